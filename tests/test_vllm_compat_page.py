"""docs/vllm-compatibility.md against the code, so the page cannot drift: every
argument of ``LLM`` and field of ``SamplingParams`` / ``StructuredOutputsParams``
is listed, the values a row calls supported are accepted, a listed argument is
never called "not supported" while the signature takes it, and what the page
calls not supported is refused."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from fastllm import LLM, SamplingParams, StructuredOutputsParams
from fastllm.config import EngineConfig

PAGE = Path(__file__).resolve().parents[1] / "docs" / "vllm-compatibility.md"
NAME = re.compile(r"`([A-Za-z_][\w.]*)")


def _table(heading: str) -> list[tuple[str, str]]:
    """The (first cell, second cell) rows of the table under ``## heading``."""
    text = PAGE.read_text()
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    rows = []
    for line in text[start : end if end > 0 else None].splitlines():
        if not line.startswith("| ") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if cells[0] in ("argument", "field", "vLLM"):
            continue
        rows.append((cells[0], cells[1]))
    return rows


def _status(cell: str) -> str:
    for status in ("not supported", "supported", "accepted"):
        if cell.startswith(status):
            return status
    return "other"


def _llm_rows() -> list[tuple[list[str], str]]:
    return [
        (NAME.findall(first), cell)
        for first, cell in _table("`LLM(...)`")
        if not first.startswith("anything else")
    ]


def test_every_llm_argument_is_listed_and_none_is_invented():
    rows = _table("`LLM(...)`")
    listed = {
        n for first, _ in rows if not first.startswith("anything else") for n in NAME.findall(first)
    }
    assert listed == set(inspect.signature(LLM.__init__).parameters) - {"self"}
    (examples,) = [NAME.findall(first) for first, _ in rows if first.startswith("anything else")]
    assert examples
    for name in examples:  # the page says: a TypeError naming the argument
        with pytest.raises(TypeError, match=name):
            LLM(**{name: 1})


def test_no_llm_argument_is_called_not_supported():
    """An argument the signature takes is at least accepted: the page names
    the values that are refused instead of calling the argument unsupported."""
    for names, cell in _llm_rows():
        assert _status(cell) in ("supported", "accepted"), (names, cell)


@pytest.mark.parametrize(
    "arg", ["quantization", "task", "tokenizer_mode", "load_format", "dtype", "kv_cache_dtype"]
)
def test_values_called_supported_are_accepted(arg):
    from fastllm.config import resolve_dtype

    (cell,) = [cell for names, cell in _llm_rows() if names == [arg]]
    head = cell.split(";")[0]
    values = [v for v in NAME.findall(head.split(":", 1)[1]) if "." not in v]
    assert values, cell
    for v in values:
        value = None if v == "None" else v
        if arg == "dtype":
            resolve_dtype(value, "cpu", None)
        else:
            EngineConfig(model="unused", **{arg: value}).validate()


def _sampling_rows() -> list[tuple[list[str], str]]:
    return [(NAME.findall(first), cell) for first, cell in _table("`SamplingParams`")]


def test_every_sampling_field_is_listed():
    listed = set()
    for names, cell in _sampling_rows():
        if _status(cell) != "not supported":
            listed |= {n for n in names if "." not in n and not n.isupper()}
    fields = {f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_")}
    methods = {n for n in listed - fields if hasattr(SamplingParams, n.split("(")[0])}
    assert listed - methods == fields


def test_structured_outputs_fields_match_the_row():
    (first,) = [
        first for first, _ in _table("`SamplingParams`") if "StructuredOutputsParams(" in first
    ]
    inner = first[first.index("StructuredOutputsParams(") :]
    names = set(re.findall(r"(\w+)=", inner))
    assert names == {f.name for f in dataclasses.fields(StructuredOutputsParams)}


def test_what_the_page_calls_not_supported_is_refused():
    for names, cell in _sampling_rows():
        if _status(cell) != "not supported":
            continue
        for n in names:
            if n.startswith("StructuredOutputsParams."):
                field = n.split(".", 1)[1]
                with pytest.raises(TypeError, match=field):
                    StructuredOutputsParams(json={"type": "object"}, **{field: True})
            else:
                with pytest.raises(TypeError, match=n):
                    SamplingParams(**{n: 1})
    for first, cell in _table("Methods and types"):
        names = [n.split(".", 1)[1] for n in NAME.findall(first) if n.startswith("LLM.")]
        for n in names:
            has = hasattr(LLM, n)
            assert has == (_status(cell) != "not supported"), (n, cell)

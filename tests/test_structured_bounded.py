"""A JSON schema whose instances are bounded always closes within a modest
``max_tokens``: a tiny random model sampling at temperature 1 (which, with
free whitespace, writes newlines until ``max_tokens``) finishes every one of
200 seeded generations with JSON that parses and validates (``jsonschema``,
an independent checker). The whitespace switches do what they say."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from fastllm import LLM, SamplingParams, StructuredOutputsParams

# Bounded schemas: short strings, bounded integers, enums, short arrays, booleans.
BOUNDED = {
    "profile": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {
                "type": "array",
                "items": {"enum": ["a", "bb", "ccc", "dddd"]},
                "maxItems": 3,
            },
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "tags", "active"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": -9, "maximum": 9},
            "owner": {
                "type": "object",
                "properties": {
                    "ok": {"type": "boolean"},
                    "nick": {"type": "string", "maxLength": 4},
                },
                "required": ["ok", "nick"],
                "additionalProperties": False,
            },
        },
        "required": ["id", "owner"],
        "additionalProperties": False,
    },
    "points": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": 0, "maximum": 99},
                "y": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 4,
    },
    "choice": {"enum": ["red", "green", "blue", None, 7]},
}
MAX_TOKENS = 200
N = 200


@pytest.fixture(scope="module")
def llm(make_model) -> LLM:
    return LLM(make_model("llama"), device="cpu", dtype="float32", max_model_len=512)


def _params(schema: dict, seed: int, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=1.0,
        seed=seed,
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(json=schema, **kw),
    )


def test_bounded_schemas_always_close(llm):
    names = sorted(BOUNDED)
    jobs = [(names[i % len(names)], i) for i in range(N)]
    params = [_params(BOUNDED[name], seed) for name, seed in jobs]
    outs = llm.generate(["# data\n"] * N, params, use_tqdm=False)
    bad = []
    for (name, seed), out in zip(jobs, outs):
        c = out.outputs[0]
        try:
            assert c.finish_reason == "stop", c.finish_reason
            jsonschema.validate(json.loads(c.text), BOUNDED[name])
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            bad.append((name, seed, repr(c.text[:80]), str(e)[:80]))
    assert not bad, f"{len(bad)} of {N} did not close: {bad[:5]}"


@pytest.mark.parametrize("seed", range(8))
def test_default_whitespace_is_one_space_after_comma_and_colon(llm, seed):
    schema = BOUNDED["profile"]
    (out,) = llm.generate(["# data\n"], _params(schema, seed), use_tqdm=False)
    text = out.outputs[0].text
    jsonschema.validate(json.loads(text), schema)
    outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    assert "\n" not in outside and "\t" not in outside and "  " not in outside
    # A space only ever follows ',' or ':'.
    assert all(outside[i - 1] in ",:" for i, ch in enumerate(outside) if ch == " ")


@pytest.mark.parametrize("seed", range(4))
def test_disable_any_whitespace_writes_none(llm, seed):
    schema = BOUNDED["nested"]
    p = _params(schema, seed, disable_any_whitespace=True)
    (out,) = llm.generate(["# data\n"], p, use_tqdm=False)
    outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', out.outputs[0].text)
    assert not re.search(r"\s", outside)
    jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_any_whitespace_allows_newlines(llm):
    """The opt-in keeps the old free whitespace: across seeds, some reply has
    whitespace the bounded default never writes (and every reply that
    closes still validates)."""
    schema = BOUNDED["nested"]
    outs = llm.generate(
        ["# data\n"] * 16,
        [_params(schema, s, any_whitespace=True) for s in range(16)],
        use_tqdm=False,
    )
    spaced = 0
    for out in outs:
        text = out.outputs[0].text
        outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
        spaced += bool(re.search(r"\n|\t|  |[\[{] ", outside))
        if out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(text), schema)
    assert spaced > 0


def test_whitespace_switches_are_checked():
    with pytest.raises(ValueError, match="any_whitespace"):
        StructuredOutputsParams(
            json={"type": "object"}, any_whitespace=True, disable_any_whitespace=True
        )
    with pytest.raises(ValueError, match="any_whitespace"):
        StructuredOutputsParams(json_object=True, any_whitespace=True, whitespace_pattern=" ?")
    with pytest.raises(ValueError, match="any_whitespace"):
        StructuredOutputsParams(json_object=True, any_whitespace="yes")

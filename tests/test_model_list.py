"""The README's and docs/models.md's lists of architectures against the registry."""

from __future__ import annotations

import os
import re

from fastllm.gguf.config import ARCHITECTURES as GGUF_ARCHITECTURES
from fastllm.gguf.config import MIXTRAL
from fastllm.models import ARCHITECTURES
from fastllm.models.llama_stack import FUSED_ARCHITECTURES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = re.compile(r"`(\w+(?:ForCausalLM|LMHeadModel|ForConditionalGeneration))`")


def _section(path: str, heading: str) -> str:
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end >= 0 else len(text)]


def test_readme_lists_exactly_the_registry() -> None:
    listed = NAME.findall(_section("README.md", "## Supported architectures"))
    assert set(listed) == set(ARCHITECTURES)


def test_docs_table_matches_registry_gguf_and_fused_stack() -> None:
    rows = {}
    for line in _section("docs/models.md", "| architecture").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = NAME.fullmatch(cells[0]) if cells else None
        if m:
            rows[m.group(1)] = cells
    assert set(rows) == set(ARCHITECTURES)
    # Mistral and Mixtral files are ``llama`` files (Mixtral's with experts).
    from_gguf = {hf for hf, _ in GGUF_ARCHITECTURES.values()} | {"MistralForCausalLM", MIXTRAL[0]}
    for arch, cells in rows.items():
        assert cells[3].startswith("yes") == (arch in from_gguf), arch
        assert cells[4].startswith("yes") == (arch in FUSED_ARCHITECTURES), arch

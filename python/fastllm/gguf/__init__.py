"""fastllm.gguf: a GGUF file as a model (reader, config, tokenizer, weights).

``LLM("model.gguf")`` reads the file once (``reader``), configures the model
from its metadata (``config``), builds the tokenizer and chat template from
its ``tokenizer.*`` keys (``tokenizer``) and loads its tensors into the
kernels as they are (``loader``). See docs/gguf.md.
"""

from __future__ import annotations

from typing import Any


def describe_tensor_types(info: dict[str, Any]) -> str:
    """``"Q8_0 x169, F32 x121"`` (and what was converted) for an engine's ``gguf`` info."""
    types = sorted(info["tensor_types"].items(), key=lambda kv: -kv[1])
    text = ", ".join(f"{k} x{n}" for k, n in types)
    converted = info.get("converted") or {}
    if converted:
        text += "; converted to q8_0: " + ", ".join(
            f"{k} x{n}" for k, n in sorted(converted.items())
        )
    return text

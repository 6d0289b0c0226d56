"""fastllm.gguf: a GGUF file as a model (reader, config, tokenizer, weights).

``LLM("model.gguf")`` reads the file once (``reader``), configures the model
from its metadata (``config``), builds the tokenizer and chat template from
its ``tokenizer.*`` keys (``tokenizer``) and loads its tensors into the
kernels as they are (``loader``). See docs/gguf.md.
"""

from __future__ import annotations

from typing import Any

from fastllm.lazy import lazy_attribute

# Public names of the package's modules, imported on first use (the reader
# and the loader pull in numpy and torch).
_LAZY = {
    "GGUFFile": "fastllm.gguf.reader",
    "GGUFError": "fastllm.gguf.reader",
    "hf_config": "fastllm.gguf.config",
    "tokenizer_from_metadata": "fastllm.gguf.tokenizer",
    "load_gguf_model": "fastllm.gguf.loader",
}


def __getattr__(name: str) -> Any:
    return lazy_attribute("fastllm.gguf", _LAZY, globals(), name)


def open_file(path: str) -> Any:
    """The GGUF file ``path``, every header, key and tensor checked. With a
    packed-weight cache for it, its pages are mapped as they are read, not
    all at once (its quantized tensors are never read then)."""
    from fastllm.gguf.cache import cache_file_exists
    from fastllm.gguf.reader import GGUFFile

    return GGUFFile(path, populate=not cache_file_exists(path))


def describe_tensor_types(info: dict[str, Any]) -> str:
    """``"Q8_0 x169, F32 x121"`` (and what was converted) for an engine's ``gguf`` info."""
    types = sorted(info["tensor_types"].items(), key=lambda kv: -kv[1])
    text = ", ".join(f"{k} x{n}" for k, n in types)
    rewritten = info.get("rewritten") or {}
    if rewritten:
        text += "; run as q4_1: " + ", ".join(f"{k} x{n}" for k, n in sorted(rewritten.items()))
    exact = info.get("exact") or {}
    if exact:
        text += "; q8_0 exactly: " + ", ".join(f"{k} x{n}" for k, n in sorted(exact.items()))
    converted = info.get("converted") or {}
    if converted:
        text += "; converted to q8_0: " + ", ".join(
            f"{k} x{n}" for k, n in sorted(converted.items())
        )
    return text


def load_tokenizer(path: str) -> Any:
    """The tokenizer of the GGUF file ``path`` (its header only is read)."""
    from fastllm.gguf.reader import GGUFFile
    from fastllm.gguf.tokenizer import tokenizer_from_metadata

    with GGUFFile(path, populate=False) as g:
        return tokenizer_from_metadata(g.metadata, path)


def weight_bytes_per_token(path: str) -> int:
    """Bytes of weights one decode step reads from the GGUF file ``path``: every
    matrix once, as stored; of a stack of experts' matrices, the share of the
    experts each token uses; the token embedding only when it is also the head."""
    from fastllm.gguf.reader import GGUFFile

    with GGUFFile(path, populate=False) as g:
        tied = "output.weight" not in g.tensors
        skip = {"position_embd.weight"} | (set() if tied else {"token_embd.weight"})
        arch = g.get("general.architecture")
        used, experts = g.get(f"{arch}.expert_used_count"), g.get(f"{arch}.expert_count")
        total = 0
        for t in g.tensors.values():
            if t.name in skip:
                continue
            if len(t.shape) == 2:
                total += t.nbytes
            elif len(t.shape) == 3 and isinstance(used, int) and isinstance(experts, int):
                total += t.nbytes * min(used, experts) // max(experts, 1)
        return total


def describe_file(path: str) -> str:
    """One paragraph about a GGUF file for ``fastllm env --model``: architecture,
    tensor types and how fastllm runs each."""
    from fastllm.gguf.loader import (
        CONVERSION_FORMAT,
        EXACT_TYPES,
        FLOAT_TYPES,
        KERNEL_TYPES,
        REWRITTEN_TYPES,
    )
    from fastllm.gguf.reader import GGUFFile

    with GGUFFile(path, populate=False) as g:
        counts: dict[str, int] = {}
        for t in g.tensors.values():
            counts[t.type.name] = counts.get(t.type.name, 0) + 1
        arch = g.get("general.architecture", "?")
        name = g.get("general.name")
        lines = [f"Model: {path} (GGUF v{g.version}, {arch}{', ' + name if name else ''})"]
    for kind, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        if kind in FLOAT_TYPES:
            how = "float"
        elif kind in KERNEL_TYPES:
            how = f"{KERNEL_TYPES[kind]} kernel, as stored"
        elif kind in REWRITTEN_TYPES:
            how = f"{REWRITTEN_TYPES[kind]} kernel: scales and minimums rounded to f16 at load"
        elif kind in EXACT_TYPES:
            how = f"no kernel: converted to {CONVERSION_FORMAT} exactly at load"
        else:
            how = f"no kernel: converted to {CONVERSION_FORMAT} at load (rounded)"
        lines.append(f"  {kind} x{n}: {how}")
    return "\n".join(lines)

"""Configuration: the engine's settings and the dtype rules of DESIGN.md."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("fastllm")


@dataclass
class EngineConfig:
    """Every setting of an LLM, as passed to ``LLM(...)`` (vLLM's names)."""

    model: str
    tokenizer: str | None = None
    dtype: Any = "auto"
    device: str = "auto"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    seed: int = 0
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None
    load_format: str = "auto"

    def validate(self) -> None:
        """Checks every field, naming the field in the error."""

        def positive(name: str) -> None:
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

        for name in ("tensor_parallel_size", "block_size", "max_num_seqs"):
            positive(name)
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            positive(name)
        if self.block_size > 1024:
            raise ValueError(f"block_size must be at most 1024, got {self.block_size}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(
                f"load_format must be one of 'auto', 'safetensors', 'dummy', got {self.load_format!r}"
            )


_DTYPE_NAMES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU (and OS) runs bfloat16 natively (AVX512-BF16 or AMX-BF16)."""
    from fastllm import _core

    feats = _core.cpu_features()
    return bool(feats.get("avx512_bf16") or feats.get("amx_bf16"))


def resolve_dtype(dtype: Any, device: str, config_dtype: str | None) -> Any:
    """The torch dtype to run in, following DESIGN.md's rules per device."""
    import torch

    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        if dtype != "auto" and dtype not in _DTYPE_NAMES:
            raise ValueError(
                f"dtype must be 'auto' or one of {sorted(_DTYPE_NAMES)}, got {dtype!r}"
            )
        name = _DTYPE_NAMES.get(dtype, "auto")
    else:
        raise ValueError(f"dtype must be a string or torch.dtype, got {dtype!r}")
    if name not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"dtype {name} is not supported; use float32, bfloat16 or float16")
    if device == "cpu":
        if name == "auto":
            name = "bfloat16" if cpu_has_native_bf16() else "float32"
        elif name == "float16":
            logger.warning("float16 is not served on the CPU; using bfloat16 instead")
            name = "bfloat16"
    elif name == "auto":
        cfg = _DTYPE_NAMES.get(config_dtype or "", None)
        name = cfg if cfg in ("bfloat16", "float16") else "bfloat16"
    return getattr(torch, name)

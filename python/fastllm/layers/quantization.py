"""Quantized weights on the CPU: ``LLM(model, quantization="int8" | "int4")``.

At load, every linear layer, the language-model head and the token embedding
are quantized from the float weights (round to nearest, no calibration data)
into the Rust core's integer kernels (``_core.QuantizedLinear``), and the
float weights are freed. The formats carry the numbers of GGUF's blocks:
groups of 32 input features with one scale each.

- ``"int8"`` is ``"q8_0"``: symmetric int8.
- ``"int4"`` is ``"q4_0"``: symmetric 4-bit, which measured the smaller
  perplexity loss of the two 4-bit formats on the trained demo model
  (``benches/quant_quality.py``: +0.8% against +1.3% for ``"iq4_nl"``, whose
  non-linear levels fit the weights more closely by RMS and by KL divergence
  but lose more perplexity; see docs/quantization.md).
- ``"q8_0"``, ``"q4_0"``, ``"iq4_nl"`` and ``"q4_1"`` (4-bit with a minimum
  per group: GGUF's Q4_1, and the form GGUF's Q4_K tensors run in) name a
  format directly.

A tied embedding reads its rows from the quantized head; an untied one is
quantized to the same format and looked up row by row.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from fastllm import _core

logger = logging.getLogger("fastllm")

# The names ``quantization`` accepts, and the kernel format each one runs.
QUANTIZATION_FORMATS: dict[str, str] = {
    "int8": "q8_0",
    "int4": "q4_0",
    "q8_0": "q8_0",
    "q4_0": "q4_0",
    "iq4_nl": "iq4_nl",
    "q4_1": "q4_1",
}

# Bytes per weight of each format: 32 weights and one f16 scale a group.
BYTES_PER_WEIGHT: dict[str, float] = {
    "q8_0": 34 / 32,
    "q4_0": 18 / 32,
    "iq4_nl": 18 / 32,
    "q4_1": 20 / 32,  # a scale and a minimum per group
}


def resolve_quantization(name: str | None) -> str | None:
    """The kernel format of ``quantization=name`` (None: float weights); a
    ValueError naming the valid values for anything else."""
    if name is None:
        return None
    key = name.strip().lower() if isinstance(name, str) else None
    if key in ("", "none", "gguf"):
        return None  # "gguf" (vLLM's name): a GGUF file's own tensor types
    fmt = QUANTIZATION_FORMATS.get(key)
    if fmt is None:
        valid = ", ".join(repr(k) for k in QUANTIZATION_FORMATS)
        raise ValueError(
            f"quantization={name!r} is not supported; expected None, {valid} "
            "(or 'gguf' for a GGUF file's own types)"
        )
    return fmt


def describe(name: str | None) -> str:
    """``quantization`` as shown to users: ``"int8 (q8_0)"``, ``"q4_0"``, ``"none"``."""
    fmt = resolve_quantization(name)
    if fmt is None:
        return "none"
    key = name.strip().lower()
    return fmt if key == fmt else f"{key} ({fmt})"


def _kernel_input(t: torch.Tensor) -> torch.Tensor:
    """A weight as the quantizer reads it: bf16 or f32, contiguous, on the CPU."""
    t = t.detach()
    if t.dtype not in (torch.bfloat16, torch.float32):
        t = t.float()
    return t.contiguous()


def quantize_model(model: nn.Module, fmt: str, vocab_size: int) -> int:
    """Quantizes every ``Linear`` of ``model``, its head and its token
    embedding (the ``Embedding`` of ``vocab_size`` rows) to ``fmt``; frees the
    float weights and returns the bytes of quantized weights."""
    from fastllm.layers.linear import Embedding, pack_linears

    head_weight, _ = model.head_weights()

    def make(weight: torch.Tensor, bias: torch.Tensor | None):
        b = None if bias is None else _kernel_input(bias)
        return _core.QuantizedLinear(_kernel_input(weight), b, format=fmt)

    total = pack_linears(model, make)
    head = model.packed_head
    for module in model.modules():
        if isinstance(module, Embedding) and module.weight is not None:
            if module.weight is head_weight:
                module.quantize(head)
            elif module.weight.shape[0] == vocab_size:
                module.quantize(make(module.weight, None))
                total += module.quantized.nbytes
    logger.info("quantized %.1f MB of weights to %s for the %s kernel", total / 1e6, fmt, head.path)
    return total

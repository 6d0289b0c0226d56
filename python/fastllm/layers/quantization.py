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
- ``"q8_0"``, ``"q4_0"``, ``"iq4_nl"``, ``"q4_1"`` (4-bit with a minimum
  per group: GGUF's Q4_1, and the form GGUF's Q4_K tensors run in) and
  ``"mxfp4"`` (OCP MXFP4: E2M1 codes with a power-of-two scale per group, the
  format of gpt-oss's experts) name a format directly.

A tied embedding reads its rows from the quantized head; an untied one is
quantized to the same format and looked up row by row.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from fastllm import _core
from fastllm.models.weights import PackedBlocks

logger = logging.getLogger("fastllm")

# The names ``quantization`` accepts, and the kernel format each one runs.
QUANTIZATION_FORMATS: dict[str, str] = {
    "int8": "q8_0",
    "int4": "q4_0",
    "q8_0": "q8_0",
    "q4_0": "q4_0",
    "iq4_nl": "iq4_nl",
    "q4_1": "q4_1",
    "mxfp4": "mxfp4",
}

# Bytes per weight of each format: 32 weights and one f16 scale a group.
BYTES_PER_WEIGHT: dict[str, float] = {
    "q8_0": 34 / 32,
    "q4_0": 18 / 32,
    "iq4_nl": 18 / 32,
    "q4_1": 20 / 32,  # a scale and a minimum per group
    "mxfp4": 18 / 32,  # its exponent byte held as an f16 scale in memory
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


def quantizer(fmt: str):
    """``make(weight, bias)``: the ``_core.QuantizedLinear`` of a float
    weight (and bias) in ``fmt``."""

    def make(weight: torch.Tensor, bias: torch.Tensor | None):
        b = None if bias is None else _kernel_input(bias)
        return _core.QuantizedLinear(_kernel_input(weight), b, format=fmt)

    return make


def quantize_model(model: nn.Module, fmt: str, vocab_size: int) -> int:
    """Quantizes every ``Linear`` of ``model``, its head and its token
    embedding (the ``Embedding`` of ``vocab_size`` rows) to ``fmt``; frees the
    float weights and returns the bytes of quantized weights (those the
    loader already quantized as it read them included: ``StreamingQuantizer``)."""
    from fastllm.layers.linear import Embedding, pack_linears

    head_weight, _ = model.head_weights()
    make = quantizer(fmt)
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


class StreamingQuantizer:
    """Quantizes a model's linear layers while the loader reads them, so a
    folder loaded with ``quantization=`` never holds all its float weights at
    once (a Qwen3-30B-A3B folder in bf16 is 61 GB; quantized to int4 it is
    17): each ``Linear`` weight read from the checkpoint (with its bias,
    which comes right after it) becomes a ``_core.QuantizedLinear`` at once
    and its float copy is dropped. Nothing is assigned to the model until
    the loader has read everything (``adopt``); the head (``lm_head``, or
    whichever layer ``head_weights`` names: an encoder's last) and the
    embeddings are left to ``quantize_model``, which packs what is left.

    A weight the checkpoint stores quantized (``PackedBlocks``: gpt-oss's
    MXFP4 experts) is adopted as stored, whatever ``fmt``; with ``fmt``
    None the float weights go to the model as they are."""

    def __init__(self, model: nn.Module, fmt: str | None) -> None:
        from fastllm.layers.linear import Linear

        self.make = quantizer(fmt) if fmt is not None else None
        head_weight, _ = model.head_weights()
        self.linears = {
            name: m
            for name, m in model.named_modules()
            if isinstance(m, Linear) and name != "lm_head" and m.weight is not head_weight
        }
        self.pending: dict[str, Any] = {}  # a weight waiting for its bias
        self.packed: dict[str, object] = {}

    def offer(self, pname: str, tensor: Any, state: dict[str, torch.Tensor]) -> None:
        """Takes parameter ``pname`` as read: a linear layer's weight is
        quantized (once its bias, if any, has come too); anything else goes
        into ``state`` for the model."""
        module, _, kind = pname.rpartition(".")
        linear = self.linears.get(module)
        stored = isinstance(tensor, PackedBlocks)
        if linear is None or kind not in ("weight", "bias"):
            state[pname] = tensor
        elif kind == "weight" and self.make is None and not stored:
            state[pname] = tensor  # float weights stay float
        elif kind == "weight" and linear.bias is not None:
            self.pending[module] = tensor
        elif kind == "weight":
            self.packed[module] = self._make(tensor, None)
        else:
            state[pname] = tensor  # the module keeps its bias, as pack() does
            if module in self.pending:
                self.packed[module] = self._make(self.pending.pop(module), tensor)

    def _make(self, weight: Any, bias: torch.Tensor | None) -> object:
        if isinstance(weight, PackedBlocks):
            b = None if bias is None else bias.float().contiguous()
            return _core.QuantizedLinear.from_blocks(
                weight.blocks, weight.out_features, weight.in_features, weight.format, b
            )
        assert self.make is not None
        return self.make(weight, bias)

    def adopt(self, model: nn.Module) -> None:
        """Hands each quantized matrix to its layer (the float weight was never assigned)."""
        if self.pending:
            raise RuntimeError(f"linear weights without their bias: {sorted(self.pending)}")
        for name, packed in self.packed.items():
            self.linears[name].pack(packed)

    def consumed(self) -> set[str]:
        """The parameters ``adopt`` stands for (left out of the model's state)."""
        return {f"{name}.weight" for name in self.packed}

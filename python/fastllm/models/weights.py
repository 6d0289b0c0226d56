"""How a model's parameters are found in a Hugging Face checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WeightSpec:
    """Checkpoint tensors that make up one parameter.

    ``sources`` are concatenated along dim 0 (fused q/k/v or gate/up); ``splits``
    gives each source's size along that dim. ``transpose`` marks GPT-2's
    ``Conv1D`` weights, stored as [in, out] instead of [out, in]. ``offset``
    is added to the stored values in float32 before the cast to the model's
    dtype (Gemma's norms store ``w`` and scale by ``1 + w``).

    Mixture-of-experts checkpoints may stack every expert in one tensor
    ``[experts, ...]``: ``select`` reads row ``select`` of it (and only that
    row), before ``transpose``; ``deinterleave`` then puts the even rows
    before the odd ones (gpt-oss stores gate and up interleaved). Where a
    family's checkpoints come in several layouts, ``alternatives`` are tried
    in order when a source of this spec is missing or misshapen.

    ``mxfp4``: the weight is stored quantized in OCP MXFP4 as gpt-oss's
    checkpoints keep their experts: ``sources`` are its blocks (uint8 [out,
    in / 32, 16], two E2M1 codes a byte, the even input in the low nibble)
    and its scales (uint8 [out, in / 32], E8M0 exponents); the loader hands
    the layer those very weights (``PackedBlocks``), never a float copy.
    """

    sources: tuple[str, ...]
    splits: tuple[int, ...] | None = None
    transpose: bool = False
    offset: float = 0.0
    select: int | None = None
    deinterleave: bool = False
    alternatives: tuple[WeightSpec, ...] = ()
    mxfp4: bool = False

    def source_shapes(self, param_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The shape each source tensor must have in the checkpoint."""
        if self.mxfp4:
            out, k = param_shape
            return [(out, -(-k // 32), 16), (out, -(-k // 32))]
        if len(self.sources) == 1:
            shapes = [tuple(param_shape)]
        else:
            if self.splits is None or len(self.splits) != len(self.sources):
                raise ValueError(f"WeightSpec {self.sources} needs one split size per source")
            shapes = [(n, *param_shape[1:]) for n in self.splits]
        if self.transpose:
            shapes = [tuple(reversed(s)) for s in shapes]
        return shapes


@dataclass(frozen=True)
class PackedBlocks:
    """A weight read as stored quantized (``WeightSpec.mxfp4``): ``blocks``
    uint8 [out_features, in_features / 32 x block bytes] in GGUF's block layout
    of ``format``, which ``_core.QuantizedLinear.from_blocks`` adopts."""

    format: str
    blocks: torch.Tensor
    out_features: int
    in_features: int


def mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss's MXFP4 weights (``blocks`` uint8 [rows, groups, 16]: codes 2i
    and 2i + 1 of a group in byte i's low and high nibble; ``scales`` uint8
    [rows, groups]: E8M0 exponents) as GGUF ``MXFP4`` blocks [rows, groups x
    17]: the exponent byte (the same: a code's E2M1 value times 2^(e - 127) is
    GGUF's doubled level times 2^(e - 128)), then codes i and 16 + i in byte
    i's low and high nibble (``_core.mxfp4_from_pairs``, one pass)."""
    from fastllm import _core

    rows, groups = scales.shape
    out = torch.empty(rows, groups * 17, dtype=torch.uint8)
    _core.mxfp4_from_pairs(blocks.contiguous(), scales.contiguous(), out)
    return out

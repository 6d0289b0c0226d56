"""How a model's parameters are found in a Hugging Face checkpoint."""

from __future__ import annotations

from dataclasses import dataclass


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
    """

    sources: tuple[str, ...]
    splits: tuple[int, ...] | None = None
    transpose: bool = False
    offset: float = 0.0
    select: int | None = None
    deinterleave: bool = False
    alternatives: tuple[WeightSpec, ...] = ()

    def source_shapes(self, param_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The shape each source tensor must have in the checkpoint."""
        if len(self.sources) == 1:
            shapes = [tuple(param_shape)]
        else:
            if self.splits is None or len(self.splits) != len(self.sources):
                raise ValueError(f"WeightSpec {self.sources} needs one split size per source")
            shapes = [(n, *param_shape[1:]) for n in self.splits]
        if self.transpose:
            shapes = [tuple(reversed(s)) for s in shapes]
        return shapes

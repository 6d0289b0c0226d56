"""``PoolingParams``: vLLM's parameters of a pooling request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingParams:
    """How one pooling request's output is shaped (vLLM's names).

    ``dimensions``: keep the first N dimensions of the embedding (Matryoshka
    truncation; only where the model declares it, or any N up to the
    model's size when it declares nothing — vLLM's rule is that the model
    must support it, so an undeclared model is an error). ``normalize``:
    L2-normalise the embedding (None: the model's default, its
    sentence-transformers ``Normalize`` module). ``activation``: apply the
    classifier's activation to classification and score outputs (sigmoid
    for one label, softmax for several; None: yes).
    """

    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("dimensions", "truncate_prompt_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(
                    f"PoolingParams.{name} must be None or a positive integer, got {v!r}"
                )
        for name in ("normalize", "activation"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"PoolingParams.{name} must be None or a bool, got {v!r}")

"""Activation functions named as in Hugging Face configs."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from fastllm.layers import Module
from fastllm.layers.ops import TORCH_OPS


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "relu": F.relu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation called ``name`` in a config (``hidden_act``/``activation_function``)."""
    fn = _ACTIVATIONS.get(name)
    if fn is None:
        raise ValueError(
            f"unsupported activation {name!r}; supported: {', '.join(sorted(_ACTIVATIONS))}"
        )
    return fn


class ActAndMul(Module):
    """Gated MLP activation: ``act(x[..., :d]) * x[..., d:]`` for a fused gate/up output."""

    def __init__(self, name: str = "silu") -> None:
        super().__init__()
        self.act = get_activation(name)
        self.fused_silu = self.act is F.silu
        #: GeGLU (tanh GELU: Gemma), run as one op of the model's table.
        self.fused_gelu_tanh = self.act is _gelu_tanh
        self.ops = TORCH_OPS  # the model's op table (``layers/ops.py``), bound at load

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the gate to the first half and multiplies by the second half."""
        if self.fused_silu:
            return self.ops.silu_and_mul(x)
        if self.fused_gelu_tanh:
            return self.ops.gelu_tanh_and_mul(x)
        d = x.shape[-1] // 2
        return self.act(x[..., :d]) * x[..., d:]

"""Activation functions named as in Hugging Face configs."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from fastllm.layers import CPU_KERNEL_DTYPES


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


class ActAndMul(torch.nn.Module):
    """Gated MLP activation: ``act(x[..., :d]) * x[..., d:]`` for a fused gate/up output."""

    def __init__(self, name: str = "silu") -> None:
        super().__init__()
        self.act = get_activation(name)
        self.fused_silu = self.act is F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the gate to the first half and multiplies by the second half."""
        if self.fused_silu and x.is_cuda:
            from fastllm.layers import cuda_ops

            if cuda_ops.enabled():
                out = cuda_ops.silu_and_mul(x)
                if out is not None:
                    return out
        d = x.shape[-1] // 2
        if self.fused_silu and x.device.type == "cpu" and x.dtype in CPU_KERNEL_DTYPES:
            from fastllm import _core

            rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, 2 * d).contiguous()
            out = torch.empty(rows.shape[0], d, dtype=x.dtype)
            _core.silu_and_mul(out, rows)
            return out if rows is x else out.view(*x.shape[:-1], d)
        return self.act(x[..., :d]) * x[..., d:]

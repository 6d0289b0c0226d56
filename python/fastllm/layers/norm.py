"""Normalisation layers: RMSNorm (Llama family) and LayerNorm (Phi, GPT-2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastllm.layers import CPU_KERNEL_DTYPES


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled by a learned weight."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalises the last dimension of ``x``."""
        if x.is_cuda and self.weight.dtype == x.dtype:
            from fastllm.layers import cuda_ops

            if cuda_ops.enabled():
                out = cuda_ops.rms_norm(x, self.weight, self.eps)
                if out is not None:
                    return out
        if x.device.type == "cpu" and x.dtype in CPU_KERNEL_DTYPES and self.weight.dtype == x.dtype:
            from fastllm import _core

            rows = (
                x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()
            )
            out = torch.empty_like(rows)
            _core.rms_norm(out, rows, self.weight, self.eps)
            return out if rows is x else out.view(x.shape)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # Multiplying after the cast back matches the reference models' rounding.
        return self.weight * xf.to(dtype)


class LayerNorm(nn.Module):
    """Layer norm with a learned weight and bias."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalises the last dimension of ``x``."""
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

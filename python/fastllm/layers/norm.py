"""Normalisation layers: RMSNorm (Llama family) and LayerNorm (Phi, GPT-2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastllm.layers import Module
from fastllm.layers.ops import TORCH_OPS


class RMSNorm(Module):
    """Root-mean-square norm computed in float32, scaled by a learned weight."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.ops = TORCH_OPS  # the model's op table (``layers/ops.py``), bound at load

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalises the last dimension of ``x``."""
        return self.ops.rms_norm(x, self.weight, self.eps)


class ZeroCenteredRMSNorm(Module):
    """RMSNorm scaled by ``1 + w`` where the checkpoint stores ``w`` (Qwen3.5),
    rounded as the reference rounds it: normalised and scaled in float32
    (``1 + w`` in float32 too), then cast to x's dtype once."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.ops = TORCH_OPS  # the model's op table (``layers/ops.py``), bound at load
        self._scale: torch.Tensor | None = None  # 1 + w in float32, made on first use

    def scale(self) -> torch.Tensor:
        """``1 + w`` in float32 (made once; the fused CPU stack reads it too)."""
        if self._scale is None:
            self._scale = 1.0 + self.weight.detach().float()
        return self._scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalises the last dimension of ``x``."""
        return self.ops.rms_norm(x.float(), self.scale(), self.eps).to(x.dtype)


class LayerNorm(Module):
    """Layer norm with a learned weight and bias."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalises the last dimension of ``x``."""
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

"""Linear and embedding layers whose parameters start uninitialised.

The loader always assigns every parameter, so initialising them here would only
cost time (seconds for a 7B model) and memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight`` of shape [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the affine map to the last dimension of ``x``."""
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Token (or position) embedding table of shape [num_embeddings, dim]."""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Looks up the rows ``ids``."""
        return F.embedding(ids, self.weight)

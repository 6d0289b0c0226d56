"""Linear and embedding layers whose parameters start uninitialised.

The loader always assigns every parameter, so initialising them here would only
cost time (seconds for a 7B model) and memory.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

_RUST_DTYPES = (torch.float32, torch.bfloat16)


def _env_rows(name: str, default: int) -> int:
    try:
        return max(0, int(os.environ.get(name, str(default))))
    except ValueError:
        return default


# Row counts for which linears use the Rust weight-streaming kernel instead of
# torch (FASTLLM_RUST_LINEAR_MIN_ROWS..FASTLLM_RUST_LINEAR_MAX_ROWS). Off by
# default: measured in the whole model on a 2-core AVX512-BF16 machine,
# alternating torch's OpenMP threads with the Rust pool between operations
# cost more than the kernel gains on its own, at batch 1 as at batch 64
# (docs/performance.md has the figures).
_MIN_ROWS = _env_rows("FASTLLM_RUST_LINEAR_MIN_ROWS", 1)
_MAX_ROWS = _env_rows("FASTLLM_RUST_LINEAR_MAX_ROWS", 0)
_RUST_ON = _MAX_ROWS >= max(1, _MIN_ROWS)
_core = None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``: the Rust weight-streaming kernel for few rows on the
    CPU (decode), torch otherwise (prefill, other devices)."""
    global _core
    if (
        _RUST_ON
        and x.device.type == "cpu"
        and x.dim() == 2
        and max(1, _MIN_ROWS) <= x.shape[0] <= _MAX_ROWS
        and x.dtype in _RUST_DTYPES
        and weight.dtype == x.dtype
        and (bias is None or bias.dtype == x.dtype)
    ):
        if _core is None:
            from fastllm import _core as core

            _core = core
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
        _core.linear(out, x.contiguous(), weight, bias)
        return out
    return F.linear(x, weight, bias)


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
        return linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Token (or position) embedding table of shape [num_embeddings, dim]."""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Looks up the rows ``ids``."""
        return F.embedding(ids, self.weight)

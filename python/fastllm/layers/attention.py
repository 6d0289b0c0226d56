"""Paged attention: write the step's K/V into the block cache, attend over it.

The backend is the model's op table (``layers/ops.py``), chosen once at load:
the Rust kernels on the CPU (``_core.reshape_and_cache`` / ``paged_attention``,
reading the torch tensors in place), the NVRTC kernels of ``kernels/`` on CUDA,
or plain torch (``attention_torch.py``), all with the same contract.

The cache layout is ``[num_blocks, num_kv_heads, block_size, head_size]`` and
slot ``s`` is block ``s // block_size``, offset ``s % block_size``.
"""

from __future__ import annotations

import torch

from fastllm.forward_context import get_context
from fastllm.layers import Module, attention_torch
from fastllm.layers.ops import TORCH_OPS


class PagedAttention(Module):
    """Attention of the step's new tokens over their sequences' paged KV cache."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
        if logit_softcap is not None and not logit_softcap > 0:
            raise ValueError(f"logit_softcap must be positive or None, got {logit_softcap}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        #: Gemma 2's soft-cap of the scaled scores: ``c * tanh(s / c)`` (None: none).
        self.logit_softcap = logit_softcap
        #: gpt-oss's attention sinks: float32 ``[num_heads]`` on the caches'
        #: device (contiguous), set by the model after its weights load (None:
        #: none). Head ``h``'s ``sinks[h]`` joins the softmax denominator as one
        #: more score with no value row (``-inf``: none for that head); every
        #: backend honours it, the fused CPU decoder stack does not
        #: (``llama_stack.why_not``).
        self.sinks: torch.Tensor | None = None
        # Assigned by the model runner: [num_blocks, num_kv_heads, block_size, head_size],
        # and the layer group whose block table this layer reads (``KVLayout``).
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.kv_group = 0
        self.ops = TORCH_OPS  # the model's op table (``layers/ops.py``), bound at load

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, heads*head], k/v [T, kv_heads*head] -> [T, heads*head]."""
        meta = get_context()
        num_tokens = q.shape[0]
        q = q.reshape(num_tokens, self.num_heads, self.head_size)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_size)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_size)
        if self.k_cache is None or self.v_cache is None:
            out = attention_torch.attend_uncached(self, q, k, v, meta)
        else:
            out = self.ops.attention(self, q, k, v, meta)
        return out.reshape(num_tokens, self.num_heads * self.head_size)

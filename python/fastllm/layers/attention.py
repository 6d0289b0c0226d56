"""Paged attention: write the step's K/V into the block cache, attend over it.

Two backends, chosen per call from the tensors' device:

* CPU with the Rust kernels present (``fastllm._core.paged_attention``): the
  cache write and the attention run in Rust, reading the torch tensors in place.
* CUDA: the NVRTC-compiled kernels of ``kernels/`` (``layers/cuda_ops.py``),
  with the same contract;
* otherwise (or when the CUDA kernels cannot be compiled or launched, which
  warns once): plain torch, gathering each sequence's K/V through its block
  table and calling ``scaled_dot_product_attention``.

The cache layout is ``[num_blocks, num_kv_heads, block_size, head_size]`` and
slot ``s`` is block ``s // block_size``, offset ``s % block_size``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from fastllm.engine.context import AttentionMetadata, get_context
from fastllm.layers import CPU_KERNEL_DTYPES

_core_module: ModuleType | None | bool = False  # False: not looked up yet


def _rust_core() -> ModuleType | None:
    """``fastllm._core`` when it has the paged-attention kernels, else None."""
    global _core_module
    if _core_module is False:
        try:
            core = importlib.import_module("fastllm._core")
        except ImportError:
            core = None
        if core is not None and not (
            hasattr(core, "paged_attention") and hasattr(core, "reshape_and_cache")
        ):
            core = None
        _core_module = core
    return _core_module  # type: ignore[return-value]


class PagedAttention(nn.Module):
    """Attention of the step's new tokens over their sequences' paged KV cache."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        # Assigned by the model runner: [num_blocks, num_kv_heads, block_size, head_size].
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, heads*head], k/v [T, kv_heads*head] -> [T, heads*head]."""
        meta = get_context()
        num_tokens = q.shape[0]
        q = q.reshape(num_tokens, self.num_heads, self.head_size)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_size)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_size)
        if self.k_cache is None or self.v_cache is None:
            out = self._attend_uncached(q, k, v, meta)
        elif q.device.type == "cpu" and q.dtype in CPU_KERNEL_DTYPES and _rust_core() is not None:
            out = self._attend_rust(q, k, v, meta)
        else:
            cuda_out = self._attend_cuda(q, k, v, meta) if q.device.type == "cuda" else None
            out = cuda_out if cuda_out is not None else self._attend_torch(q, k, v, meta)
        return out.reshape(num_tokens, self.num_heads * self.head_size)

    # ---- Rust CPU kernels ----

    def _attend_rust(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        core = _rust_core()
        assert core is not None and self.k_cache is not None and self.v_cache is not None
        core.reshape_and_cache(
            k.contiguous(), v.contiguous(), self.k_cache, self.v_cache, meta.slot_mapping
        )
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        core.paged_attention(
            out,
            q.contiguous(),
            self.k_cache,
            self.v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
            self.sliding_window or 0,
        )
        return out

    # ---- CUDA kernels ----

    def _attend_cuda(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """The NVRTC kernels; None when they are off (the caller falls back to torch)."""
        from fastllm.layers import cuda_ops

        k_cache, v_cache = self.k_cache, self.v_cache
        assert k_cache is not None and v_cache is not None
        if not cuda_ops.enabled() or q.dtype != k_cache.dtype:
            return None
        if not cuda_ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping):
            return None
        return cuda_ops.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
            self.sliding_window or 0,
        )

    # ---- plain torch ----

    def _attend_torch(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        k_cache, v_cache = self.k_cache, self.v_cache
        assert k_cache is not None and v_cache is not None
        block_size = k_cache.shape[2]
        slots = meta.slot_mapping.to(torch.long)
        blocks, offsets = slots // block_size, slots % block_size
        # Advanced indices around a slice put the token dim first: [T, kv_heads, head].
        k_cache[blocks, :, offsets] = k.to(k_cache.dtype)
        v_cache[blocks, :, offsets] = v.to(v_cache.dtype)
        if meta.max_query_len == 1 and q.shape[0] == meta.seq_lens.shape[0]:
            return self._decode_torch(q, meta)
        return self._prefill_torch(q, meta)

    def _gather(self, cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
        """One sequence's first ``length`` cached rows as [kv_heads, length, head]."""
        block_size = cache.shape[2]
        num_blocks = (length + block_size - 1) // block_size
        rows = cache[block_table[:num_blocks].to(torch.long)]  # [nb, kvh, bs, hd]
        rows = rows.transpose(0, 1).reshape(self.num_kv_heads, num_blocks * block_size, -1)
        return rows[:, :length]

    def _decode_torch(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One query token per sequence: the whole batch in one padded SDPA call."""
        k_cache, v_cache = self.k_cache, self.v_cache
        assert k_cache is not None and v_cache is not None
        num_seqs = q.shape[0]
        block_size = k_cache.shape[2]
        max_blocks = (meta.max_seq_len + block_size - 1) // block_size
        tables = meta.block_tables[:, :max_blocks].to(torch.long)  # [S, nb]
        length = max_blocks * block_size

        def gather(cache: torch.Tensor) -> torch.Tensor:
            rows = cache[tables]  # [S, nb, kvh, bs, hd]
            return rows.transpose(1, 2).reshape(num_seqs, self.num_kv_heads, length, -1)

        seq_lens = meta.seq_lens.to(device=q.device, dtype=torch.long).unsqueeze(1)  # [S, 1]
        j = torch.arange(length, device=q.device).unsqueeze(0)  # [1, L]
        mask = j < seq_lens
        if self.sliding_window:
            mask &= j > seq_lens - 1 - self.sliding_window
        # Slots past a sequence's end hold whatever the cache had (maybe NaN), and a
        # masked NaN still poisons the weighted sum: zero them.
        keep = mask[:, None, :, None]
        keys = torch.where(keep, gather(k_cache), 0)
        values = torch.where(keep, gather(v_cache), 0)
        out = self._sdpa(q.unsqueeze(2), keys, values, mask[:, None, None, :])  # [S, H, 1, hd]
        return out.squeeze(2)

    def _prefill_torch(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Sequence by sequence: new tokens attend to their cached prefix and causally."""
        k_cache, v_cache = self.k_cache, self.v_cache
        assert k_cache is not None and v_cache is not None
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        for i, seq_len in enumerate(seq_lens):
            start, end = starts[i], starts[i + 1]
            if end == start:
                continue
            keys = self._gather(k_cache, meta.block_tables[i], seq_len)
            values = self._gather(v_cache, meta.block_tables[i], seq_len)
            mask = self._mask(end - start, seq_len, q.device)
            qi = q[start:end].transpose(0, 1)  # [H, n, hd]
            out[start:end] = self._sdpa(qi, keys, values, mask).transpose(0, 1)
        return out

    def _attend_uncached(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """No cache assigned yet (e.g. a memory-profiling run): prompts attend to themselves."""
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        for i, seq_len in enumerate(seq_lens):
            start, end = starts[i], starts[i + 1]
            if end - start != seq_len:
                raise RuntimeError(
                    "attention without a KV cache can only run whole prompts "
                    f"(sequence {i}: {end - start} new tokens of {seq_len})"
                )
            mask = self._mask(seq_len, seq_len, q.device)
            out[start:end] = self._sdpa(
                q[start:end].transpose(0, 1),
                k[start:end].transpose(0, 1),
                v[start:end].transpose(0, 1),
                mask,
            ).transpose(0, 1)
        return out

    def _mask(self, num_queries: int, seq_len: int, device: torch.device) -> torch.Tensor:
        """[num_queries, seq_len] bool: query i (position seq_len - n + i) sees keys (p - w, p]."""
        p = torch.arange(seq_len - num_queries, seq_len, device=device).unsqueeze(1)
        j = torch.arange(seq_len, device=device).unsqueeze(0)
        mask = j <= p
        if self.sliding_window:
            mask &= j > p - self.sliding_window
        return mask

    def _sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """SDPA with grouped-query heads: q [..., H, n, hd], k/v [..., KVH, L, hd]."""
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=-3)
            v = v.repeat_interleave(groups, dim=-3)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)

"""Paged attention in plain torch: the reference backend of ``PagedAttention``.

Writes the step's K/V into their cache slots by advanced indexing, gathers
each sequence's K/V through its block table and calls
``scaled_dot_product_attention`` (the scores written out where the layer
soft-caps them or has attention sinks). Runs on any device; the Rust and CUDA
kernels have the same contract (``layers/ops.py``).

An 8-bit cache (``kv_cache_dtype="int8"``, an int8 tensor whose last
dimension is ``head_size + 4``) keeps each (token, KV head) row as
``head_size`` int8 values and the row's float32 scale in 4 bytes:
``scale = max|x| / 127``, ``q = round_half_even(x / scale)`` in float32.
``quantize_rows`` / ``dequantize_rows`` are the reference of that format; the
Rust kernels store and read the same bytes (``rust/attention/rows.rs``).
Against an 8-bit cache the query rows are quantized the same way (per query
head, before the score scale), so that the scores are products of bytes: the
Rust kernel computes them as integer dot products (``quantized_queries``).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from fastllm.forward_context import AttentionMetadata


class PagedLayer(Protocol):
    """What the attention functions read of a ``PagedAttention`` layer."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None
    logit_softcap: float | None
    sinks: torch.Tensor | None
    kv_group: int
    k_cache: torch.Tensor | None
    v_cache: torch.Tensor | None


#: Bytes of an 8-bit cache row's scale (a float32 after the values).
INT8_SCALE_BYTES = 4


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows ``x [..., d]`` as an 8-bit cache stores them: ``[..., d + 4]`` int8."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127.0
    ok = (scale > 0) & torch.isfinite(scale)
    q = torch.where(ok, xf / torch.where(ok, scale, 1.0), 0.0)
    q = q.round().clamp(-127, 127).to(torch.int8)
    scale = torch.where(ok, scale, 0.0).contiguous()
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., d]`` of 8-bit cache rows ``[..., d + 4]``."""
    d = rows.shape[-1] - INT8_SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    return rows[..., :d].float() * scale


def quantized_queries(q: torch.Tensor) -> torch.Tensor:
    """The query rows ``q [..., d]`` attention reads against an 8-bit cache:
    each row quantized as a cache row is, in ``q``'s dtype."""
    return dequantize_rows(quantize_rows(q)).to(q.dtype)


def _readable(cache_rows: torch.Tensor) -> torch.Tensor:
    """Cache rows as values: 8-bit rows dequantized, float rows as they are."""
    return dequantize_rows(cache_rows) if cache_rows.dtype == torch.int8 else cache_rows


def attend(
    layer: PagedLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """Stores the step's k/v [T, kv_heads, head] in the cache, then attends q [T, heads, head]."""
    k_cache, v_cache = layer.k_cache, layer.v_cache
    assert k_cache is not None and v_cache is not None
    block_size = k_cache.shape[2]
    slots, tables = meta.for_group(layer.kv_group)
    slots = slots.to(torch.long)
    blocks, offsets = slots // block_size, slots % block_size
    if k_cache.dtype == torch.int8:
        k, v = quantize_rows(k), quantize_rows(v)
        q = quantized_queries(q)
    # Advanced indices around a slice put the token dim first: [T, kv_heads, head].
    k_cache[blocks, :, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, :, offsets] = v.to(v_cache.dtype)
    if meta.max_query_len == 1 and q.shape[0] == meta.seq_lens.shape[0]:
        return _decode(layer, q, meta, tables)
    return _prefill(layer, q, meta, tables)


def _gather(
    layer: PagedLayer, cache: torch.Tensor, block_table: torch.Tensor, length: int
) -> torch.Tensor:
    """One sequence's first ``length`` cached rows as [kv_heads, length, head]."""
    block_size = cache.shape[2]
    num_blocks = (length + block_size - 1) // block_size
    rows = cache[block_table[:num_blocks].to(torch.long)]  # [nb, kvh, bs, hd]
    rows = rows.transpose(0, 1).reshape(layer.num_kv_heads, num_blocks * block_size, -1)
    return _readable(rows[:, :length])


def _decode(
    layer: PagedLayer, q: torch.Tensor, meta: AttentionMetadata, block_tables: torch.Tensor
) -> torch.Tensor:
    """One query token per sequence: the whole batch in one padded SDPA call."""
    k_cache, v_cache = layer.k_cache, layer.v_cache
    assert k_cache is not None and v_cache is not None
    num_seqs = q.shape[0]
    block_size = k_cache.shape[2]
    max_blocks = (meta.max_seq_len + block_size - 1) // block_size
    tables = block_tables[:, :max_blocks].to(torch.long)  # [S, nb]
    length = max_blocks * block_size

    def gather(cache: torch.Tensor) -> torch.Tensor:
        rows = cache[tables]  # [S, nb, kvh, bs, hd]
        rows = rows.transpose(1, 2).reshape(num_seqs, layer.num_kv_heads, length, -1)
        return _readable(rows)

    seq_lens = meta.seq_lens.to(device=q.device, dtype=torch.long).unsqueeze(1)  # [S, 1]
    j = torch.arange(length, device=q.device).unsqueeze(0)  # [1, L]
    mask = j < seq_lens
    if layer.sliding_window:
        mask &= j > seq_lens - 1 - layer.sliding_window
    # Slots past a sequence's end hold whatever the cache had (maybe NaN), and a
    # masked NaN still poisons the weighted sum: zero them.
    keep = mask[:, None, :, None]
    keys = torch.where(keep, gather(k_cache), 0)
    values = torch.where(keep, gather(v_cache), 0)
    out = _sdpa(layer, q.unsqueeze(2), keys, values, mask[:, None, None, :])  # [S, H, 1, hd]
    return out.squeeze(2)


def _prefill(
    layer: PagedLayer, q: torch.Tensor, meta: AttentionMetadata, block_tables: torch.Tensor
) -> torch.Tensor:
    """Sequence by sequence: new tokens attend to their cached prefix and
    causally; with a window, from the first block any of them sees (earlier
    entries of the table may be freed)."""
    k_cache, v_cache = layer.k_cache, layer.v_cache
    assert k_cache is not None and v_cache is not None
    block_size = k_cache.shape[2]
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    for i, seq_len in enumerate(seq_lens):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        skip = 0
        if layer.sliding_window:
            skip = max(0, seq_len - (end - start) + 1 - layer.sliding_window) // block_size
        table = block_tables[i, skip:]
        keys = _gather(layer, k_cache, table, seq_len - skip * block_size)
        values = _gather(layer, v_cache, table, seq_len - skip * block_size)
        mask = _mask(layer, end - start, seq_len, q.device)[:, skip * block_size :]
        qi = q[start:end].transpose(0, 1)  # [H, n, hd]
        out[start:end] = _sdpa(layer, qi, keys, values, mask).transpose(0, 1)
    return out


def attend_uncached(
    layer: PagedLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
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
        mask = _mask(layer, seq_len, seq_len, q.device)
        out[start:end] = _sdpa(
            layer,
            q[start:end].transpose(0, 1),
            k[start:end].transpose(0, 1),
            v[start:end].transpose(0, 1),
            mask,
        ).transpose(0, 1)
    return out


def _mask(layer: PagedLayer, num_queries: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[num_queries, seq_len] bool: query i (position seq_len - n + i) sees keys (p - w, p]."""
    p = torch.arange(seq_len - num_queries, seq_len, device=device).unsqueeze(1)
    j = torch.arange(seq_len, device=device).unsqueeze(0)
    mask = j <= p
    if layer.sliding_window:
        mask &= j > p - layer.sliding_window
    return mask


def _sdpa(
    layer: PagedLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """SDPA with grouped-query heads: q [..., H, n, hd], k/v [..., KVH, L, hd]."""
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    groups = layer.num_heads // layer.num_kv_heads
    if groups > 1:
        k = k.repeat_interleave(groups, dim=-3)
        v = v.repeat_interleave(groups, dim=-3)
    cap, sinks = layer.logit_softcap, layer.sinks
    if cap or sinks is not None:  # SDPA has neither soft-cap nor sinks: the scores written out
        scores = (q @ k.transpose(-1, -2)).float() * layer.scale
        if cap:
            scores = torch.tanh(scores / cap) * cap
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            # Each head's sink is one more score column, dropped after the
            # softmax (it has no value row): transformers' gpt-oss attention.
            sink = sinks.to(device=scores.device, dtype=torch.float32).view(-1, 1, 1)
            sink = sink.expand(*scores.shape[:-1], 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return (probs.to(v.dtype) @ v).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scale)

"""Paged attention and the cache write against plain torch references.

The attention reference gathers each sequence's keys and values from the paged
cache through its block table into contiguous tensors and runs
``torch.nn.functional.scaled_dot_product_attention`` in float32 with an explicit
boolean mask (causal with the prefix offset, optional sliding window), GQA by
``repeat_interleave``.

Tolerances:
- float32: ``atol=2e-5, rtol=1e-5``. Both sides compute in f32; they differ only
  in summation order and in the kernel's polynomial ``exp`` (~1 ulp).
- bfloat16: the reference runs in f32 on the *same* bf16 inputs (upcast), so the
  only extra error is the kernel's final rounding of its f32 result to bf16:
  half an ulp, ``2**-9`` relative. We allow ``rtol=2**-8`` (one ulp) plus
  ``atol=1e-4`` for accumulation-order differences near zero.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fastllm import _core
from fastllm.forward_context import AttentionMetadata, set_context
from fastllm.layers.attention import PagedAttention
from fastllm.layers.attention_torch import attend_uncached
from fastllm.layers.ops import RUST_OPS, TORCH_OPS

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-4, rtol=2**-8)}


def make_batch(
    gen, *, ctx_lens, q_lens, num_heads, num_kv_heads, head_size, block_size, dtype, spare_blocks=3
):
    """Random query, caches and a shuffled (non-contiguous) block table for the given sequences."""
    needed = [math.ceil(c / block_size) for c in ctx_lens]
    num_blocks = sum(needed) + spare_blocks
    max_blocks = max(needed) + 1
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    # Padding entries are junk: the kernel must ignore them.
    block_tables = torch.full((len(ctx_lens), max_blocks), -12345, dtype=torch.int32)
    start = 0
    for i, n in enumerate(needed):
        block_tables[i, :n] = perm[start : start + n]
        start += n
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype)
    key_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_size, generator=gen).to(
        dtype
    )
    value_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_size, generator=gen).to(
        dtype
    )
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    return query, key_cache, value_cache, block_tables, seq_lens, qsl


def reference_attention(
    query, key_cache, value_cache, block_tables, seq_lens, qsl, scale, window, softcap=0.0
):
    """Float32 attention over K/V gathered into contiguous tensors, via torch
    SDPA (written out with the soft-cap ``c * tanh(s / c)`` when there is one)."""
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    out = torch.empty(query.shape, dtype=torch.float32)
    for i in range(len(seq_lens)):
        ctx = int(seq_lens[i])
        q0, q1 = int(qsl[i]), int(qsl[i + 1])
        q_len = q1 - q0
        if q_len == 0:
            continue
        blocks = block_tables[i, : math.ceil(ctx / block_size)].long()

        def gather(cache, blocks=blocks, ctx=ctx):
            x = (
                cache[blocks]
                .float()
                .permute(1, 0, 2, 3)
                .reshape(num_kv_heads, -1, head_size)[:, :ctx]
            )
            return x.repeat_interleave(num_heads // num_kv_heads, dim=0)

        k, v = gather(key_cache), gather(value_cache)
        q = query[q0:q1].float().transpose(0, 1)
        pos = torch.arange(ctx - q_len, ctx)[:, None]
        keys = torch.arange(ctx)[None, :]
        mask = keys <= pos
        if window > 0:
            mask &= keys > pos - window
        if softcap > 0:
            scores = softcap * torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap)
            o = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[q0:q1] = o.transpose(0, 1)
    return out


@st.composite
def attention_cases(draw):
    num_seqs = draw(st.integers(1, 4))
    ctx_lens, q_lens = [], []
    for _ in range(num_seqs):
        ctx = draw(st.integers(1, 160))
        kind = draw(st.sampled_from(["decode", "prefill", "prefill_after_prefix", "idle"]))
        q_len = {"decode": 1, "prefill": ctx, "idle": 0}.get(kind) or draw(st.integers(1, ctx))
        ctx_lens.append(ctx)
        q_lens.append(q_len)
    num_kv_heads = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 4, 7]))
    return dict(
        ctx_lens=ctx_lens,
        q_lens=q_lens,
        num_kv_heads=num_kv_heads,
        num_heads=num_kv_heads * group,
        head_size=draw(st.sampled_from([64, 80, 96, 128, 256])),
        block_size=draw(st.sampled_from([8, 16, 32])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        window=draw(st.sampled_from([0, 0, -1]) | st.integers(1, 64)),
        softcap=draw(st.sampled_from([0.0, 0.0, 0.5, 4.0, 50.0])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def run_attention(
    query, key_cache, value_cache, block_tables, seq_lens, qsl, scale, window, softcap=0.0
):
    out = torch.full_like(query, float("nan"))
    _core.paged_attention(
        out, query, key_cache, value_cache, block_tables, seq_lens, qsl, scale, window, softcap
    )
    return out


@settings(max_examples=50, deadline=None)
@given(attention_cases())
def test_paged_attention_matches_sdpa(case):
    gen = torch.Generator().manual_seed(case.pop("seed"))
    window, softcap = case.pop("window"), case.pop("softcap")
    batch = make_batch(gen, **case)
    scale = 1.0 / math.sqrt(case["head_size"])
    got = run_attention(*batch, scale, window, softcap)
    want = reference_attention(*batch, scale, window, softcap)
    assert got.dtype == case["dtype"]
    torch.testing.assert_close(got.float(), want, **TOL[case["dtype"]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_context_decode_uses_partitions(dtype):
    """Batch-1 decode over a long context: the key range is split and merged."""
    gen = torch.Generator().manual_seed(1)
    batch = make_batch(
        gen,
        ctx_lens=[3000],
        q_lens=[1],
        num_heads=14,
        num_kv_heads=2,
        head_size=64,
        block_size=16,
        dtype=dtype,
    )
    got = run_attention(*batch, 0.125, 0)
    torch.testing.assert_close(got.float(), reference_attention(*batch, 0.125, 0), **TOL[dtype])


def test_long_prefill_with_window_mixed_with_decode():
    gen = torch.Generator().manual_seed(2)
    batch = make_batch(
        gen,
        ctx_lens=[700, 300],
        q_lens=[200, 1],
        num_heads=8,
        num_kv_heads=2,
        head_size=128,
        block_size=16,
        dtype=torch.float32,
    )
    got = run_attention(*batch, 0.1, 100)
    torch.testing.assert_close(got, reference_attention(*batch, 0.1, 100), **TOL[torch.float32])


@settings(max_examples=30, deadline=None)
@given(
    num_tokens=st.integers(0, 40),
    num_kv_heads=st.integers(1, 3),
    head_size=st.sampled_from([64, 80, 128]),
    block_size=st.sampled_from([8, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_reshape_and_cache_matches_indexing(
    num_tokens, num_kv_heads, head_size, block_size, dtype, seed
):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 6
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    # Distinct slots, some tokens skipped with -1.
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    skip = torch.rand(num_tokens, generator=gen) < 0.25
    slots[skip] = -1
    key_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_size, generator=gen).to(
        dtype
    )
    value_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_size, generator=gen).to(
        dtype
    )
    want_k, want_v = key_cache.clone(), value_cache.clone()
    keep = slots >= 0
    b, o = slots[keep] // block_size, slots[keep] % block_size
    want_k[b, :, o] = key[keep]
    want_v[b, :, o] = value[keep]

    _core.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, want_k)
    assert torch.equal(value_cache, want_v)


def small_cache(dtype=torch.float32):
    return torch.zeros(4, 2, 8, 64, dtype=dtype), torch.zeros(4, 2, 8, 64, dtype=dtype)


def test_reshape_and_cache_errors():
    kc, vc = small_cache()
    key = torch.randn(3, 2, 64)
    value = torch.randn(3, 2, 64)
    slots = torch.tensor([0, 5, 32], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"slot_mapping: token 2 has slot 32"):
        _core.reshape_and_cache(key, value, kc, vc, slots)
    assert not kc.any(), "a rejected call must not write anything"
    ok_slots = torch.tensor([0, 5, 31])
    with pytest.raises(ValueError, match="slot_mapping: expected dtype"):
        _core.reshape_and_cache(key, value, kc, vc, ok_slots.to(torch.int32))
    with pytest.raises(ValueError, match="key: dtype"):
        _core.reshape_and_cache(key.bfloat16(), value, kc, vc, ok_slots)
    with pytest.raises(ValueError, match="value_cache: dtype"):
        _core.reshape_and_cache(key, value, kc, vc.bfloat16(), ok_slots)
    with pytest.raises(ValueError, match="key: must be contiguous"):
        _core.reshape_and_cache(torch.randn(3, 64, 2).transpose(1, 2), value, kc, vc, ok_slots)
    with pytest.raises(ValueError, match="key_cache: must be contiguous"):
        _core.reshape_and_cache(key, value, torch.zeros(4, 8, 2, 64).transpose(1, 2), vc, ok_slots)
    with pytest.raises(ValueError, match="value: dimension 2 must be 64"):
        _core.reshape_and_cache(key, torch.randn(3, 2, 32), kc, vc, ok_slots)
    with pytest.raises(ValueError, match="slot_mapping: dimension 0 must be 3"):
        _core.reshape_and_cache(key, value, kc, vc, ok_slots[:2])
    with pytest.raises(ValueError, match="must not share memory"):
        _core.reshape_and_cache(key, value, kc, kc, ok_slots)
    with pytest.raises(ValueError, match="key: expected a torch.Tensor"):
        _core.reshape_and_cache([1, 2], value, kc, vc, ok_slots)


def attention_args(dtype=torch.float32):
    kc, vc = small_cache(dtype)
    query = torch.randn(3, 4, 64).to(dtype)
    out = torch.empty_like(query)
    block_tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([10, 5], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
    return [out, query, kc, vc, block_tables, seq_lens, qsl]


def test_paged_attention_errors():
    args = attention_args()
    _core.paged_attention(*args, 0.125)

    def check(index, value, match):
        bad = list(args)
        bad[index] = value
        with pytest.raises(ValueError, match=match):
            _core.paged_attention(*bad, 0.125)

    check(0, args[0].bfloat16(), "out: dtype")
    check(1, args[1].bfloat16(), "query: dtype")
    check(1, torch.randn(3, 64, 4).transpose(1, 2), "query: must be contiguous")
    check(1, torch.randn(3, 3, 64), "num_heads")
    check(1, torch.randn(3, 4, 32), "query: dimension 2 must be 64")
    check(0, torch.empty(2, 4, 64), "out: shape")
    check(0, args[1], "must not share memory")
    check(4, args[4].long(), "block_tables: expected dtype")
    check(
        4,
        torch.tensor([[0, 4], [2, 9]], dtype=torch.int32),
        "block_tables: sequence 0 block 1 is 4",
    )
    check(5, torch.tensor([10, 17], dtype=torch.int32), "seq_lens: sequence 1 has length 17")
    check(5, torch.tensor([1, 5], dtype=torch.int32), "seq_lens: sequence 0 has length 1, shorter")
    check(5, torch.tensor([10], dtype=torch.int32), "seq_lens: dimension 0 must be 2")
    check(6, torch.tensor([0, 2, 4], dtype=torch.int32), "query_start_loc: must start at 0 and end")
    check(6, torch.tensor([0, 2], dtype=torch.int32), "query_start_loc: dimension 0 must be 3")
    check(3, torch.zeros(4, 2, 16, 64), "value_cache: shape")
    with pytest.raises(ValueError, match="scale"):
        _core.paged_attention(*args, float("nan"))
    for cap in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap: must be a finite number >= 0"):
            _core.paged_attention(*args, 0.125, 0, cap)


def test_paged_attention_sinks_errors():
    args = attention_args()
    sinks = torch.zeros(4)
    sinks[1] = float("-inf")  # no sink for that head: allowed
    _core.paged_attention(*args, 0.125, 0, 0.0, sinks)
    _core.paged_attention(*args, 0.125, sinks=None)

    def check(value, match):
        with pytest.raises(ValueError, match=match):
            _core.paged_attention(*args, 0.125, sinks=value)

    check(sinks.double(), "sinks: unsupported dtype")
    check(sinks.bfloat16(), "sinks: expected dtype")
    check(torch.zeros(3), "sinks: dimension 0 must be 4")
    check(torch.zeros(1, 4), "sinks")
    check(torch.zeros(8)[::2], "sinks: must be contiguous")
    check([0.0] * 4, "sinks: expected a torch.Tensor")
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="sinks: head 2 is"):
            _core.paged_attention(*args, 0.125, sinks=torch.tensor([0.0, 0.0, bad, 0.0]))


# ---- attention sinks (gpt-oss) ----------------------------------------------


def dense_sinks_reference(query, kv_of, qsl, seq_lens, scale, window, softcap, sinks):
    """Float64 attention straight from the definition, as transformers'
    gpt-oss eager attention: each head's scaled (soft-capped) scores over its
    visible keys, its sink appended as one more column, softmax, that column
    dropped. ``kv_of(i)`` gives sequence ``i``'s keys and values [ctx, kv_heads, head]."""
    num_heads = query.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64)
    for i in range(len(seq_lens)):
        ctx, q0, q1 = int(seq_lens[i]), int(qsl[i]), int(qsl[i + 1])
        if q1 == q0:
            continue
        k, v = kv_of(i)
        group = num_heads // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, hd]
        v = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[q0:q1].double().transpose(0, 1)  # [H, n, hd]
        scores = (q @ k.transpose(-1, -2)) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        pos = torch.arange(ctx - (q1 - q0), ctx)[:, None]
        keys = torch.arange(ctx)[None, :]
        mask = keys <= pos
        if window > 0:
            mask &= keys > pos - window
        scores = scores.masked_fill(~mask, float("-inf"))
        sink = sinks.double().view(-1, 1, 1).expand(num_heads, q1 - q0, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out[q0:q1] = (probs @ v).transpose(0, 1)
    return out


def cached_kv(key_cache, value_cache, block_tables):
    """``kv_of`` for the paged cache: sequence i's first ``ctx`` rows."""
    block_size = key_cache.shape[2]

    def kv_of(i, ctx):
        pos = torch.arange(ctx)
        blocks = block_tables[i].long()[pos // block_size]
        return key_cache[blocks, :, pos % block_size], value_cache[blocks, :, pos % block_size]

    return kv_of


def random_sinks(gen, num_heads, with_none):
    """Sinks around the scores' range (some above a row's every score, some
    below); with ``with_none``, every third head has none (-inf)."""
    sinks = torch.randn(num_heads, generator=gen) * 3 + 1
    if with_none:
        sinks[::3] = float("-inf")
    return sinks


# The torch backend computes q @ k in the query's dtype (bf16 scores) and
# casts the probabilities to it: a looser bound than the Rust kernel's f32.
TORCH_TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=5e-2, rtol=2e-2),
}


def sinks_layer(case, window, softcap, sinks, key_cache, value_cache):
    layer = PagedAttention(
        case["num_heads"],
        case["head_size"],
        case["num_kv_heads"],
        1.0 / math.sqrt(case["head_size"]),
        sliding_window=window if window > 0 else None,
        logit_softcap=softcap or None,
    )
    layer.k_cache, layer.v_cache = key_cache, value_cache
    layer.sinks = sinks
    return layer


def run_layer(layer, ops, query, block_tables, seq_lens, qsl, kv_rows=None):
    """``PagedAttention.forward`` on ``ops``; the step's new K/V are the
    rows already cached at their slots, so the cache write changes nothing
    (``kv_rows``: float caches to take those rows from instead)."""
    block_size = layer.k_cache.shape[2]
    slots = []
    for i in range(len(seq_lens)):
        ctx, n = int(seq_lens[i]), int(qsl[i + 1] - qsl[i])
        for p in range(ctx - n, ctx):
            slots.append(int(block_tables[i, p // block_size]) * block_size + p % block_size)
    slots = torch.tensor(slots, dtype=torch.int64)
    b, o = slots // block_size, slots % block_size
    k_rows, v_rows = kv_rows or (layer.k_cache, layer.v_cache)
    k, v = k_rows[b, :, o], v_rows[b, :, o]
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=qsl,
        max_query_len=int((qsl[1:] - qsl[:-1]).max()),
        max_seq_len=int(seq_lens.max()),
    )
    layer.ops = ops
    t, width = query.shape[0], layer.num_kv_heads * layer.head_size
    set_context(meta)
    try:
        q = query.reshape(t, layer.num_heads * layer.head_size)
        out = layer.forward(q, k.reshape(t, width), v.reshape(t, width))
    finally:
        set_context(None)
    return out.reshape(query.shape)


@settings(max_examples=40, deadline=None)
@given(attention_cases(), st.booleans())
def test_sinks_rust_and_torch_match_dense_reference(case, with_none):
    """Rust kernel (``_core`` and through ``PagedAttention`` on the Rust ops)
    and the torch backend against the float64 definition, with sinks."""
    gen = torch.Generator().manual_seed(case.pop("seed"))
    window, softcap = case.pop("window"), case.pop("softcap")
    query, key_cache, value_cache, block_tables, seq_lens, qsl = make_batch(gen, **case)
    # The engine pads block tables with 0; the torch backend gathers the padding.
    block_tables = block_tables.clamp(min=0)
    sinks = random_sinks(gen, case["num_heads"], with_none)
    scale = 1.0 / math.sqrt(case["head_size"])
    kv = cached_kv(key_cache, value_cache, block_tables)
    want = dense_sinks_reference(
        query, lambda i: kv(i, int(seq_lens[i])), qsl, seq_lens, scale, window, softcap, sinks
    )
    dtype = case["dtype"]

    got = torch.full_like(query, float("nan"))
    args = (query, key_cache, value_cache, block_tables, seq_lens, qsl, scale, window, softcap)
    _core.paged_attention(got, *args, sinks)
    torch.testing.assert_close(got.double(), want, **TOL[dtype])

    layer = sinks_layer(case, window, softcap, sinks, key_cache, value_cache)
    rust = run_layer(layer, RUST_OPS, query, block_tables, seq_lens, qsl)
    assert torch.equal(rust, got)
    torch_out = run_layer(layer, TORCH_OPS, query, block_tables, seq_lens, qsl)
    assert torch_out.dtype == dtype
    torch.testing.assert_close(torch_out.double(), want, **TORCH_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_long_context_decode_uses_partitions(dtype):
    """Batch-1 decode over a long context: the sinks join the merged partitions once."""
    gen = torch.Generator().manual_seed(3)
    case = dict(num_heads=8, num_kv_heads=2, head_size=64)
    batch = make_batch(gen, ctx_lens=[3000], q_lens=[1], block_size=16, dtype=dtype, **case)
    sinks = random_sinks(gen, 8, with_none=True)
    kv = cached_kv(batch[1], batch[2], batch[3])
    for window in (0, 700):
        got = torch.full_like(batch[0], float("nan"))
        _core.paged_attention(got, *batch, 0.125, window, 0.0, sinks)
        want = dense_sinks_reference(
            batch[0], lambda i: kv(i, 3000), batch[5], batch[4], 0.125, window, 0.0, sinks
        )
        torch.testing.assert_close(got.double(), want, **TOL[dtype])


def test_sinks_of_minus_infinity_are_no_sinks():
    gen = torch.Generator().manual_seed(4)
    batch = make_batch(
        gen,
        ctx_lens=[90, 40],
        q_lens=[30, 1],
        num_heads=6,
        num_kv_heads=3,
        head_size=64,
        block_size=8,
        dtype=torch.float32,
    )
    plain = run_attention(*batch, 0.125, 20)
    got = torch.full_like(plain, float("nan"))
    _core.paged_attention(got, *batch, 0.125, 20, 0.0, torch.full((6,), float("-inf")))
    assert torch.equal(got, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 5])
def test_sinks_uncached_prompts_match_dense_reference(dtype, window):
    """``attend_uncached`` (no KV cache yet: whole prompts) honours the sinks."""
    gen = torch.Generator().manual_seed(5)
    num_heads, num_kv_heads, head_size = 6, 2, 32
    lens = [7, 1, 12]
    t = sum(lens)
    q = torch.randn(t, num_heads, head_size, generator=gen).to(dtype)
    k = torch.randn(t, num_kv_heads, head_size, generator=gen).to(dtype)
    v = torch.randn(t, num_kv_heads, head_size, generator=gen).to(dtype)
    qsl = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    sinks = random_sinks(gen, num_heads, with_none=True)
    case = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size)
    layer = sinks_layer(case, window, 0.0, sinks, None, None)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(t, dtype=torch.int64),
        block_tables=torch.zeros(3, 1, dtype=torch.int32),
        seq_lens=seq_lens,
        query_start_loc=qsl,
        max_query_len=12,
        max_seq_len=12,
    )
    got = attend_uncached(layer, q, k, v, meta)

    def kv_of(i):
        return k[qsl[i] : qsl[i + 1]], v[qsl[i] : qsl[i + 1]]

    scale = 1.0 / math.sqrt(head_size)
    want = dense_sinks_reference(q, kv_of, qsl, seq_lens, scale, window, 0.0, sinks)
    torch.testing.assert_close(got.double(), want, **TORCH_TOL[dtype])
    layer.sinks = None
    plain = attend_uncached(layer, q, k, v, meta)
    assert not torch.allclose(plain.double(), want, **TORCH_TOL[dtype])


@st.composite
def encoder_cases(draw):
    """Packed inputs of mixed lengths, MHA or GQA, a band or none, strided or packed rows."""
    num_kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 4]))
    return dict(
        lengths=draw(st.lists(st.integers(1, 150), min_size=1, max_size=5)),
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_size=draw(st.sampled_from([8, 16, 40, 64, 72])),
        band=draw(st.sampled_from([0, 0, 1, 7, 40])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        fused=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=60, deadline=None)
@given(encoder_cases())
def test_encoder_attention_matches_sdpa(case):
    """``_core.encoder_attention`` equals per-input float32 SDPA (bidirectional,
    an optional band of positions, GQA), on views of a fused projection or packed rows."""
    gen = torch.Generator().manual_seed(case["seed"])
    lengths, dtype = case["lengths"], case["dtype"]
    h, kvh, d = case["num_heads"], case["num_kv_heads"], case["head_size"]
    total = sum(lengths)
    widths = [h * d, kvh * d, kvh * d]
    if case["fused"]:
        fused = torch.randn(total, sum(widths) + 3, generator=gen).to(dtype)
        q, k, v = (t.view(total, -1, d) for t in fused[:, : sum(widths)].split(widths, dim=1))
    else:
        q, k, v = (torch.randn(total, w // d, d, generator=gen).to(dtype) for w in widths)
    out = torch.full((total, h, d), float("nan"), dtype=dtype)
    scale = d**-0.5
    _core.encoder_attention(out, q, k, v, lengths, scale, case["band"])
    first = 0
    for n in lengths:
        rows = slice(first, first + n)
        qs, ks, vs = (x[rows].float().transpose(0, 1) for x in (q, k, v))
        ks, vs = (x.repeat_interleave(h // kvh, dim=0) for x in (ks, vs))
        mask = None
        if case["band"]:
            pos = torch.arange(n)
            mask = (pos[:, None] - pos[None, :]).abs() <= case["band"]
        want = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        torch.testing.assert_close(out[rows].float(), want.transpose(0, 1), **TOL[dtype])
        first += n


def test_encoder_attention_errors():
    """Bad tensors are errors naming the argument; nothing is written."""
    q = torch.zeros(5, 2, 8)
    out = torch.zeros(5, 2, 8)
    with pytest.raises(ValueError, match="lengths|out"):
        _core.encoder_attention(out, q, q.clone(), q.clone(), [2, 2], 1.0)
    with pytest.raises(ValueError, match="value"):
        _core.encoder_attention(out, q, q.clone(), torch.zeros(5, 1, 8), [5], 1.0)
    with pytest.raises(ValueError, match="key"):
        _core.encoder_attention(out, q, torch.zeros(5, 2, 8, dtype=torch.bfloat16), q, [5], 1.0)
    with pytest.raises(ValueError, match="out"):
        _core.encoder_attention(q, q, q.clone(), q.clone(), [5], 1.0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv = torch.zeros(5, 3, 8)
        _core.encoder_attention(out, q, kv, kv.clone(), [5], 1.0)

"""Each CUDA kernel against an independent torch reference, on random shapes.

Skipped without a GPU (``fastllm.cuda_available()`` false). Run on a GPU
machine by ``benches/gpu_check.sh``.
"""

from __future__ import annotations

import random

import pytest

import fastllm

pytestmark = pytest.mark.skipif(
    not fastllm.cuda_available(), reason="no usable CUDA GPU (fastllm.cuda_available() is false)"
)

torch = pytest.importorskip("torch")
F = torch.nn.functional

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Attention tolerance per dtype: the kernel accumulates in f32 and rounds once;
# the reference works in float64 on the CPU from the same rounded inputs.
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(scope="module")
def ops():
    from fastllm.layers import cuda_ops

    assert cuda_ops.enabled(), cuda_ops.disabled_reason()
    return cuda_ops


def check_enabled(ops):
    assert ops.enabled(), f"CUDA kernels were disabled: {ops.disabled_reason()}"


def attention_reference(
    q, k_cache, v_cache, tables, seq_lens, qsl, scale, window, softcap=0.0, sinks=None
):
    """Float64 CPU attention over the gathered cache, straight from the contract
    (a head's sink is one more score column, with no value row)."""
    q, k_cache, v_cache = (t.double().cpu() for t in (q, k_cache, v_cache))
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    group = heads // kv_heads
    block_size = k_cache.shape[2]
    out = torch.zeros_like(q)
    for s in range(len(seq_lens)):
        lo, hi, n = int(qsl[s]), int(qsl[s + 1]), int(seq_lens[s])
        keys = torch.stack(
            [k_cache[int(tables[s][j // block_size]), :, j % block_size] for j in range(n)]
        )
        vals = torch.stack(
            [v_cache[int(tables[s][j // block_size]), :, j % block_size] for j in range(n)]
        )
        for t in range(lo, hi):
            p = n - (hi - lo) + (t - lo)
            visible = torch.arange(n) <= p
            if window > 0:
                visible &= torch.arange(n) > p - window
            for h in range(heads):
                kh = keys[:, h // group]
                scores = (kh @ q[t, h]) * scale
                if softcap > 0:
                    scores = softcap * torch.tanh(scores / softcap)
                scores[~visible] = float("-inf")
                if sinks is not None:
                    scores = torch.cat([scores, sinks[h : h + 1].double().cpu()])
                w = torch.softmax(scores, dim=0)[:n]
                out[t, h] = w @ vals[:, h // group]
    return out


def random_batch(rng: random.Random, block_size: int, num_blocks: int):
    """Sequences with random cached prefixes and new-token counts, tables over shuffled blocks."""
    num_seqs = rng.randint(1, 4)
    free = list(range(num_blocks))
    rng.shuffle(free)
    q_lens, seq_lens, tables = [], [], []
    for _ in range(num_seqs):
        q_len = rng.choice([1, 1, rng.randint(1, 19)])
        seq_len = q_len + rng.randint(0, 40)
        need = (seq_len + block_size - 1) // block_size
        tables.append([free.pop() for _ in range(need)])
        q_lens.append(q_len)
        seq_lens.append(seq_len)
    width = max(len(t) for t in tables)
    tables = [t + [0] * (width - len(t)) for t in tables]
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    return q_lens, seq_lens, tables, qsl


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(6))
def test_cache_write_then_attention(ops, dtype, case):
    rng = random.Random(100 + case)
    torch.manual_seed(case)
    dev = torch.device("cuda")
    head_size = rng.choice([16, 64, 80, 128, 256])
    kv_heads = rng.choice([1, 2, 4])
    heads = kv_heads * rng.choice([1, 2, 4])
    block_size = rng.choice([8, 16])
    num_blocks = 64
    window = rng.choice([0, 0, 7, 25])
    softcap = rng.choice([0.0, 0.0, 0.5, 4.0])  # Gemma 2's attention soft-cap
    with_sinks = case % 2 == 1  # gpt-oss's attention sinks
    q_lens, seq_lens, tables, qsl = random_batch(rng, block_size, num_blocks)
    shape = (num_blocks, kv_heads, block_size, head_size)
    k_cache = torch.randn(shape, device=dev).to(dtype)
    v_cache = torch.randn(shape, device=dev).to(dtype)
    num_tokens = qsl[-1]
    # New tokens' K/V are written by the cache kernel, from a strided view of a fused projection.
    fused = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_size, device=dev).to(dtype)
    q = fused[:, : heads * head_size].reshape(num_tokens, heads, head_size)
    k = fused[:, heads * head_size : (heads + kv_heads) * head_size].reshape(
        num_tokens, kv_heads, head_size
    )
    v = fused[:, (heads + kv_heads) * head_size :].reshape(num_tokens, kv_heads, head_size)
    slots = []
    for s, (n, total) in enumerate(zip(q_lens, seq_lens)):
        for pos in range(total - n, total):
            slots.append(tables[s][pos // block_size] * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=dev)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    sl = slot_mapping.cpu()
    want_k[sl // block_size, :, sl % block_size] = k
    want_v[sl // block_size, :, sl % block_size] = v
    assert ops.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    torch.cuda.synchronize()
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)

    scale = head_size**-0.5
    args = [
        torch.tensor(tables, dtype=torch.int32, device=dev),
        torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        torch.tensor(qsl, dtype=torch.int32, device=dev),
    ]
    sinks = None
    if with_sinks:
        sinks = torch.randn(heads, device=dev) * 3 + 1
        sinks[::3] = float("-inf")  # no sink for those heads
    out = ops.paged_attention(q, k_cache, v_cache, *args, scale, window, softcap, sinks)
    check_enabled(ops)
    want = attention_reference(
        q, k_cache, v_cache, tables, seq_lens, qsl, scale, window, softcap, sinks
    )
    torch.testing.assert_close(out.double().cpu(), want, atol=ATOL[dtype], rtol=ATOL[dtype])


def test_negative_slots_are_skipped(ops):
    dev = torch.device("cuda")
    cache = torch.zeros(4, 2, 8, 16, device=dev)
    other = torch.zeros_like(cache)
    k = torch.randn(3, 2, 16, device=dev)
    ops.reshape_and_cache(k, k, cache, other, torch.tensor([5, -1, 30], device=dev))
    torch.cuda.synchronize()
    assert torch.equal(cache[0, :, 5], k[0]) and torch.equal(cache[3, :, 6], k[2])
    assert int((cache != 0).any(dim=-1).sum()) == 4  # 2 tokens x 2 heads, nothing for slot -1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 896), (33, 4096), (5, 3, 128)])
def test_rms_norm(ops, dtype, shape):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3).to(dtype)
    w = torch.randn(shape[-1]).to(dtype)
    eps = 1e-6
    xf = x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    got = ops.rms_norm(x.cuda(), w.cuda(), eps)
    check_enabled(ops)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,rotary_dim", [(64, 64), (128, 128), (80, 32), (16, 8)])
def test_rotary_matches_apply_rotary(ops, dtype, head_size, rotary_dim):
    from fastllm.layers.rotary import RotaryEmbedding, apply_rotary

    torch.manual_seed(1)
    tokens, heads, kv_heads = 11, 4, 2
    rope = RotaryEmbedding(head_size, rotary_dim, 512, 10000.0)
    positions = torch.randint(0, 512, (tokens,))
    cos, sin = rope.cos_sin(positions, dtype)
    fused = torch.randn(tokens, (heads + kv_heads) * head_size).to(dtype)
    q = fused[:, : heads * head_size].reshape(tokens, heads, head_size)  # strided rows
    want = apply_rotary(q, cos, sin)  # CPU: the torch expression
    q_dev = fused.cuda()[:, : heads * head_size].reshape(tokens, heads, head_size)
    assert not q_dev.is_contiguous()
    got = ops.rotary(q_dev, cos.cuda(), sin.cuda())
    check_enabled(ops)
    # Same rounding steps as the torch expression: equal up to f32 products.
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 128), (9, 1000), (64, 4864)])
def test_silu_and_mul(ops, dtype, rows, d):
    torch.manual_seed(2)
    x = (torch.randn(rows, 2 * d) * 4).to(dtype)
    want = F.silu(x[:, :d]) * x[:, d:]
    got = ops.silu_and_mul(x.cuda())
    check_enabled(ops)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)


SAMPLER_CASES = [
    dict(temperature=0.0),
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, top_k=40, top_p=0.9, min_p=0.05),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
    dict(temperature=0.0, repetition_penalty=1.5),
    dict(temperature=1.0, top_k=1),
]


def _param_lists(cases, rows):
    keys = dict(
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        repetition_penalty=1.0,
        frequency_penalty=0.0,
        presence_penalty=0.0,
    )
    return {k: [cases[r % len(cases)].get(k, v) for r in range(rows)] for k, v in keys.items()}


@pytest.mark.parametrize("vocab", [1000, 32000, 151936])
def test_sampler_matches_the_cpu_sampler(ops, vocab):
    from fastllm import _core

    if not hasattr(_core, "sample"):
        pytest.skip("this build has no CPU sampler")
    torch.manual_seed(vocab)
    rows = 3 * len(SAMPLER_CASES)
    logits = torch.randn(rows, vocab) * 3
    logits[0, 5] = float("nan")
    logits[1, 7] = float("inf")
    p = _param_lists(SAMPLER_CASES, rows)
    seeds = [random.Random(r).getrandbits(64) for r in range(rows)]
    positions = [17 + r for r in range(rows)]
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, vocab, (rows * 12,), generator=gen, dtype=torch.int32)
    output = torch.randint(0, vocab, (rows * 6,), generator=gen, dtype=torch.int32)
    p_off = [12 * r for r in range(rows + 1)]
    o_off = [6 * r for r in range(rows + 1)]
    batch = _core.SamplingBatch(
        **p,
        seed=seeds,
        position=positions,
        prompt_tokens=prompt,
        prompt_offsets=p_off,
        output_tokens=output,
        output_offsets=o_off,
        num_logprobs=[0] * rows,
    )
    cpu_tokens, cpu_lps, cpu_ranks, _ = _core.sample(logits.clone(), batch)
    got = ops.sample(logits.cuda(), batch)
    check_enabled(ops)
    assert got is not None
    tokens, lps, ranks = got
    assert tokens == cpu_tokens
    assert ranks == cpu_ranks
    torch.testing.assert_close(torch.tensor(lps), torch.tensor(cpu_lps), atol=1e-4, rtol=1e-5)


def test_seeded_draws_follow_the_softmax(ops):
    """Across positions, a seeded row's draws have the softmax's frequencies."""
    vocab, rows = 8, 4000
    logits = torch.log(torch.tensor([0.4, 0.2, 0.15, 0.1, 0.08, 0.04, 0.02, 0.01])).repeat(rows, 1)
    from fastllm import _core

    ones = [1.0] * rows
    zeros = [0.0] * rows
    batch = _core.SamplingBatch(
        temperature=ones, top_k=[0] * rows, top_p=ones, min_p=zeros, repetition_penalty=ones,
        frequency_penalty=zeros, presence_penalty=zeros, seed=[1234] * rows,
        position=list(range(rows)),
    )  # fmt: skip
    got = ops.sample(logits.cuda(), batch)
    check_enabled(ops)
    counts = torch.bincount(torch.tensor(got[0]), minlength=vocab).double() / rows
    torch.testing.assert_close(counts, logits[0].exp().double(), atol=0.03, rtol=0)


def test_greedy_batch_without_workspaces(ops):
    """All rows greedy and unpenalised: no workspace is allocated, argmax with lowest-id ties."""
    from fastllm import _core

    logits = torch.randn(5, 3000)
    logits[2, 10] = logits[2, 20] = logits[2].max() + 1  # a tie: the lower id wins
    rows = logits.shape[0]
    zeros, ones = [0.0] * rows, [1.0] * rows
    batch = _core.SamplingBatch(
        temperature=zeros, top_k=[0] * rows, top_p=ones, min_p=zeros, repetition_penalty=ones,
        frequency_penalty=zeros, presence_penalty=zeros, seed=[0] * rows, position=[0] * rows,
        num_logprobs=[0] * rows,
    )  # fmt: skip
    got = ops.sample(logits.cuda(), batch)
    check_enabled(ops)
    assert got[0] == logits.argmax(dim=1).tolist()
    assert got[0][2] == 10 and got[2] == [1] * rows
    if hasattr(_core, "sample"):
        cpu = _core.sample(logits.clone(), batch)
        assert got[0] == cpu[0]
        torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(cpu[1]), atol=1e-4, rtol=0)

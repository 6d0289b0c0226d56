"""The Rust sampler (`_core.sample`) against brute-force torch references written here."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fastllm import _core

F32_MAX = torch.finfo(torch.float32).max
NEG_INF = float("-inf")


def _flat(histories):
    tokens = [t for h in histories for t in h]
    offsets = [0]
    for h in histories:
        offsets.append(offsets[-1] + len(h))
    return torch.tensor(tokens, dtype=torch.int32), offsets


def _per_row(value, rows):
    return list(value) if isinstance(value, (list, tuple)) else [value] * rows


def _args(logits, prompts, outputs, **kw):
    rows = logits.shape[0]
    prompt_tokens, prompt_offsets = _flat(prompts or [[]] * rows)
    output_tokens, output_offsets = _flat(outputs or [[]] * rows)
    filters = dict(
        temperature=_per_row(kw.get("temperature", 1.0), rows),
        top_k=_per_row(kw.get("top_k", 0), rows),
        top_p=_per_row(kw.get("top_p", 1.0), rows),
        min_p=_per_row(kw.get("min_p", 0.0), rows),
        repetition_penalty=_per_row(kw.get("rep", 1.0), rows),
        frequency_penalty=_per_row(kw.get("freq", 0.0), rows),
        presence_penalty=_per_row(kw.get("pres", 0.0), rows),
    )
    history = dict(
        prompt_tokens=prompt_tokens,
        prompt_offsets=prompt_offsets,
        output_tokens=output_tokens,
        output_offsets=output_offsets,
    )
    return filters, history


def sample(
    logits,
    seeds,
    position=0,
    prompts=None,
    outputs=None,
    num_logprobs=0,
    sampled_logprob=True,
    **kw,
):
    rows = logits.shape[0]
    filters, history = _args(logits, prompts, outputs, **kw)
    batch = _core.SamplingBatch(
        **filters,
        seed=_per_row(seeds, rows),
        position=_per_row(position, rows),
        **history,
        num_logprobs=_per_row(num_logprobs, rows),
        sampled_logprob=_per_row(sampled_logprob, rows),
    )
    return _core.sample(logits, batch)


def support(logits, prompts=None, outputs=None, **kw):
    filters, history = _args(logits, prompts, outputs, **kw)
    return _core.sampling_support(logits, _core.SamplingBatch(**filters, **history))


# ---- brute-force reference ----


def _sanitize(x):
    """NaN -> -inf, +inf -> float32 max (the sampler's documented treatment)."""
    return torch.nan_to_num(x, nan=NEG_INF, posinf=F32_MAX, neginf=NEG_INF)


def ref_penalised(row, prompt, output, rep=1.0, freq=0.0, pres=0.0):
    """vLLM's penalties on one float32 row, with plain torch ops."""
    z = _sanitize(row)
    v = z.numel()
    seen = torch.zeros(v, dtype=torch.bool)
    seen[torch.tensor(prompt + output, dtype=torch.long)] = True
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=v).to(torch.float32)
    rep_t = torch.tensor(rep, dtype=torch.float32)
    z = torch.where(seen, torch.where(z > 0, z / rep_t, z * rep_t), z)
    z = z - torch.tensor(freq, dtype=torch.float32) * counts
    z = z - torch.tensor(pres, dtype=torch.float32) * (counts > 0).to(torch.float32)
    return z


def ref_kept(w, top_k=0, top_p=1.0, min_p=0.0):
    """Kept mask of a tempered float32 row in float64, and whether a filter boundary is
    too close to call (the Rust side works with float32 probabilities)."""
    w = w.double()
    v = w.numel()
    keep = w > NEG_INF
    e = torch.exp(w - w.max())
    close = False
    if min_p > 0:
        close |= bool(((e - min_p).abs() <= 1e-5 * min_p).any())
        keep &= e >= min_p
    if 0 < top_k < v:
        kth = torch.sort(w, descending=True).values[top_k - 1]
        keep &= w >= kth
    if top_p < 1:
        vals = e[keep]
        order = torch.sort(vals, descending=True, stable=True).values
        total = order.sum()
        cum = torch.cumsum(order, 0)
        target = top_p * total
        close |= bool(((cum - target).abs() <= 1e-5 * total).any())
        first = int((cum >= target).nonzero()[0]) if bool((cum >= target).any()) else len(order) - 1
        threshold = order[first]
        # Distinct probabilities that float32 cannot tell apart from the threshold.
        gap = (e[keep] - threshold).abs()
        close |= bool(((gap > 0) & (gap <= 1e-6 * threshold)).any())
        keep &= e >= threshold
    return keep, close


def first_argmax(x):
    x = _sanitize(x.double())
    return int((x == x.max()).nonzero()[0])


# ---- hypothesis strategies ----

logit_values = st.one_of(
    st.floats(-8, 8, width=32),
    st.sampled_from([NEG_INF, 0.0, 1.0]),
)


@st.composite
def rows_and_params(draw):
    v = draw(st.integers(2, 40))
    rows = draw(st.integers(1, 3))
    logits = torch.tensor(
        [draw(st.lists(logit_values, min_size=v, max_size=v)) for _ in range(rows)],
        dtype=torch.float32,
    )
    hist = st.lists(st.integers(0, v - 1), max_size=12)
    f32 = dict(width=32)
    params = dict(
        temperature=draw(st.sampled_from([0.0, 0.3, 0.8, 1.0, 1.7])),
        top_k=draw(st.sampled_from([0, -1, 1, 2, 5, v - 1, v, v + 3])),
        top_p=draw(st.sampled_from([1.0, 0.95, 0.7, 0.3, 0.05])),
        min_p=draw(st.sampled_from([0.0, 0.02, 0.2, 0.6])),
        rep=draw(st.one_of(st.just(1.0), st.floats(0.5, 2.0, **f32))),
        freq=draw(st.one_of(st.just(0.0), st.floats(-1.0, 1.0, **f32))),
        pres=draw(st.one_of(st.just(0.0), st.floats(-1.0, 1.0, **f32))),
    )
    prompts = [draw(hist) for _ in range(rows)]
    outputs = [draw(hist) for _ in range(rows)]
    return logits, params, prompts, outputs


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(rows_and_params())
def test_support_and_greedy_match_brute_force(case):
    logits, params, prompts, outputs = case
    got = support(logits, prompts, outputs, **params)
    tokens, *_ = sample(
        logits, seeds=list(range(logits.shape[0])), prompts=prompts, outputs=outputs, **params
    )
    for r in range(logits.shape[0]):
        z = ref_penalised(
            logits[r], prompts[r], outputs[r], params["rep"], params["freq"], params["pres"]
        )
        if not bool((z > NEG_INF).any()):
            assert got[r] == [first_argmax(logits[r])]
            continue
        if params["temperature"] < 1e-5:
            want = [first_argmax(z)]
        else:
            w = z / torch.tensor(params["temperature"], dtype=torch.float32)
            w = w.clamp(max=F32_MAX)
            keep, close = ref_kept(w, params["top_k"], params["top_p"], params["min_p"])
            assume(not close)
            want = keep.nonzero().flatten().tolist()
        assert got[r] == want, (r, params)
        assert tokens[r] in want


@SETTINGS
@given(rows_and_params(), st.integers(0, 2**64 - 1), st.integers(0, 45))
def test_logprobs_ranks_and_top_n_match_log_softmax(case, seed, num_logprobs):
    logits, params, prompts, outputs = case
    rows, v = logits.shape
    logits[0, 0] = float("nan")  # NaN is treated as -inf and must not crash
    tokens, logprobs, ranks, tops = sample(
        logits, seeds=seed, prompts=prompts, outputs=outputs, num_logprobs=num_logprobs, **params
    )
    raw = _sanitize(logits.double())
    for r in range(rows):
        lp = torch.log_softmax(raw[r], dim=0)
        if not bool((raw[r] > NEG_INF).any()):
            continue
        t = tokens[r]
        assert math.isclose(logprobs[r], float(lp[t]), rel_tol=1e-5, abs_tol=1e-5) or (
            logprobs[r] == float(lp[t]) == NEG_INF
        )
        assert ranks[r] == 1 + int((raw[r] > raw[r, t]).sum())
        order = sorted(range(v), key=lambda i: (-float(raw[r, i]), i))[: min(num_logprobs, v)]
        assert [i for i, _ in tops[r]] == order
        for i, value in tops[r]:
            assert value == float(lp[i]) or math.isclose(
                value, float(lp[i]), rel_tol=1e-5, abs_tol=1e-5
            )


@SETTINGS
@given(rows_and_params(), st.integers(0, 2**64 - 1), st.integers(0, 3))
def test_rows_without_a_sampled_logprob_draw_the_same_tokens(case, seed, num_logprobs):
    """``sampled_logprob=False`` (a request without logprobs) draws the very
    token of the same row with it; the row reports NaN and rank 0 unless it
    asks for top logprobs, which then come as before."""
    logits, params, prompts, outputs = case
    rows = logits.shape[0]
    kw = dict(seeds=seed, prompts=prompts, outputs=outputs, num_logprobs=num_logprobs, **params)
    want = sample(logits, **kw)
    got = sample(logits, sampled_logprob=[r % 2 == 1 for r in range(rows)], **kw)
    assert got[0] == want[0]
    for r in range(rows):
        if r % 2 == 1 or num_logprobs > 0:
            assert (got[1][r], got[2][r], got[3][r]) == (want[1][r], want[2][r], want[3][r])
        else:
            assert math.isnan(got[1][r]) and got[2][r] == 0 and got[3][r] == []


def _chi_square_p(counts, probs):
    """Chi-square goodness-of-fit p-value; bins expecting < 5 draws are pooled."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs = counts[big].tolist()
    exp = expected[big].tolist()
    if bool((~big).any()):
        small_obs, small_exp = float(counts[~big].sum()), float(expected[~big].sum())
        if small_exp >= 5:
            obs.append(small_obs)
            exp.append(small_exp)
        else:
            j = min(range(len(exp)), key=exp.__getitem__)
            obs[j] += small_obs
            exp[j] += small_exp
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


CONFIGS = [
    dict(temperature=0.8),
    dict(temperature=1.3, top_k=5),
    dict(temperature=1.0, top_p=0.7),
    dict(temperature=0.9, min_p=0.15),
    dict(temperature=1.1, top_k=8, top_p=0.9, min_p=0.05),
    dict(temperature=1.0, rep=1.3, freq=0.2, pres=0.4),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_sampled_frequencies_match_the_filtered_distribution(config):
    gen = torch.Generator().manual_seed(7)
    v, n = 12, 20000
    row = torch.randn(v, generator=gen, dtype=torch.float32) * 1.5
    prompt, output = [1, 2, 3], [3, 3, 5, 9]
    logits = row.expand(n, v).contiguous()
    tokens, *_ = sample(
        logits,
        seeds=[1000 + s for s in range(n)],
        position=17,
        prompts=[prompt] * n,
        outputs=[output] * n,
        **config,
    )
    z = ref_penalised(
        row,
        prompt,
        output,
        config.get("rep", 1.0),
        config.get("freq", 0.0),
        config.get("pres", 0.0),
    )
    w = z / torch.tensor(config["temperature"], dtype=torch.float32)
    keep, close = ref_kept(
        w, config.get("top_k", 0), config.get("top_p", 1.0), config.get("min_p", 0.0)
    )
    assert not close
    probs = torch.where(
        keep, torch.exp(w.double() - w.double().max()), torch.zeros((), dtype=torch.float64)
    )
    probs = probs / probs.sum()
    counts = torch.bincount(torch.tensor(tokens), minlength=v).double()
    assert bool((counts[~keep] == 0).all()), "drew a filtered-out token"
    assert bool((counts[probs * n >= 5] > 0).all()), "a likely kept token was never drawn"
    assert _chi_square_p(counts[keep], probs[keep]) > 1e-3


@st.composite
def wide_rows(draw):
    """One row of 1-300 logits (several of the race's 64-token chunks) with a
    spread wide enough for its prune gap, exact ties and -inf entries."""
    v = draw(st.integers(1, 300))
    scale = draw(st.sampled_from([0.05, 1.0, 8.0, 40.0]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    row = torch.randn(v, generator=gen) * scale
    for i in draw(st.lists(st.integers(0, v - 1), max_size=8)):
        row[i] = NEG_INF
    for i in draw(st.lists(st.integers(1, max(v - 1, 1)), max_size=8)):
        row[i % v] = row[(i - 1) % v]
    row[draw(st.integers(0, v - 1))] = draw(st.sampled_from([1.0, 30.0]))
    return row


@SETTINGS
@given(
    wide_rows(),
    st.integers(0, 2**64 - 1),
    st.integers(0, 10**6),
    st.sampled_from([0.3, 1.0, 2.5]),
    st.sampled_from([0.0, 0.001, 0.2]),
    st.sampled_from([1.0, 0.9]),
    st.sampled_from([0, 7]),
)
def test_sampled_token_is_the_exponential_race_winner(
    row, seed, position, temperature, min_p, top_p, top_k
):
    """The drawn token is the documented race's winner, found here by brute
    force: the kept token with the largest w - ln(-ln u), u the documented
    uniform, ties to the lowest id (the sampler prunes and runs chunks of
    tokens in vectors; the winner must not change)."""
    logits = row.unsqueeze(0)
    params = dict(temperature=temperature, min_p=min_p, top_p=top_p, top_k=top_k)
    (kept,) = support(logits, **params)
    (token,), *_ = sample(logits, seeds=seed, position=position, **params)
    w = (row / torch.tensor(temperature, dtype=torch.float32)).tolist()
    best, want = -math.inf, None
    for i in kept:
        key = w[i] - math.log(-math.log(_core.sampling_uniform(seed, position, i)))
        if want is None or key > best:
            best, want = key, i
    assert token == want, (token, want, len(kept))


@SETTINGS
@given(
    wide_rows(),
    st.sampled_from([0.3, 1.0, 2.5]),
    st.sampled_from([0.0, 0.001, 0.2]),
    st.sampled_from([0.99, 0.9, 0.5, 0.1]),
)
def test_top_p_keeps_the_brute_force_set_on_wide_rows(row, temperature, min_p, top_p):
    """Top-p's kept set on rows of up to 300 tokens with wide spreads (the
    selection skips the tokens that provably fall below its threshold)
    equals the sorted cumulative mass's set, computed here in float64."""
    logits = row.unsqueeze(0)
    (kept,) = support(logits, temperature=temperature, min_p=min_p, top_p=top_p)
    w = (row / torch.tensor(temperature, dtype=torch.float32)).clamp(max=F32_MAX)
    keep, close = ref_kept(w, 0, top_p, min_p)
    assume(not close)
    assert kept == keep.nonzero().flatten().tolist()


@SETTINGS
@given(
    st.integers(1, 6),
    st.integers(1, 300),
    st.integers(0, 2**32 - 1),
    st.integers(0, 12),
    st.booleans(),
)
def test_token_logprobs_match_log_softmax(rows, v, seed, top, odd):
    """Prompt logprobs (``_core.token_logprobs``): each row's token logprob is
    torch's float64 log-softmax of the sanitised row, its rank 1 + the
    tokens with a larger logit, its top list the largest logprobs by value
    then id; NaN counts as -inf and +inf as float32's maximum."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, v, generator=gen) * 4
    logits[:, v // 2] = logits[:, 0]  # ties
    if odd:
        logits[0, 0] = float("nan")
        logits[-1, v - 1] = float("-inf")
        logits[rows // 2, v // 3] = float("inf")
    tokens = torch.randint(0, v, (rows,), generator=gen).tolist()
    got = _core.token_logprobs(logits, tokens, top)
    raw = _sanitize(logits.double())
    lp = torch.log_softmax(raw, dim=-1)
    lp[~(raw > NEG_INF).any(dim=-1)] = NEG_INF  # a row of -inf only: -inf, not NaN
    for r, (logprob, rank, tops) in enumerate(got):
        t = tokens[r]
        assert logprob == pytest.approx(lp[r, t].item(), abs=1e-5, rel=1e-6)
        assert rank == int((raw[r] > raw[r, t]).sum()) + 1
        order = sorted(range(v), key=lambda i: (-raw[r, i].item(), i))[: min(top, v)]
        assert [i for i, _ in tops] == order
        for i, value in tops:
            assert value == pytest.approx(lp[r, i].item(), abs=1e-5, rel=1e-6)


def test_token_logprobs_name_bad_arguments():
    with pytest.raises(ValueError, match="tokens: token 7 at row 1 is outside the vocabulary of 5"):
        _core.token_logprobs(torch.zeros(2, 5), [0, 7], 0)
    with pytest.raises(ValueError, match="logits: expected 3 rows"):
        _core.token_logprobs(torch.zeros(2, 5), [0, 1, 2], 0)
    assert _core.token_logprobs(torch.zeros(0, 5), [], 3) == []


def _mixed_batch(rows=64, v=997):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, v, generator=gen) * 3
    params = dict(
        temperature=[[0.0, 0.6, 1.0, 1.4][r % 4] for r in range(rows)],
        top_k=[[0, 20, 300, 0, 5][r % 5] for r in range(rows)],
        top_p=[[1.0, 0.9, 0.5][r % 3] for r in range(rows)],
        min_p=[[0.0, 0.0, 0.05][r % 3] for r in range(rows)],
        rep=[[1.0, 1.2][r % 2] for r in range(rows)],
        freq=[[0.0, 0.3][r % 2] for r in range(rows)],
        pres=[[0.0, 0.0, 0.5][r % 3] for r in range(rows)],
    )
    prompts = [[(r * 7 + i) % v for i in range(r % 9)] for r in range(rows)]
    outputs = [[(r * 13 + i * i) % v for i in range(r % 11)] for r in range(rows)]
    seeds = [r * 1_000_003 + 5 for r in range(rows)]
    positions = [r + 40 for r in range(rows)]
    return logits, params, prompts, outputs, seeds, positions


def _pick(params, idx):
    return {k: [v[i] for i in idx] for k, v in params.items()}


def test_seeded_rows_ignore_batch_composition_and_order():
    logits, params, prompts, outputs, seeds, positions = _mixed_batch()
    full = sample(logits, seeds, positions, prompts, outputs, num_logprobs=3, **params)
    rows = logits.shape[0]
    for r in range(0, rows, 5):
        alone = sample(
            logits[r : r + 1],
            [seeds[r]],
            [positions[r]],
            [prompts[r]],
            [outputs[r]],
            3,
            **_pick(params, [r]),
        )
        assert [x[0] for x in alone] == [x[r] for x in full]
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(1)).tolist()
    shuffled = sample(
        logits[perm],
        [seeds[i] for i in perm],
        [positions[i] for i in perm],
        [prompts[i] for i in perm],
        [outputs[i] for i in perm],
        3,
        **_pick(params, perm),
    )
    assert shuffled[0] == [full[0][i] for i in perm]
    # A different position or seed changes the draw for most sampled rows.
    moved = sample(logits, seeds, [p + 1 for p in positions], prompts, outputs, **params)[0]
    assert sum(a != b for a, b in zip(moved, full[0], strict=True)) > 5


def test_seeded_rows_ignore_thread_count():
    script = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import test_sampler as t; "
        "from fastllm import _core; "
        "l, p, pr, o, s, pos = t._mixed_batch(); "
        "print(json.dumps([_core.num_threads(), t.sample(l, s, pos, pr, o, **p)[0]]))"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    results = []
    for threads in ("1", "2"):
        env = dict(os.environ, FASTLLM_NUM_THREADS=threads)
        out = subprocess.run(
            [sys.executable, "-c", script, here],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        results.append(json.loads(out.stdout))
    assert results[0][0] == 1 and results[1][0] == 2
    assert results[0][1] == results[1][1]


def _mix64(z):
    m = (1 << 64) - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_uniform_follows_the_documented_hash():
    g, m = 0x9E3779B97F4A7C15, (1 << 64) - 1
    for seed, pos, tok in [(0, 0, 0), (1, 2, 3), (2**64 - 1, 123456, 151935), (42, 10**12, 7)]:
        row = _mix64((_mix64((seed + g) & m) + (pos + 1) * g) & m)
        h = _mix64((row + (tok + 1) * g) & m)
        assert _core.sampling_uniform(seed, pos, tok) == ((h >> 12) + 0.5) / 2.0**52


def test_sample_does_not_modify_logits_and_handles_empty_batches():
    logits = torch.randn(3, 50)
    before = logits.clone()
    sample(logits, seeds=[1, 2, 3], temperature=0.7, top_p=0.8, rep=1.5, outputs=[[1, 2], [], [3]])
    assert torch.equal(logits, before)
    assert sample(torch.empty(0, 50), seeds=[]) == ([], [], [], [])


def test_bad_arguments_name_the_argument():
    logits = torch.randn(2, 10)
    with pytest.raises(ValueError, match="top_p: expected 2 values"):
        sample(logits, seeds=[1, 2], top_p=[0.5])
    with pytest.raises(ValueError, match=r"temperature\[1\]"):
        sample(logits, seeds=[1, 2], temperature=[1.0, -2.0])
    with pytest.raises(ValueError, match=r"output_tokens\[1\]: token id 10"):
        sample(logits, seeds=[1, 2], outputs=[[1], [10]])
    with pytest.raises(ValueError, match="sampled_logprob: expected 2 values"):
        sample(logits, seeds=[1, 2], sampled_logprob=[True])
    neutral = dict(
        temperature=[1.0] * 2, top_k=[0] * 2, top_p=[1.0] * 2, min_p=[0.0] * 2,
        repetition_penalty=[1.0] * 2, frequency_penalty=[0.0] * 2, presence_penalty=[0.0] * 2,
        seed=[0, 0], position=[0, 0], num_logprobs=[0, 0],
    )  # fmt: skip
    with pytest.raises(ValueError, match="prompt_offsets: offsets must be non-decreasing"):
        batch = _core.SamplingBatch(
            **neutral, prompt_tokens=torch.tensor([1, 2], dtype=torch.int32),
            prompt_offsets=[0, 2, 1], output_tokens=torch.tensor([], dtype=torch.int32),
            output_offsets=[0, 0, 0],
        )  # fmt: skip
        _core.sample(logits, batch)
    with pytest.raises(ValueError, match="logits: .*dtype"):
        sample(logits.double(), seeds=[1, 2])
    with pytest.raises(ValueError, match="logits: must be contiguous"):
        sample(torch.randn(10, 2).t(), seeds=[1, 2])
    with pytest.raises(ValueError, match="prompt_tokens: expected dtype"):
        _core.SamplingBatch(
            **neutral, prompt_tokens=torch.tensor([1], dtype=torch.int64), prompt_offsets=[0, 1, 1],
            output_tokens=torch.tensor([], dtype=torch.int32), output_offsets=[0, 0, 0],
        )  # fmt: skip
    with pytest.raises(ValueError, match="batch: has 2 rows, logits has 3"):
        _core.sample(torch.randn(3, 10), _core.SamplingBatch(**neutral))

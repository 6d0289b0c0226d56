"""The recurrent token mixers' CPU kernels (``_core.causal_conv1d``,
``_core.gated_delta_rule`` and its linear rule, Mamba-2's scan, with
``_core.mamba_gates`` / ``_core.mamba_norm``) against torch, over packed batches: several
sequences of different lengths (empty ones too) in one call, each with its
state at a slot of its own, updated in place.

References: the convolution written per sequence with ``F.conv1d`` (in f32
the kernel agrees to ~1e-5; in bf16 torch rounds the convolution and the SiLU
separately, the kernel once, so a few bf16 steps apart), and the gated delta
rule of transformers' Qwen3.5 code, both its recurrent and its chunked torch
forms, run per sequence from the sequence's state.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastllm import _core  # noqa: E402

qwen35 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

F = torch.nn.functional
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
LENGTHS = st.lists(
    st.sampled_from([0, 1, 2, 3, 5, 15, 16, 17, 63, 64, 65, 130]), min_size=1, max_size=4
)


def packed(lens: list[int], g: torch.Generator, extra_slots: int = 2):
    """``query_start_loc`` (int32), ``state_slots`` (int64, a random
    permutation of the slots) and the number of slots."""
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    slots = len(lens) + extra_slots
    ids = torch.randperm(slots, generator=g)[: len(lens)].to(torch.int64)
    return qsl, ids, slots


def spans(qsl, ids):
    q = qsl.tolist()
    return [(q[i], q[i + 1], s) for i, s in enumerate(ids.tolist())]


def conv_reference(x, weight, bias, conv_state, qsl, ids, silu):
    """Per sequence, ``F.conv1d`` over its state followed by its rows, in
    x's dtype; returns the output and the new states."""
    out = torch.zeros_like(x)
    state = conv_state.clone()
    channels, width = weight.shape
    for first, end, slot in spans(qsl, ids):
        if first == end:
            continue
        xin = torch.cat([state[slot].t(), x[first:end]])
        y = F.conv1d(xin.t()[None], weight[:, None], bias, groups=channels)[0].t()
        out[first:end] = F.silu(y) if silu else y
        state[slot] = xin[-(width - 1) :].t()
    return out, state


@settings(max_examples=40, deadline=None)
@given(
    lens=LENGTHS,
    channels=st.integers(1, 300),
    width=st.integers(2, 8),
    silu=st.booleans(),
    bias=st.booleans(),
    dtype=st.sampled_from(list(DTYPES)),
    seed=st.integers(0, 2**31 - 1),
)
def test_causal_conv1d_matches_torch(lens, channels, width, silu, bias, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    qsl, ids, slots = packed(lens, g)
    tokens = sum(lens)
    x = torch.randn(tokens, channels, generator=g).to(dt)
    weight = (torch.randn(channels, width, generator=g) / width**0.5).to(dt)
    b = torch.randn(channels, generator=g).to(dt) if bias else None
    conv_state = torch.randn(slots, channels, width - 1, generator=g).to(dt)
    ref, ref_state = conv_reference(x, weight, b, conv_state, qsl, ids, silu)
    out = torch.full_like(x, float("nan"))
    _core.causal_conv1d(out, x, weight, b, conv_state, qsl, ids, silu)
    if dt == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(conv_state, ref_state)


def delta_inputs(g, tokens, hk, hv, dk, dv, l2norm, dtype):
    q = torch.randn(tokens, hk, dk, generator=g)
    # Without the normalisation, keys of norm about 1 keep the rule stable.
    k = torch.randn(tokens, hk, dk, generator=g) * (1.0 if l2norm else 0.5 / dk**0.5)
    v = torch.randn(tokens, hv, dv, generator=g)
    decay = -F.softplus(torch.randn(tokens, hv, generator=g) * 2 - 1)
    beta = torch.sigmoid(torch.randn(tokens, hv, generator=g))
    return q.to(dtype), k.to(dtype), v.to(dtype), decay, beta


def delta_reference(fn, q, k, v, decay, beta, state, qsl, ids, l2norm):
    """transformers' torch form ``fn`` per sequence from its slot's state."""
    out = torch.zeros(v.shape, dtype=torch.float32)
    state = state.clone()
    for first, end, slot in spans(qsl, ids):
        if first == end:
            continue
        rows = slice(first, end)
        o, final = fn(
            q[None, rows].float(),
            k[None, rows].float(),
            v[None, rows].float(),
            decay[None, rows],
            beta[None, rows],
            initial_state=state[slot][None],
            output_final_state=True,
            use_qk_l2norm_in_kernel=l2norm,
        )
        out[rows] = o[0]
        state[slot] = final[0]
    return out, state


@settings(max_examples=30, deadline=None)
@given(
    lens=LENGTHS,
    hk=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    dk=st.sampled_from([8, 16, 24, 64]),
    dv=st.sampled_from([8, 16, 40, 64]),
    l2norm=st.booleans(),
    dtype=st.sampled_from(list(DTYPES)),
    chunked=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_gated_delta_rule_matches_transformers(
    lens, hk, group, dk, dv, l2norm, dtype, chunked, seed
):
    g = torch.Generator().manual_seed(seed)
    hv = hk * group
    qsl, ids, slots = packed(lens, g)
    q, k, v, decay, beta = delta_inputs(g, sum(lens), hk, hv, dk, dv, l2norm, DTYPES[dtype])
    state = torch.randn(slots, hv, dk, dv, generator=g) * 0.5
    fn = qwen35.torch_chunk_gated_delta_rule if chunked else qwen35.torch_recurrent_gated_delta_rule
    ref, ref_state = delta_reference(fn, q, k, v, decay, beta, state, qsl, ids, l2norm)
    out = torch.full_like(v, float("nan"))
    _core.gated_delta_rule(out, q, k, v, decay, beta, state, qsl, ids, dk**-0.5, l2norm)
    top = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    rtol = 1e-4 if dtype == "f32" else 2**-8
    torch.testing.assert_close(out.float(), ref, rtol=rtol, atol=1e-4 * top)
    state_top = max(1.0, ref_state.abs().max().item())
    torch.testing.assert_close(state, ref_state, rtol=1e-4, atol=1e-4 * state_top)


@settings(max_examples=15, deadline=None)
@given(split=st.integers(1, 99), l2norm=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_gated_delta_rule_state_carries_across_calls(split, l2norm, seed):
    g = torch.Generator().manual_seed(seed)
    rows, hk, hv, dk, dv = 100, 1, 2, 32, 16
    q, k, v, decay, beta = delta_inputs(g, rows, hk, hv, dk, dv, l2norm, torch.float32)
    state0 = torch.randn(2, hv, dk, dv, generator=g) * 0.5
    ids = torch.tensor([1])
    whole, state = torch.empty_like(v), state0.clone()
    _core.gated_delta_rule(
        whole,
        q,
        k,
        v,
        decay,
        beta,
        state,
        torch.tensor([0, rows], dtype=torch.int32),
        ids,
        0.2,
        l2norm,
    )
    parts, carried = torch.empty_like(v), state0.clone()
    for r in (slice(0, split), slice(split, rows)):
        n = r.stop - r.start
        qsl = torch.tensor([0, n], dtype=torch.int32)
        _core.gated_delta_rule(
            parts[r], q[r], k[r], v[r], decay[r], beta[r], carried, qsl, ids, 0.2, l2norm
        )
    torch.testing.assert_close(parts, whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(carried, state, rtol=1e-4, atol=1e-4)
    assert torch.equal(carried[0], state0[0])


def conv_args(dtype=torch.float32, tokens=5, channels=6, width=4, slots=3):
    x = torch.randn(tokens, channels).to(dtype)
    return dict(
        out=torch.empty_like(x),
        x=x,
        weight=torch.randn(channels, width).to(dtype),
        bias=None,
        conv_state=torch.zeros(slots, channels, width - 1, dtype=dtype),
        query_start_loc=torch.tensor([0, 2, tokens], dtype=torch.int32),
        state_slots=torch.tensor([2, 0]),
        silu=True,
    )


def delta_args(tokens=5, hk=1, hv=2, dk=8, dv=4, slots=3):
    return dict(
        out=torch.empty(tokens, hv, dv),
        q=torch.randn(tokens, hk, dk),
        k=torch.randn(tokens, hk, dk),
        v=torch.randn(tokens, hv, dv),
        g=-torch.rand(tokens, hv),
        beta=torch.rand(tokens, hv),
        state=torch.zeros(slots, hv, dk, dv),
        query_start_loc=torch.tensor([0, 2, tokens], dtype=torch.int32),
        state_slots=torch.tensor([2, 0]),
        scale=dk**-0.5,
        l2norm=True,
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(x=torch.zeros(5, 6, dtype=torch.float16)), "^x: expected dtype"),
        (dict(weight=torch.zeros(6, 4, dtype=torch.bfloat16)), "^weight: expected dtype"),
        (dict(bias=torch.zeros(5)), "^bias: dimension 0"),
        (dict(conv_state=torch.zeros(3, 6, 2)), "^conv_state: dimension 2"),
        (dict(weight=torch.zeros(6, 9)), "^weight: kernel width"),
        (dict(state_slots=torch.tensor([3, 0])), "^state_slots: slot 3"),
        (dict(state_slots=torch.tensor([-1, 0])), "^state_slots: slot -1"),
        (dict(state_slots=torch.tensor([1, 1])), "^state_slots: slot 1 is used by two"),
        (dict(state_slots=torch.tensor([2, 0], dtype=torch.int32)), "^state_slots: expected dtype"),
        (dict(query_start_loc=torch.tensor([0, 2, 4], dtype=torch.int32)), "^query_start_loc"),
        (dict(query_start_loc=torch.tensor([0, 3, 2, 5], dtype=torch.int32)), "^query_start_loc"),
    ],
)
def test_causal_conv1d_rejects_bad_arguments(change, message):
    args = conv_args()
    args.update(change)
    with pytest.raises(ValueError, match=message):
        _core.causal_conv1d(**args)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(q=torch.zeros(5, 1, 8, dtype=torch.bfloat16)), "^k: expected dtype"),
        (dict(g=torch.zeros(5, 2, dtype=torch.bfloat16)), "^g: expected dtype"),
        (dict(state=torch.zeros(3, 2, 8, 4, dtype=torch.bfloat16)), "^state: expected dtype"),
        (dict(out=torch.zeros(5, 2, 4, dtype=torch.bfloat16)), "^out: expected dtype"),
        (dict(q=torch.zeros(5, 3, 8), k=torch.zeros(5, 3, 8)), "^v: value heads"),
        (dict(state=torch.zeros(3, 2, 8, 5)), "^state: dimension 3"),
        (dict(beta=torch.zeros(5, 3)), "^beta: dimension 1"),
        (dict(state_slots=torch.tensor([0, 3])), "^state_slots: slot 3"),
        (dict(query_start_loc=torch.tensor([1, 2, 5], dtype=torch.int32)), "^query_start_loc"),
    ],
)
def test_gated_delta_rule_rejects_bad_arguments(change, message):
    args = delta_args()
    args.update(change)
    with pytest.raises(ValueError, match=message):
        _core.gated_delta_rule(**args)


def test_out_must_not_alias_the_state():
    args = delta_args()
    args["out"] = args["state"].view(-1)[: 5 * 2 * 4].view(5, 2, 4)
    with pytest.raises(ValueError, match="^out: must not share memory with state"):
        _core.gated_delta_rule(**args)


def _ulps(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|got - want| in units of ``dtype``'s spacing at ``want`` (float32 maths)."""
    spacing = 2.0 ** (torch.frexp(want.float())[1] - (8 if dtype == torch.bfloat16 else 24))
    return ((got.float() - want.float()).abs() / spacing.clamp_min(2.0**-126)).max()


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 9),
    heads=st.integers(1, 5),
    dim=st.sampled_from([1, 8, 16, 33, 128]),
    dtype=st.sampled_from(sorted(DTYPES)),
    seed=st.integers(0, 2**31 - 1),
)
def test_qwen3_5_gates_and_gated_norm_match_transformers(rows, heads, dim, dtype, seed):
    """``_core.gated_rms_norm`` against transformers' ``Qwen3_5RMSNormGated``,
    ``_core.delta_gates`` against its ``beta`` / ``g`` expressions (softplus
    past its threshold of 20 too) and ``_core.sigmoid_mul`` against
    ``x * sigmoid(gate)``: within one step of the dtype (float32: a few
    float32 steps; the kernels' exp is not torch's)."""
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows * heads, dim, generator=g) * 3).to(dt)
    z = (torch.randn(rows * heads, dim, generator=g) * 4).to(dt)
    norm = qwen35.Qwen3_5RMSNormGated(dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=g))
    norm = norm.to(dt)
    want = norm(x, z)
    got = torch.empty_like(x)
    _core.gated_rms_norm(got, x, z, norm.weight.detach(), 1e-6)
    limit = 1.0 if dt == torch.bfloat16 else 64.0
    assert _ulps(got, want, dt) <= limit

    a = (torch.randn(rows, heads, generator=g) * 12).to(dt)
    b = (torch.randn(rows, heads, generator=g) * 6).to(dt)
    a[0, 0] = 30.0  # softplus(x) = x past 20
    a_log = torch.randn(heads, generator=g)
    dt_bias = torch.randn(heads, generator=g)
    beta, gate = torch.empty(rows, heads), torch.empty(rows, heads)
    _core.delta_gates(gate, beta, a, b, a_log, dt_bias)
    want_beta = b.sigmoid().float()
    want_g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    step = 1.0 if dt == torch.bfloat16 else 4.0  # float32: a few steps (another exp)
    assert _ulps(beta, want_beta, dt) <= step
    assert torch.allclose(gate, want_g, rtol=2e-6, atol=1e-6)

    gate_x = (torch.randn(rows, heads * dim, generator=g) * 5).to(dt)
    out = torch.empty_like(gate_x)
    _core.sigmoid_mul(out, x.reshape(rows, -1), gate_x)
    want = x.reshape(rows, -1) * torch.sigmoid(gate_x)
    assert _ulps(out, want, dt) <= step


def test_qwen3_5_elementwise_ops_reject_bad_arguments():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="z: shape"):
        _core.gated_rms_norm(torch.empty(2, 8), x, torch.zeros(2, 4), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="weight: dimension 0 must be 8"):
        _core.gated_rms_norm(torch.empty(2, 8), x, x, torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="gate: shape"):
        _core.sigmoid_mul(torch.empty(2, 8), x, torch.zeros(8, 2))
    with pytest.raises(ValueError, match="out: expected dtype"):
        _core.sigmoid_mul(torch.empty(2, 8, dtype=torch.bfloat16), x, x)
    g, beta = torch.empty(2, 8), torch.empty(2, 8)
    with pytest.raises(ValueError, match="A_log: dimension 0 must be 8"):
        _core.delta_gates(g, beta, x, x, torch.zeros(3), torch.zeros(8))
    with pytest.raises(ValueError, match="dt_bias: expected dtype"):
        _core.delta_gates(g, beta, x, x, torch.zeros(8), torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="g: must not share memory with beta"):
        _core.delta_gates(g, g, x, x, torch.zeros(8), torch.zeros(8))


granite4 = pytest.importorskip("transformers.models.granitemoehybrid.modeling_granitemoehybrid")


def mamba_reference(chunked, x, dt, a_log, dt_bias, b, c, state, qsl, ids, limit, chunk):
    """transformers' Granite 4.0 scan per sequence from its slot's state (ours
    [H, N, P], theirs [H, P, N]): the chunked form (``mamba2_chunk_scan``,
    chunks of ``chunk``) or token by token (``mamba2_selective_state_update``,
    which clamps nothing: those cases have no limit)."""
    p = x.shape[2]
    a = -torch.exp(a_log.float())
    out = torch.zeros(x.shape, dtype=torch.float32)
    state = state.clone()
    for first, end, slot in spans(qsl, ids):
        if first == end:
            continue
        theirs = state[slot].transpose(1, 2).contiguous()
        if chunked:
            o, final = granite4.mamba2_chunk_scan(
                x[None, first:end].float(), dt[None, first:end].float(), a,
                b[None, first:end].float(), c[None, first:end].float(), chunk,
                dt_bias=dt_bias, initial_states=theirs[None], dt_softplus=True,
                dt_limit=limit, return_final_states=True,
            )  # fmt: skip
            out[first:end], theirs = o[0], final[0]
        else:
            for t in range(first, end):
                n = b.shape[-1]
                s = theirs[None].clone()
                o = granite4.mamba2_selective_state_update(
                    s, x[None, t].float(), dt[None, t, :, None].float().expand(-1, -1, p),
                    a[:, None, None].expand(-1, p, n), b[None, t].float(), c[None, t].float(),
                    dt_bias=dt_bias[:, None].expand(-1, p), dt_softplus=True,
                )  # fmt: skip
                out[t], theirs = o[0], s[0]
        state[slot] = theirs.transpose(1, 2)
    return out, state


@settings(max_examples=30, deadline=None)
@given(
    lens=LENGTHS,
    groups=st.sampled_from([1, 2]),
    per_group=st.sampled_from([1, 3]),
    n=st.sampled_from([4, 16, 64]),
    p=st.sampled_from([8, 32, 40]),
    dtype=st.sampled_from(list(DTYPES)),
    chunked=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_mamba2_scan_matches_transformers(lens, groups, per_group, n, p, dtype, chunked, seed):
    """``_core.mamba_gates`` then ``_core.gated_delta_rule(..., linear=True)``
    (Mamba-2's scan: k = B, v = x, q = C, beta = dt, g = dt A) against
    transformers' Granite 4.0 scan, chunked (with a time-step limit that
    clamps) and token by token, from each sequence's state."""
    g = torch.Generator().manual_seed(seed)
    dt_ = DTYPES[dtype]
    heads, tokens = groups * per_group, sum(lens)
    qsl, ids, slots = packed(lens, g)
    x = torch.randn(tokens, heads, p, generator=g).to(dt_)
    b = (torch.randn(tokens, groups, n, generator=g) / n**0.5).to(dt_)
    c = torch.randn(tokens, groups, n, generator=g).to(dt_)
    dt = (torch.randn(tokens, heads, generator=g) * 2).to(dt_)
    a_log, dt_bias = torch.randn(heads, generator=g), torch.randn(heads, generator=g)
    limit = (0.05, 1.5) if chunked else (0.0, float("inf"))
    state = torch.randn(slots, heads, n, p, generator=g) * 0.5
    ref, ref_state = mamba_reference(
        chunked, x, dt, a_log, dt_bias, b, c, state, qsl, ids, limit, 16
    )
    gate, beta = torch.empty(tokens, heads), torch.empty(tokens, heads)
    _core.mamba_gates(gate, beta, dt, a_log, dt_bias, *limit)
    out = torch.full_like(x, float("nan"))
    _core.gated_delta_rule(out, c, b, x, gate, beta, state, qsl, ids, 1.0, False, True)
    top = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    rtol = 1e-4 if dtype == "f32" else 2**-8
    torch.testing.assert_close(out.float(), ref, rtol=rtol, atol=1e-4 * top)
    state_top = max(1.0, ref_state.abs().max().item())
    torch.testing.assert_close(state, ref_state, rtol=1e-4, atol=1e-4 * state_top)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 9),
    heads=st.sampled_from([1, 2, 4, 6]),
    p=st.sampled_from([1, 8, 33]),
    groups=st.sampled_from([1, 2]),
    dtype=st.sampled_from(sorted(DTYPES)),
    seed=st.integers(0, 2**31 - 1),
)
def test_mamba2_norm_matches_transformers(rows, heads, p, groups, dtype, seed):
    """``_core.mamba_norm`` against transformers' ``GraniteMoeHybridRMSNormGated``
    of ``y + D x`` (the scan and its skip, in float32 as its prompt path
    adds them) gated by z: within a step of bfloat16, a few of float32."""
    if heads % groups:
        groups = 1
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(seed)
    dim = heads * p
    y, x, z = ((torch.randn(rows, dim, generator=g) * 3).to(dt) for _ in range(3))
    d = torch.randn(heads, generator=g)
    norm = granite4.GraniteMoeHybridRMSNormGated(dim, dim // groups, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=g))
    skip = (y.float().view(rows, heads, p) + d[:, None] * x.float().view(rows, heads, p)).view(
        rows, dim
    )
    want = norm.to(dt)(skip, z)
    got = torch.empty_like(y)
    _core.mamba_norm(got, y, x, z, d, norm.weight.detach(), groups, 1e-5)
    assert _ulps(got, want.to(dt), dt) <= (1.0 if dt == torch.bfloat16 else 64.0)
    with pytest.raises(ValueError, match="weight: dimension 0"):
        _core.mamba_norm(got, y, x, z, d, torch.ones(dim + 1, dtype=dt), groups, 1e-5)
    with pytest.raises(ValueError, match="whole heads"):
        _core.mamba_norm(got, y, x, z, torch.ones(dim + 1), norm.weight.detach(), groups, 1e-5)

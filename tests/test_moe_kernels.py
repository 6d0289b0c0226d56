"""The mixture-of-experts CPU kernels (``_core.moe_route``, ``_core.MoeExperts``)
against torch.

Expert reference: transformers' MoE block written out (for each expert, its
tokens' rows through gate/up, activation, down, then ``index_add_`` of
``weight * row``) in float64 on the very same (bf16-rounded) inputs and
weights. The kernel rounds gate/up, activation and down outputs to the model
dtype, as torch does, and sums the experts in f32: float32 results are within
``1e-5`` of the magnitude of the sum, bf16 ones within a few 2^-8. Quantized
experts are checked against the same ``QuantizedLinear`` layers run expert by
expert (bit for bit with SiLU) and loosely against the float reference.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastllm import _core  # noqa: E402

F = torch.nn.functional
GEMM_PATHS = _core.gemm_paths()
QUANT_PATHS = _core.quant_paths()
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
ACTS = ["silu", "gelu_tanh", "swiglu_oai"]
# gpt-oss's alpha; a limit that random gates and ups reach.
ALPHA, LIMIT = 1.702, 1.5
# Relative error of the whole layer against the float reference (RMS).
QUANT_RMS = {"q8_0": 0.05, "q4_0": 0.35, "iq4_nl": 0.35, "q4_1": 0.35}


def act_ref(name: str, gu):
    """The model's torch activation of a fused gate/up output (gate first)."""
    i = gu.shape[1] // 2
    g, u = gu[:, :i], gu[:, i:]
    if name == "silu":
        return F.silu(g) * u
    if name == "gelu_tanh":
        return F.gelu(g, approximate="tanh") * u
    g = g.clamp(max=LIMIT)
    u = u.clamp(-LIMIT, LIMIT)
    return (u + 1) * (g * torch.sigmoid(g * ALPHA))


def moe_reference(x, ids, weights, experts, act):
    """transformers' MoE loop in float64; also the magnitude of each sum
    (``sum |w| * (|h| @ |W_down|^T + |b_down|)``), the scale of its error."""
    xd = x.double()
    out = torch.zeros_like(xd)
    mag = torch.zeros_like(xd)
    for e, (wgu, bgu, wd, bd) in enumerate(experts):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        bgu = None if bgu is None else bgu.double()
        h = act_ref(act, F.linear(xd[tok], wgu.double(), bgu))
        bd_abs = None if bd is None else bd.double().abs()
        y = F.linear(h, wd.double(), None if bd is None else bd.double())
        w = weights[tok, slot].double()[:, None]
        out.index_add_(0, tok, y * w)
        mag.index_add_(0, tok, F.linear(h.abs(), wd.double().abs(), bd_abs) * w.abs())
    return out, mag


def random_experts(g, n, h, i, dtype, bias):
    """[(w_gate_up [2i, h], b, w_down [h, i], b)] in ``dtype``."""
    out = []
    for _ in range(n):
        wgu = (torch.randn(2 * i, h, generator=g) / h**0.5).to(dtype)
        wd = (torch.randn(h, i, generator=g) / i**0.5).to(dtype)
        bgu = (0.1 * torch.randn(2 * i, generator=g)).to(dtype) if bias else None
        bd = (0.1 * torch.randn(h, generator=g)).to(dtype) if bias else None
        out.append((wgu, bgu, wd, bd))
    return out


def random_routing(g, tokens, experts, k, one_expert):
    """ids int32 [T, k] (distinct experts per token) and weights float32
    [T, k]; with ``one_expert``, every token's first slot is one expert."""
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    if one_expert:
        e0 = int(torch.randint(experts, (1,), generator=g))
        for t in range(tokens):
            row = [e0] + [e for e in ids[t].tolist() if e != e0]
            ids[t] = torch.tensor(row[:k])
    weights = torch.rand(tokens, k, generator=g) + 0.05
    return ids.to(torch.int32), weights


def run(layer, x, ids, weights):
    out = torch.full_like(x, float("nan"))
    layer.forward(out, x, ids, weights)
    return out


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(1, 40),
    h=st.integers(1, 96),
    i=st.integers(1, 64),
    n_experts=st.integers(1, 8),
    k=st.integers(1, 3),
    one_expert=st.booleans(),
    dtype=st.sampled_from(["bf16", "f32"]),
    act=st.sampled_from(ACTS),
    bias=st.booleans(),
    path=st.sampled_from(GEMM_PATHS),
    seed=st.integers(0, 2**31 - 1),
)
def test_packed_experts_match_torch_reference(
    tokens, h, i, n_experts, k, one_expert, dtype, act, bias, path, seed
):
    k = min(k, n_experts)
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    experts = random_experts(g, n_experts, h, i, dt, bias)
    gate_up = [_core.PackedLinear(wgu, bgu, path=path) for wgu, bgu, _, _ in experts]
    down = [_core.PackedLinear(wd, bd, path=path) for _, _, wd, bd in experts]
    layer = _core.MoeExperts(gate_up, down, act, alpha=ALPHA, limit=LIMIT)
    assert (layer.num_experts, layer.hidden_size, layer.intermediate_size) == (n_experts, h, i)
    assert layer.path == path
    assert layer.nbytes == sum(lin.nbytes for lin in gate_up + down)
    x = torch.randn(tokens, h, generator=g).to(dt)
    ids, weights = random_routing(g, tokens, n_experts, k, one_expert)
    out = run(layer, x, ids, weights)
    ref, mag = moe_reference(x, ids, weights, experts, act)
    if dt == torch.float32:
        tol = 1e-5 * (mag + mag.max()) + 1e-30
    else:
        tol = 2.0**-6 * mag + 2.0**-8 * mag.max() + 1e-30
    err = (out.double() - ref).abs()
    assert not (err > tol).any(), f"worst err {err.max().item()} ({layer!r}, T={tokens})"


def expert_by_expert(layers, x, ids, weights, act):
    """The same layers run expert by expert through ``QuantizedLinear.forward``
    (the activation: ``_core.silu_and_mul``, else torch in the model dtype),
    summed in f32 in expert order as the kernel does; also the slack of a
    rare int8 flip in the activations the down projection quantizes (and,
    in bf16, of a rare one-ulp flip of a rounded activation or output)."""
    tokens, h = x.shape
    ulp = 2.0**-7 if x.dtype == torch.bfloat16 else 0.0
    acc = torch.zeros(tokens, h)
    slack = torch.zeros(tokens, h, dtype=torch.float64)
    for e, (gu_layer, down_layer, wd) in enumerate(layers):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        rows = x[tok].contiguous()
        gu = torch.empty(len(tok), gu_layer.out_features, dtype=x.dtype)
        gu_layer.forward(gu, rows)
        if act == "silu":
            hid = torch.empty(len(tok), gu.shape[1] // 2, dtype=x.dtype)
            _core.silu_and_mul(hid, gu)
        else:
            hid = act_ref(act, gu).contiguous()
        y = torch.empty(len(tok), h, dtype=x.dtype)
        down_layer.forward(y, hid)
        w = weights[tok, slot][:, None]
        acc.index_add_(0, tok, y.float() * w)
        flip = hid.double().abs().amax(1, keepdim=True) / 127 * wd.abs().max()
        slack.index_add_(0, tok, (2 * flip + ulp * y.double().abs()) * w.double())
    return acc.to(x.dtype), slack


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(1, 40),
    h=st.sampled_from([32, 64, 96]),
    i=st.sampled_from([32, 64]),
    n_experts=st.integers(1, 8),
    k=st.integers(1, 3),
    one_expert=st.booleans(),
    dtype=st.sampled_from(["bf16", "f32"]),
    act=st.sampled_from(ACTS),
    bias=st.booleans(),
    fmt=st.sampled_from(list(QUANT_RMS)),
    path=st.sampled_from(QUANT_PATHS),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantized_experts_match_expert_by_expert(
    tokens, h, i, n_experts, k, one_expert, dtype, act, bias, fmt, path, seed
):
    k = min(k, n_experts)
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    experts = random_experts(g, n_experts, h, i, dt, bias)
    q = [
        (
            _core.QuantizedLinear(wgu, bgu, format=fmt, path=path),
            _core.QuantizedLinear(wd, bd, format=fmt, path=path),
            wd.double(),
        )
        for wgu, bgu, wd, bd in experts
    ]
    layer = _core.MoeExperts([a for a, _, _ in q], [b for _, b, _ in q], act, ALPHA, LIMIT)
    assert layer.path == path
    x = torch.randn(tokens, h, generator=g).to(dt)
    ids, weights = random_routing(g, tokens, n_experts, k, one_expert)
    out = run(layer, x, ids, weights)
    want, slack = expert_by_expert(q, x, ids, weights, act)
    if act == "silu":
        assert torch.equal(out, want), f"{layer!r}"
    else:
        err = (out.double() - want.double()).abs()
        tol = 1e-5 * want.double().abs().max() + slack
        assert not (err > tol).any(), f"worst err {err.max().item()} ({layer!r})"
    ref, _ = moe_reference(x, ids, weights, experts, act)
    rms = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    assert rms < QUANT_RMS[fmt], f"{fmt}: relative RMS error {rms}"


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(0, 40),
    n_experts=st.integers(1, 64),
    k=st.integers(1, 8),
    scoring=st.sampled_from(["softmax", "sigmoid"]),
    renormalize=st.booleans(),
    biased=st.booleans(),
    scale=st.sampled_from([1.0, 2.5]),
    seed=st.integers(0, 2**31 - 1),
)
def test_moe_route_matches_torch(tokens, n_experts, k, scoring, renormalize, biased, scale, seed):
    """Against a plain torch router written here: scores, the top-k (on the
    scores plus LFM2-MoE's selection bias where given), the weights the
    unbiased scores, renormalised with an epsilon, scaled."""
    k = min(k, n_experts)
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(tokens, n_experts, generator=g)
    bias = 0.5 * torch.randn(n_experts, generator=g) if biased else None
    eps = 1e-6 if biased else 0.0
    ids = torch.full((tokens, k), -1, dtype=torch.int32)
    weights = torch.full((tokens, k), float("nan"))
    _core.moe_route(
        ids,
        weights,
        logits,
        scoring=scoring,
        renormalize=renormalize,
        selection_bias=None if bias is None else bias.tolist(),
        renorm_eps=eps,
        scale=scale,
    )
    if scoring == "softmax":
        p = F.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        p = torch.sigmoid(logits)
    key = p if bias is None else p + bias
    top_key, chosen = torch.topk(key, k, dim=-1)
    # The same choice (an exact tie may pick either expert): distinct
    # experts, in descending order of the score they were chosen by.
    ours = key.gather(1, ids.long())
    torch.testing.assert_close(ours, top_key, rtol=1e-6, atol=0)
    assert all(len(set(row)) == k for row in ids.tolist())
    top = p.gather(1, chosen)
    if renormalize:
        top = top / (top.sum(-1, keepdim=True) + eps)
    torch.testing.assert_close(weights, top * scale, rtol=1e-5, atol=1e-7)


def test_moe_route_ties_pick_the_lower_expert():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.5, 2.0]])
    ids = torch.empty(1, 2, dtype=torch.int32)
    weights = torch.empty(1, 2)
    _core.moe_route(ids, weights, logits, "sigmoid", False)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[2.0, 2.0]])))


def test_moe_route_errors_name_the_argument():
    logits = torch.randn(3, 4)
    ids = torch.empty(3, 2, dtype=torch.int32)
    weights = torch.empty(3, 2)
    with pytest.raises(ValueError, match="scoring: unknown value 'relu'"):
        _core.moe_route(ids, weights, logits, scoring="relu")
    with pytest.raises(ValueError, match="selection_bias: expected 4 values"):
        _core.moe_route(ids, weights, logits, selection_bias=[0.0, 1.0])
    with pytest.raises(ValueError, match="renorm_eps"):
        _core.moe_route(ids, weights, logits, renorm_eps=-1.0)
    with pytest.raises(ValueError, match="logits"):
        _core.moe_route(ids, weights, logits.double())
    with pytest.raises(ValueError, match="ids"):
        _core.moe_route(ids.long(), weights, logits)
    with pytest.raises(ValueError, match="ids"):
        _core.moe_route(torch.empty(3, 5, dtype=torch.int32), torch.empty(3, 5), logits)
    with pytest.raises(ValueError, match="ids"):
        _core.moe_route(torch.empty(2, 2, dtype=torch.int32), weights, logits)
    with pytest.raises(ValueError, match="weights"):
        _core.moe_route(ids, torch.empty(3, 3), logits)


def test_moe_experts_errors_name_the_argument():
    g = torch.Generator().manual_seed(0)
    (wgu, _, wd, _), (wgu2, _, wd2, _) = random_experts(g, 2, 8, 4, torch.float32, False)
    gate_up = [_core.PackedLinear(wgu), _core.QuantizedLinear(wgu2)]
    down = [_core.PackedLinear(wd), _core.PackedLinear(wd2)]
    with pytest.raises(ValueError, match="activation: unknown value 'gelu'"):
        _core.MoeExperts(gate_up, down, "gelu")
    with pytest.raises(ValueError, match=r"gate_up\[1\]: expected a PackedLinear"):
        _core.MoeExperts([gate_up[0], wgu2], down)
    with pytest.raises(ValueError, match=r"down\[1\]: expected a \[8, 4\] weight, got \[8, 8\]"):
        _core.MoeExperts(gate_up, [down[0], gate_up[0]])
    with pytest.raises(ValueError, match="down: expected 2 weights"):
        _core.MoeExperts(gate_up, down[:1])
    layer = _core.MoeExperts(gate_up, down, "swiglu_oai")
    assert repr(layer).startswith("MoeExperts(num_experts=2, hidden_size=8, intermediate_size=4")
    x = torch.randn(3, 8)
    ids = torch.tensor([[0, 1], [1, 0], [0, 1]], dtype=torch.int32)
    weights = torch.ones(3, 2)
    out = run(layer, x, ids, weights)
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="ids: token 2 routes to expert 2"):
        layer.forward(out, x, torch.tensor([[0, 1], [1, 0], [0, 2]], dtype=torch.int32), weights)
    with pytest.raises(ValueError, match="x"):
        layer.forward(out, torch.randn(3, 7), ids, weights)
    with pytest.raises(ValueError, match="out"):
        layer.forward(out.bfloat16(), x, ids, weights)
    with pytest.raises(ValueError, match="ids"):
        layer.forward(out, x, ids.long(), weights)
    with pytest.raises(ValueError, match="weights"):
        layer.forward(out, x, ids, torch.ones(3, 1))
    with pytest.raises(ValueError, match="must not share memory"):
        layer.forward(x, x, ids, weights)

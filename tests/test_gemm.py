"""The packed-weight CPU GEMM (``_core.PackedLinear``) and the CPU layer
kernels (``_core.rms_norm``, ``_core.silu_and_mul``) against torch.

GEMM reference: float32 torch on the very same (bf16-rounded) inputs. A bf16
result is rounded once at the end (2^-8 of its magnitude); the f32 sums run in
the kernel's own order, bounded by ``3e-5 * (|x| @ |w|^T)``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastllm import _core  # noqa: E402

# avx512bf16 runs the vdpbf16ps tile for bf16 weights with bf16 x, else the AVX-512F kernel.
PATHS = _core.gemm_paths()
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def gemm_reference(x, w, b):
    xf, wf = x.float(), w.float()
    bf = None if b is None else b.float()
    ref = torch.nn.functional.linear(xf, wf, bf)
    mag = torch.nn.functional.linear(xf.abs(), wf.abs(), None if bf is None else bf.abs())
    return ref, mag


@settings(max_examples=80, deadline=None)
@given(
    m=st.integers(1, 80),
    n=st.integers(1, 100),
    k=st.integers(1, 300),
    x_dtype=st.sampled_from(["bf16", "f32"]),
    w_dtype=st.sampled_from(["bf16", "bf16", "f32"]),
    out_dtype=st.sampled_from(["bf16", "f32"]),
    bias=st.booleans(),
    path=st.sampled_from([None, *PATHS]),
    seed=st.integers(0, 2**31 - 1),
)
def test_packed_linear_matches_torch(m, n, k, x_dtype, w_dtype, out_dtype, bias, path, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DTYPES[x_dtype])
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DTYPES[w_dtype])
    b = torch.randn(n, generator=g).to(DTYPES[w_dtype]) if bias else None
    layer = _core.PackedLinear(w, b, path=path)
    assert (layer.in_features, layer.out_features) == (k, n)
    # f32 weights whose every element is a bf16 value are packed as bf16.
    exact = bool(((w.float().view(torch.int32) & 0xFFFF) == 0).all())
    assert layer.weight_dtype == ("bfloat16" if w_dtype == "bf16" or exact else "float32")
    out = torch.full((m, n), float("nan"), dtype=DTYPES[out_dtype])
    layer.forward(out, x)
    ref, mag = gemm_reference(x, w, b)
    rtol = 2.0**-8 if out.dtype == torch.bfloat16 else 0.0
    tol = rtol * ref.abs() + 3e-5 * mag + 1e-30
    err = (out.float() - ref).abs()
    assert not (err > tol).any(), f"worst err {err.max().item()} ({layer!r}, m={m})"


def test_packed_linear_is_batch_invariant_beyond_one_row():
    """Rows of a batch get the same bits as the same rows in another batch
    (the register tiles sum each row in the same order)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 257, generator=g).to(torch.bfloat16)
    x = torch.randn(70, 257, generator=g).to(torch.bfloat16)
    layer = _core.PackedLinear(w)
    full = torch.empty(70, 300, dtype=torch.bfloat16)
    layer.forward(full, x)
    part = torch.empty(9, 300, dtype=torch.bfloat16)
    layer.forward(part, x[30:39].contiguous())
    assert torch.equal(full[30:39], part)


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 40),
    n=st.integers(1, 100),
    k=st.integers(1, 300),
    bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_float32_weights_of_bf16_values_are_stored_as_bf16(m, n, k, bias, seed):
    """A bf16 checkpoint run in float32 (dtype "auto" on a CPU without native
    bf16): ``packed_linear`` keeps its weights in half the bytes, and the f32
    product is the f32 product of the same values."""
    from fastllm.layers.linear import packed_linear

    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16).float()
    b = torch.randn(n, generator=g) if bias else None
    layer = packed_linear(w, b)
    assert layer.weight_dtype == "bfloat16"
    assert layer.nbytes == _core.PackedLinear(w.to(torch.bfloat16), b).nbytes
    assert layer.nbytes == -(-n // 32) * k * 64  # 2 bytes a weight (f32 panels: 4)
    x = torch.randn(m, k, generator=g)
    out = torch.full((m, n), float("nan"))
    layer.forward(out, x)
    ref, mag = gemm_reference(x, w, b)
    err = (out - ref).abs()
    assert not (err > 3e-5 * mag + 1e-30).any(), f"worst err {err.max().item()}"


@pytest.mark.parametrize("at", [0, 7, 255, 256, (1 << 16) - 1, 1 << 16, (1 << 16) + 9])
def test_float32_weights_with_one_wider_value_stay_float32(at):
    """One element that is not a bf16 value (anywhere, across the packer's
    chunks of its check) keeps the whole weight in float32."""
    w = torch.ones(2064, 32).to(torch.bfloat16).float()
    assert _core.PackedLinear(w).weight_dtype == "bfloat16"
    w.view(-1)[at] = 1.0 + 2.0**-20  # not a bf16 value
    layer = _core.PackedLinear(w)
    assert layer.weight_dtype == "float32"
    x = torch.randn(3, 32)
    out = torch.empty(3, 2064)
    layer.forward(out, x)
    ref, mag = gemm_reference(x, w, None)
    assert not ((out - ref).abs() > 3e-5 * mag + 1e-30).any()


def test_packed_linear_errors_name_the_argument():
    w = torch.full((4, 8), 1.0 + 2.0**-20)  # not bf16 values: f32 panels
    layer = _core.PackedLinear(w)
    assert layer.nbytes == 8 * 128
    assert _core.PackedLinear(torch.zeros(4, 8)).nbytes == 8 * 64  # zeros are bf16 values
    with pytest.raises(ValueError, match="x"):
        layer.forward(torch.empty(2, 4), torch.zeros(2, 7))
    with pytest.raises(ValueError, match="out"):
        layer.forward(torch.empty(3, 4), torch.zeros(2, 8))
    with pytest.raises(ValueError, match="bias"):
        _core.PackedLinear(w, torch.zeros(5))
    with pytest.raises(ValueError, match="weight"):
        _core.PackedLinear(torch.zeros(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="unknown linear kernel path 'sse9'"):
        _core.PackedLinear(w, path="sse9")
    with pytest.raises(ValueError, match="must not share memory"):
        buf = torch.zeros(16)
        layer.forward(buf[:8].view(2, 4), buf[:16].view(2, 8))


def torch_rms_norm(x, w, eps):
    """The model's torch RMSNorm (layers/norm.py), written out."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 300),
    dim=st.integers(1, 700),
    dtype=st.sampled_from(["bf16", "f32"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_rms_norm_matches_torch(rows, dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    x = (3 * torch.randn(rows, dim, generator=g)).to(dt)
    w = (1 + 0.1 * torch.randn(dim, generator=g)).to(dt)
    out = torch.empty_like(x)
    _core.rms_norm(out, x, w, 1e-6)
    ref = torch_rms_norm(x, w, 1e-6)
    if dt == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:
        # Two bf16 roundings each side; a sum-order difference can move the
        # first rounding by one step: at most two bf16 ulps apart, and an ulp
        # is up to 2^-7 of the value (at the bottom of a binade).
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 * 2.0**-7, atol=1e-6)


# Gated activations of a fused gate/up row x [rows, 2d]: the kernel, torch's
# activation, and the float32 absolute tolerance. bf16: the kernel's exp or
# erf differs from torch's in the last f32 bits, which can move the rounding
# of act(gate) by one bf16 step, and the product is rounded once more: at
# most two steps of 2^-7.
GATED = {
    "silu_and_mul": (_core.silu_and_mul, torch.nn.functional.silu, 1e-7),
    # The exact (erf) GELU, ModernBERT's GeGLU: erf to 5e-7 absolute, the
    # negative tail as 0.5 g erfc (no cancellation).
    "gelu_and_mul": (_core.gelu_and_mul, torch.nn.functional.gelu, 3e-5),
}


@pytest.mark.parametrize("name", sorted(GATED))
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 300),
    d=st.integers(1, 700),
    dtype=st.sampled_from(["bf16", "f32"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_gated_activation_matches_torch(name, rows, d, dtype, seed):
    """``_core.<act>_and_mul`` equals ``act(x[:, :d]) * x[:, d:]``, the
    activation exact (float64) and rounded to the dtype before the product."""
    kernel, act, f32_atol = GATED[name]
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    x = (4 * torch.randn(rows, 2 * d, generator=g)).to(dt)
    out = torch.empty(rows, d, dtype=dt)
    kernel(out, x)
    # The activation in float64 (torch's float32 GELU loses the far negative
    # tail to cancellation in 1 + erf, which the kernel avoids), rounded to
    # the dtype before the product as the models' torch code rounds it.
    ref = act(x[:, :d].double()).to(dt) * x[:, d:]
    if dt == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=f32_atol)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 * 2.0**-7, atol=1e-6)
    with pytest.raises(ValueError, match="out"):
        kernel(torch.empty(rows, d + 1, dtype=dt), x)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 300),
    dim=st.integers(1, 900),
    dtype=st.sampled_from(["bf16", "f32"]),
    residual=st.booleans(),
    bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_layer_norm_matches_torch(rows, dim, dtype, residual, bias, seed):
    """``_core.layer_norm`` equals torch's ``F.layer_norm(x + residual)`` (the sum
    rounded to the dtype first, as torch adds), with and without a bias."""
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    x = (3 * torch.randn(rows, dim, generator=g) + 1).to(dt)
    r = (2 * torch.randn(rows, dim, generator=g)).to(dt) if residual else None
    w = (1 + 0.1 * torch.randn(dim, generator=g)).to(dt)
    b = (0.1 * torch.randn(dim, generator=g)).to(dt) if bias else None
    out = torch.empty_like(x)
    _core.layer_norm(out, x, r, w, b, 1e-5)
    ref = torch.nn.functional.layer_norm(x if r is None else x + r, (dim,), w, b, 1e-5)
    if dt == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-5)
    else:
        # One rounding each side of the same f32 value up to sum order: one
        # bf16 step apart at most (2^-7 of the value at the bottom of a binade).
        torch.testing.assert_close(out.float(), ref.float(), rtol=2.0**-7, atol=1e-2)


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 300), min_size=1, max_size=3),
    dtype=st.sampled_from(["bf16", "f32"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_gelu_matches_torch(shape, dtype, seed):
    """``_core.gelu`` equals torch's exact (erf) ``F.gelu``."""
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    x = (4 * torch.randn(*shape, generator=g)).to(dt)
    out = torch.empty_like(x)
    _core.gelu(out, x)
    ref = torch.nn.functional.gelu(x)
    if dt == torch.float32:
        # erf to 5e-7 absolute: gelu within 3e-7 * (1 + |x|), |x| < 20 here.
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=6e-6)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2.0**-7, atol=1e-6)


def test_layer_norm_and_gelu_reject_bad_arguments():
    x = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="weight"):
        _core.layer_norm(torch.empty(3, 8), x, None, torch.ones(7), None, 1e-5)
    with pytest.raises(ValueError, match="residual"):
        _core.layer_norm(torch.empty(3, 8), x, torch.zeros(2, 8), torch.ones(8), None, 1e-5)
    with pytest.raises(ValueError, match="bias"):
        _core.layer_norm(torch.empty(3, 8), x, None, torch.ones(8), torch.ones(8).bfloat16(), 1e-5)
    with pytest.raises(ValueError, match="out"):
        _core.gelu(torch.empty(3, 7), x)
    with pytest.raises(ValueError, match="out"):
        _core.gelu(x, x)


def test_layer_kernels_reject_bad_arguments():
    x = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="weight"):
        _core.rms_norm(torch.empty(3, 8), x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        _core.rms_norm(torch.empty(3, 8), x, torch.ones(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="out"):
        _core.silu_and_mul(torch.empty(3, 8), x)
    with pytest.raises(ValueError, match="even"):
        _core.silu_and_mul(torch.empty(3, 3), torch.zeros(3, 7))


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(1, 40),
    kv_heads=st.integers(1, 4),
    group=st.integers(1, 4),
    head_dim=st.sampled_from([2, 8, 10, 64, 80]),
    partial=st.booleans(),
    dtype=st.sampled_from(["bf16", "f32"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_qkv_rotary_matches_torch(tokens, kv_heads, group, head_dim, partial, dtype, seed):
    """The CPU split + rotary kernel gives apply_rotary's values bit for bit
    (same roundings), with partial rotary dims and v passed through."""
    from fastllm.layers.rotary import apply_rotary

    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    heads = kv_heads * group
    half = head_dim // 4 if partial and head_dim >= 4 else head_dim // 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dt)
    angles = torch.rand(tokens, 1, half, generator=g) * 100
    cos, sin = angles.cos().to(dt), angles.sin().to(dt)
    q = torch.empty(tokens, heads, head_dim, dtype=dt)
    k = torch.empty(tokens, kv_heads, head_dim, dtype=dt)
    v = torch.empty(tokens, kv_heads * head_dim, dtype=dt)
    _core.qkv_rotary(q, k, v, qkv, cos.view(tokens, half), sin.view(tokens, half))
    rq, rk, rv = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    assert torch.equal(q, apply_rotary(rq.reshape(tokens, heads, head_dim), cos, sin))
    assert torch.equal(k, apply_rotary(rk.reshape(tokens, kv_heads, head_dim), cos, sin))
    assert torch.equal(v, rv)


def test_qkv_rotary_rejects_bad_shapes():
    qkv = torch.zeros(2, 4 * 8)
    q, k, v = torch.empty(2, 2, 8), torch.empty(2, 1, 8), torch.empty(2, 8)
    cs = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="qkv"):
        _core.qkv_rotary(q, k, v, torch.zeros(2, 30), cs, cs)
    with pytest.raises(ValueError, match="sin"):
        _core.qkv_rotary(q, k, v, qkv, cs, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="cos"):
        _core.qkv_rotary(q, k, v, qkv, torch.zeros(2, 5), torch.zeros(2, 5))


def test_conversions_propagate_a_pending_interrupt():
    class Interrupting:
        @property
        def dtype(self):
            raise KeyboardInterrupt

    x = torch.zeros(2, 4)
    with pytest.raises(KeyboardInterrupt):
        _core.rms_norm(Interrupting(), x, torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="out: expected a torch.Tensor"):
        _core.rms_norm(object(), x, torch.ones(4), 1e-6)


def test_rotary_table_limited_to_the_engine_positions():
    """``limit_positions`` builds the cos/sin table for the positions below the
    limit only, with the same values (against cos/sin of ``p * inv_freq`` in
    float64); a position past it is an error, not a silent wrap."""
    from fastllm.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(16, 16, 32768, 10000.0)
    rope.limit_positions(100)
    assert rope.table_positions == 100
    positions = torch.tensor([0, 1, 57, 99])
    cos, sin = rope.cos_sin(positions, torch.float32)
    assert rope._table.shape[0] == 100
    angles = positions.double()[:, None] * rope.inv_freq.double()[None, :]
    torch.testing.assert_close(cos.view(4, 8), angles.cos().float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(sin.view(4, 8), angles.sin().float(), atol=1e-5, rtol=0)
    with pytest.raises(IndexError):
        rope.cos_sin(torch.tensor([100]), torch.float32)
    rope.limit_positions(10**9)  # never past the model's own maximum
    assert rope.table_positions == 32768

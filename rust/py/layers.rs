//! The CPU elementwise layers: RMSNorm, LayerNorm, GELU, SiLU-and-mul, QKV
//! split + rotary.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::tensor::{check_no_overlap, kernel_dst, kernel_src, DType, TensorArg};
use crate::layers::GatedAct;

/// The tensors every norm takes, checked: x [rows, dim] (bf16 or f32),
/// weight [dim] and out [rows, dim] of x's dtype, out apart from both; and dim.
fn norm_args(
    x: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
) -> PyResult<(TensorArg, TensorArg, TensorArg, usize)> {
    let x = TensorArg::extract("x", x)?;
    x.check(&[DType::BF16, DType::F32], 2)?;
    let dim = x.shape[1];
    let weight = TensorArg::extract("weight", weight)?;
    weight.check(&[x.dtype], 1)?;
    weight.expect_dim(0, dim, "the last dimension of x")?;
    let out = TensorArg::extract("out", out)?;
    out.check(&[x.dtype], 2)?;
    out.expect_dim(0, x.shape[0], "rows of x")?;
    out.expect_dim(1, dim, "the last dimension of x")?;
    check_no_overlap(&out, &x)?;
    check_no_overlap(&out, &weight)?;
    Ok((x, weight, out, dim))
}

/// out [rows, dim] = RMSNorm(x [rows, dim]) * weight [dim]; one dtype.
#[pyfunction]
fn rms_norm(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    eps: f32,
) -> PyResult<()> {
    let (x, weight, out, dim) = norm_args(x, weight, out)?;
    // SAFETY: all three were checked (dtype, CPU, contiguity, shape) and out
    // shares no memory with the inputs; the caller keeps them alive.
    let (dst, xs, ws) = unsafe {
        let dst = kernel_dst(&out);
        (dst, kernel_src(&x), kernel_src(&weight))
    };
    py.detach(move || crate::layers::rms_norm(dst, xs, ws, eps, dim))?;
    Ok(())
}

/// out [rows, dim] = LayerNorm(x + residual) * weight + bias over the last
/// dimension (residual and bias optional); one dtype.
#[pyfunction]
#[pyo3(signature = (out, x, residual, weight, bias, eps))]
fn layer_norm(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    residual: Option<&Bound<'_, PyAny>>,
    weight: &Bound<'_, PyAny>,
    bias: Option<&Bound<'_, PyAny>>,
    eps: f32,
) -> PyResult<()> {
    let (x, weight, out, dim) = norm_args(x, weight, out)?;
    let residual = match residual {
        Some(r) if !r.is_none() => {
            let r = TensorArg::extract("residual", r)?;
            r.check(&[x.dtype], 2)?;
            r.expect_dim(0, x.shape[0], "rows of x")?;
            r.expect_dim(1, dim, "the last dimension of x")?;
            check_no_overlap(&out, &r)?;
            Some(r)
        }
        _ => None,
    };
    let bias = match bias {
        Some(b) if !b.is_none() => {
            let b = TensorArg::extract("bias", b)?;
            b.check(&[x.dtype], 1)?;
            b.expect_dim(0, dim, "the last dimension of x")?;
            check_no_overlap(&out, &b)?;
            Some(b)
        }
        _ => None,
    };
    // SAFETY: every tensor was checked (dtype, CPU, contiguity, shape) and
    // out shares no memory with the inputs; the caller keeps them alive.
    let (dst, xs, rs, ws, bs) = unsafe {
        let dst = kernel_dst(&out);
        (
            dst,
            kernel_src(&x),
            residual.as_ref().map(|r| kernel_src(r)),
            kernel_src(&weight),
            bias.as_ref().map(|b| kernel_src(b)),
        )
    };
    py.detach(move || crate::layers::layer_norm(dst, xs, rs, ws, bs, eps, dim))?;
    Ok(())
}

/// out = gelu(x) elementwise (exact, erf); one dtype, any shape (contiguous).
#[pyfunction]
fn gelu(py: Python<'_>, out: &Bound<'_, PyAny>, x: &Bound<'_, PyAny>) -> PyResult<()> {
    let x = TensorArg::extract("x", x)?;
    x.check(&[DType::BF16, DType::F32], x.shape.len())?;
    let out = TensorArg::extract("out", out)?;
    out.check(&[x.dtype], x.shape.len())?;
    out.expect_shape_of(&x)?;
    check_no_overlap(&out, &x)?;
    // SAFETY: both were checked (dtype, CPU, contiguity, shape) and share no
    // memory; the caller keeps them alive.
    let (dst, xs) = unsafe {
        let dst = kernel_dst(&out);
        (dst, kernel_src(&x))
    };
    py.detach(move || crate::layers::gelu(dst, xs))?;
    Ok(())
}

/// out [rows, d] = silu(x[:, :d]) * x[:, d:] for x [rows, 2d]; one dtype.
#[pyfunction]
fn silu_and_mul(py: Python<'_>, out: &Bound<'_, PyAny>, x: &Bound<'_, PyAny>) -> PyResult<()> {
    gated(py, out, x, GatedAct::Silu)
}

/// out [rows, d] = gelu_tanh(x[:, :d]) * x[:, d:] for x [rows, 2d] (GeGLU,
/// the GELU's tanh approximation, rounded before the product); one dtype.
#[pyfunction]
fn gelu_tanh_and_mul(py: Python<'_>, out: &Bound<'_, PyAny>, x: &Bound<'_, PyAny>) -> PyResult<()> {
    gated(py, out, x, GatedAct::GeluTanh)
}

/// out [rows, d] = gelu(x[:, :d]) * x[:, d:] for x [rows, 2d] (GeGLU with
/// the exact, erf GELU, rounded before the product); one dtype.
#[pyfunction]
fn gelu_and_mul(py: Python<'_>, out: &Bound<'_, PyAny>, x: &Bound<'_, PyAny>) -> PyResult<()> {
    gated(py, out, x, GatedAct::Gelu)
}

/// A gated activation of a fused gate/up projection x [rows, 2d] into out [rows, d].
fn gated(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    act: GatedAct,
) -> PyResult<()> {
    let x = TensorArg::extract("x", x)?;
    x.check(&[DType::BF16, DType::F32], 2)?;
    if x.shape[1] % 2 != 0 {
        return Err(PyValueError::new_err(format!(
            "x: the last dimension must be even (gate and up halves), got {}",
            x.shape[1]
        )));
    }
    let d = x.shape[1] / 2;
    let out = TensorArg::extract("out", out)?;
    out.check(&[x.dtype], 2)?;
    out.expect_dim(0, x.shape[0], "rows of x")?;
    out.expect_dim(1, d, "half the last dimension of x")?;
    check_no_overlap(&out, &x)?;
    // SAFETY: both were checked (dtype, CPU, contiguity, shape) and share no
    // memory; the caller keeps them alive.
    let (dst, xs) = unsafe {
        let dst = kernel_dst(&out);
        (dst, kernel_src(&x))
    };
    py.detach(move || crate::layers::gated_act(dst, xs, d, act))?;
    Ok(())
}

/// out = x * sigmoid(gate) elementwise, the sigmoid rounded to the dtype
/// first (an attention output gate); one dtype, one shape (contiguous).
#[pyfunction]
fn sigmoid_mul(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    gate: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let x = TensorArg::extract("x", x)?;
    x.check(&[DType::BF16, DType::F32], x.shape.len())?;
    let mut args = Vec::with_capacity(2);
    for (name, obj) in [("gate", gate), ("out", out)] {
        let t = TensorArg::extract(name, obj)?;
        t.check(&[x.dtype], x.shape.len())?;
        t.expect_shape_of(&x)?;
        args.push(t);
    }
    let (gate, out) = (&args[0], &args[1]);
    check_no_overlap(out, &x)?;
    check_no_overlap(out, gate)?;
    // SAFETY: all three were checked (dtype, CPU, contiguity, shape) and out
    // shares no memory with the inputs; the caller keeps them alive.
    let (dst, xs, gs) = unsafe {
        let dst = kernel_dst(out);
        (dst, kernel_src(&x), kernel_src(gate))
    };
    py.detach(move || crate::layers::sigmoid_mul(dst, xs, gs))?;
    Ok(())
}

/// out [rows, dim] = RMSNorm(x) * weight times silu(z) (Qwen3.5's gated
/// head norm: the norm rounded as `rms_norm`'s, the gate in float32,
/// rounded once); x, z [rows, dim], weight [dim], one dtype.
#[pyfunction]
fn gated_rms_norm(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    z: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    eps: f32,
) -> PyResult<()> {
    let (x, weight, out, dim) = norm_args(x, weight, out)?;
    let z = TensorArg::extract("z", z)?;
    z.check(&[x.dtype], 2)?;
    z.expect_shape_of(&x)?;
    check_no_overlap(&out, &z)?;
    // SAFETY: all four were checked (dtype, CPU, contiguity, shape) and out
    // shares no memory with the inputs; the caller keeps them alive.
    let (dst, xs, zs, ws) = unsafe {
        let dst = kernel_dst(&out);
        (dst, kernel_src(&x), kernel_src(&z), kernel_src(&weight))
    };
    py.detach(move || crate::layers::gated_rms_norm(dst, xs, zs, ws, eps, dim))?;
    Ok(())
}

/// Splits qkv [T, (h + 2 kv) * d] into q [T, h, d], k [T, kv, d] and
/// v [T, kv * d], rotating q and k with cos / sin [T, half]; one dtype.
#[pyfunction]
fn qkv_rotary(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    qkv: &Bound<'_, PyAny>,
    cos: &Bound<'_, PyAny>,
    sin: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let qkv = TensorArg::extract("qkv", qkv)?;
    qkv.check(&[DType::BF16, DType::F32], 2)?;
    let dt = [qkv.dtype];
    let q = TensorArg::extract("q", q)?;
    q.check(&dt, 3)?;
    let (tokens, heads, head_dim) = (q.shape[0], q.shape[1], q.shape[2]);
    let k = TensorArg::extract("k", k)?;
    k.check(&dt, 3)?;
    k.expect_dim(0, tokens, "tokens of q")?;
    k.expect_dim(2, head_dim, "the head size of q")?;
    let kv_heads = k.shape[1];
    let v = TensorArg::extract("v", v)?;
    v.check(&dt, 2)?;
    v.expect_dim(0, tokens, "tokens of q")?;
    v.expect_dim(1, kv_heads * head_dim, "kv heads x head size of k")?;
    qkv.expect_dim(0, tokens, "tokens of q")?;
    qkv.expect_dim(
        1,
        (heads + 2 * kv_heads) * head_dim,
        "(q + 2 kv heads) x head size",
    )?;
    let cos = TensorArg::extract("cos", cos)?;
    cos.check(&dt, 2)?;
    cos.expect_dim(0, tokens, "tokens of q")?;
    let half = cos.shape[1];
    let sin = TensorArg::extract("sin", sin)?;
    sin.check(&dt, 2)?;
    sin.expect_dim(0, tokens, "tokens of q")?;
    sin.expect_dim(1, half, "the width of cos")?;
    for out in [&q, &k, &v] {
        for input in [&qkv, &cos, &sin] {
            check_no_overlap(out, input)?;
        }
    }
    check_no_overlap(&q, &k)?;
    check_no_overlap(&q, &v)?;
    check_no_overlap(&k, &v)?;
    let shape = crate::layers::QkvShape {
        tokens,
        heads,
        kv_heads,
        head_dim,
        half,
    };
    // SAFETY: all six were checked (dtype, CPU, contiguity, shape); the
    // outputs share no memory with each other or the inputs; the caller
    // keeps them alive.
    let (qd, kd, vd, xs, cs, ss) = unsafe {
        (
            kernel_dst(&q),
            kernel_dst(&k),
            kernel_dst(&v),
            kernel_src(&qkv),
            kernel_src(&cos),
            kernel_src(&sin),
        )
    };
    py.detach(move || crate::layers::qkv_rotary(qd, kd, vd, xs, cs, ss, shape))?;
    Ok(())
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(layer_norm, m)?)?;
    m.add_function(wrap_pyfunction!(gelu, m)?)?;
    m.add_function(wrap_pyfunction!(silu_and_mul, m)?)?;
    m.add_function(wrap_pyfunction!(gelu_tanh_and_mul, m)?)?;
    m.add_function(wrap_pyfunction!(gelu_and_mul, m)?)?;
    m.add_function(wrap_pyfunction!(qkv_rotary, m)?)?;
    m.add_function(wrap_pyfunction!(sigmoid_mul, m)?)?;
    m.add_function(wrap_pyfunction!(gated_rms_norm, m)?)?;
    Ok(())
}

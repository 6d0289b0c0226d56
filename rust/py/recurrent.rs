//! The recurrent token mixers of hybrid models: the causal depthwise
//! convolution and the gated delta rule, over packed sequences with a state
//! per sequence.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::tensor::{check_no_overlap, kernel_dst, kernel_src, DType, TensorArg};
use crate::recurrent::{
    self, ConvShape, DeltaInputs, DeltaOptions, DeltaShape, Packed, Rule, MAX_CONV_WIDTH,
};

/// `query_start_loc` (int32 [num_seqs + 1]) and `state_slots` (int64
/// [num_seqs]), checked as tensors (their values are checked by the kernel).
fn batch_args(
    query_start_loc: &Bound<'_, PyAny>,
    state_slots: &Bound<'_, PyAny>,
) -> PyResult<(TensorArg, TensorArg)> {
    let slots = TensorArg::extract("state_slots", state_slots)?;
    slots.check(&[DType::I64], 1)?;
    let qsl = TensorArg::extract("query_start_loc", query_start_loc)?;
    qsl.check(&[DType::I32], 1)?;
    qsl.expect_dim(
        0,
        slots.shape[0] + 1,
        "num_seqs + 1, num_seqs from state_slots",
    )?;
    Ok((qsl, slots))
}

/// Depthwise causal convolution of packed sequences: x, out [T, C], weight
/// [C, K], bias [C] or None, conv_state [S, C, K - 1] (updated in place);
/// one dtype (bf16 or f32).
#[pyfunction]
#[pyo3(signature = (out, x, weight, bias, conv_state, query_start_loc, state_slots, silu))]
#[allow(clippy::too_many_arguments)]
fn causal_conv1d(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    bias: Option<&Bound<'_, PyAny>>,
    conv_state: &Bound<'_, PyAny>,
    query_start_loc: &Bound<'_, PyAny>,
    state_slots: &Bound<'_, PyAny>,
    silu: bool,
) -> PyResult<()> {
    let x = TensorArg::extract("x", x)?;
    x.check(&[DType::BF16, DType::F32], 2)?;
    let (tokens, channels) = (x.shape[0], x.shape[1]);
    let dt = [x.dtype];
    let out = TensorArg::extract("out", out)?;
    out.check(&dt, 2)?;
    out.expect_dim(0, tokens, "rows of x")?;
    out.expect_dim(1, channels, "channels of x")?;
    let weight = TensorArg::extract("weight", weight)?;
    weight.check(&dt, 2)?;
    weight.expect_dim(0, channels, "channels of x")?;
    let width = weight.shape[1];
    if !(2..=MAX_CONV_WIDTH).contains(&width) {
        return Err(PyValueError::new_err(format!(
            "weight: kernel width (dimension 1) must be 2..={MAX_CONV_WIDTH}, got {width}"
        )));
    }
    let bias = bias.map(|b| TensorArg::extract("bias", b)).transpose()?;
    if let Some(b) = &bias {
        b.check(&dt, 1)?;
        b.expect_dim(0, channels, "channels of x")?;
    }
    let state = TensorArg::extract("conv_state", conv_state)?;
    state.check(&dt, 3)?;
    state.expect_dim(1, channels, "channels of x")?;
    state.expect_dim(2, width - 1, "kernel width - 1")?;
    let (qsl, slots) = batch_args(query_start_loc, state_slots)?;
    for written in [&out, &state] {
        for input in [&x, &weight, &qsl, &slots].into_iter().chain(&bias) {
            check_no_overlap(written, input)?;
        }
    }
    check_no_overlap(&out, &state)?;
    let shape = ConvShape {
        tokens,
        channels,
        width,
        slots: state.shape[0],
    };
    // SAFETY: every tensor was checked (dtype, CPU, contiguity, shape); out
    // and conv_state share no memory with each other or the inputs; the
    // caller keeps them alive.
    let (o, xs, ws, bs, ss, packed) = unsafe {
        let packed = Packed {
            query_start_loc: qsl.slice::<i32>(),
            state_slots: slots.slice::<i64>(),
        };
        let bs = bias.as_ref().map(|b| kernel_src(b));
        (
            kernel_dst(&out),
            kernel_src(&x),
            kernel_src(&weight),
            bs,
            kernel_dst(&state),
            packed,
        )
    };
    py.detach(move || recurrent::causal_conv1d(o, xs, ws, bs, ss, packed, shape, silu))?;
    Ok(())
}

/// The gated delta rule over packed sequences: q, k [T, Hk, Dk], v
/// [T, Hv, Dv] (one dtype, bf16 or f32), g, beta [T, Hv] f32, state
/// [S, Hv, Dk, Dv] f32 (updated in place), out [T, Hv, Dv] in v's dtype.
/// `linear`: Mamba-2's rule, `S = e^g S + beta k v^T`, in place of the delta rule.
#[pyfunction]
#[pyo3(signature = (out, q, k, v, g, beta, state, query_start_loc, state_slots, scale, l2norm, linear=false))]
#[allow(clippy::too_many_arguments)]
fn gated_delta_rule(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    g: &Bound<'_, PyAny>,
    beta: &Bound<'_, PyAny>,
    state: &Bound<'_, PyAny>,
    query_start_loc: &Bound<'_, PyAny>,
    state_slots: &Bound<'_, PyAny>,
    scale: f32,
    l2norm: bool,
    linear: bool,
) -> PyResult<()> {
    let q = TensorArg::extract("q", q)?;
    q.check(&[DType::BF16, DType::F32], 3)?;
    let (tokens, k_heads, k_dim) = (q.shape[0], q.shape[1], q.shape[2]);
    let dt = [q.dtype];
    let k = TensorArg::extract("k", k)?;
    k.check(&dt, 3)?;
    k.expect_shape_of(&q)?;
    let v = TensorArg::extract("v", v)?;
    v.check(&dt, 3)?;
    v.expect_dim(0, tokens, "rows of q")?;
    let (v_heads, v_dim) = (v.shape[1], v.shape[2]);
    if k_heads == 0 || !v_heads.is_multiple_of(k_heads) {
        return Err(PyValueError::new_err(format!(
            "v: value heads (dimension 1, {v_heads}) must be a multiple of the query/key heads ({k_heads})"
        )));
    }
    let mut gates = Vec::with_capacity(2);
    for (name, obj) in [("g", g), ("beta", beta)] {
        let t = TensorArg::extract(name, obj)?;
        t.check(&[DType::F32], 2)?;
        t.expect_dim(0, tokens, "rows of q")?;
        t.expect_dim(1, v_heads, "value heads of v")?;
        gates.push(t);
    }
    let state = TensorArg::extract("state", state)?;
    state.check(&[DType::F32], 4)?;
    state.expect_dim(1, v_heads, "value heads of v")?;
    state.expect_dim(2, k_dim, "head size of q")?;
    state.expect_dim(3, v_dim, "head size of v")?;
    let out = TensorArg::extract("out", out)?;
    out.check(&dt, 3)?;
    for (d, (size, what)) in [
        (tokens, "rows of q"),
        (v_heads, "value heads of v"),
        (v_dim, "head size of v"),
    ]
    .into_iter()
    .enumerate()
    {
        out.expect_dim(d, size, what)?;
    }
    let (qsl, slots) = batch_args(query_start_loc, state_slots)?;
    for written in [&out, &state] {
        for input in [&q, &k, &v, &gates[0], &gates[1], &qsl, &slots] {
            check_no_overlap(written, input)?;
        }
    }
    check_no_overlap(&out, &state)?;
    let shape = DeltaShape {
        tokens,
        k_heads,
        v_heads,
        k_dim,
        v_dim,
        slots: state.shape[0],
    };
    // SAFETY: every tensor was checked (dtype, CPU, contiguity, shape); out
    // and state share no memory with each other or the inputs; the caller
    // keeps them alive.
    let (o, inputs, st, packed) = unsafe {
        let inputs = DeltaInputs {
            q: kernel_src(&q),
            k: kernel_src(&k),
            v: kernel_src(&v),
            g: gates[0].slice::<f32>(),
            beta: gates[1].slice::<f32>(),
        };
        let packed = Packed {
            query_start_loc: qsl.slice::<i32>(),
            state_slots: slots.slice::<i64>(),
        };
        (kernel_dst(&out), inputs, state.slice_mut::<f32>(), packed)
    };
    let opts = DeltaOptions {
        rule: if linear { Rule::Linear } else { Rule::Delta },
        ..DeltaOptions::default()
    };
    py.detach(move || {
        recurrent::gated_delta_rule_with(o, inputs, st, packed, shape, scale, l2norm, opts)
    })?;
    Ok(())
}

/// Gated DeltaNet's gates: g, beta [T, H] f32 from a, b [T, H] (one
/// dtype, bf16 or f32) and A_log, dt_bias [H] f32: `beta = sigmoid(b)`
/// rounded to b's dtype, `g = -exp(A_log) * softplus(a + dt_bias)`.
#[pyfunction]
fn delta_gates(
    py: Python<'_>,
    g: &Bound<'_, PyAny>,
    beta: &Bound<'_, PyAny>,
    a: &Bound<'_, PyAny>,
    b: &Bound<'_, PyAny>,
    a_log: &Bound<'_, PyAny>,
    dt_bias: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let a = TensorArg::extract("a", a)?;
    a.check(&[DType::BF16, DType::F32], 2)?;
    let b = TensorArg::extract("b", b)?;
    b.check(&[a.dtype], 2)?;
    b.expect_shape_of(&a)?;
    let heads = a.shape[1];
    let mut params = Vec::with_capacity(2);
    for (name, obj) in [("A_log", a_log), ("dt_bias", dt_bias)] {
        let t = TensorArg::extract(name, obj)?;
        t.check(&[DType::F32], 1)?;
        t.expect_dim(0, heads, "heads of a")?;
        params.push(t);
    }
    let mut outs = Vec::with_capacity(2);
    for (name, obj) in [("g", g), ("beta", beta)] {
        let t = TensorArg::extract(name, obj)?;
        t.check(&[DType::F32], 2)?;
        t.expect_dim(0, a.shape[0], "rows of a")?;
        t.expect_dim(1, heads, "heads of a")?;
        for input in [&a, &b, &params[0], &params[1]] {
            check_no_overlap(&t, input)?;
        }
        outs.push(t);
    }
    check_no_overlap(&outs[0], &outs[1])?;
    // SAFETY: every tensor was checked (dtype, CPU, contiguity, shape); the
    // outputs share no memory with each other or the inputs; the caller
    // keeps them alive.
    let (gs, bs, a_s, b_s, al, dt) = unsafe {
        (
            outs[0].slice_mut::<f32>(),
            outs[1].slice_mut::<f32>(),
            kernel_src(&a),
            kernel_src(&b),
            params[0].slice::<f32>(),
            params[1].slice::<f32>(),
        )
    };
    py.detach(move || crate::layers::delta_gates(gs, bs, a_s, b_s, al, dt))?;
    Ok(())
}

/// Mamba-2's time steps: g, beta [T, H] f32 from dt [T, H] (bf16 or f32)
/// and A_log, dt_bias [H] f32: `beta = clamp(softplus(dt + dt_bias), lo,
/// hi)`, `g = -exp(A_log) * beta`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn mamba_gates(
    py: Python<'_>,
    g: &Bound<'_, PyAny>,
    beta: &Bound<'_, PyAny>,
    dt: &Bound<'_, PyAny>,
    a_log: &Bound<'_, PyAny>,
    dt_bias: &Bound<'_, PyAny>,
    lo: f32,
    hi: f32,
) -> PyResult<()> {
    let dt = TensorArg::extract("dt", dt)?;
    dt.check(&[DType::BF16, DType::F32], 2)?;
    let heads = dt.shape[1];
    let mut params = Vec::with_capacity(2);
    for (name, obj) in [("A_log", a_log), ("dt_bias", dt_bias)] {
        let t = TensorArg::extract(name, obj)?;
        t.check(&[DType::F32], 1)?;
        t.expect_dim(0, heads, "heads of dt")?;
        params.push(t);
    }
    let mut outs = Vec::with_capacity(2);
    for (name, obj) in [("g", g), ("beta", beta)] {
        let t = TensorArg::extract(name, obj)?;
        t.check(&[DType::F32], 2)?;
        t.expect_shape_of(&dt)?;
        for input in [&dt, &params[0], &params[1]] {
            check_no_overlap(&t, input)?;
        }
        outs.push(t);
    }
    check_no_overlap(&outs[0], &outs[1])?;
    // SAFETY: every tensor was checked (dtype, CPU, contiguity, shape); the
    // outputs share no memory with each other or the inputs; the caller
    // keeps them alive.
    let (gs, bs, dts, al, bias) = unsafe {
        (
            outs[0].slice_mut::<f32>(),
            outs[1].slice_mut::<f32>(),
            kernel_src(&dt),
            params[0].slice::<f32>(),
            params[1].slice::<f32>(),
        )
    };
    py.detach(move || crate::layers::mamba_gates(gs, bs, dts, al, bias, (lo, hi)))?;
    Ok(())
}

/// Mamba-2's gated group norm: out, y, x, z [T, H * P] (one dtype, bf16 or
/// f32), D [H] f32, weight [H * P]: `weight * rms_norm_g((y + D x) *
/// silu(z))` over `groups` slices of each row, in f32, rounded once.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn mamba_norm(
    py: Python<'_>,
    out: &Bound<'_, PyAny>,
    y: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    z: &Bound<'_, PyAny>,
    d: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    groups: usize,
    eps: f32,
) -> PyResult<()> {
    let y = TensorArg::extract("y", y)?;
    y.check(&[DType::BF16, DType::F32], 2)?;
    let dt = [y.dtype];
    let mut rows = Vec::with_capacity(3);
    for (name, obj) in [("x", x), ("z", z), ("out", out)] {
        let t = TensorArg::extract(name, obj)?;
        t.check(&dt, 2)?;
        t.expect_shape_of(&y)?;
        rows.push(t);
    }
    let d = TensorArg::extract("D", d)?;
    d.check(&[DType::F32], 1)?;
    let weight = TensorArg::extract("weight", weight)?;
    weight.check(&dt, 1)?;
    weight.expect_dim(0, y.shape[1], "columns of y")?;
    for input in [&y, &rows[0], &rows[1], &d, &weight] {
        check_no_overlap(&rows[2], input)?;
    }
    // SAFETY: every tensor was checked (dtype, CPU, contiguity, shape); out
    // shares no memory with the inputs; the caller keeps them alive.
    let (o, ys, xs, zs, ds, ws) = unsafe {
        (
            kernel_dst(&rows[2]),
            kernel_src(&y),
            kernel_src(&rows[0]),
            kernel_src(&rows[1]),
            d.slice::<f32>(),
            kernel_src(&weight),
        )
    };
    py.detach(move || crate::layers::mamba_norm(o, ys, xs, zs, ds, ws, groups, eps))?;
    Ok(())
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(mamba_gates, m)?)?;
    m.add_function(wrap_pyfunction!(mamba_norm, m)?)?;
    m.add_function(wrap_pyfunction!(causal_conv1d, m)?)?;
    m.add_function(wrap_pyfunction!(gated_delta_rule, m)?)?;
    m.add_function(wrap_pyfunction!(delta_gates, m)?)?;
    Ok(())
}

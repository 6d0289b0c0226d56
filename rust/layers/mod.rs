//! CPU kernels for the model's elementwise layers: RMSNorm, the gated
//! activations (`silu(gate) * up`, and the GELU and gpt-oss variants the
//! MoE experts use) and the QKV split with rotary embeddings,
//! on the thread team (`threads::team_run`), like the linear layers between
//! them.
//!
//! They round where the model's torch code rounds, so that a bf16 model gives
//! the same values through either: RMSNorm normalises in f32, rounds to the
//! element type, then multiplies by the weight (`weight * x_hat.to(dtype)`);
//! SiLU rounds `silu(gate)` before multiplying by `up`.
//!
//! The loops (`kernels.rs`) are written to vectorise (an exp built from a
//! polynomial and exponent bits, no libm call) and compiled through
//! `cpu::simd` for AVX-512, AVX2 + FMA and baseline x86-64, chosen at run time.

mod kernels;

use kernels::{
    Act, DeltaGates, GatedNorm, Gelu, LayerNorm, MambaGates, MambaNorm, Norm, Rotate, SigmoidMul,
};

use crate::cpu::elem::SharedOut;
use crate::cpu::simd::dispatch;
use crate::cpu::{best_path, Dst, Element, Src};
use crate::error::{CoreError, CoreResult};

/// Elements below which a call runs on the calling thread.
const SERIAL_ELEMS: usize = 1 << 16;

/// Splits `rows` rows over the team in chunks (or runs them here when the
/// call is small) and hands each chunk's row range to `f`.
fn for_row_chunks(rows: usize, dim: usize, f: impl Fn(usize, usize) + Sync) -> CoreResult<()> {
    let threads = crate::cpu::threads::num_threads();
    if threads <= 1 || rows < 2 || rows * dim < SERIAL_ELEMS {
        f(0, rows);
        return Ok(());
    }
    let chunks = (4 * threads).min(rows);
    crate::cpu::threads::team_run(chunks, &|c| f(c * rows / chunks, (c + 1) * rows / chunks))
}

/// Runs `f(out rows, span)` over chunks of the `rows` rows (`dim` elements
/// each) of `out` (see [`for_row_chunks`]): `span` is the chunk's element
/// range, the same in every input of `out`'s shape.
fn for_out_chunks<T: Send>(
    out: &mut [T],
    rows: usize,
    dim: usize,
    f: impl Fn(&mut [T], std::ops::Range<usize>) + Sync,
) -> CoreResult<()> {
    let shared = SharedOut(out.as_mut_ptr());
    for_row_chunks(rows, dim, |r0, r1| {
        let span = r0 * dim..r1 * dim;
        // SAFETY: rows r0..r1 of out belong to this chunk only, and `out`
        // holds every row (the callers checked its length).
        let o = unsafe { std::slice::from_raw_parts_mut(shared.ptr().add(span.start), span.len()) };
        f(o, span)
    })
}

/// `out[r] = weight * round(x[r] / rms(x[r]))` over rows of `dim` elements.
/// `x`, `weight` and `out` share one element type.
pub fn rms_norm(out: Dst<'_>, x: Src<'_>, weight: Src<'_>, eps: f32, dim: usize) -> CoreResult<()> {
    if dim == 0 {
        return Err(CoreError::invalid("x: rows must have at least one element"));
    }
    if !x.len().is_multiple_of(dim) || out.len() != x.len() {
        return Err(CoreError::invalid(format!(
            "out: expected {} elements (x has {}, rows of {dim})",
            x.len(),
            x.len()
        )));
    }
    if weight.len() != dim {
        return Err(CoreError::invalid(format!(
            "weight: expected {dim} elements, got {}",
            weight.len()
        )));
    }
    let rows = x.len() / dim;
    match (out, x, weight) {
        (Dst::F32(o), Src::F32(x), Src::F32(w)) => norm_rows(o, x, w, eps, dim, rows),
        (Dst::Bf16(o), Src::Bf16(x), Src::Bf16(w)) => norm_rows(o, x, w, eps, dim, rows),
        _ => Err(CoreError::invalid("x, weight and out must share one dtype")),
    }
}

/// `out[r] = LayerNorm(round(x[r] + residual[r])) * weight + bias` over
/// rows of `dim` elements (no residual: `x[r]`; no bias: none added),
/// normalised in f32 and rounded once, as torch's `layer_norm` of the
/// rounded sum. Every tensor shares one element type.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm(
    out: Dst<'_>,
    x: Src<'_>,
    residual: Option<Src<'_>>,
    weight: Src<'_>,
    bias: Option<Src<'_>>,
    eps: f32,
    dim: usize,
) -> CoreResult<()> {
    if dim == 0 || !x.len().is_multiple_of(dim) || out.len() != x.len() {
        return Err(CoreError::invalid(format!(
            "out: expected {} elements in rows of {dim} (as x), got {}",
            x.len(),
            out.len()
        )));
    }
    if residual.as_ref().is_some_and(|r| r.len() != x.len()) {
        return Err(CoreError::invalid("residual: must have x's shape"));
    }
    if weight.len() != dim || bias.as_ref().is_some_and(|b| b.len() != dim) {
        return Err(CoreError::invalid(format!(
            "weight/bias: expected {dim} elements each"
        )));
    }
    let rows = x.len() / dim;
    macro_rules! run {
        ($o:expr, $x:expr, $w:expr, $V:ident) => {{
            let residual = match residual {
                None => None,
                Some(Src::$V(r)) => Some(r),
                Some(_) => return Err(CoreError::invalid("residual: must have x's dtype")),
            };
            let bias = match bias {
                None => None,
                Some(Src::$V(b)) => Some(b),
                Some(_) => return Err(CoreError::invalid("bias: must have x's dtype")),
            };
            let shared = SharedOut($o.as_mut_ptr());
            for_row_chunks(rows, dim, |r0, r1| {
                // SAFETY: rows r0..r1 of out belong to this chunk only; out
                // holds rows * dim elements (checked above).
                let o = unsafe {
                    std::slice::from_raw_parts_mut(shared.ptr().add(r0 * dim), (r1 - r0) * dim)
                };
                let span = r0 * dim..r1 * dim;
                let kernel = LayerNorm {
                    out: o,
                    x: &$x[span.clone()],
                    residual: residual.map(|r| &r[span.clone()]),
                    w: $w,
                    b: bias,
                    eps,
                    dim,
                };
                dispatch(best_path(), kernel);
            })
        }};
    }
    match (out, x, weight) {
        (Dst::F32(o), Src::F32(x), Src::F32(w)) => run!(o, x, w, F32),
        (Dst::Bf16(o), Src::Bf16(x), Src::Bf16(w)) => run!(o, x, w, Bf16),
        _ => Err(CoreError::invalid("x, weight and out must share one dtype")),
    }
}

/// `out = round(gelu(x))` elementwise, GELU exact (erf, torch's default);
/// one dtype.
pub fn gelu(out: Dst<'_>, x: Src<'_>) -> CoreResult<()> {
    if out.len() != x.len() {
        return Err(CoreError::invalid(format!(
            "out: expected {} elements (as x), got {}",
            x.len(),
            out.len()
        )));
    }
    const ROW: usize = 4096;
    let n = x.len();
    macro_rules! run {
        ($o:expr, $x:expr) => {{
            let shared = SharedOut($o.as_mut_ptr());
            for_row_chunks(n.div_ceil(ROW), ROW, |c0, c1| {
                let span = (c0 * ROW).min(n)..(c1 * ROW).min(n);
                // SAFETY: elements `span` of out belong to this chunk only.
                let o = unsafe {
                    std::slice::from_raw_parts_mut(shared.ptr().add(span.start), span.len())
                };
                dispatch(
                    best_path(),
                    Gelu {
                        out: o,
                        x: &$x[span],
                    },
                );
            })
        }};
    }
    match (out, x) {
        (Dst::F32(o), Src::F32(x)) => run!(o, x),
        (Dst::Bf16(o), Src::Bf16(x)) => run!(o, x),
        _ => Err(CoreError::invalid("x and out must share one dtype")),
    }
}

/// `out = round(x * round(sigmoid(gate)))` elementwise, as torch's
/// `x * torch.sigmoid(gate)` (Qwen3.5's attention output gate); one dtype.
pub fn sigmoid_mul(out: Dst<'_>, x: Src<'_>, gate: Src<'_>) -> CoreResult<()> {
    if out.len() != x.len() || gate.len() != x.len() {
        return Err(CoreError::invalid(format!(
            "gate, out: expected {} elements each (as x), got {} and {}",
            x.len(),
            gate.len(),
            out.len()
        )));
    }
    const ROW: usize = 4096;
    let n = x.len();
    macro_rules! run {
        ($o:expr, $x:expr, $g:expr) => {{
            let shared = SharedOut($o.as_mut_ptr());
            for_row_chunks(n.div_ceil(ROW), ROW, |c0, c1| {
                let span = (c0 * ROW).min(n)..(c1 * ROW).min(n);
                // SAFETY: elements `span` of out belong to this chunk only.
                let o = unsafe {
                    std::slice::from_raw_parts_mut(shared.ptr().add(span.start), span.len())
                };
                let (x, gate) = (&$x[span.clone()], &$g[span]);
                dispatch(best_path(), SigmoidMul { out: o, x, gate });
            })
        }};
    }
    match (out, x, gate) {
        (Dst::F32(o), Src::F32(x), Src::F32(g)) => run!(o, x, g),
        (Dst::Bf16(o), Src::Bf16(x), Src::Bf16(g)) => run!(o, x, g),
        _ => Err(CoreError::invalid("x, gate and out must share one dtype")),
    }
}

/// Qwen3.5's gated head norm over rows of `dim`: `out[r] =
/// round(rms_norm(x[r]) * silu(z[r]))`, the norm rounded as [`rms_norm`]'s,
/// `silu(z)` and the product in f32, as torch's `(norm(x) * F.silu(z.float())).to(dtype)`.
/// `x`, `z`, `weight` and `out` share one element type.
pub fn gated_rms_norm(
    out: Dst<'_>,
    x: Src<'_>,
    z: Src<'_>,
    weight: Src<'_>,
    eps: f32,
    dim: usize,
) -> CoreResult<()> {
    if dim == 0 || !x.len().is_multiple_of(dim) {
        return Err(CoreError::invalid(format!(
            "x: expected rows of {dim} elements, got {} elements",
            x.len()
        )));
    }
    if out.len() != x.len() || z.len() != x.len() {
        return Err(CoreError::invalid(format!(
            "z, out: expected {} elements each (as x), got {} and {}",
            x.len(),
            z.len(),
            out.len()
        )));
    }
    if weight.len() != dim {
        return Err(CoreError::invalid(format!(
            "weight: expected {dim} elements, got {}",
            weight.len()
        )));
    }
    let rows = x.len() / dim;
    macro_rules! run {
        ($o:expr, $x:expr, $z:expr, $w:expr) => {{
            for_out_chunks($o, rows, dim, |o, span| {
                let (x, z) = (&$x[span.clone()], &$z[span]);
                dispatch(
                    best_path(),
                    GatedNorm {
                        out: o,
                        x,
                        z,
                        w: $w,
                        eps,
                        dim,
                    },
                );
            })
        }};
    }
    match (out, x, z, weight) {
        (Dst::F32(o), Src::F32(x), Src::F32(z), Src::F32(w)) => run!(o, x, z, w),
        (Dst::Bf16(o), Src::Bf16(x), Src::Bf16(z), Src::Bf16(w)) => run!(o, x, z, w),
        _ => Err(CoreError::invalid(
            "x, z, weight and out must share one dtype",
        )),
    }
}

/// The heads of a gate's per-head parameters `a_log` and `dt_bias` (one
/// each, at least one head).
fn gate_heads(a_log: &[f32], dt_bias: &[f32]) -> CoreResult<usize> {
    let heads = a_log.len();
    if heads == 0 || dt_bias.len() != heads {
        return Err(CoreError::invalid(format!(
            "dt_bias: expected {heads} elements (as A_log, at least one), got {}",
            dt_bias.len()
        )));
    }
    Ok(heads)
}

/// Gated DeltaNet's gates for rows of `heads = a_log.len()` values:
/// `beta = round(sigmoid(b))` and `g = -e^A_log * softplus(a + dt_bias)`,
/// both f32, as Qwen3.5's torch code computes them (`b.sigmoid().float()`;
/// `-A_log.float().exp() * F.softplus(a.float() + dt_bias.float())`). `a` and
/// `b` share one element type; `a_log` and `dt_bias` are f32.
pub fn delta_gates(
    g: &mut [f32],
    beta: &mut [f32],
    a: Src<'_>,
    b: Src<'_>,
    a_log: &[f32],
    dt_bias: &[f32],
) -> CoreResult<()> {
    let heads = gate_heads(a_log, dt_bias)?;
    if !a.len().is_multiple_of(heads) || [b.len(), g.len(), beta.len()] != [a.len(); 3] {
        return Err(CoreError::invalid(format!(
            "a, b, g, beta: expected rows of {heads} elements, {} each, got a {}, b {}, g {}, beta {}",
            a.len(),
            a.len(),
            b.len(),
            g.len(),
            beta.len()
        )));
    }
    match (a, b) {
        (Src::F32(a), Src::F32(b)) => dispatch(
            best_path(),
            DeltaGates {
                g,
                beta,
                a,
                b,
                a_log,
                dt_bias,
            },
        ),
        (Src::Bf16(a), Src::Bf16(b)) => dispatch(
            best_path(),
            DeltaGates {
                g,
                beta,
                a,
                b,
                a_log,
                dt_bias,
            },
        ),
        _ => return Err(CoreError::invalid("a and b must share one dtype")),
    }
    Ok(())
}

/// Mamba-2's time steps for rows of `heads = a_log.len()` values:
/// `beta = clamp(softplus(dt + dt_bias), limit.0, limit.1)` and `g = -e^A_log
/// * beta`, both f32 (the scan's write strength and log decay: its linear
/// rule, `recurrent::Rule::Linear`). `dt` is bf16 or f32; `a_log` and
/// `dt_bias` f32.
pub fn mamba_gates(
    g: &mut [f32],
    beta: &mut [f32],
    dt: Src<'_>,
    a_log: &[f32],
    dt_bias: &[f32],
    limit: (f32, f32),
) -> CoreResult<()> {
    let heads = gate_heads(a_log, dt_bias)?;
    if !dt.len().is_multiple_of(heads) || [g.len(), beta.len()] != [dt.len(); 2] {
        return Err(CoreError::invalid(format!(
            "dt, g, beta: expected rows of {heads} elements, {} each, got g {}, beta {}",
            dt.len(),
            g.len(),
            beta.len()
        )));
    }
    macro_rules! run {
        ($dt:expr) => {
            dispatch(
                best_path(),
                MambaGates {
                    g,
                    beta,
                    dt: $dt,
                    a_log,
                    dt_bias,
                    limit,
                },
            )
        };
    }
    match dt {
        Src::F32(dt) => run!(dt),
        Src::Bf16(dt) => run!(dt),
    }
    Ok(())
}

/// Mamba-2's gated group norm of the scan's rows `y` (`dim = d.len() x
/// head_dim` each; `x` the scan's input, `z` the gate, of the same shape):
/// `out = round(weight * rms_norm_g((y + D x) * silu(z)))` with the sums,
/// the skip `D` (per head) and the gate in f32 and the RMS over each of
/// `groups` slices of the row. `y`, `x`, `z`, `weight` and `out` share one
/// element type.
#[allow(clippy::too_many_arguments)]
pub fn mamba_norm(
    out: Dst<'_>,
    y: Src<'_>,
    x: Src<'_>,
    z: Src<'_>,
    d: &[f32],
    weight: Src<'_>,
    groups: usize,
    eps: f32,
) -> CoreResult<()> {
    let dim = weight.len();
    if d.is_empty() || groups == 0 || !dim.is_multiple_of(d.len()) || !dim.is_multiple_of(groups) {
        return Err(CoreError::invalid(format!(
            "weight: {dim} elements must be whole heads ({} of them, D) and groups ({groups})",
            d.len()
        )));
    }
    if dim == 0 || !y.len().is_multiple_of(dim) || [x.len(), z.len(), out.len()] != [y.len(); 3] {
        return Err(CoreError::invalid(format!(
            "y, x, z, out: expected rows of {dim} elements, {} each, got x {}, z {}, out {}",
            y.len(),
            x.len(),
            z.len(),
            out.len()
        )));
    }
    let (rows, head_dim) = (y.len() / dim, dim / d.len());
    macro_rules! run {
        ($o:expr, $y:expr, $x:expr, $z:expr, $w:expr) => {{
            for_out_chunks($o, rows, dim, |o, span| {
                dispatch(
                    best_path(),
                    MambaNorm {
                        out: o,
                        y: &$y[span.clone()],
                        x: &$x[span.clone()],
                        z: &$z[span],
                        d,
                        w: $w,
                        head_dim,
                        groups,
                        eps,
                    },
                );
            })
        }};
    }
    match (out, y, x, z, weight) {
        (Dst::F32(o), Src::F32(y), Src::F32(x), Src::F32(z), Src::F32(w)) => run!(o, y, x, z, w),
        (Dst::Bf16(o), Src::Bf16(y), Src::Bf16(x), Src::Bf16(z), Src::Bf16(w)) => {
            run!(o, y, x, z, w)
        }
        _ => Err(CoreError::invalid(
            "y, x, z, weight and out must share one dtype",
        )),
    }
}

/// The activation of a fused gate/up projection: rows of `2d` elements,
/// gate first, then up.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GatedAct {
    /// `round(silu(gate)) * up`.
    Silu,
    /// `round(gelu_tanh(gate)) * up` (GELU, tanh approximation).
    GeluTanh,
    /// `round(gelu(gate)) * up` (GELU exact, erf: ModernBERT's GeGLU).
    Gelu,
    /// gpt-oss: `g = min(gate, limit)`, `u = clamp(up, -limit, limit)`,
    /// `(u + 1) * g * sigmoid(alpha * g)`, each op rounded as torch does.
    SwigluOai { alpha: f32, limit: f32 },
}

impl GatedAct {
    /// The name the bindings use: "silu", "gelu_tanh", "gelu" or "swiglu_oai".
    pub fn name(self) -> &'static str {
        match self {
            GatedAct::Silu => "silu",
            GatedAct::GeluTanh => "gelu_tanh",
            GatedAct::Gelu => "gelu",
            GatedAct::SwigluOai { .. } => "swiglu_oai",
        }
    }
}

/// `out[r] = round(silu(x[r, :d])) * x[r, d:]` for rows of `2d` elements
/// (the fused gate/up projection), `out` of rows of `d`.
pub fn silu_and_mul(out: Dst<'_>, x: Src<'_>, d: usize) -> CoreResult<()> {
    gated_act(out, x, d, GatedAct::Silu)
}

/// `out[r] = act(x[r, :d], x[r, d:])` for rows of `2d` elements (the fused
/// gate/up projection), `out` of rows of `d`; one dtype.
pub fn gated_act(out: Dst<'_>, x: Src<'_>, d: usize, act: GatedAct) -> CoreResult<()> {
    if d == 0 || !x.len().is_multiple_of(2 * d) {
        return Err(CoreError::invalid(format!(
            "x: expected rows of 2 x {d} elements, got {} elements",
            x.len()
        )));
    }
    let rows = x.len() / (2 * d);
    if out.len() != rows * d {
        return Err(CoreError::invalid(format!(
            "out: expected {rows} x {d} elements, got {}",
            out.len()
        )));
    }
    match (out, x) {
        (Dst::F32(o), Src::F32(x)) => act_rows(o, x, d, rows, act),
        (Dst::Bf16(o), Src::Bf16(x)) => act_rows(o, x, d, rows, act),
        _ => Err(CoreError::invalid("x and out must share one dtype")),
    }
}

/// Shapes of a fused QKV projection for [`qkv_rotary`].
#[derive(Clone, Copy, Debug)]
pub struct QkvShape {
    pub tokens: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// Features per head.
    pub head_dim: usize,
    /// Rotated pairs per head: the first `2 * half` features rotate.
    pub half: usize,
}

/// Splits a fused QKV projection and applies rotary embeddings (NeoX style:
/// the first `2 * half` features of each head as two halves) to its query
/// and key heads: `qkv` `[tokens, (heads + 2 kv_heads) * head_dim]`, `cos` and
/// `sin` `[tokens, half]`; `q` `[tokens, heads * head_dim]`, `k` and `v`
/// `[tokens, kv_heads * head_dim]`. Each product and each sum is rounded to
/// the element type, as the model's torch code does (`x1 * cos - x2 * sin`).
#[allow(clippy::too_many_arguments)]
pub fn qkv_rotary(
    q: Dst<'_>,
    k: Dst<'_>,
    v: Dst<'_>,
    qkv: Src<'_>,
    cos: Src<'_>,
    sin: Src<'_>,
    shape: QkvShape,
) -> CoreResult<()> {
    let QkvShape {
        tokens,
        heads,
        kv_heads,
        head_dim: d,
        half,
    } = shape;
    if 2 * half > d {
        return Err(CoreError::invalid(format!(
            "cos: {half} rotated pairs exceed the head size {d}"
        )));
    }
    let expect = |what: &str, got: usize, want: usize| {
        if got == want {
            Ok(())
        } else {
            Err(CoreError::invalid(format!(
                "{what}: expected {want} elements, got {got}"
            )))
        }
    };
    expect("qkv", qkv.len(), tokens * (heads + 2 * kv_heads) * d)?;
    expect("cos", cos.len(), tokens * half)?;
    expect("sin", sin.len(), tokens * half)?;
    expect("q", q.len(), tokens * heads * d)?;
    expect("k", k.len(), tokens * kv_heads * d)?;
    expect("v", v.len(), tokens * kv_heads * d)?;
    match (q, k, v, qkv, cos, sin) {
        (Dst::F32(q), Dst::F32(k), Dst::F32(v), Src::F32(x), Src::F32(c), Src::F32(s)) => {
            rotary_rows(q, k, v, x, c, s, shape)
        }
        (Dst::Bf16(q), Dst::Bf16(k), Dst::Bf16(v), Src::Bf16(x), Src::Bf16(c), Src::Bf16(s)) => {
            rotary_rows(q, k, v, x, c, s, shape)
        }
        _ => Err(CoreError::invalid(
            "q, k, v, qkv, cos and sin must share one dtype",
        )),
    }
}

#[allow(clippy::too_many_arguments)]
fn rotary_rows<T: Element>(
    q: &mut [T],
    k: &mut [T],
    v: &mut [T],
    x: &[T],
    cos: &[T],
    sin: &[T],
    shape: QkvShape,
) -> CoreResult<()> {
    let QkvShape {
        tokens,
        heads,
        kv_heads,
        head_dim: d,
        half,
    } = shape;
    let width = (heads + 2 * kv_heads) * d;
    let path = best_path();
    let (qp, kp, vp) = (
        SharedOut(q.as_mut_ptr()),
        SharedOut(k.as_mut_ptr()),
        SharedOut(v.as_mut_ptr()),
    );
    for_row_chunks(tokens, width, |t0, t1| {
        for t in t0..t1 {
            // SAFETY: token t's rows of q, k and v belong to this chunk only;
            // their lengths were checked by the caller.
            let (qr, kr, vr) = unsafe {
                (
                    std::slice::from_raw_parts_mut(qp.ptr().add(t * heads * d), heads * d),
                    std::slice::from_raw_parts_mut(kp.ptr().add(t * kv_heads * d), kv_heads * d),
                    std::slice::from_raw_parts_mut(vp.ptr().add(t * kv_heads * d), kv_heads * d),
                )
            };
            let row = &x[t * width..(t + 1) * width];
            let (c, s) = (
                &cos[t * half..(t + 1) * half],
                &sin[t * half..(t + 1) * half],
            );
            let (xq, rest) = row.split_at(heads * d);
            let (xk, xv) = rest.split_at(kv_heads * d);
            dispatch(
                path,
                Rotate {
                    out: qr,
                    x: xq,
                    cos: c,
                    sin: s,
                    d,
                },
            );
            dispatch(
                path,
                Rotate {
                    out: kr,
                    x: xk,
                    cos: c,
                    sin: s,
                    d,
                },
            );
            vr.copy_from_slice(xv);
        }
    })
}

fn norm_rows<T: Element>(
    out: &mut [T],
    x: &[T],
    w: &[T],
    eps: f32,
    dim: usize,
    rows: usize,
) -> CoreResult<()> {
    let shared = SharedOut(out.as_mut_ptr());
    for_row_chunks(rows, dim, |r0, r1| {
        // SAFETY: rows r0..r1 of out belong to this chunk only; out holds
        // rows * dim elements (checked by the caller).
        let o =
            unsafe { std::slice::from_raw_parts_mut(shared.ptr().add(r0 * dim), (r1 - r0) * dim) };
        let x = &x[r0 * dim..r1 * dim];
        dispatch(
            best_path(),
            Norm {
                out: o,
                x,
                w,
                eps,
                dim,
            },
        );
    })
}

fn act_rows<T: Element>(
    out: &mut [T],
    x: &[T],
    d: usize,
    rows: usize,
    act: GatedAct,
) -> CoreResult<()> {
    let shared = SharedOut(out.as_mut_ptr());
    for_row_chunks(rows, 2 * d, |r0, r1| {
        // SAFETY: rows r0..r1 of out belong to this chunk only; out holds
        // rows * d elements (checked by the caller).
        let o = unsafe { std::slice::from_raw_parts_mut(shared.ptr().add(r0 * d), (r1 - r0) * d) };
        let x = &x[r0 * 2 * d..r1 * 2 * d];
        dispatch(best_path(), Act { out: o, x, d, act });
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::kernels::exp_f32;
    use super::*;
    use half::bf16;

    #[test]
    fn exp_is_accurate_and_saturates() {
        for i in -8000..=8800 {
            let i = i.min(8830);
            let x = i as f32 * 0.01;
            let want = (x as f64).exp();
            let got = exp_f32(x) as f64;
            assert!(
                ((got - want) / want).abs() < 3e-7,
                "exp({x}) = {got}, want {want}"
            );
        }
        assert!(exp_f32(-1000.0) < 1e-37);
        assert!(exp_f32(f32::NEG_INFINITY) < 1e-37);
    }

    /// erf in f64: its Maclaurin series for |x| <= 3 (to ~1e-12), else the
    /// asymptotic series of erfc to five terms (to ~1e-8 at 3, better beyond).
    pub(crate) fn erf64(x: f64) -> f64 {
        if x.abs() > 3.0 {
            return x.signum() * (1.0 - erfc64(x.abs()));
        }
        let (mut term, mut sum, mut n) = (x, x, 0.0f64);
        while term.abs() > 1e-17 * sum.abs().max(1e-300) || n < 3.0 {
            n += 1.0;
            term *= -x * x / n;
            sum += term / (2.0 * n + 1.0);
            if n > 400.0 {
                break;
            }
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }

    /// erfc in f64 for `a >= 0`, to a small relative error: `1 - erf64` up
    /// to 3, beyond it the asymptotic series (relative error below 5e-4).
    pub(crate) fn erfc64(a: f64) -> f64 {
        if a <= 3.0 {
            return 1.0 - erf64(a);
        }
        let z = 1.0 / (a * a);
        let series =
            1.0 - z / 2.0 + 3.0 * z * z / 4.0 - 15.0 * z.powi(3) / 8.0 + 105.0 * z.powi(4) / 16.0;
        (-a * a).exp() / (a * std::f64::consts::PI.sqrt()) * series
    }

    #[test]
    fn erf_and_gelu_are_accurate() {
        for i in -600..=600 {
            let x = i as f32 * 0.01;
            let got = kernels::erf(x) as f64;
            let want = erf64(x as f64);
            assert!((got - want).abs() < 5e-7, "erf({x}) = {got}, want {want}");
        }
        let x: Vec<f32> = (-4000..4000).map(|i| i as f32 * 0.0025).collect();
        let mut out = vec![0f32; x.len()];
        gelu(Dst::F32(&mut out), Src::F32(&x)).unwrap();
        for (&v, &o) in x.iter().zip(&out) {
            let v = v as f64;
            let want = 0.5 * v * (1.0 + erf64(v / 2f64.sqrt()));
            assert!(
                (o as f64 - want).abs() < 3e-7 * (1.0 + v.abs()),
                "gelu({v}) = {o}"
            );
        }
        assert!(gelu(Dst::F32(&mut out[..3]), Src::F32(&x)).is_err());
    }

    #[test]
    fn gelu_far_negative_tail_has_no_cancellation() {
        // GELU(g < 0) = 0.5 g erfc(|g| / sqrt 2) is tiny there: within 1% of
        // it down to g = -7 (below, within 1e-12); as 0.5 g (1 + erf) it was
        // off by ~1e-6 at -5, where it is -1.4e-6.
        let x: Vec<f32> = (300..1200).map(|i| i as f32 * -0.01).collect();
        let mut out = vec![0f32; x.len()];
        gelu(Dst::F32(&mut out), Src::F32(&x)).unwrap();
        for (&v, &o) in x.iter().zip(&out) {
            let a = (v as f64).abs() / 2f64.sqrt();
            let want = 0.5 * v as f64 * erfc64(a);
            let bound = if v >= -7.0 { 1e-2 * want.abs() } else { 1e-12 };
            assert!(
                (o as f64 - want).abs() <= bound,
                "gelu({v}) = {o}, want {want}"
            );
        }
    }

    /// Mean and (biased) variance of a row.
    fn moments(s: &[f64]) -> (f64, f64) {
        let mean = s.iter().sum::<f64>() / s.len() as f64;
        let var = s.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / s.len() as f64;
        (mean, var)
    }

    #[test]
    fn layer_norm_matches_definition() {
        let (dim, rows) = (45, 7);
        let x: Vec<f32> = (0..rows * dim)
            .map(|i| ((i * 7919) % 31) as f32 * 0.3 - 4.0)
            .collect();
        let res: Vec<f32> = (0..rows * dim)
            .map(|i| ((i * 104729) % 17) as f32 * 0.1)
            .collect();
        let w: Vec<f32> = (0..dim).map(|i| 0.5 + i as f32 * 0.02).collect();
        let b: Vec<f32> = (0..dim).map(|i| i as f32 * 0.01 - 0.2).collect();
        for (with_res, with_bias) in [(true, true), (false, true), (true, false)] {
            let mut out = vec![0f32; rows * dim];
            layer_norm(
                Dst::F32(&mut out),
                Src::F32(&x),
                with_res.then_some(Src::F32(&res)),
                Src::F32(&w),
                with_bias.then_some(Src::F32(&b)),
                1e-12,
                dim,
            )
            .unwrap();
            for r in 0..rows {
                let s: Vec<f64> = (0..dim)
                    .map(|j| {
                        x[r * dim + j] as f64
                            + if with_res {
                                res[r * dim + j] as f64
                            } else {
                                0.0
                            }
                    })
                    .collect();
                let (mean, var) = moments(&s);
                for j in 0..dim {
                    let bias = if with_bias { b[j] as f64 } else { 0.0 };
                    let want = (s[j] - mean) / (var + 1e-12).sqrt() * w[j] as f64 + bias;
                    let got = out[r * dim + j] as f64;
                    assert!(
                        (got - want).abs() < 1e-5,
                        "row {r} col {j}: {got} vs {want}"
                    );
                }
            }
        }
        // bf16: the sum rounds first, the result once.
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let rb: Vec<bf16> = res.iter().map(|&v| bf16::from_f32(v)).collect();
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let mut out = vec![bf16::ZERO; rows * dim];
        layer_norm(
            Dst::Bf16(&mut out),
            Src::Bf16(&xb),
            Some(Src::Bf16(&rb)),
            Src::Bf16(&wb),
            None,
            1e-12,
            dim,
        )
        .unwrap();
        for r in 0..rows {
            let s: Vec<f64> = (0..dim)
                .map(|j| {
                    bf16::from_f32(xb[r * dim + j].to_f32() + rb[r * dim + j].to_f32()).to_f32()
                        as f64
                })
                .collect();
            let (mean, var) = moments(&s);
            for j in 0..dim {
                let want = (s[j] - mean) / (var + 1e-12).sqrt() * wb[j].to_f32() as f64;
                let got = out[r * dim + j].to_f32() as f64;
                assert!(
                    (got - want).abs() <= 1e-5 + want.abs() * 2f64.powi(-8),
                    "{got} vs {want}"
                );
            }
        }
        let mut short = vec![0f32; 3];
        assert!(layer_norm(
            Dst::F32(&mut short),
            Src::F32(&x),
            None,
            Src::F32(&w),
            None,
            1e-5,
            dim
        )
        .is_err());
    }

    #[test]
    fn rms_norm_matches_definition() {
        let dim = 37;
        let rows = 5;
        let x: Vec<f32> = (0..rows * dim)
            .map(|i| ((i * 7919) % 23) as f32 - 11.0)
            .collect();
        let w: Vec<f32> = (0..dim).map(|i| 0.5 + i as f32 * 0.01).collect();
        let mut out = vec![0f32; rows * dim];
        rms_norm(Dst::F32(&mut out), Src::F32(&x), Src::F32(&w), 1e-6, dim).unwrap();
        for r in 0..rows {
            let row = &x[r * dim..(r + 1) * dim];
            let ms: f64 = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / dim as f64;
            let inv = 1.0 / (ms + 1e-6).sqrt();
            for j in 0..dim {
                let want = w[j] as f64 * row[j] as f64 * inv;
                assert!(
                    (out[r * dim + j] as f64 - want).abs() < 1e-5,
                    "row {r} col {j}"
                );
            }
        }
    }

    #[test]
    fn silu_and_mul_rounds_like_torch_in_bf16() {
        let d = 70;
        let rows = 3;
        let x: Vec<bf16> = (0..rows * 2 * d)
            .map(|i| bf16::from_f32((i as f32 - 200.0) * 0.037))
            .collect();
        let mut out = vec![bf16::ZERO; rows * d];
        silu_and_mul(Dst::Bf16(&mut out), Src::Bf16(&x), d).unwrap();
        for r in 0..rows {
            for j in 0..d {
                let g = x[r * 2 * d + j].to_f32() as f64;
                let u = x[r * 2 * d + d + j].to_f32();
                let s = bf16::from_f32((g / (1.0 + (-g).exp())) as f32).to_f32();
                assert_eq!(out[r * d + j], bf16::from_f32(s * u), "row {r} col {j}");
            }
        }
    }

    #[test]
    fn gated_act_moe_activations_match_definitions() {
        let d = 300;
        let x: Vec<f32> = (0..2 * d).map(|i| (i as f32 - 290.0) * 0.041).collect();
        let swiglu = GatedAct::SwigluOai {
            alpha: 1.702,
            limit: 7.0,
        };
        let reference = |act: GatedAct, g: f64, u: f64| match act {
            GatedAct::Silu => g / (1.0 + (-g).exp()) * u,
            GatedAct::GeluTanh => {
                let z = (2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g.powi(3));
                0.5 * g * (1.0 + z.tanh()) * u
            }
            GatedAct::Gelu => 0.5 * g * (1.0 + erf64(g / 2f64.sqrt())) * u,
            GatedAct::SwigluOai { alpha, limit } => {
                let (g, u) = (g.min(limit as f64), u.clamp(-limit as f64, limit as f64));
                (u + 1.0) * g / (1.0 + (-(alpha as f64) * g).exp())
            }
        };
        for act in [GatedAct::Silu, GatedAct::GeluTanh, GatedAct::Gelu, swiglu] {
            let mut out = vec![0f32; d];
            gated_act(Dst::F32(&mut out), Src::F32(&x), d, act).unwrap();
            let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let mut outb = vec![bf16::ZERO; d];
            gated_act(Dst::Bf16(&mut outb), Src::Bf16(&xb), d, act).unwrap();
            for j in 0..d {
                let (g, u) = (x[j] as f64, x[d + j] as f64);
                let want = reference(act, g, u);
                let got = out[j] as f64;
                // The exact GELU's erf is good to 5e-7 (absolute, see
                // `erf_and_gelu_are_accurate`), which the product scales by u.
                let erf = if act == GatedAct::Gelu {
                    3e-7 * (1.0 + g.abs()) * u.abs()
                } else {
                    0.0
                };
                assert!(
                    (got - want).abs() <= 1e-6 * (1.0 + want.abs()) + erf,
                    "{act:?} [{j}]"
                );
                // bf16: a few roundings of 2^-9 each.
                let (g, u) = (xb[j].to_f32() as f64, xb[d + j].to_f32() as f64);
                let want = reference(act, g, u);
                let got = outb[j].to_f32() as f64;
                let tol = 2f64.powi(-7) * (want.abs() + (g * u).abs()) + 1e-6;
                assert!((got - want).abs() <= tol, "{act:?} bf16 [{j}]");
            }
        }
        // The gpt-oss clamps: gate above the limit, up below -limit.
        let x = [9.0f32, -9.0];
        let mut out = [0f32; 1];
        gated_act(Dst::F32(&mut out), Src::F32(&x), 1, swiglu).unwrap();
        let want = (-7.0 + 1.0) * 7.0 / (1.0 + (-1.702f64 * 7.0).exp());
        assert!((out[0] as f64 - want).abs() < 1e-5, "{}", out[0]);
    }

    #[test]
    fn qkv_rotary_splits_and_rotates() {
        let (tokens, heads, kv_heads, d, half) = (3, 4, 2, 10, 4);
        let width = (heads + 2 * kv_heads) * d;
        let x: Vec<f32> = (0..tokens * width)
            .map(|i| (i as f32 * 0.37).sin())
            .collect();
        let cos: Vec<f32> = (0..tokens * half).map(|i| (i as f32 * 0.2).cos()).collect();
        let sin: Vec<f32> = (0..tokens * half).map(|i| (i as f32 * 0.2).sin()).collect();
        let (mut q, mut k, mut v) = (
            vec![0f32; tokens * heads * d],
            vec![0f32; tokens * kv_heads * d],
            vec![0f32; tokens * kv_heads * d],
        );
        let shape = QkvShape {
            tokens,
            heads,
            kv_heads,
            head_dim: d,
            half,
        };
        qkv_rotary(
            Dst::F32(&mut q),
            Dst::F32(&mut k),
            Dst::F32(&mut v),
            Src::F32(&x),
            Src::F32(&cos),
            Src::F32(&sin),
            shape,
        )
        .unwrap();
        for t in 0..tokens {
            for h in 0..heads + 2 * kv_heads {
                let src = &x[t * width + h * d..][..d];
                let got = match h {
                    h if h < heads => &q[(t * heads + h) * d..][..d],
                    h if h < heads + kv_heads => &k[(t * kv_heads + h - heads) * d..][..d],
                    h => &v[(t * kv_heads + h - heads - kv_heads) * d..][..d],
                };
                for i in 0..d {
                    let want = if h >= heads + kv_heads || i >= 2 * half {
                        src[i]
                    } else {
                        let (c, s) = (cos[t * half + i % half], sin[t * half + i % half]);
                        let (a, b) = (src[i % half], src[half + i % half]);
                        if i < half {
                            a * c - b * s
                        } else {
                            b * c + a * s
                        }
                    };
                    assert!(
                        (got[i] - want).abs() < 1e-6,
                        "token {t} head {h} feature {i}"
                    );
                }
            }
        }
        let bad = QkvShape { half: 6, ..shape };
        let err = qkv_rotary(
            Dst::F32(&mut q),
            Dst::F32(&mut k),
            Dst::F32(&mut v),
            Src::F32(&x),
            Src::F32(&cos),
            Src::F32(&sin),
            bad,
        );
        assert!(err.is_err());
    }

    #[test]
    fn rejects_bad_shapes_and_mixed_dtypes() {
        let x = vec![0f32; 12];
        let w = vec![1f32; 4];
        let mut out = vec![0f32; 12];
        assert!(rms_norm(Dst::F32(&mut out), Src::F32(&x), Src::F32(&w[..3]), 1e-6, 4).is_err());
        assert!(rms_norm(Dst::F32(&mut out[..8]), Src::F32(&x), Src::F32(&w), 1e-6, 4).is_err());
        let xb = vec![bf16::ZERO; 12];
        assert!(rms_norm(Dst::F32(&mut out), Src::Bf16(&xb), Src::F32(&w), 1e-6, 4).is_err());
        assert!(silu_and_mul(Dst::F32(&mut out[..6]), Src::F32(&x), 4).is_err());
        assert!(silu_and_mul(Dst::F32(&mut out[..6]), Src::F32(&x), 3).is_ok());
    }
}

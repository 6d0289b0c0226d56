//! The bodies of the elementwise layers, written once and compiled for each
//! ISA through `cpu::simd` (they are plain f32 loops that LLVM vectorises
//! for the entry point's features), with one `Kernel` per body.

use super::GatedAct;
use crate::cpu::simd::{Kernel, Simd};
use crate::cpu::Element;

/// RMSNorm of the rows of `x` into `out`.
pub(super) struct Norm<'a, T> {
    pub(super) out: &'a mut [T],
    pub(super) x: &'a [T],
    pub(super) w: &'a [T],
    pub(super) eps: f32,
    pub(super) dim: usize,
}

impl<T: Element> Kernel for Norm<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self) {
        norm_body(self.out, self.x, self.w, self.eps, self.dim)
    }
}

/// LayerNorm of the rows of `x` (plus `residual`'s, rounded first) into `out`.
pub(super) struct LayerNorm<'a, T> {
    pub(super) out: &'a mut [T],
    pub(super) x: &'a [T],
    pub(super) residual: Option<&'a [T]>,
    pub(super) w: &'a [T],
    pub(super) b: Option<&'a [T]>,
    pub(super) eps: f32,
    pub(super) dim: usize,
}

impl<T: Element> Kernel for LayerNorm<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self) {
        let LayerNorm {
            out,
            x,
            residual,
            w,
            b,
            eps,
            dim,
        } = self;
        layer_norm_body(out, x, residual, w, b, eps, dim)
    }
}

/// Exact (erf) GELU of every element of `x` into `out`.
pub(super) struct Gelu<'a, T> {
    pub(super) out: &'a mut [T],
    pub(super) x: &'a [T],
}

impl<T: Element> Kernel for Gelu<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self) {
        for (o, &v) in self.out.iter_mut().zip(self.x) {
            *o = T::from_f32(gelu_erf(v.to_f32()));
        }
    }
}

/// A gated activation of the rows of `x` (`2d` each: gate, then up) into
/// `out` (`d` each).
pub(super) struct Act<'a, T> {
    pub(super) out: &'a mut [T],
    pub(super) x: &'a [T],
    pub(super) d: usize,
    pub(super) act: GatedAct,
}

impl<T: Element> Kernel for Act<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self) {
        act_body(self.out, self.x, self.d, self.act)
    }
}

/// `out = round(x * round(sigmoid(gate)))` elementwise (an attention
/// output gate).
pub(super) struct SigmoidMul<'a, T> {
    pub(super) out: &'a mut [T],
    pub(super) x: &'a [T],
    pub(super) gate: &'a [T],
}

impl<T: Element> Kernel for SigmoidMul<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self) {
        for ((o, &v), &g) in self.out.iter_mut().zip(self.x).zip(self.gate) {
            *o = T::from_f32(v.to_f32() * T::round(sigmoid(g.to_f32())));
        }
    }
}

/// RMSNorm of the rows of `x` (rounded as [`Norm`]) times `silu(z)` in
/// f32, rounded once.
pub(super) struct GatedNorm<'a, T> {
    pub(super) out: &'a mut [T],
    pub(super) x: &'a [T],
    pub(super) z: &'a [T],
    pub(super) w: &'a [T],
    pub(super) eps: f32,
    pub(super) dim: usize,
}

impl<T: Element> Kernel for GatedNorm<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self) {
        let GatedNorm {
            out,
            x,
            z,
            w,
            eps,
            dim,
        } = self;
        norm_body(out, x, w, eps, dim);
        for (o, &g) in out.iter_mut().zip(z) {
            *o = T::from_f32(o.to_f32() * silu(g.to_f32()));
        }
    }
}

/// Gated DeltaNet's per-head gates of the rows of `a` and `b` (`heads`
/// each): `beta = round(sigmoid(b))` and `g = -e^A_log * softplus(a + dt_bias)`
/// in f32 (softplus `ln(1 + e^x)`, or `x` above 20, as torch's).
pub(super) struct DeltaGates<'a, T> {
    pub(super) g: &'a mut [f32],
    pub(super) beta: &'a mut [f32],
    pub(super) a: &'a [T],
    pub(super) b: &'a [T],
    pub(super) a_log: &'a [f32],
    pub(super) dt_bias: &'a [f32],
}

impl<T: Element> Kernel for DeltaGates<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self) {
        let heads = self.a_log.len();
        for (beta, &b) in self.beta.iter_mut().zip(self.b) {
            *beta = T::round(sigmoid(b.to_f32()));
        }
        for (g, a) in self
            .g
            .chunks_exact_mut(heads)
            .zip(self.a.chunks_exact(heads))
        {
            for (((g, &a), &al), &dt) in g.iter_mut().zip(a).zip(self.a_log).zip(self.dt_bias) {
                let x = a.to_f32() + dt;
                let softplus = if x > 20.0 { x } else { exp_f32(x).ln_1p() };
                *g = -exp_f32(al) * softplus;
            }
        }
    }
}

/// Mamba-2's per-head time steps of the rows of `dt` (`heads` each):
/// `beta = clamp(softplus(dt + dt_bias), lo, hi)` (softplus as
/// [`DeltaGates`]') and `g = -e^A_log * beta`, both f32.
pub(super) struct MambaGates<'a, T> {
    pub(super) g: &'a mut [f32],
    pub(super) beta: &'a mut [f32],
    pub(super) dt: &'a [T],
    pub(super) a_log: &'a [f32],
    pub(super) dt_bias: &'a [f32],
    pub(super) limit: (f32, f32),
}

impl<T: Element> Kernel for MambaGates<'_, T> {
    type Output = ();
    #[inline(always)]
    #[allow(clippy::manual_clamp)] // clamp panics on a NaN bound; max/min do as torch's clamp
    fn run<S: Simd>(self) {
        let heads = self.a_log.len();
        let (lo, hi) = self.limit;
        let rows = self
            .g
            .chunks_exact_mut(heads)
            .zip(self.beta.chunks_exact_mut(heads));
        for ((g, beta), dt) in rows.zip(self.dt.chunks_exact(heads)) {
            let params = self.a_log.iter().zip(self.dt_bias);
            for (((g, beta), &dt), (&al, &bias)) in g.iter_mut().zip(beta).zip(dt).zip(params) {
                let x = dt.to_f32() + bias;
                let softplus = if x > 20.0 { x } else { exp_f32(x).ln_1p() };
                *beta = softplus.max(lo).min(hi);
                *g = -exp_f32(al) * *beta;
            }
        }
    }
}

/// Mamba-2's output of the rows of the scan `y` (`dim = heads x head_dim`
/// each): `v = (y + D x) silu(z)` in f32 (`D` per head), RMS-normalised
/// over each of `groups` equal slices, times the weight, rounded once.
pub(super) struct MambaNorm<'a, T> {
    pub(super) out: &'a mut [T],
    pub(super) y: &'a [T],
    pub(super) x: &'a [T],
    pub(super) z: &'a [T],
    pub(super) d: &'a [f32],
    pub(super) w: &'a [T],
    pub(super) head_dim: usize,
    pub(super) groups: usize,
    pub(super) eps: f32,
}

impl<T: Element> Kernel for MambaNorm<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self) {
        let dim = self.w.len();
        let group = dim / self.groups;
        let mut v = vec![0f32; dim];
        let rows = self.out.chunks_exact_mut(dim).zip(self.y.chunks_exact(dim));
        for ((o, y), (x, z)) in rows.zip(self.x.chunks_exact(dim).zip(self.z.chunks_exact(dim))) {
            for (h, d) in self.d.iter().enumerate() {
                let at = h * self.head_dim..(h + 1) * self.head_dim;
                let parts = v[at.clone()]
                    .iter_mut()
                    .zip(&y[at.clone()])
                    .zip(&x[at.clone()]);
                for (((v, &y), &x), &z) in parts.zip(&z[at]) {
                    *v = (y.to_f32() + d * x.to_f32()) * silu(z.to_f32());
                }
            }
            for ((o, v), w) in o
                .chunks_exact_mut(group)
                .zip(v.chunks_exact(group))
                .zip(self.w.chunks_exact(group))
            {
                let r = 1.0 / (sum16(v, |a| a * a) / group as f32 + self.eps).sqrt();
                for ((o, &a), &wv) in o.iter_mut().zip(v).zip(w) {
                    *o = T::from_f32(wv.to_f32() * (a * r));
                }
            }
        }
    }
}

/// Rotary embedding of the heads (`d` features) of one token.
pub(super) struct Rotate<'a, T> {
    pub(super) out: &'a mut [T],
    pub(super) x: &'a [T],
    pub(super) cos: &'a [T],
    pub(super) sin: &'a [T],
    pub(super) d: usize,
}

impl<T: Element> Kernel for Rotate<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self) {
        rotate_body(self.out, self.x, self.cos, self.sin, self.d)
    }
}

/// Rotates every head (`d` features) of `x` into `out` with one token's
/// `cos` / `sin`.
#[inline(always)]
fn rotate_body<T: Element>(out: &mut [T], x: &[T], cos: &[T], sin: &[T], d: usize) {
    let half = cos.len();
    for (o, xh) in out.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
        let (o1, o_rest) = o.split_at_mut(half);
        let (o2, o3) = o_rest.split_at_mut(half);
        let (x1, x_rest) = xh.split_at(half);
        let (x2, x3) = x_rest.split_at(half);
        // Zipped (no bounds checks) so that the loop vectorises.
        let pairs = o1.iter_mut().zip(o2.iter_mut()).zip(x1.iter().zip(x2));
        for (((p, q), (a, b)), (c, s)) in pairs.zip(cos.iter().zip(&sin[..half])) {
            let (a, b, c, s) = (a.to_f32(), b.to_f32(), c.to_f32(), s.to_f32());
            *p = T::from_f32(T::round(a * c) - T::round(b * s));
            *q = T::from_f32(T::round(b * c) + T::round(a * s));
        }
        o3.copy_from_slice(x3);
    }
}

/// `e^x` for the SiLU: relative error below 2e-7 over the f32 range, 0 below
/// -87.3, and written without branches or libm so that it vectorises. (The
/// attention kernel's `exp_nonpos` covers only x <= 0; a SiLU built on it,
/// when it still cast with a saturating `as`, measured 2.2x slower in
/// `cargo bench --bench gemm -- layers/silu`.)
#[inline(always)]
#[allow(clippy::manual_clamp)] // clamp does not vectorise here
pub(super) fn exp_f32(x: f32) -> f32 {
    // max/min, not clamp: they vectorise (a NaN x is lost here, but the
    // SiLU's numerator keeps it).
    let x = x.max(-87.3).min(88.3);
    let t = x * std::f32::consts::LOG2_E;
    // Round to nearest by the 1.5 * 2^23 trick (no libm call).
    let n = (t + 12_582_912.0) - 12_582_912.0;
    // y = x - n ln2 in two steps (Cody-Waite): ln2's high part has few
    // bits, so n * LN2_HI is exact and large |x| keeps full precision.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let y = (x - n * LN2_HI) - n * LN2_LO;
    // e^y on |y| <= ln2 / 2, Taylor to degree 7.
    let p = 1.0
        + y * (1.0
            + y * (0.5
                + y * (1.0 / 6.0
                    + y * (1.0 / 24.0
                        + y * (1.0 / 120.0 + y * (1.0 / 720.0 + y * (1.0 / 5040.0)))))));
    // SAFETY: |n| <= 128 after the clamp, so it fits an i32.
    let n = unsafe { n.to_int_unchecked::<i32>() };
    let scale = f32::from_bits(((n + 127) as u32) << 23);
    p * scale
}

#[inline(always)]
fn silu(g: f32) -> f32 {
    g / (1.0 + exp_f32(-g))
}

/// `1 / (1 + e^-z)`.
#[inline(always)]
fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + exp_f32(-z))
}

/// GELU, tanh approximation: `0.5 g (1 + tanh(z))` written as the equal
/// `g sigmoid(2z)`, `z = sqrt(2/pi) (g + 0.044715 g^3)` (no tanh to call).
#[inline(always)]
fn gelu_tanh(g: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let z = SQRT_2_OVER_PI * (g + 0.044_715 * g * g * g);
    g / (1.0 + exp_f32(-2.0 * z))
}

/// `erfc(a)` for `a >= 0` as Abramowitz and Stegun 7.1.26 writes it,
/// `t P(t) e^(-a^2)` with `t = 1 / (1 + p a)`: no branches or libm, so a
/// loop over it vectorises. Absolute error below 5e-7; relative error below
/// 2e-3 for `a < 3.6` and below 7e-3 for `a < 5`.
#[inline(always)]
fn erfc_nonneg(a: f32) -> f32 {
    const P: f32 = 0.327_591_1;
    const A: [f32; 5] = [
        0.254_829_6,
        -0.284_496_74,
        1.421_413_7,
        -1.453_152_1,
        1.061_405_4,
    ];
    let t = 1.0 / (1.0 + P * a);
    let poly = t * (A[0] + t * (A[1] + t * (A[2] + t * (A[3] + t * A[4]))));
    poly * exp_f32(-a * a)
}

/// `erf(x)`, absolute error below 5e-7 (see [`erfc_nonneg`]); the kernels
/// use the erfc form, the tests check both.
#[cfg(test)]
#[inline(always)]
pub(super) fn erf(x: f32) -> f32 {
    let y = 1.0 - erfc_nonneg(x.abs());
    if x < 0.0 {
        -y
    } else {
        y
    }
}

/// GELU as `0.5 g (1 + erf(g / sqrt(2)))` (torch's default, `approximate="none"`).
/// For `g < 0` that is `0.5 g erfc(|g| / sqrt(2))`, taken in that form: `1 +
/// erf` would cancel to a few ulp of 1 in the far negative tail (about 1e-6
/// off at `g = -5`, where GELU is -1.4e-6), the erfc form is within 0.2%.
#[inline(always)]
fn gelu_erf(g: f32) -> f32 {
    let c = erfc_nonneg(g.abs() * std::f32::consts::FRAC_1_SQRT_2);
    if g < 0.0 {
        0.5 * g * c
    } else {
        g * (1.0 - 0.5 * c)
    }
}

/// LayerNorm of each row: `s = round(x + residual)` (no residual: `x`),
/// mean and variance of `s` in f32 (two passes, sixteen partial sums),
/// then `round((s - mean) * rstd * w + b)` in f32, as torch's mixed-type
/// `layer_norm` computes a bf16 row.
#[inline(always)]
fn layer_norm_body<T: Element>(
    out: &mut [T],
    x: &[T],
    residual: Option<&[T]>,
    w: &[T],
    b: Option<&[T]>,
    eps: f32,
    dim: usize,
) {
    let mut row = vec![0f32; dim];
    for (r, (o, xr)) in out
        .chunks_exact_mut(dim)
        .zip(x.chunks_exact(dim))
        .enumerate()
    {
        match residual {
            Some(res) => {
                for ((d, &a), &c) in row.iter_mut().zip(xr).zip(&res[r * dim..(r + 1) * dim]) {
                    *d = T::round(a.to_f32() + c.to_f32());
                }
            }
            None => {
                for (d, &a) in row.iter_mut().zip(xr) {
                    *d = a.to_f32();
                }
            }
        }
        let n = dim as f32;
        let mean = sum16(&row, |v| v) / n;
        let var = sum16(&row, |v| (v - mean) * (v - mean)) / n;
        let rstd = 1.0 / (var + eps).sqrt();
        match b {
            Some(b) => {
                for (((d, &v), &wv), &bv) in o.iter_mut().zip(&row).zip(w).zip(b) {
                    *d = T::from_f32((v - mean) * rstd * wv.to_f32() + bv.to_f32());
                }
            }
            None => {
                for ((d, &v), &wv) in o.iter_mut().zip(&row).zip(w) {
                    *d = T::from_f32((v - mean) * rstd * wv.to_f32());
                }
            }
        }
    }
}

/// `sum(f(v))` over `xs` in sixteen partial sums (vectorisable).
#[inline(always)]
fn sum16(xs: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; 16];
    let mut it = xs.chunks_exact(16);
    for c in &mut it {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f(v);
        }
    }
    let tail: f32 = it.remainder().iter().map(|&v| f(v)).sum();
    acc.iter().sum::<f32>() + tail
}

#[inline(always)]
fn norm_body<T: Element>(out: &mut [T], x: &[T], w: &[T], eps: f32, dim: usize) {
    for (o, xr) in out.chunks_exact_mut(dim).zip(x.chunks_exact(dim)) {
        // Sixteen partial sums: vectorisable, and close to torch's blocked sum.
        let mut acc = [0f32; 16];
        let mut it = xr.chunks_exact(16);
        for c in &mut it {
            for (a, &v) in acc.iter_mut().zip(c) {
                let v = v.to_f32();
                *a += v * v;
            }
        }
        let mut s: f32 = it
            .remainder()
            .iter()
            .map(|&v| v.to_f32() * v.to_f32())
            .sum();
        s += acc.iter().sum::<f32>();
        let r = 1.0 / (s / dim as f32 + eps).sqrt();
        for ((d, &v), &wv) in o.iter_mut().zip(xr).zip(w) {
            *d = T::from_f32(wv.to_f32() * T::round(v.to_f32() * r));
        }
    }
}

/// One loop per activation (the match stays outside the loops, so each
/// vectorises); each rounds where the model's torch code does.
#[inline(always)]
fn act_body<T: Element>(out: &mut [T], x: &[T], d: usize, act: GatedAct) {
    match act {
        // round(silu(g)) * u, as `F.silu(gate) * up`.
        GatedAct::Silu => gated_rows(out, x, d, |g, u| T::round(silu(g)) * u),
        // round(gelu(g)) * u, as `F.gelu(gate, approximate="tanh") * up`.
        GatedAct::GeluTanh => gated_rows(out, x, d, |g, u| T::round(gelu_tanh(g)) * u),
        // round(gelu(g)) * u, as `F.gelu(gate) * up`.
        GatedAct::Gelu => gated_rows(out, x, d, |g, u| T::round(gelu_erf(g)) * u),
        // gpt-oss: g = gate.clamp(max=limit); u = up.clamp(-limit, limit);
        // (u + 1) * (g * sigmoid(g * alpha)), every op rounded.
        GatedAct::SwigluOai { alpha, limit } => gated_rows(out, x, d, |g, u| {
            // Comparisons, not min/max: a NaN stays a NaN, as in torch.clamp.
            let g = if g > limit { limit } else { g };
            let u = if u > limit {
                limit
            } else if u < -limit {
                -limit
            } else {
                u
            };
            let s = T::round(sigmoid(T::round(g * alpha)));
            T::round(u + 1.0) * T::round(g * s)
        }),
    }
}

#[inline(always)]
fn gated_rows<T: Element>(out: &mut [T], x: &[T], d: usize, f: impl Fn(f32, f32) -> f32) {
    for (o, xr) in out.chunks_exact_mut(d).zip(x.chunks_exact(2 * d)) {
        let (g, u) = xr.split_at(d);
        for ((dst, &gv), &uv) in o.iter_mut().zip(g).zip(u) {
            *dst = T::from_f32(f(gv.to_f32(), uv.to_f32()));
        }
    }
}

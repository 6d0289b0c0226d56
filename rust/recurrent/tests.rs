//! Both kernels against straightforward f64 references, on every path this
//! CPU has: packed batches of sequences of 0 to 200 rows, grouped heads,
//! Dk != Dv and sizes that are no multiple of a vector, both forms of the
//! delta rule (and of the linear rule, Mamba-2's), and state carried across
//! calls.

use half::bf16;

use super::mat::{exp_f32, gemm, MatMut, MatRef};
use super::*;
use crate::cpu::elem::tests::Rng;
use crate::cpu::simd::{Kernel, Simd};

fn paths() -> Vec<Path> {
    let mut p: Vec<Path> = crate::cpu::available_paths()
        .iter()
        .map(|p| p.simd())
        .collect();
    p.dedup();
    p
}

fn uniform(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.f32() * scale).collect()
}

fn round_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// `query_start_loc` for sequences of `lens` rows, and slots that are not in
/// order (sequence `i` at slot `slots - 1 - 2 i`).
fn batch(lens: &[usize], slots: usize) -> (Vec<i32>, Vec<i64>) {
    let mut qsl = vec![0i32];
    for &l in lens {
        qsl.push(qsl.last().unwrap() + l as i32);
    }
    let ids = (0..lens.len())
        .map(|i| (slots - 1 - 2 * i) as i64)
        .collect();
    (qsl, ids)
}

/// The convolution in f64: returns the output and the new state.
#[allow(clippy::too_many_arguments)]
fn conv_reference(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    state: &[f32],
    qsl: &[i32],
    ids: &[i64],
    (c, k): (usize, usize),
    silu: bool,
) -> (Vec<f64>, Vec<f32>) {
    let keep = k - 1;
    let mut out = vec![0f64; x.len()];
    let mut st = state.to_vec();
    for (i, &slot) in ids.iter().enumerate() {
        let (r0, r1) = (qsl[i] as usize, qsl[i + 1] as usize);
        let s = &mut st[slot as usize * c * keep..][..c * keep];
        for ch in 0..c {
            let mut xin: Vec<f32> = s[ch * keep..][..keep].to_vec();
            xin.extend((r0..r1).map(|t| x[t * c + ch]));
            for t in 0..r1 - r0 {
                let mut y = bias.map_or(0.0, |b| b[ch] as f64);
                for j in 0..k {
                    y += w[ch * k + j] as f64 * xin[t + j] as f64;
                }
                out[(r0 + t) * c + ch] = if silu { y / (1.0 + (-y).exp()) } else { y };
            }
            s[ch * keep..][..keep].copy_from_slice(&xin[xin.len() - keep..]);
        }
    }
    (out, st)
}

/// Runs the convolution in `dtype` ("f32" or "bf16") on inputs already
/// rounded to it; returns the output and new state widened.
#[allow(clippy::too_many_arguments)]
fn conv_run(
    path: Path,
    bf: bool,
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    state: &mut [f32],
    qsl: &[i32],
    ids: &[i64],
    shape: ConvShape,
    silu: bool,
) -> Vec<f32> {
    let packed = Packed {
        query_start_loc: qsl,
        state_slots: ids,
    };
    if !bf {
        let mut out = vec![0f32; x.len()];
        let b = bias.map(Src::F32);
        causal_conv1d_on(
            path,
            Dst::F32(&mut out),
            Src::F32(x),
            Src::F32(w),
            b,
            Dst::F32(state),
            packed,
            shape,
            silu,
        )
        .unwrap();
        return out;
    }
    let (xb, wb) = (round_bf16(x), round_bf16(w));
    let bb = bias.map(round_bf16);
    let mut sb = round_bf16(state);
    let mut out = vec![bf16::ZERO; x.len()];
    causal_conv1d_on(
        path,
        Dst::Bf16(&mut out),
        Src::Bf16(&xb),
        Src::Bf16(&wb),
        bb.as_deref().map(Src::Bf16),
        Dst::Bf16(&mut sb),
        packed,
        shape,
        silu,
    )
    .unwrap();
    for (s, v) in state.iter_mut().zip(&sb) {
        *s = v.to_f32();
    }
    out.iter().map(|v| v.to_f32()).collect()
}

#[test]
fn conv_matches_reference_on_every_path() {
    let mut rng = Rng(11);
    let lens = [65, 0, 1, 200, 3, 64, 63];
    let tokens: usize = lens.iter().sum();
    for path in paths() {
        for (c, k) in [(300, 4), (17, 2), (8, 8), (256, 3)] {
            for (bf, silu, with_bias) in [
                (false, true, true),
                (false, false, false),
                (true, true, false),
            ] {
                let slots = 2 * lens.len() + 1;
                let (qsl, ids) = batch(&lens, slots);
                let shape = ConvShape {
                    tokens,
                    channels: c,
                    width: k,
                    slots,
                };
                let round = |v: Vec<f32>| -> Vec<f32> {
                    if bf {
                        round_bf16(&v).iter().map(|x| x.to_f32()).collect()
                    } else {
                        v
                    }
                };
                let x = round(uniform(&mut rng, tokens * c, 2.0));
                let w = round(uniform(&mut rng, c * k, 1.0));
                let bias = round(uniform(&mut rng, c, 1.0));
                let state0 = round(uniform(&mut rng, slots * c * (k - 1), 2.0));
                let b = with_bias.then_some(&bias[..]);
                let (want, want_state) =
                    conv_reference(&x, &w, b, &state0, &qsl, &ids, (c, k), silu);
                let mut state = state0.clone();
                let got = conv_run(path, bf, &x, &w, b, &mut state, &qsl, &ids, shape, silu);
                for (i, (g, r)) in got.iter().zip(&want).enumerate() {
                    // f32: sums of a few terms; bf16: one rounding of 2^-8.
                    let tol = if bf {
                        2f64.powi(-8) * r.abs() + 1e-6
                    } else {
                        1e-5 * (1.0 + r.abs())
                    };
                    assert!(
                        (*g as f64 - r).abs() <= tol,
                        "{path:?} c={c} k={k} bf16={bf} element {i}: {g} vs {r}"
                    );
                }
                assert_eq!(state, want_state, "{path:?} c={c} k={k} state");
            }
        }
    }
}

#[test]
fn conv_state_carries_across_calls() {
    let mut rng = Rng(5);
    let (c, k, rows) = (70, 4, 41);
    let x = uniform(&mut rng, rows * c, 1.0);
    let w = uniform(&mut rng, c * k, 1.0);
    let state0 = uniform(&mut rng, 2 * c * (k - 1), 1.0);
    let shape = |tokens| ConvShape {
        tokens,
        channels: c,
        width: k,
        slots: 2,
    };
    let mut whole_state = state0.clone();
    let whole = conv_run(
        best_path(),
        false,
        &x,
        &w,
        None,
        &mut whole_state,
        &[0, rows as i32],
        &[1],
        shape(rows),
        true,
    );
    // 17 rows, then single rows (fewer than K - 1 per call), then the rest.
    let mut cuts = vec![0, 17, 18, 19];
    cuts.push(rows);
    let mut state = state0.clone();
    let mut got = Vec::new();
    for w2 in cuts.windows(2) {
        let part = &x[w2[0] * c..w2[1] * c];
        let n = (w2[1] - w2[0]) as i32;
        let o = conv_run(
            best_path(),
            false,
            part,
            &w,
            None,
            &mut state,
            &[0, n],
            &[1],
            shape(n as usize),
            true,
        );
        got.extend(o);
    }
    assert_eq!(got, whole);
    assert_eq!(state, whole_state);
    assert_eq!(
        state[..c * (k - 1)],
        state0[..c * (k - 1)],
        "slot 0 untouched"
    );
}

/// Inputs of a delta-rule test, in f32 (already rounded when bf16).
struct DeltaCase {
    lens: Vec<usize>,
    shape: DeltaShape,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    state: Vec<f32>,
    scale: f32,
    l2norm: bool,
}

impl DeltaCase {
    #[allow(clippy::too_many_arguments)]
    fn new(
        rng: &mut Rng,
        lens: &[usize],
        heads: (usize, usize),
        dims: (usize, usize),
        l2norm: bool,
        bf: bool,
    ) -> Self {
        let tokens: usize = lens.iter().sum();
        let ((hk, hv), (dk, dv)) = (heads, dims);
        let slots = 2 * lens.len() + 1;
        let round = |v: Vec<f32>| -> Vec<f32> {
            if bf {
                round_bf16(&v).iter().map(|x| x.to_f32()).collect()
            } else {
                v
            }
        };
        // Without the normalisation, keys of norm <= 1 keep the rule stable.
        let kscale = if l2norm {
            1.0
        } else {
            1.0 / (dk as f32).sqrt()
        };
        let q = round(uniform(rng, tokens * hk * dk, 1.0));
        let k = round(uniform(rng, tokens * hk * dk, kscale));
        let v = round(uniform(rng, tokens * hv * dv, 1.0));
        // Mostly mild decays, some strong ones (down to e^-8 per row).
        let g = (0..tokens * hv)
            .map(|i| {
                if i % 7 == 3 {
                    -8.0 * rng.f32().abs()
                } else {
                    -0.3 * rng.f32().abs()
                }
            })
            .collect();
        let beta = (0..tokens * hv).map(|_| 0.5 + 0.49 * rng.f32()).collect();
        let state = uniform(rng, slots * hv * dk * dv, 0.5);
        let shape = DeltaShape {
            tokens,
            k_heads: hk,
            v_heads: hv,
            k_dim: dk,
            v_dim: dv,
            slots,
        };
        let scale = 1.0 / (dk as f32).sqrt();
        DeltaCase {
            lens: lens.to_vec(),
            shape,
            q,
            k,
            v,
            g,
            beta,
            state,
            scale,
            l2norm,
        }
    }

    /// The rule in f64, row by row: output and new state.
    fn reference(&self, rule: Rule) -> (Vec<f64>, Vec<f64>) {
        let DeltaShape {
            k_heads: hk,
            v_heads: hv,
            k_dim: dk,
            v_dim: dv,
            ..
        } = self.shape;
        let (qsl, ids) = batch(&self.lens, self.shape.slots);
        let mut out = vec![0f64; self.v.len()];
        let mut state: Vec<f64> = self.state.iter().map(|&x| x as f64).collect();
        let vec_of = |src: &[f32], t: usize, h: usize, scale: f64| -> Vec<f64> {
            let x: Vec<f64> = src[(t * hk + h) * dk..][..dk]
                .iter()
                .map(|&x| x as f64)
                .collect();
            let norm = if self.l2norm {
                1.0 / (x.iter().map(|v| v * v).sum::<f64>() + 1e-6).sqrt()
            } else {
                1.0
            };
            x.iter().map(|v| v * norm * scale).collect()
        };
        for (i, &slot) in ids.iter().enumerate() {
            for h in 0..hv {
                let s = &mut state[(slot as usize * hv + h) * dk * dv..][..dk * dv];
                for t in qsl[i] as usize..qsl[i + 1] as usize {
                    let kh = h / (hv / hk);
                    let q = vec_of(&self.q, t, kh, self.scale as f64);
                    let k = vec_of(&self.k, t, kh, 1.0);
                    let decay = (self.g[t * hv + h] as f64).exp();
                    let beta = self.beta[t * hv + h] as f64;
                    s.iter_mut().for_each(|x| *x *= decay);
                    for j in 0..dv {
                        let kv: f64 = match rule {
                            Rule::Delta => (0..dk).map(|a| s[a * dv + j] * k[a]).sum(),
                            Rule::Linear => 0.0,
                        };
                        let delta = (self.v[(t * hv + h) * dv + j] as f64 - kv) * beta;
                        for a in 0..dk {
                            s[a * dv + j] += k[a] * delta;
                        }
                        out[(t * hv + h) * dv + j] = (0..dk).map(|a| s[a * dv + j] * q[a]).sum();
                    }
                }
            }
        }
        (out, state)
    }

    /// Runs the kernel on rows `rows` of the case (one sequence, the first,
    /// at its slot) or on the whole batch (`None`), updating `state`.
    fn run(&self, bf: bool, state: &mut [f32], opts: DeltaOptions) -> Vec<f32> {
        let (qsl, ids) = batch(&self.lens, self.shape.slots);
        let packed = Packed {
            query_start_loc: &qsl,
            state_slots: &ids,
        };
        self.run_packed(bf, state, packed, self.shape, opts, 0..self.shape.tokens)
    }

    fn run_packed(
        &self,
        bf: bool,
        state: &mut [f32],
        packed: Packed<'_>,
        shape: DeltaShape,
        opts: DeltaOptions,
        rows: Range<usize>,
    ) -> Vec<f32> {
        let s = &self.shape;
        let (qk, vw, gw) = (s.k_heads * s.k_dim, s.v_heads * s.v_dim, s.v_heads);
        let q = &self.q[rows.start * qk..rows.end * qk];
        let k = &self.k[rows.start * qk..rows.end * qk];
        let v = &self.v[rows.start * vw..rows.end * vw];
        let g = &self.g[rows.start * gw..rows.end * gw];
        let beta = &self.beta[rows.start * gw..rows.end * gw];
        let (scale, l2) = (self.scale, self.l2norm);
        if !bf {
            let mut out = vec![0f32; v.len()];
            let inputs = DeltaInputs {
                q: Src::F32(q),
                k: Src::F32(k),
                v: Src::F32(v),
                g,
                beta,
            };
            gated_delta_rule_with(
                Dst::F32(&mut out),
                inputs,
                state,
                packed,
                shape,
                scale,
                l2,
                opts,
            )
            .unwrap();
            return out;
        }
        let (qb, kb, vb) = (round_bf16(q), round_bf16(k), round_bf16(v));
        let mut out = vec![bf16::ZERO; v.len()];
        let inputs = DeltaInputs {
            q: Src::Bf16(&qb),
            k: Src::Bf16(&kb),
            v: Src::Bf16(&vb),
            g,
            beta,
        };
        gated_delta_rule_with(
            Dst::Bf16(&mut out),
            inputs,
            state,
            packed,
            shape,
            scale,
            l2,
            opts,
        )
        .unwrap();
        out.iter().map(|x| x.to_f32()).collect()
    }
}

/// `got` within `rel` of the largest reference value (plus a rounding of
/// `out_rel` of each value).
fn assert_close(what: &str, got: &[f32], want: &[f64], rel: f64, out_rel: f64) {
    let top = want.iter().fold(1f64, |a, b| a.max(b.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (*g as f64 - w).abs();
        assert!(
            err <= rel * top + out_rel * w.abs(),
            "{what}: element {i}: {g} vs {w} (scale {top})"
        );
    }
}

#[test]
fn delta_rule_matches_reference_on_every_path_and_form() {
    let mut rng = Rng(3);
    let lens = [64, 0, 1, 65, 3, 200, 63];
    for path in paths() {
        for (heads, dims, l2norm, bf) in [
            ((2, 4), (24, 40), true, false),
            ((1, 2), (16, 8), false, false),
            ((1, 1), (64, 33), true, true),
        ] {
            let case = DeltaCase::new(&mut rng, &lens, heads, dims, l2norm, bf);
            for rule in [Rule::Delta, Rule::Linear] {
                let (want, want_state) = case.reference(rule);
                for form in [Form::Recurrent, Form::Chunked, Form::Auto] {
                    for column_blocks in [1, 3] {
                        let opts = DeltaOptions {
                            path,
                            form,
                            rule,
                            column_blocks,
                        };
                        let mut state = case.state.clone();
                        let got = case.run(bf, &mut state, opts);
                        let what = format!("{path:?} {rule:?} {form:?} blocks {column_blocks} {heads:?} {dims:?} l2 {l2norm} bf16 {bf}");
                        let out_rel = if bf { 2f64.powi(-8) } else { 0.0 };
                        assert_close(&format!("{what} out"), &got, &want, 2e-5, out_rel);
                        assert_close(&format!("{what} state"), &state, &want_state, 2e-5, 0.0);
                    }
                }
            }
        }
    }
}

#[test]
fn delta_rule_state_carries_across_calls() {
    let mut rng = Rng(9);
    let case = DeltaCase::new(&mut rng, &[200], (2, 4), (32, 48), true, false);
    for (rule, form) in [
        (Rule::Delta, Form::Auto),
        (Rule::Delta, Form::Recurrent),
        (Rule::Delta, Form::Chunked),
        (Rule::Linear, Form::Auto),
        (Rule::Linear, Form::Chunked),
    ] {
        let (want, want_state) = case.reference(rule);
        let opts = DeltaOptions {
            form,
            rule,
            ..DeltaOptions::default()
        };
        let mut state = case.state.clone();
        let mut got = Vec::new();
        // An odd split, then one row at a time, then the rest.
        for (a, b) in [(0, 77), (77, 78), (78, 79), (79, 200)] {
            let qsl = [0, (b - a) as i32];
            let packed = Packed {
                query_start_loc: &qsl,
                state_slots: &[case.shape.slots as i64 - 1],
            };
            let shape = DeltaShape {
                tokens: b - a,
                ..case.shape
            };
            got.extend(case.run_packed(false, &mut state, packed, shape, opts, a..b));
        }
        assert_close(&format!("{rule:?} {form:?} out"), &got, &want, 2e-5, 0.0);
        assert_close(
            &format!("{rule:?} {form:?} state"),
            &state,
            &want_state,
            2e-5,
            0.0,
        );
    }
}

#[test]
fn rejects_bad_batches() {
    let shape = ConvShape {
        tokens: 4,
        channels: 3,
        width: 3,
        slots: 2,
    };
    let (x, w) = (vec![0f32; 12], vec![0f32; 9]);
    let run = |qsl: &[i32], ids: &[i64]| {
        let (mut out, mut st) = (vec![0f32; 12], vec![0f32; 12]);
        let packed = Packed {
            query_start_loc: qsl,
            state_slots: ids,
        };
        let r = causal_conv1d(
            Dst::F32(&mut out),
            Src::F32(&x),
            Src::F32(&w),
            None,
            Dst::F32(&mut st),
            packed,
            shape,
            false,
        );
        r.err().map(|e| e.to_string()).unwrap_or_default()
    };
    assert_eq!(run(&[0, 2, 4], &[0, 1]), "");
    assert!(run(&[0, 2, 4], &[0, 2]).starts_with("state_slots: slot 2"));
    assert!(run(&[0, 2, 4], &[-1, 1]).starts_with("state_slots"));
    assert!(run(&[0, 2, 4], &[1, 1]).contains("two sequences"));
    assert_eq!(
        run(&[0, 0, 4], &[1, 1]),
        "",
        "an empty sequence may share a slot"
    );
    assert!(run(&[0, 3, 2, 4], &[0, 1, 0]).starts_with("query_start_loc: must not decrease"));
    assert!(run(&[0, 2, 3], &[0, 1]).starts_with("query_start_loc"));
    assert!(run(&[0, 4], &[0, 1]).starts_with("query_start_loc"));
}

struct SolveCheck<'a> {
    lower: &'a [f32],
    x: &'a mut [f32],
    m: usize,
    n: usize,
}

impl Kernel for SolveCheck<'_> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self) {
        let mut x = MatMut::new(self.x, self.m, self.n, self.n);
        for r in 1..self.m {
            let l = MatRef::rows(&self.lower[r * self.m..], 1, r, self.m);
            let (above, row) = x.above_and_row(r);
            gemm::<S>(l, above, row, 1.0);
        }
    }
}

#[test]
fn gemm_and_solve_match_f64() {
    let mut rng = Rng(13);
    for path in paths() {
        for (m, n, k) in [
            (1, 1, 1),
            (2, 37, 5),
            (9, 64, 17),
            (4, 80, 64),
            (7, 16, 0),
            (5, 3, 2),
        ] {
            for transposed in [false, true] {
                let a = uniform(&mut rng, m * k + 1, 1.0);
                let b = uniform(&mut rng, k * (n + 3), 1.0);
                let c0 = uniform(&mut rng, m * (n + 1), 1.0);
                let (rs, cs) = if transposed { (1, m) } else { (k, 1) };
                for c_scale in [0.0f32, 1.0, -0.5] {
                    let mut c = c0.clone();
                    dispatch(
                        path,
                        GemmCheck {
                            a: MatRef::new(&a, m, k, rs, cs),
                            b: MatRef::rows(&b, k, n, n + 3),
                            c: MatMut::new(&mut c, m, n, n + 1),
                            c_scale,
                        },
                    );
                    for r in 0..m {
                        for j in 0..n {
                            let mut want = c_scale as f64 * c0[r * (n + 1) + j] as f64;
                            for i in 0..k {
                                want += a[r * rs + i * cs] as f64 * b[i * (n + 3) + j] as f64;
                            }
                            let got = c[r * (n + 1) + j] as f64;
                            assert!((got - want).abs() < 1e-5, "{path:?} {m}x{n}x{k} ({r},{j})");
                        }
                    }
                }
            }
        }
        // (I - M) x = b with M strictly lower, by forward substitution.
        let (m, n) = (13, 21);
        let lower = uniform(&mut rng, m * m, 0.3);
        let b = uniform(&mut rng, m * n, 1.0);
        let mut x = b.clone();
        dispatch(
            path,
            SolveCheck {
                lower: &lower,
                x: &mut x,
                m,
                n,
            },
        );
        for r in 0..m {
            for j in 0..n {
                let lhs = x[r * n + j] as f64
                    - (0..r)
                        .map(|s| lower[r * m + s] as f64 * x[s * n + j] as f64)
                        .sum::<f64>();
                assert!(
                    (lhs - b[r * n + j] as f64).abs() < 1e-5,
                    "{path:?} solve ({r},{j})"
                );
            }
        }
    }
}

struct GemmCheck<'a> {
    a: MatRef<'a>,
    b: MatRef<'a>,
    c: MatMut<'a>,
    c_scale: f32,
}

impl Kernel for GemmCheck<'_> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self) {
        gemm::<S>(self.a, self.b, self.c, self.c_scale)
    }
}

#[test]
fn exp_is_accurate_and_saturates() {
    for i in -8730..=8830 {
        let x = i as f32 * 0.01;
        let want = (x as f64).exp();
        let got = exp_f32(x) as f64;
        assert!(
            ((got - want) / want).abs() < 3e-7,
            "exp({x}) = {got}, want {want}"
        );
    }
    assert!(exp_f32(-1000.0) < 1e-37 && exp_f32(f32::NEG_INFINITY) < 1e-37);
    assert_eq!(exp_f32(0.0), 1.0);
}

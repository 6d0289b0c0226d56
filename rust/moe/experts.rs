//! The grouped expert FFN: every expert a gate/up projection [2I, H] (gate
//! rows first, then up), a gated activation and a down projection [H, I].

use std::any::Any;
use std::sync::Mutex;

use half::bf16;

use crate::cpu::elem::expect_matrix;
use crate::cpu::threads::{team_helpers, team_run};
use crate::cpu::Element;
use crate::error::{CoreError, CoreResult};
use crate::layers::gated_act;
use crate::linear::LinearWeight;

/// The activation between an expert's projections (the layers' gated
/// activations: `Silu`, `GeluTanh`, `SwigluOai { alpha, limit }`).
pub use crate::layers::GatedAct as ExpertAct;

/// Most rows an expert may have for the experts to run one per team task
/// (above it, each expert's GEMMs split over the team instead).
const EXPERT_TASK_ROWS: usize = 8;

/// Scratch bytes kept between calls: enough for decode steps and small
/// batches; a long prefill's buffers are freed after its call.
const KEEP_SCRATCH_BYTES: usize = 8 << 20;

/// The experts of one MoE layer.
#[derive(Debug)]
pub struct Experts {
    /// Per expert: `[2 * intermediate, hidden]`, gate rows then up rows.
    pub gate_up: Vec<LinearWeight>,
    /// Per expert: `[hidden, intermediate]`.
    pub down: Vec<LinearWeight>,
    pub act: ExpertAct,
    intermediate: usize,
    hidden: usize,
    scratch: Mutex<Scratch>,
}

/// The per-element-type buffers of one expert's rows.
#[derive(Debug)]
struct Bufs<T> {
    x: Vec<T>,
    gate_up: Vec<T>,
    act: Vec<T>,
    y: Vec<T>,
}

impl<T> Default for Bufs<T> {
    fn default() -> Self {
        Bufs {
            x: Vec::new(),
            gate_up: Vec::new(),
            act: Vec::new(),
            y: Vec::new(),
        }
    }
}

impl<T> Bufs<T> {
    fn bytes(&self) -> usize {
        let n = self.x.capacity() + self.gate_up.capacity() + self.act.capacity();
        (n + self.y.capacity()) * std::mem::size_of::<T>()
    }
}

/// Buffers reused from call to call, so that a decode step allocates
/// nothing once warm.
#[derive(Debug, Default)]
struct Scratch {
    /// `offsets[e]..offsets[e + 1]`: expert `e`'s entries of `rows`.
    offsets: Vec<usize>,
    /// (token, routing weight), grouped by expert, tokens ascending.
    rows: Vec<(usize, f32)>,
    /// `[tokens, hidden]` sums.
    acc: Vec<f32>,
    f32: Bufs<f32>,
    bf16: Bufs<bf16>,
}

impl Scratch {
    fn bytes(&self) -> usize {
        self.offsets.capacity() * std::mem::size_of::<usize>()
            + self.rows.capacity() * std::mem::size_of::<(usize, f32)>()
            + self.acc.capacity() * 4
            + self.f32.bytes()
            + self.bf16.bytes()
    }
}

/// The buffers of element type `T` (None for a type other than f32 / bf16).
fn bufs_of<'a, T: Element>(f: &'a mut Bufs<f32>, b: &'a mut Bufs<bf16>) -> Option<&'a mut Bufs<T>> {
    if let Some(bufs) = (f as &mut dyn Any).downcast_mut::<Bufs<T>>() {
        return Some(bufs);
    }
    (b as &mut dyn Any).downcast_mut::<Bufs<T>>()
}

/// `v[..n]`, grown (never shrunk) to hold `n` elements.
fn grown<T: Element>(v: &mut Vec<T>, n: usize) -> &mut [T] {
    if v.len() < n {
        v.resize(n, T::from_f32(0.0));
    }
    &mut v[..n]
}

impl Experts {
    /// Experts from their weights: as many `down` as `gate_up`, at least
    /// one; every gate/up weight `[2I, H]`, every down weight `[H, I]`, with
    /// `H` and `I` from expert 0.
    pub fn new(
        gate_up: Vec<LinearWeight>,
        down: Vec<LinearWeight>,
        act: ExpertAct,
    ) -> CoreResult<Experts> {
        let Some(first) = gate_up.first() else {
            return Err(CoreError::invalid("gate_up: expected at least one expert"));
        };
        let (two_i, hidden) = (first.out_features(), first.in_features());
        if two_i == 0 || !two_i.is_multiple_of(2) || hidden == 0 {
            return Err(CoreError::invalid(format!(
                "gate_up[0]: expected a [2 * intermediate, hidden] weight with both \
                 positive, got [{two_i}, {hidden}]"
            )));
        }
        let experts = Experts {
            gate_up,
            down,
            act,
            intermediate: two_i / 2,
            hidden,
            scratch: Mutex::new(Scratch::default()),
        };
        experts.check_count()?;
        for e in 0..experts.num_experts() {
            experts.check_expert(e)?;
        }
        Ok(experts)
    }

    /// Number of experts.
    pub fn num_experts(&self) -> usize {
        self.gate_up.len()
    }

    /// `H`: the features of a token.
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// `I`: the features between an expert's projections.
    pub fn intermediate(&self) -> usize {
        self.intermediate
    }

    /// Bytes of every expert's packed weights (and scales).
    pub fn nbytes(&self) -> usize {
        let all = self.gate_up.iter().chain(&self.down);
        all.map(|w| w.nbytes()).sum()
    }

    fn check_count(&self) -> CoreResult<()> {
        if self.down.len() != self.gate_up.len() {
            return Err(CoreError::invalid(format!(
                "down: expected {} weights (one per expert, as gate_up), got {}",
                self.gate_up.len(),
                self.down.len()
            )));
        }
        Ok(())
    }

    /// Checks expert `e`'s shapes (no allocation unless it fails).
    fn check_expert(&self, e: usize) -> CoreResult<()> {
        let (h, i) = (self.hidden, self.intermediate);
        let weights = [
            ("gate_up", &self.gate_up[e], 2 * i, h),
            ("down", &self.down[e], h, i),
        ];
        for (name, w, n, k) in weights {
            if w.out_features() != n || w.in_features() != k {
                return Err(CoreError::invalid(format!(
                    "{name}[{e}]: expected a [{n}, {k}] weight, got [{}, {}]",
                    w.out_features(),
                    w.in_features()
                )));
            }
        }
        Ok(())
    }

    /// `out [tokens, H] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`:
    /// `ids` / `weights` `[tokens, top_k]` (row-major), every id in
    /// `0..num_experts`. Sums in f32, rounded to `T` once at the end.
    pub fn forward<T: Element>(
        &self,
        out: &mut [T],
        x: &[T],
        ids: &[i32],
        weights: &[f32],
        tokens: usize,
        top_k: usize,
    ) -> CoreResult<()> {
        let h = self.hidden;
        expect_matrix("x", x.len(), tokens, h)?;
        expect_matrix("out", out.len(), tokens, h)?;
        expect_matrix("ids", ids.len(), tokens, top_k)?;
        expect_matrix("weights", weights.len(), tokens, top_k)?;
        self.check_count()?;
        let experts = self.num_experts();
        if let Some(j) = ids.iter().position(|&id| id < 0 || id as usize >= experts) {
            return Err(CoreError::invalid(format!(
                "ids: token {} routes to expert {}, expected 0..{experts}",
                j / top_k,
                ids[j]
            )));
        }
        let mut guard = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let s = &mut *guard;
        group(&mut s.offsets, &mut s.rows, ids, weights, top_k, experts);
        s.acc.clear();
        s.acc.resize(tokens * h, 0.0);
        let mut own = None;
        let bufs = match bufs_of::<T>(&mut s.f32, &mut s.bf16) {
            Some(b) => b,
            None => own.insert(Bufs::default()),
        };
        let active = (0..experts).filter(|&e| s.offsets[e + 1] > s.offsets[e]);
        let (mut count, mut most) = (0, 0);
        for e in active {
            self.check_expert(e)?;
            count += 1;
            most = most.max(s.offsets[e + 1] - s.offsets[e]);
        }
        if count > 1 && most <= EXPERT_TASK_ROWS && team_helpers() > 0 {
            self.experts_in_parallel(&s.offsets, &s.rows, x, bufs, &mut s.acc)?;
        } else {
            for e in 0..experts {
                let rows = &s.rows[s.offsets[e]..s.offsets[e + 1]];
                if !rows.is_empty() {
                    self.run_expert(e, rows, x, bufs, &mut s.acc)?;
                }
            }
        }
        for (o, &a) in out.iter_mut().zip(&s.acc) {
            *o = T::from_f32(a);
        }
        if s.bytes() > KEEP_SCRATCH_BYTES {
            *s = Scratch::default();
        }
        Ok(())
    }

    /// Few rows per expert (decode, small batches): one team task per active
    /// expert, each running its expert's two GEMMs on its own thread, so
    /// every thread streams whole experts and the team meets once per layer
    /// instead of twice per expert. Rows are laid out grouped by expert
    /// (`offsets`, `rows`); the weighted sums are added afterwards, in the
    /// same order as the one-expert-at-a-time path.
    fn experts_in_parallel<T: Element>(
        &self,
        offsets: &[usize],
        rows: &[(usize, f32)],
        x: &[T],
        b: &mut Bufs<T>,
        acc: &mut [f32],
    ) -> CoreResult<()> {
        let (r, h, i) = (rows.len(), self.hidden, self.intermediate);
        let xs = grown(&mut b.x, r * h);
        for (dst, &(t, _)) in xs.chunks_exact_mut(h).zip(rows) {
            dst.copy_from_slice(&x[t * h..(t + 1) * h]);
        }
        let (xs, gu, act) = (&b.x[..r * h], grown(&mut b.gate_up, r * 2 * i), &mut b.act);
        let act = grown(act, r * i);
        let y = grown(&mut b.y, r * h);
        // One task per active expert, each owning its rows of the buffers.
        let mut tasks = Vec::new();
        let (mut gu, mut act, mut y) = (gu, act, y);
        for e in 0..self.num_experts() {
            let n = offsets[e + 1] - offsets[e];
            if n == 0 {
                continue;
            }
            let (g, gr) = std::mem::take(&mut gu).split_at_mut(n * 2 * i);
            let (a, ar) = std::mem::take(&mut act).split_at_mut(n * i);
            let (o, yr) = std::mem::take(&mut y).split_at_mut(n * h);
            (gu, act, y) = (gr, ar, yr);
            let xe = &xs[offsets[e] * h..offsets[e + 1] * h];
            tasks.push(Mutex::new((e, n, xe, g, a, o)));
        }
        let first_error = Mutex::new(None);
        team_run(tasks.len(), &|task| {
            let mut guard = tasks[task].lock().unwrap_or_else(|p| p.into_inner());
            let (e, n, xe, g, a, o) = &mut *guard;
            let mut run = || -> CoreResult<()> {
                self.gate_up[*e].forward(T::dst(g), T::src(xe), *n)?;
                gated_act(T::dst(a), T::src(g), i, self.act)?;
                self.down[*e].forward(T::dst(o), T::src(a), *n)
            };
            if let Err(err) = run() {
                first_error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert(err);
            }
        })?;
        if let Some(err) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(err);
        }
        add_weighted(acc, &b.y[..r * h], rows, h);
        Ok(())
    }

    /// Expert `e` on its `rows` (token, weight) of `x`, added into `acc`.
    fn run_expert<T: Element>(
        &self,
        e: usize,
        rows: &[(usize, f32)],
        x: &[T],
        b: &mut Bufs<T>,
        acc: &mut [f32],
    ) -> CoreResult<()> {
        let (n, h, i) = (rows.len(), self.hidden, self.intermediate);
        let t0 = rows[0].0;
        // Consecutive tokens (an expert that got every token, or a single
        // one) are read where they lie; others are gathered.
        let xs: &[T] = if rows.iter().enumerate().all(|(r, &(t, _))| t == t0 + r) {
            &x[t0 * h..(t0 + n) * h]
        } else {
            let xs = grown(&mut b.x, n * h);
            for (dst, &(t, _)) in xs.chunks_exact_mut(h).zip(rows) {
                dst.copy_from_slice(&x[t * h..(t + 1) * h]);
            }
            xs
        };
        let gu = grown(&mut b.gate_up, n * 2 * i);
        self.gate_up[e].forward(T::dst(gu), T::src(xs), n)?;
        let act = grown(&mut b.act, n * i);
        gated_act(T::dst(act), T::src(&b.gate_up[..n * 2 * i]), i, self.act)?;
        let y = grown(&mut b.y, n * h);
        self.down[e].forward(T::dst(y), T::src(&b.act[..n * i]), n)?;
        add_weighted(acc, &b.y[..n * h], rows, h);
        Ok(())
    }
}

/// `acc[t] += w * y[r]` for each expert output row `y[r]` and its entry
/// `rows[r] = (t, w)`, in row order.
fn add_weighted<T: Element>(acc: &mut [f32], y: &[T], rows: &[(usize, f32)], h: usize) {
    for (yr, &(t, w)) in y.chunks_exact(h).zip(rows) {
        for (a, &v) in acc[t * h..(t + 1) * h].iter_mut().zip(yr) {
            *a += w * v.to_f32();
        }
    }
}

/// Counting sort of the routing entries by expert: `rows` holds (token,
/// weight) of expert 0's entries, then expert 1's, ..., each in token order;
/// `offsets[e]..offsets[e + 1]` is expert `e`'s part. Ids are checked.
fn group(
    offsets: &mut Vec<usize>,
    rows: &mut Vec<(usize, f32)>,
    ids: &[i32],
    weights: &[f32],
    top_k: usize,
    experts: usize,
) {
    offsets.clear();
    offsets.resize(experts + 1, 0);
    for &id in ids {
        offsets[id as usize + 1] += 1;
    }
    for e in 0..experts {
        offsets[e + 1] += offsets[e];
    }
    rows.clear();
    rows.resize(ids.len(), (0, 0.0));
    // offsets[e] is expert e's next free entry; afterwards, its end.
    for (j, (&id, &w)) in ids.iter().zip(weights).enumerate() {
        let at = &mut offsets[id as usize];
        rows[*at] = (j / top_k, w);
        *at += 1;
    }
    // Ends back to starts: offsets[e + 1] = end of e, offsets[0] = 0.
    offsets.copy_within(0..experts, 1);
    offsets[0] = 0;
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::cpu::elem::tests::Rng;
    use crate::cpu::{Path, Src};
    use crate::gemm::PackedWeight;

    /// Every expert's float weights and biases, row-major.
    struct Weights {
        gate_up: Vec<(Vec<f32>, Vec<f32>)>,
        down: Vec<(Vec<f32>, Vec<f32>)>,
        hidden: usize,
        inter: usize,
    }

    fn matrix(rng: &mut Rng, n: usize, k: usize) -> (Vec<f32>, Vec<f32>) {
        let scale = 1.0 / (k as f32).sqrt();
        let w = (0..n * k).map(|_| rng.f32() * scale).collect();
        let b = (0..n).map(|_| 0.1 * rng.f32()).collect();
        (w, b)
    }

    fn weights(rng: &mut Rng, experts: usize, hidden: usize, inter: usize) -> Weights {
        Weights {
            gate_up: (0..experts)
                .map(|_| matrix(rng, 2 * inter, hidden))
                .collect(),
            down: (0..experts).map(|_| matrix(rng, hidden, inter)).collect(),
            hidden,
            inter,
        }
    }

    fn pack(m: &[(Vec<f32>, Vec<f32>)], n: usize, k: usize, path: Path) -> Vec<LinearWeight> {
        m.iter()
            .map(|(w, b)| {
                let p = PackedWeight::pack(Src::F32(w), Some(Src::F32(b)), n, k).unwrap();
                crate::linear::float(Arc::new(p), path)
            })
            .collect()
    }

    fn experts(w: &Weights, path: Path, act: ExpertAct) -> Experts {
        let (h, i) = (w.hidden, w.inter);
        let gate_up = pack(&w.gate_up, 2 * i, h, path);
        Experts::new(gate_up, pack(&w.down, h, i, path), act).unwrap()
    }

    fn act_ref(act: ExpertAct, g: f64, u: f64) -> f64 {
        match act {
            ExpertAct::Silu => g / (1.0 + (-g).exp()) * u,
            ExpertAct::GeluTanh => {
                let z = (2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g);
                0.5 * g * (1.0 + z.tanh()) * u
            }
            ExpertAct::Gelu => 0.5 * g * (1.0 + crate::layers::tests::erf64(g / 2f64.sqrt())) * u,
            ExpertAct::SwigluOai { alpha, limit } => {
                let (a, l) = (alpha as f64, limit as f64);
                let g = g.min(l);
                let u = u.clamp(-l, l);
                (u + 1.0) * g / (1.0 + (-a * g).exp())
            }
        }
    }

    /// y = b + W x over f64.
    fn linear(m: &(Vec<f32>, Vec<f32>), x: &[f64]) -> Vec<f64> {
        let (w, b) = m;
        let k = x.len();
        b.iter()
            .enumerate()
            .map(|(j, &bj)| {
                let row = &w[j * k..(j + 1) * k];
                bj as f64 + row.iter().zip(x).map(|(&a, &v)| a as f64 * v).sum::<f64>()
            })
            .collect()
    }

    /// The plain loop: every (token, slot) through its expert in f64.
    fn reference(w: &Weights, x: &[f32], ids: &[i32], rw: &[f32], act: ExpertAct) -> Vec<f64> {
        let (h, i) = (w.hidden, w.inter);
        let top_k = ids.len() / (x.len() / h);
        let mut out = vec![0f64; x.len()];
        for (j, (&e, &wt)) in ids.iter().zip(rw).enumerate() {
            let t = j / top_k;
            let xr: Vec<f64> = x[t * h..(t + 1) * h].iter().map(|&v| v as f64).collect();
            let gu = linear(&w.gate_up[e as usize], &xr);
            let a: Vec<f64> = (0..i).map(|c| act_ref(act, gu[c], gu[i + c])).collect();
            let y = linear(&w.down[e as usize], &a);
            for (o, v) in out[t * h..(t + 1) * h].iter_mut().zip(y) {
                *o += wt as f64 * v;
            }
        }
        out
    }

    /// (tokens, top_k, ids): expert 0 gets every token, the last none; then
    /// a spread routing; then one decode token.
    fn routings(rng: &mut Rng, experts: usize) -> Vec<(usize, usize, Vec<i32>)> {
        let every: Vec<i32> = (0..6)
            .flat_map(|t| [0, 1 + (t % (experts - 2)) as i32])
            .collect();
        let spread: Vec<i32> = (0..11)
            .flat_map(|_| {
                let mut perm: Vec<i32> = (0..experts as i32).collect();
                for i in (1..experts).rev() {
                    perm.swap(i, rng.below(i + 1));
                }
                perm.into_iter().take(3)
            })
            .collect();
        let decode = vec![experts as i32 - 1, 2, 0];
        vec![(6, 2, every), (11, 3, spread), (1, 3, decode)]
    }

    const ACTS: [ExpertAct; 4] = [
        ExpertAct::Silu,
        ExpertAct::GeluTanh,
        ExpertAct::Gelu,
        ExpertAct::SwigluOai {
            alpha: 1.702,
            limit: 0.8,
        },
    ];

    #[test]
    fn moe_experts_match_f64_reference_on_every_path() {
        let mut rng = Rng(3);
        let (n_experts, h, i) = (5, 40, 24);
        let w = weights(&mut rng, n_experts, h, i);
        let routes = routings(&mut rng, n_experts);
        for path in crate::gemm::available_paths() {
            for act in ACTS {
                let ex = experts(&w, path, act);
                for (tokens, top_k, ids) in &routes {
                    let (tokens, top_k) = (*tokens, *top_k);
                    let x: Vec<f32> = (0..tokens * h).map(|_| rng.f32()).collect();
                    let rw: Vec<f32> = (0..tokens * top_k).map(|_| rng.f32()).collect();
                    let want = reference(&w, &x, ids, &rw, act);
                    let mut out = vec![f32::NAN; tokens * h];
                    ex.forward(&mut out, &x, ids, &rw, tokens, top_k).unwrap();
                    for (j, (&o, &r)) in out.iter().zip(&want).enumerate() {
                        assert!(
                            (o as f64 - r).abs() <= 1e-5 * (1.0 + r.abs()),
                            "{path:?} {act:?} tokens={tokens} [{j}]: {o} vs {r}"
                        );
                    }
                    // bf16 in and out: the same routing, rounded inputs.
                    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
                    let xr: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
                    let want = reference(&w, &xr, ids, &rw, act);
                    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
                    let mut out = vec![bf16::ZERO; tokens * h];
                    ex.forward(&mut out, &xb, ids, &rw, tokens, top_k).unwrap();
                    for (j, (&o, &r)) in out.iter().zip(&want).enumerate() {
                        let o = o.to_f32() as f64;
                        assert!(
                            (o - r).abs() <= 2e-2 * scale + 2f64.powi(-8) * r.abs(),
                            "{path:?} {act:?} bf16 tokens={tokens} [{j}]: {o} vs {r}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn moe_experts_check_shapes_and_ids() {
        let mut rng = Rng(9);
        let (h, i) = (8, 4);
        let w = weights(&mut rng, 3, h, i);
        let path = Path::Scalar;
        let ex = experts(&w, path, ExpertAct::Silu);
        assert_eq!(
            (ex.num_experts(), ex.hidden(), ex.intermediate()),
            (3, h, i)
        );
        // Panels of 32 features, f32: 128 bytes per input feature at least.
        assert!(ex.nbytes() >= 3 * (h + i) * 128, "{}", ex.nbytes());
        let x = vec![0.5f32; 2 * h];
        let mut out = vec![0f32; 2 * h];
        let err = |r: CoreResult<()>| r.unwrap_err().to_string();
        let e = err(ex.forward(&mut out, &x, &[0, 1, 2, 3], &[1.0; 4], 2, 2));
        assert!(e.starts_with("ids: token 1 routes to expert 3"), "{e}");
        let e = err(ex.forward(&mut out, &x, &[0, -1, 2, 1], &[1.0; 4], 2, 2));
        assert!(e.starts_with("ids: token 0 routes to expert -1"), "{e}");
        let e = err(ex.forward(&mut out, &x, &[0, 1, 2], &[1.0; 4], 2, 2));
        assert!(e.starts_with("ids"), "{e}");
        let e = err(ex.forward(&mut out, &x, &[0, 1, 2, 1], &[1.0; 3], 2, 2));
        assert!(e.starts_with("weights"), "{e}");
        let e = err(ex.forward(&mut out[..h], &x, &[0, 1, 2, 1], &[1.0; 4], 2, 2));
        assert!(e.starts_with("out"), "{e}");
        // No slot at all: zeros.
        ex.forward(&mut out, &x, &[], &[], 2, 0).unwrap();
        assert!(out.iter().all(|&v| v == 0.0));

        let mut gate_up = pack(&w.gate_up, 2 * i, h, path);
        let down = pack(&w.down, h, i, path);
        let e = err(Experts::new(gate_up.clone(), down[..2].to_vec(), ExpertAct::Silu).map(|_| ()));
        assert!(e.starts_with("down: expected 3 weights"), "{e}");
        gate_up[2] = pack(&w.down[..1], h, i, path).remove(0);
        let e = err(Experts::new(gate_up.clone(), down.clone(), ExpertAct::Silu).map(|_| ()));
        assert!(
            e.starts_with("gate_up[2]: expected a [8, 8] weight, got [8, 4]"),
            "{e}"
        );
        let e = err(Experts::new(vec![], vec![], ExpertAct::Silu).map(|_| ()));
        assert!(e.starts_with("gate_up"), "{e}");
        let mut down2 = down.clone();
        down2[1] = pack(&w.gate_up[..1], 2 * i, h, path).remove(0);
        let gate_up = pack(&w.gate_up, 2 * i, h, path);
        let e = err(Experts::new(gate_up, down2, ExpertAct::Silu).map(|_| ()));
        assert!(e.starts_with("down[1]: expected a [8, 4] weight"), "{e}");
    }
}

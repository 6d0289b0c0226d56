//! The router: per token, scores of every expert from the router's logits,
//! the `top_k` best and their weights.

use crate::cpu::elem::{expect_matrix, SharedOut};
use crate::error::{CoreError, CoreResult};

/// How router logits become expert scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scoring {
    /// `softmax(logits)` over the experts, in f32 (max subtracted), as
    /// `F.softmax(logits, dim=-1, dtype=torch.float32)`.
    Softmax,
    /// `sigmoid(logit)` per expert.
    Sigmoid,
}

impl Scoring {
    /// Every scoring, in the order of the names the bindings accept.
    pub const ALL: [Scoring; 2] = [Scoring::Softmax, Scoring::Sigmoid];

    /// "softmax" or "sigmoid".
    pub fn name(self) -> &'static str {
        match self {
            Scoring::Softmax => "softmax",
            Scoring::Sigmoid => "sigmoid",
        }
    }

    /// Parses a scoring name (case-insensitive).
    pub fn parse(name: &str) -> Option<Scoring> {
        let name = name.trim().to_ascii_lowercase();
        Scoring::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// Scores (tokens x experts) below which the router runs on the calling
/// thread: a row is a few hundred operations, so only a long prefill is
/// worth waking the team for.
const SERIAL_SCORES: usize = 1 << 16;

/// Routes `tokens` tokens: `logits` [tokens, experts] (row-major) become
/// scores (`scoring`), each token's `top_k` highest scores (ties: the lower
/// expert index first) are written to `ids` and `weights` [tokens, top_k] in
/// descending order, divided by their sum when `renormalize`.
#[allow(clippy::too_many_arguments)]
pub fn route(
    logits: &[f32],
    tokens: usize,
    experts: usize,
    top_k: usize,
    scoring: Scoring,
    renormalize: bool,
    ids: &mut [i32],
    weights: &mut [f32],
) -> CoreResult<()> {
    if experts == 0 {
        return Err(CoreError::invalid("logits: expected at least one expert"));
    }
    if experts > i32::MAX as usize {
        return Err(CoreError::invalid(format!(
            "logits: {experts} experts do not fit int32 ids"
        )));
    }
    if top_k == 0 {
        return Err(CoreError::invalid("top_k: must be at least 1"));
    }
    if top_k > experts {
        return Err(CoreError::invalid(format!(
            "top_k: {top_k} exceeds the number of experts ({experts})"
        )));
    }
    expect_matrix("logits", logits.len(), tokens, experts)?;
    expect_matrix("ids", ids.len(), tokens, top_k)?;
    expect_matrix("weights", weights.len(), tokens, top_k)?;
    let threads = crate::cpu::threads::num_threads();
    if threads <= 1 || tokens < 2 || tokens * experts < SERIAL_SCORES {
        route_rows(logits, experts, top_k, scoring, renormalize, ids, weights);
        return Ok(());
    }
    let chunks = (4 * threads).min(tokens);
    let (id_out, w_out) = (SharedOut(ids.as_mut_ptr()), SharedOut(weights.as_mut_ptr()));
    crate::cpu::threads::team_run(chunks, &|c| {
        let (t0, t1) = (c * tokens / chunks, (c + 1) * tokens / chunks);
        let n = (t1 - t0) * top_k;
        // SAFETY: tokens t0..t1 of ids and weights belong to this chunk
        // only; both hold tokens * top_k elements (checked above).
        let (ids, weights) = unsafe {
            (
                std::slice::from_raw_parts_mut(id_out.ptr().add(t0 * top_k), n),
                std::slice::from_raw_parts_mut(w_out.ptr().add(t0 * top_k), n),
            )
        };
        let logits = &logits[t0 * experts..t1 * experts];
        route_rows(logits, experts, top_k, scoring, renormalize, ids, weights);
    })
}

/// Routes the rows of `logits` (whole tokens) into `ids` / `weights`.
fn route_rows(
    logits: &[f32],
    experts: usize,
    top_k: usize,
    scoring: Scoring,
    renormalize: bool,
    ids: &mut [i32],
    weights: &mut [f32],
) {
    let mut p = vec![0f32; experts];
    let rows = logits.chunks_exact(experts).zip(
        ids.chunks_exact_mut(top_k)
            .zip(weights.chunks_exact_mut(top_k)),
    );
    for (row, (ids, weights)) in rows {
        scores(row, scoring, &mut p);
        top_k_of(&p, ids, weights);
        if renormalize {
            let sum: f32 = weights.iter().sum();
            weights.iter_mut().for_each(|w| *w /= sum);
        }
    }
}

/// The scores of one token's logits.
fn scores(row: &[f32], scoring: Scoring, p: &mut [f32]) {
    match scoring {
        Scoring::Softmax => {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for (p, &l) in p.iter_mut().zip(row) {
                *p = (l - max).exp();
                sum += *p;
            }
            p.iter_mut().for_each(|p| *p /= sum);
        }
        Scoring::Sigmoid => {
            for (p, &l) in p.iter_mut().zip(row) {
                *p = 1.0 / (1.0 + (-l).exp());
            }
        }
    }
}

/// The `ids.len()` highest of `p`, in descending order (ties: the lower
/// index first), by insertion into the sorted selection: k is small.
fn top_k_of(p: &[f32], ids: &mut [i32], weights: &mut [f32]) {
    let k = ids.len();
    let mut filled = 0;
    for (e, &v) in p.iter().enumerate() {
        // Full: only a higher score than the last enters (a NaN does not).
        let enters = filled < k || v > weights[k - 1];
        if !enters {
            continue;
        }
        // After every selected score >= v: equal scores keep index order.
        let at = weights[..filled].partition_point(|&w| w >= v);
        let end = filled.min(k - 1);
        ids.copy_within(at..end, at + 1);
        weights.copy_within(at..end, at + 1);
        ids[at] = e as i32;
        weights[at] = v;
        filled = (filled + 1).min(k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::elem::tests::Rng;

    /// f64 scores, a stable sort by descending score, renormalised in f64.
    fn reference(
        row: &[f32],
        k: usize,
        scoring: Scoring,
        renormalize: bool,
    ) -> (Vec<i32>, Vec<f64>) {
        let x: Vec<f64> = row.iter().map(|&v| v as f64).collect();
        let p: Vec<f64> = match scoring {
            Scoring::Softmax => {
                let max = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = x.iter().map(|v| (v - max).exp()).collect();
                let s: f64 = e.iter().sum();
                e.iter().map(|v| v / s).collect()
            }
            Scoring::Sigmoid => x.iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect(),
        };
        let mut order: Vec<usize> = (0..p.len()).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
        order.truncate(k);
        let mut w: Vec<f64> = order.iter().map(|&e| p[e]).collect();
        if renormalize {
            let s: f64 = w.iter().sum();
            w.iter_mut().for_each(|v| *v /= s);
        }
        (order.iter().map(|&e| e as i32).collect(), w)
    }

    #[test]
    fn moe_route_matches_f64_reference() {
        let mut rng = Rng(5);
        for &(tokens, experts, k) in &[(1, 1, 1), (3, 8, 2), (7, 64, 8), (2, 5, 5), (600, 128, 4)] {
            // Well-separated logits, so f32 rounding cannot reorder them.
            let logits: Vec<f32> = (0..tokens)
                .flat_map(|_| {
                    let mut perm: Vec<usize> = (0..experts).collect();
                    for i in (1..experts).rev() {
                        perm.swap(i, rng.below(i + 1));
                    }
                    let row: Vec<f32> = perm
                        .into_iter()
                        .map(|j| j as f32 * 0.05 - 3.0 + 0.01 * rng.f32())
                        .collect();
                    row
                })
                .collect();
            for scoring in Scoring::ALL {
                for renormalize in [false, true] {
                    let mut ids = vec![-1i32; tokens * k];
                    let mut w = vec![0f32; tokens * k];
                    route(
                        &logits,
                        tokens,
                        experts,
                        k,
                        scoring,
                        renormalize,
                        &mut ids,
                        &mut w,
                    )
                    .unwrap();
                    for t in 0..tokens {
                        let row = &logits[t * experts..(t + 1) * experts];
                        let (want_ids, want_w) = reference(row, k, scoring, renormalize);
                        assert_eq!(&ids[t * k..(t + 1) * k], &want_ids[..], "{scoring:?} t={t}");
                        for (j, (&got, &want)) in w[t * k..][..k].iter().zip(&want_w).enumerate() {
                            assert!(
                                (got as f64 - want).abs() <= 1e-5 * want.abs() + 1e-12,
                                "{scoring:?} renorm={renormalize} t={t} [{j}]: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn moe_route_breaks_ties_by_lower_index() {
        let logits = [1.0f32, 2.0, 2.0, 0.5, 2.0];
        let mut ids = [0i32; 3];
        let mut w = [0f32; 3];
        route(&logits, 1, 5, 3, Scoring::Sigmoid, false, &mut ids, &mut w).unwrap();
        assert_eq!(ids, [1, 2, 4]);
        route(&logits, 1, 5, 3, Scoring::Softmax, true, &mut ids, &mut w).unwrap();
        assert_eq!(ids, [1, 2, 4]);
        assert!(w.iter().all(|&v| (v - 1.0 / 3.0).abs() < 1e-7), "{w:?}");
    }

    #[test]
    fn moe_route_errors_name_the_argument() {
        let logits = vec![0f32; 12];
        // (logits, tokens, experts, top_k, ids, weights) -> the error's first word
        type Case<'a> = (&'a [f32], usize, usize, usize, usize, usize, &'a str);
        let cases: [Case<'_>; 7] = [
            (&logits, 3, 4, 0, 6, 6, "top_k"),
            (&logits, 3, 4, 5, 6, 6, "top_k: 5 exceeds"),
            (&logits, 2, 4, 2, 6, 6, "logits"),
            (&logits, 3, 4, 2, 5, 6, "ids"),
            (&logits, 3, 4, 2, 6, 4, "weights"),
            (&[], 0, 0, 1, 0, 0, "logits"),
            (&logits, 3, 4, 2, 6, 6, ""),
        ];
        for (l, tokens, experts, k, n_ids, n_w, start) in cases {
            let (mut ids, mut w) = (vec![0i32; n_ids], vec![0f32; n_w]);
            let r = route(
                l,
                tokens,
                experts,
                k,
                Scoring::Softmax,
                true,
                &mut ids,
                &mut w,
            );
            match r {
                Err(e) => assert!(!start.is_empty() && e.to_string().starts_with(start), "{e}"),
                Ok(()) => assert!(start.is_empty(), "expected an error about {start}"),
            }
        }
        assert!(route(&[], 0, 4, 2, Scoring::Softmax, true, &mut [], &mut []).is_ok());
        assert_eq!(Scoring::parse(" Sigmoid"), Some(Scoring::Sigmoid));
        assert_eq!(Scoring::parse("relu"), None);
    }
}

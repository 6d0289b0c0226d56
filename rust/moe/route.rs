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

/// How a token's scores become its experts and their weights: the `top_k`
/// highest scores, chosen on `score + bias[e]` where a selection bias is
/// given (the weights stay the unbiased scores), divided by
/// `sum + renorm_eps` when `renormalize`, then multiplied by `scale`.
#[derive(Clone, Debug, PartialEq)]
pub struct Rule {
    pub top_k: usize,
    pub scoring: Scoring,
    pub renormalize: bool,
    pub renorm_eps: f32,
    pub scale: f32,
    pub bias: Option<Vec<f32>>,
}

impl Rule {
    /// The plain rule: top-k of the scores, renormalised or not, no bias.
    pub fn new(top_k: usize, scoring: Scoring, renormalize: bool) -> Rule {
        Rule {
            top_k,
            scoring,
            renormalize,
            renorm_eps: 0.0,
            scale: 1.0,
            bias: None,
        }
    }

    /// Checks the rule against `experts` experts.
    pub fn check(&self, experts: usize) -> CoreResult<()> {
        if experts == 0 {
            return Err(CoreError::invalid("logits: expected at least one expert"));
        }
        if experts > i32::MAX as usize {
            return Err(CoreError::invalid(format!(
                "logits: {experts} experts do not fit int32 ids"
            )));
        }
        if self.top_k == 0 {
            return Err(CoreError::invalid("top_k: must be at least 1"));
        }
        if self.top_k > experts {
            return Err(CoreError::invalid(format!(
                "top_k: {} exceeds the number of experts ({experts})",
                self.top_k
            )));
        }
        if let Some(bias) = &self.bias {
            if bias.len() != experts {
                return Err(CoreError::invalid(format!(
                    "selection_bias: expected {experts} values (one per expert), got {}",
                    bias.len()
                )));
            }
        }
        if !self.renorm_eps.is_finite() || self.renorm_eps < 0.0 {
            return Err(CoreError::invalid(format!(
                "renorm_eps: must be finite and >= 0, got {}",
                self.renorm_eps
            )));
        }
        if !self.scale.is_finite() {
            return Err(CoreError::invalid(format!(
                "scale: must be finite, got {}",
                self.scale
            )));
        }
        Ok(())
    }
}

/// Routes `tokens` tokens: `logits` [tokens, experts] (row-major) become
/// scores (`rule.scoring`), each token's `top_k` experts (ties: the lower
/// expert index first) are written to `ids` and their weights to `weights`
/// [tokens, top_k], in descending order of the score they were chosen by
/// ([`Rule`]).
pub fn route(
    logits: &[f32],
    tokens: usize,
    experts: usize,
    rule: &Rule,
    ids: &mut [i32],
    weights: &mut [f32],
) -> CoreResult<()> {
    rule.check(experts)?;
    let top_k = rule.top_k;
    expect_matrix("logits", logits.len(), tokens, experts)?;
    expect_matrix("ids", ids.len(), tokens, top_k)?;
    expect_matrix("weights", weights.len(), tokens, top_k)?;
    let threads = crate::cpu::threads::num_threads();
    if threads <= 1 || tokens < 2 || tokens * experts < SERIAL_SCORES {
        route_rows(logits, experts, rule, ids, weights);
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
        route_rows(logits, experts, rule, ids, weights);
    })
}

/// Routes the rows of `logits` (whole tokens) into `ids` / `weights`.
fn route_rows(logits: &[f32], experts: usize, rule: &Rule, ids: &mut [i32], weights: &mut [f32]) {
    let mut p = vec![0f32; experts];
    let mut biased = vec![0f32; if rule.bias.is_some() { experts } else { 0 }];
    let k = rule.top_k;
    let rows = logits
        .chunks_exact(experts)
        .zip(ids.chunks_exact_mut(k).zip(weights.chunks_exact_mut(k)));
    for (row, (ids, weights)) in rows {
        scores(row, rule.scoring, &mut p);
        match &rule.bias {
            Some(bias) => {
                for ((b, &s), &e) in biased.iter_mut().zip(&p).zip(bias) {
                    *b = s + e;
                }
                top_k_of(&biased, ids, weights);
                for (w, &e) in weights.iter_mut().zip(ids.iter()) {
                    *w = p[e as usize];
                }
            }
            None => top_k_of(&p, ids, weights),
        }
        if rule.renormalize {
            let sum = weights.iter().sum::<f32>() + rule.renorm_eps;
            weights.iter_mut().for_each(|w| *w /= sum);
        }
        if rule.scale != 1.0 {
            weights.iter_mut().for_each(|w| *w *= rule.scale);
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

    /// f64 scores, a stable sort by descending (biased) score, renormalised
    /// and scaled in f64.
    fn reference(row: &[f32], rule: &Rule) -> (Vec<i32>, Vec<f64>) {
        let x: Vec<f64> = row.iter().map(|&v| v as f64).collect();
        let p: Vec<f64> = match rule.scoring {
            Scoring::Softmax => {
                let max = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = x.iter().map(|v| (v - max).exp()).collect();
                let s: f64 = e.iter().sum();
                e.iter().map(|v| v / s).collect()
            }
            Scoring::Sigmoid => x.iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect(),
        };
        let key: Vec<f64> = match &rule.bias {
            Some(b) => p.iter().zip(b).map(|(&s, &b)| s + b as f64).collect(),
            None => p.clone(),
        };
        let mut order: Vec<usize> = (0..p.len()).collect();
        order.sort_by(|&a, &b| key[b].total_cmp(&key[a]));
        order.truncate(rule.top_k);
        let mut w: Vec<f64> = order.iter().map(|&e| p[e]).collect();
        if rule.renormalize {
            let s: f64 = w.iter().sum::<f64>() + rule.renorm_eps as f64;
            w.iter_mut().for_each(|v| *v /= s);
        }
        w.iter_mut().for_each(|v| *v *= rule.scale as f64);
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
            // A selection bias that reorders the choice (multiples of 0.3
            // keep biased scores apart), and LFM2-MoE's epsilon and scale.
            let bias: Vec<f32> = (0..experts).map(|_| 0.3 * rng.below(4) as f32).collect();
            for scoring in Scoring::ALL {
                for renormalize in [false, true] {
                    for (biased, eps, scale) in [(false, 0.0, 1.0), (true, 1e-6, 2.5)] {
                        let rule = Rule {
                            renorm_eps: eps,
                            scale,
                            bias: biased.then(|| bias.clone()),
                            ..Rule::new(k, scoring, renormalize)
                        };
                        let mut ids = vec![-1i32; tokens * k];
                        let mut w = vec![0f32; tokens * k];
                        route(&logits, tokens, experts, &rule, &mut ids, &mut w).unwrap();
                        for t in 0..tokens {
                            let row = &logits[t * experts..(t + 1) * experts];
                            let (want_ids, want_w) = reference(row, &rule);
                            let got = &ids[t * k..(t + 1) * k];
                            assert_eq!(got, &want_ids[..], "{rule:?} t={t}");
                            for (j, (&got, &want)) in
                                w[t * k..][..k].iter().zip(&want_w).enumerate()
                            {
                                assert!(
                                    (got as f64 - want).abs() <= 1e-5 * want.abs() + 1e-12,
                                    "{rule:?} t={t} [{j}]: {got} vs {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn moe_route_bias_chooses_but_does_not_weigh() {
        // Sigmoid scores ordered 4 > 1 > 0 > 3 > 2; the bias lifts expert 2
        // into the choice, whose weight stays its own score.
        let logits = [0.0f32, 1.0, -2.0, -1.0, 2.0];
        let rule = Rule {
            bias: Some(vec![0.0, 0.0, 1.0, 0.0, 0.0]),
            ..Rule::new(2, Scoring::Sigmoid, false)
        };
        let (mut ids, mut w) = ([0i32; 2], [0f32; 2]);
        route(&logits, 1, 5, &rule, &mut ids, &mut w).unwrap();
        assert_eq!(ids, [2, 4]);
        let sig = |v: f32| 1.0 / (1.0 + (-v).exp());
        assert_eq!(w, [sig(-2.0), sig(2.0)]);
    }

    #[test]
    fn moe_route_breaks_ties_by_lower_index() {
        let logits = [1.0f32, 2.0, 2.0, 0.5, 2.0];
        let mut ids = [0i32; 3];
        let mut w = [0f32; 3];
        let rule = Rule::new(3, Scoring::Sigmoid, false);
        route(&logits, 1, 5, &rule, &mut ids, &mut w).unwrap();
        assert_eq!(ids, [1, 2, 4]);
        let rule = Rule::new(3, Scoring::Softmax, true);
        route(&logits, 1, 5, &rule, &mut ids, &mut w).unwrap();
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
            let rule = Rule::new(k, Scoring::Softmax, true);
            let r = route(l, tokens, experts, &rule, &mut ids, &mut w);
            match r {
                Err(e) => assert!(!start.is_empty() && e.to_string().starts_with(start), "{e}"),
                Ok(()) => assert!(start.is_empty(), "expected an error about {start}"),
            }
        }
        let rule = Rule::new(2, Scoring::Softmax, true);
        assert!(route(&[], 0, 4, &rule, &mut [], &mut []).is_ok());
        let bad = [
            (
                Rule {
                    bias: Some(vec![0.0; 3]),
                    ..rule.clone()
                },
                "selection_bias",
            ),
            (
                Rule {
                    renorm_eps: -1.0,
                    ..rule.clone()
                },
                "renorm_eps",
            ),
            (
                Rule {
                    scale: f32::NAN,
                    ..rule.clone()
                },
                "scale",
            ),
        ];
        for (rule, start) in bad {
            let e = route(&[0.0; 4], 1, 4, &rule, &mut [0; 2], &mut [0.0; 2]).unwrap_err();
            assert!(e.to_string().starts_with(start), "{e}");
        }
        assert_eq!(Scoring::parse(" Sigmoid"), Some(Scoring::Sigmoid));
        assert_eq!(Scoring::parse("relu"), None);
    }
}

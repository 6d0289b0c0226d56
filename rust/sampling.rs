//! Batched sampler over rows of float32 logits (vLLM-compatible semantics).
//!
//! Per row, in this order (DESIGN.md, "Sampling"):
//! 1. log-probabilities, rank and top-N come from the RAW logits
//!    (`log_softmax` of the unmodified row);
//! 2. penalties: repetition over prompt and output tokens (a positive logit is
//!    divided by the penalty, a non-positive one multiplied), then
//!    `frequency × count` and `presence × [count > 0]` subtracted, over output
//!    tokens only;
//! 3. greedy argmax (ties → lowest id) when `temperature < 1e-5`;
//! 4. `w = z / temperature`;
//! 5. min_p: keep `e_i >= min_p` where `e_i = exp(w_i - max w)`, i.e. the
//!    probability relative to the most likely token;
//! 6. top-k: keep `w_i >=` the k-th largest `w` (ties at the boundary kept);
//! 7. top-p: over what is left, with `Z = Σ e_i`, sort by `e` descending and
//!    find the first token where the running sum reaches `top_p × Z`; keep
//!    every token with `e_i >=` that token's `e` (so at least one is kept);
//! 8. sample among the kept tokens by an exponential race (Gumbel-max).
//!
//! Disabled values: `top_k <= 0` or `>= vocab`, `top_p >= 1`, `min_p <= 0`,
//! `repetition_penalty == 1`, `frequency_penalty == presence_penalty == 0`.
//! NaN logits are treated as `-inf`, `+inf` as `f32::MAX`.
//!
//! No step sorts the vocabulary: top-k is a bounded heap scan, top-p without
//! top-k is a radix selection on the probability mass (bucket histograms over
//! the bit patterns of `e`), and the race prunes tokens that cannot win before
//! touching a logarithm.
//!
//! # The random draw (reproduce this bit for bit on CUDA)
//! ```text
//! G          = 0x9E3779B97F4A7C15
//! mix64(z)   : z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
//!              z = (z ^ (z >> 27)) * 0x94D049BB133111EB
//!              return z ^ (z >> 31)              (all u64, wrapping)
//! row_key    = mix64(mix64(seed + G) + (position + 1) * G)
//! h          = mix64(row_key + (token + 1) * G)
//! u          = ((h >> 12) as f64 + 0.5) * 2^-52  ∈ [2^-53, 1 - 2^-53], never 0 or 1
//! key(token) = (w_token as f64) - ln(-ln(u))     (f64 natural logs)
//! sampled    = argmax of key over the kept tokens, ties → lowest id
//! ```
//! `-ln(u)` is an Exp(1) variable `E`, so `argmax w - ln E` picks token `i`
//! with probability `∝ exp(w_i)` restricted to the kept set. The draw depends
//! only on `(seed, position, token)`, so a seeded row samples the same token
//! whatever batch it shares and however many threads run.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use rayon::prelude::*;

use crate::error::{CoreError, CoreResult};

/// Temperatures below this sample greedily (argmax).
pub const GREEDY_TEMPERATURE: f32 = 1e-5;

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
/// `53 ln 2 ≈ 36.74` bounds `-ln(E)` from above (E >= -ln(1 - 2^-53) ≈ 2^-53),
/// so a token whose tempered logit is this far below the best key cannot win.
const PRUNE_GAP: f64 = 37.0;
/// Safety factor on the approximate `exp` used by the race's cheap test.
const PRUNE_MARGIN: f64 = 1.001;
/// Candidate count under which a top-p bucket is sorted instead of refined.
const TOP_P_SORT_LIMIT: usize = 4096;

/// Sampling settings of one row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_k: i64,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// Seed of the counter-based random draw.
    pub seed: u64,
    /// Absolute position of the token being sampled (the draw's counter).
    pub position: u64,
    /// How many top raw log-probabilities to return (0 = none).
    pub num_logprobs: usize,
    /// Whether to compute the sampled token's raw log-probability and rank
    /// (a pass over the row for the log-sum-exp, another for the rank);
    /// without them, and with `num_logprobs` 0, [`Sample`] holds NaN and 0.
    pub sampled_logprob: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: 0,
            position: 0,
            num_logprobs: 0,
            sampled_logprob: true,
        }
    }
}

impl SamplingParams {
    /// Checks every field; errors name the field and the row.
    pub fn validate(&self, row: usize) -> CoreResult<()> {
        let bad = |field: &str, rule: &str, value: f32| {
            Err(CoreError::invalid(format!(
                "{field}[{row}]: must be {rule}, got {value}"
            )))
        };
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad("temperature", "finite and >= 0", self.temperature);
        }
        if self.top_p.is_nan() || self.top_p <= 0.0 {
            return bad("top_p", "> 0 (>= 1 disables it)", self.top_p);
        }
        if self.min_p.is_nan() || self.min_p > 1.0 {
            return bad("min_p", "<= 1 (<= 0 disables it)", self.min_p);
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return bad(
                "repetition_penalty",
                "finite and > 0",
                self.repetition_penalty,
            );
        }
        if !self.frequency_penalty.is_finite() {
            return bad("frequency_penalty", "finite", self.frequency_penalty);
        }
        if !self.presence_penalty.is_finite() {
            return bad("presence_penalty", "finite", self.presence_penalty);
        }
        Ok(())
    }

    fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_TEMPERATURE
    }

    fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
    }

    fn top_k_active(&self, vocab: usize) -> Option<usize> {
        (self.top_k > 0 && (self.top_k as u64) < vocab as u64).then_some(self.top_k as usize)
    }
}

/// A batch of rows to sample: logits `[rows, vocab]` row-major, per-row
/// parameters, and token histories as flat arrays with `rows + 1` offsets.
#[derive(Clone, Copy, Debug)]
pub struct Batch<'a> {
    pub logits: &'a [f32],
    pub vocab: usize,
    pub params: &'a [SamplingParams],
    pub prompt_tokens: &'a [i32],
    pub prompt_offsets: &'a [usize],
    pub output_tokens: &'a [i32],
    pub output_offsets: &'a [usize],
}

/// What one row returns.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// The sampled token id.
    pub token: u32,
    /// Its log-probability under the raw logits.
    pub logprob: f32,
    /// 1 + number of tokens with a strictly larger raw log-probability.
    pub rank: u32,
    /// The `num_logprobs` largest raw log-probabilities, descending, ties by id.
    pub top_logprobs: Vec<(u32, f32)>,
}

impl<'a> Batch<'a> {
    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.params.len()
    }

    /// Checks shapes, offsets, token ids and parameters; errors name the argument.
    pub fn validate(&self) -> CoreResult<()> {
        let rows = self.rows();
        if rows > 0 && self.vocab == 0 {
            return Err(CoreError::invalid("logits: vocabulary size must be > 0"));
        }
        if self.vocab > i32::MAX as usize {
            return Err(CoreError::invalid(format!(
                "logits: vocabulary size {} exceeds the int32 token id range",
                self.vocab
            )));
        }
        if Some(self.logits.len()) != rows.checked_mul(self.vocab) {
            return Err(CoreError::invalid(format!(
                "logits: expected {} x {} = rows x vocab values, got {}",
                rows,
                self.vocab,
                self.logits.len()
            )));
        }
        for (row, p) in self.params.iter().enumerate() {
            p.validate(row)?;
        }
        check_history(
            "prompt_tokens",
            "prompt_offsets",
            self.prompt_tokens,
            self.prompt_offsets,
            rows,
            self.vocab,
        )?;
        check_history(
            "output_tokens",
            "output_offsets",
            self.output_tokens,
            self.output_offsets,
            rows,
            self.vocab,
        )
    }

    fn row(&self, r: usize) -> RowInput<'_> {
        RowInput {
            logits: &self.logits[r * self.vocab..(r + 1) * self.vocab],
            params: &self.params[r],
            prompt: &self.prompt_tokens[self.prompt_offsets[r]..self.prompt_offsets[r + 1]],
            output: &self.output_tokens[self.output_offsets[r]..self.output_offsets[r + 1]],
        }
    }
}

fn check_history(
    tokens_name: &str,
    offsets_name: &str,
    tokens: &[i32],
    offsets: &[usize],
    rows: usize,
    vocab: usize,
) -> CoreResult<()> {
    if offsets.len() != rows + 1 {
        return Err(CoreError::invalid(format!(
            "{offsets_name}: expected {} offsets (rows + 1), got {}",
            rows + 1,
            offsets.len()
        )));
    }
    for (r, pair) in offsets.windows(2).enumerate() {
        if pair[1] < pair[0] {
            return Err(CoreError::invalid(format!(
                "{offsets_name}: offsets must be non-decreasing, but [{r}] = {} > [{}] = {}",
                pair[0],
                r + 1,
                pair[1]
            )));
        }
    }
    let (first, last) = (offsets[0], offsets[rows]);
    if last > tokens.len() {
        return Err(CoreError::invalid(format!(
            "{offsets_name}: last offset {last} is past the end of {tokens_name} (length {})",
            tokens.len()
        )));
    }
    if let Some((i, &t)) = tokens[first..last]
        .iter()
        .enumerate()
        .find(|(_, &t)| t < 0 || t as usize >= vocab)
    {
        return Err(CoreError::invalid(format!(
            "{tokens_name}[{}]: token id {t} is outside the vocabulary [0, {vocab})",
            first + i
        )));
    }
    Ok(())
}

/// Samples one token per row (in parallel over rows on the private pool).
pub fn sample_batch(batch: &Batch<'_>) -> CoreResult<Vec<Sample>> {
    batch.validate()?;
    if batch.rows() == 1 {
        // Batch-1 decode: waking a pool worker for one row costs more than
        // it saves.
        let row = batch.row(0);
        let s = &mut Scratch::default();
        return Ok(vec![crate::cpu::simd::dispatch(
            crate::cpu::best_path(),
            SampleRow { row: &row, s },
        )]);
    }
    Ok(crate::cpu::threads::install(|| {
        (0..batch.rows())
            .into_par_iter()
            .map_init(Scratch::default, |s, r| {
                let row = batch.row(r);
                crate::cpu::simd::dispatch(crate::cpu::best_path(), SampleRow { row: &row, s })
            })
            .collect()
    }))
}

/// One row's sampling as a kernel: its passes over the vocabulary (max,
/// sums of exponentials, filters, the race) compile inside the entry point
/// of the fastest SIMD path, with that path's vectors. Every float operation
/// is the same IEEE operation on every path (no reordering, no contraction),
/// so the result does not depend on the path.
struct SampleRow<'a, 'b> {
    row: &'a RowInput<'b>,
    s: &'a mut Scratch,
}

impl crate::cpu::simd::Kernel for SampleRow<'_, '_> {
    type Output = Sample;
    #[inline(always)]
    fn run<S: crate::cpu::simd::Simd>(self) -> Sample {
        sample_row(self.row, self.s)
    }
}

/// The kept token ids (ascending) of each row after penalties and filters;
/// the set the sampler draws from. For tests and debugging.
pub fn support_batch(batch: &Batch<'_>) -> CoreResult<Vec<Vec<u32>>> {
    batch.validate()?;
    Ok(crate::cpu::threads::install(|| {
        (0..batch.rows())
            .into_par_iter()
            .map_init(Scratch::default, |s, r| support_row(&batch.row(r), s))
            .collect()
    }))
}

/// The uniform draw in (0, 1) for `(seed, position, token)`; see the module docs.
pub fn uniform(seed: u64, position: u64, token: u32) -> f64 {
    unit(row_key(seed, position), token)
}

#[inline(always)]
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn row_key(seed: u64, position: u64) -> u64 {
    mix64(
        mix64(seed.wrapping_add(GOLDEN))
            .wrapping_add(position.wrapping_add(1).wrapping_mul(GOLDEN)),
    )
}

#[inline(always)]
fn unit(row_key: u64, token: u32) -> f64 {
    let h = mix64(row_key.wrapping_add((token as u64 + 1).wrapping_mul(GOLDEN)));
    // `h >> 12` < 2^52 is exact as the low mantissa bits of 2^52: the value
    // `as f64` gives, in operations that vectorise without AVX-512DQ.
    const TWO_52: f64 = 4_503_599_627_370_496.0;
    let v = f64::from_bits(TWO_52.to_bits() | (h >> 12)) - TWO_52;
    (v + 0.5) * (1.0 / TWO_52)
}

#[inline(always)]
fn race_key(w: f32, u: f64) -> f64 {
    w as f64 - (-u.ln()).ln()
}

/// NaN → -inf, +inf → f32::MAX.
#[inline(always)]
fn sanitize(v: f32) -> f32 {
    if v.is_nan() {
        f32::NEG_INFINITY
    } else if v > f32::MAX {
        f32::MAX
    } else {
        v
    }
}

/// exp for f32 with ~2e-7 relative error (Cody-Waite reduction and a degree-6
/// polynomial), written branch-free so loops over it vectorize. Inputs below
/// -87 return 0; inputs must not be NaN.
#[inline(always)]
fn fast_exp(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const SHIFTER: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let xc = x.clamp(-87.0, 88.0);
    let kf = (xc * std::f32::consts::LOG2_E + SHIFTER) - SHIFTER;
    let r = xc - kf * LN2_HI - kf * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * (r * r) + r + 1.0;
    // SAFETY: `kf` is an integer in [-126, 127] (from the clamped input), so
    // the conversion is exact; Rust's saturating `as` would keep the loops
    // around this function scalar.
    let scale = f32::from_bits(((unsafe { kf.to_int_unchecked::<i32>() } + 127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else {
        y * scale
    }
}

/// `dst[i] = f(src[i])`, as a loop that inlines into the caller's SIMD
/// entry point (`Vec::extend` over a mapped `exp` stayed out of line,
/// compiled for the baseline ISA).
#[inline(always)]
fn map_into(dst: &mut Vec<f32>, src: &[f32], f: impl Fn(f32) -> f32) {
    dst.clear();
    dst.resize(src.len(), 0.0);
    for (d, &v) in dst.iter_mut().zip(src) {
        *d = f(v);
    }
}

/// Keeps the values of `v` that pass `keep`, in order, moved to the front
/// without a branch (whether a token passes is often a coin toss).
#[inline(always)]
fn keep_where(v: &mut Vec<f32>, keep: impl Fn(f32) -> bool) {
    let mut kept = 0;
    let e = &mut v[..];
    for j in 0..e.len() {
        let x = e[j];
        e[kept] = x;
        kept += keep(x) as usize;
    }
    v.truncate(kept);
}

/// Maximum of a row, NaN ignored (an all-NaN row gives -inf).
#[inline(always)]
fn row_max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = if v > *a { v } else { *a };
        }
    }
    let mut m = acc
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    for &v in tail {
        m = if v > m { v } else { m };
    }
    m
}

/// Lowest index holding `target` after sanitising (0 if none).
#[inline(always)]
fn first_index_of(x: &[f32], target: f32) -> usize {
    for (ci, chunk) in x.chunks(64).enumerate() {
        let hits = chunk.iter().filter(|&&v| sanitize(v) == target).count();
        if hits > 0 {
            if let Some(j) = chunk.iter().position(|&v| sanitize(v) == target) {
                return ci * 64 + j;
            }
        }
    }
    0
}

/// Σ exp(sanitize(x) - m), accumulated in f32 lanes per block, blocks in f64.
#[inline(always)]
fn sum_exp(x: &[f32], m: f32) -> f64 {
    let mut total = 0.0f64;
    for block in x.chunks(1024) {
        let mut acc = [0.0f32; 16];
        let chunks = block.chunks_exact(16);
        let tail = chunks.remainder();
        for c in chunks {
            for (a, &v) in acc.iter_mut().zip(c) {
                *a += fast_exp(sanitize(v) - m);
            }
        }
        total += acc.iter().map(|&a| a as f64).sum::<f64>();
        total += tail
            .iter()
            .map(|&v| fast_exp(sanitize(v) - m) as f64)
            .sum::<f64>();
    }
    total
}

/// A heap entry ordered so that "greater" means "worse": lower value, then
/// higher id. `BinaryHeap::peek` is then the worst of the kept entries, and
/// an ascending sort puts the best first.
#[derive(Clone, Copy, Debug)]
struct Entry {
    v: f32,
    i: u32,
}

impl PartialEq for Entry {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Entry {
    fn cmp(&self, o: &Self) -> Ordering {
        // Values are never NaN here; -0.0 and 0.0 compare equal, as logprobs do.
        o.v.partial_cmp(&self.v)
            .unwrap_or(Ordering::Equal)
            .then(self.i.cmp(&o.i))
    }
}

/// Maximum of `map(v)` over a short chunk, in lanes so it vectorises.
#[inline(always)]
fn chunk_max(chunk: &[f32], map: &impl Fn(f32) -> f32) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let lanes = chunk.chunks_exact(16);
    let tail = lanes.remainder();
    for c in lanes {
        for (a, &v) in acc.iter_mut().zip(c) {
            let v = map(v);
            *a = if v > *a { v } else { *a };
        }
    }
    let mut m = acc
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    for &v in tail {
        let v = map(v);
        m = if v > m { v } else { m };
    }
    m
}

/// The `n` best `(value, id)` of `map(values)` by value descending, ties by
/// lower id, sorted best first. A bounded heap with a per-chunk maximum test,
/// so the common case is one vectorised pass; large `n` uses selection.
#[inline(always)]
fn top_n(values: &[f32], n: usize, map: impl Fn(f32) -> f32) -> Vec<Entry> {
    top_n_with_rest(values, n, map).0
}

/// `top_n`, plus the largest value left out (-inf if none): equal to the
/// n-th value exactly when ties at the boundary were left out.
#[inline(always)]
fn top_n_with_rest(values: &[f32], n: usize, map: impl Fn(f32) -> f32) -> (Vec<Entry>, f32) {
    let n = n.min(values.len());
    let mut rest = f32::NEG_INFINITY;
    let mut note = |v: f32| rest = if v > rest { v } else { rest };
    if n == 0 {
        return (Vec::new(), chunk_max(values, &map));
    }
    if n.saturating_mul(8) >= values.len() {
        let mut all: Vec<Entry> = values
            .iter()
            .enumerate()
            .map(|(i, &v)| Entry {
                v: map(v),
                i: i as u32,
            })
            .collect();
        if n < all.len() {
            all.select_nth_unstable(n - 1);
            all[n..].iter().for_each(|e| note(e.v));
            all.truncate(n);
        }
        all.sort_unstable();
        return (all, rest);
    }
    let mut heap: BinaryHeap<Entry> = BinaryHeap::with_capacity(n + 1);
    let mut worst = f32::NEG_INFINITY;
    const CHUNK: usize = 64;
    for (ci, chunk) in values.chunks(CHUNK).enumerate() {
        // A later id never beats an equal value, so only strictly larger values matter.
        if heap.len() == n {
            let m = chunk_max(chunk, &map);
            if m <= worst {
                note(m);
                continue;
            }
        }
        for (j, &v) in chunk.iter().enumerate() {
            let v = map(v);
            let i = (ci * CHUNK + j) as u32;
            if heap.len() < n {
                heap.push(Entry { v, i });
            } else if v > worst {
                if let Some(mut top) = heap.peek_mut() {
                    note(top.v);
                    *top = Entry { v, i };
                }
            } else {
                note(v);
                continue;
            }
            if heap.len() == n {
                worst = heap.peek().map_or(f32::NEG_INFINITY, |e| e.v);
            }
        }
    }
    (heap.into_sorted_vec(), rest)
}

/// Per-thread buffers, reused across the rows one worker handles.
#[derive(Default)]
struct Scratch {
    w: Vec<f32>,
    e: Vec<f32>,
    output_sorted: Vec<u32>,
    prompt_sorted: Vec<u32>,
    hist_mass: Vec<f64>,
    hist_count: Vec<u32>,
}

struct RowInput<'a> {
    logits: &'a [f32],
    params: &'a SamplingParams,
    prompt: &'a [i32],
    output: &'a [i32],
}

/// Maximum of the raw, sanitised logits.
struct RawStats {
    max: f32,
}

/// The set a row draws from.
enum Kept {
    /// Exactly one token (greedy, or nothing finite survived).
    One(usize),
    /// An explicit list, best tempered logit first (top-k path).
    List(Vec<usize>),
    /// Every token with a finite `w` and `exp(w - w_max) >= min_e`.
    Threshold { min_e: f32 },
}

/// A row after penalties, temperature and filtering; `w` lives in the scratch.
struct Plan {
    kept: Kept,
    w_max: f32,
    /// Index of the largest `w` (lowest id on ties); always kept.
    w_argmax: usize,
}

#[inline(always)]
fn raw_stats(x: &[f32]) -> RawStats {
    RawStats {
        max: sanitize(row_max(x)),
    }
}

/// Writes `z / temperature` into `s.w`, where `z` is the penalised logit.
#[inline(always)]
fn tempered_logits(row: &RowInput<'_>, temperature: f32, s: &mut Scratch) {
    let x = row.logits;
    s.w.clear();
    s.w.extend(x.iter().map(|&v| (sanitize(v) / temperature).min(f32::MAX)));
    let p = row.params;
    if !p.has_penalties() || (row.prompt.is_empty() && row.output.is_empty()) {
        return;
    }
    s.output_sorted.clear();
    s.output_sorted.extend(row.output.iter().map(|&t| t as u32));
    s.output_sorted.sort_unstable();
    s.prompt_sorted.clear();
    s.prompt_sorted.extend(row.prompt.iter().map(|&t| t as u32));
    s.prompt_sorted.sort_unstable();
    s.prompt_sorted.dedup();
    let repetition = |z: f32| {
        if z > 0.0 {
            z / p.repetition_penalty
        } else {
            z * p.repetition_penalty
        }
    };
    // Each distinct output token: repetition, then frequency × count, then presence.
    let out = &s.output_sorted;
    let mut k = 0;
    while k < out.len() {
        let t = out[k];
        let mut end = k + 1;
        while end < out.len() && out[end] == t {
            end += 1;
        }
        let mut z = repetition(sanitize(x[t as usize]));
        z -= p.frequency_penalty * (end - k) as f32;
        z -= p.presence_penalty;
        s.w[t as usize] = (z / temperature).min(f32::MAX);
        k = end;
    }
    // Prompt-only tokens: repetition only.
    if p.repetition_penalty != 1.0 {
        for &t in &s.prompt_sorted {
            if out.binary_search(&t).is_err() {
                let z = repetition(sanitize(x[t as usize]));
                s.w[t as usize] = (z / temperature).min(f32::MAX);
            }
        }
    }
}

/// Penalties, greedy, temperature and the min_p / top-k / top-p filters.
#[inline(always)]
fn plan_row(row: &RowInput<'_>, raw: &RawStats, s: &mut Scratch) -> Plan {
    let p = row.params;
    let vocab = row.logits.len();
    let penalised = p.has_penalties() && !(row.prompt.is_empty() && row.output.is_empty());
    let raw_argmax = || first_index_of(row.logits, raw.max);
    if p.is_greedy() && !penalised {
        let i = raw_argmax();
        return Plan {
            kept: Kept::One(i),
            w_max: raw.max,
            w_argmax: i,
        };
    }
    let temperature = if p.is_greedy() { 1.0 } else { p.temperature };
    tempered_logits(row, temperature, s);
    let w_max = row_max(&s.w);
    let one = |i| Plan {
        kept: Kept::One(i),
        w_max,
        w_argmax: i,
    };
    if w_max == f32::NEG_INFINITY {
        return one(raw_argmax());
    }
    if p.is_greedy() {
        return one(first_index_of(&s.w, w_max));
    }
    let min_p = if p.min_p > 0.0 { p.min_p } else { 0.0 };
    let top_p = (p.top_p < 1.0).then_some(p.top_p as f64);
    if let Some(k) = p.top_k_active(vocab) {
        let list = top_k_candidates(&s.w, w_max, k, min_p, top_p);
        return match list.first() {
            // The largest `w` (lowest id on ties) comes first and is always kept.
            Some(&w_argmax) => Plan {
                kept: Kept::List(list),
                w_max,
                w_argmax,
            },
            None => one(first_index_of(&s.w, w_max)),
        };
    }
    let min_e = match top_p {
        Some(top_p) => top_p_threshold(w_max, min_p, top_p, s).max(min_p),
        None => min_p,
    };
    Plan {
        kept: Kept::Threshold { min_e },
        w_max,
        w_argmax: first_index_of(&s.w, w_max),
    }
}

/// Top-k (ties kept), then min_p and top-p on the small candidate list; best first.
#[inline(always)]
fn top_k_candidates(w: &[f32], w_max: f32, k: usize, min_p: f32, top_p: Option<f64>) -> Vec<usize> {
    let (best, rest) = top_n_with_rest(w, k, |v| v);
    let kth = best.last().map_or(f32::NEG_INFINITY, |e| e.v);
    let mut cand = if rest == kth {
        let mut all: Vec<Entry> = w
            .iter()
            .enumerate()
            .filter(|(_, &v)| v >= kth)
            .map(|(i, &v)| Entry { v, i: i as u32 })
            .collect();
        all.sort_unstable();
        all
    } else {
        best
    };
    cand.retain(|e| e.v > f32::NEG_INFINITY && fast_exp(e.v - w_max) >= min_p);
    if let Some(top_p) = top_p {
        let es: Vec<f32> = cand.iter().map(|e| fast_exp(e.v - w_max)).collect();
        let total: f64 = es.iter().map(|&e| e as f64).sum();
        let target = top_p * total;
        let mut cum = 0.0f64;
        if let Some(cut) = es.iter().position(|&e| {
            cum += e as f64;
            cum >= target
        }) {
            let boundary = es[cut];
            let keep = es.iter().take_while(|&&e| e >= boundary).count();
            cand.truncate(keep.max(1));
        }
    }
    cand.iter().map(|e| e.i as usize).collect()
}

/// The smallest `e` kept by top-p over the tokens with `e >= floor` (and
/// `e > 0`), `e = exp(w - w_max)`: a radix selection on the bit patterns of
/// `e` (positive floats order like their bits), narrowing to one bucket of a
/// mass histogram per level and sorting only a small final bucket.
#[inline(always)]
fn top_p_threshold(w_max: f32, floor: f32, top_p: f64, s: &mut Scratch) -> f32 {
    let eligible = |e: f32| e > 0.0 && e >= floor;
    map_into(&mut s.e, &s.w, |v| fast_exp(v - w_max));
    let mut total = 0.0f64;
    for block in s.e.chunks(1024) {
        let mut acc = [0.0f32; 16];
        let lanes = block.chunks_exact(16);
        let tail = lanes.remainder();
        for c in lanes {
            for (a, &e) in acc.iter_mut().zip(c) {
                *a += if eligible(e) { e } else { 0.0 };
            }
        }
        total += acc.iter().map(|&a| a as f64).sum::<f64>();
        total += tail
            .iter()
            .filter(|&&e| eligible(e))
            .map(|&e| e as f64)
            .sum::<f64>();
    }
    let target = top_p * total;
    // The tokens below `low` hold less than half of the mass top-p drops
    // (fewer than `len` tokens of less than `low` each), so the kept set,
    // whose mass reaches the target, takes none of them; the selection
    // looks at the others only (a tenth of a random row, fewer of a trained
    // model's peaked logits), moved to the front without a branch. Which
    // tokens hold the values it looks at does not change the threshold.
    let low = ((1.0 - top_p) * total * 0.5 / s.e.len().max(1) as f64) as f32;
    keep_where(&mut s.e, |v| eligible(v) & (v >= low));
    let mut above = 0.0f64; // mass of the tokens in buckets above the current range
    let (mut lo, mut hi) = (0u32, 1.0f32.to_bits());
    for shift in [20u32, 10, 0] {
        let buckets = ((hi - lo) >> shift) as usize + 1;
        // Every value left is eligible. One outside the range (which only
        // the first level's can hold) goes to a spare last bucket, so the
        // loop has no branch to mispredict.
        s.hist_mass.clear();
        s.hist_mass.resize(buckets + 1, 0.0);
        s.hist_count.clear();
        s.hist_count.resize(buckets + 1, 0);
        for &e in &s.e {
            let b = e.to_bits();
            let k = if (b >= lo) & (b <= hi) {
                (b.wrapping_sub(lo) >> shift) as usize
            } else {
                buckets
            };
            s.hist_mass[k] += e as f64;
            s.hist_count[k] += 1;
        }
        let mut chosen = None;
        let mut lowest = None;
        for k in (0..buckets).rev() {
            if s.hist_count[k] == 0 {
                continue;
            }
            lowest = Some(k);
            if above + s.hist_mass[k] >= target {
                chosen = Some(k);
                break;
            }
            above += s.hist_mass[k];
        }
        // Rounding can leave the target just out of reach: keep everything then.
        let k = match (chosen, lowest) {
            (Some(k), _) => k,
            (None, Some(k)) => {
                above -= s.hist_mass[k];
                k
            }
            (None, None) => return floor,
        };
        let new_lo = lo + ((k as u32) << shift);
        let new_hi = if shift == 0 {
            new_lo
        } else {
            (new_lo + ((1u32 << shift) - 1)).min(hi)
        };
        // The next level (or the final sort) looks at the chosen bucket's
        // values only.
        keep_where(&mut s.e, |v| (new_lo..=new_hi).contains(&v.to_bits()));
        if shift == 0 || s.e.len() <= TOP_P_SORT_LIMIT {
            // Largest first; which token holds a value does not matter.
            s.e.sort_unstable_by(|a, b| b.total_cmp(a));
            let mut cum = above;
            for &v in &s.e {
                cum += v as f64;
                if cum >= target {
                    return v;
                }
            }
            return s.e.last().copied().unwrap_or(floor);
        }
        lo = new_lo;
        hi = new_hi;
    }
    floor
}

/// Exponential race over `candidates` (plus `start`, which must be kept):
/// the kept token with the largest `w - ln E`, ties → lowest id. Tokens are
/// skipped without a logarithm when they provably cannot win: `w` more than
/// `PRUNE_GAP` below the best key, or `1 - u` (a lower bound of `E = -ln u`)
/// already above `exp(w - best)` with a safety margin.
#[inline(always)]
fn race(
    w: &[f32],
    w_max: f32,
    start: usize,
    key: u64,
    min_e: f32,
    candidates: impl Iterator<Item = usize>,
) -> usize {
    let mut r = Race::new(w, w_max, start, key, min_e);
    for i in candidates {
        r.offer(i);
    }
    r.best_idx
}

/// The race over every token (the min_p / top-p threshold plans). Each chunk
/// of tokens first takes the cheap tests of [`Race::offer`] against the best
/// key at the chunk's start, in a branch-free loop that the path's vectors
/// run (the hash, the `exp` and the comparisons of 8-16 tokens at once); the
/// few tokens that pass are offered in order. Within a chunk the best key
/// only grows, so its floor only rises and `scale` only shrinks: a token the
/// chunk's tests skip, `offer` would skip too, and the winner is the one
/// [`race`] finds. (The scalar loop took about 1 ms for a 152k vocabulary.)
#[inline(always)]
fn race_all(w: &[f32], w_max: f32, start: usize, key: u64, min_e: f32) -> usize {
    const CHUNK: usize = 64;
    let mut r = Race::new(w, w_max, start, key, min_e);
    let mut pass = [false; CHUNK];
    for (c, chunk) in w.chunks(CHUNK).enumerate() {
        let base = c * CHUNK;
        let (floor, scale) = (r.best - PRUNE_GAP, r.scale);
        for (j, (p, &wi)) in pass.iter_mut().zip(chunk).enumerate() {
            let e = fast_exp(wi - w_max);
            let u = unit(key, (base + j) as u32);
            // No NaN reaches here (`w` is sanitised), so these are the
            // negations of `offer`'s skips.
            *p = (wi as f64 >= floor) & (e >= min_e) & (1.0 - u <= e as f64 * scale);
        }
        let pass = &pass[..chunk.len()];
        if !pass.iter().fold(false, |a, &p| a | p) {
            continue;
        }
        for (j, _) in pass.iter().enumerate().filter(|(_, &p)| p) {
            r.offer(base + j);
        }
    }
    r.best_idx
}

/// The state of an exponential race: the best key so far and its token.
struct Race<'a> {
    w: &'a [f32],
    w_max: f32,
    key: u64,
    min_e: f32,
    start: usize,
    best_idx: usize,
    best: f64,
    /// `exp(w_max - best)` with the safety margin: the cheap test's bound.
    scale: f64,
}

impl<'a> Race<'a> {
    #[inline(always)]
    fn new(w: &'a [f32], w_max: f32, start: usize, key: u64, min_e: f32) -> Self {
        let best = race_key(w[start], unit(key, start as u32));
        Race {
            w,
            w_max,
            key,
            min_e,
            start,
            best_idx: start,
            best,
            scale: (w_max as f64 - best).exp() * PRUNE_MARGIN,
        }
    }

    /// Token `i` enters the race (`start` is in it already).
    #[inline(always)]
    fn offer(&mut self, i: usize) {
        let wi = self.w[i];
        if (wi as f64) < self.best - PRUNE_GAP || i == self.start {
            return;
        }
        let e = fast_exp(wi - self.w_max);
        if e < self.min_e {
            return;
        }
        let u = unit(self.key, i as u32);
        if 1.0 - u > e as f64 * self.scale {
            return;
        }
        let k = race_key(wi, u);
        if k > self.best || (k == self.best && i < self.best_idx) {
            self.best = k;
            self.best_idx = i;
            self.scale = (self.w_max as f64 - k).exp() * PRUNE_MARGIN;
        }
    }
}

/// A token's raw log-probability (log_softmax of the unmodified, sanitised
/// row), its rank (1 + the tokens with a larger raw logit) and the row's
/// `top` largest raw log-probabilities, ties by lower id.
struct RawLogprobs {
    logprob: f32,
    rank: u32,
    top: Vec<(u32, f32)>,
}

/// [`RawLogprobs`] of `token` in the raw row `x` whose sanitised maximum is
/// `max`: the log-sum-exp in f64 over f32 lanes, as the sampler reports.
#[inline(always)]
fn raw_logprobs(x: &[f32], max: f32, token: usize, top: usize) -> RawLogprobs {
    let lse = if max == f32::NEG_INFINITY {
        f64::NEG_INFINITY
    } else {
        max as f64 + sum_exp(x, max).ln()
    };
    let logprob = |v: f32| {
        if lse == f64::NEG_INFINITY {
            f32::NEG_INFINITY
        } else {
            (v as f64 - lse) as f32
        }
    };
    let chosen = sanitize(x[token]);
    RawLogprobs {
        logprob: logprob(chosen),
        rank: 1 + x.iter().filter(|&&v| sanitize(v) > chosen).count() as u32,
        top: top_n(x, top, sanitize)
            .into_iter()
            .map(|e| (e.i, logprob(e.v)))
            .collect(),
    }
}

/// One prompt row's [`RawLogprobs`] as a kernel of the fastest SIMD path.
struct TokenRow<'a> {
    x: &'a [f32],
    token: usize,
    top: usize,
}

impl crate::cpu::simd::Kernel for TokenRow<'_> {
    type Output = RawLogprobs;
    #[inline(always)]
    fn run<S: crate::cpu::simd::Simd>(self) -> RawLogprobs {
        raw_logprobs(self.x, raw_stats(self.x).max, self.token, self.top)
    }
}

/// A prompt token's raw logprob, its rank and its row's top (id, logprob).
pub type TokenLogprob = (f32, u32, Vec<(u32, f32)>);

/// Prompt logprobs: for row `r` of `logits` (`tokens.len()` rows of `vocab`
/// raw logits, the row that predicts `tokens[r]`), the token's raw
/// log-probability and rank and the row's `top` largest raw
/// log-probabilities, computed exactly as [`sample_batch`] reports them for
/// a sampled token; rows in parallel.
pub fn token_logprobs(
    logits: &[f32],
    vocab: usize,
    tokens: &[i64],
    top: usize,
) -> CoreResult<Vec<TokenLogprob>> {
    if vocab == 0 || logits.len() != tokens.len() * vocab {
        return Err(CoreError::invalid(format!(
            "logits: expected {} rows (one per token) of a non-empty vocabulary, got {} values of rows of {vocab}",
            tokens.len(),
            logits.len()
        )));
    }
    if let Some((r, &t)) = tokens
        .iter()
        .enumerate()
        .find(|&(_, &t)| t < 0 || t as u64 >= vocab as u64)
    {
        return Err(CoreError::invalid(format!(
            "tokens: token {t} at row {r} is outside the vocabulary of {vocab}"
        )));
    }
    let row = |r: usize| {
        let x = &logits[r * vocab..(r + 1) * vocab];
        let op = TokenRow {
            x,
            token: tokens[r] as usize,
            top: top.min(vocab),
        };
        let out = crate::cpu::simd::dispatch(crate::cpu::best_path(), op);
        (out.logprob, out.rank, out.top)
    };
    if tokens.len() <= 1 {
        return Ok((0..tokens.len()).map(row).collect());
    }
    Ok(crate::cpu::threads::install(|| {
        (0..tokens.len()).into_par_iter().map(row).collect()
    }))
}

#[inline(always)]
fn sample_row(row: &RowInput<'_>, s: &mut Scratch) -> Sample {
    let x = row.logits;
    let p = row.params;
    let raw = raw_stats(x);
    let plan = plan_row(row, &raw, s);
    let key = row_key(p.seed, p.position);
    let token = match &plan.kept {
        Kept::One(i) => *i,
        Kept::List(list) => race(&s.w, plan.w_max, list[0], key, 0.0, list.iter().copied()),
        Kept::Threshold { min_e } => race_all(&s.w, plan.w_max, plan.w_argmax, key, *min_e),
    };
    if !p.sampled_logprob && p.num_logprobs == 0 {
        return Sample {
            token: token as u32,
            logprob: f32::NAN,
            rank: 0,
            top_logprobs: Vec::new(),
        };
    }
    let raw = raw_logprobs(x, raw.max, token, p.num_logprobs);
    Sample {
        token: token as u32,
        logprob: raw.logprob,
        rank: raw.rank,
        top_logprobs: raw.top,
    }
}

fn support_row(row: &RowInput<'_>, s: &mut Scratch) -> Vec<u32> {
    let raw = raw_stats(row.logits);
    let plan = plan_row(row, &raw, s);
    match plan.kept {
        Kept::One(i) => vec![i as u32],
        Kept::List(list) => {
            let mut ids: Vec<u32> = list.iter().map(|&i| i as u32).collect();
            ids.sort_unstable();
            ids
        }
        Kept::Threshold { min_e } => {
            s.w.iter()
                .enumerate()
                .filter(|(_, &v)| v > f32::NEG_INFINITY && fast_exp(v - plan.w_max) >= min_e)
                .map(|(i, _)| i as u32)
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch_of<'a>(
        logits: &'a [f32],
        params: &'a [SamplingParams],
        offsets: &'a [usize],
    ) -> Batch<'a> {
        Batch {
            logits,
            vocab: logits.len() / params.len(),
            params,
            prompt_tokens: &[],
            prompt_offsets: offsets,
            output_tokens: &[],
            output_offsets: offsets,
        }
    }

    /// The chunked race over every token picks the plain race's winner:
    /// rows longer and shorter than a chunk, spreads past the prune gap,
    /// -inf entries, exact ties, and min_p thresholds.
    #[test]
    fn race_over_every_token_matches_the_plain_race() {
        let mut rng = crate::cpu::elem::tests::Rng(17);
        for case in 0..400usize {
            let n = 1 + rng.below(300);
            let spread = [0.05f32, 2.0, 30.0, 90.0][case % 4];
            let mut w: Vec<f32> = (0..n).map(|_| rng.f32() * spread).collect();
            for _ in 0..n / 9 {
                w[rng.below(n)] = f32::NEG_INFINITY;
            }
            for _ in 0..n / 7 {
                let i = rng.below(n);
                w[i] = w[(i + 1) % n];
            }
            let w_max = row_max(&w);
            if w_max == f32::NEG_INFINITY {
                continue;
            }
            let start = first_index_of(&w, w_max);
            let key = row_key(case as u64, rng.below(1000) as u64);
            let min_e = [0.0f32, 1e-3, 0.3][(case / 4) % 3];
            assert_eq!(
                race_all(&w, w_max, start, key, min_e),
                race(&w, w_max, start, key, min_e, 0..n),
                "case {case}: n {n}, spread {spread}, min_e {min_e}"
            );
        }
    }

    #[test]
    fn uniform_is_in_open_interval_and_matches_the_documented_hash() {
        let g = 0x9E37_79B9_7F4A_7C15u64;
        let m = |mut z: u64| {
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        for seed in [0u64, 1, 42, u64::MAX] {
            for pos in [0u64, 7, 1 << 40] {
                for tok in [0u32, 1, 151_935] {
                    let u = uniform(seed, pos, tok);
                    assert!(u > 0.0 && u < 1.0);
                    let rk = m(m(seed.wrapping_add(g)).wrapping_add((pos + 1).wrapping_mul(g)));
                    let h = m(rk.wrapping_add((tok as u64 + 1).wrapping_mul(g)));
                    assert_eq!(u, ((h >> 12) as f64 + 0.5) / (1u64 << 52) as f64);
                }
            }
        }
        // splitmix64's published first output for state 0.
        assert_eq!(mix64(GOLDEN), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn uniform_mean_and_spread_look_uniform() {
        let n = 200_000u32;
        let (mut sum, mut sum_sq, mut low) = (0.0, 0.0, 0u32);
        for t in 0..n {
            let u = uniform(3, 5, t);
            sum += u;
            sum_sq += u * u;
            low += (u < 0.1) as u32;
        }
        let mean = sum / n as f64;
        let var = sum_sq / n as f64 - mean * mean;
        assert!((mean - 0.5).abs() < 0.003, "mean {mean}");
        assert!((var - 1.0 / 12.0).abs() < 0.002, "var {var}");
        assert!((low as f64 / n as f64 - 0.1).abs() < 0.003);
        assert_ne!(uniform(3, 5, 0), uniform(4, 5, 0));
        assert_ne!(uniform(3, 5, 0), uniform(3, 6, 0));
    }

    #[test]
    fn fast_exp_is_accurate() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = fast_exp(x) as f64;
            assert!(
                ((got - want) / want).abs() < 5e-7,
                "x={x} got={got} want={want}"
            );
            x += 0.013;
        }
        assert_eq!(fast_exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(fast_exp(-100.0), 0.0);
        assert_eq!(fast_exp(0.0), 1.0);
    }

    #[test]
    fn top_n_orders_by_value_then_id() {
        let v = [1.0, 3.0, 2.0, 3.0, f32::NAN, 0.5];
        let got: Vec<(u32, f32)> = top_n(&v, 3, sanitize).iter().map(|e| (e.i, e.v)).collect();
        assert_eq!(got, vec![(1, 3.0), (3, 3.0), (2, 2.0)]);
        let long: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32).collect();
        for n in [1, 5, 64, 300] {
            let got: Vec<u32> = top_n(&long, n, |v| v).iter().map(|e| e.i).collect();
            let mut want: Vec<(i64, u32)> = long
                .iter()
                .enumerate()
                .map(|(i, &v)| (-(v as i64), i as u32))
                .collect();
            want.sort();
            assert_eq!(got, want[..n].iter().map(|p| p.1).collect::<Vec<_>>());
            let (_, rest) = top_n_with_rest(&long, n, |v| v);
            assert_eq!(rest, -(want[n].0 as f32));
        }
    }

    #[test]
    fn penalties_follow_the_documented_math() {
        let logits = [2.0f32, -1.0, 0.5, 3.0, -2.0];
        let params = [SamplingParams {
            temperature: 0.0,
            repetition_penalty: 2.0,
            frequency_penalty: 0.25,
            presence_penalty: 0.5,
            ..Default::default()
        }];
        let batch = Batch {
            logits: &logits,
            vocab: 5,
            params: &params,
            prompt_tokens: &[0, 1],
            prompt_offsets: &[0, 2],
            output_tokens: &[3, 3, 4],
            output_offsets: &[0, 3],
        };
        let mut s = Scratch::default();
        tempered_logits(&batch.row(0), 1.0, &mut s);
        // 0: prompt, positive → /2; 1: prompt, negative → ×2; 2: untouched;
        // 3: output ×2: 3/2 - 0.25·2 - 0.5; 4: output ×1: -2·2 - 0.25 - 0.5.
        assert_eq!(s.w, vec![1.0, -2.0, 0.5, 0.5, -4.75]);
        assert_eq!(sample_batch(&batch).unwrap()[0].token, 0);
    }

    #[test]
    fn filters_keep_the_expected_sets() {
        // Temperature 1: e = exp(w).
        let logits = [0.0f32, -0.1, -1.0, -2.0, -5.0, f32::NEG_INFINITY, -0.1];
        let support = |p: SamplingParams| {
            let params = [p];
            support_batch(&batch_of(&logits, &params, &[0, 0]))
                .unwrap()
                .remove(0)
        };
        let base = SamplingParams::default();
        assert_eq!(support(base), vec![0, 1, 2, 3, 4, 6]);
        assert_eq!(support(SamplingParams { top_k: 1, ..base }), vec![0]);
        // Ties at the k-th value are kept.
        assert_eq!(support(SamplingParams { top_k: 2, ..base }), vec![0, 1, 6]);
        // min_p 0.3: keep exp(w) >= 0.3, i.e. w >= -1.204.
        assert_eq!(
            support(SamplingParams { min_p: 0.3, ..base }),
            vec![0, 1, 2, 6]
        );
        // top_p: masses 1, .905, .905, .368, .135, .0067 (Z = 3.320).
        assert_eq!(support(SamplingParams { top_p: 0.2, ..base }), vec![0]);
        assert_eq!(
            support(SamplingParams { top_p: 0.4, ..base }),
            vec![0, 1, 6]
        );
        assert_eq!(
            support(SamplingParams { top_p: 0.9, ..base }),
            vec![0, 1, 2, 6]
        );
        assert_eq!(
            support(SamplingParams {
                top_p: 0.99,
                top_k: 3,
                ..base
            }),
            vec![0, 1, 6]
        );
        assert_eq!(
            support(SamplingParams {
                temperature: 0.0,
                ..base
            }),
            vec![0]
        );
    }

    #[test]
    fn seeded_rows_do_not_depend_on_the_batch() {
        let vocab = 1000;
        let rows = 16;
        let logits: Vec<f32> = (0..rows * vocab)
            .map(|i| ((i * 7919) % 1013) as f32 / 100.0)
            .collect();
        let params: Vec<SamplingParams> = (0..rows)
            .map(|r| SamplingParams {
                temperature: 0.7,
                top_p: if r % 2 == 0 { 0.9 } else { 1.0 },
                top_k: if r % 3 == 0 { 40 } else { 0 },
                seed: r as u64 * 11,
                position: 3,
                ..Default::default()
            })
            .collect();
        let offsets = vec![0; rows + 1];
        let all = sample_batch(&Batch {
            logits: &logits,
            vocab,
            params: &params,
            prompt_tokens: &[],
            prompt_offsets: &offsets,
            output_tokens: &[],
            output_offsets: &offsets,
        })
        .unwrap();
        for r in 0..rows {
            let one = sample_batch(&batch_of(
                &logits[r * vocab..(r + 1) * vocab],
                &params[r..r + 1],
                &[0, 0],
            ));
            assert_eq!(one.unwrap()[0], all[r]);
        }
    }

    #[test]
    fn race_matches_a_plain_argmax_of_keys() {
        let vocab = 3000;
        let logits: Vec<f32> = (0..vocab)
            .map(|i| ((i * 104_729) % 2003) as f32 / 200.0)
            .collect();
        for seed in 0..50u64 {
            for (top_p, min_p, top_k) in [
                (1.0, 0.0, 0),
                (0.8, 0.0, 0),
                (1.0, 0.05, 0),
                (0.9, 0.0, 100),
            ] {
                let params = [SamplingParams {
                    seed,
                    top_p,
                    min_p,
                    top_k,
                    position: 9,
                    ..Default::default()
                }];
                let batch = batch_of(&logits, &params, &[0, 0]);
                let got = sample_batch(&batch).unwrap()[0].token;
                let kept = support_batch(&batch).unwrap().remove(0);
                let want = kept
                    .iter()
                    .map(|&i| (race_key(logits[i as usize], uniform(seed, 9, i)), i))
                    .fold((f64::NEG_INFINITY, 0), |b, c| if c.0 > b.0 { c } else { b })
                    .1;
                assert_eq!(got, want);
            }
        }
    }

    #[test]
    fn nan_and_all_masked_rows_do_not_crash() {
        let params = [SamplingParams {
            top_p: 0.5,
            top_k: 2,
            min_p: 0.1,
            num_logprobs: 2,
            ..Default::default()
        }];
        let logits = [f32::NAN, f32::NEG_INFINITY, f32::NAN];
        let out = sample_batch(&batch_of(&logits, &params, &[0, 0])).unwrap();
        assert_eq!((out[0].token, out[0].rank), (0, 1));
        let logits = [f32::NAN, 1.0, f32::INFINITY];
        let out = sample_batch(&batch_of(&logits, &params, &[0, 0])).unwrap();
        assert_eq!(out[0].token, 2);
    }

    #[test]
    fn invalid_arguments_name_the_argument() {
        let logits = [0.0f32; 4];
        let err = |p: SamplingParams| {
            let params = [p];
            sample_batch(&batch_of(&logits, &params, &[0, 0]))
                .unwrap_err()
                .to_string()
        };
        let d = SamplingParams::default();
        assert!(err(SamplingParams {
            temperature: -1.0,
            ..d
        })
        .starts_with("temperature[0]"));
        assert!(err(SamplingParams { top_p: 0.0, ..d }).starts_with("top_p[0]"));
        assert!(err(SamplingParams {
            min_p: f32::NAN,
            ..d
        })
        .starts_with("min_p[0]"));
        assert!(err(SamplingParams {
            repetition_penalty: 0.0,
            ..d
        })
        .starts_with("repetition_penalty[0]"));
        let params = [d];
        let mut b = batch_of(&logits, &params, &[0, 0]);
        b.output_tokens = &[9];
        b.output_offsets = &[0, 1];
        assert!(sample_batch(&b)
            .unwrap_err()
            .to_string()
            .starts_with("output_tokens[0]"));
        b.output_offsets = &[0, 2];
        assert!(sample_batch(&b)
            .unwrap_err()
            .to_string()
            .starts_with("output_offsets"));
        b.output_offsets = &[0];
        assert!(sample_batch(&b)
            .unwrap_err()
            .to_string()
            .starts_with("output_offsets"));
    }
}

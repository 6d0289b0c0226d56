//! Bidirectional attention of an encoder's packed batch, with no KV cache.
//!
//! The inputs of a batch are packed one after another (`[num_tokens, ...]`,
//! no padding), and every token of an input sees every token of the same
//! input (or those within a band of positions: ModernBERT's local layers).
//! The keys and values are laid out once per call as a private paged cache
//! (each input in consecutive blocks), and the paged kernel's tiled body
//! runs over it with a bidirectional mask: one flash-attention loop for
//! decoders and encoders, and a copy of the keys and values that costs
//! `2 * num_tokens * num_kv_heads * head_size` element moves against
//! `4 * num_tokens * length * num_heads * head_size` flops of attention.

use super::kernel::TILE;
use super::{plan_items, run_items, CacheShape, KvElem, Mask, Plan, Problem, SeqInfo};
use crate::cpu::{Element, Path};
use crate::error::{CoreError, CoreResult};
use std::cell::RefCell;
use std::sync::Mutex;

/// Token slots per block of the private cache: a multiple of the kernel's
/// 16-key tile.
const BLOCK: usize = 64;

/// Rows of one tensor of an encoder layer: row `t` is
/// `data[t * stride..][..width]` (a view of a fused projection's output
/// has a stride wider than its rows).
#[derive(Clone, Copy, Debug)]
pub struct StridedRows<'a, T> {
    pub data: &'a [T],
    pub stride: usize,
}

impl<T> StridedRows<'_, T> {
    /// Fails unless `rows` rows of `width` elements fit (`name` in the error).
    fn check(&self, name: &str, rows: usize, width: usize) -> CoreResult<()> {
        let need = if rows == 0 {
            0
        } else {
            (rows - 1) * self.stride + width
        };
        if (rows > 1 && self.stride < width) || self.data.len() < need {
            return Err(CoreError::invalid(format!(
                "{name}: expected {rows} rows of {width} elements {} apart, got {} elements",
                self.stride,
                self.data.len()
            )));
        }
        Ok(())
    }

    fn row(&self, t: usize, width: usize) -> &[T] {
        &self.data[t * self.stride..][..width]
    }
}

/// Bidirectional attention of packed inputs, written into `out`
/// (`[num_tokens, num_heads, head_size]`, packed).
///
/// `query` rows hold `num_heads * head_size` elements, `key` and `value`
/// rows `num_kv_heads * head_size` (query head `h` reads KV head
/// `h / (num_heads / num_kv_heads)`); `lengths` are the inputs' token
/// counts in order (their sum is `num_tokens`). `band > 0` lets a token see
/// only keys at most `band` positions away; 0 lets it see its whole input.
/// `scale` multiplies the scores.
#[allow(clippy::too_many_arguments)]
pub fn encoder_attention<T: Element>(
    out: &mut [T],
    query: StridedRows<'_, T>,
    key: StridedRows<'_, T>,
    value: StridedRows<'_, T>,
    (num_heads, num_kv_heads, head_size): (usize, usize, usize),
    lengths: &[usize],
    scale: f32,
    band: usize,
) -> CoreResult<()>
where
    f32: KvElem<T>,
{
    encoder_attention_with(
        out,
        (query, key, value),
        (num_heads, num_kv_heads, head_size),
        lengths,
        (scale, band),
        Plan::production(),
        crate::cpu::best_path(),
    )
}

pub(super) fn encoder_attention_with<T: Element>(
    out: &mut [T],
    (query, key, value): (StridedRows<'_, T>, StridedRows<'_, T>, StridedRows<'_, T>),
    (num_heads, num_kv_heads, d): (usize, usize, usize),
    lengths: &[usize],
    (scale, band): (f32, usize),
    plan: Plan,
    path: Path,
) -> CoreResult<()>
where
    f32: KvElem<T>,
{
    if num_kv_heads == 0 || d == 0 || !num_heads.is_multiple_of(num_kv_heads) {
        return Err(CoreError::invalid(format!(
            "query: num_heads ({num_heads}) must be a positive multiple of num_kv_heads \
             ({num_kv_heads}), and head_size ({d}) positive"
        )));
    }
    if !scale.is_finite() {
        return Err(CoreError::invalid(format!(
            "scale: must be finite, got {scale}"
        )));
    }
    let num_tokens: usize = lengths.iter().sum();
    let (qw, kw) = (num_heads * d, num_kv_heads * d);
    if out.len() != num_tokens * qw {
        return Err(CoreError::invalid(format!(
            "out: expected {num_tokens} tokens (the sum of lengths) x {num_heads} heads x {d} \
             elements, got {}",
            out.len()
        )));
    }
    query.check("query", num_tokens, qw)?;
    key.check("key", num_tokens, kw)?;
    value.check("value", num_tokens, kw)?;
    if num_tokens == 0 {
        return Ok(());
    }

    // The private cache, f32 whatever `T` is (widened once here, not once
    // per item): input `i` in consecutive blocks; keys as transposed tiles
    // of `TILE` keys, values as rows.
    let num_blocks: usize = lengths.iter().map(|l| l.div_ceil(BLOCK)).sum();
    let shape = CacheShape {
        num_blocks,
        num_kv_heads,
        block_size: BLOCK,
        head_size: d,
    };
    let max_blocks = lengths.iter().map(|l| l.div_ceil(BLOCK)).max().unwrap_or(0);
    let mut tables = vec![0i32; lengths.len() * max_blocks];
    // (first token, tokens) of each block.
    let mut blocks = Vec::with_capacity(num_blocks);
    let mut seqs = Vec::with_capacity(lengths.len());
    let mut token = 0usize;
    for (i, &len) in lengths.iter().enumerate() {
        for j in 0..len.div_ceil(BLOCK) {
            tables[i * max_blocks + j] = blocks.len() as i32;
            blocks.push((token + j * BLOCK, (len - j * BLOCK).min(BLOCK)));
        }
        seqs.push(SeqInfo {
            seq: i,
            q_start: token,
            q_len: len,
            seq_len: len,
        });
        token += len;
    }
    SCRATCH.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        let (key_cache, value_cache) = &mut *scratch;
        // Reused between calls (one per layer): no fresh pages to fault in
        // and clear. Past a block's last key, a key tile holds whatever an
        // earlier call left there (finite, or the zeros of its growth): the
        // kernel masks those lanes and reads no value row past the last.
        key_cache.resize(key_cache.len().max(shape.numel()), 0.0);
        value_cache.resize(value_cache.len().max(shape.numel()), 0.0);
        let per_block = num_kv_heads * BLOCK * d;
        let units: Vec<Mutex<(&mut [f32], &mut [f32])>> = key_cache
            .chunks_exact_mut(per_block)
            .zip(value_cache.chunks_exact_mut(per_block))
            .take(num_blocks)
            .map(Mutex::new)
            .collect();
        crate::cpu::threads::team_run(num_blocks, &|b| {
            let mut unit = units[b].lock().unwrap_or_else(|e| e.into_inner());
            let (kb, vb) = &mut *unit;
            let (first, n) = blocks[b];
            for off in 0..n {
                let (k, v) = (key.row(first + off, kw), value.row(first + off, kw));
                for h in 0..num_kv_heads {
                    let head = h * BLOCK * d;
                    let tile = head + off / TILE * TILE * d + off % TILE;
                    for (c, x) in k[h * d..(h + 1) * d].iter().enumerate() {
                        kb[tile + c * TILE] = x.to_f32();
                    }
                    let row = &mut vb[head + off * d..][..d];
                    for (o, x) in row.iter_mut().zip(&v[h * d..(h + 1) * d]) {
                        *o = x.to_f32();
                    }
                }
            }
        })?;
        drop(units);
        let group = num_heads / num_kv_heads;
        let mask = Mask {
            causal: false,
            window: band,
        };
        let items = plan_items(&seqs, shape, group, mask, plan);
        let problem = Problem {
            query: query.data,
            key_cache: &key_cache[..shape.numel()],
            value_cache: &value_cache[..shape.numel()],
            block_tables: &tables,
            max_blocks,
            shape,
            num_heads,
            group,
            query_stride: query.stride,
            scale,
            mask,
            keys_tiled: true,
            softcap: 0.0,
            sinks: None,
            path,
        };
        let result = run_items(&problem, &items, plan, out);
        if key_cache.len() > KEEP_ELEMENTS {
            // A very long batch: give its memory back rather than hold it.
            *key_cache = Vec::new();
            *value_cache = Vec::new();
        }
        result
    })
}

/// Elements of each private cache kept for the next call (64 MiB of f32):
/// a BERT-base layer of 21,000 tokens; longer batches free theirs.
const KEEP_ELEMENTS: usize = 16 << 20;

thread_local! {
    /// The private key and value caches of the last call on this thread.
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

#[cfg(test)]
mod tests {
    use super::super::{available_paths, plans};
    use super::*;
    use crate::cpu::elem::tests::Rng;
    use half::bf16;

    /// f64 attention of each input over its own tokens (within the band).
    #[allow(clippy::too_many_arguments)]
    fn reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        (qs, ks): (usize, usize),
        (h, kvh, d): (usize, usize, usize),
        lengths: &[usize],
        scale: f32,
        band: usize,
    ) -> Vec<f32> {
        let g = h / kvh;
        let total: usize = lengths.iter().sum();
        let mut out = vec![0.0f32; total * h * d];
        let mut first = 0;
        for &len in lengths {
            for i in 0..len {
                let seen: Vec<usize> = (0..len)
                    .filter(|&j| band == 0 || i.abs_diff(j) <= band)
                    .collect();
                for head in 0..h {
                    let qrow = &q[(first + i) * qs + head * d..][..d];
                    let kv = (head / g) * d;
                    let scores: Vec<f64> = seen
                        .iter()
                        .map(|&j| {
                            let krow = &k[(first + j) * ks + kv..][..d];
                            qrow.iter()
                                .zip(krow)
                                .map(|(&a, &b)| a as f64 * b as f64)
                                .sum::<f64>()
                                * scale as f64
                        })
                        .collect();
                    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                    let sum: f64 = w.iter().sum();
                    for c in 0..d {
                        let acc: f64 = seen
                            .iter()
                            .zip(&w)
                            .map(|(&j, wt)| wt * v[(first + j) * ks + kv + c] as f64)
                            .sum();
                        out[((first + i) * h + head) * d + c] = (acc / sum) as f32;
                    }
                }
            }
            first += len;
        }
        out
    }

    fn check<T: Element>(tol: f32)
    where
        f32: KvElem<T>,
    {
        let mut rng = Rng(11);
        // (heads, kv heads, head size, lengths, band)
        let cases: &[(usize, usize, usize, &[usize], usize)] = &[
            (4, 4, 64, &[1, 37, 130, 64], 0),
            (6, 2, 40, &[200, 3, 65], 0),
            (2, 1, 72, &[150, 17], 20),
            (3, 3, 16, &[129], 1),
        ];
        for &(h, kvh, d, lengths, band) in cases {
            let total: usize = lengths.iter().sum();
            // Strided rows, as views of a fused projection [T, (h + 2 kvh) d + 5].
            let stride = (h + 2 * kvh) * d + 5;
            let fused: Vec<f32> = (0..total * stride).map(|_| rng.f32() * 2.0).collect();
            let conv: Vec<T> = fused.iter().map(|&x| T::from_f32(x)).collect();
            let rounded: Vec<f32> = conv.iter().map(|x| x.to_f32()).collect();
            let (qo, ko, vo) = (0, h * d, (h + kvh) * d);
            let want = reference(
                &rounded[qo..],
                &rounded[ko..],
                &rounded[vo..],
                (stride, stride),
                (h, kvh, d),
                lengths,
                0.3,
                band,
            );
            for path in available_paths() {
                for plan in plans() {
                    let rows = |o: usize| StridedRows {
                        data: &conv[o..],
                        stride,
                    };
                    let mut out = vec![T::from_f32(f32::NAN); total * h * d];
                    encoder_attention_with(
                        &mut out,
                        (rows(qo), rows(ko), rows(vo)),
                        (h, kvh, d),
                        lengths,
                        (0.3, band),
                        plan,
                        path,
                    )
                    .unwrap();
                    for (i, (o, w)) in out.iter().zip(&want).enumerate() {
                        let o = o.to_f32();
                        assert!(
                            (o - w).abs() <= tol * (1.0 + w.abs()),
                            "{path:?} h={h} kvh={kvh} d={d} band={band} at {i}: {o} vs {w}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn matches_reference_f32() {
        check::<f32>(1e-5);
    }

    #[test]
    fn matches_reference_bf16() {
        check::<bf16>(1.6e-2);
    }

    #[test]
    fn bad_shapes_are_errors_naming_the_tensor() {
        let q = vec![0.0f32; 2 * 8];
        let rows = |stride| StridedRows { data: &q, stride };
        let mut out = vec![0.0f32; 16];
        let err = encoder_attention(&mut out, rows(8), rows(8), rows(8), (2, 2, 4), &[3], 1.0, 0)
            .unwrap_err();
        assert!(err.to_string().contains("out:"), "{err}");
        let err = encoder_attention(&mut out, rows(8), rows(8), rows(9), (2, 2, 4), &[2], 1.0, 0)
            .unwrap_err();
        assert!(err.to_string().contains("value:"), "{err}");
        let err = encoder_attention(&mut out, rows(8), rows(8), rows(8), (2, 3, 4), &[2], 1.0, 0)
            .unwrap_err();
        assert!(err.to_string().contains("num_kv_heads"), "{err}");
    }
}

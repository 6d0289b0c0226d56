//! CPU paged attention and the KV-cache write kernel.
//!
//! The KV cache of one layer is two tensors `[num_blocks, num_kv_heads,
//! block_size, head_size]` (keys and values), addressed through a block table
//! per sequence. New tokens of all sequences are packed into one batch; each
//! sequence's new tokens are the last `q_len` of its `seq_len` tokens and attend
//! causally to everything before them (optionally within a sliding window).
//!
//! Work is split into items of (sequence, KV head, chunk of query rows); all
//! query heads sharing a KV head are processed together so every key and value
//! row is loaded and widened to f32 once per item. When there are too few items
//! to keep the threads busy (batch-1 decode with a long context), an item's key
//! range is cut into partitions whose partial softmax states are merged.
//!
//! An item of many query vectors (a prefill chunk) runs the tiled body:
//! per tile of 16 keys, the keys are transposed once, the scores of 4-8
//! query vectors at a time come from broadcast-multiply-adds with no
//! horizontal sums, then the online softmax, then the weighted values of
//! 4-8 vectors at a time with their accumulators in registers (a
//! flash-attention loop: no score matrix beyond one tile, and a cost per
//! key that does not grow with the context). Items of few vectors (decode)
//! score each vector against the keys as stored (building the transposed
//! tile would cost more than it saves) and share the rest of the loop.
//! Caches hold the model's float type or 8-bit rows with a scale
//! (`rows.rs`), widened one block at a time.
//!
//! Both bodies (`kernel.rs`) are written once over `cpu::simd::Simd` and
//! compiled for AVX-512, AVX2+FMA and portable code, chosen at run time from
//! what the CPU reports (`cpu::features`).

mod encoder;
mod kernel;
mod rows;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use encoder::{encoder_attention, StridedRows};
pub use rows::{row_scale, KvElem, INT8_SCALE_BYTES};

use std::sync::Mutex;

pub use crate::cpu::Element;
use crate::cpu::{simd, Path};
use crate::error::{CoreError, CoreResult};

/// Shape of one paged cache tensor: `[num_blocks, num_kv_heads, block_size, head_size]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheShape {
    pub num_blocks: usize,
    pub num_kv_heads: usize,
    pub block_size: usize,
    pub head_size: usize,
}

impl CacheShape {
    /// Number of elements of one cache tensor.
    pub fn numel(&self) -> usize {
        self.numel_with(0)
    }

    /// Number of elements of one cache tensor whose rows carry `extra`
    /// elements after their `head_size` values (`KvElem::EXTRA`).
    pub fn numel_with(&self, extra: usize) -> usize {
        self.num_blocks * self.num_kv_heads * self.block_size * (self.head_size + extra)
    }

    /// Number of token slots (`num_blocks * block_size`).
    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }
}

/// One cache tensor of a layer, as a caller that holds either kind keeps
/// it: rows of the model's element type, or 8-bit rows with their scales
/// (`rows.rs`).
pub enum KvCacheMut<'a, T> {
    Float(&'a mut [T]),
    Int8(&'a mut [i8]),
}

/// `reshape_and_cache` then `paged_attention` on one layer's caches, of
/// either kind (both tensors of one kind); the other arguments as those
/// functions' (`softcap` 0: none; `sinks` None: none).
#[allow(clippy::too_many_arguments)]
pub fn cache_and_attend<T: Element>(
    out: &mut [T],
    query: &[T],
    key: &[T],
    value: &[T],
    key_cache: &mut KvCacheMut<'_, T>,
    value_cache: &mut KvCacheMut<'_, T>,
    slot_mapping: &[i64],
    shape: CacheShape,
    num_heads: usize,
    batch: BatchLayout<'_>,
    scale: f32,
    sliding_window: i64,
    softcap: f32,
    sinks: Option<&[f32]>,
) -> CoreResult<()> {
    type Args<'b> = (
        CacheShape,
        usize,
        BatchLayout<'b>,
        f32,
        i64,
        f32,
        Option<&'b [f32]>,
    );
    fn run<T: Element, C: KvElem<T>>(
        out: &mut [T],
        (query, key, value): (&[T], &[T], &[T]),
        kc: &mut [C],
        vc: &mut [C],
        slot_mapping: &[i64],
        (shape, num_heads, batch, scale, window, cap, sinks): Args<'_>,
    ) -> CoreResult<()> {
        reshape_and_cache(key, value, kc, vc, slot_mapping, shape)?;
        paged_attention(
            out, query, kc, vc, shape, num_heads, batch, scale, window, cap, sinks,
        )
    }
    let args = (
        shape,
        num_heads,
        batch,
        scale,
        sliding_window,
        softcap,
        sinks,
    );
    let qkv = (query, key, value);
    match (key_cache, value_cache) {
        (KvCacheMut::Float(k), KvCacheMut::Float(v)) => run(out, qkv, k, v, slot_mapping, args),
        (KvCacheMut::Int8(k), KvCacheMut::Int8(v)) => run(out, qkv, k, v, slot_mapping, args),
        _ => Err(CoreError::invalid(
            "key_cache/value_cache: both must be float caches or both 8-bit caches",
        )),
    }
}

/// Where a batch's sequences live in the cache and which query rows they own.
#[derive(Clone, Copy, Debug)]
pub struct BatchLayout<'a> {
    /// `[num_seqs, max_blocks_per_seq]`, row-major; padding past a sequence's blocks is ignored.
    pub block_tables: &'a [i32],
    pub max_blocks_per_seq: usize,
    /// `[num_seqs]`: context length of each sequence including its new tokens.
    pub seq_lens: &'a [i32],
    /// `[num_seqs + 1]`: sequence `i` owns query rows `query_start_loc[i]..query_start_loc[i + 1]`.
    pub query_start_loc: &'a [i32],
}

/// Stores `key[t]` / `value[t]` (`[num_tokens, num_kv_heads, head_size]`) into
/// cache slot `slot_mapping[t]`; a negative slot skips the token. An 8-bit
/// cache (`C = i8`) quantizes each row as it stores it (`rows.rs`).
pub fn reshape_and_cache<T: Element, C: KvElem<T>>(
    key: &[T],
    value: &[T],
    key_cache: &mut [C],
    value_cache: &mut [C],
    slot_mapping: &[i64],
    shape: CacheShape,
) -> CoreResult<()> {
    let row = shape.num_kv_heads * shape.head_size;
    let num_tokens = slot_mapping.len();
    if key.len() != num_tokens * row || value.len() != num_tokens * row {
        return Err(CoreError::invalid(format!(
            "key/value: expected {num_tokens} tokens x {} kv heads x {} head size elements, got {} and {}",
            shape.num_kv_heads,
            shape.head_size,
            key.len(),
            value.len()
        )));
    }
    check_cache_len(key_cache.len(), value_cache.len(), shape, C::EXTRA)?;
    let num_slots = shape.num_slots() as i64;
    // Validate every slot before writing anything, so a bad call leaves the cache untouched.
    for (t, &slot) in slot_mapping.iter().enumerate() {
        if slot >= num_slots {
            return Err(CoreError::invalid(format!(
                "slot_mapping: token {t} has slot {slot}, out of range for {} blocks of {} slots",
                shape.num_blocks, shape.block_size
            )));
        }
    }
    let d = shape.head_size;
    let stride = d + C::EXTRA;
    for (t, &slot) in slot_mapping.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        let (block, offset) = (
            slot as usize / shape.block_size,
            slot as usize % shape.block_size,
        );
        for h in 0..shape.num_kv_heads {
            let src = (t * shape.num_kv_heads + h) * d;
            let dst = ((block * shape.num_kv_heads + h) * shape.block_size + offset) * stride;
            C::store_row(&key[src..src + d], &mut key_cache[dst..dst + stride]);
            C::store_row(&value[src..src + d], &mut value_cache[dst..dst + stride]);
        }
    }
    Ok(())
}

/// Fails unless both cache tensors hold `shape` with rows of `head_size + extra` elements.
fn check_cache_len(k: usize, v: usize, shape: CacheShape, extra: usize) -> CoreResult<()> {
    let want = shape.numel_with(extra);
    if k != want || v != want {
        return Err(CoreError::invalid(format!(
            "key_cache/value_cache: expected {want} elements for shape {shape:?}{}, got {k} and {v}",
            if extra > 0 {
                format!(" with {extra} scale bytes per row")
            } else {
                String::new()
            }
        )));
    }
    Ok(())
}

/// How the work is cut into parallel items; fixed in production, varied by tests.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Plan {
    /// Target number of (query row x query head) pairs per item.
    rows_target: usize,
    /// Smallest key partition when an item's keys are split, as work: its
    /// query vectors x keys x head size (a partition is at least a block).
    min_partition_work: usize,
    /// Aim for at least this many tasks per thread.
    tasks_per_thread: usize,
    /// Thread count the split aims at.
    threads: usize,
}

impl Plan {
    fn production() -> Plan {
        Plan {
            rows_target: 32,
            // 128 keys for Gemma's 4 query heads of 256 a KV head, 292 for
            // Qwen2.5's 7 of 64: below that, a task's setup and the merge
            // cost more than the split saves (measured on decode).
            min_partition_work: 1 << 17,
            tasks_per_thread: 4,
            threads: crate::cpu::threads::num_threads(),
        }
    }
}

/// The SIMD paths attention runs on: the scalar code, AVX2 and AVX-512
/// (an AVX512-BF16 CPU runs the AVX-512 code).
#[cfg(test)]
fn available_paths() -> Vec<Path> {
    crate::cpu::available_paths()
        .into_iter()
        .filter(|p| p.simd() == *p)
        .collect()
}

/// The production plan, and one of many tiny partitions and single-row
/// chunks (to exercise the merge of partitions).
#[cfg(test)]
fn plans() -> Vec<Plan> {
    vec![
        Plan::production(),
        Plan {
            rows_target: 1,
            min_partition_work: 8,
            tasks_per_thread: 16,
            threads: 8,
        },
    ]
}

/// Attention of the packed new tokens over the paged cache, written into `out`.
///
/// `query` and `out` are `[num_tokens, num_heads, head_size]`; `scale`
/// multiplies the scores; `sliding_window > 0` restricts a query at position
/// `p` to keys in `(p - sliding_window, p]`; `softcap > 0` replaces each
/// scaled score `s` by `softcap * tanh(s / softcap)` (Gemma 2's attention
/// logit soft-capping), 0 leaves the scores as they are. `sinks`
/// (`[num_heads]`, gpt-oss's attention sinks) gives each query head one
/// more logit that joins the softmax denominator but has no value row:
/// with `m = max(max_j z_j, s_h)`, the weight of key `j` is
/// `e^(z_j - m) / (e^(s_h - m) + sum_j e^(z_j - m))`; an entry of `-inf`
/// is no sink for that head.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention<T: Element, C: KvElem<T>>(
    out: &mut [T],
    query: &[T],
    key_cache: &[C],
    value_cache: &[C],
    shape: CacheShape,
    num_heads: usize,
    batch: BatchLayout<'_>,
    scale: f32,
    sliding_window: i64,
    softcap: f32,
    sinks: Option<&[f32]>,
) -> CoreResult<()> {
    paged_attention_with(
        out,
        query,
        key_cache,
        value_cache,
        shape,
        num_heads,
        batch,
        scale,
        sliding_window,
        softcap,
        sinks,
        Plan::production(),
        crate::cpu::best_path(),
    )
}

/// One sequence's share of the batch, after validation.
#[derive(Clone, Copy, Debug)]
struct SeqInfo {
    seq: usize,
    q_start: usize,
    q_len: usize,
    seq_len: usize,
}

/// A unit of parallel work: query rows `row_lo..row_hi` of one sequence and the
/// query heads of one KV head, over keys `key_lo..key_hi` split into `parts`.
#[derive(Clone, Copy, Debug)]
struct Item {
    seq: SeqInfo,
    kv_head: usize,
    row_lo: usize,
    row_hi: usize,
    key_lo: usize,
    key_hi: usize,
    parts: usize,
}

/// Which keys a query row sees.
#[derive(Clone, Copy, Debug)]
struct Mask {
    /// Keys up to the row's own position (a decoder), or keys on both
    /// sides (an encoder).
    causal: bool,
    /// 0: no limit. Causal: the row's key and the `window - 1` before it
    /// (`sliding_window`). Bidirectional: keys at most `window` positions
    /// away on either side (an encoder's local attention band).
    window: usize,
}

impl Mask {
    /// The visible keys `[lo, hi)` of the row at position `pos` of a
    /// sequence of `seq_len` tokens.
    fn keys(self, pos: usize, seq_len: usize) -> (usize, usize) {
        match (self.causal, self.window) {
            (true, 0) => (0, pos + 1),
            (true, w) => ((pos + 1).saturating_sub(w), pos + 1),
            (false, 0) => (0, seq_len),
            (false, w) => (pos.saturating_sub(w), (pos + w + 1).min(seq_len)),
        }
    }
}

/// Fixed facts of one call, shared by every item.
struct Problem<'a, T, C> {
    query: &'a [T],
    key_cache: &'a [C],
    value_cache: &'a [C],
    block_tables: &'a [i32],
    max_blocks: usize,
    shape: CacheShape,
    num_heads: usize,
    group: usize,
    /// Elements from one token's query row to the next's (`num_heads *
    /// head_size` when the rows are packed).
    query_stride: usize,
    scale: f32,
    mask: Mask,
    /// The key cache holds f32 tiles of 16 keys transposed (`[head_size][16]`
    /// per tile, zeros past a block's last key; the block size a multiple
    /// of 16): the encoder's private cache. Otherwise keys are rows.
    keys_tiled: bool,
    /// Soft-cap of the scaled scores (0: none).
    softcap: f32,
    /// One sink logit per query head (`[num_heads]`), or none.
    sinks: Option<&'a [f32]>,
    path: Path,
}

impl<T, C> Problem<'_, T, C> {
    /// The sinks of an item's query heads (`[group]`), if any.
    fn item_sinks(&self, item: &Item) -> Option<&[f32]> {
        self.sinks
            .map(|s| &s[item.kv_head * self.group..(item.kv_head + 1) * self.group])
    }
}

/// The output pointer shared by the items; each (token, head) row is written
/// by exactly one item.
#[derive(Clone, Copy)]
struct OutPtr<T>(*mut T);
// SAFETY: items write disjoint rows of `out` (see `write_rows`), and the
// pointer does not outlive the `&mut [T]` it was made from.
unsafe impl<T: Send> Send for OutPtr<T> {}
unsafe impl<T: Send> Sync for OutPtr<T> {}

/// Multiply-adds (query rows x keys x head size) below which a call runs
/// single-threaded. The tasks run on the thread team, whose helpers are
/// still spinning from the linear layer before (a hand-out costs about a
/// microsecond); below this the work itself takes only a few.
const SERIAL_WORK: usize = 1 << 14;

#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_attention_with<T: Element, C: KvElem<T>>(
    out: &mut [T],
    query: &[T],
    key_cache: &[C],
    value_cache: &[C],
    shape: CacheShape,
    num_heads: usize,
    batch: BatchLayout<'_>,
    scale: f32,
    sliding_window: i64,
    softcap: f32,
    sinks: Option<&[f32]>,
    plan: Plan,
    path: Path,
) -> CoreResult<()> {
    if !(softcap.is_finite() && softcap >= 0.0) {
        return Err(CoreError::invalid(format!(
            "softcap: must be a finite number >= 0 (0: none), got {softcap}"
        )));
    }
    if let Some(sinks) = sinks {
        if sinks.len() != num_heads {
            return Err(CoreError::invalid(format!(
                "sinks: expected {num_heads} values (one per query head), got {}",
                sinks.len()
            )));
        }
        if let Some((h, v)) = sinks
            .iter()
            .enumerate()
            .find(|(_, v)| v.is_nan() || **v == f32::INFINITY)
        {
            return Err(CoreError::invalid(format!(
                "sinks: head {h} is {v}; each sink must be finite (or -inf: none)"
            )));
        }
    }
    check_cache_len(key_cache.len(), value_cache.len(), shape, C::EXTRA)?;
    let seqs = validate(out, query, shape, num_heads, batch)?;
    let d = shape.head_size;
    let group = num_heads / shape.num_kv_heads;
    let mask = Mask {
        causal: true,
        window: sliding_window.max(0) as usize,
    };
    let items = plan_items(&seqs, shape, group, mask, plan);
    if items.is_empty() || d == 0 {
        return Ok(());
    }
    let problem = Problem {
        query,
        key_cache,
        value_cache,
        block_tables: batch.block_tables,
        max_blocks: batch.max_blocks_per_seq,
        shape,
        num_heads,
        group,
        query_stride: num_heads * d,
        scale,
        mask,
        keys_tiled: false,
        softcap,
        sinks,
        path,
    };
    run_items(&problem, &items, plan, out)
}

/// Runs the items of a problem on the thread team and writes their rows
/// of `out` (`[num_tokens, num_heads, head_size]`, checked by the caller).
fn run_items<T: Element, C: KvElem<T>>(
    problem: &Problem<'_, T, C>,
    items: &[Item],
    plan: Plan,
    out: &mut [T],
) -> CoreResult<()> {
    let (shape, group) = (problem.shape, problem.group);
    let d = shape.head_size;
    let out_ptr = OutPtr(out.as_mut_ptr());
    // Tasks are (item, key range) pairs: an item whose keys are split into
    // partitions is one task per partition, merged once all have run.
    let tasks: Vec<(usize, usize, usize)> = items
        .iter()
        .enumerate()
        .flat_map(|(i, item)| {
            let bounds = if item.parts <= 1 {
                vec![(item.key_lo, item.key_hi)]
            } else {
                partition_bounds(item, shape.block_size)
            };
            bounds.into_iter().map(move |(lo, hi)| (i, lo, hi))
        })
        .collect();
    let run_task = |t: usize| -> Option<PartialState> {
        let (i, lo, hi) = tasks[t];
        let item = &items[i];
        let mut state = PartialState::new(item.rows(group), d);
        attend(problem, item, lo, hi, &mut state);
        if item.parts > 1 {
            return Some(state);
        }
        state.finish(problem.item_sinks(item));
        // SAFETY: this item owns its rows of `out` (validated shape), and
        // it is this item's only task.
        unsafe { write_rows(problem, item, &state, out_ptr) };
        None
    };
    // Small steps run on the calling thread: handing out the tasks costs
    // more than the work.
    let work: usize = items
        .iter()
        .map(|it| it.rows(group) * (it.key_hi - it.key_lo) * d)
        .sum();
    let partials: Vec<Option<PartialState>> =
        if work < SERIAL_WORK || plan.threads <= 1 || tasks.len() < 2 {
            (0..tasks.len()).map(run_task).collect()
        } else {
            let slots: Vec<Mutex<Option<PartialState>>> =
                tasks.iter().map(|_| Mutex::new(None)).collect();
            crate::cpu::threads::team_run(tasks.len(), &|t| {
                let state = run_task(t);
                *slots[t].lock().unwrap_or_else(|p| p.into_inner()) = state;
            })?;
            slots
                .into_iter()
                .map(|m| m.into_inner().unwrap_or_else(|p| p.into_inner()))
                .collect()
        };
    // Merge the partitions of each split item, in key order.
    let mut by_item: Vec<Vec<PartialState>> = items.iter().map(|_| Vec::new()).collect();
    for ((i, _, _), state) in tasks.iter().zip(partials) {
        if let Some(state) = state {
            by_item[*i].push(state);
        }
    }
    for (item, states) in items.iter().zip(by_item) {
        if item.parts > 1 {
            let merged = PartialState::merge(states, item.rows(group), d, problem.item_sinks(item));
            // SAFETY: as above; the item's tasks have all finished.
            unsafe { write_rows(problem, item, &merged, out_ptr) };
        }
    }
    Ok(())
}

fn validate<T>(
    out: &[T],
    query: &[T],
    shape: CacheShape,
    num_heads: usize,
    batch: BatchLayout<'_>,
) -> CoreResult<Vec<SeqInfo>> {
    if shape.num_kv_heads == 0 || !num_heads.is_multiple_of(shape.num_kv_heads) {
        return Err(CoreError::invalid(format!(
            "query: num_heads ({num_heads}) must be a positive multiple of the cache's num_kv_heads ({})",
            shape.num_kv_heads
        )));
    }
    if shape.block_size == 0 {
        return Err(CoreError::invalid("key_cache: block_size must be positive"));
    }
    let row = num_heads * shape.head_size;
    if query.len() != out.len() || row == 0 || !query.len().is_multiple_of(row) {
        return Err(CoreError::invalid(format!(
            "query/out: expected [num_tokens, {num_heads}, {}] elements, got {} and {}",
            shape.head_size,
            query.len(),
            out.len()
        )));
    }
    let num_tokens = query.len() / row;
    let num_seqs = batch.seq_lens.len();
    if batch.query_start_loc.len() != num_seqs + 1 {
        return Err(CoreError::invalid(format!(
            "query_start_loc: expected {} entries (num_seqs + 1), got {}",
            num_seqs + 1,
            batch.query_start_loc.len()
        )));
    }
    if batch.block_tables.len() != num_seqs * batch.max_blocks_per_seq {
        return Err(CoreError::invalid(format!(
            "block_tables: expected {num_seqs} x {} entries, got {}",
            batch.max_blocks_per_seq,
            batch.block_tables.len()
        )));
    }
    if batch.query_start_loc[0] != 0 || batch.query_start_loc[num_seqs] as i64 != num_tokens as i64
    {
        return Err(CoreError::invalid(format!(
            "query_start_loc: must start at 0 and end at num_tokens ({num_tokens}), got {} .. {}",
            batch.query_start_loc[0], batch.query_start_loc[num_seqs]
        )));
    }
    let capacity = batch.max_blocks_per_seq * shape.block_size;
    let mut seqs = Vec::with_capacity(num_seqs);
    for i in 0..num_seqs {
        let (lo, hi) = (batch.query_start_loc[i], batch.query_start_loc[i + 1]);
        if hi < lo {
            return Err(CoreError::invalid(format!(
                "query_start_loc: must be non-decreasing, entry {} is {hi} after {lo}",
                i + 1
            )));
        }
        let q_len = (hi - lo) as usize;
        let seq_len = batch.seq_lens[i];
        if seq_len < 0 || (seq_len as usize) < q_len {
            return Err(CoreError::invalid(format!(
                "seq_lens: sequence {i} has length {seq_len}, shorter than its {q_len} query tokens"
            )));
        }
        let seq_len = seq_len as usize;
        if seq_len > capacity {
            return Err(CoreError::invalid(format!(
                "seq_lens: sequence {i} has length {seq_len}, more than its block table holds ({} blocks x {})",
                batch.max_blocks_per_seq, shape.block_size
            )));
        }
        let used = seq_len.div_ceil(shape.block_size);
        let table = &batch.block_tables[i * batch.max_blocks_per_seq..][..used];
        for (j, &b) in table.iter().enumerate() {
            if b < 0 || b as usize >= shape.num_blocks {
                return Err(CoreError::invalid(format!(
                    "block_tables: sequence {i} block {j} is {b}, out of range for {} cache blocks",
                    shape.num_blocks
                )));
            }
        }
        seqs.push(SeqInfo {
            seq: i,
            q_start: lo as usize,
            q_len,
            seq_len,
        });
    }
    Ok(seqs)
}

impl Item {
    fn rows(&self, group: usize) -> usize {
        (self.row_hi - self.row_lo) * group
    }
}

/// Cuts the batch into items and decides how many key partitions each gets.
fn plan_items(
    seqs: &[SeqInfo],
    shape: CacheShape,
    group: usize,
    mask: Mask,
    plan: Plan,
) -> Vec<Item> {
    let chunk = (plan.rows_target / group).max(1);
    let mut items = Vec::new();
    for s in seqs {
        let ctx_start = s.seq_len - s.q_len;
        let mut row_lo = 0;
        while row_lo < s.q_len {
            let row_hi = (row_lo + chunk).min(s.q_len);
            // Keys visible to any row of the chunk: from the first row's
            // first key to the last row's last.
            let key_lo = mask.keys(ctx_start + row_lo, s.seq_len).0;
            let key_hi = mask.keys(ctx_start + row_hi - 1, s.seq_len).1;
            for kv_head in 0..shape.num_kv_heads {
                items.push(Item {
                    seq: *s,
                    kv_head,
                    row_lo,
                    row_hi,
                    key_lo,
                    key_hi,
                    parts: 1,
                });
            }
            row_lo = row_hi;
        }
    }
    let want = plan.threads.max(1) * plan.tasks_per_thread;
    if items.len() < want {
        let max_parts = want.div_ceil(items.len().max(1));
        for item in &mut items {
            let keys = item.key_hi - item.key_lo;
            let per_key = item.rows(group) * shape.head_size;
            let min_keys = (plan.min_partition_work / per_key.max(1)).max(shape.block_size);
            let by_size = keys / min_keys;
            item.parts = by_size.clamp(1, max_parts);
        }
    }
    items
}

/// Key ranges of an item's partitions, cut at block boundaries.
fn partition_bounds(item: &Item, block_size: usize) -> Vec<(usize, usize)> {
    let keys = item.key_hi - item.key_lo;
    let step = keys.div_ceil(item.parts).div_ceil(block_size) * block_size;
    let mut bounds = Vec::with_capacity(item.parts);
    // Align cuts to absolute block boundaries so no block is split between two partitions.
    let mut lo = item.key_lo;
    while lo < item.key_hi {
        let hi = ((lo / block_size) * block_size + step)
            .min(item.key_hi)
            .max(lo + 1);
        bounds.push((lo, hi));
        lo = hi;
    }
    bounds
}

/// Running softmax state of an item's rows: max, sum of exponentials and the
/// unnormalised weighted sum of values.
struct PartialState {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
}

impl PartialState {
    fn new(rows: usize, d: usize) -> PartialState {
        PartialState {
            max: vec![f32::NEG_INFINITY; rows],
            sum: vec![0.0; rows],
            acc: vec![0.0; rows * d],
        }
    }

    /// Normalises the accumulators into the attention output. `sinks` are
    /// the item's query heads' sink logits (`[group]`; row `r` is head
    /// `r % group`): each joins its row's denominator as one more score with
    /// a zero value row.
    fn finish(&mut self, sinks: Option<&[f32]>) {
        let d = self.acc.len() / self.sum.len().max(1);
        for (r, &l) in self.sum.iter().enumerate() {
            let inv = match sinks {
                _ if l <= 0.0 => 0.0,
                None => 1.0 / l,
                Some(s) => {
                    let (sink, m) = (s[r % s.len()], self.max[r]);
                    if sink > m {
                        // Rescale to the sink's maximum: acc * a / (l * a + 1).
                        let a = (m - sink).exp();
                        a / (l * a + 1.0)
                    } else {
                        1.0 / (l + (sink - m).exp())
                    }
                }
            };
            for a in &mut self.acc[r * d..(r + 1) * d] {
                *a *= inv;
            }
        }
    }

    /// Merges partition states (log-sum-exp) into a finished output.
    fn merge(
        states: Vec<PartialState>,
        rows: usize,
        d: usize,
        sinks: Option<&[f32]>,
    ) -> PartialState {
        let mut merged = PartialState::new(rows, d);
        for r in 0..rows {
            let m = states
                .iter()
                .map(|s| s.max[r])
                .fold(f32::NEG_INFINITY, f32::max);
            if m == f32::NEG_INFINITY {
                continue;
            }
            let dst = &mut merged.acc[r * d..(r + 1) * d];
            let mut total = 0.0f32;
            for s in &states {
                if s.sum[r] == 0.0 {
                    continue;
                }
                let w = (s.max[r] - m).exp();
                total += s.sum[r] * w;
                for (o, &a) in dst.iter_mut().zip(&s.acc[r * d..(r + 1) * d]) {
                    *o += a * w;
                }
            }
            merged.max[r] = m;
            merged.sum[r] = total;
        }
        merged.finish(sinks);
        merged
    }
}

/// Writes an item's finished rows into `out`.
///
/// # Safety
/// `out` must point to `[num_tokens, num_heads, head_size]` elements, and no
/// other thread may write the rows of this item (tokens `row_lo..row_hi` of its
/// sequence, query heads of its KV head) at the same time.
unsafe fn write_rows<T: Element, C>(
    p: &Problem<'_, T, C>,
    item: &Item,
    state: &PartialState,
    out: OutPtr<T>,
) {
    let d = p.shape.head_size;
    for r in 0..item.row_hi - item.row_lo {
        let token = item.seq.q_start + item.row_lo + r;
        let head0 = item.kv_head * p.group;
        let dst = std::slice::from_raw_parts_mut(
            out.0.add((token * p.num_heads + head0) * d),
            p.group * d,
        );
        let src = &state.acc[r * p.group * d..(r + 1) * p.group * d];
        for (o, &a) in dst.iter_mut().zip(src) {
            *o = T::from_f32(a);
        }
    }
}

/// Runs one item over keys `key_lo..key_hi`, on the problem's path.
fn attend<T: Element, C: KvElem<T>>(
    p: &Problem<'_, T, C>,
    item: &Item,
    key_lo: usize,
    key_hi: usize,
    state: &mut PartialState,
) {
    let op = kernel::Attend {
        p,
        item,
        key_lo,
        key_hi,
        state,
    };
    simd::dispatch(p.path, op);
}

#[cfg(test)]
mod tests {
    use super::kernel::exp_nonpos;
    use super::*;
    #[cfg(target_arch = "x86_64")]
    use crate::cpu::simd::Avx2;
    use crate::cpu::simd::Scalar;
    use half::bf16;

    use crate::cpu::elem::tests::Rng;

    struct Case {
        shape: CacheShape,
        num_heads: usize,
        q_lens: Vec<usize>,
        seq_lens: Vec<usize>,
        window: i64,
        softcap: f32,
        /// Whether the heads have attention sinks (random logits, some -inf).
        sinks: bool,
    }

    #[derive(Clone)]
    struct Data {
        query: Vec<f32>,
        kc: Vec<f32>,
        vc: Vec<f32>,
        tables: Vec<i32>,
        max_blocks: usize,
        seq_lens: Vec<i32>,
        qsl: Vec<i32>,
        sinks: Option<Vec<f32>>,
    }

    fn make(case: &Case, rng: &mut Rng) -> Data {
        let s = case.shape;
        let num_tokens: usize = case.q_lens.iter().sum();
        let query = (0..num_tokens * case.num_heads * s.head_size)
            .map(|_| rng.f32() * 2.0)
            .collect();
        let kc = (0..s.numel()).map(|_| rng.f32() * 2.0).collect();
        let vc = (0..s.numel()).map(|_| rng.f32()).collect();
        let max_blocks = case
            .seq_lens
            .iter()
            .map(|l| l.div_ceil(s.block_size))
            .max()
            .unwrap_or(0)
            + 1;
        // A random permutation of block ids, handed out to the sequences in turn.
        let mut perm: Vec<usize> = (0..s.num_blocks).collect();
        for i in (1..perm.len()).rev() {
            perm.swap(i, rng.below(i + 1));
        }
        let mut tables = vec![-7; case.seq_lens.len() * max_blocks];
        let mut next = 0;
        for (i, l) in case.seq_lens.iter().enumerate() {
            for j in 0..l.div_ceil(s.block_size) {
                tables[i * max_blocks + j] = perm[next] as i32;
                next += 1;
            }
        }
        let mut qsl = vec![0i32];
        for q in &case.q_lens {
            qsl.push(qsl.last().copied().unwrap_or(0) + *q as i32);
        }
        // Sinks in [-5, 7): some above every score of their row, some below;
        // every fifth head has none (-inf).
        let sinks = case.sinks.then(|| {
            (0..case.num_heads)
                .map(|h| {
                    let x = rng.f32() * 6.0 + 1.0;
                    if h % 5 == 4 {
                        f32::NEG_INFINITY
                    } else {
                        x
                    }
                })
                .collect()
        });
        Data {
            query,
            kc,
            vc,
            tables,
            max_blocks,
            seq_lens: case.seq_lens.iter().map(|&l| l as i32).collect(),
            qsl,
            sinks,
        }
    }

    /// Straightforward f64 attention over gathered keys, for comparison; a
    /// sink is one more score column whose value row is zero.
    fn reference(case: &Case, data: &Data, scale: f32) -> Vec<f32> {
        let s = case.shape;
        let d = s.head_size;
        let g = case.num_heads / s.num_kv_heads;
        let mut out = vec![0.0f32; data.query.len()];
        for (i, (&q_len, &seq_len)) in case.q_lens.iter().zip(&case.seq_lens).enumerate() {
            let slot = |t: usize, h: usize| {
                let b = data.tables[i * data.max_blocks + t / s.block_size] as usize;
                ((b * s.num_kv_heads + h) * s.block_size + t % s.block_size) * d
            };
            for j in 0..q_len {
                let token = data.qsl[i] as usize + j;
                let pos = seq_len - q_len + j;
                let lo = if case.window > 0 {
                    (pos + 1).saturating_sub(case.window as usize)
                } else {
                    0
                };
                for h in 0..case.num_heads {
                    let q = &data.query[(token * case.num_heads + h) * d..][..d];
                    let kvh = h / g;
                    let scores: Vec<f64> = (lo..=pos)
                        .map(|t| {
                            let k = &data.kc[slot(t, kvh)..][..d];
                            q.iter()
                                .zip(k)
                                .map(|(&a, &b)| a as f64 * b as f64)
                                .sum::<f64>()
                                * scale as f64
                        })
                        .map(|x| {
                            let cap = case.softcap as f64;
                            if cap > 0.0 {
                                cap * (x / cap).tanh()
                            } else {
                                x
                            }
                        })
                        .collect();
                    let sink = data
                        .sinks
                        .as_ref()
                        .map_or(f64::NEG_INFINITY, |s| s[h] as f64);
                    let m = scores.iter().copied().fold(sink, f64::max);
                    let w: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                    let total: f64 = w.iter().sum::<f64>() + (sink - m).exp();
                    for c in 0..d {
                        let v: f64 = (lo..=pos)
                            .zip(&w)
                            .map(|(t, wt)| wt * data.vc[slot(t, kvh) + c] as f64)
                            .sum();
                        out[(token * case.num_heads + h) * d + c] = (v / total) as f32;
                    }
                }
            }
        }
        out
    }

    fn run<T: Element>(case: &Case, data: &Data, scale: f32, plan: Plan, path: Path) -> Vec<f32> {
        let conv = |v: &[f32]| v.iter().map(|&x| T::from_f32(x)).collect::<Vec<T>>();
        let (kc, vc) = (conv(&data.kc), conv(&data.vc));
        run_on::<T, T>(case, data, (&kc, &vc), scale, plan, path)
    }

    /// The kernel on the case's queries (as `T`) over caches of `C`.
    fn run_on<T: Element, C: KvElem<T>>(
        case: &Case,
        data: &Data,
        (kc, vc): (&[C], &[C]),
        scale: f32,
        plan: Plan,
        path: Path,
    ) -> Vec<f32> {
        let q: Vec<T> = data.query.iter().map(|&x| T::from_f32(x)).collect();
        let mut out = vec![T::from_f32(f32::NAN); q.len()];
        let batch = BatchLayout {
            block_tables: &data.tables,
            max_blocks_per_seq: data.max_blocks,
            seq_lens: &data.seq_lens,
            query_start_loc: &data.qsl,
        };
        paged_attention_with(
            &mut out,
            &q,
            kc,
            vc,
            case.shape,
            case.num_heads,
            batch,
            scale,
            case.window,
            case.softcap,
            data.sinks.as_deref(),
            plan,
            path,
        )
        .unwrap();
        out.iter().map(|x| x.to_f32()).collect()
    }

    fn cases() -> Vec<Case> {
        let shape = |num_blocks, num_kv_heads, block_size, head_size| CacheShape {
            num_blocks,
            num_kv_heads,
            block_size,
            head_size,
        };
        vec![
            // Decode batch with GQA and an odd head size.
            Case {
                shape: shape(40, 2, 16, 80),
                num_heads: 14,
                q_lens: vec![1, 1, 1],
                seq_lens: vec![1, 37, 300],
                window: 0,
                softcap: 0.0,
                sinks: false,
            },
            // Prefill after a prefix mixed with decode, MQA, sliding window, soft-cap.
            Case {
                shape: shape(64, 1, 8, 64),
                num_heads: 4,
                q_lens: vec![23, 1, 9],
                seq_lens: vec![70, 129, 9],
                window: 17,
                softcap: 1.5,
                sinks: false,
            },
            // Long single-sequence decode (partitions), head size not a multiple of 16,
            // soft-cap (so the partitions merge capped scores).
            Case {
                shape: shape(80, 2, 32, 72),
                num_heads: 4,
                q_lens: vec![1],
                seq_lens: vec![2000],
                window: 0,
                softcap: 2.0,
                sinks: false,
            },
            // Prefill with window longer than the sequence, MHA, head size 256.
            Case {
                shape: shape(12, 3, 16, 256),
                num_heads: 3,
                q_lens: vec![40, 0],
                seq_lens: vec![50, 5],
                window: 400,
                softcap: 0.0,
                sinks: false,
            },
            // Attention sinks (gpt-oss): decode batch with GQA.
            Case {
                shape: shape(40, 2, 16, 64),
                num_heads: 16,
                q_lens: vec![1, 1, 1],
                seq_lens: vec![1, 45, 260],
                window: 0,
                softcap: 0.0,
                sinks: true,
            },
            // Sinks with prefill after a prefix mixed with decode, sliding window.
            Case {
                shape: shape(64, 2, 8, 64),
                num_heads: 10,
                q_lens: vec![23, 1, 9, 1],
                seq_lens: vec![70, 129, 9, 3],
                window: 16,
                softcap: 0.0,
                sinks: true,
            },
            // Sinks with a long partitioned decode (merged partitions), soft-cap.
            Case {
                shape: shape(80, 1, 32, 64),
                num_heads: 5,
                q_lens: vec![1],
                seq_lens: vec![2400],
                window: 0,
                softcap: 3.0,
                sinks: true,
            },
            // Blocks of 5 tokens: a softmax chunk spans blocks that end
            // inside its tiles (decode with GQA, and a prefill).
            Case {
                shape: shape(100, 2, 5, 64),
                num_heads: 6,
                q_lens: vec![1, 30, 1],
                seq_lens: vec![260, 100, 7],
                window: 0,
                softcap: 0.0,
                sinks: false,
            },
            // Blocks of 24 and of one token, with windows and soft-cap.
            Case {
                shape: shape(30, 1, 24, 48),
                num_heads: 3,
                q_lens: vec![17, 1],
                seq_lens: vec![150, 400],
                window: 50,
                softcap: 1.0,
                sinks: false,
            },
            Case {
                shape: shape(200, 1, 1, 32),
                num_heads: 2,
                q_lens: vec![1, 13],
                seq_lens: vec![90, 100],
                window: 0,
                softcap: 0.0,
                sinks: true,
            },
            // Sinks with a sliding window over a long decode and a prefill.
            Case {
                shape: shape(96, 2, 16, 80),
                num_heads: 4,
                q_lens: vec![1, 40],
                seq_lens: vec![1300, 60],
                window: 128,
                softcap: 0.0,
                sinks: true,
            },
        ]
    }

    #[test]
    fn matches_reference_f32_every_variant_and_plan() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for case in cases() {
            let data = make(&case, &mut rng);
            let scale = 1.0 / (case.shape.head_size as f32).sqrt();
            let want = reference(&case, &data, scale);
            for path in available_paths() {
                for plan in plans() {
                    let got = run::<f32>(&case, &data, scale, plan, path);
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (a - b).abs() <= 2e-5 + 1e-5 * b.abs(),
                            "{path:?} {plan:?} [{i}]: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    /// Rows of a float cache quantized as an 8-bit cache stores them, and
    /// the dequantized floats they hold.
    fn quantized(cache: &[f32], d: usize) -> (Vec<i8>, Vec<f32>) {
        let stride = d + INT8_SCALE_BYTES;
        let mut q = vec![0i8; cache.len() / d * stride];
        let mut back = vec![0f32; cache.len()];
        for (row, (dst, deq)) in cache
            .chunks_exact(d)
            .zip(q.chunks_exact_mut(stride).zip(back.chunks_exact_mut(d)))
        {
            <i8 as KvElem<f32>>::store_row(row, dst);
            <i8 as KvElem<f32>>::widen_rows(dst, d, deq);
        }
        (q, back)
    }

    #[test]
    fn int8_caches_match_reference_of_their_values_every_path() {
        let mut rng = Rng(777);
        for case in cases() {
            let mut data = make(&case, &mut rng);
            let d = case.shape.head_size;
            let (kq, kf) = quantized(&data.kc, d);
            let (vq, vf) = quantized(&data.vc, d);
            data.kc = kf;
            data.vc = vf;
            let scale = 1.0 / (d as f32).sqrt();
            // Against an 8-bit cache the queries are quantized as its rows are.
            let mut quantized_queries = data.clone();
            quantized_queries.query = quantized(&data.query, d).1;
            let want = reference(&case, &quantized_queries, scale);
            for path in available_paths() {
                let caches = (&kq[..], &vq[..]);
                let out = run_on::<f32, i8>(&case, &data, caches, scale, Plan::production(), path);
                for (a, b) in out.iter().zip(&want) {
                    assert!(
                        (a - b).abs() <= 2e-5 + 1e-5 * b.abs(),
                        "{path:?}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn matches_reference_bf16() {
        let mut rng = Rng(12345);
        for case in cases() {
            let mut data = make(&case, &mut rng);
            // Round the inputs to bf16 so the reference sees the same values.
            for v in [&mut data.query, &mut data.kc, &mut data.vc] {
                for x in v.iter_mut() {
                    *x = bf16::from_f32(*x).to_f32();
                }
            }
            let scale = 0.125;
            let want = reference(&case, &data, scale);
            for path in available_paths() {
                let got = run::<bf16>(&case, &data, scale, plans()[1], path);
                for (a, b) in got.iter().zip(&want) {
                    // Only the final rounding to bf16 (half an ulp, 2^-9 relative) differs.
                    assert!(
                        (a - b).abs() <= 1e-5 + b.abs() / 256.0,
                        "{path:?}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn exp_is_accurate() {
        let mut x = -90.0f32;
        while x <= 0.0 {
            let want = (x as f64).exp();
            for got in [exp_nonpos::<Scalar>(x) as f64, exp_nonpos::<Avx2>(x) as f64] {
                if x < -87.0 {
                    assert_eq!(got, 0.0);
                } else {
                    assert!(
                        (got - want).abs() <= 3e-7 * want,
                        "exp({x}) = {got}, want {want}"
                    );
                }
            }
            x += 0.0137;
        }
        assert_eq!(exp_nonpos::<Scalar>(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpos::<Scalar>(0.0), 1.0);
    }

    #[test]
    fn rejects_bad_layouts() {
        let case = &cases()[0];
        let mut rng = Rng(7);
        let data = make(case, &mut rng);
        let try_run = |tables: &[i32], seq_lens: &[i32], qsl: &[i32]| {
            let mut out = vec![0.0f32; data.query.len()];
            let batch = BatchLayout {
                block_tables: tables,
                max_blocks_per_seq: data.max_blocks,
                seq_lens,
                query_start_loc: qsl,
            };
            paged_attention(
                &mut out,
                &data.query,
                &data.kc,
                &data.vc,
                case.shape,
                14,
                batch,
                1.0,
                0,
                0.0,
                None,
            )
            .map_err(|e| e.to_string())
        };
        assert!(try_run(&data.tables, &data.seq_lens, &data.qsl).is_ok());
        let mut bad = data.tables.clone();
        bad[data.max_blocks * 2] = case.shape.num_blocks as i32;
        assert!(try_run(&bad, &data.seq_lens, &data.qsl)
            .unwrap_err()
            .contains("block_tables"));
        let too_long = [1, 37, (data.max_blocks * 16 + 1) as i32];
        assert!(try_run(&data.tables, &too_long, &data.qsl)
            .unwrap_err()
            .contains("seq_lens"));
        assert!(try_run(&data.tables, &[0, 37, 300], &data.qsl)
            .unwrap_err()
            .contains("seq_lens"));
        assert!(try_run(&data.tables, &data.seq_lens, &[0, 1, 2])
            .unwrap_err()
            .contains("query_start_loc"));
        assert!(try_run(&data.tables, &data.seq_lens, &[0, 1, 0, 3])
            .unwrap_err()
            .contains("query_start_loc"));
    }

    #[test]
    fn rejects_bad_sinks() {
        let case = &cases()[0];
        let mut rng = Rng(8);
        let data = make(case, &mut rng);
        let try_run = |sinks: &[f32]| {
            let mut out = vec![0.0f32; data.query.len()];
            let batch = BatchLayout {
                block_tables: &data.tables,
                max_blocks_per_seq: data.max_blocks,
                seq_lens: &data.seq_lens,
                query_start_loc: &data.qsl,
            };
            paged_attention(
                &mut out,
                &data.query,
                &data.kc,
                &data.vc,
                case.shape,
                case.num_heads,
                batch,
                1.0,
                0,
                0.0,
                Some(sinks),
            )
            .map_err(|e| e.to_string())
        };
        let mut sinks = vec![0.5f32; case.num_heads];
        sinks[3] = f32::NEG_INFINITY;
        assert!(try_run(&sinks).is_ok());
        let err = try_run(&sinks[1..]).unwrap_err();
        assert!(
            err.contains("sinks: expected 14 values (one per query head), got 13"),
            "{err}"
        );
        for bad in [f32::NAN, f32::INFINITY] {
            sinks[2] = bad;
            let err = try_run(&sinks).unwrap_err();
            assert!(err.contains("sinks: head 2 is"), "{err}");
        }
    }

    #[test]
    fn sinks_of_minus_infinity_change_nothing() {
        let case = &cases()[1];
        let mut rng = Rng(9);
        let mut data = make(case, &mut rng);
        let plain = run::<f32>(case, &data, 0.125, plans()[1], crate::cpu::best_path());
        data.sinks = Some(vec![f32::NEG_INFINITY; case.num_heads]);
        let with = run::<f32>(case, &data, 0.125, plans()[1], crate::cpu::best_path());
        assert_eq!(plain, with);
    }

    #[test]
    fn cache_write_matches_direct_indexing() {
        let shape = CacheShape {
            num_blocks: 5,
            num_kv_heads: 2,
            block_size: 4,
            head_size: 3,
        };
        let row = 2 * 3;
        let key: Vec<f32> = (0..4 * row).map(|i| i as f32).collect();
        let value: Vec<f32> = key.iter().map(|x| -x).collect();
        let slots = [7i64, -1, 0, 19];
        let mut kc = vec![f32::NAN; shape.numel()];
        let mut vc = vec![f32::NAN; shape.numel()];
        reshape_and_cache(&key, &value, &mut kc, &mut vc, &slots, shape).unwrap();
        for (t, &slot) in slots.iter().enumerate() {
            if slot < 0 {
                continue;
            }
            let (b, o) = (slot as usize / 4, slot as usize % 4);
            for h in 0..2 {
                for c in 0..3 {
                    let at = ((b * 2 + h) * 4 + o) * 3 + c;
                    assert_eq!(kc[at], key[t * row + h * 3 + c]);
                    assert_eq!(vc[at], value[t * row + h * 3 + c]);
                }
            }
        }
        assert_eq!(kc.iter().filter(|x| !x.is_nan()).count(), 3 * row);
        let err =
            reshape_and_cache(&key, &value, &mut kc, &mut vc, &[0, 1, 20, 2], shape).unwrap_err();
        assert!(err.to_string().contains("slot_mapping: token 2"), "{err}");
    }
}

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
//! The inner loops are written over fixed 16-lane chunks so LLVM vectorises
//! them; they are compiled three times (AVX-512, AVX2+FMA, portable) and the
//! variant is chosen at run time from what the CPU reports.

use half::bf16;
use rayon::prelude::*;

use crate::error::{CoreError, CoreResult};

/// An element type of the KV cache, queries and outputs.
pub trait CacheElement: Copy + Send + Sync + 'static {
    /// Widens to f32.
    fn to_f32(self) -> f32;
    /// Rounds an f32 to this type (round to nearest even).
    fn from_f32(v: f32) -> Self;
    /// The slice itself when the type already is f32 (no copy needed).
    fn as_f32_slice(s: &[Self]) -> Option<&[f32]>;
}

impl CacheElement for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
    #[inline(always)]
    fn as_f32_slice(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
}

impl CacheElement for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        // Exact: a bf16 is the upper half of an f32. Written as a shift so the
        // widening loops vectorise.
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    #[inline(always)]
    fn as_f32_slice(_: &[Self]) -> Option<&[f32]> {
        None
    }
}

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
        self.num_blocks * self.num_kv_heads * self.block_size * self.head_size
    }

    /// Number of token slots (`num_blocks * block_size`).
    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
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
/// cache slot `slot_mapping[t]`; a negative slot skips the token.
pub fn reshape_and_cache<T: CacheElement>(
    key: &[T],
    value: &[T],
    key_cache: &mut [T],
    value_cache: &mut [T],
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
    if key_cache.len() != shape.numel() || value_cache.len() != shape.numel() {
        return Err(CoreError::invalid(format!(
            "key_cache/value_cache: expected {} elements for shape {shape:?}, got {} and {}",
            shape.numel(),
            key_cache.len(),
            value_cache.len()
        )));
    }
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
            let dst = ((block * shape.num_kv_heads + h) * shape.block_size + offset) * d;
            key_cache[dst..dst + d].copy_from_slice(&key[src..src + d]);
            value_cache[dst..dst + d].copy_from_slice(&value[src..src + d]);
        }
    }
    Ok(())
}

/// How the work is cut into parallel items; fixed in production, varied by tests.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Plan {
    /// Target number of (query row x query head) pairs per item.
    rows_target: usize,
    /// Smallest key partition, in tokens, when an item's keys are split.
    min_partition: usize,
    /// Aim for at least this many tasks per thread.
    tasks_per_thread: usize,
    /// Thread count the split aims at.
    threads: usize,
}

impl Plan {
    fn production() -> Plan {
        Plan {
            rows_target: 32,
            min_partition: 256,
            tasks_per_thread: 4,
            threads: crate::threads::num_threads(),
        }
    }
}

/// Instruction-set variant of the inner loops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SimdLevel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl SimdLevel {
    /// The best variant this CPU (and OS) supports.
    pub(crate) fn detect() -> SimdLevel {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
            {
                return SimdLevel::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return SimdLevel::Avx2;
            }
        }
        SimdLevel::Portable
    }

    /// Every variant this CPU can run (for tests).
    #[cfg(test)]
    pub(crate) fn available() -> Vec<SimdLevel> {
        let mut v = vec![SimdLevel::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                v.push(SimdLevel::Avx2);
            }
            if SimdLevel::detect() == SimdLevel::Avx512 {
                v.push(SimdLevel::Avx512);
            }
        }
        v
    }
}

/// Attention of the packed new tokens over the paged cache, written into `out`.
///
/// `query` and `out` are `[num_tokens, num_heads, head_size]`; `scale`
/// multiplies the scores; `sliding_window > 0` restricts a query at position
/// `p` to keys in `(p - sliding_window, p]`.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention<T: CacheElement>(
    out: &mut [T],
    query: &[T],
    key_cache: &[T],
    value_cache: &[T],
    shape: CacheShape,
    num_heads: usize,
    batch: BatchLayout<'_>,
    scale: f32,
    sliding_window: i64,
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
        Plan::production(),
        SimdLevel::detect(),
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

/// Fixed facts of one call, shared by every item.
struct Problem<'a, T> {
    query: &'a [T],
    key_cache: &'a [T],
    value_cache: &'a [T],
    block_tables: &'a [i32],
    max_blocks: usize,
    shape: CacheShape,
    num_heads: usize,
    group: usize,
    scale: f32,
    window: usize,
    level: SimdLevel,
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
/// single-threaded. Measured on 2 cores (14 heads, head size 64): a batch-1
/// decode over 1024 keys (~0.9M) is ~15% faster split, one over 128 keys
/// (~0.1M) is not (the pool wake-up costs ~20-40 µs).
const SERIAL_WORK: usize = 1 << 18;

#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_attention_with<T: CacheElement>(
    out: &mut [T],
    query: &[T],
    key_cache: &[T],
    value_cache: &[T],
    shape: CacheShape,
    num_heads: usize,
    batch: BatchLayout<'_>,
    scale: f32,
    sliding_window: i64,
    plan: Plan,
    level: SimdLevel,
) -> CoreResult<()> {
    let seqs = validate(out, query, key_cache, value_cache, shape, num_heads, batch)?;
    let d = shape.head_size;
    let group = num_heads / shape.num_kv_heads;
    let window = if sliding_window > 0 {
        sliding_window as usize
    } else {
        0
    };
    let items = plan_items(&seqs, shape, group, window, plan);
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
        scale,
        window,
        level,
    };
    let out_ptr = OutPtr(out.as_mut_ptr());
    let problem = &problem;
    let run_item = |item: &Item, parallel: bool| {
        if item.parts <= 1 {
            let mut state = PartialState::new(item.rows(group), d);
            attend(problem, item, item.key_lo, item.key_hi, &mut state);
            state.finish();
            // SAFETY: this item owns its rows of `out` (validated shape).
            unsafe { write_rows(problem, item, &state, out_ptr) };
        } else {
            let bounds = partition_bounds(item, shape.block_size);
            let part = |&(lo, hi): &(usize, usize)| {
                let mut state = PartialState::new(item.rows(group), d);
                attend(problem, item, lo, hi, &mut state);
                state
            };
            let states: Vec<PartialState> = if parallel {
                bounds.par_iter().map(part).collect()
            } else {
                bounds.iter().map(part).collect()
            };
            let merged = PartialState::merge(states, item.rows(group), d);
            // SAFETY: as above.
            unsafe { write_rows(problem, item, &merged, out_ptr) };
        }
    };
    // Small steps (a decode of one short sequence) run on the calling thread:
    // waking the pool costs more than the work.
    let work: usize = items
        .iter()
        .map(|it| it.rows(group) * (it.key_hi - it.key_lo) * d)
        .sum();
    if work < SERIAL_WORK || plan.threads <= 1 {
        items.iter().for_each(|item| run_item(item, false));
    } else {
        crate::threads::install(|| {
            items.par_iter().for_each(|item| run_item(item, true));
        });
    }
    Ok(())
}

fn validate<T>(
    out: &[T],
    query: &[T],
    key_cache: &[T],
    value_cache: &[T],
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
    if key_cache.len() != shape.numel() || value_cache.len() != shape.numel() {
        return Err(CoreError::invalid(format!(
            "key_cache/value_cache: expected {} elements for shape {shape:?}, got {} and {}",
            shape.numel(),
            key_cache.len(),
            value_cache.len()
        )));
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
    window: usize,
    plan: Plan,
) -> Vec<Item> {
    let chunk = (plan.rows_target / group).max(1);
    let mut items = Vec::new();
    for s in seqs {
        let ctx_start = s.seq_len - s.q_len;
        let mut row_lo = 0;
        while row_lo < s.q_len {
            let row_hi = (row_lo + chunk).min(s.q_len);
            // Keys visible to any row of the chunk: up to the last row's
            // position, from the first row's window start.
            let key_hi = ctx_start + row_hi;
            let first_pos = ctx_start + row_lo;
            let key_lo = if window > 0 {
                (first_pos + 1).saturating_sub(window)
            } else {
                0
            };
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
            let by_size = keys / plan.min_partition.max(shape.block_size);
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

    /// Normalises the accumulators into the attention output.
    fn finish(&mut self) {
        let d = self.acc.len() / self.sum.len().max(1);
        for (r, &l) in self.sum.iter().enumerate() {
            let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
            for a in &mut self.acc[r * d..(r + 1) * d] {
                *a *= inv;
            }
        }
    }

    /// Merges partition states (log-sum-exp) into a finished output.
    fn merge(states: Vec<PartialState>, rows: usize, d: usize) -> PartialState {
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
        merged.finish();
        merged
    }
}

/// Writes an item's finished rows into `out`.
///
/// # Safety
/// `out` must point to `[num_tokens, num_heads, head_size]` elements, and no
/// other thread may write the rows of this item (tokens `row_lo..row_hi` of its
/// sequence, query heads of its KV head) at the same time.
unsafe fn write_rows<T: CacheElement>(
    p: &Problem<'_, T>,
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

/// Runs one item over keys `key_lo..key_hi`, in the best variant the CPU has.
fn attend<T: CacheElement>(
    p: &Problem<'_, T>,
    item: &Item,
    key_lo: usize,
    key_hi: usize,
    state: &mut PartialState,
) {
    match p.level {
        // SAFETY: `SimdLevel::detect` only returns these when the CPU has the features.
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 => unsafe { attend_avx512(p, item, key_lo, key_hi, state) },
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => unsafe { attend_avx2(p, item, key_lo, key_hi, state) },
        SimdLevel::Portable => attend_generic::<T, Plain>(p, item, key_lo, key_hi, state),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn attend_avx512<T: CacheElement>(
    p: &Problem<'_, T>,
    item: &Item,
    key_lo: usize,
    key_hi: usize,
    state: &mut PartialState,
) {
    attend_generic::<T, X86>(p, item, key_lo, key_hi, state)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_avx2<T: CacheElement>(
    p: &Problem<'_, T>,
    item: &Item,
    key_lo: usize,
    key_hi: usize,
    state: &mut PartialState,
) {
    attend_generic::<T, X86>(p, item, key_lo, key_hi, state)
}

/// What an instruction-set variant provides to the generic kernel body.
trait MulAdd {
    /// `a * b + c`: fused where the variant has FMA (a plain `mul_add`
    /// without it would become a slow library call).
    fn mul_add(a: f32, b: f32, c: f32) -> f32;

    /// Scores of 8 consecutive key rows at once, if the variant has a
    /// dedicated path for this head size; `false` means "use `dot4`".
    #[inline(always)]
    fn scores8(_q: &[f32], _keys: &[f32], _out: &mut [f32]) -> bool {
        false
    }
}

struct Plain;
/// AVX2 / AVX-512 variants: fused multiply-add and the explicit score kernel.
#[cfg(target_arch = "x86_64")]
struct X86;

impl MulAdd for Plain {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

#[cfg(target_arch = "x86_64")]
impl MulAdd for X86 {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }

    #[inline(always)]
    fn scores8(q: &[f32], keys: &[f32], out: &mut [f32]) -> bool {
        let d = q.len();
        if !d.is_multiple_of(8) || keys.len() < 8 * d || out.len() < 8 {
            return false;
        }
        // SAFETY: only instantiated inside `attend_avx2` / `attend_avx512`,
        // which run only when the CPU has AVX2 and FMA; lengths checked above.
        unsafe { x86::scores8(q.as_ptr(), keys.as_ptr(), d, out.as_mut_ptr()) };
        true
    }
}

/// Explicit AVX2 + FMA code for the query-key products, where the portable
/// formulation spends most of its time in horizontal sums. (AVX2 rather than
/// AVX-512 intrinsics: the latter need a newer compiler than the crate's MSRV.)
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// `out[t] = q . keys[t]` for 8 key rows of length `d` (a multiple of 8).
    ///
    /// Each row's products accumulate in its own register; the 8 registers
    /// are then summed in one transposing tree, ~2.4 instructions per row
    /// instead of a full horizontal sum each.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `q` has `d` elements, `keys`
    /// `8 * d`, `out` 8.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scores8(q: *const f32, keys: *const f32, d: usize, out: *mut f32) {
        let mut acc = [_mm256_setzero_ps(); 8];
        let mut i = 0;
        while i < d {
            let qv = _mm256_loadu_ps(q.add(i));
            for (t, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys.add(t * d + i)), *a);
            }
            i += 8;
        }
        // Four rows -> one register holding, in each 128-bit half, the four
        // rows' partial sums over that half.
        let quad = |a: __m256, b: __m256, c: __m256, e: __m256| {
            let ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
            let ce = _mm256_add_ps(_mm256_unpacklo_ps(c, e), _mm256_unpackhi_ps(c, e));
            let lo = _mm256_castpd_ps(_mm256_unpacklo_pd(
                _mm256_castps_pd(ab),
                _mm256_castps_pd(ce),
            ));
            let hi = _mm256_castpd_ps(_mm256_unpackhi_pd(
                _mm256_castps_pd(ab),
                _mm256_castps_pd(ce),
            ));
            _mm256_add_ps(lo, hi)
        };
        let u0 = quad(acc[0], acc[1], acc[2], acc[3]);
        let u1 = quad(acc[4], acc[5], acc[6], acc[7]);
        // Add the two halves, rows 0-3 then 4-7.
        let r = _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(u0, u1),
            _mm256_permute2f128_ps::<0x31>(u0, u1),
        );
        _mm256_storeu_ps(out, r);
    }
}

const LANES: usize = 16;

/// Sum of 16 lanes as a balanced tree (vectorises; a left fold would not).
#[inline(always)]
fn hsum(a: &[f32; LANES]) -> f32 {
    let mut h8 = [0.0f32; 8];
    for i in 0..8 {
        h8[i] = a[i] + a[i + 8];
    }
    let mut h4 = [0.0f32; 4];
    for i in 0..4 {
        h4[i] = h8[i] + h8[i + 4];
    }
    (h4[0] + h4[2]) + (h4[1] + h4[3])
}

/// Dot products of `q` with four key rows at once (one load of `q` per chunk).
#[inline(always)]
fn dot4<M: MulAdd>(q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
    let n = q.len() / LANES * LANES;
    let mut acc = [[0.0f32; LANES]; 4];
    let mut i = 0;
    while i < n {
        let qc = &q[i..i + LANES];
        for (a, kr) in acc.iter_mut().zip(&k) {
            let kc = &kr[i..i + LANES];
            for l in 0..LANES {
                a[l] = M::mul_add(qc[l], kc[l], a[l]);
            }
        }
        i += LANES;
    }
    let mut res = [hsum(&acc[0]), hsum(&acc[1]), hsum(&acc[2]), hsum(&acc[3])];
    for j in n..q.len() {
        for (r, kr) in res.iter_mut().zip(&k) {
            *r = M::mul_add(q[j], kr[j], *r);
        }
    }
    res
}

/// Dot product of two rows.
#[inline(always)]
fn dot1<M: MulAdd>(q: &[f32], k: &[f32]) -> f32 {
    let n = q.len() / LANES * LANES;
    let mut acc = [0.0f32; LANES];
    let mut i = 0;
    while i < n {
        let (qc, kc) = (&q[i..i + LANES], &k[i..i + LANES]);
        for l in 0..LANES {
            acc[l] = M::mul_add(qc[l], kc[l], acc[l]);
        }
        i += LANES;
    }
    let mut res = hsum(&acc);
    for j in n..q.len() {
        res = M::mul_add(q[j], k[j], res);
    }
    res
}

/// `acc += w[0] * v[0] + .. + w[3] * v[3]`, one pass over `acc`.
#[inline(always)]
fn axpy4<M: MulAdd>(acc: &mut [f32], w: [f32; 4], v: [&[f32]; 4]) {
    let d = acc.len();
    let (v0, v1, v2, v3) = (&v[0][..d], &v[1][..d], &v[2][..d], &v[3][..d]);
    for j in 0..d {
        let mut a = acc[j];
        a = M::mul_add(w[0], v0[j], a);
        a = M::mul_add(w[1], v1[j], a);
        a = M::mul_add(w[2], v2[j], a);
        a = M::mul_add(w[3], v3[j], a);
        acc[j] = a;
    }
}

/// `acc += w * v`.
#[inline(always)]
fn axpy1<M: MulAdd>(acc: &mut [f32], w: f32, v: &[f32]) {
    let v = &v[..acc.len()];
    for (a, &x) in acc.iter_mut().zip(v) {
        *a = M::mul_add(w, x, *a);
    }
}

/// `e^x` for `x <= 0` (scores minus their running max), ~1 ulp, written
/// without branches or library calls so a loop over it vectorises. Inputs
/// below -87 (including -inf) give 0.
#[inline(always)]
fn exp_nonpos<M: MulAdd>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let xc = if x < -87.0 { -87.0 } else { x };
    let n = (xc * LOG2E + ROUND) - ROUND;
    let r = M::mul_add(n, -LN2_LO, M::mul_add(n, -LN2_HI, xc));
    let mut p = 1.987_569_1e-4f32;
    p = M::mul_add(p, r, 1.398_199_9e-3);
    p = M::mul_add(p, r, 8.333_452e-3);
    p = M::mul_add(p, r, 4.166_579_6e-2);
    p = M::mul_add(p, r, 1.666_666_5e-1);
    p = M::mul_add(p, r, 0.5);
    let r2 = r * r;
    let e = M::mul_add(p, r2, r) + 1.0;
    let scale = f32::from_bits((((n as i32) + 127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else {
        e * scale
    }
}

/// Replaces each score by `e^(s - max)` and returns their sum.
#[inline(always)]
fn exp_shift_sum<M: MulAdd>(s: &mut [f32], max: f32) -> f32 {
    let mut sums = [0.0f32; LANES];
    let mut chunks = s.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            c[l] = exp_nonpos::<M>(c[l] - max);
            sums[l] += c[l];
        }
    }
    let mut total = hsum(&sums);
    for x in chunks.into_remainder() {
        *x = exp_nonpos::<M>(*x - max);
        total += *x;
    }
    total
}

/// Largest element (scores are never NaN: inputs are finite); written over
/// 16 lanes with plain comparisons so it vectorises.
#[inline(always)]
fn max_of(s: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; LANES];
    let mut chunks = s.chunks_exact(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            m[l] = if c[l] > m[l] { c[l] } else { m[l] };
        }
    }
    // A balanced tree over the lanes: a left fold would be a 16-deep chain.
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            m[l] = if m[l + width] > m[l] {
                m[l + width]
            } else {
                m[l]
            };
        }
        width /= 2;
    }
    let mut best = m[0];
    for &x in chunks.remainder() {
        best = if x > best { x } else { best };
    }
    best
}

/// Hints the CPU to bring `data` into the cache.
#[inline(always)]
fn prefetch<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let bytes = std::mem::size_of_val(data);
        let ptr = data.as_ptr() as *const i8;
        let mut off = 0;
        while off < bytes {
            // SAFETY: a prefetch never faults, and `ptr + off` stays inside `data`.
            #[allow(unused_unsafe)]
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(ptr.add(off))
            };
            off += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// Widens `src` into `dst` (same length).
#[inline(always)]
fn widen<T: CacheElement>(src: &[T], dst: &mut [f32]) {
    for (o, &x) in dst.iter_mut().zip(src) {
        *o = x.to_f32();
    }
}

/// The kernel body: one item's rows over keys `key_lo..key_hi`, one cache
/// block (tile) at a time, with the softmax state updated per tile.
#[inline(always)]
fn attend_generic<T: CacheElement, M: MulAdd>(
    p: &Problem<'_, T>,
    item: &Item,
    key_lo: usize,
    key_hi: usize,
    state: &mut PartialState,
) {
    let d = p.shape.head_size;
    let bs = p.shape.block_size;
    let g = p.group;
    let nrows = item.row_hi - item.row_lo;
    let ctx_start = item.seq.seq_len - item.seq.q_len;

    // Queries of the item, pre-scaled, as f32: row (r, head) at (r * g + head) * d.
    let mut q = vec![0.0f32; nrows * g * d];
    for r in 0..nrows {
        let token = item.seq.q_start + item.row_lo + r;
        let src = &p.query[(token * p.num_heads + item.kv_head * g) * d..][..g * d];
        for (o, &x) in q[r * g * d..(r + 1) * g * d].iter_mut().zip(src) {
            *o = x.to_f32() * p.scale;
        }
    }
    // Visible key range [lo, hi) of each query row.
    let vis: Vec<(usize, usize)> = (0..nrows)
        .map(|r| {
            let pos = ctx_start + item.row_lo + r;
            let lo = if p.window > 0 {
                (pos + 1).saturating_sub(p.window)
            } else {
                0
            };
            (lo, pos + 1)
        })
        .collect();

    let mut kbuf = vec![
        0.0f32;
        if T::as_f32_slice(p.key_cache).is_some() {
            0
        } else {
            bs * d
        }
    ];
    let mut vbuf = kbuf.clone();
    let mut scores = vec![0.0f32; bs];
    let table = &p.block_tables[item.seq.seq * p.max_blocks..][..p.max_blocks];

    let mut t0 = key_lo;
    while t0 < key_hi {
        let block_idx = t0 / bs;
        let t1 = ((block_idx + 1) * bs).min(key_hi);
        let off0 = t0 - block_idx * bs;
        let n = t1 - t0;
        // Validated: the block id is in range for every block below seq_len.
        let block = table[block_idx] as usize;
        let base = ((block * p.shape.num_kv_heads + item.kv_head) * bs + off0) * d;
        if t1 < key_hi {
            // The next block is elsewhere in the pool (the hardware prefetcher
            // cannot guess it): ask for it while this one is computed.
            let next = table[t1 / bs] as usize;
            let next_base = (next * p.shape.num_kv_heads + item.kv_head) * bs * d;
            let next_n = (key_hi - t1).min(bs) * d;
            prefetch(&p.key_cache[next_base..next_base + next_n]);
            prefetch(&p.value_cache[next_base..next_base + next_n]);
        }
        let kraw = &p.key_cache[base..base + n * d];
        let vraw = &p.value_cache[base..base + n * d];
        let (keys, values): (&[f32], &[f32]) = match (T::as_f32_slice(kraw), T::as_f32_slice(vraw))
        {
            (Some(k), Some(v)) => (k, v),
            _ => {
                widen(kraw, &mut kbuf[..n * d]);
                widen(vraw, &mut vbuf[..n * d]);
                (&kbuf[..n * d], &vbuf[..n * d])
            }
        };

        for (r, &(vlo, vhi)) in vis.iter().enumerate() {
            let a = vlo.max(t0);
            let b = vhi.min(t1);
            if a >= b {
                continue;
            }
            let (ka, kb) = (a - t0, b - t0);
            for h in 0..g {
                let row = r * g + h;
                let qrow = &q[row * d..(row + 1) * d];
                let s = &mut scores[..kb - ka];
                let mut j = 0;
                while j + 8 <= s.len() && M::scores8(qrow, &keys[(ka + j) * d..], &mut s[j..j + 8])
                {
                    j += 8;
                }
                while j + 4 <= s.len() {
                    let t = ka + j;
                    let k4 = [
                        &keys[t * d..(t + 1) * d],
                        &keys[(t + 1) * d..(t + 2) * d],
                        &keys[(t + 2) * d..(t + 3) * d],
                        &keys[(t + 3) * d..(t + 4) * d],
                    ];
                    let r4 = dot4::<M>(qrow, k4);
                    s[j..j + 4].copy_from_slice(&r4);
                    j += 4;
                }
                while j < s.len() {
                    let t = ka + j;
                    s[j] = dot1::<M>(qrow, &keys[t * d..(t + 1) * d]);
                    j += 1;
                }
                let tile_max = max_of(s);
                let old_max = state.max[row];
                let acc = &mut state.acc[row * d..(row + 1) * d];
                let new_max = if tile_max > old_max {
                    if old_max > f32::NEG_INFINITY {
                        let alpha = exp_nonpos::<M>(old_max - tile_max);
                        state.sum[row] *= alpha;
                        for x in acc.iter_mut() {
                            *x *= alpha;
                        }
                    }
                    state.max[row] = tile_max;
                    tile_max
                } else {
                    old_max
                };
                state.sum[row] += exp_shift_sum::<M>(s, new_max);
                let mut j = 0;
                while j + 4 <= s.len() {
                    let t = ka + j;
                    let v4 = [
                        &values[t * d..(t + 1) * d],
                        &values[(t + 1) * d..(t + 2) * d],
                        &values[(t + 2) * d..(t + 3) * d],
                        &values[(t + 3) * d..(t + 4) * d],
                    ];
                    axpy4::<M>(acc, [s[j], s[j + 1], s[j + 2], s[j + 3]], v4);
                    j += 4;
                }
                while j < s.len() {
                    let t = ka + j;
                    axpy1::<M>(acc, s[j], &values[t * d..(t + 1) * d]);
                    j += 1;
                }
            }
        }
        t0 = t1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic pseudo-random numbers in [-1, 1) (xorshift).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn uniform(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    struct Case {
        shape: CacheShape,
        num_heads: usize,
        q_lens: Vec<usize>,
        seq_lens: Vec<usize>,
        window: i64,
    }

    struct Data {
        query: Vec<f32>,
        kc: Vec<f32>,
        vc: Vec<f32>,
        tables: Vec<i32>,
        max_blocks: usize,
        seq_lens: Vec<i32>,
        qsl: Vec<i32>,
    }

    fn make(case: &Case, rng: &mut Rng) -> Data {
        let s = case.shape;
        let num_tokens: usize = case.q_lens.iter().sum();
        let query = (0..num_tokens * case.num_heads * s.head_size)
            .map(|_| rng.uniform() * 2.0)
            .collect();
        let kc = (0..s.numel()).map(|_| rng.uniform() * 2.0).collect();
        let vc = (0..s.numel()).map(|_| rng.uniform()).collect();
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
        Data {
            query,
            kc,
            vc,
            tables,
            max_blocks,
            seq_lens: case.seq_lens.iter().map(|&l| l as i32).collect(),
            qsl,
        }
    }

    /// Straightforward f64 attention over gathered keys, for comparison.
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
                        .collect();
                    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let w: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                    let total: f64 = w.iter().sum();
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

    fn run<T: CacheElement>(
        case: &Case,
        data: &Data,
        scale: f32,
        plan: Plan,
        level: SimdLevel,
    ) -> Vec<f32> {
        let conv = |v: &[f32]| v.iter().map(|&x| T::from_f32(x)).collect::<Vec<T>>();
        let (q, kc, vc) = (conv(&data.query), conv(&data.kc), conv(&data.vc));
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
            &kc,
            &vc,
            case.shape,
            case.num_heads,
            batch,
            scale,
            case.window,
            plan,
            level,
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
            },
            // Prefill after a prefix mixed with decode, MQA, sliding window.
            Case {
                shape: shape(64, 1, 8, 64),
                num_heads: 4,
                q_lens: vec![23, 1, 9],
                seq_lens: vec![70, 129, 9],
                window: 17,
            },
            // Long single-sequence decode (partitions), head size not a multiple of 16.
            Case {
                shape: shape(80, 2, 32, 72),
                num_heads: 4,
                q_lens: vec![1],
                seq_lens: vec![2000],
                window: 0,
            },
            // Prefill with window longer than the sequence, MHA, head size 256.
            Case {
                shape: shape(12, 3, 16, 256),
                num_heads: 3,
                q_lens: vec![40, 0],
                seq_lens: vec![50, 5],
                window: 400,
            },
        ]
    }

    fn plans() -> Vec<Plan> {
        vec![
            Plan::production(),
            // Many tiny partitions and single-row chunks, to exercise the merge.
            Plan {
                rows_target: 1,
                min_partition: 8,
                tasks_per_thread: 16,
                threads: 8,
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
            for level in SimdLevel::available() {
                for plan in plans() {
                    let got = run::<f32>(&case, &data, scale, plan, level);
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (a - b).abs() <= 2e-5 + 1e-5 * b.abs(),
                            "{level:?} {plan:?} [{i}]: {a} vs {b}"
                        );
                    }
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
            for level in SimdLevel::available() {
                let got = run::<bf16>(&case, &data, scale, plans()[1], level);
                for (a, b) in got.iter().zip(&want) {
                    // Only the final rounding to bf16 (half an ulp, 2^-9 relative) differs.
                    assert!(
                        (a - b).abs() <= 1e-5 + b.abs() / 256.0,
                        "{level:?}: {a} vs {b}"
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
            for got in [exp_nonpos::<Plain>(x) as f64, exp_nonpos::<X86>(x) as f64] {
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
        assert_eq!(exp_nonpos::<Plain>(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpos::<Plain>(0.0), 1.0);
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

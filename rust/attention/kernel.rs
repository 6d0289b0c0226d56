//! The attention body, written once over `Simd`: one item's query rows
//! over a range of keys, one cache block at a time, with an online softmax.
//! The inner loops run over fixed 16-lane chunks so that LLVM vectorises them
//! for whichever ISA the entry point (`cpu::simd`) compiles them for.

use super::{Item, KvElem, PartialState, Problem};
use crate::cpu::simd::{Kernel, Simd};
use crate::cpu::{Element, Path};

/// One call of the body: an item over keys `key_lo..key_hi`.
pub(super) struct Attend<'a, 'p, T, C> {
    pub(super) p: &'a Problem<'p, T, C>,
    pub(super) item: &'a Item,
    pub(super) key_lo: usize,
    pub(super) key_hi: usize,
    pub(super) state: &'a mut PartialState,
}

impl<T: Element, C: KvElem<T>> Kernel for Attend<'_, '_, T, C> {
    type Output = ();

    #[inline(always)]
    fn run<S: Simd>(self) {
        attend_body::<T, C, S>(self.p, self.item, self.key_lo, self.key_hi, self.state)
    }
}

/// Scores of 8 consecutive key rows at once, where the ISA has the explicit
/// AVX2 + FMA score kernel (`x86.rs`) and the head size suits it; `false`
/// means "use `dot4`".
#[inline(always)]
fn scores8<S: Simd>(q: &[f32], keys: &[f32], out: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let d = q.len();
        if S::PATH == Path::Scalar || !d.is_multiple_of(8) || keys.len() < 8 * d || out.len() < 8 {
            return false;
        }
        // SAFETY: S is AVX2 or AVX-512, so this runs inside an entry point
        // whose CPU has AVX2 and FMA; lengths checked above.
        unsafe { super::x86::scores8(q.as_ptr(), keys.as_ptr(), d, out.as_mut_ptr()) };
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (q, keys, out);
        false
    }
}

pub(super) const LANES: usize = 16;

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
fn dot4<S: Simd>(q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
    let n = q.len() / LANES * LANES;
    let mut acc = [[0.0f32; LANES]; 4];
    let mut i = 0;
    while i < n {
        let qc = &q[i..i + LANES];
        for (a, kr) in acc.iter_mut().zip(&k) {
            let kc = &kr[i..i + LANES];
            for l in 0..LANES {
                a[l] = S::mul_add(qc[l], kc[l], a[l]);
            }
        }
        i += LANES;
    }
    let mut res = [hsum(&acc[0]), hsum(&acc[1]), hsum(&acc[2]), hsum(&acc[3])];
    for j in n..q.len() {
        for (r, kr) in res.iter_mut().zip(&k) {
            *r = S::mul_add(q[j], kr[j], *r);
        }
    }
    res
}

/// Dot product of two rows.
#[inline(always)]
fn dot1<S: Simd>(q: &[f32], k: &[f32]) -> f32 {
    let n = q.len() / LANES * LANES;
    let mut acc = [0.0f32; LANES];
    let mut i = 0;
    while i < n {
        let (qc, kc) = (&q[i..i + LANES], &k[i..i + LANES]);
        for l in 0..LANES {
            acc[l] = S::mul_add(qc[l], kc[l], acc[l]);
        }
        i += LANES;
    }
    let mut res = hsum(&acc);
    for j in n..q.len() {
        res = S::mul_add(q[j], k[j], res);
    }
    res
}

/// `acc += w[0] * v[0] + .. + w[3] * v[3]`, one pass over `acc`.
#[inline(always)]
fn axpy4<S: Simd>(acc: &mut [f32], w: [f32; 4], v: [&[f32]; 4]) {
    let d = acc.len();
    let (v0, v1, v2, v3) = (&v[0][..d], &v[1][..d], &v[2][..d], &v[3][..d]);
    for j in 0..d {
        let mut a = acc[j];
        a = S::mul_add(w[0], v0[j], a);
        a = S::mul_add(w[1], v1[j], a);
        a = S::mul_add(w[2], v2[j], a);
        a = S::mul_add(w[3], v3[j], a);
        acc[j] = a;
    }
}

/// `acc += w * v`.
#[inline(always)]
fn axpy1<S: Simd>(acc: &mut [f32], w: f32, v: &[f32]) {
    let v = &v[..acc.len()];
    for (a, &x) in acc.iter_mut().zip(v) {
        *a = S::mul_add(w, x, *a);
    }
}

/// `e^x` for `x <= 0` (scores minus their running max), ~1 ulp, written
/// without branches or library calls so a loop over it vectorises. Inputs
/// below -87 (including -inf) give 0.
#[inline(always)]
pub(super) fn exp_nonpos<S: Simd>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let xc = if x < -87.0 { -87.0 } else { x };
    let n = (xc * LOG2E + ROUND) - ROUND;
    let r = S::mul_add(n, -LN2_LO, S::mul_add(n, -LN2_HI, xc));
    let mut p = 1.987_569_1e-4f32;
    p = S::mul_add(p, r, 1.398_199_9e-3);
    p = S::mul_add(p, r, 8.333_452e-3);
    p = S::mul_add(p, r, 4.166_579_6e-2);
    p = S::mul_add(p, r, 1.666_666_5e-1);
    p = S::mul_add(p, r, 0.5);
    let r2 = r * r;
    let e = S::mul_add(p, r2, r) + 1.0;
    let scale = f32::from_bits((((n as i32) + 127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else {
        e * scale
    }
}

/// Replaces each score by `e^(s - max)` and returns their sum.
#[inline(always)]
fn exp_shift_sum<S: Simd>(s: &mut [f32], max: f32) -> f32 {
    let mut sums = [0.0f32; LANES];
    let mut chunks = s.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            c[l] = exp_nonpos::<S>(c[l] - max);
            sums[l] += c[l];
        }
    }
    let mut total = hsum(&sums);
    for x in chunks.into_remainder() {
        *x = exp_nonpos::<S>(*x - max);
        total += *x;
    }
    total
}

/// `cap * tanh(s / cap)` for each score, as `sign * (1 - e) / (1 + e)` with
/// `e = exp(-2 |s| / cap)` (branch-free, so the loop vectorises); exact to
/// a few ulp of the cap.
#[inline(always)]
fn soft_cap<S: Simd>(s: &mut [f32], cap: f32) {
    let inv = -2.0 / cap;
    for x in s.iter_mut() {
        let e = exp_nonpos::<S>(x.abs() * inv);
        let t = cap * (1.0 - e) / (1.0 + e);
        *x = if *x < 0.0 { -t } else { t };
    }
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

/// The kernel body: one item's rows over keys `key_lo..key_hi`, one cache
/// block (tile) at a time, with the softmax state updated per tile.
#[inline(always)]
fn attend_body<T: Element, C: KvElem<T>, S: Simd>(
    p: &Problem<'_, T, C>,
    item: &Item,
    key_lo: usize,
    key_hi: usize,
    state: &mut PartialState,
) {
    let d = p.shape.head_size;
    // Elements of one stored row (an 8-bit row carries its scale).
    let stride = d + C::EXTRA;
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
        if C::f32_rows(&p.key_cache[..0]).is_some() {
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
        let base = ((block * p.shape.num_kv_heads + item.kv_head) * bs + off0) * stride;
        if t1 < key_hi {
            // The next block is elsewhere in the pool (the hardware prefetcher
            // cannot guess it): ask for it while this one is computed.
            let next = table[t1 / bs] as usize;
            let next_base = (next * p.shape.num_kv_heads + item.kv_head) * bs * stride;
            let next_n = (key_hi - t1).min(bs) * stride;
            prefetch(&p.key_cache[next_base..next_base + next_n]);
            prefetch(&p.value_cache[next_base..next_base + next_n]);
        }
        let kraw = &p.key_cache[base..base + n * stride];
        let vraw = &p.value_cache[base..base + n * stride];
        let (keys, values): (&[f32], &[f32]) = match (C::f32_rows(kraw), C::f32_rows(vraw)) {
            (Some(k), Some(v)) => (k, v),
            _ => {
                C::widen_rows(kraw, d, &mut kbuf[..n * d]);
                C::widen_rows(vraw, d, &mut vbuf[..n * d]);
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
                while j + 8 <= s.len()
                    && scores8::<S>(qrow, &keys[(ka + j) * d..], &mut s[j..j + 8])
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
                    let r4 = dot4::<S>(qrow, k4);
                    s[j..j + 4].copy_from_slice(&r4);
                    j += 4;
                }
                while j < s.len() {
                    let t = ka + j;
                    s[j] = dot1::<S>(qrow, &keys[t * d..(t + 1) * d]);
                    j += 1;
                }
                if p.softcap > 0.0 {
                    soft_cap::<S>(s, p.softcap);
                }
                let tile_max = max_of(s);
                let old_max = state.max[row];
                let acc = &mut state.acc[row * d..(row + 1) * d];
                let new_max = if tile_max > old_max {
                    if old_max > f32::NEG_INFINITY {
                        let alpha = exp_nonpos::<S>(old_max - tile_max);
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
                state.sum[row] += exp_shift_sum::<S>(s, new_max);
                let mut j = 0;
                while j + 4 <= s.len() {
                    let t = ka + j;
                    let v4 = [
                        &values[t * d..(t + 1) * d],
                        &values[(t + 1) * d..(t + 2) * d],
                        &values[(t + 2) * d..(t + 3) * d],
                        &values[(t + 3) * d..(t + 4) * d],
                    ];
                    axpy4::<S>(acc, [s[j], s[j + 1], s[j + 2], s[j + 3]], v4);
                    j += 4;
                }
                while j < s.len() {
                    let t = ka + j;
                    axpy1::<S>(acc, s[j], &values[t * d..(t + 1) * d]);
                    j += 1;
                }
            }
        }
        t0 = t1;
    }
}

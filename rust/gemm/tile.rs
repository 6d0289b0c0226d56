//! The GEMM's register tile, written once over [`Simd`]: `R` rows of `x` x
//! one panel of 32 output features, accumulated in f32 with FMA (AVX-512:
//! `R` up to 12, 24 accumulators; scalar: up to 4). AVX2 (16 registers)
//! takes up to 2 rows x 32 features (8 accumulators) or up to 6 rows x 16
//! features (12), the panel's two halves one after the other. Each weight
//! line is loaded (and widened, for bf16) once per tile (or part) and each
//! element of `x` broadcast from memory.

use super::NR;
use crate::cpu::simd::{Kernel, Simd};

/// How far ahead (in lines) the one-row kernel prefetches each of the
/// four segments of its panel.
const PREFETCH_LINES: usize = 16;

/// Whether one-row bf16 tiles read their panel as four segments, where the
/// path can (`Simd::SEGMENTED_ROW`): on Intel's CPUs (see
/// `one_row_segmented`), unless a test forces a choice (`SEGMENTS`).
fn segmented_rows() -> bool {
    match SEGMENTS.load(std::sync::atomic::Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => crate::cpu::features::is_intel(),
    }
}

/// 0: by CPU vendor; 1: segments; 2: one stream (tests run both kernels
/// on any CPU).
pub(super) static SEGMENTS: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// One tile call: `R` rows of `x` (stride `stride`) x `kc` lines of the
/// panel at `b`, sums into `out[..R]` (added to what `out` holds if `add`).
/// Each `R` is a kernel of its own, so that each gets its own entry point
/// (one function per height: the register allocator sees one tile at a
/// time, and keeps its sums in registers).
pub(super) struct Tile<const R: usize> {
    pub(super) x: *const f32,
    pub(super) stride: usize,
    pub(super) kc: usize,
    pub(super) b: *const u8,
    pub(super) bf16: bool,
    pub(super) add: bool,
    pub(super) out: *mut [f32; NR],
}

impl<const R: usize> Kernel for Tile<R> {
    type Output = ();

    #[inline(always)]
    fn run<S: Simd>(self) {
        let Tile {
            x,
            stride,
            kc,
            b,
            bf16,
            add,
            out,
        } = self;
        let t = Args {
            x,
            stride,
            kc,
            b,
            add,
            out,
        };
        // SAFETY: the caller checked the path and that x holds `R` rows of
        // `kc` (stride `stride`), the panel `kc` lines (bf16) or 2 `kc` (f32)
        // and `out` `R` rows.
        unsafe { tile_rows::<S, R>(t, bf16) }
    }
}

/// A tile's pointers, as [`Tile`] has them.
#[derive(Clone, Copy)]
struct Args {
    x: *const f32,
    stride: usize,
    kc: usize,
    b: *const u8,
    add: bool,
    out: *mut [f32; NR],
}

/// A tile of `R` rows x 32 features: at once up to `S::FULL_ROW_ROWS` rows,
/// else as `S::PARTS` parts of the panel one after the other (each reads
/// the same lines of `x` and of the panel, from L1).
///
/// # Safety
/// Runs inside `S`'s entry point; `x` points to `R` rows of `kc` f32 (stride
/// `stride`), `b` to a 64-byte aligned panel of `kc` lines (bf16) or `2kc`
/// (f32), `out` to `R` rows.
#[inline(always)]
unsafe fn tile_rows<S: Simd, const R: usize>(t: Args, bf16: bool) {
    if R > S::FULL_ROW_ROWS && S::PARTS == 2 {
        tile_part::<S, R, 0>(t, bf16);
        tile_part::<S, R, 1>(t, bf16);
        return;
    }
    let Args {
        x,
        stride,
        kc,
        b,
        add,
        out,
    } = t;
    // Sums continue from `out` when adding, so that a row's sums are the
    // same whether k is taken in blocks or at once.
    let mut acc = [S::zero_row(); R];
    if add {
        for (r, a) in acc.iter_mut().enumerate() {
            *a = loaded::<S, _>(*a, (*out.add(r)).as_ptr());
        }
    }
    if bf16 && R == 1 && S::SEGMENTED_ROW && segmented_rows() {
        let seg = one_row_segmented::<S>(x, kc, b);
        if add {
            for (v, s) in acc[0].as_mut().iter_mut().zip(seg.as_ref()) {
                *v = S::add(*v, *s);
            }
        } else {
            acc[0] = seg;
        }
    } else if bf16 {
        for kk in 0..kc {
            let w = S::widen_bf16_row(b.add(kk * 64));
            accumulate::<S, R, _>(&mut acc, w.as_ref(), x, stride, kk);
        }
    } else {
        for kk in 0..kc {
            let w = S::load_row(b.add(kk * 128) as *const f32);
            accumulate::<S, R, _>(&mut acc, w.as_ref(), x, stride, kk);
        }
    }
    for (r, sums) in acc.iter().enumerate() {
        let o = (*out.add(r)).as_mut_ptr();
        for (q, v) in sums.as_ref().iter().enumerate() {
            S::store(o.add(q * S::LANES), *v);
        }
    }
}

/// Part `P` of a tile of `R` rows: features `P * 32 / PARTS..` of the panel.
///
/// # Safety
/// As for `tile_rows`.
#[inline(always)]
unsafe fn tile_part<S: Simd, const R: usize, const P: usize>(t: Args, bf16: bool) {
    let Args {
        x,
        stride,
        kc,
        b,
        add,
        out,
    } = t;
    let f0 = P * NR / S::PARTS;
    let mut acc = [S::zero_part(); R];
    if add {
        for (r, a) in acc.iter_mut().enumerate() {
            *a = loaded::<S, _>(*a, (*out.add(r)).as_ptr().add(f0));
        }
    }
    if bf16 {
        for kk in 0..kc {
            let w = S::widen_bf16_part::<P>(b.add(kk * 64));
            accumulate::<S, R, _>(&mut acc, w.as_ref(), x, stride, kk);
        }
    } else {
        for kk in 0..kc {
            let w = S::load_part::<P>(b.add(kk * 128) as *const f32);
            accumulate::<S, R, _>(&mut acc, w.as_ref(), x, stride, kk);
        }
    }
    for (r, sums) in acc.iter().enumerate() {
        let o = (*out.add(r)).as_mut_ptr().add(f0);
        for (q, v) in sums.as_ref().iter().enumerate() {
            S::store(o.add(q * S::LANES), *v);
        }
    }
}

/// `v` (a row or a part) filled from the f32 at `p` (any alignment).
#[inline(always)]
unsafe fn loaded<S: Simd, V: AsMut<[S::F32]>>(mut v: V, p: *const f32) -> V {
    for (q, e) in v.as_mut().iter_mut().enumerate() {
        *e = S::load(p.add(q * S::LANES));
    }
    v
}

/// `acc[r] += x[r, kk] * w` for every row of the tile (`w`: the vectors of
/// a row or of a part).
#[inline(always)]
unsafe fn accumulate<S: Simd, const R: usize, A: AsMut<[S::F32]>>(
    acc: &mut [A; R],
    w: &[S::F32],
    x: *const f32,
    stride: usize,
    kk: usize,
) {
    for (r, row) in acc.iter_mut().enumerate() {
        let a = S::splat(*x.add(r * stride + kk));
        for (sum, wq) in row.as_mut().iter_mut().zip(w) {
            *sum = S::fmadd(a, *wq, *sum);
        }
    }
}

/// One row of bf16 weights, which is memory-bound: the panel is read as four
/// segments at once. Four streams keep more lines in flight than one (the
/// hardware prefetchers stop at every 4 KB page of a stream), each
/// prefetched ahead, and give four independent chains of accumulators.
/// On Intel's CPUs only: on an AMD EPYC with AVX-512 the same panels stream
/// at 0.6 of the triad bandwidth this way and 0.96 as one stream (Phi-4-mini's
/// MLP matrices, 2 threads), as the hardware prefetchers there follow one
/// stream well and the software prefetches only add traffic.
///
/// # Safety
/// As for `tile_rows` with one row.
#[inline(always)]
unsafe fn one_row_segmented<S: Simd>(x: *const f32, k: usize, b: *const u8) -> S::Row {
    let seg = k / 4;
    let mut acc = [S::zero_row(); 4];
    for i in 0..seg {
        if i % 2 == 0 {
            // Every other line: the adjacent-line prefetcher brings the rest.
            for u in 0..4 {
                S::prefetch(b.wrapping_add((u * seg + i + PREFETCH_LINES) * 64));
            }
        }
        for (u, sums) in acc.iter_mut().enumerate() {
            let kk = u * seg + i;
            let w = S::widen_bf16_row(b.add(kk * 64));
            let a = S::splat(*x.add(kk));
            for (sum, wq) in sums.as_mut().iter_mut().zip(w.as_ref()) {
                *sum = S::fmadd(a, *wq, *sum);
            }
        }
    }
    for kk in 4 * seg..k {
        let w = S::widen_bf16_row(b.add(kk * 64));
        let a = S::splat(*x.add(kk));
        for (sum, wq) in acc[0].as_mut().iter_mut().zip(w.as_ref()) {
            *sum = S::fmadd(a, *wq, *sum);
        }
    }
    let mut total = S::zero_row();
    for (q, t) in total.as_mut().iter_mut().enumerate() {
        let (a, b) = (acc[0].as_ref()[q], acc[1].as_ref()[q]);
        let (c, d) = (acc[2].as_ref()[q], acc[3].as_ref()[q]);
        *t = S::add(S::add(a, b), S::add(c, d));
    }
    total
}

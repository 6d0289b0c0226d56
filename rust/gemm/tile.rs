//! The GEMM's register tile, written once over [`Simd`]: `R` rows of `x` x
//! one panel of 32 output features, accumulated in f32 with FMA (AVX-512:
//! `R` up to 12, 24 accumulators; AVX2: up to 3, 12; scalar: up to 4).
//! Each weight line is loaded (and widened, for bf16) once per tile and each
//! element of `x` broadcast from memory.

use super::NR;
use crate::cpu::simd::{Kernel, Simd};

/// How far ahead (in lines) the one-row kernel prefetches each of the
/// four segments of its panel.
const PREFETCH_LINES: usize = 16;

/// One tile call: `rows` rows of `x` (stride `k`) x the panel at `b`, sums
/// into `tile[..rows]`.
pub(super) struct Tile<'a> {
    pub(super) x: *const f32,
    pub(super) k: usize,
    pub(super) b: *const u8,
    pub(super) bf16: bool,
    pub(super) rows: usize,
    pub(super) tile: &'a mut [[f32; NR]; 12],
}

impl Kernel for Tile<'_> {
    type Output = ();

    #[inline(always)]
    fn run<S: Simd>(self) {
        let Tile {
            x,
            k,
            b,
            bf16,
            rows,
            tile,
        } = self;
        macro_rules! each_rows {
            ($($r:literal)*) => {
                match rows {
                    // SAFETY: the caller checked the path and that x holds
                    // `rows` rows of k and the panel k lines (bf16) or 2k (f32).
                    $($r => unsafe { tile_rows::<S, $r>(x, k, b, bf16, tile) },)*
                    _ => unreachable!("tile rows exceed the path's maximum"),
                }
            };
        }
        each_rows!(1 2 3 4 5 6 7 8 9 10 11 12);
    }
}

/// A tile of `R` rows x 32 features.
///
/// # Safety
/// Runs inside `S`'s entry point; `x` points to `R` rows of `k` f32 (stride
/// `k`), `b` to a 64-byte aligned panel of `k` lines (bf16) or `2k` (f32).
#[inline(always)]
unsafe fn tile_rows<S: Simd, const R: usize>(
    x: *const f32,
    k: usize,
    b: *const u8,
    bf16: bool,
    tile: &mut [[f32; NR]; 12],
) {
    let mut acc = [S::zero_row(); R];
    if bf16 && R == 1 && S::SEGMENTED_ROW {
        acc[0] = one_row_segmented::<S>(x, k, b);
    } else if bf16 {
        for kk in 0..k {
            let w = S::widen_bf16_row(b.add(kk * 64));
            accumulate::<S, R>(&mut acc, &w, x, k, kk);
        }
    } else {
        for kk in 0..k {
            let w = S::load_row(b.add(kk * 128) as *const f32);
            accumulate::<S, R>(&mut acc, &w, x, k, kk);
        }
    }
    for (sums, out) in acc.iter().zip(tile.iter_mut()) {
        for (q, v) in sums.as_ref().iter().enumerate() {
            S::store(out.as_mut_ptr().add(q * S::LANES), *v);
        }
    }
}

/// `acc[r] += x[r, kk] * w` for every row of the tile.
#[inline(always)]
unsafe fn accumulate<S: Simd, const R: usize>(
    acc: &mut [S::Row; R],
    w: &S::Row,
    x: *const f32,
    k: usize,
    kk: usize,
) {
    for (r, row) in acc.iter_mut().enumerate() {
        let a = S::splat(*x.add(r * k + kk));
        for (sum, wq) in row.as_mut().iter_mut().zip(w.as_ref()) {
            *sum = S::fmadd(a, *wq, *sum);
        }
    }
}

/// One row of bf16 weights, which is memory-bound: the panel is read as four
/// segments at once. Four streams keep more lines in flight than one (the
/// hardware prefetchers stop at every 4 KB page of a stream), each
/// prefetched ahead, and give four independent chains of accumulators.
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

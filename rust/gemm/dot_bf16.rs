//! The bf16 dot-product tile (`vdpbf16ps`, AVX512-BF16): bf16 rows of `x`
//! against a bf16 panel, on the `avx512bf16` path.
//!
//! `vdpbf16ps` multiplies two pairs of bf16 per 32-bit lane and adds both
//! products to the lane's f32 sum (each product is exact in f32; the two
//! adds round, as two FMAs would, with denormals flushed). The panel's
//! lines hold one `k` each (word `j`: feature `j` low, `16 + j` high), so a
//! pair of lines `k, k + 1` is interleaved by two single-cycle unpacks
//! (`vpunpcklwd` / `vpunpckhwd`, within each 128-bit lane) into 32 features
//! with their `k, k + 1` pairs side by side, in the unpacks' lane order;
//! each row's pair `x[k], x[k + 1]` is one 32-bit broadcast. The sums are
//! put back in feature order once per tile (two `vpermt2ps` per row), not
//! once per pair of lines: against two word permutes (`vpermt2w`) per pair,
//! the BERT-base shapes ran 1.04-1.25x at M = 16-1024 on a Zen 4, side by
//! side in one process, with equal outputs. A tile of `R` rows takes 2 `R`
//! dot products per two `k` where the FMA tile takes 4 `R` FMAs (and 4
//! widenings): twice the multiply-adds per instruction, which is where the
//! CPUs that run it at the FMA's rate gain (see `default_path`).
//!
//! The same weights and rows of `x` give the same sums in any call (one
//! order of additions for every tile height, and a tile's sum of its `k`
//! range is added to what `out` holds at the end), so a row's output does
//! not depend on the rows beside it.

use super::NR;

/// Rows of `x` a tile takes at most (24 sums, 2 lines, the broadcast and
/// the two paired lines: 29 of the 32 registers).
pub(super) const MAX_ROWS: usize = 12;

/// One tile: `R` rows of bf16 `x` (as bits, stride `stride`, from the
/// row's element `k0`) x `kc` lines of the panel at `b` (`k0` even); sums
/// into `out[..R]`, added to what it holds if `add`.
pub(super) struct DotTile {
    pub(super) x: *const u16,
    pub(super) stride: usize,
    pub(super) kc: usize,
    pub(super) b: *const u8,
    pub(super) add: bool,
    pub(super) out: *mut [f32; NR],
}

/// Runs one tile of `rows` rows (1..=`MAX_ROWS`).
///
/// # Safety
/// AVX512-BF16 (with AVX-512F/BW) is available; `x` holds `rows` rows of
/// `kc` bf16 (stride `stride`), `b` a 64-byte aligned panel of `kc` lines,
/// `out` `rows` rows.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn run(t: DotTile, rows: usize) {
    macro_rules! each_rows {
        ($($r:literal)*) => {
            match rows {
                $($r => tile::<$r>(t),)*
                _ => unreachable!("dot tile rows exceed {MAX_ROWS}"),
            }
        };
    }
    each_rows!(1 2 3 4 5 6 7 8 9 10 11 12);
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn run(_t: DotTile, _rows: usize) {
    unreachable!("the avx512bf16 path exists on x86_64 only")
}

/// The dword indices of `vpermt2ps` that put the sums of a tile's two
/// accumulators back in feature order: features 0..16 (`high == false`) or
/// 16..32, each as an index into the first accumulator (0..16) or the
/// second (16..32).
///
/// `vpunpcklwd` / `vpunpckhwd` of lines `k`, `k + 1` pair word `w` of both
/// lines in lane `4 (w / 8) + w % 4` of the first (`w % 8 < 4`) or the
/// second (`w % 8 >= 4`) result; a line's word `w` holds feature `w / 2`
/// (even `w`) or `16 + w / 2` (odd `w`).
#[cfg(target_arch = "x86_64")]
fn feature_indices(high: bool) -> [u32; 16] {
    let mut idx = [0u32; 16];
    for w in 0..32u32 {
        let feature = if w % 2 == 0 { w / 2 } else { 16 + w / 2 };
        let lane = 4 * (w / 8) + w % 4;
        let src = if w % 8 < 4 { lane } else { 16 + lane };
        if (feature >= 16) == high {
            idx[(feature % 16) as usize] = src;
        }
    }
    idx
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn tile<const R: usize>(t: DotTile) {
    use std::arch::x86_64::*;
    let DotTile {
        x,
        stride,
        kc,
        b,
        add,
        out,
    } = t;
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    // One step: lines `kk`, `kk + 1` (`next` the second line, or zeros
    // past an odd `kc`) paired word by word within each 128-bit lane (two
    // single-cycle unpacks; the sums come out in the lanes' order, put back
    // in feature order once per tile) against each row's pair.
    macro_rules! step {
        ($kk:expr, $next:expr, $pair:expr) => {{
            let l0 = _mm512_load_si512(b.add($kk * 64) as *const _);
            let l1 = $next;
            let w0: __m512bh = std::mem::transmute(_mm512_unpacklo_epi16(l0, l1));
            let w1: __m512bh = std::mem::transmute(_mm512_unpackhi_epi16(l0, l1));
            for (r, a) in acc.iter_mut().enumerate() {
                let xr: __m512bh = std::mem::transmute(_mm512_set1_epi32($pair(r)));
                a[0] = _mm512_dpbf16_ps(a[0], w0, xr);
                a[1] = _mm512_dpbf16_ps(a[1], w1, xr);
            }
        }};
    }
    let pairs = kc / 2;
    for kp in 0..pairs {
        let kk = 2 * kp;
        step!(
            kk,
            _mm512_load_si512(b.add((kk + 1) * 64) as *const _),
            |r: usize| (x.add(r * stride + kk) as *const i32).read_unaligned()
        );
    }
    if kc % 2 == 1 {
        let kk = kc - 1;
        // The last line alone: its pair's second weight and x are zero.
        step!(kk, _mm512_setzero_si512(), |r: usize| i32::from(
            *x.add(r * stride + kk)
        ));
    }
    let lo_idx = _mm512_loadu_si512(feature_indices(false).as_ptr() as *const _);
    let hi_idx = _mm512_loadu_si512(feature_indices(true).as_ptr() as *const _);
    for (r, a) in acc.iter().enumerate() {
        let o = (*out.add(r)).as_mut_ptr();
        let mut lo = _mm512_permutex2var_ps(a[0], lo_idx, a[1]);
        let mut hi = _mm512_permutex2var_ps(a[0], hi_idx, a[1]);
        if add {
            lo = _mm512_add_ps(_mm512_loadu_ps(o), lo);
            hi = _mm512_add_ps(_mm512_loadu_ps(o.add(16)), hi);
        }
        _mm512_storeu_ps(o, lo);
        _mm512_storeu_ps(o.add(16), hi);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn feature_indices_name_every_lane_once() {
        let lo = super::feature_indices(false);
        let hi = super::feature_indices(true);
        // Feature 0 is word 0: lane 0 of the first unpack; feature 16 is
        // word 1: lane 1 of it; feature 2 is word 4: lane 0 of the second.
        assert_eq!(lo[0], 0);
        assert_eq!(hi[0], 1);
        assert_eq!(lo[2], 16);
        let mut seen: Vec<u32> = lo.iter().chain(&hi).copied().collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..32).collect::<Vec<u32>>());
    }
}

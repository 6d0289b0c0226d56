//! The bf16 dot-product tile (`vdpbf16ps`, AVX512-BF16): bf16 rows of `x`
//! against a bf16 panel, on the `avx512bf16` path.
//!
//! `vdpbf16ps` multiplies two pairs of bf16 per 32-bit lane and adds both
//! products to the lane's f32 sum (each product is exact in f32; the two
//! adds round, as two FMAs would, with denormals flushed). The panel's
//! lines hold one `k` each (word `j`: feature `j` low, `16 + j` high), so a
//! pair of lines `k, k + 1` is interleaved by two `vpermt2w` into features
//! 0..16 and 16..32 with their `k, k + 1` pairs side by side; each row's
//! pair `x[k], x[k + 1]` is one 32-bit broadcast. A tile of `R` rows then
//! takes 2 `R` dot products per two `k` where the FMA tile takes 4 `R` FMAs
//! (and 4 widenings): twice the multiply-adds per instruction, which is
//! where the CPUs that run it at the FMA's rate gain (see `default_path`).
//!
//! The same weights and rows of `x` give the same sums in any call (one
//! order of additions for every tile height), so a row's output does not
//! depend on the rows beside it.

use super::NR;

/// Rows of `x` a tile takes at most (24 sums, 2 weight vectors, the
/// broadcast and the two permutations: 29 of the 32 registers).
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

/// The word indices of `vpermt2w` that interleave lines `k` (indices
/// 0..32) and `k + 1` (32..64): features 0..16 (`HIGH == false`) or 16..32,
/// each as the pair (`k`, `k + 1`).
#[cfg(target_arch = "x86_64")]
fn pair_indices(high: bool) -> [u16; 32] {
    let mut idx = [0u16; 32];
    for j in 0..16 {
        let word = 2 * j as u16 + u16::from(high);
        idx[2 * j] = word;
        idx[2 * j + 1] = 32 + word;
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
    let lo_idx = _mm512_loadu_si512(pair_indices(false).as_ptr() as *const _);
    let hi_idx = _mm512_loadu_si512(pair_indices(true).as_ptr() as *const _);
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    if add {
        for (r, a) in acc.iter_mut().enumerate() {
            let o = (*out.add(r)).as_ptr();
            *a = [_mm512_loadu_ps(o), _mm512_loadu_ps(o.add(16))];
        }
    }
    // One step: the interleaved weights of lines `kk`, `kk + 1` (`next` the
    // second line, or zeros past an odd `kc`) against each row's pair.
    macro_rules! step {
        ($kk:expr, $next:expr, $pair:expr) => {{
            let l0 = _mm512_load_si512(b.add($kk * 64) as *const _);
            let l1 = $next;
            let w0: __m512bh = std::mem::transmute(_mm512_permutex2var_epi16(l0, lo_idx, l1));
            let w1: __m512bh = std::mem::transmute(_mm512_permutex2var_epi16(l0, hi_idx, l1));
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
    for (r, a) in acc.iter().enumerate() {
        let o = (*out.add(r)).as_mut_ptr();
        _mm512_storeu_ps(o, a[0]);
        _mm512_storeu_ps(o.add(16), a[1]);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn pair_indices_interleave_the_two_lines() {
        let lo = super::pair_indices(false);
        let hi = super::pair_indices(true);
        assert_eq!(&lo[..4], &[0, 32, 2, 34]);
        assert_eq!(&hi[..4], &[1, 33, 3, 35]);
        assert_eq!(lo[31], 62);
        assert_eq!(hi[31], 63);
    }
}

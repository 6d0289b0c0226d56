//! Explicit AVX2 + FMA code for the query-key products, where the portable
//! formulation spends most of its time in horizontal sums. (AVX2 rather than
//! AVX-512 intrinsics: the latter need a newer compiler than the crate's MSRV.)
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

//! AVX2 with FMA: 8 f32 lanes.

use std::arch::x86_64::*;

use super::{Kernel, Simd};
use crate::cpu::Path;

/// The AVX2 code of every kernel.
#[derive(Clone, Copy, Debug)]
pub struct Avx2;

impl Simd for Avx2 {
    const PATH: Path = Path::Avx2;
    const LANES: usize = 8;
    const SEGMENTED_ROW: bool = false;
    // 16 ymm registers: a full row is 4 vectors (2 rows of sums, 8
    // registers, plus the widened line); taller tiles take half a row at a
    // time, 2 vectors, so that 6 rows of sums (12 registers), the half line
    // (2), the broadcast x and the bf16 mask fit.
    const FULL_ROW_ROWS: usize = 2;
    const PARTS: usize = 2;
    type F32 = __m256;
    type Row = [__m256; 4];
    type Part = [__m256; 2];

    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
    #[inline(always)]
    unsafe fn zero() -> __m256 {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn zero_row() -> [__m256; 4] {
        [_mm256_setzero_ps(); 4]
    }
    #[inline(always)]
    unsafe fn zero_part() -> [__m256; 2] {
        [_mm256_setzero_ps(); 2]
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> __m256 {
        _mm256_set1_ps(v)
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        _mm256_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn load_row(p: *const f32) -> [__m256; 4] {
        [
            _mm256_load_ps(p),
            _mm256_load_ps(p.add(8)),
            _mm256_load_ps(p.add(16)),
            _mm256_load_ps(p.add(24)),
        ]
    }
    #[inline(always)]
    unsafe fn widen_bf16_row(p: *const u8) -> [__m256; 4] {
        // Words 0..8 hold features 0..8 (low) and 16..24 (high); words 8..16
        // hold 8..16 and 24..32.
        let l0 = _mm256_load_si256(p as *const __m256i);
        let l1 = _mm256_load_si256(p.add(32) as *const __m256i);
        let mask = _mm256_set1_epi32(0xffff_0000u32 as i32);
        [
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(l0)),
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(l1)),
            _mm256_castsi256_ps(_mm256_and_si256(l0, mask)),
            _mm256_castsi256_ps(_mm256_and_si256(l1, mask)),
        ]
    }
    #[inline(always)]
    unsafe fn load_part<const P: usize>(p: *const f32) -> [__m256; 2] {
        // Features 16 * P.. are the second 64 bytes of the row for P = 1.
        [
            _mm256_load_ps(p.add(16 * P)),
            _mm256_load_ps(p.add(16 * P + 8)),
        ]
    }
    #[inline(always)]
    unsafe fn widen_bf16_part<const P: usize>(p: *const u8) -> [__m256; 2] {
        // Part 0 (features 0..16) is the low halves of the line's 16 words,
        // part 1 (16..32) their high halves.
        let l0 = _mm256_load_si256(p as *const __m256i);
        let l1 = _mm256_load_si256(p.add(32) as *const __m256i);
        if P == 0 {
            [
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(l0)),
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(l1)),
            ]
        } else {
            let mask = _mm256_set1_epi32(0xffff_0000u32 as i32);
            [
                _mm256_castsi256_ps(_mm256_and_si256(l0, mask)),
                _mm256_castsi256_ps(_mm256_and_si256(l1, mask)),
            ]
        }
    }
    #[inline(always)]
    unsafe fn prefetch(p: *const u8) {
        _mm_prefetch::<_MM_HINT_T0>(p as *const i8)
    }
}

/// The AVX2 entry point: `kernel`'s body compiled with these features.
///
/// # Safety
/// `Path::Avx2.is_available()` must hold.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn run<K: Kernel>(kernel: K) -> K::Output {
    kernel.run::<Avx2>()
}

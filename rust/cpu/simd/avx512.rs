//! AVX-512 (F/BW/VL, with AVX2 and FMA): 16 f32 lanes.

use std::arch::x86_64::*;

use super::{Kernel, Simd};
use crate::cpu::Path;

/// The AVX-512 code of every kernel.
#[derive(Clone, Copy, Debug)]
pub struct Avx512;

impl Simd for Avx512 {
    const PATH: Path = Path::Avx512;
    const LANES: usize = 16;
    const SEGMENTED_ROW: bool = true;
    // 32 zmm registers hold 12 rows of full-row sums.
    const FULL_ROW_ROWS: usize = 12;
    const PARTS: usize = 1;
    type F32 = __m512;
    type Row = [__m512; 2];
    type Part = [__m512; 2];

    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
    #[inline(always)]
    unsafe fn zero() -> __m512 {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn zero_row() -> [__m512; 2] {
        [_mm512_setzero_ps(); 2]
    }
    #[inline(always)]
    unsafe fn zero_part() -> [__m512; 2] {
        [_mm512_setzero_ps(); 2]
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> __m512 {
        _mm512_set1_ps(v)
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        _mm512_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn load_row(p: *const f32) -> [__m512; 2] {
        [_mm512_load_ps(p), _mm512_load_ps(p.add(16))]
    }
    #[inline(always)]
    unsafe fn widen_bf16_row(p: *const u8) -> [__m512; 2] {
        let line = _mm512_load_si512(p as *const _);
        let mask = _mm512_set1_epi32(0xffff_0000u32 as i32);
        [
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(line)),
            _mm512_castsi512_ps(_mm512_and_si512(line, mask)),
        ]
    }
    #[inline(always)]
    unsafe fn load_part<const P: usize>(p: *const f32) -> [__m512; 2] {
        // One part: the whole row.
        Self::load_row(p)
    }
    #[inline(always)]
    unsafe fn widen_bf16_part<const P: usize>(p: *const u8) -> [__m512; 2] {
        Self::widen_bf16_row(p)
    }
    #[inline(always)]
    unsafe fn prefetch(p: *const u8) {
        _mm_prefetch::<_MM_HINT_T0>(p as *const i8)
    }
}

/// The AVX-512 entry point: `kernel`'s body compiled with these features.
///
/// # Safety
/// `Path::Avx512.is_available()` must hold.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(super) unsafe fn run<K: Kernel>(kernel: K) -> K::Output {
    kernel.run::<Avx512>()
}

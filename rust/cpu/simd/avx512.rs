//! AVX-512 (F/BW/VL, with AVX2 and FMA): 16 f32 lanes.

use std::arch::x86_64::*;

use super::{IntKernel, IntSimd, Kernel, Simd};
use crate::cpu::{IntPath, Path};

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

/// The AVX-512BW integer code of the quantized kernels; `V`: AVX512-VNNI's
/// `vpdpbusd` for the dot product.
#[derive(Clone, Copy, Debug)]
pub struct Avx512Int<const V: bool>;

impl<const V: bool> IntSimd for Avx512Int<V> {
    const PATH: IntPath = if V {
        IntPath::Avx512Vnni
    } else {
        IntPath::Avx512
    };
    const LANES: usize = 16;
    const VNNI: bool = V;
    type I = __m512i;
    type F = __m512;

    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m512i {
        _mm512_load_si512(p as *const _)
    }
    #[inline(always)]
    unsafe fn bcast4(p: *const u8) -> __m512i {
        _mm512_set1_epi32((p as *const i32).read_unaligned())
    }
    #[inline(always)]
    unsafe fn splat_i32(v: i32) -> __m512i {
        _mm512_set1_epi32(v)
    }
    #[inline(always)]
    unsafe fn dot(acc: __m512i, u: __m512i, s: __m512i) -> __m512i {
        if V {
            _mm512_dpbusd_epi32(acc, u, s)
        } else {
            Self::widen_pairs(acc, Self::pairs(u, s))
        }
    }
    #[inline(always)]
    unsafe fn pairs(u: __m512i, s: __m512i) -> __m512i {
        _mm512_maddubs_epi16(u, s)
    }
    #[inline(always)]
    unsafe fn add_pairs(a: __m512i, b: __m512i) -> __m512i {
        _mm512_add_epi16(a, b)
    }
    #[inline(always)]
    unsafe fn widen_pairs(acc: __m512i, p: __m512i) -> __m512i {
        _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)))
    }
    #[inline(always)]
    unsafe fn sign(w: __m512i, x: __m512i) -> __m512i {
        // AVX-512 has no vpsignb: subtract from zero under the sign mask.
        _mm512_mask_sub_epi8(w, _mm512_movepi8_mask(x), _mm512_setzero_si512(), w)
    }
    #[inline(always)]
    unsafe fn flip(w: __m512i) -> __m512i {
        _mm512_xor_si512(w, _mm512_set1_epi8(-128))
    }
    #[inline(always)]
    unsafe fn low_nibbles(v: __m512i) -> __m512i {
        _mm512_and_si512(v, _mm512_set1_epi8(15))
    }
    #[inline(always)]
    unsafe fn high_nibbles(v: __m512i) -> __m512i {
        _mm512_and_si512(_mm512_srli_epi16::<4>(v), _mm512_set1_epi8(15))
    }
    #[inline(always)]
    unsafe fn table(t: &[u8; 16]) -> __m512i {
        _mm512_broadcast_i32x4(_mm_loadu_si128(t.as_ptr() as *const __m128i))
    }
    #[inline(always)]
    unsafe fn lookup(table: __m512i, idx: __m512i) -> __m512i {
        _mm512_shuffle_epi8(table, idx)
    }
    #[inline(always)]
    unsafe fn to_f32(v: __m512i) -> __m512 {
        _mm512_cvtepi32_ps(v)
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
    #[inline(always)]
    unsafe fn splat_f32(v: f32) -> __m512 {
        _mm512_set1_ps(v)
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        _mm512_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn load_f32(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store_f32(p: *mut f32, v: __m512) {
        _mm512_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn prefetch(p: *const u8) {
        _mm_prefetch::<_MM_HINT_T0>(p as *const i8)
    }
    #[inline(always)]
    unsafe fn transpose_dwords(src: *const u8, stride: usize, dst: *mut u8, xor: u32) {
        // Dwords, then pairs of dwords within each 128-bit lane; `b[4j + c]`
        // then holds, in lane L, column 4L + c of rows 4j..4j + 4, and two
        // rounds of 128-bit shuffles gather a column's four lanes.
        let r: [__m512i; 16] =
            std::array::from_fn(|l| _mm512_loadu_si512(src.add(l * stride) as *const _));
        let mut a = [_mm512_setzero_si512(); 16];
        for i in 0..8 {
            a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        let mut b = [_mm512_setzero_si512(); 16];
        for j in 0..4 {
            b[4 * j] = _mm512_unpacklo_epi64(a[4 * j], a[4 * j + 2]);
            b[4 * j + 1] = _mm512_unpackhi_epi64(a[4 * j], a[4 * j + 2]);
            b[4 * j + 2] = _mm512_unpacklo_epi64(a[4 * j + 1], a[4 * j + 3]);
            b[4 * j + 3] = _mm512_unpackhi_epi64(a[4 * j + 1], a[4 * j + 3]);
        }
        let x = _mm512_set1_epi32(xor as i32);
        let out = |col: usize, v: __m512i| {
            _mm512_store_si512(dst.add(col * 64) as *mut _, _mm512_xor_si512(v, x))
        };
        for c in 0..4 {
            let e0 = _mm512_shuffle_i32x4::<0x44>(b[c], b[4 + c]);
            let e1 = _mm512_shuffle_i32x4::<0xEE>(b[c], b[4 + c]);
            let f0 = _mm512_shuffle_i32x4::<0x44>(b[8 + c], b[12 + c]);
            let f1 = _mm512_shuffle_i32x4::<0xEE>(b[8 + c], b[12 + c]);
            out(c, _mm512_shuffle_i32x4::<0x88>(e0, f0));
            out(4 + c, _mm512_shuffle_i32x4::<0xDD>(e0, f0));
            out(8 + c, _mm512_shuffle_i32x4::<0x88>(e1, f1));
            out(12 + c, _mm512_shuffle_i32x4::<0xDD>(e1, f1));
        }
    }
}

/// The AVX-512BW entry point of the integer kernels.
///
/// # Safety
/// `IntPath::Avx512.is_available()` must hold.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn run_int<K: IntKernel>(kernel: K) -> K::Output {
    kernel.run::<Avx512Int<false>>()
}

/// The AVX512-VNNI entry point of the integer kernels.
///
/// # Safety
/// `IntPath::Avx512Vnni.is_available()` must hold.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn run_int_vnni<K: IntKernel>(kernel: K) -> K::Output {
    kernel.run::<Avx512Int<true>>()
}

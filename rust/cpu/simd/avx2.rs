//! AVX2 with FMA: 8 f32 lanes.

use std::arch::x86_64::*;

use super::{IntKernel, IntSimd, Kernel, Simd};
use crate::cpu::{IntPath, Path};

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

/// The AVX2 integer code of the quantized kernels; `V`: AVX-VNNI's
/// `vpdpbusd` for the dot product.
#[derive(Clone, Copy, Debug)]
pub struct Avx2Int<const V: bool>;

impl<const V: bool> IntSimd for Avx2Int<V> {
    const PATH: IntPath = if V { IntPath::AvxVnni } else { IntPath::Avx2 };
    const LANES: usize = 8;
    const VNNI: bool = V;
    type I = __m256i;
    type F = __m256;

    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m256i {
        _mm256_load_si256(p as *const __m256i)
    }
    #[inline(always)]
    unsafe fn bcast4(p: *const u8) -> __m256i {
        _mm256_set1_epi32((p as *const i32).read_unaligned())
    }
    #[inline(always)]
    unsafe fn splat_i32(v: i32) -> __m256i {
        _mm256_set1_epi32(v)
    }
    #[inline(always)]
    unsafe fn dot(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        if V {
            _mm256_dpbusd_avx_epi32(acc, u, s)
        } else {
            Self::widen_pairs(acc, Self::pairs(u, s))
        }
    }
    #[inline(always)]
    unsafe fn pairs(u: __m256i, s: __m256i) -> __m256i {
        _mm256_maddubs_epi16(u, s)
    }
    #[inline(always)]
    unsafe fn add_pairs(a: __m256i, b: __m256i) -> __m256i {
        _mm256_add_epi16(a, b)
    }
    #[inline(always)]
    unsafe fn widen_pairs(acc: __m256i, p: __m256i) -> __m256i {
        _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
    }
    #[inline(always)]
    unsafe fn sign(w: __m256i, x: __m256i) -> __m256i {
        _mm256_sign_epi8(w, x)
    }
    #[inline(always)]
    unsafe fn flip(w: __m256i) -> __m256i {
        _mm256_xor_si256(w, _mm256_set1_epi8(-128))
    }
    #[inline(always)]
    unsafe fn low_nibbles(v: __m256i) -> __m256i {
        _mm256_and_si256(v, _mm256_set1_epi8(15))
    }
    #[inline(always)]
    unsafe fn high_nibbles(v: __m256i) -> __m256i {
        _mm256_and_si256(_mm256_srli_epi16::<4>(v), _mm256_set1_epi8(15))
    }
    #[inline(always)]
    unsafe fn table(t: &[u8; 16]) -> __m256i {
        _mm256_broadcastsi128_si256(_mm_loadu_si128(t.as_ptr() as *const __m128i))
    }
    #[inline(always)]
    unsafe fn lookup(table: __m256i, idx: __m256i) -> __m256i {
        _mm256_shuffle_epi8(table, idx)
    }
    #[inline(always)]
    unsafe fn to_f32(v: __m256i) -> __m256 {
        _mm256_cvtepi32_ps(v)
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
    #[inline(always)]
    unsafe fn splat_f32(v: f32) -> __m256 {
        _mm256_set1_ps(v)
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        _mm256_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn load_f32(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store_f32(p: *mut f32, v: __m256) {
        _mm256_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn prefetch(p: *const u8) {
        _mm_prefetch::<_MM_HINT_T0>(p as *const i8)
    }
    #[inline(always)]
    unsafe fn transpose_dwords(src: *const u8, stride: usize, dst: *mut u8, xor: u32) {
        // As the AVX-512 one, with two 128-bit lanes to gather.
        let r: [__m256i; 8] =
            std::array::from_fn(|l| _mm256_loadu_si256(src.add(l * stride) as *const __m256i));
        let mut a = [_mm256_setzero_si256(); 8];
        for i in 0..4 {
            a[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            a[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        let mut b = [_mm256_setzero_si256(); 8];
        for j in 0..2 {
            b[4 * j] = _mm256_unpacklo_epi64(a[4 * j], a[4 * j + 2]);
            b[4 * j + 1] = _mm256_unpackhi_epi64(a[4 * j], a[4 * j + 2]);
            b[4 * j + 2] = _mm256_unpacklo_epi64(a[4 * j + 1], a[4 * j + 3]);
            b[4 * j + 3] = _mm256_unpackhi_epi64(a[4 * j + 1], a[4 * j + 3]);
        }
        let x = _mm256_set1_epi32(xor as i32);
        let out = |col: usize, v: __m256i| {
            _mm256_store_si256(dst.add(col * 64) as *mut __m256i, _mm256_xor_si256(v, x))
        };
        for c in 0..4 {
            out(c, _mm256_permute2x128_si256::<0x20>(b[c], b[4 + c]));
            out(4 + c, _mm256_permute2x128_si256::<0x31>(b[c], b[4 + c]));
        }
    }
}

/// The AVX2 entry point of the integer kernels.
///
/// # Safety
/// `IntPath::Avx2.is_available()` must hold.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run_int<K: IntKernel>(kernel: K) -> K::Output {
    kernel.run::<Avx2Int<false>>()
}

/// The AVX-VNNI entry point of the integer kernels.
///
/// # Safety
/// `IntPath::AvxVnni.is_available()` must hold.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub(super) unsafe fn run_int_vnni<K: IntKernel>(kernel: K) -> K::Output {
    kernel.run::<Avx2Int<true>>()
}

//! Portable code: one f32 per "vector", plain multiply and add (no FMA
//! assumed), compiled for the crate's baseline target.

use super::{Kernel, Simd, ROW};
use crate::cpu::Path;

/// The portable code of every kernel.
#[derive(Clone, Copy, Debug)]
pub struct Scalar;

impl Simd for Scalar {
    const PATH: Path = Path::Scalar;
    const LANES: usize = 1;
    const SEGMENTED_ROW: bool = false;
    const FULL_ROW_ROWS: usize = 4;
    const PARTS: usize = 1;
    type F32 = f32;
    type Row = [f32; ROW];
    type Part = [f32; ROW];

    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
    #[inline(always)]
    unsafe fn zero() -> f32 {
        0.0
    }
    #[inline(always)]
    unsafe fn zero_row() -> [f32; ROW] {
        [0.0; ROW]
    }
    #[inline(always)]
    unsafe fn zero_part() -> [f32; ROW] {
        [0.0; ROW]
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> f32 {
        v
    }
    #[inline(always)]
    unsafe fn fmadd(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
    #[inline(always)]
    unsafe fn add(a: f32, b: f32) -> f32 {
        a + b
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: f32) {
        p.write_unaligned(v)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> f32 {
        p.read_unaligned()
    }
    #[inline(always)]
    unsafe fn load_row(p: *const f32) -> [f32; ROW] {
        std::ptr::read_unaligned(p as *const [f32; ROW])
    }
    #[inline(always)]
    unsafe fn widen_bf16_row(p: *const u8) -> [f32; ROW] {
        let words = std::ptr::read_unaligned(p as *const [u32; ROW / 2]);
        let mut row = [0f32; ROW];
        for (j, w) in words.iter().enumerate() {
            let w = u32::from_le(*w);
            row[j] = f32::from_bits(w << 16);
            row[ROW / 2 + j] = f32::from_bits(w & 0xffff_0000);
        }
        row
    }
    #[inline(always)]
    unsafe fn load_part<const P: usize>(p: *const f32) -> [f32; ROW] {
        Self::load_row(p)
    }
    #[inline(always)]
    unsafe fn widen_bf16_part<const P: usize>(p: *const u8) -> [f32; ROW] {
        Self::widen_bf16_row(p)
    }
    #[inline(always)]
    unsafe fn prefetch(_p: *const u8) {}
}

/// The portable entry point.
#[inline]
pub(super) fn run<K: Kernel>(kernel: K) -> K::Output {
    kernel.run::<Scalar>()
}

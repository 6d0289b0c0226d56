//! Portable code: one f32 per "vector", plain multiply and add (no FMA
//! assumed), compiled for the crate's baseline target.

use super::{IntKernel, IntSimd, Kernel, Simd, ROW};
use crate::cpu::{IntPath, Path};

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

/// The portable entry point. Never inlined: a dispatch on a SIMD path stays
/// a small function instead of carrying the portable body's stack frame
/// (which cost a quantized prefill 2-3% in its per-tile dispatches).
#[inline(never)]
pub(super) fn run<K: Kernel>(kernel: K) -> K::Output {
    kernel.run::<Scalar>()
}

/// Eight i32 lanes as 32 bytes (the portable integer vector).
#[derive(Clone, Copy, Debug)]
#[repr(C, align(32))]
pub struct Bytes32([u8; 32]);

impl Bytes32 {
    #[inline(always)]
    fn map(self, f: impl Fn(u8) -> u8) -> Bytes32 {
        Bytes32(self.0.map(f))
    }
    #[inline(always)]
    fn lane(&self, l: usize) -> i32 {
        let b = &self.0[4 * l..4 * l + 4];
        i32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
    #[inline(always)]
    fn half(&self, j: usize) -> i16 {
        i16::from_le_bytes([self.0[2 * j], self.0[2 * j + 1]])
    }
    #[inline(always)]
    fn from_halves(halves: [i16; 16]) -> Bytes32 {
        let mut b = [0u8; 32];
        for (j, v) in halves.iter().enumerate() {
            b[2 * j..2 * j + 2].copy_from_slice(&v.to_le_bytes());
        }
        Bytes32(b)
    }
    #[inline(always)]
    fn from_lanes(lanes: [i32; 8]) -> Bytes32 {
        let mut b = [0u8; 32];
        for (l, v) in lanes.iter().enumerate() {
            b[4 * l..4 * l + 4].copy_from_slice(&v.to_le_bytes());
        }
        Bytes32(b)
    }
}

/// The portable integer code of the quantized kernels (exact i32 dots).
#[derive(Clone, Copy, Debug)]
pub struct ScalarInt;

impl IntSimd for ScalarInt {
    const PATH: IntPath = IntPath::Scalar;
    const LANES: usize = 8;
    const VNNI: bool = true;
    type I = Bytes32;
    type F = [f32; 8];

    #[inline(always)]
    unsafe fn load(p: *const u8) -> Bytes32 {
        Bytes32(std::ptr::read_unaligned(p as *const [u8; 32]))
    }
    #[inline(always)]
    unsafe fn bcast4(p: *const u8) -> Bytes32 {
        let four = std::ptr::read_unaligned(p as *const [u8; 4]);
        Bytes32(std::array::from_fn(|i| four[i % 4]))
    }
    #[inline(always)]
    unsafe fn splat_i32(v: i32) -> Bytes32 {
        Bytes32::from_lanes([v; 8])
    }
    #[inline(always)]
    unsafe fn dot(acc: Bytes32, u: Bytes32, s: Bytes32) -> Bytes32 {
        Bytes32::from_lanes(std::array::from_fn(|l| {
            let sum: i32 = (4 * l..4 * l + 4)
                .map(|i| u.0[i] as i32 * s.0[i] as i8 as i32)
                .sum();
            acc.lane(l).wrapping_add(sum)
        }))
    }
    #[inline(always)]
    unsafe fn pairs(u: Bytes32, s: Bytes32) -> Bytes32 {
        // vpmaddubsw: the pair's sum saturated to i16.
        Bytes32::from_halves(std::array::from_fn(|j| {
            let sum: i32 = (2 * j..2 * j + 2)
                .map(|i| u.0[i] as i32 * s.0[i] as i8 as i32)
                .sum();
            sum.clamp(i16::MIN as i32, i16::MAX as i32) as i16
        }))
    }
    #[inline(always)]
    unsafe fn add_pairs(a: Bytes32, b: Bytes32) -> Bytes32 {
        Bytes32::from_halves(std::array::from_fn(|j| a.half(j).wrapping_add(b.half(j))))
    }
    #[inline(always)]
    unsafe fn widen_pairs(acc: Bytes32, p: Bytes32) -> Bytes32 {
        Bytes32::from_lanes(std::array::from_fn(|l| {
            acc.lane(l)
                .wrapping_add(p.half(2 * l) as i32 + p.half(2 * l + 1) as i32)
        }))
    }
    #[inline(always)]
    unsafe fn sign(w: Bytes32, x: Bytes32) -> Bytes32 {
        Bytes32(std::array::from_fn(|i| {
            if (x.0[i] as i8) < 0 {
                (w.0[i] as i8).wrapping_neg() as u8
            } else {
                w.0[i]
            }
        }))
    }
    #[inline(always)]
    unsafe fn flip(w: Bytes32) -> Bytes32 {
        w.map(|b| b ^ 0x80)
    }
    #[inline(always)]
    unsafe fn low_nibbles(v: Bytes32) -> Bytes32 {
        v.map(|b| b & 15)
    }
    #[inline(always)]
    unsafe fn high_nibbles(v: Bytes32) -> Bytes32 {
        v.map(|b| b >> 4)
    }
    #[inline(always)]
    unsafe fn table(t: &[u8; 16]) -> Bytes32 {
        Bytes32(std::array::from_fn(|i| t[i % 16]))
    }
    #[inline(always)]
    unsafe fn lookup(table: Bytes32, idx: Bytes32) -> Bytes32 {
        idx.map(|i| table.0[(i & 15) as usize])
    }
    #[inline(always)]
    unsafe fn to_f32(v: Bytes32) -> [f32; 8] {
        std::array::from_fn(|l| v.lane(l) as f32)
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> [f32; 8] {
        let bits = std::ptr::read_unaligned(p as *const [u16; 8]);
        bits.map(|b| half::f16::from_bits(u16::from_le(b)).to_f32())
    }
    #[inline(always)]
    unsafe fn splat_f32(v: f32) -> [f32; 8] {
        [v; 8]
    }
    #[inline(always)]
    unsafe fn mul(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|l| a[l] * b[l])
    }
    #[inline(always)]
    unsafe fn fmadd(a: [f32; 8], b: [f32; 8], c: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|l| a[l] * b[l] + c[l])
    }
    #[inline(always)]
    unsafe fn load_f32(p: *const f32) -> [f32; 8] {
        std::ptr::read_unaligned(p as *const [f32; 8])
    }
    #[inline(always)]
    unsafe fn store_f32(p: *mut f32, v: [f32; 8]) {
        std::ptr::write_unaligned(p as *mut [f32; 8], v)
    }
    #[inline(always)]
    unsafe fn prefetch(_p: *const u8) {}
    #[inline(always)]
    unsafe fn transpose_dwords(src: *const u8, stride: usize, dst: *mut u8, xor: u32) {
        for l in 0..8 {
            let row = std::ptr::read_unaligned(src.add(l * stride) as *const [u32; 8]);
            for (i, &w) in row.iter().enumerate() {
                (dst.add(i * 64 + l * 4) as *mut u32).write(w ^ xor);
            }
        }
    }
}

/// The portable entry point of the integer kernels (never inlined, as
/// [`run`]).
#[inline(never)]
pub(super) fn run_int<K: IntKernel>(kernel: K) -> K::Output {
    kernel.run::<ScalarInt>()
}

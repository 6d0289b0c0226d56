//! The one multiversioning style of the CPU kernels.
//!
//! A kernel is written once, as a generic `#[inline(always)]` body over a
//! [`Simd`] type, and handed to [`dispatch`] as a [`Kernel`]. Each ISA has
//! one file here (`avx512.rs`, `avx2.rs`, `scalar.rs`) holding its `Simd`
//! impl and its single entry point, a `#[target_feature(enable = "...")]
//! unsafe fn run` that calls `Kernel::run::<ThatIsa>()`: the body inlines
//! into the entry point and is compiled with the entry point's features (the
//! auto-vectorised loops get that ISA's vectors, and the `Simd` methods'
//! intrinsics inline there). The crate itself stays compiled for baseline
//! x86-64, and `dispatch` only calls an entry point when [`Path::is_available`]
//! says the CPU and the OS allow it, so no CPU ever sees an instruction it
//! lacks.
//!
//! The vector methods cover what the kernels need: f32 vectors of
//! `LANES` lanes, a panel row of 32 f32 (the GEMM's output features) as a
//! fixed array of vectors, and bf16 pairs widened to f32 by one shift (low
//! halves) and one mask (high halves).

use super::Path;

mod int;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod scalar;

pub use int::{dispatch_int, IntKernel, IntSimd};

#[cfg(target_arch = "x86_64")]
pub use avx2::Avx2;
#[cfg(target_arch = "x86_64")]
pub use avx512::Avx512;
pub use scalar::Scalar;

/// Features per GEMM panel row (`gemm::NR`): the width of [`Simd::Row`].
pub const ROW: usize = 32;

/// One instruction set, as the generic kernel bodies see it.
///
/// # Safety
/// The methods may only run inside that ISA's entry point (`dispatch`), and
/// their pointers must be valid as each one says.
#[allow(clippy::missing_safety_doc)] // one Safety section, above, for all
pub trait Simd: Copy + 'static {
    /// The path this implementation serves.
    const PATH: Path;
    /// f32 lanes per vector.
    const LANES: usize;
    /// Whether a one-row GEMM tile streams its panel as four segments (more
    /// lines in flight, see `gemm::tile`). Only the AVX-512 kernel does, on
    /// Intel's CPUs.
    const SEGMENTED_ROW: bool;
    /// The GEMM tile covers the panel's 32 features at once up to this many
    /// rows; taller tiles (up to `gemm`'s rows for the path) cover it as
    /// `PARTS` parts of `ROW / PARTS` features, one after the other, so that
    /// more rows' accumulators fit the registers.
    const FULL_ROW_ROWS: usize;
    /// Parts of a panel row for tiles taller than `FULL_ROW_ROWS` (1 or 2).
    const PARTS: usize;
    /// A vector of `LANES` f32.
    type F32: Copy;
    /// `ROW` f32 as vectors (`ROW / LANES` of them).
    type Row: Copy + AsRef<[Self::F32]> + AsMut<[Self::F32]>;
    /// `ROW / PARTS` f32 as vectors: part `P` of a panel row is its features
    /// `P * ROW / PARTS..(P + 1) * ROW / PARTS`.
    type Part: Copy + AsRef<[Self::F32]> + AsMut<[Self::F32]>;

    /// `a * b + c` on scalars: fused where the ISA has FMA (a plain
    /// `f32::mul_add` without it would be a slow library call).
    fn mul_add(a: f32, b: f32, c: f32) -> f32;

    /// All lanes zero.
    unsafe fn zero() -> Self::F32;
    /// A row of zeros.
    unsafe fn zero_row() -> Self::Row;
    /// A part of zeros.
    unsafe fn zero_part() -> Self::Part;
    /// `v` in every lane.
    unsafe fn splat(v: f32) -> Self::F32;
    /// `a * b + c` per lane.
    unsafe fn fmadd(a: Self::F32, b: Self::F32, c: Self::F32) -> Self::F32;
    /// `a + b` per lane.
    unsafe fn add(a: Self::F32, b: Self::F32) -> Self::F32;
    /// Stores `LANES` f32 at `p` (any alignment).
    unsafe fn store(p: *mut f32, v: Self::F32);
    /// `LANES` f32 from `p` (any alignment).
    unsafe fn load(p: *const f32) -> Self::F32;
    /// `ROW` f32 from `p` (64-byte aligned, 128 bytes).
    unsafe fn load_row(p: *const f32) -> Self::Row;
    /// `ROW` bf16 from the 64-byte aligned line at `p`, widened to f32: the
    /// low half of 32-bit word `j` is feature `j`, its high half `16 + j`.
    unsafe fn widen_bf16_row(p: *const u8) -> Self::Row;
    /// Part `P` (`P < PARTS`) of the f32 row at `p` (as `load_row`).
    unsafe fn load_part<const P: usize>(p: *const f32) -> Self::Part;
    /// Part `P` (`P < PARTS`) of the bf16 line at `p`, widened (as
    /// `widen_bf16_row`).
    unsafe fn widen_bf16_part<const P: usize>(p: *const u8) -> Self::Part;
    /// Asks the CPU to bring the line at `p` into L1 (never faults).
    unsafe fn prefetch(p: *const u8);
}

/// A kernel body to run on one ISA. `run` must be `#[inline(always)]`, so
/// that it is compiled inside the ISA's `#[target_feature]` entry point.
pub trait Kernel {
    /// What the kernel returns.
    type Output;
    /// The body, monomorphised for `S`.
    fn run<S: Simd>(self) -> Self::Output;
}

/// Runs `kernel` on `path`'s SIMD code (`Avx512Bf16` runs the AVX-512 code).
///
/// The caller must have checked `path.is_available()`; a path this CPU
/// lacks runs the scalar code instead (never an illegal instruction).
#[inline]
pub fn dispatch<K: Kernel>(path: Path, kernel: K) -> K::Output {
    #[cfg(target_arch = "x86_64")]
    match path.simd() {
        // SAFETY: each entry point runs only where its features exist.
        Path::Avx512 if path.is_available() => return unsafe { avx512::run(kernel) },
        Path::Avx2 if path.is_available() => return unsafe { avx2::run(kernel) },
        _ => {}
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = path;
    scalar::run(kernel)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::available_paths;

    /// Sums of the widened bf16 row and the f32 row, through the methods.
    struct RowCheck<'a> {
        line: &'a [u8; 64],
        floats: &'a [f32; ROW],
    }

    impl Kernel for RowCheck<'_> {
        type Output = ([f32; ROW], [f32; ROW]);
        #[inline(always)]
        fn run<S: Simd>(self) -> Self::Output {
            let (mut a, mut b) = ([0f32; ROW], [0f32; ROW]);
            // SAFETY: inside the ISA's entry point; both rows are 64-byte aligned.
            unsafe {
                let wide = S::widen_bf16_row(self.line.as_ptr());
                let plain = S::load_row(self.floats.as_ptr());
                let two = S::splat(2.0);
                for (i, (w, p)) in wide.as_ref().iter().zip(plain.as_ref()).enumerate() {
                    S::store(
                        a.as_mut_ptr().add(i * S::LANES),
                        S::fmadd(two, *w, S::zero()),
                    );
                    S::store(b.as_mut_ptr().add(i * S::LANES), S::add(*p, S::zero()));
                }
            }
            (a, b)
        }
    }

    #[repr(C, align(64))]
    struct Aligned<T>(T);

    #[test]
    fn every_isa_reads_rows_the_same() {
        let mut line = Aligned([0u8; 64]);
        let mut want = [0f32; ROW];
        for (j, w) in want.iter_mut().enumerate() {
            let v = half::bf16::from_f32(j as f32 - 7.5);
            let off = (j % 16) * 4 + if j < 16 { 0 } else { 2 };
            line.0[off..off + 2].copy_from_slice(&v.to_bits().to_le_bytes());
            *w = v.to_f32();
        }
        let floats = Aligned(std::array::from_fn::<f32, ROW, _>(|j| j as f32 * 0.5));
        for path in available_paths() {
            let (a, b) = dispatch(
                path,
                RowCheck {
                    line: &line.0,
                    floats: &floats.0,
                },
            );
            let doubled: Vec<f32> = want.iter().map(|w| 2.0 * w).collect();
            assert_eq!(&a[..], &doubled[..], "{path:?}");
            assert_eq!(b, floats.0, "{path:?}");
        }
    }
}

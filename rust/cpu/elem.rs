//! The element types of the CPU kernels: f32 and bf16, behind one trait, and
//! the slice views (`Src`, `Dst`) that carry either through a kernel's API.
//!
//! Kernels compute in f32. A bf16 widens exactly (it is the upper half of an
//! f32) and rounds to nearest even on the way back, written without branches
//! so that loops over it vectorise.

use half::bf16;

use crate::error::{CoreError, CoreResult};

/// An element type the kernels read and write: f32 or bf16.
pub trait Element: Copy + Default + Send + Sync + 'static {
    /// Widens to f32 (exact).
    fn to_f32(self) -> f32;
    /// Rounds an f32 to this type (nearest even; a NaN stays a quiet NaN).
    fn from_f32(v: f32) -> Self;
    /// `v` rounded to this type and back (identity for f32).
    #[inline(always)]
    fn round(v: f32) -> f32 {
        Self::from_f32(v).to_f32()
    }
    /// The slice itself when the type already is f32 (no copy needed).
    fn as_f32_slice(s: &[Self]) -> Option<&[f32]>;
    /// The slice as a kernel source.
    fn src(s: &[Self]) -> Src<'_>;
    /// The slice as a kernel destination.
    fn dst(s: &mut [Self]) -> Dst<'_>;
}

impl Element for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
    #[inline(always)]
    fn as_f32_slice(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
    fn src(s: &[Self]) -> Src<'_> {
        Src::F32(s)
    }
    fn dst(s: &mut [Self]) -> Dst<'_> {
        Dst::F32(s)
    }
}

impl Element for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        // Written as a shift so the widening loops vectorise.
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16_rne(v)
    }
    #[inline(always)]
    fn as_f32_slice(_: &[Self]) -> Option<&[f32]> {
        None
    }
    fn src(s: &[Self]) -> Src<'_> {
        Src::Bf16(s)
    }
    fn dst(s: &mut [Self]) -> Dst<'_> {
        Dst::Bf16(s)
    }
}

/// `v` rounded to the nearest bf16 (ties to even), as `bf16::from_f32`, but
/// without branches so that loops over it vectorise; a NaN stays a (quiet) NaN.
#[inline(always)]
pub fn bf16_rne(v: f32) -> bf16 {
    let bits = v.to_bits();
    let rounded = (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
    let nan = (bits & 0x7fff_ffff) > 0x7f80_0000;
    let quiet = ((bits >> 16) as u16) | 0x40;
    bf16::from_bits(if nan { quiet } else { rounded })
}

/// A read-only bf16 or f32 matrix, row-major.
#[derive(Clone, Copy, Debug)]
pub enum Src<'a> {
    /// bfloat16 elements.
    Bf16(&'a [bf16]),
    /// float32 elements.
    F32(&'a [f32]),
}

impl Src<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Src::Bf16(s) => s.len(),
            Src::F32(s) => s.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i`, widened to f32.
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            Src::Bf16(s) => s[i].to_f32(),
            Src::F32(s) => s[i],
        }
    }
}

/// A writable bf16 or f32 matrix, row-major.
#[derive(Debug)]
pub enum Dst<'a> {
    /// bfloat16 elements (results rounded to nearest even).
    Bf16(&'a mut [bf16]),
    /// float32 elements.
    F32(&'a mut [f32]),
}

impl Dst<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Dst::Bf16(o) => o.len(),
            Dst::F32(o) => o.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The output pointer shared by tasks that write disjoint parts of it.
pub(crate) struct SharedOut<T>(pub(crate) *mut T);
// SAFETY: every task writes only its own part of the output.
unsafe impl<T: Send> Send for SharedOut<T> {}
unsafe impl<T: Send> Sync for SharedOut<T> {}

impl<T> SharedOut<T> {
    pub(crate) fn ptr(&self) -> *mut T {
        self.0
    }
}

/// Checks that `what` (`len` elements) holds a `rows x cols` matrix.
pub(crate) fn expect_matrix(what: &str, len: usize, rows: usize, cols: usize) -> CoreResult<()> {
    let want = rows
        .checked_mul(cols)
        .ok_or_else(|| CoreError::invalid(format!("{what}: size {rows} x {cols} overflows")))?;
    if len != want {
        return Err(CoreError::invalid(format!(
            "{what}: expected {rows} x {cols} = {want} elements, got {len}"
        )));
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Tiny deterministic generator (xorshift) so tests need no extra crate.
    pub(crate) struct Rng(pub(crate) u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        pub(crate) fn f32(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
        /// A uniform index in `0..n`.
        pub(crate) fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// f64 reference over the same (already rounded) inputs; also returns
    /// sum |w * x| per output, the scale of the summation error.
    pub(crate) fn reference(
        x: &[f32],
        w: &[f32],
        b: Option<&[f32]>,
        m: usize,
        n: usize,
        k: usize,
    ) -> (Vec<f64>, Vec<f64>) {
        let mut out = vec![0f64; m * n];
        let mut mag = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = b.map_or(0.0, |b| b[j] as f64);
                let mut a = s.abs();
                for t in 0..k {
                    let p = x[i * k + t] as f64 * w[j * k + t] as f64;
                    s += p;
                    a += p.abs();
                }
                out[i * n + j] = s;
                mag[i * n + j] = a;
            }
        }
        (out, mag)
    }

    #[test]
    fn branch_free_bf16_rounding_matches_half() {
        let specials = [
            0.0f32,
            -0.0,
            1.0,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            f32::INFINITY,
            -f32::INFINITY,
        ];
        let mut seed = 1u32;
        let randoms = (0..100_000).map(|_| {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            f32::from_bits(seed)
        });
        for v in specials.into_iter().chain(randoms) {
            let ours = bf16_rne(v);
            if v.is_nan() {
                assert!(ours.is_nan());
            } else {
                assert_eq!(ours.to_bits(), bf16::from_f32(v).to_bits(), "{v:e}");
            }
        }
    }

    #[test]
    fn expect_matrix_names_the_argument() {
        assert!(expect_matrix("x", 6, 2, 3).is_ok());
        let err = expect_matrix("x", 5, 2, 3).unwrap_err().to_string();
        assert!(
            err.contains("x: expected 2 x 3 = 6 elements, got 5"),
            "{err}"
        );
        assert!(expect_matrix("w", 0, usize::MAX, 2).is_err());
    }
}

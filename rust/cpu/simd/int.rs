//! The integer vocabulary of the quantized-weight kernels, in the same style
//! as [`Simd`](super::Simd): a kernel body is written once over [`IntSimd`]
//! and run by [`dispatch_int`] on one [`IntPath`]'s entry point, compiled
//! with that path's target features.
//!
//! A vector holds `LANES` 32-bit lanes; a lane is one output feature and
//! holds four bytes of its weights (four consecutive input features). The
//! one dot product is "u8 x i8, four products summed into each i32 lane":
//! one `vpdpbusd` with VNNI, `vpmaddubsw` + `vpmaddwd` without. The second
//! form sums pairs of products in i16 first, so it is exact only while
//! `|u * s|` of a pair stays below 2^15: the kernels keep `u` a 4-bit index
//! or the magnitude of an int8 in [-127, 127] there (see `quant`).

use crate::cpu::IntPath;

/// One integer instruction set, as the quantized kernel bodies see it.
///
/// # Safety
/// The methods may only run inside that path's entry point
/// ([`dispatch_int`]); pointers must be valid as each one says.
#[allow(clippy::missing_safety_doc)] // one Safety section, above, for all
pub trait IntSimd: Copy + 'static {
    /// The path this implementation serves.
    const PATH: IntPath;
    /// i32 lanes (output features) per vector.
    const LANES: usize;
    /// `dot` is one VNNI instruction with no i16 step (any u8 x i8 exact).
    const VNNI: bool;
    /// `LANES` i32 lanes (`4 * LANES` bytes).
    type I: Copy;
    /// `LANES` f32.
    type F: Copy;

    /// `4 * LANES` bytes from the 32-byte aligned `p`.
    unsafe fn load(p: *const u8) -> Self::I;
    /// The four bytes at `p` in every lane.
    unsafe fn bcast4(p: *const u8) -> Self::I;
    /// `v` in every lane.
    unsafe fn splat_i32(v: i32) -> Self::I;
    /// `acc + sum of u[4l + b] * s[4l + b]` over the four bytes of each lane,
    /// `u` unsigned and `s` signed (see the module docs for exactness).
    unsafe fn dot(acc: Self::I, u: Self::I, s: Self::I) -> Self::I;
    /// The two-instruction form's first half: per i16 lane, the sum of the
    /// pair `u[2j] * s[2j] + u[2j + 1] * s[2j + 1]` (`u` unsigned, `s`
    /// signed; exact while it stays in i16, as for `dot`).
    unsafe fn pairs(u: Self::I, s: Self::I) -> Self::I;
    /// `a + b` per i16 lane (wrapping: callers keep the sums in range).
    unsafe fn add_pairs(a: Self::I, b: Self::I) -> Self::I;
    /// `acc` plus, per i32 lane, the sum of its two i16 lanes of `p`.
    unsafe fn widen_pairs(acc: Self::I, p: Self::I) -> Self::I;
    /// `w` with every byte negated where the same byte of `x` is negative.
    unsafe fn sign(w: Self::I, x: Self::I) -> Self::I;
    /// Every byte XOR 0x80 (int8 to `u8 = int8 + 128`).
    unsafe fn flip(w: Self::I) -> Self::I;
    /// The low four bits of every byte.
    unsafe fn low_nibbles(v: Self::I) -> Self::I;
    /// The high four bits of every byte, shifted down.
    unsafe fn high_nibbles(v: Self::I) -> Self::I;
    /// The 16-byte table at `t`, in the form `lookup` takes.
    unsafe fn table(t: &[u8; 16]) -> Self::I;
    /// `table[idx]` per byte, for indices below 16.
    unsafe fn lookup(table: Self::I, idx: Self::I) -> Self::I;
    /// The lanes as f32.
    unsafe fn to_f32(v: Self::I) -> Self::F;
    /// `LANES` f16 at `p` (any alignment) as f32.
    unsafe fn load_f16(p: *const u8) -> Self::F;
    /// `v` in every lane.
    unsafe fn splat_f32(v: f32) -> Self::F;
    /// `a * b` per lane.
    unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
    /// `a * b + c` per lane.
    unsafe fn fmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// `LANES` f32 from `p` (any alignment).
    unsafe fn load_f32(p: *const f32) -> Self::F;
    /// Stores `LANES` f32 at `p` (any alignment).
    unsafe fn store_f32(p: *mut f32, v: Self::F);
    /// Asks the CPU to bring the line at `p` into L1 (never faults).
    unsafe fn prefetch(p: *const u8);
    /// `LANES` rows of `LANES` dwords transposed, each dword XOR `xor`:
    /// row `l` is read at `src + l * stride` (any alignment), and dword `i`
    /// of every row goes to lane `l` of the `i`-th 64-byte aligned line at
    /// `dst` (lines 64 bytes apart; lanes past `LANES` left alone).
    unsafe fn transpose_dwords(src: *const u8, stride: usize, dst: *mut u8, xor: u32);
}

/// A quantized kernel body to run on one integer path; `run` must be
/// `#[inline(always)]` so that it compiles inside the path's entry point.
pub trait IntKernel {
    /// What the kernel returns.
    type Output;
    /// The body, monomorphised for `S`.
    fn run<S: IntSimd>(self) -> Self::Output;
}

/// Runs `kernel` on `path`'s code. A path this CPU lacks runs the portable
/// code instead (never an illegal instruction); callers check first.
#[inline]
pub fn dispatch_int<K: IntKernel>(path: IntPath, kernel: K) -> K::Output {
    #[cfg(target_arch = "x86_64")]
    if path.is_available() {
        // SAFETY: each entry point runs only where its features exist.
        unsafe {
            match path {
                IntPath::Avx512Vnni => return super::avx512::run_int_vnni(kernel),
                IntPath::Avx512 => return super::avx512::run_int(kernel),
                IntPath::AvxVnni => return super::avx2::run_int_vnni(kernel),
                IntPath::Avx2 => return super::avx2::run_int(kernel),
                IntPath::Scalar => {}
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = path;
    super::scalar::run_int(kernel)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every method once, on 64 bytes, stored back as i32 and f32 lanes.
    struct Check<'a> {
        w: &'a [u8; 64],
        x: &'a [u8; 4],
        scales: &'a [u16; 16],
    }

    #[derive(Debug, PartialEq)]
    struct Seen {
        dot: Vec<i32>,
        signed: Vec<i32>,
        nibbles: Vec<i32>,
        paired: Vec<i32>,
        saturated: Vec<i32>,
        scaled: Vec<f32>,
    }

    impl IntKernel for Check<'_> {
        type Output = Seen;
        #[inline(always)]
        fn run<S: IntSimd>(self) -> Seen {
            let mut seen = Seen {
                dot: vec![],
                signed: vec![],
                nibbles: vec![],
                paired: vec![],
                saturated: vec![],
                scaled: vec![],
            };
            let table: [u8; 16] = std::array::from_fn(|i| (i as u8) * 3);
            // SAFETY: inside the path's entry point; `w` is 64-byte aligned
            // (a wrapper below) and holds 64 bytes, more than one vector.
            unsafe {
                for half in 0..(64 / (4 * S::LANES)).min(2) {
                    let w = S::load(self.w.as_ptr().add(half * 4 * S::LANES));
                    let x = S::bcast4(self.x.as_ptr());
                    let lanes = |v: S::I| -> Vec<i32> {
                        let mut out = vec![0f32; S::LANES];
                        S::store_f32(out.as_mut_ptr(), S::to_f32(v));
                        out.iter().map(|&f| f as i32).collect()
                    };
                    let low = S::low_nibbles(w);
                    seen.dot.extend(lanes(S::dot(S::splat_i32(5), low, x)));
                    let abs_x = S::sign(x, x);
                    let flipped = S::flip(S::flip(w));
                    seen.signed
                        .extend(lanes(S::dot(S::splat_i32(0), abs_x, S::sign(flipped, x))));
                    // Both nibbles' pair sums added in i16, then widened.
                    let both = S::add_pairs(S::pairs(low, x), S::pairs(S::high_nibbles(w), x));
                    seen.paired
                        .extend(lanes(S::widen_pairs(S::splat_i32(7), both)));
                    // 255 * 127 twice saturates each pair at i16::MAX.
                    let big = S::pairs(S::splat_i32(-1), S::bcast4([127u8; 4].as_ptr()));
                    seen.saturated
                        .extend(lanes(S::widen_pairs(S::splat_i32(0), big)));
                    let t = S::table(&table);
                    seen.nibbles.extend(lanes(S::dot(
                        S::splat_i32(0),
                        S::lookup(t, S::high_nibbles(w)),
                        S::bcast4([1u8, 1, 1, 1].as_ptr()),
                    )));
                    let sc = S::load_f16(self.scales.as_ptr().add(half * S::LANES) as *const u8);
                    // (2 * scale + 1) * 1, the 1 loaded from memory.
                    let ones = vec![1f32; S::LANES];
                    let v = S::fmadd(sc, S::splat_f32(2.0), S::splat_f32(1.0));
                    let mut out = vec![0f32; S::LANES];
                    S::store_f32(out.as_mut_ptr(), S::mul(v, S::load_f32(ones.as_ptr())));
                    seen.scaled.extend(out);
                    S::prefetch(self.w.as_ptr());
                }
            }
            seen
        }
    }

    #[repr(C, align(64))]
    struct Aligned([u8; 64]);

    /// `transpose_dwords` on rows of 68 bytes (an 8-bit cache row of 64
    /// and its scale), the lines read back as `LANES` dwords each.
    struct Transpose<'a>(&'a [u8], u32);

    impl IntKernel for Transpose<'_> {
        type Output = Vec<Vec<u32>>;
        #[inline(always)]
        fn run<S: IntSimd>(self) -> Vec<Vec<u32>> {
            #[repr(C, align(64))]
            struct Line([u32; 16]);
            let mut lines: Vec<Line> = (0..S::LANES).map(|_| Line([7; 16])).collect();
            // SAFETY: inside the path's entry point; `LANES` rows of 68
            // bytes (>= 4 * LANES) and `LANES` aligned lines of 64 bytes.
            unsafe {
                S::transpose_dwords(self.0.as_ptr(), 68, lines.as_mut_ptr() as *mut u8, self.1)
            };
            lines.iter().map(|l| l.0[..S::LANES].to_vec()).collect()
        }
    }

    #[test]
    fn every_int_path_transposes_dwords() {
        let bytes: Vec<u8> = (0..16 * 68).map(|i| (i * 37 % 251) as u8).collect();
        let dword = |row: usize, i: usize| {
            let b = &bytes[row * 68 + 4 * i..row * 68 + 4 * i + 4];
            u32::from_le_bytes([b[0], b[1], b[2], b[3]])
        };
        for path in IntPath::available() {
            for xor in [0, 0x8080_8080] {
                let lines = dispatch_int(path, Transpose(&bytes, xor));
                let lanes = lines.len();
                for (i, line) in lines.iter().enumerate() {
                    let want: Vec<u32> = (0..lanes).map(|l| dword(l, i) ^ xor).collect();
                    assert_eq!(line, &want, "{path:?} line {i} xor {xor:x}");
                }
            }
        }
    }

    #[test]
    fn every_int_path_computes_the_same_lanes() {
        let mut rng = crate::cpu::elem::tests::Rng(11);
        let mut w = Aligned([0; 64]);
        for b in w.0.iter_mut() {
            // int8 weights in [-127, 127], as the kernels keep them.
            *b = ((rng.below(255) as i32) - 127) as i8 as u8;
        }
        let x = [200u8, 3, 0x80 | 17, 127];
        let scales: [u16; 16] =
            std::array::from_fn(|i| half::f16::from_f32(i as f32 * 0.5 - 3.0).to_bits());
        // The reference, lane by lane, over the first 32 bytes (8 lanes).
        let xi: Vec<i32> = x.iter().map(|&b| b as i8 as i32).collect();
        let mut want_dot = vec![];
        let mut want_signed = vec![];
        let mut want_nib = vec![];
        let mut want_paired = vec![];
        for l in 0..8 {
            let bytes = &w.0[4 * l..4 * l + 4];
            want_dot.push(5 + (0..4).map(|b| (bytes[b] & 15) as i32 * xi[b]).sum::<i32>());
            want_signed.push((0..4).map(|b| bytes[b] as i8 as i32 * xi[b]).sum::<i32>());
            want_nib.push((0..4).map(|b| (bytes[b] >> 4) as i32 * 3).sum::<i32>());
            let both = (0..4).map(|b| ((bytes[b] & 15) + (bytes[b] >> 4)) as i32 * xi[b]);
            want_paired.push(7 + both.sum::<i32>());
        }
        for path in IntPath::available() {
            let seen = dispatch_int(
                path,
                Check {
                    w: &w.0,
                    x: &x,
                    scales: &scales,
                },
            );
            assert_eq!(&seen.dot[..8], &want_dot[..], "{path:?} dot");
            assert_eq!(&seen.signed[..8], &want_signed[..], "{path:?} signed");
            assert_eq!(&seen.nibbles[..8], &want_nib[..], "{path:?} nibbles");
            assert_eq!(&seen.paired[..8], &want_paired[..], "{path:?} pairs");
            assert_eq!(
                &seen.saturated[..8],
                &[65534; 8],
                "{path:?} saturated pairs"
            );
            for (i, &v) in seen.scaled[..8].iter().enumerate() {
                let s = half::f16::from_bits(scales[i]).to_f32();
                assert_eq!(v, s * 2.0 + 1.0, "{path:?} scale {i}");
            }
        }
    }
}

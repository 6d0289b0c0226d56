//! Quantized rows in the block layout of the GGUF file format: groups of 32
//! weights, one f16 scale each, row after row. This is the interchange form:
//! models quantized at load time pass through it, GGUF files store it, and
//! `pack` turns it into the kernels' panels bit for bit.
//!
//! - `q8_0` (34 bytes a block): scale `d`, then 32 int8; `w = d * q`.
//! - `q4_0` (18 bytes): `d`, then 16 bytes whose low nibbles are weights
//!   0..16 and high nibbles 16..32; `w = d * (q - 8)`.
//! - `q4_1` (20 bytes): `d`, a minimum `m` (f16), then nibbles as `q4_0`;
//!   `w = d * q + m`.
//! - `iq4_nl` (18 bytes): as `q4_0`, but a nibble indexes the 16 levels of
//!   [`IQ4_NL_LEVELS`], `w = d * level[q]`: denser near zero, where most
//!   weights are.
//! - `mxfp4` (17 bytes; OCP MXFP4, gpt-oss's experts): an E8M0 exponent
//!   byte `e`, then nibbles as `q4_0` indexing E2M1's values doubled
//!   ([`MXFP4_LEVELS`]); `w = 2^(e - 128) * level[q]`. The kernels hold the
//!   scale as an f16, which every `e` in 104..=143 is exactly
//!   ([`mxfp4_f16_scale`]).
//!
//! Quantization rounds to nearest with no calibration data.

use half::f16;

use super::{QuantFormat, GROUP};

/// The 16 non-linear levels of `iq4_nl`, in increasing order.
pub const IQ4_NL_LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The E2M1 values of `mxfp4`'s 4-bit codes, doubled (as llama.cpp's
/// `kvalues_mxfp4`): code `q` is `MXFP4_LEVELS[q] / 2` times `2^(e - 127)`.
pub const MXFP4_LEVELS: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// `2^(e - 128)`, the f32 scale of an `mxfp4` block with exponent byte `e`
/// (subnormal for `e` < 2).
#[inline(always)]
pub fn mxfp4_scale(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000u32 << e)
    } else {
        f32::from_bits(((e - 1) as u32) << 23)
    }
}

/// The f16 bits of `2^k`, for `k` in -24..=15 (subnormal below -14).
#[inline(always)]
fn f16_power_of_two(k: i32) -> u16 {
    if k >= -14 {
        ((k + 15) as u16) << 10
    } else {
        1u16 << (k + 24)
    }
}

/// The f16 bits of an `mxfp4` block's scale `2^(e - 128)`: exact for `e` in
/// 104..=143; 0 for a block of zero codes whatever its `e` (its weights are
/// zeros either way); `None` for any other block (a scale no f16 holds).
#[inline(always)]
pub fn mxfp4_f16_scale(block: &[u8]) -> Option<u16> {
    let k = block[0] as i32 - 128;
    if (-24..=15).contains(&k) {
        return Some(f16_power_of_two(k));
    }
    // Codes 0 and 8 are E2M1's +0 and -0.
    let zero = block[1..1 + GROUP / 2]
        .iter()
        .all(|&b| b & 7 == 0 && (b >> 4) & 7 == 0);
    zero.then_some(0)
}

/// The exponent byte of an `mxfp4` block whose scale has the f16 bits
/// `bits` (the inverse of [`mxfp4_f16_scale`]; 0 for a zero scale).
pub fn mxfp4_exponent(bits: u16) -> u8 {
    if bits == 0 {
        return 0;
    }
    let k = if bits >= 0x0400 {
        (bits >> 10) as i32 - 15
    } else {
        bits.trailing_zeros() as i32 - 24
    };
    (k + 128) as u8
}

/// Quantizes `rows` rows of `k` (a multiple of 32) weights into blocks. The
/// loops compile inside the fastest SIMD path's entry point (vector rounding
/// instead of a libm call per weight) with the same IEEE operations, so the
/// blocks do not depend on the path.
pub fn quantize_rows(format: QuantFormat, w: &[f32], rows: usize, k: usize, out: &mut [u8]) {
    struct Rows<'a> {
        format: QuantFormat,
        w: &'a [f32],
        rows: usize,
        k: usize,
        out: &'a mut [u8],
    }
    impl crate::cpu::simd::Kernel for Rows<'_> {
        type Output = ();
        #[inline(always)]
        fn run<S: crate::cpu::simd::Simd>(self) {
            let bb = self.format.block_bytes();
            let blocks = self
                .out
                .chunks_exact_mut(bb)
                .take(self.rows * self.k / GROUP);
            for (block, vals) in blocks.zip(self.w.as_chunks::<GROUP>().0) {
                quantize_block(self.format, vals, block);
            }
        }
    }
    debug_assert!(k.is_multiple_of(GROUP) && w.len() >= rows * k);
    debug_assert!(out.len() >= rows * (k / GROUP) * format.block_bytes());
    let task = Rows {
        format,
        w,
        rows,
        k,
        out,
    };
    crate::cpu::simd::dispatch(crate::cpu::best_path(), task);
}

/// One block of 32 weights (inlined into the SIMD entry points that call it).
#[inline(always)]
pub fn quantize_block(format: QuantFormat, x: &[f32; GROUP], out: &mut [u8]) {
    match format {
        QuantFormat::Q8_0 => {
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
            for (o, v) in out[2..2 + GROUP].iter_mut().zip(x) {
                *o = (v * id).round() as i8 as u8;
            }
        }
        QuantFormat::Q4_0 => {
            // The weight of largest magnitude maps to -8 exactly.
            let max = x
                .iter()
                .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
            let d = max / -8.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
            let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
            for i in 0..GROUP / 2 {
                out[2 + i] = q(x[i]) | (q(x[i + GROUP / 2]) << 4);
            }
        }
        QuantFormat::Q4_1 => {
            // The group's range in 15 steps from its minimum.
            let (min, max) = x
                .iter()
                .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
            let d = (max - min) / 15.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
            out[2..4].copy_from_slice(&f16::from_f32(min).to_le_bytes());
            let q = |v: f32| (((v - min) * id + 0.5) as i8).min(15) as u8;
            for i in 0..GROUP / 2 {
                out[4 + i] = q(x[i]) | (q(x[i + GROUP / 2]) << 4);
            }
        }
        QuantFormat::Iq4Nl => {
            let (d, idx) = iq4_nl_fit(x);
            out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
            for i in 0..GROUP / 2 {
                out[2 + i] = idx[i] | (idx[i + GROUP / 2] << 4);
            }
        }
        QuantFormat::Mxfp4 => {
            let (e, idx) = mxfp4_fit(x);
            out[0] = e;
            for i in 0..GROUP / 2 {
                out[1 + i] = idx[i] | (idx[i + GROUP / 2] << 4);
            }
        }
    }
}

/// The code of the `mxfp4` level nearest to `v` (in level units; ties to
/// the smaller magnitude), and its squared distance.
#[inline(always)]
fn nearest_mxfp4(v: f32) -> (u8, f32) {
    let a = v.abs();
    let mut best = (0u8, a * a);
    for (q, &l) in MXFP4_LEVELS[..8].iter().enumerate().skip(1) {
        let e = (a - l as f32) * (a - l as f32);
        if e < best.1 {
            best = (q as u8, e);
        }
    }
    // The negative levels are the positive ones' codes + 8 (+0 stays 0).
    let sign = if v < 0.0 && best.0 != 0 { 8 } else { 0 };
    (best.0 | sign, best.1)
}

/// An exponent byte and codes for one `mxfp4` block: of the two powers of
/// two that put the largest magnitude between 4 and 16 level units (the
/// outer level being 12), the one of smaller squared error; kept where an
/// f16 holds the scale.
#[inline(always)]
fn mxfp4_fit(x: &[f32; GROUP]) -> (u8, [u8; GROUP]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 || !amax.is_finite() {
        return (0, [0; GROUP]);
    }
    // 2^k0 <= amax / 8 < 2^(k0 + 1).
    let k0 = (amax / 8.0).log2().floor() as i32;
    let mut best = (0u8, [0u8; GROUP], f32::INFINITY);
    for k in [k0, k0 + 1] {
        let k = k.clamp(-24, 15);
        let inv = 1.0 / f32::from_bits(((k + 127) as u32) << 23);
        let mut idx = [0u8; GROUP];
        let mut err = 0f32;
        for (q, &v) in idx.iter_mut().zip(x) {
            let (c, e) = nearest_mxfp4(v * inv);
            *q = c;
            err += e;
        }
        // Errors in level units of 2^k: compare them in the weights' units.
        let err = err * f32::from_bits(((2 * k + 127) as u32) << 23);
        if err < best.2 {
            best = ((k + 128) as u8, idx, err);
        }
    }
    (best.0, best.1)
}

/// Half level units covered by [`NEAREST`]: `v` in [-128, 128).
const HALF_UNITS: usize = 512;

/// The index of the level nearest to each half unit of [-128, 128).
static NEAREST: [u8; HALF_UNITS] = nearest_table();

const fn nearest_table() -> [u8; HALF_UNITS] {
    let mut t = [0u8; HALF_UNITS];
    let mut i = 0;
    while i < HALF_UNITS {
        // Twice the value, so that midpoints between levels are exact.
        let v2 = i as i32 - 256;
        let mut best = 0;
        let mut j = 1;
        while j < 16 {
            let d = (2 * IQ4_NL_LEVELS[j] as i32 - v2).abs();
            if d < (2 * IQ4_NL_LEVELS[best] as i32 - v2).abs() {
                best = j;
            }
            j += 1;
        }
        t[i] = best as u8;
        i += 1;
    }
    t
}

/// The level of [`IQ4_NL_LEVELS`] nearest to `v` (in level units), to half
/// a unit (levels are at least 10 units apart).
#[inline]
fn nearest_level(v: f32) -> u8 {
    // Truncation of a non-negative value rounds down (and compiles to one
    // instruction on every x86-64, where `round` is a library call).
    let i = (v * 2.0 + 256.5).clamp(0.0, (HALF_UNITS - 1) as f32);
    NEAREST[i as usize]
}

/// A scale and level indices for one block of `iq4_nl`: nearest levels for
/// a few candidate scales around "largest magnitude to the outer level",
/// each refit by least squares; the one of smallest squared error wins.
#[inline(always)]
fn iq4_nl_fit(x: &[f32; GROUP]) -> (f32, [u8; GROUP]) {
    let max = x
        .iter()
        .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
    let mut best = (0f32, [nearest_level(0.0); GROUP], f32::INFINITY);
    if max == 0.0 {
        return (best.0, best.1);
    }
    for step in -4..=4 {
        // The largest weight lands on level -127 + step (of either sign).
        let d0 = max / (IQ4_NL_LEVELS[0] as f32 + step as f32);
        let inv = 1.0 / d0;
        let mut idx = [0u8; GROUP];
        let (mut sxl, mut sll) = (0f32, 0f32);
        for (i, &v) in x.iter().enumerate() {
            idx[i] = nearest_level(v * inv);
            let l = IQ4_NL_LEVELS[idx[i] as usize] as f32;
            sxl += v * l;
            sll += l * l;
        }
        let d = if sll > 0.0 { sxl / sll } else { d0 };
        // The error with the scale as it will be stored (f16).
        let ds = f16::from_f32(d).to_f32();
        let err: f32 = x
            .iter()
            .zip(&idx)
            .map(|(&v, &q)| (v - ds * IQ4_NL_LEVELS[q as usize] as f32).powi(2))
            .sum();
        if err < best.2 {
            best = (d, idx, err);
        }
    }
    (best.0, best.1)
}

/// The weights of one block, dequantized.
pub fn dequantize_block(format: QuantFormat, block: &[u8], out: &mut [f32]) {
    let d = if format == QuantFormat::Mxfp4 {
        mxfp4_scale(block[0])
    } else {
        f16::from_le_bytes([block[0], block[1]]).to_f32()
    };
    match format {
        QuantFormat::Q4_1 => {
            let m = f16::from_le_bytes([block[2], block[3]]).to_f32();
            for i in 0..GROUP / 2 {
                out[i] = d * (block[4 + i] & 15) as f32 + m;
                out[i + GROUP / 2] = d * (block[4 + i] >> 4) as f32 + m;
            }
        }
        QuantFormat::Q8_0 => {
            for (o, &q) in out.iter_mut().zip(&block[2..2 + GROUP]) {
                *o = d * q as i8 as f32;
            }
        }
        QuantFormat::Q4_0 | QuantFormat::Iq4Nl | QuantFormat::Mxfp4 => {
            let codes = &block[format.block_bytes() - GROUP / 2..];
            for i in 0..GROUP {
                let byte = codes[i % (GROUP / 2)];
                let q = if i < GROUP / 2 { byte & 15 } else { byte >> 4 };
                out[i] = d * match format {
                    QuantFormat::Q4_0 => q as f32 - 8.0,
                    QuantFormat::Mxfp4 => MXFP4_LEVELS[q as usize] as f32,
                    _ => IQ4_NL_LEVELS[q as usize] as f32,
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::elem::tests::Rng;

    fn dequantized(format: QuantFormat, x: &[f32; GROUP]) -> Vec<f32> {
        let mut block = vec![0u8; format.block_bytes()];
        quantize_block(format, x, &mut block);
        let mut out = vec![0f32; GROUP];
        dequantize_block(format, &block, &mut out);
        out
    }

    #[test]
    fn round_trip_error_is_within_half_a_step() {
        let mut rng = Rng(5);
        for _ in 0..200 {
            let x: [f32; GROUP] = std::array::from_fn(|_| rng.f32() * 3.0);
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (format, step) in [
                (QuantFormat::Q8_0, amax / 127.0 * 0.5),
                // Codes reach -8 steps but only +7: the weights of the other
                // sign than the largest may be clamped by up to one step.
                (QuantFormat::Q4_0, amax / 8.0),
                // The least-squares scale may clip the outermost weight.
                (QuantFormat::Iq4Nl, amax * 0.15),
            ] {
                let y = dequantized(format, &x);
                for (a, b) in x.iter().zip(&y) {
                    // The bound, plus the f16 rounding of the scale.
                    let tol = step + amax * 2e-3 + 1e-6;
                    assert!((a - b).abs() <= tol, "{format:?}: {a} vs {b} (step {step})");
                }
            }
        }
    }

    #[test]
    fn iq4_nl_beats_q4_0_on_gaussian_weights() {
        // Both formats spend 4.5 bits a weight; the non-linear levels should
        // fit bell-shaped weights more closely.
        let mut rng = Rng(9);
        let (mut e4, mut enl) = (0f64, 0f64);
        for _ in 0..500 {
            let x: [f32; GROUP] = std::array::from_fn(|_| {
                // Sum of uniforms: close to a normal distribution.
                (0..6).map(|_| rng.f32()).sum::<f32>()
            });
            for (format, e) in [(QuantFormat::Q4_0, &mut e4), (QuantFormat::Iq4Nl, &mut enl)] {
                let y = dequantized(format, &x);
                *e += x
                    .iter()
                    .zip(&y)
                    .map(|(a, b)| ((a - b) as f64).powi(2))
                    .sum::<f64>();
            }
        }
        assert!(enl < e4 * 0.9, "iq4_nl {enl} vs q4_0 {e4}");
    }

    #[test]
    fn zero_blocks_stay_zero() {
        for format in QuantFormat::ALL {
            assert!(dequantized(format, &[0.0; GROUP]).iter().all(|&v| v == 0.0));
        }
    }
}

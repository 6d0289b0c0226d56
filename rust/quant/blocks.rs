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
//!
//! Quantization rounds to nearest with no calibration data.

use half::f16;

use super::{QuantFormat, GROUP};

/// The 16 non-linear levels of `iq4_nl`, in increasing order.
pub const IQ4_NL_LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

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
    }
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
    let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
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
        QuantFormat::Q4_0 | QuantFormat::Iq4Nl => {
            for i in 0..GROUP {
                let byte = block[2 + i % (GROUP / 2)];
                let q = if i < GROUP / 2 { byte & 15 } else { byte >> 4 };
                out[i] = d * match format {
                    QuantFormat::Q4_0 => q as f32 - 8.0,
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

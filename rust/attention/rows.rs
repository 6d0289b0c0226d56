//! How a paged cache stores one (token, KV head) row of `head_size` values.
//!
//! A float cache keeps the model's element type as is. The 8-bit cache
//! (`kv_cache_dtype="int8"`) keeps each row as `head_size` signed bytes
//! followed by the row's scale, an `f32` in 4 little-endian bytes, so a row
//! takes `head_size + 4` bytes: about half of bf16 (0.53x at head size 64,
//! 0.52x at 128). The quantization is symmetric, one scale per row:
//! `scale = max|x| / 127` and `q = round_half_even(x / scale)`, computed in
//! f32 (a row of zeros has scale 0). Rows are quantized once, when they are
//! written. The attention kernel widens value rows back to f32 (`q * scale`)
//! a chunk at a time, as it does for bf16; against an 8-bit cache the query
//! rows are quantized the same way (per query head, before the score scale),
//! so the scores are integer dot products of the bytes times the two scales
//! (`kernel::ScoresI8`).

use crate::cpu::Element;

/// Extra elements an 8-bit row carries after its values: its f32 scale.
pub const INT8_SCALE_BYTES: usize = 4;

/// A cache element type for query/output element `T`.
pub trait KvElem<T: Element>: Copy + Send + Sync + 'static {
    /// Elements per stored row beyond `head_size`.
    const EXTRA: usize;
    /// Stores one row (`src.len() == head_size`, `dst.len() == head_size + EXTRA`).
    fn store_row(src: &[T], dst: &mut [Self]);
    /// Rows that already are f32 values (no widening needed), else `None`.
    fn f32_rows(rows: &[Self]) -> Option<&[f32]>;
    /// Widens `n` stored rows (`n * (d + EXTRA)` elements) into `dst` (`n * d`).
    fn widen_rows(rows: &[Self], d: usize, dst: &mut [f32]);
    /// Rows of an 8-bit cache as their bytes (values, then the scale), else `None`.
    fn i8_rows(rows: &[Self]) -> Option<&[i8]>;
}

impl<T: Element> KvElem<T> for T {
    const EXTRA: usize = 0;

    #[inline(always)]
    fn store_row(src: &[T], dst: &mut [T]) {
        dst.copy_from_slice(src);
    }

    #[inline(always)]
    fn f32_rows(rows: &[T]) -> Option<&[f32]> {
        T::as_f32_slice(rows)
    }

    #[inline(always)]
    fn widen_rows(rows: &[T], _d: usize, dst: &mut [f32]) {
        for (o, &x) in dst.iter_mut().zip(rows) {
            *o = x.to_f32();
        }
    }

    #[inline(always)]
    fn i8_rows(_rows: &[T]) -> Option<&[i8]> {
        None
    }
}

/// f32 rows under bf16 queries: the encoder's private cache, widened once
/// when it is written.
impl KvElem<half::bf16> for f32 {
    const EXTRA: usize = 0;

    #[inline(always)]
    fn store_row(src: &[half::bf16], dst: &mut [f32]) {
        for (o, x) in dst.iter_mut().zip(src) {
            *o = x.to_f32();
        }
    }

    #[inline(always)]
    fn f32_rows(rows: &[f32]) -> Option<&[f32]> {
        Some(rows)
    }

    #[inline(always)]
    fn widen_rows(rows: &[f32], _d: usize, dst: &mut [f32]) {
        dst.copy_from_slice(&rows[..dst.len()]);
    }

    #[inline(always)]
    fn i8_rows(_rows: &[f32]) -> Option<&[i8]> {
        None
    }
}

impl<T: Element> KvElem<T> for i8 {
    const EXTRA: usize = INT8_SCALE_BYTES;

    #[inline(always)]
    fn store_row(src: &[T], dst: &mut [i8]) {
        let d = src.len();
        let amax = src.iter().fold(0.0f32, |m, x| m.max(x.to_f32().abs()));
        let scale = amax / 127.0;
        let (values, tail) = dst.split_at_mut(d);
        if scale > 0.0 && scale.is_finite() {
            for (q, x) in values.iter_mut().zip(src) {
                *q = (x.to_f32() / scale).round_ties_even().clamp(-127.0, 127.0) as i8;
            }
        } else {
            values.fill(0);
        }
        let scale = if scale.is_finite() { scale } else { 0.0 };
        for (b, s) in tail.iter_mut().zip(scale.to_le_bytes()) {
            *b = s as i8;
        }
    }

    #[inline(always)]
    fn f32_rows(_rows: &[i8]) -> Option<&[f32]> {
        None
    }

    #[inline(always)]
    fn widen_rows(rows: &[i8], d: usize, dst: &mut [f32]) {
        let stride = d + INT8_SCALE_BYTES;
        for (row, out) in rows.chunks_exact(stride).zip(dst.chunks_exact_mut(d)) {
            let scale = row_scale(row, d);
            for (o, &q) in out.iter_mut().zip(&row[..d]) {
                *o = q as f32 * scale;
            }
        }
    }

    #[inline(always)]
    fn i8_rows(rows: &[i8]) -> Option<&[i8]> {
        Some(rows)
    }
}

/// The scale of one stored 8-bit row of `d` values.
#[inline(always)]
pub fn row_scale(row: &[i8], d: usize) -> f32 {
    let b = &row[d..d + INT8_SCALE_BYTES];
    f32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8])
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn int8_rows_round_trip_within_half_a_step() {
        let src: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 29) as f32 - 14.0) * 0.37)
            .collect();
        let mut row = vec![0i8; 64 + INT8_SCALE_BYTES];
        <i8 as KvElem<f32>>::store_row(&src, &mut row);
        let scale = row_scale(&row, 64);
        let amax = src.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        assert_eq!(scale, amax / 127.0);
        let mut back = vec![0.0f32; 64];
        <i8 as KvElem<f32>>::widen_rows(&row, 64, &mut back);
        for (a, b) in src.iter().zip(&back) {
            assert!((a - b).abs() <= scale * 0.5 + 1e-6, "{a} vs {b}");
        }
        // The largest magnitude is exact up to the scale's rounding.
        assert!(row[..64].iter().any(|&q| q == 127 || q == -127));
    }

    #[test]
    fn int8_zero_and_bf16_rows() {
        let mut row = vec![5i8; 8 + INT8_SCALE_BYTES];
        <i8 as KvElem<bf16>>::store_row(&[bf16::ZERO; 8], &mut row);
        assert!(row.iter().all(|&b| b == 0));
        let src: Vec<bf16> = [1.0f32, -2.0, 0.6, 0.26].map(bf16::from_f32).to_vec();
        let mut row = vec![0i8; 4 + INT8_SCALE_BYTES];
        <i8 as KvElem<bf16>>::store_row(&src, &mut row);
        // bf16(0.26) is 0.2598: 16.49 steps.
        assert_eq!(&row[..4], &[64, -127, 38, 16]);
    }
}

//! Dequantization of the GGUF block types that have no kernel of their own,
//! and the reader of a GGUF file's string arrays (its vocabulary).
//!
//! A GGUF file may hold tensors in types fastllm's kernels do not run
//! (the K-quants of llama.cpp's "_K_M" mixes, and the older 4/5-bit types
//! with an offset). At load such a tensor is dequantized here to f32 and
//! quantized again to the nearest kernel format by the caller. The types
//! with a kernel (`q8_0`, `q4_0`, `iq4_nl`, `q4_1`) are here too, so the
//! caller can convert any mix of them to one format.
//!
//! Block layouts (little-endian; `d`, `m`, `dmin` are f16):
//! - `q4_1` (32 weights, 20 bytes): `d`, `m`, 16 bytes of nibbles (low:
//!   weights 0..16, high: 16..32); `w = d * q + m`.
//! - `q5_0` (22 bytes): `d`, 4 bytes of fifth bits (`u32`, bit `i` for
//!   weight `i`), 16 bytes of nibbles; `w = d * (q - 16)`.
//! - `q5_1` (24 bytes): `d`, `m`, fifth bits, nibbles; `w = d * q + m`.
//! - `q4_k` (256 weights, 144 bytes): `d`, `dmin`, 12 bytes of eight 6-bit
//!   scales and eight 6-bit mins, 128 bytes of nibbles. Each 64 weights use
//!   32 bytes: low nibbles with sub-block `2i`, high with `2i + 1`;
//!   `w = d * sc * q - dmin * mn`.
//! - `q5_k` (176 bytes): as `q4_k` with 32 bytes of fifth bits after the
//!   scales (bit `2i` and `2i + 1` of byte `l` for the two sub-blocks).
//! - `q6_k` (210 bytes): 128 bytes of low nibbles, 64 bytes of high 2-bit
//!   pairs, 16 int8 scales (one per 16 weights), then `d`;
//!   `w = d * sc * (q - 32)`.
//! - `mxfp4` (32 weights, 17 bytes; gpt-oss's experts): one E8M0 exponent
//!   byte `e`, then 16 bytes of 4-bit E2M1 codes (low nibble: weights
//!   0..16, high: 16..32); `w = 2^(e - 128) * MXFP4_LEVELS[q]`, the levels
//!   being E2M1's values doubled (llama.cpp's `kvalues_mxfp4` and
//!   `ggml_e8m0_to_fp32_half`: the scale halved to match).

use half::f16;
use rayon::prelude::*;

use super::blocks::{
    dequantize_block, mxfp4_f16_scale, quantize_block, IQ4_NL_LEVELS, MXFP4_LEVELS,
};
use super::{QuantFormat, GROUP};
use crate::error::{CoreError, CoreResult};

/// A GGUF block type this module dequantizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockType {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Iq4Nl,
    Q4K,
    Q5K,
    Q6K,
    Mxfp4,
}

impl BlockType {
    /// Every type, with its GGUF name.
    pub const ALL: [(BlockType, &'static str); 10] = [
        (BlockType::Q4_0, "Q4_0"),
        (BlockType::Q4_1, "Q4_1"),
        (BlockType::Q5_0, "Q5_0"),
        (BlockType::Q5_1, "Q5_1"),
        (BlockType::Q8_0, "Q8_0"),
        (BlockType::Iq4Nl, "IQ4_NL"),
        (BlockType::Q4K, "Q4_K"),
        (BlockType::Q5K, "Q5_K"),
        (BlockType::Q6K, "Q6_K"),
        (BlockType::Mxfp4, "MXFP4"),
    ];

    /// The type named `name` (GGUF's spelling, any case).
    pub fn parse(name: &str) -> Result<BlockType, String> {
        Self::ALL
            .iter()
            .find(|(_, n)| n.eq_ignore_ascii_case(name))
            .map(|(t, _)| *t)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|(_, n)| *n).collect();
                format!(
                    "unknown block type {name:?}; expected one of {}",
                    names.join(", ")
                )
            })
    }

    /// Weights per block.
    pub fn block_len(self) -> usize {
        match self {
            BlockType::Q4K | BlockType::Q5K | BlockType::Q6K => 256,
            _ => GROUP,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            BlockType::Q4_0 | BlockType::Iq4Nl => 18,
            BlockType::Q4_1 => 20,
            BlockType::Q5_0 => 22,
            BlockType::Q5_1 => 24,
            BlockType::Q8_0 => 34,
            BlockType::Q4K => 144,
            BlockType::Q5K => 176,
            BlockType::Q6K => 210,
            BlockType::Mxfp4 => 17,
        }
    }
}

#[inline(always)]
fn half(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Scale and min of sub-block `j` (0..8) from the 12 packed bytes of a
/// `q4_k` / `q5_k` block: six bits each, the first four pairs in the low
/// bits of bytes 0..8, the last four split over bytes 8..12 and the top two
/// bits of bytes 0..8.
#[inline(always)]
fn scale_min(q: &[u8], j: usize) -> (f32, f32) {
    let (sc, mn) = if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    };
    (sc as f32, mn as f32)
}

/// Dequantizes one block of `kind` into `out` (`kind.block_len()` values).
#[inline(always)]
fn dequantize_one(kind: BlockType, b: &[u8], out: &mut [f32]) {
    match kind {
        BlockType::Q8_0 => dequantize_block(QuantFormat::Q8_0, b, out),
        BlockType::Q4_0 => dequantize_block(QuantFormat::Q4_0, b, out),
        BlockType::Iq4Nl => dequantize_block(QuantFormat::Iq4Nl, b, out),
        BlockType::Q4_1 => dequantize_block(QuantFormat::Q4_1, b, out),
        BlockType::Q5_0 | BlockType::Q5_1 => {
            let offset = kind == BlockType::Q5_1;
            let d = half(b, 0);
            let (m, at) = if offset { (half(b, 2), 4) } else { (0.0, 2) };
            let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
            let qs = &b[at + 4..at + 20];
            let bias = if offset { 0 } else { 16 };
            for i in 0..16 {
                let lo = ((qs[i] & 15) as u32 | (((qh >> i) & 1) << 4)) as i32 - bias;
                let hi = ((qs[i] >> 4) as u32 | (((qh >> (i + 16)) & 1) << 4)) as i32 - bias;
                out[i] = d * lo as f32 + m;
                out[i + 16] = d * hi as f32 + m;
            }
        }
        BlockType::Q4K | BlockType::Q5K => {
            let (d, dmin) = (half(b, 0), half(b, 2));
            let scales = &b[4..16];
            let (qh, qs) = if kind == BlockType::Q5K {
                (Some(&b[16..48]), &b[48..176])
            } else {
                (None, &b[16..144])
            };
            for chunk in 0..4 {
                let q = &qs[chunk * 32..chunk * 32 + 32];
                for half_idx in 0..2 {
                    let sub = chunk * 2 + half_idx;
                    let (sc, mn) = scale_min(scales, sub);
                    let (scale, min) = (d * sc, dmin * mn);
                    for l in 0..32 {
                        let nib = if half_idx == 0 { q[l] & 15 } else { q[l] >> 4 };
                        let high = qh.map_or(0, |h| ((h[l] >> sub) & 1) << 4);
                        out[sub * 32 + l] = scale * (nib | high) as f32 - min;
                    }
                }
            }
        }
        BlockType::Mxfp4 => dequantize_block(QuantFormat::Mxfp4, b, out),
        BlockType::Q6K => {
            let (ql, qh) = (&b[0..128], &b[128..192]);
            let sc = &b[192..208];
            let d = half(b, 208);
            for n in 0..2 {
                let (ql, qh) = (&ql[n * 64..], &qh[n * 32..]);
                let sc = &sc[n * 8..];
                let y = &mut out[n * 128..n * 128 + 128];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 15) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                    y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                    y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                    y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                }
            }
        }
    }
}

/// Dequantizes `blocks` (whole blocks of `kind`, row after row) into `out`,
/// which must hold exactly the blocks' values; runs on the kernels' threads.
pub fn dequantize(kind: BlockType, blocks: &[u8], out: &mut [f32]) -> CoreResult<()> {
    let (len, bytes) = (kind.block_len(), kind.block_bytes());
    let what = format!("{kind:?} to f32");
    per_block_chunks(
        &what,
        blocks,
        bytes,
        out,
        len,
        (1 << 16) / len,
        |src, out| {
            for (y, b) in out.chunks_exact_mut(len).zip(src.chunks_exact(bytes)) {
                dequantize_one(kind, b, y);
            }
        },
    )
}

/// Runs `f` over matching chunks of `per_task` blocks of `src` (blocks of
/// `src_block` bytes) and of `out` (`out_block` items per block), in
/// parallel on the kernels' threads, once `src` is seen to hold whole
/// blocks and `out` exactly their output; `what` names the conversion in
/// the error.
fn per_block_chunks<T: Send>(
    what: &str,
    src: &[u8],
    src_block: usize,
    out: &mut [T],
    out_block: usize,
    per_task: usize,
    f: impl Fn(&[u8], &mut [T]) + Sync,
) -> CoreResult<()> {
    if !src.len().is_multiple_of(src_block) || src.len() / src_block * out_block != out.len() {
        return Err(CoreError::invalid(format!(
            "{what}: {} bytes of blocks do not match an output of {} items",
            src.len(),
            out.len()
        )));
    }
    let per_task = per_task.max(1);
    crate::cpu::threads::install(|| {
        out.par_chunks_mut(per_task * out_block)
            .zip(src.par_chunks(per_task * src_block))
            .for_each(|(out, src)| f(src, out));
    });
    Ok(())
}

/// Converts blocks of `kind` to `q8_0` blocks (`out`: 34 bytes per 32
/// weights), group by group, without a float copy of the whole tensor, on
/// the kernels' threads: exactly for the types of [`converts_exactly`],
/// otherwise each block dequantized and quantized again.
pub fn to_q8_0(kind: BlockType, blocks: &[u8], out: &mut [u8]) -> CoreResult<()> {
    let (len, bytes) = (kind.block_len(), kind.block_bytes());
    let out_block = len / GROUP * QuantFormat::Q8_0.block_bytes();
    let what = format!("{kind:?} to q8_0");
    per_block_chunks(
        &what,
        blocks,
        bytes,
        out,
        out_block,
        (1 << 14) / len,
        |src, out| crate::cpu::simd::dispatch(crate::cpu::best_path(), ToQ8 { kind, src, out }),
    )
}

/// Whether `kind` converts to `q8_0` exactly: its weights are `d` times
/// integers in -128..127 (`q4_0`: `q - 8`, `q5_0`: `q - 16`, `iq4_nl`: its
/// levels, `mxfp4`: its doubled E2M1 levels), so the `q8_0` block keeps `d`
/// and those integers, bit for bit the same weights. For `mxfp4` that holds
/// for every block whose scale an f16 holds ([`mxfp4_f16_scale`]: `e` in
/// 104..=143, weights from 2^-24 to 12 * 2^15 in size, or zero codes); any
/// other block is dequantized and quantized again.
pub fn converts_exactly(kind: BlockType) -> bool {
    matches!(
        kind,
        BlockType::Q8_0 | BlockType::Q4_0 | BlockType::Q5_0 | BlockType::Iq4Nl | BlockType::Mxfp4
    )
}

/// Writes the exact `q8_0` block of `b` into `out` when `kind` has one
/// ([`converts_exactly`]); false otherwise.
#[inline(always)]
fn exact_codes(kind: BlockType, b: &[u8], out: &mut [u8]) -> bool {
    if !converts_exactly(kind) {
        return false;
    }
    if kind == BlockType::Mxfp4 {
        let Some(d) = mxfp4_f16_scale(b) else {
            return false; // no f16 holds the scale
        };
        out[..2].copy_from_slice(&d.to_le_bytes());
        for i in 0..GROUP / 2 {
            out[2 + i] = MXFP4_LEVELS[(b[1 + i] & 15) as usize] as u8;
            out[2 + i + GROUP / 2] = MXFP4_LEVELS[(b[1 + i] >> 4) as usize] as u8;
        }
        return true;
    }
    out[..2].copy_from_slice(&b[..2]);
    let codes = &mut out[2..2 + GROUP];
    match kind {
        BlockType::Q8_0 => codes.copy_from_slice(&b[2..2 + GROUP]),
        BlockType::Q4_0 | BlockType::Iq4Nl => {
            for i in 0..GROUP / 2 {
                let (lo, hi) = (b[2 + i] & 15, b[2 + i] >> 4);
                let code = |q: u8| -> i8 {
                    if kind == BlockType::Q4_0 {
                        q as i8 - 8
                    } else {
                        IQ4_NL_LEVELS[q as usize]
                    }
                };
                codes[i] = code(lo) as u8;
                codes[i + GROUP / 2] = code(hi) as u8;
            }
        }
        _ => {
            // q5_0: nibbles and a fifth bit, minus 16.
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for i in 0..GROUP / 2 {
                let lo = (b[6 + i] & 15) as u32 | (((qh >> i) & 1) << 4);
                let hi = (b[6 + i] >> 4) as u32 | (((qh >> (i + 16)) & 1) << 4);
                codes[i] = (lo as i32 - 16) as i8 as u8;
                codes[i + GROUP / 2] = (hi as i32 - 16) as i8 as u8;
            }
        }
    }
    true
}

/// One task of [`to_q8_0`] as a kernel: the loops compile inside the
/// fastest SIMD path's entry point (vector rounding instead of a libm call
/// per weight), with the same IEEE operations, so the same blocks.
struct ToQ8<'a> {
    kind: BlockType,
    src: &'a [u8],
    out: &'a mut [u8],
}

impl crate::cpu::simd::Kernel for ToQ8<'_> {
    type Output = ();
    #[inline(always)]
    fn run<S: crate::cpu::simd::Simd>(self) {
        let (len, bytes) = (self.kind.block_len(), self.kind.block_bytes());
        let q8 = QuantFormat::Q8_0.block_bytes();
        let mut vals = [0f32; 256];
        let vals = &mut vals[..len];
        let out_per_block = len / GROUP * q8;
        for (o, b) in self
            .out
            .chunks_exact_mut(out_per_block)
            .zip(self.src.chunks_exact(bytes))
        {
            if exact_codes(self.kind, b, o) {
                continue;
            }
            dequantize_one(self.kind, b, vals);
            for (group, block) in vals
                .as_chunks::<GROUP>()
                .0
                .iter()
                .zip(o.chunks_exact_mut(q8))
            {
                quantize_block(QuantFormat::Q8_0, group, block);
            }
        }
    }
}

/// Rewrites `q4_k` super-blocks as `q4_1` blocks (eight per super-block),
/// which the kernels run: sub-block `j`'s scale `d * sc_j` and minimum
/// `-dmin * mn_j` rounded to f16 (a relative change of at most 2^-11 each),
/// its 32 codes as they are. Runs on the kernels' threads.
pub fn q4_k_to_q4_1(src: &[u8], out: &mut [u8]) -> CoreResult<()> {
    let (sb, ob) = (
        BlockType::Q4K.block_bytes(),
        8 * QuantFormat::Q4_1.block_bytes(),
    );
    per_block_chunks("Q4_K to q4_1", src, sb, out, ob, 256, |src, out| {
        for (o, b) in out.chunks_exact_mut(ob).zip(src.chunks_exact(sb)) {
            let (d, dmin) = (half(b, 0), half(b, 2));
            let (scales, qs) = (&b[4..16], &b[16..144]);
            for (sub, block) in o.chunks_exact_mut(ob / 8).enumerate() {
                let (sc, mn) = scale_min(scales, sub);
                block[..2].copy_from_slice(&f16::from_f32(d * sc).to_le_bytes());
                block[2..4].copy_from_slice(&f16::from_f32(-dmin * mn).to_le_bytes());
                let q = &qs[sub / 2 * 32..sub / 2 * 32 + 32];
                let code = |l: usize| if sub % 2 == 0 { q[l] & 15 } else { q[l] >> 4 };
                for i in 0..GROUP / 2 {
                    block[4 + i] = code(i) | (code(i + GROUP / 2) << 4);
                }
            }
        }
    })
}

/// GGUF `mxfp4` blocks (into `out`, 17 bytes each) from MXFP4 weights
/// stored as gpt-oss's checkpoints store them: `codes`, 16 bytes a block,
/// byte `i` holding codes `2i` and `2i + 1` in its low and high nibble, and
/// `scales`, one E8M0 exponent byte a block. GGUF's byte `i` holds codes `i`
/// and `16 + i`; the exponent byte is the same.
pub fn mxfp4_from_pairs(codes: &[u8], scales: &[u8], out: &mut [u8]) -> CoreResult<()> {
    let (bb, cb) = (BlockType::Mxfp4.block_bytes(), GROUP / 2);
    if codes.len() != scales.len() * cb || out.len() != scales.len() * bb {
        return Err(CoreError::invalid(format!(
            "MXFP4 blocks: {} code bytes, {} scales and {} output bytes are not 16, 1 and 17 \
             per block",
            codes.len(),
            scales.len(),
            out.len()
        )));
    }
    const PER_TASK: usize = 4096;
    const LOW: u64 = 0x0f0f_0f0f_0f0f_0f0f;
    crate::cpu::threads::install(|| {
        out.par_chunks_mut(PER_TASK * bb)
            .zip(codes.par_chunks(PER_TASK * cb))
            .zip(scales.par_chunks(PER_TASK))
            .for_each(|((out, codes), scales)| {
                let blocks = out.chunks_exact_mut(bb).zip(codes.chunks_exact(cb));
                for ((o, b), &e) in blocks.zip(scales) {
                    o[0] = e;
                    // Byte j of `a` holds codes 2j, 2j + 1; of `c`, 16 + 2j, 17 + 2j.
                    let word =
                        |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
                    let (a, c) = (word(0), word(8));
                    // Output bytes 2j and 2j + 1.
                    let even = (a & LOW) | ((c & LOW) << 4);
                    let odd = ((a >> 4) & LOW) | (c & !LOW);
                    for (j, (x, y)) in even
                        .to_le_bytes()
                        .into_iter()
                        .zip(odd.to_le_bytes())
                        .enumerate()
                    {
                        o[1 + 2 * j] = x;
                        o[2 + 2 * j] = y;
                    }
                }
            });
    });
    Ok(())
}

/// The `count` length-prefixed strings (u64 length, then the bytes) of a
/// GGUF string array starting at `pos` in `data`: their byte ranges and the
/// position after the last one; an error names the string that runs past
/// the end.
pub fn string_array(
    data: &[u8],
    mut pos: usize,
    count: usize,
) -> CoreResult<(Vec<(usize, usize)>, usize)> {
    let mut out = Vec::with_capacity(count.min(data.len() / 8));
    for i in 0..count {
        let len = data
            .get(pos..pos + 8)
            .map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]));
        let end = len
            .and_then(|n| usize::try_from(n).ok())
            .and_then(|n| (pos + 8).checked_add(n));
        match end {
            Some(end) if end <= data.len() => {
                out.push((pos + 8, end));
                pos = end;
            }
            _ => {
                return Err(CoreError::invalid(format!(
                    "string {i} of {count} runs past the end of the data"
                )))
            }
        }
    }
    Ok((out, pos))
}

#[cfg(test)]
mod tests {
    use super::super::blocks::mxfp4_scale;
    use super::*;

    #[test]
    fn kernel_formats_dequantize_as_their_blocks_do() {
        let x: [f32; GROUP] = std::array::from_fn(|i| (i as f32 - 15.5) * 0.37);
        for (fmt, kind) in [
            (QuantFormat::Q8_0, BlockType::Q8_0),
            (QuantFormat::Q4_0, BlockType::Q4_0),
            (QuantFormat::Iq4Nl, BlockType::Iq4Nl),
            (QuantFormat::Mxfp4, BlockType::Mxfp4),
        ] {
            let mut block = vec![0u8; fmt.block_bytes()];
            quantize_block(fmt, &x, &mut block);
            let (mut a, mut b) = (vec![0f32; GROUP], vec![0f32; GROUP]);
            dequantize_block(fmt, &block, &mut a);
            dequantize(kind, &block, &mut b).unwrap();
            assert_eq!(a, b);
        }
    }

    #[test]
    fn q4_1_and_q5_follow_their_formulas() {
        // d = 1, m = 0.5; nibbles i & 15 and fifth bits alternating.
        let one = f16::from_f32(1.0).to_le_bytes();
        let half_v = f16::from_f32(0.5).to_le_bytes();
        let mut q41 = vec![one[0], one[1], half_v[0], half_v[1]];
        q41.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
        let mut y = vec![0f32; 32];
        dequantize(BlockType::Q4_1, &q41, &mut y).unwrap();
        for i in 0..16 {
            assert_eq!(y[i], i as f32 + 0.5);
            assert_eq!(y[i + 16], (15 - i) as f32 + 0.5);
        }
        let mut q50 = vec![one[0], one[1]];
        q50.extend(0x5555_5555u32.to_le_bytes());
        q50.extend((0..16u8).map(|i| i | (i << 4)));
        dequantize(BlockType::Q5_0, &q50, &mut y).unwrap();
        for (i, &v) in y.iter().enumerate() {
            let fifth = if i % 2 == 0 { 16 } else { 0 };
            assert_eq!(v, ((i % 16) as i32 + fifth - 16) as f32, "weight {i}");
        }
    }

    #[test]
    fn mxfp4_pairs_become_gguf_order() {
        // Code c of block k is (3 * c + k) % 16, stored in pairs.
        let blocks = 3;
        let mut codes = vec![0u8; blocks * 16];
        for (k, b) in codes.chunks_exact_mut(16).enumerate() {
            for c in 0..32 {
                b[c / 2] |= (((3 * c + k) % 16) as u8) << (4 * (c % 2));
            }
        }
        let scales: Vec<u8> = (0..blocks as u8).map(|k| 120 + k).collect();
        let mut out = vec![0u8; blocks * 17];
        mxfp4_from_pairs(&codes, &scales, &mut out).unwrap();
        for (k, o) in out.chunks_exact(17).enumerate() {
            assert_eq!(o[0], 120 + k as u8);
            for i in 0..16 {
                assert_eq!(o[1 + i] & 15, ((3 * i + k) % 16) as u8);
                assert_eq!(o[1 + i] >> 4, ((3 * (i + 16) + k) % 16) as u8);
            }
        }
        assert!(mxfp4_from_pairs(&codes[..20], &scales, &mut out).is_err());
        assert!(mxfp4_from_pairs(&codes, &scales[..2], &mut out).is_err());
    }

    #[test]
    fn string_arrays_and_their_bounds() {
        let mut data = vec![7u8];
        for s in ["ab", "", "héllo"] {
            data.extend((s.len() as u64).to_le_bytes());
            data.extend(s.as_bytes());
        }
        let (ranges, end) = string_array(&data, 1, 3).unwrap();
        let got: Vec<&[u8]> = ranges.iter().map(|&(a, b)| &data[a..b]).collect();
        assert_eq!(got, [&b"ab"[..], b"", "héllo".as_bytes()]);
        assert_eq!(end, data.len());
        assert!(string_array(&data, 1, 4).is_err());
        assert!(string_array(&data[..data.len() - 1], 1, 3).is_err());
        let huge = [u64::MAX.to_le_bytes().as_slice(), b"x"].concat();
        assert!(string_array(&huge, 0, 1).is_err());
    }

    #[test]
    fn to_q8_0_is_dequantize_then_quantize() {
        let mut rng = crate::cpu::elem::tests::Rng(5);
        for (kind, _) in BlockType::ALL {
            let n = 3 * kind.block_bytes();
            let mut src: Vec<u8> = (0..n).map(|_| (rng.f32() * 256.0) as u8).collect();
            let d = f16::from_f32(0.01).to_le_bytes();
            for (i, b) in src.chunks_exact_mut(kind.block_bytes()).enumerate() {
                if kind == BlockType::Mxfp4 {
                    b[0] = 118 + 3 * i as u8; // scales 2^-10, 2^-7, 2^-4: f16s
                    continue;
                }
                let at = if kind == BlockType::Q6K { 208 } else { 0 };
                b[at..at + 2].copy_from_slice(&d);
                if matches!(
                    kind,
                    BlockType::Q4_1 | BlockType::Q5_1 | BlockType::Q4K | BlockType::Q5K
                ) {
                    b[2..4].copy_from_slice(&d);
                }
            }
            let mut vals = vec![0f32; 3 * kind.block_len()];
            dequantize(kind, &src, &mut vals).unwrap();
            let mut want = vec![0u8; vals.len() / GROUP * 34];
            for (g, o) in vals
                .as_chunks::<GROUP>()
                .0
                .iter()
                .zip(want.chunks_exact_mut(34))
            {
                quantize_block(QuantFormat::Q8_0, g, o);
            }
            let mut got = vec![0u8; want.len()];
            to_q8_0(kind, &src, &mut got).unwrap();
            if converts_exactly(kind) {
                // The very weights: the q8_0 blocks dequantize to them.
                let mut back = vec![0f32; vals.len()];
                for (y, b) in back.chunks_exact_mut(GROUP).zip(got.chunks_exact(34)) {
                    dequantize_block(QuantFormat::Q8_0, b, y);
                }
                assert_eq!(back, vals, "{kind:?}");
            } else {
                assert_eq!(got, want, "{kind:?}");
            }
            assert!(to_q8_0(kind, &src[1..], &mut got).is_err());
        }
    }

    #[test]
    fn q4_k_as_q4_1_blocks_dequantizes_alike() {
        let mut rng = crate::cpu::elem::tests::Rng(3);
        let mut src = vec![0u8; 2 * 144];
        for b in src.iter_mut() {
            *b = (rng.f32() * 256.0) as u8;
        }
        for sb in 0..2 {
            let d = f16::from_f32(0.01 + 0.001 * sb as f32).to_le_bytes();
            let m = f16::from_f32(0.02).to_le_bytes();
            src[sb * 144..sb * 144 + 4].copy_from_slice(&[d[0], d[1], m[0], m[1]]);
        }
        let mut want = vec![0f32; 512];
        dequantize(BlockType::Q4K, &src, &mut want).unwrap();
        let mut blocks = vec![0u8; 16 * 20];
        q4_k_to_q4_1(&src, &mut blocks).unwrap();
        let mut got = vec![0f32; 512];
        for (o, b) in got.chunks_exact_mut(GROUP).zip(blocks.chunks_exact(20)) {
            dequantize_block(QuantFormat::Q4_1, b, o);
        }
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= scale * 2e-3, "{g} vs {w}");
        }
        assert!(q4_k_to_q4_1(&src[1..], &mut blocks).is_err());
    }

    #[test]
    fn mxfp4_follows_llama_cpp() {
        // e = 127: scale 2^-1; codes 1 and 7 (0.5 and 6), 8 and 15 (-0 and -6),
        // then 2, 5, 10, 13 in the low nibbles and 3, 4, 9, 11 in the high ones.
        let mut b = vec![127u8, 0x71, 0xF8];
        let (lo, hi) = ([2u8, 5, 10, 13], [3u8, 4, 9, 11]);
        b.extend((0..14).map(|i| lo[i % 4] | (hi[i % 4] << 4)));
        let mut y = vec![0f32; 32];
        dequantize(BlockType::Mxfp4, &b, &mut y).unwrap();
        assert_eq!(&y[..2], &[0.5, 0.0]);
        assert_eq!(&y[16..18], &[6.0, -6.0]);
        for i in 2..16 {
            assert_eq!(y[i], [1.0, 3.0, -1.0, -3.0][(i - 2) % 4], "weight {i}");
            assert_eq!(
                y[i + 16],
                [1.5, 2.0, -0.5, -1.5][(i - 2) % 4],
                "weight {}",
                i + 16
            );
        }
        // e = 0 and 1: ggml's subnormal scales 2^-128 and 2^-127; e = 255: 2^127.
        for (e, k) in [(0u8, -128), (1, -127), (255, 127)] {
            b[0] = e;
            dequantize(BlockType::Mxfp4, &b, &mut y).unwrap();
            assert_eq!(y[0], 2f64.powi(k) as f32, "e = {e}");
        }
        // To q8_0: the scale as an f16 and the doubled levels as codes,
        // exactly; a scale no f16 holds (e = 100) is quantized again.
        let mut q8 = vec![0u8; 34];
        for e in [104u8, 127, 143, 100] {
            b[0] = e;
            dequantize(BlockType::Mxfp4, &b, &mut y).unwrap();
            to_q8_0(BlockType::Mxfp4, &b, &mut q8).unwrap();
            let mut back = vec![0f32; 32];
            dequantize_block(QuantFormat::Q8_0, &q8, &mut back);
            if e == 100 {
                let mut want = vec![0u8; 34];
                quantize_block(QuantFormat::Q8_0, y[..].try_into().unwrap(), &mut want);
                assert_eq!(q8, want);
            } else {
                assert_eq!(back, y, "e = {e}");
                assert_eq!(f16::from_le_bytes([q8[0], q8[1]]).to_f32(), mxfp4_scale(e));
                assert_eq!(q8[2 + 16] as i8, 12);
            }
        }
    }

    #[test]
    fn rejects_partial_blocks() {
        let mut y = vec![0f32; 256];
        assert!(dequantize(BlockType::Q6K, &[0u8; 209], &mut y).is_err());
        assert!(dequantize(BlockType::Q6K, &[0u8; 210], &mut y[..255]).is_err());
        assert!(BlockType::parse("q6_k").is_ok());
        assert!(BlockType::parse("Q3_K").is_err());
    }
}

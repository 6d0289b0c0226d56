//! The panel layout of quantized weights (see the module docs of `quant`).

use std::sync::Arc;

use super::blocks::{
    dequantize_block, mxfp4_exponent, mxfp4_f16_scale, quantize_rows, IQ4_NL_LEVELS, MXFP4_LEVELS,
};
use super::kernel::MXFP4_PAIR_OFFSET;
use super::{QuantFormat, GROUP, NR};
use crate::cpu::elem::expect_matrix;
use crate::cpu::{Dst, Element, Src};
use crate::error::{CoreError, CoreResult};
use crate::gemm::{lines_filled, Line};

/// A quantized weight matrix in panel layout, with its bias.
pub struct QuantWeight {
    pub(super) format: QuantFormat,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) groups: usize,
    pub(super) lines: Lines,
    pub(super) bias: Option<Vec<f32>>,
}

/// A weight's panels: packed by this process, or mapped from a file of
/// panels packed earlier ([`QuantWeight::from_panels`]).
pub(super) enum Lines {
    Owned(Vec<Line>),
    Mapped {
        ptr: *const Line,
        len: usize,
        _owner: Arc<dyn Send + Sync>,
    },
}

// SAFETY: mapped lines are only read, and `_owner` keeps them valid and
// unchanged while they exist (the contract of `from_panels`).
unsafe impl Send for Lines {}
unsafe impl Sync for Lines {}

impl std::ops::Deref for Lines {
    type Target = [Line];
    fn deref(&self) -> &[Line] {
        match self {
            Lines::Owned(v) => v,
            // SAFETY: `len` lines at `ptr`, alive with `_owner`.
            Lines::Mapped { ptr, len, .. } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
        }
    }
}

impl std::fmt::Debug for QuantWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuantWeight")
            .field("format", &self.format)
            .field("n", &self.n)
            .field("k", &self.k)
            .field("bias", &self.bias.is_some())
            .finish()
    }
}

/// Rows quantized per piece of work when quantizing at load.
const ROWS_PER_PIECE: usize = NR * 4;

impl QuantWeight {
    /// Quantizes `weight` (`[n, k]`, row-major, torch `Linear` layout) to
    /// `format`, with `bias` (`[n]`) kept in f32. `k` need not be a multiple
    /// of 32: rows are padded with zeros.
    pub fn quantize(
        format: QuantFormat,
        weight: Src<'_>,
        bias: Option<Src<'_>>,
        n: usize,
        k: usize,
    ) -> CoreResult<Self> {
        expect_matrix("weight", weight.len(), n, k)?;
        let groups = k.div_ceil(GROUP);
        let kp = groups * GROUP;
        let bb = format.block_bytes();
        let panels_per_piece = ROWS_PER_PIECE / NR;
        Self::filled(
            format,
            n,
            k,
            bias,
            panels_per_piece,
            |piece, lines, panel_lines| {
                let r0 = piece * ROWS_PER_PIECE;
                let rows = ROWS_PER_PIECE.min(n - r0);
                // The rows, zero-padded to whole groups, as f32.
                let mut padded = vec![0f32; rows * kp];
                for r in 0..rows {
                    for c in 0..k {
                        padded[r * kp + c] = weight.get((r0 + r) * k + c);
                    }
                }
                let mut blocks = vec![0u8; rows * groups * bb];
                quantize_rows(format, &padded, rows, kp, &mut blocks);
                let rb = groups * bb;
                let row = |r: usize| &blocks[r * rb..(r + 1) * rb];
                fill_panels(format, &row, rows, groups, lines, panel_lines);
            },
        )
    }

    /// Adopts rows already quantized in the block layout of `blocks`
    /// (`[n, k / 32]` blocks, as a GGUF file stores them), bit for bit.
    pub fn from_blocks(
        format: QuantFormat,
        blocks: &[u8],
        bias: Option<Src<'_>>,
        n: usize,
        k: usize,
    ) -> CoreResult<Self> {
        Self::from_block_parts(format, &[blocks], bias, n, k)
    }

    /// As [`from_blocks`](Self::from_blocks), with the rows given in parts
    /// (whole rows each, in order): the tensors of a fused matrix, such as
    /// q, k and v, adopted without first copying them into one.
    pub fn from_block_parts(
        format: QuantFormat,
        parts: &[&[u8]],
        bias: Option<Src<'_>>,
        n: usize,
        k: usize,
    ) -> CoreResult<Self> {
        if !k.is_multiple_of(GROUP) {
            return Err(CoreError::invalid(format!(
                "{}: in_features ({k}) must be a multiple of {GROUP}",
                format.name()
            )));
        }
        let row_bytes = k / GROUP * format.block_bytes();
        let want = n * row_bytes;
        let got: usize = parts.iter().map(|p| p.len()).sum();
        if got != want
            || parts
                .iter()
                .any(|p| !p.len().is_multiple_of(row_bytes.max(1)))
        {
            return Err(CoreError::invalid(format!(
                "{} blocks: expected {want} bytes for {n} x {k} weights in whole rows, got {got}",
                format.name(),
            )));
        }
        if format == QuantFormat::Mxfp4 {
            check_mxfp4_scales(parts)?;
        }
        // The first row of each part.
        let mut starts = Vec::with_capacity(parts.len());
        let mut rows_before = 0;
        for p in parts {
            starts.push(rows_before);
            rows_before += p.len() / row_bytes.max(1);
        }
        let groups = k / GROUP;
        let row = |r: usize| -> &[u8] {
            let part = starts.partition_point(|&s| s <= r) - 1;
            let local = r - starts[part];
            &parts[part][local * row_bytes..(local + 1) * row_bytes]
        };
        Self::filled(format, n, k, bias, 1, |p, lines, panel_lines| {
            let r0 = p * NR;
            let rows = NR.min(n - r0);
            fill_panels(format, &|r| row(r0 + r), rows, groups, lines, panel_lines);
        })
    }

    /// Adopts panels packed earlier (the bytes of [`panel_bytes`](Self::panel_bytes)
    /// of a weight of the same format and shape, e.g. mapped from a file)
    /// where they lie, without a copy. `panels` must be 64-byte aligned.
    ///
    /// # Safety
    /// The memory of `panels` must stay valid and unchanged while `owner` is
    /// alive (the weight keeps `owner`).
    pub unsafe fn from_panels(
        format: QuantFormat,
        panels: &[u8],
        owner: Arc<dyn Send + Sync>,
        bias: Option<Src<'_>>,
        n: usize,
        k: usize,
    ) -> CoreResult<Self> {
        let bias = f32_bias(bias, n)?;
        let (groups, _, total) = panel_shape(format, n, k)?;
        let want = total * 64;
        if panels.len() != want {
            return Err(CoreError::invalid(format!(
                "panels: expected {want} bytes for {n} x {k} {} weights, got {}",
                format.name(),
                panels.len()
            )));
        }
        if !(panels.as_ptr() as usize).is_multiple_of(std::mem::align_of::<Line>()) {
            return Err(CoreError::invalid("panels: not aligned to 64 bytes"));
        }
        Ok(QuantWeight {
            format,
            n,
            k,
            groups,
            lines: Lines::Mapped {
                ptr: panels.as_ptr() as *const Line,
                len: total,
                _owner: owner,
            },
            bias,
        })
    }

    /// The panels as bytes (what [`from_panels`](Self::from_panels) adopts).
    pub fn panel_bytes(&self) -> &[u8] {
        // SAFETY: a Line is 64 plain bytes.
        unsafe {
            std::slice::from_raw_parts(self.lines.as_ptr() as *const u8, self.lines.len() * 64)
        }
    }

    /// A weight of `n x k` in `format` whose panels are written, in pieces of
    /// `panels` panels, by `fill(piece, lines, lines per panel)` on the
    /// kernels' threads (each piece's lines arrive zeroed).
    fn filled(
        format: QuantFormat,
        n: usize,
        k: usize,
        bias: Option<Src<'_>>,
        panels: usize,
        fill: impl Fn(usize, &mut [Line], usize) + Sync,
    ) -> CoreResult<Self> {
        let bias = f32_bias(bias, n)?;
        let (groups, panel_lines, total) = panel_shape(format, n, k)?;
        let lines = lines_filled(total, panel_lines * panels, |piece, lines| {
            fill(piece, lines, panel_lines)
        })
        .ok_or_else(|| CoreError::Exhausted(format!("weight: cannot allocate {n} x {k}")))?;
        Ok(QuantWeight {
            format,
            n,
            k,
            groups,
            lines: Lines::Owned(lines),
            bias,
        })
    }

    /// The format of the weights.
    pub fn format(&self) -> QuantFormat {
        self.format
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.n
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        self.k
    }

    /// Bytes of packed weights and scales (what one batch-1 call streams).
    pub fn nbytes(&self) -> usize {
        self.lines.len() * 64
    }

    pub(super) fn panels(&self) -> usize {
        self.n.div_ceil(NR)
    }

    fn panel_lines(&self) -> usize {
        self.groups * self.format.panel_block_bytes() / 64
    }

    /// The first byte of panel `p`.
    pub(super) fn panel(&self, p: usize) -> *const u8 {
        self.lines[p * self.panel_lines()..].as_ptr() as *const u8
    }

    /// The weights in the block layout of [`from_blocks`](Self::from_blocks)
    /// (rows padded with zeros to whole groups).
    pub fn to_blocks(&self) -> Vec<u8> {
        let (bb, pb) = (self.format.block_bytes(), self.format.panel_block_bytes());
        let mut out = vec![0u8; self.n * self.groups * bb];
        for (j, row) in out.chunks_exact_mut(self.groups * bb).enumerate() {
            let base = self.panel(j / NR);
            for (g, block) in row.chunks_exact_mut(bb).enumerate() {
                // SAFETY: the panel holds `groups` blocks of `pb` bytes.
                let blk = unsafe { std::slice::from_raw_parts(base.add(g * pb), pb) };
                unpack_block(self.format, blk, j % NR, block);
            }
        }
        out
    }

    /// `out[t] =` row `ids[t]` of the weights, dequantized (`out`: `[T, k]`):
    /// the lookup of an embedding table tied to this weight.
    pub fn embed(&self, ids: &[i64], out: Dst<'_>) -> CoreResult<()> {
        let k = self.k;
        expect_matrix("out", out.len(), ids.len(), k)?;
        let mut row = vec![0f32; k];
        let mut out = out;
        for (t, &id) in ids.iter().enumerate() {
            let j = usize::try_from(id)
                .map_err(|_| CoreError::invalid(format!("ids: negative token id {id}")))?;
            match &mut out {
                Dst::F32(o) => self.dequantize_row(j, &mut o[t * k..(t + 1) * k])?,
                Dst::Bf16(o) => {
                    self.dequantize_row(j, &mut row)?;
                    for (d, &v) in o[t * k..(t + 1) * k].iter_mut().zip(&row) {
                        *d = Element::from_f32(v);
                    }
                }
            }
        }
        Ok(())
    }

    /// Row `j` of the weights (output feature `j`), dequantized into `out`
    /// (`k` values): what an embedding table tied to this weight looks up.
    pub fn dequantize_row(&self, j: usize, out: &mut [f32]) -> CoreResult<()> {
        if j >= self.n {
            return Err(CoreError::invalid(format!(
                "row {j} out of range for {} rows",
                self.n
            )));
        }
        expect_matrix("out", out.len(), 1, self.k)?;
        let (p, jj) = (j / NR, j % NR);
        let base = self.panel(p);
        let bb = self.format.panel_block_bytes();
        let mut block = vec![0u8; self.format.block_bytes()];
        let mut vals = [0f32; GROUP];
        for g in 0..self.groups {
            // SAFETY: the panel holds `groups` blocks of `bb` bytes.
            let blk = unsafe { std::slice::from_raw_parts(base.add(g * bb), bb) };
            unpack_block(self.format, blk, jj, &mut block);
            dequantize_block(self.format, &block, &mut vals);
            let c0 = g * GROUP;
            let c1 = (c0 + GROUP).min(self.k);
            out[c0..c1].copy_from_slice(&vals[..c1 - c0]);
        }
        Ok(())
    }
}

/// Groups per row, lines per panel and lines in all of an `n x k` weight in
/// `format`.
fn panel_shape(format: QuantFormat, n: usize, k: usize) -> CoreResult<(usize, usize, usize)> {
    let groups = k.div_ceil(GROUP);
    let panel_lines = groups * format.panel_block_bytes() / 64;
    let total = n
        .div_ceil(NR)
        .checked_mul(panel_lines)
        .ok_or_else(|| CoreError::invalid("weight: packed size overflows"))?;
    Ok((groups, panel_lines, total))
}

/// A bias of `n` elements, as f32.
fn f32_bias(bias: Option<Src<'_>>, n: usize) -> CoreResult<Option<Vec<f32>>> {
    match bias {
        Some(b) if b.len() != n => Err(CoreError::invalid(format!(
            "bias: expected {n} elements, got {}",
            b.len()
        ))),
        Some(b) => Ok(Some((0..n).map(|j| b.get(j)).collect())),
        None => Ok(None),
    }
}

/// Writes the blocks of `rows` consecutive rows (`groups` blocks each;
/// `row(r)` is row `r`'s) into their panels (`panel_lines` lines each,
/// starting at `lines`). Row by row: one stream of reads, while the panel
/// being written stays in cache.
fn fill_panels<'a>(
    format: QuantFormat,
    row: &dyn Fn(usize) -> &'a [u8],
    rows: usize,
    groups: usize,
    lines: &mut [Line],
    panel_lines: usize,
) {
    let (bb, pb) = (format.block_bytes(), format.panel_block_bytes());
    for (p, panel) in lines.chunks_exact_mut(panel_lines).enumerate() {
        let r0 = p * NR;
        if r0 >= rows {
            break;
        }
        // SAFETY: a Line is 64 plain bytes.
        let bytes: &mut [u8] = unsafe {
            std::slice::from_raw_parts_mut(panel.as_mut_ptr() as *mut u8, panel.len() * 64)
        };
        for j in 0..NR.min(rows - r0) {
            let blocks = row(r0 + j);
            for (g, out) in bytes.chunks_exact_mut(pb).take(groups).enumerate() {
                pack_block(format, &blocks[g * bb..][..bb], j, out);
            }
        }
    }
}

/// The four bytes at `at` as one little-endian word.
#[inline(always)]
fn word(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// Places one row's block as feature `j` of a panel block.
///
/// `q8_0`: byte `b` of lane `j` in quad `q` (bytes `q * 128 + 4j + b`) is
/// weight `4q + b`. The 4-bit formats: in oct `o` (bytes `o * 128 + 4j + b`),
/// the low nibble is weight `8o + b`, the high nibble `8o + 4 + b`. The f16
/// scales of the 32 features follow the weights.
#[inline(always)]
fn pack_block(format: QuantFormat, block: &[u8], j: usize, out: &mut [u8]) {
    let scales = format.scale_offset();
    let mut q = &block[2..];
    if format == QuantFormat::Mxfp4 {
        // Checked by `check_mxfp4_scales` (a weight quantized here has an
        // f16 scale by construction).
        let d = mxfp4_f16_scale(block).unwrap_or(0);
        out[scales + 2 * j..scales + 2 * j + 2].copy_from_slice(&d.to_le_bytes());
        q = &block[1..];
    } else {
        out[scales + 2 * j..scales + 2 * j + 2].copy_from_slice(&block[..2]);
    }
    if format == QuantFormat::Q4_1 {
        let mins = format.min_offset();
        out[mins + 2 * j..mins + 2 * j + 2].copy_from_slice(&block[2..4]);
        q = &block[4..];
    }
    let mut put = |lane: usize, v: u32| {
        out[lane * 128 + 4 * j..][..4].copy_from_slice(&v.to_le_bytes());
    };
    match format {
        QuantFormat::Q8_0 => {
            for quad in 0..GROUP / 4 {
                put(quad, word(q, 4 * quad));
            }
        }
        QuantFormat::Q4_0 | QuantFormat::Iq4Nl | QuantFormat::Q4_1 | QuantFormat::Mxfp4 => {
            // Weight i < 16 is the low nibble of byte i, weight 16 + i its
            // high nibble: oct o's bytes pair weights 8o + b and 8o + 4 + b.
            const LOW: u32 = 0x0f0f_0f0f;
            for o in 0..GROUP / 16 {
                let (a, b) = (word(q, 8 * o), word(q, 8 * o + 4));
                put(o, (a & LOW) | ((b & LOW) << 4));
                put(o + GROUP / 16, ((a >> 4) & LOW) | (b & !LOW));
            }
        }
    }
}

/// The inverse of [`pack_block`]: feature `j`'s block from a panel block.
fn unpack_block(format: QuantFormat, pb: &[u8], j: usize, block: &mut [u8]) {
    let scales = format.scale_offset();
    let mut at = 2;
    if format == QuantFormat::Mxfp4 {
        block[0] = mxfp4_exponent(u16::from_le_bytes([
            pb[scales + 2 * j],
            pb[scales + 2 * j + 1],
        ]));
        at = 1;
    } else {
        block[..2].copy_from_slice(&pb[scales + 2 * j..scales + 2 * j + 2]);
    }
    if format == QuantFormat::Q4_1 {
        let mins = format.min_offset();
        block[2..4].copy_from_slice(&pb[mins + 2 * j..mins + 2 * j + 2]);
        at = 4;
    }
    match format {
        QuantFormat::Q8_0 => {
            for i in 0..GROUP {
                block[2 + i] = pb[(i / 4) * 128 + 4 * j + i % 4];
            }
        }
        QuantFormat::Q4_0 | QuantFormat::Iq4Nl | QuantFormat::Q4_1 | QuantFormat::Mxfp4 => {
            let mut nibs = [0u8; GROUP];
            for o in 0..GROUP / 8 {
                for b in 0..4 {
                    let byte = pb[o * 128 + 4 * j + b];
                    nibs[8 * o + b] = byte & 15;
                    nibs[8 * o + 4 + b] = byte >> 4;
                }
            }
            for i in 0..GROUP / 2 {
                block[at + i] = nibs[i] | (nibs[i + GROUP / 2] << 4);
            }
        }
    }
}

/// The levels of a format's codes (`iq4_nl`'s, or `mxfp4`'s; unused by the
/// others) as the kernels' lookup tables: for the paths without VNNI
/// (`iq4_nl`'s signed, for the sign trick; `mxfp4`'s plus
/// [`MXFP4_PAIR_OFFSET`], unsigned, for pair sums), and offset by 128
/// (unsigned) for the VNNI dot product.
pub(super) fn level_tables(format: QuantFormat) -> ([u8; 16], [u8; 16]) {
    let (levels, pairs) = if format == QuantFormat::Mxfp4 {
        (MXFP4_LEVELS, MXFP4_PAIR_OFFSET)
    } else {
        (IQ4_NL_LEVELS, 0)
    };
    (
        levels.map(|l| (l as i32 + pairs) as u8),
        levels.map(|l| (l as i32 + 128) as u8),
    )
}

/// Checks that the kernels' f16 scales hold every `mxfp4` block's scale
/// exactly ([`mxfp4_f16_scale`]); the error names the first block that
/// does not.
fn check_mxfp4_scales(parts: &[&[u8]]) -> CoreResult<()> {
    let bb = QuantFormat::Mxfp4.block_bytes();
    let mut before = 0;
    for p in parts {
        let blocks = p.chunks_exact(bb);
        let n = blocks.len();
        if let Some((i, b)) = blocks
            .enumerate()
            .find(|(_, b)| mxfp4_f16_scale(b).is_none())
        {
            return Err(CoreError::invalid(format!(
                "mxfp4 blocks: block {} has the exponent byte {} (a scale of 2^{}), which \
                 the kernels' f16 scales do not hold (exponent bytes 104..=143; convert \
                 such a tensor to q8_0)",
                before + i,
                b[0],
                b[0] as i32 - 128
            )));
        }
        before += n;
    }
    Ok(())
}

/// Bytes per write of [`write_chunked`]: a huge page, so that the page
/// cache keeps a file of panels in huge folios and a later mapping of it
/// reads them through huge pages (far fewer TLB misses while decode streams
/// them).
pub(crate) const PANEL_FILE_CHUNK: usize = 2 << 20;

/// Lays `parts` (offset, bytes; in order, not overlapping) out in chunks of
/// [`PANEL_FILE_CHUNK`] bytes at multiples of that size, zeros between the
/// parts, and hands each chunk to `write` (the last one cut at the end of
/// the last part).
pub fn write_chunked(
    parts: &[(u64, &[u8])],
    mut write: impl FnMut(u64, &[u8]) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let chunk = PANEL_FILE_CHUNK as u64;
    let end = parts
        .iter()
        .map(|(o, b)| o + b.len() as u64)
        .max()
        .unwrap_or(0);
    let mut buf = vec![0u8; PANEL_FILE_CHUNK];
    let mut first = 0; // the first part that may reach into this chunk
    let mut at = 0;
    while at < end {
        let stop = (at + chunk).min(end);
        buf.fill(0);
        while first < parts.len() && parts[first].0 + parts[first].1.len() as u64 <= at {
            first += 1;
        }
        for (o, b) in &parts[first..] {
            if *o >= stop {
                break;
            }
            let (lo, hi) = ((*o).max(at), (o + b.len() as u64).min(stop));
            buf[(lo - at) as usize..(hi - at) as usize]
                .copy_from_slice(&b[(lo - o) as usize..(hi - o) as usize]);
        }
        write(at, &buf[..(stop - at) as usize])?;
        at = stop;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_chunked_lays_parts_out_in_whole_chunks() {
        let c = PANEL_FILE_CHUNK as u64;
        let big: Vec<u8> = (0..(2 * PANEL_FILE_CHUNK + 7))
            .map(|i| (i % 251) as u8)
            .collect();
        let parts: Vec<(u64, &[u8])> = vec![
            (0, b"head"),
            (4096, &[1, 2, 3]),
            (c - 2, &[4, 5, 6, 7]), // across a chunk boundary
            (c + 4096, &big),       // across two more
            (4 * c, &[]),
            (4 * c, &[9]),
        ];
        let mut want = vec![0u8; 4 * PANEL_FILE_CHUNK + 1];
        for (o, b) in &parts {
            want[*o as usize..*o as usize + b.len()].copy_from_slice(b);
        }
        let mut got = vec![0xAAu8; want.len()];
        let mut writes = Vec::new();
        write_chunked(&parts, |at, bytes| {
            writes.push((at, bytes.len()));
            got[at as usize..at as usize + bytes.len()].copy_from_slice(bytes);
            Ok(())
        })
        .unwrap();
        assert_eq!(got, want);
        let sizes: Vec<(u64, usize)> = (0..4).map(|i| (i * c, PANEL_FILE_CHUNK)).collect();
        assert_eq!(writes[..4], sizes[..]);
        assert_eq!(writes[4], (4 * c, 1));
        assert_eq!(writes.len(), 5);
    }
}

//! Linear layers over weights packed once at load time: `y = x @ W^T + bias`
//! for any number of rows of `x`, from batch-1 decode to prefill chunks.
//!
//! ## Layout
//! The weight `[n, k]` is cut into panels of `NR = 32` output features. A
//! panel stores, for every `k`, its 32 weights in one 64-byte line (bf16) or
//! two (f32), so a panel is one contiguous stream of `k` lines. For bf16,
//! 32-bit word `j` of a line holds feature `j` in its low half and feature
//! `16 + j` in its high half: one shift and one mask widen the line into two
//! vectors of 16 f32 (features 0..16 and 16..32) with no shuffle. Features
//! past `n` are zero.
//!
//! ## Kernel
//! A register tile of `MR` rows of `x` × 32 features accumulates in f32 with
//! FMA (AVX-512F: `MR` up to 12, 24 accumulators; AVX2: up to 3, 12), each
//! weight line loaded once per tile and each element of `x` broadcast from
//! memory. On the Xeons measured, two f32 FMAs retire per cycle and one
//! `vdpbf16ps` per two, so widening bf16 and using FMA is twice as fast as the
//! bf16 dot-product instruction while reading the same bytes.
//!
//! Batch-1 decode streams every panel once (memory-bound); large batches
//! reuse each panel from L1/L2 for every tile of rows (compute-bound). Work
//! is split into tasks of (block of rows, group of panels) run by the thread
//! team (`threads::team_run`: the caller and helpers that stay awake between
//! the calls of a step); small calls run on the calling thread.

use half::bf16;
use rayon::prelude::*;

use crate::error::{CoreError, CoreResult};
use crate::linear::{expect_matrix, Dst, OutElem, Path, SharedOut, Src};

/// Output features per panel.
pub const NR: usize = 32;

/// Multiply-adds below which a call runs on the calling thread.
const SERIAL_FLOPS: usize = 1 << 18;

/// Up to this many rows a call is memory-bound: one task per thread.
const STREAM_ROWS: usize = 4;

/// Bytes of `x` (as f32) a block of rows may take, so that it stays in L2
/// while every panel of a task passes over it.
const ROW_BLOCK_BYTES: usize = 512 * 1024;

/// One 64-byte, 64-byte-aligned line of a panel.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// A weight matrix in panel layout, with its bias.
pub struct PackedWeight {
    n: usize,
    k: usize,
    bf16: bool,
    lines: Vec<Line>,
    bias: Option<Vec<f32>>,
}

impl std::fmt::Debug for PackedWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedWeight")
            .field("n", &self.n)
            .field("k", &self.k)
            .field("bf16", &self.bf16)
            .field("bias", &self.bias.is_some())
            .finish()
    }
}

impl PackedWeight {
    /// Packs `weight` (`[n, k]`, row-major, torch `Linear` layout) and `bias`
    /// (`[n]`). bf16 weights stay bf16 (two bytes per weight); f32 stay f32.
    pub fn pack(weight: Src<'_>, bias: Option<Src<'_>>, n: usize, k: usize) -> CoreResult<Self> {
        expect_matrix("weight", weight.len(), n, k)?;
        if let Some(b) = &bias {
            if b.len() != n {
                return Err(CoreError::invalid(format!(
                    "bias: expected {n} elements, got {}",
                    b.len()
                )));
            }
        }
        let bf16 = matches!(weight, Src::Bf16(_));
        let lines_per_k = if bf16 { 1 } else { 2 };
        let panels = n.div_ceil(NR);
        let panel_lines = k * lines_per_k;
        let total = panels
            .checked_mul(panel_lines)
            .ok_or_else(|| CoreError::invalid("weight: packed size overflows"))?;
        let mut lines: Vec<Line> = Vec::new();
        lines
            .try_reserve_exact(total)
            .map_err(|_| CoreError::Exhausted(format!("weight: cannot allocate {n} x {k}")))?;
        lines.resize(total, Line([0; 64]));
        if panel_lines > 0 {
            crate::threads::install(|| {
                lines
                    .par_chunks_mut(panel_lines)
                    .enumerate()
                    .for_each(|(p, panel)| pack_panel(weight, p * NR, n, k, bf16, panel));
            });
        }
        let bias = bias.map(|b| (0..n).map(|j| b.get(j)).collect());
        Ok(PackedWeight {
            n,
            k,
            bf16,
            lines,
            bias,
        })
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.n
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        self.k
    }

    /// Whether the weights are stored as bf16 (else f32).
    pub fn is_bf16(&self) -> bool {
        self.bf16
    }

    /// Bytes of packed weights (what one batch-1 call streams).
    pub fn nbytes(&self) -> usize {
        self.lines.len() * 64
    }

    fn panels(&self) -> usize {
        self.n.div_ceil(NR)
    }

    fn panel_bytes(&self) -> usize {
        self.k * if self.bf16 { 64 } else { 128 }
    }

    /// The weight at feature `j` of panel `p`, input `kk` (any path can read
    /// the layout through this; the scalar kernel does).
    #[inline]
    fn at(&self, p: usize, kk: usize, j: usize) -> f32 {
        let line = &self.lines[p * self.k * if self.bf16 { 1 } else { 2 }..];
        if self.bf16 {
            let bytes = &line[kk].0;
            let off = (j % 16) * 4 + if j < 16 { 0 } else { 2 };
            let bits = u16::from_le_bytes([bytes[off], bytes[off + 1]]);
            bf16::from_bits(bits).to_f32()
        } else {
            let bytes = &line[2 * kk + j / 16].0;
            let off = (j % 16) * 4;
            f32::from_le_bytes([bytes[off], bytes[off + 1], bytes[off + 2], bytes[off + 3]])
        }
    }
}

/// Fills one panel (features `n0..n0 + NR`) from the row-major weight.
fn pack_panel(weight: Src<'_>, n0: usize, n: usize, k: usize, bf16: bool, panel: &mut [Line]) {
    for j in 0..NR.min(n - n0) {
        let row = (n0 + j) * k;
        for kk in 0..k {
            if bf16 {
                let bits = match weight {
                    Src::Bf16(w) => w[row + kk].to_bits(),
                    Src::F32(_) => unreachable!("bf16 panels come from bf16 weights"),
                };
                let off = (j % 16) * 4 + if j < 16 { 0 } else { 2 };
                panel[kk].0[off..off + 2].copy_from_slice(&bits.to_le_bytes());
            } else {
                let v = weight.get(row + kk);
                let off = (j % 16) * 4;
                panel[2 * kk + j / 16].0[off..off + 4].copy_from_slice(&v.to_le_bytes());
            }
        }
    }
}

/// The register tile rows of each path.
fn max_rows(path: Path) -> usize {
    match path {
        Path::Scalar => 4,
        Path::Avx2 => 3,
        Path::Avx512 | Path::Avx512Bf16 => 12,
    }
}

/// The path used when a call names none: the fastest this CPU has
/// (AVX512-BF16 CPUs run the AVX-512F FMA kernel, see the module docs).
pub fn default_path() -> Path {
    match crate::linear::best_path() {
        Path::Avx512Bf16 => Path::Avx512,
        p => p,
    }
}

/// `out[m, j] = sum_k x[m, k] * W[j, k] + bias[j]` for `x` of `m` rows, on
/// the default path.
pub fn gemm(out: Dst<'_>, x: Src<'_>, w: &PackedWeight, m: usize) -> CoreResult<()> {
    gemm_with_path(default_path(), out, x, w, m)
}

/// As [`gemm`] on an explicit path (an error if the CPU lacks it).
pub fn gemm_with_path(
    path: Path,
    out: Dst<'_>,
    x: Src<'_>,
    w: &PackedWeight,
    m: usize,
) -> CoreResult<()> {
    if !path.is_available() {
        return Err(CoreError::invalid(format!(
            "linear kernel path '{}' is not supported by this CPU",
            path.name()
        )));
    }
    let (n, k) = (w.n, w.k);
    expect_matrix("x", x.len(), m, k)?;
    expect_matrix("out", out.len(), m, n)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    // The kernels read x as f32 rows.
    let converted: Vec<f32>;
    let xf: &[f32] = match x {
        Src::F32(s) => s,
        Src::Bf16(s) => {
            // A shift per element (vectorises; prefill chunks convert
            // megabytes here).
            converted = s
                .iter()
                .map(|v| f32::from_bits((v.to_bits() as u32) << 16))
                .collect();
            &converted
        }
    };
    match out {
        Dst::Bf16(o) => run(path, o, xf, w, m),
        Dst::F32(o) => run(path, o, xf, w, m),
    }
}

fn run<T: OutElem>(
    path: Path,
    out: &mut [T],
    x: &[f32],
    w: &PackedWeight,
    m: usize,
) -> CoreResult<()> {
    let (n, k) = (w.n, w.k);
    let mr = max_rows(path);
    let panels = w.panels();
    let threads = crate::threads::num_threads();
    // Rows per block: a multiple of the tile that keeps the block in L2.
    let by_cache = ((ROW_BLOCK_BYTES / (4 * k).max(1)) / mr * mr).max(mr);
    let row_blocks = m.div_ceil(by_cache);
    let rows_per_block = m.div_ceil(row_blocks).div_ceil(mr) * mr;
    let row_blocks = m.div_ceil(rows_per_block);
    // Panel groups, their sizes within one panel of each other: one per
    // thread for a few rows (memory-bound, equal work per panel, so fewer and
    // longer streams), else enough to balance the threads (4 per thread).
    let per_thread = if m <= STREAM_ROWS { 1 } else { 4 };
    let groups = (per_thread * threads).div_ceil(row_blocks).clamp(1, panels);
    let tasks = row_blocks * groups;
    let shared = SharedOut(out.as_mut_ptr());
    let task = |t: usize| {
        let (rb, g) = (t / groups, t % groups);
        let r0 = rb * rows_per_block;
        let r1 = (r0 + rows_per_block).min(m);
        let (p0, p1) = (g * panels / groups, (g + 1) * panels / groups);
        let mut tile = [[0f32; NR]; 12];
        for p in p0..p1 {
            let mut i = r0;
            while i < r1 {
                let rows = mr.min(r1 - i);
                tile_dispatch(path, &x[i * k..], k, w, p, rows, &mut tile);
                // SAFETY: rows r0..r1 x features of panel p belong to this
                // task only; out holds m * n elements (checked by the caller).
                unsafe { store_tile(shared.ptr(), &tile[..rows], w.bias.as_deref(), i, n, p) };
                i += rows;
            }
        }
    };
    if tasks == 1 || threads == 1 || m * n * k < SERIAL_FLOPS {
        (0..tasks).for_each(task);
        Ok(())
    } else {
        crate::threads::team_run(tasks, &task)
    }
}

/// Writes a tile of sums (+ bias) into rows `i..` and the features of panel `p`.
///
/// # Safety
/// `out` holds `[m, n]` with `i + tile.len() <= m`, and no other thread writes
/// those elements.
unsafe fn store_tile<T: OutElem>(
    out: *mut T,
    tile: &[[f32; NR]],
    bias: Option<&[f32]>,
    i: usize,
    n: usize,
    p: usize,
) {
    let j0 = p * NR;
    let width = NR.min(n - j0);
    for (r, sums) in tile.iter().enumerate() {
        let dst = std::slice::from_raw_parts_mut(out.add((i + r) * n + j0), width);
        match bias {
            Some(b) => {
                for ((d, &s), &bj) in dst.iter_mut().zip(sums).zip(&b[j0..j0 + width]) {
                    *d = T::from_f32(s + bj);
                }
            }
            None => {
                for (d, &s) in dst.iter_mut().zip(sums) {
                    *d = T::from_f32(s);
                }
            }
        }
    }
}

/// One register tile: `rows` rows of `x` (stride `k`, starting at `x[0]`) ×
/// panel `p`, sums into `tile[..rows]`.
fn tile_dispatch(
    path: Path,
    x: &[f32],
    k: usize,
    w: &PackedWeight,
    p: usize,
    rows: usize,
    tile: &mut [[f32; NR]; 12],
) {
    debug_assert!(x.len() >= (rows - 1) * k + k);
    #[cfg(target_arch = "x86_64")]
    {
        use x86::{tile_avx2, tile_avx512};
        let b = w.lines[p * w.panel_bytes() / 64..].as_ptr() as *const u8;
        macro_rules! each_rows {
            ($f:ident, $($r:literal)*) => {
                match rows {
                    $($r => unsafe { $f::<$r>(x.as_ptr(), k, b, w.bf16, tile) },)*
                    _ => unreachable!("tile rows exceed the path's maximum"),
                }
            };
        }
        match path {
            // SAFETY (all arms): the path is available (checked by the
            // caller); x holds `rows` rows of k, the panel k lines.
            Path::Avx512 | Path::Avx512Bf16 => {
                each_rows!(tile_avx512, 1 2 3 4 5 6 7 8 9 10 11 12);
                return;
            }
            Path::Avx2 => {
                each_rows!(tile_avx2, 1 2 3);
                return;
            }
            Path::Scalar => {}
        }
    }
    tile_scalar(x, k, w, p, rows, tile);
}

fn tile_scalar(
    x: &[f32],
    k: usize,
    w: &PackedWeight,
    p: usize,
    rows: usize,
    tile: &mut [[f32; NR]; 12],
) {
    for acc in tile.iter_mut().take(rows) {
        *acc = [0.0; NR];
    }
    let mut wrow = [0f32; NR];
    for kk in 0..k {
        for (j, v) in wrow.iter_mut().enumerate() {
            *v = w.at(p, kk, j);
        }
        for (r, acc) in tile.iter_mut().enumerate().take(rows) {
            let a = x[r * k + kk];
            for (s, &wv) in acc.iter_mut().zip(&wrow) {
                *s += a * wv;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::NR;
    use std::arch::x86_64::*;

    /// How far ahead (in lines) the one-row kernel prefetches each of the
    /// four segments of its panel.
    const PREFETCH_LINES: usize = 16;

    /// AVX-512F tile of `R` rows × 32 features.
    ///
    /// # Safety
    /// AVX-512F must be available; `x` points to `R` rows of `k` f32 (stride
    /// `k`), `b` to a panel of `k` lines (bf16) or `2k` lines (f32).
    #[target_feature(enable = "avx512f")]
    pub unsafe fn tile_avx512<const R: usize>(
        x: *const f32,
        k: usize,
        b: *const u8,
        bf16: bool,
        tile: &mut [[f32; NR]; 12],
    ) {
        let mut lo = [_mm512_setzero_ps(); R];
        let mut hi = [_mm512_setzero_ps(); R];
        let mask = _mm512_set1_epi32(0xffff_0000u32 as i32);
        if bf16 && R == 1 {
            // One row is memory-bound. The panel is read as four segments at
            // once: four streams keep more lines in flight than one (the
            // hardware prefetchers stop at every 4 KB page of a stream), each
            // prefetched ahead, and give four independent pairs of chains.
            let seg = k / 4;
            let mut acc = [_mm512_setzero_ps(); 8];
            for i in 0..seg {
                if i % 2 == 0 {
                    // Every other line: the adjacent-line prefetcher brings the rest.
                    for u in 0..4 {
                        let ahead = b.wrapping_add((u * seg + i + PREFETCH_LINES) * 64);
                        _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
                    }
                }
                for u in 0..4 {
                    let kk = u * seg + i;
                    let line = _mm512_load_si512(b.add(kk * 64) as *const _);
                    let a = _mm512_set1_ps(*x.add(kk));
                    acc[2 * u] = _mm512_fmadd_ps(
                        a,
                        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(line)),
                        acc[2 * u],
                    );
                    acc[2 * u + 1] = _mm512_fmadd_ps(
                        a,
                        _mm512_castsi512_ps(_mm512_and_si512(line, mask)),
                        acc[2 * u + 1],
                    );
                }
            }
            for kk in 4 * seg..k {
                let line = _mm512_load_si512(b.add(kk * 64) as *const _);
                let a = _mm512_set1_ps(*x.add(kk));
                acc[0] = _mm512_fmadd_ps(
                    a,
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(line)),
                    acc[0],
                );
                acc[1] =
                    _mm512_fmadd_ps(a, _mm512_castsi512_ps(_mm512_and_si512(line, mask)), acc[1]);
            }
            lo[0] = _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[4], acc[6]));
            hi[0] = _mm512_add_ps(_mm512_add_ps(acc[1], acc[3]), _mm512_add_ps(acc[5], acc[7]));
        } else if bf16 {
            for kk in 0..k {
                let line = _mm512_load_si512(b.add(kk * 64) as *const _);
                let w0 = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(line));
                let w1 = _mm512_castsi512_ps(_mm512_and_si512(line, mask));
                for r in 0..R {
                    let a = _mm512_set1_ps(*x.add(r * k + kk));
                    lo[r] = _mm512_fmadd_ps(a, w0, lo[r]);
                    hi[r] = _mm512_fmadd_ps(a, w1, hi[r]);
                }
            }
        } else {
            for kk in 0..k {
                let w0 = _mm512_load_ps(b.add(kk * 128) as *const f32);
                let w1 = _mm512_load_ps(b.add(kk * 128 + 64) as *const f32);
                for r in 0..R {
                    let a = _mm512_set1_ps(*x.add(r * k + kk));
                    lo[r] = _mm512_fmadd_ps(a, w0, lo[r]);
                    hi[r] = _mm512_fmadd_ps(a, w1, hi[r]);
                }
            }
        }
        for r in 0..R {
            _mm512_storeu_ps(tile[r].as_mut_ptr(), lo[r]);
            _mm512_storeu_ps(tile[r].as_mut_ptr().add(16), hi[r]);
        }
    }

    /// AVX2 + FMA tile of `R` rows × 32 features (four 8-lane vectors).
    ///
    /// # Safety
    /// AVX2 and FMA must be available; pointers as for `tile_avx512`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile_avx2<const R: usize>(
        x: *const f32,
        k: usize,
        b: *const u8,
        bf16: bool,
        tile: &mut [[f32; NR]; 12],
    ) {
        // acc[r][q]: features 8q..8q+8.
        let mut acc = [[_mm256_setzero_ps(); 4]; R];
        let mask = _mm256_set1_epi32(0xffff_0000u32 as i32);
        for kk in 0..k {
            let w: [__m256; 4] = if bf16 {
                // Words 0..8 hold features 0..8 (low) and 16..24 (high);
                // words 8..16 hold 8..16 and 24..32.
                let l0 = _mm256_load_si256(b.add(kk * 64) as *const __m256i);
                let l1 = _mm256_load_si256(b.add(kk * 64 + 32) as *const __m256i);
                [
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(l0)),
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(l1)),
                    _mm256_castsi256_ps(_mm256_and_si256(l0, mask)),
                    _mm256_castsi256_ps(_mm256_and_si256(l1, mask)),
                ]
            } else {
                let p = b.add(kk * 128) as *const f32;
                [
                    _mm256_load_ps(p),
                    _mm256_load_ps(p.add(8)),
                    _mm256_load_ps(p.add(16)),
                    _mm256_load_ps(p.add(24)),
                ]
            };
            for (r, row) in acc.iter_mut().enumerate() {
                let a = _mm256_set1_ps(*x.add(r * k + kk));
                for (sum, wq) in row.iter_mut().zip(&w) {
                    *sum = _mm256_fmadd_ps(a, *wq, *sum);
                }
            }
        }
        for (row, out) in acc.iter().zip(tile.iter_mut()) {
            for (q, sum) in row.iter().enumerate() {
                _mm256_storeu_ps(out.as_mut_ptr().add(8 * q), *sum);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::available_paths;
    use crate::linear::tests::{reference, Rng};

    #[test]
    fn matches_reference_on_every_path_and_layout() {
        let mut rng = Rng(7);
        for &(m, n, k) in &[
            (1, 1, 1),
            (1, 33, 17),
            (5, 64, 40),
            (13, 70, 3),
            (40, 100, 96),
            (27, 31, 129),
        ] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
            let w: Vec<f32> = (0..n * k).map(|_| rng.f32()).collect();
            let b: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let wr: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
            for path in available_paths() {
                for bf in [false, true] {
                    let packed = if bf {
                        PackedWeight::pack(Src::Bf16(&wb), Some(Src::F32(&b)), n, k).unwrap()
                    } else {
                        PackedWeight::pack(Src::F32(&w), Some(Src::F32(&b)), n, k).unwrap()
                    };
                    let (want, _) = reference(&x, if bf { &wr } else { &w }, Some(&b), m, n, k);
                    let mut out = vec![0f32; m * n];
                    gemm_with_path(path, Dst::F32(&mut out), Src::F32(&x), &packed, m).unwrap();
                    for (i, (&o, &r)) in out.iter().zip(&want).enumerate() {
                        let tol = 1e-5 * (k as f64).sqrt() + 1e-6 * r.abs();
                        assert!(
                            (o as f64 - r).abs() <= tol,
                            "{path:?} bf16={bf} {m}x{n}x{k} at {i}: {o} vs {r}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn bf16_output_is_rounded_sum() {
        let (m, n, k) = (3, 40, 8);
        let x: Vec<bf16> = (0..m * k)
            .map(|i| bf16::from_f32(i as f32 * 0.25 - 2.0))
            .collect();
        let w: Vec<bf16> = (0..n * k)
            .map(|i| bf16::from_f32((i % 7) as f32 - 3.0))
            .collect();
        let packed = PackedWeight::pack(Src::Bf16(&w), None, n, k).unwrap();
        let mut out = vec![bf16::ZERO; m * n];
        gemm(Dst::Bf16(&mut out), Src::Bf16(&x), &packed, m).unwrap();
        for i in 0..m {
            for j in 0..n {
                let s: f32 = (0..k)
                    .map(|kk| x[i * k + kk].to_f32() * w[j * k + kk].to_f32())
                    .sum();
                assert_eq!(out[i * n + j], bf16::from_f32(s), "row {i} feature {j}");
            }
        }
    }

    #[test]
    fn large_calls_split_over_threads_match_serial() {
        let (m, n, k) = (70, 300, 257);
        let mut rng = Rng(3);
        let x: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
        let w: Vec<f32> = (0..n * k).map(|_| rng.f32()).collect();
        let packed = PackedWeight::pack(Src::F32(&w), None, n, k).unwrap();
        let mut all = vec![0f32; m * n];
        gemm(Dst::F32(&mut all), Src::F32(&x), &packed, m).unwrap();
        for i in [0, 13, 69] {
            let mut one = vec![0f32; n];
            gemm(
                Dst::F32(&mut one),
                Src::F32(&x[i * k..(i + 1) * k]),
                &packed,
                1,
            )
            .unwrap();
            assert_eq!(&all[i * n..(i + 1) * n], &one[..], "row {i}");
        }
    }

    #[test]
    fn rejects_bad_sizes() {
        let w = vec![0f32; 6];
        assert!(PackedWeight::pack(Src::F32(&w), None, 4, 2).is_err());
        let b = vec![0f32; 2];
        assert!(PackedWeight::pack(Src::F32(&w), Some(Src::F32(&b)), 3, 2).is_err());
        let packed = PackedWeight::pack(Src::F32(&w), None, 3, 2).unwrap();
        let x = vec![0f32; 5];
        let mut out = vec![0f32; 6];
        let err = gemm(Dst::F32(&mut out), Src::F32(&x), &packed, 2).unwrap_err();
        assert!(err.to_string().contains("x: expected 2 x 2"), "{err}");
        let x = vec![0f32; 4];
        let mut out = vec![0f32; 5];
        let err = gemm(Dst::F32(&mut out), Src::F32(&x), &packed, 2).unwrap_err();
        assert!(err.to_string().contains("out: expected 2 x 3"), "{err}");
        assert_eq!(packed.nbytes(), 2 * 2 * 64);
    }
}

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
//! FMA (AVX-512F: `MR` up to 12, 24 accumulators), each weight line loaded
//! once per tile and each element of `x` broadcast from memory. AVX2 has 16
//! registers: its tiles are up to 6 rows × 16 features (12 accumulators,
//! the panel's two halves one after the other; 2 rows or fewer take all 32
//! at once), over the panel in blocks of k of 16 KB that stay in L1 while
//! every tile of the task's rows passes over them. Each entry point compiles
//! one tile height, so the register allocator keeps every sum in a register.
//!
//! bf16 weights against bf16 rows on the `avx512bf16` path run the
//! dot-product tile instead (`dot_bf16`: `vdpbf16ps`, two multiply-adds per
//! lane, on the same panels). Which is faster depends on the CPU: on an AMD
//! Zen 4 the dot product does about 1.8x the FMA tile's multiply-adds per
//! second; on the Xeons measured, two f32 FMAs retired per cycle and one
//! `vdpbf16ps` per two, so widening bf16 for FMA was twice as fast there.
//! `default_path` chooses by CPU vendor.
//!
//! Batch-1 decode streams every panel once (memory-bound); large batches
//! reuse each panel from L1/L2 for every tile of rows (compute-bound). Work
//! is split into tasks of (block of rows, group of panels) run by the thread
//! team (`threads::team_run`: the caller and helpers that stay awake between
//! the calls of a step); small calls run on the calling thread.

mod dot_bf16;
mod pack;
mod tile;

pub use pack::PackedWeight;
pub(crate) use pack::{lines_filled, Line};

use crate::cpu::elem::{expect_matrix, SharedOut};
use crate::cpu::{simd, Dst, Element, Path, Src};
use crate::error::{CoreError, CoreResult};

/// Output features per panel.
pub const NR: usize = 32;

/// Multiply-adds below which a call runs on the calling thread.
const SERIAL_FLOPS: usize = 1 << 18;

/// Up to this many rows a call is memory-bound: one task per thread.
const STREAM_ROWS: usize = 4;

/// Bytes of `x` (as the kernel reads it: f32, or bf16 for the dot-product
/// tile) a block of rows may take on the AVX-512 paths (see
/// `row_block_bytes`).
pub(crate) const ROW_BLOCK_BYTES: usize = 512 * 1024;

/// The register tile rows of each path.
fn max_rows(path: Path) -> usize {
    match path {
        Path::Scalar => 4,
        Path::Avx2 => 6,
        Path::Avx512 | Path::Avx512Bf16 => 12,
    }
}

/// Bytes of a panel one pass of the tiles covers (a block of k), per path,
/// for calls of more than `STREAM_ROWS` rows: the block stays in L1 while
/// every tile of rows of the task passes over it. `None`: all of k at once.
/// AVX2: 16 KB (256 bf16 lines, 128 f32 pairs) beside a tile's 6 rows of x
/// (6 KB) in a 32 KB L1.
fn k_block_bytes(path: Path) -> Option<usize> {
    match path {
        Path::Avx2 => Some(16 * 1024),
        _ => None,
    }
}

/// Bytes of `x` (as the kernel reads it) a block of rows may take, per
/// path, so that it stays in L2 while every panel of a task passes over
/// it: half of the 512 KB L2 of the AVX2-only CPUs aimed at (AMD Zen 3),
/// leaving room for the panel; 512 KB elsewhere.
fn row_block_bytes(path: Path) -> usize {
    match path {
        Path::Avx2 => ROW_BLOCK_BYTES / 2,
        _ => ROW_BLOCK_BYTES,
    }
}

/// The path used when a call names none: the fastest this CPU has. On
/// AVX512-BF16 CPUs other than Intel's that is `avx512bf16`, whose
/// dot-product tile (`dot_bf16`) runs bf16 weights against bf16 rows at
/// about 1.8x the FMA tile's multiply-adds on an AMD Zen 4 (and streams a
/// batch-1 call's weights faster); on the Intel Xeons measured, the FMA tile
/// was faster (module docs), so they keep `avx512`.
pub fn default_path() -> Path {
    let best = crate::cpu::fastest_path();
    let dot = Path::Avx512Bf16.is_available() && !crate::cpu::features::is_intel();
    if best == Path::Avx512 && dot {
        Path::Avx512Bf16
    } else {
        best
    }
}

/// The paths `gemm_with_path` accepts on this CPU, in the order of `Path::ALL`.
pub fn available_paths() -> Vec<Path> {
    crate::cpu::available_paths()
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
    let what = format!("linear kernel path '{}'", path.name());
    if !check_call(path.is_available(), &what, x.len(), out.len(), m, w.n, w.k)? {
        return Ok(());
    }
    // bf16 rows against bf16 weights on the avx512bf16 path: the dot-product
    // tile reads them as they are.
    if let (Path::Avx512Bf16, true, Src::Bf16(xb)) = (path, w.bf16, x) {
        // SAFETY: bf16 is a 16-bit value type; the slice is viewed as its bits.
        let bits = unsafe { std::slice::from_raw_parts(xb.as_ptr() as *const u16, xb.len()) };
        return match out {
            Dst::Bf16(o) => run(path, o, Rows::Bf16(bits), w, m),
            Dst::F32(o) => run(path, o, Rows::Bf16(bits), w, m),
        };
    }
    // The FMA kernels read x as f32 rows.
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
        Dst::Bf16(o) => run(path, o, Rows::F32(xf), w, m),
        Dst::F32(o) => run(path, o, Rows::F32(xf), w, m),
    }
}

/// The rows of `x` as a kernel reads them: f32 (the FMA tiles) or bf16 bits
/// (the dot-product tile).
#[derive(Clone, Copy)]
enum Rows<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl Rows<'_> {
    /// Elements of `x`.
    fn len(&self) -> usize {
        match self {
            Rows::F32(s) => s.len(),
            Rows::Bf16(s) => s.len(),
        }
    }

    /// Bytes of one element of `x`.
    fn elem_bytes(&self) -> usize {
        match self {
            Rows::F32(_) => 4,
            Rows::Bf16(_) => 2,
        }
    }

    /// The most rows a register tile takes on `path` for these rows.
    fn tile_rows(&self, path: Path) -> usize {
        match self {
            Rows::F32(_) => max_rows(path),
            Rows::Bf16(_) => dot_bf16::MAX_ROWS,
        }
    }
}

/// Checks a call: its path runs on this CPU (`available`; `what` names it)
/// and `x` holds `m x k`, `out` `m x n`. Returns whether there is work.
pub(crate) fn check_call(
    available: bool,
    what: &str,
    x_len: usize,
    out_len: usize,
    m: usize,
    n: usize,
    k: usize,
) -> CoreResult<bool> {
    if !available {
        return Err(CoreError::invalid(format!(
            "{what} is not supported by this CPU"
        )));
    }
    expect_matrix("x", x_len, m, k)?;
    expect_matrix("out", out_len, m, n)?;
    Ok(m > 0 && n > 0)
}

fn run<T: Element>(
    path: Path,
    out: &mut [T],
    x: Rows<'_>,
    w: &PackedWeight,
    m: usize,
) -> CoreResult<()> {
    let (n, k) = (w.n, w.k);
    let mr = x.tile_rows(path);
    // k in blocks (a multiple of 16 lines) where the path asks for them.
    let line_bytes = if w.bf16 { 64 } else { 128 };
    let kc = match k_block_bytes(path) {
        Some(bytes) if m > STREAM_ROWS => (bytes / line_bytes / 16 * 16).max(16).min(k),
        _ => k,
    };
    let shared = SharedOut(out.as_mut_ptr());
    let rows_in_l2 = row_block_bytes(path) / (x.elem_bytes() * k).max(1);
    let serial = m * n * k < SERIAL_FLOPS;
    for_each_task(m, w.panels(), rows_in_l2, mr, serial, &|r0, r1, p0, p1| {
        // SAFETY (StoreTile::new): rows r0..r1 x features of panel p belong to
        // this task only; out holds m * n elements (checked by the caller).
        if kc == k {
            let mut tile = [[0f32; NR]; 12];
            for p in p0..p1 {
                let mut i = r0;
                while i < r1 {
                    let rows = mr.min(r1 - i);
                    tile_dispatch(path, x, i * k, k, 0, k, w, p, rows, &mut tile[..rows]);
                    let store = unsafe {
                        StoreTile::new(shared.ptr(), &tile[..rows], w.bias.as_deref(), i, n, p)
                    };
                    simd::dispatch(path, store);
                    i += rows;
                }
            }
            return;
        }
        // Each panel in blocks of k: a block stays in L1 while every tile
        // of rows passes over it (the panel is still read in order); the
        // sums of the panel wait in `sums` between blocks.
        let rows = r1 - r0;
        let mut sums = vec![[0f32; NR]; rows];
        for p in p0..p1 {
            for k0 in (0..k).step_by(kc) {
                let len = kc.min(k - k0);
                let mut i = r0;
                while i < r1 {
                    let tr = mr.min(r1 - i);
                    let tile = &mut sums[i - r0..i - r0 + tr];
                    tile_dispatch(path, x, i * k + k0, k, k0, len, w, p, tr, tile);
                    i += tr;
                }
            }
            let store = unsafe { StoreTile::new(shared.ptr(), &sums, w.bias.as_deref(), r0, n, p) };
            simd::dispatch(path, store);
        }
    })
}

/// Splits `m` rows x `panels` panels into tasks of (block of rows, group of
/// panels) and runs `task(r0, r1, p0, p1)` for each on the thread team (on
/// the calling thread when `serial`, for small calls). A block holds at
/// most `rows_in_l2` rows (so that it stays in L2 while the task's panels
/// pass over it), rounded to whole tiles of `mr` rows.
pub(crate) fn for_each_task(
    m: usize,
    panels: usize,
    rows_in_l2: usize,
    mr: usize,
    serial: bool,
    task: &(dyn Fn(usize, usize, usize, usize) + Sync),
) -> CoreResult<()> {
    let threads = crate::cpu::threads::num_threads();
    let by_cache = (rows_in_l2 / mr * mr).max(mr);
    let row_blocks = m.div_ceil(by_cache);
    let rows_per_block = m.div_ceil(row_blocks).div_ceil(mr) * mr;
    let row_blocks = m.div_ceil(rows_per_block);
    // Panel groups, their sizes within one panel of each other: one per
    // thread for a few rows (memory-bound, equal work per panel, so fewer and
    // longer streams), else enough to balance the threads (4 per thread).
    let per_thread = if m <= STREAM_ROWS { 1 } else { 4 };
    let groups = (per_thread * threads).div_ceil(row_blocks).clamp(1, panels);
    let tasks = row_blocks * groups;
    let one = |t: usize| {
        let (rb, g) = (t / groups, t % groups);
        let r0 = rb * rows_per_block;
        let r1 = (r0 + rows_per_block).min(m);
        task(r0, r1, g * panels / groups, (g + 1) * panels / groups);
    };
    if tasks == 1 || threads == 1 || serial {
        (0..tasks).for_each(one);
        Ok(())
    } else {
        crate::cpu::threads::team_run(tasks, &one)
    }
}

/// A tile of sums (+ bias) for rows `i..` and the features of panel `p` of
/// `out` (`[m, n]`), run as a kernel of the float or integer paths so that
/// the rounding to bf16 vectorises with the path's features (as plain code
/// it was 3-4% of a quantized prefill).
pub(crate) struct StoreTile<'a, T> {
    out: *mut T,
    tile: &'a [[f32; NR]],
    bias: Option<&'a [f32]>,
    i: usize,
    n: usize,
    p: usize,
}

impl<'a, T: Element> StoreTile<'a, T> {
    /// The store of `tile` into rows `i..` x the features of panel `p`.
    ///
    /// # Safety
    /// `out` holds `[m, n]` with `i + tile.len() <= m`, and no other thread
    /// writes those elements until the store has run.
    pub(crate) unsafe fn new(
        out: *mut T,
        tile: &'a [[f32; NR]],
        bias: Option<&'a [f32]>,
        i: usize,
        n: usize,
        p: usize,
    ) -> Self {
        StoreTile {
            out,
            tile,
            bias,
            i,
            n,
            p,
        }
    }

    /// Writes the tile.
    #[inline(always)]
    fn write(self) {
        let StoreTile {
            out,
            tile,
            bias,
            i,
            n,
            p,
        } = self;
        let j0 = p * NR;
        let width = NR.min(n - j0);
        for (r, sums) in tile.iter().enumerate() {
            // SAFETY: the contract of `new`.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.add((i + r) * n + j0), width) };
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
}

impl<T: Element> simd::Kernel for StoreTile<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<S: simd::Simd>(self) {
        self.write()
    }
}

impl<T: Element> simd::IntKernel for StoreTile<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<S: simd::IntSimd>(self) {
        self.write()
    }
}

/// One register tile: `rows` rows of `x` (stride `k`, the first starting at
/// element `at`, the row's element `k0`) x lines `k0..k0 + kc` of panel `p`;
/// sums into `tile` (`rows` rows), added to what it holds unless `k0 == 0`.
#[allow(clippy::too_many_arguments)]
fn tile_dispatch(
    path: Path,
    x: Rows<'_>,
    at: usize,
    k: usize,
    k0: usize,
    kc: usize,
    w: &PackedWeight,
    p: usize,
    rows: usize,
    tile: &mut [[f32; NR]],
) {
    assert!(tile.len() == rows && rows <= x.tile_rows(path) && k0 + kc <= k);
    assert!(x.len() >= at + (rows - 1) * k + kc);
    let line = p * w.panel_bytes() / 64 + k0 * if w.bf16 { 1 } else { 2 };
    let b = w.lines[line..].as_ptr() as *const u8;
    let xf = match x {
        Rows::F32(s) => s[at..].as_ptr(),
        Rows::Bf16(s) => {
            assert!(w.bf16 && k0.is_multiple_of(2));
            assert!(path == Path::Avx512Bf16 && path.is_available());
            let t = dot_bf16::DotTile {
                x: s[at..].as_ptr(),
                stride: k,
                kc,
                b,
                add: k0 > 0,
                out: tile.as_mut_ptr(),
            };
            // SAFETY: the CPU has AVX512-BF16 (checked above); x holds `rows`
            // rows of kc (stride k), the panel kc lines from `b` and `tile`
            // `rows` rows (checked above).
            unsafe { dot_bf16::run(t, rows) };
            return;
        }
    };
    macro_rules! each_rows {
        ($($r:literal)*) => {
            match rows {
                $($r => simd::dispatch(path, tile::Tile::<$r> {
                    x: xf,
                    stride: k,
                    kc,
                    b,
                    bf16: w.bf16,
                    add: k0 > 0,
                    out: tile.as_mut_ptr(),
                }),)*
                _ => unreachable!("tile rows exceed the path's maximum"),
            }
        };
    }
    // The caller checked that the path is available; x holds `rows` rows of
    // kc (stride k), the panel kc (bf16) or 2kc (f32) lines from `b` and
    // `tile` `rows` rows (checked above).
    each_rows!(1 2 3 4 5 6 7 8 9 10 11 12);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::elem::tests::{reference, Rng};
    use half::bf16;

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
            // Tiles of 6 rows and k in blocks (AVX2: 256 bf16 lines, 128
            // f32): rows not a multiple of the tile, n not a multiple of 16
            // or 32, k over several blocks with a remainder, k of one line.
            (7, 48, 600),
            (11, 17, 300),
            (6, 40, 257),
            (19, 90, 520),
            (5, 16, 1),
            (8, 33, 129),
            (9, 70, 2600),
        ] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
            let w: Vec<f32> = (0..n * k).map(|_| rng.f32()).collect();
            let b: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let wr: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
            // bf16 rows of x too (the avx512bf16 path's dot-product tile).
            let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let xr: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
            for path in available_paths() {
                for (bf, bx) in [(false, false), (true, false), (true, true)] {
                    let packed = if bf {
                        PackedWeight::pack(Src::Bf16(&wb), Some(Src::F32(&b)), n, k).unwrap()
                    } else {
                        PackedWeight::pack(Src::F32(&w), Some(Src::F32(&b)), n, k).unwrap()
                    };
                    let (xs, xref) = if bx {
                        (Src::Bf16(&xb), &xr)
                    } else {
                        (Src::F32(&x), &x)
                    };
                    let (want, _) = reference(xref, if bf { &wr } else { &w }, Some(&b), m, n, k);
                    let mut out = vec![0f32; m * n];
                    gemm_with_path(path, Dst::F32(&mut out), xs, &packed, m).unwrap();
                    for (i, (&o, &r)) in out.iter().zip(&want).enumerate() {
                        let tol = 1e-5 * (k as f64).sqrt() + 1e-6 * r.abs();
                        assert!(
                            (o as f64 - r).abs() <= tol,
                            "{path:?} bf16={bf} x bf16={bx} {m}x{n}x{k} at {i}: {o} vs {r}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn f32_weights_of_bf16_values_pack_as_bf16() {
        let mut rng = Rng(5);
        let (m, n, k) = (5, 70, 300);
        let w: Vec<f32> = (0..n * k).map(|_| rng.f32()).collect();
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let wr: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
        let x: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
        assert!(!PackedWeight::pack(Src::F32(&w), None, n, k)
            .unwrap()
            .is_bf16());
        let from_f32 = PackedWeight::pack(Src::F32(&wr), None, n, k).unwrap();
        let from_bf16 = PackedWeight::pack(Src::Bf16(&wb), None, n, k).unwrap();
        assert!(from_f32.is_bf16() && from_f32.nbytes() == from_bf16.nbytes());
        for path in available_paths() {
            let (mut a, mut b) = (vec![0f32; m * n], vec![0f32; m * n]);
            gemm_with_path(path, Dst::F32(&mut a), Src::F32(&x), &from_f32, m).unwrap();
            gemm_with_path(path, Dst::F32(&mut b), Src::F32(&x), &from_bf16, m).unwrap();
            assert_eq!(a, b, "{path:?}");
        }
    }

    #[test]
    fn one_row_bf16_matches_reference_segmented_or_not() {
        use std::sync::atomic::Ordering;
        let mut rng = Rng(11);
        for &(n, k) in &[(33, 17), (70, 600), (40, 2601), (5, 3)] {
            let x: Vec<f32> = (0..k).map(|_| rng.f32()).collect();
            let w: Vec<f32> = (0..n * k).map(|_| rng.f32()).collect();
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let wr: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
            let packed = PackedWeight::pack(Src::Bf16(&wb), None, n, k).unwrap();
            let (want, _) = reference(&x, &wr, None, 1, n, k);
            for mode in [1u8, 2] {
                tile::SEGMENTS.store(mode, Ordering::Relaxed);
                for path in available_paths() {
                    let mut out = vec![0f32; n];
                    gemm_with_path(path, Dst::F32(&mut out), Src::F32(&x), &packed, 1).unwrap();
                    for (i, (&o, &r)) in out.iter().zip(&want).enumerate() {
                        let tol = 1e-5 * (k as f64).sqrt() + 1e-6 * r.abs();
                        assert!(
                            (o as f64 - r).abs() <= tol,
                            "{path:?} mode {mode} {n}x{k} [{i}]"
                        );
                    }
                }
            }
            tile::SEGMENTS.store(0, Ordering::Relaxed);
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
    fn rows_sum_alike_in_any_call_on_every_path() {
        // k over several blocks: a call of many rows (k in blocks, several
        // blocks of rows, tiles of the path's full height) against calls of one row (f32 weights) or
        // two (bf16: one row of bf16 may stream its panel in segments).
        let (m, n, k) = (70, 100, 1500);
        let mut rng = Rng(5);
        let x: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
        let w: Vec<f32> = (0..n * k).map(|_| rng.f32()).collect();
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        for bf in [false, true] {
            let packed = if bf {
                PackedWeight::pack(Src::Bf16(&wb), None, n, k).unwrap()
            } else {
                PackedWeight::pack(Src::F32(&w), None, n, k).unwrap()
            };
            let few = if bf { 2 } else { 1 };
            for path in available_paths() {
                let mut all = vec![0f32; m * n];
                gemm_with_path(path, Dst::F32(&mut all), Src::F32(&x), &packed, m).unwrap();
                for i in [0, 13, 68] {
                    let mut one = vec![0f32; few * n];
                    let xs = Src::F32(&x[i * k..(i + few) * k]);
                    gemm_with_path(path, Dst::F32(&mut one), xs, &packed, few).unwrap();
                    assert_eq!(
                        &all[i * n..(i + few) * n],
                        &one[..],
                        "{path:?} bf16={bf} row {i}"
                    );
                }
                if !bf {
                    continue;
                }
                // bf16 rows (the dot-product tile on avx512bf16): one row
                // alone sums as it does among many.
                let mut all = vec![0f32; m * n];
                gemm_with_path(path, Dst::F32(&mut all), Src::Bf16(&xb), &packed, m).unwrap();
                for i in [0, 13, 69] {
                    let mut one = vec![0f32; n];
                    let xs = Src::Bf16(&xb[i * k..(i + 1) * k]);
                    gemm_with_path(path, Dst::F32(&mut one), xs, &packed, 1).unwrap();
                    assert_eq!(
                        &all[i * n..(i + 1) * n],
                        &one[..],
                        "{path:?} bf16 x row {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn rejects_bad_sizes() {
        let w = vec![0.1f32; 6]; // not bf16 values: f32 panels
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

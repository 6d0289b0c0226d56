//! Decode-time linear layers: `y = x @ W^T (+ bias)` for a small number of
//! rows `M` (the sequences of one decode step) that stream the weights once.
//!
//! Batch-1 decode is bound by memory bandwidth: every token reads every weight
//! once. The kernels here therefore read each weight row exactly once per call
//! and compute the dot products of that row with all `M` rows of `x` while it
//! sits in registers (register tiles of `R` weight rows × `MT` rows of `x`; for
//! larger `M` the same small weight tile is re-read from L1 for every tile of
//! `x`). Work is split over blocks of output rows on the private rayon pool.
//!
//! `x` is converted once per call into the form the chosen path consumes
//! (bf16 for `vdpbf16ps`, f32 otherwise), padded with zeros to a multiple of
//! 32 elements so that the last chunk of a row can be loaded whole; the weight
//! tail is read with masked loads (AVX-512) or through a zero-padded copy
//! (AVX2), never past the end of the weight matrix.
//!
//! SIMD paths are chosen at run time (`is_x86_feature_detected!`), so the crate
//! keeps its baseline x86-64 target and never executes an instruction the CPU
//! lacks: AVX512-BF16 (`vdpbf16ps`), AVX-512F (bf16 → f32 by a 16-bit shift,
//! FMA), AVX2 + FMA, and portable scalar code. All accumulate in f32.

use half::bf16;
use rayon::prelude::*;
use std::sync::OnceLock;

use crate::error::{CoreError, CoreResult};

/// Environment variable that forces a path (`scalar`, `avx2`, `avx512`,
/// `avx512bf16`) for every call that does not name one.
pub const PATH_ENV: &str = "FASTLLM_LINEAR_PATH";

/// Rows of `x` are padded to a multiple of this many elements.
const X_ALIGN: usize = 32;

/// Bytes of weights one parallel task aims to stream.
const TASK_BYTES: usize = 96 * 1024;

/// One implementation of the kernel, from the most portable to the fastest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Path {
    /// Plain Rust, f32 accumulation; runs everywhere.
    Scalar,
    /// AVX2 + FMA: bf16 widened to f32 by a shift, 8 lanes.
    Avx2,
    /// AVX-512F/BW/VL: bf16 widened to f32 by a shift, 16 lanes.
    Avx512,
    /// AVX512-BF16: `vdpbf16ps` multiplies bf16 pairs and adds to f32 lanes.
    Avx512Bf16,
}

impl Path {
    /// Every path, in order of the instruction sets they need.
    pub const ALL: [Path; 4] = [Path::Scalar, Path::Avx2, Path::Avx512, Path::Avx512Bf16];

    /// The order in which the default is picked. AVX-512F comes before
    /// AVX512-BF16: on the Xeons measured (`benches/linear_vs_torch.py`)
    /// `vdpbf16ps` retires one per two cycles while two FMAs retire per
    /// cycle, so the FMA kernel (one shift or mask per 16 weights) is faster
    /// once compute matters (M >= 4) and equal when memory-bound (M = 1);
    /// it is also exact for f32 x, where `vdpbf16ps` needs a hi + lo split.
    pub const PREFERENCE: [Path; 4] = [Path::Avx512, Path::Avx512Bf16, Path::Avx2, Path::Scalar];

    /// The name used by `FASTLLM_LINEAR_PATH` and the Python binding.
    pub fn name(self) -> &'static str {
        match self {
            Path::Scalar => "scalar",
            Path::Avx2 => "avx2",
            Path::Avx512 => "avx512",
            Path::Avx512Bf16 => "avx512bf16",
        }
    }

    /// Parses a path name (case-insensitive).
    pub fn parse(name: &str) -> Option<Path> {
        let name = name.trim().to_ascii_lowercase();
        Path::ALL.into_iter().find(|p| p.name() == name)
    }

    /// Whether this CPU (and OS) can run the path.
    pub fn is_available(self) -> bool {
        match self {
            Path::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Path::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            Path::Avx512 => {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
            }
            #[cfg(target_arch = "x86_64")]
            Path::Avx512Bf16 => {
                Path::Avx512.is_available() && is_x86_feature_detected!("avx512bf16")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }
}

/// The paths this CPU can run, in the order of `Path::ALL`.
pub fn available_paths() -> Vec<Path> {
    Path::ALL.into_iter().filter(|p| p.is_available()).collect()
}

/// The fastest path this CPU can run (first available in `Path::PREFERENCE`).
pub fn best_path() -> Path {
    Path::PREFERENCE
        .into_iter()
        .find(|p| p.is_available())
        .unwrap_or(Path::Scalar)
}

/// Up to this many rows of bf16 x, the default prefers AVX512-BF16 over
/// AVX-512F: while memory-bound, `vdpbf16ps` (half the instructions, half
/// the bytes of x) streamed the weights 5-15% faster in
/// `benches/linear_vs_torch.py`; beyond, the FMA kernel's compute wins.
pub const DPBF16_MAX_ROWS: usize = 4;

/// The path used when a call names none, for `m` rows of x (`x_bf16`: x is
/// bf16): `FASTLLM_LINEAR_PATH` if set (read once per process), else
/// AVX512-BF16 for up to `DPBF16_MAX_ROWS` rows of bf16 x where available,
/// else the fastest available path (`best_path`).
pub fn default_path(m: usize, x_bf16: bool) -> CoreResult<Path> {
    static FORCED: OnceLock<Result<Option<Path>, String>> = OnceLock::new();
    let forced = FORCED
        .get_or_init(|| match std::env::var(PATH_ENV) {
            Ok(v) if !v.trim().is_empty() => check_path(&v).map(Some),
            _ => Ok(None),
        })
        .clone()
        .map_err(CoreError::InvalidArgument)?;
    if let Some(p) = forced {
        return Ok(p);
    }
    let best = best_path();
    if best == Path::Avx512 && x_bf16 && m <= DPBF16_MAX_ROWS && Path::Avx512Bf16.is_available() {
        return Ok(Path::Avx512Bf16);
    }
    Ok(best)
}

/// Parses a path name and checks this CPU can run it.
pub fn check_path(name: &str) -> Result<Path, String> {
    let names: Vec<&str> = Path::ALL.iter().map(|p| p.name()).collect();
    let path = Path::parse(name)
        .ok_or_else(|| format!("unknown linear kernel path '{name}', expected one of {names:?}"))?;
    if !path.is_available() {
        let avail: Vec<&str> = available_paths().iter().map(|p| p.name()).collect();
        return Err(format!(
            "linear kernel path '{name}' is not supported by this CPU (available: {avail:?})"
        ));
    }
    Ok(path)
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
    pub(crate) fn len(&self) -> usize {
        match self {
            Src::Bf16(s) => s.len(),
            Src::F32(s) => s.len(),
        }
    }

    #[inline]
    pub(crate) fn get(&self, i: usize) -> f32 {
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
    pub(crate) fn len(&self) -> usize {
        match self {
            Dst::Bf16(o) => o.len(),
            Dst::F32(o) => o.len(),
        }
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

/// `out[m, n] = sum_k x[m, k] * weight[n, k] (+ bias[n])` with the default path.
///
/// `x` is `[m, k]`, `weight` `[n, k]` (torch `Linear` layout), `bias` `[n]`,
/// `out` `[m, n]`; all row-major. Accumulation is in f32.
pub fn linear(
    out: Dst<'_>,
    x: Src<'_>,
    weight: Src<'_>,
    bias: Option<Src<'_>>,
    m: usize,
    n: usize,
    k: usize,
) -> CoreResult<()> {
    let path = default_path(m, matches!(x, Src::Bf16(_)))?;
    linear_with_path(path, out, x, weight, bias, m, n, k)
}

/// As [`linear`], on an explicit kernel path (an error if the CPU lacks it).
///
/// f32 weights have no `vdpbf16ps` form: `Avx512Bf16` runs them on `Avx512`.
/// With f32 `x`, `Avx512Bf16` splits each element into two bf16 terms
/// (`hi + lo`), which keeps about 16 significant bits of `x`.
#[allow(clippy::too_many_arguments)]
pub fn linear_with_path(
    path: Path,
    out: Dst<'_>,
    x: Src<'_>,
    weight: Src<'_>,
    bias: Option<Src<'_>>,
    m: usize,
    n: usize,
    k: usize,
) -> CoreResult<()> {
    if !path.is_available() {
        return Err(CoreError::invalid(format!(
            "linear kernel path '{}' is not supported by this CPU",
            path.name()
        )));
    }
    expect_matrix("x", x.len(), m, k)?;
    expect_matrix("weight", weight.len(), n, k)?;
    expect_matrix("out", out.len(), m, n)?;
    if let Some(b) = &bias {
        if b.len() != n {
            return Err(CoreError::invalid(format!(
                "bias: expected {n} elements, got {}",
                b.len()
            )));
        }
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let kernel = Kernel::choose(path, &weight);
    let pack = Packed::new(kernel, x, m, k);
    match out {
        Dst::Bf16(o) => run(o, &pack, weight, bias, m, n, k),
        Dst::F32(o) => run(o, &pack, weight, bias, m, n, k),
    }
    Ok(())
}

/// The inner kernel a call runs: a path and the weights' element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Scalar,
    /// AVX2, bf16 weights (x packed even/odd per 16 elements).
    Avx2Bf16,
    /// AVX2, f32 weights.
    Avx2F32,
    /// AVX-512F, bf16 weights (x packed even/odd per 32 elements).
    Avx512Bf16,
    /// AVX-512F, f32 weights.
    Avx512F32,
    /// AVX512-BF16 `vdpbf16ps`, bf16 weights, x packed as bf16.
    Dpbf16,
}

impl Kernel {
    fn choose(path: Path, weight: &Src<'_>) -> Kernel {
        let bf16_weights = matches!(weight, Src::Bf16(_));
        match (path, bf16_weights) {
            (Path::Scalar, _) => Kernel::Scalar,
            (Path::Avx2, true) => Kernel::Avx2Bf16,
            (Path::Avx2, false) => Kernel::Avx2F32,
            (Path::Avx512, true) => Kernel::Avx512Bf16,
            (Path::Avx512Bf16, true) => Kernel::Dpbf16,
            // f32 weights have no dpbf16 form.
            (Path::Avx512 | Path::Avx512Bf16, false) => Kernel::Avx512F32,
        }
    }

    /// Width of the chunks in which x is stored even elements first, then
    /// odd ones (0: natural order). The bf16-weight kernels widen a vector of
    /// bf16 pairs to f32 with one shift (even elements) and one mask (odd
    /// elements), so x must come in that order.
    fn split(self) -> usize {
        match self {
            Kernel::Avx2Bf16 => 16,
            Kernel::Avx512Bf16 => 32,
            _ => 0,
        }
    }
}

/// `x` converted once per call into what a kernel consumes; rows padded
/// with zeros to `kp` (a multiple of `X_ALIGN`).
struct Packed {
    kernel: Kernel,
    /// bf16 bit patterns (`Kernel::Dpbf16` only).
    bits: Vec<u16>,
    /// f32 values (every other kernel).
    vals: Vec<f32>,
    kp: usize,
    /// Packed rows per row of x: 2 when an f32 x is split into bf16 hi + lo.
    terms: usize,
    /// Packed rows in all.
    rows: usize,
}

impl Packed {
    fn new(kernel: Kernel, x: Src<'_>, m: usize, k: usize) -> Packed {
        let kp = k.div_ceil(X_ALIGN).max(1) * X_ALIGN;
        let mut pack = Packed {
            kernel,
            bits: Vec::new(),
            vals: Vec::new(),
            kp,
            terms: 1,
            rows: m,
        };
        match (kernel, x) {
            (Kernel::Dpbf16, Src::Bf16(xs)) => {
                pack.bits = vec![0u16; m * kp];
                for (dst, src) in pack
                    .bits
                    .chunks_exact_mut(kp)
                    .zip(xs.chunks_exact(k.max(1)))
                {
                    for (d, s) in dst.iter_mut().zip(src) {
                        *d = s.to_bits();
                    }
                }
            }
            (Kernel::Dpbf16, Src::F32(xs)) => {
                // Two rows per row of x: hi = bf16(x), lo = bf16(x - hi).
                pack.terms = 2;
                pack.rows = 2 * m;
                pack.bits = vec![0u16; 2 * m * kp];
                let rows = pack
                    .bits
                    .chunks_exact_mut(2 * kp)
                    .zip(xs.chunks_exact(k.max(1)));
                for (dst, src) in rows {
                    let (hi, lo) = dst.split_at_mut(kp);
                    for ((h, l), &s) in hi.iter_mut().zip(lo.iter_mut()).zip(src) {
                        let top = bf16::from_f32(s);
                        *h = top.to_bits();
                        let rest = s - top.to_f32();
                        *l = if rest.is_finite() {
                            bf16::from_f32(rest).to_bits()
                        } else {
                            0
                        };
                    }
                }
            }
            (_, x) => {
                let split = kernel.split();
                pack.vals = vec![0f32; m * kp];
                let mut row = vec![0f32; k];
                for (i, dst) in pack.vals.chunks_exact_mut(kp).enumerate() {
                    match x {
                        Src::Bf16(xs) => {
                            for (d, s) in row.iter_mut().zip(&xs[i * k..(i + 1) * k]) {
                                *d = s.to_f32();
                            }
                        }
                        Src::F32(xs) => row.copy_from_slice(&xs[i * k..(i + 1) * k]),
                    }
                    if split == 0 {
                        dst[..k].copy_from_slice(&row);
                        continue;
                    }
                    // Within each chunk: even elements, then odd ones.
                    let half = split / 2;
                    for (dc, sc) in dst.chunks_exact_mut(split).zip(row.chunks(split)) {
                        for (e, &v) in sc.iter().enumerate() {
                            dc[(e % 2) * half + e / 2] = v;
                        }
                    }
                }
            }
        }
        pack
    }
}

/// Output element types.
pub(crate) trait OutElem: Copy + Send + Sync {
    fn from_f32(v: f32) -> Self;
}

impl OutElem for f32 {
    #[inline]
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl OutElem for bf16 {
    #[inline]
    fn from_f32(v: f32) -> Self {
        bf16_rne(v)
    }
}

/// `v` rounded to the nearest bf16 (ties to even), as `bf16::from_f32`, but
/// without branches so that loops over it vectorise; a NaN stays a (quiet) NaN.
#[inline(always)]
pub(crate) fn bf16_rne(v: f32) -> bf16 {
    let bits = v.to_bits();
    let rounded = (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
    let nan = (bits & 0x7fff_ffff) > 0x7f80_0000;
    let quiet = ((bits >> 16) as u16) | 0x40;
    bf16::from_bits(if nan { quiet } else { rounded })
}

/// The output pointer shared by tasks that write disjoint columns.
pub(crate) struct SharedOut<T>(pub(crate) *mut T);
// SAFETY: every task writes only the columns of its own block of output rows.
unsafe impl<T: Send> Send for SharedOut<T> {}
unsafe impl<T: Send> Sync for SharedOut<T> {}

impl<T> SharedOut<T> {
    pub(crate) fn ptr(&self) -> *mut T {
        self.0
    }
}

/// Rows of `weight` per parallel task: about `TASK_BYTES` of weights, at
/// least 4 tasks per thread where the matrix allows, a multiple of 4 rows.
/// Weight bytes below which a call runs single-threaded.
const SERIAL_BYTES: usize = 3 << 20;

fn rows_per_task(n: usize, k: usize, elem: usize, threads: usize) -> usize {
    let by_bytes = (TASK_BYTES / (k * elem).max(1)).max(1);
    let by_balance = n.div_ceil(4 * threads).max(1);
    let rows = by_bytes.min(by_balance).max(4);
    rows.div_ceil(4) * 4
}

fn run<T: OutElem>(
    out: &mut [T],
    pack: &Packed,
    weight: Src<'_>,
    bias: Option<Src<'_>>,
    m: usize,
    n: usize,
    k: usize,
) {
    let elem = match weight {
        Src::Bf16(_) => 2,
        Src::F32(_) => 4,
    };
    let threads = crate::threads::num_threads();
    let rows = rows_per_task(n, k, elem, threads);
    let tasks = n.div_ceil(rows);
    let shared = SharedOut(out.as_mut_ptr());
    let bias: Option<Vec<f32>> = bias.map(|b| (0..n).map(|j| b.get(j)).collect());
    let bias = bias.as_deref();
    let task = |tile: &mut Vec<f32>, t: usize| {
        let n0 = t * rows;
        let n1 = (n0 + rows).min(n);
        tile.clear();
        tile.resize(pack.rows * (n1 - n0), 0.0);
        compute_block(pack, weight, n0, n1, k, tile);
        // SAFETY: columns n0..n1 of every row of out belong to this task only,
        // and out has m * n elements (checked by the caller).
        unsafe { store_block(shared.ptr(), tile, pack.terms, bias, m, n, n0, n1) };
    };
    // Small matrices run on the calling thread: waking the pool costs more
    // than streaming a couple of megabytes.
    if tasks == 1 || threads == 1 || n * k * elem < SERIAL_BYTES {
        let mut tile = Vec::new();
        for t in 0..tasks {
            task(&mut tile, t);
        }
    } else {
        crate::threads::install(|| {
            (0..tasks)
                .into_par_iter()
                .for_each_init(Vec::new, |tile, t| task(tile, t));
        });
    }
}

/// Writes `tile` (`[rows of pack][n1 - n0]` f32 sums) plus bias into columns
/// `n0..n1` of `out`, adding the `terms` partial rows of each row of `x`.
///
/// # Safety
/// `out` must point to `m * n` elements and no other thread may touch
/// columns `n0..n1`.
#[allow(clippy::too_many_arguments)]
unsafe fn store_block<T: OutElem>(
    out: *mut T,
    tile: &[f32],
    terms: usize,
    bias: Option<&[f32]>,
    m: usize,
    n: usize,
    n0: usize,
    n1: usize,
) {
    let w = n1 - n0;
    let zeros = [0f32; 64];
    for i in 0..m {
        let dst = std::slice::from_raw_parts_mut(out.add(i * n + n0), w);
        let sums = &tile[i * terms * w..(i * terms + 1) * w];
        for (c, (dc, sc)) in dst.chunks_mut(64).zip(sums.chunks(64)).enumerate() {
            let j0 = n0 + c * 64;
            let bc = bias.map_or(&zeros[..dc.len()], |b| &b[j0..j0 + dc.len()]);
            if terms == 1 {
                for ((d, &s), &b) in dc.iter_mut().zip(sc).zip(bc) {
                    *d = T::from_f32(s + b);
                }
            } else {
                for (jj, (d, &b)) in dc.iter_mut().zip(bc).enumerate() {
                    let j = c * 64 + jj;
                    let v: f32 = (0..terms).map(|t| tile[(i * terms + t) * w + j]).sum();
                    *d = T::from_f32(v + b);
                }
            }
        }
    }
}

/// Dot products of weight rows `n0..n1` with every packed row of `x`, into
/// `tile[p * (n1 - n0) + (row - n0)]`.
fn compute_block(pack: &Packed, weight: Src<'_>, n0: usize, n1: usize, k: usize, tile: &mut [f32]) {
    let rows = n1 - n0;
    let (kp, xs, bits) = (pack.kp, &pack.vals[..], &pack.bits[..]);
    // The weights of this block as raw bytes for the SIMD kernels.
    #[cfg(target_arch = "x86_64")]
    let wb: *const u8 = match weight {
        Src::Bf16(w) => w[n0 * k..n1 * k].as_ptr().cast(),
        Src::F32(w) => w[n0 * k..n1 * k].as_ptr().cast(),
    };
    // SAFETY (every arm): `Kernel::choose` picked the kernel from a path
    // checked available and from the weights' dtype; `wb` points to the
    // `rows * k` weights of this block; the pack was built for this kernel
    // (rows of `kp` values, zero past `k`) and `tile` holds `pack.rows * rows`.
    match pack.kernel {
        #[cfg(target_arch = "x86_64")]
        Kernel::Dpbf16 => unsafe { x86::block_dpbf16(wb.cast(), rows, k, bits, kp, tile) },
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512Bf16 => unsafe { x86::block_avx512_bf16(wb, rows, k, xs, kp, tile) },
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512F32 => unsafe { x86::block_avx512_f32(wb, rows, k, xs, kp, tile) },
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2Bf16 => unsafe { x86::block_avx2_bf16(wb, rows, k, xs, kp, tile) },
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2F32 => unsafe { x86::block_avx2_f32(wb, rows, k, xs, kp, tile) },
        _ => {
            let _ = bits;
            block_scalar(weight, n0, n1, k, xs, kp, tile)
        }
    }
}

/// Portable kernel: eight partial sums per dot product, so the compiler can
/// keep them in SIMD registers of the baseline target.
fn block_scalar(
    weight: Src<'_>,
    n0: usize,
    n1: usize,
    k: usize,
    xs: &[f32],
    kp: usize,
    tile: &mut [f32],
) {
    let rows = n1 - n0;
    let mut wrow = vec![0f32; k];
    for r in 0..rows {
        match weight {
            Src::Bf16(w) => {
                for (d, s) in wrow.iter_mut().zip(&w[(n0 + r) * k..(n0 + r + 1) * k]) {
                    *d = s.to_f32();
                }
            }
            Src::F32(w) => wrow.copy_from_slice(&w[(n0 + r) * k..(n0 + r + 1) * k]),
        }
        for (p, xrow) in xs.chunks_exact(kp).enumerate() {
            let mut acc = [0f32; 8];
            let mut wc = wrow.chunks_exact(8);
            let mut xc = xrow[..k].chunks_exact(8);
            for (a, b) in (&mut wc).zip(&mut xc) {
                for l in 0..8 {
                    acc[l] += a[l] * b[l];
                }
            }
            let mut s = acc.iter().sum::<f32>();
            for (a, b) in wc.remainder().iter().zip(xc.remainder()) {
                s += a * b;
            }
            tile[p * rows + r] = s;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The SIMD kernels. Each `block_*` walks register tiles of `R` weight
    //! rows × `MT` packed rows of x (see `walk`), so a tile's weights come
    //! from DRAM once and from L1/L2 for the other tiles of x. Every tile
    //! kernel prefetches the weights of the next tile while it streams its
    //! own, which keeps more DRAM requests in flight than the hardware
    //! prefetcher alone (it stops at 4 KiB page boundaries).

    // Register tiles are indexed `acc[r][j]` on purpose: fixed-size loops
    // that the compiler unrolls into registers.
    #![allow(clippy::needless_range_loop)]

    use std::arch::x86_64::*;

    /// Weight rows per sub-block: the tiles of x are walked inside a
    /// sub-block, so its weights are re-read from L1/L2, not DRAM.
    const SUB: usize = 8;

    /// Reinterprets 32 bf16 bit patterns as the `vdpbf16ps` operand type.
    #[inline(always)]
    fn as_bh(v: __m512i) -> __m512bh {
        // SAFETY: both are 64-byte plain vector types.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
    }

    /// Calls `f(r, rr, p, mt)` for every register tile of a block of `rows`
    /// weight rows and `prows` packed rows of x: `rr` weight rows from `r`
    /// (`group(mt)`, or 1 at the tail), `mt <= mt_max` packed rows from `p`.
    #[inline(always)]
    fn walk(
        rows: usize,
        prows: usize,
        mt_max: usize,
        group: impl Fn(usize) -> usize,
        mut f: impl FnMut(usize, usize, usize, usize),
    ) {
        let mut s = 0;
        while s < rows {
            let s1 = (s + SUB).min(rows);
            let mut p = 0;
            while p < prows {
                let mt = (prows - p).min(mt_max);
                let g = group(mt);
                let mut r = s;
                while r < s1 {
                    let rr = if s1 - r >= g { g } else { 1 };
                    f(r, rr, p, mt);
                    r += rr;
                }
                p += mt;
            }
            s = s1;
        }
    }

    /// Prefetches (into L2) piece `i` of `step` bytes from `next`, the
    /// weights of the following tile; `next` is null when this tile's
    /// weights were already streamed for an earlier tile of x.
    #[inline(always)]
    unsafe fn prefetch_next(next: *const u8, i: usize, step: usize) {
        if !next.is_null() {
            _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(i * step).cast());
        }
    }

    /// The weights after a tile of `rr` rows, to prefetch, or null when the
    /// tile is not the first of x (`p > 0`). Prefetching past the end of the
    /// weights is harmless: prefetches never fault.
    #[inline(always)]
    fn next_tile(wp: *const u8, rr: usize, row_bytes: usize, p: usize) -> *const u8 {
        if p == 0 {
            wp.wrapping_add(rr * row_bytes)
        } else {
            std::ptr::null()
        }
    }

    /// Expands the (rr, mt) tile shape into calls of a const-generic kernel.
    macro_rules! dispatch {
        ($kern:ident, $rr:expr, $mt:expr, $args:tt, [$(($r:literal, $m:literal)),*]) => {
            match ($rr, $mt) {
                $(($r, $m) => $kern::<$r, $m> $args,)*
                _ => unreachable_tile(),
            }
        };
    }

    /// `walk` only produces the shapes each `dispatch!` lists.
    #[cold]
    fn unreachable_tile() {
        debug_assert!(false, "tile shape not instantiated");
    }

    // ---- AVX512-BF16: vdpbf16ps on bf16 pairs ----

    /// # Safety
    /// Needs AVX-512F/BW/VL and AVX512-BF16. `w` points to `rows * k` bf16
    /// values; `xs` holds packed rows of `kp >= k` (a multiple of 32) values,
    /// zero past `k`; `tile` has `xs.len() / kp * rows` elements.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    pub unsafe fn block_dpbf16(
        w: *const u16,
        rows: usize,
        k: usize,
        xs: &[u16],
        kp: usize,
        tile: &mut [f32],
    ) {
        let prows = xs.len() / kp;
        walk(
            rows,
            prows,
            4,
            |_| 4,
            |r, rr, p, mt| {
                let wp = w.add(r * k);
                let next = next_tile(wp.cast(), rr, 2 * k, p);
                let xp = xs.as_ptr().add(p * kp);
                let tp = tile.as_mut_ptr().add(p * rows + r);
                dispatch!(
                    dpbf16_tile,
                    rr,
                    mt,
                    (wp, next, k, xp, kp, tp, rows),
                    [
                        (4, 4),
                        (4, 3),
                        (4, 2),
                        (4, 1),
                        (1, 4),
                        (1, 3),
                        (1, 2),
                        (1, 1)
                    ]
                )
            },
        );
    }

    /// `R` weight rows × `MT` packed x rows, 32 bf16 per step.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn dpbf16_tile<const R: usize, const MT: usize>(
        w: *const u16,
        next: *const u8,
        k: usize,
        x: *const u16,
        kp: usize,
        out: *mut f32,
        out_stride: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); MT]; R];
        let mut wv = [_mm512_setzero_si512(); R];
        let full = k / 32;
        for c in 0..=full {
            let off = c * 32;
            if c < full {
                for r in 0..R {
                    prefetch_next(next, c * R + r, 64);
                    wv[r] = _mm512_loadu_si512(w.add(r * k + off).cast());
                }
            } else if !k.is_multiple_of(32) {
                let mask: __mmask32 = (1u32 << (k % 32)) - 1;
                for r in 0..R {
                    wv[r] = _mm512_maskz_loadu_epi16(mask, w.add(r * k + off).cast());
                }
            } else {
                break;
            }
            for j in 0..MT {
                let xv = as_bh(_mm512_loadu_si512(x.add(j * kp + off).cast()));
                for r in 0..R {
                    acc[r][j] = _mm512_dpbf16_ps(acc[r][j], as_bh(wv[r]), xv);
                }
            }
        }
        for r in 0..R {
            for j in 0..MT {
                *out.add(j * out_stride + r) = _mm512_reduce_add_ps(acc[r][j]);
            }
        }
    }

    // ---- AVX-512F: bf16 widened to f32 by shift / mask, FMA ----

    /// # Safety
    /// Needs AVX-512F/BW/VL. `w` points to `rows * k` bf16 values; `xs` holds
    /// packed f32 rows of `kp >= k` values (a multiple of 32), zero past `k`,
    /// even elements before odd ones in every chunk of 32; `tile` has
    /// `xs.len() / kp * rows` elements.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn block_avx512_bf16(
        w: *const u8,
        rows: usize,
        k: usize,
        xs: &[f32],
        kp: usize,
        tile: &mut [f32],
    ) {
        let prows = xs.len() / kp;
        walk(
            rows,
            prows,
            4,
            |_| 4,
            |r, rr, p, mt| {
                let wp = w.add(r * k * 2);
                let next = next_tile(wp, rr, 2 * k, p);
                let xp = xs.as_ptr().add(p * kp);
                let tp = tile.as_mut_ptr().add(p * rows + r);
                dispatch!(
                    avx512_bf16_tile,
                    rr,
                    mt,
                    (wp.cast(), next, k, xp, kp, tp, rows),
                    [
                        (4, 4),
                        (4, 3),
                        (4, 2),
                        (4, 1),
                        (1, 4),
                        (1, 3),
                        (1, 2),
                        (1, 1)
                    ]
                )
            },
        );
    }

    /// `R` weight rows × `MT` packed x rows, 32 bf16 per step: a 32-bit lane
    /// holds elements 2i (low half) and 2i+1 (high half); `lane << 16` is
    /// element 2i as f32 and `lane & 0xffff0000` is element 2i+1.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn avx512_bf16_tile<const R: usize, const MT: usize>(
        w: *const u16,
        next: *const u8,
        k: usize,
        x: *const f32,
        kp: usize,
        out: *mut f32,
        out_stride: usize,
    ) {
        let high = _mm512_set1_epi32(0xffff_0000u32 as i32);
        let mut acc = [[_mm512_setzero_ps(); MT]; R];
        let mut even = [_mm512_setzero_ps(); R];
        let mut odd = [_mm512_setzero_ps(); R];
        let full = k / 32;
        for c in 0..=full {
            let off = c * 32;
            if c == full && k.is_multiple_of(32) {
                break;
            }
            for r in 0..R {
                let v = if c < full {
                    prefetch_next(next, c * R + r, 64);
                    _mm512_loadu_si512(w.add(r * k + off).cast())
                } else {
                    let mask: __mmask32 = (1u32 << (k % 32)) - 1;
                    _mm512_maskz_loadu_epi16(mask, w.add(r * k + off).cast())
                };
                even[r] = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
                odd[r] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
            }
            for j in 0..MT {
                let xe = _mm512_loadu_ps(x.add(j * kp + off));
                let xo = _mm512_loadu_ps(x.add(j * kp + off + 16));
                for r in 0..R {
                    acc[r][j] = _mm512_fmadd_ps(even[r], xe, acc[r][j]);
                    acc[r][j] = _mm512_fmadd_ps(odd[r], xo, acc[r][j]);
                }
            }
        }
        for r in 0..R {
            for j in 0..MT {
                *out.add(j * out_stride + r) = _mm512_reduce_add_ps(acc[r][j]);
            }
        }
    }

    /// # Safety
    /// Needs AVX-512F/BW/VL. `w` points to `rows * k` f32 values; `xs` holds
    /// packed f32 rows of `kp >= k` values in natural order, zero past `k`;
    /// `tile` has `xs.len() / kp * rows` elements.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn block_avx512_f32(
        w: *const u8,
        rows: usize,
        k: usize,
        xs: &[f32],
        kp: usize,
        tile: &mut [f32],
    ) {
        let prows = xs.len() / kp;
        walk(
            rows,
            prows,
            4,
            |_| 4,
            |r, rr, p, mt| {
                let wp = w.add(r * k * 4);
                let next = next_tile(wp, rr, 4 * k, p);
                let xp = xs.as_ptr().add(p * kp);
                let tp = tile.as_mut_ptr().add(p * rows + r);
                dispatch!(
                    avx512_f32_tile,
                    rr,
                    mt,
                    (wp.cast(), next, k, xp, kp, tp, rows),
                    [
                        (4, 4),
                        (4, 3),
                        (4, 2),
                        (4, 1),
                        (1, 4),
                        (1, 3),
                        (1, 2),
                        (1, 1)
                    ]
                )
            },
        );
    }

    /// `R` weight rows × `MT` packed x rows, 16 f32 weights per step.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn avx512_f32_tile<const R: usize, const MT: usize>(
        w: *const f32,
        next: *const u8,
        k: usize,
        x: *const f32,
        kp: usize,
        out: *mut f32,
        out_stride: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); MT]; R];
        let mut wv = [_mm512_setzero_ps(); R];
        let full = k / 16;
        for c in 0..=full {
            let off = c * 16;
            if c < full {
                for r in 0..R {
                    prefetch_next(next, c * R + r, 64);
                    wv[r] = _mm512_loadu_ps(w.add(r * k + off));
                }
            } else if !k.is_multiple_of(16) {
                let mask: __mmask16 = ((1u32 << (k % 16)) - 1) as u16;
                for r in 0..R {
                    wv[r] = _mm512_maskz_loadu_ps(mask, w.add(r * k + off));
                }
            } else {
                break;
            }
            for j in 0..MT {
                let xv = _mm512_loadu_ps(x.add(j * kp + off));
                for r in 0..R {
                    acc[r][j] = _mm512_fmadd_ps(wv[r], xv, acc[r][j]);
                }
            }
        }
        for r in 0..R {
            for j in 0..MT {
                *out.add(j * out_stride + r) = _mm512_reduce_add_ps(acc[r][j]);
            }
        }
    }

    // ---- AVX2 + FMA ----

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
        _mm_cvtss_f32(s)
    }

    /// Loads the `len` elements of `elem` bytes at `p` into a zeroed
    /// 32-byte buffer (AVX2 has no masked 16-bit load for the row tail).
    #[inline(always)]
    unsafe fn tail32(p: *const u8, len: usize, elem: usize) -> [u8; 32] {
        let mut buf = [0u8; 32];
        std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), len * elem);
        buf
    }

    /// # Safety
    /// Needs AVX2 and FMA. `w` points to `rows * k` bf16 values; `xs` holds
    /// packed f32 rows of `kp >= k` values (a multiple of 32), zero past `k`,
    /// even elements before odd ones in every chunk of 16; `tile` has
    /// `xs.len() / kp * rows` elements.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn block_avx2_bf16(
        w: *const u8,
        rows: usize,
        k: usize,
        xs: &[f32],
        kp: usize,
        tile: &mut [f32],
    ) {
        let prows = xs.len() / kp;
        // 16 ymm registers: 4 rows for one row of x, else 2 rows × up to 4.
        let group = |mt: usize| if mt == 1 { 4 } else { 2 };
        walk(rows, prows, 4, group, |r, rr, p, mt| {
            let wp = w.add(r * k * 2);
            let next = next_tile(wp, rr, 2 * k, p);
            let xp = xs.as_ptr().add(p * kp);
            let tp = tile.as_mut_ptr().add(p * rows + r);
            dispatch!(
                avx2_bf16_tile,
                rr,
                mt,
                (wp.cast(), next, k, xp, kp, tp, rows),
                [
                    (4, 1),
                    (2, 4),
                    (2, 3),
                    (2, 2),
                    (1, 4),
                    (1, 3),
                    (1, 2),
                    (1, 1)
                ]
            )
        });
    }

    /// `R` weight rows × `MT` packed x rows, 16 bf16 per step (shift / mask
    /// widening as in `avx512_bf16_tile`).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2_bf16_tile<const R: usize, const MT: usize>(
        w: *const u16,
        next: *const u8,
        k: usize,
        x: *const f32,
        kp: usize,
        out: *mut f32,
        out_stride: usize,
    ) {
        let high = _mm256_set1_epi32(0xffff_0000u32 as i32);
        let mut acc = [[_mm256_setzero_ps(); MT]; R];
        let mut even = [_mm256_setzero_ps(); R];
        let mut odd = [_mm256_setzero_ps(); R];
        let full = k / 16;
        for c in 0..=full {
            let off = c * 16;
            if c == full && k.is_multiple_of(16) {
                break;
            }
            for r in 0..R {
                let v = if c < full {
                    prefetch_next(next, c * R + r, 32);
                    _mm256_loadu_si256(w.add(r * k + off).cast())
                } else {
                    let buf = tail32(w.add(r * k + off).cast(), k % 16, 2);
                    _mm256_loadu_si256(buf.as_ptr().cast())
                };
                even[r] = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v));
                odd[r] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
            }
            for j in 0..MT {
                let xe = _mm256_loadu_ps(x.add(j * kp + off));
                let xo = _mm256_loadu_ps(x.add(j * kp + off + 8));
                for r in 0..R {
                    acc[r][j] = _mm256_fmadd_ps(even[r], xe, acc[r][j]);
                    acc[r][j] = _mm256_fmadd_ps(odd[r], xo, acc[r][j]);
                }
            }
        }
        for r in 0..R {
            for j in 0..MT {
                *out.add(j * out_stride + r) = hsum256(acc[r][j]);
            }
        }
    }

    /// # Safety
    /// Needs AVX2 and FMA. `w` points to `rows * k` f32 values; otherwise as
    /// [`block_avx512_f32`].
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn block_avx2_f32(
        w: *const u8,
        rows: usize,
        k: usize,
        xs: &[f32],
        kp: usize,
        tile: &mut [f32],
    ) {
        let prows = xs.len() / kp;
        walk(
            rows,
            prows,
            2,
            |_| 4,
            |r, rr, p, mt| {
                let wp = w.add(r * k * 4);
                let next = next_tile(wp, rr, 4 * k, p);
                let xp = xs.as_ptr().add(p * kp);
                let tp = tile.as_mut_ptr().add(p * rows + r);
                dispatch!(
                    avx2_f32_tile,
                    rr,
                    mt,
                    (wp.cast(), next, k, xp, kp, tp, rows),
                    [(4, 2), (4, 1), (1, 2), (1, 1)]
                )
            },
        );
    }

    /// `R` weight rows × `MT` packed x rows, 8 f32 weights per step.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2_f32_tile<const R: usize, const MT: usize>(
        w: *const f32,
        next: *const u8,
        k: usize,
        x: *const f32,
        kp: usize,
        out: *mut f32,
        out_stride: usize,
    ) {
        let mut acc = [[_mm256_setzero_ps(); MT]; R];
        let mut wv = [_mm256_setzero_ps(); R];
        let full = k / 8;
        for c in 0..=full {
            let off = c * 8;
            if c < full {
                for r in 0..R {
                    prefetch_next(next, c * R + r, 32);
                    wv[r] = _mm256_loadu_ps(w.add(r * k + off));
                }
            } else if !k.is_multiple_of(8) {
                for r in 0..R {
                    let buf = tail32(w.add(r * k + off).cast(), k % 8, 4);
                    wv[r] = _mm256_loadu_ps(buf.as_ptr().cast());
                }
            } else {
                break;
            }
            for j in 0..MT {
                let xv = _mm256_loadu_ps(x.add(j * kp + off));
                for r in 0..R {
                    acc[r][j] = _mm256_fmadd_ps(wv[r], xv, acc[r][j]);
                }
            }
        }
        for r in 0..R {
            for j in 0..MT {
                *out.add(j * out_stride + r) = hsum256(acc[r][j]);
            }
        }
    }
}

/// STREAM-triad bandwidth (`a = b + s * c`, f32 arrays of `bytes` each) on
/// the private pool, in GB/s (10^9 bytes, counting 3 arrays per pass); best
/// of `repeats` passes after one warm-up pass, as STREAM reports.
pub fn stream_triad_gbs(bytes: usize, repeats: usize) -> CoreResult<f64> {
    let len = bytes / 4;
    if len == 0 {
        return Err(CoreError::invalid("bytes: must be at least 4"));
    }
    let threads = crate::threads::num_threads();
    let chunk = len.div_ceil(threads * 8).max(4096);
    let mut a: Vec<f32> = Vec::new();
    let mut b: Vec<f32> = Vec::new();
    let mut c: Vec<f32> = Vec::new();
    for v in [&mut a, &mut b, &mut c] {
        v.try_reserve_exact(len).map_err(|_| {
            CoreError::Exhausted(format!("stream triad: cannot allocate {bytes} bytes"))
        })?;
    }
    let s = 3.0f32;
    let mut best = f64::INFINITY;
    crate::threads::install(|| {
        // First touch on the pool's threads, chunk by chunk.
        a.resize(len, 0.0);
        b.resize(len, 1.0);
        c.resize(len, 2.0);
        for pass in 0..repeats.max(1) + 1 {
            let t0 = std::time::Instant::now();
            a.par_chunks_mut(chunk)
                .zip(b.par_chunks(chunk))
                .zip(c.par_chunks(chunk))
                .for_each(|((a, b), c)| {
                    for ((a, b), c) in a.iter_mut().zip(b).zip(c) {
                        *a = b + s * c;
                    }
                });
            let dt = t0.elapsed().as_secs_f64();
            if pass > 0 {
                best = best.min(dt);
            }
        }
    });
    std::hint::black_box(&a);
    Ok(3.0 * (len * 4) as f64 / best / 1e9)
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
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        pub(crate) fn f32(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
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

    fn check(got: f32, want: f64, mag: f64, out_bf16: bool, what: &str) {
        // bf16 output: half an ulp is 2^-9 relative; f32 sums: a few eps per
        // term scale; the hi+lo split of f32 x keeps ~2^-16 relative.
        let round = if out_bf16 {
            want.abs() * 2f64.powi(-8)
        } else {
            0.0
        };
        let tol = round + mag * 2e-5 + 1e-30;
        assert!(
            (got as f64 - want).abs() <= tol,
            "{what}: got {got}, want {want} (tol {tol})"
        );
    }

    fn run_case(rng: &mut Rng, path: Path, m: usize, n: usize, k: usize) {
        let w32: Vec<f32> = (0..n * k).map(|_| rng.f32()).collect();
        let wb: Vec<bf16> = w32.iter().map(|&v| bf16::from_f32(v)).collect();
        let wr: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
        let xf: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
        let xb: Vec<bf16> = xf.iter().map(|&v| bf16::from_f32(v)).collect();
        let xr: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
        let bias: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
        let biasb: Vec<bf16> = bias.iter().map(|&v| bf16::from_f32(v)).collect();
        let biasr: Vec<f32> = biasb.iter().map(|v| v.to_f32()).collect();
        let tag = format!("{path:?} m={m} n={n} k={k}");

        // bf16 x, bf16 weights, bf16 bias, bf16 out.
        let mut ob = vec![bf16::ZERO; m * n];
        linear_with_path(
            path,
            Dst::Bf16(&mut ob),
            Src::Bf16(&xb),
            Src::Bf16(&wb),
            Some(Src::Bf16(&biasb)),
            m,
            n,
            k,
        )
        .unwrap();
        let (want, mag) = reference(&xr, &wr, Some(&biasr), m, n, k);
        for i in 0..m * n {
            check(
                ob[i].to_f32(),
                want[i],
                mag[i],
                true,
                &format!("{tag} bf16 [{i}]"),
            );
        }

        // f32 x, bf16 weights, f32 bias, f32 out.
        let mut of = vec![0f32; m * n];
        linear_with_path(
            path,
            Dst::F32(&mut of),
            Src::F32(&xf),
            Src::Bf16(&wb),
            Some(Src::F32(&bias)),
            m,
            n,
            k,
        )
        .unwrap();
        let (want, mag) = reference(&xf, &wr, Some(&bias), m, n, k);
        for i in 0..m * n {
            check(of[i], want[i], mag[i], false, &format!("{tag} f32x [{i}]"));
        }

        // all f32, no bias.
        let mut of = vec![0f32; m * n];
        linear_with_path(
            path,
            Dst::F32(&mut of),
            Src::F32(&xf),
            Src::F32(&w32),
            None,
            m,
            n,
            k,
        )
        .unwrap();
        let (want, mag) = reference(&xf, &w32, None, m, n, k);
        for i in 0..m * n {
            check(of[i], want[i], mag[i], false, &format!("{tag} f32w [{i}]"));
        }
    }

    #[test]
    fn every_path_matches_reference_on_random_shapes() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let paths = available_paths();
        assert!(paths.contains(&Path::Scalar));
        for case in 0..40 {
            let m = 1 + case % 40;
            let n = 1 + rng.below(70);
            let k = 1 + rng.below(300);
            for &p in &paths {
                run_case(&mut rng, p, m, n, k);
            }
        }
        // Edge shapes: exact SIMD multiples, tails of every length, big N.
        for &(m, n, k) in &[
            (1, 4, 32),
            (3, 8, 64),
            (5, 3, 31),
            (2, 5, 33),
            (1, 600, 96),
            (17, 9, 17),
        ] {
            for &p in &paths {
                run_case(&mut rng, p, m, n, k);
            }
        }
    }

    #[test]
    fn k_zero_gives_bias_and_empty_shapes_are_fine() {
        let bias = [1.5f32, -2.0];
        let mut out = [9f32; 6];
        linear(
            Dst::F32(&mut out),
            Src::F32(&[]),
            Src::F32(&[]),
            Some(Src::F32(&bias)),
            3,
            2,
            0,
        )
        .unwrap();
        assert_eq!(out, [1.5, -2.0, 1.5, -2.0, 1.5, -2.0]);
        linear(
            Dst::F32(&mut []),
            Src::F32(&[]),
            Src::F32(&[0.0; 4]),
            None,
            0,
            2,
            2,
        )
        .unwrap();
    }

    #[test]
    fn bad_sizes_name_the_argument() {
        let w = [bf16::ONE; 6];
        let x = [bf16::ONE; 3];
        let mut o = [bf16::ZERO; 2];
        let err = |r: CoreResult<()>| r.unwrap_err().to_string();
        let e = err(linear(
            Dst::Bf16(&mut o),
            Src::Bf16(&x[..2]),
            Src::Bf16(&w),
            None,
            1,
            2,
            3,
        ));
        assert!(e.starts_with("x:"), "{e}");
        let e = err(linear(
            Dst::Bf16(&mut o),
            Src::Bf16(&x),
            Src::Bf16(&w[..5]),
            None,
            1,
            2,
            3,
        ));
        assert!(e.starts_with("weight:"), "{e}");
        let e = err(linear(
            Dst::Bf16(&mut o[..1]),
            Src::Bf16(&x),
            Src::Bf16(&w),
            None,
            1,
            2,
            3,
        ));
        assert!(e.starts_with("out:"), "{e}");
        let b = [bf16::ONE; 3];
        let e = err(linear(
            Dst::Bf16(&mut o),
            Src::Bf16(&x),
            Src::Bf16(&w),
            Some(Src::Bf16(&b)),
            1,
            2,
            3,
        ));
        assert!(e.starts_with("bias:"), "{e}");
    }

    #[test]
    fn path_names_round_trip_and_unknown_is_rejected() {
        for p in Path::ALL {
            assert_eq!(Path::parse(p.name()), Some(p));
        }
        assert_eq!(Path::parse(" AVX2 "), Some(Path::Avx2));
        assert!(check_path("sse9").unwrap_err().contains("unknown"));
        assert_eq!(check_path("scalar"), Ok(Path::Scalar));
    }

    #[test]
    fn triad_measures_something_positive() {
        let gbs = stream_triad_gbs(1 << 20, 2).unwrap();
        assert!(gbs.is_finite() && gbs > 0.0);
        assert!(stream_triad_gbs(0, 1).is_err());
    }
}

//! Linear layers over 8-bit and 4-bit weights: `y = x @ W^T + bias` with
//! integer dot products, for any number of rows of `x`.
//!
//! ## Formats
//! The numbers of GGUF's block formats (see [`blocks`]): groups of 32 input
//! features with one f16 scale, `q8_0` (8.5 bits a weight), `q4_0` and
//! `iq4_nl` (4.5 bits; `iq4_nl` maps its 16 codes to non-linear levels),
//! `q4_1` (with a minimum) and `mxfp4` (E2M1 levels; its power-of-two scale
//! held as an f16 in the panels).
//!
//! ## Layout
//! As in the float GEMM, the weight is cut into panels of 32 output
//! features, one contiguous stream per panel: for every group, a block of
//! the group's weights of all 32 features (quads of four inputs per feature
//! in one 32-bit lane, so one broadcast of four activation bytes meets a
//! whole vector of features), then the 32 f16 scales. `q8_0`: 8 quads of
//! 128 bytes and 64 bytes of scales (1088 bytes a block); 4-bit: 4 octs of
//! 128 bytes (a lane's low nibbles are four inputs, its high nibbles the
//! next four) and the scales (576 bytes).
//!
//! ## Kernel
//! Activations are quantized once per call, per row in groups of 32 (int8
//! with one f32 scale and the group's sum, which undoes the weights'
//! offsets). The register tile (`kernel`) keeps `R` rows x 2 vectors of
//! features in i32 accumulators over a group, then scales them into f32:
//! `sum_g d_w[g] * d_x[g] * dot_g`. Batch-1 decode streams each panel once;
//! the work is split into tasks over the thread team as in `gemm`.

pub mod blocks;
pub mod gguf;
mod kernel;
mod pack;

pub use pack::{write_chunked, QuantWeight};

use crate::cpu::elem::SharedOut;
use crate::cpu::simd::dispatch_int;
use crate::cpu::{Dst, Element, IntPath, Src};
use crate::error::CoreResult;
use crate::gemm::StoreTile;
use kernel::{QuantRows, QuantTile, QuantizeRows, MAX_ROWS};

/// Input features per group (one scale each).
pub const GROUP: usize = 32;

/// Output features per panel.
pub const NR: usize = crate::gemm::NR;

/// Multiply-adds below which a call runs on the calling thread.
const SERIAL_MACS: usize = 1 << 18;

/// Rows of activations per task when quantizing them on the team.
const QUANTIZE_ROWS: usize = 16;

/// A quantized weight format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    /// int8, one scale per 32.
    Q8_0,
    /// 4-bit `q - 8`, one scale per 32.
    Q4_0,
    /// 4-bit codes of 16 non-linear levels, one scale per 32.
    Iq4Nl,
    /// 4-bit `d * q + m`: a scale and a minimum per 32 (GGUF's Q4_1, and the
    /// form GGUF's Q4_K super-blocks take in the kernels).
    Q4_1,
    /// 4-bit E2M1 codes with a power-of-two scale per 32 (OCP MXFP4, as GGUF
    /// stores gpt-oss's experts): a code table like `iq4_nl`'s.
    Mxfp4,
}

impl QuantFormat {
    /// Every format.
    pub const ALL: [QuantFormat; 5] = [
        QuantFormat::Q8_0,
        QuantFormat::Q4_0,
        QuantFormat::Iq4Nl,
        QuantFormat::Q4_1,
        QuantFormat::Mxfp4,
    ];

    /// The format's name (as GGUF spells it, lower case).
    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Q8_0 => "q8_0",
            QuantFormat::Q4_0 => "q4_0",
            QuantFormat::Iq4Nl => "iq4_nl",
            QuantFormat::Q4_1 => "q4_1",
            QuantFormat::Mxfp4 => "mxfp4",
        }
    }

    /// Parses a format name (case-insensitive).
    pub fn parse(name: &str) -> Result<QuantFormat, String> {
        let wanted = name.trim().to_ascii_lowercase();
        QuantFormat::ALL
            .into_iter()
            .find(|f| f.name() == wanted)
            .ok_or_else(|| {
                let names: Vec<&str> = QuantFormat::ALL.iter().map(|f| f.name()).collect();
                format!("unknown quantized format '{name}', expected one of {names:?}")
            })
    }

    /// Bytes of one GGUF block (32 weights, their scale and minimum).
    pub fn block_bytes(self) -> usize {
        match self {
            QuantFormat::Q8_0 => 2 + GROUP,
            QuantFormat::Q4_0 | QuantFormat::Iq4Nl => 2 + GROUP / 2,
            QuantFormat::Q4_1 => 4 + GROUP / 2,
            QuantFormat::Mxfp4 => 1 + GROUP / 2,
        }
    }

    /// Whether a nibble indexes a table of levels (`iq4_nl`, `mxfp4`).
    pub(crate) fn has_levels(self) -> bool {
        matches!(self, QuantFormat::Iq4Nl | QuantFormat::Mxfp4)
    }

    /// Bytes of one group of a panel (32 features).
    pub(crate) fn panel_block_bytes(self) -> usize {
        let mins = if self == QuantFormat::Q4_1 { 2 * NR } else { 0 };
        self.scale_offset() + 2 * NR + mins
    }

    /// Where the scales start in a panel block.
    pub(crate) fn scale_offset(self) -> usize {
        match self {
            QuantFormat::Q8_0 => NR * GROUP,
            QuantFormat::Q4_0 | QuantFormat::Iq4Nl | QuantFormat::Q4_1 | QuantFormat::Mxfp4 => {
                NR * GROUP / 2
            }
        }
    }

    /// Where the minimums (`q4_1`) start in a panel block: after the scales.
    pub(crate) fn min_offset(self) -> usize {
        self.scale_offset() + 2 * NR
    }
}

/// The path used when a call names none: the fastest this CPU runs, or the
/// one `FASTLLM_CPU_INT_PATH` names (read once per process; a bad value
/// falls back to the fastest here, and the Python side refuses it with
/// `int_path_from_env`'s error).
pub fn default_path() -> IntPath {
    static PATH: std::sync::OnceLock<IntPath> = std::sync::OnceLock::new();
    *PATH.get_or_init(|| crate::cpu::int_path_from_env().unwrap_or_else(|_| IntPath::best()))
}

/// `out[m, j] = sum_k x[m, k] * W[j, k] + bias[j]` on the default path.
pub fn gemm(out: Dst<'_>, x: Src<'_>, w: &QuantWeight, m: usize) -> CoreResult<()> {
    gemm_with_path(default_path(), out, x, w, m)
}

/// As [`gemm`] on an explicit path (an error if the CPU lacks it).
pub fn gemm_with_path(
    path: IntPath,
    out: Dst<'_>,
    x: Src<'_>,
    w: &QuantWeight,
    m: usize,
) -> CoreResult<()> {
    let what = format!("quantized kernel path '{}'", path.name());
    let (n, k) = (w.n, w.k);
    if !crate::gemm::check_call(path.is_available(), &what, x.len(), out.len(), m, n, k)? {
        return Ok(());
    }
    let rows = quantize_activations(path, x, m, k)?;
    let done = match out {
        Dst::Bf16(o) => run(path, o, &rows, w, m),
        Dst::F32(o) => run(path, o, &rows, w, m),
    };
    rows.keep();
    done
}

/// The activations as int8 groups, quantized on the team for large calls.
fn quantize_activations(path: IntPath, x: Src<'_>, m: usize, k: usize) -> CoreResult<QuantRows> {
    let groups = k.div_ceil(GROUP);
    let mut rows = QuantRows::new(m, groups);
    let kp = rows.kp;
    let (q, abs) = (
        SharedOut(rows.q.as_mut_ptr()),
        SharedOut(rows.abs.as_mut_ptr()),
    );
    let (d, sum) = (
        SharedOut(rows.d.as_mut_ptr()),
        SharedOut(rows.sum.as_mut_ptr()),
    );
    let tasks = m.div_ceil(QUANTIZE_ROWS);
    let task = |t: usize| {
        let (r0, r1) = (t * QUANTIZE_ROWS, ((t + 1) * QUANTIZE_ROWS).min(m));
        let n = r1 - r0;
        // SAFETY: task t alone writes rows r0..r1 of each buffer, which hold
        // m rows.
        let (q, abs, d, sum) = unsafe {
            (
                std::slice::from_raw_parts_mut(q.ptr().add(r0 * kp), n * kp),
                std::slice::from_raw_parts_mut(abs.ptr().add(r0 * kp), n * kp),
                std::slice::from_raw_parts_mut(d.ptr().add(r0 * groups), n * groups),
                std::slice::from_raw_parts_mut(sum.ptr().add(r0 * groups), n * groups),
            )
        };
        match x {
            Src::F32(s) => dispatch_int(
                path,
                QuantizeRows {
                    x: s,
                    k,
                    r0,
                    r1,
                    q,
                    abs,
                    d,
                    sum,
                },
            ),
            Src::Bf16(s) => dispatch_int(
                path,
                QuantizeRows {
                    x: s,
                    k,
                    r0,
                    r1,
                    q,
                    abs,
                    d,
                    sum,
                },
            ),
        }
    };
    if tasks == 1 {
        task(0);
    } else {
        crate::cpu::threads::team_run(tasks, &task)?;
    }
    Ok(rows)
}

fn run<T: Element>(
    path: IntPath,
    out: &mut [T],
    x: &QuantRows,
    w: &QuantWeight,
    m: usize,
) -> CoreResult<()> {
    let n = w.n;
    let shared = SharedOut(out.as_mut_ptr());
    let tables = pack::level_tables(w.format);
    let serial = m * n * w.k < SERIAL_MACS;
    let offsets = dispatch_int(
        path,
        kernel::GroupOffsets {
            format: w.format,
            x,
        },
    );
    // A block of rows keeps its int8 activations in L2.
    let rows_in_l2 = crate::gemm::ROW_BLOCK_BYTES / x.kp.max(1);
    crate::gemm::for_each_task(
        m,
        w.panels(),
        rows_in_l2,
        MAX_ROWS,
        serial,
        &|r0, r1, p0, p1| {
            let mut tile = [[0f32; NR]; MAX_ROWS];
            for p in p0..p1 {
                let mut i = r0;
                while i < r1 {
                    let rows = MAX_ROWS.min(r1 - i);
                    let op = QuantTile {
                        format: w.format,
                        panel: w.panel(p),
                        x,
                        i,
                        rows,
                        tables: &tables,
                        tile: &mut tile,
                        offsets: &offsets,
                    };
                    dispatch_int(path, op);
                    // SAFETY: rows i..i + rows x features of panel p belong to
                    // this task only; out holds m * n elements (checked by the
                    // caller).
                    let store = unsafe {
                        StoreTile::new(shared.ptr(), &tile[..rows], w.bias.as_deref(), i, n, p)
                    };
                    dispatch_int(path, store);
                    i += rows;
                }
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::elem::tests::Rng;
    use half::bf16;

    /// The product computed in f64 from the dequantized weights and the
    /// activations as the kernel quantizes them: what the kernel must match
    /// up to f32 rounding.
    fn reference(w: &QuantWeight, x: &[f32], m: usize) -> Vec<f64> {
        let (n, k) = (w.n, w.k);
        let rows = quantize_activations(IntPath::Scalar, Src::F32(x), m, k).unwrap();
        let mut row = vec![0f32; k];
        let mut out = vec![0f64; m * n];
        for j in 0..n {
            w.dequantize_row(j, &mut row).unwrap();
            for i in 0..m {
                let mut s = 0f64;
                for (c, &wv) in row.iter().enumerate() {
                    let g = c / GROUP;
                    let xv = rows.q[i * rows.kp + c] as f64 * rows.d[i * rows.groups + g] as f64;
                    s += xv * wv as f64;
                }
                out[i * n + j] = s + w.bias.as_ref().map_or(0.0, |b| b[j] as f64);
            }
        }
        out
    }

    /// `w`'s product with the `m` rows of `x` on every path, against the
    /// f64 product of the dequantized weights.
    fn matches_reference_on_every_path(w: &QuantWeight, x: &[f32], m: usize, what: &str) {
        let want = reference(w, x, m);
        for path in IntPath::available() {
            let mut out = vec![0f32; m * w.n];
            gemm_with_path(path, Dst::F32(&mut out), Src::F32(x), w, m).unwrap();
            for (idx, (&o, &r)) in out.iter().zip(&want).enumerate() {
                let tol = 1e-5 * (1.0 + r.abs()) * (w.k as f64).sqrt();
                assert!(
                    (o as f64 - r).abs() <= tol,
                    "{path:?} {what} at {idx}: {o} vs {r}"
                );
            }
        }
    }

    #[test]
    fn every_path_and_format_matches_the_dequantized_product() {
        let mut rng = Rng(21);
        for &(m, n, k) in &[
            (1, 1, 32),
            (1, 40, 64),
            (3, 33, 96),
            (9, 64, 40),
            (17, 70, 160),
            (1, 300, 257),
        ] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
            let wf: Vec<f32> = (0..n * k).map(|_| rng.f32()).collect();
            let b: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
            for format in QuantFormat::ALL {
                let w =
                    QuantWeight::quantize(format, Src::F32(&wf), Some(Src::F32(&b)), n, k).unwrap();
                matches_reference_on_every_path(&w, &x, m, &format!("{format:?} {m}x{n}x{k}"));
            }
        }
    }

    #[test]
    fn activations_quantize_per_group_on_every_path() {
        // Per group of 32: scale = max|x| / 127 over the values that are not
        // NaN (a NaN quantizes to 0), q = x / scale rounded to nearest even,
        // |q| <= 127; bf16 rows as their f32 values; rows past 16 are
        // quantized on the team.
        let mut rng = Rng(33);
        let special = [
            f32::NAN,
            f32::INFINITY,
            -f32::INFINITY,
            1e-40,
            -3e-39,
            0.0,
            -0.0,
        ];
        for &(m, k) in &[(1, 1), (2, 31), (3, 32), (1, 33), (20, 100), (17, 257)] {
            let mut x: Vec<f32> = (0..m * k).map(|_| rng.f32() * 8.0).collect();
            for (i, v) in x.iter_mut().enumerate() {
                if (i / k) % 3 == 1 {
                    *v *= 1e-39; // subnormal rows: 1 / scale overflows
                }
                if i % 13 == 0 {
                    *v = special[(i / 13) % special.len()];
                }
            }
            let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let wide: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
            for path in IntPath::available() {
                for (src, vals) in [(Src::F32(&x), &x), (Src::Bf16(&xb), &wide)] {
                    let rows = quantize_activations(path, src, m, k).unwrap();
                    for i in 0..m {
                        for g in 0..k.div_ceil(GROUP) {
                            let group = &vals[i * k + g * GROUP..i * k + ((g + 1) * GROUP).min(k)];
                            let amax = group.iter().fold(0f32, |a, v| a.max(v.abs()));
                            let scale = amax / 127.0;
                            let at = i * rows.groups + g;
                            assert_eq!(rows.d[at].to_bits(), scale.to_bits(), "{path:?} scale");
                            let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                            let mut total = 0;
                            for c in 0..GROUP {
                                let got = rows.q[i * rows.kp + g * GROUP + c];
                                let want = match group.get(c) {
                                    Some(&v) if !(v * inv).is_nan() => {
                                        (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8
                                    }
                                    _ => 0,
                                };
                                assert_eq!(
                                    got,
                                    want,
                                    "{path:?} {m}x{k} row {i} col {}",
                                    g * GROUP + c
                                );
                                if matches!(path, IntPath::Avx512 | IntPath::Avx2) {
                                    assert_eq!(
                                        rows.abs[i * rows.kp + g * GROUP + c],
                                        got.unsigned_abs()
                                    );
                                }
                                total += got as i32;
                            }
                            assert_eq!(rows.sum[at], total, "{path:?} sum");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn extreme_nibbles_and_activations_stay_exact() {
        // Every 4-bit weight at its largest index (15) against activations
        // at +-127: the largest pair sums `vpmaddubsw` meets on the paths
        // without VNNI (2 x 15 x 127, within i16), for tiles of 1 to 3 rows.
        let (n, k) = (40, 96);
        let wf: Vec<f32> = (0..n * k)
            .map(|i| if i % 32 == 0 { -1.0 } else { 0.875 })
            .collect();
        for m in 1..=3 {
            let x: Vec<f32> = (0..m * k)
                .map(|i| if (i / k) % 2 == 0 { 1.0 } else { -1.0 })
                .collect();
            for format in [QuantFormat::Q4_0, QuantFormat::Q4_1] {
                let w = QuantWeight::quantize(format, Src::F32(&wf), None, n, k).unwrap();
                let want = reference(&w, &x, m);
                for path in IntPath::available() {
                    let mut out = vec![0f32; m * n];
                    gemm_with_path(path, Dst::F32(&mut out), Src::F32(&x), &w, m).unwrap();
                    for (idx, (&o, &r)) in out.iter().zip(&want).enumerate() {
                        assert!(
                            (o as f64 - r).abs() <= 1e-5 * (1.0 + r.abs()),
                            "{path:?} {format:?} m={m} at {idx}: {o} vs {r}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn quantized_product_is_close_to_the_float_product() {
        // The end-to-end error of both quantizations against f64 floats.
        let (m, n, k) = (4, 64, 512);
        let mut rng = Rng(4);
        let x: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
        let wf: Vec<f32> = (0..n * k).map(|_| rng.f32()).collect();
        for (format, rel) in [
            (QuantFormat::Q8_0, 0.02),
            (QuantFormat::Q4_0, 0.15),
            (QuantFormat::Iq4Nl, 0.15),
            (QuantFormat::Q4_1, 0.15),
            (QuantFormat::Mxfp4, 0.2),
        ] {
            let w = QuantWeight::quantize(format, Src::F32(&wf), None, n, k).unwrap();
            let mut out = vec![0f32; m * n];
            gemm(Dst::F32(&mut out), Src::F32(&x), &w, m).unwrap();
            let (mut err, mut norm) = (0f64, 0f64);
            for i in 0..m {
                for j in 0..n {
                    let exact: f64 = (0..k)
                        .map(|c| x[i * k + c] as f64 * wf[j * k + c] as f64)
                        .sum();
                    err += (out[i * n + j] as f64 - exact).powi(2);
                    norm += exact.powi(2);
                }
            }
            let r = (err / norm).sqrt();
            assert!(r < rel, "{format:?}: relative error {r}");
        }
    }

    #[test]
    fn blocks_round_trip_through_the_panels() {
        let (n, k) = (45, 96);
        let mut rng = Rng(8);
        let wf: Vec<f32> = (0..n * k).map(|_| rng.f32()).collect();
        for format in QuantFormat::ALL {
            let mut blocks = vec![0u8; n * (k / GROUP) * format.block_bytes()];
            blocks::quantize_rows(format, &wf, n, k, &mut blocks);
            let a = QuantWeight::from_blocks(format, &blocks, None, n, k).unwrap();
            let b = QuantWeight::quantize(format, Src::F32(&wf), None, n, k).unwrap();
            assert_eq!(a.nbytes(), b.nbytes());
            // The same rows in three parts (one panel straddles two of them).
            let row = (k / GROUP) * format.block_bytes();
            let (p1, rest) = blocks.split_at(7 * row);
            let (p2, p3) = rest.split_at(30 * row);
            let parts = QuantWeight::from_block_parts(format, &[p1, p2, p3], None, n, k).unwrap();
            assert_eq!(parts.to_blocks(), a.to_blocks());
            assert!(
                QuantWeight::from_block_parts(format, &[&p1[1..], p2, p3], None, n, k).is_err()
            );
            let (mut ra, mut rb, mut want) = (vec![0f32; k], vec![0f32; k], vec![0f32; GROUP]);
            for j in 0..n {
                a.dequantize_row(j, &mut ra).unwrap();
                b.dequantize_row(j, &mut rb).unwrap();
                assert_eq!(ra, rb, "{format:?} row {j}");
                for g in 0..k / GROUP {
                    let blk = &blocks[(j * (k / GROUP) + g) * format.block_bytes()..];
                    blocks::dequantize_block(format, blk, &mut want);
                    assert_eq!(
                        &ra[g * GROUP..(g + 1) * GROUP],
                        &want[..],
                        "{format:?} {j} {g}"
                    );
                }
            }
        }
        let err = QuantWeight::from_blocks(QuantFormat::Q8_0, &[0; 10], None, 1, 32).unwrap_err();
        assert!(err.to_string().contains("expected 34 bytes"), "{err}");
        let err = QuantWeight::from_blocks(QuantFormat::Q4_0, &[0; 18], None, 1, 31).unwrap_err();
        assert!(err.to_string().contains("multiple of 32"), "{err}");
    }

    /// `mxfp4` blocks as a GGUF file holds them (any codes, exponent bytes
    /// across the range an f16 scale holds) go through the panels bit for
    /// bit and multiply as dequantized on every path, extreme codes against
    /// extreme activations included; a block whose scale no f16 holds is
    /// refused by index unless its codes are all zero.
    #[test]
    fn mxfp4_blocks_as_stored() {
        let f = QuantFormat::Mxfp4;
        let (m, n, k) = (5, 70, 128);
        let bb = f.block_bytes();
        let mut rng = Rng(17);
        let mut blocks: Vec<u8> = (0..n * k / GROUP * bb)
            .map(|_| (rng.f32().abs() * 256.0) as u8)
            .collect();
        for (i, b) in blocks.chunks_exact_mut(bb).enumerate() {
            b[0] = 104 + (i % 40) as u8;
            if i % 7 == 0 {
                b[1..].fill(0x77); // +12 everywhere (code 7)
            }
        }
        let w = QuantWeight::from_blocks(f, &blocks, None, n, k).unwrap();
        assert_eq!(w.to_blocks(), blocks);
        let mut x: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
        x[..k].iter_mut().for_each(|v| *v = -1.0); // codes at -127
        matches_reference_on_every_path(&w, &x, m, "mxfp4 as stored");
        // Exponent bytes no f16 holds.
        let mut bad = blocks.clone();
        bad[5 * bb] = 150;
        let err = QuantWeight::from_blocks(f, &bad, None, n, k).unwrap_err();
        assert!(
            err.to_string()
                .contains("block 5 has the exponent byte 150"),
            "{err}"
        );
        bad[5 * bb + 1..6 * bb].fill(0x80); // +0 and -0: zero weights
        let z = QuantWeight::from_blocks(f, &bad, None, n, k).unwrap();
        let mut row = vec![1f32; k];
        z.dequantize_row(1, &mut row).unwrap();
        assert!(row[GROUP..2 * GROUP].iter().all(|&v| v == 0.0));
        // Quantized here: every code is the level nearest to w / scale.
        let wf: Vec<f32> = (0..4 * GROUP).map(|_| rng.f32() * 0.1).collect();
        let mut q = vec![0u8; 4 * bb];
        blocks::quantize_rows(f, &wf, 1, 4 * GROUP, &mut q);
        for (g, b) in q.chunks_exact(bb).enumerate() {
            let d = blocks::mxfp4_scale(b[0]);
            let mut y = vec![0f32; GROUP];
            blocks::dequantize_block(f, b, &mut y);
            for (c, &v) in y.iter().enumerate() {
                let a = wf[g * GROUP + c];
                let best = blocks::MXFP4_LEVELS
                    .iter()
                    .map(|&l| (a - d * l as f32).abs())
                    .fold(f32::INFINITY, f32::min);
                assert!((a - v).abs() <= best * (1.0 + 1e-6), "{a}: {v}");
            }
        }
    }

    /// Panels adopted from bytes packed earlier give the same products bit
    /// for bit; a wrong size or alignment is an error.
    #[test]
    fn panels_adopted_from_their_bytes() {
        let (m, n, k) = (3, 45, 96);
        let mut rng = Rng(11);
        let x: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
        let wf: Vec<f32> = (0..n * k).map(|_| rng.f32()).collect();
        let b: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
        for format in QuantFormat::ALL {
            let w = QuantWeight::quantize(format, Src::F32(&wf), Some(Src::F32(&b)), n, k).unwrap();
            // 64-byte aligned copies of the bytes, as a file mapping gives.
            let bytes = w.panel_bytes();
            let mut lines = vec![crate::gemm::Line([0; 64]); bytes.len() / 64];
            for (l, c) in lines.iter_mut().zip(bytes.chunks_exact(64)) {
                l.0.copy_from_slice(c);
            }
            let owner = std::sync::Arc::new(lines);
            // SAFETY: a Line is 64 plain bytes; `owner` keeps them, unchanged.
            let view = unsafe {
                std::slice::from_raw_parts(owner.as_ptr() as *const u8, owner.len() * 64)
            };
            // SAFETY: as above.
            let adopted = unsafe {
                QuantWeight::from_panels(format, view, owner.clone(), Some(Src::F32(&b)), n, k)
            }
            .unwrap();
            assert_eq!(adopted.to_blocks(), w.to_blocks());
            let (mut a, mut c) = (vec![0f32; m * n], vec![0f32; m * n]);
            gemm(Dst::F32(&mut a), Src::F32(&x), &w, m).unwrap();
            gemm(Dst::F32(&mut c), Src::F32(&x), &adopted, m).unwrap();
            assert_eq!(a, c, "{format:?}");
            // SAFETY: as above (the calls fail before adopting anything).
            let short =
                unsafe { QuantWeight::from_panels(format, &view[..64], owner.clone(), None, n, k) };
            assert!(short.unwrap_err().to_string().contains("panels: expected"));
            let wide = std::sync::Arc::new(vec![crate::gemm::Line([0; 64]); owner.len() + 1]);
            // SAFETY: one line more than the panels' bytes; offset by one byte.
            let skewed = unsafe {
                std::slice::from_raw_parts((wide.as_ptr() as *const u8).add(1), view.len())
            };
            // SAFETY: as above.
            let skew =
                unsafe { QuantWeight::from_panels(format, skewed, wide.clone(), None, n, k) };
            assert!(skew.unwrap_err().to_string().contains("aligned"));
        }
    }

    #[test]
    fn reused_activation_buffers_give_what_fresh_ones_give() {
        // A thread reuses its last call's activation buffers: calls of
        // other shapes and paths (VNNI or not: `abs` written or not) in
        // turn on one thread give exactly what each gives on a new thread,
        // which has no spare buffers.
        let mut rng = Rng(9);
        let n = 50;
        let shapes = [(37, 300), (2, 40), (37, 300), (5, 100), (64, 257), (1, 33)];
        let calls: Vec<_> = shapes
            .iter()
            .flat_map(|&(m, k)| {
                let x: Vec<f32> = (0..m * k).map(|_| 3.0 * rng.f32()).collect();
                let wf: Vec<f32> = (0..n * k).map(|_| rng.f32()).collect();
                let w = QuantWeight::quantize(QuantFormat::Q4_0, Src::F32(&wf), None, n, k);
                let w = std::sync::Arc::new(w.unwrap());
                IntPath::available()
                    .into_iter()
                    .map(move |path| (path, m, x.clone(), w.clone()))
            })
            .collect();
        let run = move |path: IntPath, m: usize, x: &[f32], w: &QuantWeight| {
            let mut out = vec![0f32; m * n];
            gemm_with_path(path, Dst::F32(&mut out), Src::F32(x), w, m).unwrap();
            out
        };
        for (path, m, x, w) in &calls {
            let here = run(*path, *m, x, w);
            let (p, m, x, w) = (*path, *m, x.clone(), w.clone());
            let fresh = std::thread::spawn(move || run(p, m, &x, &w))
                .join()
                .unwrap();
            assert_eq!(here, fresh, "{path:?} m = {m}");
        }
    }

    #[test]
    fn bf16_inputs_and_outputs_and_thread_split() {
        let (m, n, k) = (70, 300, 256);
        let mut rng = Rng(2);
        let x: Vec<bf16> = (0..m * k).map(|_| bf16::from_f32(rng.f32())).collect();
        let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
        let wf: Vec<f32> = (0..n * k).map(|_| rng.f32()).collect();
        let w = QuantWeight::quantize(QuantFormat::Q4_0, Src::F32(&wf), None, n, k).unwrap();
        let mut all = vec![0f32; m * n];
        gemm(Dst::F32(&mut all), Src::Bf16(&x), &w, m).unwrap();
        let mut out16 = vec![bf16::ZERO; m * n];
        gemm(Dst::Bf16(&mut out16), Src::F32(&xf), &w, m).unwrap();
        for (a, b) in all.iter().zip(&out16) {
            assert_eq!(bf16::from_f32(*a), *b);
        }
        for i in [0, 33, 69] {
            let mut one = vec![0f32; n];
            gemm(Dst::F32(&mut one), Src::Bf16(&x[i * k..(i + 1) * k]), &w, 1).unwrap();
            assert_eq!(&all[i * n..(i + 1) * n], &one[..], "row {i}");
        }
    }

    #[test]
    fn rejects_bad_sizes_and_names() {
        let w = vec![0f32; 6];
        assert!(QuantWeight::quantize(QuantFormat::Q8_0, Src::F32(&w), None, 4, 2).is_err());
        let q = QuantWeight::quantize(QuantFormat::Q8_0, Src::F32(&w), None, 3, 2).unwrap();
        let mut out = vec![0f32; 6];
        let err = gemm(Dst::F32(&mut out), Src::F32(&[0.0; 5]), &q, 2).unwrap_err();
        assert!(err.to_string().contains("x: expected 2 x 2"), "{err}");
        assert!(QuantFormat::parse("q5_k").unwrap_err().contains("q8_0"));
        assert_eq!(QuantFormat::parse(" IQ4_NL"), Ok(QuantFormat::Iq4Nl));
        let mut row = vec![0f32; 2];
        assert!(q.dequantize_row(3, &mut row).is_err());
    }
}

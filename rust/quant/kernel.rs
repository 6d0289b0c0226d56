//! The quantized kernels' bodies, written once over [`IntSimd`]: the
//! activations' int8 quantization, and the register tile of `R` rows x one
//! panel (32 features), whose sums are exact i32 dot products per group of
//! 32 inputs, scaled into f32 once per group.
//!
//! Each weight vector of a quad (four inputs of every feature) is loaded
//! and prepared once per tile and meets every row's broadcast activations:
//! - with an exact dot product (VNNI, portable): int8 weights as
//!   `u8 = w + 128`, `iq4_nl` levels from a table offset by 128, and `q4_0`
//!   nibbles as they are; the offsets come back out through the group sums
//!   of the activations (`corr * sum(x)` starts the accumulator);
//! - with `vpmaddubsw` (i16 pairs): `q4_0`/`q4_1` nibbles as they are, their
//!   pair sums kept in i16 across the group and widened once (`vpmaddwd`);
//!   `mxfp4`'s levels + 12 from a table likewise, widened every half group;
//!   and signed weights against `|x|`, with the sign of `x` moved onto the
//!   weight.

use super::{QuantFormat, GROUP, NR};
use crate::cpu::simd::{IntKernel, IntSimd};
use crate::cpu::{Element, IntPath};

/// Register tile rows of the integer paths: every path keeps `2 * R`
/// accumulator vectors (two vectors of features per pass).
pub(super) const MAX_ROWS: usize = 8;

/// What the paths without VNNI add to `mxfp4`'s levels (-12..12) to multiply
/// them unsigned in i16 pair sums (`vpmaddubsw`), taken back out through the
/// group offsets (`pack::level_tables`).
pub(super) const MXFP4_PAIR_OFFSET: i32 = 12;

/// The activations of a call, quantized per row in groups of 32. The
/// buffers may be longer than this call's rows (a thread's buffers only
/// grow, see [`QuantRows::new`]); what lies past them is an earlier call's.
pub(super) struct QuantRows {
    /// `m` rows of `kp` int8 (zero past `k`).
    pub(super) q: Vec<i8>,
    /// `|q|` as u8, for the sign trick of `vpmaddubsw` (left as it was on
    /// the paths with an exact dot product, which do not read it).
    pub(super) abs: Vec<u8>,
    /// One scale per row and group.
    pub(super) d: Vec<f32>,
    /// `sum(q)` per row and group.
    pub(super) sum: Vec<i32>,
    /// Rows of this call.
    pub(super) m: usize,
    /// Bytes per row of `q` and `abs`.
    pub(super) kp: usize,
    /// Groups per row.
    pub(super) groups: usize,
}

/// Bytes of activation buffers a thread keeps for its next call: large
/// calls (prefill, encoder batches) would otherwise fault in and zero fresh
/// pages for every layer's quantized activations (about 3% of an int8
/// BERT-base embedding run in `clear_page` and page faults).
const SPARE_ROWS_BYTES: usize = 64 << 20;

thread_local! {
    /// This thread's buffers of its last call, reused by its next one.
    static SPARE_ROWS: std::cell::RefCell<Option<QuantRows>> = const { std::cell::RefCell::new(None) };
}

impl QuantRows {
    /// Buffers for `m` rows of `groups` groups: this thread's spare ones
    /// ([`QuantRows::keep`]) when it has them, else new ones. They only
    /// grow, so calls of other sizes in turn (a layer's two projections,
    /// decode after prefill) zero nothing; their old contents stay, and
    /// every element a call reads `QuantizeRows` writes first.
    pub(super) fn new(m: usize, groups: usize) -> Self {
        let kp = groups * GROUP;
        let mut rows = SPARE_ROWS
            .with(|s| s.borrow_mut().take())
            .unwrap_or(QuantRows {
                q: Vec::new(),
                abs: Vec::new(),
                d: Vec::new(),
                sum: Vec::new(),
                m,
                kp,
                groups,
            });
        grow(&mut rows.q, m * kp, 0);
        grow(&mut rows.abs, m * kp, 0);
        grow(&mut rows.d, m * groups, 0.0);
        grow(&mut rows.sum, m * groups, 0);
        (rows.m, rows.kp, rows.groups) = (m, kp, groups);
        rows
    }

    /// Keeps the buffers as this thread's spare for its next call, unless
    /// they are larger than `SPARE_ROWS_BYTES`.
    pub(super) fn keep(self) {
        let bytes = self.q.capacity() + self.abs.capacity() + 8 * self.d.capacity();
        if bytes <= SPARE_ROWS_BYTES {
            SPARE_ROWS.with(|s| *s.borrow_mut() = Some(self));
        }
    }
}

/// `v` at least `len` long, new elements `fill`.
fn grow<E: Copy>(v: &mut Vec<E>, len: usize, fill: E) {
    if v.len() < len {
        v.resize(len, fill);
    }
}

/// Quantizes rows `r0..r1` of `x` (`k` wide) into `rows`: per group of 32,
/// `scale = max|x| / 127` and `q = round_ties_even(x / scale)`. Written as
/// plain loops over whole groups that the entry point's features vectorise:
/// bf16 widened by a shift, the maximum taken over the magnitudes' bits
/// (ordered as the floats are; a NaN counts as 0, as `f32::max` skips it).
pub(super) struct QuantizeRows<'a, T: Element> {
    pub(super) x: &'a [T],
    pub(super) k: usize,
    pub(super) r0: usize,
    pub(super) r1: usize,
    pub(super) q: &'a mut [i8],
    pub(super) abs: &'a mut [u8],
    pub(super) d: &'a mut [f32],
    pub(super) sum: &'a mut [i32],
}

impl<T: Element> IntKernel for QuantizeRows<'_, T> {
    type Output = ();

    #[inline(always)]
    fn run<S: IntSimd>(self) {
        let QuantizeRows {
            x,
            k,
            r0,
            r1,
            q,
            abs,
            d,
            sum,
        } = self;
        let groups = k.div_ceil(GROUP);
        let kp = groups * GROUP;
        // A row widened to f32 at once (a loop of run-time length, which
        // vectorises), zero past `k`.
        let mut wide = vec![0f32; kp];
        for r in 0..r1 - r0 {
            let row = &x[(r0 + r) * k..(r0 + r + 1) * k];
            for (w, e) in wide.iter_mut().zip(row) {
                *w = e.to_f32();
            }
            for g in 0..groups {
                let c0 = g * GROUP;
                let vals: &[f32; GROUP] = wide[c0..c0 + GROUP].try_into().expect("a group");
                // Lane-wise maxima of the two halves, then across the lanes.
                let mut lanes = [0u32; GROUP / 2];
                for half in vals.chunks_exact(GROUP / 2) {
                    for (m, v) in lanes.iter_mut().zip(half) {
                        let a = v.to_bits() & 0x7fff_ffff;
                        *m = (*m).max(if a > 0x7f80_0000 { 0 } else { a });
                    }
                }
                let amax_bits = lanes.iter().fold(0u32, |m, &a| m.max(a));
                let scale = f32::from_bits(amax_bits) / 127.0;
                let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                let qs: &mut [i8; GROUP] = (&mut q[r * kp + c0..r * kp + c0 + GROUP])
                    .try_into()
                    .expect("a whole group");
                let mut ints = [0i32; GROUP];
                for (i, &v) in ints.iter_mut().zip(vals) {
                    // A NaN becomes 0 and the rest stays in i8's range (a
                    // subnormal scale can make `inv` infinite), so the
                    // conversion needs no saturation and vectorises.
                    let y = (v * inv).round_ties_even();
                    let y = if y.is_nan() {
                        0.0
                    } else {
                        y.clamp(-127.0, 127.0)
                    };
                    // SAFETY: `y` is finite and within i32's range.
                    *i = unsafe { y.to_int_unchecked::<i32>() };
                }
                for (qv, &i) in qs.iter_mut().zip(&ints) {
                    *qv = i as i8;
                }
                if !S::VNNI {
                    let ab = &mut abs[r * kp + c0..r * kp + c0 + GROUP];
                    for (av, &qv) in ab.iter_mut().zip(qs.iter()) {
                        *av = qv.unsigned_abs();
                    }
                }
                d[r * groups + g] = scale;
                sum[r * groups + g] = ints.iter().sum();
            }
        }
    }
}

/// One tile call: `rows` rows of activations starting at row `i` x the
/// panel at `panel`, sums (of every group, scaled) into `tile[..rows]`.
pub(super) struct QuantTile<'a> {
    pub(super) format: QuantFormat,
    pub(super) panel: *const u8,
    pub(super) x: &'a QuantRows,
    pub(super) i: usize,
    pub(super) rows: usize,
    pub(super) tables: &'a ([u8; 16], [u8; 16]),
    pub(super) tile: &'a mut [[f32; NR]; MAX_ROWS],
    /// `corr * sum(q)` per row and group ([`GroupOffsets`]).
    pub(super) offsets: &'a [i32],
}

/// The offset of each row and group that the integer sums start from:
/// `corr * sum(q)`, where `corr` undoes the weights' unsigned form (`q4_0`
/// nibbles as stored, `-8`; int8 weights as `w + 128` where the dot product
/// is exact, `-128`), so the tiles broadcast it from memory. Run on the
/// GEMM's path, so that `corr` is that of the code the tiles run.
pub(super) struct GroupOffsets<'a> {
    pub(super) format: QuantFormat,
    pub(super) x: &'a QuantRows,
}

impl IntKernel for GroupOffsets<'_> {
    type Output = Vec<i32>;

    #[inline(always)]
    fn run<S: IntSimd>(self) -> Vec<i32> {
        let corr = match self.format {
            QuantFormat::Q4_0 => -8,
            QuantFormat::Q4_1 => 0, // its minimum comes in after the group
            _ if S::VNNI => -128,
            // Levels + 12 in pair sums without VNNI (see `pass`).
            QuantFormat::Mxfp4 => -MXFP4_PAIR_OFFSET,
            _ => 0,
        };
        let x = self.x;
        x.sum[..x.m * x.groups].iter().map(|&s| corr * s).collect()
    }
}

impl IntKernel for QuantTile<'_> {
    type Output = ();

    #[inline(always)]
    fn run<S: IntSimd>(self) {
        macro_rules! each_rows {
            ($($r:literal)*) => {
                match self.rows {
                    // SAFETY: the caller checked the path; the panel holds
                    // `groups` blocks and x holds rows i..i + rows.
                    $($r => unsafe { tile_rows::<S, $r>(self) },)*
                    _ => unreachable!("tile rows exceed the maximum"),
                }
            };
        }
        each_rows!(1 2 3 4 5 6 7 8);
    }
}

/// The features of a panel in passes of two vectors, or one pass of the
/// whole panel for a single row of 8-lane vectors (memory-bound: one
/// stream over the panel).
///
/// # Safety
/// As for [`QuantTile`], inside `S`'s entry point.
#[inline(always)]
unsafe fn tile_rows<S: IntSimd, const R: usize>(mut t: QuantTile<'_>) {
    // `q4_1`'s minimum term, and the i16 pair sums of 4-bit indices
    // without VNNI (see `pass`), are compiled only into their own passes.
    match (t.format, S::VNNI) {
        (QuantFormat::Q4_1, false) => passes::<S, R, true, true>(&mut t),
        (QuantFormat::Q4_1, true) => passes::<S, R, true, false>(&mut t),
        (QuantFormat::Q4_0 | QuantFormat::Mxfp4, false) => passes::<S, R, false, true>(&mut t),
        _ => passes::<S, R, false, false>(&mut t),
    }
}

/// The passes over a panel's features (see [`tile_rows`]).
///
/// # Safety
/// As for [`tile_rows`].
#[inline(always)]
unsafe fn passes<S: IntSimd, const R: usize, const MIN: bool, const PAIRS: bool>(
    t: &mut QuantTile<'_>,
) {
    let vectors = NR / S::LANES;
    if R == 1 && vectors == 4 {
        pass::<S, R, 4, MIN, PAIRS>(t, 0);
    } else {
        for v0 in (0..vectors).step_by(2) {
            pass::<S, R, 2, MIN, PAIRS>(t, v0);
        }
    }
}

/// Vectors `v0..v0 + V` of the panel's features for `R` rows; `MIN`: the
/// format has a minimum per group (`q4_1`); `PAIRS`: unsigned 4-bit weights
/// (`q4_0`, `q4_1` indices, `mxfp4` levels + 12) on a path without VNNI,
/// whose pair sums stay in i16 across the group (half a group for `mxfp4`).
///
/// # Safety
/// As for [`tile_rows`].
#[inline(always)]
unsafe fn pass<S: IntSimd, const R: usize, const V: usize, const MIN: bool, const PAIRS: bool>(
    t: &mut QuantTile<'_>,
    v0: usize,
) {
    let format = t.format;
    let x = t.x;
    let (groups, kp, lanes) = (x.groups, x.kp, S::LANES);
    let block = format.panel_block_bytes();
    let scales = format.scale_offset();
    // Exact dot products take unsigned weights (offset by 128); the
    // two-instruction form takes signed ones against |x|.
    let offset = S::VNNI;
    let table = S::table(if offset { &t.tables.1 } else { &t.tables.0 });
    let (panel, i) = (t.panel, t.i);
    assert!(
        t.offsets.len() >= (i + R) * groups,
        "offsets: one per row and group"
    );
    let tile = &mut *t.tile;
    // The f32 sums are locals across the groups, stored into the tile once
    // after the last: at one row they stay in registers; taller tiles leave
    // it to the compiler to spill them (see the offsets below).
    let mut sums = [[S::splat_f32(0.0); V]; R];
    // How far ahead one row prefetches (see the loop): 8 blocks, or 64 (70
    // KB) for q8_0 on the AVX2 path, whose matrices streamed 1.15-1.21x
    // faster so on an AMD Zen 2 (0.5B model, int8 decode 31-33 -> 38-41
    // tokens/s); 4-bit blocks showed no difference there.
    let ahead_bytes = block
        * if format == QuantFormat::Q8_0 && S::PATH == IntPath::Avx2 {
            64
        } else {
            8
        };
    let at = |r: usize, g: usize, off: usize| (i + r) * kp + g * GROUP + off;
    let xq = |r, g, off| (x.q.as_ptr() as *const u8).add(at(r, g, off));
    let xa = |r, g, off| x.abs.as_ptr().add(at(r, g, off));
    for g in 0..groups {
        let blk = panel.add(g * block);
        if R == 1 {
            // Batch-1 decode streams the panel: ask for the block 8 ahead.
            // Its every line for the 4-bit formats, whose blocks carry more
            // work per byte (measured on 4-bit matrices of a 0.5B model:
            // 3-17% faster on AVX-512 VNNI, 12-20% on AVX2); only its first
            // line for q8_0, whose larger blocks stream as fast without.
            // q8_0 on the AVX2 path asks 64 blocks ahead (`ahead_bytes`).
            let ahead = blk.wrapping_add(ahead_bytes);
            if format == QuantFormat::Q8_0 {
                S::prefetch(ahead);
            } else {
                let mut off = 0;
                while off < block {
                    S::prefetch(ahead.wrapping_add(off));
                    off += 64;
                }
            }
        }
        let mut acc = [[S::splat_i32(0); V]; R];
        // Taller tiles broadcast the offsets from memory (a load instead of
        // a multiply and a broadcast from a general register); one row
        // splats them. With the sums as locals this made q8_0 at 16-256
        // rows 1.1-1.37x faster on AVX-512 VNNI; either change alone
        // measured 0.99-1.04x.
        for (r, a) in acc.iter_mut().enumerate() {
            let at = (i + r) * groups + g;
            *a = if R == 1 {
                [S::splat_i32(t.offsets[at]); V]
            } else {
                [S::bcast4(t.offsets.as_ptr().add(at) as *const u8); V]
            };
        }
        // A pass of 4-bit pairs (or of `q4_1`) has its format's branch only.
        let branch = if PAIRS || MIN {
            QuantFormat::Q4_0
        } else {
            format
        };
        match branch {
            QuantFormat::Q8_0 => {
                for quad in 0..GROUP / 4 {
                    let mut w = [S::splat_i32(0); V];
                    for (v, wv) in w.iter_mut().enumerate() {
                        *wv = S::load(blk.add(quad * 128 + (v0 + v) * lanes * 4));
                        if offset {
                            *wv = S::flip(*wv);
                        }
                    }
                    for (r, a) in acc.iter_mut().enumerate() {
                        let xb = S::bcast4(xq(r, g, quad * 4));
                        if offset {
                            for (av, wv) in a.iter_mut().zip(&w) {
                                *av = S::dot(*av, *wv, xb);
                            }
                        } else {
                            let ab = S::bcast4(xa(r, g, quad * 4));
                            for (av, wv) in a.iter_mut().zip(&w) {
                                *av = S::dot(*av, ab, S::sign(*wv, xb));
                            }
                        }
                    }
                }
            }
            QuantFormat::Q4_0 | QuantFormat::Iq4Nl | QuantFormat::Q4_1 | QuantFormat::Mxfp4 => {
                let levels = format.has_levels();
                // Without VNNI, 4-bit indices (0-15) against int8 (|x| <=
                // 127) keep their pair sums in i16 for the whole group:
                // each pair is at most 2 * 15 * 127 = 3810, and a lane's
                // eight pairs of the group at most 30480 < 2^15, so one
                // `vpmaddwd` widens them per group instead of one per pair.
                // `mxfp4`'s levels + 12 (0-24) reach 2 * 24 * 127 = 6096 a
                // pair: widened after each half group's four (24384).
                let half_groups = PAIRS && format == QuantFormat::Mxfp4;
                let mut pairs = [[S::splat_i32(0); V]; R];
                for oct in 0..GROUP / 8 {
                    let (mut lo, mut hi) = ([S::splat_i32(0); V], [S::splat_i32(0); V]);
                    for v in 0..V {
                        let raw = S::load(blk.add(oct * 128 + (v0 + v) * lanes * 4));
                        lo[v] = S::low_nibbles(raw);
                        hi[v] = S::high_nibbles(raw);
                        if levels {
                            lo[v] = S::lookup(table, lo[v]);
                            hi[v] = S::lookup(table, hi[v]);
                        }
                    }
                    for (r, (a, p)) in acc.iter_mut().zip(pairs.iter_mut()).enumerate() {
                        let xl = S::bcast4(xq(r, g, oct * 8));
                        let xh = S::bcast4(xq(r, g, oct * 8 + 4));
                        if PAIRS {
                            for v in 0..V {
                                let both = S::add_pairs(S::pairs(lo[v], xl), S::pairs(hi[v], xh));
                                p[v] = S::add_pairs(p[v], both);
                                if half_groups && oct == GROUP / 16 - 1 {
                                    a[v] = S::widen_pairs(a[v], p[v]);
                                    p[v] = S::splat_i32(0);
                                }
                            }
                        } else if !levels || offset {
                            for v in 0..V {
                                a[v] = S::dot(S::dot(a[v], lo[v], xl), hi[v], xh);
                            }
                        } else {
                            let al = S::bcast4(xa(r, g, oct * 8));
                            let ah = S::bcast4(xa(r, g, oct * 8 + 4));
                            for v in 0..V {
                                let s = S::dot(a[v], al, S::sign(lo[v], xl));
                                a[v] = S::dot(s, ah, S::sign(hi[v], xh));
                            }
                        }
                    }
                }
                if PAIRS {
                    for (a, p) in acc.iter_mut().zip(&pairs) {
                        for v in 0..V {
                            a[v] = S::widen_pairs(a[v], p[v]);
                        }
                    }
                }
            }
        }
        let mut dw = [S::splat_f32(0.0); V];
        for (v, d) in dw.iter_mut().enumerate() {
            *d = S::load_f16(blk.add(scales + (v0 + v) * lanes * 2));
        }
        let mut mw = [S::splat_f32(0.0); V];
        if MIN {
            let mins = format.min_offset();
            for (v, m) in mw.iter_mut().enumerate() {
                *m = S::load_f16(blk.add(mins + (v0 + v) * lanes * 2));
            }
        }
        for (r, (a, s)) in acc.iter().zip(sums.iter_mut()).enumerate() {
            let rg = (i + r) * groups + g;
            let dx = S::splat_f32(x.d[rg]);
            // sum_c m * x_c = m * d_x * sum(q_x), once per row and group.
            let sx = S::splat_f32(if MIN { x.d[rg] * x.sum[rg] as f32 } else { 0.0 });
            for v in 0..V {
                s[v] = S::fmadd(S::to_f32(a[v]), S::mul(dw[v], dx), s[v]);
                if MIN {
                    s[v] = S::fmadd(mw[v], sx, s[v]);
                }
            }
        }
    }
    for (row, s) in tile.iter_mut().zip(&sums) {
        for (v, &sv) in s.iter().enumerate() {
            S::store_f32(row.as_mut_ptr().add((v0 + v) * lanes), sv);
        }
    }
}

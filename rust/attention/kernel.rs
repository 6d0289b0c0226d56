//! The attention body, written once over `Simd`: one item's query rows
//! over a range of keys, a chunk of up to 64 keys (across cache blocks) at a
//! time, with an online softmax.
//! The inner loops run over fixed 16-lane chunks so that LLVM vectorises them
//! for whichever ISA the entry point (`cpu::simd`) compiles them for.

use super::rows::row_scale;
use super::{Item, KvElem, PartialState, Problem};
use crate::cpu::simd::{dispatch_int, IntKernel, IntSimd};
use crate::cpu::simd::{Kernel, Simd};
use crate::cpu::{Element, IntPath, Path};

/// One call of the body: an item over keys `key_lo..key_hi`.
pub(super) struct Attend<'a, 'p, T, C> {
    pub(super) p: &'a Problem<'p, T, C>,
    pub(super) item: &'a Item,
    pub(super) key_lo: usize,
    pub(super) key_hi: usize,
    pub(super) state: &'a mut PartialState,
}

impl<T: Element, C: KvElem<T>> Kernel for Attend<'_, '_, T, C> {
    type Output = ();

    #[inline(always)]
    fn run<S: Simd>(self) {
        attend_body::<T, C, S>(self.p, self.item, self.key_lo, self.key_hi, self.state)
    }
}

/// Scores of 8 consecutive key rows at once, where the ISA has the explicit
/// AVX2 + FMA score kernel (`x86.rs`) and the head size suits it; `false`
/// means "use `dot4`".
#[inline(always)]
fn scores8<S: Simd>(q: &[f32], keys: &[f32], out: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let d = q.len();
        if S::PATH == Path::Scalar || !d.is_multiple_of(8) || keys.len() < 8 * d || out.len() < 8 {
            return false;
        }
        // SAFETY: S is AVX2 or AVX-512, so this runs inside an entry point
        // whose CPU has AVX2 and FMA; lengths checked above.
        unsafe { super::x86::scores8(q.as_ptr(), keys.as_ptr(), d, out.as_mut_ptr()) };
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (q, keys, out);
        false
    }
}

pub(super) const LANES: usize = 16;

/// Sum of 16 lanes as a balanced tree (vectorises; a left fold would not).
#[inline(always)]
fn hsum(a: &[f32; LANES]) -> f32 {
    let mut h8 = [0.0f32; 8];
    for i in 0..8 {
        h8[i] = a[i] + a[i + 8];
    }
    let mut h4 = [0.0f32; 4];
    for i in 0..4 {
        h4[i] = h8[i] + h8[i + 4];
    }
    (h4[0] + h4[2]) + (h4[1] + h4[3])
}

/// Dot products of `q` with four key rows at once (one load of `q` per chunk).
#[inline(always)]
fn dot4<S: Simd>(q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
    let n = q.len() / LANES * LANES;
    let mut acc = [[0.0f32; LANES]; 4];
    let mut i = 0;
    while i < n {
        let qc = &q[i..i + LANES];
        for (a, kr) in acc.iter_mut().zip(&k) {
            let kc = &kr[i..i + LANES];
            for l in 0..LANES {
                a[l] = S::mul_add(qc[l], kc[l], a[l]);
            }
        }
        i += LANES;
    }
    let mut res = [hsum(&acc[0]), hsum(&acc[1]), hsum(&acc[2]), hsum(&acc[3])];
    for j in n..q.len() {
        for (r, kr) in res.iter_mut().zip(&k) {
            *r = S::mul_add(q[j], kr[j], *r);
        }
    }
    res
}

/// Dot product of two rows.
#[inline(always)]
fn dot1<S: Simd>(q: &[f32], k: &[f32]) -> f32 {
    let n = q.len() / LANES * LANES;
    let mut acc = [0.0f32; LANES];
    let mut i = 0;
    while i < n {
        let (qc, kc) = (&q[i..i + LANES], &k[i..i + LANES]);
        for l in 0..LANES {
            acc[l] = S::mul_add(qc[l], kc[l], acc[l]);
        }
        i += LANES;
    }
    let mut res = hsum(&acc);
    for j in n..q.len() {
        res = S::mul_add(q[j], k[j], res);
    }
    res
}

/// `e^x` for `x <= 0` (scores minus their running max), ~1 ulp, written
/// without branches or library calls so a loop over it vectorises. Inputs
/// below -87 (including -inf) give 0.
#[inline(always)]
pub(super) fn exp_nonpos<S: Simd>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let xc = if x < -87.0 { -87.0 } else { x };
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    // The integer `n` also sits in the low bits of `t` (|n| < 2^22): read
    // it from there with integer arithmetic, which vectorises (a float to
    // int cast would not: Rust's `as` saturates).
    let ni = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = S::mul_add(n, -LN2_LO, S::mul_add(n, -LN2_HI, xc));
    let mut p = 1.987_569_1e-4f32;
    p = S::mul_add(p, r, 1.398_199_9e-3);
    p = S::mul_add(p, r, 8.333_452e-3);
    p = S::mul_add(p, r, 4.166_579_6e-2);
    p = S::mul_add(p, r, 1.666_666_5e-1);
    p = S::mul_add(p, r, 0.5);
    let r2 = r * r;
    let e = S::mul_add(p, r2, r) + 1.0;
    let scale = f32::from_bits((ni.wrapping_add(127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else {
        e * scale
    }
}

/// Replaces each score by `e^(s - max)` and returns their sum.
#[inline(always)]
fn exp_shift_sum<S: Simd>(s: &mut [f32], max: f32) -> f32 {
    let mut sums = [0.0f32; LANES];
    let mut chunks = s.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            c[l] = exp_nonpos::<S>(c[l] - max);
            sums[l] += c[l];
        }
    }
    let mut total = hsum(&sums);
    for x in chunks.into_remainder() {
        *x = exp_nonpos::<S>(*x - max);
        total += *x;
    }
    total
}

/// `cap * tanh(s / cap)` for each score, as `sign * (1 - e) / (1 + e)` with
/// `e = exp(-2 |s| / cap)` (branch-free, so the loop vectorises); exact to
/// a few ulp of the cap.
#[inline(always)]
fn soft_cap<S: Simd>(s: &mut [f32], cap: f32) {
    let inv = -2.0 / cap;
    for x in s.iter_mut() {
        let e = exp_nonpos::<S>(x.abs() * inv);
        let t = cap * (1.0 - e) / (1.0 + e);
        *x = if *x < 0.0 { -t } else { t };
    }
}

/// Largest element (scores are never NaN: inputs are finite); written over
/// 16 lanes with plain comparisons so it vectorises.
#[inline(always)]
fn max_of(s: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; LANES];
    let mut chunks = s.chunks_exact(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            m[l] = if c[l] > m[l] { c[l] } else { m[l] };
        }
    }
    // A balanced tree over the lanes: a left fold would be a 16-deep chain.
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            m[l] = if m[l + width] > m[l] {
                m[l + width]
            } else {
                m[l]
            };
        }
        width /= 2;
    }
    let mut best = m[0];
    for &x in chunks.remainder() {
        best = if x > best { x } else { best };
    }
    best
}

/// Hints the CPU to bring `data` into the cache.
#[inline(always)]
fn prefetch<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let bytes = std::mem::size_of_val(data);
        let ptr = data.as_ptr() as *const i8;
        let mut off = 0;
        while off < bytes {
            // SAFETY: a prefetch never faults, and `ptr + off` stays inside `data`.
            #[allow(unused_unsafe)]
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(ptr.add(off))
            };
            off += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// Keys per score tile: one AVX-512 vector, two AVX2 ones.
pub(super) const TILE: usize = 16;
/// Keys per softmax step: up to four tiles of consecutive positions (across
/// cache blocks), so that a row's maximum, sum and rescale (horizontal work)
/// are paid once per 64 keys whatever the block size.
const CHUNK: usize = 4 * TILE;
/// Score lanes per query vector: a chunk, and room for a last tile that
/// starts inside it to be written whole (its lanes past the chunk unused).
const LANES_PER_ROW: usize = CHUNK + TILE;
/// Items with at least this many query vectors (rows x query heads) score
/// a transposed key tile; fewer (decode) score the keys as stored, where
/// building the transposed tile would cost more than it saves.
const TRANSPOSE_MIN_VECTORS: usize = 12;
/// Query vectors (rows x heads) per micro-kernel call: their accumulators
/// and one tile of keys or values fit the registers of every path.
const QROWS: usize = 4;

/// `out[u][at + l] = q[u] . kt[.., l]` for `U` query vectors and the `TILE`
/// keys of a transposed tile (`kt`: `d * TILE`, key `l` in lane `l` of each
/// of its `d` rows). The queries are dimension-major (`qt[i * nq + u]`:
/// element `i` of vector `u`), so each step's `U` broadcasts sit side by
/// side at fixed offsets: a broadcast query element times one tile row per
/// step, no horizontal sums.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // register tiles: indices say which register
fn qk_tile<S: Simd, const U: usize>(
    (qt, nq): (&[f32], usize),
    kt: &[f32],
    d: usize,
    out: &mut [[f32; LANES_PER_ROW]],
    at: usize,
) {
    let nv = TILE / S::LANES;
    assert!(d > 0 && U <= nq && qt.len() >= (d - 1) * nq + U);
    let kt = &kt[..d * TILE];
    // SAFETY: S's instructions run inside its entry point (`Kernel::run`);
    // every load reads `kt[i * TILE + v * LANES..][..LANES]`, inside `kt`,
    // and `qt[i * nq + u]` with `i < d`, `u < U`: inside `qt` (asserted).
    unsafe {
        let mut acc = [[S::zero(); TILE]; U];
        let mut qp = qt.as_ptr();
        for i in 0..d {
            let row = kt.as_ptr().add(i * TILE);
            for v in 0..nv {
                let k = S::load(row.add(v * S::LANES));
                for u in 0..U {
                    acc[u][v] = S::fmadd(S::splat(*qp.add(u)), k, acc[u][v]);
                }
            }
            qp = qp.add(nq);
        }
        for u in 0..U {
            let row = &mut out[u][at..at + TILE];
            for v in 0..nv {
                S::store(row.as_mut_ptr().add(v * S::LANES), acc[u][v]);
            }
        }
    }
}

/// `acc[u] += sum_j p[u][j] * vals[j - lane0]` for `U` query vectors over
/// the chunk's lanes `j` in `keys` (`vals`: value rows, `d` apart, the first
/// one lane `lane0`'s; `acc`: `U * d`): one value vector times a broadcast
/// weight per step, the accumulators held in registers across the lanes.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // register tiles: indices say which register
fn pv_tile<S: Simd, const U: usize>(
    p: &[[f32; LANES_PER_ROW]],
    (vals, lane0): (&[f32], usize),
    keys: std::ops::Range<usize>,
    d: usize,
    acc: &mut [f32],
) {
    if keys.start >= keys.end {
        return;
    }
    assert!(keys.start >= lane0 && keys.end <= CHUNK);
    let vals = &vals[(keys.start - lane0) * d..(keys.end - lane0) * d];
    let acc = &mut acc[..U * d];
    let p = &p[..U];
    let mut c = 0;
    // SAFETY: as `qk_tile`; loads and stores stay inside `vals` and `acc`
    // (`c + LANES <= d`; row `j - keys.start` of `vals` for `j` in `keys`).
    unsafe {
        while c + S::LANES <= d {
            let mut a = [S::zero(); U];
            for u in 0..U {
                a[u] = S::load(acc.as_ptr().add(u * d + c));
            }
            for j in keys.clone() {
                let v = S::load(vals.as_ptr().add((j - keys.start) * d + c));
                for u in 0..U {
                    // `j < keys.end <= CHUNK`.
                    a[u] = S::fmadd(S::splat(*p[u].get_unchecked(j)), v, a[u]);
                }
            }
            for u in 0..U {
                S::store(acc.as_mut_ptr().add(u * d + c), a[u]);
            }
            c += S::LANES;
        }
    }
    for u in 0..U {
        for j in keys.clone() {
            let w = p[u][j];
            let row = &vals[(j - keys.start) * d..];
            for x in c..d {
                acc[u * d + x] = S::mul_add(w, row[x], acc[u * d + x]);
            }
        }
    }
}

/// Runs `$body` over query vectors `0..$nq` in groups: `2 * QROWS` at a
/// time where `$wide`, then `QROWS`, then the 3, 2 or 1 left; in `$body`,
/// `$r` is the group's first vector and `$u` its size, a constant (the
/// micro-kernels' `U`). A macro, not a closure: a closure would not be
/// compiled with the entry point's target features.
macro_rules! by_vector_groups {
    ($nq:expr, $wide:expr, |$r:ident, $u:ident| $body:expr) => {{
        let nq: usize = $nq;
        let mut $r = 0;
        if $wide {
            while $r + 2 * QROWS <= nq {
                {
                    const $u: usize = 2 * QROWS;
                    $body;
                }
                $r += 2 * QROWS;
            }
        }
        while $r + QROWS <= nq {
            {
                const $u: usize = QROWS;
                $body;
            }
            $r += QROWS;
        }
        match nq - $r {
            3 => {
                const $u: usize = 3;
                $body;
            }
            2 => {
                const $u: usize = 2;
                $body;
            }
            1 => {
                const $u: usize = 1;
                $body;
            }
            _ => {}
        }
    }};
}

/// Scores of every query vector against the `m` keys of a tile as stored
/// (`keys`: `m * d`), into lanes `at..at + m` of its chunk, 8 keys at a
/// time where the ISA has the transposing score kernel, else 4 then 1.
#[inline(always)]
fn scores_as_stored<S: Simd>(
    q: &[f32],
    keys: &[f32],
    m: usize,
    d: usize,
    scores: &mut [[f32; LANES_PER_ROW]],
    at: usize,
) {
    for (r, s) in scores.iter_mut().enumerate() {
        let qrow = &q[r * d..(r + 1) * d];
        let s = &mut s[at..at + m];
        let mut j = 0;
        while j + 8 <= m && scores8::<S>(qrow, &keys[j * d..], &mut s[j..j + 8]) {
            j += 8;
        }
        while j + 4 <= m {
            let k4 = [
                &keys[j * d..(j + 1) * d],
                &keys[(j + 1) * d..(j + 2) * d],
                &keys[(j + 2) * d..(j + 3) * d],
                &keys[(j + 3) * d..(j + 4) * d],
            ];
            s[j..j + 4].copy_from_slice(&dot4::<S>(qrow, k4));
            j += 4;
        }
        while j < m {
            s[j] = dot1::<S>(qrow, &keys[j * d..(j + 1) * d]);
            j += 1;
        }
    }
}

/// An item's query vectors quantized against an 8-bit cache: each as a
/// cache row stores it (`rows.rs`: `max|x| / 127`, round half to even),
/// from its values before the score scale.
struct QueryBytes {
    /// Four bytes per (dimension group, vector), dimension-major:
    /// `dwords[i * nq + u]` holds bytes `4i..4i + 4` of vector `u`.
    dwords: Vec<u32>,
    /// Each vector's bytes summed (for `vpdpbusd`'s unsigned operand).
    sums: Vec<i32>,
    /// Each vector's scale times the score scale.
    scales: Vec<f32>,
    nq: usize,
    /// One quantized row (values, then the scale), reused per vector.
    row: Vec<i8>,
}

impl QueryBytes {
    fn new(nq: usize, d: usize) -> Self {
        QueryBytes {
            dwords: vec![0; nq * d.div_ceil(4)],
            sums: vec![0; nq],
            scales: vec![0.0; nq],
            nq,
            row: vec![
                0;
                if nq > 0 {
                    d + super::rows::INT8_SCALE_BYTES
                } else {
                    0
                }
            ],
        }
    }

    /// Quantizes vector `u` (`x`, unscaled) and writes the f32 values its
    /// bytes stand for, times `scale`, to `out`.
    fn quantize<T: Element>(&mut self, u: usize, x: &[T], scale: f32, out: &mut [f32]) {
        let d = x.len();
        let row = &mut self.row[..d + super::rows::INT8_SCALE_BYTES];
        <i8 as KvElem<T>>::store_row(x, row);
        let s = row_scale(row, d);
        for (o, &b) in out.iter_mut().zip(&row[..d]) {
            *o = b as f32 * s * scale;
        }
        self.sums[u] = row[..d].iter().map(|&b| b as i32).sum();
        self.scales[u] = s * scale;
        for (i, four) in row[..d].chunks(4).enumerate() {
            let mut b = [0u8; 4];
            for (o, &v) in b.iter_mut().zip(four) {
                *o = v as u8;
            }
            self.dwords[i * self.nq + u] = u32::from_le_bytes(b);
        }
    }
}

/// One row of a transposed tile of 8-bit keys: lane `l` holds four bytes
/// of key `l` (64-byte aligned, as the integer paths load it).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct TileRow([u32; 16]);

/// The integer path that goes with a SIMD path: the fastest dot product of
/// the same register width (the scalar path's portable one otherwise).
fn int_path(path: Path) -> IntPath {
    let first = |paths: &[IntPath]| {
        paths
            .iter()
            .copied()
            .find(|p| p.is_available())
            .unwrap_or(IntPath::Scalar)
    };
    match path.simd() {
        Path::Avx512 => first(&[
            IntPath::Avx512Vnni,
            IntPath::Avx512,
            IntPath::AvxVnni,
            IntPath::Avx2,
        ]),
        Path::Avx2 => first(&[IntPath::AvxVnni, IntPath::Avx2]),
        _ => IntPath::Scalar,
    }
}

/// Scores of every query vector against `rows` (8-bit cache rows, `d + 4`
/// bytes each) into lanes `at..` of the chunk: the keys laid out as a
/// transposed tile of `LANES` keys (four bytes per lane), then per query
/// vector one integer dot product per four dimensions with its four bytes
/// broadcast, and the exact integer sums times the two scales. With VNNI
/// the keys' bytes are flipped to unsigned (`k + 128`) and `128 * sum(q)`
/// taken off again; without it, `|k|` against `q` with `k`'s signs keeps
/// every pair of products inside `vpmaddwd`'s i16 step (`|k|, |q| <= 127`).
/// The sums stay below 2^24 for `d <= 512`, so they are exact in f32.
struct ScoresI8<'a> {
    rows: &'a [i8],
    d: usize,
    /// The queries' dwords, count, byte sums and scales (`QueryBytes`).
    queries: (&'a [u32], usize, &'a [i32], &'a [f32]),
    tile: &'a mut [TileRow],
    scores: &'a mut [[f32; LANES_PER_ROW]],
    at: usize,
}

impl IntKernel for ScoresI8<'_> {
    type Output = ();

    #[inline(always)]
    fn run<S: IntSimd>(self) {
        let ScoresI8 {
            rows,
            d,
            queries: (q8t, nq, qsum, qscale),
            tile,
            scores,
            at,
        } = self;
        let stride = d + super::rows::INT8_SCALE_BYTES;
        let (d4, n) = (d / 4, rows.len() / stride);
        let lanes = S::LANES;
        assert!(lanes <= 16 && tile.len() >= d4 && q8t.len() >= d4 * nq && scores.len() >= nq);
        let flip = if S::VNNI { 0x8080_8080u32 } else { 0 };
        let mut t0 = 0;
        while t0 < n {
            let m = (n - t0).min(lanes);
            assert!(at + t0 + lanes <= LANES_PER_ROW);
            let mut ks = [0.0f32; 16];
            // A whole tile transposes `LANES` dimensions' quads at a time in
            // registers; what is left (a head size that is not a multiple
            // of 4 * LANES, a tile's missing keys) byte by byte.
            let whole = if m == lanes { d4 / lanes * lanes } else { 0 };
            for i in (0..whole).step_by(lanes) {
                // SAFETY: inside S's entry point; rows t0..t0 + LANES hold
                // dwords i..i + LANES (i + LANES <= d4) at stride `stride`,
                // and tile rows i..i + LANES exist (64-byte aligned).
                unsafe {
                    let src = rows.as_ptr().add(t0 * stride + 4 * i) as *const u8;
                    S::transpose_dwords(src, stride, tile[i..].as_mut_ptr() as *mut u8, flip);
                }
            }
            for l in 0..lanes {
                if l < m {
                    let row = &rows[(t0 + l) * stride..(t0 + l + 1) * stride];
                    ks[l] = row_scale(row, d);
                    for (i, four) in row[..d].chunks_exact(4).enumerate().skip(whole) {
                        let b = [four[0] as u8, four[1] as u8, four[2] as u8, four[3] as u8];
                        tile[i].0[l] = u32::from_le_bytes(b) ^ flip;
                    }
                } else {
                    for t in tile[..d4].iter_mut() {
                        t.0[l] = flip;
                    }
                }
            }
            // SAFETY: S's instructions run inside its entry point
            // (`IntKernel::run`); tile rows are 64-byte aligned and hold 16
            // lanes (>= LANES); `q8t[i * nq + u]` with `i < d4`, `u < nq`
            // is inside `q8t`; the store writes lanes `at + t0..` of a row
            // of `LANES_PER_ROW` (asserted).
            unsafe {
                let kscale = S::load_f32(ks.as_ptr());
                for u in 0..nq {
                    let mut acc = S::splat_i32(0);
                    for (i, row) in tile[..d4].iter().enumerate() {
                        let k = S::load(row.0.as_ptr() as *const u8);
                        let qb = S::bcast4(q8t.as_ptr().add(i * nq + u) as *const u8);
                        acc = if S::VNNI {
                            S::dot(acc, k, qb)
                        } else {
                            S::dot(acc, S::sign(k, k), S::sign(qb, k))
                        };
                    }
                    let mut f = S::to_f32(acc);
                    if S::VNNI {
                        let off = S::splat_f32(-128.0 * qsum[u] as f32);
                        f = S::fmadd(f, S::splat_f32(1.0), off);
                    }
                    let f = S::mul(S::mul(f, kscale), S::splat_f32(qscale[u]));
                    S::store_f32(scores[u][at + t0..].as_mut_ptr(), f);
                }
            }
            t0 += m;
        }
    }
}

/// The online-softmax update of query vector `r` for one chunk: masks the
/// keys its row does not see (`lo..hi` of the chunk's lanes), soft-caps,
/// turns the scores into weights `e^(s - max)` and rescales the row's
/// accumulator when its running maximum grows. A row that sees no key of
/// the chunk gets weights of zero.
#[inline(always)]
fn softmax_chunk<S: Simd>(
    s: &mut [f32],
    (lo, hi): (usize, usize),
    softcap: f32,
    max: &mut f32,
    sum: &mut f32,
    acc: &mut [f32],
) {
    if lo >= hi {
        s.fill(0.0);
        return;
    }
    if softcap > 0.0 {
        soft_cap::<S>(s, softcap);
    }
    if lo > 0 || hi < s.len() {
        for (l, x) in s.iter_mut().enumerate() {
            if l < lo || l >= hi {
                *x = f32::NEG_INFINITY;
            }
        }
    }
    let tile_max = max_of(s);
    if tile_max > *max {
        if *max > f32::NEG_INFINITY {
            let alpha = exp_nonpos::<S>(*max - tile_max);
            *sum *= alpha;
            for x in acc.iter_mut() {
                *x *= alpha;
            }
        }
        *max = tile_max;
    }
    *sum += exp_shift_sum::<S>(s, *max);
}

/// The kernel body: one item's query vectors (rows x the KV head's query
/// heads) over keys `key_lo..key_hi`, a chunk of up to `CHUNK` keys at a
/// time read block by block, in tiles of `TILE` keys: scores (keys as
/// stored, a tile transposed once, or bytes against an 8-bit cache's
/// quantized queries), the online softmax per vector and chunk, then the
/// weighted values of `QROWS` vectors at a time (a flash-attention loop:
/// the cost per key is flat in the context length, and no score matrix is
/// kept beyond one chunk).
#[inline(always)]
fn attend_body<T: Element, C: KvElem<T>, S: Simd>(
    p: &Problem<'_, T, C>,
    item: &Item,
    key_lo: usize,
    key_hi: usize,
    state: &mut PartialState,
) {
    // Taken and put back (not borrowed in a closure: the body must compile
    // with the entry point's target features).
    let mut scratch = SCRATCH.take();
    attend_with::<T, C, S>(p, item, key_lo, key_hi, state, &mut scratch);
    SCRATCH.set(scratch);
}

/// The body's buffers, kept per thread from call to call: allocated and
/// zeroed per call they cost more than a short item's work (with head size
/// 256, 128 KB of widened rows a call, which the allocator returned to the
/// system and took back as fresh pages each time). Every element the body
/// reads it has written in the same call (see [`attend_with`]).
#[derive(Default)]
struct BodyScratch {
    q: Vec<f32>,
    qt: Vec<f32>,
    kbuf: Vec<f32>,
    vbuf: Vec<f32>,
    krow: Vec<f32>,
    kt: Vec<f32>,
    scores: Vec<[f32; LANES_PER_ROW]>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<BodyScratch> = std::cell::RefCell::default();
}

/// `buf` as `n` elements: grown (with `fill`) when short, its contents
/// otherwise left as the last call wrote them.
fn reuse<E: Copy>(buf: &mut Vec<E>, n: usize, fill: E) -> &mut [E] {
    if buf.len() < n {
        buf.resize(n, fill);
    }
    &mut buf[..n]
}

/// [`attend_body`] with its buffers. Reads of reused buffers stay inside
/// what this call wrote: every query vector (and its transpose); the
/// widened key and value rows of the block runs that cover a chunk's seen
/// lanes (`first..seen_hi`), which are all that scoring and the weighted
/// sum read; each score lane in `first..seen_hi`, and the softmax masks
/// every lane outside a row's visible ones (inside those) before it reads
/// them; a transposed tile's every lane (its lanes past `m` zeroed).
#[inline(always)]
fn attend_with<T: Element, C: KvElem<T>, S: Simd>(
    p: &Problem<'_, T, C>,
    item: &Item,
    key_lo: usize,
    key_hi: usize,
    state: &mut PartialState,
    scratch: &mut BodyScratch,
) {
    let d = p.shape.head_size;
    // Elements of one stored row (an 8-bit row carries its scale).
    let stride = d + C::EXTRA;
    let bs = p.shape.block_size;
    let g = p.group;
    let nrows = item.row_hi - item.row_lo;
    let nq = nrows * g;
    let ctx_start = item.seq.seq_len - item.seq.q_len;

    // Against an 8-bit cache, each query vector is quantized as a cache row
    // is (`rows.rs`), before the score scale.
    let int8 = C::i8_rows(&p.key_cache[..0]).is_some();
    // Queries of the item, pre-scaled, as f32: vector (r, head) at (r * g +
    // head) * d; for an 8-bit cache, the values its bytes stand for.
    let q = reuse(&mut scratch.q, nq * d, 0.0);
    let mut q8 = QueryBytes::new(if int8 { nq } else { 0 }, d);
    for r in 0..nrows {
        let token = item.seq.q_start + item.row_lo + r;
        let src = &p.query[token * p.query_stride + item.kv_head * g * d..][..g * d];
        let dst = &mut q[r * g * d..(r + 1) * g * d];
        if int8 {
            for (h, (o, x)) in dst.chunks_exact_mut(d).zip(src.chunks_exact(d)).enumerate() {
                q8.quantize(r * g + h, x, p.scale, o);
            }
        } else {
            for (o, &x) in dst.iter_mut().zip(src) {
                *o = x.to_f32() * p.scale;
            }
        }
    }
    // An 8-bit cache's keys are scored as bytes (integer dot products) where
    // a vector's sums stay exact in f32 (`ScoresI8`).
    let int_scores = int8 && d.is_multiple_of(4) && d <= 512;
    let ipath = int_path(p.path);
    let mut ktile = vec![TileRow([0; 16]); if int_scores { d / 4 } else { 0 }];
    // Keys stored as transposed tiles (the encoder's private cache) need no
    // transposing, and a tile starts at a multiple of `TILE` in its block.
    let tiled = p.keys_tiled;
    let transpose = !int_scores && (tiled || nq >= TRANSPOSE_MIN_VECTORS);
    // The transposed route reads the queries dimension-major (`qk_tile`).
    let qt = reuse(&mut scratch.qt, if transpose { d * nq } else { 0 }, 0.0);
    if transpose {
        for (u, row) in q.chunks_exact(d).enumerate() {
            for (i, &x) in row.iter().enumerate() {
                qt[i * nq + u] = x;
            }
        }
    }
    let (q, qt) = (&*q, &*qt);
    // Visible key range [lo, hi) of each query row.
    let vis: Vec<(usize, usize)> = (0..nrows)
        .map(|r| p.mask.keys(ctx_start + item.row_lo + r, item.seq.seq_len))
        .collect();

    // Caches of f32 rows are read in place; others are widened per chunk.
    let widen = C::f32_rows(&p.key_cache[..0]).is_none();
    let vbuf = reuse(&mut scratch.vbuf, if widen { CHUNK * d } else { 0 }, 0.0);
    let kbuf_len = if widen && !transpose && !int_scores {
        CHUNK * d
    } else {
        0
    };
    let kbuf = reuse(&mut scratch.kbuf, kbuf_len, 0.0);
    let krow = reuse(&mut scratch.krow, d, 0.0);
    let kt = reuse(&mut scratch.kt, d * TILE, 0.0);
    let scores = reuse(&mut scratch.scores, nq, [0.0; LANES_PER_ROW]);
    let table = &p.block_tables[item.seq.seq * p.max_blocks..][..p.max_blocks];
    // Element offset of the stored row of key position `t` (validated: the
    // block id is in range for every block below seq_len).
    let row_at = |t: usize| {
        let block = table[t / bs] as usize;
        ((block * p.shape.num_kv_heads + item.kv_head) * bs + t % bs) * stride
    };
    // Runs `$body` with `(pos, n)` for each block's run of key positions in `$lo..$hi`.
    macro_rules! by_block {
        ($lo:expr, $hi:expr, |$pos:ident, $n:ident| $body:expr) => {{
            let (mut $pos, hi): (usize, usize) = ($lo, $hi);
            while $pos < hi {
                let $n = ((($pos / bs) + 1) * bs).min(hi) - $pos;
                $body;
                $pos += $n;
            }
        }};
    }
    // Value rows in place (f32 caches), by block: (first lane, rows).
    let mut runs: Vec<(usize, &[f32])> = Vec::new();

    let mut c0 = if tiled { key_lo / TILE * TILE } else { key_lo };
    while c0 < key_hi {
        // A chunk: up to `CHUNK` consecutive key positions, across blocks.
        let mc = (key_hi - c0).min(CHUNK);
        let (ck0, ck1) = (c0, c0 + mc);
        // Lanes of the chunk each query row sees.
        let lanes = |r: usize| {
            let (vlo, vhi) = vis[r];
            let lo = vlo.max(ck0).min(ck1) - ck0;
            let hi = vhi.min(ck1).max(ck0) - ck0;
            (lo, hi)
        };
        // Lanes any row sees: tiles outside are not scored, and keys
        // outside are not weighted.
        let (seen_lo, seen_hi) = (0..nrows)
            .map(lanes)
            .filter(|(lo, hi)| lo < hi)
            .fold((mc, 0), |(a, b), (lo, hi)| (a.min(lo), b.max(hi)));
        if seen_lo >= seen_hi {
            c0 = ck1;
            continue;
        }
        let first = seen_lo / TILE * TILE;
        runs.clear();
        by_block!(ck0 + first, ck0 + seen_hi, |pos, n| {
            // Rows of the next chunk are elsewhere in the pool (the hardware
            // prefetcher does not follow the block table): ask for them a
            // chunk ahead, a block's run at a time, while this one is computed.
            by_block!(
                (pos + CHUNK).min(key_hi),
                (pos + n + CHUNK).min(key_hi),
                |ahead, an| {
                    let at = row_at(ahead);
                    prefetch(&p.key_cache[at..at + an * stride]);
                    prefetch(&p.value_cache[at..at + an * stride]);
                }
            );
            let at = row_at(pos);
            let lane0 = pos - ck0;
            // A tiled block's last tile runs to the tile's end (the block size
            // is a multiple of `TILE`); past the block's last key its lanes
            // hold what the cache held, and the softmax masks them.
            let klen = if tiled { n.next_multiple_of(TILE) } else { n };
            let kraw = &p.key_cache[at..at + klen * stride];
            let vraw = &p.value_cache[at..at + n * stride];
            match C::f32_rows(vraw) {
                Some(v) => runs.push((lane0, v)),
                None => C::widen_rows(vraw, d, &mut vbuf[lane0 * d..(lane0 + n) * d]),
            }
            // An 8-bit cache's keys, scored as their bytes.
            let key_bytes = if int_scores { C::i8_rows(kraw) } else { None };
            if let Some(rows) = key_bytes {
                let queries = (&q8.dwords[..], nq, &q8.sums[..], &q8.scales[..]);
                dispatch_int(
                    ipath,
                    ScoresI8 {
                        rows,
                        d,
                        queries,
                        tile: &mut ktile,
                        scores,
                        at: lane0,
                    },
                );
            } else {
                // The encoder's keys, already transposed tiles of f32.
                let tiles: Option<&[f32]> = if tiled { C::f32_rows(kraw) } else { None };
                // Without the transposed tile, the block's keys as stored (widened).
                let stored: Option<&[f32]> = match (transpose, C::f32_rows(kraw)) {
                    (true, _) => None,
                    (false, Some(k)) => Some(k),
                    (false, None) => {
                        let kb = &mut kbuf[lane0 * d..(lane0 + n) * d];
                        C::widen_rows(kraw, d, kb);
                        Some(kb)
                    }
                };
                let mut k0 = 0;
                while k0 < n {
                    let m = (n - k0).min(TILE);
                    let jt = lane0 + k0;
                    if let Some(keys) = stored {
                        scores_as_stored::<S>(q, &keys[k0 * d..(k0 + m) * d], m, d, scores, jt);
                    } else if let Some(tiles) = tiles {
                        by_vector_groups!(nq, S::LANES >= TILE, |r, U| qk_tile::<S, U>(
                            (&qt[r..], nq),
                            &tiles[k0 * d..(k0 + TILE) * d],
                            d,
                            &mut scores[r..],
                            jt
                        ));
                    } else {
                        // The tile's keys, widened and transposed (lanes past `m` zero).
                        for jj in 0..m {
                            let raw = &kraw[(k0 + jj) * stride..(k0 + jj + 1) * stride];
                            C::widen_rows(raw, d, krow);
                            for (i, &x) in krow.iter().enumerate() {
                                kt[i * TILE + jj] = x;
                            }
                        }
                        if m < TILE {
                            for i in 0..d {
                                kt[i * TILE + m..(i + 1) * TILE].fill(0.0);
                            }
                        }
                        // One vector per tile row on AVX-512: twice the query vectors fit.
                        by_vector_groups!(nq, S::LANES >= TILE, |r, U| qk_tile::<S, U>(
                            (&qt[r..], nq),
                            kt,
                            d,
                            &mut scores[r..],
                            jt
                        ));
                    }
                    k0 += m;
                }
            }
        });
        for (r, s) in scores.iter_mut().enumerate() {
            let acc = &mut state.acc[r * d..(r + 1) * d];
            let (max, sum) = (&mut state.max[r], &mut state.sum[r]);
            softmax_chunk::<S>(&mut s[..mc], lanes(r / g), p.softcap, max, sum, acc);
        }
        if runs.is_empty() {
            let vals = &vbuf[..mc * d];
            by_vector_groups!(nq, true, |r, U| pv_tile::<S, U>(
                &scores[r..],
                (vals, 0),
                seen_lo..seen_hi,
                d,
                &mut state.acc[r * d..]
            ));
        } else {
            for &(lane0, vals) in &runs {
                let keys = lane0.max(seen_lo)..(lane0 + vals.len() / d);
                by_vector_groups!(nq, true, |r, U| pv_tile::<S, U>(
                    &scores[r..],
                    (vals, lane0),
                    keys.clone(),
                    d,
                    &mut state.acc[r * d..]
                ));
            }
        }
        c0 = ck1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ScoresI8` on every integer path this CPU runs against the integer
    /// sums in i64 times the two scales: 8-bit rows with extreme bytes
    /// (+-127, 0), head sizes that leave partial tiles and odd dword counts.
    #[test]
    fn int8_scores_equal_exact_sums_on_every_int_path() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for (d, n, nq) in [
            (64, 16, 7),
            (72, 21, 3),
            (4, 5, 1),
            (128, 40, 9),
            (512, 17, 2),
        ] {
            let stride = d + super::super::rows::INT8_SCALE_BYTES;
            let mut rows = vec![0i8; n * stride];
            for row in rows.chunks_exact_mut(stride) {
                for b in row[..d].iter_mut() {
                    *b = match next() % 5 {
                        0 => 127,
                        1 => -127,
                        2 => 0,
                        _ => (next() % 255) as i64 as i8,
                    }
                    .clamp(-127, 127);
                }
                let s = 0.001 + (next() % 1000) as f32 * 1e-4;
                for (o, b) in row[d..].iter_mut().zip(s.to_le_bytes()) {
                    *o = b as i8;
                }
            }
            let mut q8 = QueryBytes::new(nq, d);
            let mut qvals = vec![0.0f32; d];
            let queries: Vec<Vec<f32>> = (0..nq)
                .map(|_| {
                    (0..d)
                        .map(|_| (next() % 2001) as f32 / 100.0 - 10.0)
                        .collect()
                })
                .collect();
            let mut qbytes = vec![vec![0i8; stride]; nq];
            for (u, x) in queries.iter().enumerate() {
                q8.quantize(u, x, 0.125, &mut qvals);
                <i8 as KvElem<f32>>::store_row(x, &mut qbytes[u]);
            }
            for path in IntPath::available() {
                let mut tile = vec![TileRow([0; 16]); d / 4];
                let mut scores = vec![[f32::NAN; LANES_PER_ROW]; nq];
                // A chunk's lanes from 3 on (the kernel takes any start).
                let at = 3;
                let rows = &rows[..(n.min(CHUNK - at)) * stride];
                dispatch_int(
                    path,
                    ScoresI8 {
                        rows,
                        d,
                        queries: (&q8.dwords, nq, &q8.sums, &q8.scales),
                        tile: &mut tile,
                        scores: &mut scores,
                        at,
                    },
                );
                for (u, qb) in qbytes.iter().enumerate() {
                    let qs = row_scale(qb, d);
                    for (j, row) in rows.chunks_exact(stride).enumerate() {
                        let sum: i64 = (0..d).map(|i| qb[i] as i64 * row[i] as i64).sum();
                        let want = sum as f64 * qs as f64 * 0.125 * row_scale(row, d) as f64;
                        let got = scores[u][at + j] as f64;
                        assert!(
                            (got - want).abs() <= 1e-6 * want.abs().max(1e-3),
                            "{path:?} d {d} query {u} key {j}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

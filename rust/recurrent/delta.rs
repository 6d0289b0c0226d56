//! The gated delta rule of one task: one sequence's rows x one value head x
//! a block of the state's columns (columns of the state never mix: column
//! `j` of the output and of the state depend on column `j` of `v` and of the
//! state alone), in one of two forms that compute the same thing:
//!
//! - **recurrent**, row after row: one read of the state, then one pass per
//!   row that decays and updates the state and, in the same pass, reads the
//!   next row's `S^T k` and `S^T q` (`mat::update`);
//! - **chunked**, `DELTA_CHUNK` (16) rows at a time: the rows' updates
//!   within a chunk condensed by the UT transform (a unit lower triangular
//!   solve), then matrix products against the state (`mat::gemm`):
//!
//! ```text
//! G_r   = g_1 + ... + g_r (within the chunk)        D_rs = exp(G_r - G_s), s <= r
//! L_rs  = beta_r (k_r . k_s) D_rs  (s < r)           A_rs = (q_r . k_s) D_rs  (s <= r)
//! U     = (I + L)^-1 (beta v)                        W    = (I + L)^-1 (beta exp(G) k)
//! V'    = U - W S                                    out  = (exp(G) q) S + A V'
//! S     = exp(G_last) S + (exp(G_last - G) k)^T V'
//! ```
//!
//! Every exponent is <= 0 (`g <= 0`), so nothing overflows. Both forms do
//! about the same multiply-adds per row (`4 Dk Dv` recurrent, `3 Dk Dv` plus
//! the chunk's own products chunked), so on a CPU (FMA units, no matrix
//! units) the chunk is short: at 16 rows the chunked form ran 1.0-1.2 us
//! per row and head (Dk = Dv = 128, one AVX-512 thread) against 1.3-1.6 at
//! 64 rows and 1.5-1.9 row by row; row by row wins at one row (2.0 against
//! 2.8: three passes over the state against two) and ties at two.

use std::ops::Range;

use super::mat::{exp_f32, gemm, update, MatMut, MatRef, Reads};
use super::DELTA_CHUNK as CHUNK;
use crate::cpu::simd::{Kernel, Simd};
use crate::cpu::Element;

/// The inputs of one call, shared by its tasks.
pub(super) struct Inputs<'a, T> {
    /// `[tokens, k_heads, k_dim]` each.
    pub(super) q: &'a [T],
    pub(super) k: &'a [T],
    /// `[tokens, v_heads, v_dim]`.
    pub(super) v: &'a [T],
    /// `[tokens, v_heads]` each.
    pub(super) g: &'a [f32],
    pub(super) beta: &'a [f32],
    pub(super) k_heads: usize,
    pub(super) v_heads: usize,
    pub(super) k_dim: usize,
    pub(super) v_dim: usize,
    pub(super) scale: f32,
    pub(super) l2norm: bool,
    /// The delta rule (else the linear rule, `S += beta k v^T`: Mamba-2's
    /// SSD, whose chunked form then needs no triangular solve: `L = W = 0`).
    pub(super) delta: bool,
}

/// One task: rows `rows` of value head `head`, state columns `j0..`, and
/// that block of the head's state.
pub(super) struct DeltaTask<'a, 'b, T> {
    pub(super) part: Part<'a, 'b, T>,
    /// The head's state, columns `j0..j0 + n`: `k_dim x n`.
    pub(super) state: MatMut<'b>,
    pub(super) chunked: bool,
}

impl<T: Element> Kernel for DeltaTask<'_, '_, T> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self) {
        if self.chunked {
            chunked::<S, T>(&self.part, self.state)
        } else {
            recurrent::<S, T>(&self.part, self.state)
        }
    }
}

/// What a task reads and writes besides the state.
pub(super) struct Part<'a, 'b, T> {
    pub(super) inputs: &'b Inputs<'a, T>,
    /// The whole output, `[tokens, v_heads, v_dim]`; the task writes its
    /// rows' columns of its head only.
    pub(super) out: *mut T,
    pub(super) rows: Range<usize>,
    pub(super) head: usize,
    pub(super) j0: usize,
}

impl<T: Element> Part<'_, '_, T> {
    /// Row `t`'s query and key of this head, in f32, normalised when asked,
    /// the query scaled.
    #[inline(always)]
    fn query_key(&self, t: usize, q: &mut [f32], k: &mut [f32]) {
        let p = self.inputs;
        let kh = self.head / (p.v_heads / p.k_heads);
        let at = (t * p.k_heads + kh) * p.k_dim;
        load_scaled(&mut q[..p.k_dim], &p.q[at..at + p.k_dim], p.l2norm, p.scale);
        load_scaled(&mut k[..p.k_dim], &p.k[at..at + p.k_dim], p.l2norm, 1.0);
    }

    /// Row `t`'s values of this head and columns.
    #[inline(always)]
    fn values(&self, t: usize, n: usize) -> &[T] {
        let p = self.inputs;
        &p.v[(t * p.v_heads + self.head) * p.v_dim + self.j0..][..n]
    }

    /// Row `t`'s `(g, beta)` of this head.
    #[inline(always)]
    fn gate(&self, t: usize) -> (f32, f32) {
        let i = t * self.inputs.v_heads + self.head;
        (self.inputs.g[i], self.inputs.beta[i])
    }

    /// Writes row `t`'s output, columns `j..j + o.len()` of the task's.
    #[inline(always)]
    fn write(&self, t: usize, j: usize, o: &[f32]) {
        let p = self.inputs;
        // SAFETY: row t of this task's head and columns is written by this
        // task only; the caller checked `out` holds every row.
        let dst = unsafe {
            let at = (t * p.v_heads + self.head) * p.v_dim + self.j0 + j;
            std::slice::from_raw_parts_mut(self.out.add(at), o.len())
        };
        for (d, &v) in dst.iter_mut().zip(o) {
            *d = T::from_f32(v);
        }
    }
}

/// `dst = src * f`, `f = scale / sqrt(sum(src^2) + 1e-6)` when `l2norm`,
/// else `scale`.
#[inline(always)]
fn load_scaled<T: Element>(dst: &mut [f32], src: &[T], l2norm: bool, scale: f32) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
    let mut f = scale;
    if l2norm {
        // Sixteen partial sums: the loop vectorises.
        let mut part = [0f32; 16];
        let mut it = dst.chunks_exact(16);
        for c in &mut it {
            for (p, v) in part.iter_mut().zip(c) {
                *p += v * v;
            }
        }
        let tail: f32 = it.remainder().iter().map(|v| v * v).sum();
        let sum = part.iter().sum::<f32>() + tail;
        f = scale / (sum + 1e-6).sqrt();
    }
    for d in dst.iter_mut() {
        *d *= f;
    }
}

/// State bytes the recurrent form keeps in L1 over its rows: it takes the
/// state's columns in blocks of `dk x width` of about this size.
const L1_STATE_BYTES: usize = 24 << 10;

/// Row after row: `S = e^g S`, `delta = beta (v - S^T k)`, `S += k delta^T`,
/// `out = S^T q`, computed as `out = e^g (S_old^T q) + (k . q) delta` so that
/// each row passes over the state once (`mat::update`), after one first read.
/// The state's columns never mix, so the rows run over one block of columns
/// at a time, which stays in L1 between the passes.
#[inline(always)]
fn recurrent<S: Simd, T: Element>(task: &Part<'_, '_, T>, mut state: MatMut<'_>) {
    let (dk, n) = (task.inputs.k_dim, state.cols());
    let rows = task.rows.clone();
    let vector_block = S::LANES * if S::LANES >= 16 { 4 } else { 2 };
    let width = (L1_STATE_BYTES / 4 / dk / vector_block * vector_block).max(vector_block);
    let mut scratch = Scratch::take(rows.len() * (2 * dk + 1) + 4 * width);
    // Every row's key and query (2 dk: k, then q) and k . q.
    let (kq, buf) = scratch.0.split_at_mut(rows.len() * 2 * dk);
    let (kdotq, buf) = buf.split_at_mut(rows.len());
    for (r, t) in rows.clone().enumerate() {
        let (k, q) = kq[r * 2 * dk..][..2 * dk].split_at_mut(dk);
        task.query_key(t, q, k);
        kdotq[r] = k.iter().zip(q.iter()).map(|(a, b)| a * b).sum();
    }
    let (reads, buf) = buf.split_at_mut(2 * width);
    let (delta, o) = buf.split_at_mut(width);
    for j in (0..n).step_by(width) {
        let w = width.min(n - j);
        let mut s = state.columns(j, w);
        // [S^T k; S^T q] of the first row.
        let first = MatRef::rows(kq, 2, dk, dk);
        gemm::<S>(first, s.view(), MatMut::new(reads, 2, w, w), 0.0);
        for (r, t) in rows.clone().enumerate() {
            let (g, beta) = task.gate(t);
            let decay = g.exp();
            let (kv, sq) = reads.split_at(w);
            let v = &task.values(t, n)[j..j + w];
            let recall = if task.inputs.delta { decay } else { 0.0 };
            for (c, x) in v.iter().enumerate() {
                delta[c] = (x.to_f32() - recall * kv[c]) * beta;
                o[c] = S::mul_add(kdotq[r], delta[c], decay * sq[c]);
            }
            task.write(t, j, &o[..w]);
            let next = kq.get((r + 1) * 2 * dk..(r + 2) * 2 * dk).map(|next| {
                let (ua, ub) = reads.split_at_mut(w);
                let (a, b) = next.split_at(dk);
                Reads { a, b, ua, ub }
            });
            let k = &kq[r * 2 * dk..][..dk];
            update::<S>(s.reborrow(), decay, k, &delta[..w], next);
        }
    }
}

/// The chunked form's buffers, for chunks of up to `CHUNK` rows.
struct Chunk<'a> {
    /// Keys and queries `[CHUNK, dk]`, then scaled as the steps need.
    k: &'a mut [f32],
    q: &'a mut [f32],
    /// The keys transposed, `[dk, CHUNK]`.
    kt: &'a mut [f32],
    /// `-W`, `[CHUNK, dk]`.
    w: &'a mut [f32],
    /// `beta v`, then `U`, then `V'`, `[CHUNK, n]`.
    u: &'a mut [f32],
    /// The output rows, `[CHUNK, n]`.
    o: &'a mut [f32],
    /// `-L` and `A`, `[CHUNK, CHUNK]`.
    lower: &'a mut [f32],
    attn: &'a mut [f32],
    /// The cumulative log decay `G`, `beta`, and one row of decays.
    cum: [f32; CHUNK],
    beta: [f32; CHUNK],
    decay: [f32; CHUNK],
}

impl<'a> Chunk<'a> {
    /// f32 the buffers take.
    fn len(dk: usize, n: usize) -> usize {
        CHUNK * (4 * dk + 2 * n + 2 * CHUNK)
    }

    /// The buffers, carved from `buf` (`len` elements; contents ignored).
    fn new(buf: &'a mut [f32], dk: usize, n: usize) -> Self {
        let (k, buf) = buf.split_at_mut(CHUNK * dk);
        let (q, buf) = buf.split_at_mut(CHUNK * dk);
        let (kt, buf) = buf.split_at_mut(CHUNK * dk);
        let (w, buf) = buf.split_at_mut(CHUNK * dk);
        let (u, buf) = buf.split_at_mut(CHUNK * n);
        let (o, buf) = buf.split_at_mut(CHUNK * n);
        let (lower, attn) = buf.split_at_mut(CHUNK * CHUNK);
        Chunk {
            k,
            q,
            kt,
            w,
            u,
            o,
            lower,
            attn,
            cum: [0.0; CHUNK],
            beta: [0.0; CHUNK],
            decay: [0.0; CHUNK],
        }
    }
}

/// Rows per block of the chunk's triangular products (blocks above the
/// diagonal are skipped).
const TRI: usize = 16;

/// `CHUNK` rows at a time (see the module's notes for the algebra).
#[inline(always)]
fn chunked<S: Simd, T: Element>(task: &Part<'_, '_, T>, mut state: MatMut<'_>) {
    let (dk, n) = (task.inputs.k_dim, state.cols());
    let mut scratch = Scratch::take(Chunk::len(dk, n));
    let mut c = Chunk::new(&mut scratch.0, dk, n);
    let rows = task.rows.clone();
    for start in rows.clone().step_by(CHUNK) {
        let m = CHUNK.min(rows.end - start);
        chunk_inputs(task, &mut c, (dk, n), start, m);
        chunk_solve::<S>(&mut c, dk, n, m, task.inputs.delta);
        chunk_apply::<S, T>(task, state.reborrow(), &mut c, start, m, task.inputs.delta);
    }
}

/// Loads rows `start..start + m`: keys and queries, `beta v`, `G`, `beta`,
/// and the keys transposed.
#[inline(always)]
fn chunk_inputs<T: Element>(
    task: &Part<'_, '_, T>,
    c: &mut Chunk,
    (dk, n): (usize, usize),
    start: usize,
    m: usize,
) {
    let mut cum = 0f32;
    for r in 0..m {
        let t = start + r;
        task.query_key(t, &mut c.q[r * dk..][..dk], &mut c.k[r * dk..][..dk]);
        let (g, beta) = task.gate(t);
        cum += g;
        c.cum[r] = cum;
        c.beta[r] = beta;
        for (u, x) in c.u[r * n..][..n].iter_mut().zip(task.values(t, n)) {
            *u = beta * x.to_f32();
        }
        for i in 0..dk {
            c.kt[i * CHUNK + r] = c.k[r * dk + i];
        }
    }
}

/// The chunk's triangular systems: `-L`, `A` (both decayed), `-W` and `U`
/// (the linear rule, `delta` false: `A` only, `U = beta v` as loaded).
#[inline(always)]
fn chunk_solve<S: Simd>(c: &mut Chunk, dk: usize, n: usize, m: usize, delta: bool) {
    // K K^T and Q K^T by blocks of rows, up to the diagonal block (its
    // columns rounded up to 16: the columns past `m` are never read).
    for r0 in (0..m).step_by(TRI) {
        let r1 = (r0 + TRI).min(m);
        let cols = r1.next_multiple_of(TRI).min(CHUNK);
        let kt = MatRef::rows(c.kt, dk, cols, CHUNK);
        for (x, out, wanted) in [(&*c.k, &mut *c.lower, delta), (&*c.q, &mut *c.attn, true)] {
            if !wanted {
                continue;
            }
            let x = MatRef::rows(&x[r0 * dk..], r1 - r0, dk, dk);
            gemm::<S>(
                x,
                kt,
                MatMut::new(&mut out[r0 * CHUNK..], r1 - r0, cols, CHUNK),
                0.0,
            );
        }
    }
    for r in 0..m {
        let gr = c.cum[r];
        for (d, &gs) in c.decay[..=r].iter_mut().zip(&c.cum[..=r]) {
            *d = exp_f32(gr - gs);
        }
        let attn = &mut c.attn[r * CHUNK..][..m];
        for (a, d) in attn[..=r].iter_mut().zip(&c.decay[..=r]) {
            *a *= d;
        }
        attn[r + 1..].fill(0.0);
        if !delta {
            continue;
        }
        let b = -c.beta[r];
        for (l, d) in c.lower[r * CHUNK..][..r].iter_mut().zip(&c.decay[..r]) {
            *l *= b * d;
        }
        let f = -c.beta[r] * c.cum[r].exp();
        for (w, kv) in c.w[r * dk..][..dk].iter_mut().zip(&c.k[r * dk..][..dk]) {
            *w = f * kv;
        }
    }
    if !delta {
        return;
    }
    // Forward substitution, row by row: x_r -= sum_{s<r} L_rs x_s.
    let mut u = MatMut::new(c.u, m, n, n);
    let mut w = MatMut::new(c.w, m, dk, dk);
    for r in 1..m {
        let l = MatRef::rows(&c.lower[r * CHUNK..], 1, r, CHUNK);
        let (above, row) = u.above_and_row(r);
        gemm::<S>(l, above, row, 1.0);
        let (above, row) = w.above_and_row(r);
        gemm::<S>(l, above, row, 1.0);
    }
}

/// `V' = U - W S` (the linear rule: `V' = U`), the output rows, and the
/// state after the chunk.
#[inline(always)]
fn chunk_apply<S: Simd, T: Element>(
    task: &Part<'_, '_, T>,
    mut state: MatMut<'_>,
    c: &mut Chunk,
    start: usize,
    m: usize,
    delta: bool,
) {
    let (dk, n) = (task.inputs.k_dim, state.cols());
    if delta {
        let w = MatRef::rows(c.w, m, dk, dk);
        gemm::<S>(w, state.view(), MatMut::new(c.u, m, n, n), 1.0);
    }
    for r in 0..m {
        let f = c.cum[r].exp();
        c.q[r * dk..][..dk].iter_mut().for_each(|v| *v *= f);
    }
    let q = MatRef::rows(c.q, m, dk, dk);
    gemm::<S>(q, state.view(), MatMut::new(c.o, m, n, n), 0.0);
    // o += A V', A lower triangular: by blocks of rows, up to the diagonal.
    for r0 in (0..m).step_by(TRI) {
        let r1 = (r0 + TRI).min(m);
        let a = MatRef::rows(&c.attn[r0 * CHUNK..], r1 - r0, r1, CHUNK);
        let v_new = MatRef::rows(c.u, r1, n, n);
        gemm::<S>(
            a,
            v_new,
            MatMut::new(&mut c.o[r0 * n..], r1 - r0, n, n),
            1.0,
        );
    }
    for r in 0..m {
        task.write(start + r, 0, &c.o[r * n..][..n]);
    }
    let last = c.cum[m - 1];
    for r in 0..m {
        let f = (last - c.cum[r]).exp();
        c.k[r * dk..][..dk].iter_mut().for_each(|v| *v *= f);
    }
    // S = e^G_last S + K'^T V' (K' read transposed: element (i, r) = k[r, i]).
    let kt = MatRef::new(c.k, dk, m, 1, dk);
    let v_new = MatRef::rows(c.u, m, n, n);
    gemm::<S>(kt, v_new, state.reborrow(), last.exp());
}

thread_local! {
    /// Each thread's scratch for the delta rule's tasks, kept between calls
    /// (a prefill chunk's buffers are a few hundred KB: allocating and
    /// zeroing them per task cost as much as a pass over the state).
    static SCRATCH: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// This thread's scratch, taken for one task and given back when dropped.
/// (A guard, not a closure: the kernel bodies must stay inside the ISA's
/// entry point, and a closure called from a plain function would compile
/// them without its features.)
struct Scratch(Vec<f32>);

impl Scratch {
    fn take(len: usize) -> Self {
        let mut buf = SCRATCH.try_with(|c| c.take()).unwrap_or_default();
        if buf.len() < len {
            buf.resize(len, 0.0);
        }
        Scratch(buf)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.0);
        let _ = SCRATCH.try_with(|c| c.set(buf));
    }
}

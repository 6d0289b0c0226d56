//! The f32 building blocks of the recurrent kernels, written once over
//! [`Simd`]: a small GEMM with register tiles (the chunked delta rule's
//! matrix products and triangular solve), the fused state pass of the
//! recurrent delta rule, and a vectorisable `exp`.
//!
//! Every function here is `#[inline(always)]`, so that it is compiled
//! inside the ISA entry point of the kernel that calls it. The matrices are
//! views ([`MatRef`], [`MatMut`]) checked against their memory when made, so
//! that the loops can index them without checks.

use std::marker::PhantomData;

use crate::cpu::simd::Simd;

/// A read-only `rows x cols` f32 matrix whose element `(r, c)` is at
/// `r * rs + c * cs`: a row-major matrix (`cs = 1`) or the transpose of
/// one (`rs = 1`).
#[derive(Clone, Copy)]
pub(super) struct MatRef<'a> {
    ptr: *const f32,
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
    _data: PhantomData<&'a [f32]>,
}

impl<'a> MatRef<'a> {
    /// The matrix in `data`; panics (a bug, caught by the thread team) if
    /// an element would lie outside it.
    pub(super) fn new(data: &'a [f32], rows: usize, cols: usize, rs: usize, cs: usize) -> Self {
        assert!(
            rows == 0 || cols == 0 || (rows - 1) * rs + (cols - 1) * cs < data.len(),
            "matrix {rows} x {cols} (strides {rs}, {cs}) outside {} elements",
            data.len()
        );
        MatRef {
            ptr: data.as_ptr(),
            rows,
            cols,
            rs,
            cs,
            _data: PhantomData,
        }
    }

    /// A row-major matrix, rows `ld` apart.
    pub(super) fn rows(data: &'a [f32], rows: usize, cols: usize, ld: usize) -> Self {
        Self::new(data, rows, cols, ld, 1)
    }

    /// Element `(r, c)`.
    ///
    /// # Safety
    /// `r < rows`, `c < cols`.
    #[inline(always)]
    unsafe fn at(&self, r: usize, c: usize) -> f32 {
        *self.ptr.add(r * self.rs + c * self.cs)
    }
}

/// A writable row-major `rows x cols` f32 matrix, rows `ld` apart, that
/// nothing else reads or writes while it lives.
pub(super) struct MatMut<'a> {
    ptr: *mut f32,
    rows: usize,
    cols: usize,
    ld: usize,
    _data: PhantomData<&'a mut [f32]>,
}

impl<'a> MatMut<'a> {
    /// The matrix in `data`; panics if an element would lie outside it.
    pub(super) fn new(data: &'a mut [f32], rows: usize, cols: usize, ld: usize) -> Self {
        assert!(
            rows == 0 || cols == 0 || (rows - 1) * ld + cols <= data.len(),
            "matrix {rows} x {cols} (rows {ld} apart) outside {} elements",
            data.len()
        );
        MatMut {
            ptr: data.as_mut_ptr(),
            rows,
            cols,
            ld,
            _data: PhantomData,
        }
    }

    /// A window of a larger matrix (some of its columns) that other
    /// threads may share with disjoint windows.
    ///
    /// # Safety
    /// Elements `ptr + r * ld + c` (`r < rows`, `c < cols`) are valid for
    /// `'a`, and nothing else reads or writes them meanwhile.
    pub(super) unsafe fn from_raw(ptr: *mut f32, rows: usize, cols: usize, ld: usize) -> Self {
        MatMut {
            ptr,
            rows,
            cols,
            ld,
            _data: PhantomData,
        }
    }

    /// Its number of columns.
    pub(super) fn cols(&self) -> usize {
        self.cols
    }

    /// The same matrix for a shorter borrow.
    pub(super) fn reborrow(&mut self) -> MatMut<'_> {
        MatMut {
            _data: PhantomData,
            ..*self
        }
    }

    /// The same matrix, read-only.
    pub(super) fn view(&self) -> MatRef<'_> {
        MatRef {
            ptr: self.ptr,
            rows: self.rows,
            cols: self.cols,
            rs: self.ld,
            cs: 1,
            _data: PhantomData,
        }
    }

    /// Columns `j..j + w` (within the matrix), for a shorter borrow.
    pub(super) fn columns(&mut self, j: usize, w: usize) -> MatMut<'_> {
        assert!(j + w <= self.cols);
        MatMut {
            // SAFETY: column j is inside the matrix (or one past its end
            // when w is 0).
            ptr: unsafe { self.ptr.add(j) },
            cols: w,
            _data: PhantomData,
            ..*self
        }
    }

    /// Rows `0..r` (read-only) and row `r` (writable), `r < rows`.
    pub(super) fn above_and_row(&mut self, r: usize) -> (MatRef<'_>, MatMut<'_>) {
        assert!(r < self.rows);
        let above = MatRef {
            ptr: self.ptr,
            rows: r,
            cols: self.cols,
            rs: self.ld,
            cs: 1,
            _data: PhantomData,
        };
        // SAFETY: row r is disjoint from rows 0..r and inside the matrix.
        let row = MatMut {
            ptr: unsafe { self.ptr.add(r * self.ld) },
            rows: 1,
            cols: self.cols,
            ld: self.ld,
            _data: PhantomData,
        };
        (above, row)
    }
}

/// `c = c_scale * c + a b` for `a [m x k]`, `b [k x n]` (row-major) and
/// `c [m x n]`; with `c_scale == 0` the old contents of `c` are not read.
/// Sums in f32 with FMA in the order of `k`, whatever the tile.
///
/// Panics (a bug, caught by the thread team) if the shapes disagree.
#[inline(always)]
pub(super) fn gemm<S: Simd>(a: MatRef, b: MatRef, c: MatMut, c_scale: f32) {
    assert!(
        b.cs == 1 && a.cols == b.rows && c.rows == a.rows && c.cols == b.cols,
        "gemm: shapes {}x{} {}x{} {}x{}",
        a.rows,
        a.cols,
        b.rows,
        b.cols,
        c.rows,
        c.cols
    );
    let (m, n) = (c.rows, c.cols);
    let g = Gemm { a, b, c, c_scale };
    // SAFETY: the shapes agree, and every tile stays inside `m x n`.
    unsafe {
        // Accumulators + the row of `b` + a broadcast fit the registers:
        // AVX-512 (32): 4 x 4 + 4 + 1; AVX2 (16): 4 x 2 + 2 + 1.
        if S::LANES >= 16 {
            g.columns::<S, 4>(m, n)
        } else {
            g.columns::<S, 2>(m, n)
        }
    }
}

/// One [`gemm`] call.
struct Gemm<'a, 'b, 'c> {
    a: MatRef<'a>,
    b: MatRef<'b>,
    c: MatMut<'c>,
    c_scale: f32,
}

impl Gemm<'_, '_, '_> {
    /// Columns in blocks of `NB` vectors, then single vectors, then scalars.
    ///
    /// # Safety
    /// Inside `S`'s entry point; `a`, `b` and `c` are `m x k`, `k x n`, `m x n`.
    #[inline(always)]
    unsafe fn columns<S: Simd, const NB: usize>(&self, m: usize, n: usize) {
        let mut j = 0;
        while j + NB * S::LANES <= n {
            self.rows::<S, NB>(m, j);
            j += NB * S::LANES;
        }
        while j + S::LANES <= n {
            self.rows::<S, 1>(m, j);
            j += S::LANES;
        }
        let (k, ld) = (self.a.cols, self.c.ld);
        for r in 0..m {
            for jj in j..n {
                let c = self.c.ptr.add(r * ld + jj);
                let mut s = if self.c_scale == 0.0 {
                    0.0
                } else {
                    self.c_scale * *c
                };
                for i in 0..k {
                    s = S::mul_add(self.a.at(r, i), self.b.at(i, jj), s);
                }
                *c = s;
            }
        }
    }

    /// Every row of the column block at `j`: tiles of 4 rows, then the rest.
    #[inline(always)]
    unsafe fn rows<S: Simd, const NB: usize>(&self, m: usize, j: usize) {
        let mut r = 0;
        while r + 4 <= m {
            self.tile::<S, 4, NB>(r, j);
            r += 4;
        }
        match m - r {
            3 => self.tile::<S, 3, NB>(r, j),
            2 => self.tile::<S, 2, NB>(r, j),
            1 => self.tile::<S, 1, NB>(r, j),
            _ => {}
        }
    }

    /// `R` rows x `NB` vectors of `c` at `(r0, j)`, summed in registers.
    #[inline(always)]
    unsafe fn tile<S: Simd, const R: usize, const NB: usize>(&self, r0: usize, j: usize) {
        let ld = self.c.ld;
        let mut acc = [[S::zero(); NB]; R];
        if self.c_scale != 0.0 {
            let scale = S::splat(self.c_scale);
            for (r, row) in acc.iter_mut().enumerate() {
                let c = self.c.ptr.add((r0 + r) * ld + j);
                for (v, sum) in row.iter_mut().enumerate() {
                    *sum = S::fmadd(scale, S::load(c.add(v * S::LANES)), S::zero());
                }
            }
        }
        for i in 0..self.a.cols {
            let b = self.b.ptr.add(i * self.b.rs + j);
            let bv: [S::F32; NB] = std::array::from_fn(|v| S::load(b.add(v * S::LANES)));
            for (r, row) in acc.iter_mut().enumerate() {
                let a = S::splat(self.a.at(r0 + r, i));
                for (sum, bq) in row.iter_mut().zip(&bv) {
                    *sum = S::fmadd(a, *bq, *sum);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            let c = self.c.ptr.add((r0 + r) * ld + j);
            for (v, sum) in row.iter().enumerate() {
                S::store(c.add(v * S::LANES), *sum);
            }
        }
    }
}

/// The vectors one [`update`] reads the new state with: `(a, b)`, `dk`
/// each, and where their products go, `(ua, ub)`, `n` each.
pub(super) struct Reads<'a> {
    pub(super) a: &'a [f32],
    pub(super) b: &'a [f32],
    pub(super) ua: &'a mut [f32],
    pub(super) ub: &'a mut [f32],
}

/// One row of the recurrent delta rule over a state `s [dk x n]`:
/// `s = alpha * s + x y^T` (`x`: dk, `y`: n) and, in the same pass, with
/// `reads`, `ua = s^T a` and `ub = s^T b` over the new state (the next row's
/// key and query), so that each row streams the state once.
///
/// Panics (a bug, caught by the thread team) if a vector is too short.
#[inline(always)]
pub(super) fn update<S: Simd>(s: MatMut, alpha: f32, x: &[f32], y: &[f32], reads: Option<Reads>) {
    let (dk, n) = (s.rows, s.cols);
    assert!(x.len() >= dk && y.len() >= n, "update: vectors too short");
    let step = Step {
        s,
        alpha,
        x: x.as_ptr(),
        y: y.as_ptr(),
    };
    // SAFETY: `s` is `dk x n`, the vectors were checked (here and below).
    unsafe {
        match reads {
            Some(r) => {
                assert!(r.a.len() >= dk && r.b.len() >= dk && r.ua.len() >= n && r.ub.len() >= n);
                let p = ReadPtrs {
                    a: r.a.as_ptr(),
                    b: r.b.as_ptr(),
                    ua: r.ua.as_mut_ptr(),
                    ub: r.ub.as_mut_ptr(),
                };
                step.columns::<S, true>(p)
            }
            None => step.columns::<S, false>(ReadPtrs::NONE),
        }
    }
}

/// The state and the outer product of one [`update`].
struct Step<'a> {
    s: MatMut<'a>,
    alpha: f32,
    x: *const f32,
    y: *const f32,
}

/// [`Reads`] as pointers (null without reads).
#[derive(Clone, Copy)]
struct ReadPtrs {
    a: *const f32,
    b: *const f32,
    ua: *mut f32,
    ub: *mut f32,
}

impl ReadPtrs {
    const NONE: ReadPtrs = ReadPtrs {
        a: std::ptr::null(),
        b: std::ptr::null(),
        ua: std::ptr::null_mut(),
        ub: std::ptr::null_mut(),
    };
}

impl Step<'_> {
    /// Columns in blocks of 4 vectors (AVX2: 2), single vectors, scalars.
    ///
    /// # Safety
    /// As for `update`; with `READ`, `r` holds valid vectors.
    #[inline(always)]
    unsafe fn columns<S: Simd, const READ: bool>(&self, r: ReadPtrs) {
        let n = self.s.cols;
        let mut j = 0;
        if S::LANES >= 16 {
            while j + 4 * S::LANES <= n {
                self.block::<S, 4, READ>(j, r);
                j += 4 * S::LANES;
            }
        } else {
            while j + 2 * S::LANES <= n {
                self.block::<S, 2, READ>(j, r);
                j += 2 * S::LANES;
            }
        }
        while j + S::LANES <= n {
            self.block::<S, 1, READ>(j, r);
            j += S::LANES;
        }
        for jj in j..n {
            let (mut ua, mut ub) = (0f32, 0f32);
            let y = *self.y.add(jj);
            for i in 0..self.s.rows {
                let p = self.s.ptr.add(i * self.s.ld + jj);
                let v = S::mul_add(*self.x.add(i), y, self.alpha * *p);
                *p = v;
                if READ {
                    ua = S::mul_add(*r.a.add(i), v, ua);
                    ub = S::mul_add(*r.b.add(i), v, ub);
                }
            }
            if READ {
                *r.ua.add(jj) = ua;
                *r.ub.add(jj) = ub;
            }
        }
    }

    /// `NB` vectors of columns at `j`, down every row of the state.
    #[inline(always)]
    unsafe fn block<S: Simd, const NB: usize, const READ: bool>(&self, j: usize, r: ReadPtrs) {
        let y: [S::F32; NB] = std::array::from_fn(|v| S::load(self.y.add(j + v * S::LANES)));
        let alpha = S::splat(self.alpha);
        let (mut ua, mut ub) = ([S::zero(); NB], [S::zero(); NB]);
        for i in 0..self.s.rows {
            let row = self.s.ptr.add(i * self.s.ld + j);
            let xi = S::splat(*self.x.add(i));
            let (ai, bi) = if READ {
                (S::splat(*r.a.add(i)), S::splat(*r.b.add(i)))
            } else {
                (S::zero(), S::zero())
            };
            for (v, yv) in y.iter().enumerate() {
                let p = row.add(v * S::LANES);
                let new = S::fmadd(alpha, S::load(p), S::fmadd(xi, *yv, S::zero()));
                S::store(p, new);
                if READ {
                    ua[v] = S::fmadd(ai, new, ua[v]);
                    ub[v] = S::fmadd(bi, new, ub[v]);
                }
            }
        }
        if READ {
            for v in 0..NB {
                S::store(r.ua.add(j + v * S::LANES), ua[v]);
                S::store(r.ub.add(j + v * S::LANES), ub[v]);
            }
        }
    }
}

/// `e^x` without branches or libm, so that loops over it vectorise:
/// relative error below 3e-7 on [-87.3, 88.3]; below, about 1e-38; above,
/// it saturates.
#[inline(always)]
#[allow(clippy::manual_clamp)] // min/max vectorise, clamp does not here
pub(super) fn exp_f32(x: f32) -> f32 {
    let x = x.max(-87.3).min(88.3);
    // x = n ln2 + y, |y| <= ln2 / 2; n rounded by adding 1.5 * 2^23.
    let n = (x * std::f32::consts::LOG2_E + 12_582_912.0) - 12_582_912.0;
    // ln2 split in two (Cody-Waite) so that n * LN2_HI is exact.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let y = (x - n * LN2_HI) - n * LN2_LO;
    // e^y by its Taylor series to degree 7 (Horner).
    let mut p = 1.0 / 5040.0;
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = p * y + c;
    }
    // SAFETY: |n| <= 128 after the clamp.
    let n = unsafe { n.to_int_unchecked::<i32>() };
    p * f32::from_bits(((n + 127) as u32) << 23)
}

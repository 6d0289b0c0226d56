//! The causal depthwise convolution of one task: one sequence's rows x one
//! block of channels, vectorised across the channels (plain loops that the
//! entry point's features vectorise).

use std::ops::Range;

use super::mat::exp_f32;
use super::MAX_CONV_WIDTH as MAX_WIDTH;
use crate::cpu::simd::{Kernel, Simd};
use crate::cpu::Element;

/// Channels per task.
pub(super) const BLOCK: usize = 256;

/// One sequence's rows x channels `c0..c0 + cb` (`cb <= BLOCK`).
pub(super) struct ConvTask<'a, T> {
    /// The whole input, `[tokens, channels]`.
    pub(super) x: &'a [T],
    /// The whole output, `[tokens, channels]`; this task writes its rows'
    /// channels of the block only.
    pub(super) out: *mut T,
    /// The weights, `[channels, width]`, and the bias, `[channels]`.
    pub(super) weight: &'a [T],
    pub(super) bias: Option<&'a [T]>,
    /// The block's state: `cb` channels of `width - 1` inputs, oldest first.
    pub(super) state: &'a mut [T],
    pub(super) rows: Range<usize>,
    pub(super) c0: usize,
    pub(super) cb: usize,
    pub(super) channels: usize,
    pub(super) width: usize,
    pub(super) silu: bool,
}

impl<T: Element> Kernel for ConvTask<'_, T> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self) {
        conv_block::<S, T>(self)
    }
}

/// `y[t, c] = bias[c] + sum_j w[c, j] xin[t - (K - 1) + j, c]` over the
/// state followed by the rows, in f32, then SiLU, rounded once; the state
/// becomes the last `K - 1` inputs.
#[inline(always)]
fn conv_block<S: Simd, T: Element>(t: ConvTask<'_, T>) {
    let (cb, k, keep) = (t.cb, t.width, t.width - 1);
    assert!(cb <= BLOCK && (2..=MAX_WIDTH).contains(&k) && t.state.len() == cb * keep);
    // The block's weights as one row per tap, the state as one row per
    // position (oldest first): both read along the channels below.
    let mut taps = [[0f32; BLOCK]; MAX_WIDTH];
    let mut hist = [[T::from_f32(0.0); BLOCK]; MAX_WIDTH - 1];
    for c in 0..cb {
        let w = &t.weight[(t.c0 + c) * k..][..k];
        for (tap, wj) in taps.iter_mut().zip(w) {
            tap[c] = wj.to_f32();
        }
        for (h, s) in hist.iter_mut().zip(&t.state[c * keep..][..keep]) {
            h[c] = *s;
        }
    }
    // Input position p (0.. = state, then the rows) of this block.
    let input = |p: usize| -> &[T] {
        if p < keep {
            &hist[p][..cb]
        } else {
            &t.x[(t.rows.start + p - keep) * t.channels + t.c0..][..cb]
        }
    };
    let mut acc = [0f32; BLOCK];
    let acc = &mut acc[..cb];
    for r in 0..t.rows.len() {
        match t.bias {
            Some(b) => {
                for (a, bv) in acc.iter_mut().zip(&b[t.c0..t.c0 + cb]) {
                    *a = bv.to_f32();
                }
            }
            None => acc.fill(0.0),
        }
        for (j, tap) in taps[..k].iter().enumerate() {
            for ((a, w), xv) in acc.iter_mut().zip(&tap[..cb]).zip(input(r + j)) {
                *a = S::mul_add(*w, xv.to_f32(), *a);
            }
        }
        // SAFETY: row `r` of this sequence, channels of this block: written
        // by this task only; the caller checked `out` holds every row.
        let o = unsafe {
            let row = t.rows.start + r;
            std::slice::from_raw_parts_mut(t.out.add(row * t.channels + t.c0), cb)
        };
        if t.silu {
            for (o, &y) in o.iter_mut().zip(acc.iter()) {
                *o = T::from_f32(y / (1.0 + exp_f32(-y)));
            }
        } else {
            for (o, &y) in o.iter_mut().zip(acc.iter()) {
                *o = T::from_f32(y);
            }
        }
    }
    // The new state: the last `K - 1` inputs, state rows included when the
    // call has fewer rows.
    let n = t.rows.len();
    for j in 0..keep {
        for (c, v) in input(n + j).iter().enumerate() {
            t.state[c * keep + j] = *v;
        }
    }
}

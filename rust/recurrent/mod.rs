//! CPU kernels of the recurrent token mixers of hybrid models, over packed
//! variable-length batches with a fixed-size state per sequence:
//!
//! - [`causal_conv1d`]: a depthwise causal convolution (LFM2's short
//!   convolutions, Qwen3.5's q/k/v convolution) whose state is the last
//!   `K - 1` input rows, optionally followed by SiLU (`conv.rs`);
//! - [`gated_delta_rule`]: Gated DeltaNet's linear attention (Qwen3.5), whose
//!   state is one `[Dk, Dv]` f32 matrix per value head (`delta.rs`), row by
//!   row for one or two rows (decode) and [`DELTA_CHUNK`] rows at a time
//!   through the UT transform for more (prefill); with [`Rule::Linear`] the
//!   same kernel runs Mamba-2's selective state space (SSD: the state decays
//!   and adds `beta k v^T`, without the delta rule's correction).
//!
//! Sequence `i` owns rows `query_start_loc[i]..query_start_loc[i + 1]` and
//! its state lives at index `state_slots[i]` of the state tensor: the state
//! before its first row, overwritten with the state after its last row.
//! Tasks are (sequence, block of channels) and (sequence, value head, block
//! of state columns) on the thread team; the bodies are written once over
//! `cpu::simd::Simd` (`mat.rs`) and compiled for every ISA path.

mod conv;
mod delta;
mod mat;
#[cfg(test)]
mod tests;

use std::ops::Range;

use crate::cpu::elem::SharedOut;
use crate::cpu::simd::dispatch;
use crate::cpu::{best_path, Dst, Element, Path, Src};
use crate::error::{CoreError, CoreResult};

/// The widest convolution (taps per channel) [`causal_conv1d`] takes.
pub const MAX_CONV_WIDTH: usize = 8;

/// Rows per chunk of the chunked form of the delta rule (16 ran faster than
/// 32 or 64 on a CPU: the chunk's own products grow with its square).
pub const DELTA_CHUNK: usize = 16;

/// Sequences of at least this many rows in a call run the chunked form of
/// the delta rule, shorter ones the recurrent form: measured by timing both
/// forms on one AVX-512 thread (`delta.rs` has the figures; `cargo bench
/// --bench recurrent -- delta_forms` times them again).
pub const CHUNKED_MIN_ROWS: usize = 3;

/// Multiply-adds below which a call runs on the calling thread.
const SERIAL_WORK: usize = 1 << 15;

/// Where the sequences of a packed batch are.
#[derive(Clone, Copy, Debug)]
pub struct Packed<'a> {
    /// `num_seqs + 1` row offsets, from 0, non-decreasing, ending at the
    /// number of rows: sequence `i` owns rows `query_start_loc[i]..query_start_loc[i + 1]`.
    pub query_start_loc: &'a [i32],
    /// The state slot of each sequence (`num_seqs`), each below the number of
    /// slots, and distinct among the sequences that have rows.
    pub state_slots: &'a [i64],
}

/// One sequence of a call that has rows.
#[derive(Clone, Debug)]
struct Seq {
    rows: Range<usize>,
    slot: usize,
}

/// The sequences of `packed` that have rows, checked against `tokens` rows
/// and `slots` state slots.
fn sequences(packed: Packed<'_>, tokens: usize, slots: usize) -> CoreResult<Vec<Seq>> {
    let (qsl, ids) = (packed.query_start_loc, packed.state_slots);
    if qsl.len() != ids.len() + 1 {
        return Err(CoreError::invalid(format!(
            "query_start_loc: expected num_seqs + 1 = {} entries (state_slots has {}), got {}",
            ids.len() + 1,
            ids.len(),
            qsl.len()
        )));
    }
    if qsl[0] != 0 || qsl[ids.len()] as i64 != tokens as i64 {
        return Err(CoreError::invalid(format!(
            "query_start_loc: must run from 0 to the {tokens} rows, got {}..{}",
            qsl[0],
            qsl[ids.len()]
        )));
    }
    let mut seqs = Vec::with_capacity(ids.len());
    for (i, (w, &slot)) in qsl.windows(2).zip(ids).enumerate() {
        if w[1] < w[0] {
            return Err(CoreError::invalid(format!(
                "query_start_loc: must not decrease, got {} then {} at sequence {i}",
                w[0], w[1]
            )));
        }
        if slot < 0 || slot as u64 >= slots as u64 {
            return Err(CoreError::invalid(format!(
                "state_slots: slot {slot} of sequence {i} is outside the {slots} slots of the state"
            )));
        }
        if w[1] > w[0] {
            seqs.push(Seq {
                rows: w[0] as usize..w[1] as usize,
                slot: slot as usize,
            });
        }
    }
    let mut used: Vec<usize> = seqs.iter().map(|s| s.slot).collect();
    used.sort_unstable();
    if let Some(w) = used.windows(2).find(|w| w[0] == w[1]) {
        return Err(CoreError::invalid(format!(
            "state_slots: slot {} is used by two sequences with rows",
            w[0]
        )));
    }
    Ok(seqs)
}

/// Runs `f(0..tasks)` on the team, or on this thread when the call has
/// fewer than `SERIAL_WORK` multiply-adds; a panic (a bug) becomes an error.
/// Each task runs with subnormal floats flushed to zero (`flush_subnormals`).
fn run_tasks(tasks: usize, work: usize, f: impl Fn(usize) + Sync) -> CoreResult<()> {
    let f = |i: usize| flush_subnormals(|| f(i));
    if work < SERIAL_WORK || crate::cpu::threads::num_threads() <= 1 {
        return crate::cpu::threads::team_run(1, &|_| (0..tasks).for_each(f));
    }
    crate::cpu::threads::team_run(tasks, &f)
}

/// Runs `f` with the SSE/AVX unit flushing subnormal results and inputs to
/// zero (MXCSR's FTZ and DAZ bits), then restores the thread's setting.
///
/// A strongly decaying state (Gated DeltaNet's `exp(g)` over many rows, the
/// chunked form's pairwise decays) produces values below 1e-38, and x86 runs
/// arithmetic on those subnormals about ten times slower: a 512-row prefill
/// went from 6 ms to 50-90 ms with decays of `exp(-10)` per row. Flushed,
/// they are the zero they round to anyway at this scale.
fn flush_subnormals<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        const FTZ_DAZ: u32 = 0x8040;
        let mut old: u32 = 0;
        // SAFETY: stmxcsr / ldmxcsr read and write this thread's MXCSR
        // through a valid pointer; only the FTZ and DAZ bits change, which
        // affect nothing but the rounding of subnormal values.
        unsafe {
            core::arch::asm!("stmxcsr [{}]", in(reg) &mut old, options(nostack));
            let new = old | FTZ_DAZ;
            core::arch::asm!("ldmxcsr [{}]", in(reg) &new, options(nostack, readonly));
        }
        let out = f();
        // SAFETY: as above, restoring the value read.
        unsafe {
            core::arch::asm!("ldmxcsr [{}]", in(reg) &old, options(nostack, readonly));
        }
        out
    }
    #[cfg(not(target_arch = "x86_64"))]
    f()
}

fn expect_len(what: &str, got: usize, dims: &[usize], names: &str) -> CoreResult<()> {
    let want = dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| CoreError::invalid(format!("{what}: size {names} overflows")))?;
    if got != want {
        return Err(CoreError::invalid(format!(
            "{what}: expected {names} = {dims:?} = {want} elements, got {got}"
        )));
    }
    Ok(())
}

/// The shapes of a [`causal_conv1d`] call.
#[derive(Clone, Copy, Debug)]
pub struct ConvShape {
    /// Rows of `x` and `out`.
    pub tokens: usize,
    pub channels: usize,
    /// Taps per channel, `K` (2..=[`MAX_CONV_WIDTH`]).
    pub width: usize,
    /// State slots (the first dimension of the state).
    pub slots: usize,
}

/// Depthwise causal convolution of packed sequences: `x`, `out`
/// `[tokens, channels]`, `weight` `[channels, width]`, `bias` `[channels]`,
/// `state` `[slots, channels, width - 1]` (the last inputs before the call,
/// oldest first; updated in place), one dtype. `out[t, c] = bias[c] +
/// sum_j weight[c, j] xin[t - (width - 1) + j, c]` over the sequence's state
/// followed by its rows, in f32, then SiLU (`y sigmoid(y)`) when `silu`,
/// rounded once.
#[allow(clippy::too_many_arguments)]
pub fn causal_conv1d(
    out: Dst<'_>,
    x: Src<'_>,
    weight: Src<'_>,
    bias: Option<Src<'_>>,
    state: Dst<'_>,
    packed: Packed<'_>,
    shape: ConvShape,
    silu: bool,
) -> CoreResult<()> {
    let path = best_path();
    causal_conv1d_on(path, out, x, weight, bias, state, packed, shape, silu)
}

/// [`causal_conv1d`] on a chosen path (tests run every path).
#[allow(clippy::too_many_arguments)]
fn causal_conv1d_on(
    path: Path,
    out: Dst<'_>,
    x: Src<'_>,
    weight: Src<'_>,
    bias: Option<Src<'_>>,
    state: Dst<'_>,
    packed: Packed<'_>,
    shape: ConvShape,
    silu: bool,
) -> CoreResult<()> {
    let ConvShape {
        tokens,
        channels: c,
        width,
        slots,
    } = shape;
    if !(2..=MAX_CONV_WIDTH).contains(&width) {
        return Err(CoreError::invalid(format!(
            "weight: kernel width must be 2..={MAX_CONV_WIDTH}, got {width}"
        )));
    }
    expect_len("x", x.len(), &[tokens, c], "[tokens, channels]")?;
    expect_len("out", out.len(), &[tokens, c], "[tokens, channels]")?;
    expect_len("weight", weight.len(), &[c, width], "[channels, width]")?;
    if let Some(b) = &bias {
        expect_len("bias", b.len(), &[c], "[channels]")?;
    }
    let keep = width - 1;
    expect_len(
        "conv_state",
        state.len(),
        &[slots, c, keep],
        "[slots, channels, width - 1]",
    )?;
    let seqs = sequences(packed, tokens, slots)?;
    let args = ConvArgs {
        seqs: &seqs,
        shape,
        silu,
        path,
    };
    let bias_dtype = || CoreError::invalid("bias: must have the dtype of x");
    match (out, x, weight, state) {
        (Dst::F32(o), Src::F32(x), Src::F32(w), Dst::F32(s)) => {
            let b = match bias {
                None => None,
                Some(Src::F32(b)) => Some(b),
                Some(_) => return Err(bias_dtype()),
            };
            conv_rows(o, x, w, b, s, args)
        }
        (Dst::Bf16(o), Src::Bf16(x), Src::Bf16(w), Dst::Bf16(s)) => {
            let b = match bias {
                None => None,
                Some(Src::Bf16(b)) => Some(b),
                Some(_) => return Err(bias_dtype()),
            };
            conv_rows(o, x, w, b, s, args)
        }
        _ => Err(CoreError::invalid(
            "x, weight, conv_state and out must share one dtype",
        )),
    }
}

struct ConvArgs<'a> {
    seqs: &'a [Seq],
    shape: ConvShape,
    silu: bool,
    path: Path,
}

fn conv_rows<T: Element>(
    out: &mut [T],
    x: &[T],
    weight: &[T],
    bias: Option<&[T]>,
    state: &mut [T],
    args: ConvArgs<'_>,
) -> CoreResult<()> {
    let ConvShape {
        channels, width, ..
    } = args.shape;
    let blocks = channels.div_ceil(conv::BLOCK);
    let tasks = args.seqs.len() * blocks;
    let rows: usize = args.seqs.iter().map(|s| s.rows.len()).sum();
    let (out_p, state_p) = (SharedOut(out.as_mut_ptr()), SharedOut(state.as_mut_ptr()));
    let path = args.path;
    run_tasks(tasks, rows * channels * width, |i| {
        let seq = &args.seqs[i / blocks];
        let c0 = (i % blocks) * conv::BLOCK;
        let cb = conv::BLOCK.min(channels - c0);
        let keep = width - 1;
        // SAFETY: the block's channels of the sequence's slot, contiguous in
        // `[slots, channels, keep]`: slots are distinct among the sequences
        // (`sequences`) and blocks disjoint, so no other task touches them.
        let st = unsafe {
            let at = (seq.slot * channels + c0) * keep;
            std::slice::from_raw_parts_mut(state_p.ptr().add(at), cb * keep)
        };
        let task = conv::ConvTask {
            x,
            out: out_p.ptr(),
            weight,
            bias,
            state: st,
            rows: seq.rows.clone(),
            c0,
            cb,
            channels,
            width,
            silu: args.silu,
        };
        dispatch(path, task);
    })
}

/// The shapes of a [`gated_delta_rule`] call.
#[derive(Clone, Copy, Debug)]
pub struct DeltaShape {
    pub tokens: usize,
    /// Query / key heads `Hk`, and value heads `Hv` (a multiple of `Hk`:
    /// value head `h` reads query / key head `h / (Hv / Hk)`).
    pub k_heads: usize,
    pub v_heads: usize,
    /// Head sizes `Dk` (queries, keys) and `Dv` (values).
    pub k_dim: usize,
    pub v_dim: usize,
    /// State slots (the first dimension of the state).
    pub slots: usize,
}

/// Which form of the delta rule a sequence runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// Recurrent below [`CHUNKED_MIN_ROWS`] rows, chunked from there.
    Auto,
    /// Row after row.
    Recurrent,
    /// 64 rows at a time (UT transform and matrix products).
    Chunked,
}

/// What a row adds to the state after its decay `S = e^g S`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// Gated DeltaNet: `S += k (beta (v - S^T k))^T`, the value corrected by
    /// what the state already recalls for the key.
    Delta,
    /// Mamba-2's SSD (the scalar-decay selective state space): `S += beta k v^T`,
    /// with `k` = B, `v` = x, `beta` = dt, `g` = dt A and `q` = C.
    Linear,
}

/// How [`gated_delta_rule_with`] runs (tests and benches choose; the
/// default is what [`gated_delta_rule`] does).
#[derive(Clone, Copy, Debug)]
pub struct DeltaOptions {
    pub path: Path,
    pub form: Form,
    /// The update rule (default [`Rule::Delta`]).
    pub rule: Rule,
    /// Blocks of state columns per (sequence, head); 0 picks: more than one
    /// only when there are fewer (sequence, head) pairs than threads.
    pub column_blocks: usize,
}

impl Default for DeltaOptions {
    fn default() -> Self {
        DeltaOptions {
            path: best_path(),
            form: Form::Auto,
            rule: Rule::Delta,
            column_blocks: 0,
        }
    }
}

/// The tensors of a [`gated_delta_rule`] call: `q`, `k` `[tokens, Hk, Dk]`
/// and `v` `[tokens, Hv, Dv]` of one dtype, `g` (log decay, <= 0) and `beta`
/// `[tokens, Hv]` f32.
#[derive(Clone, Copy, Debug)]
pub struct DeltaInputs<'a> {
    pub q: Src<'a>,
    pub k: Src<'a>,
    pub v: Src<'a>,
    pub g: &'a [f32],
    pub beta: &'a [f32],
}

/// The gated delta rule over packed sequences, in f32: per sequence and
/// value head, with `q`, `k` L2-normalised when `l2norm` (`x / sqrt(sum x^2
/// + 1e-6)`) and `q` scaled by `scale`, for each row `S = e^g S`,
/// `delta = beta (v - S^T k)`, `S += k delta^T`, `out = S^T q`. `state`
/// `[slots, Hv, Dk, Dv]` f32 holds each slot's `S` (updated in place); `out`
/// `[tokens, Hv, Dv]` has `v`'s dtype. ([`Rule::Linear`] through
/// [`gated_delta_rule_with`]: `S += beta k v^T` in place of the delta step.)
pub fn gated_delta_rule(
    out: Dst<'_>,
    inputs: DeltaInputs<'_>,
    state: &mut [f32],
    packed: Packed<'_>,
    shape: DeltaShape,
    scale: f32,
    l2norm: bool,
) -> CoreResult<()> {
    let opts = DeltaOptions::default();
    gated_delta_rule_with(out, inputs, state, packed, shape, scale, l2norm, opts)
}

/// [`gated_delta_rule`] on a chosen path and form.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule_with(
    out: Dst<'_>,
    inputs: DeltaInputs<'_>,
    state: &mut [f32],
    packed: Packed<'_>,
    shape: DeltaShape,
    scale: f32,
    l2norm: bool,
    opts: DeltaOptions,
) -> CoreResult<()> {
    let DeltaShape {
        tokens,
        k_heads: hk,
        v_heads: hv,
        k_dim: dk,
        v_dim: dv,
        slots,
    } = shape;
    if hk == 0 || dk == 0 || dv == 0 || !hv.is_multiple_of(hk) {
        return Err(CoreError::invalid(format!(
            "v: {hv} value heads must be a multiple of the {hk} query/key heads, head sizes \
             positive (got {dk}, {dv})"
        )));
    }
    let DeltaInputs { q, k, v, g, beta } = inputs;
    expect_len("q", q.len(), &[tokens, hk, dk], "[tokens, k_heads, k_dim]")?;
    expect_len("k", k.len(), &[tokens, hk, dk], "[tokens, k_heads, k_dim]")?;
    expect_len("v", v.len(), &[tokens, hv, dv], "[tokens, v_heads, v_dim]")?;
    expect_len("g", g.len(), &[tokens, hv], "[tokens, v_heads]")?;
    expect_len("beta", beta.len(), &[tokens, hv], "[tokens, v_heads]")?;
    expect_len(
        "out",
        out.len(),
        &[tokens, hv, dv],
        "[tokens, v_heads, v_dim]",
    )?;
    expect_len(
        "state",
        state.len(),
        &[slots, hv, dk, dv],
        "[slots, v_heads, k_dim, v_dim]",
    )?;
    if !opts.path.is_available() {
        return Err(CoreError::invalid(format!(
            "path: {} is not available on this CPU",
            opts.path.name()
        )));
    }
    let seqs = sequences(packed, tokens, slots)?;
    let run = DeltaRun {
        seqs: &seqs,
        shape,
        scale,
        l2norm,
        opts,
    };
    match (out, q, k, v) {
        (Dst::F32(o), Src::F32(q), Src::F32(k), Src::F32(v)) => {
            run.rows(o, q, k, v, g, beta, state)
        }
        (Dst::Bf16(o), Src::Bf16(q), Src::Bf16(k), Src::Bf16(v)) => {
            run.rows(o, q, k, v, g, beta, state)
        }
        _ => Err(CoreError::invalid("q, k, v and out must share one dtype")),
    }
}

/// One [`gated_delta_rule_with`] call, checked.
struct DeltaRun<'a> {
    seqs: &'a [Seq],
    shape: DeltaShape,
    scale: f32,
    l2norm: bool,
    opts: DeltaOptions,
}

impl DeltaRun<'_> {
    /// `(blocks, width)`: the state columns of each (sequence, head) in
    /// `blocks` tasks of `width` columns (a multiple of 16 but the last).
    fn column_blocks(&self) -> (usize, usize) {
        let dv = self.shape.v_dim;
        let pairs = (self.seqs.len() * self.shape.v_heads).max(1);
        let want = match self.opts.column_blocks {
            0 => crate::cpu::threads::num_threads()
                .div_ceil(pairs)
                .min(dv / 32)
                .max(1),
            b => b.min(dv),
        };
        let width = dv.div_ceil(want).next_multiple_of(16).min(dv);
        (dv.div_ceil(width), width)
    }

    #[allow(clippy::too_many_arguments)]
    fn rows<T: Element>(
        &self,
        out: &mut [T],
        q: &[T],
        k: &[T],
        v: &[T],
        g: &[f32],
        beta: &[f32],
        state: &mut [f32],
    ) -> CoreResult<()> {
        let DeltaShape {
            k_heads,
            v_heads: hv,
            k_dim: dk,
            v_dim: dv,
            ..
        } = self.shape;
        let inputs = delta::Inputs {
            q,
            k,
            v,
            g,
            beta,
            k_heads,
            v_heads: hv,
            k_dim: dk,
            v_dim: dv,
            scale: self.scale,
            l2norm: self.l2norm,
            delta: self.opts.rule == Rule::Delta,
        };
        let (blocks, width) = self.column_blocks();
        let tasks = self.seqs.len() * hv * blocks;
        let rows: usize = self.seqs.iter().map(|s| s.rows.len()).sum();
        let (out_p, state_p) = (SharedOut(out.as_mut_ptr()), SharedOut(state.as_mut_ptr()));
        run_tasks(tasks, rows * hv * dk * dv, |i| {
            let (pair, b) = (i / blocks, i % blocks);
            let (seq, head) = (&self.seqs[pair / hv], pair % hv);
            let j0 = b * width;
            let n = width.min(dv - j0);
            // SAFETY: columns j0..j0 + n of this head's `dk x dv` matrix in
            // the sequence's slot: slots are distinct among the sequences
            // (`sequences`), heads and column blocks disjoint, so no other
            // task touches them; `state` holds every slot (checked).
            let s = unsafe {
                let at = (seq.slot * hv + head) * dk * dv + j0;
                mat::MatMut::from_raw(state_p.ptr().add(at), dk, n, dv)
            };
            let chunked = match self.opts.form {
                Form::Auto => seq.rows.len() >= CHUNKED_MIN_ROWS,
                f => f == Form::Chunked,
            };
            let part = delta::Part {
                inputs: &inputs,
                out: out_p.ptr(),
                rows: seq.rows.clone(),
                head,
                j0,
            };
            let task = delta::DeltaTask {
                part,
                state: s,
                chunked,
            };
            dispatch(self.opts.path, task);
        })
    }
}

//! The decoder layers of the Llama family (Llama, Mistral, Qwen2, Qwen3, Phi-3) in
//! one call per step: the Rust twin of `python/fastllm/models/llama.py`
//! (`models/llama_stack.py` hands it the weights; `tests/test_decoder_stack.py`
//! checks both paths agree on every Llama-family config).
//!
//! A batch-1 decode step of a small model is a few hundred kernel calls of
//! 5-150 µs each. Made one by one from Python, every call pays for the
//! interpreter, the tensor checks of its binding and torch's allocator: on a
//! 0.5B model about 2 ms of a 12 ms step. [`decoder_stack`] runs every layer
//! of the model, in order, with the same kernels and the same roundings as
//! the layer-by-layer path (`layers/ops.py`), so both give bit-identical
//! hidden states:
//!
//! ```text
//! h = rms_norm(x) ; qkv = h W_qkv (+ bias) ; [q, k per-head rms_norm]
//! q, k, v = split + rotary ; cache <- k, v ; a = paged_attention(q)
//! x = x + a W_o ; h = rms_norm(x) ; x = x + silu_and_mul(h W_gate_up) W_down
//! ```
//!
//! or, in a mixture-of-experts layer (Qwen3-MoE, Mixtral), `x = x + moe(h)`
//! with the router, routing and grouped experts of `moe::SparseMlp`.
//!
//! A layer's mixer may instead be LFM2's short convolution ([`ShortConv`]):
//!
//! ```text
//! b, c, v = h W_in ; y = causal_conv1d(b * v, state) ; x = x + (c * y) W_out
//! ```
//!
//! where every `+` and `*` rounds to the element type, as torch's does; or
//! Qwen3.5's Gated DeltaNet ([`DeltaNet`]):
//!
//! ```text
//! qkv, z, b, a = h W_in ; q, k, v = silu(causal_conv1d(qkv, state))
//! o = gated_delta_rule(l2norm(q), l2norm(k), v, g(a), sigmoid(b), S)
//! x = x + (rms_norm(o) * silu(z)) W_out
//! ```
//!
//! or Granite 4.0's Mamba-2 ([`Mamba2`]):
//!
//! ```text
//! z, xBC, dt = h W_in ; x, B, C = silu(causal_conv1d(xBC, state) + bias)
//! y = scan(x, B, C, dt) (the delta rule's linear rule) ; x = x + norm((y + D x) silu(z)) W_out
//! ```
//!
//! Qwen3.5's attention layers add an output gate (`Attention::gate`: the
//! attention output times `sigmoid(gate)`, the gate projected beside each
//! query head), and its norms scale by `1 + w` in f32 ([`NormWeight::Float`]).
//!
//! Gemma 2 and 3 normalise the mixer's and the MLP's outputs before their
//! residual adds (`DecoderLayer::mixer_out_norm`, `mlp_out_norm`), gate the
//! MLP with the tanh GELU (`Mlp::Dense::act`), soft-cap attention scores
//! (`Attention::softcap`), rotate their local layers by their own tables
//! (`Attention::local_rotary`) and keep those layers' blocks in a KV group
//! of their own (`Attention::group`, `StepInputs::groups`). Layers of
//! different groups share cache tensors (at distinct blocks), so the stack
//! reads its layers one at a time ([`Layers`]).

use crate::attention::{cache_and_attend, BatchLayout, CacheShape, KvCacheMut};
use crate::cpu::Element;
use crate::cpu::{Dst, Src};
use crate::error::{CoreError, CoreResult};
use crate::layers::{
    delta_gates, gated_act, gated_rms_norm, mamba_gates, mamba_norm, qkv_rotary, rms_norm,
    sigmoid_mul, GatedAct, QkvShape,
};
use crate::linear::LinearWeight;
use crate::moe::SparseMlp;
use crate::recurrent::{
    causal_conv1d, gated_delta_rule, gated_delta_rule_with, ConvShape, DeltaInputs, DeltaOptions,
    DeltaShape, Packed, Rule, MAX_CONV_WIDTH,
};

/// The sizes every layer of a model shares.
#[derive(Clone, Copy, Debug)]
pub struct DecoderShape {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Rotated pairs per head (`rotary_dim / 2`).
    pub rotary_half: usize,
    pub intermediate: usize,
    /// RMSNorm epsilon (the layer norms and the q/k norms).
    pub eps: f32,
    /// Attention score scale (`head_dim ** -0.5`).
    pub scale: f32,
    /// Factor on each residual branch before it is added (Granite's
    /// `residual_multiplier`; 1: a plain sum).
    pub residual_scale: f32,
}

impl DecoderShape {
    fn qkv_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }
}

/// One decoder layer's weights, and its KV cache or recurrent state.
pub struct DecoderLayer<'a, T> {
    /// The norms before the mixer and before the MLP (None: OLMo 2's
    /// layers, which normalise only their outputs).
    pub input_norm: Option<NormWeight<'a, T>>,
    pub post_norm: Option<NormWeight<'a, T>>,
    /// Gemma's norms of the mixer's and the MLP's outputs, before each is
    /// added to the residual.
    pub mixer_out_norm: Option<NormWeight<'a, T>>,
    pub mlp_out_norm: Option<NormWeight<'a, T>>,
    pub mixer: Mixer<'a, T>,
    pub mlp: Mlp<'a>,
}

/// Where [`decoder_stack`] finds its layers: one at a time, so that no two
/// layers' views of a shared cache tensor are alive together.
pub trait Layers<T> {
    /// The number of layers.
    fn count(&self) -> usize;
    /// Runs `f` on layer `i`.
    fn with<R>(
        &mut self,
        i: usize,
        f: impl FnOnce(&mut DecoderLayer<'_, T>) -> CoreResult<R>,
    ) -> CoreResult<R>;
}

impl<'a, T> Layers<T> for [DecoderLayer<'a, T>] {
    fn count(&self) -> usize {
        self.len()
    }

    fn with<R>(
        &mut self,
        i: usize,
        f: impl FnOnce(&mut DecoderLayer<'_, T>) -> CoreResult<R>,
    ) -> CoreResult<R> {
        f(&mut self[i])
    }
}

/// An RMSNorm's weight: in the element type (`w * round(x / rms)`, two
/// roundings, as Llama's norm), or f32 (`round(w * (x / rms))` in f32:
/// Qwen3.5's norms, whose `1 + w` the caller computed in f32).
pub enum NormWeight<'a, T> {
    Model(&'a [T]),
    Float(&'a [f32]),
}

impl<T> Clone for NormWeight<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for NormWeight<'_, T> {}

impl<T> NormWeight<'_, T> {
    fn len(&self) -> usize {
        match self {
            NormWeight::Model(w) => w.len(),
            NormWeight::Float(w) => w.len(),
        }
    }
}

/// What mixes a layer's tokens: paged attention, LFM2's short convolution,
/// Qwen3.5's Gated DeltaNet or Granite 4.0's Mamba-2.
pub enum Mixer<'a, T> {
    Attention(Attention<'a, T>),
    ShortConv(ShortConv<'a, T>),
    DeltaNet(DeltaNet<'a, T>),
    Mamba2(Mamba2<'a, T>),
}

/// An attention mixer's weights and KV cache.
pub struct Attention<'a, T> {
    /// Qwen3's per-head RMSNorm of q and k (both or neither): weights of
    /// `head_dim`, or of the whole projection (`heads * head_dim`, and
    /// `kv_heads * head_dim` for k: OLMo 2's).
    pub qk_norm: Option<(NormWeight<'a, T>, NormWeight<'a, T>)>,
    /// Qwen3.5's output gate: `qkv` projects each query head followed by
    /// its gate (`2 * heads * head_dim` rows, then k and v), and the
    /// attention output is multiplied by `round(sigmoid(gate))` before `o`.
    pub gate: bool,
    pub qkv: &'a LinearWeight,
    pub o: &'a LinearWeight,
    /// Float rows of `T`, or 8-bit rows with their scales (`kv_cache_dtype="int8"`).
    pub key_cache: KvCacheMut<'a, T>,
    pub value_cache: KvCacheMut<'a, T>,
    /// Keys within this many positions, or 0 for all.
    pub sliding_window: i64,
    /// Score soft-cap `c * tanh(s / c)` (Gemma 2), or 0 for none.
    pub softcap: f32,
    /// The layer's KV group: 0 reads the step's `slot_mapping` and block
    /// tables, `g > 0` those of `StepInputs::groups[g - 1]`.
    pub group: usize,
    /// Rotated by the step's local tables (`cos_local`, `sin_local`: Gemma
    /// 3's local layers) instead of `cos`, `sin`.
    pub local_rotary: bool,
    /// Whether q and k rotate at all (false: SmolLM3's NoPE layers, whose
    /// positions come from the causal mask alone).
    pub rotary: bool,
    /// gpt-oss's attention sinks: one logit per query head that joins the
    /// softmax's denominator (`paged_attention`), or None.
    pub sinks: Option<&'a [f32]>,
}

/// LFM2's short-convolution mixer: `in_proj` [3H, H] (b, c and v rows),
/// a depthwise causal convolution of `taps` (`weight` [H, taps], optional
/// `bias` [H]) whose last `taps - 1` inputs per sequence live in `state`
/// ([slots, H, taps - 1], the slot of each sequence given per step), and
/// `out_proj` [H, H].
pub struct ShortConv<'a, T> {
    pub in_proj: &'a LinearWeight,
    pub weight: &'a [T],
    pub bias: Option<&'a [T]>,
    pub out_proj: &'a LinearWeight,
    pub state: &'a mut [T],
    pub taps: usize,
}

impl<T> ShortConv<'_, T> {
    /// The state slots `state` holds (each `hidden * (taps - 1)` values;
    /// `check_layer` has checked `taps >= 2`).
    fn slots(&self, hidden: usize) -> usize {
        self.state.len() / (hidden * (self.taps - 1))
    }
}

/// The head counts and sizes of a Gated DeltaNet layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaHeads {
    /// Query / key heads and their size.
    pub k_heads: usize,
    pub k_dim: usize,
    /// Value heads (a multiple of `k_heads`) and their size.
    pub v_heads: usize,
    pub v_dim: usize,
    /// Taps of the q/k/v convolution.
    pub taps: usize,
}

impl DeltaHeads {
    fn key_dim(&self) -> usize {
        self.k_heads * self.k_dim
    }

    fn value_dim(&self) -> usize {
        self.v_heads * self.v_dim
    }

    /// Channels of the convolution: q, k and v.
    fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// Rows of `in_proj`: q, k, v, then z, b and a.
    fn in_width(&self) -> usize {
        self.conv_dim() + self.value_dim() + 2 * self.v_heads
    }

    /// Elements of one slot of the convolution state and of the delta-rule state.
    fn slot_sizes(&self) -> (usize, usize) {
        (
            self.conv_dim() * self.taps.saturating_sub(1),
            self.v_heads * self.k_dim * self.v_dim,
        )
    }
}

/// Qwen3.5's Gated DeltaNet mixer: `in_proj` [conv_dim + value_dim + 2 Hv,
/// H] (q, k, v, z, b, a), the q/k/v convolution (`conv_weight` [conv_dim,
/// taps], no bias, SiLU) with its `conv_state` ([slots, conv_dim, taps -
/// 1]), the gates' `a_log` and `dt_bias` ([Hv], f32), the delta rule's
/// `state` ([slots, Hv, Dk, Dv], f32), the gated head norm's `norm` [Dv]
/// and `out_proj` [H, value_dim].
pub struct DeltaNet<'a, T> {
    pub in_proj: &'a LinearWeight,
    pub conv_weight: &'a [T],
    pub conv_state: &'a mut [T],
    pub a_log: &'a [f32],
    pub dt_bias: &'a [f32],
    pub norm: &'a [T],
    pub out_proj: &'a LinearWeight,
    pub state: &'a mut [f32],
    pub heads: DeltaHeads,
}

impl<T> DeltaNet<'_, T> {
    /// The state slots (`check_layer` has checked both states hold as many).
    fn slots(&self) -> usize {
        self.state.len() / self.heads.slot_sizes().1.max(1)
    }
}

/// The head counts and sizes of a Mamba-2 layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MambaHeads {
    /// Heads and their channels (`inner = heads x head_dim`).
    pub heads: usize,
    pub head_dim: usize,
    /// Groups of B and C (the heads of a group share them) and their size.
    pub groups: usize,
    pub d_state: usize,
    /// Taps of the x/B/C convolution.
    pub taps: usize,
}

impl MambaHeads {
    fn inner(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Channels of the convolution: x, B and C.
    fn conv_dim(&self) -> usize {
        self.inner() + 2 * self.groups * self.d_state
    }

    /// Rows of `in_proj`: z, then x, B, C, then dt.
    fn in_width(&self) -> usize {
        self.inner() + self.conv_dim() + self.heads
    }

    /// Elements of one slot of the convolution state and of the scan's state.
    fn slot_sizes(&self) -> (usize, usize) {
        (
            self.conv_dim() * self.taps.saturating_sub(1),
            self.heads * self.d_state * self.head_dim,
        )
    }
}

/// Granite 4.0's Mamba-2 mixer: `in_proj` [inner + conv_dim + heads, H]
/// (z, x/B/C, dt; its bias inside), the x/B/C convolution (`conv_weight`
/// [conv_dim, taps], `conv_bias`, SiLU) with its `conv_state` ([slots,
/// conv_dim, taps - 1]), the time steps' `a_log`, `dt_bias` and the skip
/// `d` ([heads], f32) clamped to `dt_limit`, the scan's `state` ([slots,
/// heads, d_state, head_dim], f32), the gated group norm's `norm` [inner]
/// and `out_proj` [H, inner].
pub struct Mamba2<'a, T> {
    pub in_proj: &'a LinearWeight,
    pub conv_weight: &'a [T],
    pub conv_bias: Option<&'a [T]>,
    pub conv_state: &'a mut [T],
    pub a_log: &'a [f32],
    pub dt_bias: &'a [f32],
    pub d: &'a [f32],
    pub dt_limit: (f32, f32),
    pub norm: &'a [T],
    pub out_proj: &'a LinearWeight,
    pub state: &'a mut [f32],
    pub heads: MambaHeads,
}

impl<T> Mamba2<'_, T> {
    /// The state slots (`check_layer` has checked both states hold as many).
    fn slots(&self) -> usize {
        self.state.len() / self.heads.slot_sizes().1.max(1)
    }
}

/// A layer's MLP: Llama's gated SiLU MLP (gate/up fused), or a mixture of
/// experts (Qwen3-MoE, Mixtral: `moe::SparseMlp`).
#[derive(Clone, Copy)]
pub enum Mlp<'a> {
    Dense {
        gate_up: &'a LinearWeight,
        down: &'a LinearWeight,
        /// `GatedAct::Silu` (Llama) or `GatedAct::GeluTanh` (Gemma).
        act: GatedAct,
    },
    Sparse(&'a SparseMlp),
}

/// The cache slots and block tables of the layers of one KV group `g > 0`
/// (the step's `slot_mapping` and `batch.block_tables` are group 0's).
#[derive(Clone, Copy, Debug)]
pub struct KvGroup<'a> {
    pub slot_mapping: &'a [i64],
    pub block_tables: &'a [i32],
    pub max_blocks_per_seq: usize,
}

/// What one step gives every layer: rotary tables of its tokens, their
/// cache slots and where the batch's sequences live.
#[derive(Clone, Copy)]
pub struct StepInputs<'a, T> {
    /// `[tokens, rotary_half]` each.
    pub cos: &'a [T],
    pub sin: &'a [T],
    /// The tables of the layers with `local_rotary` (`cos`, `sin` when the
    /// model has one pair).
    pub cos_local: &'a [T],
    pub sin_local: &'a [T],
    pub slot_mapping: &'a [i64],
    pub batch: BatchLayout<'a>,
    /// KV groups 1, 2, ... (empty when every layer is in group 0).
    pub groups: &'a [KvGroup<'a>],
    pub cache: CacheShape,
    /// `[num_seqs]`: each sequence's recurrent-state slot (convolution and
    /// DeltaNet layers).
    pub state_slots: &'a [i64],
}

impl<T> StepInputs<'_, T> {
    /// The step's sequences as the recurrent kernels take them: row offsets
    /// and state slots.
    fn packed(&self) -> Packed<'_> {
        Packed {
            query_start_loc: self.batch.query_start_loc,
            state_slots: self.state_slots,
        }
    }
}

/// A recurrent layer's convolution width against what the kernel takes.
fn check_taps(index: usize, key: &str, taps: usize) -> CoreResult<()> {
    if !(2..=MAX_CONV_WIDTH).contains(&taps) {
        return Err(CoreError::invalid(format!(
            "layers[{index}].{key}: expected 2 to {MAX_CONV_WIDTH} taps, got {taps}"
        )));
    }
    Ok(())
}

/// Checks the weights of layer `index` against the model's shape (no
/// allocation unless it fails: this runs for every layer of every step).
pub fn check_layer<T>(
    layer: &DecoderLayer<'_, T>,
    shape: &DecoderShape,
    index: usize,
) -> CoreResult<()> {
    let s = shape;
    let mut linears = Vec::with_capacity(4);
    let sizes_match = |sizes: &[(&str, usize, usize)]| -> CoreResult<()> {
        for &(name, got, want) in sizes {
            if got != want {
                return Err(CoreError::invalid(format!(
                    "layers[{index}].{name}: expected {want} elements, got {got}"
                )));
            }
        }
        Ok(())
    };
    let (q, k) = match &layer.mixer {
        Mixer::Attention(a) => {
            let gate = if a.gate { s.heads * s.head_dim } else { 0 };
            linears.push(("qkv", a.qkv, s.hidden, s.qkv_width() + gate));
            linears.push(("o", a.o, s.heads * s.head_dim, s.hidden));
            if let Some(sinks) = a.sinks {
                sizes_match(&[("sinks", sinks.len(), s.heads)])?;
            }
            a.qk_norm
                .map_or((None, None), |(q, k)| (Some(q.len()), Some(k.len())))
        }
        Mixer::DeltaNet(n) => {
            let h = n.heads;
            if h.k_heads == 0
                || h.k_dim == 0
                || h.v_dim == 0
                || !h.v_heads.is_multiple_of(h.k_heads)
            {
                return Err(CoreError::invalid(format!(
                    "layers[{index}].delta_state: {} value heads must be a positive multiple of \
                     the {} key heads, head sizes positive (got {}, {})",
                    h.v_heads, h.k_heads, h.k_dim, h.v_dim
                )));
            }
            check_taps(index, "delta_conv_weight", h.taps)?;
            linears.push(("delta_in_proj", n.in_proj, s.hidden, h.in_width()));
            linears.push(("delta_out_proj", n.out_proj, h.value_dim(), s.hidden));
            sizes_match(&[
                (
                    "delta_conv_weight",
                    n.conv_weight.len(),
                    h.conv_dim() * h.taps,
                ),
                ("delta_a_log", n.a_log.len(), h.v_heads),
                ("delta_dt_bias", n.dt_bias.len(), h.v_heads),
                ("delta_norm", n.norm.len(), h.v_dim),
            ])?;
            let (conv, delta) = h.slot_sizes();
            let slots = n.slots();
            if slots == 0 || n.state.len() != slots * delta || n.conv_state.len() != slots * conv {
                return Err(CoreError::invalid(format!(
                    "layers[{index}].delta_state: expected [slots, {}, {}, {}] and a \
                     delta_conv_state of [slots, {}, {}] with as many slots, got {} and {} elements",
                    h.v_heads,
                    h.k_dim,
                    h.v_dim,
                    h.conv_dim(),
                    h.taps - 1,
                    n.state.len(),
                    n.conv_state.len()
                )));
            }
            (None, None)
        }
        Mixer::Mamba2(m) => {
            let h = m.heads;
            if h.heads == 0
                || h.head_dim == 0
                || h.d_state == 0
                || h.groups == 0
                || !h.heads.is_multiple_of(h.groups)
            {
                return Err(CoreError::invalid(format!(
                    "layers[{index}].mamba_state: {} heads must be a positive multiple of the \
                     {} groups, sizes positive (got {}, {})",
                    h.heads, h.groups, h.d_state, h.head_dim
                )));
            }
            check_taps(index, "mamba_conv_weight", h.taps)?;
            linears.push(("mamba_in_proj", m.in_proj, s.hidden, h.in_width()));
            linears.push(("mamba_out_proj", m.out_proj, h.inner(), s.hidden));
            let conv = h.conv_dim();
            sizes_match(&[
                ("mamba_conv_weight", m.conv_weight.len(), conv * h.taps),
                (
                    "mamba_conv_bias",
                    m.conv_bias.map_or(conv, |b| b.len()),
                    conv,
                ),
                ("mamba_a_log", m.a_log.len(), h.heads),
                ("mamba_dt_bias", m.dt_bias.len(), h.heads),
                ("mamba_d", m.d.len(), h.heads),
                ("mamba_norm", m.norm.len(), h.inner()),
            ])?;
            let (conv_slot, scan_slot) = h.slot_sizes();
            let slots = m.slots();
            if slots == 0
                || m.state.len() != slots * scan_slot
                || m.conv_state.len() != slots * conv_slot
            {
                return Err(CoreError::invalid(format!(
                    "layers[{index}].mamba_state: expected [slots, {}, {}, {}] and a \
                     mamba_conv_state of [slots, {conv}, {}] with as many slots, got {} and {} \
                     elements",
                    h.heads,
                    h.d_state,
                    h.head_dim,
                    h.taps - 1,
                    m.state.len(),
                    m.conv_state.len()
                )));
            }
            (None, None)
        }
        Mixer::ShortConv(c) => {
            linears.push(("conv_in_proj", c.in_proj, s.hidden, 3 * s.hidden));
            linears.push(("conv_out_proj", c.out_proj, s.hidden, s.hidden));
            let taps = c.taps;
            sizes_match(&[
                ("conv_weight", c.weight.len(), s.hidden * taps),
                ("conv_bias", c.bias.map_or(s.hidden, |b| b.len()), s.hidden),
            ])?;
            let per_slot = s.hidden * taps.saturating_sub(1);
            if taps < 2 || per_slot == 0 || !c.state.len().is_multiple_of(per_slot) {
                return Err(CoreError::invalid(format!(
                    "layers[{index}].conv_state: expected [slots, {}, {}] elements, got {} \
                     (taps {taps})",
                    s.hidden,
                    taps.saturating_sub(1),
                    c.state.len()
                )));
            }
            (None, None)
        }
    };
    match layer.mlp {
        Mlp::Dense { gate_up, down, .. } => {
            linears.push(("gate_up", gate_up, s.hidden, 2 * s.intermediate));
            linears.push(("down", down, s.intermediate, s.hidden));
        }
        Mlp::Sparse(moe) => {
            if moe.experts.hidden() != s.hidden {
                return Err(CoreError::invalid(format!(
                    "layers[{index}].moe: experts of hidden size {}, expected {}",
                    moe.experts.hidden(),
                    s.hidden
                )));
            }
        }
    }
    for (name, w, k, n) in linears {
        if w.in_features() != k || w.out_features() != n {
            return Err(CoreError::invalid(format!(
                "layers[{index}].{name}: expected a [{n}, {k}] weight, got [{}, {}]",
                w.out_features(),
                w.in_features()
            )));
        }
    }
    let norms = [
        ("input_norm", layer.input_norm.map(|n| n.len()), s.hidden),
        ("post_norm", layer.post_norm.map(|n| n.len()), s.hidden),
        (
            "mixer_out_norm",
            layer.mixer_out_norm.map(|n| n.len()),
            s.hidden,
        ),
        (
            "mlp_out_norm",
            layer.mlp_out_norm.map(|n| n.len()),
            s.hidden,
        ),
        // Per head, or over the whole projection.
        (
            "q_norm",
            q.filter(|&n| n != s.heads * s.head_dim),
            s.head_dim,
        ),
        (
            "k_norm",
            k.filter(|&n| n != s.kv_heads * s.head_dim),
            s.head_dim,
        ),
    ];
    for (name, got, want) in norms {
        if let Some(got) = got.filter(|&g| g != want) {
            return Err(CoreError::invalid(format!(
                "layers[{index}].{name}: expected {want} elements, got {got}"
            )));
        }
    }
    Ok(())
}

/// Scratch rows of one step, reused by every layer: each buffer is sized
/// by the first layer that uses it ([`sized`]).
#[derive(Default)]
struct Scratch<T> {
    normed: Vec<T>,
    qkv: Vec<T>,
    /// A gated attention's q, k, v with the gates taken out, and its gates.
    qkv_plain: Vec<T>,
    gate: Vec<T>,
    qkv_normed: Vec<T>,
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    attn: Vec<T>,
    attn_gated: Vec<T>,
    proj: Vec<T>,
    proj_normed: Vec<T>,
    gate_up: Vec<T>,
    act: Vec<T>,
    /// The short convolution's b, c, v rows, its input and output.
    bcv: Vec<T>,
    conv_in: Vec<T>,
    conv_out: Vec<T>,
    /// A Gated DeltaNet's in_proj rows, its q, k, v, z, a, b, delta-rule
    /// output and gated norm.
    mix: Vec<T>,
    z: Vec<T>,
    a: Vec<T>,
    b: Vec<T>,
    delta_out: Vec<T>,
    delta_normed: Vec<T>,
    g: Vec<f32>,
    beta: Vec<f32>,
    /// Rows widened to f32 for a norm with f32 weights, and its output.
    wide: Vec<f32>,
    wide_out: Vec<f32>,
}

/// `buf` as exactly `n` elements (zeros where it grows).
fn sized<E: Element>(buf: &mut Vec<E>, n: usize) -> &mut [E] {
    buf.resize(n, E::from_f32(0.0));
    buf
}

/// RMSNorm of the rows (`dim` each) of `src` into `dst` with `w`: the
/// element type's kernel for a weight in it, or for f32 weights the rows
/// widened, normalised and scaled by the same kernel in f32, and rounded
/// once (`wide`, `wide_out`: scratch).
fn norm_rows<T: Element>(
    dst: &mut [T],
    src: &[T],
    w: NormWeight<'_, T>,
    eps: f32,
    dim: usize,
    wide: &mut Vec<f32>,
    wide_out: &mut Vec<f32>,
) -> CoreResult<()> {
    match w {
        NormWeight::Model(w) => rms_norm(T::dst(dst), T::src(src), T::src(w), eps, dim),
        NormWeight::Float(w) => {
            wide.clear();
            wide.extend(src.iter().map(|v| v.to_f32()));
            let out = sized(wide_out, src.len());
            rms_norm(Dst::F32(out), Src::F32(wide), Src::F32(w), eps, dim)?;
            for (d, &v) in dst.iter_mut().zip(out.iter()) {
                *d = T::from_f32(v);
            }
            Ok(())
        }
    }
}

/// `x += y` (or `x += y * m`, the product rounded first), each result
/// rounded to the element type, as torch's `x + y * m` does.
fn add_residual<T: Element>(x: &mut [T], y: &[T], m: f32) {
    if m == 1.0 {
        for (a, b) in x.iter_mut().zip(y) {
            *a = T::from_f32(a.to_f32() + b.to_f32());
        }
        return;
    }
    for (a, b) in x.iter_mut().zip(y) {
        let p = T::from_f32(b.to_f32() * m).to_f32();
        *a = T::from_f32(a.to_f32() + p);
    }
}

/// Runs `layers` in order on the hidden states `x` [tokens, hidden], in place.
pub fn decoder_stack<T: Element, L: Layers<T> + ?Sized>(
    x: &mut [T],
    layers: &mut L,
    shape: &DecoderShape,
    step: &StepInputs<'_, T>,
) -> CoreResult<()> {
    let s = *shape;
    if s.hidden == 0 || !x.len().is_multiple_of(s.hidden) {
        return Err(CoreError::invalid(format!(
            "x: expected rows of {} elements, got {} elements",
            s.hidden,
            x.len()
        )));
    }
    let tokens = x.len() / s.hidden;
    if 2 * s.rotary_half > s.head_dim {
        return Err(CoreError::invalid(format!(
            "rotary: {} rotated pairs exceed the head size {}",
            s.rotary_half, s.head_dim
        )));
    }
    check_step(step, tokens)?;
    // Every layer checked (and the recurrent states' slot count found)
    // before any runs, so a bad step changes nothing.
    let mut state_slots: Option<usize> = None;
    for i in 0..layers.count() {
        layers.with(i, |layer| {
            check_layer(layer, &s, i)?;
            let slots = match &layer.mixer {
                Mixer::ShortConv(c) => c.slots(s.hidden),
                Mixer::DeltaNet(n) => n.slots(),
                Mixer::Mamba2(m) => m.slots(),
                Mixer::Attention(a) if a.group > step.groups.len() => {
                    return Err(CoreError::invalid(format!(
                        "layers[{i}]: KV group {} but the step gives {} groups",
                        a.group,
                        step.groups.len() + 1
                    )));
                }
                Mixer::Attention(_) => return Ok(()),
            };
            state_slots = Some(state_slots.map_or(slots, |m| m.min(slots)));
            Ok(())
        })?;
    }
    if let Some(slots) = state_slots {
        check_state_slots(slots, step)?;
    }
    if tokens == 0 {
        return Ok(());
    }
    let mut b = Scratch::<T>::default();
    for i in 0..layers.count() {
        layers.with(i, |layer| run_layer(x, layer, &mut b, &s, step, tokens))?;
    }
    Ok(())
}

/// One layer on `x` [tokens, hidden], in place.
fn run_layer<T: Element>(
    x: &mut [T],
    layer: &mut DecoderLayer<'_, T>,
    b: &mut Scratch<T>,
    s: &DecoderShape,
    step: &StepInputs<'_, T>,
    tokens: usize,
) -> CoreResult<()> {
    pre_norm(b, x, layer.input_norm, s)?;
    match &mut layer.mixer {
        Mixer::Attention(a) => attention(a, b, s, step, tokens)?,
        Mixer::ShortConv(c) => short_conv(c, b, s, step, tokens)?,
        Mixer::DeltaNet(n) => delta_net(n, b, s, step, tokens)?,
        Mixer::Mamba2(m) => mamba2(m, b, s, step, tokens)?,
    }
    add_output(x, b, layer.mixer_out_norm, s)?;
    pre_norm(b, x, layer.post_norm, s)?;
    let proj = sized(&mut b.proj, tokens * s.hidden);
    match layer.mlp {
        Mlp::Dense { gate_up, down, act } => {
            let inter = s.intermediate;
            let gu = sized(&mut b.gate_up, tokens * 2 * inter);
            gate_up.forward(T::dst(gu), T::src(&b.normed), tokens)?;
            let out = sized(&mut b.act, tokens * inter);
            gated_act(T::dst(out), T::src(&b.gate_up), inter, act)?;
            down.forward(T::dst(proj), T::src(&b.act), tokens)?;
        }
        Mlp::Sparse(moe) => moe.forward(proj, &b.normed, tokens)?,
    }
    add_output(x, b, layer.mlp_out_norm, s)
}

/// `b.normed` = the norm of `x`'s rows, or `x` itself for a layer without
/// that norm.
fn pre_norm<T: Element>(
    b: &mut Scratch<T>,
    x: &[T],
    norm: Option<NormWeight<'_, T>>,
    s: &DecoderShape,
) -> CoreResult<()> {
    let normed = sized(&mut b.normed, x.len());
    match norm {
        Some(w) => norm_rows(normed, x, w, s.eps, s.hidden, &mut b.wide, &mut b.wide_out),
        None => {
            normed.copy_from_slice(x);
            Ok(())
        }
    }
}

/// `x += branch`, the branch (`b.proj`) normalised first when the layer has
/// a norm for it (Gemma's post-attention and post-feedforward norms).
fn add_output<T: Element>(
    x: &mut [T],
    b: &mut Scratch<T>,
    norm: Option<NormWeight<'_, T>>,
    s: &DecoderShape,
) -> CoreResult<()> {
    let Some(w) = norm else {
        add_residual(x, &b.proj, s.residual_scale);
        return Ok(());
    };
    let out = sized(&mut b.proj_normed, b.proj.len());
    norm_rows(
        out,
        &b.proj,
        w,
        s.eps,
        s.hidden,
        &mut b.wide,
        &mut b.wide_out,
    )?;
    add_residual(x, &b.proj_normed, s.residual_scale);
    Ok(())
}

/// Checks the step's tables: one slot per token in every group, the local
/// rotary tables as long as the others, each group's block tables whole.
fn check_step<T>(step: &StepInputs<'_, T>, tokens: usize) -> CoreResult<()> {
    let seqs = step.batch.query_start_loc.len().saturating_sub(1);
    let mappings = std::iter::once(("slot_mapping", step.slot_mapping)).chain(
        step.groups
            .iter()
            .map(|g| ("group_slot_mappings", g.slot_mapping)),
    );
    for (name, m) in mappings {
        if m.len() != tokens {
            return Err(CoreError::invalid(format!(
                "{name}: expected {tokens} entries (one per token), got {}",
                m.len()
            )));
        }
    }
    for (g, group) in step.groups.iter().enumerate() {
        if group.block_tables.len() != seqs * group.max_blocks_per_seq {
            return Err(CoreError::invalid(format!(
                "group_block_tables[{}]: expected {seqs} x {} entries, got {}",
                g + 1,
                group.max_blocks_per_seq,
                group.block_tables.len()
            )));
        }
    }
    if step.cos_local.len() != step.cos.len() || step.sin_local.len() != step.sin.len() {
        return Err(CoreError::invalid(format!(
            "cos_local, sin_local: expected {} elements each (as cos), got {} and {}",
            step.cos.len(),
            step.cos_local.len(),
            step.sin_local.len()
        )));
    }
    Ok(())
}

/// Checks the step's `state_slots` against the recurrent layers' `slots`.
fn check_state_slots<T>(slots: usize, step: &StepInputs<'_, T>) -> CoreResult<()> {
    let seqs = step.batch.query_start_loc.len().saturating_sub(1);
    if step.state_slots.len() != seqs {
        return Err(CoreError::invalid(format!(
            "state_slots: expected {seqs} entries (one per sequence), got {}",
            step.state_slots.len()
        )));
    }
    if let Some((i, &slot)) = step
        .state_slots
        .iter()
        .enumerate()
        .find(|&(_, &v)| v < 0 || v as u64 >= slots as u64)
    {
        return Err(CoreError::invalid(format!(
            "state_slots: slot {slot} of sequence {i} is outside the {slots} slots of the state"
        )));
    }
    Ok(())
}

/// An attention mixer on the step's normed rows (`b.normed`), its output
/// projection in `b.proj`.
fn attention<T: Element>(
    a: &mut Attention<'_, T>,
    b: &mut Scratch<T>,
    s: &DecoderShape,
    step: &StepInputs<'_, T>,
    tokens: usize,
) -> CoreResult<()> {
    let d = s.head_dim;
    let qkv_shape = QkvShape {
        tokens,
        heads: s.heads,
        kv_heads: s.kv_heads,
        head_dim: d,
        half: if a.rotary { s.rotary_half } else { 0 },
    };
    let width = s.qkv_width();
    let (qw, kw) = (s.heads * d, s.kv_heads * d);
    let projected = if a.gate { width + qw } else { width };
    let raw = sized(&mut b.qkv, tokens * projected);
    a.qkv.forward(T::dst(raw), T::src(&b.normed), tokens)?;
    if a.gate {
        // Each query head is followed by its gate: [q_0, g_0, q_1, g_1, ..., k, v].
        let plain = sized(&mut b.qkv_plain, tokens * width);
        let gate = sized(&mut b.gate, tokens * qw);
        for ((src, dst), g) in b
            .qkv
            .chunks_exact(projected)
            .zip(plain.chunks_exact_mut(width))
            .zip(gate.chunks_exact_mut(qw))
        {
            for ((pair, q), gh) in src[..2 * qw]
                .chunks_exact(2 * d)
                .zip(dst[..qw].chunks_exact_mut(d))
                .zip(g.chunks_exact_mut(d))
            {
                q.copy_from_slice(&pair[..d]);
                gh.copy_from_slice(&pair[d..]);
            }
            dst[qw..].copy_from_slice(&src[2 * qw..]);
        }
    }
    let plain: &[T] = if a.gate { &b.qkv_plain } else { &b.qkv };
    let qkv: &[T] = match a.qk_norm {
        None => plain,
        Some((qn, kn)) => {
            let normed = sized(&mut b.qkv_normed, tokens * width);
            for (src, dst) in plain
                .chunks_exact(width)
                .zip(normed.chunks_exact_mut(width))
            {
                let (dq, rest) = dst.split_at_mut(qw);
                let (dk, dv) = rest.split_at_mut(kw);
                let (wide, out) = (&mut b.wide, &mut b.wide_out);
                norm_rows(dq, &src[..qw], qn, s.eps, qn.len(), wide, out)?;
                norm_rows(dk, &src[qw..qw + kw], kn, s.eps, kn.len(), wide, out)?;
                dv.copy_from_slice(&src[qw + kw..]);
            }
            &b.qkv_normed
        }
    };
    let (q, k, v) = (
        sized(&mut b.q, tokens * qw),
        sized(&mut b.k, tokens * kw),
        sized(&mut b.v, tokens * kw),
    );
    let (cos, sin) = if !a.rotary {
        (&[][..], &[][..])
    } else if a.local_rotary {
        (step.cos_local, step.sin_local)
    } else {
        (step.cos, step.sin)
    };
    qkv_rotary(
        T::dst(q),
        T::dst(k),
        T::dst(v),
        T::src(qkv),
        T::src(cos),
        T::src(sin),
        qkv_shape,
    )?;
    let (slots, batch) = match a.group {
        0 => (step.slot_mapping, step.batch),
        g => {
            let group = &step.groups[g - 1];
            let batch = BatchLayout {
                block_tables: group.block_tables,
                max_blocks_per_seq: group.max_blocks_per_seq,
                ..step.batch
            };
            (group.slot_mapping, batch)
        }
    };
    let attn = sized(&mut b.attn, tokens * qw);
    cache_and_attend(
        attn,
        &b.q,
        &b.k,
        &b.v,
        &mut a.key_cache,
        &mut a.value_cache,
        slots,
        step.cache,
        s.heads,
        batch,
        s.scale,
        a.sliding_window,
        a.softcap,
        a.sinks,
    )?;
    let proj = sized(&mut b.proj, tokens * s.hidden);
    if !a.gate {
        return a.o.forward(T::dst(proj), T::src(&b.attn), tokens);
    }
    let gated = sized(&mut b.attn_gated, tokens * qw);
    sigmoid_mul(T::dst(gated), T::src(&b.attn), T::src(&b.gate))?;
    a.o.forward(T::dst(proj), T::src(&b.attn_gated), tokens)
}

/// LFM2's short convolution on the step's normed rows (`b.normed`), its
/// output projection in `b.proj`: the products rounded to `T` as torch's
/// `b * v` and `c * y` are.
fn short_conv<T: Element>(
    c: &mut ShortConv<'_, T>,
    b: &mut Scratch<T>,
    s: &DecoderShape,
    step: &StepInputs<'_, T>,
    tokens: usize,
) -> CoreResult<()> {
    let h = s.hidden;
    let bcv = sized(&mut b.bcv, tokens * 3 * h);
    c.in_proj.forward(T::dst(bcv), T::src(&b.normed), tokens)?;
    let mul = |p: T, q: T| T::from_f32(p.to_f32() * q.to_f32());
    let conv_in = sized(&mut b.conv_in, tokens * h);
    for (row, dst) in b.bcv.chunks_exact(3 * h).zip(conv_in.chunks_exact_mut(h)) {
        let (bs, vs) = (&row[..h], &row[2 * h..]);
        for ((o, &p), &q) in dst.iter_mut().zip(bs).zip(vs) {
            *o = mul(p, q);
        }
    }
    let shape = ConvShape {
        tokens,
        channels: h,
        width: c.taps,
        slots: c.slots(h),
    };
    conv_step(b, c.weight, c.bias, c.state, step.packed(), shape, false)?;
    for ((row, y), dst) in b
        .bcv
        .chunks_exact(3 * h)
        .zip(b.conv_out.chunks_exact(h))
        .zip(b.conv_in.chunks_exact_mut(h))
    {
        for ((o, &p), &q) in dst.iter_mut().zip(&row[h..2 * h]).zip(y) {
            *o = mul(p, q);
        }
    }
    let proj = sized(&mut b.proj, tokens * h);
    c.out_proj.forward(T::dst(proj), T::src(&b.conv_in), tokens)
}

/// Qwen3.5's Gated DeltaNet on the step's normed rows (`b.normed`), its
/// output projection in `b.proj`, with the kernels and roundings of the
/// layer-by-layer path (`models/hybrid.py`'s `GatedDeltaNet`).
fn delta_net<T: Element>(
    n: &mut DeltaNet<'_, T>,
    b: &mut Scratch<T>,
    s: &DecoderShape,
    step: &StepInputs<'_, T>,
    tokens: usize,
) -> CoreResult<()> {
    let h = n.heads;
    let (kd, vd, cd, hv) = (h.key_dim(), h.value_dim(), h.conv_dim(), h.v_heads);
    let width = h.in_width();
    let mix = sized(&mut b.mix, tokens * width);
    n.in_proj.forward(T::dst(mix), T::src(&b.normed), tokens)?;
    let conv_in = sized(&mut b.conv_in, tokens * cd);
    let z = sized(&mut b.z, tokens * vd);
    let gb = sized(&mut b.b, tokens * hv);
    let ga = sized(&mut b.a, tokens * hv);
    split_columns(&b.mix, tokens, &mut [conv_in, z, gb, ga]);
    let packed = step.packed();
    let slots = n.slots();
    let shape = ConvShape {
        tokens,
        channels: cd,
        width: h.taps,
        slots,
    };
    conv_step(b, n.conv_weight, None, n.conv_state, packed, shape, true)?;
    let (q, k, v) = (
        sized(&mut b.q, tokens * kd),
        sized(&mut b.k, tokens * kd),
        sized(&mut b.v, tokens * vd),
    );
    split_columns(&b.conv_out, tokens, &mut [q, k, v]);
    let (g, beta) = (
        sized(&mut b.g, tokens * hv),
        sized(&mut b.beta, tokens * hv),
    );
    delta_gates(g, beta, T::src(&b.a), T::src(&b.b), n.a_log, n.dt_bias)?;
    let out = sized(&mut b.delta_out, tokens * vd);
    gated_delta_rule(
        T::dst(out),
        DeltaInputs {
            q: T::src(&b.q),
            k: T::src(&b.k),
            v: T::src(&b.v),
            g: &b.g,
            beta: &b.beta,
        },
        n.state,
        packed,
        DeltaShape {
            tokens,
            k_heads: h.k_heads,
            v_heads: hv,
            k_dim: h.k_dim,
            v_dim: h.v_dim,
            slots,
        },
        // As Python's `head_k_dim ** -0.5`, then rounded to f32.
        (h.k_dim as f64).powf(-0.5) as f32,
        true,
    )?;
    let normed = sized(&mut b.delta_normed, tokens * vd);
    gated_rms_norm(
        T::dst(normed),
        T::src(&b.delta_out),
        T::src(&b.z),
        T::src(n.norm),
        s.eps,
        h.v_dim,
    )?;
    let proj = sized(&mut b.proj, tokens * s.hidden);
    n.out_proj
        .forward(T::dst(proj), T::src(&b.delta_normed), tokens)
}

/// The recurrent mixers' depthwise causal convolution of the step's
/// `b.conv_in` into `b.conv_out` (`shape.channels` columns), its rolling
/// inputs in `state`, SiLU after it when `silu`.
fn conv_step<T: Element>(
    b: &mut Scratch<T>,
    weight: &[T],
    bias: Option<&[T]>,
    state: &mut [T],
    packed: Packed<'_>,
    shape: ConvShape,
    silu: bool,
) -> CoreResult<()> {
    let out = sized(&mut b.conv_out, shape.tokens * shape.channels);
    causal_conv1d(
        T::dst(out),
        T::src(&b.conv_in),
        T::src(weight),
        bias.map(T::src),
        T::dst(state),
        packed,
        shape,
        silu,
    )
}

/// Splits the `tokens` rows of `src` into `parts`, in order: part `i` takes
/// the next `parts[i].len() / tokens` columns of every row.
fn split_columns<T: Copy>(src: &[T], tokens: usize, parts: &mut [&mut [T]]) {
    if tokens == 0 {
        return;
    }
    let widths: Vec<usize> = parts.iter().map(|p| p.len() / tokens).collect();
    let width: usize = widths.iter().sum();
    for (t, row) in src.chunks_exact(width).enumerate() {
        let mut at = 0;
        for (part, &w) in parts.iter_mut().zip(&widths) {
            part[t * w..(t + 1) * w].copy_from_slice(&row[at..at + w]);
            at += w;
        }
    }
}

/// Granite 4.0's Mamba-2 on the step's normed rows (`b.normed`), its output
/// projection in `b.proj`, with the kernels and roundings of the
/// layer-by-layer path (`models/hybrid.py`'s `Mamba2Mixer`).
fn mamba2<T: Element>(
    m: &mut Mamba2<'_, T>,
    b: &mut Scratch<T>,
    s: &DecoderShape,
    step: &StepInputs<'_, T>,
    tokens: usize,
) -> CoreResult<()> {
    let h = m.heads;
    let (inner, cd, heads, bc) = (h.inner(), h.conv_dim(), h.heads, h.groups * h.d_state);
    let width = h.in_width();
    let mix = sized(&mut b.mix, tokens * width);
    m.in_proj.forward(T::dst(mix), T::src(&b.normed), tokens)?;
    let z = sized(&mut b.z, tokens * inner);
    let conv_in = sized(&mut b.conv_in, tokens * cd);
    let dt = sized(&mut b.a, tokens * heads);
    split_columns(&b.mix, tokens, &mut [z, conv_in, dt]);
    let packed = step.packed();
    let slots = m.slots();
    let shape = ConvShape {
        tokens,
        channels: cd,
        width: h.taps,
        slots,
    };
    conv_step(
        b,
        m.conv_weight,
        m.conv_bias,
        m.conv_state,
        packed,
        shape,
        true,
    )?;
    let (x, bk, cq) = (
        sized(&mut b.v, tokens * inner),
        sized(&mut b.k, tokens * bc),
        sized(&mut b.q, tokens * bc),
    );
    split_columns(&b.conv_out, tokens, &mut [x, bk, cq]);
    let (g, beta) = (
        sized(&mut b.g, tokens * heads),
        sized(&mut b.beta, tokens * heads),
    );
    mamba_gates(g, beta, T::src(&b.a), m.a_log, m.dt_bias, m.dt_limit)?;
    let out = sized(&mut b.delta_out, tokens * inner);
    gated_delta_rule_with(
        T::dst(out),
        DeltaInputs {
            q: T::src(&b.q),
            k: T::src(&b.k),
            v: T::src(&b.v),
            g: &b.g,
            beta: &b.beta,
        },
        m.state,
        packed,
        DeltaShape {
            tokens,
            k_heads: h.groups,
            v_heads: heads,
            k_dim: h.d_state,
            v_dim: h.head_dim,
            slots,
        },
        1.0,
        false,
        DeltaOptions {
            rule: Rule::Linear,
            ..DeltaOptions::default()
        },
    )?;
    let normed = sized(&mut b.delta_normed, tokens * inner);
    mamba_norm(
        T::dst(normed),
        T::src(&b.delta_out),
        T::src(&b.v),
        T::src(&b.z),
        m.d,
        T::src(m.norm),
        h.groups,
        s.eps,
    )?;
    let proj = sized(&mut b.proj, tokens * s.hidden);
    m.out_proj
        .forward(T::dst(proj), T::src(&b.delta_normed), tokens)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::cpu::elem::tests::Rng;
    use crate::cpu::Src;
    use crate::gemm::PackedWeight;

    /// A plain f64 model of the same layers: dense matrices, full causal
    /// softmax over each sequence's positions, no cache, no blocks.
    struct Reference {
        w: Vec<[Vec<f32>; 4]>,     // qkv, o, gate_up, down: [n, k] row-major
        norms: Vec<[Vec<f32>; 4]>, // input, post, q, k
    }

    fn matvec(w: &[f32], x: &[f64], n: usize) -> Vec<f64> {
        let k = x.len();
        (0..n)
            .map(|j| (0..k).map(|c| w[j * k + c] as f64 * x[c]).sum())
            .collect()
    }

    fn norm(x: &[f64], w: &[f32], eps: f64) -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let r = 1.0 / (ms + eps).sqrt();
        x.iter().zip(w).map(|(v, &g)| v * r * g as f64).collect()
    }

    fn rotate(x: &mut [f64], pos: usize, half: usize, theta: f64) {
        for i in 0..half {
            let a = pos as f64 / theta.powf(2.0 * i as f64 / (2 * half) as f64);
            let (c, s) = (a.cos(), a.sin());
            let (x1, x2) = (x[i], x[i + half]);
            x[i] = x1 * c - x2 * s;
            x[i + half] = x2 * c + x1 * s;
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn reference(
        r: &Reference,
        s: &DecoderShape,
        seq: &[Vec<f64>],
        qk_norm: bool,
        window: usize,
        theta: f64,
    ) -> Vec<Vec<f64>> {
        let (h, kvh, d) = (s.heads, s.kv_heads, s.head_dim);
        let mut x: Vec<Vec<f64>> = seq.to_vec();
        for (w, g) in r.w.iter().zip(&r.norms) {
            let mut keys = Vec::new();
            let mut vals = Vec::new();
            let mut qs = Vec::new();
            for (p, row) in x.iter().enumerate() {
                let qkv = matvec(&w[0], &norm(row, &g[0], s.eps as f64), s.qkv_width());
                let mut q = qkv[..h * d].to_vec();
                let mut k = qkv[h * d..(h + kvh) * d].to_vec();
                for (part, weight, heads) in [(&mut q, &g[2], h), (&mut k, &g[3], kvh)] {
                    for hd in 0..heads {
                        let head = &mut part[hd * d..(hd + 1) * d];
                        if qk_norm {
                            let n = norm(head, weight, s.eps as f64);
                            head.copy_from_slice(&n);
                        }
                        rotate(head, p, s.rotary_half, theta);
                    }
                }
                qs.push(q);
                keys.push(k);
                vals.push(qkv[(h + kvh) * d..].to_vec());
            }
            for (p, row) in x.iter_mut().enumerate() {
                let mut attn = vec![0f64; h * d];
                for hd in 0..h {
                    let kv = hd / (h / kvh);
                    let lo = if window > 0 {
                        (p + 1).saturating_sub(window)
                    } else {
                        0
                    };
                    let q = &qs[p][hd * d..(hd + 1) * d];
                    let scores: Vec<f64> = (lo..=p)
                        .map(|t| {
                            let k = &keys[t][kv * d..(kv + 1) * d];
                            q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() * s.scale as f64
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|v| (v - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for (t, &wt) in (lo..=p).zip(&e) {
                        let v = &vals[t][kv * d..(kv + 1) * d];
                        for c in 0..d {
                            attn[hd * d + c] += wt / z * v[c];
                        }
                    }
                }
                let o = matvec(&w[1], &attn, s.hidden);
                row.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
                let gu = matvec(&w[2], &norm(row, &g[1], s.eps as f64), 2 * s.intermediate);
                let act: Vec<f64> = (0..s.intermediate)
                    .map(|i| {
                        let g = gu[i];
                        g / (1.0 + (-g).exp()) * gu[s.intermediate + i]
                    })
                    .collect();
                let down = matvec(&w[3], &act, s.hidden);
                row.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
            }
        }
        x
    }

    #[test]
    fn stack_matches_a_plain_reference() {
        let s = DecoderShape {
            hidden: 48,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            rotary_half: 8,
            intermediate: 40,
            eps: 1e-5,
            scale: 0.25,
            residual_scale: 1.0,
        };
        let theta = 10000.0f64;
        let (block_size, num_blocks) = (4usize, 12usize);
        let cache = CacheShape {
            num_blocks,
            num_kv_heads: s.kv_heads,
            block_size,
            head_size: s.head_dim,
        };
        let mut rng = Rng(77);
        let mut rand =
            |n: usize, scale: f32| -> Vec<f32> { (0..n).map(|_| rng.f32() * scale).collect() };
        for (qk_norm, window) in [(false, 0usize), (true, 0), (false, 3)] {
            let dims = [
                (s.qkv_width(), s.hidden),
                (s.hidden, s.heads * s.head_dim),
                (2 * s.intermediate, s.hidden),
                (s.hidden, s.intermediate),
            ];
            let r = Reference {
                w: (0..2)
                    .map(|_| dims.map(|(n, k)| rand(n * k, 0.3)))
                    .collect(),
                norms: (0..2)
                    .map(|_| {
                        [s.hidden, s.hidden, s.head_dim, s.head_dim]
                            .map(|n| rand(n, 0.2).iter().map(|v| 1.0 + v).collect())
                    })
                    .collect(),
            };
            let weights: Vec<[LinearWeight; 4]> =
                r.w.iter()
                    .map(|ws| {
                        std::array::from_fn(|i| {
                            let (n, k) = dims[i];
                            let p = PackedWeight::pack(Src::F32(&ws[i]), None, n, k).unwrap();
                            crate::linear::float(Arc::new(p), crate::gemm::default_path())
                        })
                    })
                    .collect();
            // Two sequences: 5 prompt tokens then 2 decode steps, and 3 then 2,
            // in blocks taken out of order.
            let tables: [Vec<i32>; 2] = [vec![7, 2], vec![5, 10]];
            let lens = [7usize, 5];
            let prompts = [5usize, 3];
            let embeds: Vec<Vec<Vec<f64>>> = lens
                .iter()
                .map(|&n| {
                    (0..n)
                        .map(|_| rand(s.hidden, 1.0).iter().map(|&v| v as f64).collect())
                        .collect()
                })
                .collect();
            let mut caches: Vec<(Vec<f32>, Vec<f32>)> = (0..2)
                .map(|_| (vec![f32::NAN; cache.numel()], vec![f32::NAN; cache.numel()]))
                .collect();
            let mut got: Vec<Vec<Vec<f32>>> = vec![Vec::new(), Vec::new()];
            // Step 0: both prompts; steps 1, 2: one token each.
            let steps: [[(usize, usize); 2]; 3] = [
                [(0, prompts[0]), (0, prompts[1])],
                [(prompts[0], prompts[0] + 1), (prompts[1], prompts[1] + 1)],
                [(prompts[0] + 1, lens[0]), (prompts[1] + 1, lens[1])],
            ];
            for step in steps {
                let mut x = Vec::new();
                let (mut cos, mut sin, mut slots) = (Vec::new(), Vec::new(), Vec::new());
                let mut qsl = vec![0i32];
                let mut seq_lens = Vec::new();
                for (i, &(a, b)) in step.iter().enumerate() {
                    for p in a..b {
                        x.extend(embeds[i][p].iter().map(|&v| v as f32));
                        for j in 0..s.rotary_half {
                            let ang =
                                p as f64 / theta.powf(2.0 * j as f64 / (2 * s.rotary_half) as f64);
                            cos.push(ang.cos() as f32);
                            sin.push(ang.sin() as f32);
                        }
                        slots.push(
                            (tables[i][p / block_size] as usize * block_size + p % block_size)
                                as i64,
                        );
                    }
                    qsl.push(qsl.last().unwrap() + (b - a) as i32);
                    seq_lens.push(b as i32);
                }
                let bt: Vec<i32> = tables.iter().flatten().copied().collect();
                let batch = BatchLayout {
                    block_tables: &bt,
                    max_blocks_per_seq: 2,
                    seq_lens: &seq_lens,
                    query_start_loc: &qsl,
                };
                let mut layers: Vec<DecoderLayer<'_, f32>> = caches
                    .iter_mut()
                    .enumerate()
                    .map(|(l, (kc, vc))| DecoderLayer {
                        input_norm: Some(NormWeight::Model(&r.norms[l][0])),
                        post_norm: Some(NormWeight::Model(&r.norms[l][1])),
                        mixer_out_norm: None,
                        mlp_out_norm: None,
                        mixer: Mixer::Attention(Attention {
                            qk_norm: qk_norm.then(|| {
                                (
                                    NormWeight::Model(&r.norms[l][2][..]),
                                    NormWeight::Model(&r.norms[l][3][..]),
                                )
                            }),
                            gate: false,
                            qkv: &weights[l][0],
                            o: &weights[l][1],
                            key_cache: KvCacheMut::Float(kc),
                            value_cache: KvCacheMut::Float(vc),
                            sliding_window: window as i64,
                            softcap: 0.0,
                            group: 0,
                            local_rotary: false,
                            rotary: true,
                            sinks: None,
                        }),
                        mlp: Mlp::Dense {
                            gate_up: &weights[l][2],
                            down: &weights[l][3],
                            act: GatedAct::Silu,
                        },
                    })
                    .collect();
                let inputs = StepInputs {
                    cos: &cos,
                    sin: &sin,
                    cos_local: &cos,
                    sin_local: &sin,
                    slot_mapping: &slots,
                    batch,
                    groups: &[],
                    cache,
                    state_slots: &[],
                };
                decoder_stack(&mut x, &mut layers[..], &s, &inputs).unwrap();
                let mut rows = x.chunks(s.hidden);
                for (i, &(a, b)) in step.iter().enumerate() {
                    got[i].extend((a..b).map(|_| rows.next().unwrap().to_vec()));
                }
            }
            for i in 0..2 {
                let want = reference(&r, &s, &embeds[i], qk_norm, window, theta);
                for (p, (g, w)) in got[i].iter().zip(&want).enumerate() {
                    for (c, (&a, &b)) in g.iter().zip(w).enumerate() {
                        assert!(
                            (a as f64 - b).abs() <= 1e-4 * (1.0 + b.abs()),
                            "qk_norm {qk_norm} window {window} seq {i} pos {p} [{c}]: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn rejects_mismatched_weights_and_inputs() {
        let s = DecoderShape {
            hidden: 8,
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
            rotary_half: 2,
            intermediate: 6,
            eps: 1e-6,
            scale: 0.5,
            residual_scale: 1.0,
        };
        let lin = |n: usize, k: usize| {
            let w = vec![0.1f32; n * k];
            crate::linear::float(
                Arc::new(PackedWeight::pack(Src::F32(&w), None, n, k).unwrap()),
                crate::gemm::default_path(),
            )
        };
        let (qkv, o, gu, down) = (lin(16, 8), lin(8, 8), lin(12, 8), lin(8, 6));
        let norm = vec![1.0f32; 8];
        let cache = CacheShape {
            num_blocks: 2,
            num_kv_heads: 1,
            block_size: 4,
            head_size: 4,
        };
        let (mut kc, mut vc) = (vec![0f32; cache.numel()], vec![0f32; cache.numel()]);
        let mut layers = [DecoderLayer {
            input_norm: Some(NormWeight::Model(&norm)),
            post_norm: Some(NormWeight::Model(&norm)),
            mixer_out_norm: None,
            mlp_out_norm: None,
            mixer: Mixer::Attention(Attention {
                qk_norm: None,
                gate: false,
                qkv: &qkv,
                o: &gu, // wrong: [12, 8] where [8, 8] belongs
                key_cache: KvCacheMut::Float(&mut kc),
                value_cache: KvCacheMut::Float(&mut vc),
                sliding_window: 0,
                softcap: 0.0,
                group: 0,
                local_rotary: false,
                rotary: true,
                sinks: None,
            }),
            mlp: Mlp::Dense {
                gate_up: &gu,
                down: &down,
                act: GatedAct::Silu,
            },
        }];
        let (cos, sin) = (vec![1.0f32; 2], vec![0.0f32; 2]);
        let step = StepInputs {
            cos: &cos,
            sin: &sin,
            cos_local: &cos,
            sin_local: &sin,
            groups: &[],
            slot_mapping: &[0],
            batch: BatchLayout {
                block_tables: &[0],
                max_blocks_per_seq: 1,
                seq_lens: &[1],
                query_start_loc: &[0, 1],
            },
            cache,
            state_slots: &[],
        };
        let mut x = vec![1.0f32; 8];
        let err = decoder_stack(&mut x, &mut layers[..], &s, &step).unwrap_err();
        assert!(
            err.to_string()
                .contains("layers[0].o: expected a [8, 8] weight"),
            "{err}"
        );
        if let Mixer::Attention(a) = &mut layers[0].mixer {
            a.o = &o;
        }
        let mut short = vec![1.0f32; 7];
        assert!(decoder_stack(&mut short, &mut layers[..], &s, &step).is_err());
        decoder_stack(&mut x, &mut layers[..], &s, &step).unwrap();
        assert!(x.iter().all(|v| v.is_finite()));
    }
}

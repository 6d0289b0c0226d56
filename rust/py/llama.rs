//! The decoder stack (`DecoderStack`): every Llama-family layer of a model
//! (or a hybrid's: LFM2's short convolutions and Qwen3.5's Gated DeltaNet
//! layers keep a state per sequence), run in one call per step
//! (`models::llama`).
//!
//! The stack is built once, after the model is packed and its KV caches (and
//! states) are allocated: it checks every weight, norm, cache and state
//! tensor then, keeps them alive, and shares the packed weights with the
//! model's `PackedLinear` / `QuantizedLinear` objects. A step then only
//! checks its own inputs.

use std::sync::{Arc, Mutex};

use half::bf16;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::attention::{cache_shape, BatchArgs};
use super::linear::linear_weight;
use super::tensor::{DType, TensorArg};
use crate::attention::{BatchLayout, CacheShape, Element, KvCacheMut};
use crate::error::CoreResult;
use crate::layers::GatedAct;
use crate::linear::LinearWeight;
use crate::models::llama::{
    self as decoder, Attention, DecoderLayer, DecoderShape, DeltaHeads, DeltaNet, KvGroup, Layers,
    Mamba2, MambaHeads, Mixer, Mlp, NormWeight, ShortConv, StepInputs,
};
use crate::moe::SparseMlp;

/// A tensor the stack reads or writes: address and element count.
#[derive(Clone, Copy)]
struct Span {
    ptr: usize,
    len: usize,
}

impl Span {
    fn of(t: &TensorArg) -> Span {
        Span {
            ptr: t.ptr,
            len: t.numel(),
        }
    }

    /// # Safety
    /// The tensor is alive (the stack holds it), holds `T`, and nothing else
    /// accesses it during the step.
    unsafe fn slice<'a, T>(self) -> &'a [T] {
        std::slice::from_raw_parts(self.ptr as *const T, self.len)
    }

    /// # Safety
    /// As `slice`, and no other slice aliases it.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice_mut<'a, T>(self) -> &'a mut [T] {
        std::slice::from_raw_parts_mut(self.ptr as *mut T, self.len)
    }

    /// Whether this span (of `size`-byte elements) shares memory with `other`.
    fn overlaps(self, other: &TensorArg, size: usize) -> bool {
        let (a0, a1) = (self.ptr, self.ptr + self.len * size);
        let (b0, b1) = (other.ptr, other.ptr + other.numel() * other.dtype.size());
        self.len > 0 && other.numel() > 0 && a0 < b1 && b0 < a1
    }
}

struct Layer {
    input_norm: Option<Norm>,
    post_norm: Option<Norm>,
    mixer_out_norm: Option<Norm>,
    mlp_out_norm: Option<Norm>,
    mixer: LayerMixer,
    mlp: LayerMlp,
}

/// A norm's weight: in the model's dtype, or f32 in a bf16 model
/// (`decoder::NormWeight::Float`).
#[derive(Clone, Copy)]
struct Norm {
    span: Span,
    float: bool,
}

impl Norm {
    /// # Safety
    /// As `Span::slice`, the span holding the model's `T` unless `float`.
    unsafe fn view<'a, T>(self) -> NormWeight<'a, T> {
        if self.float {
            NormWeight::Float(self.span.slice())
        } else {
            NormWeight::Model(self.span.slice())
        }
    }
}

/// A layer's mixer (`decoder::Mixer` borrows it).
enum LayerMixer {
    Attention {
        qk_norm: Option<(Norm, Norm)>,
        gate: bool,
        qkv: LinearWeight,
        o: LinearWeight,
        key_cache: Span,
        value_cache: Span,
        sliding_window: i64,
        softcap: f32,
        group: usize,
        local_rotary: bool,
        rotary: bool,
        sinks: Option<Span>,
    },
    ShortConv {
        in_proj: LinearWeight,
        weight: Span,
        bias: Option<Span>,
        out_proj: LinearWeight,
        state: Span,
        taps: usize,
    },
    DeltaNet {
        in_proj: LinearWeight,
        conv_weight: Span,
        conv_state: Span,
        a_log: Span,
        dt_bias: Span,
        norm: Span,
        out_proj: LinearWeight,
        state: Span,
        heads: DeltaHeads,
    },
    Mamba2 {
        in_proj: LinearWeight,
        conv_weight: Span,
        conv_bias: Option<Span>,
        conv_state: Span,
        a_log: Span,
        dt_bias: Span,
        d: Span,
        dt_limit: (f32, f32),
        norm: Span,
        out_proj: LinearWeight,
        state: Span,
        heads: MambaHeads,
    },
}

impl Layer {
    /// The tensors a step writes, each with its element size: the KV caches
    /// (`cache` bytes), or the recurrent states (`model` bytes, f32 for the
    /// delta rule's).
    fn written(&self, model: usize, cache: usize) -> Vec<(Span, usize)> {
        match &self.mixer {
            LayerMixer::Attention {
                key_cache,
                value_cache,
                ..
            } => vec![(*key_cache, cache), (*value_cache, cache)],
            LayerMixer::ShortConv { state, .. } => vec![(*state, model)],
            LayerMixer::DeltaNet {
                conv_state, state, ..
            }
            | LayerMixer::Mamba2 {
                conv_state, state, ..
            } => vec![(*conv_state, model), (*state, 4)],
        }
    }
}

/// A layer's MLP weights (`decoder::Mlp` borrows them).
enum LayerMlp {
    Dense(LinearWeight, LinearWeight, GatedAct),
    Sparse(Arc<SparseMlp>),
}

/// The decoder layers of a Llama-family model (pre-norm attention with a
/// fused q/k/v projection and rotary, or LFM2's short convolution, or
/// Qwen3.5's Gated DeltaNet; Gemma's extra norms, soft-caps, local tables
/// and KV groups; a SiLU- or GELU-gated MLP with a fused gate/up projection,
/// or a mixture of experts),
/// run in one call per step.
#[pyclass(name = "DecoderStack", module = "fastllm._core", frozen)]
struct PyDecoderStack {
    layers: Vec<Layer>,
    shape: DecoderShape,
    cache: CacheShape,
    /// The model's element type (hidden states, norms, rotary tables).
    dtype: DType,
    /// The caches' element type: `dtype`, or int8 (8-bit rows with scales).
    cache_dtype: DType,
    /// Whether any layer keeps a recurrent state (its steps need `state_slots`).
    has_state: bool,
    /// The tensors the layers point into, kept alive with the stack.
    _tensors: Vec<Py<PyAny>>,
    /// One step at a time: a step writes the caches.
    running: Mutex<()>,
}

/// Prefixes a `ValueError` with the layer it is about.
fn in_layer(py: Python<'_>, i: usize, err: PyErr) -> PyErr {
    if err.is_instance_of::<PyValueError>(py) {
        PyValueError::new_err(format!("layers[{i}]: {}", err.value(py)))
    } else {
        err
    }
}

/// Tensor `key` of a layer dict, checked (dtype, rank), and kept alive with
/// the stack (`tensors`).
fn kept_tensor(
    d: &Bound<'_, PyDict>,
    key: &'static str,
    dtypes: &[DType],
    ndim: usize,
    tensors: &mut Vec<Py<PyAny>>,
) -> PyResult<TensorArg> {
    let obj = item(d, key)?;
    let t = TensorArg::extract(key, &obj)?;
    t.check(dtypes, ndim)?;
    tensors.push(obj.unbind());
    Ok(t)
}

/// A recurrent layer's convolution weight `[channels, taps]` (`weight_key`),
/// its channels checked by `channels` (which returns what the caller reads
/// from them), then its rolling state `[slots, channels, taps - 1]`
/// (`state_key`); each taken by `tensor` (a [`kept_tensor`] of the layer's
/// dict).
fn conv_and_state<R>(
    tensor: &mut impl FnMut(&'static str, &[DType], usize) -> PyResult<TensorArg>,
    (weight_key, state_key): (&'static str, &'static str),
    dtype: DType,
    channels: impl FnOnce(usize) -> PyResult<R>,
) -> PyResult<(TensorArg, TensorArg, R)> {
    let weight = tensor(weight_key, &[dtype], 2)?;
    let taps = weight.shape[1];
    check_taps(weight_key, taps)?;
    let read = channels(weight.shape[0])?;
    let state = tensor(state_key, &[dtype], 3)?;
    state.expect_dim(1, weight.shape[0], &format!("channels of {weight_key}"))?;
    state.expect_dim(2, taps - 1, "taps - 1")?;
    Ok((weight, state, read))
}

/// A recurrent layer's convolution width `taps`, checked against what the kernel takes.
fn check_taps(key: &str, taps: usize) -> PyResult<()> {
    if !(2..=crate::recurrent::MAX_CONV_WIDTH).contains(&taps) {
        return Err(PyValueError::new_err(format!(
            "{key}: expected 2 to {} taps, got {taps}",
            crate::recurrent::MAX_CONV_WIDTH
        )));
    }
    Ok(())
}

fn item<'py>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<Bound<'py, PyAny>> {
    d.get_item(key)?
        .ok_or_else(|| PyValueError::new_err(format!("missing key '{key}'")))
}

#[pymethods]
impl PyDecoderStack {
    /// `layers`: one dict per layer with the keys `input_norm`, `post_norm`
    /// (weights [hidden], or None: no norm), `q_norm` and `k_norm`
    /// ([head_dim], the whole projection's width, or None),
    /// `qkv`, `o`, `gate_up`, `down` (PackedLinear or QuantizedLinear, biases
    /// inside; or, for a mixture of experts, `moe`: a MoeBlock), `key_cache`,
    /// `value_cache` ([blocks, kv_heads, block_size, head_dim]) and
    /// `sliding_window` (0: none); optionally `logit_softcap` (0: none),
    /// `kv_group` (0: the step's own tables; layers of different groups may
    /// share a cache tensor, at their own blocks), `local_rotary` (the step's
    /// local tables), `rotary` (default True; False: no rotation, SmolLM3's
    /// NoPE layers), `mixer_out_norm` / `mlp_out_norm` (Gemma's norms of the
    /// attention and MLP outputs), `sinks` (f32 [heads]: gpt-oss's sink
    /// logits, or None) and `mlp_act` ("silu", "gelu_tanh"). Norms and caches share the model's dtype
    /// (bf16 or f32). A short-convolution layer (LFM2) gives instead of the
    /// attention keys `conv_in_proj` [3H, H], `conv_weight` ([H, taps], the
    /// model's dtype), `conv_bias` ([H] or None), `conv_out_proj` [H, H] and
    /// `conv_state` ([slots, H, taps - 1], the model's dtype). A Gated
    /// DeltaNet layer (Qwen3.5) gives `delta_in_proj` [C + Hv Dv + 2 Hv, H]
    /// (q, k, v, z, b, a; C = 2 Hk Dk + Hv Dv), `delta_conv_weight` [C, taps],
    /// `delta_conv_state` [slots, C, taps - 1] (the model's dtype),
    /// `delta_a_log` and `delta_dt_bias` ([Hv] float32), `delta_norm` [Dv],
    /// `delta_out_proj` [H, Hv Dv] and `delta_state` ([slots, Hv, Dk, Dv]
    /// float32). A Mamba-2 layer (Granite 4.0) gives `mamba_in_proj` [inner +
    /// C + Hm, H] (z, x/B/C, dt; C = inner + 2 G N), `mamba_conv_weight` [C,
    /// taps], `mamba_conv_bias` ([C] or None), `mamba_conv_state` [slots, C,
    /// taps - 1] (the model's dtype), `mamba_a_log`, `mamba_dt_bias` and
    /// `mamba_d` ([Hm] float32), `mamba_dt_limit` ((min, max)), `mamba_groups`
    /// (G), `mamba_norm` [inner], `mamba_out_proj` [H, inner] and
    /// `mamba_state` ([slots, Hm, N, inner / Hm] float32). `attn_output_gate` (Qwen3.5's attention, default False):
    /// `qkv` yields each query head followed by its gate. In a bf16 model the
    /// norm weights (`input_norm`, `post_norm`, `q_norm`, `k_norm`) may be
    /// float32: such a norm runs in float32 and rounds once (Qwen3.5's `1 + w`).
    /// `residual_multiplier` scales each residual branch (Granite). `dtype`:
    /// the model's (torch.bfloat16 or torch.float32; default the first input
    /// norm's).
    #[new]
    #[pyo3(signature = (layers, hidden_size, num_heads, num_kv_heads, head_dim, rotary_dim,
                        intermediate_size, eps, scale, residual_multiplier=1.0, dtype=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        layers: Vec<Bound<'_, PyDict>>,
        hidden_size: usize,
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        rotary_dim: usize,
        intermediate_size: usize,
        eps: f32,
        scale: f32,
        residual_multiplier: f32,
        dtype: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        if !(residual_multiplier.is_finite() && residual_multiplier > 0.0) {
            return Err(PyValueError::new_err(format!(
                "residual_multiplier: must be a positive number, got {residual_multiplier}"
            )));
        }
        let shape = DecoderShape {
            hidden: hidden_size,
            heads: num_heads,
            kv_heads: num_kv_heads,
            head_dim,
            rotary_half: rotary_dim / 2,
            intermediate: intermediate_size,
            eps,
            scale,
            residual_scale: residual_multiplier,
        };
        if !rotary_dim.is_multiple_of(2) || rotary_dim > head_dim {
            return Err(PyValueError::new_err(format!(
                "rotary_dim: must be even and at most head_dim ({head_dim}), got {rotary_dim}"
            )));
        }
        let mut built = Vec::with_capacity(layers.len());
        let mut tensors = Vec::new();
        // The model dtype: layer 0's input norm's (every other tensor is checked against it).
        let Some(layer0) = layers.first() else {
            return Err(PyValueError::new_err("layers: expected at least one layer"));
        };
        let dtype = match dtype {
            Some(d) if !d.is_none() => {
                let name = d.str()?.to_string();
                match DType::from_torch(&name) {
                    Some(dt @ (DType::BF16 | DType::F32)) => dt,
                    _ => {
                        return Err(PyValueError::new_err(format!(
                            "dtype: expected torch.bfloat16 or torch.float32, got {name}"
                        )))
                    }
                }
            }
            _ => {
                let norm = item(layer0, "input_norm")?;
                if norm.is_none() {
                    return Err(PyValueError::new_err(
                        "dtype: required when layer 0 has no input_norm",
                    ));
                }
                TensorArg::extract("input_norm", &norm)
                    .map_err(|e| in_layer(py, 0, e))?
                    .dtype
            }
        };
        let mut first: Option<(CacheShape, DType)> = None;
        for (i, d) in layers.iter().enumerate() {
            let layer = Self::layer(d, &shape, dtype, &mut first, &mut tensors)
                .map_err(|e| in_layer(py, i, e))?;
            built.push(layer);
        }
        let Some((cache, cache_dtype)) = first else {
            return Err(PyValueError::new_err(
                "layers: expected at least one attention layer",
            ));
        };
        // Every tensor a step writes (caches and states, each in bytes) apart.
        let written: Vec<(usize, usize, usize)> = built
            .iter()
            .enumerate()
            .flat_map(|(i, l): (usize, &Layer)| {
                l.written(dtype.size(), cache_dtype.size())
                    .into_iter()
                    .map(move |(s, size)| (i, s.ptr, s.ptr + s.len * size))
            })
            .collect();
        // Attention layers of different KV groups may share a cache tensor
        // (the runner's layout: each group at its own blocks of it).
        let group = |i: usize| match built[i].mixer {
            LayerMixer::Attention { group, .. } => Some(group),
            _ => None,
        };
        for (a, &(i, s0, s1)) in written.iter().enumerate() {
            for &(j, t0, t1) in &written[a + 1..] {
                let shared_by_groups = (s0, s1) == (t0, t1)
                    && group(i).is_some()
                    && group(j).is_some()
                    && group(i) != group(j);
                if s0 < t1 && t0 < s1 && !shared_by_groups {
                    return Err(PyValueError::new_err(format!(
                        "layers[{j}]: its KV cache or state shares memory with layer {i}'s"
                    )));
                }
            }
        }
        let has_state = built
            .iter()
            .any(|l| !matches!(l.mixer, LayerMixer::Attention { .. }));
        if cache.num_kv_heads != num_kv_heads || cache.head_size != head_dim {
            return Err(PyValueError::new_err(format!(
                "key_cache: expected {num_kv_heads} kv heads of {head_dim}, got {} of {}",
                cache.num_kv_heads, cache.head_size
            )));
        }
        let stack = PyDecoderStack {
            layers: built,
            shape,
            cache,
            dtype,
            cache_dtype,
            has_state,
            _tensors: tensors,
            running: Mutex::new(()),
        };
        // The full shape check of the pure-Rust side, once.
        for i in 0..stack.layers.len() {
            match dtype {
                DType::BF16 => stack.check::<bf16>(i)?,
                _ => stack.check::<f32>(i)?,
            }
        }
        Ok(stack)
    }

    /// Runs every layer on the hidden states `x` [tokens, hidden], in place:
    /// `cos` / `sin` [tokens, rotary_dim / 2] (the model's dtype), the
    /// step's `slot_mapping` (int64 [tokens]), `block_tables` (int32
    /// [seqs, max_blocks]), `seq_lens` (int32 [seqs]) and `query_start_loc`
    /// (int32 [seqs + 1]), as the paged-attention kernel takes them; with
    /// recurrent (convolution, DeltaNet) layers, `state_slots` (int64
    /// [seqs]): each sequence's slot of their states. `cos_local` /
    /// `sin_local`: the tables of the layers with `local_rotary` (default
    /// `cos` / `sin`). `group_slot_mappings` / `group_block_tables`: per KV
    /// group (entry 0, group 0's, is the step's own and is not read), the
    /// slots and block tables of the layers of that `kv_group`.
    #[pyo3(signature = (x, cos, sin, slot_mapping, block_tables, seq_lens, query_start_loc,
                        state_slots=None, cos_local=None, sin_local=None,
                        group_slot_mappings=None, group_block_tables=None))]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        cos: &Bound<'_, PyAny>,
        sin: &Bound<'_, PyAny>,
        slot_mapping: &Bound<'_, PyAny>,
        block_tables: &Bound<'_, PyAny>,
        seq_lens: &Bound<'_, PyAny>,
        query_start_loc: &Bound<'_, PyAny>,
        state_slots: Option<&Bound<'_, PyAny>>,
        cos_local: Option<&Bound<'_, PyAny>>,
        sin_local: Option<&Bound<'_, PyAny>>,
        group_slot_mappings: Option<Vec<Bound<'_, PyAny>>>,
        group_block_tables: Option<Vec<Bound<'_, PyAny>>>,
    ) -> PyResult<()> {
        let dt = [self.dtype];
        let x = TensorArg::extract("x", x)?;
        x.check(&dt, 2)?;
        x.expect_dim(1, self.shape.hidden, "hidden_size")?;
        let tokens = x.shape[0];
        let half = self.shape.rotary_half;
        let mut rot = Vec::with_capacity(4);
        let local = [
            (
                "cos_local",
                cos_local.filter(|t| !t.is_none()).unwrap_or(cos),
            ),
            (
                "sin_local",
                sin_local.filter(|t| !t.is_none()).unwrap_or(sin),
            ),
        ];
        for (name, t) in [("cos", cos), ("sin", sin)].into_iter().chain(local) {
            let t = TensorArg::extract(name, t)?;
            t.check(&dt, 2)?;
            t.expect_dim(0, tokens, "tokens of x")?;
            t.expect_dim(1, half, "rotary_dim / 2")?;
            rot.push(t);
        }
        let slots = TensorArg::extract("slot_mapping", slot_mapping)?;
        slots.check(&[DType::I64], 1)?;
        slots.expect_dim(0, tokens, "tokens of x")?;
        let batch = BatchArgs::extract(block_tables, seq_lens, query_start_loc)?;
        let seqs = batch.num_seqs();
        // Groups 1.. (entry 0 is group 0's, the step's own tables).
        let (maps, tables) = (
            group_slot_mappings.unwrap_or_default(),
            group_block_tables.unwrap_or_default(),
        );
        if maps.len() != tables.len() {
            return Err(PyValueError::new_err(format!(
                "group_slot_mappings, group_block_tables: {} and {} entries, expected as many",
                maps.len(),
                tables.len()
            )));
        }
        let mut groups = Vec::with_capacity(maps.len().saturating_sub(1));
        for (m, t) in maps.iter().zip(&tables).skip(1) {
            let m = TensorArg::extract("group_slot_mappings", m)?;
            m.check(&[DType::I64], 1)?;
            m.expect_dim(0, tokens, "tokens of x")?;
            let t = TensorArg::extract("group_block_tables", t)?;
            t.check(&[DType::I32], 2)?;
            t.expect_dim(0, seqs, "num_seqs of block_tables")?;
            groups.push((m, t));
        }
        let state_slots = match state_slots {
            Some(s) if !s.is_none() => {
                let t = TensorArg::extract("state_slots", s)?;
                t.check(&[DType::I64], 1)?;
                Some(t)
            }
            _ if self.has_state => {
                return Err(PyValueError::new_err(
                    "state_slots: required by the recurrent (convolution, DeltaNet) layers",
                ))
            }
            _ => None,
        };
        for layer in &self.layers {
            for (span, size) in layer.written(self.dtype.size(), self.cache_dtype.size()) {
                for t in [&x, &rot[0], &rot[1], &rot[2], &rot[3]] {
                    if span.overlaps(t, size) {
                        return Err(PyValueError::new_err(format!(
                            "{}: must not share memory with a KV cache or state",
                            t.name
                        )));
                    }
                }
            }
        }
        let _one_step = self.running.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: every tensor was checked (dtype, CPU, contiguity, shape);
        // x is disjoint from the caches, the caches were checked disjoint at
        // construction (or shared by layers of different groups, which write
        // their own blocks), and the stack keeps its tensors alive.
        unsafe {
            let batch = batch.layout();
            let slots = slots.slice::<i64>();
            let states: &[i64] = state_slots.as_ref().map_or(&[], |t| t.slice::<i64>());
            let groups: Vec<KvGroup<'_>> = groups
                .iter()
                .map(|(m, t)| KvGroup {
                    slot_mapping: m.slice::<i64>(),
                    block_tables: t.slice::<i32>(),
                    max_blocks_per_seq: t.shape[1],
                })
                .collect();
            let tables = (slots, states, &groups[..]);
            match self.dtype {
                DType::BF16 => self.run::<bf16>(py, &x, &rot, tables, batch),
                _ => self.run::<f32>(py, &x, &rot, tables, batch),
            }
        }
    }

    #[getter]
    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "DecoderStack(num_layers={}, hidden_size={}, dtype={:?})",
            self.layers.len(),
            self.shape.hidden,
            self.dtype
        )
    }
}

impl PyDecoderStack {
    /// Reads and checks one layer's dict; the first attention layer fixes
    /// the cache shape and the cache dtype the others must have. A cache
    /// holds the model dtype `dtype` or 8-bit rows (int8).
    fn layer(
        d: &Bound<'_, PyDict>,
        shape: &DecoderShape,
        dtype: DType,
        first: &mut Option<(CacheShape, DType)>,
        tensors: &mut Vec<Py<PyAny>>,
    ) -> PyResult<Layer> {
        // A 1-D tensor of `dim` elements (0: any) in one of `dtypes`, kept
        // alive; None if None.
        let mut vector =
            |key: &'static str, dim: usize, dtypes: &[DType]| -> PyResult<Option<(Span, DType)>> {
                let obj = item(d, key)?;
                if obj.is_none() {
                    return Ok(None);
                }
                let t = TensorArg::extract(key, &obj)?;
                t.check(dtypes, 1)?;
                if dim > 0 {
                    t.expect_dim(0, dim, "its layer's width")?;
                }
                tensors.push(obj.unbind());
                Ok(Some((Span::of(&t), t.dtype)))
            };
        // A norm's weight: the model's dtype, or float32 (run in float32).
        let mut norm = |key: &'static str, dim: usize| -> PyResult<Option<Norm>> {
            Ok(
                vector(key, dim, &[dtype, DType::F32])?.map(|(span, dt)| Norm {
                    span,
                    float: dt != dtype,
                }),
            )
        };
        let input_norm = norm("input_norm", shape.hidden)?;
        let post_norm = norm("post_norm", shape.hidden)?;
        let present = |key: &str| -> PyResult<Option<Bound<'_, PyAny>>> {
            Ok(d.get_item(key)?.filter(|v| !v.is_none()))
        };
        let mut out_norms = [None, None];
        for (slot, key) in out_norms.iter_mut().zip(["mixer_out_norm", "mlp_out_norm"]) {
            if present(key)?.is_some() {
                *slot = norm(key, shape.hidden)?;
            }
        }
        let [mixer_out_norm, mlp_out_norm] = out_norms;
        let mixer = if let Some(in_proj) = present("conv_in_proj")? {
            let bias = vector("conv_bias", shape.hidden, &[dtype])?.map(|(s, _)| s);
            Self::short_conv(d, &in_proj, bias, shape, dtype, tensors)?
        } else if let Some(in_proj) = present("delta_in_proj")? {
            Self::delta_net(d, &in_proj, dtype, tensors)?
        } else if let Some(in_proj) = present("mamba_in_proj")? {
            Self::mamba2(d, &in_proj, dtype, tensors)?
        } else {
            let qk_norm = match (
                // Per head or over the whole projection: `check_layer` checks.
                norm("q_norm", 0)?,
                norm("k_norm", 0)?,
            ) {
                (Some(q), Some(k)) => Some((q, k)),
                (None, None) => None,
                _ => {
                    return Err(PyValueError::new_err(
                        "q_norm, k_norm: give both or neither",
                    ))
                }
            };
            let gate = match present("attn_output_gate")? {
                Some(g) => g.extract::<bool>()?,
                None => false,
            };
            Self::attention(d, qk_norm, gate, dtype, first, tensors)?
        };
        let mlp = match d.get_item("moe")? {
            Some(moe) if !moe.is_none() => LayerMlp::Sparse(super::moe::block_of(&moe)?),
            _ => {
                let act = match present("mlp_act")? {
                    None => GatedAct::Silu,
                    Some(a) => match super::moe::parse_act(&a.extract::<String>()?, 0.0, 0.0) {
                        Ok(GatedAct::SwigluOai { .. }) | Err(_) => {
                            return Err(PyValueError::new_err(format!(
                                "mlp_act: expected 'silu' or 'gelu_tanh', got {a}"
                            )))
                        }
                        Ok(act) => act,
                    },
                };
                LayerMlp::Dense(
                    linear_weight(&item(d, "gate_up")?, "gate_up")?,
                    linear_weight(&item(d, "down")?, "down")?,
                    act,
                )
            }
        };
        Ok(Layer {
            input_norm,
            post_norm,
            mixer_out_norm,
            mlp_out_norm,
            mixer,
            mlp,
        })
    }

    /// An attention layer's projections, caches and window.
    fn attention(
        d: &Bound<'_, PyDict>,
        qk_norm: Option<(Norm, Norm)>,
        gate: bool,
        dtype: DType,
        first: &mut Option<(CacheShape, DType)>,
        tensors: &mut Vec<Py<PyAny>>,
    ) -> PyResult<LayerMixer> {
        let kc_obj = item(d, "key_cache")?;
        let vc_obj = item(d, "value_cache")?;
        let kc = TensorArg::extract("key_cache", &kc_obj)?;
        let vc = TensorArg::extract("value_cache", &vc_obj)?;
        let cache = cache_shape(&kc, &vc)?;
        if kc.dtype != dtype && kc.dtype != DType::I8 {
            return Err(PyValueError::new_err(format!(
                "key_cache: dtype {:?} must be the model's ({dtype:?}) or int8",
                kc.dtype
            )));
        }
        match first {
            None => *first = Some((cache, kc.dtype)),
            Some((c, cdt)) => {
                if *c != cache || *cdt != kc.dtype {
                    return Err(PyValueError::new_err(format!(
                        "key_cache: {cache:?} {:?} differs from the first attention layer's \
                         {c:?} {cdt:?}",
                        kc.dtype
                    )));
                }
            }
        }
        let sliding_window: i64 = item(d, "sliding_window")?.extract()?;
        let optional = |key: &str| -> PyResult<Option<Bound<'_, PyAny>>> {
            Ok(d.get_item(key)?.filter(|v| !v.is_none()))
        };
        let softcap: f32 = optional("logit_softcap")?.map_or(Ok(0.0), |v| v.extract())?;
        if !(softcap.is_finite() && softcap >= 0.0) {
            return Err(PyValueError::new_err(format!(
                "logit_softcap: must be a positive number or 0 (none), got {softcap}"
            )));
        }
        let group: usize = optional("kv_group")?.map_or(Ok(0), |v| v.extract())?;
        let local_rotary: bool = optional("local_rotary")?.map_or(Ok(false), |v| v.extract())?;
        let rotary: bool = optional("rotary")?.map_or(Ok(true), |v| v.extract())?;
        let sinks = match optional("sinks")? {
            None => None,
            Some(obj) => {
                let t = TensorArg::extract("sinks", &obj)?;
                t.check(&[DType::F32], 1)?;
                let span = Span::of(&t);
                tensors.push(obj.unbind());
                Some(span)
            }
        };
        let mixer = LayerMixer::Attention {
            qk_norm,
            gate,
            qkv: linear_weight(&item(d, "qkv")?, "qkv")?,
            o: linear_weight(&item(d, "o")?, "o")?,
            key_cache: Span::of(&kc),
            value_cache: Span::of(&vc),
            sliding_window: sliding_window.max(0),
            softcap,
            group,
            local_rotary,
            rotary,
            sinks,
        };
        tensors.push(kc_obj.unbind());
        tensors.push(vc_obj.unbind());
        Ok(mixer)
    }

    /// A short-convolution layer's projections, taps and state.
    fn short_conv(
        d: &Bound<'_, PyDict>,
        in_proj: &Bound<'_, PyAny>,
        bias: Option<Span>,
        shape: &DecoderShape,
        dtype: DType,
        tensors: &mut Vec<Py<PyAny>>,
    ) -> PyResult<LayerMixer> {
        let w_obj = item(d, "conv_weight")?;
        let w = TensorArg::extract("conv_weight", &w_obj)?;
        w.check(&[dtype], 2)?;
        w.expect_dim(0, shape.hidden, "hidden_size")?;
        let taps = w.shape[1];
        check_taps("conv_weight", taps)?;
        let s_obj = item(d, "conv_state")?;
        let st = TensorArg::extract("conv_state", &s_obj)?;
        st.check(&[dtype], 3)?;
        st.expect_dim(1, shape.hidden, "hidden_size")?;
        st.expect_dim(2, taps - 1, "taps - 1")?;
        let mixer = LayerMixer::ShortConv {
            in_proj: linear_weight(in_proj, "conv_in_proj")?,
            weight: Span::of(&w),
            bias,
            out_proj: linear_weight(&item(d, "conv_out_proj")?, "conv_out_proj")?,
            state: Span::of(&st),
            taps,
        };
        tensors.push(w_obj.unbind());
        tensors.push(s_obj.unbind());
        Ok(mixer)
    }

    /// A Gated DeltaNet layer's projections, gate parameters, norm and
    /// states (its head counts read from the states' shapes).
    fn delta_net(
        d: &Bound<'_, PyDict>,
        in_proj: &Bound<'_, PyAny>,
        dtype: DType,
        tensors: &mut Vec<Py<PyAny>>,
    ) -> PyResult<LayerMixer> {
        let mut tensor = |key: &'static str, dtypes: &[DType], ndim: usize| {
            kept_tensor(d, key, dtypes, ndim, tensors)
        };
        let state = tensor("delta_state", &[DType::F32], 4)?;
        let (v_heads, k_dim, v_dim) = (state.shape[1], state.shape[2], state.shape[3]);
        let keys = ("delta_conv_weight", "delta_conv_state");
        let (conv_weight, conv_state, keys) = conv_and_state(&mut tensor, keys, dtype, |conv| {
            let keys = conv.checked_sub(v_heads * v_dim).unwrap_or(1);
            if k_dim == 0 || !keys.is_multiple_of(2 * k_dim) || keys == 0 {
                return Err(PyValueError::new_err(format!(
                    "delta_conv_weight: {conv} channels are not q, k of a whole number of \
                     heads of {k_dim} and v of {v_heads} heads of {v_dim}"
                )));
            }
            Ok(keys)
        })?;
        let taps = conv_weight.shape[1];
        let mut span = |key: &'static str, dtypes: &[DType], dim: usize| {
            let t = tensor(key, dtypes, 1)?;
            t.expect_dim(0, dim, "its layer's heads")?;
            Ok::<_, PyErr>(Span::of(&t))
        };
        let a_log = span("delta_a_log", &[DType::F32], v_heads)?;
        let dt_bias = span("delta_dt_bias", &[DType::F32], v_heads)?;
        let norm = span("delta_norm", &[dtype], v_dim)?;
        Ok(LayerMixer::DeltaNet {
            in_proj: linear_weight(in_proj, "delta_in_proj")?,
            conv_weight: Span::of(&conv_weight),
            conv_state: Span::of(&conv_state),
            a_log,
            dt_bias,
            norm,
            out_proj: linear_weight(&item(d, "delta_out_proj")?, "delta_out_proj")?,
            state: Span::of(&state),
            heads: DeltaHeads {
                k_heads: keys / (2 * k_dim),
                k_dim,
                v_heads,
                v_dim,
                taps,
            },
        })
    }

    /// A Mamba-2 layer's projections, time-step parameters, norm and states
    /// (its head counts read from the scan state's shape and `mamba_groups`).
    fn mamba2(
        d: &Bound<'_, PyDict>,
        in_proj: &Bound<'_, PyAny>,
        dtype: DType,
        tensors: &mut Vec<Py<PyAny>>,
    ) -> PyResult<LayerMixer> {
        let mut tensor = |key: &'static str, dtypes: &[DType], ndim: usize| {
            kept_tensor(d, key, dtypes, ndim, tensors)
        };
        let state = tensor("mamba_state", &[DType::F32], 4)?;
        let (heads, d_state, head_dim) = (state.shape[1], state.shape[2], state.shape[3]);
        let groups: usize = item(d, "mamba_groups")?.extract()?;
        let keys = ("mamba_conv_weight", "mamba_conv_state");
        let (conv_weight, conv_state, ()) = conv_and_state(&mut tensor, keys, dtype, |conv| {
            if groups == 0 || conv != heads * head_dim + 2 * groups * d_state {
                return Err(PyValueError::new_err(format!(
                    "mamba_conv_weight: {conv} channels are not x of {heads} heads of \
                     {head_dim} and B, C of {groups} groups of {d_state}"
                )));
            }
            Ok(())
        })?;
        let (conv_dim, taps) = (conv_weight.shape[0], conv_weight.shape[1]);
        let conv_bias = match d.get_item("mamba_conv_bias")?.filter(|v| !v.is_none()) {
            None => None,
            Some(_) => {
                let t = tensor("mamba_conv_bias", &[dtype], 1)?;
                t.expect_dim(0, conv_dim, "channels of mamba_conv_weight")?;
                Some(Span::of(&t))
            }
        };
        let mut span = |key: &'static str, dtypes: &[DType], dim: usize| {
            let t = tensor(key, dtypes, 1)?;
            t.expect_dim(0, dim, "its layer's heads")?;
            Ok::<_, PyErr>(Span::of(&t))
        };
        let a_log = span("mamba_a_log", &[DType::F32], heads)?;
        let dt_bias = span("mamba_dt_bias", &[DType::F32], heads)?;
        let skip = span("mamba_d", &[DType::F32], heads)?;
        let norm = span("mamba_norm", &[dtype], heads * head_dim)?;
        let dt_limit: (f32, f32) = item(d, "mamba_dt_limit")?.extract()?;
        Ok(LayerMixer::Mamba2 {
            in_proj: linear_weight(in_proj, "mamba_in_proj")?,
            conv_weight: Span::of(&conv_weight),
            conv_bias,
            conv_state: Span::of(&conv_state),
            a_log,
            dt_bias,
            d: skip,
            dt_limit,
            norm,
            out_proj: linear_weight(&item(d, "mamba_out_proj")?, "mamba_out_proj")?,
            state: Span::of(&state),
            heads: MambaHeads {
                heads,
                head_dim,
                groups,
                d_state,
                taps,
            },
        })
    }

    /// Shape check of layer `i` by the pure-Rust side.
    fn check<T: Element>(&self, i: usize) -> PyResult<()> {
        // SAFETY: only lengths are read; nothing runs on these slices.
        let mut layer = unsafe { self.view::<T>(&self.layers[i]) };
        if let Mixer::Attention(a) = &mut layer.mixer {
            a.key_cache = KvCacheMut::Float(&mut []);
            a.value_cache = KvCacheMut::Float(&mut []);
        }
        Ok(decoder::check_layer(&layer, &self.shape, i)?)
    }

    /// One layer's tensors as slices.
    ///
    /// # Safety
    /// As `Span::slice_mut`: the caller runs one step at a time.
    unsafe fn view<'s, T: Element>(&'s self, l: &'s Layer) -> DecoderLayer<'s, T> {
        let mixer = match &l.mixer {
            LayerMixer::Attention {
                qk_norm,
                gate,
                qkv,
                o,
                key_cache,
                value_cache,
                sliding_window,
                softcap,
                group,
                local_rotary,
                rotary,
                sinks,
            } => Mixer::Attention(Attention {
                qk_norm: qk_norm.map(|(q, k)| (q.view(), k.view())),
                gate: *gate,
                qkv,
                o,
                key_cache: self.cache_view(*key_cache),
                value_cache: self.cache_view(*value_cache),
                sliding_window: *sliding_window,
                softcap: *softcap,
                group: *group,
                local_rotary: *local_rotary,
                rotary: *rotary,
                sinks: sinks.map(|s| s.slice::<f32>()),
            }),
            LayerMixer::ShortConv {
                in_proj,
                weight,
                bias,
                out_proj,
                state,
                taps,
            } => Mixer::ShortConv(ShortConv {
                in_proj,
                weight: weight.slice(),
                bias: bias.map(|b| b.slice()),
                out_proj,
                state: state.slice_mut(),
                taps: *taps,
            }),
            LayerMixer::DeltaNet {
                in_proj,
                conv_weight,
                conv_state,
                a_log,
                dt_bias,
                norm,
                out_proj,
                state,
                heads,
            } => Mixer::DeltaNet(DeltaNet {
                in_proj,
                conv_weight: conv_weight.slice(),
                conv_state: conv_state.slice_mut(),
                a_log: a_log.slice(),
                dt_bias: dt_bias.slice(),
                norm: norm.slice(),
                out_proj,
                state: state.slice_mut(),
                heads: *heads,
            }),
            LayerMixer::Mamba2 {
                in_proj,
                conv_weight,
                conv_bias,
                conv_state,
                a_log,
                dt_bias,
                d,
                dt_limit,
                norm,
                out_proj,
                state,
                heads,
            } => Mixer::Mamba2(Mamba2 {
                in_proj,
                conv_weight: conv_weight.slice(),
                conv_bias: conv_bias.map(|b| b.slice()),
                conv_state: conv_state.slice_mut(),
                a_log: a_log.slice(),
                dt_bias: dt_bias.slice(),
                d: d.slice(),
                dt_limit: *dt_limit,
                norm: norm.slice(),
                out_proj,
                state: state.slice_mut(),
                heads: *heads,
            }),
        };
        DecoderLayer {
            input_norm: l.input_norm.map(|n| n.view()),
            post_norm: l.post_norm.map(|n| n.view()),
            mixer_out_norm: l.mixer_out_norm.map(|n| n.view()),
            mlp_out_norm: l.mlp_out_norm.map(|n| n.view()),
            mixer,
            mlp: match &l.mlp {
                LayerMlp::Dense(gate_up, down, act) => Mlp::Dense {
                    gate_up,
                    down,
                    act: *act,
                },
                LayerMlp::Sparse(moe) => Mlp::Sparse(moe),
            },
        }
    }

    /// A cache tensor as the stack's kind of cache.
    ///
    /// # Safety
    /// As `Span::slice_mut`.
    unsafe fn cache_view<'s, T: Element>(&'s self, span: Span) -> KvCacheMut<'s, T> {
        if self.cache_dtype == DType::I8 {
            KvCacheMut::Int8(span.slice_mut())
        } else {
            KvCacheMut::Float(span.slice_mut())
        }
    }

    /// # Safety
    /// As `forward`'s checks: `x` and `rot` hold `T`, and this thread holds `running`.
    unsafe fn run<T: Element>(
        &self,
        py: Python<'_>,
        x: &TensorArg,
        rot: &[TensorArg],
        (slot_mapping, state_slots, groups): (&[i64], &[i64], &[KvGroup<'_>]),
        batch: BatchLayout<'_>,
    ) -> PyResult<()> {
        let xs = x.slice_mut::<T>();
        let step = StepInputs {
            cos: rot[0].slice::<T>(),
            sin: rot[1].slice::<T>(),
            cos_local: rot[2].slice::<T>(),
            sin_local: rot[3].slice::<T>(),
            slot_mapping,
            batch,
            groups,
            cache: self.cache,
            state_slots,
        };
        let shape = &self.shape;
        let mut layers = Views { stack: self };
        py.detach(move || decoder::decoder_stack(xs, &mut layers, shape, &step))?;
        Ok(())
    }
}

/// The stack's layers as `decoder::Layers`: each layer's view made when it
/// runs and dropped after, so that layers sharing a cache tensor (different
/// KV groups) never hold views of it at once.
struct Views<'s> {
    stack: &'s PyDecoderStack,
}

impl<T: Element> Layers<T> for Views<'_> {
    fn count(&self) -> usize {
        self.stack.layers.len()
    }

    fn with<R>(
        &mut self,
        i: usize,
        f: impl FnOnce(&mut DecoderLayer<'_, T>) -> CoreResult<R>,
    ) -> CoreResult<R> {
        // SAFETY: the caller holds `running` (one step at a time) and this
        // view is the only one alive.
        let mut layer = unsafe { self.stack.view::<T>(&self.stack.layers[i]) };
        f(&mut layer)
    }
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDecoderStack>()?;
    Ok(())
}

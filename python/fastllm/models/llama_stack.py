"""The Llama family's (and Gemma's, and the hybrids': LFM2, Qwen3.5, Granite
4.0) decoder layers in one Rust call per step.

On the CPU, once a model is packed and its KV caches exist, the model runner
asks the model to fuse its layers (``LlamaForCausalLM.fuse_decoder_layers``).
``build`` then hands every layer's packed weights, norms and caches to one
``_core.DecoderStack``, and each step's forward pass runs all layers in a
single call (``rust/layers/decoder.rs``) instead of about ten Python-level op
calls per layer. The kernels and their roundings are the same as the
layer-by-layer path, so the hidden states are bit-identical; only the
interpreter, binding and allocator overhead between kernels goes (about 2 ms
of a 12 ms decode step of a 0.5B model).

``FASTLLM_CPU_FUSED=0`` keeps the layer-by-layer path (for comparisons).
"""

from __future__ import annotations

import logging

import torch

from fastllm import _core
from fastllm.forward_context import get_context
from fastllm.layers.moe import SparseMoeBlock
from fastllm.layers.norm import ZeroCenteredRMSNorm

logger = logging.getLogger("fastllm")


def _packed(linear) -> object | None:
    packed = getattr(linear, "packed", None)
    if isinstance(packed, (_core.PackedLinear, _core.QuantizedLinear)):
        return packed
    return None


# The architectures whose decoder maths ``rust/models/llama.rs`` implements
# (pre-norm attention with optional q/k norms and biases, a gated-SiLU MLP);
# ``tests/test_decoder_stack.py`` checks each against the layer-by-layer path.
# A family added to ``models/llama.py`` runs layer by layer until it is added
# here and there.
# The hybrid families, built by ``build_hybrid``: LFM2 (dense and MoE:
# attention layers with q/k norms, and short convolutions whose states the
# runner keeps) and Qwen3.5 (dense and MoE, and the text part of their
# multimodal checkpoints: gated attention with float32 ``1 + w`` norms, and
# Gated DeltaNet layers with their two states) and Granite 4.0 (Granite's
# attention with or without rotary, Mamba-2 layers with their two states, the
# dense MLP, or experts with it as their ungated shared expert).
_HYBRID = frozenset(
    {
        "GraniteMoeHybridForCausalLM",
        "Lfm2ForCausalLM",
        "Lfm2MoeForCausalLM",
        "Qwen3_5ForCausalLM",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeForConditionalGeneration",
    }
)
FUSED_ARCHITECTURES = (
    frozenset(
        {
            "LlamaForCausalLM",
            "MistralForCausalLM",
            "Qwen2ForCausalLM",
            "Qwen3ForCausalLM",
            # Phi-3 / Phi-4-mini: the Llama layers with partial rotary (the stack's
            # rotary_dim) and LongRoPE (in the cos/sin tables the model makes).
            "Phi3ForCausalLM",
            # Mixtures of experts with Llama / Qwen3 attention: a layer's MLP is
            # the dense one or a sparse block (router, routing, grouped experts).
            "Qwen3MoeForCausalLM",
            "Qwen2MoeForCausalLM",
            "MixtralForCausalLM",
            # Granite 3.x (dense and MoE): the residual multiplier in the stack;
            # the attention multiplier is its score scale, and the embedding and
            # logits factors lie outside the decoder layers.
            "GraniteForCausalLM",
            "GraniteMoeForCausalLM",
            # SmolLM3: the Llama layers, some without rotary (NoPE), some
            # windowed (their own KV group).
            "SmolLM3ForCausalLM",
            # OLMo 2: no norms before attention and MLP, norms of their
            # outputs, and q/k norms over the whole projections.
            "Olmo2ForCausalLM",
            # Gemma 2 / 3 (and the text part of Gemma 3's multimodal checkpoints):
            # four norms a layer, GeGLU, soft-capped scores (Gemma 2), local
            # layers in a KV group of their own and, in Gemma 3, rotated by their
            # own tables.
            "Gemma2ForCausalLM",
            "Gemma3ForCausalLM",
            "Gemma3ForConditionalGeneration",
            # gpt-oss: biased q/k/v and o, a sink logit per head, sliding and
            # full layers alternating (KV groups), experts with biases, a
            # biased router and the clamped SwiGLU (the MoE kernel's).
            "GptOssForCausalLM",
        }
    )
    | _HYBRID
)


def why_not(model) -> str | None:
    """Why the decoder layers of ``model`` (a Llama-family model) cannot run
    as one stack, or None when they can. The model names the layer classes
    whose maths the stack implements (``FUSED_LAYER_TYPES``): a subclass that
    changes them runs layer by layer."""
    arch = model.config.architecture
    if arch not in FUSED_ARCHITECTURES:
        return f"the fused stack does not implement {arch}"
    if arch in _HYBRID:
        return _hybrid_why_not(model)
    layer_type, attn_type, mlp_types = model.FUSED_LAYER_TYPES
    for i, layer in enumerate(model.model.layers):
        kinds = ((layer, (layer_type,)), (layer.self_attn, (attn_type,)), (layer.mlp, mlp_types))
        if any(type(part) not in kind for part, kind in kinds):
            return f"layer {i} is not the {layer_type.__name__} the fused stack implements"
        attn, mlp = layer.self_attn, layer.mlp
        reason = _mlp_why_not(mlp)
        if reason is not None:
            return f"layer {i}'s {reason}"
        if _residual_multiplier(layer) != _residual_multiplier(model.model.layers[0]):
            return f"layer {i}'s residual multiplier differs from layer 0's"
        norms = [n for n in _layer_norms(layer).values() if n is not None]
        dtype = norms[0].weight.dtype
        reason = _attention_why_not(attn, dtype)
        if reason is not None:
            return f"layer {i}'s {reason}"
        if any(n.weight.dtype != dtype for n in norms):
            return f"layer {i}'s norm weights are not all in one dtype ({dtype})"
    return None


def _layer_norms(layer) -> dict:
    """A Llama-family layer's norms by the stack's names: Llama's two,
    Gemma's four (its norm before the MLP is the stack's ``post_norm``; its
    norms of the attention and MLP outputs the ``*_out_norm``) or OLMo 2's
    two output norms (None: no such norm)."""
    if not hasattr(layer, "input_layernorm"):
        return {
            "input_norm": None,
            "post_norm": None,
            "mixer_out_norm": layer.post_attention_layernorm,
            "mlp_out_norm": layer.post_feedforward_layernorm,
        }
    if hasattr(layer, "pre_feedforward_layernorm"):
        return {
            "input_norm": layer.input_layernorm,
            "post_norm": layer.pre_feedforward_layernorm,
            "mixer_out_norm": layer.post_attention_layernorm,
            "mlp_out_norm": layer.post_feedforward_layernorm,
        }
    return {
        "input_norm": layer.input_layernorm,
        "post_norm": layer.post_attention_layernorm,
        "mixer_out_norm": None,
        "mlp_out_norm": None,
    }


def _attention_why_not(attn, dtype: torch.dtype) -> str | None:
    """Why an attention (a ``LlamaAttention``) cannot run in the stack, or None."""
    if attn.ops.backend != "rust":
        return f"attention runs the {attn.ops.backend} ops"
    if any(_packed(lin) is None for lin in (attn.qkv_proj, attn.o_proj)):
        return "attention has a linear layer that is not packed"
    if attn.attn.k_cache is None or attn.attn.v_cache is None:
        return "attention has no KV cache"
    cache_dtype = attn.attn.k_cache.dtype
    if cache_dtype not in (dtype, torch.int8):
        return f"KV cache is {cache_dtype}, not the model's {dtype} or int8"
    norms = [n for n in (attn.q_norm, attn.k_norm) if n is not None]
    if any(n.weight.dtype != dtype for n in norms):
        return f"q/k norm weights are not in the model's dtype ({dtype})"
    return None


def _hybrid_parts(layer) -> tuple:
    """A hybrid layer's (input norm, post norm, recurrent mixer or None,
    attention or None, MLP): LFM2's names or Qwen3.5's."""
    if hasattr(layer, "operator_norm"):
        return layer.operator_norm, layer.ffn_norm, layer.conv, layer.self_attn, layer.feed_forward
    if hasattr(layer, "mamba"):  # Granite 4.0
        return (
            layer.input_layernorm,
            layer.post_attention_layernorm,
            layer.mamba,
            layer.self_attn,
            layer.mlp,
        )
    return (
        layer.input_layernorm,
        layer.post_attention_layernorm,
        layer.linear_attn,
        layer.self_attn,
        layer.mlp,
    )


def _mixer_kind(mixer) -> str:
    """A recurrent mixer's kind: "mamba" (Granite 4.0's Mamba-2, which has a
    skip ``D``), "delta" (Qwen3.5's Gated DeltaNet) or "conv" (LFM2's)."""
    if hasattr(mixer, "D"):
        return "mamba"
    return "delta" if hasattr(mixer, "A_log") else "conv"


def _norm_weight(norm) -> torch.Tensor:
    """The weight the stack gives a norm: its own, or a zero-centred norm's
    ``1 + w`` in float32 (the stack then normalises in float32)."""
    if isinstance(norm, ZeroCenteredRMSNorm):
        return norm.scale()
    return norm.weight.detach()


def _hybrid_why_not(model) -> str | None:
    """``why_not`` for the hybrids (LFM2, Qwen3.5): their attention layers as
    the Llama ones, their recurrent mixers packed, with their states, in the
    model's dtype (the layer, attention, mixer and MLP classes:
    ``FUSED_LAYER_TYPES``)."""
    layer_type, attn_type, mixer_type, mlp_types = model.FUSED_LAYER_TYPES
    layers = model.model.layers
    if not any(layer.self_attn is not None for layer in layers):
        return "the model has no attention layer"
    dtype = _hybrid_parts(layers[0])[0].weight.dtype
    for i, layer in enumerate(layers):
        if type(layer) is not layer_type:
            return f"layer {i} is not the {layer_type.__name__} the fused stack implements"
        if _residual_multiplier(layer) != _residual_multiplier(layers[0]):
            return f"layer {i}'s residual multiplier differs from layer 0's"
        in_norm, post_norm, mixer, attn, mlp = _hybrid_parts(layer)
        if type(mlp) not in mlp_types:
            return f"layer {i}'s MLP is not one the fused stack implements"
        reason = _mlp_why_not(mlp)
        if reason is not None:
            return f"layer {i}'s {reason}"
        if any(n.weight.dtype != dtype for n in (in_norm, post_norm)):
            return f"layer {i}'s norm weights are not all in one dtype ({dtype})"
        if mixer is None:
            if type(attn) is not attn_type:
                return f"layer {i}'s attention is not the one the fused stack implements"
            reason = _attention_why_not(attn, dtype)
            if reason is not None:
                return f"layer {i}'s {reason}"
            continue
        if type(mixer) is not mixer_type or mixer.ops.backend != "rust":
            return f"layer {i}'s recurrent mixer runs the {mixer.ops.backend} ops"
        if any(_packed(lin) is None for lin in (mixer.in_proj, mixer.out_proj)):
            return f"layer {i}'s recurrent mixer has a linear layer that is not packed"
        want = [dt for _, dt in mixer.state_shapes(dtype)]
        if [t.dtype for t in mixer.states] != want:
            return f"layer {i}'s recurrent mixer has no states of {want}"
        kind = _mixer_kind(mixer)
        if kind == "mamba":
            bias = mixer.conv1d.bias
            tensors = [mixer.conv1d.weight, mixer.norm.weight] + (
                [bias] if bias is not None else []
            )
        elif kind == "delta":
            tensors = [mixer.conv1d.weight, mixer.norm.weight]
        else:
            tensors = [mixer.conv.weight] + (
                [mixer.conv.bias] if mixer.conv.bias is not None else []
            )
        if any(t.dtype != dtype for t in tensors):
            return f"layer {i}'s recurrent mixer weights are not in the model's dtype ({dtype})"
    return None


def _residual_multiplier(layer) -> float:
    """The factor on a layer's residual branches (Granite's; 1: none)."""
    m = getattr(layer, "residual_multiplier", None)
    return 1.0 if m is None else float(m)


def _mlp_why_not(mlp) -> str | None:
    """Why a layer's MLP (dense, or a ``SparseMoeBlock``) cannot run in the
    stack, or None."""
    if isinstance(mlp, SparseMoeBlock):
        return "experts are not packed" if mlp.packed_kernel() is None else None
    if any(_packed(lin) is None for lin in (mlp.gate_up_proj, mlp.down_proj)):
        return "MLP has a linear layer that is not packed"
    if not (mlp.act.fused_silu or mlp.act.fused_gelu_tanh):
        return "activation is neither SiLU nor the tanh GELU"
    return None


def _mlp_entries(mlp) -> dict:
    """A layer dict's MLP entries: ``gate_up`` / ``down``, or ``moe``."""
    if isinstance(mlp, SparseMoeBlock):
        return {"gate_up": None, "down": None, "moe": mlp.packed_kernel()}
    return {
        "gate_up": _packed(mlp.gate_up_proj),
        "down": _packed(mlp.down_proj),
        "moe": None,
        "mlp_act": "silu" if mlp.act.fused_silu else "gelu_tanh",
    }


def _attention_entries(attn, local_rotary: bool = False) -> dict:
    """A layer dict's attention entries (``local_rotary``: the layer turns by
    the model's local tables, Gemma 3's local layers)."""
    # Sink logits (gpt-oss's): those the attention op holds, else the
    # module's own (the op takes them at its first call).
    sinks = attn.attn.sinks if attn.attn.sinks is not None else getattr(attn, "sinks", None)
    return {
        "logit_softcap": attn.attn.logit_softcap or 0.0,
        "kv_group": attn.attn.kv_group,
        "local_rotary": local_rotary,
        "rotary": attn.use_rope,
        "q_norm": None if attn.q_norm is None else attn.q_norm.weight.detach(),
        "k_norm": None if attn.k_norm is None else attn.k_norm.weight.detach(),
        "qkv": _packed(attn.qkv_proj),
        "o": _packed(attn.o_proj),
        "key_cache": attn.attn.k_cache,
        "value_cache": attn.attn.v_cache,
        "sliding_window": attn.attn.sliding_window or 0,
        "sinks": None if sinks is None else sinks.detach().float().contiguous(),
    }


def _stack(model, layers: list[dict], attn, norm, mlps: list) -> _core.DecoderStack:
    """The ``_core.DecoderStack`` of ``layers`` (dicts), its shape from an
    attention layer ``attn``, the first input norm ``norm`` and the MLPs."""
    c = model.config
    dense = [m for m in mlps if not isinstance(m, SparseMoeBlock)]
    # The dense MLPs' size (a model of experts only: the config's, unused).
    intermediate = dense[0].down_proj.in_features if dense else c.intermediate_size
    return _core.DecoderStack(
        layers,
        hidden_size=c.hidden_size,
        num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        rotary_dim=model.rotary.rotary_dim,
        intermediate_size=intermediate,
        eps=norm.eps,
        scale=attn.attn.scale,
        residual_multiplier=_residual_multiplier(model.model.layers[0]),
        dtype=norm.weight.dtype,
    )


def _recurrent_entries(mixer) -> dict:
    """A layer dict's entries for a recurrent mixer: a short convolution's
    ``conv_*``, a Gated DeltaNet's ``delta_*`` or a Mamba-2's ``mamba_*``."""
    kind = _mixer_kind(mixer)
    if kind == "mamba":
        conv_state, state = mixer.states
        bias = mixer.conv1d.bias
        return {
            "mamba_in_proj": _packed(mixer.in_proj),
            "mamba_conv_weight": mixer.conv1d.weight.detach().view(mixer.conv_dim, mixer.taps),
            "mamba_conv_bias": None if bias is None else bias.detach(),
            "mamba_conv_state": conv_state,
            "mamba_a_log": mixer.A_log.detach().float().contiguous(),
            "mamba_dt_bias": mixer.dt_bias.detach().float().contiguous(),
            "mamba_d": mixer.D.detach().float().contiguous(),
            "mamba_dt_limit": mixer.time_step_limit,
            "mamba_groups": mixer.groups,
            "mamba_norm": mixer.norm.weight.detach(),
            "mamba_out_proj": _packed(mixer.out_proj),
            "mamba_state": state,
        }
    if kind == "delta":
        conv_state, state = mixer.states
        return {
            "delta_in_proj": _packed(mixer.in_proj),
            "delta_conv_weight": mixer.conv1d.weight.detach().view(mixer.conv_dim, mixer.taps),
            "delta_conv_state": conv_state,
            "delta_a_log": mixer.A_log.detach().float().contiguous(),
            "delta_dt_bias": mixer.dt_bias.detach().float().contiguous(),
            "delta_norm": mixer.norm.weight.detach(),
            "delta_out_proj": _packed(mixer.out_proj),
            "delta_state": state,
        }
    bias = mixer.conv.bias
    return {
        "conv_in_proj": _packed(mixer.in_proj),
        "conv_weight": mixer.conv.weight.detach().view(mixer.hidden, mixer.taps),
        "conv_bias": None if bias is None else bias.detach(),
        "conv_out_proj": _packed(mixer.out_proj),
        "conv_state": mixer.states[0],
    }


def build_hybrid(model) -> _core.DecoderStack:
    """A hybrid's layers as one stack (``why_not`` said they can): attention
    layers as the Llama ones (with Qwen3.5's output gate and float32 norms),
    recurrent layers with their projections, parameters and the runner's
    state tensors."""
    layers = []
    for layer in model.model.layers:
        in_norm, post_norm, mixer, attn, mlp = _hybrid_parts(layer)
        entry = {
            "input_norm": _norm_weight(in_norm),
            "post_norm": _norm_weight(post_norm),
            **_mlp_entries(mlp),
        }
        if mixer is None:
            entry.update(_attention_entries(attn))
            if attn.q_norm is not None and attn.k_norm is not None:
                entry["q_norm"], entry["k_norm"] = map(_norm_weight, (attn.q_norm, attn.k_norm))
            entry["attn_output_gate"] = getattr(attn, "OUTPUT_GATE", False)
        else:
            entry.update(_recurrent_entries(mixer))
        layers.append(entry)
    attn = next(layer.self_attn for layer in model.model.layers if layer.self_attn is not None)
    parts = [_hybrid_parts(layer) for layer in model.model.layers]
    return _stack(model, layers, attn, parts[0][0], [p[4] for p in parts])


def build(model) -> _core.DecoderStack | None:
    """One ``_core.DecoderStack`` over the decoder layers of ``model``, or
    None (with the reason logged) when they must run layer by layer."""
    reason = why_not(model)
    if reason is not None:
        logger.debug("decoder layers run one by one: %s", reason)
        return None
    if model.config.architecture in _HYBRID:
        return build_hybrid(model)
    layers = []
    local = _local_layers(model)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        norms = {
            k: None if n is None else n.weight.detach() for k, n in _layer_norms(layer).items()
        }
        layers.append({**norms, **_attention_entries(attn, local[i]), **_mlp_entries(mlp)})
    first = model.model.layers[0]
    mlps = [layer.mlp for layer in model.model.layers]
    norm = next(n for n in _layer_norms(first).values() if n is not None)
    return _stack(model, layers, first.self_attn, norm, mlps)


def _local_layers(model) -> list[bool]:
    """Which layers turn by the model's local rotary tables (Gemma 3's local
    layers; none in a model with one pair of tables)."""
    n = len(model.model.layers)
    if getattr(model, "rotary_local", None) is None:
        return [False] * n
    return list(model.local_layers)


def run(
    stack: _core.DecoderStack,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    local: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Runs every decoder layer on ``x`` [tokens, hidden] in place, with the
    step's rotary tables (``local``: the local layers' own, Gemma 3) and
    attention metadata (its KV groups' tables too)."""
    meta = get_context()
    n = x.shape[0]
    cos_local, sin_local = (None, None) if local is None else (t.view(n, -1) for t in local)
    stack.forward(
        x,
        cos.view(n, -1),
        sin.view(n, -1),
        meta.slot_mapping,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.state_slots,
        cos_local,
        sin_local,
        meta.group_slot_mappings,
        meta.group_block_tables,
    )

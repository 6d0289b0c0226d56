"""The Llama family's decoder layers in one Rust call per step.

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
FUSED_ARCHITECTURES = frozenset(
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
    }
)


def why_not(model) -> str | None:
    """Why the decoder layers of ``model`` (a Llama-family model) cannot run
    as one stack, or None when they can. The model names the layer classes
    whose maths the stack implements (``FUSED_LAYER_TYPES``): a subclass that
    changes them runs layer by layer."""
    arch = model.config.architecture
    if arch not in FUSED_ARCHITECTURES:
        return f"the fused stack does not implement {arch}"
    layer_type, attn_type, mlp_types = model.FUSED_LAYER_TYPES
    for i, layer in enumerate(model.model.layers):
        kinds = ((layer, (layer_type,)), (layer.self_attn, (attn_type,)), (layer.mlp, mlp_types))
        if any(type(part) not in kind for part, kind in kinds):
            return f"layer {i} is not the Llama layer the fused stack implements"
        attn, mlp = layer.self_attn, layer.mlp
        if attn.ops.backend != "rust":
            return f"layer {i} runs the {attn.ops.backend} ops"
        if any(_packed(lin) is None for lin in (attn.qkv_proj, attn.o_proj)):
            return f"layer {i} has a linear layer that is not packed"
        reason = _mlp_why_not(mlp)
        if reason is not None:
            return f"layer {i}'s {reason}"
        if _residual_multiplier(layer) != _residual_multiplier(model.model.layers[0]):
            return f"layer {i}'s residual multiplier differs from layer 0's"
        if attn.attn.k_cache is None or attn.attn.v_cache is None:
            return f"layer {i} has no KV cache"
        if attn.attn.kv_group != 0:
            return f"layer {i} keeps its own block table (windowed and full layers mixed)"
        if attn.attn.sinks is not None:
            return f"layer {i}'s attention has sinks, which the fused stack does not implement"
        dtype = layer.input_layernorm.weight.dtype
        cache_dtype = attn.attn.k_cache.dtype
        if cache_dtype not in (dtype, torch.int8):
            return f"layer {i}'s KV cache is {cache_dtype}, not the model's {dtype} or int8"
        norms = [layer.post_attention_layernorm]
        norms += [n for n in (attn.q_norm, attn.k_norm) if n is not None]
        if any(n.weight.dtype != dtype for n in norms):
            return f"layer {i}'s norm weights are not all in one dtype ({dtype})"
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
    if not mlp.act.fused_silu:
        return "activation is not SiLU"
    return None


def _mlp_entries(mlp) -> dict:
    """A layer dict's MLP entries: ``gate_up`` / ``down``, or ``moe``."""
    if isinstance(mlp, SparseMoeBlock):
        return {"gate_up": None, "down": None, "moe": mlp.packed_kernel()}
    return {"gate_up": _packed(mlp.gate_up_proj), "down": _packed(mlp.down_proj), "moe": None}


def build(model) -> _core.DecoderStack | None:
    """One ``_core.DecoderStack`` over the decoder layers of ``model``, or
    None (with the reason logged) when they must run layer by layer."""
    reason = why_not(model)
    if reason is not None:
        logger.debug("decoder layers run one by one: %s", reason)
        return None
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        layers.append(
            {
                "input_norm": layer.input_layernorm.weight.detach(),
                "post_norm": layer.post_attention_layernorm.weight.detach(),
                "q_norm": None if attn.q_norm is None else attn.q_norm.weight.detach(),
                "k_norm": None if attn.k_norm is None else attn.k_norm.weight.detach(),
                "qkv": _packed(attn.qkv_proj),
                "o": _packed(attn.o_proj),
                **_mlp_entries(mlp),
                "key_cache": attn.attn.k_cache,
                "value_cache": attn.attn.v_cache,
                "sliding_window": attn.attn.sliding_window or 0,
            }
        )
    first = model.model.layers[0]
    c = model.config
    dense = [layer.mlp for layer in model.model.layers if not isinstance(layer.mlp, SparseMoeBlock)]
    # The dense MLPs' size (a model of experts only: the config's, unused).
    intermediate = dense[0].down_proj.in_features if dense else c.intermediate_size
    return _core.DecoderStack(
        layers,
        hidden_size=c.hidden_size,
        num_heads=first.self_attn.num_heads,
        num_kv_heads=first.self_attn.num_kv_heads,
        head_dim=first.self_attn.head_dim,
        rotary_dim=model.rotary.rotary_dim,
        intermediate_size=intermediate,
        eps=first.input_layernorm.eps,
        scale=first.self_attn.attn.scale,
        residual_multiplier=_residual_multiplier(first),
    )


def run(stack: _core.DecoderStack, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Runs every decoder layer on ``x`` [tokens, hidden] in place, with the
    step's rotary tables and attention metadata."""
    meta = get_context()
    n = x.shape[0]
    stack.forward(
        x,
        cos.view(n, -1),
        sin.view(n, -1),
        meta.slot_mapping,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
    )

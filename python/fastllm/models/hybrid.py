"""Hybrid recurrent models: most layers keep a fixed-size recurrent state
(``layers/recurrent.py``), a few attend over the paged KV cache.

* **Qwen3.5** (``Qwen3_5ForCausalLM``, and the text part of
  ``Qwen3_5ForConditionalGeneration`` checkpoints): ``layer_types`` of
  ``linear_attention`` (Gated DeltaNet) and ``full_attention`` layers (by
  default every ``full_attention_interval``-th). A Gated DeltaNet layer
  projects q/k/v (one causal convolution with SiLU over all three), the
  output gate z and the per-head ``b`` (write strength ``beta = sigmoid(b)``)
  and ``a`` (decay ``g = -exp(A_log) * softplus(a + dt_bias)``), runs the
  gated delta rule with L2-normalised q and k, and normalises each head's
  output by an RMSNorm gated by ``silu(z)``. Its attention layers have a
  sigmoid output gate (q_proj yields the query and the gate of each head),
  per-head q/k norms and partial rotary (``partial_rotary_factor``). Every
  other RMSNorm scales by ``1 + w``, computed in float32 as the reference
  does (``ZeroCenteredRMSNorm``).
* **LFM2** (``Lfm2ForCausalLM``): ``conv`` layers (in_proj to B, C and x,
  ``C * conv(B * x)`` with a short depthwise causal convolution,
  ``conv_L_cache`` taps) and ``full_attention`` layers (``full_attn_idxs``)
  with per-head q/k norms; SwiGLU MLPs whose width follows
  ``block_auto_adjust_ff_dim``; the final norm is ``embedding_norm``.

* **Granite 4.0** (``GraniteMoeHybridForCausalLM``): ``layer_types`` of
  Mamba-2 (``mamba``) and attention layers with Granite's multipliers. A
  Mamba-2 layer projects the gate z, the channels x, B, C (one causal
  convolution with SiLU) and a time step per head; its scan ``S = exp(dt A)
  S + dt B x^T``, ``y = S^T C + D x`` is the Gated DeltaNet kernel's linear
  rule; the output is gated by ``silu(z)`` and RMS-normalised per group.
  The dense ``shared_mlp``, or with experts a sparse block whose ungated
  shared expert is that MLP.

* **Qwen3.5-MoE** (``Qwen3_5MoeForCausalLM``, and the text part of
  ``Qwen3_5MoeForConditionalGeneration`` checkpoints) and **LFM2-MoE**
  (``Lfm2MoeForCausalLM``): the same layers with sparse MLPs
  (``layers/moe.py``): Qwen3.5-MoE's every MLP softmax top-k experts and a
  gated shared expert; LFM2-MoE's after the first ``num_dense_layers``
  sigmoid-scored experts chosen with an ``expert_bias``, renormalised and
  scaled by ``routed_scaling_factor``.

On the CPU, once packed, every one of these families runs its layers in the
fused decoder stack (``llama_stack.build_hybrid``: a layer's mixer is
attention, with Qwen3.5's output gate and float32 ``1 + w`` norms, the short
convolution, the Gated DeltaNet or the Mamba-2); elsewhere (or with ``FASTLLM_CPU_FUSED=0``)
layer by layer, with the model's op table for every kernel (Qwen3.5's gates
and gated norm included, so that both paths round alike).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fastllm.config import ModelConfig
from fastllm.forward_context import get_context
from fastllm.layers import Module
from fastllm.layers.attention import PagedAttention
from fastllm.layers.linear import Linear
from fastllm.layers.moe import SparseMoeBlock
from fastllm.layers.norm import RMSNorm, ZeroCenteredRMSNorm
from fastllm.layers.ops import TORCH_OPS
from fastllm.models.llama import (
    QKV,
    GraniteForCausalLM,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    fused_specs,
)
from fastllm.models.moe import expert_weight_specs, is_sparse, moe_flags, sparse_block
from fastllm.models.weights import WeightSpec


def _config_int(hf: dict[str, Any], name: str, default: int) -> int:
    value = hf.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}")
    return value


def hybrid_layer_types(config: ModelConfig, recurrent: str, default: list[str]) -> list[str]:
    """The config's ``layer_types`` (each ``recurrent`` or ``full_attention``),
    or the family's ``default``; a ValueError naming the field otherwise."""
    types = config.hf.get("layer_types") or default
    n = config.num_hidden_layers
    if len(types) != n or any(t not in (recurrent, "full_attention") for t in types):
        raise ValueError(
            f"config.json: layer_types must list {n} of {recurrent!r} and 'full_attention', "
            f"got {types!r}"
        )
    return list(types)


class ConvWeight(Module):
    """A depthwise convolution's parameters as checkpoints store them:
    ``weight`` [channels, 1, taps] and an optional ``bias`` [channels]."""

    def __init__(self, channels: int, taps: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, taps), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None


class GatedRMSNorm(Module):
    """Qwen3.5's head norm: ``RMSNorm(x) * w`` (in x's dtype) times ``silu(z)``
    in float32, rounded to x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.ops = TORCH_OPS

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.ops.gated_rms_norm(x, z, self.weight, self.eps)


class ConvScanMixer(Module):
    """What Gated DeltaNet and Mamba-2 share: a causal depthwise convolution
    with SiLU over their ``conv_dim`` channels (``conv1d``, ``taps`` taps),
    then a scan whose state is one float32 matrix of ``scan_state`` per
    sequence. ``states`` ([conv state, scan state]) are set by the model
    runner from ``state_shapes``."""

    conv_dim: int
    taps: int
    conv1d: ConvWeight
    #: One sequence's scan state: [heads, rows, columns].
    scan_state: tuple[int, int, int]

    def state_shapes(self, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """One sequence's state: the convolution's last inputs and the scan's matrices."""
        return [((self.conv_dim, self.taps - 1), dtype), (self.scan_state, torch.float32)]

    def convolve(self, channels: torch.Tensor) -> torch.Tensor:
        """SiLU of the causal convolution of ``channels`` [T, conv_dim] over the
        step's sequences, each from its state (updated in place)."""
        meta = get_context()
        return self.ops.causal_conv1d(
            channels.contiguous(),
            self.conv1d.weight.view(self.conv_dim, self.taps),
            self.conv1d.bias,
            self.states[0],
            meta.query_start_loc,
            meta.state_slots,
            True,
        )


class GatedDeltaNet(ConvScanMixer):
    """Qwen3.5's linear-attention layer (module docstring). Its state per
    sequence: the convolution's last inputs and one [Dk, Dv] matrix per value head."""

    def __init__(self, config: ModelConfig, eps: float) -> None:
        super().__init__()
        hf = config.hf
        self.num_k_heads = _config_int(hf, "linear_num_key_heads", 16)
        self.num_v_heads = _config_int(hf, "linear_num_value_heads", 32)
        self.head_k_dim = _config_int(hf, "linear_key_head_dim", 128)
        self.head_v_dim = _config_int(hf, "linear_value_head_dim", 128)
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"config.json: linear_num_value_heads ({self.num_v_heads}) must be a multiple "
                f"of linear_num_key_heads ({self.num_k_heads})"
            )
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.taps = _config_int(hf, "linear_conv_kernel_dim", 4)
        # q/k/v, z, b and a in one projection (``weight_specs``)
        self.in_proj = Linear(
            config.hidden_size, self.conv_dim + self.value_dim + 2 * self.num_v_heads
        )
        self.conv1d = ConvWeight(self.conv_dim, self.taps, False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(self.head_v_dim, eps)
        self.out_proj = Linear(self.value_dim, config.hidden_size)
        self.ops = TORCH_OPS
        self.scan_state = (self.num_v_heads, self.head_k_dim, self.head_v_dim)
        self.states: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        meta = get_context()
        n, hv = x.shape[0], self.num_v_heads
        mixed, z, b, a = self.in_proj(x).split([self.conv_dim, self.value_dim, hv, hv], dim=-1)
        mixed = self.convolve(mixed)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        g, beta = self.ops.delta_gates(a, b, self.A_log, self.dt_bias)
        out = self.ops.gated_delta_rule(
            q.reshape(n, self.num_k_heads, self.head_k_dim),
            k.reshape(n, self.num_k_heads, self.head_k_dim),
            v.reshape(n, hv, self.head_v_dim),
            g,
            beta,
            self.states[1],
            meta.query_start_loc,
            meta.state_slots,
            self.head_k_dim**-0.5,
            True,
        )
        out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(n, self.value_dim))


class GatedAttention(LlamaAttention):
    """Qwen3.5's attention: q_proj yields each head's query and output gate
    (interleaved per head), q/k normalised per head, partial rotary, and
    the attention output multiplied by ``sigmoid(gate)`` before o_proj."""

    #: The fused stack's ``attn_output_gate`` (``llama_stack.build_hybrid``).
    OUTPUT_GATE = True

    def __init__(self, config: ModelConfig, layer: int, eps: float) -> None:
        bias = bool(config.hf.get("attention_bias", False))
        super().__init__(config, layer, bias, bias, True, eps)
        self.qkv_proj = Linear(config.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        n, d = x.shape[0], self.head_dim
        qg, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        qg = qg.reshape(n, self.num_heads, 2 * d)
        gate = qg[..., d:].reshape(n, self.q_size)
        q = self.q_norm(qg[..., :d].contiguous())
        k = self.k_norm(k.reshape(n, self.num_kv_heads, d))
        q, k = self.ops.rotary(q, cos, sin), self.ops.rotary(k, cos, sin)
        out = self.attn(q, k, v)
        return self.o_proj(self.ops.sigmoid_mul(out, gate))


class Qwen3_5DecoderLayer(Module):
    """Pre-norm block whose mixer is a Gated DeltaNet or a gated attention."""

    def __init__(self, config: ModelConfig, layer: int, flags: dict[str, Any]) -> None:
        super().__init__()
        eps = float(config.hf.get("rms_norm_eps", 1e-6))
        if flags["layer_types"][layer] == "linear_attention":
            self.linear_attn: GatedDeltaNet | None = GatedDeltaNet(config, eps)
            self.self_attn: GatedAttention | None = None
        else:
            self.linear_attn, self.self_attn = None, GatedAttention(config, layer, eps)
        self.mlp: Module = (
            sparse_block(config, flags) if is_sparse(flags, layer) else LlamaMLP.of(config, False)
        )
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        h = self.input_layernorm(x)
        if self.linear_attn is not None:
            x = x + self.linear_attn(h)
        else:
            assert self.self_attn is not None
            x = x + self.self_attn(h, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridForCausalLM(LlamaForCausalLM):
    """What the hybrid families share: the mixers' lists for the runner. On
    the CPU, once packed, every layer runs in one ``_core.DecoderStack`` call
    per step (``llama_stack.build_hybrid``)."""

    def attention_layers(self) -> list[PagedAttention]:
        """The paged-attention layers (the recurrent ones have no KV cache)."""
        return [layer.self_attn.attn for layer in self.model.layers if layer.self_attn is not None]

    def recurrent_layers(self) -> list[Module]:
        """The recurrent mixers, in order, for the runner to give state slots."""
        return [m for m in self.modules() if hasattr(m, "state_shapes")]


class Qwen3_5ForCausalLM(HybridForCausalLM):
    """Qwen3.5 (text): Gated DeltaNet and gated-attention layers."""

    LAYER_CLASS = Qwen3_5DecoderLayer
    #: The classes whose maths ``rust/models/llama.rs`` implements for Qwen3.5:
    #: the layer, its attention, its Gated DeltaNet, its MLPs.
    FUSED_LAYER_TYPES = (
        Qwen3_5DecoderLayer,
        GatedAttention,
        GatedDeltaNet,
        (LlamaMLP, SparseMoeBlock),
    )

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        eps = float(config.hf.get("rms_norm_eps", 1e-6))
        self.model.norm = ZeroCenteredRMSNorm(config.hidden_size, eps)
        if config.hf.get("text_part_of"):
            self.checkpoint_prefix_aliases = (("model.", "model.language_model."),)

    @staticmethod
    def _flags(config: ModelConfig) -> dict[str, Any]:
        n = config.num_hidden_layers
        interval = _config_int(config.hf, "full_attention_interval", 4)
        default = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)
        ]
        return {"layer_types": hybrid_layer_types(config, "linear_attention", default)}

    def weight_specs(self) -> dict[str, WeightSpec]:
        """Fused projections (the norms keep their ``w``: ``ZeroCenteredRMSNorm``)."""
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        specs: dict[str, WeightSpec] = {}
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}"
            if layer.self_attn is not None:
                qkv = layer.self_attn.qkv_proj
                specs.update(fused_specs(p, qkv, "self_attn.qkv_proj", QKV, (2 * q, kv, kv)))
            else:
                la = layer.linear_attn
                specs[f"{p}.linear_attn.in_proj.weight"] = WeightSpec(
                    tuple(f"{p}.linear_attn.in_proj_{n}.weight" for n in ("qkv", "z", "b", "a")),
                    (la.conv_dim, la.value_dim, la.num_v_heads, la.num_v_heads),
                )
            if isinstance(layer.mlp, SparseMoeBlock):
                specs.update(expert_weight_specs(layer.mlp, f"{p}.mlp", f"{p}.mlp"))
                continue
            m = c.intermediate_size
            specs[f"{p}.mlp.gate_up_proj.weight"] = WeightSpec(
                (f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"), (m, m)
            )
        return specs


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE (Qwen3.5-35B-A3B, Qwen3.6-35B-A3B; text): Qwen3.5's layers
    with every MLP a sparse block of softmax top-k experts (always
    renormalised) and a shared expert behind a sigmoid gate."""

    @staticmethod
    def _flags(config: ModelConfig) -> dict[str, Any]:
        return {
            **Qwen3_5ForCausalLM._flags(config),
            **moe_flags(config, "moe_intermediate_size", every_layer=True),
            "renormalize": True,
            "shared_intermediate": _config_int(
                config.hf, "shared_expert_intermediate_size", config.intermediate_size
            ),
        }


class ShortConv(Module):
    """LFM2's convolution mixer: ``out_proj(C * conv(B * x))`` with B, C, x
    from one projection and a depthwise causal convolution of ``conv_L_cache`` taps."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        bias = bool(config.hf.get("conv_bias", False))
        self.hidden = h
        self.taps = _config_int(config.hf, "conv_L_cache", 3)
        self.in_proj = Linear(h, 3 * h, bias=bias)
        self.conv = ConvWeight(h, self.taps, bias)
        self.out_proj = Linear(h, h, bias=bias)
        self.ops = TORCH_OPS
        self.states: list[torch.Tensor] = []

    def state_shapes(self, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """One sequence's state: the convolution's last inputs."""
        return [((self.hidden, self.taps - 1), dtype)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        meta = get_context()
        b, c, xx = self.in_proj(x).chunk(3, dim=-1)
        weight = self.conv.weight.view(self.hidden, self.taps)
        y = self.ops.causal_conv1d(
            (b * xx).contiguous(),
            weight,
            self.conv.bias,
            self.states[0],
            meta.query_start_loc,
            meta.state_slots,
            False,
        )
        return self.out_proj(c * y)


def lfm2_intermediate_size(config: ModelConfig) -> int:
    """LFM2's MLP width: ``intermediate_size``, or with ``block_auto_adjust_ff_dim``
    two thirds of it times ``block_ffn_dim_multiplier``, rounded up to a
    multiple of ``block_multiple_of``."""
    hf, size = config.hf, config.intermediate_size
    if not hf.get("block_auto_adjust_ff_dim", True):
        return size
    size = int(2 * size / 3)
    multiplier = hf.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        size = int(multiplier * size)
        step = _config_int(hf, "block_multiple_of", 256)
        size = step * ((size + step - 1) // step)
    return size


class Lfm2DecoderLayer(Module):
    """Pre-norm block: a short convolution or attention, then the SwiGLU MLP."""

    def __init__(self, config: ModelConfig, layer: int, flags: dict[str, Any]) -> None:
        super().__init__()
        eps = float(config.hf.get("norm_eps", 1e-5))
        if flags["layer_types"][layer] == "conv":
            self.conv: ShortConv | None = ShortConv(config)
            self.self_attn: LlamaAttention | None = None
        else:
            self.conv = None
            self.self_attn = LlamaAttention(config, layer, False, False, True, eps)
        if is_sparse(flags, layer):
            self.feed_forward: Module = sparse_block(config, flags, "silu")
        else:
            width = flags.get("dense_intermediate") or lfm2_intermediate_size(config)
            self.feed_forward = LlamaMLP(config.hidden_size, width, "silu", False)
        self.operator_norm = RMSNorm(config.hidden_size, eps)
        self.ffn_norm = RMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        h = self.operator_norm(x)
        if self.conv is not None:
            x = x + self.conv(h)
        else:
            assert self.self_attn is not None
            x = x + self.self_attn(h, cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Lfm2ForCausalLM(HybridForCausalLM):
    """LFM2: short-convolution and attention layers."""

    LAYER_CLASS = Lfm2DecoderLayer
    #: The classes whose maths ``rust/models/llama.rs`` implements for LFM2:
    #: the layer, its attention, its short convolution, its MLPs.
    FUSED_LAYER_TYPES = (Lfm2DecoderLayer, LlamaAttention, ShortConv, (LlamaMLP, SparseMoeBlock))

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        # LFM2 names its final norm ``embedding_norm``; it runs last, as ``model.norm``.
        self.model.norm = RMSNorm(config.hidden_size, float(config.hf.get("norm_eps", 1e-5)))

    @staticmethod
    def _flags(config: ModelConfig) -> dict[str, Any]:
        n = config.num_hidden_layers
        full = config.hf.get("full_attn_idxs")
        full = range(n) if full is None else full
        default = ["full_attention" if i in full else "conv" for i in range(n)]
        return {"layer_types": hybrid_layer_types(config, "conv", default)}

    def weight_specs(self) -> dict[str, WeightSpec]:
        """Fused q/k/v and gate/up, and LFM2's own names of the other tensors."""
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        specs: dict[str, WeightSpec] = {
            "model.norm.weight": WeightSpec(("model.embedding_norm.weight",))
        }
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}"
            if layer.self_attn is not None:
                a = f"{p}.self_attn"
                specs[f"{a}.qkv_proj.weight"] = WeightSpec(
                    tuple(f"{a}.{n}_proj.weight" for n in "qkv"), (q, kv, kv)
                )
                specs[f"{a}.o_proj.weight"] = WeightSpec((f"{a}.out_proj.weight",))
                specs[f"{a}.q_norm.weight"] = WeightSpec((f"{a}.q_layernorm.weight",))
                specs[f"{a}.k_norm.weight"] = WeightSpec((f"{a}.k_layernorm.weight",))
            f = f"{p}.feed_forward"
            block = layer.feed_forward
            if isinstance(block, SparseMoeBlock):
                specs.update(expert_weight_specs(block, f, f, ("w1", "w3", "w2")))
                if block.selection_bias is not None:
                    specs[f"{f}.selection_bias"] = WeightSpec((f"{f}.expert_bias",))
                continue
            w = block.down_proj.in_features
            specs[f"{f}.gate_up_proj.weight"] = WeightSpec(
                (f"{f}.w1.weight", f"{f}.w3.weight"), (w, w)
            )
            specs[f"{f}.down_proj.weight"] = WeightSpec((f"{f}.w2.weight",))
        return specs


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """LFM2-MoE (LFM2-8B-A1B): LFM2's layers, the first ``num_dense_layers``
    with a dense SwiGLU MLP of ``intermediate_size``, the others a sparse
    block: sigmoid scores, the top-k chosen with the ``expert_bias`` added
    (``use_expert_bias``), their weights renormalised (``norm_topk_prob``,
    with transformers' 1e-6 in the sum) and scaled by ``routed_scaling_factor``."""

    @staticmethod
    def _flags(config: ModelConfig) -> dict[str, Any]:
        hf = config.hf
        scale = hf.get("routed_scaling_factor", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise ValueError(f"config.json: routed_scaling_factor must be a number, got {scale!r}")
        return {
            **Lfm2ForCausalLM._flags(config),
            **moe_flags(config, "moe_intermediate_size", every_layer=True),
            "dense_intermediate": config.intermediate_size,
            "scoring": "sigmoid",
            "renormalize": bool(hf.get("norm_topk_prob", True)),
            "renorm_eps": 1e-6,
            "scale": float(scale),
            "selection_bias": bool(hf.get("use_expert_bias", True)),
        }


class MambaNorm(Module):
    """Mamba-2's output norm (``norm_before_gate`` false): ``(y + D x) *
    silu(z)`` in float32, RMS-normalised over each of ``groups`` equal slices
    of the channels, then scaled by the weight (``ops.mamba_norm``)."""

    def __init__(self, dim: int, groups: int, eps: float) -> None:
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.ops = TORCH_OPS

    def forward(
        self, y: torch.Tensor, x: torch.Tensor, z: torch.Tensor, d: torch.Tensor
    ) -> torch.Tensor:
        """y (the scan), x (its input), z (the gate) [T, dim]; d [heads] -> [T, dim]."""
        return self.ops.mamba_norm(y, x, z, d, self.weight, self.groups, self.eps)


class Mamba2Mixer(ConvScanMixer):
    """Granite 4.0's Mamba-2 layer: one projection to the output gate z, the
    convolved channels (x, B, C: a depthwise causal convolution of
    ``mamba_d_conv`` taps with SiLU) and the per-head time step dt; the
    selective scan ``S = exp(dt A) S + dt B x^T``, ``y = S^T C + D x`` per
    head (``mamba_n_heads`` heads of ``mamba_d_head`` channels, B and C shared
    by the heads of each of ``mamba_n_groups`` groups, ``mamba_d_state``
    states) with ``dt = softplus(dt + dt_bias)`` clamped to
    ``time_step_limit``; then the group-wise gated norm and ``out_proj``. Its
    state per sequence: the convolution's last inputs and one [N, P] float32
    matrix per head. The scan is the Gated DeltaNet kernel's linear rule
    (``k = B``, ``v = x``, ``beta = dt``, ``g = dt A``, ``q = C``)."""

    def __init__(self, config: ModelConfig, eps: float) -> None:
        super().__init__()
        hf, hidden = config.hf, config.hidden_size
        self.num_heads = _config_int(hf, "mamba_n_heads", 128)
        self.groups = _config_int(hf, "mamba_n_groups", 1)
        self.state_size = _config_int(hf, "mamba_d_state", 256)
        self.taps = _config_int(hf, "mamba_d_conv", 4)
        self.inner = _config_int(hf, "mamba_expand", 2) * hidden
        head_dim = hf.get("mamba_d_head", "auto")
        self.head_dim = self.inner // self.num_heads if head_dim in ("auto", None) else head_dim
        if self.num_heads * self.head_dim != self.inner:
            raise ValueError(
                f"config.json: mamba_n_heads ({self.num_heads}) x mamba_d_head "
                f"({head_dim!r}) must equal mamba_expand x hidden_size ({self.inner})"
            )
        if self.num_heads % self.groups:
            raise ValueError(
                f"config.json: mamba_n_heads ({self.num_heads}) must be a multiple of "
                f"mamba_n_groups ({self.groups})"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json: hidden_act {act!r}: Mamba-2 layers run SiLU only")
        limit = hf.get("time_step_limit") or (0.0, float("inf"))
        if (
            not isinstance(limit, (list, tuple))
            or len(limit) != 2
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in limit)
        ):
            raise ValueError(f"config.json: time_step_limit must be [min, max], got {limit!r}")
        self.time_step_limit = (float(limit[0]), float(limit[1]))
        self.conv_dim = self.inner + 2 * self.groups * self.state_size
        bias = bool(hf.get("mamba_proj_bias", False))
        self.in_proj = Linear(hidden, self.inner + self.conv_dim + self.num_heads, bias=bias)
        self.conv1d = ConvWeight(self.conv_dim, self.taps, bool(hf.get("mamba_conv_bias", True)))
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.norm = MambaNorm(self.inner, self.groups, eps)
        self.out_proj = Linear(self.inner, hidden, bias=bias)
        self.ops = TORCH_OPS
        self.scan_state = (self.num_heads, self.state_size, self.head_dim)
        self.states: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        meta = get_context()
        n, heads, bc = x.shape[0], self.num_heads, self.groups * self.state_size
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, heads], dim=-1)
        xs, b, c = self.convolve(xbc).split([self.inner, bc, bc], dim=-1)
        g, beta = self.ops.mamba_gates(dt, self.A_log, self.dt_bias, self.time_step_limit)
        xs = xs.contiguous()
        y = self.ops.gated_delta_rule(
            c.reshape(n, self.groups, self.state_size),
            b.reshape(n, self.groups, self.state_size),
            xs.view(n, heads, self.head_dim),
            g,
            beta,
            self.states[1],
            meta.query_start_loc,
            meta.state_slots,
            1.0,
            False,
            linear=True,
        )
        y = self.norm(y.view(n, self.inner), xs, z, self.D)
        return self.out_proj(y)


class GraniteHybridDecoderLayer(Module):
    """Granite 4.0's block: a Mamba-2 or an attention mixer, then the dense
    ``shared_mlp`` or, with experts, a sparse block whose ungated shared
    expert is that dense MLP; each branch scaled by the residual multiplier."""

    def __init__(self, config: ModelConfig, layer: int, flags: dict[str, Any]) -> None:
        super().__init__()
        eps = float(config.hf.get("rms_norm_eps", 1e-6))
        if flags["layer_types"][layer] == "linear_attention":
            self.mamba: Mamba2Mixer | None = Mamba2Mixer(config, eps)
            self.self_attn: LlamaAttention | None = None
        else:
            self.mamba, self.self_attn = None, LlamaAttention.of(config, layer, flags, eps)
        self.residual_multiplier: float = flags["residual_multiplier"]
        act = config.hf.get("hidden_act", "silu")
        self.mlp: Module = (
            sparse_block(config, flags)
            if is_sparse(flags, layer)
            else LlamaMLP(config.hidden_size, flags["shared_intermediate"], act, False)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        m, h = self.residual_multiplier, self.input_layernorm(x)
        if self.mamba is not None:
            x = x + self.mamba(h) * m
        else:
            assert self.self_attn is not None
            x = x + self.self_attn(h, cos, sin) * m
        return x + self.mlp(self.post_attention_layernorm(x)) * m


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    """Granite 4.0 (``granitemoehybrid``): Granite 3.x's multipliers over
    layers of Mamba-2 (``layer_types`` "mamba") or attention (rotary only
    with ``position_embedding_type`` "rope", else none), each with the dense
    ``shared_mlp`` (gate rows, then up rows of ``input_linear``: this model's
    ``gate_up_proj``) and, with ``num_local_experts`` > 0, a sparse block of
    softmax top-k experts (renormalised) with that MLP as its ungated shared
    expert. Every layer runs on the fused CPU stack
    (``llama_stack.build_hybrid``)."""

    LAYER_CLASS = GraniteHybridDecoderLayer
    #: The classes whose maths ``rust/models/llama.rs`` implements for Granite
    #: 4.0: the layer, its attention, its Mamba-2, its MLPs.
    FUSED_LAYER_TYPES = (
        GraniteHybridDecoderLayer,
        LlamaAttention,
        Mamba2Mixer,
        (LlamaMLP, SparseMoeBlock),
    )

    @staticmethod
    def _flags(config: ModelConfig) -> dict[str, Any]:
        hf = config.hf
        n = config.num_hidden_layers
        rope = hf.get("position_embedding_type") == "rope"
        flags = {
            **GraniteForCausalLM._flags(config),
            "mlp_bias": False,
            "rope_layers": (rope,) * n,
            "layer_types": hybrid_layer_types(config, "linear_attention", []),
            "shared_intermediate": _config_int(hf, "shared_intermediate_size", 1024),
        }
        if hf.get("num_local_experts"):
            flags.update(moe_flags(config, "intermediate_size", every_layer=True))
            flags.update(renormalize=True, shared_gated=False)
        return flags

    def weight_specs(self) -> dict[str, WeightSpec]:
        """q/k/v fused, the shared MLP's and the experts' stacked tensors."""
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        specs: dict[str, WeightSpec] = {}
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}"
            if layer.self_attn is not None:
                qkv = layer.self_attn.qkv_proj
                specs.update(fused_specs(p, qkv, "self_attn.qkv_proj", QKV, (q, kv, kv)))
            block = layer.mlp
            dense = block.shared_expert if isinstance(block, SparseMoeBlock) else block
            ours = f"{p}.mlp.shared_expert" if isinstance(block, SparseMoeBlock) else f"{p}.mlp"
            m = dense.down_proj.in_features
            # A GGUF file holds the dense MLP under the names of a dense MLP or,
            # with experts, of a shared expert, gate and up apart: the alternatives.
            apart = WeightSpec((f"{ours}.gate_proj.weight", f"{ours}.up_proj.weight"), (m, m))
            specs[f"{ours}.gate_up_proj.weight"] = WeightSpec(
                (f"{p}.shared_mlp.input_linear.weight",), alternatives=(apart,)
            )
            specs[f"{ours}.down_proj.weight"] = WeightSpec(
                (f"{p}.shared_mlp.output_linear.weight",),
                alternatives=(WeightSpec((f"{ours}.down_proj.weight",)),),
            )
            if not isinstance(block, SparseMoeBlock):
                continue
            theirs = f"{p}.block_sparse_moe"
            specs[f"{p}.mlp.gate.weight"] = WeightSpec((f"{theirs}.router.layer.weight",))
            for j in range(len(block.experts)):
                specs[f"{p}.mlp.experts.{j}.gate_up_proj.weight"] = WeightSpec(
                    (f"{theirs}.input_linear.weight",), select=j
                )
                specs[f"{p}.mlp.experts.{j}.down_proj.weight"] = WeightSpec(
                    (f"{theirs}.output_linear.weight",), select=j
                )
        return specs

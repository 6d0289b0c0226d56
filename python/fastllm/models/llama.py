"""The Llama family: Llama 2/3, Mistral, Qwen2, Qwen3, Granite, SmolLM3, OLMo 2
and Phi-3 share one implementation.

Differences are flags: Qwen2 has q/k/v biases, Qwen3 RMS-normalises q and k per
head before the rotary embedding, Mistral (and Qwen when enabled) use a sliding
window, Granite scales the embeddings, the attention scores, each residual
branch and the logits by constants of its config, SmolLM3 leaves the rotary
embedding out of some layers (``no_rope_layers``), OLMo 2 normalises after
attention and MLP instead of before, and RMS-normalises the whole q and k
projections (``Olmo2DecoderLayer``). q/k/v are fused into one
projection and gate/up into another; the loader concatenates the checkpoint's
separate tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fastllm.config import ModelConfig
from fastllm.layers import Module
from fastllm.layers.activation import ActAndMul
from fastllm.layers.attention import PagedAttention
from fastllm.layers.linear import Embedding, Linear, head_logits
from fastllm.layers.norm import RMSNorm
from fastllm.layers.ops import TORCH_OPS, split_qkv
from fastllm.layers.rotary import RotaryEmbedding, qkv_with_rotary
from fastllm.models import llama_stack
from fastllm.models.weights import WeightSpec


def positive_number(hf: dict[str, Any], name: str) -> float | None:
    """The config's field ``name`` as a positive float, None where it is absent
    or null; a ValueError naming it otherwise."""
    value = hf.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"config.json: {name} must be a positive number, got {value!r}")
    return float(value)


def fused_specs(
    p: str, linear: Linear, fused: str, parts: tuple[str, ...], splits: tuple[int, ...]
) -> dict[str, WeightSpec]:
    """The specs of the fused linear ``{p}.{fused}`` (its weight, and its bias
    where it has one) from the checkpoint's ``{p}.{part}`` linears."""
    kinds = ["weight"] + (["bias"] if linear.bias is not None else [])
    return {
        f"{p}.{fused}.{kind}": WeightSpec(tuple(f"{p}.{n}.{kind}" for n in parts), splits)
        for kind in kinds
    }


#: The checkpoint's linears of a fused q/k/v and a fused gate/up.
QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
GATE_UP = ("mlp.gate_proj", "mlp.up_proj")


class LlamaAttention(Module):
    """Self-attention with fused q/k/v, rotary positions and a paged KV cache."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        eps: float,
        scale: float | None = None,
        use_rope: bool = True,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.ops = TORCH_OPS  # the model's op table (``layers/ops.py``), bound at load
        self.use_rope = use_rope
        self.attn = PagedAttention(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            self.head_dim**-0.5 if scale is None else scale,
            config.layer_sliding_window(layer),
            logit_softcap,
        )

    @classmethod
    def of(
        cls, config: ModelConfig, layer: int, flags: dict[str, Any], eps: float
    ) -> LlamaAttention:
        """The attention of decoder layer ``layer`` as the family's flags set it
        (``LlamaForCausalLM._flags``)."""
        rope_layers = flags.get("rope_layers")
        return cls(
            config,
            layer,
            flags["qkv_bias"],
            flags["o_bias"],
            flags["qk_norm"],
            eps,
            scale=flags.get("attention_scale"),
            use_rope=True if rope_layers is None else bool(rope_layers[layer]),
            logit_softcap=flags.get("logit_softcap"),
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        if not self.use_rope:  # positions come from the causal mask alone (SmolLM3)
            q, k, v = split_qkv(self.qkv_proj(x), self.num_heads, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            return self.o_proj(self.attn(q, k, v))
        q, k, v = qkv_with_rotary(
            self.ops,
            self.qkv_proj(x),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            cos,
            sin,
            self.q_norm,
            self.k_norm,
        )
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(Module):
    """Gated MLP: down(act(gate(x)) * up(x)) with gate and up fused."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.act = ActAndMul(act)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    @classmethod
    def of(cls, config: ModelConfig, bias: bool) -> LlamaMLP:
        """The MLP a decoder layer of ``config`` has."""
        act = config.hf.get("hidden_act", "silu")
        return cls(config.hidden_size, config.intermediate_size, act, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(Module):
    """Pre-norm attention and MLP blocks with residual connections."""

    def __init__(self, config: ModelConfig, layer: int, flags: dict[str, Any]) -> None:
        super().__init__()
        eps = float(config.hf.get("rms_norm_eps", 1e-6))
        self.self_attn = LlamaAttention.of(config, layer, flags, eps)
        #: Granite's factor on each residual branch (None: plain sums).
        self.residual_multiplier: float | None = flags.get("residual_multiplier")
        self.mlp = LlamaMLP.of(config, flags["mlp_bias"])
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        m = self.residual_multiplier
        if m is None:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin)
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin) * m
        return x + self.mlp(self.post_attention_layernorm(x)) * m


class Olmo2Attention(LlamaAttention):
    """OLMo 2's attention: RMSNorm over the whole q and k projections (not per
    head) before the rotary embedding."""

    def __init__(self, config: ModelConfig, layer: int, bias: bool, eps: float) -> None:
        super().__init__(config, layer, bias, bias, False, eps)
        self.q_norm = RMSNorm(self.q_size, eps)
        self.k_norm = RMSNorm(self.kv_size, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        n = x.shape[0]
        q = self.q_norm(q.contiguous()).view(n, self.num_heads, self.head_dim)
        k = self.k_norm(k.contiguous()).view(n, self.num_kv_heads, self.head_dim)
        q, k = self.ops.rotary(q, cos, sin), self.ops.rotary(k, cos, sin)
        return self.o_proj(self.attn(q, k, v))


class Olmo2DecoderLayer(Module):
    """OLMo 2's block: attention and MLP each normalised after, then added."""

    def __init__(self, config: ModelConfig, layer: int, flags: dict[str, Any]) -> None:
        super().__init__()
        eps = float(config.hf.get("rms_norm_eps", 1e-6))
        self.self_attn = Olmo2Attention(config, layer, flags["qkv_bias"], eps)
        self.mlp = LlamaMLP.of(config, flags["mlp_bias"])
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class LlamaModel(Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, config: ModelConfig, flags: dict[str, Any], layer_class: type) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            layer_class(config, i, flags) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, float(config.hf.get("rms_norm_eps", 1e-6)))


class LlamaForCausalLM(Module):
    """Llama 2 / 3 (with rope scaling), TinyLlama, SmolLM."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tied = config.tie_word_embeddings
        flags = self._flags(config)
        self.model = LlamaModel(config, flags, self.LAYER_CLASS)
        #: Granite's factor on the token embeddings and divisor of the logits.
        self.embedding_multiplier: float | None = flags.get("embedding_multiplier")
        self.logits_scaling: float | None = flags.get("logits_scaling")
        self.lm_head = None if self.tied else Linear(config.hidden_size, config.vocab_size)
        rotary_dim = int(config.head_dim * config.partial_rotary_factor)
        self.rotary = RotaryEmbedding(
            config.head_dim,
            rotary_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )
        # All decoder layers in one Rust call per step (CPU; ``fuse_decoder_layers``).
        self.decoder_stack = None

    @staticmethod
    def _flags(config: ModelConfig) -> dict[str, Any]:
        bias = bool(config.hf.get("attention_bias", False))
        return {
            "qkv_bias": bias,
            "o_bias": bias,
            "qk_norm": False,
            "mlp_bias": bool(config.hf.get("mlp_bias", False)),
        }

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's packed tokens."""
        x = self.model.embed_tokens(input_ids)
        if self.embedding_multiplier is not None:
            x = x * self.embedding_multiplier
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        if self.decoder_stack is not None:
            llama_stack.run(self.decoder_stack, x, cos, sin)
        else:
            for layer in self.model.layers:
                x = layer(x, cos, sin)
        return self.model.norm(x)

    #: The decoder layer of this family.
    LAYER_CLASS: type = LlamaDecoderLayer
    #: A base model's checkpoint (an embedder saved without its head, such as
    #: Qwen3-Embedding) names the decoder's tensors without the ``model.`` prefix.
    checkpoint_prefix_aliases = (("model.", ""),)
    #: The layer classes whose maths ``rust/models/llama.rs`` implements.
    FUSED_LAYER_TYPES = (LlamaDecoderLayer, LlamaAttention, (LlamaMLP,))

    def fuse_decoder_layers(self) -> bool:
        """Runs the decoder layers as one ``_core.DecoderStack`` from now on,
        when the model is packed on the CPU and has its KV caches
        (``models/llama_stack.py``); returns whether it does."""
        self.decoder_stack = llama_stack.build(self)
        return self.decoder_stack is not None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [n, vocab] for the given rows of hidden states."""
        logits = head_logits(self, hidden)
        return logits if self.logits_scaling is None else logits / self.logits_scaling

    def head_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weight and bias of the language-model head (the embedding when tied)."""
        if self.lm_head is None:
            return self.model.embed_tokens.weight, None
        return self.lm_head.weight, None

    def attention_layers(self) -> list[PagedAttention]:
        """The paged-attention layers, in order, for the runner to give caches."""
        return [layer.self_attn.attn for layer in self.model.layers]

    def weight_specs(self) -> dict[str, WeightSpec]:
        """Checkpoint sources of the fused parameters (others keep their names)."""
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        specs: dict[str, WeightSpec] = {}
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}"
            attn = layer.self_attn
            specs.update(fused_specs(p, attn.qkv_proj, "self_attn.qkv_proj", QKV, (q, kv, kv)))
            if not isinstance(layer.mlp, LlamaMLP):  # a mixture of experts (``models/moe.py``)
                continue
            m = c.intermediate_size
            specs.update(
                fused_specs(p, layer.mlp.gate_up_proj, "mlp.gate_up_proj", GATE_UP, (m, m))
            )
        return specs


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with a sliding attention window."""

    @staticmethod
    def _flags(config: ModelConfig) -> dict[str, Any]:
        return {"qkv_bias": False, "o_bias": False, "qk_norm": False, "mlp_bias": False}


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: biases on q, k and v (not on o)."""

    @staticmethod
    def _flags(config: ModelConfig) -> dict[str, Any]:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False, "mlp_bias": False}


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: per-head RMSNorm on q and k before the rotary embedding."""

    @staticmethod
    def _flags(config: ModelConfig) -> dict[str, Any]:
        bias = bool(config.hf.get("attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True, "mlp_bias": False}


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite 3.x: Llama with its config's multipliers on the embeddings, the
    attention scores (in place of 1/sqrt(head_dim)), each residual branch,
    and a divisor of the logits."""

    @staticmethod
    def _flags(config: ModelConfig) -> dict[str, Any]:
        hf = config.hf
        bias = bool(hf.get("attention_bias", False))

        def number(name: str, default: float) -> float:
            value = positive_number(hf, name)
            return default if value is None else value

        return {
            "qkv_bias": bias,
            "o_bias": bias,
            "qk_norm": False,
            "mlp_bias": bool(hf.get("mlp_bias", False)),
            "embedding_multiplier": number("embedding_multiplier", 1.0),
            "attention_scale": number("attention_multiplier", config.head_dim**-0.5),
            "residual_multiplier": number("residual_multiplier", 1.0),
            "logits_scaling": number("logits_scaling", 1.0),
        }


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3: Llama whose layers with ``no_rope_layers[i] == 0`` use no
    rotary embedding (NoPE), and sliding windows where ``layer_types`` says."""

    @staticmethod
    def _flags(config: ModelConfig) -> dict[str, Any]:
        hf = config.hf
        layers = hf.get("no_rope_layers")
        n = config.num_hidden_layers
        if layers is None:
            interval = hf.get("no_rope_layer_interval", 4)
            layers = [int((i + 1) % interval != 0) for i in range(n)]
        if not isinstance(layers, list) or len(layers) != n or any(v not in (0, 1) for v in layers):
            raise ValueError(
                f"config.json: no_rope_layers must be a list of {n} zeros and ones, got {layers!r}"
            )
        bias = bool(hf.get("attention_bias", False))
        return {
            "qkv_bias": bias,
            "o_bias": bias,
            "qk_norm": False,
            "mlp_bias": bool(hf.get("mlp_bias", False)),
            "rope_layers": tuple(bool(v) for v in layers),
        }


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2: post-norm blocks with RMSNorm over the whole q and k projections."""

    LAYER_CLASS = Olmo2DecoderLayer
    FUSED_LAYER_TYPES = (Olmo2DecoderLayer, Olmo2Attention, (LlamaMLP,))

    @staticmethod
    def _flags(config: ModelConfig) -> dict[str, Any]:
        bias = bool(config.hf.get("attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False, "mlp_bias": False}


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-3.5 (and Phi-4-mini's layout): Llama with q/k/v and gate/up
    stored fused (``qkv_proj``, ``gate_up_proj``, read as they are), partial
    rotary, LongRoPE (``layers/rotary.py``) and a sliding window on every
    layer when the config has one."""

    @staticmethod
    def _flags(config: ModelConfig) -> dict[str, Any]:
        return {"qkv_bias": False, "o_bias": False, "qk_norm": False, "mlp_bias": False}

    def weight_specs(self) -> dict[str, WeightSpec]:
        """None: the checkpoint's fused tensors have this model's names."""
        return {}

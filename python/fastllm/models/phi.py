"""Phi (phi-1.5, phi-2): parallel attention and MLP on one LayerNorm, partial rotary."""

from __future__ import annotations

import torch
from torch import nn

from fastllm.config import ModelConfig
from fastllm.layers import Module
from fastllm.layers.activation import get_activation
from fastllm.layers.attention import PagedAttention
from fastllm.layers.linear import Embedding, Linear, head_logits
from fastllm.layers.norm import LayerNorm
from fastllm.layers.ops import TORCH_OPS
from fastllm.layers.rotary import RotaryEmbedding, qkv_with_rotary
from fastllm.models.weights import WeightSpec


class PhiAttention(Module):
    """Biased fused q/k/v, optional per-head LayerNorm on q/k, rotary on a prefix of each head."""

    def __init__(self, config: ModelConfig, eps: float) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=True)
        self.dense = Linear(self.q_size, config.hidden_size, bias=True)
        qk_norm = bool(config.hf.get("qk_layernorm", False))
        self.q_layernorm = LayerNorm(self.head_dim, eps) if qk_norm else None
        self.k_layernorm = LayerNorm(self.head_dim, eps) if qk_norm else None
        self.ops = TORCH_OPS  # the model's op table (``layers/ops.py``), bound at load
        self.attn = PagedAttention(
            self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5, None
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        q, k, v = qkv_with_rotary(
            self.ops,
            self.qkv_proj(x),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            cos,
            sin,
            self.q_layernorm,
            self.k_layernorm,
        )
        return self.dense(self.attn(q, k, v))


class PhiMLP(Module):
    """fc2(act(fc1(x))) with biases."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc1 = Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.fc2 = Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = get_activation(config.hf.get("hidden_act", "gelu_new"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return self.fc2(self.act(self.fc1(x)))


class PhiDecoderLayer(Module):
    """x + attn(ln(x)) + mlp(ln(x)): attention and MLP read the same normalised input."""

    def __init__(self, config: ModelConfig, eps: float) -> None:
        super().__init__()
        self.input_layernorm = LayerNorm(config.hidden_size, eps)
        self.self_attn = PhiAttention(config, eps)
        self.mlp = PhiMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        h = self.input_layernorm(x)
        return self.self_attn(h, cos, sin) + self.mlp(h) + x


class PhiModel(Module):
    """Embedding, decoder layers and the final LayerNorm."""

    def __init__(self, config: ModelConfig, eps: float) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            PhiDecoderLayer(config, eps) for _ in range(config.num_hidden_layers)
        )
        self.final_layernorm = LayerNorm(config.hidden_size, eps)


class PhiForCausalLM(Module):
    """phi-2 and phi-1.5 (Hugging Face's ``PhiForCausalLM`` layout)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        eps = float(config.hf.get("layer_norm_eps", 1e-5))
        self.model = PhiModel(config, eps)
        self.tied = config.tie_word_embeddings
        # phi-2's head has a bias; when tied, only the weight is shared.
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=True)
        if self.tied:
            del self.lm_head.weight
            self.lm_head.register_parameter("weight", None)
        rotary_dim = int(config.head_dim * config.partial_rotary_factor)
        self.rotary = RotaryEmbedding(
            config.head_dim,
            rotary_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's packed tokens."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.final_layernorm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [n, vocab] for the given rows of hidden states."""
        return head_logits(self, hidden)

    def head_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weight and bias of the language-model head (the embedding's weight when tied)."""
        weight = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return weight, self.lm_head.bias

    def attention_layers(self) -> list[PagedAttention]:
        """The paged-attention layers, in order, for the runner to give caches."""
        return [layer.self_attn.attn for layer in self.model.layers]

    def weight_specs(self) -> dict[str, WeightSpec]:
        """Checkpoint sources of the fused q/k/v parameters (others keep their names)."""
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        specs: dict[str, WeightSpec] = {}
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}.self_attn"
            for kind in ("weight", "bias"):
                specs[f"{p}.qkv_proj.{kind}"] = WeightSpec(
                    tuple(f"{p}.{n}_proj.{kind}" for n in "qkv"), (q, kv, kv)
                )
        return specs

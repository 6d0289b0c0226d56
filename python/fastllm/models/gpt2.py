"""GPT-2: learned positions, LayerNorm, gelu_new MLP, Conv1D weights, tied head."""

from __future__ import annotations

import torch
from torch import nn

from fastllm.config import ModelConfig
from fastllm.layers import Module
from fastllm.layers.activation import get_activation
from fastllm.layers.attention import PagedAttention
from fastllm.layers.linear import Embedding, Linear, head_logits
from fastllm.layers.norm import LayerNorm
from fastllm.models.weights import WeightSpec


class GPT2Attention(Module):
    """Fused q/k/v (``c_attn``) and output projection (``c_proj``), both biased."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.c_attn = Linear(hidden, 3 * hidden, bias=True)
        self.c_proj = Linear(hidden, hidden, bias=True)
        scale = config.head_dim**-0.5 if config.hf.get("scale_attn_weights", True) else 1.0
        if config.hf.get("scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer + 1)
        self.attn = PagedAttention(
            config.num_attention_heads, config.head_dim, config.num_attention_heads, scale, None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        return self.c_proj(self.attn(q, k, v))


class GPT2MLP(Module):
    """c_proj(act(c_fc(x)))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.c_fc = Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.c_proj = Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = get_activation(config.hf.get("activation_function", "gelu_new"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(Module):
    """Pre-norm attention and MLP with residuals."""

    def __init__(self, config: ModelConfig, layer: int, eps: float) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.hidden_size, eps)
        self.attn = GPT2Attention(config, layer)
        self.ln_2 = LayerNorm(config.hidden_size, eps)
        self.mlp = GPT2MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(Module):
    """Token and position embeddings, blocks, final LayerNorm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        eps = float(config.hf.get("layer_norm_epsilon", 1e-5))
        self.wte = Embedding(config.vocab_size, config.hidden_size)
        self.wpe = Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i, eps) for i in range(config.num_hidden_layers))
        self.ln_f = LayerNorm(config.hidden_size, eps)


class GPT2LMHeadModel(Module):
    """GPT-2 with its language-model head (tied to the token embedding by default)."""

    # The original GPT-2 checkpoints name tensors without the "transformer." prefix.
    checkpoint_prefix_aliases = (("transformer.", ""),)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's packed tokens."""
        t = self.transformer
        x = t.wte(input_ids) + t.wpe(positions)
        for block in t.h:
            x = block(x)
        return t.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [n, vocab] for the given rows of hidden states."""
        return head_logits(self, hidden)

    def head_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weight and bias of the language-model head (the embedding when tied)."""
        if self.lm_head is None:
            return self.transformer.wte.weight, None
        return self.lm_head.weight, None

    def attention_layers(self) -> list[PagedAttention]:
        """The paged-attention layers, in order, for the runner to give caches."""
        return [block.attn.attn for block in self.transformer.h]

    def weight_specs(self) -> dict[str, WeightSpec]:
        """Conv1D weights are stored transposed ([in, out]) in GPT-2 checkpoints."""
        specs: dict[str, WeightSpec] = {}
        for i in range(self.config.num_hidden_layers):
            for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
                key = f"transformer.h.{i}.{name}.weight"
                specs[key] = WeightSpec((key,), transpose=True)
        return specs

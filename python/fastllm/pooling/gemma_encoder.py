"""EmbeddingGemma: Gemma 3's text layers run as an encoder (a config with
``use_bidirectional_attention``).

Token embeddings scaled by ``sqrt(hidden_size)`` (rounded to the model's
dtype, as transformers scales them), then Gemma 3 blocks: zero-centred
RMSNorm (``1 + w``), q/k/v projections, per-head q/k norms, rotary positions
(the local layers with their own base, the global ones with the model's
rope scaling: default or linear), bidirectional attention scaled by
``query_pre_attn_scalar ** -0.5`` (the local layers see the tokens less than
``sliding_window // 2 + 1`` positions away, as transformers halves the
window of a bidirectional model), a norm of the attention output, the
residual; a norm, the tanh-GELU gated MLP, a norm of its output, the
residual; a final norm.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fastllm.config import ModelConfig, rope_of_layer_type
from fastllm.layers import Module
from fastllm.layers.linear import Embedding, Linear
from fastllm.pooling.encoder_layers import (
    EncoderAttention,
    PackedInputs,
    apply_rotary,
    encoder_gated_activation,
    rotary_tables,
)

#: the architectures of an EmbeddingGemma folder (with ``use_bidirectional_attention``)
GEMMA_ENCODER_ARCHITECTURES = ("Gemma3TextModel", "Gemma3ForCausalLM")


def is_gemma_encoder(architectures: list[str], hf: dict[str, Any]) -> bool:
    """Whether a config describes Gemma 3 layers with bidirectional attention."""
    return (
        bool(architectures)
        and architectures[0] in GEMMA_ENCODER_ARCHITECTURES
        and bool(hf.get("use_bidirectional_attention"))
    )


class GemmaNorm(Module):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + w)`` in float32, rounded to x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def _rotary(config: ModelConfig, layer_type: str, head_dim: int):
    """A function of positions giving the (cos, sin) tables of the layers of
    ``layer_type``: the default rotary embedding or its linear scaling."""
    theta, scaling = rope_of_layer_type(config, layer_type)
    factor = 1.0
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", "linear"):
            raise ValueError(
                f"config.json: EmbeddingGemma rope_type {kind!r} ({layer_type}) is not "
                "supported (only 'default' and 'linear')"
            )
        factor = float(scaling.get("factor", 1.0)) if kind == "linear" else 1.0
    return lambda positions: rotary_tables(positions.float() / factor, head_dim, theta)


class GemmaEncoderLayer(Module):
    """One Gemma 3 block with bidirectional attention."""

    def __init__(self, hf: dict[str, Any], head_dim: int, window: int | None) -> None:
        super().__init__()
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        kv, eps = hf.get("num_key_value_heads", heads), hf.get("rms_norm_eps", 1e-6)
        bias = bool(hf.get("attention_bias", False))
        inter = hf["intermediate_size"]
        self.q_size, self.kv_size = heads * head_dim, kv * head_dim
        self.heads, self.kv_heads = heads, kv
        self.input_norm = GemmaNorm(hidden, eps)
        self.qkv = Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.q_norm = GemmaNorm(head_dim, eps)
        self.k_norm = GemmaNorm(head_dim, eps)
        self.o_proj = Linear(self.q_size, hidden, bias=bias)
        self.attn_out_norm = GemmaNorm(hidden, eps)
        self.mlp_norm = GemmaNorm(hidden, eps)
        self.gate_up = Linear(hidden, 2 * inter, bias=False)
        self.down = Linear(inter, hidden, bias=False)
        self.mlp_out_norm = GemmaNorm(hidden, eps)
        self.gated_act = encoder_gated_activation(hf.get("hidden_activation", "gelu_pytorch_tanh"))
        scale = hf.get("query_pre_attn_scalar", head_dim) ** -0.5
        self.attention = EncoderAttention(heads, head_dim, window, scale=scale)
        self.layer_type = "sliding_attention" if window is not None else "full_attention"

    def forward(
        self, x: torch.Tensor, inputs: PackedInputs, rotary: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; ``rotary``: this layer's (cos, sin)."""
        d = self.attention.head_dim
        qkv = self.qkv(self.input_norm(x))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        cos, sin = rotary
        q = apply_rotary(self.q_norm(q.reshape(-1, self.heads, d)), cos, sin)
        k = apply_rotary(self.k_norm(k.reshape(-1, self.kv_heads, d)), cos, sin)
        v = v.reshape(-1, self.kv_heads, d)
        x = x + self.attn_out_norm(self.o_proj(self.attention(q, k, v, inputs)))
        h = self.down(self.gated_act(self.gate_up(self.mlp_norm(x))))
        return x + self.mlp_out_norm(h)


class GemmaEncoder(Module):
    """EmbeddingGemma's encoder (no classification head)."""

    def __init__(self, hf: dict[str, Any], architecture: str) -> None:
        super().__init__()
        config = ModelConfig.from_dict(hf)
        hidden = config.hidden_size
        self.hidden_size = hidden
        self.vocab_size = config.vocab_size
        self.max_positions = config.max_position_embeddings
        head_dim = config.head_dim
        kinds = hf.get("layer_types") or [
            "sliding_attention"
            if (i + 1) % hf.get("sliding_window_pattern", 6)
            else "full_attention"
            for i in range(config.num_hidden_layers)
        ]
        ok = ("sliding_attention", "full_attention")
        if len(kinds) != config.num_hidden_layers or any(k not in ok for k in kinds):
            raise ValueError(
                f"config.json: layer_types must list {config.num_hidden_layers} of {ok}, got {kinds!r}"
            )
        window = int(hf.get("sliding_window") or 0) // 2 or None
        self.embed_tokens = Embedding(config.vocab_size, hidden)
        self.layers = nn.ModuleList(
            GemmaEncoderLayer(hf, head_dim, window if kind == "sliding_attention" else None)
            for kind in kinds
        )
        self.norm = GemmaNorm(hidden, hf.get("rms_norm_eps", 1e-6))
        self.tables = {kind: _rotary(config, kind, head_dim) for kind in set(kinds)}
        self.num_labels = None

    uses_type_ids = False

    def forward(self, inputs: PackedInputs) -> torch.Tensor:
        """Last hidden states [T, hidden] of the packed inputs."""
        x = self.embed_tokens(inputs.ids)
        x = x * torch.tensor(self.hidden_size**0.5, dtype=x.dtype)
        rotary = {kind: table(inputs.positions) for kind, table in self.tables.items()}
        for layer in self.layers:
            x = layer(x, inputs, rotary[layer.layer_type])
        return self.norm(x)

    def checkpoint_sources(self, prefix: str, names: set[str]) -> dict[str, list[str]]:
        """Each parameter's checkpoint tensors (concatenated in order), the
        model's under ``prefix`` (``model.`` or none); ``names``: the
        checkpoint's tensor names (one layout: not read)."""
        src = {"embed_tokens.weight": [f"{prefix}embed_tokens.weight"]}
        src["norm.weight"] = [f"{prefix}norm.weight"]
        for i in range(len(self.layers)):
            hf, me = f"{prefix}layers.{i}.", f"layers.{i}."
            for p in ("weight", "bias"):
                src[f"{me}qkv.{p}"] = [f"{hf}self_attn.{n}_proj.{p}" for n in "qkv"]
                src[f"{me}o_proj.{p}"] = [f"{hf}self_attn.o_proj.{p}"]
            parts = {
                "input_norm": "input_layernorm",
                "q_norm": "self_attn.q_norm",
                "k_norm": "self_attn.k_norm",
                "attn_out_norm": "post_attention_layernorm",
                "mlp_norm": "pre_feedforward_layernorm",
                "mlp_out_norm": "post_feedforward_layernorm",
                "down": "mlp.down_proj",
            }
            for mine, theirs in parts.items():
                src[f"{me}{mine}.weight"] = [f"{hf}{theirs}.weight"]
            src[f"{me}gate_up.weight"] = [f"{hf}mlp.gate_proj.weight", f"{hf}mlp.up_proj.weight"]
        return src

    @staticmethod
    def checkpoint_probe() -> str:
        """A tensor every checkpoint has (after its prefix)."""
        return "embed_tokens.weight"

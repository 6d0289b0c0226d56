"""ModernBERT: a pre-norm encoder with rotary positions and alternating
global and local (sliding-window) attention.

Token embeddings and ``embedding_norm`` (``embeddings.norm``), then blocks of
``attn_norm`` (none in the first), fused ``Wqkv``, rotary (``global_rope_theta``
in the global layers, ``local_rope_theta`` in the local ones), attention
(every ``global_attn_every_n_layers``-th layer global from layer 0, the others
seeing ``local_attention // 2`` tokens each way), ``Wo``; ``mlp_norm``, GeGLU
``Wi`` / ``Wo``; ``final_norm``. Norms have no bias unless ``norm_bias``. The
classification head pools (``classifier_pooling``: the CLS row or the mean),
then ``head.dense`` + activation + ``head.norm`` and ``classifier``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fastllm.layers import Module
from fastllm.layers.linear import Embedding, Linear
from fastllm.pooling.bert import num_labels
from fastllm.pooling.encoder_layers import (
    EncoderAttention,
    EncoderLayerNorm,
    PackedInputs,
    apply_rotary,
    encoder_activation,
    encoder_gated_activation,
    rotary_tables,
)

#: architecture -> whether it has a sequence-classification head
MODERNBERT_ARCHITECTURES: dict[str, bool] = {
    "ModernBertModel": False,
    "ModernBertForMaskedLM": False,
    "ModernBertForSequenceClassification": True,
}


def modernbert_layers(hf: dict[str, Any]) -> list[tuple[str, float]]:
    """Each layer's attention type and rotary theta, from ``layer_types`` and
    ``rope_parameters`` (transformers 5) or ``global_attn_every_n_layers``,
    ``global_rope_theta`` and ``local_rope_theta`` (earlier configs)."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        every = hf.get("global_attn_every_n_layers", 3)
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(
                f"config.json: global_attn_every_n_layers must be a positive integer, got {every!r}"
            )
        types = ["sliding_attention" if i % every else "full_attention" for i in range(n)]
    ok = ("sliding_attention", "full_attention")
    if not isinstance(types, list) or len(types) != n or any(t not in ok for t in types):
        raise ValueError(f"config.json: layer_types must list {n} of {ok}, got {types!r}")
    global_theta = hf.get("global_rope_theta", 160_000.0)
    local_theta = hf.get("local_rope_theta", 10_000.0)
    if local_theta is None:  # earlier transformers: the local layers then take the global theta
        local_theta = global_theta
    thetas = {"full_attention": global_theta, "sliding_attention": local_theta}
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        for kind in ok:
            p = params.get(kind)
            if isinstance(p, dict):
                if p.get("rope_type", "default") != "default":
                    raise ValueError(
                        f"config.json: ModernBERT rope_type {p['rope_type']!r} is not supported"
                    )
                thetas[kind] = p.get("rope_theta", thetas[kind])
    return [(t, float(thetas[t])) for t in types]


class ModernBertLayer(Module):
    """One pre-norm block; ``window``: tokens seen each way (None: global)."""

    def __init__(self, hf: dict[str, Any], first: bool, theta: float, window: int | None) -> None:
        super().__init__()
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        eps, norm_bias = hf.get("norm_eps", 1e-5), hf.get("norm_bias", False)
        attn_bias, mlp_bias = hf.get("attention_bias", False), hf.get("mlp_bias", False)
        inter = hf["intermediate_size"]
        self.attn_norm = None if first else EncoderLayerNorm(hidden, eps, norm_bias)
        self.Wqkv = Linear(hidden, 3 * hidden, bias=attn_bias)
        self.Wo = Linear(hidden, hidden, bias=attn_bias)
        self.mlp_norm = EncoderLayerNorm(hidden, eps, norm_bias)
        self.Wi = Linear(hidden, 2 * inter, bias=mlp_bias)
        self.mlp_Wo = Linear(inter, hidden, bias=mlp_bias)
        self.gated_act = encoder_gated_activation(hf.get("hidden_activation", "gelu"))
        self.attention = EncoderAttention(heads, hidden // heads, window)
        self.theta = theta

    def forward(
        self, x: torch.Tensor, inputs: PackedInputs, rotary: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; ``rotary``: this layer's (cos, sin)."""
        h, d = self.attention.num_heads, self.attention.head_dim
        y = x if self.attn_norm is None else self.attn_norm(x)
        qkv = self.Wqkv(y).view(-1, 3, h, d)
        cos, sin = rotary
        q, k = apply_rotary(qkv[:, 0], cos, sin), apply_rotary(qkv[:, 1], cos, sin)
        x = x + self.Wo(self.attention(q, k, qkv[:, 2], inputs))
        gate_in = self.Wi(self.mlp_norm(x))
        return x + self.mlp_Wo(self.gated_act(gate_in))


class ModernBertEncoder(Module):
    """A ModernBERT encoder and, for ``ModernBertForSequenceClassification``, its head."""

    def __init__(self, hf: dict[str, Any], architecture: str) -> None:
        super().__init__()
        has_head = MODERNBERT_ARCHITECTURES[architecture]
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        if hidden % heads:
            raise ValueError(
                f"config.json: hidden_size ({hidden}) is not a multiple of "
                f"num_attention_heads ({heads})"
            )
        eps, norm_bias = hf.get("norm_eps", 1e-5), hf.get("norm_bias", False)
        window = hf.get("local_attention", 128) // 2
        self.hidden_size = hidden
        self.head_dim = hidden // heads
        self.vocab_size = hf["vocab_size"]
        self.max_positions = hf["max_position_embeddings"]
        self.tok_embeddings = Embedding(hf["vocab_size"], hidden)
        self.embedding_norm = EncoderLayerNorm(hidden, eps, norm_bias)
        self.layers = nn.ModuleList(
            ModernBertLayer(hf, i == 0, theta, window if kind == "sliding_attention" else None)
            for i, (kind, theta) in enumerate(modernbert_layers(hf))
        )
        self.final_norm = EncoderLayerNorm(hidden, eps, norm_bias)
        self.num_labels = num_labels(hf) if has_head else None
        self.head_dense = self.head_norm = self.classifier = None
        if has_head:
            self.classifier_pooling = hf.get("classifier_pooling", "cls")
            if self.classifier_pooling not in ("cls", "mean"):
                raise ValueError(
                    "config.json: classifier_pooling must be 'cls' or 'mean', "
                    f"got {self.classifier_pooling!r}"
                )
            self.head_dense = Linear(hidden, hidden, bias=hf.get("classifier_bias", False))
            self.head_act = encoder_activation(hf.get("classifier_activation", "gelu"))
            self.head_norm = EncoderLayerNorm(hidden, eps, norm_bias)
            self.classifier = Linear(hidden, self.num_labels, bias=True)

    uses_type_ids = False

    def forward(self, inputs: PackedInputs) -> torch.Tensor:
        """Last hidden states [T, hidden] of the packed inputs."""
        x = self.embedding_norm(self.tok_embeddings(inputs.ids))
        tables = {
            theta: rotary_tables(inputs.positions, self.head_dim, theta)
            for theta in {layer.theta for layer in self.layers}
        }
        for layer in self.layers:
            x = layer(x, inputs, tables[layer.theta])
        return self.final_norm(x)

    def classify(self, hidden: torch.Tensor, inputs: PackedInputs) -> torch.Tensor:
        """Classifier logits [B, num_labels], pooled per ``classifier_pooling``."""
        if self.classifier_pooling == "cls":
            pooled = inputs.first_rows(hidden)
        else:
            pooled = inputs.mean_rows(hidden).to(hidden.dtype)
        return self.classifier(self.head_norm(self.head_act(self.head_dense(pooled))))

    def checkpoint_sources(self, prefix: str, names: set[str]) -> dict[str, list[str]]:
        """Each parameter's checkpoint tensor, the encoder's under ``prefix``
        (``model.`` or none); ``names``: the checkpoint's tensor names
        (one layout only: not read)."""
        src = {"tok_embeddings.weight": [f"{prefix}embeddings.tok_embeddings.weight"]}
        for p in ("weight", "bias"):
            src[f"embedding_norm.{p}"] = [f"{prefix}embeddings.norm.{p}"]
            src[f"final_norm.{p}"] = [f"{prefix}final_norm.{p}"]
            for i in range(len(self.layers)):
                hf, me = f"{prefix}layers.{i}.", f"layers.{i}."
                for name in ("attn_norm", "mlp_norm"):
                    src[f"{me}{name}.{p}"] = [f"{hf}{name}.{p}"]
                src[f"{me}Wqkv.{p}"] = [f"{hf}attn.Wqkv.{p}"]
                src[f"{me}Wo.{p}"] = [f"{hf}attn.Wo.{p}"]
                src[f"{me}Wi.{p}"] = [f"{hf}mlp.Wi.{p}"]
                src[f"{me}mlp_Wo.{p}"] = [f"{hf}mlp.Wo.{p}"]
            src[f"head_dense.{p}"] = [f"head.dense.{p}"]
            src[f"head_norm.{p}"] = [f"head.norm.{p}"]
            src[f"classifier.{p}"] = [f"classifier.{p}"]
        return src

    @staticmethod
    def checkpoint_probe() -> str:
        """A tensor every checkpoint has (after its prefix)."""
        return "embeddings.tok_embeddings.weight"

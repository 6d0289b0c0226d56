"""Nomic BERT (nomic-embed-text): a post-LayerNorm encoder with rotary
positions, token types and a SwiGLU MLP.

Word and token-type embeddings summed and normalised (no position table),
then blocks of: q/k/v projections (no biases), rotary positions on the whole
head (``rope_parameters``' ``rope_theta``, default 1000), bidirectional
attention, output projection, residual and LayerNorm; ``down(act(gate(x)) *
up(x))`` (``hidden_act``, SiLU by default), residual and LayerNorm. The
classification head is BERT's: a pooler (dense + tanh on the CLS row) then
``classifier``.

Checkpoints come in transformers' layout (``layers.{i}.self_attn.q_proj``,
``mlp.gate_proj``, ``post_attention_layernorm``, ...) or in the layout of the
original release (``encoder.layers.{i}.attn.Wqkv``, ``mlp.fc11`` / ``fc12``
/ ``fc2``, ``norm1`` / ``norm2``, ``emb_ln``), whose config names its fields
``n_embd``, ``n_head``, ``n_layer``, ``n_inner``, ``rotary_emb_base``, ...
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
    encoder_gated_activation,
    rotary_tables,
)

#: architecture -> whether it has a sequence-classification head
NOMIC_ARCHITECTURES: dict[str, bool] = {
    "NomicBertModel": False,
    "NomicBertForMaskedLM": False,
    "NomicBertForSequenceClassification": True,
}

#: the original release's config fields -> transformers' names
_RELEASE_FIELDS = {
    "n_embd": "hidden_size",
    "n_head": "num_attention_heads",
    "n_layer": "num_hidden_layers",
    "n_inner": "intermediate_size",
    "n_positions": "max_position_embeddings",
    "layer_norm_epsilon": "layer_norm_eps",
}


def nomic_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The config in transformers' names, with its defaults, checked: the
    original release's fields translated, and a clear error for the
    variants this encoder does not run."""
    cfg = dict(hf)
    for old, new in _RELEASE_FIELDS.items():
        if old in cfg and new not in cfg:
            cfg[new] = cfg[old]
    release = "n_embd" in hf
    if release:
        act = cfg.get("activation_function", "swiglu")
        if act not in ("swiglu", "silu"):
            raise ValueError(
                f"config.json: Nomic BERT activation_function={act!r} is not supported "
                "(only 'swiglu')"
            )
        cfg["hidden_act"] = "silu"
        unsupported = {
            "prenorm": False,
            "causal": False,
            "rotary_emb_interleaved": False,
            "qkv_proj_bias": False,
            "mlp_fc1_bias": False,
            "mlp_fc2_bias": False,
        }
        for key, ok in unsupported.items():
            if cfg.get(key, ok) != ok:
                raise ValueError(
                    f"config.json: Nomic BERT with {key}={cfg[key]!r} is not supported"
                )
        fraction = cfg.get("rotary_emb_fraction", 1.0)
        if fraction != 1.0:
            raise ValueError(
                f"config.json: Nomic BERT with rotary_emb_fraction={fraction!r} is not "
                "supported (only 1.0: the whole head rotated)"
            )
        if cfg.get("rotary_scaling_factor") not in (None, 1, 1.0):
            raise ValueError(
                "config.json: Nomic BERT with rotary_scaling_factor="
                f"{cfg['rotary_scaling_factor']!r} is not supported"
            )
        if "rotary_emb_base" in cfg:
            cfg.setdefault("rope_theta", cfg["rotary_emb_base"])
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        if key not in cfg:
            raise ValueError(f"config.json: Nomic BERT needs {key!r}")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    cfg.setdefault("intermediate_size", 4 * hidden)
    if cfg.get("head_dim") is None:
        if hidden % heads:
            raise ValueError(
                f"config.json: hidden_size ({hidden}) is not a multiple of "
                f"num_attention_heads ({heads}) and no 'head_dim' is given"
            )
        cfg["head_dim"] = hidden // heads
    if cfg["head_dim"] % 2:
        raise ValueError(f"config.json: head_dim ({cfg['head_dim']}) must be even for rotary")
    theta = cfg.get("rope_theta", 1000.0)
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        kind = params.get("rope_type", "default")
        if kind != "default":
            raise ValueError(f"config.json: Nomic BERT rope_type {kind!r} is not supported")
        theta = params.get("rope_theta", theta)
    cfg["rope_theta"] = float(theta)
    return cfg


class NomicBertLayer(Module):
    """One post-LayerNorm block with rotary attention and a SwiGLU MLP."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, heads, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
        inter = cfg["intermediate_size"]
        eps = cfg.get("layer_norm_eps", 1e-12)
        self.qkv = Linear(hidden, 3 * heads * d, bias=False)
        self.o_proj = Linear(heads * d, hidden, bias=False)
        self.attn_norm = EncoderLayerNorm(hidden, eps)
        self.gate_up = Linear(hidden, 2 * inter, bias=False)
        self.down = Linear(inter, hidden, bias=False)
        self.mlp_norm = EncoderLayerNorm(hidden, eps)
        self.gated_act = encoder_gated_activation(cfg.get("hidden_act", "silu"))
        self.attention = EncoderAttention(heads, d)

    def forward(
        self, x: torch.Tensor, inputs: PackedInputs, rotary: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; ``rotary``: the (cos, sin) tables."""
        h, d = self.attention.num_heads, self.attention.head_dim
        qkv = self.qkv(x).view(-1, 3, h, d)
        cos, sin = rotary
        q, k = apply_rotary(qkv[:, 0], cos, sin), apply_rotary(qkv[:, 1], cos, sin)
        x = self.attn_norm(self.o_proj(self.attention(q, k, qkv[:, 2], inputs)), residual=x)
        return self.mlp_norm(self.down(self.gated_act(self.gate_up(x))), residual=x)


class NomicBertEncoder(Module):
    """A Nomic BERT encoder and, for ``NomicBertForSequenceClassification``, its head."""

    def __init__(self, hf: dict[str, Any], architecture: str) -> None:
        super().__init__()
        has_head = NOMIC_ARCHITECTURES[architecture]
        cfg = nomic_config(hf)
        hidden = cfg["hidden_size"]
        self.hidden_size = hidden
        self.head_dim = cfg["head_dim"]
        self.theta = cfg["rope_theta"]
        self.vocab_size = cfg["vocab_size"]
        self.max_positions = cfg.get("max_position_embeddings", 2048)
        self.word_embeddings = Embedding(cfg["vocab_size"], hidden)
        self.token_type_embeddings = Embedding(cfg.get("type_vocab_size", 2), hidden)
        self.embedding_norm = EncoderLayerNorm(hidden, cfg.get("layer_norm_eps", 1e-12))
        self.layers = nn.ModuleList(NomicBertLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.num_labels = num_labels(hf) if has_head else None
        self.pooler = Linear(hidden, hidden, bias=True) if has_head else None
        self.classifier = Linear(hidden, self.num_labels, bias=True) if has_head else None

    #: Inputs carry the tokenizer's token types (BERT's tokenizers write them).
    uses_type_ids = True

    def forward(self, inputs: PackedInputs) -> torch.Tensor:
        """Last hidden states [T, hidden] of the packed inputs."""
        types = inputs.type_ids
        if types is None:
            types = torch.zeros_like(inputs.ids)
        x = self.embedding_norm(
            self.word_embeddings(inputs.ids) + self.token_type_embeddings(types)
        )
        rotary = rotary_tables(inputs.positions, self.head_dim, self.theta)
        for layer in self.layers:
            x = layer(x, inputs, rotary)
        return x

    def classify(self, hidden: torch.Tensor, inputs: PackedInputs) -> torch.Tensor:
        """Classifier logits [B, num_labels] from the CLS rows."""
        return self.classifier(torch.tanh(self.pooler(inputs.first_rows(hidden))))

    def checkpoint_sources(self, prefix: str, names: set[str]) -> dict[str, list[str]]:
        """Each parameter's checkpoint tensors (concatenated in order), the
        encoder's under ``prefix`` (``nomic_bert.`` or none), in whichever
        layout ``names`` (the checkpoint's tensor names) is written."""
        release = f"{prefix}emb_ln.weight" in names
        src: dict[str, list[str]] = {}
        emb = f"{prefix}embeddings."
        for name in ("word_embeddings", "token_type_embeddings"):
            src[f"{name}.weight"] = [f"{emb}{name}.weight"]
        for p in ("weight", "bias"):
            norm = f"{prefix}emb_ln.{p}" if release else f"{emb}LayerNorm.{p}"
            src[f"embedding_norm.{p}"] = [norm]
        for i in range(len(self.layers)):
            me = f"layers.{i}."
            if release:
                hf = f"{prefix}encoder.layers.{i}."
                src[f"{me}qkv.weight"] = [f"{hf}attn.Wqkv.weight"]
                src[f"{me}o_proj.weight"] = [f"{hf}attn.out_proj.weight"]
                # fc12 is the gated half, fc11 the other (transformers' reading)
                src[f"{me}gate_up.weight"] = [f"{hf}mlp.fc12.weight", f"{hf}mlp.fc11.weight"]
                src[f"{me}down.weight"] = [f"{hf}mlp.fc2.weight"]
                norms = {"attn_norm": "norm1", "mlp_norm": "norm2"}
            else:
                hf = f"{prefix}layers.{i}."
                src[f"{me}qkv.weight"] = [f"{hf}self_attn.{n}_proj.weight" for n in "qkv"]
                src[f"{me}o_proj.weight"] = [f"{hf}self_attn.o_proj.weight"]
                src[f"{me}gate_up.weight"] = [
                    f"{hf}mlp.gate_proj.weight",
                    f"{hf}mlp.up_proj.weight",
                ]
                src[f"{me}down.weight"] = [f"{hf}mlp.down_proj.weight"]
                norms = {"attn_norm": "post_attention_layernorm", "mlp_norm": "post_mlp_layernorm"}
            for mine, theirs in norms.items():
                for p in ("weight", "bias"):
                    src[f"{me}{mine}.{p}"] = [f"{hf}{theirs}.{p}"]
        for p in ("weight", "bias"):
            src[f"pooler.{p}"] = [f"{prefix}pooler.dense.{p}"]
            src[f"classifier.{p}"] = [f"classifier.{p}"]
        return src

    @staticmethod
    def checkpoint_probe() -> str:
        """A tensor every checkpoint has (after its prefix)."""
        return "embeddings.word_embeddings.weight"

"""Rotary BERT encoders: Nomic BERT (nomic-embed-text) and GTE
(gte-multilingual-base, gte-base-en-v1.5): post-LayerNorm encoders with
rotary positions, token types and a gated MLP.

Word and token-type embeddings summed and normalised (no position table;
GTE with ``type_vocab_size`` 0 has no token types), then blocks of: q/k/v
projections (GTE: with biases), rotary positions on the whole head
(``rope_parameters``' ``rope_theta``: default 1000 for Nomic BERT, 160000
for GTE), bidirectional attention, output projection (GTE: with a bias),
residual and LayerNorm; ``down(act(gate(x)) * up(x))`` (``hidden_act``:
SiLU by default for Nomic BERT, GELU for GTE; GTE's ``down`` has a bias),
residual and LayerNorm. The classification head is BERT's: a pooler (dense
+ tanh on the CLS row) then ``classifier``.

Nomic BERT checkpoints come in transformers' layout (``layers.{i}.self_attn.q_proj``,
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
    token_embeddings,
)

#: architecture -> (family, whether it has a sequence-classification head);
#: ``New*``: GTE's original release (gte-multilingual-base and its reranker)
ROTARY_BERT_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "NomicBertModel": ("nomic_bert", False),
    "NomicBertForMaskedLM": ("nomic_bert", False),
    "NomicBertForSequenceClassification": ("nomic_bert", True),
    "GteModel": ("gte", False),
    "GteForMaskedLM": ("gte", False),
    "GteForSequenceClassification": ("gte", True),
    "NewModel": ("gte", False),
    "NewForMaskedLM": ("gte", False),
    "NewForSequenceClassification": ("gte", True),
}

#: family -> (linear biases of attention and of the MLP's down projection,
#: default rotary base, default activation, default token types)
_FAMILIES: dict[str, tuple[bool, float, str, int]] = {
    "nomic_bert": (False, 1000.0, "silu", 2),
    "gte": (True, 160_000.0, "gelu", 1),
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


def rotary_bert_config(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """The config in transformers' names, with the family's defaults, checked:
    Nomic BERT's original release's fields translated, and a clear error for
    the variants this encoder does not run."""
    bias, theta, act, types = _FAMILIES[family]
    cfg = {"attention_bias": bias, "hidden_act": act, "type_vocab_size": types, **hf}
    for old, new in _RELEASE_FIELDS.items():
        if old in cfg and new not in cfg:
            cfg[new] = cfg[old]
    if "n_embd" in hf:
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
    if family == "gte":  # the fields of GTE's original release (``NewModel``) it runs
        for key, ok in (
            ("position_embedding_type", "rope"),
            ("layer_norm_type", "layer_norm"),
            ("logn_attention_scale", False),
            ("rope_scaling", None),
        ):
            if cfg.get(key, ok) != ok:
                raise ValueError(f"config.json: GTE with {key}={cfg[key]!r} is not supported")
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        if key not in cfg:
            raise ValueError(f"config.json: {family} needs {key!r}")
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
    theta = cfg.get("rope_theta", theta)
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        kind = params.get("rope_type", "default")
        if kind != "default":
            raise ValueError(f"config.json: {family} rope_type {kind!r} is not supported")
        theta = params.get("rope_theta", theta)
    cfg["rope_theta"] = float(theta)
    return cfg


class RotaryBertLayer(Module):
    """One post-LayerNorm block with rotary attention and a gated MLP."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, heads, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
        inter = cfg["intermediate_size"]
        eps, bias = cfg.get("layer_norm_eps", 1e-12), cfg["attention_bias"]
        self.qkv = Linear(hidden, 3 * heads * d, bias=bias)
        self.o_proj = Linear(heads * d, hidden, bias=bias)
        self.attn_norm = EncoderLayerNorm(hidden, eps)
        self.gate_up = Linear(hidden, 2 * inter, bias=False)
        self.down = Linear(inter, hidden, bias=bias)
        self.mlp_norm = EncoderLayerNorm(hidden, eps)
        self.gated_act = encoder_gated_activation(cfg["hidden_act"])
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


class RotaryBertEncoder(Module):
    """A Nomic BERT or GTE encoder and, for ``*ForSequenceClassification``, its head."""

    def __init__(self, hf: dict[str, Any], architecture: str) -> None:
        super().__init__()
        family, has_head = ROTARY_BERT_ARCHITECTURES[architecture]
        cfg = rotary_bert_config(hf, family)
        hidden = cfg["hidden_size"]
        self.hidden_size = hidden
        self.head_dim = cfg["head_dim"]
        self.theta = cfg["rope_theta"]
        self.vocab_size = cfg["vocab_size"]
        self.max_positions = cfg.get("max_position_embeddings", 2048)
        self.word_embeddings = Embedding(cfg["vocab_size"], hidden)
        types = cfg["type_vocab_size"]
        self.token_type_embeddings = Embedding(types, hidden) if types else None
        #: Inputs carry the tokenizer's token types where the model has more than one.
        self.uses_type_ids = types > 1
        self.embedding_norm = EncoderLayerNorm(hidden, cfg.get("layer_norm_eps", 1e-12))
        self.layers = nn.ModuleList(RotaryBertLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.num_labels = num_labels(hf) if has_head else None
        self.pooler = Linear(hidden, hidden, bias=True) if has_head else None
        self.classifier = Linear(hidden, self.num_labels, bias=True) if has_head else None
        self._swap_gate_up = False  # set by ``checkpoint_sources`` for GTE's layout

    def forward(self, inputs: PackedInputs) -> torch.Tensor:
        """Last hidden states [T, hidden] of the packed inputs."""
        x = token_embeddings(self.word_embeddings, self.token_type_embeddings, inputs)
        x = self.embedding_norm(x)
        rotary = rotary_tables(inputs.positions, self.head_dim, self.theta)
        for layer in self.layers:
            x = layer(x, inputs, rotary)
        return x

    def classify(self, hidden: torch.Tensor, inputs: PackedInputs) -> torch.Tensor:
        """Classifier logits [B, num_labels] from the CLS rows."""
        return self.classifier(torch.tanh(self.pooler(inputs.first_rows(hidden))))

    def checkpoint_sources(self, prefix: str, names: set[str]) -> dict[str, list[str]]:
        """Each parameter's checkpoint tensors (concatenated in order), the
        encoder's under ``prefix`` (``nomic_bert.``, ``gte.``, ``new.`` or
        none), in whichever layout ``names`` (the checkpoint's tensor names)
        is written: Nomic BERT's release (``Wqkv``, ``fc11`` / ``fc12`` /
        ``fc2``, ``norm1`` / ``norm2``, ``emb_ln``; what transformers saves),
        GTE's (``qkv_proj``, ``up_gate_proj``, ``attn_ln`` / ``mlp_ln``; what
        transformers saves), or the module names of transformers' classes
        (``self_attn.q_proj``, ``mlp.gate_proj``, ...: a state dict saved as it is).
        A fused ``up_gate_proj`` is read whole; ``loaded`` swaps its halves."""
        src: dict[str, list[str]] = {}
        emb = f"{prefix}embeddings."
        for name in ("word_embeddings", "token_type_embeddings"):
            src[f"{name}.weight"] = [f"{emb}{name}.weight"]
        nomic = f"{prefix}emb_ln.weight" in names
        gte = f"{prefix}encoder.layer.0.attention.qkv_proj.weight" in names
        for p in ("weight", "bias"):
            src[f"embedding_norm.{p}"] = [f"{prefix}emb_ln.{p}" if nomic else f"{emb}LayerNorm.{p}"]
            src[f"pooler.{p}"] = [f"{prefix}pooler.dense.{p}"]
            src[f"classifier.{p}"] = [f"classifier.{p}"]
        for i in range(len(self.layers)):
            me = f"layers.{i}."
            if nomic:
                hf = f"{prefix}encoder.layers.{i}."
                parts = {
                    "qkv": ["attn.Wqkv"],
                    "o_proj": ["attn.out_proj"],
                    # fc12 is the gated half, fc11 the other (transformers' reading)
                    "gate_up": ["mlp.fc12", "mlp.fc11"],
                    "down": ["mlp.fc2"],
                    "attn_norm": ["norm1"],
                    "mlp_norm": ["norm2"],
                }
            elif gte:
                hf = f"{prefix}encoder.layer.{i}."
                parts = {
                    "qkv": ["attention.qkv_proj"],
                    "o_proj": ["attention.o_proj"],
                    "gate_up": ["mlp.up_gate_proj"],
                    "down": ["mlp.down_proj"],
                    "attn_norm": ["attn_ln"],
                    "mlp_norm": ["mlp_ln"],
                }
            else:
                hf = f"{prefix}layers.{i}."
                parts = {
                    "qkv": [f"self_attn.{n}_proj" for n in "qkv"],
                    "o_proj": ["self_attn.o_proj"],
                    "gate_up": ["mlp.gate_proj", "mlp.up_proj"],
                    "down": ["mlp.down_proj"],
                    "attn_norm": ["post_attention_layernorm"],
                    "mlp_norm": ["post_mlp_layernorm"],
                }
            for mine, theirs in parts.items():
                for p in ("weight", "bias"):
                    src[f"{me}{mine}.{p}"] = [f"{hf}{t}.{p}" for t in theirs]
        self._swap_gate_up = gte
        return src

    def loaded(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The parameter ``name`` as this module holds it, from the tensor read
        for it: GTE's fused ``up_gate_proj`` stores the gate second."""
        if self._swap_gate_up and name.endswith(".gate_up.weight"):
            half = tensor.shape[0] // 2
            return torch.cat([tensor[half:], tensor[:half]])
        return tensor

    @staticmethod
    def checkpoint_probe() -> str:
        """A tensor every checkpoint has (after its prefix)."""
        return "embeddings.word_embeddings.weight"

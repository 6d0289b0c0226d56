"""BERT, RoBERTa and XLM-RoBERTa encoders (one model: they differ only in
their positions, their token types and their classification heads).

Word, position and token-type embeddings summed and normalised, then
post-LayerNorm blocks: fused QKV, bidirectional attention, output projection,
residual and LayerNorm; GELU MLP, residual and LayerNorm. RoBERTa's
positions start at ``pad_token_id + 1`` and skip the padding token, as
transformers counts them. The classification heads: BERT's pooler
(dense + tanh on the CLS row) then ``classifier``; RoBERTa's
``classifier.dense`` + tanh + ``classifier.out_proj`` on the CLS row.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fastllm.layers import Module
from fastllm.layers.linear import Embedding, Linear
from fastllm.pooling.encoder_layers import (
    EncoderAttention,
    EncoderLayerNorm,
    PackedInputs,
    encoder_activation,
)

#: architecture -> (family, whether it has a sequence-classification head)
BERT_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "BertModel": ("bert", False),
    "BertForMaskedLM": ("bert", False),
    "BertForSequenceClassification": ("bert", True),
    "RobertaModel": ("roberta", False),
    "RobertaForMaskedLM": ("roberta", False),
    "RobertaForSequenceClassification": ("roberta", True),
    "XLMRobertaModel": ("roberta", False),
    "XLMRobertaForMaskedLM": ("roberta", False),
    "XLMRobertaForSequenceClassification": ("roberta", True),
}


class BertLayer(Module):
    """One post-LayerNorm encoder block."""

    def __init__(self, hf: dict[str, Any]) -> None:
        super().__init__()
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        eps = hf.get("layer_norm_eps", 1e-12)
        self.hidden = hidden
        self.qkv = Linear(hidden, 3 * hidden, bias=True)
        self.attn_out = Linear(hidden, hidden, bias=True)
        self.attn_norm = EncoderLayerNorm(hidden, eps)
        self.intermediate = Linear(hidden, hf["intermediate_size"], bias=True)
        self.output = Linear(hf["intermediate_size"], hidden, bias=True)
        self.out_norm = EncoderLayerNorm(hidden, eps)
        self.act = encoder_activation(hf.get("hidden_act", "gelu"))
        self.attention = EncoderAttention(heads, hidden // heads)

    def forward(self, x: torch.Tensor, inputs: PackedInputs) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]."""
        qkv = self.qkv(x)
        h, d, n = self.attention.num_heads, self.attention.head_dim, self.hidden
        q, k, v = (qkv[:, i * n : (i + 1) * n].view(-1, h, d) for i in range(3))
        x = self.attn_norm(self.attn_out(self.attention(q, k, v, inputs)), residual=x)
        return self.out_norm(self.output(self.act(self.intermediate(x))), residual=x)


class BertEncoder(Module):
    """A BERT-family encoder and, for ``*ForSequenceClassification``, its head."""

    def __init__(self, hf: dict[str, Any], architecture: str) -> None:
        super().__init__()
        family, has_head = BERT_ARCHITECTURES[architecture]
        check_bert_config(hf, architecture)
        hidden = hf["hidden_size"]
        self.family = family
        self.hidden_size = hidden
        self.vocab_size = hf["vocab_size"]
        self.pad_token_id = hf.get("pad_token_id", 1 if family == "roberta" else 0)
        self.max_positions = hf["max_position_embeddings"]
        if family == "roberta":
            self.max_positions -= self.pad_token_id + 1
        self.word_embeddings = Embedding(hf["vocab_size"], hidden)
        self.position_embeddings = Embedding(hf["max_position_embeddings"], hidden)
        self.token_type_embeddings = Embedding(hf.get("type_vocab_size", 2), hidden)
        self.embedding_norm = EncoderLayerNorm(hidden, hf.get("layer_norm_eps", 1e-12))
        self.layers = nn.ModuleList(BertLayer(hf) for _ in range(hf["num_hidden_layers"]))
        self.num_labels = num_labels(hf) if has_head else None
        self.pooler = self.head_dense = None
        if has_head and family == "bert":
            self.pooler = Linear(hidden, hidden, bias=True)
        elif has_head:
            self.head_dense = Linear(hidden, hidden, bias=True)
        self.classifier = Linear(hidden, self.num_labels, bias=True) if has_head else None

    @property
    def uses_type_ids(self) -> bool:
        """Whether inputs carry the tokenizer's token types (BERT); RoBERTa reads zeros."""
        return self.family == "bert"

    def forward(self, inputs: PackedInputs) -> torch.Tensor:
        """Last hidden states [T, hidden] of the packed inputs."""
        positions = inputs.positions
        if self.family == "roberta":
            positions = _roberta_positions(inputs, self.pad_token_id)
        types = inputs.type_ids
        if types is None:
            types = torch.zeros_like(inputs.ids)
        x = self.word_embeddings(inputs.ids) + self.token_type_embeddings(types)
        x = self.embedding_norm(x + self.position_embeddings(positions))
        for layer in self.layers:
            x = layer(x, inputs)
        return x

    def classify(self, hidden: torch.Tensor, inputs: PackedInputs) -> torch.Tensor:
        """Classifier logits [B, num_labels] from the CLS rows."""
        cls = inputs.first_rows(hidden)
        if self.pooler is not None:
            return self.classifier(torch.tanh(self.pooler(cls)))
        return self.classifier(torch.tanh(self.head_dense(cls)))

    def checkpoint_sources(self, prefix: str, names: set[str]) -> dict[str, list[str]]:
        """Each parameter's checkpoint tensors (concatenated in order), the
        encoder's under ``prefix`` (``bert.``, ``roberta.`` or none); ``names``: the checkpoint's
        tensor names (one layout only: not read)."""
        src: dict[str, list[str]] = {}
        emb = f"{prefix}embeddings."
        for name in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
            src[f"{name}.weight"] = [f"{emb}{name}.weight"]
        for p in ("weight", "bias"):
            src[f"embedding_norm.{p}"] = [f"{emb}LayerNorm.{p}"]
            for i in range(len(self.layers)):
                hf, me = f"{prefix}encoder.layer.{i}.", f"layers.{i}."
                qkv = ("query", "key", "value")
                src[f"{me}qkv.{p}"] = [f"{hf}attention.self.{n}.{p}" for n in qkv]
                src[f"{me}attn_out.{p}"] = [f"{hf}attention.output.dense.{p}"]
                src[f"{me}attn_norm.{p}"] = [f"{hf}attention.output.LayerNorm.{p}"]
                src[f"{me}intermediate.{p}"] = [f"{hf}intermediate.dense.{p}"]
                src[f"{me}output.{p}"] = [f"{hf}output.dense.{p}"]
                src[f"{me}out_norm.{p}"] = [f"{hf}output.LayerNorm.{p}"]
            if self.pooler is not None:
                src[f"pooler.{p}"] = [f"{prefix}pooler.dense.{p}"]
                src[f"classifier.{p}"] = [f"classifier.{p}"]
            elif self.head_dense is not None:
                src[f"head_dense.{p}"] = [f"classifier.dense.{p}"]
                src[f"classifier.{p}"] = [f"classifier.out_proj.{p}"]
        return src

    @staticmethod
    def checkpoint_probe() -> str:
        """A tensor every checkpoint of the family has (after its prefix)."""
        return "embeddings.word_embeddings.weight"


def _roberta_positions(inputs: PackedInputs, pad: int) -> torch.Tensor:
    """RoBERTa's positions: ``pad + 1`` onwards within each input, counting
    only non-padding tokens; a padding token sits at ``pad``."""
    keep = (inputs.ids != pad).to(torch.int64)
    running = torch.cumsum(keep, 0)
    before = (running - keep)[inputs.starts]  # kept tokens before each input
    return (running - before[inputs.seq_index]) * keep + pad


def num_labels(hf: dict[str, Any]) -> int:
    """The classification head's labels: ``id2label``'s size, else ``num_labels`` (2)."""
    id2label = hf.get("id2label")
    if isinstance(id2label, dict) and id2label:
        return len(id2label)
    n = hf.get("num_labels", 2)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"config.json: num_labels must be a positive integer, got {n!r}")
    return n


def check_bert_config(hf: dict[str, Any], architecture: str) -> None:
    """A clear error for the BERT variants this encoder does not run."""
    pos = hf.get("position_embedding_type", "absolute")
    if pos != "absolute":
        raise ValueError(
            f"config.json: {architecture} with position_embedding_type={pos!r} is not "
            "supported (only 'absolute')"
        )
    if hf["hidden_size"] % hf["num_attention_heads"]:
        raise ValueError(
            f"config.json: hidden_size ({hf['hidden_size']}) is not a multiple of "
            f"num_attention_heads ({hf['num_attention_heads']})"
        )

"""BERT, RoBERTa, XLM-RoBERTa, DistilBERT and MPNet encoders (one model: they
differ in their positions, their token types, their tensor names and their
classification heads, and MPNet adds a relative position bias).

Word, position and token-type embeddings summed and normalised, then
post-LayerNorm blocks: fused QKV, bidirectional attention, output projection,
residual and LayerNorm; GELU MLP, residual and LayerNorm. RoBERTa's and
MPNet's positions start at ``pad_token_id + 1`` and skip the padding token,
as transformers counts them; DistilBERT and MPNet have no token types.
MPNet adds to every layer's scores one learned bias per head and bucket of
relative distance (T5's bidirectional buckets: 32, up to 128 tokens apart).
The classification heads: BERT's pooler (dense + tanh on the CLS row) then
``classifier``; RoBERTa's and MPNet's ``classifier.dense`` + tanh +
``classifier.out_proj`` on the CLS row; DistilBERT's ``pre_classifier`` +
ReLU + ``classifier``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fastllm.config import DISTILBERT_NAMES
from fastllm.layers import Module
from fastllm.layers.linear import Embedding, Linear
from fastllm.pooling.encoder_layers import (
    EncoderAttention,
    EncoderLayerNorm,
    PackedInputs,
    encoder_activation,
    token_embeddings,
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
    "DistilBertModel": ("distilbert", False),
    "DistilBertForMaskedLM": ("distilbert", False),
    "DistilBertForSequenceClassification": ("distilbert", True),
    "MPNetModel": ("mpnet", False),
    "MPNetForMaskedLM": ("mpnet", False),
    "MPNetForSequenceClassification": ("mpnet", True),
}

#: the families whose position ids count past the padding id, as RoBERTa's do
_ROBERTA_POSITIONS = ("roberta", "mpnet")
#: MPNet's relative-position buckets as transformers computes them (32 buckets,
#: exact up to 8 tokens apart each way, logarithmic up to 128)
_MPNET_BUCKETS, _MPNET_MAX_DISTANCE = 32, 128


def bert_config(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """The config in BERT's names: DistilBERT's ``dim``, ``n_layers``, ...,
    ``activation`` translated; no token types for DistilBERT and MPNet."""
    cfg = dict(hf)
    if family == "distilbert":
        for name, theirs in DISTILBERT_NAMES.items():
            cfg[name] = hf[theirs]
        cfg["hidden_act"] = hf.get("activation", "gelu")
    if family in ("distilbert", "mpnet"):
        cfg["type_vocab_size"] = 0
    return cfg


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

    def forward(
        self,
        x: torch.Tensor,
        inputs: PackedInputs,
        bias: Callable[[int], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; ``bias``: MPNet's relative position bias
        (``EncoderAttention``'s)."""
        qkv = self.qkv(x)
        h, d, n = self.attention.num_heads, self.attention.head_dim, self.hidden
        q, k, v = (qkv[:, i * n : (i + 1) * n].view(-1, h, d) for i in range(3))
        x = self.attn_norm(self.attn_out(self.attention(q, k, v, inputs, bias)), residual=x)
        return self.out_norm(self.output(self.act(self.intermediate(x))), residual=x)


class BertEncoder(Module):
    """A BERT-family encoder and, for ``*ForSequenceClassification``, its head."""

    def __init__(self, hf: dict[str, Any], architecture: str) -> None:
        super().__init__()
        family, has_head = BERT_ARCHITECTURES[architecture]
        hf = bert_config(hf, family)
        check_bert_config(hf, architecture)
        hidden = hf["hidden_size"]
        self.family = family
        self.hidden_size = hidden
        self.vocab_size = hf["vocab_size"]
        self.roberta_positions = family in _ROBERTA_POSITIONS
        self.pad_token_id = hf.get("pad_token_id", 1 if self.roberta_positions else 0)
        if family == "mpnet":
            self.pad_token_id = 1  # transformers' MPNet counts positions past id 1, always
        self.max_positions = hf["max_position_embeddings"]
        if self.roberta_positions:
            self.max_positions -= self.pad_token_id + 1
        self.word_embeddings = Embedding(hf["vocab_size"], hidden)
        self.position_embeddings = Embedding(hf["max_position_embeddings"], hidden)
        types = hf.get("type_vocab_size", 2)
        self.token_type_embeddings = Embedding(types, hidden) if types else None
        self.embedding_norm = EncoderLayerNorm(hidden, hf.get("layer_norm_eps", 1e-12))
        self.layers = nn.ModuleList(BertLayer(hf) for _ in range(hf["num_hidden_layers"]))
        self.relative_attention_bias = None
        if family == "mpnet":
            buckets = hf.get("relative_attention_num_buckets", _MPNET_BUCKETS)
            if buckets < _MPNET_BUCKETS:
                # transformers buckets distances into 32 whatever the table's
                # size, so a smaller table has no row for the far buckets.
                raise ValueError(
                    f"config.json: MPNet with relative_attention_num_buckets={buckets} is not "
                    f"supported: relative distances fall in {_MPNET_BUCKETS} buckets, and the "
                    f"table needs a row for each"
                )
            self.relative_attention_bias = Embedding(buckets, hf["num_attention_heads"])
        self.num_labels = num_labels(hf) if has_head else None
        self.pooler = self.head_dense = self.pre_classifier = None
        if has_head and family == "bert":
            self.pooler = Linear(hidden, hidden, bias=True)
        elif has_head and family == "distilbert":
            self.pre_classifier = Linear(hidden, hidden, bias=True)
        elif has_head:
            self.head_dense = Linear(hidden, hidden, bias=True)
        self.classifier = Linear(hidden, self.num_labels, bias=True) if has_head else None

    @property
    def uses_type_ids(self) -> bool:
        """Whether inputs carry the tokenizer's token types (BERT); RoBERTa reads
        zeros, DistilBERT and MPNet have none (nor has a BERT GGUF file
        without a token-type table: DistilBERT's, as llama.cpp's converter
        writes it)."""
        return self.family == "bert" and self.token_type_embeddings is not None

    def forward(self, inputs: PackedInputs) -> torch.Tensor:
        """Last hidden states [T, hidden] of the packed inputs."""
        positions = inputs.positions
        if self.roberta_positions:
            positions = _roberta_positions(inputs, self.pad_token_id)
        x = token_embeddings(self.word_embeddings, self.token_type_embeddings, inputs)
        x = self.embedding_norm(x + self.position_embeddings(positions))
        bias = None
        if self.relative_attention_bias is not None:
            table = self.relative_attention_bias.weight
            biases: dict[int, torch.Tensor] = {}

            def bias(length: int) -> torch.Tensor:
                if length not in biases:
                    biases[length] = mpnet_position_bias(table, length)
                return biases[length]

        for layer in self.layers:
            x = layer(x, inputs, bias)
        return x

    def classify(self, hidden: torch.Tensor, inputs: PackedInputs) -> torch.Tensor:
        """Classifier logits [B, num_labels] from the CLS rows."""
        cls = inputs.first_rows(hidden)
        if self.pooler is not None:
            return self.classifier(torch.tanh(self.pooler(cls)))
        if self.pre_classifier is not None:
            return self.classifier(torch.relu(self.pre_classifier(cls)))
        return self.classifier(torch.tanh(self.head_dense(cls)))

    def checkpoint_sources(self, prefix: str, names: set[str]) -> dict[str, list[str]]:
        """Each parameter's checkpoint tensors (concatenated in order), the
        encoder's under ``prefix`` (``bert.``, ``roberta.``, ``distilbert.``,
        ``mpnet.`` or none); ``names``: the checkpoint's tensor names (one
        layout a family: not read)."""
        src: dict[str, list[str]] = {}
        emb = f"{prefix}embeddings."
        for name in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
            src[f"{name}.weight"] = [f"{emb}{name}.weight"]
        src["relative_attention_bias.weight"] = [f"{prefix}encoder.relative_attention_bias.weight"]
        for p in ("weight", "bias"):
            src[f"embedding_norm.{p}"] = [f"{emb}LayerNorm.{p}"]
            for i in range(len(self.layers)):
                me = f"layers.{i}."
                for mine, theirs in _layer_tensors(self.family, prefix, i).items():
                    src[f"{me}{mine}.{p}"] = [f"{t}.{p}" for t in theirs]
            if self.pooler is not None:
                src[f"pooler.{p}"] = [f"{prefix}pooler.dense.{p}"]
                src[f"classifier.{p}"] = [f"classifier.{p}"]
            elif self.pre_classifier is not None:
                src[f"pre_classifier.{p}"] = [f"pre_classifier.{p}"]
                src[f"classifier.{p}"] = [f"classifier.{p}"]
            elif self.head_dense is not None:
                src[f"head_dense.{p}"] = [f"classifier.dense.{p}"]
                src[f"classifier.{p}"] = [f"classifier.out_proj.{p}"]
        return src

    @staticmethod
    def checkpoint_probe() -> str:
        """A tensor every checkpoint of the family has (after its prefix)."""
        return "embeddings.word_embeddings.weight"


def _layer_tensors(family: str, prefix: str, i: int) -> dict[str, list[str]]:
    """Layer ``i``'s parameters -> the checkpoint's tensors (without ``.weight``
    / ``.bias``), in the family's names."""
    if family == "distilbert":
        hf = f"{prefix}transformer.layer.{i}."
        return {
            "qkv": [f"{hf}attention.{n}_lin" for n in "qkv"],
            "attn_out": [f"{hf}attention.out_lin"],
            "attn_norm": [f"{hf}sa_layer_norm"],
            "intermediate": [f"{hf}ffn.lin1"],
            "output": [f"{hf}ffn.lin2"],
            "out_norm": [f"{hf}output_layer_norm"],
        }
    hf = f"{prefix}encoder.layer.{i}."
    if family == "mpnet":
        attention = {
            "qkv": [f"{hf}attention.attn.{n}" for n in "qkv"],
            "attn_out": [f"{hf}attention.attn.o"],
            "attn_norm": [f"{hf}attention.LayerNorm"],
        }
    else:
        attention = {
            "qkv": [f"{hf}attention.self.{n}" for n in ("query", "key", "value")],
            "attn_out": [f"{hf}attention.output.dense"],
            "attn_norm": [f"{hf}attention.output.LayerNorm"],
        }
    return {
        **attention,
        "intermediate": [f"{hf}intermediate.dense"],
        "output": [f"{hf}output.dense"],
        "out_norm": [f"{hf}output.LayerNorm"],
    }


def mpnet_position_bias(table: torch.Tensor, length: int) -> torch.Tensor:
    """MPNet's relative position bias [heads, length, length] of one input
    from its table [buckets, heads]: key j seen from query i falls in T5's
    bidirectional bucket of j - i (as transformers computes it: 32 buckets
    whatever the table's size)."""
    pos = torch.arange(length, device=table.device)
    n = pos[:, None] - pos[None, :]  # query - key
    half = _MPNET_BUCKETS // 2
    exact = half // 2
    bucket = (n < 0).to(torch.long) * half
    n = n.abs()
    scaled = torch.log(n.clamp(min=1).float() / exact) / math.log(_MPNET_MAX_DISTANCE / exact)
    large = (exact + (scaled * (half - exact)).to(torch.long)).clamp(max=half - 1)
    bucket = bucket + torch.where(n < exact, n, large)
    return table[bucket].permute(2, 0, 1)


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

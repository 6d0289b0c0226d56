"""What every pooling model gives the pooling engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from fastllm.tokenizer import Tokenizer


@dataclass
class PoolerConfig:
    """How a model turns its last hidden states into one vector, and what it
    does after: read from the folder's sentence-transformers files
    (``modules.json``, ``1_Pooling/config.json``, a ``Normalize`` module) or
    the architecture's default."""

    #: "CLS", "MEAN" or "LAST"
    pooling_type: str
    #: whether embeddings are L2-normalised by default (a Normalize module)
    normalize: bool
    #: the embedding's size (the hidden size, or a Dense module's output)
    dimensions: int
    #: Matryoshka sizes the model declares (``matryoshka_dimensions`` in
    #: config.json or config_sentence_transformers.json); empty: none
    matryoshka_dimensions: list[int] = field(default_factory=list)
    #: text put before each query / document (config_sentence_transformers.json
    #: ``prompts``), by name; the engine adds none unless asked
    prompts: dict[str, str] = field(default_factory=dict)


class PoolingRunner(Protocol):
    """A loaded pooling model."""

    tokenizer: Tokenizer
    max_model_len: int
    pooler: PoolerConfig
    #: labels of the classification head (None: no head; a cross-encoder has 1)
    num_labels: int | None

    def tokenize(self, text: str, pair: str | None = None) -> tuple[list[int], list[int] | None]:
        """Token ids (with the model's special tokens) and token type ids (None
        when the model has none) of a text, or of a text pair as a
        cross-encoder reads it."""

    def pool(self, batch: list[tuple[list[int], list[int] | None]]) -> list[torch.Tensor]:
        """Each input's pooled vector (float32, CPU, not normalised) per
        ``pooler``: the inputs run together, padding-free."""

    def classify(self, batch: list[tuple[list[int], list[int] | None]]) -> list[torch.Tensor]:
        """Each input's classifier logits (float32, CPU, ``num_labels`` values,
        no activation); a ValueError when the model has no head."""

"""``PoolingEngine``: embeddings, scores and classes of a pooling model, what
``LLM.embed`` / ``score`` / ``classify`` and the server's pooling routes call.

It loads the model's ``PoolingRunner`` (an encoder, or a decoder embedder
through the paged engine), checks every input (a ValueError naming it),
runs the inputs in batches of a token budget, and shapes the results per
``PoolingParams``: Matryoshka truncation, then L2 normalisation; a
classifier's activation (sigmoid for one label, softmax for several).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fastllm.config import EngineConfig
from fastllm.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from fastllm.pooling.params import PoolingParams
from fastllm.pooling.runner import PoolingRunner

Tokens = tuple[list[int], list[int] | None]
#: Tokens one runner call takes at most (inputs are never split).
BATCH_TOKENS = 8192


def is_pooling_folder(config: EngineConfig) -> bool:
    """Whether the model ``config`` names is an encoder or a decoder with a
    classification head (a pooling model even with ``runner="auto"``)."""
    from fastllm.pooling.decoder import classifier_base
    from fastllm.pooling.encoder import is_encoder_architecture

    hf = _folder_config(config)[1]
    archs = list(hf.get("architectures") or [])
    return is_encoder_architecture(archs, hf) or classifier_base(archs) is not None


def _folder_config(config: EngineConfig) -> tuple[str, dict[str, Any]]:
    """The model's folder (a GGUF file's path as it is) and its config.json
    (a GGUF encoder's as its metadata gives it; {} when there is none to
    read: the loaders report what is wrong)."""
    from fastllm.loading import is_gguf_file, resolve_model_folder

    if is_gguf_file(config.model):
        return config.model, _gguf_encoder_config(config.model)
    folder = resolve_model_folder(config.model, config.revision, config.download_dir)
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return folder, {}
    if not isinstance(hf, dict):
        return folder, {}
    return folder, {**hf, **(config.hf_overrides or {})}


def _gguf_encoder_config(path: str) -> dict[str, Any]:
    """The config.json of the encoder in GGUF file ``path`` ({} for a decoder,
    or a file that cannot be opened: the loaders report what is wrong)."""
    from fastllm.loading import gguf_encoder_config

    try:
        return gguf_encoder_config(path) or {}
    except OSError:
        return {}


class PoolingEngine:
    """A loaded pooling model and the pooling API over it."""

    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        from fastllm.pooling.encoder import is_encoder_architecture, load_encoder

        #: the model's folder, and its config.json
        self.folder, hf = _folder_config(config)
        if is_encoder_architecture(list(hf.get("architectures") or []), hf):
            self.runner: PoolingRunner = load_encoder(config)
        else:
            from fastllm.pooling.decoder import DecoderRunner

            self.runner = DecoderRunner(config, hf)
        self.config = config
        labels = hf.get("id2label")
        #: a classifier's label names by class index (None: not named)
        self.id2label: dict[int, str] | None = (
            {int(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else None
        )
        self.tokenizer = self.runner.tokenizer
        self.max_model_len = self.runner.max_model_len
        self.pooler = self.runner.pooler
        heads = self.runner.num_labels
        #: what this model can do: embed (no classifier), or classify; both score
        self.tasks = frozenset({"classify", "score"} if heads else {"embed", "score"})
        self._ids = itertools.count()

    # ---- the API ----------------------------------------------------------------

    def embed(
        self,
        prompts: Sequence[str | list[int]],
        params: PoolingParams | Sequence[PoolingParams] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (a text or token ids), in order."""
        self._require("embed")
        inputs = [self._input(p, f"input[{i}]") for i, p in enumerate(prompts)]
        plist = self._params(params, len(inputs))
        for i, p in enumerate(plist):
            self._check_dimensions(p, f"input[{i}]")
        inputs = [self._fit(t, p, f"input[{i}]") for i, (t, p) in enumerate(zip(inputs, plist))]
        vectors = self._run(self.runner.pool, inputs, progress)
        return [
            EmbeddingRequestOutput(
                self._next_id("embd"), ids, EmbeddingOutput(self._shape(v, p).tolist())
            )
            for (ids, _), v, p in zip(inputs, vectors, plist)
        ]

    def classify(
        self,
        prompts: Sequence[str | list[int]],
        params: PoolingParams | Sequence[PoolingParams] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (logits with ``activation=False``)."""
        self._require("classify")
        inputs = [self._input(p, f"input[{i}]") for i, p in enumerate(prompts)]
        plist = self._params(params, len(inputs))
        inputs = [self._fit(t, p, f"input[{i}]") for i, (t, p) in enumerate(zip(inputs, plist))]
        logits = self._run(self.runner.classify, inputs, progress)
        return [
            ClassificationRequestOutput(
                self._next_id("classify"), ids, ClassificationOutput(_activate(x, p).tolist())
            )
            for (ids, _), x, p in zip(inputs, logits, plist)
        ]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        params: PoolingParams | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[ScoringRequestOutput]:
        """One score per pair: ``data_1`` and ``data_2`` of equal length, or
        one query against every document (vLLM's 1:N). A cross-encoder reads
        each pair together; an embedding model compares the two embeddings
        (cosine similarity)."""
        self._require("score")
        left = [data_1] if isinstance(data_1, str) else list(data_1)
        right = [data_2] if isinstance(data_2, str) else list(data_2)
        if not left or not right:
            raise ValueError("score: text_1 and text_2 must not be empty")
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right):
            raise ValueError(
                f"score: text_1 has {len(left)} texts and text_2 {len(right)}; give one "
                "query, or as many queries as documents"
            )
        p = params or PoolingParams()
        if "classify" in self.tasks:
            pairs = [
                self._fit(self._pair(a, b, f"pair[{i}]"), p, f"pair[{i}]")
                for i, (a, b) in enumerate(zip(left, right))
            ]
            logits = self._run(self.runner.classify, pairs, progress)
            scores = [float(_activate(x, p)[0]) for x in logits]
            ids = [t for t, _ in pairs]
        else:
            # each distinct text embedded once (one query against many documents)
            texts = list(dict.fromkeys([*left, *right]))
            done = dict(zip(texts, self.embed(texts, p, progress)))
            a, b = [done[t] for t in left], [done[t] for t in right]
            scores = [
                float(
                    torch.nn.functional.cosine_similarity(
                        torch.tensor(x.outputs.embedding), torch.tensor(y.outputs.embedding), dim=0
                    )
                )
                for x, y in zip(a, b)
            ]
            ids = [x.prompt_token_ids + y.prompt_token_ids for x, y in zip(a, b)]
        return [
            ScoringRequestOutput(self._next_id("score"), t, ScoringOutput(s))
            for t, s in zip(ids, scores)
        ]

    # ---- helpers ----------------------------------------------------------------

    def _require(self, task: str) -> None:
        if task not in self.tasks:
            what = (
                "a classifier (cross-encoder)" if "classify" in self.tasks else "an embedding model"
            )
            raise ValueError(
                f"{task}: this model is {what}; it supports {', '.join(sorted(self.tasks))}"
            )

    def _next_id(self, kind: str) -> str:
        return f"{kind}-{next(self._ids)}"

    def _input(self, prompt: Any, where: str) -> Tokens:
        """A prompt (a text, token ids, or vLLM's prompt dicts) as runner input."""
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{where} is an empty string")
            return self.runner.tokenize(prompt)
        if isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            if not prompt:
                raise ValueError(f"{where} has no tokens")
            return list(prompt), None
        raise ValueError(
            f"{where} must be a string or a list of token ids, got {type(prompt).__name__}"
        )

    def _pair(self, a: Any, b: Any, where: str) -> Tokens:
        if not isinstance(a, str) or not isinstance(b, str) or not a or not b:
            raise ValueError(f"{where}: both texts must be non-empty strings")
        return self.runner.tokenize(a, b)

    def _fit(self, tokens: Tokens, params: PoolingParams, where: str) -> Tokens:
        """The input cut to ``truncate_prompt_tokens`` (its last tokens, vLLM's
        rule), then checked against ``max_model_len``."""
        ids, types = tokens
        k = params.truncate_prompt_tokens
        if k is not None and len(ids) > k:
            ids, types = ids[-k:], (types[-k:] if types is not None else None)
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"{where} has {len(ids)} tokens, more than max_model_len={self.max_model_len}; "
                "shorten it or set truncate_prompt_tokens"
            )
        return ids, types

    def _params(
        self, params: PoolingParams | Sequence[PoolingParams] | None, n: int
    ) -> list[PoolingParams]:
        if params is None or isinstance(params, PoolingParams):
            return [params or PoolingParams()] * n
        plist = list(params)
        if len(plist) != n:
            raise ValueError(f"pooling_params: {len(plist)} given for {n} inputs")
        return plist

    def _check_dimensions(self, p: PoolingParams, where: str) -> None:
        d = p.dimensions
        if d is None:
            return
        declared = self.pooler.matryoshka_dimensions
        if not declared:
            raise ValueError(
                f"{where}: dimensions={d}: this model does not declare Matryoshka "
                "dimensions, so its embeddings cannot be shortened"
            )
        if d not in declared and d != self.pooler.dimensions:
            raise ValueError(
                f"{where}: dimensions={d} is not one of the model's Matryoshka sizes "
                f"{declared} (its embeddings have {self.pooler.dimensions})"
            )

    def _shape(self, v: torch.Tensor, p: PoolingParams) -> torch.Tensor:
        if p.dimensions is not None:
            v = v[: p.dimensions]
        normalize = self.pooler.normalize if p.normalize is None else p.normalize
        if normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        return v

    def _run(
        self,
        fn: Callable[[list[Tokens]], list[torch.Tensor]],
        inputs: list[Tokens],
        progress: Callable[[int], None] | None,
    ) -> list[torch.Tensor]:
        """``fn`` over the inputs in batches of at most BATCH_TOKENS tokens
        (longest first, so a batch holds inputs of like length), in input order."""
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i][0]))
        out: list[torch.Tensor | None] = [None] * len(inputs)
        batch: list[int] = []
        used = 0

        def flush() -> None:
            nonlocal batch, used
            if batch:
                for i, v in zip(batch, fn([inputs[i] for i in batch])):
                    out[i] = v
                if progress is not None:
                    progress(len(batch))
            batch, used = [], 0

        for i in order:
            n = len(inputs[i][0])
            if batch and used + n > BATCH_TOKENS:
                flush()
            batch.append(i)
            used += n
        flush()
        return [v for v in out if v is not None]


def _activate(logits: torch.Tensor, p: PoolingParams) -> torch.Tensor:
    """A classifier's output: sigmoid for one label, softmax for several
    (raw logits with ``activation=False``)."""
    if p.activation is False:
        return logits
    return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=-1)

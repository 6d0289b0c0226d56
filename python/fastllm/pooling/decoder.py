"""Decoder models as embedders (Qwen3-Embedding and its kin) and as
classifiers: the prompt runs as a prefill through the paged engine (chunked
prefill, batching and the fused CPU decoder stack included), and the model
runner hands each pooling sequence its final hidden states as they are
computed; the request then ends without generating.

A classifier is a decoder with a head on its last token's final hidden
state: a ``...ForSequenceClassification`` checkpoint (its ``score`` matrix:
rerankers and reward models converted to sequence classification), or a
causal LM whose head rows of some tokens are the classes, named by
``hf_overrides`` as vLLM names them: ``classifier_from_token`` (the tokens),
and for two tokens with ``method="from_2_way_softmax"`` or
``is_original_qwen3_reranker`` one label, the second token's row minus the
first's, so that its sigmoid is the softmax of the two logits
(Qwen3-Reranker's "yes" against "no")."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fastllm.config import EngineConfig
from fastllm.pooling.runner import PoolerConfig
from fastllm.pooling.st_config import read_st_pooling
from fastllm.sampling_params import RequestOutputKind, SamplingParams


class PoolState:
    """One sequence's pooled hidden state, filled in chunk by chunk."""

    def __init__(self, pooling_type: str) -> None:
        self.pooling_type = pooling_type
        #: whether every prompt position must be computed (none from the prefix cache)
        self.needs_every_position = pooling_type != "LAST"
        self.total: torch.Tensor | None = None
        self.result: torch.Tensor | None = None

    def add(self, rows: torch.Tensor, start: int, num_prompt_tokens: int) -> None:
        """The final hidden states of prompt positions ``[start, start + len(rows))``."""
        n = rows.shape[0]
        if n == 0:
            return
        last = start + n >= num_prompt_tokens
        if self.pooling_type == "MEAN":
            if start == 0:
                self.total = None  # a prefill recomputed from the start (preemption)
            part = rows.float().sum(0)
            self.total = part if self.total is None else self.total + part
            if last:
                self.result = (self.total / num_prompt_tokens).cpu()
        elif self.pooling_type == "CLS":
            if start == 0:
                self.result = rows[0].float().cpu()
        elif last:
            self.result = rows[-1].float().cpu()


def classifier_base(architectures: list[str]) -> str | None:
    """The causal LM a ``...ForSequenceClassification`` architecture runs as
    (None: not a decoder classifier fastllm has)."""
    from fastllm.models import ARCHITECTURES

    if not architectures or not isinstance(architectures[0], str):
        return None
    arch = architectures[0]
    if not arch.endswith("ForSequenceClassification"):
        return None
    family = arch.removesuffix("ForSequenceClassification")
    # transformers names some text-only classes with "Text"
    # (Gemma3TextForSequenceClassification): their LM is the family's
    for causal in (family + "ForCausalLM", family.removesuffix("Text") + "ForCausalLM"):
        if causal in ARCHITECTURES:
            return causal
    return None


class DecoderRunner:
    """A decoder model's pooling (``PoolingRunner``): last-token pooling by
    default, or what its sentence-transformers files say; or, for a
    classifier (``classifier_base``), its head on the last token."""

    def __init__(self, config: EngineConfig, hf: dict[str, Any] | None = None) -> None:
        """``hf``: the model's config.json with ``config.hf_overrides`` merged
        (``PoolingEngine`` reads it; {} for a GGUF file)."""
        from fastllm.engine.llm_engine import LLMEngine

        hf = hf or {}
        base = classifier_base(list(hf.get("architectures") or []))
        tokens = hf.get("classifier_from_token")
        overrides = dict(config.hf_overrides or {})
        if tokens is not None and base is None:
            raise ValueError(
                "hf_overrides: classifier_from_token needs 'architectures' naming a "
                "...ForSequenceClassification of a decoder family fastllm runs, got "
                f"{hf.get('architectures')!r}"
            )
        if base is not None:
            # The engine runs the causal LM; a sequence-classification checkpoint
            # stores no LM head (the head it runs is the embedding: unused).
            overrides["architectures"] = [base]
            if tokens is None:
                overrides["tie_word_embeddings"] = True
        # One more position than asked: the pooling request's one (discarded)
        # sampled token must fit after a prompt of max_model_len tokens.
        engine_config = dataclasses.replace(
            config,
            runner="generate",
            task="generate",
            max_model_len=None if config.max_model_len is None else config.max_model_len + 1,
            reasoning_parser=None,
            hf_overrides=overrides or None,
        )
        self.engine = engine = LLMEngine(engine_config)
        #: None with skip_tokenizer_init: inputs are then token ids only
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len - 1
        mc = engine.model_config
        self.pooler: PoolerConfig
        self.pooler, dense = read_st_pooling(engine.folder, mc.hidden_size, "LAST", mc.hf)
        if dense:
            raise ValueError(
                f"{engine.folder}: sentence-transformers Dense modules after a decoder are not "
                "supported (fastllm applies them to encoders only)"
            )
        self.folder = engine.folder
        #: the classification head (weight [labels, hidden], bias), or None
        self.head: tuple[torch.Tensor, torch.Tensor | None] | None = None
        if base is not None:
            self.head = self._classifier_head(hf, tokens, mc.hidden_size)
        #: labels of the classification head (None: an embedder)
        self.num_labels = None if self.head is None else self.head[0].shape[0]

    def _classifier_head(
        self, hf: dict[str, Any], tokens: Any, hidden: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head's (weight, bias) in float32: the checkpoint's ``score``
        layer, or the LM head's rows of the ``classifier_from_token`` tokens."""
        from fastllm.loading import is_gguf_file
        from fastllm.models.loader import Checkpoint

        if is_gguf_file(self.folder):
            raise ValueError(
                f"{self.folder}: classification heads are read from model folders, not GGUF files"
            )
        with Checkpoint(self.folder) as ckpt:
            names = set(ckpt.location)
            if tokens is None:
                if "score.weight" not in names:
                    raise ValueError(
                        f"{self.folder}: {hf['architectures'][0]} needs its classification "
                        "head, tensor 'score.weight', which the checkpoint does not have"
                    )
                weight = ckpt.read("score.weight").float().clone()
                bias = ckpt.read("score.bias").float().clone() if "score.bias" in names else None
            else:
                weight, bias = self._token_rows(ckpt, names, hf, tokens), None
        if weight.ndim != 2 or weight.shape[1] != hidden:
            raise ValueError(
                f"{self.folder}: the classification head has shape {list(weight.shape)}, "
                f"expected [labels, {hidden}]"
            )
        return weight, bias

    def _token_rows(self, ckpt: Any, names: set[str], hf: dict[str, Any], tokens: Any) -> Any:
        """The LM head's rows of ``tokens`` (one label each), or for two tokens
        read as a 2-way softmax, one row: the second's minus the first's."""
        if (
            not isinstance(tokens, list)
            or not tokens
            or not all(isinstance(t, str) for t in tokens)
        ):
            raise ValueError(
                f"hf_overrides: classifier_from_token must be a list of token strings, got "
                f"{tokens!r}"
            )
        ids = []
        vocabulary = self.engine.require_tokenizer()
        for t in tokens:
            i = vocabulary.token_to_id(t)
            if i is None:
                raise ValueError(
                    f"hf_overrides: classifier_from_token {t!r} is not a token of the vocabulary"
                )
            ids.append(i)
        head = "lm_head.weight"
        if head not in names:
            head = next((n for n in sorted(names) if n.endswith("embed_tokens.weight")), "")
        if not head:
            raise ValueError(f"{self.folder}: no LM head or token embedding tensor to classify by")
        rows = ckpt.read(head)[ids].float().clone()
        two_way = hf.get("method") == "from_2_way_softmax" or hf.get("is_original_qwen3_reranker")
        if two_way:
            if len(ids) != 2:
                raise ValueError(
                    "hf_overrides: a 2-way softmax classifier needs two classifier_from_token "
                    f"tokens, got {len(ids)}"
                )
            return (rows[1] - rows[0])[None]
        return rows

    def tokenize(self, text: str, pair: str | None = None) -> tuple[list[int], list[int] | None]:
        """The text's ids (the tokenizer's special tokens, e.g. a closing EOS,
        included); a pair as the tokenizer joins two texts (its template, or
        the two texts' ids one after the other), as transformers does."""
        tokenizer = self.engine.require_tokenizer()
        if pair is not None:
            return tokenizer.encode_with_types(text, pair)[0], None
        return tokenizer.encode(text), None

    def pool(self, batch: list[tuple[list[int], list[int] | None]]) -> list[torch.Tensor]:
        """Each input's pooled final hidden state (float32, CPU)."""
        return self._pooled(batch, self.pooler.pooling_type)

    def _pooled(
        self, batch: list[tuple[list[int], list[int] | None]], pooling_type: str
    ) -> list[torch.Tensor]:
        engine = self.engine
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        states = []
        try:
            for ids, _ in batch:
                req = engine.add_request(None, ids, params)
                state = PoolState(pooling_type)
                req.seqs[0].pooling = state
                states.append(state)
            while engine.has_unfinished_requests():
                engine.step()
        finally:
            if engine.has_unfinished_requests():
                engine.abort_all()  # an error or an interrupt: the engine is idle again
        out = []
        for s in states:
            assert s.result is not None
            out.append(s.result)
        return out

    def classify(self, batch: list[tuple[list[int], list[int] | None]]) -> list[torch.Tensor]:
        """Each input's logits: the head on its last token's final hidden state."""
        if self.head is None:
            raise ValueError("this model has no classification head (it embeds)")
        weight, bias = self.head
        hidden = torch.stack(self._pooled(batch, "LAST"))
        logits = hidden @ weight.T
        if bias is not None:
            logits = logits + bias
        return list(logits.unbind(0))

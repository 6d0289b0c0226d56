"""Decoder models as embedders (Qwen3-Embedding and its kin): the prompt runs
as a prefill through the paged engine (chunked prefill, batching and the
fused CPU decoder stack included), and the model runner hands each pooling
sequence its final hidden states as they are computed; the request then ends
without generating."""

from __future__ import annotations

import dataclasses

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


class DecoderRunner:
    """A decoder model's pooling (``PoolingRunner``): last-token pooling by
    default, or what its sentence-transformers files say."""

    num_labels = None

    def __init__(self, config: EngineConfig) -> None:
        from fastllm.engine.llm_engine import LLMEngine

        # One more position than asked: the pooling request's one (discarded)
        # sampled token must fit after a prompt of max_model_len tokens.
        engine_config = dataclasses.replace(
            config,
            runner="generate",
            task="generate",
            max_model_len=None if config.max_model_len is None else config.max_model_len + 1,
            reasoning_parser=None,
        )
        self.engine = engine = LLMEngine(engine_config)
        self.tokenizer = engine.require_tokenizer()
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

    def tokenize(self, text: str, pair: str | None = None) -> tuple[list[int], list[int] | None]:
        """The text's ids (the tokenizer's special tokens, e.g. a closing EOS,
        included); a pair is joined as query then document."""
        if pair is not None:
            text = text + pair
        return self.tokenizer.encode(text), None

    def pool(self, batch: list[tuple[list[int], list[int] | None]]) -> list[torch.Tensor]:
        """Each input's pooled final hidden state (float32, CPU)."""
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
                state = PoolState(self.pooler.pooling_type)
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
        """Decoder embedders have no classification head."""
        raise ValueError("this model has no classification head (it embeds)")

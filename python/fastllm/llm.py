"""LLM: offline generation with vLLM's API (generate, chat, stream)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from fastllm.config import EngineConfig
from fastllm.engine.llm_engine import LLMEngine
from fastllm.inputs import (  # noqa: F401 - TextPrompt, TokensPrompt: vLLM's names, exported here
    PromptType,
    TextPrompt,
    TokensPrompt,
    chat_prompt,
    chat_stop,
    parse_prompts,
    truncate,
)
from fastllm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from fastllm.pooling.engine import PoolingEngine, is_pooling_folder
from fastllm.pooling.params import PoolingParams
from fastllm.reasoning import ReasoningStream
from fastllm.sampling_params import RequestOutputKind, SamplingParams
from fastllm.tokenizer import HFCompatibleTokenizer, Tokenizer


class LLM:
    """A model loaded from a local Hugging Face folder, ready to generate.

    Without ``model`` it loads the small demo model that ships in the package.

    Example::

        llm = LLM("path/to/model")
        outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    """

    def __init__(
        self,
        model: str | None = None,
        tokenizer: str | None = None,
        dtype: Any = "auto",
        device: str = "auto",
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        seed: int = 0,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        kv_cache_dtype: str = "auto",
        gpu_memory_utilization: float = 0.9,
        load_format: str = "auto",
        max_logprobs: int = 20,
        revision: str | None = None,
        tokenizer_revision: str | None = None,
        download_dir: str | None = None,
        quantization: str | None = None,
        task: str = "generate",
        tokenizer_mode: str = "auto",
        trust_remote_code: bool = False,
        enforce_eager: bool = False,
        skip_tokenizer_init: bool = False,
        reasoning_parser: str | None = None,
        runner: str = "auto",
        state_snapshot_interval: int = 256,
        max_state_snapshots: int = 32,
        hf_overrides: dict[str, Any] | None = None,
    ) -> None:
        if model is None:
            from fastllm.demo import demo_model_path

            model = demo_model_path()
        self.config = EngineConfig(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            device=device,
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len,
            seed=seed,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            kv_cache_dtype=kv_cache_dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            load_format=load_format,
            max_logprobs=max_logprobs,
            revision=revision,
            tokenizer_revision=tokenizer_revision,
            download_dir=download_dir,
            quantization=quantization,
            task=task,
            tokenizer_mode=tokenizer_mode,
            trust_remote_code=trust_remote_code,
            enforce_eager=enforce_eager,
            skip_tokenizer_init=skip_tokenizer_init,
            reasoning_parser=reasoning_parser,
            runner=runner,
            state_snapshot_interval=state_snapshot_interval,
            max_state_snapshots=max_state_snapshots,
            hf_overrides=hf_overrides,
        )
        self.config.validate()
        #: the pooling model (runner="pooling", or an encoder folder), else None
        self.pooling_engine: PoolingEngine | None = None
        if self.config.pooling or (runner == "auto" and is_pooling_folder(self.config)):
            self.pooling_engine = PoolingEngine(self.config)
            self.llm_engine: LLMEngine = _NoGeneration()  # type: ignore[assignment]
        else:
            self.llm_engine = LLMEngine(self.config)

    def get_tokenizer(self) -> HFCompatibleTokenizer:
        """The model's tokenizer, callable like a Hugging Face tokenizer
        (``__call__``, ``encode``, ``decode``, ``apply_chat_template``, ...)."""
        return HFCompatibleTokenizer(self._tokenizer())

    def _tokenizer(self) -> Tokenizer:
        if self.pooling_engine is not None:
            return self.pooling_engine.tokenizer
        return self.llm_engine.require_tokenizer()

    # ---- pooling ----------------------------------------------------------

    def _pooling(self, what: str) -> PoolingEngine:
        if self.pooling_engine is None:
            raise ValueError(
                f"LLM.{what} needs a pooling model: this LLM generates text; load an "
                "embedding or cross-encoder model with LLM(model, runner='pooling')"
            )
        return self.pooling_engine

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``outputs.embedding``), in input order."""
        engine = self._pooling("embed")
        items = _pooling_prompts(prompts)
        params = _with_truncation(pooling_params, truncate_prompt_tokens)
        with _PoolingProgress(len(items), use_tqdm) as bar:
            return engine.embed(items, params, bar.update)

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (``outputs.probs``), in input order."""
        engine = self._pooling("classify")
        items = _pooling_prompts(prompts)
        params = _with_truncation(pooling_params, truncate_prompt_tokens)
        with _PoolingProgress(len(items), use_tqdm) as bar:
            return engine.classify(items, params, bar.update)

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """One score per (``data_1``, ``data_2``) pair, or of one query against
        each document (``outputs.score``): a cross-encoder's relevance, or the
        cosine similarity of an embedding model's vectors."""
        engine = self._pooling("score")
        params = _with_truncation(pooling_params, truncate_prompt_tokens)
        n = 1 if isinstance(data_2, str) else len(data_2)
        with _PoolingProgress(n, use_tqdm) as bar:
            return engine.score(data_1, data_2, params, bar.update)

    def __repr__(self) -> str:
        from fastllm.loading import describe_weights

        if self.pooling_engine is not None:
            p = self.pooling_engine
            return (
                f"LLM(model={self.config.model!r}, runner='pooling', "
                f"tasks={sorted(p.tasks)}, max_model_len={p.max_model_len})"
            )
        e = self.llm_engine
        quant = describe_weights(e.loaded)
        return (
            f"LLM(model={self.config.model!r}, device={e.device!r}, "
            f"dtype={str(e.dtype).removeprefix('torch.')}, "
            f"{quant}, max_model_len={e.max_model_len})"
        )

    # ---- generate -------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates completions for every prompt; outputs come back in input order."""
        items = self._normalize_prompts(prompts)
        params = self._normalize_params(sampling_params, len(items))
        return self._run(items, params, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generates the assistant's reply to one conversation or a list of them.

        vLLM's keywords: ``tools`` and ``documents`` reach the template as
        those variables, ``chat_template_kwargs`` as extra variables (Qwen3's
        ``{"enable_thinking": False}``), and ``continue_final_message`` ends
        the prompt inside the last message so the reply continues it. With a
        ``reasoning_parser``, each output's ``reasoning_content`` and
        ``content`` hold the thinking and the answer apart."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self._tokenizer()
        options = {
            "chat_template_kwargs": chat_template_kwargs,
            "continue_final_message": continue_final_message,
            "documents": documents,
        }
        items = []
        for i, conv in enumerate(convs):
            if not isinstance(conv, list):
                raise ValueError(f"messages[{i}] must be a list of message dicts")
            items.append(
                chat_prompt(tok, conv, chat_template, add_generation_prompt, tools, **options)
            )
        params = [
            chat_stop(p, tok, chat_template)
            for p in self._normalize_params(sampling_params, len(items))
        ]
        return self._run(items, params, use_tqdm)

    def stream(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yields incremental outputs of one prompt: the new text and tokens since
        the last one (``RequestOutputKind.DELTA``); joined, they are what
        ``generate`` returns for the same prompt and parameters."""
        (item,) = self._normalize_prompts([prompt])
        (params,) = self._normalize_params(sampling_params, 1)
        engine = self.llm_engine
        self._check_idle()
        item = (item[0], truncate(item[1], params))
        engine.validate_request(item[1], params, "prompt 0")
        parser = engine.reasoning
        splits: dict[int, ReasoningStream] = {}
        with self._owned_requests() as ids:
            rid = self._add(ids, item, params.clone(output_kind=RequestOutputKind.DELTA))
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id != rid:
                        continue
                    if parser is not None:
                        for c in out.outputs:
                            s = splits.get(c.index)
                            if s is None:
                                s = splits[c.index] = parser.stream(self._prompt_text(out))
                            r, t = s.add(c.text)
                            if c.finish_reason is not None:
                                r2, t2 = s.finish()
                                r, t = r + r2, t + t2
                            c.reasoning_content, c.content = r, t
                    yield out

    # ---- helpers --------------------------------------------------------

    def _check_idle(self) -> None:
        if self.llm_engine.has_unfinished_requests():
            raise RuntimeError("another generation is still running on this LLM")

    @contextmanager
    def _owned_requests(self) -> Iterator[list[str]]:
        """The ids of the requests one call adds. However the call ends (an
        error, Ctrl-C at any moment, a stream closed early), every one of them
        still in the engine is aborted, so the LLM is idle again and its KV
        blocks are back in the pool. An id is listed before its request is
        added, so an interrupt inside ``add_request`` is covered too."""
        ids: list[str] = []
        try:
            yield ids
        finally:
            engine = self.llm_engine
            try:
                # After a call that ran to its end nothing is left to abort.
                if engine.requests or engine.has_unfinished_requests():
                    for rid in ids:
                        engine.abort_request(rid)
                else:
                    engine.reclaim_blocks()
            except Exception:  # noqa: BLE001 - whatever ended the call propagates
                # An interrupt can leave block accounting half-done; the
                # engine belongs to this call alone, so it is reset whole.
                engine.abort_all()

    def _add(
        self, ids: list[str], item: tuple[str | None, list[int]], params: SamplingParams
    ) -> str:
        """Adds one request under a fresh id, listed in ``ids`` first."""
        engine = self.llm_engine
        rid = engine.next_request_id()
        ids.append(rid)
        engine.add_request(item[0], item[1], params, request_id=rid)
        return rid

    def _normalize_prompts(self, prompts: Any) -> list[tuple[str | None, list[int]]]:
        return parse_prompts(prompts, lambda text: self._tokenizer().encode(text))

    @staticmethod
    def _normalize_params(sp: Any, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(
                f"sampling_params has {len(sp)} entries for {n} prompts; pass one or one per prompt"
            )
        for i, p in enumerate(sp):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params[{i}] must be a SamplingParams")
        return sp

    def _run(
        self,
        items: list[tuple[str | None, list[int]]],
        params: list[SamplingParams],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        self._check_idle()
        items = [(text, truncate(ids, p)) for (text, ids), p in zip(items, params)]
        for i, ((_, ids), p) in enumerate(zip(items, params)):
            engine.validate_request(ids, p, f"prompt {i}")
        results: list[RequestOutput | None] = [None] * len(items)
        progress = _Progress(engine, len(items)) if use_tqdm and items else None
        try:
            with self._owned_requests() as ids:
                for item, p in zip(items, params):
                    self._add(ids, item, p.clone(output_kind=RequestOutputKind.FINAL_ONLY))
                order = {rid: i for i, rid in enumerate(ids)}
                while engine.has_unfinished_requests():
                    finished = 0
                    for out in engine.step():
                        if out.finished:
                            results[order[out.request_id]] = out
                            finished += 1
                    if progress is not None:
                        progress.update(finished)
        finally:
            if progress is not None:
                progress.close()
        outs = [r for r in results if r is not None]
        parser = engine.reasoning
        if parser is not None:
            for out in outs:
                prompt = self._prompt_text(out)
                for c in out.outputs:
                    c.reasoning_content, c.content = parser.split(c.text, prompt)
        return outs

    def _prompt_text(self, out: RequestOutput) -> str | None:
        """A request's prompt as text (token prompts decoded), for the reasoning split."""
        if out.prompt is not None:
            return out.prompt
        tok = self.llm_engine.tokenizer
        if tok is None:
            return None
        return tok.decode(out.prompt_token_ids, skip_special_tokens=False)


def _pooling_prompts(prompts: Any) -> list[Any]:
    """One prompt or a list of them (texts, token-id lists, prompt dicts)."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    return list(prompts)


def _with_truncation(
    params: PoolingParams | Sequence[PoolingParams] | None, truncate: int | None
) -> Any:
    """``params`` with vLLM's ``truncate_prompt_tokens`` keyword folded in."""
    if truncate is None:
        return params
    if params is None or isinstance(params, PoolingParams):
        return dataclasses.replace(params or PoolingParams(), truncate_prompt_tokens=truncate)
    return [dataclasses.replace(p, truncate_prompt_tokens=truncate) for p in params]


class _NoGeneration:
    """``LLM.llm_engine`` of a pooling LLM: every generation call is a clear error."""

    def __getattr__(self, name: str) -> Any:
        raise ValueError(
            "this LLM holds a pooling model (runner='pooling'): it embeds, scores or "
            "classifies (LLM.embed, LLM.score, LLM.classify) and does not generate text"
        )


class _PoolingProgress:
    """A pooling call's progress bar (inputs done), or nothing without tqdm."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled and total:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="Processed inputs", unit="input", dynamic_ncols=True)

    def __enter__(self) -> _PoolingProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.close()

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)


class _Progress:
    """generate()'s progress bar: finished requests, and input and output tokens/s
    updated every step (so a long prefill is seen moving)."""

    def __init__(self, engine: LLMEngine, total: int) -> None:
        from tqdm.auto import tqdm

        self.engine = engine
        self.bar = tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
        self.start = time.perf_counter()
        self.prompt0 = engine.stats["prompt_tokens"]
        self.output0 = engine.stats["generation_tokens"]

    def update(self, finished: int) -> None:
        """Called after every step with the number of requests it finished."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        inp = (self.engine.stats["prompt_tokens"] - self.prompt0) / elapsed
        out = (self.engine.stats["generation_tokens"] - self.output0) / elapsed
        self.bar.set_postfix_str(
            f"est. speed input: {inp:.1f} toks/s, output: {out:.1f} toks/s", refresh=False
        )
        if finished:
            self.bar.update(finished)
        else:
            self.bar.refresh()

    def close(self) -> None:
        """Closes the bar."""
        self.bar.close()

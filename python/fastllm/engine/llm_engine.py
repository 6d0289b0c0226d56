"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out."""

from __future__ import annotations

import itertools
import logging
import random
import time
from typing import TYPE_CHECKING

from fastllm.config import EngineConfig, ModelConfig
from fastllm.engine.output_processor import OutputProcessor
from fastllm.engine.request import Request
from fastllm.engine.thinking import THINK, ThinkingState, ThinkingTags
from fastllm.logs import configure_logging
from fastllm.outputs import RequestOutput
from fastllm.reasoning import reasoning_parser
from fastllm.sampling_params import SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from fastllm.loading import LoadedModel
    from fastllm.tokenizer import Tokenizer

logger = logging.getLogger("fastllm")


class RequestError(ValueError):
    """A request the engine cannot run; ``field`` names what to change."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class LLMEngine:
    """Owns the tokenizer, model runner and scheduler; advances requests step by step."""

    def __init__(self, config: EngineConfig) -> None:
        configure_logging()
        config.validate()
        from fastllm.engine.kv_cache_manager import KVCacheManager
        from fastllm.engine.scheduler import Scheduler
        from fastllm.engine.structured import StructuredOutputs
        from fastllm.loading import load
        from fastllm.platform import resolve_device

        self.config = config
        #: The model as ``loading.load`` made it: source, config, tokenizer, weights.
        self.loaded = loaded = load(
            config, resolve_device(config.device, config.tensor_parallel_size)
        )
        self.folder = loaded.path
        self.model_config = mc = loaded.model_config
        self.tokenizer = loaded.tokenizer
        self.device, self.dtype = loaded.device, loaded.dtype
        self.quantization = loaded.quantization
        self._set_limits(config, mc)
        eos = set(mc.eos_token_ids)
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self._build_runner(config, loaded)
        self.kv = KVCacheManager(
            self.cache.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            self.runner.layout.windows,
            self.states,
        )
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, self.max_num_batched_tokens, self.max_model_len, eos
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.structured = StructuredOutputs(self.tokenizer, eos, mc.vocab_size)
        #: how replies mark their thinking (EngineConfig.reasoning_parser), and its
        #: tags as token ids (encoded on first use)
        self.reasoning = reasoning_parser(config.reasoning_parser)
        self._thinking_tags: ThinkingTags | None = None
        self._request_ids = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}

    def _set_limits(self, config: EngineConfig, mc: ModelConfig) -> None:
        """The context and batch limits, checked against the model's."""
        limit = mc.max_position_embeddings
        if config.max_model_len is not None and limit and config.max_model_len > limit:
            raise ValueError(
                f"max_model_len ({config.max_model_len}) is larger than the model's "
                f"max_position_embeddings ({limit})"
            )
        self.max_model_len = config.max_model_len or limit or 2048
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(
            2048, config.max_num_seqs
        )
        if self.max_num_batched_tokens < config.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({config.max_num_seqs})"
            )

    def _build_runner(self, config: EngineConfig, loaded: LoadedModel) -> None:
        """Sizes the KV cache (which may lower ``max_model_len``) and builds the runner."""
        import torch

        from fastllm.engine.cache_size import plan_kv_cache
        from fastllm.engine.kv_cache_manager import KVLayout
        from fastllm.engine.model_runner import ModelRunner, cache_dtype
        from fastllm.engine.state_cache import StateCache
        from fastllm.layers.rotary import limit_positions

        mc, bs = loaded.model_config, config.block_size
        attention = loaded.model.attention_layers()
        layout = KVLayout.of([layer.sliding_window for layer in attention])
        step = self.max_num_batched_tokens
        #: A hybrid model's recurrent-state slots and snapshots (None: no recurrent layers).
        self.states: StateCache | None = None
        slot_bytes = ModelRunner.state_slot_bytes(loaded.model, loaded.dtype)
        if slot_bytes:
            self.states = StateCache(
                config.max_num_seqs,
                config.max_state_snapshots,
                config.state_snapshot_interval,
                config.enable_prefix_caching,
                config.block_size,
            )
        self.cache = plan_kv_cache(
            device=loaded.device,
            block_bytes=ModelRunner.block_bytes(
                layout.layers_per_block,
                mc.num_key_value_heads,
                mc.head_dim,
                bs,
                loaded.dtype,
                config.kv_cache_dtype,
            ),
            block_size=bs,
            max_model_len=self.max_model_len,
            max_model_len_is_explicit=config.max_model_len is not None,
            max_num_seqs=config.max_num_seqs,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            gpu_memory_utilization=config.gpu_memory_utilization,
            seq_blocks=lambda n: layout.blocks_per_seq(n, bs, step),
            layout=layout.describe(),
            groups=layout.num_groups,
            state_bytes=slot_bytes * (self.states.num_slots if self.states else 0),
            state_slots=self.states.num_slots if self.states else 0,
        )
        self.max_model_len = self.cache.max_model_len
        limit_positions(loaded.model, self.max_model_len)
        kv = str(cache_dtype(config.kv_cache_dtype, loaded.dtype)).removeprefix("torch.")
        logger.info("KV cache (%s): %s", kv, self.cache.describe())
        self.runner = ModelRunner(
            loaded.model,
            num_layers=len(attention),
            num_kv_heads=mc.num_key_value_heads,
            head_size=mc.head_dim,
            num_blocks=self.cache.num_blocks,
            block_size=bs,
            dtype=loaded.dtype,
            device=torch.device(loaded.device),
            vocab_size=mc.vocab_size,
            fuse_decoder=loaded.fuse_decoder,
            layout=layout,
            num_state_slots=self.states.num_slots if self.states else 0,
            kv_cache_dtype=config.kv_cache_dtype,
        )

    def require_tokenizer(self) -> Tokenizer:
        """The tokenizer; a ValueError saying what to do when there is none."""
        if self.tokenizer is None:
            raise ValueError(
                "this LLM has no tokenizer (skip_tokenizer_init=True, or load_format='dummy' "
                "on a folder without tokenizer.json): give prompts as token ids, "
                "e.g. {'prompt_token_ids': [...]}"
            )
        return self.tokenizer

    @property
    def requests(self) -> dict[str, Request]:
        """The requests not yet finished, by id."""
        return self.output_processor.requests

    # ---- requests -------------------------------------------------------

    def next_request_id(self) -> str:
        """A fresh request id."""
        return str(next(self._request_ids))

    def validate_prompt(self, prompt_token_ids: list[int], where: str) -> None:
        """Raises a ValueError naming ``where`` if the prompt cannot run."""
        if not prompt_token_ids:
            raise ValueError(f"{where}: the prompt is empty")
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(
                f"{where}: the prompt has {len(prompt_token_ids)} tokens, longer than "
                f"max_model_len={self.max_model_len}"
            )
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"{where}: token id {bad} is outside the vocabulary [0, {vocab})")

    def validate_request(
        self, prompt_token_ids: list[int], params: SamplingParams, where: str
    ) -> None:
        """The one rule of what a request may ask, offline and over HTTP: a
        ``RequestError`` naming ``where`` and the field when it cannot run."""
        try:
            self.validate_prompt(prompt_token_ids, where)
        except ValueError as e:
            raise RequestError(str(e), "prompt") from None
        limit = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and limit >= 0 and value > limit:
                raise RequestError(
                    f"{where}: {name}={value} is more than max_logprobs={limit}, the most "
                    f"this engine returns per token (raise it with LLM(max_logprobs=...) "
                    f"or `--max-logprobs`)",
                    name,
                )
        if params.thinking_token_budget is not None and (
            self.reasoning is None or self.tokenizer is None
        ):
            raise RequestError(
                f"{where}: thinking_token_budget needs a reasoning parser, which this engine "
                "does not have (start it with reasoning_parser=... or --reasoning-parser)",
                "thinking_token_budget",
            )
        if params.structured_outputs is not None and getattr(
            self.reasoning, "keeps_special_tokens", False
        ):
            raise RequestError(
                f"{where}: structured_outputs (and forced tool calls) are not supported with "
                f"the {self.reasoning.name} reasoning parser: a grammar would have to allow "
                "harmony's message headers",
                "structured_outputs",
            )
        if params.structured_outputs is not None:
            try:
                self.structured.check()
            except ValueError as e:
                raise RequestError(f"{where}: {e}", "structured_outputs") from None
        if self.states is not None and params.n > self.config.max_num_seqs:
            raise RequestError(
                f"{where}: n={params.n} completions need as many recurrent-state slots, and "
                f"this hybrid model has max_num_seqs={self.config.max_num_seqs}; lower n or "
                "raise max_num_seqs",
                "n",
            )
        n = len(prompt_token_ids)
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"{where}: this model's maximum context length is {self.max_model_len} "
                f"tokens; the prompt has {n} tokens and max_tokens={params.max_tokens} asks "
                f"for {n + params.max_tokens} in all; lower max_tokens or shorten the prompt",
                "max_tokens",
            )

    def add_request(
        self,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Queues a request whose prompt was already validated and tokenized."""
        rid = request_id if request_id is not None else self.next_request_id()
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if self.reasoning is not None and self.reasoning.keeps_special_tokens:
            # gpt-oss's harmony markers are special tokens: the reasoning
            # split reads them from the text (and removes them).
            params = params.clone(skip_special_tokens=False)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        req = Request(
            rid, prompt, list(prompt_token_ids), params, arrival_time or time.time(), seed
        )
        if params.bad_words:
            req.seqs[0].bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        seq = req.seqs[0]
        if params.structured_outputs is not None:
            seq.grammar = self.structured.start(params.structured_outputs)
        if (
            self.reasoning is not None
            and self.tokenizer is not None
            and (seq.grammar is not None or params.thinking_token_budget is not None)
        ):
            seq.thinking = ThinkingState.start(
                self.thinking_tags,
                seq.prompt_token_ids,
                params.thinking_token_budget,
                self.reasoning.implicit_start,
            )
            if seq.thinking.phase == THINK:
                # the grammar applies to the answer, once the thinking is over
                seq.thinking.grammar, seq.grammar = seq.grammar, None
        self.output_processor.add_request(req)
        self.scheduler.add(req.seqs[0])
        return req

    @property
    def thinking_tags(self) -> ThinkingTags:
        """The reasoning parser's tags as token ids."""
        if self._thinking_tags is None:
            assert self.reasoning is not None and self.tokenizer is not None
            enc = self.tokenizer.encode
            self._thinking_tags = ThinkingTags(
                enc(self.reasoning.start, add_special_tokens=False),
                enc(self.reasoning.end, add_special_tokens=False),
            )
        return self._thinking_tags

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as tokens, written alone and after a space (as it appears
        mid-text), as vLLM bans them."""
        if self.tokenizer is None:
            raise ValueError("SamplingParams.bad_words needs a tokenizer; this engine has none")
        out: list[list[int]] = []
        for w in words:
            for text in (w.lstrip(), " " + w.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stops a request now; its blocks return to the pool (and, once no
        request is left, any block an interrupt cut off: ``reclaim_blocks``).
        Every sequence the scheduler holds for it stops too, even one an
        interrupt left outside the request (an ``n > 1`` fork cut off between
        the scheduler and the output processor)."""
        req = self.requests.get(request_id)
        seqs = self.scheduler.sequences_of(request_id)
        if req is not None:
            seqs += [s for s in req.seqs if s not in seqs]
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.stop(seq, "abort")
        out = None
        if req is not None:
            out = self.output_processor.output(req, finished=True)
            self.output_processor.release(req)
        self.reclaim_blocks()
        return out

    def abort_all(self) -> None:
        """Aborts every request and drops whatever an interrupt left half-done
        (sequences no request owns, blocks no table lists), so the engine is
        idle with every KV block free; for the one caller that owns the
        engine (``LLM``) when aborting its own requests failed."""
        for rid in list(self.requests):
            try:
                self.abort_request(rid)
            except Exception:  # noqa: BLE001 - the rest is dropped below either way
                logger.debug("abort of request %s failed", rid, exc_info=True)
        self.output_processor.release_all()
        self.scheduler.drop_all()
        self.reclaim_blocks()

    def reclaim_blocks(self) -> int:
        """With no request left, returns to the pool every KV block still held:
        blocks an interrupt (Ctrl-C) cut off between their allocation and their
        sequence's block table, which no request can free. Returns how many
        references were dropped; does nothing while any request is unfinished."""
        if self.has_unfinished_requests():
            return 0
        if self.states is not None:
            self.states.reclaim()
        pool = self.kv.pool
        dropped = 0
        if pool.num_free_blocks() == pool.num_blocks:
            return 0  # the usual case: nothing held
        for block in range(pool.num_blocks):
            while pool.ref_count(block) > 0:
                pool.free(block)
                dropped += 1
        if dropped:
            logger.info("returned %d KV block reference(s) an interrupt had cut off", dropped)
        return dropped

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still waiting or running."""
        return self.scheduler.has_unfinished()

    # ---- one step -------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step: schedule, run the model and sample, apply the tokens,
        then the outputs of the requests it advanced."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            why = self.scheduler.unschedulable()
            if why is not None:
                raise RuntimeError(why)
            return []
        now = time.time()
        for entry in sched.scheduled:
            metrics = self.requests[entry.seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        result = self.runner.run(sched)
        for idx, entries in result.prompt_logprobs.items():
            self.output_processor.add_prompt_logprobs(sched.scheduled[idx].seq, entries)
        self.stats["steps"] += 1
        self.stats["prompt_tokens"] += sum(e.num_prompt_tokens for e in sched.scheduled)
        update = self.scheduler.postprocess(sched, result)
        self.stats["generation_tokens"] += len(update.new_tokens)
        now = time.time()
        for seq, stop in self.output_processor.process(update, now):
            self.scheduler.stop(seq, "stop", stop)
        return self.output_processor.outputs((e.seq.request_id for e in sched.scheduled), now)

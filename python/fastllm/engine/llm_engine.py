"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out."""

from __future__ import annotations

import itertools
import logging
import os
import random
import time
from typing import TYPE_CHECKING

from fastllm.config import EngineConfig, resolve_dtype
from fastllm.engine.request import Request
from fastllm.engine.sequence import Sequence
from fastllm.outputs import CompletionOutput, Logprob, RequestOutput
from fastllm.sampling_params import SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from fastllm.engine.scheduler import SchedulerOutput

logger = logging.getLogger("fastllm")

_DEFAULT_KV_BYTES = 4 << 30  # like vLLM's CPU default KV space


def resolve_model_folder(model: str) -> str:
    """A local folder for ``model``: a path, or a hub id found in the local hub cache."""
    if os.path.isdir(model):
        return model
    if os.path.exists(model):
        raise ValueError(f"model path {model!r} is not a folder")
    if model.count("/") == 1 and not model.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            snapshot_download = None
        if snapshot_download is not None:
            try:
                return snapshot_download(model, local_files_only=True)
            except Exception as e:  # not in the local cache
                raise ValueError(
                    f"model {model!r} is not a local folder and is not in the local "
                    f"Hugging Face cache ({type(e).__name__}); download it first"
                ) from e
    raise ValueError(f"model folder not found: {model!r}")


class LLMEngine:
    """Owns the tokenizer, model runner and scheduler; advances requests step by step."""

    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        from fastllm.platform import resolve_device

        device = resolve_device(config.device, config.tensor_parallel_size)
        folder = resolve_model_folder(config.model)

        import torch

        from fastllm.config import ModelConfig
        from fastllm.engine.kv_cache_manager import KVCacheManager
        from fastllm.engine.model_runner import ModelRunner
        from fastllm.engine.scheduler import Scheduler
        from fastllm.layers.linear import pack_linears, should_pack
        from fastllm.models.loader import load_model
        from fastllm.tokenizer import Tokenizer

        self.config = config
        self.folder = folder
        self.model_config = mc = ModelConfig.from_pretrained(folder)
        tok_folder = resolve_model_folder(config.tokenizer) if config.tokenizer else folder
        self.tokenizer = Tokenizer(tok_folder)
        self.device = device
        self.dtype = resolve_dtype(config.dtype, device, mc.torch_dtype)
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
        eos = set(mc.eos_token_ids)
        if not eos and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos

        torch_device = torch.device(device)
        model = load_model(mc, folder, self.dtype, device, config.load_format)
        if should_pack(device, self.dtype):
            pack_linears(model)
        bs = config.block_size
        per_block = ModelRunner.block_bytes(
            mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, bs, self.dtype
        )
        need_blocks = -(-self.max_model_len // bs)
        if config.kv_cache_memory_bytes is not None:
            num_blocks = config.kv_cache_memory_bytes // per_block
        else:
            wanted = need_blocks * config.max_num_seqs + 1
            num_blocks = min(wanted, _DEFAULT_KV_BYTES // per_block)
        if num_blocks < need_blocks:
            raise ValueError(
                f"the KV cache ({num_blocks} blocks of {bs} tokens) cannot hold one sequence "
                f"of max_model_len={self.max_model_len} tokens ({need_blocks} blocks); raise "
                f"kv_cache_memory_bytes or lower max_model_len"
            )
        self.runner = ModelRunner(
            model,
            num_layers=mc.num_hidden_layers,
            num_kv_heads=mc.num_key_value_heads,
            head_size=mc.head_dim,
            num_blocks=num_blocks,
            block_size=bs,
            dtype=self.dtype,
            device=torch_device,
        )
        self.kv = KVCacheManager(num_blocks, bs, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, self.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}

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
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        req = Request(
            rid, prompt, list(prompt_token_ids), params, arrival_time or time.time(), seed
        )
        seq = Sequence(next(self._seq_ids), req, 0, seed)
        self._attach_detokenizer(seq)
        req.seqs.append(seq)
        self.requests[rid] = req
        self.scheduler.add(seq)
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stops a request now; its blocks return to the pool."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        req.aborted = True
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        return self._output(req, finished=True)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still waiting or running."""
        return self.scheduler.has_unfinished()

    # ---- one step -------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one model step; returns outputs of requests it advanced."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self.scheduler.waiting and not self.scheduler.running:
                seq = self.scheduler.waiting[0]
                raise RuntimeError(
                    f"request {seq.request.request_id} cannot be scheduled: needs "
                    f"{self.kv.blocks_for(seq.num_tokens)} KV blocks, pool has "
                    f"{self.kv.num_free_blocks} free"
                )
            return []
        now = time.time()
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        prompt_lp: list[int] = []
        off = 0
        for idx, (seq, n) in enumerate(sched.scheduled):
            req = seq.request
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            if req.prompt_logprobs is not None and seq.index == 0 and not seq.prefill_done:
                prompt_lp.append(idx)
            off += n
            if seq.num_computed_tokens + n == seq.num_tokens:
                sample_rows.append(off - 1)
                sample_seqs.append(seq)
        logits, all_logits = self.runner.execute(sched, sample_rows, prompt_lp)
        self._collect_prompt_logprobs(sched, all_logits)
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            self.kv.register_computed_blocks(seq)
        self.stats["steps"] += 1
        # prompt tokens computed this step: chunk [end - n, end) clipped to the prompt
        self.stats["prompt_tokens"] += sum(
            max(0, min(s.num_prompt_tokens, s.num_computed_tokens) - (s.num_computed_tokens - n))
            for s, n in sched.scheduled
        )
        if sample_seqs:
            self._sample_and_append(logits, sample_seqs)
        return self._outputs_of(sched)

    def _collect_prompt_logprobs(self, sched: SchedulerOutput, all_logits: dict) -> None:
        from fastllm.engine.model_runner import prompt_logprobs_of

        for idx, logits in all_logits.items():
            seq, n = sched.scheduled[idx]
            start = seq.num_computed_tokens
            nxt = seq.token_ids[start + 1 : min(start + n + 1, seq.num_prompt_tokens)]
            entries = prompt_logprobs_of(logits, nxt, seq.request.params.prompt_logprobs or 0)
            self._decode_logprob_tokens(entries)
            seq.request.prompt_logprobs.extend(entries)

    def _decode_logprob_tokens(self, entries: list[dict[int, Logprob]]) -> None:
        for d in entries:
            for t, lp in d.items():
                lp.decoded_token = self.tokenizer.decode([t], skip_special_tokens=False)

    def _sample_and_append(self, logits, sample_seqs: list[Sequence]) -> None:
        import torch

        rows = list(range(len(sample_seqs)))
        seqs = list(sample_seqs)
        for r, seq in enumerate(sample_seqs):
            req = seq.request
            if req.params.n > 1 and len(req.seqs) < req.params.n and seq.num_output_tokens == 0:
                for i in range(len(req.seqs), req.params.n):
                    child = Sequence(next(self._seq_ids), req, i, req.seed + i)
                    self._attach_detokenizer(child)
                    self.kv.fork(seq, child)
                    child.status = seq.status
                    req.seqs.append(child)
                    self.scheduler.running.append(child)
                    rows.append(r)
                    seqs.append(child)
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows)]
        suppress = [self._suppressed(s) for s in seqs]
        tokens, lps, ranks, tops = self.runner.sample(logits, seqs, suppress)
        now = time.time()
        for seq, tok, lp, rank, top in zip(seqs, tokens, lps, ranks, tops):
            self._append_token(seq, tok, lp, rank, top, now)

    def _suppressed(self, seq: Sequence) -> list[int]:
        p = seq.request.params
        if seq.num_output_tokens >= p.min_tokens:
            return []
        toks = list(p.stop_token_ids)
        if not p.ignore_eos:
            toks.extend(self.eos_token_ids)
        return toks

    def _attach_detokenizer(self, seq: Sequence) -> None:
        from fastllm.tokenizer import IncrementalDetokenizer

        seq.detokenizer = IncrementalDetokenizer(
            self.tokenizer, seq.request.prompt_token_ids, seq.request.params.skip_special_tokens
        )

    def _append_token(self, seq, tok: int, lp: float, rank: int, top, now: float) -> None:
        req = seq.request
        p = req.params
        seq.token_ids.append(tok)
        self.stats["generation_tokens"] += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        if p.logprobs is not None:
            seq.cumulative_logprob += lp
            entry = {tok: Logprob(lp, rank)}
            for i, (t, v) in enumerate(top):
                if t not in entry:
                    entry[t] = Logprob(v, i + 1)
            self._decode_logprob_tokens([entry])
            seq.logprobs.append(entry)
        n_out = seq.num_output_tokens
        finish: str | None = None
        reason: int | str | None = None
        if n_out >= p.min_tokens:
            if not p.ignore_eos and tok in self.eos_token_ids:
                finish = "stop"
            elif tok in p.stop_token_ids:
                finish, reason = "stop", tok
        if finish is None or p.include_stop_str_in_output:
            delta = seq.detokenizer.add(tok)
            seq.text += delta
            if finish is None and p._stop_list and n_out >= p.min_tokens and delta:
                hit = _find_stop(seq.text, len(delta), p._stop_list)
                if hit is not None:
                    pos, s = hit
                    seq.text = (
                        seq.text[: pos + len(s)] if p.include_stop_str_in_output else seq.text[:pos]
                    )
                    finish, reason = "stop", s
        if finish is None:
            if p.max_tokens is not None and n_out >= p.max_tokens:
                finish = "length"
            elif seq.num_tokens >= self.max_model_len:
                finish = "length"
        if finish is not None:
            seq.finish_reason = finish
            seq.stop_reason = reason
            self.scheduler.finish(seq)
            if req.finished:
                req.metrics.finished_time = now

    # ---- outputs --------------------------------------------------------

    def _outputs_of(self, sched: SchedulerOutput) -> list[RequestOutput]:
        seen: dict[str, Request] = {}
        for seq, _ in sched.scheduled:
            seen.setdefault(seq.request.request_id, seq.request)
        outs = []
        for rid, req in seen.items():
            finished = req.finished
            outs.append(self._output(req, finished))
            if finished:
                self.requests.pop(rid, None)
        return outs

    def _output(self, req: Request, finished: bool) -> RequestOutput:
        want_lp = req.params.logprobs is not None
        comps = [
            CompletionOutput(
                index=s.index,
                text=s.text,
                token_ids=list(s.output_token_ids),
                cumulative_logprob=s.cumulative_logprob if want_lp else None,
                logprobs=list(s.logprobs) if want_lp else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in req.seqs
        ]
        req.num_cached_tokens = req.seqs[0].num_cached_tokens if req.seqs else 0
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=req.prompt_logprobs,
            outputs=comps,
            finished=finished,
            num_cached_tokens=req.num_cached_tokens,
            metrics=req.metrics,
        )


def _find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends inside the last new_len characters."""
    best: tuple[int, str] | None = None
    for s in stops:
        start = max(0, len(text) - new_len - len(s) + 1)
        pos = text.find(s, start)
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, s)
    return best

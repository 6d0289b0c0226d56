"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out."""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import random
import re
import time
from typing import Any

from fastllm.config import EngineConfig, ModelConfig, resolve_dtype
from fastllm.engine.output_processor import OutputProcessor
from fastllm.engine.request import Request
from fastllm.logs import configure_logging
from fastllm.outputs import RequestOutput
from fastllm.sampling_params import SamplingParams

logger = logging.getLogger("fastllm")

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def is_gguf_file(model: str) -> bool:
    """Whether ``model`` names a GGUF file (a path ending in ``.gguf``)."""
    return isinstance(model, str) and model.lower().endswith(".gguf") and not os.path.isdir(model)


def resolve_model_folder(
    model: str, revision: str | None = None, download_dir: str | None = None
) -> str:
    """A local folder for ``model``: a path, or a hub id (``org/name`` or
    ``name``) found in the local Hugging Face cache (``download_dir`` when
    given). fastllm never downloads: a miss says how to."""
    if os.path.isdir(model):
        return model
    if os.path.exists(model):
        raise ValueError(f"model path {model!r} is not a folder")
    if _HUB_ID.match(model) and ".." not in model:
        try:
            from huggingface_hub import snapshot_download
        except ImportError:  # pragma: no cover - tokenizers depends on it
            snapshot_download = None
        if snapshot_download is not None:
            try:
                return snapshot_download(
                    model, revision=revision, cache_dir=download_dir, local_files_only=True
                )
            except Exception as e:  # not in the local cache
                where = download_dir or "the local Hugging Face cache"
                rev = f" at revision {revision!r}" if revision else ""
                hint = f" --revision {revision}" if revision else ""
                hint += f" --cache-dir {download_dir}" if download_dir else ""
                raise ValueError(
                    f"model {model!r}{rev} is not a local folder and is not in {where} "
                    f"({type(e).__name__}); fastllm never downloads: run "
                    f"`huggingface-cli download {model}{hint}` first, or pass the folder's path"
                ) from None
    raise ValueError(f"model folder not found: {model!r}")


def _check_architecture(mc: ModelConfig, folder: str) -> None:
    """A clear error, before any weight is read, for an architecture fastllm cannot run."""
    from fastllm.models import ARCHITECTURES, get_model_class

    if mc.architecture not in ARCHITECTURES and "auto_map" in mc.hf:
        raise ValueError(
            f"{os.path.join(folder, 'config.json')}: architecture {mc.architecture!r} comes "
            f"with its own remote code (auto_map), and fastllm runs no remote code, "
            f"trust_remote_code or not; supported architectures: {', '.join(ARCHITECTURES)}"
        )
    get_model_class(mc.architecture)  # the usual error for any other unknown architecture


class RequestError(ValueError):
    """A request the engine cannot run; ``field`` names what to change."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@contextlib.contextmanager
def _gc_paused():
    """Python's cyclic garbage collector off while a model loads. A load makes
    hundreds of thousands of objects that form no cycles (a GGUF vocabulary's
    strings and merges), and every collection they set off walks all of
    torch's objects too (a 152k-token GGUF header and tokenizer: 104 -> 99 ms)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class LLMEngine:
    """Owns the tokenizer, model runner and scheduler; advances requests step by step."""

    def __init__(self, config: EngineConfig) -> None:
        configure_logging()
        config.validate()
        from fastllm.platform import resolve_device

        device = resolve_device(config.device, config.tensor_parallel_size)
        from fastllm.layers.quantization import resolve_quantization

        gguf_path = config.model if is_gguf_file(config.model) else None
        q = config.quantization
        if gguf_path is None and isinstance(q, str) and q.strip().lower() == "gguf":
            raise ValueError(f"quantization='gguf' needs a .gguf model file; got {config.model!r}")
        self.quantization = resolve_quantization(q)
        if self.quantization is not None and device != "cpu":
            raise ValueError(
                f"quantization={config.quantization!r} runs on the CPU's integer kernels, "
                f"not on device {device!r}: pass device='cpu', or quantization=None"
            )
        if gguf_path is None:
            folder = resolve_model_folder(config.model, config.revision, config.download_dir)
        else:
            from fastllm.gguf.cache import cache_file_exists
            from fastllm.gguf.reader import GGUFFile

            folder = gguf_path
        self.config = config
        self.folder = folder
        with _gc_paused():
            # A GGUF file's every header, key and tensor is checked here.
            # With the packed-weight cache, the file's quantized tensors are
            # not read: its pages are mapped as the header and floats need them.
            gguf = (
                None
                if gguf_path is None
                else GGUFFile(gguf_path, populate=not cache_file_exists(gguf_path))
            )
            try:
                self._init(config, device, folder, gguf)
            finally:
                if gguf is not None:
                    gguf.close()  # every tensor was copied or repacked out of the file

    def _init(self, config: EngineConfig, device: str, folder: str, gguf: Any) -> None:
        import torch

        from fastllm.engine.cache_size import plan_kv_cache
        from fastllm.engine.kv_cache_manager import KVCacheManager
        from fastllm.engine.model_runner import ModelRunner
        from fastllm.engine.scheduler import Scheduler
        from fastllm.layers.linear import pack_linears, should_pack
        from fastllm.layers.rotary import RotaryEmbedding
        from fastllm.models.loader import load_model
        from fastllm.tokenizer import Tokenizer

        #: What the model's weights came from: the GGUF file's tensor types, or None.
        self.gguf: dict[str, Any] | None = None
        if gguf is None:
            self.model_config = mc = ModelConfig.from_pretrained(folder)
        else:
            from fastllm.gguf.config import hf_config

            if config.load_format not in ("auto", "gguf"):
                raise ValueError(
                    f"load_format={config.load_format!r} does not apply to a GGUF file; "
                    "use 'auto' or 'gguf'"
                )
            self.model_config = mc = ModelConfig.from_dict(hf_config(gguf), path=folder)
        _check_architecture(mc, folder)
        tok_folder = (
            resolve_model_folder(config.tokenizer, config.tokenizer_revision, config.download_dir)
            if config.tokenizer
            else folder
        )
        # Without a tokenizer (vLLM's skip_tokenizer_init, or random weights from a
        # folder that holds only config.json) prompts are token ids and outputs
        # carry no text.
        no_tokenizer = config.skip_tokenizer_init or (
            config.load_format == "dummy"
            and not os.path.isfile(os.path.join(tok_folder, "tokenizer.json"))
        )
        self.tokenizer: Tokenizer | None
        if no_tokenizer:
            self.tokenizer = None
        elif gguf is not None and not config.tokenizer:
            from fastllm.gguf.tokenizer import tokenizer_from_metadata

            self.tokenizer = tokenizer_from_metadata(gguf.metadata, folder)
        else:
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
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos

        torch_device = torch.device(device)
        if gguf is None:
            model = load_model(mc, folder, self.dtype, device, config.load_format)
        else:
            from fastllm.gguf.loader import load_gguf_model

            model, report = load_gguf_model(mc, gguf, self.dtype, device)
            self.gguf = report.summary(folder)
        if self.quantization is not None:
            from fastllm.layers.quantization import quantize_model

            quantize_model(model, self.quantization, mc.vocab_size)
        elif should_pack(device, self.dtype):
            pack_linears(model)
        bs = config.block_size
        self.cache = plan_kv_cache(
            device=device,
            block_bytes=ModelRunner.block_bytes(
                mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, bs, self.dtype
            ),
            block_size=bs,
            max_model_len=self.max_model_len,
            max_model_len_is_explicit=config.max_model_len is not None,
            max_num_seqs=config.max_num_seqs,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            gpu_memory_utilization=config.gpu_memory_utilization,
        )
        self.max_model_len = self.cache.max_model_len
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.limit_positions(self.max_model_len)
        num_blocks = self.cache.num_blocks
        logger.info("KV cache: %s", self.cache.describe())
        self.runner = ModelRunner(
            model,
            num_layers=mc.num_hidden_layers,
            num_kv_heads=mc.num_key_value_heads,
            head_size=mc.head_dim,
            num_blocks=num_blocks,
            block_size=bs,
            dtype=self.dtype,
            device=torch_device,
            vocab_size=mc.vocab_size,
        )
        self.kv = KVCacheManager(num_blocks, bs, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, self.max_num_batched_tokens, self.max_model_len, eos
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        from fastllm.engine.structured import StructuredOutputs

        self.structured = StructuredOutputs(self.tokenizer, eos, mc.vocab_size)
        self._request_ids = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}

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
        if params.structured_outputs is not None:
            try:
                self.structured.check()
            except ValueError as e:
                raise RequestError(f"{where}: {e}", "structured_outputs") from None
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
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        req = Request(
            rid, prompt, list(prompt_token_ids), params, arrival_time or time.time(), seed
        )
        if params.bad_words:
            req.seqs[0].bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        if params.structured_outputs is not None:
            req.seqs[0].grammar = self.structured.start(params.structured_outputs)
        self.output_processor.add_request(req)
        self.scheduler.add(req.seqs[0])
        return req

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

    def reclaim_blocks(self) -> int:
        """With no request left, returns to the pool every KV block still held:
        blocks an interrupt (Ctrl-C) cut off between their allocation and their
        sequence's block table, which no request can free. Returns how many
        references were dropped; does nothing while any request is unfinished."""
        if self.has_unfinished_requests():
            return 0
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

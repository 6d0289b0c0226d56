"""Model runner: owns the model and its KV caches; ``run`` turns a scheduled
step into one packed forward pass and samples the next tokens."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from fastllm import _core
from fastllm.engine.kv_cache_manager import KVLayout
from fastllm.engine.scheduler import SampledToken, SchedulerOutput, StepResult
from fastllm.engine.sequence import Sequence
from fastllm.engine.structured import GrammarMasks
from fastllm.forward_context import AttentionMetadata, set_context
from fastllm.outputs import Logprob

_NO_PENALTY_TOKENS = torch.zeros(0, dtype=torch.int32)


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache tensors' dtype for ``EngineConfig.kv_cache_dtype``."""
    return torch.int8 if kv_cache_dtype == "int8" else model_dtype


def row_elements(head_size: int, dtype: torch.dtype) -> int:
    """Elements of one cached (token, KV head) row: an 8-bit row carries its scale."""
    from fastllm.layers.attention_torch import INT8_SCALE_BYTES

    return head_size + (INT8_SCALE_BYTES if dtype == torch.int8 else 0)


class ModelRunner:
    """Runs the torch model on the packed tokens of a step."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        vocab_size: int | None = None,
        fuse_decoder: bool = False,
        layout: KVLayout | None = None,
        num_state_slots: int = 0,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.model = model
        # Grammar masks overlap the forward pass when it runs on the GPU (the CPU is
        # free then); on the CPU the forward pass already uses every core, and the
        # masks are computed in the sampler's pass. Needs the logits' width.
        self.vocab_size = vocab_size
        self.overlap_masks = device.type == "cuda" and vocab_size is not None
        self._mask_worker: ThreadPoolExecutor | None = None
        # A packed model runs its heavy CPU work (linears, norms, attention,
        # sampling) on the Rust threads; torch's remaining small ops run on the
        # calling thread during a step, so that torch's OpenMP workers do not
        # spin on the cores the Rust threads need (measured: +15% output
        # tokens/s at batch 64 on 2 cores).
        packed = device.type == "cpu" and getattr(model, "packed_head", None) is not None
        self.step_torch_threads = 1 if packed else None
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        #: The caches' element type: the model's, or int8 (``kv_cache_dtype="int8"``:
        #: rows of head_size int8 values and a float32 scale, ``attention_torch``).
        self.cache_dtype = cache_dtype(kv_cache_dtype, dtype)
        shape = (num_blocks, num_kv_heads, block_size, row_elements(head_size, self.cache_dtype))
        layers = model.attention_layers()
        if len(layers) != num_layers:
            raise ValueError(f"model has {len(layers)} attention layers, config says {num_layers}")
        self.layout = layout or KVLayout.of([layer.sliding_window for layer in layers])
        # One K and one V tensor per layer slot of a block (``KVLayout``):
        # layer slot s of every group lives in tensor s, at its group's block ids.
        # Uninitialised: a slot is always written before it is read, and on the
        # CPU the pages of blocks never used are never committed.
        slots = self.layout.layers_per_block
        kv = self.cache_dtype
        self.k_caches = [torch.empty(shape, dtype=kv, device=device) for _ in range(slots)]
        self.v_caches = [torch.empty(shape, dtype=kv, device=device) for _ in range(slots)]
        for i, layer in enumerate(layers):
            group, slot = self.layout.place(i)
            layer.kv_group = group
            layer.k_cache = self.k_caches[slot]
            layer.v_cache = self.v_caches[slot]
        # A hybrid model's recurrent layers: each state tensor has one slot per
        # running sequence and per snapshot (``engine/state_cache.py``), in
        # place of KV blocks; uninitialised until a slot is zeroed or copied.
        self.state_tensors: list[torch.Tensor] = []
        for layer in recurrent_layers(model):
            layer.states = [
                torch.empty((num_state_slots, *shape), dtype=dt, device=device)
                for shape, dt in layer.state_shapes(dtype)
            ]
            self.state_tensors.extend(layer.states)
        # The loader decided whether the decoder layers run as one fused call
        # per step (``loading.load``); the fusion needs the caches made above.
        self.fused_layers = bool(fuse_decoder and model.fuse_decoder_layers())

    @staticmethod
    def block_bytes(
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
    ) -> int:
        """Bytes of K and V one block takes across ``num_layers`` layers (the
        layers a block holds: ``KVLayout.layers_per_block``)."""
        kv = cache_dtype(kv_cache_dtype, dtype)
        elem = torch.empty(0, dtype=kv).element_size()
        row = row_elements(head_size, kv)
        return 2 * num_layers * num_kv_heads * row * block_size * elem

    @staticmethod
    def state_slot_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
        """Bytes of one sequence's recurrent state, every recurrent layer (0: none)."""
        total = 0
        for layer in recurrent_layers(model):
            for shape, dt in layer.state_shapes(dtype):
                total += torch.empty(0, dtype=dt).element_size() * int(np.prod(shape))
        return total

    def _copy_states(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for t in self.state_tensors:
            t[dst] = t[src]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copies KV blocks (src -> dst) in every layer slot, for copy-on-write
        (a block belongs to one group; the other groups never read it)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k, v in zip(self.k_caches, self.v_caches):
            k[dst] = k[src]
            v[dst] = v[src]

    @torch.inference_mode()
    def run(self, sched: SchedulerOutput) -> StepResult:
        """Runs one step: the packed forward pass, then the sampler for every
        entry that samples, and the prompt logprobs that were asked for."""
        sampled = sched.sampled
        rows: list[int] = []
        seqs: list[Sequence] = []
        seeds: list[int] = []
        suppress: list[list[int]] = []
        for r, entry in enumerate(sampled):
            for j in range(entry.num_samples):
                rows.append(r)
                seqs.append(entry.seq)
                seeds.append(entry.seq.seed + j)
                suppress.append(entry.suppressed)
        masks = GrammarMasks(seqs)
        if self.overlap_masks and masks.matchers and self.vocab_size is not None:
            if self._mask_worker is None:
                self._mask_worker = ThreadPoolExecutor(1, thread_name_prefix="fastllm-masks")
            masks.start(self._mask_worker, self.vocab_size)
        logits, prompt_logits = self._forward(sched)
        samples: list[list[SampledToken]] = []
        if sampled:
            if len(rows) != logits.shape[0]:
                logits = logits[torch.tensor(rows, device=logits.device)]
            _apply_logit_rules(logits, seqs)
            tokens, lps, ranks, tops = self.sample(logits, seqs, seeds, suppress, masks)
            drawn = iter(map(SampledToken, tokens, lps, ranks, tops))
            samples = [[next(drawn) for _ in range(e.num_samples)] for e in sampled]
        prompt_lps = {}
        for idx, lg in prompt_logits.items():
            entry = sched.scheduled[idx]
            seq = entry.seq
            nxt = seq.token_ids[
                entry.start + 1 : min(entry.start + entry.num_new_tokens + 1, seq.num_prompt_tokens)
            ]
            prompt_lps[idx] = prompt_logprobs_of(lg, nxt, seq.params.prompt_logprobs or 0)
        return StepResult(samples, prompt_lps)

    def _forward(self, sched: SchedulerOutput) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The forward pass of one step.

        Returns float32 logits of the last row of every sampling entry (left
        on the GPU when the CUDA sampler will take them, else on the CPU) and,
        for each scheduled index that wants prompt logprobs, the CPU logits of
        all its rows in this step.
        """
        self.copy_blocks(sched.block_copies)
        states = sched.state_ops
        if states is not None:
            self._copy_states(states.copies)
            if states.resets:
                idx = torch.tensor(states.resets, device=self.device)
                for t in self.state_tensors:
                    t[idx] = 0
        n_tokens = sched.num_tokens
        input_ids = np.empty(n_tokens, dtype=np.int64)
        positions = np.empty(n_tokens, dtype=np.int64)
        num_seqs = len(sched.scheduled)
        seq_lens = np.empty(num_seqs, dtype=np.int32)
        qsl = np.zeros(num_seqs + 1, dtype=np.int32)
        num_groups = self.layout.num_groups
        max_blocks = max(len(e.seq.block_table) for e in sched.scheduled)
        block_tables = np.zeros((num_groups, num_seqs, max_blocks), dtype=np.int32)
        group_slots = np.empty((num_groups, n_tokens), dtype=np.int64)
        bs = self.block_size
        max_q = 0
        for i, entry in enumerate(sched.scheduled):
            seq, n, off = entry.seq, entry.num_new_tokens, entry.row
            start = entry.start
            end = start + n
            input_ids[off : off + n] = seq.token_ids[start:end]
            pos = np.arange(start, end, dtype=np.int64)
            positions[off : off + n] = pos
            for g in range(num_groups):
                table = np.asarray(seq.block_tables[g], dtype=np.int64)
                group_slots[g, off : off + n] = table[pos // bs] * bs + pos % bs
                block_tables[g, i, : len(table)] = table
            seq_lens[i] = end
            qsl[i + 1] = off + n
            max_q = max(max_q, n)
        dev = self.device
        tables = [torch.from_numpy(block_tables[g]).to(dev) for g in range(num_groups)]
        mappings = [torch.from_numpy(group_slots[g]).to(dev) for g in range(num_groups)]
        meta = AttentionMetadata(
            slot_mapping=mappings[0],
            block_tables=tables[0],
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            query_start_loc=torch.from_numpy(qsl).to(dev),
            max_query_len=max_q,
            max_seq_len=int(seq_lens.max()),
            group_slot_mappings=mappings if num_groups > 1 else None,
            group_block_tables=tables if num_groups > 1 else None,
            state_slots=None
            if states is None
            else torch.tensor([e.seq.state_slot for e in sched.scheduled], device=dev),
        )
        logit_rows = [e.row + e.num_new_tokens - 1 for e in sched.sampled]
        set_context(meta)
        with torch_threads(self.step_torch_threads):
            try:
                hidden = self.model(
                    torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev)
                )
            finally:
                set_context(None)
            if states is not None:
                self._copy_states(states.saves)
            for entry in sched.scheduled:
                if entry.seq.pooling is not None:
                    # a pooling request: its hidden states, as the prompt is computed
                    rows = hidden[entry.row : entry.row + entry.num_prompt_tokens]
                    entry.seq.pooling.add(rows, entry.start, entry.seq.num_prompt_tokens)
            # int64 even when empty: a step of prompt chunks alone samples nothing.
            rows = torch.as_tensor(logit_rows, dtype=torch.long, device=dev)
            logits = self.model.compute_logits(hidden[rows])
            extra: dict[int, torch.Tensor] = {}
            for idx, entry in enumerate(sched.scheduled):
                if entry.prompt_logprobs:
                    lo = entry.row
                    extra[idx] = self.model.compute_logits(hidden[lo : lo + entry.num_new_tokens])
                    extra[idx] = extra[idx].float().cpu()
        if logits.is_cuda and _cuda_kernels_enabled():
            return logits.float(), extra
        return logits.float().cpu(), extra

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        seeds: list[int],
        suppress: list[list[int]],
        masks: GrammarMasks | None = None,
    ) -> tuple[list[int], list[float], list[int], list[list[tuple[int, float]]]]:
        """Samples one token per row of ``logits``: row i for ``seqs[i]`` with ``seeds[i]``.

        CUDA logits go to the CUDA sampler (same semantics and random draw as
        the CPU one); CPU logits, or CUDA ones when the kernels are off, go to
        the Rust CPU sampler. ``suppress[i]`` lists tokens row i may not
        produce (EOS and stop tokens before ``min_tokens``); a sequence with a
        grammar may only produce what its grammar allows next (``masks``: the
        step's grammar masks, perhaps already computing; built here when None).
        """
        for i, toks in enumerate(suppress):
            if toks:
                logits[i, toks] = float("-inf")
        for i, seq in enumerate(seqs):
            if seq.thinking is not None and seq.thinking.forced:
                # the thinking budget is spent: the block's closing tag comes next
                forced = seq.thinking.forced[0]
                value = logits[i, forced].clone()
                logits[i] = float("-inf")
                logits[i, forced] = value if torch.isfinite(value) else 0.0
        logits = logits.contiguous()
        (masks if masks is not None else GrammarMasks(seqs)).apply(logits)
        batch = sampling_batch(seqs, seeds)
        if logits.is_cuda:
            from fastllm.layers import cuda_ops

            drawn = cuda_ops.sample(logits, batch)
            if drawn is not None:
                tokens, lps, ranks = drawn
                return tokens, lps, ranks, _top_logprobs(logits, batch.num_logprobs)
            logits = logits.cpu()
        return _core.sample(logits, batch)


def recurrent_layers(model: torch.nn.Module) -> list:
    """The model's recurrent token mixers (``layers/recurrent.py``), in order; [] for most models."""
    layers = getattr(model, "recurrent_layers", None)
    return list(layers()) if layers is not None else []


def sampling_batch(seqs: list[Sequence], seeds: list[int]) -> _core.SamplingBatch:
    """The step's sampling parameters as the one structure the samplers read:
    row i samples for ``seqs[i]`` with ``seeds[i]`` at its next position; token
    histories only for the rows with penalties."""
    params = [s.params for s in seqs]
    prompt_off = [0]
    output_off = [0]
    prompt_chunks: list[list[int]] = []
    output_chunks: list[list[int]] = []
    for s, p in zip(seqs, params):
        if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            prompt_chunks.append(s.token_ids[: s.num_prompt_tokens])
            output_chunks.append(s.output_token_ids)
        else:
            prompt_chunks.append([])
            output_chunks.append([])
        prompt_off.append(prompt_off[-1] + len(prompt_chunks[-1]))
        output_off.append(output_off[-1] + len(output_chunks[-1]))
    return _core.SamplingBatch(
        temperature=[p.temperature for p in params],
        top_k=[p.top_k for p in params],
        top_p=[p.top_p for p in params],
        min_p=[p.min_p for p in params],
        repetition_penalty=[p.repetition_penalty for p in params],
        frequency_penalty=[p.frequency_penalty for p in params],
        presence_penalty=[p.presence_penalty for p in params],
        seed=seeds,
        position=[s.num_tokens for s in seqs],
        prompt_tokens=_flat_int32(prompt_chunks, prompt_off[-1]),
        prompt_offsets=prompt_off,
        output_tokens=_flat_int32(output_chunks, output_off[-1]),
        output_offsets=output_off,
        num_logprobs=[p.logprobs or 0 for p in params],
        # The sampled token's logprob and rank only for the requests that
        # report them (two passes over the row saved for the others).
        sampled_logprob=[p.logprobs is not None for p in params],
    )


def _apply_logit_rules(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """SamplingParams.logit_bias and allowed_token_ids, in place on each row."""
    vocab = logits.shape[1]
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.allowed_token_ids is not None:
            allowed = [t for t in p.allowed_token_ids if t < vocab]
            keep = logits[i, allowed].clone()
            logits[i] = float("-inf")
            logits[i, allowed] = keep
        if p.logit_bias:
            ids = [t for t in p.logit_bias if t < vocab]
            if ids:
                bias = torch.tensor([p.logit_bias[t] for t in ids], dtype=logits.dtype)
                logits[i, ids] += bias.to(logits.device)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Runs the block with torch's intra-op thread count set to ``n`` (None:
    unchanged), restoring the caller's setting afterwards."""
    before = torch.get_num_threads()
    if n is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _cuda_kernels_enabled() -> bool:
    from fastllm.layers import cuda_ops

    return cuda_ops.enabled()


def _top_logprobs(logits: torch.Tensor, counts: list[int]) -> list[list[tuple[int, float]]]:
    """Per row, the ``counts[r]`` largest raw logprobs as (id, logprob), ties by lower id."""
    out: list[list[tuple[int, float]]] = [[] for _ in counts]
    rows = [r for r, n in enumerate(counts) if n > 0]
    if not rows:
        return out
    x = logits[rows]
    x = torch.nan_to_num(
        x, nan=float("-inf"), posinf=torch.finfo(torch.float32).max, neginf=float("-inf")
    )
    lp = torch.log_softmax(x.double(), dim=-1)
    top = max(counts[r] for r in rows)
    values, ids = torch.sort(lp, dim=-1, descending=True, stable=True)
    values, ids = values[:, :top].float().cpu().tolist(), ids[:, :top].cpu().tolist()
    for j, r in enumerate(rows):
        n = counts[r]
        out[r] = list(zip(ids[j][:n], values[j][:n]))
    return out


def _flat_int32(chunks: list[list[int]], total: int) -> torch.Tensor:
    if total == 0:
        return _NO_PENALTY_TOKENS
    flat = np.fromiter((t for c in chunks for t in c), dtype=np.int32, count=total)
    return torch.from_numpy(flat)


def prompt_logprobs_of(
    logits: torch.Tensor, next_tokens: list[int], top_n: int
) -> list[dict[int, Logprob]]:
    """Logprob, rank and top-N of each next prompt token from its preceding row's
    logits, as the sampler reports a sampled token's (``_core.token_logprobs``:
    the raw row's log-softmax, rows in parallel in Rust)."""
    if not next_tokens:
        return []
    rows = logits[: len(next_tokens)].float().contiguous()
    out: list[dict[int, Logprob]] = []
    for tok, (lp, rank, top) in zip(
        next_tokens, _core.token_logprobs(rows, next_tokens, top_n), strict=True
    ):
        d = {tok: Logprob(lp, rank)}
        for k, (t, v) in enumerate(top):
            if t not in d:
                d[t] = Logprob(v, k + 1)
        out.append(d)
    return out

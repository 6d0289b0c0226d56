"""Decode cost per step when the KV cache holds long contexts.

Times whole decode steps of the model runner (every layer, paged attention
included, the LM head and the sampler) for a batch of sequences whose contexts are already
in the KV cache, at each context length, and prints the cost relative to the
shortest. The cache contents are zeros rather than a real prefill (attention
costs the same whatever the values), so a context of 4096 for 16 sequences is
measured in seconds instead of the minutes its prefill would take.

    PYTHONPATH=python python benches/long_context.py MODEL --batch 16 \\
        --contexts 128 4096 [--steps 5] [--dtype bfloat16] [--json FILE] \\
        [--kv-cache-dtype int8] [--quantization int8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fastllm import LLM
from fastllm.engine.model_runner import ModelRunner
from fastllm.engine.scheduler import ScheduledSeq, SchedulerOutput
from fastllm.engine.sequence import Sequence
from fastllm.sampling_params import SamplingParams


def _decoding_seq(token_ids: list[int], computed: int, tables: list[list[int]]) -> Sequence:
    """A sequence whose first ``computed`` tokens are in the cache, in one
    block table per layer group (``KVLayout``)."""
    seq = Sequence("bench", token_ids, SamplingParams(temperature=0), seed=0)
    seq.num_computed_tokens = computed
    seq.block_tables = tables
    seq.num_registered = [0] * len(tables)
    seq.num_freed = [0] * len(tables)
    return seq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--steps", type=int, default=5, help="timed decode steps per context")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto or int8")
    ap.add_argument("--quantization", default=None, help="weights: None, int8, int4, ...")
    args = ap.parse_args()

    longest = max(args.contexts) + args.steps + 2
    # The engine's own cache only needs one sequence: the runner below has its own.
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device="cpu",
        max_model_len=longest,
        max_num_seqs=1,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
    )
    engine = llm.llm_engine
    mc, bs = engine.model_config, engine.config.block_size
    layout = engine.runner.layout
    groups = layout.num_groups
    blocks_per_seq = -(-longest // bs)
    per_block = ModelRunner.block_bytes(
        layout.layers_per_block,
        mc.num_key_value_heads,
        mc.head_dim,
        bs,
        engine.dtype,
        args.kv_cache_dtype,
    )
    # A runner whose cache holds every sequence of the batch at the longest context.
    runner = ModelRunner(
        engine.runner.model,
        num_layers=mc.num_hidden_layers,
        num_kv_heads=mc.num_key_value_heads,
        head_size=mc.head_dim,
        num_blocks=args.batch * blocks_per_seq * groups,
        block_size=bs,
        dtype=engine.dtype,
        device=torch.device("cpu"),
        fuse_decoder=engine.loaded.fuse_decoder,
        layout=layout,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    for cache in runner.k_caches + runner.v_caches:
        cache.zero_()  # "prefilled" contexts: zeros, whatever the allocator gave
    print(
        f"batch {args.batch}, KV cache "
        f"{args.batch * blocks_per_seq * groups * per_block / 1e9:.2f} GB, "
        f"dtype {engine.dtype}, KV cache {runner.cache_dtype}"
    )
    vocab = mc.vocab_size
    results = []
    for ctx in args.contexts:
        seqs = [
            _decoding_seq(
                [(7 * i + j) % vocab for j in range(ctx + args.steps + 1)],
                ctx - 1,
                [
                    list(range(b0, b0 + blocks_per_seq))
                    for b0 in ((i * groups + g) * blocks_per_seq for g in range(groups))
                ],
            )
            for i in range(args.batch)
        ]
        times = []
        for step in range(args.steps + 1):  # the first step warms up
            sched = SchedulerOutput(
                scheduled=[
                    ScheduledSeq(s, 1, row=i, start=s.num_computed_tokens, num_samples=1)
                    for i, s in enumerate(seqs)
                ]
            )
            t0 = time.perf_counter()
            runner.run(sched)
            if step:
                times.append(time.perf_counter() - t0)
            for s in seqs:
                s.num_computed_tokens += 1
        med = statistics.median(times)
        results.append({"context": ctx, "step_s": med, "tokens_per_s": args.batch / med})
        print(f"context {ctx:>6}: {med * 1e3:8.1f} ms per step, {args.batch / med:7.1f} tokens/s")
    base = results[0]["step_s"]
    for r in results:
        r["relative_to_shortest"] = r["step_s"] / base
    print(
        "cost relative to context",
        results[0]["context"],
        ":",
        ", ".join(f"{r['context']}: {r['relative_to_shortest']:.2f}x" for r in results),
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"batch": args.batch, "dtype": str(engine.dtype), "results": results}, f, indent=2
            )


if __name__ == "__main__":
    main()

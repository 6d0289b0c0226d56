"""The CPU paged-attention kernel alone at long contexts, float and 8-bit caches.

For a Qwen2.5-0.5B-shaped layer (14 query heads, 2 KV heads, head size 64,
block size 16) it times ``_core.paged_attention`` on one sequence:

* prefill: a chunk of ``--chunk`` new tokens at the end of a context of
  ``C`` tokens (the last chunk of a ``C``-token prompt), for each ``C`` in
  ``--contexts``; GFLOP/s counts the causal multiply-adds (QK and PV).
* decode: one new token over a context of each length, for each batch size
  in ``--decode-batch`` (sequences with their own blocks), and the KV bytes
  it reads per second.

    PYTHONPATH=python python benches/attention_lengths.py \\
        [--contexts 2048 8192] [--chunk 2048] [--kv auto int8] [--decode-batch 1 16] \\
        [--dtype auto|bfloat16|float32]

``--dtype``: the queries' (and a float cache's) dtype; ``auto`` is the engine's
rule for ``dtype="auto"`` on this CPU (bfloat16 where bf16 is native, else
float32).

(threads: FASTLLM_NUM_THREADS, default all cores)
"""

from __future__ import annotations

import argparse
import time

import torch

from fastllm import _core
from fastllm.layers.attention_torch import quantize_rows

HEADS, KV_HEADS, HEAD, BLOCK = 14, 2, 64, 16


def time_call(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def bench(ctx: int, q_len: int, kv: str, batch: int = 1, dtype=torch.bfloat16) -> dict:
    """``batch`` sequences of ``ctx`` tokens, each with ``q_len`` new ones."""
    torch.manual_seed(0)
    per_seq = ctx // BLOCK + 1
    nb = per_seq * batch
    kc = torch.randn(nb, KV_HEADS, BLOCK, HEAD).to(dtype)
    vc = torch.randn(nb, KV_HEADS, BLOCK, HEAD).to(dtype)
    if kv == "int8":
        kc, vc = quantize_rows(kc), quantize_rows(vc)
    q = torch.randn(batch * q_len, HEADS, HEAD).to(dtype)
    out = torch.empty_like(q)
    tables = torch.arange(nb, dtype=torch.int32).view(batch, per_seq)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32) * q_len

    def call():
        _core.paged_attention(out, q, kc, vc, tables, seq_lens, qsl, HEAD**-0.5, 0, 0.0)

    s = time_call(call, 3 if q_len > 1 else 50)
    keys = batch * sum(ctx - q_len + i + 1 for i in range(q_len))
    elem = torch.finfo(dtype).bits // 8
    kv_bytes = batch * 2 * ctx * KV_HEADS * (HEAD + 4 if kv == "int8" else elem * HEAD)
    return {
        "context": ctx,
        "new_tokens": q_len,
        "batch": batch,
        "kv": kv,
        "ms": s * 1e3,
        "gflops": 4 * HEADS * HEAD * keys / s / 1e9,
        "kv_gbs": kv_bytes / s / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--kv", nargs="+", default=["auto", "int8"], choices=["auto", "int8"])
    ap.add_argument("--decode-batch", type=int, nargs="+", default=[1])
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    args = ap.parse_args()
    from fastllm.config import resolve_dtype

    dtype = resolve_dtype(args.dtype, "cpu", None)
    print(f"{_core.num_threads()} threads, {str(dtype).removeprefix('torch.')} queries")
    for kv in args.kv:
        for ctx in args.contexts:
            runs = [(min(args.chunk, ctx), 1)] + [(1, b) for b in args.decode_batch]
            for q_len, batch in runs:
                r = bench(ctx, q_len, kv, batch, dtype)
                print(
                    f"kv {kv:>4}  context {ctx:>6}  batch {batch:>3}  new tokens {q_len:>5}: "
                    f"{r['ms']:8.2f} ms  {r['gflops']:6.1f} GFLOP/s  KV read {r['kv_gbs']:5.1f} GB/s"
                )


if __name__ == "__main__":
    main()

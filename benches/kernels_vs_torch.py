"""Rust kernels and their torch equivalents, side by side in one process.

Each section times a fastllm kernel and the torch code that does the same job
on the same data, and prints the ratio ``rust / torch`` (below 1 means the Rust
kernel is faster). torch runs with as many threads as the Rust pool
(``FASTLLM_NUM_THREADS``, else the cores).

    PYTHONPATH=python python benches/kernels_vs_torch.py [--only attention] [--quick]

Sections are plain functions registered in ``SECTIONS``; add one by writing a
``bench_<name>(args)`` function and listing it there.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fastllm import _core


def time_pair(
    a: Callable[[], object], b: Callable[[], object], *, rounds: int = 7, min_time: float = 0.4
):
    """Seconds per call of ``a`` and ``b``: the fastest of ``rounds`` interleaved rounds.

    Interleaving and taking the fastest round keep the ratio fair on a machine
    shared with other work: both sides see the same background load.
    """

    def calls_per_round(fn):
        fn()
        start = time.perf_counter()
        fn()
        return max(1, int(min_time / rounds / max(time.perf_counter() - start, 1e-7)))

    counts = (calls_per_round(a), calls_per_round(b))
    best = [math.inf, math.inf]
    for _ in range(rounds):
        for i, (fn, n) in enumerate(zip((a, b), counts, strict=True)):
            start = time.perf_counter()
            for _ in range(n):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / n)
    return best[0], best[1]


def print_row(name: str, rust_s: float, torch_s: float) -> None:
    """One table row: both timings and the ratio."""
    print(f"{name:<44} {rust_s * 1e3:>10.3f} {torch_s * 1e3:>10.3f} {rust_s / torch_s:>8.2f}")


def print_header(title: str) -> None:
    """Section title and column names."""
    print(f"\n## {title}")
    print(f"{'case':<44} {'rust ms':>10} {'torch ms':>10} {'ratio':>8}")


def decode_attention_case(
    batch: int, ctx: int, dtype: torch.dtype, *, num_heads=14, num_kv_heads=2, head_size=64
):
    """Paged decode inputs (shuffled blocks) plus the same K/V laid out contiguously for SDPA."""
    block_size = 16
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = math.ceil(ctx / block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    block_tables = (
        torch.randperm(num_blocks, generator=gen).to(torch.int32).view(batch, blocks_per_seq)
    )
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    query = torch.randn(batch, num_heads, head_size, generator=gen).to(dtype)
    out = torch.empty_like(query)

    def contiguous(cache):
        # [batch, kv_heads, ctx, head_size], the layout SDPA wants.
        x = cache[block_tables.long()]  # [batch, blocks, kv_heads, block_size, head_size]
        x = x.permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, -1, head_size)
        return x[:, :, :ctx].contiguous()

    k, v = contiguous(key_cache), contiguous(value_cache)
    q4 = query.unsqueeze(2)  # [batch, heads, 1, head_size]
    scale = 1.0 / math.sqrt(head_size)

    def rust():
        _core.paged_attention(
            out, query, key_cache, value_cache, block_tables, seq_lens, qsl, scale
        )

    def torch_sdpa():
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

    return rust, torch_sdpa, out, query


def bench_attention(args: argparse.Namespace) -> None:
    """Decode attention (14 heads, 2 KV heads, head size 64) vs torch SDPA on contiguous K/V."""
    print_header(
        "decode attention: paged_attention vs scaled_dot_product_attention (contiguous K/V)"
    )
    batches = [1, 16] if args.quick else [1, 16, 64]
    ctxs = [128, 1024] if args.quick else [128, 1024, 4096]
    worst = 0.0
    for dtype in (torch.bfloat16, torch.float32):
        for batch in batches:
            for ctx in ctxs:
                rust, torch_sdpa, out, _ = decode_attention_case(batch, ctx, dtype)
                rust()
                want = torch_sdpa().squeeze(2)
                err = (out.float() - want.float()).abs().max().item()
                tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
                if err > tol:
                    raise SystemExit(f"mismatch batch={batch} ctx={ctx} {dtype}: max abs err {err}")
                rust_s, torch_s = time_pair(rust, torch_sdpa)
                worst = max(worst, rust_s / torch_s)
                name = f"{str(dtype).removeprefix('torch.')} batch={batch} ctx={ctx}"
                print_row(name, rust_s, torch_s)
    print(f"worst ratio: {worst:.2f} (target <= 1.2)")


SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {
    "attention": bench_attention,
}


def main() -> None:
    """Runs every section, or only the ones named with ``--only``."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(SECTIONS),
        help="run only this section (repeatable)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer, smaller cases")
    args = parser.parse_args()
    threads = _core.num_threads()
    torch.set_num_threads(threads)
    print(f"threads: rust {threads}, torch {torch.get_num_threads()}; torch {torch.__version__}")
    for name in args.only or list(SECTIONS):
        SECTIONS[name](args)


if __name__ == "__main__":
    main()

"""The packed-weight GEMM the model runs (``_core.PackedLinear``, per kernel
path) against torch's bf16 ``F.linear``, side by side.

Prints, for the benchmark model's matrix products (Qwen2.5-0.5B shapes) and
several M (rows of x: sequences in a decode step), the time per call and the
GB/s of bf16 weights streamed by each, and the STREAM-triad bandwidth measured
on the same machine (the bound for M = 1). Each shape is run over enough
copies of its weights (> 512 MB in all) that they come from DRAM, not from
the last-level cache, as in a real decode step. Rust and torch alternate
within every repeat and the medians are reported, so that load from other
processes hits both alike.

    PYTHONPATH=python python benches/gemm_vs_torch.py [--ms 1,4,16,64] [--repeats 5] [--threads N]
        [--paths avx512,avx2] [--shapes qkv,o_proj,gate_up,down,lm_head]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from fastllm import _core

SHAPES = [  # name, N (out_features), K (in_features), has bias
    ("qkv", 1152, 896, True),
    ("o_proj", 896, 896, False),
    ("gate_up", 9728, 896, False),
    ("down", 896, 4864, False),
    ("lm_head", 151936, 896, False),
]


def time_calls(fn, weights, x, biases) -> float:
    """Seconds per call, one call per copy of the weights."""
    t0 = time.perf_counter()
    for w, b in zip(weights, biases):
        fn(x, w, b)
    return (time.perf_counter() - t0) / len(weights)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,4,16,64", help="comma-separated M values")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--min-bytes", type=int, default=512 << 20, help="weights per shape")
    ap.add_argument(
        "--paths", default="", help="GEMM paths to time (default: gemm_default_path())"
    )
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument(
        "--threads", type=int, default=None, help="threads for both (default: FASTLLM_NUM_THREADS)"
    )
    args = ap.parse_args()
    if args.threads:
        # Read by the Rust pool when it first runs a kernel: set before any call.
        os.environ["FASTLLM_NUM_THREADS"] = str(args.threads)
    ms = [int(v) for v in args.ms.split(",")]
    threads = _core.num_threads()
    torch.set_num_threads(threads)
    paths = [p for p in args.paths.split(",") if p in _core.gemm_paths()]
    paths = paths or [_core.gemm_default_path()]
    print(
        f"threads={threads}  rust paths={paths}  torch {torch.__version__}  "
        f"default path: {_core.gemm_default_path()}"
    )
    triads = [_core.stream_triad_gbs(200_000_000, 3) for _ in range(3)]
    triad = statistics.median(triads)
    print(
        f"STREAM triad (3 x 200 MB f32, {threads} threads): median {triad:.1f} GB/s "
        f"(runs: {', '.join(f'{t:.1f}' for t in triads)})"
    )

    def torch_linear(x, w, b):
        return torch.nn.functional.linear(x, w, b)

    # One PackedLinear per path and copy of the weights, built per shape below.
    packed: dict[tuple[str, int], object] = {}

    def packed_linear(path):
        def call(x, w, b):
            layer = packed[(path, id(w))]
            out = torch.empty(x.shape[0], layer.out_features, dtype=x.dtype)
            layer.forward(out, x)
            return out

        return call

    fns = {p: packed_linear(p) for p in paths}
    fns["torch"] = torch_linear
    cols = "".join(f" | {p[:10]:>10} ms  GB/s %triad" for p in fns)
    header = f"{'shape':8} {'N':>6} {'K':>5} {'M':>3}{cols} | torch/rust | spread"
    print(header)
    print("-" * len(header))
    crossover: dict[str, int | None] = {}
    wanted = set(args.shapes.split(","))
    for name, n, k, has_bias in SHAPES:
        if name not in wanted:
            continue
        nbytes = n * k * 2
        copies = max(1, -(-args.min_bytes // nbytes))
        g = torch.Generator().manual_seed(0)
        weights = [
            (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16) for _ in range(copies)
        ]
        biases = [
            torch.randn(n, generator=g).to(torch.bfloat16) if has_bias else None
            for _ in range(copies)
        ]
        packed.clear()
        packed.update(
            {
                (p, id(w)): _core.PackedLinear(w, b, path=p)
                for p in paths
                for w, b in zip(weights, biases)
            }
        )
        crossover[name] = None
        for m in ms:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            # Same answer before timing: a benchmark of a wrong kernel is worthless.
            b0 = None if biases[0] is None else biases[0].float()
            ref = torch.nn.functional.linear(x.float(), weights[0].float(), b0)
            for p in paths:
                got = fns[p](x, weights[0], biases[0]).float()
                assert torch.allclose(got, ref, rtol=2**-7, atol=1e-2), f"{name} M={m} {p}"
            times: dict[str, list[float]] = {p: [] for p in fns}
            for rep in range(args.repeats + 1):  # the first round warms up
                for p, fn in fns.items():
                    t = time_calls(fn, weights, x, biases)
                    if rep:
                        times[p].append(t)
            med = {p: statistics.median(v) for p, v in times.items()}
            spread = max((max(v) - min(v)) / med[p] for p, v in times.items())
            row = "".join(
                f" | {med[p] * 1e3:13.3f} {nbytes / med[p] / 1e9:5.1f} {nbytes / med[p] / 1e9 / triad:6.0%}"
                for p in fns
            )
            best_rust = min(med[p] for p in paths)
            print(
                f"{name:8} {n:6} {k:5} {m:3}{row} | {med['torch'] / best_rust:9.2f}x | {spread:5.0%}"
            )
            if med["torch"] < best_rust and crossover[name] is None:
                crossover[name] = m
        packed.clear()
        del weights, biases
    print()
    print("crossover (smallest M at which torch is faster; None: Rust faster at every M tried):")
    for name, m in crossover.items():
        print(f"  {name:8} {m}")
    print("spread = largest (max - min) / median over the repeats of any column: the noise.")


if __name__ == "__main__":
    main()

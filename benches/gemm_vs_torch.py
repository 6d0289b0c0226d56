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

``--vs-fp32`` compares against torch's float32 ``F.linear`` instead (float32 x
and weights: torch's best dtype on a CPU without native bf16 arithmetic) and
times each path twice, on bf16 weights with bf16 x (the model's case) and on
f32 weights with f32 x, printing GFLOP/s and torch's time over the kernel's
(> 1: the packed GEMM is faster). To compare with torch on an AVX2-only CPU
from a machine with AVX-512, limit torch's kernels with
``ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2``
and check that torch's column drops against an unrestricted run. Use a small
``--min-bytes`` there (e.g. 33554432): at M >= 16 the calls are compute-bound.
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
    ap.add_argument("--paths", default="", help="GEMM paths to time (default: gemm_default_path())")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument(
        "--threads", type=int, default=None, help="threads for both (default: FASTLLM_NUM_THREADS)"
    )
    ap.add_argument(
        "--vs-fp32",
        action="store_true",
        help="against torch float32 F.linear; each path on bf16 and on f32 weights, GFLOP/s",
    )
    args = ap.parse_args()
    if args.vs_fp32:
        vs_fp32(args)
        return
    ms, threads, paths = _setup(args)
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


def _setup(args) -> tuple[list[int], int, list[str]]:
    """(row counts, threads, Rust paths) of a run; sets the kernels' threads."""
    if args.threads:
        # Read by the Rust pool when it first runs a kernel: set before any call.
        os.environ["FASTLLM_NUM_THREADS"] = str(args.threads)
    ms = [int(v) for v in args.ms.split(",")]
    threads = _core.num_threads()
    torch.set_num_threads(threads)
    paths = [p for p in args.paths.split(",") if p in _core.gemm_paths()]
    return ms, threads, paths or [_core.gemm_default_path()]


def vs_fp32(args) -> None:
    """The ``--vs-fp32`` table: GFLOP/s of each path on bf16 and f32 weights
    and of torch's float32 ``F.linear``, with torch's time over each."""
    ms, threads, paths = _setup(args)
    isa_env = {v: os.environ.get(v) for v in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")}
    print(
        f"threads={threads}  rust paths={paths}  torch {torch.__version__} "
        f"(capability {torch.backends.cpu.get_cpu_capability()}, {isa_env})"
    )
    cols = [(p, wd) for p in paths for wd in ("bf16", "f32")]
    names = [f"{p}/{wd}" for p, wd in cols] + ["torch fp32"]
    head = "".join(f" | {c[:14]:>14} GF/s" for c in names)
    ratios = "".join(f" | {c[:14]:>14}" for c in names[:-1])
    header = f"{'shape':8} {'N':>6} {'K':>5} {'M':>4}{head}{ratios} | spread"
    print("GFLOP/s; then torch fp32 time / kernel time per column (> 1: kernel faster)")
    print(header)
    print("-" * len(header))
    wanted = set(args.shapes.split(","))
    for name, n, k, has_bias in SHAPES:
        if name not in wanted:
            continue
        copies = max(1, -(-args.min_bytes // (n * k * 4)))
        g = torch.Generator().manual_seed(0)
        w32 = [torch.randn(n, k, generator=g) / k**0.5 for _ in range(copies)]
        w32 = [w.to(torch.bfloat16).float() for w in w32]  # same values in both dtypes
        b32 = [torch.randn(n, generator=g) if has_bias else None for _ in range(copies)]
        packed = {
            (p, wd): [
                _core.PackedLinear(w.to(torch.bfloat16) if wd == "bf16" else w, b, path=p)
                for w, b in zip(w32, b32)
            ]
            for p, wd in cols
        }
        for m in ms:
            x32 = torch.randn(m, k, generator=g).to(torch.bfloat16).float()
            xs = {"bf16": x32.to(torch.bfloat16), "f32": x32}
            outs = {wd: torch.empty(m, n, dtype=x.dtype) for wd, x in xs.items()}
            ref = torch.nn.functional.linear(x32, w32[0], b32[0])
            for p, wd in cols:
                packed[(p, wd)][0].forward(outs[wd], xs[wd])
                assert torch.allclose(outs[wd].float(), ref, rtol=2**-7, atol=1e-2), (
                    f"{name} M={m} {p} {wd}"
                )

            def rust(p, wd, packed=packed, xs=xs, outs=outs):
                layers, x, out = packed[(p, wd)], xs[wd], outs[wd]

                def call():
                    for layer in layers:
                        layer.forward(out, x)

                return call

            def torch_fp32(w32=w32, b32=b32, x32=x32):
                for w, b in zip(w32, b32):
                    torch.nn.functional.linear(x32, w, b)

            fns = {f"{p}/{wd}": rust(p, wd) for p, wd in cols}
            fns["torch fp32"] = torch_fp32
            times: dict[str, list[float]] = {c: [] for c in fns}
            for rep in range(args.repeats + 1):  # the first round warms up
                for c, fn in fns.items():
                    # Let the other side's spinning threads (the Rust team's,
                    # torch's OpenMP workers) go to sleep first, and time at
                    # least 20 ms of calls.
                    time.sleep(0.01)
                    calls, t0 = 0, time.perf_counter()
                    while True:
                        fn()
                        calls += copies
                        t = time.perf_counter() - t0
                        if t > 0.02:
                            break
                    if rep:
                        times[c].append(t / calls)
            med = {c: statistics.median(v) for c, v in times.items()}
            spread = max((max(v) - min(v)) / med[c] for c, v in times.items())
            flops = 2 * m * n * k
            row = "".join(f" | {flops / med[c] / 1e9:19.1f}" for c in names)
            row += "".join(f" | {med['torch fp32'] / med[c]:13.2f}x" for c in names[:-1])
            print(f"{name:8} {n:6} {k:5} {m:4}{row} | {spread:5.0%}", flush=True)
        del packed, w32, b32
    print("spread = largest (max - min) / median over the repeats of any column: the noise.")


if __name__ == "__main__":
    main()

"""Times the packed GEMM (``_core.PackedLinear``, bf16) on every projection of the
benchmark model (Qwen2.5-0.5B shapes) at M = 1, 64 and 128 rows, median of
repeats, and prints microseconds as JSON.

Run it once per build to compare two builds side by side, alternating, e.g.
``PYTHONPATH=old/python python benches/gemm_shapes.py --path avx2`` then the
same with the new build; divide the figures.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from fastllm import _core

SHAPES = {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 9728), "down": (4864, 896)}
SHAPES["lm_head"] = (896, 151936)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", default=None, help="kernel path (one of _core.gemm_paths())")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 128])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="projections to time")
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, (k, n) in SHAPES.items():
        if name not in args.shapes:
            continue
        w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
        packed = _core.PackedLinear(w, None, path=args.path)
        for m in args.rows:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            y = torch.empty(m, n, dtype=torch.bfloat16)
            reps = 200 if m == 1 and name != "lm_head" else 20
            for _ in range(5):
                packed.forward(y, x)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                packed.forward(y, x)
                times.append(time.perf_counter() - t0)
            times.sort()
            out[f"{name}/M{m}"] = round(times[len(times) // 2] * 1e6, 1)
    print(json.dumps({"path": packed.path, "us": out}))


if __name__ == "__main__":
    main()

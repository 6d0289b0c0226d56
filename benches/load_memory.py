"""Peak memory and time of loading a folder with ``quantization=``: the
loader quantizing each linear layer as it reads it (what ``LLM`` does)
against reading the whole float model first and quantizing it after (the
loader called without ``quantization``, then ``prepare_for_kernels``).

    PYTHONPATH=python python benches/load_memory.py FOLDER [--quantization int4]
        [--rounds 2]

Each load runs in a fresh process, the two ways alternating. Reported: the
load's wall time, the process's peak anonymous memory (``RssAnon`` of
``/proc/self/status`` sampled every 20 ms: what the process itself holds,
torch and Python included) and its peak RSS (``ru_maxrss``, which also
counts the safetensors files' mapped pages: clean page cache the kernel can
drop). Linux only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, threading, time
sys.path.insert(0, "python")
from fastllm import loading
from fastllm.config import EngineConfig

folder, quantization, way = sys.argv[1:4]
if way == "whole":
    original = loading.FolderSource.load_weights

    def whole(self, mc, dtype, device, quantization=None):
        return original(self, mc, dtype, device, None)  # quantized afterwards

    loading.FolderSource.load_weights = whole
peak, done = [0.0], threading.Event()

def sample():
    while not done.is_set():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon"):
                    peak[0] = max(peak[0], int(line.split()[1]) / 2**20)
        time.sleep(0.02)

thread = threading.Thread(target=sample, daemon=True)
thread.start()
start = time.perf_counter()
loading.load(EngineConfig(model=folder, quantization=quantization, skip_tokenizer_init=True), "cpu")
seconds = time.perf_counter() - start
done.set()
thread.join()
print(json.dumps({
    "seconds": seconds,
    "anon_gib": peak[0],
    "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder")
    p.add_argument("--quantization", default="int4")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    rows: dict[str, list[dict]] = {"whole": [], "streamed": []}
    for _ in range(args.rounds):
        for way in rows:
            cmd = [sys.executable, "-c", CHILD, args.folder, args.quantization, way]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows[way].append(json.loads(out.strip().splitlines()[-1]))
    print(f"{args.folder}, quantization={args.quantization}, {args.rounds} rounds")
    print("| load | peak anonymous memory | peak RSS (file pages too) | load time |")
    print("|---|---|---|---|")
    names = {"whole": "whole float model, then quantized", "streamed": "quantized as read"}
    for way, runs in rows.items():
        anon = "-".join(sorted({f"{r['anon_gib']:.2f}" for r in runs}))
        rss = "-".join(sorted({f"{r['rss_gib']:.2f}" for r in runs}))
        secs = "-".join(f"{r['seconds']:.1f}" for r in sorted(runs, key=lambda r: r["seconds"]))
        print(f"| {names[way]} | {anon} GiB | {rss} GiB | {secs} s |")


if __name__ == "__main__":
    main()

"""Load time of GGUF files: fastllm against llama.cpp on the same file.

For each file, alternating rounds of

  llama.cpp  ``llama-completion -m FILE -n 1 -p hi -no-cnv --no-warmup -t T``: the
             "load time" llama.cpp itself reports (model and context set up, the
             weights mapped and, for the formats it repacks, repacked);
  fastllm    ``LLM(FILE, max_model_len=L)`` timed in a fresh process after its imports,
             the modules it loads lazily included (header check, config, tokenizer,
             every tensor repacked or copied into the kernels' layout, or mapped
             from its packed-weight cache, KV cache allocated);

each in its own process, the file already in the page cache (one untimed run of each
first). Prints the medians and fastllm / llama.cpp (below 1: fastllm loads faster).

fastllm caches a GGUF file's packed weights after its first load
(``fastllm/gguf/cache.py``), so the untimed run writes the cache and the timed ones
map it: the time of every load after the first. ``--no-cache`` times the first
load instead (``FASTLLM_GGUF_CACHE=0``: every tensor repacked).

llama.cpp maps the file and reads most weights only when the first token needs them,
so its "load time" leaves that reading out; fastllm's includes it. ``--first-token``
adds one prompt token's run to both sides, which counts the reading on both.

    flock /work/bench.lock python benches/gguf_load.py \\
        --llama-completion /work/llamacpp/build/bin/llama-completion \\
        /work/benchmodels/gguf/qwen2-0.5b-random-{q8_0,q4_0}.gguf
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

FASTLLM = """
import sys, time
# Imports are not part of the load (llama.cpp's code is linked before it
# starts): the modules LLM() and generate() import on first use come first.
import fastllm, torch, numpy, tokenizers, jinja2, tqdm
import fastllm.engine.llm_engine, fastllm.engine.model_runner, fastllm.engine.scheduler
import fastllm.gguf.loader, fastllm.gguf.tokenizer, fastllm.gguf.config
import fastllm.models.llama, fastllm.outputs, fastllm.tokenizer
from fastllm import LLM, SamplingParams
t = time.perf_counter()
llm = LLM(sys.argv[1], max_model_len=int(sys.argv[2]))
if sys.argv[3] == "1":
    llm.generate([{"prompt_token_ids": [1]}], SamplingParams(max_tokens=1), use_tqdm=False)
print("SECONDS", time.perf_counter() - t)
"""


def run_llama(args: argparse.Namespace, path: str) -> float:
    cmd = [args.llama_completion, "-m", path, "-n", "1", "-p", "hi", "-no-cnv", "-t"]
    cmd += [str(args.threads), "-c", str(args.max_model_len)]
    if not args.first_token:
        cmd.append("--no-warmup")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    m = re.search(r"load time\s*=\s*([\d.]+) ms", text)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"llama-completion failed (rc {out.returncode}):\n{text[-2000:]}")
    seconds = float(m.group(1)) / 1000
    if args.first_token:
        m = re.search(r"prompt eval time\s*=\s*([\d.]+) ms", text)
        seconds += float(m.group(1)) / 1000 if m else 0.0
    return seconds


def run_fastllm(args: argparse.Namespace, path: str) -> float:
    env = dict(os.environ, FASTLLM_NUM_THREADS=str(args.threads))
    if args.no_cache:
        env["FASTLLM_GGUF_CACHE"] = "0"
    cmd = [
        args.python,
        "-c",
        FASTLLM,
        path,
        str(args.max_model_len),
        "1" if args.first_token else "0",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    m = re.search(r"SECONDS ([\d.]+)", out.stdout)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"fastllm failed (rc {out.returncode}):\n{out.stderr[-2000:]}")
    return float(m.group(1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("files", nargs="+", help="GGUF files")
    p.add_argument("--llama-completion", required=True, metavar="PATH")
    p.add_argument("--python", default=sys.executable, help="interpreter that imports fastllm")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--first-token", action="store_true", help="include one prompt token's run")
    p.add_argument(
        "--no-cache", action="store_true", help="time fastllm's first load (no packed-weight cache)"
    )
    args = p.parse_args(argv)
    print(f"{'file':40s} {'llama.cpp s':>12s} {'fastllm s':>10s} {'ratio':>6s}")
    for path in args.files:
        run_llama(args, path)
        run_fastllm(args, path)  # page cache warm, both sides
        llama, ours = [], []
        for rep in range(args.repeats):
            order = (run_llama, run_fastllm) if rep % 2 == 0 else (run_fastllm, run_llama)
            for fn in order:
                (llama if fn is run_llama else ours).append(fn(args, path))
        a, b = statistics.median(llama), statistics.median(ours)
        print(f"{os.path.basename(path):40s} {a:12.3f} {b:10.3f} {b / a:6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Batched decode, fastllm against llama.cpp's ``llama-batched-bench`` on the same GGUF file.

B sequences, each a P-token prompt (distinct random token ids) and G generated
tokens. Both sides report the prefill speed (B x P prompt tokens over the time
to prefill them) and the decode speed (B x G generated tokens over the time
the generation took, after the prefill):

  llama.cpp  ``llama-batched-bench -m FILE -c CTX -b 2048 -ub 512 -npp P -ntg G
             -npl B -t T``: its S_PP and S_TG columns.
  fastllm    ``LLM(FILE, enable_prefix_caching=False)`` (each run prefills its
             prompts anew): ``generate`` of the B prompts with ``max_tokens=1``
             (the prefill, with one sampled token each), then with
             ``max_tokens=G+1`` (ignore_eos, greedy); decode = B x G / (the
             second time - the first).

Each side runs as its own subprocess, alternately, ``--repeats`` times; the
table shows the medians and fastllm / llama.cpp. Run it on an idle machine.

    python benches/batched_vs_llama_cpp.py FILE.gguf \\
        --llama-batched-bench /work/llamacpp/build/bin/llama-batched-bench -B 16 -P 128 -G 64
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

FASTLLM = r"""
import json, random, sys, time
from fastllm import LLM, SamplingParams
path, b, p, g, threads = sys.argv[1], *map(int, sys.argv[2:6])
llm = LLM(model=path, max_model_len=p + g + 8, max_num_seqs=b,
          max_num_batched_tokens=max(2048, p), enable_prefix_caching=False)
rng = random.Random(0)
vocab = llm.llm_engine.model_config.vocab_size
prompts = [{"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(p)]} for _ in range(b)]
def run(n):
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == n for o in outs)
    return time.perf_counter() - t
run(2)  # warm-up
t1, tn = run(1), run(g + 1)
print(json.dumps({"pp": b * p / t1, "tg": b * g / (tn - t1)}))
"""


def fastllm(args: argparse.Namespace) -> dict[str, float]:
    cmd = [args.python, "-c", FASTLLM, args.file, str(args.B), str(args.P), str(args.G)]
    cmd.append(str(args.threads))
    env = {"FASTLLM_NUM_THREADS": str(args.threads), "OMP_NUM_THREADS": str(args.threads)}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, **env})
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_cpp(args: argparse.Namespace) -> dict[str, float]:
    ctx = args.B * (args.P + args.G) + 256
    cmd = [args.llama_batched_bench, "-m", args.file, "-c", str(ctx), "-b", "2048"]
    cmd += ["-ub", "512", "-npp", str(args.P), "-ntg", str(args.G), "-npl", str(args.B)]
    cmd += ["-t", str(args.threads), *args.llama_arg]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and all(re.fullmatch(r"[\d.]+", c) for c in cells[:8]):
            return {"pp": float(cells[5]), "tg": float(cells[7])}
    raise SystemExit(f"no result row in llama-batched-bench's output:\n{out.stdout}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file", help="GGUF file both sides load")
    p.add_argument("--llama-batched-bench", required=True, metavar="PATH")
    p.add_argument("-B", type=int, default=16, help="sequences")
    p.add_argument("-P", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("-G", type=int, default=64, help="generated tokens per sequence")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--llama-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"llama.cpp": [], "fastllm": []}
    for r in range(args.repeats):
        order = [("llama.cpp", llama_cpp), ("fastllm", fastllm)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            runs[name].append(fn(args))
            print(name, runs[name][-1], file=sys.stderr)
    med = {
        name: {k: statistics.median(x[k] for x in rs) for k in ("pp", "tg")}
        for name, rs in runs.items()
    }
    print(f"{args.file}: {args.B} sequences x {args.P} prompt + {args.G} generated tokens")
    print(f"{'':10} {'prefill t/s':>12} {'decode t/s':>12}")
    for name in ("llama.cpp", "fastllm"):
        print(f"{name:10} {med[name]['pp']:12.1f} {med[name]['tg']:12.1f}")
    ratio = {k: med["fastllm"][k] / med["llama.cpp"][k] for k in ("pp", "tg")}
    print(f"{'ratio':10} {ratio['pp']:11.2f}x {ratio['tg']:11.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "median": med, "ratio": ratio}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

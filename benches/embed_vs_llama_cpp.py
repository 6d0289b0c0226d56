"""Embedding throughput of fastllm's pooling engine against llama.cpp's on the
same weights, on the CPU, in one run.

llama.cpp: ``llama-bench -m GGUF -embd 1 -p P -n 0 -t T -r 3 -o json`` (one
sequence of P tokens through the model in embedding mode, its pooling
included; tokens/s). fastllm: ``LLM(FOLDER_OR_GGUF, runner="pooling")``
embedding one input of P token ids at a time (``llm.embed([{"prompt_token_ids":
ids}])``), best of ``--repeats`` after a warm-up; tokens/s. Both sides run
alternately in every repeat (llama-bench as a subprocess), and the table shows
the medians, with ratio = fastllm / llama.cpp (above 1: fastllm is faster).

    python benches/embed_vs_llama_cpp.py --llama-bench /work/llamacpp/build/bin/llama-bench \\
        --gguf bench-models/gguf/qwen3-embed-random-bf16.gguf \\
        --model bench-models/qwen3-embed-random [--dtype bfloat16] [--lengths 128,512]

``--model`` is what fastllm loads: the GGUF file itself (the same file on both
sides: a ``bert`` or ``nomic-bert`` encoder, or a decoder embedder), or the
Hugging Face folder it was converted from (the same weights). Make the GGUF
file with ``MODEL=FOLDER benches/build_llama_cpp.sh convert``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time


def llama_tps(binary: str, gguf: str, length: int, threads: int) -> float:
    """llama-bench's tokens/s of one ``length``-token prompt in embedding mode."""
    cmd = [binary, "-m", gguf, "-embd", "1", "-p", str(length), "-n", "0"]
    cmd += ["-t", str(threads), "-r", "3", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    return float(rows[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--lengths", default="128,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from fastllm import LLM

    kw = dict(runner="pooling", dtype=args.dtype, enable_prefix_caching=False)
    if args.quantization:
        kw["quantization"] = args.quantization
    llm = LLM(args.model, **kw)
    vocab = llm.get_tokenizer().vocab_size

    def fastllm_tps(length: int) -> float:
        # Ids past the first 100 (no special tokens), the same every call.
        ids = [100 + (i * 7919) % (vocab - 100) for i in range(length)]
        llm.embed([{"prompt_token_ids": ids}], use_tqdm=False)
        best = 0.0
        for _ in range(3):
            t = time.perf_counter()
            llm.embed([{"prompt_token_ids": ids}], use_tqdm=False)
            best = max(best, length / (time.perf_counter() - t))
        return best

    lengths = [int(x) for x in args.lengths.split(",")]
    figures: dict[int, dict[str, list[float]]] = {n: {"llama": [], "fastllm": []} for n in lengths}
    for r in range(args.repeats):
        for n in lengths:
            sides = [("llama", lambda n=n: llama_tps(args.llama_bench, args.gguf, n, args.threads))]
            sides.append(("fastllm", lambda n=n: fastllm_tps(n)))
            for name, fn in sides if r % 2 == 0 else sides[::-1]:
                figures[n][name].append(fn())
    print(f"fastllm: {args.model} ({args.dtype}, {args.quantization or 'no quantization'})")
    print(f"llama.cpp: {args.gguf}, {args.threads} threads")
    print(f"{'tokens':>7s} {'llama.cpp t/s':>14s} {'fastllm t/s':>12s} {'ratio':>7s}")
    for n in lengths:
        a = statistics.median(figures[n]["llama"])
        b = statistics.median(figures[n]["fastllm"])
        print(f"{n:7d} {a:14.1f} {b:12.1f} {b / a:6.2f}x")


if __name__ == "__main__":
    main()

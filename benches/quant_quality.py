"""What quantization costs in quality: perplexity and the KL divergence of
each quantized model's next-token distributions from the float model's, on
real text, for every format.

    PYTHONPATH=python python benches/quant_quality.py [MODEL] [--tokens 4000]
        [--text FILE ...] [--formats q8_0,q4_0,iq4_nl]

MODEL defaults to the embedded demo model (trained on Python's standard
library), and the text to modules of the standard library, which it has
learned. The KL divergence is the finer measure: perplexity moves only once
the distributions move a lot. ``quantization="int4"`` names the 4-bit format
of the smaller perplexity loss here (docs/quantization.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch

from fastllm import LLM, SamplingParams
from fastllm.demo import demo_model_path

# Modules of the standard library (text the demo model has seen).
DEFAULT_TEXTS = ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "heapq.py")


def _texts(paths: list[str] | None) -> list[str]:
    if paths:
        names = paths
    else:
        lib = os.path.dirname(os.__file__)
        names = [os.path.join(lib, n) for n in DEFAULT_TEXTS]
    out = []
    for p in names:
        with open(p, encoding="utf-8") as f:
            out.append(f.read())
    return out


def prompt_logprobs(llm: LLM, chunks: list[list[int]], top: int) -> list[list[dict[int, float]]]:
    """Per chunk and position, the top-``top`` logprobs and the actual token's."""
    outs = llm.generate(
        [{"prompt_token_ids": c} for c in chunks],
        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=top),
        use_tqdm=False,
    )
    return [
        [{t: lp.logprob for t, lp in entry.items()} for entry in o.prompt_logprobs[1:]]
        for o in outs
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--text", nargs="*", default=None, help="text files (default: stdlib)")
    ap.add_argument("--tokens", type=int, default=4000, help="tokens of text to score")
    ap.add_argument("--chunk", type=int, default=500, help="tokens per scored sequence")
    ap.add_argument("--top", type=int, default=20, help="logprobs per position for the KL")
    ap.add_argument("--formats", default="q8_0,q4_0,iq4_nl")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = args.model or demo_model_path()
    base = LLM(model, max_logprobs=args.top)
    tok = base.get_tokenizer()
    ids: list[int] = []
    for text in _texts(args.text):
        ids += tok.encode(text)
        if len(ids) >= args.tokens:
            break
    ids = ids[: args.tokens]
    chunks = [ids[i : i + args.chunk] for i in range(0, len(ids), args.chunk)]
    chunks = [c for c in chunks if len(c) > 1]

    def score(llm: LLM) -> tuple[list[list[dict[int, float]]], float]:
        lps = prompt_logprobs(llm, chunks, args.top)
        actual = [pos[t] for c, chunk in zip(lps, chunks) for pos, t in zip(c, chunk[1:])]
        return lps, math.exp(-sum(actual) / len(actual))

    ref, ref_ppl = score(base)
    del base
    rows = [{"format": "float", "perplexity": ref_ppl, "kl": 0.0}]
    for fmt in args.formats.split(","):
        lps, ppl = score(LLM(model, quantization=fmt, max_logprobs=args.top))
        # KL(float || quantized) over the float model's top tokens (the rest
        # of the mass is lumped together), averaged over positions.
        kls = []
        for rc, qc in zip(ref, lps):
            for rp, qp in zip(rc, qc):
                top = sorted(rp, key=rp.get, reverse=True)[: args.top]
                p = torch.tensor([math.exp(rp[t]) for t in top])
                q = torch.tensor([math.exp(qp.get(t, min(qp.values()))) for t in top])
                p_rest, q_rest = max(1 - float(p.sum()), 1e-9), max(1 - float(q.sum()), 1e-9)
                kl = float((p * (p.log() - q.clamp_min(1e-12).log())).sum())
                kls.append(kl + p_rest * math.log(p_rest / q_rest))
        rows.append({"format": fmt, "perplexity": ppl, "kl": sum(kls) / len(kls)})
    print(f"{len(ids)} tokens of text, model {model}")
    print(f"{'format':>8} {'perplexity':>11} {'vs float':>9} {'KL (nats)':>10}")
    for r in rows:
        print(
            f"{r['format']:>8} {r['perplexity']:11.3f} {r['perplexity'] / ref_ppl:9.4f} "
            f"{r['kl']:10.5f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()

"""Documents per second of one embedding model: fastllm's pooling engine
(float, bf16 where the CPU has it, int8) against sentence-transformers
(float32 and bfloat16) on the same folder and the same documents, in one run,
with the cosine agreement of the two float32 embeddings.

Usage: python benches/embed_vs_sentence_transformers.py FOLDER [--docs 256]
         [--min-tokens 32] [--max-tokens 512] [--batch-size 32] [--skip-st]
FOLDER: e.g. bench-models/bert-base-random or bench-models/qwen3-embed-random
(benches/make_bench_model.py --models=bert-base,qwen3-embed). Needs
sentence-transformers (the test extra has it).
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import sysconfig
import time


def documents(tokenizer, n: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    """``n`` texts of ``lo``..``hi`` tokens each, cut from the standard library's sources."""
    rng = random.Random(seed)
    text = ""
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:40]:
        with open(path, encoding="utf-8", errors="ignore") as f:
            text += f.read()
    ids = tokenizer.encode(text, add_special_tokens=False)
    docs = []
    for _ in range(n):
        k = rng.randint(lo, hi) - 2  # room for the special tokens
        start = rng.randint(0, len(ids) - k - 1)
        docs.append(tokenizer.decode(ids[start : start + k]))
    return docs


def timed(fn, docs: list[str], repeats: int = 2) -> tuple[float, object]:
    """Best documents per second of ``fn(docs)`` over ``repeats`` runs (after a warm-up)."""
    fn(docs[:8])
    best, out = 0.0, None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn(docs)
        best = max(best, len(docs) / (time.perf_counter() - t))
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--docs", type=int, default=256)
    ap.add_argument("--min-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--skip-st", action="store_true")
    args = ap.parse_args()

    import torch

    from fastllm import LLM
    from fastllm.config import cpu_has_native_bf16

    rows = []
    # No prefix cache: every timed run embeds the same documents, and a decoder
    # embedder would otherwise compute only their last tokens after the first.
    cold = dict(runner="pooling", enable_prefix_caching=False)
    llm = LLM(args.folder, dtype="float32", **cold)
    docs = documents(llm.get_tokenizer(), args.docs, args.min_tokens, args.max_tokens)
    ntok = sum(len(llm.get_tokenizer().encode(d)) for d in docs)
    print(
        f"{args.folder}: {len(docs)} documents, {ntok} tokens, torch threads {torch.get_num_threads()}"
    )

    def fastllm_embed(model):
        return lambda d: [o.outputs.embedding for o in model.embed(d, use_tqdm=False)]

    rate, ours = timed(fastllm_embed(llm), docs)
    rows.append(("fastllm float32", rate))
    del llm
    # int8 weights with the activations in the faster float type of this CPU.
    native_bf16 = cpu_has_native_bf16()
    act = "bfloat16" if native_bf16 else "float32"
    variants = [(f"int8 ({act})", dict(dtype=act, quantization="int8"))]
    if native_bf16:
        variants.insert(0, ("bfloat16", dict(dtype="bfloat16")))
    for name, kw in variants:
        m = LLM(args.folder, **cold, **kw)
        rows.append((f"fastllm {name}", timed(fastllm_embed(m), docs)[0]))
        del m
    if not args.skip_st:
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(args.folder, device="cpu")

        def st_embed(d):
            return st.encode(d, batch_size=args.batch_size, convert_to_tensor=True)

        rate, theirs = timed(st_embed, docs)
        rows.append(("sentence-transformers float32", rate))
        cos = torch.nn.functional.cosine_similarity(torch.tensor(ours), theirs.float(), dim=1)
        print(f"cosine fastllm vs sentence-transformers (float32): min {cos.min().item():.6f}")
        st = st.to(torch.bfloat16)
        rows.append(("sentence-transformers bfloat16", timed(st_embed, docs)[0]))
    best_st = max((r for n, r in rows if n.startswith("sentence")), default=None)
    print(f"{'engine':34s} {'docs/s':>8s} {'vs best s-t':>12s}")
    for name, rate in rows:
        ratio = f"{rate / best_st:.2f}x" if best_st else "-"
        print(f"{name:34s} {rate:8.2f} {ratio:>12s}")


if __name__ == "__main__":
    main()

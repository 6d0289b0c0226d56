"""Times ``fastllm.gguf.tokenizer.tokenizer_from_metadata`` (only the tokenizer
build, not the reading of the file) and checks the tokenizer of a GGUF file that
llama.cpp's converter wrote against the tokenizer.json it was written from.

    python benches/gguf_tokenizer.py [--gguf FILE --hf FOLDER] [--repeats 5]

Always times a synthetic Qwen2-sized byte-level vocabulary (151936 ids: 256 bytes,
151387 merges, 22 control tokens, the rest [PAD] slots). With --gguf it also times
that file's tokenizer and encodes a varied text with it and with FOLDER's
tokenizer.json, printing whether the ids are equal. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Any

import numpy as np

from fastllm.gguf.tokenizer import tokenizer_from_metadata

TEXT = (
    'def main() -> None:\n    print("hello, world")  # comment\n\n\n\t\tx = [1, 22, 333, 4444]\n'
    "Grüße, naïve café, Ελληνικά, русский, 日本語と中文，한국어。 e\u0301 A\u030a 🦙🚀 👩\u200d💻 "
    "I've they'll WE'RE   runs   of    spaces     \n\n 3.14159 1234567890 "
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"
)


def synthetic_meta(seed: int = 0) -> dict[str, Any]:
    """A vocabulary shaped like Qwen2's: each merge joins two existing tokens."""
    from tokenizers import pre_tokenizers

    rng = random.Random(seed)
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    seen = set(tokens)
    merges: list[str] = []
    while len(merges) < 151387:
        a = tokens[rng.randrange(len(tokens))]
        b = tokens[rng.randrange(min(len(tokens), 2000))]
        if len(a) + len(b) > 16 or a + b in seen:
            continue
        seen.add(a + b)
        tokens.append(a + b)
        merges.append(f"{a} {b}")
    types = [1] * len(tokens)
    for i in range(22):
        tokens.append(f"<|special_{i}|>")
        types.append(3)
    while len(tokens) < 151936:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(5)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.asarray(types, dtype=np.int32),  # as fastllm's reader
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": len(seen),
    }


def time_build(meta: dict[str, Any], source: str, repeats: int) -> dict[str, float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokenizer_from_metadata(meta, source)
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", help="a GGUF file written by llama.cpp's converter")
    ap.add_argument("--hf", help="the Hugging Face folder it was written from")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    meta = synthetic_meta()
    report: dict[str, Any] = {
        "synthetic": {
            "tokens": len(meta["tokenizer.ggml.tokens"]),
            "merges": len(meta["tokenizer.ggml.merges"]),
            **time_build(meta, "synthetic.gguf", args.repeats),
        }
    }
    if args.gguf:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        from tokenizers import Tokenizer as HFTokenizer

        from gguf_writer import read_metadata

        file_meta = read_metadata(args.gguf)
        entry: dict[str, Any] = {
            "tokens": len(file_meta["tokenizer.ggml.tokens"]),
            "merges": len(file_meta.get("tokenizer.ggml.merges", [])),
            "pre": file_meta.get("tokenizer.ggml.pre"),
            **time_build(file_meta, args.gguf, args.repeats),
        }
        if args.hf:
            tok = tokenizer_from_metadata(file_meta, args.gguf)
            ref = HFTokenizer.from_file(os.path.join(args.hf, "tokenizer.json"))
            ids = tok.encode(TEXT)
            entry["text_tokens"] = len(ids)
            entry["ids_equal"] = ids == ref.encode(TEXT).ids
            entry["decode_equal"] = tok.decode(ids, False) == ref.decode(
                ids, skip_special_tokens=False
            )
        report[args.gguf] = entry
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""Builds a random Llama-architecture model folder for throughput runs (no network).

    python benches/gpu_bench_model.py OUT_DIR [--hidden 1024 --layers 12]

Weights are random (throughput does not depend on them); the tokenizer is a
word-level vocabulary of the same size, so any token id decodes.
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    """Writes config.json, model.safetensors and a tokenizer into OUT_DIR."""
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    args = p.parse_args()

    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    vocab = {"<s>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, args.vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "</s>", "bos_token": "<s>", "pad_token": "</s>"}, f)
    print(args.out)


if __name__ == "__main__":
    main()

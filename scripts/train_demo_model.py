"""Trains fastllm's embedded demo model: a small Llama-architecture code model.

The corpus is the Python standard library's own source code (on every machine
with Python, under the PSF license), so the model completes Python. Runs on a
CPU in well under an hour; writes a Hugging Face folder (config.json,
model.safetensors in bfloat16, tokenizer.json, tokenizer_config.json,
generation_config.json) into python/fastllm/demo_model/ by default.

    python scripts/train_demo_model.py [--out DIR] [--steps 1000] [--threads 2]

Needs torch, tokenizers and transformers (a training-time tool only; the
runtime never imports transformers).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import sysconfig
import time

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def source_files() -> list[str]:
    """The standard library's .py files, in a fixed order."""
    lib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(lib, "**", "*.py"), recursive=True))
    return [f for f in files if "site-packages" not in f and "/test" not in f]


def read_corpus(files: list[str]) -> list[str]:
    """File contents, skipping unreadable ones."""
    texts = []
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
        except (OSError, UnicodeDecodeError):
            continue
    return texts


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on the corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument(
        "--out", default=os.path.join(here, "..", "python", "fastllm", "demo_model")
    )
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps (cosine schedule)")
    parser.add_argument("--minutes", type=float, default=55.0, help="stop early after this long")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    import transformers as tf

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    texts = read_corpus(source_files())
    print(f"corpus: {len(texts)} files, {sum(map(len, texts)) / 1e6:.1f} M chars", flush=True)
    tok = train_tokenizer(texts, args.vocab)
    eos = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for t in texts:
        ids.extend(tok.encode(t).ids)
        ids.append(eos)
    data = torch.tensor(ids, dtype=torch.long)
    n_val = len(data) // 50
    train, val = data[:-n_val], data[-n_val:]
    print(f"tokens: {len(train) / 1e6:.2f} M train, {n_val / 1e6:.2f} M validation", flush=True)

    cfg = tf.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    model = tf.LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    budget = args.minutes * 60
    warmup = 50

    def batch(src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(src) - args.seq_len - 1, (args.batch,))
        x = torch.stack([src[s : s + args.seq_len] for s in starts])
        y = torch.stack([src[s + 1 : s + args.seq_len + 1] for s in starts])
        return x, y

    def val_loss() -> float:
        model.eval()
        g = torch.Generator().manual_seed(1)
        losses = []
        with torch.no_grad():
            for _ in range(8):
                s = int(torch.randint(0, len(val) - args.seq_len - 1, (1,), generator=g))
                x = val[s : s + args.seq_len][None]
                y = val[s + 1 : s + args.seq_len + 1][None]
                logits = model(x).logits
                losses.append(torch.nn.functional.cross_entropy(logits[0], y[0]).item())
        model.train()
        return sum(losses) / len(losses)

    start = time.time()
    step = 0
    history = []
    model.train()
    total = args.steps
    while step < total:
        elapsed = time.time() - start
        if elapsed > budget:
            print(f"time budget reached at step {step}", flush=True)
            break
        lr = args.lr * min(1.0, (step + 1) / warmup)
        lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / total)))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch(train)
        logits = model(x).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            history.append((step, round(loss.item(), 4)))
            print(
                f"step {step:5d}  loss {loss.item():.3f}  lr {lr:.2e}  {elapsed:.0f}s", flush=True
            )
        step += 1
    final_val = val_loss()
    print(f"done: {step} steps, validation loss {final_val:.3f}", flush=True)

    os.makedirs(args.out, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = tf.GenerationConfig(
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos
    )
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "add_bos_token": False,
        "model_max_length": 1024,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f, indent=2)
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(
            {
                "corpus": "CPython standard library source (Lib/**/*.py, tests excluded)",
                "steps": step,
                "minutes": round((time.time() - start) / 60, 1),
                "parameters": n_params,
                "loss_history": history,
                "final_validation_loss": round(final_val, 4),
                "args": vars(args) | {"out": None},
            },
            f,
            indent=2,
        )


if __name__ == "__main__":
    main()

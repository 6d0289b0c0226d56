"""The Rust sampler against a straightforward torch sampler of the same semantics.

The torch side follows vLLM's torch fallback: penalties from bincounts of the token
histories, temperature, a full sort for top-k / top-p with a cumulative-sum mask,
softmax, and an exponential race (`probs / Exp(1)` argmax); both sides also return the
sampled token's raw logprob and rank. Both run in this process on the same logits with
the same thread count. Run: `PYTHONPATH=python python benches/sampler_vs_torch.py`.
"""

import argparse
import statistics
import time

import torch

from fastllm import _core

VOCAB = 151936


def torch_sample(logits, temperature, top_k, top_p, rep, freq, pres, prompts, outputs, gen):
    """vLLM-style torch sampler: returns tokens, raw logprobs and ranks."""
    rows, vocab = logits.shape
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    x = logits.clone()
    if prompts is not None:
        counts = torch.zeros(rows, vocab, dtype=torch.float32)
        counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=torch.float32))
        seen = torch.zeros(rows, vocab, dtype=torch.bool)
        seen.scatter_(1, prompts, True)
        seen |= counts > 0
        r = rep.unsqueeze(1)
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        x -= freq.unsqueeze(1) * counts
        x -= pres.unsqueeze(1) * (counts > 0).to(torch.float32)
    x.div_(temperature.unsqueeze(1))
    sorted_x, order = x.sort(dim=-1, descending=False)
    kth = sorted_x.gather(1, (vocab - top_k).unsqueeze(1))
    sorted_x.masked_fill_(sorted_x < kth, float("-inf"))
    cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= 1 - top_p.unsqueeze(1)
    drop[:, -1] = False
    sorted_x.masked_fill_(drop, float("-inf"))
    x = sorted_x.scatter(-1, order, sorted_x)
    probs = x.softmax(dim=-1)
    q = torch.empty_like(probs).exponential_(generator=gen)
    tokens = probs.div_(q).argmax(dim=-1)
    logprobs = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    ranks = (raw_logprobs > logprobs.unsqueeze(1)).sum(dim=-1) + 1
    return tokens, logprobs, ranks


def rust_sample(logits, rows, history, penalties):
    empty = torch.empty(0, dtype=torch.int32)
    if penalties:
        flat = history.reshape(-1).to(torch.int32)
        offsets = [r * history.shape[1] for r in range(rows + 1)]
    else:
        flat, offsets = empty, [0] * (rows + 1)
    # The batch is built in the timed call, as the engine builds one every step.
    batch = _core.SamplingBatch(
        temperature=[0.8] * rows,
        top_k=[50] * rows,
        top_p=[0.9] * rows,
        min_p=[0.0] * rows,
        repetition_penalty=[1.1 if penalties else 1.0] * rows,
        frequency_penalty=[0.1 if penalties else 0.0] * rows,
        presence_penalty=[0.1 if penalties else 0.0] * rows,
        seed=list(range(rows)),
        position=[100] * rows,
        prompt_tokens=flat,
        prompt_offsets=offsets,
        output_tokens=flat,
        output_offsets=offsets,
        num_logprobs=[0] * rows,
    )
    return _core.sample(logits, batch)


def timed(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    threads = _core.num_threads()
    torch.set_num_threads(threads)
    print(f"threads: {threads} (rust pool and torch), vocab {VOCAB}")
    print(f"{'batch':>5} {'penalties':>9} {'rust ms':>9} {'torch ms':>9} {'speedup':>8}")
    gen = torch.Generator().manual_seed(0)
    for rows in args.batches:
        logits = torch.randn(rows, VOCAB, generator=gen) * 2.0
        logits[:, :64] += 12.0  # a peaked head, as language models have
        history = torch.randint(0, VOCAB, (rows, 256), generator=gen)
        for penalties in (False, True):
            ones = torch.ones(rows)
            t_args = (
                logits,
                0.8 * ones,
                torch.full((rows,), 50),
                0.9 * ones,
                (1.1 if penalties else 1.0) * ones,
                (0.1 if penalties else 0.0) * ones,
                (0.1 if penalties else 0.0) * ones,
                history if penalties else None,
                history if penalties else None,
                gen,
            )
            rust = timed(lambda: rust_sample(logits, rows, history, penalties), args.repeats)  # noqa: B023
            ref = timed(lambda: torch_sample(*t_args), args.repeats)  # noqa: B023
            print(
                f"{rows:>5} {str(penalties):>9} {rust * 1e3:>9.2f} {ref * 1e3:>9.2f} {ref / rust:>7.1f}x"
            )


if __name__ == "__main__":
    main()

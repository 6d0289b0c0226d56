"""What structured outputs cost: decode steps of a batch whose sequences are
constrained by a JSON schema, against the same batch unconstrained and a mixed
one, and the time to the first token of a request with a schema never seen
before (compiled on the spot) against an unconstrained one.

Every configuration runs in the same process, interleaved round by round, so
the ratios compare like with like on a shared machine.

    PYTHONPATH=python python benches/structured_outputs.py [MODEL] --batch 16 \\
        [--steps 16] [--rounds 3] [--dtype bfloat16] [--full-vocab] [--json FILE]

MODEL defaults to the benchmark model (/work/benchmodels/qwen2-0.5b-random,
made by benches/make_bench_model.py when missing). Its tokenizer has 8,192
real tokens (the rest of its 151,936 logits are padding), and a mask costs in
proportion to the real tokens: ``--full-vocab`` first trains a byte-level BPE
tokenizer of as many tokens as the model has logits on the local Python
sources (about a minute; kept in MODEL-fullvocab/, beside the model's other
files), so the masks are those of a full-size vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from fastllm import LLM, SamplingParams, StructuredOutputsParams, _core

BENCH_MODEL = "/work/benchmodels/qwen2-0.5b-random"

# An unbounded array of records: a random model keeps writing items, so every
# sequence stays constrained (numbers, enums, keys, strings) for the whole run.
SCHEMA = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0},
            "kind": {"enum": ["user", "admin", "guest"]},
            "score": {"type": "number"},
            "name": {"type": "string", "maxLength": 12},
        },
        "required": ["id", "kind", "score", "name"],
        "additionalProperties": False,
    },
}


def full_vocab_model(model: str) -> str:
    """A folder with ``model``'s files and a BPE tokenizer of as many tokens as
    the model has logits (trained on the local Python sources once, then kept)."""
    import glob
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = model.rstrip("/") + "-fullvocab"
    tok_path = os.path.join(out, "tokenizer.json")
    if os.path.isfile(tok_path):
        return out
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(model):
        if name != "tokenizer.json" and not os.path.exists(os.path.join(out, name)):
            os.symlink(os.path.abspath(os.path.join(model, name)), os.path.join(out, name))
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    with open(os.path.join(model, "tokenizer.json")) as f:
        specials = [t["content"] for t in json.load(f)["added_tokens"]]
    paths = sysconfig.get_paths()
    files = sorted(glob.glob(os.path.join(paths["stdlib"], "**/*.py"), recursive=True))
    files += sorted(glob.glob(os.path.join(paths["purelib"], "**/*.py"), recursive=True))[:20000]

    def corpus():
        for p in files:
            with open(p, encoding="utf-8", errors="ignore") as f:
                yield f.read()

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=specials,  # the same ids as the model's tokenizer: EOS stays EOS
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.save(tok_path)
    return out


def params(kind: str, i: int, max_tokens: int) -> SamplingParams:
    common = dict(temperature=1.0, seed=1000 + i, max_tokens=max_tokens, ignore_eos=True)
    if kind == "free" or (kind == "mixed" and i % 2 == 0):
        return SamplingParams(**common)
    return SamplingParams(**common, structured_outputs=StructuredOutputsParams(json=SCHEMA))


def decode_steps(llm: LLM, kind: str, batch: int, steps: int) -> tuple[list[float], int]:
    """Per-step seconds of ``steps`` decode steps of ``batch`` sequences (after
    their prefill), and how many sequences still ran at the last step."""
    eng = llm.llm_engine
    ids = eng.tokenizer.encode("Records as JSON:")
    for i in range(batch):
        eng.add_request(None, ids, params(kind, i, steps + 4))
    while any(s.num_output_tokens == 0 for s in [*eng.scheduler.waiting, *eng.scheduler.running]):
        eng.step()  # prefill and the first token
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    alive = len(eng.scheduler.running)
    while eng.has_unfinished_requests():
        eng.step()
    return times, alive


def first_token(llm: LLM, schema: dict | None) -> float:
    """Seconds from adding one request to its first token."""
    eng = llm.llm_engine
    ids = eng.tokenizer.encode("Records as JSON:")
    so = None if schema is None else StructuredOutputsParams(json=schema)
    t0 = time.perf_counter()
    p = SamplingParams(temperature=1.0, seed=1, max_tokens=1, structured_outputs=so)
    req = eng.add_request(None, ids, p)
    while not req.seqs[0].output_token_ids:
        eng.step()
    dt = time.perf_counter() - t0
    while eng.has_unfinished_requests():
        eng.step()
    return dt


def mask_only(llm: LLM, batch: int, steps: int) -> list[float]:
    """Per-step seconds of computing and applying the masks alone, for ``batch``
    sequences walking through their grammar (no forward pass)."""
    import torch

    vocab = llm.llm_engine.structured.vocabulary
    ms = [vocab.start("json", json.dumps(SCHEMA)) for _ in range(batch)]
    logits = torch.randn(batch, vocab.vocab_size)
    times = []
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = logits.clone()
        t0 = time.perf_counter()
        _core.apply_grammar_masks(x, list(range(batch)), ms)
        times.append(time.perf_counter() - t0)
        for i, m in enumerate(ms):  # advance each by a random allowed token
            allowed = m.allowed_tokens()
            m.consume(allowed[int(torch.randint(len(allowed), (1,), generator=g))])
            if m.is_finished:
                ms[i] = vocab.start("json", json.dumps(SCHEMA))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=BENCH_MODEL)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--full-vocab", action="store_true", help="a tokenizer as large as the logits")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    if not os.path.isdir(args.model):
        maker = os.path.join(os.path.dirname(__file__), "make_bench_model.py")
        subprocess.run([sys.executable, maker, os.path.dirname(args.model.rstrip("/"))], check=True)
    if args.full_vocab:
        args.model = full_vocab_model(args.model)

    llm = LLM(
        args.model, dtype=args.dtype, device="cpu", max_num_seqs=args.batch, max_model_len=512
    )
    t0 = time.perf_counter()
    _ = llm.llm_engine.structured.vocabulary
    vocab_s = time.perf_counter() - t0
    # Warm-up: the first steps of a process pay one-time costs.
    decode_steps(llm, "json", args.batch, 2)
    decode_steps(llm, "free", args.batch, 2)

    kinds = ["free", "json", "mixed"]
    step_times: dict[str, list[float]] = {k: [] for k in kinds}
    alive: dict[str, list[int]] = {k: [] for k in kinds}
    ttft: dict[str, list[float]] = {"free": [], "new_schema": []}
    for r in range(args.rounds):
        for k in kinds:
            times, n = decode_steps(llm, k, args.batch, args.steps)
            step_times[k] += times
            alive[k].append(n)
        for j in range(3):
            ttft["free"].append(first_token(llm, None))
            fresh = dict(SCHEMA, title=f"schema {r}.{j}")  # a new schema: compiled now
            ttft["new_schema"].append(first_token(llm, fresh))
    masks = mask_only(llm, args.batch, args.steps * args.rounds)

    med = {k: statistics.median(v) for k, v in step_times.items()}
    tok = llm.llm_engine.tokenizer
    result = {
        "model": args.model,
        "tokenizer_tokens": tok.vocab_size if tok is not None else None,
        "batch": args.batch,
        "dtype": args.dtype,
        "vocabulary_build_s": vocab_s,
        "step_ms": {k: 1e3 * v for k, v in med.items()},
        "json_over_free": med["json"] / med["free"],
        "mixed_over_free": med["mixed"] / med["free"],
        "mask_only_ms_per_step": 1e3 * statistics.median(masks),
        "sequences_alive_at_last_step": alive,
        "ttft_ms": {k: 1e3 * statistics.median(v) for k, v in ttft.items()},
        "ttft_new_schema_over_free": statistics.median(ttft["new_schema"])
        / statistics.median(ttft["free"]),
    }
    print(
        f"tokenizer: {result['tokenizer_tokens']} tokens; logits: {llm.llm_engine.model_config.vocab_size}"
    )
    print(f"vocabulary (token trie) built once: {vocab_s * 1e3:.0f} ms")
    for k in kinds:
        print(f"decode step, batch {args.batch}, {k:5s}: {1e3 * med[k]:8.1f} ms (median)")
    print(f"  all constrained / unconstrained: {result['json_over_free']:.3f}")
    print(f"  mixed (half constrained) / unconstrained: {result['mixed_over_free']:.3f}")
    print(
        f"  masks alone (compute + apply, {args.batch} rows): {result['mask_only_ms_per_step']:.2f} ms"
    )
    print(
        f"first token: unconstrained {result['ttft_ms']['free']:.0f} ms, new schema "
        f"{result['ttft_ms']['new_schema']:.0f} ms, ratio {result['ttft_new_schema_over_free']:.3f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

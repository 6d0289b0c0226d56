"""fastllm on mixture-of-experts GGUF files written by llama.cpp's own converter
(``convert_hf_to_gguf.py``): Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE and gpt-oss.

    PYTHONPATH=python python benches/gguf_converter_moe.py [OUT_DIR] [--llama-dir DIR]
        [--pylib DIR] [--families qwen3_moe,mixtral,...]

The sibling of ``benches/gguf_converter_families.py``, whose helpers it uses
(the converter's environment and its pre-tokenizer fallback, fastllm's paged
prefill on the file, the error and argmax comparison, the tokenizer check).
Each tiny random model of ``tests/test_moe_models.py::CONFIGS`` (randomized as
there: routers decisive, logits O(1)) is saved with the 512-token byte-level
BPE tokenizer of ``tests/conftest.py`` (vocabulary resized to 512), with the
options that the converter cannot write set to what a file without them means
(``WRITABLE``, printed with the table), and converted by the real converter to
F32 and to Q8_0 (``--outtype q8_0``). fastllm reads each file and its logits
over random sequences of 9, 17 and 33 tokens are compared with transformers'
(float32, eager attention) on the original folder:

* F32: max |ours - ref| / max|ref|, the number of positions whose argmax
  (teacher-forced greedy token) is the reference's, and whether ``LLM(file)``
  generates transformers' greedy tokens (12 tokens after each sequence's first
  8, EOS ignored on both sides);
* Q8_0: the same error and its median over positions (a router near-tie that
  the int8 rounding flips runs another expert at that position: the largest
  error is a few positions'), the positions whose argmax is the reference's
  and, at each disagreement, the reference's top-1/top-2 margin as a fraction
  of that position's max|logit|;
* tok: the file's tokenizer encodes a sample text as the folder's does.

llama.cpp's source and the ``pylib`` folder (sentencepiece, which the Qwen2
vocabulary path imports) are found as ``gguf_converter_families.py`` finds
them (``--llama-dir`` / ``$LLAMA_DIR``, ``--pylib``). No network is used.
"""

import argparse
import copy
import json
import os
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_converter_families as fam  # noqa: E402  (puts tests/ on sys.path)
import torch  # noqa: E402
import transformers  # noqa: E402

import test_models as tm  # noqa: E402
import test_moe_models as tmm  # noqa: E402
from conftest import train_byte_level_bpe  # noqa: E402
from fastllm import LLM, SamplingParams  # noqa: E402

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss", "gpt_oss_top1"]
# Options of the test configs that llama.cpp's converter cannot write (it fails
# on Qwen3-MoE's dense layers and silently leaves the others out), set to what
# llama.cpp (and fastllm) assume for a file without them. The others
# (top-k, expert sizes, the shared expert and its gate, q/k/v biases, q/k norms,
# gpt-oss's sinks, biased router and experts, sliding window and alternating
# layers) go into the file.
WRITABLE = {
    "qwen3_moe": (
        {"mlp_only_layers": []},
        "mlp_only_layers [1] -> [] (the converter fails: it cannot map a dense layer's MLP)",
    ),
    "mixtral": (
        {"sliding_window": None},
        "sliding_window 8 -> none (the llama converter writes no window)",
    ),
    "olmoe": (
        {"clip_qkv": None},
        "clip_qkv 0.9 -> none (the OLMoE converter writes no attention.clamp_kqv)",
    ),
    "gpt_oss": (
        {"swiglu_limit": 7.0},
        "swiglu_limit 0.6 -> 7.0 (no swiglu_clamp_exp is written; 7.0 is llama.cpp's)",
    ),
}
PROMPT, NEW_TOKENS = 8, 12


def make_folder(name: str, folder: str, tokenizer) -> torch.nn.Module:
    """The family's tiny random MoE model, with only converter-writable options,
    saved in ``folder`` with the 512-token tokenizer."""
    cfg = copy.deepcopy(tmm.CONFIGS[name])
    for key, value in WRITABLE.get(name, ({}, ""))[0].items():
        setattr(cfg, key, value)
    cfg.vocab_size = tm.VOCAB
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = 0  # <|endoftext|>
    os.makedirs(folder, exist_ok=True)
    model = tmm.build(cfg, folder)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({**fam.TOKENIZER_CONFIG, "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return model


def reference_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    """transformers' greedy tokens by full forward passes (no generation config,
    so nothing masks EOS or stops at it)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


def greedy_equal(path: str, ref_model: torch.nn.Module, seqs: list[list[int]]) -> tuple[int, int]:
    """How many of the prompts (each sequence's first ``PROMPT`` tokens)
    ``LLM(path)`` continues greedily as transformers does."""
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=64)
    prompts = [s[:PROMPT] for s in seqs]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    same = sum(
        list(o.outputs[0].token_ids) == reference_greedy(ref_model, p)
        for p, o in zip(prompts, outs)
    )
    del llm
    return same, len(prompts)


def median_error(ours: list[torch.Tensor], refs: list[torch.Tensor]) -> float:
    """The median over positions of max |ours - ref| / max|ref| (of the sequence):
    a quantized router that flips a near-tie runs another expert at that
    position, so the largest error is a few positions' (tests/test_gguf_moe.py)."""
    errs = [(a - b).abs().max(-1).values / b.abs().max() for a, b in zip(ours, refs)]
    return torch.cat(errs).median().item()


def run_family(name: str, args, tokenizer, seqs, failures: list) -> dict:
    """Converts the family's folder to F32 and Q8_0 and measures fastllm on both."""
    folder = os.path.join(args.out, name)
    ref_model = make_folder(name, folder, tokenizer)
    refs = tm._reference(ref_model, seqs)
    row = {"family": name}
    for outtype in ("f32", "q8_0"):
        path = os.path.join(folder, f"{name}-{outtype}.gguf")
        try:
            fam.convert(args.llama_dir, args.pylib, folder, path, outtype)
        except RuntimeError as e:
            failures.append(f"{name} {outtype} (convert): {e}")
            continue
        try:
            ours, types, hf = fam.fastllm_logits(path, seqs)
        except Exception as e:  # noqa: BLE001 - reported per family
            failures.append(f"{name} {outtype} (fastllm load): {type(e).__name__}: {e}")
            continue
        row[outtype] = {**fam.compare(ours, refs), "types": types}
        row[outtype]["median"] = median_error(ours, refs)
        if outtype != "f32":
            continue
        row["diff"] = fam.config_diff(hf, ref_model.config)
        try:
            row["greedy"] = greedy_equal(path, ref_model, seqs)
        except Exception as e:  # noqa: BLE001
            failures.append(f"{name} f32 (LLM generate): {type(e).__name__}: {e}")
        try:
            row["tok"] = fam.tokens_match(path, tokenizer, None)
        except Exception as e:  # noqa: BLE001
            row["tok"] = f"error: {type(e).__name__}: {e}"
    return row


def report(rows: list[dict], notes: list[str], writable: dict = WRITABLE) -> None:
    """The comparison table and its notes; rows with an ``at_load`` entry (the
    folder quantized to q8_0 by fastllm at load) add that column."""
    width = max([len("family"), *(len(r["family"]) for r in rows)]) + 1
    at_load = any("at_load" in r for r in rows)
    head = f"{'family':{width}} | {'F32 err':>8} {'argmax':>7} {'greedy':>6} | "
    head += f"{'Q8_0 err median/max':>19} {'argmax':>7} {'max flip margin':>15} | "
    if at_load:
        head += f"{'at load: median/max':>19} {'argmax':>7} | "
    head += "tok"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        f, q = r.get("f32"), r.get("q8_0")
        line = f"{r['family']:{width}} | "
        if f:
            g = r.get("greedy")
            greedy = f"{g[0]}/{g[1]}" if g else "-"
            line += f"{f['err']:8.1e} {f['same']:>3}/{f['total']:<3} {greedy:>6} | "
        else:
            line += f"{'failed':>23} | "
        if q:
            flip = f"{max(q['margins']):.4f}" if q["margins"] else "-"
            err = f"{q['median']:.4f}/{q['err']:.4f}"
            line += f"{err:>19} {q['same']:>3}/{q['total']:<3} {flip:>15} | "
        else:
            line += f"{'failed':>43} | "
        if at_load:
            median, a = r["at_load"]
            err = f"{median:.4f}/{a['err']:.4f}"
            line += f"{err:>19} {a['same']:>3}/{a['total']:<3} | "
        print(line + r.get("tok", "-"))
    print("errors: max |fastllm - transformers| / max|transformers| over the sequences")
    print("  (Q8_0: the median over positions, then the largest);")
    print(f"greedy: LLM(file) continues the {PROMPT}-token prompts as transformers does")
    print(f"  ({NEW_TOKENS} tokens each); flip margin: the reference's (top1 - top2) /")
    print("  max|logit| where the argmax differs")
    if at_load:
        print("at load: the folder quantized to q8_0 by fastllm at load, against the same")
        print("  reference (the same kind of rounding of the weights and activations as the")
        print("  Q8_0 file's)")
    for r in rows:
        for t in ("f32", "q8_0"):
            if t in r:
                types = ", ".join(f"{k} x{v}" for k, v in sorted(r[t]["types"].items()))
                flips = ", ".join(f"{m:.4f}" for m in sorted(r[t]["margins"])) or "none"
                print(f"  {r['family']} {t}: tensors {types}; flip margins: {flips}")
        for d in r.get("diff", []):
            print(f"  {r['family']}: config from the file differs from the folder's: {d}")
    names = {r["family"] for r in rows}
    print("options the converter cannot write, changed in the test configs:")
    for name, (_, why) in writable.items():
        if name in names:
            print(f"  {name}: {why}")
    for note in notes:
        print("FAILED " + note)


def main(
    kind: str = "MoE",
    families: list[str] = FAMILIES,
    run: Callable = None,
    writable: dict = WRITABLE,
    default_out: str = "/tmp/gguf-moe",
    doc: str | None = None,
) -> None:
    """The command line: convert each family with the real converter and
    print the table (``kind`` names the models; ``run`` does one family)."""
    ap = argparse.ArgumentParser(description=(doc or __doc__).split("\n")[0])
    ap.add_argument("out", nargs="?", default=default_out)
    ap.add_argument("--llama-dir", default=os.environ.get("LLAMA_DIR", fam.DEFAULT_LLAMA))
    ap.add_argument(
        "--pylib",
        default=None,
        help="folder holding sentencepiece (default: LLAMA_DIR's pylib, "
        "see benches/build_llama_cpp.sh)",
    )
    ap.add_argument("--families", default=",".join(families))
    args = ap.parse_args()
    args.pylib = args.pylib or fam.default_pylib(args.llama_dir)
    if not os.path.isfile(os.path.join(args.llama_dir, "convert_hf_to_gguf.py")):
        sys.exit(
            f"llama.cpp source not found: {args.llama_dir}/convert_hf_to_gguf.py is missing; "
            "pass --llama-dir or set LLAMA_DIR (benches/build_llama_cpp.sh fetch unpacks it)"
        )
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    tokenizer = train_byte_level_bpe(tm.VOCAB)
    seqs = tm._sequences(5, fam.LENGTHS)
    print(
        f"tiny random {kind} models (vocab {tm.VOCAB}), sequences of {fam.LENGTHS} tokens "
        f"({sum(fam.LENGTHS)} positions); converter: {args.llama_dir}"
    )
    rows, failures = [], []
    for name in args.families.split(","):
        rows.append((run or run_family)(name, args, tokenizer, seqs, failures))
    report(rows, failures, writable)


if __name__ == "__main__":
    main()

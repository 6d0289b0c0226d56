"""fastllm on hybrid recurrent GGUF files written by llama.cpp's own converter
(``convert_hf_to_gguf.py``): Qwen3.5 (``qwen35``), LFM2 (``lfm2``), their
mixture-of-experts versions (``qwen35moe``, ``lfm2moe``) and Granite 4.0's
hybrids (``granitehybrid``, with and without experts; their ``layer_types``
written as the released configs write them, "mamba" and "attention", which
the converter reads).

    PYTHONPATH=python python benches/gguf_converter_hybrid.py [OUT_DIR] [--llama-dir DIR]
        [--pylib DIR] [--families qwen3_5,lfm2,...]

The sibling of ``benches/gguf_converter_moe.py``, whose helpers it uses (and
through it ``benches/gguf_converter_families.py``'s: the converter's
environment and its pre-tokenizer fallback, fastllm's paged prefill on the
file, the error and argmax comparison, the tokenizer check, greedy
generation). Each tiny random model of ``tests/test_hybrid_models.py::CONFIGS``
(Gated DeltaNet with value heads sharing key heads and Dk != Dv, attention
first, partial rotary, q/k/v/o biases; LFM2 with an adjusted MLP width, 2-3
taps, untied head) is saved with the 512-token byte-level BPE tokenizer of
``tests/conftest.py``, with the options that the converter cannot write set
to what it can (``WRITABLE``, printed with the table), and converted by the
real converter to F32 and to Q8_0 (``--outtype q8_0``; Qwen3.5 with
``--no-mtp``: these folders have no multi-token-prediction layers, which
the converter otherwise requires). fastllm reads each file and its logits
over random sequences of 9, 17 and 33 tokens are compared with transformers'
(float32, eager attention) on the original folder:

* F32: max |ours - ref| / max|ref|, the positions whose argmax (teacher-forced
  greedy token) is the reference's, and whether ``LLM(file)`` generates
  transformers' greedy tokens (12 after each sequence's first 8, EOS ignored);
* Q8_0: the error's median over positions and its largest, the positions
  whose argmax is the reference's and, at each disagreement, the reference's
  top-1/top-2 margin as a fraction of that position's max|logit|;
* tok: the file's tokenizer encodes a sample text as the folder's does.

The config fastllm reads from each F32 file is compared with the folder's
(LFM2's MLP width: the file stores the adjusted width, read with
``block_auto_adjust_ff_dim`` off; that is reported only when the widths
differ). No network is used.
"""

import copy
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_converter_families as fam  # noqa: E402  (puts tests/ on sys.path)
import gguf_converter_moe as moe  # noqa: E402
import torch  # noqa: E402

import test_hybrid_models as th  # noqa: E402
import test_models as tm  # noqa: E402
from fastllm.config import ModelConfig  # noqa: E402
from fastllm.layers.quantization import quantize_model  # noqa: E402
from fastllm.models.hybrid import lfm2_intermediate_size  # noqa: E402
from fastllm.models.loader import load_model  # noqa: E402
from paged_helpers import PagedRunner  # noqa: E402

FAMILIES = list(th.CONFIGS)
# Options of the test configs that llama.cpp's converter cannot write, set to
# what it can.
WRITABLE = {
    "lfm2_bias": (
        {"conv_bias": False},
        "conv_bias True -> False (the converter fails: it squeezes every 'conv.conv' tensor "
        "along dim 1, the 1-D conv.conv.bias too: IndexError)",
    ),
    "lfm2_moe": (
        {"routed_scaling_factor": 1.0},
        "routed_scaling_factor 1.7 -> 1.0 (the converter writes no expert_weights_scale, "
        "and llama.cpp's lfm2moe graph does not scale)",
    ),
    "lfm2_moe_plain": (
        {"tie_word_embeddings": True, "norm_topk_prob": True, "conv_bias": False},
        "conv_bias True -> False (as lfm2_bias); tie_word_embeddings False -> True (gguf-py's LFM2MOE tensor map has no 'output': "
        "'Can not map tensor lm_head.weight'); norm_topk_prob False -> True (the converter "
        "writes no expert_weights_norm, and llama.cpp's graph renormalises)",
    ),
    "granite4_h": (
        {"position_embedding_type": None},
        "position_embedding_type rope -> None (the converter writes rope.scaling.finetuned "
        "false for every hybrid, and llama.cpp then runs no rotary: the released hybrids have none)",
    ),
    "granite4_h_moe": (
        {"time_step_limit": (0.0, float("inf"))},
        "time_step_limit (0, 1.5) -> (0, inf) (a GGUF file has no key for it; llama.cpp clamps nothing)",
    ),
}
# Converter arguments per family (Qwen3.5: no multi-token-prediction layers).
EXTRA_ARGS = {"Qwen3_5TextConfig": ["--no-mtp"], "Qwen3_5MoeTextConfig": ["--no-mtp"]}


def make_folder(name: str, folder: str, tokenizer) -> torch.nn.Module:
    """The family's tiny random model, with only converter-writable options,
    saved in ``folder`` with the 512-token tokenizer."""
    cfg = copy.deepcopy(th.CONFIGS[name])
    for key, value in WRITABLE.get(name, ({}, ""))[0].items():
        setattr(cfg, key, value)
    cfg.vocab_size = tm.VOCAB
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = 0  # <|endoftext|>
    os.makedirs(folder, exist_ok=True)
    model = tm._build("", folder, 0, cfg)
    if name.startswith("granite4"):  # the released configs' words, which the converter reads
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            saved = json.load(f)
        words = {"linear_attention": "mamba", "full_attention": "attention"}
        saved["layer_types"] = [words[t] for t in saved["layer_types"]]
        with open(path, "w") as f:
            json.dump(saved, f)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({**fam.TOKENIZER_CONFIG, "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return model


def convert(args, name: str, folder: str, out: str, outtype: str) -> None:
    """``fam.convert`` with the family's extra converter arguments."""
    llama = args.llama_dir
    path = [llama, os.path.join(llama, "gguf-py")]
    path += [args.pylib] if os.path.isdir(args.pylib) else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    cmd = [sys.executable, "-c", fam.CONVERT, os.path.join(llama, "convert_hf_to_gguf.py"), folder]
    cmd += ["--outtype", outtype, "--outfile", out]
    cmd += EXTRA_ARGS.get(type(th.CONFIGS[name]).__name__, [])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        tail = [ln for ln in r.stderr.splitlines() if not ln.startswith("INFO:")][-6:]
        raise RuntimeError("converter failed:\n    " + "\n    ".join(tail))


def config_diff(hf: dict, folder: str, ref: object) -> list[str]:
    """``fam.config_diff``, LFM2's MLP width compared as the width it runs."""
    diff = fam.config_diff(hf, ref)
    if hf.get("model_type") == "lfm2":
        ours = lfm2_intermediate_size(ModelConfig.from_dict(hf))
        want = lfm2_intermediate_size(ModelConfig.from_pretrained(folder))
        keys = ("intermediate_size:", "block_auto_adjust_ff_dim:")
        diff = [d for d in diff if not d.startswith(keys)]
        if ours != want:
            diff.append(f"MLP width: file {ours}, folder {want}")
    return diff


def folder_q8_0(folder: str, seqs: list[list[int]]) -> list[torch.Tensor]:
    """fastllm's logits on the folder quantized to q8_0 at load (the yardstick
    for the Q8_0 file: the same rounding of weights and activations)."""
    config = ModelConfig.from_pretrained(folder)
    model = load_model(config, folder, torch.float32, "cpu")
    quantize_model(model, "q8_0", config.vocab_size)
    return PagedRunner(model, torch.float32).step(list(enumerate(seqs)))


def run_family(name: str, args, tokenizer, seqs, failures: list) -> dict:
    """Converts the family's folder to F32 and Q8_0 and measures fastllm on both."""
    folder = os.path.join(args.out, name)
    ref_model = make_folder(name, folder, tokenizer)
    refs = tm._reference(ref_model, seqs)
    at_load = folder_q8_0(folder, seqs)
    row = {"family": name, "at_load": (moe.median_error(at_load, refs), fam.compare(at_load, refs))}
    for outtype in ("f32", "q8_0"):
        path = os.path.join(folder, f"{name}-{outtype}.gguf")
        try:
            convert(args, name, folder, path, outtype)
        except RuntimeError as e:
            failures.append(f"{name} {outtype} (convert): {e}")
            continue
        try:
            ours, types, hf = fam.fastllm_logits(path, seqs)
        except Exception as e:  # noqa: BLE001 - reported per family
            failures.append(f"{name} {outtype} (fastllm load): {type(e).__name__}: {e}")
            continue
        row[outtype] = {**fam.compare(ours, refs), "types": types}
        row[outtype]["median"] = moe.median_error(ours, refs)
        if outtype != "f32":
            continue
        row["diff"] = config_diff(hf, folder, ref_model.config)
        try:
            row["greedy"] = moe.greedy_equal(path, ref_model, seqs)
        except Exception as e:  # noqa: BLE001
            failures.append(f"{name} f32 (LLM generate): {type(e).__name__}: {e}")
        try:
            row["tok"] = fam.tokens_match(path, tokenizer, None)
        except Exception as e:  # noqa: BLE001
            row["tok"] = f"error: {type(e).__name__}: {e}"
    return row


def main() -> None:
    """The MoE bench's command line and table, for the hybrid families."""
    moe.main("hybrid", FAMILIES, run_family, WRITABLE, "/tmp/gguf-hybrid", __doc__)


if __name__ == "__main__":
    main()

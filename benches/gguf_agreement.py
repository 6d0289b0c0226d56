"""Greedy agreement of a quantized GGUF file with its own weights in float: is
a low agreement a defect, or near-tied logits of a random model?

    PYTHONPATH=python python benches/gguf_agreement.py [OUT_DIR]

For tiny random Mistral (sliding window 16), Llama and Qwen2 configs of the
test suite, the folder is written as a Q8_0 file (llama.cpp's layout, through
the ``gguf`` package), and fastllm's greedy tokens from the file are compared
with transformers on the file's weights dequantized (full attention: the
file describes no window for the llama architecture) and on the float folder.
Then, teacher-forced on fastllm's tokens, every position where fastllm's
argmax differs from the dequantized reference is listed with the reference's
top-1/top-2 margin as a fraction of its largest logit: flips only at small
margins mean the int8 rounding of activations (as llama.cpp's Q8_0 kernels
round them) decides near ties, not a defect.
"""

import copy
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import gguf  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import test_models as tm  # noqa: E402
from fastllm import LLM, SamplingParams  # noqa: E402
from gguf_models import ARCH, dequantized_state, unpermute, write_gguf  # noqa: E402

out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/gguf-agreement"
N = 9  # greedy tokens per prompt: 4 prompts, 36 positions
for name, seed in [("mistral", 0), ("mistral", 1), ("mistral", 2), ("llama", 1), ("qwen2", 1)]:
    folder = os.path.join(out, f"{name}-{seed}")
    cfg = copy.deepcopy(tm.CONFIGS[name])
    if name == "mistral":
        cfg.sliding_window = 16
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    tm._randomize(model, seed)
    model = model.float().eval()
    model.save_pretrained(folder)
    kind = "llama" if name == "mistral" else name
    q8 = write_gguf(folder, os.path.join(folder, "q8.gguf"), kind, "Q8_0")
    # the reference: the same model, full attention, holding the file's dequantized weights
    ref = copy.deepcopy(model)
    if name == "mistral":
        ref.config.sliding_window = None
    names = gguf.TensorNameMap(ARCH[name], cfg.num_hidden_layers)
    deq = dequantized_state(q8)
    with torch.no_grad():
        for hf, p in ref.named_parameters():
            t = deq[names.get_name(hf, try_suffixes=(".weight", ".bias"))].reshape(p.shape)
            if kind == "llama" and ".q_proj." in hf:
                t = torch.as_tensor(unpermute(t.numpy(), cfg.num_attention_heads))
            elif kind == "llama" and ".k_proj." in hf:
                t = torch.as_tensor(unpermute(t.numpy(), cfg.num_key_value_heads))
            p.copy_(t)
    full = copy.deepcopy(model)
    if name == "mistral":
        full.config.sliding_window = None
    prompts = tm._sequences(1, [5, 9, 3, 7])
    llm = LLM(q8, device="cpu", dtype="float32", max_model_len=128, skip_tokenizer_init=True)
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, detokenize=False)
    ours = [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    ]

    def greedy(m, p):
        with torch.no_grad():
            g = m.generate(torch.tensor([p]), max_new_tokens=N, do_sample=False, min_new_tokens=N)
        return g[0, len(p) :].tolist()

    deq_tok = [greedy(ref, p) for p in prompts]
    flt_tok = [greedy(full, p) for p in prompts]

    def agree(a, b):  # positions equal before the first divergence, and overall
        tot = sum(len(x) for x in a)
        same = sum(x == y for s, t in zip(a, b) for x, y in zip(s, t))
        first = sum(
            next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s)) for s, t in zip(a, b)
        )
        return f"{same}/{tot} equal, {first}/{tot} before the first divergence"

    # teacher-forced logits on our tokens: relative error and the reference's top-2 margin
    errs, margins_at_flips, margins = [], [], []
    for p, toks in zip(prompts, ours):
        seq = p + toks
        with torch.no_grad():
            r = ref(torch.tensor([seq])).logits[0, len(p) - 1 : -1]
        lp = llm.generate(
            [{"prompt_token_ids": seq[: len(p) + i]} for i in range(len(toks))],
            SamplingParams(temperature=0, max_tokens=1, logprobs=2, detokenize=False),
            use_tqdm=False,
        )
        for i, o in enumerate(lp):
            top2 = torch.topk(r[i], 2).values
            margin = (top2[0] - top2[1]).item() / r[i].abs().max().item()
            margins.append(margin)
            if o.outputs[0].token_ids[0] != r[i].argmax().item():
                margins_at_flips.append(margin)
    print(
        json.dumps(
            {
                "model": f"{name} (seed {seed})",
                "q8 file vs dequantized float (full attn)": agree(ours, deq_tok),
                "q8 file vs float folder (full attn)": agree(ours, flt_tok),
                "dequantized float vs float folder": agree(deq_tok, flt_tok),
                "argmax flips vs dequantized ref (teacher forced)": len(margins_at_flips),
                "ref top1-top2 margin / max|logit| at flips": [
                    round(m, 4) for m in margins_at_flips
                ],
                "median margin": round(sorted(margins)[len(margins) // 2], 4),
            },
            indent=1,
        )
    )

"""fastllm on GGUF files written by llama.cpp's own converter (``convert_hf_to_gguf.py``)
for the newer families: Gemma 2/3, Phi-3, Granite, OLMo 2 and SmolLM3.

    PYTHONPATH=python python benches/gguf_converter_families.py [OUT_DIR] [--llama-dir DIR]
        [--pylib DIR] [--families gemma2,gemma3,...]

Each tiny random model of ``tests/test_gguf.py::GGUF_CONFIGS`` is saved with a
512-token byte-level BPE tokenizer (``tests/conftest.py``) and converted by the
real converter, one subprocess per file, to F32 and to Q8_0. Gemma 2's converter
reads only a SentencePiece ``tokenizer.model``: its folder gets instead a
512-piece SentencePiece BPE model trained here (``train_sentencepiece``: byte
fallback and, as Gemma's, identity normalization, no dummy prefix, spaces kept)
on the lines of the same standard-library sources, and its config takes that
model's bos/eos/pad ids (1/2/3). fastllm reads each file (``hf_config`` +
``load_gguf_model``, paged prefill) and its logits over random sequences of 9,
17 and 33 tokens are compared with transformers' (float32, eager attention) on
the original folder:

* F32: max |ours - ref| / max|ref| and whether the argmax of every position
  (teacher-forced greedy tokens) is the reference's;
* Q8_0: the same error, the fraction of positions whose argmax is the
  reference's and, at each disagreement, the reference's top-1/top-2 margin as
  a fraction of that position's max|logit| (small margins: near ties that the
  int8 rounding decides, not a defect);
* tok: the file's tokenizer (``fastllm.gguf.load_tokenizer``) encodes a sample
  text as the folder's tokenizer does (for Gemma 2: as SentencePiece itself
  encodes it, without and with the BOS the file asks for).

llama.cpp's source (the converter, ``conversion/`` and ``gguf-py/``) is taken
from ``--llama-dir`` or ``$LLAMA_DIR`` (default: the llama-cpp-python sdist that
``benches/build_llama_cpp.sh fetch`` unpacks). sentencepiece, for Gemma 2, is
imported from this environment or else from ``--pylib`` (default: the ``pylib``
folder that ``benches/build_llama_cpp.sh convert`` installs it in, next to
``src/``), which is also on the converter's ``PYTHONPATH``; without it that family
is skipped. No network is used.
"""

import argparse
import copy
import importlib.util
import io
import json
import math
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "tests"))
os.environ.setdefault("FASTLLM_GGUF_CACHE", "0")  # no packed-weight cache files

import torch  # noqa: E402
import transformers  # noqa: E402

import test_models as tm  # noqa: E402
from conftest import _corpus, train_byte_level_bpe  # noqa: E402
from fastllm.config import ModelConfig  # noqa: E402
from fastllm.gguf import load_tokenizer  # noqa: E402
from fastllm.gguf.config import hf_config  # noqa: E402
from fastllm.gguf.loader import load_gguf_model  # noqa: E402
from fastllm.gguf.reader import GGUFFile  # noqa: E402
from fastllm.layers.linear import pack_linears  # noqa: E402
from paged_helpers import PagedRunner  # noqa: E402
from test_gguf import GGUF_CONFIGS  # noqa: E402

DEFAULT_LLAMA = "/work/llamacpp/src/llama_cpp_python-0.3.36/vendor/llama.cpp"
# Gemma 3's config there has six layers, the last one global: the converter
# writes no sliding_window_pattern for gemma3, and llama.cpp (and fastllm) make
# every 6th layer global.
FAMILIES = ["gemma2", "gemma3", "phi3", "granite", "olmo2", "smollm3"]
LENGTHS = [9, 17, 33]
TOKENIZER_CONFIG = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "bos_token": None}
SAMPLE = "def main(argv=None):\n    return {'x': 1, \"y\": [2, 3]}  # ok\n"
# Runs the converter; an unknown pre-tokenizer hash (our trained tokenizer) is
# a plain ByteLevel one: "gpt-2", as benches/build_llama_cpp.sh does. Without a
# tokenizer.model, the SentencePiece path raises the FileNotFoundError that makes
# the Llama-family converters fall back to tokenizer.json before importing
# sentencepiece (the converter checks the file only after that import).
CONVERT = """
import runpy, sys
from conversion import base
orig, orig_sp = base.TextModel.get_vocab_base_pre, base.TextModel._create_vocab_sentencepiece
def pre(self, tokenizer):
    try:
        return orig(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
def sp(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(self.dir_model / "tokenizer.model")
    return orig_sp(self)
base.TextModel.get_vocab_base_pre, base.TextModel._create_vocab_sentencepiece = pre, sp
sys.argv[0] = sys.argv.pop(1)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def default_pylib(llama: str) -> str:
    """``<LLAMA_DIR>/pylib`` for ``<LLAMA_DIR>/src/llama_cpp_python-*/vendor/llama.cpp``."""
    return os.path.normpath(os.path.join(os.path.abspath(llama), "..", "..", "..", "..", "pylib"))


def train_sentencepiece(vocab_size: int) -> bytes:
    """A SentencePiece BPE model (serialized) of ``vocab_size`` pieces, trained on
    the lines of the standard-library sources that ``train_byte_level_bpe`` reads.

    Byte fallback and, as Gemma's tokenizer.model has them, identity
    normalization, whitespace kept as it is (runs of spaces too) and no dummy
    prefix. Gemma's converter writes ``add_space_prefix = False``, which fastllm
    (as llama.cpp) honours by prepending no ``▁``: a model trained without
    ``add_dummy_prefix`` makes SentencePiece's own ``encode`` do the same, so the
    two encodings are like for like. BPE, not unigram: the file keeps only
    pieces and scores, from which fastllm (as llama.cpp) rebuilds BPE merges."""
    import sentencepiece as spm

    lines = [ln for text in _corpus() for ln in text.splitlines() if ln.strip()]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        num_threads=1,
        minloglevel=2,
    )
    return buf.getvalue()


def make_folder(name: str, folder: str, tokenizer, sp_model: bytes | None) -> torch.nn.Module:
    """The family's tiny random model saved in ``folder`` with the 512-token tokenizer
    (``sp_model``, a SentencePiece model, for Gemma 2)."""
    cfg = copy.deepcopy(GGUF_CONFIGS[name])
    if name == "gemma2":
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_proto=sp_model)
        # The converter pads the vocabulary to the config's size with unused [PADn].
        assert sp.vocab_size() <= cfg.vocab_size, (sp.vocab_size(), cfg.vocab_size)
        cfg.bos_token_id, cfg.eos_token_id = sp.bos_id(), sp.eos_id()
        cfg.pad_token_id = sp.pad_id()
        model = tm._build(name, folder, config=cfg)
        with open(os.path.join(folder, "tokenizer.model"), "wb") as f:
            f.write(sp_model)
        # No tokenizer.json: the converter would not read it. Gemma adds a BOS.
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump(
                {
                    "tokenizer_class": "GemmaTokenizer",
                    "add_bos_token": True,
                    "add_eos_token": False,
                },
                f,
            )
        return model
    cfg.eos_token_id = cfg.pad_token_id = 0  # the tokenizer's <|endoftext|>
    if not 0 <= (cfg.bos_token_id or 0) < tm.VOCAB:
        cfg.bos_token_id = 0
    model = tm._build(name, folder, config=cfg)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    # Phi-3's converter takes the GPT-2 vocabulary path only for a GPT2Tokenizer.
    kind = "GPT2Tokenizer" if name == "phi3" else "PreTrainedTokenizerFast"
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({**TOKENIZER_CONFIG, "tokenizer_class": kind}, f)
    return model


def convert(llama: str, pylib: str, folder: str, out: str, outtype: str) -> None:
    path = [llama, os.path.join(llama, "gguf-py")] + ([pylib] if os.path.isdir(pylib) else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    cmd = [sys.executable, "-c", CONVERT, os.path.join(llama, "convert_hf_to_gguf.py"), folder]
    cmd += ["--outtype", outtype, "--outfile", out]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        tail = [ln for ln in r.stderr.splitlines() if not ln.startswith("INFO:")][-6:]
        raise RuntimeError("converter failed:\n    " + "\n    ".join(tail))


def fastllm_logits(path: str, seqs: list[list[int]]) -> tuple[list[torch.Tensor], dict, dict]:
    with GGUFFile(path) as g:
        hf = hf_config(g)
        model, report = load_gguf_model(
            ModelConfig.from_dict(hf, path=path), g, torch.float32, "cpu"
        )
    pack_linears(model)
    return PagedRunner(model, torch.float32).step(list(enumerate(seqs))), report.tensor_types, hf


def config_diff(hf: dict, ref: object) -> list[str]:
    """Keys of the config fastllm reads from the file that differ from the folder's."""

    def norm(d):  # a rope dict: "default" type = no type; keys the file gives at the top level
        if not isinstance(d, dict):
            return d
        return {
            k: norm(v)
            for k, v in d.items()
            if (k, v) != ("rope_type", "default") and not (k in hf and hf[k] == v)
        }

    out = []
    for key, value in hf.items():
        value, want = norm(value), norm(getattr(ref, key, None))
        if key in ("architectures", "torch_dtype") or want is None or want == value:
            continue
        if (
            isinstance(value, float)
            and isinstance(want, float)
            and math.isclose(value, want, rel_tol=1e-6)
        ):
            continue
        out.append(f"{key}: file {value!r}, folder {want!r}")
    return out


def compare(ours: list[torch.Tensor], refs: list[torch.Tensor]) -> dict:
    err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours, refs))
    same, margins = 0, []
    for a, b in zip(ours, refs):
        for x, y in zip(a, b):
            if x.argmax() == y.argmax():
                same += 1
            else:
                top2 = torch.topk(y, 2).values
                margins.append(((top2[0] - top2[1]) / y.abs().max()).item())
    total = sum(len(b) for b in refs)
    return {"err": err, "same": same, "total": total, "margins": margins}


def tokens_match(path: str, tokenizer, sp_model: bytes | None) -> str:
    """ "same" when the file's tokenizer encodes ``SAMPLE`` as the folder's does."""
    ours = load_tokenizer(path)
    ids = list(ours.encode(SAMPLE, add_special_tokens=False))
    if sp_model is None:
        return "same" if ids == tokenizer.encode(SAMPLE).ids else "DIFF"
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=sp_model)
    want = sp.encode(SAMPLE)
    with_bos = list(ours.encode(SAMPLE, add_special_tokens=True))
    if ids != want:
        return "DIFF"
    return "same" if with_bos == [sp.bos_id(), *want] else "DIFF (BOS)"


def run_family(name: str, args, tokenizer, sp_model: bytes | None, seqs, failures: list) -> dict:
    """Converts the family's folder to F32 and Q8_0 and measures fastllm on both."""
    folder = os.path.join(args.out, name)
    sp_model = sp_model if name == "gemma2" else None
    ref_model = make_folder(name, folder, tokenizer, sp_model)
    refs = tm._reference(ref_model, seqs)
    row = {"family": name}
    for outtype in ("f32", "q8_0"):
        path = os.path.join(folder, f"{name}-{outtype}.gguf")
        try:
            convert(args.llama_dir, args.pylib, folder, path, outtype)
        except RuntimeError as e:
            failures.append(f"{name} {outtype} (convert): {e}")
            continue
        try:
            ours, types, hf = fastllm_logits(path, seqs)
        except Exception as e:  # noqa: BLE001 - reported per family
            failures.append(f"{name} {outtype} (fastllm load): {type(e).__name__}: {e}")
            continue
        row[outtype] = {**compare(ours, refs), "types": types}
        if outtype == "f32":
            row["diff"] = config_diff(hf, ref_model.config)
            try:
                row["tok"] = tokens_match(path, tokenizer, sp_model)
            except Exception as e:  # noqa: BLE001
                row["tok"] = f"error: {type(e).__name__}: {e}"
    return row


def report(rows: list[dict], notes: list[str]) -> None:
    head = f"{'family':10} | {'F32 err':>8} {'argmax':>6} | {'Q8_0 err':>8} {'argmax':>7} "
    head += f"{'max flip margin':>15} | tok"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        f, q = r.get("f32"), r.get("q8_0")
        line = f"{r['family']:10} | "
        if f:
            line += f"{f['err']:8.1e} {'equal' if f['same'] == f['total'] else 'DIFF':>6} | "
        else:
            line += f"{'failed':>15} | "
        if q:
            flip = f"{max(q['margins']):.4f}" if q["margins"] else "-"
            line += f"{q['err']:8.4f} {q['same']:>3}/{q['total']:<3} {flip:>15} | "
        else:
            line += f"{'failed':>32} | "
        print(line + r.get("tok", "-"))
    print("errors: max |fastllm - transformers| / max|transformers| over the sequences;")
    print("flip margin: the reference's top1 - top2 / max|logit| where the argmax differs")
    for r in rows:
        for t in ("f32", "q8_0"):
            if t in r:
                types = ", ".join(f"{k} x{v}" for k, v in sorted(r[t]["types"].items()))
                flips = ", ".join(f"{m:.4f}" for m in sorted(r[t]["margins"])) or "none"
                print(f"  {r['family']} {t}: tensors {types}; flip margins: {flips}")
        for d in r.get("diff", []):
            print(f"  {r['family']}: config from the file differs from the folder's: {d}")
    for note in notes:
        print(note)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", default="/tmp/gguf-families")
    ap.add_argument("--llama-dir", default=os.environ.get("LLAMA_DIR", DEFAULT_LLAMA))
    ap.add_argument(
        "--pylib",
        default=None,
        help="folder holding sentencepiece (default: LLAMA_DIR's pylib, "
        "see benches/build_llama_cpp.sh)",
    )
    ap.add_argument("--families", default=",".join(FAMILIES))
    args = ap.parse_args()
    args.pylib = args.pylib or default_pylib(args.llama_dir)
    if not os.path.isfile(os.path.join(args.llama_dir, "convert_hf_to_gguf.py")):
        sys.exit(
            f"llama.cpp source not found: {args.llama_dir}/convert_hf_to_gguf.py is missing; "
            "pass --llama-dir or set LLAMA_DIR (benches/build_llama_cpp.sh fetch unpacks it)"
        )
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    tokenizer = train_byte_level_bpe(tm.VOCAB)
    seqs = tm._sequences(5, LENGTHS)
    print(
        f"tiny random models (vocab {tm.VOCAB}), sequences of {LENGTHS} tokens "
        f"({sum(LENGTHS)} positions); converter: {args.llama_dir}"
    )
    rows, notes = [], []
    sp_model = None
    for name in args.families.split(","):
        if name == "gemma2" and sp_model is None:
            if importlib.util.find_spec("sentencepiece") is None and os.path.isdir(args.pylib):
                sys.path.append(args.pylib)
            if importlib.util.find_spec("sentencepiece") is None:
                notes.append(
                    "SKIPPED gemma2: its converter reads only a SentencePiece tokenizer.model, "
                    f"and sentencepiece is neither installed nor in {args.pylib}"
                )
                continue
            sp_model = train_sentencepiece(tm.VOCAB)
        rows.append(run_family(name, args, tokenizer, sp_model, seqs, notes))
    report(rows, [n if n.startswith("SKIPPED") else "FAILED " + n for n in notes])


if __name__ == "__main__":
    main()

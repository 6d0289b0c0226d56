"""Test-side GGUF helpers: write an HF folder's tokenizer into a ``gguf.GGUFWriter``
as llama.cpp's converter lays it out, and read a file's metadata back into the
``{key: value}`` dict that ``fastllm.gguf`` reads.

The layout (from the GGUF format and the converter's documented behaviour):
``tokenizer.ggml.tokens`` holds every id in order, ids the HF tokenizer does not
have written as ``[PAD<id>]`` with type UNUSED; added tokens are CONTROL when
special (or spelt ``<|...|>``), else USER_DEFINED; byte-level files carry
``merges`` as ``"left right"`` strings (a space inside a piece spelt as U+0120);
SentencePiece files carry ``scores`` and ``<0xNN>`` tokens of type BYTE.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import gguf

# Pre-tokenizer regexes as the tokenizer.json files of these models spell them.
_HF_SPLITS = {
    "llama-bpe": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
T = gguf.TokenType


def add_tokenizer_metadata(
    writer: gguf.GGUFWriter,
    hf_folder: str,
    pre: str | None = None,
    vocab_size: int | None = None,
) -> None:
    """Adds the ``tokenizer.*`` keys of ``hf_folder`` (tokenizer.json +
    tokenizer_config.json) to ``writer``. ``pre`` names the pre-tokenizer (detected
    from tokenizer.json when None); ``vocab_size`` pads the vocabulary to the
    model's embedding rows, as the converter does with config.json's vocab_size."""
    with open(os.path.join(hf_folder, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    cfg: dict[str, Any] = {}
    cfg_path = os.path.join(hf_folder, "tokenizer_config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    model = tj["model"]
    if model["type"] != "BPE":
        raise ValueError(f"only BPE tokenizers can be written, not {model['type']}")
    spm = bool(model.get("byte_fallback"))

    by_id: dict[int, str] = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in tj.get("added_tokens", [])}
    for i, a in added.items():
        by_id[i] = a["content"]
    n = max(by_id) + 1 if vocab_size is None else vocab_size
    if max(by_id) >= n:
        raise ValueError(f"vocab_size {n} is smaller than the tokenizer ({max(by_id) + 1})")
    tokens: list[str] = []
    types: list[int] = []
    for i in range(n):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(T.UNUSED)
            continue
        tok = by_id[i]
        if i in added:
            looks_special = tok.startswith("<|") and tok.endswith("|>")
            if added[i]["special"] or looks_special:
                types.append(T.UNKNOWN if spm and tok == model.get("unk_token") else T.CONTROL)
            else:
                tok = tok.replace("\u2581", " ")  # user-defined pieces are stored pre-normalized
                types.append(T.USER_DEFINED)
        elif spm and _BYTE_TOKEN.fullmatch(tok):
            types.append(T.BYTE)
        elif spm and tok == model.get("unk_token"):
            types.append(T.UNKNOWN)
        else:
            types.append(T.NORMAL)
        tokens.append(tok)

    merges = [m if isinstance(m, list) else m.split(" ", 1) for m in model.get("merges", [])]
    if spm:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        # SentencePiece merges the pair whose joined piece scores best: a piece
        # scores minus the rank of the first merge that makes it.
        first_merge: dict[str, int] = {}
        for rank, (a, b) in enumerate(merges):
            first_merge.setdefault(a + b, rank)
        scores = [
            -float(first_merge[t] + 1) if ty == T.NORMAL and t in first_merge else 0.0
            for t, ty in zip(tokens, types)
        ]
        writer.add_token_scores(scores)
        writer.add_token_types(types)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre or detect_pre(tj))
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(
            [" ".join(part.replace(" ", "\u0120") for part in pair) for pair in merges]
        )

    text_to_id = {a["content"]: i for i, a in added.items()}
    for name, add_id in (
        ("bos", writer.add_bos_token_id),
        ("eos", writer.add_eos_token_id),
        ("unk", writer.add_unk_token_id),
        ("pad", writer.add_pad_token_id),
    ):
        entry = cfg.get(f"{name}_token")
        text = entry.get("content") if isinstance(entry, dict) else entry
        if isinstance(text, str) and text in text_to_id:
            add_id(text_to_id[text])
    add_bos, add_eos = _added_by_post_processor(tj.get("post_processor"), cfg)
    for flag, add in ((add_bos, writer.add_add_bos_token), (add_eos, writer.add_add_eos_token)):
        if flag is not None:
            add(flag)
    template = cfg.get("chat_template")
    jinja = os.path.join(hf_folder, "chat_template.jinja")
    if template is None and os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            template = f.read()
    if template is not None:
        writer.add_chat_template(template)


def detect_pre(tj: dict[str, Any]) -> str:
    """The ``tokenizer.ggml.pre`` name of a byte-level tokenizer.json's pre-tokenizer."""
    pt = tj.get("pre_tokenizer") or {}
    if pt.get("type") == "ByteLevel" and pt.get("use_regex", True):
        return "gpt-2"
    if pt.get("type") == "Sequence":
        steps = pt["pretokenizers"]
        if (
            len(steps) == 2
            and steps[0].get("type") == "Split"
            and steps[1].get("type") == "ByteLevel"
            and not steps[1].get("use_regex", True)
        ):
            regex = steps[0]["pattern"].get("Regex")
            for name, known in _HF_SPLITS.items():
                if regex == known:
                    return name
        if [s.get("type") for s in steps] == ["Digits", "ByteLevel"] and steps[0].get(
            "individual_digits"
        ):
            return "smollm"
    raise ValueError(f"pre-tokenizer not recognised, pass pre=...: {json.dumps(pt)[:200]}")


def _added_by_post_processor(
    post: dict[str, Any] | None, cfg: dict[str, Any]
) -> tuple[bool | None, bool | None]:
    """(add_bos, add_eos): a TemplateProcessing's first / last special token, else
    tokenizer_config's add_*_token, else False where a ByteLevel one says so."""
    add_bos = cfg.get("add_bos_token") if isinstance(cfg.get("add_bos_token"), bool) else None
    add_eos = cfg.get("add_eos_token") if isinstance(cfg.get("add_eos_token"), bool) else None
    for proc in (post or {}).get("processors", [post] if post else []):
        if proc.get("type") == "TemplateProcessing":
            single = proc.get("single", [])
            add_bos = len(single) > 1 and "SpecialToken" in single[0]
            add_eos = len(single) > 1 and "SpecialToken" in single[-1]
        elif proc.get("type") == "ByteLevel":
            add_bos = False if add_bos is None else add_bos
            add_eos = False if add_eos is None else add_eos
    return add_bos, add_eos


def read_metadata(path: str) -> dict[str, Any]:
    """Every metadata key of a GGUF file with its value: scalars as Python values,
    arrays as lists (a string that is not valid UTF-8 stays ``bytes``)."""
    reader = gguf.GGUFReader(path)
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the header's own fields
            continue
        main = field.types[0]
        if main == gguf.GGUFValueType.ARRAY:
            if field.types[-1] == gguf.GGUFValueType.STRING:
                meta[key] = [_text(bytes(field.parts[i])) for i in field.data]
            else:
                meta[key] = [v for i in field.data for v in field.parts[i].tolist()]
        elif main == gguf.GGUFValueType.STRING:
            meta[key] = _text(bytes(field.parts[-1]))
        else:
            meta[key] = field.parts[-1].tolist()[0]
    return meta


def _text(raw: bytes) -> str | bytes:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw

"""The tokenizer built from a GGUF file's metadata against the Hugging Face
tokenizer of the folder the file was written from (``tokenizers`` on
tokenizer.json and ``transformers.AutoTokenizer``), and against a brute-force
SentencePiece BPE for the ``llama`` vocabulary; then broken metadata, each
with an error that names the file and the key."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import CHAT_TEMPLATE, _corpus
from fastllm.gguf.tokenizer import tokenizer_from_metadata
from fastllm.tokenizer import HFCompatibleTokenizer
from gguf_writer import add_tokenizer_metadata, read_metadata

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPM_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token }}[INST] {{ m['content'] }}"
    " [/INST]{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
SPM_SPECIALS = ("<unk>", "<s>", "</s>")
MULTILINGUAL = (
    "Grüße aus Köln! naïve café, Ελληνικά, русский текст, עברית, العربية, हिन्दी. "
    "日本語のテキストと中文文本，한국어 문장。 Ünïcödé e\u0301 A\u030a n\u0303 "
    "emoji 🦙🚀 👩\u200d💻 🇫🇷 ✅ ½ ∑ ∞ ≠ "
)


def _text_sample() -> str:
    code = next(iter(_corpus()))[:3000]
    return (
        code
        + "\n\n\n    indented\n\t\ttabs\t \t\n  \n"
        + MULTILINGUAL
        + "digits 0 12 345 6789 1234567890 3.14159 1,000,000 0x1F "
        + "I've they'll WE'RE it's   trailing   \n\n"
        + " leading space and   runs  of   spaces     "
    )


def _specials_text(specials: list[str]) -> str:
    return "".join(f"before{s}after {s} x{s}\n" for s in specials)


def _train(tok, vocab_size: int, texts, special_tokens=(), **kwargs) -> None:
    from tokenizers import pre_tokenizers, trainers

    kwargs.setdefault("initial_alphabet", pre_tokenizers.ByteLevel.alphabet())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False, **kwargs
    )
    tok.train_from_iterator(texts, trainer=trainer)


def _training_text() -> list[str]:
    texts = list(_corpus())[:25]
    return [*texts, MULTILINGUAL * 3]


def _save(out, tok_json: dict, config: dict) -> str:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok_json, f, ensure_ascii=False)
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({**cfg, **config}, f)
    return str(out)


def _qwen2_folder(out) -> str:
    """Configured as Qwen2's tokenizer.json: NFC, its split regex, byte-level BPE,
    special tokens after the vocabulary, plus one user-defined (non-special) token."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    _train(tok, 900, _training_text())
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.add_tokens(["<think>"])
    cfg = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
    }
    return _save(out, json.loads(tok.to_str()), cfg)


def _llama3_folder(out) -> str:
    """Configured as Llama-3's tokenizer.json: its split regex, ignore_merges, BOS
    added by a TemplateProcessing post-processor."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    _train(tok, 900, _training_text())
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>"]
    specials += ["<|end_header_id|>", "<|reserved_special_token_0|>", "<|eot_id|>"]
    tok.add_special_tokens(specials)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
                special_tokens=[("<|begin_of_text|>", bos)],
            ),
        ]
    )
    doc = json.loads(tok.to_str())
    doc["model"]["ignore_merges"] = True
    cfg = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3_TEMPLATE,
    }
    return _save(out, doc, cfg)


def _spm_folder(out) -> str:
    """A Llama-2-style tokenizer.json: ``▁`` spaces and a prefix space from the
    normalizer, BPE with byte fallback over ``<0xNN>`` tokens at ids 3..258,
    ``<unk> <s> </s>`` at 0..2, the ByteFallback/Fuse/Strip decoder, and the
    merges a SentencePiece vocabulary implies (every cut of each piece into two
    pieces, in the pieces' order), as transformers converts Llama-2's model."""
    from tokenizers import Tokenizer, models, normalizers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    lines = [line for text in _training_text() for line in text.splitlines() if line.strip()]
    # A small alphabet: rarer characters (CJK, emoji) are spelt in byte tokens.
    _train(
        tok,
        1100,
        lines,
        special_tokens=["<unk>", "<s>", "</s>"],
        limit_alphabet=150,
        initial_alphabet=[],
    )
    trained = json.loads(tok.to_str())["model"]["vocab"]
    pieces = [t for t, _ in sorted(trained.items(), key=lambda kv: kv[1]) if t not in SPM_SPECIALS]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = 3 + b
    for p in pieces:
        vocab.setdefault(p, len(vocab))
    normal = {p: i for p, i in vocab.items() if i >= 259}
    merges = []
    for p in sorted(normal, key=normal.__getitem__):
        cuts = [(p[:k], p[k:]) for k in range(1, len(p)) if p[:k] in normal and p[k:] in normal]
        merges += sorted(cuts, key=lambda c: (normal[c[0]], normal[c[1]]))
    added = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for t, i in (("<unk>", 0), ("<s>", 1), ("</s>", 2))
    ]
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": json.loads(tok.to_str())["normalizer"],
        "pre_tokenizer": None,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<s>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"SpecialToken": {"id": "<s>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": "<s>", "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
        },
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": "<unk>",
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [list(m) for m in merges],
        },
    }
    cfg = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "chat_template": SPM_TEMPLATE,
    }
    return _save(out, doc, cfg)


def _write_gguf(path: str, folder: str, pre: str | None = None) -> str:
    writer = gguf.GGUFWriter(path, arch="llama")
    add_tokenizer_metadata(writer, folder, pre=pre)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class Case:
    """One HF folder, the GGUF written from it, and the tokenizers built from both."""

    def __init__(self, folder: str, gguf_path: str, specials: list[str]) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.folder = folder
        self.path = gguf_path
        self.meta = read_metadata(gguf_path)
        self.tok = tokenizer_from_metadata(self.meta, gguf_path)
        self.ref = HFTokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        self.specials = specials


@pytest.fixture(scope="module")
def cases(tmp_path_factory, tokenizer_dir) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("gguf_tok")
    folders = {
        "gpt2": (tokenizer_dir, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
        "qwen2": (_qwen2_folder(root / "qwen2"), ["<|endoftext|>", "<|im_end|>", "<think>"]),
        "llama3": (_llama3_folder(root / "llama3"), ["<|begin_of_text|>", "<|eot_id|>"]),
        "spm": (_spm_folder(root / "spm"), ["<s>", "</s>", "<unk>"]),
    }
    return {
        name: Case(folder, _write_gguf(str(root / f"{name}.gguf"), folder), specials)
        for name, (folder, specials) in folders.items()
    }


NAMES = ["gpt2", "qwen2", "llama3", "spm"]


def test_writer_names_the_pre_tokenizer_of_each_style(cases):
    assert cases["gpt2"].meta["tokenizer.ggml.pre"] == "gpt-2"
    assert cases["qwen2"].meta["tokenizer.ggml.pre"] == "qwen2"
    assert cases["llama3"].meta["tokenizer.ggml.pre"] == "llama-bpe"
    assert cases["spm"].meta["tokenizer.ggml.model"] == "llama"
    types = cases["spm"].meta["tokenizer.ggml.token_type"]
    assert types[0] == gguf.TokenType.UNKNOWN and types[1] == gguf.TokenType.CONTROL
    assert set(types[3:259]) == {gguf.TokenType.BYTE}


@pytest.mark.parametrize("name", NAMES)
def test_encode_decode_match_the_tokenizer_json(cases, name):
    case = cases[name]
    text = _text_sample() + _specials_text(case.specials)
    for add in (True, False):
        ids = case.tok.encode(text, add_special_tokens=add)
        assert ids == case.ref.encode(text, add_special_tokens=add).ids, add
    for skip in (True, False):
        assert case.tok.decode(ids, skip) == case.ref.decode(ids, skip_special_tokens=skip)
    # Every token of the vocabulary decodes alike, one at a time.
    every = list(range(case.ref.get_vocab_size()))
    assert [case.tok.decode([i], False) for i in every] == [
        case.ref.decode([i], skip_special_tokens=False) for i in every
    ]


@pytest.mark.parametrize("name", NAMES)
def test_encode_decode_match_transformers(cases, name):
    from transformers import AutoTokenizer

    case = cases[name]
    hf = AutoTokenizer.from_pretrained(case.folder)
    ours = HFCompatibleTokenizer(case.tok)
    text = _text_sample() + _specials_text(case.specials)
    ids = hf.encode(text)
    assert ours.encode(text) == ids
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == hf.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    assert ours.eos_token_id == hf.eos_token_id
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.pad_token_id == hf.pad_token_id
    assert ours.all_special_ids == sorted(
        i for i, t in hf.added_tokens_decoder.items() if t.special
    )
    messages = [{"role": "user", "content": "hi 你好"}, {"role": "assistant", "content": "ok"}]
    assert ours.apply_chat_template(messages, tokenize=False) == hf.apply_chat_template(
        messages, tokenize=False
    )
    assert ours.apply_chat_template(messages, return_dict=False) == hf.apply_chat_template(
        messages, return_dict=False
    )


def test_special_ids_add_bos_and_chat_template(cases):
    qwen, llama3, spm, gpt2 = cases["qwen2"], cases["llama3"], cases["spm"], cases["gpt2"]
    im_end = qwen.ref.token_to_id("<|im_end|>")
    assert qwen.tok.eos_token_id == im_end and qwen.tok.bos_token_id is None
    assert not qwen.tok.add_bos_token and qwen.tok.chat_template == CHAT_TEMPLATE
    assert qwen.tok.end_of_turn_token_ids() == [im_end]
    assert qwen.tok.token_to_id("<think>") not in qwen.tok.all_special_ids

    bot = llama3.ref.token_to_id("<|begin_of_text|>")
    assert llama3.tok.add_bos_token and llama3.tok.bos_token_id == bot
    assert llama3.tok.encode("hi")[0] == bot and llama3.tok.encode("hi", False)[0] != bot
    assert llama3.tok.encode("") == [bot]
    assert llama3.tok.end_of_turn_token_ids() == [llama3.ref.token_to_id("<|eot_id|>")]

    assert spm.tok.add_bos_token and (spm.tok.bos_token_id, spm.tok.eos_token_id) == (1, 2)
    assert spm.tok.encode("hello")[0] == 1 and spm.tok.encode("hello")[1] != 1
    assert gpt2.tok.chat_template == CHAT_TEMPLATE and gpt2.tok.eos_token_id == 0


def test_eot_and_add_eos_from_the_metadata(cases):
    case = cases["llama3"]
    reserved = case.ref.token_to_id("<|reserved_special_token_0|>")
    meta = dict(case.meta)
    meta["tokenizer.ggml.eot_token_id"] = reserved
    meta["tokenizer.ggml.add_eos_token"] = True
    meta["tokenizer.ggml.eos_token_id"] = case.ref.token_to_id("<|end_of_text|>")
    tok = tokenizer_from_metadata(meta, case.path)
    assert reserved in tok.end_of_turn_token_ids()
    ids = tok.encode("hi there")
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert ids[1:-1] == case.ref.encode("hi there", add_special_tokens=False).ids


def _spm_reference(case: Case, text: str) -> list[int]:
    """llama.cpp's SentencePiece BPE, brute force: text split at the special
    tokens; each piece gets the prefix space and ``▁`` for spaces, then the
    adjacent pair whose joined piece scores best is merged (leftmost on ties)
    until none is left; a piece missing from the vocabulary is spelt in bytes."""
    meta = case.meta
    tokens = meta["tokenizer.ggml.tokens"]
    scores = meta["tokenizer.ggml.scores"]
    types = meta["tokenizer.ggml.token_type"]
    normal = {t: i for i, t in enumerate(tokens) if types[i] == gguf.TokenType.NORMAL}
    specials = sorted(SPM_SPECIALS, key=len, reverse=True)
    out = [1]
    rest = text
    while rest:
        cut = min(((rest.find(s), -len(s), s) for s in specials if s in rest), default=None)
        piece, special = (rest, None) if cut is None else (rest[: cut[0]], cut[2])
        rest = "" if cut is None else rest[cut[0] + len(special) :]
        if piece:
            symbols = list("\u2581" + piece.replace(" ", "\u2581"))
            while True:
                best = None
                for k in range(len(symbols) - 1):
                    joined = symbols[k] + symbols[k + 1]
                    if joined in normal and (best is None or scores[normal[joined]] > best[0]):
                        best = (scores[normal[joined]], k)
                if best is None:
                    break
                k = best[1]
                symbols[k : k + 2] = [symbols[k] + symbols[k + 1]]
            for s in symbols:
                if s in normal:
                    out.append(normal[s])
                else:
                    out += [3 + b for b in s.encode("utf-8")]
        if special is not None:
            out.append(tokens.index(special))
    return out


def test_spm_matches_a_brute_force_sentencepiece(cases):
    case = cases["spm"]
    text = _text_sample() + _specials_text(case.specials)
    assert case.tok.encode(text) == _spm_reference(case, text)


_ALL_SPECIALS = ["<|endoftext|>", "<|im_end|>", "<think>", "<|begin_of_text|>", "<|eot_id|>"]
_TEXT = st.lists(
    st.one_of(
        st.text(
            alphabet=st.one_of(
                st.characters(codec="utf-8", exclude_categories=("Cs",)),
                st.sampled_from(list(" \t\n\r  ") + list("aé日🦙1'")),
            ),
            max_size=20,
        ),
        st.sampled_from(_ALL_SPECIALS + list(SPM_SPECIALS)),
    ),
    max_size=6,
).map("".join)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=_TEXT)
def test_random_text_matches(cases, text):
    for name in NAMES:
        case = cases[name]
        ids = case.tok.encode(text)
        assert ids == case.ref.encode(text).ids, name
        assert case.tok.decode(ids, False) == case.ref.decode(ids, skip_special_tokens=False)
    assert cases["spm"].tok.encode(text) == _spm_reference(cases["spm"], text)


def test_numpy_arrays_and_bytes_tokens(cases):
    """The metadata's arrays may be numpy arrays, and a SentencePiece token that
    is not valid UTF-8 comes as bytes: it builds, and the rest encodes alike."""
    case = cases["spm"]
    meta = dict(case.meta)
    meta["tokenizer.ggml.scores"] = np.asarray(meta["tokenizer.ggml.scores"], dtype=np.float32)
    meta["tokenizer.ggml.token_type"] = np.asarray(meta["tokenizer.ggml.token_type"], np.int32)
    tokens = list(meta["tokenizer.ggml.tokens"])
    last = len(tokens) - 1  # the last piece: no other piece is built from it
    tokens[last] = b"\xff\xfe" + tokens[last].encode("utf-8")
    meta["tokenizer.ggml.tokens"] = tokens
    tok = tokenizer_from_metadata(meta, case.path)
    text = "plain words 日本 🦙"
    assert tok.encode(text) == case.tok.encode(text)


@pytest.mark.parametrize("pre", ["default", "smollm", "deepseek-llm", "gpt-4o", "tekken", "olmo"])
def test_other_pre_tokenizers_build_and_round_trip(cases, pre):
    meta = dict(cases["gpt2"].meta, **{"tokenizer.ggml.pre": pre})
    tok = tokenizer_from_metadata(meta, "x.gguf")
    text = _text_sample()
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_smollm_pre_tokenizer_matches_its_tokenizer_json(cases, tmp_path):
    """smollm: single digits, then GPT-2's split (a Digits + ByteLevel tokenizer.json)."""
    from tokenizers import Tokenizer as HFTokenizer

    src = cases["gpt2"]
    doc = json.loads(src.ref.to_str())
    doc["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": True,
                "use_regex": True,
            },
        ],
    }
    folder = _save(tmp_path / "smollm", doc, {"eos_token": "<|endoftext|>"})
    path = _write_gguf(str(tmp_path / "smollm.gguf"), folder)
    meta = read_metadata(path)
    assert meta["tokenizer.ggml.pre"] == "smollm"
    tok = tokenizer_from_metadata(meta, path)
    ref = HFTokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    text = _text_sample()
    assert tok.encode(text) == ref.encode(text).ids


def _broken(meta: dict, **changes) -> dict:
    out = dict(meta)
    for key, value in changes.items():
        key = key.replace("__", ".")
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


@pytest.mark.parametrize(
    "base, changes, key, words",
    [
        ("gpt2", {"tokenizer__ggml__tokens": None}, "tokenizer.ggml.tokens", "no"),
        ("gpt2", {"tokenizer__ggml__model": None}, "tokenizer.ggml.model", "no"),
        ("gpt2", {"tokenizer__ggml__merges": None}, "tokenizer.ggml.merges", "required"),
        ("spm", {"tokenizer__ggml__scores": None}, "tokenizer.ggml.scores", "required"),
        ("gpt2", {"tokenizer__ggml__model": "rwkv"}, "tokenizer.ggml.model", "'rwkv'"),
        ("gpt2", {"tokenizer__ggml__model": "rwkv"}, "tokenizer.ggml.model", "gpt2, llama"),
        ("gpt2", {"tokenizer__ggml__pre": "made-up"}, "tokenizer.ggml.pre", "'made-up'"),
        ("gpt2", {"tokenizer__ggml__token_type": [1, 1]}, "tokenizer.ggml.token_type", "2 entries"),
        ("spm", {"tokenizer__ggml__scores": [0.0]}, "tokenizer.ggml.scores", "1 entries"),
        ("gpt2", {"tokenizer__ggml__eos_token_id": 10**6}, "eos_token_id", "out of range"),
        ("gpt2", {"tokenizer__ggml__bos_token_id": -1}, "bos_token_id", "out of range"),
        ("gpt2", {"tokenizer__ggml__bos_token_id": "1"}, "bos_token_id", "integer"),
        ("gpt2", {"tokenizer__ggml__merges": ["Ġt", "a b"]}, "tokenizer.ggml.merges", "'Ġt'"),
        ("gpt2", {"tokenizer__ggml__merges": ["zz qq"]}, "tokenizer.ggml.merges", "zz"),
        ("gpt2", {"tokenizer__ggml__tokens": []}, "tokenizer.ggml.tokens", "empty"),
        ("gpt2", {"tokenizer__chat_template": 3}, "tokenizer.chat_template", "string"),
    ],
)
def test_broken_metadata_names_the_file_and_key(cases, base, changes, key, words):
    meta = _broken(cases[base].meta, **changes)
    with pytest.raises(ValueError) as err:
        tokenizer_from_metadata(meta, "/models/broken.gguf")
    message = str(err.value)
    assert "/models/broken.gguf" in message and key in message and words in message, message
    if "'made-up'" in words:
        assert "qwen2" in message and "llama-bpe" in message


def test_folder_tokenizer_is_unchanged(tokenizer_dir):
    """The folder constructor still reads tokenizer.json and tokenizer_config.json."""
    from fastllm.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_dir)
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
    assert tok.bos_token_id is None and not tok.add_bos_token
    assert tok.chat_template == CHAT_TEMPLATE and tok.all_special_ids == {0, 1, 2}
    assert tok.end_of_turn_token_ids() == [2, 0]


@pytest.mark.parametrize("name", NAMES)
def test_matches_transformers_gguf_loader(cases, name):
    """transformers' own GGUF tokenizer conversion, an independent reading of the
    same file, encodes alike, where it means to: it has no NFC step for qwen2 (the
    model's tokenizer.json has one, so text is NFC here), and for SentencePiece it
    prepends the space only at the start of the text, where llama.cpp and the
    Llama-2 tokenizer.json also do after each special token (none in the text)."""
    import unicodedata

    from transformers import AutoTokenizer

    case = cases[name]
    hf = AutoTokenizer.from_pretrained(
        os.path.dirname(case.path), gguf_file=os.path.basename(case.path)
    )
    text = unicodedata.normalize("NFC", _text_sample())
    if name != "spm":
        text += _specials_text(case.specials)
    assert case.tok.encode(text, add_special_tokens=False) == hf.encode(
        text, add_special_tokens=False
    )
    assert case.tok.encode("hi") == hf.encode("hi")


def test_spm_without_the_prefix_space(cases, tmp_path):
    """``tokenizer.ggml.add_space_prefix = false``: no ``▁`` prepended (and none
    stripped when decoding), as a tokenizer.json without the Prepend normalizer."""
    from tokenizers import Tokenizer as HFTokenizer

    case = cases["spm"]
    doc = json.loads(case.ref.to_str())
    doc["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    doc["decoder"]["decoders"] = doc["decoder"]["decoders"][:3]
    ref = HFTokenizer.from_str(json.dumps(doc))
    tok = tokenizer_from_metadata(
        dict(case.meta, **{"tokenizer.ggml.add_space_prefix": False}), case.path
    )
    text = _text_sample() + _specials_text(case.specials)
    ids = tok.encode(text)
    assert ids == ref.encode(text).ids
    plain = text
    for special in case.specials:
        plain = plain.replace(special, "")
    assert tok.decode(ids) == ref.decode(ids) == plain

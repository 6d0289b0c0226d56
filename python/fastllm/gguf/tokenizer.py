"""The tokenizer a GGUF file describes in its metadata (``tokenizer.ggml.*``),
rebuilt as the ``tokenizers`` pipeline its Hugging Face ``tokenizer.json`` has.

Three vocabularies are supported: ``gpt2`` (byte-level BPE: tokens, merges and a
pre-tokenizer named by ``tokenizer.ggml.pre``), ``llama`` (SentencePiece-style
BPE: tokens and scores, with byte fallback and the ``▁`` space) and ``bert``
(an encoder's WordPiece vocabulary, ``_wordpiece_tokenizer``), and ``t5``
(a SentencePiece Unigram vocabulary, as XLM-RoBERTa encoders have it:
``_unigram_tokenizer``). The pipeline is
written as one ``tokenizer.json`` document and parsed in Rust by
``Tokenizer.from_str``: that keeps every token at the id the file gives it
(added tokens included) and builds a 150k-token vocabulary in a fraction of a
second.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from operator import itemgetter
from typing import Any

import numpy as np

from fastllm.tokenizer import Tokenizer

# gguf.TokenType, spelled out so that loading a file needs no gguf package.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_KEY_MODEL = "tokenizer.ggml.model"
_KEY_PRE = "tokenizer.ggml.pre"
_KEY_TOKENS = "tokenizer.ggml.tokens"
_KEY_TYPES = "tokenizer.ggml.token_type"
_KEY_MERGES = "tokenizer.ggml.merges"
_KEY_SCORES = "tokenizer.ggml.scores"

# The pre-tokenizer splits of each ``tokenizer.ggml.pre`` name (the regexes of the
# tokenizer.json files the names stand for). A list is applied in turn, each regex
# splitting the pieces the previous one left, matches and gaps alike.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's: Qwen2's with combining marks (\p{M}) kept in words.
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = [
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
]
# Code points written as \x{...} escapes: some of these letters change under
# Unicode normalization, which would empty their ranges.
_DEEPSEEK_LLM = [
    r"[\r\n]",
    (
        r"\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-"
        r"\x{293}\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}"
        r"\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-"
        r"\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}"
        r"\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-"
        r"\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}"
        r"\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}"
        r"\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}"
        r"\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}"
        r"\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}"
        r"\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}"
        r"\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}"
        r"\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-"
        r"\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}"
        r"\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}"
        r"\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}"
        r"\x{1E900}-\x{1E943}]+"
    ),
    r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+",
    r"\s+$",
    r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+",
    r"\p{N}+",
]


class _Pre:
    """How one ``tokenizer.ggml.pre`` name splits text before the byte-level BPE."""

    def __init__(
        self,
        splits: list[str] | None,
        gpt2_regex: bool = False,
        ignore_merges: bool = False,
        add_bos: bool = False,
        nfc: bool = False,
    ) -> None:
        self.splits = splits or []  # regexes applied first, in turn
        self.gpt2_regex = gpt2_regex  # then GPT-2's own split (ByteLevel's regex)
        self.ignore_merges = ignore_merges  # a word found whole in the vocabulary is one token
        self.add_bos = add_bos  # llama.cpp's default when the file has no add_bos_token
        self.nfc = nfc  # NFC normalization first, as the model's tokenizer.json does


_PRE: dict[str, _Pre] = {
    "default": _Pre(_DEFAULT),
    "gpt-2": _Pre(None, gpt2_regex=True),
    "phi-2": _Pre(None, gpt2_regex=True),
    "mpt": _Pre(None, gpt2_regex=True),
    "olmo": _Pre(None, gpt2_regex=True),
    "smollm": _Pre([r"\p{N}"], gpt2_regex=True),
    "starcoder": _Pre([r"\p{N}"], gpt2_regex=True),
    "refact": _Pre([r"\p{N}"], gpt2_regex=True),
    "codeshell": _Pre([r"\p{N}"], gpt2_regex=True),
    "llama-bpe": _Pre([_LLAMA3], ignore_merges=True, add_bos=True),
    "llama3": _Pre([_LLAMA3], ignore_merges=True, add_bos=True),
    "llama-v3": _Pre([_LLAMA3], ignore_merges=True, add_bos=True),
    "falcon3": _Pre([_LLAMA3], ignore_merges=True, add_bos=True),
    "dbrx": _Pre([_LLAMA3]),
    "smaug-bpe": _Pre([_LLAMA3], ignore_merges=True, add_bos=True),
    "lfm2": _Pre([_LLAMA3], ignore_merges=True, add_bos=True),  # as llama.cpp reads it
    "qwen2": _Pre([_QWEN2], nfc=True),
    "deepseek-r1-qwen": _Pre([_QWEN2]),
    "qwen35": _Pre([_QWEN35], nfc=True),
    "deepseek-llm": _Pre(_DEEPSEEK_LLM),
    "gpt-4o": _Pre([_GPT4O]),
    "llama4": _Pre([_GPT4O]),
    "tekken": _Pre([_TEKKEN], add_bos=True),
}

SUPPORTED_MODELS = ("gpt2", "llama", "bert", "t5")
SUPPORTED_PRE = tuple(sorted(_PRE))


def tokenizer_from_metadata(meta: Mapping[str, Any], source: str) -> Tokenizer:
    """The tokenizer a GGUF file's metadata describes; ``source`` (the file) names
    it in every error."""
    model = meta.get(_KEY_MODEL)
    if model is None:
        raise ValueError(f"{source}: GGUF metadata has no {_KEY_MODEL}: the file has no tokenizer")
    if model not in SUPPORTED_MODELS:
        raise ValueError(
            f"{source}: {_KEY_MODEL} = {model!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODELS)}"
        )
    tokens = _tokens(meta, source)
    n = len(tokens)
    types = _int_list(meta, _KEY_TYPES, n, source)
    if types is None:
        types = [NORMAL] * n
    if model == "bert":
        return _wordpiece_tokenizer(meta, tokens, types, source)
    if model == "t5":
        return _unigram_tokenizer(meta, tokens, types, source)
    ids = {name: _token_id(meta, name, n, source) for name in _SPECIAL_KEYS}
    kinds = _Kinds(types)
    vocab = _model_vocab(tokens, kinds)

    if model == "gpt2":
        pre = _pre(meta, source)
        merges = _merges(meta, source)
        pipeline = _byte_level_pipeline(pre)
        options = {"ignore_merges": pre.ignore_merges}
        add_bos_default = pre.add_bos
    else:
        add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        merges = _spm_merges(tokens, types, _scores(meta, n, source), vocab)
        pipeline = _spm_pipeline(add_space_prefix)
        unk = ids["unknown"]
        options = {
            "unk_token": tokens[unk] if unk is not None else None,
            "fuse_unk": True,
            "byte_fallback": True,
        }
        add_bos_default = True  # llama.cpp's default for SentencePiece vocabularies
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    pipeline["post_processor"] = _post_processor(
        tokens, ids["bos"] if add_bos else None, ids["eos"] if add_eos else None, model == "gpt2"
    )
    tok = _assemble(pipeline, vocab, merges, options, source)
    special, plain = _added_tokens(tokens, kinds)
    _add_tokens(tok, special, plain)

    def text(name: str) -> str | None:
        i = ids[name]
        return tokens[i] if i is not None else None

    config: dict[str, Any] = {
        "bos_token": text("bos"),
        "eos_token": text("eos"),
        "pad_token": text("padding"),
        "unk_token": text("unknown"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{source}: tokenizer.chat_template must be a string")
    end_ids = [i for i in (ids["eot"], ids["eom"]) if i is not None]
    result = Tokenizer.from_backend(tok, config, template or None, end_of_turn_ids=end_ids)
    # Ids straight from the file: a token text may be spelt twice in a vocabulary.
    result.bos_token_id = ids["bos"]
    result.eos_token_id = ids["eos"]
    return result


_SPECIAL_KEYS = ("bos", "eos", "padding", "unknown", "eot", "eom")


def _assemble(
    pipeline: dict[str, Any],
    vocab: dict[str, int],
    merges: list[tuple[str, str]],
    options: dict[str, Any],
    source: str,
) -> Any:
    """The ``tokenizers.Tokenizer``: the BPE model built from Python objects (the
    fastest way in), the rest of the pipeline parsed from its tokenizer.json form."""
    from tokenizers import Tokenizer as _HFTokenizer
    from tokenizers import models

    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        **pipeline,
        "model": {"type": "BPE", "vocab": {}, "merges": []},
    }
    skeleton = _HFTokenizer.from_str(json.dumps(doc))
    try:
        model = models.BPE(vocab, merges, **options)
    except BaseException as e:  # an error, or a panic of the library on a bad merge
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        _check_merges(merges, vocab, source)
        raise ValueError(f"{source}: could not build the tokenizer from {_KEY_MERGES}: {e}") from e
    tok = _HFTokenizer(model)
    for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        value = getattr(skeleton, part)
        if value is not None:
            setattr(tok, part, value)
    return tok


def _check_merges(merges: list[tuple[str, str]], vocab: dict[str, int], source: str) -> None:
    for i, (left, right) in enumerate(merges):
        if left not in vocab or right not in vocab or left + right not in vocab:
            raise ValueError(
                f"{source}: {_KEY_MERGES}[{i}] = {left + ' ' + right!r} joins tokens "
                f"missing from {_KEY_TOKENS}"
            )


def _add_tokens(tok: Any, special: list[str], plain: list[str]) -> None:
    """Added tokens, matched whole in the text before the model runs. Each is in
    the model's vocabulary, so it keeps the id the file gives it."""
    from tokenizers import AddedToken

    if special:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    if plain:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])


def _pre(meta: Mapping[str, Any], source: str) -> _Pre:
    name = meta.get(_KEY_PRE, "default")
    pre = _PRE.get(name) if isinstance(name, str) else None
    if pre is None:
        raise ValueError(
            f"{source}: {_KEY_PRE} = {name!r} is not a supported pre-tokenizer; "
            f"supported: {', '.join(SUPPORTED_PRE)}"
        )
    return pre


def _tokens(meta: Mapping[str, Any], source: str) -> list[str]:
    raw = meta.get(_KEY_TOKENS)
    if raw is None:
        raise ValueError(f"{source}: GGUF metadata has no {_KEY_TOKENS}")
    if isinstance(raw, (str, bytes)):
        raise ValueError(f"{source}: {_KEY_TOKENS} must be an array of strings")
    tokens = list(raw)
    if not tokens:
        raise ValueError(f"{source}: {_KEY_TOKENS} is empty")
    for i, t in enumerate(tokens):
        if isinstance(t, str):
            continue
        if isinstance(t, (bytes, bytearray, memoryview)):
            # A SentencePiece piece need not be valid UTF-8: such a token can never be
            # produced from text, so a replacement character is all it needs.
            tokens[i] = bytes(t).decode("utf-8", errors="replace")
        else:
            raise ValueError(f"{source}: {_KEY_TOKENS}[{i}] is {type(t).__name__}, not a string")
    return tokens


def _int_list(meta: Mapping[str, Any], key: str, n: int, source: str) -> list[int] | None:
    raw = meta.get(key)
    if raw is None:
        return None
    try:
        if getattr(getattr(raw, "dtype", None), "kind", "") in ("i", "u"):  # numpy integers
            values = raw.tolist()
        else:
            values = [int(v) for v in (raw.tolist() if hasattr(raw, "tolist") else raw)]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {key} must be an array of integers: {e}") from e
    if len(values) != n:
        raise ValueError(f"{source}: {key} has {len(values)} entries but {_KEY_TOKENS} has {n}")
    return values


def _token_id(meta: Mapping[str, Any], name: str, n: int, source: str) -> int | None:
    key = f"tokenizer.ggml.{name}_token_id"
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"{source}: {key} must be an integer, not {value!r}")
    value = int(value)  # numpy integers too
    if not 0 <= value < n:
        raise ValueError(
            f"{source}: {key} = {value} is out of range: the vocabulary has {n} tokens"
        )
    return value


def _merges(meta: Mapping[str, Any], source: str) -> list[tuple[str, str]]:
    """``"left right"`` strings as pairs, cut at the first space after the first
    character (a piece is never empty)."""
    raw = meta.get(_KEY_MERGES)
    if raw is None:
        raise ValueError(f"{source}: GGUF metadata has no {_KEY_MERGES} (required for gpt2)")
    raw = raw.tolist() if hasattr(raw, "tolist") else list(raw)
    try:
        parts = [m.partition(" ") for m in raw]
    except (AttributeError, TypeError):  # bytes, or not strings at all
        raw = [m.decode("utf-8", errors="replace") if isinstance(m, bytes) else m for m in raw]
        bad = next((i for i, m in enumerate(raw) if not isinstance(m, str)), None)
        if bad is not None:
            raise ValueError(f"{source}: {_KEY_MERGES}[{bad}] is not a string") from None
        parts = [m.partition(" ") for m in raw]
    if all(map(itemgetter(0), parts)) and all(map(itemgetter(1), parts)):
        return list(zip(map(itemgetter(0), parts), map(itemgetter(2), parts)))
    merges = []
    for i, m in enumerate(raw):  # the rare merge whose left piece starts with a space
        cut = m.find(" ", 1)
        if cut < 0:
            raise ValueError(f"{source}: {_KEY_MERGES}[{i}] = {m!r} is not 'left right'")
        merges.append((m[:cut], m[cut + 1 :]))
    return merges


def _scores(meta: Mapping[str, Any], n: int, source: str) -> list[float]:
    raw = meta.get(_KEY_SCORES)
    if raw is None:
        raise ValueError(f"{source}: GGUF metadata has no {_KEY_SCORES} (required for llama)")
    scores = raw.tolist() if hasattr(raw, "tolist") else list(raw)
    if len(scores) != n:
        raise ValueError(
            f"{source}: {_KEY_SCORES} has {len(scores)} entries but {_KEY_TOKENS} has {n}"
        )
    return scores


def _byte_level_pipeline(pre: _Pre) -> dict[str, Any]:
    """Normalizer, pre-tokenizer and decoder of a byte-level BPE tokenizer.json."""
    byte_level = {"add_prefix_space": False, "trim_offsets": True}
    steps: list[dict[str, Any]] = [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
        for regex in pre.splits
    ]
    steps.append({"type": "ByteLevel", **byte_level, "use_regex": pre.gpt2_regex})
    return {
        "normalizer": {"type": "NFC"} if pre.nfc else None,
        "pre_tokenizer": steps[0]
        if len(steps) == 1
        else {"type": "Sequence", "pretokenizers": steps},
        "decoder": {"type": "ByteLevel", **byte_level, "use_regex": True},
    }


def _spm_pipeline(add_space_prefix: bool) -> dict[str, Any]:
    """Normalizer and decoder of a Llama-2-style tokenizer.json: ``▁`` for spaces,
    a ``▁`` prefix (stripped again when decoding), byte tokens fused back."""
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    prefix = {"type": "Prepend", "prepend": "\u2581"}
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if add_space_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "normalizer": (
            {"type": "Sequence", "normalizers": [prefix, replace]} if add_space_prefix else replace
        ),
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
    }


class _Kinds:
    """The token ids of each non-normal type, found with one vectorised pass
    (a padded vocabulary can have over a hundred thousand unused slots)."""

    def __init__(self, types: list[int]) -> None:
        arr = np.asarray(types)
        self.unused_mask = arr == UNUSED
        self.unused = np.flatnonzero(self.unused_mask).tolist()
        self.special = np.flatnonzero((arr == CONTROL) | (arr == UNKNOWN)).tolist()
        self.user_defined = np.flatnonzero(arr == USER_DEFINED).tolist()


def _model_vocab(tokens: list[str], kinds: _Kinds) -> dict[str, int]:
    """Token text -> id for every token but the unused slots ([PADn] padding of the
    vocabulary); a text spelt twice keeps its first id. Added tokens are in it too:
    ``tokenizers`` keeps an added token at the id its model gives it, and would
    renumber one the model lacks."""
    vocab = dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1)))
    if len(kinds.unused) > 64:
        keep = (~kinds.unused_mask).tolist()
        return {t: i for t, i in vocab.items() if keep[i]}
    for i in kinds.unused:
        if vocab.get(tokens[i]) == i:
            del vocab[tokens[i]]
    return vocab


def _spm_merges(
    tokens: list[str], types: list[int], scores: list[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: every way of cutting a
    normal token into two normal tokens, best score first (ties: the lower id), so
    that BPE merges the pair whose joined piece scores highest, as SentencePiece
    does. The cuts of one token are ordered by the ids of their halves."""
    normal = {t: i for t, i in vocab.items() if types[i] == NORMAL}
    per_token: list[tuple[float, int, list[tuple[str, str]]]] = []
    for t, i in normal.items():
        if len(t) < 2:
            continue
        cuts = [(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in normal and t[k:] in normal]
        if cuts:
            cuts.sort(key=lambda c: (normal[c[0]], normal[c[1]]))
            per_token.append((-float(scores[i]), i, cuts))
    per_token.sort(key=lambda e: (e[0], e[1]))
    return [cut for _, _, cuts in per_token for cut in cuts]


def _added_tokens(tokens: list[str], kinds: _Kinds) -> tuple[list[str], list[str]]:
    """(special, plain) added tokens: control and unknown tokens are special,
    user-defined ones plain."""
    return [tokens[i] for i in kinds.special], [tokens[i] for i in kinds.user_defined]


def _post_processor(
    tokens: list[str], bos: int | None, eos: int | None, byte_level: bool
) -> dict[str, Any] | None:
    """BOS / EOS added around every encoded text, as the file's add_*_token ask."""
    offsets = {
        "type": "ByteLevel",
        "add_prefix_space": True,
        "trim_offsets": False,
        "use_regex": True,
    }
    if bos is None and eos is None:
        return offsets if byte_level else None

    def piece(i: int, type_id: int) -> dict[str, Any]:
        return {"SpecialToken": {"id": tokens[i], "type_id": type_id}}

    def seq(name: str, type_id: int) -> list[dict[str, Any]]:
        head = [piece(bos, type_id)] if bos is not None else []
        tail = [piece(eos, type_id)] if eos is not None else []
        return [*head, {"Sequence": {"id": name, "type_id": type_id}}, *tail]

    specials = {
        tokens[i]: {"id": tokens[i], "ids": [i], "tokens": [tokens[i]]}
        for i in (bos, eos)
        if i is not None
    }
    template = {
        "type": "TemplateProcessing",
        "single": seq("A", 0),
        "pair": seq("A", 0) + seq("B", 1),
        "special_tokens": specials,
    }
    if not byte_level:
        return template
    return {"type": "Sequence", "processors": [offsets, template]}


def _wordpiece_tokenizer(
    meta: Mapping[str, Any], tokens: list[str], types: list[int], source: str
) -> Tokenizer:
    """An encoder's WordPiece tokenizer (``tokenizer.ggml.model`` ``bert``), as
    its tokenizer.json has it: BERT's normalizer and pre-tokenizer, the
    vocabulary, ``[CLS] a [SEP]`` / ``[CLS] a [SEP] b [SEP]`` around texts
    (token types 0, then 1 for the second text).

    llama.cpp's converter writes the vocabulary with a ``▁`` before each
    word-initial piece and continuation pieces bare (``##`` dropped), control
    tokens as they are; this undoes that. Lower-casing and accent stripping
    come from ``tokenizer.ggml.normalizer.lowercase`` / ``strip_accents``
    where the file has them; an older file has neither, and the vocabulary
    tells: lower-cased when no piece has an upper-case letter (an uncased
    model), as its ``BertNormalizer`` does (accents stripped with the case)."""
    from tokenizers import Tokenizer as _HFTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

    n = len(tokens)
    pieces = []
    for t, kind in zip(tokens, types, strict=True):
        if kind in (CONTROL, UNKNOWN, USER_DEFINED, UNUSED):
            pieces.append(t)
        elif t.startswith("\u2581"):
            pieces.append(t[1:])
        else:
            pieces.append("##" + t)
    vocab: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        vocab.setdefault(piece, i)
    names = ("cls", "seperator", "bos", "eos", "unknown", "padding", "mask")
    ids = {name: _token_id(meta, name, n, source) for name in names}
    # The converter takes [CLS] and [SEP] from the tokenizer.json's template, as
    # the BOS and EOS it adds; some files name them cls / seperator too.
    for name, alias in (("cls", "bos"), ("seperator", "eos")):
        if ids[name] is None:
            ids[name] = ids[alias]
        if ids[name] is None:
            raise ValueError(
                f"{source}: a WordPiece vocabulary needs tokenizer.ggml.{name}_token_id "
                f"(or {alias}_token_id)"
            )

    def text(name: str) -> str | None:
        i = ids.get(name)
        return pieces[i] if i is not None else None

    lowercase = meta.get("tokenizer.ggml.normalizer.lowercase")
    if not isinstance(lowercase, bool):
        lowercase = not any(
            kind == NORMAL and p != p.lower() for p, kind in zip(pieces, types, strict=True)
        )
    strip = meta.get("tokenizer.ggml.normalizer.strip_accents")
    tok = _HFTokenizer(
        # without an unknown token (none named), a word the vocabulary cannot
        # spell is an encoding error naming it
        models.WordPiece(vocab, unk_token=text("unknown") or "[UNK]", max_input_chars_per_word=100)
    )
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True,
        handle_chinese_chars=True,
        strip_accents=strip if isinstance(strip, bool) else None,
        lowercase=lowercase,
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    cls, sep = pieces[ids["cls"]], pieces[ids["seperator"]]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, ids["cls"]), (sep, ids["seperator"])],
    )
    _add_tokens(tok, [p for p, k in zip(pieces, types, strict=True) if k in (CONTROL, UNKNOWN)], [])

    config: dict[str, Any] = {
        "cls_token": cls,
        "sep_token": sep,
        "pad_token": text("padding"),
        "unk_token": text("unknown"),
        "mask_token": text("mask"),
        "add_bos_token": False,
        "add_eos_token": False,
    }
    return Tokenizer.from_backend(tok, config)


def _unigram_tokenizer(
    meta: Mapping[str, Any], tokens: list[str], types: list[int], source: str
) -> Tokenizer:
    """A SentencePiece Unigram tokenizer (``tokenizer.ggml.model`` ``t5``), as
    XLM-RoBERTa's tokenizer.json has it: the pieces and their scores, the
    SentencePiece normalization rules (``tokenizer.ggml.precompiled_charsmap``),
    trailing spaces stripped and runs of spaces merged into one ``▁``
    (``remove_extra_whitespaces``, default true), a ``▁`` before the text
    (``add_space_prefix``, default true), and ``<s> a </s>`` /
    ``<s> a </s> </s> b </s>`` from the BOS and EOS ids (every token type 0)."""
    from tokenizers import (
        Regex,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from tokenizers import Tokenizer as _HFTokenizer

    n = len(tokens)
    scores = _scores(meta, n, source)
    pad, mask = _token_id(meta, "padding", n, source), _token_id(meta, "mask", n, source)
    if mask is not None and types[mask] == UNUSED:
        # llama.cpp's converter leaves XLM-RoBERTa's last slot, <mask>, as an
        # unused padding piece while naming its id: the token is <mask>
        tokens, types = list(tokens), list(types)
        tokens[mask], types[mask] = "<mask>", CONTROL
    ids = {name: _token_id(meta, name, n, source) for name in ("bos", "eos", "unknown")}
    for name in ("bos", "eos", "unknown"):
        if ids[name] is None:
            raise ValueError(f"{source}: a Unigram vocabulary needs tokenizer.ggml.{name}_token_id")
    # unused slots (the converter pads the vocabulary) can never be chosen
    pieces = [
        (t, -1e9 if kind == UNUSED else float(score))
        for t, kind, score in zip(tokens, types, scores, strict=True)
    ]
    tok = _HFTokenizer(models.Unigram(pieces, unk_id=ids["unknown"], byte_fallback=False))
    steps = []
    charsmap = meta.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap is not None and len(charsmap):
        raw = charsmap if isinstance(charsmap, bytes) else bytes(np.asarray(charsmap, np.uint8))
        steps.append(normalizers.Precompiled(raw))
    if bool(meta.get("tokenizer.ggml.remove_extra_whitespaces", True)):
        steps += [
            normalizers.Strip(left=False, right=True),
            normalizers.Replace(Regex(" {2,}"), "\u2581"),
        ]
    if steps:
        tok.normalizer = normalizers.Sequence(steps)
    scheme = "always" if bool(meta.get("tokenizer.ggml.add_space_prefix", True)) else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme)
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme=scheme)
    bos, eos = tokens[ids["bos"]], tokens[ids["eos"]]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}",
        pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, ids["bos"]), (eos, ids["eos"])],
    )
    _add_tokens(tok, [t for t, k in zip(tokens, types, strict=True) if k in (CONTROL, UNKNOWN)], [])
    config: dict[str, Any] = {
        "bos_token": bos,
        "eos_token": eos,
        "cls_token": bos,
        "sep_token": eos,
        "pad_token": tokens[pad] if pad is not None else None,
        "unk_token": tokens[ids["unknown"]],
        "mask_token": tokens[mask] if mask is not None else None,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    return Tokenizer.from_backend(tok, config)

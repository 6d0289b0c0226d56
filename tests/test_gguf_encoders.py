"""Text encoders from GGUF files (BERT and Nomic BERT, as llama.cpp's converter
writes them), against independent references: the folder the file was
written from, embedded by sentence-transformers (float32), and tokenized by
its own transformers tokenizer. Quantized files against sentence-transformers
on the same folder with its weights replaced by the file's dequantized
values (the ``gguf`` package's own dequantization)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")
gguf = pytest.importorskip("gguf")

from safetensors.torch import load_file, save_file  # noqa: E402

from fastllm import LLM  # noqa: E402
from fastllm.config import EngineConfig  # noqa: E402
from fastllm.layers.linear import Linear  # noqa: E402
from fastllm.pooling.encoder import load_encoder  # noqa: E402
from test_encoders import (  # noqa: E402
    MAX_LEN,
    PAIRS,
    TEXTS,
    _cosines,
    _legacy_modes,
    _long_text,
    _make,
    _reference,
    _write_st,
)

#: llama.cpp's pooling_type values
_POOLING = {"mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS}


def write_encoder_gguf(
    folder: str,
    path: str,
    types: str = "F32",
    pooling: str | None = "mean",
    normalizer_keys: bool = True,
) -> str:
    """Writes the encoder in ``folder`` as llama.cpp's converter does: ``bert``
    for BERT, ``nomic-bert`` for Nomic BERT; tensor names from
    ``gguf.TensorNameMap``; the WordPiece vocabulary with a ``▁`` before
    word-initial pieces and ``##`` dropped (control tokens as they are);
    ``[CLS]`` / ``[SEP]`` / ``[PAD]`` / ``[UNK]`` / ``[MASK]`` ids; every
    matrix in ``types`` (embedding tables included), 1-D tensors F32.
    ``normalizer_keys``: the BertNormalizer's lowercase flag written (newer
    converters) or not (older files)."""
    cfg = json.load(open(os.path.join(folder, "config.json")))
    if cfg["model_type"] == "distilbert":  # DistilBERT's names; a bert file with no token types
        renamed = {"dim": "hidden_size", "n_layers": "num_hidden_layers"}
        renamed.update(n_heads="num_attention_heads", hidden_dim="intermediate_size")
        cfg = {renamed.get(k, k): v for k, v in cfg.items()}
        cfg.update(layer_norm_eps=1e-12, type_vocab_size=0)
    state = load_file(os.path.join(folder, "model.safetensors"))
    nomic = cfg["architectures"][0].startswith("NomicBert")
    arch = gguf.MODEL_ARCH.NOMIC_BERT if nomic else gguf.MODEL_ARCH.BERT
    arch_name = gguf.MODEL_ARCH_NAMES[arch]
    n_layers = cfg["num_hidden_layers"]
    names = gguf.TensorNameMap(arch, n_layers)
    w = gguf.GGUFWriter(path, arch_name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_eps(cfg["layer_norm_eps"])
    w.add_causal_attention(False)
    if pooling is not None:
        w.add_pooling_type(_POOLING[pooling])
    if nomic:
        rope = cfg.get("rope_parameters") or {}
        w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 1000.0))))
    # the vocabulary, as the converter's BertModel.set_vocab writes it
    tok = json.load(open(os.path.join(folder, "tokenizer.json")))
    vocab = tok["model"]["vocab"]
    specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
    tokens = [""] * len(vocab)
    for piece, i in vocab.items():
        tokens[i] = piece
    kinds = [gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens]

    def phantom(t: str, kind: int) -> str:
        if kind == gguf.TokenType.CONTROL:
            return t
        return t[2:] if t.startswith("##") else "\u2581" + t

    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    w.add_token_list([phantom(t, k) for t, k in zip(tokens, kinds)])
    w.add_token_types(kinds)
    if cfg.get("type_vocab_size", 1):
        w.add_token_type_count(cfg.get("type_vocab_size", 1))
    # as the converter's SpecialVocab writes them: [CLS] / [SEP] as the BOS /
    # EOS of the tokenizer.json's template, [SEP] as the separator too
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_eos_token", True)
    for key, piece in (
        ("bos", "[CLS]"),
        ("eos", "[SEP]"),
        ("seperator", "[SEP]"),
        ("padding", "[PAD]"),
        ("unknown", "[UNK]"),
        ("mask", "[MASK]"),
    ):
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", vocab[piece])
    if normalizer_keys:
        w.add_bool("tokenizer.ggml.normalizer.lowercase", tok["normalizer"]["lowercase"])
    for hf_name, t in state.items():
        if hf_name.endswith("position_ids") or hf_name.startswith(("pooler.", "cls.")):
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        _add_tensor(w, name, t, types)
    return _close_writer(w, path)


def _add_tensor(w, name: str, t: torch.Tensor, types: str) -> None:
    """``t`` as the converter stores it: 1-D tensors F32, matrices in ``types``."""
    arr = t.float().numpy()
    kind = "F32" if arr.ndim == 1 else types
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    if kind == "F32":
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    elif kind == "F16":
        w.add_tensor(name, arr.astype(np.float16))
    else:
        w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)


def _close_writer(w, path: str) -> str:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _dequantized_folder(folder: str, out: str, types: str) -> str:
    """A copy of ``folder`` whose matrices hold the values the GGUF file of
    ``types`` stores (quantized and dequantized by the ``gguf`` package)."""
    shutil.copytree(folder, out)
    state = load_file(os.path.join(folder, "model.safetensors"))
    qtype = getattr(gguf.GGMLQuantizationType, types)
    for name, t in state.items():
        if t.ndim == 2 and t.is_floating_point():
            q = gguf.quants.quantize(t.float().numpy(), qtype)
            state[name] = torch.from_numpy(gguf.quants.dequantize(q, qtype).copy()).to(t.dtype)
    save_file(state, os.path.join(out, "model.safetensors"))
    return out


#: widths that are whole blocks of 32, as quantized GGUF matrices need
SHAPE = {"hidden_size": 64, "intermediate_size": 96}
# name -> (architecture, sentence-transformers pooling, GGUF pooling, config extras)
ENCODERS = {
    "bert-mean": ("BertModel", {"pooling_mode": "mean"}, "mean", {}),
    "bert-cls": ("BertModel", _legacy_modes("cls_token"), "cls", {}),
    # DistilBERT (msmarco-distilbert's shape): the converter writes it as bert,
    # without a token-type table
    "distilbert-mean": ("DistilBertModel", {"pooling_mode": "mean"}, "mean", {}),
    "nomic-mean": ("NomicBertModel", {"pooling_mode": "mean"}, "mean", {}),
    "nomic-cls-rope": (
        "NomicBertModel",
        _legacy_modes("cls_token"),
        "cls",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0}},
    ),
}


@pytest.fixture(scope="module", params=sorted(ENCODERS))
def encoder_folder(request, tmp_path_factory):
    arch, st_pooling, _, extra = ENCODERS[request.param]
    shape = SHAPE
    if arch.startswith("DistilBert"):
        shape = {"dim": SHAPE["hidden_size"], "hidden_dim": SHAPE["intermediate_size"]}
    folder = _make(tmp_path_factory, arch, seed=len(request.param), **shape, **extra)
    _write_st(folder, st_pooling, normalize=True)
    return request.param, folder


def _texts(runner) -> list[str]:
    return [*TEXTS, _long_text(runner, MAX_LEN), _long_text(runner, MAX_LEN // 2)]


def test_float_file_embeds_like_its_folder(encoder_folder, tmp_path):
    name, folder = encoder_folder
    path = write_encoder_gguf(folder, str(tmp_path / "m.gguf"), "F32", ENCODERS[name][2])
    runner = load_encoder(EngineConfig(model=path, max_model_len=MAX_LEN))
    assert runner.pooler.pooling_type == ENCODERS[name][2].upper()
    assert runner.pooler.normalize
    texts = _texts(runner)
    got = torch.stack(runner.pool([runner.tokenize(t) for t in texts]))
    want = _reference(folder, texts)
    assert _cosines(got, want).min() >= 0.9999, _cosines(got, want)


@pytest.mark.parametrize("types", ["Q8_0", "Q4_0"])
def test_quantized_file_runs_its_blocks_as_stored(encoder_folder, tmp_path, types):
    """Every linear layer on the integer kernel of the file's type; the
    embeddings close to sentence-transformers on the dequantized weights
    (the kernels quantize activations to 8 bits: cos >= 0.999)."""
    name, folder = encoder_folder
    path = write_encoder_gguf(folder, str(tmp_path / "m.gguf"), types, ENCODERS[name][2])
    runner = load_encoder(EngineConfig(model=path, max_model_len=MAX_LEN))
    fmt = types.lower()
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(getattr(m.packed, "format", None) == fmt for m in linears)
    texts = _texts(runner)
    got = torch.stack(runner.pool([runner.tokenize(t) for t in texts]))
    reference = _dequantized_folder(folder, str(tmp_path / "dequantized"), types)
    want = _reference(reference, texts)
    assert _cosines(got, want).min() >= 0.999, _cosines(got, want)


@pytest.mark.parametrize("normalizer_keys", [True, False])
def test_tokenizer_equals_the_folders(encoder_folder, tmp_path, normalizer_keys):
    """Ids and token types of texts and text pairs equal the folder's
    transformers tokenizer, whether the file states the lower-casing or the
    vocabulary has to tell."""
    name, folder = encoder_folder
    path = write_encoder_gguf(
        folder, str(tmp_path / "m.gguf"), "F32", None, normalizer_keys=normalizer_keys
    )
    runner = load_encoder(EngineConfig(model=path))
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    typed = not name.startswith("distilbert")  # DistilBERT reads no token types
    for text in [*TEXTS, "[CLS] inside [MASK] text", "UPPER Case ÀÉÎ"]:
        want = reference(text, return_token_type_ids=True)
        ids, types = runner.tokenize(text)
        assert ids == want["input_ids"], text
        assert types == (want["token_type_ids"] if typed else None), text
    # pairs against the folder's tokenizer.json in the tokenizers library
    # (transformers drops an empty second text)
    from tokenizers import Tokenizer

    pairs = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    for a, b in PAIRS:
        want = pairs.encode(a, b)
        assert runner.tokenize(a, b) == (want.ids, want.type_ids if typed else None), (a, b)
    assert runner.pooler.pooling_type == "MEAN"  # a file without pooling_type


def test_llm_embeds_a_gguf_file(encoder_folder, tmp_path):
    """``LLM(path)`` on an encoder file is a pooling model (no runner
    argument), and ``normalize=False`` gives the raw vectors."""
    from fastllm import PoolingParams

    name, folder = encoder_folder
    path = write_encoder_gguf(folder, str(tmp_path / "m.gguf"), "F16", ENCODERS[name][2])
    llm = LLM(path, max_model_len=MAX_LEN)
    texts = ["Hello, world!", "naïve café 日本語"]
    out = llm.embed(texts)
    got = torch.tensor([o.outputs.embedding for o in out])
    want = _reference(folder, texts)
    assert _cosines(got, want).min() >= 0.9995  # F16 weights
    assert torch.allclose(got.norm(dim=-1), torch.ones(2, dtype=got.dtype), atol=1e-5)
    raw = llm.embed(texts, pooling_params=PoolingParams(normalize=False))
    raw_t = torch.tensor([o.outputs.embedding for o in raw])
    assert torch.allclose(torch.nn.functional.normalize(raw_t, dim=-1), got, atol=1e-5)


def _rewrite(path: str, out: str, drop: str | None = None, **keys) -> str:
    """A copy of GGUF file ``path`` with metadata ``keys`` set (or added) and
    metadata key ``drop`` left out."""
    reader = gguf.GGUFReader(path)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    w = gguf.GGUFWriter(out, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name == drop or field.name in keys:
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, value, vtype, sub_type=sub)
    for key, value in keys.items():
        w.add_key_value(key, value[0], value[1])
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_shape=None, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_bad_encoder_files_are_named(tmp_path_factory, tmp_path):
    folder = _make(tmp_path_factory, "BertModel", seed=3, **SHAPE)
    path = write_encoder_gguf(folder, str(tmp_path / "m.gguf"))
    u32, boolean = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.BOOL
    rank = _rewrite(path, str(tmp_path / "rank.gguf"), **{"bert.pooling_type": (4, u32)})
    with pytest.raises(ValueError, match=r"rank.gguf: bert.pooling_type is rank"):
        load_encoder(EngineConfig(model=rank))
    causal = _rewrite(
        path, str(tmp_path / "causal.gguf"), **{"bert.attention.causal": (1, boolean)}
    )
    with pytest.raises(ValueError, match=r"causal.gguf: bert.attention.causal is true"):
        load_encoder(EngineConfig(model=causal))
    no_cls = _rewrite(path, str(tmp_path / "nocls.gguf"), drop="tokenizer.ggml.bos_token_id")
    with pytest.raises(ValueError, match=r"nocls.gguf: .*needs tokenizer.ggml.cls_token_id"):
        load_encoder(EngineConfig(model=no_cls))
    with pytest.raises(ValueError, match=r"m.gguf: .*'bert' is a text encoder: it embeds"):
        LLM(path, runner="generate")
    no_heads = _rewrite(path, str(tmp_path / "noheads.gguf"), drop="bert.attention.head_count")
    with pytest.raises(ValueError, match=r"noheads.gguf: metadata key 'bert.attention.head_count'"):
        LLM(no_heads)


def test_docs_gguf_example_runs(tmp_path_factory, tmp_path, monkeypatch):
    """docs/embeddings.md's GGUF example, run as written beside a Q8_0 file of
    a Nomic BERT test model under the name it uses."""
    import re

    folder = _make(tmp_path_factory, "NomicBertModel", seed=5, **SHAPE)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "embeddings.md"), encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    (code,) = [b for b in blocks if ".gguf" in b]
    name = re.search(r'LLM\("([^"]+)"\)', code).group(1)
    write_encoder_gguf(folder, str(tmp_path / name), "Q8_0")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "docs/embeddings.md", "exec"), scope)
    (vector,) = scope["vectors"]
    assert len(vector) == SHAPE["hidden_size"]
    assert abs(sum(v * v for v in vector) - 1) < 1e-4


def test_server_serves_a_gguf_encoder(tmp_path_factory, tmp_path):
    """``fastllm serve model.gguf`` on an encoder file: /v1/embeddings through
    the openai client equal to sentence-transformers on the folder, and a
    generation route a 400 naming the model's kind."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    import urllib.error
    import urllib.request

    from server_process import app_server

    folder = _make(tmp_path_factory, "NomicBertModel", seed=11, **SHAPE)
    _write_st(folder, {"pooling_mode": "mean"}, normalize=True)
    path = write_encoder_gguf(folder, str(tmp_path / "m.gguf"), "F32", "mean")
    texts = ["Hello, world!", "naïve café 日本語"]
    with app_server(path, MAX_LEN, served_model_name="enc") as (_, addr):
        base = f"http://{addr[0]}:{addr[1]}/v1"
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
        resp = client.embeddings.create(model="enc", input=texts)
        got = torch.tensor([d.embedding for d in resp.data])
        assert _cosines(got, _reference(folder, texts)).min() >= 0.9999
        body = json.dumps({"model": "enc", "prompt": "hi", "max_tokens": 2}).encode()
        req = urllib.request.Request(
            f"{base}/completions", body, {"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req)
        assert err.value.code == 400
        assert "pooling" in err.value.read().decode()


# ---- XLM-RoBERTa with a SentencePiece vocabulary (bge-m3, multilingual-e5) ----------


def _sentencepiece_folder(out) -> tuple[str, list[tuple[str, float]], bytes]:
    """A SentencePiece Unigram model trained on local text, and the
    tokenizer.json XLM-RoBERTa checkpoints ship for it (the <s> <pad> </s>
    <unk> ids first, the model's pieces from its fourth on, <mask> last; its
    normalization rules, then trailing spaces stripped and runs of spaces
    merged; a ``▁`` before the text; ``<s> a </s>`` / ``<s> a </s> </s> b </s>``):
    (the .model path, the vocabulary with scores, the normalization rules)."""
    spm = pytest.importorskip("sentencepiece")
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    from conftest import _corpus

    lines = [line for text in _corpus() for line in text.splitlines() if line.strip()]
    lines += ["naïve café 日本語のテキスト Ünïcödé ﬁ ① Ｆｕｌｌ width émoji 🙂"] * 20
    prefix = str(out / "sentencepiece.bpe")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=prefix,
        vocab_size=500,
        model_type="unigram",
        character_coverage=1.0,
        minloglevel=2,
    )
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(open(prefix + ".model", "rb").read())
    vocab = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [(p.piece, p.score) for p in proto.pieces[3:]] + [("<mask>", 0.0)]
    charsmap = proto.normalizer_spec.precompiled_charsmap
    tok = Tokenizer(models.Unigram(vocab, unk_id=3, byte_fallback=False))
    tok.normalizer = normalizers.Sequence(
        [
            normalizers.Precompiled(charsmap),
            normalizers.Strip(left=False, right=True),
            normalizers.Replace(Regex(" {2,}"), "\u2581"),
        ]
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)],
    )
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MAX_LEN,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "cls_token": "<s>",
        "sep_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return prefix + ".model", vocab, charsmap


def write_xlm_roberta_gguf(
    folder: str, vocab, charsmap: bytes, path: str, types: str, rank: bool = False
) -> str:
    """An XLM-RoBERTa folder as llama.cpp's converter writes it: ``bert``, the
    position table cut to start at the first token (rows past the padding
    id), a ``t5`` vocabulary (pieces, scores, types; the normalization rules
    and flags), <s> / </s> as BOS / EOS; ``rank``: a reranker
    (``XLMRobertaForSequenceClassification``: ``roberta.`` dropped from the
    names, its head as ``cls`` / ``cls.output``, rank pooling)."""
    cfg = json.load(open(os.path.join(folder, "config.json")))
    state = load_file(os.path.join(folder, "model.safetensors"))
    offset = cfg["pad_token_id"] + 1
    arch = gguf.MODEL_ARCH.BERT
    names = gguf.TensorNameMap(arch, cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    w.add_context_length(cfg["max_position_embeddings"] - offset)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_eps(cfg["layer_norm_eps"])
    w.add_causal_attention(False)
    if not rank:  # the converter writes no pooling for a reranker folder without ST files
        w.add_pooling_type(gguf.PoolingType.MEAN)
    w.add_tokenizer_model("t5")
    w.add_tokenizer_pre("default")
    # the converter's realignment leaves the last slot (<mask>) an unused
    # padding piece, and names its id as the mask token's
    mask = len(vocab) - 1
    w.add_token_list([t for t, _ in vocab[:-1]] + [f"[PAD{mask - 1}]"])
    w.add_token_scores([s for _, s in vocab[:-1]] + [-10000.0])
    control, unknown = gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN
    kinds = {0: control, 1: control, 2: control, 3: unknown, mask: gguf.TokenType.UNUSED}
    w.add_token_types([kinds.get(i, gguf.TokenType.NORMAL) for i in range(len(vocab))])
    w.add_uint32("tokenizer.ggml.mask_token_id", mask)
    w.add_add_space_prefix(True)
    w.add_remove_extra_whitespaces(True)
    w.add_precompiled_charsmap(charsmap)
    w.add_token_type_count(1)
    for key, i in (("bos", 0), ("padding", 1), ("eos", 2), ("unknown", 3)):
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", i)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_eos_token", True)
    for hf_name, t in state.items():
        hf_name = hf_name.removeprefix("roberta.")
        if hf_name.endswith("position_ids") or hf_name.startswith("pooler."):
            continue
        if hf_name.endswith("position_embeddings.weight"):
            t = t[offset:]
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        _add_tensor(w, name, t, types)
    return _close_writer(w, path)


@pytest.fixture(scope="module")
def xlm_roberta(tmp_path_factory):
    """A tiny XLMRobertaModel with a SentencePiece vocabulary, mean pooling,
    normalised (multilingual-e5's and bge-m3's setup, CLS for bge-m3)."""
    from test_encoders import _config, _randomize

    out = tmp_path_factory.mktemp("xlm-roberta-spm")
    model_path, vocab, charsmap = _sentencepiece_folder(out)
    ids = {"vocab": len(vocab), "pad": 1, "cls": 0, "sep": 2}
    config = _config("XLMRobertaModel", ids, 2, **SHAPE)
    torch.manual_seed(4)
    model = transformers.XLMRobertaModel(config).eval()
    _randomize(model, 4)
    model.save_pretrained(str(out))
    _write_st(str(out), {"pooling_mode": "mean"}, normalize=True)
    return str(out), model_path, vocab, charsmap


XLM_TEXTS = [
    "Hello, world!",
    "naïve café 日本語のテキスト",
    "Ｆｕｌｌ width ﬁ ① and   runs of   spaces  ",
    "  leading spaces",
    "tabs\tand\nnewlines",
    "<mask> and <s> inside",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
]


@pytest.mark.parametrize("types", ["F32", "Q8_0"])
def test_xlm_roberta_file_embeds_like_its_folder(xlm_roberta, tmp_path, types):
    folder, _, vocab, charsmap = xlm_roberta
    path = write_xlm_roberta_gguf(folder, vocab, charsmap, str(tmp_path / "m.gguf"), types)
    runner = load_encoder(EngineConfig(model=path, max_model_len=MAX_LEN))
    long = "the"
    while len(runner.tokenize(long + " the")[0]) <= MAX_LEN:
        long += " the"
    texts = [*XLM_TEXTS, long]
    assert len(runner.tokenize(long)[0]) > MAX_LEN - 3
    got = torch.stack(runner.pool([runner.tokenize(t) for t in texts]))
    reference = (
        folder if types == "F32" else _dequantized_folder(folder, str(tmp_path / "d"), types)
    )
    want = _reference(reference, texts)
    bound = 0.9999 if types == "F32" else 0.999
    assert _cosines(got, want).min() >= bound, _cosines(got, want)


def test_xlm_roberta_tokenizer_equals_the_folders_and_sentencepiece(xlm_roberta, tmp_path):
    """Ids of texts and pairs equal the folder's tokenizer (transformers), and
    for texts without leading, trailing or repeated spaces, SentencePiece's own
    ids shifted past the four specials."""
    import sentencepiece

    folder, model_path, vocab, charsmap = xlm_roberta
    path = write_xlm_roberta_gguf(folder, vocab, charsmap, str(tmp_path / "m.gguf"), "F32")
    runner = load_encoder(EngineConfig(model=path))
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    for text in XLM_TEXTS:
        assert runner.tokenize(text)[0] == reference(text)["input_ids"], text
    for a, b in PAIRS:
        if a and b:
            assert runner.tokenize(a, b)[0] == reference(a, b)["input_ids"], (a, b)
    sp = sentencepiece.SentencePieceProcessor(model_file=model_path)
    for text in ["Hello, world!", "naïve café 日本語のテキスト", "Ｆｕｌｌ width ﬁ ①"]:
        pieces = sp.encode(text)
        want = [0] + [3 if i == sp.unk_id() else i + 1 for i in pieces] + [2]
        assert runner.tokenize(text)[0] == want, text


def test_xlm_roberta_reranker_file_scores_like_transformers(
    xlm_roberta, tmp_path_factory, tmp_path
):
    """An XLMRobertaForSequenceClassification reranker (bge-reranker-v2-m3's
    shape, one label) as a rank-pooling GGUF file: ``LLM(path)`` is a
    cross-encoder whose scores are transformers' sigmoid logits of the pairs
    its own tokenizer makes."""
    from test_encoders import _config, _randomize

    folder, _, vocab, charsmap = xlm_roberta
    out = tmp_path_factory.mktemp("xlm-roberta-reranker")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(folder, name), out / name)
    ids = {"vocab": len(vocab), "pad": 1, "cls": 0, "sep": 2}
    config = _config("XLMRobertaForSequenceClassification", ids, 1, **SHAPE)
    torch.manual_seed(9)
    model = transformers.XLMRobertaForSequenceClassification(config).eval()
    _randomize(model, 9)
    model.save_pretrained(str(out))
    path = write_xlm_roberta_gguf(str(out), vocab, charsmap, str(tmp_path / "r.gguf"), "F32", True)
    llm = LLM(path, max_model_len=MAX_LEN)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    query = "how do I read a file?"
    docs = ["with open(path) as f: data = f.read()", "naïve café 日本語", "import os"]
    got = [o.outputs.score for o in llm.score(query, docs)]
    with torch.no_grad():
        want = [
            torch.sigmoid(model(**tok(query, d, return_tensors="pt")).logits[0, 0]).item()
            for d in docs
        ]
    assert got == pytest.approx(want, abs=1e-5)
    with pytest.raises(ValueError, match="embed: this model is a classifier"):
        llm.embed(["x"])

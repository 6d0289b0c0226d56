"""Encoder models (BERT, RoBERTa, XLM-RoBERTa, DistilBERT, MPNet, ModernBERT, Nomic BERT,
GTE, EmbeddingGemma) as pooling runners,
against independent references: sentence-transformers' ``encode`` for
embeddings (CLS and MEAN pooling, Dense, Normalize), transformers'
``*ForSequenceClassification`` for cross-encoder logits on text pairs (its
own tokenizer making the pairs), int8 weights close to float, and clear
errors for what fastllm does not run."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")

from conftest import _corpus, train_byte_level_bpe  # noqa: E402
from fastllm.config import EngineConfig  # noqa: E402
from fastllm.layers.linear import Linear, should_pack  # noqa: E402
from fastllm.pooling.encoder import EncoderRunner, is_encoder_architecture, load_encoder  # noqa: E402

MAX_LEN = 64
TEXTS = [
    "",
    "a",
    "Hello, world!",
    "  leading and trailing whitespace  ",
    "tabs\tand\nnewlines\r\n  inside",
    "Unicode: naïve café, 日本語のテキスト, emoji 🙂",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
]
PAIRS = [
    ("what does the function return?", "def f(x): return x + 1"),
    ("", "only the second text"),
    ("only the first text", ""),
    ("naïve 日本語", "emoji 🙂 and café"),
    ("import os", "import sys\nimport os\nprint(os.getcwd())"),
]


# ---- tokenizers ----------------------------------------------------------------------


def _wordpiece(out) -> None:
    """A BERT-style WordPiece tokenizer trained on local text: [CLS] a [SEP] b [SEP]."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import WordPieceTrainer

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = WordPieceTrainer(vocab_size=400, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    _save_tokenizer(out, tok, "[CLS]", "[SEP]", "[PAD]", "[UNK]", "[MASK]")


def _bpe(out, roberta: bool) -> None:
    """A byte-level BPE tokenizer; RoBERTa's ``<s> a </s></s> b </s>`` or
    ModernBERT's ``[CLS] a [SEP] b [SEP]``."""
    from tokenizers import processors

    tok = train_byte_level_bpe(400)
    if roberta:
        names = ["<s>", "</s>", "<pad>", "<unk>", "<mask>"]
        tok.add_special_tokens(names)
        cls, sep = names[0], names[1]
        tok.post_processor = processors.RobertaProcessing(
            (sep, tok.token_to_id(sep)), (cls, tok.token_to_id(cls)), add_prefix_space=False
        )
    else:
        names = ["[CLS]", "[SEP]", "[PAD]", "[UNK]", "[MASK]"]
        tok.add_special_tokens(names)
        cls, sep = names[0], names[1]
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B [SEP]",
            special_tokens=[(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))],
        )
    _save_tokenizer(out, tok, *names)


def _save_tokenizer(out, tok, cls, sep, pad, unk, mask) -> None:
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MAX_LEN,
        "cls_token": cls,
        "sep_token": sep,
        "pad_token": pad,
        "unk_token": unk,
        "mask_token": mask,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def _special_ids(out) -> dict[str, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    names = {"pad": ("[PAD]", "<pad>"), "cls": ("[CLS]", "<s>"), "sep": ("[SEP]", "</s>")}
    ids = {
        k: next(tok.token_to_id(n) for n in v if tok.token_to_id(n) is not None)
        for k, v in names.items()
    }
    ids["vocab"] = tok.get_vocab_size(with_added_tokens=True)
    return ids


# ---- models --------------------------------------------------------------------------


def _randomize(model, seed: int) -> None:
    """Weights large enough that attention is far from uniform, norms away from 1 / 0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name.lower():
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.05 * noise)
            else:
                p.copy_(0.15 * noise)


def _config(arch: str, ids: dict[str, int], num_labels: int, **extra):
    common = {
        "vocab_size": ids["vocab"],
        "hidden_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 80,
        "pad_token_id": ids["pad"],
        "num_labels": num_labels,
    }
    if arch.startswith("ModernBert"):
        common.update(
            hidden_size=64,
            num_hidden_layers=3,
            intermediate_size=96,
            max_position_embeddings=MAX_LEN,
            global_attn_every_n_layers=2,
            local_attention=8,  # each local layer sees 4 tokens each way: texts are longer
            global_rope_theta=160_000.0,
            local_rope_theta=1_000.0,
            cls_token_id=ids["cls"],
            sep_token_id=ids["sep"],
            bos_token_id=ids["cls"],
            eos_token_id=ids["sep"],
        )
        common.update(extra)
        return transformers.ModernBertConfig(**common)
    if arch.startswith("NomicBert"):
        common.update(max_position_embeddings=MAX_LEN, type_vocab_size=2)
        return transformers.NomicBertConfig(**{**common, **extra})
    if arch.startswith("Gte"):
        common.update(max_position_embeddings=MAX_LEN, **extra)
        return transformers.GteConfig(**common)
    if arch.startswith("Bert"):
        common.update(max_position_embeddings=MAX_LEN, type_vocab_size=2)
        return transformers.BertConfig(**{**common, **extra})
    if arch.startswith("DistilBert"):
        renamed = {"hidden_size": "dim", "num_hidden_layers": "n_layers"}
        renamed.update(num_attention_heads="n_heads", intermediate_size="hidden_dim")
        common = {renamed.get(k, k): v for k, v in common.items()}
        return transformers.DistilBertConfig(
            **{**common, "max_position_embeddings": MAX_LEN, **extra}
        )
    # RoBERTa's and MPNet's positions start after the padding id
    common.update(max_position_embeddings=ids["pad"] + 1 + MAX_LEN, **extra)
    if arch.startswith("MPNet"):
        return transformers.MPNetConfig(**common)
    cls = transformers.XLMRobertaConfig if arch.startswith("XLM") else transformers.RobertaConfig
    return cls(**common, type_vocab_size=1)


def _tokenizer_for(arch: str, out) -> None:
    if arch.startswith(("Bert", "NomicBert", "DistilBert")):
        _wordpiece(out)
    else:
        _bpe(out, roberta=not arch.startswith("ModernBert"))


def _make(tmp_path_factory, arch: str, num_labels: int = 2, seed: int = 0, **extra) -> str:
    out = tmp_path_factory.mktemp(arch)
    _tokenizer_for(arch, out)
    config = _config(arch, _special_ids(out), num_labels, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    _randomize(model, seed)
    model.save_pretrained(str(out))
    return str(out)


def _write_st(folder: str, pooling: dict, normalize: bool, dense: int | None = None) -> None:
    """Hand-written sentence-transformers files, as hub models carry them."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
    ]
    modules.append(
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    )
    config = json.load(open(os.path.join(folder, "config.json")))
    hidden = config.get("hidden_size", config.get("dim"))
    legacy = "word_embedding_dimension" in pooling
    pooling = {**pooling, "word_embedding_dimension" if legacy else "embedding_dimension": hidden}
    os.makedirs(os.path.join(folder, "1_Pooling"), exist_ok=True)
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
        json.dump(pooling, f)
    if dense is not None:
        layer = st.models.Dense(hidden, dense, activation_function=torch.nn.Tanh())
        _randomize(layer, 7)
        os.makedirs(os.path.join(folder, "2_Dense"), exist_ok=True)
        layer.save(os.path.join(folder, "2_Dense"))
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
        )
    if normalize:
        os.makedirs(os.path.join(folder, "3_Normalize"), exist_ok=True)
        modules.append(
            {
                "idx": 3,
                "name": "3",
                "path": "3_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump(modules, f)
    with open(os.path.join(folder, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": MAX_LEN, "do_lower_case": False}, f)


def _legacy_modes(key: str) -> dict:
    """A Pooling config in the older layout: one ``pooling_mode_*`` flag on."""
    keys = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken")
    flags = {f"pooling_mode_{k}": k == key for k in keys}
    return {"word_embedding_dimension": 0, **flags}


def _long_text(runner: EncoderRunner, n: int) -> str:
    """A text of at most ``n`` tokens (with the specials), within a few of it."""
    words = "the quick brown fox jumps over the lazy dog while naïve café owners watch".split()
    text, i = "", 0
    while True:
        longer = (text + " " + words[i % len(words)]).strip()
        if len(runner.tokenize(longer)[0]) > n:
            assert len(runner.tokenize(text)[0]) >= n - 3
            return text
        text, i = longer, i + 1


# ---- embeddings ----------------------------------------------------------------------

# name -> (architecture, how the folder pools, normalize, Dense output, config extras)
EMBEDDERS = {
    "bert-cls-normalize": ("BertModel", _legacy_modes("cls_token"), True, None, {}),
    "bert-mlm-mean-dense": ("BertForMaskedLM", {"pooling_mode": "mean"}, True, 24, {}),
    "roberta-mean": (
        "RobertaModel",
        {"pooling_mode": "mean", "include_prompt": True},
        False,
        None,
        {},
    ),
    "xlm-roberta-cls": ("XLMRobertaModel", _legacy_modes("cls_token"), False, None, {}),
    "modernbert-default-mean": ("ModernBertModel", None, False, None, {}),
    "modernbert-biases-cls": (
        "ModernBertModel",
        {"pooling_mode": ["cls"]},
        True,
        None,
        {"norm_bias": True, "attention_bias": True, "mlp_bias": True},
    ),
    # DistilBERT (msmarco-distilbert's setup) and MPNet (all-mpnet-base-v2's: mean,
    # normalised; and a masked-LM checkpoint pooling CLS)
    "distilbert-mean": ("DistilBertModel", {"pooling_mode": "mean"}, False, None, {}),
    "mpnet-mean-normalize": ("MPNetModel", {"pooling_mode": "mean"}, True, None, {}),
    "mpnet-mlm-cls": ("MPNetForMaskedLM", _legacy_modes("cls_token"), False, None, {}),
    # nomic-embed-text's shape: mean pooling, normalised; the default rotary base (1000)
    "nomic-mean-normalize": ("NomicBertModel", {"pooling_mode": "mean"}, True, None, {}),
    # GTE (gte-multilingual-base's shape): biased attention and down projection,
    # CLS pooling, one token type; and without token types (gte-base-en-v1.5)
    "gte-cls-normalize": ("GteModel", _legacy_modes("cls_token"), True, None, {}),
    "gte-mlm-mean-no-types": (
        "GteForMaskedLM",
        {"pooling_mode": "mean"},
        False,
        None,
        {"type_vocab_size": 0, "hidden_act": "silu", "head_dim": 16},
    ),
    # a masked-LM checkpoint: heads wider than hidden / heads, another rotary base,
    # a GELU gate
    "nomic-mlm-cls": (
        "NomicBertForMaskedLM",
        _legacy_modes("cls_token"),
        False,
        None,
        {
            "head_dim": 16,
            "hidden_act": "gelu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    ),
}


@pytest.fixture(scope="module", params=sorted(EMBEDDERS))
def embedder(request, tmp_path_factory):
    arch, pooling, normalize, dense, extra = EMBEDDERS[request.param]
    folder = _make(tmp_path_factory, arch, seed=len(request.param), **extra)
    if pooling is not None:
        _write_st(folder, pooling, normalize, dense)
    return request.param, folder


def _reference(folder: str, texts: list[str]) -> torch.Tensor:
    model = st.SentenceTransformer(folder, device="cpu")
    return model.encode(texts, convert_to_tensor=True, batch_size=4).float()


def _cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def test_embeddings_match_sentence_transformers(embedder):
    name, folder = embedder
    runner = load_encoder(EngineConfig(model=folder))
    _, _, normalize, dense, _ = EMBEDDERS[name]
    assert runner.pooler.normalize is normalize
    assert runner.num_labels is None
    if should_pack("cpu", torch.float32):  # the Rust GEMM runs every linear layer
        assert all(m.packed is not None for m in runner.model.modules() if isinstance(m, Linear))
    texts = [*TEXTS, _long_text(runner, MAX_LEN), _long_text(runner, MAX_LEN // 2)]
    if name.startswith("roberta"):
        texts.append("a <pad> inside the text")  # RoBERTa's positions skip padding tokens
    batch = [runner.tokenize(t) for t in texts]
    assert max(len(ids) for ids, _ in batch) > MAX_LEN - 4
    got = torch.stack(runner.pool(batch))
    assert got.dtype == torch.float32 and got.shape[-1] == runner.pooler.dimensions
    assert runner.pooler.dimensions == (dense or got.shape[-1])
    if normalize:
        got = torch.nn.functional.normalize(got, dim=-1)
    want = _reference(folder, texts)
    assert _cosines(got, want).min() >= 0.9999, _cosines(got, want)
    # the same inputs alone and in reverse order: packed inputs do not mix
    raw = torch.stack(runner.pool(batch))
    alone = torch.stack([runner.pool([b])[0] for b in batch])
    reverse = torch.stack(runner.pool(batch[::-1])).flip(0)
    assert torch.allclose(raw, alone, atol=1e-5) and torch.allclose(raw, reverse, atol=1e-5)


def test_modernbert_local_layers_see_a_window(tmp_path_factory):
    """The local layers' window matters for the long texts (the reference test
    above would not notice a model that ignored it otherwise)."""
    folder = _make(tmp_path_factory, "ModernBertModel", seed=3)
    runner = load_encoder(EngineConfig(model=folder))
    batch = [runner.tokenize(_long_text(runner, MAX_LEN))]
    windowed = runner.pool(batch)[0]
    layers = runner.encoder.layers
    assert [layer.attention.window for layer in layers] == [None, 4, None]
    layers[1].attention.window = None
    assert _cosines(windowed, runner.pool(batch)[0]) < 0.9999
    assert _cosines(windowed, _reference(folder, [_long_text(runner, MAX_LEN)])[0]) >= 0.9999


def test_legacy_modernbert_config(tmp_path_factory):
    """A config.json in the older layout (global_attn_every_n_layers,
    global_rope_theta, local_rope_theta) runs as transformers reads it."""
    folder = _make(tmp_path_factory, "ModernBertModel", seed=5)
    path = os.path.join(folder, "config.json")
    cfg = json.load(open(path))
    cfg.pop("layer_types")
    cfg.pop("rope_parameters")
    cfg.update(global_attn_every_n_layers=2, global_rope_theta=160_000.0, local_rope_theta=1_000.0)
    json.dump(cfg, open(path, "w"))
    runner = load_encoder(EngineConfig(model=folder))
    texts = [TEXTS[2], _long_text(runner, MAX_LEN)]
    got = torch.stack(runner.pool([runner.tokenize(t) for t in texts]))
    assert _cosines(got, _reference(folder, texts)).min() >= 0.9999


def _original_config(folder: str, family: str) -> dict:
    """``folder``'s config.json (transformers' ``NomicBertModel`` or ``GteModel``)
    written as the family's original release writes it: nomic-embed-text's
    GPT-2-style names, or gte-multilingual-base's ``NewModel`` fields."""
    cfg = json.load(open(os.path.join(folder, "config.json")))
    theta = cfg["rope_parameters"]["rope_theta"]
    if family == "nomic":
        return {
            "architectures": ["NomicBertModel"],
            "model_type": "nomic_bert",
            "vocab_size": cfg["vocab_size"],
            "n_embd": cfg["hidden_size"],
            "n_head": cfg["num_attention_heads"],
            "n_layer": cfg["num_hidden_layers"],
            "n_inner": cfg["intermediate_size"],
            "n_positions": cfg["max_position_embeddings"],
            "layer_norm_epsilon": cfg["layer_norm_eps"],
            "type_vocab_size": cfg["type_vocab_size"],
            "rotary_emb_base": theta,
            "rotary_emb_fraction": 1.0,
            "rotary_emb_interleaved": False,
            "rotary_scaling_factor": None,
            "activation_function": "swiglu",
            "prenorm": False,
            "causal": False,
            "qkv_proj_bias": False,
            "mlp_fc1_bias": False,
            "mlp_fc2_bias": False,
            "pad_token_id": cfg["pad_token_id"],
        }
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    return {
        **{k: cfg[k] for k in keep},
        "architectures": ["NewModel"],
        "model_type": "new",
        "intermediate_size": cfg["intermediate_size"],
        "hidden_act": cfg["hidden_act"],
        "max_position_embeddings": cfg["max_position_embeddings"],
        "type_vocab_size": cfg["type_vocab_size"],
        "layer_norm_eps": cfg["layer_norm_eps"],
        "layer_norm_type": "layer_norm",
        "position_embedding_type": "rope",
        "rope_theta": theta,
        "rope_scaling": None,
        "logn_attention_scale": False,
        "logn_attention_clip1": False,
        "pack_qkv": True,
        "unpad_inputs": False,
        "pad_token_id": cfg["pad_token_id"],
    }


@pytest.mark.parametrize(
    ("arch", "family", "unsupported"),
    [
        (
            "NomicBertModel",
            "nomic",
            [
                ("prenorm", True),
                ("rotary_emb_fraction", 0.5),
                ("activation_function", "gelu"),
                ("qkv_proj_bias", True),
                ("rotary_scaling_factor", 2.0),
            ],
        ),
        (
            "GteModel",
            "gte",
            [
                ("rope_scaling", {"type": "ntk", "factor": 2.0}),
                ("logn_attention_scale", True),
                ("position_embedding_type", "absolute"),
            ],
        ),
    ],
)
def test_rotary_encoders_in_every_layout(tmp_path_factory, arch, family, unsupported):
    """Nomic BERT and GTE as transformers saves them (the original releases'
    tensor names), with the original releases' config.json, and as a state
    dict saved under transformers' module names, all embed as transformers'
    model of the same weights; the releases' options fastllm does not run
    are named."""
    import shutil

    from safetensors.torch import save_file

    rope = {"rope_type": "default", "rope_theta": 500.0}
    folder = _make(tmp_path_factory, arch, seed=9, rope_parameters=rope)
    _write_st(folder, {"pooling_mode": "mean"}, normalize=True)
    texts = [*TEXTS[1:4], "a longer text " * 4]
    want = _reference(folder, texts)

    def check(path: str) -> None:
        runner = load_encoder(EngineConfig(model=path))
        assert runner.encoder.theta == 500.0 and runner.pooler.normalize
        got = torch.stack(runner.pool([runner.tokenize(t) for t in texts]))
        got = torch.nn.functional.normalize(got, dim=-1)
        assert _cosines(got, want).min() >= 0.9999, path

    check(folder)
    original = str(tmp_path_factory.mktemp(f"{family}-original"))
    shutil.copytree(folder, original, dirs_exist_ok=True)
    config = os.path.join(original, "config.json")
    json.dump(_original_config(folder, family), open(config, "w"))
    check(original)
    named = str(tmp_path_factory.mktemp(f"{family}-module-names"))
    shutil.copytree(folder, named, dirs_exist_ok=True)
    model = getattr(transformers, arch).from_pretrained(folder)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(".self_attn.q_proj." in k for k in state)
    save_file(state, os.path.join(named, "model.safetensors"))
    check(named)
    good = json.load(open(config))
    for key, value in unsupported:
        json.dump({**good, key: value}, open(config, "w"))
        with pytest.raises(ValueError, match=key):
            load_encoder(EngineConfig(model=original))


@pytest.mark.parametrize(
    "extra",
    [
        {},  # EmbeddingGemma's shape: 1 KV head, local layers and a global one
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 24,
            "query_pre_attn_scalar": 24,
            "attention_bias": True,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        },
    ],
)
def test_embedding_gemma(tmp_path_factory, extra):
    """EmbeddingGemma (Gemma 3's layers with ``use_bidirectional_attention``,
    saved as ``Gemma3TextModel``; mean pooling, two Dense layers without
    biases or activation, normalised, as its sentence-transformers files
    say) against sentence-transformers, in mixed-length batches whose long
    inputs exceed the local layers' window; the same folder without the
    flag stays a generation model."""
    from sentence_transformers.models import Dense

    out = tmp_path_factory.mktemp("embeddinggemma")
    _bpe(out, roberta=False)
    ids = _special_ids(out)
    shape = dict(
        vocab_size=ids["vocab"],
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=MAX_LEN,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        sliding_window=10,
        use_bidirectional_attention=True,
        pad_token_id=ids["pad"],
    )
    config = transformers.Gemma3TextConfig(**{**shape, **extra})
    torch.manual_seed(0)
    model = transformers.Gemma3TextModel(config).eval()
    _randomize(model, 0)
    with torch.no_grad():  # Gemma's norms scale by 1 + w: keep w small
        for name, p in model.named_parameters():
            if "norm" in name:
                p.mul_(0.5)
    model.save_pretrained(str(out))
    folder = str(out)
    _write_st(folder, {"pooling_mode": "mean"}, normalize=True, dense=None)
    modules = json.load(open(os.path.join(folder, "modules.json")))
    widths = [(48, 72), (72, 48)]
    for i, (n_in, n_out) in enumerate(widths):
        layer = Dense(n_in, n_out, bias=False, activation_function=torch.nn.Identity())
        _randomize(layer, 20 + i)
        name = f"{2 + i}_Dense"
        os.makedirs(os.path.join(folder, name))
        layer.save(os.path.join(folder, name))
        modules.insert(2 + i, {"idx": 2 + i, "name": name, "path": name,
                               "type": "sentence_transformers.models.Dense"})  # fmt: skip
    for i, m in enumerate(modules):
        m["idx"] = i
    json.dump(modules, open(os.path.join(folder, "modules.json"), "w"))
    runner = load_encoder(EngineConfig(model=folder))
    assert runner.pooler.normalize and runner.pooler.dimensions == 48
    texts = [*TEXTS, _long_text(runner, MAX_LEN), _long_text(runner, MAX_LEN // 2)]
    got = torch.stack(runner.pool([runner.tokenize(t) for t in texts]))
    got = torch.nn.functional.normalize(got, dim=-1)
    assert _cosines(got, _reference(folder, texts)).min() >= 0.9999
    path = os.path.join(folder, "config.json")
    cfg = json.load(open(path))
    assert is_encoder_architecture(cfg["architectures"], cfg)
    cfg["use_bidirectional_attention"] = False
    assert not is_encoder_architecture(cfg["architectures"], cfg)


# ---- cross-encoders ------------------------------------------------------------------

CROSS_ENCODERS = [
    ("BertForSequenceClassification", 1, {}),
    ("BertForSequenceClassification", 3, {}),
    ("RobertaForSequenceClassification", 1, {}),
    ("XLMRobertaForSequenceClassification", 3, {}),
    ("ModernBertForSequenceClassification", 1, {"classifier_pooling": "cls"}),
    (
        "ModernBertForSequenceClassification",
        3,
        {"classifier_pooling": "mean", "classifier_bias": True},
    ),
    ("DistilBertForSequenceClassification", 1, {}),
    ("DistilBertForSequenceClassification", 3, {"activation": "relu"}),
    ("MPNetForSequenceClassification", 1, {}),
    ("MPNetForSequenceClassification", 3, {}),
    ("NomicBertForSequenceClassification", 1, {}),
    ("GteForSequenceClassification", 1, {}),
    ("GteForSequenceClassification", 2, {"rope_parameters": {"rope_theta": 50.0}}),
    ("NomicBertForSequenceClassification", 3, {"head_dim": 8, "hidden_act": "gelu_pytorch_tanh"}),
]


@pytest.mark.parametrize(("arch", "labels", "extra"), CROSS_ENCODERS)
def test_cross_encoder_logits_match_transformers(tmp_path_factory, arch, labels, extra):
    folder = _make(tmp_path_factory, arch, num_labels=labels, seed=labels, **extra)
    runner = load_encoder(EngineConfig(model=folder))
    assert runner.num_labels == labels
    pairs = [*PAIRS, (TEXTS[2], _long_text(runner, MAX_LEN // 2))]
    batch = [runner.tokenize(a, b) for a, b in pairs]
    got = torch.stack(runner.classify(batch))
    assert got.shape == (len(pairs), labels) and got.dtype == torch.float32

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    firsts, seconds = [a for a, _ in pairs], [b for _, b in pairs]
    bert = arch.startswith(("Bert", "NomicBert"))  # the token-type readers
    enc = tok(firsts, seconds, padding=True, return_tensors="pt", return_token_type_ids=bert)
    for i, (ids, types) in enumerate(batch):  # fastllm's pair encoding is the tokenizer's
        n = int(enc["attention_mask"][i].sum())
        assert ids == enc["input_ids"][i, :n].tolist()
        if bert:
            assert types == enc["token_type_ids"][i, :n].tolist() and 1 in types
        else:
            assert types is None
    model = getattr(transformers, arch).from_pretrained(folder).eval()
    with torch.no_grad():
        want = model(**enc).logits
    assert (got - want).abs().max() <= 1e-4, (got, want)


def test_a_model_without_a_head_does_not_classify(tmp_path_factory):
    runner = load_encoder(EngineConfig(model=_make(tmp_path_factory, "BertModel")))
    with pytest.raises(ValueError, match="no classification head"):
        runner.classify([runner.tokenize("a")])


# ---- quantization and dtypes ---------------------------------------------------------


@pytest.mark.parametrize(
    "arch", ["BertModel", "ModernBertModel", "NomicBertModel", "GteModel", "MPNetModel"]
)
def test_int8_weights_stay_close(tmp_path_factory, arch):
    folder = _make(tmp_path_factory, arch, seed=11)
    _write_st(folder, {"pooling_mode": "mean"}, normalize=False, dense=16)
    runner = load_encoder(EngineConfig(model=folder, quantization="int8"))
    formats = {
        getattr(m.packed, "format", None) for m in runner.model.modules() if hasattr(m, "packed")
    }
    assert formats == {"q8_0"}
    texts = [*TEXTS, _long_text(runner, MAX_LEN)]
    got = torch.stack(runner.pool([runner.tokenize(t) for t in texts]))
    assert _cosines(got, _reference(folder, texts)).min() >= 0.99
    int4 = load_encoder(EngineConfig(model=folder, quantization="int4"))
    assert torch.isfinite(torch.stack(int4.pool([int4.tokenize(t) for t in texts]))).all()


def test_int8_cross_encoder_runs(tmp_path_factory):
    folder = _make(tmp_path_factory, "BertForSequenceClassification", num_labels=1, seed=2)
    exact = load_encoder(EngineConfig(model=folder))
    int8 = load_encoder(EngineConfig(model=folder, quantization="int8"))
    batch = [exact.tokenize(a, b) for a, b in PAIRS]
    a, b = torch.stack(exact.classify(batch)), torch.stack(int8.classify(batch))
    assert (a - b).abs().max() <= 0.05 * a.abs().max() + 0.05


def test_bfloat16_runs_close(tmp_path_factory):
    folder = _make(tmp_path_factory, "BertModel", seed=4)
    exact = load_encoder(EngineConfig(model=folder))
    half = load_encoder(EngineConfig(model=folder, dtype="bfloat16"))
    batch = [exact.tokenize(t) for t in TEXTS]
    assert _cosines(torch.stack(exact.pool(batch)), torch.stack(half.pool(batch))).min() >= 0.99


# ---- routing, limits and errors ------------------------------------------------------


def test_is_encoder_architecture():
    for arch in (
        "BertModel",
        "XLMRobertaForSequenceClassification",
        "ModernBertModel",
        "NomicBertModel",
        "GteForSequenceClassification",
        "DistilBertModel",
        "MPNetForMaskedLM",
    ):
        assert is_encoder_architecture([arch])
    assert not is_encoder_architecture(["Qwen3ForCausalLM"])
    assert not is_encoder_architecture([])


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    return _make(tmp_path_factory, "BertModel", seed=9)


def test_too_long_and_empty_inputs_are_named(bert_folder):
    runner = load_encoder(EngineConfig(model=bert_folder, max_model_len=16))
    assert runner.max_model_len == 16
    ok = runner.tokenize("a")
    with pytest.raises(ValueError, match=r"input 1 has 17 tokens, more than max_model_len=16"):
        runner.pool([ok, (list(range(17)), None)])
    with pytest.raises(ValueError, match="input 0 has no tokens"):
        runner.pool([([], None)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        runner.pool([([10**6], None)])
    with pytest.raises(ValueError, match="more than this encoder's 64 positions"):
        load_encoder(EngineConfig(model=bert_folder, max_model_len=65))


@pytest.mark.parametrize(
    ("pooling", "key"),
    [
        (_legacy_modes("max_tokens"), "pooling_mode_max_tokens"),
        ({"pooling_mode": "weightedmean"}, "pooling_mode='weightedmean'"),
        ({"pooling_mode": ["cls", "mean"]}, "pooling_mode="),
        ({"pooling_mode": "mean", "include_prompt": False}, "include_prompt=False"),
    ],
)
def test_unknown_pooling_mode_is_a_clear_error(bert_folder, tmp_path, pooling, key):
    import shutil

    folder = shutil.copytree(bert_folder, tmp_path / "model")
    _write_st(str(folder), pooling, normalize=False)
    with pytest.raises(ValueError, match="1_Pooling") as err:
        load_encoder(EngineConfig(model=str(folder)))
    assert key in str(err.value)


def test_unsupported_modules_are_named(bert_folder, tmp_path):
    import shutil

    folder = shutil.copytree(bert_folder, tmp_path / "model")
    _write_st(str(folder), {"pooling_mode": "mean"}, normalize=False, dense=8)
    cfg_path = folder / "2_Dense" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["activation_function"] = "torch.nn.modules.activation.Softplus"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="Dense module is not supported.*Softplus"):
        load_encoder(EngineConfig(model=str(folder)))
    cfg["activation_function"] = "torch.nn.modules.activation.Tanh"
    cfg_path.write_text(json.dumps(cfg))
    load_encoder(EngineConfig(model=str(folder)))
    modules = json.loads((folder / "modules.json").read_text())
    modules.append(
        {"idx": 9, "name": "9", "path": "9_LSTM", "type": "sentence_transformers.models.LSTM"}
    )
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="LSTM"):
        load_encoder(EngineConfig(model=str(folder)))


def test_torch_attention_path_equals_the_kernel():
    """The torch attention path (a GPU's, and MPNet's biased one) with grouped
    queries and a score scale other than ``head_dim ** -0.5`` (EmbeddingGemma)
    gives the Rust kernel's output; a zero bias changes nothing."""
    from fastllm.pooling.encoder_layers import EncoderAttention, PackedInputs

    torch.manual_seed(0)
    inputs = PackedInputs.from_batch([(list(range(n)), None) for n in (5, 9, 9, 17)])
    rows = len(inputs.ids)
    q, k, v = torch.randn(rows, 6, 16), torch.randn(rows, 2, 16), torch.randn(rows, 2, 16)
    attention = EncoderAttention(6, 16, scale=0.3)
    kernel = attention(q, k, v, inputs)
    torch_path = attention(q, k, v, inputs, bias=lambda n: torch.zeros(6, n, n))
    torch.testing.assert_close(torch_path, kernel, atol=2e-6, rtol=1e-5)

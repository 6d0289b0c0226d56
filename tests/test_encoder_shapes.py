"""Every encoder family at shapes its other tests do not build, against transformers.

``test_encoders.py`` builds each family at one width (48 wide, 4 heads, 2
layers) with a few options. Here a seeded generator draws, per family, the
heads and head size (1 to 6 heads of 8 to 32, and Nomic BERT / GTE heads
wider or narrower than hidden / heads), odd intermediate widths, 1 to 3
layers, the activation, the norm epsilon and the family's options
(token-type vocabularies, ModernBERT's layer patterns, windows, biases and
rotary bases, MPNet's relative buckets, DistilBERT's sinusoidal positions);
the embeddings (mean pooling, as sentence-transformers computes it) and a
cross-encoder's logits over text pairs must match transformers.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")

from fastllm.config import EngineConfig  # noqa: E402
from fastllm.pooling.encoder import load_encoder  # noqa: E402
from test_encoders import (  # noqa: E402
    MAX_LEN,
    PAIRS,
    TEXTS,
    _cosines,
    _long_text,
    _make,
    _reference,
    _write_st,
)

transformers.logging.set_verbosity_error()

FAMILIES = [
    "Bert",
    "Roberta",
    "XLMRoberta",
    "DistilBert",
    "MPNet",
    "ModernBert",
    "NomicBert",
    "Gte",
]
ACTIVATIONS = ["gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu"]


def _draw(family: str, rng: random.Random) -> dict[str, Any]:
    """Config fields for ``family`` (``test_encoders._config`` fills the rest)."""
    coin = lambda p=0.5: rng.random() < p  # noqa: E731
    heads = rng.choice([1, 2, 3, 4, 6])
    head = rng.choice([8, 16, 24, 32])
    layers = rng.choice([1, 2, 3])
    common: dict[str, Any] = dict(
        hidden_size=heads * head,
        num_attention_heads=heads,
        intermediate_size=rng.choice([24, 40, 72, 100, 128]),
        num_hidden_layers=layers,
    )
    if family == "DistilBert":
        return dict(
            dim=heads * head, n_heads=heads, hidden_dim=common["intermediate_size"],
            n_layers=layers, activation=rng.choice(["gelu", "relu"]),
            sinusoidal_pos_embds=coin(),
        )  # fmt: skip
    if family == "ModernBert":
        pattern = [rng.choice(["full_attention", "sliding_attention"]) for _ in range(layers)]
        return dict(
            common, layer_types=pattern, local_attention=rng.choice([2, 4, 8, 16]),
            hidden_activation=rng.choice(["gelu", "gelu_pytorch_tanh", "silu"]),
            norm_eps=rng.choice([1e-5, 1e-6]), norm_bias=coin(), attention_bias=coin(),
            mlp_bias=coin(),
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": rng.choice([1e4, 1.6e5])},
                "sliding_attention": {"rope_type": "default", "rope_theta": rng.choice([50.0, 1e4])},
            },
        )  # fmt: skip
    common.update(layer_norm_eps=rng.choice([1e-12, 1e-5]))
    if family in ("NomicBert", "Gte"):
        common.update(
            head_dim=rng.choice([8, 16, 24]), hidden_act=rng.choice(["gelu", "silu", "gelu_new"]),
            rope_parameters={"rope_type": "default", "rope_theta": rng.choice([50.0, 1e3, 1.6e5])},
            type_vocab_size=rng.choice([1, 2] if family == "NomicBert" else [0, 1, 2]),
        )  # fmt: skip
        return common
    common.update(hidden_act=rng.choice(ACTIVATIONS))
    if family == "MPNet":
        common.update(relative_attention_num_buckets=rng.choice([32, 48]))
    elif family == "Bert":
        common.update(type_vocab_size=rng.choice([1, 2, 3]))
    return common


def _folder(tmp_path_factory, family: str, head: str, seed: int, labels: int = 2) -> str:
    rng = random.Random(f"{family}-{head}-{seed}")
    extra = _draw(family, rng)
    if head == "ForSequenceClassification" and family == "ModernBert":
        extra.update(
            classifier_pooling=rng.choice(["cls", "mean"]), classifier_bias=rng.random() < 0.5
        )
    return _make(tmp_path_factory, f"{family}{head}", num_labels=labels, seed=seed, **extra)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_drawn_shapes_embed_as_sentence_transformers(tmp_path_factory, family: str, seed: int):
    folder = _folder(tmp_path_factory, family, "Model", seed)
    _write_st(folder, {"pooling_mode": "mean"}, normalize=False)
    runner = load_encoder(EngineConfig(model=folder))
    texts = [*TEXTS, _long_text(runner, MAX_LEN), _long_text(runner, MAX_LEN // 3)]
    batch = [runner.tokenize(t) for t in texts]
    got = torch.stack(runner.pool(batch))
    want = _reference(folder, texts)
    config = open(os.path.join(folder, "config.json")).read()
    assert _cosines(got, want).min() >= 0.99999, (config, _cosines(got, want))
    assert torch.allclose(got.norm(dim=-1), want.norm(dim=-1), rtol=1e-4), config


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_drawn_shapes_classify_as_transformers(tmp_path_factory, family: str, seed: int):
    labels = 1 + seed * 2
    folder = _folder(tmp_path_factory, family, "ForSequenceClassification", seed, labels)
    runner = load_encoder(EngineConfig(model=folder))
    pairs = [*PAIRS, (TEXTS[2], _long_text(runner, MAX_LEN // 2))]
    config = json.load(open(os.path.join(folder, "config.json")))
    if family == "Bert" and config["type_vocab_size"] == 1:
        # pairs carry token type 1, which a one-row table has not (transformers
        # fails on its embedding lookup): a clear error naming the input
        with pytest.raises(ValueError, match=r"input 0: token type ids .* in \[0, 1\)"):
            runner.classify([runner.tokenize(a, b) for a, b in pairs])
        return
    got = torch.stack(runner.classify([runner.tokenize(a, b) for a, b in pairs]))
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    # token types where the model reads them (a table of more than one row)
    types = runner.tokenize("a", "b")[1] is not None
    enc = tok(
        [a for a, _ in pairs], [b for _, b in pairs], padding=True, return_tensors="pt",
        return_token_type_ids=types,
    )  # fmt: skip
    model = getattr(transformers, f"{family}ForSequenceClassification").from_pretrained(folder)
    with torch.no_grad():
        want = model.eval()(**enc).logits
    assert got.shape == want.shape, config
    assert (got - want).abs().max() <= 1e-4, (config, got, want)


def test_mpnet_with_fewer_than_32_buckets_is_an_error(tmp_path_factory):
    """transformers buckets relative distances into 32 whatever the table's
    size (a smaller table fails its lookup on long inputs): a clear error at
    load, naming the field."""
    folder = _make(tmp_path_factory, "MPNetModel", relative_attention_num_buckets=8)
    with pytest.raises(ValueError, match="relative_attention_num_buckets=8"):
        load_encoder(EngineConfig(model=folder))

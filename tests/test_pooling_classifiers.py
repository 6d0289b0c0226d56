"""Decoders as classifiers and rerankers, against transformers on the same
weights (float32): ``...ForSequenceClassification`` checkpoints (a reranker
of one label, a classifier of three) and a causal LM read as a Qwen3-Reranker
(its "yes" logit against its "no" logit, through ``hf_overrides`` as vLLM
names them)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fastllm import LLM, PoolingParams  # noqa: E402
from tiny_models import tiny_qwen3_config  # noqa: E402

QUERY = "how do I read a file in python?"
DOCS = [
    "with open(path) as f: data = f.read()",
    "import os",
    "The quick brown fox jumps over the lazy dog, again and again and again.",
    "x",
]
TEXTS = ["def f(x): return x + 1", "a", "naïve café 日本語 🙂", "import sys\n" * 9]


def _save(model, tokenizer_dir: str, out) -> str:
    model.to(torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, name), out / name)
    return str(out)


def _eos(tokenizer_dir: str) -> tuple[int, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    return tok.get_vocab_size(), tok.token_to_id("<|endoftext|>")


def _logits(model, tokenizer_dir: str, a: str, b: str | None = None) -> torch.Tensor:
    """transformers' logits of one text (or pair) as its own tokenizer encodes it."""
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok(a, b)["input_ids"] if b is not None else tok(a)["input_ids"]
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def qwen3_reranker(tmp_path_factory, tokenizer_dir):
    """Qwen3ForSequenceClassification, one label, untied (no LM head stored)."""
    vocab, eos = _eos(tokenizer_dir)
    config = tiny_qwen3_config(vocab, eos, num_labels=1, tie_word_embeddings=False)
    torch.manual_seed(5)
    model = transformers.Qwen3ForSequenceClassification(config).eval()
    out = _save(model, tokenizer_dir, tmp_path_factory.mktemp("qwen3-seq-cls"))
    assert json.loads(open(os.path.join(out, "config.json")).read())["architectures"] == [
        "Qwen3ForSequenceClassification"
    ]
    return out, model


def test_sequence_classification_reranker_scores_like_transformers(qwen3_reranker, tokenizer_dir):
    folder, model = qwen3_reranker
    llm = LLM(folder, dtype="float32", max_model_len=256)  # runner="auto": a pooling model
    out = llm.score(QUERY, DOCS)
    want = [torch.sigmoid(_logits(model, tokenizer_dir, QUERY, d))[0].item() for d in DOCS]
    assert [o.outputs.score for o in out] == pytest.approx(want, abs=1e-5)
    # the pair's ids are the tokenizer's (the query's then the document's)
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    assert out[0].prompt_token_ids == tok(QUERY, DOCS[0])["input_ids"]
    # raw logits of single texts, in one mixed-length batch
    raw = llm.classify(TEXTS, pooling_params=PoolingParams(activation=False))
    for text, o in zip(TEXTS, raw):
        assert o.outputs.probs == pytest.approx(
            _logits(model, tokenizer_dir, text).tolist(), abs=1e-4
        )
    with pytest.raises(ValueError, match="embed: this model is a classifier"):
        llm.embed(["x"])


def test_three_label_classifier_softmax(tmp_path_factory, tokenizer_dir):
    """LlamaForSequenceClassification of three labels, tied embeddings: class
    probabilities equal transformers' softmax."""
    vocab, eos = _eos(tokenizer_dir)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        pad_token_id=eos,
        eos_token_id=eos,
        num_labels=3,
        id2label={0: "bad", 1: "neutral", 2: "good"},
        label2id={"bad": 0, "neutral": 1, "good": 2},
    )
    torch.manual_seed(6)
    model = transformers.LlamaForSequenceClassification(config).eval()
    folder = _save(model, tokenizer_dir, tmp_path_factory.mktemp("llama-seq-cls"))
    llm = LLM(folder, runner="pooling", dtype="float32", max_model_len=256)
    for text, o in zip(TEXTS, llm.classify(TEXTS)):
        want = torch.softmax(_logits(model, tokenizer_dir, text), -1)
        assert o.outputs.probs == pytest.approx(want.tolist(), abs=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_causal_lm_as_a_yes_no_reranker(tmp_path_factory, tokenizer_dir, tied):
    """A Qwen3ForCausalLM folder with Qwen3-Reranker's hf_overrides: the score
    is the softmax of its last-position logits of the two tokens, the second
    ("yes") against the first ("no"), as Qwen3-Reranker's own code computes it."""
    vocab, eos = _eos(tokenizer_dir)
    config = tiny_qwen3_config(vocab, eos, tie_word_embeddings=tied)
    torch.manual_seed(7)
    model = transformers.Qwen3ForCausalLM(config).eval()
    folder = _save(model, tokenizer_dir, tmp_path_factory.mktemp(f"qwen3-lm-{tied}"))
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    no, yes = tok.convert_ids_to_tokens([300, 301])
    overrides = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": [no, yes],
        "is_original_qwen3_reranker": True,
    }
    llm = LLM(folder, runner="pooling", dtype="float32", max_model_len=256, hf_overrides=overrides)
    prefix = "<Instruct>: judge\n<Query>: " + QUERY + "\n"
    docs = [f"<Document>: {d}" for d in DOCS]
    for d, o in zip(docs, llm.score(prefix, docs)):
        logits = _logits(model, tokenizer_dir, prefix, d)[-1]
        want = torch.softmax(logits[[300, 301]], -1)[1].item()
        assert o.outputs.score == pytest.approx(want, abs=1e-5)
    # without the 2-way reading, one label per token: their raw logits
    rows = LLM(
        folder,
        runner="pooling",
        dtype="float32",
        max_model_len=256,
        hf_overrides={**overrides, "is_original_qwen3_reranker": False},
    )
    (o,) = rows.classify([TEXTS[0]], pooling_params=PoolingParams(activation=False))
    want = _logits(model, tokenizer_dir, TEXTS[0])[-1][[300, 301]]
    assert o.outputs.probs == pytest.approx(want.tolist(), abs=1e-4)


def test_classifier_errors_name_the_problem(qwen3_reranker, tmp_path, tokenizer_dir):
    folder, _ = qwen3_reranker
    vocab, eos = _eos(tokenizer_dir)
    lm = _save(
        transformers.Qwen3ForCausalLM(tiny_qwen3_config(vocab, eos)), tokenizer_dir, tmp_path / "lm"
    )
    bad = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["@@"]}
    with pytest.raises(ValueError, match="classifier_from_token '@@' is not a token"):
        LLM(lm, runner="pooling", hf_overrides=bad)
    with pytest.raises(ValueError, match="classifier_from_token needs 'architectures'"):
        LLM(
            folder,
            runner="pooling",
            hf_overrides={"architectures": ["Qwen3ForCausalLM"], "classifier_from_token": ["a"]},
        )
    with pytest.raises(ValueError, match="hf_overrides must be a dict"):
        LLM(folder, hf_overrides=["architectures"])
    # a sequence-classification checkpoint without its head
    from safetensors.torch import load_file, save_file

    headless = tmp_path / "headless"
    shutil.copytree(folder, headless)
    state = load_file(str(headless / "model.safetensors"))
    del state["score.weight"]
    save_file(state, str(headless / "model.safetensors"))
    with pytest.raises(ValueError, match="tensor 'score.weight'"):
        LLM(str(headless))


def test_docs_reranker_example_runs(tmp_path, tokenizer_dir, monkeypatch):
    """docs/embeddings.md's Qwen3-Reranker example, run as written in a folder
    holding a tiny Qwen3ForCausalLM under the name it uses (its tokenizer
    given "no" and "yes" tokens)."""
    import re

    from tokenizers import Tokenizer

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "embeddings.md"), encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    (code,) = [b for b in blocks if "hf_overrides" in b]
    name = re.search(r'LLM\(\n\s+"([^"]+)"', code).group(1)
    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    tok.add_tokens(["no", "yes"])
    folder = tmp_path / name
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    shutil.copy(os.path.join(tokenizer_dir, "tokenizer_config.json"), folder)
    config = tiny_qwen3_config(tok.get_vocab_size(), tok.token_to_id("<|endoftext|>"))
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "docs/embeddings.md", "exec"), scope)
    scores = scope["scores"]
    assert len(scores) == 2 and all(0 < s < 1 for s in scores)


def test_server_reranks_with_a_decoder_classifier(qwen3_reranker, tokenizer_dir):
    """``fastllm serve`` on the sequence-classification folder (no runner
    given): /v1/rerank sorted by transformers' sigmoid scores."""
    pytest.importorskip("fastapi")
    import urllib.request

    from server_process import app_server

    folder, model = qwen3_reranker
    want = [torch.sigmoid(_logits(model, tokenizer_dir, QUERY, d))[0].item() for d in DOCS]
    with app_server(folder, 256) as (_, addr):
        body = json.dumps({"query": QUERY, "documents": DOCS, "top_n": 3}).encode()
        req = urllib.request.Request(
            f"http://{addr[0]}:{addr[1]}/v1/rerank", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req) as resp:
            out = json.loads(resp.read())
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])[:3]
    assert [r["index"] for r in out["results"]] == order
    for r in out["results"]:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-5)

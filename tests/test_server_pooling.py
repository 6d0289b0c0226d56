"""The server's pooling routes (/v1/embeddings, rerank, score, classify):
first over a stand-in PoolingEngine (deterministic vectors, so the HTTP
shapes, errors and the batching worker are checked without a model), then
over a real tiny BERT folder against the offline engine."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import json
import math
import sys
import time
import types

import pytest

from server_process import app_server
from tiny_models import tiny_qwen3_config, write_sentence_transformers

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

NAME = "tiny-pool"
KEY = "sk-pool"
MAX_LEN = 32
DIM = 8
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


# ---- a stand-in PoolingEngine ----------------------------------------------------


def _vector(ids: list[int]) -> list[float]:
    """A deterministic vector of token ids (not normalised)."""
    return [sum((t * (k + 3)) % 17 - 8 for t in ids) / len(ids) + 0.1 * k for k in range(DIM)]


def _unit(v: list[float]) -> list[float]:
    n = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / n for x in v]


class FakePoolingEngine:
    """PoolingEngine's interface over ``_vector``: embed, score (cosine), classify."""

    tasks = frozenset({"embed", "score", "classify"})

    def __init__(self, config) -> None:
        from fastllm.outputs import (
            ClassificationOutput,
            ClassificationRequestOutput,
            EmbeddingOutput,
            EmbeddingRequestOutput,
            ScoringOutput,
            ScoringRequestOutput,
        )
        from fastllm.pooling.runner import PoolerConfig
        from fastllm.tokenizer import Tokenizer

        self.out = types.SimpleNamespace(
            embed=(EmbeddingRequestOutput, EmbeddingOutput),
            score=(ScoringRequestOutput, ScoringOutput),
            classify=(ClassificationRequestOutput, ClassificationOutput),
        )
        self.folder = config.model
        self.tokenizer = Tokenizer(config.model)
        self.max_model_len = config.max_model_len or MAX_LEN
        self.pooler = PoolerConfig("MEAN", True, DIM, [4, DIM])
        self.id2label = dict(LABELS)
        self.calls: list[tuple[str, int]] = []
        self.delay = 0.0

    def _ids(self, prompt, params, where: str) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        k = params.truncate_prompt_tokens if params is not None else None
        if k is not None:
            ids = ids[-k:]
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"{where} has {len(ids)} tokens, more than max_model_len={self.max_model_len}"
            )
        return ids

    def _embedding(self, ids: list[int], params, where: str) -> list[float]:
        v = _vector(ids)
        dims = params.dimensions if params is not None else None
        if dims is not None:
            if dims not in self.pooler.matryoshka_dimensions:
                raise ValueError(f"{where}: dimensions={dims}: the model's sizes are 4, {DIM}")
            v = v[:dims]
        normalize = params.normalize if params is not None else None
        return _unit(v) if normalize is not False else v

    def embed(self, prompts, params=None):
        self.calls.append(("embed", len(prompts)))
        time.sleep(self.delay)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self._ids(p, q, f"input[{i}]") for i, (p, q) in enumerate(zip(prompts, plist))]
        vecs = [self._embedding(x, q, f"input[{i}]") for i, (x, q) in enumerate(zip(ids, plist))]
        req, out = self.out.embed
        return [req(f"e{i}", x, out(v)) for i, (x, v) in enumerate(zip(ids, vecs))]

    def score(self, data_1, data_2, params=None):
        self.calls.append(("score", len(data_2)))
        d1 = [data_1] if isinstance(data_1, str) else list(data_1)
        d2 = [data_2] if isinstance(data_2, str) else list(data_2)
        if len(d1) == 1:
            d1 = d1 * len(d2)
        i1 = [self._ids(t, params, f"input[{i}]") for i, t in enumerate(d1)]
        i2 = [self._ids(t, params, f"input[{i}]") for i, t in enumerate(d2)]
        req, out = self.out.score
        res = []
        for i, (a, b) in enumerate(zip(i1, i2)):
            cos = sum(x * y for x, y in zip(_unit(_vector(a)), _unit(_vector(b))))
            res.append(req(f"s{i}", a + b, out(cos)))
        return res

    def classify(self, prompts, params=None):
        self.calls.append(("classify", len(prompts)))
        req, out = self.out.classify
        plist = params if isinstance(params, list) else [params] * len(prompts)
        res = []
        for i, (p, q) in enumerate(zip(prompts, plist)):
            ids = self._ids(p, q, f"input[{i}]")
            logits = _vector(ids)[:3]
            z = [math.exp(x - max(logits)) for x in logits]
            res.append(req(f"c{i}", ids, out([x / sum(z) for x in z])))
        return res


def _fake_module(tasks: frozenset[str]) -> types.ModuleType:
    mod = types.ModuleType("fastllm.pooling.engine")
    mod.PoolingEngine = type("Fake", (FakePoolingEngine,), {"tasks": tasks})
    return mod


@contextlib.contextmanager
def fake_pooling_server(tokenizer_dir: str, tasks=FakePoolingEngine.tasks, **kw):
    """A pooling server (create_app with runner="pooling") whose PoolingEngine
    is the stand-in: (app, (host, port))."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "fastllm.pooling.engine", _fake_module(frozenset(tasks)))
        cm = app_server(tokenizer_dir, MAX_LEN, runner="pooling", **kw)
        served = cm.__enter__()
    try:
        yield served
    finally:
        cm.__exit__(None, None, None)


@pytest.fixture(scope="module")
def fake(tokenizer_dir):
    with fake_pooling_server(tokenizer_dir, served_model_name=NAME, api_key=KEY) as served:
        yield served


@pytest.fixture(scope="module")
def fake_addr(fake):
    return fake[1]


@pytest.fixture(scope="module")
def fake_engine(fake):
    return fake[0].state.fastllm.engine.engine


@pytest.fixture(scope="module")
def fake_client(fake_addr):
    host, port = fake_addr
    return openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key=KEY, max_retries=0)


def _request(addr, method: str, path: str, body=None, key: str | None = KEY, headers=None):
    conn = http.client.HTTPConnection(*addr, timeout=60)
    try:
        h = {"Content-Type": "application/json"}
        if key:
            h["Authorization"] = f"Bearer {key}"
        h.update(headers or {})
        data = json.dumps(body) if body is not None and not isinstance(body, str) else body
        conn.request(method, path, body=data, headers=h)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw or b"null")
        except json.JSONDecodeError:
            return resp.status, raw.decode()
    finally:
        conn.close()


def _post(addr, path, body, **kw):
    return _request(addr, "POST", path, body, **kw)


def _bad(addr, path, body, param):
    status, out = _post(addr, path, body)
    assert status == 400, out
    assert out["error"]["param"] == param, out
    return out["error"]["message"]


# ---- /v1/embeddings --------------------------------------------------------------


TEXTS = ["def fibonacci(n):", "The quick brown fox", "import os", "x"]


def _client_vectors(resp) -> list[list[float]]:
    """The response's embeddings; base64 strings decoded as OpenAI's client
    decodes them when it asks for base64 itself (little-endian float32)."""
    import numpy as np

    return [
        np.frombuffer(base64.b64decode(d.embedding), dtype="<f4").tolist()
        if isinstance(d.embedding, str)
        else d.embedding
        for d in resp.data
    ]


def test_embeddings_through_the_openai_client(fake_client, fake_engine):
    want = fake_engine.embed(TEXTS)
    # no encoding_format: the client asks for base64 and decodes it itself
    for fmt in ("float", "base64", openai.omit):
        resp = fake_client.embeddings.create(model=NAME, input=TEXTS, encoding_format=fmt)
        assert [d.index for d in resp.data] == list(range(len(TEXTS)))
        assert isinstance(resp.data[0].embedding, str) == (fmt == "base64")
        for got, w in zip(_client_vectors(resp), want):
            assert got == pytest.approx(w.outputs.embedding, abs=1e-6)
        tokens = sum(len(w.prompt_token_ids) for w in want)
        assert resp.usage.prompt_tokens == resp.usage.total_tokens == tokens
        assert resp.model == NAME
    one = fake_client.embeddings.create(model=NAME, input=TEXTS[1])
    assert one.data[0].embedding == pytest.approx(want[1].outputs.embedding, abs=1e-6)


def test_embeddings_of_token_ids_dimensions_and_normalize(fake_addr, fake_engine):
    from fastllm.pooling.params import PoolingParams

    ids = [[5, 6, 7], [8, 9]]
    status, out = _post(fake_addr, "/v1/embeddings", {"input": ids})
    assert status == 200, out
    want = fake_engine.embed(ids)
    assert [d["embedding"] for d in out["data"]] == [w.outputs.embedding for w in want]
    status, out = _post(fake_addr, "/v1/embeddings", {"input": ids[0], "dimensions": 4})
    assert status == 200 and len(out["data"][0]["embedding"]) == 4
    status, out = _post(fake_addr, "/v1/embeddings", {"input": ids[0], "normalize": False})
    raw = fake_engine.embed([ids[0]], PoolingParams(normalize=False))[0].outputs.embedding
    assert out["data"][0]["embedding"] == pytest.approx(raw)
    assert out["object"] == "list" and out["data"][0]["object"] == "embedding"


def test_embeddings_base64_is_little_endian_float32(fake_addr, fake_engine):
    import struct

    status, out = _post(fake_addr, "/v1/embeddings", {"input": "abc", "encoding_format": "base64"})
    assert status == 200
    blob = base64.b64decode(out["data"][0]["embedding"])
    got = struct.unpack(f"<{len(blob) // 4}f", blob)
    assert got == pytest.approx(fake_engine.embed(["abc"])[0].outputs.embedding, abs=1e-6)


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"input": []}, "input", "at least one"),
        ({"input": ""}, "input", "empty string"),
        ({"input": ["a", ""]}, "input", "input[1]"),
        ({"input": [[]]}, "input", "empty token list"),
        ({"input": [1, -2]}, "input", "vocabulary"),
        ({"input": [[1], [1, 512]]}, "input", "input[1]: token ids must be in the vocabulary"),
        ({"input": ["a", "word " * 40]}, "input", "input[1] has"),
        ({"input": "a", "dimensions": 5}, "dimensions", "dimensions"),
        ({"input": "a", "dimensions": 0}, "dimensions", "positive"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", "encoding_format"),
        ({"input": "a", "priority": 3}, "priority", "unknown field"),
        ({"input": "a", "truncate_prompt_tokens": -1}, "truncate_prompt_tokens", "positive"),
    ],
)
def test_embeddings_refusals_name_the_field(fake_addr, body, param, words):
    assert words in _bad(fake_addr, "/v1/embeddings", body, param)


def test_a_long_input_with_truncate_prompt_tokens(fake_addr, fake_engine):
    from fastllm.pooling.params import PoolingParams

    long = "word " * 40
    assert "max_model_len" in _bad(fake_addr, "/v1/embeddings", {"input": long}, "input")
    body = {"input": long, "truncate_prompt_tokens": 8}
    status, out = _post(fake_addr, "/v1/embeddings", body)
    assert status == 200, out
    want = fake_engine.embed([long], PoolingParams(truncate_prompt_tokens=8))[0]
    assert out["data"][0]["embedding"] == pytest.approx(want.outputs.embedding)
    assert out["usage"]["prompt_tokens"] == 8


def test_unknown_model_is_a_404(fake_addr):
    status, out = _post(fake_addr, "/v1/embeddings", {"input": "a", "model": "other"})
    assert status == 404 and out["error"]["param"] == "model"


# ---- rerank, score, classify ------------------------------------------------------


DOCS = ["import os", "The quick brown fox", "def fibonacci(n):", "for i in range(10):"]


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_sorted_and_top_n(fake_addr, fake_engine, path):
    want = [o.outputs.score for o in fake_engine.score("def fib(n):", DOCS)]
    body = {"model": NAME, "query": "def fib(n):", "documents": DOCS}
    status, out = _post(fake_addr, path, body)
    assert status == 200, out
    results = out["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCS)))
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    for r in results:
        assert r["relevance_score"] == pytest.approx(want[r["index"]])
        assert r["document"] == {"text": DOCS[r["index"]]}
    assert out["model"] == NAME and out["usage"]["total_tokens"] > 0
    body.update(top_n=2, return_documents=False)
    body["documents"] = [{"text": d} for d in DOCS]
    status, top = _post(fake_addr, path, body)
    assert status == 200
    assert [r["index"] for r in top["results"]] == [r["index"] for r in results[:2]]
    assert all("document" not in r for r in top["results"])


@pytest.mark.parametrize(
    "body, param",
    [
        ({"query": "q", "documents": []}, "documents"),
        ({"query": "", "documents": ["a"]}, "query"),
        ({"query": "q", "documents": ["a", ""]}, "documents"),
        ({"query": "q", "documents": ["a", {"text": ""}]}, "documents"),
        ({"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ({"query": "q", "documents": [{"text": "a", "title": "t"}]}, "documents.0.title"),
        ({"query": "q", "documents": ["a", "word " * 40]}, "documents"),
        ({"documents": ["a"]}, "query"),
    ],
)
def test_rerank_refusals_name_the_field(fake_addr, body, param):
    _bad(fake_addr, "/v1/rerank", body, param)


def test_score_one_to_many_and_pairwise(fake_addr, fake_engine):
    status, out = _post(fake_addr, "/score", {"text_1": "query", "text_2": DOCS})
    assert status == 200, out
    want = fake_engine.score("query", DOCS)
    assert [d["score"] for d in out["data"]] == pytest.approx([w.outputs.score for w in want])
    assert [d["index"] for d in out["data"]] == list(range(len(DOCS)))
    assert all(d["object"] == "score" for d in out["data"])
    pairs = {"text_1": DOCS[:2], "text_2": DOCS[2:]}
    status, out = _post(fake_addr, "/v1/score", pairs)
    want = fake_engine.score(DOCS[:2], DOCS[2:])
    assert [d["score"] for d in out["data"]] == pytest.approx([w.outputs.score for w in want])
    status, out = _post(fake_addr, "/v1/score", {"text_1": "a", "text_2": "b"})
    assert status == 200 and len(out["data"]) == 1
    assert "text_2" in _bad(fake_addr, "/score", {"text_1": DOCS[:2], "text_2": DOCS}, "text_1")
    _bad(fake_addr, "/score", {"text_1": [], "text_2": DOCS}, "text_1")
    _bad(fake_addr, "/score", {"text_1": "", "text_2": DOCS}, "text_1")
    _bad(fake_addr, "/score", {"text_1": "q", "text_2": ["a", ""]}, "text_2")
    _bad(fake_addr, "/score", {"text_1": "q", "text_2": ["a", "word " * 40]}, "text_2")


def test_classify_labels_from_id2label(fake_addr, fake_engine):
    status, out = _post(fake_addr, "/classify", {"model": NAME, "input": TEXTS[:2]})
    assert status == 200, out
    want = fake_engine.classify(TEXTS[:2])
    for d, w in zip(out["data"], want):
        probs = w.outputs.probs
        assert d["probs"] == pytest.approx(probs)
        assert d["num_classes"] == 3
        assert d["label"] == LABELS[probs.index(max(probs))]
    _bad(fake_addr, "/classify", {"input": []}, "input")


def test_a_route_the_model_cannot_do_is_a_400(tokenizer_dir):
    with fake_pooling_server(tokenizer_dir, tasks={"embed"}) as (_, addr):
        for path, body in (
            ("/v1/rerank", {"query": "q", "documents": ["a"]}),
            ("/score", {"text_1": "q", "text_2": "a"}),
            ("/classify", {"input": "a"}),
        ):
            msg = _bad(addr, path, body, "model")
            assert path in msg and "supports: embed" in msg
        assert _post(addr, "/v1/embeddings", {"input": "a"})[0] == 200


# ---- the rest of a pooling server -------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"]
)
def test_generation_routes_on_a_pooling_server_are_a_400(fake_addr, path):
    status, out = _post(fake_addr, path, {"prompt": "hi", "max_tokens": 2})
    assert status == 400, out
    if path == "/v1/messages":
        assert out["type"] == "error"
        msg = out["error"]["message"]
    else:
        msg = out["error"]["message"]
    assert "pooling model" in msg and path in msg


def test_startup_summary(fake):
    from fastllm.server.app import startup_summary

    text = startup_summary(fake[0], "127.0.0.1", 8000)
    assert "runner         pooling (classify, embed, score)" in text
    assert "pooler         MEAN, 8 dimensions (matryoshka: 4, 8), normalized" in text
    assert f"served as      {NAME}" in text and "API key        required" in text


def test_models_health_tokenize_metrics_and_keys(fake_addr):
    status, out = _request(fake_addr, "GET", "/v1/models")
    assert status == 200 and out["data"][0]["id"] == NAME
    assert out["data"][0]["max_model_len"] == MAX_LEN
    assert _request(fake_addr, "GET", "/health", key=None)[0] == 200
    status, out = _post(fake_addr, "/tokenize", {"prompt": "import os"})
    assert status == 200 and out["count"] == len(out["tokens"]) > 0
    status, out = _post(fake_addr, "/detokenize", {"tokens": out["tokens"]})
    assert status == 200 and out["prompt"] == "import os"
    _post(fake_addr, "/v1/embeddings", {"input": "metrics"})
    status, text = _request(fake_addr, "GET", "/metrics", key=None)
    assert status == 200
    assert 'fastllm_pooling_requests_total{model_name="tiny-pool",kind="embed"}' in text
    assert "fastllm_request_latency_seconds_count" in text
    for path in ("/rerank", "/v2/rerank", "/score", "/classify", "/v1/embeddings"):
        status, out = _post(fake_addr, path, {}, key=None)
        assert status == 401, (path, out)


# ---- the batching worker ------------------------------------------------------------


def test_concurrent_requests_share_engine_calls(tokenizer_dir):
    """Requests that arrive while a batch runs are merged into the next engine
    call; a merged call that refuses one input reruns each request alone, so
    only that request fails, naming its own input."""
    from fastllm.config import EngineConfig
    from fastllm.pooling.params import PoolingParams
    from fastllm.server.pooling_loop import AsyncPooling

    engine = FakePoolingEngine(EngineConfig(model=tokenizer_dir, max_model_len=MAX_LEN))
    engine.delay = 0.05
    pool = AsyncPooling(engine)
    pool.start()
    long = "word " * 40
    inputs = [[f"text {i}", f"more {i}"] for i in range(12)] + [["ok", long]]
    dims = [PoolingParams(dimensions=4 if i % 2 else None) for i in range(len(inputs))]

    async def run() -> list:
        jobs = [pool.embed(x, p) for x, p in zip(inputs, dims)]
        return await asyncio.gather(*jobs, return_exceptions=True)

    try:
        results = asyncio.run(run())
    finally:
        pool.shutdown()
    assert isinstance(results[-1], ValueError) and str(results[-1]).startswith("input[1] has")
    for x, p, got in zip(inputs[:-1], dims, results[:-1]):
        assert [o.outputs.embedding for o in got] == [
            o.outputs.embedding for o in engine.embed(x, p)
        ]
    merged = [n for kind, n in engine.calls if kind == "embed"]
    assert max(merged) > 2  # at least one call held several requests' inputs
    assert pool.stats.requests["embed"] == 12 and pool.stats.errors == 1


def test_a_stopped_worker_answers_503(tokenizer_dir):
    from fastllm.config import EngineConfig
    from fastllm.server.engine_loop import EngineDeadError
    from fastllm.server.pooling_loop import AsyncPooling

    pool = AsyncPooling(FakePoolingEngine(EngineConfig(model=tokenizer_dir)))
    with pytest.raises(EngineDeadError):
        asyncio.run(pool.embed(["a"], None))
    pool.start()
    assert pool.is_alive
    pool.shutdown()
    assert not pool.is_alive
    with pytest.raises(EngineDeadError):
        asyncio.run(pool.embed(["a"], None))


# ---- fastllm bench embed ------------------------------------------------------------


def test_bench_embed_prints_a_row_per_length_and_batch_size(tokenizer_dir, capsys, tmp_path):
    from fastllm.cli import main

    out = tmp_path / "embed.json"
    argv = ["bench", "embed", tokenizer_dir, "--num-docs", "6", "--lengths", "4,8"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "fastllm.pooling.engine", _fake_module(FakePoolingEngine.tasks))
        assert main([*argv, "--batch-size", "2,4", "--json", str(out)]) == 0
        assert main([*argv, "--batch-size", "3", "--docs", "text"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["length", "batch_size", "docs_per_s", "tokens_per_s", "elapsed_s"]
    rows = json.loads(out.read_text())["results"]
    assert [(r["length"], r["batch_size"]) for r in rows] == [(4, 2), (4, 4), (8, 2), (8, 4)]
    assert all(r["num_docs"] == 6 and r["docs_per_s"] > 0 for r in rows)
    assert rows[2]["tokens_per_s"] == pytest.approx(rows[2]["docs_per_s"] * 8)


# ---- a generation server ------------------------------------------------------------


def test_pooling_routes_on_a_generation_server_are_a_400(make_model):
    with app_server(make_model("llama"), 64) as (_, addr):
        for path in ("/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank", "/score"):
            status, out = _post(addr, path, {"input": "a"}, key=None)
            assert status == 400, (path, out)
            msg = out["error"]["message"]
            assert path in msg and "--runner pooling" in msg
        status, out = _post(addr, "/classify", {"input": "a"}, key=None)
        assert status == 400 and out["error"]["param"] == "model"
        body = {"prompt": "def", "max_tokens": 2}
        assert _post(addr, "/v1/completions", body, key=None)[0] == 200


# ---- real models: the server against the offline PoolingEngine -----------------------


def _save_tokenizer(tokenizer_dir: str, out) -> None:
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tokenizer_dir}/{name}", out / name)


@pytest.fixture(scope="module")
def decoder_embedder_dir(tmp_path_factory, tokenizer_dir) -> str:
    """A tiny random Qwen3 base model as an embedder (Qwen3-Embedding's shape:
    last-token pooling, normalised, Matryoshka sizes 16 and 32)."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    out = tmp_path_factory.mktemp("qwen3-embedder")
    eos = Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json").token_to_id("<|endoftext|>")
    config = tiny_qwen3_config(512, eos, max_position_embeddings=256, initializer_range=0.02)
    torch.manual_seed(3)
    tf.Qwen3Model(config).to(torch.float32).save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg))
    _save_tokenizer(tokenizer_dir, out)
    write_sentence_transformers(out, "last", 64, [16, 32])
    return str(out)


REAL_LEN = 64


@contextlib.contextmanager
def _real_server(folder: str):
    """The model served (runner="pooling") and the same model offline: (addr, engine)."""
    from fastllm.config import EngineConfig
    from fastllm.pooling.engine import PoolingEngine

    config = EngineConfig(
        model=folder, runner="pooling", dtype="float32", device="cpu", max_model_len=REAL_LEN
    )
    offline = PoolingEngine(config)
    kw = {"served_model_name": NAME, "api_key": KEY}
    with app_server(folder, REAL_LEN, runner="pooling", **kw) as (_, addr):
        yield addr, offline


@pytest.fixture(scope="module")
def decoder_served(decoder_embedder_dir):
    with _real_server(decoder_embedder_dir) as served:
        yield served


def test_decoder_embedder_over_the_openai_client(decoder_served):
    from fastllm.pooling.params import PoolingParams

    addr, offline = decoder_served
    client = openai.OpenAI(base_url=f"http://{addr[0]}:{addr[1]}/v1", api_key=KEY, max_retries=0)
    want = [o.outputs.embedding for o in offline.embed(TEXTS)]
    for fmt in ("float", "base64", openai.omit):
        resp = client.embeddings.create(model=NAME, input=TEXTS, encoding_format=fmt)
        for got, w in zip(_client_vectors(resp), want):
            assert got == pytest.approx(w, abs=1e-5)
    resp = client.embeddings.create(model=NAME, input=TEXTS[:2], dimensions=16)
    short = offline.embed(TEXTS[:2], PoolingParams(dimensions=16))
    for got, w in zip(_client_vectors(resp), short):
        assert len(got) == 16 and got == pytest.approx(w.outputs.embedding, abs=1e-5)
    ids = offline.tokenizer.encode(TEXTS[0])
    resp = client.embeddings.create(model=NAME, input=[ids])
    assert _client_vectors(resp)[0] == pytest.approx(offline.embed([ids])[0].outputs.embedding)
    assert resp.usage.prompt_tokens == len(ids)


def test_decoder_embedder_rerank_and_score_are_cosines(decoder_served):
    addr, offline = decoder_served
    query = "how do I read a file?"
    want = [o.outputs.score for o in offline.score(query, DOCS)]
    status, out = _post(addr, "/v1/rerank", {"query": query, "documents": DOCS, "top_n": 3})
    assert status == 200, out
    assert [r["index"] for r in out["results"]] == sorted(range(len(DOCS)), key=lambda i: -want[i])[
        :3
    ]
    for r in out["results"]:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-5)
    status, out = _post(addr, "/score", {"text_1": query, "text_2": DOCS})
    assert [d["score"] for d in out["data"]] == pytest.approx(want, abs=1e-5)


def test_decoder_embedder_refusals(decoder_served):
    addr, _ = decoder_served
    long = "import os\n" * 60
    assert "max_model_len=64" in _bad(addr, "/v1/embeddings", {"input": ["x", long]}, "input")
    body = {"input": long, "truncate_prompt_tokens": 10}
    status, out = _post(addr, "/v1/embeddings", body)
    assert status == 200 and out["usage"]["prompt_tokens"] == 10
    _bad(addr, "/v1/embeddings", {"input": "x", "dimensions": 100}, "dimensions")
    _bad(addr, "/v1/embeddings", {"input": []}, "input")
    _bad(addr, "/v1/rerank", {"query": "q", "documents": []}, "documents")
    _bad(addr, "/v1/rerank", {"query": "q", "documents": ["x", long]}, "documents")
    assert "cannot classify" in _bad(addr, "/classify", {"input": "x"}, "model")
    status, out = _post(addr, "/v1/chat/completions", {"messages": []})
    assert status == 400 and "pooling model" in out["error"]["message"]


def test_concurrent_http_requests_equal_offline(decoder_served):
    from concurrent.futures import ThreadPoolExecutor

    addr, offline = decoder_served
    inputs = [[f"document number {i}", TEXTS[i % len(TEXTS)]] for i in range(16)]

    def one(texts: list[str]) -> list[list[float]]:
        status, out = _post(addr, "/v1/embeddings", {"input": texts})
        assert status == 200, out
        return [d["embedding"] for d in out["data"]]

    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(one, inputs))
    for texts, got in zip(inputs, results):
        want = [o.outputs.embedding for o in offline.embed(texts)]
        for g, w in zip(got, want):
            assert g == pytest.approx(w, abs=1e-5)


# ---- real BERT encoders: an embedder, a cross-encoder, a classifier -------------------


def _bert_tokenizer(out) -> int:
    """A WordPiece tokenizer ([CLS] a [SEP] b [SEP]) trained on local text in
    ``out``; its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import WordPieceTrainer

    from conftest import _corpus

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(
        _corpus(), trainer=WordPieceTrainer(vocab_size=300, special_tokens=specials)
    )
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    tok.save(str(out / "tokenizer.json"))
    names = dict(cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", unk_token="[UNK]")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": REAL_LEN, **names}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


@pytest.fixture(scope="module")
def make_bert(tmp_path_factory):
    """Builds a tiny random BERT folder: ``BertModel`` (an embedder, mean
    pooling) or ``BertForSequenceClassification`` with ``labels`` labels."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")

    def build(labels: dict[int, str] | None = None) -> str:
        out = tmp_path_factory.mktemp("bert")
        vocab = _bert_tokenizer(out)
        head = {"id2label": labels, "label2id": {v: k for k, v in labels.items()}} if labels else {}
        config = tf.BertConfig(
            vocab_size=vocab,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=REAL_LEN,
            initializer_range=0.2,
            **head,
        )
        torch.manual_seed(len(labels or ()))
        cls = tf.BertForSequenceClassification if labels else tf.BertModel
        cls(config).eval().save_pretrained(str(out))
        return str(out)

    return build


def test_bert_embeddings_over_the_openai_client(make_bert):
    with _real_server(make_bert()) as (addr, offline):
        assert offline.tasks == frozenset({"embed", "score"})
        url = f"http://{addr[0]}:{addr[1]}/v1"
        client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
        want = offline.embed(TEXTS)
        resp = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="base64")
        assert all(isinstance(d.embedding, str) for d in resp.data)
        for got, w in zip(_client_vectors(resp), want):
            assert got == pytest.approx(w.outputs.embedding, abs=1e-5)
        assert resp.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
        resp = client.embeddings.create(model=NAME, input=TEXTS)  # the client's base64
        for got, w in zip(_client_vectors(resp), want):
            assert got == pytest.approx(w.outputs.embedding, abs=1e-5)
        long = "import os " * 40
        assert "max_model_len" in _bad(addr, "/v1/embeddings", {"input": ["a", long]}, "input")
        # no Matryoshka sizes declared: any dimensions is refused
        _bad(addr, "/v1/embeddings", {"input": "a", "dimensions": 8}, "dimensions")
        msg = _bad(addr, "/classify", {"input": "a"}, "model")
        assert "supports: embed, score" in msg


def test_bert_cross_encoder_rerank_equals_offline(make_bert):
    query = "what does the function return?"
    with _real_server(make_bert({0: "LABEL_0"})) as (addr, offline):
        assert "score" in offline.tasks
        want = [o.outputs.score for o in offline.score(query, DOCS)]
        order = sorted(range(len(DOCS)), key=lambda i: -want[i])
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            body = {"model": NAME, "query": query, "documents": DOCS}
            status, out = _post(addr, path, body)
            assert status == 200, out
            assert [r["index"] for r in out["results"]] == order
            for r in out["results"]:
                assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-5)
                assert r["document"]["text"] == DOCS[r["index"]]
            status, out = _post(addr, path, {**body, "top_n": 2, "return_documents": False})
            assert [r["index"] for r in out["results"]] == order[:2]
            assert all("document" not in r for r in out["results"])
        status, out = _post(addr, "/score", {"text_1": [query, query], "text_2": DOCS[:2]})
        assert [d["score"] for d in out["data"]] == pytest.approx(want[:2], abs=1e-5)
        long = "import os " * 40
        _bad(addr, "/v1/rerank", {"query": query, "documents": ["a", long]}, "documents")
        body = {"query": query, "documents": ["a", long], "truncate_prompt_tokens": 16}
        assert _post(addr, "/v1/rerank", body)[0] == 200
        msg = _bad(addr, "/v1/embeddings", {"input": "a"}, "model")
        assert "cannot embed" in msg


def test_bert_classifier_labels(make_bert):
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    with _real_server(make_bert(labels)) as (addr, offline):
        status, out = _post(addr, "/classify", {"input": TEXTS})
        assert status == 200, out
        for d, w in zip(out["data"], offline.classify(TEXTS)):
            probs = w.outputs.probs
            assert d["probs"] == pytest.approx(probs, abs=1e-5)
            assert d["num_classes"] == 3
            assert d["label"] == labels[probs.index(max(probs))]

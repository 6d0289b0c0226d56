"""The OpenAI-compatible server: a real ``fastllm serve`` process on 127.0.0.1,
driven by the official ``openai`` client and compared with offline ``LLM``
runs of the same requests."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time

import pytest

from server_process import app_server, free_port, package_env, running_server, serve_command

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from fastllm import LLM, SamplingParams  # noqa: E402

NAME = "tiny"
KEY = "sk-test-key"
MAX_LEN = 256
PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox",
    "import os\nimport sys\n",
    "class Foo:\n    def __init__(self):",
    "return self.",
    "for i in range(",
    "x",
    "    # a comment about",
]


@pytest.fixture(scope="module")
def model_dir(make_model) -> str:
    return make_model("llama")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """One server process for the whole module: (host, port)."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = serve_command(model_dir, port, MAX_LEN, NAME, KEY)
    env = package_env()
    with running_server(cmd, port, log, env):
        yield "127.0.0.1", port


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    host, port = server
    return openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    """The offline reference: the same model in this process."""
    return LLM(model_dir, dtype="float32", device="cpu", max_model_len=MAX_LEN)


def _get(host: str, port: int, path: str, headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _post(host: str, port: int, path: str, body, headers: dict | None = None, **kw):
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        h = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
        h.update(headers or {})
        conn.request("POST", path, body=body, headers=h, **kw)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def _metrics(server) -> dict[str, float]:
    """The /metrics page as {name{labels}: value}, labels reduced to the finish reason."""
    status, body = _get(*server, "/metrics")
    assert status == 200
    out = {}
    for line in body.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        name, _, labels = key.partition("{")
        extra = [p for p in labels.rstrip("}").split(",") if not p.startswith("model_name=")]
        out[name + (f"{{{','.join(extra)}}}" if extra else "")] = float(value)
    return out


def _offline(llm: LLM, prompt, **kw):
    (out,) = llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)
    return out


# ---- basic endpoints -------------------------------------------------------------


def test_models_and_health(server, client, model_dir):
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert _get(*server, "/health")[0] == 200


def test_completion_matches_offline(client, llm):
    kw = dict(temperature=0.8, top_p=0.95, seed=1234, max_tokens=12)
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], **kw)
    ref = _offline(llm, PROMPTS[0], **kw)
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(llm.get_tokenizer().encode(PROMPTS[0]))
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert r.model == NAME and r.object == "text_completion"


def test_token_id_prompt_and_several_prompts(client, llm):
    tok = llm.get_tokenizer()
    kw = dict(temperature=0.0, max_tokens=6)
    want = [_offline(llm, p, **kw).outputs[0].text for p in PROMPTS[1:3]]
    ids = [tok.encode(p) for p in PROMPTS[1:3]]
    for prompt in (ids, PROMPTS[1:3]):
        r = client.completions.create(model=NAME, prompt=prompt, **kw)
        assert [c.index for c in r.choices] == [0, 1]
        assert [c.text for c in r.choices] == want
    r = client.completions.create(model=NAME, prompt=ids[0], **kw)
    assert r.choices[0].text == want[0]


def test_chat_matches_offline(client, llm):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Write a loop."},
    ]
    r = client.chat.completions.create(
        model=NAME,
        messages=messages,
        temperature=0.0,
        max_tokens=10,
        extra_body={"ignore_eos": True},
    )
    (ref,) = llm.chat(
        messages, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == 10


def test_streaming_completion_equals_whole(client):
    kw = dict(model=NAME, prompt=PROMPTS[3], temperature=0.9, seed=7, max_tokens=14)
    whole = client.completions.create(**kw)
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_streaming_chat_equals_whole(client):
    kw = dict(
        model=NAME,
        messages=[{"role": "user", "content": "hello there"}],
        temperature=0.7,
        seed=11,
        max_tokens=12,
    )
    whole = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == (
        whole.choices[0].finish_reason
    )
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n2_matches_offline(client, llm):
    kw = dict(temperature=1.0, seed=99, max_tokens=8, n=2)
    r = client.completions.create(model=NAME, prompt=PROMPTS[4], **kw)
    ref = _offline(llm, PROMPTS[4], **kw)
    assert sorted(c.index for c in r.choices) == [0, 1]
    by_index = {c.index: c.text for c in r.choices}
    assert by_index == {c.index: c.text for c in ref.outputs}
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[4], stream=True, **kw))
    streamed = {0: "", 1: ""}
    for ch in chunks:
        streamed[ch.choices[0].index] += ch.choices[0].text
    assert streamed == by_index


def test_stop_strings(client, llm):
    kw = dict(temperature=0.0, max_tokens=24, extra_body={"ignore_eos": True})
    full = client.completions.create(model=NAME, prompt=PROMPTS[0], **kw).choices[0].text
    assert len(full) >= 8, full
    stop = full[4:7]
    want = full[: full.index(stop)]
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], stop=[stop], **kw)
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(model=NAME, prompt=PROMPTS[0], stop=stop, stream=True, **kw)
    )
    assert "".join(c.choices[0].text for c in chunks) == want
    chat = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "hi"}],
        temperature=0.0,
        max_tokens=16,
        extra_body={"ignore_eos": True},
    )
    ctext = chat.choices[0].message.content
    assert len(ctext) >= 4, ctext
    cstop = ctext[2:4]
    stopped = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "hi"}],
        temperature=0.0,
        max_tokens=16,
        stop=cstop,
        extra_body={"ignore_eos": True},
    )
    assert stopped.choices[0].message.content == ctext[: ctext.index(cstop)]


def _sse_stop_for(llm: LLM, prompt: str, seed: int) -> str:
    """A piece of the sampled completion 0 that spans several tokens."""
    (ref,) = llm.generate(
        [prompt],
        SamplingParams(n=2, temperature=0.9, seed=seed, max_tokens=24, ignore_eos=True),
        use_tqdm=False,
    )
    c0, tok = ref.outputs[0], llm.get_tokenizer()
    for k in range(1, len(c0.token_ids) - 3):
        piece = tok.decode(c0.token_ids[k : k + 3])
        if len(piece) >= 3 and len(tok.decode(c0.token_ids[k : k + 1])) < len(piece):
            if piece in c0.text:
                return piece
    pytest.skip("no multi-token piece in the sampled text")


@pytest.mark.parametrize("include", [False, True])
def test_sse_streams_join_to_the_whole_reply(client, llm, include):
    """Completions and chat, n = 2, seeded, a stop string spanning several
    tokens: the joined SSE text and tokens equal the non-streamed reply's."""
    prompt = PROMPTS[1]
    stop = _sse_stop_for(llm, prompt, seed=21)
    extra = {"ignore_eos": True, "include_stop_str_in_output": include}
    kw = dict(temperature=0.9, seed=21, max_tokens=24, n=2, stop=[stop], extra_body=extra)

    whole = client.completions.create(model=NAME, prompt=prompt, logprobs=1, **kw)
    chunks = list(
        client.completions.create(model=NAME, prompt=prompt, logprobs=1, stream=True, **kw)
    )
    text, toks, finish = {0: "", 1: ""}, {0: [], 1: []}, {}
    for ch in chunks:
        for c in ch.choices:
            text[c.index] += c.text
            toks[c.index] += c.logprobs.tokens if c.logprobs else []
            if c.finish_reason:
                assert c.index not in finish, "one finish per choice"
                finish[c.index] = c.finish_reason
    assert whole.choices[0].finish_reason == "stop"  # completion 0 meets the stop string
    for c in whole.choices:
        assert text[c.index] == c.text
        assert toks[c.index] == c.logprobs.tokens
        assert finish[c.index] == c.finish_reason
    ref = _offline(
        llm,
        prompt,
        temperature=0.9,
        seed=21,
        max_tokens=24,
        n=2,
        stop=[stop],
        ignore_eos=True,
        include_stop_str_in_output=include,
    )
    assert {c.index: c.text for c in whole.choices} == {c.index: c.text for c in ref.outputs}
    assert whole.choices[0].text.endswith(stop) == include

    messages = [{"role": "user", "content": prompt}]
    chat = client.chat.completions.create(model=NAME, messages=messages, logprobs=True, **kw)
    chat_chunks = list(
        client.chat.completions.create(
            model=NAME, messages=messages, logprobs=True, stream=True, **kw
        )
    )
    text, toks, finish = {0: "", 1: ""}, {0: [], 1: []}, {}
    for ch in chat_chunks:
        for c in ch.choices:
            text[c.index] += c.delta.content or ""
            toks[c.index] += [t.token for t in (c.logprobs.content if c.logprobs else [])]
            if c.finish_reason:
                assert c.index not in finish, "one finish per choice"
                finish[c.index] = c.finish_reason
    for c in chat.choices:
        assert text[c.index] == c.message.content
        assert toks[c.index] == [t.token for t in c.logprobs.content]
        assert finish[c.index] == c.finish_reason


def test_logprobs(client, llm):
    kw = dict(temperature=0.0, max_tokens=6, extra_body={"ignore_eos": True})
    r = client.completions.create(model=NAME, prompt=PROMPTS[5], logprobs=3, **kw)
    ref = _offline(llm, PROMPTS[5], temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    c, rc = r.choices[0], ref.outputs[0]
    want = [rc.logprobs[i][t].logprob for i, t in enumerate(rc.token_ids)]
    assert c.logprobs.token_logprobs == pytest.approx(want, abs=1e-5)
    tok = llm.get_tokenizer()
    assert c.logprobs.tokens == [tok.decode([t], skip_special_tokens=False) for t in rc.token_ids]
    for lp, top in zip(c.logprobs.token_logprobs, c.logprobs.top_logprobs):
        assert 1 <= len(top) <= 4
        # greedy: the chosen token is the most likely one
        assert lp == pytest.approx(max(top.values()), abs=1e-6)
    offsets = c.logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)

    chat = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        top_logprobs=2,
        **kw,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 6
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-6)
        assert item.bytes == list(item.token.encode())


def test_seeded_reproducible(client, llm):
    kw = dict(temperature=1.0, top_k=50, max_tokens=10)
    texts = [
        client.completions.create(
            model=NAME,
            prompt=PROMPTS[6],
            seed=2024,
            max_tokens=10,
            temperature=1.0,
            extra_body={"top_k": 50},
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert texts[0] == texts[1]
    assert texts[0] == _offline(llm, PROMPTS[6], seed=2024, **kw).outputs[0].text


# ---- bad requests ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": MAX_LEN + 10}, "max_tokens"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"logprobs": 50}, "logprobs"),
        ({"temperature": "hot"}, "temperature"),
        ({"extra_body": {"top_k": -3}}, "top_k"),
        ({"extra_body": {"min_p": 2.0}}, "min_p"),
        ({"extra_body": {"repetition_penalty": 0.0}}, "repetition_penalty"),
        ({"extra_body": {"stop_token_ids": [-1]}}, "stop_token_ids"),
        ({"extra_body": {"min_tokens": 20}, "max_tokens": 5}, "min_tokens"),
        ({"prompt": "x " * (MAX_LEN + 50)}, "prompt"),
        ({"prompt": []}, "prompt"),
    ],
)
def test_invalid_completion_params(client, kwargs, field):
    kw = {"model": NAME, "prompt": "hello"}
    kw.update(kwargs)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(**kw)
    assert exc.value.status_code == 400
    assert exc.value.body["param"] == field
    assert field in exc.value.body["message"]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages.0.role"),
    ],
)
def test_invalid_chat_params(client, kwargs, field):
    kw = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
    kw.update(kwargs)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(**kw)
    assert exc.value.body["param"] == field
    assert field in exc.value.body["message"]


def test_api_key(server, client):
    host, port = server
    bad = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=NAME, prompt="hi", max_tokens=2)
    status, body = _get(host, port, "/v1/models")  # no Authorization header at all
    assert status == 401 and body and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert _get(host, port, "/health")[0] == 200  # health stays open


def test_unknown_model_and_malformed_bodies(server, client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="no-such-model", prompt="hi")
    assert exc.value.body["param"] == "model"
    status, body = _post(*server, "/v1/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "BadRequestError"
    status, body = _post(*server, "/v1/completions", b"[1, 2]")
    assert status == 400
    status, body = _post(*server, "/v1/completions", json.dumps({"model": NAME}))
    assert status == 400 and body["error"]["param"] == "prompt"


def test_body_over_limit(server):
    big = json.dumps({"model": NAME, "prompt": "a" * (5 << 20)}).encode()
    status, body = _post(*server, "/v1/completions", big)
    assert status == 413 and "limit" in body["error"]["message"]
    # a chunked body has no Content-Length: the limit applies while reading
    chunks = (big[i : i + (1 << 20)] for i in range(0, len(big), 1 << 20))
    status, body = _post(*server, "/v1/completions", chunks, encode_chunked=True)
    assert status == 413


def test_tokenize_detokenize(server, llm):
    tok = llm.get_tokenizer()
    status, body = _post(*server, "/tokenize", json.dumps({"prompt": PROMPTS[2]}))
    assert status == 200 and body["tokens"] == tok.encode(PROMPTS[2])
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_LEN
    status, body = _post(*server, "/detokenize", json.dumps({"tokens": body["tokens"]}))
    assert status == 200 and body["prompt"] == PROMPTS[2]
    status, body = _post(*server, "/detokenize", json.dumps({"tokens": [10**6]}))
    assert status == 400 and body["error"]["param"] == "tokens"


# ---- load and disconnects --------------------------------------------------------


def test_64_concurrent_streaming_clients(server, llm):
    host, port = server
    n_clients = 64
    reqs = [
        (PROMPTS[i % len(PROMPTS)], 1000 + i, 0.6 + 0.05 * (i % 8), 4 + i % 5)
        for i in range(n_clients)
    ]

    async def one(client, prompt, seed, temp, max_tokens) -> str:
        stream = await client.completions.create(
            model=NAME,
            prompt=prompt,
            seed=seed,
            temperature=temp,
            max_tokens=max_tokens,
            stream=True,
        )
        parts = []
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
        return "".join(parts)

    async def bad(client) -> int:
        try:
            await client.completions.create(model=NAME, prompt="x", top_p=7.0)
        except openai.BadRequestError as e:
            return e.status_code
        return 200

    async def main():
        client = openai.AsyncOpenAI(
            base_url=f"http://{host}:{port}/v1", api_key=KEY, max_retries=0, timeout=120
        )
        async with client:
            jobs = [one(client, *r) for r in reqs] + [bad(client) for _ in range(4)]
            return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    texts, bad_codes = results[:n_clients], results[n_clients:]
    assert bad_codes == [400] * 4
    params = [SamplingParams(seed=s, temperature=t, max_tokens=m) for _, s, t, m in reqs]
    ref = llm.generate([r[0] for r in reqs], params, use_tqdm=False)
    assert texts == [o.outputs[0].text for o in ref]


def _open_stream(server, prompt: str) -> socket.socket:
    """Starts a streaming completion on a raw socket and reads its first event."""
    body = json.dumps(
        {
            "model": NAME,
            "prompt": prompt,
            "max_tokens": 200,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
        }
    ).encode()
    sock = socket.create_connection(server, timeout=30)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body)
    data = b""
    while b"data: " not in data:
        part = sock.recv(4096)
        assert part, "the server closed the stream early"
        data += part
    assert data.startswith(b"HTTP/1.1 200")
    return sock


def test_disconnect_returns_blocks(server):
    before = _metrics(server)
    assert before["fastllm_num_requests_running"] == 0
    socks = [_open_stream(server, p) for p in PROMPTS[:4]]
    during = _metrics(server)
    assert during["fastllm_kv_blocks_free"] < before["fastllm_kv_blocks_free"]
    for s in socks:
        s.close()
    deadline = time.time() + 30
    while True:
        after = _metrics(server)
        idle = after["fastllm_num_requests_running"] == 0
        idle = idle and after["fastllm_num_requests_waiting"] == 0
        if idle or time.time() > deadline:
            break
        time.sleep(0.05)
    assert idle
    assert after["fastllm_kv_blocks_free"] == before["fastllm_kv_blocks_free"]
    key = 'fastllm_request_finished_total{finished_reason="abort"}'
    assert after[key] - before[key] == 4
    # the aborted requests stopped early: far fewer than 4 x 200 tokens were generated
    made = after["fastllm_generation_tokens_total"] - before["fastllm_generation_tokens_total"]
    assert made < 4 * 200


def test_prefix_cache_hits(server, client):
    before = _metrics(server)
    prompt = " ".join(PROMPTS) * 2  # several full KV blocks
    for _ in range(2):
        client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0.0)
    after = _metrics(server)
    hits = after["fastllm_prefix_cache_hits_total"] - before["fastllm_prefix_cache_hits_total"]
    assert hits >= 2


def test_metrics(server):
    m = _metrics(server)
    assert m["fastllm_generation_tokens_total"] > 0
    assert m["fastllm_prompt_tokens_total"] > 0
    assert m["fastllm_time_to_first_token_seconds_count"] > 0
    assert (
        m['fastllm_time_to_first_token_seconds_bucket{le="+Inf"}']
        == (m["fastllm_time_to_first_token_seconds_count"])
    )
    assert m["fastllm_inter_token_latency_seconds_count"] > 0
    assert m["fastllm_kv_blocks_used"] + m["fastllm_kv_blocks_free"] == m["fastllm_kv_blocks_total"]
    assert 0.0 < m["fastllm_prefix_cache_hit_rate"] <= 1.0


# ---- servers in this process: chat templates, model names, engine limits -----------

PLAIN_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:{% endif %}"
)


def _app_server(model: str, chat_template: str | None = None, **engine):
    """create_app(...) served on a thread of this process (server_process.app_server)."""
    return app_server(model, MAX_LEN, chat_template, **engine)


def _record_params(app) -> list[SamplingParams]:
    """The SamplingParams of every request the app hands its engine from now on."""
    engine = app.state.fastllm.engine
    seen: list[SamplingParams] = []
    real = engine.generate

    def generate(prompt, prompt_token_ids, params, *args, **kw):
        seen.append(params)
        return real(prompt, prompt_token_ids, params, *args, **kw)

    engine.generate = generate
    return seen


def test_no_chat_template_names_the_server_option(untemplated_model_dir):
    from fastllm.server.app import startup_summary

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with _app_server(untemplated_model_dir, max_logprobs=2) as (app, addr):
        for path, body in (
            ("/v1/chat/completions", chat),
            ("/tokenize", {"messages": chat["messages"]}),
        ):
            status, answer = _post(*addr, path, json.dumps(body))
            assert status == 400, answer
            msg = answer["error"]["message"]
            assert "start the server with --chat-template FILE|STRING" in msg
            assert "chat()" not in msg and "chat_template=" not in msg
        # a request's own template still works, and completions need none
        status, answer = _post(
            *addr, "/v1/chat/completions", json.dumps({**chat, "chat_template": PLAIN_TEMPLATE})
        )
        assert status == 200, answer
        status, answer = _post(
            *addr, "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2})
        )
        assert status == 200, answer
        # the logprobs limit is the engine's max_logprobs (--max-logprobs)
        body = {"prompt": "x", "max_tokens": 2, "logprobs": 3}
        status, answer = _post(*addr, "/v1/completions", json.dumps(body))
        assert status == 400 and answer["error"]["param"] == "logprobs", answer
        assert "max_logprobs=2" in answer["error"]["message"]
        assert "--max-logprobs" in answer["error"]["message"]
        body["logprobs"] = 2
        assert _post(*addr, "/v1/completions", json.dumps(body))[0] == 200
        body = {**chat, "chat_template": PLAIN_TEMPLATE, "logprobs": True, "top_logprobs": 3}
        status, answer = _post(*addr, "/v1/chat/completions", json.dumps(body))
        assert status == 400 and answer["error"]["param"] == "top_logprobs", answer
        # served under the folder's name; the path as given is accepted too
        status, models = _get(*addr, "/v1/models")
        assert [m["id"] for m in json.loads(models)["data"]] == ["tiny-untemplated"]
        for name in ("tiny-untemplated", untemplated_model_dir):
            body = {"model": name, "prompt": "x", "max_tokens": 2}
            status, answer = _post(*addr, "/v1/completions", json.dumps(body))
            assert status == 200 and answer["model"] == "tiny-untemplated", answer
        summary = startup_summary(app, "::1", 8123)
        assert "chat template  none" in summary and "--chat-template" in summary
        assert summary.rstrip().endswith("address        http://[::1]:8123")
        assert "quantization   none" in summary and f"max_model_len  {MAX_LEN}" in summary


def test_chat_template_option_and_end_of_turn(model_dir, llm):
    """--chat-template is the default of /v1/chat/completions, a request's own
    template wins, and a reply stops at the end-of-turn token of the template
    it was rendered with (chat_stop, as LLM.chat)."""
    from fastllm.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    im_end = tok.token_to_id("<|im_end|>")
    model_template = tok.chat_template
    messages = [{"role": "user", "content": "hi"}]

    def rendered(template: str) -> list[int]:
        text = tok.apply_chat_template(messages, chat_template=template)
        return tok.encode(text, add_special_tokens=False)

    with _app_server(model_dir, chat_template=PLAIN_TEMPLATE) as (app, addr):
        seen = _record_params(app)
        status, body = _post(*addr, "/tokenize", json.dumps({"messages": messages}))
        assert status == 200 and body["tokens"] == rendered(PLAIN_TEMPLATE)
        chat = {"messages": messages, "max_tokens": 3}
        status, body = _post(*addr, "/v1/chat/completions", json.dumps(chat))
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == len(rendered(PLAIN_TEMPLATE))
        assert im_end not in seen[-1].stop_token_ids  # this template ends turns in plain text
        with_own = {**chat, "chat_template": model_template}
        status, body = _post(*addr, "/v1/chat/completions", json.dumps(with_own))
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == len(rendered(model_template))
        assert im_end in seen[-1].stop_token_ids
        status, body = _post(
            *addr, "/v1/chat/completions", json.dumps({**with_own, "ignore_eos": True})
        )
        assert status == 200 and im_end not in seen[-1].stop_token_ids
        conn = http.client.HTTPConnection(*addr, timeout=30)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps({**with_own, "stream": True}))
            resp = conn.getresponse()
            assert resp.status == 200 and resp.read().endswith(b"data: [DONE]\n\n")
        finally:
            conn.close()
        assert im_end in seen[-1].stop_token_ids


def test_bad_chat_template_fails_at_startup(model_dir):
    with pytest.raises(ValueError, match="--chat-template cannot render"):
        with _app_server(model_dir, chat_template="{% for m in messages %}"):
            pass


def test_logit_bias_and_vllm_token_fields_match_offline(client, llm, server):
    tok = llm.get_tokenizer()
    forced = tok.encode(" return", add_special_tokens=False)[0]
    kw = dict(temperature=0.0, max_tokens=5, extra_body={"ignore_eos": True})
    r = client.completions.create(
        model=NAME, prompt=PROMPTS[0], logit_bias={str(forced): 100}, **kw
    )
    ref = _offline(
        llm, PROMPTS[0], temperature=0.0, max_tokens=5, ignore_eos=True,
        logit_bias={forced: 100.0},
    )  # fmt: skip
    assert r.choices[0].text == ref.outputs[0].text == tok.decode([forced] * 5)
    allowed = [forced, forced + 1]
    r = client.completions.create(
        model=NAME, prompt=PROMPTS[1], temperature=1.0, seed=3, max_tokens=6,
        extra_body={"ignore_eos": True, "allowed_token_ids": allowed},
    )  # fmt: skip
    ref = _offline(
        llm, PROMPTS[1], temperature=1.0, seed=3, max_tokens=6, ignore_eos=True,
        allowed_token_ids=allowed,
    )  # fmt: skip
    assert r.choices[0].text == ref.outputs[0].text
    status, body = _post(
        *server, "/v1/completions",
        json.dumps({"model": NAME, "prompt": "x", "logit_bias": {"-4": 1}}),
    )  # fmt: skip
    assert status == 400 and body["error"]["param"] == "logit_bias", body


def test_quantized_model_is_served_and_shown(model_dir):
    from fastllm.server.app import startup_summary

    with _app_server(model_dir, quantization="int8") as (app, addr):
        status, models = _get(*addr, "/v1/models")
        assert status == 200
        assert [m["quantization"] for m in json.loads(models)["data"]] == ["q8_0"]
        body = {"model": json.loads(models)["data"][0]["id"], "prompt": "x", "max_tokens": 3}
        status, answer = _post(*addr, "/v1/completions", json.dumps(body))
        assert status == 200 and answer["usage"]["completion_tokens"] == 3, answer
        assert "quantization   int8 (q8_0)" in startup_summary(app, "127.0.0.1", 8000)

"""Prefix-aware routing on Ray Serve: the routing functions themselves, then a
local Ray cluster (2 CPUs) serving a tiny model on 1 and on 2 replicas of
one thread each, measured against each other."""

from __future__ import annotations

import json
import random
import re
import socket
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ray = pytest.importorskip("ray", reason='needs the ray extra: pip install "fastllm[ray]"')

from fastllm.ray.routing import (  # noqa: E402
    choose,
    prefix_key,
    rendezvous_order,
    routing_token_ids,
)
from ray_helpers import ENGINE, start_local_cluster  # noqa: E402

BS = 16  # the engine's default KV block size

# ---- the routing functions ------------------------------------------------------------


def test_prefix_key_hashes_the_first_full_blocks():
    rng = random.Random(1)
    system = [rng.randrange(100, 200) for _ in range(4 * BS)]
    a = prefix_key(system + [1, 2, 3], BS, 4)
    b = prefix_key(system + [rng.randrange(100, 200) for _ in range(40)], BS, 4)
    assert a is not None and a == b  # only the first 4 blocks count
    other = list(system)
    other[3 * BS + 5] += 1  # a token of the 4th block differs
    assert prefix_key(other + [1, 2, 3], BS, 4) != a
    # the prompt's last token is always computed: 64 tokens give 3 cacheable blocks
    assert prefix_key(system, BS, 4) == prefix_key(system[: 3 * BS + 1], BS, 4) != a
    assert prefix_key(system[:BS], BS, 4) is None  # no full block before the last token
    assert prefix_key(system[: BS + 1], BS, 4) is not None
    assert prefix_key(system + [1], BS, 2) == prefix_key(system[: 2 * BS + 1], BS, 2)
    assert prefix_key(system + [1], 32, 4) == prefix_key(system + [9], 16, 4)  # the same tokens


@settings(max_examples=200, deadline=None)
@given(
    key=st.text(min_size=1, max_size=20),
    replicas=st.sets(st.text(alphabet="abcdef0123", min_size=1, max_size=8), min_size=2),
    data=st.data(),
)
def test_rendezvous_order_is_stable_when_a_replica_leaves(key, replicas, data):
    replicas = sorted(replicas)
    order = rendezvous_order(key, replicas)
    assert sorted(order) == replicas
    assert rendezvous_order(key, list(reversed(replicas))) == order  # no dependence on order
    gone = data.draw(st.sampled_from(replicas))
    rest = [r for r in replicas if r != gone]
    assert rendezvous_order(key, rest) == [r for r in order if r != gone]


def test_rendezvous_moves_only_the_keys_of_a_removed_replica_and_spreads_keys():
    replicas = ["r1", "r2", "r3"]
    keys = [prefix_key(list(range(i, i + 33)), BS, 4) for i in range(3000)]
    home = {k: rendezvous_order(k, replicas)[0] for k in keys}
    counts = {r: sum(1 for h in home.values() if h == r) for r in replicas}
    assert all(800 <= c <= 1200 for c in counts.values()), counts  # about 1000 each
    after = {k: rendezvous_order(k, ["r1", "r3"])[0] for k in keys}
    assert all(after[k] == home[k] for k in keys if home[k] != "r2")
    moved = [after[k] for k in keys if home[k] == "r2"]
    assert 0.35 < moved.count("r1") / len(moved) < 0.65  # r2's keys split over the rest


@settings(max_examples=300, deadline=None)
@given(
    loads=st.dictionaries(
        st.sampled_from(["a", "b", "c", "d"]), st.integers(0, 20), min_size=1, max_size=4
    ),
    key=st.one_of(st.none(), st.text(min_size=1, max_size=8)),
    margin=st.integers(0, 6),
)
def test_choose_prefers_the_home_unless_it_is_busy(loads, key, margin):
    order, why = choose(key, loads, margin)
    assert sorted(order) == sorted(loads)
    least = min(loads.values())
    if key is None:
        assert why == "unkeyed" and loads[order[0]] == least
        return
    home = rendezvous_order(key, list(loads))[0]
    if loads[home] <= least + margin:
        assert why == "home" and order == rendezvous_order(key, list(loads))
    else:  # busy: the least-loaded first, ties in the key's own order
        assert why == "busy" and loads[order[0]] == least
        tied = [r for r in rendezvous_order(key, list(loads)) if loads[r] == least]
        assert order[0] == tied[0]
        assert [loads[r] for r in order] == sorted(loads[r] for r in order)


def test_choose_fallback_example():
    key = "k"
    home, second = rendezvous_order(key, ["x", "y"])
    assert choose(key, {home: 4, second: 0}, 4)[0] == [home, second]
    assert choose(key, {home: 5, second: 0}, 4) == ([second, home], "busy")
    assert choose(key, {home: 9, second: 5}, 4)[0] == [home, second]
    assert choose(None, {"x": 3, "y": 1}, 4) == (["y", "x"], "unkeyed")
    assert choose(key, {}, 4) == ([], "unkeyed")


def test_merge_prometheus_keeps_each_family_once():
    from fastllm.ray.serve import merge_prometheus

    page = (
        "# HELP m_total Things.\n# TYPE m_total counter\n"
        'm_total{{replica="{r}"}} {v}\n'
        "# HELP h Hist.\n# TYPE h histogram\n"
        'h_bucket{{replica="{r}",le="1"}} 1\nh_sum{{replica="{r}"}} 0.5\n'
    )
    merged = merge_prometheus([page.format(r="a", v=1), page.format(r="b", v=2)])
    lines = merged.splitlines()
    assert lines.count("# TYPE m_total counter") == 1 and lines.count("# TYPE h histogram") == 1
    assert lines[:4] == [
        "# HELP m_total Things.",
        "# TYPE m_total counter",
        'm_total{replica="a"} 1',
        'm_total{replica="b"} 2',
    ]
    assert lines[-1] == 'h_sum{replica="b"} 0.5'


@pytest.fixture(scope="module")
def model_dir(make_model) -> str:
    return make_model("llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    from fastllm import LLM

    return LLM(model_dir, **ENGINE)


def test_routing_tokens_equal_the_engines_prompt_tokens(reference):
    """The router tokenizes as the server does: the prompt ids it hashes are
    the ones the engine runs (completion text, token ids, chat)."""
    from fastllm import SamplingParams

    tok = reference.llm_engine.tokenizer
    sp = SamplingParams(max_tokens=1)
    text = "the of and to in is that for it as with was on be by this are or"
    body = json.dumps({"model": "m", "prompt": text}).encode()
    want = reference.generate(text, sp, use_tqdm=False)[0].prompt_token_ids
    assert routing_token_ids("/v1/completions", body, tok, None) == list(want)
    body = json.dumps({"prompt": [[5, 6, 7], [8]]}).encode()
    assert routing_token_ids("/v1/completions", body, tok, None) == [5, 6, 7]
    conv = [{"role": "system", "content": text}, {"role": "user", "content": "to in is"}]
    body = json.dumps({"model": "m", "messages": conv}).encode()
    want = reference.chat(conv, sp, use_tqdm=False)[0].prompt_token_ids
    assert routing_token_ids("/v1/chat/completions", body, tok, None) == list(want)
    for bad in (b"{", b"[1]", b'{"prompt": 3}', json.dumps({"messages": "x"}).encode()):
        assert routing_token_ids("/v1/completions", bad, tok, None) is None
    assert routing_token_ids("/tokenize", body, tok, None) is None


TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}


@pytest.mark.parametrize("tool_choice", [None, "auto", "required", "none"])
def test_routing_tokens_of_a_tool_calling_chat_include_its_tools(reference, tool_choice):
    """A chat that offers tools is routed by the prompt the replica runs: the
    template renders the tools (unless tool_choice is 'none'), as the server
    does; the reference renders the template with jinja2 directly."""
    import jinja2

    tok = reference.llm_engine.tokenizer
    conv = [{"role": "user", "content": "the weather in Oslo"}]
    req = {"model": "m", "messages": conv, "tools": [WEATHER], "chat_template": TOOLS_TEMPLATE}
    if tool_choice is not None:
        req["tool_choice"] = tool_choice
    body = json.dumps(req).encode()
    tools = None if tool_choice == "none" else [WEATHER]
    text = jinja2.Template(TOOLS_TEMPLATE).render(
        messages=conv, tools=tools, add_generation_prompt=True
    )
    assert ("get_weather" in text) == (tool_choice != "none")
    want = tok.encode(text, add_special_tokens=False)
    assert routing_token_ids("/v1/chat/completions", body, tok, None) == want


# ---- on a local Ray cluster ----------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    start_local_cluster()
    yield
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _deploy(model_dir: str, replicas: int, port: int) -> str:
    import fastllm.ray
    from fastllm.config import EngineConfig

    app = fastllm.ray.build_app(
        EngineConfig(model=model_dir, **ENGINE),
        num_replicas=replicas,
        num_cpus_per_replica=1,
        served_model_name="tiny",
    )
    fastllm.ray.run(app, port=port, blocking=False)
    return f"http://127.0.0.1:{port}"


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


_SAMPLE = re.compile(r'^(\w+)\{[^}]*replica="([^"]+)"[^}]*\} (\S+)$')


def _per_replica(base: str) -> dict[str, dict[str, float]]:
    """replica id -> {metric: value} of the counters that matter here, from
    the deployment's /metrics (finished requests summed over reasons)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=60) as r:
        text = r.read().decode()
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, replica, value = m.groups()
        if name in (
            "fastllm_prefix_cache_hits_total",
            "fastllm_prefix_cache_queries_total",
            "fastllm_request_finished_total",
        ):
            d = out.setdefault(replica, {})
            d[name] = d.get(name, 0.0) + float(value)
    return out


def _delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    return {
        r: {k: v - before.get(r, {}).get(k, 0.0) for k, v in m.items()} for r, m in after.items()
    }


def _hit_rate(delta: dict[str, dict[str, float]]) -> float:
    hits = sum(m.get("fastllm_prefix_cache_hits_total", 0.0) for m in delta.values())
    queries = sum(m.get("fastllm_prefix_cache_queries_total", 0.0) for m in delta.values())
    return hits / queries if queries else 0.0


def _load(base: str, prompts: list[list[int]], concurrency: int) -> dict[str, dict[str, float]]:
    """Sends every prompt (token ids) as a completion request, ``concurrency``
    at a time; returns the per-replica counters it added."""
    before = _per_replica(base)

    def one(ids: list[int]) -> None:
        got = _post(
            f"{base}/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 4, "seed": 1}
        )
        assert got["usage"]["prompt_tokens"] == len(ids)

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, prompts))
    return _delta(before, _per_replica(base))


def _shared_prefix_prompts(seed: int, n: int) -> list[list[int]]:
    """``n`` prompts: one 4-block system prompt, then a distinct user turn."""
    rng = random.Random(seed)
    system = [rng.randrange(50, 500) for _ in range(4 * BS)]
    return [system + [rng.randrange(50, 500) for _ in range(8 + i % 5)] for i in range(n)]


@pytest.fixture(scope="module")
def port(cluster) -> int:
    """The port of Serve's HTTP proxy (it keeps the first one it listens on)."""
    return _port()


@pytest.fixture(scope="module")
def pair(cluster, model_dir, port) -> str:
    """The 2-replica deployment (prefix routing on); yields its base URL."""
    from ray import serve

    yield _deploy(model_dir, 2, port)
    serve.delete("fastllm")


def test_shared_prefix_hit_rate_on_2_replicas_matches_1_and_uniform_load_splits(
    cluster, model_dir, port, request
):
    """64 requests sharing a 4-block system prompt: the deployment's
    prefix-cache hit rate with 2 replicas is within 0.10 of one replica's on
    the same load (measured here, first); 64 requests of distinct prefixes
    split between the 2 replicas within 70/30; and requests of one prefix,
    sent one after another, all land on the same replica."""
    from ray import serve

    base = _deploy(model_dir, 1, port)
    solo = _load(base, _shared_prefix_prompts(1, 64), concurrency=8)
    assert len(solo) == 1
    solo_rate = _hit_rate(solo)
    serve.delete("fastllm")

    base = request.getfixturevalue("pair")  # deployed now, after the solo one left
    two = _load(base, _shared_prefix_prompts(2, 64), concurrency=8)
    pair_rate = _hit_rate(two)
    print(f"prefix-cache hit rate: 1 replica {solo_rate:.3f}, 2 replicas {pair_rate:.3f}")
    assert solo_rate > 0.5, solo  # the shared blocks do hit
    assert pair_rate >= solo_rate - 0.10, (solo_rate, pair_rate, two)

    rng = random.Random(3)
    distinct = [[rng.randrange(50, 500) for _ in range(4 * BS + 3)] for _ in range(64)]
    split = _load(base, distinct, concurrency=8)
    counts = [m.get("fastllm_request_finished_total", 0.0) for m in split.values()]
    print(f"distinct prefixes, requests per replica: {counts}")
    assert len(counts) == 2 and sum(counts) == 64
    assert min(counts) >= 0.3 * 64, counts

    # one prefix, light load: every request on the prefix's home replica
    same = _load(base, _shared_prefix_prompts(4, 8), concurrency=1)
    counts = sorted(m.get("fastllm_request_finished_total", 0.0) for m in same.values())
    assert counts[-1] == 8, same


def _aborted(base: str) -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=60) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("fastllm_request_finished_total{") and 'finished_reason="abort"' in line
    )


def test_client_leaving_a_stream_aborts_it_on_the_replica(pair):
    """The router relays a client's disconnect: the replica aborts the
    request instead of generating for nobody."""
    import http.client
    import time

    before = _aborted(pair)
    host, where = pair.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(where), timeout=60)
    body = {"model": "tiny", "prompt": "the of and", "max_tokens": 200, "stream": True}
    body.update(ignore_eos=True)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.fp.readline()  # the stream has started
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + 30
    while _aborted(pair) <= before:
        assert time.monotonic() < deadline, "the replica did not abort the abandoned request"
        time.sleep(0.2)

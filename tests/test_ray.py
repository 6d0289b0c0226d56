"""fastllm on Ray: the offline path (Ray Data) and the serving path (Ray Serve),
on a small local Ray cluster (2 CPUs) with replicas of a tiny model, one
thread each."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray", reason='needs the ray extra: pip install "fastllm[ray]"')

from ray_helpers import ENGINE, PYTHON_DIR, start_local_cluster  # noqa: E402

WORDS = "the of and to in is that for it as with was on be by this are or from at".split()


@pytest.fixture(scope="module")
def cluster():
    start_local_cluster()
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(make_model) -> str:
    return make_model("llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    from fastllm import LLM

    return LLM(model_dir, **ENGINE)


def _prompt(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(3 + i % 9))


def _rows(n: int) -> list[dict]:
    return [
        {
            "id": i,
            "prompt": _prompt(i),
            "seed": 1000 + i,
            "max_tokens": 4 + i % 13,
            "temperature": 0.7 + (i % 3) * 0.2,
        }
        for i in range(n)
    ]


def _expected(llm, rows: list[dict]) -> dict[int, list[int]]:
    """Row id -> the token ids one process's ``LLM.generate`` gives it."""
    return {k: ids for k, (ids, _) in _expected_outputs(llm, rows).items()}


def _expected_outputs(llm, rows: list[dict]) -> dict[int, tuple[list[int], str]]:
    from fastllm import SamplingParams

    params = [
        SamplingParams(seed=r["seed"], max_tokens=r["max_tokens"], temperature=r["temperature"])
        for r in rows
    ]
    outs = llm.generate([r["prompt"] for r in rows], params, use_tqdm=False)
    return {r["id"]: (list(o.outputs[0].token_ids), o.outputs[0].text) for r, o in zip(rows, outs)}


# ---- importing ---------------------------------------------------------------


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": PYTHON_DIR}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_import_fastllm_does_not_import_ray():
    r = _python(
        "import sys, fastllm, fastllm.llm, fastllm.server.app, fastllm.cli\n"
        "assert 'ray' not in sys.modules, sorted(m for m in sys.modules if 'ray' in m)\n"
    )
    assert r.returncode == 0, r.stderr


def test_missing_ray_says_how_to_install():
    r = _python(
        "import sys\nsys.modules['ray'] = None\n"
        "try:\n    import fastllm.ray\nexcept ImportError as e:\n    print(e)\n"
        "else:\n    raise SystemExit('no ImportError')\n"
    )
    assert r.returncode == 0, r.stderr
    assert 'pip install "fastllm[ray]"' in r.stdout


def test_cli_serve_replicas_starts_a_local_ray(tmp_path, model_dir, reference):
    """``fastllm serve MODEL --replicas 2``: one command, Ray started locally
    (a cluster of its own, before this module's cluster exists)."""
    import openai

    from fastllm import SamplingParams
    from server_process import free_port, running_server

    if ray.is_initialized():
        pytest.skip("this module's Ray cluster is already running")
    port = free_port()
    cmd = [sys.executable, "-m", "fastllm.cli", "serve", model_dir, "--replicas", "2"]
    cmd += ["--port", str(port), "--kv-cache-memory-bytes", str(ENGINE["kv_cache_memory_bytes"])]
    cmd += ["--max-model-len", str(ENGINE["max_model_len"]), "--served-model-name", "tiny"]
    env = {**os.environ, "PYTHONPATH": PYTHON_DIR}
    env.pop("FASTLLM_API_KEY", None)
    with running_server(cmd, port, tmp_path / "serve.log", env):
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        got = c.completions.create(model="tiny", prompt=_prompt(3), max_tokens=8, seed=4)
        want = reference.generate(_prompt(3), SamplingParams(seed=4, max_tokens=8), use_tqdm=False)
        assert got.choices[0].text == want[0].outputs[0].text


def _doc_blocks() -> list[str]:
    """The Python blocks of docs/ray.md."""
    import re

    path = os.path.join(os.path.dirname(PYTHON_DIR), "docs", "ray.md")
    with open(path, encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_docs_offline_example_runs(tmp_path, model_dir):
    """docs/ray.md's laptop example, run as written (with the test model and
    an output folder of this test), in a process of its own."""
    import pyarrow.parquet as pq

    if ray.is_initialized():
        pytest.skip("this module's Ray cluster is already running")
    code = _doc_blocks()[0]
    assert "fastllm.ray.generate(" in code
    code = code.replace('"path/to/model"', repr(model_dir))
    code = code.replace('"/tmp/stories"', repr(str(tmp_path / "stories")))
    r = _python(code)
    assert r.returncode == 0, r.stderr[-4000:]
    table = pq.read_table(tmp_path / "stories")
    assert sorted(table.column("id").to_pylist()) == list(range(200))
    assert set(table.column("num_generated_tokens").to_pylist()) <= set(range(65))
    import pyarrow as pa

    token_type = table.schema.field("generated_token_ids").type
    assert pa.types.is_list(token_type) and token_type.value_type == pa.int64()


# ---- the predictor in this process ---------------------------------------------


def test_predictor_formats_columns_and_bad_rows(model_dir, reference):
    import pandas as pd
    import pyarrow as pa

    from fastllm import SamplingParams
    from fastllm.ray import OUTPUT_COLUMNS, LLMPredictor

    pred = LLMPredictor(model_dir, sampling_params={"max_tokens": 5}, num_threads=1, **ENGINE)
    rows = _rows(6)
    want = _expected(reference, rows)
    texts = {k: text for k, (_, text) in _expected_outputs(reference, rows).items()}
    for batch in (pa.Table.from_pylist(rows), pd.DataFrame(rows)):
        out = pred(batch)
        got = out.to_pylist() if isinstance(out, pa.Table) else out.to_dict("records")
        for r, g in zip(rows, got):
            assert {k: g[k] for k in r} == r  # the input columns are kept
            assert list(g["generated_token_ids"]) == want[r["id"]]
            assert g["num_generated_tokens"] == len(want[r["id"]])
            assert g["finish_reason"] in ("length", "stop") and g["error"] is None
            assert g["generated_text"] == texts[r["id"]]
    import numpy as np

    out = pred({k: np.array([r[k] for r in rows]) for k in rows[0]})
    assert set(OUTPUT_COLUMNS) <= set(out)
    assert [list(x) for x in out["generated_token_ids"]] == [want[r["id"]] for r in rows]

    # chat rows, token-id rows, a default from sampling_params, and bad rows
    conv = [{"role": "user", "content": "the of and"}]
    ids = reference.get_tokenizer().encode("to in is")
    table = pa.Table.from_pylist(
        [
            {"messages": conv, "prompt": None, "prompt_token_ids": None, "seed": 1},
            {"messages": None, "prompt": None, "prompt_token_ids": ids, "seed": 2},
            {"messages": None, "prompt": "x " * 400, "prompt_token_ids": None, "seed": 3},
            {"messages": None, "prompt": None, "prompt_token_ids": None, "seed": 4},
        ]
    )
    got = pred(table).to_pylist()
    chat = reference.chat(conv, SamplingParams(seed=1, max_tokens=5), use_tqdm=False)[0]
    assert got[0]["generated_token_ids"] == list(chat.outputs[0].token_ids)
    solo = reference.generate(
        {"prompt_token_ids": ids}, SamplingParams(seed=2, max_tokens=5), use_tqdm=False
    )[0]
    assert got[1]["generated_token_ids"] == list(solo.outputs[0].token_ids)
    assert got[1]["num_prompt_tokens"] == len(ids)
    assert got[2]["finish_reason"] == "error" and "row 2" in got[2]["error"]
    assert got[3]["finish_reason"] == "error" and "no prompt" in got[3]["error"]

    with pytest.raises(ValueError, match="temperature"):
        LLMPredictor(model_dir, sampling_params={"temperature": -1.0}, **ENGINE)


# ---- Ray Data ------------------------------------------------------------------


def test_generate_200_rows_on_2_replicas_equals_one_process(cluster, model_dir, reference):
    import fastllm.ray

    rows = _rows(200)
    want = _expected(reference, rows)
    ds = ray.data.from_items(rows, override_num_blocks=20)
    out = fastllm.ray.generate(
        ds, model=model_dir, num_replicas=2, num_cpus_per_replica=1, batch_size=8, **ENGINE
    ).take_all()
    ids = [r["id"] for r in out]
    assert sorted(ids) == list(range(200))  # every row exactly once
    for r in out:
        assert list(r["generated_token_ids"]) == want[r["id"]], r["id"]
        assert r["num_generated_tokens"] == len(want[r["id"]])
        assert r["prompt"] == _prompt(r["id"]) and r["error"] is None


def _replica_pids() -> list[int]:
    """The processes of the live LLMPredictor actors (Ray titles an actor's
    process ``ray::<class name>``), found without the dashboard."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if cmd.startswith("ray::") and "LLMPredictor" in cmd.split("\0")[0]:
            pids.append(int(entry))
    return pids


def test_killed_replica_is_replaced_and_its_batch_retried(cluster, model_dir, reference):
    import fastllm.ray

    rows = [dict(r, max_tokens=24) for r in _rows(120)]
    want = _expected(reference, rows)
    ds = ray.data.from_items(rows, override_num_blocks=30)
    out = fastllm.ray.generate(
        ds, model=model_dir, num_replicas=2, num_cpus_per_replica=1, batch_size=4, **ENGINE
    )
    killed: list[int] = []

    def kill_one() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pids = _replica_pids()
            if len(pids) == 2:
                os.kill(pids[0], signal.SIGKILL)  # the actor's process dies mid-batch
                killed.append(len(seen))
                return
            time.sleep(0.2)

    seen: list[dict] = []
    killer = None
    for r in out.iter_rows():
        seen.append(r)
        if killer is None:
            killer = threading.Thread(target=kill_one)
            killer.start()
    killer.join()
    assert killed, "no replica actor was found to kill"
    assert killed[0] < 100, f"the kill came after {killed[0]} of 120 rows: too late to test"
    assert sorted(r["id"] for r in seen) == list(range(120))
    for r in seen:
        assert list(r["generated_token_ids"]) == want[r["id"]], r["id"]


# ---- Ray Serve -----------------------------------------------------------------

API_KEY = "ray-secret"


@pytest.fixture(scope="module")
def served(cluster, model_dir):
    """The Serve deployment of the test model, 2 replicas; yields its base URL."""
    import socket

    from ray import serve

    import fastllm.ray
    from fastllm.config import EngineConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = fastllm.ray.build_app(
        EngineConfig(model=model_dir, **ENGINE),
        num_replicas=2,
        num_cpus_per_replica=1,
        api_key=API_KEY,
        served_model_name="tiny",
    )
    fastllm.ray.run(app, port=port, blocking=False)
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="module")
def client(served):
    import openai

    return openai.OpenAI(base_url=f"{served}/v1", api_key=API_KEY, max_retries=0)


def _get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {})) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_serve_health_models_and_api_key(served):
    import json

    assert _get(f"{served}/health") == (200, b'{"status":"ok"}')
    assert _get(f"{served}/v1/models")[0] == 401
    status, body = _get(f"{served}/v1/models", {"Authorization": f"Bearer {API_KEY}"})
    assert status == 200
    (model,) = json.loads(body)["data"]
    assert model["id"] == "tiny" and model["max_model_len"] == ENGINE["max_model_len"]
    status, body = _get(f"{served}/metrics")
    assert status == 200 and b"fastllm_prefix_cache_hit_rate" in body


def test_serve_completions_chat_streaming_n2_equal_llm(client, reference):
    from fastllm import SamplingParams

    prompt = _prompt(5)
    want = reference.generate(prompt, SamplingParams(n=2, seed=7, max_tokens=12), use_tqdm=False)[
        0
    ].outputs
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, seed=7, n=2)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [c.text for c in want]
    assert got.usage.completion_tokens == sum(len(c.token_ids) for c in want)

    stream = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, seed=7, stream=True
    )
    one = reference.generate(prompt, SamplingParams(seed=7, max_tokens=12), use_tqdm=False)[0]
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == one.outputs[0].text

    conv = [{"role": "user", "content": _prompt(9)}]
    chat = reference.chat(conv, SamplingParams(seed=3, max_tokens=10), use_tqdm=False)[0]
    got = client.chat.completions.create(model="tiny", messages=conv, max_tokens=10, seed=3)
    assert got.choices[0].message.content == chat.outputs[0].text
    stream = client.chat.completions.create(
        model="tiny", messages=conv, max_tokens=10, seed=3, stream=True
    )
    text = "".join((ch.choices[0].delta.content or "") for ch in stream if ch.choices)
    assert text == chat.outputs[0].text


def test_serve_32_concurrent_seeded_streams_equal_solo(client, reference):
    from concurrent.futures import ThreadPoolExecutor

    from fastllm import SamplingParams

    prompts = [_prompt(i) for i in range(32)]
    want = [
        o.outputs[0].text
        for o in reference.generate(
            prompts,
            [SamplingParams(seed=50 + i, max_tokens=10) for i in range(32)],
            use_tqdm=False,
        )
    ]

    def one(i: int) -> str:
        stream = client.completions.create(
            model="tiny", prompt=prompts[i], max_tokens=10, seed=50 + i, stream=True
        )
        return "".join(ch.choices[0].text for ch in stream if ch.choices)

    with ThreadPoolExecutor(32) as pool:
        assert list(pool.map(one, range(32))) == want


def _serve_replica_pids() -> list[int]:
    """The processes of the fastllm deployment's Serve replicas (the engines,
    not the router deployment in front of them)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read().decode(errors="replace").split("\0")[0]
        except OSError:
            continue
        engine = "ray::ServeReplica:fastllm:fastllm"
        if title.startswith(engine) and not title.startswith(f"{engine}-router"):
            pids.append(int(entry))
    return pids


def _running_replicas() -> int:
    from ray import serve

    app = serve.status().applications["fastllm"]
    return app.deployments["fastllm"].replica_states.get("RUNNING", 0)


def test_serve_killed_replica_is_replaced_while_the_other_answers(client, reference):
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from fastllm import SamplingParams

    pids = _serve_replica_pids()
    assert len(pids) == 2 and _running_replicas() == 2
    prompts = [_prompt(i) for i in range(24)]
    want = [
        o.outputs[0].text
        for o in reference.generate(
            prompts,
            [SamplingParams(seed=90 + i, max_tokens=24) for i in range(24)],
            use_tqdm=False,
        )
    ]

    def one(i: int) -> str | None:
        try:
            stream = client.completions.create(
                model="tiny", prompt=prompts[i], max_tokens=24, seed=90 + i, stream=True
            )
            return "".join(ch.choices[0].text for ch in stream if ch.choices)
        except (openai.APIError, openai.APIConnectionError):
            return None  # a clean error: retried below

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(24)]
        time.sleep(0.3)
        os.kill(pids[0], signal.SIGKILL)
        got = [f.result() for f in futures]
    errors = [i for i, g in enumerate(got) if g is None]
    for i, g in enumerate(got):
        assert g is None or g == want[i], i
    deadline = time.monotonic() + 120
    for i in errors:  # a retry completes (on the surviving replica, or the new one)
        while True:
            g = one(i)
            if g is not None or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert g == want[i], i
    while _running_replicas() < 2 or len(_serve_replica_pids()) < 2:
        assert time.monotonic() < deadline, "the deployment did not get back to 2 replicas"
        time.sleep(0.5)
    assert set(_serve_replica_pids()) != set(pids)  # the dead one was replaced
    assert [one(i) for i in range(4)] == want[:4]

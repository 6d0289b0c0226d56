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

PYTHON_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")
# Small KV caches: several engines share this machine's memory.
ENGINE = {"kv_cache_memory_bytes": 16 << 20, "max_model_len": 256}
WORDS = "the of and to in is that for it as with was on be by this are or from at".split()


@pytest.fixture(scope="module")
def cluster():
    os.environ["FASTLLM_NUM_THREADS"] = "1"
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": PYTHON_DIR, "FASTLLM_NUM_THREADS": "1"}},
    )
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

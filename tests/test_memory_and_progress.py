"""The KV cache is sized from the machine and the job, and generate()'s progress
bar moves every step."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fastllm.engine import cache_size
from fastllm.engine.cache_size import plan_kv_cache

MiB = 1 << 20


def _plan(**kw):
    args = dict(
        device="cpu",
        block_bytes=MiB,
        block_size=16,
        max_model_len=1024,
        max_model_len_is_explicit=False,
        max_num_seqs=8,
        kv_cache_memory_bytes=None,
        gpu_memory_utilization=0.9,
    )
    args.update(kw)
    return plan_kv_cache(**args)


def test_the_job_bounds_the_cache(monkeypatch):
    monkeypatch.setattr(cache_size, "available_cpu_memory", lambda: 1 << 40)
    plan = _plan()
    assert plan.num_blocks == 8 * 64 + 1  # max_num_seqs sequences of max_model_len
    assert plan.max_model_len == 1024


def test_available_memory_bounds_the_cache(monkeypatch):
    monkeypatch.setattr(cache_size, "available_cpu_memory", lambda: 200 * MiB)
    plan = _plan(gpu_memory_utilization=0.5)
    assert plan.num_blocks == 100  # half of 200 MiB, 1 MiB a block
    assert "gpu_memory_utilization=0.5" in plan.describe()
    assert "100 blocks of 16 tokens" in plan.describe()


def test_a_default_context_too_long_for_memory_is_lowered(monkeypatch, caplog):
    """A 7B model on a small laptop: the model's context is lowered, not an OOM."""
    monkeypatch.setattr(cache_size, "available_cpu_memory", lambda: 40 * MiB)
    with caplog.at_level("WARNING", logger="fastllm"):
        plan = _plan(max_model_len=32768)
    assert plan.max_model_len == plan.num_blocks * 16 == 36 * 16
    assert "max_model_len is lowered to 576" in caplog.text


def test_an_explicit_context_that_cannot_fit_is_an_error(monkeypatch):
    monkeypatch.setattr(cache_size, "available_cpu_memory", lambda: 40 * MiB)
    with pytest.raises(ValueError, match=r"cannot hold one sequence of max_model_len=32768"):
        _plan(max_model_len=32768, max_model_len_is_explicit=True)
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=1048576: 1 blocks"):
        _plan(kv_cache_memory_bytes=MiB)
    monkeypatch.setattr(cache_size, "available_cpu_memory", lambda: 4 * MiB)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        _plan()  # not even MIN_CACHE_TOKENS fit: no silent tiny context


def test_explicit_bytes_are_exact(monkeypatch):
    monkeypatch.setattr(cache_size, "available_cpu_memory", lambda: 1 << 40)
    assert _plan(kv_cache_memory_bytes=100 * MiB).num_blocks == 100


def test_unused_cache_blocks_are_never_resident():
    """LLM() on the demo model plus a small job: resident memory grows by far
    less than the cache it planned (its pages are committed only when used)."""
    code = (
        "import json, resource, torch\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "from fastllm import LLM, SamplingParams\n"
        "llm = LLM(device='cpu')\n"
        "llm.generate(['def f(x):', 'import os'], SamplingParams(max_tokens=16), use_tqdm=False)\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(json.dumps([before * 1024, after * 1024, llm.llm_engine.cache.num_bytes]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    before, after, cache_bytes = json.loads(out.stdout.strip().splitlines()[-1])
    assert cache_bytes >= 256 * MiB, cache_bytes  # the plan is large ...
    assert after - before < 160 * MiB, (after - before) / MiB  # ... the process is not


def test_progress_bar_shows_token_rates_before_any_request_finishes(capsys):
    from fastllm import LLM, SamplingParams

    llm = LLM(device="cpu", max_num_batched_tokens=256, max_num_seqs=2)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    llm.generate(["def f(x):", "x" * 40], params, use_tqdm=True)
    err = capsys.readouterr().err
    frames = [f for f in err.replace("\r", "\n").splitlines() if "Processed prompts" in f]
    moving = [f for f in frames if " 0/2" in f and "output:" in f]
    assert len(moving) >= 5, frames[:5]  # updated every step while nothing has finished
    assert "est. speed input:" in moving[0]
    assert " 2/2" in frames[-1]


@pytest.mark.parametrize("configure", ["1", "0"])
def test_the_chosen_cache_is_logged_without_any_logging_setup(configure):
    env = {**__import__("os").environ, "FASTLLM_CONFIGURE_LOGGING": configure}
    out = subprocess.run(
        [sys.executable, "-c", "from fastllm import LLM; LLM(device='cpu')"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=env,
    )
    logged = "KV cache (" in out.stderr and "blocks of 16 tokens" in out.stderr
    assert logged == (configure == "1"), out.stderr
    if logged:
        assert "longest sequence 1024 tokens" in out.stderr

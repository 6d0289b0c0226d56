"""Ctrl-C always works: SIGINT at random moments of a generation (generate,
stream, chat, n > 1, and batches of hundreds of text prompts, whose
tokenizing and adding is a wide window) ends in KeyboardInterrupt (never
another exception replacing it), and the engine is usable afterwards: idle,
the reference tokens, every KV block back in the pool."""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time

import pytest

from server_process import default_sigint

pytest.importorskip("torch")

TRIALS = 200

CHILD = r"""
import json, sys, time
from fastllm import LLM, SamplingParams

llm = LLM(sys.argv[1], device="cpu", dtype=sys.argv[2], max_model_len=256)
engine = llm.llm_engine
check = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
prompts = ["def f(x):", "import os", "class A:", "for i in"]
ref = [o.outputs[0].token_ids for o in llm.generate(prompts, check, use_tqdm=False)]
total = engine.kv.num_free_blocks
long = SamplingParams(temperature=0.8, max_tokens=200, ignore_eos=True)
# Hundreds of text prompts with short replies: most of a call is spent
# tokenizing, validating and adding requests, the window an interrupt must
# not leave requests behind in.
many = [f"{prompts[i % 4]} # variant {i} " + "x" * (i % 17) for i in range(400)]
short = SamplingParams(temperature=0.8, max_tokens=2, ignore_eos=True)
chats = [[{"role": "user", "content": p}] for p in many[:150]]
forks = SamplingParams(n=3, temperature=0.8, max_tokens=40, ignore_eos=True)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    mode = line.strip()
    outcome = "none"
    try:
        print(json.dumps({"started": True}), flush=True)
        while True:
            if mode == "stream":
                for _ in llm.stream(prompts[0], long):
                    pass
            elif mode == "many":
                llm.generate(many, short, use_tqdm=False)
            elif mode == "chat":
                llm.chat(chats, short, use_tqdm=False)
            elif mode == "fork":
                llm.generate(prompts * 4, forks, use_tqdm=False)
            else:
                llm.generate(prompts, long, use_tqdm=False)
    except KeyboardInterrupt:
        outcome = "KeyboardInterrupt"
    except BaseException as e:
        outcome = f"{type(e).__name__}: {e}"
    if outcome != "KeyboardInterrupt":
        try:  # the call ended without the interrupt, which is still on its way
            time.sleep(1.0)
        except KeyboardInterrupt:
            pass
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, check, use_tqdm=False)]
    except BaseException as e:
        got = f"{type(e).__name__}: {e}"
    print(json.dumps({
        "outcome": outcome,
        "usable": got == ref or got,
        "idle": not engine.has_unfinished_requests(),
        "blocks_back": engine.kv.num_free_blocks == total,
    }), flush=True)
"""
MODES = ("generate", "stream", "many", "chat", "fork")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sigint_at_random_moments_is_always_keyboard_interrupt(make_model, dtype, tmp_path):
    folder = make_model("llama")
    env = dict(os.environ, FASTLLM_NUM_THREADS="2")
    log = tmp_path / "child.log"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, folder, dtype],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(log, "w"),  # noqa: SIM115 - closed with the process
        text=True,
        env=env,
        preexec_fn=default_sigint,
    )

    def reply(timeout: float = 60.0) -> dict:
        ready, _, _ = select.select([child.stdout], [], [], timeout)
        if not ready:
            child.kill()
            pytest.fail(f"the child stopped answering (a lost SIGINT?):\n{log.read_text()}")
        line = child.stdout.readline()
        if not line:
            pytest.fail(f"the child died:\n{log.read_text()}")
        return json.loads(line)

    rng = random.Random(1234)
    bad = []
    try:
        assert reply(300) == {"ready": True}
        for trial in range(TRIALS):
            mode = MODES[trial % len(MODES)]
            child.stdin.write(mode + "\n")
            child.stdin.flush()
            assert reply() == {"started": True}
            time.sleep(rng.uniform(0.0, 0.06 if mode in ("many", "chat") else 0.03))
            child.send_signal(signal.SIGINT)
            result = reply()
            expected = {"outcome": "KeyboardInterrupt", "usable": True, "idle": True}
            expected["blocks_back"] = True
            if result != expected:
                bad.append((trial, mode, result))
    finally:
        child.stdin.close()
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
    assert not bad, f"{len(bad)} of {TRIALS} trials went wrong, e.g. {bad[:5]}\n{log.read_text()}"


# ---- the narrow windows, hit on purpose --------------------------------------


@pytest.fixture(scope="module")
def small_llm(make_model):
    from fastllm import LLM

    return LLM(make_model("llama"), device="cpu", dtype="float32", max_model_len=256)


def _interrupt_on_call(monkeypatch, obj, name: str, at: int) -> None:
    """``obj.name`` raises KeyboardInterrupt on its ``at``-th call (a SIGINT
    landing exactly there), then behaves as before."""
    real = getattr(obj, name)
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == at:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapped)


def _assert_idle_and_usable(llm) -> None:
    from fastllm import SamplingParams

    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    check = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (out,) = llm.generate(["def f(x):"], check, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("at", [1, 3, 7])
def test_interrupt_while_requests_are_added(small_llm, monkeypatch, at):
    """Ctrl-C between a request entering the output processor and the
    scheduler, with earlier requests of the call already queued."""
    from fastllm import SamplingParams

    sched = small_llm.llm_engine.scheduler
    _interrupt_on_call(monkeypatch, sched, "add", at)
    with pytest.raises(KeyboardInterrupt):
        small_llm.generate(["a = 1"] * 8, SamplingParams(max_tokens=4), use_tqdm=False)
    monkeypatch.undo()
    _assert_idle_and_usable(small_llm)


def test_interrupt_between_a_fork_and_its_request(small_llm, monkeypatch):
    """Ctrl-C after the scheduler forked an ``n > 1`` request's sequences and
    before the output processor recorded them: the forks stop too."""
    from fastllm import SamplingParams

    proc = small_llm.llm_engine.output_processor
    _interrupt_on_call(monkeypatch, proc, "process", 1)
    params = SamplingParams(n=3, temperature=0.8, max_tokens=8, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        small_llm.generate(["x = [", "import os"], params, use_tqdm=False)
    monkeypatch.undo()
    _assert_idle_and_usable(small_llm)


def test_interrupt_while_a_stream_adds_its_request(small_llm, monkeypatch):
    from fastllm import SamplingParams

    _interrupt_on_call(monkeypatch, small_llm.llm_engine.scheduler, "add", 1)
    with pytest.raises(KeyboardInterrupt):
        for _ in small_llm.stream("def g():", SamplingParams(max_tokens=4)):
            pass
    monkeypatch.undo()
    _assert_idle_and_usable(small_llm)


def test_interrupt_inside_a_block_free(small_llm, monkeypatch):
    """Ctrl-C between two blocks of a finishing sequence's free: no block is
    freed twice later (which raised ValueError in place of the interrupt)."""
    from fastllm import SamplingParams

    kv = small_llm.llm_engine.kv
    real = kv.pool

    class Pool:
        frees = 0

        def __getattr__(self, name):
            return getattr(real, name)

        def free(self, block):
            Pool.frees += 1
            if Pool.frees == 2:
                raise KeyboardInterrupt
            return real.free(block)

    monkeypatch.setattr(kv, "pool", Pool())
    prompt = "def f(x):\n    return x + 1\n" * 4  # several blocks
    with pytest.raises(KeyboardInterrupt):
        small_llm.generate([prompt] * 3, SamplingParams(max_tokens=4), use_tqdm=False)
    monkeypatch.undo()
    _assert_idle_and_usable(small_llm)

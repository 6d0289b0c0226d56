"""Ctrl-C always works: SIGINT at random moments of a generation ends in
KeyboardInterrupt (never another exception replacing it), and the engine is
usable afterwards, with every KV block back in the pool."""

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
import json, sys
from fastllm import LLM, SamplingParams

llm = LLM(sys.argv[1], device="cpu", dtype=sys.argv[2], max_model_len=256)
engine = llm.llm_engine
check = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
prompts = ["def f(x):", "import os", "class A:", "for i in"]
ref = [o.outputs[0].token_ids for o in llm.generate(prompts, check, use_tqdm=False)]
total = engine.kv.num_free_blocks
long = SamplingParams(temperature=0.8, max_tokens=200, ignore_eos=True)
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
            else:
                llm.generate(prompts, long, use_tqdm=False)
    except KeyboardInterrupt:
        outcome = "KeyboardInterrupt"
    except BaseException as e:
        outcome = f"{type(e).__name__}: {e}"
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, check, use_tqdm=False)]
    print(json.dumps({
        "outcome": outcome,
        "usable": got == ref,
        "idle": not engine.has_unfinished_requests(),
        "blocks_back": engine.kv.num_free_blocks == total,
    }), flush=True)
"""


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
            mode = "stream" if trial % 3 == 0 else "generate"
            child.stdin.write(mode + "\n")
            child.stdin.flush()
            assert reply() == {"started": True}
            time.sleep(rng.uniform(0.0, 0.03))
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

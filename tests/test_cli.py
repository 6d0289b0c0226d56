"""The ``fastllm`` command: --help everywhere, ``generate`` against the offline
API, and the interactive ``chat`` driven through a pseudo-terminal."""

from __future__ import annotations

import json
import os
import sys

import pytest

from fastllm.cli import main

ENGINE = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "256"]


@pytest.mark.parametrize("command", [[], ["serve"], ["generate"], ["chat"], ["env"]])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fastllm")
    if command in (["serve"], ["generate"], ["chat"]):
        for option in ("--dtype", "--device", "--max-model-len", "--block-size", "--seed"):
            assert option in out
    if command == ["serve"]:
        for option in ("--host", "--port", "--api-key", "--served-model-name"):
            assert option in out


def test_help_imports_no_torch():
    import subprocess

    code = (
        "import sys\nfrom fastllm.cli import main\n"
        "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'help imported torch'\n"
    )
    env = dict(os.environ, PYTHONPATH=_python_path())
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_bad_model_folder(tmp_path, capsys):
    rc = main(["generate", str(tmp_path / "missing"), "--prompt", "hi", *ENGINE])
    assert rc == 2
    assert "missing" in capsys.readouterr().err


@pytest.fixture(scope="module")
def model_dir(make_model) -> str:
    return make_model("llama")


@pytest.fixture(scope="module")
def llm(model_dir):
    pytest.importorskip("torch")
    from fastllm import LLM

    return LLM(model_dir, dtype="float32", device="cpu", max_model_len=256)


def test_generate_prints_text(model_dir, llm, capsys):
    from fastllm import SamplingParams

    prompts = ["def fibonacci(n):", "The quick brown fox"]
    args = ["generate", model_dir, *ENGINE, "--max-tokens", "8", "--temperature", "0.8"]
    args += ["--top-k", "40", "--seed", "5"]
    for p in prompts:
        args += ["--prompt", p]
    assert main(args) == 0
    params = SamplingParams(max_tokens=8, temperature=0.8, top_k=40, seed=5)
    ref = llm.generate(prompts, params, use_tqdm=False)
    out = capsys.readouterr().out
    assert out == "".join(o.outputs[0].text + "\n" for o in ref)


def test_generate_json(model_dir, llm, capsys):
    from fastllm import SamplingParams

    args = ["generate", model_dir, *ENGINE, "--prompt", "import os", "--max-tokens", "6"]
    args += ["--temperature", "0", "--logprobs", "2", "--json"]
    assert main(args) == 0
    (line,) = capsys.readouterr().out.splitlines()
    data = json.loads(line)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
    (ref,) = llm.generate(["import os"], params, use_tqdm=False)
    assert data["prompt"] == "import os"
    assert data["prompt_token_ids"] == ref.prompt_token_ids
    assert data["finished"] is True
    (comp,) = data["outputs"]
    assert comp["text"] == ref.outputs[0].text
    assert comp["token_ids"] == ref.outputs[0].token_ids
    assert comp["finish_reason"] == ref.outputs[0].finish_reason
    first = ref.outputs[0].token_ids[0]
    assert comp["logprobs"][0][str(first)]["logprob"] == pytest.approx(
        ref.outputs[0].logprobs[0][first].logprob
    )


def _python_path() -> str:
    import fastllm

    root = os.path.dirname(os.path.dirname(os.path.abspath(fastllm.__file__)))
    return os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])


def _spawn_chat(model_dir: str, *extra: str):
    pexpect = pytest.importorskip("pexpect")
    env = dict(os.environ, PYTHONPATH=_python_path(), TERM="dumb")
    args = ["-m", "fastllm.cli", "chat", model_dir, *ENGINE, "--max-tokens", "8", *extra]
    return pexpect.spawn(sys.executable, args, env=env, encoding="utf-8", timeout=120)


def _reply(child) -> str:
    """The assistant's streamed reply, up to the next prompt."""
    child.expect_exact("assistant> ")
    child.expect_exact("\r\nuser> ")
    return child.before.replace("\r\n", "\n")


def test_chat_in_a_terminal(model_dir, llm):
    import pexpect

    from fastllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8)
    child = _spawn_chat(model_dir, "--temperature", "0", "--system", "Be brief.")
    try:
        child.expect_exact("user> ")
        conv = [{"role": "system", "content": "Be brief."}]
        for line in ("hello", "tell me more"):
            child.sendline(line)
            got = _reply(child)
            conv.append({"role": "user", "content": line})
            (ref,) = llm.chat(conv, params, use_tqdm=False)
            assert got == ref.outputs[0].text
            conv.append({"role": "assistant", "content": got})
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_chat_ends_on_eof(model_dir):
    pexpect = pytest.importorskip("pexpect")
    child = _spawn_chat(model_dir)
    try:
        child.expect_exact("user> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0

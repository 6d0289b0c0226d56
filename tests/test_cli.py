"""The ``fastllm`` command: --help everywhere, ``generate`` against the offline
API, and the interactive ``chat`` driven through a pseudo-terminal."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from fastllm.cli import main
from server_process import default_sigint

ENGINE = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "256"]
SETTINGS = (
    "--gpu-memory-utilization",
    "--kv-cache-memory-bytes",
    "--max-logprobs",
    "--revision",
    "--tokenizer-revision",
    "--download-dir",
    "--tokenizer-mode",
    "--trust-remote-code",
    "--enforce-eager",
)


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
        for option in SETTINGS:
            assert option in out
    if command == ["serve"]:
        for option in ("--host", "--port", "--api-key", "--served-model-name"):
            assert option in out
    if command in (["serve"], ["chat"]):
        assert "--chat-template FILE|STRING" in out


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
    return pexpect.spawn(
        sys.executable, args, env=env, encoding="utf-8", timeout=120, preexec_fn=default_sigint
    )


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


# ---- engine settings, the demo model, chat templates -------------------------------


@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt", "x"], ["chat"]])
def test_engine_settings_reach_the_config(command):
    from fastllm.cli import build_parser
    from fastllm.engine_args import engine_config

    args = build_parser().parse_args(
        [
            *command,
            "some/model",
            "--gpu-memory-utilization",
            "0.5",
            "--kv-cache-memory-bytes",
            "64MiB",
            "--max-logprobs",
            "3",
            "--revision",
            "v1",
            "--tokenizer-revision",
            "v2",
            "--download-dir",
            "/hub",
            "--tokenizer-mode",
            "slow",
            "--trust-remote-code",
            "--enforce-eager",
        ]
    )
    config = engine_config(args)
    assert config.model == "some/model"
    assert config.gpu_memory_utilization == 0.5
    assert config.kv_cache_memory_bytes == 64 << 20
    assert config.max_logprobs == 3
    assert (config.revision, config.tokenizer_revision) == ("v1", "v2")
    assert config.download_dir == "/hub"
    assert config.tokenizer_mode == "slow"
    assert config.trust_remote_code is True and config.enforce_eager is True
    default = engine_config(build_parser().parse_args(command))
    assert default.gpu_memory_utilization == 0.9 and default.max_logprobs == 20


def _capture_serve(monkeypatch) -> dict:
    import fastllm.server.app as app

    seen: dict = {}
    monkeypatch.setattr(app, "serve", lambda config, **kw: seen.update(config=config, **kw))
    return seen


def test_serve_without_model_serves_the_demo_model(monkeypatch, tmp_path):
    from fastllm.demo import demo_model_path

    seen = _capture_serve(monkeypatch)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert main(["serve", "--port", "9", "--chat-template", str(template)]) == 0
    assert seen["config"].model == demo_model_path()
    assert seen["served_model_name"] is None  # create_app picks the folder's name
    assert seen["port"] == 9
    assert seen["chat_template"] == template.read_text()
    assert main(["serve", "--chat-template", "{{ messages[0]['content'] }}"]) == 0
    assert seen["chat_template"] == "{{ messages[0]['content'] }}"
    assert main(["serve", "--chat-template", str(tmp_path / "missing.jinja")]) == 2


def test_default_model_name():
    pytest.importorskip("fastapi")
    from fastllm.server.app import _hub_repo_id, default_model_name

    assert default_model_name("/m/demo_model", "/m/demo_model") == "demo_model"
    assert default_model_name("./qwen/", "./qwen/") == "qwen"
    snap = "/c/hub/models--Qwen--Qwen2.5-0.5B/snapshots/0123abcd"
    assert default_model_name("Qwen/Qwen2.5-0.5B", snap) == "Qwen2.5-0.5B"
    assert _hub_repo_id(snap) == "Qwen/Qwen2.5-0.5B"
    assert _hub_repo_id("/m/demo_model") is None


def test_read_chat_template(tmp_path):
    from fastllm.engine_args import read_chat_template

    f = tmp_path / "chat.jinja"
    f.write_text("{{ messages }}")
    assert read_chat_template(str(f)) == "{{ messages }}"
    assert read_chat_template("{% for m in messages %}x{% endfor %}").startswith("{%")
    assert read_chat_template(None) is None
    with pytest.raises(ValueError, match="no such file"):
        read_chat_template(str(tmp_path / "nope.jinja"))
    (tmp_path / "empty.jinja").write_text("  ")
    with pytest.raises(ValueError, match="empty"):
        read_chat_template(str(tmp_path / "empty.jinja"))


def _no_input(prompt=""):
    raise AssertionError("fastllm chat asked for input: it should have failed at startup")


def test_chat_without_template_fails_at_startup(untemplated_model_dir, monkeypatch, capsys):
    monkeypatch.setattr("builtins.input", _no_input)
    assert main(["chat", untemplated_model_dir, *ENGINE]) == 2
    err = capsys.readouterr().err
    assert "no chat template" in err and "--chat-template FILE|STRING" in err
    bad = "{% for m in messages %}{{ m.content }"  # a syntax error
    assert main(["chat", untemplated_model_dir, *ENGINE, "--chat-template", bad]) == 2
    assert "--chat-template cannot render" in capsys.readouterr().err


def _scripted_input(monkeypatch, lines):
    feed = iter(lines)

    def fake_input(prompt=""):
        print(prompt, end="")
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)


TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}### assistant:"
)


def test_chat_with_chat_template(untemplated_model_dir, monkeypatch, capsys, tmp_path):
    from fastllm import LLM, SamplingParams

    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    _scripted_input(monkeypatch, ["hello"])
    args = ["chat", untemplated_model_dir, *ENGINE, "--max-tokens", "8", "--temperature", "0"]
    assert main([*args, "--chat-template", str(path)]) == 0
    out = capsys.readouterr().out
    ref_llm = LLM(untemplated_model_dir, dtype="float32", device="cpu", max_model_len=256)
    (ref,) = ref_llm.chat(
        [{"role": "user", "content": "hello"}],
        SamplingParams(temperature=0.0, max_tokens=8),
        use_tqdm=False,
        chat_template=TEMPLATE,
    )
    assert out == f"user> assistant> {ref.outputs[0].text}\nuser> \n"


def test_chat_reply_stops_at_end_of_turn(model_dir, monkeypatch):
    """fastllm chat asks the engine to stop at the template's end-of-turn token
    (<|im_end|> here), as LLM.chat does."""
    from fastllm.llm import LLM

    seen = []
    real_stream = LLM.stream

    def stream(self, prompt, params=None):
        seen.append(params)
        return real_stream(self, prompt, params)

    monkeypatch.setattr(LLM, "stream", stream)
    _scripted_input(monkeypatch, ["hello"])
    assert main(["chat", model_dir, *ENGINE, "--max-tokens", "4"]) == 0
    (params,) = seen
    from fastllm.tokenizer import Tokenizer

    im_end = Tokenizer(model_dir).token_to_id("<|im_end|>")
    assert im_end in params.stop_token_ids
    seen.clear()
    _scripted_input(monkeypatch, ["hello"])
    assert main(["chat", model_dir, *ENGINE, "--max-tokens", "4", "--ignore-eos"]) == 0
    assert im_end not in seen[0].stop_token_ids and seen[0].ignore_eos


# ---- Ctrl-C in fastllm chat ------------------------------------------------------


def test_chat_ctrl_c_stops_a_reply_and_returns_to_the_prompt():
    """On the demo model: 24 interrupts at random moments of streaming replies,
    each answered by the prompt, then a reply that runs to its end; Ctrl-C at
    the prompt then leaves with status 0."""
    import random

    pexpect = pytest.importorskip("pexpect")
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=_python_path(), TERM="dumb")
    args = ["-m", "fastllm.cli", "chat", "--max-tokens", "2000", "--temperature", "1.0"]
    args += ["--ignore-eos", "--seed", "1"]
    child = pexpect.spawn(
        sys.executable, args, env=env, encoding="utf-8", timeout=120, preexec_fn=default_sigint
    )
    rng = random.Random(0)
    try:
        child.expect_exact("user> ")
        for i in range(24):
            child.sendline(f"write function number {i}")
            child.expect_exact("assistant> ")
            if i % 3:
                child.expect(r"\S")  # some of the reply has arrived
            time.sleep(rng.uniform(0.0, 0.12))
            child.sendintr()
            child.expect_exact("[interrupted]")
            child.expect_exact("user> ")
        child.sendline("one more")
        child.expect_exact("assistant> ")
        child.expect_exact("\r\nuser> ")
        final = child.before
        assert "[interrupted]" not in final and len(final.strip()) > 20
        child.sendintr()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before


def test_bench_passes_engine_settings_to_its_llm(monkeypatch):
    import fastllm
    from fastllm import benchmark
    from fastllm.cli import build_parser

    seen = {}

    def fake_llm(model, **kw):
        seen.update(kw, model=model)
        raise RuntimeError("stop here")

    monkeypatch.setattr(fastllm, "LLM", fake_llm)
    args = build_parser().parse_args(
        [
            "bench",
            "throughput",
            "some/model",
            "--gpu-memory-utilization",
            "0.4",
            "--max-logprobs",
            "7",
        ]
    )
    with pytest.raises(RuntimeError, match="stop here"):
        benchmark._llm(args)
    assert seen["model"] == "some/model"
    assert seen["gpu_memory_utilization"] == 0.4 and seen["max_logprobs"] == 7

"""README.md's examples, run as written: the Quickstart and Structured outputs blocks, and the
"Command line and server" section's `fastllm serve` command with the curl and
`openai` examples against it (only the port number is changed, to a free one).
Also what the README says about the notebook extra and the benchmark-model
script."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from server_process import free_port, running_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def code_blocks(markdown: str) -> list[tuple[str, str, str]]:
    """Every fenced code block as (section heading, language, code)."""
    blocks = []
    section = ""
    fence: str | None = None
    lang = ""
    lines: list[str] = []
    for line in markdown.splitlines():
        if fence is None:
            m = re.match(r"^(```+|~~~+)\s*([\w+-]*)", line)
            if m:
                fence, lang, lines = m.group(1), m.group(2), []
            elif line.startswith("## "):
                section = line[3:].strip()
        elif line.strip() == fence:
            blocks.append((section, lang, "\n".join(lines) + "\n"))
            fence = None
        else:
            lines.append(line)
    return blocks


def _readme_blocks(section: str) -> list[tuple[str, str]]:
    with open(README, encoding="utf-8") as f:
        found = [(lang, code) for sec, lang, code in code_blocks(f.read()) if sec == section]
    assert found, f"README.md has no code block under '## {section}'"
    return found


def _commands(code: str) -> list[str]:
    """The shell commands of a block: continuation lines joined, comments and blanks dropped."""
    joined = code.replace("\\\n", " ")
    return [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.startswith("#")]


def _server_examples() -> dict[str, str]:
    """The serve command, the curl command and the openai snippet of the README."""
    blocks = _readme_blocks("Command line and server")
    bash = [_commands(c) for lang, c in blocks if lang == "bash"]
    serve = [cmds for cmds in bash if len(cmds) == 1 and cmds[0].startswith("fastllm serve")]
    curl = [c for lang, c in blocks if lang == "bash" and _commands(c)[0].startswith("curl ")]
    snippet = [c for lang, c in blocks if lang == "python" and "OpenAI(" in c]
    assert len(serve) == 1, "expected one block holding only a `fastllm serve` command"
    assert len(curl) == 1 and len(snippet) == 1
    return {"serve": serve[0][0], "curl": curl[0], "python": snippet[0]}


def _env() -> dict[str, str]:
    import fastllm

    root = os.path.dirname(os.path.dirname(os.path.abspath(fastllm.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    env.pop("FASTLLM_API_KEY", None)
    return env


def _fastllm_command() -> list[str]:
    """How to run the `fastllm` console script from this interpreter."""
    script = os.path.join(os.path.dirname(sys.executable), "fastllm")
    if os.path.isfile(script) and os.access(script, os.X_OK):
        return [script]
    return [sys.executable, "-m", "fastllm.cli"]


def test_code_blocks_parser():
    md = "## A\n```bash\nx \\\n  y\n```\ntext\n## B\n```python\nprint(1)\n```\n"
    assert code_blocks(md) == [("A", "bash", "x \\\n  y\n"), ("B", "python", "print(1)\n")]
    assert _commands("x \\\n  y\n# c\n\nz\n") == ["x    y", "z"]


# ---- the server examples ----------------------------------------------------------


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory):
    """The README's `fastllm serve ...` command, on a free port: (examples, port, log)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    examples = _server_examples()
    argv = shlex.split(examples["serve"], comments=True)
    assert argv[:2] == ["fastllm", "serve"]
    readme_port = argv[argv.index("--port") + 1]
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    examples = {
        k: v.replace(f":{readme_port}/", f":{port}/") for k, v in examples.items() if k != "serve"
    }
    log = tmp_path_factory.mktemp("readme") / "serve.log"
    with running_server(_fastllm_command() + argv[1:], port, log, _env()):
        yield examples, port, log


def test_readme_curl(readme_server):
    pytest.importorskip("torch")
    examples, port, _ = readme_server
    assert f"127.0.0.1:{port}/" in examples["curl"]
    r = subprocess.run(
        ["bash", "-c", examples["curl"]], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    assert "error" not in body, body
    request = json.loads(re.search(r"-d '(\{.*\})'", examples["curl"]).group(1))
    assert body["model"] == request["model"] == "demo_model"
    (choice,) = body["choices"]
    assert choice["text"]

    from fastllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=request["max_tokens"], temperature=request["temperature"])
    (ref,) = LLM().generate([request["prompt"]], params, use_tqdm=False)
    assert choice["text"] == ref.outputs[0].text
    assert body["usage"]["completion_tokens"] == len(ref.outputs[0].token_ids)


def test_readme_openai_snippet(readme_server):
    pytest.importorskip("openai")
    examples, port, _ = readme_server
    assert f"127.0.0.1:{port}/" in examples["python"]
    r = subprocess.run(
        [sys.executable, "-c", examples["python"]],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "the chat reply is empty"


def test_readme_server_logs_startup_block(readme_server):
    """One block, before the server listens, at the default log level."""
    from fastllm.demo import demo_model_path

    _, port, log = readme_server
    text = log.read_text()
    assert text.count(" server\n  model ") == 1, text
    block = text[text.index(" server\n  model ") :]
    block = block[: block.index("\n", block.index("  address "))]
    rows = dict(re.findall(r"^  (\S[\w ]*?\S)  +(.*)$", block, re.M))
    assert rows["model"] == demo_model_path()
    assert rows["served as"] == "demo_model"
    assert rows["device"] == "cpu" or rows["device"].startswith("cuda")
    assert rows["dtype"] in ("float32", "bfloat16", "float16")
    assert rows["quantization"] == "none"
    assert rows["max_model_len"] == "1024"
    assert re.match(r"\d+ blocks of 16 tokens, [\d.]+ MiB", rows["KV cache"])
    assert rows["address"] == f"http://127.0.0.1:{port}"
    assert rows["API key"] == "required"
    assert text.index("  address ") < text.index("Uvicorn running on")


# ---- the Quickstart ---------------------------------------------------------------


def test_readme_quickstart():
    pytest.importorskip("torch")
    (code,) = [c for lang, c in _readme_blocks("Quickstart") if lang == "python"]
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300
    )
    assert r.returncode == 0, r.stderr
    for prompt in re.findall(r"llm\.generate\(\[(.*?)\]", code)[0].split(", "):
        assert prompt.strip('"') in r.stdout
    assert len(r.stdout) > 200


def test_readme_structured_outputs():
    pytest.importorskip("torch")
    (code,) = [c for lang, c in _readme_blocks("Structured outputs") if lang == "python"]
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300
    )
    assert r.returncode == 0, r.stderr
    obj_line, choice_line = r.stdout.strip().splitlines()[-2:]
    import ast

    obj = ast.literal_eval(obj_line)  # the printed dict
    assert set(obj) == {"name", "year", "typed"} and 1990 <= obj["year"] <= 2030
    assert choice_line in ("list", "dict", "set")


def test_readme_quantized_weights():
    pytest.importorskip("torch")
    blocks = _readme_blocks("Quantized weights")
    (code,) = [c for lang, c in blocks if lang == "python"]
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert "quantization='q8_0'" in r.stdout and len(r.stdout) > 80
    (bash,) = [c for lang, c in blocks if lang == "bash"]
    for line in _commands(bash):
        argv = shlex.split(line)
        if "bench-models/" in line:
            continue  # the benchmark model is built separately (see Benchmarks)
        r = subprocess.run(
            _fastllm_command() + argv[1:], capture_output=True, text=True, env=_env(), timeout=300
        )
        assert r.returncode == 0, (line, r.stderr)
        assert "quantized" in r.stderr and r.stdout.strip(), line


def test_readme_gguf_files(tmp_path):
    """The GGUF section's examples, run in a folder holding ``model.gguf``: the
    demo model written as a Q8_0 GGUF file (tests/gguf_models.py)."""
    pytest.importorskip("gguf")
    import fastllm
    from gguf_models import write_gguf

    demo = os.path.join(os.path.dirname(os.path.abspath(fastllm.__file__)), "demo_model")
    write_gguf(demo, str(tmp_path / "model.gguf"), "llama", "Q8_0", tokenizer=True)
    blocks = _readme_blocks("GGUF files")
    (code,) = [c for lang, c in blocks if lang == "python"]
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "quantization='gguf' (Q8_0 x" in r.stdout and len(r.stdout.splitlines()) >= 2
    (bash,) = [c for lang, c in blocks if lang == "bash"]
    outputs = []
    for line in _commands(bash):
        argv = shlex.split(line.split("  #")[0])
        r = subprocess.run(
            _fastllm_command() + argv[1:],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=300,
            cwd=tmp_path,
        )
        assert r.returncode == 0, (line, r.stderr)
        assert r.stdout.strip(), line
        outputs.append(r.stdout)
    assert "Q8_0 x" in outputs[0] and "q8_0 kernel, as stored" in outputs[0]  # fastllm env --model


def test_readme_overview_commands_run_as_written():
    """The command overview's one-shot commands on the demo model (not the
    interactive chat, the long-running serve, nor a placeholder MODEL)."""
    pytest.importorskip("torch")
    blocks = [c for lang, c in _readme_blocks("Command line and server") if lang == "bash"]
    overview = next(c for c in blocks if "fastllm env" in c)
    lines = [ln.split("  #")[0].strip() for ln in _commands(overview)]
    runnable = [ln for ln in lines if " MODEL" not in ln and ln.split()[1] not in ("chat", "serve")]
    assert [ln.split()[1] for ln in runnable] == ["env", "generate"]
    for line in runnable:
        argv = shlex.split(line)
        r = subprocess.run(
            _fastllm_command() + argv[1:], capture_output=True, text=True, env=_env(), timeout=300
        )
        assert r.returncode == 0, (line, r.stderr)
        assert r.stdout.strip(), line
    report = subprocess.run(
        _fastllm_command() + ["env"], capture_output=True, text=True, env=_env(), timeout=120
    ).stdout
    assert "CPU: " in report and "CPU kernel paths" in report


# ---- what the README says about files --------------------------------------------


def test_notebook_extra():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    names = {re.split(r"[<>=!~\[ ]", req)[0] for req in extras["notebook"]}
    assert {"ipywidgets", "ipykernel"} <= names
    with open(README, encoding="utf-8") as f:
        text = f.read()
    notebook = text.index("quickstart.ipynb")
    assert 'pip install "fastllm[notebook]"' in text[notebook - 200 : notebook + 300]


def test_bench_model_script_is_in_the_project():
    mentions = []
    docs = sorted(n for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
    for doc in ["README.md", *(os.path.join("docs", n) for n in docs)]:
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            text = f.read()
        assert "../shared" not in text, f"{doc} points outside the project"
        mentions += [(doc, m) for m in re.findall(r"[\w./-]*make_bench_model\.py", text)]
    assert mentions
    for doc, path in mentions:
        assert path in ("benches/make_bench_model.py", "../benches/make_bench_model.py"), doc
    script = os.path.join(ROOT, "benches", "make_bench_model.py")
    with open(script, encoding="utf-8") as f:
        compile(f.read(), script, "exec")

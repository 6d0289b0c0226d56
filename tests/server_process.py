"""Test helper: a `fastllm serve` process on 127.0.0.1, started and stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest


def default_sigint() -> None:
    """For ``preexec_fn``: the child starts with SIGINT's default disposition, as
    from a terminal. A shell without job control starts background commands
    with SIGINT ignored, the ignored disposition is inherited, and Python then
    never turns SIGINT into KeyboardInterrupt: tests of Ctrl-C would hang."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def free_port() -> int:
    """A port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(cmd: list[str], port: int, log: Path, env: dict) -> Iterator[None]:
    """Runs ``cmd`` (output to ``log``) until ``/health`` on ``port`` answers 200,
    yields, and stops it; a server that exits or never answers fails the test
    with its log."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                pytest.fail(f"server did not start:\n{log.read_text()}")
            time.sleep(0.2)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve_command(model: str, port: int, max_len: int, name: str, key: str) -> list[str]:
    """`fastllm serve` of ``model`` on 127.0.0.1:``port`` (float32, CPU), as the tests run it."""
    return [
        sys.executable,
        "-m",
        "fastllm.cli",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--max-model-len",
        str(max_len),
        "--served-model-name",
        name,
        "--api-key",
        key,
        "--log-level",
        "warning",
    ]


def package_env() -> dict[str, str]:
    """The environment for a server process: this fastllm first on the path, no API key set."""
    import fastllm

    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(fastllm.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([pkg_root, os.environ.get("PYTHONPATH", "")]))
    env.pop("FASTLLM_API_KEY", None)
    return env


@contextlib.contextmanager
def app_server(
    model: str, max_model_len: int, chat_template: str | None = None, **engine
) -> Iterator[tuple]:
    """create_app(...) served by uvicorn on a thread of this process:
    (app, (host, port)); the app's engine is reachable for inspection.
    ``engine``: EngineConfig fields, or create_app's own keywords
    (``tool_call_parser``, ``served_model_name``, ``api_key``)."""
    import threading

    import uvicorn

    from fastllm.config import EngineConfig
    from fastllm.server.app import create_app

    app_keys = ("tool_call_parser", "served_model_name", "api_key")
    app_kw = {k: engine.pop(k) for k in app_keys if k in engine}
    config = EngineConfig(
        model=model, dtype="float32", device="cpu", max_model_len=max_model_len, **engine
    )
    app = create_app(config, chat_template=chat_template, **app_kw)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not srv.started:
        if not thread.is_alive() or time.time() > deadline:
            pytest.fail("the in-process server did not start")
        time.sleep(0.05)
    try:
        yield app, ("127.0.0.1", port)
    finally:
        srv.should_exit = True
        thread.join(30)

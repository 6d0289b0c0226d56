"""Serving on Ray Serve: the app of ``fastllm serve``, one engine per replica."""

from __future__ import annotations

import logging
import os
from typing import Any

from fastllm.ray import require_ray

ray = require_ray()

logger = logging.getLogger("fastllm.server")


def build_app(
    engine_args: Any,
    *,
    num_replicas: int = 1,
    num_cpus_per_replica: float = 1,
    num_gpus_per_replica: float = 0,
    num_threads: int | None = None,
    served_model_name: str | list[str] | None = None,
    api_key: str | None = None,
    max_body_bytes: int | None = None,
    chat_template: str | None = None,
    max_ongoing_requests: int | None = None,
    name: str = "fastllm",
    runtime_env: dict[str, Any] | None = None,
) -> Any:
    """The Ray Serve application (a bound deployment) serving ``engine_args``
    (an ``EngineConfig``) with ``num_replicas`` replicas.

    Each replica builds the FastAPI app of ``fastllm serve``
    (``fastllm.server.app.create_app``) with its own engine, on
    ``num_cpus_per_replica`` CPUs and ``num_gpus_per_replica`` GPUs (1 for a
    GPU replica), its CPU kernels on ``num_threads`` threads (default: the
    CPUs it asked for, at least 1). Serve's health check of a replica is the
    engine's health (what ``/health`` answers); a replica that fails it, or
    dies, is replaced while the others keep answering. ``api_key``,
    ``served_model_name``, ``chat_template`` and ``max_body_bytes`` mean what
    they mean to ``fastllm serve``; ``max_model_len`` is ``engine_args``'.
    Run it with ``serve.run(app)`` or ``fastllm.ray.run``.
    """
    from ray import serve

    from fastllm.server.app import DEFAULT_MAX_BODY_BYTES

    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
    if num_cpus_per_replica < 0 or num_gpus_per_replica < 0:
        raise ValueError("num_cpus_per_replica and num_gpus_per_replica must not be negative")
    if num_threads is None:
        num_threads = max(1, int(num_cpus_per_replica))
    app_kwargs = {
        "served_model_name": served_model_name,
        "api_key": api_key,
        "max_body_bytes": max_body_bytes or DEFAULT_MAX_BODY_BYTES,
        "chat_template": chat_template,
    }
    threads = num_threads

    def build_asgi_app() -> Any:
        from fastllm.server.app import create_app

        return create_app(engine_args, **app_kwargs)

    class FastllmReplica:
        """One replica: the server app over its own engine."""

        def __init__(self) -> None:
            os.environ["FASTLLM_NUM_THREADS"] = str(threads)
            import torch

            torch.set_num_threads(threads)

        def check_health(self) -> None:
            """Serve's health check: raises while the engine is not running."""
            engine = self.app.state.fastllm.engine
            if not engine.is_alive:
                raise RuntimeError(f"the fastllm engine is not running: {engine.error!r}")

    FastllmReplica.__name__ = FastllmReplica.__qualname__ = "FastllmReplica"
    env = dict(runtime_env or {})
    env["env_vars"] = {
        "FASTLLM_NUM_THREADS": str(threads),
        "OMP_NUM_THREADS": str(threads),
        **env.get("env_vars", {}),
    }
    options: dict[str, Any] = {
        "name": name,
        "num_replicas": num_replicas,
        "ray_actor_options": {
            "num_cpus": num_cpus_per_replica,
            "num_gpus": num_gpus_per_replica,
            "runtime_env": env,
        },
        "health_check_period_s": 2,
    }
    if max_ongoing_requests is not None:
        options["max_ongoing_requests"] = max_ongoing_requests
    deployment = serve.deployment(serve.ingress(build_asgi_app)(FastllmReplica), **options)
    return deployment.bind()


def run(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    address: str | None = None,
    name: str = "fastllm",
    blocking: bool = True,
) -> Any:
    """Runs ``app`` (from ``build_app``) on Ray Serve, listening on
    ``host:port``: on the Ray cluster at ``address`` (``"auto"``: the one
    this machine belongs to), or on a local one started here when None.
    With ``blocking`` it serves until interrupted (Ctrl-C or SIGTERM), then
    shuts Serve down, and the local Ray cluster if it started one."""
    import signal
    import threading
    import time

    from ray import serve

    started = False
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False if address is None else None)
        started = True
    serve.start(http_options={"host": host, "port": port})
    handle = serve.run(app, name=name, route_prefix="/", blocking=False)
    shown = f"[{host}]" if ":" in host else host
    logger.info("fastllm on Ray Serve: application %r at http://%s:%d", name, shown, port)
    if not blocking:
        return handle
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.is_set():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        logger.info("fastllm on Ray Serve: shutting down")
        serve.shutdown()
        if started:
            ray.shutdown()
    return handle

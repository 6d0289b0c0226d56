"""Serving on Ray Serve: the app of ``fastllm serve``, one engine per replica."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastllm import envs
from fastllm.ray import require_ray
from fastllm.ray.routing import (
    DEFAULT_BUSY_MARGIN,
    DEFAULT_ROUTING_BLOCKS,
    PIN_KEY,
    ROUTING_KEY,
    live_replicas,
    prefix_key,
    routing_token_ids,
)

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
    tool_call_parser: str | None = None,
    max_ongoing_requests: int | None = None,
    name: str = "fastllm",
    runtime_env: dict[str, Any] | None = None,
    prefix_routing: bool = True,
    routing_blocks: int = DEFAULT_ROUTING_BLOCKS,
    busy_margin: int = DEFAULT_BUSY_MARGIN,
    router_max_ongoing_requests: int = 4096,
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
    ``served_model_name``, ``chat_template``, ``tool_call_parser`` and
    ``max_body_bytes`` mean what they mean to ``fastllm serve``; ``max_model_len`` is ``engine_args``'.
    Run it with ``serve.run(app)`` or ``fastllm.ray.run``.

    With ``prefix_routing`` (the default) HTTP requests reach the engine
    replicas through a router deployment (``{name}-router``, one replica on
    no CPU of its own): it tokenizes each completion or chat request as the
    replicas do and sends it to the replica whose prefix cache should hold
    its first ``routing_blocks`` full KV blocks, or to the least-loaded one
    when that replica has more than ``busy_margin`` requests in flight over
    it (``fastllm.ray.routing``); its ``/metrics`` gathers every replica's
    metrics, each with a ``replica`` label. Without it the engine deployment
    is the HTTP ingress itself and Serve routes by its own rule.
    """
    from ray import serve

    from fastllm.server.app import DEFAULT_MAX_BODY_BYTES

    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
    if num_cpus_per_replica < 0 or num_gpus_per_replica < 0:
        raise ValueError("num_cpus_per_replica and num_gpus_per_replica must not be negative")
    if routing_blocks < 1 or busy_margin < 0:
        raise ValueError(
            f"routing_blocks must be at least 1 and busy_margin not negative, "
            f"got {routing_blocks} and {busy_margin}"
        )
    if num_threads is None:
        num_threads = max(1, int(num_cpus_per_replica))
    app_kwargs = {
        "served_model_name": served_model_name,
        "api_key": api_key,
        "max_body_bytes": max_body_bytes or DEFAULT_MAX_BODY_BYTES,
        "chat_template": chat_template,
        "tool_call_parser": tool_call_parser,
    }
    replica = _replica_class(engine_args, app_kwargs, num_threads, prefix_routing)
    env = dict(runtime_env or {})
    env["env_vars"] = {
        "FASTLLM_NUM_THREADS": str(num_threads),
        "OMP_NUM_THREADS": str(num_threads),
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
    if not prefix_routing:
        deployment = serve.deployment(serve.ingress(replica.build_asgi_app)(replica), **options)
        return deployment.bind()
    from ray.serve.config import RequestRouterConfig

    options["request_router_config"] = RequestRouterConfig(
        request_router_class="fastllm.ray.router.PrefixAffinityRouter",
        request_router_kwargs={"busy_margin": busy_margin},
    )
    engines = serve.deployment(replica, **options)
    router_app = RouterApp(
        deployment=name,
        routing_blocks=routing_blocks,
        max_body_bytes=app_kwargs["max_body_bytes"],
        api_key=api_key,
        chat_template=chat_template,
    )
    router = serve.deployment(
        serve.ingress(router_app)(FastllmRouter),
        name=f"{name}-router",
        num_replicas=1,
        max_ongoing_requests=router_max_ongoing_requests,
        ray_actor_options={"num_cpus": 0, "runtime_env": env},
    )
    return router.bind(engines.bind())


def _replica_class(
    engine_args: Any, app_kwargs: dict[str, Any], threads: int, routed: bool
) -> type:
    """The class of the engine deployment's replicas."""

    def build_asgi_app() -> Any:
        from fastllm.server.app import create_app

        return create_app(engine_args, **app_kwargs)

    class FastllmReplica:
        """One replica: the server app over its own engine (Serve's HTTP
        ingress itself, or, behind the router deployment, run on the
        requests it relays)."""

        def __init__(self) -> None:
            envs.set_num_threads(threads)
            import torch

            torch.set_num_threads(threads)
            if routed:  # no serve.ingress (one per application): run the app here
                self.app = build_asgi_app()
                self.app.state.fastllm.engine.start()

        async def _shutdown(self) -> None:
            await asyncio.to_thread(self.app.state.fastllm.engine.shutdown)

        def check_health(self) -> None:
            """Serve's health check: raises while the engine is not running."""
            engine = self.app.state.fastllm.engine
            if not engine.is_alive:
                raise RuntimeError(f"the fastllm engine is not running: {engine.error!r}")

        async def handle_http(
            self, scope: dict[str, Any], body: bytes, **routing: Any
        ) -> AsyncIterator[dict[str, Any]]:
            """One HTTP request relayed by the router deployment: runs the
            app on it and yields the ASGI messages it sends (``routing``
            holds the router's keys, which only the request router reads)."""
            async for message in _run_asgi(self.app, scope, body):
                yield message

        def metrics_text(self, **routing: Any) -> str:
            """This replica's ``/metrics`` page, each sample labelled with
            the replica's unique id."""
            from ray import serve

            from fastllm.server.metrics import prometheus

            state = self.app.state.fastllm
            uid = serve.get_replica_context().replica_id.unique_id
            return prometheus(state.engine, state.model_names[0], replica=uid)

        def routing_info(self, **routing: Any) -> dict[str, Any]:
            """What the router needs to compute the replicas' prompt tokens
            and blocks (``ServerState.routing_info``)."""
            return self.app.state.fastllm.routing_info()

    FastllmReplica.__name__ = FastllmReplica.__qualname__ = "FastllmReplica"
    FastllmReplica.build_asgi_app = staticmethod(build_asgi_app)
    if routed:  # Serve calls (and awaits) __del__ when it stops the replica
        FastllmReplica.__del__ = FastllmReplica._shutdown
    return FastllmReplica


# ---- the router deployment ---------------------------------------------------------

_DONE = object()
# ASGI scope keys that travel to the engine replica (the rest are the proxy's)
_SCOPE_KEYS = (
    "type",
    "asgi",
    "http_version",
    "method",
    "scheme",
    "path",
    "raw_path",
    "root_path",
    "query_string",
    "headers",
    "client",
    "server",
)


async def _run_asgi(app: Any, scope: dict[str, Any], body: bytes) -> AsyncIterator[dict[str, Any]]:
    """Runs the ASGI ``app`` on one HTTP request whose body is ``body`` and
    yields the messages it sends. Leaving early (the client went away, the
    caller was cancelled) tells the app the client disconnected."""
    queue: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        queue.put_nowait(message)

    async def run() -> None:
        try:
            await app(dict(scope), receive, send)
        except Exception as e:  # noqa: BLE001 - handed to the reader below
            queue.put_nowait(e)
        finally:
            queue.put_nowait(_DONE)

    task = asyncio.ensure_future(run())
    try:
        while True:
            item = await queue.get()
            if item is _DONE:
                break
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        disconnected.set()
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), 5)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()


def merge_prometheus(pages: list[str]) -> str:
    """One Prometheus text page from several (each replica's): every metric
    family's HELP and TYPE once, then its samples from every page, in the
    order of the first page that has it."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for page in pages:
        current = None
        for line in page.splitlines():
            if not line:
                continue
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                name = line.split(" ", 3)[2]
                head, _ = families.setdefault(name, ([], []))
                if line not in head:
                    head.append(line)
                current = name
            elif current is not None:
                families[current][1].append(line)
    out: list[str] = []
    for head, samples in families.values():
        out += head + samples
    return "\n".join(out) + "\n"


class RouterApp:
    """The ASGI app of the router deployment: relays every HTTP request to an
    engine replica (``FastllmReplica.handle_http``), with the prefix key of
    completion and chat requests for ``PrefixAffinityRouter``, and answers
    ``/metrics`` with every replica's metrics."""

    def __init__(
        self,
        *,
        deployment: str,
        routing_blocks: int,
        max_body_bytes: int,
        api_key: str | None,
        chat_template: str | None,
    ) -> None:
        self.deployment = deployment
        self.routing_blocks = routing_blocks
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key.encode() if api_key else None
        self.chat_template = chat_template
        self._handle: Any = None
        self._info: dict[str, Any] | None = None
        self._tokenizer: Any = None
        self._info_lock: asyncio.Lock | None = None

    # -- state, built in the replica on first use --

    def handle(self) -> Any:
        if self._handle is None:
            from ray import serve

            app_name = serve.get_replica_context().app_name
            self._handle = serve.get_deployment_handle(self.deployment, app_name=app_name)
        return self._handle

    async def routing_state(self) -> tuple[Any, int] | None:
        """The tokenizer and block size of the replicas (asked of one
        replica once), or None when requests cannot be keyed."""
        if self._info is None:
            if self._info_lock is None:
                self._info_lock = asyncio.Lock()
            async with self._info_lock:
                if self._info is None:
                    info = await self.handle().routing_info.remote(**{ROUTING_KEY: None})
                    tok = None
                    if info.get("tokenizer_folder") and info.get("prefix_caching"):
                        try:
                            from fastllm.loading import load_tokenizer

                            tok = await asyncio.to_thread(load_tokenizer, info["tokenizer_folder"])
                        except Exception as e:  # noqa: BLE001 - routing degrades, serving goes on
                            logger.warning("prefix routing off: cannot load the tokenizer: %s", e)
                    self._tokenizer = tok
                    self._info = info
        if self._tokenizer is None:
            return None
        return self._tokenizer, int(self._info["block_size"])

    def authorized(self, headers: dict[bytes, bytes]) -> bool:
        if self.api_key is None:
            return True
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def key_of(self, path: str, body: bytes, headers: dict[bytes, bytes]) -> str | None:
        """The prefix key of a completion or chat request (None for others,
        and for requests the replica will refuse anyway)."""
        if path not in ("/v1/completions", "/v1/chat/completions") or not self.authorized(headers):
            return None
        state = await self.routing_state()
        if state is None:
            return None
        tok, block_size = state
        ids = routing_token_ids(path, body, tok, self.chat_template)
        if ids is None:
            return None
        return prefix_key(ids, block_size, self.routing_blocks)

    # -- ASGI --

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        from fastllm.server.http import error_response, too_large

        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await error_response(too_large(self.max_body_bytes))(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        path = scope.get("path", "")
        if path == "/metrics" and scope.get("method") == "GET":
            await self.metrics(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        key = await self.key_of(path, bytes(body), headers)
        out_scope = {k: scope[k] for k in _SCOPE_KEYS if k in scope}
        stream = (
            self.handle()
            .options(stream=True)
            .handle_http.remote(out_scope, bytes(body), **{ROUTING_KEY: key})
        )
        await self.relay(stream, scope, receive, send)

    async def relay(self, stream: Any, scope: Any, receive: Any, send: Any) -> None:
        """Sends the replica's messages on; a replica that dies before its
        answer started gives a 503, one that dies in an event stream ends
        it with an error event (what the OpenAI clients raise)."""
        from fastllm.server.http import error_response
        from fastllm.server.protocol import APIError

        started = False
        event_stream = False
        try:
            async for message in stream:
                if message["type"] == "http.response.start":
                    started = True
                    ctype = dict(message.get("headers") or []).get(b"content-type", b"")
                    event_stream = ctype.startswith(b"text/event-stream")
                await send(message)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the replica died or failed
            err = APIError(f"the replica serving this request failed: {e}", 503)
            logger.warning("fastllm router: %s", err.message)
            if not started:
                await error_response(err)(scope, receive, send)
            elif event_stream:
                data = f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n".encode()
                await send({"type": "http.response.body", "body": data, "more_body": False})
            else:
                raise

    async def metrics(self, scope: Any, receive: Any, send: Any) -> None:
        """Every live replica's ``/metrics``, merged (each sample with its
        ``replica`` label)."""
        from fastapi.responses import PlainTextResponse
        from ray import serve

        handle = self.handle()
        app_name = serve.get_replica_context().app_name
        ids = live_replicas(app_name, self.deployment)
        if not ids:  # this process's router has not seen the replicas yet
            await self.routing_state()
            for _ in range(50):
                ids = live_replicas(app_name, self.deployment)
                if ids:
                    break
                await asyncio.sleep(0.1)

        async def one(uid: str) -> str | None:
            try:
                call = handle.metrics_text.remote(**{PIN_KEY: uid})
                return await asyncio.wait_for(call, 5)
            except Exception as e:  # noqa: BLE001 - a replica going away
                logger.warning("fastllm router: no metrics from replica %s: %s", uid, e)
                return None

        # one after another: calls made within one request share its internal
        # request id, and Serve's router matches concurrent ones by that id
        pages = [p for p in [await one(u) for u in ids] if p]
        response = PlainTextResponse(
            merge_prometheus(pages), media_type="text/plain; version=0.0.4; charset=utf-8"
        )
        await response(scope, receive, send)


class FastllmRouter:
    """The router deployment's class: holds the engine deployment's handle
    (its argument) so that Serve deploys the two together."""

    def __init__(self, engines: Any) -> None:
        self.engines = engines


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

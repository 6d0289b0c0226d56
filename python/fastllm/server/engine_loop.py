"""AsyncEngine: one thread owns the (synchronous, not thread-safe) LLMEngine
and runs its steps; asyncio handlers submit requests and aborts through a
thread-safe queue and receive each request's outputs on an asyncio queue."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastllm.outputs import RequestOutput
from fastllm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from fastllm.engine.llm_engine import LLMEngine

logger = logging.getLogger("fastllm.server")

# Latency buckets (seconds) of the time-to-first-token and inter-token histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    """A Prometheus-style cumulative histogram (written by one thread)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        """Records one value."""
        with self._lock:
            i = next((k for k, b in enumerate(self.buckets) if value <= b), len(self.buckets))
            self.counts[i] += 1
            self.sum += value
            self.count += 1

    def snapshot(self) -> tuple[list[tuple[str, int]], float, int]:
        """Cumulative (le, count) pairs, the sum and the count."""
        with self._lock:
            out, acc = [], 0
            for b, c in zip([*map(repr, self.buckets), "+Inf"], self.counts):
                acc += c
                out.append((b, acc))
            return out, self.sum, self.count


@dataclass
class _Stream:
    """Where one request's outputs go, and its latency bookkeeping."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    delta: bool  # outputs are deltas (RequestOutputKind.DELTA), not cumulative
    tokens_seen: int = 0
    last_token_time: float = 0.0


@dataclass
class EngineStats:
    """What /metrics shows, copied by the engine thread after every step."""

    running: int = 0
    waiting: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    num_blocks: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0
    prefix_hits: int = 0
    prefix_queries: int = 0
    evictions: int = 0
    # Hybrid models' recurrent-state snapshots (``engine/state_cache.py``).
    state_snapshot_queries: int = 0
    state_snapshot_hits: int = 0
    state_snapshot_hit_tokens: int = 0
    state_snapshots_saved: int = 0
    finished: dict[str, int] = field(default_factory=dict)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped."""


class AsyncEngine:
    """Serves many concurrent asyncio callers from one engine thread."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # touched only by the engine thread
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self._finished: dict[str, int] = {}
        self.stats = EngineStats()
        self._publish_stats()

    # ---- life -----------------------------------------------------------

    def start(self) -> None:
        """Starts the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fastllm-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine thread; requests still running are aborted."""
        self._stopping = True
        self._commands.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        """Whether the engine thread is running."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- the asyncio side -----------------------------------------------

    async def generate(
        self,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs (cumulative, or deltas when
        ``params.output_kind`` says so), the last one with ``finished=True``.

        Leaving the iteration early (cancellation, client disconnect, ``aclose``)
        aborts the request, so its KV blocks return to the pool.
        """
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        delta = params.output_kind is RequestOutputKind.DELTA
        stream = _Stream(loop, q, time.time(), delta)
        self._commands.put(("add", request_id, prompt, prompt_token_ids, params, stream))
        finished = False
        try:
            while not finished:
                item = await q.get()
                # Cumulative outputs: when the reader lags, only the newest matters
                # (deltas are all read, in order).
                while not delta and not q.empty() and not isinstance(item, BaseException):
                    if item.finished:
                        break
                    item = q.get_nowait()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Asks the engine thread to abort a request (thread-safe, idempotent)."""
        self._commands.put(("abort", request_id))

    # ---- the engine thread ----------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._take_commands(block=not engine.has_unfinished_requests())
                if self._stopping:
                    break
                if engine.has_unfinished_requests():
                    try:
                        outputs = engine.step()
                    except Exception as e:  # one failing step must not stop the server
                        logger.exception("engine step failed; aborting its requests")
                        self._fail_all(e)
                        outputs = []
                    now = time.time()
                    for out in outputs:
                        self._deliver(out, now)
                self._publish_stats()
        except BaseException as e:  # pragma: no cover - a bug in the loop itself
            self.error = e
            logger.exception("the engine thread died")
        finally:
            self._fail_all(EngineDeadError("the server is shutting down"))

    def _take_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "stop":
            self._stopping = True
        elif kind == "add":
            _, rid, prompt, ids, params, stream = cmd
            try:
                self.engine.add_request(prompt, ids, params, request_id=rid)
            except Exception as e:
                _send(stream, e)
                return
            self._streams[rid] = stream
        elif kind == "abort":
            out = self.engine.abort_request(cmd[1])
            if out is not None:
                self._deliver(out, time.time())

    def _deliver(self, out: RequestOutput, now: float) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        seen = max((len(c.token_ids) for c in out.outputs), default=0)
        if stream.delta:
            seen += stream.tokens_seen
        if seen > stream.tokens_seen:
            if stream.tokens_seen == 0:
                self.ttft.observe(now - stream.arrival)
            else:
                gap = (now - stream.last_token_time) / (seen - stream.tokens_seen)
                for _ in range(seen - stream.tokens_seen):
                    self.itl.observe(gap)
            stream.tokens_seen = seen
            stream.last_token_time = now
        if out.finished:
            del self._streams[out.request_id]
            reasons = {c.finish_reason for c in out.outputs}
            reason = (
                "abort" if "abort" in reasons else ("length" if "length" in reasons else "stop")
            )
            self._finished[reason] = self._finished.get(reason, 0) + 1
        _send(stream, out)

    def _fail_all(self, error: BaseException) -> None:
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:  # pragma: no cover - keep failing the others
                logger.exception("abort of request %s failed", rid)
            _send(stream, error)
            self._finished["error"] = self._finished.get("error", 0) + 1
        self._streams.clear()

    def _publish_stats(self) -> None:
        e = self.engine
        pool = e.kv.pool.stats()
        running, waiting = e.scheduler.num_requests()
        snaps = e.states.stats if e.states is not None else {}
        self.stats = EngineStats(
            running=running,
            waiting=waiting,
            prompt_tokens=e.stats["prompt_tokens"],
            generation_tokens=e.stats["generation_tokens"],
            steps=e.stats["steps"],
            num_blocks=e.kv.pool.num_blocks,
            free_blocks=pool["free_blocks"],
            cached_blocks=pool["cached_blocks"],
            prefix_hits=pool["hits"],
            prefix_queries=pool["queries"],
            evictions=pool["evictions"],
            state_snapshot_queries=snaps.get("queries", 0),
            state_snapshot_hits=snaps.get("hits", 0),
            state_snapshot_hit_tokens=snaps.get("hit_tokens", 0),
            state_snapshots_saved=snaps.get("saved", 0),
            finished=dict(self._finished),
        )


def _send(stream: _Stream, item: Any) -> None:
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:  # the event loop has closed
        pass

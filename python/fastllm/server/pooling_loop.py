"""AsyncPooling: one thread owns the (synchronous, not thread-safe)
PoolingEngine; asyncio handlers submit jobs on a thread-safe queue, and the
jobs that arrive while a batch runs are merged into the next engine call."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastllm.server.engine_loop import EngineDeadError, Histogram

if TYPE_CHECKING:  # pragma: no cover
    from fastllm.pooling.engine import PoolingEngine
    from fastllm.pooling.params import PoolingParams

logger = logging.getLogger("fastllm.server")

# The most inputs merged into one engine call (a larger single job still runs whole).
MAX_MERGED_INPUTS = 256
# Request latency buckets (seconds) of /metrics.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
KINDS = ("embed", "score", "classify")


@dataclass
class _Job:
    """One request's call: ``embed``/``classify``: (prompts, params);
    ``score``: (data_1, data_2, params)."""

    kind: str
    args: tuple
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    arrival: float

    @property
    def size(self) -> int:
        return len(self.args[0]) if self.kind != "score" else 1


@dataclass
class PoolingStats:
    """What /metrics shows, updated by the worker thread."""

    running: int = 0
    waiting: int = 0
    prompt_tokens: int = 0
    engine_calls: int = 0
    requests: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    errors: int = 0


class AsyncPooling:
    """Serves many concurrent asyncio callers from one pooling-engine thread."""

    def __init__(self, engine: PoolingEngine) -> None:
        self.engine = engine
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.stats = PoolingStats()
        self.latency = Histogram(LATENCY_BUCKETS)

    # ---- life -----------------------------------------------------------

    def start(self) -> None:
        """Starts the worker thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fastllm-pooling", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the worker thread; jobs not yet run fail with EngineDeadError."""
        self._stopping = True
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        """Whether the worker thread is running."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- the asyncio side -----------------------------------------------

    async def embed(self, prompts: list[Any], params: PoolingParams) -> list[Any]:
        """``PoolingEngine.embed(prompts, params)`` on the worker thread."""
        return await self._submit("embed", (prompts, params))

    async def classify(self, prompts: list[Any], params: PoolingParams) -> list[Any]:
        """``PoolingEngine.classify(prompts, params)`` on the worker thread."""
        return await self._submit("classify", (prompts, params))

    async def score(
        self, data_1: str | list[str], data_2: str | list[str], params: PoolingParams
    ) -> list[Any]:
        """``PoolingEngine.score(data_1, data_2, params)`` on the worker thread."""
        return await self._submit("score", (data_1, data_2, params))

    async def _submit(self, kind: str, args: tuple) -> list[Any]:
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        loop = asyncio.get_running_loop()
        job = _Job(kind, args, loop, loop.create_future(), time.time())
        self._jobs.put(job)
        # a cancelled caller (client gone) leaves the future cancelled: the
        # worker skips the job if it has not started it yet
        return await job.future

    # ---- the worker thread ----------------------------------------------

    def _run(self) -> None:
        pending: list[_Job] = []
        try:
            while not self._stopping:
                if not pending:
                    job = self._jobs.get()
                    if job is None:
                        break
                    pending.append(job)
                self._drain(pending)
                if self._stopping:
                    break
                pending = [j for j in pending if not j.future.cancelled()]
                if not pending:
                    continue
                batch, pending = _next_batch(pending)
                self.stats.waiting = len(pending)
                self.stats.running = len(batch)
                self._execute(batch)
                self.stats.running = 0
        except BaseException as e:  # pragma: no cover - a bug in the loop itself
            self.error = e
            logger.exception("the pooling thread died")
        finally:
            self._drain(pending)
            for job in pending:
                _resolve(job, EngineDeadError("the server is shutting down"))

    def _drain(self, pending: list[_Job]) -> None:
        """Moves every queued job to ``pending`` (a stop marker sets ``_stopping``)."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:
                self._stopping = True
            else:
                pending.append(job)

    def _execute(self, batch: list[_Job]) -> None:
        """Runs the batch as one engine call; when that call refuses an input
        (ValueError), each job runs alone so its own error names its own input."""
        if len(batch) > 1:
            try:
                results = self._call(batch[0].kind, _merged_args(batch))
            except ValueError:
                for job in batch:
                    self._execute([job])
                return
            except Exception as e:
                logger.exception("pooling call failed")
                for job in batch:
                    self._finish(job, e)
                return
            start = 0
            for job in batch:
                self._finish(job, results[start : start + job.size])
                start += job.size
            return
        job = batch[0]
        try:
            result: Any = self._call(job.kind, job.args)
        except Exception as e:
            if not isinstance(e, ValueError):
                logger.exception("pooling call failed")
            result = e
        self._finish(job, result)

    def _call(self, kind: str, args: tuple) -> list[Any]:
        self.stats.engine_calls += 1
        return getattr(self.engine, kind)(*args)

    def _finish(self, job: _Job, result: Any) -> None:
        if isinstance(result, BaseException):
            self.stats.errors += 1
        else:
            self.stats.requests[job.kind] += 1
            self.stats.prompt_tokens += sum(len(o.prompt_token_ids) for o in result)
        self.latency.observe(time.time() - job.arrival)
        _resolve(job, result)


def _next_batch(pending: list[_Job]) -> tuple[list[_Job], list[_Job]]:
    """The first job and the later ones that can share its engine call (the
    same kind, not ``score``), within MAX_MERGED_INPUTS; and the jobs left."""
    first = pending[0]
    batch, rest = [first], []
    total = first.size
    for job in pending[1:]:
        same = job.kind == first.kind and first.kind != "score"
        if same and total + job.size <= MAX_MERGED_INPUTS:
            batch.append(job)
            total += job.size
        else:
            rest.append(job)
    return batch, rest


def _merged_args(batch: list[_Job]) -> tuple:
    """One engine call's arguments for several ``embed`` or ``classify`` jobs:
    the prompts joined, and one PoolingParams per prompt."""
    prompts = [p for job in batch for p in job.args[0]]
    return prompts, [job.args[1] for job in batch for _ in job.args[0]]


def _resolve(job: _Job, result: Any) -> None:
    """Hands the result (or exception) to the job's waiting coroutine."""

    def settle() -> None:
        if job.future.done():  # cancelled: the client left
            return
        if isinstance(result, BaseException):
            job.future.set_exception(result)
        else:
            job.future.set_result(result)

    try:
        job.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the event loop has closed
        pass

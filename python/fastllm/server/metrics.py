"""``/metrics``: the engine's counters and histograms in Prometheus' text format."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from fastllm.server.engine_loop import AsyncEngine, Histogram
from fastllm.server.pooling_loop import AsyncPooling

if TYPE_CHECKING:  # pragma: no cover
    from fastllm.server.context import RouteContext


def register(app: FastAPI, ctx: RouteContext) -> None:
    """Adds ``/metrics`` to ``app``."""

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        name = ctx.state.model_names[0]
        if ctx.pooling is not None:
            text = pooling_prometheus(ctx.pooling, name)
        else:
            text = prometheus(ctx.engine, name)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def prometheus(engine: AsyncEngine, model: str, replica: str | None = None) -> str:
    """The /metrics page in Prometheus' text format; with ``replica`` (a Ray
    Serve replica's id) every sample also carries a ``replica`` label."""
    s = engine.stats
    label = f'model_name="{_escape(model)}"'
    if replica is not None:
        label += f',replica="{_escape(replica)}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, value: float, extra: str = "") -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        labels = f"{label},{extra}" if extra else label
        lines.append(f"{name}{{{labels}}} {_num(value)}")

    metric("fastllm_num_requests_running", "gauge", "Requests in the running batch.", s.running)
    metric("fastllm_num_requests_waiting", "gauge", "Requests waiting to run.", s.waiting)
    metric("fastllm_prompt_tokens_total", "counter", "Prompt tokens computed.", s.prompt_tokens)
    metric(
        "fastllm_generation_tokens_total",
        "counter",
        "Tokens generated.",
        s.generation_tokens,
    )
    metric("fastllm_engine_steps_total", "counter", "Engine steps run.", s.steps)
    metric("fastllm_kv_blocks_total", "gauge", "KV-cache blocks in the pool.", s.num_blocks)
    metric(
        "fastllm_kv_blocks_free",
        "gauge",
        "KV-cache blocks that can be handed out (free or evictable cached).",
        s.free_blocks,
    )
    metric(
        "fastllm_kv_blocks_used",
        "gauge",
        "KV-cache blocks held by requests.",
        s.num_blocks - s.free_blocks,
    )
    metric(
        "fastllm_kv_blocks_cached",
        "gauge",
        "KV-cache blocks holding prefix-cache content.",
        s.cached_blocks,
    )
    usage = (s.num_blocks - s.free_blocks) / s.num_blocks if s.num_blocks else 0.0
    metric("fastllm_kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use.", usage)
    metric(
        "fastllm_prefix_cache_queries_total",
        "counter",
        "Full prompt blocks looked up in the prefix cache.",
        s.prefix_queries,
    )
    metric(
        "fastllm_prefix_cache_hits_total",
        "counter",
        "Prompt blocks found in the prefix cache.",
        s.prefix_hits,
    )
    rate = s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0
    metric("fastllm_prefix_cache_hit_rate", "gauge", "Prefix-cache hits per query.", rate)
    metric(
        "fastllm_prefix_cache_evictions_total",
        "counter",
        "Cached blocks evicted.",
        s.evictions,
    )
    metric(
        "fastllm_state_snapshot_queries_total",
        "counter",
        "Hybrid models: prefix-cache lookups of a recurrent-state snapshot.",
        s.state_snapshot_queries,
    )
    metric(
        "fastllm_state_snapshot_hits_total",
        "counter",
        "Hybrid models: requests resumed from a recurrent-state snapshot.",
        s.state_snapshot_hits,
    )
    metric(
        "fastllm_state_snapshot_hit_tokens_total",
        "counter",
        "Hybrid models: prompt tokens not recomputed thanks to state snapshots.",
        s.state_snapshot_hit_tokens,
    )
    metric(
        "fastllm_state_snapshots_saved_total",
        "counter",
        "Hybrid models: recurrent-state snapshots taken.",
        s.state_snapshots_saved,
    )
    name = "fastllm_request_finished_total"
    lines.append(f"# HELP {name} Requests finished, by reason (stop, length, abort, error).")
    lines.append(f"# TYPE {name} counter")
    for reason in ("stop", "length", "abort", "error"):
        lines.append(f'{name}{{{label},finished_reason="{reason}"}} {s.finished.get(reason, 0)}')
    _histogram(
        lines,
        "fastllm_time_to_first_token_seconds",
        "Seconds from arrival to the first generated token.",
        engine.ttft,
        label,
    )
    _histogram(
        lines,
        "fastllm_inter_token_latency_seconds",
        "Seconds between successive generated tokens of a request.",
        engine.itl,
        label,
    )
    return "\n".join(lines) + "\n"


def pooling_prometheus(pool: AsyncPooling, model: str) -> str:
    """The /metrics page of a pooling server: requests by kind, prompt tokens,
    engine calls (merged batches) and request latency."""
    s = pool.stats
    label = f'model_name="{_escape(model)}"'
    lines: list[str] = []
    for name, kind, help_, value in (
        ("fastllm_num_requests_running", "gauge", "Requests in the running batch.", s.running),
        ("fastllm_num_requests_waiting", "gauge", "Requests waiting to run.", s.waiting),
        ("fastllm_prompt_tokens_total", "counter", "Input tokens pooled.", s.prompt_tokens),
        ("fastllm_pooling_batches_total", "counter", "Pooling engine calls.", s.engine_calls),
        ("fastllm_request_errors_total", "counter", "Requests that failed.", s.errors),
    ):
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{{{label}}} {value}"]
    name = "fastllm_pooling_requests_total"
    lines.append(f"# HELP {name} Pooling requests served, by kind (embed, score, classify).")
    lines.append(f"# TYPE {name} counter")
    for kind, count in s.requests.items():
        lines.append(f'{name}{{{label},kind="{kind}"}} {count}')
    _histogram(
        lines,
        "fastllm_request_latency_seconds",
        "Seconds from arrival to the result of a pooling request.",
        pool.latency,
        label,
    )
    return "\n".join(lines) + "\n"


def _histogram(lines: list[str], name: str, help_: str, h: Histogram, label: str) -> None:
    buckets, total, count = h.snapshot()
    lines.append(f"# HELP {name} {help_}")
    lines.append(f"# TYPE {name} histogram")
    for le, c in buckets:
        lines.append(f'{name}_bucket{{{label},le="{le}"}} {c}')
    lines.append(f"{name}_sum{{{label}}} {_num(total)}")
    lines.append(f"{name}_count{{{label}}} {count}")


def _num(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    return repr(float(v))


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

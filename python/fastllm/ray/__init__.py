"""fastllm replicas on Ray: offline jobs on Ray Data, serving on Ray Serve.

Each replica is a whole fastllm engine in its own Ray actor, with its own
device probe and thread count; Ray does the placement, the concurrency, the
retries and the replacement of dead replicas. ``import fastllm`` never imports
Ray; this package needs the ``ray`` extra (``pip install "fastllm[ray]"``).

- ``LLMPredictor``: the callable class for ``Dataset.map_batches``.
- ``generate(dataset, model=..., ...)``: the one-call offline job.
- ``build_app(...)`` / ``run(...)``: the Ray Serve deployment of the
  OpenAI-compatible server (``fastllm serve MODEL --replicas N``).
"""

from __future__ import annotations

from typing import Any

from fastllm.lazy import lazy_attribute

INSTALL_HINT = 'fastllm.ray needs Ray: pip install "fastllm[ray]"'


def require_ray() -> Any:
    """Imports and returns the ``ray`` module, or raises an ImportError that
    says how to install it."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return ray


require_ray()

_LAZY = {
    "LLMPredictor": "fastllm.ray.data",
    "generate": "fastllm.ray.data",
    "OUTPUT_COLUMNS": "fastllm.ray.data",
    "build_app": "fastllm.ray.serve",
    "run": "fastllm.ray.serve",
}

__all__ = sorted([*_LAZY, "require_ray", "INSTALL_HINT"])


def __getattr__(name: str) -> Any:
    return lazy_attribute("fastllm.ray", _LAZY, globals(), name)

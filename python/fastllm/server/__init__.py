"""fastllm.server: the OpenAI-compatible HTTP server (``fastllm serve``).

``create_app(EngineConfig(...))`` returns the FastAPI app; ``serve(...)`` runs it
with uvicorn. FastAPI is imported only when this package's names are used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from fastllm.server.app import create_app, serve

__all__ = ["create_app", "serve"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from fastllm.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'fastllm.server' has no attribute {name!r}")

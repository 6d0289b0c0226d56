"""fastllm's log lines on stderr by default, as vLLM's are.

The engine says what it chose (device, dtype, KV-cache size, packing) at INFO.
``configure_logging`` gives the ``fastllm`` logger a stderr handler unless the
program has set logging up itself (a handler on ``fastllm`` or the root
logger), so those lines are seen in a script or a notebook without any setup.
``FASTLLM_LOGGING_LEVEL`` (default ``INFO``) sets the level, and
``FASTLLM_CONFIGURE_LOGGING=0`` leaves logging entirely to the program.
"""

from __future__ import annotations

import logging
import sys

from fastllm import envs

LEVELS = {
    "critical": logging.CRITICAL,
    "error": logging.ERROR,
    "warning": logging.WARNING,
    "info": logging.INFO,
    "debug": logging.DEBUG,
    "trace": logging.DEBUG,
}


_configured = False


def configure_logging(level: str | None = None) -> None:
    """Sets the ``fastllm`` logger up: once from the environment (later calls
    without ``level`` change nothing), or at ``level`` whenever one is given
    (the server's ``--log-level``)."""
    global _configured
    if envs.off("FASTLLM_CONFIGURE_LOGGING"):
        return
    if _configured and level is None:
        return
    _configured = True
    log = logging.getLogger("fastllm")
    name = (level or envs.get("FASTLLM_LOGGING_LEVEL") or "info").strip().lower()
    log.setLevel(LEVELS.get(name, logging.INFO))
    if not log.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s fastllm: %(message)s"))
        log.addHandler(handler)

"""Prefix-aware routing of Serve requests to the engine replica whose prefix
cache already holds their prompt's start.

The router deployment (``serve.py``) tokenizes each completion or chat request
as the replicas do, hashes the prompt's first full KV blocks into a routing
key (``prefix_key``) and hands it to the engine deployment's handle; Ray
Serve then asks ``PrefixAffinityRouter.choose_replicas`` (Serve's request
router extension point; ``fastllm.ray.router``) where to send it. The choice (``choose``):

- the replica ranked first for the key by rendezvous hashing over the live
  replicas (``rendezvous_order``): every router picks the same one without
  sharing state, distinct keys spread evenly, and a replica that leaves only
  moves the keys it held;
- unless it is busy: its in-flight requests exceed the least-loaded replica's
  by more than ``busy_margin``; then the least-loaded one (ties broken by the
  key's rendezvous order, so a hot prefix spills to the same second replica);
- requests without a key (no full block, other routes, unparsable bodies) go
  to the least-loaded replica.

"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from collections.abc import Mapping, Sequence
from typing import Any

# Keyword arguments of the engine deployment's methods that the router reads.
ROUTING_KEY = "fastllm_prefix_key"  # the prompt's prefix hash (or None)
PIN_KEY = "fastllm_replica"  # a replica's unique id: send there and nowhere else

DEFAULT_ROUTING_BLOCKS = 4
DEFAULT_BUSY_MARGIN = 4


def prefix_key(token_ids: Sequence[int], block_size: int, max_blocks: int) -> str | None:
    """The routing key of a prompt: a hash of its first full KV blocks, at
    most ``max_blocks`` of them; None when it has no full block.

    A block counts as the engine's prefix cache counts it: the prompt's last
    token is always computed, so only the blocks before it can be cache hits
    (``(len - 1) // block_size`` of them). The key hashes the tokens of those
    blocks: two prompts share it when they share those tokens.
    """
    if block_size < 1 or max_blocks < 1:
        return None
    full = min((len(token_ids) - 1) // block_size, max_blocks)
    if full <= 0:
        return None
    n = full * block_size
    data = struct.pack(f"<{n}q", *token_ids[:n])
    return hashlib.blake2b(data, digest_size=16, person=b"fastllm-prefix").hexdigest()


def _score(key: str, replica: str) -> int:
    h = hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8, person=b"fastllm-hrw")
    return int.from_bytes(h.digest(), "big")


def rendezvous_order(key: str, replicas: Sequence[str]) -> list[str]:
    """``replicas`` ranked for ``key`` by rendezvous (highest random weight)
    hashing: the first is the key's home. Removing a replica leaves the
    relative order of the others unchanged."""
    return sorted(replicas, key=lambda r: (_score(key, r), r), reverse=True)


def choose(key: str | None, loads: Mapping[str, int], busy_margin: int) -> tuple[list[str], str]:
    """The replicas (ids, the keys of ``loads``: in-flight requests of each)
    in the order to try them, and why the first comes first: ``"home"`` (the
    key's rendezvous home), ``"busy"`` (the home had more than ``busy_margin``
    requests over the least-loaded replica, which comes first instead) or
    ``"unkeyed"`` (no key: least-loaded first)."""
    if not loads:
        return [], "unkeyed"
    if key is None:
        return sorted(loads, key=lambda r: (loads[r], r)), "unkeyed"
    order = rendezvous_order(key, list(loads))
    least = min(loads.values())
    if loads[order[0]] <= least + busy_margin:
        return order, "home"
    rank = {r: i for i, r in enumerate(order)}
    return sorted(order, key=lambda r: (loads[r], rank[r])), "busy"


def routing_token_ids(
    path: str, body: bytes, tokenizer: Any, chat_template: str | None
) -> list[int] | None:
    """The prompt token ids a replica would compute for this request (the
    first prompt of a completions request; the rendered conversation of a
    chat request), or None when the request is not one of those or cannot be
    read (the replica then answers it, with its own errors)."""
    from pydantic import ValidationError

    from fastllm.inputs import parse_prompt
    from fastllm.server.protocol import ChatCompletionRequest, CompletionRequest

    if tokenizer is None:
        return None
    try:
        data = json.loads(body)
        if not isinstance(data, dict):
            return None
        if path == "/v1/completions":
            prompts = CompletionRequest.model_validate(data).prompts()
            if not prompts:
                return None
            return parse_prompt(prompts[0], tokenizer.encode, "prompt")[1]
        if path == "/v1/chat/completions":
            req = ChatCompletionRequest.model_validate(data)
            template = req.chat_template or chat_template or tokenizer.chat_template
            if template is None:
                return None
            return req.prompt(tokenizer, template)[1]
    except (ValueError, TypeError, ValidationError, UnicodeDecodeError):
        return None
    except Exception:  # a template that raises: the replica reports it
        return None
    return None


# ---- live replicas, as this process's routers see them --------------------------

_live_lock = threading.Lock()
_live: dict[tuple[str, str], list[str]] = {}


def live_replicas(app_name: str, deployment: str) -> list[str]:
    """Unique ids of the replicas of ``deployment`` that this process's
    router currently routes to (empty before its first update)."""
    with _live_lock:
        return list(_live.get((app_name, deployment), ()))


def _set_live(app_name: str, deployment: str, ids: list[str]) -> None:
    with _live_lock:
        _live[(app_name, deployment)] = sorted(ids)

"""The Ray Serve request router of fastllm's engine deployment.

Serve imports this module by name and ships it to every process holding a
handle of the deployment *by value* (its globals copied); so it keeps no
state of its own at module level and reaches shared state (the live-replica
registry) through ``fastllm.ray.routing``, which travels by reference.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from fastllm.ray import routing


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve request router of the engine deployment: each request to the
    replica its prefix key is homed on, unless that one is busy (see
    ``fastllm.ray.routing``). A request pinned with ``fastllm_replica`` goes to
    that replica only (the router deployment's ``/metrics`` asks each one).

    A replica's load is the larger of the requests this router has in flight
    there and the queue length Serve last cached for it."""

    def initialize_state(
        self, busy_margin: int = routing.DEFAULT_BUSY_MARGIN, **kwargs: Any
    ) -> None:
        if int(busy_margin) < 0:
            raise ValueError(f"busy_margin must not be negative, got {busy_margin}")
        self.busy_margin = int(busy_margin)

    def _load(self, r: RunningReplica) -> int:
        mine = len(self._inflight_ids().get(r.replica_id, ()))
        cached = self.replica_queue_len_cache.get(r.replica_id)
        return max(mine, cached or 0)

    def _inflight_ids(self) -> dict[ReplicaID, set[str]]:
        inflight = self.__dict__.get("_fastllm_inflight")
        if inflight is None:
            inflight = self.__dict__["_fastllm_inflight"] = {}
        return inflight

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        ids = {r.replica_id for r in replicas}
        inflight = self._inflight_ids()
        for gone in [r for r in inflight if r not in ids]:
            del inflight[gone]
        d = self._deployment_id
        routing._set_live(d.app_name, d.name, [r.replica_id.unique_id for r in replicas])

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        kwargs = pending_request.kwargs if pending_request is not None else {}
        if pending_request is not None:
            # the ranks below hold every candidate: when none of them can
            # take the request, Serve should wait before asking again
            pending_request.routing_context.should_backoff = True
        pin = kwargs.get(routing.PIN_KEY)
        if pin is not None:
            return [[by_id[pin]]] if pin in by_id else []
        loads = {uid: self._load(r) for uid, r in by_id.items()}
        order, _ = routing.choose(
            kwargs.get(routing.ROUTING_KEY),
            loads,
            getattr(self, "busy_margin", routing.DEFAULT_BUSY_MARGIN),
        )
        return [[by_id[uid]] for uid in order]

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        rid = pending_request.metadata.internal_request_id
        self._inflight_ids().setdefault(replica_id, set()).add(rid)

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        held = self._inflight_ids().get(replica_id)
        if held is not None:
            held.discard(internal_request_id)

"""`ReplicaSetClient`: the EngineClient over N data-parallel engine replicas (`-dp N`).

The frontend validates and builds requests once, as for one engine; the set sends each to the
replica `PrefixRouter` chooses (the one most likely to hold its prefix's KV, else the least
busy) and merges the replicas' outputs into the one stream per request. How a replica is
reached is its transport's business (`Replica`; on Ray: engine.ray_replicas).

A replica that dies does not take the server down:
- requests it had accepted but not started (no output came back yet) are sent again to a live
  replica: nothing the client could have seen is lost or repeated;
- requests it had started end with EngineDeadError (a stream mid-way cannot be replayed);
- it is restarted (the server's --max-engine-restarts within --engine-restart-window, per
  replica) while the others keep serving; runtime-loaded LoRA adapters are loaded into it again.
Only when no replica is left or coming back does the set die as one engine would (the server
then restarts it whole or exits).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import astuple, dataclass, field
from typing import Any, Protocol

from kestrel.engine.client import (
    EngineClient,
    EngineDeadError,
    EngineStats,
    LatencyListener,
    ReplicaStatus,
)
from kestrel.engine.engine import EngineLoad, RequestOutput
from kestrel.engine.process import EngineInfo
from kestrel.engine.request import Request
from kestrel.engine.router import PrefixRouter

log = logging.getLogger("kestrel.replicas")

# one replica's step: (its outputs, its load after the step, whether it stepped)
Step = tuple[list[RequestOutput], EngineLoad, bool]


class Replica(Protocol):
    """The transport to one engine replica. `outputs` raises once the replica is gone."""

    pid: int | None

    async def ready(self) -> EngineInfo: ...

    def add(self, requests: list[Request]) -> None: ...

    def abort(self, request_ids: list[str]) -> None: ...

    async def control(self, method: str, args: tuple) -> Any: ...

    async def outputs(self) -> list[Step]: ...

    def kill(self) -> None: ...


@dataclass
class _Slot:
    """One replica position: the replica now serving it and what was routed to it."""

    index: int
    replica: Replica | None
    status: str = "ok"  # ok | restarting | failed
    load: EngineLoad = field(default_factory=EngineLoad)
    requests: set[str] = field(default_factory=set)  # routed here, unfinished
    routed: int = 0
    restarts: deque[float] = field(default_factory=deque)  # monotonic times
    task: asyncio.Task | None = None


class ReplicaSetClient(EngineClient):
    """N replicas of one model behind one EngineClient. `spawn(index)` starts a fresh replica
    (a restart); `replicas` are the first N, already loaded (`info` from one of them)."""

    def __init__(
        self,
        replicas: list[Replica],
        spawn: Callable[[int], Replica],
        info: EngineInfo,
        tokenizer,
        processor=None,
        listener: LatencyListener | None = None,
        stats: EngineStats | None = None,
    ):
        super().__init__(info.intake(tokenizer), tokenizer, processor, listener, stats)
        self.replica_capacity = self.capacity  # each replica's scheduler bounds its own queue
        self.capacity *= len(replicas)
        self.adapters = dict(info.adapters)
        self.router = PrefixRouter(block_size=info.config.cache.block_size)
        self._spawn = spawn
        self._slots = [_Slot(i, replica) for i, replica in enumerate(replicas)]
        self._owner: dict[str, _Slot] = {}  # request id -> the slot running it
        self._unstarted: dict[str, Request] = {}  # sent, no output back yet: may be re-sent
        self._orphans: list[Request] = []  # waiting for a replica to come back
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        for slot in self._slots:
            self._attach(slot, slot.replica)

    def stop(self) -> None:
        for task in [*self._tasks, *(s.task for s in self._slots if s.task)]:
            task.cancel()
        for slot in self._slots:
            if slot.replica is not None:
                slot.replica.kill()

    def replica_status(self) -> list[ReplicaStatus]:
        return [
            ReplicaStatus(
                s.index,
                s.status,
                s.replica.pid if s.replica is not None and s.status == "ok" else None,
                len(s.requests),
                s.routed,
                len(s.restarts),
                s.load,
            )
            for s in self._slots
        ]

    # -- requests out ---------------------------------------------------------------------------

    def _send_add(self, requests: list[Request]) -> None:
        for request in requests:
            self._unstarted[request.request_id] = request
        self._place(requests)

    def _place(self, requests: list[Request]) -> None:
        """Route each request to a live replica (one add per replica), or keep it for the next
        replica to come back."""
        live = {s.index: s for s in self._slots if s.status == "ok"}
        batches: dict[int, list[Request]] = {}
        for request in requests:
            # a full replica would refuse it (503) while another has room
            room = {i: len(s.requests) for i, s in live.items()}
            room = {i: n for i, n in room.items() if n < self.replica_capacity} or room
            if not room:
                self._orphans.append(request)
                continue
            slot = live[self.router.route(request.prompt_ids, room)]
            slot.requests.add(request.request_id)
            slot.routed += 1
            self._owner[request.request_id] = slot
            batches.setdefault(slot.index, []).append(request)
        for index, batch in batches.items():
            live[index].replica.add(batch)

    def _send_abort(self, request_ids: list[str]) -> None:
        by_slot: dict[int, list[str]] = {}
        for request_id in request_ids:
            self._unstarted.pop(request_id, None)
            slot = self._owner.pop(request_id, None)
            if slot is not None:
                slot.requests.discard(request_id)
                by_slot.setdefault(slot.index, []).append(request_id)
        self._orphans = [r for r in self._orphans if r.request_id not in request_ids]
        for index, ids in by_slot.items():
            if self._slots[index].status == "ok":
                self._slots[index].replica.abort(ids)

    async def _control(self, method: str, *args) -> Any:
        """The same call on every live replica (LoRA adapters: each replica loads its own)."""
        live = [s.replica for s in self._slots if s.status == "ok"]
        results = await asyncio.gather(*(r.control(method, args) for r in live))
        return results[0] if results else None

    # -- outputs in -----------------------------------------------------------------------------

    def _attach(self, slot: _Slot, replica: Replica) -> None:
        slot.replica, slot.status = replica, "ok"
        slot.task = asyncio.get_running_loop().create_task(self._read(slot, replica))

    async def _read(self, slot: _Slot, replica: Replica) -> None:
        try:
            while True:
                for outputs, load, stepped in await replica.outputs():
                    self._from_replica(slot, outputs, load, stepped)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            self._replica_died(slot, replica, error)

    def _from_replica(
        self, slot: _Slot, outputs: list[RequestOutput], load: EngineLoad, stepped: bool
    ) -> None:
        slot.load = load
        for output in outputs:
            self._unstarted.pop(output.request_id, None)  # started: never sent again
            if output.finished and self._owner.get(output.request_id) is slot:
                del self._owner[output.request_id]
                slot.requests.discard(output.request_id)
        self._receive(outputs, self._total_load(), stepped)

    def _total_load(self) -> EngineLoad:
        loads = [astuple(s.load) for s in self._slots]
        return EngineLoad(*(sum(column) for column in zip(*loads, strict=True)))

    # -- a replica's death ----------------------------------------------------------------------

    def _replica_died(self, slot: _Slot, replica: Replica, error: BaseException) -> None:
        if slot.replica is not replica:
            return  # an old replica's reader, already replaced
        log.error("replica %d died: %r", slot.index, error)
        replica.kill()  # whatever is left of it (an engine loop that raised)
        slot.replica, slot.load = None, EngineLoad()
        slot.status = "restarting" if self._may_restart(slot) else "failed"
        self.router.forget(slot.index)
        ids, slot.requests = slot.requests, set()
        resend = [self._unstarted[i] for i in ids if i in self._unstarted]
        self._fail([i for i in ids if i not in self._unstarted], error)
        for request in resend:
            del self._owner[request.request_id]
        self._place(resend)
        if slot.status == "restarting":
            self._spawn_task(self._restart(slot))
        elif all(s.status == "failed" for s in self._slots):
            self._die(error)

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        """End started requests with EngineDeadError (their streams cannot be replayed)."""
        dead = EngineDeadError(f"the replica serving it stopped: {error!r}")
        outputs = [
            RequestOutput(i, finished=True, finish_reason="error", error=dead) for i in request_ids
        ]
        for request_id in request_ids:
            self._owner.pop(request_id, None)
        self._receive(outputs, self._total_load(), False)

    def _may_restart(self, slot: _Slot) -> bool:
        """Restarts are on and this replica had fewer than the limit within the window."""
        server = self.intake.config.server
        if not server.restart_engine:
            return False
        now = time.monotonic()
        while slot.restarts and now - slot.restarts[0] > server.engine_restart_window:
            slot.restarts.popleft()
        return len(slot.restarts) < server.max_engine_restarts

    async def _restart(self, slot: _Slot) -> None:
        slot.restarts.append(time.monotonic())
        replica = None
        try:
            replica = await asyncio.to_thread(self._spawn, slot.index)
            await self._reload_adapters(replica, await replica.ready())
        except Exception as error:
            log.exception("replica %d failed to restart", slot.index)
            if replica is not None:
                replica.kill()
            slot.status = "failed"
            if all(s.status == "failed" for s in self._slots):
                self._die(error)
            return
        self._attach(slot, replica)
        log.info("replica %d is back (pid %s)", slot.index, replica.pid)
        orphans, self._orphans = self._orphans, []
        self._place(orphans)

    async def _reload_adapters(self, replica: Replica, info: EngineInfo) -> None:
        """The adapters loaded at runtime (POST /v1/load_lora_adapter) into a fresh replica."""
        for name, path in self.adapters.items():
            if info.adapters.get(name) != path:
                await replica.control("load_lora", (name, path))

    def _spawn_task(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

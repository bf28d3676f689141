"""Data-parallel engine replicas as Ray actors (`kestrel serve -dp N [--ray-address ADDR]`).

Each replica is one `EngineActor`: an Engine in a Ray worker process of its own, with
`num_gpus` = its -tp x -pp ranks (Ray gives it those GPUs through CUDA_VISIBLE_DEVICES), or a
CPU replica where the cluster has no GPUs or --device cpu is asked. The HTTP frontend stays this
process's FastAPI app and reaches the replicas through `ReplicaSetClient` (engine.replicas).

Ray core actors, not Ray Serve: kestrel already has its one OpenAI endpoint, with its own
admission control, streaming and errors; Serve would put a second HTTP layer and its own
router in front of it. Ray here only places processes on GPUs and machines and carries Python
objects between them.

Replicas are restarted by the frontend, not by Ray's `max_restarts`: the frontend must know a
replica died to re-send the requests it had not started, and a fresh actor is simpler than a
revived one whose state is gone.

The actor steps its Engine on a thread of its own; the frontend long-polls `outputs()` (one
call in flight per replica), which returns every step finished since the last poll, so a busy
engine's steps cross in batches. ray is imported only here: it is an optional dependency
(`pip install 'kestrel[dp]'`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kestrel.config import Config, ParallelConfig
from kestrel.engine.client import EngineStats, LatencyListener
from kestrel.engine.engine import Engine
from kestrel.engine.process import (
    CONTROLS,
    EngineError,
    EngineInfo,
    EngineProcessError,
    portable_output,
    run_control,
)
from kestrel.engine.replicas import ReplicaSetClient, Step
from kestrel.engine.request import Request
from kestrel.errors import KestrelError

log = logging.getLogger("kestrel.ray_replicas")
POLL_S = 1.0  # the longest an idle replica holds a poll (then it answers with nothing)
MAX_CALLS = 8  # concurrent calls an actor serves: the poll, adds, aborts, controls


def require_ray():
    """The ray module, or a KestrelError naming the flag that needs it."""
    try:
        import ray
    except ImportError as error:
        raise KestrelError(
            "-dp/--data-parallel-size runs its replicas on Ray, which is not installed: "
            "pip install 'kestrel[dp]'"
        ) from error
    return ray


class EngineActor:
    """An Engine in a Ray actor, stepped on its own thread (the Engine is not thread-safe: Ray's
    call threads only queue commands for it)."""

    def __init__(self, build: Callable[[], Engine]):
        self.engine = build()
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._outbox: list[tuple] = []
        self._posted = threading.Condition()
        # a threaded actor may run an abort before the add it follows: remember the ids
        self._early_aborts: OrderedDict[str, None] = OrderedDict()
        threading.Thread(target=self._run, name="kestrel-engine", daemon=True).start()

    def info(self) -> tuple[EngineInfo, int]:
        return EngineInfo.of(self.engine), os.getpid()

    def add(self, requests: list[Request]) -> None:
        self._submit(lambda: self._add(requests))

    def abort(self, request_ids: list[str]) -> None:
        self._submit(lambda: self._abort(request_ids))

    def control(self, method: str, args: tuple) -> tuple[Any, BaseException | None]:
        """(result, error) of Engine.<method>(*args), run between steps."""
        if method not in CONTROLS:
            return None, EngineError(f"unknown control {method!r}")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(lambda: done.set_result(run_control(self.engine, 0, method, args)[1:]))
        return done.result()

    def outputs(self) -> list[tuple]:
        """Every ("step", outputs, load, stepped) or ("dead", error) posted since the last call;
        waits up to POLL_S for one."""
        with self._posted:
            self._posted.wait_for(lambda: self._outbox, POLL_S)
            items, self._outbox = self._outbox, []
        return items

    # -- the engine thread ----------------------------------------------------------------------

    def _add(self, requests: list[Request]) -> None:
        failed = self.engine.add_all([r for r in requests if not self._aborted(r.request_id)])
        if failed:
            self._post("step", [portable_output(o) for o in failed], self.engine.snapshot(), False)

    def _aborted(self, request_id: str) -> bool:
        """Whether the request's abort came first (it is then never run)."""
        return self._early_aborts.pop(request_id, False) is None

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if not self.engine.abort(request_id):
                self._early_aborts[request_id] = None
        while len(self._early_aborts) > 4096:  # ids of requests that had finished meanwhile
            self._early_aborts.popitem(last=False)

    def _submit(self, command: Callable[[], None]) -> None:
        self._inbox.put(command)
        self._wakeup.set()

    def _post(self, *item) -> None:
        with self._posted:
            self._outbox.append(item)
            self._posted.notify()

    def _run(self) -> None:
        sent = None  # the load last posted: an idle engine posts a changed one once
        try:
            while True:
                while not self._inbox.empty():
                    self._inbox.get_nowait()()
                if self.engine.has_unfinished():
                    outputs = [portable_output(o) for o in self.engine.step()]
                    sent = self.engine.snapshot()
                    self._post("step", outputs, sent, True)
                    continue
                if self.engine.snapshot() != sent:
                    sent = self.engine.snapshot()
                    self._post("step", [], sent, False)
                self._wakeup.wait()
                self._wakeup.clear()
        except BaseException as error:
            log.critical("the engine loop died: %r", error, exc_info=error)
            self._post("dead", EngineError(f"{type(error).__name__}: {error}"))


class RayReplica:
    """The frontend's handle on one EngineActor (the `Replica` transport)."""

    def __init__(self, actor):
        self.actor = actor
        self.pid: int | None = None
        self._info = actor.info.remote()

    def wait_ready(self) -> EngineInfo:
        """Blocking: the replica's engine is loaded (raises if it failed to load)."""
        info, self.pid = require_ray().get(self._info)
        return info

    async def ready(self) -> EngineInfo:
        info, self.pid = await self._info
        return info

    def add(self, requests: list[Request]) -> None:
        self.actor.add.remote(requests)

    def abort(self, request_ids: list[str]) -> None:
        self.actor.abort.remote(request_ids)

    async def control(self, method: str, args: tuple) -> Any:
        result, error = await self.actor.control.remote(method, args)
        if error is not None:
            raise error
        return result

    async def outputs(self) -> list[Step]:
        steps = []
        for kind, *payload in await self.actor.outputs.remote():
            if kind == "dead":
                raise EngineProcessError(f"the engine loop died: {payload[0]}") from payload[0]
            steps.append(tuple(payload))
        return steps

    def kill(self) -> None:
        require_ray().kill(self.actor, no_restart=True)


def load_replicas(
    config: Config,
    build: Callable[[], Engine],
    tokenizer,
    processor=None,
    listener: LatencyListener | None = None,
    stats: EngineStats | None = None,
) -> ReplicaSetClient:
    """Join (--ray-address) or start a Ray cluster, start -dp replicas and wait until every one
    has loaded (blocking: the server runs this off the event loop)."""
    ray = require_ray()
    _init(ray, config.parallel)
    actor = ray.remote(EngineActor).options(**_placement(ray, config), max_concurrency=MAX_CALLS)

    def spawn(index: int) -> RayReplica:
        return RayReplica(actor.remote(build))

    size = config.parallel.data_parallel_size
    replicas = [spawn(i) for i in range(size)]
    try:
        infos = [replica.wait_ready() for replica in replicas]
    except Exception as error:
        for replica in replicas:
            replica.kill()
        raise EngineProcessError(f"a replica failed to load: {error}") from error
    log.info("%d replicas ready (pids %s)", size, [r.pid for r in replicas])
    return ReplicaSetClient(replicas, spawn, infos[0], tokenizer, processor, listener, stats)


def _init(ray, parallel: ParallelConfig) -> None:
    if ray.is_initialized():
        return  # the server restarts a replica set that died whole: same cluster
    if parallel.ray_address:
        ray.init(address=parallel.ray_address, include_dashboard=False)
        return
    # a local cluster: room for every CPU replica's threads, so that none waits for a place
    wanted = parallel.data_parallel_size * max(parallel.threads, 1)
    ray.init(num_cpus=max(os.cpu_count() or 1, wanted), include_dashboard=False)


def _placement(ray, config: Config) -> dict:
    """The resources one replica asks of Ray: its ranks' GPUs, or CPU threads."""
    parallel = config.parallel
    device = config.model.device
    gpus = ray.cluster_resources().get("GPU", 0)
    on_gpu = device.startswith("cuda") or (device == "auto" and gpus > 0)
    if not on_gpu:
        return {"num_cpus": max(parallel.threads, 1), "num_gpus": 0}
    needed = parallel.data_parallel_size * parallel.ranks
    if needed > gpus:
        raise KestrelError(
            f"-dp {parallel.data_parallel_size} replicas of {parallel.ranks} GPU(s) each need "
            f"{needed} GPUs; the Ray cluster has {gpus:g}"
        )
    return {"num_cpus": 1, "num_gpus": parallel.ranks}

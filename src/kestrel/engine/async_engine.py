"""The engine for the server: one thread owns the Engine; each request gets an async stream.

The Engine is not thread-safe, so a single engine thread runs it: it drains an inbox of commands
(add, abort, call) between steps, runs `Engine.step()`, and hands each step's outputs to the event
loop in one `call_soon_threadsafe`. An abort therefore takes effect before the next step.

If the loop itself raises (a bug, not one request's fault: the runner already isolates those), the
engine is dead: every open stream gets the error, new requests fail at once with EngineDeadError,
and `on_death` runs so the server can turn unhealthy and exit. Never alive-but-dead.

The server hands it an `engine.process.EngineProcess` instead of an Engine: the same interface
over a pipe to an Engine in a child process, so this thread only relays (tests drive an Engine
in-process).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kestrel.engine.engine import Engine, EngineLoad, RequestOutput
from kestrel.engine.scheduler import QueueFullError
from kestrel.errors import InvalidRequestError
from kestrel.sampling import SamplingParams

log = logging.getLogger("kestrel.async_engine")


class EngineDeadError(RuntimeError):
    """The engine loop stopped; the server answers 503 and (by default) exits."""


class OverloadedError(QueueFullError):
    """Every running slot and queue place is taken; the server answers 503 with Retry-After."""


@dataclass
class EngineStats:
    """A snapshot the engine thread publishes after every step (read by /metrics, tests)."""

    load: EngineLoad = field(default_factory=EngineLoad)  # what the engine holds now
    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish_reason -> count


class LatencyListener:
    """Receives per-token timings from the engine thread; the server's metrics implement it."""

    def first_token(self, seconds: float) -> None: ...

    def token_gap(self, seconds: float) -> None: ...


@dataclass
class GenerateRequest:
    """One engine request: n choices of one prompt are n of these."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_kv_size: int | None = None


class OutputStream:
    """The outputs of a group of engine requests (the n choices, the prompts of one HTTP request),
    each request's in order; iteration ends when every request has its finished output."""

    def __init__(self, request_ids: list[str]):
        self.request_ids = request_ids
        self.unfinished = set(request_ids)
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while self.unfinished:
            output = await self.queue.get()
            if output.finished:
                self.unfinished.discard(output.request_id)
            yield output


@dataclass
class _Timing:
    arrival: float
    last_token: float | None = None


class AsyncEngine:
    """Runs an Engine on its own thread; add requests and read their outputs from asyncio."""

    def __init__(self, engine: Engine, listener: LatencyListener | None = None):
        self.engine = engine
        self.listener = listener or LatencyListener()
        self.stats = EngineStats()
        self.on_death: Callable[[BaseException], None] | None = None
        self.dead: BaseException | None = None
        # admission control: at most this many unfinished requests. New requests wait in the
        # scheduler's queue until its next step, so its bound is the whole capacity (the server
        # sizes it as --parallel + --max-queue-depth).
        self.capacity = engine.config.scheduler.max_queue_depth
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, OutputStream] = {}
        self._pending: set[asyncio.Future] = set()  # call() futures the engine thread owes
        self._timing: dict[str, _Timing] = {}  # engine thread only
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        # an engine in another process (engine.process) sets its own event when a step arrives
        self._wakeup = getattr(engine, "wakeup", None) or threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- event-loop side ------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kestrel-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
        close = getattr(self.engine, "close", None)
        if close is not None:  # an engine process ends with its server
            close()

    @property
    def num_unfinished(self) -> int:
        """Requests accepted and not yet finished (the admission-control count)."""
        return len(self._streams)

    async def add(self, requests: list[GenerateRequest]) -> OutputStream:
        """Queue requests as one group; raises InvalidRequestError, OverloadedError or
        EngineDeadError, and then none of them runs."""
        self._check_alive()
        if len(requests) > self.capacity:  # could never run, however long it waited
            raise InvalidRequestError(
                f"{len(requests)} sequences (n x prompts) exceed the server's capacity "
                f"({self.capacity})",
                param="n",
            )
        if self.num_unfinished + len(requests) > self.capacity:
            raise OverloadedError(f"server busy ({self.capacity} requests in flight)")
        stream = OutputStream([r.request_id for r in requests])
        for r in requests:  # counted at once, so a burst cannot overshoot the capacity
            self._streams[r.request_id] = stream
        try:
            await self.call(lambda engine: self._admit(requests))
        except asyncio.CancelledError:
            self.abort(stream)  # the client left while its requests were being admitted
            raise
        except BaseException:
            for r in requests:
                self._streams.pop(r.request_id, None)
            raise
        return stream

    def abort(self, stream: OutputStream) -> None:
        """Stop the stream's unfinished requests before the next step and free their KV.
        Synchronous, so it is safe in a finally of a cancelled task."""
        ids = [i for i in stream.unfinished if self._streams.pop(i, None) is not None]
        if ids and self.dead is None:
            self._submit(lambda: self._abort(ids))

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps; return its result or raise."""
        self._check_alive()
        future = self._loop.create_future()
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)

        def run() -> None:
            try:
                result, error = fn(self.engine), None
            except Exception as e:
                result, error = None, e
            self._loop.call_soon_threadsafe(_resolve, future, result, error)

        self._submit(run)
        return await future

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead!r}")

    def _submit(self, command: Callable[[], None]) -> None:
        self._inbox.put(command)
        self._wakeup.set()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted by its client meanwhile
            if output.finished:
                del self._streams[output.request_id]
            stream.queue.put_nowait(output)

    def _fail_all(self, error: BaseException) -> None:
        for future in list(self._pending):
            _resolve(future, None, error)
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            stream.queue.put_nowait(
                RequestOutput(request_id, finished=True, finish_reason="error", error=error)
            )

    # -- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                if self.engine.has_unfinished():
                    self._step()
                else:
                    self._wakeup.wait()
                    self._wakeup.clear()
        except BaseException as error:
            self._die(error)

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            command()

    def _step(self) -> None:
        outputs = self.engine.step()
        now = time.monotonic()
        for output in outputs:
            self._account(output, now)
        self.stats.steps += 1
        self._publish_stats()
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _admit(self, requests: list[GenerateRequest]) -> None:
        added = []
        try:
            for r in requests:
                request = self.engine.add_request(
                    r.request_id, r.prompt_ids, r.params, r.max_kv_size
                )
                added.append(r.request_id)
                self._timing[r.request_id] = _Timing(time.monotonic())
                self.stats.prompt_tokens += len(request.prompt_ids)
        except Exception:
            for request_id in added:  # all or nothing
                self.engine.abort(request_id)
                self._timing.pop(request_id, None)
            raise
        finally:
            self._publish_stats()

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self.engine.abort(request_id):
                self._count_finish("abort")
            self._timing.pop(request_id, None)
        self._publish_stats()

    def _account(self, output: RequestOutput, now: float) -> None:
        timing = self._timing.get(output.request_id)
        if output.new_token_ids and timing is not None:
            self.stats.generation_tokens += len(output.new_token_ids)
            if timing.last_token is None:
                self.listener.first_token(now - timing.arrival)
            else:
                self.listener.token_gap(now - timing.last_token)
            timing.last_token = now
        if output.finished:
            self._timing.pop(output.request_id, None)
            self._count_finish(output.finish_reason or "error")

    def _count_finish(self, reason: str) -> None:
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1

    def _publish_stats(self) -> None:
        self.stats.load = self.engine.snapshot()

    def _die(self, error: BaseException) -> None:
        log.critical("the engine loop died: %r", error, exc_info=error)
        self.dead = error
        try:
            # one callback, so whoever sees the streams fail also sees on_death already ran
            self._loop.call_soon_threadsafe(self._announce_death, error)
        except RuntimeError:
            pass  # the event loop is already closed: nobody is left to tell

    def _announce_death(self, error: BaseException) -> None:
        if self.on_death is not None:
            self.on_death(error)
        self._fail_all(EngineDeadError(f"the engine stopped: {error!r}"))


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return  # the awaiting request was cancelled
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)

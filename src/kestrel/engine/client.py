"""The one contract between the HTTP frontend and the engine: `EngineClient`.

The frontend validates and builds every request here, on its own side (`intake`, the Engine's
`RequestFactory`: a bad request is a synchronous 400), adds it, and reads its outputs as an async
stream; it can abort a stream, read the engine's load and statistics, and learn of its death.
How outputs come back is the implementation's business:

- `InProcessEngineClient`: an Engine in this process, stepped on a thread of its own (`LLM`-style
  embedding and tests);
- `engine.process.EngineProcessClient`: an Engine in a child process, over a socket the event loop
  reads itself (the server: the HTTP loop and the engine loop never share a GIL).

A client whose engine dies fails every open stream with `EngineDeadError` (a final output, never a
hung stream), refuses new requests, and calls `on_death`; the server decides to restart or exit.
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

from kestrel.engine.engine import Engine, EngineLoad, RequestFactory, RequestOutput
from kestrel.engine.request import Request
from kestrel.engine.scheduler import QueueFullError
from kestrel.errors import InvalidRequestError
from kestrel.sampling import SamplingParams

log = logging.getLogger("kestrel.engine_client")


class EngineDeadError(RuntimeError):
    """The engine stopped; its requests fail and the server answers 503 (then restarts it)."""


class OverloadedError(QueueFullError):
    """Every running slot and queue place is taken; the server answers 503 with Retry-After."""


@dataclass
class EngineStats:
    """Counts of what the engine did, kept by the frontend from the outputs it receives (so they
    survive an engine restart), and the engine's latest load."""

    load: EngineLoad = field(default_factory=EngineLoad)  # what the engine holds now
    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    embeddings: int = 0  # embedding vectors computed
    finished: dict[str, int] = field(default_factory=dict)  # finish_reason -> count

    def count_finish(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1


@dataclass
class ReplicaStatus:
    """One data-parallel replica as /health and /metrics show it (engine.replicas)."""

    replica: int  # its index, 0..N-1, kept across restarts
    status: str  # ok | restarting | failed
    pid: int | None  # its engine's process (None while it starts)
    in_flight: int  # requests routed to it and not finished
    routed: int  # requests routed to it since the server started
    restarts: int
    load: EngineLoad


class LatencyListener:
    """Receives per-token timings; the server's metrics implement it."""

    def first_token(self, seconds: float) -> None: ...

    def token_gap(self, seconds: float) -> None: ...


@dataclass
class GenerateRequest:
    """One engine request: n choices of one prompt are n of these. `embed`: its output is the
    prompt's embedding (`RequestOutput.embedding`), nothing is generated."""

    request_id: str
    prompt: list[int] | object  # token ids, or a kestrel.models.qwen_vl_processor.MultimodalPrompt
    params: SamplingParams
    max_kv_size: int | None = None
    embed: bool = False
    lora: str | None = None  # a loaded LoRA adapter's name; None: the base model
    priority: int = 0  # under --scheduling-policy priority: lower runs sooner


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


class EngineClient:
    """The frontend's side of an engine. Subclasses move built requests and aborts to the engine
    (`_send_add`, `_send_abort`) and hand what comes back to `_receive` on the event loop."""

    def __init__(
        self,
        intake: RequestFactory,
        tokenizer,
        processor=None,
        listener: LatencyListener | None = None,
        stats: EngineStats | None = None,
    ):
        self.intake, self.tokenizer, self.processor = intake, tokenizer, processor
        self.listener = listener or LatencyListener()
        self.stats = stats or EngineStats()
        self.on_death: Callable[[BaseException], None] | None = None
        self.dead: BaseException | None = None
        # admission control: at most this many unfinished requests. New requests wait in the
        # scheduler's queue until its next step, so its bound is the whole capacity (the server
        # sizes it as --parallel + --max-queue-depth).
        self.capacity = intake.config.scheduler.max_queue_depth
        self._streams: dict[str, OutputStream] = {}
        self._timing: dict[str, _Timing] = {}
        self.adapters: dict[str, str] = {}  # loaded LoRA adapters: name -> path

    # -- the contract -------------------------------------------------------------------------

    async def start(self) -> None:
        """Begin serving (the engine is loaded by then)."""

    def stop(self) -> None:
        """End the engine (an engine process exits)."""

    @property
    def embedding_size(self) -> int | None:
        """The length of the model's embedding vectors (its hidden size)."""
        return self.intake.hidden_size

    @property
    def num_unfinished(self) -> int:
        """Requests accepted and not yet finished (the admission-control count)."""
        return len(self._streams)

    def replica_status(self) -> list[ReplicaStatus]:
        """Each data-parallel replica's state (empty: one engine, no replicas)."""
        return []

    async def add(self, requests: list[GenerateRequest]) -> OutputStream:
        """Validate and queue requests as one group; raises InvalidRequestError,
        OverloadedError or EngineDeadError, and then none of them runs."""
        self._check_alive()
        if len(requests) > self.capacity:  # could never run, however long it waited
            raise InvalidRequestError(
                f"{len(requests)} sequences (n x prompts) exceed the server's capacity "
                f"({self.capacity})",
                param="n",
            )
        if self.num_unfinished + len(requests) > self.capacity:
            raise OverloadedError(f"server busy ({self.capacity} requests in flight)")
        built = [self._build(r) for r in requests]  # all validated before any is queued
        stream = OutputStream([r.request_id for r in built])
        now = time.monotonic()
        for request in built:
            self._streams[request.request_id] = stream
            self._timing[request.request_id] = _Timing(now)
            self.stats.prompt_tokens += len(request.prompt_ids)
        self._send_add(built)
        return stream

    def abort(self, stream: OutputStream) -> None:
        """Stop the stream's unfinished requests before the engine's next step and free their
        KV. Synchronous, so it is safe in a finally of a cancelled task."""
        ids = [i for i in stream.unfinished if self._streams.pop(i, None) is not None]
        for request_id in ids:
            self._timing.pop(request_id, None)
            self.stats.count_finish("abort")
        if ids and self.dead is None:
            self._send_abort(ids)

    async def load_lora(self, name: str, path: str) -> None:
        """Load a PEFT adapter into the engine as `name` (InvalidRequestError names what is
        wrong; the engine and its other adapters are untouched)."""
        self._check_alive()
        await self._control("load_lora", name, path)
        self.adapters[name] = path

    async def unload_lora(self, name: str) -> None:
        """Forget adapter `name`; requests running with it finish with it."""
        self._check_alive()
        await self._control("unload_lora", name)
        self.adapters.pop(name, None)

    # -- transport (subclasses) ---------------------------------------------------------------

    async def _control(self, method: str, *args) -> Any:
        """Engine.<method>(*args) between the engine's steps; its result or its exception."""
        raise NotImplementedError

    def _send_add(self, requests: list[Request]) -> None:
        raise NotImplementedError

    def _send_abort(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    # -- shared bookkeeping -------------------------------------------------------------------

    def _build(self, r: GenerateRequest) -> Request:
        if r.request_id in self._streams:
            raise InvalidRequestError(f"duplicate request id {r.request_id!r}")
        if r.lora is not None and r.lora not in self.adapters:
            raise InvalidRequestError(
                f"no adapter {r.lora!r} is loaded", "model", "model_not_found"
            )
        return self.intake.build(
            r.request_id, r.prompt, r.params, r.max_kv_size, r.embed, r.lora, r.priority
        )

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead!r}")

    def _receive(self, outputs: list[RequestOutput], load: EngineLoad, stepped: bool) -> None:
        """One engine step's outputs and the load after it (event loop)."""
        self.stats.load = load
        self.stats.steps += stepped
        now = time.monotonic()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted by its client meanwhile
            self._account(output, now)
            if output.finished:
                del self._streams[output.request_id]
            stream.queue.put_nowait(output)

    def _account(self, output: RequestOutput, now: float) -> None:
        timing = self._timing.get(output.request_id)
        if output.new_token_ids and timing is not None:
            self.stats.generation_tokens += len(output.new_token_ids)
            if timing.last_token is None:
                self.listener.first_token(now - timing.arrival)
            else:
                self.listener.token_gap(now - timing.last_token)
            timing.last_token = now
        if output.embedding is not None:
            self.stats.embeddings += 1
        if output.finished:
            self._timing.pop(output.request_id, None)
            self.stats.count_finish(output.finish_reason or "error")

    def _die(self, error: BaseException) -> None:
        """The engine is gone (event loop): every open stream ends with EngineDeadError."""
        if self.dead is not None:
            return
        log.critical("the engine died: %r", error, exc_info=error)
        self.dead = error
        if self.on_death is not None:  # first, so whoever sees a stream fail sees it ran
            self.on_death(error)
        dead = EngineDeadError(f"the engine stopped: {error!r}")
        streams, self._streams = self._streams, {}
        self._timing.clear()
        for request_id, stream in streams.items():
            self.stats.count_finish("error")
            stream.queue.put_nowait(
                RequestOutput(request_id, finished=True, finish_reason="error", error=dead)
            )


class InProcessEngineClient(EngineClient):
    """An Engine in this process, stepped on its own thread (the Engine is not thread-safe, so
    only that thread touches it: adds and aborts go through an inbox drained between steps)."""

    def __init__(self, engine: Engine, listener: LatencyListener | None = None):
        super().__init__(engine.intake, engine.tokenizer, engine.processor, listener)
        self.engine = engine
        self.adapters = engine.lora_adapters()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kestrel-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """fn(engine) on the engine thread between steps (tests inspect the engine with it)."""
        future = self._loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
                self._loop.call_soon_threadsafe(_resolve, future, result, None)
            except Exception as error:
                self._loop.call_soon_threadsafe(_resolve, future, None, error)

        self._submit(run)
        return await future

    async def _control(self, method: str, *args) -> Any:
        return await self.call(lambda engine: getattr(engine, method)(*args))

    def _send_add(self, requests: list[Request]) -> None:
        self._submit(lambda: self._add(requests))

    def _send_abort(self, request_ids: list[str]) -> None:
        self._submit(lambda: [self.engine.abort(i) for i in request_ids])

    def _add(self, requests: list[Request]) -> None:
        failed = self.engine.add_all(requests)
        if failed:
            self._loop.call_soon_threadsafe(self._receive, failed, self.engine.snapshot(), False)

    def _submit(self, command: Callable[[], None]) -> None:
        self._inbox.put(command)
        self._wakeup.set()

    def _run(self) -> None:
        try:
            while not self._stopping:
                while not self._inbox.empty():
                    self._inbox.get_nowait()()
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    self._loop.call_soon_threadsafe(
                        self._receive, outputs, self.engine.snapshot(), True
                    )
                else:
                    self._wakeup.wait()
                    self._wakeup.clear()
        except BaseException as error:
            try:
                self._loop.call_soon_threadsafe(self._die, error)
            except RuntimeError:
                pass  # the event loop is already closed: nobody is left to tell


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return  # the awaiting request was cancelled
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)

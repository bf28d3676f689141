"""The server's engine in a process of its own, so the HTTP event loop and the engine loop never
share a GIL.

In one process the event loop (SSE encoding and sending, thousands of events a second at high
concurrency) and the engine thread (scheduling, packing, launching the GPU step, detokenizing)
take turns on one interpreter lock, and every turn the engine waits for is time the GPU sits idle:
through the server, 64 streams made only ~70% of the offline throughput. vLLM separates its API
server and engine core for the same reason.

`EngineProcess` has the Engine's interface (add_request, abort, step, has_unfinished, snapshot)
and stands in for it under AsyncEngine: requests are validated here with the Engine's own
`RequestFactory` (so errors are still synchronous 400s) and cross the pipe already built; the
child runs `Engine.step()` in a loop and sends each step's outputs back in one message. A child
that dies (or raises out of its loop) ends the stream of messages with an error, which kills
the AsyncEngine: the engine-death path, as in one process.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from kestrel.engine.engine import (
    Engine,
    EngineConfig,
    EngineLoad,
    RequestFactory,
    RequestOutput,
)
from kestrel.engine.request import Request
from kestrel.engine.scheduler import QueueFullError
from kestrel.errors import InvalidRequestError

log = logging.getLogger("kestrel.engine_process")


class EngineProcessError(RuntimeError):
    """The engine process failed to start, exited, or its loop raised."""


class EngineError(RuntimeError):
    """An error raised in the engine process, as "TypeName: message"."""


@dataclass
class _Ready:
    """What the server's side needs to validate requests like the Engine would."""

    config: EngineConfig
    vocab_size: int
    ctx_size: int
    multimodal: bool


class EngineProcess:
    """An Engine in a spawned child process, driven through the Engine's interface.

    `build` (picklable: it is called in the child) returns the Engine; `tokenizer` and
    `processor` are this process's own (the routes encode prompts and images here)."""

    def __init__(self, build: Callable[[], Engine], tokenizer, processor=None):
        self.tokenizer, self.processor = tokenizer, processor
        # a fresh interpreter, not a fork: CUDA cannot be forked, nor can the server's threads
        # be; a plain subprocess (not multiprocessing's spawn) leaves no helper process behind
        ours, theirs = socket.socketpair()
        entry = f"from kestrel.engine.process import child_main; child_main({theirs.fileno()})"
        self._process = subprocess.Popen([sys.executable, "-c", entry], pass_fds=[theirs.fileno()])
        theirs.close()
        self._conn = Connection(ours.detach())
        _send(self._conn, build)
        kind, payload = self._receive_or_exit()
        if kind != "ready":
            self._process.wait()
            raise EngineProcessError(f"the engine failed to load: {payload}") from payload
        ready: _Ready = payload
        self.config = ready.config
        self.intake = RequestFactory(
            tokenizer, ready.config, ready.vocab_size, ready.ctx_size, ready.multimodal
        )
        self.unfinished: set[str] = set()
        self.load = EngineLoad()
        # set when a message arrives; AsyncEngine waits on it (and sets it for its own inbox)
        self.wakeup = threading.Event()
        self._messages: deque[tuple] = deque()
        threading.Thread(target=self._read, name="kestrel-engine-reader", daemon=True).start()

    def _receive_or_exit(self) -> tuple:
        try:
            return _receive(self._conn)
        except (EOFError, OSError):
            code = self._process.wait()
            return "failed", EngineProcessError(f"the engine process exited (code {code})")

    def _read(self) -> None:
        while True:
            message = self._receive_or_exit()
            self._messages.append(message)
            self.wakeup.set()
            if message[0] != "step":
                return

    # -- the Engine's interface ------------------------------------------------------------

    def add_request(self, request_id, prompt, params, max_kv_size=None) -> Request:
        if request_id in self.unfinished:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        request = self.intake.build(request_id, prompt, params, max_kv_size)
        _send(self._conn, ("add", request))
        self.unfinished.add(request_id)
        return request

    def abort(self, request_id: str) -> bool:
        if request_id not in self.unfinished:
            return False
        self.unfinished.discard(request_id)
        _send(self._conn, ("abort", request_id))
        return True

    def has_unfinished(self) -> bool:
        return bool(self.unfinished or self._messages)

    def step(self) -> list[RequestOutput]:
        """The outputs of the steps the child finished since the last call; if none has, waits
        for a message or a wakeup (then returns nothing, so the caller serves its inbox)."""
        if not self._messages:
            self.wakeup.wait()
            self.wakeup.clear()
        outputs = []
        while self._messages:
            kind, payload, *load = self._messages.popleft()
            if kind != "step":
                raise EngineProcessError(f"the engine process stopped: {payload}") from payload
            self.load = load[0]
            for output in payload:  # outputs of requests aborted meanwhile are dropped
                if output.request_id in self.unfinished:
                    if output.finished:
                        self.unfinished.discard(output.request_id)
                    outputs.append(output)
        return outputs

    def snapshot(self) -> EngineLoad:
        return self.load

    def close(self, timeout: float = 5.0) -> None:
        try:
            _send(self._conn, ("stop", None))
        except OSError:
            pass  # already gone
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


# -- the child ------------------------------------------------------------------------------


def child_main(fd: int) -> None:
    """The engine process: receive `build`, build the Engine, serve until told to stop or the
    server goes away."""
    # Ctrl-C and SIGTERM are the server's to handle (it drains, then closes this process)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_server(os.getppid())
    conn = Connection(fd)
    try:
        build = _receive(conn)
        engine = build()
        text = engine.intake
        _send(
            conn, ("ready", _Ready(engine.config, text.vocab_size, text.ctx_size, text.multimodal))
        )
    except BaseException as error:
        log.exception("the engine failed to load")
        _send(conn, ("failed", _portable(error)))
        return
    try:
        _serve(conn, engine)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the server went away: nothing is left to serve
    except BaseException as error:
        log.critical("the engine loop died: %r", error, exc_info=error)
        try:
            _send(conn, ("dead", _portable(error)))
        except OSError:
            pass


def _exit_with_server(server: int) -> None:
    """Exit within a second of the server's death, however it died and even mid-load (a closed
    pipe is only noticed between steps)."""

    def watch() -> None:
        while os.getppid() == server:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="kestrel-server-watch", daemon=True).start()


def _serve(conn, engine: Engine) -> None:
    """Commands between steps (blocking for one while there is no work), then a step. Each step
    sends its outputs with the engine's load; an idle engine sends its load once more when it
    changed (after the last abort, say), so the server's gauges do not stay stale."""
    sent = None
    while True:
        if not engine.has_unfinished():
            if engine.snapshot() != sent:
                sent = engine.snapshot()
                _send(conn, ("step", [], sent))
            conn.poll(None)  # idle: wait for a command
        while conn.poll(0):
            command, payload = _receive(conn)
            if command == "stop":
                return
            failed = _apply(engine, command, payload)
            if failed:
                _send(conn, ("step", [_portable_output(failed)], engine.snapshot()))
        if not engine.has_unfinished():
            continue
        outputs = engine.step()
        sent = engine.snapshot()
        _send(conn, ("step", [_portable_output(o) for o in outputs], sent))


def _apply(engine: Engine, command: str, payload) -> RequestOutput | None:
    """Run one command; the failed output of an "add" that raised (validated on the server's
    side already, so that fails only its own request), else None."""
    if command == "abort":
        engine.abort(payload)
        return None
    try:
        engine.add(payload)
    except Exception as error:
        return RequestOutput(payload.request_id, finished=True, finish_reason="error", error=error)
    return None


def _portable_output(output: RequestOutput) -> RequestOutput:
    if output.error is not None:
        output.error = _portable(output.error)
    return output


def _portable(error: BaseException) -> BaseException:
    """Errors the server maps to a status (400, 503) cross as they are; any other as its type's
    name and message, so no engine-side class has to rebuild on the server's side."""
    if isinstance(error, InvalidRequestError | QueueFullError):
        return error
    return EngineError(f"{type(error).__name__}: {error}")


def _send(conn: Connection, message) -> None:
    """Plain pickle, not the Connection's own: multiprocessing's pickler (with torch's reductions)
    would pass tensors as shared memory, which a process it did not spawn cannot open."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _receive(conn: Connection):
    return pickle.loads(conn.recv_bytes())  # only ever what the other side of our pipe sent

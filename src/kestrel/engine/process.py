"""The server's engine in a process of its own, so the HTTP event loop and the engine loop never
share a GIL.

In one process the event loop (SSE encoding and sending, thousands of events a second at high
concurrency) and the engine loop (scheduling, packing, launching the GPU step, detokenizing)
take turns on one interpreter lock, and every turn the engine waits for is time the GPU sits idle:
through the server, 64 streams made only ~70% of the offline throughput. vLLM separates its API
server and engine core for the same reason.

`EngineProcessClient` is the EngineClient over a socket to the child: requests are validated and
built on the server's side (so errors are still synchronous 400s) and cross already built; the
child runs `Engine.step()` in a loop and sends each step's outputs back in one message, which the
event loop reads from the socket itself (no relay thread). A child that dies, is killed or raises
out of its loop ends the stream of messages: the client fails its open requests and reports the
death (the server then restarts the engine or exits).

Messages are pickles framed by an 8-byte length, both ways.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kestrel.config import Config
from kestrel.engine.client import EngineClient, EngineStats, LatencyListener
from kestrel.engine.engine import Engine, RequestFactory, RequestOutput
from kestrel.engine.request import Request
from kestrel.engine.scheduler import QueueFullError
from kestrel.errors import InvalidRequestError

log = logging.getLogger("kestrel.engine_process")
HEADER = struct.Struct("!Q")


class EngineProcessError(RuntimeError):
    """The engine process failed to start, exited, or its loop raised."""


class EngineError(RuntimeError):
    """An error raised in the engine process, as "TypeName: message"."""


@dataclass
class EngineInfo:
    """What the server's side needs to validate requests like the Engine would."""

    config: Config
    vocab_size: int
    ctx_size: int
    multimodal: bool
    hidden_size: int | None
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapters loaded at start

    @classmethod
    def of(cls, engine: Engine) -> EngineInfo:
        text = engine.intake
        return cls(
            engine.config,
            text.vocab_size,
            text.ctx_size,
            text.multimodal,
            text.hidden_size,
            engine.lora_adapters(),
        )

    def intake(self, tokenizer) -> RequestFactory:
        """The server's RequestFactory: validates and builds requests as the engine's would."""
        return RequestFactory(
            tokenizer,
            self.config,
            self.vocab_size,
            self.ctx_size,
            self.multimodal,
            self.hidden_size,
        )


# what the server may ask of the engine between steps (`EngineClient._control`)
CONTROLS = {"load_lora", "unload_lora"}


class EngineProcessClient(EngineClient):
    """An Engine in a child process (a fresh interpreter), driven over a socket.

    `build` (picklable: it is called in the child) returns the Engine; `tokenizer` and
    `processor` are this process's own (the routes encode prompts and images here)."""

    def __init__(
        self,
        build: Callable[[], Engine],
        tokenizer,
        processor=None,
        listener: LatencyListener | None = None,
        stats: EngineStats | None = None,
    ):
        # a fresh interpreter, not a fork: CUDA cannot be forked, nor can the server's threads
        # be; a plain subprocess (not multiprocessing's spawn) leaves no helper process behind
        ours, theirs = socket.socketpair()
        entry = f"from kestrel.engine.process import child_main; child_main({theirs.fileno()})"
        self.process = subprocess.Popen([sys.executable, "-c", entry], pass_fds=[theirs.fileno()])
        theirs.close()
        ready = self._load(ours, build)
        super().__init__(ready.intake(tokenizer), tokenizer, processor, listener, stats)
        self.adapters = dict(ready.adapters)
        self._replies: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._socket = ours
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None

    def _load(self, sock: socket.socket, build) -> EngineInfo:
        """Send `build`, wait (blocking: the caller runs this off the event loop) for ready."""
        try:
            _send(sock, build)
            kind, payload = _receive(sock)
        except (EOFError, OSError):
            kind, payload = "failed", self._exited()
        if kind != "ready":
            self.process.wait()
            sock.close()
            raise EngineProcessError(f"the engine failed to load: {payload}") from payload
        return payload

    def _exited(self) -> EngineProcessError:
        code = self.process.wait()
        return EngineProcessError(f"the engine process exited (code {code})")

    async def start(self) -> None:
        reader, self._writer = await asyncio.open_connection(sock=self._socket)
        self._reader_task = asyncio.create_task(self._read(reader))

    def stop(self, timeout: float = 5.0) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
        try:
            if self._writer is None:  # never started: the socket is still ours to use
                _send(self._socket, ("stop", None))
            elif not self._writer.is_closing():
                self._writer.write(_frame(("stop", None)))
                self._writer.close()
        except OSError:
            pass  # the child is gone already
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _send_add(self, requests: list[Request]) -> None:
        self._writer.write(_frame(("add", requests)))

    def _send_abort(self, request_ids: list[str]) -> None:
        self._writer.write(_frame(("abort", request_ids)))

    async def _control(self, method: str, *args):
        call_id = next(self._call_ids)
        future = self._replies[call_id] = asyncio.get_running_loop().create_future()
        self._writer.write(_frame(("control", (call_id, method, args))))
        try:
            return await future
        finally:
            self._replies.pop(call_id, None)

    def _reply(self, call_id: int, result, error: BaseException | None) -> None:
        future = self._replies.get(call_id)
        if future is not None and not future.done():
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        """Every message the child sends, until it stops or dies."""
        try:
            while True:
                kind, *payload = await _read_message(reader)
                if kind == "reply":
                    self._reply(*payload)
                    continue
                if kind != "step":
                    raise EngineProcessError(f"the engine loop died: {payload[0]}") from payload[0]
                self._receive(*payload)
        except asyncio.CancelledError:
            raise
        except (asyncio.IncompleteReadError, OSError):
            self._die(await asyncio.to_thread(self._exited))
        except Exception as error:
            self._die(error)


# -- the child ------------------------------------------------------------------------------


def child_main(fd: int) -> None:
    """The engine process: receive `build`, build the Engine, serve until told to stop or the
    server goes away."""
    # Ctrl-C and SIGTERM are the server's to handle (it drains, then closes this process)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_server(os.getppid())
    sock = socket.socket(fileno=fd)
    try:
        build = _receive(sock)
        engine = build()
        _send(sock, ("ready", EngineInfo.of(engine)))
    except BaseException as error:
        log.exception("the engine failed to load")
        _send(sock, ("failed", _portable(error)))
        return
    code = 0
    try:
        _serve(sock, engine)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the server went away: nothing is left to serve
    except BaseException as error:
        log.critical("the engine loop died: %r", error, exc_info=error)
        code = 1
        try:
            _send(sock, ("dead", _portable(error)))
        except OSError:
            pass
    # nothing is left to clean up: skip the interpreter's teardown (seconds with torch loaded)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_with_server(server: int) -> None:
    """Exit within a second of the server's death, however it died and even mid-load (a closed
    socket is only noticed between steps)."""

    def watch() -> None:
        while os.getppid() == server:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="kestrel-server-watch", daemon=True).start()


def _serve(sock: socket.socket, engine: Engine) -> None:
    """Commands between steps (blocking for one while there is no work), then a step. Each step
    sends its outputs with the engine's load; an idle engine sends its load once more when it
    changed (after the last abort, say), so the server's gauges do not stay stale."""
    sent = None
    while True:
        if not engine.has_unfinished():
            if engine.snapshot() != sent:
                sent = engine.snapshot()
                _send(sock, ("step", [], sent, False))
            select.select([sock], [], [])  # idle: wait for a command
        while select.select([sock], [], [], 0)[0]:
            command, payload = _receive(sock)
            if command == "stop":
                return
            if command == "control":
                _send(sock, ("reply", *run_control(engine, *payload)))
                continue
            failed = _apply(engine, command, payload)
            if failed:
                _send(sock, ("step", failed, engine.snapshot(), False))
        if engine.has_unfinished():
            outputs = engine.step()
            sent = engine.snapshot()
            _send(sock, ("step", [portable_output(o) for o in outputs], sent, True))


def _apply(engine: Engine, command: str, payload) -> list[RequestOutput]:
    """Run one command; the failed outputs of added requests that raised (validated on the
    server's side already, so each fails only itself)."""
    if command == "abort":
        for request_id in payload:
            engine.abort(request_id)
        return []
    return [portable_output(output) for output in engine.add_all(payload)]


def run_control(engine: Engine, call_id: int, method: str, args: tuple) -> tuple:
    """(call id, result, error) of one of CONTROLS run on the engine."""
    if method not in CONTROLS:
        return call_id, None, EngineError(f"unknown control {method!r}")
    try:
        return call_id, getattr(engine, method)(*args), None
    except Exception as error:
        return call_id, None, _portable(error)


def portable_output(output: RequestOutput) -> RequestOutput:
    if output.error is not None:
        output.error = _portable(output.error)
    return output


def _portable(error: BaseException) -> BaseException:
    """Errors the server maps to a status (400, 503) cross as they are; any other as its type's
    name and message, so no engine-side class has to rebuild on the server's side."""
    if isinstance(error, InvalidRequestError | QueueFullError):
        return error
    return EngineError(f"{type(error).__name__}: {error}")


# -- framing: an 8-byte length, then a pickle ------------------------------------------------


def _frame(message) -> bytes:
    """Plain pickle: multiprocessing's pickler (with torch's reductions) would pass tensors as
    shared memory, which a process it did not spawn cannot open."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


def _send(sock: socket.socket, message) -> None:
    sock.sendall(_frame(message))


def _receive(sock: socket.socket):
    (size,) = HEADER.unpack(_receive_exactly(sock, HEADER.size))
    return pickle.loads(_receive_exactly(sock, size))  # only ever what our other side sent


def _receive_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other side closed the socket")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


async def _read_message(reader: asyncio.StreamReader):
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(size))

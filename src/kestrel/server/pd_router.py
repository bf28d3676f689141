"""The router of disaggregated prefill and decode (`kestrel serve --disaggregate`): the one
`EngineClient` in front of a prefill engine process and a decode engine process
(distributed/disaggregated.py says what each does).

- Every request goes to the prefill engine. Those that can be handed off (they generate more
  than one token, with no grammar to carry along) are marked `Request.handoff`; the rest (an
  embedding, a structured output, max_tokens 1) run whole there.
- When the prefill engine's output for a request ends with "handoff", its first token is
  streamed to the client as an ordinary output, and the request goes to the decode engine,
  whose add receives its KV (already on its way). Hand-offs reach the decode engine in the
  order the prefill engine sent them, so every one is forwarded, even a request aborted
  meanwhile (it is aborted there right after).
- An abort goes to the engine that holds the request; LoRA adapters load into both; the load
  the server reports is the two engines' together. Either engine's death is the pair's: the
  server restarts both or exits.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import astuple

from kestrel.config import Config
from kestrel.distributed.disaggregated import DECODE, PREFILL, build_role
from kestrel.engine.client import EngineClient, EngineStats, LatencyListener
from kestrel.engine.engine import EngineLoad, RequestOutput
from kestrel.engine.process import EngineProcessClient, EngineProcessError
from kestrel.engine.request import Request

log = logging.getLogger("kestrel.pd_router")
MAX_ABANDONED = 4096  # aborted while prefilling: kept in case their hand-off still comes


def hands_off(request: Request) -> bool:
    """Whether the request's decoding moves to the decode engine."""
    return (
        request.pooling is None
        and request.max_tokens > 1
        and request.params.structured_output is None
    )


class RoleProcess(EngineProcessClient):
    """One role's engine process; its steps and its death go to the router (`on_step`,
    `on_lost`), which keeps the streams."""

    def __init__(self, build, tokenizer, started: list):
        self.started = started
        self.on_step: Callable = lambda outputs, load, stepped: None
        self.on_lost: Callable = lambda error: None
        super().__init__(build, tokenizer)

    def _load(self, sock, build):
        self.started.append(self)  # its process runs: kill it if the other role fails
        return super()._load(sock, build)

    def _receive(self, outputs: list[RequestOutput], load: EngineLoad, stepped: bool) -> None:
        self.on_step(outputs, load, stepped)

    def _die(self, error: BaseException) -> None:
        self.on_lost(error)


class DisaggregatedClient(EngineClient):
    """The prefill and decode engine processes behind one EngineClient."""

    def __init__(
        self,
        prefill: RoleProcess,
        decode: RoleProcess,
        tokenizer,
        processor=None,
        listener: LatencyListener | None = None,
        stats: EngineStats | None = None,
    ):
        super().__init__(prefill.intake, tokenizer, processor, listener, stats)
        self.adapters = dict(prefill.adapters)
        self.roles = {PREFILL: prefill, DECODE: decode}
        self.loads = {PREFILL: EngineLoad(), DECODE: EngineLoad()}
        self._owner: dict[str, str] = {}  # request id -> the role holding it
        self._prefilling: dict[str, Request] = {}  # marked for hand-off, not handed off yet
        self._abandoned: OrderedDict[str, Request] = OrderedDict()
        self.handed_off = 0  # requests the decode engine took over, since the pair started
        for role, process in self.roles.items():
            process.on_step = functools.partial(self._from_role, role)
            process.on_lost = self._die

    async def start(self) -> None:
        for process in self.roles.values():
            await process.start()

    def stop(self) -> None:
        for process in self.roles.values():
            process.stop()

    # -- requests out ---------------------------------------------------------------------------

    def _send_add(self, requests: list[Request]) -> None:
        for request in requests:
            request.handoff = hands_off(request)
            self._owner[request.request_id] = PREFILL
            if request.handoff:
                self._prefilling[request.request_id] = request
        self.roles[PREFILL]._send_add(requests)

    def _send_abort(self, request_ids: list[str]) -> None:
        by_role: dict[str, list[str]] = {PREFILL: [], DECODE: []}
        for request_id in request_ids:
            role = self._owner.pop(request_id, None)
            if role is not None:
                by_role[role].append(request_id)
            request = self._prefilling.pop(request_id, None)
            if request is not None:
                self._abandon(request)
        for role, ids in by_role.items():
            if ids:
                self.roles[role]._send_abort(ids)

    def _abandon(self, request: Request) -> None:
        self._abandoned[request.request_id] = request
        while len(self._abandoned) > MAX_ABANDONED:
            self._abandoned.popitem(last=False)

    async def _control(self, method: str, *args):
        """The same call on both engines (each loads its own LoRA adapters)."""
        results = await asyncio.gather(*(p._control(method, *args) for p in self.roles.values()))
        return results[0]

    # -- outputs in -----------------------------------------------------------------------------

    def _from_role(
        self, role: str, outputs: list[RequestOutput], load: EngineLoad, stepped: bool
    ) -> None:
        self.loads[role] = load
        for output in outputs:
            if output.finish_reason == "handoff":
                self._hand_over(output.request_id)
                output.finished, output.finish_reason = False, None  # it goes on in decode
            elif output.finished:
                self._owner.pop(output.request_id, None)
                self._prefilling.pop(output.request_id, None)
        self._receive(outputs, self._total_load(), stepped)

    def _hand_over(self, request_id: str) -> None:
        """Send the request to the decode engine (which receives its KV as it adds it)."""
        request = self._prefilling.pop(request_id, None) or self._abandoned.pop(request_id, None)
        if request is None:
            log.error("a hand-off of %s, which the router does not know", request_id)
            return
        decode = self.roles[DECODE]
        decode._send_add([request])
        self.handed_off += 1
        if request_id in self._streams:
            self._owner[request_id] = DECODE
        else:  # aborted by its client while it prefilled
            decode._send_abort([request_id])

    def _total_load(self) -> EngineLoad:
        loads = [astuple(load) for load in self.loads.values()]
        return EngineLoad(*(sum(column) for column in zip(*loads, strict=True)))


def load_disaggregated(
    config: Config,
    build_engine: Callable,
    log_level: str,
    tokenizer,
    processor=None,
    listener: LatencyListener | None = None,
    stats: EngineStats | None = None,
) -> DisaggregatedClient:
    """Start the prefill and decode engine processes (blocking: the server runs this off the
    event loop) and the router over them. They load at once: each waits for the other where
    they join the hand-off group."""
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    started: list[RoleProcess] = []
    with ThreadPoolExecutor(2, thread_name_prefix="kestrel-pd-load") as pool:
        futures = {
            role: pool.submit(
                RoleProcess,
                functools.partial(build_role, build_engine, config, log_level, role, init_method),
                tokenizer,
                started,
            )
            for role in (PREFILL, DECODE)
        }
        done, _ = wait(futures.values(), return_when=FIRST_EXCEPTION)
        failed = [f.exception() for f in done if f.exception() is not None]
        if failed:
            for process in started:  # the other waits for its peer: end it
                process.process.kill()
            raise EngineProcessError(f"an engine of the pair failed to load: {failed[0]}")
    prefill, decode = futures[PREFILL].result(), futures[DECODE].result()
    log.info("prefill engine (pid %d) and decode engine (pid %d) ready",
             prefill.process.pid, decode.process.pid)  # fmt: skip
    return DisaggregatedClient(prefill, decode, tokenizer, processor, listener, stats)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

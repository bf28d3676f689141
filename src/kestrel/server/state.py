"""The server's lifecycle: loading -> ready -> draining, or failed; restarting while a dead engine
comes back. Routes get the engine client here."""

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from kestrel.config import ServerConfig
from kestrel.engine.client import (
    EngineClient,
    EngineStats,
    GenerateRequest,
    LatencyListener,
)
from kestrel.errors import ModelLoadError
from kestrel.sampling import SamplingParams
from kestrel.server.errors import model_not_found, unavailable
from kestrel.server.generation import TokenText
from kestrel.server.metrics import Metrics
from kestrel.server.reasoning import ReasoningParser, choose_reasoning_parser
from kestrel.server.tools.parsers import ToolParser, choose_parser
from kestrel.tokenizer import encode

log = logging.getLogger("kestrel.server")

# builds a started-to-be engine client (blocking: it runs on a worker thread)
LoadEngine = Callable[[LatencyListener, EngineStats], EngineClient]


class ServerState:
    def __init__(self, config: ServerConfig, request_exit: Callable[[int], None] | None = None):
        self.config = config
        self.status = "loading"  # loading | ready | restarting | draining | failed
        self.engine: EngineClient | None = None
        self.token_text: TokenText | None = None
        self.tool_parser: ToolParser | None = None
        self.reasoning_parser: ReasoningParser | None = None
        self.stats = EngineStats()  # kept across engine restarts (Prometheus counters)
        self.metrics = Metrics(lambda: self.engine, self.stats)
        self.request_exit = request_exit or (lambda code: None)
        self._load: LoadEngine | None = None
        self._restarts: deque[float] = deque()  # monotonic times of recent restarts
        self._tasks: set[asyncio.Task] = set()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def processor(self):
        return self.engine.processor

    def ready_engine(self) -> EngineClient:
        """The engine, or 503 while loading, restarting, draining or after the engine died."""
        if self.engine is None or self.health() != "ready":
            raise unavailable(f"the server is not ready ({self.health()})")
        return self.engine

    def health(self) -> str:
        if self.status == "ready" and self.engine is not None and self.engine.dead is not None:
            return "engine failed"
        if self.status == "ready" and self.engine is not None and not self._replica_serves():
            return "restarting"
        return self.status

    def _replica_serves(self) -> bool:
        """With -dp: some replica is up (the others may be restarting); without: True."""
        replicas = self.engine.replica_status()
        return not replicas or any(r.status == "ok" for r in replicas)

    def check_model(self, name: str) -> None:
        if name != self.config.model_name and name not in self.config.aliases:
            if self.adapter(name) is None:
                raise model_not_found(name)

    def adapter(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model)."""
        engine = self.engine
        return model if engine is not None and model in engine.adapters else None

    async def start(self, load: LoadEngine) -> None:
        """Load the model (off the event loop), start the engine, run one warm-up."""
        self._load = load
        try:
            await self._start_engine()
        except ModelLoadError as e:  # the user's to fix (a bad -m): the message says what
            log.error("the model failed to load: %s", e)
            self.status = "failed"
            self.request_exit(1)
            return
        except Exception:
            log.exception("the model failed to load")
            self.status = "failed"
            self.request_exit(1)
            return
        if self.status == "loading":
            self.status = "ready"
        reasoning = self.reasoning_parser.name if self.reasoning_parser else "none"
        log.info(
            "ready: serving %s (tool calls: %s, reasoning: %s)",
            self.config.model_name,
            self.tool_parser.name,
            reasoning,
        )

    async def _start_engine(self) -> None:
        engine = await asyncio.to_thread(self._load, self.metrics, self.stats)
        await engine.start()
        self.engine = engine
        self.token_text = TokenText(engine.tokenizer)
        self.tool_parser = choose_parser(engine.tokenizer, self.config.tool_call_parser)
        self.reasoning_parser = choose_reasoning_parser(
            engine.tokenizer, self.config.reasoning_parser
        )
        await self._warm_up(engine)  # a death before this returns fails the start instead
        engine.on_death = self._on_engine_death

    async def _warm_up(self, engine: EngineClient) -> None:
        prompt = encode(engine.tokenizer, "Hello")
        params = SamplingParams(max_tokens=1, temperature=0)
        stream = await engine.add([GenerateRequest("warmup", prompt, params)])
        async for output in stream:
            if output.error is not None:
                raise output.error

    # -- engine death: restart, or give up ------------------------------------------------------

    def _on_engine_death(self, error: BaseException) -> None:
        if self.status in ("ready", "restarting") and self._may_restart():
            log.error("the engine died (%r); restarting it", error)
            self.status = "restarting"
            task = asyncio.get_running_loop().create_task(self._restart())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        self._give_up()

    def _may_restart(self) -> bool:
        """Restarts are on and fewer than the limit happened within the window."""
        if not self.config.restart_engine:
            return False
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > self.config.engine_restart_window:
            self._restarts.popleft()
        return len(self._restarts) < self.config.max_engine_restarts

    async def _restart(self) -> None:
        self._restarts.append(time.monotonic())
        dead, self.engine = self.engine, None
        await asyncio.to_thread(dead.stop)  # reap what is left of the old process
        try:
            await self._start_engine()
        except Exception:
            log.exception("the engine failed to restart")
            self._give_up()
            return
        if self.status == "restarting":
            self.status = "ready"
        log.info("the engine is back: serving %s", self.config.model_name)

    def _give_up(self) -> None:
        if self.config.restart_engine:
            log.critical(
                "the engine died %d times within %.0f s: giving up",
                len(self._restarts) + 1,
                self.config.engine_restart_window,
            )
        if self.status == "restarting":
            self.status = "failed"
        if self.config.exit_on_engine_failure:
            log.critical(
                "exiting: the engine loop died (run with --no-exit-on-engine-failure to stay up)"
            )
            self.request_exit(1)

    # -- shutdown -------------------------------------------------------------------------------

    def idle(self) -> bool:
        """No accepted request is unfinished (a draining server exits once this holds)."""
        engine = self.engine
        return engine is None or engine.dead is not None or engine.num_unfinished == 0

    def drain(self) -> None:
        """Stop admitting: /health and new requests answer 503; running requests go on."""
        if self.status != "failed":
            self.status = "draining"

    def stop(self) -> None:
        self.drain()
        for task in self._tasks:
            task.cancel()
        if self.engine is not None:
            self.engine.stop()

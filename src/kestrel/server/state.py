"""The server's lifecycle: loading -> ready -> draining, or failed. Routes get the engine here."""

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kestrel.engine.async_engine import AsyncEngine, GenerateRequest
from kestrel.engine.engine import Engine
from kestrel.engine.process import EngineProcess
from kestrel.sampling import SamplingParams
from kestrel.server.errors import model_not_found, unavailable
from kestrel.server.generation import TokenText
from kestrel.server.metrics import Metrics
from kestrel.tokenizer import encode

log = logging.getLogger("kestrel.server")


@dataclass
class ServerConfig:
    model_name: str  # the id /v1/models lists
    aliases: set[str] = field(default_factory=set)  # other names `model` may use
    api_key: str | None = None
    allowed_origins: list[str] = field(default_factory=list)
    default_max_tokens: int | None = None
    exit_on_engine_failure: bool = True
    max_request_bytes: int = 8 * 2**20  # larger bodies: 413 before they are read whole
    client_timeout: float = 30.0  # seconds a client has to send its request head, and its body


class ServerState:
    def __init__(self, config: ServerConfig, request_exit: Callable[[int], None] | None = None):
        self.config = config
        self.status = "loading"  # loading | ready | draining | failed
        self.engine: AsyncEngine | None = None
        self.token_text: TokenText | None = None
        self.metrics = Metrics(lambda: self.engine)
        self.request_exit = request_exit or (lambda code: None)

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    def ready_engine(self) -> AsyncEngine:
        """The engine, or 503 while loading, draining or after the engine died."""
        if self.status != "ready" or self.engine is None or self.engine.dead is not None:
            raise unavailable(f"the server is not ready ({self.health()})")
        return self.engine

    def health(self) -> str:
        if self.engine is not None and self.engine.dead is not None:
            return "engine failed"
        return self.status

    def check_model(self, name: str) -> None:
        if name != self.config.model_name and name not in self.config.aliases:
            raise model_not_found(name)

    async def start(self, load: Callable[[], Engine | EngineProcess]) -> None:
        """Load the model (off the event loop), start the engine loop, run one warm-up."""
        try:
            engine = AsyncEngine(await asyncio.to_thread(load), self.metrics)
            engine.on_death = self._on_engine_death
            engine.start()
            self.engine = engine
            self.token_text = TokenText(engine.engine.tokenizer)
            await self._warm_up(engine)
        except Exception:
            log.exception("the model failed to load")
            self.status = "failed"
            self.request_exit(1)
            return
        if self.status == "loading":
            self.status = "ready"
        log.info("ready: serving %s", self.config.model_name)

    async def _warm_up(self, engine: AsyncEngine) -> None:
        prompt = encode(engine.engine.tokenizer, "Hello")
        params = SamplingParams(max_tokens=1, temperature=0)
        stream = await engine.add([GenerateRequest("warmup", prompt, params)])
        async for output in stream:
            if output.error is not None:
                raise output.error

    def _on_engine_death(self, error: BaseException) -> None:
        if self.config.exit_on_engine_failure:
            log.critical(
                "exiting: the engine loop died (run with --no-exit-on-engine-failure to stay up)"
            )
            self.request_exit(1)

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
        if self.engine is not None:
            self.engine.stop()

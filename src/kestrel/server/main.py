"""`kestrel serve`: build the app from the flags and run it on uvicorn."""

import functools
import logging
import os
import signal
import threading
import time

import uvicorn

from kestrel.config import Config, config_from_args
from kestrel.engine.client import EngineClient, EngineStats, LatencyListener
from kestrel.engine.engine import Engine
from kestrel.engine.process import EngineProcessClient
from kestrel.server import faults
from kestrel.server.app import create_app
from kestrel.server.args import served_names
from kestrel.server.limits import TimedH11Protocol
from kestrel.server.state import ServerState

log = logging.getLogger("kestrel.server")


def serve(args) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    faults.parse(os.environ.get(faults.ENV_VAR, ""))  # a bad test spec fails at startup
    exit_code = 0
    server: uvicorn.Server | None = None

    def request_exit(code: int) -> None:
        nonlocal exit_code
        exit_code = exit_code or code
        server.should_exit = True

    config = server_settings(args)
    if config.parallel.data_parallel_size > 1:
        from kestrel.engine.ray_replicas import require_ray

        require_ray()  # before the server starts: a clear error, not a failed load
    load = functools.partial(load_engine, config, args.log_level)
    app = create_app(config.server, load, request_exit=request_exit)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_keep_alive=int(args.timeout),
        timeout_graceful_shutdown=args.shutdown_timeout,
        http=_timed_h11(args.client_timeout),
    )
    server = _Server(config, app.state.kestrel)
    server.run()
    return exit_code


class _Server(uvicorn.Server):
    """SIGTERM drains: /health and new requests turn 503 at once (the socket stays open, so
    clients get an answer, not a refused connection), in-flight requests finish (up to
    --shutdown-timeout), then uvicorn shuts down and the process exits 0. A second signal exits
    at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self.draining = False

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGTERM and not self.draining and not self.should_exit:
            log.info("SIGTERM: draining")
            self.draining = True
            self.state.drain()
            threading.Thread(target=self._exit_when_idle, name="kestrel-drain", daemon=True).start()
            return
        super().handle_exit(sig, frame)

    def _exit_when_idle(self) -> None:
        deadline = time.monotonic() + self.config.timeout_graceful_shutdown
        while not self.state.idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        # what is left of the timeout goes to uvicorn's wait for responses still being sent
        self.config.timeout_graceful_shutdown = max(1.0, deadline - time.monotonic())
        self.should_exit = True


def server_settings(args) -> Config:
    """The server's whole Config from its flags. Every new request waits in the scheduler's
    queue until its next step, free slot or not, so that queue holds -np + --max-queue-depth."""
    model_name, aliases = served_names(args)
    return config_from_args(
        args,
        max_queue_depth=args.max_num_seqs + args.max_queue_depth,
        model_name=model_name,
        aliases=aliases,
        api_key=args.api_key or None,
        allowed_origins=[o.strip() for o in args.allowed_origins.split(",") if o.strip()],
        default_max_tokens=args.max_tokens if args.max_tokens > 0 else None,
    )


def load_engine(
    config: Config, log_level: str, listener: LatencyListener, stats: EngineStats
) -> EngineClient:
    """The engine in its own process (model, runner, scheduler), -dp replicas of it on Ray, or
    a prefill and a decode engine (--disaggregate), with this process's tokenizer and image processor for the routes. The tokenizer is loaded
    first: a GGUF vocabulary is converted and cached then, and the engines find it cached."""
    tokenizer, processor = load_frontend(config)
    if config.parallel.disaggregate:
        from kestrel.server.pd_router import load_disaggregated

        return load_disaggregated(
            config, build_engine, log_level, tokenizer, processor, listener, stats
        )
    build = functools.partial(build_engine, config, log_level)
    if config.parallel.data_parallel_size > 1:
        from kestrel.engine.ray_replicas import load_replicas

        return load_replicas(config, build, tokenizer, processor, listener, stats)
    return EngineProcessClient(build, tokenizer, processor, listener, stats)


def load_frontend(config: Config):
    """(tokenizer, image processor or None) of the model, without its weights."""
    from kestrel.media import MediaLimits
    from kestrel.models.qwen_vl_processor import load_processor
    from kestrel.weights.loader import load_config, load_tokenizer, resolve, takes_images
    from kestrel.weights.shapes import decoder_config, shape_config, shape_tokenizer

    if config.model.shape:
        return shape_tokenizer(decoder_config(shape_config(config.model.shape)).vocab_size), None
    source = resolve(config.model.model)
    model_config = load_config(source)  # first: it registers a family's own config class, if any
    tokenizer = load_tokenizer(source)
    limits = MediaLimits(allowed_local_media_path=config.server.allowed_local_media_path)
    return tokenizer, load_processor(takes_images(model_config), source.path, tokenizer, limits)


def build_engine(config: Config, log_level: str) -> Engine:
    """The Engine (in the engine process): weights on the device, and the test-only fault hooks
    when their variable is set."""
    import torch

    from kestrel.llm import load_engine

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if config.parallel.threads > 0:
        torch.set_num_threads(config.parallel.threads)
    engine, _ = load_engine(config, progress=False, exit_with_workers=True)
    if faults.install_from_env(engine):
        log.warning("TEST-ONLY fault injection is on (%s is set)", faults.ENV_VAR)
    return engine


def _timed_h11(head_timeout: float) -> type[TimedH11Protocol]:
    return type("TimedH11", (TimedH11Protocol,), {"head_timeout": head_timeout})

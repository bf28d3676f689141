"""The FastAPI app factory: routes, error mapping, auth, CORS and metrics middleware.

`create_app(config, load)` serves at once; `load(listener, stats)` builds the engine client on a
worker thread while
/health answers 503, then one warm-up generation runs and /health turns 200.
"""

import asyncio
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

import kestrel
from kestrel.config import ServerConfig
from kestrel.server.auth import APIKeyMiddleware
from kestrel.server.errors import install_error_handlers
from kestrel.server.limits import RequestLimitsMiddleware
from kestrel.server.metrics import HTTPMetricsMiddleware
from kestrel.server.routes import (
    chat,
    completions,
    embeddings,
    health,
    llama,
    lora,
    messages,
    models,
    page,
    responses,
)
from kestrel.server.state import LoadEngine, ServerState


def create_app(
    config: ServerConfig,
    load: LoadEngine | None = None,
    request_exit: Callable[[int], None] | None = None,
) -> FastAPI:
    """`load` builds the engine (None: never ready, e.g. to inspect routes); `request_exit(code)`
    asks the process to end."""
    state = ServerState(config, request_exit)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(state.start(load)) if load else None
        yield
        if task is not None:
            task.cancel()
        state.stop()

    app = FastAPI(title="kestrel", version=kestrel.__version__, lifespan=lifespan)
    app.state.kestrel = state
    routers = (
        chat,
        completions,
        embeddings,
        responses,
        messages,
        models,
        lora,
        llama,
        health,
        page,
    )
    for module in routers:
        app.include_router(module.router)
    install_error_handlers(app)
    _add_middleware(app, state, {path for path, _ in route_table(app)})
    return app


def _add_middleware(app: FastAPI, state: ServerState, routes: set[str]) -> None:
    """The last added runs first: metrics see every response, body limits (413/408), CORS
    answers preflights, then auth."""
    config = state.config
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.allowed_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
        )
    app.add_middleware(
        RequestLimitsMiddleware,
        max_bytes=config.max_request_bytes,
        body_timeout=config.client_timeout,
    )
    app.add_middleware(HTTPMetricsMiddleware, metrics=state.metrics, routes=routes)


def route_table(app: FastAPI) -> list[tuple[str, set[str]]]:
    """Every (path, methods) the app serves, walking included routers (auth tests use it)."""
    table = []

    def walk(routes) -> None:
        for route in routes:
            if hasattr(route, "original_router"):  # FastAPI's included router
                walk(route.original_router.routes)
            elif hasattr(route, "path"):
                table.append((route.path, set(getattr(route, "methods", None) or {"GET"})))

    walk(app.router.routes)
    return table

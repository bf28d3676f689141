"""GET /health (no key needed) and GET /metrics (Prometheus text format)."""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kestrel.server.routes import server_state

router = APIRouter()


@router.get("/health")
async def health(http: Request) -> JSONResponse:
    """200 once the model is loaded and a warm-up generation ran; 503 while loading, draining, or
    after the engine loop died."""
    state = server_state(http)
    status = state.health()
    return JSONResponse(
        {"status": "ok" if status == "ready" else status},
        status_code=200 if status == "ready" else 503,
    )


@router.get("/metrics")
async def metrics(http: Request) -> Response:
    return Response(server_state(http).metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

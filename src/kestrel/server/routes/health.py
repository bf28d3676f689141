"""GET /health (no key needed) and GET /metrics (Prometheus text format)."""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kestrel.server.routes import server_state

router = APIRouter()


@router.get("/health")
async def health(http: Request) -> JSONResponse:
    """200 once the model is loaded and a warm-up generation ran; 503 while loading, draining, or
    after the engine loop died. With -dp, `replicas` lists each replica's status and pid."""
    state = server_state(http)
    status = state.health()
    body = {"status": "ok" if status == "ready" else status}
    replicas = state.engine.replica_status() if state.engine is not None else []
    if replicas:  # -dp: each replica's state; the server is ok while one of them serves
        body["replicas"] = [
            {k: getattr(r, k) for k in ("replica", "status", "pid", "in_flight", "restarts")}
            for r in replicas
        ]
    return JSONResponse(body, status_code=200 if status == "ready" else 503)


@router.get("/metrics")
async def metrics(http: Request) -> Response:
    return Response(server_state(http).metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

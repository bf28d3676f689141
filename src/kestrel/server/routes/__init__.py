"""The HTTP routes, one module per endpoint family."""

from fastapi import Request

from kestrel.server.protocol import ErrorResponse
from kestrel.server.state import ServerState

# error bodies every generating route may answer (documented in the OpenAPI schema)
ERROR_RESPONSES = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "invalid request"),
        (401, "missing or invalid API key"),
        (404, "unknown model"),
        (500, "the request failed in the engine"),
        (503, "loading, overloaded or unhealthy"),
    )
}


def server_state(http: Request) -> ServerState:
    return http.app.state.kestrel

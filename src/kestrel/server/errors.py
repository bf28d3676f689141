"""Every error the server answers, mapped to its body in this one place: OpenAI's

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

or, on the Anthropic Messages route (whose clients parse no other), Anthropic's

    {"type": "error", "error": {"type": str, "message": str}}
"""

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kestrel.engine.client import EngineDeadError
from kestrel.engine.scheduler import QueueFullError
from kestrel.errors import InvalidRequestError

log = logging.getLogger("kestrel.server")

RETRY_AFTER_S = 1


class APIError(Exception):
    """An HTTP error with an OpenAI body: raise it anywhere below a route."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code
        self.headers = headers


class ClientDisconnected(Exception):
    """The client went away before its response was ready (logged as 499, never sent)."""


def model_not_found(name: str) -> APIError:
    return APIError(
        404, f"The model '{name}' does not exist", param="model", code="model_not_found"
    )


def unavailable(message: str) -> APIError:
    return APIError(
        503,
        message,
        "service_unavailable",
        code="service_unavailable",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(error: APIError, path: str = "") -> JSONResponse:
    """The error's response on the route at `path`, in that route's API's shape."""
    if path in ANTHROPIC_PATHS:
        body = anthropic_error_body(error)
    else:
        body = error_body(str(error), error.type, error.param, error.code)
    return JSONResponse(body, status_code=error.status, headers=error.headers)


ANTHROPIC_PATHS = frozenset({"/v1/messages"})
# Anthropic's error types by HTTP status (its overloaded_error is 529; ours stays 503)
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(error: APIError) -> dict:
    default = "invalid_request_error" if error.status < 500 else "api_error"
    kind = _ANTHROPIC_TYPES.get(error.status, default)
    message = str(error)
    if error.param and not message.startswith(error.param):  # the body has no `param` field
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def as_api_error(error: BaseException, request_id: str | None = None) -> APIError:
    """The APIError for any exception: user errors are 4xx, engine trouble 5xx."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, InvalidRequestError):
        return APIError(400, str(error), param=error.param, code=error.code)
    if isinstance(error, QueueFullError):
        return unavailable(f"{error}; retry later")
    if isinstance(error, EngineDeadError):
        return unavailable(str(error))
    if isinstance(error, ClientDisconnected):
        return APIError(499, str(error), code="client_disconnected")
    where = f" (request {request_id})" if request_id else ""
    return APIError(
        500,
        f"the request failed{where}: {type(error).__name__}: {error}",
        "server_error",
        code="internal_error",
    )


def validation_error(error: RequestValidationError) -> APIError:
    """pydantic's first complaint as a 400 naming the field (`messages[0].content`)."""
    first = error.errors()[0]
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, "the body is not valid JSON", code="invalid_json")
    if not loc:
        return APIError(400, "the body must be a JSON object", code="invalid_body")
    param = _param_name(loc)
    message = first.get("msg", "invalid value")
    if first.get("type") == "extra_forbidden":  # routes that list every field they implement
        message = "this server does not support this parameter"
    return APIError(400, f"{param}: {message}", param=param, code=first.get("type"))


def _param_name(loc) -> str:
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif not name:
            name = str(part)
        elif not _is_type_tag(part):
            name += f".{part}"
    return name


def _is_type_tag(part: str) -> bool:
    # pydantic names union members in the location (`str`, `list[int]`, `function-after[...]`)
    return any(c in part for c in "[]-") or part in ("str", "int", "float", "bool", "list", "dict")


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, error: Exception) -> JSONResponse:
        api_error = as_api_error(error)
        if api_error.status >= 500:
            log.error("%s %s failed: %s", request.method, request.url.path, api_error)
        return error_response(api_error, request.url.path)

    async def on_validation(request: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(error), request.url.path)

    async def on_http(request: Request, error: HTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        api_error = APIError(error.status_code, str(error.detail), kind, headers=error.headers)
        return error_response(api_error, request.url.path)

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
    for kind in (APIError, InvalidRequestError, QueueFullError, EngineDeadError, Exception):
        app.add_exception_handler(kind, on_api_error)


def sse_error(error: BaseException, request_id: str | None = None) -> str:
    """The SSE event that ends a failed stream (the `[DONE]` follows)."""
    api_error = as_api_error(error, request_id)
    body = error_body(str(api_error), api_error.type, api_error.param, api_error.code)
    return f"data: {json.dumps(body)}\n\n"


def anthropic_sse_error(error: BaseException, request_id: str | None = None) -> str:
    """The `error` event that ends a failed Anthropic Messages stream."""
    body = anthropic_error_body(as_api_error(error, request_id))
    return f"event: error\ndata: {json.dumps(body)}\n\n"

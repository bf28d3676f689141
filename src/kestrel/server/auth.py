"""`--api-key`: every route but /health and the chat page (GET /) needs the key, as
`Authorization: Bearer KEY` or `X-Api-Key: KEY`. A middleware, not a per-route dependency, so no
new route can slip through. The page is static; it asks for the key when the API answers 401."""

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from kestrel.server.errors import APIError, error_response

OPEN_PATHS = frozenset({"/health"})
OPEN_PAGES = frozenset({"/"})  # open to GET (and HEAD) only


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _is_open(scope) or self._authorized(scope):
            return await self.app(scope, receive, send)
        error = APIError(
            401,
            "missing or invalid API key",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await error_response(error, scope["path"])(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        given = headers.get(b"x-api-key", b"")
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer":
            given = token.strip()
        return hmac.compare_digest(given, self.key)  # constant time


def _is_open(scope: Scope) -> bool:
    path = scope["path"]
    return path in OPEN_PATHS or (path in OPEN_PAGES and scope["method"] in ("GET", "HEAD"))

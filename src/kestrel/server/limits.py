"""What a client may cost the server: body size, and time to send its request.

- `RequestLimitsMiddleware`: a body over `--max-request-bytes` gets 413 before it is read whole
  (a too-large Content-Length at once, a chunked body as soon as it passes the limit), and a body
  that takes longer than `--client-timeout` to arrive gets 408. At most the limit is buffered.
- The same middleware answers 400 for a body that is not UTF-8 or whose JSON escapes a lone
  UTF-16 surrogate (`"\ud800"`): such text cannot be tokenized or even sent back in an error.
- `TimedH11Protocol`: uvicorn's h11 protocol closes a connection whose request head (request line
  and headers, at most h11's 16 KiB) has not arrived `--client-timeout` seconds after the
  connection opened or its first byte came (slowloris). Idle keep-alive connections are uvicorn's
  `--timeout`.
"""

import asyncio
import json
import re

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from kestrel.server.errors import APIError, error_response


class _TooLarge(Exception):
    pass


class _ClientLeft(Exception):
    pass


class RequestLimitsMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, body_timeout: float):
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._reject(scope, receive, send, self._too_large())
        try:
            body = await asyncio.wait_for(self._read(receive), self.body_timeout)
        except _ClientLeft:
            return  # nobody to answer
        except _TooLarge:
            return await self._reject(scope, receive, send, self._too_large())
        except TimeoutError:
            error = APIError(
                408, f"the body did not arrive in {self.body_timeout:g} s", code="timeout"
            )
            return await self._reject(scope, receive, send, error)
        if not _valid_unicode(body):
            error = APIError(400, "the body is not valid UTF-8 JSON text", code="invalid_unicode")
            return await self._reject(scope, receive, send, error)
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientLeft
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                raise _TooLarge
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> APIError:
        return APIError(
            413, f"the body is over {self.max_bytes} bytes", param=None, code="request_too_large"
        )

    async def _reject(self, scope: Scope, receive: Receive, send: Send, error: APIError) -> None:
        response = error_response(error, scope["path"])
        response.headers["Connection"] = "close"  # the unread rest of the body is not ours
        await response(scope, receive, send)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _valid_unicode(body: bytes) -> bool:
    """UTF-8, and no JSON string in it holds a lone surrogate (pairs, e.g. escaped emoji, are
    fine). Only a body with a surrogate escape is parsed here."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    if not _SURROGATE_ESCAPE.search(body):
        return True
    try:
        json.loads(body, object_pairs_hook=_check_pairs, parse_constant=float)
    except UnicodeEncodeError:
        return False
    except ValueError:
        return True  # not JSON: the route's parser answers that
    return True


def _check_pairs(pairs: list) -> dict:
    for key, value in pairs:
        for text in (key, *(v for v in _strings(value))):
            text.encode("utf-8")  # raises on a lone surrogate
    return dict(pairs)


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The buffered body as one message, then the real channel (so disconnects still arrive)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class TimedH11Protocol(H11Protocol):
    """Closes connections whose request head is slower than `head_timeout` seconds."""

    head_timeout = 30.0  # set by the server from --client-timeout

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = None
        self._watch_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_head()

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _watch_head(self) -> None:
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting and self._head_timer is None and self.timeout_keep_alive_task is None:
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)
        elif not waiting:
            self._cancel_head_timer()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

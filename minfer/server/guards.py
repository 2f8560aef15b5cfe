"""ASGI guards in front of every endpoint: the API key and the request body size limit.

Both answer with OpenAI's error JSON before any endpoint (or FastAPI's body parsing) runs. The
body is read here, counting bytes as they arrive, so a body over the limit is refused after
`max_request_bytes` bytes, not after the whole of it was buffered and parsed; the endpoint then
gets the body replayed from memory and, after it, the connection's own messages (so it still
sees the client's disconnect).
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minfer.server.errors import error_response


async def _answer(scope: Scope, receive: Receive, send: Send, response) -> None:
    await response(scope, receive, send)


class APIKeyGuard:
    """`Authorization: Bearer KEY` on every path but the open ones; 401 otherwise."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str]):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):  # constant time: no timing oracle on the key
            return await self.app(scope, receive, send)
        message = "a valid API key is required: send `Authorization: Bearer <key>`"
        await _answer(
            scope,
            receive,
            send,
            error_response(401, message, None, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"}),
        )


class BodySizeLimit:
    """Refuse a request body over `max_bytes` with 413, while it is being read."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def too_large(self, size: str) -> object:
        return error_response(
            413,
            f"the request body is {size}, more than --max-request-bytes={self.max_bytes}",
            None,
            "request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _answer(scope, receive, send, self.too_large(f"{int(declared)} bytes"))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await _answer(scope, receive, send, self.too_large("larger"))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

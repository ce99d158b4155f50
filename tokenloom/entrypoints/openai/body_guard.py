"""The body guard (pure ASGI): malformed requests are answered before they reach FastAPI: a wrong content type
(400), an oversized body (413), also for chunked uploads, and a JSON body that breaks a limit checked before
parsing (400, body_limits.py: not UTF-8, too deep, too many values, a field over its size, a lone surrogate).
A body over `OFF_LOOP_BYTES` is checked in a worker thread, so the event loop keeps answering other clients.

File uploads: a route that takes multipart/form-data names itself in ``app.state.multipart_limits``
({path: byte limit}, set by the route's own module); there such a body passes with that size limit and
without the JSON checks, and every other content type is still refused."""
from __future__ import annotations

import json

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenloom.entrypoints.openai.body_limits import OFF_LOOP_BYTES, check_body
from tokenloom.entrypoints.openai.errors import error_body


def _multipart_limit(scope: Scope) -> int | None:
    """The byte limit of a file upload to this path, or None when the path takes no uploads."""
    app = scope.get("app")
    limits = getattr(getattr(app, "state", None), "multipart_limits", None)
    if not limits:
        return None
    path = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return limits.get(path)


class BodyGuardMiddleware:
    """Reject wrong content types (400) and bodies over `max_body_bytes` (413) up front.

    The body is read here (bounded) and replayed to the app, so FastAPI never sees an
    oversized one; after the body, `receive` passes through so disconnects still arrive.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        upload_limit = _multipart_limit(scope)
        is_upload = upload_limit is not None and ctype == "multipart/form-data"
        if is_upload and upload_limit is not None:
            limit = upload_limit
        elif ctype and ctype != "application/json" and not ctype.endswith("+json"):
            wanted = "multipart/form-data (a file upload)" if upload_limit is not None else "application/json"
            return await self._reject(send, 400, f"Content-Type must be {wanted}, got {ctype!r}",
                                      "invalid_content_type")
        else:
            limit = self.max_body_bytes
        length = headers.get("content-length")
        if length is not None:
            try:
                if int(length) > limit:
                    return await self._reject(send, 413, self._too_large(limit), "request_too_large")
            except ValueError:
                return await self._reject(send, 400, "invalid Content-Length header", "invalid_request")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                return await self._reject(send, 413, self._too_large(limit), "request_too_large")
            chunks.append(body)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if is_upload:  # the route parses it
            return await self.app(scope, self._replay(chunks, receive), send)
        if len(body) > OFF_LOOP_BYTES:
            refusal = await anyio.to_thread.run_sync(check_body, body)
        else:
            refusal = check_body(body)
        if refusal is not None:
            return await self._reject(send, 400, refusal.message, refusal.code, refusal.param)
        return await self.app(scope, self._replay(chunks, receive), send)

    @staticmethod
    def _replay(chunks: list[bytes], receive: Receive) -> Receive:
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return replay

    @staticmethod
    def _too_large(limit: int) -> str:
        return f"request body too large: the limit is {limit} bytes"

    @staticmethod
    async def _reject(send: Send, status: int, message: str, code: str, param: str | None = None) -> None:
        body = json.dumps(error_body(message, "invalid_request_error", param, code)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

"""HEAD answered as GET without the body (RFC 9110 9.3.2), on every path that answers GET.

FastAPI routes declared with ``@app.get`` take GET only, so ``HEAD /`` (what uptime checkers and
``curl -I`` send) got 405. The request goes on as a GET and only the response's status and headers
(Content-Length included) go back.
"""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HeadAsGetMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)
        ended = False

        async def send_head(message: Message) -> None:
            nonlocal ended
            if message["type"] != "http.response.body":
                return await send(message)
            if not ended:  # the first body part ends the response: a streamed GET is not read to its end
                ended = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})

        await self.app(dict(scope, method="GET"), receive, send_head)

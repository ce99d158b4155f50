"""kv_transfer_params only from a trusted sender (tokenloom/kv_transfer/trust.py decides who is trusted).

`KVTrustMiddleware` checks the X-KV-Transfer-Secret header once per HTTP request and notes the answer for
the length of that request; `check_kv_transfer_params` (called where every API's request becomes
SamplingParams) answers 400 in OpenAI's shape when a request's params are not taken. Requests that do not
come through the middleware (a batch file's lines) are never trusted.
"""
from __future__ import annotations

from contextvars import ContextVar

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenloom.config import KVTransferConfig
from tokenloom.core.json_types import JsonValue
from tokenloom.entrypoints.openai.errors import BadRequestError
from tokenloom.kv_transfer.trust import SECRET_HEADER, refusal, secret_matches

_SECRET_SHOWN: ContextVar[bool] = ContextVar("tokenloom_kv_secret_shown", default=False)
_HEADER = SECRET_HEADER.encode()


class KVTrustMiddleware:
    def __init__(self, app: ASGIApp, config: KVTransferConfig | None) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.config is None or not self.config.kv_secret:
            return await self.app(scope, receive, send)
        sent = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == _HEADER), None)
        token = _SECRET_SHOWN.set(secret_matches(self.config, sent))
        try:
            return await self.app(scope, receive, send)
        finally:
            _SECRET_SHOWN.reset(token)


def check_kv_transfer_params(params: dict[str, JsonValue] | None, config: KVTransferConfig | None) -> None:
    """400 unless this HTTP request may set `params` (None: nothing to check)."""
    if params is None:
        return
    reason = refusal(params, config, _SECRET_SHOWN.get())
    if reason is not None:
        raise BadRequestError(reason, param="kv_transfer_params", code="untrusted_kv_transfer")

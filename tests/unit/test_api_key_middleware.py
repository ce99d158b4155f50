"""ApiKeyMiddleware: constant-time comparison, open paths (/health; /metrics needs the key)."""
import asyncio
import hmac

import httpx

from tokenloom.entrypoints.openai.app import ApiKeyMiddleware


async def _ok(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _status(app, path, key=None):
    async def main():
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return (await c.get(path, headers=headers)).status_code
    return asyncio.run(main())


def test_health_is_open_and_metrics_need_the_key():
    app = ApiKeyMiddleware(_ok, "s3cret")
    assert _status(app, "/health") == 200
    assert _status(app, "/metrics") == 401
    assert _status(app, "/metrics", "s3cret") == 200


def test_every_other_path_needs_the_key():
    app = ApiKeyMiddleware(_ok, "s3cret")
    for path in ("/v1/models", "/v1/completions", "/tokenize", "/version", "/openapi.json", "/docs", "/nope"):
        assert _status(app, path) == 401
        assert _status(app, path, "s3cre") == 401
        assert _status(app, path, "s3cret") == 200


def test_key_is_compared_in_constant_time(monkeypatch):
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    app = ApiKeyMiddleware(_ok, "s3cret")
    assert _status(app, "/v1/models", "guess") == 401
    assert calls == [(b"guess", b"s3cret")]


def test_web_page_files_are_open_but_its_status_endpoint_is_not():
    app = ApiKeyMiddleware(_ok, "s3cret", open_ui=True)
    assert _status(app, "/") == 200
    assert _status(app, "/ui/static/js/engine.js") == 200
    assert _status(app, "/ui/api/status") == 401
    assert _status(app, "/ui/api/status", "s3cret") == 200


def test_without_the_web_page_the_root_needs_the_key():
    app = ApiKeyMiddleware(_ok, "s3cret")
    assert _status(app, "/") == 401
    assert _status(app, "/ui/static/js/engine.js") == 401

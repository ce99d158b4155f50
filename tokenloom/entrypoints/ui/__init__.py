"""The server's web page at `/`: a live engine view and a chat playground (`--no-ui`: off).

Everything the page needs ships in `static/` inside the package (its two JavaScript
libraries are vendored built files, see static/vendor/VENDORED.md), so it works with no
network and no build step. The page talks only to its own origin through relative URLs
(so it also works under --root-path): the OpenAI endpoints for the playground and
`ui/api/status` (status.py) for the engine view, polled about once a second.

The page itself and its static files are public (they hold no data); the status
endpoint shows request ids and is behind --api-key like every API route.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.entrypoints.ui.status import StatusTracker

STATIC_DIR = Path(__file__).parent / "static"
PUBLIC_PATHS = {"/"}
PUBLIC_PREFIX = "/ui/static/"
# The page renders only from its own files: no inline script, no other origin, no plugins. Model
# text is put in with textContent or through a sanitiser; this header is the second wall.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'")


def mount_ui(app: FastAPI, engine: AsyncLLM, api_key_required: bool = False) -> StatusTracker:
    """Add `/`, `/ui/static/*` and `/ui/api/status` to `app`.

    With an API key the page is told so (``<body data-auth="required">``) and asks for the key
    before its first call, rather than learning it from a 401 (which the browser would log as an
    error)."""
    tracker = StatusTracker(engine)
    headers = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}
    page = (STATIC_DIR / "index.html").read_text(encoding="utf-8")
    if api_key_required:
        page = page.replace("<body>", '<body data-auth="required">', 1)

    @app.get("/", include_in_schema=False)
    async def index():
        return HTMLResponse(page, headers=headers)

    @app.get("/ui/api/status", include_in_schema=False)
    async def ui_status():
        return JSONResponse(tracker.snapshot(), headers={"Cache-Control": "no-store"})

    app.mount("/ui/static", StaticFiles(directory=STATIC_DIR), name="ui-static")
    return tracker

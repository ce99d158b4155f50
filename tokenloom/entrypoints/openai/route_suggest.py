"""A 404 for a path the server does not serve names the nearest one it does (``/v1/chat/completion`` ->
``/v1/chat/completions``): typos and another server's paths are the usual reason for a 404 here."""
from __future__ import annotations

import difflib

from starlette.routing import BaseRoute, Route

# How alike (difflib's ratio) a served path must be to be suggested.
SUGGEST_CUTOFF = 0.6


def served_paths(routes: list[BaseRoute]) -> list[str]:
    """The app's fixed paths (no path parameters, no mounted folders), with /docs and the like."""
    return sorted({r.path for r in routes if isinstance(r, Route) and "{" not in r.path})


def nearest_path(path: str, paths: list[str]) -> str | None:
    found = difflib.get_close_matches(path.rstrip("/") or "/", paths, n=1, cutoff=SUGGEST_CUTOFF)
    return found[0] if found else None


def not_found_message(path: str, routes: list[BaseRoute]) -> str:
    suggestion = nearest_path(path, served_paths(routes))
    message = f"{path} is not served here"
    return f"{message}: did you mean {suggestion}?" if suggestion else message

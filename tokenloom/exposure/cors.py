"""Cross-origin access (CORS): closed unless `--allowed-origins` opens it.

A browser lets a web page read a cross-origin reply only when the reply says so
(``Access-Control-Allow-Origin``). A server on localhost answering ``*`` lets any page the user opens
call it and read its answers, so by default no CORS header is sent at all and preflights are not
answered: same-origin callers (the web page at ``/``), curl and SDKs are unaffected. The flags are
vLLM's (``--allowed-origins '["https://app.example"]'``, ``--allowed-methods``, ``--allowed-headers``,
``--allow-credentials``); methods and headers default to any, as vLLM's, once an origin is allowed.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware

from tokenloom.config import env_default


def json_list(raw: str) -> list[str]:
    """vLLM passes CORS lists as JSON ('["http://a.example"]'); a bare comma-separated list is accepted too."""
    text = raw.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a JSON list: {raw}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings: {raw}")
        return value
    return [v.strip() for v in text.split(",") if v.strip()]


json_list.__name__ = "JSON list"


@dataclass
class CorsSettings:
    allowed_origins: list[str] = field(default_factory=list)  # empty: no cross-origin access
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_origins)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "CorsSettings":
        return cls(allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                   allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials)


def add_cors_args(parser: argparse.ArgumentParser) -> None:
    """The CORS flags (each also TOKENLOOM_<NAME>), shared by `tokenloom serve` and `tokenloom router`."""
    c = parser.add_argument_group("CORS (vLLM's flags; closed by default)")
    c.add_argument("--allowed-origins", type=json_list, default=env_default("allowed_origins", [], json_list),
                   help='origins whose web pages may call this server, JSON list, e.g. \'["https://app.example"]\' '
                        '(["*"]: any page); default none: no CORS headers are sent')
    c.add_argument("--allowed-methods", type=json_list, default=env_default("allowed_methods", ["*"], json_list),
                   help='methods allowed cross-origin, JSON list (default ["*"]; applies with --allowed-origins)')
    c.add_argument("--allowed-headers", type=json_list, default=env_default("allowed_headers", ["*"], json_list),
                   help='request headers allowed cross-origin, JSON list (default ["*"]; applies with '
                        '--allowed-origins)')
    c.add_argument("--allow-credentials", action="store_true", default=env_default("allow_credentials", False, bool),
                   help="allow credentials (cookies, Authorization) in cross-origin requests (default off)")


def install_cors(app: Starlette, settings: CorsSettings) -> None:
    """Make `app` answer CORS as `settings` say (call it last: outermost, so preflights are answered before
    any other middleware and every response, a 401 too, carries the headers); nothing when no origin is
    allowed, so no CORS header is ever sent."""
    if settings.enabled:
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins,
                           allow_methods=settings.allowed_methods, allow_headers=settings.allowed_headers,
                           allow_credentials=settings.allow_credentials)

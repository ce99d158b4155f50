"""Where an image URL may point, and its bytes (a blocking call: the server runs it in a thread).

* `data:` URLs: always (base64 only).
* `http(s)://`: only to a host in --allowed-media-domains; fetched with the size limit enforced while the
  body streams and one timeout for the whole transfer; redirects are not followed (a redirect could leave the
  allowed hosts).
* `file://`: only a file under --allowed-local-media-path (symlinks resolved before the check).
Anything else is an `ImageInputError` naming the rule.
"""
from __future__ import annotations

import base64
import binascii
import os
import time
import urllib.parse

import httpx

from tokenloom.config import MultiModalConfig
from tokenloom.multimodal.errors import ImageInputError


def image_bytes(url: str, config: MultiModalConfig, param: str = "image_url") -> bytes:
    """The encoded image a URL names, within `config`'s limits."""
    if not isinstance(url, str) or not url:
        raise ImageInputError("the image URL is empty", param)
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        return _data_url(url, config.max_image_bytes, param)
    if scheme in ("http", "https"):
        return _fetch(url, config, param)
    if scheme == "file":
        return _local_file(url, config, param)
    raise ImageInputError(f"image URLs must be data:, http(s):// or file:// (got scheme {scheme!r})", param)


def _data_url(url: str, max_bytes: int, param: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ImageInputError("a data: image URL must be base64 (data:image/png;base64,...)", param)
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:
        raise ImageInputError(f"the image is larger than {max_bytes} bytes", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError("the data: URL's payload is not valid base64", param) from None


def _fetch(url: str, config: MultiModalConfig, param: str) -> bytes:
    allowed = config.allowed_media_domains
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if not allowed:
        raise ImageInputError("this server fetches no image URLs (start it with --allowed-media-domains); send "
                              "the image as a data: URL", param)
    if host not in {d.lower() for d in allowed}:
        raise ImageInputError(f"image host {host!r} is not in --allowed-media-domains", param)
    deadline = time.monotonic() + config.media_fetch_timeout
    chunks, total = [], 0
    try:
        with httpx.stream("GET", url, timeout=config.media_fetch_timeout, follow_redirects=False) as response:
            if response.status_code != 200:
                raise ImageInputError(f"fetching the image returned HTTP {response.status_code}", param)
            for chunk in response.iter_bytes():
                total += len(chunk)
                if total > config.max_image_bytes:
                    raise ImageInputError(f"the image is larger than {config.max_image_bytes} bytes", param)
                if time.monotonic() > deadline:
                    raise ImageInputError(f"fetching the image took longer than {config.media_fetch_timeout} s",
                                          param)
                chunks.append(chunk)
    except httpx.HTTPError as exc:
        raise ImageInputError(f"the image could not be fetched ({type(exc).__name__})", param) from None
    return b"".join(chunks)


def _local_file(url: str, config: MultiModalConfig, param: str) -> bytes:
    root = config.allowed_local_media_path
    if root is None:
        raise ImageInputError("this server reads no local files (start it with --allowed-local-media-path)", param)
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlsplit(url).path))
    if os.path.commonpath([root, path]) != root:
        raise ImageInputError("the file is outside --allowed-local-media-path", param)
    try:
        size = os.path.getsize(path)
        if size > config.max_image_bytes:
            raise ImageInputError(f"the image is {size} bytes; the limit is {config.max_image_bytes} bytes", param)
        with open(path, "rb") as f:
            return f.read(config.max_image_bytes + 1)
    except OSError:
        raise ImageInputError("the file cannot be read", param) from None

"""Where image URLs may point: http(s) only to allowed hosts, within the byte and time limits, no redirects;
file:// only under the allowed directory; data: URLs base64 only."""
from __future__ import annotations

import base64
import http.server
import threading
import time

import pytest

from tokenloom.config import MultiModalConfig
from tokenloom.multimodal.errors import ImageInputError
from tokenloom.multimodal.image_source import image_bytes

BODY = b"\x89PNG" + b"x" * 2000


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://elsewhere.invalid/cat.png")
            self.end_headers()
            return
        if self.path == "/slow":
            self.send_response(200)
            self.end_headers()
            for _ in range(20):
                self.wfile.write(b"x" * 10)
                self.wfile.flush()
                time.sleep(0.1)
            return
        self.send_response(200 if self.path == "/cat.png" else 404)
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def host():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _config(**kw) -> MultiModalConfig:
    return MultiModalConfig(allowed_media_domains=["127.0.0.1"], **kw)


def test_an_allowed_host_is_fetched(host):
    assert image_bytes(f"{host}/cat.png", _config()) == BODY


def test_no_url_is_fetched_without_allowed_domains(host):
    with pytest.raises(ImageInputError, match="--allowed-media-domains"):
        image_bytes(f"{host}/cat.png", MultiModalConfig())


def test_a_host_not_allowed_is_refused(host):
    with pytest.raises(ImageInputError, match="not in --allowed-media-domains"):
        image_bytes(host.replace("127.0.0.1", "localhost") + "/cat.png", _config())


def test_a_body_over_the_byte_limit_is_cut_off(host):
    with pytest.raises(ImageInputError, match="larger than 1000 bytes"):
        image_bytes(f"{host}/cat.png", _config(max_image_bytes=1000))


def test_a_redirect_is_not_followed(host):
    with pytest.raises(ImageInputError, match="HTTP 302"):
        image_bytes(f"{host}/redirect", _config())


def test_a_transfer_past_the_timeout_is_abandoned(host):
    start = time.monotonic()
    with pytest.raises(ImageInputError, match="longer than 0.5 s|could not be fetched"):
        image_bytes(f"{host}/slow", _config(media_fetch_timeout=0.5))
    assert time.monotonic() - start < 1.5


def test_a_file_under_the_allowed_path_is_read_and_one_outside_is_refused(tmp_path):
    (tmp_path / "a.png").write_bytes(BODY)
    config = MultiModalConfig(allowed_local_media_path=str(tmp_path))
    assert image_bytes(f"file://{tmp_path}/a.png", config) == BODY
    with pytest.raises(ImageInputError, match="outside"):
        image_bytes(f"file://{tmp_path}/../a.png", config)


def test_a_data_url_must_be_base64():
    assert image_bytes("data:image/png;base64," + base64.b64encode(BODY).decode(), MultiModalConfig()) == BODY
    with pytest.raises(ImageInputError, match="base64"):
        image_bytes("data:image/png,rawbytes", MultiModalConfig())

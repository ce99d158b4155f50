"""The web page at / (engine view and playground) in a real headless Chromium, on the real server.

One server (API key on) for the module and one browser; each test gets a fresh browser
context that enters the key. Playwright drives the system Chromium (the Debian package,
which `scripts/setup.sh test` installs); without it the browser tests skip, saying so.
Screenshots of every browser test go to test-artifacts/ui/ (TOKENLOOM_UI_ARTIFACTS overrides).

Generation is slow on two shared CPU cores, so requests ask for few tokens.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from PIL import Image
from server_harness import ServerProcess, metric_values

API_KEY = "ui-test-key"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(os.environ.get("TOKENLOOM_UI_ARTIFACTS",
                                Path(__file__).resolve().parents[2] / "test-artifacts" / "ui"))
# Model text that would run script if it were ever rendered as HTML (no quotes: JSON would escape them).
PAYLOAD = "<script>pw=1</script><img src=x onerror=pw=2>"


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--api-key", API_KEY)
    try:
        yield srv
    finally:
        assert srv.terminate() == 0, srv.log_text()


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("browser: no chromium on PATH: run scripts/setup.sh test as root (apt-get install chromium)")
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM)
        try:
            yield b
        finally:
            b.close()


def _open(browser, server, enter_key: bool = True):
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    page = context.new_page()
    page.problems = []  # console errors and uncaught exceptions
    page.requests = []  # (url, Authorization header) of every request the page made
    page.on("console", lambda m: page.problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: page.problems.append(f"pageerror: {e}"))
    page.on("request", lambda r: page.requests.append((r.url, r.headers.get("authorization"))))
    page.goto(server.url + "/")
    if enter_key:
        page.fill("#key-input", API_KEY)
        page.click("#key-save")
        page.locator("#hdr-model").filter(has_text=server.model).wait_for(timeout=15_000)
    return context, page


@contextmanager
def _page_on(browser, server, name: str):
    context, page = _open(browser, server)
    try:
        yield page
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
        context.close()


@pytest.fixture
def page(browser, server, request):
    with _page_on(browser, server, request.node.name) as page:
        yield page


@pytest.fixture(scope="module")
def llava_server(tiny_llava):
    """A tiny random LLaVA (tests/helpers.py) behind the same key: a model that reads images."""
    srv = ServerProcess("--api-key", API_KEY, model=tiny_llava[0],
                        base_args=["--max-model-len", "256", "--num-blocks", "64", "--log-level", "warning"])
    try:
        yield srv
    finally:
        assert srv.terminate() == 0, srv.log_text()


@pytest.fixture
def llava_page(browser, llava_server, request):
    with _page_on(browser, llava_server, request.node.name) as page:
        yield page


def text(page, selector: str) -> str:
    return page.evaluate("(s) => document.querySelector(s).textContent", selector)


def chat(page, message: str, max_tokens: int, temperature: float = 0.0) -> None:
    page.click("#tab-chat")
    page.fill("#p-max_tokens", str(max_tokens))
    page.fill("#p-temperature", str(temperature))
    page.fill("#chat-input", message)
    page.click("#chat-send")


def wait_chat_done(page, timeout_s: float = 90.0) -> None:
    page.locator("#chat-send:enabled").wait_for(state="attached", timeout=timeout_s * 1000)


def engine_status(server) -> dict:
    r = server.get("/ui/api/status", headers=auth())
    assert r.status_code == 200, r.text
    return r.json()


# ------------------------------------------------------------------ without a browser

def test_status_endpoint_needs_the_api_key(server):
    assert server.get("/ui/api/status").status_code == 401
    assert engine_status(server)["header"]["model"] == server.model


def test_page_and_assets_load_without_the_key_and_say_a_key_is_needed(server):
    page = server.get("/")
    assert page.status_code == 200 and 'data-auth="required"' in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert server.get("/ui/static/vendor/purify.min.js").status_code == 200


def test_head_on_the_page_answers_as_get_without_a_body(server):
    got, head = server.get("/"), httpx.head(server.url + "/", timeout=30)
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]
    assert head.headers["content-length"] == got.headers["content-length"]


# ------------------------------------------------------------------ in the browser

@pytest.mark.ui
def test_page_asks_for_the_key_before_calling_the_api(browser, server):
    context, page = _open(browser, server, enter_key=False)
    try:
        page.locator("#key-dialog[open]").wait_for(timeout=5_000)
        time.sleep(1.0)  # a poll would have gone out by now
        assert not [u for u, _ in page.requests if "/ui/api/" in u or "/v1/" in u]
        assert page.problems == []
    finally:
        context.close()


@pytest.mark.ui
def test_page_loads_with_no_console_errors(page, server):
    page.locator("#hdr-health").filter(has_text="healthy").wait_for(timeout=10_000)
    for tab in ("#tab-chat", "#tab-completions", "#tab-engine"):
        page.click(tab)
    time.sleep(1.5)  # two more polls of the engine view
    assert page.problems == []
    assert text(page, "#hdr-kv").startswith("KV 256 blocks")


@pytest.mark.ui
def test_the_header_says_how_the_engine_holds_the_weights_and_their_memory(page, server):
    """The weights chip comes from what the engine reported, not from the file name alone."""
    header = engine_status(server)["header"]
    page.locator("#hdr-quant").filter(has_text="MiB").wait_for(timeout=10_000)
    chip = text(page, "#hdr-quant")
    assert header["quantization"] in chip
    assert f"{header['weights_bytes'] / 2 ** 20:.0f} MiB" in chip


@pytest.mark.ui
def test_the_key_goes_only_to_this_server(page, server):
    chat(page, "Hi", max_tokens=4)
    wait_chat_done(page)
    origin = server.url.rstrip("/")
    assert all(url.startswith(origin + "/") or url.startswith("data:") for url, _ in page.requests), page.requests
    api = [(u, a) for u, a in page.requests if "/ui/api/" in u or "/v1/" in u]
    assert api and all(a == f"Bearer {API_KEY}" for _, a in api)


@pytest.mark.ui
def test_chat_streams_text(page):
    chat(page, "Name three colours.", max_tokens=8)
    seen: list[str] = []
    deadline = time.time() + 90
    while time.time() < deadline and page.locator("#chat-send:disabled").count():
        content = page.evaluate("() => (document.querySelector('#chat-log .msg.assistant .content') || {}).textContent")
        if content and (not seen or seen[-1] != content):
            seen.append(content)
        time.sleep(0.03)
    assert len(seen) >= 2, f"the answer did not arrive in pieces: {seen}"
    meta = text(page, "#chat-log .msg.assistant .meta")
    assert re.search(r"\d+ prompt \+ \d+ completion tokens", meta) and "TTFT" in meta, meta


@pytest.mark.ui
def test_engine_view_shows_the_running_request_and_counters_move(page):
    before = int(text(page, "#m-gtotal").split()[0])
    # Long enough (several seconds) that the view's once-a-second poll sees the request on a fast machine too.
    chat(page, "Write a long story about a dragon who learns to paint, in five paragraphs.", max_tokens=200)
    page.click("#tab-engine")
    row = page.locator("#requests tbody tr").filter(has_text=re.compile(r"^chatcmpl-"))
    row.first.wait_for(timeout=30_000)
    assert row.first.locator("td").nth(1).text_content() in ("queued", "prefill", "decoding")
    wait_chat_done(page)
    page.wait_for_function(f"() => parseInt(document.querySelector('#m-gtotal').textContent) > {before}",
                           timeout=10_000)
    page.locator("#requests tbody tr").first.wait_for(state="detached", timeout=10_000)


@pytest.mark.ui
def test_stop_button_leaves_no_running_request(page, server):
    aborted = metric_values(server.get("/metrics", headers=auth()).text).get(
        'tokenloom:request_success_total{finished_reason="abort"}', 0)
    chat(page, "Write a very long story about a dragon and a loom.", max_tokens=1500, temperature=1.0)
    page.locator("#chat-log .msg.assistant .content").filter(has_text=re.compile(r"\S")).wait_for(timeout=60_000)
    page.click("#chat-stop")
    wait_chat_done(page, 10)
    assert text(page, "#chat-log .msg.assistant .meta").startswith("stopped")
    deadline = time.time() + 10
    while (s := engine_status(server))["requests"] or s["running"]:
        assert time.time() < deadline, s
        time.sleep(0.2)
    metrics = metric_values(server.get("/metrics", headers=auth()).text)
    after = metrics['tokenloom:request_success_total{finished_reason="abort"}']
    assert after == aborted + 1


@pytest.mark.ui
def test_model_text_with_script_is_shown_as_text(page):
    page.click("#tab-chat")
    page.select_option("#p-format", "json_schema")
    page.fill("#p-schema", json.dumps({"type": "string", "enum": [PAYLOAD]}))
    chat(page, "Say something.", max_tokens=64)
    wait_chat_done(page)
    shown = text(page, "#chat-log .msg.assistant .content")
    assert PAYLOAD in shown, shown
    assert page.locator("#chat-log script, #chat-log img").count() == 0
    assert page.evaluate("() => window.pw") is None


@pytest.mark.ui
def test_completions_show_each_token_logprob_on_hover(page):
    page.click("#tab-completions")
    page.fill("#cp-max_tokens", "4")
    page.fill("#cp-temperature", "0")
    page.click("#comp-send")
    page.locator("#comp-send:enabled").wait_for(timeout=60_000)
    tokens = page.locator("#comp-out .tokens .tok")
    assert tokens.count() >= 2
    first = tokens.first
    logprob = float(first.get_attribute("data-logprob"))
    assert logprob <= 0
    first.hover()
    tip = page.locator("#tooltip")
    tip.wait_for(state="visible", timeout=2_000)
    assert f"logprob {logprob:.3f}" in tip.text_content()


@pytest.mark.ui
def test_engine_view_lists_a_timed_out_request_under_recent_errors(page, server):
    r = server.post("/v1/chat/completions", headers=auth(),
                    json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 50, "timeout": 0.01})
    assert r.status_code == 504, r.text
    page.locator("#errors li").filter(has_text="timed out").first.wait_for(timeout=5_000)


@pytest.mark.ui
def test_schema_editor_shows_only_for_the_json_schema_format(page):
    page.click("#tab-chat")
    assert not page.locator("#p-schema").is_visible()
    page.select_option("#p-format", "json_schema")
    assert page.locator("#p-schema").is_visible()


@pytest.mark.ui
def test_a_text_only_model_offers_no_image_button(page):
    page.click("#tab-chat")
    assert page.locator("#chat-send").is_visible()
    assert not page.locator("#chat-attach").is_visible()


@pytest.mark.ui
def test_an_image_picked_for_a_vision_model_goes_with_the_message_and_shows_in_the_conversation(llava_page, tmp_path):
    picture = tmp_path / "red.png"
    Image.new("RGB", (40, 30), (200, 20, 20)).save(picture)
    page = llava_page
    page.click("#tab-chat")
    page.locator("#chat-attach").wait_for(state="visible", timeout=15_000)
    page.set_input_files("#chat-image", str(picture))
    page.locator("#chat-attachments img").wait_for(timeout=5_000)
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
        chat(page, "What colour is this?", max_tokens=4)
    parts = sent.value.post_data_json["messages"][-1]["content"]
    assert [p["type"] for p in parts] == ["text", "image_url"], parts
    assert parts[1]["image_url"]["url"].startswith("data:image/png;base64,")
    wait_chat_done(page)
    assert page.locator("#chat-log .msg.user .images img").count() == 1
    assert page.locator("#chat-attachments img").count() == 0
    assert page.locator("#chat-log .msg.assistant.error").count() == 0, text(page, "#chat-log .msg.assistant")
    assert re.search(r"\d+ prompt \+ \d+ completion tokens", text(page, "#chat-log .msg.assistant .meta"))

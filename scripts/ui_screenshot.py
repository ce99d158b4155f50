"""Make docs/web-page.png, the picture of the web page in docs/serving.md: the engine view while two
chat requests run on a local server. Usage: .venv/bin/python scripts/ui_screenshot.py URL [OUT]
(needs the system chromium and the test extras' playwright)."""
from __future__ import annotations

import shutil
import sys
import threading
import time

import httpx
from playwright.sync_api import sync_playwright


def main() -> None:
    url = sys.argv[1].rstrip("/")
    out = sys.argv[2] if len(sys.argv) > 2 else "docs/web-page.png"
    body = {"messages": [{"role": "user", "content": "Tell me a story about a loom."}], "max_tokens": 200}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium") or shutil.which("chromium-browser"))
        page = browser.new_page(viewport={"width": 1200, "height": 860})
        page.goto(url + "/")
        page.locator("#hdr-health").filter(has_text="healthy").wait_for(timeout=15_000)
        httpx.post(url + "/v1/chat/completions", json={**body, "max_tokens": 30}, timeout=120)  # latencies
        threads = [threading.Thread(target=httpx.post, args=(url + "/v1/chat/completions",),
                                    kwargs={"json": body, "timeout": 300}) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(1.5)
        time.sleep(8)
        page.screenshot(path=out)
        browser.close()
        for t in threads:
            t.join()


if __name__ == "__main__":
    main()

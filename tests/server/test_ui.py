"""The chat page at `/`, driven in a real Chromium (Playwright) against a live `flatserve serve`.

Needs Debian's `chromium` (scripts/setup.sh installs it where it runs as root with apt); the
browser tests skip, saying so, only where no chromium binary can be found. Set
FLATSERVE_UI_SHOTS=docs/img to rewrite the README's screenshots from this run.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from flatserve.bench.serve import wait_healthy
from tests.server import live

KEY = "ui-key-42"
# The page is under test, not the kernels: the torch paths, and no C++ build at start-up
# (minutes on a busy 2-core box).
FAST = ["--device", "cpu", "--attention-backend", "torch", "--fused-ops", "none", "--cpu-gemm", "torch",
        "--enforce-eager"]
ARGS = ["--api-key", KEY, "--kv-cache-memory", "128MiB", "--max-model-len", "1024",
        "--max-num-batched-tokens", "256",
        "--max-num-seqs", "8", "--served-model-name", "gemma-test"]
NO_CPP = live.NO_CPP + "import sys\nfrom flatserve.cli import main\nsys.exit(main(sys.argv[1:]))\n"
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run"]


def _chromium() -> str | None:
    for c in (os.environ.get("FLATSERVE_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
              shutil.which("chromium-browser")):
        if c and os.access(c, os.X_OK):
            return c
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(extra: list[str], tmp: Path) -> tuple[str, subprocess.Popen]:
    port = _free_port()
    with open(tmp / f"serve-{port}.log", "w") as log:  # a file: an unread pipe fills and blocks
        proc = subprocess.Popen([sys.executable, "-c", NO_CPP, "serve", "--port", str(port), *FAST, *extra],
                                stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, timeout=900)  # a busy 2-core box starts slowly
    return url, proc


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(default_model_path, tmp_path_factory):
    url, proc = _serve(ARGS, tmp_path_factory.mktemp("ui"))
    yield url
    _stop(proc)


@pytest.fixture(scope="module")
def browser():
    exe = _chromium()
    if exe is None:
        pytest.skip("no chromium binary (apt-get install chromium, or scripts/setup.sh as root)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=LAUNCH_ARGS)
        yield b
        b.close()


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(flatserve_\w+) ([0-9.e+-]+)$", text, re.M)}


def _wait(cond, timeout: float, what: str, step: float = 0.1):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _shot(page, name: str) -> None:
    out = os.environ.get("FLATSERVE_UI_SHOTS")
    if not out:
        return
    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path))
    from PIL import Image  # a 64-colour palette keeps the PNGs small in the repo

    Image.open(path).convert("RGB").quantize(64).save(path, optimize=True)


class Page:
    """The page plus every request it sent, so tests check the bodies the browser really posted."""

    def __init__(self, browser, url: str) -> None:
        self.ctx = browser.new_context(viewport={"width": 1100, "height": 720},
                                       permissions=["clipboard-read", "clipboard-write"])
        self.page = self.ctx.new_page()
        self.url, self.sent, self.errors = url, [], []
        self.page.on("request", lambda r: self.sent.append(r))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        # Chromium logs each 401 answer (the page probing for the key) as a console error: expected.
        self.page.on("console", lambda m: m.type == "error" and "401" not in m.text
                     and self.errors.append(m.text))
        self.page.goto(url + "/")

    def chats(self) -> list[dict]:
        return [json.loads(r.post_data) for r in self.sent if r.url.endswith("/v1/chat/completions")]

    def last_reply(self) -> str:
        return self.page.locator(".msg.assistant .body").last.inner_text()

    def close(self) -> None:
        self.ctx.close()


def test_page_and_files_open_without_key_api_still_guarded(server) -> None:
    r = httpx.get(server + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert '<script src="/ui/chat.js"' in r.text and "http" not in r.text.split("<body>")[0]
    for f in ("/ui/chat.js", "/ui/chat.css"):
        assert httpx.get(server + f).status_code == 200
    assert httpx.post(server + "/").status_code == 405
    assert httpx.get(server + "/v1/models").status_code == 401
    assert httpx.get(server + "/metrics").status_code == 401
    assert httpx.get(server + "/ui/other.js").status_code == 401  # no open directory under /ui/


def test_js_never_parses_html() -> None:
    import flatserve.server

    js = (Path(flatserve.server.__file__).parent / "static" / "chat.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in js, sink


def test_chat_stream_stop_regenerate_settings(server, browser) -> None:
    p = Page(browser, server)
    page = p.page
    try:
        # --api-key: the page asks, keeps the key in sessionStorage and sends it as a Bearer header.
        page.wait_for_selector("#key-dialog:not([hidden])")
        page.fill("#key-input", KEY)
        page.click("#key-form button")
        page.wait_for_selector("#model option", state="attached")  # no wait_for_function: the CSP forbids eval
        assert page.eval_on_selector("#model", "s => s.value") == "gemma-test"
        assert page.evaluate("sessionStorage.getItem('flatserve.key')") == KEY
        _wait(lambda: "blocks" in page.inner_text("#kv-text"), 30, "KV usage from /metrics")
        _shot(page, "chat-empty.png")

        # Send: streamed text arrives in pieces, then the stats line.
        page.fill("#system", "You are a concise assistant.")
        page.fill("#max-tokens", "12")
        page.fill("#input", "Write a Python function that adds two numbers.")
        page.press("#input", "Enter")
        seen: set[str] = set()

        def growing() -> bool:
            t = page.locator(".msg.assistant .body").last.inner_text() if page.locator(
                ".msg.assistant").count() else ""
            if t.strip():
                seen.add(t)
            return page.is_enabled("#send")
        _wait(growing, 300, "the first reply", step=0.02)
        assert len(seen) >= 2, f"text did not arrive in pieces: {seen}"
        stats = page.locator(".msg.assistant .stats").last.inner_text()
        assert re.search(r"TTFT [0-9.]+ s · [0-9.]+ tok/s · \d+ tokens", stats), stats
        first = p.chats()[0]
        assert first["stream"] and first["model"] == "gemma-test" and first["max_tokens"] == 12
        assert first["messages"][0] == {"role": "system", "content": "You are a concise assistant."}
        sent_auth = [r.headers.get("authorization") for r in p.sent if "/v1/" in r.url]
        # The first /v1/models goes without a key (the 401 opens the dialog); all later carry it.
        assert sent_auth[0] is None and len(sent_auth) >= 3
        assert all(a == f"Bearer {KEY}" for a in sent_auth[1:]), sent_auth
        _shot(page, "chat-reply.png")

        # Copy puts the raw reply on the clipboard.
        page.locator(".msg.assistant .msg-head .copy").last.click()
        page.wait_for_selector(".msg.assistant .msg-head .copy:text('Copied')")
        conv = json.loads(page.evaluate("sessionStorage.getItem('flatserve.conversation')"))
        assert conv[-1]["content"] and page.evaluate("navigator.clipboard.readText()") == conv[-1]["content"]

        # Temperature / top-p changes reach the request body; the conversation is kept.
        page.fill("#temperature", "1.3")
        page.fill("#top-p", "0.9")
        assert page.inner_text("#temperature-out") == "1.3"
        page.fill("#max-tokens", "400")
        before = _metrics(server)
        page.fill("#input", "Now tell a very long story about a dragon.")
        page.click("#send")
        _wait(lambda: p.last_reply().strip() and _metrics(server)["flatserve_kv_blocks_used"] > 0,
              300, "the second reply to start streaming", step=0.05)
        body = p.chats()[1]
        assert body["temperature"] == 1.3 and body["top_p"] == 0.9 and body["max_tokens"] == 400
        roles = [m["role"] for m in body["messages"]]
        assert roles == ["system", "user", "assistant", "user"], roles

        # Stop aborts the fetch; the server aborts the request and frees its blocks.
        page.click("#stop")
        _wait(lambda: page.is_enabled("#send"), 30, "the page to leave the busy state")
        assert "stopped" in page.locator(".msg.assistant .stats").last.inner_text()
        _wait(lambda: (lambda m: m["flatserve_num_requests_aborted_total"]
                       >= before["flatserve_num_requests_aborted_total"] + 1
                       and m["flatserve_kv_blocks_used"] == 0
                       and m["flatserve_num_requests_running"] == 0)(_metrics(server)),
              30, "the server to abort the request and free its KV blocks")

        # Regenerate: the stopped reply is replaced; the same conversation is sent again.
        page.fill("#max-tokens", "4")
        page.click("#regenerate")
        _wait(lambda: len(p.chats()) == 3 and page.is_enabled("#send"), 300, "the regenerated reply")
        assert p.chats()[2]["messages"] == body["messages"]
        assert page.locator(".msg.assistant").count() == 2
        assert "stopped" not in page.locator(".msg.assistant .stats").last.inner_text()
        assert _metrics(server)["flatserve_kv_blocks_used"] == 0

        # Clear empties the conversation (and its sessionStorage copy).
        page.click("#clear")
        assert page.locator(".msg").count() == 0
        assert page.evaluate("sessionStorage.getItem('flatserve.conversation')") == "[]"
        assert all(r.url.startswith(server) or r.url.startswith("data:") for r in p.sent), \
            [r.url for r in p.sent]  # no CDN, no network fetch
        assert not p.errors, p.errors
    finally:
        p.close()


CRAFTED = [
    "Here is <script>window.__pwned = 1</script> and <img src=x onerror=\"window.__pwned = 2\">",
    " **bold** and `<i>code</i>` and [bad](javascript:window.__pwned=3) [ok](https://example.org)\n\n",
    "```html\n<b>not bold</b><script>window.__pwned = 4</script>\n```\n",
    "- item <u>one</u>\n",
]


def test_injected_markup_in_model_output_renders_as_text(server, browser) -> None:
    p = Page(browser, server)
    page = p.page
    try:
        page.evaluate(f"sessionStorage.setItem('flatserve.key', {json.dumps(KEY)})")
        page.reload()
        page.wait_for_selector("#model option", state="attached")  # no wait_for_function: the CSP forbids eval
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
        chunks += [{"choices": [{"index": 0, "delta": {"content": c}, "finish_reason": None}]} for c in CRAFTED]
        chunks.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}})
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        page.route("**/v1/chat/completions", lambda route: route.fulfill(
            status=200, headers={"content-type": "text/event-stream"}, body=sse))
        page.fill("#input", "echo")
        page.press("#input", "Enter")
        page.wait_for_selector(".msg.assistant .code")
        reply = page.locator(".msg.assistant .body").last
        text = reply.inner_text()
        assert "<script>window.__pwned = 1</script>" in text and 'onerror="window.__pwned = 2"' in text
        assert "<b>not bold</b><script>window.__pwned = 4</script>" in text and "<u>one</u>" in text
        assert page.evaluate("window.__pwned") is None
        assert reply.locator("script, img, b, i, u, iframe").count() == 0
        assert reply.locator("strong").inner_text() == "bold"
        assert reply.locator("code").first.inner_text() == "<i>code</i>"
        hrefs = reply.locator("a").evaluate_all("as => as.map(a => a.href)")
        assert hrefs == ["https://example.org/"], hrefs  # the javascript: link stays text
        assert reply.locator("li").inner_text() == "item <u>one</u>"
        assert not p.errors, p.errors
    finally:
        p.close()


def test_no_ui_flag(tmp_path) -> None:
    from tests.conftest import build_checkpoint

    model = build_checkpoint("qwen3", tmp_path)[0]  # a routing check: a tiny model starts fastest
    url, proc = _serve([str(model), "--no-ui", "--kv-cache-memory", "16MiB", "--max-model-len", "256"], tmp_path)
    try:
        for path in ("/", "/ui/chat.js"):
            r = httpx.get(url + path)
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert httpx.get(url + "/v1/models").status_code == 200
    finally:
        _stop(proc)

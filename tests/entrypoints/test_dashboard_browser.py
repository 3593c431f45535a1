"""The live dashboard in a real headless Chromium, against a real `kvserve serve` with an
API key: the key form, the numbers moving under load, a non-blank rendering, the key kept
across a reload, no overlapping polls, and a clean console."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.deploy.tools import require_tool
from tests.entrypoints.conftest import ServerProcess

CHROMIUM = "/usr/bin/chromium"
API_KEY = "secret"
SERVED_NAME = "dash-llama"
KEY_NAME = "kvserve-api-key"
DASH = "\u2013"
CONCURRENCY = 4
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def chromium() -> str:
    # Checked before the server starts: missing -> fail as root, skip otherwise.
    return require_tool(CHROMIUM, "chromium")


@pytest.fixture(scope="module")
def keyed_server(chromium, llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("dashboard_server") / "server.log"
    server = ServerProcess(llama_dir, log, "--api-key", API_KEY,
                           "--served-model-name", SERVED_NAME, "--log-stats-interval", "1")
    try:
        server.wait_healthy()
        yield server
    finally:
        server.terminate()


def completions_round(base_url: str) -> Callable[[], int]:
    """A callable sending CONCURRENCY greedy completions at once; returns how many finished."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0,
                           timeout=120)
    pool = ThreadPoolExecutor(CONCURRENCY)

    def one(i: int) -> int:
        out = client.completions.create(
            model=SERVED_NAME, prompt=f"Request {i}: the quick brown fox", max_tokens=MAX_TOKENS,
            temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == MAX_TOKENS, out.usage
        return 1

    def run() -> int:
        return sum(pool.map(one, range(CONCURRENCY)))
    run.close = lambda: (pool.shutdown(), client.close())  # type: ignore[attr-defined]
    return run


def _number(text: str | None) -> float | None:
    text = (text or "").strip()
    if not text or text == DASH:
        return None
    return float(text)


def _not_blank(png: Path) -> tuple[int, float]:
    """(distinct colours, share of pixels differing from the most common colour)."""
    try:
        import numpy as np
        from PIL import Image
        pixels = np.asarray(Image.open(png).convert("RGB"))
    except ImportError:
        import matplotlib.image
        import numpy as np
        pixels = (matplotlib.image.imread(str(png))[..., :3] * 255).round().astype("uint8")
    flat = pixels.reshape(-1, 3).astype("uint32")
    codes = (flat[:, 0] << 16) | (flat[:, 1] << 8) | flat[:, 2]
    values, counts = np.unique(codes, return_counts=True)
    return len(values), 1.0 - counts.max() / codes.size


def check_dashboard(browser, base_url: str, api_key: str, model: str,
                    load_round: Callable[[], int], out_dir: Path) -> None:
    """The whole browser scenario; takes the server's URL so it can run against any server
    that serves /dashboard and /v1/stats."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    console: list[tuple[str, str, str]] = []
    page.on("console", lambda m: console.append((m.type, m.text, m.location.get("url", ""))))
    page.on("pageerror", lambda e: console.append(("pageerror", str(e), "")))
    # Every /v1/stats request the page makes, to check the polls never overlap.
    open_polls: set = set()
    polls = {"count": 0, "max_open": 0}

    def started(req) -> None:
        if req.url.split("?")[0].endswith("/v1/stats"):
            open_polls.add(req)
            polls["count"] += 1
            polls["max_open"] = max(polls["max_open"], len(open_polls))
    page.on("request", started)
    page.on("requestfinished", lambda req: open_polls.discard(req))
    page.on("requestfailed", lambda req: open_polls.discard(req))

    def text(el_id: str) -> str:
        return (page.text_content(f"#{el_id}") or "").strip()

    try:
        response = page.goto(f"{base_url}/dashboard")
        assert response is not None and response.status == 200
        assert response.headers.get("content-type", "").startswith("text/html")

        # No key yet: the form, without an error message.
        page.wait_for_selector("#api-key", state="visible", timeout=10_000)
        assert page.is_visible("#api-key-save")
        assert not page.is_visible("#auth-msg")

        # A wrong key: the form again, with the server's own message; nothing kept.
        wrong = httpx.get(f"{base_url}/v1/stats", timeout=10,
                          headers={"Authorization": "Bearer wrong-key"})
        assert wrong.status_code == 401
        assert wrong.json()["error"]["code"] == "invalid_api_key"
        server_message = wrong.json()["error"]["message"]
        page.fill("#api-key", "wrong-key")
        page.click("#api-key-save")
        page.wait_for_selector("#auth-msg", state="visible", timeout=10_000)
        assert text("auth-msg") == server_message
        assert page.is_visible("#api-key")
        assert page.evaluate(f"localStorage.getItem('{KEY_NAME}')") is None

        # The right key: the form goes, the data comes.
        page.fill("#api-key", api_key)
        page.click("#api-key-save")
        page.wait_for_selector("#auth", state="hidden", timeout=10_000)
        page.wait_for_function("document.getElementById('status').textContent === 'Live'",
                               timeout=10_000)
        assert page.evaluate(f"localStorage.getItem('{KEY_NAME}')") == api_key
        assert text("model") == model
        assert text("kv-manager") not in ("", DASH)
        assert text("updated").startswith("updated ")
        assert text("running") not in ("", DASH) and text("waiting") not in ("", DASH)
        finished_before = _number(text("finished")) or 0
        elements_before = page.evaluate("document.getElementsByTagName('*').length")

        # Under load the numbers move.
        stop = threading.Event()
        sent: list[int] = []
        errors: list[BaseException] = []

        def drive() -> None:
            try:
                while not stop.is_set() and len(sent) < 40:
                    sent.append(load_round())
            except BaseException as e:  # noqa: BLE001 - reported by the test thread
                errors.append(e)
        driver = threading.Thread(target=drive, daemon=True)
        t0, polls_before = time.monotonic(), polls["count"]
        driver.start()
        max_gen_tps = 0.0
        finished_seen = finished_before
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not errors:
            max_gen_tps = max(max_gen_tps, _number(text("gen-tps")) or 0.0)
            finished_seen = max(finished_seen, _number(text("finished")) or 0)
            if max_gen_tps > 0 and finished_seen > finished_before and len(sent) >= 2:
                break
            page.wait_for_timeout(250)
        stop.set()
        driver.join(180)
        assert not errors, errors
        assert not driver.is_alive()
        assert max_gen_tps > 0, "generation tokens/s never went above 0"
        assert finished_seen > finished_before, "the finished count never moved"

        # Every finished request shows up in the count, and the charts have lines.
        total = sum(sent)
        page.wait_for_function(
            f"Number(document.getElementById('finished').textContent) >= {finished_before + total}",
            timeout=15_000)
        for path_id in ("line-running", "line-gen-tps", "line-kv"):
            assert page.get_attribute(f"#{path_id}", "d"), f"#{path_id} has no line"
        for el_id in ("ttft-p50", "ttft-p99", "tpot-p50", "tpot-p99"):
            assert _number(text(el_id)) is not None, f"#{el_id} is empty after {total} requests"
        assert "No active alerts" in text("alerts") or page.locator("#alerts li").count() >= 1

        # Polls: one at a time, about once a second (not hammering the server).
        elapsed = time.monotonic() - t0
        assert polls["max_open"] == 1, f"{polls['max_open']} /v1/stats requests overlapped"
        assert polls["count"] - polls_before <= elapsed / 0.9 + 2, (polls, elapsed)
        # Updates change text, they do not pile up elements (alerts may add a few rows).
        elements_after = page.evaluate("document.getElementsByTagName('*').length")
        assert elements_after <= elements_before + 20, (elements_before, elements_after)

        shot = out_dir / "dashboard.png"
        page.screenshot(path=str(shot))
        colours, busy = _not_blank(shot)
        assert colours >= 100, f"screenshot has only {colours} colours"
        assert busy >= 0.05, f"screenshot is {1 - busy:.0%} one colour"

        # A reload keeps the key: no form, straight to live data.
        page.reload()
        page.wait_for_function("document.getElementById('status').textContent === 'Live'",
                               timeout=10_000)
        assert not page.is_visible("#api-key")
        assert page.evaluate(f"localStorage.getItem('{KEY_NAME}')") == api_key
        assert text("model") == model
        page.wait_for_timeout(1500)
    finally:
        context.close()

    # The only console output: Chromium's own "Failed to load resource ... 401" lines for
    # the two refused polls (no key, wrong key). Nothing from the page itself.
    unexpected = [m for m in console
                  if not (m[0] == "error" and "status of 401" in m[1]
                          and m[2].split("?")[0].endswith("/v1/stats"))]
    assert not unexpected, unexpected
    assert len(console) <= 2, console


def test_dashboard_live_with_api_key(chromium, keyed_server, tmp_path):
    from playwright.sync_api import sync_playwright
    load_round = completions_round(keyed_server.url)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium)
            try:
                check_dashboard(browser, keyed_server.url, API_KEY, SERVED_NAME, load_round,
                                tmp_path)
            finally:
                browser.close()
    except BaseException:
        print(keyed_server.log()[-5000:])
        raise
    finally:
        load_round.close()  # type: ignore[attr-defined]

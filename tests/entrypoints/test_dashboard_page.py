"""Static checks of the dashboard page, no browser: it is small, self-contained (nothing
loaded from elsewhere) and has every element id the browser test and users rely on."""
from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

PAGE = (Path(__file__).resolve().parents[2]
        / "kvserve" / "entrypoints" / "dashboard" / "dashboard.html")
MAX_BYTES = 300 * 1024

REQUIRED_IDS = [
    "status", "api-key", "api-key-save",
    "running", "waiting", "prompt-tps", "gen-tps",
    "ttft-p50", "ttft-p99", "tpot-p50", "tpot-p99",
    "kv-usage", "kv-utilization", "kv-fragmentation", "kv-manager",
    "prefix-hit-rate", "preemptions", "preemptions-rate", "transfer",
    "step-split", "step-ms", "finished", "failed", "batch", "alerts",
]


class _Elements(HTMLParser):
    """Every start tag as (tag, attrs dict), in document order."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag, attrs) -> None:
        self.tags.append((tag, dict(attrs)))

    handle_startendtag = handle_starttag


@pytest.fixture(scope="module")
def text() -> str:
    return PAGE.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def tags(text) -> list[tuple[str, dict[str, str | None]]]:
    parser = _Elements()
    parser.feed(text)
    parser.close()
    return parser.tags


def test_page_is_small():
    size = PAGE.stat().st_size
    assert 0 < size < MAX_BYTES, f"dashboard.html is {size} bytes"


def test_is_a_package_next_to_the_page():
    assert (PAGE.parent / "__init__.py").is_file()


def test_no_external_scripts_or_resources(tags):
    for tag, attrs in tags:
        if tag == "script":
            assert "src" not in attrs, f"<script src={attrs['src']!r}>: the page must be inline"
        for attr in ("src", "href", "action", "srcset", "data", "poster"):
            value = (attrs.get(attr) or "").strip().lower()
            assert not value.startswith(("http:", "https:", "//")), \
                f"<{tag} {attr}={attrs[attr]!r}> loads something from elsewhere"
        if tag == "link":
            rel = (attrs.get("rel") or "").lower()
            href = (attrs.get("href") or "").strip().lower()
            assert rel != "stylesheet", "stylesheets must be inline"
            assert not href or href.startswith("data:"), f"<link href={href!r}>"


def test_no_external_urls_in_code(text):
    # No absolute URL anywhere in the markup, CSS or script: fetches, imports, url(...)
    # and @import all stay on the page's own origin.
    url = re.search(r".{0,40}https?://.{0,40}", text, re.IGNORECASE)
    assert url is None, url.group(0)
    assert not re.search(r"\bimport\s*\(|^\s*import\s|@import", text, re.MULTILINE)
    for call in re.findall(r"fetch\(([^,)]*)", text):
        assert "//" not in call, call


def test_stats_url_is_resolved_against_the_page(text):
    assert "new URL('/v1/stats', location.href)" in text


def test_every_required_id_is_present_once(tags):
    ids = [attrs["id"] for _, attrs in tags if attrs.get("id")]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    assert not dupes, f"duplicate ids: {dupes}"
    missing = [i for i in REQUIRED_IDS if i not in ids]
    assert not missing, f"missing ids: {missing}"


def test_key_form_controls(tags):
    by_id = {attrs.get("id"): (tag, attrs) for tag, attrs in tags if attrs.get("id")}
    assert by_id["api-key"][0] == "input"
    assert by_id["api-key-save"][0] == "button"
    assert by_id["alerts"][0] in ("ul", "ol")


def test_key_is_kept_under_the_documented_name(text):
    assert "'kvserve-api-key'" in text
    assert "'Bearer '" in text

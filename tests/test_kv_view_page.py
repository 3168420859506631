"""The /kv page in a real headless browser (Playwright driving Debian's chromium) against a server.

While requests with a shared prefix and n > 1 run, the page must show shared blocks, its grid's
counts must agree with its counters (one snapshot), and a hovered sequence must show its block
table; once the server is idle its counters must equal /stats and every block be free or cached.
A screenshot of the page under load is checked not blank. The contiguous layout's page shows the
reservations' unused tails.
"""

from __future__ import annotations

import io
import os
import threading
import time

import httpx
import pytest

from tests.test_server import ServerProcess

CHROMIUM = os.environ.get("PAGEDLLM_TEST_CHROMIUM", "/usr/bin/chromium")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extras")
if not os.path.exists(CHROMIUM):
    pytest.skip(f"no browser at {CHROMIUM} (scripts/setup.sh installs Debian's chromium)", allow_module_level=True)

API_KEY = "sk-kv-view"
PREFIX = list(range(5, 29))  # 24 tokens: 6 full blocks of 4 that the requests share
MODEL = "tiny"
SERVE_ARGS = ("--served-model-name", MODEL)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        # --no-sandbox: the tests may run as root (CI does), where chromium's sandbox refuses to start.
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def paged_server(tiny_llama, tmp_path_factory):
    srv = ServerProcess(
        tiny_llama,
        str(tmp_path_factory.mktemp("kv") / "server.log"),
        "--api-key",
        API_KEY,
        "--block-size",
        "4",
        *SERVE_ARGS,
    )
    yield srv
    srv.stop()


def start_load(srv: ServerProcess, max_tokens: int = 160, parallel: int = 4) -> threading.Thread:
    """``parallel`` requests that share a 24-token prefix, each with n = 3, in the background."""

    def one(i: int) -> None:
        body = {
            "model": MODEL,
            "prompt": PREFIX + [40 + i, 41 + i, 42 + i],
            "n": 3,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "seed": i,
            "ignore_eos": True,
        }
        r = httpx.post(srv.url("/v1/completions"), json=body, timeout=120, headers=auth())
        r.raise_for_status()

    def run() -> None:
        workers = [threading.Thread(target=one, args=(i,)) for i in range(parallel)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def auth() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


# Counters and legend counts as shown, read in one evaluation: the page re-renders every poll, so
# separate reads could straddle two snapshots.
READ_PAGE = """() => {
  const counters = {}, legend = {};
  document.querySelectorAll("td[data-stat]").forEach((td) => { counters[td.dataset.stat] = td.textContent; });
  document.querySelectorAll("#legend b").forEach((b) => { legend[b.id.slice(6)] = Number(b.textContent); });
  return { counters, legend };
}"""


def shown(page) -> tuple[dict[str, str], dict[str, int]]:
    v = page.evaluate(READ_PAGE)
    return v["counters"], v["legend"]


def hover_detail(page, selector: str) -> str | None:
    """The detail panel once the selector's row is hovered; None if that row is gone (its sequence
    finished between the poll that listed it and the hover)."""
    # Away first: rows are rebuilt on every poll, and a pointer that does not move enters no new row.
    page.mouse.move(0, 0)
    try:
        page.locator(selector).first.hover(timeout=5_000)
        # the panel fills on the next render; on a loaded machine that can take a poll or two
        page.wait_for_function("() => document.querySelector('#detail').textContent.includes(' -> ')", timeout=3_000)
    except sync_api.TimeoutError:
        return None
    return page.text_content("#detail")


def open_page(browser, srv: ServerProcess):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(srv.url(f"/kv?interval=150#key={API_KEY}"))
    page.wait_for_function("() => Number(document.body.dataset.polls) >= 1", timeout=20_000)
    return page, errors


def wait_next_poll(page) -> None:
    n = int(page.get_attribute("body", "data-polls"))
    page.wait_for_function(f"() => Number(document.body.dataset.polls) > {n}", timeout=10_000)


def test_auth_and_headers(paged_server):
    page = httpx.get(paged_server.url("/kv"), timeout=10)
    assert page.status_code == 200 and "<canvas" in page.text  # static, public: it holds no data
    csp = page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in csp and "connect-src 'self'" in csp and "unsafe-inline" not in csp
    assert page.headers["referrer-policy"] == "no-referrer"
    assert httpx.get(paged_server.url("/kv/blocks"), timeout=10).status_code == 401
    r = httpx.get(paged_server.url("/kv/blocks"), timeout=10, headers=auth())
    assert r.status_code == 200 and r.json()["num_blocks"] == 256
    # idle: the snapshot's own stats are /stats (which adds the step-failure counters)
    assert {k: v for k, v in paged_server.stats().items() if k in r.json()["stats"]} == r.json()["stats"]


def test_page_asks_for_a_key_without_one(browser, paged_server):
    page = browser.new_page()
    page.goto(paged_server.url("/kv"))
    page.wait_for_selector("#keyform.shown", timeout=10_000)
    page.fill("#key", API_KEY)
    page.click("#keyform button")
    page.wait_for_function("() => Number(document.body.dataset.polls) >= 1", timeout=10_000)
    page.close()


def test_page_under_load_shows_sharing_and_agrees_with_stats(browser, paged_server, tmp_path):
    page, errors = open_page(browser, paged_server)
    assert "key=" not in page.url  # the key left the address bar at once
    # One request first, so that the prefix is in the prefix cache when the others arrive.
    start_load(paged_server, max_tokens=1, parallel=1).join(60)
    seen_shared, detail = False, None
    for _ in range(8):  # a round can end before a poll (or a hover) sees it: run another
        load = start_load(paged_server)
        deadline = time.monotonic() + 60
        while load.is_alive() and time.monotonic() < deadline and not (seen_shared and detail):
            wait_next_poll(page)
            # grid (block states) and counters (stats) of one snapshot must agree
            counters, legend = shown(page)
            shared, used = legend["shared"], legend["used"]
            held, total = counters["blocks_held"].split(" / ")
            assert shared + used == int(held) == int(counters["physical_blocks"])
            assert shared == int(counters["kv_shared_blocks"])
            assert sum(legend[s] for s in ("free", "cached", "used", "shared", "swapping")) == int(total)
            if shared > 0:
                seen_shared = True
                shot = page.screenshot(path=str(tmp_path / "kv_under_load.png"), full_page=True)
                text = hover_detail(page, '#seqs div.seq:has-text("shared")')
                if text is not None and "shared with" in text:
                    detail = text
        load.join(120)
        if seen_shared and detail:
            break
    assert seen_shared, "the page never showed a shared block while n > 1 requests with a shared prefix ran"
    assert detail is not None, "hovering a sequence that shares blocks never showed with whom"
    assert "block table (logical -> physical)" in detail and " -> " in detail
    assert_not_blank(shot)

    stats = paged_server.wait_idle()
    wait_next_poll(page)
    counters, legend = shown(page)
    assert counters["blocks_held"] == f"{stats['num_kv_blocks'] - stats['num_free_kv_blocks']} / 256"
    for key in ("kv_shared_blocks", "kv_logical_blocks", "num_preemptions", "num_requests_running"):
        assert counters[key] == str(stats[key]), key
    assert counters["prefix_hit_rate"].endswith(f"({stats['prefix_cache_hits']}/{stats['prefix_cache_queries']})")
    assert stats["prefix_cache_hits"] > 0
    # idle: every block free or holding a cached prefix, and the shared prefix is among the cached
    assert legend["used"] == legend["shared"] == legend["swapping"] == 0
    assert legend["free"] + legend["cached"] == 256 and legend["cached"] >= len(PREFIX) // 4
    assert not errors, errors
    page.close()


def assert_not_blank(png: bytes) -> None:
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("RGB")
    colors = img.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 8, "screenshot is blank"
    # the grid's in-use and shared colours (kv_view.html) are on it
    present = {c for _, c in colors}
    assert (61, 122, 224) in present, "no block in use on the screenshot"
    assert any(r > g > b and r - b > 100 for r, g, b in present), "no shared (orange) block on the screenshot"


def test_contiguous_page_shows_reservation_tails(browser, tiny_llama, tmp_path):
    srv = ServerProcess(
        tiny_llama,
        str(tmp_path / "server.log"),
        "--api-key",
        API_KEY,
        "--block-size",
        "4",
        "--kv-layout",
        "contiguous",
        "--reserve",
        "pow2",
        *SERVE_ARGS,
    )
    try:
        page, errors = open_page(browser, srv)
        seen_tail = False
        # A round can end before a poll and a hover land on a reservation's tail (on a loaded
        # machine, inside the full suite, one round of 300 tokens once did): run another.
        for _ in range(4):
            load = start_load(srv, max_tokens=300)
            deadline = time.monotonic() + 90
            while load.is_alive() and time.monotonic() < deadline and not seen_tail:
                wait_next_poll(page)
                counters, legend = shown(page)
                reserved, used = legend["reserved"], legend["used"]
                assert reserved + used == int(counters["physical_blocks"])
                if reserved > 0:
                    # a sequence whose reservation has blocks without a token yet
                    sid = page.evaluate(
                        "(() => { const s = kvView.last; return (s.seqs.find((q) =>"
                        " q.reserved_tokens - q.num_tokens >= s.block_size) || {}).seq_id; })()"
                    )
                    if sid is None:
                        continue
                    detail = hover_detail(page, f'#seqs div.seq[data-seq="{sid}"]')
                    seen_tail = detail is not None and "unused tail" in detail
            load.join(120)
            if seen_tail:
                break
        assert seen_tail, "hovering a sequence with an unused reservation never showed its tail"
        srv.wait_idle()
        wait_next_poll(page)
        legend = shown(page)[1]
        assert legend["free"] == 256 and legend["reserved"] == legend["used"] == 0
        assert not errors, errors
        page.close()
    finally:
        srv.stop()

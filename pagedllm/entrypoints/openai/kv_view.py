"""The live KV cache view: the /kv page and the /kv/blocks JSON it polls.

/kv is one self-contained file (kv_view.html: no CDN, works offline) that holds no data, so it is
public like /health; everything it shows comes from /kv/blocks, which the server's API key guards
like /stats. The page takes the key from the URL's fragment (``/kv#key=...``: a fragment is never
sent to the server, so it stays out of access logs and proxies), keeps it in sessionStorage (this
tab only), wipes it from the address bar and sends it as a Bearer header; without one it asks.

The page's Content-Security-Policy allows only its own inline script and style (by hash) and
requests to this server, and forbids framing: an injected string cannot run, and no other site can
show the page or read the key.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Awaitable, Callable
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse

PAGE_PATH = "/kv"


def _inline_hash(html: str, tag: str) -> str:
    m = re.search(rf"<{tag}>(.*?)</{tag}>", html, re.S)
    assert m is not None, f"kv_view.html has no <{tag}>"
    return "'sha256-" + base64.b64encode(hashlib.sha256(m.group(1).encode()).digest()).decode() + "'"


def load_page() -> tuple[str, dict[str, str]]:
    """The page and the headers it is served with."""
    html = resources.files(__package__).joinpath("kv_view.html").read_text(encoding="utf-8")
    csp = (
        f"default-src 'none'; script-src {_inline_hash(html, 'script')}; style-src {_inline_hash(html, 'style')}; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    headers = {
        "Content-Security-Policy": csp,
        "Referrer-Policy": "no-referrer",
        "X-Content-Type-Options": "nosniff",
        "Cache-Control": "no-store",
    }
    return html, headers


def add_kv_view_routes(app: FastAPI, snapshot: Callable[[int | None], Awaitable[dict]], responses: dict) -> None:
    """``snapshot``: the engine's KV blocks (EngineClient.get_kv_blocks, errors already mapped), of
    one data-parallel replica (None: the first)."""
    html, headers = load_page()

    @app.get(PAGE_PATH, response_class=HTMLResponse, include_in_schema=False)
    async def kv_page() -> HTMLResponse:
        return HTMLResponse(html, headers=headers)

    @app.get(PAGE_PATH + "/blocks", responses=responses)
    async def kv_blocks(replica: int | None = None) -> JSONResponse:
        """Every KV block's state (base64, one byte a block: see state_names), the shared blocks'
        refcounts, each sequence's block table, and /stats of the same moment. ``replica``: whose
        KV cache with data parallelism (default 0)."""
        return JSONResponse(await snapshot(replica), headers={"Cache-Control": "no-store"})

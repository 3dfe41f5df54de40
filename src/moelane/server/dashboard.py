"""The dashboard: `/dashboard`, one page whose script and style ship in `static/` (nothing is fetched from the
network at run time: its Content-Security-Policy allows this server alone), drawn from `GET /v1/stats`
(sampler.py; the schema is stats.py's `StatsResponse`); and `report_html`, the same page as one self-contained file
for a recorded trace (`moelane trace analyze --html`).

This module imports no web framework at its top, so that writing a report does not load the server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI

STATIC = Path(__file__).with_name("static")
MEDIA = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")  # fmt: skip
STYLE_TAG = '<link rel="stylesheet" href="dashboard/static/dashboard.css">'
SCRIPT_TAG = '<script src="dashboard/static/dashboard.js"></script>'


def static_text(name: str) -> str:
    return (STATIC / name).read_text(encoding="utf-8")


def report_html(stats: dict[str, Any], title: str) -> str:
    """The dashboard page for one `StatsResponse` object, script, style and data inlined: a file that opens
    anywhere, offline. `title`: the page's title."""
    page = static_text("dashboard.html")
    data = json.dumps(stats, allow_nan=False, separators=(",", ":")).replace("</", "<\\/").replace("<!--", "<\\!--")
    page = page.replace("<title>moelane dashboard</title>", f"<title>{_escape(title)}</title>")
    page = page.replace(STYLE_TAG, f"<style>\n{static_text('dashboard.css')}</style>")
    script = static_text("dashboard.js").replace("</", "<\\/")
    return page.replace(SCRIPT_TAG, f'<script id="moelane-data" type="application/json">{data}</script>\n'
                                     f"<script>\n{script}</script>")  # fmt: skip


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def add_dashboard(app: FastAPI, sampler: Any) -> None:
    """Register `GET /v1/stats` (the sampler's JSON), `/dashboard` and its static files on a FastAPI app."""
    from fastapi import Response
    from starlette.concurrency import run_in_threadpool

    from moelane.server.errors import error_body
    from moelane.server.stats import StatsResponse

    page = static_text("dashboard.html")

    @app.get("/v1/stats", response_model=StatsResponse)
    async def stats() -> Response:
        # (off the event loop: a sample takes the expert store's lock for a moment)
        return Response(await run_in_threadpool(sampler.body), media_type="application/json")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        return Response(page, media_type="text/html; charset=utf-8",
                        headers={"Content-Security-Policy": CSP, "Cache-Control": "no-store"})  # fmt: skip

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in MEDIA:
            body = json.dumps(error_body(f"no dashboard file {name!r}", "invalid_request_error", None, "not_found"))
            return Response(body, status_code=404, media_type="application/json")
        return Response(static_text(name), media_type=MEDIA[name])

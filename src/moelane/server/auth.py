"""The API key (`--api-key`, or MOELANE_API_KEY): a bearer token every endpoint asks for, as OpenAI clients send it
(`Authorization: Bearer KEY`), except `/health`, which load balancers and uptime checks call without one.

A browser cannot send a header when it navigates, so the dashboard is opened once as `/dashboard?key=KEY`: the key
is checked, answered with a cookie and a redirect to `/dashboard` (the key leaves the address bar; `moelane serve`
hides it in its access log too). The cookie holds an HMAC of the key, not the key, and is taken for the dashboard's
own GETs alone (its page, its static files, `/v1/stats`): it never authorizes a generation.

Invariants: every key comparison is constant-time (`hmac.compare_digest`); a request that is refused never reaches
the app; the refusal is a 401 with an OpenAI error body (`invalid_api_key`) and `WWW-Authenticate: Bearer`.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any
from urllib.parse import parse_qs

from starlette.requests import cookie_parser
from starlette.responses import JSONResponse, RedirectResponse

from moelane.server.errors import error_body

OPEN_PATHS = frozenset({"/health"})
DASHBOARD = "/dashboard"
COOKIE = "moelane_dashboard"
# What the cookie lets a browser GET: the dashboard's page, its files, and the numbers it draws.
COOKIE_PATHS = (DASHBOARD, f"{DASHBOARD}/", "/v1/stats")


def cookie_token(key: str) -> str:
    """The cookie's value: an HMAC of the key (the cookie never holds the key itself)."""
    return hmac.new(key.encode(), b"moelane dashboard", hashlib.sha256).hexdigest()


def _header(scope: dict[str, Any], name: bytes) -> bytes:
    return next((bytes(value) for key, value in scope["headers"] if key == name), b"")


def _cookie_path(path: str) -> bool:
    return path in COOKIE_PATHS or path.startswith(f"{DASHBOARD}/")


class ApiKey:
    """ASGI middleware: refuses every request but `/health` that does not carry the key."""

    def __init__(self, app: Any, key: str) -> None:
        if not key:
            raise ValueError("the API key must not be empty")
        self.app, self.key, self.token = app, key.encode(), cookie_token(key).encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        given = parse_qs(scope["query_string"].decode("latin-1")).get("key") if scope["path"] == DASHBOARD else None
        if given and hmac.compare_digest(given[0].encode(), self.key):
            response = RedirectResponse(DASHBOARD, status_code=303)
            response.set_cookie(COOKIE, self.token.decode(), httponly=True, samesite="strict")
            await response(scope, receive, send)
            return
        message = ("open the dashboard as /dashboard?key=YOUR_KEY" if scope["path"] == DASHBOARD else
                   "this server needs an API key: send it as 'Authorization: Bearer KEY'")  # fmt: skip
        body = error_body(f"missing or wrong API key; {message}", "invalid_request_error", None, "invalid_api_key")
        await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)

    def _allowed(self, scope: dict[str, Any]) -> bool:
        scheme, _, given = _header(scope, b"authorization").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.key):
            return True
        if scope["method"] not in ("GET", "HEAD") or not _cookie_path(scope["path"]):
            return False
        cookie = cookie_parser(_header(scope, b"cookie").decode("latin-1")).get(COOKIE)
        return cookie is not None and hmac.compare_digest(cookie.encode("latin-1"), self.token)

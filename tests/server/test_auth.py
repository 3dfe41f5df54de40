"""`--api-key`: the official `openai` client gets in with the key and is refused without it (401, an OpenAI error
body); every endpoint but /health wants it; the dashboard is opened once with `?key=`, then its cookie serves its own
GETs and nothing else."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from moelane.commands import build_parser, serve
from moelane.errors import InputError
from moelane.server.app import create_app
from moelane.server.auth import COOKIE, cookie_token
from tests.server.conftest import MODEL, make_engine, running

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def url(tiny_lm: Any) -> Iterator[str]:
    app = create_app(make_engine(tiny_lm), tiny_lm, model_name=MODEL, api_key=KEY)
    with running(app) as base:
        yield base


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def test_the_openai_client_with_the_key_is_served(url: str) -> None:
    c = client(url, KEY)
    assert [m.id for m in c.models.list().data] == [MODEL]
    r = c.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=4, temperature=0)
    assert r.usage is not None and r.usage.completion_tokens == 4
    chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                            temperature=0, stream=True))  # fmt: skip
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("key", ["wrong", KEY + "x", KEY[:-1]])
def test_the_openai_client_with_a_wrong_key_gets_401(url: str, key: str) -> None:
    c = client(url, key)
    for call in (lambda: c.models.list(),
                 lambda: c.completions.create(model=MODEL, prompt="x", max_tokens=2),
                 lambda: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                   max_tokens=2, stream=True)):  # fmt: skip
        with pytest.raises(openai.AuthenticationError) as caught:
            call()
        assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"


GUARDED = [
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/metrics"),
    ("GET", "/v1/stats"),
    ("GET", "/dashboard"),
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
    ("GET", "/nowhere"),
]


@pytest.mark.parametrize(("method", "path"), GUARDED)
def test_every_endpoint_but_health_wants_the_key(url: str, method: str, path: str) -> None:
    r = httpx.request(method, f"{url}{path}", json={"prompt": "x"} if method == "POST" else None)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
    r = httpx.request(method, f"{url}{path}", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    assert httpx.head(f"{url}/health").status_code == 200


def test_the_dashboard_takes_the_key_once_and_its_cookie_only_serves_its_gets(url: str) -> None:
    assert httpx.get(f"{url}/dashboard?key=wrong").status_code == 401
    r = httpx.get(f"{url}/dashboard?key={KEY}")
    assert r.status_code == 303 and r.headers["location"] == "/dashboard"
    assert KEY not in r.headers["set-cookie"] and "httponly" in r.headers["set-cookie"].lower()
    cookies = {COOKIE: r.cookies[COOKIE]}
    assert cookies[COOKIE] == cookie_token(KEY)
    assert httpx.get(f"{url}/v1/stats", cookies=cookies).status_code == 200
    assert httpx.get(f"{url}/dashboard", cookies=cookies).status_code == 200
    assert httpx.get(f"{url}/dashboard/static/dashboard.js", cookies=cookies).status_code == 200
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/metrics")):
        r = httpx.request(method, f"{url}{path}", cookies=cookies, json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 401, path
    assert httpx.get(f"{url}/v1/stats", cookies={COOKIE: "0" * 64}).status_code == 401


def test_serve_takes_the_key_from_its_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    parse = build_parser().parse_args
    monkeypatch.delenv(serve.API_KEY_ENV, raising=False)
    assert serve.api_key(parse(["serve"])) is None
    monkeypatch.setenv(serve.API_KEY_ENV, "from-env")
    assert serve.api_key(parse(["serve"])) == "from-env"
    assert serve.api_key(parse(["serve", "--api-key", "from-flag"])) == "from-flag"
    with pytest.raises(InputError, match="--api-key must not be empty"):
        serve.check_args(parse(["serve", "--api-key", " "]))


def test_the_access_log_hides_a_key_in_a_query() -> None:
    record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", f"/dashboard?key={KEY}&x=1", "1.1", 303), None)  # fmt: skip
    assert serve.HiddenKey().filter(record)
    assert KEY not in record.getMessage() and "/dashboard?key=...&x=1" in record.getMessage()

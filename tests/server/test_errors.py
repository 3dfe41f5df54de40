"""Malformed and impossible requests over raw HTTP: each gets a 4xx with an OpenAI error body and a clear message,
never a 5xx or a hang."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL

GOOD = {"model": MODEL, "prompt": "def f", "max_tokens": 2, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BIAS_PAST = dict.fromkeys(map(str, range((1 << 18) + 1)), 1)  # more tokens than any vocabulary has


@pytest.fixture(scope="module")
def url(tiny_lm: Any) -> Any:
    from tests.server.conftest import create_app, make_engine, running

    with running(create_app(make_engine(tiny_lm), tiny_lm, model_name=MODEL)) as base:
        yield base


CASES = [
    ("bad json", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, "not valid JSON"),
    ("not an object", "/v1/completions", [1, 2], 400, "must be a JSON object, not an array"),
    ("a string, not an object", "/v1/chat/completions", b'"hi"', 400, "must be a JSON object, not a string"),
    ("a number, not an object", "/v1/completions", b"5", 400, "must be a JSON object, not a number"),
    ("null, not an object", "/v1/completions", b"null", 400, "must be a JSON object, not null"),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("prompt wrong type", "/v1/completions", {**GOOD, "prompt": 3}, 400, "prompt"),
    ("max_tokens wrong type", "/v1/completions", {**GOOD, "max_tokens": "many"}, 400, "max_tokens"),
    ("max_tokens float", "/v1/completions", {**GOOD, "max_tokens": 2.5}, 400, "max_tokens"),
    ("max_tokens negative", "/v1/completions", {**GOOD, "max_tokens": -5}, 400, "max_tokens"),
    ("max_tokens zero", "/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens huge", "/v1/completions", {**GOOD, "max_tokens": 10**12}, 400, "max_tokens is too large"),
    ("prompt over context", "/v1/completions", {**GOOD, "prompt": "To be, or not " * 400}, 400, "context length"),
    ("ids over context", "/v1/completions", {**GOOD, "prompt": [5] * 600}, 400, "context length"),
    ("token id out of range", "/v1/completions", {**GOOD, "prompt": [1, 10**6]}, 400, "token ids"),
    ("empty prompt", "/v1/completions", {**GOOD, "prompt": ""}, 400, "empty"),
    ("one of several prompts empty", "/v1/completions", {**GOOD, "prompt": ["a", ""]}, 400, "empty"),
    ("one of several over context", "/v1/completions", {**GOOD, "prompt": [[5], [5] * 600]}, 400, "context length"),
    ("too many prompts", "/v1/completions", {**GOOD, "prompt": ["a"] * 129}, 400, "at most 128 prompts"),
    ("more choices than held", "/v1/completions", {**GOOD, "prompt": ["a", "b"], "n": 41}, 400, "82 choices"),
    ("unknown model", "/v1/completions", {**GOOD, "model": "gpt-17"}, 404, "does not exist"),
    ("temperature negative", "/v1/completions", {**GOOD, "temperature": -1}, 400, "temperature"),
    ("top_p zero", "/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("temperature a boolean", "/v1/completions", {**GOOD, "temperature": True}, 400, "temperature"),
    ("top_p a string", "/v1/completions", {**GOOD, "top_p": "0.5"}, 400, "top_p"),
    ("stream a number", "/v1/completions", {**GOOD, "stream": 1}, 400, "stream"),
    ("n zero", "/v1/completions", {**GOOD, "n": 0}, 400, "n"),
    ("n over 128", "/v1/chat/completions", {**CHAT, "n": 129}, 400, "n"),
    ("stop wrong type", "/v1/completions", {**GOOD, "stop": 5}, 400, "stop"),
    ("too many stops", "/v1/completions", {**GOOD, "stop": list("abcde")}, 400, "stop"),
    ("stop too long", "/v1/completions", {**GOOD, "stop": ["a", "x" * 1025]}, 400, "at most 1024"),
    ("seed wrong type", "/v1/completions", {**GOOD, "seed": "x"}, 400, "seed"),
    ("chat no messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("chat bad role", "/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("chat user without content", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}, 400, "content"),
    (
        "chat null content",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "system", "content": None}, {"role": "user", "content": "hi"}]},
        400,
        "needs content",
    ),
    ("chat unknown model", "/v1/chat/completions", {**CHAT, "model": "nope"}, 404, "does not exist"),
    ("chat huge max_tokens", "/v1/chat/completions", {**CHAT, "max_tokens": 1 << 40}, 400, "too large"),
    ("chat both limits", "/v1/chat/completions", {**CHAT, "max_completion_tokens": 2, "max_tokens": 4096}, 400, "fit"),
    ("penalty out of range", "/v1/completions", {**GOOD, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("bias key not an id", "/v1/completions", {**GOOD, "logit_bias": {"x": 1}}, 400, "token ids"),
    ("bias key a unicode digit", "/v1/completions", {**GOOD, "logit_bias": {"\u00b2": 1}}, 400, "token ids"),
    ("bias value too big", "/v1/completions", {**GOOD, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("bias id out of range", "/v1/completions", {**GOOD, "logit_bias": {"99999999": 1}}, 400, "out of range"),
    ("bias of more tokens than any vocabulary", "/v1/completions", {**GOOD, "logit_bias": BIAS_PAST}, 400, "262144"),
    ("logprobs over 5", "/v1/completions", {**GOOD, "logprobs": 6}, 400, "logprobs"),
    ("best_of", "/v1/completions", {**GOOD, "best_of": 3}, 400, "best_of"),
    ("suffix", "/v1/completions", {**GOOD, "suffix": "}"}, 400, "suffix is not supported"),
    ("chat top_logprobs alone", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "needs logprobs"),
    (
        "chat top_logprobs over 20",
        "/v1/chat/completions",
        {**CHAT, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    (
        "chat json_schema without its schema",
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_schema"}},
        400,
        "response_format",
    ),
    (
        "chat json schema of an unknown type",
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "tuple"}}}},
        400,
        "response_format",
    ),
    (
        "completion json schema that accepts nothing",
        "/v1/completions",
        {**GOOD, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}},
        400,
        "response_format",
    ),
    (
        "chat strict json schema with a keyword it cannot hold",
        "/v1/chat/completions",
        {
            **CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "strict": True, "schema": {"uniqueItems": True}},
            },
        },
        400,
        "response_format",
    ),
    (
        "chat response_format of an unknown type",
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "yaml"}},
        400,
        "response_format",
    ),
    (
        "chat tools",
        "/v1/chat/completions",
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tools",
    ),
    ("unknown route", "/v1/embeddings", GOOD, 404, "Not Found"),
    (
        "prompt a lone surrogate",
        "/v1/completions",
        b'{"model": "tiny", "prompt": "a\\ud800"}',
        400,
        "not valid Unicode",
    ),
    (
        "chat a lone surrogate",
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff b"}], "stream": true}',
        400,
        "not valid Unicode",
    ),
    (
        "stop a lone surrogate",
        "/v1/completions",
        b'{"prompt": "a", "stop": ["x", "a\\ud800"]}',
        400,
        "not valid Unicode",
    ),
    ("temperature NaN", "/v1/completions", b'{"prompt": "a", "temperature": NaN}', 400, "finite number"),
    ("top_p Infinity", "/v1/completions", b'{"prompt": "a", "top_p": Infinity}', 400, "finite number"),
    ("penalty -Infinity", "/v1/completions", b'{"prompt": "a", "presence_penalty": -Infinity}', 400, "finite"),
    ("bias NaN", "/v1/completions", b'{"prompt": "a", "logit_bias": {"5": NaN}}', 400, "finite number"),
    ("too many messages", "/v1/chat/completions", {**CHAT, "messages": CHAT["messages"] * 2049}, 400, "at most 2048"),
    ("body not UTF-8", "/v1/completions", b'{"prompt": "caf\xe9"}', 400, "not valid JSON (not UTF-8"),
    ("body nested too deeply", "/v1/completions", b'{"x": ' + b"[" * 10**5 + b"]" * 10**5 + b"}", 400, "too deeply"),
]


@pytest.mark.parametrize(("path", "body", "status", "needle"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_gets_clear_4xx(url: str, path: str, body: Any, status: int, needle: str) -> None:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    for stream in (False, True):
        if isinstance(body, dict) and stream and "stream" not in body:
            kwargs = {"json": {**body, "stream": True}}
        r = httpx.post(f"{url}{path}", timeout=30, headers={"content-type": "application/json"}, **kwargs)  # type: ignore[arg-type]
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert needle.lower() in error["message"].lower(), error
        assert set(error) == {"message", "type", "param", "code"}


def test_off_states_of_unsupported_fields_are_accepted(url: str) -> None:
    """Clients that send these fields in their off state (as many do by default) are served."""
    off = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "user": "u"}
    r = httpx.post(f"{url}/v1/completions", json={**GOOD, **off, "best_of": 1, "logprobs": None, "suffix": ""},
                   timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
    chat = {**CHAT, **off, "logprobs": False, "top_logprobs": 0, "tools": [], "response_format": {"type": "text"},
            "modalities": ["text"], "audio": None}  # fmt: skip
    r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 200, r.text


def test_wrong_method_and_good_request_still_served(url: str) -> None:
    r = httpx.get(f"{url}/v1/completions", timeout=30)
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.post(f"{url}/v1/completions", json=GOOD, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [
        ("/v1/completions", {**GOOD, "max_tokens": 10**12}, "max_tokens", "context_length_exceeded"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 1 << 40}, "max_tokens", "context_length_exceeded"),
        (
            "/v1/chat/completions",
            {**CHAT, "max_tokens": None, "max_completion_tokens": 1 << 40},
            "max_completion_tokens",
            "context_length_exceeded",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "max_tokens": 1 << 40, "max_completion_tokens": 2},
            "max_tokens",
            "context_length_exceeded",
        ),
        ("/v1/completions", {**GOOD, "prompt": [5] * 600}, "prompt", "context_length_exceeded"),
        ("/v1/completions", {**GOOD, "prompt": "To be, or not " * 4000}, "prompt", "context_length_exceeded"),
        ("/v1/completions", {**GOOD, "prompt": ""}, "prompt", "invalid_value"),
        ("/v1/completions", {**GOOD, "prompt": [1, 10**6]}, "prompt", "invalid_value"),
        ("/v1/completions", {**GOOD, "prompt": ["a", "b"], "n": 41}, "n", "invalid_value"),
        ("/v1/completions", {**GOOD, "prompt": ["a"] * 81}, "prompt", "invalid_value"),  # (n 1: the prompts ask)
        ("/v1/completions", b'{"prompt": "a", "stop": "\\udc00"}', "stop", "invalid_value"),
        ("/v1/completions", b'{"prompt": "a\\ud800"}', "prompt", "invalid_value"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages",
            "invalid_value",
        ),
        ("/v1/completions", b'{"prompt": "a", "temperature": NaN}', "temperature", "invalid_value"),
        ("/v1/completions", b'{"prompt": "\xff"}', None, "invalid_value"),
        ("/v1/completions", {**GOOD, "logit_bias": {"99999999": 1}}, "logit_bias", "invalid_value"),
        # what a check across fields finds is said of the field at fault, not of the whole body
        ("/v1/completions", {**GOOD, "max_tokens": 0}, "max_tokens", "invalid_value"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}, "messages.0.content", "invalid_value"),
        (
            "/v1/chat/completions",
            {**CHAT, "response_format": {"type": "json_schema"}},
            "response_format.json_schema",
            "invalid_value",
        ),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 1, str(10**40): 1}}, "logit_bias", "invalid_value"),
        # (as OpenAI: usage asked of a stream, for a reply that is not streamed)
        (
            "/v1/chat/completions",
            {**CHAT, "stream_options": {"include_usage": True}},
            "stream_options",
            "invalid_value",
        ),
        ("/v1/completions", {**GOOD, "stream": False, "stream_options": {}}, "stream_options", "invalid_value"),
    ],
)
def test_errors_name_their_field_and_kind(url: str, path: str, body: Any, param: str | None, code: str) -> None:
    """Stable `code`s as OpenAI gives them: context_length_exceeded for what does not fit the context,
    invalid_value for other bad values; the message in our words (not pydantic's "Value error, " before them)."""
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{url}{path}", timeout=30, headers={"content-type": "application/json"}, **kwargs)  # type: ignore[arg-type]
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code), r.text
    assert "value error" not in r.json()["error"]["message"].lower(), r.text


def test_model_may_be_left_out(url: str) -> None:
    """As vLLM, llama.cpp and Ollama take it: no `model` means the served one, so a request that leaves it out
    and has another field wrong is told about that field."""
    r = httpx.post(f"{url}/v1/completions", json={k: v for k, v in GOOD.items() if k != "model"}, timeout=30)
    assert r.status_code == 200 and r.json()["model"] == MODEL, r.text
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT["messages"], "temperature": 5}, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "temperature" and "model" not in error["message"], r.text


def test_stop_strings_up_to_the_bound_are_served(url: str) -> None:
    """The bound on a stop string's length (its filter's work runs on the event loop, every token) admits any stop
    string clients use."""
    r = httpx.post(f"{url}/v1/completions", json={**GOOD, "stop": ["x" * 1024, "\nObservation:"]}, timeout=30)
    assert r.status_code == 200, r.text

"""What real clients send that the other server tests do not: `null` in OpenAI's nullable fields (clients that
serialise every field), tool-calling fields in their on and off states, content parts this server cannot read, JSON
sent without its Content-Type, and clients that go away; each gets what the OpenAI API would give, or a clear 4xx,
and the server's log and metrics stay true."""

from __future__ import annotations

import gc
import json
import logging
import socket
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from moelane.model.tokenizer import MAX_CHARS_PER_TOKEN, Tokenizer
from moelane.server.app import create_app
from tests.server.conftest import MODEL, make_engine, running, wait_until

GOOD = {"model": MODEL, "prompt": "def f", "max_tokens": 3, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def url(tiny_lm: Any) -> Any:
    with running(create_app(make_engine(tiny_lm), tiny_lm, model_name=MODEL)) as base:
        yield base


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=30)


def test_null_means_the_default(url: str) -> None:
    """OpenAI's schema makes these fields nullable; a client that sends null for what it leaves unset is served as
    if it had left them out (`model` too: the served model, as vLLM and llama.cpp take it)."""
    nulls = {"model": None, "top_p": None, "n": None, "presence_penalty": None, "frequency_penalty": None,
             "stream": None, "seed": None, "stop": None, "logit_bias": None, "stream_options": None,
             "user": None}  # fmt: skip
    r = post(url, "/v1/completions", {**GOOD, **nulls, "echo": None, "logprobs": None, "best_of": None})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == post(url, "/v1/completions", GOOD).json()["choices"][0]["text"]
    chat_nulls = {**nulls, "logprobs": None, "top_logprobs": None, "max_completion_tokens": None, "tools": None}
    r = post(url, "/v1/chat/completions", {**CHAT, **chat_nulls})
    assert r.status_code == 200, r.text
    assert r.json()["choices"] == post(url, "/v1/chat/completions", CHAT).json()["choices"]
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": None}}
    r = post(url, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n") and '"usage"' not in r.text, r.text
    r = post(url, "/v1/completions", {**GOOD, "temperature": None, "seed": 1})  # the default, 1: sampled
    assert r.status_code == 200, r.text
    r = post(url, "/v1/completions", {**GOOD, "prompt": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", GOOD), ("/v1/chat/completions", CHAT)])
def test_with_include_usage_every_other_chunk_says_usage_null(url: str, path: str, body: dict[str, Any]) -> None:
    """As OpenAI streams it: clients that read `chunk.usage` on every chunk find the key."""
    r = post(url, path, {**body, "stream": True, "stream_options": {"include_usage": True}, "n": 2})
    chunks = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    assert r.status_code == 200 and len(chunks) > 3 and r.text.endswith("data: [DONE]\n\n")
    *rest, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    assert all("usage" in c and c["usage"] is None and c["choices"] for c in rest)


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("tool_choice", "required", "gives no tools"),  # (a call forced, of no tool)
        ("tool_choice", "auto", "only allowed when 'tools' are specified"),  # (as OpenAI's answers it)
        ("tool_choice", {"type": "function", "function": {"name": "f"}}, "gives no tools"),
        ("functions", [{"name": "f", "parameters": {}}], "not supported"),
        ("function_call", {"name": "f"}, "not supported"),
        ("modalities", ["text", "audio"], "not supported"),  # (an audio reply: this server writes text only)
        ("audio", {"voice": "alloy", "format": "wav"}, "not supported"),
    ],
)
def test_asking_for_a_tool_call_or_audio_gets_400(url: str, field: str, value: Any, needle: str) -> None:
    r = post(url, "/v1/chat/completions", {**CHAT, field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and needle in error["message"], error


def test_tool_fields_off_are_served(url: str) -> None:
    off = {"tool_choice": "none", "functions": [], "function_call": "none", "parallel_tool_calls": False}
    assert post(url, "/v1/chat/completions", {**CHAT, **off}).status_code == 200
    assert post(url, "/v1/chat/completions", {**CHAT, "function_call": "auto"}).status_code == 200


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}], "'image_url' are not"),
        ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], "'input_audio' are not"),
        (5, "a string or a list of content parts"),
        ([], "content must not be an empty list"),
        ({"type": "text", "text": "hi"}, "a string or a list of content parts"),
    ],
)
def test_content_this_server_cannot_read_says_so(url: str, content: Any, needle: str) -> None:
    r = post(url, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["param"] == "messages.0.content", error


def test_error_param_names_the_field_not_a_union_member(url: str) -> None:
    """The param is where the value is wrong, as the union member it was meant as sees it (`stop.0`, not
    `stop.str`)."""
    for path, body, param in [
        ("/v1/completions", {**GOOD, "stop": [1]}, "stop.0"),
        ("/v1/completions", {**GOOD, "prompt": [1.5]}, "prompt.0"),
        ("/v1/completions", {**GOOD, "prompt": None}, "prompt"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages.0.content.0.text"),
    ]:  # fmt: skip
        r = post(url, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_json_without_its_content_type_gets_a_clear_400(url: str, content_type: str | None) -> None:
    """What `curl -d '{...}'` without `-H 'Content-Type: application/json'` sends."""
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(f"{url}/v1/completions", content=b'{"model": "tiny", "prompt": "x"}', headers=headers, timeout=30)
    assert r.status_code == 400, r.text
    assert "Content-Type: application/json" in r.json()["error"]["message"]


def test_empty_body_gets_a_clear_400(url: str) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", content=b"", headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "body is empty" in r.json()["error"]["message"], r.text


def test_streamed_disconnect_is_counted_as_499(serve: Any) -> None:
    url, engine = serve(delay=0.05)
    body = {**GOOD, "max_tokens": 400, "stream": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert any(line.startswith("data:") for line, _ in zip(r.iter_lines(), range(4), strict=False))
    assert wait_until(lambda: engine.n_active == 0)
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert wait_until(lambda: 'status="499"' in httpx.get(f"{url}/metrics", timeout=30).text), metrics
    assert 'moelane_requests_total{endpoint="completions",status="200"}' not in metrics


def test_disconnect_while_waiting_logs_no_error(serve: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A client that closes its socket before its whole reply is ready is a normal event, not an asyncio error."""
    url, engine = serve(delay=0.05)
    port = int(url.rsplit(":", 1)[1])
    payload = f'{{"model": "{MODEL}", "prompt": "def f", "max_tokens": 400, "temperature": 0}}'.encode()
    head = ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n")  # fmt: skip
    with caplog.at_level(logging.WARNING), socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head.encode() + payload)
        assert wait_until(lambda: engine.n_active == 1)
    assert wait_until(lambda: engine.n_active == 0 and engine.n_waiting == 0), "stream still held after disconnect"
    time.sleep(0.2)
    gc.collect()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


class CountingTokenizer:
    """The model's tokenizer, remembering the length of every text it encodes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def encode(self, text: str) -> list[int]:
        self.lengths.append(len(text))
        return self.tokenizer.encode(text)  # type: ignore[no-any-return]

    def encode_prompt(self, text: str, context: int) -> list[int]:  # (its encodes counted)
        return Tokenizer.encode_prompt(self, text, context)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


def test_a_prompt_far_over_the_context_is_refused_unread(tiny_lm: Any) -> None:
    """Tokenising holds the GIL (every stream waits), so a megabyte prompt is measured by its head only."""
    tokenizer = CountingTokenizer(tiny_lm.tokenizer)
    lm = SimpleNamespace(tokenizer=tokenizer, max_context=tiny_lm.max_context, vocab_size=tiny_lm.vocab_size)
    huge = "To be, or not " * 100_000
    with running(create_app(make_engine(tiny_lm), lm, model_name=MODEL)) as base:
        for path, body, param in [
            ("/v1/completions", {**GOOD, "prompt": huge}, "prompt"),
            ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": huge}]}, "messages"),
            ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "To be " * 1000}]}, "messages"),
        ]:
            r = post(base, path, body)
            assert r.status_code == 400 and "context length" in r.json()["error"]["message"], r.text
            assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "context_length_exceeded"
        assert max(tokenizer.lengths) <= tiny_lm.max_context * MAX_CHARS_PER_TOKEN


def test_a_body_over_the_limit_gets_413_unread(tiny_lm: Any) -> None:
    """By its Content-Length, and sent in chunks without one; the server goes on serving."""
    app = create_app(make_engine(tiny_lm), tiny_lm, model_name=MODEL, max_body_bytes=4096)
    with running(app) as base:
        r = httpx.post(f"{base}/v1/completions", json={**GOOD, "prompt": "x" * 5000}, timeout=30)
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large"

        def chunks() -> Any:
            yield b'{"model": "tiny", "prompt": "'
            for _ in range(10):
                yield b"x" * 1000
            yield b'"}'

        r = httpx.post(f"{base}/v1/completions", content=chunks(), headers={"Content-Type": "application/json"},
                       timeout=30)  # fmt: skip
        assert r.status_code == 413, r.text
        assert "larger than this server takes" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "request_too_large"
        assert httpx.post(f"{base}/v1/completions", json=GOOD, timeout=30).status_code == 200


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1])
def test_a_seed_outside_int64_gets_400(url: str, seed: int) -> None:
    r = post(url, "/v1/completions", {**GOOD, "seed": seed})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text


@pytest.mark.parametrize("stream", [False, True])
def test_metrics_count_a_request_of_several_choices_once(tiny_lm: Any, stream: bool) -> None:
    """Prompt tokens agree with `usage` (each prompt once, however many choices), and the request's latency and
    time to first token are observed once; completion tokens and token gaps are the choices'."""
    with running(create_app(make_engine(tiny_lm), tiny_lm, model_name=MODEL)) as base:
        body = {**GOOD, "prompt": ["def f", "class A"], "n": 2, "max_tokens": 3, "stream": stream,
                "stream_options": {"include_usage": True} if stream else None}  # fmt: skip
        r = post(base, "/v1/completions", body)
        assert r.status_code == 200, r.text
        usage = [line for line in r.text.splitlines() if '"usage"' in line][-1] if stream else r.text
        n_prompt = sum(len(tiny_lm.tokenizer.encode(p)) for p in body["prompt"])
        assert f'"prompt_tokens":{n_prompt}' in usage.replace(" ", "")
        lines = httpx.get(f"{base}/metrics").text.splitlines()
        metrics = {line.split()[0]: float(line.split()[1]) for line in lines if line and line[0] != "#"}
        assert metrics["moelane_prompt_tokens_total"] == n_prompt
        assert metrics["moelane_completion_tokens_total"] == 4 * 3
        assert metrics["moelane_request_seconds_count"] == 1
        assert metrics["moelane_time_to_first_token_seconds_count"] == 1
        assert metrics["moelane_inter_token_latency_seconds_count"] == 4

"""Concurrency and faults: 16 concurrent greedy clients get their solo replies; a client that disconnects frees its
engine stream; overload beyond the queue gets 429 while the queued requests complete; an engine failure answers
that request alone; timeouts cancel; shutdown lets running streams finish."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from moelane.errors import ModelLoadError
from moelane.server.app import create_app
from moelane.server.generation import Limits
from tests.helpers import TEXT
from tests.server.conftest import MODEL, make_engine, running, wait_until

PROMPTS = [TEXT[i * 7 : i * 7 + 12 + i] for i in range(16)]


def ask(url: str, prompt: str, stream: bool, max_tokens: int = 16) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    if not stream:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
        return r.choices[0].text
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def concurrent_equals_solo(serve: Any, n_clients: int, max_tokens: int) -> None:
    url, engine = serve(max_streams=16)
    prompts = PROMPTS[:n_clients]
    solo = [ask(url, p, stream=False, max_tokens=max_tokens) for p in prompts]
    rounds_solo = engine.stats().rounds
    with ThreadPoolExecutor(n_clients) as pool:
        together = list(pool.map(lambda ip: ask(url, ip[1], ip[0] % 2 == 0, max_tokens), enumerate(prompts)))
    assert together == solo
    assert engine.stats().rounds - rounds_solo < rounds_solo * 0.75, "concurrent requests should share rounds"


def test_four_concurrent_clients_get_their_solo_replies(serve: Any) -> None:
    concurrent_equals_solo(serve, 4, 8)


@pytest.mark.slow
def test_sixteen_concurrent_clients_get_their_solo_replies(serve: Any) -> None:
    concurrent_equals_solo(serve, 16, 16)


def test_disconnect_mid_stream_frees_the_stream(serve: Any) -> None:
    url, engine = serve(delay=0.05)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", f"{url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data:")]
        assert got and engine.n_active == 1
    assert wait_until(lambda: engine.n_active == 0 and engine.n_waiting == 0), "stream still held after disconnect"
    assert engine.stats().committed < 200


def test_disconnect_while_waiting_for_whole_reply_frees_the_stream(serve: Any) -> None:
    url, engine = serve(delay=0.05)
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0}
    try:
        httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
        raise AssertionError("the request should have timed out on the client")
    except httpx.TimeoutException:
        pass
    assert wait_until(lambda: engine.n_active == 0 and engine.n_waiting == 0), "stream still held after disconnect"
    assert engine.stats().committed < 200


@pytest.mark.parametrize("stream", [False, True])
def test_choices_of_a_request_end_together(serve: Any, tiny_lm: Any, stream: bool) -> None:
    """Every stream of a request with several choices is freed when its client goes away, and when one of its
    prompts fails in the engine (the request gets the error; the server goes on)."""
    poison = tiny_lm.tokenizer.encode("fox")[0]
    url, engine = serve(delay=0.05, poison=poison)
    clean = [[t for t in range(first, first + 6) if t != poison] for first in (1, 9)]
    body = {"model": MODEL, "prompt": clean, "n": 2, "max_tokens": 400, "temperature": 0, "stream": stream}
    if stream:
        with httpx.Client(timeout=30) as client, client.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert any(line.startswith("data:") for line, _ in zip(r.iter_lines(), range(6), strict=False))
            assert engine.n_active == 4
    else:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
    assert wait_until(lambda: engine.n_active == 0 and engine.n_waiting == 0), "streams still held after disconnect"
    assert engine.stats().committed < 400
    body = {"model": MODEL, "prompt": [clean[0], [1, 2, poison]], "n": 2, "max_tokens": 200, "stream": stream}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert '"engine_error"' in r.text and (r.status_code == 200 if stream else r.status_code == 500)
    assert wait_until(lambda: engine.n_active == 0 and engine.n_waiting == 0), "streams still held after a failure"
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_overload_gets_429_and_the_queued_complete(serve: Any) -> None:
    url, _ = serve(delay=0.03, max_streams=2, max_queue=2)
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0}
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json=body, timeout=60), range(8)))
    codes = sorted(r.status_code for r in replies)
    assert codes.count(200) >= 4 and codes.count(429) >= 1 and set(codes) == {200, 429}, codes
    for r in replies:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["code"] == "queue_full"
        else:
            assert r.json()["usage"]["completion_tokens"] == 12
    texts = {r.json()["choices"][0]["text"] for r in replies if r.status_code == 200}
    assert len(texts) == 1


def test_engine_failure_fails_that_request_only(serve: Any, tiny_lm: Any) -> None:
    poison = tiny_lm.tokenizer.encode("fox")[0]
    url, _ = serve(poison=poison)
    bad = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [1, 2, poison], "max_tokens": 4},
                     timeout=30)  # fmt: skip
    assert bad.status_code == 500 and bad.json()["error"]["code"] == "engine_error"
    assert "poisoned" not in bad.text  # (a bug's own words are for the log, not the client)
    good = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4,
                                                     "temperature": 0}, timeout=30)  # fmt: skip
    assert good.status_code == 200
    streamed = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [poison], "max_tokens": 4,
                                                         "stream": True}, timeout=30)  # fmt: skip
    assert streamed.status_code == 200 and '"engine_error"' in streamed.text and streamed.text.endswith("[DONE]\n\n")


def test_idle_timeout_cancels(serve: Any) -> None:
    url, engine = serve(delay=0.6, limits=Limits(request_s=30, idle_s=0.2))
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 8}, timeout=30)
    assert r.status_code == 504 and "idle" in r.json()["error"]["message"]
    assert wait_until(lambda: engine.n_active == 0 and engine.n_waiting == 0)


def test_shutdown_lets_running_streams_finish(tiny_lm: Any) -> None:
    engine = make_engine(tiny_lm, delay=0.02)
    app = create_app(engine, tiny_lm, model_name=MODEL)
    out: list[str] = []
    with running(app) as url:
        thread = threading.Thread(target=lambda: out.append(ask(url, PROMPTS[3], stream=True, max_tokens=30)))
        thread.start()
        assert wait_until(lambda: engine.n_active == 1)
    thread.join(timeout=30)
    assert out and len(out[0]) > 0
    assert engine.n_active == 0 and app.state.moelane.in_flight == 0


def test_an_engine_failure_of_ours_says_what_it_was(serve: Any, tiny_lm: Any) -> None:
    """A failure moelane knows (a shard found truncated mid-run, say) reaches the client in its own words."""
    poison = tiny_lm.tokenizer.encode("fox")[0]
    url, engine = serve(poison=poison)
    engine.target.error = ModelLoadError("truncated shard model.safetensors: expert 3 of layer 1 ends at byte 12")
    bad = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [1, 2, poison], "max_tokens": 4},
                     timeout=30)  # fmt: skip
    assert bad.status_code == 500 and bad.json()["error"]["code"] == "engine_error"
    assert "expert 3 of layer 1" in bad.json()["error"]["message"]


class HeldTemplate:
    """The tokenizer, its chat template held until `release`: as a template over very many messages takes seconds
    to render."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.rendering, self.release = tokenizer, threading.Event(), threading.Event()

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
        self.rendering.set()
        self.release.wait(10)
        return self.tokenizer.apply_chat_template(*args, **kwargs)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


def test_a_slow_chat_template_stalls_no_other_request(tiny_lm: Any) -> None:
    """The chat template renders off the event loop: while it does, /health answers and a stream is served."""
    tokenizer = HeldTemplate(tiny_lm.tokenizer)
    lm = SimpleNamespace(tokenizer=tokenizer, max_context=tiny_lm.max_context, vocab_size=tiny_lm.vocab_size)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 3, "max_tokens": 2}
    with running(create_app(make_engine(tiny_lm), lm, model_name=MODEL)) as url, ThreadPoolExecutor(1) as pool:
        try:
            held = pool.submit(httpx.post, f"{url}/v1/chat/completions", json=chat, timeout=30)
            assert tokenizer.rendering.wait(10)
            assert httpx.get(f"{url}/health", timeout=2).status_code == 200
            streamed = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4,
                                                                 "stream": True}, timeout=5)  # fmt: skip
            assert streamed.text.endswith("data: [DONE]\n\n") and not held.done()
        finally:
            tokenizer.release.set()
        assert held.result().status_code == 200

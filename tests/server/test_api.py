"""The server driven by the official `openai` client: both endpoints, streamed and not, stop strings, seeds,
usage, and the `moelane` extension field; replies checked against the model run directly (`lm.generate_ids`)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
import torch

from moelane.model.sampling import SamplingParams
from tests.server.conftest import MODEL

PROMPT = "def fibonacci(n):"


@pytest.fixture
def client(serve: Any) -> openai.OpenAI:
    url, _ = serve()
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def reference(lm: Any, prompt_ids: list[int], n: int, **sampling: Any) -> str:
    ids = list(lm.generate_ids(prompt_ids, n, SamplingParams(**sampling)))
    return str(lm.tokenizer.decode(ids))


def test_models_health_metrics(client: openai.OpenAI, serve: Any) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    url = str(client.base_url).removesuffix("/v1/")
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    text = httpx.get(f"{url}/metrics").text
    for name in ("moelane_requests_total", "moelane_completion_tokens_total 4.0", "moelane_engine_rounds_total",
                 "moelane_queue_depth", "moelane_tokens_per_second", "moelane_engine_acceptance",
                 "moelane_time_to_first_token_seconds_bucket"):  # fmt: skip
        assert name in text, name


def test_completion_matches_model(client: openai.OpenAI, tiny_lm: Any) -> None:
    want = reference(tiny_lm, tiny_lm.tokenizer.encode(PROMPT), 12)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(tiny_lm.tokenizer.encode(PROMPT))
    extra = r.model_extra or {}
    assert set(extra["moelane"]["pager"]) == {"experts_fetched", "bytes_fetched", "stall_ms"}


def test_streamed_completion_equals_whole(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_chat_streamed_and_not(client: openai.OpenAI, tiny_lm: Any) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "To be, or not"}]
    prompt = tiny_lm.tokenizer.encode(tiny_lm.tokenizer.apply_chat_template(messages))
    want = reference(tiny_lm, prompt, 10)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)  # type: ignore[arg-type]
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.usage is not None and r.usage.prompt_tokens == len(prompt)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,  # type: ignore[arg-type]
                                            stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == len(prompt) + 10


def test_stop_string_never_leaks(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = full[5:8]  # a string the reply is known to contain
    cut = full[: full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "\x00never"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens < 24
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                         stream=True)  # fmt: skip
    pieces = [c.choices[0].text for c in streamed if c.choices]
    assert "".join(pieces) == cut


def test_several_prompts_and_n_choices(client: openai.OpenAI, tiny_lm: Any) -> None:
    """A list of prompts (texts or token ids) gets `n` choices each, indexed prompt by prompt, each what the model
    gives that prompt alone; a seeded choice j samples with seed + j. Streamed, the choices' chunks interleave, each
    choice's text in order and ending with its own finish reason; usage counts each prompt once."""
    prompts = [PROMPT, "import os", "class A:"]
    ids = [tiny_lm.tokenizer.encode(p) for p in prompts]
    want = [reference(tiny_lm, i, 8) for i in ids]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [w for w in want for _ in range(2)]
    assert r.usage is not None and r.usage.prompt_tokens == sum(map(len, ids)) and r.usage.completion_tokens == 48
    r = client.completions.create(model=MODEL, prompt=ids[1:], max_tokens=8, temperature=0)  # lists of token ids
    assert [c.text for c in r.choices] == want[1:]
    sampled = dict(temperature=1.0, top_p=0.9, seed=11)
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=10, **sampled)  # type: ignore[arg-type]
    alone = [reference(tiny_lm, ids[0], 10, temperature=1.0, top_p=0.9, seed=11 + j) for j in range(3)]
    assert [c.text for c in r.choices] == alone and len(set(alone)) == 3
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))  # fmt: skip
    texts, finished = [""] * 6, [0] * 6
    for c in chunks:
        for choice in c.choices:
            assert not finished[choice.index]  # nothing of a choice after its finish reason
            texts[choice.index] += choice.text
            finished[choice.index] += choice.finish_reason is not None
    assert texts == [w for w in want for _ in range(2)] and finished == [1] * 6
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 48
    messages = [{"role": "user", "content": "To be, or not"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=6, **sampled)  # type: ignore[arg-type, call-overload]
    stream = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=6, stream=True,  # type: ignore[arg-type, call-overload]
                                            **sampled)  # fmt: skip
    deltas = ["", ""]
    roles = [0, 0]
    for c in stream:
        for choice in c.choices:
            deltas[choice.index] += choice.delta.content or ""
            roles[choice.index] += choice.delta.role == "assistant"
    assert deltas == [c.message.content for c in chat.choices] and roles == [1, 1]
    assert deltas[0] != deltas[1]


def test_seed_reproduces_sampling(client: openai.OpenAI) -> None:
    def ask(seed: int) -> str:
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.9,
                                      seed=seed)  # fmt: skip
        return r.choices[0].text

    a, b, c = ask(7), ask(7), ask(8)
    assert a == b
    assert a != c


def test_logit_bias_and_penalties_reach_the_sampler(client: openai.OpenAI, tiny_lm: Any) -> None:
    """The openai client's logit_bias / presence_penalty / frequency_penalty give what the model gives with the same
    adjustments (greedy and seeded, chat and completions), and a +100 bias forces its token."""
    ids = tiny_lm.tokenizer.encode(PROMPT)
    forced = ids[-1]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                  logit_bias={str(forced): 100})  # fmt: skip
    assert tiny_lm.tokenizer.encode(r.choices[0].text) == [forced] * 5
    sampling: dict[str, Any] = dict(logit_bias=((3, 4.0), (forced, -100.0)), presence_penalty=1.5,
                                    frequency_penalty=0.5)  # fmt: skip
    for temperature, seed in ((0.0, None), (0.9, 11)):
        want = reference(tiny_lm, ids, 12, temperature=temperature, seed=seed, **sampling)
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=temperature, seed=seed,
                                      logit_bias={"3": 4, str(forced): -100}, presence_penalty=1.5,
                                      frequency_penalty=0.5)  # fmt: skip
        assert r.choices[0].text == want
        assert want != reference(tiny_lm, ids, 12, temperature=temperature, seed=seed)


def test_logprobs_are_the_models_own(client: openai.OpenAI, tiny_lm: Any) -> None:
    """Completions (`logprobs`: n) and chat (`logprobs`, `top_logprobs`), streamed and not: one entry per completion
    token, each the log-softmax of the model's logits at that token's position (checked against a pass over the
    whole sequence), the top alternatives most likely first; the pieces stream in order."""
    ids = tiny_lm.tokenizer.encode(PROMPT)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and r.usage is not None
    reply = list(tiny_lm.generate_ids(ids, 10))
    want = torch.log_softmax(tiny_lm.logits(ids + reply)[len(ids) - 1 : -1].float(), dim=-1)
    assert lp.token_logprobs == pytest.approx([float(want[i, t]) for i, t in enumerate(reply)], abs=1e-4)
    assert lp.tokens == [tiny_lm.tokenizer.decode([t]) for t in reply]
    # Where each token's text starts in the reply: after the characters the tokens before it completed.
    assert lp.text_offset == [len(tiny_lm.tokenizer.decode(reply[:i]).rstrip("\ufffd")) for i in range(len(reply))]
    for top, row in zip(lp.top_logprobs, want, strict=True):  # tokens of the same text share one key
        best3 = torch.topk(row, 3).values.tolist()
        assert next(iter(top.values())) == pytest.approx(best3[0], abs=1e-4)
        assert all(min(abs(v - b) for b in best3) < 1e-4 for v in top.values())
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3,
                                            stream=True))  # fmt: skip
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and chat.usage is not None and len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy took the most likely
        assert bytes(entry.bytes or []).decode() == entry.token
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert plain.choices[0].logprobs is None


def test_echo_with_logprobs_scores_the_prompt(client: openai.OpenAI, tiny_lm: Any) -> None:
    """`echo` + `logprobs` (how evaluation harnesses score text): the prompt's tokens come first, the first with no
    log-probability, each other one the log-softmax of the logits after the tokens before it; then the reply's, their
    offsets after the prompt's text. Streamed, the same entries in the same order."""
    ids = tiny_lm.tokenizer.encode(PROMPT)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, echo=True)
    lp = r.choices[0].logprobs
    assert lp is not None and r.choices[0].text.startswith(tiny_lm.tokenizer.decode(ids))
    reply = list(tiny_lm.generate_ids(ids, 4))
    rows = torch.log_softmax(tiny_lm.logits(ids + reply).float(), dim=-1)
    assert lp.tokens == [tiny_lm.tokenizer.decode([t]) for t in ids + reply]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # type: ignore[index]
    want = [float(rows[p - 1, t]) for p, t in enumerate(ids + reply) if p > 0]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    n_echo = len(tiny_lm.tokenizer.decode(ids))
    assert lp.text_offset[len(ids)] == n_echo and lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1,
                                            echo=True, stream=True))  # fmt: skip
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    # max_tokens 0: the prompt alone, scored.
    for stream in (False, True):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 0, "logprobs": 0, "echo": True, "stream": stream}
        got = httpx.post(f"{str(client.base_url).rstrip('/')}/completions", json=body, timeout=60)
        assert got.status_code == 200, got.text
        if stream:
            events = [json.loads(x[6:]) for x in got.text.splitlines() if x.startswith("data: {")]
            text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
            scored = [v for e in events if e["choices"] and e["choices"][0]["logprobs"]
                      for v in e["choices"][0]["logprobs"]["token_logprobs"]]  # fmt: skip
        else:
            choice = got.json()["choices"][0]
            text, scored = choice["text"], choice["logprobs"]["token_logprobs"]
            assert got.json()["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"
        assert text == tiny_lm.tokenizer.decode(ids) and scored == lp.token_logprobs[: len(ids)]


def test_token_id_prompt_and_echo(client: openai.OpenAI, tiny_lm: Any) -> None:
    ids = tiny_lm.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0).choices[0].text
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    assert by_text.choices[0].text == tiny_lm.tokenizer.decode(ids) + by_ids


def test_models_retrieve_and_head_health(tiny_lm: Any) -> None:
    """`client.models.retrieve` finds the served model (an id with a slash too) and says model_not_found of others;
    load balancers' `HEAD /health` is answered."""
    from tests.server.conftest import create_app, make_engine, running

    for name in (MODEL, "org/tiny-moe"):
        with running(create_app(make_engine(tiny_lm), tiny_lm, model_name=name)) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
            card = client.models.retrieve(name)
            assert card.id == name and card.object == "model"
            assert card.model_extra is not None and card.model_extra["max_model_len"] == tiny_lm.max_context
            with pytest.raises(openai.NotFoundError) as refused:
                client.models.retrieve("gpt-17")
            assert refused.value.code == "model_not_found" and "does not exist" in refused.value.message
            head = httpx.head(f"{base}/health", timeout=30)
            assert head.status_code == 200 and head.content == b""
            other = httpx.options(f"{base}/health", timeout=30)  # (the schema's one method: it said HEAD)
            assert other.status_code == 405 and other.headers["allow"] == "GET"


def test_the_schema_says_null_is_taken_where_it_is(tiny_lm: Any) -> None:
    """Every optional field of a request body takes null as its default (clients send it for fields left unset);
    the schema says so, or schemathesis finds a request "violating" it accepted."""
    from tests.server.conftest import create_app, make_engine, running

    with running(create_app(make_engine(tiny_lm), tiny_lm, model_name=MODEL)) as base:
        schemas = httpx.get(f"{base}/openapi.json", timeout=30).json()["components"]["schemas"]
        for name in ("CompletionRequest", "ChatCompletionRequest", "StreamOptions"):
            body = schemas[name]
            for key, prop in body["properties"].items():
                takes_null = {"type": "null"} in prop.get("anyOf", [])
                assert takes_null == (key not in body.get("required", [])), (name, key)
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                       "temperature": None, "model": None, "max_tokens": 2}, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text

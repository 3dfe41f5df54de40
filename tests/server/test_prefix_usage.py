"""Prefix caching through the server: a chat's second turn takes over the first turn's KV cache, says so in OpenAI's
`usage.prompt_tokens_details.cached_tokens` (streamed or not) and in `/metrics`, and replies as the model alone."""

from __future__ import annotations

from typing import Any

import httpx
import openai

from moelane.model.sampling import SamplingParams
from tests.server.conftest import MODEL

SYSTEM = "You answer in verse. " * 6


def test_a_second_turn_reports_the_tokens_it_took_from_the_first(serve: Any, tiny_lm: Any) -> None:
    url, engine = serve()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "To be, or not"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "that is the question"}]  # fmt: skip
    prompt = tiny_lm.tokenizer.encode(tiny_lm.tokenizer.apply_chat_template(messages))
    want = tiny_lm.tokenizer.decode(list(tiny_lm.generate_ids(prompt, 8, SamplingParams())))
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == len(prompt) and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= first.usage.prompt_tokens and cached == engine.stats().prefix_tokens
    metrics = httpx.get(f"{url}/metrics").text
    assert (
        "moelane_engine_prefix_hits_total 1.0" in metrics
        and f"moelane_engine_prefix_tokens_total {cached}.0" in metrics
    )

"""`response_format` through the API: replies held to JSON or a JSON schema on the shipped model and the real lanes
engine, read by the official openai client (its `parse` helper sends a strict schema and validates the reply),
streamed and not; and the prompt's opening for models that reason first (gpt-oss's channels, think tags)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

import moelane
from moelane.model.reasoning import FINAL_OPENING
from moelane.model.tokenizer import Tokenizer
from moelane.server.app import create_app
from moelane.server.chat_request import ChatCompletionRequest
from moelane.server.prompts import Prompts
from tests.helpers import write_harmony_tokenizer, write_think_tokenizer
from tests.server.conftest import make_engine, running
from tests.server.fake_engine import FakeEngine, FakeLM

MODEL = "default"
MESSAGES = [{"role": "user", "content": "Describe a user of the system as JSON."}]


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    tags: list[Annotated[str, Field(max_length=8)]] = Field(max_length=3)


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def base() -> Any:
    lm = moelane.load()
    with running(create_app(make_engine(lm, drafter="copy"), lm, model_name=MODEL)) as url:
        yield url


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


def test_the_openai_client_parses_a_strict_schema_reply(base: str) -> None:
    reply = client(base).chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Person, temperature=0,
                                                max_tokens=300)  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)


def test_a_streamed_reply_is_the_reply(base: str) -> None:
    asked: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, response_format=JSON_SCHEMA, max_tokens=200,
                                 temperature=0)  # fmt: skip
    whole = client(base).chat.completions.create(**asked)
    chunks = client(base).chat.completions.create(**asked, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].message.content
    value = json.loads(text)
    assert set(value) == {"name", "n"} and 0 <= value["n"] <= 9 and len(value["name"]) <= 12


def test_each_sampled_choice_meets_the_schema(base: str) -> None:
    reply = client(base).chat.completions.create(model=MODEL, messages=MESSAGES, response_format=JSON_SCHEMA,  # type: ignore[arg-type]
                                                 max_tokens=200, n=3, temperature=1.0, seed=5)  # fmt: skip
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        assert set(json.loads(choice.message.content or "")) == {"name", "n"}


def test_json_object_and_completions(base: str) -> None:
    reply = client(base).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40,
                                                 response_format={"type": "json_object"})  # fmt: skip
    assert (reply.choices[0].message.content or "").lstrip().startswith("{")
    r = httpx.post(f"{base}/v1/completions", timeout=60, json={"model": MODEL, "prompt": "user = ", "max_tokens": 200,
                                                                "response_format": JSON_SCHEMA})  # fmt: skip
    assert r.status_code == 200, r.text
    assert set(json.loads(r.json()["choices"][0]["text"])) == {"name", "n"}


def test_a_reply_cut_before_its_json_is_whole_ends_for_length(base: str) -> None:
    """As OpenAI's: `max_tokens` cuts the JSON short, and the finish reason says so, streamed or not."""
    asked: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                 response_format={"type": "json_object"})  # fmt: skip
    whole = client(base).chat.completions.create(**asked).choices[0]
    assert whole.finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(whole.message.content or "")
    chunks = [c for c in client(base).chat.completions.create(**asked, stream=True) if c.choices]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


def test_text_is_no_constraint(base: str) -> None:
    free = client(base).completions.create(model=MODEL, prompt="ROMEO:", max_tokens=12, temperature=0)
    text = client(base).completions.create(model=MODEL, prompt="ROMEO:", max_tokens=12, temperature=0,
                                           extra_body={"response_format": {"type": "text"}})  # fmt: skip
    assert text.choices[0].text == free.choices[0].text


# ---- the opening of a reply that must be JSON --------------------------------------------------------------------


HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
                    "<|start|>assistant")  # fmt: skip
THINKING = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|><think>\n"


def chat(json_format: bool = True) -> ChatCompletionRequest:
    fmt = {"response_format": {"type": "json_object"}} if json_format else {}
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fmt})


def test_gpt_oss_answers_in_its_final_channel(tmp_path: Path) -> None:
    """The prompt ends with the final channel's header, so the JSON is the answer (not reasoning), and the app's
    reply says it as the content."""
    tok = Tokenizer(write_harmony_tokenizer(tmp_path, HARMONY_TEMPLATE), frozenset())
    prompts = Prompts(FakeLM(tok), "m")
    opening = tok.encode(FINAL_OPENING)
    ids, primer = prompts.chat_prompt(chat(), None, json=True)
    assert ids[-len(opening) :] == opening and primer == tuple(opening)  # (the splitter reads the opening first)
    assert prompts.chat_prompt(chat(json_format=False), None)[0][-len(opening) :] != opening
    end = tok.token_id("<|return|>")
    assert end is not None
    engine = FakeEngine([*tok.encode('{"a": 1}'), end])
    app = create_app(engine, FakeLM(tok, frozenset({end})), model_name="m", max_streams=4, manage_engine=False)
    with running(app) as url:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                       json={**chat().model_dump(exclude_none=True), "max_tokens": 50})  # fmt: skip
    message = r.json()["choices"][0]["message"]
    assert (message["content"], message.get("reasoning_content")) == ('{"a": 1}', None)


def test_a_think_block_the_template_opens_is_closed_first(tmp_path: Path) -> None:
    tok = Tokenizer(write_think_tokenizer(tmp_path, THINKING), frozenset())
    prompts = Prompts(FakeLM(tok), "m")
    ids, primer = prompts.chat_prompt(chat(), None, json=True)
    assert tok.decode(ids).endswith("<think></think>\n\n") and primer == ()  # (the tags are read from the prompt)
    assert tok.decode(prompts.chat_prompt(chat(json_format=False), None)[0]).endswith("<think>")

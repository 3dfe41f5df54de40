"""Tool calls: the tools and the call history reach a chat template that takes them, and a reply's calls come back
as OpenAI's `tool_calls`, streamed and not, as the official `openai` client reads them, in each form the server reads
(`<tool_call>` blocks of JSON, Qwen3-Coder's tags, GLM-4.5's keys, MiniMax-M2's invokes, gpt-oss's harmony messages,
and the forms whose markers are special tokens: Mistral's, Granite's, DeepSeek's, Kimi-K2's, more of which in
`test_tool_markers.py`); a model whose template takes no tools refuses them in one line."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from moelane.model.tokenizer import Tokenizer
from moelane.server.app import create_app
from moelane.server.calls import read_function_call, read_invokes, read_keyed_call
from moelane.server.chat_request import ChatCompletionRequest, ChatMessage
from moelane.server.tools import ToolCallReader, ToolUse, call_opening, split_reply, tool_support
from tests.helpers import write_harmony_tokenizer, write_tokenizer
from tests.server.conftest import running
from tests.server.fake_engine import FakeEngine, FakeLM

TEMPLATE = """{%- if tools %}<|im_start|>system
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{%- if m.role == "tool" %}
<tool_response>{{ m.tool_call_id }}: {{ m.content }}</tool_response>
{%- else %}
{{ m.content }}
{%- for call in m.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}{%- endif %}<|im_end|>
{% endfor %}<|im_start|>assistant
"""
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time"}},
]  # fmt: skip
CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')  # fmt: skip
REPLY = "Let me look.\n\n" + CALLS
REQUEST: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Paris?"}], "tools": TOOLS}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder: Path = tmp_path_factory.mktemp("tools")
    write_tokenizer(folder, 300)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return Tokenizer(folder, frozenset())


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=30)


def app_over(engine: FakeEngine, tokenizer: Tokenizer) -> Any:
    return create_app(engine, FakeLM(tokenizer), model_name="m", max_streams=4, manage_engine=False)


def both_ways(engine: FakeEngine, tokenizer: Tokenizer, request: dict[str, Any]) -> list[Any]:
    """The first choice of the request, unstreamed and streamed (as the official client's stream helper assembles
    it)."""
    with running(app_over(engine, tokenizer)) as base:
        whole = client(base).chat.completions.create(**request)
        with client(base).chat.completions.stream(**request) as stream:
            streamed = stream.get_final_completion()
    return [whole.choices[0], streamed.choices[0]]


@pytest.mark.parametrize(
    "reply",
    [REPLY, CALLS, "no calls at all\n", "a <tool_call>{not json}</tool_call> b", "cut <tool_call>\n{\"name\": \"f\"",
     "x <tool_ y <tool_callz", "\n" + CALLS + "\n\nand after", '<tool_call>{"arguments": {}}</tool_call>',
     "1.\n" + CALLS + "\n2.\n" + CALLS + "\n3.", "<tool_call>" + "[" * 1200 + "]" * 1200 + "</tool_call>",
     '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": NaN}</tool_call>',
     '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'],
)  # fmt: skip
def test_a_reply_reads_the_same_however_it_streams(reply: str) -> None:
    content, calls = split_reply(reply)
    rng = random.Random(0)
    for _ in range(100):
        reader, parts, at = ToolCallReader(), [], 0
        while at < len(reply):
            n = rng.randint(1, 6)
            parts += reader.feed(reply[at : at + n])
            at += n
        parts += reader.end()
        assert [p for p in parts if not isinstance(p, str)] == [
            c.model_copy(update={"id": p.id}) for c, p in zip(calls, [p for p in parts if not isinstance(p, str)],
                                                               strict=True)
        ]  # fmt: skip
        text = "".join(p for p in parts if isinstance(p, str))
        assert (text or None if calls else text) == content
    if not calls:  # no text is lost: a block that is not a call stays as written
        assert content == reply


def test_calls_are_read_and_blank_lines_beside_them_dropped() -> None:
    content, calls = split_reply(REPLY)
    assert content == "Let me look."
    # text on both sides of calls keeps what parted it from them, once
    assert split_reply("1.\n" + CALLS + "\n2.\n\n" + CALLS + "\n\n3.")[0] == "1.\n2.\n\n3."
    assert split_reply("Here:\n```\n" + CALLS + "\n```\n")[0] == "Here:\n```\n```\n"
    # arguments: an object, or the JSON text of one, or none at all
    for arguments, text in (("null", "{}"), ('"{\\"a\\": 1}"', '{"a": 1}'), ('{"x": "\\u00e9"}', '{"x": "é"}')):
        reply = '<tool_call>{"name": "f", "arguments": ' + arguments + "}</tool_call>"
        assert [c.function.arguments for c in split_reply(reply)[1]] == [text], reply
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]  # fmt: skip
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert split_reply(CALLS)[0] is None  # only calls: no content, as OpenAI's


@pytest.mark.parametrize("per_round", [1, 3])
def test_the_openai_client_reads_the_calls_streamed_and_not(tokenizer: Tokenizer, per_round: int) -> None:
    engine = FakeEngine(tokenizer.encode(REPLY), per_round=per_round)
    for choice in both_ways(engine, tokenizer, REQUEST):
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me look."
        calls = choice.message.tool_calls or []
        assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [  # type: ignore[union-attr]
            ("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {})]  # fmt: skip
    prompt = tokenizer.decode(engine.streams[0].prompt_ids)
    assert json.dumps(TOOLS[0]["function"]["parameters"]) in prompt and '"name": "get_time"' in prompt
    with running(app_over(engine, tokenizer)) as base:
        schema = httpx.get(f"{base}/openapi.json", timeout=30).json()
    assert "maxItems" not in schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]["tools"]["anyOf"][0]


def test_the_call_messagesreaches_the_template(tokenizer: Tokenizer) -> None:
    """An assistant's calls (arguments sent as JSON text, given to the template as the object) and the tool's
    answer, with the id of the call it answers."""
    engine = FakeEngine(tokenizer.encode("It is sunny."))
    history = [
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                                "function": {"name": "get_weather",
                                                                             "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    app = app_over(engine, tokenizer)
    with running(app) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json={**REQUEST, "messages": history}, timeout=30)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert (
        message == {"role": "assistant", "content": "It is sunny."}
        and r.json()["choices"][0]["finish_reason"] == "stop"
    )
    prompt = tokenizer.decode(engine.streams[0].prompt_ids)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>call_1: sunny</tool_response>" in prompt


def test_tool_choice_none_shows_no_tools_and_reads_no_calls(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer.encode(REPLY))
    app = app_over(engine, tokenizer)
    with running(app) as base:
        body = httpx.post(f"{base}/v1/chat/completions", json={**REQUEST, "tool_choice": "none"}, timeout=30).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    assert "<tools>" not in tokenizer.decode(engine.streams[0].prompt_ids)


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_allowed_tools_are_the_tools_the_model_is_shown(tokenizer: Tokenizer, mode: str) -> None:
    """OpenAI's `allowed_tools`: the prompt is the one for the allowed tools alone with its mode as tool_choice
    (forced, for "required"), and the calls read back are those."""
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": [
        {"type": "function", "function": {"name": "get_time"}}]}}  # fmt: skip
    prompts, messages = [], []
    for change in ({"tool_choice": choice}, {"tools": TOOLS[1:], "tool_choice": mode}):
        engine = FakeEngine(tokenizer.encode(REPLY))
        with running(app_over(engine, tokenizer)) as base:
            r = httpx.post(f"{base}/v1/chat/completions", json={**REQUEST, **change}, timeout=30)
        assert r.status_code == 200, r.text
        prompts.append(engine.streams[0].prompt_ids)
        message = r.json()["choices"][0]["message"]
        messages.append({**message, "tool_calls": [{**c, "id": None} for c in message.get("tool_calls") or ()]})
    assert prompts[0] == prompts[1] and messages[0] == messages[1]
    assert "get_time" in tokenizer.decode(prompts[0]) and "get_weather" not in tokenizer.decode(prompts[0])


@pytest.mark.parametrize(
    ("change", "param", "needle"),
    [
        ({"tools": [{"type": "function", "function": {"name": "two words"}}]}, "tools.0.function.name", "pattern"),
        (
            {
                "tool_choice": {
                    "type": "allowed_tools",
                    "allowed_tools": {
                        "mode": "auto",
                        "tools": [{"type": "function", "function": {"name": "get_date"}}],
                    },
                }
            },
            "tool_choice",
            "'get_date', not among the tools given (get_time, get_weather)",
        ),
        (
            {
                "tool_choice": {
                    "type": "allowed_tools",
                    "allowed_tools": {"mode": "any", "tools": [{"type": "function", "function": {"name": "get_time"}}]},
                }
            },
            "tool_choice.allowed_tools.mode",
            "'auto' or 'required'",
        ),
        ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice.allowed_tools", "Field required"),
        ({"tool_choice": {"type": "function"}}, "tool_choice.function", "Field required"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "'function'"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "get_date"}}},
            "tool_choice",
            "get_weather, get_time",
        ),
        ({"tool_choice": "any"}, "tool_choice", "'required'"),
        ({"tools": [*TOOLS, TOOLS[1]]}, "tools", "given more than once: get_time"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools.0.function.parameters",
            "of type 'object'",
        ),
    ],
)
def test_bad_tools_get_400(tokenizer: Tokenizer, change: dict[str, Any], param: str, needle: str) -> None:
    app = create_app(FakeEngine([]), FakeLM(tokenizer), model_name="m", max_streams=4, manage_engine=False)
    with running(app) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json={**REQUEST, **change}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error


def test_a_model_whose_template_takes_no_tools_refuses_them(tiny_lm: Any) -> None:
    app = create_app(FakeEngine([]), tiny_lm, model_name="m", max_streams=4, manage_engine=False)
    with running(app) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=REQUEST, timeout=30)
        completion = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "tools": TOOLS}, timeout=30)
        unshown = httpx.post(f"{base}/v1/chat/completions", json={**REQUEST, "tool_choice": "none"}, timeout=30)
        schema = httpx.get(f"{base}/openapi.json", timeout=30).json()  # says so, for clients and schema fuzzers
    tools = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]["tools"]
    assert tools["anyOf"][0]["maxItems"] == 0 and "takes no tools" in tools["description"]
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "takes no tools" in r.json()["error"]["message"]
    assert unshown.status_code == 400, unshown.text  # as its schema says: no tools at all
    assert completion.status_code == 400 and completion.json()["error"]["param"] == "tools", completion.text


# ---- gpt-oss's harmony messages to functions -------------------------------------------------------------------

HARMONY_TEMPLATE = (
    "{% if tools %}<|start|>developer<|message|>{% for t in tools %}{{ t.function.name }};{% endfor %}<|end|>"
    "{% endif %}{% for m in messages %}<|start|>{{ m.role }}{% if m.tool_calls %} to=functions."
    "{{ m.tool_calls[0].function.name }}<|channel|>commentary json<|message|>{{ m.tool_calls[0].function.arguments"
    " | tojson }}<|call|>{% else %}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}<|start|>assistant"
)


@pytest.fixture(scope="module")
def harmony(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The test tokenizer with harmony's special tokens, and a chat template that takes tools."""
    return Tokenizer(write_harmony_tokenizer(tmp_path_factory.mktemp("harmony_tools"), HARMONY_TEMPLATE), frozenset())


def harmony_ids(tok: Tokenizer, text: str) -> list[int]:
    """`text` with harmony's special tokens written as themselves, as ids."""
    import re

    ids: list[int] = []
    for part in re.split(r"(<\|[a-z]+\|>)", text):
        special = tok.token_id(part) if part.startswith("<|") else None
        ids += [special] if special is not None else tok.encode(part) if part else []
    return ids


THOUGHT = "<|channel|>analysis<|message|>Need the weather.<|end|>"
WEATHER = (
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
)
TIME = "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>"


@pytest.mark.parametrize("per_round", [1, 4])
@pytest.mark.parametrize(
    ("reply", "calls", "content"),
    [
        # the engine ends the reply at <|call|>, an end-of-sequence token of gpt-oss's: the call is not followed by it
        (THOUGHT + WEATHER, [("get_weather", {"city": "Paris"})], None),
        # the recipient before the channel, a call ended by <|call|> itself, then an answer
        (THOUGHT + TIME + "<|start|>assistant<|channel|>final<|message|>Noon.<|return|>", [("get_time", {})], "Noon."),
        (THOUGHT + TIME + WEATHER, [("get_time", {}), ("get_weather", {"city": "Paris"})], None),
        # a call without arguments (its body empty), and the recipient after <|constrain|>
        (
            THOUGHT + "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>",
            [("get_time", {})],
            None,
        ),
        (
            THOUGHT + "<|start|>assistant<|channel|>commentary <|constrain|>json to=functions.get_weather<|message|>"
            '{"city": "Paris"}',
            [("get_weather", {"city": "Paris"})],
            None,
        ),
    ],
)
def test_harmony_calls_come_back_as_tool_calls(
    harmony: Tokenizer, reply: str, calls: list[tuple[str, Any]], content: str | None, per_round: int
) -> None:
    engine = FakeEngine(harmony_ids(harmony, reply), per_round=per_round)
    for choice in both_ways(engine, harmony, REQUEST):
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == content
        assert choice.message.reasoning_content == "Need the weather."  # type: ignore[attr-defined]
        got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]  # type: ignore[union-attr]
        assert got == calls
    assert "get_weather;get_time;" in harmony.decode(engine.streams[0].prompt_ids)


def test_harmony_calls_without_tools_or_cut_off_are_reasoning(harmony: Tokenizer) -> None:
    """A request without tools reads a message to a function as reasoning, as before; so does a call cut off by
    max_tokens (its arguments are not whole)."""
    engine = FakeEngine(harmony_ids(harmony, THOUGHT + WEATHER))
    app = app_over(engine, harmony)
    n_tokens = len(engine.reply)
    with running(app) as base:
        plain = client(base).chat.completions.create(model="m", messages=REQUEST["messages"])
        cut = client(base).chat.completions.create(**REQUEST, max_tokens=n_tokens - 2)
    for choice in (plain.choices[0], cut.choices[0]):
        assert not choice.message.tool_calls
        assert choice.message.reasoning_content.startswith("Need the weather.")  # type: ignore[attr-defined]
    assert (
        plain.choices[0].finish_reason == "stop" and '{"city": "Paris"}' in plain.choices[0].message.reasoning_content
    )  # type: ignore[attr-defined]
    assert cut.choices[0].finish_reason == "length" and '{"city": "Pa' in cut.choices[0].message.reasoning_content  # type: ignore[attr-defined]


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_gives_the_first_call_only(tokenizer: Tokenizer, stream: bool) -> None:
    engine = FakeEngine(tokenizer.encode(CALLS))
    app = app_over(engine, tokenizer)
    request = {**REQUEST, "parallel_tool_calls": False}
    with running(app) as base:
        if stream:
            with client(base).chat.completions.stream(**request) as s:
                message = s.get_final_completion().choices[0].message
        else:
            message = client(base).chat.completions.create(**request).choices[0].message
    assert [c.function.name for c in message.tool_calls or []] == ["get_weather"]  # type: ignore[union-attr]
    assert message.content is None


class TemplateOnly:
    """What `tool_support` reads of a tokenizer."""

    def __init__(self, template: str, special_tag: bool = False) -> None:
        self.chat_template, self.special_tag = template, special_tag

    def chat_template_variables(self) -> frozenset[str]:
        return frozenset({"messages", "tools"})

    def token_id(self, token: str) -> int | None:
        return 7 if token == "<tool_call>" else None

    def decode(self, ids: list[int]) -> str:
        return "" if self.special_tag else "<tool_call>"


def test_a_tag_the_tokenizer_drops_is_shown_to_the_reader() -> None:
    """(A special token: the reply's text writes it out for the reader, which keeps it out of the content.)"""
    support = tool_support(TemplateOnly('<tool_call>\n{"name": ...', special_tag=True))
    assert support.syntax == "hermes" and support.shown == {7: "<tool_call>"}
    assert tool_support(TemplateOnly('<tool_call>\n{"name": ...')).shown == {}


# Each form as a template of the model's own writes a call (Qwen3's, Qwen3-Coder's, GLM-4.5's, MiniMax-M2's: written
# here, not copied): a reply written that way must read back as the call, and the call, sent back in the history,
# must render as the reply did.
CALL_IN_HISTORY = {
    "hermes": ('{%- for call in m.tool_calls %}\n<tool_call>\n{"name": "{{ call.function.name }}", "arguments": '
               "{{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}"),
    "qwen3_coder": ("{%- for call in m.tool_calls %}\n<tool_call>\n<function={{ call.function.name }}>\n"
                    "{% for key, value in call.function.arguments | items %}<parameter={{ key }}>\n"
                    "{{ value | tojson if value is mapping or (value is sequence and value is not string) else "
                    "value | string }}\n</parameter>\n{% endfor %}</function>\n"
                    "</tool_call>{% endfor %}"),
    "glm45": ("{%- for call in m.tool_calls %}\n<tool_call>{{ call.function.name }}\n"
              "{% for key, value in call.function.arguments | items %}<arg_key>{{ key }}</arg_key>\n"
              "<arg_value>{{ value if value is string else value | tojson }}</arg_value>\n{% endfor %}</tool_call>"
              "{% endfor %}"),
    "minimax": ("\n<minimax:tool_call>\n{% for call in m.tool_calls %}<invoke name=\"{{ call.function.name }}\">\n"
                "{% for key, value in call.function.arguments | items %}<parameter name=\"{{ key }}\">"
                "{{ value if value is string else value | tojson }}</parameter>\n{% endfor %}</invoke>\n{% endfor %}"
                "</minimax:tool_call>"),
    # the forms whose markers are special tokens (`MARKERS`)
    "mistral": ("[TOOL_CALLS][{% for call in m.tool_calls %}{% if call.id | length != 9 %}"
                "{{ raise_exception('call ids are nine letters and digits') }}{% endif %}"
                "{% set function = call.function | tojson %}{{ function[:-1] }}, \"id\": \"{{ call.id }}\"}"
                "{{ ', ' if not loop.last }}{% endfor %}]"),
    "mistral_args": ("{% for call in m.tool_calls %}[TOOL_CALLS]{{ call.function.name }}[ARGS]"
                     "{{ call.function.arguments | tojson }}{% endfor %}"),
    "granite": "<|tool_call|>{{ m.tool_calls | map(attribute='function') | list | tojson }}",
    "deepseek_v3": ("<｜tool▁calls▁begin｜>{% for call in m.tool_calls %}{{ '<｜tool▁call▁begin｜>' + call.type + "
                    "'<｜tool▁sep｜>' + call.function.name + '\\n```json\\n' + call.function.arguments + "
                    "'\\n```<｜tool▁call▁end｜>' }}{% endfor %}<｜tool▁calls▁end｜>"),
    "deepseek_v31": ("<｜tool▁calls▁begin｜>{% for call in m.tool_calls %}{{ '<｜tool▁call▁begin｜>' + "
                     "call.function.name + '<｜tool▁sep｜>' + call.function.arguments + '<｜tool▁call▁end｜>' }}"
                     "{% endfor %}<｜tool▁calls▁end｜>"),
    "kimi_k2": ("<|tool_calls_section_begin|>{% for call in m.tool_calls %}<|tool_call_begin|>{{ call.id }}"
                "<|tool_call_argument_begin|>{{ call.function.arguments if call.function.arguments is string else "
                "call.function.arguments | tojson }}<|tool_call_end|>{% endfor %}<|tool_calls_section_end|>"),
}  # fmt: skip
DEEPSEEK = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
            "<｜tool▁calls▁end｜>")  # fmt: skip
KIMI = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
        "<|tool_calls_section_end|>")  # fmt: skip
MARKERS = {"mistral": ("[TOOL_CALLS]",), "mistral_args": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
           "granite": ("<|tool_call|>",), "deepseek_v3": DEEPSEEK, "deepseek_v31": DEEPSEEK,
           "kimi_k2": KIMI}  # special tokens, in the test tokenizer  # fmt: skip
NEEDS_OBJECT = ("qwen3_coder", "glm45", "minimax")  # templates that read a call's arguments as an object (`| items`)
TO_THE_END = ("mistral", "mistral_args", "granite")  # forms whose calls run to the reply's end: no text after them
ARGUMENTS = {"city": "Paris", "days": 3, "code": "007", "opts": {"a": [1, True]}, "note": "two\n\nlines", "on": False,
             "count": None, "zip": "12345", "ref": "99"}  # fmt: skip
TYPES = {"city": "string", "days": "integer", "code": "string", "opts": "object", "note": ["string", "null"],
         "on": "boolean", "count": ["integer", "null"]}  # fmt: skip
SCHEMA = {"type": "object", "properties": {key: {"type": kind} for key, kind in TYPES.items()}
          | {"zip": {"anyOf": [{"type": "string"}, {"type": "null"}]},  # (pydantic's Optional[str])
             "ref": {"$ref": "#/$defs/Ref"}}}  # (no type named: text)  # fmt: skip


CALL = {"id": "call_1", "type": "function", "function": {"name": "plan", "arguments": json.dumps(ARGUMENTS)}}
HISTORY = [{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": [CALL]}]
PLAN = [{"type": "function", "function": {"name": "plan", "parameters": SCHEMA}}]
CALL_IDS = {"mistral": "a1B2c3D4e", "kimi_k2": "functions.plan:0"}  # ids as those forms' templates take them


def history(syntax: str) -> list[dict[str, Any]]:
    """`HISTORY`, its call's id as the form gives ids."""
    call = {**CALL, "id": CALL_IDS.get(syntax, CALL["id"])}
    return [HISTORY[0], {**HISTORY[1], "tool_calls": [call]}]


def form(folder: Path, syntax: str) -> tuple[Tokenizer, str]:
    """A tokenizer whose chat template writes calls in this form (its `MARKERS` special tokens), and the call of
    `history(syntax)` as it writes it."""
    from tokenizers import Tokenizer as HfTokenizer

    from moelane.server.tools import ARGUMENTS_AS_TEXT

    template = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n{% endif %}"
                "{% for m in messages %}<|im_start|>{{ m.role }}{% if m.tool_calls %}" + CALL_IN_HISTORY[syntax] +
                "{% else %}\n{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant")  # fmt: skip
    write_tokenizer(folder, 300)
    hf = HfTokenizer.from_file(str(folder / "tokenizer.json"))
    hf.add_special_tokens(list(MARKERS.get(syntax, ())))
    hf.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    tok = Tokenizer(folder, frozenset())
    assert tool_support(tok).syntax == syntax
    as_text = syntax in ARGUMENTS_AS_TEXT
    messages = [ChatMessage.model_validate(m).for_template(as_text) for m in history(syntax)]  # as the server gives
    written = tok.apply_chat_template(messages, add_generation_prompt=False).split("<|im_start|>assistant")[1]
    return tok, written.removesuffix("<|im_end|>\n")


def shown(tok: Tokenizer, ids: list[int]) -> str:
    """The text of `ids` with every special token written out (markers included)."""
    return tok.decode(ids, frozenset(range(tok.vocab_size)))


@pytest.mark.parametrize("syntax", list(CALL_IN_HISTORY))
def test_each_form_reads_back_what_its_template_writes(tmp_path: Path, syntax: str) -> None:
    tok, written = form(tmp_path, syntax)
    messages, tools = history(syntax), PLAN
    call = messages[1]["tool_calls"][0]
    after = "" if syntax in TO_THE_END else "\n\nDone."
    reply = written + after  # what the model writes: the call, then more text
    engine = FakeEngine(tok.encode(reply), per_round=3)
    app = app_over(engine, tok)
    with running(app) as base:
        whole = client(base).chat.completions.create(model="m", messages=messages[:1], tools=tools)  # type: ignore[arg-type]
        with client(base).chat.completions.stream(model="m", messages=messages[:1], tools=tools) as stream:  # type: ignore[arg-type]
            streamed = stream.get_final_completion()
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": messages, "tools": tools}, timeout=30)
        # arguments that are not JSON reach the template as text: where it needs an object, a 400, not a 500
        bad = {**call, "function": {"name": "plan", "arguments": "oops"}}
        odd = [messages[0], {**messages[1], "tool_calls": [bad]}]
        refused = httpx.post(f"{base}/v1/chat/completions", json={"messages": odd, "tools": tools}, timeout=30)
    for choice in (whole.choices[0], streamed.choices[0]):
        calls = choice.message.tool_calls or []
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("plan", ARGUMENTS)]  # type: ignore[union-attr]
        assert choice.message.content == (after.strip() or None) and choice.finish_reason == "tool_calls"
        assert syntax not in CALL_IDS or calls[0].id == call["id"]  # (ids the template writes back: the model's)
    assert r.status_code == 200, r.text
    if syntax in NEEDS_OBJECT:  # (the others write the text as it is)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages", refused.text
    else:
        assert refused.status_code == 200, refused.text
    assert written in shown(tok, engine.streams[2].prompt_ids)  # (the history request's)


@pytest.mark.parametrize(
    ("read", "body"),
    [
        (read_function_call, "\n<function=f>\n<parameter=a>\n1\n</parameter>\nstray text\n</function>\n"),
        (read_function_call, "\n<function=f>\n<parameter=a>\n1\n"),  # no </parameter>, no </function>
        (read_function_call, '\n{"name": "f", "arguments": {}}\n'),
        (read_keyed_call, "f\n<arg_key>a</arg_key>\nstray\n<arg_value>1</arg_value>\n"),
        (read_keyed_call, '{"name": "f", "arguments": {}}'),
        (read_keyed_call, "two words\n<arg_key>a</arg_key><arg_value>1</arg_value>"),
        (read_keyed_call, 'get_weather(city="Paris")'),  # (a name is a function's name: OpenAI's rule)
        (read_keyed_call, "<tool_call>f\n<arg_key>a</arg_key><arg_value>1</arg_value>"),
        (read_function_call, "<function=<b>\n</function>"),
        # a model looping in a block that never closes its values: one pass, where lazy patterns took minutes
        (read_keyed_call, "f\n" + "<arg_key>a</arg_key>\n<arg_value>x\n" * 3000),
        (read_function_call, "\n<function=f>\n" + "<parameter=a>\nx\n" * 3000 + "</function>"),
    ],
)
def test_tagged_blocks_that_are_not_calls_are_not_read(read: Any, body: str) -> None:
    assert read(body, {}) is None
    assert read_keyed_call("now\n", {}) is not None  # (a call without arguments)


@pytest.mark.parametrize(
    "body",
    [
        '\n<invoke name="f">\n<parameter name="a">1</parameter>\nstray\n</invoke>\n',
        '\n<invoke name="f">\n<parameter name="a">1\n</invoke>\n',  # no </parameter>
        '\n<invoke name="f">\n<parameter name="a">1</parameter>\n',  # no </invoke>
        '<invoke name="f"></invoke>\ntext after\n',
        '{"name": "f", "arguments": {}}',
        '<invoke name="two words"></invoke>',
        "",
        '<invoke name="f">' + '<parameter name="a">x\n' * 3000 + "</invoke>",
    ],
)
def test_minimax_blocks_that_are_not_calls_are_not_read(body: str) -> None:
    assert read_invokes(body, {}) is None


def test_a_minimax_block_holds_each_of_its_calls_in_order(tmp_path: Path) -> None:
    """MiniMax-M2 writes parallel calls as `<invoke>` elements of one block: each is a call, typed by its own
    tool's schema, and `parallel_tool_calls: false` keeps the first; a block cut off by max_tokens stays text."""
    tok, _ = form(tmp_path, "minimax")
    block = ('Checking.\n<minimax:tool_call>\n<invoke name="trip">\n<parameter name="city">Rome</parameter>\n'
             '<parameter name="days">2</parameter>\n</invoke>\n<invoke name="ping">\n</invoke>\n'
             "</minimax:tool_call>")  # fmt: skip
    request = {"model": "m", "messages": HISTORY[:1], "tools": TRIP_TOOLS}
    for got in both_ways(FakeEngine(tok.encode(block), per_round=2), tok, request):
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in got.message.tool_calls]
        assert calls == [("trip", {"city": "Rome", "days": 2}), ("ping", {})]
        assert got.message.content == "Checking." and got.finish_reason == "tool_calls"
    one = {**request, "parallel_tool_calls": False}
    for got in both_ways(FakeEngine(tok.encode(block)), tok, one):
        assert [c.function.name for c in got.message.tool_calls] == ["trip"]
    cut = block[: block.index("</invoke>")]
    assert split_reply(cut, ToolUse("minimax").reader(), stopped=True) == (cut, [])


def test_only_an_assistant_message_passes_calls_and_reasoning_to_the_template() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    user = ChatMessage.model_validate({"role": "user", "content": "hi", "tool_calls": [call]})
    assistant = ChatMessage.model_validate({"role": "assistant", "tool_calls": [call], "reasoning_content": "hm"})
    assert user.for_template() == {"role": "user", "content": "hi"}
    calls = [{**call, "function": {"name": "f", "arguments": {}}}]  # (arguments as an object, for templates)
    assert assistant.for_template() == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "hm",
        "thinking": "hm",  # (gpt-oss's template reads this name)
        "tool_calls": calls,
    }


def test_an_assistant_turn_of_calls_with_an_empty_content_list_reads_as_no_content() -> None:
    """Some clients write a turn of tool calls only with `content: []`: it is the turn with null content, where a
    user's empty list is refused."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    empty = ChatMessage.model_validate({"role": "assistant", "content": [], "tool_calls": [call]})
    null = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [call]})
    assert empty.for_template() == null.for_template()
    with pytest.raises(ValueError, match="must not be an empty list"):
        ChatMessage.model_validate({"role": "user", "content": []})


def test_an_assistants_refusal_reaches_the_template_as_its_text() -> None:
    refused = ChatMessage.model_validate({"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]})
    assert refused.for_template() == {"role": "assistant", "content": "No."}


def test_messagesarguments_that_are_not_an_object_reach_the_template_as_text() -> None:
    from moelane.server.protocol import template_tool_calls

    for text in ("not json", "[1, 2]", "[" * 5000):  # (the last nests deeper than Python's JSON reader goes)
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": text}}
        assert template_tool_calls([call]) == [call]


def test_harmony_arguments_that_are_not_an_object_are_reasoning(harmony: Tokenizer) -> None:
    """As a `<tool_call>` block that is not a call stays text; and a reply with tools but no text says null."""
    body = "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>now please"
    engine = FakeEngine(harmony_ids(harmony, THOUGHT + body))
    for choice in both_ways(engine, harmony, REQUEST):
        assert not choice.message.tool_calls and choice.finish_reason == "stop"
        assert choice.message.content is None and "now please" in choice.message.reasoning_content  # type: ignore[attr-defined]


def test_harmony_messagesgives_each_call_a_message_of_its_own() -> None:
    from moelane.server.prompts import one_call_each

    call = {"id": "a", "type": "function", "function": {"name": "f", "arguments": {}}}
    two = {"role": "assistant", "content": "", "thinking": "hm", "tool_calls": [call, {**call, "id": "b"}]}
    user = {"role": "user", "content": "go"}
    second = {"role": "assistant", "content": "", "tool_calls": [{**call, "id": "b"}]}
    assert one_call_each([user, two]) == [user, {**two, "tool_calls": [call]}, second]


@pytest.mark.parametrize("named", [False, True])
@pytest.mark.parametrize("syntax", list(CALL_IN_HISTORY))
def test_tool_choice_forces_a_call_by_the_opening_the_prompt_ends_with(
    tmp_path: Path, syntax: str, named: bool
) -> None:
    """`tool_choice` "required" or a named function: the prompt ends with the start of a call in the model's own
    form, and the model writes the rest (nothing constrains it: the call is as good as the model). A named choice
    ends "stop", as OpenAI's does."""
    tok, written = form(tmp_path, syntax)
    opening = call_opening(syntax, "plan" if named else None)
    assert written.lstrip().startswith(opening)
    engine = FakeEngine(tok.encode(written.lstrip()[len(opening) :]))  # the rest, as the model would write it
    choice = {"type": "function", "function": {"name": "plan"}} if named else "required"
    for got in both_ways(engine, tok, {"model": "m", "messages": HISTORY[:1], "tools": PLAN, "tool_choice": choice}):
        assert [(c.function.name, json.loads(c.function.arguments)) for c in got.message.tool_calls] == [
            ("plan", ARGUMENTS)]  # fmt: skip
        assert got.finish_reason == ("stop" if named else "tool_calls") and got.message.content is None
    assert shown(tok, engine.streams[0].prompt_ids).endswith(opening)


TRIP = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1,
        "maximum": 9}}, "required": ["city", "days"], "additionalProperties": False}  # fmt: skip
PING = {"type": "object", "properties": {}}
TRIP_TOOLS = [{"type": "function", "function": {"name": "trip", "parameters": TRIP}},
              {"type": "function", "function": {"name": "ping", "parameters": PING}}]  # fmt: skip


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "trip"}}, "required"])
def test_a_forced_call_is_held_to_the_tools_schema(tmp_path: Path, choice: Any) -> None:
    """On a real (random) model, which would write noise: a forced call's JSON is held token by token to a call
    of a tool given, with arguments its schema accepts (named: of that tool)."""
    import moelane
    from tests.helpers import random_model
    from tests.server.conftest import make_engine

    folder = random_model("qwen3_moe", tmp_path)
    form(folder, "hermes")  # (its tokenizer, with a chat template that writes <tool_call> blocks)
    lm = moelane.load(folder)
    request = {"model": "m", "messages": HISTORY[:1], "tools": TRIP_TOOLS, "tool_choice": choice, "max_tokens": 150,
               "n": 4, "temperature": 1.0, "seed": 3}  # fmt: skip
    with running(create_app(make_engine(lm, drafter="copy"), lm, model_name="m")) as base:
        reply = client(base).chat.completions.create(**request)
    for got in reply.choices:
        assert got.finish_reason == ("stop" if isinstance(choice, dict) else "tool_calls")
        (call,) = got.message.tool_calls or []
        arguments = json.loads(call.function.arguments)
        assert call.function.name in (["trip"] if isinstance(choice, dict) else ["trip", "ping"])
        if call.function.name == "trip":
            assert arguments["city"] in ("Paris", "Rome") and arguments["days"] in range(1, 10)
            assert set(arguments) == {"city", "days"}


@pytest.mark.parametrize(
    ("syntax", "choice", "rest"),
    [
        ("hermes", {"type": "function", "function": {"name": "trip"}}, '{"city": "Rome", "days": 2}}'),
        ("hermes", "required", '{"name": "ping", "arguments": {}}'),
        ("harmony", {"type": "function", "function": {"name": "trip"}}, '{"city": "Paris", "days": 9}'),
        ("harmony", "required", None),  # (the name is written before <|constrain|>: not constrained)
        ("qwen3_coder", "required", None),  # (tagged parameters, not JSON)
        ("minimax", {"type": "function", "function": {"name": "trip"}}, None),
        ("hermes", "auto", None),
        ("mistral", {"type": "function", "function": {"name": "trip"}}, '{"city": "Rome", "days": 2}}]'),
        ("mistral", "required", '[{"name": "ping", "arguments": {}}, {"name": "trip", "arguments": {"city": "Paris", '
                                '"days": 1}}]'),
        ("granite", "required", '[{"name": "ping", "arguments": {}}]'),
        ("mistral_args", {"type": "function", "function": {"name": "trip"}}, '{"city": "Rome", "days": 2}'),
        ("mistral_args", "required", None),  # (the name comes first, then [ARGS])
        ("deepseek_v3", {"type": "function", "function": {"name": "trip"}}, '{"city": "Rome", "days": 2}\n```'),
        ("deepseek_v31", {"type": "function", "function": {"name": "trip"}}, '{"city": "Rome", "days": 2}'),
        ("deepseek_v31", "required", None),
        ("kimi_k2", {"type": "function", "function": {"name": "trip"}}, '{"city": "Rome", "days": 2}'),
    ],
)  # fmt: skip
def test_which_forced_calls_a_grammar_holds(
    tmp_path: Path, harmony: Tokenizer, syntax: str, choice: Any, rest: str | None
) -> None:
    from moelane.server.prompts import Prompts

    tok = harmony if syntax == "harmony" else form(tmp_path, syntax)[0]
    prompts = Prompts(FakeLM(tok), "m")
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": HISTORY[:1], "tools": TRIP_TOOLS,
                                                 "tool_choice": choice})  # fmt: skip
    grammar = prompts.call_grammar(body, prompts.tool_use(body))
    assert (grammar is None) == (rest is None)
    if grammar is not None and rest is not None:
        reply = tok.encode(rest)
        assert all(grammar.allowed(reply[:k])[t] for k, t in enumerate(reply))
        assert grammar.allowed(reply).nonzero().flatten().tolist() == [tok.vocab_size - 1]  # only the end


def test_a_function_without_parameters_takes_none(tmp_path: Path) -> None:
    from moelane.server.prompts import Prompts

    tok, _ = form(tmp_path, "hermes")
    now = {"type": "function", "function": {"name": "now"}}
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": HISTORY[:1], "tools": [now],
                                                 "tool_choice": now})  # fmt: skip
    prompts = Prompts(FakeLM(tok), "m")
    grammar = prompts.call_grammar(body, prompts.tool_use(body))
    assert grammar is not None
    empty, some = tok.encode("{}}"), tok.encode('{"a": 1}}')
    assert all(grammar.allowed(empty[:k])[t] for k, t in enumerate(empty))
    assert not all(grammar.allowed(some[:k])[t] for k, t in enumerate(some))


def test_a_tool_schema_that_cannot_be_used_leaves_the_call_free(tmp_path: Path) -> None:
    from moelane.server.prompts import Prompts

    tok, _ = form(tmp_path, "hermes")
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"$ref": "#/$defs/missing"}}}}}]  # fmt: skip
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": HISTORY[:1], "tools": bad,
                                                 "tool_choice": "required"})  # fmt: skip
    prompts = Prompts(FakeLM(tok), "m")
    assert prompts.call_grammar(body, prompts.tool_use(body)) is None


HARMONY_REST = 'get_weather <|constrain|>json<|message|>{"city": "Paris"}'  # after "to=functions."


@pytest.mark.parametrize(("named", "rest"), [(True, '{"city": "Paris"}'), (False, HARMONY_REST)])
def test_tool_choice_forces_a_harmony_call(harmony: Tokenizer, named: bool, rest: str) -> None:
    engine = FakeEngine(harmony_ids(harmony, rest))
    choice = {"type": "function", "function": {"name": "get_weather"}} if named else "required"
    for got in both_ways(engine, harmony, {**REQUEST, "tool_choice": choice}):
        assert [(c.function.name, json.loads(c.function.arguments)) for c in got.message.tool_calls] == [
            ("get_weather", {"city": "Paris"})]  # fmt: skip
    opening = call_opening("harmony", "get_weather" if named else None)
    assert harmony.decode(engine.streams[0].prompt_ids).endswith(
        opening.replace("<|constrain|>", "").replace("<|channel|>", "").replace("<|message|>", "")
    )  # (decoded without its special tokens)


@pytest.mark.parametrize(
    ("reply", "extra", "calls"),
    [
        (REPLY.removesuffix("</tool_call>"), {}, ["get_weather", "get_time"]),  # ended by end of text
        (REPLY, {"stop": "</tool_call>"}, ["get_weather"]),  # clients' way of ending at a call
    ],
)
def test_a_block_left_open_is_a_call_when_the_reply_stopped(
    tokenizer: Tokenizer, reply: str, extra: dict[str, Any], calls: list[str]
) -> None:
    for got in both_ways(FakeEngine(tokenizer.encode(reply)), tokenizer, {**REQUEST, **extra}):
        assert [c.function.name for c in got.message.tool_calls or []] == calls and got.finish_reason == "tool_calls"


def test_a_block_left_open_by_max_tokens_is_text(tokenizer: Tokenizer) -> None:
    """(Its arguments may be cut short, and the stream helper refuses "length" replies: the whole one is read.)"""
    ids = tokenizer.encode(REPLY.removesuffix("</tool_call>"))
    with running(app_over(FakeEngine(ids), tokenizer)) as base:
        got = client(base).chat.completions.create(**REQUEST, max_tokens=len(ids)).choices[0]
    assert [c.function.name for c in got.message.tool_calls or []] == ["get_weather"] and got.finish_reason == "length"
    assert got.message.content == 'Let me look.\n\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'

"""Tool calls in the forms whose markers are special tokens (Mistral's `[TOOL_CALLS]`, Granite's `<|tool_call|>`,
DeepSeek's and Kimi-K2's): the reader sees the markers, the content never does, and a block that is not a call reads
as the reply would without tools. (Each form's round trip, forced calls and grammars: `test_tools.py`, whose test
templates write these forms too.)"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from moelane.server.calls import read_call_list, read_deepseek_calls, read_kimi_calls, read_named_args
from moelane.server.tools import FORMS, ToolUse, split_reply, tool_support
from tests.server.conftest import running
from tests.server.fake_engine import FakeEngine
from tests.server.test_tools import HISTORY, TRIP_TOOLS, TemplateOnly, app_over, both_ways, client, form, shown

REQUEST: dict[str, Any] = {"model": "m", "messages": HISTORY[:1], "tools": TRIP_TOOLS}
DS = {"CALLS": "<｜tool▁calls▁begin｜>", "CALL": "<｜tool▁call▁begin｜>", "SEP": "<｜tool▁sep｜>",
      "END": "<｜tool▁call▁end｜>", "CALLS_END": "<｜tool▁calls▁end｜>"}  # fmt: skip
KIMI = {"CALLS": "<|tool_calls_section_begin|>", "CALL": "<|tool_call_begin|>", "ARGS": "<|tool_call_argument_begin|>",
        "END": "<|tool_call_end|>", "CALLS_END": "<|tool_calls_section_end|>"}  # fmt: skip
TRIP, PING = '{"city": "Rome", "days": 2}', "{}"


def ds(*calls: str) -> str:
    return DS["CALLS"] + "".join(DS["CALL"] + call + DS["END"] for call in calls) + DS["CALLS_END"]


def kimi(*calls: str) -> str:
    return KIMI["CALLS"] + "".join(KIMI["CALL"] + call + KIMI["END"] for call in calls) + KIMI["CALLS_END"]


# (form, reply, its content, its calls: (id, or None for a fresh one; name; arguments))
CALLS = [
    ("mistral", f'[TOOL_CALLS][{{"name": "trip", "arguments": {TRIP}, "id": "a1B2c3D4e"}}, {{"name": "ping"}}]',
     None, [("a1B2c3D4e", "trip", TRIP), (None, "ping", PING)]),
    ("mistral", f'Checking.\n\n[TOOL_CALLS] [{{"name": "trip", "arguments": {json.dumps(TRIP)}}}]',
     "Checking.", [(None, "trip", TRIP)]),  # (the space v3's templates write after the marker; arguments as text)
    ("mistral_args", f"[TOOL_CALLS]trip[ARGS]{TRIP}[TOOL_CALLS]ping[CALL_ID]x9Y8z7W6v[ARGS]{{}}",
     None, [(None, "trip", TRIP), ("x9Y8z7W6v", "ping", PING)]),
    ("granite", f'<|tool_call|>[{{"name": "trip", "arguments": {TRIP}}}, {{"name": "ping", "arguments": {{}}}}]',
     None, [(None, "trip", TRIP), (None, "ping", PING)]),
    ("deepseek_v3", "Checking.\n" + ds(f"function{DS['SEP']}trip\n```json\n{TRIP}\n```",
                                        f"function{DS['SEP']}ping\n```json\n{{}}\n```"),
     "Checking.", [(None, "trip", TRIP), (None, "ping", PING)]),
    ("deepseek_v31", ds(f"trip{DS['SEP']}{TRIP}", f"ping{DS['SEP']}{{}}") + "\n\nDone.",
     "Done.", [(None, "trip", TRIP), (None, "ping", PING)]),
    ("deepseek_v3", ds(f"trip{DS['SEP']}{TRIP}"), None, [(None, "trip", TRIP)]),  # (V3.1's call, from a V3 model)
    ("kimi_k2", kimi(f"functions.trip:0{KIMI['ARGS']}{TRIP}", f" functions.ping:1 {KIMI['ARGS']} {{}} "),
     None, [("functions.trip:0", "trip", TRIP), ("functions.ping:1", "ping", PING)]),
]  # fmt: skip


@pytest.mark.parametrize(("syntax", "reply", "content", "calls"), CALLS)
def test_each_call_of_a_block_comes_back_with_its_id(
    tmp_path: Path, syntax: str, reply: str, content: str | None, calls: list[tuple[str | None, str, str]]
) -> None:
    """A call keeps the id the model wrote (Kimi-K2's `functions.NAME:IDX`, Mistral's), and one that gives none
    gets one (of nine letters and digits in Mistral's forms, which its templates refuse otherwise)."""
    tok, _ = form(tmp_path, syntax)
    fresh = r"[A-Za-z0-9]{9}" if syntax.startswith("mistral") else r"call_[0-9a-f]{24}"
    for got in both_ways(FakeEngine(tok.encode(reply), per_round=2), tok, REQUEST):
        assert got.finish_reason == "tool_calls" and got.message.content == content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in got.message.tool_calls or []] == [
            (name, json.loads(arguments)) for _, name, arguments in calls]  # fmt: skip
        for (given, _, _), call in zip(calls, got.message.tool_calls or [], strict=True):
            assert call.id == given if given else re.fullmatch(fresh, call.id), call.id


# Blocks that are not calls: the content is the reply as a decode without tools has it (its special tokens dropped).
NOT_CALLS = [
    ("mistral", '[TOOL_CALLS][{"name": "trip", "arguments": {"city": Rome}}]'),  # not JSON
    ("mistral", '[TOOL_CALLS]{"name": "trip", "arguments": {}}'),  # not a list
    ("mistral", '[TOOL_CALLS][{"name": "trip"}] and then some text'),
    ("mistral", "[TOOL_CALLS][]"),
    ("mistral_args", 'Let me see [ARGS] this.\n[TOOL_CALLS]trip{"city": "Rome"}'),  # a stray marker, no [ARGS]
    ("mistral_args", '[TOOL_CALLS]two words[ARGS]{"city": "Rome"}'),
    ("mistral_args", '[TOOL_CALLS]trip[ARGS]{"city": "Rome"} and more'),
    ("granite", '<|tool_call|>[{"arguments": {}}]'),
    ("deepseek_v3", ds(f"function{DS['SEP']}trip\n```json\n{{\"city\"\n```") + " after"),
    ("deepseek_v3", DS["CALLS"] + "text" + DS["CALL"] + f"trip{DS['SEP']}{{}}" + DS["END"] + DS["CALLS_END"]),
    ("deepseek_v31", ds(f"trip{DS['SEP']}{{}}" + DS["CALL"] + f"ping{DS['SEP']}{{}}")),  # a call within a call
    ("deepseek_v31", ds("trip{}")),  # no separator
    ("kimi_k2", kimi(f"trip{KIMI['ARGS']}{{}}")),  # no index
    ("kimi_k2", kimi(f"functions.trip:0{KIMI['ARGS']}[1, 2]")),
    ("kimi_k2", KIMI["END"] + " stray " + KIMI["CALLS_END"]),
]  # fmt: skip


@pytest.mark.parametrize(("syntax", "reply"), NOT_CALLS)
def test_a_marker_block_that_is_not_a_call_reads_as_without_tools(tmp_path: Path, syntax: str, reply: str) -> None:
    tok, _ = form(tmp_path, syntax)
    ids = tok.encode(reply)
    without_tools = tok.decode(ids)
    assert without_tools != reply  # (the markers are special tokens: a decode drops them)
    for got in both_ways(FakeEngine(ids, per_round=3), tok, REQUEST):
        assert not got.message.tool_calls and got.finish_reason == "stop"
        assert got.message.content == without_tools


@pytest.mark.parametrize(("syntax", "reply", "content", "calls"), CALLS)
def test_a_marker_reply_reads_the_same_however_it_streams(syntax: str, reply: str, content: Any, calls: Any) -> None:
    """Pieces that split a marker (a stop string's filter may hold part of one back): held until known."""
    tags = (FORMS[syntax].opening, FORMS[syntax].closing, *FORMS[syntax].tags)
    use = ToolUse(syntax, shown={i: tag for i, tag in enumerate(tags) if tag})
    for text in (reply, reply.replace(FORMS[syntax].opening, "x", 1), *(r for s, r in NOT_CALLS if s == syntax)):
        said, whole = split_reply(text, use.reader(), stopped=True)
        rng = random.Random(0)
        for _ in range(20):
            reader, parts, at = use.reader(), [], 0
            assert reader is not None
            while at < len(text):
                parts += reader.feed(text[at : (at := at + rng.randint(1, 4))])
            parts += reader.end(stopped=True)
            calls_ = [p for p in parts if not isinstance(p, str)]
            assert [(c.function.name, c.function.arguments) for c in calls_] == [
                (c.function.name, c.function.arguments) for c in whole]  # fmt: skip
            text_ = "".join(p for p in parts if isinstance(p, str))
            assert (text_ or None if whole else text_) == said
            assert not any(tag in text_ for tag in tags if tag)


def test_a_marker_block_cut_off_by_max_tokens_is_text(tmp_path: Path) -> None:
    """Even one that reads as a call: its list, or its arguments, may have been cut short."""
    tok, _ = form(tmp_path, "mistral")
    ids = tok.encode('[TOOL_CALLS][{"name": "ping", "arguments": {}}]')
    with running(app_over(FakeEngine(ids), tok)) as base:
        got = client(base).chat.completions.create(**REQUEST, max_tokens=len(ids)).choices[0]
    assert got.finish_reason == "length" and not got.message.tool_calls
    assert got.message.content == '[{"name": "ping", "arguments": {}}]'


@pytest.mark.parametrize("syntax", ["mistral_args", "deepseek_v31"])
def test_parallel_tool_calls_false_gives_the_first_marker_call(tmp_path: Path, syntax: str) -> None:
    tok, _ = form(tmp_path, syntax)
    reply = next(r for s, r, _, _ in CALLS if s == syntax)
    for got in both_ways(FakeEngine(tok.encode(reply)), tok, {**REQUEST, "parallel_tool_calls": False}):
        assert [c.function.name for c in got.message.tool_calls or []] == ["trip"]


@pytest.mark.parametrize(
    ("syntax", "rest", "opening"),
    [  # the rest as a grammar ends it: at the end of the JSON it holds, before the markers that close the call
        ("deepseek_v3", TRIP + "\n```", DS["CALLS"] + DS["CALL"] + "function" + DS["SEP"] + "trip\n```json\n"),
        ("deepseek_v31", TRIP, DS["CALLS"] + DS["CALL"] + "trip" + DS["SEP"]),
        ("kimi_k2", TRIP, KIMI["CALLS"] + KIMI["CALL"] + "functions.trip:1" + KIMI["ARGS"]),
        ("mistral", TRIP + "}]", '[TOOL_CALLS][{"name": "trip", "arguments": '),
        ("granite", TRIP + "}]", '<|tool_call|>[{"name": "trip", "arguments": '),
        ("mistral_args", TRIP, "[TOOL_CALLS]trip[ARGS]"),
    ],
)  # fmt: skip
def test_a_forced_call_ended_where_its_grammar_ends_it(tmp_path: Path, syntax: str, rest: str, opening: str) -> None:
    """A named call's opening in the prompt (Kimi-K2's numbered after the conversation's calls so far); the reply
    ends at the end of the arguments and whatever text closes them (a grammar cannot write special tokens), and the
    block left open reads as the call."""
    tok, _ = form(tmp_path, syntax)
    earlier = [HISTORY[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "p1N2g3P4q", "type": "function", "function": {"name": "ping", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "p1N2g3P4q", "content": "pong"}]  # fmt: skip
    choice = {"type": "function", "function": {"name": "trip"}}
    engine = FakeEngine(tok.encode(rest))
    for got in both_ways(engine, tok, {**REQUEST, "messages": earlier, "tool_choice": choice}):
        assert [(c.function.name, json.loads(c.function.arguments)) for c in got.message.tool_calls or []] == [
            ("trip", json.loads(TRIP))]  # fmt: skip
        assert got.finish_reason == "stop" and got.message.content is None
    assert shown(tok, engine.streams[0].prompt_ids).endswith(opening)


@pytest.mark.parametrize(
    ("template", "syntax"),
    [  # each as the release's template spells its calls (written here, not copied)
        ('{{- "[TOOL_CALLS] [" }}{% for c in m.tool_calls %}{{ c.function | tojson }}{% endfor %}', "mistral"),
        ('{{- "[TOOL_CALLS]" + call.function.name + "[ARGS]" + call.function.arguments }}', "mistral_args"),
        ("{{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' + m.content }}", "granite"),
        ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + t.type + '<｜tool▁sep｜>' + t.function.name + "
         "'\\n```json'}}", "deepseek_v3"),
        ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + t.function.name + '<｜tool▁sep｜>'}}", "deepseek_v31"),
        ("<|tool_calls_section_begin|>{% for c in m.tool_calls %}<|tool_call_begin|>{{ c.id }}", "kimi_k2"),
        # Llama 4's: JSON between <|python_start|> and <|python_end|>, where Meta's notes have it write Python
        ('{{- "<|python_start|>" }}{{- \'{"name": "\' + c.name + \'", "parameters": \' }}', None),
        ("{{- '[' + c.name + '(' + args + ')]' }}", None),
    ],
)  # fmt: skip
def test_the_form_is_told_by_the_template(template: str, syntax: str | None) -> None:
    support = tool_support(TemplateOnly(template))
    assert support.syntax == syntax
    assert syntax is not None or ("[TOOL_CALLS]" in support.why_not and "writes them otherwise" in support.why_not)


@pytest.mark.parametrize(
    ("read", "body"),
    [
        (read_call_list, '[{"name": "f", "arguments": {}}, 3]'),
        (read_call_list, '[{"name": "f", "arguments": NaN}]'),
        (read_call_list, "[" * 5000 + "]" * 5000),
        (read_named_args, "f"),
        (read_named_args, 'f[ARGS]{"a": 1}[ARGS]{}'),
        (read_named_args, "f[ARGS]"),
        (read_deepseek_calls, ""),
        (read_deepseek_calls, "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```<｜tool▁call▁end｜>x"),
        (read_deepseek_calls, "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n<｜tool▁call▁end｜>"),
        (read_kimi_calls, "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>\nx"),
        (read_kimi_calls, "<|tool_call_begin|>functions.f:x<|tool_call_argument_begin|>{}<|tool_call_end|>"),
        (read_kimi_calls, "<|tool_call_begin|>functions.f:0{}<|tool_call_end|>"),
    ],
)
def test_marker_blocks_that_are_not_calls_are_not_read(read: Any, body: str) -> None:
    assert read(body, {}) is None


def test_deepseek_templates_get_a_calls_arguments_as_text(tmp_path: Path) -> None:
    """As DeepSeek's templates join them into the prompt (an object would fail there): the JSON text sent."""
    tok, _ = form(tmp_path, "deepseek_v31")
    sent = '{"city":  "Rome"}'  # (as sent, spacing and all)
    messages = [HISTORY[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "trip", "arguments": sent}}]}]  # fmt: skip
    engine = FakeEngine(tok.encode("ok"))
    with running(app_over(engine, tok)) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json={**REQUEST, "messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    assert "trip" + sent in tok.decode(engine.streams[0].prompt_ids)

"""How a block of a reply reads as tool calls, form by form (which form a model writes, and how its blocks are found
in a reply: `tools.py`). Each reader takes a block's body (the text between its opening and closing tags) and the
tools' parameter types, and gives the call or calls it holds, or None: the block is not a call, and stays text.

The forms whose markers are special tokens (Mistral's `[TOOL_CALLS]`, Granite's `<|tool_call|>`, DeepSeek's and
Kimi-K2's) are read from the reply's text with those markers written out (`ToolUse.shown`).
"""

from __future__ import annotations

import json
import random
import re
import string
import uuid
from collections.abc import Callable
from typing import Any

from moelane.server.protocol import FunctionCall, ToolCall

Types = dict[str, dict[str, Any]]  # per function, its parameters' JSON schemas (`parameters.properties`)


def read_call(body: str, types: Types | None = None) -> ToolCall | None:
    """The call a block's text holds (`call_in`), or None if it is not one."""
    try:
        return call_in(json.loads(body, parse_constant=_not_json))
    except (ValueError, RecursionError):  # (JSON nested a thousand deep: Python's parser gives up, as do we)
        return None


def call_in(value: Any, new_id: Callable[[], str] | None = None) -> ToolCall | None:
    """The call a JSON value is, or None: an object with a `name` and, as `arguments` (or `parameters`), an object
    or the JSON text of one (none: `{}`). `new_id`: the id of a call that gives none of its own (Mistral's template
    writes one as `id`); None: `call_id`'s, and any given is not read."""
    if not isinstance(value, dict) or not isinstance(name := value.get("name"), str) or not name:
        return None
    arguments = value.get("arguments", value.get("parameters"))
    if arguments is None:
        text: str | None = "{}"
    elif isinstance(arguments, str):
        text = object_text(arguments)
    elif isinstance(arguments, dict):
        try:
            text = json.dumps(arguments, ensure_ascii=False)
        except (ValueError, RecursionError):
            return None
    else:
        return None
    if text is None:
        return None
    given = value.get("id") if new_id is not None else None
    given = given if isinstance(given, str) and given else (new_id or call_id)()
    return ToolCall(id=given, function=FunctionCall(name=name, arguments=text))


def object_text(text: str) -> str | None:
    """`text` if it is the JSON text of an object (OpenAI's `arguments`), else None."""
    try:
        return text if isinstance(json.loads(text, parse_constant=_not_json), dict) else None
    except (ValueError, RecursionError):
        return None


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")  # (Python's reader takes NaN and Infinity; clients' do not)


NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names: no other name is one of the tools
PYTHON_WORDS = {"True": True, "False": False, "None": None}  # (Qwen3-Coder's template writes values with |string)


def read_function_call(body: str, types: Types) -> ToolCall | None:
    """Qwen3-Coder's `<function=NAME>` with its `<parameter=KEY>` values, or None."""
    body = body.strip()
    if not (body.startswith("<function=") and body.endswith("</function>")) or (end := body.find(">")) < 0:
        return None
    name, inner = body[len("<function=") : end], body[end + 1 : -len("</function>")]
    pairs = tag_pairs(inner, [("<parameter=", ">"), ("", "</parameter>")])
    if pairs is None:
        return None
    return tagged_call(name, [(key, trim_newline(value)) for key, value in pairs], types.get(name, {}))


def read_keyed_call(body: str, types: Types) -> ToolCall | None:
    """GLM-4.5's name, then its `<arg_key>`/`<arg_value>` pairs, or None."""
    name, tag, inner = body.partition("<arg_key>")
    pairs = tag_pairs(tag + inner, [("<arg_key>", "</arg_key>"), ("<arg_value>", "</arg_value>")])
    return None if pairs is None else tagged_call(name.strip(), pairs, types.get(name.strip(), {}))


INVOKE, INVOKE_END = "<invoke name=", "</invoke>"


def read_invokes(body: str, types: Types) -> list[ToolCall] | None:
    """MiniMax-M2's `<invoke name="NAME">` elements, each with its `<parameter name="KEY">` values, or None if
    the block holds anything else (names may go without quotes, as vLLM reads them)."""
    calls, at = [], skip_space(body, 0)
    while at < len(body):
        head = body.find(">", at)
        if not body.startswith(INVOKE, at) or head < 0 or (end := body.find(INVOKE_END, head)) < 0:
            return None
        pairs = tag_pairs(body[head + 1 : end], [("<parameter name=", ">"), ("", "</parameter>")])
        name = body[at + len(INVOKE) : head].strip().strip('"')
        if pairs is None:
            return None
        arguments = [(key.strip('"'), trim_newline(value)) for key, value in pairs]
        if (call := tagged_call(name, arguments, types.get(name, {}))) is None:
            return None
        calls.append(call)
        at = skip_space(body, end + len(INVOKE_END))
    return calls or None


def tag_pairs(text: str, tags: list[tuple[str, str]]) -> list[tuple[str, str]] | None:
    """(key, value) pairs written as `open key close` then `open value close` (`tags`), with only whitespace around
    and between them; None if anything else is there. One pass, by `find`: a model's runaway block costs its
    length, not its length cubed (as lazy regular expressions did)."""
    pairs, at = [], 0
    while (at := skip_space(text, at)) < len(text):
        found = []
        for opening, closing in tags:
            at = skip_space(text, at) if opening else at  # (an empty opening: the value starts at once)
            if not text.startswith(opening, at) or (end := text.find(closing, at + len(opening))) < 0:
                return None
            found.append(text[at + len(opening) : end])
            at = end + len(closing)
        pairs.append((found[0].strip(), found[1]))
    return pairs


def skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def trim_newline(value: str) -> str:
    """A Qwen3-Coder value without the newline its template writes on each side."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def tagged_call(name: str, pairs: list[tuple[str, str]], schemas: dict[str, Any]) -> ToolCall | None:
    """The call of `name` with these (key, value text) arguments, or None if `name` is not a function's name."""
    if not NAME.fullmatch(name):
        return None
    arguments = {key: typed(value, schemas.get(key)) for key, value in pairs}
    try:
        text = json.dumps(arguments, ensure_ascii=False)
    except (ValueError, RecursionError):
        return None
    return ToolCall(id=call_id(), function=FunctionCall(name=name, arguments=text))


def typed(text: str, schema: Any) -> Any:
    """A tagged value by its parameter's schema: kept as written for a string, or where the schema says no type
    (a parameter not in it, a `$ref`); else its JSON value where it parses (Python's True, False and None, which
    Qwen3-Coder's template writes, too), else the text."""
    kind = schema_type(schema)
    if kind in (None, "string"):
        return text
    if text.strip() in PYTHON_WORDS:
        return PYTHON_WORDS[text.strip()]
    try:
        return json.loads(text, parse_constant=_not_json)
    except (ValueError, RecursionError):
        return text


def schema_type(schema: Any) -> str | None:
    """A parameter schema's type: its `type` (of a list of types, the first that is not null; with string among
    them, string), or that of the first choice of an `anyOf`/`oneOf` that has one; None if it names none."""
    if not isinstance(schema, dict):
        return None
    kinds = schema.get("type")
    if isinstance(kinds, str):
        return kinds
    if isinstance(kinds, list):
        named = [k for k in kinds if isinstance(k, str) and k != "null"]
        return "string" if "string" in named else named[0] if named else None
    for choice in (*schema.get("anyOf", ()), *schema.get("oneOf", ())):
        if (kind := schema_type(choice)) not in (None, "null"):
            return kind
    return None


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def short_id() -> str:
    """A call id as Mistral's templates take them back: nine letters and digits (they refuse any other)."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


# ---- the forms whose markers are special tokens ----------------------------------------------------------------

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"  # Mistral's
GRANITE_CALL = "<|tool_call|>"
DEEPSEEK_CALLS, DEEPSEEK_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL, DEEPSEEK_SEP, DEEPSEEK_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
DEEPSEEK_FENCE, FENCE_END = "\n```json\n", "```"  # DeepSeek-V3's arguments, between NAME and the call's end
KIMI_CALLS, KIMI_CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGUMENTS, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
KIMI_ID = re.compile(rf"(?:functions\.)?({NAME.pattern}):\d+")  # `functions.NAME:IDX`, the call's id


def read_call_list(body: str, types: Types, new_id: Callable[[], str] = call_id) -> list[ToolCall] | None:
    """Mistral's calls (tokenizer v3: Mixtral-8x22B, Mistral-Nemo) and Granite 3's: a JSON list of call objects
    (`call_in`'s), each keeping the `id` it gives (Mistral's template writes them back so); None if the list is
    empty or an item is not a call."""
    try:
        items = json.loads(body, parse_constant=_not_json)
    except (ValueError, RecursionError):
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = [call_in(item, new_id) for item in items]
    return None if None in calls else [call for call in calls if call is not None]


def read_named_args(body: str, types: Types) -> list[ToolCall] | None:
    """Mistral's calls from tokenizer v11 on (Mistral-Small-3.2, Magistral, Devstral): `NAME[ARGS]{...}` after each
    `[TOOL_CALLS]` (the block's opening, the body's separator), or `NAME[CALL_ID]ID[ARGS]{...}`, whose id the call
    keeps; None if any is otherwise."""
    calls = []
    for part in body.split(TOOL_CALLS):
        head, _, arguments = part.partition(ARGS)  # (no [ARGS]: no arguments, not a call)
        name, _, given = head.partition(CALL_ID)
        if (call := named_call(name, arguments, given.strip() or short_id())) is None:
            return None
        calls.append(call)
    return calls


def read_deepseek_calls(body: str, types: Types) -> list[ToolCall] | None:
    """DeepSeek's calls (`marked`): DeepSeek-V3's `function<｜tool▁sep｜>NAME` then its arguments fenced as
    ```json, or V3.1's `NAME<｜tool▁sep｜>{...}`; None if any is otherwise."""
    calls = []
    for part in marked(body, DEEPSEEK_CALL, DEEPSEEK_CALL_END) or ():
        head, _, rest = part.partition(DEEPSEEK_SEP)
        name, fence, fenced = rest.partition(DEEPSEEK_FENCE)
        if head == "function" and fence and fenced.rstrip().endswith(FENCE_END):  # V3's
            arguments = fenced.rstrip().removesuffix(FENCE_END)
        else:  # V3.1's (a function named "function" too)
            name, arguments = head, rest
        if (call := named_call(name, arguments, call_id())) is None:
            return None
        calls.append(call)
    return calls or None


def read_kimi_calls(body: str, types: Types) -> list[ToolCall] | None:
    """Kimi-K2's calls (`marked`): `functions.NAME:IDX<|tool_call_argument_begin|>{...}`, whose id is
    `functions.NAME:IDX`, as Kimi's template writes it back; None if any is otherwise."""
    calls = []
    for part in marked(body, KIMI_CALL, KIMI_CALL_END) or ():
        head, _, arguments = part.partition(KIMI_ARGUMENTS)
        found = KIMI_ID.fullmatch(head.strip())
        if found is None or (call := named_call(found[1], arguments, head.strip())) is None:
            return None
        calls.append(call)
    return calls or None


def marked(body: str, begin: str, end: str) -> list[str] | None:
    """The texts of the `begin ... end` calls a block's body holds, with only whitespace around them; the last may
    lack its `end` (a reply that stopped there: a forced call's grammar ends it before); None if anything else is
    there."""
    parts, at = [], skip_space(body, 0)
    while at < len(body):
        if not body.startswith(begin, at):
            return None
        if (stop := body.find(end, at)) < 0:
            parts.append(body[at + len(begin) :])
            break
        parts.append(body[at + len(begin) : stop])
        at = skip_space(body, stop + len(end))
    return parts


def named_call(name: str, arguments: str, given_id: str) -> ToolCall | None:
    """The call of `name` (a function's name, with whitespace around it) with `arguments` (the JSON text of an
    object, kept as written but for the whitespace around it), or None."""
    if not NAME.fullmatch(name := name.strip()) or (text := object_text(arguments.strip())) is None:
        return None
    return ToolCall(id=given_id, function=FunctionCall(name=name, arguments=text))

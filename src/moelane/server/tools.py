"""Tool calls (OpenAI's function calling). The forms read:
- `<tool_call>` blocks in the reply's text, read by `ToolCallReader` here, holding
  - JSON (`HERMES`), as Qwen2.5's and Qwen3's templates have their models write them:
    `<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>`;
  - tags (`QWEN3_CODER`), as Qwen3-Coder's do:
    `<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>`;
  - keys and values (`GLM45`), as GLM-4.5's do:
    `<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>`.
- `<minimax:tool_call>` blocks of `<invoke>` elements (`MINIMAX`), one or more calls a block, as MiniMax-M2's
  template has it write them: `<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris
  </parameter>\n</invoke>\n</minimax:tool_call>` (without the break in the value).
Tagged values (all but `HERMES`) are text: a parameter the tool's schema says is a string (or names no type for) is
kept as written, any other is read as JSON where it parses (`3` is a number, `true` a boolean, `{...}` an object), as
the templates write them.
- gpt-oss's harmony messages to a function (`<|channel|>commentary to=functions.get_weather ...<|message|>{...}`),
  read token by token with its channels (`moelane.model.reasoning`, `Generation`).

`tool_support(tokenizer)` says which form a model writes, or why the server cannot serve it tools.

Invariant: no reply text is lost. A block that does not read as a call (JSON that does not parse, no name, text
between tags, a block cut off by max_tokens or a stop) stays in the content as the model wrote it.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moelane.model.reasoning import Channels
from moelane.server.protocol import FunctionCall, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MINIMAX_OPEN, MINIMAX_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
HERMES, QWEN3_CODER, GLM45, MINIMAX, HARMONY = "hermes", "qwen3_coder", "glm45", "minimax", "harmony"
Types = dict[str, dict[str, Any]]  # per function, its parameters' JSON schemas (`parameters.properties`)


@dataclass(frozen=True, slots=True)
class ToolUse:
    """How one request's replies are read for calls."""

    syntax: str  # HERMES, QWEN3_CODER, GLM45, MINIMAX or HARMONY
    parallel: bool = True  # False: a reply's first call only (`parallel_tool_calls: false`; OpenAI gives one)
    types: Types = field(default_factory=dict)
    opening: str = ""  # the start of a call the prompt ends with, when `tool_choice` forces one (`call_opening`)
    named: bool = False  # `tool_choice` named the function: the reply ends "stop", as OpenAI's does

    def reader(self) -> ToolCallReader | None:
        """A reader of a reply's call blocks, fed the call's opening where the prompt ends with one; None for
        HARMONY, whose calls `Generation` reads token by token."""
        if self.syntax == HARMONY:
            return None
        tags = (MINIMAX_OPEN, MINIMAX_CLOSE) if self.syntax == MINIMAX else (OPEN, CLOSE)
        reader = ToolCallReader(functools.partial(BLOCK_READERS[self.syntax], types=self.types), *tags)
        reader.feed(self.opening)
        return reader


def call_opening(syntax: str, name: str | None) -> str:
    """The start of a call, in the model's own form, that a prompt ends with to force one (`tool_choice`
    "required": of any function; named: of that one). The model writes the rest, held to the tools' schemas where
    that rest is JSON (`Prompts.call_grammar`)."""
    if syntax == HARMONY:
        return "<|channel|>commentary to=functions." + (f"{name} <|constrain|>json<|message|>" if name else "")
    if syntax == QWEN3_CODER:
        return OPEN + "\n<function=" + (f"{name}>\n" if name else "")
    if syntax == GLM45:
        return OPEN + (f"{name}\n" if name else "")
    if syntax == MINIMAX:
        return MINIMAX_OPEN + '\n<invoke name="' + (f'{name}">\n' if name else "")
    return OPEN + "\n" + (f'{{"name": {json.dumps(name)}, "arguments": ' if name else "")


@dataclass(frozen=True, slots=True)
class ToolSupport:
    syntax: str | None  # HERMES, QWEN3_CODER, GLM45, MINIMAX or HARMONY; None: tools cannot be served
    why_not: str = ""  # one sentence, when they cannot


def tool_support(tokenizer: Any) -> ToolSupport:
    """How this model writes tool calls, from its chat template and vocabulary."""
    if not getattr(tokenizer, "chat_template", None):
        return ToolSupport(None, "this model has no chat template")
    if "tools" not in tokenizer.chat_template_variables():
        return ToolSupport(None, "this model's chat template takes no tools")
    template = tokenizer.chat_template
    if MINIMAX_OPEN in template or OPEN in template:
        tag = MINIMAX_OPEN if MINIMAX_OPEN in template else OPEN
        if (tag_id := tokenizer.token_id(tag)) is not None and not tokenizer.decode([tag_id]):
            return ToolSupport(None, f"this model's tokenizer drops {tag} from the text it decodes (a special "
                                     "token), so its calls cannot be read")  # fmt: skip
        if tag == MINIMAX_OPEN:
            return ToolSupport(MINIMAX)
        if "<function=" in template and "<parameter=" in template:
            return ToolSupport(QWEN3_CODER)
        return ToolSupport(GLM45 if "<arg_key>" in template else HERMES)
    if Channels.for_tokenizer(tokenizer) is not None:
        return ToolSupport(HARMONY)
    why = (f"this server reads tool calls written in {OPEN} blocks (Qwen's, Qwen3-Coder's, GLM-4.5's, Hermes'), "
           f"in {MINIMAX_OPEN} blocks (MiniMax-M2's) or as harmony messages (gpt-oss's), and this model's chat "
           "template writes them otherwise")  # fmt: skip
    return ToolSupport(None, why)


def read_call(body: str, types: Types | None = None) -> ToolCall | None:
    """The call a block's text holds, or None if it is not one: a JSON object with a `name` and, as `arguments`
    (or `parameters`), an object or the JSON text of one (none: `{}`)."""
    try:
        value = json.loads(body, parse_constant=_not_json)
        if not isinstance(value, dict) or not isinstance(name := value.get("name"), str) or not name:
            return None
        arguments = value.get("arguments", value.get("parameters"))
        if arguments is None:
            arguments = {}
        elif isinstance(arguments, str):
            if object_text(arguments) is None:
                return None
            return ToolCall(id=call_id(), function=FunctionCall(name=name, arguments=arguments))
        if not isinstance(arguments, dict):
            return None
        text = json.dumps(arguments, ensure_ascii=False)
    except (ValueError, RecursionError):  # (JSON nested a thousand deep: Python's parser gives up, as do we)
        return None
    return ToolCall(id=call_id(), function=FunctionCall(name=name, arguments=text))


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


BLOCK_READERS: dict[str, Callable[..., ToolCall | list[ToolCall] | None]] = {
    HERMES: read_call,
    QWEN3_CODER: read_function_call,
    GLM45: read_keyed_call,
    MINIMAX: read_invokes,
}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallReader:
    """Feeds on a reply's text piece by piece and gives back content and calls in order. Text that may be the
    start of a tag is held until it is known not to be. The whitespace around calls is kept once, where it parts
    text before them from text after them, and dropped where it only opens or ends the content (the blank lines a
    model writes before and after its calls); all other text is given back as written."""

    def __init__(
        self, read: Callable[[str], ToolCall | list[ToolCall] | None] = read_call, opening: str = OPEN,
        closing: str = CLOSE,
    ) -> None:  # fmt: skip
        self.read = read  # a block's call (or calls), or None
        self.opening, self.closing = opening, closing  # a block's tags
        self.pending = ""  # text not read yet (in a block: its body so far)
        self.scanned = 0  # how far `pending` is known to hold no closing tag (a long block is searched once)
        self.inside = False
        self.held = ""  # trailing whitespace of the content: dropped if a call follows
        self.gap = ""  # the whitespace that stood before the calls since the last content
        self.after_call = False  # leading whitespace is dropped, or becomes the gap
        self.said = False  # content has been given back

    def feed(self, text: str) -> list[str | ToolCall]:
        self.pending += text
        out: list[str | ToolCall] = []
        while True:
            if self.inside:
                end = self.pending.find(self.closing, self.scanned)
                if end < 0:
                    self.scanned = max(0, len(self.pending) - len(self.closing) + 1)
                    return out
                body, self.pending = self.pending[:end], self.pending[end + len(self.closing) :]
                self.inside, self.scanned = False, 0
                if not (calls := self._calls(body)):
                    self._content(out, self.opening + body + self.closing)
                else:
                    self.gap, self.held = self.gap or self.held, ""
                    self.after_call = True
                    out.extend(calls)
                continue
            start = self.pending.find(self.opening)
            if start >= 0:
                self._content(out, self.pending[:start])
                self.pending, self.inside = self.pending[start + len(self.opening) :], True
                continue
            cut = len(self.pending) - partial_tag(self.pending, self.opening)
            self._content(out, self.pending[:cut])
            self.pending = self.pending[cut:]
            return out

    def end(self, stopped: bool = False) -> list[str | ToolCall]:
        """The rest, when the reply has ended: a block left open is content, unless the reply `stopped` (at its end
        of text, or at a stop string such as `</tool_call>`, which clients send to end a call) and the block reads
        as a call, as vLLM's parsers read it. (Cut off by max_tokens, a block that reads as a call may still be
        missing arguments.)"""
        out: list[str | ToolCall] = []
        if self.inside and stopped and (calls := self._calls(self.pending)):
            self.pending, self.inside, self.held = "", False, ""
            return [*calls]
        self._content(out, (self.opening if self.inside else "") + self.pending)
        if self.held:
            out.append(self.held)
        self.pending, self.inside, self.held = "", False, ""
        return out

    def _calls(self, body: str) -> list[ToolCall]:
        """The calls a block's body holds (none: it is not a call)."""
        calls = self.read(body)
        return [calls] if isinstance(calls, ToolCall) else calls or []

    def _content(self, out: list[str | ToolCall], text: str) -> None:
        if self.after_call:
            stripped = text.lstrip()
            if not stripped:
                self.gap = self.gap or text
                return
            gap = self.gap or text[: len(text) - len(stripped)]
            text, self.gap, self.after_call = (gap if self.said else "") + stripped, "", False
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body) :]
        if body:
            out.append(body)
            self.said = True


def partial_tag(text: str, tag: str = OPEN) -> int:
    """How many of `text`'s last characters could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_reply(
    text: str, reader: ToolCallReader | None = None, stopped: bool = False
) -> tuple[str | None, list[ToolCall]]:
    """A whole reply's content (None when it is only calls, as OpenAI's) and calls, read by a fresh `reader`
    (default: of JSON blocks); `stopped`: as `ToolCallReader.end` takes it."""
    reader = reader or ToolCallReader()
    parts = reader.feed(text) + reader.end(stopped)
    calls = [p for p in parts if isinstance(p, ToolCall)]
    content = "".join(p for p in parts if isinstance(p, str))
    return (content or None) if calls else content, calls

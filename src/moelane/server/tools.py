"""Tool calls (OpenAI's function calling). Two forms are read:
- Hermes-style tags, as Qwen2.5's and Qwen3's templates have their models write them, read from the reply's text by
  `ToolCallReader` here:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- gpt-oss's harmony messages to a function (`<|channel|>commentary to=functions.get_weather ...<|message|>{...}`),
  read token by token with its channels (`moelane.model.reasoning`, `Generation`).

`tool_support(tokenizer)` says which form a model writes, or why the server cannot serve it tools.

Invariant: no reply text is lost. A block that does not read as a call (JSON that does not parse, no name, a block
cut off by max_tokens or a stop) stays in the content as the model wrote it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from moelane.model.reasoning import Channels
from moelane.server.protocol import FunctionCall, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
OTHER_TAGGED = ("<function=", "<arg_key>")  # calls in <tool_call> but not as JSON: Qwen3-Coder's, GLM-4.5's
HERMES, HARMONY = "hermes", "harmony"


@dataclass(frozen=True, slots=True)
class ToolUse:
    """How one request's replies are read for calls."""

    syntax: str  # HERMES or HARMONY
    parallel: bool = True  # False: a reply's first call only (`parallel_tool_calls: false`; OpenAI gives one)


@dataclass(frozen=True, slots=True)
class ToolSupport:
    syntax: str | None  # HERMES or HARMONY; None: tools cannot be served
    why_not: str = ""  # one sentence, when they cannot


def tool_support(tokenizer: Any) -> ToolSupport:
    """How this model writes tool calls, from its chat template and vocabulary."""
    if not getattr(tokenizer, "chat_template", None):
        return ToolSupport(None, "this model has no chat template")
    if "tools" not in tokenizer.chat_template_variables():
        return ToolSupport(None, "this model's chat template takes no tools")
    if OPEN in tokenizer.chat_template:
        if other := next((m for m in OTHER_TAGGED if m in tokenizer.chat_template), None):
            why = f"this model's chat template writes calls inside {OPEN} as {other}...; this server reads JSON there"
            return ToolSupport(None, why + ' ({"name": ..., "arguments": ...}, as Qwen3\'s)')
        if (tag := tokenizer.token_id(OPEN)) is not None and not tokenizer.decode([tag]):
            return ToolSupport(None, f"this model's tokenizer drops {OPEN} from the text it decodes (a special "
                                     "token), so its calls cannot be read")  # fmt: skip
        return ToolSupport(HERMES)
    if Channels.for_tokenizer(tokenizer) is not None:
        return ToolSupport(HARMONY)
    why = (f"this server reads tool calls written as {OPEN} JSON {CLOSE} (Qwen's, Hermes') or as harmony messages "
           "(gpt-oss's), and this model's chat template writes them otherwise")  # fmt: skip
    return ToolSupport(None, why)


def read_call(body: str) -> ToolCall | None:
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
            if not isinstance(json.loads(arguments, parse_constant=_not_json), dict):
                return None
            return ToolCall(id=call_id(), function=FunctionCall(name=name, arguments=arguments))
        if not isinstance(arguments, dict):
            return None
        text = json.dumps(arguments, ensure_ascii=False)
    except (ValueError, RecursionError):  # (JSON nested a thousand deep: Python's parser gives up, as do we)
        return None
    return ToolCall(id=call_id(), function=FunctionCall(name=name, arguments=text))


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")  # (Python's reader takes NaN and Infinity; clients' do not)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallReader:
    """Feeds on a reply's text piece by piece and gives back content and calls in order. Text that may be the
    start of a tag is held until it is known not to be. The whitespace around calls is kept once, where it parts
    text before them from text after them, and dropped where it only opens or ends the content (the blank lines a
    model writes before and after its calls); all other text is given back as written."""

    def __init__(self) -> None:
        self.pending = ""  # text not read yet (in a block: its body so far)
        self.scanned = 0  # how far `pending` is known to hold no closing tag (a long block is searched once)
        self.inside = False
        self.held = ""  # trailing whitespace of the content: dropped if a call follows
        self.gap = ""  # the whitespace that stood before the calls since the last content
        self.after_call = False  # leading whitespace is dropped, or becomes the gap
        self.said = False  # content has been given back
        self.n_calls = 0

    def feed(self, text: str) -> list[str | ToolCall]:
        self.pending += text
        out: list[str | ToolCall] = []
        while True:
            if self.inside:
                end = self.pending.find(CLOSE, self.scanned)
                if end < 0:
                    self.scanned = max(0, len(self.pending) - len(CLOSE) + 1)
                    return out
                body, self.pending, self.inside = self.pending[:end], self.pending[end + len(CLOSE) :], False
                self.scanned = 0
                if (call := read_call(body)) is None:
                    self._content(out, OPEN + body + CLOSE)
                else:
                    self.gap, self.held = self.gap or self.held, ""
                    self.after_call, self.n_calls = True, self.n_calls + 1
                    out.append(call)
                continue
            start = self.pending.find(OPEN)
            if start >= 0:
                self._content(out, self.pending[:start])
                self.pending, self.inside = self.pending[start + len(OPEN) :], True
                continue
            cut = len(self.pending) - partial_tag(self.pending)
            self._content(out, self.pending[:cut])
            self.pending = self.pending[cut:]
            return out

    def end(self) -> list[str | ToolCall]:
        """The rest, when the reply has ended: an unfinished block is content."""
        out: list[str | ToolCall] = []
        self._content(out, (OPEN if self.inside else "") + self.pending)
        if self.held:
            out.append(self.held)
        self.pending, self.inside, self.held = "", False, ""
        return out

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


def partial_tag(text: str) -> int:
    """How many of `text`'s last characters could begin the opening tag."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def split_reply(text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole reply's content (None when it is only calls, as OpenAI's) and calls."""
    reader = ToolCallReader()
    parts = reader.feed(text) + reader.end()
    calls = [p for p in parts if isinstance(p, ToolCall)]
    content = "".join(p for p in parts if isinstance(p, str))
    return (content or None) if calls else content, calls

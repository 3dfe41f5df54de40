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

`tool_support(tokenizer)` says which form a model writes, or why the server cannot serve it tools. What a block holds
is read in `calls.py`.

Invariant: no reply text is lost. A block that does not read as a call (JSON that does not parse, no name, text
between tags, a block cut off by max_tokens or a stop) stays in the content as the model wrote it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moelane.model.reasoning import Channels
from moelane.server.calls import Types, read_call, read_function_call, read_invokes, read_keyed_call
from moelane.server.protocol import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MINIMAX_OPEN, MINIMAX_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
HERMES, QWEN3_CODER, GLM45, MINIMAX, HARMONY = "hermes", "qwen3_coder", "glm45", "minimax", "harmony"


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


BLOCK_READERS: dict[str, Callable[..., ToolCall | list[ToolCall] | None]] = {
    HERMES: read_call,
    QWEN3_CODER: read_function_call,
    GLM45: read_keyed_call,
    MINIMAX: read_invokes,
}


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

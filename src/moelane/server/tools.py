"""Tool calls (OpenAI's function calling): which form a model writes them in (`tool_support`), how a request's replies
are read for them (`ToolUse`), and `ToolCallReader`, which finds a form's blocks in a reply's text as it streams (what
a block holds is read in `calls.py`). The forms read:
- `<tool_call>` blocks, holding
  - JSON (`HERMES`), as Qwen2.5's and Qwen3's templates have their models write them:
    `<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>`;
  - tags (`QWEN3_CODER`), as Qwen3-Coder's do:
    `<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>`;
  - keys and values (`GLM45`), as GLM-4.5's do:
    `<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>`.
- `<minimax:tool_call>` blocks of `<invoke>` elements (`MINIMAX`), one or more calls a block, as MiniMax-M2's
  template has it write them: `<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris
  </parameter>\n</invoke>\n</minimax:tool_call>` (without the break in the value).
Tagged values (of those three) are text: a parameter the tool's schema says is a string (or names no type for) is
kept as written, any other is read as JSON where it parses (`3` is a number, `true` a boolean, `{...}` an object), as
the templates write them.
- Mistral's `[TOOL_CALLS]`, then to the reply's end a JSON list of calls (`MISTRAL`), as the templates of its
  tokenizer v3 (Mixtral-8x22B-Instruct-v0.1, Mistral-Nemo) write them: `[TOOL_CALLS][{"name": "get_weather",
  "arguments": {"city": "Paris"}}]`, an `id` of nine letters and digits in each (its templates refuse any other, so
  the server gives such ids); from tokenizer v11 on (Mistral-Small-3.2, Magistral, Devstral: `MISTRAL_ARGS`) a
  `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}` per call, `[CALL_ID]ID` before `[ARGS]` in some versions.
- Granite 3's `<|tool_call|>`, then to the reply's end a JSON list of calls (`GRANITE`), as Mistral's v3.
- DeepSeek's `<｜tool▁calls▁begin｜>` blocks of `<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>` calls, each
  `function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n``` ` (DeepSeek-V3's and R1's: `DEEPSEEK_V3`) or
  `get_weather<｜tool▁sep｜>{"city": "Paris"}` (V3.1's: `DEEPSEEK_V31`), closed by `<｜tool▁calls▁end｜>`.
- Kimi-K2's `<|tool_calls_section_begin|>` blocks of `<|tool_call_begin|>functions.get_weather:0
  <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>` calls (`KIMI_K2`; without the break), closed by
  `<|tool_calls_section_end|>`; a call's id is `functions.get_weather:0`, which its template writes back.
- gpt-oss's harmony messages to a function (`<|channel|>commentary to=functions.get_weather ...<|message|>{...}`),
  read token by token with its channels (`moelane.model.reasoning`, `Generation`).
Llama 4's calls are not read: which form it writes them in (JSON, or a Python list of calls, within
`<|python_start|>` or not) is not settled enough here to read it.

Markers: where a tokenizer has a form's tags as special tokens, which a decode drops (Mistral's `[TOOL_CALLS]`), the
reply's text that the reader reads writes them out (`ToolUse.shown`, `Tokenizer.decode`), and the reader keeps them
out of the content it gives back.

Invariant: no reply text is lost. A block that does not read as a call (JSON that does not parse, no name, text
between tags, a block cut off by max_tokens or a stop) stays in the content as the model wrote it, as a decode
writes it: its tags that are special tokens dropped, as the reply would read without tools.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moelane.model.reasoning import Channels
from moelane.server.calls import (
    ARGS,
    CALL_ID,
    DEEPSEEK_CALL,
    DEEPSEEK_CALL_END,
    DEEPSEEK_CALLS,
    DEEPSEEK_CALLS_END,
    DEEPSEEK_FENCE,
    DEEPSEEK_SEP,
    GRANITE_CALL,
    KIMI_ARGUMENTS,
    KIMI_CALL,
    KIMI_CALL_END,
    KIMI_CALLS,
    KIMI_CALLS_END,
    TOOL_CALLS,
    Types,
    read_call,
    read_call_list,
    read_deepseek_calls,
    read_function_call,
    read_invokes,
    read_keyed_call,
    read_kimi_calls,
    read_named_args,
    short_id,
)
from moelane.server.protocol import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MINIMAX_OPEN, MINIMAX_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
HERMES, QWEN3_CODER, GLM45, MINIMAX, HARMONY = "hermes", "qwen3_coder", "glm45", "minimax", "harmony"
MISTRAL, MISTRAL_ARGS, GRANITE = "mistral", "mistral_args", "granite"
DEEPSEEK_V3, DEEPSEEK_V31, KIMI_K2 = "deepseek_v3", "deepseek_v31", "kimi_k2"


@dataclass(frozen=True, slots=True)
class Form:
    """Where a form's calls stand in a reply's text, and how a block of them reads."""

    opening: str
    closing: str  # "": a block runs to the reply's end
    read: Callable[..., ToolCall | list[ToolCall] | None]  # (a block's body, types=) -> its call(s), or None
    tags: tuple[str, ...] = ()  # its tags besides (`tool_support` shows those a tokenizer drops to the reader)


DEEPSEEK_TAGS = (DEEPSEEK_CALL, DEEPSEEK_SEP, DEEPSEEK_CALL_END)
FORMS = {
    HERMES: Form(OPEN, CLOSE, read_call),
    QWEN3_CODER: Form(OPEN, CLOSE, read_function_call),
    GLM45: Form(OPEN, CLOSE, read_keyed_call, ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")),
    MINIMAX: Form(MINIMAX_OPEN, MINIMAX_CLOSE, read_invokes),
    MISTRAL: Form(TOOL_CALLS, "", functools.partial(read_call_list, new_id=short_id)),
    MISTRAL_ARGS: Form(TOOL_CALLS, "", read_named_args, (ARGS, CALL_ID)),
    GRANITE: Form(GRANITE_CALL, "", read_call_list),
    DEEPSEEK_V3: Form(DEEPSEEK_CALLS, DEEPSEEK_CALLS_END, read_deepseek_calls, DEEPSEEK_TAGS),
    DEEPSEEK_V31: Form(DEEPSEEK_CALLS, DEEPSEEK_CALLS_END, read_deepseek_calls, DEEPSEEK_TAGS),
    KIMI_K2: Form(KIMI_CALLS, KIMI_CALLS_END, read_kimi_calls, (KIMI_CALL, KIMI_ARGUMENTS, KIMI_CALL_END)),
}
ARGUMENTS_AS_TEXT = (DEEPSEEK_V3, DEEPSEEK_V31)  # templates that join a call's arguments into the text as a string


@dataclass(frozen=True, slots=True)
class ToolUse:
    """How one request's replies are read for calls."""

    syntax: str  # a form of FORMS, or HARMONY
    parallel: bool = True  # False: a reply's first call only (`parallel_tool_calls: false`; OpenAI gives one)
    types: Types = field(default_factory=dict)
    opening: str = ""  # the start of a call the prompt ends with, when `tool_choice` forces one (`call_opening`)
    named: bool = False  # `tool_choice` named the function: the reply ends "stop", as OpenAI's does
    shown: dict[int, str] = field(default_factory=dict)  # the form's tags a decode drops, by id (`ToolSupport`)

    def reader(self) -> ToolCallReader | None:
        """A reader of a reply's call blocks, fed the call's opening where the prompt ends with one; None for
        HARMONY, whose calls `Generation` reads token by token."""
        if self.syntax == HARMONY:
            return None
        form = FORMS[self.syntax]
        read = functools.partial(form.read, types=self.types)
        reader = ToolCallReader(read, form.opening, form.closing, tuple(self.shown.values()))
        reader.feed(self.opening)
        return reader


def call_opening(syntax: str, name: str | None, n_calls: int = 0) -> str:
    """The start of a call, in the model's own form, that a prompt ends with to force one (`tool_choice`
    "required": of any function; named: of that one). The model writes the rest, held to the tools' schemas where
    that rest is JSON (`Prompts.call_grammar`). `n_calls`: how many calls the conversation has made (Kimi-K2 numbers
    its calls' ids across it)."""
    if syntax == HARMONY:
        return "<|channel|>commentary to=functions." + (f"{name} <|constrain|>json<|message|>" if name else "")
    if syntax == QWEN3_CODER:
        return OPEN + "\n<function=" + (f"{name}>\n" if name else "")
    if syntax == GLM45:
        return OPEN + (f"{name}\n" if name else "")
    if syntax == MINIMAX:
        return MINIMAX_OPEN + '\n<invoke name="' + (f'{name}">\n' if name else "")
    if syntax in (MISTRAL, GRANITE):
        return FORMS[syntax].opening + (f'[{{"name": {json.dumps(name)}, "arguments": ' if name else "")
    if syntax == MISTRAL_ARGS:
        return TOOL_CALLS + (f"{name}{ARGS}" if name else "")
    if syntax == DEEPSEEK_V3:
        return DEEPSEEK_CALLS + DEEPSEEK_CALL + "function" + DEEPSEEK_SEP + (f"{name}{DEEPSEEK_FENCE}" if name else "")
    if syntax == DEEPSEEK_V31:
        return DEEPSEEK_CALLS + DEEPSEEK_CALL + (f"{name}{DEEPSEEK_SEP}" if name else "")
    if syntax == KIMI_K2:
        return KIMI_CALLS + KIMI_CALL + (f"functions.{name}:{n_calls}{KIMI_ARGUMENTS}" if name else "")
    return OPEN + "\n" + (f'{{"name": {json.dumps(name)}, "arguments": ' if name else "")


# What a grammar holds after a forced call's opening, where the rest is JSON: a named call's arguments, then this text
# (what closes the call, where that is not a special token, which a grammar cannot write); for "required", in the
# forms whose call is JSON throughout, a call object (HERMES) or a list of them.
NAMED_AFTER = {HERMES: "}", HARMONY: "", MISTRAL: "}]", GRANITE: "}]", MISTRAL_ARGS: "", DEEPSEEK_V3: "\n```",
               DEEPSEEK_V31: "", KIMI_K2: ""}  # fmt: skip
REQUIRED_JSON = (HERMES, MISTRAL, GRANITE)


@dataclass(frozen=True, slots=True)
class ToolSupport:
    syntax: str | None  # a form of FORMS, or HARMONY; None: tools cannot be served
    why_not: str = ""  # one sentence, when they cannot
    shown: dict[int, str] = field(default_factory=dict)  # the form's tags this tokenizer drops from decoded text


def tool_support(tokenizer: Any) -> ToolSupport:
    """How this model writes tool calls, from its chat template and vocabulary."""
    if not getattr(tokenizer, "chat_template", None):
        return ToolSupport(None, "this model has no chat template")
    if "tools" not in tokenizer.chat_template_variables():
        return ToolSupport(None, "this model's chat template takes no tools")
    if (syntax := template_form(tokenizer)) is None:
        why = (f"this server reads tool calls written in {OPEN} blocks (Qwen's, Qwen3-Coder's, GLM-4.5's, Hermes'), "
               f"in {MINIMAX_OPEN} blocks (MiniMax-M2's), after {TOOL_CALLS} (Mistral's) or {GRANITE_CALL} "
               "(Granite's), in DeepSeek-V3's or Kimi-K2's markers, or as harmony messages (gpt-oss's), and this "
               "model's chat template writes them otherwise")  # fmt: skip
        return ToolSupport(None, why)
    form = FORMS.get(syntax)
    tags = (form.opening, form.closing, *form.tags) if form is not None else ()
    dropped = {tid: tag for tag in tags if tag and (tid := tokenizer.token_id(tag)) is not None
               and not tokenizer.decode([tid])}  # fmt: skip
    return ToolSupport(syntax, shown=dropped)


def template_form(tokenizer: Any) -> str | None:
    """The form the chat template writes calls in (told apart by its own markup), or None."""
    template = tokenizer.chat_template
    if MINIMAX_OPEN in template:
        return MINIMAX
    if OPEN in template:
        if "<function=" in template and "<parameter=" in template:
            return QWEN3_CODER
        return GLM45 if "<arg_key>" in template else HERMES
    if Channels.for_tokenizer(tokenizer) is not None:
        return HARMONY
    if DEEPSEEK_CALLS in template:
        return DEEPSEEK_V3 if "```json" in template else DEEPSEEK_V31
    if KIMI_CALLS in template:
        return KIMI_K2
    if TOOL_CALLS in template:
        return MISTRAL_ARGS if ARGS in template else MISTRAL
    return GRANITE if GRANITE_CALL in template else None


class ToolCallReader:
    """Feeds on a reply's text piece by piece and gives back content and calls in order. Text that may be the
    start of a tag is held until it is known not to be. The whitespace around calls is kept once, where it parts
    text before them from text after them, and dropped where it only opens or ends the content (the blank lines a
    model writes before and after its calls); all other text is given back as written, but for the `hidden` tags
    (special tokens a decode drops: `ToolUse.shown`), which never reach the content."""

    def __init__(
        self, read: Callable[[str], ToolCall | list[ToolCall] | None] = read_call, opening: str = OPEN,
        closing: str = CLOSE, hidden: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        self.read = read  # a block's call (or calls), or None
        self.opening, self.closing = opening, closing  # a block's tags ("" closing: the block runs to the end)
        self.hidden = hidden
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
                end = self.pending.find(self.closing, self.scanned) if self.closing else -1
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
            cut = len(self.pending) - max(partial_tag(self.pending, tag) for tag in (self.opening, *self.hidden))
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
        for tag in self.hidden:
            text = text.replace(tag, "")
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

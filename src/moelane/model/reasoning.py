"""Which part of a chat reply a token belongs to: the answer, the model's reasoning, or the markup around them.

Two formats:
- gpt-oss's channels (OpenAI's "harmony"): the prompt ends `<|start|>assistant` and the reply is messages such as
  `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>`; the final
  channel is the answer, the others reasoning (`Channels`). A message addressed to a function (`to=functions.NAME`
  in its header, before or after the channel name) is a tool call, its body the arguments;
- think tags (Qwen3, DeepSeek-R1, GLM-4.5): reasoning between `<think>` and `</think>`, the answer after. A prompt
  may open the block itself (DeepSeek-R1's template ends `<think>\n`), or close an empty one (Qwen3 with thinking
  off): `ThinkTags` starts inside the block when the prompt's last tag opens one.

`splitter_for(tokenizer, prompt_ids)` picks the format from the tokenizer's vocabulary, or None (a plain reply);
`answer_opening(tokenizer, prompt)` says what a prompt ends with for the reply to be the answer at once.
`push(token)` returns `ANSWER` for a token of the answer, `REASONING` for one of the reasoning, `CALL` for one of a
tool call's arguments (then `recipient` names the function), None for markup.
"""

from __future__ import annotations

import re
from typing import Protocol

from moelane.model.tokenizer import Tokenizer

SPECIALS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
ANSWER, REASONING, CALL = "answer", "reasoning", "call"
FINAL = "final"  # harmony's answer channel
FUNCTIONS = "functions."  # harmony's recipients that are the caller's tools (others are the model's own: browser, ...)
RECIPIENT = re.compile(r"\bto=(\S+)")
FINAL_OPENING = "<|channel|>final<|message|>"  # harmony: the answer's message follows
THINK, THINK_END = "<think>", "</think>"


def recipient_in(header: str) -> str | None:
    """The function a harmony message header addresses (`to=functions.get_weather`: "get_weather"), or None."""
    match = RECIPIENT.search(header)
    if match is None or not match.group(1).startswith(FUNCTIONS):
        return None
    return match.group(1)[len(FUNCTIONS) :] or None


class Splitter(Protocol):
    recipient: str | None  # the function the tokens of a CALL part are arguments of

    def push(self, token: int) -> str | None: ...


class Openings:
    """Drops the whitespace that opens each part of a split reply (`<think>\n`, `</think>\n\n`, a channel's first
    newline): a part's text passes whole once its first other character has. `trim(part, text)` per piece."""

    def __init__(self) -> None:
        self._opening = {ANSWER: True, REASONING: True}  # a part's first text is still to come

    def trim(self, part: str, text: str) -> str:
        if not self._opening[part]:
            return text
        text = text.lstrip()
        self._opening[part] = not text
        return text


def answer_opening(tokenizer: Tokenizer, prompt: str) -> str:
    """What a chat prompt ends with so that the reply is the answer, without reasoning first (a reply held to
    JSON): harmony's final channel (gpt-oss), or the end of a think block the prompt opened."""
    if Channels.for_tokenizer(tokenizer) is not None:
        return FINAL_OPENING
    if tokenizer.token_id(THINK) is not None and prompt.rfind(THINK) > prompt.rfind(THINK_END):
        return THINK_END + "\n\n"
    return ""


def splitter_for(tokenizer: Tokenizer, prompt_ids: list[int]) -> Splitter | None:
    """The reply format of this tokenizer's models, or None."""
    return Channels.for_tokenizer(tokenizer) or ThinkTags.for_tokenizer(tokenizer, prompt_ids)


class ThinkTags:
    """The state of one reply with `<think>...</think>` reasoning."""

    recipient: str | None = None  # (no calls in this format: templates that write them write text)

    def __init__(self, open_id: int, close_id: int, inside: bool) -> None:
        self._open, self._close, self._inside = open_id, close_id, inside

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, prompt_ids: list[int]) -> ThinkTags | None:
        open_id, close_id = tokenizer.token_id(THINK), tokenizer.token_id(THINK_END)
        if open_id is None or close_id is None:
            return None
        last = next((t for t in reversed(prompt_ids) if t in (open_id, close_id)), None)
        return cls(open_id, close_id, inside=last == open_id)

    def push(self, token: int) -> str | None:
        if token in (self._open, self._close):
            self._inside = token == self._open
            return None
        return REASONING if self._inside else ANSWER


class Channels:
    """The state of one reply. Starts in a message header (the prompt ends with `<|start|>assistant`)."""

    def __init__(self, tokenizer: Tokenizer, ids: dict[str, int]) -> None:
        self._tokenizer = tokenizer
        self._start, self._channel, self._message = ids["<|start|>"], ids["<|channel|>"], ids["<|message|>"]
        self._ends = {ids["<|end|>"], ids["<|return|>"], ids["<|call|>"]}
        self._constrain = ids["<|constrain|>"]
        self._before: list[int] = []  # the header's ids before `<|channel|>` (" to=functions.f")
        self._after: list[int] | None = None  # and after it, once read ("commentary to=functions.f <|constrain|>json")
        self._body: str | None = None  # the channel whose message body is being read
        self.recipient: str | None = None  # the function that body is addressed to

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> Channels | None:
        """Channels for a tokenizer with harmony's special tokens, else None (the model does not speak it)."""
        ids = {name: tokenizer.token_id(name) for name in SPECIALS}
        if any(i is None for i in ids.values()):
            return None
        return cls(tokenizer, {name: i for name, i in ids.items() if i is not None})

    def push(self, token: int) -> str | None:
        """ANSWER for a token of the final channel's message, CALL for one of a message to a function, REASONING
        for one of another channel's, None for the markup."""
        channel = self._channel_of(token)
        if channel is None:
            return None
        return CALL if self.recipient is not None else ANSWER if channel == FINAL else REASONING

    def _channel_of(self, token: int) -> str | None:
        """The channel of the message body `token` is part of, or None for structure."""
        if token == self._message:
            after, decode = self._after or [], self._tokenizer.decode
            name = after[: after.index(self._constrain)] if self._constrain in after else after  # (then "json")
            words = decode(name).split()
            self._body = words[0] if words else FINAL
            self.recipient = recipient_in(decode(self._before)) or recipient_in(decode(after))
            self._before, self._after = [], None
            return None
        if token == self._channel:
            self._body, self._after = None, []
            return None
        if token == self._start or token in self._ends:
            self._body = self.recipient = None
            self._before, self._after = [], None
            return None
        if self._body is None:
            (self._before if self._after is None else self._after).append(token)
            return None
        return self._body

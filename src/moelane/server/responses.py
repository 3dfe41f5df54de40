"""OpenAI response bodies (plain pydantic models, serialised with `model_dump` as each endpoint needs) and the
server-sent events of the two generation endpoints, from a finished or running `Generation`. Pure formatting: no
engine, no I/O. moelane's one extension field is `moelane` on every completion response and on each choice's last
streamed chunk: what it cost the expert pager (docs/server.md).

Stream layout (both endpoints): content chunks as text arrives (chat: a tool call whole in a chunk of its own,
`delta.tool_calls`, once its block has ended); one chunk with `finish_reason` and the `moelane`
extension; a chunk with `usage` and no choices when the client asked (`stream_options.include_usage`: then, as
OpenAI does, every other chunk carries `"usage": null`); `[DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from moelane.lanes.stream import TokenLogprob
from moelane.server.protocol import ToolCall

# ---- bodies ----------------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV cache a finished request left (docs/lanes.md, "Prefix caching")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class PagerCost(BaseModel):
    """What one request cost the expert pager (zeros where the model's experts are all resident)."""

    experts_fetched: int = 0
    bytes_fetched: int = 0
    stall_ms: float = 0.0


class Extension(BaseModel):
    """moelane's extension field, `moelane` on responses (docs/server.md)."""

    pager: PagerCost


class CompletionLogprobs(BaseModel):
    """The legacy completions format: per token its text, log-probability, the top alternatives and where its text
    starts in the reply."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token, which nothing predicts
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    moelane: Extension | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: the reply is only tool calls
    reasoning_content: str | None = None  # a reasoning model's thinking (gpt-oss: its analysis channel)
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    moelane: Extension | None = None


class DeltaToolCall(ToolCall):
    index: int  # which of the choice's calls (each is streamed whole, in one chunk)


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    moelane: Extension | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "moelane"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok", "stopping", "degraded"]  # degraded: a part the model runs on has failed (`problem`)
    active_streams: int
    waiting_streams: int
    problem: str | None = None


# ---- formatting ------------------------------------------------------------------------------------------------

DONE = "data: [DONE]\n\n"
# (token, its entry, where its text starts), as Generation keeps them; entry None: an echoed prompt's first token
Logprobs = list[tuple[int, TokenLogprob | None, int]]


def logprobs_body(chat: bool, entries: Logprobs | None, text_of: Callable[[int], str],
                  offset: int = 0) -> CompletionLogprobs | ChatLogprobs | None:  # fmt: skip
    """OpenAI's `logprobs` object for these tokens: the chat format (token, logprob, UTF-8 bytes, top alternatives)
    or the legacy completions one (parallel lists, text offsets shifted by `offset`, e.g. an echoed prompt)."""
    if entries is None:
        return None
    if chat:
        content = []
        for token, e, _ in entries:
            assert e is not None  # only a prompt's first token has none, and chat never echoes
            top = [TopLogprob(token=text_of(t), logprob=lp, bytes=list(text_of(t).encode())) for t, lp in e.top]
            text = text_of(token)
            entry = TokenLogprobEntry(token=text, logprob=e.logprob, bytes=list(text.encode()), top_logprobs=top)
            content.append(entry)
        return ChatLogprobs(content=content)
    return CompletionLogprobs(
        tokens=[text_of(token) for token, _, _ in entries],
        token_logprobs=[e.logprob if e else None for _, e, _ in entries],
        top_logprobs=[_by_text(e.top, text_of) if e else None for _, e, _ in entries],
        text_offset=[offset + at for _, _, at in entries],
    )


def event(body: BaseModel, null_usage: bool = False) -> str:
    """One server-sent event; unset optional fields left out (`usage` kept as null with `null_usage`)."""
    data = body.model_dump(mode="json")
    for key in ("moelane",) if null_usage else ("usage", "moelane"):
        if data.get(key, 0) is None:
            del data[key]
    for choice in data.get("choices", ()):
        delta = choice.get("delta") or {}
        for key in [k for k, v in delta.items() if v is None]:
            del delta[key]
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _by_text(top: tuple[tuple[int, float], ...], text_of: Callable[[int], str]) -> dict[str, float]:
    """Most likely first; two tokens with the same text keep the likelier one's log-probability."""
    out: dict[str, float] = {}
    for token, lp in top:
        out.setdefault(text_of(token), lp)
    return out


@dataclass(frozen=True, slots=True)
class Reply:
    """One choice's finished reply. `text`: None when it is only tool calls (chat)."""

    text: str | None
    finish: str
    logprobs: BaseModel | None = None
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True, slots=True)
class Header:
    """What every body of one request shares."""

    id: str
    created: int
    model: str
    chat: bool
    include_usage: bool = False  # streamed with a usage chunk: every other chunk says "usage": null

    def usage(self, n_prompt: int, n_tokens: int, gens: Sequence[Any] = ()) -> Usage:
        """Usage of a request whose generations are `gens`: their prompts' tokens taken from kept caches are
        `prompt_tokens_details.cached_tokens`, each prompt counted once, as `n_prompt` counts it (the most any of
        its choices took: choices of one prompt share its `prompt_ids`)."""
        cached: dict[int, int] = {}
        for gen in gens:
            key = id(gen.params.prompt_ids)
            cached[key] = max(cached.get(key, 0), gen.stream.n_cached if gen.stream is not None else 0)
        details = PromptTokensDetails(cached_tokens=sum(cached.values()))
        return Usage(prompt_tokens=n_prompt, completion_tokens=n_tokens, total_tokens=n_prompt + n_tokens,
                     prompt_tokens_details=details)  # fmt: skip

    def whole(self, choices: list[Reply], usage: Usage, cost: PagerCost) -> BaseModel:
        """The response of a finished request: its choices' replies, by index."""
        ext = Extension(pager=cost)
        if self.chat:
            chat = [ChatChoice(index=i, finish_reason=r.finish, logprobs=r.logprobs,  # type: ignore[arg-type]
                               message=AssistantMessage(content=r.text, reasoning_content=r.reasoning,
                                                        tool_calls=list(r.tool_calls) or None))
                    for i, r in enumerate(choices)]  # fmt: skip
            return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=chat,
                                          usage=usage, moelane=ext)  # fmt: skip
        plain = [CompletionChoice(index=i, text=r.text or "", finish_reason=r.finish, logprobs=r.logprobs)  # type: ignore[arg-type]
                 for i, r in enumerate(choices)]  # fmt: skip
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=plain, usage=usage,
                                  moelane=ext)  # fmt: skip

    def first(self, index: int = 0, tools: bool = False) -> str | None:
        """The opening chunk of a choice (chat only: the assistant role; with `tools`, as OpenAI's, no content yet:
        a reply of calls only has none)."""
        if not self.chat:
            return None
        delta = Delta(role="assistant", content=None if tools else "")
        return self._event(self._chunk([ChatChunkChoice(index=index, delta=delta)]))

    def piece(self, text: str, logprobs: BaseModel | None = None, index: int = 0, reasoning: bool = False) -> str:
        """A chunk of a choice's text (chat, `reasoning`: of its reasoning, `delta.reasoning_content`)."""
        if self.chat:
            said = Delta(reasoning_content=text) if reasoning else Delta(content=text)
            delta = ChatChunkChoice(index=index, delta=said, logprobs=logprobs)  # type: ignore[arg-type]
            return self._event(self._chunk([delta]))
        choice = CompletionChoice(index=index, text=text, finish_reason=None, logprobs=logprobs)  # type: ignore[arg-type]
        return self._event(self._completion([choice]))

    def calls(self, calls: list[ToolCall], first: int, logprobs: BaseModel | None = None, index: int = 0) -> str:
        """A chunk of a choice's tool calls, each whole; `first`: the number of the choice's calls before them."""
        numbered = [DeltaToolCall(index=first + k, **call.model_dump()) for k, call in enumerate(calls)]
        choice = ChatChunkChoice(index=index, delta=Delta(tool_calls=numbered), logprobs=logprobs)  # type: ignore[arg-type]
        return self._event(self._chunk([choice]))

    def last(self, finish: str, cost: PagerCost, logprobs: BaseModel | None = None, index: int = 0) -> str:
        """A choice's last chunk: its finish reason, and what the choice cost the pager."""
        ext = Extension(pager=cost)
        if self.chat:
            choice = ChatChunkChoice(index=index, delta=Delta(), finish_reason=finish, logprobs=logprobs)  # type: ignore[arg-type]
            return self._event(self._chunk([choice], moelane=ext))
        choice_c = CompletionChoice(index=index, text="", finish_reason=finish, logprobs=logprobs)  # type: ignore[arg-type]
        return self._event(self._completion([choice_c], moelane=ext))

    def usage_chunk(self, usage: Usage) -> str:
        if self.chat:
            return self._event(self._chunk([], usage=usage))
        return self._event(self._completion([], usage=usage))

    def _event(self, body: BaseModel) -> str:
        return event(body, null_usage=self.include_usage)

    def _chunk(self, choices: list[ChatChunkChoice], **extra: object) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, **extra)  # type: ignore[arg-type]

    def _completion(self, choices: list[CompletionChoice], **extra: object) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, **extra)  # type: ignore[arg-type]

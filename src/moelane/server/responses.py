"""OpenAI response bodies and server-sent events for the two generation endpoints, from a finished or running
`Generation`. Pure formatting: no engine, no I/O.

Stream layout (both endpoints): content chunks as text arrives; one chunk with `finish_reason` and the `moelane`
extension; a chunk with `usage` and no choices when the client asked (`stream_options.include_usage`); `[DONE]`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import BaseModel

from moelane.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    Delta,
    Extension,
    PagerCost,
    Usage,
)

DONE = "data: [DONE]\n\n"


def event(body: BaseModel) -> str:
    data = body.model_dump(mode="json")
    for key in ("usage", "moelane"):
        if data.get(key, 0) is None:
            del data[key]
    for choice in data.get("choices", ()):
        delta = choice.get("delta") or {}
        for key in [k for k, v in delta.items() if v is None]:
            del delta[key]
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


@dataclass(frozen=True, slots=True)
class Header:
    """What every body of one request shares."""

    id: str
    created: int
    model: str
    chat: bool

    def usage(self, n_prompt: int, n_tokens: int) -> Usage:
        return Usage(prompt_tokens=n_prompt, completion_tokens=n_tokens, total_tokens=n_prompt + n_tokens)

    def whole(self, text: str, finish: str, usage: Usage, cost: PagerCost) -> BaseModel:
        ext = Extension(pager=cost)
        if self.chat:
            choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish)  # type: ignore[arg-type]
            return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice],
                                          usage=usage, moelane=ext)  # fmt: skip
        c = CompletionChoice(text=text, finish_reason=finish)  # type: ignore[arg-type]
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[c], usage=usage,
                                  moelane=ext)  # fmt: skip

    def first(self) -> str | None:
        """The opening chunk (chat only: the assistant role)."""
        if not self.chat:
            return None
        return event(self._chunk([ChatChunkChoice(delta=Delta(role="assistant", content=""))]))

    def piece(self, text: str) -> str:
        if self.chat:
            return event(self._chunk([ChatChunkChoice(delta=Delta(content=text))]))
        return event(self._completion([CompletionChoice(text=text, finish_reason=None)]))

    def last(self, finish: str, cost: PagerCost) -> str:
        ext = Extension(pager=cost)
        if self.chat:
            choice = ChatChunkChoice(delta=Delta(), finish_reason=finish)  # type: ignore[arg-type]
            return event(self._chunk([choice], moelane=ext))
        choice_c = CompletionChoice(text="", finish_reason=finish)  # type: ignore[arg-type]
        return event(self._completion([choice_c], moelane=ext))

    def usage_chunk(self, usage: Usage) -> str:
        if self.chat:
            return event(self._chunk([], usage=usage))
        return event(self._completion([], usage=usage))

    def _chunk(self, choices: list[ChatChunkChoice], **extra: object) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, **extra)  # type: ignore[arg-type]

    def _completion(self, choices: list[CompletionChoice], **extra: object) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, **extra)  # type: ignore[arg-type]

"""The OpenAI wire format the server speaks: request bodies (validated here, so handlers see only well-typed
values) and response bodies, plus moelane's one extension field.

Requests ignore unknown fields (clients send many we do not use) but reject wrong types and out-of-range values
with a 400. Responses are plain pydantic models serialised with `model_dump(exclude_none=...)` as each endpoint
needs. The extension field is `moelane` on every completion response and on the last streamed chunk: what the
request cost the expert pager (docs/server.md).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator

Stop = str | list[str] | None
Role = Literal["system", "user", "assistant", "tool", "developer"]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """Fields shared by both generation endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    # Strict: a JSON number only (ints included); true, "1" and the like are errors, as the schema says.
    temperature: StrictFloat = Field(default=1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=0, ge=0)
    seed: StrictInt | None = None
    stop: Stop = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(default=1, ge=1, le=1, description="only n=1 is served")
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: Stop) -> Stop:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingFields):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    echo: StrictBool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: object) -> object:
        if isinstance(v, list) and v and isinstance(v[0], str | list):
            if len(v) != 1:
                raise ValueError("exactly one prompt per request is served")
            return v[0]
        return v


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses ----------------------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class PagerCost(BaseModel):
    """What one request cost the expert pager (zeros where the model's experts are all resident)."""

    experts_fetched: int = 0
    bytes_fetched: int = 0
    stall_ms: float = 0.0


class Extension(BaseModel):
    """moelane's extension field, `moelane` on responses (docs/server.md)."""

    pager: PagerCost


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
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
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    moelane: Extension | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


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
    status: Literal["ok", "stopping"]
    active_streams: int
    waiting_streams: int

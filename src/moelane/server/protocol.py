"""The OpenAI request bodies the server takes, validated here so that handlers see only well-typed values: the
sampling fields both endpoints share, the completion request, and the tool wire models (the chat request is in
`chat_request.py`, the response bodies are in `responses.py`).

Requests ignore unknown fields (clients send many we do not use) but reject wrong types and out-of-range values
with a 400, and so do known OpenAI fields that ask for what the server does not do (best_of, suffix, non-text
content parts, audio replies, tools in a completion) unless they are in their off state; `null` in an optional
field means its default, as OpenAI's schema allows. `tools` are taken by chat requests (`tools.py` reads the calls);
`response_format` holds a reply to JSON (`moelane.model.grammar`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, Literal, cast

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)

from moelane.model.tokenizer import lone_surrogate

Stop = str | list[str] | None
MAX_N = 128  # most choices per prompt, and prompts per request, as OpenAI's bound on n
# Longest stop string: the stop filter runs on the event loop at every token and reads back up to a stop string's
# length of text (4 stop strings of 300K characters once held every other request for 4 s a token).
MAX_STOP_CHARS = 1024
# Most logit_bias entries: as many as the largest vocabularies have tokens (Gemma 3's 262,144), counted before any is
# validated (validation runs on the event loop: 4M entries held it, every stream with it, for 2 s more than parsing).
MAX_BIAS_TOKENS = 1 << 18


class FieldError(ValueError):
    """A model validator's finding about one of the model's fields (`field`), which the error body's `param` names:
    a plain ValueError there would be said of the whole model (param null at the top)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class Body(BaseModel):
    """A request body (or part of one). OpenAI's schema makes most optional fields nullable, and clients that
    serialise every field send `null` for those they leave unset: null in an optional field means its default."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


class StreamOptions(Body):
    include_usage: StrictBool = False


class JsonSchemaFormat(Body):
    """OpenAI's `response_format.json_schema`: the reply is JSON that `schema` accepts (any JSON object without
    one), held to it token by token. `strict`: keywords the grammar cannot hold the reply to are a 400, not
    ignored."""

    name: str = "response"
    description: str | None = None
    schema_: dict[str, object] | StrictBool | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise FieldError(
                "type 'json_schema' needs json_schema (with the schema in json_schema.schema)", "json_schema"
            )
        return self

    def json_wanted(self) -> tuple[bool, dict[str, object] | bool | None, bool]:
        """(whether the reply must be JSON, the schema it must meet: None for any JSON object, whether strictly)."""
        if self.type == "json_schema" and self.json_schema is not None:
            return True, self.json_schema.schema_, bool(self.json_schema.strict)
        return self.type == "json_object", None, False


def unsupported(what: str, *off: object) -> Callable[[object], object]:
    """A validator that accepts None and the `off` values only."""

    def check(v: object) -> object:
        if v is not None and v not in off:
            raise ValueError(f"{what} is not supported by this server")
        return v

    return check


class SamplingFields(Body):
    """Fields shared by both generation endpoints."""

    model: str | None = Field(default=None, description="the served model's id (default: the served model)")
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    # Strict: a JSON number only (ints included); true, "1" and the like are errors, as the schema says. Finite:
    # Python's JSON reader takes NaN and Infinity, which would otherwise be said to be out of range.
    temperature: StrictFloat = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: StrictFloat = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: StrictInt = Field(default=0, ge=0)
    seed: StrictInt | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # OpenAI's bounds (int64)
    stop: Stop = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(default=1, ge=1, le=MAX_N, description="choices per prompt, each a stream of its own")
    user: str | None = None
    presence_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: Annotated[
        dict[str, Annotated[StrictFloat, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]] | None,
        Field(max_length=MAX_BIAS_TOKENS),
    ] = None
    # Accepted in their off state only, so that a client asking for them gets a clear 400 rather than a reply
    # that silently lacks them.
    response_format: ResponseFormat | None = None
    functions: list[dict[str, object]] | None = None  # the deprecated form of tools
    # (chat takes "required" and named functions: ChatCompletionRequest)
    tool_choice: Annotated[object, AfterValidator(unsupported("tool_choice other than 'none' or 'auto'", "none",
                                                               "auto"))] = None  # fmt: skip
    function_call: Annotated[object, AfterValidator(unsupported("function_call other than 'none' or 'auto'", "none",
                                                                 "auto"))] = None  # fmt: skip

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids, got {key!r}")
        return v

    @field_validator("functions")
    @classmethod
    def _functions(cls, v: list[dict[str, object]] | None) -> list[dict[str, object]] | None:
        if v:
            raise ValueError("functions (the deprecated form of tools) are not supported by this server; send tools")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:  # (as OpenAI: they would be dropped unread)
            raise FieldError("stream_options is only allowed with stream: true", "stream_options")
        return self

    def limit_field(self) -> str:
        """The field that sets the reply's token limit (what a limit that does not fit is said of)."""
        return "max_tokens"

    def bias_map(self) -> dict[int, float]:
        return {int(k): b for k, b in (self.logit_bias or {}).items()}

    def top_logprobs_asked(self) -> int | None:
        """None: no log-probabilities; n: each token's, with the n most likely."""
        return None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: Stop) -> Stop:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        for i, stop in enumerate(stops):  # as a prompt with one is refused (the tokenizer cannot take it)
            if len(stop) > MAX_STOP_CHARS:
                raise ValueError(f"stop sequence {i} has {len(stop)} characters; at most {MAX_STOP_CHARS}")
            if (problem := lone_surrogate(stop)) is not None:
                raise ValueError(f"stop sequence {i} is not valid Unicode: {problem}")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingFields):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    # 0 with echo: only score the prompt (its logprobs), as the legacy API allows
    max_tokens: StrictInt | None = Field(default=None, ge=0)
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5, description="log-probabilities of the n most likely")
    best_of: Annotated[StrictInt | None, AfterValidator(unsupported("best_of > 1", 1))] = Field(default=None, ge=1)
    suffix: Annotated[str | None, AfterValidator(unsupported("suffix", ""))] = None
    tools: Annotated[list[object] | None, AfterValidator(unsupported("tools (a chat field)", []))] = None

    @model_validator(mode="after")
    def _zero_needs_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("max_tokens 0 needs echo: true (only the prompt would be returned)", "max_tokens")
        return self

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, v: object) -> object:
        if isinstance(v, list) and v and isinstance(v[0], str | list) and len(v) > MAX_N:
            raise ValueError(f"at most {MAX_N} prompts per request")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompts: a text or a list of token ids, or a list of either (each its own choices)."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [cast(str | list[int], p)]
        return cast(list[str | list[int]], p)


class FunctionCall(Body):
    name: str
    arguments: str  # a JSON text, as the model wrote it


class ToolCall(Body):
    """A call an assistant message made (in a request's history) or a reply makes."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict[str, object] | None = None  # a JSON schema
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _of_an_object(cls, v: dict[str, object] | None) -> dict[str, object] | None:
        # (as OpenAI's: a call's arguments are an object; a forced call held to another type could never be one)
        if v and "type" in v and v["type"] != "object":
            raise ValueError(f"must be a JSON schema of type 'object' (a call's arguments are an object), got "
                             f"type {json.dumps(v['type'])}")  # fmt: skip
        return v


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(Body):
    mode: Literal["auto", "required"]
    tools: Annotated[list[NamedToolChoice], Field(min_length=1)]


class AllowedToolsChoice(Body):
    """OpenAI's `{"type": "allowed_tools", ...}`: of the tools given, the model may call these only (the tools list
    stays whole, so that a prompt cache holds across turns; here the model is shown the allowed ones)."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class ToolDefinition(Body):
    type: Literal["function"]
    function: FunctionDefinition


def template_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's calls as chat templates read them: OpenAI sends `arguments` as a JSON text, and the
    templates of transformers' convention want the object (Qwen3's takes either)."""
    out = []
    for call in calls:
        function = dict(call.get("function") or {})
        try:
            arguments = json.loads(function.get("arguments", ""))
        except (TypeError, ValueError, RecursionError):  # (not JSON: the template gets the text)
            arguments = None
        if isinstance(arguments, dict):
            function["arguments"] = arguments
        out.append({**call, "function": function})
    return out

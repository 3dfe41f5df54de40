"""The chat request body (`/v1/chat/completions`): messages, tools and the choice of them, and what the chat template
gets from them. Its sampling fields, and the wire models they share with completions, are in `protocol.py`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from moelane.server.protocol import (
    AllowedToolsChoice,
    Body,
    FieldError,
    NamedToolChoice,
    SamplingFields,
    ToolCall,
    ToolDefinition,
    template_tool_calls,
    unsupported,
)

# Most messages per chat request, as OpenAI's bound: checked before any message is validated, so a body of a million
# messages is refused at once instead of holding the event loop for seconds (validation runs on it).
MAX_MESSAGES = 2048
Role = Literal["system", "user", "assistant", "tool", "developer"]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


def _text_content(v: object) -> object:
    """A message's content as OpenAI takes it, with one clear message for what this server cannot read."""
    if v is None or isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise ValueError("content must be a string or a list of content parts")
    parts = []
    for part in v:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):  # (an assistant's refusal, in the history)
            part = {"type": "text", "text": part["refusal"]}
        elif isinstance(kind, str) and kind != "text":
            raise ValueError(f"content parts of type {kind!r} are not supported by this server (only 'text' and "
                             f"an assistant's 'refusal')")  # fmt: skip
        parts.append(part)
    return parts


class ChatMessage(Body):
    role: Role
    content: Annotated[str | list[TextPart] | None, BeforeValidator(_text_content)] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool message's: the call it answers
    reasoning_content: str | None = None  # an assistant's thinking, which some templates keep (Qwen3's, mid-tools)

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        # as OpenAI: only an assistant message (one that made tool calls) may come without content
        if self.content is None and self.role != "assistant":
            raise FieldError(f"a {self.role} message needs content", "content")
        # an empty list too, as OpenAI answers it; an assistant's (a turn of tool calls only, as some clients write
        # it) is read as no content, so that a conversation's history is never refused for it
        if self.content == [] and self.role != "assistant":
            raise FieldError(f"a {self.role} message's content must not be an empty list: give a string, or at "
                             "least one content part", "content")  # fmt: skip
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def for_template(self, arguments_as_text: bool = False) -> dict[str, Any]:
        """The message as chat templates read it (transformers' convention; with `arguments_as_text`, a call's
        arguments as the JSON text sent, for templates that join them into a string, as DeepSeek's do)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls and self.role == "assistant":
            calls = [c.model_dump() for c in self.tool_calls]
            out["tool_calls"] = calls if arguments_as_text else template_tool_calls(calls)
        if self.reasoning_content is not None and self.role == "assistant":  # (gpt-oss's template reads `thinking`)
            out["reasoning_content"] = out["thinking"] = self.reasoning_content
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out


TEMPLATE_OWN = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools")  # set by the server


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    # OpenAI's, for reasoning models; given to the chat template as `reasoning_effort` (gpt-oss reads it)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # vLLM's and llama.cpp's: more variables for the chat template (Qwen3: {"enable_thinking": false})
    chat_template_kwargs: dict[str, object] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: (
        Literal["none", "auto", "required"]
        | Annotated[NamedToolChoice | AllowedToolsChoice, Field(discriminator="type")]
        | None
    ) = None
    parallel_tool_calls: StrictBool | None = None  # false: a reply's first call only
    # OpenAI's audio replies: a reply of text only is all this server writes
    modalities: Annotated[list[object] | None, AfterValidator(unsupported("modalities other than ['text']",
                                                                            ["text"], []))] = None  # fmt: skip
    audio: Annotated[object, AfterValidator(unsupported("audio output"))] = None

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, v: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        # (a call names its function: of two of one name, which one it called, and which schema a forced call is held
        # to, could not be said)
        names = [tool.function.name for tool in v or ()]
        if twice := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"function names must be unique; given more than once: {', '.join(twice)}")
        return v

    @model_validator(mode="after")
    def _allowed_tools_only(self) -> ChatCompletionRequest:
        """`allowed_tools` as the tools it names, and its mode as the tool_choice."""
        if isinstance(self.tool_choice, AllowedToolsChoice):
            given = {tool.function.name for tool in self.tools or ()}
            allowed = {tool.function.name for tool in self.tool_choice.allowed_tools.tools}
            if unknown := sorted(allowed - given):
                raise FieldError(f"allowed_tools names {', '.join(map(repr, unknown))}, not among the tools given "
                                 f"({', '.join(sorted(given)) or 'none'})", "tool_choice")  # fmt: skip
            self.tools = [tool for tool in self.tools or () if tool.function.name in allowed]
            self.tool_choice = self.tool_choice.allowed_tools.mode
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_variables(cls, v: dict[str, object] | None) -> dict[str, object] | None:
        taken = sorted(set(v or {}) & set(TEMPLATE_OWN))
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)} (the server sets them)")
        return v

    def template_variables(self) -> dict[str, object]:
        """What the chat template gets beside the messages."""
        extra = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            extra.setdefault("reasoning_effort", self.reasoning_effort)
        if self.tools_on():
            extra["tools"] = [t.model_dump(exclude_none=True) for t in self.tools or ()]
        return extra

    def tools_on(self) -> bool:
        """The model is shown the tools, and its reply is read for calls (`tool_choice` "none": neither)."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced(self) -> str | None:
        """The function `tool_choice` forces a call of: "" for any ("required"), its name, or None."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "" if self.tool_choice == "required" else None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs needs logprobs: true", "top_logprobs")
        return self

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def limit_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

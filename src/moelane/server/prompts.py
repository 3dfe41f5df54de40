"""`Prompts`: a request's prompt as the engine takes it: the served model checked, text (or a chat's messages
through the model's chat template) tokenised, token ids checked against the vocabulary, and max_tokens checked
against the context.

Every refusal is an `InputError` whose `param` names the request field at fault and whose `code` is OpenAI's
(`context_length_exceeded`, `invalid_value`); `errors.describe` turns it into the 400 body. Tokenising and
rendering are slow for long prompts, so the server calls `completion_prompts` and `chat_prompt` off the event loop.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from moelane.errors import InputError, PromptTooLong
from moelane.model.grammar import Grammar, json_grammar
from moelane.model.reasoning import Channels, answer_opening
from moelane.server.chat_request import ChatCompletionRequest
from moelane.server.errors import ModelNotFound
from moelane.server.protocol import CompletionRequest, SamplingFields
from moelane.server.tools import (
    ARGUMENTS_AS_TEXT,
    HARMONY,
    HERMES,
    NAMED_AFTER,
    REQUIRED_JSON,
    ToolSupport,
    ToolUse,
    call_opening,
    tool_support,
)

log = logging.getLogger(__name__)
OVER_CONTEXT, INVALID = "context_length_exceeded", "invalid_value"  # error codes, as OpenAI's


def bad_request(message: str, param: str | None = None, code: str | None = INVALID) -> InputError:
    e = InputError(message)
    e.param, e.code = param, code  # type: ignore[attr-defined]
    return e


def check_chat_template(tokenizer: Any) -> None:
    """ModelLoadError if the model's chat template cannot be compiled: every chat request would fail, and that is
    the model folder's fault, not the client's. (A template that refuses some messages at render time, with
    `raise_exception`, is fine: those requests get a 400.)"""
    if getattr(tokenizer, "chat_template", None):
        tokenizer.compiled_chat_template()


class Prompts:
    """The prompt rules of one served model. `lm`: its tokenizer, `max_context` and `vocab_size`."""

    def __init__(self, lm: Any, model_name: str) -> None:
        self.lm, self.model_name = lm, model_name

    @functools.cached_property
    def tools(self) -> ToolSupport:
        """How this model writes tool calls (read from its chat template when first asked)."""
        return tool_support(self.lm.tokenizer)

    def tool_use(self, body: ChatCompletionRequest) -> ToolUse | None:
        """How a chat request's replies are read for calls; None: they are not (no tools, or tool_choice "none").
        A 400 for tools this model cannot use, and for a `tool_choice` other than "none" without tools."""
        forced, syntax = body.forced(), self.tools.syntax if body.tools else None
        if body.tools and syntax is None:  # (with tool_choice "none" too: the schema says no tools)
            raise bad_request(f"tools cannot be used with this model: {self.tools.why_not}", "tools")
        names = [tool.function.name for tool in body.tools or ()]
        if body.tool_choice not in (None, "none") and not names:  # ("auto" too, as OpenAI's and vLLM's refuse it)
            raise bad_request("'tool_choice' is only allowed when 'tools' are specified: the request gives no tools",
                              "tool_choice")  # fmt: skip
        if forced and forced not in names:
            message = f"tool_choice names {forced!r}, which is not among the tools given ({', '.join(names)})"
            raise bad_request(message, "tool_choice")
        if not body.tools_on() or syntax is None:
            return None
        types = {tool.function.name: properties(tool.function.parameters) for tool in body.tools or ()}
        n_calls = sum(len(m.tool_calls or ()) for m in body.messages)
        opening = call_opening(syntax, forced or None, n_calls) if forced is not None else ""
        parallel = body.parallel_tool_calls is not False
        return ToolUse(syntax, parallel, types, opening, named=bool(forced), shown=self.tools.shown)

    def check_model(self, name: str | None) -> None:
        """Refuse a request for another model; one that names none gets the served one (as vLLM's, llama.cpp's)."""
        if name is not None and name != self.model_name:
            e = ModelNotFound(f"the model {name!r} does not exist; this server serves {self.model_name!r}")
            e.param = "model"  # type: ignore[attr-defined]
            raise e

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        """A prompt text's token ids; one whose head alone already holds twice the context is refused unread.
        `param`: the request field the text came from."""
        try:
            return self.lm.tokenizer.encode_prompt(text, int(self.lm.max_context))  # type: ignore[no-any-return]
        except PromptTooLong as e:
            raise bad_request(str(e), param, OVER_CONTEXT) from None
        except InputError as e:  # a text the tokenizer cannot take (a lone surrogate)
            raise bad_request(str(e), param) from None

    def completion_prompts(self, body: CompletionRequest) -> list[tuple[list[int], str]]:
        """(token ids, echoed text) per prompt. Runs off the event loop (tokenising 128 long prompts takes a while)."""
        prompts = [self.completion_prompt(p) for p in body.prompts()]
        return [(ids, self.lm.tokenizer.decode(ids) if body.echo else "") for ids in prompts]

    def completion_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt)
        vocab = int(self.lm.vocab_size)
        if any(not 0 <= t < vocab for t in prompt):
            raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
        return prompt

    def logit_bias(self, body: SamplingFields) -> dict[int, float]:
        """The request's logit bias by token id; a 400 naming `logit_bias` for an id past the vocabulary."""
        bias, vocab = body.bias_map(), int(self.lm.vocab_size)
        if past := [token for token in bias if token >= vocab]:
            raise bad_request(f"logit_bias token id {past[0]} is out of range: ids must be in [0, {vocab})",
                              "logit_bias")  # fmt: skip
        return bias

    def grammar(self, body: SamplingFields) -> Grammar | None:
        """What `response_format` holds the replies to (None: nothing). A 400 naming `response_format` for a schema
        that cannot be used. Runs off the event loop: a large schema takes a while to compile, and so does the
        tokenizer's first grammar view (~1 s, llguidance says)."""
        if body.response_format is None:
            return None
        wanted, schema, strict = body.response_format.json_wanted()
        if not wanted:
            return None
        try:
            return self._grammar(json_grammar(schema, strict=strict))
        except InputError as e:
            raise bad_request(f"response_format: {e}", "response_format") from None

    def call_grammar(self, body: ChatCompletionRequest, tools: ToolUse | None) -> Grammar | None:
        """What a call that `tool_choice` forces is held to, where the rest of the call is JSON (`NAMED_AFTER`): the
        named function's arguments (in a `<tool_call>` block, then the brace that closes the call; after Mistral's
        v3 or Granite's opening, `}]`), or for "required", where the call is JSON throughout, a call of any tool
        given, each with its own arguments (in a `<tool_call>` block; a list of such calls after Mistral's v3 or
        Granite's opening). None where nothing is forced, for the tagged forms (Qwen3-Coder's, GLM-4.5's,
        MiniMax-M2's), for "required" where the name comes before the JSON (harmony, Mistral's v11, DeepSeek's,
        Kimi-K2's), and where a tool's schema cannot be used (the call then goes as the model writes it)."""
        forced, syntax = body.forced(), tools.syntax if tools is not None else None
        if forced is None or syntax is None or syntax not in (NAMED_AFTER if forced else REQUIRED_JSON):
            return None
        schemas = {tool.function.name: arguments_schema(tool.function.parameters) for tool in body.tools or ()}
        try:
            if forced:
                return self._grammar(json_grammar(schemas[forced], NAMED_AFTER[syntax]))
            calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                      "required": ["name", "arguments"], "additionalProperties": False}
                     for name, schema in schemas.items()]  # fmt: skip
            one = {"anyOf": calls}
            return self._grammar(json_grammar(one if syntax == HERMES else {"type": "array", "items": one,
                                                                            "minItems": 1}))  # fmt: skip
        except InputError as e:
            log.warning("a forced tool call goes unconstrained: %s", e)
            return None

    def _grammar(self, text: str) -> Grammar:
        return Grammar.for_lm(self.lm, text)

    def chat_prompt(
        self, body: ChatCompletionRequest, tools: ToolUse | None = None, json: bool = False
    ) -> tuple[list[int], tuple[int, ...]]:
        """The messages through the chat template, as token ids, ending with the opening of a call `tools` forces,
        or of the answer where the reply must be `json`; and the primer: that opening's tokens where the channel
        splitter must read them first (harmony's; think tags are read from the prompt). Runs off the event loop:
        rendering thousands of messages takes seconds, in which no other stream would be served."""
        messages = [m.for_template(self.tools.syntax in ARGUMENTS_AS_TEXT) for m in body.messages]
        if any(len(m.get("tool_calls") or ()) > 1 for m in messages) and self.tools.syntax == HARMONY:
            messages = one_call_each(messages)
        try:
            text = self.lm.tokenizer.apply_chat_template(messages, **body.template_variables())
        except InputError as e:  # the template refused the messages (roles out of order, say)
            raise bad_request(str(e), "messages") from None
        tokenizer = self.lm.tokenizer
        if tools is not None and tools.opening:
            opening = tools.opening
        else:  # a reply held to JSON is the answer, at once
            opening = answer_opening(tokenizer, text) if json else ""
        harmony = bool(opening) and Channels.for_tokenizer(tokenizer) is not None
        return self.encode(text + opening, "messages"), tuple(tokenizer.encode(opening)) if harmony else ()

    def budget(self, n_prompt: int, requested: int | None, default: int | None, param: str = "prompt",
               limit_field: str = "max_tokens") -> int:  # fmt: skip
        """max_tokens for the engine: the request's, checked against the context, or the endpoint's default.
        `param`: the field the prompt came from (`messages` for chat); `limit_field`: the one `requested` came from."""
        context = int(self.lm.max_context)
        if n_prompt == 0:
            raise bad_request("the prompt is empty", param)
        if n_prompt >= context:
            raise bad_request(f"the prompt has {n_prompt} tokens; this model's context length is {context} tokens "
                              "(prompt and completion together)", param, OVER_CONTEXT)  # fmt: skip
        room = context - n_prompt
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            message = (f"{limit_field} is too large: the prompt has {n_prompt} tokens and this model's context length "
                       f"is {context}, so at most {room} completion tokens fit")  # fmt: skip
            raise bad_request(message, limit_field, OVER_CONTEXT)
        return requested


def properties(parameters: dict[str, object] | None) -> dict[str, Any]:
    """A tool's parameters by name, as its JSON schema gives them (a schema without `properties`: none)."""
    found = (parameters or {}).get("properties")
    return found if isinstance(found, dict) else {}


def one_call_each(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant messages of several calls as one message per call, its thinking and text with the first: harmony
    writes a call as a message of its own, and gpt-oss's template renders only an assistant message's first call."""
    out = []
    for message in messages:
        calls = message.get("tool_calls") or []
        if len(calls) < 2:
            out.append(message)
            continue
        out.append({**message, "tool_calls": calls[:1]})
        out.extend({"role": "assistant", "content": "", "tool_calls": [call]} for call in calls[1:])
    return out


def arguments_schema(parameters: dict[str, object] | None) -> dict[str, object]:
    """A tool's arguments schema as a call's arguments meet it: an object, whatever else it says. A function
    without `parameters` takes none (OpenAI's reading): `{}`."""
    if not parameters:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return {**parameters, "type": "object"} if "type" not in parameters else dict(parameters)

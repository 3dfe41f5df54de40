"""Text <-> token ids, and chat prompts, from the model folder's `tokenizer.json` and `tokenizer_config.json` (or a
GGUF's vocabulary: `gguf/vocab.py`).

The engine works on ids only; this is the one place text is turned into ids and back. The chat template is the
folder's own Jinja template, rendered in a sandbox.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from functools import cache, cached_property
from pathlib import Path
from typing import Any

from jinja2 import Template, meta, nodes
from jinja2.exceptions import TemplateError, TemplateSyntaxError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HfTokenizer

from moelane.errors import InputError, ModelLoadError, PromptTooLong
from moelane.model.checkpoint import read_json

# A prompt text longer than this many characters per context token is measured by its head first (`encode_prompt`):
# tokenising a megabyte takes seconds (and holds the GIL: a server's streams would stall) only to refuse it.
MAX_CHARS_PER_TOKEN = 32


class Tokenizer:
    def __init__(self, folder: Path, eos_ids: frozenset[int]) -> None:
        """The tokenizer of a model folder: tokenizer.json, tokenizer_config.json, the chat template."""
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"tokenizer.json not found in {folder}")
        try:
            tok = HfTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exceptions on bad files
            raise ModelLoadError(f"cannot read {path}: {e}") from None
        config: dict[str, Any] = {}
        cfg = folder / "tokenizer_config.json"
        if cfg.is_file():
            config = read_json(cfg, "tokenizer_config.json")
        self._init(tok, config, read_chat_template(folder, config), eos_ids)

    @classmethod
    def built(cls, tok: HfTokenizer, config: dict[str, Any], eos_ids: frozenset[int]) -> Tokenizer:
        """A tokenizer built elsewhere (a GGUF's), with the tokenizer_config.json entries `config` says (eos_token,
        bos_token, chat_template)."""
        self = cls.__new__(cls)
        chat_template = config.get("chat_template")
        self._init(tok, config, chat_template if isinstance(chat_template, str) else None, eos_ids)
        return self

    def _init(
        self, tok: HfTokenizer, config: dict[str, Any], chat_template: str | None, eos_ids: frozenset[int]
    ) -> None:
        self._tok, self.config, self.chat_template = tok, config, chat_template
        self._template: Template | None = None  # compiled at its first use (`compiled_chat_template`)
        eos_token = self._token_str("eos_token")
        self.eos_token = eos_token
        ids = set(eos_ids)
        if not ids and eos_token is not None and (tid := self._tok.token_to_id(eos_token)) is not None:
            ids.add(tid)
        self.eos_ids = frozenset(ids)

    def _token_str(self, key: str) -> str | None:
        value = self.config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        return value if isinstance(value, str) else None

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        try:
            return list(self._tok.encode(text, add_special_tokens=False).ids)
        except TypeError:  # what the tokenizers library says of a str it cannot take: one with a lone surrogate
            if (problem := lone_surrogate(text)) is not None:
                raise InputError(f"the text is not valid Unicode: {problem}") from None
            raise

    def encode_prompt(self, text: str, context: int) -> list[int]:
        """`encode(text)`, but a text whose head alone holds twice `context` tokens is refused unread: a prompt of
        megabytes would take a minute to encode only to be refused for its length."""
        head = context * MAX_CHARS_PER_TOKEN
        if len(text) > head and (n_head := len(self.encode(text[:head]))) >= 2 * context:
            raise PromptTooLong(f"the prompt has {n_head} tokens in its first {head} characters alone; this "
                                f"model's context length is {context} tokens (prompt and reply together)")  # fmt: skip
        return self.encode(text)

    def serialized(self) -> str:
        """The tokenizer as tokenizer.json holds it (for llguidance's view of it: `grammar.grammar_tokenizer`)."""
        return str(self._tok.to_str())

    def decode(self, ids: Iterable[int], shown: frozenset[int] = frozenset()) -> str:
        """The text of `ids`, without special tokens (`<|endoftext|>`, `[TOOL_CALLS]`) but those in `shown`, which
        read as their text (a tool form's markers, for the server's reader of calls)."""
        if not shown:
            return str(self._tok.decode(list(ids), skip_special_tokens=True))
        kept = [i for i in ids if i in shown or i not in self._special_ids]
        return str(self._tok.decode(kept, skip_special_tokens=False))

    @cached_property
    def _special_ids(self) -> frozenset[int]:
        """The ids of the tokens a decode drops."""
        return frozenset(i for i, token in self._tok.get_added_tokens_decoder().items() if token.special)

    def token_id(self, token: str) -> int | None:
        """The id of a token of the vocabulary (special tokens included), or None."""
        tid = self._tok.token_to_id(token)
        return None if tid is None else int(tid)

    def compiled_chat_template(self) -> Template:
        """The chat template, compiled once (a server renders it for every request). InputError if the model has
        none; ModelLoadError if it cannot be compiled (a syntax error, an unknown filter): the folder's fault, not a
        request's."""
        if self._template is None:
            if not self.chat_template:
                raise InputError("this model has no chat template (no chat_template.jinja, and tokenizer_config.json "
                                 "has no chat_template)")  # fmt: skip
            try:
                self._template = chat_environment().from_string(self.chat_template)
            except TemplateSyntaxError as e:  # (an unknown filter or test too: Jinja finds them when compiling)
                raise ModelLoadError(
                    f"the model's chat template cannot be compiled: {e.message} (line {e.lineno})"
                ) from None
        return self._template

    def chat_template_variables(self) -> frozenset[str]:
        """The variables the chat template reads from its caller (`messages`, `tools`, `enable_thinking`, ...)."""
        if not self.chat_template:
            return frozenset()
        return frozenset(meta.find_undeclared_variables(chat_environment().parse(self.chat_template)))

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **variables: object
    ) -> str:
        """The template rendered over `messages`, with `variables` as more template variables (`enable_thinking`,
        `reasoning_effort`, ...)."""
        template = self.compiled_chat_template()
        try:
            return template.render(
                **variables,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._token_str("bos_token") or "",
                eos_token=self.eos_token or "",
            )
        except TemplateRaised as e:  # the template's own message (roles that do not alternate, say)
            raise InputError(f"the chat template refused the messages: {e}") from None
        except TemplateError as e:
            raise InputError(f"chat template failed: {e}") from None
        except Exception as e:  # a value of the messages' the template cannot use (`|items` of a string, say)
            raise InputError(f"chat template failed on these messages: {type(e).__name__}: {e}") from None


def lone_surrogate(text: str) -> str | None:
    """What makes `text` not valid Unicode ("character 3 is a lone surrogate ('\\udc80')"), or None if it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"character {e.start} is a lone surrogate ({text[e.start]!r})"
    return None


def read_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """The chat template where transformers finds it: `chat_template.jinja` beside the tokenizer (what transformers 5
    saves and newer hub repositories ship; it wins), else tokenizer_config.json's `chat_template`, a string or a list
    of named templates, of which "default"."""
    path = folder / "chat_template.jinja"
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"cannot read {path}: {e}") from None
    value = config.get("chat_template")
    if isinstance(value, list):
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    return value if isinstance(value, str) else None


class TemplateRaised(Exception):
    """What a chat template's `raise_exception(message)` raises."""


def raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's part for training masks; rendering keeps the
    text as it is."""

    tags = {"generation"}  # noqa: RUF012 (as jinja2 declares it)

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


@cache
def chat_environment() -> ImmutableSandboxedEnvironment:
    """The sandbox chat templates render in, with what templates written for transformers expect of it:
    `raise_exception`, `strftime_now`, `{% break %}`/`{% continue %}`, `{% generation %}`, and a `tojson` that writes
    plain JSON (Jinja's own escapes <, >, & and ' for HTML and all non-ASCII) with json.dumps' options."""
    extensions = [loopcontrols, GenerationBlock]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=extensions)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    env.filters["tojson"] = to_json
    return env


def to_json(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    try:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    except (TypeError, ValueError) as e:  # a value JSON cannot write (an undefined variable, say): the template's fault
        raise TemplateError(f"tojson: {e}") from None


class Detokenizer:
    """Turns a growing list of ids into text pieces, holding back an unfinished UTF-8 character.

    Each push decodes only a short window: the ids since the last piece plus the ids of that piece as context (so
    tokenizers that drop a leading space at the start of a decode still space correctly), and emits the difference.
    Work per token stays constant however long the reply grows. `shown`: special tokens that read as their text
    (`Tokenizer.decode`)."""

    def __init__(self, tokenizer: Tokenizer, shown: frozenset[int] = frozenset()) -> None:
        self._tok, self._shown = tokenizer, shown
        self._ids: list[int] = []
        self._prefix = 0  # window start: context ids already emitted
        self._read = 0  # ids before this are emitted

    def push(self, ids: Iterable[int]) -> str:
        self._ids.extend(ids)
        return self._take(hold=True)

    def flush(self) -> str:
        """At the end of a reply: what `push` held back, an unfinished character shown as U+FFFD (as a decode of the
        whole reply shows it)."""
        return self._take(hold=False)

    def _take(self, hold: bool) -> str:
        """The text of the ids not emitted yet; with `hold`, nothing while it ends in an unfinished character."""
        if len(self._ids) == self._read:
            return ""
        before = self._tok.decode(self._ids[self._prefix : self._read], self._shown)
        text = self._tok.decode(self._ids[self._prefix :], self._shown)
        if hold and (text.endswith("\ufffd") or len(text) <= len(before)):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before) :]


class StopFilter:
    """Cuts streamed text at the first stop string, never letting out text past it.

    Text that could be the start of a stop string is held back until it is known not to be one.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def push(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self._held + piece
        cut = min((i for s in self.stops if (i := text.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._held = True, ""
            return text[:cut]
        keep = max((held_back(text, s) for s in self.stops), default=0)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held


def held_back(text: str, stop: str) -> int:
    """The length of the longest end of `text` that begins `stop` and is shorter than it (0: none). Only the places
    where `stop`'s first character stands are tried, so a token's work stays about the length of the text held, not
    its square (a stop string of a thousand characters)."""
    i = text.find(stop[0], max(0, len(text) - len(stop) + 1))
    while i >= 0:
        if stop.startswith(text[i:]):
            return len(text) - i
        i = text.find(stop[0], i + 1)
    return 0

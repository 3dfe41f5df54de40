"""Constrained decoding: a reply held to JSON, or to a JSON schema (OpenAI's `response_format`), by llguidance's
token masks.

A `Grammar` is one reply's constraint. `allowed(reply)` is the mask of the tokens that may follow the reply's
tokens: a function of the reply alone, as sampling is of the logits, seed and position. So a drafted row is masked
exactly as a one-token step at that position would be, and replies stay token-identical with drafting on or off:
the matcher follows whatever reply it is asked about, rolling back what a rejected draft made it consume. Once the
JSON is whole, only an end-of-sequence token may follow; a reply cut off by `max_tokens` stays unfinished, as
OpenAI's does.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import llguidance
import numpy as np
import torch

from moelane.errors import InputError
from moelane.model.tokenizer import Tokenizer

# Any JSON object (`response_format: {"type": "json_object"}`).
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# JSON as written by hand: a space may follow ',' and ':' and lines may break, but runs of whitespace are kept
# short (a model that loops on blank lines inside a constraint never ends its JSON).
COMPILE_OPTIONS = {"whitespace_pattern": r"(?:[\x20\x09]|\r?\n[\x20\x09]{0,32})?"}
MAX_ROLLBACK = 64  # tokens a matcher can step back (more than any draft): past that it starts over from the reply

_tokenizers: weakref.WeakKeyDictionary[Tokenizer, dict[tuple[int, tuple[int, ...]], llguidance.LLTokenizer]] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()


def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_ids: Iterable[int]) -> llguidance.LLTokenizer:
    """llguidance's view of a model's tokenizer, built once per tokenizer, vocabulary size and end ids (~1 s for a
    large vocabulary, llguidance says; 0.03 s for the shipped model's 8K tokens)."""
    # (llguidance takes only end tokens the tokenizer has: a config's id past it would be refused)
    eos = tuple(sorted(i for i in eos_ids if i < min(vocab_size, tokenizer.vocab_size)))
    with _lock:
        views = _tokenizers.setdefault(tokenizer, {})
        found = views.get((vocab_size, eos))
        if found is None:
            found = llguidance.LLTokenizer(tokenizer.serialized(), n_vocab=vocab_size, eos_token=list(eos) or None)
            views[(vocab_size, eos)] = found
        return found


def json_grammar(schema: dict[str, Any] | bool | None = None, after: str = "", strict: bool = False) -> str:
    """The grammar of JSON that `schema` accepts (None: any JSON object), followed by the text `after` (for a tool
    call's arguments: the brace that closes the call's object). InputError if there is no such grammar: a schema
    llguidance cannot read (an unknown type, a `$ref` to nothing, a bound past 64-bit integers, which it would
    clamp), `false`, which accepts nothing, or, when `strict`, one with keywords llguidance does not implement
    (`uniqueItems`, `if`/`then`, `contains`, `not`, ...), which a reply could then break. Not strict, those are
    ignored: clients' schemas come with all sorts."""
    if schema is False:
        raise InputError("the JSON schema cannot be used: false accepts no value")
    chosen = ANY_OBJECT if schema is None else {} if schema is True else schema
    if (bound := past_int64(chosen)) is not None:
        raise InputError(f"the JSON schema cannot be used: {bound} is past what 64-bit integers hold")
    options = {**chosen, "x-guidance": {**COMPILE_OPTIONS, "lenient": not strict}}
    lark = "start: value" + (f" {json.dumps(after)}" if after else "") + f"\nvalue: %json {json.dumps(options)}\n"
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError, RuntimeError) as e:
        raise InputError(f"the JSON schema cannot be used: {error_text(e)}") from None
    if error := llguidance.LLMatcher.validate_grammar(grammar):
        raise InputError(f"the JSON schema cannot be used: {error_text(error)}")
    return grammar


BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def past_int64(schema: object) -> float | None:
    """A numeric bound anywhere in `schema` that 64-bit integers cannot hold (llguidance would clamp it), or None."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                number = isinstance(value, int | float) and not isinstance(value, bool)
                if key in BOUNDS and number and not -(2**63) <= value <= 2**63 - 1:
                    return value  # type: ignore[no-any-return]
                stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)
    return None


def error_text(error: object) -> str:
    """llguidance's error in one line: its first, without the position in our grammar's text, and the line that
    says what is wrong where the first only says where (a regex's error)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    head = re.sub(r"^at \d+\(\d+\): ", "", lines[0])
    return " ".join([head, *(line for line in lines[1:] if line.startswith("error:"))])


class Grammar:
    """The constraint of one reply (not shared between replies: it keeps a matcher at the reply it last saw)."""

    def __init__(
        self, tokenizer: llguidance.LLTokenizer, grammar: str | llguidance.LLMatcher,
        start: llguidance.LLMatcher | None = None,
    ) -> None:  # fmt: skip
        """`grammar` as text, or a matcher at its start; `start`: that start, kept unchanged for `fresh` copies (one
        of its own by default)."""
        self._tokenizer = tokenizer
        if isinstance(grammar, str):
            grammar = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            if grammar.is_error():
                raise InputError(f"the JSON schema cannot be used: {error_text(grammar.get_error())}")
        self._matcher = grammar
        # (for `fresh`: a copy costs far less than compiling the grammar again; never changed, so copies share it)
        self._start = grammar.deep_copy() if start is None else start
        self._reply: list[int] = []  # the reply last asked about
        self._n_taken = 0  # how many of its tokens the matcher has taken (the rest left the grammar)
        self._bits = torch.zeros((tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
        self._eos = torch.zeros(tokenizer.vocab_size, dtype=torch.bool)
        self._eos[tokenizer.eos_tokens] = True

    @classmethod
    def for_lm(cls, lm: Any, grammar: str) -> Grammar:
        """`grammar` over a model's vocabulary: its tokenizer, its logits' width and its end-of-sequence ids."""
        return cls(grammar_tokenizer(lm.tokenizer, int(lm.vocab_size), lm.eos_ids), grammar)

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.vocab_size)

    def fresh(self) -> Grammar:
        """The same constraint for another reply (quick: no compiling)."""
        return Grammar(self._tokenizer, self._start.deep_copy(), self._start)

    def allowed(self, reply: Sequence[int]) -> torch.Tensor:
        """bool [vocab]: the tokens that may follow `reply`. Only end-of-sequence tokens once the JSON is whole,
        or once the reply has left the grammar (a token the mask forbade was put in: nothing can mend it)."""
        if self._follow(reply) < len(reply):
            return self._eos
        self._matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        bits = np.unpackbits(self._bits.numpy().view(np.uint8), bitorder="little")
        mask = torch.from_numpy(bits[: self._eos.shape[0]].astype(np.bool_))
        return mask if bool(mask.any()) else self._eos

    def complete(self, reply: Sequence[int]) -> bool:
        """Whether `reply` holds whole JSON, which only an end-of-sequence token may follow (false for a reply cut
        off mid-value, or one that left the grammar)."""
        return self._follow(reply) == len(reply) and bool(self._matcher.is_accepting())

    def _follow(self, reply: Sequence[int]) -> int:
        """Bring the matcher to the state after the longest prefix of `reply` that the grammar allows: step back to
        where the reply parts from the last one, then take the rest. -> the length of that prefix. (The matcher
        never takes a token it would refuse: in its error state it could not step back.)"""
        kept = 0
        for mine, theirs in zip(self._reply, reply, strict=False):
            if mine != theirs:
                break
            kept += 1
        kept = min(kept, self._n_taken)
        back = self._n_taken - kept
        if back > MAX_ROLLBACK or (back and not self._matcher.rollback(back)):
            self._matcher.reset()
            kept = 0
        rest = list(reply[kept:])
        n = self._matcher.validate_tokens(rest) if rest else 0
        if n and not self._matcher.consume_tokens(rest[:n]):
            raise RuntimeError(f"llguidance took back tokens it had validated: {self._matcher.get_error()}")
        self._reply, self._n_taken = list(reply), kept + n
        return self._n_taken

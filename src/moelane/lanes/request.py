"""A request as `Engine.submit` takes it: `check_request` turns submit's arguments into plain, checked values before
anything is queued (InputError for a bad one), and `submit_kwargs` gives submit's keywords for `SamplingParams`.

Invariants of a checked `Request`: counts, ids and seeds are plain ints (numpy's too are taken); the prompt is
non-empty, within the vocabulary and leaves room for at least one new token; `1 <= max_tokens <=` the room left;
a sampled request has a seed.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from moelane.errors import InputError, integer
from moelane.lanes.target import Target
from moelane.model.grammar import Grammar
from moelane.model.lm import token_id_list
from moelane.model.sampling import SamplingParams

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class Request:
    prompt: list[int]
    max_tokens: int  # cut to the room the context has left after the prompt
    params: SamplingParams
    stop_ids: frozenset[int]  # the target's EOS ids and the request's stop tokens
    top_logprobs: int | None  # None: no log-probabilities; n: each token's, with the n most likely
    prompt_logprobs: bool


def check_request(
    target: Target,
    token_ids: Sequence[int],
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    stop_token_ids: Sequence[int] | None,
    logit_bias: Mapping[int, float] | None,
    presence_penalty: float,
    frequency_penalty: float,
    logprobs: int | None,
    prompt_logprobs: bool,
    grammar: Grammar | None = None,
) -> Request:
    """`Engine.submit`'s arguments (as it documents them) checked for `target`; InputError for a bad one."""
    if grammar is not None and not isinstance(grammar, Grammar):
        raise InputError(f"grammar must be a moelane.model.grammar.Grammar, got {grammar!r}")
    if not isinstance(prompt_logprobs, bool):
        raise InputError(f"prompt_logprobs must be True or False, got {prompt_logprobs!r}")
    try:  # counts, ids and seeds as plain ints (numpy's too), before anything is queued
        max_tokens, top_k = integer("max_tokens", max_tokens), integer("top_k", top_k)
        seed = None if seed is None else integer("seed", seed)
        logprobs = None if logprobs is None else integer("logprobs", logprobs)
        if not isinstance(logit_bias or {}, Mapping):
            raise ValueError(f"logit_bias must be a mapping of token id to bias, got {logit_bias!r}")
        bias = tuple(sorted((integer("logit_bias token id", t), b) for t, b in (logit_bias or {}).items()))
        stop_ids = () if stop_token_ids is None else stop_token_ids  # (not `or`: a numpy array has no truth value)
        if isinstance(stop_ids, str | bytes | Mapping) or not isinstance(stop_ids, Iterable):  # (numpy's, torch's too)
            raise ValueError(f"stop_token_ids must be a list of token ids, got {stop_token_ids!r}")
        stops = frozenset(integer("stop_token_ids", t) for t in stop_ids)
        params = SamplingParams(temperature, top_p, top_k, seed, bias, presence_penalty, frequency_penalty, grammar)
        params.check_vocab(target.vocab_size)
    except ValueError as e:
        raise InputError(str(e)) from None
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise InputError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}")
    if prompt_logprobs and logprobs is None:
        raise InputError("prompt_logprobs needs logprobs (the number of alternatives to report)")
    if not params.greedy and params.seed is None:
        params = replace(params, seed=secrets.randbits(62))
    prompt = token_id_list(prompt_ids(token_ids), target.vocab_size, target.max_context)
    if max_tokens < 1:
        raise InputError(f"max_tokens must be >= 1, got {max_tokens}")
    max_tokens = min(max_tokens, target.max_context - len(prompt))
    return Request(prompt, max_tokens, params, target.eos_ids | stops, logprobs, prompt_logprobs)


def prompt_ids(token_ids: Sequence[int]) -> Sequence[int]:
    """The prompt's ids as given, an iterator's as a list; InputError for a bool among them (`token_id_list` takes
    True as 1)."""
    if isinstance(token_ids, str | bytes):
        return token_ids
    try:
        ids = list(token_ids)
    except TypeError:
        raise InputError("token ids must be integers") from None
    if any(isinstance(t, bool) for t in ids):
        raise InputError(f"token ids must be integers, not bools: {[t for t in ids if isinstance(t, bool)][:3]}")
    return ids


def submit_kwargs(params: SamplingParams) -> dict[str, Any]:
    """`Engine.submit`'s keyword arguments for these sampling settings (as `LM.generate_ids` takes them)."""
    return dict(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=params.seed,
                logit_bias=dict(params.logit_bias), presence_penalty=params.presence_penalty,
                frequency_penalty=params.frequency_penalty, grammar=params.grammar)  # fmt: skip

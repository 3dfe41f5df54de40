"""Replies held to JSON (`moelane.model.grammar`): what the masks let through, that a mask depends on the reply alone
(however the matcher got there), and that the lanes engine's replies under a grammar equal one-token decoding's
with drafting on and off, greedy and sampled."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch

import moelane
from moelane.errors import InputError
from moelane.lanes.config import EngineConfig
from moelane.lanes.engine import Engine
from moelane.model.grammar import Grammar, grammar_tokenizer, json_grammar
from moelane.model.sampling import SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
PROMPTS = [
    "def person():\n    return ",
    "The settings, as JSON: ",
    '{"name": "ada", "age": 36, "role": "admin", "tags": ["math"]}\n{"name": "ada", "age": 36, "role": "admin", ',
    "ROMEO:\n",
]


@pytest.fixture(scope="module")
def lm() -> Any:
    return moelane.load()


def grammar(lm: Any, schema: Any = PERSON) -> Grammar:
    return Grammar.for_lm(lm, json_grammar(schema))


def meets_person(value: Any) -> bool:
    """PERSON's rules, checked by hand (the reference the masks are held to)."""
    return (
        isinstance(value, dict)
        and set(value) == {"name", "age", "role", "tags"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 12
        and type(value["age"]) is int
        and 0 <= value["age"] <= 120
        and value["role"] in ("admin", "user", "guest")
        and isinstance(value["tags"], list)
        and len(value["tags"]) <= 3
        and all(isinstance(t, str) and len(t) <= 8 for t in value["tags"])
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_finished_reply_meets_the_schema(lm: Any, prompt: str, temperature: float) -> None:
    params = SamplingParams(temperature, seed=7, grammar=grammar(lm))
    ids = list(lm.generate_ids(lm.tokenizer.encode(prompt), 200, params))
    assert len(ids) < 200, "the reply did not finish"  # (a bounded schema: it must end)
    assert meets_person(json.loads(lm.tokenizer.decode(ids)))


def test_any_json_object(lm: Any) -> None:
    for prompt in PROMPTS:
        ids = list(lm.generate_ids(lm.tokenizer.encode(prompt), 60, SamplingParams(grammar=grammar(lm, None))))
        text = lm.tokenizer.decode(ids)
        assert text.lstrip().startswith("{")
        if len(ids) < 60:
            assert isinstance(json.loads(text), dict)


def test_a_mask_depends_on_the_reply_alone(lm: Any) -> None:
    """One grammar asked about prefixes of a reply in random order (forward, back as after a rejected draft, far
    back) gives each prefix the mask a fresh grammar gives it."""
    reply = list(lm.generate_ids(lm.tokenizer.encode(PROMPTS[0]), 200, SamplingParams(grammar=grammar(lm))))
    wrong = [t for t in range(lm.vocab_size) if t not in reply][:5]
    prefixes = [reply[:k] for k in range(len(reply) + 1)]
    prefixes += [[*reply[:k], wrong[k % 5]] for k in range(0, len(reply), 3)]  # (a token the mask forbade)
    one = grammar(lm)
    rng = random.Random(0)
    for prefix in rng.sample(prefixes, len(prefixes)) + prefixes[::-1]:
        assert torch.equal(one.allowed(prefix), grammar(lm).allowed(prefix)), prefix


def test_after_the_json_or_a_forced_token_only_end_of_sequence_may_follow(lm: Any) -> None:
    g = grammar(lm)
    reply = list(lm.generate_ids(lm.tokenizer.encode(PROMPTS[0]), 200, SamplingParams(grammar=g)))
    eos = torch.zeros(lm.vocab_size, dtype=torch.bool)
    eos[sorted(lm.eos_ids)] = True
    assert torch.equal(g.allowed(reply), eos)
    assert torch.equal(g.allowed(lm.tokenizer.encode("nope")), eos)  # ('n' cannot start the object)


def test_a_reply_is_complete_once_its_json_is_whole(lm: Any) -> None:
    """`complete` (what `moelane run --json` asks of a reply that --max-tokens cut) agrees with json.loads on every
    prefix of a finished reply."""
    g = grammar(lm)
    reply = list(lm.generate_ids(lm.tokenizer.encode(PROMPTS[0]), 200, SamplingParams(grammar=g)))
    for k in range(len(reply) + 1):
        try:
            json.loads(lm.tokenizer.decode(reply[:k]))
            whole = True
        except ValueError:
            whole = False
        assert g.complete(reply[:k]) is whole, lm.tokenizer.decode(reply[:k])
    assert not g.complete(lm.tokenizer.encode("nope"))  # (left the grammar)


@pytest.mark.parametrize(
    ("schema", "needle"),
    [
        ({"type": "tuple"}, "Invalid type"),
        (False, "accepts no value"),
        ({"$ref": "#/$defs/missing"}, "missing"),
        ({"type": "string", "pattern": "(["}, "regex parse error: error: unclosed character class$"),
        ({"type": "integer", "minimum": 2**63 + 1}, "past what 64-bit integers hold"),  # (llguidance would clamp)
        ({"items": {"type": "number", "maximum": -1e30}}, "past what 64-bit integers hold"),
    ],
)
def test_a_schema_that_cannot_be_used_is_an_input_error(schema: Any, needle: str) -> None:
    with pytest.raises(InputError, match=needle) as e:
        json_grammar(schema)
    assert "\n" not in str(e.value) and " at " not in str(e.value)  # (one line, no place in our grammar's text)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "array", "uniqueItems": True},
        {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
        {"type": "array", "contains": {"const": 0}},
        {"not": {"type": "string"}},
    ],
)
def test_keywords_the_grammar_cannot_hold_are_refused_when_strict(schema: dict[str, Any]) -> None:
    json_grammar(schema)  # (ignored: the reply is held to the rest)
    with pytest.raises(InputError, match="Unimplemented keys"):
        json_grammar(schema, strict=True)
    json_grammar({"type": "string", "format": "email", "title": "t", "description": "d"}, strict=True)


def test_a_grammar_for_another_vocabulary_is_refused(lm: Any) -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        SamplingParams(grammar=grammar(lm)).check_vocab(lm.vocab_size + 1)


def test_end_ids_past_the_tokenizer_are_left_to_the_rest(lm: Any) -> None:
    """A config may name an end-of-sequence id past the tokenizer's own tokens (the embedding has more rows):
    llguidance refuses such an id, so the grammar ends on the others. (The shipped model's tokenizer, whose view
    other tests have built with other end ids: a view is kept per vocabulary size and end ids.)"""
    tok = lm.tokenizer
    llg = grammar_tokenizer(tok, tok.vocab_size + 16, {tok.vocab_size + 3, tok.vocab_size - 1})
    held = Grammar(llg, json_grammar())
    finished = tok.encode('{"a": 1}')
    assert held.allowed(finished).nonzero().flatten().tolist() == [tok.vocab_size - 1]


@pytest.mark.parametrize("drafter", ["none", "copy"])
def test_engine_replies_under_a_grammar_equal_one_token_decoding(lm: Any, drafter: str) -> None:
    """Drafts (copy-heavy prompts make the copy drafter propose JSON) are checked against the mask of their own
    row, so the replies are the one-token replies, greedy and seeded."""
    engine = Engine(lm, EngineConfig(drafter=drafter, timed=False))
    runs = []
    for i, prompt in enumerate(PROMPTS * 2):
        temperature = 0.0 if i < len(PROMPTS) else 0.9
        ids = lm.tokenizer.encode(prompt)
        stream = engine.submit(ids, 60, temperature=temperature, seed=i, grammar=grammar(lm))
        runs.append((ids, SamplingParams(temperature, seed=i if temperature else None), stream))
    engine.run_until_idle()
    for ids, params, stream in runs:
        alone = SamplingParams(params.temperature, seed=params.seed, grammar=grammar(lm))
        assert stream.token_ids == list(lm.generate_ids(ids, 60, alone))

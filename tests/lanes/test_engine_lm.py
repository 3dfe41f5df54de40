"""Token identity on a real model: every lanes reply equals `LM.generate_ids` of that prompt alone (greedy and seeded
sampling), whatever the drafter, the guard and the stream count. Default run: tiny random qwen3_moe models; the full
acceptance matrix (24 prompts, 1-16 streams, every drafter, guard on and off, the shipped model) is marked slow."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import moelane
from moelane.lanes import Engine, EngineConfig
from moelane.lanes.drafters import load_draft_model
from moelane.lanes.request import submit_kwargs
from moelane.model.cache import Rows
from moelane.model.lm import LM
from moelane.model.sampling import SamplingParams
from tests.helpers import random_model
from tests.lanes.reference import prompts


def params_of(i: int) -> SamplingParams:
    if i % 6 == 5:  # sampled, with a bias and penalties: each token depends on the reply before it
        return SamplingParams(temperature=0.8, seed=31 + i, logit_bias=((2, 2.0),), frequency_penalty=1.0)
    if i % 4 == 3:
        return SamplingParams(logit_bias=((2, 3.0), (5, -50.0)), presence_penalty=1.0, frequency_penalty=0.5)
    return SamplingParams() if i % 2 == 0 else SamplingParams(temperature=0.8, top_p=0.9, seed=31 + i)


def check_identity(lm: Any, draft: Any, cases: list[tuple[list[int], list[int]]], max_tokens: int, **config: Any):
    engine = Engine(lm, EngineConfig(**config), draft=draft)
    streams = []
    for i, (prompt, _) in enumerate(cases):
        sp = params_of(i)
        streams.append(engine.submit(prompt, max_tokens, **submit_kwargs(sp)))
    engine.run_until_idle()
    for i, (stream, (prompt, expected)) in enumerate(zip(streams, cases, strict=True)):
        assert stream.token_ids == expected, f"prompt {i} ({prompt}) with {config}"
    return engine.stats()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_model("qwen3_moe", tmp_path_factory.mktemp("lanes_lm") / "target")


@pytest.fixture(scope="module")
def tiny(tiny_folder: Path) -> tuple[Any, Any]:
    lm = moelane.load(tiny_folder)
    draft = moelane.load(random_model("qwen3_moe", tiny_folder.parent / "draft", seed=1))
    return lm, draft


@pytest.fixture(scope="module")
def tiny_cases(tiny: tuple[Any, Any]) -> list[tuple[list[int], list[int]]]:
    lm, _ = tiny
    return [(p, list(lm.generate_ids(p, 16, params_of(i)))) for i, p in enumerate(prompts(6, lm.vocab_size))]


@pytest.mark.parametrize(
    "config",
    [
        dict(drafter="none", max_streams=4),
        dict(drafter="copy", max_streams=1),
        dict(drafter="copy", max_streams=4, prefill_chunk=5),
        dict(drafter="recall", max_streams=6),
        dict(drafter="model", max_streams=3, guard=False, timed=False),  # table prices: drafts surely held
        dict(drafter="model", max_streams=6, guard=True),
    ],
)
def test_tiny_model_replies_equal_solo_decode(tiny, tiny_cases, config: dict[str, Any]) -> None:
    lm, draft = tiny
    stats = check_identity(lm, draft, tiny_cases, 16, **config)
    if config["drafter"] == "model" and not config.get("guard"):
        assert stats.holds > 0


@pytest.mark.parametrize(
    "setting",
    [
        dict(default_tier="int8"),  # every expert resident at int8, computed from its codes by the kernels
        pytest.param(dict(default_tier="int4", quantize="int4"), marks=pytest.mark.slow),  # dense projections too
        pytest.param(dict(dtype=torch.bfloat16), marks=pytest.mark.slow),  # bf16 pools, projections: the kernels
        dict(expert_memory="40%", default_tier="int4"),  # a store paging experts held at int4
    ],
    ids=["int8", "int4-all", "bf16", "paged-int4"],
)
def test_replies_equal_solo_decode_at_every_precision(tiny_folder: Path, setting: dict[str, Any]) -> None:
    lm = moelane.load(tiny_folder, **setting)
    cases = [(p, list(lm.generate_ids(p, 12, params_of(i)))) for i, p in enumerate(prompts(6, lm.vocab_size))]
    for config in (dict(drafter="none", max_streams=6), dict(drafter="copy", max_streams=4, prefill_chunk=5)):
        check_identity(lm, None, cases, 12, **config)


@pytest.mark.slow  # (two more compiles, ~10 s each)
@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_compiled_replies_equal_compiled_solo_decode_with_quantised_weights(tiny_folder: Path, quantize: str) -> None:
    """The decode step exported and compiled ahead of time (the default) over int8 / int4 experts and projections:
    shared rounds, drafts verified, give each stream its compiled solo decode."""
    lm = moelane.load(tiny_folder, quantize=quantize, compile=True)
    cases = [(p, list(lm.generate_ids(p, 12, params_of(i)))) for i, p in enumerate(prompts(6, lm.vocab_size))]
    for config in (dict(drafter="none", max_streams=6), dict(drafter="copy", max_streams=4, prefill_chunk=5)):
        check_identity(lm, None, cases, 12, timed=False, **config)
    assert lm._compiled is not None and getattr(lm._compiled, "exported", None) is not None


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("glm4_moe", dict(n_group=4, topk_group=2, use_qk_norm=True)),
        ("deepseek_v3", dict(rope_interleave=False)),
        ("gpt_oss", dict(sliding_window=6)),
    ],
)
def test_families_of_their_own_kind_reply_as_solo_decode(family: str, overrides: dict, tmp_path: Path) -> None:
    """Families with a biased, group-limited sigmoid router (glm4_moe with partial rotary embeddings; deepseek_v3
    with latent attention), and gpt_oss (attention sinks, sliding windows, expert biases): shared rounds with drafts
    verified give each stream its solo decode."""
    folder = random_model(family, tmp_path / family, **overrides)
    lm = moelane.load(folder)
    cases = [(p, list(lm.generate_ids(p, 16, params_of(i)))) for i, p in enumerate(prompts(6, lm.vocab_size))]
    assert check_identity(lm, None, cases, 16, drafter="copy", max_streams=4, prefill_chunk=5).holds > 0


def test_lfm2_convolutions_roll_back_with_rejected_drafts(tmp_path: Path) -> None:
    """lfm2_moe's convolutions read the history of their inputs by position: with drafts that are all rejected (from
    another random model) or all accepted (from the model itself), in shared rounds beside prompt chunks, each
    stream still gets its solo decode, greedy and sampled."""
    folder = random_model("lfm2_moe", tmp_path / "target")
    lm = moelane.load(folder)
    cases = [(p, list(lm.generate_ids(p, 16, params_of(i)))) for i, p in enumerate(prompts(6, lm.vocab_size))]
    config: dict[str, Any] = dict(drafter="model", max_streams=4, prefill_chunk=5, guard=False, timed=False)
    wrong = check_identity(lm, moelane.load(random_model("lfm2_moe", tmp_path / "other", seed=1)), cases, 16, **config)
    assert wrong.holds > 0 and wrong.accepted == 0
    right = check_identity(lm, moelane.load(folder), cases, 16, **config)
    assert right.holds > 0 and right.accepted > 0


@pytest.mark.slow  # (another compile)
def test_a_model_of_one_kv_head_compiles_and_replies_as_its_compiled_solo_decode(tmp_path: Path) -> None:
    """Multi-query attention (one KV head): the decode step compiles (inductor could not lower its attention
    product once: a size-1 head dim beside the unbacked key length), its logits are the eager ones within fp32
    rounding, and shared rounds with drafts give each stream its compiled solo decode."""
    folder = random_model("mixtral", tmp_path / "mqa", num_attention_heads=4, num_key_value_heads=1)
    eager = moelane.load(folder)
    lm = moelane.load(folder, compile=True)
    assert lm.warm_up(8, 16)
    prompt = prompts(1, lm.vocab_size)[0]

    def next_logits(model: LM) -> torch.Tensor:
        cache = model.cache_for(len(prompt), 2)
        model.forward([Rows(cache, prompt, 0)])
        return model.forward([Rows(cache, [7], len(prompt), decode=True)])[0]

    assert torch.allclose(next_logits(lm), next_logits(eager), atol=1e-4)
    cases = [(p, list(lm.generate_ids(p, 12, params_of(i)))) for i, p in enumerate(prompts(4, lm.vocab_size))]
    check_identity(lm, moelane.load(folder), cases, 12, drafter="model", max_streams=4, timed=False, guard=False)


@pytest.mark.slow  # (compiles a draft model)
def test_a_compiled_draft_model_changes_no_reply(tiny, tiny_cases) -> None:
    """The draft model the engine loads runs its generated rows (and short catch-ups) through its compiled decode
    step; drafts are held and every reply still equals the solo decode."""
    lm, eager = tiny
    draft = load_draft_model(eager.folder)
    assert draft.compiled
    calls: list[int] = []
    step = draft._compiled
    draft._compiled = lambda parts: calls.append(sum(len(rows) for rows, _, _ in parts)) or step(parts)
    stats = check_identity(lm, draft, tiny_cases, 16, drafter="model", max_streams=3, timed=False)
    assert stats.holds > 0 and calls
    check_identity(lm, draft, tiny_cases, 16, drafter="model", max_streams=3, guard=False)  # timed: calibrated too
    # a one-position cache (reach 1: not a shape of the compiled step) runs eagerly, where it once crashed Dynamo
    lone = draft.forward([Rows(draft.new_cache(1), [3], 0, decode=True)])[0]
    assert torch.equal(lone, eager.forward([Rows(eager.new_cache(1), [3], 0)])[0])


def test_a_draft_model_that_cannot_compile_runs_eagerly(tiny, monkeypatch, caplog) -> None:
    def broken(self: Any, *args: Any) -> None:
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore")

    monkeypatch.setattr(LM, "step", broken)
    with caplog.at_level(logging.WARNING):
        draft = load_draft_model(tiny[1].folder)
    assert not draft.compile_enabled
    assert "running eagerly" in caplog.text and "No working C++ compiler" in caplog.text and "more" not in caplog.text


@pytest.fixture(scope="module")
def shipped() -> tuple[Any, Any]:
    try:
        lm = moelane.load()
    except Exception as e:  # the shipped model is not in this checkout yet
        pytest.skip(f"no shipped model: {e}")
    try:
        draft = load_draft_model()
    except Exception:
        draft = None
    return lm, draft


TEXTS = [
    "Once upon a time", "The capital of France is", "def add(a, b):", "1, 2, 3, 4, 5,",
    "Repeat after me: the cat sat on the mat. The cat sat", "In the beginning", "import numpy as np\n",
    "Q: What is two plus two?\nA:", "The quick brown fox", "Dear Sir or Madam,", "for i in range(10):",
    "It was the best of times, it was the worst of times, it was", "Rain", "Alice said to Bob", "Monday, Tuesday,",
    "ROMEO:\nBut soft, what light", "Hello! How are", "To be or not to be,", ":help buffers", "Chapter 1\n\n",
    "class Stack:\n    def push(self, x):", "One fish, two fish,", "*usr_01.txt*", "Edit: teh cat is hapy. Fixed:",
]  # fmt: skip
SHIPPED_TOKENS = 32


@pytest.fixture(scope="module")
def shipped_cases(shipped: tuple[Any, Any]) -> list[tuple[list[int], list[int]]]:
    lm, _ = shipped
    cases = []
    for i, text in enumerate(TEXTS):
        p = lm.tokenizer.encode(text)
        cases.append((p, list(lm.generate_ids(p, SHIPPED_TOKENS, params_of(i)))))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("guard", [False, True])
@pytest.mark.parametrize("drafter", ["none", "copy", "recall", "model"])
def test_shipped_model_replies_equal_solo_decode(shipped, shipped_cases, drafter: str, guard: bool) -> None:
    """The acceptance matrix: 24 varied prompts (half greedy, half seeded sampling) at 1, 2, 4, 8, 16 streams."""
    lm, draft = shipped
    if drafter == "model" and draft is None:
        pytest.skip("no shipped draft model")
    for n_streams in (1, 2, 4, 8, 16):
        check_identity(lm, draft, shipped_cases, SHIPPED_TOKENS, drafter=drafter, guard=guard, max_streams=n_streams)


def test_compiled_model_replies_equal_its_compiled_solo_decode(tiny, tmp_path: Path) -> None:
    """With the decode step compiled, every generated row (a stream's next token and its drafts) runs through it,
    all streams' rows in one call, and prompt rows share eager passes: replies equal the compiled `generate_ids`
    alone, at one stream and at four with prompts prefilled in chunks beside decoding streams, plain and drafted,
    with two cache capacities (pools) in one round."""
    lm = moelane.load(tiny[0].folder, compile=True)
    calls: list[int] = []
    step = lm._compiled
    assert step is not None
    lm._compiled = lambda parts: calls.append(sum(len(rows) for rows, _, _ in parts)) or step(parts)
    lengths = [16 + 300 * (i == 1) for i in range(6)]  # one stream's cache has another capacity: the same graph
    cases = [(p, list(lm.generate_ids(p, n, params_of(i))))
             for i, (p, n) in enumerate(zip(prompts(6, lm.vocab_size), lengths, strict=True))]  # fmt: skip
    assert set(calls) == {1}
    configs = [
        dict(max_streams=1),
        dict(max_streams=4, prefill_chunk=5),
        dict(drafter="copy", max_streams=4),
        dict(drafter="recall", max_streams=6, timed=False),
        dict(drafter="model", max_streams=3, timed=False),
    ]
    for config in configs:
        calls.clear()
        engine = Engine(lm, EngineConfig(**config), draft=tiny[1])
        pairs = enumerate(zip(cases, lengths, strict=True))
        streams = [engine.submit(p, n, **submit_kwargs(params_of(i))) for i, ((p, _), n) in pairs]
        engine.run_until_idle()
        for i, (stream, (_, expected)) in enumerate(zip(streams, cases, strict=True)):
            assert stream.token_ids == expected, f"prompt {i} with {config}"
        if config["max_streams"] > 1:
            assert max(calls) > 2, f"rows were not batched with {config}"
        if config.get("drafter") == "model":  # table prices: drafts surely held
            assert engine.stats().holds > 0

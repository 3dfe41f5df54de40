"""Model core: loading (and every way a model folder can be bad), generation, sampling, batch invariance."""

from __future__ import annotations

import functools
import itertools
import json
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import moelane
from moelane.commands import build_parser, main
from moelane.errors import InputError, ModelLoadError
from moelane.lanes.drafters import CopyDrafter, ModelDrafter
from moelane.model.attention import reach
from moelane.model.cache import KVCache, KVPool, Rows
from moelane.model.sampling import SamplingParams, adjusted, argmax, argmax_rows, sample
from moelane.model.tokenizer import StopFilter
from tests.helpers import random_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_model("qwen3_moe", tmp_path_factory.mktemp("q3"))


@pytest.fixture(scope="module")
def lm(folder: Path) -> moelane.LM:
    return moelane.load(folder)


@pytest.fixture(scope="module")
def long_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model with a context of 2,048 positions: caches long enough that attention's reach varies."""
    return random_model("qwen3_moe", tmp_path_factory.mktemp("q3long"), max_position_embeddings=2048, head_dim=32)


def broken_copy(folder: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(folder, dst)
    return dst


def cli_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moelane: error:"), err
    return err[0]


# ---- bad model folders: one clear line, exit code 2 ------------------------------------------------------------


def test_missing_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "not found" in cli_error(["run", "--model", str(tmp_path / "nope"), "hi"], capsys)


def test_missing_config(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = broken_copy(folder, tmp_path)
    (bad / "config.json").unlink()
    assert "config.json not found" in cli_error(["run", "--model", str(bad), "hi"], capsys)


def test_invalid_config(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = broken_copy(folder, tmp_path)
    (bad / "config.json").write_text("{not json")
    assert "not valid JSON" in cli_error(["run", "--model", str(bad), "hi"], capsys)


def test_config_missing_field(folder: Path, tmp_path: Path) -> None:
    bad = broken_copy(folder, tmp_path)
    config = json.loads((bad / "config.json").read_text())
    del config["hidden_size"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="hidden_size"):
        moelane.load(bad)


def test_unknown_model_type(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = broken_copy(folder, tmp_path)
    config = json.loads((bad / "config.json").read_text())
    config["model_type"] = "gpt9"
    (bad / "config.json").write_text(json.dumps(config))
    line = cli_error(["run", "--model", str(bad), "hi"], capsys)
    assert "gpt9" in line and "qwen3_moe" in line and "mixtral" in line


def shard_into_two(folder: Path) -> list[Path]:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, folder / file, metadata={"format": "pt"})
    (folder / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return [folder / f for f in halves]


def test_sharded_checkpoint_loads_same(folder: Path, lm: moelane.LM, tmp_path: Path) -> None:
    sharded = broken_copy(folder, tmp_path)
    shard_into_two(sharded)
    ids = list(range(5, 40))
    assert torch.equal(moelane.load(sharded).logits(ids), lm.logits(ids))


def test_missing_shard(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = broken_copy(folder, tmp_path)
    shard_into_two(bad)[1].unlink()
    assert "missing shard model-00002-of-00002.safetensors" in cli_error(["run", "--model", str(bad), "hi"], capsys)


def test_truncated_shard(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = broken_copy(folder, tmp_path)
    shard = bad / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    assert "truncated shard model.safetensors" in cli_error(["run", "--model", str(bad), "hi"], capsys)


def test_corrupt_header(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = broken_copy(folder, tmp_path)
    shard = bad / "model.safetensors"
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    data[8 : 8 + n] = b"\xff" * n
    shard.write_bytes(bytes(data))
    assert "corrupt safetensors header" in cli_error(["run", "--model", str(bad), "hi"], capsys)


def test_shape_disagrees_with_config(folder: Path, tmp_path: Path) -> None:
    bad = broken_copy(folder, tmp_path)
    config = json.loads((bad / "config.json").read_text())
    config["moe_intermediate_size"] += 1
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="implies"):
        moelane.load(bad)
    config["moe_intermediate_size"] -= 1
    config["intermediate_size"] += 2  # the dense layer's MLP
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"mlp.*implies"):
        moelane.load(bad)


def test_missing_tokenizer(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = broken_copy(folder, tmp_path)
    (bad / "tokenizer.json").unlink()
    assert "tokenizer.json not found" in cli_error(["run", "--model", str(bad), "hi"], capsys)


def test_prompt_longer_than_context(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    long_prompt = "To be, or not to be " * 400
    assert "does not fit" in cli_error(["run", "--model", str(folder), long_prompt], capsys)


def test_threads_option(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "--threads must be at least 1" in cli_error(["run", "--model", str(folder), "--threads", "0", "hi"], capsys)
    before = torch.get_num_threads()
    try:
        assert main(["run", "--model", str(folder), "--threads", "1", "--max-tokens", "2", "hi"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_eager_flag_turns_compilation_off() -> None:
    parse = build_parser().parse_args
    assert parse(["run", "hi"]).compile == "auto"
    assert parse(["run", "--eager", "hi"]).compile == "off"
    with pytest.raises(SystemExit):  # one or the other
        parse(["run", "--compile", "on", "--eager", "hi"])


# ---- generation ------------------------------------------------------------------------------------------------


def test_cli_run_streams_reply_and_summary(folder: Path, lm: moelane.LM, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--model", str(folder), "--max-tokens", "12", "def fib"]) == 0
    out, err = capsys.readouterr()
    assert out.rstrip("\n") == lm.generate("def fib", max_tokens=12)
    assert "prompt" in err and "decode" in err and "tok/s" in err


@pytest.mark.parametrize("drafter", ["copy", "model"])
def test_cli_run_with_a_drafter_prints_the_very_same_reply(
    drafter: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`run --drafter` verifies drafts several tokens a round through the lanes engine (shipped model and draft):
    greedy and seeded sampled replies are those of one-token steps, and drafts were made."""
    cls = {"copy": CopyDrafter, "model": ModelDrafter}[drafter]
    proposals: list[int] = []
    real = cls.propose
    monkeypatch.setattr(cls, "propose", lambda self, *a: proposals.append(1) or real(self, *a))  # type: ignore[func-returns-value]
    lm = moelane.load()
    prompt = "the cat sat on the mat. the cat sat on the mat. the cat sat"
    for extra, params in (
        ([], SamplingParams()),
        (["--temperature", "0.8", "--seed", "5"], SamplingParams(0.8, seed=5)),
    ):
        assert main(["run", "--eager", "--drafter", drafter, "--max-tokens", "40", *extra, prompt]) == 0
        want = lm.tokenizer.decode(list(lm.generate_ids(lm.tokenizer.encode(prompt), 40, params)))
        assert capsys.readouterr().out.rstrip("\n") == want
    assert proposals


def test_cli_run_with_a_drafter_says_a_failed_pass_in_one_line(
    folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pass that fails mid-reply (a shard found truncated, say) ends the run with its error in one line, as
    without a drafter: not the engine's logged tracebacks."""
    real, calls = moelane.LM.forward, [0]

    def failing(self: moelane.LM, *a: Any, **k: Any) -> Any:
        calls[0] += 1
        if calls[0] > 20:  # (the engine's price calibration makes 14 passes first)
            raise ModelLoadError("truncated shard model.safetensors: expert 3 of layer 1 ends at byte 12")
        return real(self, *a, **k)

    monkeypatch.setattr(moelane.LM, "forward", failing)
    run = ["run", "--model", str(folder), "--eager", "--drafter", "copy", "--max-tokens", "40", "hi"]
    assert "expert 3 of layer 1" in cli_error(run, capsys)
    assert "--trace records one token a step" in cli_error([*run, "--trace", "t.trc"], capsys)


def test_cli_run_takes_logit_bias_and_penalties(
    folder: Path, lm: moelane.LM, capsys: pytest.CaptureFixture[str]
) -> None:
    """`run`'s logit bias and penalties give what `generate_ids` gives with them, sampled with a seed drawn at
    random too (where they were once dropped); bad values are one-line errors."""
    prompt = lm.tokenizer.encode("def fib")
    greedy = list(lm.generate_ids(prompt, 12))
    banned = greedy[0]
    args = ["run", "--model", str(folder), "--max-tokens", "12", "--logit-bias", f"{banned}=-100",
            "--presence-penalty", "1.5", "--frequency-penalty", "0.5", "def fib"]  # fmt: skip
    assert main(args) == 0
    params = SamplingParams(logit_bias=((banned, -100.0),), presence_penalty=1.5, frequency_penalty=0.5)
    reply = list(lm.generate_ids(prompt, 12, params))
    assert reply != greedy and banned not in reply
    assert capsys.readouterr().out.rstrip("\n") == lm.tokenizer.decode(reply)
    forced = ["run", "--model", str(folder), "--max-tokens", "6", "--temperature", "1", "--logit-bias",
              f"{banned}=100", "def fib"]  # fmt: skip
    assert main(forced) == 0
    assert capsys.readouterr().out.rstrip("\n") == lm.tokenizer.decode([banned] * 6)
    for bad, message in (("7", "ID=BIAS"), ("x=1", "ID=BIAS"), ("7=500", "[-100, 100]"), ("999999=1", "vocabulary")):
        assert message in cli_error(["run", "--model", str(folder), "--logit-bias", bad, "hi"], capsys)
    assert "[-2, 2]" in cli_error(["run", "--model", str(folder), "--presence-penalty", "3", "hi"], capsys)


@pytest.mark.parametrize(
    "flag, value",
    [("--temperature", "-1"), ("--top-p", "0"), ("--top-k", "-1"), ("--max-tokens", "0"),
     ("--presence-penalty", "3"), ("--frequency-penalty", "-2.5"), ("--logit-bias", "5=101"),
     ("--logit-bias", "999999=1")],
)  # fmt: skip
def test_cli_run_errors_name_the_flag(folder: Path, flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad sampling setting is refused in the words of the flag the user typed, not the API's field name."""
    assert cli_error(["run", "--model", str(folder), flag, value, "hi"], capsys).startswith(f"moelane: error: {flag} ")


def test_cli_run_takes_bytes_that_are_not_utf8(
    folder: Path, lm: moelane.LM, capsys: pytest.CaptureFixture[str]
) -> None:
    """A prompt with bytes that are not UTF-8 (Python hands them over as lone surrogates) is read as U+FFFD, as an
    editor shows it: no traceback."""
    assert main(["run", "--model", str(folder), "--max-tokens", "3", "def f\udcff"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == lm.generate("def f\ufffd", max_tokens=3)
    with pytest.raises(InputError, match="lone surrogate"):
        lm.tokenizer.encode("a\ud800")


def test_cli_pager_options_on_a_dense_model_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dense = random_model("llama", tmp_path / "llama")
    capsys.readouterr()  # transformers' progress bar while saving
    for option in (["--expert-memory", "50%"], ["--default-tier", "int8"], ["--trace", str(tmp_path / "t.bin")]):
        assert "no experts" in cli_error(["run", "--model", str(dense), "--max-tokens", "2", "hi", *option], capsys)


def test_chunked_prefill_matches_whole(lm: moelane.LM) -> None:
    ids = [(i * 7) % 290 for i in range(50)]
    whole = list(lm.generate_ids(ids, 10, prefill_chunk=512))
    assert list(lm.generate_ids(ids, 10, prefill_chunk=7)) == whole


def test_rows_are_batch_invariant(lm: moelane.LM) -> None:
    """A stream's logits are bit-identical alone, chunked, batched with other streams, or as drafted rows."""
    a, b, extra = list(range(3, 40)), list(range(100, 120)), [5, 6, 7, 8]
    cache = lm.new_cache(256)
    solo = [lm.forward([Rows(cache, a, 0)])[0][-1]]
    solo += [lm.forward([Rows(cache, [t], 37 + i)])[0][0] for i, t in enumerate(extra)]
    ca, cb = lm.new_cache(256), lm.new_cache(256)
    lm.forward([Rows(ca, a[:13], 0), Rows(cb, b, 0)])
    last = lm.forward([Rows(cb, [3], 20), Rows(ca, a[13:], 13)])[1][-1:]
    drafted = lm.forward([Rows(ca, extra, 37), Rows(cb, [4, 5, 6], 21)])[0]
    assert torch.equal(torch.cat([last, drafted]), torch.stack(solo))


@pytest.fixture(scope="module")
def long_sinks_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpt-oss with a context of 2,048 positions: attention sinks and sliding windows, reaches that vary."""
    return random_model("gpt_oss", tmp_path_factory.mktemp("gptosslong"), max_position_embeddings=2048,
                        sliding_window=30)  # fmt: skip


@pytest.mark.parametrize("model", ["long_folder", "long_sinks_folder"])
def test_attention_reads_as_far_as_the_rows_reach_bit_for_bit(model: str, request: pytest.FixtureRequest) -> None:
    """Attention reads a cache up to the rows' reach (their last position rounded up to 512), not its capacity; a
    stream's logits are the same bits whether its pass reads 512 positions (alone) or 1,536 (beside a stream 1,100
    positions further), for decode rows, drafts and prefill chunks, and beside streams of another capacity; with
    attention sinks too."""
    assert reach(40, 2048) == 512 and reach(513, 2048) == 1024 and reach(1500, 1536) == 1536 and reach(9, 256) == 256
    lm = moelane.load(request.getfixturevalue(model))
    a, far = list(range(3, 43)), [(i * 7) % 290 for i in range(1100)]
    solo_cache = lm.new_cache(2048)
    solo = [lm.forward([Rows(solo_cache, a[:30], 0)])[0], lm.forward([Rows(solo_cache, a[30:], 30)])[0]]
    solo += [lm.forward([Rows(solo_cache, [5, 6, 7], 40)])[0]]
    ca, cb, cc = lm.new_cache(2048), lm.new_cache(2048), lm.new_cache(1024)
    for start in range(0, len(far), 256):
        lm.forward([Rows(cb, far[start : start + 256], start)])
    lm.forward([Rows(cc, far[:600], 0)])
    got = [lm.forward([Rows(ca, a[:30], 0), Rows(cb, [9], 1100)])[0]]  # chunk beside a decode row far ahead
    got += [lm.forward([Rows(cb, [10], 1101), Rows(ca, a[30:], 30), Rows(cc, [4, 4], 600)])[1]]
    got += [lm.forward([Rows(ca, [5, 6, 7], 40), Rows(cb, [11, 12, 13], 1102)])[0]]  # one uniform group
    for alone, shared in zip(solo, got, strict=True):
        assert torch.equal(alone, shared)


def test_streams_attend_in_one_batched_call_bit_for_bit(lm: moelane.LM) -> None:
    """Streams sharing a cache capacity attend in one batched call; each stream's logits equal its solo pass, for
    decode rows, drafted windows and prefill chunks, and beside streams of another capacity."""
    prompts = [[(i * 11 + j * 3) % 290 for j in range(5 + 3 * i)] for i in range(6)]
    caps = [256, 256, 256, 512, 256, 512]
    solo, caches = [], []
    for p, cap in zip(prompts, caps, strict=True):
        cache = lm.new_cache(cap)
        solo.append(lm.forward([Rows(cache, p, 0)])[0])
        solo[-1] = torch.cat([solo[-1], lm.forward([Rows(cache, [7, 8, 9][: 1 + len(p) % 3], len(p))])[0]])
        caches.append(lm.new_cache(cap))
    together = lm.forward([Rows(c, p, 0) for c, p in zip(caches, prompts, strict=True)])
    step = lm.forward([Rows(c, [7, 8, 9][: 1 + len(p) % 3], len(p)) for c, p in zip(caches, prompts, strict=True)])
    for alone, first, second in zip(solo, together, step, strict=True):
        assert torch.equal(alone, torch.cat([first, second]))


def test_decode_rounds_read_caches_in_place_or_stacked_bit_for_bit(folder: Path) -> None:
    """A decode round's streams attend over their caches read in place when they hold a run of their pool's slots
    (in slot order or not) and over gathered copies when they do not, also beside another pool's streams (one
    with two rows); each stream's logits equal its solo pass."""
    lm = moelane.load(folder)  # pools of its own: four caches hold slots 0-3
    prompts = [[(i * 13 + j * 5) % 290 for j in range(9 + 4 * i)] for i in range(4)]

    def solo_steps(capacity: int) -> list[torch.Tensor]:
        """Each prompt's next-token logits from a cache of `capacity`, alone (the cache is given back after)."""
        out = []
        for p in prompts:
            cache = lm.new_cache(capacity)
            lm.forward([Rows(cache, p, 0)])
            out.append(lm.forward([Rows(cache, [7], len(p))])[0])
        return out

    solo = solo_steps(256)
    # a run in slot order, a run out of it, and slots with a gap
    for members in ([0, 1, 2, 3], [2, 0, 3, 1], [3, 0, 2]):
        caches = sorted((lm.new_cache(256) for _ in prompts), key=lambda c: c.slot)
        assert [c.slot for c in caches] == [0, 1, 2, 3]
        for i, p in enumerate(prompts):
            lm.forward([Rows(caches[i], p, 0)])
        step = lm.forward([Rows(caches[i], [7], len(prompts[i])) for i in members])
        for i, logits in zip(members, step, strict=True):
            assert torch.equal(logits, solo[i])
        del caches  # the pool goes back to its first size
    # beside streams of another pool, interleaved: each pool's streams read their run of slots in place
    wide = solo_steps(512)
    narrow = sorted((lm.new_cache(256) for _ in prompts), key=lambda c: c.slot)
    broad = sorted((lm.new_cache(512) for _ in prompts[:3]), key=lambda c: c.slot)
    for i, p in enumerate(prompts):
        lm.forward([Rows(narrow[i], p, 0)] + ([Rows(broad[i], p, 0)] if i < 3 else []))
    order = [(narrow, 0), (broad, 1), (narrow, 2), (broad, 0), (narrow, 1), (narrow, 3), (broad, 2)]
    step = lm.forward([Rows(caches[i], [7, 8][: 1 + (caches is broad and i == 1)], len(prompts[i]))
                       for caches, i in order])  # fmt: skip
    for (caches, i), logits in zip(order, step, strict=True):
        assert torch.equal(logits[:1], (wide if caches is broad else solo)[i])


@pytest.mark.parametrize("threads", [1, pytest.param(2, marks=pytest.mark.slow)])  # (2 threads: in the slow set)
def test_compiled_rows_do_not_depend_on_what_shares_the_call(folder: Path, threads: int) -> None:
    """Through the compiled decode step, a stream's generated rows are bit-identical decoded one token at a time
    alone, and as rows among 1 to 23 others (other streams of its pool and of another pool, its own drafts, a call
    split over two), so drafts verified in one call give what one-token steps give. Rows of both pools share a call
    (so a round reads each expert once), up to 16 rows a call."""
    lm = moelane.load(folder, compile=True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = list(range(3, 40))
        extra = [(7 * i + 5) % 290 for i in range(12)]
        cache = lm.new_cache(256)
        lm.forward([Rows(cache, a, 0)])
        solo = torch.stack([lm.step(t, len(a) + i, cache) for i, t in enumerate(extra)])
        others = [(lm.new_cache(256 if i % 2 else 512), [(i * 13 + j) % 290 for j in range(9)]) for i in range(10)]
        for c, p in others:
            lm.forward([Rows(c, p, 0)])
        ca = lm.new_cache(256)
        lm.forward([Rows(ca, a, 0)])
        got, fed, calls = [], 0, []
        step = lm._compiled
        lm._compiled = lambda parts: (calls.append(len(parts)), step(parts))[1]
        for n_own, n_others in ((1, 0), (1, 1), (1, 4), (1, 10), (8, 10)):  # the last: 8 + 10 + 5 rows, split
            rows = [Rows(ca, extra[fed : fed + n_own], len(a) + fed, decode=True)]
            rows += [Rows(c, p[: 1 + k % 2], 9 + fed, decode=True) for k, (c, p) in enumerate(others[:n_others])]
            got.append(lm.forward(rows)[0])
            fed += n_own
        assert torch.equal(torch.cat(got), solo)
        assert calls == [1, 2, 2, 2, 1, 2]  # pools each call read: 1 row; 2; 5; 16; 23 (18 of one pool first)
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow  # (a compiled step of its own, ~10 s: the compiled steps are all in the slow set)
@pytest.mark.parametrize("threads", [1, 2])
def test_compiled_rows_do_not_depend_on_how_far_the_call_reads(long_folder: Path, threads: int) -> None:
    """A call's attention reads every row's cache as far as its furthest row reaches: a stream's compiled rows are
    the same bits read to 512 positions (alone) as beside a row 1,100 positions further on (1,536)."""
    lm = moelane.load(long_folder, compile=True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, extra, far = list(range(3, 40)), [17, 4, 250], [(7 * i) % 290 for i in range(1100)]
        cache = lm.new_cache(2048)
        lm.forward([Rows(cache, a, 0)])
        solo = torch.stack([lm.step(t, len(a) + i, cache) for i, t in enumerate(extra)])
        ca, cb = lm.new_cache(2048), lm.new_cache(2048)
        lm.forward([Rows(ca, a, 0)])
        for start in range(0, len(far), 256):
            lm.forward([Rows(cb, far[start : start + 256], start)])
        shared = lm.forward([Rows(ca, extra, len(a), decode=True), Rows(cb, [5], len(far), decode=True)])[0]
        assert torch.equal(shared, solo)
    finally:
        torch.set_num_threads(before)


def test_token_ids_out_of_range_are_refused_eager_and_compiled(folder: Path) -> None:
    """Prompt rows (eager) and generated rows (through the compiled step) alike: a clear InputError, not an index
    error inside a kernel."""
    lm = moelane.load(folder, compile=True)
    cache = lm.new_cache(256)
    for decode in (False, True):
        for bad in (lm.vocab_size, -1):
            with pytest.raises(InputError, match="out of range"):
                lm.forward([Rows(cache, [5, bad], 0, decode=decode)])


def test_max_tokens_and_eos(lm: moelane.LM) -> None:
    ids = list(range(10, 30))
    out = list(lm.generate_ids(ids, 8))
    assert len(out) <= 8
    first = out[0]
    assert list(lm.generate_ids(ids, 8, stop_ids=frozenset({first}))) == []
    with pytest.raises(InputError):
        list(lm.generate_ids(ids, 0))


@pytest.mark.slow  # (compiles with fullgraph: ~10-12 s on 2 cores)
def test_compiled_decode_has_no_graph_break(lm: moelane.LM) -> None:
    """The decode step compiles whole (fullgraph=True raises on any graph break), with the rows of one pool and of
    two, and its rows agree with eager."""
    import torch._dynamo

    torch._dynamo.reset()
    cache, other = lm.new_cache(256), lm.new_cache(512)
    ids = list(range(10, 30))
    eager_logits = lm.forward([Rows(cache, ids, 0)])[0][-1]
    lm.forward([Rows(other, ids, 0)])
    token = int(torch.argmax(eager_logits))
    step = torch.compile(lm._decode_step, fullgraph=True, dynamic=False)

    def part(c: KVCache, n: int) -> tuple[torch.Tensor, KVPool, torch.Tensor]:
        rows, keys = torch.tensor([[token, 20, c.slot]] * n), torch.arange(c.capacity if c.capacity < 512 else 512)
        torch._dynamo.decorators.mark_unbacked(rows, 0)
        torch._dynamo.decorators.mark_unbacked(keys, 0)
        return rows, c.pool, keys

    with torch.no_grad():
        compiled = step([part(cache, 2)])
        mixed = step([part(cache, 1), part(other, 2)])
    eager = lm.forward([Rows(cache, [token], 20)])[0][0]
    assert (compiled[0] - eager).abs().max() < 1e-4
    assert torch.equal(compiled[0], compiled[1])
    assert torch.equal(mixed[0], compiled[0]) and torch.equal(mixed[1], mixed[2])


@pytest.mark.slow  # (compiles two models: ~13-15 s)
def test_two_compiled_models_of_one_shape_keep_their_own_graphs(tmp_path: Path) -> None:
    """Two models whose guarded tensors have the same shapes but whose code differs (a dense qwen3, a qwen3_moe),
    compiled in one process: each decodes its own eager tokens. With one graph cache for both, the second ran the
    first one's graph (KeyError: 'gate_proj')."""
    prompt = list(range(10, 30))
    qwen3 = dict(tie_word_embeddings=True, attention_bias=True, use_sliding_window=True, sliding_window=20,
                 max_window_layers=1)  # fmt: skip
    for family, overrides in (("qwen3", qwen3), ("qwen3_moe", {})):
        lm = moelane.load(random_model(family, tmp_path / family, **overrides))
        eager = list(lm.generate_ids(prompt, 8))
        lm.enable_compile()
        assert list(lm.generate_ids(prompt, 8)) == eager, family


# ---- sampling and stop strings ---------------------------------------------------------------------------------


def test_sampling_is_a_function_of_seed_and_position() -> None:
    torch.manual_seed(0)
    logits = torch.randn(300)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    draws = [sample(logits, params, pos) for pos in range(200)]
    assert draws == [sample(logits, params, pos) for pos in range(200)]
    assert len(set(draws)) > 5
    other = [sample(logits, SamplingParams(temperature=0.8, top_p=0.9, seed=8), pos) for pos in range(200)]
    assert draws != other


def test_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    params = SamplingParams(temperature=1.0, seed=3)
    counts = torch.bincount(torch.tensor([sample(logits, params, p) for p in range(4000)]), minlength=4).float()
    assert torch.allclose(counts / 4000, torch.softmax(logits, 0), atol=0.03)


def test_top_k_and_top_p_cut_the_tail() -> None:
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    top_k = {sample(logits, SamplingParams(temperature=2.0, top_k=2, seed=1), p) for p in range(500)}
    assert top_k == {0, 1}
    top_p = {sample(logits, SamplingParams(temperature=1.0, top_p=0.5, seed=1), p) for p in range(500)}
    assert top_p == {0}  # p(0) = 0.64 >= 0.5
    assert sample(logits, SamplingParams(), 0) == 0


def test_logit_bias_and_penalties_adjust_as_openai_defines_them() -> None:
    """Against a per-token loop: bias added; presence subtracted once for a token the reply holds, frequency once
    per occurrence; tokens only in the prompt are not counted (the reply is what is passed)."""
    torch.manual_seed(1)
    logits = torch.randn(50)
    reply = [4, 9, 4, 4, 17]
    params = SamplingParams(logit_bias=((9, 2.5), (30, -100.0)), presence_penalty=0.7, frequency_penalty=0.4)
    expected = logits.clone()
    for token in range(50):
        expected[token] += dict(params.logit_bias).get(token, 0.0)
        n = reply.count(token)
        expected[token] -= (0.7 if n else 0.0) + 0.4 * n
    assert torch.allclose(adjusted(logits, params, reply), expected, atol=1e-6)
    assert adjusted(logits, SamplingParams(), reply) is logits  # nothing asked: untouched
    forced = SamplingParams(logit_bias=((11, 100.0),))
    assert {sample(logits, forced, p, reply) for p in range(20)} == {11}
    # A strong frequency penalty keeps greedy from repeating the last choice.
    z = torch.zeros(6)
    z[2] = 1.0
    params = SamplingParams(frequency_penalty=2.0)
    picks: list[int] = []
    for p in range(6):
        picks.append(sample(z, params, p, picks))
    assert picks[0] == 2 and picks.count(2) == 1
    with pytest.raises(ValueError, match="frequency_penalty"):
        SamplingParams(frequency_penalty=3.0)
    with pytest.raises(ValueError, match="distinct"):
        SamplingParams(logit_bias=((1, 1.0), (1, 2.0)))


def test_stop_filter_never_leaks_past_a_stop() -> None:
    f = StopFilter(["STOP", "\n\n"])
    pieces = ["hello S", "TO", "P world"]
    out = "".join(f.push(p) for p in pieces) + f.flush()
    assert out == "hello " and f.stopped
    g = StopFilter(["STOP"])
    assert "".join([g.push("a ST"), g.push("ar"), g.flush()]) == "a STar"


def test_stop_filter_holds_back_what_brute_force_holds_back() -> None:
    """Each push lets out what the plain rule does (hold the longest end of the text that begins a stop string), on
    random pieces over a small alphabet, where partial matches overlap and restart all the time."""
    import random

    def brute(stops: list[str], pieces: list[str]) -> list[str]:
        out, held = [], ""
        for piece in pieces:
            text = held + piece
            cut = min((i for s in stops if (i := text.find(s)) >= 0), default=-1)
            if cut >= 0:
                return [*out, text[:cut]]
            keep = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            held = text[len(text) - keep :] if keep else ""
            out.append(text[: len(text) - keep])
        return out

    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        pieces = ["".join(rng.choices("abc", k=rng.randint(0, 4))) for _ in range(rng.randint(1, 8))]
        f = StopFilter(stops)
        want = brute(stops, pieces)
        assert [f.push(p) for p in pieces[: len(want)]] == want, (stops, pieces)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pointwise_rows_do_not_depend_on_the_other_rows(dtype: torch.dtype, threads: int) -> None:
    """silu and sigmoid of a block of rows are bit-identical alone and among any number of other rows, across the
    sizes where PyTorch's kernels leave a scalar tail or split the range between threads (on AVX-512 plain F.silu
    differed in the last bit at some of these sizes)."""
    from moelane.model.layers import pointwise, silu_mul

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        width = 80  # with 64 rows of 80, plain F.silu differed from itself alone at every n_other here on AVX-512
        rows = torch.randn(64, width, generator=gen).to(dtype), torch.randn(64, width, generator=gen).to(dtype)
        alone = silu_mul(*rows), pointwise(torch.sigmoid, rows[0])
        for n_other in (1, 5, 8, 13, 55, 1371, 2731):
            others = [torch.randn(n_other, width, generator=gen).to(dtype) for _ in rows]
            g, u = (torch.cat([o, r]) for o, r in zip(others, rows, strict=True))
            assert torch.equal(silu_mul(g, u)[n_other:], alone[0]), n_other
            assert torch.equal(pointwise(torch.sigmoid, g)[n_other:], alone[1]), n_other
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_dispatch_equals_dispatch(dtype: torch.dtype) -> None:
    """Resident experts first, the late ones after `wait()`: the same bits as all at once; `wait` runs between. Also
    with one input per (token, expert) pair (Llama 4's, scaled by the router)."""
    from moelane.model.experts import dispatch, dispatch_staged

    gen = torch.Generator().manual_seed(1)
    n_slots, hidden, width, k = 7, 32, 16, 4
    w13 = torch.randn(n_slots, 2 * width, hidden, generator=gen).to(dtype)
    w2 = torch.randn(n_slots, hidden, width, generator=gen).to(dtype)
    for n_tokens in (1, 5, 19):
        x = torch.randn(n_tokens, hidden, generator=gen).to(dtype)
        slots = torch.stack([torch.randperm(n_slots, generator=gen)[:k] for _ in range(n_tokens)])
        weights = torch.rand(n_tokens, k, generator=gen)
        per_pair = torch.randn(n_tokens, k, hidden, generator=gen).to(dtype)
        for inputs, pending in itertools.product(
            (x, per_pair), (slots == 2, slots >= 0, torch.rand(n_tokens, k, generator=gen) < 0.4)
        ):
            calls: list[int] = []
            got = dispatch_staged(inputs, slots, pending, weights, w13, w2, functools.partial(calls.append, 1))
            assert calls == [1]
            assert torch.equal(got, dispatch(inputs, slots, weights, w13, w2))


@pytest.mark.parametrize("widths", [(40, 24), (36, 20)])  # (hidden, expert width); 36 bf16 values: 72 bytes a row
@pytest.mark.parametrize("n_slots", [6, 40])  # slots dense in their range (grouped product), sparse (per slot)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_one_linear_per_expert(dtype: torch.dtype, n_slots: int, widths: tuple[int, int]) -> None:
    """The eager dispatch's grouped products give each (token, expert) pair the bits of `expert_mlp` on that expert's
    rows alone: the tile rule holds through `torch._grouped_mm` and through one product per slot, for empty, partial
    and multi-tile groups, and for widths `torch._grouped_mm` refuses (rows not of whole 16-byte multiples)."""
    from moelane.model.experts import expert_mlp, grouped

    gen = torch.Generator().manual_seed(0)
    (hidden, width), k = widths, 3
    w13 = torch.randn(n_slots, 2 * width, hidden, generator=gen).to(dtype)
    w2 = torch.randn(n_slots, hidden, width, generator=gen).to(dtype)
    for n_tokens in (1, 3, 11, 40):
        x = torch.randn(n_tokens, hidden, generator=gen).to(dtype)
        flat = torch.stack([torch.randperm(n_slots - 1, generator=gen)[:k] for _ in range(n_tokens)]).reshape(-1)
        y = grouped(x, torch.arange(flat.numel()) // k, flat, w13, w2)
        for slot in range(n_slots):
            pairs = (flat == slot).nonzero().reshape(-1)
            if len(pairs):
                assert torch.equal(y[pairs], expert_mlp(x[pairs // k], w13[slot], w2[slot]))


def test_chat_templates_written_for_transformers_render(folder: Path, tmp_path: Path) -> None:
    """What templates in the wild use besides plain Jinja: loop controls, `{% generation %}` blocks,
    `strftime_now` (Llama 3.2 dates its system prompt) and `raise_exception` (Mixtral's alternating roles), whose
    message reaches the user as an InputError."""
    from moelane.model.tokenizer import Tokenizer

    dst = broken_copy(folder, tmp_path)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% if loop.index > 3 %}{% break %}{% endif %}"
        "{% if m.role == 'assistant' %}{% generation %}[a]{{ m.content }}{% endgeneration %}"
        "{% else %}[u]{{ m.content }}{% endif %}{% endfor %}"
        "{% if messages[-1].role == 'assistant' %}{{ raise_exception('the last message must be the user\\'s') }}"
        "{% endif %}|{{ strftime_now('%Y') | length }}"
    )
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(dst, frozenset())
    roles = ["system", "user", "assistant", "user", "assistant", "user"]
    messages = [{"role": r, "content": str(i)} for i, r in enumerate(roles)]
    assert tok.apply_chat_template(messages) == "[u]1[a]2|4"  # system skipped, stopped at the 4th
    with pytest.raises(InputError, match="refused the messages: the last message must be the user's"):
        tok.apply_chat_template(messages[:3])


def test_chat_templates_are_found_where_transformers_finds_them(folder: Path, tmp_path: Path) -> None:
    """`chat_template.jinja` (what transformers 5 saves, and GLM-4.5's repositories ship) wins over
    tokenizer_config.json's; a list of named templates gives its "default"; none at all is one clear InputError."""
    from moelane.model.tokenizer import Tokenizer

    messages = [{"role": "user", "content": "hi"}]
    dst = broken_copy(folder, tmp_path)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "[{{ messages[0].content }}]"}]
    (dst / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}))
    assert Tokenizer(dst, frozenset()).apply_chat_template(messages) == "[hi]"
    (dst / "chat_template.jinja").write_text("<{{ messages[0].content }}>", encoding="utf-8")
    assert Tokenizer(dst, frozenset()).apply_chat_template(messages) == "<hi>"
    # tojson as transformers renders it: plain JSON, not Jinja's HTML-escaped ASCII; json.dumps' options taken
    (dst / "chat_template.jinja").write_text("{{ messages[0] | tojson }}{{ messages | tojson(ensure_ascii=True) }}")
    assert Tokenizer(dst, frozenset()).apply_chat_template([{"role": "user", "content": "<é&'>"}]) == (
        '{"role": "user", "content": "<é&\'>"}[{"role": "user", "content": "<\\u00e9&\'>"}]'
    )
    (dst / "chat_template.jinja").write_text("{{ nothing | tojson }}")
    with pytest.raises(InputError, match="chat template failed: tojson: Object of type Undefined"):
        Tokenizer(dst, frozenset()).apply_chat_template(messages)
    (dst / "chat_template.jinja").unlink()
    (dst / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    with pytest.raises(InputError, match="this model has no chat template"):
        Tokenizer(dst, frozenset()).apply_chat_template(messages)


def test_a_cache_is_zeroed_as_far_as_passes_read_it(long_folder: Path) -> None:
    """A slot is zeroed block by block as its reach grows, not whole when taken (a cache reserving the whole
    context commits memory only for what its stream has used); whatever a freed slot held (NaN here) never reaches
    a pass: the logits equal those of a fresh cache, across reach blocks."""
    lm = moelane.load(long_folder)
    tokens = [(i * 5) % 290 for i in range(700)]
    fresh = lm.new_cache(2048)
    want = torch.cat([lm.forward([Rows(fresh, tokens[s : s + 256], s)])[0] for s in range(0, 700, 256)])
    pool = fresh.pool
    for t in (*pool.k.values(), *pool.v.values()):
        t[pool._free].fill_(float("nan"))  # garbage in every slot not taken
    cache = lm.new_cache(2048)
    got = [lm.forward([Rows(cache, tokens[:256], 0)])[0]]
    assert pool._clean[cache.slot] == 512  # only the first reach block
    got += [lm.forward([Rows(cache, tokens[s : s + 256], s)])[0] for s in range(256, 700, 256)]
    assert pool._clean[cache.slot] == 1024
    assert torch.equal(torch.cat(got), want)


# ---- the Python API against what users pass (found by trying it, 2026-12-03) ------------------------------------


def test_api_arguments_of_the_wrong_kind_are_input_errors_naming_them(lm: moelane.LM) -> None:
    ids = lm.tokenizer.encode("def add(a, b):")
    cases = [
        (lambda: lm.generate_ids(ids, 2.5), "max_tokens must be an integer"),  # (gave 3 tokens)
        (lambda: lm.generate_ids(ids, True), "max_tokens must be an integer"),
        (lambda: lm.generate_ids(ids, 3, prefill_chunk=-1), "prefill_chunk must be >= 1"),  # (UnboundLocalError)
        (lambda: lm.generate_ids(ids, 3, {"temperature": 0.5}), "params must be a SamplingParams"),
        (lambda: lm.generate(123), "prompt must be text"),  # (AttributeError: no encode)
        (lambda: lm.generate("hi", stop=123), "stop must be a string or a list of strings"),
        (lambda: lm.logits([1.5, 2.7]), "token ids must be integers"),  # (was silently [1, 2])
        (lambda: lm.logits(torch.tensor([], dtype=torch.long)), "empty prompt"),
    ]
    for call, message in cases:
        with pytest.raises(InputError, match=message):
            call()  # (checked at the call, not at the first token)
    assert torch.equal(lm.logits(torch.tensor(ids)), lm.logits(np.array(ids)))  # (tensors and arrays were refused)
    assert torch.equal(lm.logits(iter(ids)), lm.logits(ids))


def test_tiny_temperatures_choose_as_greedy_does(lm: moelane.LM) -> None:
    """logits / 1e-39 overflow float32: every token tied at infinity, and the reply was noise."""
    greedy = lm.generate("def fibonacci(n):", max_tokens=12)
    for t in (1e-6, 1e-39, 5e-324):
        assert lm.generate("def fibonacci(n):", max_tokens=12, temperature=t, seed=3) == greedy


def test_a_character_cut_off_by_max_tokens_ends_the_text_as_run_prints_it(lm: moelane.LM) -> None:
    from moelane.model.tokenizer import Detokenizer

    prompt = "日本語のテキスト:"
    for n in range(1, 24):
        ids = list(lm.generate_ids(lm.tokenizer.encode(prompt), n))
        whole = Detokenizer(lm.tokenizer)
        text = whole.push(ids) + whole.flush()
        assert lm.generate(prompt, max_tokens=n) == text, n  # (the cut-off character was dropped)


def test_a_closed_model_says_so(tmp_path: Path, folder: Path) -> None:
    """A paged LM used after close() waited forever on its store's stopped threads."""
    from moelane.errors import MoelaneError

    paged = moelane.load(folder, expert_memory="30%")
    assert paged.generate("hi", max_tokens=2)
    paged.close()
    paged.close()
    with pytest.raises(MoelaneError, match="closed"):
        paged.generate("hi", max_tokens=2)


def test_argmax_is_torchs_first_maximum() -> None:
    """sampling.argmax (NumPy on the CPU) chooses as torch.argmax: the lowest id on ties, a NaN where there is one."""
    g = torch.Generator().manual_seed(3)
    cases = [
        torch.randn(32000, generator=g),
        torch.tensor([1.0, 3.0, 3.0, 2.0]),
        torch.full((5,), float("-inf")),
        torch.tensor([1.0, float("nan"), 3.0, float("nan")]),
        torch.tensor([float("inf"), 2.0, float("inf")]),
    ]
    ties = torch.randint(0, 4, (4000,), generator=g).float()  # many ties at the maximum
    cases.append(ties)
    for logits in cases:
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            z = logits.to(dtype)
            assert argmax(z) == int(torch.argmax(z))
        block = torch.stack([logits, logits.flip(0)])
        assert argmax_rows(block) == block.argmax(-1).tolist()

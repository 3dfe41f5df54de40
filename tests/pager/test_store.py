"""The live expert store: tier-0 identity with the all-resident run at any budget, eviction order, pins, plans and
tiers, statistics, and clear errors for budgets that cannot work and for shards that go bad mid-run."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import moelane
import moelane.pager.live.store as store_module
from moelane.model import experts
from moelane.model.provider import ResidentProvider
from moelane.pager.live.build import format_stats, store_factory
from moelane.pager.live.memory import MemorySpec, parse_memory
from moelane.pager.live.storage import ExpertReadError
from moelane.pager.live.store import ExpertStore, StoreConfig, StoreError
from moelane.pager.live.tiers import ExpertCodec
from moelane.pager.plan import Plan
from tests.helpers import random_model

PROMPT = list(range(3, 40))
Reference = tuple[moelane.LM, list[int]]  # the all-resident LM and its greedy reply to PROMPT
WIDE = dict(num_hidden_layers=6, num_experts=16, num_experts_per_tok=2, mlp_only_layers=[])


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 MoE layers x 16 experts, top-2: 20% of expert bytes still holds one layer's experts."""
    return random_model("qwen3_moe", tmp_path_factory.mktemp("wide"), seed=1, **WIDE)


@pytest.fixture(scope="module")
def reference(wide: Path) -> Reference:
    lm = moelane.load(wide)
    return lm, list(lm.generate_ids(PROMPT, 24))


def store_of(lm: moelane.LM, n_slots: int, **kw: object) -> ExpertStore:
    """A store of exactly `n_slots` slots over `lm`'s experts."""
    hidden, width = lm.expert_handles[lm.moe_layers[0]][0].tensors["down"].shape
    budget = n_slots * 3 * hidden * width * lm.dtype.itemsize
    return ExpertStore(lm.expert_handles, lm.dtype, StoreConfig(budget_bytes=budget, **kw))  # type: ignore[arg-type]


# ---- identity with the all-resident run ----------------------------------------------------------------------------


@pytest.mark.parametrize(("share", "staged"), [("20%", True), ("50%", False), ("100%", False), ("20%", False)])
def test_greedy_tokens_identical_at_every_budget(
    wide: Path, reference: Reference, share: str, staged: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`staged`: misses load on the I/O threads while the resident experts compute (what experts of >= 1 MiB do)."""
    n_staged = []
    if staged:
        monkeypatch.setattr(store_module, "SMALL_EXPERT_BYTES", 0)
        plain, kernel = experts.staged_pairs, experts.kernel_pairs

        def kernel_staged(*a: Any) -> torch.Tensor:  # (the kernels' path stages when handed the pending pairs)
            if len(a) > 6 and a[6] is not None:
                n_staged.append(1)
            return kernel(*a)

        monkeypatch.setattr(experts, "staged_pairs", lambda *a: n_staged.append(1) or plain(*a))
        monkeypatch.setattr(experts, "kernel_pairs", kernel_staged)
    lm = moelane.load(wide, expert_memory=share)  # (its store attached: predictors, the live planner)
    store = lm.provider
    assert isinstance(store, ExpertStore)
    try:
        assert list(lm.generate_ids(PROMPT, 24)) == reference[1]
        assert list(lm.generate_ids(PROMPT[5:], 12, prefill_chunk=3)) == list(reference[0].generate_ids(PROMPT[5:], 12))
        assert store.live_planner is not None
        store.live_planner.wait()
        assert store.live_planner.n_segments > 0 and store.live_planner.n_plans > 0 and store.plan is not None
        store.check_invariants()
        assert bool(n_staged) == staged
        totals = store.stats.totals()
        assert totals.misses > 0 and (share == "100%") == (store.stats.evictions == 0)
        # every resident slot holds exactly what the resident provider holds
        resident = ResidentProvider.from_handles(lm.expert_handles, lm.dtype)
        for layer, expert, kind, (w13, w2) in held_experts(store):
            assert kind == "native"
            assert torch.equal(w13, resident.weights(layer)[0][expert])
            assert torch.equal(w2, resident.weights(layer)[1][expert])
    finally:
        lm.close()


def held_experts(store: ExpertStore) -> list[tuple[int, int, str, tuple[torch.Tensor, ...]]]:
    """(layer, expert, tier name, slot tensors) of every expert the store holds."""
    out = []
    for slot, key in enumerate(store.table.key.tolist()):
        if key >= 0:
            kind, parts = store.expert_parts(slot)
            out.append((store.layers[key // store.n_experts], key % store.n_experts, kind, parts))
    return out


def test_closing_the_lm_ends_its_stores_threads(wide: Path) -> None:
    """`LM.close()` (which `moelane run` and `serve` call before exiting) joins every thread of its store: fetches,
    predictors, the live planner. (One still in torch work at interpreter exit aborted ~1 run in 20.)"""
    before = set(threading.enumerate())
    lm = moelane.load(wide, expert_memory="30%")
    assert isinstance(lm.provider, ExpertStore)
    list(lm.generate_ids(PROMPT, 4))
    ours = [t for t in threading.enumerate() if t not in before and t.name.startswith("moelane-")]
    assert {t.name.rstrip("0123456789") for t in ours} >= {"moelane-fetch-", "moelane-cooc", "moelane-planner"}
    lm.close()
    assert [t.name for t in ours if t.is_alive()] == []


@pytest.mark.slow  # (compiles a model: ~15-25 s on 2 cores)
def test_compiled_decode_through_a_store_equals_its_solo_decode(wide: Path, reference: Reference) -> None:
    """Compiled with a store, the decode step hands back to Python at the residency check; an engine's streams (one
    row a call, as a lone stream's) reply what the compiled solo decode does, and that is the resident model's."""
    from moelane.lanes import Engine, EngineConfig

    lm = moelane.load(wide, provider=store_factory(parse_memory("50%"), None, "lru", "native"), compile=True)
    try:
        prompts = [PROMPT, PROMPT[7:], PROMPT[::2]]
        solo = [list(lm.generate_ids(p, 12)) for p in prompts]
        assert solo[0] == reference[1][:12]
        engine = Engine(lm, EngineConfig(drafter="copy", max_streams=3))
        streams = [engine.submit(p, 12) for p in prompts]
        engine.run_until_idle()
        assert [s.token_ids for s in streams] == solo
    finally:
        lm.provider.close()  # type: ignore[attr-defined]


def test_an_engine_fits_its_rounds_to_a_small_pool(
    wide: Path, reference: Reference, caplog: pytest.LogCaptureFixture
) -> None:
    """A pool that holds one layer's experts for 2 rows at a time (5 slots, top-2): the engine caps rows, streams per
    round and prefill chunks to it, so no round fails (a failed round would be logged and rerun one stream at a
    time), and 6 streams with drafts reply what the resident model does alone."""
    from moelane.lanes import Engine, EngineConfig

    lm = moelane.load(wide, provider=lambda handles, dtype: store_of_handles(handles, dtype, 5))
    try:
        assert lm.max_pass_rows() == 2
        engine = Engine(lm, EngineConfig(drafter="copy", max_streams=6))
        assert (engine.config.max_rows, engine.config.max_streams, engine.config.prefill_chunk) == (2, 2, 2)
        prompts = [PROMPT[i:] for i in range(6)]
        with caplog.at_level("ERROR", logger="moelane.lanes.engine"):
            streams = [engine.submit(p, 10) for p in prompts]
            engine.run_until_idle()
        assert not [r for r in caplog.records if r.levelname == "ERROR"]
        assert [s.token_ids for s in streams] == [list(reference[0].generate_ids(p, 10)) for p in prompts]
    finally:
        lm.provider.close()  # type: ignore[attr-defined]


def store_of_handles(handles: dict[int, list[Any]], dtype: torch.dtype, n_slots: int) -> ExpertStore:
    """A store of exactly `n_slots` slots over these expert handles (the loader's provider factory signature)."""
    hidden, width = next(iter(handles.values()))[0].tensors["down"].shape
    budget = n_slots * 3 * hidden * width * dtype.itemsize
    return ExpertStore(handles, dtype, StoreConfig(budget_bytes=budget))  # type: ignore[arg-type]


@pytest.mark.parametrize(("dtype", "host"), [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "10%")])
def test_every_read_path_fills_the_slots_exactly(
    wide: Path, dtype: torch.dtype, host: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 over this fp32 checkpoint reads straight into the slots; bf16 converts through a reused per-thread
    buffer; with a host cache, the stored forms are kept (and read back) as copies of their own."""
    import moelane.pager.live.storage as storage_module

    in_place: list[bool] = []
    plain = storage_module.read_in_place
    monkeypatch.setattr(storage_module, "read_in_place", lambda *a: in_place.append(plain(*a)) or in_place[-1])
    buffers: list[int] = []  # the conversion buffer handed out for each load
    scratch = storage_module.Storage._scratch
    monkeypatch.setattr(storage_module.Storage, "_scratch",
                        lambda self, n: buffers.append((b := scratch(self, n)).data_ptr()) or b)  # fmt: skip
    ref = moelane.load(wide, dtype)
    in_place.clear()  # (all-resident experts are read the same way: only the store's reads are counted)
    buffers.clear()
    factory = store_factory(parse_memory("20%"), host and parse_memory(host), "planner", "native")
    lm = moelane.load(wide, dtype, provider=factory)
    store = lm.provider
    assert isinstance(store, ExpertStore)
    try:
        assert list(lm.generate_ids(PROMPT, 12)) == list(ref.generate_ids(PROMPT, 12))
        if dtype == torch.float32 and host is None:
            assert in_place and all(in_place) and not buffers
        else:
            assert not any(in_place)
        if dtype == torch.bfloat16:  # one buffer per loading thread, reused for every later load on it
            assert len(buffers) == len(in_place) and len(set(buffers)) <= threading.active_count() < len(buffers)
        for layer, expert, _, (w13, w2) in held_experts(store):
            assert torch.equal(w13, ref.provider.weights(layer)[0][expert])
            assert torch.equal(w2, ref.provider.weights(layer)[1][expert])
    finally:
        store.close()


def test_lru_and_lfu_are_identical_too(wide: Path, reference: Reference) -> None:
    for policy in ("lru", "lfu"):
        lm = moelane.load(wide, provider=store_factory(parse_memory("30%"), parse_memory("10%"), policy, "0"))
        assert list(lm.generate_ids(PROMPT, 24)) == reference[1]
        lm.provider.close()  # type: ignore[attr-defined]


# ---- eviction order ------------------------------------------------------------------------------------------------


def call(store: ExpertStore, layer: int, experts: list[int]) -> None:
    store.slots(layer, torch.tensor([experts]))


def resident(store: ExpertStore, layer: int) -> set[int]:
    li = store.layers.index(layer)
    return {k % store.n_experts for k in store.table.key.tolist() if k >= 0 and k // store.n_experts == li}


def test_oldest_generation_evicted_first_and_a_layer_batch_keeps_its_hits(reference: Reference) -> None:
    lm = reference[0]
    store = store_of(lm, 6, io_threads=0)
    first, second = store.layers[0], store.layers[1]
    call(store, first, [0, 1, 2])  # generation 1
    call(store, second, [0, 1, 2])
    call(store, first, [0, 3])  # generation 2: 3 misses, the pool is full
    # victim: generation 1, least recently accessed -> layer `first` experts 1 or 2 (expert 0 was just used)
    assert resident(store, first) >= {0, 3} and len(resident(store, first) & {1, 2}) == 1
    assert resident(store, second) == {0, 1, 2}
    call(store, second, [0, 4, 5])  # two misses as one batch; its hit (0) survives, gen-2 layer-`first` stays
    assert 0 in resident(store, second) and {4, 5} <= resident(store, second)
    assert {0, 3} <= resident(store, first)
    store.check_invariants()
    store.close()


def test_pins_bias_and_hard(reference: Reference) -> None:
    lm = reference[0]
    first, second = lm.moe_layers[0], lm.moe_layers[1]
    for mode in ("bias", "hard"):
        store = store_of(lm, 4, io_threads=0)
        store.apply(Plan(budget_bytes=4 * store.slot_bytes, window_k=2, pins=((first, 7, None),), pin_mode=mode))
        call(store, first, [7, 1])
        for expert in range(2, 8):  # many later generations churn the pool
            call(store, first, [0, expert % 7])
            call(store, second, [expert])
        if mode == "hard":
            assert 7 in resident(store, first)
        store.check_invariants()
        store.close()
    # bias: a pinned expert outlives unpinned ones of up to 2 * window_k newer generations
    store = store_of(lm, 3, io_threads=0)
    store.apply(Plan(budget_bytes=3 * store.slot_bytes, window_k=2, pins=((first, 7, None),)))
    call(store, first, [7])
    call(store, first, [1])
    call(store, first, [2])
    call(store, first, [3])
    assert 7 in resident(store, first) and 1 not in resident(store, first)
    store.close()


def test_lfu_evicts_the_least_used(reference: Reference) -> None:
    store = store_of(reference[0], 2, io_threads=0, policy="lfu")
    first = store.layers[0]
    for _ in range(3):
        call(store, first, [5])
    call(store, first, [6])
    call(store, first, [7])  # evicts 6 (used once), keeps 5 (used thrice) although 5 is older
    assert resident(store, first) == {5, 7}
    store.close()


# ---- budgets, plans, tiers, statistics -----------------------------------------------------------------------------


def test_a_layer_call_larger_than_the_pool_is_a_clear_error(reference: Reference) -> None:
    store = store_of(reference[0], 2, io_threads=0)
    with pytest.raises(StoreError, match=rf"needs 3 experts at once \({3 * store.slot_bytes} bytes at their tiers\) "
                       rf"but the expert memory holds {2 * store.slot_bytes} bytes"):  # fmt: skip
        call(store, store.layers[0], [0, 1, 2])
    assert store.max_rows(top_k=2) == 1
    store.close()


def test_memory_specs_and_factory_errors() -> None:
    assert parse_memory("512MiB").resolve(0) == 512 * 2**20
    assert parse_memory("2GiB").resolve(0) == 2 * 2**30
    assert parse_memory("1.5GB").resolve(0) == 1_500_000_000
    assert parse_memory("25%").resolve(1000) == 250
    assert parse_memory("300000").resolve(7) == 300000
    assert str(MemorySpec(fraction=0.25)) == "25%"
    for bad in ("", "12XB", "-5MiB", "150%", "MiB"):
        with pytest.raises(ValueError):
            parse_memory(bad)
    with pytest.raises(StoreError, match="not a memory size"):
        moelane.load(expert_memory="lots")  # (refused before anything loads)
    with pytest.raises(StoreError, match="precision tier"):
        store_factory(parse_memory("50%"), None, "planner", "int3")
    with pytest.raises(StoreError, match="policy"):
        store_factory(parse_memory("50%"), None, "fifo", "0")
    assert "not in use" in format_stats(object())


def test_statistics_count_every_access_and_byte(wide: Path) -> None:
    lm = moelane.load(wide, provider=store_factory(parse_memory("40%"), parse_memory("100%"), "planner", "native"))
    store = lm.provider
    assert isinstance(store, ExpertStore)
    expert_bytes = lm.expert_handles[lm.moe_layers[0]][0].nbytes
    with store.track() as request:
        list(lm.generate_ids(PROMPT, 8))
    total = store.stats.totals()
    assert request.totals().misses == total.misses > 0
    assert set(store.stats.by_phase) == {"prefill", "decode"}
    store.wait_loads()
    n_read = sum(store.stats.reads.values())
    warm = store.stats.source("warm")  # no predictors attached: warm start only; a late one is read as a miss
    assert n_read == total.misses + warm.issued - warm.late - warm.dropped
    assert sum(store.stats.bytes_read.values()) == n_read * expert_bytes
    assert set(store.stats.read_s) == set(store.stats.reads) and min(store.stats.read_s.values()) > 0
    speed = store.stats.load_speed("disk")
    assert speed == store.stats.bytes_read[("disk", "native")] / store.stats.read_s[("disk", "native")]
    assert store.stats.load_speed("tape") is None  # a level nothing was read from
    disk_before = store.stats.bytes_read[("disk", "native")]
    list(lm.generate_ids(PROMPT, 8))  # the host cache holds every expert now
    assert store.stats.bytes_read[("disk", "native")] == disk_before
    assert store.stats.bytes_read[("host", "native")] > 0
    text = format_stats(store)
    assert "decode" in text and "read disk native" in text and "read host native" in text and "MB/s a thread" in text
    assert store.stats.to_dict()["total"]["misses"] == store.stats.totals().misses
    store.close()


def test_plan_tiers_decide_the_precision_of_each_fetch(wide: Path, reference: Reference) -> None:
    lm = moelane.load(wide, provider=store_factory(parse_memory("100%"), None, "planner", "native"))
    store = lm.provider
    assert isinstance(store, ExpertStore)
    first = lm.moe_layers[0]
    pins = tuple((first, e, 0) for e in range(store.n_experts))  # layer `first` stays exact, the rest int8
    store.apply(Plan(budget_bytes=store.config.budget_bytes, window_k=4, pins=pins, default_tier=1))
    list(lm.generate_ids(PROMPT, 4))
    reads = store.stats.reads
    assert reads[("disk", "int8")] > 0 and reads[("disk", "native")] > 0
    resident_pool = ResidentProvider.from_handles(lm.expert_handles, lm.dtype)
    for layer, expert, kind, parts in held_experts(store):
        assert kind == ("native" if layer == first else "int8")
        assert kind == "int8" or torch.equal(parts[0], resident_pool.weights(layer)[0][expert])
    hidden, width = lm.expert_handles[first][0].tensors["down"].shape
    stored = store.stats.bytes_read[("disk", "int8")] / reads[("disk", "int8")]
    assert stored == ExpertCodec(1, width, hidden).nbytes
    store.close()


def test_warm_start_at_the_prefill_decode_boundary(wide: Path) -> None:
    lm = moelane.load(wide, provider=store_factory(parse_memory("30%"), None, "planner", "native"))
    store = lm.provider
    assert isinstance(store, ExpertStore)
    list(lm.generate_ids(PROMPT, 6, prefill_chunk=8))
    assert store.stats.source("warm").issued > 0
    store.close()


# ---- storage going bad mid-run -------------------------------------------------------------------------------------


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def shard_of(folder: Path) -> Path:
    return next(folder.glob("*.safetensors"))


def test_truncated_shard_mid_run_names_file_and_expert(wide: Path, tmp_path: Path) -> None:
    folder = copy_model(wide, tmp_path / "m")
    lm = moelane.load(folder, provider=store_factory(parse_memory("20%"), None, "planner", "0"))
    list(lm.generate_ids(PROMPT, 2))
    os.truncate(shard_of(folder), shard_of(folder).stat().st_size // 2)
    with pytest.raises(ExpertReadError, match=r"expert \d+ of layer \d+: .*model\.safetensors"):
        list(lm.generate_ids(PROMPT[::-1], 8))
    lm.provider.close()  # type: ignore[attr-defined]


def test_rewritten_shard_mid_run_is_detected(wide: Path, tmp_path: Path) -> None:
    folder = copy_model(wide, tmp_path / "m")
    lm = moelane.load(folder, provider=store_factory(parse_memory("20%"), None, "planner", "0"))
    list(lm.generate_ids(PROMPT, 2))
    shard = shard_of(folder)
    data = bytearray(shard.read_bytes())
    data[-4096:] = bytes(4096)  # same size, different bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(ExpertReadError, match="changed on disk"):
        list(lm.generate_ids(PROMPT[::-1], 8))
    lm.provider.close()  # type: ignore[attr-defined]


def test_non_finite_expert_weights_are_rejected(wide: Path, tmp_path: Path) -> None:
    folder = copy_model(wide, tmp_path / "m")
    lm = moelane.load(folder)
    ref = lm.expert_handles[lm.moe_layers[2]][5].tensors["down"]
    with open(ref.path, "r+b") as f:
        f.seek(ref.offset)
        f.write(torch.full((4,), float("nan")).numpy().tobytes())
    lm = moelane.load(folder, provider=store_factory(parse_memory("100%"), None, "planner", "0"))
    with pytest.raises(ExpertReadError, match=f"expert 5 of layer {lm.moe_layers[2]}: non-finite"):
        list(lm.generate_ids(list(range(3, 200)), 4))
    lm.provider.close()  # type: ignore[attr-defined]


def test_cli_reports_a_corrupt_expert_in_one_line(
    wide: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from moelane.commands import main

    folder = copy_model(wide, tmp_path / "m")
    lm = moelane.load(folder)
    for expert in range(16):  # every expert of one layer: whatever the prompt routes to is corrupt
        ref = lm.expert_handles[lm.moe_layers[1]][expert].tensors["gate"]
        with open(ref.path, "r+b") as f:
            f.seek(ref.offset)
            f.write(torch.full((8,), float("inf")).numpy().tobytes())
    args = ["run", "--model", str(folder), "--expert-memory", "50%", "--max-tokens", "4", "hello"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"of layer {lm.moe_layers[1]}: non-finite weights read from {folder}" in err[0]

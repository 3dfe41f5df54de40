"""The store's device level (transfer.py): loads through pinned staging buffers and one copy stream, an event per
slot, compute waiting for exactly the slots it is handed that are still being copied, and no copy into a slot before
the kernels of its last leases. On the CPU the device is simulated (`SimDevice`): a copy runs only when something
waits for it, reading its staging buffer then, so a missing wait or a staging buffer reused too early shows up as
wrong bytes. With CUDA, a real store on the GPU."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import moelane
import moelane.pager.live.store as store_module
from moelane.model.provider import ResidentProvider
from moelane.pager.live.build import resident_at_tier, store_factory
from moelane.pager.live.memory import parse_memory
from moelane.pager.live.store import ExpertStore, StoreConfig, StoreError
from moelane.pager.live.transfer import DeviceTransfer, Transfer, on_device
from tests.helpers import random_model

PROMPT = list(range(3, 40))
WIDE = dict(num_hidden_layers=4, num_experts=16, num_experts_per_tok=2, mlp_only_layers=[])


# ---- a simulated device ---------------------------------------------------------------------------------------------


class SimEvent:
    def __init__(self, sim: SimDevice) -> None:
        self.sim, self.done, self.stream = sim, False, None

    def record(self, stream: Any = None) -> None:
        self.stream = stream
        if stream is self.sim.copy_stream:
            with self.sim.lock:
                self.done = False
                self.sim.queue.append(self)
        else:  # (compute runs synchronously here: what it enqueued has run)
            self.done = True

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.sim.run_until(self)


class SimStream:
    def __init__(self, sim: SimDevice, name: str) -> None:
        self.sim, self.name = sim, name

    def wait_event(self, event: Any) -> None:
        with self.sim.lock:
            self.sim.log.append((self.name, "wait", event))
            if self is not self.sim.copy_stream and event.done:
                self.sim.needless += 1
        if self is not self.sim.copy_stream:
            self.sim.run_until(event)  # (what a compute stream waits for has landed before it computes on)


class SimCopy:
    """A queued copy: runs when the copy stream gets to it, reading its sources then."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pairs = pairs
        self.targets = {dst.data_ptr() for dst, _ in pairs}

    def run(self) -> None:
        for dst, src in self.pairs:
            dst.copy_(src)


class SimDevice:
    """`DeviceOps` on the CPU: the copy stream is a queue that runs only as far as something waits (a compute stream's
    `wait_event`, an event's `synchronize`) or `advance` says; a compute stream per thread."""

    def __init__(self, seed: int = 0, progress: float = 0.0) -> None:
        self.lock = threading.RLock()
        self.queue: list[SimCopy | SimEvent] = []
        self.log: list[tuple[str, str, Any]] = []
        self.copy_stream = SimStream(self, "copy")
        self.streams = threading.local()
        self.pinned_sizes: list[int] = []
        self.needless = 0  # compute waits for an event already complete
        self.rng, self.progress = np.random.default_rng(seed), progress

    def new_stream(self) -> SimStream:
        return self.copy_stream

    def current_stream(self) -> SimStream:
        stream = getattr(self.streams, "stream", None)
        if stream is None:
            stream = self.streams.stream = SimStream(self, f"compute-{threading.get_ident()}")
        if self.progress and self.rng.random() < self.progress:
            self.advance(int(self.rng.integers(1, 4)))  # (some copies land on their own)
        return stream

    def copy_event(self) -> SimEvent:
        return SimEvent(self)

    def release_event(self) -> SimEvent:
        return SimEvent(self)

    def pinned(self, n_bytes: int) -> torch.Tensor:
        self.pinned_sizes.append(n_bytes)
        return torch.full((n_bytes,), 0xAB, dtype=torch.uint8)

    def pinned_bytes(self, n_bytes: int) -> int:
        return 1 << max(0, n_bytes - 1).bit_length()

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: Any) -> None:
        assert stream is self.copy_stream
        with self.lock:
            self.log.append(("copy", "copy", pairs))
            self.queue.append(SimCopy(pairs))

    def synchronize(self, stream: Any) -> None:
        self.advance(len(self.queue))

    def run_until(self, event: SimEvent) -> None:
        with self.lock:
            while not event.done and self.queue:
                self._step()

    def advance(self, n: int) -> None:
        with self.lock:
            for _ in range(min(n, len(self.queue))):
                self._step()

    def _step(self) -> None:
        item = self.queue.pop(0)
        if isinstance(item, SimEvent):
            item.done = True
        else:
            item.run()

    def pending_targets(self) -> set[int]:
        with self.lock:
            return set().union(*(c.targets for c in self.queue if isinstance(c, SimCopy)))


def sim_transfer(sim: SimDevice, slot_bytes: int = 64, n_staging: int = 2) -> DeviceTransfer:
    return DeviceTransfer(torch.device("cpu"), slot_bytes, n_staging, sim)


# ---- the transfer alone ---------------------------------------------------------------------------------------------


def slot_parts(pool: torch.Tensor, slot: int) -> tuple[torch.Tensor, ...]:
    return (pool[slot, 0], pool[slot, 1])


def filler(value: float) -> Callable[[tuple[torch.Tensor, ...]], str]:
    def fill(parts: tuple[torch.Tensor, ...]) -> str:
        for i, part in enumerate(parts):
            part.fill_(value + i)
        return "host"

    return fill


def test_each_slot_handed_out_is_waited_on_exactly_when_its_copy_is_pending() -> None:
    sim = SimDevice()
    transfer = sim_transfer(sim, n_staging=4)
    pool = torch.zeros(5, 2, 3, 4)
    events = {}
    for slot in (1, 2, 3):
        assert transfer.load(slot, slot_parts(pool, slot), filler(10.0 * slot)) == "host"
        events[slot] = sim.queue[-1]
    assert (pool == 0).all()  # enqueued, not landed
    sim.run_until(events[2])  # slot 1's and 2's copies land, 3's is still queued
    sim.log.clear()
    transfer.ready(np.array([1, 2, 3, 4]))
    assert [e for _, what, e in sim.log if what == "wait"] == [events[3]]
    assert sim.needless == 0 and (pool[3, 1] == 31).all()
    sim.log.clear()
    transfer.ready([1, 2, 3, 4])  # every copy has landed now: nothing more to wait for
    transfer.ready([3], late=[3])
    assert sim.log == [] and transfer._copied == {}
    for slot in (1, 2, 3):
        assert (pool[slot, 0] == 10 * slot).all() and (pool[slot, 1] == 10 * slot + 1).all()


def test_ready_skips_the_late_slots_until_their_wait() -> None:
    sim = SimDevice()
    transfer = sim_transfer(sim, n_staging=4)
    pool = torch.zeros(4, 2, 3, 4)
    for slot in (0, 1):
        transfer.load(slot, slot_parts(pool, slot), filler(slot + 1.0))
    transfer.ready(np.array([0, 1]), late=[1])
    waited = [e for _, what, e in sim.log if what == "wait"]
    assert len(waited) == 1 and (pool[0] == torch.tensor([1.0, 2.0]).view(2, 1, 1)).all()
    assert (pool[1] == 0).all()


def test_a_staging_buffer_is_reused_only_after_its_copy_completed() -> None:
    sim = SimDevice()
    transfer = sim_transfer(sim, slot_bytes=2 * 3 * 4 * 4, n_staging=1)
    pool = torch.zeros(3, 2, 3, 4)
    transfer.load(0, slot_parts(pool, 0), filler(5.0))
    first = sim.queue[-1]
    assert isinstance(first, SimEvent) and not first.done
    seen: list[bool] = []

    def second(parts: tuple[torch.Tensor, ...]) -> str:
        seen.append(first.done)  # (its staging buffer is this one: the first copy must have read it)
        return filler(7.0)(parts)

    transfer.load(1, slot_parts(pool, 1), second)
    assert seen == [True] and len(sim.pinned_sizes) == 1  # one buffer, allocated once, at the largest slot
    assert sim.pinned_sizes[0] >= 2 * 3 * 4 * 4
    sim.synchronize(sim.copy_stream)
    assert (pool[0, 0] == 5).all() and (pool[1, 1] == 8).all()


def test_a_copy_into_a_slot_waits_for_every_stream_that_read_it() -> None:
    sim = SimDevice()
    transfer = sim_transfer(sim, n_staging=2)
    pool = torch.zeros(4, 2, 3, 4)
    transfer.load(2, slot_parts(pool, 2), filler(1.0))
    a, b = SimStream(sim, "a"), SimStream(sim, "b")
    transfer.released(np.array([2, 3]), a)
    transfer.released(np.array([2]), a)  # (a later release on the same stream covers the earlier)
    transfer.released(np.array([2]), b)
    last_a, last_b = transfer._read[2][a], transfer._read[2][b]
    sim.log.clear()
    transfer.load(2, slot_parts(pool, 2), filler(9.0))
    kinds = [(stream, what, item) for stream, what, item in sim.log]
    waits = [item for stream, what, item in kinds if stream == "copy" and what == "wait"]
    assert waits == [last_a, last_b]
    assert [what for _, what, _ in kinds] == ["wait", "wait", "copy"]  # the waits before the copy
    sim.log.clear()
    transfer.load(2, slot_parts(pool, 2), filler(4.0))  # nothing read it since: no wait
    assert [what for _, what, _ in sim.log] == ["copy"]
    assert 3 in transfer._read  # (slot 3's release stays until a copy into it)
    sim.synchronize(sim.copy_stream)
    assert (pool[2, 0] == 4).all()


def test_a_failed_fill_enqueues_nothing_and_keeps_the_release_events() -> None:
    sim = SimDevice()
    transfer = sim_transfer(sim, n_staging=1)
    pool = torch.zeros(2, 2, 3, 4)
    transfer.released(np.array([0]), SimStream(sim, "a"))

    def broken(parts: tuple[torch.Tensor, ...]) -> str:
        raise OSError("read failed")

    with pytest.raises(OSError):
        transfer.load(0, slot_parts(pool, 0), broken)
    assert sim.queue == [] and 0 in transfer._read and 0 not in transfer._copied
    transfer.load(0, slot_parts(pool, 0), filler(3.0))  # (the ring's buffer was given back)
    assert [what for _, what, _ in sim.log] == ["wait", "copy"]


# ---- a store over a simulated device --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 MoE layers x 16 experts, top-2."""
    return random_model("qwen3_moe", tmp_path_factory.mktemp("wide"), seed=3, **WIDE)


@pytest.fixture(scope="module")
def reference(wide: Path) -> tuple[moelane.LM, list[int]]:
    lm = moelane.load(wide)
    return lm, list(lm.generate_ids(PROMPT, 16))


def checked(store: ExpertStore, sim: SimDevice) -> list[int]:
    """Wrap the store's `slots` and `slots_staged` so that every slot handed out for compute is checked to have no
    copy still queued when compute may read it. -> the list of slots checked, appended to as they are."""
    seen: list[int] = []
    plain, staged = store.slots, store.slots_staged

    def settled(slots: torch.Tensor, pending: torch.Tensor | None = None, now: bool = True) -> None:
        picked = slots if pending is None else slots[~pending if now else pending]
        for slot in set(picked.reshape(-1).tolist()):
            _, parts = store.expert_parts(slot)
            assert not {p.data_ptr() for p in parts} & sim.pending_targets(), f"slot {slot} read before its copy"
            seen.append(slot)

    def slots(layer: int, ids: torch.Tensor) -> torch.Tensor:
        out = plain(layer, ids)
        settled(out)
        return out

    def slots_staged(layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, Callable[[], None]]:
        out, pending, wait = staged(layer, ids)
        settled(out, pending)
        if pending is None:
            return out, pending, wait

        def waited() -> None:
            wait()
            settled(out, pending, now=False)

        return out, pending, waited

    store.slots, store.slots_staged = slots, slots_staged  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize(
    ("share", "host", "tier", "staged"),
    [("20%", None, "native", True), ("30%", "10%", "native", False), ("15%", "5%", "int8", True)],
)
def test_a_store_on_a_simulated_device_computes_what_the_cpu_store_does(
    wide: Path,
    reference: tuple[moelane.LM, list[int]],
    share: str,
    host: str | None,
    tier: str,
    staged: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Greedy tokens and every held slot's bytes equal a CPU store's; no slot is computed on before its copy landed;
    no staging buffer is refilled before its copy ran (else a copy would carry another expert's bytes); the pool's
    and the pinned host cache's bytes stay in their budgets."""
    if staged:
        monkeypatch.setattr(store_module, "SMALL_EXPERT_BYTES", 0)  # (misses load on the I/O threads meanwhile)
    factory = store_factory(parse_memory(share), host and parse_memory(host), "planner", tier)
    cpu_lm = moelane.load(wide, provider=factory)
    expected = list(cpu_lm.generate_ids(PROMPT, 16, prefill_chunk=4))  # (4 rows: 8 experts fit every budget)
    if tier == "native":
        assert expected == reference[1]
    cpu_store = cpu_lm.provider
    assert isinstance(cpu_store, ExpertStore) and type(cpu_store.transfer) is Transfer

    sims: list[SimDevice] = []

    def simulated(device: torch.device | None, slot_bytes: int, n_staging: int) -> DeviceTransfer:
        sims.append(SimDevice(seed=len(sims), progress=0.3))
        return DeviceTransfer(torch.device("cpu"), slot_bytes, n_staging, sims[-1])

    monkeypatch.setattr(store_module, "make_transfer", simulated)
    lm = moelane.load(wide, provider=factory)
    store = lm.provider
    assert isinstance(store, ExpertStore) and isinstance(store.transfer, DeviceTransfer)
    sim = sims[0]
    seen = checked(store, sim)
    try:
        assert list(lm.generate_ids(PROMPT, 16, prefill_chunk=4)) == expected
        assert list(lm.generate_ids(PROMPT[4:], 8, prefill_chunk=3)) == list(
            cpu_lm.generate_ids(PROMPT[4:], 8, prefill_chunk=3)
        )
        store.wait_loads()
        sim.synchronize(sim.copy_stream)
        assert seen and store.stats.evictions > 0
        store.check_invariants()
        assert store.high_water_bytes <= store.config.budget_bytes
        staging = [n for n in sim.pinned_sizes if n >= store.transfer.staging_bytes]  # (the rest: host cache copies)
        assert 0 < len(staging) <= store.config.io_threads + 2
        if host:
            host_cache = store.storage.host
            assert 0 < host_cache.nbytes <= store.config.host_bytes
            assert host_cache.nbytes == sum(sim.pinned_bytes(b.numel()) for b in host_cache._items.values())
        cpu_held = {store_key(cpu_store, s): parts for s, parts in held(cpu_store)}
        for slot, parts in held(store):
            key = store_key(store, slot)
            if key in cpu_held:
                assert all(torch.equal(a, b) for a, b in zip(parts, cpu_held[key], strict=True))
        resident = ResidentProvider.from_handles(lm.expert_handles, lm.dtype)
        if tier == "native":
            for slot, (w13, w2) in held(store):
                layer, expert = store_key(store, slot)
                assert torch.equal(w13, resident.weights(layer)[0][expert])
                assert torch.equal(w2, resident.weights(layer)[1][expert])
    finally:
        store.close()
        cpu_store.close()


def held(store: ExpertStore) -> list[tuple[int, tuple[torch.Tensor, ...]]]:
    return [(s, store.expert_parts(s)[1]) for s, k in enumerate(store.table.key.tolist()) if k >= 0]


def store_key(store: ExpertStore, slot: int) -> tuple[int, int]:
    key = int(store.table.key[slot])
    return store.layers[key // store.n_experts], key % store.n_experts


def test_threads_on_their_own_streams_each_wait_and_are_waited_for(
    reference: tuple[moelane.LM, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several threads route at once, each on its own compute stream: every slot is settled when handed out, and a
    copy into a slot waits for the release event of each stream that leased it since its last copy."""
    lm = reference[0]
    sims: list[SimDevice] = []

    def simulated(device: torch.device | None, slot_bytes: int, n_staging: int) -> DeviceTransfer:
        sims.append(SimDevice(seed=7, progress=0.5))
        return DeviceTransfer(torch.device("cpu"), slot_bytes, n_staging, sims[-1])

    monkeypatch.setattr(store_module, "make_transfer", simulated)
    monkeypatch.setattr(store_module, "SMALL_EXPERT_BYTES", 0)
    hidden, width = lm.expert_handles[lm.moe_layers[0]][0].tensors["down"].shape
    store = ExpertStore(
        lm.expert_handles, lm.dtype, StoreConfig(budget_bytes=10 * 3 * hidden * width * lm.dtype.itemsize)
    )
    sim = sims[0]
    seen = checked(store, sim)
    resident = ResidentProvider.from_handles(lm.expert_handles, lm.dtype)
    errors: list[BaseException] = []

    def stream(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(12):
                for layer in store.layers:
                    ids = torch.from_numpy(np.stack([rng.choice(16, 2, replace=False) for _ in range(2)]))
                    slots, _, wait = store.slots_staged(layer, ids)
                    wait()
                    for slot, expert in zip(slots.reshape(-1).tolist(), ids.reshape(-1).tolist(), strict=True):
                        _, (w13, _) = store.expert_parts(slot)
                        assert torch.equal(w13, resident.weights(layer)[0][expert])
                store.release()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == [] and seen
        store.check_invariants()
        streams = {name for name, what, _ in sim.log if what == "wait" and name != "copy"}
        copy_waits = [item for name, what, item in sim.log if name == "copy" and what == "wait"]
        assert len(streams) >= 2 and copy_waits  # (victims read by other streams were waited for)
        assert all(isinstance(e, SimEvent) and e.stream is not sim.copy_stream for e in copy_waits)
    finally:
        store.close()


def test_the_device_argument_reaches_the_store_and_cpu_is_todays_path(wide: Path) -> None:
    handles = moelane.load(wide).expert_handles
    for device in (None, torch.device("cpu"), "cpu"):
        store = store_factory(parse_memory("50%"), device=device)(handles, torch.float32)  # type: ignore[arg-type]
        assert isinstance(store, ExpertStore) and store.device is None and type(store.transfer) is Transfer
        assert all(p.w13[0].device.type == "cpu" for p in store.pools(store.layers[0]))
        store.close()
    with pytest.raises(StoreError, match="CPU or a CUDA device"):
        store_factory(parse_memory("50%"), device=torch.device("meta"))
    assert on_device(None) is None and on_device("cpu") is None and on_device("cuda:1") == torch.device("cuda:1")


def test_a_cpu_store_does_not_initialise_cuda(wide: Path) -> None:
    """`import moelane` and a CPU store's build, loads and waits leave CUDA alone."""
    script = f"""
import torch, moelane
from moelane.pager.live.build import store_factory, resident_at_tier
from moelane.pager.live.memory import parse_memory
lm = moelane.load({str(wide)!r}, provider=store_factory(parse_memory("30%"), parse_memory("10%")))
lm.generate_ids(list(range(3, 20)), 4)
resident_at_tier(lm.expert_handles, lm.dtype, 1)
lm.provider.close()
assert not torch.cuda.is_initialized(), "CUDA initialised"
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


# ---- a real CUDA device ---------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize(("tier", "host", "staged"), [(0, 0, False), (0, 1 << 20, True), (1, 1 << 20, True)])
def test_a_store_on_cuda_fills_its_slots_exactly(
    wide: Path, tier: int, host: int, staged: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pools on the GPU, loads through pinned staging buffers on the copy stream: what compute gathers from the
    slots handed out, on its own stream with no host synchronisation, is exactly what the CPU store holds."""
    if staged:
        monkeypatch.setattr(store_module, "SMALL_EXPERT_BYTES", 0)
    lm = moelane.load(wide)
    handles, dtype = lm.expert_handles, lm.dtype
    hidden, width = handles[lm.moe_layers[0]][0].tensors["down"].shape
    slot = 3 * hidden * width * dtype.itemsize
    config = StoreConfig(budget_bytes=6 * slot, host_bytes=host, default_tier=tier)
    device = torch.device("cuda")
    store = ExpertStore(handles, dtype, config, device=device)
    cpu = ExpertStore(handles, dtype, config)
    compute = torch.cuda.Stream(device)
    rng = np.random.default_rng(0)
    try:
        assert all(p.w13[0].device.type == "cuda" for p in store.pools(store.layers[0]))
        with torch.cuda.stream(compute):
            for _ in range(10):
                for layer in store.layers:
                    ids = torch.from_numpy(np.stack([rng.choice(16, 2, replace=False) for _ in range(2)]))
                    if staged:
                        slots, _, wait = store.slots_staged(layer, ids)
                        wait()
                    else:
                        slots = store.slots(layer, ids)
                    got = gathered(store, slots)  # (on `compute`, ordered after the copies only by the events)
                    want = gathered(cpu, cpu.slots(layer, ids))
                    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))
        store.check_invariants()
        assert store.stats.evictions > 0 and store.high_water_bytes <= config.budget_bytes
        if host:
            assert all(b.is_pinned() for b in store.storage.host._items.values())
        assert not any(staging.buf is not None and not staging.buf.is_pinned() for staging in store.transfer._free)
    finally:
        store.close()
        cpu.close()


def gathered(store: ExpertStore, slots: torch.Tensor) -> list[torch.Tensor]:
    """Each part of each slot's tier pool, gathered at these slots (on the current stream)."""
    out = []
    for s in slots.reshape(-1).tolist():
        _, parts = store.expert_parts(s)
        out.extend(p.clone() for p in parts)
    return out


@cuda
@pytest.mark.parametrize("tier", [0, 1])
def test_all_resident_on_cuda_equals_all_resident_on_the_cpu(wide: Path, tier: int) -> None:
    lm = moelane.load(wide)
    on_gpu = resident_at_tier(lm.expert_handles, lm.dtype, tier, device=torch.device("cuda"))
    on_cpu = resident_at_tier(lm.expert_handles, lm.dtype, tier)
    for layer in lm.moe_layers:
        (g,), (c,) = on_gpu.pools(layer), on_cpu.pools(layer)
        assert g.w13[0].device.type == "cuda"
        for a, b in itertools.chain(zip(g.w13, c.w13, strict=True), zip(g.w2, c.w2, strict=True)):
            assert (a is None and b is None) or torch.equal(a.cpu(), b)  # type: ignore[union-attr]

"""How a loaded expert reaches its pool slot, and what compute waits for before reading it: the store's only
device-specific part.

`Transfer` (the CPU): the pools are host memory, a load writes its slot directly, and nothing is ever in flight, so
every other method does nothing. `DeviceTransfer` (a CUDA device): the pools are device memory (pools.py), and a load
goes through pinned host memory:

- The storage levels (storage.py) fill a *staging buffer*, pinned host memory taken from a small ring (one per
  loading thread), viewed as the slot's parts (same dtypes and shapes), exactly as they would fill the slot itself.
- The staging buffer is copied into the slot on the one *copy stream* (`non_blocking`), and an event is recorded on
  that stream after the copy: the slot's *copy event*. The load is done (its future completes) once the copy is
  enqueued; it does not wait for it.
- `ready(slots)`, called on the computing thread by `slots`, `slots_staged` and a staged call's `wait` for exactly the
  slots they hand out, makes the caller's current stream wait for the copy events of those slots whose copies have
  not completed (a GPU-side wait: the host never blocks, and no other copy is waited for).
- `released(slots, reader)`, called when a lease ends, records an event on the stream the lease was taken on (the
  *release event*: after every kernel that thread enqueued on those slots).

Invariants:
1. A slot is written only by copies on the copy stream, and a copy into a slot is enqueued only after the copy
   stream waits for the slot's latest release event of every stream that leased it since its previous copy. A slot
   becomes a victim only when no lease holds it (slots.py), and each lease records its release event under the
   store's lock before its count drops, so every kernel that was handed a slot was enqueued before an event the next
   copy into that slot waits for: a copy never overwrites memory a kernel may still read.
2. Compute reads a slot only after its stream waited for the slot's latest copy event, unless that event had already
   completed when `ready` looked (a completed event is forgotten: no later reader needs it).
3. A staging buffer is written only by the one thread that took it from the ring, and only after the event of the last
   copy that read it has completed (`event.synchronize()` on that loading thread, never on the computing thread).
4. Every copy goes through the one copy stream, so two copies into one slot (an evicted prefetch reloaded) land in
   the order they were enqueued.

Nothing here touches `torch.cuda` unless the device is CUDA (`make_transfer`), so a CPU run never initialises it.
`DeviceTransfer` takes its streams, events, pinned buffers and copies from a `DeviceOps` (`CudaOps` by default); the
tests drive it on the CPU with simulated ones.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

R = TypeVar("R")
ALIGN = 256  # each part of a staging buffer starts at a multiple of this many bytes
MAX_PARTS = 4  # a slot's parts at most (quantised: codes13, scales13, codes2, scales2)


class Event(Protocol):
    def record(self, stream: Any = None) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class Stream(Protocol):
    def wait_event(self, event: Any) -> None: ...


class DeviceOps(Protocol):
    """What `DeviceTransfer` asks of a device (`CudaOps`; the tests' simulated device)."""

    def new_stream(self) -> Stream: ...
    def current_stream(self) -> Stream: ...
    def copy_event(self) -> Event: ...
    def release_event(self) -> Event: ...
    def pinned(self, n_bytes: int) -> torch.Tensor: ...
    def pinned_bytes(self, n_bytes: int) -> int: ...
    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: Stream) -> None: ...
    def synchronize(self, stream: Stream) -> None: ...


def on_device(device: torch.device | str | None) -> torch.device | None:
    """The CUDA device the store's pools live on; None for the CPU (None or "cpu"). ValueError for another kind."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"the expert store's pools live on the CPU or a CUDA device, not {device}")
    return None if device.type == "cpu" else device


def make_transfer(device: torch.device | None, slot_bytes: int, n_staging: int) -> Transfer:
    """The transfer of a store whose pools are on `device` (`on_device`'s; None: the CPU). `slot_bytes`: the
    largest slot it loads; `n_staging`: staging buffers in the ring (the threads that may load at once)."""
    if device is None:
        return Transfer()
    return DeviceTransfer(device, slot_bytes, n_staging, CudaOps(device))


class Transfer:
    """The CPU: a load writes its slot directly; nothing is in flight, so there is nothing to wait for."""

    device: torch.device | None = None

    def host_buffer(self, n_bytes: int) -> torch.Tensor:
        """A uint8 host buffer that a copy to the device can read (a host cache entry)."""
        return torch.empty(n_bytes, dtype=torch.uint8)

    def host_bytes(self, n_bytes: int) -> int:
        """The host memory `host_buffer(n_bytes)` really takes."""
        return n_bytes

    def load(self, slot: int, parts: tuple[torch.Tensor, ...], fill: Callable[[tuple[torch.Tensor, ...]], R]) -> R:
        """Put an expert into `slot`, whose parts are `parts`: `fill(tensors)` writes it into host tensors shaped as
        the parts (here: the parts themselves). -> what `fill` returned."""
        return fill(parts)

    def reader(self) -> Any:
        """What a lease taken now by the calling thread is read on (the device: its current stream)."""
        return None

    def ready(self, slots: Iterable[int] | np.ndarray, late: Iterable[int] = ()) -> None:
        """Make the calling thread's compute wait for the copies into these slots (except those in `late`)."""

    def released(self, slots: np.ndarray, reader: Any) -> None:
        """A lease of these slots, taken on `reader`, ends: a copy into them must wait for what it enqueued."""

    def settle(self) -> None:
        """Wait until every copy enqueued has landed (after loading every expert at once, not on the hot path)."""


@dataclass(slots=True)
class Staging:
    """One pinned staging buffer of the ring and the event of the last copy that read it."""

    buf: torch.Tensor | None = None
    event: Event | None = None


class DeviceTransfer(Transfer):
    """Loads through pinned staging buffers and one copy stream, an event per slot (module docstring)."""

    def __init__(self, device: torch.device, slot_bytes: int, n_staging: int, ops: DeviceOps) -> None:
        self.device, self.ops = device, ops
        self.staging_bytes = slot_bytes + ALIGN * MAX_PARTS
        self.stream = ops.new_stream()  # the copy stream
        self._free = deque(Staging() for _ in range(max(1, n_staging)))  # least recently used first
        self._ring = threading.Condition()
        self._lock = threading.Lock()  # guards the two maps below
        self._copied: dict[int, Event] = {}  # slot -> event of its latest copy, until seen completed
        self._read: dict[int, dict[Any, Event]] = {}  # slot -> its latest release event per stream since its copy

    def host_buffer(self, n_bytes: int) -> torch.Tensor:
        return self.ops.pinned(n_bytes)

    def host_bytes(self, n_bytes: int) -> int:
        return self.ops.pinned_bytes(n_bytes)

    def load(self, slot: int, parts: tuple[torch.Tensor, ...], fill: Callable[[tuple[torch.Tensor, ...]], R]) -> R:
        with self._ring:
            self._ring.wait_for(lambda: bool(self._free))
            staging = self._free.popleft()  # (the one whose last copy is the likeliest to have completed)
        try:
            if staging.event is not None:
                staging.event.synchronize()  # (invariant 3: its last copy has read it)
                staging.event = None
            host = self._views(staging, parts)
            result = fill(host)
            event = self.ops.copy_event()
            with self._lock:
                for waited in self._read.pop(slot, {}).values():
                    self.stream.wait_event(waited)  # (invariant 1)
                self.ops.copy(list(zip(parts, host, strict=True)), self.stream)
                event.record(self.stream)
                self._copied[slot] = staging.event = event
        finally:
            with self._ring:
                self._free.append(staging)
                self._ring.notify()
        return result

    def _views(self, staging: Staging, parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Host tensors shaped as `parts`, in `staging`'s buffer (each at a multiple of ALIGN bytes)."""
        offsets, end = [], 0
        for part in parts:
            offsets.append(end)
            end += -(-part.nbytes // ALIGN) * ALIGN
        if staging.buf is None or staging.buf.numel() < end:
            staging.buf = self.ops.pinned(max(end, self.staging_bytes))
        buf = staging.buf
        return tuple(
            buf[offset : offset + part.nbytes].view(part.dtype).view(part.shape)
            for offset, part in zip(offsets, parts, strict=True)
        )

    def reader(self) -> Any:
        return self.ops.current_stream()

    def ready(self, slots: Iterable[int] | np.ndarray, late: Iterable[int] = ()) -> None:
        wanted = slots.tolist() if isinstance(slots, np.ndarray) else list(slots)
        skip = set(late)
        with self._lock:
            if not self._copied:
                return
            pending = [(s, self._copied[s]) for s in wanted if s in self._copied and s not in skip]
        if not pending:
            return
        stream, done = self.ops.current_stream(), []
        for slot, event in pending:
            if event.query():
                done.append((slot, event))
            else:
                stream.wait_event(event)  # (invariant 2)
        if done:
            with self._lock:
                for slot, event in done:
                    if self._copied.get(slot) is event:
                        del self._copied[slot]

    def released(self, slots: np.ndarray, reader: Any) -> None:
        event = self.ops.release_event()
        event.record(reader)
        with self._lock:
            for slot in slots.tolist():
                self._read.setdefault(slot, {})[reader] = event

    def settle(self) -> None:
        self.ops.synchronize(self.stream)
        with self._lock:
            self._copied.clear()


class CudaOps:
    """A CUDA device's streams, events, pinned memory and copies."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> Stream:
        stream: Stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        return stream

    def current_stream(self) -> Stream:
        return torch.cuda.current_stream(self.device)

    def copy_event(self) -> Event:
        # blocking: a loading thread that waits for a staging buffer's copy sleeps instead of spinning on a core
        event: Event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        return event

    def release_event(self) -> Event:
        event: Event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        return event

    def pinned(self, n_bytes: int) -> torch.Tensor:
        return torch.empty(n_bytes, dtype=torch.uint8, pin_memory=True)

    def pinned_bytes(self, n_bytes: int) -> int:
        """Pinned blocks are rounded up to a power of two (PyTorch's caching host allocator)."""
        return 1 << max(0, n_bytes - 1).bit_length()

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: Stream) -> None:
        assert isinstance(stream, torch.cuda.Stream)
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)

    def synchronize(self, stream: Stream) -> None:
        assert isinstance(stream, torch.cuda.Stream)
        stream.synchronize()

"""Small traces and straightforward reference implementations for the pager tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from moelane.pager.lab.replay import is_decode
from moelane.pager.lab.synth import SynthConfig, synth_trace
from moelane.pager.trace import Segment, Trace, TraceHeader, token_flat_ids, trace_from_segments


def small_trace(seed: int = 0, **kw: object) -> Trace:
    base: dict[str, object] = dict(
        n_layers=3, n_experts=8, top_k=2, n_requests=2, prefill_tokens=12, prefill_chunk=5, decode_tokens=20, seed=seed
    )
    base.update(kw)
    return synth_trace(SynthConfig(**base))  # type: ignore[arg-type]


def random_trace(rng: np.random.Generator, n_layers: int, n_experts: int, top_k: int, n_tokens: int) -> Trace:
    """Uniformly random routing, one decode token per segment (for brute-force checks)."""
    header = TraceHeader(n_layers, n_experts, top_k, (("bf16", 10),))
    segs = []
    for i in range(n_tokens):
        ids = np.stack([rng.choice(n_experts, top_k, replace=False) for _ in range(n_layers)])[None]
        segs.append(Segment(i, "decode", ids.astype(np.uint8), np.zeros(1, np.int64)))
    return trace_from_segments(header, segs)


def with_lookahead(trace: Trace, rng: np.random.Generator, accuracy: float = 0.7) -> Trace:
    """`trace` carrying a noisy look-ahead: per token and layer l+1, each routed expert kept with probability
    `accuracy`, else replaced by a random expert (a prediction may then name an expert twice, as real ones cannot)."""
    nxt = trace.expert_ids[:, 1:].astype(np.int64)
    noise = rng.integers(0, trace.header.n_experts, nxt.shape)
    ahead = np.where(rng.random(nxt.shape) < accuracy, nxt, noise).astype(trace.expert_ids.dtype)
    return dataclasses.replace(trace, lookahead=ahead)


def steps_of(trace: Trace) -> list[tuple[list[int], bool]]:
    out = []
    for seg in trace.segments():
        flat = token_flat_ids(seg.expert_ids, trace.header.n_experts)
        for layer in range(flat.shape[1]):
            out.append((sorted(set(flat[:, layer].reshape(-1).tolist())), is_decode(seg)))
    return out


Key = Callable[[int], tuple[float, ...]]


def reference_replay(
    trace: Trace, capacity: int, policy: str, decay: float = 0.5, ahead: bool = False
) -> dict[str, int]:
    """Plain-Python pool: per step, evict min key among residents the step does not need. `ahead`: after each decode
    step of layer l, load the look-ahead's experts for layer l+1 the same way (sparing layer l's and their own)."""
    e = trace.header.n_experts
    resident: set[int] = set()
    last: dict[int, int] = {}
    count: dict[int, int] = {}
    score: dict[int, float] = {}
    hits = {"prefill": 0, "decode": 0, "prefetched": 0}
    step = 0
    for seg in trace.segments():
        phase = "decode" if is_decode(seg) else "prefill"
        flat = token_flat_ids(seg.expert_ids, e)
        t = flat.shape[0]
        for k in score:
            score[k] *= decay**t
        for layer in range(flat.shape[1]):
            need = sorted(set(flat[:, layer].reshape(-1).tolist()))
            hits[phase] += sum(1 for x in need if x in resident)
            miss = [x for x in need if x not in resident]

            def key(y: int) -> tuple[float, ...]:
                if policy == "lru":
                    return (last[y], -y)
                if policy == "lfu":
                    return (count.get(y, 0), last[y], -y)
                return (score.get(y, 0.0), last[y], -y)

            while len(resident) + len(miss) > capacity:
                resident.remove(min((y for y in resident if y not in need), key=key))
            resident.update(miss)
            for x in need:
                last[x] = step
                count[x] = count.get(x, 0) + 1
            for i in range(t):
                for x in set(flat[i, layer].tolist()):
                    score[x] = score.get(x, 0.0) + decay ** (t - 1 - i)
            step += 1
            if ahead and phase == "decode" and layer + 1 < flat.shape[1]:
                assert seg.lookahead is not None
                want = {int(x) + (layer + 1) * e for x in seg.lookahead[:, layer].reshape(-1)}
                early = [x for x in sorted(want) if x not in resident]
                keep = set(need) | want
                while early and len(resident) + len(early) > capacity:
                    resident.remove(min((y for y in resident if y not in keep), key=key))
                resident.update(early)
                hits["prefetched"] += len(early)
                for x in early:
                    last[x] = step
    return hits

"""Belady's MIN for multi-expert layer steps: the offline optimum that replays are measured against
(docs/design.md#replay-and-the-lab).

The pool is global across layers; each step (segment, layer) needs all its experts resident together. On a miss that
does not fit, evict the resident expert (not needed by this step) whose next use is furthest in the future; experts
never used again go first (ties: larger flat id first). Checked optimal against exhaustive search in the tests.
Needs the whole trace in advance: `Belady` precomputes every access's next use when bound to the simulator.
"""

from __future__ import annotations

import numpy as np

from moelane.pager.lab.replay import Policy, Simulator, layer_steps
from moelane.pager.trace import IntArray, Trace, token_flat_ids

NEVER = np.iinfo(np.int64).max // 4


def next_uses(steps: list[IntArray]) -> tuple[IntArray, IntArray]:
    """For every access (steps concatenated), the index of the next step using the same id (NEVER if none);
    also the offsets of each step in the concatenation."""
    sizes = np.array([s.size for s in steps], np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    if not steps:
        return np.zeros(0, np.int64), offsets
    ids = np.concatenate(steps).astype(np.int64)
    step_of = np.repeat(np.arange(len(steps), dtype=np.int64), sizes)
    order = np.lexsort((step_of, ids))
    nxt = np.full(ids.size, NEVER, np.int64)
    same = ids[order[1:]] == ids[order[:-1]]
    nxt[order[:-1][same]] = step_of[order[1:][same]]
    return nxt, offsets


def trace_steps(trace: Trace) -> list[IntArray]:
    steps: list[IntArray] = []
    for seg in trace.segments():
        steps.extend(layer_steps(token_flat_ids(seg.expert_ids, trace.header.n_experts)))
    return steps


class Belady(Policy):
    name = "belady"

    def bind(self, sim: Simulator) -> None:
        super().bind(sim)
        self.nu = np.full(sim.resident.size, NEVER, np.int64)
        self.cursor = 0
        self.next_use: IntArray | None = None

    def prepare(self, trace: Trace) -> None:
        self.next_use, self.offsets = next_uses(trace_steps(trace))

    def on_step(self, ids: IntArray, layer: int, flat: IntArray) -> None:
        assert self.next_use is not None, "Belady.prepare(trace) must run before the replay"
        a, b = self.offsets[self.cursor], self.offsets[self.cursor + 1]
        self.nu[ids] = self.next_use[a:b]
        self.cursor += 1

    def order(self, cand: IntArray) -> IntArray:
        return np.lexsort((self.sim.ids_desc[cand], -self.nu[cand]))

"""The shared guard: per stream count, is drafting paying for itself right now?

Meant for drafters whose hold costs a forward pass of its own (the draft model). Per stream count it keeps one
`GuardEntry` (allocated the first time that count runs; later rounds allocate nothing) and alternates:

1. measure plain for 16 measured rounds, then drafted for 4;
2. run the faster mode for 512 rounds; drafted wins only if it beats plain by 5% in committed tokens per second;
3. re-measure the other mode (the running mode's rate is taken from the last 16 or 4 measured rounds of its stretch),
   decide again; the run length doubles each time the same mode wins again, up to 64x the base, and falls back to
   the base when the other mode wins. So drafting is never switched off for good.

The first round after a switch of mode still carries the other mode's drafts or holds: it is not measured and
counts for nothing, not even toward a measuring stretch; the engine also reports `measured=False` for a round
whose drafts were prepared for another stream count's mode, for a round that feeds a prompt chunk (its time
and its few commits are the prompt's, whatever the mode: counted, a joining stream's prefill made drafting look
4x slower than plain on the shipped model and kept it off for 512 rounds), and for a drafted round that holds no
drafts. Such a round does a plain round's work, so it says nothing about whether drafting pays; counted, it pulls
the drafted rate toward plain's. Early in a reply, when the copy drafter has little to copy yet, all four measured
rounds were often such rounds. The 5% margin was then decided by noise, and usually went to plain for 512 rounds.
A drafted stretch therefore lasts until four rounds have held drafts. Rates come from
the seconds the engine reports, which it reads from its injected clock; the guard itself reads no clock.
"""

from __future__ import annotations

PLAIN = "plain"
DRAFTED = "drafted"
MEASURE_ROUNDS = {PLAIN: 16, DRAFTED: 4}
BASE_WAIT = 512
MAX_WAIT_FACTOR = 64
DRAFT_MARGIN = 1.05


class GuardEntry:
    """The guard's state for one stream count. Mutated in place; never reallocated."""

    __slots__ = (
        "factor",
        "left",
        "mode",
        "n_decisions",
        "n_skipped",
        "rate_drafted",
        "rate_plain",
        "running",
        "seconds",
        "skip",
        "tokens",
        "winner",
    )

    def __init__(self) -> None:
        self.mode = PLAIN  # the mode rounds at this count run in now
        self.running = False  # False: measuring `mode`; True: running the winner
        self.left = MEASURE_ROUNDS[PLAIN]  # rounds left in this stretch (measured rounds while measuring)
        self.tokens = 0  # accumulators of the current measurement
        self.seconds = 0.0
        self.rate_plain = 0.0  # committed tokens per second, last measurement of each mode
        self.rate_drafted = 0.0
        self.winner = ""  # the last decision's winner ("" before the first)
        self.factor = 1  # the current run length in units of BASE_WAIT
        self.n_decisions = 0
        self.skip = False  # the next round is the first after a switch of mode: not measured
        self.n_skipped = 0


class Guard:
    def __init__(self) -> None:
        self._entries: dict[int, GuardEntry] = {}

    def entry(self, n_streams: int) -> GuardEntry:
        e = self._entries.get(n_streams)
        if e is None:
            e = self._entries[n_streams] = GuardEntry()
        return e

    def mode(self, n_streams: int) -> str:
        """The mode a round with `n_streams` streams runs in (and that its drafts are prepared in)."""
        return self.entry(n_streams).mode

    def modes(self) -> dict[int, str]:
        return {n: e.mode for n, e in sorted(self._entries.items())}

    def observe(self, n_streams: int, mode: str, n_tokens: int, seconds: float, measured: bool) -> None:
        """Fold in one finished round that ran `n_streams` streams in `mode`."""
        e = self.entry(n_streams)
        if mode != e.mode:
            return
        if e.skip or not measured:
            e.skip = False
            e.n_skipped += 1
            if e.running:
                e.left -= 1
                if e.left <= 0:
                    if e.seconds > 0:
                        self._set_rate(e)
                    self._measure_other(e)
            return
        if e.running:
            e.left -= 1
            if e.left < MEASURE_ROUNDS[e.mode]:  # the tail of a run stretch measures the running mode
                e.tokens += n_tokens
                e.seconds += seconds
            if e.left <= 0:
                self._set_rate(e)
                self._measure_other(e)
            return
        e.tokens += n_tokens
        e.seconds += seconds
        e.left -= 1
        if e.left > 0:
            return
        self._set_rate(e)
        if not e.winner and e.mode == PLAIN:
            self._start(e, DRAFTED, running=False)
        else:
            self._decide(e)

    def _set_rate(self, e: GuardEntry) -> None:
        rate = e.tokens / e.seconds if e.seconds > 0 else float("inf") if e.tokens else 0.0
        if e.mode == PLAIN:
            e.rate_plain = rate
        else:
            e.rate_drafted = rate

    def _decide(self, e: GuardEntry) -> None:
        winner = DRAFTED if e.rate_drafted > DRAFT_MARGIN * e.rate_plain else PLAIN
        e.factor = min(e.factor * 2, MAX_WAIT_FACTOR) if winner == e.winner else 1
        e.winner = winner
        e.n_decisions += 1
        self._start(e, winner, running=True)

    def _measure_other(self, e: GuardEntry) -> None:
        self._start(e, DRAFTED if e.mode == PLAIN else PLAIN, running=False)

    def _start(self, e: GuardEntry, mode: str, running: bool) -> None:
        e.skip = mode != e.mode
        e.mode = mode
        e.running = running
        e.left = BASE_WAIT * e.factor if running else MEASURE_ROUNDS[mode]
        e.tokens = 0
        e.seconds = 0.0

"""The lanes engine: many streams served in shared rounds, drafting where it pays, replies never changed.

A round is one batched forward pass over the streams taking part:

    chosen  = choose(...)            # least recently served first, within stream and row limits
    windows = plan_windows(...)      # pending rows + drafts held by the depth rule (drafted rounds only)
    logits  = target.forward(rows)   # verify all
    commit(verify(window, logits))   # accepted drafts + the model's token; rejected rows are rolled back
    draft(...)                       # proposals for the next round, in the mode the guard chose for it

Streams join and leave between rounds. The target is a `Target` (`moelane.lanes.target`: `LM`, or the fake of
`moelane.lanes.fake`); requests are checked (`moelane.lanes.request`) before they are queued. Every time reading goes
through the injected `Clock`; with `timed=False` nothing the engine decides depends on it. The engine knows nothing
about text: callers detokenise and handle stop strings (cancelling the stream). A started engine calls its step hooks
after each step, once the stream listeners' calls of that step have returned, so a caller can hand a whole round's
commits on at once (the server: one wake-up of its event loop a round, docs/server.md).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from moelane.errors import InputError, MoelaneError
from moelane.lanes.clock import Clock, RealClock
from moelane.lanes.config import EngineConfig
from moelane.lanes.depth import Acceptance, Prices, PriceTable, Seat, allocate, probe_round
from moelane.lanes.drafters import CopyDrafter, Drafter, ModelDrafter, RecallDrafter, RecallStore, load_draft_model
from moelane.lanes.guard import DRAFTED, PLAIN, Guard
from moelane.lanes.lane import Lane
from moelane.lanes.prefix import PrefixStore, admit_cache, live_bytes, valid_tokens
from moelane.lanes.request import check_request
from moelane.lanes.rounds import Window, choose, commit, logprobs_of, plan_windows, prompt_logprobs_of, verify
from moelane.lanes.stream import Stream
from moelane.lanes.target import Target, calibrate, fit_to_target
from moelane.model.grammar import Grammar

log = logging.getLogger(__name__)
DRAFT_PRICE_RATE = 0.2
STEADY_FEED = 2  # a draft model's first feed in a round while it drafts every round: the last accepted draft (fed
# only if it is verified) and the target's own token


@dataclass(frozen=True, slots=True)
class EngineStats:
    rounds: int = 0
    holds: int = 0  # draft rows placed for verification
    accepted: int = 0  # holds that became committed tokens
    committed: int = 0  # tokens appended to replies
    prefill_tokens: int = 0
    prefix_hits: int = 0  # streams that took over a kept cache sharing their prompt's prefix
    prefix_tokens: int = 0  # prompt tokens those streams did not feed
    finished: int = 0
    n_active: int = 0
    n_waiting: int = 0
    guard_modes: dict[int, str] = field(default_factory=dict)


class Engine:
    def __init__(
        self,
        target: Target,
        config: EngineConfig | None = None,
        *,
        draft: Any = None,
        clock: Clock | None = None,
        recall_store: RecallStore | None = None,
    ) -> None:
        """`draft`: the draft model for drafter "model" (default: the shipped one). `recall_store`: a store to share
        with other engines (default: a new one)."""
        if config is not None and not isinstance(config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig (EngineConfig(**settings)), got {config!r}")
        self.target, self.config = target, fit_to_target(config or EngineConfig(), target)
        self.clock = clock or RealClock()
        self.drafter = self._make_drafter(draft, recall_store)
        self.guard = Guard() if self.config.guard_on else None
        self.prices: Prices = PriceTable(self.config.prices)
        self.draft_price = self.config.draft_price
        self.prefixes = PrefixStore(self.config.prefix_cache_mb << 20, self.config.max_streams)
        self._waiting: deque[Lane] = deque()
        self._active: list[Lane] = []
        self._cv = threading.Condition()
        self._step_hooks: list[Callable[[], None]] = []
        self._next_id = 0
        self._round = 0
        self._draft_failures = 0
        self._counts = dict.fromkeys(("holds", "accepted", "committed", "prefill_tokens", "finished"), 0)
        self._span_start: float | None = None  # when the current round's host work (drafting) began
        self._drafted_for = PLAIN  # the mode the drafts for the next round were prepared in
        self._thread: threading.Thread | None = None
        self._stopping = False  # the engine thread is asked to end
        self._stopped = False  # start()ed, then stopped: submit refuses until start() again
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="moelane-forward") if self.config.overlap else None
        if self.config.timed:
            draft_model = self.drafter.draft if isinstance(self.drafter, ModelDrafter) else None
            self.prices, measured = calibrate(self.target, draft_model, self.clock, self.config.max_rows)
            self.draft_price = self.draft_price if measured is None else measured

    def _make_drafter(self, draft: Any, store: RecallStore | None) -> Drafter | None:
        c = self.config
        if c.drafter == "copy":
            return CopyDrafter(c.min_match)
        if c.drafter == "recall":
            return RecallDrafter(store or RecallStore(c.recall_tokens), c.min_match)
        if c.drafter == "model":
            draft = draft if draft is not None else load_draft_model(compile=c.compile_draft)
            if draft.vocab_size != self.target.vocab_size:
                raise InputError(f"draft vocabulary {draft.vocab_size} != target's {self.target.vocab_size}")
            return ModelDrafter(draft, c.prefill_chunk, c.prefix_cache_mb << 20, c.max_streams)
        return None

    # ---- requests -----------------------------------------------------------------------------------------------

    def submit(
        self,
        token_ids: Sequence[int],
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        logit_bias: Mapping[int, float] | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
        grammar: Grammar | None = None,
    ) -> Stream:
        """Queue a request; its tokens arrive on the returned `Stream` as rounds commit them. Ends at an EOS id or a
        stop token (not part of the reply) or after `max_tokens` tokens. `logit_bias` and the penalties adjust the
        logits as OpenAI's parameters of those names do (the penalties count the reply's tokens). With `logprobs`
        = n (0-20) the stream also gets each token's log-probability and the n most likely tokens there
        (`Stream.logprobs`); with `prompt_logprobs` too, the prompt's tokens get theirs (`Stream.prompt_logprobs`).
        A `grammar` (`moelane.model.grammar`, one per request) holds the reply to JSON or a JSON schema.
        InputError for a bad argument (counts, ids and seeds must be integers); MoelaneError once the engine thread
        was `start`ed and then stopped."""
        request = check_request(self.target, token_ids, max_tokens, temperature, top_p, top_k, seed, stop_token_ids,
                                logit_bias, presence_penalty, frequency_penalty, logprobs, prompt_logprobs,
                                grammar)  # fmt: skip
        with self._cv:  # (stop()'s lock: a stream is queued before a stop, and ended by it, or refused)
            if self._stopped:
                raise MoelaneError("the engine is stopped; start() it again before submitting")
            stream = Stream(self._next_id, request.prompt, request.max_tokens)
            self._next_id += 1
            lane = Lane(stream, request.params, request.stop_ids, None, Acceptance(self.config.max_depth),
                        request.prompt, len(request.prompt))  # fmt: skip
            lane.top_logprobs, lane.prompt_logprobs = request.top_logprobs, request.prompt_logprobs
            self._waiting.append(lane)
            self._cv.notify_all()
        return stream

    @property
    def n_active(self) -> int:
        return len(self._active)

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    def stats(self) -> EngineStats:
        return EngineStats(
            rounds=self._round, **self._counts, n_active=self.n_active, n_waiting=self.n_waiting,
            prefix_hits=self.prefixes.n_hits, prefix_tokens=self.prefixes.n_reused,
            guard_modes=self.guard.modes() if self.guard else {},
        )  # fmt: skip

    # ---- rounds -------------------------------------------------------------------------------------------------

    def step(self) -> bool:
        """Run one round in this thread; False if there was nothing to do. Not while `start`ed (MoelaneError): then
        the engine thread runs the rounds."""
        if self._thread is not None:
            raise MoelaneError("the engine thread runs the rounds (start()ed): stop() it before step() or "
                               "run_until_idle()")  # fmt: skip
        return self._step()

    def _step(self) -> bool:
        self._admit()
        chosen = choose(self._active, self.config.max_streams, self.config.max_rows, self.config.prefill_chunk)
        if not chosen:
            self._span_start = None
            return False
        try:
            self._round_of(chosen)
        except Exception:
            log.exception("a lanes round of %d streams failed; running them one at a time", len(chosen))
            self._isolate(chosen)
        return True

    def _round_of(self, chosen: list[tuple[Lane, int]]) -> None:
        """One round over `chosen`: plan windows, verify all in one pass, commit, draft the next round."""
        start = self.clock.now() if self._span_start is None else self._span_start
        mode = self._mode(len(chosen))
        windows = plan_windows(chosen, mode == DRAFTED, self.prices, self.config.max_rows, probe_round(self._round))
        # What the guard does not count: a round that feeds a prompt chunk (it measures the prompt, not the mode), and
        # a drafted round that holds no drafts (a plain round in all but name).
        measured = (
            self._drafted_for == mode
            and not any(lane.prefilling for lane, _ in chosen)
            and (mode == PLAIN or any(w.drafts for w in windows))
        )
        logits = self._forward(windows)
        n_committed = sum(self._settle(w, lg, mode) for w, lg in zip(windows, logits, strict=True))
        self._round += 1
        end = self.clock.now()
        if self.guard is not None:
            self.guard.observe(len(chosen), mode, n_committed, end - start, measured)
        self._span_start = end
        self._draft()

    def _isolate(self, failed: list[tuple[Lane, int]]) -> None:
        """A round failed: rerun its streams one at a time without drafts, so only a stream that fails by itself ends
        ("error") and the others go on. Nothing was committed for a stream whose pass failed; KV rows it wrote are
        written again at the same positions."""
        for lane, _ in failed:
            lane.drafts, lane.drafted_at = [], -1
        for lane, _ in failed:
            if lane not in self._active:
                continue
            try:
                self._round_of(choose([lane], 1, self.config.max_rows, self.config.prefill_chunk))
            except Exception as e:
                log.exception("lanes stream %d failed alone; ending it", lane.stream.id)
                self._retire(lane, "error", e)
        self._span_start = None

    def run_until_idle(self) -> None:
        """Run rounds in this thread until every submitted stream has finished (not while `start`ed: MoelaneError)."""
        while self.step():
            pass

    def _mode(self, n_streams: int) -> str:
        if self.drafter is None:
            return PLAIN
        return self.guard.mode(n_streams) if self.guard is not None else DRAFTED

    def _forward(self, windows: list[Window]) -> list[torch.Tensor]:
        rows = [w.rows() for w in windows]
        # Only each stream's last row is read, unless a window holds drafts or a prompt's log-probabilities are asked.
        last_only = not any(w.drafts or (w.lane.prompt_logprobs and w.lane.prefilling) for w in windows)
        t0 = self.clock.now()
        if self._pool is not None:
            pending = self._pool.submit(self.target.forward, rows, last_only=last_only)
            joined = self._admit([w.lane for w in windows])  # host work that does not depend on this pass
            if joined and self.drafter is not None:
                with self._drafting(joined):  # (a failure here must not leave the pass running unawaited)
                    self.drafter.prepare(joined)  # index their prompts, prefill the draft model
            logits = pending.result()
        else:
            logits = self.target.forward(rows, last_only=last_only)  # (keyword: LM's second is `phase`)
        if self.config.timed:
            self.prices.observe(sum(len(r.token_ids) for r in rows), self.clock.now() - t0, len(rows))
        for w in windows:
            w.lane.last_round = self._round
        return logits

    def _settle(self, window: Window, logits: torch.Tensor, mode: str) -> int:
        """Verify and commit one window; count it; finish its stream if it ended. Returns tokens committed."""
        lane = window.lane
        had_drafts, prefilling = bool(lane.drafts), lane.prefilling
        if prefilling and lane.prompt_logprobs:
            lane.stream._append_prompt(prompt_logprobs_of(window, logits, lane.top_logprobs or 0))
        tokens = verify(window, logits)
        n_before = lane.n_generated
        asked = lane.top_logprobs is not None and tokens
        reason = commit(window, tokens, logprobs_of(window, logits, tokens, lane.top_logprobs or 0) if asked else None)
        if prefilling:
            self._counts["prefill_tokens"] += len(window.feed)
        if window.commits and mode == DRAFTED and had_drafts:
            lane.acceptance.observe(len(window.drafts), len(tokens) - 1)
            if self.drafter is not None:
                self.drafter.feedback(lane, len(window.drafts), len(tokens) - 1)
        self._counts["holds"] += len(window.drafts)
        self._counts["accepted"] += max(0, len(tokens) - 1)
        n_committed = lane.n_generated - n_before
        self._counts["committed"] += n_committed
        if reason is not None or lane.stream.cancel_requested:
            self._retire(lane, reason or "cancelled")
        return n_committed

    def _draft(self) -> None:
        """Proposals for the next round, in the mode the guard runs that round's stream count in."""
        if self.drafter is None:
            return
        with self._cv:
            n_next = min(len(self._active) + len(self._waiting), self.config.max_streams)
        if n_next == 0:
            return
        mode = self._mode(n_next)
        self._drafted_for = mode
        if mode == PLAIN:
            for lane in self._active:
                lane.drafts, lane.drafted_at = [], -1
            return
        lanes = [x for x in self._active if x.decoding and x.room > 0 and x.drafted_at != len(x.tokens)]
        if not lanes:
            return
        with self._drafting(lanes):
            self._propose(lanes)

    def _propose(self, lanes: list[Lane]) -> None:
        assert self.drafter is not None
        depths = [min(self.config.max_depth, x.room) for x in lanes]
        if self.drafter.costs_passes:
            seats = [Seat(min(x.n_pending, self.config.prefill_chunk), True, d, x.acceptance)
                     for x, d in zip(lanes, depths, strict=True)]  # fmt: skip
            # (the round these drafts are for is self._round: this one's index was already counted)
            depths = allocate(seats, self.prices, self.config.max_rows, self.draft_price, probe_round(self._round))
        if isinstance(self.drafter, ModelDrafter):
            # Tokens committed while a stream held no drafts are fed to the draft model first, apart, so that the
            # price measured below is of a draft level as it is while drafting goes on (its first feed: the model's
            # token, after the last accepted draft), not of a catch-up, which priced drafting out once it stopped.
            self.drafter.prepare([x for x, d in zip(lanes, depths, strict=True) if d > 0], leave=STEADY_FEED)
        t0 = self.clock.now()
        proposals = self.drafter.propose(lanes, depths)
        if self.config.timed and self.drafter.costs_passes and max(depths, default=0) > 0:
            per_pass = (self.clock.now() - t0) / max(depths)
            self.draft_price += DRAFT_PRICE_RATE * (per_pass - self.draft_price)
        for lane, drafts in zip(lanes, proposals, strict=True):
            lane.drafts = drafts[: lane.room]
            lane.drafted_at = len(lane.tokens)

    @contextmanager
    def _drafting(self, lanes: Sequence[Lane]) -> Iterator[None]:
        """Drafter work for `lanes`: if it raises, they hold no drafts and the round goes on. Drafts never change a
        reply, so a failing drafter costs speed, not streams. Logged whole the first time, in a line at the 2nd, 4th,
        8th ... after."""
        try:
            yield
        except Exception as e:
            self._draft_failures += 1
            if self._draft_failures == 1:
                log.exception(
                    "the %s drafter failed; the streams it drafted for go on without drafts", self.config.drafter
                )
            elif self._draft_failures & (self._draft_failures - 1) == 0:  # (at 2, 4, 8, ... failures)
                log.warning("the %s drafter failed again (%d times): %s", self.config.drafter, self._draft_failures, e)
            for lane in lanes:
                lane.drafts, lane.drafted_at = [], -1

    # ---- membership ---------------------------------------------------------------------------------------------

    def _admit(self, in_pass: Sequence[Lane] = ()) -> list[Lane]:
        """Between rounds (or during a pass, with `overlap`): drop cancelled streams, admit waiting ones. The streams
        `in_pass` are not dropped here: their pass is still writing their caches, and its commits follow (`_settle`
        ends them)."""
        joined = []
        with self._cv:
            for lane in [x for x in self._active if x.stream.cancel_requested and x not in in_pass]:
                self._retire(lane, "cancelled")
            for lane in [x for x in self._waiting if x.stream.cancel_requested]:  # (not left waiting for a seat)
                self._waiting.remove(lane)
                self._end_unseated(lane)
            while self._waiting and len(self._active) < self.config.max_streams:
                lane = self._waiting.popleft()
                if lane.stream.cancel_requested:
                    self._end_unseated(lane)
                    continue
                try:
                    lane.cache = admit_cache(self.target, self.prefixes, lane, self._active)
                except Exception as e:  # (a cache it cannot have, as a failing pass: it ends alone)
                    log.exception("lanes stream %d could not be admitted; ending it", lane.stream.id)
                    self._retire(lane, "error", e)
                    continue
                self._active.append(lane)
                joined.append(lane)
        return joined

    def _end_unseated(self, lane: Lane) -> None:
        """A waiting stream cancelled before it had a seat: it holds nothing yet."""
        self._counts["finished"] += 1
        lane.stream._finish("cancelled")

    def _retire(self, lane: Lane, reason: str, error: BaseException | None = None) -> None:
        if lane in self._active:
            self._active.remove(lane)
        if self.drafter is not None:
            self.drafter.release(lane)
        if reason != "error" and lane.cache is not None:  # (an error may have left its state unsound)
            self.prefixes.keep(lane.cache, valid_tokens(lane, self.target), live_bytes(self._active))
        lane.cache, lane.drafts = None, []
        self._counts["finished"] += 1
        lane.stream._finish(reason, error)

    # ---- threaded mode ------------------------------------------------------------------------------------------

    def add_step_hook(self, hook: Callable[[], None]) -> Callable[[], None]:
        """Call `hook()` on the engine thread after each step it runs (a round, or ending the streams it holds at a
        failure or a stop), once the stream listeners' calls of that step have returned; what it raises is logged.
        It must be quick and must not block. Returns a function that removes it."""
        with self._cv:
            self._step_hooks.append(hook)

        def remove() -> None:
            with self._cv:
                if hook in self._step_hooks:
                    self._step_hooks.remove(hook)

        return remove

    def on_engine_thread(self) -> bool:
        """Whether the caller is the engine thread (a stream listener called from a step, whose hooks follow it)."""
        return self._thread is not None and self._thread is threading.current_thread()

    def _after_step(self) -> None:
        with self._cv:
            hooks = list(self._step_hooks)
        for hook in hooks:
            try:
                hook()
            except Exception:  # a hook's bug must not stop the engine, nor pass unsaid
                log.exception("a step hook failed")

    def start(self) -> None:
        """Run rounds on a thread of the engine's own (for a server); `submit` from any thread. Then `stop()` it (or
        use `with engine:`, which starts and stops): a started engine is kept alive by its thread."""
        while True:  # (under the lock, with the thread found there: starts racing each other start one thread)
            with self._cv:
                thread = self._thread
                if thread is None:
                    self._stopping = self._stopped = False
                    self._thread = threading.Thread(target=self._loop, name="moelane-lanes", daemon=True)
                    self._thread.start()
                    return
                if not self._stopping:
                    return
                if thread is threading.current_thread():  # (a listener's stop() then start(): the thread goes on)
                    self._stopping = self._stopped = False
                    return
            thread.join()  # a stop asked (on the engine thread itself, or racing this start): that thread is ending

    def stop(self) -> None:
        """Stop the engine thread; every stream it leaves, running or waiting, ends "cancelled", and `submit` refuses
        until `start()` again. Called on the engine thread itself (from a stream's listener), it asks for the stop
        and returns: the thread ends the streams after its current round."""
        with self._cv:
            thread = self._thread
            if thread is None:
                return
            self._stopping = self._stopped = True
            self._cv.notify_all()
        if thread is not threading.current_thread():
            thread.join()

    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _loop(self) -> None:
        try:
            self._serve()
        finally:
            with self._cv:
                self._end_all("cancelled")
            self._after_step()
            with self._cv:
                self._thread = None

    def _serve(self) -> None:
        while True:
            with self._cv:
                if not (self._waiting or self._active):
                    self._span_start = None  # idle time is no round's cost
                self._cv.wait_for(lambda: self._stopping or bool(self._waiting or self._active))
                if self._stopping:
                    return
            try:
                self._step()
            except Exception as e:  # outside any one round (choosing, isolating): it would fail again next round, so
                # the streams the engine holds end with it (the loop then waits for new ones, never spins)
                log.exception("lanes engine failed between rounds; ending its streams")
                with self._cv:
                    self._end_all("error", e)
            self._after_step()

    def _end_all(self, reason: str, error: BaseException | None = None) -> None:
        """End every stream the engine holds, running or waiting (under the lock)."""
        for lane in list(self._active) + list(self._waiting):
            self._retire(lane, reason, error)
        self._waiting.clear()

"""The handle a caller holds for one request: committed tokens as they come, the whole reply, the finish reason,
and `cancel()`.

Invariants: tokens are only ever appended (a committed token is final); the engine thread appends and finishes,
any other thread may read, iterate, wait or cancel. `finish_reason` is None while the stream runs, then one of
"stop" (an end-of-sequence or stop token, which is not part of the reply), "length" (max_tokens reached),
"cancelled" (by `cancel()` or an engine stop) or "error" (the engine failed; it logged why).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)
FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A committed token's log-probability under the model (log-softmax of its raw logits, before temperature,
    bias and penalties), and the `top` most likely tokens at its position, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Stream:
    def __init__(self, stream_id: int, prompt_ids: list[int], max_tokens: int) -> None:
        self.id = stream_id
        self.prompt_ids = list(prompt_ids)
        self.max_tokens = max_tokens
        self._tokens: list[int] = []
        self._logprobs: list[TokenLogprob] = []  # one per token, when the request asked for them
        self._prompt_logprobs: list[TokenLogprob | None] = []  # one per prompt token (None for the first), if asked
        self._finish_reason: str | None = None
        self.error: BaseException | None = None  # what ended it, when finish_reason is "error"
        self.n_cached = 0  # prompt tokens whose K/V came from a kept cache (`moelane.lanes.prefix`), set at admission
        self._cancel_requested = False
        self._changed = threading.Condition()
        self._listeners: list[Callable[[list[int] | None], None]] = []

    def __repr__(self) -> str:
        return f"Stream(id={self.id}, n_tokens={len(self._tokens)}, finish_reason={self._finish_reason!r})"

    @property
    def token_ids(self) -> list[int]:
        """A copy of the tokens committed so far (the whole reply once `done`)."""
        with self._changed:
            return list(self._tokens)

    @property
    def logprobs(self) -> list[TokenLogprob]:
        """Per committed token, when submitted with `logprobs`: its log-probability and the top alternatives."""
        with self._changed:
            return list(self._logprobs)

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None]:
        """Per prompt token, when submitted with `prompt_logprobs`: its log-probability given the tokens before it
        (None for the first, which has none), complete once the first reply token is committed."""
        with self._changed:
            return list(self._prompt_logprobs)

    def logprob(self, i: int) -> TokenLogprob:
        """Token i's entry of `logprobs` (without copying them all)."""
        with self._changed:
            return self._logprobs[i]

    @property
    def finish_reason(self) -> str | None:
        return self._finish_reason

    @property
    def done(self) -> bool:
        return self._finish_reason is not None

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_requested

    def cancel(self) -> None:
        """Ask the engine to end this stream; it frees the stream's memory between rounds."""
        with self._changed:
            self._cancel_requested = True
            self._changed.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the stream has finished; True if it has."""
        with self._changed:
            return self._changed.wait_for(lambda: self._finish_reason is not None, timeout)

    def __iter__(self) -> Iterator[int]:
        """Committed tokens, blocking until each is committed, ending when the stream finishes."""
        i = 0

        def ready() -> bool:
            return len(self._tokens) > i or self._finish_reason is not None

        while True:
            with self._changed:
                self._changed.wait_for(ready)
                fresh = self._tokens[i:]
                finished = self._finish_reason is not None
            yield from fresh
            i += len(fresh)
            if finished and not fresh:
                return

    def subscribe(self, listener: Callable[[list[int] | None], None]) -> None:
        """Call `listener(tokens)` with the tokens committed so far and then with each commit's, in order, and
        `listener(None)` once the stream has finished. It runs on the engine thread, under the stream's lock: it must
        be quick and must not block (hand the tokens on, as `loop.call_soon_threadsafe` does); what it raises is
        logged, never passed to the engine. No thread waits per stream."""
        with self._changed:
            self._listeners.append(listener)
            if self._tokens:
                _call(listener, list(self._tokens))
            if self._finish_reason is not None:
                _call(listener, None)

    # engine side
    def _append_prompt(self, logprobs: list[TokenLogprob | None]) -> None:
        with self._changed:
            self._prompt_logprobs.extend(logprobs)

    def _append(self, token_ids: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        with self._changed:
            self._tokens.extend(token_ids)
            self._logprobs.extend(logprobs or ())
            self._changed.notify_all()
            if token_ids:
                for listener in self._listeners:
                    _call(listener, list(token_ids))

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
        assert reason in FINISH_REASONS, reason
        with self._changed:
            if self._finish_reason is None:
                self._finish_reason, self.error = reason, error
                for listener in self._listeners:
                    _call(listener, None)
            self._changed.notify_all()


def _call(listener: Callable[[list[int] | None], None], tokens: list[int] | None) -> None:
    try:
        listener(tokens)
    except Exception:  # a listener's bug (or its closed event loop) must not stop the engine, nor pass unsaid
        log.exception("a stream listener failed")

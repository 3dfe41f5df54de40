"""One request's run on the lanes engine, seen from the event loop: submit, bridge committed tokens from the engine
thread into asyncio (a `Stream.subscribe` listener that hands each commit to the loop; no thread waits per
request), turn them into text cut at stop strings, and cancel the engine stream when the request ends early (stop
string, client gone, timeout, server stopping). Commits reach the loop through a `Handoff`: those an engine step makes
go together when the step ends, in one wake-up of the loop (docs/server.md, "One wake-up a round").

A chat reply of a model that reasons aloud (gpt-oss's channels, `<think>` tags: `moelane.model.reasoning`) is split:
the answer is the content, cut at stop strings; the reasoning comes as `Reasoning` pieces; the markup between them
is dropped, and so is the whitespace that opens each part. With `tool_calls`, a harmony message to a function comes
as one `ToolCall` piece once it has ended (formats that write calls as text are read by the app: `tools.py`; the
special tokens among their tags, `shown`, are written out in the content's text for it).

Invariants: every `Generation` that submitted a stream leaves it finished or cancelled when `run` returns or is
cancelled, so its KV cache and slot are freed; text past a stop string never leaves this module; the engine thread
never touches asyncio objects except through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from moelane.errors import MoelaneError, Unavailable
from moelane.lanes.stream import TokenLogprob
from moelane.model.grammar import Grammar
from moelane.model.reasoning import ANSWER, CALL, REASONING, Openings, splitter_for
from moelane.model.tokenizer import Detokenizer, StopFilter, Tokenizer
from moelane.server.calls import call_id, object_text
from moelane.server.protocol import FunctionCall, ToolCall
from moelane.server.responses import PagerCost

END = None  # queue sentinel: the engine stream has finished


class Handoff:
    """Committed tokens from the engine thread into one event loop's queues, one wake-up of the loop for many.

    Each wake-up writes the loop's self-pipe, which lets the loop take the GIL from the engine thread; one per commit
    had the loop detokenise and send each stream's token in turn between two streams' commits, a round of n streams
    waiting n times (docs/server.md). So a commit made on the engine thread during a step (`held()` true) only joins
    the pending ones, and `flush`, the engine's step hook, wakes the loop once for all of them; a commit from
    anywhere else (a listener's first call, on the loop; an engine without step hooks) wakes it at once.

    Invariant: tokens reach each queue in the order they were put, and none waits past the end of the step that put
    them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, held: Callable[[], bool] = lambda: False) -> None:
        self._loop, self._held = loop, held
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[list[int] | None], list[int] | None]] = []
        self._woken = False  # a wake-up is on its way: it will take whatever is pending when it runs

    def put(self, queue: asyncio.Queue[list[int] | None], tokens: list[int] | None) -> None:  # any thread
        with self._lock:
            self._pending.append((queue, tokens))
        if not self._held():
            self.flush()

    def flush(self) -> None:  # any thread
        with self._lock:
            if self._woken or not self._pending:
                return
            self._woken = True
        if not self._loop.is_closed():  # (the server stopped first: nobody is left to hand the tokens to)
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:  # on the loop
        with self._lock:
            pending, self._pending, self._woken = self._pending, [], False
        for queue, tokens in pending:
            queue.put_nowait(tokens)


class Reasoning(str):
    """A piece of a reply's reasoning (gpt-oss's analysis channel, a `<think>` block), not of its answer."""

    __slots__ = ()


class EngineError(MoelaneError):
    """The engine failed this request (the server and other requests go on)."""


class RequestTimeout(MoelaneError):
    """The request ran past its time limit or produced nothing for too long."""


class ServerStopping(MoelaneError):
    """The server is shutting down: it takes no new requests, and ends those still running when its grace is over
    (their engine streams are cancelled)."""


class StreamLike(Protocol):
    @property
    def finish_reason(self) -> str | None: ...

    def cancel(self) -> None: ...

    def subscribe(self, listener: Callable[[list[int] | None], None]) -> None: ...


class EngineLike(Protocol):
    def submit(
        self,
        token_ids: list[int],
        max_tokens: int = ...,
        temperature: float = ...,
        top_p: float = ...,
        top_k: int = ...,
        seed: int | None = ...,
        stop_token_ids: list[int] | None = ...,
        logit_bias: dict[int, float] | None = ...,
        presence_penalty: float = ...,
        frequency_penalty: float = ...,
        logprobs: int | None = ...,
        prompt_logprobs: bool = ...,
        grammar: Grammar | None = ...,
    ) -> Any: ...

    @property
    def n_active(self) -> int: ...

    @property
    def n_waiting(self) -> int: ...

    def stats(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class Limits:
    """request_s: wall time a request may take in all; idle_s: longest wait for the next token (queueing included)."""

    request_s: float = 600.0
    idle_s: float = 120.0

    def __post_init__(self) -> None:
        if not (self.request_s > 0 and self.idle_s > 0):
            raise ValueError(f"timeouts must be > 0, got request_s={self.request_s}, idle_s={self.idle_s}")


@dataclass(frozen=True, slots=True)
class GenerationParams:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stops: tuple[str, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: none; n: each token's log-probability and the n most likely
    prompt_logprobs: bool = False  # the prompt's tokens' too (completions with echo)
    reasoning: bool = False  # split the reply's reasoning from its answer, where the model writes both (chat)
    tool_calls: bool = False  # harmony's messages to functions are calls (else reasoning)
    primer: tuple[int, ...] = ()  # the prompt's last tokens, read as the reply's start (a forced call's opening)
    shown: frozenset[int] = frozenset()  # special tokens the content's text shows (a tool form's tags: `ToolUse`)
    grammar: Grammar | None = None  # what the reply is held to (each generation submits a copy of its own)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("empty prompt")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")


class Generation:
    """Use: `async for piece in gen.run(): ...`, then read `finish_reason`, `n_tokens`, `cost`."""

    def __init__(
        self,
        engine: EngineLike,
        tokenizer: Tokenizer,
        params: GenerationParams,
        limits: Limits,
        cost_of: Callable[[Any], PagerCost] | None = None,
        handoff: Handoff | None = None,
    ) -> None:
        """`handoff`: the server's, flushed by the engine's step hook (default: one of this generation's own, which
        wakes the loop at each commit)."""
        self.engine, self.params, self.limits = engine, params, limits
        self._handoff = handoff
        self._tokenizer = tokenizer
        self._detok, self._stops = Detokenizer(tokenizer, params.shown), StopFilter(params.stops)
        self._splitter = splitter_for(tokenizer, list(params.prompt_ids)) if params.reasoning else None
        self._reasoning = Detokenizer(tokenizer)
        self._openings = Openings()
        self._ids: list[int] = []  # the content's tokens
        self._call_ids: list[int] = []  # the arguments so far of a harmony call
        self._call_name: str | None = None  # the function of the harmony call being read (None: none is)
        if self._splitter is not None and params.primer:
            for token in params.primer:
                self._splitter.push(token)
            self._call_name = self._splitter.recipient if params.tool_calls else None
        self._n_chars = 0  # characters the detokenizer has let out
        self._cost_of = cost_of
        self.stream: Any = None
        self.finish_reason: str | None = None
        self.n_tokens = 0  # completion tokens that produced the text sent (up to and including a stop string)
        self.first_token_at: float | None = None
        self._logprobs: list[tuple[int, TokenLogprob | None, int]] = []  # (token, entry, where its text starts)
        self._logprobs_taken = 0

    @property
    def cost(self) -> PagerCost:
        if self._cost_of is None or self.stream is None:
            return PagerCost()
        return self._cost_of(self.stream)

    def submit(self) -> None:
        """Hand the request to the engine (raises `InputError` for a request the engine refuses)."""
        p = self.params
        self.stream = self.engine.submit(
            list(p.prompt_ids), max(p.max_tokens, 1), temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
            seed=p.seed,
            logit_bias=dict(p.logit_bias), presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs,
            grammar=p.grammar.fresh() if p.grammar is not None else None,
        )  # fmt: skip

    async def run(self) -> AsyncIterator[str | ToolCall]:
        """Text pieces as the engine commits tokens (`Reasoning` ones for a reply's reasoning, and `ToolCall`s);
        ends with `finish_reason` set to "stop" or "length"."""
        if self.stream is None:
            self.submit()
        stream = self.stream
        handoff = self._handoff or Handoff(asyncio.get_running_loop())
        queue: asyncio.Queue[list[int] | None] = asyncio.Queue()
        stream.subscribe(lambda tokens: handoff.put(queue, tokens))  # (on the engine thread, or here for the first)
        deadline = time.monotonic() + self.limits.request_s
        try:
            while True:
                batch = await self._next(queue, deadline)
                if batch is END:
                    break
                if self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                if not self.params.max_tokens:  # only the prompt was asked for: its one token is not part of it
                    continue
                thought, piece, calls = self._text(batch)
                if thought:
                    yield Reasoning(thought)
                for call in calls:
                    yield call
                if piece:
                    yield piece
                if self._stops.stopped:
                    self.finish_reason = "stop"
                    return
            if self._call_name is not None:  # a call ended by an end-of-sequence token (gpt-oss's <|call|> is one)
                if stream.finish_reason == "stop":
                    yield self._take_call()
                else:  # cut off by max_tokens: arguments, but not a call
                    yield Reasoning(self._tokenizer.decode(self._call_ids))
            if thought := self._opened(REASONING, self._reasoning.flush()):
                yield Reasoning(thought)
            if tail := self._tail():
                yield tail
            self.finish_reason = _finish(stream.finish_reason, stream.error) if self.params.max_tokens else "length"
        finally:
            stream.cancel()  # no-op once finished; frees the slot at the next round otherwise

    async def _next(self, queue: asyncio.Queue[list[int] | None], deadline: float) -> list[int] | None:
        """The committed tokens waiting in the queue (all of them, so one round's tokens travel together)."""
        wait = min(self.limits.idle_s, deadline - time.monotonic())
        try:
            first = await asyncio.wait_for(queue.get(), timeout=max(wait, 0.0))
        except TimeoutError:
            which = "request time limit" if time.monotonic() >= deadline else "idle time limit"
            raise RequestTimeout(f"the request ran past its {which}") from None
        if first is END:
            return END
        batch = list(first)
        while not queue.empty():
            more = queue.get_nowait()
            if more is END:
                queue.put_nowait(END)
                break
            batch.extend(more)
        return batch

    def _text(self, token_ids: list[int]) -> tuple[str, str, list[ToolCall]]:
        """Push tokens one by one, so `n_tokens` counts exactly the tokens up to a stop string. -> (reasoning,
        content) text, and the calls that ended."""
        out: list[str] = []
        thoughts: list[str] = []
        calls: list[ToolCall] = []
        for token in token_ids:
            part = ANSWER if self._splitter is None else self._splitter.push(token)
            recipient = self._splitter.recipient if self._splitter is not None and self.params.tool_calls else None
            if self._call_name is not None and recipient is None:  # the call's message has ended
                if isinstance(call := self._take_call(), ToolCall):
                    calls.append(call)
                else:
                    thoughts.append(call)
            self._call_name = recipient  # (set from the message's header on: a call's body may be empty)
            if part == CALL and recipient is None:  # (a request without tools: a message to a function is thought)
                part = REASONING
            if part == CALL:
                self.n_tokens += 1
                self._call_ids.append(token)
                continue
            if part != ANSWER:  # reasoning, or the markup around it
                self.n_tokens += 1
                if part is not None:
                    thoughts.append(self._opened(REASONING, self._reasoning.push([token])))
                continue
            if self.params.logprobs is not None:
                self._logprobs.append((token, self.stream.logprob(self.n_tokens), self._n_chars))
            self.n_tokens += 1
            self._ids.append(token)
            piece = self._detok.push([token])
            self._n_chars += len(piece)
            out.append(self._stops.push(self._opened(ANSWER, piece)))
            if self._stops.stopped:
                break
        return "".join(thoughts), "".join(out), calls

    def _take_call(self) -> ToolCall | Reasoning:
        """The harmony call just read, or its text as reasoning if its arguments are not a JSON object (as a
        `<tool_call>` block that is not a call stays text); an empty body is a call without arguments."""
        text = self._tokenizer.decode(self._call_ids).strip()
        name, self._call_ids, self._call_name = self._call_name, [], None
        assert name is not None
        if (arguments := object_text(text or "{}")) is None:
            return Reasoning(text)
        return ToolCall(id=call_id(), function=FunctionCall(name=name, arguments=arguments))

    def _opened(self, part: str, text: str) -> str:
        """`text` without the whitespace that opens a part of a split reply (`<think>\n`, `</think>\n\n`)."""
        return text if self._splitter is None else self._openings.trim(part, text)

    def prompt_logprobs(self) -> list[tuple[int, TokenLogprob | None, int]]:
        """(token, entry, where its text starts in the prompt) per prompt token, once the prompt has been read; the
        first token's entry is None (nothing predicts it)."""
        detok, at = Detokenizer(self._tokenizer), 0
        out: list[tuple[int, TokenLogprob | None, int]] = []
        for token, entry in zip(self.params.prompt_ids, self.stream.prompt_logprobs, strict=False):
            out.append((token, entry, at))
            at += len(detok.push([token]))
        return out

    def take_logprobs(self) -> list[tuple[int, TokenLogprob | None, int]] | None:
        """The (token, entry, text offset) of the tokens counted since the last call; None when not asked for."""
        if self.params.logprobs is None:
            return None
        fresh = self._logprobs[self._logprobs_taken :]
        self._logprobs_taken = len(self._logprobs)
        return fresh

    def _tail(self) -> str:
        """At the end: what the detokenizer held back (an unfinished character, shown as U+FFFD like a whole
        decode would) and what the stop filter held back, still cut at a stop string."""
        rest = self._tokenizer.decode(self._ids, self.params.shown)[self._n_chars :]
        text = self._stops.push(self._opened(ANSWER, rest)) if rest else ""
        return text + self._stops.flush()


def _finish(engine_reason: str | None, error: BaseException | None = None) -> str:
    if engine_reason in ("stop", "length"):
        return engine_reason
    if engine_reason == "error" and isinstance(error, Unavailable):  # (a rank of a distributed run failed: 503)
        raise Unavailable(f"the server cannot compute this request: {error}")
    if engine_reason == "error":  # a failure of ours (a truncated shard, say) says what it was; a bug does not
        said = f": {error}" if isinstance(error, MoelaneError) else ""
        raise EngineError(f"the engine failed while generating this request{said}")
    if engine_reason == "cancelled":  # (by none but the server's shutdown while the request runs: `ServerState`)
        raise ServerStopping("the server is shutting down; the request was ended before its reply was complete")
    raise EngineError(f"the request was ended by the engine ({engine_reason})")

"""`create_app(engine, lm, ...)`: the OpenAI-compatible FastAPI app over a lanes engine.

The engine runs rounds on its own thread (the app's lifespan starts and stops it unless told not to); handlers run
on the event loop and talk to it only through `Generation` (submit, token bridge, cancel). The lifespan also hangs
the app's `Handoff` on the engine's step hook, so each round's commits reach the loop in one wake-up. Admission is
bounded: at most `max_streams + max_queue` generation requests are in flight, the rest get 429 with `Retry-After`.

Invariants: every admitted request releases its admission slot and cancels its engine stream when it ends, however
it ends (done, stop string, client gone, timeout, error, shutdown); a failure inside one request answers that request
with an error body and leaves the server and the other requests running.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from moelane.errors import Unavailable
from moelane.model.grammar import Grammar
from moelane.server import errors
from moelane.server.auth import ApiKey
from moelane.server.chat_request import ChatCompletionRequest
from moelane.server.cost import PagerHooks
from moelane.server.dashboard import add_dashboard
from moelane.server.errors import ClientGone, Overloaded, sse_event
from moelane.server.events import Collected, EventStream, merged, whole_replies
from moelane.server.generation import Generation, GenerationParams, Handoff, Limits, Reasoning, ServerStopping
from moelane.server.metrics import ServerMetrics
from moelane.server.openapi import openapi_schema
from moelane.server.prompts import Prompts, bad_request, check_chat_template
from moelane.server.protocol import CompletionRequest, SamplingFields, ToolCall
from moelane.server.responses import (
    DONE,
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
    Header,
    Health,
    Logprobs,
    ModelCard,
    ModelList,
    PagerCost,
    Reply,
    logprobs_body,
)
from moelane.server.sampler import REQUEST_LOG, RequestLog, Sampler, prompt_text, request_row
from moelane.server.tools import HARMONY, ToolUse, split_reply

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left in context
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 404, 429, 500, 503, 504)
}


class ServerState:
    """What the handlers of one app share."""

    def __init__(
        self,
        engine: Any,
        lm: Any,
        model_name: str,
        max_streams: int,
        max_queue: int,
        limits: Limits,
        pager: PagerHooks | None,
        show_text: bool = False,
        request_log: int = REQUEST_LOG,
        fault: Callable[[], BaseException | None] | None = None,
    ) -> None:
        self.engine, self.lm, self.model_name, self.limits, self.pager = engine, lm, model_name, limits, pager
        self._fault = fault
        self.prompts = Prompts(lm, model_name)
        self.capacity = max_streams + max_queue
        self.max_streams = max_streams
        rank_counts = getattr(getattr(lm, "provider", None), "rank_counts", None)  # (a distributed run's)
        self.metrics = ServerMetrics(engine, pager.stats if pager else None, getattr(lm, "memory", None), rank_counts)
        self.requests = RequestLog(request_log)
        self.sampler = Sampler(engine, lm, model_name, self.requests, pager.stats if pager else None, show_text)
        self.in_flight = 0
        self.stopping = False
        self.handoff: Handoff | None = None  # set by the lifespan, on the loop it hands tokens to
        self.live: set[Generation] = set()
        self.created = int(time.time())
        self.token_text = functools.lru_cache(maxsize=1 << 16)(lambda token: str(lm.tokenizer.decode([token])))

    def problem(self) -> str | None:
        """What has failed of the parts the model runs on (a rank of a distributed run), or None: then the server
        is degraded, and answers every request with 503."""
        fault = self._fault() if self._fault is not None else None
        return None if fault is None else str(fault)

    # ---- admission ----------------------------------------------------------------------------------------------

    def admit(self, n: int = 1, param: str = "n") -> None:
        """Take `n` admission slots (one per choice: each is a stream of its own), or refuse; `param`: the field
        that asked for so many (`n`, or `prompt` for a list of prompts)."""
        if self.stopping:
            raise ServerStopping("the server is shutting down")
        if (problem := self.problem()) is not None:
            raise Unavailable(f"the server is degraded: {problem}")
        if n > self.capacity:
            raise bad_request(f"the request asks for {n} choices (n times the prompts); this server holds at most "
                              f"{self.capacity} at once", param)  # fmt: skip
        if self.in_flight + n > self.capacity:
            self.metrics.rejected.inc()
            waiting = max(1, self.in_flight - self.max_streams)
            raise Overloaded(f"the server is at capacity ({self.capacity} requests in flight); retry later",
                             retry_after_s=min(60, waiting))  # fmt: skip
        self.in_flight += n
        self.metrics.in_flight.set(self.in_flight)

    def release(self, gens: list[Generation], n: int) -> None:
        """Give back `n` admission slots and end the streams of `gens`."""
        self.in_flight -= n
        self.metrics.in_flight.set(self.in_flight)
        for gen in gens:
            self.live.discard(gen)
            if gen.stream is not None:
                gen.stream.cancel()

    # ---- serving ------------------------------------------------------------------------------------------------

    async def serve(self, request: Request, body: SamplingFields, prompts: list[tuple[list[int], str]],
                    limit: int | None, default: int | None, chat: bool,
                    tools: ToolUse | None = None, grammar: Grammar | None = None,
                    primer: tuple[int, ...] = ()) -> Response:  # fmt: skip
        """Answer a generation request. `prompts`: (token ids, echoed text) per prompt; each prompt gets `body.n`
        choices, each a stream of its own, indexed prompt by prompt. A seeded request's choice j of a prompt samples
        with seed + j, so that its choices differ and each can be reproduced alone. `tools`: how replies are read
        for tool calls; `grammar`: what the replies are held to (each choice gets its own copy); `primer`: the
        prompt's last tokens that the reply's channel splitter reads first (`Prompts.chat_prompt`)."""
        endpoint = "chat" if chat else "completions"
        top_logprobs, bias = body.top_logprobs_asked(), tuple(self.prompts.logit_bias(body).items())
        per_prompt = [
            GenerationParams(
                tuple(ids), self.prompts.budget(len(ids), limit, default, "messages" if chat else "prompt",
                                                body.limit_field()),
                temperature=body.temperature, top_p=body.top_p,
                top_k=body.top_k, seed=body.seed, stops=tuple(body.stop_list()),
                logit_bias=bias, presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty, logprobs=top_logprobs,
                prompt_logprobs=bool(echo) and top_logprobs is not None, reasoning=chat,
                tool_calls=tools is not None and tools.syntax == HARMONY,
                shown=frozenset(tools.shown if tools is not None else ()),
                primer=primer, grammar=grammar,
            )
            for ids, echo in prompts
        ]  # fmt: skip
        params = [p if p.seed is None else dataclasses.replace(p, seed=p.seed + j)
                  for p in per_prompt for j in range(body.n)]  # fmt: skip
        echoes = [echo for _, echo in prompts for _ in range(body.n)]
        gens = self.start(params, "n" if body.n > 1 else "prompt")
        prefix = "chatcmpl" if chat else "cmpl"
        usage_chunk = bool(body.stream and body.stream_options and body.stream_options.include_usage)
        header = Header(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), self.model_name, chat, usage_chunk)
        started = time.monotonic()
        n_prompt = sum(len(ids) for ids, _ in prompts)  # each prompt counted once, however many choices it has
        if body.stream:
            status = ["200"]  # how the stream ended, for the requests metric: set by _events
            events = self._events(gens, header, echoes, started, n_prompt, status, tools)
            return EventStream(events, on_close=lambda: self._close(gens, endpoint, status[0]))
        try:
            texts = await whole_replies(request, gens)
        except BaseException as e:
            if isinstance(e, ClientGone):
                self.metrics.cancelled.inc()
            self._close_sync(gens, endpoint, str(errors.describe(e)[0]) if isinstance(e, Exception) else "499")
            raise
        self._account(gens, started, n_prompt, header)
        self._close_sync(gens, endpoint, "200")
        replies = [
            self._reply(gen, echo, collected, chat, tools)
            for gen, echo, collected in zip(gens, echoes, texts, strict=True)
        ]
        usage = header.usage(n_prompt, sum(gen.n_tokens for gen in gens), gens)
        whole = header.whole(replies, usage, total_cost(gens)).model_dump(mode="json")
        for choice in whole["choices"]:  # a reply with no reasoning or calls says nothing of them, as OpenAI's do
            for key in ("reasoning_content", "tool_calls"):
                if "message" in choice and choice["message"].get(key) is None:
                    del choice["message"][key]
        return JSONResponse(whole)

    def _reply(self, gen: Generation, echo: str, collected: Collected, chat: bool, tools: ToolUse | None) -> Reply:
        """A finished choice's reply: its text (after the echoed prompt) read for tool calls if the request has
        tools, and its logprobs."""
        text, reasoning, calls = collected
        logprobs = logprobs_body(chat, self._echoed(gen, len(echo), gen.take_logprobs()), self.token_text)
        content: str | None = echo + text
        if tools is not None and (reader := tools.reader()) is not None:
            content, written = split_reply(text, reader, stopped=gen.finish_reason == "stop")
            calls = calls + written
        if tools is not None and not tools.parallel:
            calls = calls[:1]
        if tools is not None and not content:
            content = None  # no text beside the calls, as OpenAI's say it (and as the stream, which sends none)
        return Reply(content, finish_reason(gen, bool(calls), tools), logprobs, reasoning, tuple(calls))

    def start(self, params: list[GenerationParams], param: str = "n") -> list[Generation]:
        """Admit and submit one generation per choice (all or none); `param` as `admit` takes it."""
        self.admit(len(params), param)
        gens: list[Generation] = []
        try:
            for p in params:
                cost_of = self.pager.cost_of if self.pager is not None else None
                gen = Generation(self.engine, self.lm.tokenizer, p, self.limits, cost_of, self.handoff)
                gen.submit()
                if self.pager is not None:
                    self.pager.track(gen.stream)
                gens.append(gen)
                self.live.add(gen)
        except BaseException:
            self.release(gens, len(params))
            raise
        return gens

    async def _events(self, gens: list[Generation], header: Header, echoes: list[str], started: float,
                      n_prompt: int, status: list[str], tools: ToolUse | None) -> AsyncIterator[str]:  # fmt: skip
        """The stream of events of a request: its choices' chunks as they come (each choice's in order), then
        usage if asked, then [DONE]; an error ends it with an error event. `status[0]` becomes the HTTP status the
        request would have had unstreamed (499: the client went away)."""
        try:
            choices = [self._choice_events(g, header, e, i, tools)
                       for i, (g, e) in enumerate(zip(gens, echoes, strict=True))]  # fmt: skip
            async with contextlib.aclosing(merged(choices)) as chunks:
                async for chunk in chunks:
                    yield chunk
            if header.include_usage:
                yield header.usage_chunk(header.usage(n_prompt, sum(gen.n_tokens for gen in gens), gens))
            self._account(gens, started, n_prompt, header, count_rate=False)
        except asyncio.CancelledError:
            self.metrics.cancelled.inc()
            status[0] = "499"
            raise
        except Exception as e:
            code, body = errors.describe(e)
            status[0] = str(code)
            yield sse_event(body)
        yield DONE

    async def _choice_events(self, gen: Generation, header: Header, echo: str, index: int,
                             tools: ToolUse | None) -> AsyncGenerator[str, None]:  # fmt: skip
        """One choice's chunks: (chat) its role, the echoed prompt, its text as it comes and its tool calls, its
        finish reason."""
        if first := header.first(index, tools is not None):
            yield first
        reader = tools.reader() if tools is not None else None
        one_call = tools is not None and not tools.parallel
        # A scored echo waits for the prompt's entries, which the first reply token comes after.
        late_echo = bool(echo) and gen.params.prompt_logprobs
        if echo and not late_echo:
            yield header.piece(echo, index=index)
        sent, calls = 0, list[ToolCall]()
        async for piece in gen.run():
            self.metrics.rate.add(gen.n_tokens - sent)
            sent = gen.n_tokens
            if isinstance(piece, Reasoning):
                yield header.piece(piece, index=index, reasoning=True)
                continue
            if late_echo:
                yield self._scored_echo(gen, header, echo, index)
                late_echo = False
            parts = reader.feed(piece) if reader is not None and isinstance(piece, str) else [piece]
            for chunk in self._chunks(gen, header, parts, calls, index, len(echo), one_call):
                yield chunk
        if late_echo:  # no reply text at all (max_tokens 0, or a stop at once)
            yield self._scored_echo(gen, header, echo, index)
        for chunk in self._chunks(
            gen, header, reader.end(gen.finish_reason == "stop") if reader else [], calls, index, len(echo), one_call
        ):
            yield chunk
        yield header.last(
            finish_reason(gen, bool(calls), tools), gen.cost, self._fresh_logprobs(gen, header, len(echo)), index
        )

    def _chunks(self, gen: Generation, header: Header, parts: list[str | ToolCall], calls: list[ToolCall], index: int,
                offset: int, one_call: bool) -> list[str]:  # fmt: skip
        """The chunks of a choice's text pieces and tool calls, each call whole in a chunk of its own; `calls`: the
        choice's calls sent so far, to which these are added (with `one_call`, only a first one is sent)."""
        chunks = []
        for part in parts:
            if not isinstance(part, ToolCall):
                chunks.append(header.piece(part, self._fresh_logprobs(gen, header, offset), index))
            elif not (one_call and calls):
                chunks.append(header.calls([part], len(calls), self._fresh_logprobs(gen, header, offset), index))
                calls.append(part)
        return chunks

    def _fresh_logprobs(self, gen: Generation, header: Header, offset: int = 0) -> BaseModel | None:
        """The logprobs of the tokens counted since the last chunk, if the request asked and there are any."""
        fresh = gen.take_logprobs()
        return logprobs_body(header.chat, fresh, self.token_text, offset) if fresh else None

    def _scored_echo(self, gen: Generation, header: Header, echo: str, index: int) -> str:
        return header.piece(echo, logprobs_body(False, gen.prompt_logprobs(), self.token_text), index)

    @staticmethod
    def _echoed(gen: Generation, n_echo: int, entries: Logprobs | None) -> Logprobs | None:
        """A whole reply's entries: an echoed prompt's first, then the reply's, their offsets after the prompt."""
        if entries is None or not gen.params.prompt_logprobs:
            return entries
        return gen.prompt_logprobs() + [(t, e, at + n_echo) for t, e, at in entries]

    def _account(self, gens: list[Generation], started: float, n_prompt: int, header: Header,
                 count_rate: bool = True) -> None:  # fmt: skip
        """A finished request in the metrics and the dashboard's request log, once, however many choices it had."""
        if count_rate:
            self.metrics.rate.add(sum(gen.n_tokens for gen in gens))
        choices = [(gen.n_tokens, gen.first_token_at) for gen in gens]
        cost = total_cost(gens)
        self.metrics.observe_request(n_prompt, started, choices, cost)
        text = prompt_text(self.lm.tokenizer, gens[0].params.prompt_ids) if self.sampler.show_text else None
        self.requests.add(request_row(header.id, header.chat, gens, started, n_prompt, cost, text))

    async def _close(self, gens: list[Generation], endpoint: str, status: str) -> None:
        self._close_sync(gens, endpoint, status)

    def _close_sync(self, gens: list[Generation], endpoint: str, status: str) -> None:
        self.metrics.requests.labels(endpoint, status).inc()
        self.release(gens, len(gens))

    def hand_over(self, loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
        """Give the generations a `Handoff` into `loop`, flushed by the engine's step hook where it has one (an
        engine without, such as a test's stand-in, has each commit wake the loop). Returns what undoes the hook."""
        add_hook = getattr(self.engine, "add_step_hook", None)
        if add_hook is None:
            self.handoff = Handoff(loop)
            return lambda: None
        self.handoff = Handoff(loop, self.engine.on_engine_thread)
        return add_hook(self.handoff.flush)  # type: ignore[no-any-return]

    def shutdown(self) -> None:
        """Refuse new requests and cancel the running ones (their handlers then end cleanly)."""
        self.stopping = True
        for gen in list(self.live):
            if gen.stream is not None:
                gen.stream.cancel()


def finish_reason(gen: Generation, made_calls: bool, tools: ToolUse | None = None) -> str:
    """A choice's finish reason, as OpenAI's: a reply that ended by itself after calling tools says so, unless
    `tool_choice` named the function (then OpenAI's says "stop")."""
    assert gen.finish_reason is not None
    named = tools is not None and tools.named
    return "tool_calls" if made_calls and gen.finish_reason == "stop" and not named else gen.finish_reason


def total_cost(gens: list[Generation]) -> PagerCost:
    """What a request's choices together cost the pager."""
    costs = [gen.cost for gen in gens]
    return PagerCost(
        experts_fetched=sum(c.experts_fetched for c in costs),
        bytes_fetched=sum(c.bytes_fetched for c in costs),
        stall_ms=sum(c.stall_ms for c in costs),
    )


def create_app(
    engine: Any,
    lm: Any,
    *,
    model_name: str = "moelane",
    max_queue: int = 64,
    max_streams: int | None = None,
    limits: Limits | None = None,
    pager: PagerHooks | None = None,
    manage_engine: bool = True,
    max_body_bytes: int = errors.MAX_BODY_BYTES,
    api_key: str | None = None,
    show_text: bool = False,
    request_log: int = REQUEST_LOG,
    fault: Callable[[], BaseException | None] | None = None,
) -> FastAPI:
    """The app. `engine`: a lanes `Engine` (or anything with its interface); `lm`: the model it serves (tokenizer,
    `max_context`, `vocab_size`). `max_streams` defaults to the engine's. `pager`: an expert store's ledger
    (`cost.pager_hooks`): each request's pager cost (default zeros) and the store's counters. `manage_engine`: the
    app's lifespan starts and stops the engine thread. A request body over `max_body_bytes` gets 413 unread. With
    `api_key`, every endpoint but /health wants it as a bearer token (auth.py). The dashboard (`/dashboard`,
    `/v1/stats`) lists the last `request_log` requests, with their prompts' first characters if `show_text`.
    `fault`: what has failed of the parts the model runs on, or None (a distributed run's failed rank): while it
    says something, /health says "degraded" and requests get 503. ModelLoadError if the model's chat template
    cannot be compiled."""
    if max_queue < 0:
        raise ValueError(f"max_queue must be >= 0, got {max_queue}")
    check_chat_template(lm.tokenizer)
    streams = max_streams if max_streams is not None else engine.config.max_streams
    state = ServerState(engine, lm, model_name, streams, max_queue, limits or Limits(), pager,
                        show_text, request_log, fault)  # fmt: skip

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        unhook = state.hand_over(asyncio.get_running_loop())
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            state.shutdown()
            if manage_engine:
                await asyncio.get_running_loop().run_in_executor(None, engine.stop)
            unhook()

    app = FastAPI(title="moelane", version="0.1.0", lifespan=lifespan)
    app.state.moelane = state
    errors.install(app, max_body_bytes)
    if api_key is not None:  # (added last: the outermost middleware, so a refused request is never read)
        app.add_middleware(ApiKey, key=api_key)
    add_routes(app, state)
    add_dashboard(app, state.sampler)
    app.openapi = lambda: openapi_schema(  # type: ignore[method-assign]
        app, model_name, int(lm.max_context), state.prompts.tools.why_not or None
    )
    return app


def add_routes(app: FastAPI, state: ServerState) -> None:
    # (GET's route first: a 405 for another method then says `Allow: GET`, the schema's one method)
    @app.head("/health", include_in_schema=False)  # (what load balancers' and uptime checks often send)
    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health() -> JSONResponse:
        problem = state.problem()
        status: Literal["ok", "stopping", "degraded"] = (
            "stopping" if state.stopping else "degraded" if problem is not None else "ok"
        )
        body = Health(status=status, active_streams=state.engine.n_active, waiting_streams=state.engine.n_waiting,
                      problem=problem)  # fmt: skip
        return JSONResponse(body.model_dump(exclude_none=True), status_code=200 if status == "ok" else 503)

    def card() -> ModelCard:
        return ModelCard(id=state.model_name, created=state.created, max_model_len=state.lm.max_context)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses={404: {"model": ErrorResponse}})
    async def model_card(model: str) -> ModelCard:  # (`path`: served ids may hold a slash, "org/name")
        state.prompts.check_model(model)
        return card()

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics() -> Response:
        body = await run_in_threadpool(state.metrics.render)  # (a distributed run's waits for its ranks' counters)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        state.prompts.check_model(body.model)
        prompts = await run_in_threadpool(state.prompts.completion_prompts, body)
        grammar = await run_in_threadpool(state.prompts.grammar, body)
        return await state.serve(request, body, prompts, body.max_tokens, DEFAULT_COMPLETION_TOKENS, False,
                                 grammar=grammar)  # fmt: skip

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        state.prompts.check_model(body.model)
        tools = state.prompts.tool_use(body)
        grammar = await run_in_threadpool(state.prompts.grammar, body)
        if grammar is not None and tools is not None and tools.opening:
            raise bad_request("response_format asks for a JSON reply, and tool_choice for a tool call; ask for one",
                              "response_format")  # fmt: skip
        prompt_ids, primer = await run_in_threadpool(state.prompts.chat_prompt, body, tools, grammar is not None)
        if grammar is None:
            grammar = await run_in_threadpool(state.prompts.call_grammar, body, tools)
        if body.max_completion_tokens is not None and body.max_tokens is not None:
            state.prompts.budget(len(prompt_ids), body.max_tokens, None, "messages")  # the one not used must fit too
        return await state.serve(request, body, [(prompt_ids, "")], body.token_limit(), None, True, tools, grammar,
                                 primer)  # fmt: skip

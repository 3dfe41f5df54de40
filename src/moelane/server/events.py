"""Waiting on generations for the server: `whole_replies` gathers a request's whole replies while watching for the
client to go away; `merged` interleaves several choices' event streams, and `EventStream` is a server-sent-events
response that runs its close hook however the response ends (the hook releases the request's admission slots and
cancels its engine streams)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, cast

from fastapi import Request
from fastapi.responses import StreamingResponse

from moelane.server.errors import ClientGone
from moelane.server.generation import Generation, Reasoning
from moelane.server.protocol import ToolCall

Collected = tuple[str, str | None, list[ToolCall]]  # a whole reply's text, reasoning, and calls read token by token


async def merged(sources: list[AsyncGenerator[str, None]]) -> AsyncGenerator[str, None]:
    """The items of several async iterators, each source's in its order, as they come. An error in one source is
    raised here (and ends the others); closing this ends them all."""
    queue: asyncio.Queue[str | BaseException | None] = asyncio.Queue()  # None: a source has ended

    async def pump(source: AsyncGenerator[str, None]) -> None:
        try:
            async for item in source:
                queue.put_nowait(item)
        except Exception as e:
            queue.put_nowait(e)
        finally:
            queue.put_nowait(None)
            with contextlib.suppress(BaseException):
                await source.aclose()

    tasks = [asyncio.ensure_future(pump(source)) for source in sources]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t


class EventStream(StreamingResponse):
    """Server-sent events whose `on_close` runs however the response ends (even if its body never started)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self._on_close()


async def whole_replies(request: Request, gens: list[Generation]) -> list[Collected]:
    """The whole replies (text, reasoning or None, the calls the generation read); cancels the generations if
    the client goes away while waiting (then ClientGone)."""

    async def join(gen: Generation) -> Collected:
        pieces = [piece async for piece in gen.run()]
        thoughts = [p for p in pieces if isinstance(p, Reasoning)]
        calls = [p for p in pieces if isinstance(p, ToolCall)]
        text = "".join(p for p in pieces if isinstance(p, str) and not isinstance(p, Reasoning))
        return text, "".join(thoughts) if thoughts else None, calls

    async def gone() -> None:  # the body has been read: what the server receives next is the disconnect
        with contextlib.suppress(Exception):  # a broken receive channel means the client is gone too
            while (await request.receive())["type"] != "http.disconnect":
                pass

    tasks = [asyncio.ensure_future(join(gen)) for gen in gens]
    every: asyncio.Future[list[Collected]] = asyncio.gather(*tasks)
    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait([every, cast(asyncio.Future[Any], watch)], return_when=asyncio.FIRST_COMPLETED)
        if every.done():
            return every.result()
        raise ClientGone("the client disconnected")
    finally:
        # the gathering future first: cancelling it cancels the tasks, and awaiting it retrieves its outcome
        # (a gather left holding a child's CancelledError is logged as "exception was never retrieved")
        others: list[asyncio.Future[Any]] = [every, *tasks, watch]
        for t in others:
            if not t.done():
                t.cancel()
                with contextlib.suppress(BaseException):
                    await t

"""Streaming plumbing of the server: `merged` interleaves several choices' event streams, and `EventStream` is
a server-sent-events response that runs its close hook however the response ends (the hook releases the request's
admission slots and cancels its engine streams)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi.responses import StreamingResponse


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

"""Streaming and cancellation: a handler cancelled when its client disconnects, a StreamingResponse that
watches for the disconnect (and for a client that stopped reading), SSE framing, and merging several
generations into one stream.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from tokenloom.core.json_types import JsonObject
from tokenloom.entrypoints.openai.errors import engine_error_to_api_error, error_body
from tokenloom.outputs import RequestOutput

logger = logging.getLogger("tokenloom.server")

T = TypeVar("T")


def sse(data: JsonObject | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def stream_error_chunk(exc: BaseException) -> str:
    err = engine_error_to_api_error(exc)
    body = error_body(err.message, err.error_type, err.param, err.code)
    body["error"]["status_code"] = err.status_code
    return sse(body)


async def final_output(gen: AsyncIterator[RequestOutput],
                       to_api_error: Callable[[BaseException], Exception] = engine_error_to_api_error) -> RequestOutput:
    """A non-streamed answer's last output (the whole text so far); an engine error becomes the API's own
    error (`to_api_error`), raised without the engine's traceback."""
    final: RequestOutput | None = None
    try:
        async for out in gen:
            final = out
    except Exception as e:  # noqa: BLE001 - mapped to the API's error
        raise to_api_error(e) from None
    if final is None:
        raise to_api_error(RuntimeError("the engine ended the request without an output"))
    return final


async def run_cancellable(raw_request: Request, coro: Awaitable[T]) -> T | None:
    """Await `coro`, cancelling it if the client disconnects first (then returns None)."""
    task = asyncio.ensure_future(coro)

    async def wait_disconnect() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - the client is gone; nothing to report to it
        pass
    return None


class StalledClientError(Exception):
    """The client took no chunk of a streamed response for the write timeout."""


class DisconnectAwareStreamingResponse(StreamingResponse):
    """Streams the body while listening for the client's disconnect, whatever the ASGI spec
    version: on disconnect the body iterator is cancelled, which aborts the request. A client
    that takes no chunk for `write_timeout` seconds (it stopped reading) gets the same: the
    stream ends and the connection closes, so it holds no server resources."""

    def __init__(self, content: AsyncIterator[str], *, write_timeout: float | None = None,
                 media_type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(content, media_type=media_type, headers=headers)
        self.write_timeout = write_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeout = self.write_timeout

        async def timed_send(message: Message) -> None:
            if timeout is None:
                return await send(message)
            try:
                await asyncio.wait_for(send(message), timeout)
            except asyncio.TimeoutError:
                raise StalledClientError(f"the client read nothing for {timeout:g} s") from None

        stream_task = asyncio.ensure_future(self.stream_response(timed_send))

        async def wait_disconnect() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(wait_disconnect())
        try:
            done, _ = await asyncio.wait({stream_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            stream_task.cancel()
            watcher.cancel()
            await self._close_body()
            raise
        if watcher in done:
            stream_task.cancel()
            try:
                await stream_task
            except BaseException:  # noqa: BLE001
                pass
            await self._close_body()
            return
        watcher.cancel()
        exc = stream_task.exception()
        if isinstance(exc, StalledClientError):
            logger.warning("ending a stalled stream: %s", exc)
            await self._close_body()  # aborts the request in the engine now, not at garbage collection
            return  # the server closes a connection whose response is incomplete
        stream_task.result()

    async def _close_body(self) -> None:
        close = getattr(self.body_iterator, "aclose", None)
        if close is not None:
            try:
                await close()
            except BaseException:  # noqa: BLE001 - closing only
                pass


async def merge_generators(gens: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators, yielding (index, item); closes all on exit."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, object, BaseException | None]] = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator[T]) -> None:
        try:
            async for item in gen:
                await queue.put((i, item, None))
        except BaseException as e:  # noqa: BLE001 - re-raised by the consumer
            await queue.put((i, None, e))
            return
        await queue.put((i, done, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item, exc = await queue.get()
            if exc is not None:
                if isinstance(exc, asyncio.CancelledError):
                    raise RuntimeError("a generation was cancelled")
                raise exc
            if item is done:
                remaining -= 1
                continue
            yield i, item  # type: ignore[misc]
    finally:
        for t in tasks:
            t.cancel()
        # Let each cancelled pump unwind its generator (which aborts its request).
        await asyncio.gather(*tasks, return_exceptions=True)

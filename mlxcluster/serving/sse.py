"""Server-sent events and client-disconnect handling, shared by the provider API
(:mod:`mlxcluster.serving.api`) and the marketplace router (:mod:`mlxcluster.router.server`).

A stream of OpenAI chunk dicts is written as ``data: {json}\\n\\n`` events and
ends with ``data: [DONE]\\n\\n`` (OpenAI's streaming format); an error after the
``200`` went out is one ``data: {"error": {...}}`` event before ``[DONE]`` (the
``openai`` client raises it).  While a response is produced the client's
``http.disconnect`` is watched; when it comes, the work is cancelled and the
chunk iterator closed (which cancels the generation upstream).

Imports Starlette only (no MLX, no gRPC), so the router stays light.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, Optional, TypeVar

from starlette.responses import Response

from ..protocol.errors import OpenAIError

__all__ = ["ClientGone", "EventStream", "event", "next_chunk", "unless_disconnected", "usage_rule",
           "wait_disconnect"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


async def wait_disconnect(receive) -> None:
    """Return when the ASGI ``receive`` channel reports ``http.disconnect``
    (the request body must already have been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` while watching ``receive`` for the client's disconnect.

    Raises:
        ClientGone: the client disconnected first (``awaitable`` is cancelled).
        Whatever ``awaitable`` raises.
    """
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def next_chunk(chunks: AsyncIterator[T]) -> Optional[T]:
    """The iterator's next item, or ``None`` once it is exhausted."""
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None


def event(data: Any) -> bytes:
    """One SSE event: ``data: <compact JSON of data>\\n\\n`` (``bytes`` are written as they are)."""
    body = data if isinstance(data, bytes) else json.dumps(data, separators=(",", ":")).encode()
    return b"data: " + body + b"\n\n"


def usage_rule(chunk: Dict[str, Any], include_usage: bool) -> Optional[Dict[str, Any]]:
    """OpenAI's ``stream_options.include_usage``: without it no chunk carries
    ``usage`` (a usage-only chunk is dropped: ``None``; a chunk with choices
    loses the field); with it chunks pass unchanged."""
    if include_usage or not chunk.get("usage"):
        return chunk
    if not chunk.get("choices"):
        return None
    return {k: v for k, v in chunk.items() if k != "usage"}


class EventStream(Response):
    """``text/event-stream`` response of a chunk stream.

    Args:
        chunks: async iterator of chunk dicts.  An item, or a raised exception,
            that is an :class:`~mlxcluster.protocol.errors.OpenAIError` becomes
            the error event and ends the stream; any other exception becomes a
            500 ``server_error`` event.  Always closed (``aclose``) when the
            response ends, the client going away included.
        first: a chunk already taken off ``chunks`` (to answer errors with their
            own HTTP status before the ``200``), written first; ``None``: none.
        include_usage: the request's ``stream_options.include_usage`` (:func:`usage_rule`).
        on_end: called once as ``on_end(error, complete)``: the error event
            written (or ``None``) and whether the stream reached ``[DONE]``
            (``False``: the client went away first).
    """

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[Any], first: Optional[Dict[str, Any]] = None,
                 include_usage: bool = True,
                 on_end: Optional[Callable[[Optional[OpenAIError], bool], None]] = None):
        # No body attribute: Response.init_headers would declare Content-Length.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.chunks = chunks
        self.first = first
        self.include_usage = include_usage
        self.on_end = on_end
        self.error: Optional[OpenAIError] = None
        self.complete = False

    async def _write(self, send, item: Any) -> bool:
        """Write one item; ``False`` once an error event ended the stream."""
        if isinstance(item, OpenAIError):
            self.error = item
            await send({"type": "http.response.body", "body": event(item.to_dict()), "more_body": True})
            return False
        chunk = usage_rule(item, self.include_usage)
        if chunk is not None:
            await send({"type": "http.response.body", "body": event(chunk), "more_body": True})
        return True

    async def _next(self) -> Any:
        """The next item (``None`` at the end); an exception the iterator raises becomes its error."""
        try:
            return await next_chunk(self.chunks)
        except OpenAIError as exc:
            return exc
        except Exception as exc:
            log.exception("event stream failed")
            return OpenAIError(500, f"internal error: {str(exc)[:200]}", "server_error")

    async def _produce(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        item = self.first if self.first is not None else await self._next()
        while item is not None and await self._write(send, item):
            item = await self._next()
        await send({"type": "http.response.body", "body": event(b"[DONE]"), "more_body": False})
        self.complete = True

    async def __call__(self, scope, receive, send) -> None:
        producer = asyncio.ensure_future(self._produce(send))
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (producer, watcher):
                task.cancel()
            results = await asyncio.gather(producer, watcher, return_exceptions=True)
            await self.chunks.aclose()
            if self.on_end is not None:
                self.on_end(self.error, self.complete)
        if isinstance(results[0], Exception):  # e.g. OSError: the client went away while we wrote
            log.debug("event stream ended with %r", results[0])

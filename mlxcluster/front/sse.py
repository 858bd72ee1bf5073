"""Answering an OpenAI chunk stream over HTTP, shared by the provider API
(:mod:`mlxcluster.front.api`) and the marketplace router (:mod:`mlxcluster.router.server`).

:func:`respond` answers a request from its stream of OpenAI chunk dicts: with
``"stream": true`` as server-sent events (:class:`EventStream`), written as
``data: {json}\\n\\n`` events ending with ``data: [DONE]\\n\\n`` (OpenAI's
streaming format); an error after the ``200`` went out is one
``data: {"error": {...}}`` event before ``[DONE]`` (the ``openai`` client
raises it).  Otherwise the chunks are folded into one ``chat.completion`` /
``text_completion`` object (:func:`collect`, :func:`fold_chunks`).  While a
response is produced the client's ``http.disconnect`` is watched; when it
comes, the work is cancelled and the chunk iterator closed (which cancels the
generation upstream).

Imports Starlette only (no MLX, no gRPC), so the router stays light.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, Iterable, List, Optional, TypeVar

from starlette.responses import JSONResponse, Response

from ..protocol.errors import OpenAIError

__all__ = ["ClientGone", "EventStream", "Timing", "collect", "event", "fold_chunks", "next_chunk", "respond",
           "stream_flag", "unless_disconnected", "usage_rule", "wait_disconnect"]

log = logging.getLogger(__name__)

T = TypeVar("T")
#: ``on_end(error, complete)``: the OpenAI error the answer ended with (or
#: ``None``) and whether it was complete (``False``: the client went away first).
OnEnd = Callable[[Optional[OpenAIError], bool], None]


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


class Timing:
    """When one answer's phases happened, on ``time.monotonic_ns()``: ``arrival`` (created), ``start``
    (the request handed to generation: :meth:`started`), ``first`` (the first chunk with choices:
    the provider sends it with the first generated token) and ``end`` (the chunk stream ran out),
    recorded by :meth:`watch`."""

    def __init__(self) -> None:
        self.arrival = time.monotonic_ns()
        self.start: Optional[int] = None
        self.first: Optional[int] = None
        self.end: Optional[int] = None

    def started(self) -> None:
        self.start = time.monotonic_ns()

    async def watch(self, chunks: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """``chunks``, unchanged, noting ``first`` and ``end``; closing this closes ``chunks``."""
        try:
            async for item in chunks:
                if self.first is None and isinstance(item, dict) and item.get("choices"):
                    self.first = time.monotonic_ns()
                yield item
            self.end = time.monotonic_ns()
        finally:
            await chunks.aclose()

    def durations(self) -> Dict[str, int]:
        """Nanoseconds (Ollama's fields): ``load`` (arrival to start: translation), ``prompt_eval``
        (start to the first token: tokenising, queueing, prefill), ``eval`` (first token to the end),
        ``total`` (arrival to the end; now when the stream has not ended)."""
        end = self.end if self.end is not None else time.monotonic_ns()
        start = self.start if self.start is not None else self.arrival
        first = self.first if self.first is not None else end
        return {"load": start - self.arrival, "prompt_eval": first - start, "eval": end - first,
                "total": end - self.arrival}


def stream_flag(body: Dict[str, Any]) -> bool:
    """An OpenAI request's ``stream`` (absent or null: false).

    Raises:
        OpenAIError: 400 on ``stream`` when it is not a boolean."""
    value = body.get("stream")
    if value is None:
        return False
    if not isinstance(value, bool):
        raise OpenAIError(400, f"'stream' must be a boolean, got {json.dumps(value)[:40]}",
                          "invalid_request_error", "stream")
    return value


def event(data: Any) -> bytes:
    """One SSE event: ``data: <compact JSON of data>\\n\\n`` (``bytes`` are written as they are)."""
    body = data if isinstance(data, bytes) else json.dumps(data, separators=(",", ":")).encode()
    return b"data: " + body + b"\n\n"


def usage_rule(chunk: Dict[str, Any], include_usage: bool) -> Optional[Dict[str, Any]]:
    """OpenAI's ``stream_options.include_usage``: only the last, choice-less chunk carries
    ``usage``, and only with it (without: that chunk is dropped, ``None``); a chunk with
    choices never does (the provider's first chunk carries the prompt's size for the other
    dialects: it loses the field)."""
    if "usage" not in chunk:
        return chunk
    if not chunk.get("choices"):
        return chunk if include_usage else None
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
                 include_usage: bool = True, on_end: Optional[OnEnd] = None):
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
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # ours: the client went away
                raise
            # a cancellation from inside the iterator (e.g. a gRPC call cancelled under it) must
            # not end the response unfinished: the client gets an error event and [DONE]
            log.exception("event stream failed: cancelled from inside")
            return OpenAIError(500, "internal error: the answer's stream was cancelled", "server_error")
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


# -- non-streaming answers ---------------------------------------------------------------
def fold_chunks(chunks: Iterable[Dict[str, Any]], chat: bool) -> Dict[str, Any]:
    """Fold streamed chunks into one non-streaming object.

    Args:
        chunks: ``chat.completion.chunk`` dicts (``chat``) or ``text_completion`` dicts.
        chat: fold ``delta``s into ``message``s (role, content, other string
            fields, ``tool_calls`` joined by index) instead of joining ``text``.

    Returns:
        A ``chat.completion`` or ``text_completion`` dict: ``id``, ``created``
        and ``model`` of the first chunk with an id, one choice per ``index``
        with the last ``finish_reason`` and the merged ``logprobs``, and the
        last ``usage`` seen (absent when none).
    """
    chunks = list(chunks)
    head = next((c for c in chunks if c.get("id")), chunks[0] if chunks else {})
    usage = None
    choices: Dict[int, dict] = {}
    for chunk in chunks:
        if chunk.get("usage"):
            usage = chunk["usage"]
        for ch in chunk.get("choices") or []:
            idx = int(ch.get("index") or 0)
            st = choices.setdefault(idx, {"finish_reason": None, "logprobs": None, "text": [], "role": None,
                                          "fields": {}, "tool_calls": {}})
            if ch.get("finish_reason"):
                st["finish_reason"] = ch["finish_reason"]
            if ch.get("stop_reason") is not None:
                st["stop_reason"] = ch["stop_reason"]
            if ch.get("logprobs"):
                st["logprobs"] = _merge_logprobs(st["logprobs"], ch["logprobs"])
            if not chat:
                st["text"].append(ch.get("text") or "")
                continue
            for key, value in (ch.get("delta") or {}).items():
                if key == "role":
                    st["role"] = st["role"] or value
                elif key == "tool_calls" and value:
                    for tc in value:
                        slot = st["tool_calls"].setdefault(int(tc.get("index") or 0), {
                            "id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                        slot["id"] = tc.get("id") or slot["id"]
                        slot["type"] = tc.get("type") or slot["type"]
                        fn = tc.get("function") or {}
                        slot["function"]["name"] += fn.get("name") or ""
                        slot["function"]["arguments"] += fn.get("arguments") or ""
                elif isinstance(value, str):
                    st["fields"][key] = st["fields"].get(key, "") + value
    out_choices = []
    for idx in sorted(choices):
        st = choices[idx]
        if chat:
            fields = st["fields"]
            tool_calls = [st["tool_calls"][i] for i in sorted(st["tool_calls"])]
            content = fields.pop("content", None if tool_calls else "")
            message = {"role": st["role"] or "assistant", "content": None if tool_calls and not content else content,
                       "refusal": fields.pop("refusal", None), **fields}
            if tool_calls:
                message["tool_calls"] = tool_calls
            out_choices.append({"index": idx, "message": message, "logprobs": st["logprobs"],
                                "finish_reason": st["finish_reason"]})
        else:
            out_choices.append({"index": idx, "text": "".join(st["text"]), "logprobs": st["logprobs"],
                                "finish_reason": st["finish_reason"]})
        if "stop_reason" in st:
            out_choices[-1]["stop_reason"] = st["stop_reason"]
    result = {"id": head.get("id") or f"cmpl-{uuid.uuid4().hex}",
              "object": "chat.completion" if chat else "text_completion",
              "created": head.get("created") or int(time.time()), "model": head.get("model", ""),
              "choices": out_choices}
    if chat or head.get("system_fingerprint"):
        result["system_fingerprint"] = head.get("system_fingerprint")
    if usage is not None:
        result["usage"] = usage
    return result


def _merge_logprobs(acc: Any, lp: Any) -> Any:
    """``logprobs`` of one more chunk added to ``acc``: lists (``content``,
    ``tokens``, ...) are extended, other fields kept from the first chunk."""
    if acc is None:
        return copy.deepcopy(lp)
    if isinstance(acc, dict) and isinstance(lp, dict):
        for key, value in lp.items():
            if isinstance(value, list) and isinstance(acc.get(key), list):
                acc[key].extend(value)
            elif acc.get(key) is None:
                acc[key] = value
    return acc


async def collect(chunks: AsyncIterator[Any], chat: bool) -> Dict[str, Any]:
    """Read a chunk stream to its end and fold it (:func:`fold_chunks`); closes the stream.

    Raises:
        OpenAIError: an item of the stream is one (an error after content), or
            the stream raised it.
    """
    items: List[Dict[str, Any]] = []
    try:
        async for item in chunks:
            if isinstance(item, OpenAIError):
                raise item
            items.append(item)
    finally:
        await chunks.aclose()
    return fold_chunks(items, chat)


async def respond(receive, body: Dict[str, Any], chunks: AsyncIterator[Any], *, chat: bool,
                  on_end: Optional[OnEnd] = None, dialect=None, timing: Optional[Timing] = None) -> Response:
    """The HTTP answer of an OpenAI request whose result is the chunk stream ``chunks``.

    ``body["stream"]`` true: an :class:`EventStream` (honouring
    ``body["stream_options"]["include_usage"]``), returned once the first chunk
    is there, so errors before any content keep their own HTTP status.  Else
    the chunks folded into one object (:func:`collect`), as JSON.  With a ``dialect``
    (:class:`mlxcluster.front.dialects.Dialect`: a request of another API translated to
    OpenAI's), whether it streams, the folded answer, the stream and the error bodies are
    the dialect's.

    Args:
        receive: the request's ASGI ``receive`` (its body already read), watched
            for the client's disconnect.
        body: the request's JSON object.
        chunks: async iterator of chunk dicts (or an :class:`OpenAIError` item
            ending it; see :class:`EventStream`).  Always closed.
        chat: chat completion chunks (see :func:`fold_chunks`).
        on_end: called once with how the answer ended (:data:`OnEnd`); for a
            stream, by the :class:`EventStream` when it ends.
        timing: the request's :class:`Timing` (watching ``chunks``), passed to the dialect.

    Returns:
        The response: 200 (JSON or SSE); the error's own (e.g. 400, 429 with
        ``Retry-After``) when ``chunks`` raises an :class:`OpenAIError` before the
        answer; 499 without a body when the client went away first.

    Raises:
        Any other exception ``chunks`` raises before the answer.
    """
    try:
        stream = dialect.streams(body) if dialect is not None else stream_flag(body)
        if stream:
            first = await unless_disconnected(receive, next_chunk(chunks))
        else:
            result = await unless_disconnected(receive, collect(chunks, chat))
    except (ClientGone, OpenAIError) as exc:
        await chunks.aclose()
        error = exc if isinstance(exc, OpenAIError) else None
        if on_end is not None:
            on_end(error, error is not None)
        if error is None:
            return Response(status_code=499)
        return dialect.error_response(error) if dialect is not None else error.response()
    except BaseException:
        await chunks.aclose()
        raise
    if not stream:
        if on_end is not None:
            on_end(None, True)
        return JSONResponse(dialect.fold(result, body, timing) if dialect is not None else result)
    if dialect is not None:
        return dialect.stream_response(chunks, first, body, on_end, timing)
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    return EventStream(chunks, first, include_usage, on_end=on_end)

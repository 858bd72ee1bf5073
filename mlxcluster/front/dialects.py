"""The other API dialects clients speak, as codecs over the OpenAI chat/completions chunk stream.

Each dialect turns its request into an OpenAI request body (validated afterwards by the
provider like any other, so every dialect runs on the same admission queue, continuous
batching and metrics), and the resulting ``chat.completion.chunk`` / ``text_completion``
stream back into its own answer:

* **Anthropic Messages** -- ``POST /v1/messages`` (docs.anthropic.com/en/api/messages; streaming:
  docs.anthropic.com/en/docs/build-with-claude/streaming: ``message_start``,
  ``content_block_start``, ``ping``, ``content_block_delta``, ``content_block_stop``,
  ``message_delta``, ``message_stop``; errors ``{"type": "error", "error": {type, message}}``);
* **Ollama** -- ``POST /api/chat``, ``POST /api/generate`` (NDJSON when streaming, which is
  their default), ``GET /api/tags``, ``POST /api/show``, ``GET /api/version``
  (github.com/ollama/ollama ``docs/api.md``; errors ``{"error": "..."}``);
* **OpenAI Responses** -- ``POST /v1/responses`` (platform.openai.com/docs/api-reference/responses;
  streamed as ``response.created`` ... ``response.completed`` events with ``sequence_number``).

Both the provider's HTTP API (:mod:`mlxcluster.front.api`) and the marketplace router
(:mod:`mlxcluster.router.server`) mount them with :func:`mount`: the router translates at its
edge and forwards OpenAI requests, so every provider serves every dialect.  Fields a dialect
defines that this server does not implement are refused (400 in the dialect's error format),
never ignored.  Imports Starlette only (no MLX, no gRPC).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from datetime import datetime, timezone
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, List, Optional, Tuple

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..protocol.errors import OpenAIError, read_body
from .sse import EventStream, OnEnd, respond

__all__ = ["ANTHROPIC", "OLLAMA_CHAT", "OLLAMA_GENERATE", "RESPONSES", "Dialect", "answer", "mount",
           "OLLAMA_VERSION"]

#: the Ollama API version /api/version reports (the dialect implemented: docs/api.md of this release)
OLLAMA_VERSION = "0.12.0"

#: ``chunks(openai_body, chat) -> async iterator of OpenAI chunk dicts`` (provider or router)
Chunks = Callable[[Dict[str, Any], bool], AsyncIterator[Any]]


def _bad(message: str, param: Optional[str] = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param)


def _unsupported(name: str) -> OpenAIError:
    return OpenAIError(400, f"'{name}' is not supported by this server", "invalid_request_error", name,
                       "unsupported_parameter")


def _given(body: Dict[str, Any], name: str) -> bool:
    return body.get(name) not in (None, False, [], {}, "")


def _text_of(content: Any, where: str, kinds: Tuple[str, ...] = ("text",)) -> str:
    """The text of a message's ``content``: a string, or a list of text parts (``kinds``)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in kinds and isinstance(part.get("text"), str):
                out.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _bad(f"{where}: only text content is supported, got {kind!r}", where)
        return "".join(out)
    raise _bad(f"{where} must be a string or a list of text blocks", where)


def _finish(chunk_choice: Dict[str, Any]) -> Optional[str]:
    return chunk_choice.get("finish_reason")


class Dialect:
    """One API dialect: request -> OpenAI body, OpenAI chunks -> answer.

    Attributes:
        name: the endpoint label in metrics.
        chat: the OpenAI endpoint it maps to (chat completions, else completions).
        media_type: of a streamed answer.
    """

    name = ""
    chat = True
    media_type = "text/event-stream"

    def to_openai(self, body: Dict[str, Any]) -> Dict[str, Any]:
        """The OpenAI request body (``stream`` always true: the answer is built from chunks).

        Raises:
            OpenAIError: 400 naming the field (refused or malformed)."""
        raise NotImplementedError

    def streams(self, body: Dict[str, Any]) -> bool:
        return bool(body.get("stream"))

    def error(self, exc: OpenAIError) -> Dict[str, Any]:
        """The error body in this dialect's format."""
        return exc.to_dict()

    def error_response(self, exc: OpenAIError) -> Response:
        return exc.response(self.error(exc))

    def stream_response(self, chunks, first, body: Dict[str, Any], on_end: Optional[OnEnd]) -> Response:
        """The streamed answer once its first chunk is there (:class:`DialectStream`)."""
        return DialectStream(chunks, first, self, body, on_end=on_end)

    def fold(self, result: Dict[str, Any], body: Dict[str, Any]) -> Dict[str, Any]:
        """The non-streamed answer from the folded OpenAI object (:func:`~mlxcluster.front.sse.fold_chunks`)."""
        raise NotImplementedError

    def encode(self, items: AsyncIterator[Any], body: Dict[str, Any]) -> AsyncIterator[bytes]:
        """The streamed answer: bytes per OpenAI chunk (an :class:`OpenAIError` item is the
        stream's last: written as this dialect's error event)."""
        raise NotImplementedError


def _sse(event: str, data: Dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _cached_tokens(usage: Dict[str, Any]) -> int:
    """OpenAI's ``usage.prompt_tokens_details.cached_tokens`` (0 when absent)."""
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _anthropic_input(usage: Dict[str, Any]) -> Dict[str, int]:
    """Anthropic's input counts from OpenAI's ``usage``: ``input_tokens`` are the prompt tokens
    not read from a cache, ``cache_read_input_tokens`` those taken from the prefix caches
    (Anthropic's prompt-caching fields; total input is their sum)."""
    prompt, cached = usage.get("prompt_tokens", 0), _cached_tokens(usage)
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _text_and_end(chunk: Dict[str, Any]) -> Tuple[str, Optional[str], Optional[str], Optional[dict]]:
    """(text, finish_reason, matched stop string, usage) of one OpenAI chunk."""
    text, finish, stop = "", None, None
    for ch in chunk.get("choices") or []:
        delta = ch.get("delta")
        text += (delta.get("content") or "") if isinstance(delta, dict) else (ch.get("text") or "")
        finish = _finish(ch) or finish
        stop = ch.get("stop_reason") if isinstance(ch.get("stop_reason"), str) else stop
    return text, finish, stop, chunk.get("usage")


# -- Anthropic Messages -------------------------------------------------------------------
_ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                     404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                     500: "api_error", 503: "overloaded_error"}


class Anthropic(Dialect):
    name = "messages"

    def to_openai(self, body):
        for name in ("tools", "tool_choice", "thinking", "mcp_servers", "container"):
            if _given(body, name) and not (name == "tool_choice" and body[name] in ({"type": "none"}, "none")):
                raise _unsupported(name)
        if body.get("top_k") is not None:
            raise _unsupported("top_k")
        if body.get("max_tokens") is None:
            raise _bad("'max_tokens' is required", "max_tokens")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty list", "messages")
        out = []
        system = body.get("system")
        if system is not None:
            out.append({"role": "system", "content": _text_of(system, "system")})
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
                raise _bad(f"messages[{i}].role must be 'user' or 'assistant'", f"messages[{i}].role")
            out.append({"role": m["role"], "content": _text_of(m.get("content"), f"messages[{i}].content")})
        temperature = body.get("temperature")
        if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                        or not 0 <= temperature <= 1):
            raise _bad("'temperature' must be a number in [0, 1]", "temperature")
        stops = body.get("stop_sequences")
        if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)):
            raise _bad("'stop_sequences' must be a list of strings", "stop_sequences")
        req = {"model": body.get("model"), "messages": out, "max_tokens": body["max_tokens"], "stream": True,
               "temperature": 1.0 if temperature is None else temperature}
        for name in ("top_p", "seed"):
            if body.get(name) is not None:
                req[name] = body[name]
        if stops:
            req["stop"] = stops
        config = body.get("output_config")
        if config is not None:  # structured outputs (platform.claude.com ... structured-outputs)
            if not isinstance(config, dict):
                raise _bad("'output_config' must be an object", "output_config")
            if config.get("effort") is not None:
                raise _unsupported("output_config.effort")
            fmt = config.get("format")
            if fmt is not None:
                if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(
                        fmt.get("schema"), dict):
                    raise _bad("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}",
                               "output_config.format")
                req["response_format"] = {"type": "json_schema",
                                          "json_schema": {"name": "output", "schema": fmt["schema"]}}
        return req

    def error(self, exc):
        kind = _ANTHROPIC_ERRORS.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": exc.message}}

    @staticmethod
    def _stop(finish: Optional[str], stop: Optional[str]) -> Tuple[str, Optional[str]]:
        if finish == "length":
            return "max_tokens", None
        return ("stop_sequence", stop) if stop is not None else ("end_turn", None)

    def fold(self, result, body):
        choice = result["choices"][0]
        reason, seq = self._stop(choice.get("finish_reason"), choice.get("stop_reason"))
        usage = result.get("usage") or {}
        return {"id": "msg_" + result["id"].split("-", 1)[-1], "type": "message", "role": "assistant",
                "model": result.get("model"),
                "content": [{"type": "text", "text": choice["message"].get("content") or ""}],
                "stop_reason": reason, "stop_sequence": seq,
                "usage": dict(_anthropic_input(usage), output_tokens=usage.get("completion_tokens", 0))}

    async def encode(self, items, body):
        started, finish, stop, output = False, None, None, 0
        async for item in items:
            if isinstance(item, OpenAIError):
                yield _sse("error", self.error(item))
                return
            text, f, s, usage = _text_and_end(item)
            finish, stop = f or finish, s or stop
            if not started and item.get("choices"):
                started = True
                yield _sse("message_start", {"type": "message_start", "message": {
                    "id": "msg_" + str(item.get("id", uuid.uuid4().hex)).split("-", 1)[-1], "type": "message",
                    "role": "assistant", "model": item.get("model"), "content": [], "stop_reason": None,
                    "stop_sequence": None, "usage": dict(_anthropic_input(usage or {}), output_tokens=0)}})
                yield _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                                   "content_block": {"type": "text", "text": ""}})
                yield _sse("ping", {"type": "ping"})
            if text:
                yield _sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                   "delta": {"type": "text_delta", "text": text}})
            if usage and not item.get("choices"):
                output = usage.get("completion_tokens", 0)
        if started:
            reason, seq = self._stop(finish, stop)
            yield _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
            yield _sse("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": reason, "stop_sequence": seq},
                                         "usage": {"output_tokens": output}})
            yield _sse("message_stop", {"type": "message_stop"})


# -- Ollama --------------------------------------------------------------------------------
#: Ollama runtime options that only size or place the model (no effect on the answer here)
_OLLAMA_RESOURCE = {"num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "vocab_only",
                    "use_mmap", "use_mlock", "num_thread", "numa", "num_keep"}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _model_name(name: Any) -> Any:
    """Ollama names carry a tag (``smollm2:latest``); ``latest`` is the name itself."""
    return name[: -len(":latest")] if isinstance(name, str) and name.endswith(":latest") else name


class Ollama(Dialect):
    media_type = "application/x-ndjson"

    def streams(self, body):
        return body.get("stream") is not False  # Ollama streams unless told not to

    def error(self, exc):
        return {"error": exc.message}

    def _options(self, body, req):
        options = body.get("options") or {}
        if not isinstance(options, dict):
            raise _bad("'options' must be an object", "options")
        for key, value in options.items():
            if key in _OLLAMA_RESOURCE or value is None:
                continue
            if key == "num_predict":
                if not isinstance(value, int) or isinstance(value, bool):
                    raise _bad("'options.num_predict' must be an integer", "options.num_predict")
                if value >= 0:  # -1 (and -2): until the context is full / the model stops
                    req["max_tokens"] = value or 1
            elif key in ("temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty"):
                req[key] = value
            else:
                raise _unsupported(f"options.{key}")
        fmt = body.get("format")
        if fmt == "json":
            if not self.chat:
                raise _unsupported("format")
            req["response_format"] = {"type": "json_object"}
        elif isinstance(fmt, dict):
            if not self.chat:
                raise _unsupported("format")
            req["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
        elif fmt not in (None, ""):
            raise _bad("'format' must be \"json\" or a JSON schema", "format")
        for name in ("tools", "images", "suffix", "context", "template"):
            if _given(body, name):
                raise _unsupported(name)
        if body.get("think"):
            raise _unsupported("think")
        req.setdefault("temperature", 0.8)  # Ollama's default
        return req

    def fold(self, result, body):
        return self._final(result, body)

    def _piece(self, body, text: str) -> Dict[str, Any]:
        raise NotImplementedError

    def _final(self, result: Dict[str, Any], body: Dict[str, Any], text: str = None) -> Dict[str, Any]:
        choice = result["choices"][0] if result.get("choices") else {}
        if text is None:
            text = (choice.get("message") or {}).get("content") if self.chat else choice.get("text")
        usage = result.get("usage") or {}
        t = result.get("_timing", {})
        out = self._piece(body, text or "")
        out.update({"done": True, "done_reason": "length" if choice.get("finish_reason") == "length" else "stop",
                    "total_duration": t.get("total", 0), "load_duration": 0,
                    "prompt_eval_count": usage.get("prompt_tokens", 0), "prompt_eval_duration": t.get("prompt", 0),
                    "eval_count": usage.get("completion_tokens", 0), "eval_duration": t.get("eval", 0)})
        return out

    async def encode(self, items, body):
        finish, usage = None, {}
        t0 = time.monotonic_ns()
        t_first = None
        async for item in items:
            if isinstance(item, OpenAIError):
                yield (json.dumps(self.error(item)) + "\n").encode()
                return
            text, f, _, u = _text_and_end(item)
            finish, usage = f or finish, (u if u and not item.get("choices") else usage)
            if text:
                t_first = t_first or time.monotonic_ns()
                yield (json.dumps(self._piece(body, text)) + "\n").encode()
        now = time.monotonic_ns()
        final = self._final({"choices": [{"finish_reason": finish, "message": {}, "text": ""}], "usage": usage,
                             "_timing": {"total": now - t0, "prompt": (t_first or now) - t0,
                                         "eval": now - (t_first or now)}}, body, "")
        yield (json.dumps(final) + "\n").encode()


class OllamaChat(Ollama):
    name = "ollama_chat"
    chat = True

    def to_openai(self, body):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty list", "messages")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
                raise _bad(f"messages[{i}].role must be system, user or assistant", f"messages[{i}].role")
            for name in ("images", "tool_calls"):
                if _given(m, name):
                    raise _unsupported(f"messages[{i}].{name}")
            out.append({"role": m["role"], "content": _text_of(m.get("content"), f"messages[{i}].content")})
        return self._options(body, {"model": _model_name(body.get("model")), "messages": out, "stream": True})

    def _piece(self, body, text):
        return {"model": body.get("model"), "created_at": _now(), "message": {"role": "assistant", "content": text},
                "done": False}


class OllamaGenerate(Ollama):
    name = "ollama_generate"

    def to_openai(self, body):
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise _bad("'prompt' must be a string", "prompt")
        system = body.get("system")
        if system is not None and not isinstance(system, str):
            raise _bad("'system' must be a string", "system")
        self.chat = not body.get("raw")  # raw: the prompt as it is, no template
        if self.chat:
            messages = ([{"role": "system", "content": system}] if system else []) + \
                [{"role": "user", "content": prompt}]
            req = {"model": _model_name(body.get("model")), "messages": messages, "stream": True}
        else:
            req = {"model": _model_name(body.get("model")), "prompt": prompt, "stream": True, "max_tokens": 256}
        return self._options(body, req)

    def _piece(self, body, text):
        return {"model": body.get("model"), "created_at": _now(), "response": text, "done": False}


def ollama_model(name: str, info: Dict[str, Any]) -> Dict[str, Any]:
    """One ``/api/tags`` entry (``info``: ``architecture``, ``weight_format``, ``parameters``, ``size``)."""
    family = info.get("architecture") or "unknown"
    return {"name": f"{name}:latest", "model": f"{name}:latest", "modified_at": info.get("modified_at", _now()),
            "size": int(info.get("size", 0)),
            "digest": hashlib.sha256(f"{name}|{info.get('weight_format')}".encode()).hexdigest(),
            "details": {"parent_model": "", "format": info.get("format", "mlx"), "family": family,
                        "families": [family], "parameter_size": info.get("parameter_size", ""),
                        "quantization_level": info.get("weight_format", "")}}


# -- OpenAI Responses ----------------------------------------------------------------------
class Responses(Dialect):
    name = "responses"

    def to_openai(self, body):
        for name in ("tools", "previous_response_id", "prompt", "reasoning", "background", "conversation"):
            if _given(body, name):
                raise _unsupported(name)
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise _unsupported("tool_choice")
        messages = []
        if body.get("instructions") is not None:
            if not isinstance(body["instructions"], str):
                raise _bad("'instructions' must be a string", "instructions")
            messages.append({"role": "system", "content": body["instructions"]})
        inp = body.get("input")
        if isinstance(inp, str):
            messages.append({"role": "user", "content": inp})
        elif isinstance(inp, list) and inp:
            for i, item in enumerate(inp):
                if not isinstance(item, dict) or item.get("type", "message") != "message" or \
                        item.get("role") not in ("system", "developer", "user", "assistant"):
                    raise _bad(f"input[{i}] must be a message with a role (system, developer, user, assistant)",
                               f"input[{i}]")
                role = "system" if item["role"] == "developer" else item["role"]
                text = _text_of(item.get("content"), f"input[{i}].content", ("input_text", "output_text", "text"))
                messages.append({"role": role, "content": text})
        else:
            raise _bad("'input' must be a string or a non-empty list of messages", "input")
        req = {"model": body.get("model"), "messages": messages, "stream": True}
        for ours, theirs in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"),
                             ("top_p", "top_p"), ("top_logprobs", "top_logprobs")):
            if body.get(theirs) is not None:
                req[ours] = body[theirs]
        if req.get("top_logprobs"):
            req["logprobs"] = True
        text = body.get("text")
        fmt = (text or {}).get("format") if isinstance(text, dict) else None
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            req["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.get("name"), "schema": fmt.get("schema", {}), "strict": fmt.get("strict")}}
        elif isinstance(fmt, dict) and fmt.get("type") in ("text", "json_object"):
            req["response_format"] = {"type": fmt["type"]}
        elif fmt is not None:
            raise _bad("'text.format.type' must be one of 'text', 'json_object', 'json_schema'", "text.format")
        return req

    def _response(self, body, rid, created, status, text, usage=None, finish=None, msg_id=None):
        item = []
        if text is not None:
            item = [{"type": "message", "id": msg_id, "status": "completed" if status != "in_progress" else
                     "in_progress", "role": "assistant",
                     "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}]
        fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
        out = {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
               "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
               "model": body.get("model"), "output": item, "parallel_tool_calls": True,
               "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
               "temperature": body.get("temperature", 1.0), "text": {"format": fmt or {"type": "text"}},
               "tool_choice": body.get("tool_choice") or "auto", "tools": [], "top_p": body.get("top_p", 1.0),
               "truncation": "disabled", "metadata": body.get("metadata") or {}}
        if isinstance(body.get("user"), str):
            out["user"] = body["user"]
        if usage is not None:
            p, c = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
            out["usage"] = {"input_tokens": p, "input_tokens_details": {"cached_tokens": _cached_tokens(usage),
                                                                        "cache_write_tokens": 0},
                            "output_tokens": c,
                            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}
        return out

    def fold(self, result, body):
        choice = result["choices"][0]
        finish = choice.get("finish_reason")
        rid = "resp_" + result["id"].split("-", 1)[-1]
        return self._response(body, rid, result.get("created") or int(time.time()),
                              "incomplete" if finish == "length" else "completed",
                              choice["message"].get("content") or "", result.get("usage"), finish,
                              "msg_" + result["id"].split("-", 1)[-1])

    async def encode(self, items, body):
        seq = 0

        def ev(kind: str, **data) -> bytes:
            nonlocal seq
            seq += 1
            return _sse(kind, {"type": kind, "sequence_number": seq - 1, **data})

        rid = msg_id = None
        created, text, finish, usage = int(time.time()), "", None, None
        async for item in items:
            if isinstance(item, OpenAIError):
                yield ev("error", code=item.code, message=item.message, param=item.param)
                return
            if rid is None:
                suffix = str(item.get("id") or uuid.uuid4().hex).split("-", 1)[-1]
                rid, msg_id = "resp_" + suffix, "msg_" + suffix
                created = item.get("created") or created
                start = self._response(body, rid, created, "in_progress", None)
                yield ev("response.created", response=start)
                yield ev("response.in_progress", response=start)
                yield ev("response.output_item.added", output_index=0, item={
                    "type": "message", "id": msg_id, "status": "in_progress", "role": "assistant", "content": []})
                yield ev("response.content_part.added", item_id=msg_id, output_index=0, content_index=0,
                         part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            delta, f, _, u = _text_and_end(item)
            finish = f or finish
            if u and not item.get("choices"):
                usage = u
            if delta:
                text += delta
                yield ev("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0, delta=delta,
                         logprobs=[])
        if rid is None:
            return
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        yield ev("response.output_text.done", item_id=msg_id, output_index=0, content_index=0, text=text, logprobs=[])
        yield ev("response.content_part.done", item_id=msg_id, output_index=0, content_index=0, part=part)
        yield ev("response.output_item.done", output_index=0, item={
            "type": "message", "id": msg_id, "status": "completed", "role": "assistant", "content": [part]})
        final = self._response(body, rid, created, "incomplete" if finish == "length" else "completed", text,
                               usage, finish, msg_id)
        yield ev("response.incomplete" if finish == "length" else "response.completed", response=final)


ANTHROPIC, OLLAMA_CHAT, RESPONSES = Anthropic(), OllamaChat(), Responses()
OLLAMA_GENERATE = OllamaGenerate  # per request: ``raw`` picks the endpoint


# -- answering -----------------------------------------------------------------------------
class DialectStream(EventStream):
    """A streamed dialect answer: the dialect's :meth:`Dialect.encode` over the chunk stream
    (disconnect handling, ``on_end`` and closing as :class:`~mlxcluster.front.sse.EventStream`)."""

    def __init__(self, chunks, first, dialect: Dialect, body: Dict[str, Any], on_end: Optional[OnEnd] = None):
        self.media_type = dialect.media_type
        super().__init__(chunks, first, include_usage=True, on_end=on_end)
        self.dialect, self.body = dialect, body

    async def _items(self):
        item = self.first if self.first is not None else await self._next()
        while item is not None:
            if isinstance(item, OpenAIError):
                self.error = item
                yield item
                return
            yield item
            item = await self._next()

    async def _produce(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for data in self.dialect.encode(self._items(), self.body):
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self.complete = True


async def answer(receive, dialect: Dialect, body: Dict[str, Any], chunks: Chunks,
                 on_end: Optional[OnEnd] = None) -> Response:
    """Answer one dialect request: translate, generate through ``chunks``, answer (streamed or
    not) in the dialect's format; errors before the answer keep their HTTP status, in the
    dialect's error body; 499 (no body) when the client went away first."""
    try:
        openai_body = dialect.to_openai(body)
    except OpenAIError as exc:
        if on_end is not None:
            on_end(exc, True)
        return dialect.error_response(exc)
    return await respond(receive, body, chunks(openai_body, dialect.chat), chat=dialect.chat, on_end=on_end,
                         dialect=dialect)


def ollama_embed_request(body: Dict[str, Any]) -> Tuple[Dict[str, Any], bool]:
    """Ollama's ``/api/embed`` body (``model``, ``input`` a string or a list of strings,
    ``truncate`` default true, ``dimensions``; ``options`` and ``keep_alive`` change no embedding and
    are ignored) -> ``(OpenAI embeddings body, truncate)``.

    Raises:
        OpenAIError: 400 naming the field."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required", "model")
    value = body.get("input")
    if not (isinstance(value, str) or (isinstance(value, list) and all(isinstance(x, str) for x in value))):
        raise _bad("'input' must be a string or a list of strings", "input")
    truncate = body.get("truncate")
    if truncate is not None and not isinstance(truncate, bool):
        raise _bad("'truncate' must be a boolean", "truncate")
    if body.get("options") is not None and not isinstance(body["options"], dict):
        raise _bad("'options' must be an object", "options")
    req: Dict[str, Any] = {"model": _model_name(model), "input": value}
    if body.get("dimensions") is not None:
        req["dimensions"] = body["dimensions"]
    return req, truncate is not False


def mount(app, chunks: Chunks, models: Callable[[], List[Tuple[str, Dict[str, Any]]]], *,
          admit: Optional[Callable[[Request], None]] = None, on_end: Optional[OnEnd] = None,
          count: Optional[Callable[[str, OpenAIError], None]] = None,
          embed: Optional[Callable[..., Awaitable[Dict[str, Any]]]] = None) -> None:
    """Add the dialects' routes to a FastAPI ``app``.

    Args:
        chunks: ``chunks(openai_body, chat)`` -> the OpenAI chunk stream of a request.
        models: ``[(name, info)]`` served (``info`` as :func:`ollama_model` reads it); called on a
            worker thread (it may read model files).
        admit: called first with the request (API keys, rate limits); raises :class:`OpenAIError`.
        on_end: how an answer ended (:data:`~mlxcluster.front.sse.OnEnd`).
        count: ``count(endpoint, error)`` for a request refused before ``chunks`` (bad JSON, a wrong key).
        embed: ``await embed(openai_body, truncate=...)`` -> an OpenAI embeddings answer
            (:meth:`~mlxcluster.front.provider.Provider.embed`); ``None``: no ``/api/embed``.
    """
    async def handle(request: Request, dialect: Dialect) -> Response:
        try:
            if admit is not None:
                admit(request)
            body = await read_body(request)
        except OpenAIError as exc:
            if count is not None:
                count(dialect.name, exc)
            return dialect.error_response(exc)
        return await answer(request.receive, dialect, body, chunks, on_end)

    @app.post("/v1/messages")
    async def messages(request: Request):
        """Anthropic Messages."""
        return await handle(request, ANTHROPIC)

    @app.post("/v1/responses")
    async def responses(request: Request):
        """OpenAI Responses."""
        return await handle(request, RESPONSES)

    @app.post("/api/chat")
    async def ollama_chat(request: Request):
        """Ollama chat (NDJSON stream unless ``"stream": false``)."""
        return await handle(request, OLLAMA_CHAT)

    @app.post("/api/generate")
    async def ollama_generate(request: Request):
        """Ollama generate (NDJSON stream unless ``"stream": false``)."""
        return await handle(request, OllamaGenerate())

    if embed is not None:
        @app.post("/api/embed")
        async def ollama_embed(request: Request):
            """Ollama embeddings: ``{"model", "embeddings": [[...]], "total_duration", "load_duration",
            "prompt_eval_count"}`` (durations in nanoseconds)."""
            t0 = time.perf_counter_ns()
            try:
                if admit is not None:
                    admit(request)
                body = await read_body(request)
            except OpenAIError as exc:
                if count is not None:
                    count("embed", exc)
                return OLLAMA_CHAT.error_response(exc)
            try:
                req, truncate = ollama_embed_request(body)
            except OpenAIError as exc:
                if count is not None:
                    count("embed", exc)
                return OLLAMA_CHAT.error_response(exc)
            if req["input"] in ("", []):  # Ollama answers no input with no embeddings
                return {"model": body["model"], "embeddings": [], "total_duration": max(1, time.perf_counter_ns() - t0),
                        "load_duration": 0, "prompt_eval_count": 0}
            try:
                result = await embed(req, truncate=truncate, endpoint="embed")
            except OpenAIError as exc:
                return OLLAMA_CHAT.error_response(exc)
            return {"model": body["model"], "embeddings": [d["embedding"] for d in result["data"]],
                    "total_duration": max(1, time.perf_counter_ns() - t0), "load_duration": 0,
                    "prompt_eval_count": result["usage"]["prompt_tokens"]}

    @app.get("/api/version")
    async def ollama_version():
        return {"version": OLLAMA_VERSION}

    def _admitted(request: Request) -> Optional[Response]:
        try:
            if admit is not None:
                admit(request)
        except OpenAIError as exc:
            return OLLAMA_CHAT.error_response(exc)
        return None

    @app.get("/api/tags")
    async def ollama_tags(request: Request):
        refused = _admitted(request)
        return refused or {"models": [ollama_model(name, info) for name, info in await asyncio.to_thread(models)]}

    @app.get("/api/ps")
    async def ollama_ps(request: Request):
        refused = _admitted(request)
        return refused or {"models": [dict(ollama_model(name, info), expires_at="2100-01-01T00:00:00Z",
                                           size_vram=0) for name, info in await asyncio.to_thread(models)]}

    @app.post("/api/show")
    async def ollama_show(request: Request):
        refused = _admitted(request)
        if refused:
            return refused
        try:
            body = await read_body(request)
        except OpenAIError as exc:
            return OLLAMA_CHAT.error_response(exc)
        name = _model_name(body.get("model") or body.get("name"))
        if not isinstance(name, str):
            return JSONResponse({"error": "'model' must be a model name"}, status_code=400)
        found = dict(await asyncio.to_thread(models)).get(name)
        if found is None:
            return JSONResponse({"error": f"model '{body.get('model') or body.get('name')}' not found"},
                                status_code=404)
        entry = ollama_model(name, found)
        arch = found.get("architecture") or "unknown"
        return {"modelfile": f"FROM {name}\n", "parameters": "", "template": found.get("template", ""),
                "details": entry["details"], "modified_at": entry["modified_at"],
                "model_info": {"general.architecture": arch, f"{arch}.context_length": found.get("context_length", 0)},
                "capabilities": ["completion"]}

"""The Anthropic Messages, Ollama and OpenAI Responses APIs, served as codecs over the OpenAI chunk stream.

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
never ignored; values that ask for nothing are accepted.  Tool definitions, choices, calls and
results are translated to and from OpenAI's shape (the provider renders them with the chat
template and parses the model's calls, :mod:`mlxcluster.front.tools`).  Ollama's durations are
measured per request (:class:`~mlxcluster.front.sse.Timing`).  Imports Starlette only (no MLX, no gRPC).
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
from . import schemas
from .sse import EventStream, OnEnd, Timing, respond

__all__ = ["ANTHROPIC", "OLLAMA_CHAT", "OLLAMA_GENERATE", "RESPONSES", "Dialect", "answer", "dialect_of_path",
           "mount", "OLLAMA_VERSION"]

#: the Ollama API version /api/version reports (the dialect implemented: docs/api.md of this release)
OLLAMA_VERSION = "0.12.0"

#: what ``/api/ps`` shows as ``expires_at`` of a model that never expires (loaded for as long as ``serve`` runs)
NEVER_EXPIRES = "2100-01-01T00:00:00Z"

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


def _stream_flag(body: Dict[str, Any], default: bool) -> bool:
    """The request's ``stream`` (``default`` when absent or null).

    Raises:
        OpenAIError: 400 on ``stream`` when it is not a boolean (``"yes"``, ``1``)."""
    value = body.get("stream")
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"'stream' must be a boolean, got {json.dumps(value)[:40]}", "stream")
    return value


def _arguments(text: Any) -> Dict[str, Any]:
    """An OpenAI tool call's ``arguments`` (a JSON string) as the object the other dialects send
    (Anthropic ``input``, Ollama ``arguments``); a string that is no JSON object is kept under
    ``"arguments"``."""
    if isinstance(text, dict):
        return text
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {"arguments": text}
    return value if isinstance(value, dict) else {"arguments": value}


def _function_tool(name: Any, description: Any, parameters: Any, where: str) -> Dict[str, Any]:
    """One OpenAI function tool (``tools[i]`` of a chat request); the provider checks the name."""
    if not isinstance(name, str):
        raise _bad(f"{where}.name must be a string", where)
    if parameters is not None and not isinstance(parameters, dict):
        raise _bad(f"{where}: the parameters / input_schema must be a JSON Schema object", where)
    fn: Dict[str, Any] = {"name": name, "parameters": parameters if parameters is not None else
                          {"type": "object", "properties": {}}}
    if isinstance(description, str):
        fn["description"] = description
    return {"type": "function", "function": fn}


def _function_tools(body: Dict[str, Any], schema_of: Callable[[int, Any], Any]) -> Dict[str, Any]:
    """A dialect's ``tools`` list as OpenAI chat's: ``{"tools": [...]}``, or ``{}`` when absent or empty.
    ``schema_of(i, tool)`` checks ``tools[i]`` in the dialect's terms (raising its 400) and returns
    its parameters' JSON Schema (None for none); :func:`_function_tool` checks the rest.

    Raises:
        OpenAIError: 400 when ``tools`` is not a list, and those of ``schema_of`` and
            :func:`_function_tool`."""
    tools = body.get("tools")
    if tools in (None, []):
        return {}
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list of tools", "tools")
    out = []
    for i, t in enumerate(tools):
        schema = schema_of(i, t)
        out.append(_function_tool(t.get("name"), t.get("description"), schema, f"tools[{i}]"))
    return {"tools": out}


def _tool_calls_of(chunk: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The complete tool calls an OpenAI chat chunk carries (``delta.tool_calls``: the provider
    sends each call whole, at the end of the answer)."""
    calls: List[Dict[str, Any]] = []
    for ch in chunk.get("choices") or []:
        delta = ch.get("delta")
        if isinstance(delta, dict) and delta.get("tool_calls"):
            calls.extend(delta["tool_calls"])
    return calls


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
        """Whether the answer streams.

        Raises:
            OpenAIError: 400 on ``stream`` when it is not a boolean."""
        return _stream_flag(body, False)

    def error(self, exc: OpenAIError) -> Dict[str, Any]:
        """The error body in this dialect's format."""
        return exc.to_dict()

    def error_response(self, exc: OpenAIError) -> Response:
        return exc.response(self.error(exc))

    def stream_response(self, chunks, first, body: Dict[str, Any], on_end: Optional[OnEnd],
                        timing: Optional[Timing] = None) -> Response:
        """The streamed answer once its first chunk is there (:class:`DialectStream`)."""
        return DialectStream(chunks, first, self, body, on_end=on_end, timing=timing)

    def fold(self, result: Dict[str, Any], body: Dict[str, Any], timing: Optional[Timing] = None) -> Dict[str, Any]:
        """The non-streamed answer from the folded OpenAI object (:func:`~mlxcluster.front.sse.fold_chunks`);
        ``timing``: the request's phases (:class:`~mlxcluster.front.sse.Timing`)."""
        raise NotImplementedError

    def encode(self, items: AsyncIterator[Any], body: Dict[str, Any],
               timing: Optional[Timing] = None) -> AsyncIterator[bytes]:
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

    def streams(self, body):
        return _stream_flag(body, False)

    def to_openai(self, body, count_only: bool = False):
        """The OpenAI chat body; ``count_only``: a ``count_tokens`` body (no ``max_tokens``)."""
        for name in ("mcp_servers", "container"):
            if _given(body, name):
                raise _unsupported(name)
        if _given(body, "thinking") and body["thinking"] != {"type": "disabled"}:  # disabled asks for nothing
            raise _unsupported("thinking")
        if body.get("max_tokens") is None and not count_only:
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
            out.extend(self._message(m, i))
        tools = self._tools(body)
        if count_only:
            req = {"model": body.get("model"), "messages": out}
            req.update(tools)
            return req
        temperature = body.get("temperature")
        if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))):
            raise _bad("'temperature' must be a number", "temperature")
        if temperature is not None and temperature > 1:  # Anthropic's range; below 0: check_args, as every dialect
            raise _bad(f"'temperature' must be at most 1, got {temperature}", "temperature")
        stops = body.get("stop_sequences")
        if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)):
            raise _bad("'stop_sequences' must be a list of strings", "stop_sequences")
        req = {"model": body.get("model"), "messages": out, "max_tokens": body["max_tokens"], "stream": True,
               "temperature": 1.0 if temperature is None else temperature}
        req.update(tools)
        for name in ("top_p", "top_k", "seed"):
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

    @staticmethod
    def _message(m: Dict[str, Any], i: int) -> List[Dict[str, Any]]:
        """One Anthropic message as OpenAI messages: text blocks joined; an assistant's ``tool_use``
        blocks become its ``tool_calls``; a user's ``tool_result`` blocks become ``tool`` messages
        (before the user's text; ``is_error`` results are prefixed ``Error: ``)."""
        where = f"messages[{i}].content"
        content = m.get("content")
        if not isinstance(content, list):
            return [{"role": m["role"], "content": _text_of(content, where)}]
        texts: List[str] = []
        calls: List[Dict[str, Any]] = []
        results: List[Dict[str, Any]] = []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            at = f"{where}[{j}]"
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) or \
                        not isinstance(block.get("input", {}), dict):
                    raise _bad(f"{at}: a tool_use block needs an 'id', a 'name' and an object 'input'", where)
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and m["role"] == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise _bad(f"{at}: a tool_result block needs a 'tool_use_id'", where)
                text = _text_of(block.get("content"), f"{at}.content")
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                "content": ("Error: " + text) if block.get("is_error") else text})
            else:
                allowed = "text and tool_use" if m["role"] == "assistant" else "text and tool_result"
                raise _bad(f"{where}: only {allowed} blocks are supported in a {m['role']} message, got {kind!r}",
                           where)
        if m["role"] == "assistant":
            msg: Dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            return [msg]
        return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])

    @staticmethod
    def _tool_schema(i: int, t: Any) -> Any:
        """``tools[i]``'s ``input_schema``: a custom tool's JSON Schema object; server tools refused."""
        if not isinstance(t, dict):
            raise _bad(f"tools[{i}] must be an object", f"tools[{i}]")
        if t.get("type") not in (None, "custom"):
            raise _unsupported(f"tools[{i}].type")  # server tools (web search, bash, ...)
        if not isinstance(t.get("input_schema"), dict):
            raise _bad(f"tools[{i}].input_schema must be a JSON Schema object", f"tools[{i}]")
        return t["input_schema"]

    @staticmethod
    def _tools(body: Dict[str, Any]) -> Dict[str, Any]:
        """``tools`` ([{name, description, input_schema}]; server tools refused) and ``tool_choice``
        (auto, any -> required, tool -> the named function, none; ``disable_parallel_tool_use`` ->
        ``parallel_tool_calls: false``) as OpenAI's fields."""
        out: Dict[str, Any] = _function_tools(body, Anthropic._tool_schema)
        choice = body.get("tool_choice")
        if choice is not None:
            kind = choice.get("type") if isinstance(choice, dict) else None
            if kind == "auto":
                out["tool_choice"] = "auto"
            elif kind == "any":
                out["tool_choice"] = "required"
            elif kind == "none":
                out["tool_choice"] = "none"
            elif kind == "tool" and isinstance(choice.get("name"), str):
                out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
            else:
                raise _bad("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or "
                           "{\"type\": \"tool\", \"name\": ...}", "tool_choice")
            if choice.get("disable_parallel_tool_use") is True:
                out["parallel_tool_calls"] = False
        return out

    def error(self, exc):
        kind = _ANTHROPIC_ERRORS.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": exc.message}}

    @staticmethod
    def _stop(finish: Optional[str], stop: Optional[str]) -> Tuple[str, Optional[str]]:
        if finish == "length":
            return "max_tokens", None
        if finish == "tool_calls":
            return "tool_use", None
        return ("stop_sequence", stop) if stop is not None else ("end_turn", None)

    @staticmethod
    def _tool_use(call: Dict[str, Any]) -> Dict[str, Any]:
        """An OpenAI tool call as an Anthropic ``tool_use`` block (``input`` the arguments object)."""
        fn = call.get("function") or {}
        cid = str(call.get("id") or uuid.uuid4().hex)
        return {"type": "tool_use", "id": "toolu_" + cid.split("_", 1)[-1], "name": fn.get("name"),
                "input": _arguments(fn.get("arguments"))}

    def fold(self, result, body, timing=None):
        choice = result["choices"][0]
        reason, seq = self._stop(choice.get("finish_reason"), choice.get("stop_reason"))
        usage = result.get("usage") or {}
        message = choice["message"]
        calls = [self._tool_use(c) for c in message.get("tool_calls") or []]
        text = message.get("content") or ""
        content = ([{"type": "text", "text": text}] if text or not calls else []) + calls
        return {"id": "msg_" + result["id"].split("-", 1)[-1], "type": "message", "role": "assistant",
                "model": result.get("model"), "content": content,
                "stop_reason": reason, "stop_sequence": seq,
                "usage": dict(_anthropic_input(usage), output_tokens=usage.get("completion_tokens", 0))}

    async def encode(self, items, body, timing=None):
        started, finish, stop, output = False, None, None, 0
        blocks, text_open = 0, False  # content blocks started; whether the last is an open text block
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
                yield _sse("ping", {"type": "ping"})
            if text:
                if not text_open:
                    yield _sse("content_block_start", {"type": "content_block_start", "index": blocks,
                                                       "content_block": {"type": "text", "text": ""}})
                    blocks, text_open = blocks + 1, True
                yield _sse("content_block_delta", {"type": "content_block_delta", "index": blocks - 1,
                                                   "delta": {"type": "text_delta", "text": text}})
            for call in _tool_calls_of(item):
                if text_open:
                    yield _sse("content_block_stop", {"type": "content_block_stop", "index": blocks - 1})
                    text_open = False
                block = self._tool_use(call)
                yield _sse("content_block_start", {"type": "content_block_start", "index": blocks,
                                                   "content_block": dict(block, input={})})
                yield _sse("content_block_delta", {"type": "content_block_delta", "index": blocks, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
                yield _sse("content_block_stop", {"type": "content_block_stop", "index": blocks})
                blocks += 1
            if usage and not item.get("choices"):
                output = usage.get("completion_tokens", 0)
        if started:
            reason, seq = self._stop(finish, stop)
            if blocks == 0:  # an empty answer is one empty text block
                yield _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                                   "content_block": {"type": "text", "text": ""}})
                blocks, text_open = 1, True
            if text_open:
                yield _sse("content_block_stop", {"type": "content_block_stop", "index": blocks - 1})
            yield _sse("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": reason, "stop_sequence": seq},
                                         "usage": {"output_tokens": output}})
            yield _sse("message_stop", {"type": "message_stop"})


# -- Ollama --------------------------------------------------------------------------------
#: Ollama options that only size or place the model, or load it (no effect on the answer here)
_OLLAMA_RESOURCE = {"num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "vocab_only",
                    "use_mmap", "use_mlock", "num_thread", "numa", "num_keep", "logits_all", "embedding_only"}
#: Ollama sampling options (github.com/ollama/ollama docs/modelfile.md "Valid Parameters and Values")
#: that are refused unless their value asks for nothing: the value that turns each off
_OLLAMA_OFF = {"mirostat": 0, "tfs_z": 1, "typical_p": 1}
#: Ollama's repeat_last_n when a client sets repeat_penalty alone (its documented default)
OLLAMA_REPEAT_LAST_N = 64
#: a repetition window that covers any context (the provider bounds it by the model's)
WHOLE_CONTEXT = 2**31 - 1


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _model_name(name: Any) -> Any:
    """Ollama names carry a tag (``smollm2:latest``); ``latest`` is the name itself."""
    return name[: -len(":latest")] if isinstance(name, str) and name.endswith(":latest") else name


def _keep_alive_seconds(value: Any) -> float:
    """Ollama's ``keep_alive`` in seconds (:func:`~mlxcluster.front.residency.parse_keep_alive`).

    Raises:
        OpenAIError: 400 naming ``keep_alive``."""
    from .residency import parse_keep_alive

    try:
        return parse_keep_alive(value)
    except ValueError as exc:
        raise _bad(str(exc), "keep_alive") from None


def _option_number(options: Dict[str, Any], key: str, integer: bool = False) -> Any:
    value = options[key]
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise _bad(f"'options.{key}' must be {'an integer' if integer else 'a number'}", f"options.{key}")
    return value


class Ollama(Dialect):
    media_type = "application/x-ndjson"

    def streams(self, body):
        return _stream_flag(body, True)  # Ollama streams unless told not to

    def error(self, exc):
        return {"error": exc.message}

    def _options(self, body, req):
        """Ollama's ``options`` onto the OpenAI body: ``num_predict`` -> ``max_tokens``,
        ``temperature``, ``top_p``, ``seed``, ``stop``, ``presence_penalty``, ``frequency_penalty``,
        ``top_k`` and ``min_p`` (0: off), ``repeat_penalty`` -> ``repetition_penalty`` (1: off) over
        ``repeat_last_n`` -> ``repetition_context_size`` (default 64; 0: off; -1: ``num_ctx``, else the
        whole context).
        Resource options are accepted and change nothing; ``mirostat``, ``tfs_z`` and ``typical_p``
        are accepted only at their "off" values (and ``mirostat_eta``/``mirostat_tau`` with them,
        ``penalize_newline`` unless it asks to exempt newlines from a repetition penalty).

        Raises:
            OpenAIError: 400 naming ``options.<key>`` (unsupported, or not a number)."""
        options = body.get("options") or {}
        if not isinstance(options, dict):
            raise _bad("'options' must be an object", "options")
        options = {k: v for k, v in options.items() if v is not None}
        for key, value in options.items():
            if key in _OLLAMA_RESOURCE or key in ("mirostat_eta", "mirostat_tau", "penalize_newline",
                                                  "repeat_last_n"):
                continue
            if key == "num_predict":
                value = _option_number(options, key, integer=True)
                if value >= 0:  # -1 (and -2): until the context is full / the model stops
                    req["max_tokens"] = value or 1
            elif key in ("temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty"):
                req[key] = value
            elif key in _OLLAMA_OFF:
                off = _OLLAMA_OFF[key]
                if _option_number(options, key) != off and not (key == "typical_p" and value >= 1):
                    raise _bad(f"'options.{key}' is not supported by this server (only {key} {off}, which "
                               "turns it off)", f"options.{key}")
            elif key == "top_k":
                if _option_number(options, key, integer=True) > 0:  # 0 (or less): no top-k cut
                    req["top_k"] = value
            elif key == "min_p":
                if _option_number(options, key) > 0:
                    req["min_p"] = value
            elif key == "repeat_penalty":
                _option_number(options, key)
            else:
                raise _unsupported(f"options.{key}")
        penalty = options.get("repeat_penalty", 1.0)
        last_n = _option_number(options, "repeat_last_n", integer=True) if "repeat_last_n" in options \
            else OLLAMA_REPEAT_LAST_N
        if penalty != 1.0 and last_n != 0:
            if last_n == -1:  # Ollama: num_ctx, the whole context (the provider bounds a window by it)
                last_n = _option_number(options, "num_ctx", integer=True) if "num_ctx" in options \
                    else WHOLE_CONTEXT
            elif last_n < -1:
                raise _bad("'options.repeat_last_n' must be -1, 0 or a positive integer", "options.repeat_last_n")
            if options.get("penalize_newline") is False:
                raise _bad("'options.penalize_newline' false is not supported by this server (the repetition "
                           "penalty covers every token)", "options.penalize_newline")
            req["repetition_penalty"], req["repetition_context_size"] = penalty, last_n
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
        for name in ("images", "suffix", "context", "template") + (() if self.chat else ("tools",)):
            if _given(body, name):
                raise _unsupported(name)
        think = body.get("think")
        if think is not None:  # Ollama's thinking switch: the template's reasoning switch (provider)
            if not self.chat:  # raw: no template to switch
                if think:
                    raise _unsupported("think")
            elif isinstance(think, bool):
                req["reasoning_effort"] = "medium" if think else "none"
            elif think in ("low", "medium", "high"):  # gpt-oss's levels
                req["reasoning_effort"] = think
            else:
                raise _bad("'think' must be a boolean or one of 'low', 'medium', 'high'", "think")
        if body.get("logprobs") is not None and not isinstance(body["logprobs"], bool):
            raise _bad("'logprobs' must be a boolean", "logprobs")
        if body.get("logprobs") or body.get("top_logprobs") is not None:
            if not self.chat:  # a raw prompt's logprobs would be the completions' legacy shape
                raise _unsupported("logprobs")
            req["logprobs"] = bool(body.get("logprobs"))  # the provider checks top_logprobs (0..20, needs logprobs)
            if body.get("top_logprobs") is not None:
                req["top_logprobs"] = body["top_logprobs"]
        if body.get("keep_alive") is not None:  # how long the model stays loaded after this answer
            _keep_alive_seconds(body["keep_alive"])  # (a model pool applies it: front/pool.py)
            req["keep_alive"] = body["keep_alive"]
        req.setdefault("temperature", 0.8)  # Ollama's default
        return req

    def fold(self, result, body, timing=None):
        choice = result["choices"][0] if result.get("choices") else {}
        message = choice.get("message") or {}
        text = message.get("content") if self.chat else choice.get("text")
        out = self._final(choice.get("finish_reason"), result.get("usage") or {}, body, timing, text or "",
                          message.get("tool_calls"))
        logprobs = (choice.get("logprobs") or {}).get("content") if self.chat else None
        if logprobs:
            out["logprobs"] = logprobs
        return out

    def _piece(self, body, text: str, calls: Optional[List[Dict[str, Any]]] = None) -> Dict[str, Any]:
        raise NotImplementedError

    def _final(self, finish: Optional[str], usage: Dict[str, Any], body: Dict[str, Any], timing, text: str = "",
               calls: Optional[List[Dict[str, Any]]] = None) -> Dict[str, Any]:
        """The last object (``done: true``): counts from ``usage``, durations in nanoseconds from
        ``timing`` (:class:`~mlxcluster.front.sse.Timing`)."""
        out = self._piece(body, text, calls)
        d = timing.durations() if timing is not None else {}
        out.update({"done": True, "done_reason": "length" if finish == "length" else "stop",
                    "total_duration": d.get("total", 0), "load_duration": d.get("load", 0),
                    "prompt_eval_count": usage.get("prompt_tokens", 0),
                    "prompt_eval_duration": d.get("prompt_eval", 0),
                    "eval_count": usage.get("completion_tokens", 0), "eval_duration": d.get("eval", 0)})
        return out

    async def encode(self, items, body, timing=None):
        finish, usage = None, {}
        async for item in items:
            if isinstance(item, OpenAIError):
                yield (json.dumps(self.error(item)) + "\n").encode()
                return
            text, f, _, u = _text_and_end(item)
            finish, usage = f or finish, (u if u and not item.get("choices") else usage)
            calls = _tool_calls_of(item)
            logprobs = [e for ch in item.get("choices") or [] if isinstance(ch.get("logprobs"), dict)
                        for e in ch["logprobs"].get("content") or []]
            if text or calls or logprobs:
                piece = self._piece(body, text, calls or None)
                if logprobs:  # Ollama's shape is OpenAI chat's: token, logprob, bytes, top_logprobs
                    piece["logprobs"] = logprobs
                yield (json.dumps(piece) + "\n").encode()
        yield (json.dumps(self._final(finish, usage, body, timing)) + "\n").encode()


def _ollama_calls(calls: Optional[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """OpenAI tool calls as Ollama's ``message.tool_calls`` (``arguments`` an object)."""
    return [{"function": {"index": i, "name": (c.get("function") or {}).get("name"),
                          "arguments": _arguments((c.get("function") or {}).get("arguments"))}}
            for i, c in enumerate(calls or [])]


class OllamaChat(Ollama):
    name = "ollama_chat"
    chat = True

    def to_openai(self, body):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty list", "messages")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
                raise _bad(f"messages[{i}].role must be system, user, assistant or tool", f"messages[{i}].role")
            if _given(m, "images"):
                raise _unsupported(f"messages[{i}].images")
            msg: Dict[str, Any] = {"role": m["role"],
                                   "content": _text_of(m.get("content"), f"messages[{i}].content")}
            calls = m.get("tool_calls")
            if calls not in (None, []):
                if m["role"] != "assistant" or not isinstance(calls, list) or not all(
                        isinstance(c, dict) and isinstance(c.get("function"), dict)
                        and isinstance(c["function"].get("name"), str) for c in calls):
                    raise _bad(f"messages[{i}].tool_calls must be an assistant's list of "
                               "{\"function\": {\"name\", \"arguments\"}}", f"messages[{i}].tool_calls")
                msg["tool_calls"] = [{"id": c.get("id") or f"call_{i}_{j}", "type": "function", "function": {
                    "name": c["function"]["name"], "arguments": json.dumps(c["function"].get("arguments") or {})}}
                    for j, c in enumerate(calls)]
            if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
                msg["tool_call_id"] = m["tool_call_id"]
            out.append(msg)
        req = {"model": _model_name(body.get("model")), "messages": out, "stream": True}
        tools = body.get("tools")
        if tools not in (None, []):
            if not isinstance(tools, list):
                raise _bad("'tools' must be a list of function tools", "tools")
            req["tools"] = tools  # Ollama's tools are OpenAI's function tools; the provider checks them
        return self._options(body, req)

    def _piece(self, body, text, calls=None):
        message: Dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = _ollama_calls(calls)
        return {"model": body.get("model"), "created_at": _now(), "message": message, "done": False}


class OllamaGenerate(Ollama):
    name = "ollama_generate"

    def to_openai(self, body):
        prompt = body.get("prompt")
        if prompt is None:
            raise _bad("'prompt' is required", "prompt")
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

    def _piece(self, body, text, calls=None):
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

    def streams(self, body):
        return _stream_flag(body, False)

    def to_openai(self, body):
        for name in ("previous_response_id", "prompt", "background", "conversation"):
            if _given(body, name):
                raise _unsupported(name)
        reasoning = body.get("reasoning")
        if reasoning is not None:  # effort: the provider's reasoning_effort (the template's switch)
            if not isinstance(reasoning, dict):
                raise _bad("'reasoning' must be an object", "reasoning")
            for key, value in reasoning.items():
                if key != "effort" and value is not None:
                    raise _unsupported(f"reasoning.{key}")
        messages: List[Dict[str, Any]] = []
        if body.get("instructions") is not None:
            if not isinstance(body["instructions"], str):
                raise _bad("'instructions' must be a string", "instructions")
            messages.append({"role": "system", "content": body["instructions"]})
        inp = body.get("input")
        if isinstance(inp, str):
            messages.append({"role": "user", "content": inp})
        elif isinstance(inp, list) and inp:
            for i, item in enumerate(inp):
                self._item(item, i, messages)
        else:
            raise _bad("'input' must be a string or a non-empty list of messages", "input")
        req = {"model": body.get("model"), "messages": messages, "stream": True}
        req.update(self._tools(body))
        if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
            req["reasoning_effort"] = reasoning["effort"]
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
        if isinstance(text, dict) and text.get("verbosity") is not None:
            req["verbosity"] = text["verbosity"]  # the provider refuses what it cannot honour
        return req

    @staticmethod
    def _item(item: Any, i: int, messages: List[Dict[str, Any]]) -> None:
        """One ``input`` item onto the OpenAI ``messages``: a message; a ``function_call`` (joins
        the assistant message just before it, else starts one); a ``function_call_output`` (a
        ``tool`` message)."""
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise _bad(f"input[{i}]: a function_call needs string 'call_id', 'name' and 'arguments'",
                           f"input[{i}]")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"input[{i}]: a function_call_output needs a string 'call_id'", f"input[{i}]")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_of(item.get("output"), f"input[{i}].output",
                                                 ("input_text", "output_text", "text"))})
        elif kind == "message" and item.get("role") in ("system", "developer", "user", "assistant"):
            role = "system" if item["role"] == "developer" else item["role"]
            text = _text_of(item.get("content"), f"input[{i}].content", ("input_text", "output_text", "text"))
            messages.append({"role": role, "content": text})
        else:
            raise _bad(f"input[{i}] must be a message with a role (system, developer, user, assistant), a "
                       "function_call or a function_call_output", f"input[{i}]")

    @staticmethod
    def _tool_schema(i: int, t: Any) -> Any:
        """``tools[i]``'s ``parameters`` (None for none): function tools only, built-in tools refused."""
        if not isinstance(t, dict) or t.get("type") != "function":
            raise _unsupported(f"tools[{i}].type")  # built-in tools (web_search, file_search, ...)
        return t.get("parameters")

    @staticmethod
    def _tools(body: Dict[str, Any]) -> Dict[str, Any]:
        """``tools`` (function tools only), ``tool_choice`` and ``parallel_tool_calls`` as OpenAI chat's."""
        out: Dict[str, Any] = _function_tools(body, Responses._tool_schema)
        choice = body.get("tool_choice")
        if choice in ("none", "auto", "required"):
            out["tool_choice"] = choice
        elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
            out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        elif choice is not None:
            raise _unsupported("tool_choice")
        if body.get("parallel_tool_calls") is False:
            out["parallel_tool_calls"] = False
        return out

    @staticmethod
    def _call_item(call: Dict[str, Any], status: str = "completed") -> Dict[str, Any]:
        fn = call.get("function") or {}
        cid = str(call.get("id") or uuid.uuid4().hex)
        return {"type": "function_call", "id": "fc_" + cid.split("_", 1)[-1], "call_id": cid,
                "name": fn.get("name"), "arguments": fn.get("arguments") or "", "status": status}

    def _response(self, body, rid, created, status, text, usage=None, finish=None, msg_id=None, calls=()):
        item = []
        if text is not None:
            item = [{"type": "message", "id": msg_id, "status": "completed" if status != "in_progress" else
                     "in_progress", "role": "assistant",
                     "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}]
        item += [self._call_item(c) for c in calls]
        fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
        out = {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
               "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
               "model": body.get("model"), "output": item,
               "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
               "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
               "temperature": body.get("temperature", 1.0), "text": {"format": fmt or {"type": "text"}},
               "tool_choice": body.get("tool_choice") or "auto",
               "tools": [dict(t, strict=t.get("strict")) for t in body.get("tools") or []],
               "top_p": body.get("top_p", 1.0), "truncation": "disabled", "metadata": body.get("metadata") or {}}
        if isinstance(body.get("user"), str):
            out["user"] = body["user"]
        if usage is not None:
            p, c = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
            out["usage"] = {"input_tokens": p, "input_tokens_details": {"cached_tokens": _cached_tokens(usage),
                                                                        "cache_write_tokens": 0},
                            "output_tokens": c,
                            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}
        return out

    def fold(self, result, body, timing=None):
        choice = result["choices"][0]
        finish = choice.get("finish_reason")
        rid = "resp_" + result["id"].split("-", 1)[-1]
        calls = choice["message"].get("tool_calls") or []
        text = choice["message"].get("content") or ""
        return self._response(body, rid, result.get("created") or int(time.time()),
                              "incomplete" if finish == "length" else "completed",
                              text if text or not calls else None, result.get("usage"), finish,
                              "msg_" + result["id"].split("-", 1)[-1], calls)

    async def encode(self, items, body, timing=None):
        seq = 0

        def ev(kind: str, **data) -> bytes:
            nonlocal seq
            seq += 1
            return _sse(kind, {"type": kind, "sequence_number": seq - 1, **data})

        rid = msg_id = None
        created, text, finish, usage = int(time.time()), "", None, None
        index, msg_index, calls = 0, None, []  # output items so far; the message's index (once open)

        def close_message():
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            return [ev("response.output_text.done", item_id=msg_id, output_index=msg_index, content_index=0,
                       text=text, logprobs=[]),
                    ev("response.content_part.done", item_id=msg_id, output_index=msg_index, content_index=0,
                       part=part),
                    ev("response.output_item.done", output_index=msg_index, item={
                        "type": "message", "id": msg_id, "status": "completed", "role": "assistant",
                        "content": [part]})]

        def open_message():
            return [ev("response.output_item.added", output_index=index, item={
                        "type": "message", "id": msg_id, "status": "in_progress", "role": "assistant",
                        "content": []}),
                    ev("response.content_part.added", item_id=msg_id, output_index=index, content_index=0,
                       part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

        message_done = False
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
            delta, f, _, u = _text_and_end(item)
            finish = f or finish
            if u and not item.get("choices"):
                usage = u
            if delta:
                if msg_index is None:
                    for e in open_message():
                        yield e
                    msg_index, index = index, index + 1
                text += delta
                yield ev("response.output_text.delta", item_id=msg_id, output_index=msg_index, content_index=0,
                         delta=delta, logprobs=[])
            for call in _tool_calls_of(item):
                if msg_index is not None and not message_done:
                    for e in close_message():
                        yield e
                    message_done = True
                fc = self._call_item(call)
                yield ev("response.output_item.added", output_index=index, item=dict(fc, arguments="",
                                                                                    status="in_progress"))
                yield ev("response.function_call_arguments.delta", item_id=fc["id"], output_index=index,
                         delta=fc["arguments"])
                yield ev("response.function_call_arguments.done", item_id=fc["id"], output_index=index,
                         arguments=fc["arguments"], name=fc["name"])
                yield ev("response.output_item.done", output_index=index, item=fc)
                calls.append(call)
                index += 1
        if rid is None:
            return
        if msg_index is None and not calls:  # an empty answer is one empty message
            for e in open_message():
                yield e
            msg_index, index = index, index + 1
        if msg_index is not None and not message_done:
            for e in close_message():
                yield e
        final = self._response(body, rid, created, "incomplete" if finish == "length" else "completed",
                               text if msg_index is not None else None, usage, finish, msg_id, calls)
        yield ev("response.incomplete" if finish == "length" else "response.completed", response=final)


ANTHROPIC, OLLAMA_CHAT, RESPONSES = Anthropic(), OllamaChat(), Responses()
OLLAMA_GENERATE = OllamaGenerate  # per request: ``raw`` picks the endpoint


# -- answering -----------------------------------------------------------------------------
class DialectStream(EventStream):
    """A streamed dialect answer: the dialect's :meth:`Dialect.encode` over the chunk stream
    (disconnect handling, ``on_end`` and closing as :class:`~mlxcluster.front.sse.EventStream`)."""

    def __init__(self, chunks, first, dialect: Dialect, body: Dict[str, Any], on_end: Optional[OnEnd] = None,
                 timing: Optional[Timing] = None):
        self.media_type = dialect.media_type
        super().__init__(chunks, first, include_usage=True, on_end=on_end)
        self.dialect, self.body, self.timing = dialect, body, timing

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
        async for data in self.dialect.encode(self._items(), self.body, self.timing):
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self.complete = True


async def answer(receive, dialect: Dialect, body: Dict[str, Any], chunks: Chunks,
                 on_end: Optional[OnEnd] = None) -> Response:
    """Answer one dialect request: translate, generate through ``chunks``, answer (streamed or
    not) in the dialect's format; errors before the answer keep their HTTP status, in the
    dialect's error body; 499 (no body) when the client went away first."""
    timing = Timing()
    try:
        openai_body = dialect.to_openai(body)
        dialect.streams(body)  # a malformed ``stream`` is refused before any work
        for name in ("cache_salt", "prompt_cache_key"):  # vLLM's salt, OpenAI's routing hint: in every
            if name in body:                              # dialect (the provider checks them)
                openai_body[name] = body[name]
    except OpenAIError as exc:
        if on_end is not None:
            on_end(exc, True)
        return dialect.error_response(exc)
    timing.started()
    return await respond(receive, body, timing.watch(chunks(openai_body, dialect.chat)), chat=dialect.chat,
                         on_end=on_end, dialect=dialect, timing=timing)


def dialect_of_path(path: str) -> Optional[Dialect]:
    """The dialect whose error format a path's answers use (``/v1/messages...``: Anthropic,
    ``/api/...``: Ollama, ``/v1/responses...``: Responses), or ``None`` (OpenAI's)."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return ANTHROPIC
    if path.startswith("/api/"):
        return OLLAMA_CHAT
    if path == "/v1/responses" or path.startswith("/v1/responses/"):
        return RESPONSES
    return None


def ollama_embed_request(body: Dict[str, Any]) -> Tuple[Dict[str, Any], bool]:
    """Ollama's ``/api/embed`` body (``model``, ``input`` a string or a list of strings,
    ``truncate`` default true, ``dimensions``; ``options`` change no embedding and are ignored;
    ``keep_alive``, checked, is passed on: a model pool applies it) -> ``(OpenAI embeddings body, truncate)``.

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
    if body.get("keep_alive") is not None:
        _keep_alive_seconds(body["keep_alive"])
        req["keep_alive"] = body["keep_alive"]
    return req, truncate is not False


def mount(app, chunks: Chunks, models: Callable[[], List[Tuple[str, Dict[str, Any]]]], *,
          admit: Optional[Callable[[Request], None]] = None, on_end: Optional[OnEnd] = None,
          count: Optional[Callable[[str, OpenAIError], None]] = None,
          embed: Optional[Callable[..., Awaitable[Dict[str, Any]]]] = None,
          count_tokens: Optional[Callable[[Dict[str, Any]], Awaitable[int]]] = None,
          loaded: Optional[Callable[[], List[Dict[str, Any]]]] = None,
          keep: Optional[Callable[[Any, Any], Awaitable[str]]] = None) -> None:
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
        count_tokens: ``await count_tokens(openai_chat_body)`` -> the prompt's token count, chat
            template and tools included (:meth:`~mlxcluster.front.provider.Provider.count_chat_tokens`);
            ``None``: no ``/v1/messages/count_tokens``.
        loaded: ``[{name, details, size, size_vram, expires_at}]`` of the models loaded now, for
            ``/api/ps`` (``expires_at`` an ISO-8601 string, ``None``: never); called on a worker
            thread.  ``None``: every model of ``models``, loaded for good.
        keep: ``await keep(model, keep_alive)`` -> ``"load"`` / ``"unload"``: Ollama's
            ``/api/generate`` with an empty ``prompt`` loads the model, or with ``keep_alive`` 0
            unloads it, and answers ``done_reason`` so (:meth:`~mlxcluster.front.pool.ModelPool.keep`);
            ``None``: an empty prompt is generated from like any other.
    """
    schemas.install(app)

    async def handle(request: Request, dialect: Dialect, model: type) -> Response:
        try:
            if admit is not None:
                admit(request)
            body = await read_body(request)
            schemas.check(model, body)  # the endpoint's request model: 400 in the dialect's format
        except OpenAIError as exc:
            if count is not None:
                count(dialect.name, exc)
            return dialect.error_response(exc)
        if keep is not None and isinstance(dialect, OllamaGenerate) and body.get("prompt") in (None, ""):
            return await _load_or_unload(keep, body, count)
        return await answer(request.receive, dialect, body, chunks, on_end)

    _mount_generation(app, handle, admit, count, count_tokens)
    _mount_ollama_embeddings(app, admit, count, embed)
    _mount_ollama_models(app, admit, models, loaded)


async def _load_or_unload(keep: Callable[[Any, Any], Awaitable[str]], body: Dict[str, Any],
                          count: Optional[Callable[[str, OpenAIError], None]]) -> Response:
    """Ollama's ``/api/generate`` without a prompt: load the model (``keep_alive`` 0: unload it) and
    answer ``{"model", "created_at", "response": "", "done": true, "done_reason": "load"|"unload"}``
    (Ollama's ``docs/api.md``, "Load a model" / "Unload a model")."""
    try:
        keep_alive = body.get("keep_alive")
        if keep_alive is not None:
            _keep_alive_seconds(keep_alive)
        reason = await keep(_model_name(body.get("model")), keep_alive)
    except OpenAIError as exc:
        if count is not None:
            count(OllamaGenerate.name, exc)
        return OLLAMA_CHAT.error_response(exc)
    return JSONResponse({"model": body.get("model"), "created_at": _now(), "response": "", "done": True,
                         "done_reason": reason})


#: ``await handle(request, dialect, request_model)`` -> the dialect's answer (``mount``'s shared route body)
_Handle = Callable[[Request, Dialect, type], Awaitable[Response]]


def _mount_generation(app, handle: _Handle, admit: Optional[Callable[[Request], None]],
                      count: Optional[Callable[[str, OpenAIError], None]],
                      count_tokens: Optional[Callable[[Dict[str, Any]], Awaitable[int]]]) -> None:
    """Add the generating routes (Anthropic Messages and count_tokens, Responses, Ollama chat/generate)."""
    @app.post("/v1/messages", **schemas.route(schemas.AnthropicMessagesRequest, errors=schemas.ANTHROPIC,
                                              ok=schemas.AnthropicMessageResponse, ok_media=("text/event-stream",)))
    async def messages(request: Request):
        """Anthropic Messages."""
        return await handle(request, ANTHROPIC, schemas.AnthropicMessagesRequest)

    if count_tokens is not None:
        @app.post("/v1/messages/count_tokens", **schemas.route(
            schemas.AnthropicCountTokensRequest, errors=schemas.ANTHROPIC, ok=schemas.TokenCount))
        async def messages_count_tokens(request: Request):
            """Anthropic's token counting: ``{"input_tokens": N}`` for a Messages body (no ``max_tokens``),
            counted through the chat template exactly as the prompt would be."""
            try:
                if admit is not None:
                    admit(request)
                body = await read_body(request)
                schemas.check(schemas.AnthropicCountTokensRequest, body)
                n = await count_tokens(ANTHROPIC.to_openai(body, count_only=True))
            except OpenAIError as exc:
                if count is not None:
                    count("count_tokens", exc)
                return ANTHROPIC.error_response(exc)
            return {"input_tokens": n}

    @app.post("/v1/responses", **schemas.route(schemas.ResponsesRequest, ok=schemas.ResponseObject,
                                               ok_media=("text/event-stream",)))
    async def responses(request: Request):
        """OpenAI Responses."""
        return await handle(request, RESPONSES, schemas.ResponsesRequest)

    @app.post("/api/chat", **schemas.route(schemas.OllamaChatRequest, errors=schemas.OLLAMA, ok=schemas.OllamaAnswer,
                                           ok_media=("application/x-ndjson",)))
    async def ollama_chat(request: Request):
        """Ollama chat (NDJSON stream unless ``"stream": false``)."""
        return await handle(request, OLLAMA_CHAT, schemas.OllamaChatRequest)

    @app.post("/api/generate", **schemas.route(schemas.OllamaGenerateRequest, errors=schemas.OLLAMA,
                                               ok=schemas.OllamaAnswer, ok_media=("application/x-ndjson",)))
    async def ollama_generate(request: Request):
        """Ollama generate (NDJSON stream unless ``"stream": false``)."""
        return await handle(request, OllamaGenerate(), schemas.OllamaGenerateRequest)


def _mount_ollama_embeddings(app, admit: Optional[Callable[[Request], None]],
                             count: Optional[Callable[[str, OpenAIError], None]],
                             embed: Optional[Callable[..., Awaitable[Dict[str, Any]]]]) -> None:
    """Add Ollama's ``/api/embed`` and ``/api/embeddings`` routes when ``embed`` is given."""
    if embed is not None:
        @app.post("/api/embed", **schemas.route(schemas.OllamaEmbedRequest, errors=schemas.OLLAMA,
                                                ok=schemas.OllamaEmbeddings))
        async def ollama_embed(request: Request):
            """Ollama embeddings: ``{"model", "embeddings": [[...]], "total_duration", "load_duration",
            "prompt_eval_count"}`` (durations in nanoseconds)."""
            t0 = time.perf_counter_ns()
            try:
                if admit is not None:
                    admit(request)
                body = await read_body(request)
                schemas.check(schemas.OllamaEmbedRequest, body)
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

        @app.post("/api/embeddings", **schemas.route(schemas.OllamaLegacyEmbeddingRequest, errors=schemas.OLLAMA,
                                                     ok=schemas.OllamaLegacyEmbedding))
        async def ollama_embeddings(request: Request):
            """Ollama's older embeddings endpoint (``ollama.embeddings(model, prompt)``): ``{"model",
            "prompt"}`` -> ``{"embedding": [...]}`` (the same pooled, L2-normalised vector as
            ``/api/embed``'s; an empty prompt has none, as Ollama answers it)."""
            try:
                if admit is not None:
                    admit(request)
                body = await read_body(request)
                schemas.check(schemas.OllamaLegacyEmbeddingRequest, body)
                if body["prompt"] == "":
                    return {"embedding": []}
                req, truncate = ollama_embed_request({"model": body["model"], "input": body["prompt"]})
                result = await embed(req, truncate=truncate, endpoint="embed")
            except OpenAIError as exc:
                if count is not None:
                    count("embed", exc)
                return OLLAMA_CHAT.error_response(exc)
            return {"embedding": result["data"][0]["embedding"]}


def _mount_ollama_models(app, admit: Optional[Callable[[Request], None]],
                         models: Callable[[], List[Tuple[str, Dict[str, Any]]]],
                         loaded: Optional[Callable[[], List[Dict[str, Any]]]] = None) -> None:
    """Add Ollama's model-listing routes (``/api/version``, ``/api/tags``, ``/api/ps``, ``/api/show``)."""
    @app.get("/api/version", **schemas.route(errors=schemas.OLLAMA, ok=schemas.OllamaVersion, statuses=(401,)))
    async def ollama_version():
        return {"version": OLLAMA_VERSION}

    def _admitted(request: Request) -> Optional[Response]:
        try:
            if admit is not None:
                admit(request)
        except OpenAIError as exc:
            return OLLAMA_CHAT.error_response(exc)
        return None

    @app.get("/api/tags", **schemas.route(errors=schemas.OLLAMA, ok=schemas.OllamaModels, statuses=schemas.GET_ERRORS))
    async def ollama_tags(request: Request):
        refused = _admitted(request)
        return refused or {"models": [ollama_model(name, info) for name, info in await asyncio.to_thread(models)]}

    @app.get("/api/ps", **schemas.route(errors=schemas.OLLAMA, ok=schemas.OllamaModels, statuses=schemas.GET_ERRORS))
    async def ollama_ps(request: Request):
        refused = _admitted(request)
        if refused:
            return refused
        if loaded is None:
            return {"models": [dict(ollama_model(name, info), expires_at=NEVER_EXPIRES, size_vram=0)
                               for name, info in await asyncio.to_thread(models)]}
        return {"models": [dict(ollama_model(m["name"], m["details"]), size=int(m["size"]),
                                size_vram=int(m["size_vram"]), expires_at=m["expires_at"] or NEVER_EXPIRES)
                           for m in await asyncio.to_thread(loaded)]}

    @app.post("/api/show", **schemas.route(schemas.OllamaShowRequest, errors=schemas.OLLAMA, ok=schemas.OllamaShow,
                                           statuses=(400, 401, 404, 413, 500)))
    async def ollama_show(request: Request):
        refused = _admitted(request)
        if refused:
            return refused
        try:
            body = await read_body(request)
            schemas.check(schemas.OllamaShowRequest, body)
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

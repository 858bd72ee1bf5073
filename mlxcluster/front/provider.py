"""The OpenAI-style provider in front of rank 0's ``Generation`` service: OpenAI requests in, chunk dicts out.

:class:`Provider` sits in front of rank 0's ``Generation`` gRPC service: it
tokenises requests itself (chat template included), validates their fields
(rank 0 validates the prompt tokens: its ``INVALID_ARGUMENT`` is answered
here as 400 naming the prompt's field), forwards each one to rank 0 at once
(rank 0's scheduler is the one admission queue: ``capacity`` sequences decode
together, ``max_queue`` wait, more are refused with ``RESOURCE_EXHAUSTED``,
answered here as 429), streams rank 0's tokens back as OpenAI chunk dicts
and keeps Prometheus metrics.  The HTTP API
(:mod:`mlxcluster.front.api`) and the marketplace router link both drive
it through :meth:`Provider.chat_completion` / :meth:`Provider.completion`.

Consumers should close the async iterators they stop reading early
(``await it.aclose()``, or ``contextlib.aclosing``); closing (or cancelling
the task that reads) cancels the gRPC call, and rank 0 then sends
``sessionStop`` so every rank frees the sequence's KV cache.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import math
import secrets
import time
import uuid
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Sequence, Tuple

import grpc
import grpc.aio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..engine.constraint import GrammarError, check_grammar, json_grammar
from ..model.tokenizer import answer_tail, apply_chat_messages, final_segment, streaming_detokenizer
from ..protocol.args import (REPETITION_CONTEXT_SIZE, ArgumentError, GenerationArgs, LogitsArgs, SamplingArgs,
                             check_args, to_request)
from ..protocol.errors import GROUP_FAILURE_CODES, OpenAIError
from ..protocol import mlxcluster_pb2 as pb
from ..protocol import mlxcluster_pb2_grpc as pb_grpc
from .auth import REQUEST_KEY
from .tools import StopScan, ToolCalls, template_messages, tool_spec

log = logging.getLogger(__name__)

__all__ = ["CACHE_ISOLATION", "Delivered", "Provider", "ProviderError", "cache_namespace", "speculative_figures"]

DEFAULT_CHAT_MAX_TOKENS = 256    # OpenAI's chat default is "up to the context"; bounded here
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's /v1/completions default
MAX_STOP_SEQUENCES = 4           # as OpenAI
RETARGET_GRACE_S = 1.0           # seconds a call on a replaced group's channel may still read (Provider.retarget)


#: ``serve --cache-isolation`` values (:class:`Provider`)
CACHE_ISOLATION = ("none", "key")
#: The longest ``cache_salt`` a request may set, in characters.
MAX_CACHE_SALT_CHARS = 1024


def cache_namespace(salt: str, key: str = "") -> str:
    """A request's prefix-cache namespace as rank 0 is given it (``GenerateRequest.cache_salt``): the
    request's ``salt`` alone, or, where ``key`` (the API key's digest, ``--cache-isolation key``) is
    set, the SHA-256 hex digest of both (the key itself never leaves the front).  "" shares the
    caches.  Rank 0 hashes it again (:func:`mlxcluster.leader.scheduler.salt_namespace`)."""
    if not key:
        return salt
    import hashlib

    return hashlib.sha256(f"{key}\0{salt}".encode("utf-8", "surrogatepass")).hexdigest()


class ProviderError(OpenAIError):
    """A request the provider refuses or cannot serve, in OpenAI's error terms.

    Attributes:
        status: HTTP status (400 bad request, 404 unknown model, 429 queue full,
            503 cluster unavailable, 500 unexpected rank 0 failure).
        message: one line.
        type: OpenAI error type (``invalid_request_error``, ``rate_limit_error``,
            ``server_error``).
        param: the offending request field, or ``None``.
        code: OpenAI error code (e.g. ``model_not_found``), or ``None``.
        retry_after: seconds a client should wait before retrying (429/503).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 retry_after: Optional[float] = None):
        super().__init__(status, message, type, param, code, retry_after)


def _bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ProviderError:
    return ProviderError(400, message, "invalid_request_error", param, code)


def _check_prompt_cache_key(body: Dict[str, Any]) -> None:
    """Check OpenAI's ``prompt_cache_key`` (a string, when given).  It is a routing hint
    only (the router's cache affinity, :meth:`mlxcluster.router.server.Router._pick`): one group
    keeps one prefix cache, so the provider neither shares nor isolates anything by it
    (``cache_salt`` does).

    Raises:
        ProviderError: 400 naming ``prompt_cache_key`` (not a string)."""
    key = body.get("prompt_cache_key")
    if key is not None and not isinstance(key, str):
        raise _bad("'prompt_cache_key' must be a string", "prompt_cache_key")


# -- metrics ---------------------------------------------------------------------------
class Metrics:
    """The provider's Prometheus metrics, in their own ``registry``; the gauges
    read ``load`` (:meth:`Provider.load`) when scraped."""

    def __init__(self, load: Callable[[], Dict[str, int]]):
        self.registry = CollectorRegistry()
        r = self.registry
        p = "mlxcluster_provider_"
        self.requests = Counter(p + "requests", "Requests by endpoint and HTTP status "
                                "(499: the client went away).", ["endpoint", "status"], registry=r)
        self.errors = Counter(p + "errors", "Failed requests by OpenAI error type.", ["type"], registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "This provider's requests sent to rank 0 that have "
                                 "no token yet (waiting in rank 0's queue or in prefill).", registry=r)
        self.queue_depth.set_function(lambda: load()["queued"])
        self.running = Gauge(p + "running", "This provider's requests streaming tokens from rank 0.", registry=r)
        self.running.set_function(lambda: load()["running"])
        self.capacity = Gauge(p + "capacity", "Sequences rank 0 decodes together (its InfoReply.capacity).",
                              registry=r)
        self.capacity.set_function(lambda: load()["capacity"])
        self.ttft = Histogram(p + "time_to_first_token_seconds",
                              "Request arrival to first generated token (queue wait included).",
                              registry=r, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300))
        self.tokens_per_s = Histogram(p + "decode_tokens_per_second", "Decode speed per request.",
                                      registry=r, buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000))
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of served requests.", registry=r)
        self.completion_tokens = Counter(p + "completion_tokens", "Generated tokens (counted as they are "
                                         "generated).", registry=r)
        # failover (issue 29): requests replayed across a group's re-formation
        self.replays = Counter(p + "replays", "Requests re-sent to a new group after theirs failed, by cause "
                               "(unavailable, cancelled, internal, group_error, stream_ended, group_replaced).", ["cause"],
                               registry=r)
        self.waited = Counter(p + "waited_for_group", "Requests that waited for a group to serve "
                              "(arrived while none served, or replayed).", registry=r)
        self.wait_s = Histogram(p + "group_wait_seconds", "Time a request waited for a serving group.", registry=r,
                                buckets=(0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120))
        self.failed_after_replays = Counter(p + "failed_after_replays", "Requests that failed after their "
                                            "replays ran out or no group served in time.", registry=r)
        # speculative decoding (issue 30), from each answer's GenerateDone: acceptance rate =
        # accepted / drafted, tokens per decode step = decoded / decode steps
        s = "mlxcluster_spec_"
        self.spec_drafted = Counter(s + "drafted_tokens", "Draft tokens verified (speculative decoding).", registry=r)
        self.spec_accepted = Counter(s + "accepted_tokens", "Draft tokens accepted (speculative decoding).",
                                     registry=r)
        self.spec_steps = Counter(s + "verify_steps", "Decode steps of a request that verified a draft.", registry=r)
        self.spec_decode_steps = Counter(s + "decode_steps", "Decode steps after each answer's first token, drafted "
                                         "or not.", registry=r)
        self.spec_decoded = Counter(s + "decoded_tokens", "Tokens those decode steps gave.", registry=r)
        self.reformation_s = Histogram(p + "reformation_seconds", "A group's re-formation: failure detected to "
                                       "serving again (the healer).", registry=r,
                                       buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300))


def describe_model(model_path: Optional[str]) -> Dict[str, Any]:
    """What the model catalog (:func:`mlxcluster.model.catalog.describe`) says of a model reference, as
    the Ollama dialect's ``/api/tags`` and ``/api/show`` read it: ``architecture``, ``size`` (bytes of
    its files), ``format`` (``gguf`` or ``safetensors``), ``parameter_size`` (``135M``, ``7.6B``); ``{}``
    when it cannot be read (a description only: serving does not depend on it).  Reads the model's
    files (a GGUF whole): call it off the event loop."""
    details: Dict[str, Any] = {}
    try:
        from ..model.catalog import describe
        from ..model.loader import resolve_model_path

        entry = describe(resolve_model_path(model_path))
        if not entry.error:
            details.update(architecture=entry.architecture, size=entry.size_bytes,
                           format="gguf" if entry.path.endswith(".gguf") else "safetensors")
            if entry.parameters:
                details["parameter_size"] = f"{entry.parameters / 1e6:.0f}M" if entry.parameters < 1e9 \
                    else f"{entry.parameters / 1e9:.1f}B"
    except Exception as exc:  # a description only
        log.debug("model details unavailable: %s", exc)
    return details


def speculative_figures(info: Optional[pb.InfoReply]) -> Optional[Dict[str, Any]]:
    """The dashboards' speculative-decoding figures from rank 0's ``Info`` (``None`` without one):
    ``draft`` (the server's default drafter, ``--draft``; "" off -- a request may still draft with its
    own ``speculative``), ``draft_tokens`` (its bound, ``--draft-tokens``), and since rank 0 started,
    over every step of a sequence that had a draft: ``drafted_tokens``, ``acceptance_rate`` (accepted /
    drafted draft tokens) and ``tokens_per_step`` (tokens emitted per such step: 1 .. k + 1); both
    ``None`` before any draft."""
    if info is None:
        return None
    drafted, steps = int(info.spec_drafted_tokens), int(info.spec_steps)
    return {"draft": info.draft, "draft_tokens": int(info.draft_tokens), "drafted_tokens": drafted,
            "acceptance_rate": round(info.spec_accepted_tokens / drafted, 4) if drafted else None,
            "tokens_per_step": round(info.spec_emitted_tokens / steps, 4) if steps else None}


# -- request parsing -------------------------------------------------------------------
def _number(body: Dict[str, Any], name: str, default, lo=None, hi=None, lo_open=False, integer=False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise _bad(f"'{name}' must be {'an integer' if integer else 'a number'}", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise _bad(f"'{name}' must be finite", name)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise _bad(f"'{name}' must be {'greater than' if lo_open else 'at least'} {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise _bad(f"'{name}' must be at most {hi}, got {value}", name)
    return value


def _seed(body: Dict[str, Any], temperature: float) -> int:
    """The request's ``seed`` as the sampler's uint64 (any JSON integer, ``35804.0`` included, taken
    modulo 2**64); without one, a random 63-bit seed (0 when greedy: nothing is drawn).

    Raises:
        ProviderError: 400 naming ``seed`` (not an integer)."""
    seed = _number(body, "seed", None)
    if isinstance(seed, float):  # JSON numbers: 35804.0 is the integer 35804
        if not seed.is_integer():
            raise _bad(f"'seed' must be an integer, got {seed}", "seed")
        seed = int(seed)
    if seed is None:
        seed = secrets.randbits(63) if temperature > 0 else 0
    return int(seed) & (2**64 - 1)


def _speculative(body: Dict[str, Any]) -> Optional[Tuple[str, int]]:
    """The request's ``speculative`` extension (:class:`~mlxcluster.front.schemas.Speculative`):
    ``(draft, draft_tokens)`` for ``GenerateRequest.speculative``, or ``None`` (the server's default).
    An unknown or malformed drafter (:func:`~mlxcluster.engine.speculative.parse_draft`: ``ngram``,
    ``ngram:MIN-MAX``, ``model:PATH``, ``layers:N``, ``remote:HOST:PORT``) and a ``draft_tokens`` outside 0..16 are 400s
    naming ``speculative``; whether the model can speculate, a ``layers:N`` beyond its layers and a
    draft model that is missing or has another vocabulary are rank 0's to say (its refusal is a 400
    naming ``speculative`` too)."""
    from ..engine.speculative import MAX_DRAFT_TOKENS, parse_draft

    spec = body.get("speculative")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise _bad("'speculative' must be an object: {\"draft\": \"ngram\", \"draft_tokens\": 4}", "speculative")
    draft = spec.get("draft") or ""
    if not isinstance(draft, str):
        raise _bad("'speculative.draft' must be a string (ngram, ngram:MIN-MAX, model:PATH, layers:N, "
                   "remote:HOST:PORT or off)",
                   "speculative")
    k = spec.get("draft_tokens") or 0
    if isinstance(k, float) and k.is_integer():
        k = int(k)
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_DRAFT_TOKENS:
        raise _bad(f"'speculative.draft_tokens' must be an integer in 0..{MAX_DRAFT_TOKENS}, got {k!r}", "speculative")
    if draft and draft not in ("off", "none"):
        try:
            parse_draft(draft, "speculative.draft")
        except ValueError as exc:
            raise _bad(str(exc), "speculative") from None
    return draft, k


def _stops(body: Dict[str, Any]) -> List[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _bad("'stop' must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise _bad(f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences", "stop")
    return [s for s in stop if s]


def _message_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _bad(f"messages[{index}].content: only text parts are supported, got {kind!r}",
                           f"messages[{index}].content")
        return "".join(parts)
    raise _bad(f"messages[{index}].content must be a string or a list of text parts",
               f"messages[{index}].content")


def _messages(body: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The conversation as the chat template reads it: ``{"role", "content"}``, plus an
    assistant's ``tool_calls`` and a tool result's ``tool_call_id``."""
    messages = body.get("messages")
    if messages is None:
        raise _bad("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise _bad(f"messages[{i}].role {m['role']!r} is not one of system, developer, user, "
                       "assistant, tool", f"messages[{i}].role")
        role = "system" if m["role"] == "developer" else m["role"]
        if m.get("content") is None and not (role == "assistant" and any(
                m.get(k) not in (None, [], "") for k in ("tool_calls", "function_call", "refusal"))):
            # OpenAI: content may be null (or absent) only for an assistant message that carries
            # tool_calls (or a function_call / refusal)
            raise _bad(f"messages[{i}].content is required for a {m['role']} message (null only for an "
                       "assistant message with tool_calls)", f"messages[{i}].content")
        msg: Dict[str, Any] = {"role": role, "content": _message_text(m.get("content"), i)}
        calls = m.get("tool_calls")
        if role == "assistant" and calls:
            if not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str) for c in calls):
                raise _bad(f"messages[{i}].tool_calls must be a list of function calls", f"messages[{i}].tool_calls")
            msg["tool_calls"] = calls
        if role == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = str(m["tool_call_id"])
        out.append(msg)
    return out



def _grpc_error(exc: grpc.RpcError, why: Optional[str], retry_after: float = 5.0,
                param: Optional[str] = None) -> ProviderError:
    """Rank 0's gRPC status as an OpenAI error: ``INVALID_ARGUMENT`` (rank 0 refused
    the prompt) 400 on ``param``, ``RESOURCE_EXHAUSTED`` (its queue is full) 429
    with ``retry_after``, ``UNKNOWN``/``INTERNAL`` 500, anything else 503 (``why``:
    the group's failure, appended)."""
    code = exc.code() if hasattr(exc, "code") else None
    detail = (exc.details() if hasattr(exc, "details") else None) or str(code)
    if code == grpc.StatusCode.INVALID_ARGUMENT:  # (rank 0 names a speculative field it refused)
        return _bad(detail, "speculative" if detail.startswith("speculative.") else param)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # rank 0's queue is full
        return ProviderError(429, f"the cluster's queue is full: {detail}", "rate_limit_error",
                             code="rate_limit_exceeded", retry_after=retry_after)
    if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
        return ProviderError(500, f"rank 0 failed: {detail}", "server_error")
    msg = f"cluster unavailable: {detail}" + (f" ({why})" if why else "")
    return ProviderError(503, msg, "server_error", code="service_unavailable", retry_after=5)


# -- failover: replay bookkeeping (issue 29) ---------------------------------------------
def replay_cause(exc: Optional[grpc.RpcError] = None, done_reason: Optional[int] = None) -> Optional[str]:
    """Why a broken generation may be replayed (a ``replays`` metric label), ``None`` if it may not.

    Args:
        exc: the gRPC error the stream raised (``None``: it ended without raising).
        done_reason: the ``GenerateDone.reason`` it ended with (``None``: no ``done`` event).
    Returns:
        ``"unavailable"`` / ``"cancelled"`` / ``"internal"`` (the stream broke with that status),
        ``"group_error"`` (rank 0 ended it with ``ERROR``: the group failed), ``"stream_ended"``
        (it ended without ``done``), or ``None`` (a refusal or a finished answer)."""
    if exc is not None:
        return GROUP_FAILURE_CODES.get(exc.code() if hasattr(exc, "code") else None)
    if done_reason is None:
        return "stream_ended"
    return "group_error" if done_reason == pb.ERROR else None


def resume_request(request: pb.GenerateRequest, delivered: Sequence[int]) -> pb.GenerateRequest:
    """The request to re-send after a failure: the same prompt, sampling and ORIGINAL ``max_tokens``
    (it counts the resumed tokens), with ``resume_token_ids`` = ``delivered``, the generated token
    ids already passed on (EOS never among them); rank 0 continues after them.  ``request`` is not
    changed.  With nothing delivered it is ``request`` itself (a plain re-send)."""
    if not delivered:
        return request
    again = pb.GenerateRequest()
    again.CopyFrom(request)
    del again.resume_token_ids[:]
    again.resume_token_ids.extend(int(t) for t in delivered)
    return again


def _unresumed(sent: int, answered: Optional[int]) -> ProviderError:
    """The error of a replay that rank 0 did not continue: it reported resuming ``answered`` tokens
    (``None``: no report before its first token) where ``sent`` were sent -- a rank 0 that ignores
    ``resume_token_ids`` would start the answer again, and the client would get it twice."""
    said = "did not say it resumed them" if answered is None else f"resumed {answered}"
    return ProviderError(503, f"the replayed request was not continued: {sent} generated tokens were sent to the "
                         f"new group and rank 0 {said}", "server_error", code="service_unavailable", retry_after=5)


def replay_error(failures: int, cause: str) -> ProviderError:
    """The one error of a request whose group failed ``failures`` times (its replays ran out):
    503 naming the count and the last failure."""
    return ProviderError(503, f"the group failed {failures} time{'s' if failures != 1 else ''} during this "
                         f"request: {cause}", "server_error", code="service_unavailable", retry_after=5)


class Delivered:
    """The part of one answer a client has received, in generated tokens and text: what the
    router's continuation on another provider resumes after (``chat_completion(resume=...)``), and
    what a provider reports as it streams (``progress=``).

    Attributes:
        token_ids: the generated token ids (list of int, EOS never), in order.
        chars: characters (code points) of answer text released with them: stop strings applied
            (text held back for a possible stop string is not counted), before tool-call parsing."""

    __slots__ = ("token_ids", "chars")

    def __init__(self, token_ids: Sequence[int] = (), chars: int = 0):
        self.token_ids: List[int] = [int(t) for t in token_ids]
        self.chars = int(chars)

    def add(self, text: str, token: Optional[Tuple[int, Any]]) -> None:
        """Count one text piece the answer released and the token it came with (``None``: a tail)."""
        if token is not None:
            self.token_ids.append(int(token[0]))
        self.chars += len(text)


def released_text(tokenizer, tokens: Sequence[int]) -> Tuple[str, str]:
    """``(released, tail)`` of an answer's first ``tokens`` (int ids, no EOS): the text rank 0's
    streaming detokenizer sent with them (the concatenation of their ``token.text`` pieces) and
    the text it still held (its ``done.text_tail`` had the answer been cut there, as
    :func:`~mlxcluster.model.tokenizer.answer_tail`).  O(len(tokens)) tokenizer calls: run it off
    the event loop."""
    detok = streaming_detokenizer(tokenizer, tokens)
    released = detok.text[:detok.offset]
    return released, final_segment(detok, False)


class _Waiters:
    """Futures woken when the provider may serve again (a group is serving, or another group was
    put in place); one per waiting request, each of its own event loop (woken thread-safely)."""

    def __init__(self) -> None:
        self._futures: List[Tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    async def wait(self, timeout_s: float) -> None:
        """Wait for :meth:`wake` at most ``timeout_s`` seconds (``asyncio.TimeoutError`` after)."""
        loop = asyncio.get_running_loop()
        entry = (loop, loop.create_future())
        self._futures.append(entry)
        try:
            await asyncio.wait_for(entry[1], max(0.0, timeout_s))
        finally:
            if entry in self._futures:
                self._futures.remove(entry)

    def wake(self) -> None:
        futures, self._futures = self._futures, []
        for loop, fut in futures:
            if not loop.is_closed():
                loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_result(None))


#: OpenAI's ``reasoning_effort`` values; a chat template that reads ``reasoning_effort`` gets it,
#: one that reads ``enable_thinking`` (Qwen3) gets ``enable_thinking = effort != "none"``.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
#: Request fields not implemented yet: refused (400) when they ask for something, never ignored.
_UNSUPPORTED_CHAT = ("functions", "function_call", "audio", "prediction", "web_search_options")
_UNSUPPORTED_COMPLETIONS = ("suffix",)
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound on the completions endpoint's logprobs


def _byte_decoder() -> Dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted (character -> byte): openai/gpt-2 ``encoder.py``
    ``bytes_to_unicode``, as Hugging Face ``tokenizers``' ByteLevel pre-tokenizer uses it."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
        list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _usage(prompt: int, completion: int, cached: int = 0) -> Dict[str, Any]:
    """OpenAI's ``usage`` object (token counts); ``cached``: the leading prompt tokens taken from
    the ranks' prefix caches (``prompt_tokens_details.cached_tokens``, counted in ``prompt``)."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _stopped(chunk: Dict[str, Any], matched: Optional[str]) -> Dict[str, Any]:
    """The finishing chunk, naming the stop string that ended the answer in ``stop_reason``
    (vLLM's extension of the choice object; Anthropic's ``stop_sequence`` is read from it)."""
    if matched is not None:
        chunk["choices"][0]["stop_reason"] = matched
    return chunk


# -- embeddings --------------------------------------------------------------------------
#: inputs of one embeddings request (OpenAI's bound)
MAX_EMBEDDING_INPUTS = 2048
#: inputs per ``Generation.Embed`` call: a request's inputs go to rank 0 in calls of at most this
#: many, one after another, so that a reply (inputs x width float32) stays well within gRPC's
#: 4 MiB message bound (64 x 8192 x 4 bytes = 2 MiB)
EMBED_INPUTS_PER_CALL = 64


def embedding_inputs(value: Any, param: str = "input") -> List[Any]:
    """OpenAI's embeddings ``input``: a string, a list of strings, a list of token ids (one input)
    or a list of such lists -> the inputs, each a ``str`` or a ``List[int]``.

    Raises:
        ProviderError: 400 on ``param``: not one of those forms, empty, an empty string or token
            list, a negative or non-integer token, more than :data:`MAX_EMBEDDING_INPUTS` inputs."""
    def ids_of(x: Any) -> Optional[List[int]]:
        if isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x):
            if not x:
                raise _bad(f"'{param}' holds an empty token list", param)
            if any(t < 0 for t in x):
                raise _bad(f"'{param}' holds a negative token id", param)
            return list(x)
        return None

    form = f"'{param}' must be a string, a list of strings, a list of token ids or a list of token id lists"
    if isinstance(value, str):
        items: List[Any] = [value]
    elif not isinstance(value, list) or not value:
        raise _bad(form if not isinstance(value, list) else f"'{param}' must not be empty", param)
    elif all(isinstance(x, str) for x in value):
        items = list(value)
    else:
        one = ids_of(value)
        if one is not None:
            items = [one]
        else:
            items = [ids_of(x) for x in value]
            if any(x is None for x in items):
                raise _bad(form, param)
    if len(items) > MAX_EMBEDDING_INPUTS:
        raise _bad(f"'{param}' holds {len(items)} inputs, at most {MAX_EMBEDDING_INPUTS} are allowed", param)
    for i, x in enumerate(items):
        if isinstance(x, str) and not x:
            raise _bad(f"'{param}' holds an empty string (input {i})", param)
    return items


def encode_embedding(values: Sequence[float], encoding_format: str) -> Any:
    """One embedding as OpenAI answers it: ``"float"`` a list of floats, ``"base64"`` the
    little-endian float32 bytes, base64-encoded (what the ``openai`` client decodes with NumPy)."""
    if encoding_format == "base64":
        import base64
        import struct

        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return [float(v) for v in values]


# -- provider --------------------------------------------------------------------------
class Provider:
    """One tensor-parallel cluster (reached through rank 0) as an OpenAI-style provider.

    Args:
        rank0_address: ``host:port`` of rank 0's ``Generation`` service.
        model_path: the model's ``.gguf`` file or mlx-lm directory (``None``:
            embedded default); only its tokenizer is read here.
        model_name: the id clients pass as ``model``.
        credentials: :class:`mlxcluster.security.Credentials` of the cluster: the link
            to rank 0 is mutual TLS (rank 0 proves the secret before a prompt is sent).
        default_max_tokens: chat ``max_tokens`` when the request has none
            (completions default to OpenAI's 16).
        request_timeout_s: bound on one gRPC generation.
        failure: optional callable giving one line on why the group failed
            (e.g. ``LocalCluster.failure``), appended to 503 messages.
        max_replays: times one request is re-sent to a new group after its group failed (while a
            :class:`~mlxcluster.front.healer.Healer` heals this provider: :attr:`healing`); then it
            fails with one 503 naming the cause.
        unavailable_wait_s: seconds a request waits for a serving group (arriving while the group
            is replaced, or to be replayed) before a 503 with ``Retry-After``.
        cache_isolation: ``"none"``: prompts share the prefix caches unless a request sets
            ``cache_salt``; ``"key"`` (``serve --cache-isolation key``): each API key's prompts
            have their own namespace too (:func:`cache_namespace`), so no client learns another's
            prompts through ``cached_tokens`` or time to first token.

    Admission is rank 0's (its ``--max-batch`` / ``--max-queue``): every request
    is forwarded at once; a full queue is answered 429 with ``Retry-After``.
    ``capacity`` and ``max_queue`` are rank 0's ``InfoReply`` figures read at
    start-up.

    Raises:
        ProviderError: (503) rank 0 does not answer ``Info``; (500) the
            tokenizer cannot be read.
    """

    def __init__(self, rank0_address: str, model_path: Optional[str], model_name: str, credentials, *,
                 default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS, request_timeout_s: float = 600.0,
                 failure: Optional[Callable[[], Optional[str]]] = None, max_replays: int = 2,
                 unavailable_wait_s: float = 60.0, cache_isolation: str = "none"):
        if max_replays < 0 or not unavailable_wait_s >= 0:
            raise ValueError("max_replays and unavailable_wait_s must be at least 0")
        if cache_isolation not in CACHE_ISOLATION:
            raise ValueError(f"cache isolation must be one of {', '.join(CACHE_ISOLATION)}, not {cache_isolation!r}")
        self.cache_isolation = cache_isolation
        self.rank0_address = rank0_address
        self.max_replays = int(max_replays)
        self.unavailable_wait_s = float(unavailable_wait_s)
        #: a healer replaces this provider's failed groups: requests wait for the next one and are
        #: replayed there (set by :class:`~mlxcluster.front.healer.Healer`); else they fail at once
        self.healing = False
        self._unavailable: Optional[str] = None
        self._epoch = 0  # groups put in place by retarget
        self._waiters = _Waiters()
        self.last_reformation_s: Optional[float] = None
        self.model_name = model_name
        self.models: List[str] = [model_name]
        self.credentials = credentials
        self.default_max_tokens = default_max_tokens
        self.request_timeout_s = request_timeout_s
        self._failure = failure or (lambda: None)
        from ..model.loader import ModelError, load_tokenizer

        try:
            self.tokenizer, self.eos_token_ids = load_tokenizer(model_path)
        except ModelError as exc:
            raise ProviderError(500, str(exc), "server_error") from None
        info = self._info_sync()
        self.world_size = int(info.world_size)
        self.context_length = int(info.context_length)
        self.vocab_size = int(info.vocab_size)
        self.capacity = max(1, int(info.capacity))
        self.max_queue = int(info.max_queue)
        self._queued = 0   # this provider's requests at rank 0 without a token yet
        self._running = 0  # ... and those streaming tokens
        self.metrics = Metrics(self.load)
        self.registry = self.metrics.registry
        self._channels: Dict[Any, Tuple[grpc.aio.Channel, pb_grpc.GenerationStub]] = {}
        self._closing: set = set()  # retarget's background closes of replaced channels (kept referenced)
        #: the group's state for ``/health`` (``status``, ``restarts``, ``last_failure``), set by the healer
        self.group_status: Dict[str, Any] = {"status": "ok", "restarts": 0, "last_failure": None}
        self._service_s = 5.0  # moving average of a request's running time, for Retry-After
        #: OpenAI's backend-configuration fingerprint (a string, as the spec types it): the model
        #: as rank 0 runs it, the weight format and the world size; changes when any of them does
        import hashlib

        fp = hashlib.blake2b(f"{info.model}|{info.weight_format}|{info.world_size}".encode(), digest_size=5)
        self.system_fingerprint = "fp_" + fp.hexdigest()
        self._tokens: Dict[int, Tuple[str, List[int]]] = {}  # token id -> (text, bytes), for logprobs
        # the dashboard (snapshot): recent failures, the rank list, the tok/s window, TTFT
        self.recent_errors: "collections.deque" = collections.deque(maxlen=20)
        self._last_ranks: List[Dict[str, Any]] = []
        self._last_spec: Optional[Dict[str, Any]] = None  # speculative_figures of rank 0's last Info
        self._rate: "collections.deque" = collections.deque()
        self._ttft_seen, self._ttft_last = (0.0, 0.0), None
        self._bytes = _byte_decoder()
        self.model_path = model_path
        self.weight_format = info.weight_format
        self._details: Optional[Dict[str, Any]] = None
        self._digest: Optional[str] = None  # model_digest(), once read

    def model_digest(self) -> str:
        """The served model's identity: :func:`mlxcluster.model.loader.model_digest` of its file or
        directory ("" when it cannot be read).  Read once (up to 2 MiB of the file: call it off
        the event loop), then kept; the router continues an answer only on a provider with the
        same digest."""
        if self._digest is None:
            try:
                from ..model.loader import model_digest, resolve_model_path

                self._digest = model_digest(resolve_model_path(self.model_path))
            except Exception as exc:  # an identity only: serving does not depend on it
                log.debug("model digest unavailable: %s", exc)
                self._digest = ""
        return self._digest

    def model_details(self) -> Dict[str, Any]:
        """What the Ollama dialect's ``/api/tags`` and ``/api/show`` describe: ``weight_format``,
        ``context_length``, ``template`` and, from the model catalog (:func:`mlxcluster.model.catalog.describe`),
        ``architecture``, ``format``, ``size``, ``parameter_size``.  Computed on first use (it
        reads the model's files: call it off the event loop), then kept."""
        if self._details is None:
            details: Dict[str, Any] = {"weight_format": self.weight_format, "context_length": self.context_length,
                                       "template": getattr(self.tokenizer, "chat_template", None) or ""}
            details.update(describe_model(self.model_path))
            self._details = details
        return self._details

    def catalog(self) -> List[Tuple[str, Dict[str, Any]]]:
        """``[(name, details)]`` of the served models (``/api/tags``, ``/api/show``): this one's
        :meth:`model_details` (reads files: call it off the event loop)."""
        return [(m, self.model_details()) for m in self.models]

    def loaded(self) -> List[Dict[str, Any]]:
        """Ollama's ``/api/ps`` view: the one model, loaded for as long as ``serve`` runs (``expires_at``
        ``None``: never), ``size`` its weight files' bytes, ``size_vram`` 0 (not measured here)."""
        return [{"name": m, "details": self.model_details(), "size": int(self.model_details().get("size", 0)),
                 "size_vram": 0, "expires_at": None} for m in self.models]

    #: Ollama's load/unload requests (an empty prompt) are a model pool's (:class:`~mlxcluster.front.pool.ModelPool`);
    #: one provider's model is loaded for as long as ``serve`` runs
    keep = None

    # -- rank 0 ----------------------------------------------------------------------
    def _info_sync(self) -> pb.InfoReply:
        channel = self.credentials.channel(self.rank0_address)
        try:
            return pb_grpc.GenerationStub(channel).Info(pb.InfoRequest(), timeout=10)
        except grpc.RpcError as exc:
            raise _grpc_error(exc, self._failure()) from None
        finally:
            channel.close()

    @property
    def unavailable(self) -> Optional[str]:
        """Why rank 0 is being replaced (set by :class:`~mlxcluster.front.healer.Healer`); ``None``:
        serving.  Setting ``None`` wakes the requests waiting for a group."""
        return self._unavailable

    @unavailable.setter
    def unavailable(self, why: Optional[str]) -> None:
        self._unavailable = why
        if why is None:
            self._waiters.wake()

    async def wait_for_group(self, after_epoch: Optional[int], deadline: float) -> bool:
        """Wait until a group serves (:attr:`unavailable` is ``None``) and, with ``after_epoch``,
        one other than that epoch's (:meth:`retarget` put a new one in place), until ``deadline``
        (``time.monotonic()`` seconds).  Returns whether one does; no polling: :meth:`retarget` and
        clearing :attr:`unavailable` wake the waiters.  A cancelled waiter (the client went away)
        just leaves."""
        while self._unavailable is not None or (after_epoch is not None and self._epoch <= after_epoch):
            if not self.healing:  # nothing will replace the group (the healer gave up)
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await self._waiters.wait(left)
            except asyncio.TimeoutError:
                return False
        return True

    def end_healing(self) -> None:
        """No group will be put in place any more (the healer gave up): requests waiting for one
        fail now, and new ones are refused at once."""
        self.healing = False
        self._waiters.wake()

    async def retarget(self, rank0_address: str, credentials, grace_s: Optional[float] = None) -> None:
        """Talk to a new rank 0 (a restarted group) from now on, and wake the requests waiting to be
        replayed.  The old channels are closed in the background with a grace of ``grace_s``
        (default :data:`RETARGET_GRACE_S`): a call still on one reads what the old rank 0 sent before its
        abort (tokens in flight when the healer saw the failure: a replay resumes after them instead
        of generating them again), and one still open after the grace (a frozen rank 0 whose socket
        stayed open) is cancelled and replayed.  ``grace_s=0``: the old rank 0 was silent (frozen or
        cut off), nothing more comes from it; its calls are cancelled at once."""
        self.rank0_address, self.credentials = rank0_address, credentials
        channels, self._channels = self._channels, {}
        self._epoch += 1
        self._waiters.wake()
        grace = RETARGET_GRACE_S if grace_s is None else grace_s
        for channel, _stub in channels.values():
            task = asyncio.ensure_future(self._close_channel(channel, grace))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    @staticmethod
    async def _close_channel(channel, grace_s: float) -> None:
        try:
            await channel.close(grace=grace_s or None)
        except RuntimeError:  # a channel of a loop that is gone
            pass

    def _check_available(self) -> None:
        if self.unavailable is not None:
            raise ProviderError(503, f"the tensor-parallel group is restarting ({self.unavailable})", "server_error",
                                code="service_unavailable", retry_after=5)

    def _stub(self) -> pb_grpc.GenerationStub:
        """The async stub of the running event loop (grpc.aio channels are per loop)."""
        loop = asyncio.get_running_loop()
        entry = self._channels.get(loop)
        if entry is None:
            for other in [l for l in self._channels if l.is_closed()]:
                self._channels.pop(other, None)
            channel = self.credentials.aio_channel(self.rank0_address)
            entry = (channel, pb_grpc.GenerationStub(channel))
            self._channels[loop] = entry
        return entry[1]

    async def health(self, timeout_s: float = 3.0) -> Dict[str, Any]:
        """Rank 0's ``Info``: model, world size, backend, weight format, context
        length, ``kv_cache`` (``bits`` / ``group_size`` of quantized K/V, ``None`` at full precision) and ``queue`` (rank 0's admission queue: ``capacity``,
        ``max_queue``, ``queued``, ``running``, all requests counted, not only
        this provider's).  Raises ProviderError (503) when it does not answer or the
        group is restarting."""
        self._check_available()
        try:
            info = await self._stub().Info(pb.InfoRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise _grpc_error(exc, self._failure()) from None
        return {"status": "ok", "model": self.model_name, "rank0_model": info.model,
                "world_size": info.world_size, "backend": info.backend,
                "weight_format": info.weight_format, "context_length": info.context_length,
                "kv_cache": {"bits": info.kv_bits or None, "group_size": info.kv_group_size or None},
                "queue": {"capacity": info.capacity, "max_queue": info.max_queue, "queued": info.queued,
                          "running": info.running, "batch_limit": info.batch_limit}}

    async def aclose(self) -> None:
        """Close this loop's gRPC channel."""
        loop = asyncio.get_running_loop()
        entry = self._channels.pop(loop, None)
        if entry is not None:
            await entry[0].close()

    def load(self) -> Dict[str, int]:
        """This provider's requests in flight at rank 0, ``{queued, running,
        capacity}``: ``queued`` have no token yet (waiting in rank 0's queue or
        in prefill), ``running`` stream tokens; ``capacity`` is rank 0's."""
        return {"queued": self._queued, "running": self._running, "capacity": self.capacity}

    def record_request(self, endpoint: str, status: int, error_type: Optional[str] = None) -> None:
        """Count a request the provider itself never saw (e.g. malformed JSON at the HTTP layer)."""
        self.metrics.requests.labels(endpoint, str(status)).inc()
        if error_type:
            self.metrics.errors.labels(error_type).inc()

    def _count_failure(self, endpoint: str, exc: "ProviderError") -> str:
        """Count a refused or failed request (its error type; a 5xx also as the provider's last error);
        returns its HTTP status as the requests counter's label."""
        self.metrics.errors.labels(exc.type).inc()
        if exc.status >= 500:
            self.note_error(f"{endpoint} failed ({exc.status}): {exc.message}")
        return str(exc.status)

    def note_error(self, message: str) -> None:
        """Remember a failure (a request that failed, the group lost) for the dashboard."""
        self.recent_errors.append({"time": time.time(), "message": message[:300]})

    async def snapshot(self) -> Dict[str, Any]:
        """What the dashboard shows, from rank 0's ``Info`` and this provider's Prometheus metrics:
        ``model``, ``world_size``, ``backend``, ``weight_format``, ``ranks`` (rank, memory in use and
        weight bytes, alive; all marked lost when rank 0 does not answer), ``queue`` (rank 0's
        ``queued``/``running``/``capacity``), ``decode_tokens_per_s`` (generated tokens per second
        over the last ~3 s), ``ttft_s`` (mean TTFT of the requests that started since the last
        snapshot, else the previous figure), ``tokens_total``, ``group`` (the healer's status),
        ``errors`` (the last 20, oldest first), ``failover`` (:meth:`failover_counts`), ``speculative``
        (:func:`speculative_figures`: the drafter, acceptance rate, tokens per step; the last known
        while rank 0 does not answer)."""
        info = None
        if self.unavailable is None:
            try:
                info = await self._stub().Info(pb.InfoRequest(), timeout=2.0)
            except grpc.RpcError:
                info = None
        if info is not None:
            self._last_ranks = [{"rank": r.rank, "alive": r.alive, "active_memory_bytes": r.active_memory_bytes,
                                 "weight_bytes": r.weight_bytes, "address": r.address,
                                 "last_seen_s": round(r.last_seen_s, 2)} for r in info.ranks]
        else:
            self._last_ranks = [dict(r, alive=False) for r in self._last_ranks]
        self._last_spec = speculative_figures(info) or self._last_spec
        reg, now = self.registry, time.monotonic()
        tokens = reg.get_sample_value("mlxcluster_provider_completion_tokens_total") or 0.0
        self._rate.append((now, tokens))
        while len(self._rate) > 2 and now - self._rate[0][0] > 3.0:
            self._rate.popleft()
        t0, k0 = self._rate[0]
        rate = (tokens - k0) / (now - t0) if now > t0 else 0.0
        s = reg.get_sample_value("mlxcluster_provider_time_to_first_token_seconds_sum") or 0.0
        c = reg.get_sample_value("mlxcluster_provider_time_to_first_token_seconds_count") or 0.0
        if c > self._ttft_seen[1]:
            self._ttft_last = (s - self._ttft_seen[0]) / (c - self._ttft_seen[1])
            self._ttft_seen = (s, c)
        return {"model": self.model_name, "world_size": self.world_size,
                "backend": info.backend if info is not None else "", "weight_format": self.weight_format,
                "ranks": self._last_ranks, "decode_tokens_per_s": round(rate, 2), "ttft_s": self._ttft_last,
                "tokens_total": int(tokens), "group": dict(self.group_status), "errors": list(self.recent_errors),
                "failover": self.failover_counts(), "speculative": self._last_spec,
                "queue": {"queued": info.queued if info is not None else self._queued,
                          "running": info.running if info is not None else self._running,
                          "capacity": self.capacity}, "time": time.time()}

    def failover_counts(self) -> Dict[str, Any]:
        """The failover figures the dashboard shows, from the Prometheus metrics: ``replays`` (requests
        re-sent to a new group, all causes), ``waited`` (requests that waited for a group),
        ``failed_after_replays``, ``reformations`` (groups the healer put in place) and
        ``last_reformation_s`` (seconds the last one took, failure detected to serving; ``None``: none yet)."""
        reg = self.registry

        def total(name: str) -> int:
            return int(sum(s.value for metric in reg.collect() if metric.name == name
                           for s in metric.samples if s.name == name + "_total"))

        return {"replays": total("mlxcluster_provider_replays"), "waited": total("mlxcluster_provider_waited_for_group"),
                "failed_after_replays": total("mlxcluster_provider_failed_after_replays"),
                "reformations": int(reg.get_sample_value("mlxcluster_provider_reformation_seconds_count") or 0),
                "last_reformation_s": self.last_reformation_s}

    def retry_after(self) -> int:
        """Seconds until rank 0 may admit a request (a rough estimate from this
        provider's requests in flight and their mean running time, at least 1)."""
        ahead = max(1, self._queued + self._running)
        return max(1, math.ceil(self._service_s * ahead / self.capacity))

    # -- validation ------------------------------------------------------------------
    @staticmethod
    def refuse_unsupported(body: Dict[str, Any], chat: bool) -> None:
        """Raise 400 naming the first field this server would otherwise ignore: a client that
        asks for tools, JSON output, log probabilities, penalties or a logit bias must not get
        plain text back as if it had been honoured.  Fields whose value asks for nothing
        (``tools: []``, ``tool_choice: "none"``, ``response_format: {"type": "text"}``,
        ``logprobs: false``, penalties of 0, an empty ``logit_bias``) are accepted."""
        def given(name: str) -> bool:
            return body.get(name) not in (None, False, [], {}, "", 0, 0.0)

        fields = [n for n in _UNSUPPORTED_CHAT if given(n)] if chat else [n for n in _UNSUPPORTED_COMPLETIONS
                                                                           if given(n)]
        mods = body.get("modalities")
        if chat and mods is not None and mods != ["text"]:
            fields.append("modalities")
        if not chat and body.get("best_of") not in (None, 1):
            fields.append("best_of")
        verbosity = body.get("verbosity") if chat else None
        if verbosity is not None:
            if verbosity not in ("low", "medium", "high"):
                raise _bad("'verbosity' must be one of 'low', 'medium', 'high'", "verbosity")
            if verbosity != "medium":  # OpenAI's default asks for nothing
                fields.append("verbosity")
        if body.get("stream_options") is not None and body.get("stream") is not True:
            raise _bad("The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")
        if fields:
            name = fields[0]
            raise _bad(f"'{name}' is not supported by this server (mlxcluster {name}: not implemented yet)", name,
                       "unsupported_parameter")

    # -- the request's GenerationArgs -----------------------------------------------
    def request_args(self, body: Dict[str, Any], chat: bool, default_max_tokens: int, *names: str) -> GenerationArgs:
        """The one :class:`~mlxcluster.protocol.args.GenerationArgs` of an OpenAI body (every dialect's body
        becomes one: :meth:`mlxcluster.front.dialects.Dialect.to_openai`).  The fields every endpoint
        shares are read here by type: ``model``, ``n``, the max-tokens field ``names`` in order of
        preference, the sampler's and the logits processors' fields, ``stop``, ``speculative``,
        ``cache_salt``, ``logprobs`` / ``top_logprobs`` (chat: a bool and a count; completions:
        ``logprobs`` 0..5); their ranges are checked once, by :func:`~mlxcluster.protocol.args.check_args`
        (rank 0 checks a ``GenerateRequest`` with it too).  Aliases are resolved first: ``top_k`` -1 is
        off (0, as vLLM), a ``top_k`` beyond the vocabulary and a ``repetition_context_size`` beyond the
        context are bounded there.  ``response_format``'s grammar is :meth:`_response_format`'s.

        Raises:
            ProviderError: 404 unknown model; 400 naming the field (wrong type, out of range).
        """
        if body.get("model") is not None:
            self.check_model(body["model"])
        n = _number(body, "n", 1, integer=True)
        if n != 1:
            raise _bad("only n=1 is supported", "n")
        max_tokens, asked = None, ""
        for name in names:
            max_tokens = _number(body, name, None, lo=1, integer=True)
            if max_tokens is not None:
                asked = name
                break
        temperature = float(_number(body, "temperature", 1.0))
        top_k = _number(body, "top_k", 0, integer=True)
        window = _number(body, "repetition_context_size", REPETITION_CONTEXT_SIZE, integer=True)
        logprobs, top = self._logprobs(body, chat)
        _check_prompt_cache_key(body)
        args = GenerationArgs(
            sampling=SamplingArgs(temperature=temperature, top_p=float(_number(body, "top_p", 1.0)),
                                  top_k=min(0 if top_k == -1 else top_k, self.vocab_size),
                                  min_p=float(_number(body, "min_p", 0.0)), seed=_seed(body, temperature)),
            logits=LogitsArgs(logit_bias=self._logit_bias(body),
                              presence_penalty=float(_number(body, "presence_penalty", 0.0)),
                              frequency_penalty=float(_number(body, "frequency_penalty", 0.0)),
                              repetition_penalty=float(_number(body, "repetition_penalty", 1.0)),
                              repetition_context_size=min(window, self.context_length)),
            max_tokens=max_tokens or default_max_tokens, max_tokens_field=asked, stop=tuple(_stops(body)),
            logprobs=logprobs, top_logprobs=top, speculative=_speculative(body), cache_salt=self._cache_salt(body))
        try:
            return check_args(args, self.vocab_size)
        except ArgumentError as exc:
            raise _bad(str(exc), exc.param) from None

    @staticmethod
    def _logprobs(body: Dict[str, Any], chat: bool) -> Tuple[bool, int]:
        """``(logprobs, top_logprobs)``: chat's ``logprobs`` (a bool) and ``top_logprobs`` (an integer,
        only with ``logprobs``); completions' ``logprobs`` (an integer in 0..5, OpenAI's legacy bound:
        that many alternatives).

        Raises:
            ProviderError: 400 naming the field (wrong type, ``top_logprobs`` without ``logprobs``, a
                completions ``logprobs`` outside 0..5)."""
        if not chat:
            top = _number(body, "logprobs", None, lo=0, hi=MAX_COMPLETION_LOGPROBS, integer=True)
            return top is not None, int(top or 0)
        logprobs = body.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise _bad("'logprobs' must be a boolean", "logprobs")
        top = _number(body, "top_logprobs", None, integer=True)
        if top is not None and top > 0 and not logprobs:
            raise _bad("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
        return bool(logprobs), int(top or 0)

    async def _response_format(self, body: Dict[str, Any]) -> str:
        """Chat's ``response_format`` (``text``, ``json_object``, ``json_schema``) as an llguidance grammar
        ("" for text or none).

        Raises:
            ProviderError: 400 on ``response_format`` (an unknown type, a ``json_schema`` without a
                name or with a schema that is no object or that llguidance cannot compile)."""
        rf = body.get("response_format")
        if rf is None:
            return ""
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise _bad("'response_format.type' must be one of 'text', 'json_object', 'json_schema'", "response_format")
        if kind == "text":
            return ""
        schema = None
        if kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("name"), str):
                raise _bad("'response_format.json_schema' must be an object with a 'name'", "response_format")
            schema = js.get("schema", {})
            if not isinstance(schema, dict):
                raise _bad("'response_format.json_schema.schema' must be a JSON Schema object", "response_format")
        return await self._checked(lambda: json_grammar(schema), "response_format")

    async def _checked(self, make_grammar: Callable[[], str], param: str) -> str:
        """The grammar ``make_grammar()`` builds, once llguidance accepts it for this tokenizer (the
        first check builds llguidance's tokenizer, ~0.3 s: off the event loop).

        Raises:
            ProviderError: 400 on ``param`` when it cannot be built or compiled."""
        try:
            grammar = make_grammar()
            await asyncio.to_thread(check_grammar, grammar, self.tokenizer, self.vocab_size, self.eos_token_ids)
        except GrammarError as exc:
            raise _bad(f"{param}: {exc}", param) from None
        return grammar

    def _token(self, token_id: int) -> Tuple[str, List[int]]:
        """A token's text and its UTF-8 bytes (OpenAI's ``token`` and ``bytes``); a byte-level BPE
        token that is part of a character has its own raw bytes (its text shows U+FFFD)."""
        cached = self._tokens.get(token_id)
        if cached is None:
            text = self.tokenizer.decode([token_id])
            raw = list(text.encode("utf-8"))
            if "\ufffd" in text:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                if isinstance(piece, str) and all(ch in self._bytes for ch in piece):
                    raw = [self._bytes[ch] for ch in piece]
            cached = self._tokens[token_id] = (text, raw)
        return cached

    def _chat_logprobs(self, token_id: int, lp: Any) -> Dict[str, Any]:
        """One generated token's ``choices[].logprobs`` of a chat chunk (``content`` of one entry)."""
        def entry(tid: int, value: float) -> Dict[str, Any]:
            text, raw = self._token(tid)
            return {"token": text, "logprob": value, "bytes": raw}

        logprob, top = lp
        return {"content": [dict(entry(token_id, logprob), top_logprobs=[entry(t, v) for t, v in top])],
                "refusal": None}

    def check_model(self, model: Any) -> None:
        """Raises ProviderError (404 ``model_not_found``) unless ``model`` is one of :attr:`models`."""
        if model not in self.models:
            raise ProviderError(404, f"The model {model!r} does not exist (available: "
                                f"{', '.join(self.models)})", "invalid_request_error", "model",
                                "model_not_found")

    def _cache_salt(self, body: Dict[str, Any]) -> str:
        """vLLM's ``cache_salt`` (a non-empty string of at most :data:`MAX_CACHE_SALT_CHARS`
        characters) combined with who asked under ``--cache-isolation key``: the namespace rank 0
        keeps the prompt's prefix-cache positions under ("" shared).

        Raises:
            ProviderError: 400 naming ``cache_salt`` (not a non-empty string, or too long)."""
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT_CHARS):
            raise _bad(f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
                       "cache_salt")
        return cache_namespace(salt or "", REQUEST_KEY.get() if self.cache_isolation == "key" else "")

    def _logit_bias(self, body: Dict[str, Any]) -> Tuple[Tuple[int, float], ...]:
        """OpenAI's ``logit_bias`` (token id as a JSON object key, so a string -> a number) as
        ``((token_id, bias), ...)`` sorted by token id (their ranges: :func:`check_args`).

        Raises:
            ProviderError: 400 naming ``logit_bias`` (not an object, a key that is no integer, a
                value that is no number)."""
        bias = body.get("logit_bias")
        if bias is None:
            return ()
        if not isinstance(bias, dict):
            raise _bad("'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
        out = {}
        for key, value in bias.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise _bad(f"'logit_bias' key {key!r} is not a token id", "logit_bias") from None
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _bad(f"'logit_bias' value for token {token} must be a number in [-100, 100]", "logit_bias")
            out[token] = float(value)
        return tuple(sorted(out.items()))

    # -- embeddings ------------------------------------------------------------------
    async def embed(self, body: Dict[str, Any], *, truncate: bool = False,
                    endpoint: str = "embeddings") -> Dict[str, Any]:
        """OpenAI's ``/v1/embeddings``: ``body`` (``model``, ``input``, ``dimensions``,
        ``encoding_format`` ``float``/``base64``, ``user``) -> ``{"object": "list", "data":
        [{"object": "embedding", "index", "embedding"}], "model", "usage": {prompt_tokens,
        total_tokens}}``.  Rank 0 tokenises, queues and pools (``Generation.Embed``);
        ``truncate`` (Ollama) cuts inputs longer than the context instead of refusing them.

        Raises:
            ProviderError: 400 for a bad field, a too long input, a ``dimensions`` the model does
                not allow or a group that cannot compute embeddings (naming why); 404 unknown
                model; 429 queue full; 503 group unavailable."""
        status = "499"
        try:
            out = await self._embed(body, truncate)
            status = "200"
            return out
        except ProviderError as exc:
            status = self._count_failure(endpoint, exc)
            raise
        finally:
            self.metrics.requests.labels(endpoint, status).inc()

    async def _embed(self, body: Dict[str, Any], truncate: bool) -> Dict[str, Any]:
        if body.get("model") is not None:
            self.check_model(body["model"])
        items = embedding_inputs(body.get("input"))
        fmt = body.get("encoding_format")
        if fmt is None:
            fmt = "float"
        if fmt not in ("float", "base64"):
            raise _bad("'encoding_format' must be \"float\" or \"base64\"", "encoding_format")
        dimensions = _number(body, "dimensions", 0, lo=1, hi=2**31 - 1, integer=True)
        if body.get("user") is not None and not isinstance(body["user"], str):
            raise _bad("'user' must be a string", "user")
        for x in items:
            if isinstance(x, list) and any(t >= self.vocab_size for t in x):
                raise _bad(f"'input' holds a token id outside the vocabulary (0..{self.vocab_size - 1})", "input")
        self._check_available()
        embeddings, tokens = [], 0
        for start in range(0, len(items), EMBED_INPUTS_PER_CALL):  # each reply well within gRPC's 4 MiB
            reply = await self._embed_call(items[start:start + EMBED_INPUTS_PER_CALL], start, dimensions, truncate)
            embeddings += reply.embeddings
            tokens += reply.prompt_tokens
        self.metrics.prompt_tokens.inc(tokens)
        return {"object": "list", "model": body.get("model") or self.model_name,
                "data": [{"object": "embedding", "index": i, "embedding": encode_embedding(e.values, fmt)}
                         for i, e in enumerate(embeddings)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def _embed_call(self, items: List[Any], start: int, dimensions: int, truncate: bool) -> pb.EmbedReply:
        """One ``Generation.Embed`` call for ``items`` (inputs ``start``... of the request); rank 0's
        refusals as OpenAI errors naming the request's own input index."""
        import re

        request = pb.EmbedRequest(inputs=[pb.EmbedInput(text=x) if isinstance(x, str) else pb.EmbedInput(token_ids=x)
                                          for x in items], dimensions=dimensions, truncate=truncate)
        try:
            return await self._stub().Embed(request, timeout=self.request_timeout_s)
        except grpc.RpcError as exc:
            code, detail = exc.code(), exc.details() or ""
            detail = re.sub(r"\binput (\d+)", lambda m: f"input {int(m.group(1)) + start}", detail)
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                raise _bad(detail, None, "embeddings_unsupported") from None
            if code == grpc.StatusCode.INVALID_ARGUMENT and "context" in detail:
                raise _bad(detail, "input", "context_length_exceeded") from None
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise _bad(detail, "dimensions" if "'dimensions'" in detail else "input") from None
            raise _grpc_error(exc, self._failure(), self.retry_after()) from None

    # -- generation ------------------------------------------------------------------
    def _generate(self, endpoint: str, ids: List[int], args: GenerationArgs, param: str,
                  resume: Optional[Delivered] = None) -> "_Answer":
        """One request's answer from rank 0 (an :class:`_Answer`: iterate :meth:`_Answer.events`)."""
        return _Answer(self, endpoint, ids, args, param, resume)

    def _room(self, ids: Sequence[int], args: GenerationArgs, param: str) -> int:
        """Tokens the context leaves for the answer after prompt ``ids``.

        Raises:
            ProviderError: 400 ``context_length_exceeded``: no room for one token, or a limit the
                request set (``args.max_tokens_field``) beyond the room (refused before anything
                streams, as OpenAI and vLLM do, rather than cut short at the context's end)."""
        room = self.context_length - len(ids)
        if room < 1:
            raise _bad(f"This model's maximum context length is {self.context_length} tokens; the prompt "
                       f"has {len(ids)} tokens (at least one must be left for the answer)", param,
                       "context_length_exceeded")
        if args.max_tokens_field and args.max_tokens > room:  # asked for: refused, not cut short mid-answer
            raise _bad(f"This model's maximum context length is {self.context_length} tokens; you requested "
                       f"{len(ids) + args.max_tokens} ({len(ids)} in the prompt, {args.max_tokens} for the answer): "
                       f"lower {args.max_tokens_field} to at most {room} or shorten the prompt",
                       args.max_tokens_field, "context_length_exceeded")
        return room

    async def _await_group(self, t_arrival: float) -> None:
        """Wait (while :attr:`healing`) up to :attr:`unavailable_wait_s` for a serving group when a
        request arrives while none serves.

        Raises:
            ProviderError: 503 (no group served in time; without a healer, at once)."""
        if self._unavailable is None:
            return
        if not self.healing:
            self._check_available()
        why = self._unavailable
        self.metrics.waited.inc()
        served = await self.wait_for_group(None, t_arrival + self.unavailable_wait_s)
        self.metrics.wait_s.observe(time.monotonic() - t_arrival)
        if not served:
            why = self._unavailable or why
            raise ProviderError(503, f"the tensor-parallel group is restarting ({why}); none served within "
                                f"{self.unavailable_wait_s:g} s" if self.healing else
                                f"the tensor-parallel group could not be restarted ({why})", "server_error",
                                code="service_unavailable", retry_after=5)

    async def _counted(self, endpoint: str, gen: AsyncIterator[Dict[str, Any]]) -> AsyncIterator[Dict[str, Any]]:
        """Yield ``gen``'s chunks, counting the request by status (499: the consumer
        stopped early); closing this iterator closes ``gen``."""
        status = "499"
        try:
            async for chunk in gen:
                yield chunk
            status = "200"
        except ProviderError as exc:
            status = self._count_failure(endpoint, exc)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception:
            status = "500"
            self.metrics.errors.labels("server_error").inc()
            raise
        finally:
            self.metrics.requests.labels(endpoint, status).inc()
            await gen.aclose()

    #: the router link may send continuations (``resume``) and read ``progress`` (front/link.py)
    resumes = True

    def chat_completion(self, body: Dict[str, Any], resume: Optional[Delivered] = None,
                        progress: Optional[Delivered] = None) -> AsyncIterator[Dict[str, Any]]:
        """Stream a chat completion as ``chat.completion.chunk`` dicts: a first
        chunk with ``delta.role`` (sent once rank 0 produced the first token),
        one per generated token (``delta.content``, possibly "" while a stop
        string may be starting), one with ``finish_reason`` (``stop`` or
        ``length``), and a last one with ``choices: []`` and ``usage``.
        Validation and admission happen on the first ``__anext__``, raising
        :class:`ProviderError`.  Closing the iterator early cancels the generation.

        Args:
            body: the request's JSON object (OpenAI's chat completion fields).
            resume: continue this answer after what the client already has (the router's
                failover across providers): its tokens are resumed, not generated again, only
                text from ``resume.chars`` on is sent, and usage counts the whole answer.
            progress: filled in (:meth:`Delivered.add`) before each chunk is yielded with the
                tokens and text it carries (newly generated ones only).
        """
        return self._counted("chat_completions", self._chat(body, resume, progress))

    def completion(self, body: Dict[str, Any], resume: Optional[Delivered] = None,
                   progress: Optional[Delivered] = None) -> AsyncIterator[Dict[str, Any]]:
        """Stream a (legacy) completion as ``text_completion`` dicts: one per
        generated token (``choices[0].text``), one with ``finish_reason``, and a
        last one with ``choices: []`` and ``usage`` (see :meth:`chat_completion`,
        also for ``resume`` and ``progress``)."""
        return self._counted("completions", self._completion(body, resume, progress))

    def _template_kwargs(self, body: Dict[str, Any]) -> Dict[str, Any]:
        """``reasoning_effort`` as the chat template's own variable: ``reasoning_effort`` itself
        (gpt-oss) or ``enable_thinking`` (Qwen3: false only for ``"none"``); ``"none"`` asks nothing of
        a template with neither.

        Raises:
            ProviderError: 400 on ``reasoning_effort``: not one of :data:`REASONING_EFFORTS`, or
                the model's template reads neither (a model without reasoning, as OpenAI answers)."""
        effort = body.get("reasoning_effort")
        if effort is None:
            return {}
        if effort not in REASONING_EFFORTS:
            raise _bad(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}", "reasoning_effort")
        template = str(getattr(self.tokenizer, "chat_template", None) or "")
        if "reasoning_effort" in template:
            return {"reasoning_effort": effort}
        if "enable_thinking" in template:
            return {"enable_thinking": effort != "none"}
        if effort == "none":  # no reasoning asked of a model that has none: asks for nothing
            return {}
        raise _bad("Unsupported parameter: 'reasoning_effort' is not supported with this model (its chat "
                   "template has no reasoning switch).", "reasoning_effort", "unsupported_parameter")

    async def _chat_prompt(self, body: Dict[str, Any]) -> Tuple[List[int], Optional[Any]]:
        """A chat request's prompt token ids (messages checked, tools and ``reasoning_effort``
        rendered by the chat template) and its tool spec (``None``: no tools offered).  The work
        proportional to the request (checking the messages, templating, tokenising) runs in a
        worker thread, never on the event loop.

        Raises:
            ProviderError: 400 naming the field (messages, tools, reasoning_effort, a template error)."""
        spec = tool_spec(body, self.tokenizer)
        kwargs = self._template_kwargs(body)

        def prompt() -> List[int]:
            messages = _messages(body)
            try:
                return apply_chat_messages(self.tokenizer, template_messages(messages),
                                           tools=spec.tools if spec is not None else None, **kwargs)
            except Exception as exc:
                raise _bad(f"cannot apply the chat template: {str(exc).splitlines()[0][:200]}",
                           "messages") from None

        return await asyncio.to_thread(prompt), spec

    async def count_chat_tokens(self, body: Dict[str, Any]) -> int:
        """The prompt tokens a chat request (``model``, ``messages``, ``tools``, ``tool_choice``,
        ``reasoning_effort``) would send to rank 0: the chat template applied exactly as
        :meth:`chat_completion` applies it (Anthropic's ``count_tokens``).

        Raises:
            ProviderError: 404 unknown model; 400 naming the field."""
        if body.get("model") is not None:
            self.check_model(body["model"])
        ids, _spec = await self._chat_prompt(body)
        return len(ids)

    async def _chat(self, body: Dict[str, Any], resume: Optional[Delivered] = None,
                    progress: Optional[Delivered] = None) -> AsyncIterator[Dict[str, Any]]:
        self.refuse_unsupported(body, chat=True)
        args = self.request_args(body, True, self.default_max_tokens, "max_completion_tokens", "max_tokens")
        grammar = await self._response_format(body)
        ids, spec = await self._chat_prompt(body)
        if spec is not None and spec.grammar:
            if grammar:
                raise _bad("'response_format' cannot be combined with a forced 'tool_choice'", "response_format")
            grammar = await self._checked(lambda: spec.grammar, "tools")
        answer = self._generate("chat_completions", ids, dataclasses.replace(args, grammar=grammar), "messages",
                                resume)
        calls = ToolCalls(spec) if spec is not None else None
        one_call = body.get("parallel_tool_calls") is False  # at most one call per answer
        cid, created = "chatcmpl-" + uuid.uuid4().hex[:24], int(time.time())

        def chunk(delta, finish=None, logprobs=None):
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                    "system_fingerprint": self.system_fingerprint,
                    "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

        first = True
        async for kind, value, token in answer.events():
            if first:
                # the prompt's size rides on the first chunk for the other dialects (Anthropic's
                # message_start); sse.usage_rule drops it from what OpenAI clients see
                yield dict(chunk({"role": "assistant", "content": ""}), usage=_usage(len(ids), 0, answer.cached_tokens))
                first = False
                if calls is not None and answer.resumed_text:
                    calls.feed(answer.resumed_text)  # the parser's state as the first provider left it
            if kind == "text":
                if progress is not None:
                    progress.add(value, token)
                lp = self._chat_logprobs(token[0], token[1]) if token is not None and token[1] is not None else None
                yield chunk({"content": value if calls is None else calls.feed(value)}, logprobs=lp)
            else:
                finish, n, matched = value
                if calls is not None:
                    rest, made = calls.finish()
                    made = made[:1] if one_call else made
                    if rest:
                        yield chunk({"content": rest})
                    if made:
                        yield chunk({"tool_calls": made})
                        finish = "tool_calls"
                yield _stopped(chunk({}, finish), matched)
                yield {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                       "system_fingerprint": self.system_fingerprint, "choices": [],
                       "usage": _usage(len(ids), n, answer.cached_tokens)}

    async def _completion(self, body: Dict[str, Any], resume: Optional[Delivered] = None,
                          progress: Optional[Delivered] = None) -> AsyncIterator[Dict[str, Any]]:
        self.refuse_unsupported(body, chat=False)
        args = self.request_args(body, False, DEFAULT_COMPLETION_MAX_TOKENS, "max_tokens")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):  # tokenised in a worker thread: never on the event loop
            ids = list(await asyncio.to_thread(self.tokenizer.encode, prompt, add_special_tokens=True))
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        elif prompt is None:
            raise _bad("'prompt' is required", "prompt")
        else:
            raise _bad("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
        if body.get("echo"):
            raise _bad("'echo' is not supported", "echo")
        cid, created = "cmpl-" + uuid.uuid4().hex[:24], int(time.time())

        def chunk(text, finish=None, logprobs=None):
            return {"id": cid, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

        offset = 0  # characters of text before this token (legacy logprobs' text_offset)
        answer = self._generate("completions", ids, args, "prompt", resume)
        async for kind, value, token in answer.events():
            if kind == "text":
                if progress is not None:
                    progress.add(value, token)
                lp = None
                if token is not None and token[1] is not None:
                    logprob, top = token[1]
                    text = self._token(token[0])[0]
                    lp = {"tokens": [text], "token_logprobs": [logprob],
                          "top_logprobs": [{self._token(t)[0]: v for t, v in top}], "text_offset": [offset]}
                    offset += len(text)
                yield chunk(value, logprobs=lp)
            else:
                finish, n, matched = value
                yield _stopped(chunk("", finish), matched)
                yield {"id": cid, "object": "text_completion", "created": created, "model": self.model_name,
                       "choices": [], "usage": _usage(len(ids), n, answer.cached_tokens)}


class _Answer:
    """One request's answer from rank 0, as the provider streams it: the context check, the wait for a
    serving group, one ``Generate`` call per group (:meth:`_pass`), stop strings, the request's counts
    and metrics, and the replays after a group failure (:meth:`_replay`).

    :meth:`events` yields ``("text", str, token)`` once per generated token except EOS (the text the
    token released, possibly ""; ``token``: ``(token_id, logprobs)``, ``logprobs`` ``(logprob,
    ((token_id, logprob), ...))`` when ``args.logprobs``, else ``None``), then ``("done",
    (finish_reason, completion_tokens, stop), None)`` (``stop``: the stop string that ended the answer,
    else ``None``).  ``max_tokens`` is bounded by the room the prompt leaves in the context.
    :attr:`cached_tokens` (prompt tokens rank 0 took from the prefix caches) is set before the first
    token is yielded, :attr:`resumed_text` (a continuation's text the client has) before anything is.

    Failover (while :attr:`Provider.healing`): a request arriving while the group is replaced waits up
    to :attr:`Provider.unavailable_wait_s` for the next one.  When the group fails under a request
    (:func:`replay_cause`: the stream breaks, or ends without ``done`` or with ``ERROR``), before or
    after its first token, it waits for the next group and is re-sent there with the token ids already
    yielded (:func:`resume_request`); the answer goes on where it stopped (stop strings, counts and
    metrics included), at most :attr:`Provider.max_replays` times.

    Raises (from :meth:`events`):
        ProviderError: 400 ``context_length_exceeded`` (:meth:`Provider._room`), 400 on ``param``
            (rank 0 refused the prompt), 429 (rank 0's queue is full), 503 or 500 (see
            :func:`_grpc_error`), on the first ``__anext__`` unless rank 0 failed mid-generation; 503
            (:func:`replay_error`) when the group failed more than ``max_replays`` times, 503 with
            ``Retry-After`` when no group served within ``unavailable_wait_s``.
    """

    def __init__(self, provider: Provider, endpoint: str, ids: List[int], args: GenerationArgs, param: str,
                 resume: Optional[Delivered] = None):
        self.provider, self.endpoint, self.ids, self.args, self.param = provider, endpoint, ids, args, param
        self.resume = resume
        self.cached_tokens = 0
        self.resumed_text = ""
        self.scan = StopScan(list(args.stop))
        self.n_tokens = 0
        self.finish: Optional[str] = None
        self.matched: Optional[str] = None
        self.t_arrival = self.t_first = self.t_last = None
        self.eos = set(provider.eos_token_ids)
        self.delivered: List[int] = []  # generated ids yielded so far (EOS never): what a replay resumes after
        self.failures, self.epoch = 0, provider._epoch
        self.call = None
        self.state = "new"  # -> "queued" -> "running" at the first token -> "ended"
        # the last pass's ending: a gRPC error, the done event's reason, a call closed by retarget
        self.error: Optional[grpc.RpcError] = None
        self.done_reason: Optional[int] = None
        self.replaced = False

    # -- the request's place in the provider's counts -----------------------------------
    def _enter(self) -> None:
        self.provider._queued += 1
        self.state = "queued"

    def _first_token(self) -> None:
        p = self.provider
        p._queued, p._running, self.state = p._queued - 1, p._running + 1, "running"

    def _leave(self) -> None:
        """Cancel the call (a no-op once it has ended; otherwise rank 0 stops the session and frees its
        KV cache) and leave the counts, once."""
        p = self.provider
        if self.call is not None:
            self.call.cancel()
        if self.state == "queued":
            p._queued -= 1
        elif self.state == "running":
            p._running -= 1
            p._service_s = 0.8 * p._service_s + 0.2 * (time.monotonic() - self.t_arrival)
        self.state = "ended"

    # -- the answer ----------------------------------------------------------------
    async def events(self) -> AsyncIterator[Tuple[str, Any, Any]]:
        """The answer's events (see the class); one pass per group, bounded by ``max_replays``."""
        p = self.provider
        room = p._room(self.ids, self.args, self.param)
        self.t_arrival = time.monotonic()
        await p._await_group(self.t_arrival)
        try:
            request = to_request(self.args, self.ids, min(self.args.max_tokens, room))
        except ValueError as exc:  # a token id beyond int32
            raise _bad(f"prompt token ids: {exc}", self.param) from None
        self._enter()
        try:
            if self.resume is not None:  # the router's continuation of an answer begun elsewhere
                out = await self._resumed(request.max_tokens)
                if out:
                    yield ("text", out, None)
            while self.finish is None:
                async with contextlib.aclosing(self._pass(request)) as items:
                    async for item in items:
                        yield item
                ended, out = await self._ended(request.max_tokens)
                if out:
                    yield ("text", out, None)
                if ended:
                    break
                await self._replay()
                self.epoch = p._epoch
            self._observe()
            self._leave()  # before the last yield: a consumer may stop reading there
            yield ("done", (self.finish, self.n_tokens, self.matched), None)
        finally:
            self._leave()

    async def _resumed(self, max_tokens: int) -> str:
        """Prime a continuation (:attr:`resume`, a :class:`Delivered`): its tokens count as delivered,
        :attr:`scan` is put in the state the first provider's was in (the resumed tokens' text fed,
        ``chars`` of it emitted) and :attr:`resumed_text` is set to the text the client has (for the
        tool-call parser).  Sets :attr:`finish` / :attr:`matched` when the answer already ended there.

        Returns:
            text due now: held text the resumed tokens already release (a stop string not matching
            after all, or the tail when they fill ``max_tokens``).

        Raises:
            ProviderError: 400 on ``resume``: a token id outside the vocabulary or an EOS, or
                ``chars`` beyond the resumed tokens' text."""
        p, resume = self.provider, self.resume
        for i, t in enumerate(resume.token_ids):
            if not 0 <= t < p.vocab_size or t in self.eos:
                raise _bad(f"resume_token_ids[{i}]: token {t} is outside the vocabulary or ends the answer", "resume")
        self.delivered = list(resume.token_ids)
        self.n_tokens = len(self.delivered)  # usage counts the whole answer
        released, tail = await asyncio.to_thread(released_text, p.tokenizer, resume.token_ids)
        if not 0 <= resume.chars <= len(released):
            raise _bad(f"resume_chars {resume.chars} is beyond the {len(released)} characters of text the "
                       f"{len(resume.token_ids)} resumed tokens release", "resume")
        self.resumed_text = released[:resume.chars]
        self.scan.text, self.scan.emitted = released, resume.chars
        final = len(resume.token_ids) >= max_tokens  # nothing left to generate: the tail ends it
        out, matched = self.scan.feed(tail if final else "", final=final)
        if matched is not None:
            self.finish, self.matched = "stop", matched
        elif final:
            self.finish = "length"
        return out

    async def _pass(self, request: pb.GenerateRequest) -> AsyncIterator[Tuple[str, Any, Any]]:
        """One ``Generate`` call on the current group (a replay's with the tokens delivered so far):
        its text events, stop strings applied; how it ended is left in :attr:`error`,
        :attr:`done_reason` and :attr:`replaced`."""
        p = self.provider
        self.call = call = p._stub().Generate(resume_request(request, self.delivered), timeout=p.request_timeout_s)
        resumed = sent = len(self.delivered)  # a replay: rank 0 must say it continues after these (started)
        self.error, self.done_reason, self.replaced = None, None, False
        try:
            async for event in call:
                kind = event.WhichOneof("event")
                token = None
                if kind == "token":
                    if resumed:  # no started event confirmed the resume: fail closed
                        raise _unresumed(resumed, None)
                    token = self._token(event.token)
                    if token is None:  # EOS
                        continue
                    piece = event.token.text
                elif kind == "started":
                    if event.started.resumed_tokens != resumed:
                        raise _unresumed(resumed, event.started.resumed_tokens)
                    resumed = 0
                    if self.failures == 0:  # the prompt's own figure, not a replay's
                        self.cached_tokens = int(event.started.cached_prompt_tokens)
                    continue
                elif kind == "done":
                    piece = self._done(event.done, sent)
                    if piece is None:
                        break  # the group failed: replayed (or an error) after the pass
                else:
                    continue
                out, hit = self.scan.feed(piece, final=kind == "done")
                if out or kind == "token":  # one text per token, "" included
                    yield ("text", out, token)
                if hit is not None:
                    self.finish, self.matched = "stop", hit
                    call.cancel()
                    break
        except grpc.RpcError as exc:
            self.error = exc
        except asyncio.CancelledError:
            if not self._closed_by_retarget(call):
                raise
            self.replaced = True

    def _token(self, t: pb.GeneratedToken) -> Optional[Tuple[int, Any]]:
        """Count one generated token (metrics, the first token's TTFT); ``None`` for an EOS (it ends the
        answer: :attr:`finish` ``stop``), else ``(token_id, logprobs)`` (delivered)."""
        m = self.provider.metrics
        self.n_tokens += 1
        m.completion_tokens.inc()  # live: the dashboard's tok/s reads it while requests run
        self.t_last = time.monotonic()
        if self.t_first is None:
            self.t_first = self.t_last
            m.ttft.observe(self.t_first - self.t_arrival)
            self._first_token()
        if t.token_id in self.eos:
            self.finish = "stop"
            return None
        self.delivered.append(t.token_id)
        lp = None
        if self.args.logprobs:
            lp = (t.logprob, tuple((x.token_id, x.logprob) for x in t.top_logprobs))
        return t.token_id, lp

    def _done(self, d: pb.GenerateDone, sent: int) -> Optional[str]:
        """Read the ``done`` event (speculative decoding's metrics); ``None`` when rank 0 ended the
        request with ``ERROR`` before an EOS (the group failed), else the text rank 0 still held."""
        m = self.provider.metrics
        self.done_reason = d.reason
        if d.decode_steps:
            m.spec_drafted.inc(d.spec_drafted_tokens)
            m.spec_accepted.inc(d.spec_accepted_tokens)
            m.spec_steps.inc(d.spec_steps)
            m.spec_decode_steps.inc(d.decode_steps)
            m.spec_decoded.inc(max(0, d.generated_tokens - sent - 1))
        if d.reason == pb.ERROR and self.finish is None:
            return None
        if self.finish is None:
            self.finish = "stop" if d.reason == pb.EOS else "length"
        return d.text_tail

    def _closed_by_retarget(self, call) -> bool:
        """Whether a ``CancelledError`` out of ``call`` is retarget's closing of the old group's channel
        (replayed like a broken stream, or ending the answer after an EOS) rather than ours (a stop
        string) or this task's (the client went away): grpc.aio raises it for a call cancelled
        locally, also under a frozen rank 0 whose socket stayed open."""
        task = asyncio.current_task()
        if self.matched is not None or (task is not None and task.cancelling()):
            return False
        # retarget put another group in place since this call began (its epoch moved on): the call is
        # the old channel's, closed under it -- whether or not grpc.aio already reports it cancelled
        # (a call still waiting for its first answer may not)
        return call.cancelled() or self.provider._epoch != self.epoch

    async def _ended(self, max_tokens: int) -> Tuple[bool, str]:
        """After a pass: whether the answer ended, and text due now.  It ended with an answer (an EOS
        or a stop string or a done event), or with only the done event lost with the group: after
        the EOS token, or after every token (a replay would have nothing left to generate); then its
        text is the tail rank 0's detokenizer held, computed here from the same tokens."""
        tokenizer = self.provider.tokenizer
        if self.finish == "stop" and self.matched is None and self.done_reason is None:
            tail = await asyncio.to_thread(answer_tail, tokenizer, self.delivered, True)
            out, self.matched = self.scan.feed(tail, final=True)
            return True, out
        if self.finish is not None:
            return True, ""  # answered (an EOS before a break: nothing is left to generate)
        if len(self.delivered) >= max_tokens:
            tail = await asyncio.to_thread(answer_tail, tokenizer, self.delivered)
            out, self.matched = self.scan.feed(tail, final=True)
            self.finish = "length" if self.matched is None else "stop"
            return True, out
        return False, ""

    async def _replay(self) -> None:
        """The group failed under the request: wait for the next one (it is re-sent there by the next
        pass).

        Raises:
            ProviderError: the failure was no group's (:func:`_grpc_error`); without a healer, 503 at
                once; 503 when the replays ran out (:func:`replay_error`) or no group served again
                within ``unavailable_wait_s``."""
        p, m, error = self.provider, self.provider.metrics, self.error
        cause = "group_replaced" if self.replaced else replay_cause(error, self.done_reason)
        if error is not None and cause is None:
            raise _grpc_error(error, p._failure(), p.retry_after(), self.param)
        if self.replaced:
            detail = "the group was replaced while this request waited on it"
        elif error is not None:
            detail = (error.details() if hasattr(error, "details") else None) or str(error.code())
        elif self.done_reason is None:
            detail = "rank 0 ended the stream early"
        else:
            detail = "rank 0 ended the request with an error"
        group_why = p._failure()
        why = detail + (f" ({group_why})" if group_why else "")
        if not p.healing:
            if error is not None:
                raise _grpc_error(error, group_why, p.retry_after(), self.param)
            raise ProviderError(503, f"cluster unavailable: {why}", "server_error", code="service_unavailable")
        self.failures += 1
        if self.failures > p.max_replays:
            m.failed_after_replays.inc()
            raise replay_error(self.failures, why)
        m.replays.labels(cause).inc()
        log.warning("%s: the group failed after %d generated tokens (%s); replaying the request on the "
                    "next group (%d of %d)", self.endpoint, len(self.delivered), why, self.failures, p.max_replays)
        m.waited.inc()
        t_wait = time.monotonic()
        served = await p.wait_for_group(self.epoch, t_wait + p.unavailable_wait_s)
        m.wait_s.observe(time.monotonic() - t_wait)
        if not served:
            m.failed_after_replays.inc()
            raise ProviderError(503, f"the group failed during this request and none served again within "
                                f"{p.unavailable_wait_s:g} s: {why}" if p.healing else
                                f"the group failed during this request and could not be restarted: {why}",
                                "server_error", code="service_unavailable", retry_after=5)

    def _observe(self) -> None:
        """The finished answer's metrics (decode speed, prompt tokens) and debug line."""
        m = self.provider.metrics
        if self.t_first is not None and self.t_last is not None and self.n_tokens > 1 and self.t_last > self.t_first:
            m.tokens_per_s.observe((self.n_tokens - 1) / (self.t_last - self.t_first))
        m.prompt_tokens.inc(len(self.ids))
        log.debug("%s: %d prompt + %d generated tokens, TTFT %.3f s (queue wait included), finish %s, %d replays",
                  self.endpoint, len(self.ids), self.n_tokens,
                  (self.t_first - self.t_arrival) if self.t_first is not None else -1.0, self.finish, self.failures)

"""An error answered in OpenAI's format, shared by the provider API and the router.

Body: ``{"error": {"message", "type", "param", "code"}}`` (OpenAI API reference,
"Error codes"); 429 and 503 answers carry ``Retry-After`` (RFC 9110 section 10.2.3).
Kept free of heavy imports so the router does not load MLX.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Optional, Union

import grpc

__all__ = ["OpenAIError", "QueueFullError", "parse_body", "read_body", "MAX_BODY_BYTES", "MAX_JSON_DEPTH",
           "GROUP_FAILURE_CODES"]

#: gRPC codes of a Generate stream that broke because rank 0's group failed (rank 0 died, was killed
#: by the healer, or gave the group up), each with its ``replays`` metric label: the request is
#: resumed on the next group (serve's provider, ``generate --cluster``).  ``INVALID_ARGUMENT`` (400),
#: ``RESOURCE_EXHAUSTED`` (429), ``DEADLINE_EXCEEDED`` and ``UNKNOWN`` (a rank 0 bug) are not among them.
GROUP_FAILURE_CODES = {grpc.StatusCode.UNAVAILABLE: "unavailable", grpc.StatusCode.CANCELLED: "cancelled",
                       grpc.StatusCode.INTERNAL: "internal"}

#: Largest request body accepted, in bytes (larger: 413).
MAX_BODY_BYTES = 8 * 2**20
#: Deepest JSON nesting accepted (OpenAI bodies need ~6 levels; deeper: 400).
MAX_JSON_DEPTH = 64


class OpenAIError(Exception):
    """Attributes: ``status`` (HTTP status), ``message`` (one line), ``type``
    (OpenAI error type), ``param`` (offending field or ``None``), ``code``
    (OpenAI error code or ``None``), ``retry_after`` (seconds, for 429/503)."""

    def __init__(self, status: int, message: str, type: str, param: Optional[str] = None,
                 code: Optional[str] = None, retry_after: Optional[float] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def to_dict(self) -> Dict[str, Any]:
        """OpenAI's error body: ``{"error": {message, type, param, code}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self, body: Optional[Dict[str, Any]] = None):
        """A Starlette ``JSONResponse`` with the body (OpenAI's, or ``body``: another dialect's
        error body), the status and, for a 429/503 with a hint, ``Retry-After`` in whole
        seconds (at least 1)."""
        from starlette.responses import JSONResponse

        headers = {}
        if self.retry_after is not None and self.status in (429, 503):
            headers["Retry-After"] = str(max(1, int(round(self.retry_after))))
        return JSONResponse(self.to_dict() if body is None else body, status_code=self.status, headers=headers)


def _too_large() -> OpenAIError:
    return OpenAIError(413, f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB",
                       "invalid_request_error", code="request_too_large")


async def read_body(request) -> Dict[str, Any]:
    """Read and :func:`parse_body` a Starlette request's body, never holding more than
    :data:`MAX_BODY_BYTES` of it (a larger ``Content-Length`` is refused unread).

    Raises:
        OpenAIError: as :func:`parse_body` (413 for a body too large).
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _too_large()
        chunks.append(chunk)
    return parse_body(b"".join(chunks))


def _bad_body(message: str) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error")


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _check_parsed(body: Any) -> None:
    """At most :data:`MAX_JSON_DEPTH` levels, and every string (keys included) encodable
    text: a lone UTF-16 surrogate (``"\\ud800"``) is valid JSON but not Unicode text a
    tokenizer can encode."""
    stack = [(body, 1)]
    while stack:  # iterative and linear in the size of the body
        item, depth = stack.pop()
        if isinstance(item, (dict, list)) and depth > MAX_JSON_DEPTH:
            raise _bad_body(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, dict):
            stack.extend((k, depth) for k in item.keys())
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise _bad_body("the request body holds a lone UTF-16 surrogate escape (e.g. \\ud800): "
                                "strings must be valid Unicode") from None


def parse_body(raw: Union[bytes, str]) -> Dict[str, Any]:
    """The JSON object of a request body (the provider API, the router, the router link).

    Strict JSON (RFC 8259): ``NaN``/``Infinity`` literals and numbers that overflow a
    double are refused, as are nesting deeper than :data:`MAX_JSON_DEPTH` and lone
    surrogate escapes.

    Raises:
        OpenAIError: 413 ``invalid_request_error``: more than :data:`MAX_BODY_BYTES`;
            400 ``invalid_request_error``: not UTF-8, not JSON (empty included), too
            deeply nested, a non-finite number, a lone surrogate, or JSON that is not
            an object.
    """
    if len(raw) > MAX_BODY_BYTES:
        raise _too_large()
    if isinstance(raw, (bytes, bytearray)):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _bad_body(f"the request body is not UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        body = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite)
    except RecursionError:  # deeper than the interpreter's recursion limit (~1000 levels)
        raise _bad_body(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:
        raise _bad_body(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _bad_body("the request body must be a JSON object")
    _check_parsed(body)
    return body


class QueueFullError(RuntimeError):
    """The one admission queue (rank 0's scheduler) is full: retry later.

    Mapped to gRPC ``RESOURCE_EXHAUSTED`` by rank 0's ``Generation`` service and
    to HTTP 429 with ``Retry-After`` by the provider API and the router."""

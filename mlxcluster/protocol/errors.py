"""An error answered in OpenAI's format, shared by the provider API and the router.

Body: ``{"error": {"message", "type", "param", "code"}}`` (OpenAI API reference,
"Error codes"); 429 and 503 answers carry ``Retry-After`` (RFC 9110 section 10.2.3).
Kept free of heavy imports so the router does not load MLX.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Optional, Union

__all__ = ["OpenAIError", "QueueFullError", "parse_body"]


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

    def response(self):
        """A Starlette ``JSONResponse`` with the body, the status and, for a
        429/503 with a hint, ``Retry-After`` in whole seconds (at least 1)."""
        from starlette.responses import JSONResponse

        headers = {}
        if self.retry_after is not None and self.status in (429, 503):
            headers["Retry-After"] = str(max(1, int(round(self.retry_after))))
        return JSONResponse(self.to_dict(), status_code=self.status, headers=headers)


def parse_body(raw: Union[bytes, str]) -> Dict[str, Any]:
    """The JSON object of a request body (the provider API, the router, the router link).

    Raises:
        OpenAIError: 400 ``invalid_request_error``: not JSON (empty included), or
            JSON that is not an object.
    """
    try:
        body = json.loads(raw)
    except ValueError as exc:  # UnicodeDecodeError included
        raise OpenAIError(400, f"the request body is not valid JSON: {exc}", "invalid_request_error") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object", "invalid_request_error")
    return body


class QueueFullError(RuntimeError):
    """The one admission queue (rank 0's scheduler) is full: retry later.

    Mapped to gRPC ``RESOURCE_EXHAUSTED`` by rank 0's ``Generation`` service and
    to HTTP 429 with ``Retry-After`` by the provider API and the router."""

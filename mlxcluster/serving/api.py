"""OpenAI-compatible HTTP API over a :class:`~mlxcluster.serving.provider.Provider`.

``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``
(``stream: true`` -> server-sent events ``data: {chunk}`` ... ``data: [DONE]``),
``GET /health`` and ``GET /metrics`` (Prometheus text).  Errors use OpenAI's
body ``{"error": {"message", "type", "param", "code"}}``; 429 carries
``Retry-After``.  A client that disconnects (while queued, while a
non-streaming answer is generated, or mid-stream) cancels its generation.
"""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator, Dict

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from .provider import Provider, ProviderError, collect
from .sse import ClientGone, EventStream, next_chunk, unless_disconnected

__all__ = ["create_app"]


def create_app(provider: Provider) -> FastAPI:
    """The FastAPI application serving ``provider``."""
    app = FastAPI(title="mlxcluster", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.provider = provider

    @app.exception_handler(ProviderError)
    async def _provider_error(request: Request, exc: ProviderError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"Unknown path {request.url.path}"
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return ProviderError(400, str(exc)[:300]).response()

    async def _body(request: Request, endpoint: str) -> Dict[str, Any]:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            provider.record_request(endpoint, 400, "invalid_request_error")
            raise ProviderError(400, f"We could not parse the JSON body of your request: {exc}") from None
        if not isinstance(body, dict):
            provider.record_request(endpoint, 400, "invalid_request_error")
            raise ProviderError(400, "the request body must be a JSON object")
        return body

    async def _respond(request: Request, body: Dict[str, Any], chunks: AsyncIterator[Dict[str, Any]]):
        stream = bool(body.get("stream"))
        if not stream:
            try:
                result = await unless_disconnected(request.receive, collect(chunks))
            except ClientGone:
                return Response(status_code=499)
            return JSONResponse(result)
        options = body.get("stream_options") or {}
        include_usage = bool(options.get("include_usage")) if isinstance(options, dict) else False
        # Take the first chunk before answering 200, so validation, queue-full and
        # cluster errors get their own HTTP status.
        try:
            first = await unless_disconnected(request.receive, next_chunk(chunks))
        except ClientGone:
            await chunks.aclose()
            return Response(status_code=499)
        except BaseException:
            await chunks.aclose()
            raise
        return EventStream(chunks, first, include_usage)

    @app.get("/v1/models")
    async def list_models():
        created = int(time.time())
        return {"object": "list", "data": [{"id": m, "object": "model", "created": created, "owned_by": "mlxcluster"}
                                           for m in provider.models]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        if model not in provider.models:
            raise ProviderError(404, f"The model {model!r} does not exist", "invalid_request_error", "model",
                                "model_not_found")
        return {"id": model, "object": "model", "created": int(time.time()), "owned_by": "mlxcluster"}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _body(request, "chat_completions")
        return await _respond(request, body, provider.chat_completion(body))

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body(request, "completions")
        return await _respond(request, body, provider.completion(body))

    @app.get("/health")
    async def health():
        try:
            return await provider.health()
        except ProviderError as exc:
            return JSONResponse({"status": "unavailable", "model": provider.model_name, "error": exc.message,
                                 "queue": provider.load()}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(provider.registry), media_type=CONTENT_TYPE_LATEST)

    return app

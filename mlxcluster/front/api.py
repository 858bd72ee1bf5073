"""OpenAI-compatible HTTP API over a :class:`~mlxcluster.front.provider.Provider`.

``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``
(``stream: true`` -> server-sent events ``data: {chunk}`` ... ``data: [DONE]``),
``GET /health``, ``GET /metrics`` (Prometheus text), ``GET /openapi.json`` and ``GET /docs``
(FastAPI's schema and Swagger UI); the Anthropic Messages, Ollama and OpenAI Responses
dialects (:mod:`mlxcluster.front.dialects`) on the same provider; the dashboard at ``GET /``
(assets in the package, ``GET /dashboard/state`` one snapshot, ``GET /dashboard/events`` a
server-sent snapshot per second: :meth:`Provider.snapshot`).

This module only reads and parses the JSON body (:func:`~mlxcluster.protocol.errors.read_body`),
checks it against the endpoint's request model (:mod:`mlxcluster.front.schemas`, also what
``/openapi.json`` publishes) and answers (:func:`~mlxcluster.front.sse.respond`); the provider
validates the request's fields in detail.  Errors use OpenAI's body ``{"error": {"message", "type",
"param", "code"}}``; 429 carries ``Retry-After``.  A client that disconnects
(while queued, while a non-streaming answer is generated, or mid-stream)
cancels its generation.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from typing import Any, Awaitable, Callable, Dict, Optional

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse

from ..protocol.errors import OpenAIError, read_body
from . import schemas
from .auth import OPEN_PATHS, KeyRing, install
from .dialects import dialect_of_path, mount
from .provider import Provider, ProviderError
from .sse import respond

__all__ = ["bind_socket", "create_app", "mount_dashboard"]

_DASHBOARD = os.path.join(os.path.dirname(__file__), "dashboard")
_ASSETS = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}
#: one dashboard event stream lasts at most this long (the browser's EventSource reconnects)
EVENTS_MAX_S = 3600.0


def create_app(provider: Provider, auth: Optional[KeyRing] = None) -> FastAPI:
    """The FastAPI application serving ``provider`` (a :class:`Provider`, or a
    :class:`~mlxcluster.front.pool.ModelPool` of several models: the same interface); with ``auth``,
    every path but ``/health`` needs one of its API keys (:mod:`mlxcluster.front.auth`; counted per key
    in ``/metrics``)."""
    app = FastAPI(title="mlxcluster", version="0.1.0", docs_url="/docs", redoc_url=None, openapi_url="/openapi.json",
                  description="OpenAI-compatible API of an mlxcluster provider (chat completions, completions, "
                              "models, health, Prometheus metrics), with the Anthropic Messages, Ollama and OpenAI "
                              "Responses dialects.")
    app.state.provider = provider
    install(app, auth, provider.registry)
    schemas.install(app, secured=auth is not None, open_paths=OPEN_PATHS)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"Unknown path {request.url.path}"
        dialect = dialect_of_path(request.url.path)  # /v1/messages/*: Anthropic's format, /api/*: Ollama's
        if dialect is not None:
            error = OpenAIError(exc.status_code, message, kind)
            return JSONResponse(dialect.error(error), status_code=exc.status_code,
                                headers=getattr(exc, "headers", None))
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def _body(request: Request, endpoint: str, model: Optional[type] = None) -> Dict[str, Any]:
        try:
            body = await read_body(request)
            if model is not None:  # the endpoint's request model (mlxcluster.front.schemas)
                schemas.check(model, body)
            return body
        except OpenAIError as exc:  # the provider never sees this request: count it here
            provider.record_request(endpoint, exc.status, exc.type)
            raise

    @app.get("/v1/models", **schemas.route(ok=schemas.ModelList, statuses=schemas.GET_ERRORS))
    async def list_models():
        created = int(time.time())
        return {"object": "list", "data": [{"id": m, "object": "model", "created": created, "owned_by": "mlxcluster"}
                                           for m in provider.models]}

    @app.get("/v1/models/{model:path}", **schemas.route(ok=schemas.ModelCard, statuses=(401, 404, 500)))
    async def get_model(model: str):
        provider.check_model(model)
        return {"id": model, "object": "model", "created": int(time.time()), "owned_by": "mlxcluster"}

    @app.post("/v1/chat/completions", **schemas.route(schemas.ChatCompletionRequest, ok=schemas.ChatCompletion,
                                                      ok_media=("text/event-stream",)))
    async def chat_completions(request: Request):
        body = await _body(request, "chat_completions", schemas.ChatCompletionRequest)
        return await respond(request.receive, body, provider.chat_completion(body), chat=True)

    @app.post("/v1/embeddings", **schemas.route(schemas.EmbeddingsRequest, ok=schemas.EmbeddingList))
    async def embeddings(request: Request):
        """OpenAI embeddings (:meth:`Provider.embed`): ``input`` a string, strings, token ids or
        lists of them; ``dimensions`` (Matryoshka models); ``encoding_format`` ``float``/``base64``."""
        return await provider.embed(await _body(request, "embeddings", schemas.EmbeddingsRequest))

    @app.post("/v1/completions", **schemas.route(schemas.CompletionRequest, ok=schemas.Completion,
                                                 ok_media=("text/event-stream",)))
    async def completions(request: Request):
        body = await _body(request, "completions", schemas.CompletionRequest)
        return await respond(request.receive, body, provider.completion(body), chat=False)

    @app.get("/health", **schemas.route(ok=schemas.Health, statuses=(), extra={503: {
        "model": schemas.Health, "description": "Rank 0 does not answer, or the group is restarting or failed"}}))
    async def health():
        """200 ``{"status": "ok", ..., "group": {status, restarts, last_failure}}`` while rank 0
        answers; else 503 with ``status`` ``restarting`` / ``failed`` (the group is being
        replaced, or could not be) or ``unavailable`` (rank 0 does not answer)."""
        group = dict(provider.group_status)
        try:
            return dict(await provider.health(), group=group)
        except ProviderError as exc:
            status = group["status"] if group["status"] != "ok" else "unavailable"
            return JSONResponse({"status": status, "model": provider.model_name, "error": exc.message,
                                 "queue": provider.load(), "group": group}, status_code=503)

    @app.get("/metrics", **schemas.route(ok_media=(CONTENT_TYPE_LATEST.split(";")[0],), statuses=(401,),
                                         ok_description="Prometheus metrics (text format)"))
    async def metrics():
        return Response(generate_latest(provider.registry), media_type=CONTENT_TYPE_LATEST)

    mount_dashboard(app, provider.snapshot)
    mount(app, lambda body, chat: provider.chat_completion(body) if chat else provider.completion(body),
          provider.catalog, count=lambda endpoint, exc: provider.record_request(endpoint, exc.status, exc.type),
          embed=provider.embed, count_tokens=provider.count_chat_tokens, loaded=provider.loaded, keep=provider.keep)

    return app


def mount_dashboard(app: FastAPI, snapshot: Callable[[], Awaitable[Dict[str, Any]]]) -> None:
    """Serve the dashboard on ``app``: ``GET /`` (the page), ``GET /dashboard/{js,css}`` (its
    assets, shipped in the package), ``GET /dashboard/state`` (one ``await snapshot()``) and
    ``GET /dashboard/events`` (``text/event-stream``: a snapshot per second, for at most
    :data:`EVENTS_MAX_S`; EventSource reconnects).  Used by ``serve`` (:meth:`Provider.snapshot`)
    and by ``join`` nodes (:mod:`mlxcluster.cluster.dashboard`)."""

    @app.get("/", include_in_schema=False)
    async def dashboard():
        return FileResponse(os.path.join(_DASHBOARD, "index.html"), media_type="text/html; charset=utf-8")

    @app.get("/dashboard/state", **schemas.route(statuses=(401,)))
    async def dashboard_state():
        """One snapshot of what the dashboard shows."""
        return await snapshot()

    @app.get("/dashboard/events", **schemas.route(ok_media=("text/event-stream",), statuses=(401,),
                                                  ok_description="A snapshot per second"))
    async def dashboard_events():
        """``text/event-stream``: a snapshot per second (for at most an hour; EventSource reconnects)."""
        async def events():
            deadline = time.monotonic() + EVENTS_MAX_S
            while time.monotonic() < deadline:
                yield f"data: {json.dumps(await snapshot(), separators=(',', ':'))}\n\n"
                await asyncio.sleep(1.0)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/dashboard/{name}", include_in_schema=False)
    async def dashboard_asset(name: str):
        if name not in _ASSETS:
            raise StarletteHTTPException(404)
        return FileResponse(os.path.join(_DASHBOARD, name), media_type=_ASSETS[name])


def bind_socket(host: str, port: int, what: str = "") -> socket.socket:
    """A TCP socket bound to ``host:port`` (``0``: any free port) for uvicorn to serve on, bound
    before anything else starts so that a taken port fails first; its connections get
    ``TCP_NODELAY`` from asyncio.

    Raises:
        OSError: one line, ``cannot listen on HOST:PORT[ for WHAT]: why``.
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say so
        # (base_events._set_nodelay), and an accepted connection inherits its listener's proto; with
        # Nagle on, uvicorn's header and body writes stalled every keep-alive answer ~40 ms on the
        # client's delayed ACK
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
    except OSError as exc:
        raise OSError(f"cannot listen on {host}:{port}{' for ' + what if what else ''}: {exc.strerror or exc}") \
            from None
    return sock

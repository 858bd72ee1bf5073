"""The marketplace router: providers dial in over gRPC, users call an OpenAI-compatible API.

Providers (see :mod:`mlxcluster.front.link`) open one ``Marketplace.Link`` stream each and
register with the shared provider token; the router keeps them by ``provider_id`` and sends them
``Request`` messages. Users call ``/v1/chat/completions`` and ``/v1/completions`` (streaming or
not), ``/v1/models``, ``/health`` and ``/metrics``.

The provider link is TLS only (a plaintext client is refused in the handshake): the router's
``tls_cert``/``tls_key`` (also its HTTPS certificate), or a self-signed certificate
(:func:`link_certificate`, kept in a directory so that providers' ``--router-ca`` stays valid
across restarts; the CLI prints its path and SHA-256 fingerprint); the provider token travels
inside it.

Users: with API keys configured, every ``/v1/*`` call needs ``Authorization: Bearer <key>`` or
``x-api-key: <key>`` (one :class:`~mlxcluster.front.auth.KeyRing`, as ``serve``'s; 401
``invalid_api_key`` otherwise, OpenAI's error body) and each key has a token bucket of
``rate_limit_per_min`` requests per minute (burst: 10 s worth; over it 429
``rate_limit_exceeded`` with ``Retry-After``). ``/health`` shows provider details (peer
addresses) only to a valid key; ``/metrics`` holds no addresses.

Routing: among the live providers serving the requested model, the least loaded one, where
load = (requests in flight here + the provider's other work) / capacity and "other work" is the
heartbeat's ``queued + running`` minus the requests this router had in flight on it when the
heartbeat arrived (so our own requests are not counted twice); ties go round-robin.  A request
with OpenAI's ``prompt_cache_key`` goes to the provider its key ranks first by rendezvous hashing
while that one has room (load below 1), so prompts sharing a key share that provider's prefix cache;
else to the next with room, else the least loaded (:meth:`Router._pick`).

Failures: a provider that is lost (stream broken, heartbeat timeout) or answers 429/503 before the
answer's first content chunk reached the user is retried on another provider (at most
``retry_attempts`` times). Afterwards the answer is CONTINUED on another live provider that
registered the same model digest (and ``resumes``): it is sent the generated token ids the user
already got and how many characters of text (each provider chunk says which tokens and how much
text it carries; text a provider held back for a possible stop string was never sent), resumes
after those tokens and sends only the rest, which the router passes on under the answer's own
``id`` (at most ``max_continuations`` times; a chunk that carries no token -- the text tail, tool
calls, the finish and usage chunks -- is held until the next token or the provider's ``Done``, so
a break never duplicates them). Greedy and seeded answers are the unbroken answer exactly. When no
continuation is possible the request ends with a clear error: an SSE ``data: {"error": {...}}``
event then ``data: [DONE]`` when streaming, HTTP 502 otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import socket
import time
import uuid
from typing import Dict, List, Optional, Sequence, Set, Tuple

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily

from ..protocol import router_pb2 as pb
from ..protocol import router_pb2_grpc as pb_grpc
from ..protocol.errors import OpenAIError, read_body
from ..front.auth import KeyRing
from ..front import schemas
from ..front.dialects import dialect_of_path, mount
from ..front.sse import respond
from ..security import fingerprint, self_signed

log = logging.getLogger("mlxcluster.router")

RETRYABLE_STATUS = frozenset({429, 503})

# Keepalive: providers ping every 10 s (see link.py); accept that without strikes.
GRPC_SERVER_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_time_ms", 20000),
    ("grpc.keepalive_timeout_ms", 10000),
]


def link_names(grpc_host: str) -> List[str]:
    """Host names and addresses a self-signed link certificate covers: ``grpc_host`` (unless a
    wildcard), this machine's name and fully qualified name, ``localhost``, ``127.0.0.1``, ``::1``."""
    names = [] if grpc_host in ("", "0.0.0.0", "::") else [grpc_host.strip("[]")]
    return list(dict.fromkeys(names + [socket.gethostname(), socket.getfqdn(), "localhost", "127.0.0.1", "::1"]))


def link_certificate(directory: str, names: Sequence[str]) -> Tuple[bytes, bytes, str, bool]:
    """The router's self-signed link certificate kept in ``directory`` (``router-link.pem`` and
    ``router-link.key``, mode 600): loaded when both files are there and the certificate covers
    every one of ``names``, else made (:func:`mlxcluster.security.self_signed`) and written.

    Returns:
        ``(key_pem, cert_pem, cert_path, created)``.

    Raises:
        OSError: one line: the directory or files cannot be written.
    """
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert_path, key_path = os.path.join(directory, "router-link.pem"), os.path.join(directory, "router-link.key")
    try:
        with open(cert_path, "rb") as f:
            cert_pem = f.read()
        with open(key_path, "rb") as f:
            key_pem = f.read()
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, None)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        have = {str(n) for n in sans.get_values_for_type(x509.DNSName)} | \
            {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
        covered = all((str(ipaddress.ip_address(n)) if _is_ip(n) else n) in have for n in names)
        if covered and key.public_key().public_numbers() == cert.public_key().public_numbers() and \
                cert.not_valid_after_utc.timestamp() > time.time() + 86400:
            return key_pem, cert_pem, cert_path, False
    except (OSError, ValueError, x509.ExtensionNotFound, TypeError, AttributeError):
        pass  # missing, unreadable or not ours: make a new one
    key_pem, cert_pem = self_signed(names)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        for path, data in ((key_path, key_pem), (cert_path, cert_pem)):
            tmp = f"{path}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
    except OSError as exc:
        raise OSError(f"cannot write the router's link certificate in {directory}: {exc.strerror or exc}") from None
    return key_pem, cert_pem, cert_path, True


def _is_ip(name: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class RouterError(OpenAIError):
    """An error answered to the user in OpenAI's format; ``reason`` labels it in the metrics."""

    def __init__(self, status: int, message: str, type: str = "server_error", param: Optional[str] = None,
                 code: Optional[str] = None, retry_after: Optional[float] = None, reason: str = ""):
        super().__init__(status, message, type, param, code, retry_after)
        self.reason = reason or code or f"status_{status}"


class _Pending:
    """One attempt of one user request on one provider; ``started``: content of the answer was
    passed on to the user (from then on a failure continues the answer elsewhere or ends it,
    never re-sends it); ``delivered``: the generated token ids passed on from this attempt."""

    __slots__ = ("request_id", "queue", "started", "delivered")

    def __init__(self, request_id: str, started: bool = False):
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.started = started
        self.delivered = 0


class _Answer:
    """What one user request's answer passed on to the user so far, across providers.

    Attributes:
        started: content reached the user.
        token_ids: generated token ids passed on (list of int; EOS never).
        chars: characters of answer text passed on (as the providers counted them).
        resumable: every provider that passed content on reported its tokens (``resumes``).
        digest: the model digest of the provider it started on ("" when unknown).
        head: ``id``, ``created``, ``model``, ``system_fingerprint`` of the first chunk passed
            on; a continuation's chunks are given them.
        prompt_details: the prompt's ``prompt_tokens_details`` as the first provider counted them.
        continuations: continuations sent so far."""

    def __init__(self) -> None:
        self.started = False
        self.token_ids: List[int] = []
        self.chars = 0
        self.resumable = True
        self.digest = ""
        self.head: Dict[str, object] = {}
        self.prompt_details: Optional[dict] = None
        self.continuations = 0


def _rendezvous(key: str, provider_id: str) -> bytes:
    """The weight of ``provider_id`` for ``key`` in rendezvous hashing (:meth:`Router._pick`)."""
    return hashlib.sha256(f"{key}\0{provider_id}".encode("utf-8", "surrogatepass")).digest()


class ProviderConn:
    """A registered provider and its Link stream."""

    def __init__(self, reg: "pb.Register", peer: str):
        self.provider_id = reg.provider_id
        self.models: List[str] = list(dict.fromkeys(reg.models))
        self.model_digest = reg.model_digest
        self.resumes = bool(reg.resumes)
        self.context_length = int(reg.context_length)
        self.capacity = max(1, int(reg.capacity))
        self.peer = peer
        self.queued = 0
        self.running = 0
        self._external = 0  # the heartbeat's work that is not ours
        self.connected_at = time.time()
        self.last_seen = time.monotonic()
        self.inflight: Dict[str, _Pending] = {}
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.closed = False
        self.close_reason = ""

    def heartbeat(self, hb: "pb.Heartbeat") -> None:
        self.queued, self.running = int(hb.queued), int(hb.running)
        if hb.capacity:
            self.capacity = max(1, int(hb.capacity))
        self._external = max(0, self.queued + self.running - len(self.inflight))

    def load(self) -> float:
        return (len(self.inflight) + self._external) / self.capacity

    def send(self, msg: "pb.RouterMessage") -> None:
        if not self.closed:
            self.outbox.put_nowait(msg)

    def info(self) -> dict:
        return {"provider_id": self.provider_id, "models": self.models, "model_digest": self.model_digest,
                "resumes": self.resumes, "context_length": self.context_length,
                "capacity": self.capacity, "queued": self.queued, "running": self.running,
                "inflight": len(self.inflight), "streaming": sum(p.started for p in self.inflight.values()),
                "delivered_tokens": sum(p.delivered for p in self.inflight.values()),
                "load": round(self.load(), 4), "peer": self.peer,
                "connected_at": self.connected_at,
                "last_seen_s_ago": round(time.monotonic() - self.last_seen, 3)}


class _InflightCollector:
    def __init__(self, router: "Router"):
        self.router = router

    def collect(self):
        inflight = GaugeMetricFamily("mlxcluster_router_provider_inflight",
                                     "Requests in flight on each provider through this router", labels=["provider"])
        load = GaugeMetricFamily("mlxcluster_router_provider_load",
                                 "Routing load of each provider ((in flight + other work) / capacity)",
                                 labels=["provider"])
        live = GaugeMetricFamily("mlxcluster_router_providers", "Live registered providers")
        for conn in list(self.router.providers.values()):
            inflight.add_metric([conn.provider_id], len(conn.inflight))
            load.add_metric([conn.provider_id], conn.load())
        live.add_metric([], len(self.router.providers))
        yield inflight
        yield load
        yield live


class _NoSignalServer:
    """uvicorn.Server that leaves signal handling to its owner and sets ``ready`` (an
    ``asyncio.Event``) once it listens."""

    def __new__(cls, config):
        import uvicorn

        class Server(uvicorn.Server):
            def __init__(self, config):
                super().__init__(config)
                self.ready = asyncio.Event()

            @contextlib.contextmanager
            def capture_signals(self):
                yield

            async def startup(self, sockets=None):
                await super().startup(sockets=sockets)
                self.ready.set()

        return Server(config)


def _has_content(chunk: dict) -> bool:
    """Whether a chunk carries anything beyond a bare role announcement."""
    if chunk.get("usage") and not chunk.get("choices"):
        return True
    for choice in chunk.get("choices") or []:
        if choice.get("finish_reason") or choice.get("text") or choice.get("logprobs"):
            return True
        delta = choice.get("delta") or {}
        for key, value in delta.items():
            if key != "role" and value:
                return True
    return False


class _Marketplace(pb_grpc.MarketplaceServicer):
    def __init__(self, router: "Router"):
        self.router = router

    async def Link(self, request_iterator, context):
        router = self.router
        router._ensure_monitor()
        it = request_iterator.__aiter__()
        peer = context.peer()
        try:
            first = await asyncio.wait_for(it.__anext__(), router.register_timeout_s)
        except (StopAsyncIteration, asyncio.TimeoutError):
            return
        except Exception as exc:  # the stream broke before registering
            log.info("link from %s broke before Register: %s", peer, exc)
            return
        error = router._check_register(first)
        if error:
            router._count("refused_providers")
            router.m_refused.inc()
            log.warning("refused provider link from %s: %s", peer, error)
            yield pb.RouterMessage(registered=pb.Registered(ok=False, error=error))
            return
        conn = router._add_provider(first.register, peer)
        yield pb.RouterMessage(registered=pb.Registered(ok=True))
        reader = asyncio.ensure_future(router._read_provider(conn, it))
        try:
            for _ in iter(int, 1):  # until the outbox says stop (None)
                msg = await conn.outbox.get()
                if msg is None:
                    break
                yield msg
        finally:
            reader.cancel()
            router._close_provider(conn, conn.close_reason or "link closed")


class Router:
    """Provider registry, Marketplace gRPC service and the users' OpenAI-compatible HTTP API."""

    def __init__(self, provider_token: str, retry_attempts: int = 2, heartbeat_timeout_s: float = 5.0, *,
                 idle_timeout_s: float = 300.0, register_timeout_s: float = 10.0,
                 api_keys: Optional[List[str]] = None, rate_limit_per_min: float = 600.0,
                 max_continuations: int = 2):
        """Args (besides the provider side): ``api_keys``: the users' keys (``None``: no
        authentication, only for a router behind one); ``rate_limit_per_min``: requests per
        minute per key (0: unlimited); ``max_continuations``: times one answer is continued on
        another provider after its provider was lost mid-answer (0: never).

        Raises:
            ValueError: no provider token, an empty key list, a negative rate limit or
                ``max_continuations``."""
        if not provider_token:
            raise ValueError("a provider token is required")
        if api_keys is not None and not [k for k in api_keys if k]:
            raise ValueError("no API keys given")
        if rate_limit_per_min < 0:
            raise ValueError("the rate limit must be at least 0")
        if max_continuations < 0:
            raise ValueError("max_continuations must be at least 0")
        self.max_continuations = int(max_continuations)
        self._token = provider_token.encode()
        self._keys = None if api_keys is None else KeyRing(k for k in api_keys if k)
        self.rate_limit_per_min = float(rate_limit_per_min)
        self._buckets: Dict[int, List[float]] = {}  # key index -> [tokens, last refill time]
        self.retry_attempts = max(0, int(retry_attempts))
        self.heartbeat_timeout_s = float(heartbeat_timeout_s)
        self.idle_timeout_s = float(idle_timeout_s)
        self.register_timeout_s = float(register_timeout_s)
        self.providers: Dict[str, ProviderConn] = {}
        self._seen_models: Set[str] = set()
        self._rr = 0
        self.stats = {"requests": 0, "retries": 0, "continuations": 0, "failures": 0, "cancels": 0,
                      "refused_providers": 0, "completed": 0}
        self.registry = CollectorRegistry()
        self.m_requests = Counter("mlxcluster_router_requests", "User requests", ["endpoint", "stream"],
                                  registry=self.registry)
        self.m_retries = Counter("mlxcluster_router_retries", "Requests retried on another provider", ["reason"],
                                 registry=self.registry)
        self.m_continuations = Counter("mlxcluster_router_continuations",
                                        "Answers continued on another provider of the same model digest after "
                                        "their provider was lost mid-answer", ["reason"], registry=self.registry)
        self.m_failures = Counter("mlxcluster_router_failures", "User requests that ended with an error",
                                  ["reason"], registry=self.registry)
        self.m_cancels = Counter("mlxcluster_router_cancels", "Requests cancelled because the user went away",
                                 registry=self.registry)
        self.m_refused = Counter("mlxcluster_router_refused_providers", "Provider links refused (bad token)",
                                 registry=self.registry)
        self.m_tokens = Counter("mlxcluster_router_completion_tokens", "Completion tokens served (from usage)",
                                registry=self.registry)
        self.registry.register(_InflightCollector(self))
        self.app = self._build_app()
        self.servicer = _Marketplace(self)
        self._monitor: Optional[asyncio.Task] = None
        self._grpc_server = None
        self._http_server = None
        self._http_task: Optional[asyncio.Task] = None
        self.http_port: Optional[int] = None
        self.grpc_port: Optional[int] = None
        #: the certificate the provider link presents (PEM; what providers trust: ``--router-ca``)
        self.link_cert_pem: Optional[bytes] = None

    # ----- lifecycle -------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 8080, grpc_host: Optional[str] = None,
                    grpc_port: int = 8081, *, tls: Optional[Tuple[str, str]] = None,
                    link_credentials: Optional[Tuple[bytes, bytes]] = None) -> None:
        """Serve gRPC (the provider link, TLS) on grpc_host:grpc_port and HTTP on host:port (0 =
        any free port).

        Args:
            tls: ``(cert, key)`` PEM files (:func:`~mlxcluster.front.auth.tls_files`): HTTPS for
                users, and the link's certificate.
            link_credentials: ``(key_pem, cert_pem)`` of the link when ``tls`` is not given
                (:func:`link_certificate`); neither: a fresh self-signed certificate for
                :func:`link_names`, held in memory (:attr:`link_cert_pem`).

        Raises:
            OSError: one line: a port cannot be bound, or the HTTP server did not start.
        """
        import uvicorn

        grpc_host = host if grpc_host is None else grpc_host
        if tls is not None:
            with open(tls[1], "rb") as f_key, open(tls[0], "rb") as f_cert:
                link_credentials = (f_key.read(), f_cert.read())
        elif link_credentials is None:
            link_credentials = self_signed(link_names(grpc_host))
        self.link_cert_pem = link_credentials[1]
        self._grpc_server = grpc.aio.server(options=GRPC_SERVER_OPTIONS)
        pb_grpc.add_MarketplaceServicer_to_server(self.servicer, self._grpc_server)
        bind = f"[{grpc_host}]:{grpc_port}" if ":" in grpc_host else f"{grpc_host}:{grpc_port}"
        try:
            self.grpc_port = self._grpc_server.add_secure_port(bind, grpc.ssl_server_credentials([link_credentials]))
        except RuntimeError as exc:
            raise OSError(f"cannot listen for providers on {bind}: {exc}") from exc
        await self._grpc_server.start()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY: see bind_socket
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            await self._grpc_server.stop(None)
            raise
        sock.listen(2048)
        sock.setblocking(False)
        self.http_port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False,
                                timeout_graceful_shutdown=3, timeout_keep_alive=30,
                                **(dict(ssl_certfile=tls[0], ssl_keyfile=tls[1]) if tls else {}))
        self._http_server = _NoSignalServer(config)
        self._http_task = asyncio.ensure_future(self._http_server.serve(sockets=[sock]))
        ready = asyncio.ensure_future(self._http_server.ready.wait())
        await asyncio.wait({ready, self._http_task}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        if not self._http_server.started:
            self._http_server.should_exit = True
            await self._grpc_server.stop(None)
            if self._http_task.done():
                self._http_task.result()
            raise OSError("the HTTP server did not start")
        self._ensure_monitor()
        log.info("router: HTTP%s on %s:%d, providers (gRPC over TLS, certificate %s) on %s", "S" if tls else "",
                 host, self.http_port, fingerprint(self.link_cert_pem), bind.rsplit(":", 1)[0] + f":{self.grpc_port}")

    async def stop(self, grace: float = 1.0) -> None:
        """Stop both servers; provider links are closed and requests in flight end with an error."""
        if self._grpc_server is not None:
            for conn in list(self.providers.values()):
                self._close_provider(conn, "router shutting down")
            await self._grpc_server.stop(grace)
            self._grpc_server = None
        if self._http_server is not None:
            self._http_server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._http_task, 10)
            self._http_server = None
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(BaseException):
                await self._monitor
            self._monitor = None

    def _ensure_monitor(self) -> None:
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.ensure_future(self._watch_heartbeats())

    async def _watch_heartbeats(self) -> None:
        period = max(0.05, min(0.5, self.heartbeat_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in list(self.providers.values()):
                silent = now - conn.last_seen
                if silent > self.heartbeat_timeout_s:
                    self._close_provider(conn, f"no heartbeat for {silent:.1f} s")

    # ----- providers ---------------------------------------------------------------------------

    def _check_register(self, msg: "pb.ProviderMessage") -> str:
        if msg.WhichOneof("msg") != "register":
            return "the first message must be Register"
        reg = msg.register
        if not hmac.compare_digest(reg.token.encode(), self._token):
            return "invalid provider token"
        if not reg.provider_id:
            return "provider_id is required"
        if not reg.models:
            return "a provider must serve at least one model"
        return ""

    def _add_provider(self, reg: "pb.Register", peer: str) -> ProviderConn:
        old = self.providers.get(reg.provider_id)
        if old is not None:
            self._close_provider(old, "replaced by a new link with the same provider_id")
        conn = ProviderConn(reg, peer)
        self.providers[conn.provider_id] = conn
        self._seen_models.update(conn.models)
        log.info("provider %s registered from %s: models %s, capacity %d, context %d", conn.provider_id, peer,
                 conn.models, conn.capacity, conn.context_length)
        return conn

    def _close_provider(self, conn: ProviderConn, reason: str) -> None:
        if conn.closed:
            return
        conn.closed = True
        conn.close_reason = reason
        if self.providers.get(conn.provider_id) is conn:
            del self.providers[conn.provider_id]
        conn.outbox.put_nowait(None)
        for pending in list(conn.inflight.values()):
            pending.queue.put_nowait(("lost", reason))
        log.warning("provider %s lost: %s (%d request(s) in flight)", conn.provider_id, reason, len(conn.inflight))

    async def _read_provider(self, conn: ProviderConn, it) -> None:
        reason = "provider closed the link"
        try:
            for _ in iter(int, 1):  # until the stream ends
                try:
                    msg = await it.__anext__()
                except StopAsyncIteration:
                    break
                conn.last_seen = time.monotonic()
                kind = msg.WhichOneof("msg")
                if kind == "heartbeat":
                    conn.heartbeat(msg.heartbeat)
                elif kind == "chunk":
                    pending = conn.inflight.get(msg.chunk.request_id)
                    if pending is None:
                        continue  # cancelled or from a lost attempt
                    try:
                        chunk = json.loads(msg.chunk.json)
                        if not isinstance(chunk, dict):
                            raise ValueError("not an object")
                    except ValueError as exc:
                        pending.queue.put_nowait(("error", RouterError(
                            502, f"provider {conn.provider_id} sent a malformed chunk: {exc}", "upstream_error",
                            reason="bad_chunk")))
                        continue
                    pending.queue.put_nowait(("chunk", (chunk, list(msg.chunk.token_ids), int(msg.chunk.text_chars))))
                elif kind == "done":
                    pending = conn.inflight.get(msg.done.request_id)
                    if pending is not None:
                        pending.queue.put_nowait(("done", None))
                elif kind == "error":
                    e = msg.error
                    pending = conn.inflight.get(e.request_id)
                    if pending is not None:
                        status = int(e.status) or 500
                        pending.queue.put_nowait(("error", RouterError(
                            status, e.message or f"provider error {status}", e.type or "server_error",
                            e.param or None, retry_after=e.retry_after_s or None, reason=f"provider_{status}")))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reason = f"link broke: {getattr(exc, 'details', lambda: None)() or exc}"
        self._close_provider(conn, reason)

    def _pick(self, model: str, exclude: Set[int], digest: Optional[str] = None,
              affinity: str = "") -> Optional[ProviderConn]:
        """The least loaded live provider of ``model`` not in ``exclude`` (``id()`` of connections);
        with ``digest``: only one that resumes answers and registered that model digest.

        With ``affinity`` (a request's ``prompt_cache_key``, OpenAI's prefix-cache hint): the first
        provider with room (load below 1) in the key's rendezvous order -- highest random weight, the
        SHA-256 of key and provider id (Thaler and Ravishankar, "Using name-based mappings to increase
        hit rates", 1998) -- so requests with one key keep reaching the provider whose prefix cache
        holds their prompts while it has room, and a provider that joins or leaves moves only the keys
        it ranks first; when none has room, the least loaded (load bounded as in Mirrokni et al.,
        "Consistent Hashing with Bounded Loads", 2018)."""
        candidates = sorted((c for c in self.providers.values()
                             if not c.closed and model in c.models and id(c) not in exclude
                             and (digest is None or (c.resumes and c.model_digest == digest))),
                            key=lambda c: c.provider_id)
        if not candidates:
            return None
        if affinity:
            for conn in sorted(candidates, key=lambda c: _rendezvous(affinity, c.provider_id), reverse=True):
                if conn.load() < 1:
                    return conn
        loads = [c.load() for c in candidates]
        best = min(loads)
        ties = [c for c, l in zip(candidates, loads) if l <= best + 1e-9]
        conn = ties[self._rr % len(ties)]
        self._rr += 1
        return conn

    def _no_provider(self, model: str) -> RouterError:
        if model in self._seen_models:
            return RouterError(503, f"no live provider serves model {model!r} right now", "service_unavailable",
                               code="no_provider", reason="no_provider")
        return RouterError(404, f"The model {model!r} does not exist (no provider serves it)",
                           "invalid_request_error", param="model", code="model_not_found", reason="model_not_found")

    def models(self) -> List[dict]:
        seen: Dict[str, dict] = {}
        for conn in sorted(self.providers.values(), key=lambda c: c.connected_at):
            for m in conn.models:
                entry = seen.setdefault(m, {"id": m, "object": "model", "created": int(conn.connected_at),
                                            "owned_by": "mlxcluster", "context_length": conn.context_length,
                                            "providers": 0})
                entry["context_length"] = max(entry["context_length"], conn.context_length)
                entry["providers"] += 1
        return list(seen.values())

    # ----- requests ----------------------------------------------------------------------------

    def _count(self, key: str) -> None:
        self.stats[key] = self.stats.get(key, 0) + 1

    def _failed(self, err: RouterError) -> None:
        self._count("failures")
        self.m_failures.labels(err.reason).inc()

    async def _attempts(self, kind: str, model: str, body: dict):
        """Yields the answer's chunks (dicts); a RouterError instance as the last item means it broke
        after content reached the user and could not be continued. Raises RouterError when nothing
        was delivered.

        Before content reached the user a failed attempt is re-sent as it is to another provider
        (``retry_attempts``); afterwards it is continued (:meth:`_continuation`)."""
        body_json = json.dumps(body, separators=(",", ":"))
        key = body.get("prompt_cache_key")
        affinity = key if isinstance(key, str) else ""  # checked by the schema (else the provider refuses it)
        tried: Set[int] = set()
        last_err: Optional[RouterError] = None
        answer = _Answer()
        retries = 0
        for _ in range(2 + self.retry_attempts + self.max_continuations):  # the first try, retries, continuations
            conn = self._pick(model, tried, answer.digest if answer.started else None, affinity)
            if conn is None:
                break
            tried.add(id(conn))
            continuing = answer.started
            request_id = uuid.uuid4().hex
            pending = _Pending(request_id, started=continuing)
            conn.inflight[request_id] = pending
            conn.send(pb.RouterMessage(request=pb.Request(
                request_id=request_id, kind=kind, body_json=body_json,
                resume_token_ids=answer.token_ids if continuing else (), resume_chars=answer.chars if continuing else 0)))
            finished = False
            # chunks not passed on yet: (chunk, token ids, text chars); before content, and (from a
            # provider that reports its tokens) chunks without a token until the next token or Done
            held: List[Tuple[dict, List[int], int]] = []
            retry_err: Optional[RouterError] = None
            try:
                for _ in iter(int, 1):  # one event per provider message; bounded by idle_timeout_s each
                    try:
                        what, value = await asyncio.wait_for(pending.queue.get(), self.idle_timeout_s)
                    except asyncio.TimeoutError:  # not finished: the Cancel in `finally` stops it
                        err = RouterError(504, f"provider {conn.provider_id} sent nothing for "
                                               f"{self.idle_timeout_s:.0f} s", "timeout", reason="timeout")
                        if answer.started:
                            yield err
                            return
                        raise err
                    if what == "chunk":
                        held.append(value)
                        chunk, ids, _chars = value
                        if (ids or not conn.resumes) and \
                                (answer.started or any(_has_content(h[0]) for h in held)):
                            for out in self._pass_on(answer, pending, conn, held, continuing):
                                yield out
                            held = []
                        continue
                    finished = True
                    if what == "done":
                        for out in self._pass_on(answer, pending, conn, held, continuing):
                            yield out
                        self._count("completed")
                        return
                    if what == "lost":
                        err = RouterError(502, f"provider {conn.provider_id} was lost: {value}", "upstream_error",
                                          code="provider_lost", reason="provider_lost")
                        retryable = True
                    else:
                        err = value
                        retryable = err.status in RETRYABLE_STATUS
                    if answer.started:
                        why = self._continuation(answer, conn, err, retryable, model, tried)
                        if why is not None:  # 502 if not streamed (else an SSE error event)
                            if what == "lost":
                                message = f"provider {conn.provider_id} was lost mid-generation ({value})"
                            else:
                                message = f"provider {conn.provider_id} failed mid-generation: {err.message}"
                            yield RouterError(502, f"{message}; {why}; the answer is incomplete",
                                              err.type if err.type != "server_error" else "upstream_error",
                                              code=err.code or "provider_failed", reason=err.reason)
                            return
                        break
                    if not retryable:
                        raise err
                    retry_err = err
                    break
            finally:
                conn.inflight.pop(request_id, None)
                if not finished and not conn.closed:
                    conn.send(pb.RouterMessage(cancel=pb.Cancel(request_id=request_id)))
            if answer.started:
                continue
            last_err = retry_err
            if retries >= self.retry_attempts or not self._pick_possible(model, tried):
                break
            retries += 1
            self._count("retries")
            self.m_retries.labels(last_err.reason).inc()
            log.info("retrying a %s request for %s on another provider after: %s", kind, model, last_err.message)
        if answer.started:  # the provider picked for a continuation went away meanwhile
            yield RouterError(502, f"the answer broke and no live provider serves model digest "
                                   f"{answer.digest or '(unknown)'} any more to continue it; the answer is incomplete",
                              "upstream_error", code="provider_lost", reason="provider_lost")
            return
        if last_err is not None:
            raise last_err
        raise self._no_provider(model)

    def _pass_on(self, answer: "_Answer", pending: _Pending, conn: ProviderConn,
                 held: List[Tuple[dict, List[int], int]], continuing: bool):
        """The held chunks as the user gets them, counted into ``answer``: a continuation's own
        role announcement is dropped (the user has one), its ``id``/``created``/``model``/
        ``system_fingerprint`` become the answer's, its usage keeps the first provider's prompt
        details."""
        for chunk, ids, chars in held:
            if continuing:
                if not ids and not _has_content(chunk):
                    continue
                for key, value in answer.head.items():
                    if key in chunk:
                        chunk[key] = value
                usage = chunk.get("usage")
                if isinstance(usage, dict) and answer.prompt_details is not None and not chunk.get("choices"):
                    usage["prompt_tokens_details"] = answer.prompt_details
            else:
                if not answer.head:
                    answer.head = {k: chunk[k] for k in ("id", "created", "model", "system_fingerprint")
                                   if k in chunk}
                usage = chunk.get("usage")
                if answer.prompt_details is None and isinstance(usage, dict) and usage.get("prompt_tokens_details"):
                    answer.prompt_details = usage["prompt_tokens_details"]
            if not answer.started:
                answer.started = pending.started = True
                answer.digest = conn.model_digest
            answer.resumable = answer.resumable and conn.resumes
            answer.token_ids.extend(ids)
            answer.chars += chars
            pending.delivered += len(ids)
            usage = chunk.get("usage")
            if usage and not chunk.get("choices"):
                with contextlib.suppress(Exception):
                    self.m_tokens.inc(int(usage.get("completion_tokens") or 0))
            yield chunk

    def _continuation(self, answer: "_Answer", conn: ProviderConn, err: RouterError, retryable: bool,
                      model: str, tried: Set[int]) -> Optional[str]:
        """Whether an answer that broke after content reached the user is continued elsewhere:
        ``None`` when it is (counted and logged), else why not (a clause of the user's error)."""
        if not retryable:
            return "a provider's refusal is not continued"
        if not answer.resumable:
            return f"provider {conn.provider_id} does not report its tokens, so it cannot be continued"
        if not answer.digest:
            return "its provider registered no model digest, so no other provider can continue it"
        if answer.continuations >= self.max_continuations:
            return (f"it was continued {answer.continuations} time{'s' if answer.continuations != 1 else ''} "
                    f"already (the limit, --max-continuations)")
        if self._pick(model, tried, answer.digest) is None:
            return f"no other live provider serves model digest {answer.digest} to continue it"
        answer.continuations += 1
        self._count("continuations")
        self.m_continuations.labels(err.reason).inc()
        log.info("continuing a %s answer on another provider of model digest %s after %d tokens (%d characters) "
                 "(continuation %d of %d): %s", model, answer.digest, len(answer.token_ids), answer.chars,
                 answer.continuations, self.max_continuations, err.message)
        return None

    def _pick_possible(self, model: str, tried: Set[int]) -> bool:
        return any(not c.closed and model in c.models and id(c) not in tried for c in self.providers.values())

    async def _handle(self, request: Request, kind: str) -> Response:
        endpoint = "chat.completions" if kind == "chat" else "completions"
        try:
            self._admit_user(request)
            body = await read_body(request)
        except OpenAIError as exc:
            return self._refuse(exc)
        model = self._admit_request(endpoint, body)
        try:
            # the same request models as serve's (front/schemas.py) and its one streaming rule: the
            # provider is always sent a stream (_provider_body), so it cannot tell
            schemas.check(schemas.ChatCompletionRequest if kind == "chat" else schemas.CompletionRequest, body)
            if body.get("stream_options") is not None and body.get("stream") is not True:
                raise OpenAIError(400, "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                                  "invalid_request_error", "stream_options")
        except OpenAIError as exc:
            return self._refuse(exc)
        if not isinstance(model, str) or not model:
            return self._refuse(OpenAIError(400, "'model' is required", "invalid_request_error", param="model"))
        # Closing the attempts (the client gone, an error) sends the provider a Cancel unless it finished.
        return await respond(request.receive, body, self._attempts(kind, model, self._provider_body(body)),
                             chat=kind == "chat", on_end=self._ended)

    def _admit_request(self, endpoint: str, body: dict):
        """Count a user request (by endpoint and streaming) and return its ``model`` field."""
        self._count("requests")
        self.m_requests.labels(endpoint, "true" if body.get("stream") else "false").inc()
        return body.get("model")

    @staticmethod
    def _provider_body(body: dict) -> dict:
        """What a provider is sent: always streamed, with usage (the router counts tokens)."""
        options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
        return dict(body, stream=True, stream_options=dict(options, include_usage=True))

    # ----- users: API keys and rate limits ------------------------------------------------------

    def _key_index(self, request: Request) -> Optional[int]:
        """Index of the request's valid API key; -1 when the router needs none; ``None`` when
        missing or wrong (every configured key is compared in constant time)."""
        if self._keys is None:
            return -1
        return self._keys.check(request.headers)

    def _admit_user(self, request: Request) -> None:
        """Check the request's API key and take one token from its bucket.

        Raises:
            RouterError: 401 ``invalid_api_key``; 429 ``rate_limit_exceeded`` with ``Retry-After``."""
        index = self._key_index(request)
        if index is None:
            raise RouterError(401, "Incorrect or missing API key: send Authorization: Bearer <key> or x-api-key: <key>",
                              "invalid_request_error", code="invalid_api_key", reason="unauthorized")
        if index < 0 or self.rate_limit_per_min <= 0:
            return
        per_s = self.rate_limit_per_min / 60.0
        burst = max(1.0, per_s * 10.0)
        now = time.monotonic()
        tokens, last = self._buckets.get(index, [burst, now])
        tokens = min(burst, tokens + (now - last) * per_s)
        if tokens < 1.0:
            self._buckets[index] = [tokens, now]
            raise RouterError(429, f"Rate limit reached for this API key: {self.rate_limit_per_min:g} requests "
                              "per minute", "requests", code="rate_limit_exceeded",
                              retry_after=(1.0 - tokens) / per_s, reason="rate_limited")
        self._buckets[index] = [tokens - 1.0, now]

    def _refuse(self, exc: OpenAIError) -> Response:
        """A request refused before routing (bad body): counted as a ``bad_request`` failure."""
        reason = exc.reason if isinstance(exc, RouterError) and exc.reason else "bad_request"
        err = RouterError(exc.status, exc.message, exc.type, exc.param, code=exc.code, retry_after=exc.retry_after,
                          reason=reason)
        self._failed(err)
        return err.response()

    def _ended(self, error: Optional[OpenAIError], complete: bool) -> None:
        """How a routed request ended (:data:`mlxcluster.front.sse.OnEnd`): counts
        failures and cancellations (the user went away)."""
        if isinstance(error, RouterError):
            self._failed(error)
        if not complete:
            self._count("cancels")
            self.m_cancels.inc()

    # ----- HTTP app ----------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="mlxcluster router", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request: Request, exc: StarletteHTTPException):
            """An unknown path or method, in the error format of the path's dialect (as serve's)."""
            message = f"Unknown path {request.url.path}" if exc.status_code == 404 else str(exc.detail)
            error = OpenAIError(exc.status_code, message, "invalid_request_error")
            dialect = dialect_of_path(request.url.path)
            return JSONResponse(dialect.error(error) if dialect is not None else error.to_dict(),
                                status_code=exc.status_code, headers=getattr(exc, "headers", None))

        @app.get("/v1/models")
        async def list_models(request: Request):
            try:
                self._admit_user(request)
            except OpenAIError as exc:
                return self._refuse(exc)
            return {"object": "list", "data": self.models()}

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self._handle(request, "chat")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._handle(request, "completion")

        @app.get("/health")
        async def health(request: Request):
            providers = [c.info() for c in sorted(self.providers.values(), key=lambda c: c.provider_id)]
            status = "ok" if providers else "no_providers"
            if self._key_index(request) is None:  # no peer addresses, ids or models to strangers
                return {"status": status, "providers": len(providers)}
            return {"status": status, "providers": providers,
                    "models": sorted({m for c in self.providers.values() for m in c.models}),
                    "stats": dict(self.stats)}

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(generate_latest(self.registry).decode(),
                                     media_type="text/plain; version=0.0.4; charset=utf-8")

        # Anthropic, Ollama and Responses: translated here, forwarded as OpenAI requests (every
        # provider serves every dialect); keys, rate limits, retries and metrics as above
        mount(app, self._dialect_chunks, lambda: [(m["id"], {"context_length": m["context_length"]})
                                                  for m in self.models()],
              admit=self._admit_user, on_end=self._ended,
              count=lambda endpoint, exc: self._refuse(exc))
        return app

    async def _dialect_chunks(self, body: dict, chat: bool):
        """The OpenAI chunk stream of a dialect's request (translated by :mod:`mlxcluster.front.dialects`)."""
        model = self._admit_request("chat.completions" if chat else "completions", body)
        if not isinstance(model, str) or not model:
            raise RouterError(400, "'model' is required", "invalid_request_error", param="model", reason="bad_request")
        it = self._attempts("chat" if chat else "completion", model, self._provider_body(body))
        try:
            async for chunk in it:
                yield chunk
        finally:
            await it.aclose()


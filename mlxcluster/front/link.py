"""A provider's outbound link to a marketplace router (``proto/router.proto``).

:func:`run_link` dials the router (so a provider behind NAT can serve), registers with the provider
token, sends a heartbeat with ``provider.load()`` about every second, runs each ``Request`` as a
task that streams the provider's chunks back (``Chunk``... then ``Done``, or ``Error``), cancels that
task on ``Cancel`` (which closes the provider's iterator and so cancels the generation), and
reconnects with bounded, jittered exponential backoff whenever the stream breaks.

A refused registration (wrong token) is logged as an error and retried at the maximum backoff
(the router's operator may fix the token; we do not hammer it meanwhile). ``max_attempts`` bounds
the number of consecutive failed connections when wanted (default: retry until ``stop_event``).

When the link is lost, requests running for it are cancelled: the router has already given up on
them (and retried them elsewhere when nothing had reached the user yet, or continued them on another
provider of the same model when something had).

Continuations (a provider with ``resumes``, :class:`~mlxcluster.front.provider.Provider`): the
registration carries the model's digest and ``resumes``; each chunk carries the token ids and the
characters of answer text it released (the provider's ``progress``); a ``Request`` with
``resume_token_ids``/``resume_chars`` is passed on as ``resume`` and continues that answer.

The link is always TLS (never plaintext: the token and every request travel inside it): the provider
checks the router's certificate against ``root_certificates`` (``serve --router-ca FILE``, e.g. the
self-signed certificate the router wrote at start; default: the system's roots) and the host name
it dials.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import socket
import time
import uuid
from typing import Dict, Optional

import grpc

from ..protocol import router_pb2 as pb
from ..protocol import router_pb2_grpc as pb_grpc
from ..protocol.errors import OpenAIError, parse_body

log = logging.getLogger("mlxcluster.front.link")

# Every session gets a fresh channel with its own subchannel pool, so gRPC's own reconnect backoff
# (shared subchannels keep it across channels, up to 120 s) never stretches ours.
GRPC_CHANNEL_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_http_proxy", 0),
    ("grpc.keepalive_time_ms", 10000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]


class RegistrationRefused(Exception):
    """The router answered Registered{ok=false}."""


def parse_router_url(url: str) -> str:
    """``host:port`` or ``grpc://host:port`` -> gRPC target ``host:port``."""
    target = url.strip()
    for prefix in ("grpc://", "grpcs://", "http://"):
        if target.startswith(prefix):
            target = target[len(prefix):]
            break
    target = target.rstrip("/")
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"router address {url!r} must be host:port or grpc://host:port")
    return target


def read_ca(path: Optional[str]) -> Optional[bytes]:
    """The PEM certificates in ``path`` (``serve --router-ca``), or ``None`` for no path (the
    system's roots).

    Raises:
        ValueError: one line: the file cannot be read or holds no PEM certificate.
    """
    if path is None:
        return None
    from cryptography import x509

    try:
        with open(path, "rb") as f:
            data = f.read()
        x509.load_pem_x509_certificates(data)
    except OSError as exc:
        raise ValueError(f"cannot read --router-ca {path}: {exc.strerror or exc}") from None
    except ValueError:
        raise ValueError(f"--router-ca {path} holds no PEM certificate") from None
    return data


def default_provider_id() -> str:
    return f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


def _error_fields(exc: Exception) -> dict:
    """``pb.Error`` fields of a failed request: an :class:`OpenAIError` as it is,
    anything else as a 500 ``server_error``."""
    if not isinstance(exc, OpenAIError):
        exc = OpenAIError(500, str(exc) or type(exc).__name__, "server_error")
    return {"status": exc.status, "message": exc.message, "type": exc.type, "param": exc.param or "",
            "retry_after_s": float(exc.retry_after or 0.0)}


class _Session:
    """One connected Link stream."""

    def __init__(self, provider, provider_id: str, token: str, heartbeat_interval_s: float,
                 root_certificates: Optional[bytes] = None, model_digest: str = ""):
        self.provider = provider
        self.model_digest = model_digest
        #: the provider takes ``resume``/``progress`` (Provider.resumes); a fake or older one does not
        self.resumes = bool(getattr(provider, "resumes", False))
        self.root_certificates = root_certificates
        self.provider_id = provider_id
        self.token = token
        self.heartbeat_interval_s = heartbeat_interval_s
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.tasks: Dict[str, asyncio.Task] = {}
        self.registered = False

    def _register_message(self) -> "pb.ProviderMessage":
        p = self.provider
        return pb.ProviderMessage(register=pb.Register(
            provider_id=self.provider_id, token=self.token, models=list(p.models),
            context_length=int(getattr(p, "context_length", 0) or 0),
            capacity=int(getattr(p, "capacity", 1) or 1), model_digest=self.model_digest,
            resumes=self.resumes))

    def _heartbeat_message(self) -> "pb.ProviderMessage":
        try:
            load = self.provider.load() or {}
        except Exception as exc:  # a broken load() must not break the link
            log.debug("provider.load() failed: %s", exc)
            load = {}
        return pb.ProviderMessage(heartbeat=pb.Heartbeat(
            queued=max(0, int(load.get("queued", 0) or 0)), running=max(0, int(load.get("running", 0) or 0)),
            capacity=max(0, int(load.get("capacity", getattr(self.provider, "capacity", 0)) or 0))))

    async def _requests(self):
        for _ in iter(int, 1):  # until None
            msg = await self.outbox.get()
            if msg is None:
                return
            yield msg

    async def _heartbeats(self) -> None:
        while True:
            self.outbox.put_nowait(self._heartbeat_message())
            await asyncio.sleep(self.heartbeat_interval_s)

    async def _serve(self, r: "pb.Request") -> None:
        request_id, send = r.request_id, self.outbox.put_nowait
        try:
            body = parse_body(r.body_json)
            if r.kind == "chat":
                fn = self.provider.chat_completion
            elif r.kind == "completion":
                fn = self.provider.completion
            else:
                raise OpenAIError(400, f"unknown request kind {r.kind!r}", "invalid_request_error")
            progress = None
            if self.resumes:
                from .provider import Delivered

                progress = Delivered()
                resume = Delivered(r.resume_token_ids, r.resume_chars) if r.resume_token_ids or r.resume_chars \
                    else None
                it = fn(body, resume=resume, progress=progress)
            elif r.resume_token_ids or r.resume_chars:
                raise OpenAIError(400, "this provider cannot continue an answer (resume_token_ids)",
                                  "invalid_request_error", "resume")
            else:
                it = fn(body)
            ids_sent = chars_sent = 0  # what the chunks sent so far covered of progress
            try:
                async for chunk in it:
                    msg = pb.Chunk(request_id=request_id, json=json.dumps(chunk, separators=(",", ":")))
                    if progress is not None:
                        msg.token_ids.extend(progress.token_ids[ids_sent:])
                        msg.text_chars = progress.chars - chars_sent
                        ids_sent, chars_sent = len(progress.token_ids), progress.chars
                    send(pb.ProviderMessage(chunk=msg))
            finally:
                await it.aclose()  # on Cancel too: cancels the generation on rank 0
            send(pb.ProviderMessage(done=pb.Done(request_id=request_id)))
        except asyncio.CancelledError:
            raise  # Cancel from the router, or the link went away: nothing more to say
        except Exception as exc:
            fields = _error_fields(exc)
            if fields["status"] >= 500:
                log.warning("request %s failed: %s", request_id, fields["message"])
            send(pb.ProviderMessage(error=pb.Error(request_id=request_id, **fields)))
        finally:
            self.tasks.pop(request_id, None)

    async def run(self, target: str, register_timeout_s: float) -> None:
        """Connect, register and serve until the stream ends. Raises on failure to register."""
        creds = grpc.ssl_channel_credentials(root_certificates=self.root_certificates)
        async with grpc.aio.secure_channel(target, creds, options=GRPC_CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.MarketplaceStub(channel)
            self.outbox.put_nowait(self._register_message())
            call = stub.Link(self._requests())
            heartbeats: Optional[asyncio.Task] = None
            try:
                first = await asyncio.wait_for(call.read(), register_timeout_s)
                if first is grpc.aio.EOF:
                    raise ConnectionError("the router closed the link before answering Register")
                if first.WhichOneof("msg") != "registered":
                    raise ConnectionError(f"unexpected first message from the router: {first.WhichOneof('msg')}")
                if not first.registered.ok:
                    raise RegistrationRefused(first.registered.error or "registration refused")
                self.registered = True
                log.info("registered with router %s as %s", target, self.provider_id)
                heartbeats = asyncio.ensure_future(self._heartbeats())
                for _ in iter(int, 1):  # until EOF
                    msg = await call.read()
                    if msg is grpc.aio.EOF:
                        raise ConnectionError("the router closed the link")
                    kind = msg.WhichOneof("msg")
                    if kind == "request":
                        r = msg.request
                        if r.request_id in self.tasks:
                            continue
                        self.tasks[r.request_id] = asyncio.ensure_future(self._serve(r))
                    elif kind == "cancel":
                        task = self.tasks.get(msg.cancel.request_id)
                        if task is not None:
                            log.info("request %s cancelled by the router", msg.cancel.request_id)
                            task.cancel()
            finally:
                if heartbeats is not None:
                    heartbeats.cancel()
                tasks = list(self.tasks.values())
                for task in tasks:
                    task.cancel()
                if tasks:
                    await asyncio.wait(tasks, timeout=5)
                self.outbox.put_nowait(None)
                call.cancel()


async def run_link(provider, router_url: str, token: str, provider_id: Optional[str] = None, *,
                   max_backoff_s: float = 30.0, stop_event: Optional[asyncio.Event] = None,
                   initial_backoff_s: float = 0.5, heartbeat_interval_s: float = 1.0,
                   register_timeout_s: float = 10.0, max_attempts: Optional[int] = None,
                   root_certificates: Optional[bytes] = None) -> None:
    """Keep ``provider`` linked to the router at ``router_url`` until ``stop_event`` is set, over
    TLS that trusts ``root_certificates`` (PEM bytes, :func:`read_ca`; ``None``: the system's roots).
    The provider's ``model_digest()`` (when it has one) is read once, off the event loop, and
    registered with every connection.

    Backoff between connections: ``min(max_backoff_s, initial_backoff_s * 2**n)`` scaled by a random
    factor in [0.5, 1], n = consecutive failures (reset once a link has registered and lasted 10 s);
    a refused registration waits ``max_backoff_s``. ``max_attempts`` (consecutive failures) ends the
    function with the last error when given.
    """
    target = parse_router_url(router_url)
    provider_id = provider_id or default_provider_id()
    stop_event = stop_event or asyncio.Event()
    digest = getattr(provider, "model_digest", None)
    digest = str(await asyncio.to_thread(digest) or "") if callable(digest) else ""
    stop_wait = asyncio.ensure_future(stop_event.wait())
    failures = 0
    try:
        while not stop_event.is_set():
            session = _Session(provider, provider_id, token, heartbeat_interval_s, root_certificates, digest)
            started = time.monotonic()
            run = asyncio.ensure_future(session.run(target, register_timeout_s))
            try:
                await asyncio.wait({run, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:  # run_link itself cancelled: drop the link now
                run.cancel()
                with contextlib.suppress(BaseException):
                    await run
                raise
            if not run.done():  # stop requested
                run.cancel()
                with contextlib.suppress(BaseException):
                    await run
                break
            exc = run.exception()
            refused = isinstance(exc, RegistrationRefused)
            if refused:
                log.error("router %s refused provider %s: %s", target, provider_id, exc)
            elif isinstance(exc, grpc.aio.AioRpcError):
                log.warning("link to router %s lost: %s %s", target, exc.code().name, exc.details())
            elif exc is not None:
                log.warning("link to router %s lost: %s", target, exc)
            if session.registered and time.monotonic() - started >= 10.0:
                failures = 0
            failures += 1
            if max_attempts is not None and failures >= max_attempts:
                raise exc if exc is not None else ConnectionError("link closed")
            if refused:
                delay = max_backoff_s
            else:
                delay = min(max_backoff_s, initial_backoff_s * 2 ** min(failures - 1, 30))
                delay *= random.uniform(0.5, 1.0)
            log.info("reconnecting to %s in %.1f s", target, delay)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(stop_wait), delay)
    finally:
        stop_wait.cancel()

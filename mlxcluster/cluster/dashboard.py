"""The dashboard of a ``join`` node: the page ``serve`` shows, for the node and its cluster.

``GET /`` and its assets, ``GET /dashboard/state`` and ``/dashboard/events`` (one snapshot per
second, :meth:`NodeDashboard.snapshot`) through :func:`~mlxcluster.front.api.mount_dashboard`;
``GET /metrics`` (Prometheus text: the same figures); ``POST /v1/chat/completions`` (the page's
chat box) streamed from the formed cluster's rank 0 by a
:class:`~mlxcluster.front.provider.Provider` that follows rank 0 when the cluster re-forms (the
full API of a formed cluster is ``serve --cluster``'s).

What a snapshot holds, beyond ``serve``'s keys: ``nodes`` -- this node and every peer it knows, each
with its membership ``status`` (live, seen, refused, lost: a peer that misses heartbeats for
``PEER_TIMEOUT_S`` is lost, and the page draws it red), rank and layers in the formation, ``spare``
(``join --spare``: the page marks it) -- ``fetch``
(``join --fetch-model``'s transfer: bytes done of total, rate, state) and ``waiting`` (what
formation waits for).  Ranks, memory, queue, tok/s and TTFT come from rank 0's ``Info``: its
counters cover every client of the cluster, not only this page.

Threads: one, ``dashboard``, runs an asyncio loop (uvicorn, rank 0's ``Info`` and the chat's
``Generate`` over ``grpc.aio``); it reads only what the node loop publishes (:meth:`NodeDaemon.view`).
With ``join --api-key``/``--api-key-file`` every path needs a key, as on ``serve``
(:mod:`mlxcluster.front.auth`: Bearer or ``x-api-key``, the page's sign-in cookie); without one it
listens only on loopback unless ``--insecure-no-auth``.  ``--tls-cert``/``--tls-key`` serve it over
HTTPS.  Its port: :func:`bind` (the default port, else the next free one, so that several nodes on
one host each get a page).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import socket
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import grpc
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.responses import Response

from ..protocol import mlxcluster_pb2 as pb
from ..protocol import mlxcluster_pb2_grpc as pb_grpc
from ..protocol.errors import OpenAIError, read_body

log = logging.getLogger("mlxcluster.dashboard")

__all__ = ["NodeDashboard", "DEFAULT_PORT", "bind"]

#: ``join --dashboard-port`` default
DEFAULT_PORT = 8477
#: with the default port taken, the next ports tried before any free port (0)
DEFAULT_PORT_TRIES = 10


def bind(host: str, port: Optional[int] = None, default: int = DEFAULT_PORT,
         tries: int = DEFAULT_PORT_TRIES) -> socket.socket:
    """The dashboard's listening socket on ``host``: ``port`` when given (0: any free port),
    else ``default``; when the default is taken (another node on this host), the next of
    ``tries`` ports, then any free port.  The socket is bound AND listening when this returns
    (a socket only bound could share its port with another process's, both with
    ``SO_REUSEADDR``, until the second one's ``listen`` failed).

    Raises:
        OSError: one line, ``cannot listen on HOST:PORT for the dashboard: why`` (an explicit port
            that is taken, a host that is not this machine's).
    """
    from ..front.api import bind_socket

    candidates = [port] if port is not None else [default + i for i in range(max(1, tries))] + [0]
    for i, p in enumerate(candidates):
        try:
            sock = bind_socket(host, p, "the dashboard")
        except OSError as exc:  # one line already
            error, taken = str(exc), "in use" in str(exc)
        else:
            try:
                sock.listen(128)
            except OSError as exc:
                sock.close()
                error = f"cannot listen on {host}:{p} for the dashboard: {exc.strerror or exc}"
                taken = exc.errno == errno.EADDRINUSE
            else:
                if i:
                    log.info("dashboard port %d is taken (another node on this host?): using %d", candidates[0],
                             sock.getsockname()[1])
                return sock
        if i == len(candidates) - 1 or not taken:
            raise OSError(error)
    raise AssertionError("unreachable")  # the last candidate returns or raises


#: the tok/s figure is the rate over about this many seconds
RATE_WINDOW_S = 3.0


class NodeDashboard:
    """The HTTP server of one node's dashboard.

    Args:
        daemon: the :class:`~mlxcluster.cluster.node.NodeDaemon` it shows (``view()``, ``creds``).
        sock: a listening socket (:func:`bind`), so that a taken port fails before the node joins.
        auth: the API keys every request needs (``None``: none).
        tls: ``(cert, key)`` PEM files (:func:`~mlxcluster.front.auth.tls_files`): HTTPS.
    """

    def __init__(self, daemon, sock: socket.socket, auth=None, tls: Optional[Tuple[str, str]] = None):
        self.daemon = daemon
        self.sock = sock
        self.auth = auth
        self.tls = tls
        host, port = sock.getsockname()[:2]
        self.url = "%s://%s:%d/" % ("https" if tls else "http", f"[{host}]" if ":" in host else host, port)
        self._thread: Optional[threading.Thread] = None
        self._server = None
        self._info: Optional[pb.InfoReply] = None       # rank 0's last Info (for the current rank 0)
        self._info_of = ""                              # ... and which rank 0 answered it
        self._channel: Optional[Any] = None             # grpc.aio channel to rank 0, per rank 0 address
        self._rate: "collections.deque" = collections.deque()  # (monotonic s, generated tokens)
        self._ttft_seen = (0, 0.0)                      # (first_tokens, ttft_seconds_sum) last used
        self._ttft_last: Optional[float] = None
        self._provider = None                           # the chat box's Provider, made on first use
        self._errors: "collections.deque" = collections.deque(maxlen=20)
        self._last_lost: frozenset = frozenset()
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Serve in the ``dashboard`` thread (returns at once)."""
        import uvicorn

        tls = dict(ssl_certfile=self.tls[0], ssl_keyfile=self.tls[1]) if self.tls else {}
        config = uvicorn.Config(self.app(), log_level="warning", timeout_graceful_shutdown=1, lifespan="off", **tls)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="dashboard", daemon=True)
        self._thread.start()
        log.info("dashboard at %s", self.url)

    def _run(self) -> None:
        async def main() -> None:
            try:
                await self._server.serve(sockets=[self.sock])
            finally:
                if self._provider is not None:
                    await self._provider.aclose()
                if self._channel is not None:
                    await self._channel[1].close()
        try:
            asyncio.run(main())
        except Exception:  # the node keeps running without its page
            log.exception("the dashboard stopped")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving (open event streams are closed) and wait up to ``timeout_s``."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.sock.close()

    # -- the application ----------------------------------------------------------------------
    def app(self) -> FastAPI:
        from ..front.api import mount_dashboard
        from ..front.auth import install
        from ..front.sse import respond

        app = FastAPI(title="mlxcluster node", docs_url=None, redoc_url=None, openapi_url=None)
        install(app, self.auth, self.registry)

        @app.exception_handler(OpenAIError)
        async def _openai_error(request: Request, exc: OpenAIError):
            return exc.response()

        @app.get("/metrics")
        async def metrics():
            await self._refresh()
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            body = await read_body(request)
            provider = await self._chat_provider()
            return await respond(request.receive, body, provider.chat_completion(body), chat=True)

        mount_dashboard(app, self.snapshot)
        return app

    # -- rank 0 -------------------------------------------------------------------------------
    def _rank0(self) -> str:
        view = self.daemon.view()
        f = view["formation"]
        return f["rank0_address"] if f is not None and view["state"] == "ready" else ""

    async def _refresh(self) -> None:
        """Ask the current rank 0 for ``Info`` (none while the cluster is not formed)."""
        address = self._rank0()
        if self._channel is not None and self._channel[0] != address:
            await self._channel[1].close()
            self._channel = None
        info = None
        if address:
            if self._channel is None:
                self._channel = (address, self.daemon.creds.aio_channel(address))
            try:
                info = await pb_grpc.GenerationStub(self._channel[1]).Info(pb.InfoRequest(), timeout=2.0)
            except grpc.RpcError:
                info = None
        if address != self._info_of:  # a new rank 0: its counters start again
            self._rate.clear()
            self._ttft_seen = (0, 0.0)
            self._info_of = address
        self._info = info

    async def _chat_provider(self):
        """The provider for the current rank 0 (made on first use, then retargeted).

        Raises:
            OpenAIError: 503 while the cluster is not formed (the message says what it waits for).
        """
        from ..front.provider import Provider

        view = self.daemon.view()
        address = self._rank0()
        if not address:
            raise OpenAIError(503, "the cluster is not formed yet" + (f" (waiting: {view['waiting']})"
                                                                      if view["waiting"] else ""),
                              "server_error", code="service_unavailable", retry_after=5)
        if self._provider is None:  # (a ProviderError is an OpenAIError: answered in OpenAI's format)
            self._provider = await asyncio.to_thread(Provider, address, view["model_path"], _name(view),
                                                     self.daemon.creds)
        elif self._provider.rank0_address != address:
            await self._provider.retarget(address, self.daemon.creds)
        return self._provider

    # -- the snapshot --------------------------------------------------------------------------
    def _note_losses(self, view: Dict[str, Any]) -> None:
        lost = frozenset(p["node_id"] for p in view["peers"] if p["status"] == "lost")
        for nid in sorted(lost - self._last_lost):
            reason = next(p["reason"] for p in view["peers"] if p["node_id"] == nid)
            self._errors.append({"time": time.time(), "message": f"node {nid} lost: {reason}"[:300]})
        self._last_lost = lost
        if view["state"] == "failed" and view["error"] and \
                (not self._errors or self._errors[-1]["message"] != view["error"][:300]):
            self._errors.append({"time": time.time(), "message": view["error"][:300]})

    async def snapshot(self) -> Dict[str, Any]:
        """What the page shows: ``serve``'s keys (:meth:`Provider.snapshot`: ``model``,
        ``world_size``, ``backend``, ``weight_format``, ``ranks``, ``queue``,
        ``decode_tokens_per_s``, ``ttft_s``, ``tokens_total``, ``group``, ``errors``, ``time``,
        ``speculative``: :func:`~mlxcluster.front.provider.speculative_figures`) from rank 0's
        ``Info``, and ``node_id``, ``cluster``, ``state``, ``waiting``, ``nodes`` (see the
        module docstring), ``fetch`` (bytes of the model transfer) and ``plan`` (rank 0's node: the plan's
        predicted decode tok/s and TTFT beside the measured ones, :func:`~mlxcluster.cluster.measure.plan_view`;
        ``None`` elsewhere) from this node."""
        from ..front.provider import speculative_figures

        await self._refresh()
        view, info, now = self.daemon.view(), self._info, time.monotonic()
        self._note_losses(view)
        formation = view["formation"]
        rate = 0.0
        if info is not None:
            self._rate.append((now, info.generated_tokens))
            while len(self._rate) > 2 and now - self._rate[0][0] > RATE_WINDOW_S:
                self._rate.popleft()
            t0, k0 = self._rate[0]
            rate = (info.generated_tokens - k0) / (now - t0) if now > t0 else 0.0
            if info.first_tokens > self._ttft_seen[0]:
                self._ttft_last = (info.ttft_seconds_sum - self._ttft_seen[1]) / \
                    (info.first_tokens - self._ttft_seen[0])
                self._ttft_seen = (info.first_tokens, info.ttft_seconds_sum)
        ranks: List[Dict[str, Any]] = []
        if info is not None:
            ranks = [{"rank": r.rank, "alive": r.alive, "active_memory_bytes": r.active_memory_bytes,
                      "weight_bytes": r.weight_bytes, "address": r.address, "last_seen_s": round(r.last_seen_s, 2)}
                     for r in info.ranks]
        status = "ok" if info is not None else (view["state"] if view["state"] != "ready" else "unavailable")
        return {"model": _name(view), "world_size": formation["world_size"] if formation else 0,
                "backend": formation["backend"] if formation else "",
                "weight_format": info.weight_format if info is not None else "",
                "ranks": ranks, "decode_tokens_per_s": round(rate, 2), "ttft_s": self._ttft_last,
                "tokens_total": int(info.generated_tokens) if info is not None else 0,
                "group": {"status": status, "restarts": 0, "last_failure": view["error"]},
                "errors": list(self._errors), "speculative": speculative_figures(info),
                "queue": {"queued": info.queued if info is not None else 0,
                          "running": info.running if info is not None else 0,
                          "capacity": info.capacity if info is not None else 0},
                "time": time.time(), "node_id": view["node_id"], "cluster": view["cluster"],
                "state": view["state"], "waiting": view["waiting"], "nodes": _nodes(view), "fetch": view["fetch"],
                # issue 31: rank 0's node: the formation's predicted figures beside the measured ones
                "plan": view.get("plan")}


def _name(view: Dict[str, Any]) -> str:
    """The model id the chat box sends (``serve``'s default ``--model-name``)."""
    name = view["model"]
    return name[:-5] if name.endswith(".gguf") else name


def _nodes(view: Dict[str, Any]) -> List[Dict[str, Any]]:
    """This node and its peers, each with its rank in the formation (``None``: none)."""
    f = view["formation"]
    rank = {m["node_id"]: m["rank"] for m in f["members"]} if f else {}
    me = {"node_id": view["node_id"], "address": view["address"], "status": "live", "state": view["state"],
          "reason": view["error"], "model_digest": view["model_digest"], "layers": view["layers"],
          "role": view["role"], "spare": view.get("spare", False), "last_seen_s": 0.0, "self": True}
    out = [me] + [dict(p, self=False) for p in view["peers"]]
    for n in out:
        n["rank"] = rank.get(n["node_id"])
    return out


class _Collector:
    """``/metrics`` of a node: membership, the model transfer and rank 0's counters."""

    def __init__(self, board: NodeDashboard):
        self.board = board

    def collect(self):
        view, info = self.board.daemon.view(), self.board._info
        peers = GaugeMetricFamily("mlxcluster_node_peers", "Peers this node knows, by membership status.",
                                  labels=["status"])
        counts = collections.Counter(p["status"] for p in view["peers"])
        for status in ("seen", "live", "refused", "lost"):
            peers.add_metric([status], counts.get(status, 0))
        yield peers
        ready = GaugeMetricFamily("mlxcluster_node_formed", "1 while this node holds a ready rank of a formation.")
        ready.add_metric([], 1.0 if view["state"] == "ready" else 0.0)
        yield ready
        fetch = view["fetch"] or {}
        done = GaugeMetricFamily("mlxcluster_node_model_fetch_bytes", "Bytes of the model fetched from a peer "
                                 "(join --fetch-model), of model_fetch_total_bytes.")
        done.add_metric([], float(fetch.get("done_bytes", 0)))
        yield done
        total = GaugeMetricFamily("mlxcluster_node_model_fetch_total_bytes", "Bytes of the model being fetched.")
        total.add_metric([], float(fetch.get("total_bytes", 0)))
        yield total
        if info is not None:
            tokens = CounterMetricFamily("mlxcluster_cluster_generated_tokens", "Tokens rank 0 generated since it "
                                         "started (every client).")
            tokens.add_metric([], float(info.generated_tokens))
            yield tokens
            ttft = CounterMetricFamily("mlxcluster_cluster_time_to_first_token_seconds", "Sum of rank 0's "
                                       "admission-to-first-token times (s), over first_tokens requests.")
            ttft.add_metric([], info.ttft_seconds_sum)
            yield ttft
            first = CounterMetricFamily("mlxcluster_cluster_first_tokens", "Requests that received a first token.")
            first.add_metric([], float(info.first_tokens))
            yield first
            for name, value, doc in (("drafted_tokens", info.spec_drafted_tokens, "Draft tokens rank 0 verified "
                                      "(speculative decoding)."),
                                     ("accepted_tokens", info.spec_accepted_tokens, "Draft tokens accepted."),
                                     ("verify_steps", info.spec_steps, "Steps of a sequence that verified a draft."),
                                     ("verify_step_tokens", info.spec_emitted_tokens, "Tokens those steps emitted.")):
                c = CounterMetricFamily(f"mlxcluster_cluster_spec_{name}", doc)
                c.add_metric([], float(value))
                yield c
            for name, value, doc in (("queue_depth", info.queued, "Requests waiting at rank 0."),
                                     ("running", info.running, "Sequences rank 0 decodes.")):
                g = GaugeMetricFamily(f"mlxcluster_cluster_{name}", doc)
                g.add_metric([], float(value))
                yield g
            mem = GaugeMetricFamily("mlxcluster_cluster_rank_active_memory_bytes", "MLX active memory per rank.",
                                    labels=["rank"])
            for r in info.ranks:
                mem.add_metric([str(r.rank)], float(r.active_memory_bytes))
            yield mem


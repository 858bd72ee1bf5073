"""The node daemon behind ``mlxcluster join``: one loop that forms, runs and re-forms the cluster with its peers.

Each node advertises itself over mDNS (:mod:`mlxcluster.cluster.discovery`),
watches its peers, and serves the ``Node`` gRPC service
(:mod:`mlxcluster.cluster.service`).  The loop keeps the typed membership
(:mod:`mlxcluster.cluster.membership`), asks the pure planner
(:mod:`mlxcluster.cluster.plan`) what to do, and applies its answer:

* *Membership.*  A peer counts when its TXT record is of the same protocol
  version and model digest, and it answers ``Status`` (the heartbeat, every
  ``HEARTBEAT_S``) over mutual TLS, proving the cluster secret and its node id.
  mDNS is only a hint: a proven peer moves to another advertised endpoint only
  once that endpoint proves the node id, and an mDNS goodbye does not remove it;
  a peer that misses heartbeats for ``PEER_TIMEOUT_S`` is lost.
* *Formation.*  The coordinator (smallest live node id) asks each chosen member
  to ``Prepare`` (pick ring and control ports), picks the backend, and sends
  each a ``Bootstrap`` with its rank and every rank's endpoints.
* *Rank process.*  Each member starts its rank (:mod:`mlxcluster.cluster.ranks`)
  and follows its progress events; the rank exits by itself if the daemon dies.
* *Loss.*  When a member is lost or a rank fails, every survivor tears its
  rank process down and the coordinator re-forms when the model still splits.
* *Spare* (``join --spare``).  The node advertises ``sp=1``, takes a rank only in a lost
  member's place (the planner's rules) and, while idle, reads the model's files into the OS
  page cache once (a ``spare-warm`` thread), so that its rank's load is a warm read.
* *Measurement* (issue 31, :mod:`mlxcluster.cluster.measure`).  At its start (or once ``--fetch-model``
  has the model) a ``measure-compute`` thread gets this machine's compute figures for the model (a child
  process, cached on disk); a ``measure-links`` thread probes each live peer's link through its
  ``Node.Measure`` RPC (re-measured after ``LINK_TTL_S``); a rank's ``loaded`` event gives the backend's
  ``all_sum``.  The figures travel in ``Prepare`` and ``Status`` replies; the loop keeps every peer's.
  With ``join --plan auto`` (the default) the planner chooses the shape from them (:class:`AutoInputs`);
  rank 0's node shows its formation's predicted figures beside the measured ones and logs a prediction
  off by more than 30 % once, with the measurements.
* *Growth.*  Rank 0's node keeps whether its rank 0 last reported no running or queued request
  (``Generation.Info``, the liveness probe's answer): without ``--world-size`` the planner grows a
  formation that re-formed smaller at such a moment (or after a bounded delay).

Threads: the thread that calls :meth:`NodeDaemon.run` is the node loop, the only
one that reads or changes membership and rank state.  Discovery callbacks,
heartbeat answers (gRPC futures) and rank events (supervisor readers) post to
its inbox; gRPC handlers post ``Prepare``/``Bootstrap``/``Teardown`` and wait for
the loop's answer, and answer ``Status`` from the snapshot the loop publishes.
The loop's own RPCs to peers (forming, teardown) block it, each within a
deadline, so a loop waiting on another loop always ends.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import platform
import queue
import shutil
import socket
import tempfile
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Set, Tuple, TypeVar

import grpc

from ..model.loader import model_digest
from ..protocol import mlxcluster_pb2 as pb
from ..protocol import mlxcluster_pb2_grpc as pb_grpc
from ..runtime.launcher import free_ports
from ..runtime.standby import Standby
from ..runtime.supervisor import RankProcess
from ..runtime import backends as bk
from ..runtime import mpi_agent, thunderbolt
from . import ranks
from ..security import credentials, describe_rpc_error, handshake_failed, node_name
from . import measure as ms
from .discovery import PROTOCOL_VERSION, Discovery, NodeInfo, interface_of, local_node_facts
from .membership import (
    Bootstrapping, Failed, Formation, Idle, Member, OwnState, Peer, PeerReport, PeerStatus, Preparing, Running,
    IDLE_STATES, PEER_TIMEOUT_S, RttEstimate, advertised, heartbeat, peer_timeout, proved, refusal, silent_since, wire_state)
from .plan import Announce, AutoInputs, Form, PlanInputs, Teardown, Wait, coordinator_id, plan, predicted_for
from .shape import LinkMeasure, ModelProfile, Request, ShapeError, TpLayerMeasure, with_jaccl_prior
from .service import NodeService
from .transfer import ModelShare

log = logging.getLogger("mlxcluster.node")

__all__ = ["NodeDaemon", "NodeConfig", "default_node_id"]

HEARTBEAT_S = 0.5
RPC_TIMEOUT_S = 2.0
#: Seconds a running rank process may leave its liveness probe unanswered before it counts as
#: failed (stuck or frozen: SIGSTOP), so that the formation is torn down and re-formed.
RANK_STUCK_S = 6.0
#: Formations whose deserters :meth:`NodeDaemon._note_left` remembers.
LEFT_KEPT = 16

#: Planner runs between two ticks at most (a lost peer, a teardown's next step: acted on at once).
MAX_EARLY_PLANS = 4

#: After a teardown the node ticks (heartbeats, plans) every ``FAST_TICK_S`` for ``FAST_TICKS_FOR_S``:
#: the next formation waits on the other members' reports that they let go too, which come with
#: heartbeats, not with a tick half a second later.
FAST_TICK_S = 0.1
FAST_TICKS_FOR_S = 1.5

#: Seconds this node must have been idle, or its rank serving, before a standby is started.
STANDBY_DELAY_S = 10.0

#: Seconds before a new standby rank process after one exited by itself (a broken install or
#: model must not restart one every tick).
STANDBY_RETRY_S = 30.0

T = TypeVar("T")



def default_node_id(address: str, port: int) -> str:
    """Hostname, data-plane address and gRPC port: unique per ``join`` process on a
    host, and stable across restarts when ``--port`` is fixed."""
    host = socket.gethostname().split(".")[0] or "node"
    return f"{host}-{address.replace('.', '-').replace(':', '-')}-{port}"


@dataclass
class NodeConfig:
    """Settings of one node daemon (see ``mlxcluster join --help``)."""

    cluster: str = "default"
    address: str = "127.0.0.1"        # data-plane / gRPC address (from --interface)
    interfaces: List[str] = field(default_factory=list)  # mDNS interface addresses
    port: int = 0                      # Node service port (0 = pick)
    node_id: str = ""                  # "" = default_node_id(address, port)
    model_path: str = ""
    weights: Optional[str] = None
    backend: str = "auto"
    world_size: Optional[int] = None
    exact_world_size: bool = False     # join --exact-world-size: never re-form below world_size
    secret: str = ""
    valid_world_sizes: List[int] = field(default_factory=lambda: [1])
    layers: str = ""                   # join --layers: this node's pipeline stage ("" = TP)
    role: str = ""                     # join --role: "prefill", "decode", "draft" or ""
    spare: bool = False                # join --spare: a rank only in a lost member's place
    standby: bool = True               # keep a standby rank process (runtime/standby.py); join --no-standby
    peer_timeout_s: float = PEER_TIMEOUT_S  # a peer silent this long is lost (join --peer-timeout)
    n_layers: int = 0                  # the model's transformer layers (for layers)
    #: join --fetch-model: with no model_path, fetch the model from a peer into this directory, then
    #: call ``configure_model(path)`` for the fields above that depend on it (weights,
    #: valid_world_sizes, n_layers)
    fetch_dir: str = ""
    configure_model: Optional[Callable[[str], Dict[str, object]]] = None
    #: join --plan: "auto" (choose the shape by measurement when no --world-size, --layers or --role is
    #: given) or "manual" (today's rule: the largest valid world size)
    plan: str = "auto"
    #: where the compute measurement is cached ("": ~/.cache/mlxcluster/measure)
    measure_dir: str = ""
    measure: bool = True               # measure compute and links at all
    #: join --memory: bytes this node offers its ranks -- advertised and planned with (0: what the
    #: machine has, :func:`~mlxcluster.cluster.measure.usable_memory_bytes`)
    memory_limit: int = 0
    #: join --kv-bits / --kv-group-size: the KV format of the formations this node coordinates (0 / 0:
    #: full precision); a member runs its coordinator's
    kv_bits: int = 0
    kv_group_size: int = 0
    #: join --recorded DIR: this node's macOS tool outputs (its Thunderbolt ports, their addresses,
    #: RDMA devices) are read from DIR/<node id> or DIR/<host name> instead of running the tools
    recorded_dir: str = ""
    #: join --prompt-cache-dir / --prompt-cache-size: this node's ranks' disk tier (made and checked by
    #: ``join``), where the formation's topology keeps one ("": none)
    prompt_cache_dir: str = ""
    prompt_cache_size: str = ""


class NodeDaemon:
    """One ``mlxcluster join`` process.  ``run()`` blocks until ``stop()``.

    Raises (constructor):
        OSError: the ``Node`` service cannot listen on ``address:port``.
        ValueError: an invalid address or node id for discovery.
    """

    def __init__(self, config: NodeConfig):
        self.cfg = config
        self._inbox: "queue.SimpleQueue[futures.Future]" = queue.SimpleQueue()
        self._stop = threading.Event()
        # -- owned by the loop thread ----------------------------------------------
        self.own: OwnState = Idle()
        self.peers: Dict[str, Peer] = {}
        self._channels: Dict[str, Tuple[Tuple[str, int], grpc.Channel, pb_grpc.NodeStub]] = {}
        self._in_flight: set = set()       # node ids with a heartbeat under way
        #: node id -> time.monotonic() its last heartbeat was sent / its answer (or error) arrived, the
        #: latter written by gRPC's callback thread before the answer is posted to the inbox
        self._sent_at: Dict[str, float] = {}
        self._arrived_at: Dict[str, float] = {}
        #: node id -> time.monotonic() the first heartbeat still unanswered since its last answer was
        #: sent (membership.silent_since: this node's own lateness is not the peer's silence)
        self._asked_at: Dict[str, float] = {}
        self._rtt: Dict[str, RttEstimate] = {}  # node id -> its answered heartbeats' round trips (RFC 6298)
        self._fast_until = 0.0             # tick every FAST_TICK_S until then (after a teardown)
        #: own rank's (busy_s, time.monotonic() of the answer, step_s: its slowest recent step)
        self._rank_busy: Tuple[float, float, float] = (0.0, 0.0, 0.0)
        #: formation id -> node ids that reported holding a rank in it and later reported another
        #: state (left it): a silent peer still in a deserted formation is judged sooner
        self._left: "collections.OrderedDict[str, Set[str]]" = collections.OrderedDict()
        self._probing: set = set()         # (node id, address, port) of pending endpoints being asked
        self._changed_at = self._started_at = time.monotonic()
        self._retry_at = 0.0
        self._attempts = 0
        self._announced = False
        self._advertised = "idle"
        self._waiting = ""
        self._ranks = None                 # Supervisor of this node's rank process
        self._rank_seq = 0                 # identifies it in its callbacks
        self._rank_probe: Optional[Tuple[int, grpc.Channel]] = None  # (seq, channel) of the liveness probe
        self._rank_probing = False
        self._rank_ok_at = 0.0
        self._tmp = tempfile.mkdtemp(prefix="mlxcluster-node-")
        self._fetching: Optional[str] = None  # node id the model is being fetched from
        self._fetch_retry_at = 0.0
        #: join --fetch-model's transfer for the dashboard: replaced whole (never mutated) by the
        #: fetch thread and the loop; ``None`` when this node fetched nothing
        self.fetch_progress: Optional[Dict[str, object]] = None
        self._sized: Tuple[str, int] = ("", 0)  # (model path, its files' total bytes)
        self._last_world_size = 0          # world size of the last formation this node held a rank in
        self._rank0_idle = False           # this node's rank 0 answered Info with no running/queued request
        self._warmed = ""                  # join --spare: model path whose files were read into the page cache
        self._standby: Optional[Standby] = None  # the next rank process, started ahead (runtime/standby.py)
        self._standby_at = 0.0             # no standby started before this (after one exited by itself)
        self._plan_now = False             # run the planner before the next tick (a peer was lost, a teardown)
        self._standby_seen: Tuple[type, float] = (Idle, time.monotonic())  # own state's kind, and since when
        # -- measurement (issue 31) --------------------------------------------------
        self._compute: Optional[ms.Compute] = None  # this machine's compute figures (measure-compute thread)
        self._compute_error = ""
        self._links: Dict[str, Tuple[LinkMeasure, float]] = {}  # peer id -> (its link, time.monotonic())
        self._link_tried: Dict[str, float] = {}  # peer id -> when its probe was last queued
        self._link_jobs: "queue.SimpleQueue" = queue.SimpleQueue()  # (peer id, address, port) to probe
        self._all_sum: Dict[str, float] = {}     # backend -> all_sum µs a rank of this node measured
        # backend -> the last TP formation's measured layer (shape.TpLayerMeasure: its nodes, seconds)
        self._tp_layer: Dict[str, TpLayerMeasure] = {}
        self._reports: Dict[str, ms.NodeReport] = {}  # peer id -> what it last reported
        self._profile: Optional[Tuple[str, Optional[ModelProfile]]] = None  # (model path, its profile)
        self._plan_msg: Optional[pb.PlanMsg] = None  # rank 0's node: its formation's prediction
        self._plan_for: Tuple = ((), "", "", "")  # (members, layers, mode, note) it was predicted for
        self._meter = ms.DecodeMeter()
        self._off_logged = False
        self._memory_usable = 0
        self._measuring: List = []  # Supervisors of compute measurements (stopped with the node)
        # ---------------------------------------------------------------------------
        if not config.secret:
            raise ValueError("a node needs the cluster secret")
        # The node id (and so this node's certificate) may name the port: pick it before binding.
        bound = 0
        for _ in range(3 if config.port == 0 else 1):
            port = config.port or free_ports(1, config.address)[0]
            node_id = config.node_id or default_node_id(config.address, port)
            self.creds = credentials(config.secret, config.cluster, [node_name(node_id)])
            self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
            self.share = ModelShare(config.model_path)  # the model, to peers that lack it
            pb_grpc.add_NodeServicer_to_server(NodeService(self), self.server)
            bound = self.server.add_secure_port(f"{config.address}:{port}", self.creds.server())
            if bound:
                break
        if bound == 0:
            raise OSError(f"cannot listen on {config.address}:{config.port}")
        self.cfg.port = bound
        self.cfg.node_id = node_id
        facts = local_node_facts()
        self.rdma = self._rdma_facts()  # jaccl and the ring's cables: Thunderbolt ports and RDMA devices
        self._exec: Optional["queue.SimpleQueue"] = None  # output queue of the Exec call running orted here
        self.info = NodeInfo(
            node_id=self.cfg.node_id, cluster=config.cluster, address=config.address, port=bound,
            version=PROTOCOL_VERSION,
            memory_bytes=ms.cap_memory(int(facts.get("memory_bytes", 0)), config.memory_limit),
            platform=str(facts.get("platform", platform.platform())), chip=str(facts.get("chip", "")),
            backends=bk.local_backends(), model_digest=model_digest(config.model_path) if config.model_path else "",
            state="idle", layers=config.layers, role=config.role, spare=config.spare)
        self.discovery = Discovery(self.info, config.interfaces,
                                   on_change=lambda event, info: self._post(lambda: self._on_advert(event, info)))
        self._memory_usable = ms.cap_memory(ms.usable_memory_bytes(), config.memory_limit)
        self._iface = interface_of(config.address)
        self._host = socket.gethostname()
        self._snapshot = self._status_reply()
        self._view = self._view_of()

    # -- lifecycle ----------------------------------------------------------------
    def run(self) -> None:
        """Serve, announce and run the node loop until :meth:`stop`.

        Raises:
            DiscoveryError: this node id is already announced by a live node.
            OSError: the mDNS sockets cannot be opened.
        """
        self.server.start()
        try:
            if self.cfg.measure:
                threading.Thread(target=self._link_worker, daemon=True, name="measure-links").start()
                self._start_compute()
            self.discovery.start()
            log.info("node %s joined cluster %r at %s:%d (backends %s, model digest %s)", self.cfg.node_id,
                     self.cfg.cluster, self.cfg.address, self.cfg.port, ",".join(self.info.backends),
                     self.info.model_digest)
            self._loop()
        finally:
            self._teardown_local("node stopping")
            for sup in list(self._measuring):
                sup.stop(timeout_s=1.0)
            if self._standby is not None:
                self._standby.stop()
            self.discovery.stop()
            self.server.stop(grace=0.5)
            for _, channel, _ in self._channels.values():
                channel.close()
            if self._rank_probe is not None:
                self._rank_probe[1].close()
            self._drain()
            shutil.rmtree(self._tmp, ignore_errors=True)

    def stop(self) -> None:
        """Ask :meth:`run` to return (within ``HEARTBEAT_S``); safe from a signal handler."""
        self._stop.set()

    def _loop(self) -> None:
        next_tick = 0.0
        early = 0  # plans run between two ticks (bounded: MAX_EARLY_PLANS)
        while not self._stop.is_set():
            soon = self._plan_now and early < MAX_EARLY_PLANS
            try:
                item = self._inbox.get(timeout=0.0 if soon else max(0.0, min(next_tick - time.monotonic(), HEARTBEAT_S)))
            except queue.Empty:
                item = None
            try:
                if item is not None:
                    self._run(item)
                if self._plan_now and early < MAX_EARLY_PLANS:
                    self._plan_now = False
                    early += 1
                    self._plan(time.monotonic())
                if time.monotonic() >= next_tick:
                    early = 0
                    self._tick()
                    now = time.monotonic()
                    next_tick = now + (FAST_TICK_S if now < self._fast_until else HEARTBEAT_S)
            except Exception:  # keep the daemon alive; the next tick retries
                log.exception("node loop step failed")
            self._snapshot = self._status_reply()
            self._view = self._view_of()

    # -- the inbox ------------------------------------------------------------------
    def _post(self, fn: Callable[[], T]) -> "futures.Future[T]":
        job: futures.Future = futures.Future()
        job.fn = fn  # type: ignore[attr-defined]
        self._inbox.put(job)
        return job

    def call_soon(self, fn: Callable[[], T]) -> "futures.Future[T]":
        """Run ``fn`` on the node loop (from any thread) without waiting for it."""
        return self._post(fn)

    @staticmethod
    def _run(job: futures.Future) -> None:
        if not job.set_running_or_notify_cancel():
            return
        try:
            job.set_result(job.fn())  # type: ignore[attr-defined]
        except Exception as exc:  # a bug: logged here, and handed to a waiting caller
            log.exception("node loop job failed")
            job.set_exception(exc)

    def _drain(self) -> None:
        while True:
            try:
                self._inbox.get_nowait().cancel()
            except queue.Empty:
                return

    def call(self, fn: Callable[[], T], timeout_s: float) -> T:
        """Run ``fn`` on the node loop and return its result (from any other thread).

        Raises:
            TimeoutError: the loop did not run it within ``timeout_s`` (it will not run later).
        """
        job = self._post(fn)
        try:
            return job.result(timeout=timeout_s)
        except futures.TimeoutError:
            job.cancel()
            raise TimeoutError("the node loop is busy") from None

    # -- measurement (issue 31) ------------------------------------------------------------
    def _start_compute(self) -> None:
        """Measure this machine's compute for the model on a ``measure-compute`` thread (cached on disk)."""
        path = self.cfg.model_path
        if not path or not self.cfg.measure:
            return
        cache = self.cfg.measure_dir or os.path.join(os.path.expanduser("~"), ".cache", "mlxcluster", "measure")
        weights = self.cfg.weights or ""

        def work() -> None:
            t0 = time.monotonic()
            got, err = ms.measure_compute(path, weights, self.info.model_digest, self.info.chip, cache,
                                          started=self._measuring.append)
            self._post(lambda: self._on_compute(got, err, time.monotonic() - t0))
        threading.Thread(target=work, daemon=True, name="measure-compute").start()

    def _on_compute(self, got: Optional[ms.Compute], error: str, seconds: float) -> None:
        self._compute, self._compute_error = got, error
        if got is None:
            log.warning("compute measurement: %s (the shape is chosen without this node's figures)", error)
        else:
            log.info("measured compute in %.1f s: one layer %.2f ms per decode token (+%.2f ms per extra sequence), "
                     "head %.2f ms, prefill %.0f tok/s", seconds, got.layer_s * 1e3, got.layer_batch_s * 1e3,
                     got.head_s * 1e3, got.prefill_tokens_per_s)
        self._plan_now = True

    def _queue_link_probes(self, now: float) -> None:
        """Queue a link probe of each live peer whose link is unmeasured or older than ``LINK_TTL_S``
        (a failed probe is tried again after a sixth of it)."""
        if not self.cfg.measure:
            return
        for nid in self._live():
            measured = self._links.get(nid)
            if measured is not None and now - measured[1] < ms.LINK_TTL_S:
                continue
            if now - self._link_tried.get(nid, -1e9) < ms.LINK_TTL_S / 6:
                continue
            self._link_tried[nid] = now
            info = self.peers[nid].info
            self._link_jobs.put((nid, info.address, info.port))

    def _link_worker(self) -> None:
        """The ``measure-links`` thread: one peer's probe at a time (bounded: ``LINK_DEADLINE_S``)."""
        payload = bytes(ms.BULK_BYTES)
        while not self._stop.is_set():
            try:
                nid, address, port = self._link_jobs.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                continue
            channel = self.creds.channel(f"{address}:{port}", node_name(nid))
            stub = pb_grpc.NodeStub(channel)
            try:
                lat, bw = ms.measure_link(lambda n, t: stub.Measure(pb.MeasureRequest(payload=payload[:n]), timeout=t))
                link, err = LinkMeasure(self.cfg.node_id, nid, lat, bw, self._iface), ""
            except (grpc.RpcError, TimeoutError) as exc:
                link = None
                err = describe_rpc_error(exc) if isinstance(exc, grpc.RpcError) else str(exc)
            finally:
                channel.close()
            self._post(lambda nid=nid, link=link, err=err: self._on_link(nid, link, err))

    def _on_link(self, nid: str, link: Optional[LinkMeasure], error: str) -> None:
        if link is None:
            log.debug("link probe of node %s failed: %s", nid, error)
            return
        first = nid not in self._links
        self._links[nid] = (link, time.monotonic())
        if first:
            log.info("link to node %s over %s: %.0f µs, %.0f MB/s", nid, link.interface or "?", link.latency_s * 1e6,
                     link.bandwidth_bytes_per_s / 1e6)
            self._plan_now = True

    def _own_report(self) -> ms.NodeReport:
        now = time.monotonic()
        live = set(self._live())
        links = tuple(lk for nid, (lk, _) in sorted(self._links.items()) if nid in live)
        return ms.NodeReport(self.cfg.node_id, self._memory_usable, self._compute, self.info.chip, self._host,
                             self.cfg.weights or "", links, dict(self._all_sum), self._compute_error,
                             tuple(self._tp_layer[b] for b in sorted(self._tp_layer))), \
            {nid: now - at for nid, (_, at) in self._links.items()}

    def _measure_msg(self) -> pb.NodeMeasureMsg:
        report, ages = self._own_report()
        return ms.to_msg(report, ages)

    def _model_profile(self) -> Optional[ModelProfile]:
        """The model's :class:`ModelProfile` (config read once per model path; ``None``: no model, or
        a config the cost model cannot size)."""
        path = self.cfg.model_path
        if not path:
            return None
        if self._profile is None or self._profile[0] != path:
            try:
                from ..model.loader import inspect_model

                info = inspect_model(path)
                prof: Optional[ModelProfile] = ModelProfile.from_config(
                    info.config, name=info.name, quantization=info.quantization,
                    weights=self.cfg.weights or "float32", kv_bits=self.cfg.kv_bits,
                    kv_group_size=self.cfg.kv_group_size)
            except (ShapeError, OSError, ValueError) as exc:
                log.warning("the shape planner cannot size this model: %s", exc)
                prof = None
            self._profile = (path, prof)
        return self._profile[1]

    def _auto_inputs(self) -> Optional[AutoInputs]:
        """What the shape planner decides from: every live node's measurements (this node's own
        included), those still measuring named ``pending``; ``None`` without a model profile."""
        profile = self._model_profile()
        if profile is None or not self.cfg.measure:
            return None
        me = self.cfg.node_id
        reports = {nid: r for nid, r in self._reports.items()}
        reports[me] = self._own_report()[0]
        ids = (me,) + self._live()
        pending = tuple(n for n in ids if n not in reports or (reports[n].compute is None and not reports[n].error))
        jaccl = all("jaccl" in (self.info.backends if nid == me else self.peers[nid].info.backends)
                    for nid in ids if nid == me or nid in self.peers)
        return AutoInputs(with_jaccl_prior(ms.combine(reports, only=ids), jaccl), profile,
                          Request(context=min(4096, profile.max_positions)), pending)

    def _set_prediction(self, members: Tuple[str, ...], layers: str, mode: str, note: str = "") -> None:
        """Rank 0's node: remember what the shape planner predicts for the formation it forms."""
        self._meter = ms.DecodeMeter()
        self._off_logged = False
        self._plan_for = (members, layers, mode, note)
        auto = self._auto_inputs()
        cand = predicted_for(auto, members, layers) if auto is not None else None
        if cand is None:
            self._plan_msg = pb.PlanMsg(label=f"world size {len(members)}" + (f", route {layers}" if layers else ""),
                                        mode=mode, note=note or "not predicted: measurements missing")
            return
        p = cand.prediction
        self._plan_msg = pb.PlanMsg(label=cand.label, mode=mode, decode_tok_s=p.decode_tok_s, ttft_s=p.ttft_s,
                                    prompt_tokens=auto.request.prompt_tokens, note=note)
        log.info("plan %s (%s): predicted %.1f tok/s decode, TTFT %.2f s for %d tokens%s", cand.label, mode,
                 p.decode_tok_s, p.ttft_s, auto.request.prompt_tokens, f" ({note})" if note else "")

    def _measured(self, reply: pb.InfoReply, now: float) -> None:
        """Rank 0's ``Info``: the measured decode tok/s and TTFT beside the prediction; a prediction
        off by more than ``OFF_BY`` is logged once, with the measurements."""
        msg = self._plan_msg
        if msg is None:
            return
        if not msg.decode_tok_s and isinstance(self.own, Running):  # measurements arrived after the formation
            members, layers, mode, note = self._plan_for
            meter = self._meter
            self._set_prediction(members, layers, mode, note)
            self._meter, msg = meter, self._plan_msg
        self._meter.update(now, int(reply.generated_tokens), int(reply.running))
        tok_s = self._meter.tok_s
        ttft = reply.ttft_seconds_sum / reply.first_tokens if reply.first_tokens else 0.0
        new = pb.PlanMsg()
        new.CopyFrom(msg)
        new.measured_decode_tok_s = tok_s or 0.0
        new.measured_ttft_s = ttft
        self._plan_msg = new
        if tok_s and not self._off_logged and ms.off_by(msg.decode_tok_s, tok_s) > ms.OFF_BY:
            self._off_logged = True
            auto = self._auto_inputs()
            log.warning("plan %s: predicted %.1f tok/s, measured %.1f tok/s (off by %.0f%%); measurements: %s",
                        msg.label, msg.decode_tok_s, tok_s, 100 * ms.off_by(msg.decode_tok_s, tok_s),
                        json.dumps(ms.measurements_json(auto.measurements)) if auto is not None else "none")

    # -- membership (loop thread) ------------------------------------------------------
    def _live(self) -> Tuple[str, ...]:
        return tuple(sorted(nid for nid, p in self.peers.items() if p.status is PeerStatus.LIVE))

    def _set_peer(self, peer: Optional[Peer], node_id: str) -> None:
        before = self._live()
        old = self.peers.get(node_id)
        if peer is None:
            self.peers.pop(node_id, None)
        else:
            self.peers[node_id] = peer
            if peer.status is PeerStatus.LOST and (old is None or old.status is not PeerStatus.LOST):
                log.warning("lost node %s: %s", node_id, peer.reason)
                self._plan_now = True  # a loss is acted on at once, not at the next tick
        if set(self._live()) - set(before):
            # a node joined the live set: let membership settle before forming (nodes starting
            # together); a node lost needs no settling -- the re-formation without it starts at once
            self._changed_at = time.monotonic()

    def _on_advert(self, event: str, info: NodeInfo) -> None:
        old = self.peers.get(info.node_id)
        if event == "removed":
            if old is not None and old.verified and old.status is PeerStatus.LIVE:
                # mDNS goodbyes are unauthenticated (anyone can send one for any name): a node
                # that proved itself stays until its heartbeats stop (PEER_TIMEOUT_S)
                log.info("node %s said goodbye over mDNS; its heartbeats decide whether it left", info.node_id)
                self._set_peer(replace(old, pending=None), info.node_id)
                return
            if old is not None and old.status is not PeerStatus.REFUSED:
                log.info("node %s left (goodbye)", info.node_id)
            self._set_peer(None, info.node_id)
            return
        # a node fetching the model (no digest yet) refuses no peer for its model
        why = refusal(info, self.cfg.node_id, self.info.model_digest or info.model_digest, self.cfg.role)
        new = advertised(old, info, why)
        if new.pending is not None and (old is None or old.pending != new.pending):
            log.warning("node %s is advertised at %s:%d, but proved itself at %s:%d: it moves only once the "
                        "new endpoint proves its node id", info.node_id, info.address, info.port,
                        new.info.address, new.info.port)
        if why and (old is None or old.reason != why):
            log.warning("refusing node %s at %s:%d: %s", info.node_id, info.address, info.port, why)
        elif new.status is PeerStatus.SEEN and (old is None or old.status is not PeerStatus.SEEN):
            log.info("discovered node %s at %s:%d", info.node_id, info.address, info.port)
        self._set_peer(new, info.node_id)

    def _stub(self, peer: Peer) -> pb_grpc.NodeStub:
        where = (peer.info.address, peer.info.port)
        known = self._channels.get(peer.node_id)
        if known is not None and known[0] == where:
            return known[2]
        if known is not None:
            known[1].close()
        # mutual TLS, and the peer must prove the node id it advertises
        channel = self.creds.channel(f"{where[0]}:{where[1]}", node_name(peer.node_id))
        stub = pb_grpc.NodeStub(channel)
        self._channels[peer.node_id] = (where, channel, stub)
        return stub

    def _heartbeat(self) -> None:
        """Send ``Status`` to every peer without one under way, and to every pending endpoint
        (:func:`~mlxcluster.cluster.membership.advertised`); answers arrive in the inbox."""
        for nid, peer in list(self.peers.items()):
            if peer.pending is not None:
                self._probe(peer)
            if peer.status is PeerStatus.REFUSED or nid in self._in_flight:
                continue
            self._in_flight.add(nid)
            self._sent_at[nid] = time.monotonic()
            self._asked_at.setdefault(nid, self._sent_at[nid])
            where = (peer.info.address, peer.info.port)
            call = self._stub(peer).Status.future(pb.NodeStatusRequest(), timeout=RPC_TIMEOUT_S / 2)

            def done(c, nid=nid, where=where):
                at = self._arrived_at[nid] = time.monotonic()
                self._post(lambda: self._on_status(nid, where, c, at))
            call.add_done_callback(done)

    def _rdma_facts(self) -> thunderbolt.RdmaFacts:
        """This node's Thunderbolt ports and RDMA devices: its tools' outputs, or (``join --recorded
        DIR``) the recordings in ``DIR/<node id>`` or ``DIR/<host name>``.

        Raises:
            ValueError: no folder for this node under ``DIR``, or a recording is missing."""
        if not self.cfg.recorded_dir:
            return thunderbolt.local_rdma_facts()
        from ..runtime.netplan import read_recorded_node

        node = read_recorded_node(self.cfg.recorded_dir, (self.cfg.node_id, socket.gethostname().split(".")[0]))
        return thunderbolt.facts_from_outputs(node.system_profiler, node.networksetup, node.ibv_devices, node.ifconfig)

    def _silence_limit(self, node_id: str, now: float) -> float:
        """Seconds of silence after which peer ``node_id`` is lost (:func:`peer_timeout`): the full
        ``--peer-timeout``, shorter for a member of this node's formation while this node's own rank
        has been stuck in one step (its last ``busy_s``, aged since that answer, against its
        ``step_s``), as long as the peer's own heartbeat round trips allow."""
        f = self._formation()
        busy, at, step = self._rank_busy
        peer = self.peers.get(node_id)
        held = peer.report.formation_id if peer is not None and peer.report is not None else ""
        deserted = bool(held) and bool(self._left.get(held, set()) - {node_id})
        return peer_timeout(self.cfg.peer_timeout_s, f is not None and node_id in f.node_ids,
                            busy + (now - at) if busy > 0.0 else 0.0, self._rtt.get(node_id), HEARTBEAT_S, step,
                            deserted=deserted)

    def _note_left(self, node_id: str, before: Optional[PeerReport], after: Optional[PeerReport]) -> None:
        """Record that ``node_id`` left the formation it reported holding a rank in (``before``), now
        that it reports another (``after``); at most ``LEFT_KEPT`` formations are remembered."""
        if before is None or after is None or not before.formation_id or before.state in IDLE_STATES:
            return
        if after.formation_id == before.formation_id and after.state not in IDLE_STATES:
            return
        self._record_left(before.formation_id, node_id)

    def _record_left(self, formation_id: str, node_id: str) -> None:
        """``node_id`` left formation ``formation_id`` (the newest of the ``LEFT_KEPT`` remembered)."""
        self._left.setdefault(formation_id, set()).add(node_id)
        self._left.move_to_end(formation_id)
        while len(self._left) > LEFT_KEPT:
            self._left.popitem(last=False)

    def _silent_since(self, peer: Peer) -> float:
        """:func:`silent_since` of ``peer``: its last answer, not before this node asked late."""
        return silent_since(peer.last_ok, self._asked_at.get(peer.node_id, 0.0), HEARTBEAT_S)

    def _judge_silent_peers(self, now: float) -> None:
        """Peers whose heartbeat is still unanswered (no answer or error arrived since it was sent)
        are judged now against :meth:`_silence_limit`: a frozen peer is lost when its silence passes
        the limit, not when its call gives up."""
        for nid in list(self._in_flight):
            peer = self.peers.get(nid)
            if peer is None or self._arrived_at.get(nid, -1.0) >= self._sent_at.get(nid, 0.0):
                continue  # its answer is in the inbox: _on_status judges it
            judged = heartbeat(peer, None, now, timeout_s=self._silence_limit(nid, now), since=self._silent_since(peer))
            if judged is not peer:
                self._set_peer(judged, nid)

    def _probe(self, peer: Peer) -> None:
        """Ask a peer's pending endpoint to prove the peer's node id (mutual TLS + ``Status``)."""
        info = peer.pending
        key = (peer.node_id, info.address, info.port)
        if key in self._probing:
            return
        self._probing.add(key)
        channel = self.creds.channel(f"{info.address}:{info.port}", node_name(peer.node_id))
        call = pb_grpc.NodeStub(channel).Status.future(pb.NodeStatusRequest(), timeout=RPC_TIMEOUT_S / 2)

        def done(c, info=info, key=key, channel=channel):
            channel.close()
            self._post(lambda: self._on_probe(key, info, c))
        call.add_done_callback(done)

    def _on_probe(self, key: Tuple[str, str, int], info: NodeInfo, call) -> None:
        self._probing.discard(key)
        node_id = key[0]
        peer = self.peers.get(node_id)
        if peer is None or peer.pending != info:
            return
        try:
            reply = call.result()
        except (grpc.RpcError, grpc.FutureCancelledError) as exc:
            log.debug("pending endpoint %s:%d of node %s did not prove it: %s", info.address, info.port, node_id,
                      describe_rpc_error(exc) if isinstance(exc, grpc.RpcError) else "cancelled")
            return
        if reply.node_id != node_id:
            return
        log.info("node %s moved to %s:%d (proved its node id there)", node_id, info.address, info.port)
        self._set_peer(proved(peer, info, PeerReport(state=reply.state, formation_id=reply.formation_id,
                                                        rank0_address=reply.rank0_address),
                              time.monotonic()), node_id)

    def _on_status(self, node_id: str, where: Tuple[str, int], call, at: float) -> None:
        self._in_flight.discard(node_id)
        peer = self.peers.get(node_id)
        if peer is None or (peer.info.address, peer.info.port) != where:
            return
        refused = False
        try:
            reply = call.result()
            report = PeerReport(state=reply.state, formation_id=reply.formation_id, rank0_address=reply.rank0_address)
        except grpc.FutureCancelledError:
            report = None
        except grpc.RpcError as exc:
            report = None
            refused = exc.code() == grpc.StatusCode.UNAVAILABLE and "connection refused" in (exc.details() or "").lower()
            if handshake_failed(exc) and peer.status is not PeerStatus.LIVE:
                why = describe_rpc_error(exc)
                if peer.reason != why:
                    log.warning("node %s at %s:%d does not prove the cluster secret and its node id: %s",
                                node_id, where[0], where[1], why)
                    self._set_peer(replace(peer, reason=why), node_id)
                return
        if report is not None and reply.HasField("measure"):
            self._reports[node_id] = ms.from_msg(node_id, reply.measure)
        was, before = peer.status, peer.report
        if report is not None and node_id in self._sent_at:
            self._rtt[node_id] = self._rtt.get(node_id, RttEstimate()).update(at - self._sent_at[node_id])
        if report is not None:
            self._asked_at.pop(node_id, None)
        peer = heartbeat(peer, report, at, refused=refused, timeout_s=self._silence_limit(node_id, at),
                         since=self._silent_since(peer))
        self._note_left(node_id, before, report)
        if report is not None and report != before:
            self._plan_now = True  # e.g. a member idle after its teardown: the next formation need not wait a tick
        if peer.status is PeerStatus.LIVE and was is PeerStatus.LOST:
            log.info("node %s is back", node_id)
        self._set_peer(peer, node_id)

    # -- the loop ------------------------------------------------------------------------
    def _probe_own_rank(self, now: float) -> None:
        """Ask this node's running rank process whether it is alive (rank 0: ``Generation.Info``,
        rank N: ``RankControl.Health``, both answered off its MLX thread); one left
        unanswered for ``RANK_STUCK_S`` makes the rank failed."""
        own = self.own
        remote_started = isinstance(own, Bootstrapping) and own.formation.backend == "mpi" and own.rank > 0 \
            and self._ranks is not None  # mpirun started it here: its events go to rank 0's node
        if not isinstance(own, Running) and not remote_started:
            return
        if isinstance(own, Running) and now - self._rank_ok_at > RANK_STUCK_S:
            self._set_own(Failed(own.formation, own.rank, own.since,
                                 f"rank {own.rank} process answered nothing for {now - self._rank_ok_at:.0f} s "
                                 "(stuck or frozen)"))
            return
        if self._rank_probing:
            return
        seq = self._rank_seq
        if self._rank_probe is None or self._rank_probe[0] != seq:
            if self._rank_probe is not None:
                self._rank_probe[1].close()
            m = own.formation.members[own.rank]
            self._rank_probe = (seq, self.creds.channel(f"{m.address}:{m.control_port}"))
        channel = self._rank_probe[1]
        if own.rank == 0:
            call = pb_grpc.GenerationStub(channel).Info.future(pb.InfoRequest(), timeout=RPC_TIMEOUT_S)
        else:
            call = pb_grpc.RankControlStub(channel).Health.future(pb.HealthRequest(), timeout=RPC_TIMEOUT_S)
        self._rank_probing = True
        call.add_done_callback(lambda c: self._post(lambda: self._on_own_rank_probe(seq, c)))

    def _on_own_rank_probe(self, seq: int, call) -> None:
        self._rank_probing = False
        if seq != self._rank_seq:
            return
        try:
            reply = call.result()
        except (grpc.RpcError, grpc.FutureCancelledError):
            return
        self._rank_ok_at = time.monotonic()
        self._rank_busy = (reply.busy_s, self._rank_ok_at, reply.step_s)
        if isinstance(reply, pb.InfoReply):  # rank 0: is a request running or queued?
            self._rank0_idle = reply.running == 0 and reply.queued == 0
            self._measured(reply, self._rank_ok_at)
        own = self.own
        if isinstance(own, Bootstrapping):  # an MPI rank started by mpirun: it serves, so it is ready
            log.info("rank %d ready (answers at its control port)", own.rank)
            self._set_own(Running(own.formation, own.rank, own.since))

    def _tick(self) -> None:
        self._heartbeat()
        now = time.monotonic()
        self._judge_silent_peers(now)
        if not self.cfg.model_path:  # join --fetch-model: no formation before the model is here
            self._fetch_model(now)
            return
        self._set_own(ranks.after_start_timeout(self.own, now))
        self._queue_link_probes(now)
        self._probe_own_rank(now)
        self._warm_spare()
        self._keep_standby(now)
        self._plan(now)

    def _plan(self, now: float) -> None:
        """Ask the planner what to do now and do it; after a teardown, ask again at once (its next
        step, e.g. forming without the lost node, need not wait for the next tick)."""
        if not self.cfg.model_path:
            return
        action = plan(PlanInputs(
            node_id=self.cfg.node_id, world_size=self.cfg.world_size,
            valid_world_sizes=tuple(self.cfg.valid_world_sizes), own=self.own, peers=dict(self.peers), now=now,
            changed_at=self._changed_at, retry_at=self._retry_at, announced=self._announced,
            layers=self.cfg.layers, n_layers=self.cfg.n_layers, memory_bytes=self.info.memory_bytes,
            role=self.cfg.role, spare=self.cfg.spare, last_world_size=self._last_world_size,
            rank0_idle=self._rank0_idle, started_at=self._started_at,
            auto=self._auto_inputs() if self.cfg.plan == "auto" else None,
            exact_world_size=self.cfg.exact_world_size))
        self._apply(action, now)
        if isinstance(action, Teardown):
            self._plan_now = True

    def _apply(self, action, now: float) -> None:
        """Carry out the planner's ``action`` (decided at ``now``)."""
        if isinstance(action, Wait):
            if action.reason != self._waiting:
                log.info("waiting: %s", action.reason)
                self._waiting = action.reason
            return
        self._waiting = ""
        if isinstance(action, Teardown):
            if action.backoff and self._announced:
                # it formed and served: a member failed under it -- re-form at once, no back-off
                log.warning("formation lost (%s); tearing down", action.reason)
            elif action.backoff:  # it never formed: back off before the next attempt (1, 2, 4 ... 30 s)
                log.warning("formation failed (%s); tearing down", action.reason)
                self._retry_at = now + min(30.0, 2.0 ** max(0, self._attempts - 1))
            held = self._formation()
            self._teardown_local(action.reason)
            if action.tell_members and held is not None:
                self._broadcast_teardown(action.reason, held.formation_id)
            self._heartbeat()  # the peers' states now (who else let go), not at the next tick
            self._fast_until = time.monotonic() + FAST_TICKS_FOR_S  # ... and again soon
        elif isinstance(action, Announce):
            f = action.formation
            log.info("cluster %r formed: world size %d, backend %s, rank 0 at %s", self.cfg.cluster,
                     f.world_size, f.backend, f.rank0_address)
            self._attempts = 0
            self._announced = True
            self._advertise("formed")
        elif isinstance(action, Form):
            if action.warning:
                log.warning("%s", action.warning)
            self._form(action.members, action.layers, action.role, action.prefill_peer, action.shape, action.note,
                       action.draft_peer)

    # -- join --spare -------------------------------------------------------------------
    def _warm_spare(self) -> None:
        """A spare's pre-load: once per model path, while it holds no rank, read the model's files
        into the OS page cache (a ``spare-warm`` thread, at most half the memory available now), so
        that taking a lost member's place loads warm."""
        path = self.cfg.model_path
        if not self.cfg.spare or not path or self._warmed == path or self._formation() is not None:
            return
        self._warmed = path
        import psutil

        limit = min(self._model_bytes(), psutil.virtual_memory().available // 2)

        def work() -> None:
            t0 = time.monotonic()
            done = ranks.warm_page_cache(path, limit, stop=self._stop.is_set)
            log.info("spare: read %.1f of %.1f MB of the model into the page cache in %.1f s", done / 1e6,
                     self._model_bytes() / 1e6, time.monotonic() - t0)
        threading.Thread(target=work, daemon=True, name="spare-warm").start()

    def _keep_standby(self, now: float) -> None:
        """Keep one standby rank process (:class:`~mlxcluster.runtime.standby.Standby`) started ahead,
        for the next formation's bootstrap to adopt: started once this node has held no formation,
        or its rank has served, for :data:`STANDBY_DELAY_S` -- never while a rank of it starts, nor
        right after (it would take the CPU that a formation's start and the requests replayed onto
        it need; nodes started together form within seconds) -- and, after one exited by itself,
        not before :data:`STANDBY_RETRY_S`.  Only where a formation would adopt it: ``--backend
        ring``/``jaccl``, or ``auto`` on a node without a usable OpenMPI (with one, ``auto`` picks
        MPI, whose ranks ``mpirun`` starts)."""
        useful = self.cfg.backend in ("ring", "jaccl") or (self.cfg.backend == "auto"
                                                           and "mpi" not in self.info.backends)
        if not self.cfg.standby or not useful or not self.cfg.model_path or self._stop.is_set():
            return
        standby = self._standby
        if standby is not None and standby.alive():
            return
        if standby is not None and standby.exited.is_set():
            log.warning("standby rank process: %s", standby.process.exit_line())
            self._standby_at = now + STANDBY_RETRY_S
        self._standby = None
        kind = type(self.own)
        if kind is not self._standby_seen[0]:
            self._standby_seen = (kind, now)
        # idle or serving for STANDBY_DELAY_S: not while a formation starts (nodes starting together
        # form within seconds) nor right after one served (its replayed requests need the CPU)
        if now < self._standby_at or kind not in (Idle, Running) or now - self._standby_seen[1] < STANDBY_DELAY_S:
            return
        try:
            self._standby = Standby(self.cfg.model_path, {"MLXCLUSTER_SECRET": self.cfg.secret,
                                                          "MLXCLUSTER_CLUSTER": self.cfg.cluster})
        except OSError as exc:
            log.warning("cannot start a standby rank process: %s", exc)
            self._standby_at = now + STANDBY_RETRY_S

    # -- join --fetch-model ------------------------------------------------------------
    def _fetch_model(self, now: float) -> None:
        """Fetch the model from a verified live peer that advertises one (a thread; the result comes
        back to the loop through :meth:`_fetched`); says what it waits for."""
        if self._fetching is not None or now < self._fetch_retry_at:
            return
        holders = sorted(nid for nid, p in self.peers.items() if p.status is PeerStatus.LIVE and p.verified
                         and p.info.model_digest and p.info.role != "draft")  # a draft node holds another model
        if not holders:
            why = "no peer holding the model is live yet (join --fetch-model)"
            if why != self._waiting:
                log.info("waiting: %s", why)
                self._waiting = why
            return
        peer = self.peers[holders[0]]
        self._fetching = peer.info.node_id
        address = f"{peer.info.address}:{peer.info.port}"
        channel = self.creds.channel(address, node_name(peer.info.node_id))
        log.info("fetching model %s from node %s at %s into %s", peer.info.model_digest, peer.info.node_id, address,
                 self.cfg.fetch_dir)
        threading.Thread(target=self._fetch_thread, args=(channel, peer.info.model_digest), daemon=True,
                         name="model-fetch").start()

    def _fetch_thread(self, channel: grpc.Channel, digest: str) -> None:
        from .transfer import ModelTransferError, fetch_model

        t0, shown, base = time.monotonic(), [-1], [None]  # base: bytes already here when it started
        source = self._fetching or ""

        def progress(done: int, total: int) -> None:  # the first call comes before any chunk
            if base[0] is None:
                base[0] = done
                if done:
                    log.info("resuming the model transfer at %.1f of %.1f MB (kept from an interrupted fetch)",
                             done / 1e6, total / 1e6)
            rate = (done - base[0]) / max(1e-6, time.monotonic() - t0)  # bytes/s of this fetch
            self.fetch_progress = {"state": "fetching", "from": source, "done_bytes": done, "total_bytes": total,
                                   "bytes_per_s": round(rate), "error": ""}
            pct = int(100 * done / max(1, total))
            if pct // 10 != shown[0] // 10 or done == total:
                shown[0] = pct
                log.info("fetching the model: %d%% (%.1f of %.1f MB, %.1f MB/s)", pct, done / 1e6, total / 1e6,
                         rate / 1e6)

        try:
            path, err = fetch_model(channel, self.cfg.fetch_dir, progress=progress, expect_digest=digest), ""
        except (ModelTransferError, OSError) as exc:
            path, err = "", str(exc)
        finally:
            channel.close()
        self._post(lambda: self._fetched(path, err))

    def _fetched(self, path: str, error: str) -> None:
        self._fetching = None
        if self.fetch_progress is not None:
            self.fetch_progress = dict(self.fetch_progress, state="failed" if error else "verified", error=error)
        if error:
            log.warning("fetching the model failed: %s; trying again in 5 s (what arrived is kept)", error)
            self._fetch_retry_at = time.monotonic() + 5.0
            return
        if self.cfg.configure_model is not None:
            for key, value in self.cfg.configure_model(path).items():
                setattr(self.cfg, key, value)
        self.cfg.model_path = path
        self.share.model_path = path
        self.info = replace(self.info, model_digest=model_digest(path))
        log.info("model %s fetched and verified: %s", self.info.model_digest, path)
        self._start_compute()
        try:
            self.discovery.update(model_digest=self.info.model_digest)
        except Exception:
            log.warning("advertising the model digest failed", exc_info=True)
        for nid, p in list(self.peers.items()):  # peers of another model are refused from now on
            why = refusal(p.info, self.cfg.node_id, self.info.model_digest, self.cfg.role)
            if why:
                self._set_peer(advertised(p, p.info, why), nid)
        self._changed_at = time.monotonic()

    def _form(self, members: Tuple[str, ...], layers: str = "", role: str = "", prefill_peer: str = "",
              shape: str = "", note: str = "", draft_peer: str = "") -> None:
        self._attempts += 1
        fid = uuid.uuid4().hex[:12]
        me = self.cfg.node_id
        log.info("forming cluster %r: world size %d with %s (formation %s)%s%s", self.cfg.cluster, len(members),
                 ", ".join(members), fid, f", pipeline route {layers}" if layers else "",
                 (f", {role} group" + (f" of the prefill group at {prefill_peer}" if prefill_peer else "")
                  if role else "")
                 + (f", drafting with the draft node's group at {draft_peer}" if draft_peer else ""))
        req = pb.PrepareRequest(protocol_version=PROTOCOL_VERSION, formation_id=fid,
                                coordinator_id=me)
        replies: List[pb.PrepareReply] = []
        for nid in members:
            try:
                rep = self.prepare(fid) if nid == me else self._stub(self.peers[nid]).Prepare(req, timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as exc:
                log.warning("node %s did not prepare: %s", nid, exc.details())
                return
            if not rep.ok:
                log.warning("node %s refused to prepare: %s", nid, rep.error)
                return
            if nid != me and rep.HasField("measure"):  # the measurements, as of the formation's start
                self._reports[nid] = ms.from_msg(nid, rep.measure)
            replies.append(rep)
        try:
            facts = [ranks.rdma_facts(rep.rdma) for rep in replies]
            backend, reason, devices = ranks.pick_backend(
                self.cfg.backend,
                [bk.RankEndpoint(rank=r, address=rep.address, ring_port=rep.ring_port, control_port=rep.control_port,
                                 hostname=nid, backends=list(rep.backends)) for r, (nid, rep) in
                 enumerate(zip(members, replies))], facts)
        except ValueError as exc:
            log.error("cannot form: %s", exc)
            self._retry_at = time.monotonic() + 30
            return
        wires = ranks.data_plane(backend, facts, [f"rank {r} ({nid})" for r, nid in enumerate(members)])
        reason = f"{reason}; {wires.note}" if wires.note else reason
        log.info("backend %s: %s", backend, reason)
        self._set_prediction(tuple(members), layers, "auto" if shape else "manual", note)
        formation = Formation(
            formation_id=fid, coordinator_id=me, backend=backend, model_digest=self.info.model_digest,
            weights=self.cfg.weights or "", backend_reason=reason,
            jaccl_devices_json=json.dumps(devices) if devices else "", layers=layers, role=role,
            prefill_peer=prefill_peer, draft_peer=draft_peer,
            kv_bits=self.cfg.kv_bits, kv_group_size=self.cfg.kv_group_size if self.cfg.kv_bits else 0,
            ring_hosts_json=wires.ring_hosts_json, jaccl_ring=wires.jaccl_ring,
            members=tuple(Member(rank=r, node_id=nid, address=rep.address, ring_port=rep.ring_port,
                                 control_port=rep.control_port) for r, (nid, rep) in enumerate(zip(members, replies))))
        # Members first, rank 0 (this node) last: with MPI, rank 0's mpirun asks each member's
        # node to start its daemon, which the member only does once it holds the formation.
        for rank in list(range(1, len(members))) + [0]:
            nid = members[rank]
            breq = formation.to_bootstrap(rank)
            try:
                rep = self.bootstrap(breq) if nid == me else \
                    self._stub(self.peers[nid]).Bootstrap(breq, timeout=RPC_TIMEOUT_S * 2)
            except grpc.RpcError as exc:
                rep = pb.BootstrapReply(ok=False, error=exc.details() or str(exc.code()))
            if not rep.ok:
                log.warning("node %s refused bootstrap: %s", nid, rep.error)
                self._teardown_local("bootstrap refused")
                self._broadcast_teardown("bootstrap refused", fid)
                self._retry_at = time.monotonic() + 5
                return

    def _broadcast_teardown(self, reason: str, formation_id: str) -> None:
        """Ask every live peer to tear down ``formation_id``."""
        req = pb.TeardownRequest(formation_id=formation_id, reason=reason)
        for nid in self._live():
            try:
                self._stub(self.peers[nid]).Teardown(req, timeout=RPC_TIMEOUT_S)
            except grpc.RpcError:
                pass

    # -- own state and the rank process (loop thread) ----------------------------------------
    def _set_own(self, own: OwnState) -> None:
        if own is self.own:
            return
        if isinstance(own, Failed) and not isinstance(self.own, Failed):
            log.error("rank %d process failed: %s", own.rank, own.error)
        if isinstance(own, Running) and not isinstance(self.own, Running):
            self._rank_ok_at = time.monotonic()  # the liveness probe's clock starts at ready
        was = self._formation()
        self.own = own
        now = self._formation()
        if was is not None and (now is None or now.formation_id != was.formation_id):  # this node left it
            self._record_left(was.formation_id, self.cfg.node_id)

    def _formation(self) -> Optional[Formation]:
        return self.own.formation if isinstance(self.own, (Bootstrapping, Running, Failed)) else None

    def _on_rank_event(self, seq: int, event: dict) -> None:
        if seq != self._rank_seq:
            return
        kind = event.get("event")
        if isinstance(event.get("rank"), int) and isinstance(self.own, (Bootstrapping, Running)) \
                and event["rank"] != self.own.rank and kind != "error":
            return  # another rank's progress (mpirun carries every rank's output to rank 0's node)
        if kind == "loaded" and event.get("all_sum_us") and isinstance(self.own, (Bootstrapping, Running)):
            try:
                us = float(event["all_sum_us"])
            except (TypeError, ValueError):
                us = 0.0
            if us > 0 and self.own.formation.world_size > 1:  # the backend's measured all_sum (issue 31)
                self._all_sum[self.own.formation.backend] = us
            def figure(name: str) -> float:
                try:
                    x = float(event.get(name) or 0.0)
                except (TypeError, ValueError):
                    return 0.0
                return x if 0 < x < float("inf") else 0.0
            f = self.own.formation
            layer_us, prefill_us = figure("tp_layer_us"), figure("tp_prefill_layer_us")
            if layer_us and f.world_size > 1:  # a TP formation's layer, in a real step's rhythm
                self._tp_layer[f.backend] = TpLayerMeasure(
                    f.backend, tuple(m.node_id for m in f.members), layer_us * 1e-6, prefill_us * 1e-6,
                    int(figure("tp_prefill_tokens")) if prefill_us else 0)
        if kind == "loaded" and event.get("all_sum_us"):
            log.info("rank %s: loaded in %.2f s (%.2f s of it waiting for its tokenizer) + %.2f s all_sum probe "
                     "(all_sum of a decode-sized tensor: %.0f µs over %s)", event.get("rank"), event.get("load_s", 0.0),
                     event.get("tokenizer_wait_s", 0.0), event.get("probe_s", 0.0), event["all_sum_us"], self.own.formation.backend
                     if isinstance(self.own, (Bootstrapping, Running)) else "?")
        elif kind == "loading" and "init_s" in event:
            log.info("rank %s: loading (group init %.2f s)", event.get("rank"), event["init_s"])
        elif kind == "init" and "start_s" in event:
            log.info("rank process started (%.2f s of imports and credentials)", event["start_s"])
        elif kind in ("loading", "loaded", "connecting"):
            log.info("rank %s: %s", event.get("rank"), kind)
        elif kind == "ready":
            log.info("rank %s ready at %s", event.get("rank"), event.get("address"))
        self._set_own(ranks.after_event(self.own, event))

    def _on_rank_exit(self, seq: int, proc: RankProcess) -> None:
        if seq == self._rank_seq:
            self._set_own(ranks.after_exit(self.own, proc.exit_line()))

    def _advertise(self, state: str) -> None:
        if state != self._advertised:
            self._advertised = state
            try:
                self.discovery.update(state=state)
            except Exception:
                log.debug("advertising state %s failed", state, exc_info=True)

    def _teardown_local(self, reason: str) -> None:
        supervisor, self._ranks = self._ranks, None
        self._rank_seq += 1
        self._rank_busy = (0.0, 0.0, 0.0)
        if self._exec is not None:
            self._exec.put(None)  # the Exec call ends (its orted is stopped below)
            self._exec = None
        had = self._formation() is not None
        self.own = Idle(reason if had else "")
        self._rank0_idle = False
        if had:  # not a bootstrap's own teardown of a preparing node: the coordinator's prediction stays
            self._plan_msg = None
        if supervisor is not None:
            supervisor.stop(timeout_s=0)  # SIGKILL: a rank may be stuck in a collective
        if had:
            log.warning("tore down rank process: %s", reason)
            self._advertise("idle")

    # -- Node service operations (run on the loop; requests already checked) ---------------------
    def prepare(self, formation_id: str) -> pb.PrepareReply:
        """Reserve ring and control ports for ``formation_id`` (tearing down another formation)."""
        held = self._formation()
        if held is not None and held.formation_id != formation_id:
            self._teardown_local(f"re-forming ({formation_id})")
        if self._formation() is None:
            self.own = Preparing(formation_id)
        ring_port, control_port = free_ports(2, self.cfg.address)  # distinct, below the ephemeral range
        return pb.PrepareReply(ok=True, address=self.cfg.address, ring_port=ring_port,
                               control_port=control_port, node_id=self.cfg.node_id,
                               backends=self.info.backends, rdma=ranks.rdma_msg(self.rdma),
                               measure=self._measure_msg())

    def bootstrap(self, request: pb.BootstrapRequest) -> pb.BootstrapReply:
        """Become rank ``request.rank`` of the formation in ``request`` and start its process."""
        formation = Formation.from_bootstrap(request)
        mine = self._route_mismatch(formation, request.rank)
        if not mine and formation.role != self.cfg.role:
            mine = (f"formation {formation.formation_id} is a {formation.role or 'plain'} group, this node was "
                    f"started with {'--role ' + self.cfg.role if self.cfg.role else 'no --role'}")
        if mine:
            return pb.BootstrapReply(ok=False, error=mine)
        self._teardown_local("new formation")
        self.own = Bootstrapping(formation, request.rank, since=time.monotonic())
        self._last_world_size = formation.world_size
        self._announced = False
        log.info("bootstrap: rank %d of %d, backend %s, formation %s (coordinator %s)", request.rank,
                 request.world_size, request.backend, request.formation_id, request.coordinator_id)
        seq = self._rank_seq
        try:
            self._ranks = ranks.start_rank(
                formation, request.rank, bind=self.cfg.address, model_path=self.cfg.model_path,
                secret=self.cfg.secret, cluster=self.cfg.cluster, workdir=os.path.join(self._tmp, formation.formation_id),
                node_endpoints=self._node_endpoints(formation), standby=self._standby,
                prompt_cache=(self.cfg.prompt_cache_dir, self.cfg.prompt_cache_size),
                on_event=lambda event: self._post(lambda: self._on_rank_event(seq, event)),
                on_exit=lambda proc: self._post(lambda: self._on_rank_exit(seq, proc)))
            if self._standby is not None and self._standby.adopted:
                log.info("rank %d: a standby rank process took it (pid %d)", request.rank, self._standby.process.pid)
                self._standby = None
        except (OSError, ValueError) as exc:
            error = f"cannot start rank process: {exc}"
            self._set_own(Failed(formation, request.rank, self.own.since, error))
            return pb.BootstrapReply(ok=False, error=error)
        return pb.BootstrapReply(ok=True)

    def _route_mismatch(self, formation: Formation, rank: int) -> str:
        """Why this node cannot be rank ``rank`` of ``formation``'s pipeline route ("": it can):
        it must hold the range it advertised (or ``auto``), and a TP node joins no pipeline."""
        ranges = formation.layers.split(",") if formation.layers else []
        if ranges and not self.cfg.layers and self.cfg.plan == "auto" and not self.cfg.world_size:
            return ""  # join --plan auto: the coordinator chose a pipeline by measurement
        if bool(ranges) != bool(self.cfg.layers):
            return (f"formation {formation.formation_id} is {'a pipeline' if ranges else 'tensor-parallel'}, "
                    f"this node was started {'without' if ranges else 'with'} --layers")
        if not ranges or self.cfg.layers.strip() == "auto":
            return ""
        if not 0 <= rank < len(ranges):
            return f"rank {rank} is outside the route {formation.layers}"
        from ..model.layout import LayoutError, parse_range

        try:
            if parse_range(ranges[rank], self.cfg.n_layers) != parse_range(self.cfg.layers, self.cfg.n_layers):
                return f"the route gives rank {rank} layers {ranges[rank]}, this node serves {self.cfg.layers}"
        except LayoutError as exc:
            return str(exc)
        return ""

    def _node_endpoints(self, formation: Formation) -> List[str]:
        """``"ip:port"`` of each member's ``Node`` service ("" for a peer this node does not know)."""
        out = []
        for m in formation.members:
            if m.node_id == self.cfg.node_id:
                out.append(f"{self.cfg.address}:{self.cfg.port}")
            else:
                peer = self.peers.get(m.node_id)
                out.append(f"{peer.info.address}:{peer.info.port}" if peer is not None else "")
        return out

    def start_exec(self, formation_id: str, argv: List[str], out: "queue.SimpleQueue") -> str:
        """``Node.Exec``: start OpenMPI's daemon for this node's MPI rank of ``formation_id``;
        its output lines and finally its exit code go to ``out`` (``None``: torn down).
        Returns ``""``, or why not."""
        own = self.own
        if not isinstance(own, Bootstrapping) or own.formation.formation_id != formation_id:
            return f"this node holds no starting rank of formation {formation_id}"
        if own.formation.backend != "mpi" or own.rank == 0 or self._ranks is not None:
            return f"rank {own.rank} of formation {formation_id} is not waiting for mpirun"
        try:
            cmd = mpi_agent.orted_argv(argv)
        except ValueError as exc:
            return str(exc)
        seq = self._rank_seq

        def on_exit(proc: RankProcess) -> None:
            out.put(("exit", proc.returncode))
            self._post(lambda: self._on_rank_exit(seq, proc))
        log.info("mpirun of formation %s starts rank %d's daemon here", formation_id, own.rank)
        try:
            self._ranks = ranks.start_orted(
                cmd, secret=self.cfg.secret, cluster=self.cfg.cluster, model_path=self.cfg.model_path,
                prompt_cache=(self.cfg.prompt_cache_dir, self.cfg.prompt_cache_size), on_output=lambda stream, line: out.put((stream, line)), on_exit=on_exit)
        except OSError as exc:
            return f"cannot start orted: {exc}"
        self._exec = out
        return ""

    def exec_ended(self, out: "queue.SimpleQueue") -> None:
        """The ``Exec`` call that owns ``out`` ended: if its daemon still runs (mpirun's agent
        went away), stop it; the rank has failed either way."""
        if self._exec is not out:
            return
        self._exec = None
        own = self.own
        if isinstance(own, (Bootstrapping, Running)):
            if self._ranks is not None:
                self._ranks.stop(timeout_s=0)
            self._set_own(Failed(own.formation, own.rank, own.since, "mpirun's launch agent disconnected"))

    def teardown(self, formation_id: str, reason: str) -> None:
        """Tear down ``formation_id`` (``""``: whatever this node holds or prepares)."""
        held = self._formation()
        if held is not None and formation_id in ("", held.formation_id):
            self._teardown_local(reason)
        elif isinstance(self.own, Preparing) and formation_id in ("", self.own.formation_id):
            self.own = Idle(reason)

    def status(self) -> pb.NodeStatusReply:
        """The last published ``Status`` answer (any thread; never changed after publishing)."""
        return self._snapshot

    def view(self) -> Dict[str, object]:
        """What the node's dashboard shows (:mod:`mlxcluster.cluster.dashboard`); any thread: the
        loop publishes a new dict after every step and never changes a published one.

        Keys: ``node_id``, ``cluster``, ``address``, ``state`` (this node's wire state), ``error``,
        ``waiting`` (what formation waits for), ``model``/``model_path``/``model_digest`` (empty while
        ``--fetch-model`` fetches), ``spare`` (``join --spare``), ``formation`` (``None``, or ``formation_id``, ``world_size``,
        ``backend``, ``rank0_address``, ``rank`` (this node's), ``layers``, ``draft_peer`` and ``members``: rank,
        node_id, address), ``peers`` (each: node_id, address, ``status`` seen/live/refused/lost, its
        reported ``state``, ``reason``, ``model_digest``, ``layers``, ``role``, ``spare``, ``last_seen_s`` since
        its last answered heartbeat or ``None``) and ``fetch`` (:attr:`fetch_progress`)."""
        return self._view

    def _view_of(self) -> Dict[str, object]:
        own, f, now = self.own, self._formation(), time.monotonic()
        formation = None
        if f is not None:
            formation = {"formation_id": f.formation_id, "world_size": f.world_size, "backend": f.backend,
                         "rank0_address": f.rank0_address, "rank": own.rank, "layers": f.layers,
                         "draft_peer": f.draft_peer,
                         "members": [{"rank": m.rank, "node_id": m.node_id, "address": m.address}
                                     for m in f.members]}
        peers = [{"node_id": nid, "address": f"{p.info.address}:{p.info.port}", "status": p.status.value,
                  "state": p.report.state if p.report is not None else "", "reason": p.reason,
                  "model_digest": p.info.model_digest, "layers": p.info.layers, "role": p.info.role,
                  "spare": p.info.spare, "last_seen_s": round(now - p.last_ok, 2) if p.last_ok else None}
                 for nid, p in sorted(self.peers.items())]
        path = self.cfg.model_path
        return {"node_id": self.cfg.node_id, "cluster": self.cfg.cluster,
                "address": f"{self.cfg.address}:{self.cfg.port}", "state": wire_state(own),
                "error": own.error if isinstance(own, Failed) else own.reason if isinstance(own, Idle) else "",
                "waiting": "" if isinstance(own, Running) else self._waiting,
                "model": os.path.basename(os.path.normpath(path)) if path else "", "model_path": path,
                "model_digest": self.info.model_digest, "layers": self.cfg.layers, "role": self.cfg.role,
                "spare": self.cfg.spare, "formation": formation, "peers": peers, "fetch": self.fetch_progress,
                "plan": ms.plan_view(self._plan_msg)}

    def _coordinator(self) -> str:
        live = self._live()
        spares = [nid for nid in live if self.peers[nid].info.spare] + ([self.cfg.node_id] if self.cfg.spare else [])
        return coordinator_id(self.cfg.node_id, live, spares)

    def _model_bytes(self) -> int:
        """Total size of the model's files (0: no model yet); cached per model path."""
        path = self.cfg.model_path
        if not path:
            return 0
        if self._sized[0] != path:
            from .transfer import model_files

            base = path if os.path.isdir(path) else os.path.dirname(path)
            try:
                size = sum(os.path.getsize(os.path.join(base, rel)) for rel in model_files(path))
            except OSError:
                size = 0
            self._sized = (path, size)
        return self._sized[1]

    def _status_reply(self) -> pb.NodeStatusReply:
        own = self.own
        f = self._formation()
        reply = pb.NodeStatusReply(
            node_id=self.cfg.node_id, cluster=self.cfg.cluster, state=wire_state(own),
            model=os.path.basename(self.cfg.model_path), protocol_version=PROTOCOL_VERSION,
            error=own.error if isinstance(own, Failed) else own.reason if isinstance(own, Idle) else "",
            coordinator_id=self._coordinator(), waiting=self._waiting, spare=self.cfg.spare,
            layers=self.cfg.layers, role=self.cfg.role, model_digest=self.info.model_digest,
            model_bytes=self._model_bytes(), measure=self._measure_msg())
        if self._plan_msg is not None:
            reply.plan.CopyFrom(self._plan_msg)
        fetch = self.fetch_progress
        if fetch is not None:
            reply.fetch_state, reply.fetch_from = str(fetch["state"]), str(fetch["from"])
            reply.fetch_done_bytes, reply.fetch_total_bytes = int(fetch["done_bytes"]), int(fetch["total_bytes"])
        if f is not None:
            reply.formation_id = f.formation_id
            reply.rank = own.rank
            reply.world_size = f.world_size
            reply.backend = f.backend
            reply.backend_reason = f.backend_reason
            reply.coordinator_id = f.coordinator_id
            reply.rank0_address = f.rank0_address
            reply.prefill_peer = f.prefill_peer
            reply.draft_peer = f.draft_peer
            reply.members.extend(Formation.endpoint_msg(m) for m in f.members)
        return reply

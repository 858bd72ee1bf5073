"""The node daemon behind ``mlxcluster join``.

Each node advertises itself over mDNS (:mod:`mlxcluster.cluster.discovery`),
watches its peers, and serves the ``Node`` gRPC service.  Formation:

1. *Membership.*  A peer counts when its TXT record is of the same cluster,
   protocol version and model digest, its auth tag verifies with our secret,
   and it answers ``Status`` (the heartbeat, every ``HEARTBEAT_S``).  A peer
   that misses heartbeats for ``PEER_TIMEOUT_S`` or says goodbye is gone.
2. *Coordinator.*  The live node with the smallest node id (deterministic:
   every node computes the same answer from the same membership).
3. *Formation.*  Once the wanted world size is present (``--world-size N``, or
   the largest size the model splits into) and membership has been stable for
   ``SETTLE_S``, the coordinator asks each chosen member to ``Prepare`` (pick
   ring and control ports), picks the backend, and sends each a ``Bootstrap``
   with its rank and every rank's endpoints.  Ranks: the coordinator is rank
   0, the others follow in node-id order.
4. *Rank process.*  Each member starts ``python -m mlxcluster.runtime.rank``
   with its backend's environment and supervises it (it dies with the daemon:
   ``PR_SET_PDEATHSIG``).
5. *Loss.*  When a member or the coordinator is lost, or a rank process exits,
   every survivor tears its rank process down (an MLX group cannot be rebuilt
   inside a live process) and the coordinator re-forms with the remaining
   nodes if the model can be split that way; otherwise it waits.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import grpc

from ..protocol import mlxcluster_pb2 as pb
from ..protocol import mlxcluster_pb2_grpc as pb_grpc
from ..protocol.frames import secrets_match
from ..runtime.blas import rank_environment
from ..runtime.rank import parse_event
from . import backends as bk
from .discovery import PROTOCOL_VERSION, Discovery, NodeInfo, auth_tag, local_node_facts, verify_auth

log = logging.getLogger("mlxcluster.node")

__all__ = ["NodeDaemon", "NodeConfig", "model_digest", "default_node_id"]

HEARTBEAT_S = 0.5
PEER_TIMEOUT_S = 3.0
SETTLE_S = 2.0
RANK_START_TIMEOUT_S = 300.0
RPC_TIMEOUT_S = 2.0


def model_digest(path: str) -> str:
    """Cheap identity of a model: sha256 over its size and first/last MiB
    (whole-file hashing of multi-GB models would delay every start).  For a
    directory, over its ``config.json`` and weight file names and sizes."""
    h = hashlib.sha256()
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            if name.endswith((".json", ".safetensors")):
                full = os.path.join(path, name)
                h.update(name.encode())
                h.update(str(os.path.getsize(full)).encode())
                if name == "config.json":
                    with open(full, "rb") as f:
                        h.update(f.read())
        return h.hexdigest()[:16]
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(size - (1 << 20))
            h.update(f.read())
    return h.hexdigest()[:16]


def default_node_id(address: str) -> str:
    """Stable across restarts: hostname plus the data-plane address."""
    host = socket.gethostname().split(".")[0] or "node"
    return f"{host}-{address.replace('.', '-').replace(':', '-')}"


def _free_port(address: str) -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((address, 0))
        return s.getsockname()[1]
    finally:
        s.close()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """preexec_fn: the rank process gets SIGKILL when its daemon dies (Linux).

    Its own process group (killed as a group) in the daemon's session: a new
    session would be a new scheduler autogroup (see
    :func:`mlxcluster.runtime.launcher.process_group_kwargs`)."""
    os.setpgrp()
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class NodeConfig:
    """Settings of one node daemon (see ``mlxcluster join --help``)."""

    cluster: str = "default"
    address: str = "127.0.0.1"        # data-plane / gRPC address (from --interface)
    interfaces: List[str] = field(default_factory=list)  # mDNS interface addresses
    port: int = 0                      # Node service port (0 = pick)
    node_id: str = ""
    model: Optional[str] = None
    model_path: str = ""
    weights: Optional[str] = None
    backend: str = "auto"
    world_size: Optional[int] = None
    secret: str = ""
    valid_world_sizes: List[int] = field(default_factory=lambda: [1])


@dataclass
class _Peer:
    info: NodeInfo
    last_ok: float = 0.0
    status: Optional[pb.NodeStatusReply] = None
    stub: Optional[pb_grpc.NodeStub] = None
    channel: Optional[grpc.Channel] = None


class NodeDaemon(pb_grpc.NodeServicer):
    """One ``mlxcluster join`` process.  ``run()`` blocks until ``stop()``."""

    def __init__(self, config: NodeConfig):
        self.cfg = config
        self.cfg.node_id = config.node_id or default_node_id(config.address)
        self.lock = threading.RLock()
        self.stop_event = threading.Event()
        self.state = "idle"
        self.error = ""
        self.formation: Optional[pb.BootstrapRequest] = None
        self.rank_proc: Optional[subprocess.Popen] = None
        self.rank_state = ""
        self.prepared: Dict[str, tuple] = {}
        self.peers: Dict[str, _Peer] = {}
        self.refused: Dict[str, str] = {}
        self.membership_changed = time.monotonic()
        self.form_attempts = 0
        self.next_form_at = 0.0
        self.formed_at = 0.0
        self._tmp = tempfile.mkdtemp(prefix="mlxcluster-node-")
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_NodeServicer_to_server(self, self.server)
        bound = self.server.add_insecure_port(f"{config.address}:{config.port}")
        if bound == 0:
            raise OSError(f"cannot listen on {config.address}:{config.port}")
        self.cfg.port = bound
        facts = local_node_facts()
        self.info = NodeInfo(
            node_id=self.cfg.node_id, cluster=config.cluster, address=config.address, port=bound,
            version=PROTOCOL_VERSION, memory_bytes=int(facts.get("memory_bytes", 0)),
            platform=str(facts.get("platform", platform.platform())), chip=str(facts.get("chip", "")),
            backends=bk.local_backends(), model_digest=model_digest(config.model_path),
            auth=auth_tag(config.secret, self.cfg.node_id), state="idle")
        self.discovery = Discovery(self.info, config.interfaces, on_change=self._on_change)

    # -- lifecycle ----------------------------------------------------------------
    def run(self) -> None:
        self.server.start()
        self.discovery.start()
        log.info("node %s joined cluster %r at %s:%d (backends %s, model digest %s)", self.cfg.node_id,
                 self.cfg.cluster, self.cfg.address, self.cfg.port, ",".join(self.info.backends),
                 self.info.model_digest)
        try:
            while not self.stop_event.wait(HEARTBEAT_S):
                try:
                    self._tick()
                except Exception:  # keep the daemon alive; the next tick retries
                    log.exception("node tick failed")
        finally:
            self._teardown_local("node stopping")
            self.discovery.stop()
            self.server.stop(grace=0.5)

    def stop(self) -> None:
        self.stop_event.set()

    # -- membership -----------------------------------------------------------------
    def _on_change(self, event: str, info: NodeInfo) -> None:
        with self.lock:
            if event == "removed":
                if self.peers.pop(info.node_id, None) is not None:
                    log.info("node %s left (goodbye)", info.node_id)
                    self.membership_changed = time.monotonic()
                return
            reason = self._incompatible(info)
            if reason:
                if self.refused.get(info.node_id) != reason:
                    log.warning("refusing node %s at %s:%d: %s", info.node_id, info.address, info.port, reason)
                    self.refused[info.node_id] = reason
                return
            self.refused.pop(info.node_id, None)
            peer = self.peers.get(info.node_id)
            if peer is None or (peer.info.address, peer.info.port) != (info.address, info.port):
                if peer and peer.channel:
                    peer.channel.close()
                channel = grpc.insecure_channel(f"{info.address}:{info.port}",
                                                options=[("grpc.enable_http_proxy", 0)])
                self.peers[info.node_id] = _Peer(info=info, channel=channel, stub=pb_grpc.NodeStub(channel))
                log.info("discovered node %s at %s:%d", info.node_id, info.address, info.port)
                self.membership_changed = time.monotonic()
            else:
                peer.info = info

    def _incompatible(self, info: NodeInfo) -> str:
        if info.node_id == self.cfg.node_id:
            return "same node id as this node"
        if info.version != PROTOCOL_VERSION:
            return f"protocol version {info.version}, this node speaks {PROTOCOL_VERSION}"
        if not verify_auth(self.cfg.secret, info):
            return "wrong cluster secret"
        if info.model_digest != self.info.model_digest:
            return f"different model (digest {info.model_digest}, this node {self.info.model_digest})"
        return ""

    def _heartbeat(self) -> None:
        with self.lock:
            peers = list(self.peers.values())
        for peer in peers:
            try:
                peer.status = peer.stub.Status(pb.NodeStatusRequest(), timeout=RPC_TIMEOUT_S / 2)
                if peer.last_ok == 0.0 or time.monotonic() - peer.last_ok > PEER_TIMEOUT_S:
                    self.membership_changed = time.monotonic()
                peer.last_ok = time.monotonic()
            except grpc.RpcError:
                pass

    def alive_peers(self) -> Dict[str, _Peer]:
        now = time.monotonic()
        with self.lock:
            return {nid: p for nid, p in self.peers.items() if p.last_ok and now - p.last_ok <= PEER_TIMEOUT_S}

    def coordinator_id(self) -> str:
        return min([self.cfg.node_id, *self.alive_peers()])

    def target_world_size(self, n_alive: int) -> Optional[int]:
        if self.cfg.world_size:
            return self.cfg.world_size if n_alive >= self.cfg.world_size else None
        sizes = [n for n in self.cfg.valid_world_sizes if n <= n_alive]
        return max(sizes) if sizes else None

    # -- the loop ---------------------------------------------------------------------
    def _tick(self) -> None:
        self._heartbeat()
        self._supervise_rank()
        alive = self.alive_peers()
        coordinator = self.coordinator_id()
        f = self.formation
        if f is not None:
            members = [e.node_id for e in f.endpoints]
            lost = [m for m in members if m != self.cfg.node_id and m not in alive]
            if lost:
                self._teardown_local(f"lost node(s) {', '.join(lost)}")
                if coordinator == self.cfg.node_id:
                    self._broadcast_teardown(f.formation_id, f"lost node(s) {', '.join(lost)}", alive)
                return
            if coordinator == self.cfg.node_id:
                self._check_members(f, alive)
            return
        if coordinator == self.cfg.node_id:
            self._maybe_form(alive)

    def _check_members(self, f: pb.BootstrapRequest, alive: Dict[str, _Peer]) -> None:
        states = [self.state]
        for e in f.endpoints:
            if e.node_id == self.cfg.node_id:
                continue
            st = alive[e.node_id].status
            if st is None or st.formation_id != f.formation_id:
                if st is not None and time.monotonic() - self.formed_at > RPC_TIMEOUT_S * 2:
                    states.append("failed")
                continue
            states.append(st.state)
        if "failed" in states:
            why = self.error or "a member's rank process failed"
            log.warning("formation %s failed (%s); tearing down", f.formation_id, why)
            self._teardown_local(why)
            self._broadcast_teardown(f.formation_id, why, alive)
            self.next_form_at = time.monotonic() + min(30.0, 2.0 * (2 ** self.form_attempts))
            return
        if all(s == "ready" for s in states) and self.state == "ready" and self.info.state != "formed":
            log.info("cluster %r formed: world size %d, backend %s, rank 0 at %s", self.cfg.cluster,
                     f.world_size, f.backend, self._rank0_address(f))
            self.form_attempts = 0
            self.discovery.update(state="formed")
            self.info.state = "formed"

    def _maybe_form(self, alive: Dict[str, _Peer]) -> None:
        n_alive = 1 + len(alive)
        n = self.target_world_size(n_alive)
        if n is None or time.monotonic() - self.membership_changed < SETTLE_S or time.monotonic() < self.next_form_at:
            return
        chosen = [self.cfg.node_id] + sorted(alive)[: n - 1]
        # Only nodes that are idle (not in another formation) are used.
        for nid in chosen[1:]:
            st = alive[nid].status
            if st is not None and st.formation_id and st.state not in ("idle", "failed"):
                return
        self.form_attempts += 1
        fid = uuid.uuid4().hex[:12]
        log.info("forming cluster %r: world size %d with %s (formation %s)", self.cfg.cluster, n,
                 ", ".join(chosen), fid)
        endpoints: List[bk.RankEndpoint] = []
        msgs: List[pb.RankEndpointMsg] = []
        for rank, nid in enumerate(chosen):
            req = pb.PrepareRequest(secret=self.cfg.secret, protocol_version=PROTOCOL_VERSION,
                                    formation_id=fid, coordinator_id=self.cfg.node_id)
            try:
                rep = self.Prepare(req, None) if nid == self.cfg.node_id else \
                    alive[nid].stub.Prepare(req, timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as exc:
                log.warning("node %s did not prepare: %s", nid, exc.details())
                return
            if not rep.ok:
                log.warning("node %s refused to prepare: %s", nid, rep.error)
                return
            endpoints.append(bk.RankEndpoint(rank=rank, address=rep.address, ring_port=rep.ring_port,
                                             control_port=rep.control_port, backends=list(rep.backends)))
            msgs.append(pb.RankEndpointMsg(rank=rank, node_id=nid, address=rep.address,
                                           ring_port=rep.ring_port, control_port=rep.control_port))
        try:
            backend = bk.choose_backend(self.cfg.backend, endpoints)
        except ValueError as exc:
            log.error("cannot form: %s", exc)
            self.next_form_at = time.monotonic() + 30
            return
        for rank, nid in enumerate(chosen):
            req = pb.BootstrapRequest(
                secret=self.cfg.secret, protocol_version=PROTOCOL_VERSION, formation_id=fid,
                coordinator_id=self.cfg.node_id, rank=rank, world_size=n, backend=backend,
                endpoints=msgs, model_digest=self.info.model_digest, weights=self.cfg.weights or "")
            try:
                rep = self.Bootstrap(req, None) if nid == self.cfg.node_id else \
                    alive[nid].stub.Bootstrap(req, timeout=RPC_TIMEOUT_S * 2)
            except grpc.RpcError as exc:
                rep = pb.BootstrapReply(ok=False, error=exc.details() or str(exc.code()))
            if not rep.ok:
                log.warning("node %s refused bootstrap: %s", nid, rep.error)
                self._teardown_local("bootstrap refused")
                self._broadcast_teardown(fid, "bootstrap refused", alive)
                self.next_form_at = time.monotonic() + 5
                return

    def _broadcast_teardown(self, fid: str, reason: str, alive: Dict[str, _Peer]) -> None:
        for peer in alive.values():
            try:
                peer.stub.Teardown(pb.TeardownRequest(secret=self.cfg.secret, formation_id=fid, reason=reason),
                                   timeout=RPC_TIMEOUT_S)
            except grpc.RpcError:
                pass

    # -- rank process -------------------------------------------------------------------
    def _rank0_address(self, f: pb.BootstrapRequest) -> str:
        e = f.endpoints[0]
        return f"{e.address}:{e.control_port}"

    def _start_rank(self, f: pb.BootstrapRequest) -> None:
        eps = [bk.RankEndpoint(rank=e.rank, address=e.address, ring_port=e.ring_port,
                               control_port=e.control_port) for e in f.endpoints]
        workdir = os.path.join(self._tmp, f.formation_id)
        os.makedirs(workdir, exist_ok=True)
        env = dict(os.environ)
        env.update(rank_environment(1))
        if f.world_size > 1:
            env.update(bk.write_backend_files(f.backend, eps, f.rank, workdir))
        env["MLXCLUSTER_SECRET"] = self.cfg.secret
        env["PYTHONUNBUFFERED"] = "1"
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [sys.executable, "-m", "mlxcluster.runtime.rank",
               "--backend", f.backend if f.world_size > 1 else "any",
               "--world-size", str(f.world_size),
               "--ports", ",".join(str(e.control_port) for e in f.endpoints),
               "--hosts", ",".join(e.address for e in f.endpoints),
               "--bind", self.cfg.address, "--model", self.cfg.model_path]
        if f.weights:
            cmd += ["--weights", f.weights]
        self.rank_state = "starting"
        self.rank_proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          stdin=subprocess.DEVNULL, text=True, preexec_fn=_die_with_parent)
        proc = self.rank_proc
        threading.Thread(target=self._read_rank_events, args=(proc,), daemon=True).start()
        threading.Thread(target=self._read_rank_stderr, args=(proc,), daemon=True).start()

    def _read_rank_events(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            event = parse_event(line)
            if event is None:
                continue
            with self.lock:
                if proc is not self.rank_proc:
                    return
                kind = event.get("event", "")
                if kind == "error":
                    self.state, self.error = "failed", event.get("message", "rank failed")
                    log.error("rank process failed: %s", self.error)
                elif kind in ("loading", "loaded", "connecting"):
                    self.state = "loading"
                    log.info("rank %s: %s", event.get("rank"), kind)
                elif kind == "ready":
                    self.state = "ready"
                    log.info("rank %s ready at %s", event.get("rank"), event.get("address"))

    def _read_rank_stderr(self, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            if line.strip():
                log.debug("rank stderr: %s", line.rstrip())

    def _supervise_rank(self) -> None:
        with self.lock:
            proc = self.rank_proc
            if proc is None or self.formation is None:
                return
            code = proc.poll()
            if code is not None and self.state != "failed":
                self.state = "failed"
                self.error = self.error or f"rank process exited with code {code}"
                log.error("rank %d process exited (code %s)", self.formation.rank, code)
            elif self.state in ("starting", "loading") and time.monotonic() - self.formed_at > RANK_START_TIMEOUT_S:
                self.state, self.error = "failed", "rank process did not become ready in time"
        if self.state == "failed" and self.formation is not None and self.coordinator_id() != self.cfg.node_id:
            # Members keep a failed formation until the coordinator tears it down,
            # unless the coordinator is gone (handled in _tick).
            pass

    def _teardown_local(self, reason: str) -> None:
        with self.lock:
            proc, self.rank_proc = self.rank_proc, None
            had = self.formation is not None
            self.formation = None
            self.state = "idle"
            self.rank_state = ""
            self.membership_changed = time.monotonic()
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if had:
            log.warning("tore down rank process: %s", reason)
            if self.info.state != "idle":
                self.info.state = "idle"
                try:
                    self.discovery.update(state="idle")
                except Exception:
                    pass

    # -- Node service -------------------------------------------------------------------
    def _auth_error(self, secret: str, version: int) -> str:
        if not secrets_match(secret, self.cfg.secret):
            return "wrong cluster secret"
        if version != PROTOCOL_VERSION:
            return f"protocol version {version} does not match this node's {PROTOCOL_VERSION}"
        return ""

    def _peer_name(self, context) -> str:
        return context.peer() if context is not None else "self"

    def Prepare(self, request, context):
        err = self._auth_error(request.secret, request.protocol_version)
        if err:
            log.warning("refused Prepare from %s: %s", self._peer_name(context), err)
            return pb.PrepareReply(ok=False, error=err, node_id=self.cfg.node_id)
        with self.lock:
            if self.formation is not None and request.formation_id != self.formation.formation_id:
                self._teardown_local(f"re-forming ({request.formation_id})")
            ports = (_free_port(self.cfg.address), _free_port(self.cfg.address))
            self.prepared[request.formation_id] = ports
        return pb.PrepareReply(ok=True, address=self.cfg.address, ring_port=ports[0], control_port=ports[1],
                               node_id=self.cfg.node_id, backends=self.info.backends)

    def Bootstrap(self, request, context):
        err = self._auth_error(request.secret, request.protocol_version)
        if not err and request.model_digest != self.info.model_digest:
            err = f"model digest {request.model_digest} differs from this node's {self.info.model_digest}"
        if not err and not 0 <= request.rank < request.world_size == len(request.endpoints):
            err = f"bad rank {request.rank} for world size {request.world_size}"
        if err:
            log.warning("refused Bootstrap from %s: %s", self._peer_name(context), err)
            return pb.BootstrapReply(ok=False, error=err)
        self._teardown_local("new formation")
        with self.lock:
            self.formation = request
            self.formed_at = time.monotonic()
            self.state = "starting"
            self.error = ""
            log.info("bootstrap: rank %d of %d, backend %s, formation %s (coordinator %s)", request.rank,
                     request.world_size, request.backend, request.formation_id, request.coordinator_id)
            try:
                self._start_rank(request)
            except Exception as exc:
                self.state, self.error = "failed", f"cannot start rank process: {exc}"
                return pb.BootstrapReply(ok=False, error=self.error)
        return pb.BootstrapReply(ok=True)

    def Teardown(self, request, context):
        if not secrets_match(request.secret, self.cfg.secret):
            log.warning("refused Teardown from %s: wrong cluster secret", self._peer_name(context))
            return pb.TeardownReply()
        f = self.formation
        if f is not None and (not request.formation_id or request.formation_id == f.formation_id):
            self._teardown_local(request.reason or "coordinator asked")
        return pb.TeardownReply()

    def Status(self, request, context):
        f = self.formation
        reply = pb.NodeStatusReply(node_id=self.cfg.node_id, cluster=self.cfg.cluster, state=self.state,
                                   model=os.path.basename(self.cfg.model_path), error=self.error,
                                   protocol_version=PROTOCOL_VERSION,
                                   coordinator_id=self.coordinator_id())
        if f is not None:
            reply.formation_id = f.formation_id
            reply.rank = f.rank
            reply.world_size = f.world_size
            reply.backend = f.backend
            reply.coordinator_id = f.coordinator_id
            reply.rank0_address = self._rank0_address(f)
            reply.members.extend(f.endpoints)
        return reply

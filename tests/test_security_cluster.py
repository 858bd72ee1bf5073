"""Node daemons under attack and faults, without a model load (fast tier).

Real :class:`~mlxcluster.cluster.node.NodeDaemon` s on loopback (mDNS, mutual TLS, the
node loop) with a stand-in model file and ``--world-size 3`` for at most two nodes, so
nothing ever forms and no rank process starts: what is tested is membership.

* A stranger (plaintext, or TLS under another secret) gets no ``Node`` handler called.
* An intruder daemon with another secret is never live and never coordinates; a client
  with a wrong secret (``generate --cluster``) gets one line saying so.
* A member's mDNS record replayed with a forged port moves nothing (the forged endpoint
  sees a TLS ClientHello at most); an mDNS goodbye does not remove a proven peer; a real
  restart on a new port moves it once the new endpoint proves the node id.
* A frozen node (SIGSTOP) is lost within 10 s, and live again after SIGCONT.

The same faults on formed clusters of `join` processes: tests/test_cluster.py (slow tier).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import grpc
import pytest
from zeroconf import IPVersion, ServiceInfo, Zeroconf

from harness import seconds_until
from mlxcluster.cluster.discovery import PROTOCOL_VERSION, SERVICE_TYPE, encode_txt
from mlxcluster.cluster.membership import PEER_TIMEOUT_S, PeerStatus
from mlxcluster.cluster.node import NodeConfig, NodeDaemon
from mlxcluster.cluster.service import NodeService
from mlxcluster.protocol import mlxcluster_pb2 as pb
from mlxcluster.protocol import mlxcluster_pb2_grpc as pb_grpc
from mlxcluster.security import credentials, node_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LO = ["127.0.0.1"]
SECRET = "membership-test-secret-0123"
pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def model(tmp_path):
    """A stand-in model file: the daemons only hash it (nothing forms, nothing loads it)."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(64))
    return str(path)


@pytest.fixture
def daemons(model):
    """Factory: ``start(cluster, node_id, secret=SECRET)`` -> a running NodeDaemon (stopped at teardown)."""
    running = []

    def start(cluster, node_id, secret=SECRET):
        d = NodeDaemon(NodeConfig(cluster=cluster, address="127.0.0.1", interfaces=LO, node_id=node_id,
                                  model_path=model, world_size=3, secret=secret, valid_world_sizes=[3]))
        t = threading.Thread(target=d.run, daemon=True)
        t.start()
        running.append((d, t))
        return d

    yield start
    for d, _ in running:
        d.stop()
    for _, t in running:
        t.join(10.0)
    assert not any(t.is_alive() for _, t in running)


def peer(daemon, node_id):
    return daemon.peers.get(node_id)  # the loop thread replaces entries; a get is atomic


def status_of(daemon, node_id):
    p = peer(daemon, node_id)
    return None if p is None else p.status


# --------------------------------------------------------------------------- strangers


@pytest.mark.slow  # real network timers (mDNS, heartbeats): seconds of waiting
def test_strangers_get_no_handler_called_and_an_intruder_is_never_live(daemons, monkeypatch, caplog, tmp_path):
    """Plaintext, TLS under another secret, or TLS without a certificate of the cluster CA:
    Prepare/Bootstrap/Teardown/Status all fail in the handshake (UNAVAILABLE) before any
    handler runs.  An intruder daemon with another secret and the smallest node id stays
    unverified (SEEN), is logged, never coordinates.  ``generate --cluster`` under a wrong
    secret fails with one line."""
    calls = []
    for rpc in ("Prepare", "Bootstrap", "Teardown", "Status"):
        original = getattr(NodeService, rpc)

        def counted(self, request, context, _rpc=rpc, _original=original):
            calls.append((self.node.cfg.node_id, _rpc))
            return _original(self, request, context)

        monkeypatch.setattr(NodeService, rpc, counted)
    caplog.set_level(logging.INFO, logger="mlxcluster.node")
    cluster = f"t-{uuid.uuid4().hex[:8]}"
    node = daemons(cluster, "node-a")
    intruder = daemons(cluster, "a-intruder", secret="another-secret-4567")
    address = f"127.0.0.1:{node.cfg.port}"

    # The intruder answers heartbeats with a certificate of the wrong CA: never live.
    seconds_until(lambda: getattr(peer(node, "a-intruder"), "reason", "") ==
                  "TLS handshake failed: not the same cluster secret", 15, "node-a refuses the intruder")
    assert status_of(node, "a-intruder") is PeerStatus.SEEN
    assert f"node a-intruder at 127.0.0.1:{intruder.cfg.port} does not prove the cluster secret" in caplog.text
    assert node.status().coordinator_id == "node-a"  # the smaller id does not lead

    requests = {
        "Prepare": pb.PrepareRequest(protocol_version=PROTOCOL_VERSION, formation_id="evil", coordinator_id="x"),
        "Bootstrap": pb.BootstrapRequest(
            protocol_version=PROTOCOL_VERSION, formation_id="evil", coordinator_id="x", rank=0, world_size=1,
            backend="ring", model_digest=node.info.model_digest,
            endpoints=[pb.RankEndpointMsg(rank=0, node_id="node-a", address="127.0.0.1", ring_port=1,
                                          control_port=2)]),
        "Teardown": pb.TeardownRequest(reason="stranger teardown"),
        "Status": pb.NodeStatusRequest(),
    }
    stranger = credentials("another-secret-4567", cluster)
    # A stranger who skips checking the server (here: trusts the cluster CA, which is no
    # secret) still needs a client certificate the cluster CA signed.
    ca = credentials(SECRET, cluster).ca_pem
    no_cert = grpc.ssl_channel_credentials(root_certificates=ca)
    wrong_cert = grpc.ssl_channel_credentials(root_certificates=ca, private_key=stranger.key_pem,
                                              certificate_chain=stranger.cert_pem)
    options = stranger.channel_options(node_name("node-a"))
    for make in (lambda: grpc.insecure_channel(address),
                 lambda: stranger.channel(address, node_name("node-a")),
                 lambda: stranger.channel(address),
                 lambda: grpc.secure_channel(address, no_cert, options),
                 lambda: grpc.secure_channel(address, wrong_cert, options)):
        for rpc, request in requests.items():
            channel = make()
            try:
                with pytest.raises(grpc.RpcError) as err:
                    getattr(pb_grpc.NodeStub(channel), rpc)(request, timeout=5)
            finally:
                channel.close()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (rpc, err.value)
    assert calls == []  # no handler of either daemon ran: the intruder reached none either
    assert "stranger teardown" not in caplog.text

    # Control: a secret holder reaches the handlers (so the counter counts).
    channel = credentials(SECRET, cluster).channel(address, node_name("node-a"))
    try:
        assert pb_grpc.NodeStub(channel).Status(pb.NodeStatusRequest(), timeout=5).node_id == "node-a"
        reply = pb_grpc.NodeStub(channel).Prepare(pb.PrepareRequest(protocol_version=99), timeout=5)
    finally:
        channel.close()
    assert not reply.ok and "protocol version 99" in reply.error
    assert calls == [("node-a", "Status"), ("node-a", "Prepare")]
    assert node.status().state == "idle" and node.status().formation_id == ""

    # `generate --cluster` under a third secret (from --secret-file): one line naming why each
    # node was skipped, no traceback, nothing sent.
    secret_file = tmp_path / "secret"
    secret_file.write_text("a-third-secret-89\n")
    secret_file.chmod(0o600)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MLXCLUSTER_SECRET", None)
    proc = subprocess.run([sys.executable, "-m", "mlxcluster", "generate", "hello", "--cluster", cluster,
                           "--interface", "127.0.0.1", "--secret-file", str(secret_file)],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode != 0 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert ("(a-intruder: TLS handshake failed: not the same cluster secret; "
            "node-a: TLS handshake failed: not the same cluster secret)") in proc.stderr, proc.stderr
    assert calls == [("node-a", "Status"), ("node-a", "Prepare")]


# --------------------------------------------------------------------------- replayed records


class Sink:
    """A plain TCP listener on loopback recording every byte sent to it (a forged endpoint)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.data = bytearray()
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        deadline = time.monotonic() + 120
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            self.connections += 1
            conn.settimeout(0.3)
            try:
                while not self._stop.is_set():
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    self.data += chunk
            except OSError:
                pass
            conn.close()

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def replay(daemon, port):
    """Re-announce ``daemon``'s own mDNS record (same name and TXT) at ``port``, as anyone on
    the link can; returns the Zeroconf that keeps answering for it (close() sends goodbyes)."""
    info = daemon.discovery.info
    zc = Zeroconf(interfaces=LO, ip_version=IPVersion.V4Only)
    zc.register_service(ServiceInfo(SERVICE_TYPE, info.service_name, addresses=[socket.inet_aton("127.0.0.1")],
                                    port=port, properties=encode_txt(info), server=f"{info.instance_name}.local."),
                        cooperating_responders=True)
    return zc


@pytest.mark.slow  # real network timers (mDNS, heartbeats): seconds of waiting
def test_a_replayed_record_moves_no_peer_and_a_proven_restart_does(daemons, caplog):
    caplog.set_level(logging.INFO, logger="mlxcluster.node")
    cluster = f"t-{uuid.uuid4().hex[:8]}"
    a, b = daemons(cluster, "node-a"), daemons(cluster, "node-b")
    real = ("127.0.0.1", b.cfg.port)
    seconds_until(lambda: status_of(a, "node-b") is PeerStatus.LIVE, 15, "node-a verifies node-b")

    def still_at_real_endpoint(p):
        return p is not None and p.status is PeerStatus.LIVE and (p.info.address, p.info.port) == real

    sink = Sink()
    zc = replay(b, sink.port)
    try:
        seconds_until(lambda: getattr(getattr(peer(a, "node-b"), "pending", None), "port", 0) == sink.port, 15,
                      "node-a hears the replayed record")
        seconds_until(lambda: len(sink.data) > 0, 10, "node-a asks the forged endpoint to prove node-b")
        # An observation window longer than the heartbeat timeout: nothing may move.
        deadline = time.monotonic() + PEER_TIMEOUT_S + 1.0
        while time.monotonic() < deadline:
            assert still_at_real_endpoint(peer(a, "node-b")), peer(a, "node-b")
            time.sleep(0.1)
    finally:
        zc.close()  # also sends the replayer's goodbye for node-b's name
    try:
        try:
            seconds_until(lambda: "node node-b said goodbye over mDNS" in caplog.text, 10, "the forged goodbye arrives")
        except AssertionError:
            # the real node-b's record (same PTR name) may be refreshed in node-a's mDNS cache within the
            # goodbye's one-second grace (RFC 6762 10.1), and then zeroconf reports no removal at all; the
            # property checked below is the same either way: node-b stays where it proved itself
            print("the forged goodbye was absorbed by node-b's own record (no removal reported)")
        deadline = time.monotonic() + 2 * 0.5 + 0.5  # two heartbeat periods after it: still there
        while time.monotonic() < deadline:
            assert still_at_real_endpoint(peer(a, "node-b")), peer(a, "node-b")
            time.sleep(0.1)
    finally:
        sink.close()
    # What reached the forged endpoint: TLS handshake records (ClientHello), nothing secret.
    assert sink.data[:1] == b"\x16", bytes(sink.data[:16])
    assert SECRET.encode() not in sink.data
    assert "node node-b moved" not in caplog.text and "left (goodbye)" not in caplog.text

    # A real restart on another port: the new endpoint proves node-b, and node-a moves it there.
    b.stop()
    b2 = daemons(cluster, "node-b")
    assert b2.cfg.port != real[1]
    moved_s = seconds_until(lambda: getattr(peer(a, "node-b"), "info", None) is not None
                            and peer(a, "node-b").info.port == b2.cfg.port
                            and peer(a, "node-b").status is PeerStatus.LIVE, 20, "node-a follows node-b's restart")
    assert f"node node-b moved to 127.0.0.1:{b2.cfg.port} (proved its node id there)" in caplog.text
    print(f"restarted node followed after {moved_s:.1f} s")


# --------------------------------------------------------------------------- freezes

DAEMON = r"""
import os, signal, sys
from mlxcluster.cluster.node import NodeConfig, NodeDaemon
cluster, node_id, model = sys.argv[1:4]
d = NodeDaemon(NodeConfig(cluster=cluster, address="127.0.0.1", interfaces=["127.0.0.1"], node_id=node_id,
                          model_path=model, world_size=3, valid_world_sizes=[3],
                          secret=os.environ["MLXCLUSTER_SECRET"]))
signal.signal(signal.SIGTERM, lambda *_: d.stop())
d.run()
"""


@pytest.mark.slow  # real network timers (mDNS, heartbeats): seconds of waiting
def test_a_frozen_node_is_lost_within_10_s_and_back_after_sigcont(daemons, model, tmp_path):
    """The node-level bound of issue 10: heartbeats every HEARTBEAT_S with a deadline, lost
    after PEER_TIMEOUT_S without an answer, so a SIGSTOPped node is lost in <= 10 s."""
    cluster = f"t-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MLXCLUSTER_SECRET=SECRET)
    log = tmp_path / "node-b.log"
    with open(log, "w") as out:  # a file, not a pipe nobody reads while the test waits
        proc = subprocess.Popen([sys.executable, "-c", DAEMON, cluster, "node-b", model], env=env,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        a = daemons(cluster, "node-a")
        verified_s = seconds_until(lambda: status_of(a, "node-b") is PeerStatus.LIVE or proc.poll() is not None,
                                   30, "node-a verifies node-b")
        assert proc.poll() is None, log.read_text()
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            lost_s = seconds_until(lambda: status_of(a, "node-b") is PeerStatus.LOST, 10.0, "node-b lost")
            assert "no heartbeat" in peer(a, "node-b").reason
            assert lost_s >= PEER_TIMEOUT_S - 0.5  # by the heartbeat timeout, not by accident
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        back_s = seconds_until(lambda: status_of(a, "node-b") is PeerStatus.LIVE, 10, "node-b back after SIGCONT")
        print(f"verified after {verified_s:.1f} s; frozen node lost after {lost_s:.1f} s, "
              f"live again {back_s:.1f} s after SIGCONT")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

"""`mlxcluster join`: discovery, formation, generation through the cluster, node loss, trust.

Nodes are real `mlxcluster join` processes on the real model.  Loopback runs
bind mDNS and the data plane to 127.0.0.1; the namespace test gives each node
its own network namespace (veth into a bridge that lives in a namespace of its
own), so the three nodes are three hosts on one private link.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import grpc
import pytest

from mlxcluster.cluster.client import ClusterLookupError, cluster_status, find_rank0
from mlxcluster.protocol import mlxcluster_pb2 as pb
from mlxcluster.protocol import mlxcluster_pb2_grpc as pb_grpc
from mlxcluster.serving.generation import ClientError, GenerationClient
from mlxcluster.runtime.launcher import LocalCluster, free_ports

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "The capital of France is"
N_TOKENS = 8
SECRET = "correct horse battery staple"


def _env(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OPENBLAS_NUM_THREADS"] = "1"  # 3 nodes share this machine's cores
    env.pop("MLXCLUSTER_SECRET", None)
    env.update(extra or {})
    return env


class JoinNode:
    """One `mlxcluster join` process (optionally inside a network namespace)."""

    def __init__(self, tmp_path, cluster, node_id, address, port, secret=SECRET, netns=None,
                 interface=None, world_size=3):
        self.node_id = node_id
        self.log_path = tmp_path / f"{node_id}.log"
        cmd = [sys.executable, "-m", "mlxcluster", "join", "--cluster", cluster, "--node-id", node_id,
               "--interface", interface or address, "--port", str(port), "--world-size", str(world_size),
               "--weights", "float32", "--secret", secret]
        if netns:
            cmd = ["ip", "netns", "exec", netns] + cmd
        self.cmd = cmd
        self.proc = None
        self.start()

    def start(self):
        self.log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.cmd, env=_env(), stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def kill(self):
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()

    def text(self):
        return self.log_path.read_text()


def wait_formed(cluster, interfaces, timeout_s=240, netns=None):
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            if netns:
                out = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-m", "mlxcluster", "status",
                                      "--cluster", cluster, "--json", "--timeout", "2",
                                      *sum((["--interface", i] for i in interfaces), [])],
                                     capture_output=True, text=True, env=_env(), timeout=60)
                nodes = json.loads(out.stdout) if out.returncode == 0 else []
            else:
                nodes = cluster_status(cluster, interfaces, timeout_s=2.0)
            ready = [n for n in nodes if n.get("state") == "ready" and n.get("formation_id")]
            last = json.dumps([(n["node_id"], n.get("state"), n.get("rank")) for n in nodes])
            if len(ready) == 3 and len({n["formation_id"] for n in ready}) == 1:
                return nodes
        except (ClusterLookupError, ValueError):
            pass
        time.sleep(1.0)
    raise AssertionError(f"cluster {cluster} did not form within {timeout_s} s; last status {last}")


@pytest.fixture(scope="module")
def tp1_tokens(real_model_path):
    with LocalCluster(1, model=real_model_path, weights="float32") as local:
        client = GenerationClient(local.address, local.credentials)
        result = client.generate(PROMPT, max_tokens=N_TOKENS)
        client.close()
    return result.token_ids


def run_generate_cli(cluster, interface, secret=SECRET, netns=None, max_tokens=N_TOKENS):
    cmd = [sys.executable, "-m", "mlxcluster", "generate", PROMPT, "--cluster", cluster, "--interface", interface,
           "--max-tokens", str(max_tokens), "--json", "--secret", secret]
    if netns:
        cmd = ["ip", "netns", "exec", netns] + cmd
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)


def test_loopback_cluster_forms_serves_survives_node_loss_and_refuses_strangers(tmp_path, tp1_tokens):
    cluster = f"t-{uuid.uuid4().hex[:8]}"
    ports = free_ports(4)
    nodes = [JoinNode(tmp_path, cluster, f"node-{i}", "127.0.0.1", ports[i]) for i in range(3)]
    # A node with the wrong secret and the smallest id: it must neither lead nor join.
    intruder = JoinNode(tmp_path, cluster, "a-intruder", "127.0.0.1", ports[3], secret="wrong")
    try:
        status = wait_formed(cluster, ["127.0.0.1"])
        by_id = {n["node_id"]: n for n in status}
        assert [by_id[f"node-{i}"]["rank"] for i in range(3)] == [0, 1, 2]
        assert by_id["node-0"]["backend"] == "ring"
        assert by_id["a-intruder"]["formation_id"] == ""  # never handed a rank

        # Generation through the cluster equals TP=1.
        proc = run_generate_cli(cluster, "127.0.0.1")
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["world_size"] == 3 and out["token_ids"] == tp1_tokens

        # Trust: the intruder was refused and logged; its requests are refused too.
        assert "refusing node a-intruder" in nodes[0].text() and "wrong cluster secret" in nodes[0].text()
        channel = grpc.insecure_channel(f"127.0.0.1:{ports[1]}")
        reply = pb_grpc.NodeStub(channel).Bootstrap(pb.BootstrapRequest(secret="wrong", protocol_version=1,
                                                                        rank=0, world_size=1), timeout=5)
        channel.close()
        assert not reply.ok and "wrong cluster secret" in reply.error
        assert "refused Bootstrap" in nodes[1].text()
        proc = run_generate_cli(cluster, "127.0.0.1", secret="wrong")
        assert proc.returncode != 0 and "wrong cluster secret" in proc.stderr and "Traceback" not in proc.stderr
        # A protocol-version mismatch is refused with a clear message.
        channel = grpc.insecure_channel(f"127.0.0.1:{ports[1]}")
        reply = pb_grpc.NodeStub(channel).Prepare(pb.PrepareRequest(secret=SECRET, protocol_version=99), timeout=5)
        channel.close()
        assert not reply.ok and "protocol version 99" in reply.error

        # Node loss mid-generation: the client gets a clear error within 10 s.
        address, formed = find_rank0(cluster, ["127.0.0.1"], secret=SECRET)
        rank2 = next(m for m in formed.members if m.rank == 2)
        assert rank2.node_id == "node-2"
        client = GenerationClient(address, secret=SECRET)
        stream = client.stream(PROMPT, max_tokens=400)
        next(stream)  # started
        next(stream)  # first token
        nodes[2].kill()
        t0 = time.monotonic()
        with pytest.raises(ClientError) as err:
            for _ in stream:
                pass
        elapsed = time.monotonic() - t0
        client.close()
        assert elapsed < 10.0, elapsed
        # rank 0 names the rank whose control stream broke (control/link.py), and the service
        # reports the group as failed (serving/generation.py)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value
        assert f"tensor-parallel group failed: lost rank 2 at {rank2.address}:{rank2.control_port}" \
            in str(err.value), err.value

        # The node comes back; the cluster re-forms and serves again.
        nodes[2].start()
        wait_formed(cluster, ["127.0.0.1"])
        proc = run_generate_cli(cluster, "127.0.0.1")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["token_ids"] == tp1_tokens
        assert "tore down rank process: lost rank 2" in nodes[0].text()
    finally:
        for n in nodes + [intruder]:
            n.stop()


def _sh(*cmd, check=True):
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture
def three_hosts():
    """Three network namespaces on one bridge (itself in a fourth namespace)."""
    tag = uuid.uuid4().hex[:4]
    br_ns = f"mlxc{tag}br"
    hosts = [(f"mlxc{tag}h{i}", f"10.231.{int(tag, 16) % 250}.{i + 1}") for i in range(3)]
    try:
        _sh("ip", "netns", "add", br_ns)
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        pytest.skip(f"cannot create network namespaces here: {getattr(exc, 'stderr', exc)}")
    made = [br_ns]
    try:
        _sh("ip", "-n", br_ns, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", br_ns, "link", "set", "br0", "up")
        for i, (ns, ip) in enumerate(hosts):
            _sh("ip", "netns", "add", ns)
            made.append(ns)
            _sh("ip", "link", "add", f"mx{tag}{i}a", "type", "veth", "peer", "name", f"mx{tag}{i}b")
            _sh("ip", "link", "set", f"mx{tag}{i}a", "netns", ns)
            _sh("ip", "link", "set", f"mx{tag}{i}b", "netns", br_ns)
            _sh("ip", "-n", ns, "link", "set", f"mx{tag}{i}a", "name", "eth0")
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", ns, "route", "add", "224.0.0.0/4", "dev", "eth0")
            _sh("ip", "-n", br_ns, "link", "set", f"mx{tag}{i}b", "master", "br0")
            _sh("ip", "-n", br_ns, "link", "set", f"mx{tag}{i}b", "up")
        yield hosts
    finally:
        for ns in made:
            _sh("ip", "netns", "del", ns, check=False)


def test_three_namespaces_form_a_tp3_cluster_over_mdns(tmp_path, three_hosts, tp1_tokens):
    cluster = f"ns-{uuid.uuid4().hex[:8]}"
    nodes = [JoinNode(tmp_path, cluster, f"host-{i}", ip, 50051, netns=ns, interface="eth0")
             for i, (ns, ip) in enumerate(three_hosts)]
    try:
        ns0, ip0 = three_hosts[0]
        status = wait_formed(cluster, ["eth0"], netns=ns0)
        assert sorted(n["address"].split(":")[0] for n in status) == sorted(ip for _, ip in three_hosts)
        proc = run_generate_cli(cluster, "eth0", netns=ns0)
        assert proc.returncode == 0, proc.stderr + "\n".join(n.text()[-2000:] for n in nodes)
        out = json.loads(proc.stdout)
        assert out["world_size"] == 3 and out["token_ids"] == tp1_tokens
        # `status` as a person reads it.
        st = subprocess.run(["ip", "netns", "exec", ns0, sys.executable, "-m", "mlxcluster", "status",
                             "--cluster", cluster, "--interface", "eth0"], capture_output=True, text=True,
                            env=_env(), timeout=60)
        assert st.returncode == 0 and "formed: world size 3, backend ring" in st.stdout, st.stdout + st.stderr
    finally:
        for n in nodes:
            n.stop()

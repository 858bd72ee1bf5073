"""mDNS/DNS-SD discovery (mlxcluster.cluster.discovery).

Network rule: everything here runs on loopback only (zeroconf bound to 127.0.0.1); every wait
is bounded. Each test uses its own cluster name so tests never see each other's nodes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent import futures

import grpc
import pytest
from zeroconf import IPVersion, ServiceInfo, Zeroconf, service_type_name

from harness import until
from mlxcluster.cluster.client import ClusterLookupError, find_rank0
from mlxcluster.cluster.discovery import (
    PROTOCOL_VERSION,
    SERVICE_TYPE,
    Discovery,
    DiscoveryError,
    NodeInfo,
    browse,
    decode_txt,
    encode_txt,
    local_node_facts,
    interface_kind,
    parse_ifconfig_ipv4,
    primary_address,
    rank_interfaces,
    resolve_interfaces,
)
from mlxcluster.protocol import mlxcluster_pb2 as pb
from mlxcluster.protocol import mlxcluster_pb2_grpc as pb_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LO = ["127.0.0.1"]
pytestmark = pytest.mark.timeout(60)


def make_info(cluster: str, node_id: str, port: int, **kw) -> NodeInfo:
    fields = dict(node_id=node_id, cluster=cluster, address="127.0.0.1", port=port, version=PROTOCOL_VERSION,
                  memory_bytes=16 * 2**30, platform="Linux-x86_64", chip=f"chip of {node_id}",
                  backends=["ring", "mpi"], model_digest="sha256:abc123", state="idle")
    fields.update(kw)
    return NodeInfo(**fields)


def txt_bytes(txt):
    return {k.encode(): v.encode() for k, v in txt.items()}


def new_cluster() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


class Recorder:
    """Collects on_change events; waits are bounded."""

    def __init__(self):
        self.cond = threading.Condition()
        self.events = []  # (event, node_id, port, state)

    def __call__(self, event, info):
        with self.cond:
            self.events.append((event, info.node_id, info.port, info.state))
            self.cond.notify_all()

    def wait(self, pred, timeout=6.0) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not pred(list(self.events)):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.1))
            return True


def consistent(events) -> bool:
    """Replaying the events never adds a present node, nor updates/removes an absent one."""
    present = set()
    for event, node_id, _, _ in events:
        if (event == "added") == (node_id in present):
            return False
        if event == "added":
            present.add(node_id)
        elif event == "removed":
            present.discard(node_id)
    return True


@pytest.fixture
def nodes():
    """Factory for Discovery objects bound to loopback; all are stopped at teardown."""
    made = []

    def make(info, **kw):
        d = Discovery(info, LO, on_change=kw.pop("on_change", None), **kw)
        made.append(d)
        return d

    yield make
    stoppers = [threading.Thread(target=d.stop) for d in made]
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join(10.0)


def start_all(discs, timeout=10.0):
    errors = []

    def run(d):
        try:
            d.start()
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(d,)) for d in discs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "Discovery.start() hung"
    assert not errors, errors


# --------------------------------------------------------------------------- TXT / auth / names


def test_txt_round_trip_through_zeroconf():
    info = make_info("lab", "n1", 5000, state="formed", layers="20:output", role="decode")  # "ly", "ro"
    txt = encode_txt(info)
    assert txt["ly"] == "20:output" and txt["ro"] == "decode"
    assert all(len(k.encode()) + 1 + len(v.encode()) <= 255 for k, v in txt.items())
    assert decode_txt(txt_bytes(txt), "127.0.0.1", 5000) == info
    # the same through zeroconf's own TXT encoding / parsing
    si = ServiceInfo(SERVICE_TYPE, info.service_name, addresses=[socket.inet_aton("127.0.0.1")], port=5000,
                     properties=txt, server=f"{info.instance_name}.local.")
    parsed = ServiceInfo(SERVICE_TYPE, info.service_name, properties=si.text)  # raw TXT rdata
    assert decode_txt(parsed.properties, "127.0.0.1", 5000) == info
    # empty state is omitted and decodes back to ""; empty backends decode to []
    bare = make_info("lab", "n1", 5000, state="", backends=[])
    assert "st" not in encode_txt(bare) and "ly" not in encode_txt(bare)
    assert decode_txt(txt_bytes(encode_txt(bare)), "127.0.0.1", 5000) == bare


@pytest.mark.parametrize("mutate", [
    lambda p: p.pop(b"c"),
    lambda p: p.pop(b"id"),
    lambda p: p.pop(b"v"),
    lambda p: p.pop(b"mem"),
    lambda p: p.update({b"v": b"one"}),
    lambda p: p.update({b"mem": b"lots"}),
    lambda p: p.update({b"c": None}),
    lambda p: p.update({b"id": b""}),
    lambda p: p.update({b"chip": b"\xff\xfe"}),
], ids=["no-cluster", "no-id", "no-version", "no-mem", "bad-version", "non-integer-mem", "cluster-none",
        "empty-id", "non-utf8"])
def test_garbled_txt_raises(mutate):
    props = txt_bytes(encode_txt(make_info("lab", "n1", 5000)))
    mutate(props)
    with pytest.raises(ValueError):
        decode_txt(props, "127.0.0.1", 5000)


@pytest.mark.parametrize("mem", [b"100000000000000000000", b"70368744177665", b"-5", b"-100000000000000000000"])
def test_an_implausible_advertised_memory_is_read_as_unknown(mem):
    """A TXT ``mem`` above 64 TiB or negative (records are unauthenticated) decodes as 0, unknown;
    64 TiB itself and ordinary values are kept."""
    from mlxcluster.cluster.discovery import MAX_MEMORY_BYTES

    props = txt_bytes(encode_txt(make_info("lab", "n1", 5000)))
    props[b"mem"] = mem
    assert decode_txt(props, "127.0.0.1", 5000).memory_bytes == 0
    for good in (MAX_MEMORY_BYTES, 16 * 2**30, 0):
        props[b"mem"] = str(good).encode()
        assert decode_txt(props, "127.0.0.1", 5000).memory_bytes == good


def test_status_shows_an_implausible_memory_as_unknown(monkeypatch):
    """`mlxcluster status` prints "?" for a peer advertising mem=10^20 (was "93132257461.5 GiB"),
    through the real parse and the client's rows; and `--layers auto` never weighs the split by it."""
    from harness import cli

    from mlxcluster.cluster import client
    from mlxcluster.cluster.plan import pipeline_route

    honest = make_info("lab", "n1", 5000)
    forged = txt_bytes(encode_txt(make_info("lab", "n2", 5001)))
    forged[b"mem"] = b"100000000000000000000"
    peers = [honest, decode_txt(forged, "127.0.0.1", 5001)]
    monkeypatch.setattr(client, "browse", lambda cluster, addresses, timeout_s: peers)
    out = cli("status", "--cluster", "lab", env={"MLXCLUSTER_SECRET": None})
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines() if line.startswith(("n1 ", "n2 "))}
    assert "16.0 GiB" in rows["n1"] and " ? " in rows["n2"] and "GiB" not in rows["n2"], out.stdout
    assert "93132257461" not in out.stdout
    # the planner splits 30 layers evenly when a node's memory is unknown
    nodes = [(p.node_id, "auto", p.memory_bytes) for p in peers] + [("n3", "auto", 16 * 2**30)]
    assert pipeline_route(nodes, 30) == (("n1", "n2", "n3"), "20:output,0:9,10:19")


def test_decode_rejects_bad_address_and_port():
    props = txt_bytes(encode_txt(make_info("lab", "n1", 5000)))
    for address, port in [("not-an-ip", 5000), ("::1", 5000), ("127.0.0.1", 0), ("127.0.0.1", 70000)]:
        with pytest.raises(ValueError):
            decode_txt(props, address, port)


def test_encode_limits():
    with pytest.raises(ValueError):
        encode_txt(make_info("lab", "n1", 5000, model_digest="x" * 300))
    with pytest.raises(ValueError):
        encode_txt(make_info("", "n1", 5000))
    with pytest.raises(ValueError):
        encode_txt(make_info("lab", "n1", 5000, backends=["ring,mpi"]))
    txt = encode_txt(make_info("lab", "n1", 5000, chip="é" * 400))  # informational: cut to fit
    assert len(b"chip=" + txt["chip"].encode()) <= 255 and txt["chip"].startswith("é")


def test_nothing_secret_in_txt():
    """The record carries only public facts: no key holds anything derived from a secret
    (an HMAC tag there could be replayed and tested offline at hash speed)."""
    txt = encode_txt(make_info("lab", "n1", 5000, state="formed"))
    assert set(txt) == {"v", "c", "id", "mem", "plat", "chip", "be", "md", "st"}



LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


@pytest.mark.parametrize("cluster,node_id", [
    ("lab", "n1"),
    ("Lab Cluster/№1", "node_01.local"),
    ("c" * 200, "n" * 200),
    ("---", "___"),
    ("日本", "ノード"),
])
def test_instance_names_valid_and_stable(cluster, node_id):
    a = make_info(cluster, node_id, 1)
    b = make_info(cluster, node_id, 2, address="10.0.0.9", state="formed")
    name = a.instance_name
    assert name == b.instance_name  # depends only on cluster + node id
    assert LABEL.match(name) and len(name.encode()) <= 63, name
    assert a.service_name == f"{name}.{SERVICE_TYPE}"
    service_type_name(a.service_name, strict=True)  # zeroconf accepts it


def test_instance_names_distinct():
    pairs = [("lab-1", "x"), ("lab", "1-x"), ("Lab", "1-x"), ("lab", "1_x"), ("c" * 200, "a"), ("c" * 200, "b")]
    names = {make_info(c, n, 1).instance_name for c, n in pairs}
    assert len(names) == len(pairs)
    assert make_info("lab", "n1", 1).instance_name.startswith("lab-n1-")


# --------------------------------------------------------------------------- interfaces / facts


def test_resolve_interfaces():
    assert resolve_interfaces(["lo"]) == ["127.0.0.1"]
    assert resolve_interfaces(["127.0.0.1"]) == ["127.0.0.1"]
    assert resolve_interfaces(["lo", "127.0.0.1"]) == ["127.0.0.1"]
    assert resolve_interfaces(["lo,127.0.0.1"]) == ["127.0.0.1"]
    assert resolve_interfaces([]) == [] and resolve_interfaces(None) == []
    with pytest.raises(ValueError, match="unknown network interface"):
        resolve_interfaces(["no-such-if0"])
    foreign = next(f"203.0.113.{i}" for i in range(1, 255)
                   if f"203.0.113.{i}" not in resolve_interfaces([a for a in _adapters()]))
    with pytest.raises(ValueError, match="not assigned"):
        resolve_interfaces([foreign])
    with pytest.raises(ValueError) as exc:
        resolve_interfaces(["lo", "no-such-if0"])
    assert "\n" not in str(exc.value)


def _adapters():
    import ifaddr

    return [a.name for a in ifaddr.get_adapters() if any(ip.is_IPv4 for ip in a.ips)]


def test_local_node_facts():
    facts = local_node_facts()
    assert isinstance(facts["memory_bytes"], int) and facts["memory_bytes"] > 2**20
    assert re.fullmatch(r"[A-Za-z]+-[A-Za-z0-9_]+", facts["platform"])
    assert isinstance(facts["chip"], str) and facts["chip"]


def test_discovery_rejects_bad_arguments():
    with pytest.raises(ValueError):
        Discovery(make_info("lab", "n1", 5000, address="0.0.0.0"), LO)
    with pytest.raises(ValueError):
        Discovery(make_info("lab", "n1", 5000), ["lo"])  # names must be resolved first
    d = Discovery(make_info("lab", "n1", 5000), LO)
    with pytest.raises(ValueError):
        d.update(node_id="n2")
    with pytest.raises(ValueError):
        d.update(colour="red")
    d.update(state="formed")  # not started: just recorded
    assert d.info.state == "formed"
    d.stop()  # never started: no-op
    assert d.peers() == {}


# --------------------------------------------------------------------------- live discovery (loopback)


@pytest.mark.slow  # real network timers (mDNS, heartbeats): seconds of waiting
def test_nodes_find_each_other_update_goodbye_restart_browse(nodes):
    cluster, other = new_cluster(), new_cluster()
    recs = {n: Recorder() for n in ("a", "b", "c")}
    infos = {n: make_info(cluster, n, 6000 + i) for i, n in enumerate(("a", "b", "c"))}
    ds = {n: nodes(infos[n], on_change=recs[n]) for n in infos}
    # Another cluster: "x" (whose on_change raises) sees "good" and "bad" (discovery does not
    # judge secrets: peers prove them over TLS, see test_security.py / test_cluster.py).
    def explode(event, info):
        raise RuntimeError("callback bug")

    infos["x"] = make_info(other, "x", 6100)
    ds["x"] = nodes(infos["x"], on_change=explode)
    others = [nodes(make_info(other, "good", 6101)), nodes(make_info(other, "bad", 6102))]
    t0 = time.monotonic()
    start_all(list(ds.values()) + others)

    # every node of `cluster` sees exactly the two others, with the advertised fields
    for n in ("a", "b", "c"):
        want = {m for m in ("a", "b", "c") if m != n}
        until(lambda: set(ds[n].peers()) == want, 6.0, lambda: (n, ds[n].peers()))
        for m in want:
            assert ds[n].peers()[m] == infos[m]
    found_s = time.monotonic() - t0
    assert found_s < 8.0
    # the other cluster's nodes see only each other (x's raising callback broke nothing) and are
    # seen by nobody here
    until(lambda: set(ds["x"].peers()) == {"good", "bad"}, 5.0, lambda: ds["x"].peers())
    until(lambda: set(others[1].peers()) == {"x", "good"}, 5.0, lambda: others[1].peers())
    assert all(set(ds[n].peers()) <= {"a", "b", "c"} for n in ("a", "b", "c"))
    assert all(e[1] in {"a", "b", "c"} for n in ("a", "b", "c") for e in recs[n].events)
    assert recs["a"].wait(lambda ev: {e[1] for e in ev if e[0] == "added"} == {"b", "c"})

    # a state change reaches the peers as "updated"
    ds["b"].update(state="formed")
    for n in ("a", "c"):
        assert recs[n].wait(lambda ev: ("updated", "b", 6001, "formed") in ev, 4.0), recs[n].events
        assert ds[n].peers()["b"].state == "formed"

    # browse() (a client registering nothing) finds the three, not the other cluster's node
    got = {}
    browsers = [threading.Thread(target=lambda: got.update({"all": browse(cluster, LO, timeout_s=1.5)})),
                threading.Thread(target=lambda: got.update({"other": browse(other, LO, 1.5)}))]
    for t in browsers:
        t.start()
    for t in browsers:
        t.join(10.0)
    assert [i.node_id for i in got["all"]] == ["a", "b", "c"]
    assert got["all"][1] == dataclasses.replace(infos["b"], state="formed")
    assert [i.node_id for i in got["other"]] == ["bad", "good", "x"]

    # stop() sends goodbyes: the peers report "removed" promptly
    t1 = time.monotonic()
    ds["c"].stop()
    ds["c"].stop()  # idempotent
    for n in ("a", "b"):
        assert recs[n].wait(lambda ev: any(e[:2] == ("removed", "c") for e in ev), 3.0), recs[n].events
        assert set(ds[n].peers()) == {"a", "b"} - {n}
    assert time.monotonic() - t1 < 3.0

    # the same node id comes back on another port: seen again, once, with the new port
    restarted = nodes(make_info(cluster, "c", 6202), on_change=Recorder())
    restarted.start()
    for n in ("a", "b"):
        until(lambda: ds[n].peers().get("c") is not None and ds[n].peers()["c"].port == 6202, 5.0,
              lambda: (n, ds[n].peers()))
        assert sorted(ds[n].peers()) == sorted({"a", "b", "c"} - {n})
    until(lambda: set(restarted.peers()) == {"a", "b"}, 5.0, lambda: restarted.peers())
    for n in ("a", "b"):
        assert consistent(recs[n].events), recs[n].events


# --------------------------------------------------------------------------- find_rank0 (client of a cluster)


class FakeNode(pb_grpc.NodeServicer):
    """A node's ``Node`` service on loopback (mutual TLS under ``secret``, certified for
    ``node_id``) answering ``Status`` with :attr:`reply` (settable); :attr:`asked` is set
    by every call."""

    def __init__(self, node_id: str, state: str = "idle", rank: int = 0, secret: str = "pw-0123456789"):
        from mlxcluster.security import credentials, node_name

        self.node_id = node_id
        self.asked = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_NodeServicer_to_server(self, self.server)
        creds = credentials(secret, "fake", [node_name(node_id)])
        self.port = self.server.add_secure_port("127.0.0.1:0", creds.server())
        self.server.start()
        self.set(state, rank)

    def set(self, state: str, rank: int = 0) -> None:
        self.reply = pb.NodeStatusReply(node_id=self.node_id, state=state, rank=rank, world_size=2,
                                        formation_id="f1", rank0_address=f"127.0.0.1:{40000 + self.port % 1000}")

    def Status(self, request, context):
        self.asked.set()
        if self.frozen is not None:
            self.frozen.wait(60.0)  # a frozen node: the call hangs (bounded, for the server's stop)
        return self.reply

    frozen: Optional[threading.Event] = None  # set to an Event: Status hangs until it is set


@pytest.fixture
def fake_nodes():
    made = []

    def make(*args, **kw):
        made.append(FakeNode(*args, **kw))
        return made[-1]

    yield make
    for n in made:
        n.server.stop(0)


@pytest.mark.slow  # real network timers (mDNS, heartbeats): seconds of waiting
def test_find_rank0_skips_strangers_and_returns_once_rank0_is_ready(nodes, fake_nodes, monkeypatch):
    from mlxcluster.security import CLIENT, credentials

    cluster = new_cluster()
    creds = credentials("pw-0123456789", "fake", [CLIENT])
    # a node without the secret claims to be a ready rank 0 (a forged advertisement); another
    # advertises a node id its certificate does not prove; the real rank 0 is still loading
    intruder = fake_nodes("a-intruder", "ready", secret="wrong-secret")
    rank0, rank1 = fake_nodes("n0", "loading"), fake_nodes("n1", "ready", rank=1)
    announced = {n.node_id: nodes(make_info(cluster, n.node_id, n.port, state="idle"))
                 for n in (intruder, rank0, rank1)}
    impostor = nodes(make_info(cluster, "b-impostor", rank1.port, state="formed"))  # n1's endpoint
    start_all(list(announced.values()) + [impostor])

    # No ready rank 0 among the nodes that prove the secret: one line naming every node's state.
    with pytest.raises(ClusterLookupError) as err:
        find_rank0(cluster, creds, LO, timeout_s=3.0)
    assert ("(a-intruder: TLS handshake failed: not the same cluster secret; "
            "b-impostor: TLS: the endpoint does not prove the node id it advertises; "
            "n0: loading; n1: ready)") in str(err.value), err.value
    assert not intruder.asked.is_set()  # the handshake failed: the forger got no request
    with pytest.raises(ClusterLookupError, match="no nodes of cluster"):
        find_rank0(new_cluster(), creds, LO, timeout_s=0.5)

    # Searching with a long timeout, it returns as soon as rank 0 is ready and advertises it -- even
    # with a frozen node in the cluster whose Status never answers (the nodes are asked side by side:
    # asked one after another, the search would wait out that call first, here for 600 s).
    import mlxcluster.cluster.client as cluster_client

    monkeypatch.setattr(cluster_client, "STATUS_TIMEOUT_S", 600.0)
    frozen = fake_nodes("a-frozen", "ready", rank=1)
    frozen.frozen = threading.Event()
    nodes(make_info(cluster, "a-frozen", frozen.port, state="formed")).start()
    rank0.asked.clear()
    done, found = threading.Event(), {}

    def search():
        try:
            found["rank0"] = find_rank0(cluster, creds, LO, timeout_s=600.0)
        finally:
            done.set()

    threading.Thread(target=search, daemon=True).start()
    assert rank0.asked.wait(30.0)  # resolved and asked: still loading
    assert frozen.asked.wait(30.0)  # resolved and asked too: its Status call hangs
    assert not done.is_set()
    rank0.set("ready")
    announced["n0"].update(state="formed")  # what the node daemon advertises once every rank is ready
    assert done.wait(30.0)  # far within the 600 s the search could take
    address, status = found["rank0"]
    assert address == rank0.reply.rank0_address and status.node_id == "n0"
    assert not intruder.asked.is_set()
    assert frozen.asked.is_set()  # it was asked, and hung

    # serve --cluster's long-lived view: a lookup starts from the nodes it already knows, and sees
    # the formation move (here: the one found is excluded, a new one formed on n0)
    from mlxcluster.cluster.client import ClusterView

    view = ClusterView(cluster, LO)
    try:
        assert find_rank0(cluster, creds, view=view, timeout_s=30.0)[1].node_id == "n0"
        rank0.reply.formation_id = "f2"
        assert find_rank0(cluster, creds, view=view, timeout_s=30.0, not_formation="f1")[1].formation_id == "f2"
    finally:
        view.close()
    frozen.frozen.set()


def test_primary_address_is_the_best_ranked_interface():
    import ifaddr

    local = [(str(a.name), ip.ip) for a in ifaddr.get_adapters() for ip in a.ips if ip.is_IPv4]
    wireless = [n for n, _ in local if os.path.exists(f"/sys/class/net/{n}/wireless")]
    ranked = rank_interfaces(local, {}, wireless)
    assert primary_address() == (ranked[0].address if ranked else "127.0.0.1")


MACOS_DATA = os.path.join(os.path.dirname(__file__), "data", "macos")


def _recorded(name):
    with open(os.path.join(MACOS_DATA, name), encoding="utf-8") as fh:
        return fh.read()


def test_rank_interfaces_on_a_recorded_mac():
    """Issue 43, item 9: a Mac Studio with Ethernet, Wi-Fi, a Thunderbolt cable on its own /30, a
    link-local Thunderbolt port and a VPN (recorded ``ifconfig`` and ``networksetup
    -listallhardwareports``).  The first non-loopback address (the old rule) is the Thunderbolt link."""
    from mlxcluster.runtime.thunderbolt import parse_hardware_ports

    addrs = parse_ifconfig_ipv4(_recorded("ifconfig.txt"))
    assert addrs == [("lo0", "127.0.0.1"), ("en2", "192.168.10.1"), ("en3", "169.254.17.3"),
                     ("en1", "192.168.1.21"), ("en0", "192.168.1.20"), ("utun4", "100.101.2.3")]
    ports = {dev: port for port, dev in parse_hardware_ports(_recorded("networksetup_listallhardwareports.txt")).items()}
    ranked = rank_interfaces(addrs, ports)
    assert [(c.interface, c.kind) for c in ranked] == [
        ("en0", "ethernet"), ("en1", "wifi"), ("en2", "thunderbolt"), ("utun4", "vpn"),
        ("en3", "link-local"), ("lo0", "loopback")]
    assert ranked[0].why == "hardware port 'Ethernet'"
    # a MacBook: no Ethernet, Wi-Fi on en0 -- Wi-Fi before the Thunderbolt cable
    laptop = rank_interfaces([("en2", "192.168.10.2"), ("en0", "192.168.1.30")], {"en0": "Wi-Fi", "en2": "Thunderbolt 1"})
    assert laptop[0].interface == "en0" and laptop[0].kind == "wifi"
    # a Thunderbolt-to-Ethernet adapter is Ethernet; only a Thunderbolt link and loopback: the link
    assert interface_kind("en5", "10.0.0.5", "Thunderbolt Ethernet Slot 1")[0] == "ethernet"
    assert rank_interfaces([("lo0", "127.0.0.1"), ("en2", "192.168.10.1")], ports)[0].interface == "en2"


def test_rank_interfaces_by_name_on_linux():
    ranked = rank_interfaces([("lo", "127.0.0.1"), ("docker0", "172.17.0.1"), ("tun0", "10.8.0.2"),
                              ("wlp2s0", "192.168.1.7"), ("enp3s0", "192.168.1.6"), ("veth1a2b", "172.18.0.1")])
    assert [c.interface for c in ranked] == ["enp3s0", "wlp2s0", "docker0", "veth1a2b", "tun0", "lo"]
    assert rank_interfaces([("wlan0", "192.168.1.7"), ("eth0", "10.0.0.1")], wireless=["wlan0"])[0].interface == "eth0"
    # the tests' network namespaces: a veth end renamed eth0 (or lan0) is the LAN
    assert rank_interfaces([("lo", "127.0.0.1"), ("eth0", "10.231.0.2")])[0].interface == "eth0"
    assert rank_interfaces([("lo", "127.0.0.1"), ("lan0", "10.232.0.2")])[0].interface == "lan0"
    with pytest.raises(ValueError):
        rank_interfaces([("eth0", "fe80::1")])


# --------------------------------------------------------------------------- separate processes

RUNNER = r"""
import json, sys, threading
from mlxcluster.cluster.discovery import Discovery, NodeInfo
cfg = json.loads(sys.argv[1])
lock = threading.Lock()
def emit(obj):
    with lock:
        print(json.dumps(obj), flush=True)
def on_change(ev, info):
    emit({"event": ev, "node_id": info.node_id, "port": info.port})
d = Discovery(NodeInfo(**cfg["info"]), ["127.0.0.1"], on_change, ttl_s=cfg["ttl_s"])
d.start()
emit({"event": "ready"})
for line in sys.stdin:  # parent closes stdin -> graceful stop
    if line.strip() == "peers":
        emit({"event": "peers", "peers": sorted(d.peers())})
d.stop()
emit({"event": "stopped"})
"""


class NodeProcess:
    def __init__(self, info: NodeInfo, ttl_s: int):
        cfg = json.dumps({"info": info.__dict__, "ttl_s": ttl_s})
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen([sys.executable, "-c", RUNNER, cfg], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        self.cond = threading.Condition()
        self.messages = []  # everything the node printed, in order
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self.cond:
                self.messages.append(msg)
                self.cond.notify_all()

    def expect(self, pred, timeout=8.0) -> dict:
        """First message so far (or arriving within `timeout`) that satisfies `pred`."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                hit = next((m for m in self.messages if pred(m)), None)
                left = deadline - time.monotonic()
                if hit is not None or left <= 0:
                    break
                self.cond.wait(min(left, 0.1))
        if hit is not None:
            return hit
        err = self.proc.stderr.read() if self.proc.poll() is not None else "(still running)"
        raise AssertionError(f"node process: expected message not seen; stderr: {err}")

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)  # a crash: no goodbye packets
        self.proc.wait(5)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()


@pytest.mark.slow  # real network timers (mDNS, heartbeats): seconds of waiting
def test_processes_crash_restart_and_expiry(nodes):
    """A node in another process: found both ways; SIGKILLed (no goodbye) and restarted on a new
    port within seconds -> seen again once with the new port; kept alive by refreshes across
    several TTLs; SIGKILLed for good -> "removed" once its records expire (ttl 2 s)."""
    cluster = new_cluster()
    ttl = 2
    rec = Recorder()
    a = nodes(make_info(cluster, "a", 6400), on_change=rec)
    procs = []
    try:
        b = NodeProcess(make_info(cluster, "b", 6401, chip="remote chip"), ttl)
        procs.append(b)
        a.start()
        b.expect(lambda m: m["event"] == "ready")
        until(lambda: "b" in a.peers(), 5.0, lambda: a.peers())
        assert a.peers()["b"] == make_info(cluster, "b", 6401, chip="remote chip")
        b.expect(lambda m: m["event"] == "added" and m["node_id"] == "a")

        b.kill()
        b2 = NodeProcess(make_info(cluster, "b", 6402, chip="remote chip"), ttl)
        procs.append(b2)
        b2.expect(lambda m: m["event"] == "ready")
        until(lambda: a.peers().get("b") is not None and a.peers()["b"].port == 6402, 5.0, lambda: a.peers())
        assert list(a.peers()) == ["b"]
        b2.expect(lambda m: m["event"] == "added" and m["node_id"] == "a")

        # live: refresh queries keep b's short-TTL records fresh at a, no spurious "removed"
        n_before = len(rec.events)
        time.sleep(1.5 * ttl)  # > ttl: without refreshes the records would expire
        assert list(a.peers()) == ["b"] and a.peers()["b"].port == 6402
        assert all(e[0] != "removed" for e in rec.events[n_before:]), rec.events

        t_kill = time.monotonic()
        b2.kill()
        assert rec.wait(lambda ev: ev[-1][:2] == ("removed", "b"), ttl + 3.0), rec.events
        assert time.monotonic() - t_kill < ttl + 3.0
        assert a.peers() == {}
        assert consistent(rec.events), rec.events
        assert [e for e in rec.events if e[1] == "a"] == []
    finally:
        for p in procs:
            p.kill()


@pytest.mark.slow  # real network timers (mDNS, heartbeats): seconds of waiting
def test_process_goodbye(nodes):
    cluster = new_cluster()
    rec = Recorder()
    a = nodes(make_info(cluster, "a", 6500), on_change=rec)
    b = NodeProcess(make_info(cluster, "b", 6501), 60)
    try:
        a.start()
        b.expect(lambda m: m["event"] == "ready")
        until(lambda: "b" in a.peers(), 5.0, lambda: a.peers())
        # b's own view may lag a's under load (its resolution of a's record): ask until it sees a
        t_end = time.monotonic() + 20.0
        while True:
            b.proc.stdin.write("peers\n")
            b.proc.stdin.flush()
            try:
                b.expect(lambda m: m["event"] == "peers" and m["peers"] == ["a"], 2.0)
                break
            except AssertionError:
                assert time.monotonic() < t_end, "node b never saw node a"
        b.close()  # graceful: Discovery.stop() -> goodbye
        assert rec.wait(lambda ev: ("removed", "b", 6501, "idle") in ev, 3.0), rec.events
    finally:
        b.kill()


# --------------------------------------------------------------------------- name conflicts


@pytest.mark.slow  # real network timers (mDNS, heartbeats): seconds of waiting
def test_name_conflicts(nodes):
    """A live responder still holding this node's name at the same address:port (an old
    incarnation) is taken over, and its later goodbye does not remove the new node; a live node
    with the same node id elsewhere (a duplicate) makes start() fail with DiscoveryError."""
    cluster = new_cluster()
    rec = Recorder()
    watcher = nodes(make_info(cluster, "w", 6600), on_change=rec)
    me = make_info(cluster, "me", 6601, state="new")
    ghost_zc = Zeroconf(interfaces=LO, ip_version=IPVersion.V4Only)
    try:
        ghost = ServiceInfo(SERVICE_TYPE, me.service_name, addresses=[socket.inet_aton("127.0.0.1")], port=6601,
                            properties=encode_txt(make_info(cluster, "me", 6601, state="old")),
                            server=f"{me.instance_name}.local.")
        ghost_up = threading.Thread(target=ghost_zc.register_service, args=(ghost,))
        ghost_up.start()
        start_all([watcher])
        ghost_up.join(10.0)
        until(lambda: watcher.peers().get("me", None) is not None, 5.0, lambda: watcher.peers())

        d = nodes(me)
        d.start()  # takes the name over
        until(lambda: getattr(watcher.peers().get("me"), "state", None) == "new", 5.0, lambda: watcher.peers())
        ghost_zc.unregister_service(ghost)  # the old incarnation finally says goodbye
        assert rec.wait(lambda ev: any(e[:2] == ("removed", "me") for e in ev), 3.0), rec.events
        until(lambda: getattr(watcher.peers().get("me"), "state", None) == "new", 4.0, lambda: rec.events)

        # A late goodbye carrying exactly this node's records (an old incarnation with the same
        # data exits): peers drop the name, and only the node's own defence brings it back.
        twin = ServiceInfo(SERVICE_TYPE, me.service_name, addresses=[socket.inet_aton("127.0.0.1")], port=6601,
                           properties=encode_txt(me), server=f"{me.instance_name}.local.")
        # register_service returns once the twin's announcements are sent: they take as long as
        # the node's own, which began before the watcher re-added it, so those are over too
        ghost_zc.register_service(twin, cooperating_responders=True)
        # the watcher has it (its last word on "me" is a presence: re-added after the ghost's
        # goodbye, possibly first from a cached TXT and then updated, as zeroconf does here)
        assert rec.wait(lambda ev: ev[-1][:2] in (("added", "me"), ("updated", "me"))), rec.events
        n_removed = sum(e[0] == "removed" for e in rec.events)
        ghost_zc.unregister_service(twin)
        assert rec.wait(lambda ev: sum(e[0] == "removed" for e in ev) > n_removed, 3.0), rec.events
        until(lambda: getattr(watcher.peers().get("me"), "state", None) == "new", 4.0, lambda: rec.events)

        dup = nodes(make_info(cluster, "me", 6699), conflict_wait_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(DiscoveryError, match="already announced"):
            dup.start()
        assert time.monotonic() - t0 < 8.0
        assert not dup.started
        assert watcher.peers()["me"].port == 6601
        assert consistent(rec.events), rec.events
    finally:
        ghost_zc.close()


# --------------------------------------------------------------------------- join's node ids


@pytest.mark.slow  # real network timers (mDNS, heartbeats): seconds of waiting
def test_join_default_node_ids_are_unique_per_process(tmp_path):
    """Two node daemons on one host without --node-id get distinct ids (hostname, address, port)
    and see each other live (a duplicate id fails in Discovery.start: test_name_conflicts)."""
    from mlxcluster.cluster.node import NodeConfig, NodeDaemon

    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(64))
    cluster = new_cluster()

    def daemon(node_id=""):
        return NodeDaemon(NodeConfig(cluster=cluster, address="127.0.0.1", interfaces=LO, node_id=node_id,
                                     model_path=str(model), world_size=3, secret="s", valid_world_sizes=[3]))

    a, b = daemon(), daemon()
    assert a.cfg.node_id != b.cfg.node_id and a.cfg.node_id.endswith(f"-{a.cfg.port}")
    threads = [threading.Thread(target=d.run, daemon=True) for d in (a, b)]
    for t in threads:
        t.start()
    try:
        until(lambda: a.status().coordinator_id == b.status().coordinator_id == min(a.cfg.node_id, b.cfg.node_id),
              15.0, lambda: (a.status(), b.status()))
        assert a.status().state == "idle" and a.status().formation_id == ""  # 2 of 3 nodes: no formation
    finally:
        for d in (a, b):
            d.stop()
        for t in threads:
            t.join(10.0)
    assert not any(t.is_alive() for t in threads)

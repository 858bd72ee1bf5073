"""Hosts on one private link, made of Linux network namespaces (root only).

``bridged_hosts(n)`` creates ``n`` namespaces, each with an ``eth0`` (a veth pair's end)
holding ``10.231.X.i/24`` and a multicast route (mDNS), all plugged into a bridge that
lives in a namespace of its own, and deletes them all on exit.  Used by the namespace
tests (tests/test_cluster.py) and benchmarks/bench_join.py.  ``root_link(hosts)`` plugs this
(the root) namespace into the same bridge, for a process here -- ``serve --cluster`` and the
test's HTTP clients on loopback -- that talks to the hosts as one more machine on their link.
``second_link(hosts)`` gives the same hosts a second interface ``lan0`` on a bridge of its own (two
networks, e.g. collectives on one and the control link on the other: benchmarks/bench_control_link.py).
``direct_links(hosts, cables)`` adds point-to-point links, one /30 each, as Thunderbolt cables between Macs
(tests/test_cluster.py's Mac-shaped network).  ``private_loopback()`` is one namespace with only its own
``lo``: a packet capture there sees one test's traffic, not the other test worker's (tests/test_security.py).
"""

from __future__ import annotations

import contextlib
import select
import subprocess
import sys
import uuid
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

__all__ = ["NetnsError", "private_loopback", "bridged_hosts", "bridge_namespace", "root_link", "second_link", "direct_links",
           "slow_wire"]


class NetnsError(RuntimeError):
    """Network namespaces cannot be created here (not root, no ``ip``)."""


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check, timeout=30)


def bridge_namespace(hosts: List[Tuple[str, str]]) -> str:
    """The name of the bridge's namespace of ``hosts`` (from :func:`bridged_hosts`)."""
    return hosts[0][0][:-2] + "br"


@contextlib.contextmanager
def private_loopback() -> Iterator[str]:
    """One namespace with its own ``lo`` up and nothing else: yields its name (run in it with
    ``ip netns exec NAME ...``), and deletes it on exit.

    Raises:
        NetnsError: namespaces cannot be created here.
    """
    ns = f"mlxc{uuid.uuid4().hex[:6]}lo"
    try:
        _sh("ip", "netns", "add", ns)
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        raise NetnsError(f"cannot create network namespaces here: {getattr(exc, 'stderr', exc)}") from None
    try:
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield ns
    finally:
        _sh("ip", "netns", "del", ns, check=False)


@contextlib.contextmanager
def bridged_hosts(n: int = 3) -> Iterator[List[Tuple[str, str]]]:
    """``n`` hosts on one bridge: yields ``[(namespace, ipv4), ...]``.

    Raises:
        NetnsError: namespaces cannot be created here.
        subprocess.CalledProcessError: a later ``ip`` command failed (everything made is removed).
    """
    tag = uuid.uuid4().hex[:4]
    br_ns = f"mlxc{tag}br"
    hosts = [(f"mlxc{tag}h{i}", f"10.231.{int(tag, 16) % 250}.{i + 1}") for i in range(n)]
    try:
        _sh("ip", "netns", "add", br_ns)
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        raise NetnsError(f"cannot create network namespaces here: {getattr(exc, 'stderr', exc)}") from None
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


@contextlib.contextmanager
def root_link(hosts: List[Tuple[str, str]]) -> Iterator[Tuple[str, str]]:
    """A veth pair from the root namespace onto the bridge of ``hosts`` (from :func:`bridged_hosts`):
    yields ``(interface, ipv4)`` of its root end (``10.231.X.200/24``), deleted on exit.  No route is
    added here: mDNS works because zeroconf sends and joins the group on the interface's address.

    Raises:
        subprocess.CalledProcessError: an ``ip`` command failed (what was made is removed).
    """
    tag = hosts[0][0][4:8]
    ip = hosts[0][1].rsplit(".", 1)[0] + ".200"
    root_if, bridge_if = f"mx{tag}r", f"mx{tag}rb"
    _sh("ip", "link", "add", root_if, "type", "veth", "peer", "name", bridge_if)
    try:
        _sh("ip", "link", "set", bridge_if, "netns", bridge_namespace(hosts))
        _sh("ip", "-n", bridge_namespace(hosts), "link", "set", bridge_if, "master", "br0")
        _sh("ip", "-n", bridge_namespace(hosts), "link", "set", bridge_if, "up")
        _sh("ip", "addr", "add", f"{ip}/24", "dev", root_if)
        _sh("ip", "link", "set", root_if, "up")
        yield root_if, ip
    finally:
        _sh("ip", "link", "del", root_if, check=False)


@contextlib.contextmanager
def second_link(hosts: List[Tuple[str, str]], ifname: str = "lan0") -> Iterator[Tuple[str, List[str]]]:
    """A second network for the hosts of :func:`bridged_hosts`: in each host's namespace an
    interface ``ifname`` (a veth pair's end, ``10.232.X.i/24``) plugged into a new bridge in a
    namespace of its own.  Yields ``(bridge namespace, [ipv4 of each host on it])``; removed on exit.
    Its bridge ends are named ``lx{tag}{i}b`` (for :func:`slow_wire`'s ``end``).

    Raises:
        subprocess.CalledProcessError: an ``ip`` command failed (what was made is removed).
    """
    tag = hosts[0][0][4:8]
    br_ns = f"mlxc{tag}lb"
    ips = [f"10.232.{int(tag, 16) % 250}.{i + 1}" for i in range(len(hosts))]
    _sh("ip", "netns", "add", br_ns)
    try:
        _sh("ip", "-n", br_ns, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", br_ns, "link", "set", "br0", "up")
        for i, ((ns, _ip), ip) in enumerate(zip(hosts, ips)):
            a, b = f"lx{tag}{i}a", f"lx{tag}{i}b"
            _sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            _sh("ip", "link", "set", a, "netns", ns)
            _sh("ip", "link", "set", b, "netns", br_ns)
            _sh("ip", "-n", ns, "link", "set", a, "name", ifname)
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", ifname)
            _sh("ip", "-n", ns, "link", "set", ifname, "up")
            _sh("ip", "-n", br_ns, "link", "set", b, "master", "br0")
            _sh("ip", "-n", br_ns, "link", "set", b, "up")
        yield br_ns, ips
    finally:
        _sh("ip", "netns", "del", br_ns, check=False)  # its veth ends go, and with them the hosts' ends


@contextlib.contextmanager
def direct_links(hosts: List[Tuple[str, str]], cables: Sequence[Tuple[Tuple[int, str, str], Tuple[int, str, str]]]
                 ) -> Iterator[None]:
    """Point-to-point links between the hosts of :func:`bridged_hosts`, as Thunderbolt cables between
    Macs: one veth pair per cable, each end renamed to its Mac interface (e.g. ``en2``) and given its
    address on the cable's own /30.  ``cables``: ``((host index, ifname, ipv4/prefix), (host index,
    ifname, ipv4/prefix))`` per cable.  Removed on exit (with the hosts' namespaces at the latest).

    Raises:
        subprocess.CalledProcessError: an ``ip`` command failed (what was made is removed).
    """
    tag = hosts[0][0][4:8]
    made = []
    try:
        for k, ends in enumerate(cables):
            names = [f"tb{tag}{k}a", f"tb{tag}{k}b"]
            _sh("ip", "link", "add", names[0], "type", "veth", "peer", "name", names[1])
            made.append((None, names[0]))
            for name, (i, ifname, address) in zip(names, ends):
                ns = hosts[i][0]
                _sh("ip", "link", "set", name, "netns", ns)
                _sh("ip", "-n", ns, "link", "set", name, "name", ifname)
                _sh("ip", "-n", ns, "addr", "add", address, "dev", ifname)
                _sh("ip", "-n", ns, "link", "set", ifname, "up")
            made[-1] = (hosts[ends[0][0]][0], ends[0][1])
        yield
    finally:
        for ns, ifname in made:
            _sh(*(["ip", "-n", ns] if ns else ["ip"]), "link", "del", ifname, check=False)


@contextlib.contextmanager
def slow_wire(hosts: List[Tuple[str, str]], index: int, delay_ms: float, rate_mbit: float,
              preexec_fn: Optional[Callable[[], None]] = None, *, bridge_ns: str = "", end: str = "",
              wire_args: Sequence[str] = ()) -> Iterator[subprocess.Popen]:
    """Put host ``index`` of :func:`bridged_hosts` behind a slow link: its veth's bridge end moves into a
    namespace of its own, bridged to a TAP device; a second TAP device there is bridged, through a new
    veth pair, back onto the hosts' bridge; :mod:`benchmarks.wire` copies frames between the two TAP
    devices ``delay_ms`` (one way, each direction) and ``rate_mbit`` (Mbit/s, 0: unlimited) later -- tc
    netem's delay and rate, in user space (kernels without ``sch_netem``).  Still one Ethernet segment
    (mDNS works).  Yields the forwarder's process (``preexec_fn`` runs in it before it starts: e.g. a
    cgroup); everything is removed on exit.  ``bridge_ns``/``end``: another bridge's namespace and that
    host's veth end on it (default: the hosts' own bridge; e.g. :func:`second_link`'s); ``wire_args``:
    more options of :mod:`benchmarks.wire` (``--jitter-ms``, ``--late-pct``, ``--late-ms``, ``--seed``).

    Raises:
        subprocess.CalledProcessError: an ``ip`` command failed; RuntimeError: the forwarder did not start.
    """
    tag = hosts[0][0][4:8]
    other = bool(bridge_ns)
    br_ns = bridge_ns or bridge_namespace(hosts)
    wire_ns = f"mlxc{tag}{'l' if other else 'w'}{index}"
    end = end or f"mx{tag}{index}b"
    va, vb = f"w{'l' if other else 'v'}{tag}{index}a", f"w{'l' if other else 'v'}{tag}{index}b"
    _sh("ip", "netns", "add", wire_ns)
    proc = None
    try:
        for brname in ("brA", "brB"):
            _sh("ip", "-n", wire_ns, "link", "add", brname, "type", "bridge")
            _sh("ip", "-n", wire_ns, "link", "set", brname, "up")
        _sh("ip", "-n", br_ns, "link", "set", end, "nomaster")
        _sh("ip", "-n", br_ns, "link", "set", end, "netns", wire_ns)
        _sh("ip", "-n", wire_ns, "link", "set", end, "master", "brA")
        _sh("ip", "-n", wire_ns, "link", "set", end, "up")
        _sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        _sh("ip", "link", "set", va, "netns", wire_ns)
        _sh("ip", "link", "set", vb, "netns", br_ns)
        _sh("ip", "-n", wire_ns, "link", "set", va, "master", "brB")
        _sh("ip", "-n", wire_ns, "link", "set", va, "up")
        _sh("ip", "-n", br_ns, "link", "set", vb, "master", "br0")
        _sh("ip", "-n", br_ns, "link", "set", vb, "up")
        for tap in ("tapA", "tapB"):
            _sh("ip", "netns", "exec", wire_ns, "ip", "tuntap", "add", "dev", tap, "mode", "tap")
        proc = subprocess.Popen(["ip", "netns", "exec", wire_ns, sys.executable, "-m", "benchmarks.wire", "tapA",
                                 "tapB", "--delay-ms", str(delay_ms), "--rate-mbit", str(rate_mbit), *wire_args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                preexec_fn=preexec_fn)
        ready, _, _ = select.select([proc.stdout], [], [], 30.0)
        if not ready or proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the slow-link forwarder did not start: {proc.stderr.read(500) if proc.poll() else ''}")
        for tap, brname in (("tapA", "brA"), ("tapB", "brB")):
            _sh("ip", "-n", wire_ns, "link", "set", tap, "master", brname)
            _sh("ip", "-n", wire_ns, "link", "set", tap, "up")
        yield proc
    finally:
        if proc is not None:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        _sh("ip", "netns", "del", wire_ns, check=False)

"""The Thunderbolt network plan a join would apply, computed as MLX's own ``mlx.distributed_config`` does.

Input: one :class:`RecordedNode` per Mac (its host name and what five macOS tools printed).
Output: a :class:`NetworkPlan`: every cable with both ends and one /30 per cable, the commands
each Mac runs, the jaccl ``MLX_IBV_DEVICES`` matrix and whether jaccl runs as a ring
(``MLX_JACCL_RING=1``), the TCP ring hostfile on the per-cable addresses, and the problems
found, each with its fix.  Pure but for :func:`read_recorded`, which reads recorded outputs.

Followed, from MLX 0.32.4 ``mlx/_distributed_utils/config.py`` (``mlx.distributed_config``):

* connectivity (``extract_connectivity``): :func:`thunderbolt.parse_thunderbolt`; the ports of
  each Mac sorted by interface name; a port whose peer uuid no node reports is not a cable.
* addresses (``IPConfigurator``): ONE enumeration over the nodes in order and their ports in
  order; the n-th cable gets ``192.168.{n // 64}.{4 (n % 64) + 1}`` on the port enumerated first
  and ``... + 2`` on the other end (netmask ``255.255.255.252``, a /30 per cable).
* commands (``IPConfigurator.setup``): ``ifconfig bridge0 down``, then per peer in node order and
  per cable ``ifconfig enX inet A netmask 255.255.255.252`` and ``route change PEER -interface enX``.
* backend (``prepare_tb_hostfile``, no ``--backend``): ``jaccl`` with RDMA on every node and a full
  mesh; else ``jaccl-ring`` with RDMA and a ring through every node (``extract_rings``'s first,
  longest ring); else ``ring``.  Matrix: ``configure_jaccl`` / ``configure_jaccl_ring``; TCP ring
  hostfile: ``configure_ring`` (rank i's addresses on its cables to rank i-1).

Beyond MLX's tool:

* ``MLX_JACCL_RING=1`` also for a full mesh whose every pair has several cables: jaccl's mesh
  uses only entry ``[0]`` of each cell, its ring stripes over all (exo PR #2160).
* Thunderbolt 4 cables (<= 40 Gb/s) keep their /30 (the TCP ring works over them) but are kept
  out of jaccl: macOS 26 makes ``rdma_enX`` on TB4 ports too and jaccl crashes in ``ibv_reg_mr``
  (exo #2186, mlx #3777).
* problems: a cabled port without IPv4 address (RDMA ports publish their GID only once the
  interface has one, MLX ``rdma.cpp`` PR #4191; older builds fail "RTR errno 22", mlx #3467);
  ``bridge0`` up with Thunderbolt members (in a loop of 3+ Macs broadcasts storm: exo PR #1222).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

from .thunderbolt import Interface, thunderbolt4, parse_hardware_ports, parse_ibv_devices, parse_ifconfig, \
    parse_thunderbolt, thunderbolt_links

__all__ = ["RecordedNode", "Interface", "CableEnd", "Cable", "Problem", "RankNetwork", "NetworkPlan",
           "RECORDED_FILES", "NETMASK", "read_recorded", "read_recorded_node", "parse_ifconfig", "extract_rings", "network_plan", "describe",
           "unaddressed_ports", "cable_addresses", "local_commands"]

#: The netmask of each cable's network (MLX ``IPConfigurator.setup``): a /30, two hosts.
NETMASK = "255.255.255.252"
#: :class:`RecordedNode` field -> the file ``--recorded DIR/<host>/`` holds it in.
RECORDED_FILES = {"system_profiler": "system_profiler_SPThunderboltDataType.json",
                  "networksetup": "networksetup_listallhardwareports.txt", "ifconfig": "ifconfig.txt",
                  "ibv_devices": "ibv_devices.txt", "sw_vers": "sw_vers.txt"}

Device = Union[str, List[str]]


@dataclass(frozen=True)
class RecordedNode:
    """What the macOS tools printed on one Mac.

    Attributes:
        host: the Mac's host name (its folder name under ``--recorded``).
        system_profiler: ``system_profiler SPThunderboltDataType -json``.
        networksetup: ``networksetup -listallhardwareports``.
        ifconfig: ``ifconfig`` (every interface; ``""``: not recorded, addresses unchecked).
        ibv_devices: ``ibv_devices`` (``""``: not recorded, RDMA assumed on).
        sw_vers: ``sw_vers``.
    """

    host: str
    system_profiler: str
    networksetup: str
    ifconfig: str = ""
    ibv_devices: str = ""
    sw_vers: str = ""


@dataclass(frozen=True)
class CableEnd:
    """One end of a cable: the Mac, its interface (``"en2"``) and the IPv4 address the plan gives it."""

    host: str
    iface: str
    address: str


@dataclass(frozen=True)
class Cable:
    """One Thunderbolt cable between two Macs.

    Attributes:
        a: the end MLX's enumeration meets first (address ``.1`` of the /30), ``b`` the other (``.2``).
        network: its /30, e.g. ``"192.168.0.0/30"``.
        speed_gbps: the slower end's ``current_speed_key`` in Gb/s (``None``: not reported).
        jaccl: whether jaccl may use it (not Thunderbolt 4).
    """

    a: CableEnd
    b: CableEnd
    network: str
    speed_gbps: Optional[float]
    jaccl: bool


@dataclass(frozen=True)
class Problem:
    """One problem of the network: ``check`` (``"tb4"``, ``"no-address"``, ``"bridge"``, ``"bridge-loop"``
    (bridge0 up and the cables form a loop of 3+ Macs), ``"rdma"``, ``"cabling"``), the ``host`` it concerns (``""``: all), ``what`` is wrong, the ``fix`` command."""

    check: str
    host: str
    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.host + ': ' if self.host else ''}{self.what}; fix: {self.fix}"


@dataclass(frozen=True)
class RankNetwork:
    """The network of ranks in a given order (:meth:`NetworkPlan.for_ranks`).

    Attributes:
        hosts: the host of each rank.
        ring_hostfile: per rank its addresses on its cables to rank i-1 (MLX's ring hostfile
            ``ips``), or ``None`` when a ring neighbour pair has no cable.
        jaccl_devices: the N x N ``MLX_IBV_DEVICES`` matrix (``None`` on the diagonal, and off the
            ring neighbours in ring mode), or ``None`` when jaccl cannot run in this order.
        jaccl_ring: whether to set ``MLX_JACCL_RING=1``.
        problem: one line why ``ring_hostfile`` or ``jaccl_devices`` is ``None`` (``""``: none).
    """

    hosts: Tuple[str, ...]
    ring_hostfile: Optional[List[List[str]]]
    jaccl_devices: Optional[List[List[Optional[Device]]]]
    jaccl_ring: bool
    problem: str = ""


@dataclass(frozen=True)
class NetworkPlan:
    """The Thunderbolt network of a group of Macs (:func:`network_plan`).

    Attributes:
        hosts: the Macs, in the order given (MLX's ``--hosts`` order: it fixes the addresses).
        cables: every cable between two of them, in MLX's enumeration order.
        connectivity: N x N cable counts (``make_connectivity_matrix``).
        commands: host -> the commands MLX's setup runs there (without ``sudo``).
        backend: what ``mlx.distributed_config`` picks: ``"jaccl"``, ``"jaccl-ring"``, ``"ring"``,
            or ``""`` (neither a mesh nor a ring, or one Mac).
        jaccl_order: the hosts in jaccl rank order (``hosts``; the ring's order for ``jaccl-ring``).
        jaccl_devices: the ``MLX_IBV_DEVICES`` matrix in ``jaccl_order`` (``None``: no jaccl).
        jaccl_ring: whether jaccl runs as a ring (``MLX_JACCL_RING=1``): ``jaccl-ring``, or a mesh
            with several cables per pair (exo PR #2160).
        ring_order: the hosts in TCP ring rank order (``extract_rings``' first ring; ``()``: no ring).
        ring_hostfile: per rank of ``ring_order`` its addresses (``configure_ring``).
        problems: what stands in the way, each with its fix.
    """

    hosts: Tuple[str, ...]
    cables: Tuple[Cable, ...]
    connectivity: List[List[int]]
    commands: Dict[str, Tuple[str, ...]]
    backend: str
    jaccl_order: Tuple[str, ...]
    jaccl_devices: Optional[List[List[Optional[Device]]]]
    jaccl_ring: bool
    ring_order: Tuple[str, ...]
    ring_hostfile: Optional[List[List[str]]]
    problems: Tuple[Problem, ...] = ()
    _links: Dict[Tuple[int, int], List[int]] = field(default_factory=dict, repr=False, compare=False)

    def to_dict(self) -> dict:
        """JSON-serialisable: every field, ``problems`` as one-line strings and as objects."""
        out = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        out["cables"] = [dict(asdict(c)) for c in self.cables]
        out["commands"] = {h: list(c) for h, c in self.commands.items()}
        out["problems"] = [str(p) for p in self.problems]
        out["problem_details"] = [asdict(p) for p in self.problems]
        return out

    def for_ranks(self, hosts: Sequence[str]) -> RankNetwork:
        """The ring hostfile (per-cable addresses), the jaccl matrix and ring flag for ranks whose
        hosts are ``hosts``, in rank order (e.g. a formation's).

        Raises:
            ValueError: a host not in the plan, or named twice.
        """
        idx = []
        for h in hosts:
            if h not in self.hosts:
                raise ValueError(f"host {h!r} is not in the network plan ({', '.join(self.hosts)})")
            idx.append(self.hosts.index(h))
        if len(set(idx)) != len(idx):
            raise ValueError("a host is named twice in the rank order")
        ring, why_ring = _ring_hostfile(self, idx)
        devices, why_jaccl = _jaccl_matrix(self, idx)
        return RankNetwork(tuple(hosts), ring, devices, self.jaccl_ring and devices is not None,
                           "; ".join(w for w in (why_ring, why_jaccl) if w))


# --------------------------------------------------------------------------- recorded outputs


def read_recorded(directory: str) -> List[RecordedNode]:
    """Every node's recorded tool outputs: one subfolder per node, named by its host name, holding
    the files of :data:`RECORDED_FILES`; nodes sorted by host name.

    Raises:
        ValueError: ``directory`` is no folder, holds no subfolder, or a file is missing or unreadable.
    """
    if not os.path.isdir(directory):
        raise ValueError(f"--recorded {directory}: not a folder")
    hosts = sorted(d for d in os.listdir(directory) if os.path.isdir(os.path.join(directory, d)))
    if not hosts:
        raise ValueError(f"--recorded {directory}: no node folders (one per host name)")
    nodes = [read_recorded_node(directory, [host]) for host in hosts]
    return nodes


def read_recorded_node(directory: str, names: Sequence[str]) -> RecordedNode:
    """One node's recorded tool outputs: ``directory/<name>`` for the first of ``names`` (e.g. the
    node id, then the host name) that is a folder there.

    Raises:
        ValueError: no such folder, or a file of :data:`RECORDED_FILES` is missing or unreadable.
    """
    for name in names:
        if name and os.path.isdir(os.path.join(directory, name)):
            texts = {}
            for key, file in RECORDED_FILES.items():
                path = os.path.join(directory, name, file)
                try:
                    with open(path, encoding="utf-8") as f:
                        texts[key] = f.read()
                except (OSError, UnicodeDecodeError) as exc:
                    raise ValueError(f"--recorded: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") \
                        from None
            return RecordedNode(host=name, **texts)
    raise ValueError(f"--recorded {directory}: no folder for this node (looked for "
                     f"{', '.join(repr(n) for n in names if n)})")


# --------------------------------------------------------------------------- the plan


def extract_rings(connectivity: Sequence[Sequence[int]]) -> List[Tuple[List[int], int]]:
    """Every ring through the cabling, longest first: ``(nodes, cables on its thinnest edge)``.
    Copied from MLX ``config.py: extract_rings`` (same order of search, so the same first ring)."""
    rings, seen, n = [], set(), len(connectivity)

    def dfs(start, node, path, visited):
        path.append(node)
        visited.add(node)
        for j in range(n):
            if connectivity[node][j] <= 0:
                continue
            if j == start:
                yield path[:]
            if j not in visited:
                yield from dfs(start, j, path, visited)
        path.pop()
        visited.remove(node)

    for start in range(n):
        for r in dfs(start, start, [], set()):
            key = tuple(sorted(r))
            if key not in seen:
                rings.append((r, min(connectivity[r[i]][r[(i + 1) % len(r)]] for i in range(len(r)))))
                seen.add(key)
    return sorted(rings, key=lambda x: -len(x[0]))


def _address(k: int, end: int) -> str:
    """The address of end ``end`` (1 or 2) of the k-th cable (MLX ``IPConfigurator``'s counters)."""
    ip0, ip1 = divmod(4 * k, 256)
    if ip0 > 255:
        raise ValueError("too many cables: ran out of addresses in 192.168.0.0/16")
    return f"192.168.{ip0}.{ip1 + end}"


def _cables(nodes: Sequence[RecordedNode]) -> Tuple[List[Cable], Dict[Tuple[int, int], List[int]]]:
    """The cables (MLX's one enumeration) and ``links[(i, j)]``: indices of the cables from node i to j."""
    ports, speeds = [], []
    for node in nodes:
        hw = parse_hardware_ports(node.networksetup)
        try:
            ports.append(parse_thunderbolt(node.system_profiler, hw))
        except ValueError as exc:
            raise ValueError(f"{node.host}: {exc}") from None
        speeds.append({link["uuid"]: link["speed_gbps"] for link in thunderbolt_links(node.system_profiler, hw)})
    where: Dict[str, Tuple[int, int]] = {}
    for i, node_ports in enumerate(ports):
        for k, p in enumerate(node_ports):
            if p.uuid in where:
                raise ValueError(f"Thunderbolt port {p.uuid} reported by both {nodes[where[p.uuid][0]].host} "
                                 f"and {nodes[i].host}")
            where[p.uuid] = (i, k)
    cables: List[Cable] = []
    links: Dict[Tuple[int, int], List[int]] = {}
    assigned = set()
    for i, node_ports in enumerate(ports):
        for k, p in enumerate(node_ports):
            if not p.connected_to or p.connected_to not in where or (i, k) in assigned:
                continue
            j, m = where[p.connected_to]
            n = len(cables)
            ends = (speeds[i].get(p.uuid), speeds[j].get(ports[j][m].uuid))
            known = [s for s in ends if s is not None]
            cables.append(Cable(CableEnd(nodes[i].host, p.iface, _address(n, 1)),
                                CableEnd(nodes[j].host, ports[j][m].iface, _address(n, 2)),
                                f"{_address(n, 0)}/30", min(known) if known else None, not thunderbolt4(*ends)))
            links.setdefault((i, j), []).append(n)
            links.setdefault((j, i), []).append(n)
            assigned.update({(i, k), (j, m)})
    return cables, links


def _end(cable: Cable, host: str, other: str) -> Tuple[CableEnd, CableEnd]:
    """``(this end, the peer's end)`` of ``cable`` seen from ``host`` (toward ``other``)."""
    if cable.a.host == host and cable.b.host == other:
        return cable.a, cable.b
    return cable.b, cable.a


def _address_commands(iface: str, mine: str, peer: str) -> List[str]:
    """MLX ``IPConfigurator.setup``'s two commands for one cable's end: this end's address on its /30,
    and the route to the other end over that interface."""
    return [f"ifconfig {iface} inet {mine} netmask {NETMASK}", f"route change {peer} -interface {iface}"]


def _commands(hosts: Sequence[str], cables: Sequence[Cable], links) -> Dict[str, Tuple[str, ...]]:
    """MLX ``IPConfigurator.setup``'s commands per host (without ``sudo``)."""
    out = {}
    for i, host in enumerate(hosts):
        cmds = ["ifconfig bridge0 down"]
        for j, other in enumerate(hosts):
            for c in links.get((i, j), []) if i != j else []:
                mine, peer = _end(cables[c], host, other)
                cmds += _address_commands(mine.iface, mine.address, peer.address)
        out[host] = tuple(cmds)
    return out


def _counts(n: int, links, cables, jaccl_only: bool) -> List[List[int]]:
    return [[len([c for c in links.get((i, j), []) if cables[c].jaccl or not jaccl_only]) if i != j else 0
             for j in range(n)] for i in range(n)]


def network_plan(nodes: Sequence[RecordedNode]) -> NetworkPlan:
    """The network plan of ``nodes`` (in MLX's ``--hosts`` order: it fixes which end is ``.1``).

    Returns:
        :class:`NetworkPlan`; a problem never raises (it is in ``problems``).
    Raises:
        ValueError: no node, a host named twice, unreadable ``system_profiler`` output, a Thunderbolt
            port ``networksetup`` does not list, or a port uuid reported by two nodes.
    """
    hosts = tuple(n.host for n in nodes)
    if not hosts:
        raise ValueError("no nodes to plan")
    if len(set(hosts)) != len(hosts):
        raise ValueError("a host name is given twice")
    cables, links = _cables(nodes)
    n = len(hosts)
    conn, jconn = _counts(n, links, cables, False), _counts(n, links, cables, True)
    rings, jrings = extract_rings(conn), extract_rings(jconn)
    ring = rings[0][0] if rings and len(rings[0][0]) == n and n > 1 else []
    jring = jrings[0][0] if jrings and len(jrings[0][0]) == n and n > 1 else []
    mesh = n > 1 and all(jconn[i][j] > 0 for i in range(n) for j in range(n) if i != j)
    rdma = [parse_ibv_devices(node.ibv_devices) if node.ibv_devices else None for node in nodes]
    has_rdma = all(d is None or d for d in rdma)
    backend = ("jaccl" if has_rdma and mesh else "jaccl-ring" if has_rdma and jring else "ring" if ring else "")
    jorder = tuple(hosts[k] for k in jring) if backend == "jaccl-ring" else hosts
    several = mesh and min(jconn[i][j] for i in range(n) for j in range(n) if i != j) > 1
    plan = NetworkPlan(hosts, tuple(cables), conn, _commands(hosts, cables, links), backend, jorder, None,
                       backend == "jaccl-ring" or (backend == "jaccl" and several),
                       tuple(hosts[k] for k in ring), None, (), links)
    devices = _jaccl_matrix(plan, [hosts.index(h) for h in jorder])[0] if backend.startswith("jaccl") else None
    hostfile = _ring_hostfile(plan, ring)[0] if ring else None
    problems = _problems(nodes, plan, rdma, any(len(r) >= 3 for r, _ in rings))
    return NetworkPlan(hosts, plan.cables, conn, plan.commands, backend, jorder, devices, plan.jaccl_ring,
                       plan.ring_order, hostfile, tuple(problems), links)


def _ring_hostfile(plan: NetworkPlan, idx: Sequence[int]) -> Tuple[Optional[List[List[str]]], str]:
    """MLX ``configure_ring``: rank r's addresses on its first ``count`` cables to rank r-1."""
    if len(idx) < 2:
        return None, "a ring needs 2 or more hosts"
    edges = [plan._links.get((idx[r], idx[r - 1]), []) for r in range(len(idx))]
    if not all(edges):
        r = edges.index([])
        return None, f"no cable between {plan.hosts[idx[r]]} and {plan.hosts[idx[r - 1]]}: no ring over cables"
    count = min(len(e) for e in edges)
    return [[_end(plan.cables[c], plan.hosts[idx[r]], plan.hosts[idx[r - 1]])[0].address for c in edges[r][:count]]
            for r in range(len(idx))], ""


def _jaccl_matrix(plan: NetworkPlan, idx: Sequence[int]) -> Tuple[Optional[List[List[Optional[Device]]]], str]:
    """MLX ``configure_jaccl`` (every pair) or ``configure_jaccl_ring`` (ring neighbours), over the
    cables jaccl may use; ``count`` = the fewest such cables between the pairs it needs."""
    n = len(idx)
    if not plan.backend.startswith("jaccl"):
        return None, f"no jaccl: {plan.backend or 'no'} Thunderbolt {'ring' if plan.backend else 'mesh or ring'}"
    ring_mode = plan.backend == "jaccl-ring"

    def jlinks(a: int, b: int) -> List[int]:
        return [c for c in plan._links.get((idx[a], idx[b]), []) if plan.cables[c].jaccl]

    pairs = [(a, b) for a in range(n) for b in range(n) if a != b and (not ring_mode or b in ((a - 1) % n, (a + 1) % n))]
    for a, b in pairs:
        if not jlinks(a, b):
            return None, f"no jaccl: no Thunderbolt 5 cable between {plan.hosts[idx[a]]} and {plan.hosts[idx[b]]}"
    count = min(len(jlinks(a, b)) for a, b in pairs)
    matrix: List[List[Optional[Device]]] = [[None] * n for _ in range(n)]
    for a, b in pairs:
        devs = [f"rdma_{_end(plan.cables[c], plan.hosts[idx[a]], plan.hosts[idx[b]])[0].iface}"
                for c in jlinks(a, b)[:count]]
        matrix[a][b] = devs[0] if count == 1 else devs
    return matrix, ""


def _problems(nodes: Sequence[RecordedNode], plan: NetworkPlan, rdma, loop: bool) -> List[Problem]:
    """The problems of the cabling and of each Mac's interfaces (see the module docstring)."""
    out: List[Problem] = []
    for c in plan.cables:
        if not c.jaccl:
            out.append(Problem("tb4", c.a.host, f"the cable {c.a.host}:{c.a.iface} - {c.b.host}:{c.b.iface} links at "
                               f"{c.speed_gbps:g} Gb/s (Thunderbolt 4): kept out of jaccl (macOS 26 makes rdma_"
                               f"{c.a.iface} on TB4 too and jaccl crashes in ibv_reg_mr: exo #2186, mlx #3777)",
                               "cable Thunderbolt 5 ports with a Thunderbolt 5 cable (the TCP ring still uses this one)"))
    for node, devices in zip(nodes, rdma):
        if devices == ():
            out.append(Problem("rdma", node.host, "RDMA is disabled (ibv_devices lists no rdma_ device): no jaccl",
                               "in macOS Recovery: rdma_ctl enable; then restart"))
    by_host = {node.host: parse_ifconfig(node.ifconfig) for node in nodes if node.ifconfig}
    tb_ifaces = {node.host: {d for k, d in parse_hardware_ports(node.networksetup).items()
                             if k.startswith("Thunderbolt ") and k != "Thunderbolt Bridge"} for node in nodes}
    for host, ifaces in by_host.items():
        bridge = ifaces.get("bridge0")
        taken = [m for m in bridge.members if m in tb_ifaces[host]] if bridge else []
        if bridge and bridge.up and taken:
            storm = "; the Macs' cables form a loop of 3 or more: broadcasts storm over it and take the LAN " \
                    "and Wi-Fi down (exo PR #1222)" if loop else ""
            out.append(Problem("bridge-loop" if loop else "bridge", host, f"bridge0 (the Thunderbolt Bridge) is up with Thunderbolt ports "
                               f"{', '.join(taken)}{storm}", "sudo ifconfig bridge0 down   # for good: sudo networksetup "
                               "-setnetworkserviceenabled \"Thunderbolt Bridge\" off"))
    for c in plan.cables:
        for mine, peer in ((c.a, c.b), (c.b, c.a)):
            iface = by_host.get(mine.host, {}).get(mine.iface)
            if mine.host not in by_host:
                continue
            have = iface.inet if iface else ()
            if any(ipaddress.ip_address(a) in ipaddress.ip_network(c.network) for a in have):
                continue
            what = (f"{mine.iface} (cable to {peer.host}) has no IPv4 address: RDMA ports publish their GID only "
                    "once it has one (MLX PR #4191; older builds fail 'RTR errno 22', mlx #3467)") if not have else \
                   (f"{mine.iface} (cable to {peer.host}) has {', '.join(have)}, not an address on the cable's "
                    f"{c.network}: the TCP ring's per-cable addresses miss it")
            out.append(Problem("no-address", mine.host, what,
                               f"sudo ifconfig {mine.iface} inet {mine.address} netmask {NETMASK} && sudo route change "
                               f"{peer.address} -interface {mine.iface}   # or: mlxcluster join --configure-network"))
    if len(plan.hosts) > 1 and not plan.backend:
        out.append(Problem("cabling", "", "the Thunderbolt cables form neither a full mesh nor a ring through "
                           "every Mac", "cable each Mac to the next, and the last to the first (a ring), or every "
                           "pair (a mesh)"))
    return out


# --------------------------------------------------------------------------- what join prints and runs


def describe(plan: NetworkPlan) -> str:
    """The plan as readable lines (``join --dry-run``): cables, backend, matrix, hostfile, commands, problems."""
    mode = "ring (MLX_JACCL_RING=1)" if plan.jaccl_ring else "mesh"
    lines = [f"Thunderbolt network plan for {', '.join(plan.hosts)}: backend "
             f"{(plan.backend + ', jaccl as ' + mode) if plan.backend.startswith('jaccl') else plan.backend or 'none'}"]
    lines += ["cables:"] + [f"  {c.a.host}:{c.a.iface} {c.a.address} <-> {c.b.host}:{c.b.iface} {c.b.address}  "
                            f"({c.network}, {'?' if c.speed_gbps is None else f'{c.speed_gbps:g}'} Gb/s"
                            f"{'' if c.jaccl else ', not for jaccl'})" for c in plan.cables] if plan.cables else \
        ["cables: none between the nodes given"]
    if plan.jaccl_devices is not None:
        lines.append(f"MLX_IBV_DEVICES (ranks {', '.join(plan.jaccl_order)}): {json.dumps(plan.jaccl_devices)}")
    if plan.ring_hostfile is not None:
        lines.append(f"ring hostfile (ranks {', '.join(plan.ring_order)}): {json.dumps(plan.ring_hostfile)}")
    for host, cmds in plan.commands.items():
        lines += [f"commands on {host}:"] + [f"  sudo {c}" for c in cmds]
    lines += ["problems:"] + [f"  {p}" for p in plan.problems] if plan.problems else ["problems: none"]
    return "\n".join(lines)


def unaddressed_ports(node: RecordedNode) -> List[str]:
    """This Mac's Thunderbolt interfaces cabled to a peer but with no IPv4 address (``ifconfig``);
    ``[]`` when ``ifconfig`` is not recorded."""
    if not node.ifconfig:
        return []
    ifaces = parse_ifconfig(node.ifconfig)
    links = thunderbolt_links(node.system_profiler, parse_hardware_ports(node.networksetup))
    return sorted(link["iface"] for link in links if link["peer_uuid"] and link["iface"]
                  and not (ifaces.get(link["iface"]) and ifaces[link["iface"]].inet))


#: The /30s :func:`cable_addresses` picks from when one Mac sets its cables up alone: 192.168.128.0/17,
#: clear of the 192.168.0.x and 192.168.1.x home LANs (MLX's enumeration starts at 192.168.0.0).
ALONE_BASE = int(ipaddress.IPv4Address("192.168.128.0"))
ALONE_NETWORKS = 1 << 13


def cable_addresses(uuid_a: str, uuid_b: str) -> Tuple[str, str, str]:
    """``(network, address at uuid_a's end, address at uuid_b's end)`` of one cable, from its two
    ports' Thunderbolt ``domain_uuid_key`` alone: both Macs compute the same /30 without each other's
    outputs (MLX's ``IPConfigurator`` numbers cables over every host at once, which one Mac joining
    alone cannot).  The end with the smaller uuid gets ``.1``.  SHA-256 of the sorted pair picks one
    of :data:`ALONE_NETWORKS` /30s of 192.168.128.0/17."""
    lo, hi = sorted((uuid_a.upper(), uuid_b.upper()))
    k = int.from_bytes(hashlib.sha256(f"{lo}|{hi}".encode()).digest()[:4], "big") % ALONE_NETWORKS
    base = ALONE_BASE + 4 * k
    first, second = str(ipaddress.IPv4Address(base + 1)), str(ipaddress.IPv4Address(base + 2))
    mine = first if uuid_a.upper() == lo else second
    return f"{ipaddress.IPv4Address(base)}/30", mine, second if mine == first else first


def local_commands(node: RecordedNode) -> List[str]:
    """What this Mac alone runs (with ``sudo``) so that each cabled Thunderbolt port has its cable's
    /30 (:func:`cable_addresses`) -- ``join --configure-network`` on a live Mac, where the other Macs'
    outputs are not at hand: ``ifconfig bridge0 down`` when the bridge is up with Thunderbolt
    members, then per unaddressed cabled port ``ifconfig enX inet A netmask 255.255.255.252`` and
    ``route change PEER -interface enX`` (MLX ``IPConfigurator.setup``'s commands).  Ports that
    already hold an address (e.g. set by ``mlx.distributed_config``) are left as they are.

    Raises:
        ValueError: a cable's /30 overlaps a network this Mac already has (name it; set the
            addresses with ``mlx.distributed_config`` instead).
    """
    ifaces = parse_ifconfig(node.ifconfig)
    hw = parse_hardware_ports(node.networksetup)
    tb = {dev for name, dev in hw.items() if name.startswith("Thunderbolt ") and name != "Thunderbolt Bridge"}
    bridge = ifaces.get("bridge0")
    cmds = ["ifconfig bridge0 down"] if bridge is not None and bridge.up and set(bridge.members) & tb else []
    held = [ipaddress.IPv4Interface(f"{a}/{p}").network for i in ifaces.values() for a, p in
            zip(i.inet, i.prefixes or (32,) * len(i.inet))]
    ports = {p.iface: p for p in parse_thunderbolt(node.system_profiler, hw)}
    for iface in unaddressed_ports(node):
        net, mine, peer = cable_addresses(ports[iface].uuid, ports[iface].connected_to or "")
        clash = [str(h) for h in held if h.overlaps(ipaddress.IPv4Network(net))]
        if clash:
            raise ValueError(f"the /30 {net} of the cable on {iface} overlaps {clash[0]} here: set the cables up "
                             "with mlx.distributed_config (or join --dry-run --recorded DIR) instead")
        cmds += _address_commands(iface, mine, peer)
    return cmds

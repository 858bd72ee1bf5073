"""jaccl on real Macs: each node's Thunderbolt ports and RDMA devices, and the device matrix.

jaccl (MLX's RDMA backend over Thunderbolt 5, macOS 26.2+) needs, for every pair of
ranks, the ibverbs device through which one reaches the other: ``MLX_IBV_DEVICES``,
an N x N JSON matrix (row ``i``: rank ``i``'s device toward each rank ``j``).  MLX's
own tool (``mlx.distributed_config``) derives it over ssh from three commands per
host; here each node runs them on itself (:func:`local_rdma_facts`), sends the
result in its ``Prepare`` reply, and the coordinator derives the matrix
(:func:`jaccl_mesh`).  Followed, from MLX 0.32.4
``mlx/_distributed_utils/config.py``:

* ``ibv_devices``: the words starting with ``rdma_`` are the RDMA devices
  (``check_rdma``); none means RDMA is disabled (``rdma_ctl enable`` in macOS
  Recovery turns it on).
* ``networksetup -listallhardwareports``: ``Hardware Port: Thunderbolt <tag>`` ->
  ``Device: en<k>`` (``parse_hardware_ports``).
* ``system_profiler SPThunderboltDataType -json``: per bus with a
  ``domain_uuid_key``, its receptacle tag (``receptacle_1_tag.receptacle_id_key``)
  and the ``domain_uuid_key`` of the first connected item, i.e. the peer port
  (``extract_connectivity``); ports sorted by interface name.
* Links (``IPConfigurator``): ONE enumeration over nodes in rank order and their
  ports in order; each cable is recorded for both directions at once, so the c-th
  link of ``(i, j)`` and of ``(j, i)`` are the two ends of the same cable.  Choosing
  each direction's interface independently can name different cables on the two
  sides, and jaccl pairs queue pairs across ranks: a silent deadlock (exo PR #2160).
* Matrix (``configure_jaccl``): ``count`` = the fewest links between any pair;
  entry ``(i, j)`` = ``"rdma_<iface>"`` of the first link, or the list of the first
  ``count`` links when ``count > 1``; ``None`` on the diagonal.  (jaccl's mesh uses
  only the first name of a list, ``jaccl.cpp: Config::get_mesh_connectivity``; the
  others serve ``MLX_JACCL_RING``.)
"""

from __future__ import annotations

import ipaddress
import json
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

__all__ = ["ThunderboltPort", "RdmaFacts", "JacclMesh", "parse_hardware_ports", "parse_thunderbolt",
           "parse_ibv_devices", "parse_ifconfig", "thunderbolt4", "Interface", "facts_from_outputs", "local_rdma_facts",
           "jaccl_mesh", "ring_over_cables", "thunderbolt_links", "RDMA_DISABLED",
           "TB4_MAX_GBPS"]

#: The problem of a Mac without ``ibv_devices``.
NO_IBV = "ibv_devices not found (RDMA over Thunderbolt needs macOS 26.2 or later)"
#: The problem of a Mac whose ``ibv_devices`` lists nothing.
RDMA_DISABLED = "RDMA is disabled (run `rdma_ctl enable` in macOS Recovery, then reboot)"
#: jaccl needs Thunderbolt 5: a link at 40 Gb/s or less is Thunderbolt 4 (or 3, or USB4 at 40).
TB4_MAX_GBPS = 40
_MAX_ITEMS = 64
_MAX_TEXT = 256
_TIMEOUT_S = 20.0

Device = Union[str, List[str]]


def thunderbolt4(*speeds_gbps: Optional[float]) -> bool:
    """Whether a cable whose ends report ``speeds_gbps`` (``None`` or 0: not reported) is Thunderbolt 4
    or slower: its slower known end at most :data:`TB4_MAX_GBPS`; unknown speeds count as Thunderbolt 5."""
    known = [s for s in speeds_gbps if s]
    return bool(known) and min(known) <= TB4_MAX_GBPS


@dataclass(frozen=True)
class ThunderboltPort:
    """One Thunderbolt port of a Mac.

    Attributes:
        iface: its network interface, e.g. ``"en2"``.
        uuid: its Thunderbolt ``domain_uuid_key``.
        connected_to: the ``domain_uuid_key`` of the port at the other end of its cable, or ``None``.
        address: its IPv4 interface from ``ifconfig``, e.g. ``"192.168.0.1/30"`` (``""``: none; the
            per-cable network MLX's ``IPConfigurator`` sets up, which the TCP ring runs over).
        speed_gbps: its link speed (``current_speed_key``), 0.0 when not reported; at most
            ``TB4_MAX_GBPS`` is Thunderbolt 4, which jaccl must not use (exo #2186, mlx #3777).
    """

    iface: str
    uuid: str
    connected_to: Optional[str] = None
    address: str = ""
    speed_gbps: float = 0.0


@dataclass(frozen=True)
class RdmaFacts:
    """What one node found about itself for jaccl.

    Attributes:
        ports: its Thunderbolt ports, sorted by interface name.
        rdma_devices: the ``rdma_*`` devices ``ibv_devices`` lists.
        problem: one line why this node cannot run jaccl (``""``: it can, where cabled).
    """

    ports: Tuple[ThunderboltPort, ...] = ()
    rdma_devices: Tuple[str, ...] = ()
    problem: str = ""

    def to_dict(self) -> dict:
        """A JSON-serialisable dict (``connected_to`` ``None`` for a free port)."""
        return {"ports": [{"iface": p.iface, "uuid": p.uuid, "connected_to": p.connected_to, "address": p.address,
                           "speed_gbps": p.speed_gbps} for p in self.ports],
                "rdma_devices": list(self.rdma_devices), "problem": self.problem}

    @classmethod
    def from_dict(cls, data: object) -> "RdmaFacts":
        """Inverse of :meth:`to_dict`, for facts a peer sent (ports re-sorted by interface).

        Raises:
            ValueError: not that shape, more than 64 ports or devices, an empty
                ``iface`` / ``uuid`` / device, or a string over 256 characters.
        """
        def text(value: object, what: str, empty: bool = False) -> str:
            if not isinstance(value, str) or len(value) > _MAX_TEXT or not (value or empty):
                raise ValueError(f"RDMA facts: {what} must be a {'' if empty else 'non-empty '}string "
                                 f"of at most {_MAX_TEXT} characters, got {str(value)[:40]!r}")
            return value

        if not isinstance(data, dict):
            raise ValueError("RDMA facts must be an object")
        ports, devices = data.get("ports", []), data.get("rdma_devices", [])
        if not isinstance(ports, list) or not isinstance(devices, list) or \
                len(ports) > _MAX_ITEMS or len(devices) > _MAX_ITEMS:
            raise ValueError(f"RDMA facts: ports and rdma_devices must be lists of at most {_MAX_ITEMS}")
        out = []
        for p in ports:
            if not isinstance(p, dict):
                raise ValueError("RDMA facts: a port must be an object")
            peer = p.get("connected_to")
            address = text(p.get("address", ""), "address", empty=True)
            if address:
                try:
                    ipaddress.IPv4Interface(address)
                except ValueError:
                    raise ValueError(f"RDMA facts: address must be an IPv4 interface (a.b.c.d/n), "
                                     f"got {address[:40]!r}") from None
            speed = p.get("speed_gbps", 0.0)
            if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0.0 <= speed <= 1e4:
                raise ValueError(f"RDMA facts: speed_gbps must be a number in 0..10000, got {str(speed)[:40]!r}")
            out.append(ThunderboltPort(text(p.get("iface"), "iface"), text(p.get("uuid"), "uuid"),
                                       None if peer is None else text(peer, "connected_to", empty=True) or None,
                                       address, float(speed)))
        return cls(tuple(sorted(out, key=lambda p: p.iface)), tuple(text(d, "device") for d in devices),
                   text(data.get("problem", ""), "problem", empty=True))


def parse_hardware_ports(text: str) -> Dict[str, str]:
    """Hardware port name -> network interface, as ``config.py: parse_hardware_ports``.

    Args:
        text: output of ``networksetup -listallhardwareports`` (blocks of
            ``Hardware Port: Thunderbolt 1`` / ``Device: en2`` / ``Ethernet Address: ...``).
    Returns:
        e.g. ``{"Ethernet": "en0", "Thunderbolt 1": "en2", "Thunderbolt Bridge": "bridge0"}``.
    """
    ports: Dict[str, str] = {}
    name = None
    for line in text.split("\n"):
        if line.startswith("Hardware Port:"):
            name = line.strip()[15:]
        elif line.startswith("Device:") and name is not None:
            ports[name] = line.strip()[8:]
            name = None
    return ports


def parse_thunderbolt(profiler_json: str, hardware_ports: Dict[str, str]) -> Tuple[ThunderboltPort, ...]:
    """This Mac's Thunderbolt ports, as ``config.py: extract_connectivity`` reads them.

    Args:
        profiler_json: output of ``system_profiler SPThunderboltDataType -json``.
        hardware_ports: :func:`parse_hardware_ports` of the same Mac.
    Returns:
        one port per bus with a ``domain_uuid_key``, sorted by interface name.
    Raises:
        ValueError: not JSON of that shape, or a bus whose ``Thunderbolt <tag>`` port
            ``networksetup`` does not list.
    """
    try:
        buses = json.loads(profiler_json)["SPThunderboltDataType"]
        ports = []
        for bus in buses:
            uuid = bus.get("domain_uuid_key")
            if uuid is None:
                continue
            tag = bus["receptacle_1_tag"]["receptacle_id_key"]
            connected = [item for item in bus.get("_items", []) if "domain_uuid_key" in item]
            iface = hardware_ports.get(f"Thunderbolt {tag}")
            if iface is None:
                raise ValueError(f"networksetup lists no interface for port 'Thunderbolt {tag}'")
            ports.append(ThunderboltPort(iface, str(uuid), str(connected[0]["domain_uuid_key"]) if connected else None))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"unexpected system_profiler output: {type(exc).__name__}: {exc}") from None
    return tuple(sorted(ports, key=lambda p: p.iface))


def _speed_gbps(text: str) -> Optional[float]:
    match = re.search(r"([0-9]+(?:\.[0-9]+)?)\s*Gb/s", str(text), re.IGNORECASE)
    return float(match.group(1)) if match else None


def thunderbolt_links(profiler_json: str, hardware_ports: Mapping[str, str]) -> List[dict]:
    """Per Thunderbolt port of ``system_profiler SPThunderboltDataType -json``: ``{"port", "iface",
    "uuid", "connected", "peer_uuid", "peer", "speed_gbps"}`` (``iface`` from ``networksetup``).

    Raises:
        ValueError: not JSON of that shape.
    """
    try:
        buses = json.loads(profiler_json)["SPThunderboltDataType"]
        out = []
        for bus in buses:
            tag = bus.get("receptacle_1_tag")
            if not isinstance(tag, dict):
                continue
            items = [i for i in bus.get("_items", []) if isinstance(i, dict)]
            peers = [i for i in items if "domain_uuid_key" in i]
            port = f"Thunderbolt {tag.get('receptacle_id_key', '?')}"
            out.append({"port": port, "iface": hardware_ports.get(port, ""), "uuid": str(bus.get("domain_uuid_key", "")),
                        "connected": tag.get("receptacle_status_key") == "receptacle_connected" or bool(items),
                        "peer_uuid": str(peers[0]["domain_uuid_key"]) if peers else "",
                        "peer": str(peers[0].get("_name", "")) if peers else "",
                        "speed_gbps": _speed_gbps(tag.get("current_speed_key", ""))})
        return out
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"unexpected system_profiler output: {type(exc).__name__}: {exc}") from None


def parse_ibv_devices(text: str) -> Tuple[str, ...]:
    """The RDMA devices in ``ibv_devices`` output: its words starting with ``rdma_``
    (``config.py: check_rdma``); ``()`` when RDMA is disabled."""
    return tuple(word for word in text.split() if word.startswith("rdma_"))


def _run(argv: List[str]) -> str:
    exe = shutil.which(argv[0])
    if exe is None:
        raise FileNotFoundError(f"{argv[0]} not found")
    return subprocess.run([exe] + argv[1:], capture_output=True, text=True, timeout=_TIMEOUT_S, check=True).stdout


@dataclass(frozen=True)
class Interface:
    """One interface of ``ifconfig``: ``up`` (``UP`` in its flags), its IPv4 ``inet`` addresses and
    their prefix lengths (``prefixes``, from ``netmask 0xfffffffc``: 30), its bridge ``members``
    (``member: en2 flags=3<LEARNING,DISCOVER>``)."""

    up: bool
    inet: Tuple[str, ...] = ()
    members: Tuple[str, ...] = ()
    prefixes: Tuple[int, ...] = ()


def parse_ifconfig(text: str) -> Dict[str, Interface]:
    """Interface name -> :class:`Interface` from macOS ``ifconfig`` (blocks starting
    ``en2: flags=8863<UP,BROADCAST,...> mtu 1500``, then tab-indented ``inet A netmask 0xfffffffc
    broadcast B`` and ``member: enX ...`` lines; a netmask missing or not hex counts as /32)."""
    out: Dict[str, Interface] = {}
    name, up, inet, members, prefixes = "", False, [], [], []

    def close() -> None:
        if name:
            out[name] = Interface(up, tuple(inet), tuple(members), tuple(prefixes))

    for line in text.splitlines():
        head = re.match(r"^([A-Za-z0-9_.\-]+):\s+flags=\w+<([^>]*)>", line)
        if head:
            close()
            name, up, inet, members, prefixes = head.group(1), "UP" in head.group(2).split(","), [], [], []
            continue
        addr = re.match(r"^\s+inet\s+(\d+\.\d+\.\d+\.\d+)(?:\s+netmask\s+0x([0-9a-fA-F]{8}))?", line)
        member = re.match(r"^\s+member:\s*(\S+)", line)
        if addr:
            inet.append(addr.group(1))
            prefixes.append(bin(int(addr.group(2), 16)).count("1") if addr.group(2) else 32)
        elif member:
            members.append(member.group(1))
    close()
    return out


def facts_from_outputs(profiler_json: str, networksetup: str, ibv_devices: Optional[str],
                       ifconfig: str = "") -> RdmaFacts:
    """A Mac's :class:`RdmaFacts` from what its tools printed (run now, or recorded: ``join
    --recorded``).  Never raises: unreadable output becomes the ``problem``.

    Args:
        profiler_json: ``system_profiler SPThunderboltDataType -json``.
        networksetup: ``networksetup -listallhardwareports``.
        ibv_devices: ``ibv_devices`` output, ``None`` when the tool is missing (macOS before 26.2).
        ifconfig: ``ifconfig``: each port's IPv4 address (its cable's /30), ``""``: none known.
    Returns:
        the ports (with their addresses and link speeds) and RDMA devices; ``problem`` says why
        jaccl cannot run here (the ports still serve the TCP ring over the cables).
    """
    devices = parse_ibv_devices(ibv_devices) if ibv_devices is not None else ()
    problem = NO_IBV if ibv_devices is None else "" if devices else RDMA_DISABLED
    try:
        hw = parse_hardware_ports(networksetup)
        ports = parse_thunderbolt(profiler_json, hw)
        speeds = {link["uuid"]: link["speed_gbps"] or 0.0 for link in thunderbolt_links(profiler_json, hw)}
    except Exception as exc:
        return RdmaFacts(rdma_devices=devices[:_MAX_ITEMS],
                         problem=f"cannot read the Thunderbolt ports: {exc}"[:_MAX_TEXT])
    ifaces = parse_ifconfig(ifconfig)

    def address(iface: str) -> str:
        i = ifaces.get(iface)
        return f"{i.inet[0]}/{i.prefixes[0] if i.prefixes else 32}" if i is not None and i.inet else ""

    ports = tuple(ThunderboltPort(p.iface, p.uuid, p.connected_to, address(p.iface), float(speeds.get(p.uuid, 0.0)))
                  for p in ports)
    return RdmaFacts(ports[:_MAX_ITEMS], devices[:_MAX_ITEMS], problem)


def local_rdma_facts(run: Optional[Callable[[List[str]], str]] = None, system: Optional[str] = None) -> RdmaFacts:
    """This machine's :class:`RdmaFacts` (:func:`facts_from_outputs` of its tools).  Never raises: a
    failing command becomes the ``problem``.

    Args:
        run: ``run(argv) -> stdout``; default runs the command (20 s timeout, non-zero
            exit fails).  Tests pass recorded outputs.
        system: ``platform.system()`` unless given; only ``"Darwin"`` is probed.
    """
    if (system or platform.system()) != "Darwin":
        return RdmaFacts(problem="not macOS (jaccl needs RDMA over Thunderbolt)")
    run = run or _run
    try:
        ibv: Optional[str] = run(["ibv_devices"])
    except FileNotFoundError:
        ibv = None
    except Exception as exc:
        return RdmaFacts(problem=f"ibv_devices failed: {exc}"[:_MAX_TEXT])
    try:
        profiler = run(["system_profiler", "SPThunderboltDataType", "-json"])
        hardware = run(["networksetup", "-listallhardwareports"])
    except Exception as exc:
        return RdmaFacts(rdma_devices=parse_ibv_devices(ibv or "")[:_MAX_ITEMS], problem=(
            NO_IBV if ibv is None else f"cannot read the Thunderbolt ports: {exc}"[:_MAX_TEXT]))
    try:
        ifconfig = run(["ifconfig"])
    except Exception:  # addresses unknown: the ring runs over the LAN
        ifconfig = ""
    return facts_from_outputs(profiler, hardware, ibv, ifconfig)


@dataclass(frozen=True)
class JacclMesh:
    """The outcome of :func:`jaccl_mesh`.

    Attributes:
        devices: the N x N ``MLX_IBV_DEVICES`` matrix, or ``None`` when jaccl cannot run.
        reason: one line: why not, or what was found (for ``mlxcluster status``).
        ring: run jaccl as a ring (``MLX_JACCL_RING=1``): every pair has several cables, which
            jaccl's mesh does not use (only entry ``[0]`` of a cell, ``jaccl.cpp:
            Config::get_mesh_connectivity``) and its ring stripes over (exo PR #2160).
    """

    devices: Optional[List[List[Optional[Device]]]]
    reason: str
    ring: bool = False


def jaccl_mesh(facts: Sequence[RdmaFacts], labels: Sequence[str] = ()) -> JacclMesh:
    """jaccl's device matrix for ranks whose nodes reported ``facts``, as ``configure_jaccl`` builds it.

    Args:
        facts: one :class:`RdmaFacts` per rank, in rank order.
        labels: how messages name each rank (``"rank i"`` unless one label per rank is given).
    Returns:
        :class:`JacclMesh`; ``devices`` is ``None`` for fewer than 2 ranks, a node with a
        ``problem``, a port uuid reported twice, an incomplete mesh (a pair with no
        cable), or a cabled port whose ``rdma_<iface>`` device its node lacks.  Every
        name in ``devices`` is in that node's ``rdma_devices``.
    """
    n = len(facts)
    names = list(labels) if len(labels) == n else [f"rank {i}" for i in range(n)]
    if n < 2:
        return JacclMesh(None, "jaccl needs at least 2 ranks")
    for name, f in zip(names, facts):
        if f.problem:
            return JacclMesh(None, f"{name}: {f.problem}")
    where: Dict[str, Tuple[int, int]] = {}
    for i, f in enumerate(facts):
        for k, p in enumerate(f.ports):
            if p.uuid in where:
                return JacclMesh(None, f"Thunderbolt port {p.uuid} reported by both {names[where[p.uuid][0]]} "
                                       f"and {names[i]}")
            where[p.uuid] = (i, k)
    links: Dict[Tuple[int, int], List[str]] = {}
    assigned = set()
    slow = []
    for i, f in enumerate(facts):  # one enumeration: both ends of each cable at once
        for k, p in enumerate(f.ports):
            if not p.connected_to or p.connected_to not in where or (i, k) in assigned:
                continue
            j, m = where[p.connected_to]
            if thunderbolt4(p.speed_gbps, facts[j].ports[m].speed_gbps):
                # Thunderbolt 4: macOS 26 makes rdma_enX there too, and jaccl crashes in ibv_reg_mr
                slow.append((i, j))
                assigned.update({(i, k), (j, m)})
                continue
            links.setdefault((i, j), []).append(p.iface)
            links.setdefault((j, i), []).append(facts[j].ports[m].iface)
            assigned.update({(i, k), (j, m)})
    for i in range(n):
        for j in range(i + 1, n):
            if not links.get((i, j)):
                tb4 = (i, j) in slow or (j, i) in slow
                return JacclMesh(None, f"incomplete Thunderbolt mesh: no {'Thunderbolt 5 ' if tb4 else ''}cable "
                                       f"between {names[i]} and {names[j]}"
                                       + (" (a Thunderbolt 4 cable: kept out of jaccl)" if tb4 else ""))
    count = min(len(links[i, j]) for i in range(n) for j in range(n) if i != j)
    matrix: List[List[Optional[Device]]] = []
    for i in range(n):
        row: List[Optional[Device]] = []
        for j in range(n):
            if i == j:
                row.append(None)
                continue
            devs = [f"rdma_{iface}" for iface in links[i, j][:count]]
            missing = [d for d in devs if d not in facts[i].rdma_devices]
            if missing:
                return JacclMesh(None, f"{names[i]} has no RDMA device {missing[0]} for its cable to {names[j]}")
            row.append(devs[0] if count == 1 else devs)
        matrix.append(row)
    plural = "s" if count > 1 else ""
    how = ", as a ring striped over them (MLX_JACCL_RING=1)" if count > 1 else ""
    return JacclMesh(matrix, f"full Thunderbolt mesh with RDMA on all {n} nodes ({count} link{plural} per pair{how})",
                     ring=count > 1)


def ring_over_cables(facts: Sequence[RdmaFacts], labels: Sequence[str] = ()) -> Tuple[Optional[List[List[str]]], str]:
    """The TCP ring's per-rank addresses over the Thunderbolt cables, as MLX's ``configure_ring``
    (``mlx/_distributed_utils/config.py``) writes its hostfile: rank ``r`` listens on its addresses
    on its cables to rank ``r - 1`` (rank ``r - 1`` connects to them over those cables).

    Args:
        facts: one :class:`RdmaFacts` per rank, in rank order (``problem`` is jaccl's and ignored).
        labels: how messages name each rank.
    Returns:
        ``(addresses, reason)``: ``addresses[r]`` the IPv4 addresses of rank ``r`` (as many per rank
        as the fewest addressed cables between neighbours), or ``None`` with one line why the
        ring runs over the nodes' LAN addresses instead (fewer than 2 ranks, no cable between
        neighbours, or a cable whose ends hold no addresses in one network: ``join --dry-run``).
    """
    n = len(facts)
    names = list(labels) if len(labels) == n else [f"rank {i}" for i in range(n)]
    if n < 2:
        return None, "a ring over cables needs 2 or more ranks"
    owner = {p.uuid: (i, p) for i, f in enumerate(facts) for p in f.ports}
    rows: List[List[str]] = []
    for r in range(n):
        left = (r - 1) % n
        mine = []  # (the cable's place in MLX's one enumeration over ranks and their ports, address)
        for k, p in enumerate(facts[r].ports):
            peer = owner.get(p.connected_to or "")
            if peer is None or peer[0] != left:
                continue
            if p.address and peer[1].address and \
                    ipaddress.IPv4Interface(p.address).network == ipaddress.IPv4Interface(peer[1].address).network:
                place = facts[left].ports.index(peer[1]) if left < r else k
                mine.append((place, p.address.split("/")[0]))
        mine = [address for _, address in sorted(mine)]
        if not mine:
            cabled = any(owner.get(p.connected_to or "", (-1,))[0] == left for p in facts[r].ports)
            return None, (f"the cable between {names[r]} and {names[left]} has no addresses in one network "
                          "(mlxcluster join --dry-run prints the commands)" if cabled else
                          f"no Thunderbolt cable between {names[r]} and {names[left]}")
        rows.append(mine)
    count = min(len(row) for row in rows)
    return [row[:count] for row in rows], f"over the Thunderbolt cables ({count} per neighbour)"

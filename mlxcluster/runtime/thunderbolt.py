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

import json
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

__all__ = ["ThunderboltPort", "RdmaFacts", "JacclMesh", "parse_hardware_ports", "parse_thunderbolt",
           "parse_ibv_devices", "local_rdma_facts", "jaccl_mesh", "thunderbolt_links", "RDMA_DISABLED",
           "TB4_MAX_GBPS"]

#: The problem of a Mac whose ``ibv_devices`` lists nothing.
RDMA_DISABLED = "RDMA is disabled (run `rdma_ctl enable` in macOS Recovery, then reboot)"
#: jaccl needs Thunderbolt 5: a link at 40 Gb/s or less is Thunderbolt 4 (or 3, or USB4 at 40).
TB4_MAX_GBPS = 40
_MAX_ITEMS = 64
_MAX_TEXT = 256
_TIMEOUT_S = 20.0

Device = Union[str, List[str]]


@dataclass(frozen=True)
class ThunderboltPort:
    """One Thunderbolt port of a Mac.

    Attributes:
        iface: its network interface, e.g. ``"en2"``.
        uuid: its Thunderbolt ``domain_uuid_key``.
        connected_to: the ``domain_uuid_key`` of the port at the other end of its cable, or ``None``.
    """

    iface: str
    uuid: str
    connected_to: Optional[str] = None


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
        return {"ports": [{"iface": p.iface, "uuid": p.uuid, "connected_to": p.connected_to} for p in self.ports],
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
            out.append(ThunderboltPort(text(p.get("iface"), "iface"), text(p.get("uuid"), "uuid"),
                                       None if peer is None else text(peer, "connected_to", empty=True) or None))
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


def local_rdma_facts(run: Optional[Callable[[List[str]], str]] = None, system: Optional[str] = None) -> RdmaFacts:
    """This machine's :class:`RdmaFacts`.  Never raises: a failing command becomes the ``problem``.

    Args:
        run: ``run(argv) -> stdout``; default runs the command (20 s timeout, non-zero
            exit fails).  Tests pass recorded outputs.
        system: ``platform.system()`` unless given; only ``"Darwin"`` is probed.
    Returns:
        the ports and devices, with ``problem`` set when jaccl cannot run here
        (not macOS, no ``ibv_devices``, RDMA disabled, unreadable Thunderbolt data).
    """
    if (system or platform.system()) != "Darwin":
        return RdmaFacts(problem="not macOS (jaccl needs RDMA over Thunderbolt)")
    run = run or _run
    try:
        devices = parse_ibv_devices(run(["ibv_devices"]))
    except FileNotFoundError:
        return RdmaFacts(problem="ibv_devices not found (RDMA over Thunderbolt needs macOS 26.2 or later)")
    except Exception as exc:
        return RdmaFacts(problem=f"ibv_devices failed: {exc}"[:_MAX_TEXT])
    try:
        ports = parse_thunderbolt(run(["system_profiler", "SPThunderboltDataType", "-json"]),
                                  parse_hardware_ports(run(["networksetup", "-listallhardwareports"])))
    except Exception as exc:
        return RdmaFacts(rdma_devices=devices, problem=f"cannot read the Thunderbolt ports: {exc}"[:_MAX_TEXT])
    return RdmaFacts(ports[:_MAX_ITEMS], devices[:_MAX_ITEMS], "" if devices else RDMA_DISABLED)


@dataclass(frozen=True)
class JacclMesh:
    """The outcome of :func:`jaccl_mesh`.

    Attributes:
        devices: the N x N ``MLX_IBV_DEVICES`` matrix, or ``None`` when jaccl cannot run.
        reason: one line: why not, or what was found (for ``mlxcluster status``).
    """

    devices: Optional[List[List[Optional[Device]]]]
    reason: str


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
    for i, f in enumerate(facts):  # one enumeration: both ends of each cable at once
        for k, p in enumerate(f.ports):
            if not p.connected_to or p.connected_to not in where or (i, k) in assigned:
                continue
            j, m = where[p.connected_to]
            links.setdefault((i, j), []).append(p.iface)
            links.setdefault((j, i), []).append(facts[j].ports[m].iface)
            assigned.update({(i, k), (j, m)})
    for i in range(n):
        for j in range(i + 1, n):
            if not links.get((i, j)):
                return JacclMesh(None, f"incomplete Thunderbolt mesh: no cable between {names[i]} and {names[j]}")
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
    return JacclMesh(matrix, f"full Thunderbolt mesh with RDMA on all {n} nodes ({count} link{plural} per pair)")

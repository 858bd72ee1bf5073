"""``mlxcluster doctor``: what blocks each backend on this node, each finding with the command that fixes it.

Two parts:

* **Checks** (pure): each is a function from recorded command outputs (strings) to a list of
  :class:`Finding`.  :func:`check_node` runs the ones for one node's :class:`NodeReport`;
  :func:`check_across` compares the reports of several nodes (versions, the MTU at both ends of
  each Thunderbolt cable).  Tests feed them what the real tools print.
* **Runner** (:func:`gather`): runs the real tools, each as an argv list (never a shell), each
  bounded by a timeout; a tool that is not installed is recorded as ``None`` (a finding, never a
  crash), a tool that fails as its exit status and stderr.

What each check reads, and where its rule comes from:

========================  ==========================================  =============================================
check                     reads                                       rule's source
========================  ==========================================  =============================================
``rdma``                  ``rdma_ctl status`` (``enabled``/           Apple TN3205 "Low-latency communication with
                          ``disabled``), ``ibv_devices``              RDMA over Thunderbolt": RDMA is enabled only
                                                                      from macOS Recovery (``rdma_ctl enable``);
                                                                      MLX ``config.py: check_rdma`` (``rdma_*``)
``macos``                 ``sw_vers -productVersion``                 MLX ``docs/usage/distributed.rst``: RDMA over
                                                                      Thunderbolt from macOS 26.2
``thunderbolt-speed``     ``system_profiler SPThunderboltDataType     MLX distributed.rst: jaccl needs Thunderbolt 5;
                          -json`` (``receptacle_1_tag.                TB4 links at 40 Gb/s, TB5 at 80 (120 boost)
                          current_speed_key``)
``bridge``                ``ifconfig bridge0`` (``member: enX``)      MLX ``config.py: IPConfigurator.setup`` takes
                                                                      bridge0 down before it addresses the ports
``route``                 ``route -n get PEER`` (macOS),              MLX ``IPConfigurator.setup``: ``route change
                          ``ip route get PEER`` (Linux)               PEER -interface enX``; exo #2295 (Wi-Fi used)
``mtu``                   ``ifconfig`` of every node                  IP over one link: a frame over the receiver's
                                                                      MTU is dropped (RFC 894), no PMTUD on-link
``versions``              ``sw_vers``, ``mlx`` package version        issue 31: exo #1973, mlx #2944 (RDMA between
                                                                      different macOS fails); ranks run one MLX
``openmpi``               ``mpirun --version``, ``orted`` on PATH     ``backends.mpi_usable``: OpenMPI 4's mpirun and
                                                                      orted (5.x: PRRTE, no orted; MPICH's is not
                                                                      launched this way)
``blas``                  ``blas.find_openblas()``, numpy's BLAS      ``runtime/blas.py``: the reference BLAS is ~50x
                                                                      slower for MLX's CPU matmuls
``firewall``              ``nft list ruleset``, ``iptables -S``       the ports mlxcluster listens on: Node/ring/
                                                                      control ports (``launcher.free_ports``:
                                                                      10000 .. below the ephemeral range), mDNS
                                                                      224.0.0.251:5353/udp, OpenMPI's TCP ports
``firewall`` (macOS)      ``socketfilterfw --getglobalstate``,        exo #1035: the application firewall and
                          ``--getblockall``, ``--getstealthmode``,    Local Network permission behind most
                          ``--getappblocked <python>``                discovery failures
``local-network``         an mDNS send to 224.0.0.251:5353            Apple TN3179: a denied program's LAN sends
                          (``EHOSTUNREACH``: permission denied)       fail; exo PR #1103 probes the same way
``collective``            a measured ``all_sum`` (latency, bandwidth)  skipped on a node without peers
========================  ==========================================  =============================================
"""

from __future__ import annotations

import ipaddress
import re
import shlex
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from .netplan import NETMASK, RecordedNode, network_plan
from .thunderbolt import TB4_MAX_GBPS, parse_hardware_ports, parse_ibv_devices, thunderbolt_links

__all__ = ["Finding", "Ran", "NodeReport", "CollectiveResult", "ERROR", "WARNING", "NOTE", "check_node",
           "check_across", "check_rdma", "check_rdma_ports", "parse_ibv_devinfo", "check_macos", "check_thunderbolt_speed", "check_bridge", "check_route",
           "check_mtu", "check_network", "recorded_node", "check_versions", "check_openmpi", "check_blas",
           "check_firewall", "check_collective", "check_macos_firewall", "check_local_network", "probe_local_network",
           "SOCKETFILTERFW", "MDNS_PROBE",
           "parse_ifconfig_mtus", "route_interface", "gather", "doctor_local", "run_tool", "has_errors", "TIMEOUT_S"]

ERROR, WARNING, NOTE = "error", "warning", "note"
#: Longest one tool may run, in seconds.
TIMEOUT_S = 10.0
#: The first macOS with RDMA over Thunderbolt (MLX distributed.rst).
MACOS_RDMA = (26, 2)
#: mDNS (RFC 6762): every node browses and announces on 224.0.0.251:5353/udp.
MDNS = ("udp", 5353, "224.0.0.251")
#: Lowest port a node picks for its Node, ring and control ports (``launcher.LOW_PORT``).
LOW_PORT = 10000
#: A measured all_sum slower than this at 4 bytes is not on a fast link (jaccl: ~tens of µs;
#: MPI on one machine here ~76 µs; TCP over Wi-Fi: milliseconds).
SLOW_ALLSUM_US = 1000.0

_RECOVERY = "in macOS Recovery (hold the power button at start-up, Options > Utilities > Terminal): rdma_ctl enable; then restart"


@dataclass(frozen=True)
class Finding:
    """One problem (or note) doctor found.

    Attributes:
        severity: ``"error"`` (blocks a backend or the cluster: exit status 1), ``"warning"``
            (works, slower or fragile) or ``"note"`` (nothing to fix, e.g. a skipped test).
        what: one line: what is wrong, naming the port, interface, peer or node.
        fix_command: the command that fixes it (``""`` for a note).
        detail: why it matters, and the rule's source.
        check: the check that found it (``"rdma"``, ``"route"``, ...).
        node: the node it concerns (``""``: this one).
    """

    severity: str
    what: str
    fix_command: str
    detail: str = ""
    check: str = ""
    node: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Ran:
    """What one command printed: ``out`` (stdout), ``rc`` (exit status), ``err`` (stderr)."""

    out: str
    rc: int = 0
    err: str = ""

    def to_dict(self) -> dict:
        return {"out": self.out, "rc": self.rc, "err": self.err}


@dataclass(frozen=True)
class CollectiveResult:
    """A measured ``all_sum``: its backend, ranks, latency of a 4-byte sum (µs) and bus bandwidth (GB/s)."""

    backend: str
    ranks: int
    latency_us: float
    bandwidth_gbs: float


@dataclass
class NodeReport:
    """What doctor recorded on one node: enough to run every check again elsewhere.

    Attributes:
        name: the node (its node id, or the host name).
        system: ``platform.system()``: ``"Darwin"`` or ``"Linux"``.
        outputs: command (argv joined by spaces) -> :class:`Ran`, ``None`` when the tool is not installed.
        mlx_version: the installed ``mlx`` package's version (``""``: not installed).
        blas: ``blas.find_openblas()`` (``""``: none), ``blas_setting`` ``MLXCLUSTER_BLAS``, ``numpy_blas``
            the BLAS numpy was built with (``numpy.__config__``).
        peers: the IPv4 addresses of the other nodes (routes are checked to each).
        ports: the TCP ports mlxcluster listens on (Node, ring, control): ``(low, high)``.
        collective: a measured all_sum, or ``None`` (not run).
    """

    name: str
    system: str
    outputs: Dict[str, Optional[Ran]] = field(default_factory=dict)
    mlx_version: str = ""
    blas: str = ""
    blas_setting: str = ""
    numpy_blas: str = ""
    peers: List[str] = field(default_factory=list)
    ports: Tuple[int, int] = (LOW_PORT, 32767)
    collective: Optional[CollectiveResult] = None

    def out(self, command: str) -> Optional[Ran]:
        return self.outputs.get(command)

    def to_dict(self) -> dict:
        return {"name": self.name, "system": self.system, "mlx_version": self.mlx_version, "blas": self.blas,
                "blas_setting": self.blas_setting, "numpy_blas": self.numpy_blas, "peers": list(self.peers),
                "ports": list(self.ports), "collective": asdict(self.collective) if self.collective else None,
                "outputs": {k: (v.to_dict() if v is not None else None) for k, v in self.outputs.items()}}

    @classmethod
    def from_dict(cls, data: object) -> "NodeReport":
        """Inverse of :meth:`to_dict` (a report another node wrote with ``doctor --json``).

        Raises:
            ValueError: not that shape.
        """
        try:
            if not isinstance(data, dict):
                raise TypeError("not an object")
            outputs = {}
            for k, v in dict(data.get("outputs") or {}).items():
                outputs[str(k)] = None if v is None else Ran(str(v["out"]), int(v.get("rc", 0)), str(v.get("err", "")))
            coll = data.get("collective")
            low, high = data.get("ports") or (LOW_PORT, 32767)
            return cls(name=str(data["name"]), system=str(data["system"]), outputs=outputs,
                       mlx_version=str(data.get("mlx_version", "")), blas=str(data.get("blas", "")),
                       blas_setting=str(data.get("blas_setting", "")), numpy_blas=str(data.get("numpy_blas", "")),
                       peers=[str(p) for p in data.get("peers") or []], ports=(int(low), int(high)),
                       collective=CollectiveResult(**coll) if coll else None)
        except (TypeError, KeyError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a doctor node report: {type(exc).__name__}: {exc}") from None


def has_errors(findings: Iterable[Finding]) -> bool:
    """Whether any finding is an error (doctor's exit status 1)."""
    return any(f.severity == ERROR for f in findings)


# --------------------------------------------------------------------------- macOS


def check_rdma(rdma_ctl: Optional[Ran], ibv_devices: Optional[Ran], cabled_ifaces: Sequence[str] = ()) -> List[Finding]:
    """RDMA over Thunderbolt is on, and each cabled Thunderbolt port has its ``rdma_<iface>`` device.

    Reads ``rdma_ctl status`` (prints ``enabled`` or ``disabled``) and ``ibv_devices`` (its
    ``rdma_*`` words, MLX ``config.py: check_rdma``); ``cabled_ifaces``: this Mac's Thunderbolt
    interfaces with a cable to another Mac.  Source: Apple TN3205 (``rdma_ctl enable`` works only
    from macOS Recovery); MLX distributed.rst (jaccl needs RDMA on every node).
    """
    out: List[Finding] = []
    if rdma_ctl is None:
        return [Finding(ERROR, "rdma_ctl not found: this macOS has no RDMA over Thunderbolt (jaccl needs macOS 26.2+)",
                        "softwareupdate --list   # then install macOS 26.2 or later",
                        "MLX distributed.rst: RDMA over Thunderbolt from macOS 26.2", "rdma")]
    state = rdma_ctl.out.strip().lower()
    if state == "disabled":
        out.append(Finding(ERROR, "RDMA over Thunderbolt is disabled (rdma_ctl status: disabled)", _RECOVERY,
                           "jaccl cannot run; only macOS Recovery can enable it (Apple TN3205)", "rdma"))
    elif state != "enabled":
        out.append(Finding(WARNING, f"rdma_ctl status printed {rdma_ctl.out.strip()[:60]!r} (rc {rdma_ctl.rc}), "
                                    "not enabled/disabled", "rdma_ctl status", rdma_ctl.err.strip()[:200], "rdma"))
    if ibv_devices is None:
        out.append(Finding(ERROR, "ibv_devices not found: no RDMA tools (macOS 26.2 or later)", "softwareupdate --list",
                           "MLX config.py: check_rdma runs ibv_devices", "rdma"))
        return out
    devices = parse_ibv_devices(ibv_devices.out)
    if not devices:
        if state == "enabled":
            out.append(Finding(ERROR, "ibv_devices lists no RDMA devices although rdma_ctl says enabled",
                               "system_profiler SPThunderboltDataType   # every port at 80 Gb/s or more?",
                               "RDMA over Thunderbolt needs Thunderbolt 5 ports (a Thunderbolt 4 Mac stays "
                               "without devices); after rdma_ctl enable, restart", "rdma"))
        elif state != "disabled":
            out.append(Finding(ERROR, "ibv_devices lists no RDMA devices: RDMA is disabled", _RECOVERY,
                               "MLX config.py: check_rdma", "rdma"))
        return out
    for iface in cabled_ifaces:
        if f"rdma_{iface}" not in devices:
            out.append(Finding(ERROR, f"no RDMA device rdma_{iface} for the Thunderbolt cable on {iface}",
                               "ibv_devices   # after: sudo ifconfig bridge0 deletem " + iface,
                               f"ibv_devices lists {', '.join(devices)}; jaccl's matrix names rdma_<iface> of each "
                               "cabled port (runtime/thunderbolt.py)", "rdma"))
    return out


def parse_ibv_devinfo(text: str) -> Dict[str, Tuple[str, Tuple[str, ...]]]:
    """``ibv_devinfo -v`` (rdma-core's format: ``hca_id:\trdma_en2`` blocks, ``state:\t\tPORT_ACTIVE (4)``,
    ``GID[  1]:\t\t0000:0000:0000:0000:0000:ffff:c0a8:0001, RoCE v2``) -> device -> (its first port's
    state, e.g. ``"PORT_ACTIVE"``; the IPv4 addresses of its IPv4-mapped GIDs)."""
    out: Dict[str, Tuple[str, Tuple[str, ...]]] = {}
    device, state, v4 = "", "", []
    for line in text.splitlines() + ["hca_id:"]:
        head = re.match(r"^hca_id:\s*(\S*)", line)
        if head:
            if device:
                out[device] = (state, tuple(v4))
            device, state, v4 = head.group(1), "", []
            continue
        st = re.match(r"^\s+state:\s+(\w+)", line)
        gid = re.match(r"^\s+GID\[\s*\d+\]:\s+([0-9a-fA-F:]+)", line)
        if st and not state:
            state = st.group(1)
        elif gid:
            groups = gid.group(1).lower().split(":")
            if len(groups) == 8 and groups[:5] == ["0000"] * 5 and groups[5] == "ffff":
                word = int(groups[6] + groups[7], 16)
                v4.append(".".join(str((word >> k) & 255) for k in (24, 16, 8, 0)))
    return out


def check_rdma_ports(ibv_devinfo: Optional[Ran], cabled_ifaces: Sequence[str]) -> List[Finding]:
    """Each cabled Thunderbolt port's RDMA device is up and publishes an IPv4-mapped GID.

    Reads ``ibv_devinfo -v`` (:func:`parse_ibv_devinfo`).  Source: MLX ``rdma.cpp`` (PR #4191):
    "Thunderbolt RDMA ports only publish [an IPv4-mapped GID] once the interface has an IPv4
    address"; without one, older MLX builds fail with "RTR errno 22" (mlx #3467).  Nothing is
    reported when the tool is missing (``check_rdma`` names that) or lists no such device."""
    if ibv_devinfo is None or ibv_devinfo.rc != 0:
        return []
    info = parse_ibv_devinfo(ibv_devinfo.out)
    out: List[Finding] = []
    for iface in cabled_ifaces:
        dev = f"rdma_{iface}"
        if dev not in info:
            continue
        state, v4 = info[dev]
        if state and state != "PORT_ACTIVE":
            out.append(Finding(ERROR, f"RDMA device {dev} is {state}: its Thunderbolt link carries no RDMA",
                               "system_profiler SPThunderboltDataType   # the cable seated, the peer awake?",
                               "jaccl's queue pairs need an active port (ibv_devinfo)", "rdma"))
        elif not v4:
            out.append(Finding(ERROR, f"RDMA device {dev} has no IPv4-mapped GID: {iface} has no IPv4 address",
                               f"mlxcluster join --dry-run --recorded DIR   # {iface}'s /30; or join --configure-network",
                               "RDMA ports publish that GID only once the interface has an IPv4 address (MLX "
                               "rdma.cpp, PR #4191); without it jaccl fails with 'RTR errno 22' (mlx #3467)", "rdma"))
    return out


def _version_tuple(text: str) -> Tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def check_macos(sw_vers: Optional[Ran]) -> List[Finding]:
    """macOS is 26.2 or later.  Reads ``sw_vers -productVersion`` (e.g. ``26.2``).
    Source: MLX distributed.rst (RDMA over Thunderbolt from macOS 26.2)."""
    if sw_vers is None or not _version_tuple(sw_vers.out):
        return [Finding(WARNING, "cannot read the macOS version (sw_vers -productVersion)", "sw_vers", "", "macos")]
    version = _version_tuple(sw_vers.out)
    if version < MACOS_RDMA:
        return [Finding(ERROR, f"macOS {sw_vers.out.strip()}: jaccl needs macOS 26.2 or later",
                        "softwareupdate --list   # then install macOS 26.2 or later",
                        "MLX distributed.rst: RDMA over Thunderbolt from macOS 26.2", "macos")]
    return []


def check_thunderbolt_speed(profiler: Optional[Ran], networksetup: Optional[Ran]) -> List[Finding]:
    """Each Thunderbolt port cabled to another Mac links at more than 40 Gb/s (Thunderbolt 5).

    Reads ``system_profiler SPThunderboltDataType -json`` (``receptacle_1_tag.current_speed_key``,
    e.g. ``"Up to 80 Gb/s"``; the first item with a ``domain_uuid_key`` is the peer Mac, as MLX's
    ``extract_connectivity`` reads it) and ``networksetup -listallhardwareports`` (port -> enX).
    Source: MLX distributed.rst (RDMA over Thunderbolt 5 only); Thunderbolt 4 is 40 Gb/s,
    Thunderbolt 5 80 Gb/s (120 Gb/s Bandwidth Boost).
    """
    if profiler is None or networksetup is None:
        return [Finding(WARNING, "cannot read the Thunderbolt ports (system_profiler or networksetup missing)",
                        "system_profiler SPThunderboltDataType", "", "thunderbolt-speed")]
    try:
        links = thunderbolt_links(profiler.out, parse_hardware_ports(networksetup.out))
    except ValueError as exc:
        return [Finding(WARNING, f"cannot read the Thunderbolt ports: {exc}"[:200], "system_profiler SPThunderboltDataType",
                        "", "thunderbolt-speed")]
    out = []
    for link in links:
        if not link["peer_uuid"] or link["speed_gbps"] is None:
            continue
        if link["speed_gbps"] <= TB4_MAX_GBPS:
            name = f"{link['port']} ({link['iface'] or 'no interface'})"
            out.append(Finding(ERROR, f"{name} links to {link['peer'] or 'its peer'} at {link['speed_gbps']:g} Gb/s "
                                      "(Thunderbolt 4 or older): kept out of jaccl, which needs Thunderbolt 5 "
                                      "(80/120 Gb/s; on TB4 it crashes in ibv_reg_mr: exo #2186, mlx #3777)",
                               "system_profiler SPThunderboltDataType   # cable both Macs' Thunderbolt 5 ports "
                               "with a Thunderbolt 5 cable",
                               "RDMA over Thunderbolt needs Thunderbolt 5 on both ends (MLX distributed.rst); "
                               "ring over this link still works", "thunderbolt-speed"))
    return out


def bridge_members(ifconfig_bridge: str) -> Tuple[bool, List[str]]:
    """``(up, members)`` of ``ifconfig bridge0``: ``UP`` in its flags, its ``member: enX`` lines."""
    lines = ifconfig_bridge.splitlines()
    up = bool(lines) and bool(re.search(r"flags=\w+<([^>]*\bUP\b[^>]*)>", lines[0]))
    members = [m.group(1) for m in re.finditer(r"^\s*member:\s*(\S+)", ifconfig_bridge, re.MULTILINE)]
    return up, members


def check_bridge(ifconfig_bridge: Optional[Ran], networksetup: Optional[Ran],
                 addresses: Optional[Mapping[str, str]] = None) -> List[Finding]:
    """No Thunderbolt interface is a member of an up ``bridge0`` (the Thunderbolt Bridge).

    Reads ``ifconfig bridge0`` (``flags=...<UP,...>``, ``member: en2 flags=3<LEARNING,DISCOVER>``)
    and ``networksetup -listallhardwareports`` (which enX are Thunderbolt ports).  Source: MLX
    ``config.py: IPConfigurator.setup`` runs ``ifconfig bridge0 down`` before addressing the ports:
    a bridged port is not an interface of its own, so jaccl's ``rdma_enX`` and a route over enX fail.
    A port taken out of the bridge has no address: the fix also gives it one (``addresses``: enX ->
    the network plan's address command, else the command with a placeholder).
    """
    if ifconfig_bridge is None or ifconfig_bridge.rc != 0 or networksetup is None:
        return []  # no ifconfig, or no bridge0: nothing takes the ports
    up, members = bridge_members(ifconfig_bridge.out)
    tb = {dev for name, dev in parse_hardware_ports(networksetup.out).items() if name.startswith("Thunderbolt ")
          and name != "Thunderbolt Bridge"}
    taken = [m for m in members if m in tb]
    if not up or not taken:
        return []
    addresses = addresses or {}
    return [Finding(ERROR, f"Thunderbolt port {m} is inside bridge0 (the Thunderbolt Bridge)",
                    f"sudo ifconfig bridge0 deletem {m} && " + addresses.get(
                        m, f"sudo ifconfig {m} inet <this end's address of the cable's /30> netmask {NETMASK}   # "
                           "mlxcluster join --dry-run prints it; or: mlxcluster join --configure-network"),
                    "or disable the bridge for good: sudo networksetup -setnetworkserviceenabled "
                    "\"Thunderbolt Bridge\" off (MLX's setup: sudo ifconfig bridge0 down); a bridged port "
                    "cannot carry jaccl or its own route", "bridge") for m in taken]


def parse_ifconfig_mtus(text: str) -> Dict[str, int]:
    """Interface -> MTU from ``ifconfig`` (macOS/BSD: ``en2: flags=8863<UP,...> mtu 1500``) or
    ``ip -o link`` (Linux: ``2: eth0: <BROADCAST,...> mtu 1500 qdisc ...``)."""
    out = {}
    for match in re.finditer(r"^(?:\d+:\s+)?([A-Za-z0-9_.\-]+)(?:@\S+)?:\s.*?\bmtu\s+(\d+)", text, re.MULTILINE):
        out[match.group(1)] = int(match.group(2))
    return out


# --------------------------------------------------------------------------- routes (both systems)


def route_interface(system: str, text: str) -> Tuple[str, str]:
    """``(interface, gateway)`` of one route lookup: macOS ``route -n get PEER`` (``interface: en2``,
    ``gateway: 192.168.1.1``), Linux ``ip route get PEER`` (``PEER via GW dev eth0 src ...``);
    ``("", "")`` when it names none."""
    if system == "Darwin":
        iface = re.search(r"^\s*interface:\s*(\S+)", text, re.MULTILINE)
        gw = re.search(r"^\s*gateway:\s*(\S+)", text, re.MULTILINE)
        return (iface.group(1) if iface else "", gw.group(1) if gw else "")
    iface = re.search(r"\bdev\s+(\S+)", text)
    gw = re.search(r"\bvia\s+(\S+)", text)
    return (iface.group(1) if iface else "", gw.group(1) if gw else "")


def check_route(system: str, peer: str, lookup: Optional[Ran], networksetup: Optional[Ran] = None,
                cabled_ifaces: Sequence[str] = ()) -> List[Finding]:
    """The route to ``peer`` leaves through a wired interface on the peer's link, not Wi-Fi or a gateway.

    Reads ``route -n get PEER`` (macOS) or ``ip route get PEER`` (Linux), and on macOS
    ``networksetup -listallhardwareports`` (which enX is ``Wi-Fi``, which are ``Thunderbolt N``);
    ``cabled_ifaces``: Thunderbolt interfaces with a cable to another Mac.  Source: exo #2295 (the
    collective took Wi-Fi while Thunderbolt was cabled); MLX ``IPConfigurator.setup`` pins each
    peer's route: ``route change PEER -interface enX``.
    """
    tool = "route -n get" if system == "Darwin" else "ip route get"
    if lookup is None:
        return [Finding(WARNING, f"cannot check the route to {peer}: `{tool.split()[0]}` not found",
                        "", "", "route")]
    iface, gateway = route_interface(system, lookup.out)
    if lookup.rc != 0 or not iface:
        why = (lookup.err or lookup.out).strip().splitlines()
        return [Finding(ERROR, f"no route to peer {peer}" + (f": {why[-1][:120]}" if why else ""),
                        f"{tool} {peer}   # give this node an address on the peer's network",
                        "the collective cannot reach this peer", "route")]
    if iface.startswith("lo"):
        return []
    ports = parse_hardware_ports(networksetup.out) if (system == "Darwin" and networksetup is not None) else {}
    wifi = {dev for name, dev in ports.items() if name in ("Wi-Fi", "AirPort")}
    is_wifi = iface in wifi if ports else iface.startswith("wl")
    tb = [dev for dev in cabled_ifaces]
    if is_wifi:
        if system == "Darwin" and tb:
            fix = f"sudo route change {peer} -interface {tb[0]}"
            sev, why = ERROR, f"a Thunderbolt cable is connected on {', '.join(tb)}"
        else:
            fix = (f"sudo route change {peer} -interface <wired interface>" if system == "Darwin"
                   else f"sudo ip route replace {peer}/32 dev <wired interface>")
            sev, why = WARNING, "Wi-Fi's latency and bandwidth make every collective slow"
        return [Finding(sev, f"the route to peer {peer} takes Wi-Fi ({iface})", fix,
                        f"{why} (exo #2295); or join with --interface of the wired link", "route")]
    if gateway and not gateway.startswith("link#"):
        fix = (f"sudo route change {peer} -interface <interface on the peer's link>" if system == "Darwin"
               else f"sudo ip route replace {peer}/32 dev <interface on the peer's link>")
        return [Finding(WARNING, f"the route to peer {peer} goes through gateway {gateway} ({iface}), "
                                 "not a direct link", fix, "every collective crosses a router", "route")]
    if system == "Darwin" and tb and iface not in tb and not iface.startswith("bridge"):
        return [Finding(WARNING, f"the route to peer {peer} takes {iface}, not a Thunderbolt port "
                                 f"({', '.join(tb)} cabled)", f"sudo route change {peer} -interface {tb[0]}",
                        "MLX IPConfigurator.setup pins each peer's route to its Thunderbolt port", "route")]
    return []


# --------------------------------------------------------------------------- across nodes


def _cables(reports: Sequence[NodeReport]) -> List[Tuple[str, str, str, str]]:
    """``(node_a, iface_a, node_b, iface_b)`` of each Thunderbolt cable between two reports' Macs."""
    where: Dict[str, Tuple[str, str, str]] = {}
    for r in reports:
        prof, ns = r.out("system_profiler SPThunderboltDataType -json"), r.out("networksetup -listallhardwareports")
        if prof is None or ns is None:
            continue
        try:
            for link in thunderbolt_links(prof.out, parse_hardware_ports(ns.out)):
                if link["uuid"]:
                    where[link["uuid"]] = (r.name, link["iface"], link["peer_uuid"])
        except ValueError:
            continue
    out, seen = [], set()
    for uuid, (node, iface, peer_uuid) in where.items():
        if peer_uuid in where and (peer_uuid, uuid) not in seen:
            seen.add((uuid, peer_uuid))
            other = where[peer_uuid]
            out.append((node, iface, other[0], other[1]))
    return sorted(out)


def check_mtu(reports: Sequence[NodeReport]) -> List[Finding]:
    """Both ends of each Thunderbolt cable have the same MTU.

    Reads each node's ``ifconfig`` (``enX: flags=... mtu N``) and its Thunderbolt ports
    (``system_profiler``/``networksetup``: the cable's two ports from their ``domain_uuid_key``).
    Source: IP over one link: a frame larger than the receiver's MTU is dropped (RFC 894), and no
    path-MTU discovery happens on-link, so the ring's large TCP segments stall.
    """
    mtus = {r.name: parse_ifconfig_mtus(r.out("ifconfig").out) for r in reports if r.out("ifconfig") is not None}
    out = []
    for a, ia, b, ib in _cables(reports):
        ma, mb = mtus.get(a, {}).get(ia), mtus.get(b, {}).get(ib)
        if ma is None or mb is None or ma == mb:
            continue
        low_node, low_if, high = (a, ia, mb) if ma < mb else (b, ib, ma)
        out.append(Finding(ERROR, f"MTU mismatch on the Thunderbolt cable {a}:{ia} (mtu {ma}) - {b}:{ib} (mtu {mb})",
                           f"sudo ifconfig {low_if} mtu {high}   # on {low_node} (or set both ends to the same MTU)",
                           "frames over the smaller MTU are dropped (RFC 894): collectives stall", "mtu", low_node))
    return out


def check_versions(reports: Sequence[NodeReport]) -> List[Finding]:
    """Every node runs the same MLX, and every Mac the same macOS.

    Reads each report's ``mlx_version`` and ``sw_vers -productVersion``.  Source: issue 31 (exo
    #1973, mlx #2944: RDMA between Macs of different macOS fails); ranks of one group load the same
    MLX and exchange its collectives, so versions must match.
    """
    out = []
    mlx = {r.name: r.mlx_version or "not installed" for r in reports}
    if len(set(mlx.values())) > 1:
        newest = max((v for v in mlx.values() if v != "not installed"), key=_version_tuple, default="")
        out.append(Finding(ERROR, "MLX versions differ: " + ", ".join(f"{n} {v}" for n, v in sorted(mlx.items())),
                           f"pip install 'mlx=={newest}'   # on every node, in mlxcluster's environment",
                           "every rank must run the same MLX build", "versions"))
    macs = {r.name: (r.out("sw_vers -productVersion").out.strip() if r.out("sw_vers -productVersion") else "?")
            for r in reports if r.system == "Darwin"}
    if len(set(macs.values())) > 1:
        newest = max(macs.values(), key=_version_tuple)
        out.append(Finding(ERROR, "macOS versions differ: " + ", ".join(f"{n} {v}" for n, v in sorted(macs.items())),
                           f"softwareupdate --list   # update every Mac to macOS {newest}",
                           "RDMA between Macs on different macOS versions fails (exo #1973, mlx #2944)", "versions"))
    return out


# --------------------------------------------------------------------------- Linux


def check_openmpi(system: str, mpirun_version: Optional[Ran], orted_found: bool) -> List[Finding]:
    """OpenMPI 4's ``mpirun`` and ``orted`` are installed (the ``mpi`` backend).

    Reads ``mpirun --version`` (``mpirun (Open MPI) 4.1.6``; 5.x prints ``mpirun (Open MPI) 5.0.5``:
    ``backends.openmpi_version``) and whether ``orted`` is on PATH.  Source: ``backends.mpi_usable``
    (rank 0's node runs mpirun, every other member's node OpenMPI's orted through ``Node.Exec``);
    OpenMPI 5 runs PRRTE (``prterun``/``prted``, no ``orted``) and is refused
    (``backends.openmpi_refusal``: ``join --backend auto`` then picks jaccl or the ring); MPICH's or
    Intel's mpirun (``HYDRA``) is not OpenMPI.  On macOS a missing OpenMPI is a warning (jaccl and
    the ring need none).
    """
    from .backends import OPENMPI4_INSTALL, openmpi_refusal, openmpi_version

    install = OPENMPI4_INSTALL.get(system, OPENMPI4_INSTALL["Linux"])
    if mpirun_version is None:
        return [Finding(WARNING if system == "Darwin" else ERROR, "OpenMPI not found (no mpirun): the mpi backend "
                        "is unavailable", install, "backends.mpi_usable needs OpenMPI 4's mpirun and orted", "openmpi")]
    text = mpirun_version.out + mpirun_version.err
    if "Open MPI" not in text and "OpenRTE" not in text:
        first = (text.strip().splitlines() or ["?"])[0][:80]
        return [Finding(ERROR, f"mpirun is not OpenMPI ({first!r})", install,
                        "MLX's MPI backend is launched here with OpenMPI's mpirun and orted", "openmpi")]
    refusal = openmpi_refusal(openmpi_version(text), system)
    if refusal:
        return [Finding(WARNING if system == "Darwin" else ERROR, refusal, install,
                        "OpenMPI 5 replaced ORTE's orted by PRRTE's prted; runtime/mpi_agent.py starts orted "
                        "(backends.openmpi_refusal)", "openmpi")]
    if not orted_found:
        return [Finding(ERROR, "OpenMPI's orted is not on PATH: members cannot start MPI ranks", install,
                        "backends.mpi_usable", "openmpi")]
    return []


def check_blas(system: str, openblas: str, setting: str, numpy_blas: str) -> List[Finding]:
    """On Linux, MLX's CPU matmuls get OpenBLAS, and numpy was built with an optimised BLAS.

    Reads ``blas.find_openblas()`` (``openblas``: the library rank processes preload, ``""``
    none), ``MLXCLUSTER_BLAS`` (``setting``) and numpy's build BLAS (``numpy.__config__``).
    Source: ``runtime/blas.py`` (the ``mlx[cpu]`` wheel's reference BLAS: a 256x576x1536 float32
    matmul ~200 ms, ~4 ms with OpenBLAS preloaded).
    """
    if system != "Linux":
        return []
    out = []
    if setting == "reference":
        out.append(Finding(NOTE, "MLXCLUSTER_BLAS=reference: ranks use MLX's reference BLAS", "unset MLXCLUSTER_BLAS",
                           "runtime/blas.py", "blas"))
    elif setting and not openblas:
        out.append(Finding(ERROR, f"MLXCLUSTER_BLAS={setting} is not a file: ranks fall back to the reference BLAS",
                           "unset MLXCLUSTER_BLAS", "runtime/blas.py: find_openblas", "blas"))
    elif not openblas:
        out.append(Finding(WARNING, "no OpenBLAS to preload: MLX's CPU matmuls use the reference BLAS (~50x slower)",
                           "sudo apt-get install libopenblas0-pthread",
                           "runtime/blas.py looks for <arch>-linux-gnu/openblas-{pthread,openmp,serial}/libblas.so.3",
                           "blas"))
    name = numpy_blas.lower()
    if numpy_blas and not any(k in name for k in ("openblas", "mkl", "accelerate", "blis")):
        out.append(Finding(WARNING, f"numpy is built with {numpy_blas!r}, not an optimised BLAS",
                           "pip install --force-reinstall numpy   # the PyPI wheel bundles OpenBLAS",
                           "numpy.__config__ Build Dependencies: blas", "blas"))
    return out


# --------------------------------------------------------------------------- firewall


@dataclass(frozen=True)
class _Probe:
    proto: str
    port: int
    daddr: str  # "" unknown (this node's address)
    saddr: str  # "" unknown (a peer)
    what: str
    severity: str


def _probes(ports: Tuple[int, int], peers: Sequence[str]) -> List[_Probe]:
    low, high = ports
    src = peers[0] if peers else ""
    out = [_Probe("tcp", p, "", src, f"TCP {low}-{high} (Node, ring and control ports)", ERROR)
           for p in sorted({low, (low + high) // 2, high})]
    out.append(_Probe(MDNS[0], MDNS[1], MDNS[2], src, "UDP 5353 to 224.0.0.251 (mDNS discovery)", ERROR))
    out.append(_Probe("tcp", high + 1024, "", src, f"TCP {high + 1024} (OpenMPI's TCP ports, ephemeral)", WARNING))
    return out


def _port_in(port: int, spec: str) -> bool:
    for part in re.split(r"[,\s]+", spec.strip("{} ")):
        if not part:
            continue
        lo, _, hi = part.replace(":", "-").partition("-")
        try:
            if int(lo) <= port <= int(hi or lo):
                return True
        except ValueError:
            return False
    return False


def _addr_in(addr: str, spec: str) -> Optional[bool]:
    if not addr:
        return None  # unknown: assume the rule is written for it
    try:
        return any(ipaddress.IPv4Address(addr) in ipaddress.IPv4Network(s.strip(), strict=False)
                   for s in spec.strip("{} ").split(",") if s.strip())
    except ValueError:
        return None


_NEW_STATES = {"new", "untracked"}


def _iptables_match(args: List[str], probe: _Probe) -> Optional[bool]:
    """Whether one ``-A CHAIN ...`` rule matches the probe: True/False, ``None`` when it has an
    option this reader does not know (the rule is then skipped)."""
    i, ok = 0, True
    while i < len(args):
        neg = args[i] == "!"
        if neg:
            i += 1
        opt = args[i]
        val = args[i + 1] if i + 1 < len(args) else ""
        step = 2
        if opt in ("-p", "--protocol"):
            hit = val in (probe.proto, "all", "0")
        elif opt in ("--dport", "--destination-port", "--dports", "--destination-ports"):
            hit = _port_in(probe.port, val)
        elif opt in ("-i", "--in-interface"):
            hit = not val.startswith("lo")
        elif opt in ("-s", "--source"):
            r = _addr_in(probe.saddr, val)
            hit = True if r is None else r
        elif opt in ("-d", "--destination"):
            r = _addr_in(probe.daddr, val)
            hit = True if r is None else r
        elif opt in ("--state", "--ctstate"):
            hit = bool(_NEW_STATES & {s.lower() for s in val.split(",")})
        elif opt == "--dst-type":
            hit = val == ("MULTICAST" if probe.daddr.startswith("224.") else "LOCAL")
        elif opt == "-m":
            hit = True  # the module's own options follow
        elif opt in ("--comment", "--limit", "--limit-burst", "--log-prefix", "--log-level", "--reject-with",
                     "--src-type", "--tcp-flags", "--syn", "-o", "--out-interface"):
            hit = True
            if opt == "--tcp-flags":
                step = 3
            elif opt == "--syn":
                step = 1
        else:
            return None
        if neg:
            hit = not hit
        ok = ok and hit
        i += step
    return ok


def _iptables_verdict(text: str, probe: _Probe) -> Tuple[str, str]:
    """``(verdict, rule)`` of ``iptables -S``'s filter table for the probe arriving in INPUT."""
    chains: Dict[str, List[Tuple[List[str], str, str, str]]] = {}
    policy: Dict[str, str] = {}
    for line in text.splitlines():
        try:
            words = shlex.split(line)
        except ValueError:
            continue
        if len(words) >= 3 and words[0] == "-P":
            policy[words[1]] = words[2]
        elif len(words) >= 2 and words[0] == "-N":
            chains.setdefault(words[1], [])
        elif len(words) >= 2 and words[0] == "-A":
            rest, kind, target = words[2:], "", ""
            for k, w in enumerate(words[2:]):
                if w in ("-j", "--jump", "-g", "--goto"):
                    kind = "goto" if w in ("-g", "--goto") else "jump"
                    target = words[2 + k + 1] if 2 + k + 1 < len(words) else ""
                    rest = words[2:2 + k]  # what follows the target is the target's options
                    break
            chains.setdefault(words[1], []).append((rest, kind, target, line))

    def run(chain: str, depth: int) -> Tuple[str, str]:
        if depth > 16:
            return "", ""
        for matches, kind, target, line in chains.get(chain, []):
            if _iptables_match(matches, probe) is not True:
                continue
            if target in ("ACCEPT",):
                return "accept", line
            if target in ("DROP", "REJECT"):
                return "drop", line
            if target == "RETURN":
                return "", ""
            if target in chains:
                verdict, why = run(target, depth + 1)
                if verdict or kind == "goto":
                    return verdict, why
        return "", ""

    verdict, why = run("INPUT", 0)
    if verdict:
        return verdict, why
    pol = policy.get("INPUT", "ACCEPT")
    return ("drop" if pol in ("DROP", "REJECT") else "accept"), f"-P INPUT {pol}"


def _nft_chains(text: str) -> Tuple[Dict[str, List[str]], List[Tuple[str, str]]]:
    """``(chain -> rule lines, [(input base chain, policy)])`` of ``nft list ruleset``'s ip and
    inet tables (chains named ``family table chain``)."""
    chains: Dict[str, List[str]] = {}
    bases: List[Tuple[str, str]] = []
    table, chain = "", ""
    for raw in text.splitlines():
        line = raw.strip()
        m = re.match(r"table\s+(\w+)\s+(\S+)\s*\{", line)
        if m:
            table, chain = (f"{m.group(1)} {m.group(2)}" if m.group(1) in ("ip", "inet") else ""), ""
            continue
        m = re.match(r"chain\s+(\S+)\s*\{", line)
        if m:
            chain = f"{table} {m.group(1)}" if table else ""
            if chain:
                chains[chain] = []
            continue
        if not chain or not line or line == "}" or line.startswith("#"):
            if line == "}" and chain:
                chain = ""
            continue
        m = re.match(r"type\s+filter\s+hook\s+(\w+)\s+.*?;\s*(?:policy\s+(\w+);)?", line)
        if m:
            if m.group(1) == "input":
                bases.append((chain, m.group(2) or "accept"))
            continue
        if line.startswith(("policy ", "type ", "comment ")):
            continue
        chains[chain].append(line)
    return chains, bases


def _nft_set(words: List[str], k: int) -> Tuple[List[str], int, bool]:
    """The value at ``words[k]`` (a ``{ a, b }`` set or one word, after an optional ``!=``): (items, next, negated)."""
    neg = k < len(words) and words[k] == "!="
    if neg:
        k += 1
    if k < len(words) and words[k].startswith("{"):
        items = []
        while k < len(words):
            items.extend(x for x in words[k].strip("{},").split(",") if x)
            if words[k].endswith("}"):
                break
            k += 1
        return items, k + 1, neg
    return ([x for x in words[k].split(",") if x] if k < len(words) else []), k + 1, neg


def _nft_rule(line: str, probe: _Probe) -> Tuple[Optional[bool], str, str]:
    """``(matches, verdict, target)`` of one nft rule (``matches`` None: an expression this reader
    does not know, so the rule is skipped)."""
    words = line.replace('"', "").split()
    k, ok, verdict, target = 0, True, "", ""
    while k < len(words):
        w = words[k]
        nxt = words[k + 1] if k + 1 < len(words) else ""
        if w in ("tcp", "udp", "th") and nxt in ("dport", "sport"):
            items, k, neg = _nft_set(words, k + 2)
            hit = (w in (probe.proto, "th")) and (nxt == "dport" and any(_port_in(probe.port, i) for i in items))
            if nxt == "sport":
                return None, "", ""
            ok = ok and (hit != neg)
            continue
        if w in ("tcp", "udp") and nxt == "flags":
            return None, "", ""
        if (w, nxt) in (("meta", "l4proto"), ("ip", "protocol")):
            items, k, neg = _nft_set(words, k + 2)
            ok = ok and ((probe.proto in items) != neg)
            continue
        if w == "ct" and nxt == "state":
            items, k, neg = _nft_set(words, k + 2)
            ok = ok and (bool(_NEW_STATES & set(items)) != neg)
            continue
        if w in ("iif", "iifname") or (w == "meta" and nxt in ("iif", "iifname")):
            k += 2 if w == "meta" else 1
            items, k, neg = _nft_set(words, k)
            ok = ok and ((not all(i.startswith("lo") for i in items)) != neg)
            continue
        if w == "ip" and nxt in ("saddr", "daddr"):
            items, k, neg = _nft_set(words, k + 2)
            r = _addr_in(probe.saddr if nxt == "saddr" else probe.daddr, ",".join(items))
            ok = ok and ((True if r is None else r) != neg)
            continue
        if w in ("ip6", "icmp", "icmpv6") or (w == "meta" and nxt == "nfproto" and "ipv6" in words[k + 2:k + 3]):
            return False, "", ""
        if w == "fib" or (w == "meta" and nxt == "pkttype"):
            return None, "", ""
        if w == "counter":
            k += 1
            while k < len(words) and words[k] in ("packets", "bytes"):
                k += 2
            continue
        if w == "log":
            k += 1
            while k < len(words) and words[k] in ("prefix", "level", "flags", "group"):
                k += 2
            continue
        if w in ("accept", "drop", "reject", "return"):
            verdict = w
            break
        if w in ("jump", "goto"):
            verdict, target = w, nxt
            break
        if w in ("limit", "comment"):
            return None, "", ""
        return None, "", ""
    return ok, verdict, target


def _nft_verdict(text: str, probe: _Probe) -> Tuple[str, str, str]:
    """``(verdict, why, "family table chain")`` of ``nft list ruleset`` for the probe: dropped when
    any input-hook chain drops it."""
    chains, bases = _nft_chains(text)

    def run(chain: str, depth: int) -> Tuple[str, str]:
        if depth > 16:
            return "", ""
        for line in chains.get(chain, []):
            ok, verdict, target = _nft_rule(line, probe)
            if ok is not True or not verdict:
                continue
            if verdict == "accept":
                return "accept", line
            if verdict in ("drop", "reject"):
                return "drop", line
            if verdict == "return":
                return "", ""
            full = f"{chain.rsplit(' ', 1)[0]} {target}"
            got, why = run(full, depth + 1)
            if got or verdict == "goto":
                return got, why
        return "", ""

    for base, policy in bases:  # every input hook must let it through
        verdict, why = run(base, 0)
        if not verdict:
            verdict, why = ("drop" if policy == "drop" else "accept"), f"chain {base.split()[-1]} policy {policy}"
        if verdict == "drop":
            return "drop", f"table {' '.join(base.split()[:2])}: {why}", base
    return "accept", "", ""


def check_firewall(nft: Optional[Ran], iptables: Optional[Ran], ports: Tuple[int, int] = (LOW_PORT, 32767),
                   peers: Sequence[str] = ()) -> List[Finding]:
    """The firewall lets peers reach this node's ports: new TCP connections to the Node, ring and
    control ports, mDNS, OpenMPI's TCP ports.

    Reads ``nft list ruleset`` (input-hook chains of the ``ip``/``inet`` tables, their rules,
    jumps and policies) and ``iptables -S`` (the filter table's INPUT chain, user chains and
    policy), and follows them for one packet per port (from the first peer when known).  Rules
    with expressions this reader does not know are skipped.  Source: the ports mlxcluster uses --
    ``launcher.free_ports`` (``ports``: 10000 up to below the ephemeral range), mDNS
    224.0.0.251:5353/udp (RFC 6762), OpenMPI's TCP BTL (ephemeral ports).
    """
    out = []
    for probe in _probes(ports, peers):
        blocked, fixes = [], []
        if probe.proto == "udp":
            nft_match, ipt_match = "ip daddr 224.0.0.251 udp dport 5353", "-p udp -d 224.0.0.251 --dport 5353"
        elif probe.severity == WARNING:  # OpenMPI's TCP BTL and orted pick ephemeral ports: allow the peers
            nft_match, ipt_match = "ip saddr <peer network> accept  #", "-s <peer network>"
        else:
            nft_match, ipt_match = f"tcp dport {ports[0]}-{ports[1]}", f"-p tcp --dport {ports[0]}:{ports[1]}"
        if nft is not None and nft.rc == 0 and nft.out.strip():
            verdict, why, base = _nft_verdict(nft.out, probe)
            if verdict == "drop":
                blocked.append(f"nft: {why}")
                fixes.append(f"sudo nft insert rule {base} {nft_match} accept".replace(" accept  # accept", " accept"))
        if iptables is not None and iptables.rc == 0 and iptables.out.strip():
            verdict, why = _iptables_verdict(iptables.out, probe)
            if verdict == "drop":
                blocked.append(f"iptables: {why}")
                fixes.append(f"sudo iptables -I INPUT {ipt_match} -j ACCEPT")
        if blocked and not any(f.what.endswith(probe.what) for f in out):  # one finding per port range
            out.append(Finding(probe.severity, f"the firewall drops {probe.what}", " && ".join(fixes),
                               "; ".join(blocked)[:300], "firewall"))
    for name, ran in (("nft list ruleset", nft), ("iptables -S", iptables)):
        if ran is not None and ran.rc != 0 and re.search(r"denied|not permitted|must be root", ran.err, re.I):
            out.append(Finding(NOTE, f"cannot read the firewall rules ({name}: {ran.err.strip()[:80]})",
                               "sudo mlxcluster doctor", "", "firewall"))
    return out


# --------------------------------------------------------------------------- macOS firewall, Local Network

#: macOS's application firewall tool.
SOCKETFILTERFW = "/usr/libexec/ApplicationFirewall/socketfilterfw"
#: The key of :func:`probe_local_network`'s result in :attr:`NodeReport.outputs`.
MDNS_PROBE = "mdns send 224.0.0.251:5353"
_LOCAL_NETWORK_FIX = ("open 'x-apple.systempreferences:com.apple.preference.security?Privacy_LocalNetwork'   "
                      "# System Settings > Privacy & Security > Local Network: turn on the app that runs mlxcluster "
                      "(Terminal, iTerm, ...); already on: turn it off and on, then restart mlxcluster")


def check_macos_firewall(globalstate: Optional[Ran], blockall: Optional[Ran], stealth: Optional[Ran],
                         appblocked: Optional[Ran]) -> List[Finding]:
    """macOS's application firewall lets peers reach this node (its ports, its mDNS answers).

    Reads ``socketfilterfw --getglobalstate`` (``Firewall is enabled. (State = 1)``; ``State = 2``:
    block all, older macOS), ``--getblockall`` (``Firewall has block all state set to enabled.``),
    ``--getstealthmode`` (``Firewall stealth mode is on``) and ``--getappblocked <python>``
    (``Incoming connection to <path> is blocked.`` / ``... is permitted.``; it says ``permitted`` for a
    program it has never listed too, so only ``blocked`` is a finding).  Recorded in
    ``tests/data/macos/socketfilterfw_*.txt``.  Source: exo #1035 (the firewall and the Local Network
    permission behind most discovery failures).
    """
    if globalstate is None or "State = 0" in globalstate.out or "enabled" not in globalstate.out.lower():
        return []
    out: List[Finding] = []
    if "State = 2" in globalstate.out or (blockall is not None and "set to enabled" in blockall.out):
        out.append(Finding(ERROR, "the macOS firewall blocks all incoming connections: peers reach neither this "
                                  "node's ports nor its mDNS answers", f"sudo {SOCKETFILTERFW} --setblockall off",
                           "socketfilterfw --getblockall: block all set to enabled (System Settings > Network > "
                           "Firewall > Options)", "firewall"))
    m = re.search(r"Incoming connection to (.+) is blocked", appblocked.out if appblocked else "")
    if m:
        path = shlex.quote(m.group(1))
        out.append(Finding(ERROR, f"the macOS firewall blocks incoming connections to {m.group(1)}: peers cannot "
                                  "reach this node's Node, ring and control ports",
                           f"sudo {SOCKETFILTERFW} --add {path} && sudo {SOCKETFILTERFW} --unblockapp {path}",
                           "socketfilterfw --getappblocked: the Python that runs mlxcluster is blocked", "firewall"))
    if stealth is not None and "mode is on" in stealth.out:
        out.append(Finding(NOTE, "macOS firewall stealth mode is on: this Mac answers no ping (mlxcluster needs "
                                 "none)", "", "socketfilterfw --getstealthmode", "firewall"))
    return out


def probe_local_network(send: Optional[Callable[[], None]] = None) -> Ran:
    """Send one mDNS query to 224.0.0.251:5353 from this process: ``Ran("", 0)`` when it leaves,
    ``Ran("", errno, message)`` when the system refuses it.  ``send`` replaces the real send (tests).

    macOS's Local Network privacy (Apple TN3179) refuses a denied program's multicast and LAN sends with
    ``EHOSTUNREACH`` ("No route to host"); no command line reads the permission.  exo PR #1103 detects it
    the same way (a UDP send to the mDNS group)."""
    import socket

    def real() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(1.0)
            header = b"\x00\x00\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00"  # id 0, flags 0, one question
            query = header + b"\x09_services\x07_dns-sd\x04_udp\x05local\x00\x00\x0c\x00\x01"  # PTR IN
            sock.sendto(query, ("224.0.0.251", 5353))

    try:
        (send or real)()
        return Ran("", 0)
    except OSError as exc:
        return Ran("", int(exc.errno or -1), str(exc))


def check_local_network(probe: Optional[Ran]) -> List[Finding]:
    """macOS's Local Network permission lets this program use the LAN (:func:`probe_local_network`).

    An ``EHOSTUNREACH`` (65 on macOS) or "No route to host" on the mDNS send says it is denied:
    mDNS sees no peer and peers cannot connect.  Fix: System Settings > Privacy & Security > Local
    Network (a permission that looks on but does not work after a restart: turn it off and on, exo
    #952).  Source: Apple TN3179; exo #1035, PR #1103."""
    import errno

    if probe is None or probe.rc == 0:
        return []
    if probe.rc in (errno.EHOSTUNREACH, 65) or "no route to host" in probe.err.lower():
        return [Finding(ERROR, "macOS Local Network permission denied: this program's mDNS send failed with "
                               f"{probe.err.strip()[:60] or 'No route to host'}; peers cannot discover this node",
                        _LOCAL_NETWORK_FIX, "Apple TN3179 (Local Network privacy); exo #1035, #952, PR #1103",
                        "local-network")]
    return [Finding(WARNING, f"an mDNS send to 224.0.0.251:5353 failed: {probe.err.strip()[:80]} (errno {probe.rc})",
                    "route -n get 224.0.0.251   # is there a LAN interface with a multicast route?",
                    "every node announces and browses on 224.0.0.251:5353 (RFC 6762)", "local-network")]


# --------------------------------------------------------------------------- the collective


def check_collective(result: Optional[CollectiveResult], peers: int) -> List[Finding]:
    """A measured ``all_sum`` (latency of 4 bytes, bus bandwidth): a note with the figures, a
    warning when the latency says the collective is not on a fast link; without peers skipped."""
    if result is None:
        why = "no peers: a single node has no link to measure" if not peers else \
            "not run: a cross-node all_sum needs ranks on the peers, i.e. a formed group"
        return [Finding(NOTE, f"collective smoke test skipped ({why})", "", "", "collective")]
    text = (f"all_sum over {result.backend} on {result.ranks} ranks: {result.latency_us:.0f} us latency, "
            f"{result.bandwidth_gbs:.2f} GB/s")
    if result.latency_us > SLOW_ALLSUM_US:
        return [Finding(WARNING, text + " (slow: over 1 ms for 4 bytes)", "mlxcluster doctor   # check the routes",
                        "a 4-byte all_sum over Thunderbolt or Ethernet takes well under 1 ms", "collective")]
    return [Finding(NOTE, text, "", "", "collective")]


# --------------------------------------------------------------------------- one node


def _cabled(report: NodeReport) -> List[str]:
    prof, ns = report.out("system_profiler SPThunderboltDataType -json"), report.out("networksetup -listallhardwareports")
    if prof is None or ns is None:
        return []
    try:
        return [l["iface"] for l in thunderbolt_links(prof.out, parse_hardware_ports(ns.out)) if l["peer_uuid"] and l["iface"]]
    except ValueError:
        return []


def route_command(system: str, peer: str) -> List[str]:
    """The argv that looks the route to ``peer`` up: ``route -n get PEER`` or ``ip route get PEER``."""
    return ["route", "-n", "get", peer] if system == "Darwin" else ["ip", "route", "get", peer]


def check_node(report: NodeReport) -> List[Finding]:
    """Every check of one node (macOS: RDMA, macOS version, Thunderbolt speed, bridge0, routes;
    Linux: OpenMPI, BLAS, firewall, routes; both: the collective), each finding named after the node."""
    r = report
    out: List[Finding] = []
    if r.system == "Darwin":
        cabled = _cabled(r)
        ns = r.out("networksetup -listallhardwareports")
        out += check_macos(r.out("sw_vers -productVersion"))
        out += check_rdma(r.out("rdma_ctl status"), r.out("ibv_devices"), cabled)
        out += check_rdma_ports(r.out("ibv_devinfo -v"), cabled)
        out += check_thunderbolt_speed(r.out("system_profiler SPThunderboltDataType -json"), ns)
        out += check_bridge(r.out("ifconfig bridge0"), ns)
        for peer in r.peers:
            out += check_route(r.system, peer, r.out(" ".join(route_command(r.system, peer))), ns, cabled)
        out += check_macos_firewall(*(r.out(f"socketfilterfw --{q}") for q in
                                      ("getglobalstate", "getblockall", "getstealthmode", "getappblocked")))
        out += check_local_network(r.out(MDNS_PROBE))
        if "mpirun --version" in r.outputs:
            out += check_openmpi(r.system, r.out("mpirun --version"), r.out("which orted") is not None)
    else:
        out += check_openmpi(r.system, r.out("mpirun --version"), r.out("which orted") is not None)
        out += check_blas(r.system, r.blas, r.blas_setting, r.numpy_blas)
        out += check_firewall(r.out("nft list ruleset"), r.out("iptables -S"), r.ports, r.peers)
        for peer in r.peers:
            out += check_route(r.system, peer, r.out(" ".join(route_command(r.system, peer))))
    if not r.mlx_version:
        out.append(Finding(ERROR, "MLX is not installed", "pip install mlx" + ("" if r.system == "Darwin" else "[cpu]"),
                           "every rank runs MLX", "versions"))
    out += check_collective(r.collective, len(r.peers))
    return [Finding(f.severity, f.what, f.fix_command, f.detail, f.check, f.node or r.name) for f in out]


def recorded_node(report: NodeReport) -> Optional[RecordedNode]:
    """A Mac's report as the network plan's input (``None``: not macOS, or no Thunderbolt data)."""
    prof, ns = report.out("system_profiler SPThunderboltDataType -json"), report.out("networksetup -listallhardwareports")
    if report.system != "Darwin" or prof is None or ns is None or prof.rc != 0:
        return None

    def text(command: str) -> str:
        ran = report.out(command)
        return ran.out if ran is not None and ran.rc == 0 else ""

    return RecordedNode(report.name, prof.out, ns.out, text("ifconfig"), text("ibv_devices"),
                        text("sw_vers -productVersion"))


#: netplan problem -> (doctor's check, severity); TB4 and RDMA are check_thunderbolt_speed's and check_rdma's.
_NETWORK_CHECKS = {"no-address": ("address", ERROR), "bridge-loop": ("bridge-loop", ERROR),
                   "cabling": ("cabling", WARNING)}


def check_network(reports: Sequence[NodeReport]) -> List[Finding]:
    """The Thunderbolt network of the Macs among ``reports`` (``runtime/netplan.py``, as MLX's
    ``mlx.distributed_config`` plans it): a cabled port without an IPv4 address (fix: the plan's
    ``ifconfig``/``route`` commands, or ``mlxcluster join --configure-network``), ``bridge0`` up with
    Thunderbolt members while the cables form a loop of 3+ Macs (exo PR #1222: broadcast storm; fix:
    ``sudo ifconfig bridge0 down``), cabling that is neither a mesh nor a ring."""
    nodes = [n for n in (recorded_node(r) for r in reports) if n is not None]
    if not nodes:
        return []
    try:
        plan = network_plan(nodes)
    except ValueError as exc:
        return [Finding(WARNING, f"cannot plan the Thunderbolt network: {exc}"[:200], "mlxcluster join --dry-run",
                        "", "network")]
    return [Finding(_NETWORK_CHECKS[p.check][1], p.what, p.fix, "runtime/netplan.py (MLX config.py: IPConfigurator)",
                    _NETWORK_CHECKS[p.check][0], p.host) for p in plan.problems if p.check in _NETWORK_CHECKS]


def check_across(reports: Sequence[NodeReport]) -> List[Finding]:
    """The checks that compare nodes: MLX and macOS versions, the MTU at both ends of each cable, and
    the Thunderbolt network plan (:func:`check_network`)."""
    return check_versions(reports) + check_mtu(reports) + check_network(reports)


# --------------------------------------------------------------------------- runner


def run_tool(argv: Sequence[str], timeout_s: float = TIMEOUT_S) -> Optional[Ran]:
    """Run ``argv`` (no shell) for at most ``timeout_s`` seconds: its :class:`Ran`, ``None`` when
    ``argv[0]`` is not installed; a timeout or an OS error is a :class:`Ran` with rc -1."""
    exe = shutil.which(argv[0])
    if exe is None:
        return None
    try:
        p = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=timeout_s, check=False,
                           stdin=subprocess.DEVNULL)
        return Ran(p.stdout, p.returncode, p.stderr)
    except subprocess.TimeoutExpired:
        return Ran("", -1, f"timed out after {timeout_s:g} s")
    except OSError as exc:
        return Ran("", -1, str(exc))


def _numpy_blas() -> str:
    try:
        import numpy

        return str(numpy.__config__.CONFIG["Build Dependencies"]["blas"]["name"])
    except Exception:
        return ""


def doctor_local(name: str, peers: Sequence[str] = (), others: Sequence[NodeReport] = ()
                 ) -> Tuple[NodeReport, List[Finding]]:
    """Run this node's tools (routes and firewall toward ``peers``) and every check: this node's,
    and those across it and ``others`` (reports of other nodes)."""
    report = gather(name, peers)
    findings = check_node(report)
    if others:
        findings += check_across([report, *others])
    return report, findings


def gather(name: str, peers: Sequence[str] = (), system: Optional[str] = None,
           run: Callable[[Sequence[str]], Optional[Ran]] = run_tool) -> NodeReport:
    """Run this node's tools (``run(argv)``, default :func:`run_tool`) and record a :class:`NodeReport`."""
    import importlib.metadata
    import platform

    from .blas import find_openblas
    from .launcher import LOW_PORT as low, ephemeral_range
    from ..config import config

    system = system or platform.system()
    if system == "Darwin":
        commands = [["sw_vers", "-productVersion"], ["rdma_ctl", "status"], ["ibv_devices"], ["ibv_devinfo", "-v"],
                    ["system_profiler", "SPThunderboltDataType", "-json"], ["networksetup", "-listallhardwareports"],
                    ["ifconfig", "bridge0"], ["ifconfig"], ["mpirun", "--version"]]
    else:
        commands = [["mpirun", "--version"], ["nft", "list", "ruleset"], ["iptables", "-S"]]
    commands += [route_command(system, p) for p in peers]
    outputs: Dict[str, Optional[Ran]] = {}
    for argv in commands:
        outputs[" ".join(argv)] = run(argv)
    if system == "Darwin":  # the application firewall (full path: not on PATH) and Local Network
        import os
        import sys

        for q in ("getglobalstate", "getblockall", "getstealthmode", "getappblocked"):
            argv = [SOCKETFILTERFW, f"--{q}"] + ([os.path.realpath(sys.executable)] if q == "getappblocked" else [])
            outputs[f"socketfilterfw --{q}"] = run(argv) if os.path.exists(SOCKETFILTERFW) else None
        outputs[MDNS_PROBE] = probe_local_network()
    orted = shutil.which("orted")  # the mpi backend's daemon, on every system
    outputs["which orted"] = Ran(orted + "\n") if orted else None
    try:
        mlx_version = importlib.metadata.version("mlx")
    except importlib.metadata.PackageNotFoundError:
        mlx_version = ""
    return NodeReport(name=name, system=system, outputs=outputs, mlx_version=mlx_version,
                      blas=(find_openblas() or "") if system == "Linux" else "", blas_setting=config().blas or "",
                      numpy_blas=_numpy_blas(), peers=list(peers), ports=(low, max(low + 1, ephemeral_range()[0] - 1)))

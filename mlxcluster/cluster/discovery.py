"""Bonjour/mDNS discovery of cluster nodes (DNS-SD over multicast DNS).

Every node registers one DNS-SD service instance (RFC 6763) of type
:data:`SERVICE_TYPE` with python-zeroconf (https://python-zeroconf.readthedocs.io):

* PTR ``_mlxcluster._tcp.local.`` -> ``<instance>._mlxcluster._tcp.local.`` (RFC 6763 §4.1),
* SRV -> ``<instance>.local.`` and the node's gRPC ``Node`` service port (RFC 6763 §5),
* A ``<instance>.local.`` -> the IPv4 address the gRPC service listens on. The host name is
  per node (not the machine's ``hostname.local.``, which Avahi/mDNSResponder already own),
  so several nodes can share one machine,
* TXT with the node's facts as short ``key=value`` strings (RFC 6763 §6, see :func:`encode_txt`).

The instance name is derived only from the cluster name and node id (:attr:`NodeInfo.instance_name`),
so a restarted node announces the *same* name: its cache-flush announcements (RFC 6762 §10.2)
replace whatever the peers still cache about the previous incarnation, and no second entry appears.

Peers learn of departures three ways:

* goodbye packets (TTL 0, RFC 6762 §10.1) sent by :meth:`Discovery.stop` -> "removed" within ~1 s;
* record expiry for a node that died without a goodbye: :class:`Discovery` keeps the SRV records
  of its peers fresh with refresh queries at 80/85/90/95 % of their TTL (RFC 6762 §5.2) and reports
  "removed" once a peer's SRV record expires unanswered, i.e. within ``ttl_s`` (default
  :data:`DEFAULT_TTL_S`) of its death. python-zeroconf itself only tracks PTR records, whose TTL it
  raises to at least 1125 s, so it would report a crashed node for ~19 minutes;
* a restart under the same node id simply refreshes the records ("updated" when anything changed).

A node also defends its name (RFC 6762 §9): when its own records disappear from its cache (a
late goodbye from an old incarnation) or other data shows up for its name, it announces again.

All questions are QM (multicast answers): answers to QU questions are unicast to port 5353 of the
asking host, where another mDNS socket (a second node on the machine, mDNSResponder on macOS) can
swallow them. mDNS is membership, not a failure detector: callers should still health-check peers
over gRPC. All traffic goes to the mDNS group 224.0.0.251:5353 on the given interfaces (IPv4 only).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import ipaddress
import logging
import os
import platform as _platform
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple, Union

import ifaddr
from zeroconf import (
    DNSOutgoing,
    DNSQuestion,
    DNSQuestionType,
    InterfaceChoice,
    IPVersion,
    NonUniqueNameException,
    ServiceBrowser,
    ServiceInfo,
    ServiceStateChange,
    Zeroconf,
    current_time_millis,
)

__all__ = [
    "DEFAULT_TTL_S",
    "MAX_MEMORY_BYTES",
    "PROTOCOL_VERSION",
    "SERVICE_TYPE",
    "Browser",
    "Discovery",
    "DiscoveryError",
    "NodeInfo",
    "browse",
    "decode_txt",
    "encode_txt",
    "local_node_facts",
    "primary_address",
    "rank_interfaces",
    "interface_kind",
    "parse_ifconfig_ipv4",
    "RankedInterface",
    "INTERFACE_KINDS",
    "resolve_interfaces",
]

log = logging.getLogger(__name__)

SERVICE_TYPE = "_mlxcluster._tcp.local."
"""DNS-SD service type (RFC 6763 §7: ``_<service>._tcp`` under ``local.``, RFC 6762 §3)."""

PROTOCOL_VERSION = 2
"""Version of the node protocol, advertised in TXT key ``v`` (2: mutual TLS, no auth tag)."""

MAX_MEMORY_BYTES = 64 * 2**40
"""The largest ``mem`` a TXT record may advertise (64 TiB, beyond any one machine): a larger or
negative value (TXT records are unauthenticated) is read as unknown, ``memory_bytes == 0``."""

DEFAULT_TTL_S = 60
"""TTL in seconds of every record a node announces, and so the time within which peers notice a
node that vanished without a goodbye. RFC 6762 §10 suggests 120 s for host records; shorter
is fine on a LAN and bounds how long a dead node lingers."""

RESOLVE_TIMEOUT_S = 3.0
"""Longest a discovery worker waits for one peer's SRV/TXT/A records, in seconds."""

CONFLICT_WAIT_S = 5.0
"""Default time, in seconds, :meth:`Discovery.start` keeps probing while another live responder
still claims this node's instance name (e.g. an old incarnation that is shutting down)."""

_TXT_MAX = 255  # RFC 6763 §6.1: each key=value string is one length-prefixed string, <= 255 bytes
_LABEL_MAX = 63  # RFC 1035 §2.3.4: a DNS label is at most 63 bytes
_TRUNCATABLE_KEYS = ("plat", "chip")  # informational values, cut to fit rather than refused

# DNS constants (RFC 1035 §3.2.2, RFC 2782, RFC 6762 §18.12 for the QM question class).
_TYPE_A = 1
_TYPE_TXT = 16
_TYPE_SRV = 33
_CLASS_IN = 1
_FLAGS_QUERY = 0x0000

_REFRESH_PERCENTS = (80, 85, 90, 95)  # RFC 6762 §5.2 cache maintenance
_TICK_S = 0.25  # how often the maintenance thread looks at the peers' records
_WORKERS = 3  # resolver threads per Discovery/browse
_JOIN_S = 2.0  # bound on joining our threads at stop()
_MAX_REGISTER_ATTEMPTS = 20
_LOOP_CALL_S = 15.0  # bound on one registration (probing ~1.3 s) run on zeroconf's event loop
_PRECHECK_MS = 500  # how long start() listens for a live holder of its name before probing

OnChange = Callable[[str, "NodeInfo"], None]


class DiscoveryError(RuntimeError):
    """Registration failed: another *live* node announces this node's instance name
    (the same cluster + node id) from a different address or port."""


# --------------------------------------------------------------------------- node facts / TXT


def _instance_label(cluster: str, node_id: str) -> str:
    # Readable part: the lower-cased name with every run of other characters turned into '-'.
    # Then always an 8-hex digest of the exact (cluster, node_id) pair, so that distinct pairs
    # that sanitise alike ("lab-1"/"x" vs "lab"/"1-x", "A.b" vs "a_b") never share a name.
    digest = hashlib.sha256(f"{cluster}\x00{node_id}".encode("utf-8")).hexdigest()[:8]
    readable = re.sub(r"[^a-z0-9]+", "-", f"{cluster}-{node_id}".lower()).strip("-")
    readable = readable[: _LABEL_MAX - len(digest) - 1].rstrip("-")
    return f"{readable}-{digest}" if readable else digest


@dataclass
class NodeInfo:
    """What a node advertises about itself.

    Attributes:
        node_id: stable node id, unique within the cluster.
        cluster: cluster name; nodes only see nodes of the same cluster.
        address: IPv4 address (dotted quad) the node's gRPC ``Node`` service listens on.
        port: TCP port of that gRPC service (1..65535).
        version: node protocol version (:data:`PROTOCOL_VERSION` for this code).
        memory_bytes: physical memory of the machine, in bytes; 0 when unknown.
        platform: ``"<system>-<machine>"``, e.g. ``"Linux-x86_64"``, ``"Darwin-arm64"``.
        chip: CPU/chip name, e.g. ``"Apple M2 Max"``.
        backends: usable MLX distributed backends, e.g. ``["ring", "mpi"]``.
        model_digest: digest of the model the node serves.
        state: optional free-form state, e.g. ``"idle"`` or ``"formed"``.
        layers: ``join --layers``: the layer range this node serves as a pipeline stage
            (``"0:9"``, ``"20:output"``, ``"auto"``), ``""`` for tensor parallelism.
        role: ``join --role``: ``"prefill"`` or ``"decode"`` (prefill/decode disaggregation),
            ``""`` for an ordinary node.
        spare: ``join --spare``: the node holds the model and takes a rank only in a member's
            place (:mod:`mlxcluster.cluster.plan`).
    """

    node_id: str
    cluster: str
    address: str
    port: int
    version: int
    memory_bytes: int
    platform: str
    chip: str
    backends: List[str]
    model_digest: str
    state: str = ""
    layers: str = ""
    role: str = ""
    spare: bool = False

    @property
    def instance_name(self) -> str:
        """DNS-SD instance name (one DNS label: ``[a-z0-9-]``, <= 63 bytes, RFC 6763 §4.1.1).

        ``f"{cluster}-{node_id}"`` lower-cased, other characters replaced by ``-``, cut to fit,
        followed by ``-`` and 8 hex digits of SHA-256 of the exact pair. Deterministic: the same
        cluster and node id always give the same name. The full service name is
        ``instance_name + "." + SERVICE_TYPE`` (:attr:`service_name`).
        """
        return _instance_label(self.cluster, self.node_id)

    @property
    def service_name(self) -> str:
        """Fully qualified DNS-SD service instance name, e.g. ``lab-n1-1a2b3c4d._mlxcluster._tcp.local.``."""
        return f"{self.instance_name}.{SERVICE_TYPE}"

    def copy(self) -> "NodeInfo":
        """A copy that shares no mutable state (``backends`` is copied)."""
        return dataclasses.replace(self, backends=list(self.backends))


def _fit(key: str, value: str) -> str:
    budget = _TXT_MAX - len(key.encode()) - 1
    raw = value.encode("utf-8")
    if len(raw) <= budget:
        return value
    if key not in _TRUNCATABLE_KEYS:
        raise ValueError(f"TXT value of {key!r} is {len(raw)} bytes; at most {budget} fit in a TXT string")
    return raw[:budget].decode("utf-8", "ignore")


def encode_txt(info: NodeInfo) -> Dict[str, str]:
    """TXT record properties of ``info`` (RFC 6763 §6: short keys, each ``key=value`` <= 255 bytes).

    Keys: ``v`` protocol version, ``c`` cluster, ``id`` node id, ``mem`` memory bytes, ``plat``
    platform, ``chip``, ``be`` comma-separated backends, ``md`` model digest,
    ``st`` state, ``ly`` pipeline layer range, ``ro`` role (each omitted when empty) and ``sp``
    ``1`` for a spare (omitted otherwise). The node's address and port travel in the A and SRV
    records, not here. Nothing secret or secret-derived goes here: TXT records are readable
    (and replayable) by anyone on the link; peers prove themselves over mutual TLS
    (:mod:`mlxcluster.security`).

    Raises:
        ValueError: empty cluster or node id, a backend name that is empty or contains ``,``, or a
            value that does not fit in 255 bytes (``plat`` and ``chip`` are cut to fit instead).
    """
    if not info.cluster or not info.node_id:
        raise ValueError("cluster and node_id must be non-empty")
    for name in info.backends:
        if not name or "," in name:
            raise ValueError(f"invalid backend name {name!r}")
    txt = {
        "v": str(int(info.version)),
        "c": info.cluster,
        "id": info.node_id,
        "mem": str(int(info.memory_bytes)),
        "plat": info.platform or "",
        "chip": info.chip or "",
        "be": ",".join(info.backends),
        "md": info.model_digest or "",
    }
    if info.state:
        txt["st"] = info.state
    if info.layers:
        txt["ly"] = info.layers
    if info.role:
        txt["ro"] = info.role
    if info.spare:
        txt["sp"] = "1"
    return {key: _fit(key, value) for key, value in txt.items()}


def _txt_str(props: Mapping[str, Optional[bytes]], key: str, required: bool) -> str:
    if key not in props or props[key] is None:
        if required:
            raise ValueError(f"TXT record lacks required key {key!r}")
        return ""
    try:
        return props[key].decode("utf-8")  # type: ignore[union-attr]
    except UnicodeDecodeError as exc:
        raise ValueError(f"TXT value of {key!r} is not UTF-8") from exc


def _txt_int(props: Mapping[str, Optional[bytes]], key: str) -> int:
    text = _txt_str(props, key, True)
    if not re.fullmatch(r"[0-9]{1,20}", text):
        raise ValueError(f"TXT value of {key!r} is not a non-negative integer: {text!r}")
    return int(text)


def _txt_memory(props: Mapping[str, Optional[bytes]]) -> int:
    """``mem`` in bytes; 0 (unknown) when negative or above :data:`MAX_MEMORY_BYTES`.

    Raises:
        ValueError: missing, or not an integer.
    """
    text = _txt_str(props, "mem", True)
    if not re.fullmatch(r"-?[0-9]{1,40}", text):
        raise ValueError(f"TXT value of 'mem' is not an integer: {text[:40]!r}")
    value = int(text)
    if not 0 <= value <= MAX_MEMORY_BYTES:
        log.debug("TXT mem %s outside 0..%d bytes: read as unknown", text[:40], MAX_MEMORY_BYTES)
        return 0
    return value


def _txt_spare(props: Mapping[str, Optional[bytes]]) -> bool:
    """``sp``: ``True`` only for ``1`` (what :func:`encode_txt` writes); absent, empty or any other
    value (TXT records are unauthenticated) reads as not a spare -- no error, so a garbled ``sp``
    never hides the node."""
    value = props.get("sp")
    if value is not None and value != b"1":
        log.debug("TXT sp %r is not 1: read as not a spare", value[:40])
    return value == b"1"


def decode_txt(properties: Mapping[Union[bytes, str], Optional[Union[bytes, str]]], address: str,
               port: int) -> NodeInfo:
    """Parse TXT ``properties`` (as :attr:`zeroconf.ServiceInfo.properties` gives them: bytes keys,
    bytes or None values; str is accepted too) into a :class:`NodeInfo` with the given ``address``
    (IPv4, from the A record) and ``port`` (from the SRV record).

    Keys are matched case-insensitively (RFC 6763 §6.4); unknown keys are ignored.

    Raises:
        ValueError: a required key (``v``, ``c``, ``id``, ``mem``) missing or without a value,
            a non-integer ``v``/``mem``, an empty cluster or node id, non-UTF-8 text,
            an invalid IPv4 address or a port outside 1..65535.  (A negative ``mem`` or one
            above :data:`MAX_MEMORY_BYTES` is no error: ``memory_bytes`` is 0, unknown; an ``sp``
            other than ``1`` is no error either: not a spare.)
    """
    props: Dict[str, Optional[bytes]] = {}
    for key, value in properties.items():
        try:
            k = key.decode("ascii") if isinstance(key, bytes) else str(key)
        except UnicodeDecodeError:
            continue  # a key we never write
        if isinstance(value, str):
            value = value.encode("utf-8")
        props.setdefault(k.lower(), value)
    try:
        ipaddress.IPv4Address(address)
    except ValueError as exc:
        raise ValueError(f"invalid IPv4 address {address!r}") from exc
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"invalid port {port!r}")
    cluster = _txt_str(props, "c", True)
    node_id = _txt_str(props, "id", True)
    if not cluster or not node_id:
        raise ValueError("TXT record has an empty cluster or node id")
    backends = _txt_str(props, "be", False)
    return NodeInfo(
        node_id=node_id,
        cluster=cluster,
        address=address,
        port=port,
        version=_txt_int(props, "v"),
        memory_bytes=_txt_memory(props),
        platform=_txt_str(props, "plat", False),
        chip=_txt_str(props, "chip", False),
        backends=[b for b in backends.split(",") if b],
        model_digest=_txt_str(props, "md", False),
        state=_txt_str(props, "st", False),
        layers=_txt_str(props, "ly", False),
        role=_txt_str(props, "ro", False),
        spare=_txt_spare(props),
    )


# --------------------------------------------------------------------------- local facts / interfaces


def _run_text(cmd: List[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=2.0, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def local_node_facts() -> Dict[str, object]:
    """Facts about this machine for :class:`NodeInfo`.

    Returns:
        ``{"memory_bytes": int, "platform": str, "chip": str}``: physical memory in bytes
        (``sysctl -n hw.memsize`` on macOS, else ``SC_PAGE_SIZE * SC_PHYS_PAGES``; 0 if unknown),
        ``"<system>-<machine>"`` (e.g. ``"Linux-x86_64"``), and the CPU/chip name
        (``sysctl -n machdep.cpu.brand_string`` on macOS, ``model name`` / ``Hardware`` /
        ``Model`` from ``/proc/cpuinfo`` on Linux, else :func:`platform.processor` or the machine).
    """
    system, machine = _platform.system(), _platform.machine()
    memory = 0
    chip = ""
    if sys.platform == "darwin":
        text = _run_text(["sysctl", "-n", "hw.memsize"])
        memory = int(text) if text.isdigit() else 0
        chip = _run_text(["sysctl", "-n", "machdep.cpu.brand_string"])
    if not memory:
        try:
            memory = int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
        except (AttributeError, ValueError, OSError):
            memory = 0
    if not chip:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
                fields: Dict[str, str] = {}
                for line in fh:
                    key, sep, value = line.partition(":")
                    if sep and key.strip() not in fields and value.strip():
                        fields[key.strip()] = value.strip()
            chip = fields.get("model name") or fields.get("Hardware") or fields.get("Model") or ""
        except OSError:
            pass
    chip = chip or _platform.processor() or machine
    return {"memory_bytes": max(0, memory), "platform": f"{system}-{machine}", "chip": chip}


def _local_ipv4() -> List[Tuple[str, str]]:
    """(adapter name, IPv4) of every local interface address."""
    out = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if ip.is_IPv4:
                out.append((str(adapter.name), str(ip.ip)))
    return out


def interface_of(address: str) -> str:
    """Name of the local interface that holds IPv4 ``address`` (``""``: none does): the one a node's
    data plane, and so its collectives, use."""
    try:
        return next((name for name, ip in _local_ipv4() if ip == address), "")
    except Exception:  # ifaddr on an odd platform: the interface is for display only
        return ""


#: Interface kinds, best first, for the control plane and mDNS: exo's coordinator order
#: (``src/exo/master/placement_utils.py: _JACCL_TRANSPORT_PRIORITY``: ethernet > wifi > unknown >
#: thunderbolt > vpn; exo #1203, PR #2063), with virtual bridges, link-local and loopback after.
#: A Thunderbolt direct link carries the data plane and reaches one peer only, so it ranks low.
INTERFACE_KINDS = ("ethernet", "wifi", "other", "thunderbolt", "virtual", "vpn", "link-local", "loopback")
_VPN = ("utun", "tun", "tap", "wg", "ppp", "ipsec", "tailscale", "zt", "gif", "stf")
_VIRTUAL = ("docker", "veth", "br-", "virbr", "cni", "flannel", "vmnet", "vboxnet", "awdl", "llw", "anpi", "ap",
            "bridge", "vnic")


class RankedInterface(NamedTuple):
    """One ranked interface: its name, IPv4 address, kind (:data:`INTERFACE_KINDS`) and why."""

    interface: str
    address: str
    kind: str
    why: str


def interface_kind(name: str, address: str, hardware_port: str = "", wireless: bool = False) -> Tuple[str, str]:
    """``(kind, why)`` of one interface address.

    The address first (127/8 loopback; 169.254/16 link-local: no DHCP answered, a cable's self-assigned
    address), then macOS's hardware port name (``networksetup -listallhardwareports``, as exo's
    ``_parse_networksetup_interface_types``: ``Wi-Fi``; ``Ethernet``/``LAN`` in the name, which also
    covers "Thunderbolt Ethernet Slot 1" adapters; ``Thunderbolt 1``/``Thunderbolt Bridge``), else the
    name (Linux: ``wl*`` or ``wireless`` Wi-Fi, ``eth*``/``en*`` Ethernet, ``tun*``/``wg*``/``utun*``
    VPN, ``docker*``/``veth*``/``br-*`` virtual).  A name it does not know is ``other``.
    """
    ip = ipaddress.IPv4Address(address)
    if ip.is_loopback or name.startswith("lo"):
        return "loopback", "loopback"
    if ip.is_link_local:
        return "link-local", "link-local address (169.254/16): no DHCP lease"
    if hardware_port:
        port = hardware_port.lower()
        if "wi-fi" in port or "airport" in port:
            return "wifi", f"hardware port {hardware_port!r}"
        if "ethernet" in port or "lan" in port.split():
            return "ethernet", f"hardware port {hardware_port!r}"
        if port.startswith("thunderbolt"):
            return "thunderbolt", f"hardware port {hardware_port!r}: a direct link (data plane)"
        return "other", f"hardware port {hardware_port!r}"
    if name.startswith(_VPN):
        return "vpn", "VPN / tunnel interface"
    if wireless or name.startswith("wl"):
        return "wifi", "wireless interface"
    if name.startswith(_VIRTUAL):
        return "virtual", "virtual bridge or container interface"
    if name.startswith(("eth", "en")):
        return "ethernet", "Ethernet-named interface"
    return "other", "interface of unknown type"


def rank_interfaces(addresses: Iterable[Tuple[str, str]], hardware_ports: Optional[Mapping[str, str]] = None,
                    wireless: Iterable[str] = ()) -> List[RankedInterface]:
    """The interfaces' IPv4 addresses, best LAN interface first, for the control plane and mDNS.

    Args:
        addresses: ``(interface, IPv4)`` pairs (:func:`_local_ipv4`, or a recorded ``ifconfig``).
        hardware_ports: interface -> macOS hardware port name (``{"en0": "Ethernet", "en2":
            "Thunderbolt 1"}``), ``None``/empty where unknown (Linux).
        wireless: interfaces known to be Wi-Fi (Linux: ``/sys/class/net/X/wireless`` exists).
    Returns:
        one :class:`RankedInterface` per address, ordered by :data:`INTERFACE_KINDS` (ties: the order given).
    Raises:
        ValueError: an address that is not IPv4.
    """
    ports, wifi = dict(hardware_ports or {}), set(wireless)
    out = [RankedInterface(name, ip, *interface_kind(name, ip, ports.get(name, ""), name in wifi))
           for name, ip in addresses]
    return sorted(out, key=lambda c: INTERFACE_KINDS.index(c.kind))


def _hardware_port_names() -> Dict[str, str]:
    """Interface -> hardware port name on macOS (``networksetup -listallhardwareports``), else ``{}``."""
    if sys.platform != "darwin":
        return {}
    from ..runtime.thunderbolt import parse_hardware_ports

    return {dev: port for port, dev in parse_hardware_ports(_run_text(["networksetup", "-listallhardwareports"])).items()}


def primary_address() -> str:
    """This machine's best LAN IPv4 address (:func:`rank_interfaces`: Ethernet, then Wi-Fi, ...; a
    Thunderbolt direct link, a VPN, link-local or loopback only when nothing better has one), else
    ``"127.0.0.1"``: a node's address when ``--interface`` does not name one."""
    try:
        local = _local_ipv4()
    except OSError:
        local = []
    wireless = [name for name, _ in local if os.path.exists(f"/sys/class/net/{name}/wireless")]
    ranked = rank_interfaces(local, _hardware_port_names(), wireless)
    if ranked:
        log.debug("address %s on %s (%s)", ranked[0].address, ranked[0].interface, ranked[0].why)
    return ranked[0].address if ranked else "127.0.0.1"


def parse_ifconfig_ipv4(text: str) -> List[Tuple[str, str]]:
    """``(interface, IPv4)`` of each ``inet`` line of macOS's ``ifconfig`` (``en0: flags=...`` headers,
    tab-indented ``inet 192.168.1.20 netmask 0xffffff00 broadcast ...`` lines), in order."""
    out, name = [], ""
    for line in text.splitlines():
        head = re.match(r"^([A-Za-z0-9_.-]+): flags=", line)
        if head:
            name = head.group(1)
            continue
        m = re.match(r"^\s+inet (\d+\.\d+\.\d+\.\d+)\s", line + " ")
        if m and name:
            out.append((name, m.group(1)))
    return out


def resolve_interfaces(specs: Optional[Iterable[str]]) -> List[str]:
    """IPv4 addresses to run mDNS on, from interface names and/or IPv4 addresses.

    Each spec is an interface name (``lo``, ``en0``, ``veth0``) -> all of its IPv4 addresses, or
    an IPv4 address that must belong to a local interface. A spec may hold several entries
    separated by commas. Interfaces come from :func:`ifaddr.get_adapters`.

    Returns:
        the addresses, de-duplicated, in the order given; ``[]`` for empty/None ``specs``,
        which callers take as "all interfaces".

    Raises:
        ValueError: (one-line message) an unknown interface name, an interface without an IPv4
            address, or an address no local interface has.
    """
    if not specs:
        return []
    local = _local_ipv4()
    names = sorted({name for name, _ in local} | {str(a.name) for a in ifaddr.get_adapters()})
    out: List[str] = []
    for spec in specs:
        for item in str(spec).split(","):
            item = item.strip()
            if not item:
                continue
            try:
                addr = str(ipaddress.IPv4Address(item))
            except ValueError:
                addr = ""
            if addr:
                if addr not in {ip for _, ip in local}:
                    raise ValueError(f"address {addr} is not assigned to any local interface "
                                     f"(local IPv4: {', '.join(ip for _, ip in local) or 'none'})")
                found = [addr]
            else:
                if item not in names:
                    raise ValueError(f"unknown network interface {item!r} (known: {', '.join(names) or 'none'})")
                found = [ip for name, ip in local if name == item]
                if not found:
                    raise ValueError(f"network interface {item!r} has no IPv4 address")
            for ip in found:
                if ip not in out:
                    out.append(ip)
    return out


# --------------------------------------------------------------------------- peer table


def _current(zc: Zeroconf, name: str, type_: int, now: float):
    """The record of ``name``/``type_`` the owner currently announces, from the zeroconf cache.

    Records with TTL 1 are dying: a goodbye (RFC 6762 §10.1) or a cache-flush by newer data
    (§10.2) left them for one more second. They are used only when nothing else is cached;
    among the rest the most recently received wins (zeroconf's own ``get_by_details`` goes by
    insertion order instead, which can pick a flushed record of a previous owner).
    """
    try:
        records = zc.cache.get_all_by_details(name, type_, _CLASS_IN)
    except RuntimeError:  # the event loop changed the cache under us; callers retry
        return None
    live = [r for r in records if not r.is_expired(now)]
    steady = [r for r in live if r.ttl > 1] or live
    return max(steady, key=lambda r: r.created) if steady else None


def _fresh_srv(zc: Zeroconf, name: str, now: float):
    """Current unexpired SRV record of ``name`` in the zeroconf cache, or None."""
    return _current(zc, name, _TYPE_SRV, now)


def _parse_txt_rdata(text: bytes) -> Dict[bytes, Optional[bytes]]:
    """TXT rdata (length-prefixed strings, RFC 6763 §6) -> {key: value or None}; first key wins."""
    out: Dict[bytes, Optional[bytes]] = {}
    i = 0
    while i < len(text):
        n = text[i]
        item = text[i + 1:i + 1 + n]
        i += 1 + n
        key, sep, value = item.partition(b"=")
        if key and key.lower() not in out:
            out[key.lower()] = value if sep else None
    return out


def _read_cached_node(zc: Zeroconf, name: str, now: float) -> Tuple[Optional[Tuple], Optional[Tuple[Dict, str, int]]]:
    """(signature, (txt properties, address, port)) of ``name`` from the current SRV, TXT and A
    records in the cache; (None, None) while any of them is missing."""
    srv = _current(zc, name, _TYPE_SRV, now)
    txt = _current(zc, name, _TYPE_TXT, now)
    if srv is None or txt is None:
        return None, None
    a = _current(zc, srv.server, _TYPE_A, now)
    if a is None:
        return None, None
    address = socket.inet_ntoa(a.address)
    signature = (txt.text, srv.port, srv.server, address)
    return signature, (_parse_txt_rdata(txt.text), address, srv.port)


_REJECTED = object()  # _Watcher._resolve: resolved, but not a node to report


class _Watcher:
    """Browses SERVICE_TYPE on ``zc`` and keeps resolved NodeInfo of one cluster.

    The zeroconf browser thread only queues names; a few worker threads resolve them
    (``ServiceInfo.request`` with a timeout) and fire ``on_change``, one event at a time per name
    and in order. A maintenance thread sends RFC 6762 §5.2 refresh queries for known peers and
    reports a peer "removed" once its SRV record expires.
    """

    def __init__(self, zc: Zeroconf, cluster: str, own_name: Optional[str],
                 on_change: Optional[OnChange], on_own_conflict: Optional[Callable[[str], None]] = None,
                 own_signature: Optional[Callable[[], Optional[Tuple]]] = None,
                 resolve_timeout_s: float = RESOLVE_TIMEOUT_S, maintain: bool = True) -> None:
        self._zc = zc
        self._cluster = cluster
        self._own_name = own_name
        self._own_key = own_name.lower() if own_name else None
        self._on_change = on_change
        self._on_own_conflict = on_own_conflict
        self._own_signature = own_signature
        self._resolve_ms = int(resolve_timeout_s * 1000)
        self._cond = threading.Condition()
        self._cb_lock = threading.Lock()
        self._closed = False
        self._pending: Dict[str, Tuple[str, str]] = {}  # key -> (kind, name); kind: resolve|remove|expire
        self._busy: set = set()
        self._seen: Dict[str, str] = {}  # key -> name: instances the browser reports present
        self._nodes: Dict[str, NodeInfo] = {}  # key -> reported peer
        self._queried: Dict[str, float] = {}  # key -> when we last sent a refresh query (ms)
        self._sig: Dict[str, Optional[Tuple]] = {}  # key -> cache signature at the last resolution
        self._threads = [threading.Thread(target=self._work, name=f"mlxcluster-discovery-{i}", daemon=True)
                         for i in range(_WORKERS)]
        if maintain:
            self._threads.append(threading.Thread(target=self._maintain, name="mlxcluster-discovery-ttl", daemon=True))
        self._browser: Optional[ServiceBrowser] = None

    # lifecycle
    def start(self) -> None:
        for thread in self._threads:
            thread.start()
        # QM questions only (multicast answers): a QU question's unicast answer goes to whichever
        # socket on the querier's host is bound to port 5353 (several zeroconf instances,
        # mDNSResponder on macOS) and is often lost to us (RFC 6762 §5.4, §15.1).
        self._browser = ServiceBrowser(self._zc, SERVICE_TYPE, handlers=[self._on_browser_event],
                                       question_type=DNSQuestionType.QM)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._browser is not None:
            try:
                self._browser.cancel()
            except Exception:  # already cancelled / zeroconf closing
                log.debug("browser cancel failed", exc_info=True)
        deadline = time.monotonic() + _JOIN_S
        for thread in self._threads:
            if thread is not threading.current_thread() and thread.ident is not None:
                thread.join(max(0.0, deadline - time.monotonic()))

    # queries
    def peers(self) -> Dict[str, NodeInfo]:
        with self._cond:
            return {info.node_id: info.copy() for info in self._nodes.values()}

    def wait_idle(self, timeout_s: float) -> None:
        """Wait (bounded) until no resolution is pending or running."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (self._pending or self._busy) and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(min(left, 0.1))

    # zeroconf browser thread: queue only
    def _on_browser_event(self, zeroconf: Zeroconf, service_type: str, name: str,
                          state_change: ServiceStateChange) -> None:
        key = name.lower()
        with self._cond:
            if self._closed:
                return
            if state_change is ServiceStateChange.Removed:
                self._seen.pop(key, None)
                self._pending[key] = ("remove", name)
            else:
                self._seen[key] = name
                self._pending[key] = ("resolve", name)
            self._cond.notify_all()

    # worker threads
    def _work(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                key = next((k for k in self._pending if k not in self._busy), None)
                if key is None:
                    self._cond.wait(0.5)
                    continue
                kind, name = self._pending.pop(key)
                self._busy.add(key)
            try:
                self._handle(key, kind, name)
            except Exception:
                log.exception("discovery: handling %s of %s failed", kind, name)
            finally:
                with self._cond:
                    self._busy.discard(key)
                    self._cond.notify_all()

    def _emit(self, event: str, info: NodeInfo) -> None:
        if self._on_change is None:
            return
        with self._cb_lock:
            if self._closed:
                return
            try:
                self._on_change(event, info.copy())
            except Exception:
                log.exception("discovery: on_change(%r, %s) raised", event, info.node_id)

    def _drop(self, key: str, why: str) -> None:
        with self._cond:
            info = self._nodes.pop(key, None)
            self._queried.pop(key, None)
        if info is not None:
            log.debug("discovery: node %s removed (%s)", info.node_id, why)
            self._emit("removed", info)

    def _handle(self, key: str, kind: str, name: str) -> None:
        if key == self._own_key:
            if kind == "remove" and self._on_own_conflict is not None:
                self._on_own_conflict("a goodbye for this node's name")
            return
        if kind == "remove":
            with self._cond:
                self._sig.pop(key, None)
            self._drop(key, "goodbye")
            return
        if kind == "expire":
            if _fresh_srv(self._zc, name, current_time_millis()) is None:
                self._drop(key, "records expired")
            return
        info = self._resolve(name)
        if info is _REJECTED:  # now of another cluster, or garbled
            self._drop(key, "no longer acceptable")
            return
        if info is None:  # not (yet) resolvable: keep what we had
            return
        with self._cond:
            if self._closed:
                return
            old = self._nodes.get(key)
            self._nodes[key] = info
            self._queried.pop(key, None)
        if old is None:
            log.debug("discovery: node %s added at %s:%d", info.node_id, info.address, info.port)
            self._emit("added", info)
        elif old != info:
            self._emit("updated", info)

    def _resolve(self, name: str):
        """NodeInfo of ``name``; None if it could not be resolved; _REJECTED if it resolved
        to something this watcher must not report (garbled TXT, other cluster)."""
        # ServiceInfo.request fills the cache (queries only for what is missing, bounded by the
        # timeout); the values are then taken from the cache's current records.
        si = ServiceInfo(SERVICE_TYPE, name)
        try:
            ok = si.request(self._zc, self._resolve_ms, question_type=DNSQuestionType.QM)
        except Exception:  # zeroconf closing, bad records
            log.debug("discovery: resolving %s failed", name, exc_info=True)
            return None
        signature, parts = _read_cached_node(self._zc, name, current_time_millis())
        with self._cond:
            self._sig[name.lower()] = signature
        if not ok or parts is None:
            log.debug("discovery: %s did not resolve within %d ms", name, self._resolve_ms)
            return None
        try:
            info = decode_txt(*parts)
        except ValueError as exc:
            log.debug("discovery: ignoring %s: %s", name, exc)
            return _REJECTED
        if info.cluster != self._cluster:
            return _REJECTED
        if info.service_name.lower() != name.lower():
            log.warning("discovery: ignoring %s: its TXT claims node %r of cluster %r, whose name differs",
                        name, info.node_id, info.cluster)
            return _REJECTED
        return info

    # maintenance thread
    def _maintain(self) -> None:
        while True:  # one pass per _TICK_S until close()
            with self._cond:
                if self._closed:
                    return
                self._cond.wait(_TICK_S)
                if self._closed:
                    return
                seen = dict(self._seen)
                nodes = set(self._nodes)
                busy = set(self._pending) | self._busy
                sigs = dict(self._sig)
                queried = dict(self._queried)
            now = current_time_millis()
            if self._own_name is not None:
                self._check_own(self._own_name, now)
            for key, name in seen.items():
                if key in busy or key == self._own_key:
                    continue
                srv = _fresh_srv(self._zc, name, now)
                if srv is None:  # gone quiet: drop it if reported; resolve again when it returns
                    with self._cond:
                        self._sig[key] = None
                    if key in nodes:
                        self._queue(key, "expire", name)
                    continue
                signature, _ = _read_cached_node(self._zc, name, now)
                if signature is not None and signature != sigs.get(key):
                    # came back after expiry, or the cache's current records changed without a
                    # browser event (e.g. a flushed record of an old owner outlived the new one)
                    self._queue(key, "resolve", name)
                    continue
                if key in nodes:
                    due = [srv.get_expiration_time(p) for p in _REFRESH_PERCENTS]
                    last = queried.get(key, 0.0)
                    if any(last < t <= now for t in due):
                        self._refresh(key, name, srv.server, now)

    def _check_own(self, name: str, now: float) -> None:
        # RFC 6762 §9: records for our unique name with other data (e.g. a late answer from an
        # old incarnation) would stick in every peer's cache; defend by announcing ours again.
        if self._own_signature is None or self._on_own_conflict is None:
            return
        expected = self._own_signature()
        if expected is None:
            return
        current, _ = _read_cached_node(self._zc, name, now)
        if current is None:
            # Our own announcements loop back to us, so this means a goodbye for our name
            # (from an old incarnation) or, with no peer querying, plain expiry: announce again.
            self._on_own_conflict("")
        elif current != expected:
            self._on_own_conflict("other data cached for this node's name")

    def _queue(self, key: str, kind: str, name: str) -> None:
        with self._cond:
            if not self._closed and key not in self._pending:
                self._pending[key] = (kind, name)
                self._cond.notify_all()

    def _refresh(self, key: str, name: str, server: str, now: float) -> None:
        with self._cond:
            self._queried[key] = now
        out = DNSOutgoing(_FLAGS_QUERY)
        out.add_question(DNSQuestion(name, _TYPE_SRV, _CLASS_IN))
        out.add_question(DNSQuestion(name, _TYPE_TXT, _CLASS_IN))
        out.add_question(DNSQuestion(server, _TYPE_A, _CLASS_IN))
        try:
            self._zc.send(out)
        except Exception:
            log.debug("discovery: refresh query for %s failed", name, exc_info=True)


# --------------------------------------------------------------------------- Discovery / browse


def _check_ipv4_list(addresses: Optional[Iterable[str]]) -> List[str]:
    out = []
    for addr in addresses or []:
        try:
            out.append(str(ipaddress.IPv4Address(addr)))
        except ValueError as exc:
            raise ValueError(f"not an IPv4 address: {addr!r} (use resolve_interfaces for names)") from exc
    return out


def _zeroconf(interfaces: List[str]) -> Zeroconf:
    return Zeroconf(interfaces=interfaces or InterfaceChoice.All, ip_version=IPVersion.V4Only)


_IMMUTABLE_FIELDS = ("node_id", "cluster")


class Discovery:
    """Announce one node and track the other nodes of its cluster over mDNS/DNS-SD.

    Args:
        info: this node (copied). ``address`` must be a concrete IPv4 address, not 0.0.0.0.
        interfaces: IPv4 addresses to run mDNS on (see :func:`resolve_interfaces`); empty = all.
        on_change: called as ``on_change(event, peer)`` with event ``"added"``, ``"updated"``
            (any advertised field changed, e.g. state, port after a restart) or ``"removed"``
            (goodbye, records expired, or no longer acceptable: other cluster).
            Called from discovery worker threads, one call at a time, in order per peer, never
            for this node itself nor after :meth:`stop`; it should return quickly (it may call
            :meth:`peers` and :meth:`update`).
        ttl_s: TTL of the announced records in seconds (default :data:`DEFAULT_TTL_S`, at least
            2); peers drop this node within about this time after it dies without a goodbye.
        conflict_wait_s: how long :meth:`start` keeps probing while another live responder
            claims this node's name from a different address/port before it gives up.

    Raises:
        ValueError: invalid ``info`` (see :func:`encode_txt`), address or port, or interfaces.
    """

    def __init__(self, info: NodeInfo, interfaces: Optional[List[str]] = None,
                 on_change: Optional[OnChange] = None, *,
                 ttl_s: int = DEFAULT_TTL_S, conflict_wait_s: float = CONFLICT_WAIT_S) -> None:
        self._interfaces = _check_ipv4_list(interfaces)
        self._on_change = on_change
        self._ttl = max(2, int(ttl_s))  # TTL 1 marks records being flushed (RFC 6762 §10.2)
        self._conflict_wait_s = max(0.0, float(conflict_wait_s))
        self._lock = threading.RLock()
        self._info = self._validated(info.copy())
        self._zc: Optional[Zeroconf] = None
        self._watcher: Optional[_Watcher] = None
        self._service: Optional[ServiceInfo] = None
        self._stopping = False
        self._last_announce = 0.0  # time.monotonic() of our last registration/announcement
        self._broadcasts: list = []  # pending announcement tasks on zeroconf's loop

    @staticmethod
    def _validated(info: NodeInfo) -> NodeInfo:
        try:
            addr = ipaddress.IPv4Address(info.address)
        except ValueError as exc:
            raise ValueError(f"node address must be IPv4, got {info.address!r}") from exc
        if addr.is_unspecified:
            raise ValueError("node address must be a concrete IPv4 address, not 0.0.0.0")
        if not isinstance(info.port, int) or not 0 < info.port < 65536:
            raise ValueError(f"invalid port {info.port!r}")
        encode_txt(info)  # raises ValueError
        return info

    @property
    def info(self) -> NodeInfo:
        """A copy of what this node currently announces."""
        with self._lock:
            return self._info.copy()

    @property
    def started(self) -> bool:
        """True between a successful :meth:`start` and :meth:`stop`."""
        with self._lock:
            return self._zc is not None

    def _service_info(self, info: NodeInfo) -> ServiceInfo:
        return ServiceInfo(
            SERVICE_TYPE,
            info.service_name,
            addresses=[socket.inet_aton(info.address)],
            port=info.port,
            properties=encode_txt(info),
            server=f"{info.instance_name}.local.",
            host_ttl=self._ttl,
            other_ttl=self._ttl,
        )

    def start(self) -> None:
        """Open mDNS on the interfaces, start browsing, and register this node.

        Takes about 2 s: browsing starts at once, then a QM query (0.5 s) and zeroconf's probes
        (RFC 6762 §8.1, ~1.2 s) check that no live responder holds this node's name; the three
        announcements (§8.3) go out in the background. If a live responder answers for the same
        name (same cluster + node id):

        * at this node's own address and port: an old incarnation of this node that has not
          gone yet; this node takes the name over (cooperating announcement with cache-flush
          records; if the old one later sends goodbyes, this node re-announces);
        * elsewhere: keeps probing for up to ``conflict_wait_s`` (it may be shutting down), then
          raises :class:`DiscoveryError`.

        A node that crashed without goodbyes does not answer probes, so restarting it, even
        within seconds, registers at once and peers see at most an "updated" event.

        Raises:
            DiscoveryError: the name is held by another live node (duplicate node id).
            RuntimeError: already started.
            OSError: the mDNS sockets could not be opened.
        """
        with self._lock:
            if self._zc is not None:
                raise RuntimeError("Discovery already started")
            self._stopping = False
            zc = _zeroconf(self._interfaces)
            info = self._info
            watcher = _Watcher(zc, info.cluster, info.service_name, self._on_change,
                               on_own_conflict=self._reannounce, own_signature=self._own_signature)
            self._watcher = watcher  # peers() agrees with on_change while registration runs
            try:
                watcher.start()
                service = self._service_info(info)
                self._register(zc, service, info)
            except BaseException:
                self._watcher = None
                watcher.close()
                zc.close()
                raise
            self._zc, self._service = zc, service

    def _register(self, zc: Zeroconf, service: ServiceInfo, info: NodeInfo) -> None:
        # zeroconf's own probes (RFC 6762 §8.1) are QU questions whose defence comes back by
        # unicast to port 5353 of this host, where any other mDNS socket (another node,
        # mDNSResponder) may receive it instead of ours. So first ask with a QM question, whose
        # answers are multicast, whether a live responder already holds the name.
        deadline = time.monotonic() + self._conflict_wait_s
        holder = "?"
        for _ in range(_MAX_REGISTER_ATTEMPTS):
            other = ServiceInfo(SERVICE_TYPE, service.name)
            if other.request(zc, _PRECHECK_MS, question_type=DNSQuestionType.QM):
                addresses = other.parsed_addresses(IPVersion.V4Only)
                holder = f"{','.join(addresses) or '?'}:{other.port}"
                if info.address in addresses and other.port == info.port:
                    log.warning("discovery: an old incarnation of node %s still answers at %s:%d; taking over its name",
                                info.node_id, info.address, info.port)
                    self._announce(zc, zc.async_register_service(service, cooperating_responders=True))
                    return
            else:
                try:
                    self._announce(zc, zc.async_register_service(service, allow_name_change=False))
                    return
                except NonUniqueNameException:
                    pass
            left = deadline - time.monotonic()
            if left <= 0:
                break
            log.info("discovery: name %s is held by a live node at %s; waiting up to %.1f s",
                     service.name, holder, left)
            time.sleep(min(0.5, left))
        raise DiscoveryError(
            f"node id {info.node_id!r} of cluster {info.cluster!r} is already announced by a live node at "
            f"{holder} (node ids must be unique within a cluster)")

    def _announce(self, zc: Zeroconf, coro) -> None:
        """Run a zeroconf register/update coroutine on its loop; return once the records are in
        the registry (after probing), leaving the three announcements (RFC 6762 §8.3, ~0.5 s)
        to run in the background. stop() cancels them so none can follow the goodbye."""
        future = asyncio.run_coroutine_threadsafe(coro, zc.loop)
        try:
            task = future.result(_LOOP_CALL_S)
        except concurrent.futures.TimeoutError as exc:
            future.cancel()
            raise DiscoveryError(f"zeroconf did not complete the registration within {_LOOP_CALL_S:.0f} s") from exc
        self._broadcasts = [t for t in self._broadcasts if not t.done()] + [task]
        self._last_announce = time.monotonic()

    def _own_signature(self) -> Optional[Tuple]:
        with self._lock:
            service, info = self._service, self._info
        if service is None:
            return None
        return (service.text, service.port, service.server, info.address)

    def _reannounce(self, reason: str) -> None:
        # Something else spoke for this node's name while it runs: a goodbye or a late answer
        # from an old incarnation. Defend the name by announcing again. Not within 1.5 s of our
        # own last announcement, which may still be on its way back to our cache.
        with self._lock:
            if self._zc is None or self._stopping or time.monotonic() - self._last_announce < 1.5:
                return
            if reason:
                log.info("discovery: %s; re-announcing", reason)
            else:
                log.debug("discovery: own records no longer cached; re-announcing")
            try:
                self._announce(self._zc, self._zc.async_update_service(self._service))
            except Exception:
                log.warning("discovery: re-announcing failed", exc_info=True)

    def peers(self) -> Dict[str, NodeInfo]:
        """Currently known nodes of the same cluster, excluding this one: ``{node_id: NodeInfo}``
        (copies; address, port and TXT resolved). Thread-safe. Empty before :meth:`start`."""
        watcher = self._watcher
        return watcher.peers() if watcher is not None else {}

    def update(self, **fields: object) -> None:
        """Change advertised fields (e.g. ``state="formed"``, ``port=...``) and, when started,
        re-announce the records (cache-flush, RFC 6762 §10.2); peers report "updated".

        Raises:
            ValueError: an unknown field, a change of ``node_id``/``cluster`` (they define the
                instance name: use a new :class:`Discovery`), or an invalid value.
        """
        known = {f.name for f in dataclasses.fields(NodeInfo)}
        for name in fields:
            if name not in known:
                raise ValueError(f"unknown NodeInfo field {name!r}")
        with self._lock:
            for name in _IMMUTABLE_FIELDS:
                if name in fields and fields[name] != getattr(self._info, name):
                    raise ValueError(f"{name} cannot change; stop and start a new Discovery")
            new = self._validated(dataclasses.replace(self._info, **fields).copy())  # type: ignore[arg-type]
            if new == self._info:
                return
            self._info = new
            if self._zc is not None and not self._stopping:
                self._service = self._service_info(new)
                self._announce(self._zc, self._zc.async_update_service(self._service))

    def stop(self) -> None:
        """Send goodbyes (RFC 6762 §10.1), stop browsing and close the sockets. Idempotent;
        :meth:`start` may be called again afterwards."""
        with self._lock:
            if self._zc is None:
                return
            self._stopping = True
            zc, watcher, service = self._zc, self._watcher, self._service
            broadcasts, self._broadcasts = self._broadcasts, []
            self._zc = self._watcher = self._service = None
        try:
            if watcher is not None:
                watcher.close()
            if broadcasts and zc.loop is not None and not zc.loop.is_closed():
                zc.loop.call_soon_threadsafe(lambda: [t.cancel() for t in broadcasts])
            if service is not None:
                try:
                    zc.unregister_service(service)
                except Exception:
                    log.debug("discovery: goodbye failed", exc_info=True)
        finally:
            zc.close()

    def __enter__(self) -> "Discovery":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Browser:
    """A client's view of one cluster: browse and resolve its nodes over mDNS, announce nothing.

    Args:
        cluster: cluster name; nodes of other clusters are never reported.
        interfaces: IPv4 addresses to run mDNS on (see :func:`resolve_interfaces`); empty = all.
        on_change: called as ``on_change(event, node)`` with ``"added"``, ``"updated"`` (an
            advertised field changed, e.g. ``state``) or ``"removed"`` (goodbye), as for
            :class:`Discovery`: from discovery worker threads, one call at a time, never after
            :meth:`close`; it should return quickly.
        resolve_timeout_s: longest a node's records are waited for, in seconds.

    Raises:
        ValueError: an interface that is not an IPv4 address.
    """

    def __init__(self, cluster: str, interfaces: Optional[List[str]] = None,
                 on_change: Optional[OnChange] = None, *,
                 resolve_timeout_s: float = RESOLVE_TIMEOUT_S) -> None:
        self._cluster = cluster
        self._interfaces = _check_ipv4_list(interfaces)
        self._on_change = on_change
        self._resolve_timeout_s = resolve_timeout_s
        self._zc: Optional[Zeroconf] = None
        self._watcher: Optional[_Watcher] = None

    def start(self) -> "Browser":
        """Open mDNS on the interfaces and start browsing (queries at about 0.1 s, 1.1 s and 4 s);
        returns ``self``.

        Raises:
            RuntimeError: already started.
            OSError: the mDNS sockets could not be opened.
        """
        if self._zc is not None:
            raise RuntimeError("Browser already started")
        zc = _zeroconf(self._interfaces)
        watcher = _Watcher(zc, self._cluster, None, self._on_change,
                           resolve_timeout_s=self._resolve_timeout_s, maintain=False)
        try:
            watcher.start()
        except BaseException:
            watcher.close()
            zc.close()
            raise
        self._zc, self._watcher = zc, watcher
        return self

    def nodes(self) -> List[NodeInfo]:
        """The nodes resolved so far (copies), sorted by node id; empty before :meth:`start`."""
        watcher = self._watcher
        return sorted(watcher.peers().values(), key=lambda i: i.node_id) if watcher is not None else []

    def wait_idle(self, timeout_s: float) -> None:
        """Wait, at most ``timeout_s`` seconds, until no node is being resolved."""
        if self._watcher is not None:
            self._watcher.wait_idle(timeout_s)

    def close(self) -> None:
        """Stop browsing and close the sockets. Idempotent."""
        zc, watcher, self._zc, self._watcher = self._zc, self._watcher, None, None
        if watcher is not None:
            watcher.close()
        if zc is not None:
            zc.close()

    def __enter__(self) -> "Browser":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def browse(cluster: str, interfaces: Optional[List[str]] = None, timeout_s: float = 3.0) -> List[NodeInfo]:
    """One-shot browse for clients: listen for ``timeout_s`` seconds (at least 0.2) and return
    the resolved nodes of ``cluster``, sorted by node id. Registers nothing. For a caller that
    can stop at the first node it wants, use :class:`Browser` with ``on_change``.

    zeroconf queries at about 0.1 s, 1.1 s and 4 s, and responders ignore a query identical to one
    they saw less than 0.8 s before (e.g. another client's), so use ``timeout_s`` >= 1.5.

    Args:
        interfaces: IPv4 addresses (see :func:`resolve_interfaces`); empty = all interfaces.

    Raises:
        ValueError: an interface that is not an IPv4 address.
        OSError: the mDNS sockets could not be opened.
    """
    timeout_s = max(0.2, float(timeout_s))
    resolve_s = min(RESOLVE_TIMEOUT_S, timeout_s)
    with Browser(cluster, interfaces, resolve_timeout_s=resolve_s) as browser:
        time.sleep(timeout_s)  # the listening window (how many nodes will answer is unknown)
        browser.wait_idle(resolve_s)
        return browser.nodes()

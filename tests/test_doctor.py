"""``mlxcluster doctor``: each check fed what the real tools print, for a healthy Mac, a healthy
Linux node and each broken case; doctor names the cause and the fix on each broken case and
finds nothing on the healthy ones.  Plus ``mlxcluster doctor`` itself on this machine.

Recorded outputs, as the tools print them: ``rdma_ctl status`` (``enabled``/``disabled``),
``ibv_devices`` (a header, then one ``rdma_enX`` row per device), ``system_profiler
SPThunderboltDataType -json`` (one bus per port: ``receptacle_1_tag`` with ``current_speed_key``
``"Up to 80 Gb/s"``, the peer Mac as the first ``_items`` entry with a ``domain_uuid_key``),
``networksetup -listallhardwareports``, ``ifconfig`` / ``ifconfig bridge0`` (``member: enX``),
``route -n get PEER``, ``sw_vers -productVersion``, ``mpirun --version``, ``ip route get PEER``,
``nft list ruleset``, ``iptables -S``."""

from __future__ import annotations

import json

import pytest

from mlxcluster.cluster.doctor import check_advertised
from mlxcluster.runtime import doctor as dr
from mlxcluster.runtime.doctor import ERROR, WARNING, NodeReport, Ran, check_across, check_node

# -- recorded outputs: macOS ------------------------------------------------------------------------

PEER = "192.168.0.2"


def uuid(mac: int, tag: int) -> str:
    return f"{mac:08X}-5CAA-4F5D-8361-{tag:012X}"


def profiler(mac: int, cables: dict, speed: str = "Up to 80 Gb/s") -> str:
    """Mac ``mac``'s ports 1 and 2; ``cables``: {tag: (peer mac, peer tag)}."""
    buses = [{"_name": "thunderbolt_bus", "device_name_key": "Mac Studio", "vendor_name_key": "Apple Inc."}]
    for tag in (1, 2):
        bus = {"_name": f"thunderboltusb4_bus_{tag - 1}", "device_name_key": "Mac Studio",
               "domain_uuid_key": uuid(mac, tag), "route_string_key": "0",
               "receptacle_1_tag": {"current_speed_key": speed if tag in cables else "Up to 80 Gb/s",
                                    "link_status_key": "0x2", "receptacle_id_key": str(tag),
                                    "receptacle_status_key": "receptacle_connected" if tag in cables
                                    else "receptacle_no_devices"},
               "switch_uid_key": f"0x05AC{mac:04X}{tag:08X}", "vendor_name_key": "Apple Inc."}
        if tag in cables:
            pm, pt = cables[tag]
            bus["_items"] = [{"_name": "Mac Studio", "device_name_key": "Mac16,9", "domain_uuid_key": uuid(pm, pt),
                              "mode_key": "usb_four", "route_string_key": "1", "vendor_name_key": "Apple Inc."}]
        buses.append(bus)
    return json.dumps({"SPThunderboltDataType": buses}, indent=2, separators=(",", " : "))


NETWORKSETUP = """
Hardware Port: Ethernet
Device: en0
Ethernet Address: 36:a1:c3:00:00:00

Hardware Port: Wi-Fi
Device: en1
Ethernet Address: 36:a1:c3:00:00:01

Hardware Port: Thunderbolt 1
Device: en2
Ethernet Address: 36:a1:c3:00:00:02

Hardware Port: Thunderbolt 2
Device: en3
Ethernet Address: 36:a1:c3:00:00:03

Hardware Port: Thunderbolt Bridge
Device: bridge0
Ethernet Address: 36:a1:c3:00:00:04

VLAN Configurations
===================
"""

IBV_DEVICES = """    device          	   node GUID
    ------          	----------------
    rdma_en2        	0000000000000000
    rdma_en3        	0000000000000000
"""
IBV_NONE = """    device          	   node GUID
    ------          	----------------
"""


def bridge0(up: bool, members=("en2", "en3")) -> str:
    flags = "8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST>" if up else "8822<BROADCAST,SMART,SIMPLEX,MULTICAST>"
    text = (f"bridge0: flags={flags} mtu 1500\n\toptions=63<RXCSUM,TXCSUM,TSO4,TSO6>\n\tether 36:a1:c3:00:00:04\n"
            "\tConfiguration:\n\t\tid 0:0:0:0:0:0 priority 0 hellotime 0 fwddelay 0\n"
            "\t\tmaxage 0 holdcnt 0 proto stp maxaddr 100 timeout 1200\n"
            "\t\troot id 0:0:0:0:0:0 priority 0 ifcost 0 port 0\n\t\tipfilter disabled flags 0x0\n")
    for k, m in enumerate(members):
        text += f"\tmember: {m} flags=3<LEARNING,DISCOVER>\n\t        ifmaxaddr 0 port {9 + k} priority 0 path cost 0\n"
    return text + "\tnd6 options=201<PERFORMNUD,DAD>\n\tmedia: <unknown type>\n\tstatus: inactive\n"


def ifconfig(mtu_en2: int = 1500, mtu_en3: int = 1500) -> str:
    return ("lo0: flags=8049<UP,LOOPBACK,RUNNING,MULTICAST> mtu 16384\n\toptions=1203<RXCSUM,TXCSUM,TXSTATUS,SW_TIMESTAMP>\n"
            "\tinet 127.0.0.1 netmask 0xff000000\n"
            "en0: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500\n\tether 36:a1:c3:00:00:00\n"
            "\tinet 192.168.1.20 netmask 0xffffff00 broadcast 192.168.1.255\n\tstatus: active\n"
            f"en2: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu {mtu_en2}\n\tether 36:a1:c3:00:00:02\n"
            "\tinet 192.168.0.1 netmask 0xfffffffc broadcast 192.168.0.3\n\tstatus: active\n"
            f"en3: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu {mtu_en3}\n\tether 36:a1:c3:00:00:03\n"
            "\tstatus: inactive\n")


def route_get(peer: str, iface: str, gateway: str = "") -> str:
    return (f"   route to: {peer}\ndestination: {peer}\n" + (f"    gateway: {gateway}\n" if gateway else "") +
            f"  interface: {iface}\n      flags: <UP,HOST,DONE,LLINFO,WASCLONED,IFSCOPE,IFREF>\n"
            " recvpipe  sendpipe  ssthresh  rtt,msec    rttvar  hopcount      mtu     expire\n"
            "       0         0         0         0         0         0      1500      1195 \n")


def mac(name: str = "mac0", index: int = 0, cables=None, peers=(PEER,), **over) -> NodeReport:
    """A healthy Mac Studio on macOS 26.2 with RDMA on, cabled on Thunderbolt 1 (en2) to mac1's port 1;
    ``over`` replaces a command's output (``None``: the tool is not installed)."""
    cables = {1: (1 - index, 1)} if cables is None else cables
    outputs = {"sw_vers -productVersion": Ran("26.2\n"), "rdma_ctl status": Ran("enabled\n"),
               "ibv_devices": Ran(IBV_DEVICES), "system_profiler SPThunderboltDataType -json": Ran(profiler(index, cables)),
               "networksetup -listallhardwareports": Ran(NETWORKSETUP), "ifconfig bridge0": Ran(bridge0(False)),
               "ifconfig": Ran(ifconfig())}
    outputs.update({f"route -n get {p}": Ran(route_get(p, "en2")) for p in peers})
    mlx = over.pop("mlx_version", "0.32.4")
    outputs.update(over)
    return NodeReport(name=name, system="Darwin", outputs=outputs, mlx_version=mlx, peers=list(peers))


# -- recorded outputs: Linux ------------------------------------------------------------------------

LPEER = "10.0.0.2"
MPIRUN = "mpirun (Open MPI) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/\n"
MPICH = ("HYDRA build details:\n    Version:                                 4.0.2\n"
         "    Release Date:                            Thu Apr  7 12:34:45 CDT 2022\n")
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"

NFT_OPEN = """table inet filter {
	chain input {
		type filter hook input priority filter; policy accept;
	}

	chain forward {
		type filter hook forward priority filter; policy accept;
	}

	chain output {
		type filter hook output priority filter; policy accept;
	}
}
"""
NFT_SSH_ONLY = """table inet filter {
	chain input {
		type filter hook input priority filter; policy drop;
		ct state established,related accept
		ct state invalid drop
		iif "lo" accept
		tcp dport 22 accept
		meta l4proto icmp accept
	}

	chain forward {
		type filter hook forward priority filter; policy drop;
	}

	chain output {
		type filter hook output priority filter; policy accept;
	}
}
"""
NFT_CLUSTER = NFT_SSH_ONLY.replace("\t\ttcp dport 22 accept\n", "\t\ttcp dport 22 accept\n\t\tjump cluster\n").replace(
    "\tchain forward {", "\tchain cluster {\n\t\ttcp dport 10000-32767 counter packets 0 bytes 0 accept\n"
    "\t\tip daddr 224.0.0.251 udp dport 5353 accept\n\t\tip saddr 10.0.0.0/24 accept\n\t}\n\n\tchain forward {", 1)

IPTABLES_SSH_ONLY = """-P INPUT DROP
-P FORWARD DROP
-P OUTPUT ACCEPT
-A INPUT -i lo -j ACCEPT
-A INPUT -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A INPUT -p tcp -m tcp --dport 22 -j ACCEPT
"""
IPTABLES_REJECT_ALL = """-P INPUT ACCEPT
-P FORWARD ACCEPT
-P OUTPUT ACCEPT
-A INPUT -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A INPUT -p tcp -m tcp --dport 22 -j ACCEPT
-A INPUT -m comment --comment "deny the rest" -j REJECT --reject-with icmp-port-unreachable
"""
IPTABLES_UFW_OPEN = """-P INPUT DROP
-P FORWARD DROP
-P OUTPUT ACCEPT
-N ufw-before-input
-N ufw-user-input
-A INPUT -j ufw-before-input
-A INPUT -j ufw-user-input
-A ufw-before-input -i lo -j ACCEPT
-A ufw-before-input -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A ufw-before-input -m conntrack --ctstate INVALID -j DROP
-A ufw-before-input -d 224.0.0.251/32 -p udp -m udp --dport 5353 -j ACCEPT
-A ufw-user-input -p tcp -m tcp --dport 22 -j ACCEPT
-A ufw-user-input -s 10.0.0.0/24 -j ACCEPT
-A ufw-user-input -p tcp -m multiport --dports 10000:32767 -j ACCEPT
"""


def ip_route(peer: str, dev: str = "eth0", via: str = "") -> str:
    return f"{peer} " + (f"via {via} " if via else "") + f"dev {dev} src 10.0.0.1 uid 1000 \n    cache \n"


def linux(name: str = "box0", peers=(LPEER,), **over) -> NodeReport:
    """A healthy Linux node: OpenMPI 4.1.4, OpenBLAS, nftables without a firewall, the peer on eth0."""
    outputs = {"mpirun --version": Ran(MPIRUN), "which orted": Ran("/usr/bin/orted\n"),
               "nft list ruleset": Ran(NFT_OPEN), "iptables -S": Ran("-P INPUT ACCEPT\n-P FORWARD ACCEPT\n-P OUTPUT ACCEPT\n")}
    outputs.update({f"ip route get {p}": Ran(ip_route(p)) for p in peers})
    fields = dict(mlx_version="0.32.4", blas=OPENBLAS, blas_setting="", numpy_blas="scipy-openblas")
    for key in list(over):
        if key in fields:
            fields[key] = over.pop(key)
    outputs.update(over)
    return NodeReport(name=name, system="Linux", outputs=outputs, peers=list(peers), ports=(10000, 32767), **fields)


def problems(findings):
    return [f for f in findings if f.severity in (ERROR, WARNING)]


def only(findings, check, severity=ERROR):
    """The one problem of ``findings``, of ``check`` and ``severity``."""
    found = problems(findings)
    assert len(found) >= 1 and all(f.check == check for f in found), found
    assert all(f.severity == severity for f in found), found
    return found


# -- healthy ----------------------------------------------------------------------------------------


def test_healthy_mac_finds_nothing():
    assert problems(check_node(mac())) == []
    assert problems(check_across([mac("mac0", 0), mac("mac1", 1)])) == []


def test_healthy_linux_finds_nothing():
    assert problems(check_node(linux())) == []
    assert problems(check_node(linux(**{"iptables -S": Ran(IPTABLES_UFW_OPEN), "nft list ruleset": Ran(NFT_CLUSTER)}))) == []
    assert problems(check_node(linux(**{"nft list ruleset": None, "iptables -S": None}))) == []  # no firewall tools
    assert problems(check_across([linux("a"), linux("b")])) == []


def test_single_node_skips_the_collective_with_a_note():
    notes = [f for f in check_node(linux(peers=())) if f.check == "collective"]
    assert len(notes) == 1 and notes[0].severity == "note" and "no peers" in notes[0].what
    measured = dr.check_collective(dr.CollectiveResult("jaccl", 2, 45.0, 6.1), peers=1)
    assert measured[0].severity == "note" and "45 us" in measured[0].what and "6.10 GB/s" in measured[0].what
    slow = dr.check_collective(dr.CollectiveResult("ring", 2, 4000.0, 0.01), peers=1)
    assert slow[0].severity == WARNING and "slow" in slow[0].what


# -- macOS broken cases ------------------------------------------------------------------------------


def test_rdma_disabled():
    found = only(check_node(mac(**{"rdma_ctl status": Ran("disabled\n"), "ibv_devices": Ran(IBV_NONE)})), "rdma")
    assert "disabled" in found[0].what and "rdma_ctl enable" in found[0].fix_command
    assert "Recovery" in found[0].fix_command


def test_no_ibv_devices():
    found = only(check_node(mac(**{"ibv_devices": Ran(IBV_NONE)})), "rdma")
    assert found[0].what.startswith("ibv_devices lists no RDMA devices") and "Thunderbolt 5" in found[0].detail
    # a cabled port without its rdma_<iface> device
    one = IBV_DEVICES.replace("    rdma_en2        \t0000000000000000\n", "")
    found = only(check_node(mac(**{"ibv_devices": Ran(one)})), "rdma")
    assert "rdma_en2" in found[0].what and "en2" in found[0].fix_command
    # no RDMA tools at all (macOS before 26.2)
    old = check_node(mac(**{"rdma_ctl status": None, "ibv_devices": None, "sw_vers -productVersion": Ran("15.6.1\n")}))
    assert {f.check for f in problems(old)} == {"rdma", "macos"}
    assert any("26.2" in f.what for f in old if f.check == "macos")


def test_thunderbolt_4_link():
    rec = mac(**{"system_profiler SPThunderboltDataType -json": Ran(profiler(0, {1: (1, 1)}, "Up to 40 Gb/s"))})
    found = only(check_node(rec), "thunderbolt-speed")
    assert "Thunderbolt 1 (en2)" in found[0].what and "40 Gb/s" in found[0].what and "Thunderbolt 5" in found[0].what
    assert "Thunderbolt 5 cable" in found[0].fix_command
    # 120 Gb/s (Bandwidth Boost) is Thunderbolt 5 too
    fast = mac(**{"system_profiler SPThunderboltDataType -json": Ran(profiler(0, {1: (1, 1)}, "Up to 120 Gb/s"))})
    assert problems(check_node(fast)) == []


def test_thunderbolt_port_in_bridge0():
    found = only(check_node(mac(**{"ifconfig bridge0": Ran(bridge0(True))})), "bridge")
    assert [f.fix_command.split(" && ")[0] for f in found] == ["sudo ifconfig bridge0 deletem en2",
                                                               "sudo ifconfig bridge0 deletem en3"]
    assert "sudo ifconfig en2 inet " in found[0].fix_command  # out of the bridge, the port needs an address
    given = dr.check_bridge(Ran(bridge0(True)), Ran(NETWORKSETUP), {"en2": "sudo ifconfig en2 inet 192.168.0.1 x"})
    assert given[0].fix_command == "sudo ifconfig bridge0 deletem en2 && sudo ifconfig en2 inet 192.168.0.1 x"
    assert "Thunderbolt Bridge" in found[0].detail and "networksetup" in found[0].detail
    assert problems(check_node(mac(**{"ifconfig bridge0": Ran(bridge0(True, members=()))}))) == []


def test_route_to_a_peer_over_wifi():
    found = only(check_node(mac(**{f"route -n get {PEER}": Ran(route_get(PEER, "en1"))})), "route")
    assert "Wi-Fi (en1)" in found[0].what and PEER in found[0].what
    assert found[0].fix_command == f"sudo route change {PEER} -interface en2"
    # no Thunderbolt cable: Wi-Fi is a warning (it works, slowly)
    uncabled = mac(cables={}, **{f"route -n get {PEER}": Ran(route_get(PEER, "en1"))})
    assert only(check_node(uncabled), "route", WARNING)
    # through a gateway on Ethernet while a cable is there: a warning too
    routed = mac(**{f"route -n get {PEER}": Ran(route_get(PEER, "en0", "192.168.1.1"))})
    assert "gateway 192.168.1.1" in only(check_node(routed), "route", WARNING)[0].what


def test_mtu_mismatch_across_nodes():
    a, b = mac("mac0", 0, **{"ifconfig": Ran(ifconfig(mtu_en2=9000))}), mac("mac1", 1)
    found = only(check_across([a, b]), "mtu")
    assert "mac0:en2 (mtu 9000)" in found[0].what and "mac1:en2 (mtu 1500)" in found[0].what
    assert found[0].fix_command.startswith("sudo ifconfig en2 mtu 9000") and found[0].node == "mac1"


def test_macos_and_mlx_versions_differ_across_nodes():
    a = mac("mac0", 0)
    b = mac("mac1", 1, mlx_version="0.31.1", **{"sw_vers -productVersion": Ran("26.3\n")})
    found = only(check_across([a, b]), "versions")
    whats = " | ".join(f.what for f in found)
    assert "MLX versions differ: mac0 0.32.4, mac1 0.31.1" in whats
    assert "macOS versions differ: mac0 26.2, mac1 26.3" in whats
    assert any("mlx==0.32.4" in f.fix_command for f in found) and any("26.3" in f.fix_command for f in found)


# -- Linux broken cases ------------------------------------------------------------------------------


def test_no_openmpi():
    found = only(check_node(linux(**{"mpirun --version": None, "which orted": None})), "openmpi")
    assert "OpenMPI not found" in found[0].what and "apt-get install openmpi-bin" in found[0].fix_command
    assert "not OpenMPI" in only(check_node(linux(**{"mpirun --version": Ran(MPICH)})), "openmpi")[0].what
    assert "orted" in only(check_node(linux(**{"which orted": None})), "openmpi")[0].what


def test_no_openblas():
    found = only(check_node(linux(blas="")), "blas", WARNING)
    assert "reference BLAS" in found[0].what and found[0].fix_command == "sudo apt-get install libopenblas0-pthread"
    assert "not a file" in only(check_node(linux(blas="", blas_setting="/opt/nope.so")), "blas")[0].what
    assert "netlib" in only(check_node(linux(numpy_blas="netlib-blas")), "blas", WARNING)[0].what


@pytest.mark.parametrize("nft,iptables", [(NFT_SSH_ONLY, None), (None, IPTABLES_SSH_ONLY), (None, IPTABLES_REJECT_ALL)])
def test_firewall_dropping_the_ports(nft, iptables):
    rec = linux(**{"nft list ruleset": Ran(nft) if nft else None, "iptables -S": Ran(iptables) if iptables else None})
    found = [f for f in problems(check_node(rec))]
    assert {f.check for f in found} == {"firewall"}
    errors = [f.what for f in found if f.severity == ERROR]
    assert errors == ["the firewall drops TCP 10000-32767 (Node, ring and control ports)",
                      "the firewall drops UDP 5353 to 224.0.0.251 (mDNS discovery)"]
    fix = "sudo nft insert rule inet filter input tcp dport 10000-32767 accept" if nft else \
        "sudo iptables -I INPUT -p tcp --dport 10000:32767 -j ACCEPT"
    assert any(f.fix_command == fix for f in found), [f.fix_command for f in found]
    assert all(("policy drop" in f.detail or "-P INPUT DROP" in f.detail or "REJECT" in f.detail) for f in found)


def test_linux_route_over_wifi_or_a_gateway():
    wifi = only(check_node(linux(**{f"ip route get {LPEER}": Ran(ip_route(LPEER, "wlp2s0"))})), "route", WARNING)
    assert "Wi-Fi (wlp2s0)" in wifi[0].what and "ip route replace 10.0.0.2/32" in wifi[0].fix_command
    gw = only(check_node(linux(**{f"ip route get {LPEER}": Ran(ip_route(LPEER, via="10.0.0.254"))})), "route", WARNING)
    assert "gateway 10.0.0.254" in gw[0].what
    none = Ran("", 2, "RTNETLINK answers: Network is unreachable\n")
    assert "Network is unreachable" in only(check_node(linux(**{f"ip route get {LPEER}": none})), "route")[0].what


def test_advertised_differences_across_nodes():
    rows = [{"node_id": "a", "address": "10.0.0.1:10001", "platform": "Linux-x86_64", "backends": ["ring", "mpi"],
             "version": 2, "state": "idle"},
            {"node_id": "b", "address": "10.0.0.2:10001", "platform": "Linux-x86_64", "backends": ["ring"],
             "version": 2, "state": "unreachable", "error": "TLS handshake failed (another secret?)"}]
    found = check_advertised(rows)
    assert any(f.severity == ERROR and "b at 10.0.0.2:10001 does not answer" in f.what for f in found)
    assert any("backend mpi is unusable on b" in f.what and "openmpi" in f.fix_command for f in found)
    assert check_advertised([dict(rows[0]), dict(rows[0], node_id="c")]) == []


def test_report_round_trips_through_json():
    rec = mac()
    again = NodeReport.from_dict(json.loads(json.dumps(rec.to_dict())))
    assert again == rec
    with pytest.raises(ValueError, match="not a doctor node report"):
        NodeReport.from_dict({"system": "Darwin"})


# -- the command ---------------------------------------------------------------------------------------


def invoke(*args):
    from typer.testing import CliRunner

    from mlxcluster.cli import app

    return CliRunner().invoke(app, ["doctor", *args])


def test_doctor_on_this_machine():
    result = invoke("--json")
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    data = json.loads(result.stdout)
    assert result.exit_code == (1 if data["errors"] else 0)
    assert data["report"]["system"] and data["report"]["outputs"]
    text = invoke()
    assert text.exit_code == result.exit_code and "Traceback" not in text.output
    assert "no problems found" in text.stdout or any(w in text.stdout for w in ("ERROR", "WARNING"))


def test_doctor_bad_input():
    bad = invoke("--peer", "not-an-address")
    assert bad.exit_code == 2 and bad.stderr.strip() == "mlxcluster: error: --peer 'not-an-address' is not an IPv4 address"
    facts = invoke("--facts", "/nonexistent/doctor.json")
    assert facts.exit_code == 2 and len(facts.stderr.splitlines()) == 1
    assert facts.stderr.startswith("mlxcluster: error: --facts /nonexistent/doctor.json: ")


# -- OpenMPI 5 (issue 43, item 6): recorded ``mpirun --version`` of both generations ---------------

import os  # noqa: E402

MACOS_DATA = os.path.join(os.path.dirname(__file__), "data", "macos")


def recorded(name: str) -> str:
    with open(os.path.join(MACOS_DATA, name), encoding="utf-8") as fh:
        return fh.read()


def test_openmpi_5_is_refused_with_what_to_install():
    four = {"mpirun --version": Ran(recorded("mpirun_version_4.txt")), "which orted": Ran("/opt/ompi/bin/orted\n")}
    assert problems(check_node(mac(**four))) == []
    assert problems(check_node(linux(**four))) == []
    five = {"mpirun --version": Ran(recorded("mpirun_version_5.txt")), "which orted": None}
    found = only(check_node(mac(**five)), "openmpi", WARNING)  # jaccl and the ring need no MPI on a Mac
    assert "OpenMPI 5.0.5" in found[0].what and "no orted" in found[0].what
    assert found[0].fix_command == 'conda install -c conda-forge "openmpi=4.1"'
    found = only(check_node(linux(**five)), "openmpi")
    assert "OpenMPI 5.0.5" in found[0].what and "openmpi-bin" in found[0].fix_command
    # a stale orted beside OpenMPI 5 does not make it usable
    assert only(check_node(linux(**{**five, "which orted": Ran("/usr/bin/orted\n")})), "openmpi")


# -- macOS application firewall and Local Network permission (issue 43, item 12) -------------------

def firewall(state="on", blockall="off", stealth="off", app="permitted") -> dict:
    return {"socketfilterfw --getglobalstate": Ran(recorded(f"socketfilterfw_getglobalstate_{state}.txt")),
            "socketfilterfw --getblockall": Ran(recorded(f"socketfilterfw_getblockall_{blockall}.txt")),
            "socketfilterfw --getstealthmode": Ran(recorded(f"socketfilterfw_getstealthmode_{stealth}.txt")),
            "socketfilterfw --getappblocked": Ran(recorded(f"socketfilterfw_getappblocked_{app}.txt")),
            dr.MDNS_PROBE: Ran("", 0)}


def test_macos_firewall_findings():
    assert problems(check_node(mac(**firewall()))) == []
    assert problems(check_node(mac(**firewall("off", "on", "on", "blocked")))) == []  # firewall off: nothing applies
    notes = [f for f in check_node(mac(**firewall(stealth="on"))) if f.check == "firewall"]
    assert [f.severity for f in notes] == ["note"] and "stealth" in notes[0].what
    found = only(check_node(mac(**firewall(blockall="on"))), "firewall")
    assert "blocks all incoming" in found[0].what
    assert found[0].fix_command == "sudo /usr/libexec/ApplicationFirewall/socketfilterfw --setblockall off"
    found = only(check_node(mac(**firewall(app="blocked"))), "firewall")
    py = "/opt/homebrew/Cellar/python@3.12/3.12.8/Frameworks/Python.framework/Versions/3.12/bin/python3.12"
    assert py in found[0].what and f"--add {py}" in found[0].fix_command and f"--unblockapp {py}" in found[0].fix_command


def test_local_network_permission_denied():
    denied = dr.probe_local_network(lambda: (_ for _ in ()).throw(OSError(65, "No route to host")))
    assert denied.rc == 65 and "No route to host" in denied.err
    found = only(check_node(mac(**{**firewall(), dr.MDNS_PROBE: denied})), "local-network")
    assert "Local Network permission denied" in found[0].what and "Privacy_LocalNetwork" in found[0].fix_command
    assert dr.probe_local_network(lambda: None) == Ran("", 0)
    other = dr.probe_local_network(lambda: (_ for _ in ()).throw(OSError(51, "Network is unreachable")))
    assert only(check_node(mac(**{dr.MDNS_PROBE: other})), "local-network", WARNING)


# -- the Thunderbolt network plan over recorded Macs (tests/data/macos, runtime/netplan.py) ----------

def recorded_reports(case: str):
    """Each recorded Mac of ``case`` as the NodeReport doctor gathers."""
    import os

    from mlxcluster.runtime.netplan import read_recorded

    out = []
    for n in read_recorded(os.path.join(os.path.dirname(__file__), "data", "macos", case)):
        out.append(NodeReport(name=n.host, system="Darwin", mlx_version="0.32.4", outputs={
            "system_profiler SPThunderboltDataType -json": Ran(n.system_profiler),
            "networksetup -listallhardwareports": Ran(n.networksetup), "ifconfig": Ran(n.ifconfig),
            "ibv_devices": Ran(n.ibv_devices), "sw_vers -productVersion": Ran("26.2\n"),
            "ibv_devinfo -v": Ran(_read(case, n.host, "ibv_devinfo.txt"))}))
    return out


def _read(case: str, host: str, name: str) -> str:
    import os

    with open(os.path.join(os.path.dirname(__file__), "data", "macos", case, host, name)) as f:
        return f.read()


def test_rdma_ports_without_an_ipv4_gid_or_down_are_named_with_their_fix():
    """``ibv_devinfo -v`` (recorded, rdma-core's format): a cabled port whose interface has no IPv4
    address publishes no IPv4-mapped GID (MLX rdma.cpp PR #4191; jaccl fails 'RTR errno 22', mlx
    #3467); a port that is down carries nothing; the healthy mesh gives no finding."""
    import sys as _sys

    from mlxcluster.runtime.doctor import check_rdma_ports, parse_ibv_devinfo

    for r in recorded_reports("mesh3"):
        assert check_rdma_ports(r.out("ibv_devinfo -v"), dr._cabled(r)) == []
    assert parse_ibv_devinfo(_read("mesh3", "mac-a", "ibv_devinfo.txt"))["rdma_en2"] == ("PORT_ACTIVE", ("192.168.0.1",))
    b = next(r for r in recorded_reports("noaddr") if r.name == "mac-b")
    (found,) = check_rdma_ports(b.out("ibv_devinfo -v"), dr._cabled(b))
    assert found.what == "RDMA device rdma_en2 has no IPv4-mapped GID: en2 has no IPv4 address"
    assert "configure-network" in found.fix_command and "RTR errno 22" in found.detail
    _sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "data" / "macos"))
    from generate import ibv_devinfo

    down = ibv_devinfo("mac-a", {"en2": ("192.168.0.1", "192.168.0.3")}, down=("en2",))
    (found,) = check_rdma_ports(Ran(down), ["en2"])
    assert found.what.startswith("RDMA device rdma_en2 is PORT_DOWN")
    assert check_rdma_ports(None, ["en2"]) == []


@pytest.mark.parametrize("case", ["mesh3", "ring4", "pair2"])
def test_network_healthy_recorded_macs(case):
    assert dr.check_network(recorded_reports(case)) == []


def test_network_port_without_address():
    (f,) = dr.check_network(recorded_reports("noaddr"))
    assert (f.severity, f.check, f.node) == (ERROR, "address", "mac-b") and "no IPv4 address" in f.what
    assert f.fix_command.startswith("sudo ifconfig en2 inet 192.168.0.9 netmask 255.255.255.252 && "
                                    "sudo route change 192.168.0.10 -interface en2")


def test_network_bridge_up_in_a_loop_of_three():
    found = [f for f in check_across(recorded_reports("bridgeloop")) if f.check == "bridge-loop"]
    assert [f.node for f in found] == ["mac-a", "mac-b", "mac-c"] and all("storm" in f.what for f in found)
    assert all(f.fix_command.startswith("sudo ifconfig bridge0 down") for f in found)


def test_network_thunderbolt4_kept_out_of_jaccl():
    (r,) = recorded_reports("tb4")[:1]
    r.outputs.update({"ifconfig bridge0": None, "rdma_ctl status": Ran("enabled\n")})
    found = only(check_node(r), "thunderbolt-speed")
    assert "kept out of jaccl" in found[0].what and "Thunderbolt 5" in found[0].fix_command

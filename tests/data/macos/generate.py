"""Write the recorded macOS tool outputs under tests/data/macos/<case>/<host>/ (committed; rerun to regenerate).

Each Mac has three Thunderbolt 5 ports (``Thunderbolt 1..3`` -> en2..en4, as a Mac mini M4 Pro), Ethernet
en0 on the LAN and Wi-Fi en1.  The formats are the tools' own: ``system_profiler SPThunderboltDataType
-json`` (2-space indent, ``" : "``; one bus per port with ``domain_uuid_key``, ``receptacle_1_tag``
{``current_speed_key``, ``receptacle_id_key``, ``receptacle_status_key``}; the peer Mac as the first
``_items`` entry with a ``domain_uuid_key``, as MLX's ``extract_connectivity`` reads it),
``networksetup -listallhardwareports``, ``ifconfig``, ``ibv_devices``, ``sw_vers``.  The healthy cases'
addresses are the plan's (``mlxcluster.runtime.netplan``; tests/test_netplan.py checks that plan
against MLX's own ``mlx._distributed_utils.config``).

Usage: PYTHONPATH=. python tests/data/macos/generate.py
"""

from __future__ import annotations

import json
import os
import shutil
import uuid

from mlxcluster.runtime.netplan import RecordedNode, network_plan

HERE = os.path.dirname(os.path.abspath(__file__))
TAGS = (1, 2, 3)
TB5, TB4 = "Up to 120 Gb/s", "Up to 40 Gb/s"


def iface(tag: int) -> str:
    return f"en{tag + 1}"


def port_uuid(host: str, tag: int) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{host}.thunderbolt{tag}")).upper()


def mac_address(host: str, k: int) -> str:
    h = uuid.uuid5(uuid.NAMESPACE_DNS, host).bytes
    return f"36:{h[0]:02x}:{h[1]:02x}:{h[2]:02x}:00:{k:02x}"


def profiler(host: str, peers: dict, speeds: dict) -> str:
    """``peers``: {tag: (peer host, peer tag)}; ``speeds``: {tag: speed string} of cabled ports."""
    buses = [{"_name": "thunderbolt_bus", "device_name_key": "Mac mini", "vendor_name_key": "Apple Inc."}]
    for tag in TAGS:
        bus = {"_name": f"thunderboltusb4_bus_{tag - 1}", "device_name_key": "Mac mini",
               "domain_uuid_key": port_uuid(host, tag),
               "receptacle_1_tag": {"current_speed_key": speeds.get(tag, TB5), "link_status_key": "0x2",
                                    "receptacle_id_key": str(tag),
                                    "receptacle_status_key": "receptacle_connected" if tag in peers
                                    else "receptacle_no_devices"},
               "route_string_key": "0", "switch_uid_key": f"0x05AC{tag:04X}{uuid.uuid5(uuid.NAMESPACE_DNS, host).hex[:8].upper()}",
               "vendor_name_key": "Apple Inc."}
        if tag in peers:
            ph, pt = peers[tag]
            bus["_items"] = [{"_name": "Mac mini", "device_name_key": "Mac mini", "device_id_key": "0x2025",
                              "domain_uuid_key": port_uuid(ph, pt), "mode_key": "usb_four",
                              "route_string_key": "1", "switch_version_key": "0.0",
                              "vendor_id_key": "0x1", "vendor_name_key": "Apple Inc."}]
        buses.append(bus)
    return json.dumps({"SPThunderboltDataType": buses}, indent=2, separators=(",", " : ")) + "\n"


def networksetup(host: str) -> str:
    blocks = [("Ethernet", "en0"), ("Wi-Fi", "en1")] + [(f"Thunderbolt {t}", iface(t)) for t in TAGS] + \
        [("Thunderbolt Bridge", "bridge0")]
    return "\n" + "".join(f"Hardware Port: {name}\nDevice: {dev}\nEthernet Address: {mac_address(host, k)}\n\n"
                          for k, (name, dev) in enumerate(blocks)) + "VLAN Configurations\n===================\n"


UP = "flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500"


def ifconfig(host: str, lan: str, addresses: dict, bridge_up: bool) -> str:
    """``addresses``: {iface: (address, broadcast)} of the Thunderbolt ports that have one."""
    text = ("lo0: flags=8049<UP,LOOPBACK,RUNNING,MULTICAST> mtu 16384\n"
            "\toptions=1203<RXCSUM,TXCSUM,TXSTATUS,SW_TIMESTAMP>\n\tinet 127.0.0.1 netmask 0xff000000\n"
            "\tinet6 ::1 prefixlen 128 \n\tnd6 options=201<PERFORMNUD,DAD>\n"
            "gif0: flags=8010<POINTOPOINT,MULTICAST> mtu 1280\nstf0: flags=0<> mtu 1280\n"
            f"en0: {UP}\n\toptions=50b<RXCSUM,TXCSUM,VLAN_HWTAGGING,AV,CHANNEL_IO>\n\tether {mac_address(host, 0)}\n"
            f"\tinet {lan} netmask 0xffffff00 broadcast 192.168.1.255\n\tnd6 options=201<PERFORMNUD,DAD>\n"
            "\tmedia: autoselect (1000baseT <full-duplex,flow-control,energy-efficient-ethernet>)\n\tstatus: active\n"
            f"en1: {UP}\n\toptions=6460<TSO4,TSO6,CHANNEL_IO,PARTIAL_CSUM,ZEROINVERT_CSUM>\n\tether {mac_address(host, 1)}\n"
            "\tnd6 options=201<PERFORMNUD,DAD>\n\tmedia: autoselect (<unknown type>)\n\tstatus: inactive\n")
    for t in TAGS:
        dev = iface(t)
        text += f"{dev}: {UP}\n\toptions=460<TSO4,TSO6,CHANNEL_IO>\n\tether {mac_address(host, 1 + t)}\n"
        if dev in addresses:
            addr, bcast = addresses[dev]
            text += f"\tinet {addr} netmask 0xfffffffc broadcast {bcast}\n"
        text += "\tmedia: autoselect <full-duplex>\n\tstatus: active\n"
    flags = "8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST>" if bridge_up else "8822<BROADCAST,SMART,SIMPLEX,MULTICAST>"
    text += (f"bridge0: flags={flags} mtu 1500\n\toptions=63<RXCSUM,TXCSUM,TSO4,TSO6>\n\tether {mac_address(host, 9)}\n"
             "\tConfiguration:\n\t\tid 0:0:0:0:0:0 priority 0 hellotime 0 fwddelay 0\n"
             "\t\tmaxage 0 holdcnt 0 proto stp maxaddr 100 timeout 1200\n"
             "\t\troot id 0:0:0:0:0:0 priority 0 ifcost 0 port 0\n\t\tipfilter disabled flags 0x0\n")
    for k, t in enumerate(TAGS):
        text += f"\tmember: {iface(t)} flags=3<LEARNING,DISCOVER>\n\t        ifmaxaddr 0 port {10 + k} priority 0 path cost 0\n"
    text += "\tnd6 options=201<PERFORMNUD,DAD>\n\tmedia: <unknown type>\n"
    return text + ("\tstatus: active\n" if bridge_up else "\tstatus: inactive\n")


def ibv_devices(host: str) -> str:
    h = uuid.uuid5(uuid.NAMESPACE_DNS, host).hex
    return "    device          \t   node GUID\n    ------          \t----------------\n" + \
        "".join(f"    rdma_{iface(t)}        \t{h[:12]}{t:04x}\n" for t in TAGS)


def ibv_devinfo(host: str, addresses: dict, down=()) -> str:
    """``ibv_devinfo -v`` in rdma-core's format, trimmed of the device-wide limits; ``addresses``:
    {iface: (address, broadcast)} (an IPv4-mapped GID only where the port has one); ``down``:
    interfaces whose port is down."""
    h = uuid.uuid5(uuid.NAMESPACE_DNS, host).hex
    text = ""
    for t in TAGS:
        dev = iface(t)
        guid = f"{h[:4]}:{h[4:8]}:{h[8:12]}:{t:04x}"
        state = "PORT_DOWN (1)" if dev in down else "PORT_ACTIVE (4)"
        text += (f"hca_id:\trdma_{dev}\n\ttransport:\t\t\tInfiniBand (0)\n\tfw_ver:\t\t\t\t0.0.0\n"
                 f"\tnode_guid:\t\t\t{guid}\n\tsys_image_guid:\t\t\t{guid}\n\tvendor_id:\t\t\t0x05ac\n"
                 "\tvendor_part_id:\t\t\t0\n\thw_ver:\t\t\t\t0x0\n\tphys_port_cnt:\t\t\t1\n"
                 "\tmax_mr_size:\t\t\t0xffffffffffffffff\n\tpage_size_cap:\t\t\t0x4000\n"
                 "\tmax_qp:\t\t\t\t1024\n\tmax_qp_wr:\t\t\t4096\n"
                 f"\t\tport:\t1\n\t\t\tstate:\t\t\t{state}\n\t\t\tmax_mtu:\t\t4096 (5)\n"
                 "\t\t\tactive_mtu:\t\t4096 (5)\n\t\t\tsm_lid:\t\t\t0\n\t\t\tport_lid:\t\t0\n"
                 "\t\t\tport_lmc:\t\t0x00\n\t\t\tlink_layer:\t\tEthernet\n"
                 "\t\t\tmax_msg_sz:\t\t0x40000000\n\t\t\tport_cap_flags:\t\t0x00010000\n"
                 f"\t\t\tGID[  0]:\t\tfe80:0000:0000:0000:{h[12:16]}:{h[16:18]}ff:fe{h[18:20]}:{t:04x}, RoCE v2\n")
        if dev in addresses and dev not in down:
            a, b, c, d = (int(x) for x in addresses[dev][0].split("."))
            text += f"\t\t\tGID[  1]:\t\t0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}, RoCE v2\n"
        text += "\n"
    return text


SW_VERS = "ProductName:\t\tmacOS\nProductVersion:\t\t26.2\nBuildVersion:\t\t25C56\n"

# case -> (hosts, cables [((host, tag), (host, tag), speed)], broken: {"noaddr": [(host, iface)], "bridge": bool})
CASES = {
    "mesh3": (["mac-a", "mac-b", "mac-c"],
              [(("mac-a", 1), ("mac-b", 2), TB5), (("mac-a", 2), ("mac-c", 1), TB5), (("mac-b", 1), ("mac-c", 3), TB5)], {}),
    "ring4": (["mac-a", "mac-b", "mac-c", "mac-d"],
              [(("mac-a", 1), ("mac-b", 1), TB5), (("mac-b", 2), ("mac-c", 3), TB5), (("mac-c", 1), ("mac-d", 2), TB5),
               (("mac-d", 1), ("mac-a", 3), TB5)], {}),
    "pair2": (["mac-a", "mac-b"], [(("mac-a", 1), ("mac-b", 3), TB5), (("mac-a", 3), ("mac-b", 1), TB5)], {}),
    "noaddr": (["mac-a", "mac-b", "mac-c"],
               [(("mac-a", 1), ("mac-b", 2), TB5), (("mac-a", 2), ("mac-c", 1), TB5), (("mac-b", 1), ("mac-c", 3), TB5)],
               {"noaddr": [("mac-b", "en2")]}),
    "bridgeloop": (["mac-a", "mac-b", "mac-c"],
                   [(("mac-a", 1), ("mac-b", 2), TB5), (("mac-a", 2), ("mac-c", 1), TB5),
                    (("mac-b", 1), ("mac-c", 3), TB5)], {"bridge": True}),
    "tb4": (["mac-a", "mac-b"], [(("mac-a", 1), ("mac-b", 1), TB4)], {}),
}


def write_case(case: str) -> None:
    hosts, cables, broken = CASES[case]
    write_recordings(os.path.join(HERE, case), hosts, cables, broken)


def write_recordings(root: str, hosts, cables, broken=None, lans=None):
    """Write the five recordings of each of ``hosts`` (cabled by ``cables``, as in :data:`CASES`) under
    ``root/<host>/``; ``lans``: each host's en0 address (default 192.168.1.20 + k).  Returns the
    network plan whose addresses the healthy ports hold."""
    broken = broken or {}
    peers = {h: {} for h in hosts}
    speeds = {h: {} for h in hosts}
    for (ha, ta), (hb, tb), speed in cables:
        peers[ha][ta], peers[hb][tb] = (hb, tb), (ha, ta)
        speeds[ha][ta] = speeds[hb][tb] = speed
    profs = {h: profiler(h, peers[h], speeds[h]) for h in hosts}
    plan = network_plan([RecordedNode(h, profs[h], networksetup(h)) for h in hosts])
    addresses = {h: {} for h in hosts}
    if not broken.get("bridge"):  # a bridged port has no address of its own
        for c in plan.cables:
            bcast = c.network.split("/")[0].rsplit(".", 1)
            bcast = f"{bcast[0]}.{int(bcast[1]) + 3}"
            for end in (c.a, c.b):
                if (end.host, end.iface) not in broken.get("noaddr", []):
                    addresses[end.host][end.iface] = (end.address, bcast)
    shutil.rmtree(root, ignore_errors=True)
    for k, h in enumerate(hosts):
        os.makedirs(os.path.join(root, h))
        files = {"system_profiler_SPThunderboltDataType.json": profs[h],
                 "networksetup_listallhardwareports.txt": networksetup(h),
                 "ifconfig.txt": ifconfig(h, lans[k] if lans else f"192.168.1.{20 + k}", addresses[h],
                                          bool(broken.get("bridge"))),
                 "ibv_devices.txt": ibv_devices(h), "sw_vers.txt": SW_VERS,
                 "ibv_devinfo.txt": ibv_devinfo(h, addresses[h])}
        for name, text in files.items():
            with open(os.path.join(root, h, name), "w") as f:
                f.write(text)
    return plan


if __name__ == "__main__":
    for name in CASES:
        write_case(name)
        print("wrote", os.path.join(HERE, name))

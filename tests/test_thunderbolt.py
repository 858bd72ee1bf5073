"""jaccl on real Macs, tested with recorded command outputs (jaccl is not in the Linux wheel).

Each fixture Mac has four Thunderbolt 5 ports ("Thunderbolt 1..4" -> en2..en5); a topology
is a list of cables between (mac, tag) pairs.  From it the tests write what the three
commands print on macOS -- ``system_profiler SPThunderboltDataType -json``,
``networksetup -listallhardwareports``, ``ibv_devices`` -- and check the device matrix
against what MLX's own ``mlx.distributed_config`` code derives from the same outputs
(its ``run`` replaced by the recordings), for 2-, 3- and 4-Mac meshes, several cables
per pair, incomplete meshes and RDMA turned off.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import types
import uuid

import pytest

from mlxcluster.cluster import ranks
from mlxcluster.runtime import backends as bk
from mlxcluster.runtime import thunderbolt as tb
from mlxcluster.runtime.thunderbolt import (
    RDMA_DISABLED, JacclMesh, RdmaFacts, ThunderboltPort, jaccl_mesh, local_rdma_facts, parse_hardware_ports,
    parse_ibv_devices, parse_thunderbolt)

TAGS = (1, 2, 3, 4)


def iface(tag: int) -> str:
    return f"en{tag + 1}"


def port_uuid(mac: int, tag: int) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_DNS, f"mac{mac}.port{tag}")).upper()


# -- recorded command outputs -------------------------------------------------------------------

def profiler_json(mac: int, peer: dict, docks=(), hubs=()) -> str:
    """``system_profiler SPThunderboltDataType -json`` of Mac ``mac``: a bus without
    ``domain_uuid_key`` first, then one bus per port (in reverse port order on even Macs:
    the order of the buses is not that of the interfaces); a cabled port lists the peer
    Mac (with the peer port's ``domain_uuid_key``), a docked port a device without one;
    on a port in ``hubs`` the peer Mac comes after a hub without ``domain_uuid_key`` and
    before another device with one (the first item with a uuid counts)."""
    buses = [{"_name": "thunderbolt_bus", "device_name_key": "Mac Studio", "vendor_name_key": "Apple Inc."}]
    for tag in (TAGS[::-1] if mac % 2 == 0 else TAGS):
        status = "receptacle_connected" if (mac, tag) in peer or (mac, tag) in docks else "receptacle_no_devices"
        bus = {"_name": f"thunderboltusb4_bus_{tag - 1}", "device_name_key": "Mac Studio",
               "domain_uuid_key": port_uuid(mac, tag),
               "receptacle_1_tag": {"current_speed_key": "Up to 80 Gb/s", "link_status_key": "0x2",
                                    "receptacle_id_key": str(tag), "receptacle_status_key": status},
               "route_string_key": "0", "switch_uid_key": f"0x05AC{mac:04X}{tag:08X}", "vendor_name_key": "Apple Inc."}
        if (mac, tag) in peer:
            pm, pt = peer[(mac, tag)]
            bus["_items"] = [{"_name": "Mac Studio", "device_name_key": "Mac Studio", "domain_uuid_key": port_uuid(pm, pt),
                              "mode_key": "usb_four", "route_string_key": "1", "vendor_name_key": "Apple Inc."}]
            if (mac, tag) in hubs:
                bus["_items"] = [{"_name": "Hub", "device_name_key": "Hub", "vendor_name_key": "OWC"}] + bus["_items"] + \
                    [{"_name": "Drive", "device_name_key": "Drive", "domain_uuid_key": port_uuid(99, tag)}]
        elif (mac, tag) in docks:
            bus["_items"] = [{"_name": "TS4", "device_name_key": "TS4", "vendor_name_key": "CalDigit, Inc.",
                              "mode_key": "thunderbolt_four", "route_string_key": "1", "switch_uid_key": "0x003D0001"}]
        buses.append(bus)
    return json.dumps({"SPThunderboltDataType": buses}, indent=2, separators=(",", " : "))


def networksetup_text(mac: int) -> str:
    """``networksetup -listallhardwareports``: blank line, blocks, VLAN trailer."""
    blocks = [("Ethernet", "en0"), ("Wi-Fi", "en1")] + [(f"Thunderbolt {t}", iface(t)) for t in TAGS] + \
        [("Thunderbolt Bridge", "bridge0")]
    return "\n" + "".join(f"Hardware Port: {name}\nDevice: {dev}\nEthernet Address: 36:a1:{mac:02x}:00:00:{k:02x}\n\n"
                          for k, (name, dev) in enumerate(blocks)) + "VLAN Configurations\n===================\n"


def ibv_devices_text(devices) -> str:
    return "    device                 node GUID\n    ------              ----------------\n" + \
        "".join(f"    {d:<20}0000000000000000\n" for d in devices)


def recordings(n: int, cables, rdma_off=(), missing_device=None, docks=(), hubs=()):
    """Per Mac: the three commands' outputs for ``cables`` [((mac, tag), (mac, tag)), ...]."""
    peer = {}
    for a, b in cables:
        assert a not in peer and b not in peer and a not in docks and b not in docks
        peer[a], peer[b] = b, a
    out = []
    for mac in range(n):
        devices = [] if mac in rdma_off else [f"rdma_{iface(t)}" for t in TAGS if (mac, t) != missing_device]
        out.append({"system_profiler": profiler_json(mac, peer, docks, hubs), "networksetup": networksetup_text(mac),
                    "ibv_devices": ibv_devices_text(devices)})
    return out


def facts_of(recs):
    def runner(rec):
        return lambda argv: rec[argv[0]]
    return [local_rdma_facts(runner(rec), system="Darwin") for rec in recs]


#: Each Mac's ports in the order its cables take them, so that a cable joins ports of
#: different tags (and different indices) on its two sides.
PORT_ORDER = {0: (1, 2, 3, 4), 1: (2, 4, 1, 3), 2: (4, 3, 2, 1), 3: (3, 1, 4, 2)}


def full_mesh(n):
    """One cable per pair of ``n`` <= 4 Macs."""
    used = {m: 0 for m in range(n)}
    cables = []
    for i in range(n):
        for j in range(i + 1, n):
            cables.append(((i, PORT_ORDER[i][used[i]]), (j, PORT_ORDER[j][used[j]])))
            used[i] += 1
            used[j] += 1
    return cables


def spare_ports(n, cables):
    cabled = {end for cable in cables for end in cable}
    return {(m, t) for m in range(n) for t in TAGS if (m, t) not in cabled}


# -- MLX's own derivation (mlx/_distributed_utils/config.py), its `run` replaced -------------------

def mlx_run(recs, names, commands):
    def fake_run(cmd, **kwargs):
        assert isinstance(cmd, list) and cmd[0] == "ssh", cmd
        rec = recs[names.index(cmd[1])]
        commands.append(cmd)
        text = kwargs.get("text", False)
        if cmd[2] == "system_profiler":
            assert not text  # read as bytes, json.loads(bytes)
            return types.SimpleNamespace(stdout=rec["system_profiler"].encode(), returncode=0)
        if cmd[2] == "networksetup":
            assert not text  # parse_hardware_ports decodes bytes
            return types.SimpleNamespace(stdout=rec["networksetup"].encode(), returncode=0)
        if cmd[2] == "ibv_devices":
            assert text
            return types.SimpleNamespace(stdout=rec["ibv_devices"], returncode=0)
        if cmd[2:4] == ["ipconfig", "getifaddr"]:
            assert text
            return types.SimpleNamespace(stdout=f"10.0.0.{names.index(cmd[1]) + 1}\n", returncode=0)
        assert len(cmd) == 3 and cmd[2].startswith("sudo ifconfig bridge0 down"), cmd  # auto setup
        return types.SimpleNamespace(stdout=None, returncode=0)
    return fake_run


def mlx_connectivity(recs, monkeypatch):
    from mlx._distributed_utils import common
    from mlx._distributed_utils import config as mlxconfig

    names = [f"mac{i}" for i in range(len(recs))]
    commands = []
    monkeypatch.setattr(mlxconfig, "run", mlx_run(recs, names, commands))
    hosts = common.Hostfile.from_list(",".join(names)).hosts
    tb_hosts, index = mlxconfig.extract_connectivity(hosts, False)
    return mlxconfig, hosts, tb_hosts, index, commands


def mlx_matrix(recs, monkeypatch, tmp_path):
    """The matrix MLX's ``mlx.distributed_config --backend jaccl`` writes for ``recs``."""
    mlxconfig, hosts, tb_hosts, index, commands = mlx_connectivity(recs, monkeypatch)
    ips = mlxconfig.IPConfigurator(hosts, tb_hosts, index)
    assert mlxconfig.check_valid_mesh(hosts, mlxconfig.make_connectivity_matrix(tb_hosts, index), strict=False)
    assert mlxconfig.check_rdma(hosts, False, strict=False)
    out = tmp_path / "hostfile.json"
    # auto_setup=True with passwordless sudo: IPConfigurator.setup runs (the fake) ssh instead of input()
    args = argparse.Namespace(verbose=False, output_hostfile=str(out), auto_setup=True, env=[])
    mlxconfig.configure_jaccl(args, hosts, ips, [mlxconfig.SSHInfo(True, True)] * len(hosts))
    assert sum(c[2].startswith("sudo ifconfig") for c in commands) == len(hosts)
    return [h["rdma"] for h in json.loads(out.read_text())["hosts"]]


CASES = {
    "2 Macs": dict(n=2, cables=full_mesh(2)),
    "3 Macs": dict(n=3, cables=full_mesh(3)),
    "3 Macs, hubs in front of the peers": dict(n=3, cables=full_mesh(3), hubs={(0, 1), (1, 2), (2, 2)}),
    "4 Macs, a dock on each spare port": dict(n=4, cables=full_mesh(4), docks=spare_ports(4, full_mesh(4))),
    "2 Macs, 2 crossed cables": dict(n=2, cables=[((0, 1), (1, 4)), ((0, 2), (1, 3))]),
    "2 Macs, 4 cables": dict(n=2, cables=[((0, 1), (1, 3)), ((0, 2), (1, 1)), ((0, 3), (1, 4)), ((0, 4), (1, 2))]),
    "3 Macs, 2 cables on one pair": dict(n=3, cables=[((0, 1), (1, 2)), ((0, 3), (1, 1)), ((0, 2), (2, 4)),
                                                      ((1, 3), (2, 1))]),
    "3 Macs, 2 cables on every pair": dict(n=3, cables=[((0, 1), (1, 4)), ((0, 4), (1, 1)), ((0, 2), (2, 3)),
                                                        ((0, 3), (2, 2)), ((1, 2), (2, 4)), ((1, 3), (2, 1))]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matrix_equals_what_mlx_distributed_config_derives(case, monkeypatch, tmp_path):
    kw = dict(CASES[case])
    n = kw.pop("n")
    recs = recordings(n, **kw)
    facts = facts_of(recs)
    mesh = jaccl_mesh(facts)
    assert mesh.devices is not None, mesh.reason
    assert mesh.devices == mlx_matrix(recs, monkeypatch, tmp_path)
    assert mesh.reason.startswith(f"full Thunderbolt mesh with RDMA on all {n} nodes")
    for f, row in zip(facts, mesh.devices):  # every name is a device that node has
        for d in row:
            assert d is None or set([d] if isinstance(d, str) else d) <= set(f.rdma_devices)
    # the launcher files take it as it is (MLX_IBV_DEVICES)
    eps = [bk.RankEndpoint(rank=r, address=f"10.0.0.{r + 1}", ring_port=5000, control_port=5001,
                           rdma_devices={j: d for j, d in enumerate(row) if d is not None})
           for r, row in enumerate(mesh.devices)]
    assert bk.jaccl_devices(eps) == mesh.devices


def test_both_directions_of_each_cable_come_from_one_enumeration():
    # cable A: mac0 en2 <-> mac1 en5; cable B: mac0 en4 <-> mac1 en3.  Choosing each side's
    # interfaces on its own (sorted) would pair mac0's en2 with mac1's en3 (cable B's end):
    # queue pairs that never meet.
    recs = recordings(2, [((0, 1), (1, 4)), ((0, 3), (1, 2))])
    mesh = jaccl_mesh(facts_of(recs))
    assert mesh.devices == [[None, ["rdma_en2", "rdma_en4"]], [["rdma_en5", "rdma_en3"], None]]
    assert mesh.reason == ("full Thunderbolt mesh with RDMA on all 2 nodes (2 links per pair, as a ring striped over "
                           "them (MLX_JACCL_RING=1))") and mesh.ring  # jaccl's mesh uses cell [0] only (exo #2160)


def test_fewest_links_of_any_pair_decide_the_count():
    kw = dict(CASES["3 Macs, 2 cables on one pair"])
    mesh = jaccl_mesh(facts_of(recordings(kw.pop("n"), **kw)))
    assert mesh.devices[0] == [None, "rdma_en2", "rdma_en3"]  # the pair's first cable only
    assert mesh.devices[1][0] == "rdma_en3" and mesh.reason.endswith("(1 link per pair)")


def test_incomplete_mesh_names_the_missing_pair(monkeypatch):
    recs = recordings(3, [((0, 1), (1, 1)), ((1, 2), (2, 1))])  # a chain a - b - c
    mesh = jaccl_mesh(facts_of(recs), ["rank 0 (a)", "rank 1 (b)", "rank 2 (c)"])
    assert mesh == JacclMesh(None, "incomplete Thunderbolt mesh: no cable between rank 0 (a) and rank 2 (c)")
    assert jaccl_mesh(facts_of(recs)).reason.endswith("between rank 0 and rank 2")
    mlxconfig, hosts, tb_hosts, index, _ = mlx_connectivity(recs, monkeypatch)  # MLX agrees: no mesh
    assert not mlxconfig.check_valid_mesh(hosts, mlxconfig.make_connectivity_matrix(tb_hosts, index), strict=False)


def test_rdma_disabled_on_one_node(monkeypatch):
    recs = recordings(3, full_mesh(3), rdma_off={1})
    facts = facts_of(recs)
    assert facts[1].problem == RDMA_DISABLED and facts[1].rdma_devices == () and len(facts[1].ports) == 4
    mesh = jaccl_mesh(facts, ["rank 0 (a)", "rank 1 (b)", "rank 2 (c)"])
    assert mesh == JacclMesh(None, f"rank 1 (b): {RDMA_DISABLED}")
    mlxconfig, hosts, *_ = mlx_connectivity(recs, monkeypatch)  # MLX agrees: no RDMA
    assert not mlxconfig.check_rdma(hosts, False, strict=False)


def test_a_cabled_port_without_its_rdma_device():
    cables = full_mesh(2)
    (mac, tag), _ = cables[0]
    mesh = jaccl_mesh(facts_of(recordings(2, cables, missing_device=(mac, tag))))
    assert mesh.devices is None
    assert mesh.reason == f"rank {mac} has no RDMA device rdma_{iface(tag)} for its cable to rank {1 - mac}"
    # a missing device on a spare port does not matter
    spare = min(spare_ports(2, cables))
    assert jaccl_mesh(facts_of(recordings(2, cables, missing_device=spare))).devices is not None


def test_fewer_than_two_ranks_and_duplicate_ports():
    one = facts_of(recordings(1, []))
    assert jaccl_mesh(one) == JacclMesh(None, "jaccl needs at least 2 ranks")
    assert jaccl_mesh([]).devices is None
    a, b = facts_of(recordings(2, full_mesh(2)))
    assert jaccl_mesh([a, a], ["x", "y"]).reason == f"Thunderbolt port {a.ports[0].uuid} reported by both x and y"


def test_parsers():
    rec = recordings(2, full_mesh(2), docks={(0, 4)})[0]
    hw = parse_hardware_ports(rec["networksetup"])
    assert hw == {"Ethernet": "en0", "Wi-Fi": "en1", "Thunderbolt 1": "en2", "Thunderbolt 2": "en3",
                  "Thunderbolt 3": "en4", "Thunderbolt 4": "en5", "Thunderbolt Bridge": "bridge0"}
    ports = parse_thunderbolt(rec["system_profiler"], hw)
    assert [p.iface for p in ports] == ["en2", "en3", "en4", "en5"]  # the uuid-less bus is skipped
    assert ports[0] == ThunderboltPort("en2", port_uuid(0, 1), port_uuid(1, 2))
    assert [p.connected_to for p in ports[1:]] == [None, None, None]  # free ports and the dock (no uuid)
    assert parse_ibv_devices(rec["ibv_devices"]) == ("rdma_en2", "rdma_en3", "rdma_en4", "rdma_en5")
    assert parse_ibv_devices(ibv_devices_text([])) == () and parse_ibv_devices("") == ()


@pytest.mark.parametrize("bad", [
    "not json", "", "[]", "{}", json.dumps({"SPThunderboltDataType": "x"}),
    json.dumps({"SPThunderboltDataType": [{"domain_uuid_key": "u"}]}),  # no receptacle
    json.dumps({"SPThunderboltDataType": [{"domain_uuid_key": "u", "receptacle_1_tag": {}}]}),
    json.dumps({"SPThunderboltDataType": [{"domain_uuid_key": "u", "receptacle_1_tag": {"receptacle_id_key": "1"},
                                           "_items": None}]}),
    json.dumps({"SPThunderboltDataType": [{"domain_uuid_key": "u", "receptacle_1_tag": {"receptacle_id_key": "9"}}]}),
])
def test_garbage_profiler_output_is_a_value_error(bad):
    with pytest.raises(ValueError, match="system_profiler|Thunderbolt 9"):
        parse_thunderbolt(bad, parse_hardware_ports(networksetup_text(0)))


def test_local_facts_never_raise():
    rec = recordings(2, full_mesh(2))[0]
    with pytest.raises(ValueError, match="no interface for port 'Thunderbolt 4'"):
        parse_thunderbolt(rec["system_profiler"], {})

    def broken(argv):
        raise OSError("boom")

    def missing(argv):
        raise FileNotFoundError("ibv_devices not found")

    assert local_rdma_facts(broken, system="Darwin") == RdmaFacts(problem="ibv_devices failed: boom")
    assert local_rdma_facts(missing, system="Darwin").problem.startswith("ibv_devices not found")
    garbled = dict(rec, system_profiler="x" * 1000)
    facts = local_rdma_facts(lambda argv: garbled[argv[0]], system="Darwin")
    assert facts.problem.startswith("cannot read the Thunderbolt ports: unexpected system_profiler output")
    assert facts.rdma_devices and RdmaFacts.from_dict(facts.to_dict()) == facts  # sendable to peers
    assert local_rdma_facts(system="Linux") == RdmaFacts(problem="not macOS (jaccl needs RDMA over Thunderbolt)")


def test_local_facts_run_the_three_commands_with_a_timeout(monkeypatch):
    rec = recordings(2, full_mesh(2))[0]
    calls = []

    def fake_run(argv, **kwargs):
        calls.append((argv, kwargs))
        return subprocess.CompletedProcess(argv, 0, rec[argv[0].rsplit("/", 1)[-1]], "")

    monkeypatch.setattr(tb.shutil, "which", lambda name: f"/usr/sbin/{name}")
    monkeypatch.setattr(tb.subprocess, "run", fake_run)
    facts = local_rdma_facts(system="Darwin")
    assert facts.problem == "" and len(facts.ports) == 4 and len(facts.rdma_devices) == 4
    assert [a for a, _ in calls] == [["/usr/sbin/ibv_devices"],
                                     ["/usr/sbin/system_profiler", "SPThunderboltDataType", "-json"],
                                     ["/usr/sbin/networksetup", "-listallhardwareports"],
                                     ["/usr/sbin/ifconfig"]]  # each port's address: the ring over the cables
    assert all(kw["timeout"] > 0 and kw["check"] for _, kw in calls)
    monkeypatch.setattr(tb.shutil, "which", lambda name: None)
    assert local_rdma_facts(system="Darwin").problem.startswith("ibv_devices not found")


def test_facts_from_a_peer_are_validated():
    facts = RdmaFacts((ThunderboltPort("en2", "U1", "U2"), ThunderboltPort("en3", "U3")), ("rdma_en2",))
    assert RdmaFacts.from_dict(facts.to_dict()) == facts
    assert RdmaFacts.from_dict(json.loads(json.dumps(facts.to_dict()))) == facts
    assert ranks.rdma_facts(ranks.rdma_msg(facts)) == facts
    swapped = dict(facts.to_dict(), ports=facts.to_dict()["ports"][::-1])
    assert RdmaFacts.from_dict(swapped) == facts  # sorted by interface again
    assert RdmaFacts.from_dict({}) == RdmaFacts()
    for bad in ([], "x", None, {"ports": "x"}, {"ports": [1]}, {"ports": [{"iface": 1, "uuid": "u"}]},
                {"ports": [{"iface": "", "uuid": "u"}]}, {"ports": [{"iface": "en2"}]},
                {"ports": [{"iface": "en2", "uuid": "u", "connected_to": 5}]},
                {"rdma_devices": ["x" * 300]}, {"rdma_devices": [""]}, {"rdma_devices": "rdma_en2"},
                {"problem": 3}, {"problem": "p" * 257},
                {"ports": [{"iface": "en2", "uuid": "u"}] * 65}, {"rdma_devices": ["rdma_en2"] * 65}):
        with pytest.raises(ValueError):
            RdmaFacts.from_dict(bad)


# -- how the cluster uses it (mlxcluster.cluster.ranks) ---------------------------------------------

def _eps(n, backends):
    return [bk.RankEndpoint(rank=r, address=f"10.0.0.{r + 1}", ring_port=5000 + r, control_port=6000 + r,
                            hostname=f"mac{r}", backends=list(backends)) for r in range(n)]


def test_auto_picks_jaccl_on_a_full_mesh_else_ring_and_says_why():
    full = facts_of(recordings(3, full_mesh(3)))
    backend, reason, devices = ranks.pick_backend("auto", _eps(3, ["ring", "jaccl"]), full)
    assert backend == "jaccl" and devices == jaccl_mesh(full).devices and "full Thunderbolt mesh" in reason
    chain = facts_of(recordings(3, [((0, 1), (1, 1)), ((1, 2), (2, 1))]))
    backend, reason, devices = ranks.pick_backend("auto", _eps(3, ["ring", "jaccl"]), chain)
    assert (backend, devices) == ("ring", None)
    assert reason == ("no jaccl: incomplete Thunderbolt mesh: no cable between rank 0 (mac0) and rank 2 (mac2); "
                      "no usable OpenMPI on any node")
    # cabled, but this MLX has no jaccl (e.g. the Linux wheel): OpenMPI everywhere -> MPI
    backend, reason, _ = ranks.pick_backend("auto", _eps(3, ["ring", "mpi"]), full)
    assert backend == "mpi" and "MLX has no jaccl backend on rank 0 (mac0)" in reason
    # Linux nodes: no Thunderbolt at all; the ring only where OpenMPI is not installed
    linux = [local_rdma_facts(system="Linux")] * 2
    assert ranks.pick_backend("auto", _eps(2, ["ring"]), linux)[:2] == \
        ("ring", "no jaccl: rank 0 (mac0): not macOS (jaccl needs RDMA over Thunderbolt); "
                 "no usable OpenMPI on any node")
    with pytest.raises(ValueError, match="incomplete Thunderbolt mesh"):
        ranks.pick_backend("jaccl", _eps(3, ["ring", "jaccl"]), chain)
    assert ranks.pick_backend("mpi", _eps(2, ["ring", "mpi"]), linux) == ("mpi", "requested", None)
    with pytest.raises(ValueError, match="not available"):
        ranks.pick_backend("mpi", _eps(2, ["ring"]), linux)
    assert ranks.pick_backend("auto", _eps(1, ["ring"]), linux[:1])[0] == "ring"
    assert ranks.pick_backend("auto", _eps(1, ["ring", "mpi"]), linux[:1])[0] == "ring"


def test_auto_on_linux_picks_mpi_where_every_node_has_it_else_ring():
    """`join` with no --backend on Linux: MPI where OpenMPI is installed (and usable) on every
    node, the ring where it is not; the reason says which node lacks it."""
    linux = [local_rdma_facts(system="Linux")] * 3
    backend, reason, devices = ranks.pick_backend("auto", _eps(3, ["ring", "mpi"]), linux)
    assert (backend, devices) == ("mpi", None)
    assert reason == "no jaccl: rank 0 (mac0): not macOS (jaccl needs RDMA over Thunderbolt); every node has OpenMPI"
    mixed = _eps(3, ["ring", "mpi"])
    mixed[2].backends = ["ring"]  # node 2 lists no mpi (no mpirun/orted, or MLX cannot load libmpi)
    backend, reason, _ = ranks.pick_backend("auto", mixed, linux)
    assert backend == "ring" and reason.endswith("; no usable OpenMPI on rank 2 (mac2)")
    # a full mesh with jaccl everywhere still wins over MPI
    full = facts_of(recordings(3, full_mesh(3)))
    assert ranks.pick_backend("auto", _eps(3, ["ring", "mpi", "jaccl"]), full)[0] == "jaccl"


def test_a_jaccl_member_starts_its_rank_with_mlx_launch_s_files(tmp_path, monkeypatch):
    """What a node writes and sets for its jaccl rank: MLX_IBV_DEVICES holds the matrix the
    coordinator derived (Bootstrap's jaccl_devices_json), the coordinator is rank 0's ring port."""
    from mlxcluster.cluster.membership import Formation, Member

    devices = jaccl_mesh(facts_of(recordings(3, full_mesh(3)))).devices
    formation = Formation(formation_id="f", coordinator_id="mac0", backend="jaccl",
                          members=tuple(Member(r, f"mac{r}", f"10.0.0.{r + 1}", 5000 + r, 6000 + r) for r in range(3)),
                          jaccl_devices_json=json.dumps(devices))
    formation = Formation.from_bootstrap(formation.to_bootstrap(1))  # as the member receives it
    spawned = []

    class FakeSupervisor:
        def __init__(self, **kwargs):
            pass

        def spawn(self, cmd, env, name):
            spawned.append((cmd, env, name))

    monkeypatch.setattr(ranks, "Supervisor", FakeSupervisor)
    ranks.start_rank(formation, 1, bind="10.0.0.2", model_path="/m", secret="s" * 12, cluster="c",
                     workdir=str(tmp_path), on_event=print, on_exit=print)
    (cmd, env, name), = spawned
    assert json.loads(open(env["MLX_IBV_DEVICES"]).read()) == devices
    assert env["MLX_JACCL_COORDINATOR"] == "10.0.0.1:5000" and env["MLX_RANK"] == "1"
    assert json.loads(cmd[cmd.index("--config") + 1])["backend"] == "jaccl" and "s" * 12 not in " ".join(cmd)

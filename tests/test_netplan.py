"""The Thunderbolt network plan (``runtime/netplan.py``) against MLX's own ``mlx.distributed_config``.

For the healthy recorded cases (tests/data/macos: a 3-Mac mesh, a 4-Mac ring, a pair with two
cables) MLX's installed ``mlx._distributed_utils.config`` runs on the same recorded
``system_profiler`` / ``networksetup`` / ``ibv_devices`` outputs (its ``run``, i.e. its ssh, replaced
by the recordings), and the plan must equal what it computes: the connectivity, the addresses
(one /30 per cable), the setup commands, the jaccl matrix and backend, the ring hostfile.  Then the
broken cases: each names its cause and the fix command; the healthy ones have no problems.
"""

from __future__ import annotations

import ipaddress
import json
import os
import types
from argparse import Namespace

import pytest

from mlxcluster.runtime.netplan import RecordedNode, network_plan, parse_ifconfig, read_recorded

mc = pytest.importorskip("mlx._distributed_utils.config")
from mlx._distributed_utils.common import Host  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data", "macos")
HEALTHY = ("mesh3", "ring4", "pair2")


def case(name: str):
    return read_recorded(os.path.join(DATA, name))


def mlx_computes(nodes, monkeypatch, capsys, tmp_path) -> dict:
    """What MLX's ``prepare_tb_hostfile`` (no --backend) and ``configure_ring`` make of the recordings."""
    by_host = {n.host: n for n in nodes}

    def run(argv, capture_output=False, text=False, **kw):
        assert argv[0] == "ssh", argv
        node, cmd = by_host[argv[1]], argv[2:]
        out = {"system_profiler": node.system_profiler, "networksetup": node.networksetup,
               "ibv_devices": node.ibv_devices,
               "ipconfig": parse_ifconfig(node.ifconfig)["en0"].inet[0]}[cmd[0]]
        return types.SimpleNamespace(stdout=out if text else out.encode(), returncode=0)

    monkeypatch.setattr(mc, "run", run)
    monkeypatch.setattr("builtins.input", lambda *a: "")
    hosts = [Host(i, n.host, [], []) for i, n in enumerate(nodes)]
    ssh = [mc.SSHInfo(True, False)] * len(nodes)
    tb_hosts, index = mc.extract_connectivity(hosts, False)
    ips = mc.IPConfigurator(hosts, tb_hosts, index)
    conn = mc.make_connectivity_matrix(tb_hosts, index)
    args = Namespace(verbose=False, dot=False, backend=None, auto_setup=False, env=[],
                     output_hostfile=str(tmp_path / "tb.json"))
    capsys.readouterr()
    mc.prepare_tb_hostfile(args, [Host(i, n.host, [], []) for i, n in enumerate(nodes)], ssh)
    commands, host = {}, None
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("Setup for "):
            host = line[len("Setup for "):]
            commands[host] = []
        elif line.startswith("sudo "):
            commands[host].append(line[len("sudo "):])
    ring_args = Namespace(**{**vars(args), "output_hostfile": str(tmp_path / "ring.json")})
    mc.configure_ring(ring_args, hosts, ips, mc.extract_rings(conn)[0], ssh)
    with open(tmp_path / "tb.json") as f, open(tmp_path / "ring.json") as g:
        return {"ips": {k: list(v) for k, v in ips.ips.items()}, "connectivity": conn, "commands": commands,
                "hostfile": json.load(f), "ring": json.load(g)}


@pytest.mark.parametrize("name", HEALTHY)
def test_plan_equals_mlx_distributed_config(name, monkeypatch, capsys, tmp_path):
    nodes = case(name)
    mlx = mlx_computes(nodes, monkeypatch, capsys, tmp_path)
    plan = network_plan(nodes)
    assert plan.connectivity == mlx["connectivity"]
    ips: dict = {}
    for c in plan.cables:  # both ends of each cable, as IPConfigurator.ips holds them
        i, j = plan.hosts.index(c.a.host), plan.hosts.index(c.b.host)
        ips.setdefault((i, j), []).append((c.a.iface, c.a.address))
        ips.setdefault((j, i), []).append((c.b.iface, c.b.address))
    assert ips == mlx["ips"]
    assert {h: list(c) for h, c in plan.commands.items()} == mlx["commands"]
    hostfile = mlx["hostfile"]
    assert plan.backend == hostfile["backend"]
    assert list(plan.jaccl_order) == [h["ssh"] for h in hostfile["hosts"]]
    assert plan.jaccl_devices == [h["rdma"] for h in hostfile["hosts"]]
    several = any(n > 1 for row in plan.connectivity for n in row)
    assert plan.jaccl_ring == (hostfile["backend"] == "jaccl-ring" or several)  # exo PR #2160 for several
    assert list(plan.ring_order) == [h["ssh"] for h in mlx["ring"]["hosts"]]
    assert plan.ring_hostfile == [h["ips"] for h in mlx["ring"]["hosts"]]
    assert plan.problems == ()


@pytest.mark.parametrize("name", HEALTHY)
def test_one_slash30_per_cable(name):
    plan = network_plan(case(name))
    nets = [ipaddress.ip_network(c.network) for c in plan.cables]
    assert len(set(nets)) == len(nets) and all(n.prefixlen == 30 for n in nets)
    for c, net in zip(plan.cables, nets):
        assert list(net.hosts()) == [ipaddress.ip_address(c.a.address), ipaddress.ip_address(c.b.address)]


def test_backends_per_case():
    assert (network_plan(case("mesh3")).backend, network_plan(case("mesh3")).jaccl_ring) == ("jaccl", False)
    ring = network_plan(case("ring4"))
    assert (ring.backend, ring.jaccl_ring) == ("jaccl-ring", True)
    pair = network_plan(case("pair2"))  # MLX's config picks the mesh; jaccl's mesh would use one cable
    assert (pair.backend, pair.jaccl_ring) == ("jaccl", True)
    assert pair.jaccl_devices[0][1] == ["rdma_en2", "rdma_en4"] and pair.jaccl_devices[1][0] == ["rdma_en4", "rdma_en2"]


def test_for_ranks_reorders_and_refuses_a_broken_ring():
    mesh = network_plan(case("mesh3"))
    net = mesh.for_ranks(["mac-c", "mac-a", "mac-b"])
    assert net.jaccl_devices == [[None, mesh.jaccl_devices[2][0], mesh.jaccl_devices[2][1]],
                                 [mesh.jaccl_devices[0][2], None, mesh.jaccl_devices[0][1]],
                                 [mesh.jaccl_devices[1][2], mesh.jaccl_devices[1][0], None]]
    assert net.ring_hostfile == [["192.168.0.10"], ["192.168.0.5"], ["192.168.0.2"]]  # each on its cable to rank-1
    ring = network_plan(case("ring4"))
    assert ring.for_ranks(list(ring.ring_order)).jaccl_devices == ring.jaccl_devices
    bad = ring.for_ranks(["mac-a", "mac-c", "mac-b", "mac-d"])  # a and c share no cable
    assert bad.ring_hostfile is None and bad.jaccl_devices is None and not bad.jaccl_ring
    assert "no cable between mac-c and mac-a" in bad.problem
    with pytest.raises(ValueError, match="not in the network plan"):
        ring.for_ranks(["mac-z"])


def test_port_without_address_names_cause_and_fix():
    plan = network_plan(case("noaddr"))
    (p,) = plan.problems
    assert (p.check, p.host) == ("no-address", "mac-b")
    assert "en2 (cable to mac-c) has no IPv4 address" in p.what and "#4191" in p.what
    assert "sudo ifconfig en2 inet 192.168.0.9 netmask 255.255.255.252" in p.fix
    assert "sudo route change 192.168.0.10 -interface en2" in p.fix and "--configure-network" in p.fix


def test_bridge_up_in_a_loop_names_the_storm_and_the_fix():
    plan = network_plan(case("bridgeloop"))
    bridge = [p for p in plan.problems if p.check == "bridge-loop"]
    assert [p.host for p in bridge] == ["mac-a", "mac-b", "mac-c"]
    assert all("storm" in p.what and "en2, en3, en4" in p.what for p in bridge)
    assert all(p.fix.startswith("sudo ifconfig bridge0 down") for p in bridge)


def test_bridge_up_on_a_pair_is_no_storm():
    nodes = case("bridgeloop")
    pair = [nodes[0], RecordedNode(nodes[1].host, nodes[1].system_profiler, nodes[1].networksetup)]
    (p,) = [p for p in network_plan(pair).problems if p.check.startswith("bridge")]
    assert p.check == "bridge" and "storm" not in p.what


def test_thunderbolt4_cable_is_kept_out_of_jaccl():
    plan = network_plan(case("tb4"))
    (cable,) = plan.cables
    assert cable.speed_gbps == 40 and not cable.jaccl
    assert plan.backend == "ring" and plan.jaccl_devices is None
    assert plan.ring_hostfile == [["192.168.0.1"], ["192.168.0.2"]]  # TCP over the TB4 cable still works
    (p,) = plan.problems
    assert p.check == "tb4" and "ibv_reg_mr" in p.what and "Thunderbolt 5" in p.fix


def test_recorded_reader_errors_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        read_recorded(str(tmp_path / "none"))
    (tmp_path / "mac-a").mkdir()
    with pytest.raises(ValueError, match=r"cannot read .*mac-a/system_profiler_SPThunderboltDataType.json") as e:
        read_recorded(str(tmp_path))
    assert "\n" not in str(e.value)


# -- mlxcluster join --dry-run / --configure-network (typer's runner, in process) -------------------

def join(*args):
    from typer.testing import CliRunner

    from mlxcluster.cli import app

    return CliRunner().invoke(app, ["join", *args])


def test_join_dry_run_json_prints_the_plan_and_joins_nothing():
    result = join("--dry-run", "--json", "--recorded", os.path.join(DATA, "ring4"))
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == json.loads(json.dumps(network_plan(case("ring4")).to_dict()))
    text = join("--dry-run", "--recorded", os.path.join(DATA, "ring4"))
    assert text.exit_code == 0 and "jaccl as ring (MLX_JACCL_RING=1)" in text.stdout
    assert "sudo route change 192.168.0.13 -interface en3" in text.stdout


def test_join_dry_run_without_thunderbolt_and_bad_input(monkeypatch):
    import platform

    monkeypatch.setattr(platform, "system", lambda: "Linux")
    result = join("--dry-run")
    assert result.exit_code == 0 and result.stdout.strip().splitlines() == [
        "no Thunderbolt ports here (not macOS): give Macs' recorded outputs with --recorded DIR"]
    missing = join("--dry-run", "--recorded", os.path.join(DATA, "none"))
    assert missing.exit_code == 2 and missing.stderr.count("\n") == 1 and "not a folder" in missing.stderr
    assert join("--json").exit_code == 2


def test_join_configure_network_runs_this_hosts_commands(monkeypatch):
    import socket
    import subprocess

    ran = []
    monkeypatch.setattr(socket, "gethostname", lambda: "mac-b.local")
    monkeypatch.setattr(subprocess, "run", lambda argv, check=False: ran.append(argv) or types.SimpleNamespace(returncode=0))
    monkeypatch.setattr("mlxcluster.cli._run_node", lambda *a, **k: None)  # stop before joining
    result = join("--configure-network", "--recorded", os.path.join(DATA, "noaddr"), "--dry-run")
    assert result.exit_code == 0 and ran == []  # --dry-run wins: nothing runs
    monkeypatch.setattr("mlxcluster.cli._read_secret", lambda *a: (_ for _ in ()).throw(SystemExit(0)))
    join("--configure-network", "--recorded", os.path.join(DATA, "noaddr"))
    assert [" ".join(a) for a in ran] == ["sudo " + c for c in network_plan(case("noaddr")).commands["mac-b"]]


# -- the live formation's data plane from each node's own facts (cluster/ranks.data_plane) --------------

def live_facts(nodes):
    from mlxcluster.runtime.thunderbolt import facts_from_outputs

    return [facts_from_outputs(n.system_profiler, n.networksetup, n.ibv_devices, n.ifconfig) for n in nodes]


@pytest.mark.parametrize("name", HEALTHY)
def test_the_ring_over_cables_from_each_nodes_facts_equals_mlx_configure_ring(name, monkeypatch, capsys, tmp_path):
    """A formation's coordinator knows only what each node sent of itself (its ports, their
    addresses as ifconfig shows them, their peers' uuids). Over MLX's ring order, the per-rank
    addresses it gives the TCP ring equal MLX's ``configure_ring`` hostfile on the same recordings,
    and the rank files the nodes write list them (rank r's addresses, one port per rank)."""
    import mlxcluster.cluster.ranks as ranks
    from mlxcluster.cluster.membership import Formation, Member
    from mlxcluster.runtime import backends as bk

    nodes = case(name)
    mlx = mlx_computes(nodes, monkeypatch, capsys, tmp_path)
    order = [h["ssh"] for h in mlx["ring"]["hosts"]]
    by_host = dict(zip([n.host for n in nodes], live_facts(nodes)))
    wires = ranks.data_plane("ring", [by_host[h] for h in order], order)
    assert json.loads(wires.ring_hosts_json) == [h["ips"] for h in mlx["ring"]["hosts"]]
    assert wires.note.startswith("ring over the Thunderbolt cables")
    members = tuple(Member(rank=r, node_id=h, address=f"10.0.0.{r + 1}", ring_port=40000 + r, control_port=41000 + r)
                    for r, h in enumerate(order))
    f = Formation.from_bootstrap(Formation("f1", order[0], "ring", members,
                                           ring_hosts_json=wires.ring_hosts_json).to_bootstrap(1))
    rows = ranks.ring_addresses(f)
    eps = [bk.RankEndpoint(rank=m.rank, address=m.address, ring_port=m.ring_port, control_port=m.control_port,
                           ring_addresses=rows[m.rank]) for m in members]
    assert bk.ring_hostfile(eps) == [[f"{ip}:{40000 + r}" for ip in h["ips"]]
                                     for r, h in enumerate(mlx["ring"]["hosts"])]


def test_the_ring_falls_back_to_the_members_addresses_and_says_why():
    """No addresses on a cable (the noaddr case), or no cable between ring neighbours: the ring runs
    over the nodes' own addresses and the backend's reason names why; nodes without Thunderbolt
    ports say nothing of cables."""
    import mlxcluster.cluster.ranks as ranks
    from mlxcluster.runtime.thunderbolt import RdmaFacts

    nodes = case("noaddr")
    wires = ranks.data_plane("ring", live_facts(nodes), [n.host for n in nodes])
    assert wires.ring_hosts_json == "" and "has no addresses in one network" in wires.note
    assert "mlxcluster join --dry-run" in wires.note
    ring4 = case("ring4")  # ranks in an order the cables do not follow: mac-a's neighbour mac-c is not cabled
    facts = dict(zip([n.host for n in ring4], live_facts(ring4)))
    plan = network_plan(ring4)
    across = [plan.ring_order[0], plan.ring_order[2], plan.ring_order[1], plan.ring_order[3]]
    wires = ranks.data_plane("ring", [facts[h] for h in across], across)
    assert wires.ring_hosts_json == "" and "no Thunderbolt cable between" in wires.note
    assert ranks.data_plane("ring", [RdmaFacts(), RdmaFacts()]) == ranks.DataPlane()  # Linux: nothing to say
    assert ranks.data_plane("mpi", live_facts(case("mesh3"))) == ranks.DataPlane()


def test_jaccl_runs_as_a_ring_where_every_pair_has_several_cables_and_never_over_thunderbolt_4():
    import mlxcluster.cluster.ranks as ranks
    from mlxcluster.runtime import backends as bk
    from mlxcluster.runtime.thunderbolt import jaccl_mesh

    assert ranks.data_plane("jaccl", live_facts(case("pair2"))).jaccl_ring
    assert not ranks.data_plane("jaccl", live_facts(case("mesh3"))).jaccl_ring
    tb4 = live_facts(case("tb4"))
    assert any(0 < p.speed_gbps <= 40 for f in tb4 for p in f.ports)
    mesh = jaccl_mesh(tb4)
    assert mesh.devices is None and "Thunderbolt 4 cable: kept out of jaccl" in mesh.reason
    eps = [bk.RankEndpoint(rank=r, address=f"10.0.0.{r + 1}", ring_port=40000 + r, control_port=41000 + r,
                           rdma_devices={1 - r: "rdma_en2"}) for r in range(2)]
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        assert bk.write_backend_files("jaccl", eps, 0, d, jaccl_ring=True)["MLX_JACCL_RING"] == "1"
        assert "MLX_JACCL_RING" not in bk.write_backend_files("jaccl", eps, 0, d)


def test_a_node_reads_its_own_recorded_outputs(tmp_path):
    """``join --recorded DIR``: a node's facts come from DIR/<node id> (or its host name); a missing
    folder is one line naming what was looked for."""
    from mlxcluster.runtime.netplan import read_recorded_node

    node = read_recorded_node(os.path.join(DATA, "mesh3"), ["nope", "mac-b"])
    assert node.host == "mac-b" and node.ifconfig
    (f,) = live_facts([node])
    assert all(p.address.endswith("/30") for p in f.ports if p.connected_to)
    with pytest.raises(ValueError, match=r"no folder for this node \(looked for 'x', 'y'\)"):
        read_recorded_node(os.path.join(DATA, "mesh3"), ["x", "y"])


def test_one_mac_alone_sets_up_its_cables_so_that_both_ends_agree():
    """``join --configure-network`` on a live Mac has only its own outputs: each cable's /30 comes from
    its two port uuids, so the Macs at its two ends, each alone, give it the same network and
    different ends; the ring over the cables then runs over them (both ends in one /30). Ports that
    hold an address keep it; a bridge up with Thunderbolt members goes down first."""
    import ipaddress

    from mlxcluster.runtime.netplan import cable_addresses, local_commands
    from mlxcluster.runtime.thunderbolt import parse_hardware_ports, parse_thunderbolt

    net, a, b = cable_addresses("aaaa-1", "BBBB-2")
    assert cable_addresses("bbbb-2", "AAAA-1") == (net, b, a)
    assert ipaddress.ip_network(net).prefixlen == 30 and ipaddress.ip_address(a) in ipaddress.ip_network("192.168.128.0/17")
    assert [str(h) for h in ipaddress.ip_network(net).hosts()] == [a, b]
    healthy = {n.host: n for n in case("mesh3")}
    assert local_commands(healthy["mac-a"]) == []  # addressed already (by MLX's tool)
    noaddr = {n.host: n for n in case("noaddr")}["mac-b"]
    cmds = local_commands(noaddr)
    port = next(p for p in parse_thunderbolt(noaddr.system_profiler, parse_hardware_ports(noaddr.networksetup))
                if p.iface == "en2")
    net, mine, peer = cable_addresses(port.uuid, port.connected_to)
    assert cmds == [f"ifconfig en2 inet {mine} netmask 255.255.255.252", f"route change {peer} -interface en2"]
    looped = {n.host: n for n in case("bridgeloop")}["mac-a"]
    assert local_commands(looped)[0] == "ifconfig bridge0 down" and len(local_commands(looped)) == 1 + 2 * 2

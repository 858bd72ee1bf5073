"""MPI without ssh: the launch agent, the mpirun command of a join formation, and
``Node.Exec`` on a real node daemon (fast tier: no model load, no rank starts).

The whole path (three `join` nodes in three network namespaces forming an MPI group):
tests/test_cluster.py::test_mpi_group_formed_by_join_across_three_namespaces.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import threading

import grpc
import pytest

from harness import until
from mlxcluster.cluster.discovery import PROTOCOL_VERSION
from mlxcluster.cluster.node import NodeConfig, NodeDaemon
from mlxcluster.cluster.membership import Bootstrapping, Failed
from mlxcluster.protocol import mlxcluster_pb2 as pb
from mlxcluster.runtime import mpi_agent
from mlxcluster.security import credentials

SECRET = "mpi-agent-test-secret-0123"
pytestmark = pytest.mark.timeout(90)


def test_orted_argv_splits_like_the_remote_shell_and_accepts_only_orted():
    # the words exactly as OpenMPI 4.1's plm_rsh hands them to its agent (recorded here)
    words = [" orted", "-mca", "ess", '"env"', "-mca", "ess_base_jobid", '"1565589504"', "-mca",
             "orte_hnp_uri", '"1565589504.0;tcp://192.0.2.2:47565;tcp6://[fd00::2]:44799"']
    argv = mpi_agent.orted_argv(words, orted="/usr/bin/orted")
    assert argv == ["/usr/bin/orted", "-mca", "ess", "env", "-mca", "ess_base_jobid", "1565589504", "-mca",
                    "orte_hnp_uri", "1565589504.0;tcp://192.0.2.2:47565;tcp6://[fd00::2]:44799"]
    for bad in (["sh", "-c", "id"], ["/bin/orted"], ["orted;", "id"], [], ['"unbalanced']):
        with pytest.raises(ValueError):
            mpi_agent.orted_argv(bad, orted="/usr/bin/orted")


def test_join_mpirun_names_each_rank_by_alias_and_keeps_the_secret_off_the_command(tmp_path):
    argv = mpi_agent.join_mpirun(
        formation_id="f1", cluster="c", addresses=["10.0.0.1", "10.0.0.2", "10.0.0.2"],
        node_ids=["a", "b", "c"], node_endpoints=["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.2:50052"],
        rank_command=["python3", "-m", "mlxcluster.runtime.rank"], workdir=str(tmp_path), mpirun="mpirun",
        python="/venv/bin/python")
    hostfile = (tmp_path / "mpi_hostfile").read_text()
    # two ranks on one machine still get a daemon each (one alias per rank)
    assert hostfile == "10.0.0.1 slots=1\nmlxcluster-rank-1 slots=1\nmlxcluster-rank-2 slots=1\n"
    nodes = json.loads((tmp_path / "mpi_nodes.json").read_text())
    assert nodes["hosts"]["mlxcluster-rank-2"] == {"node_id": "c", "endpoint": "10.0.0.2:50052"}
    opts = {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv[:-2]) if a == "--mca"}
    assert opts["plm_rsh_agent"] == f"/venv/bin/python -m mlxcluster.runtime.mpi_agent --nodes {tmp_path}/mpi_nodes.json"
    assert opts["orte_leave_session_attached"] == "1" and opts["plm_rsh_no_tree_spawn"] == "1"
    assert "-x" not in argv and argv[argv.index("--") + 1:] == ["python3", "-m", "mlxcluster.runtime.rank"]


@pytest.fixture
def member(tmp_path, monkeypatch):
    """A node daemon bootstrapped as rank 1 of a 2-rank MPI formation (waiting for mpirun);
    its planner only waits (no peer is live here, which would otherwise tear it down), and it does
    not announce itself over mDNS (nothing here browses; zeroconf's probing took ~2 s of the start)."""
    import mlxcluster.cluster.node as node_mod
    from mlxcluster.cluster.plan import Wait

    monkeypatch.setattr(node_mod, "plan", lambda inputs: Wait("test: holding the formation"))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(64))
    d = NodeDaemon(NodeConfig(cluster="mpi-test", address="127.0.0.1", interfaces=["127.0.0.1"], node_id="node-b",
                              model_path=str(model), world_size=3, valid_world_sizes=[3], secret=SECRET))
    monkeypatch.setattr(d.discovery, "start", lambda: None)
    t = threading.Thread(target=d.run, daemon=True)
    t.start()
    req = pb.BootstrapRequest(
        protocol_version=PROTOCOL_VERSION, formation_id="form-1", coordinator_id="node-a",
        rank=1, world_size=2, backend="mpi", model_digest=d.info.model_digest,
        endpoints=[pb.RankEndpointMsg(rank=0, node_id="node-a", address="127.0.0.1", ring_port=1, control_port=2),
                   pb.RankEndpointMsg(rank=1, node_id="node-b", address="127.0.0.1", ring_port=3, control_port=4)])
    reply = d.call(lambda: d.bootstrap(req), 10)
    assert reply.ok, reply.error
    assert isinstance(d.own, Bootstrapping) and d._ranks is None  # no process: mpirun starts it
    yield d
    d.stop()
    t.join(10)


@pytest.mark.skipif(shutil.which("orted") is None, reason="OpenMPI's orted is not installed")
def test_node_exec_runs_only_orted_for_its_formation_and_relays_output_and_status(member):
    endpoint = f"127.0.0.1:{member.cfg.port}"
    creds = credentials(SECRET, "mpi-test")
    # not orted: refused before anything runs
    with pytest.raises(grpc.RpcError) as err:
        mpi_agent.run_remote(endpoint, "node-b", "form-1", ["sh", "-c", "id"], creds)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "only OpenMPI's orted" in err.value.details()
    # another formation: refused
    with pytest.raises(grpc.RpcError) as err:
        mpi_agent.run_remote(endpoint, "node-b", "form-2", [" orted", "--help"], creds)
    assert "holds no starting rank of formation form-2" in err.value.details()
    # another secret: the handshake fails, no handler runs
    with pytest.raises(grpc.RpcError) as err:
        mpi_agent.run_remote(endpoint, "node-b", "form-1", [" orted", "--help"], credentials("other-secret-0123", "mpi-test"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # orted itself: its output and exit status come back; the node's rank then counts as failed
    out, errb = io.BytesIO(), io.BytesIO()
    code = mpi_agent.run_remote(endpoint, "node-b", "form-1", [" orted", "--help"], creds, out=out, err=errb)
    assert b"Usage: " in out.getvalue() + errb.getvalue()
    expected = subprocess.run(["orted", "--help"], capture_output=True, timeout=30).returncode
    assert code == expected
    until(lambda: isinstance(member.own, Failed), 10, lambda: member.own)
    assert f"orted exited with code {expected}" in member.own.error


def test_agent_main_reports_an_unknown_host_in_one_line(tmp_path, capsys):
    nodes = tmp_path / "nodes.json"
    nodes.write_text(json.dumps({"formation_id": "f", "cluster": "c", "hosts": {}}))
    code = mpi_agent.main(["--nodes", str(nodes), "mlxcluster-rank-1", "orted"], env={"MLXCLUSTER_SECRET": SECRET})
    assert code == 255
    err = capsys.readouterr().err.strip()
    assert err == f"mlxcluster mpi agent: no node for host 'mlxcluster-rank-1' in {nodes}"

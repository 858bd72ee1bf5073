"""mlxcluster.runtime.backends: MLX's ring / jaccl / MPI configs, checked against mlx.launch."""

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

from mlxcluster.runtime import backends as bk
from mlxcluster.runtime.backends import RankEndpoint

launch = pytest.importorskip("mlx._distributed_utils.launch")
common = pytest.importorskip("mlx._distributed_utils.common")

ALL_SUM_SCRIPT = textwrap.dedent("""
    import json, sys
    import mlx.core as mx
    g = mx.distributed.init(backend=sys.argv[1], strict=True)
    x = mx.distributed.all_sum(mx.array([float(g.rank() + 1), 1.0]), group=g)
    mx.eval(x)
    print("RESULT " + json.dumps({"rank": g.rank(), "size": g.size(), "sum": x.tolist()}), flush=True)
""")


def eps(n, ips=None, port=32323, **kw):
    ips = ips or [f"10.0.0.{i + 1}" for i in range(n)]
    return [RankEndpoint(rank=i, address=ips[i], ring_port=port + i, control_port=40000 + i,
                         hostname=f"node{i}", **kw) for i in range(n)]


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def mlx_launch_args(port=32323):
    return argparse.Namespace(starting_port=port, connections_per_ip=1, env=[], verbose=False,
                              cwd=None, python=None, backend="jaccl", mpi_arg=[])


def capture_launch(monkeypatch):
    """Replace mlx.launch's process starter; return the list its calls are recorded in."""
    calls = []
    monkeypatch.setattr(launch, "_launch_with_io", lambda cls, arguments, verbose: calls.append(arguments))
    return calls


def results(*outputs):
    """The ``RESULT {...}`` objects in the ranks' output (lines of several ranks may interleave)."""
    rows = [json.loads(m) for text in outputs for m in re.findall(r"RESULT (\{[^}]*\})", text)]
    return sorted(rows, key=lambda r: r["rank"])


# -- ring -------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_hostfile_matches_mlx_launch(monkeypatch, n):
    ips = [f"192.168.1.{i + 10}" for i in range(n)]
    calls = capture_launch(monkeypatch)
    hosts = [common.Host(i, f"node{i}", [ip], []) for i, ip in enumerate(ips)]
    launch.launch_ring(None, hosts, mlx_launch_args(5000), ["python", "x.py"])
    files = calls[0][0][0][4]
    ours = bk.ring_hostfile(reversed(eps(n, ips, port=5000)))  # order of input must not matter
    assert json.dumps(ours) == files["MLX_HOSTFILE"]
    assert json.loads(json.dumps(ours)) == ours == [[f"{ip}:{5000 + i}"] for i, ip in enumerate(ips)]


@pytest.mark.parametrize("mutate, match", [
    (lambda e: setattr(e[1], "rank", 0), "duplicate rank"),
    (lambda e: setattr(e[1], "rank", 5), "without gaps"),
    (lambda e: setattr(e[0], "rank", -1), "without gaps"),
    (lambda e: setattr(e[0], "rank", "0"), "integer"),
    (lambda e: setattr(e[1], "ring_port", 0), "ring_port"),
    (lambda e: setattr(e[1], "ring_port", 70000), "ring_port"),
    (lambda e: setattr(e[0], "control_port", -3), "control_port"),
    (lambda e: setattr(e[1], "address", "node1.local"), "IPv4"),
    (lambda e: setattr(e[1], "address", "::1"), "IPv4"),
    (lambda e: (setattr(e[1], "address", e[0].address), setattr(e[1], "ring_port", e[0].ring_port)),
     "both use"),
])
def test_ring_hostfile_rejects_bad_endpoints(mutate, match):
    e = eps(3)
    mutate(e)
    with pytest.raises(ValueError, match=match):
        bk.ring_hostfile(e)


def test_ring_hostfile_needs_two_ranks_and_env():
    with pytest.raises(ValueError, match="at least 2"):
        bk.ring_hostfile(eps(1))
    with pytest.raises(ValueError, match="no rank endpoints"):
        bk.ring_hostfile([])
    assert bk.ring_environment(1, "/tmp/h.json") == {"MLX_RANK": "1", "MLX_HOSTFILE": "/tmp/h.json"}
    with pytest.raises(ValueError):
        bk.ring_environment(-1, "/tmp/h.json")


def test_ring_backend_really_connects(tmp_path):
    ports = free_ports(2)
    endpoints = [RankEndpoint(rank=i, address="127.0.0.1", ring_port=p, control_port=1 + i)
                 for i, p in enumerate(ports)]
    script = tmp_path / "all_sum.py"
    script.write_text(ALL_SUM_SCRIPT)
    procs = []
    try:
        for rank in range(2):
            env = dict(os.environ)
            env.update(bk.write_backend_files("ring", endpoints, rank, str(tmp_path / "cfg")))
            procs.append(subprocess.Popen([sys.executable, str(script), "ring"], env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outputs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert json.loads((tmp_path / "cfg" / bk.RING_HOSTFILE_NAME).read_text()) == \
        [[f"127.0.0.1:{p}"] for p in ports]
    assert results(*outputs) == [{"rank": r, "size": 2, "sum": [3.0, 2.0]} for r in range(2)]


# -- jaccl ------------------------------------------------------------------------------------

def jaccl_eps(n):
    e = eps(n)
    for ep in e:
        ep.rdma_devices = {j: f"rdma_en{2 + (ep.rank + j) % 5}" for j in range(n) if j != ep.rank}
        ep.backends = ["ring", "jaccl"]
    return e


@pytest.mark.parametrize("n", [2, 3])
def test_jaccl_matrix_and_env_match_mlx_launch(monkeypatch, tmp_path, n):
    e = jaccl_eps(n)
    matrix = bk.jaccl_devices(e)
    assert len(matrix) == n and all(len(row) == n for row in matrix)
    for i in range(n):
        for j in range(n):
            assert matrix[i][j] == (None if i == j else e[i].rdma_devices[j])
    # mlx.launch on a hostfile holding the same matrix writes the same file and coordinator.
    calls = capture_launch(monkeypatch)
    hosts = [common.Host(i, f"node{i}", [ep.address], matrix[i]) for i, ep in enumerate(e)]
    launch.launch_jaccl(argparse.ArgumentParser(), hosts, mlx_launch_args(32323), ["python", "x.py"])
    (_, _, _, _, files, env, _), _ = calls[0][0]
    assert json.dumps(matrix) == files["MLX_IBV_DEVICES"]
    ours = bk.write_backend_files("jaccl", e, n - 1, str(tmp_path))
    path = str(tmp_path / bk.JACCL_DEVICES_NAME)
    assert ours == {"MLX_RANK": str(n - 1), "MLX_IBV_DEVICES": path,
                    "MLX_JACCL_COORDINATOR": "10.0.0.1:32323"}
    assert f"MLX_JACCL_COORDINATOR={ours['MLX_JACCL_COORDINATOR']}" in env
    with open(path) as f:
        assert json.load(f) == matrix
    assert bk.write_backend_files("jaccl", e, 0, str(tmp_path), coordinator_port=5555)[
        "MLX_JACCL_COORDINATOR"] == "10.0.0.1:5555"


def test_jaccl_accepts_string_keys_and_link_lists():
    e = jaccl_eps(2)
    e[0].rdma_devices = {"1": ["rdma_en2", "rdma_en3"]}
    assert bk.jaccl_devices(e) == [[None, ["rdma_en2", "rdma_en3"]], [e[1].rdma_devices[0], None]]
    back = RankEndpoint.from_dict(json.loads(json.dumps(e[1].to_dict())))
    assert back == e[1]


def test_jaccl_missing_device_names_the_pair():
    e = jaccl_eps(3)
    del e[2].rdma_devices[0]
    with pytest.raises(ValueError, match=r"from rank 2 \(node2\) to rank 0 \(node0\)"):
        bk.jaccl_devices(e)
    e = jaccl_eps(3)
    e[1].rdma_devices = None
    with pytest.raises(ValueError, match=r"from rank 1 \(node1\) to rank 0 \(node0\), from rank 1"):
        bk.jaccl_devices(e)
    e = jaccl_eps(2)
    e[0].rdma_devices[0] = "rdma_en9"
    with pytest.raises(ValueError, match="itself"):
        bk.jaccl_devices(e)
    e[0].rdma_devices = {1: "rdma_en2", 4: "rdma_en3"}
    with pytest.raises(ValueError, match="outside"):
        bk.jaccl_devices(e)


def test_jaccl_environment_validation():
    env = bk.jaccl_environment(2, "/d.json", "10.0.0.1:4000")
    assert env == {"MLX_RANK": "2", "MLX_IBV_DEVICES": "/d.json", "MLX_JACCL_COORDINATOR": "10.0.0.1:4000"}
    for bad in ("10.0.0.1", "host:4000", "10.0.0.1:0", "10.0.0.1:x"):
        with pytest.raises(ValueError):
            bk.jaccl_environment(0, "/d.json", bad)


# -- MPI --------------------------------------------------------------------------------------

def test_mpi_hostfile_matches_mlx_launch(monkeypatch):
    e = eps(4, ips=["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.3"])
    seen = {}

    def fake_run(cmd, *args, **kwargs):
        if cmd[:1] == ["which"]:
            if cmd[1] != "mpirun":
                raise subprocess.CalledProcessError(1, cmd)
            return subprocess.CompletedProcess(cmd, 0, b"/usr/bin/mpirun\n", b"")
        seen["cmd"] = cmd
        with open(cmd[cmd.index("--hostfile") + 1]) as f:
            seen["hostfile"] = f.read()
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(launch, "run", fake_run)
    hosts = [common.Host(ep.rank, ep.address, [ep.address], []) for ep in e]
    args = mlx_launch_args()
    args.env = ["FOO=1"]
    launch.launch_mpi(None, hosts, args, ["python", "x.py"])
    text = bk.mpi_hostfile(e)
    assert text == seen["hostfile"] == "10.0.0.1 slots=2\n10.0.0.2 slots=1\n10.0.0.3 slots=1\n"
    assert bk.mpi_hostfile(e, slots=2, use_hostnames=True).splitlines()[0] == "node0 slots=2"

    cmd = bk.mpirun_command("/tmp/hf", 4, ["python", "x.py"], ["FOO=1", "PATH"], mpirun="/usr/bin/mpirun")
    assert cmd == ["/usr/bin/mpirun", "--hostfile", "/tmp/hf", "-np", "4", "--bind-to", "none",
                   "-x", "FOO=1", "-x", "PATH", "--", "python", "x.py"]
    # mlx.launch's own command: same flags apart from --output :raw (OpenMPI 5 only) and --bind-to.
    mlx_cmd = seen["cmd"]
    assert mlx_cmd[mlx_cmd.index("--"):] == cmd[cmd.index("--"):]
    assert mlx_cmd[mlx_cmd.index("-x"):mlx_cmd.index("-x") + 2] == ["-x", "FOO=1"]


def test_mpi_validation():
    e = eps(3, ips=["10.0.0.1", "10.0.0.2", "10.0.0.1"])
    with pytest.raises(ValueError, match="not contiguous"):
        bk.mpi_hostfile(e)
    with pytest.raises(ValueError, match="slots"):
        bk.mpi_hostfile(eps(2), slots=0)
    with pytest.raises(ValueError):
        bk.mpirun_command("/h", 0, ["x"])
    with pytest.raises(ValueError):
        bk.mpirun_command("/h", 2, [])
    with pytest.raises(ValueError, match="invalid environment"):
        bk.mpirun_command("/h", 2, ["x"], ["BAD NAME=1"])


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="OpenMPI mpirun not installed")
def test_mpirun_really_runs_all_sum(tmp_path):
    endpoints = [RankEndpoint(rank=i, address="127.0.0.1", ring_port=30000 + i, control_port=31000 + i,
                              hostname="localhost", backends=bk.local_backends()) for i in range(2)]
    assert bk.choose_backend("auto", endpoints, mpirun_launch=True) == "mpi"
    lib_env = bk.write_backend_files("mpi", endpoints, 0, str(tmp_path))
    assert (tmp_path / bk.MPI_HOSTFILE_NAME).read_text() == "127.0.0.1 slots=2\n"
    hostfile = tmp_path / "localhost_hostfile"
    hostfile.write_text(bk.mpi_hostfile(endpoints, use_hostnames=True))
    assert hostfile.read_text() == "localhost slots=2\n"
    script = tmp_path / "all_sum.py"
    script.write_text(ALL_SUM_SCRIPT)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = bk.mpirun_command(str(hostfile), 2, [sys.executable, str(script), "mpi"],
                            [f"{k}={v}" for k, v in lib_env.items()], mpirun=shutil.which("mpirun"),
                            extra_args=["--oversubscribe"])
    proc = subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 0, out
    assert results(out) == [{"rank": r, "size": 2, "sum": [3.0, 2.0]} for r in range(2)]


# -- choice and local capabilities -----------------------------------------------------------

def test_choose_backend_rules():
    e = eps(3)  # default backends: ["ring"]
    assert bk.choose_backend("auto", e) == "ring"
    assert bk.choose_backend("ring", e) == "ring"
    e[1].backends = ["ring", "mpi"]
    with pytest.raises(ValueError) as info:
        bk.choose_backend("mpi", e)
    msg = str(info.value)
    assert "\n" not in msg and "rank 0 (node0)" in msg and "rank 2 (node2)" in msg and "node1" not in msg
    with pytest.raises(ValueError, match="unknown backend"):
        bk.choose_backend("nccl", e)

    j = jaccl_eps(3)
    assert bk.choose_backend("auto", j) == "jaccl"
    assert bk.choose_backend("jaccl", j) == "jaccl"
    del j[0].rdma_devices[2]
    assert bk.choose_backend("auto", j) == "ring"  # incomplete mesh -> ring
    with pytest.raises(ValueError, match=r"rank 0 \(node0\) to rank 2 \(node2\)"):
        bk.choose_backend("jaccl", j)
    j = jaccl_eps(3)
    j[2].backends = ["ring"]
    assert bk.choose_backend("auto", j) == "ring"
    with pytest.raises(ValueError, match=r"'jaccl' is not available on rank 2 \(node2\)$"):
        bk.choose_backend("jaccl", j)

    # MPI: never automatic across machines; on one machine only when mpirun starts the ranks.
    m = eps(2, ips=["10.0.0.1", "10.0.0.2"], backends=["ring", "mpi"])
    assert bk.choose_backend("auto", m, mpirun_launch=True) == "ring"
    assert bk.choose_backend("mpi", m) == "mpi"
    local = eps(2, ips=["127.0.0.1", "127.0.0.1"], backends=["ring", "mpi"])
    assert bk.choose_backend("auto", local, mpirun_launch=True) == "mpi"
    assert bk.choose_backend("auto", local) == "ring"
    assert bk.choose_backend("auto", eps(1)) == "ring"


def test_write_backend_files_edge_cases(tmp_path):
    assert bk.write_backend_files("ring", eps(1), 0, str(tmp_path / "one")) == {}
    assert not (tmp_path / "one").exists()
    with pytest.raises(ValueError, match="rank"):
        bk.write_backend_files("ring", eps(2), 2, str(tmp_path))
    with pytest.raises(ValueError, match="unknown backend"):
        bk.write_backend_files("auto", eps(2), 0, str(tmp_path))
    env = bk.write_backend_files("ring", eps(2), 1, str(tmp_path / "new" / "dir"))
    assert env["MLX_RANK"] == "1" and os.path.isfile(env["MLX_HOSTFILE"])


def test_local_backends_on_this_machine():
    found = bk.local_backends()
    assert found[0] == "ring"
    assert ("mpi" in found) == (shutil.which("mpirun") is not None and shutil.which("orted") is not None
                                and bk.mpi_usable()[0])
    if sys.platform != "darwin":
        assert "jaccl" not in found
        assert bk.local_rdma_devices() == []


def test_mpi_is_listed_only_where_join_can_run_it(monkeypatch):
    """A node lists "mpi" (and `join --backend auto` may pick it) only when mpirun and orted
    are installed and MLX loads their libmpi -- not merely because mpirun is on PATH."""
    real_which = shutil.which
    if not (real_which("mpirun") and real_which("orted")):
        pytest.skip("OpenMPI is not installed here")
    assert bk.mpi_usable()[0] and "mpi" in bk.local_backends()
    monkeypatch.setattr(bk, "mpi_library_environment", lambda mpirun=None: {"MLX_MPI_LIBNAME": "libmpi-absent.so.99"})
    monkeypatch.delenv("MLX_MPI_LIBNAME", raising=False)
    ok, why = bk.mpi_usable()
    assert not ok and why == "MLX cannot load OpenMPI's libmpi (libmpi-absent.so.99)"
    assert "mpi" not in bk.local_backends()
    monkeypatch.undo()
    monkeypatch.setattr(bk.shutil, "which", lambda name, *a, **k: None if name == "orted" else real_which(name, *a, **k))
    assert bk.mpi_usable() == (False, "OpenMPI's orted not on PATH")
    assert "mpi" not in bk.local_backends()




# -- OpenMPI 5 (issue 43, item 6) --------------------------------------------------------------------

MACOS_DATA = os.path.join(os.path.dirname(__file__), "data", "macos")


def _recorded(name: str) -> str:
    with open(os.path.join(MACOS_DATA, name), encoding="utf-8") as fh:
        return fh.read()


def test_openmpi_version_reads_both_generations():
    assert bk.openmpi_version(_recorded("mpirun_version_4.txt")) == (4, 1, 6)
    assert bk.openmpi_version(_recorded("mpirun_version_5.txt")) == (5, 0, 5)
    assert bk.openmpi_version("HYDRA build details:\n    Version: 4.0.2\n") is None
    assert bk.openmpi_refusal((4, 1, 6), "Darwin") == ""
    line = bk.openmpi_refusal((5, 0, 5), "Darwin")
    assert "\n" not in line and "OpenMPI 5.0.5" in line and "no orted" in line
    assert 'conda install -c conda-forge "openmpi=4.1"' in line and "--backend ring or jaccl" in line
    assert "apt-get install openmpi-bin" in bk.openmpi_refusal((5, 0, 1), "Linux")


def _fake_openmpi(monkeypatch, recording: str):
    """This machine with mpirun and orted on PATH, ``mpirun --version`` printing ``recording`` and MLX
    able to load libmpi (the child's answer ``True``)."""
    text = _recorded(recording)
    monkeypatch.setattr(bk.shutil, "which", lambda name, *a, **k: f"/opt/ompi/bin/{name}"
                        if name in ("mpirun", "orted", "ompi_info") else None)
    monkeypatch.setattr(bk, "mpi_library_environment", lambda mpirun=None: {})

    def run(cmd, **kw):
        if cmd[-1] == "--version":
            return subprocess.CompletedProcess(cmd, 0, text, "")
        return subprocess.CompletedProcess(cmd, 0, "True\n", "")  # the child asking MLX for mpi

    monkeypatch.setattr(bk.subprocess, "run", run)


def test_openmpi_5_is_refused_and_auto_falls_to_the_ring(monkeypatch):
    from mlxcluster.cluster import ranks
    from mlxcluster.runtime.thunderbolt import local_rdma_facts

    _fake_openmpi(monkeypatch, "mpirun_version_4.txt")
    assert bk.mpi_usable() == (True, "OpenMPI installed and loadable by MLX")
    _fake_openmpi(monkeypatch, "mpirun_version_5.txt")
    ok, why = bk.mpi_usable()
    assert not ok and why == bk.openmpi_refusal((5, 0, 5))
    monkeypatch.setattr(bk, "local_rdma_devices", lambda: [])
    found = bk.local_backends()
    assert "mpi" not in found
    eps = [RankEndpoint(rank=r, address=f"10.0.0.{r + 1}", ring_port=5000 + r, control_port=6000 + r,
                        hostname=f"mac{r}", backends=list(found) if r else ["ring", "mpi"]) for r in range(2)]
    facts = [local_rdma_facts(system="Linux")] * 2
    backend, reason, _ = ranks.pick_backend("auto", eps, facts)
    assert backend == "ring" and "no usable OpenMPI on rank 1 (mac1)" in reason
    with pytest.raises(ValueError, match="not available on rank 1"):
        ranks.pick_backend("mpi", eps, facts)

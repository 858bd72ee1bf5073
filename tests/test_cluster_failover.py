"""Lossless failover on a `join` cluster (issue 29): nodes in network namespaces, `serve --cluster` in
front of them, the chaos workload of tests/chaos_load.py.

Four hosts on one bridge (network namespaces), each running `mlxcluster join --world-size 3` (the
default backend: MPI here); host-3 is `--spare`, so the formation is hosts 0-2.  `serve --cluster`
runs in this (the root) namespace on a veth onto the same bridge (:func:`benchmarks.netns.root_link`)
and serves 4 clients streaming greedy chat completions over loopback.  Each fault kind once, while the
answers stream: a node holding a rank is SIGKILLed (the whole node: daemon, rank, orted; restarted 10 s
later, as a machine that reboots), then -- once the re-formed cluster streams and the lost node is back,
idle -- another is SIGSTOPped for 10 s.  Each time the cluster re-forms with the spare (the lost node
comes back idle), serve's healer finds the new rank 0 over mDNS and every request in flight is replayed
there: 0 failed, every answer its fault-free one.  The long runs (a fault every 20-60 s for minutes):
``benchmarks/bench_failover.py --target spare``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from chaos_load import ChaosCluster, check_chaos, run_chaos
from test_cluster import SECRET, _env

pytestmark = pytest.mark.slow

#: the first fault comes as soon as generate --cluster streamed its first text: the answer has most of
#: its tokens to go (the check below sees it resume)
GENERATE_TOKENS = 24


@pytest.fixture
def four_hosts_and_root():
    from benchmarks.netns import NetnsError, bridged_hosts, root_link

    try:
        with bridged_hosts(4) as hosts, root_link(hosts) as (_if, root_ip):
            yield hosts, root_ip
    except NetnsError as exc:
        pytest.skip(str(exc))


def _generate_cli(target, *args):
    cmd = [sys.executable, "-m", "mlxcluster", "generate", "Tell me a story about a lighthouse.", "--chat",
           "--cluster", target.cluster, "--interface", target.root_ip, "--max-tokens", str(GENERATE_TOKENS), *args]
    return cmd, _env({"MLXCLUSTER_SECRET": SECRET})


def test_chaos_serve_cluster_with_a_spare_loses_no_request(tmp_path, four_hosts_and_root):
    """The chaos run (a kill, then a freeze), plus `generate --cluster` hit by the first fault
    mid-answer: it resumes on the re-formed cluster and prints exactly the fault-free answer."""
    from chaos_load import Streaming

    from mlxcluster.cluster.client import cluster_status

    hosts, root_ip = four_hosts_and_root
    target = ChaosCluster(tmp_path, hosts, root_ip)
    cmd, env = _generate_cli(target, "--json")
    # the fault-free answer, asked while serve's own fault-free answers are asked
    unfaulted = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 stdin=subprocess.DEVNULL)
    out_path, err_path = tmp_path / "generate.out", tmp_path / "generate.err"
    running, reference = [], []
    streaming = Streaming(target)

    def generate_under_way():
        """generate --cluster streams its answer (started once the fault-free one is done): the first
        fault hits it mid-answer."""
        if unfaulted.poll() is None:
            return False
        if not running:
            cmd, env = _generate_cli(target)
            running.append(subprocess.Popen(cmd, env=env, stdout=open(out_path, "w"), stderr=open(err_path, "w"),
                                            stdin=subprocess.DEVNULL))
        return out_path.stat().st_size > 0 or running[0].poll() is not None

    def spare_back():
        """The killed node rebooted and waits, idle: the next fault finds a spare, as the first did."""
        try:
            status = cluster_status(target.cluster, [root_ip], timeout_s=2.0, creds=target.creds)
        except (ValueError, OSError):
            return False
        return any(n.get("state") == "idle" for n in status)

    def ready(n):
        return (generate_under_way() if n == 0 else spare_back()) and streaming(n)

    def before_fault(n):
        if n == 0:
            stdout, stderr = unfaulted.communicate(timeout=300)
            assert unfaulted.returncode == 0, stderr
            reference.append(json.loads(stdout)["text"])

    out = run_chaos(target, 0.0, period_s=0.0, stop_s=10.0, seed=4, before_fault=before_fault, n_faults=2,
                    ready=ready)
    check_chaos(out, "cluster chaos")
    assert [kind for _, _, kind in out["faults"]] == ["SIGKILL", "SIGSTOP"], out["faults"]
    failover = out["state"]["failover"]
    # each fault made serve's healer find the re-formed cluster and replay the answers in flight there
    assert failover["reformations"] >= 2 and failover["replays"] >= 2, failover
    assert running[0].wait(300) == 0, err_path.read_text()
    assert out_path.read_text() == reference[0] + "\n", err_path.read_text()
    assert "resuming on the re-formed cluster" in err_path.read_text()

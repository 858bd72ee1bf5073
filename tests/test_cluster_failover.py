"""Lossless failover on a `join` cluster (issue 29): nodes in network namespaces, `serve --cluster` in
front of them, the chaos workload of tests/chaos_load.py.

Four hosts on one bridge (network namespaces), each running `mlxcluster join --world-size 3` (the
default backend: MPI here); host-3 is `--spare`, so the formation is hosts 0-2.  `serve --cluster`
runs in this (the root) namespace on a veth onto the same bridge (:func:`benchmarks.netns.root_link`)
and serves 4 clients streaming greedy chat completions over loopback.  Every 20 s (once the cluster
serves again) a node holding a rank is SIGKILLed (the whole node: daemon, rank, orted; restarted 10 s
later, as a machine that reboots) or SIGSTOPped for 10 s, alternating.  The cluster re-forms with the spare (the lost node
comes back idle), serve's healer finds the new rank 0 over mDNS and every request in flight is
replayed there: 0 failed, every answer its fault-free one.  ``MLXCLUSTER_CLUSTER_CHAOS_S`` sets the
length (default 45 s: one fault of each kind; the benchmark, ``bench_failover``, runs the long ones).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from chaos_load import ChaosCluster, check_chaos, run_chaos
from harness import until
from test_cluster import SECRET, _env

pytestmark = pytest.mark.slow

CHAOS_S = float(os.environ.get("MLXCLUSTER_CLUSTER_CHAOS_S", "45"))
GENERATE_TOKENS = 80  # long enough to be under way when the fault hits it


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
    """The chaos run, plus `generate --cluster` hit by the first fault mid-answer: it resumes on the
    re-formed cluster and prints exactly the fault-free answer."""
    hosts, root_ip = four_hosts_and_root
    target = ChaosCluster(tmp_path, hosts, root_ip)
    cmd, env = _generate_cli(target, "--json")
    reference = json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300).stdout)["text"]
    out_path, err_path = tmp_path / "generate.out", tmp_path / "generate.err"
    running = []

    def before_fault(n):
        if n == 0:  # a streamed answer under way when the first fault hits
            cmd, env = _generate_cli(target)
            running.append(subprocess.Popen(cmd, env=env, stdout=open(out_path, "w"), stderr=open(err_path, "w"),
                                            stdin=subprocess.DEVNULL))
            until(lambda: out_path.stat().st_size > 0 or running[0].poll() is not None, 120,
                  "generate --cluster to stream its first text")

    out = run_chaos(target, CHAOS_S, period_s=20.0, stop_s=10.0, seed=4, before_fault=before_fault)
    check_chaos(out, "cluster chaos")
    assert {kind for _, _, kind in out["faults"]} == {"SIGKILL", "SIGSTOP"}, out["faults"]
    assert running[0].wait(300) == 0, err_path.read_text()
    assert out_path.read_text() == reference + "\n", err_path.read_text()
    assert "resuming on the re-formed cluster" in err_path.read_text()

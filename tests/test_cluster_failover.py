"""Lossless failover on a `join` cluster (issue 29): nodes in network namespaces, `serve --cluster` in
front of them, the chaos workload of tests/chaos_load.py.

Four hosts on one bridge (network namespaces), each running `mlxcluster join --world-size 3` (the
default backend: MPI here); host-3 is `--spare`, so the formation is hosts 0-2.  `serve --cluster`
runs in this (the root) namespace on a veth onto the same bridge (:func:`benchmarks.netns.root_link`)
and serves 4 clients streaming greedy chat completions over loopback.  Every 30 s a node holding a
rank is SIGKILLed (the whole node: daemon, rank, orted; restarted 20 s later, as a machine that
reboots) or SIGSTOPped for 20 s, alternating.  The cluster re-forms with the spare (the lost node
comes back idle), serve's healer finds the new rank 0 over mDNS and every request in flight is
replayed there: 0 failed, every answer its fault-free one.  ``MLXCLUSTER_CLUSTER_CHAOS_S`` sets the
length (default 65 s: one fault of each kind).
"""

from __future__ import annotations

import os

import pytest

from chaos_load import ChaosCluster, check_chaos, run_chaos

pytestmark = pytest.mark.slow

CHAOS_S = float(os.environ.get("MLXCLUSTER_CLUSTER_CHAOS_S", "65"))


@pytest.fixture
def four_hosts_and_root():
    from benchmarks.netns import NetnsError, bridged_hosts, root_link

    try:
        with bridged_hosts(4) as hosts, root_link(hosts) as (_if, root_ip):
            yield hosts, root_ip
    except NetnsError as exc:
        pytest.skip(str(exc))


def test_chaos_serve_cluster_with_a_spare_loses_no_request(tmp_path, four_hosts_and_root):
    hosts, root_ip = four_hosts_and_root
    target = ChaosCluster(tmp_path, hosts, root_ip)
    out = run_chaos(target, CHAOS_S, period_s=30.0, stop_s=20.0, seed=4)
    check_chaos(out, "cluster chaos")

"""``mlxcluster doctor --cluster NAME``: this node's checks (:mod:`mlxcluster.runtime.doctor`) toward
every node of the cluster, plus what the nodes advertise compared across them.

The nodes' own tool outputs are not fetched over the ``Node`` service (no RPC carries them yet):
across nodes doctor compares what every node already advertises over mDNS and ``Status`` -- its
protocol version, platform and usable backends, and whether it answers -- and the reports of other
nodes the user saved with ``mlxcluster doctor --json`` on each of them (``--facts FILE``: the MLX
and macOS versions, the MTU at both ends of each Thunderbolt cable)."""

from __future__ import annotations

import ipaddress
from typing import Dict, List, Optional, Sequence, Tuple

from ..runtime.doctor import ERROR, WARNING, Finding, NodeReport, doctor_local
from .discovery import PROTOCOL_VERSION, _local_ipv4

__all__ = ["check_advertised", "doctor_cluster"]


def check_advertised(rows: Sequence[Dict]) -> List[Finding]:
    """Compare what the nodes advertise (rows of :func:`mlxcluster.cluster.client.cluster_status`).

    * a node that does not answer ``Status`` (with the secret): error (unreachable, or a TLS
      handshake that fails: another secret);
    * protocol versions that differ from this code's :data:`PROTOCOL_VERSION`: error (the nodes do not
      form a group);
    * Macs and Linux machines mixed: a warning (jaccl needs every node on macOS; ring and MPI work);
    * a backend some nodes have and others lack (e.g. ``mpi`` without OpenMPI): a warning naming them.
    """
    out: List[Finding] = []
    for r in rows:
        if r.get("state") == "unreachable":
            out.append(Finding(ERROR, f"node {r['node_id']} at {r['address']} does not answer: {r.get('error', '')}"[:200],
                               "mlxcluster status --cluster NAME   # same secret on every node? the node's port open?",
                               "every node must answer Status over mutual TLS", "advertised", r["node_id"]))
        if int(r.get("version", PROTOCOL_VERSION)) != PROTOCOL_VERSION:
            out.append(Finding(ERROR, f"node {r['node_id']} speaks node protocol {r.get('version')}, this code "
                                      f"{PROTOCOL_VERSION}", "pip install --upgrade mlxcluster   # the same version "
                                      "on every node", "nodes of different protocol versions never form a group",
                               "advertised", r["node_id"]))
    systems = {str(r.get("platform", "")).split("-")[0] for r in rows if r.get("platform")}
    if "Darwin" in systems and len(systems) > 1:
        out.append(Finding(WARNING, "Macs and other machines in one cluster: " + ", ".join(
            f"{r['node_id']} {r.get('platform', '?')}" for r in rows), "",
            "jaccl needs every node on macOS with Thunderbolt 5; ring and mpi still work", "advertised"))
    everywhere = set.intersection(*(set(r.get("backends") or []) for r in rows)) if rows else set()
    for backend in sorted({b for r in rows for b in r.get("backends") or []} - everywhere):
        lacking = [r["node_id"] for r in rows if backend not in (r.get("backends") or [])]
        fix = {"mpi": "sudo apt-get install openmpi-bin libopenmpi-dev   # OpenMPI 4.1; on a Mac: conda install -c conda-forge "
                       "'openmpi=4.1' (Homebrew's open-mpi is 5.x, which has no orted)",
               "jaccl": "mlxcluster doctor   # on each of them: RDMA, Thunderbolt 5, bridge0"}.get(backend, "")
        out.append(Finding(WARNING, f"backend {backend} is unusable on {', '.join(lacking)}: the cluster cannot use it",
                           fix, "a backend runs only where every member has it (backends.choose_backend)",
                           "advertised"))
    return out


def doctor_cluster(cluster: str, interfaces: Sequence[str] = (), timeout_s: float = 3.0, creds=None,
                   others: Sequence[NodeReport] = (), name: Optional[str] = None
                   ) -> Tuple[NodeReport, List[Finding], List[Dict]]:
    """Find the nodes of ``cluster`` over mDNS (their ``Status`` with ``creds``), then run this
    node's checks toward every other node's address, the checks across this node and ``others``,
    and :func:`check_advertised` over the rows.

    Returns:
        ``(this node's report, findings, the nodes' rows)``.
    Raises:
        ValueError: an unknown interface; LookupError: no node of the cluster found.
    """
    from .client import cluster_status

    rows = cluster_status(cluster, interfaces, timeout_s, creds)
    if not rows:
        import platform

        hint = ("; on macOS the Local Network permission or the firewall is the usual cause (exo #1035): "
                "mlxcluster doctor checks both") if platform.system() == "Darwin" else ""
        raise LookupError(f"no nodes of cluster {cluster!r} found{hint}")
    local = {ip for _, ip in _local_ipv4()}
    peers, mine = [], ""
    for r in rows:
        host = str(r["address"]).rsplit(":", 1)[0]
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            continue
        if host in local:
            mine = mine or r["node_id"]
        elif host not in peers:
            peers.append(host)
    import socket

    report, findings = doctor_local(name or mine or socket.gethostname(), peers, others)
    return report, findings + check_advertised(rows), rows

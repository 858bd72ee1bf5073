"""Clients of a formed cluster: find its nodes over mDNS and ask them for status."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import grpc

from ..protocol import mlxcluster_pb2 as pb
from ..protocol import mlxcluster_pb2_grpc as pb_grpc
from .discovery import NodeInfo, browse, resolve_interfaces

__all__ = ["ClusterLookupError", "cluster_status", "find_rank0", "node_status"]


class ClusterLookupError(RuntimeError):
    """No node of the cluster was found, or none has a formed group."""


def node_status(info: NodeInfo, timeout_s: float = 2.0) -> pb.NodeStatusReply:
    """``Status`` of one node (raises ``grpc.RpcError`` when unreachable)."""
    channel = grpc.insecure_channel(f"{info.address}:{info.port}", options=[("grpc.enable_http_proxy", 0)])
    try:
        return pb_grpc.NodeStub(channel).Status(pb.NodeStatusRequest(), timeout=timeout_s)
    finally:
        channel.close()


def _browse(cluster: str, interfaces: Sequence[str], timeout_s: float) -> List[NodeInfo]:
    addresses = resolve_interfaces(list(interfaces)) if interfaces else []
    return browse(cluster, addresses, timeout_s)


def cluster_status(cluster: str, interfaces: Sequence[str] = (), timeout_s: float = 3.0) -> List[Dict]:
    """Browse for ``timeout_s`` seconds and return one dict per node (sorted by
    node id): its advertised facts plus its live ``Status`` (``state`` is
    ``unreachable`` when it does not answer)."""
    out = []
    for info in sorted(_browse(cluster, interfaces, timeout_s), key=lambda i: i.node_id):
        row = {"node_id": info.node_id, "address": f"{info.address}:{info.port}", "platform": info.platform,
               "chip": info.chip, "memory_bytes": info.memory_bytes, "backends": list(info.backends),
               "model_digest": info.model_digest, "version": info.version}
        try:
            st = node_status(info)
            row.update(state=st.state, rank=st.rank, world_size=st.world_size, formation_id=st.formation_id,
                       backend=st.backend, rank0_address=st.rank0_address, model=st.model,
                       coordinator_id=st.coordinator_id, error=st.error)
        except grpc.RpcError:
            row.update(state="unreachable", rank=-1, world_size=0, formation_id="")
        out.append(row)
    return out


def find_rank0(cluster: str, interfaces: Sequence[str] = (), timeout_s: float = 3.0,
               ) -> Tuple[str, pb.NodeStatusReply]:
    """Address (``host:port``) of the formed cluster's rank 0 ``Generation`` service.

    Raises:
        ClusterLookupError: no node found, or no formed and ready group.
        ValueError: an unknown interface.
    """
    nodes = _browse(cluster, interfaces, timeout_s)
    if not nodes:
        raise ClusterLookupError(f"no nodes of cluster {cluster!r} found over mDNS")
    states = []
    for info in sorted(nodes, key=lambda i: i.node_id):
        try:
            st = node_status(info)
        except grpc.RpcError:
            states.append(f"{info.node_id}: unreachable")
            continue
        states.append(f"{info.node_id}: {st.state}")
        if st.formation_id and st.rank == 0 and st.state == "ready":
            return st.rank0_address, st
    raise ClusterLookupError(f"cluster {cluster!r} has no formed group yet ({'; '.join(states)})")

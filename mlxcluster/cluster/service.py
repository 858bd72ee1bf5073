"""The ``Node`` gRPC service of a node daemon: ``Prepare``, ``Bootstrap``, ``Teardown``, ``Status``,
``Exec`` (OpenMPI's daemon for an MPI formation: :mod:`mlxcluster.runtime.mpi_agent`), ``Manifest``
and ``Fetch`` (the node's model, to peers that lack it: :mod:`mlxcluster.cluster.transfer`), ``Measure``
(a peer's link probe, :mod:`mlxcluster.cluster.measure`: answered on gRPC's thread, never the loop).

The service is served over mutual TLS (:mod:`mlxcluster.security`): only a
process that proves the cluster secret gets a handler called at all.
Handlers run on gRPC's threads.  They check the request (protocol version,
model digest, rank) here, then hand the state change to the
node loop (:meth:`NodeDaemon.call`) and wait for its answer within the RPC's
deadline.  ``Status`` (every peer's heartbeat) answers from the snapshot the
loop last published, so it never waits on the loop.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import TYPE_CHECKING, Callable, TypeVar

from ..protocol import mlxcluster_pb2 as pb
from ..protocol import mlxcluster_pb2_grpc as pb_grpc
from .membership import version_error

if TYPE_CHECKING:  # pragma: no cover
    from .node import NodeDaemon

log = logging.getLogger("mlxcluster.node")

__all__ = ["NodeService"]

#: Longest a handler waits for the node loop when the RPC has no deadline.
LOOP_WAIT_S = 5.0
#: Longest an ``Exec`` call streams (a bound; a formation's daemon lives as long as its ranks).
EXEC_MAX_S = 7 * 24 * 3600.0

T = TypeVar("T")


class NodeService(pb_grpc.NodeServicer):
    """``Node`` service of ``node`` (a :class:`mlxcluster.cluster.node.NodeDaemon`)."""

    def __init__(self, node: "NodeDaemon"):
        self.node = node

    def _refuse(self, rpc: str, context, error: str) -> None:
        log.warning("refused %s from %s: %s", rpc, context.peer(), error)

    def _on_loop(self, fn: Callable[[], T], context, busy: T) -> T:
        left = context.time_remaining()
        timeout = LOOP_WAIT_S if left is None else max(0.0, min(left - 0.1, LOOP_WAIT_S))
        try:
            return self.node.call(fn, timeout)
        except TimeoutError:
            return busy

    def Prepare(self, request, context):
        cfg = self.node.cfg
        err = version_error(request.protocol_version)
        if err:
            self._refuse("Prepare", context, err)
            return pb.PrepareReply(ok=False, error=err, node_id=cfg.node_id)
        return self._on_loop(lambda: self.node.prepare(request.formation_id), context,
                             pb.PrepareReply(ok=False, error="node busy", node_id=cfg.node_id))

    def Bootstrap(self, request, context):
        err = self.bootstrap_error(request)
        if err:
            self._refuse("Bootstrap", context, err)
            return pb.BootstrapReply(ok=False, error=err)
        return self._on_loop(lambda: self.node.bootstrap(request), context,
                             pb.BootstrapReply(ok=False, error="node busy"))

    def bootstrap_error(self, request: pb.BootstrapRequest) -> str:
        """Why ``request`` may not bootstrap this node (``""``: it may)."""
        digest = self.node.info.model_digest
        err = version_error(request.protocol_version)
        if not err and request.model_digest != digest:
            err = f"model digest {request.model_digest} differs from this node's {digest}"
        if not err and not 0 <= request.rank < request.world_size == len(request.endpoints):
            err = f"bad rank {request.rank} for world size {request.world_size}"
        return err

    def Teardown(self, request, context):
        self._on_loop(lambda: self.node.teardown(request.formation_id, request.reason or "coordinator asked"),
                      context, None)
        return pb.TeardownReply()

    def Status(self, request, context):
        return self.node.status()

    def Measure(self, request, context):
        return pb.MeasureReply(received_bytes=len(request.payload))

    def Manifest(self, request, context):
        return self.node.share.Manifest(request, context)

    def Fetch(self, request, context):
        yield from self.node.share.Fetch(request, context)

    def Exec(self, request, context):
        import grpc

        out: "queue.SimpleQueue" = queue.SimpleQueue()
        error = self._on_loop(lambda: self.node.start_exec(request.formation_id, list(request.argv), out), context,
                              "node busy")
        if error:
            self._refuse("Exec", context, error)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, error)
        context.add_callback(lambda: self.node.call_soon(lambda: self.node.exec_ended(out)))
        deadline = time.monotonic() + EXEC_MAX_S
        while context.is_active() and time.monotonic() < deadline:
            try:
                item = out.get(timeout=1.0)
            except queue.Empty:
                continue
            if item is None:  # torn down: the daemon was stopped
                yield pb.ExecEvent(exit_code=137)
                return
            stream, value = item
            if stream == "exit":
                yield pb.ExecEvent(exit_code=value if value is not None else 255)
                return
            yield pb.ExecEvent(**{stream: value.encode(errors="replace")})

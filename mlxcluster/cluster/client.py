"""Clients of a formed cluster: find its nodes over mDNS and ask them for status.

mDNS records are unauthenticated hints: every ``Status`` goes over mutual TLS
and the node must prove both the cluster secret and the node id it advertises
(:func:`mlxcluster.security.node_name`) before the client believes a word of
it, let alone sends a prompt to the rank 0 it names."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from concurrent import futures
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import grpc

from ..protocol import mlxcluster_pb2 as pb
from ..protocol import mlxcluster_pb2_grpc as pb_grpc
from ..protocol.errors import GROUP_FAILURE_CODES
from ..security import Credentials, describe_rpc_error, node_name
from .discovery import RESOLVE_TIMEOUT_S, Browser, NodeInfo, browse, resolve_interfaces

__all__ = ["ClusterLookupError", "ClusterView", "cluster_status", "find_rank0", "node_status", "generate_resumed"]

#: Longest one ``Status`` call may take, in seconds.
STATUS_TIMEOUT_S = 2.0
#: :func:`find_rank0` asks the nodes it knows again after this many seconds without an mDNS change.
REASK_S = 0.25


class ClusterLookupError(RuntimeError):
    """No node of the cluster was found, or none has a formed group."""


def node_status(info: NodeInfo, creds: Credentials, timeout_s: float = STATUS_TIMEOUT_S) -> pb.NodeStatusReply:
    """``Status`` of one node, over mutual TLS: the node must prove the cluster secret and
    its node id ``info.node_id``.

    Raises:
        grpc.RpcError: unreachable, or the TLS handshake failed
            (:func:`mlxcluster.security.describe_rpc_error` tells which).
    """
    channel = creds.channel(f"{info.address}:{info.port}", node_name(info.node_id))
    try:
        return pb_grpc.NodeStub(channel).Status(pb.NodeStatusRequest(), timeout=timeout_s)
    finally:
        channel.close()


def _addresses(interfaces: Sequence[str]) -> List[str]:
    return resolve_interfaces(list(interfaces)) if interfaces else []


def cluster_status(cluster: str, interfaces: Sequence[str] = (), timeout_s: float = 3.0,
                   creds: Optional[Credentials] = None) -> List[Dict]:
    """Browse for ``timeout_s`` seconds and return one dict per node (sorted by
    node id): its advertised facts plus, with ``creds``, its verified ``Status``
    (``state`` says why not when it does not answer: ``unreachable``, or a TLS
    handshake failure).  Without ``creds`` ``state`` is the advertised one and
    ``verified`` is False.

    Raises:
        ValueError: an unknown interface.
    """
    out = []
    for info in browse(cluster, _addresses(interfaces), timeout_s):
        row = {"node_id": info.node_id, "address": f"{info.address}:{info.port}", "platform": info.platform,
               "chip": info.chip, "memory_bytes": info.memory_bytes, "backends": list(info.backends),
               "model_digest": info.model_digest, "version": info.version, "verified": False, "spare": info.spare}
        if creds is None:
            row.update(state=info.state or "?", rank=-1, world_size=0, formation_id="")
            out.append(row)
            continue
        try:
            st = node_status(info, creds)
            row.update(state=st.state, rank=st.rank, world_size=st.world_size, formation_id=st.formation_id,
                       backend=st.backend, backend_reason=st.backend_reason, rank0_address=st.rank0_address,
                       model=st.model,
                       coordinator_id=st.coordinator_id, error=st.error, verified=True, waiting=st.waiting,
                       layers=st.layers, role=st.role, prefill_peer=st.prefill_peer, draft_peer=st.draft_peer,
                       model_digest=st.model_digest,
                       model_bytes=st.model_bytes, spare=st.spare,
                       fetch={"state": st.fetch_state, "from": st.fetch_from, "done_bytes": st.fetch_done_bytes,
                              "total_bytes": st.fetch_total_bytes} if st.fetch_state else None,
                       plan=_plan_of(st))
        except grpc.RpcError as exc:
            row.update(state="unreachable", rank=-1, world_size=0, formation_id="", error=describe_rpc_error(exc))
        out.append(row)
    return out


def _plan_of(st: pb.NodeStatusReply) -> Optional[Dict]:
    """The ``plan`` dict of a node's ``Status`` (its formation's predicted and measured figures), ``None``."""
    if not st.HasField("plan"):
        return None
    from .measure import plan_view

    return plan_view(st.plan)


class ClusterView:
    """One cluster's nodes as a long-lived mDNS browser sees them (``serve --cluster``), for
    :func:`find_rank0` to start from instead of browsing afresh: a new browser knows no node
    until its first queries are answered (most of a second; under load more than the 1 s
    ``serve``'s healer gives a lookup while its rank 0 is silent).

    Args:
        cluster: the cluster name.
        interfaces: addresses or names to browse on (:func:`~mlxcluster.cluster.discovery.resolve_interfaces`).
    Raises:
        ValueError: an unknown interface.
        OSError: the mDNS sockets could not be opened.
    """

    def __init__(self, cluster: str, interfaces: Sequence[str] = ()):
        self.cluster = cluster
        self._lock = threading.Lock()
        self._nodes: Dict[str, NodeInfo] = {}
        self._queues: List["queue.SimpleQueue[tuple]"] = []
        self._browser = Browser(cluster, _addresses(interfaces), on_change=self._changed).start()

    def _changed(self, event: str, info: NodeInfo) -> None:
        with self._lock:
            if event == "removed":
                self._nodes.pop(info.node_id, None)
            else:
                self._nodes[info.node_id] = info
            for q in self._queues:
                q.put((event, info))

    @contextlib.contextmanager
    def subscribe(self) -> Iterator["queue.SimpleQueue[tuple]"]:
        """A queue of ``(event, NodeInfo)``: every node known now as ``"added"``, then each change."""
        q: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        with self._lock:
            for info in self._nodes.values():
                q.put(("added", info))
            self._queues.append(q)
        try:
            yield q
        finally:
            with self._lock:
                self._queues.remove(q)

    def close(self) -> None:
        """Stop browsing."""
        self._browser.close()


def find_rank0(cluster: str, creds: Credentials, interfaces: Sequence[str] = (),
               timeout_s: float = 3.0, not_formation: str = "",
               view: Optional[ClusterView] = None) -> Tuple[str, pb.NodeStatusReply]:
    """Address (``host:port``) of the formed cluster's rank 0 ``Generation`` service, and
    that node's ``Status``.

    Browses mDNS and asks each node of ``cluster`` for its ``Status`` as soon as it is
    resolved, again whenever its advertisement changes (rank 0 advertises ``formed``
    once every rank is ready), and every node again after :data:`REASK_S` without a change (an
    mDNS update may be lost); the nodes are asked side by side (at most one call per node at a
    time, each bounded by :data:`STATUS_TIMEOUT_S`), so a frozen node delays no other's answer;
    returns at the first node that is rank 0 of a formation and ready, so usually well within
    ``timeout_s`` (seconds; the bound on the whole search).

    Args:
        creds: the client's credentials: a node that cannot prove the cluster secret
            and its advertised node id in the TLS handshake is skipped before any
            request is sent (a forged advertisement learns nothing and answers nothing).
        not_formation: a formation id that does not count (the one that just failed: its rank 0
            may still report ready for a moment).
        view: a :class:`ClusterView` of ``cluster`` to start from (its nodes are asked at once)
            instead of browsing afresh (``interfaces`` is then unused).

    Raises:
        ClusterLookupError: no node found, or no ready rank 0 within ``timeout_s``
            (one line naming each node's state, or ``wrong cluster secret``).
        ValueError: an unknown interface.
        OSError: the mDNS sockets could not be opened.
    """
    deadline = time.monotonic() + timeout_s
    states: Dict[str, str] = {}  # node id -> its last known state, for the error message
    known: Dict[str, NodeInfo] = {}  # node id -> its advertisement, asked again each REASK_S
    asking: set = set()  # node ids with a Status call under way
    pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="find-rank0")

    def ask(info: NodeInfo, left: float) -> None:
        if info.node_id in asking:
            return
        asking.add(info.node_id)
        call = pool.submit(node_status, info, creds, min(STATUS_TIMEOUT_S, max(0.2, left)))
        call.add_done_callback(lambda c, info=info: changes.put(("status", info, c)))

    try:
        with contextlib.ExitStack() as stack:
            if view is not None:
                changes = stack.enter_context(view.subscribe())  # (event, info[, finished Status call])
            else:
                changes = queue.SimpleQueue()
                stack.enter_context(Browser(cluster, _addresses(interfaces),
                                            on_change=lambda event, info: changes.put((event, info)),
                                            resolve_timeout_s=min(RESOLVE_TIMEOUT_S, timeout_s)))
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    event, info, *call = changes.get(timeout=min(left, REASK_S))
                except queue.Empty:
                    # no advertisement changed: ask the known nodes again (an mDNS update can be lost,
                    # and a node's state changes without one, e.g. a rank 0 becoming ready)
                    for info in list(known.values()):
                        ask(info, left)
                    continue
                if event == "status":
                    asking.discard(info.node_id)
                    if known.get(info.node_id) != info:
                        continue  # an answer for an advertisement that changed or went
                    try:
                        st = call[0].result()
                    except grpc.RpcError as exc:
                        states[info.node_id] = describe_rpc_error(exc)
                        continue
                    # a node that waits says why (e.g. "exact world size 3 requested (--exact-world-size), 2 live")
                    states[info.node_id] = st.state + (f", waiting: {st.waiting}" if st.waiting and not st.formation_id
                                                       else "")
                    if st.formation_id and st.rank == 0 and st.state == "ready" and st.formation_id != not_formation:
                        return st.rank0_address, st
                    continue
                if event == "removed":
                    states.pop(info.node_id, None)
                    known.pop(info.node_id, None)
                    continue
                known[info.node_id] = info
                if info.role in ("prefill", "draft"):  # its rank 0 serves other groups (Prefill, Draft), not clients
                    states[info.node_id] = f"{info.role} group"
                    continue
                asking.discard(info.node_id)  # a changed advertisement is asked at once
                ask(info, left)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # calls under way end within STATUS_TIMEOUT_S
    if not states:
        raise ClusterLookupError(f"no nodes of cluster {cluster!r} found over mDNS")
    detail = "; ".join(f"{node_id}: {state}" for node_id, state in sorted(states.items()))
    raise ClusterLookupError(f"cluster {cluster!r} has no formed group yet ({detail})")


def generate_resumed(cluster: str, creds: Credentials, interfaces: Sequence[str], address: str,
                     formation_id: str, *, max_tokens: int, max_replays: int = 2, wait_s: float = 60.0,
                     on_replay: Optional[Callable[[str], None]] = None, **request: Any) -> Iterator[pb.GenerateEvent]:
    """One generation from a formed cluster that survives the group failing under it (lossless
    failover for ``generate --cluster`` and ``chat --cluster``): when the stream breaks
    (:data:`~mlxcluster.protocol.errors.GROUP_FAILURE_CODES`) or ends without ``done`` or with ``ERROR``, wait up to ``wait_s`` for
    the re-formed cluster's rank 0 (:func:`find_rank0`, another formation than the failed one) and
    send it the same request with ``resume_token_ids`` = the token ids already yielded; the events
    go on where they stopped (greedy and seeded answers are the unbroken ones, text included: rank 0
    primes its detokenizer with them).  At most ``max_replays`` times.

    Args:
        address, formation_id: the formed cluster's rank 0 (``host:port``) and its formation.
        max_tokens: the answer's bound (the resumed tokens count toward it).
        on_replay: called with one line before each replay (e.g. a note on stderr).
        request: :meth:`GenerationClient.stream`'s other keywords (prompt, sampling).
    Yields:
        ``GenerateEvent``: one ``started`` (the first group's), the ``token`` events of the whole
        answer, once each, and the last group's ``done`` (its timings are that group's; its
        ``generated_tokens`` counts the whole answer).
    Raises:
        ClientError: a refusal (not replayed), the group failed more than ``max_replays`` times,
            or no re-formed group within ``wait_s`` (one line naming the failure).
    """
    from ..leader.generation import ClientError, GenerationClient

    delivered: List[int] = []
    eos: Optional[frozenset] = None
    failures = 0
    while True:
        client = GenerationClient(address, creds)
        why = ""
        try:
            if eos is None:
                eos = frozenset(int(t) for t in client.info().eos_token_ids)
            resumed = len(delivered)
            for event in client.stream(max_tokens=max_tokens, resume_token_ids=delivered, **request):
                kind = event.WhichOneof("event")
                if kind == "started":
                    if event.started.resumed_tokens != resumed:  # a rank 0 that would repeat the answer
                        raise ClientError(f"the re-formed group did not continue the answer: {resumed} tokens "
                                          f"were sent, it resumed {event.started.resumed_tokens}")
                    if failures:
                        continue
                elif kind == "token":
                    if event.token.token_id not in eos:
                        delivered.append(event.token.token_id)
                elif kind == "done" and event.done.reason == pb.ERROR:
                    why = "rank 0 ended the answer with an error"
                    break
                yield event
                if kind == "done":
                    return
            else:
                why = "rank 0's stream ended early"
        except ClientError as exc:
            if exc.code not in GROUP_FAILURE_CODES:
                raise
            why = str(exc)
        finally:
            client.close()
        if len(delivered) >= max_tokens:  # every token arrived; only done was lost with the group
            yield pb.GenerateEvent(done=pb.GenerateDone(reason=pb.MAX_TOKENS, generated_tokens=len(delivered)))
            return
        failures += 1
        if failures > max_replays:
            raise ClientError(f"the group failed {failures} times during this request: {why}")
        if on_replay is not None:
            on_replay(f"the group failed after {len(delivered)} generated tokens ({why}); resuming on the "
                      f"re-formed cluster ({failures} of {max_replays})")
        try:
            address, st = find_rank0(cluster, creds, interfaces, timeout_s=wait_s, not_formation=formation_id)
        except ClusterLookupError as exc:
            raise ClientError(f"the group failed ({why}) and none formed again within {wait_s:g} s: {exc}") from None
        formation_id = st.formation_id

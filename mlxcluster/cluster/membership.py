"""Typed membership states of a node daemon (``mlxcluster join``).

Three kinds of state, all immutable values that the node loop replaces (never
mutates) and the pure planner (:mod:`mlxcluster.cluster.plan`) reads:

* :class:`Peer`: what this node knows of another node of its cluster
  (:class:`PeerStatus` ``SEEN`` / ``LIVE`` / ``REFUSED`` / ``LOST``, with a reason).
* The node's own state: :class:`Idle`, :class:`Preparing`, :class:`Bootstrapping`,
  :class:`Running` or :class:`Failed` (the last three hold a :class:`Formation`
  and this node's rank in it).  :func:`wire_state` gives the ``state`` string
  of ``NodeStatusReply`` (``idle``, ``starting``, ``loading``, ``ready``, ``failed``).
* :class:`Formation`: one tensor-parallel group: id, world size, backend,
  members in rank order, rank 0's address.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Optional, Tuple, Union

from ..protocol import mlxcluster_pb2 as pb
from .discovery import PROTOCOL_VERSION, NodeInfo

__all__ = [
    "PeerStatus", "PeerReport", "Peer", "Member", "Formation",
    "Idle", "Preparing", "Bootstrapping", "Running", "Failed", "OwnState",
    "refusal", "version_error", "wire_state", "IDLE_STATES", "PEER_TIMEOUT_S",
    "STALLED_PEER_TIMEOUT_S", "STALL_S", "STALL_STEPS", "LATE_FACTOR", "PEAK_DECAY", "peer_timeout", "RttEstimate",
    "silent_since",
    "advertised", "heartbeat", "proved",
]

#: Seconds without an answered heartbeat after which a live peer is lost.
PEER_TIMEOUT_S = 3.0
#: ... and after which a live MEMBER of this node's formation is lost while this node's own rank has
#: been inside one step for at least ``STALL_S`` and ``STALL_STEPS`` times its slowest recent step
#: (:func:`peer_timeout`)
STALLED_PEER_TIMEOUT_S = 1.0
STALL_S = 0.5
STALL_STEPS = 3.0
#: A member's silence may reach ``LATE_FACTOR`` times the slowest heartbeat round trip it showed
#: recently (:attr:`RttEstimate.peak`) before the short limit loses it
LATE_FACTOR = 2.0
#: :attr:`RttEstimate.peak` decays by this factor per answered heartbeat (a half-life of ~34
#: answers, ~17 s at one each 0.5 s): a load spike is remembered for tens of seconds, not forever
PEAK_DECAY = 0.98


def version_error(version: int) -> str:
    """``""`` when ``version`` is this node's protocol version, else a one-line reason naming both."""
    if version == PROTOCOL_VERSION:
        return ""
    return f"protocol version {version} does not match this node's {PROTOCOL_VERSION}"


def refusal(info: NodeInfo, node_id: str, model_digest: str, role: str = "") -> str:
    """Why the advertised peer ``info`` may not join this node's formations (``""``: it may).

    Checked in order: same node id as this node, protocol version, model digest -- not between a
    draft node (``join --role draft``, this node's ``role`` or the peer's) and another node: a draft
    node holds another model (the target's vocabulary is checked by its ``Draft`` calls) and forms
    with no one.  Pure: no I/O.  (The cluster secret is not in the advertisement: a peer proves
    it, and its node id, in the TLS handshake of its first heartbeat.)
    """
    if info.node_id == node_id:
        return "same node id as this node"
    err = version_error(info.version)
    if err:
        return err
    if not info.model_digest:
        return "has no model yet (join --fetch-model: it is fetching one)"
    if info.model_digest != model_digest and "draft" not in (role, info.role):
        return f"different model (digest {info.model_digest}, this node {model_digest})"
    return ""


class PeerStatus(enum.Enum):
    """Where a discovered peer stands."""

    SEEN = "seen"          # advertised and compatible, not yet answering Status
    LIVE = "live"          # compatible and answering Status (the heartbeat)
    REFUSED = "refused"    # incompatible (reason says why); never gets a rank
    LOST = "lost"          # was live, then missed heartbeats (a goodbye forgets the peer instead)


#: Wire states (``NodeStatusReply.state``) of a node free to join a new formation.
IDLE_STATES = ("idle", "failed")


@dataclass(frozen=True)
class PeerReport:
    """A peer's last ``Status`` answer, the part the planner uses.

    Attributes:
        state: its wire state (``idle``, ``starting``, ``loading``, ``ready``, ``failed``).
        formation_id: the formation it holds a rank in, ``""`` for none.
        rank0_address: ``host:port`` of its formation's rank 0 (a prefill group's ``Prefill``).
    """

    state: str
    formation_id: str = ""
    rank0_address: str = ""


@dataclass(frozen=True)
class Peer:
    """Another node of the cluster as this node sees it.

    Attributes:
        info: what it advertises over mDNS.
        status: see :class:`PeerStatus`.
        reason: why it is ``REFUSED`` or ``LOST`` (``""`` otherwise).
        last_ok: ``time.monotonic()`` of its last answered heartbeat, 0.0 for never.
        report: its last ``Status`` answer, ``None`` before the first.
        pending: another endpoint advertised for this verified peer, not yet proven
            (see :func:`advertised`); ``None`` when there is none.
    """

    info: NodeInfo
    status: PeerStatus
    reason: str = ""
    last_ok: float = 0.0
    report: Optional[PeerReport] = None
    pending: Optional[NodeInfo] = None

    @property
    def node_id(self) -> str:
        return self.info.node_id

    @property
    def verified(self) -> bool:
        """It has answered a heartbeat over mutual TLS, proving the secret and its node id
        at ``info``'s endpoint."""
        return self.last_ok > 0 and self.status in (PeerStatus.LIVE, PeerStatus.LOST)


@dataclass(frozen=True)
class Member:
    """One rank of a formation: which node, and where its rank process listens."""

    rank: int
    node_id: str
    address: str
    ring_port: int
    control_port: int


@dataclass(frozen=True)
class Formation:
    """One tensor-parallel group formed by a coordinator.

    Attributes:
        formation_id: random id chosen by the coordinator.
        coordinator_id: node id of the coordinator (always rank 0).
        backend: ``ring``, ``mpi`` or ``jaccl``.
        members: one :class:`Member` per rank, in rank order.
        model_digest / weights: what every rank loads.
        backend_reason: one line saying why ``backend`` was chosen (``mlxcluster status``).
        jaccl_devices_json: jaccl only: the N x N ``MLX_IBV_DEVICES`` matrix as JSON
            (:func:`mlxcluster.runtime.thunderbolt.jaccl_mesh`), the same on every rank.
        layers: a pipeline's route (``--layers`` text, one range per rank), ``""`` for TP.
        role: ``"prefill"``, ``"decode"`` (prefill/decode disaggregation), ``"draft"`` (a draft node's
            one-rank group) or ``""``.
        prefill_peer: a decode formation's prefill group (``host:port`` of its rank 0).
        draft_peer: the draft node's group (``join --role draft``: ``host:port`` of its rank 0) this
            formation drafts with by default (``--draft remote:HOST:PORT``), ``""`` for none.
        kv_bits / kv_group_size: every rank's KV cache format (the coordinator's ``join --kv-bits`` /
            ``--kv-group-size``; 0 / 0: full precision).
        ring_hosts_json: ring only: per rank the IPv4 addresses it listens on over the Thunderbolt
            cables (:func:`mlxcluster.runtime.thunderbolt.ring_over_cables`), as JSON; ``""``: the
            members' addresses.
        jaccl_ring: jaccl only: run as a ring (``MLX_JACCL_RING=1``, several cables per pair).
    """

    formation_id: str
    coordinator_id: str
    backend: str
    members: Tuple[Member, ...]
    model_digest: str = ""
    weights: str = ""
    backend_reason: str = ""
    jaccl_devices_json: str = ""
    layers: str = ""
    role: str = ""
    prefill_peer: str = ""
    draft_peer: str = ""
    kv_bits: int = 0
    kv_group_size: int = 0
    ring_hosts_json: str = ""
    jaccl_ring: bool = False

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def node_ids(self) -> Tuple[str, ...]:
        """Member node ids in rank order."""
        return tuple(m.node_id for m in self.members)

    @property
    def rank0_address(self) -> str:
        """``host:port`` of rank 0's ``Generation`` service."""
        m = self.members[0]
        return f"{m.address}:{m.control_port}"

    def to_bootstrap(self, rank: int) -> pb.BootstrapRequest:
        """The ``Bootstrap`` request that gives ``rank`` its place in this formation."""
        return pb.BootstrapRequest(
            protocol_version=PROTOCOL_VERSION, formation_id=self.formation_id,
            coordinator_id=self.coordinator_id, rank=rank, world_size=self.world_size, backend=self.backend,
            endpoints=[self.endpoint_msg(m) for m in self.members], model_digest=self.model_digest,
            weights=self.weights, backend_reason=self.backend_reason, jaccl_devices_json=self.jaccl_devices_json,
            layers=self.layers, role=self.role, prefill_peer=self.prefill_peer, draft_peer=self.draft_peer,
            kv_bits=self.kv_bits, kv_group_size=self.kv_group_size, ring_hosts_json=self.ring_hosts_json,
            jaccl_ring=self.jaccl_ring)

    @staticmethod
    def endpoint_msg(m: Member) -> pb.RankEndpointMsg:
        return pb.RankEndpointMsg(rank=m.rank, node_id=m.node_id, address=m.address, ring_port=m.ring_port,
                                  control_port=m.control_port)

    @classmethod
    def from_bootstrap(cls, req: pb.BootstrapRequest) -> "Formation":
        """Inverse of :meth:`to_bootstrap` (the rank is ``req.rank``)."""
        members = tuple(Member(rank=e.rank, node_id=e.node_id, address=e.address, ring_port=e.ring_port,
                               control_port=e.control_port) for e in sorted(req.endpoints, key=lambda e: e.rank))
        return cls(formation_id=req.formation_id, coordinator_id=req.coordinator_id, backend=req.backend,
                   members=members, model_digest=req.model_digest, weights=req.weights,
                   backend_reason=req.backend_reason, jaccl_devices_json=req.jaccl_devices_json,
                   layers=req.layers, role=req.role, prefill_peer=req.prefill_peer, draft_peer=req.draft_peer,
                   kv_bits=req.kv_bits, kv_group_size=req.kv_group_size, ring_hosts_json=req.ring_hosts_json,
                   jaccl_ring=req.jaccl_ring)


def _endpoint(info: NodeInfo) -> Tuple[str, int]:
    return info.address, info.port


def advertised(peer: Optional[Peer], info: NodeInfo, refused: str) -> Peer:
    """``peer`` after an mDNS advertisement ``info`` (``refused``: :func:`refusal` of it).

    mDNS is unauthenticated: anyone on the link can replay or forge a record.  So a
    :attr:`Peer.verified` peer keeps its proven endpoint: an advertisement of another
    address or port only becomes :attr:`Peer.pending` (the node loop asks that endpoint
    to prove the node id, and :func:`proved` moves the peer there), and one that would
    refuse it is ignored (the peer already proved itself).  Otherwise a refused peer is
    ``REFUSED``; a new one, or an unverified one at a new endpoint, is ``SEEN`` until it
    answers a heartbeat; at the same endpoint only its advertised facts change."""
    moved = peer is not None and _endpoint(peer.info) != _endpoint(info)
    if peer is not None and peer.verified:
        if refused:
            return peer
        if moved:
            return replace(peer, pending=info)
        return replace(peer, info=info, pending=None)
    if refused:
        return Peer(info=info, status=PeerStatus.REFUSED, reason=refused)
    if peer is None or peer.status is PeerStatus.REFUSED or moved:
        return Peer(info=info, status=PeerStatus.SEEN)
    return replace(peer, info=info)


def proved(peer: Peer, info: NodeInfo, report: PeerReport, now: float) -> Peer:
    """``peer`` after its pending endpoint ``info`` answered ``Status`` over mutual TLS as
    its node id: it is live there (a restart on a new port, not a replay)."""
    return Peer(info=info, status=PeerStatus.LIVE, last_ok=now, report=report)


@dataclass(frozen=True)
class RttEstimate:
    """A peer's heartbeat round-trip time, smoothed as TCP's retransmission timer does (RFC 6298,
    section 2, with its alpha 1/8 and beta 1/4): ``srtt`` and ``rttvar`` in seconds over ``samples``
    answered heartbeats; and ``peak``, the slowest recent round trip (each sample's, or the last
    peak times ``PEAK_DECAY``): RFC 6298's smoothing forgets a 1 s scheduling spike of a CPU-starved
    peer within a few answers, while the next spike is as likely as the last."""

    srtt: float = 0.0
    rttvar: float = 0.0
    samples: int = 0
    peak: float = 0.0

    def update(self, rtt_s: float) -> "RttEstimate":
        """The estimate after one more answered heartbeat that took ``rtt_s`` seconds."""
        r = max(0.0, rtt_s)
        if not self.samples:
            return RttEstimate(r, r / 2, 1, r)
        return RttEstimate(0.875 * self.srtt + 0.125 * r, 0.75 * self.rttvar + 0.25 * abs(self.srtt - r),
                           self.samples + 1, max(r, self.peak * PEAK_DECAY))

    def expected_silence(self, interval_s: float) -> float:
        """The longest silence an answering peer shows, heartbeats sent every ``interval_s``: one
        interval plus RFC 6298's timeout, ``srtt + 4 rttvar``, or ``LATE_FACTOR`` times the recent
        peak round trip when longer (0.0 without samples)."""
        if not self.samples:
            return 0.0
        return interval_s + max(self.srtt + 4 * self.rttvar, LATE_FACTOR * self.peak)


def silent_since(last_ok: float, asked_at: float, interval_s: float) -> float:
    """When the silence charged to a peer began (``time.monotonic()`` seconds): its last answer
    ``last_ok``, but no earlier than one heartbeat interval ``interval_s`` before this node asked
    it (``asked_at``: when the first heartbeat still unanswered since ``last_ok`` was sent; 0.0:
    none).  A node whose own loop ran late -- its daemon starved of CPU -- asks late, and that
    lateness is its own, not the peer's: judged from ``last_ok`` alone, a peer answering in 10 ms
    was lost the moment the late heartbeat was sent, and was back 13 ms later (issue 48)."""
    return max(last_ok, asked_at - interval_s) if asked_at else last_ok


def peer_timeout(timeout_s: float, member: bool, own_busy_s: float, rtt: Optional[RttEstimate] = None,
                 interval_s: float = 0.5, own_step_s: float = 0.0, deserted: bool = False) -> float:
    """Seconds of silence after which a ``LIVE`` peer is lost: ``timeout_s`` (``join --peer-timeout``),
    or less when two signals agree that the peer froze.

    A frozen peer (SIGSTOP, a hung machine) answers nothing, ever; a CPU-starved one answers late
    -- ~1 s on a loaded machine -- but answers, and its rank's steps are slow too.  Only time tells
    the two apart, so each signal is judged against what this peer and this machine showed when
    alive:

    * the peer is a ``member`` of the formation this node's rank runs in, and that rank has been
      inside one step for ``own_busy_s`` seconds (``HealthReply``/``InfoReply.busy_s``: a rank
      waits in a collective for a rank that does not join it), at least ``STALL_S`` and
      ``STALL_STEPS`` times the slowest of its recent steps (``own_step_s``:
      ``HealthReply``/``InfoReply.step_s``) -- a 0.7 s decode step on a loaded machine is its
      pace, not a stall;
    * or the peer's formation is ``deserted``: a node that held a rank in it beside the peer has
      left it since (its rank found the group broken, or its node lost the peer) -- what a node
      outside the formation (a spare, or the next coordinator) sees of a member frozen there;
      waiting the full timeout for it delayed the re-formation by 2 s (issue 48);
    * then the limit is ``STALLED_PEER_TIMEOUT_S``, or the silence the peer's own answers allow
      when longer (``rtt``: :meth:`RttEstimate.expected_silence`, heartbeats every ``interval_s``:
      RFC 6298's timeout, or ``LATE_FACTOR`` times the slowest recent round trip), and never above
      ``timeout_s``.

    The silence itself is counted from :func:`silent_since` (not this node's own lateness).  On an
    idle machine (steps of milliseconds, answers in milliseconds) a frozen member is still lost
    after 1 s of silence (issue 29); under load the limit grows to what the load has shown.  Silence
    alone waits the full timeout; a long step alone loses no one (a long prefill)."""
    if deserted or (member and own_busy_s >= max(STALL_S, STALL_STEPS * own_step_s)):
        late = rtt.expected_silence(interval_s) if rtt is not None else 0.0
        return min(timeout_s, max(STALLED_PEER_TIMEOUT_S, late))
    return timeout_s


def heartbeat(peer: Peer, report: Optional[PeerReport], now: float, refused: bool = False,
              timeout_s: float = PEER_TIMEOUT_S, since: Optional[float] = None) -> Peer:
    """``peer`` after a ``Status`` heartbeat at ``now`` (``report`` is ``None`` when it failed;
    ``refused``: it failed because the connection was refused -- the host answered, but nothing
    listens at the node's port: its daemon is gone; ``since``: when its silence began,
    :func:`silent_since`, default ``peer.last_ok``).

    An answer makes a ``SEEN`` or ``LOST`` peer ``LIVE``; a ``LIVE`` peer
    unanswered for more than ``timeout_s`` (``join --peer-timeout``, default ``PEER_TIMEOUT_S``), or
    refused, becomes ``LOST`` (a crashed or killed daemon is lost at once; a frozen or unreachable
    one after the timeout).  ``REFUSED``
    peers stay refused (they are not asked)."""
    if peer.status is PeerStatus.REFUSED:
        return peer
    if report is not None:
        return replace(peer, status=PeerStatus.LIVE, reason="", last_ok=now, report=report)
    if peer.status is PeerStatus.LIVE and refused:
        return replace(peer, status=PeerStatus.LOST, reason="its daemon is gone (connection refused)")
    if peer.status is PeerStatus.LIVE and now - (peer.last_ok if since is None else since) > timeout_s:
        return replace(peer, status=PeerStatus.LOST, reason=f"no heartbeat for {timeout_s:.3g} s")
    return peer


# -- this node's own state ----------------------------------------------------------------------

@dataclass(frozen=True)
class Idle:
    """No formation; free to be prepared. ``reason``: why the last one was torn down (``""``: none)."""

    reason: str = ""


@dataclass(frozen=True)
class Preparing:
    """A coordinator asked ``Prepare`` for ``formation_id``; its ``Bootstrap`` has not come yet."""

    formation_id: str


@dataclass(frozen=True)
class Bootstrapping:
    """Rank ``rank`` of ``formation``: its process is starting (``loading``: it reported progress).

    ``since`` is the ``time.monotonic()`` of the ``Bootstrap``."""

    formation: Formation
    rank: int
    since: float
    loading: bool = False


@dataclass(frozen=True)
class Running:
    """Rank ``rank`` of ``formation``: its process reported ready. ``since``: as in :class:`Bootstrapping`."""

    formation: Formation
    rank: int
    since: float


@dataclass(frozen=True)
class Failed:
    """Rank ``rank`` of ``formation``: its process failed (``error`` says how); waits for teardown."""

    formation: Formation
    rank: int
    since: float
    error: str


OwnState = Union[Idle, Preparing, Bootstrapping, Running, Failed]


def wire_state(own: OwnState) -> str:
    """The ``NodeStatusReply.state`` string of ``own``."""
    if isinstance(own, Bootstrapping):
        return "loading" if own.loading else "starting"
    if isinstance(own, Running):
        return "ready"
    if isinstance(own, Failed):
        return "failed"
    return "idle"

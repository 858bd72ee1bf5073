"""The formation planner: a pure function from what a node knows to what it does next.

``plan(PlanInputs) -> Action`` reads typed states (:mod:`mlxcluster.cluster.membership`)
and returns one action; it does no I/O and reads no clock (``now`` is an input),
so the rules are tested as plain functions (``tests/test_plan.py``).  The node
loop (:mod:`mlxcluster.cluster.node`) applies the action and calls it again.

Rules, first match wins:

1. *Lost member.*  This node holds a rank and another member is not live
   -> :class:`Teardown` (the formation's coordinator also tells the members), once this node's
   rank has had ``RANK_REPORT_S`` after the member's last heartbeat to report the loss itself.
   An MLX group cannot be rebuilt inside a live process.
2. *Stale formation* (members).  The formation's coordinator is live and reports
   another formation (or none) ``MEMBER_GRACE_S`` after this node's bootstrap
   -> :class:`Teardown`.  The formation id is the epoch a returning node checks:
   a node frozen (SIGSTOP) or cut off while its peers re-formed lets go of its
   old rank instead of holding it forever (and so blocking rule 8 below).
3. *Failed member* (coordinator only).  Its own rank failed, a member reports
   ``failed``, or a member still reports another formation ``MEMBER_GRACE_S``
   after the bootstrap -> :class:`Teardown`, told to members, with back-off.
4. *Formed* (coordinator only).  Every rank ready, not yet announced -> :class:`Announce`.
4b. *Grow* (coordinator only; with ``--world-size N`` only a group re-formed below N, up to N).
   A larger group is possible now (a node returned) -> :class:`Teardown` at a quiet moment (see
   *Returning nodes* below).
5. Holding a rank otherwise -> :class:`Wait`.
6. *Coordinator.*  The live compatible non-spare node with the smallest node id
   (every node computes the same answer); the others -> :class:`Wait`.
7. *World size.*  ``--world-size N`` when N nodes are live, else the largest
   valid size (the model splits into it) not above the live count; none -> :class:`Wait`.
   ``--world-size N`` is the size to form first: before this node has held a rank it waits for N
   nodes; once it has (a member was lost and no spare is live), the survivors re-form at once at
   the largest valid size up to N that the live nodes reach -- the path a cluster formed without
   ``--world-size`` takes -- and :class:`Form` carries a warning naming the shortfall; rule 4b grows
   the group back to N when nodes return.  ``--exact-world-size`` keeps N a hard requirement: the
   nodes wait (``mlxcluster status``: "exact world size N requested, M live") until N are live.
8. A node joined the live set less than ``SETTLE_S`` ago (nodes starting together), or a back-off
   runs -> :class:`Wait`.  A node lost needs no settling: the survivors re-form at once.
9. A chosen peer still holds a rank in another formation -> :class:`Wait`.
10. -> :class:`Form`: this node is rank 0, the other live nodes follow in node-id order
   (non-spares first, then spares).

*Pipeline* (``join --layers``: this node or a live peer advertises a layer range): rules 6-7
become one, :func:`pipeline_route` over this node and every live peer -- every node must
advertise a range (``A:B``, ``K:output``) or every node ``auto``; the ranges must tile the
model; the node owning ``K:output`` is the coordinator and rank 0 (the reverse topology:
sampling stays local, only hidden states travel), the others follow in layer order (hidden
states flow rank r -> r+1, as MLX's ring requires).  With ``auto`` the smallest node id is
rank 0 and the layers are split by advertised memory.  A set of ranges that is not a route
(a gap while a node is missing, an overlap, two outputs) -> :class:`Wait` naming the problem
(``mlxcluster status`` shows it); rules 8-10 then apply, and :class:`Form` carries the route.

*Prefill/decode disaggregation* (``join --role``): nodes only ever form with nodes of their own
role.  A ``prefill`` node forms a group of itself alone (its rank 0 serves ``Generation.Prefill``);
``decode`` nodes form a tensor-parallel group among themselves by rules 6-10, but only once a
prefill group is running -- a live ``prefill`` peer whose status reports a ready rank 0 (the
smallest node id among several) -- and :class:`Form` carries its address.  A running decode
formation whose prefill group moved (another address is ready) is torn down and re-formed.

*Draft nodes* (``join --role draft``): a ``draft`` node holds a draft model (another model, with the
target's tokenizer) and forms a group of itself alone, whose rank 0 serves ``Generation.Draft``; it
never takes a rank in another group.  A target node (no role, or ``decode``) that coordinates a
formation passes the running draft group's address in :class:`Form` (``draft_peer``: a live ``draft``
peer whose status reports a ready rank 0, the smallest node id among several), which the group's
rank 0 drafts with by default (``remote:HOST:PORT``).  Before forming, a coordinator waits for a live
draft node that is still starting, at most ``DRAFT_WAIT_S`` after the last membership change
(:func:`draft_wait`).  A draft node appearing, moving or vanishing later tears no serving group down:
a group without a draft node decodes plainly (its rank 0's calls fail fast and back off).

*Spares* (``join --spare``): a spare holds the model and takes a rank only in a member's place.
Rule 6 picks the coordinator among the live non-spares only; a spare never coordinates (nor forms
a group of spares: with no non-spare live it waits), so a cluster never holds two formations.
Rule 10 chooses non-spares first (node-id order), then spares (node-id order), so with enough
non-spares live a spare stays idle.  With ``--world-size N`` spares count toward N like any node
(a lost member's place is taken at the same N).  Without it (the largest valid size) spares count
only to restore the size this node's last formation had (``last_world_size``): the target is the
largest valid size the live non-spares reach alone, or -- when that is smaller than the last
formation -- the largest valid size up to the last formation's that non-spares plus spares reach.
A spare in a pipeline (``--layers``) is refused at startup (``join``); the planner leaves spares
out of a route.  With ``--role`` a spare has a role like any node and only replaces nodes of it.

*Returning nodes* are live again.  With ``--world-size N`` a node returning to a formation that
already has N ranks stays idle (a de-facto spare: rule 5 keeps the formation, rule 9 keeps it from
forming a second); one returning to a formation re-formed below N grows it back to N by rule 4b.
Without it, rule 4b grows a running formation: the coordinator of a formed
group whose target size (rule 7 over the nodes live now) is larger tears it down, told to members,
once membership has been unchanged for ``GROW_SETTLE_S`` and either its rank 0 reported no running
or queued request (``rank0_idle``) or ``GROW_DELAY_S`` have passed (under continuous load: ``serve``
replays requests in flight), and rules 6-10 form the larger group.  Rule 4c: a coordinator whose
formation is smaller than the target while a live node with a smaller id would coordinate the
larger group (two formations formed apart) yields the same way: it tears its formation down and
that node's growth takes its nodes.  Rule 8b: without ``--world-size`` a node waits
``DISCOVERY_S`` after its start before forming below the largest valid size, so nodes started
together form one group, not one each.  Refused and lost peers are never live, so they never
get a rank.

*Shape by measurement* (``join --plan auto``, the default, when no ``--world-size``, ``--layers``,
``--role`` or spare is in play): rule 7's size becomes the shape planner's choice
(:mod:`mlxcluster.cluster.shape`) over the measurements the nodes report (:class:`AutoInputs`,
:func:`auto_choice`): the best plan that fits which this coordinator can form today -- this node alone,
TP over a subset that includes it, or a pipeline with uneven layer ranges whose rank 0 (the output stage)
it is (TP x PP and PD are not formed by this planner; a better plan that needs another coordinator is
named in :attr:`AutoChoice.note`).  While a candidate's measurement is pending the coordinator waits,
at most ``MEASURE_WAIT_S`` after the last membership change; a node whose measurement failed, or a
planner error (a context no plan holds), falls back to rule 7.  Growth (rule 4b) follows the choice:
it never grows past the chosen size, nor while a measurement is pending.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Mapping, Optional, Sequence, Tuple, Union

from ..model.layout import LayoutError, auto_layers, make_route, parse_range
from .shape import Candidate, Measurements, ModelProfile, Request, ShapeError, plan_shape
from .membership import (
    IDLE_STATES, Bootstrapping, Failed, Formation, OwnState, Peer, PeerStatus, Running, wire_state)

__all__ = ["PlanInputs", "Wait", "Form", "Teardown", "Announce", "Action", "plan", "coordinator_id",
           "target_world_size", "pipeline_route", "AutoInputs", "AutoChoice", "auto_choice", "ranked_shapes",
           "predicted_for", "draft_wait", "DRAFT_WAIT_S", "MEASURE_WAIT_S", "SETTLE_S", "MEMBER_GRACE_S",
           "GROW_SETTLE_S", "GROW_DELAY_S", "DISCOVERY_S", "RANK_REPORT_S"]

#: Seconds membership must stay unchanged before a formation is attempted.
SETTLE_S = 2.0
#: Seconds after a bootstrap within which a member may still report another formation.
MEMBER_GRACE_S = 4.0
#: Seconds membership must stay unchanged before a formed group grows to a larger size (rule 4b).
GROW_SETTLE_S = 10.0
#: Seconds after which a formed group grows even while its rank 0 still reports requests (rule 4b).
GROW_DELAY_S = 60.0
#: Seconds after a member's last answered heartbeat during which a running rank is left to report
#: that member's loss itself (rule 1).
RANK_REPORT_S = 1.0
#: Seconds after its start a node without ``--world-size`` waits for peers before forming below
#: the largest valid world size (rule 8b).
DISCOVERY_S = 5.0
#: Seconds after the last membership change (or this node's start) that ``join --plan auto`` waits for
#: pending measurements before it forms by rule 7 instead.
MEASURE_WAIT_S = 20.0
#: Seconds after the last membership change that a target coordinator waits for a live draft node
#: (``join --role draft``) still starting before it forms without one (:func:`draft_wait`).
DRAFT_WAIT_S = 30.0

#: ``join --role`` values whose node forms a group of itself alone
ALONE_ROLES = ("prefill", "draft")


@dataclass(frozen=True)
class AutoInputs:
    """What ``join --plan auto`` decides from.

    Attributes:
        measurements: every node that reported its measurements (:func:`mlxcluster.cluster.measure.combine`).
        model: the model's profile.
        request: what the plan is for (context, optimize target).
        pending: node ids whose measurement is still running (neither figures nor an error yet).
    """

    measurements: Measurements
    model: ModelProfile
    request: Request
    pending: Tuple[str, ...] = ()


@dataclass(frozen=True)
class AutoChoice:
    """The formation ``join --plan auto`` chose: ``members`` in rank order (the coordinator first),
    ``layers`` a pipeline's route text (``""``: TP or a single node), the :class:`Candidate` it forms,
    and ``note`` (``""``, or the better plan it could not form)."""

    members: Tuple[str, ...]
    layers: str
    candidate: Candidate
    note: str = ""


@dataclass(frozen=True)
class PlanInputs:
    """Everything the planner reads.

    Attributes:
        node_id: this node.
        world_size: ``--world-size`` (``None``: the largest of ``valid_world_sizes`` present).
        valid_world_sizes: world sizes the model splits into, e.g. ``(1, 2, 4)``.
        own: this node's state.
        peers: every other node seen, by node id (any :class:`PeerStatus`).
        now: ``time.monotonic()`` of this decision, in seconds.
        changed_at: when a node last joined the live set (or this node got its model): a loss does not count.
        retry_at: no formation is attempted before this time (back-off after a failure).
        announced: the coordinator already announced its current formation as formed.
        layers: this node's ``join --layers`` (``""``: tensor parallelism).
        n_layers: the model's transformer layers (for ``layers``).
        memory_bytes: this node's memory (``--layers auto`` splits by it).
        role: this node's ``join --role`` (``""``, ``"prefill"``, ``"decode"``, ``"draft"``).
        spare: this node was started with ``join --spare``.
        last_world_size: world size of the last formation this node held a rank in (0: none);
            without ``world_size`` spares count only to restore it.
        rank0_idle: this node's rank 0 reported no running and no queued request at its last
            answer (``Generation.Info``); ``False`` when it holds no rank 0 or has not answered.
        exact_world_size: ``join --exact-world-size``: ``world_size`` is a hard requirement (never
            re-form below it).
    """

    node_id: str
    world_size: Optional[int]
    valid_world_sizes: Tuple[int, ...]
    own: OwnState
    peers: Mapping[str, Peer]
    now: float
    changed_at: float = 0.0
    retry_at: float = 0.0
    announced: bool = False
    layers: str = ""
    n_layers: int = 0
    memory_bytes: int = 0
    role: str = ""
    spare: bool = False
    last_world_size: int = 0
    rank0_idle: bool = False
    started_at: float = 0.0
    auto: Optional[AutoInputs] = None
    exact_world_size: bool = False

    @property
    def live(self) -> Tuple[str, ...]:
        """Node ids of the live compatible peers of this node's role, sorted (none for a
        prefill or draft node: it forms alone)."""
        if self.role in ALONE_ROLES:
            return ()
        return tuple(sorted(nid for nid, p in self.peers.items()
                            if p.status is PeerStatus.LIVE and p.info.role == self.role))

    def ready_group(self, role: str) -> str:
        """``host:port`` of a running ``role`` group's rank 0 (the smallest live node id of that role
        whose status reports one ready), ``""`` for none."""
        for nid in sorted(self.peers):
            p = self.peers[nid]
            if (p.status is PeerStatus.LIVE and p.info.role == role and p.report is not None
                    and p.report.state == "ready" and p.report.rank0_address):
                return p.report.rank0_address
        return ""

    @property
    def prefill_peer(self) -> str:
        """A running prefill group's rank 0 (:meth:`ready_group`), ``""`` for none."""
        return self.ready_group("prefill")

    @property
    def draft_peer(self) -> str:
        """A running draft group's rank 0 (:meth:`ready_group`), ``""`` for none."""
        return self.ready_group("draft")

    @property
    def spares(self) -> Tuple[str, ...]:
        """Node ids of the spares among this node (when it is one) and :attr:`live`, sorted."""
        return tuple(sorted(([self.node_id] if self.spare else []) +
                            [nid for nid in self.live if self.peers[nid].info.spare]))

    def candidates(self) -> Tuple[str, ...]:
        """This node and :attr:`live` in the order ranks are handed out: non-spares by node id,
        then spares by node id."""
        spares = set(self.spares)
        return tuple(sorted((self.node_id,) + self.live, key=lambda nid: (nid in spares, nid)))


@dataclass(frozen=True)
class Wait:
    """Nothing to do now; ``reason`` says what the node waits for."""

    reason: str


@dataclass(frozen=True)
class Form:
    """Form a group of ``members`` (node ids in rank order; this node first, as rank 0);
    ``layers``: a pipeline's route (``--layers`` text, one range per member), ``""`` for TP."""

    members: Tuple[str, ...]
    layers: str = ""
    role: str = ""          # join --role of the group ("": ordinary)
    prefill_peer: str = ""  # a decode group's prefill group (host:port)
    draft_peer: str = ""    # the draft node's group the group drafts with by default (host:port)
    shape: str = ""         # join --plan auto: the shape planner's candidate it forms ("": rule 7)
    note: str = ""          # ... and the better plan it could not form, if any
    warning: str = ""       # a formation below --world-size: why (the node logs it as a warning)

    @property
    def world_size(self) -> int:
        return len(self.members)


@dataclass(frozen=True)
class Teardown:
    """Stop this node's rank process. ``tell_members``: also ask every live peer to;
    ``backoff``: delay the next formation attempt (the formation itself failed)."""

    reason: str
    tell_members: bool = False
    backoff: bool = False


@dataclass(frozen=True)
class Announce:
    """Every rank of ``formation`` is ready: announce it formed."""

    formation: Formation


Action = Union[Wait, Form, Teardown, Announce]


def coordinator_id(node_id: str, live: Sequence[str], spares: Sequence[str] = ()) -> str:
    """The coordinator among this node and its live peers: the smallest node id that is not in
    ``spares`` (the smallest of all when every one is a spare: that spare waits, it forms nothing)."""
    everyone = [node_id, *live]
    return min([nid for nid in everyone if nid not in set(spares)] or everyone)


def target_world_size(world_size: Optional[int], valid_world_sizes: Sequence[int], n_live: int,
                      n_spares: int = 0, last_world_size: int = 0, exact: bool = False) -> Optional[int]:
    """The world size to form with ``n_live`` nodes (this one included, ``n_spares`` of them
    spares), ``None`` for none yet.

    ``world_size`` given: it, once ``n_live`` reach it (spares count like any node).  Below that,
    ``None`` while this node has held no rank (``last_world_size`` 0: the first formation waits for
    ``world_size`` nodes) or when ``exact`` (``--exact-world-size``); else -- a member was lost -- the
    largest of ``valid_world_sizes`` up to ``world_size`` that ``n_live`` reach.  Otherwise
    the largest of ``valid_world_sizes`` the ``n_live - n_spares`` non-spares reach alone; when that
    is below ``last_world_size`` (a member was lost), spares fill in: the largest valid size up to
    ``last_world_size`` that all ``n_live`` reach, if larger."""
    if world_size:
        if n_live >= world_size:
            return world_size
        if exact or not last_world_size:
            return None
        return max((n for n in valid_world_sizes if n <= n_live), default=None)
    sizes = [n for n in valid_world_sizes if n <= n_live - n_spares]
    best = max(sizes) if sizes else None
    if n_spares and (best or 0) < last_world_size:
        refill = [n for n in valid_world_sizes if n <= min(n_live, last_world_size)]
        if refill and max(refill) > (best or 0):
            best = max(refill)
    return best


_RANKED: Dict[tuple, Tuple[Candidate, ...]] = {}


def ranked_shapes(m: Measurements, model: ModelProfile, request: Request) -> Tuple[Candidate, ...]:
    """:func:`~mlxcluster.cluster.shape.plan_shape` of the inputs, remembered for the last few inputs
    (the node loop asks at every tick; the answer is the same until a measurement changes).

    Raises:
        ShapeError: as :func:`plan_shape`.
    """
    key = (m.nodes, m.links, tuple(sorted(m.all_sum_us.items())), m.tp_layers, model, request)
    got = _RANKED.get(key)
    if got is None:
        got = plan_shape(m, model, request)
        if len(_RANKED) >= 8:
            _RANKED.pop(next(iter(_RANKED)))
        _RANKED[key] = got
    return got


def _only(m: Measurements, ids: Sequence[str]) -> Measurements:
    keep = set(ids)
    return Measurements(tuple(n for n in m.nodes if n.node_id in keep),
                        tuple(lk for lk in m.links if lk.a in keep and lk.b in keep), m.all_sum_us,
                        tuple(t for t in m.tp_layers if keep.issuperset(t.nodes)))


def _formable(c: Candidate, node_id: str) -> Optional[Tuple[Tuple[str, ...], str]]:
    """``(members in rank order, route text)`` when coordinator ``node_id`` can form ``c`` today."""
    if c.kind == "single" and c.nodes == (node_id,):
        return (node_id,), ""
    if c.kind == "tp" and node_id in c.nodes:
        return (node_id,) + tuple(n for n in c.nodes if n != node_id), ""
    if c.kind == "pipeline" and c.nodes and c.nodes[0] == node_id and c.topology is not None and c.topology.layers:
        return c.nodes, c.topology.layers
    return None


def auto_choice(node_id: str, candidates: Sequence[str], auto: AutoInputs) -> Tuple[Optional[AutoChoice], str]:
    """What coordinator ``node_id`` forms over ``candidates`` (node ids that may take a rank, this one
    included) by measurement: ``(choice, "")``, or ``(None, why)`` -- ``why`` starts with ``"pending"``
    while a candidate's measurement runs (wait for it), else it says why rule 7 decides (a node without
    measurements, a planner error, nothing formable here)."""
    pending = sorted(n for n in candidates if n in auto.pending)
    if pending:
        return None, f"pending: measuring {', '.join(pending)}"
    have = {n.node_id for n in auto.measurements.nodes}
    missing = sorted(n for n in candidates if n not in have)
    if missing:
        return None, f"no measurements of {', '.join(missing)}"
    try:
        ranked = ranked_shapes(_only(auto.measurements, candidates), auto.model, auto.request)
    except ShapeError as exc:
        return None, str(exc)
    best = next((c for c in ranked if c.chosen), None)
    for c in ranked:
        if c.prediction is None or not (c.chosen or c.reason.startswith(("slower than", "within"))):
            break  # the fitting candidates come first, best first
        got = _formable(c, node_id)
        if got is not None:
            note = "" if c is best or best is None else f"{best.label} is predicted faster, but needs another coordinator"
            return AutoChoice(got[0], got[1], c, note), ""
    return None, "no plan that fits can be formed with this node as rank 0"


def predicted_for(auto: AutoInputs, members: Sequence[str], layers: str = "") -> Optional[Candidate]:
    """The shape planner's candidate that runs what formation ``members`` (rank order) with route
    ``layers`` runs (``None``: not measured, or no such candidate), for its predicted figures."""
    try:
        ranked = ranked_shapes(_only(auto.measurements, members), auto.model, auto.request)
    except ShapeError:
        return None
    for c in ranked:
        if c.prediction is None:
            continue
        if layers:
            if c.kind == "pipeline" and c.nodes == tuple(members) and c.topology is not None \
                    and c.topology.layers == layers:
                return c
        elif c.kind in ("single", "tp") and set(c.nodes) == set(members):
            return c
    return None


def _auto(x: PlanInputs) -> Optional[Tuple[Optional[AutoChoice], str]]:
    """:func:`auto_choice` for ``x`` when ``join --plan auto`` decides (no ``--world-size``, role or spare
    in play), else ``None``."""
    if x.auto is None or x.world_size or x.role or x.spares:
        return None
    return auto_choice(x.node_id, x.candidates(), x.auto)


def plan(x: PlanInputs) -> Action:
    """The next action of node ``x.node_id`` (see the module docstring for the rules)."""
    own = x.own
    if isinstance(own, (Bootstrapping, Running, Failed)):
        return _lost_member(x, own) or _stale_formation(x, own) or _failed_member(x, own) or \
            _prefill_moved(x, own) or _formed(x, own) or _grow(x, own) or \
            Wait(f"rank {own.rank} of formation {own.formation.formation_id}: {wire_state(own)}")
    if x.layers or any(x.peers[nid].info.layers for nid in x.live if not x.peers[nid].info.spare):
        if x.spare:
            return Wait("a spare takes no part in a pipeline (its peers advertise --layers)")
        return _with_draft(x, _pipeline(x))
    if x.role == "decode" and not x.prefill_peer:
        return Wait("no prefill group running yet (a node started with join --role prefill)")
    action = _not_coordinator(x) or _size_and_timing(x)
    if isinstance(action, Form) and x.role:
        action = Form(action.members, role=x.role, prefill_peer=x.prefill_peer if x.role == "decode" else "")
    return _with_draft(x, action)


def draft_wait(x: PlanInputs) -> Optional[Wait]:
    """A target node's wait for a draft node before it forms: a :class:`Wait` naming the live ``draft``
    peer that has not reported a ready rank 0 yet (its model still loading), while less than
    ``DRAFT_WAIT_S`` passed since the last membership change; ``None`` otherwise (a draft group is
    ready, none is live, or the wait is over: form without one)."""
    if x.role in ALONE_ROLES or x.draft_peer or x.now - x.changed_at >= DRAFT_WAIT_S:
        return None
    starting = sorted(nid for nid, p in x.peers.items() if p.status is PeerStatus.LIVE and p.info.role == "draft"
                      and not (p.report is not None and p.report.state == "failed"))
    if not starting:
        return None
    left = DRAFT_WAIT_S - (x.now - x.changed_at)
    return Wait(f"draft node {starting[0]} is starting (forming without it {left:.0f} s from now)")


def _with_draft(x: PlanInputs, action: Action) -> Action:
    """A target formation's :class:`Form` with the running draft group (:attr:`PlanInputs.draft_peer`),
    or :func:`draft_wait`'s wait for one that is starting; any other action as it is."""
    if not isinstance(action, Form) or x.role in ALONE_ROLES:
        return action
    return draft_wait(x) or (replace(action, draft_peer=x.draft_peer) if x.draft_peer else action)


def _prefill_moved(x: PlanInputs, own) -> Optional[Action]:
    f = own.formation
    if f.role != "decode" or f.coordinator_id != x.node_id:
        return None
    now = x.prefill_peer
    if not now or now == f.prefill_peer:
        return None  # none running: requests fail closed (or fall back) until one is
    return Teardown(f"the prefill group moved from {f.prefill_peer} to {now}", tell_members=True)


def pipeline_route(nodes: Sequence[Tuple[str, str, int]], n_layers: int) -> Tuple[Tuple[str, ...], str]:
    """The pipeline of ``nodes`` -- ``(node_id, advertised layers, memory bytes)`` each --
    as ``(node ids in rank order, route text)``: the ``K:output`` node first, the others in
    layer order; with ``auto`` on every node, the smallest node id first and the layers split
    by memory (:func:`~mlxcluster.model.layout.auto_layers`, reverse), evenly when some node's
    memory is unknown (0).

    Raises:
        LayoutError: one line -- a node without a range, ``auto`` mixed with ranges, a bad
            range, no or several ``K:output`` nodes, or ranges that do not tile the model.
    """
    bare = sorted(nid for nid, layers, _ in nodes if not layers)
    if bare:
        raise LayoutError(f"node(s) {', '.join(bare)} advertise no --layers; a pipeline needs every node's range")
    autos = [nid for nid, layers, _ in nodes if layers.strip() == "auto"]
    if autos and len(autos) != len(nodes):
        raise LayoutError("some nodes advertise --layers auto and others a range: use one or the other")
    if autos:
        ordered = sorted(nodes)
        mems = [mem for _, _, mem in ordered[1:] + ordered[:1]]  # layer order: rank 0 is last
        # a node's memory unknown (0: not advertised, or an implausible TXT value): an even split
        weights = mems if all(m > 0 for m in mems) else None
        route = make_route(auto_layers(n_layers, len(ordered), weights), n_layers)
        return tuple(nid for nid, _, _ in ordered), route.spec()
    parsed = []
    for nid, layers, _ in nodes:
        try:
            parsed.append((parse_range(layers, n_layers), nid))
        except LayoutError as exc:
            raise LayoutError(f"node {nid}: {exc}") from None
    outputs = sorted(nid for r, nid in parsed if r.output)
    if len(outputs) != 1:
        raise LayoutError("no node advertises K:output" if not outputs else
                          f"nodes {', '.join(outputs)} all advertise the output (K:output)")
    ordered = sorted(parsed, key=lambda rn: (not rn[0].output, rn[0].start, rn[1]))
    route = make_route([r for r, _ in ordered], n_layers)
    return tuple(nid for _, nid in ordered), route.spec()


def _pipeline(x: PlanInputs) -> Action:
    live = [nid for nid in x.live if not x.peers[nid].info.spare]  # spares take no pipeline stage
    nodes = [(x.node_id, x.layers, x.memory_bytes)] + [(nid, x.peers[nid].info.layers,
                                                       x.peers[nid].info.memory_bytes) for nid in live]
    try:
        members, spec = pipeline_route(nodes, x.n_layers)
    except LayoutError as exc:
        return Wait(f"no pipeline route yet: {exc}")
    if members[0] != x.node_id:
        return Wait(f"coordinator is {members[0]} (rank 0 of the route {spec})")
    if x.now - x.changed_at < SETTLE_S:
        return Wait("membership settling")
    if x.now < x.retry_at:
        return Wait("backing off after a failed formation attempt")
    for nid in members[1:]:
        report = x.peers[nid].report
        if report is not None and report.formation_id and report.state not in IDLE_STATES:
            return Wait(f"node {nid} holds a rank in formation {report.formation_id}")
    return Form(members, layers=spec)


def _lost_member(x: PlanInputs, own) -> Optional[Action]:
    live = set(x.live)
    lost = [m for m in own.formation.node_ids if m != x.node_id and m not in live]
    if not lost:
        return None
    last_ok = max((x.peers[m].last_ok for m in lost if m in x.peers), default=0.0)
    if isinstance(own, Running) and x.now - last_ok < RANK_REPORT_S:
        # a peer lost at once (its daemon refused): its rank's own failure reaches this node's rank
        # in milliseconds -- let the rank report it first (rank 0 names the lost rank to its
        # clients), rather than kill this rank under it.  Every rank waits, not only rank 0: a
        # member that let go at once would break its own link to rank 0 first whenever the lost
        # node's rank outlives its daemon for a moment (its parent watch), and rank 0 would name
        # the wrong rank (tried: 0.25 s, and rank 0 alone waiting, both failed test_cluster)
        return None
    why = own.error if isinstance(own, Failed) and own.error else f"lost node(s) {', '.join(lost)}"
    return Teardown(why, tell_members=own.formation.coordinator_id == x.node_id)


def _stale_formation(x: PlanInputs, own) -> Optional[Action]:
    f = own.formation
    if f.coordinator_id == x.node_id or x.now - own.since <= MEMBER_GRACE_S:
        return None
    peer = x.peers.get(f.coordinator_id)
    if peer is None or peer.status is not PeerStatus.LIVE or peer.report is None:
        return None
    if peer.report.formation_id == f.formation_id:
        return None
    now_holds = peer.report.formation_id or "none"
    return Teardown(f"formation {f.formation_id} is stale: its coordinator {f.coordinator_id} holds {now_holds}")


def _failed_member(x: PlanInputs, own) -> Optional[Action]:
    f = own.formation
    if f.coordinator_id != x.node_id:
        return None
    failed = isinstance(own, Failed)
    for nid in f.node_ids:
        if nid == x.node_id:
            continue
        report = x.peers[nid].report
        if report is None:
            continue
        if report.formation_id != f.formation_id:
            failed |= x.now - own.since > MEMBER_GRACE_S
        else:
            failed |= report.state == "failed"
    if not failed:
        return None
    why = own.error if isinstance(own, Failed) else "a member's rank process failed"
    return Teardown(why, tell_members=True, backoff=True)


def _formed(x: PlanInputs, own) -> Optional[Action]:
    f = own.formation
    if f.coordinator_id != x.node_id or x.announced or not isinstance(own, Running):
        return None
    for nid in f.node_ids:
        if nid == x.node_id:
            continue
        report = x.peers[nid].report
        if report is None or report.formation_id != f.formation_id or report.state != "ready":
            return None
    return Announce(f)


def _grow(x: PlanInputs, own) -> Optional[Action]:
    """Rule 4b: the coordinator of a formed group without ``--world-size`` tears it down to form
    a larger one (see the module docstring)."""
    f = own.formation
    below = x.world_size is not None and not x.exact_world_size and f.world_size < x.world_size
    if (x.world_size and not below) or f.layers or f.coordinator_id != x.node_id or not x.announced or \
            not isinstance(own, Running):
        return None
    n = target_world_size(x.world_size, x.valid_world_sizes, 1 + len(x.live), len(x.spares), x.last_world_size)
    auto = _auto(x)
    if auto is not None:
        choice, why = auto
        if choice is not None:
            n = len(choice.members)  # the shape chosen by measurement, not the largest valid size
        elif why.startswith("pending"):
            return None  # a returning node's measurement: decide once it is here
    if n is None or n <= f.world_size:
        return None
    leader = coordinator_id(x.node_id, x.live, x.spares)
    if leader != x.node_id:
        # rule 4c: another formation's coordinator (a smaller node id) would lead the larger group
        # (two formations formed apart, e.g. across a partition): yield to it, as growth would
        return _when_settled(x, f"yielding world size {f.world_size} to {leader}'s formation of {n}")
    chosen = x.candidates()[:n]
    for nid in chosen:
        if nid in f.node_ids:
            continue
        report = x.peers[nid].report
        if report is None or (report.formation_id and report.state not in IDLE_STATES):
            return None  # a new node that holds a rank elsewhere (or has not answered yet)
    return _when_settled(x, f"growing from world size {f.world_size} to {n}")


def _when_settled(x: PlanInputs, what: str) -> Optional[Action]:
    """Teardown for ``what`` once membership has been unchanged for ``GROW_SETTLE_S`` and rank 0
    is idle, or ``GROW_DELAY_S`` regardless (requests in flight are replayed); else ``None``."""
    settled = x.now - x.changed_at
    if settled < GROW_SETTLE_S:
        return None
    if not x.rank0_idle and settled < GROW_DELAY_S:
        return None
    why = "its rank 0 is idle" if x.rank0_idle else f"still busy after {GROW_DELAY_S:.0f} s: requests are replayed"
    return Teardown(f"{what} ({why})", tell_members=True)


def _not_coordinator(x: PlanInputs) -> Optional[Action]:
    coordinator = coordinator_id(x.node_id, x.live, x.spares)
    if coordinator == x.node_id and x.spare:
        return Wait("spare: no non-spare node is live (a spare takes a rank only in a group a non-spare forms)")
    if coordinator == x.node_id:
        return None
    return Wait(f"spare, idle until a member is lost (coordinator is {coordinator})" if x.spare
                else f"coordinator is {coordinator}")


def _size_and_timing(x: PlanInputs) -> Action:
    live = x.live
    n_live = 1 + len(live)
    n = target_world_size(x.world_size, x.valid_world_sizes, n_live, len(x.spares), x.last_world_size,
                          x.exact_world_size)
    choice = None
    auto = _auto(x)
    if auto is not None:
        choice, why = auto
        if choice is None and why.startswith("pending") and \
                x.now - max(x.started_at, x.changed_at) < MEASURE_WAIT_S:
            return Wait(f"choosing the shape by measurement: {why[len('pending: '):]}")
        if choice is not None:
            n = len(choice.members)
    if n is None:
        if x.world_size:
            return _world_size_wait(x, n_live)
        return Wait(f"the model splits into none of {n_live} node(s) (valid world sizes: "
                    f"{', '.join(map(str, x.valid_world_sizes))})")
    if x.now - x.changed_at < SETTLE_S:
        return Wait("membership settling")
    if not x.world_size and n < max(x.valid_world_sizes) and x.now - x.started_at < DISCOVERY_S:
        # nodes started together find each other within seconds: forming below the largest size
        # at once would leave each alone in a formation of its own
        return Wait(f"discovering peers ({DISCOVERY_S:.0f} s after start) before forming at world size {n}")
    if x.now < x.retry_at:
        return Wait("backing off after a failed formation attempt")
    chosen = choice.members if choice is not None else x.candidates()[:n]  # this node (coordinator) first
    for nid in chosen[1:]:
        report = x.peers[nid].report
        if report is not None and report.formation_id and report.state not in IDLE_STATES:
            return Wait(f"node {nid} holds a rank in formation {report.formation_id}")
    if choice is None:
        return Form(chosen, warning=_below_world_size(x, n))
    return Form(chosen, layers=choice.layers, shape=choice.candidate.label, note=choice.note)


def _world_size_wait(x: PlanInputs, n_live: int) -> Wait:
    """Rule 7's wait for ``--world-size`` nodes, naming why: e.g. "exact world size 3 requested
    (--exact-world-size), 2 live (n0, n1); waiting for 1 more (lost: n2)", or "2 of 3 nodes live
    (n0, n1); waiting for 1 more (seen, not answering: n2)" before a first formation."""
    seen = sorted(nid for nid, p in x.peers.items() if p.status is PeerStatus.SEEN)
    lost = sorted(nid for nid, p in x.peers.items() if p.status is PeerStatus.LOST)
    hints = ([f"seen, not answering: {', '.join(seen)}"] if seen else []) + \
        ([f"lost: {', '.join(lost)}"] if lost else [])
    who = f"({', '.join((x.node_id,) + x.live)}); waiting for {x.world_size - n_live} more" + \
        (f" ({'; '.join(hints)})" if hints else "")
    if x.exact_world_size:
        return Wait(f"exact world size {x.world_size} requested (--exact-world-size), {n_live} live {who}")
    return Wait(f"{n_live} of {x.world_size} nodes live {who}")


def _below_world_size(x: PlanInputs, n: int) -> str:
    """Why a formation of ``n`` is below ``--world-size`` (``""`` when it is not)."""
    if not x.world_size or n >= x.world_size:
        return ""
    lost = sorted(nid for nid, p in x.peers.items() if p.status is PeerStatus.LOST)
    return (f"re-forming at world size {n}, below --world-size {x.world_size}: {1 + len(x.live)} node(s) live"
            + (f" (lost: {', '.join(lost)})" if lost else "") + f", no spare; it grows back to {x.world_size} "
            "when nodes return (join --exact-world-size waits for them instead)")

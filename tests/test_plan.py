"""The formation planner and the typed membership states, as plain functions.

No processes, no network: every test builds typed states, calls
``plan`` (or a membership transition) and checks the action it returns.
"""

from __future__ import annotations

import copy
from typing import Dict, Iterable, Optional

import pytest

from mlxcluster.cluster import ranks
from mlxcluster.cluster.discovery import PROTOCOL_VERSION, NodeInfo
from mlxcluster.cluster.membership import (
    LATE_FACTOR, PEAK_DECAY, PEER_TIMEOUT_S, STALL_S, STALL_STEPS, STALLED_PEER_TIMEOUT_S, Bootstrapping, Failed, Formation, Idle, Member, Peer, PeerReport, PeerStatus, Preparing,
    Running, RttEstimate, advertised, heartbeat, peer_timeout, proved, refusal, silent_since, version_error,
    wire_state)
from mlxcluster.cluster.plan import (
    MEMBER_GRACE_S, SETTLE_S, Announce, Form, PlanInputs, Teardown, Wait, coordinator_id, plan, target_world_size)
DIGEST = "abc123"
NOW = 1000.0


def info(node_id: str, **kw) -> NodeInfo:
    fields = dict(node_id=node_id, cluster="lab", address="127.0.0.1", port=50000 + len(node_id),
                  version=PROTOCOL_VERSION, memory_bytes=2**34, platform="Linux-x86_64", chip="",
                  backends=["ring"], model_digest=DIGEST, state="idle")
    fields.update(kw)
    return NodeInfo(**fields)


def live(node_id: str, state: str = "idle", formation_id: str = "") -> Peer:
    return Peer(info=info(node_id), status=PeerStatus.LIVE, last_ok=NOW,
                report=PeerReport(state=state, formation_id=formation_id))


def peers(*items: Peer) -> Dict[str, Peer]:
    return {p.node_id: p for p in items}


def inputs(me: str, peer_map: Dict[str, Peer], own=Idle(), world_size: Optional[int] = 3,
           valid: Iterable[int] = (1, 2, 3), now: float = NOW, changed_at: float = 0.0, **kw) -> PlanInputs:
    return PlanInputs(node_id=me, world_size=world_size, valid_world_sizes=tuple(valid), own=own, peers=peer_map,
                      now=now, changed_at=changed_at, **kw)


def formation(*node_ids: str, fid: str = "f1") -> Formation:
    return Formation(formation_id=fid, coordinator_id=node_ids[0], backend="ring",
                     members=tuple(Member(rank=r, node_id=n, address="127.0.0.1", ring_port=41000 + r,
                                          control_port=42000 + r) for r, n in enumerate(node_ids)),
                     model_digest=DIGEST, weights="float32")


def check(me: str, peer_map, **kw):
    return plan(inputs(me, peer_map, **kw))


# -- formation and coordinator ---------------------------------------------------------------

def test_three_nodes_form_with_the_smallest_id_as_rank_0():
    action = check("node-0", peers(live("node-2"), live("node-1")))
    assert action == Form(("node-0", "node-1", "node-2"))
    assert action.world_size == 3


def test_exactly_one_coordinator_and_it_is_the_smallest_id():
    ids = ["node-b", "node-a", "node-c"]
    actions = {}
    for me in ids:
        actions[me] = check(me, peers(*[live(n) for n in ids if n != me]))
    assert actions["node-a"] == Form(("node-a", "node-b", "node-c"))
    for other in ("node-b", "node-c"):
        assert actions[other] == Wait("coordinator is node-a")
    assert coordinator_id("node-b", ["node-c", "node-a"]) == "node-a"


def test_largest_valid_world_size_among_live_nodes():
    three = peers(live("n1"), live("n2"))
    assert check("n0", three, world_size=None, valid=(1, 2, 4)) == Form(("n0", "n1"))
    assert check("n0", three, world_size=None, valid=(1, 3)) == Form(("n0", "n1", "n2"))
    assert target_world_size(None, (1, 2, 4), 5) == 4
    assert target_world_size(4, (1, 2, 4), 3) is None


def test_no_valid_world_size_waits():
    action = check("n0", peers(live("n1")), world_size=3)
    assert action == Wait("2 of 3 nodes live (n0, n1); waiting for 1 more")
    action = check("n0", {}, world_size=None, valid=(2, 4))
    assert isinstance(action, Wait) and "2, 4" in action.reason


def test_waits_for_membership_to_settle_and_for_back_off():
    p = peers(live("n1"), live("n2"))
    assert check("n0", p, changed_at=NOW - SETTLE_S / 2) == Wait("membership settling")
    assert isinstance(check("n0", p, changed_at=NOW - SETTLE_S), Form)
    assert isinstance(check("n0", p, retry_at=NOW + 1), Wait)


def test_a_peer_holding_a_rank_elsewhere_is_waited_for():
    action = check("n0", peers(live("n1", "ready", "other"), live("n2")))
    assert isinstance(action, Wait) and "n1" in action.reason
    # A failed or idle peer may be re-used.
    assert isinstance(check("n0", peers(live("n1", "failed", "other"), live("n2"))), Form)


# -- refused peers -----------------------------------------------------------------------------

def test_unverified_or_incompatible_peers_never_get_a_rank():
    # A node that never proves the secret over TLS never answers a heartbeat: it stays SEEN.
    intruder = advertised(None, info("a-intruder"), refusal(info("a-intruder"), "node-0", DIGEST))
    assert intruder.status is PeerStatus.SEEN
    assert heartbeat(intruder, None, NOW + 100).status is PeerStatus.SEEN
    other_model = info("a-other", model_digest="fff")
    why = refusal(other_model, "node-0", DIGEST)
    assert "different model" in why
    refused = advertised(None, other_model, why)
    assert refused.status is PeerStatus.REFUSED
    # A refused peer stays refused through heartbeats (it is never asked).
    assert heartbeat(refused, PeerReport("idle"), NOW).status is PeerStatus.REFUSED
    assert refusal(info("node-0"), "node-0", DIGEST) == "same node id as this node"
    assert refusal(info("node-1"), "node-0", DIGEST) == ""
    p = peers(live("node-1"), live("node-2"), refused, intruder)
    # Smallest ids, yet neither coordinates nor gets a rank.
    assert check("node-0", p) == Form(("node-0", "node-1", "node-2"))
    assert check("node-0", p, world_size=None, valid=(1, 2, 3, 4, 5)) == Form(("node-0", "node-1", "node-2"))


def test_protocol_version_mismatch_is_refused_naming_both_versions():
    why = refusal(info("node-1", version=PROTOCOL_VERSION + 98), "node-0", DIGEST)
    assert f"protocol version {PROTOCOL_VERSION + 98}" in why and f"this node's {PROTOCOL_VERSION}" in why
    assert advertised(None, info("node-1", version=99), why).status is PeerStatus.REFUSED
    err = version_error(99)
    assert "protocol version 99" in err and str(PROTOCOL_VERSION) in err
    assert version_error(PROTOCOL_VERSION) == ""


def test_a_peer_not_answering_heartbeats_is_not_counted():
    seen = advertised(None, info("node-1"), "")
    assert seen.status is PeerStatus.SEEN
    assert check("node-0", peers(seen, live("node-2")), world_size=None) == Form(("node-0", "node-2"))
    # Its first answer makes it live.
    assert heartbeat(seen, PeerReport("idle"), NOW).status is PeerStatus.LIVE


# -- loss, failure, re-forming ----------------------------------------------------------------

def test_heartbeats_lose_a_peer_after_the_timeout_and_take_it_back():
    peer = live("n1")
    assert heartbeat(peer, None, NOW + PEER_TIMEOUT_S) == peer
    lost = heartbeat(peer, None, NOW + PEER_TIMEOUT_S + 0.1)
    assert lost.status is PeerStatus.LOST and "no heartbeat" in lost.reason
    back = heartbeat(lost, PeerReport("idle"), NOW + 10)
    assert back.status is PeerStatus.LIVE and back.reason == "" and back.last_ok == NOW + 10
    # An unverified peer simply takes a new endpoint: it must still prove itself there.
    seen = advertised(None, info("n1"), "")
    assert advertised(seen, info("n1", port=60000), "") == Peer(info=info("n1", port=60000), status=PeerStatus.SEEN)


def test_a_silent_member_is_lost_sooner_only_while_the_own_rank_is_stuck_in_a_step():
    """Silence and a stuck step together (a rank waits in a collective for a frozen one) lose a
    member after STALLED_PEER_TIMEOUT_S; either signal alone waits the full timeout."""
    assert peer_timeout(PEER_TIMEOUT_S, member=True, own_busy_s=STALL_S) == STALLED_PEER_TIMEOUT_S
    assert peer_timeout(PEER_TIMEOUT_S, member=True, own_busy_s=STALL_S - 0.01) == PEER_TIMEOUT_S  # a short step
    assert peer_timeout(PEER_TIMEOUT_S, member=False, own_busy_s=10.0) == PEER_TIMEOUT_S  # not in its formation
    assert peer_timeout(0.5, member=True, own_busy_s=10.0) == 0.5  # --peer-timeout below it stays
    peer = live("n1")
    limit = peer_timeout(PEER_TIMEOUT_S, member=True, own_busy_s=2.0)
    assert heartbeat(peer, None, NOW + limit + 0.1, timeout_s=limit).status is PeerStatus.LOST
    assert heartbeat(peer, None, NOW + limit + 0.1, timeout_s=PEER_TIMEOUT_S) == peer


def test_a_member_whose_heartbeats_come_back_slowly_is_given_the_silence_they_show():
    """Under load (heartbeat round trips of 0.3-0.9 s), the shorter limit grows to what the peer's
    measured round trips allow (RFC 6298's srtt + 4 rttvar after one interval) instead of losing a
    slow but live node after 1 s; never beyond --peer-timeout; on a quiet link it stays 1 s."""
    quiet = RttEstimate()
    for r in (0.004, 0.006, 0.005, 0.005):
        quiet = quiet.update(r)
    assert peer_timeout(PEER_TIMEOUT_S, True, 2.0, quiet, 0.5) == STALLED_PEER_TIMEOUT_S
    loaded = RttEstimate()
    for r in (0.3, 0.9, 0.4, 0.8, 0.3):
        loaded = loaded.update(r)
    limit = peer_timeout(PEER_TIMEOUT_S, True, 2.0, loaded, 0.5)
    assert STALLED_PEER_TIMEOUT_S < limit <= PEER_TIMEOUT_S
    assert limit == min(PEER_TIMEOUT_S, 0.5 + max(loaded.srtt + 4 * loaded.rttvar, LATE_FACTOR * loaded.peak))
    assert RttEstimate().update(0.2) == RttEstimate(0.2, 0.1, 1, 0.2)  # RFC 6298 2.2: the first sample



def test_a_silent_peer_whose_formation_was_deserted_is_lost_sooner_by_a_node_outside_it():
    """A spare (or the next coordinator) holds no rank beside a frozen member, so its own step never
    stalls; it sees instead the frozen member's formation-mates leave that formation. Silence plus a
    deserted formation lose the peer after STALLED_PEER_TIMEOUT_S (the coordinator waited the full
    3 s for it, issue 48's freeze bench); neither alone shortens the limit, and the peer's own slow
    round trips still lengthen it."""
    assert peer_timeout(PEER_TIMEOUT_S, member=False, own_busy_s=0.0, deserted=True) == STALLED_PEER_TIMEOUT_S
    assert peer_timeout(PEER_TIMEOUT_S, member=False, own_busy_s=0.0, deserted=False) == PEER_TIMEOUT_S
    loaded = RttEstimate()
    for r in (0.3, 0.9, 0.4, 0.8, 0.3):
        loaded = loaded.update(r)
    assert STALLED_PEER_TIMEOUT_S < peer_timeout(PEER_TIMEOUT_S, False, 0.0, loaded, 0.5, deserted=True) \
        <= PEER_TIMEOUT_S


def test_the_node_judges_a_peer_of_a_deserted_formation_by_the_short_limit():
    """NodeDaemon: n1 and n2 report ranks in formation f1; n1 then reports itself idle (it left f1):
    n2, still claiming f1 and silent, is judged against the short limit; a peer of a formation
    nobody left keeps the full timeout, and a formation this node itself left counts too."""
    import shutil

    from mlxcluster.cluster.node import NodeConfig, NodeDaemon

    daemon = NodeDaemon(NodeConfig(cluster="lab", secret="correct horse battery staple", node_id="n0"))
    try:
        daemon._set_peer(live("n1", "ready", "f1"), "n1")
        daemon._set_peer(live("n2", "ready", "f1"), "n2")
        assert daemon._silence_limit("n2", NOW) == PEER_TIMEOUT_S
        daemon._note_left("n1", PeerReport("ready", "f1"), PeerReport("ready", "f1"))  # still in it
        assert daemon._silence_limit("n2", NOW) == PEER_TIMEOUT_S
        daemon._note_left("n1", PeerReport("ready", "f1"), PeerReport("idle"))
        assert daemon._silence_limit("n2", NOW) == STALLED_PEER_TIMEOUT_S
        assert daemon._silence_limit("n1", NOW) == PEER_TIMEOUT_S  # its own leaving is no signal on it
        daemon._set_peer(live("n3", "ready", "f2"), "n3")
        daemon.own = Running(formation("n0", "n3", fid="f2"), 0, since=0.0)
        daemon._set_own(Idle())  # this node tore its rank in f2 down
        assert daemon._silence_limit("n3", NOW) == STALLED_PEER_TIMEOUT_S
    finally:
        daemon.stop()
        daemon.server.stop(grace=0)
        shutil.rmtree(daemon._tmp, ignore_errors=True)

# -- issue 48 item 3: a slow member is not a frozen one -------------------------------------------

def test_a_node_that_asks_late_does_not_charge_its_own_lateness_to_the_peer():
    """This node's loop was starved: the heartbeat due at NOW + 0.5 went out at NOW + 1.2 (the peer
    had answered the last one at NOW).  Judged from the last answer alone, the peer -- which answers
    in 10 ms -- would be lost at once under the 1 s stalled limit (issue 48's "lost ... back 13 ms
    later"); its silence counts from one interval before this node asked.  A frozen peer, asked on
    time, is still lost after the limit."""
    peer = live("n1")  # last_ok NOW
    since = silent_since(NOW, NOW + 1.2, 0.5)
    assert since == NOW + 0.7
    assert heartbeat(peer, None, NOW + 1.21, timeout_s=1.0, since=since) == peer
    assert heartbeat(peer, None, NOW + 1.21, timeout_s=1.0).status is PeerStatus.LOST  # the old rule
    frozen = silent_since(NOW, NOW + 0.5, 0.5)  # asked on time: the silence counts from its last answer
    assert frozen == NOW
    assert heartbeat(peer, None, NOW + 1.01, timeout_s=1.0, since=frozen).status is PeerStatus.LOST
    assert silent_since(NOW, 0.0, 0.5) == NOW  # not asked since: from its last answer


def test_a_step_as_long_as_this_machines_recent_steps_is_no_stall():
    """A loaded machine decodes a TP=3 step in ~0.7 s: being 1 s into such a step is its pace, not a
    rank waiting for a frozen one -- the short limit needs STALL_STEPS times the slowest recent step
    (and STALL_S at least, on a fast machine)."""
    assert peer_timeout(PEER_TIMEOUT_S, True, own_busy_s=1.0, own_step_s=0.7) == PEER_TIMEOUT_S
    assert peer_timeout(PEER_TIMEOUT_S, True, own_busy_s=STALL_STEPS * 0.7, own_step_s=0.7) == STALLED_PEER_TIMEOUT_S
    assert peer_timeout(PEER_TIMEOUT_S, True, own_busy_s=STALL_S, own_step_s=0.01) == STALLED_PEER_TIMEOUT_S


def test_a_member_that_once_answered_late_keeps_the_longer_limit_for_a_while():
    """A CPU-starved peer answers in 5 ms most of the time and now and then ~0.9 s late.  RFC 6298's
    srtt + 4 rttvar forgets the spike within a few answers (its limit falls back to 1 s, and the next
    spike loses a live node); the decaying peak keeps LATE_FACTOR times it for tens of seconds."""
    rtt = RttEstimate()
    for r in [0.005] * 8 + [0.9] + [0.005] * 10:
        rtt = rtt.update(r)
    assert 0.5 + rtt.srtt + 4 * rtt.rttvar < STALLED_PEER_TIMEOUT_S  # RFC 6298 alone: forgotten
    assert rtt.peak == pytest.approx(0.9 * PEAK_DECAY ** 10)
    limit = peer_timeout(PEER_TIMEOUT_S, True, 5.0, rtt, 0.5)
    assert limit == pytest.approx(0.5 + LATE_FACTOR * 0.9 * PEAK_DECAY ** 10) and limit > 1.9
    # a second spike like the first (silence 0.5 s interval + 0.9 s) is within it; a freeze is not
    assert heartbeat(live("n1"), None, NOW + 1.4, timeout_s=limit) == live("n1")
    assert heartbeat(live("n1"), None, NOW + limit + 0.01, timeout_s=limit).status is PeerStatus.LOST
    for _ in range(400):  # ~200 s of quick answers: the spike is forgotten, the limit is 1 s again
        rtt = rtt.update(0.005)
    assert peer_timeout(PEER_TIMEOUT_S, True, 5.0, rtt, 0.5) == STALLED_PEER_TIMEOUT_S


def test_a_peer_whose_daemon_refuses_the_connection_is_lost_at_once():
    """A killed daemon's port refuses connections: lost now, not PEER_TIMEOUT_S later (a frozen or
    unreachable one still gets the timeout); its answer takes it back."""
    peer = live("n1")
    lost = heartbeat(peer, None, NOW + 0.1, refused=True)
    assert lost.status is PeerStatus.LOST and "connection refused" in lost.reason
    assert heartbeat(lost, None, NOW + 0.2, refused=True) == lost
    assert heartbeat(lost, PeerReport("idle"), NOW + 1).status is PeerStatus.LIVE
    assert heartbeat(peer, None, NOW + 0.1) == peer  # a timeout alone: not yet


def test_a_replayed_or_forged_advertisement_does_not_move_a_verified_peer():
    peer = live("n1", "ready", "f1")
    fake = info("n1", port=60000)
    moved = advertised(peer, fake, "")
    # Still live at its proven endpoint: the planner sees no change at all.
    assert moved.status is PeerStatus.LIVE and moved.info == peer.info and moved.pending == fake
    f = formation("n0", "n1", "n2")
    p = peers(moved, live("n2", "ready", "f1"))
    assert check("n0", p, own=Running(f, 0, since=0.0), announced=True) == check(
        "n0", peers(peer, live("n2", "ready", "f1")), own=Running(f, 0, since=0.0), announced=True)
    # The real record again clears the pending endpoint; a record that would refuse it is ignored.
    assert advertised(moved, info("n1", state="formed"), "").pending is None
    assert advertised(peer, info("n1", model_digest="fff"), "different model") == peer
    # A lost peer keeps its endpoint too until the new one proves the node id (a real restart).
    lost = heartbeat(peer, None, NOW + PEER_TIMEOUT_S + 1)
    assert advertised(lost, fake, "").status is PeerStatus.LOST
    after = proved(advertised(lost, fake, ""), fake, PeerReport("idle"), NOW + 20)
    assert (after.status, after.info, after.pending, after.last_ok) == (PeerStatus.LIVE, fake, None, NOW + 20)


def test_a_member_lets_go_of_a_stale_formation():
    """A node frozen (or cut off) while its coordinator re-formed sees the coordinator hold
    another formation, and tears its old rank down instead of blocking the re-formation."""
    f = formation("n0", "n1", "n2")
    own = Running(f, 2, since=NOW - MEMBER_GRACE_S - 1)
    for coordinator in (live("n0", "idle", ""), live("n0", "ready", "f2")):
        action = check("n2", peers(coordinator, live("n1", "idle", "")), own=own)
        assert isinstance(action, Teardown) and "stale" in action.reason and not action.tell_members
    # Not while the coordinator still holds it, and not within the grace period after a bootstrap
    # (the coordinator's last report may predate it).
    assert isinstance(check("n2", peers(live("n0", "ready", "f1"), live("n1", "ready", "f1")), own=own), Wait)
    fresh = Running(f, 2, since=NOW - 1)
    assert isinstance(check("n2", peers(live("n0", "idle", ""), live("n1", "ready", "f1")), own=fresh), Wait)
    # The coordinator meanwhile waits for the stale node (rule: a chosen peer holds a rank elsewhere).
    action = check("n0", peers(live("n1"), live("n2", "ready", "f1")), now=NOW + SETTLE_S)
    assert isinstance(action, Wait) and "n2" in action.reason


def test_lost_member_tears_down_then_reforms_at_a_smaller_valid_size():
    f = formation("n0", "n1", "n2")
    lost = heartbeat(live("n2", "ready", "f1"), None, NOW + PEER_TIMEOUT_S + 1)
    p = peers(live("n1", "ready", "f1"), lost)
    action = check("n0", p, own=Running(f, 0, since=0.0), world_size=None, now=NOW + PEER_TIMEOUT_S + 1)
    assert action == Teardown("lost node(s) n2", tell_members=True)
    # A member sees the same loss and tears down without telling anyone.
    member_view = peers(live("n0", "ready", "f1"), lost)
    assert check("n1", member_view, own=Running(f, 1, since=0.0), world_size=None, now=NOW + PEER_TIMEOUT_S + 1) == \
        Teardown("lost node(s) n2", tell_members=False)
    # After the teardown the survivors re-form at 2 once membership settled.
    p = peers(live("n1"), lost)
    assert check("n0", p, world_size=None, changed_at=NOW) == Wait("membership settling")
    assert check("n0", p, world_size=None, now=NOW + SETTLE_S) == Form(("n0", "n1"))
    # With --world-size 3 they re-form at once at the largest valid size (issue 48), with a warning.
    action = check("n0", p, world_size=3, now=NOW + SETTLE_S, last_world_size=3)
    assert action.members == ("n0", "n1") and "below --world-size 3" in action.warning and "lost: n2" in action.warning


def test_a_returning_node_is_taken_back_at_its_rank():
    lost = heartbeat(live("n2"), None, NOW + PEER_TIMEOUT_S + 1)
    assert isinstance(check("n0", peers(live("n1"), lost)), Wait)
    back = heartbeat(lost, PeerReport("idle"), NOW)
    assert check("n0", peers(live("n1"), back)) == Form(("n0", "n1", "n2"))


def test_coordinator_tears_down_a_failed_formation_with_back_off():
    f = formation("n0", "n1", "n2")
    ok = peers(live("n1", "loading", "f1"), live("n2", "loading", "f1"))
    own = Bootstrapping(f, 0, since=NOW - 1)
    assert isinstance(check("n0", ok, own=own), Wait)
    # Its own rank failed: the rank's one-line error is the reason.
    action = check("n0", ok, own=Failed(f, 0, NOW - 1, "lost rank 2"))
    assert action == Teardown("lost rank 2", tell_members=True, backoff=True)
    # A member's rank failed.
    bad = peers(live("n1", "failed", "f1"), live("n2", "loading", "f1"))
    assert check("n0", bad, own=own) == Teardown("a member's rank process failed", tell_members=True, backoff=True)
    # A member that never took its rank, after the grace period.
    stray = peers(live("n1", "idle", ""), live("n2", "loading", "f1"))
    assert isinstance(check("n0", stray, own=own), Wait)
    late = Bootstrapping(f, 0, since=NOW - MEMBER_GRACE_S - 1)
    assert isinstance(check("n0", stray, own=late), Teardown)
    # Members leave the decision to the coordinator.
    assert isinstance(check("n1", peers(live("n0", "loading", "f1"), live("n2", "failed", "f1")),
                            own=Bootstrapping(f, 1, since=0.0)), Wait)


def test_coordinator_announces_once_every_rank_is_ready():
    f = formation("n0", "n1", "n2")
    ready = peers(live("n1", "ready", "f1"), live("n2", "ready", "f1"))
    assert check("n0", ready, own=Running(f, 0, since=0.0)) == Announce(f)
    assert isinstance(check("n0", ready, own=Running(f, 0, since=0.0), announced=True), Wait)
    assert isinstance(check("n0", ready, own=Bootstrapping(f, 0, since=NOW, loading=True)), Wait)
    half = peers(live("n1", "ready", "f1"), live("n2", "loading", "f1"))
    assert isinstance(check("n0", half, own=Running(f, 0, since=0.0)), Wait)


def test_a_running_formation_is_kept_when_a_smaller_node_appears():
    f = formation("n1", "n2")
    p = peers(live("n0"), live("n2", "ready", "f1"))
    assert isinstance(check("n1", p, own=Running(f, 0, since=0.0), announced=True, world_size=2), Wait)
    # The newcomer waits: the nodes it would choose hold ranks.
    assert isinstance(check("n0", peers(live("n1", "ready", "f1"), live("n2", "ready", "f1")), world_size=2), Wait)


# -- own state --------------------------------------------------------------------------------

def test_rank_events_exit_and_start_timeout():
    f = formation("n0", "n1")
    own = Bootstrapping(f, 1, since=NOW)
    assert wire_state(own) == "starting"
    loading = ranks.after_event(own, {"event": "loading", "rank": 1})
    assert wire_state(loading) == "loading"
    running = ranks.after_event(loading, {"event": "ready", "rank": 1})
    assert running == Running(f, 1, NOW) and wire_state(running) == "ready"
    failed = ranks.after_event(running, {"event": "error", "message": "lost rank 0"})
    assert failed == Failed(f, 1, NOW, "lost rank 0") and wire_state(failed) == "failed"
    # The first failure is kept.
    assert ranks.after_exit(failed, "rank 1 exited with code 1") == failed
    assert ranks.after_exit(running, "rank 1 exited with code -9").error == "rank 1 exited with code -9"
    assert ranks.after_start_timeout(own, NOW + ranks.RANK_START_TIMEOUT_S) == own
    assert isinstance(ranks.after_start_timeout(own, NOW + ranks.RANK_START_TIMEOUT_S + 1), Failed)
    assert ranks.after_event(Idle(), {"event": "ready"}) == Idle()
    assert wire_state(Preparing("f2")) == wire_state(Idle("lost n2")) == "idle"


def test_formation_round_trips_through_bootstrap():
    f = formation("n0", "n1", "n2")
    req = f.to_bootstrap(2)
    assert (req.rank, req.world_size, req.protocol_version) == (2, 3, PROTOCOL_VERSION)
    assert Formation.from_bootstrap(req) == f
    assert f.rank0_address == "127.0.0.1:42000" and f.node_ids == ("n0", "n1", "n2")


@pytest.mark.parametrize("me", ["n0", "n1", "n2"])
def test_plan_is_pure(me):
    p = peers(*[live(n) for n in ("n0", "n1", "n2") if n != me])
    x = inputs(me, p)
    before = copy.deepcopy(x)
    action = plan(x)
    assert x == before  # the planner changed nothing it was given (peers, their infos)
    assert plan(x) == action


# -- pipelines (join --layers) -------------------------------------------------------------

def layered(node_id: str, layers: str, memory: int = 2**34) -> Peer:
    return Peer(info=info(node_id, layers=layers, memory_bytes=memory), status=PeerStatus.LIVE, last_ok=NOW,
                report=PeerReport(state="idle", formation_id=""))


def plan_layered(me: str, mine: str, others, memory: int = 2**34):
    return plan(inputs(me, peers(*others), world_size=None, layers=mine, n_layers=30, memory_bytes=memory))


@pytest.mark.parametrize("ids", [("a", "b", "c"), ("c", "b", "a"), ("b", "c", "a")])
def test_the_output_owner_forms_a_reverse_route_in_layer_order(ids):
    """Whatever the node ids, the node with K:output is rank 0 and the others follow in layer order."""
    ranges = dict(zip(ids, ["0:9", "20:output", "10:19"]))
    out = next(n for n, r in ranges.items() if r.endswith("output"))
    actions = {me: plan_layered(me, ranges[me], [layered(n, r) for n, r in ranges.items() if n != me])
               for me in ids}
    expected = Form((out, ids[0], ids[2]), layers="20:output,0:9,10:19")
    assert actions[out] == expected
    for me in ids:
        if me != out:
            assert isinstance(actions[me], Wait) and f"coordinator is {out}" in actions[me].reason


@pytest.mark.parametrize("mine, others, words", [
    ("20:output", [("b", "0:9")], "layers 10..19 are on no stage"),          # 10:19 not here (yet)
    ("20:output", [("b", "0:9"), ("c", "9:19")], "overlap"),
    ("20:output", [("b", "0:19"), ("c", "15:output")], "K:output"),
    ("20:output", [("b", "")], "advertise no --layers"),
    ("auto", [("b", "0:19")], "auto"),
    ("0:9", [("b", "10:29")], "no node advertises K:output"),
    ("0:9", [("b", "10:bogus")], "node b: bad layer range"),
])
def test_ranges_that_are_not_a_route_wait_naming_the_problem(mine, others, words):
    action = plan_layered("a", mine, [layered(n, r) for n, r in others])
    assert isinstance(action, Wait) and words in action.reason, action


def test_auto_splits_by_memory_with_the_smallest_id_as_rank_0():
    action = plan_layered("a", "auto", [layered("b", "auto", 3 * 2**34), layered("c", "auto", 2**34)], memory=2**34)
    # layer order: b (3 shares), c (1 share), a (1 share, the output): each stage 1 layer, the
    # other 27 by share (16.2, 5.4, 5.4; the spare one by largest remainder) -> 17, 7, 6
    assert action == Form(("a", "b", "c"), layers="24:output,0:16,17:23")


def test_a_tensor_parallel_cluster_is_unchanged_by_the_pipeline_rules():
    assert check("node-0", peers(live("node-2"), live("node-1"))) == Form(("node-0", "node-1", "node-2"))


# -- prefill/decode groups (join --role) ---------------------------------------------------

def roled(node_id: str, role: str, state: str = "idle", fid: str = "", rank0: str = "") -> Peer:
    return Peer(info=info(node_id, role=role), status=PeerStatus.LIVE, last_ok=NOW,
                report=PeerReport(state=state, formation_id=fid, rank0_address=rank0))


def test_a_prefill_node_forms_alone_and_decode_nodes_wait_for_it():
    others = peers(roled("b", "decode"), roled("c", "decode"), roled("p", "prefill"))
    # the prefill node forms a group of itself, whatever else is live
    assert plan(inputs("p", peers(roled("b", "decode"), roled("c", "decode")), world_size=None,
                       role="prefill")) == Form(("p",), role="prefill")
    # decode nodes: no prefill group ready yet
    wait = plan(inputs("a", others, world_size=None, role="decode"))
    assert isinstance(wait, Wait) and "no prefill group running" in wait.reason


def test_decode_nodes_form_among_themselves_with_the_prefill_address():
    others = peers(roled("b", "decode"), roled("c", "decode"), roled("p", "prefill", "ready", "f9", "10.0.0.9:7000"),
                   live("t"))  # an ordinary node is never taken
    action = plan(inputs("a", others, world_size=None, valid=(1, 3), role="decode"))
    assert action == Form(("a", "b", "c"), role="decode", prefill_peer="10.0.0.9:7000")
    # and an ordinary node never takes a decode or prefill node
    assert plan(inputs("a", peers(roled("b", "decode"), live("t")), world_size=None)) == Form(("a", "t"))


def test_a_decode_group_reforms_when_its_prefill_group_moves():
    f = Formation(formation_id="f1", coordinator_id="a", backend="ring", role="decode", prefill_peer="10.0.0.9:7000",
                  members=(Member(0, "a", "127.0.0.1", 41000, 42000),), model_digest=DIGEST, weights="float32")
    moved = peers(roled("p", "prefill", "ready", "f2", "10.0.0.9:7001"))
    action = plan(inputs("a", moved, own=Running(f, 0, NOW - 60), world_size=None, role="decode", announced=True))
    assert isinstance(action, Teardown) and "moved" in action.reason and action.tell_members
    same = peers(roled("p", "prefill", "ready", "f1", "10.0.0.9:7000"))
    assert not isinstance(plan(inputs("a", same, own=Running(f, 0, NOW - 60), world_size=None, role="decode",
                                      announced=True)), Teardown)
    gone = peers(roled("p", "prefill", "failed"))
    assert not isinstance(plan(inputs("a", gone, own=Running(f, 0, NOW - 60), world_size=None, role="decode",
                                      announced=True)), Teardown)


def test_role_and_prefill_peer_round_trip_through_bootstrap():
    f = Formation(formation_id="f1", coordinator_id="a", backend="ring", role="decode", prefill_peer="h:1",
                  members=(Member(0, "a", "127.0.0.1", 41000, 42000),), model_digest=DIGEST)
    assert Formation.from_bootstrap(f.to_bootstrap(0)) == f


def test_the_node_settles_after_a_node_joins_but_not_after_one_is_lost():
    """The node's ``changed_at`` (the planner's rule 8) moves when a node joins the live set, not
    when one is lost or this node tears its rank down: survivors re-form without SETTLE_S."""
    import shutil

    from mlxcluster.cluster.node import NodeConfig, NodeDaemon

    daemon = NodeDaemon(NodeConfig(cluster="lab", secret="correct horse battery staple", node_id="n0"))
    try:
        daemon._changed_at = 0.0
        daemon._set_peer(live("n1"), "n1")
        joined = daemon._changed_at
        assert joined > 0.0  # a node joined: settle
        daemon._set_peer(live("n2"), "n2")
        assert daemon._changed_at >= joined
        daemon._changed_at = 1.0
        daemon._set_peer(heartbeat(daemon.peers["n2"], None, NOW + 1, refused=True), "n2")
        assert daemon.peers["n2"].status is PeerStatus.LOST and daemon._changed_at == 1.0  # lost: no settling
        daemon._teardown_local("lost node(s) n2")
        assert daemon._changed_at == 1.0
        daemon._set_peer(live("n2"), "n2")  # it is back: settle again
        assert daemon._changed_at > 1.0
    finally:
        daemon.stop()
        daemon.server.stop(grace=0)
        shutil.rmtree(daemon._tmp, ignore_errors=True)


def test_a_formation_that_served_is_re_formed_without_back_off():
    """A member failing under a formation that formed (announced) is a loss: re-form at once; a
    formation that never formed backs off before the next attempt."""
    import shutil

    from mlxcluster.cluster.node import NodeConfig, NodeDaemon

    daemon = NodeDaemon(NodeConfig(cluster="lab", secret="correct horse battery staple", node_id="n0"))
    try:
        daemon._attempts, daemon._announced = 1, True
        daemon._apply(Teardown("a member's rank process failed", tell_members=True, backoff=True), NOW)
        assert daemon._retry_at <= NOW
        daemon._announced = False
        daemon._apply(Teardown("rank 1 could not load", tell_members=True, backoff=True), NOW)
        assert daemon._retry_at == NOW + 1.0  # the first failed attempt: 1 s, then 2, 4 ... 30
        daemon._attempts = 3
        daemon._apply(Teardown("rank 1 could not load", tell_members=True, backoff=True), NOW)
        assert daemon._retry_at == NOW + 4.0
    finally:
        daemon.stop()
        daemon.server.stop(grace=0)
        shutil.rmtree(daemon._tmp, ignore_errors=True)


def test_a_member_lost_at_once_is_first_reported_by_the_rank():
    """A killed node is lost at once (refused): for RANK_REPORT_S after its last heartbeat a running
    rank is left to fail by itself (rank 0 then names the lost rank to its clients, not "killed");
    a failed rank's own reason is the teardown's."""
    from mlxcluster.cluster.membership import Failed
    from mlxcluster.cluster.plan import RANK_REPORT_S

    f = formation("n0", "n1", "n2")
    gone = heartbeat(live("n2", "ready", "f1"), None, NOW + 0.1, refused=True)
    p = peers(live("n1", "ready", "f1"), gone)
    assert not isinstance(check("n0", p, own=Running(f, 0, since=0.0), now=NOW + 0.1), Teardown)
    failed = Failed(f, 0, 0.0, "lost rank 2 at 127.0.0.1:4000: Stream removed")
    assert check("n0", p, own=failed, now=NOW + 0.1) == Teardown("lost rank 2 at 127.0.0.1:4000: Stream removed",
                                                                   tell_members=True)
    assert check("n0", p, own=Running(f, 0, since=0.0), now=NOW + RANK_REPORT_S + 0.1) == \
        Teardown("lost node(s) n2", tell_members=True)


def test_join_memory_caps_what_the_node_advertises_and_plans_with():
    """``join --memory 1GiB`` on a machine with more: the mDNS record's memory and the memory of the
    node's measurement report (what ``plan`` and ``--plan auto`` split layers by) are 1 GiB."""
    import shutil

    from mlxcluster.cluster.node import NodeConfig, NodeDaemon

    daemon = NodeDaemon(NodeConfig(cluster="lab", secret="correct horse battery staple", node_id="n0",
                                   memory_limit=2**30, measure=False))
    try:
        assert daemon.info.memory_bytes == 2**30 and daemon._memory_usable == 2**30
    finally:
        daemon.stop()
        daemon.server.stop(grace=0)
        shutil.rmtree(daemon._tmp, ignore_errors=True)


# -- --world-size N: the size to form first; --exact-world-size: a hard requirement (issue 48) ---------

def test_world_size_is_the_size_to_form_first_and_survivors_reform_at_the_largest_valid_size():
    """Three `join --world-size 3` nodes (valid sizes 1 and 3, as the embedded model): the first
    formation waits for 3; after a member is lost (this node has held a rank, last_world_size 3) and
    no spare is live, the survivors form at once at the largest valid size they reach -- 1 here --
    with a warning, as a cluster formed without --world-size does; never above --world-size."""
    lost = heartbeat(live("n2"), None, NOW + PEER_TIMEOUT_S + 1)
    p = peers(live("n1"), lost)
    first = check("n0", p, world_size=3, valid=(1, 3), changed_at=NOW - SETTLE_S)
    assert first == Wait("2 of 3 nodes live (n0, n1); waiting for 1 more (lost: n2)")
    action = check("n0", p, world_size=3, valid=(1, 3), changed_at=NOW - SETTLE_S, last_world_size=3)
    assert isinstance(action, Form) and action.members == ("n0",)
    assert action.warning.startswith("re-forming at world size 1, below --world-size 3: 2 node(s) live (lost: n2)")
    assert check("n1", peers(live("n0"), lost), world_size=3, valid=(1, 3), last_world_size=3) == \
        Wait("coordinator is n0")  # one formation only: the other survivor waits
    # a node lost from a group of 4 at --world-size 3 never forms above 3; at N nothing warns
    four = peers(live("n1"), live("n2"), live("n3"))
    assert check("n0", four, world_size=3, valid=(1, 2, 3, 4), last_world_size=3) == Form(("n0", "n1", "n2"))
    assert target_world_size(3, (1, 2, 4), 2, last_world_size=3) == 2
    assert target_world_size(3, (2, 4), 1, last_world_size=3) is None  # none fits one node


def test_exact_world_size_waits_for_n_and_says_why():
    lost = heartbeat(live("n2"), None, NOW + PEER_TIMEOUT_S + 1)
    action = check("n0", peers(live("n1"), lost), world_size=3, valid=(1, 3), changed_at=NOW - SETTLE_S,
                   last_world_size=3, exact_world_size=True)
    assert action == Wait("exact world size 3 requested (--exact-world-size), 2 live (n0, n1); waiting for 1 more "
                          "(lost: n2)")
    assert target_world_size(3, (1, 2, 3), 2, last_world_size=3, exact=True) is None
    back = heartbeat(lost, PeerReport("idle"), NOW)
    assert check("n0", peers(live("n1"), back), world_size=3, last_world_size=3, exact_world_size=True) == \
        Form(("n0", "n1", "n2"))


def test_a_group_reformed_below_world_size_grows_back_to_it_but_not_past_it():
    """Rule 4b with --world-size 3: n0 runs alone after a loss; n2 is back -> grow to 3 once settled
    (rank 0 idle); a group at 3 never grows to 4; with --exact-world-size there is no group below N."""
    from mlxcluster.cluster.plan import GROW_SETTLE_S

    settled = dict(announced=True, world_size=3, valid=(1, 3, 4), rank0_idle=True, last_world_size=1,
                   changed_at=NOW - GROW_SETTLE_S - 1)
    alone = Running(formation("n0"), 0, since=NOW - 100)
    action = check("n0", peers(live("n1"), live("n2")), own=alone, **settled)
    assert isinstance(action, Teardown) and "growing from world size 1 to 3" in action.reason
    assert isinstance(check("n0", peers(live("n1")), own=alone, **settled), Wait)  # n2 still away: 1 is the most
    at_n = Running(formation("n0", "n1", "n2"), 0, since=NOW - 100)
    ready = peers(live("n1", "ready", "f1"), live("n2", "ready", "f1"), live("n3"))
    assert isinstance(check("n0", ready, own=at_n, **dict(settled, last_world_size=3)), Wait)

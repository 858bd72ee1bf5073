"""`join --spare` and taking back a returning node, as plain functions (issue 29).

The planner decides who gets a rank; these tests build typed states and check its actions:
a spare stays idle while enough non-spares are live, takes a lost member's place at the same
world size, never coordinates; a node returning to a formation at --world-size N stays idle;
without --world-size a formation that re-formed smaller grows again at a quiet moment (or after
a bounded delay).  Plus the TXT record's ``sp`` key, the page-cache warm-up, the CLI's one-line
refusals and the node's dashboard/status marks.
"""

from __future__ import annotations

import os
import shutil
from typing import Dict, Iterable, Optional

import pytest
from typer.testing import CliRunner

from mlxcluster.cluster import ranks
from mlxcluster.cluster.discovery import PROTOCOL_VERSION, NodeInfo, decode_txt, encode_txt
from mlxcluster.cluster.membership import Formation, Idle, Member, Peer, PeerReport, PeerStatus, Running
from mlxcluster.cluster.plan import (
    DISCOVERY_S, GROW_DELAY_S, GROW_SETTLE_S, SETTLE_S, Form, PlanInputs, Teardown, Wait, coordinator_id, plan,
    target_world_size)

DIGEST = "abc123"
NOW = 1000.0


def info(node_id: str, spare: bool = False, **kw) -> NodeInfo:
    fields = dict(node_id=node_id, cluster="lab", address="127.0.0.1", port=50000 + len(node_id),
                  version=PROTOCOL_VERSION, memory_bytes=2**34, platform="Linux-x86_64", chip="",
                  backends=["ring"], model_digest=DIGEST, state="idle", spare=spare)
    fields.update(kw)
    return NodeInfo(**fields)


def live(node_id: str, spare: bool = False, state: str = "idle", formation_id: str = "", **kw) -> Peer:
    return Peer(info=info(node_id, spare, **kw), status=PeerStatus.LIVE, last_ok=NOW,
                report=PeerReport(state=state, formation_id=formation_id))


def lost(node_id: str, spare: bool = False) -> Peer:
    return Peer(info=info(node_id, spare), status=PeerStatus.LOST, reason="no heartbeat", last_ok=NOW - 5)


def peers(*items: Peer) -> Dict[str, Peer]:
    return {p.node_id: p for p in items}


def check(me: str, peer_map, own=Idle(), world_size: Optional[int] = 3, valid: Iterable[int] = (1, 3),
          changed_at: float = 0.0, **kw):
    return plan(PlanInputs(node_id=me, world_size=world_size, valid_world_sizes=tuple(valid), own=own,
                           peers=peer_map, now=NOW, changed_at=changed_at, **kw))


def formation(*node_ids: str, fid: str = "f1") -> Formation:
    return Formation(formation_id=fid, coordinator_id=node_ids[0], backend="ring",
                     members=tuple(Member(rank=r, node_id=n, address="127.0.0.1", ring_port=41000 + r,
                                          control_port=42000 + r) for r, n in enumerate(node_ids)),
                     model_digest=DIGEST, weights="float32")


# -- a spare stays idle while enough non-spares are live -------------------------------------------

def test_three_members_and_a_spare_at_world_size_3_leave_the_spare_idle():
    everyone = {"n0": live("n0"), "n1": live("n1"), "n2": live("n2"), "s": live("s", spare=True)}
    others = lambda me: {k: v for k, v in everyone.items() if k != me}  # noqa: E731
    assert check("n0", others("n0")) == Form(("n0", "n1", "n2"))
    for me in ("n1", "n2"):
        assert check(me, others(me)) == Wait("coordinator is n0")
    assert check("s", others("s"), spare=True) == Wait("spare, idle until a member is lost (coordinator is n0)")


def test_a_lost_member_is_replaced_by_the_spare_at_the_same_world_size():
    f = formation("n0", "n1", "n2")
    running = Running(f, 0, since=NOW - 100)
    after_loss = peers(live("n1", state="ready", formation_id="f1"), lost("n2"), live("s", spare=True))
    torn = check("n0", after_loss, own=running, announced=True)
    assert isinstance(torn, Teardown) and "lost node(s) n2" in torn.reason and torn.tell_members
    # torn down: every survivor idle again, membership settled -> the spare takes n2's place
    idle = peers(live("n1"), lost("n2"), live("s", spare=True))
    assert check("n0", idle, changed_at=NOW - SETTLE_S - 1, last_world_size=3) == Form(("n0", "n1", "s"))


def test_a_spare_with_the_smallest_node_id_neither_coordinates_nor_takes_a_rank_first():
    nodes = peers(live("n1"), live("n2"), live("a-spare", spare=True))
    assert check("n0", nodes) == Form(("n0", "n1", "n2"))
    assert check("a-spare", peers(live("n0"), live("n1"), live("n2")), spare=True) == \
        Wait("spare, idle until a member is lost (coordinator is n0)")
    assert coordinator_id("a-spare", ["n0", "n1"], spares=["a-spare"]) == "n0"
    # n2 lost: the spare comes last in rank order, however small its id
    assert check("n0", peers(live("n1"), lost("n2"), live("a-spare", spare=True))) == Form(("n0", "n1", "a-spare"))


def test_two_spares_fill_two_places_in_node_id_order():
    assert check("n0", peers(live("n1"), live("s2", spare=True), live("s1", spare=True))) == Form(("n0", "n1", "s1"))
    assert check("n0", peers(lost("n1"), live("s2", spare=True), live("s1", spare=True))) == Form(("n0", "s1", "s2"))


def test_spares_alone_form_nothing():
    # every non-spare gone: no spare coordinates (a group of spares beside the members' would be a
    # second formation of the cluster once they return)
    action = check("s1", peers(live("s2", spare=True), live("s3", spare=True), lost("n0")), spare=True)
    assert isinstance(action, Wait) and "no non-spare node is live" in action.reason


def test_without_world_size_a_spare_only_restores_the_last_formations_size():
    # valid sizes 1, 2, 4: three non-spares form 2 (the spare would make 4: it is not counted)
    three_and_spare = peers(live("n1"), live("n2"), live("s", spare=True))
    assert check("n0", three_and_spare, world_size=None, valid=(1, 2, 4)) == Form(("n0", "n1"))
    # valid 1, 3: a formation of 3 lost n2; the spare restores 3 ...
    after_loss = peers(live("n1"), lost("n2"), live("s", spare=True))
    assert check("n0", after_loss, world_size=None, last_world_size=3) == Form(("n0", "n1", "s"))
    # ... but a node that held no formation yet (a fresh start) counts non-spares only: 2 -> 1
    assert check("n0", after_loss, world_size=None, last_world_size=0) == Form(("n0",))
    # two members lost: non-spares reach 1, with the spare 2 nodes, and 2 is no valid size
    assert check("n0", peers(lost("n1"), lost("n2"), live("s", spare=True)), world_size=None,
                 last_world_size=3) == Form(("n0",))
    # never above the last formation's size, however many spares are live
    assert check("n0", peers(lost("n1"), live("s1", spare=True), live("s2", spare=True), live("s3", spare=True)),
                 world_size=None, valid=(1, 2, 4), last_world_size=2) == Form(("n0", "s1"))


@pytest.mark.parametrize("args, expected", [
    ((3, (1, 3), 4, 1, 0), 3),       # fixed: spares count like any node
    ((3, (1, 3), 2, 1, 3), 1),       # fixed, a member lost: the largest valid size reached (issue 48)
    ((3, (1, 3), 2, 1, 0), None),    # ... but a first formation waits for 3
    ((3, (1, 3), 2, 1, 3, True), None),  # --exact-world-size: 3 or nothing
    ((None, (1, 2, 4), 4, 1, 0), 2),  # three non-spares reach 2; the spare is not counted
    ((None, (1, 2, 4), 4, 1, 4), 4),  # ... unless it restores a formation of 4
    ((None, (1, 3), 3, 1, 3), 3),
    ((None, (1, 3), 3, 1, 0), 1),
    ((None, (1, 3), 1, 1, 3), 1),     # only a spare: it restores the one valid size it reaches
    ((None, (2,), 1, 0, 0), None),
])
def test_target_world_size_counts_spares_only_to_restore(args, expected):
    assert target_world_size(*args) == expected


def test_a_spare_takes_no_pipeline_stage_and_blocks_no_route():
    stages = dict(n_layers=30, memory_bytes=2**34)
    route = peers(live("n1", layers="0:14"), live("s", spare=True))
    action = check("n0", route, world_size=None, layers="15:output", changed_at=NOW - SETTLE_S - 1, **stages)
    assert isinstance(action, Form) and action.members == ("n0", "n1")
    action = check("s", peers(live("n0", layers="15:output"), live("n1", layers="0:14")), world_size=None,
                   spare=True, **stages)
    assert isinstance(action, Wait) and "a spare takes no part in a pipeline" in action.reason


def test_a_decode_spare_replaces_a_decode_node_only():
    prefill = Peer(info=info("p0", role="prefill"), status=PeerStatus.LIVE, last_ok=NOW,
                   report=PeerReport(state="ready", formation_id="fp", rank0_address="127.0.0.1:9000"))
    decode = lambda nid, spare=False: live(nid, spare, role="decode")  # noqa: E731
    group = peers(prefill, decode("d1"), decode("ds", spare=True), live("tp-spare", spare=True))
    assert check("d0", group, world_size=2, role="decode") == \
        Form(("d0", "d1"), role="decode", prefill_peer="127.0.0.1:9000")
    group["d1"] = Peer(info=info("d1", role="decode"), status=PeerStatus.LOST, reason="gone", last_ok=NOW - 5)
    assert check("d0", group, world_size=2, role="decode") == \
        Form(("d0", "ds"), role="decode", prefill_peer="127.0.0.1:9000")
    assert check("ds", peers(prefill, decode("d0"), decode("d1")), world_size=2, role="decode", spare=True) == \
        Wait("spare, idle until a member is lost (coordinator is d0)")


# -- a returning node --------------------------------------------------------------------------------

def test_a_node_returning_to_a_formation_at_world_size_n_stays_idle():
    f = formation("n0", "n1", "s")
    back = peers(live("n1", state="ready", formation_id="f1"), live("s", spare=True, state="ready", formation_id="f1"),
                 live("n2"))
    action = check("n0", back, own=Running(f, 0, since=NOW - 100), announced=True, rank0_idle=True,
                   changed_at=NOW - GROW_DELAY_S - 1, last_world_size=3)
    assert isinstance(action, Wait)  # no teardown: the formation keeps serving
    returned = peers(live("n0", state="ready", formation_id="f1"), live("n1", state="ready", formation_id="f1"),
                     live("s", spare=True, state="ready", formation_id="f1"))
    assert check("n2", returned) == Wait("coordinator is n0")
    # a returning node with the smallest id forms nothing while the members hold their ranks
    assert check("a", {**returned, "n2": live("n2")}, changed_at=NOW - SETTLE_S - 1) == \
        Wait("node n0 holds a rank in formation f1")


def grow_case(**kw):
    """n0 runs a formation of 1 (it re-formed alone after n2 was lost; valid sizes 1, 3); n1 stayed
    idle and n2 is back."""
    args = dict(own=Running(formation("n0"), 0, since=NOW - 100), announced=True, world_size=None,
                last_world_size=1)
    args.update(kw)
    return check("n0", peers(live("n1"), live("n2")), **args)


def test_without_world_size_a_smaller_formation_grows_once_rank0_is_idle():
    action = grow_case(changed_at=NOW - GROW_SETTLE_S - 1, rank0_idle=True)
    assert isinstance(action, Teardown) and action.tell_members and not action.backoff
    assert "growing from world size 1 to 3" in action.reason
    # torn down: rules 6-10 form the larger group
    assert check("n0", peers(live("n1"), live("n2")), world_size=None, last_world_size=1,
                 changed_at=NOW - SETTLE_S - 1) == Form(("n0", "n1", "n2"))


def test_growth_waits_for_a_stable_membership_and_a_quiet_rank0_or_the_bounded_delay():
    assert isinstance(grow_case(changed_at=NOW - GROW_SETTLE_S + 1, rank0_idle=True), Wait)  # just returned
    assert isinstance(grow_case(changed_at=NOW - GROW_SETTLE_S - 1, rank0_idle=False), Wait)  # serving
    action = grow_case(changed_at=NOW - GROW_DELAY_S - 1, rank0_idle=False)  # under load, after the delay
    assert isinstance(action, Teardown) and "requests are replayed" in action.reason


def test_growth_never_happens_at_a_fixed_world_size_unannounced_or_into_a_busy_node():
    assert isinstance(grow_case(world_size=1, changed_at=NOW - GROW_DELAY_S - 1, rank0_idle=True), Wait)
    assert not isinstance(grow_case(announced=False, changed_at=NOW - GROW_DELAY_S - 1, rank0_idle=True),
                          Teardown)  # announced first (rule 4), grown later
    busy = peers(live("n1"), live("n2", state="ready", formation_id="other"))
    assert isinstance(check("n0", busy, own=Running(formation("n0"), 0, since=NOW - 100), announced=True,
                            world_size=None, changed_at=NOW - GROW_DELAY_S - 1, rank0_idle=True), Wait)
    # a member (not the coordinator) never grows the formation
    member = Running(formation("n0", "n1", fid="f1"), 1, since=NOW - 100)
    assert isinstance(check("n1", peers(live("n0", state="ready", formation_id="f1"), live("n2"), live("n3")),
                            own=member, world_size=None, valid=(1, 2, 4), announced=True, rank0_idle=True,
                            changed_at=NOW - GROW_DELAY_S - 1), Wait)


def test_a_formation_restored_by_a_spare_does_not_grow_when_the_member_returns():
    f = formation("n0", "n1", "s")
    back = peers(live("n1", state="ready", formation_id="f1"),
                 live("s", spare=True, state="ready", formation_id="f1"), live("n2"))
    action = check("n0", back, own=Running(f, 0, since=NOW - 100), announced=True, world_size=None,
                   rank0_idle=True, changed_at=NOW - GROW_DELAY_S - 1, last_world_size=3)
    assert isinstance(action, Wait)


def test_nodes_started_together_without_world_size_wait_to_find_each_other_first():
    """Rule 8b: alone right after its start, a node without --world-size does not form below the
    largest valid size -- each of three nodes started together formed one of its own, for good."""
    alone = check("n0", {}, world_size=None, changed_at=NOW - SETTLE_S - 1, started_at=NOW - 1)
    assert isinstance(alone, Wait) and "discovering peers" in alone.reason
    assert check("n0", {}, world_size=None, changed_at=NOW - SETTLE_S - 1, started_at=NOW - DISCOVERY_S - 1) == \
        Form(("n0",))
    everyone = peers(live("n1"), live("n2"))  # the largest size already: no reason to wait
    assert check("n0", everyone, world_size=None, changed_at=NOW - SETTLE_S - 1, started_at=NOW - 1) == \
        Form(("n0", "n1", "n2"))


def test_two_formations_formed_apart_merge_the_larger_id_yields():
    """Rule 4c: n0 and n1 each run a formation of 1 (formed apart); n2 is idle.  n1's coordinator
    yields to n0 (the smaller id, who would lead the group of 3) once settled and idle; n0 waits
    for n1 to be free, then grows."""
    settled = dict(announced=True, world_size=None, rank0_idle=True, changed_at=NOW - GROW_SETTLE_S - 1)
    n1 = check("n1", peers(live("n0", state="ready", formation_id="fa"), live("n2")),
               own=Running(formation("n1", fid="fb"), 0, since=NOW - 100), **settled)
    assert isinstance(n1, Teardown) and "yielding world size 1 to n0" in n1.reason and n1.tell_members
    assert isinstance(check("n1", peers(live("n0", state="ready", formation_id="fa"), live("n2")),
                            own=Running(formation("n1", fid="fb"), 0, since=NOW - 100),
                            **dict(settled, rank0_idle=False)), Wait)  # serving: not before GROW_DELAY_S
    n0 = check("n0", peers(live("n1", state="ready", formation_id="fb"), live("n2")),
               own=Running(formation("n0", fid="fa"), 0, since=NOW - 100), **settled)
    assert isinstance(n0, Wait)  # n1 still holds its rank
    n0 = check("n0", peers(live("n1"), live("n2")), own=Running(formation("n0", fid="fa"), 0, since=NOW - 100),
               **settled)
    assert isinstance(n0, Teardown) and "growing from world size 1 to 3" in n0.reason


# -- advertisement, warm-up, CLI, status -------------------------------------------------------------

def test_spare_travels_in_the_txt_record_and_is_parsed_defensively():
    txt = encode_txt(info("s", spare=True))
    assert txt["sp"] == "1"
    assert "sp" not in encode_txt(info("n0"))
    raw = {k.encode(): v.encode() for k, v in txt.items()}
    assert decode_txt(raw, "127.0.0.1", 5000).spare is True
    for garbled in (b"yes", b"", None, b"\xff", b"11"):
        assert decode_txt({**raw, b"sp": garbled}, "127.0.0.1", 5000).spare is False
    del raw[b"sp"]
    assert decode_txt(raw, "127.0.0.1", 5000).spare is False
    assert decode_txt({**raw, b"SP": b"1"}, "127.0.0.1", 5000).spare is True  # keys are case-insensitive


def test_warm_page_cache_reads_the_model_files_once_within_its_bound(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "a.safetensors").write_bytes(os.urandom(3 * ranks.WARM_CHUNK_BYTES // 2))
    (model / "config.json").write_bytes(b"{}")
    total = 3 * ranks.WARM_CHUNK_BYTES // 2 + 2
    assert ranks.warm_page_cache(str(model), limit_bytes=10 * total) == total
    assert ranks.warm_page_cache(str(model), limit_bytes=1000) == 1000
    assert ranks.warm_page_cache(str(model), limit_bytes=total, stop=lambda: True) == 0
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"g" * 100)
    assert ranks.warm_page_cache(str(gguf), limit_bytes=10**9) == 100


@pytest.mark.parametrize("args, needle", [
    (["--spare", "--layers", "0:5"], "a pipeline stage (--layers) has no stand-in"),
    (["--spare", "--role", "prefill"], "a second prefill node is already a stand-in"),
])
def test_join_refuses_a_spare_it_cannot_use_in_one_line(args, needle):
    from harness import cli

    # cli(): the settings (config(), read once per process) come from this call's environment
    result = cli("join", "--no-dashboard", *args, env={"MLXCLUSTER_SECRET": "correct horse battery staple"})
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr


def test_status_names_the_spare_nodes(monkeypatch):
    from mlxcluster import cli
    from mlxcluster.cluster import client

    rows = [{"node_id": n, "address": "127.0.0.1:1", "state": "idle" if n == "s" else "ready", "rank": r,
             "world_size": 3, "formation_id": "" if n == "s" else "f1", "backend": "ring", "model": "m",
             "rank0_address": "127.0.0.1:2", "backends": ["ring"], "memory_bytes": 0, "platform": "",
             "spare": n == "s"} for n, r in (("n0", 0), ("n1", 1), ("n2", 2), ("s", -1))]
    monkeypatch.setattr(client, "cluster_status", lambda *a, **k: rows)
    result = CliRunner().invoke(cli.app, ["status", "--cluster", "lab"])
    assert result.exit_code == 0, result.output
    assert "spare node(s): s" in result.output
    assert "spare: takes a rank when a member is lost" in result.output


def test_node_dashboard_marks_spares():
    from mlxcluster.cluster.dashboard import _nodes

    view = {"node_id": "s", "address": "a", "state": "idle", "error": "", "model_digest": DIGEST, "layers": "",
            "role": "", "spare": True, "formation": None,
            "peers": [{"node_id": "n0", "address": "b", "status": "live", "state": "ready", "reason": "",
                       "model_digest": DIGEST, "layers": "", "role": "", "spare": False, "last_seen_s": 0.1}]}
    nodes = {n["node_id"]: n for n in _nodes(view)}
    assert nodes["s"]["spare"] is True and nodes["n0"]["spare"] is False


class _Answered:
    """A finished gRPC future (the liveness probe's call) answering ``reply``."""

    def __init__(self, reply):
        self.reply = reply

    def result(self):
        return self.reply


def test_the_node_keeps_whether_its_rank0_is_idle_and_a_spare_warms_its_model_once(tmp_path):
    from mlxcluster.cluster.node import NodeConfig, NodeDaemon
    from mlxcluster.protocol import mlxcluster_pb2 as pb

    model = tmp_path / "m.gguf"
    model.write_bytes(b"w" * 4096)
    daemon = NodeDaemon(NodeConfig(cluster="lab", secret="correct horse battery staple", node_id="s",
                                   spare=True))
    try:
        assert daemon.info.spare and daemon.status().spare and daemon.view()["spare"]
        seq = daemon._rank_seq
        daemon._on_own_rank_probe(seq, _Answered(pb.InfoReply(running=0, queued=0)))
        assert daemon._rank0_idle
        for busy in (pb.InfoReply(running=1), pb.InfoReply(queued=2)):
            daemon._on_own_rank_probe(seq, _Answered(busy))
            assert not daemon._rank0_idle
        daemon._on_own_rank_probe(seq, _Answered(pb.InfoReply()))
        daemon._teardown_local("test")  # a new formation's rank 0 has not answered yet
        assert not daemon._rank0_idle
        # the warm-up starts once per model path, only for a spare without a rank
        daemon.cfg.model_path = str(model)
        daemon._warm_spare()
        assert daemon._warmed == str(model)
        daemon._warmed = "other"
        daemon.cfg.spare = False
        daemon._warm_spare()
        assert daemon._warmed == "other"
    finally:
        daemon.stop()
        daemon.server.stop(grace=0)
        shutil.rmtree(daemon._tmp, ignore_errors=True)

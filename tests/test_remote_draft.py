"""Speculative decoding with a draft node (issue 30: ``join --role draft``, ``--draft remote:HOST:PORT``).

In process, on loopback, over the cluster's real mutual TLS: a draft service
(:class:`~mlxcluster.leader.remote_draft.DraftService` holding another tiny random Llama of the
target's vocabulary, whose drafts are partly right) and rank 0's scheduler drafting with it.

* Greedy answers equal plain decoding token for token; each draft equals what a local ``model:PATH``
  drafter of the same model proposes for the same contexts in the same order (its KV cache trimmed
  after rejections at the draft node as rank 0's own would be); one ``Draft`` call per plan carries
  the batch's three sequences, and only new context tokens cross the wire (``keep``/``tokens``).
* The draft node's state: ``keep`` beyond what it holds -> ``resync``; ended, idle and least recently
  used sequences dropped; refusals (another vocabulary, bad items) are codes with one line.
* A draft node that is gone, stuck past the deadline, of another vocabulary or of another secret:
  every request completes with plain decoding's tokens, one call then a back-off, one log line.
* ``remote:`` refusals are one line (parse, rank 0, the API's 400, the command line's exit 2).
* The planner's draft-role rules as plain functions (``tests/test_plan.py``'s style).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import uuid

import grpc
import pytest

mx = pytest.importorskip("mlx.core")

sys.path.insert(0, os.path.dirname(__file__))

import tinymodel  # noqa: E402
from harness import until  # noqa: E402
from mlxcluster.control.link import RankGroup  # noqa: E402
from mlxcluster.engine.drafters import DraftModels  # noqa: E402
from mlxcluster.engine.speculative import make_drafter, parse_draft  # noqa: E402
from mlxcluster.leader import remote_draft as rd  # noqa: E402
from mlxcluster.leader.scheduler import Scheduler, SessionStats  # noqa: E402
from mlxcluster.protocol import mlxcluster_pb2 as pb  # noqa: E402
from mlxcluster.protocol import mlxcluster_pb2_grpc as pb_grpc  # noqa: E402

VOCAB = tinymodel.TINY_CONFIG["vocab_size"]
CONTEXT = tinymodel.TINY_CONFIG["max_position_embeddings"]
PROMPTS = [[1, 5, 200, 17, 3, 99, 42], [7, 7, 8, 100, 31, 7, 7, 8], [250, 4, 4, 4, 60, 61, 62, 63, 9]]
LENGTHS = [30, 26, 22]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """Another random model of one layer with the target's vocabulary (an mlx-lm directory): its
    drafts are partly right, so verify steps reject some."""
    config, weights = tinymodel.tiny_llama(seed=1, num_hidden_layers=1)
    out = tmp_path_factory.mktemp("draft")
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@pytest.fixture(scope="module")
def draft_net(draft_dir):
    """The draft model as a draft node's rank builds it (the loader, float32)."""
    from mlxcluster.model.loader import read_model
    from mlxcluster.model.tp import build_model

    src = read_model(draft_dir, tokenizer=False)
    return build_model(src.config, src.weights, src.quantization, "float32", None, consume_weights=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Stuck(pb_grpc.GenerationServicer):
    """A draft node that never answers (its MLX thread stuck): the call ends at its deadline."""

    async def Draft(self, request, context):
        await asyncio.Event().wait()


def _stuck(tls):
    async def serve(port):
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(_Stuck(), server)
        server.add_secure_port(f"127.0.0.1:{port}", tls.server())
        await server.start()
        return server
    return serve


def _answers(model, executor, tls, serve=None, address=None, deadline_s=30.0, clock=None, draft="remote"):
    """Greedy answers of :data:`PROMPTS` (three concurrent requests) through rank 0's scheduler with
    ``draft`` (``remote``: the draft node at ``address`` or, with ``serve`` (``async (port) ->
    server``), the one it starts on loopback; ``off``: plain).  Returns ``(answers, scheduler,
    RemoteDrafts or None)``."""

    async def main():
        server, spec, remote = None, ("off", 0), None
        sched = Scheduler(model, RankGroup(), VOCAB, CONTEXT, executor, step_timeout_s=30, credentials=tls)
        try:
            if draft == "remote":
                where = address
                if serve is not None:
                    port = _free_port()
                    server = await serve(port)
                    where = f"127.0.0.1:{port}"
                remote = sched.remote_drafts[where] = rd.RemoteDrafts(where, tls, VOCAB, deadline_s=deadline_s,
                                                                      **({"clock": clock} if clock else {}))
                spec = (f"remote:{where}", 4)

            async def one(prompt, n):
                st = SessionStats(uid="")
                return [t async for t in sched.generate(prompt, n, stats=st, speculative=spec)]

            return await asyncio.gather(*[one(p, n) for p, n in zip(PROMPTS, LENGTHS)]), sched, remote
        finally:
            await sched.close()
            if server is not None:
                await server.stop(0)

    return asyncio.run(main())


async def _serve_draft(service, port, tls):
    """A draft group's ``Generation`` service as its rank 0 serves it (``GenerationServicer.Draft``,
    the rest unused here) on 127.0.0.1:``port`` over mutual TLS; returns the started server."""
    from mlxcluster.leader.generation import GenerationServicer

    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(GenerationServicer(None, None, "", "", draft_service=service), server)
    assert server.add_secure_port(f"127.0.0.1:{port}", tls.server()) == port
    await server.start()
    return server


def _serving(service, tls):
    async def serve(port):
        return await _serve_draft(service, port, tls)
    return serve


@pytest.fixture(scope="module")
def plain(model, executor, tls):
    return _answers(model, executor, tls, draft="off")[0]


def test_greedy_with_a_draft_node_equals_plain_and_a_local_drafter(model, executor, tls, draft_dir, draft_net, plain,
                                                                   monkeypatch, full_drafts):
    service = rd.DraftService(draft_net, VOCAB, executor=executor, name="draft")
    calls, proposals = [], []
    draft = service.draft
    monkeypatch.setattr(service, "draft", lambda request: calls.append(request) or draft(request))
    prefetch = rd.RemoteDrafts.prefetch

    async def counted(self, items):
        prefetches.append(len(items))
        await prefetch(self, items)

    prefetches = []
    monkeypatch.setattr(rd.RemoteDrafts, "prefetch", counted)
    propose = rd.RemoteDrafter.propose
    monkeypatch.setattr(rd.RemoteDrafter, "propose",
                        lambda self, c, k: proposals.append((self.uid, list(c), k, self.pending[:k]))
                        or propose(self, c, k))
    got, sched, remote = _answers(model, executor, tls, _serving(service, tls))
    assert got == plain
    s = sched.spec_stats
    assert s.drafted > s.accepted > 0 and s.tokens > s.steps  # drafts partly accepted: rejections happened
    # one call per plan for the whole batch
    assert len(calls) == len(prefetches) == remote.calls and remote.failures == 0
    assert max(prefetches) == 3 and max(len(c.items) for c in calls) == 3
    # only new tokens cross the wire: per sequence the tokens sent add up to its last context, each once
    sent, last = {}, {}
    for c in calls:
        for item in c.items:
            assert item.keep == sent.get(item.uid, 0)  # all it was sent is still valid (a context only grows)
            sent[item.uid] = item.keep + len(item.tokens)
            last[item.uid] = item
    assert all(len(item.tokens) < 8 for c in calls[1:] for item in c.items if item.keep)  # accepted + bonus only
    # each draft is the one a local model:PATH drafter proposes, contexts in the same order
    assert {u for u, *_ in proposals} == set(sent) and len(proposals) > 10
    local = {}
    models = DraftModels(model, VOCAB)
    for uid, context, k, fetched in proposals:
        d = local.setdefault(uid, make_drafter(f"model:{draft_dir}", "--draft", models))
        assert d.propose(context, k) == fetched
    # every ended sequence was told to the draft node with a later call, or is held until the idle bound
    ended = {u for c in calls for u in c.ended}
    assert ended <= set(sent) and service.sequences + len(ended) == len(sent)


def test_the_draft_node_keeps_syncs_and_drops_sequences(model, draft_net):
    now = [0.0]
    service = rd.DraftService(draft_net, VOCAB, max_sequences=2, idle_s=10.0, clock=lambda: now[0])

    def ask(*items, ended=()):
        return service.draft(pb.DraftRequest(items=[pb.DraftItem(uid=u, keep=keep, tokens=t, k=k)
                                                    for u, keep, t, k in items], ended=ended, vocab_size=VOCAB))

    ctx = [3, 17, 42, 42, 9, 100, 5]
    first = ask(("a", 0, ctx, 4)).items[0]
    assert len(first.tokens) == 4 and not first.resync
    # a rejection: one draft token accepted, then the target's correction -- only those two are sent
    nxt = ctx + [first.tokens[0], (first.tokens[1] + 1) % VOCAB]
    again = ask(("a", len(ctx), nxt[len(ctx):], 4)).items[0]
    fresh = make_drafter("model:x", "--draft", _held(draft_net))
    assert list(again.tokens) == fresh.propose(nxt, 4)
    # that call's answer lost (past its deadline): rank 0 sends the same keep again with what follows,
    # and the draft node goes back to keep rather than appending twice
    later = nxt + [7]
    assert list(ask(("a", len(ctx), later[len(ctx):], 4)).items[0].tokens) == fresh.propose(later, 4)
    assert service._held["a"].context == later
    # keep beyond what it holds (it never saw "b", or dropped it): resync, no draft
    assert ask(("b", 3, [1], 2)).items[0].resync
    # ended: dropped; an unknown uid starts from keep 0
    ask(ended=["a"])
    assert service.sequences == 0 and ask(("a", 2, [1], 2)).items[0].resync
    # least recently used beyond max_sequences, then the idle bound
    ask(("a", 0, ctx, 1), ("b", 0, ctx, 1))
    ask(("c", 0, ctx, 1))
    assert sorted(service._held) == ["b", "c"]
    now[0] = 11.0
    ask(("d", 0, ctx, 1))
    assert sorted(service._held) == ["d"]
    # refusals: codes and one line
    for request, code, needle in [
            (pb.DraftRequest(vocab_size=VOCAB + 8), grpc.StatusCode.FAILED_PRECONDITION, "vocabulary has 256"),
            (pb.DraftRequest(vocab_size=VOCAB, items=[pb.DraftItem(uid="a", k=0)]), grpc.StatusCode.INVALID_ARGUMENT,
             "k must be in 1..16"),
            (pb.DraftRequest(vocab_size=VOCAB, items=[pb.DraftItem(uid="a", k=1, tokens=[VOCAB])]),
             grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
            (pb.DraftRequest(vocab_size=VOCAB, items=[pb.DraftItem(uid="a", k=1)] * 2),
             grpc.StatusCode.INVALID_ARGUMENT, "repeated")]:
        got, why = service.check(request)
        assert got == code and needle in why and "\n" not in why
    assert service.check(pb.DraftRequest(vocab_size=VOCAB, vocab_digest="x")) is None  # no tokenizer here


def _held(net):
    models = DraftModels(net, VOCAB)
    models.hold("model", "x", net)
    return models


@pytest.mark.parametrize("how", ["gone", "stuck", "other-vocabulary", "other-secret"])
def test_a_draft_node_that_fails_never_fails_a_request(model, executor, tls, other_tls, draft_net, plain, how,
                                                       caplog, full_drafts):
    """Every request completes with plain decoding's tokens; the clock stands still, so after the first
    failed call the back-off holds every later plan: one call, one log line."""
    serve, deadline = None, 30.0
    if how == "stuck":
        serve, deadline = _stuck(tls), 0.3
    elif how != "gone":
        service = rd.DraftService(draft_net, VOCAB + 8 if how == "other-vocabulary" else VOCAB, executor=executor)
        serve = _serving(service, other_tls if how == "other-secret" else tls)
    caplog.set_level(logging.WARNING, logger=rd.__name__)
    got, sched, remote = _answers(model, executor, tls, serve, address=f"127.0.0.1:{_free_port()}",
                                  deadline_s=deadline, clock=lambda: 100.0)
    assert got == plain
    assert remote.calls == remote.failures == 1 and remote.retry_at > 100.0
    assert sched.spec_stats.drafted == 0
    lines = [r.getMessage() for r in caplog.records if r.name == rd.__name__]
    assert len(lines) == 1 and "decoding without its drafts" in lines[0], lines
    needle = {"gone": "unreachable", "stuck": "no answer within 0.3 s", "other-vocabulary": "vocabulary has 264",
              "other-secret": "TLS"}[how]
    assert needle in lines[0], lines[0]


def test_the_back_off_doubles_and_a_recovered_node_is_asked_again(tls, draft_net, executor):
    now = [0.0]

    async def main():
        port = _free_port()
        remote = rd.RemoteDrafts(f"127.0.0.1:{port}", tls, VOCAB, deadline_s=30.0, clock=lambda: now[0])
        d = remote.drafter()
        ctx = [3, 17, 42, 9]
        await remote.prefetch([(d, ctx, 2)])
        assert remote.failures == 1 and remote.retry_at == rd.BACKOFF_S and d.propose(ctx, 2) == []
        await remote.prefetch([(d, ctx, 2)])  # within the back-off: no call
        assert remote.calls == 1
        now[0] = remote.retry_at
        await remote.prefetch([(d, ctx, 2)])
        assert remote.calls == 2 and remote.retry_at == now[0] + 2 * rd.BACKOFF_S  # doubled
        service = rd.DraftService(draft_net, VOCAB, executor=executor)
        server = await _serve_draft(service, port, tls)  # the node comes (back) up
        try:
            now[0] = remote.retry_at
            await remote.prefetch([(d, ctx, 2)])
            assert remote.calls == 3 and not remote.failing and len(d.propose(ctx, 2)) == 2
            assert d.sent == len(ctx) and d.draft_s is not None and d.draft_s > 0
            d.close()  # the sequence ended: told with the next call
            e = remote.drafter()
            await remote.prefetch([(e, ctx, 1)])
            assert service.sequences == 1 and d.uid not in service._held
        finally:
            await remote.close()
            await server.stop(0)

    asyncio.run(main())


def test_remote_drafters_are_refused_in_one_line(model, executor, tmp_path):
    assert parse_draft("remote:10.0.0.9:7000") == ("remote", "10.0.0.9:7000")
    assert parse_draft("remote:draft.local:07000") == ("remote", "draft.local:7000")
    for bad in ("remote:", "remote:host", "remote::7000", "remote:h:0", "remote:h:70000", "remote:h:x", "remote:a b:1"):
        with pytest.raises(ValueError, match=r"write remote:HOST:PORT") as exc:
            parse_draft(bad, "speculative.draft")
        assert "\n" not in str(exc.value) and str(exc.value).startswith("speculative.draft ")
    with pytest.raises(ValueError, match="rank 0's scheduler"):
        make_drafter("remote:h:1")
    # a rank 0 without cluster credentials refuses it (at start and per request), one line
    with pytest.raises(ValueError, match=r"^--draft remote:h:1: this rank 0 has no cluster credentials"):
        Scheduler(model, RankGroup(), VOCAB, CONTEXT, executor, draft="remote:h:1")
    with pytest.raises(ValueError, match=r"^speculative.draft remote:h:1: this rank 0 has no cluster credentials"):
        Scheduler(model, RankGroup(), VOCAB, CONTEXT, executor).speculation_of("remote:h:1", 4)
    # the API: a malformed remote drafter is a 400 naming speculative
    from mlxcluster.front.provider import ProviderError, _speculative

    assert _speculative({"speculative": {"draft": "remote:h:1"}}) == ("remote:h:1", 0)
    with pytest.raises(ProviderError) as err:
        _speculative({"speculative": {"draft": "remote:h"}})
    assert err.value.status == 400 and err.value.param == "speculative" and "\n" not in err.value.message
    # the command line: one line, exit 2, before any rank starts
    from harness import assert_one_line_error, cli

    secret = tmp_path / "s"
    secret.write_text("a-secret-of-enough-length-0123")
    os.chmod(secret, 0o600)
    env = {"MLXCLUSTER_SECRET": ""}
    for args, needles in [(["generate", "hi", "--draft", "remote:nohost"], ["write remote:HOST:PORT"]),
                          (["generate", "hi", "--draft", "remote:h:1"], ["needs --secret-file"]),
                          (["serve", "--draft", "remote:h:1"], ["needs --secret-file"]),
                          (["serve", "--role", "draft", "--draft", "ngram"], ["--role draft excludes it"]),
                          (["serve", "--role", "draft", "--prefill-peer", "h:1"], ["--prefill-peer needs --role decode"]),
                          (["join", "--role", "draft", "--world-size", "2", "--secret-file", str(secret)],
                           ["--role draft forms a group of this node alone"]),
                          (["join", "--role", "draft", "--spare", "--secret-file", str(secret)], ["--spare with --role draft"]),
                          (["join", "--role", "drafter", "--secret-file", str(secret)], ["choose tp, prefill, decode or draft"])]:
        proc = cli(*args, env=env)
        assert proc.returncode == 2, (args, proc.stderr)
        assert_one_line_error(proc, *needles)


# -- the planner (join --role draft) ------------------------------------------------------------

def test_a_draft_node_forms_alone_and_target_groups_draft_with_it():
    from test_plan import DIGEST, NOW, inputs, live, peers, roled

    from mlxcluster.cluster.membership import Formation, Member, Running
    from mlxcluster.cluster.plan import DRAFT_WAIT_S, Form, Teardown, Wait, plan

    # a draft node forms a group of itself alone, whatever else is live
    assert plan(inputs("d", peers(live("a"), live("b")), world_size=None, role="draft")) == Form(("d",), role="draft")
    # the target's coordinator: a draft node still starting -> wait (bounded), ready -> its address in Form
    starting = peers(live("b"), roled("d", "draft", "loading", "f9"))
    wait = plan(inputs("a", starting, world_size=None, valid=(1, 2), changed_at=NOW - 5))
    assert isinstance(wait, Wait) and "draft node d is starting" in wait.reason
    assert plan(inputs("a", starting, world_size=None, valid=(1, 2), changed_at=NOW - DRAFT_WAIT_S)) == Form(("a", "b"))
    ready = peers(live("b"), roled("d", "draft", "ready", "f9", "10.0.0.9:7000"), roled("e", "draft"))
    assert plan(inputs("a", ready, world_size=None, valid=(1, 2))) == Form(("a", "b"), draft_peer="10.0.0.9:7000")
    failed = peers(live("b"), roled("d", "draft", "failed"))
    assert plan(inputs("a", failed, world_size=None, valid=(1, 2))) == Form(("a", "b"))
    # a decode group drafts with it too; a prefill node never does
    pd = peers(roled("b", "decode"), roled("p", "prefill", "ready", "f8", "10.0.0.8:7000"),
               roled("d", "draft", "ready", "f9", "10.0.0.9:7000"))
    assert plan(inputs("a", pd, world_size=None, valid=(1, 2), role="decode")) == Form(
        ("a", "b"), role="decode", prefill_peer="10.0.0.8:7000", draft_peer="10.0.0.9:7000")
    assert plan(inputs("p", pd, world_size=None, role="prefill")) == Form(("p",), role="prefill")
    # a draft node appearing, moving or vanishing tears no serving group down
    f = Formation(formation_id="f1", coordinator_id="a", backend="ring", draft_peer="10.0.0.9:7000",
                  members=(Member(0, "a", "127.0.0.1", 41000, 42000),), model_digest=DIGEST, weights="float32")
    for around in (peers(), peers(roled("d", "draft", "ready", "f2", "10.0.0.9:7001")),
                   peers(roled("d", "draft", "loading"))):
        action = plan(inputs("a", around, own=Running(f, 0, NOW - 60), world_size=None, valid=(1,), announced=True))
        assert not isinstance(action, Teardown), action
    # the draft peer travels with the formation
    assert Formation.from_bootstrap(f.to_bootstrap(0)) == f


def test_a_draft_node_of_another_model_is_no_refused_peer():
    from test_plan import DIGEST, info

    from mlxcluster.cluster.membership import refusal

    other = info("d", role="draft", model_digest="fff999")
    assert refusal(other, "a", DIGEST) == ""                            # a target node sees the draft node
    assert refusal(info("a", model_digest=DIGEST), "d", "fff999", "draft") == ""  # and the draft node sees it
    assert "different model" in refusal(info("b", model_digest="fff999"), "a", DIGEST)  # targets still must match
    assert "has no model yet" in refusal(info("d", role="draft", model_digest=""), "a", DIGEST)


def test_a_formation_with_a_draft_peer_starts_rank_0_drafting_with_it(monkeypatch, tmp_path):
    """``ranks.start_rank``: the draft group's address becomes the ranks' ``--draft remote:HOST:PORT``; a
    draft formation's rank runs ``--role draft``."""
    from mlxcluster.cluster import ranks
    from mlxcluster.cluster.membership import Formation, Member

    spawned = []
    monkeypatch.setattr(ranks.Supervisor, "spawn", lambda self, cmd, env, name: spawned.append(cmd))
    for role, draft_peer, want in [("", "10.0.0.9:7000", ("draft", "remote:10.0.0.9:7000")),
                                   ("draft", "", ("role", "draft"))]:
        f = Formation(formation_id="f1", coordinator_id="a", backend="ring", role=role, draft_peer=draft_peer,
                      members=(Member(0, "a", "127.0.0.1", 41000, 42000),), weights="float32")
        ranks.start_rank(f, 0, secret="s" * 24, cluster="lab", model_path="/m.gguf", bind="127.0.0.1",
                         workdir=str(tmp_path), node_endpoints=["127.0.0.1:1"], standby=None,
                         on_event=lambda e: None, on_exit=lambda p: None)
        cmd = spawned[-1]
        config = json.loads(cmd[cmd.index("--config") + 1])  # the rank's one RankConfig
        key, value = want
        assert (config["topology"] if key == "role" else config)[key] == value, cmd


# -- a real join cluster with a draft node (slow) -----------------------------------------------

@pytest.fixture
def two_hosts():
    """Two network namespaces on one bridge (``benchmarks/netns.py``)."""
    from benchmarks.netns import NetnsError, bridged_hosts

    try:
        with bridged_hosts(2) as hosts:
            yield hosts
    except NetnsError as exc:
        pytest.skip(str(exc))


@pytest.mark.slow
def test_a_join_draft_node_drafts_for_the_cluster_and_may_vanish(tmp_path, two_hosts, tp1_reference, draft_model):
    """Two hosts (network namespaces): ``join --role draft`` with another model (the real model's first 6
    layers) forms a group of its own; then a ``join`` node forms the target group, drafting with it by
    default (``status`` says so on both sides) and ``generate --cluster`` -- which finds the target's
    rank 0, never the draft node's -- gives TP=1's tokens, also with the draft node asked per request.
    The draft node killed: the serving group stays (same formation) and answers the same."""
    from test_cluster import SECRET, JoinNode, _env, run_generate_cli

    n_tokens, prompt = 24, "The capital of France is"
    plain = tp1_reference.generate(prompt=prompt, max_tokens=n_tokens).token_ids
    cluster = f"draft-{uuid.uuid4().hex[:8]}"
    (ns0, ip0), (ns1, ip1) = two_hosts
    nodes = [JoinNode(tmp_path, cluster, "host-0", ip0, 50051, netns=ns0, interface="eth0", world_size=None,
                      role="draft", extra=["--model", draft_model])]
    try:
        def formed(node):  # the node's log says its group formed (read in place: no status process per poll)
            return until(lambda: "formed: world size 1" in node.text(), 240,
                         lambda: "\n".join(n.text()[-2000:] for n in nodes), interval_s=0.2)

        formed(nodes[0])
        # a target node without --world-size: it looks for peers DISCOVERY_S before forming alone, so it
        # sees the running draft node (a node that formed before it saw one drafts without it)
        nodes.append(JoinNode(tmp_path, cluster, "host-1", ip1, 50051, netns=ns1, interface="eth0", world_size=None))
        formed(nodes[1])
        # the target's coordinator formed with the draft group's address (its log names both)
        log1 = nodes[1].text()
        forming = [line for line in log1.splitlines() if "forming cluster" in line]
        assert len(forming) == 1 and "drafting with the draft node's group at " + ip0 + ":" in forming[0], log1
        draft_at = forming[0].rsplit(" at ", 1)[1].strip()
        fid = forming[0].split("(formation ", 1)[1].split(")", 1)[0]
        text = subprocess.run(["ip", "netns", "exec", ns1, sys.executable, "-m", "mlxcluster", "status", "--cluster",
                               cluster, "--interface", "eth0", "--timeout", "2"], capture_output=True, text=True,
                              env=_env({"MLXCLUSTER_SECRET": SECRET}), timeout=60).stdout
        assert f"rank 0 at {ip1}:" in text, text  # the target's rank 0 heads the status, not the draft node's
        assert f"drafting with the draft node's group at {draft_at}" in text, text
        assert f"role draft: serving drafts at {draft_at}, used by formation {fid} (host-1)" in text, text
        proc = run_generate_cli(cluster, "eth0", netns=ns1, max_tokens=n_tokens, prompt=prompt)
        assert proc.returncode == 0, proc.stderr + "\n".join(n.text()[-2000:] for n in nodes)
        assert json.loads(proc.stdout)["token_ids"] == plain
        asked = subprocess.run(["ip", "netns", "exec", ns1, sys.executable, "-m", "mlxcluster", "generate", prompt,
                                "--cluster", cluster, "--interface", "eth0", "--max-tokens", str(n_tokens), "--json",
                                "--draft", f"remote:{draft_at}", "--draft-tokens", "2"],
                               capture_output=True, text=True, env=_env({"MLXCLUSTER_SECRET": SECRET}), timeout=300)
        assert asked.returncode == 0, asked.stderr
        out = json.loads(asked.stdout)
        assert out["token_ids"] == plain and out["spec_drafted_tokens"] > 0, out  # drafts from the draft node
        nodes[0].kill()  # the draft node vanishes: the serving group stays, its plans go on plainly
        proc = run_generate_cli(cluster, "eth0", netns=ns1, max_tokens=n_tokens, prompt=prompt)
        assert proc.returncode == 0, proc.stderr + "\n".join(n.text()[-2000:] for n in nodes)
        assert json.loads(proc.stdout)["token_ids"] == plain
        log1 = nodes[1].text()  # the same formation served throughout: never torn down, never formed again
        assert log1.count("forming cluster") == 1 and "tearing down" not in log1 and "tore down" not in log1, log1
    finally:
        for n in nodes:
            n.stop()

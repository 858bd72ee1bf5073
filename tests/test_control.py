"""Tests for the control plane: frames, the rank-N frame handler
(Follower), its gRPC face (RankControlServicer + RankLink), and
rank 0's scheduler (Scheduler), on a tiny random Llama."""

import asyncio
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

mx = pytest.importorskip("mlx.core")
grpc = pytest.importorskip("grpc")
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

import tinymodel  # noqa: E402
from harness import chunk_plan, decode_plan, join_plan, leave_plan, one_reply  # noqa: E402
from mlxcluster.protocol import frames as fr  # noqa: E402
from mlxcluster.protocol import mlxcluster_pb2 as pb  # noqa: E402
from mlxcluster.protocol import mlxcluster_pb2_grpc as pb_grpc  # noqa: E402
from mlxcluster.control.follower import Follower, RankControlServicer  # noqa: E402
from mlxcluster.control.link import RankError, RankGroup, RankLink  # noqa: E402
from mlxcluster.leader.scheduler import Scheduler, StepTimes  # noqa: E402
from mlxcluster.engine import batch as batch_mod  # noqa: E402
from mlxcluster.engine import passes as passes_mod  # noqa: E402
from mlxcluster.engine.decode import LOOKAHEAD_PROBE_STEPS, RankEngine  # noqa: E402
from mlxcluster.engine.prefix_cache import PrefixCache  # noqa: E402
from mlxcluster.engine.sampling import Sampling  # noqa: E402
from mlxcluster.engine.session import ShardSession  # noqa: E402
from mlxcluster.model.tp import build_model  # noqa: E402

VOCAB = tinymodel.TINY_CONFIG["vocab_size"]
CONTEXT = tinymodel.TINY_CONFIG["max_position_embeddings"]
PROMPT = [1, 5, 200, 17, 3, 99, 42]


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(autouse=True)
def _executor_idle(executor):
    """An earlier test's event loop is gone, but an MLX call it submitted (a step, a lookahead step, the
    removal of an abandoned sequence) may still run on the shared one-thread executor: let it finish
    before this test (and its counting monkeypatches) starts."""
    executor.submit(lambda: None).result()


@pytest.fixture
def server(model):
    return Follower(model, rank=1, vocab_size=VOCAB, context_length=CONTEXT)


@pytest.fixture
def forwards(monkeypatch):
    """Counts ShardSession forward passes."""
    calls = []
    original = ShardSession._forward

    def counting(self, ids, **kwargs):
        calls.append(ids.shape[1])
        return original(self, ids, **kwargs)

    monkeypatch.setattr(ShardSession, "_forward", counting)
    return calls


def greedy_reference(model, prompt, n):
    """Greedy tokens by a full forward over the whole sequence at every step (no KV cache)."""
    seq = list(prompt)
    out = []
    for _ in range(n):
        logits = model(mx.array([seq], dtype=mx.int32))[0, -1]
        t = int(mx.argmax(logits).item())
        out.append(t)
        seq.append(t)
    return out


@pytest.fixture(scope="module")
def reference_tokens(model):
    return greedy_reference(model, PROMPT, 8)


# --------------------------------------------------------------------------- frames
def test_frame_type_values():
    """One frame type: the step plan (0x0D); the Swift app's 0x08..0x0A, and 0x0B/0x0C, are its parts now
    and their numbers are reserved, never reused."""
    assert fr.STEP_PLAN == 0x0D == pb.STEP_PLAN
    assert pb.FrameType.Name(0x0D) == "STEP_PLAN"
    assert set(pb.FrameType.values()) == {0, 0x0D}


def _round_trip(msg):
    data = msg.SerializeToString()
    back = type(msg).FromString(data)
    assert back == msg
    return back


def test_frames_serialise_and_parse_back():
    frame = _round_trip(fr.step_plan(
        leaves=[fr.session_stop("u0", pb.MAX_TOKENS, "why")], decode=[("u1", 7, 42), ("u2", 9, 3)],
        joins=[fr.prompt_tokens("u3", [1, 2, -3, 255], 17, temperature=0.5, top_p=0.9, seed=2**40, cached=2),
               fr.prompt_tokens("u4", [5], 3, source=fr.HANDOFF), fr.prompt_tokens("u5", [6], 3, source=fr.REMOTE)],
        chunks=[fr.prefill_chunk("u6", 512, 100)], batched=True, route="r", epoch="e", step=4))
    assert frame.type == 0x0D and frame.WhichOneof("payload") == "step_plan"
    p = frame.step_plan
    assert (p.step, p.batched, p.route, p.epoch) == (4, True, "r", "e")
    assert [(x.uid, x.reason, x.detail) for x in p.leaves] == [("u0", pb.MAX_TOKENS, "why")]
    assert [(e.uid, e.position, e.token) for e in p.decode] == [("u1", 7, 42), ("u2", 9, 3)]
    j = p.joins[0]
    assert (j.uid, list(j.token_ids), j.max_tokens, j.sampling.seed) == ("u3", [1, 2, -3, 255], 17, 2**40)
    assert j.sampling.temperature == pytest.approx(0.5)
    assert (fr.source_of(j), j.compute.cached, j.compute.chunked) == (fr.COMPUTE, 2, False)
    assert [fr.source_of(x) for x in p.joins] == [fr.COMPUTE, fr.HANDOFF, fr.REMOTE]
    assert [(c.uid, c.position, c.count) for c in p.chunks] == [("u6", 512, 100)]
    with pytest.raises(ValueError):
        fr.prompt_tokens("u", [1], 1, source="elsewhere")

    e = _round_trip(fr.error_reply(2, pb.OUT_OF_ORDER, "bad", "u1", position=9))
    assert (e.ok, e.code, e.rank, e.position, e.type, e.uid, e.error) == (False, pb.OUT_OF_ORDER, 2, 9, 0x0D, "u1", "bad")
    assert fr.error_reply(2, pb.INTERNAL, "x").position == 0

    _round_trip(pb.FrameReply(uid="u", type=pb.STEP_PLAN, ok=True, rank=1, peak_memory_bytes=2**40, position=5,
                              left=True))
    _round_trip(pb.HealthReply(rank=1, world_size=3, state="ready", model="m"))
    _round_trip(pb.Frame(type=11))  # unknown frame types survive the wire


def test_describe():
    assert fr.describe(join_plan("ab12", [1, 2, 3], 5)) == "stepPlan(step=0: join ab12 3 tokens compute)"
    assert fr.describe(decode_plan("ab12", 7, 42)) == "stepPlan(step=0: decode ab12 pos=7 token=42)"
    assert fr.describe(leave_plan("ab12", pb.MAX_TOKENS)) == "stepPlan(step=0: leave ab12 MAX_TOKENS)"
    assert fr.describe(chunk_plan("ab12", 512, 100)) == "stepPlan(step=0: chunk ab12 512+100)"
    assert fr.describe(fr.step_plan(decode=[("a", 1, 2), ("b", 3, 4)], joins=[
        fr.prompt_tokens("c", [1] * 600, 5, cached=16, chunked=True)], step=3)) == \
        "stepPlan(step=3: decode 2; join c 600 tokens compute(cached=16, chunked))"
    assert fr.describe(fr.step_plan(step=9)) == "stepPlan(step=9: empty)"
    assert fr.describe(pb.Frame(type=11)) == "0x0B(malformed)"


# --------------------------------------------------------------------------- Follower (rank N)
def test_server_prompt_steps_and_stop(server, forwards, reference_tokens):
    assert one_reply(server, join_plan("s1", PROMPT, 10)) is None
    assert server.session is not None and server.session.uid == "s1"
    # a rank N runs the head only where its logits are the group's (then it samples too)
    assert server.session.compute_logits is server.samples_here
    assert server.session.position == len(PROMPT)
    assert forwards == [len(PROMPT)]
    for i, t in enumerate(reference_tokens[:3]):
        assert one_reply(server, decode_plan("s1", len(PROMPT) + i, t)) is None
        assert server.session.position == len(PROMPT) + i + 1
    assert forwards == [len(PROMPT), 1, 1, 1]
    assert server.session.cache[0].offset == len(PROMPT) + 3

    reply = one_reply(server, leave_plan("s1", pb.MAX_TOKENS))
    assert reply is not None and reply.ok
    assert reply.type == pb.STEP_PLAN and reply.left and reply.uid == "s1" and reply.rank == 1
    assert reply.peak_memory_bytes > 0
    assert reply.position == len(PROMPT) + 3
    assert server.session is None
    assert server.frames_handled == 5


def test_server_new_prompt_joins_the_batch(server):
    assert one_reply(server, join_plan("old", PROMPT, 10)) is None
    assert one_reply(server, join_plan("new", [4, 5], 10)) is None
    assert server.batch.uids == ["old", "new"] and server.session is None
    assert [s.position for s in server.batch.sessions] == [len(PROMPT), 2]
    # a decode step that does not name the whole batch, in order, is refused
    reply = one_reply(server, decode_plan("old", len(PROMPT), 1))
    assert not reply.ok and reply.code == pb.BAD_FRAME and "this rank holds ['old', 'new']" in reply.error
    reply = one_reply(server, decode_plan([("new", 2, 1), ("old", len(PROMPT), 1)]))
    assert not reply.ok and reply.code == pb.BAD_FRAME
    # the same uid twice is refused
    reply = one_reply(server, join_plan("old", PROMPT, 10))
    assert not reply.ok and reply.code == pb.BAD_FRAME


def _expect_rejected(server, forwards, frame, code, *, position, uid=None, contains=None, blamed=None):
    before = len(forwards)
    reply = one_reply(server, frame)
    assert reply is not None, "frame was not rejected"
    assert reply.ok is False
    assert reply.code == code, pb.ErrorCode.Name(reply.code)
    assert reply.rank == server.rank
    assert reply.type == pb.STEP_PLAN
    if blamed is not None:
        assert reply.uid == blamed
    assert reply.error and "\n" not in reply.error
    if contains:
        assert contains in reply.error
    assert len(forwards) == before, "a rejected frame ran a forward pass"
    if uid is None:
        assert server.session is None
    else:
        assert server.session is not None and server.session.uid == uid
        assert server.session.position == position
        assert server.session.cache[0].offset == position
    assert reply.position == position
    return reply


def test_server_rejects_bad_step_frames(server, forwards):
    n = len(PROMPT)
    # no session at all
    _expect_rejected(server, forwards, decode_plan("s1", 0, 1), pb.UNKNOWN_SESSION, position=0)
    assert one_reply(server, join_plan("s1", PROMPT, 10)) is None
    base = len(forwards)
    _expect_rejected(server, forwards, decode_plan("other", n, 1), pb.UNKNOWN_SESSION,
                     position=n, uid="s1", contains="other", blamed="other")
    _expect_rejected(server, forwards, decode_plan("s1", n + 1, 1), pb.OUT_OF_ORDER, position=n, uid="s1",
                     blamed="s1")
    _expect_rejected(server, forwards, decode_plan("s1", n - 1, 1), pb.OUT_OF_ORDER, position=n, uid="s1")
    _expect_rejected(server, forwards, decode_plan("s1", n, -1), pb.BAD_TOKEN, position=n, uid="s1")
    _expect_rejected(server, forwards, decode_plan("s1", n, VOCAB), pb.BAD_TOKEN, position=n, uid="s1",
                     contains=str(VOCAB))
    assert len(forwards) == base
    # the session is still usable after the rejections
    assert one_reply(server, decode_plan("s1", n, VOCAB - 1)) is None
    assert server.session.position == n + 1


def test_server_rejects_bad_prompt_frames(server, forwards):
    _expect_rejected(server, forwards, join_plan("s1", [], 10), pb.BAD_FRAME, position=0)
    _expect_rejected(server, forwards, join_plan("s1", [1, -5, 2], 10), pb.BAD_TOKEN, position=0)
    _expect_rejected(server, forwards, join_plan("s1", [1, VOCAB], 10), pb.BAD_TOKEN, position=0)
    _expect_rejected(server, forwards, join_plan("s1", [1] * CONTEXT, 10), pb.CONTEXT_OVERFLOW, position=0)
    _expect_rejected(server, forwards, join_plan("", [1, 2], 10), pb.BAD_FRAME, position=0)
    # a rejected prompt leaves a running session alone
    assert one_reply(server, join_plan("s1", PROMPT, 10)) is None
    _expect_rejected(server, forwards, join_plan("s2", [], 10), pb.BAD_FRAME,
                     position=len(PROMPT), uid="s1")
    _expect_rejected(server, forwards, join_plan("s2", [0] * (CONTEXT + 5), 10), pb.CONTEXT_OVERFLOW,
                     position=len(PROMPT), uid="s1")
    # the longest prompt that fits: context - 1
    assert one_reply(server, join_plan("s3", [2] * (CONTEXT - 1), 10)) is None
    assert server.batch.uids == ["s1", "s3"]
    assert server.batch.find("s3").position == CONTEXT - 1


def test_server_context_overflow_on_step(server, forwards):
    assert one_reply(server, join_plan("s1", [2] * (CONTEXT - 1), 10)) is None
    assert one_reply(server, decode_plan("s1", CONTEXT - 1, 3)) is None  # fills the cache
    assert server.session.position == CONTEXT
    _expect_rejected(server, forwards, decode_plan("s1", CONTEXT, 3), pb.CONTEXT_OVERFLOW,
                     position=CONTEXT, uid="s1")


def test_server_rejects_unknown_and_malformed_frames(server, forwards):
    _expect_rejected(server, forwards, pb.Frame(type=12), pb.BAD_FRAME, position=0, contains="0x0C")
    _expect_rejected(server, forwards, pb.Frame(type=pb.FRAME_TYPE_UNSPECIFIED), pb.BAD_FRAME, position=0)
    # the plan's type without its payload, or the payload under another type
    _expect_rejected(server, forwards, pb.Frame(type=pb.STEP_PLAN), pb.BAD_FRAME, position=0)
    mixed = pb.Frame(type=9, step_plan=pb.StepPlan(decode=[pb.BatchEntry(uid="s1")]))
    _expect_rejected(server, forwards, mixed, pb.BAD_FRAME, position=0)
    assert server.session is None


def test_server_checks_the_whole_plan_before_running_any_of_it(server, forwards):
    """A plan whose last part is wrong runs none of its parts: its leave, its decode step and its
    join stay undone (no forward pass, no sequence freed), and one error reply names the culprit."""
    assert one_reply(server, join_plan("a", PROMPT, 10)) is None
    assert one_reply(server, join_plan("b", [4, 5], 10)) is None
    n = len(PROMPT)
    bad = fr.step_plan(leaves=[fr.session_stop("b")], decode=[("a", n, 1)],
                       joins=[fr.prompt_tokens("c", [1, 2], 5)], chunks=[fr.prefill_chunk("zz", 0, 1)])
    _expect_rejected(server, forwards, bad, pb.UNKNOWN_SESSION, position=0, blamed="zz", contains="zz")
    assert server.batch.uids == ["a", "b"] and [s.position for s in server.batch.sessions] == [n, 2]
    # a uid twice among the joins; a leave twice
    twice = fr.step_plan(joins=[fr.prompt_tokens("c", [1], 5), fr.prompt_tokens("c", [2], 5)])
    _expect_rejected(server, forwards, twice, pb.BAD_FRAME, position=0, blamed="c", contains="already resident")
    _expect_rejected(server, forwards, fr.step_plan(leaves=[fr.session_stop("a"), fr.session_stop("a")]),
                     pb.BAD_FRAME, position=n, blamed="a")
    # the same plan, right: the leave's ack, then a's step, then c's prefill, in that order
    before = len(forwards)
    good = fr.step_plan(leaves=[fr.session_stop("b")], decode=[("a", n, 1)], joins=[fr.prompt_tokens("c", [1, 2], 5)])
    replies = server.handle_frame(good)
    assert [(r.uid, r.left, r.ok) for r in replies] == [("b", True, True)]
    assert forwards[before:] == [1, 2]  # the decode step of the batch left, then the join's prefill
    assert server.batch.uids == ["a", "c"] and [s.position for s in server.batch.sessions] == [n + 1, 2]
    # a sequence leaving may join again in the same plan (a refused K/V source computed instead)
    again = fr.step_plan(leaves=[fr.session_stop("c", pb.ERROR)], joins=[fr.prompt_tokens("c", [7, 8, 9], 5)])
    assert [r.uid for r in server.handle_frame(again)] == ["c"]
    assert server.batch.uids == ["a", "c"] and server.batch.find("c").position == 3


def test_server_session_stop_unknown_uid(server, forwards):
    _expect_rejected(server, forwards, leave_plan("nobody"), pb.UNKNOWN_SESSION, position=0)
    assert one_reply(server, join_plan("s1", PROMPT, 10)) is None
    _expect_rejected(server, forwards, leave_plan("nobody"), pb.UNKNOWN_SESSION,
                     position=len(PROMPT), uid="s1")
    assert one_reply(server, leave_plan("s1")).ok
    # stopped twice: the second is unknown
    _expect_rejected(server, forwards, leave_plan("s1"), pb.UNKNOWN_SESSION, position=0)


# --------------------------------------------------------------------------- lockstep correctness
def _cache_arrays(session):
    out = []
    for c in session.cache:
        out += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    return out


@pytest.mark.parametrize("chunk", [None, 3])
def test_session_prefill_and_steps_equal_full_forward(model, monkeypatch, chunk):
    if chunk:  # several prefill chunks, the last one partial
        monkeypatch.setattr(passes_mod, "PREFILL_CHUNK_TOKENS", chunk)
    seq = PROMPT + [7, 100, 0, 255, 31]
    n = len(PROMPT)
    full_logits = model(mx.array([seq], dtype=mx.int32))[0]
    full_hidden = model.model(mx.array([seq], dtype=mx.int32))[0]

    s = ShardSession(model, "a", compute_logits=True)
    got = [s.prefill(PROMPT)]
    for t in seq[n:-1]:
        got.append(s.step(t))
    assert s.position == len(seq) - 1
    for i, logits in enumerate(got):
        assert logits.shape == (VOCAB,)
        np.testing.assert_allclose(np.array(logits), np.array(full_logits[n - 1 + i]), atol=1e-4, rtol=1e-4)

    # a rank N (no output head) builds the same KV cache, and its hidden
    # state for the next token equals the full forward's
    r = ShardSession(model, "b", compute_logits=False)
    assert r.prefill(PROMPT) is None
    for t in seq[n:-1]:
        assert r.step(t) is None
    assert r.position == s.position
    for a, b in zip(_cache_arrays(r), _cache_arrays(s)):
        assert mx.array_equal(a, b).item()
    hidden = model.model(mx.array([[seq[-1]]], dtype=mx.int32), cache=r.cache)[0, -1]
    np.testing.assert_allclose(np.array(hidden), np.array(full_hidden[-1]), atol=1e-4, rtol=1e-4)


GROUP = [PROMPT, [9, 8, 7], [100, 3, 3, 4, 250, 6, 1, 12, 13], [42]]  # lengths 7, 3, 9, 1


def test_leaving_sequences_free_rows_that_joining_ones_reuse(model):
    """A sequence leaving a batch of three or more frees its cache row without copying the
    others' K/V; a later prompt (or group) that fits left of the write index is written into free
    rows, one longer (or a group larger than the free rows) is appended by copy, the free rows
    compacted on the way, and more than half the rows free compacts them.  Every sequence decodes
    its lone greedy answer throughout, in join order."""
    greedy = Sampling()
    prompts = {"a": PROMPT, "b": [9, 8, 7, 6, 5], "c": [42, 17, 3, 99, 1, 2], "d": [5, 6], "e": [100, 3, 3],
               "f": [7], "g": list(range(20, 60)), "h": [1, 2, 3], "i": [4], "x": [11, 12], "y": [13],
               "z": [14, 15, 16]}
    want = {u: greedy_reference(model, p, 16) for u, p in prompts.items()}
    eng = RankEngine(model, CONTEXT)
    batch = eng.batch
    got = {}

    def join(*uids):
        for u, t in zip(uids, eng.prefill_many([(u, prompts[u], greedy, (), 100, 0) for u in uids])):
            got[u] = [t]

    def steps(k):
        for _ in range(k):
            for u, t in zip(batch.uids, eng.step()):
                got[u].append(t)

    def leave(*uids):
        for u in uids:
            eng.remove(u)
            assert got[u] == want[u][:len(got[u])], u

    def rows():
        return [None if r is None else r.uid for r in batch._rows]

    join("a")
    join("b")
    join("c")
    steps(3)
    leave("b")
    assert rows() == ["a", None, "c"]  # its row kept, nothing copied
    join("d")                          # 2 positions, fewer than the write index: into the free row
    assert rows() == ["a", "d", "c"] and batch.rows_reused == 1 and batch.uids == ["a", "c", "d"]
    steps(3)
    leave("a", "c")
    assert rows() == [] and batch._cache is None and batch.uids == ["d"]  # d alone: its own KVCache again
    join("e", "f")
    steps(2)
    leave("e")
    join("g")  # 40 positions, more than the write index: compacted, then appended by copy
    assert rows() == ["d", "f", "g"] and batch.rows_reused == 1
    steps(2)
    leave("f")
    join("h", "i")  # two prompts, one free row: compacted, then appended
    assert rows() == ["d", "g", "h", "i"]
    steps(2)
    leave("h", "i")
    assert rows() == ["d", "g", None, None]  # half free: kept
    join("x", "y")  # a group into the free rows
    assert rows() == ["d", "g", "x", "y"] and batch.rows_reused == 3
    join("z")
    steps(2)
    leave("d", "x", "y")  # three of five free: compacted
    assert rows() == ["g", "z"] and batch.uids == ["g", "z"]
    steps(2)
    for u in batch.uids:
        assert got[u] == want[u][:len(got[u])], u


def test_padding_every_row_holds_is_compacted_away_when_rows_leave(model, monkeypatch):
    """Rows that join a running batch are right-aligned at its write index, so once the longest row
    leaves, every remaining row holds left padding that each step still attends over: it is
    compacted away (one ``filter``) once it reaches PAD_SLACK (here 4) and a quarter of the write
    index, and every sequence goes on decoding its lone greedy answer."""
    monkeypatch.setattr(batch_mod, "PAD_SLACK", 4)
    greedy = Sampling()
    prompts = {"g": list(range(20, 60)), "b": [9, 8, 7, 6, 5], "c": [42, 17, 3], "d": [5, 6]}
    want = {u: greedy_reference(model, p, 12) for u, p in prompts.items()}
    eng = RankEngine(model, CONTEXT)
    batch = eng.batch
    got = {}
    for u, t in zip(prompts, eng.prefill_many([(u, p, greedy, (), 100, 0) for u, p in prompts.items()])):
        got[u] = [t]

    def steps(k):
        for _ in range(k):
            for u, t in zip(batch.uids, eng.step()):
                got[u].append(t)

    steps(3)
    eng.remove("b")  # g still holds the earliest position: nothing every row holds
    assert batch.compactions == 0 and batch._cache[0]._idx == 43
    steps(2)
    eng.remove("g")  # c and d now hold 38+ positions of left padding each
    assert batch.compactions == 1 and batch._cache[0]._idx == 3 + 5 and min(batch._cache[0].left_padding.tolist()) == 0
    steps(4)
    for u in ("c", "d"):
        assert got[u] == want[u][:len(got[u])], u


@pytest.mark.parametrize("chunk", [None, 3])
def test_batched_prefill_equals_lone_prefills(model, monkeypatch, chunk):
    """prefill_many of prompts of different lengths (right-padded, several chunks with ``chunk``
    3, a one-token prompt) leaves each sequence the lone prefill's K/V and first token, and the
    batch then decodes their lone greedy answers."""
    if chunk:
        monkeypatch.setattr(passes_mod, "PREFILL_CHUNK_TOKENS", chunk)
    greedy = Sampling()
    lone = []
    for i, p in enumerate(GROUP):
        eng = RankEngine(model, CONTEXT)
        first = eng.prefill(f"u{i}", p, greedy, (), 6)
        lone.append((first, [c.keys_and_values() for c in eng.get(f"u{i}").session.cache],
                     greedy_reference(model, p, 6)))
    eng = RankEngine(model, CONTEXT)
    assert eng.batched_prefill
    eng.prefill("old", [5, 6], greedy, (), 6)  # a lone resident sequence: the group merges with it
    first = eng.prefill_many([(f"u{i}", p, greedy, (), 6, 0) for i, p in enumerate(GROUP)])
    assert first == [f for f, _, _ in lone]
    assert eng.batch.uids == ["old"] + [f"u{i}" for i in range(len(GROUP))]
    assert [s.position for s in eng.batch.sessions] == [2] + [len(p) for p in GROUP]
    for i, (_, kv, _) in enumerate(lone):
        rows = [c.extract(i + 1) for c in eng.batch._cache]
        for (k, v), row in zip(kv, rows):
            np.testing.assert_allclose(np.array(row.keys), np.array(k), atol=1e-5)
            np.testing.assert_allclose(np.array(row.values), np.array(v), atol=1e-5)
    out = [[f] for f in first]
    for _ in range(5):
        for o, t in zip(out, eng.step()[1:]):
            o.append(t)
    assert out == [ref for _, _, ref in lone]


def test_server_prefills_a_batched_plan_as_one_group(model, server, forwards, monkeypatch):
    """A plan's computed joins marked ``batched`` are prefilled as one group (the call rank 0 makes,
    RankEngine.prefill_admitted(..., together=True)), in plan order; unbatched, one by one."""
    together = []
    original = RankEngine.prefill_admitted

    def spy(self, uids, together=False, _calls=together):
        _calls.append((list(uids), together))
        return original(self, uids, together)

    monkeypatch.setattr(RankEngine, "prefill_admitted", spy)
    joins = [fr.prompt_tokens(f"g{i}", p, 10) for i, p in enumerate(GROUP)]
    assert server.handle_frame(fr.step_plan(joins=joins, batched=True)) == []
    assert together == [([f"g{i}" for i in range(len(GROUP))], True)]
    assert forwards == []  # one grouped pass, not a ShardSession prefill per prompt
    assert server.batch.uids == [f"g{i}" for i in range(len(GROUP))]
    assert [s.position for s in server.batch.sessions] == [len(p) for p in GROUP]
    assert server.handle_frame(fr.step_plan(joins=[fr.prompt_tokens("h0", [1, 2], 10),
                                                   fr.prompt_tokens("h1", [3], 10)])) == []
    assert together[-1] == (["h0", "h1"], False) and forwards == [2, 1]
    # a join whose K/V source this rank cannot take is refused before anything runs
    reply = one_reply(server, join_plan("h3", [3], 10, source=fr.REMOTE))
    assert not reply.ok and reply.code == pb.BAD_FRAME and "no --prefill-peer" in reply.error
    reply = one_reply(server, join_plan("h4", [3], 10, source=fr.HANDOFF))
    assert not reply.ok and reply.code == pb.BAD_FRAME and "--local-decode" in reply.error


SHARED = [1, 5, 200, 17, 3, 99, 42, 8, 64, 7]  # a "system prompt"


def _lone_answer(model, prompt, n=5):
    eng = RankEngine(model, CONTEXT)
    eng.prefix = None
    out = [eng.prefill("x", prompt, Sampling(), (), n)]
    kv = [c.keys_and_values() for c in eng.get("x").session.cache]
    while not eng.get("x").reason:
        out += eng.step()
    return out, kv


def test_prefix_cache_reuses_the_longest_common_prefix_and_answers_the_same(model):
    """Prompts that start like an earlier one take the longest common prefix from the prefix cache
    (never their last position, never fewer than min_tokens) and get the K/V and the greedy answer
    of a prefill from scratch, alone or in a group; the cache holds at most max_positions, least
    recently used prompt dropped first."""
    greedy = Sampling()
    eng = RankEngine(model, CONTEXT)
    eng.prefix = PrefixCache(max_positions=1000, min_tokens=4)
    eng.prefill("first", SHARED + [11, 12], greedy, (), 5)
    assert len(eng.prefix) == 1 and eng.prefix.positions == 11  # all but the last position
    later = [SHARED + [30, 31, 32], SHARED[:6] + [50], SHARED[:8]]
    assert [eng.prefix_match(p) for p in later] == [10, 6, 7]  # never the last position
    assert eng.prefix_match(SHARED[:3] + [0] * 9) == 0  # 3 < min_tokens
    with pytest.raises(KeyError):
        eng.prefix.take([9] * 12, 8)
    got = eng.prefill("a", later[0], greedy, (), 5, cached=10)
    ref, ref_kv = _lone_answer(model, later[0])
    assert got == ref[0]
    for (k, v), c in zip(ref_kv, [c.extract(1) for c in eng.batch._cache]):  # "a" is row 1 of the batch
        np.testing.assert_allclose(np.array(c.keys), np.array(k), atol=1e-5)
        np.testing.assert_allclose(np.array(c.values), np.array(v), atol=1e-5)
    assert eng.prefix.hit_positions == 10
    # a group of rows with 12 ("a" is held now), 6, 7 and 0 cached positions (merged left-padded,
    # the rest right-padded)
    group = later + [[77, 78, 79]]
    hits = [eng.prefix_match(p) for p in group]
    assert hits == [12, 6, 7, 0]
    firsts = eng.prefill_many([(f"g{i}", p, greedy, (), 5, n) for i, (p, n) in enumerate(zip(group, hits))])
    assert eng.prefix.hit_positions == 10 + sum(hits)
    assert len(eng.prefix) == 2  # the group's prompts start held ones (or are too short): nothing new
    out = [[f] for f in firsts]
    for _ in range(4):
        for o, t in zip(out, eng.step()[2:]):
            o.append(t)
    assert out == [_lone_answer(model, p)[0] for p in group]
    small = PrefixCache(max_positions=20, min_tokens=4)
    for p in (SHARED, [5] * 9, [6] * 9):
        small.add(p, lambda a, b: [(mx.zeros((1, 1, b - a, 2)), mx.zeros((1, 1, b - a, 2)))])
    assert len(small) == 2 and small.positions == 16
    assert small.match([6] * 9) == 8 and small.match(SHARED + [1]) == 0


def test_server_rejects_a_prefix_it_does_not_hold(server):
    reply = one_reply(server, join_plan("p", SHARED * 2 + [1], 10, cached=16))
    assert not reply.ok and reply.code == pb.BAD_FRAME and "prefix cache holds 0" in reply.error
    assert len(server.batch) == 0


def test_engine_prefix_caching_across_requests_keeps_ranks_in_step(model, executor, server):
    """The second request sharing a prefix joins with 20 cached positions; rank N takes the same blocks
    from its own prefix cache; both answers are the greedy reference."""
    group = RankGroup()
    link = LoopbackLink(server, group.deliver, executor)
    cached = []
    original_send = link.send

    def recording_send(frame):
        cached.extend(j.compute.cached for j in frame.step_plan.joins)
        original_send(frame)

    link.send = recording_send
    engine = make_engine(model, executor, [link], group)
    prompts = [SHARED * 2 + [11], SHARED * 2 + [12, 13]]
    answers = [collect(engine, p, 6) for p in prompts]
    assert answers == [greedy_reference(model, p, 6) for p in prompts]
    assert cached == [0, len(SHARED) * 2]
    executor.submit(lambda: None).result()
    assert list(server.engine.prefix.entries) == list(engine.engine.prefix.entries)
    assert engine.broken is None and engine.cached_prompt_tokens == len(SHARED) * 2


def test_cache_salt_namespaces_the_prefix_cache_on_every_rank(model, executor, server):
    """vLLM's cache_salt (issue 32): a prompt takes prefix-cache positions only from prompts held under
    its own salt -- another salt's, and the shared namespace's, are invisible to it (no cached
    positions: nothing to learn from cached_tokens or time) --, rank N keeps the same namespaces, and
    the answers are the greedy reference either way."""
    from mlxcluster.leader.scheduler import SessionStats, salt_namespace

    group = RankGroup()
    link = LoopbackLink(server, group.deliver, executor)
    cached = []
    original_send = link.send

    def recording_send(frame):
        cached.extend((j.compute.cached, j.compute.salt) for j in frame.step_plan.joins)
        original_send(frame)

    link.send = recording_send
    engine = make_engine(model, executor, [link], group)
    first, other = SHARED * 2 + [11], SHARED * 2 + [12, 13]
    runs = [(first, "alice"), (other, "bob"), (other, ""), (other, "alice")]
    seen = []
    for prompt, salt in runs:
        stats = SessionStats(uid="")
        assert collect(engine, prompt, 6, cache_salt=salt, stats=stats) == greedy_reference(model, prompt, 6)
        seen.append(stats.cached_prompt_tokens)
    n = len(SHARED) * 2
    assert seen == [0, 0, 0, n]  # bob's and the shared namespace's requests see nothing of alice's prompt
    assert cached == [(0, salt_namespace("alice")), (0, salt_namespace("bob")), (0, ""),
                      (n, salt_namespace("alice"))]
    assert salt_namespace("") == "" and len(salt_namespace("bob")) == 32  # a digest, never the salt itself
    executor.submit(lambda: None).result()
    assert list(server.engine.prefix.entries) == list(engine.engine.prefix.entries)
    assert {k[0] for k in server.engine.prefix.entries} == {salt_namespace("alice"), salt_namespace("bob"), ""}


def test_server_cache_matches_rank0_session(model, server, reference_tokens):
    rank0 = ShardSession(model, "s1", compute_logits=True)
    token = int(mx.argmax(rank0.prefill(PROMPT)).item())
    assert one_reply(server, join_plan("s1", PROMPT, 10)) is None
    tokens = [token]
    for _ in range(4):
        assert one_reply(server, decode_plan("s1", rank0.position, token)) is None
        token = int(mx.argmax(rank0.step(token)).item())
        tokens.append(token)
    assert tokens == reference_tokens[:5]
    assert server.session.position == rank0.position
    for a, b in zip(_cache_arrays(server.session), _cache_arrays(rank0)):
        assert mx.array_equal(a, b).item()


# --------------------------------------------------------------------------- gRPC
@pytest.fixture
def grpc_rank(model, executor, tls):
    """A rank 1 served over gRPC on 127.0.0.1 (MLX work on the shared executor:
    MLX evaluation is kept on one thread per process, as in a real rank)."""
    tps = Follower(model, rank=1, vocab_size=VOCAB, context_length=CONTEXT)
    servicer = RankControlServicer(tps, executor, world_size=2, model_name="tiny")
    srv = grpc.server(ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_RankControlServicer_to_server(servicer, srv)
    port = srv.add_secure_port("127.0.0.1:0", tls.server())
    assert port > 0
    srv.start()
    yield tps, f"127.0.0.1:{port}", srv
    srv.stop(grace=None)


class Replies:
    """Rank 0's side of one RankLink in a test: every reply, awaited with a timeout."""

    def __init__(self):
        self.queue = asyncio.Queue()

    def deliver(self, reply):
        self.queue.put_nowait(reply)

    async def get(self, timeout=10.0):
        return await asyncio.wait_for(self.queue.get(), timeout)


async def _open(address, replies, creds, timeout=10.0):
    return await RankLink(1, address, replies.deliver, creds).open(timeout)


def test_rank_n_refuses_peers_without_the_secret(grpc_rank, other_tls):
    """A rank N serves only over mutual TLS under the cluster secret: a client with
    another secret, and a plaintext one, never get a frame handled."""
    tps, address, _ = grpc_rank
    with pytest.raises(RankError, match="did not answer"):
        asyncio.run(_open(address, Replies(), other_tls, timeout=0.5))  # (a channel on loopback is ready in ms)
    channel = grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)])
    try:
        with pytest.raises(grpc.RpcError) as info:
            list(pb_grpc.RankControlStub(channel).Frames(iter([join_plan("x", PROMPT, 5)]), timeout=5))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError):
            pb_grpc.RankControlStub(channel).Health(pb.HealthRequest(), timeout=5)
    finally:
        channel.close()
    assert tps.frames_handled == 0


def test_grpc_round_trip(grpc_rank, tls):
    tps, address, _ = grpc_rank

    async def run():
        replies = Replies()
        link = await _open(address, replies, tls)
        try:
            link.send(decode_plan("ghost", 0, 1))
            reply = await replies.get()
            assert not reply.ok and reply.code == pb.UNKNOWN_SESSION and reply.rank == 1 and reply.uid == "ghost"

            link.send(join_plan("s1", PROMPT, 5))
            link.send(decode_plan("s1", len(PROMPT), 3))
            link.send(decode_plan("s1", len(PROMPT) + 5, 3))  # out of order
            reply = await replies.get()
            assert not reply.ok and reply.code == pb.OUT_OF_ORDER and reply.position == len(PROMPT) + 1
            link.send(leave_plan("s1", pb.MAX_TOKENS))
            ack = await replies.get()
            assert ack.ok and ack.left and ack.type == pb.STEP_PLAN and ack.peak_memory_bytes > 0
            assert ack.position == len(PROMPT) + 1
            assert replies.queue.empty()

            # a second controller stream is refused while this one is active
            channel = tls.aio_channel(address)
            try:
                stub = pb_grpc.RankControlStub(channel)
                # (no frame written: a write racing the server's abort fails as INTERNAL on the client)
                call = stub.Frames(timeout=10)
                assert await call.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert await call.details() == "another controller stream is active"

                health = await stub.Health(pb.HealthRequest(), timeout=10)
                assert (health.rank, health.world_size, health.state, health.model) == (1, 2, "ready", "tiny")
                link.send(join_plan("s2", PROMPT, 5))
                link.send(leave_plan("ghost"))  # error reply = the prompt has been handled
                assert (await replies.get()).code == pb.UNKNOWN_SESSION
                assert (await stub.Health(pb.HealthRequest(), timeout=10)).state == "busy"
            finally:
                await channel.close()
            assert tps.session is not None and tps.session.uid == "s2"  # the intruder ran nothing
        finally:
            await link.close()

    asyncio.run(run())


def test_grpc_controller_can_reconnect(grpc_rank, tls):
    """After rank 0's stream ends, a new controller stream is served."""
    tps, address, _ = grpc_rank

    async def run():
        for attempt in range(2):
            for _ in range(50):  # bounded: the previous stream may still be winding down on the server
                replies = Replies()
                link = await _open(address, replies, tls)
                link.send(leave_plan("ghost"))
                reply = await replies.get()
                await link.close()
                if reply.code == pb.UNKNOWN_SESSION:
                    break
                assert reply.code == pb.INTERNAL, reply  # refused: the old stream still holds the rank
            else:
                pytest.fail("the rank never served a new controller stream")

    asyncio.run(run())


def test_grpc_lost_rank_is_reported(grpc_rank, tls):
    _, address, srv = grpc_rank

    async def run():
        replies = Replies()
        link = await _open(address, replies, tls)
        try:
            link.send(leave_plan("ghost"))
            assert (await replies.get()).code == pb.UNKNOWN_SESSION
            await asyncio.get_running_loop().run_in_executor(None, lambda: srv.stop(grace=None).wait(5))
            reply = await replies.get()
            assert not reply.ok and reply.code == pb.INTERNAL and reply.rank == 1
            assert "lost rank 1" in reply.error
        finally:
            await link.close()

    asyncio.run(run())


def test_rank_link_connect_timeout(tls):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(RankError, match="did not answer"):
        asyncio.run(RankLink(3, f"127.0.0.1:{port}", lambda r: None, tls).open(0.2))
    assert time.monotonic() - t0 < 5


def test_control_send_delay_delivers_every_frame_later_in_order_without_holding_the_sender():
    """``control.send=delay(MS)``: ``send`` returns at once with nothing yet in the stream; the frames
    come out of the stream's generator in send order, each at least MS ms after its send -- also one
    sent after the failpoint was unset while earlier ones still wait (it does not overtake them)."""
    from mlxcluster import failpoints

    delay_ms = 40.0

    async def run():
        loop = asyncio.get_running_loop()
        link = RankLink(1, "127.0.0.1:1", lambda r: None, credentials=None)
        stream = link._frames()
        sent = []
        with failpoints.scoped(f"control.send=delay({delay_ms:g})"):
            for i in range(5):
                sent.append(loop.time())
                link.send(fr.step_plan(step=i))
            assert link._outbox.qsize() == 0  # nothing delivered yet: the sender was not held
        sent.append(loop.time())
        link.send(fr.step_plan(step=5))  # failpoint off, but frames still wait: behind them
        got = []
        for _ in range(6):
            frame = await asyncio.wait_for(stream.__anext__(), 5.0)
            got.append((frame.step_plan.step, loop.time()))
        await link.close()
        return sent, got

    sent, got = asyncio.run(run())
    assert [step for step, _ in got] == list(range(6))
    for (step, at), t_sent in zip(got[:5], sent):
        assert at - t_sent >= delay_ms / 1e3, (step, at - t_sent)
    assert got[5][1] >= got[4][1]


def test_control_send_unset_queues_at_once():
    async def run():
        link = RankLink(1, "127.0.0.1:1", lambda r: None, credentials=None)
        link.send(fr.step_plan(step=1))
        size = link._outbox.qsize()
        await link.close()
        return size

    assert asyncio.run(run()) == 1


# --------------------------------------------------------------------------- Scheduler (rank 0)
class FakeLink:
    """Records frames; acks sessionStop like a rank N; optionally fails a step."""

    def __init__(self, rank, group, fail_on_step=None, peak=12345):
        self.rank = rank
        self.group = group
        self.fail_on_step = fail_on_step
        self.peak = peak
        self.frames = []
        self.closed = False

    def send(self, frame):
        copy = pb.Frame()
        copy.CopyFrom(frame)
        self.frames.append(copy)
        p = frame.step_plan
        if p.decode:
            steps = sum(bool(f.step_plan.decode) for f in self.frames)
            if steps == self.fail_on_step:
                self.group.deliver(fr.error_reply(self.rank, pb.OUT_OF_ORDER, "rank says no", p.decode[0].uid))
        for x in p.leaves:
            self.group.deliver(pb.FrameReply(uid=x.uid, type=frame.type, ok=True, rank=self.rank, left=True,
                                             peak_memory_bytes=self.peak))

    def close(self):
        self.closed = True

    def kinds(self):
        """Per plan sent, the parts it holds, e.g. ``("join",)``, ``("leave", "decode")``."""
        return [_kinds(f) for f in self.frames]

    def parts(self, kind):
        """Every part of ``kind`` (``leaves``, ``decode``, ``joins``, ``chunks``) sent, in order."""
        return [x for f in self.frames for x in getattr(f.step_plan, kind)]


def _kinds(frame):
    p = frame.step_plan
    return tuple(k for k, present in (("leave", p.leaves), ("decode", p.decode), ("join", p.joins),
                                      ("chunk", p.chunks)) if present)


class LoopbackLink:
    """A rank N in-process: frames go to a Follower on the MLX executor."""

    def __init__(self, server, deliver, executor):
        self.rank = server.rank
        self.server = server
        self.deliver = deliver
        self.executor = executor
        self.server_replies = []

    def send(self, frame):
        def handle():
            for reply in self.server.handle_frame(frame):
                self.server_replies.append(reply)
                self.deliver(reply)

        self.executor.submit(handle)

    def close(self):
        pass


def make_engine(model, executor, links=(), group=None, context_length=CONTEXT, step_timeout_s=30.0, **kwargs):
    group = group if group is not None else RankGroup()
    group.links = list(links)
    return Scheduler(model, group, VOCAB, context_length, executor, step_timeout_s=step_timeout_s, **kwargs)


def collect(engine, *args, stop_after=None, **kwargs):
    """Run engine.generate to the end (or break after ``stop_after`` tokens and aclose())."""

    async def run():
        out = []
        agen = engine.generate(*args, **kwargs)
        try:
            async for t in agen:
                out.append(t)
                if stop_after is not None and len(out) >= stop_after:
                    break
        finally:
            await agen.aclose()
        return out

    return asyncio.run(run())


def _fake_engine(model, executor, **link_kwargs):
    group = RankGroup()
    link = FakeLink(1, group, **link_kwargs)
    return make_engine(model, executor, [link], group), link


def test_engine_world_size_one_matches_greedy_loop(model, executor, reference_tokens):
    engine = make_engine(model, executor)
    assert engine.world_size == 1
    tokens = collect(engine, PROMPT, 8)
    assert tokens == reference_tokens
    st = engine.last_stats
    assert st.reason == pb.MAX_TOKENS and st.generated_tokens == 8 and st.prompt_tokens == len(PROMPT)
    assert len(st.peak_memory_bytes_per_rank) == 1 and st.peak_memory_bytes_per_rank[0] > 0
    assert st.ttft_s > 0 and st.prefill_tokens_per_s > 0 and st.decode_tokens_per_s > 0
    assert engine.broken is None


def test_engine_max_tokens_frames(model, executor, reference_tokens):
    engine, link = _fake_engine(model, executor)
    tokens = collect(engine, PROMPT, 5, uid="sess-1")
    assert tokens == reference_tokens[:5]
    assert engine.world_size == 2
    assert link.kinds() == [("join",)] + [("decode",)] * 4 + [("leave",)]
    assert [f.step_plan.step for f in link.frames] == list(range(1, 7))
    prompt = link.parts("joins")[0]
    assert prompt.uid == "sess-1" and list(prompt.token_ids) == PROMPT and prompt.max_tokens == 5
    steps = link.parts("decode")
    assert all(e.uid == "sess-1" for e in steps)
    assert [e.position for e in steps] == list(range(len(PROMPT), len(PROMPT) + 4))
    assert [e.token for e in steps] == tokens[:4]
    assert link.parts("leaves")[0].reason == pb.MAX_TOKENS and link.parts("leaves")[0].uid == "sess-1"
    st = engine.last_stats
    assert st.reason == pb.MAX_TOKENS
    assert st.peak_memory_bytes_per_rank[1] == 12345 and st.peak_memory_bytes_per_rank[0] > 0
    assert engine.ranks._acks == {}


def test_engine_max_tokens_one(model, executor, reference_tokens):
    engine, link = _fake_engine(model, executor)
    assert collect(engine, PROMPT, 1) == reference_tokens[:1]
    assert link.kinds() == [("join",), ("leave",)]
    assert link.parts("leaves")[0].reason == pb.MAX_TOKENS


def test_engine_stops_at_eos(model, executor, reference_tokens):
    engine, link = _fake_engine(model, executor)
    eos = reference_tokens[0]
    assert collect(engine, PROMPT, 8, [eos]) == [eos]
    assert link.kinds() == [("join",), ("leave",)]
    assert link.parts("leaves")[0].reason == pb.EOS
    assert engine.last_stats.reason == pb.EOS

    # an EOS later in the stream: yielded, then stop
    engine, link = _fake_engine(model, executor)
    eos = reference_tokens[3]
    expected = reference_tokens[: reference_tokens.index(eos) + 1]
    assert collect(engine, PROMPT, 8, [999, eos]) == expected
    assert len(link.parts("decode")) == len(expected) - 1
    assert len(link.parts("leaves")) == 1
    assert link.kinds()[-1] == ("leave",) and link.parts("leaves")[0].reason == pb.EOS


def test_engine_cancelled(model, executor, reference_tokens):
    engine, link = _fake_engine(model, executor)
    tokens = collect(engine, PROMPT, 8, stop_after=2)
    assert tokens == reference_tokens[:2]
    stops = link.parts("leaves")
    assert len(stops) == 1 and stops[0].reason == pb.CANCELLED
    assert link.kinds()[-1] == ("leave",)
    # the scheduler may have decoded one step ahead of the consumer
    assert 1 <= len(link.parts("decode")) <= 2
    assert engine.last_stats.reason == pb.CANCELLED
    assert engine.broken is None
    # the engine is usable again (lock released); the late ack of the
    # cancelled session does not disturb the next one
    assert collect(engine, PROMPT, 3) == reference_tokens[:3]
    assert engine.last_stats.reason == pb.MAX_TOKENS
    assert engine.last_stats.peak_memory_bytes_per_rank[1] == 12345


def test_engine_cancelled_sessions_leave_no_acks(model, executor):
    engine, link = _fake_engine(model, executor)
    collect(engine, PROMPT, 8, stop_after=2, uid="cancelled")
    collect(engine, PROMPT, 2, uid="finished")
    assert engine.ranks._acks == {}


def test_engine_rank_error(model, executor, reference_tokens):
    engine, link = _fake_engine(model, executor, fail_on_step=2)
    got = []

    async def run():
        agen = engine.generate(PROMPT, 8)
        try:
            async for t in agen:
                got.append(t)
        finally:
            await agen.aclose()

    with pytest.raises(RankError, match="rank says no"):
        asyncio.run(run())
    assert got == reference_tokens[:2]
    assert engine.broken and "rank says no" in engine.broken
    stops = link.parts("leaves")
    assert len(stops) == 1 and stops[0].reason == pb.ERROR
    assert engine.last_stats.reason == pb.ERROR
    # a broken group refuses new sessions without sending anything
    sent = len(link.frames)
    with pytest.raises(RankError, match="broken"):
        collect(engine, PROMPT, 3)
    assert len(link.frames) == sent


def test_a_group_failing_during_a_joins_prefill_fails_that_request(model, executor):
    """A request taken from the queue into a plan is not in the batch yet while its prefill runs: when a
    rank fails then, it still ends with the group's error (never waits forever), and so does a request
    already decoding beside it."""
    engine, link = _fake_engine(model, executor)
    original = engine.engine.prefill_admitted

    def failing(uids, together=False):
        if "joining" in uids:  # rank 1 fails while this prompt is prefilled
            engine.ranks.deliver(fr.error_reply(1, pb.INTERNAL, "rank 1 died mid-prefill", "joining"))
        return original(uids, together)

    engine.engine.prefill_admitted = failing

    async def run():
        async def drain(agen):
            return [t async for t in agen]

        first = engine.generate(PROMPT, 30, uid="running")
        await first.__anext__()  # decoding
        both = asyncio.gather(drain(first), drain(engine.generate([4, 5, 6], 5, uid="joining")),
                              return_exceptions=True)
        return await asyncio.wait_for(both, 60)

    results = asyncio.run(run())
    assert all(isinstance(r, RankError) and "rank 1 died mid-prefill" in str(r) for r in results), results
    assert engine.broken and engine.running == 0 and engine.queued == 0


@pytest.mark.parametrize("prompt,max_tokens", [
    ([], 5),
    ([1, -1, 2], 5),
    ([1, VOCAB, 2], 5),
    ([0] * CONTEXT, 5),
    ([0] * (CONTEXT + 3), 5),
    ([1, 2], 0),
])
def test_engine_rejects_bad_prompts_before_sending(model, executor, prompt, max_tokens):
    engine, link = _fake_engine(model, executor)
    with pytest.raises(ValueError) as info:
        collect(engine, prompt, max_tokens)
    assert "\n" not in str(info.value)
    assert link.frames == []
    if max_tokens:
        with pytest.raises(ValueError):
            engine.validate_prompt(prompt)
    assert engine.broken is None


def test_engine_validate_prompt_accepts_longest(model, executor):
    engine = make_engine(model, executor)
    engine.validate_prompt([0] * (CONTEXT - 1))
    engine.validate_prompt([VOCAB - 1])


def test_engine_context_full(model, executor, server):
    group = RankGroup()
    link = LoopbackLink(server, group.deliver, executor)
    engine = make_engine(model, executor, [link], group)
    prompt = [(7 * i) % VOCAB for i in range(CONTEXT - 3)]
    tokens = collect(engine, prompt, 50)
    assert len(tokens) == 3  # prompt + generated == context
    assert tokens == greedy_reference(model, prompt, 3)
    assert engine.last_stats.reason == pb.CONTEXT_FULL
    assert [(r.ok, r.left) for r in link.server_replies] == [(True, True)]  # only the leave's ack
    assert server.session is None
    assert engine.last_stats.peak_memory_bytes_per_rank[1] > 0


def test_engine_lockstep_with_in_process_rank(model, executor, server, reference_tokens):
    group = RankGroup()
    link = LoopbackLink(server, group.deliver, executor)
    engine = make_engine(model, executor, [link], group)
    assert collect(engine, PROMPT, 6, uid="lock") == reference_tokens[:6]
    assert len(link.server_replies) == 1 and link.server_replies[0].ok
    # every rank looked ahead on the last token and kept that step when the sequence left (settled)
    assert link.server_replies[0].position == len(PROMPT) + 6
    assert server.session is None
    assert engine.broken is None


def test_engine_over_grpc(model, executor, grpc_rank, reference_tokens, tls):
    tps, address, _ = grpc_rank

    async def run():
        group = RankGroup()
        group.bind()
        group.add(await RankLink(1, address, group.deliver, tls).open(10))
        engine = make_engine(model, executor, group.links, group)
        try:
            tokens = [t async for t in engine.generate(PROMPT, 5)]
        finally:
            await engine.close()
        return engine, tokens

    engine, tokens = asyncio.run(run())
    assert tokens == reference_tokens[:5]
    assert engine.broken is None
    peaks = engine.last_stats.peak_memory_bytes_per_rank
    assert len(peaks) == 2 and peaks[1] > 0
    assert tps.session is None
    assert tps.frames_handled == 1 + 4 + 1


# --------------------------------------------------------------------------- sampling
def test_seeded_sampling_is_reproducible(model, executor, reference_tokens):
    engine = make_engine(model, executor)
    a = collect(engine, PROMPT, 12, temperature=0.8, seed=1234)
    mx.random.seed(999)  # global PRNG state must not matter
    mx.eval(mx.random.normal((4,)))
    b = collect(engine, PROMPT, 12, temperature=0.8, seed=1234)
    c = collect(engine, PROMPT, 12, temperature=0.8, seed=4321)
    assert a == b
    assert a != c
    assert a[:8] != reference_tokens  # sampled, not greedy
    assert all(0 <= t < VOCAB for t in a + c)


def test_seeded_sampling_frames_carry_settings(model, executor):
    engine, link = _fake_engine(model, executor)
    collect(engine, PROMPT, 2, temperature=0.8, top_p=0.9, seed=77)
    s = link.parts("joins")[0].sampling
    assert s.temperature == pytest.approx(0.8) and s.top_p == pytest.approx(0.9) and s.seed == 77


# --------------------------------------------------------------------------- continuous batching
def test_engine_batches_concurrent_requests(model, executor, server):
    """Concurrent requests decode together (plans with several decode entries) and each gets its own
    greedy answer."""
    prompts = [PROMPT, [9, 8, 7], [100, 3, 3, 4, 250, 6, 1, 12, 13], [42]]
    lengths = [10, 6, 8, 3]
    expected = [greedy_reference(model, p, n) for p, n in zip(prompts, lengths)]
    group = RankGroup()
    link = LoopbackLink(server, group.deliver, executor)
    seen, groups = [], []
    original_send = link.send

    def recording_send(frame):
        seen.append(frame)
        if frame.step_plan.joins:
            groups.append((len(frame.step_plan.joins), frame.step_plan.batched))
        original_send(frame)

    link.send = recording_send
    engine = make_engine(model, executor, [link], group)

    async def run_all():
        async def one(p, n):
            return [t async for t in engine.generate(p, n)]
        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))

    results = asyncio.run(run_all())
    assert results == expected
    assert any(len(f.step_plan.decode) > 1 for f in seen)  # they really were decoded together
    assert sum(len(f.step_plan.joins) for f in seen) == 4 and sum(len(f.step_plan.leaves) for f in seen) == 4
    assert groups == [(4, True)]  # arrived together: one batched prefill on every rank
    executor.submit(lambda: None).result()
    assert len(server.batch) == 0 and engine.running == 0 and engine.queued == 0
    assert engine.broken is None


def test_engine_queue_full(model, executor):
    from mlxcluster.protocol.errors import QueueFullError

    engine = make_engine(model, executor, max_batch=1, max_queue=1)

    async def run():
        first = engine.generate(PROMPT, 30)
        second = engine.generate(PROMPT, 30)
        third = engine.generate(PROMPT, 30)
        t1 = await first.__anext__()  # running
        t2 = asyncio.ensure_future(second.__anext__())
        await asyncio.sleep(0)  # one loop turn: the task enters generate() and queues
        assert engine.queued == 1 and not t2.done()
        with pytest.raises(QueueFullError):
            await third.__anext__()
        await first.aclose()
        got = await t2
        await second.aclose()
        return t1, got

    t1, t2 = asyncio.run(run())
    assert t1 == t2  # same prompt, same first token


def test_engine_queue_bound_counts_the_room_the_itl_target_leaves(model, executor):
    """With an inter-token latency target holding the batch below max_batch, the queue still holds
    at most max_queue requests beyond that room (not max_batch's)."""
    from mlxcluster.protocol.errors import QueueFullError

    engine = make_engine(model, executor, max_batch=8, max_queue=1, itl_target_s=1.0)

    class One(StepTimes):
        def limit(self, target_s, cap):
            return 1

    engine.step_times = One()

    async def run():
        first = engine.generate(PROMPT, 30)
        second = engine.generate(PROMPT, 30)
        third = engine.generate(PROMPT, 30)
        await first.__anext__()  # running: the batch is full at the target's limit
        t2 = asyncio.ensure_future(second.__anext__())
        await asyncio.sleep(0)  # one loop turn: the task enters generate() and queues
        assert engine.queued == 1 and engine.running == 1
        with pytest.raises(QueueFullError):
            await third.__anext__()
        await first.aclose()
        await t2
        await second.aclose()

    asyncio.run(run())


# --------------------------------------------------------------------------- pipelining (world size 1)
def test_engine_pipelined_world_one(model, executor, reference_tokens, monkeypatch):
    issued = []
    original = ShardSession.issue_greedy

    def counting(self, token):
        issued.append(self.position)
        return original(self, token)

    monkeypatch.setattr(ShardSession, "issue_greedy", counting)
    engine = make_engine(model, executor)
    assert collect(engine, PROMPT, 8) == reference_tokens[:8]
    # 7 decode steps needed; the 8th was queued speculatively and rolled back
    assert issued == [len(PROMPT) + i for i in range(8)]
    # the pipelined path is not taken for sampling or when turned off
    issued.clear()
    collect(engine, PROMPT, 4, temperature=0.7, seed=1)
    off = make_engine(model, executor, pipeline=False)
    assert collect(off, PROMPT, 8) == reference_tokens[:8]
    assert issued == []


def test_engine_pipelined_stops_cancel_and_context(model, executor, reference_tokens):
    engine = make_engine(model, executor)
    eos = reference_tokens[4]
    n = reference_tokens.index(eos) + 1
    assert collect(engine, PROMPT, 30, eos_token_ids=[eos]) == reference_tokens[:n]
    assert engine.last_stats.reason == pb.EOS
    prompt = [(7 * i) % VOCAB for i in range(CONTEXT - 3)]
    assert collect(engine, prompt, 50) == greedy_reference(model, prompt, 3)
    assert engine.last_stats.reason == pb.CONTEXT_FULL
    assert len(collect(engine, PROMPT, 30, stop_after=3)) == 3
    assert collect(engine, PROMPT, 8) == reference_tokens[:8]


def test_engine_pipelined_sequence_joins_a_batch(model, executor):
    prompts = [PROMPT, [9, 8, 7], [42]]
    lengths = [12, 6, 4]
    expected = [greedy_reference(model, p, n) for p, n in zip(prompts, lengths)]
    engine = make_engine(model, executor)

    async def run():
        first = engine.generate(prompts[0], lengths[0])
        head = [await first.__anext__() for _ in range(4)]  # pipelined alone first

        async def rest():
            return head + [t async for t in first]

        async def other(p, n):
            return [t async for t in engine.generate(p, n)]

        return await asyncio.gather(rest(), other(prompts[1], lengths[1]), other(prompts[2], lengths[2]))

    assert list(asyncio.run(run())) == expected


@pytest.mark.parametrize("limit", [2, None])
def test_engine_keeps_the_batch_within_the_step_time_limit(model, executor, limit):
    """With an inter-token latency target, requests wait rather than grow the batch past the size
    StepTimes allows; every decode step is timed into it (batch size, positive seconds)."""
    prompts = [PROMPT, [9, 8, 7], [42], [5, 6], [77, 1, 2]]
    expected = [greedy_reference(model, p, 6) for p in prompts]
    engine = make_engine(model, executor, itl_target_s=0.5 if limit else 0.0)
    steps = []

    class Fixed(StepTimes):  # the limit is StepTimes' business (test_admission); here: is it obeyed
        def record(self, batch, seconds):
            steps.append((batch, seconds))

        def limit(self, target_s, cap):
            return limit if target_s > 0 else cap

    engine.step_times = Fixed()

    async def run():
        async def one(p):
            return [t async for t in engine.generate(p, 6)]

        return await asyncio.gather(*(one(p) for p in prompts))

    assert list(asyncio.run(run())) == expected
    assert steps and all(s > 0 for _, s in steps)
    if limit:
        assert max(b for b, _ in steps) == limit
    else:
        assert max(b for b, _ in steps) == len(prompts)


def test_pipelined_batch_changes_keep_the_queued_step(model, executor, monkeypatch):
    """A sequence that joins or leaves a pipelined batch does not roll back the step queued on it:
    its tokens are delivered (RankEngine.settle), the answers stay those of lone greedy runs."""
    from mlxcluster.engine.batch import DecodeBatch

    rollbacks = []
    real = DecodeBatch.rollback
    monkeypatch.setattr(DecodeBatch, "rollback", lambda self, n=1: (rollbacks.append(n), real(self, n))[1])
    prompts, lengths = [PROMPT, [9, 8, 7], [42]], [12, 3, 5]
    expected = [greedy_reference(model, p, n) for p, n in zip(prompts, lengths)]
    engine = make_engine(model, executor)

    async def run():
        first = engine.generate(prompts[0], lengths[0])
        head = [await first.__anext__() for _ in range(3)]

        async def rest():
            return head + [t async for t in first]

        async def other(p, n):
            return [t async for t in engine.generate(p, n)]

        return await asyncio.gather(rest(), other(prompts[1], lengths[1]), other(prompts[2], lengths[2]))

    assert list(asyncio.run(run())) == expected
    assert rollbacks == []


def test_lookahead_turns_off_for_a_kind_of_step_whose_queuing_does_the_work(model):
    """RankEngine times its first LOOKAHEAD_PROBE_STEPS lookahead steps per kind (compiled lone
    step or not) and steps without lookahead where queuing the next step took longer than the wait
    after it; a kind whose queuing returned early keeps it."""
    greedy = Sampling()
    eng = RankEngine(model, CONTEXT)
    eng.prefill("a", PROMPT, greedy, (), 50)
    eng.prefill("b", [9, 8, 7], greedy, (), 50)
    eng.step(lookahead=True)  # a real step is timed, and queues the next
    assert len(eng._probes[False]) == 1 and eng._pending is not None
    eng.settle()
    eng._probes[False].clear()
    for _ in range(LOOKAHEAD_PROBE_STEPS - 1):
        eng._probe(False, 0.100, 0.010)
    assert not eng.lookahead_off  # not decided before the last probe
    eng._probe(False, 0.100, 0.010)
    assert eng.lookahead_off == {False}
    for _ in range(LOOKAHEAD_PROBE_STEPS):
        eng._probe(True, 0.005, 0.050)
    assert eng.lookahead_off == {False}
    tokens = eng.step(lookahead=True)
    assert len(tokens) == 2 and eng._pending is None  # off: nothing queued


def test_lookahead_is_the_normal_shape_at_world_size_one(model, executor, monkeypatch):
    """Batches and sampled sequences step with lookahead too (one step queued
    ahead, rolled back when the batch changes), with the same tokens as
    without it."""
    from mlxcluster.engine.batch import DecodeBatch

    forwards = []
    original = DecodeBatch.forward
    monkeypatch.setattr(DecodeBatch, "forward", lambda self, x: (forwards.append(len(self)), original(self, x))[1])
    prompts = [PROMPT, [9, 8, 7]]

    def run(engine):
        async def both():
            async def one(p, n, **kw):
                return [t async for t in engine.generate(p, n, **kw)]
            return await asyncio.gather(one(prompts[0], 10, temperature=0.8, seed=3), one(prompts[1], 6))
        return asyncio.run(both())

    ahead = run(make_engine(model, executor, compile_decode=False))
    n_ahead = len(forwards)
    forwards.clear()
    plain = run(make_engine(model, executor, pipeline=False))
    assert ahead == plain and [len(a) for a in ahead] == [10, 6]
    assert ahead[1] == greedy_reference(model, prompts[1], 6)
    assert 2 in forwards  # they really were batched
    # every lookahead step that was not used (batch changes, the end) was queued on top
    assert n_ahead > len(forwards)


def test_seeded_sampling_does_not_depend_on_batching(model, executor, server):
    """A seeded request gets the same tokens alone and with another request
    joining mid-way, at world size 1 (lookahead) and 2 (frame-driven)."""
    def alone(engine):
        return collect(engine, PROMPT, 12, temperature=0.9, seed=11)

    def joined(engine):
        async def run():
            first = engine.generate(PROMPT, 12, temperature=0.9, seed=11)
            head = [await first.__anext__() for _ in range(3)]

            async def rest():
                return head + [t async for t in first]

            async def other():
                return [t async for t in engine.generate([5, 6, 7], 4, temperature=0.5, seed=2)]

            return (await asyncio.gather(rest(), other()))[0]
        return asyncio.run(run())

    one = make_engine(model, executor)
    expected = alone(one)
    assert joined(one) == expected
    group = RankGroup()
    two = make_engine(model, executor, [LoopbackLink(server, group.deliver, executor)], group)
    assert alone(two) == expected and joined(two) == expected
    assert two.broken is None


def test_compiled_greedy_step_matches_the_kv_cache_path_across_buckets():
    """Teacher-forced on varied tokens, the compiled static-KV step's argmax
    equals the KVCache path's at every position -- across a buffer growth past
    256 positions, after a rollback, and after handing its buffers back."""
    import random

    from mlxcluster.engine.compiled import BUCKET, CompiledGreedyStep

    config, weights = tinymodel.tiny_llama(seed=3, max_position_embeddings=1024)
    m = build_model(config, weights, None, "float32")
    rng = random.Random(5)
    prompt = [rng.randrange(VOCAB) for _ in range(8)]
    forced = [rng.randrange(VOCAB) for _ in range(BUCKET + 40)]

    ref = ShardSession(m, "ref")
    ref.prefill(prompt)
    expected = [int(mx.argmax(ref.step(t)).item()) for t in forced]
    assert len(set(expected)) > 20  # the check below is not about a repeated token

    s = ShardSession(m, "compiled")
    s.compiled = CompiledGreedyStep(m)
    s.prefill(prompt)
    half = len(forced) - 20
    got = [int(s.issue_greedy(t).item()) for t in forced[:half]]
    assert s._static[0][0].shape[2] == 2 * BUCKET  # the buffers grew once
    s.issue_greedy((forced[half] + 7) % VOCAB)  # a speculative step on another token ...
    s.rollback(1)                 # ... withdrawn, then compiled steps go on
    got += [int(s.issue_greedy(t).item()) for t in forced[half:half + 5]]
    s.leave_static()              # back to mlx-lm's KVCache
    assert s.cache[0].offset == s.position == len(prompt) + half + 5
    got += [int(mx.argmax(s.step(t)).item()) for t in forced[half + 5:]]
    assert got == expected


@pytest.mark.slow  # real network timers (mDNS, heartbeats): seconds of waiting
def test_a_rank_that_stops_answering_heartbeats_is_lost_within_10_s(model, executor, tls, monkeypatch):
    """A frozen rank N (its Health no longer answered, as under SIGSTOP) fails the group
    after LOST_AFTER_S -- while nothing waits on it, and long before a step timeout."""
    import threading

    from mlxcluster.control import link as link_mod

    assert link_mod.LOST_AFTER_S + link_mod.HEARTBEAT_S <= 10  # the product's bound
    monkeypatch.setattr(link_mod, "LOST_AFTER_S", 2.0)  # the same mechanism, faster
    monkeypatch.setattr(link_mod, "HEARTBEAT_S", 0.3)

    frozen = threading.Event()
    released = threading.Event()

    class Freezable(RankControlServicer):
        def Health(self, request, context):
            if frozen.is_set():
                released.wait(30)
            return super().Health(request, context)

    tps = Follower(model, rank=1, vocab_size=VOCAB, context_length=CONTEXT)
    srv = grpc.server(ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_RankControlServicer_to_server(Freezable(tps, executor, world_size=2, model_name="tiny"), srv)
    port = srv.add_secure_port("127.0.0.1:0", tls.server())
    srv.start()

    async def run():
        group = RankGroup()
        group.bind()
        broke = asyncio.Event()
        group.on_broken = broke.set
        group.add(await RankLink(1, f"127.0.0.1:{port}", group.deliver, tls).open(10))
        try:
            # answered heartbeats keep an idle group alive past the loss timeout
            await asyncio.sleep(link_mod.LOST_AFTER_S + 1.5)  # an observation window, not synchronisation
            assert group.broken is None
            t0 = time.monotonic()
            frozen.set()
            await asyncio.wait_for(broke.wait(), 10)
            elapsed = time.monotonic() - t0
            assert link_mod.LOST_AFTER_S - 1.5 <= elapsed < 10, elapsed
            assert "no heartbeat answered" in group.broken and "rank 1" in group.broken
            with pytest.raises(RankError, match="no heartbeat"):
                group.drain()
        finally:
            released.set()
            await group.close()

    try:
        asyncio.run(run())
    finally:
        released.set()
        srv.stop(None)


def test_the_mlx_thread_reports_how_long_its_current_frame_has_run(server):
    """HealthReply.busy_s (the node's freeze signal): the seconds the MLX thread has been in the
    frame it runs -- growing while a frame blocks (as in a collective with a frozen rank), restarted
    per frame of a drain (each frame is marked), 0 when idle; HealthReply.step_s: its slowest recent
    frame."""
    import queue
    import threading

    from harness import until
    from mlxcluster.control.mlx_thread import MlxThread

    thread = MlxThread()
    servicer = RankControlServicer(server, thread, world_size=2, model_name="tiny")
    release, marks = threading.Event(), []
    try:
        assert servicer.Health(pb.HealthRequest(), None).busy_s == 0.0
        assert servicer.Health(pb.HealthRequest(), None).step_s == 0.0  # no frame done yet
        job = thread.submit(release.wait, 30)
        first = until(lambda: servicer.Health(pb.HealthRequest(), None).busy_s >= 0.05 and thread.busy_s(),
                      what="busy_s to grow while a piece of work blocks")
        thread.mark()  # a new frame inside the same drain
        assert thread.busy_s() < first
        # HealthReply.step_s: the slowest recent frame (the one just marked done), the pace busy_s is
        # judged against (membership.peer_timeout)
        assert servicer.Health(pb.HealthRequest(), None).step_s >= first
        release.set()
        job.result(10)
        until(lambda: servicer.Health(pb.HealthRequest(), None).busy_s == 0.0, what="busy_s back to 0")
        assert thread.step_s() >= first
        inbox, replies, end = queue.Queue(), queue.Queue(), object()
        for frame in (leave_plan("a"), leave_plan("b"), end):
            inbox.put(frame)
        assert server.drain(inbox, replies, end, lambda: marks.append(1)) and len(marks) == 2
    finally:
        release.set()
        thread.shutdown(wait=True)


def test_the_mlx_thread_counts_the_frames_that_waited_for_it():
    """MlxThread.plan_waits (issue 42's benchmark): the first frame of a drain waited the idle time
    before it, the drain's other frames none; a pause of WAIT_CAP_S or more (between generations) is
    not counted; a frame that found the thread idle WAITED_S or more waited."""
    from mlxcluster.control.mlx_thread import WAIT_CAP_S, WAITED_S, MlxThread

    now = [100.0]
    thread = MlxThread(clock=lambda: now[0])

    def drain(frames: int) -> None:
        for _ in range(frames):
            thread.mark()

    try:
        thread.submit(drain, 3).result(10)  # the first drain: no idle time before it is known
        assert thread.plan_waits() == {"plan_frames": 2, "plan_wait_s": 0.0, "plan_waited": 0}
        now[0] += 4 * WAITED_S  # the next plan came 4 ms after the thread went idle
        thread.submit(drain, 2).result(10)
        now[0] += WAITED_S / 2
        thread.submit(drain, 1).result(10)
        now[0] += WAIT_CAP_S  # a pause between generations
        thread.submit(drain, 1).result(10)
        got = thread.plan_waits()
        assert (got["plan_frames"], got["plan_waited"]) == (5, 1)
        assert got["plan_wait_s"] == pytest.approx(4.5 * WAITED_S)
    finally:
        thread.shutdown(wait=True)


# --------------------------------------------------------------------------- every rank samples (issue 42)
def _recording_link(server, group, executor):
    """A LoopbackLink that records each frame it sends and whether rank N had a lookahead step queued
    when the frame arrived (i.e. the step was computing while the frame travelled)."""
    link = LoopbackLink(server, group.deliver, executor)
    seen, checked = [], []
    link.checked = checked  # per frame: the uids whose fed token rank N checks against its own
    original = link.send

    def send(frame):
        seen.append((frame, server.engine.queued))
        checked.append(set(server.engine.expected_tokens(settled=frame.step_plan.settled)))
        original(frame)

    link.send = send
    return link, seen


def test_every_rank_samples_and_queues_the_next_step_before_the_plan_arrives(model, executor, server, reference_tokens):
    """In a group whose ranks all hold the logits, rank N samples each sequence itself and queues the
    next decode step on its own lazy tokens (StepPlan.ahead), so a plain decode plan finds that step
    already queued there; the plans' fed tokens equal rank N's own; greedy tokens equal one rank's."""
    group = RankGroup()
    link, seen = _recording_link(server, group, executor)
    engine = make_engine(model, executor, [link], group)
    assert collect(engine, PROMPT, 8, uid="ahead") == reference_tokens[:8]
    join = next(f.step_plan.joins[0] for f, _ in seen if f.step_plan.joins)
    assert join.every_rank_samples
    plain = [(f.step_plan, queued) for f, queued in seen if f.step_plan.decode and not f.step_plan.joins]
    assert sum(p.ahead for p, _ in plain) >= 5
    # every plan after a lookahead plan found its step queued on rank N before it arrived
    after = [queued for (prev, _), (_, queued) in zip(plain, plain[1:]) if prev.ahead]
    assert after and all(after)
    assert engine.broken is None


def test_seeded_sampling_is_derived_on_every_rank_with_lookahead(model, executor, server):
    """Seeded temperature sampling: rank N draws every token itself with the (seed, index) key; no
    plan's fed token differs from its own, and the answer equals a group of one rank's."""
    from mlxcluster.engine.sampling import Sampling

    sampling = Sampling(temperature=0.9, top_p=0.95, seed=1234)
    alone = collect(make_engine(model, executor), PROMPT, 12, sampling=sampling)
    group = RankGroup()
    link, seen = _recording_link(server, group, executor)
    engine = make_engine(model, executor, [link], group)
    assert collect(engine, PROMPT, 12, sampling=sampling) == alone
    assert any(f.step_plan.ahead for f, _ in seen) and engine.broken is None


def test_a_rank_whose_token_differs_fails_the_group_closed_naming_the_step_and_rank(model, executor, server):
    """Failpoint decode.token=flip: rank 1's own token differs from rank 0's; the next plan is refused
    before any collective with one line naming the step and the rank, and the request fails (its
    answer is then replayed by the client on a new group: issue 29)."""
    from mlxcluster import failpoints

    group = RankGroup()
    link, seen = _recording_link(server, group, executor)
    engine = make_engine(model, executor, [link], group)
    with failpoints.scoped("decode.token", "flip"):
        with pytest.raises(RankError) as info:
            collect(engine, PROMPT, 8, uid="flip")
    message = str(info.value)
    assert "\n" not in message
    assert "rank 1 sampled token" in message and "the ranks disagree" in message
    step = int(message.split("step ")[1].split(":")[0])
    assert step in [f.step_plan.step for f, _ in seen]
    assert engine.broken is not None


def test_flip_at_fails_the_group_once_after_the_token_it_names(model, executor, server):
    """decode.token=flip_at(N): the tokens before and including token N reach the client (rank 0's
    own, the greedy reference's), then the group fails closed naming the step and rank 1 -- the
    replay resumes after them, past N, where nothing flips again."""
    from mlxcluster import failpoints

    group = RankGroup()
    link, seen = _recording_link(server, group, executor)
    engine = make_engine(model, executor, [link], group)
    got = []

    async def run():
        async for t in engine.generate(PROMPT, 12, uid="flip-at"):
            got.append(t)

    with failpoints.scoped("decode.token", "flip_at(5)"):
        with pytest.raises(RankError, match="rank 1 sampled token .* the ranks disagree"):
            asyncio.run(run())
    assert 5 <= len(got) < 12 and got == greedy_reference(model, PROMPT, 12)[:len(got)]
    assert failpoints.parse("decode.token=flip_at(5)")["decode.token"].arg == 5
    for bad in ("flip_at", "flip_at(0)", "flip_at(2.5)", "flip(3)"):
        with pytest.raises(ValueError):
            failpoints.parse(f"decode.token={bad}")


def test_a_batch_with_a_drafting_sequence_runs_on_rank_0s_tokens_then_looks_ahead_again(model, executor, server):
    """A sequence with a drafter is sampled by rank 0 alone: while it decodes no plan looks ahead and
    rank N takes its every-rank sequence's tokens from the plans (adopted: its seeded sampler's index
    and history follow), then samples it itself again once the drafting one left; both answers equal
    one rank's."""
    from mlxcluster.engine.sampling import Sampling

    sampling = Sampling(temperature=0.9, seed=77)
    prompts, lengths = [PROMPT, [9, 8, 7, 9, 8, 7, 9, 8]], [16, 5]
    seeded = collect(make_engine(model, executor), prompts[0], lengths[0], sampling=sampling)
    expected = [seeded, greedy_reference(model, prompts[1], lengths[1])]
    group = RankGroup()
    link, seen = _recording_link(server, group, executor)
    engine = make_engine(model, executor, [link], group)

    async def run_all():
        async def one(p, n, **kw):
            return [t async for t in engine.generate(p, n, **kw)]
        return await asyncio.gather(one(prompts[0], lengths[0], sampling=sampling),
                                    one(prompts[1], lengths[1], speculative=("ngram", 4)))

    assert asyncio.run(run_all()) == expected
    joins = {j.uid: j.every_rank_samples for f, _ in seen for j in f.step_plan.joins}
    assert sorted(joins.values()) == [False, True]
    both = [f.step_plan for f, _ in seen if len(f.step_plan.decode) == 2]
    assert both and not any(p.ahead for p in both)
    alone = [(f.step_plan, uids) for (f, _), uids in zip(seen, link.checked) if len(f.step_plan.decode) == 1]
    assert any(p.ahead for p, _ in alone)  # after the drafting sequence left
    # ... and rank N checked every fed token of the every-rank sequence against its own again
    mine = next(u for u, every in joins.items() if every)
    assert all(mine in uids for p, uids in alone[1:] if p.decode[0].uid == mine)
    assert engine.broken is None


def test_a_group_keeps_lookahead_unless_the_steps_without_it_measure_faster():
    """AheadChoice (issue 42: measure both ways before choosing): PROBE_STEPS steady steps with
    lookahead, then as many without, at one batch size; lookahead stays unless the steps without it
    were more than MARGIN faster.  The first step after a switch and steps of another batch size are
    no samples; a batch size outside [b/2, 2b], or REPROBE_STEPS steps after the choice, measure again."""
    from mlxcluster.leader.scheduler import AheadChoice

    def probe(with_s, without_s, batch=4):
        c = AheadChoice()
        for _ in range(4 * AheadChoice.PROBE_STEPS):
            if c.choice is not None:
                break
            ahead = c.want()
            c.record(ahead, batch, with_s if ahead else without_s)
        return c

    slow_link = probe(0.010, 0.013)  # the flight of each plan on the token's path: lookahead wins
    assert slow_link.choice is True and slow_link.want()
    contended = probe(0.012, 0.008)  # queued collectives spinning against each other: lookahead loses
    assert contended.choice is False and not contended.want()
    assert probe(0.0100, 0.0098).choice is True  # within the margin: lookahead
    # the first step after the switch (0.5 s: the pipeline drains) is no sample
    c = AheadChoice()
    for i in range(2 * AheadChoice.PROBE_STEPS + 1):
        ahead = c.want()
        c.record(ahead, 4, 0.5 if (not ahead and not c.samples[False] and c._last) else (0.010 if ahead else 0.009))
    assert c.choice is False and max(c.samples[False]) == 0.009
    # another batch size measures again; REPROBE_STEPS later, too
    c.record(False, 16, 0.02)
    assert c.choice is None and c.batch == 16 and c.want()
    d = probe(0.012, 0.008)
    for _ in range(AheadChoice.REPROBE_STEPS):
        d.record(False, 4, 0.008)
    d.record(False, 4, 0.008)
    assert d.choice is None and d.want()


def test_read_first_lookahead_returns_before_the_next_step_is_queued(model):
    """RankEngine.read_first (a group on MLX's CPU backend, where queuing a step computes it): a
    lookahead step with ``defer`` returns this step's tokens with the next step owed, not queued --
    rank 0's next plan goes out while queue_owed runs it --; the KV length and ``queued`` read the
    same before and after it is queued; settle and the next step take it as mlx-lm's order would, and
    the tokens are the greedy answers of both orders."""
    greedy = Sampling()
    prompts = {"a": [9, 8, 7, 6, 5], "b": list(range(20, 40))}
    want = {u: greedy_reference(model, p, 10) for u, p in prompts.items()}
    eng = RankEngine(model, CONTEXT, read_first=True)
    got = {u: [t] for u, t in zip(prompts, eng.prefill_many([(u, p, greedy, (), 100, 0)
                                                              for u, p in prompts.items()]))}
    lengths = {u: eng.kv_length(eng.get(u)) for u in prompts}
    for i in range(6):
        for u, t in zip(eng.batch.uids, eng.step(None, lookahead=True, exact=True, defer=True)):
            got[u].append(t)
        assert eng._owed is not None and eng.queued  # owed: nothing queued on the batch yet
        owed_lengths = {u: eng.kv_length(eng.get(u)) for u in prompts}
        assert owed_lengths == {u: n + i + 1 for u, n in lengths.items()}
        eng.queue_owed()
        assert eng._owed is None and eng._pending is not None and eng.queued
        assert {u: eng.kv_length(eng.get(u)) for u in prompts} == owed_lengths
    for u, t in eng.settle().items():
        got[u].append(t)
    for u, t in zip(eng.batch.uids, eng.step()):
        got[u].append(t)
    assert not eng.queued
    for u in prompts:
        assert got[u] == want[u][:len(got[u])] and len(got[u]) == 9, u

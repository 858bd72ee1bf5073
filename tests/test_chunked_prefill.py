"""Chunked prefill: a long prompt is prefilled one chunk per step of rank 0's loop, interleaved
with the running batch's decode steps and with short prompts, on every rank (``promptTokens.chunked``
then ``prefillChunk`` frames); the stuck-group watchdog times one chunk, never a whole prompt.

In-process, on the tiny random Llama: rank 0's :class:`Scheduler` with a :class:`Follower` behind a
loopback link, chunks of 4 tokens."""

import asyncio
import os
import sys

import pytest

mx = pytest.importorskip("mlx.core")

sys.path.insert(0, os.path.dirname(__file__))

from test_control import (CONTEXT, VOCAB, LoopbackLink, _cache_arrays, collect,  # noqa: E402,F401
                          greedy_reference, make_engine)
from mlxcluster.control.follower import Follower  # noqa: E402
from mlxcluster.control.link import RankGroup  # noqa: E402
from mlxcluster.engine import passes as passes_mod  # noqa: E402
from mlxcluster.engine.decode import RankEngine  # noqa: E402
from mlxcluster.engine.sampling import Sampling  # noqa: E402
from harness import chunk_plan, join_plan, leave_plan, one_reply  # noqa: E402
from mlxcluster.protocol import mlxcluster_pb2 as pb  # noqa: E402

CHUNK = 4
LONG = [(7 * i + 3) % VOCAB for i in range(22)]  # 6 chunks of 4 (the last one partial)
SHORT = [9, 8, 7]


@pytest.fixture
def chunk(monkeypatch):
    monkeypatch.setattr(passes_mod, "PREFILL_CHUNK_TOKENS", CHUNK)
    return CHUNK


@pytest.fixture
def follower(model):
    return Follower(model, rank=1, vocab_size=VOCAB, context_length=CONTEXT)


# --------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("compute_logits", [True, False])
def test_chunks_across_calls_equal_one_prefill(model, chunk, compute_logits):
    """K/V and first token of a prompt prefilled by separate chunk calls equal one call's."""
    whole, parts = RankEngine(model, CONTEXT, compute_logits=compute_logits), \
        RankEngine(model, CONTEXT, compute_logits=compute_logits)
    sampling = Sampling() if compute_logits else None
    first = whole.prefill("a", LONG, sampling)
    seq = parts.admit("a", LONG, sampling)
    assert seq.prefilling and len(parts.batch) == 0 and seq.session.position == 0
    got = [parts.prefill_chunk("a", min(CHUNK, len(LONG) - p)) for p in range(0, len(LONG), CHUNK)]
    assert got[:-1] == [None] * (len(got) - 1) and got[-1] == first
    assert not seq.prefilling and parts.batch.uids == ["a"]
    for x, y in zip(_cache_arrays(whole.get("a").session), _cache_arrays(seq.session)):
        assert mx.array_equal(x, y).item()
    # both decode on identically
    assert whole.step([5]) == parts.step([5])


def test_chunk_calls_are_checked(model, chunk):
    engine = RankEngine(model, CONTEXT)
    engine.admit("a", LONG)
    with pytest.raises(ValueError, match="does not fit"):
        engine.prefill_chunk("a", len(LONG) + 1)
    with pytest.raises(ValueError, match="does not fit"):
        engine.prefill_chunk("a", 0)
    with pytest.raises(ValueError, match="already resident"):
        engine.admit("a", LONG)
    engine.prefill_chunk("a", len(LONG))
    with pytest.raises(ValueError, match="not being prefilled"):
        engine.prefill_chunk("a", 1)
    assert engine.remove("a") == len(LONG)


# --------------------------------------------------------------------------- rank N's frames
def test_follower_prefills_chunk_frames_like_rank_0(model, chunk, follower):
    rank0 = RankEngine(model, CONTEXT)
    rank0.prefill("a", LONG, Sampling())
    assert one_reply(follower, join_plan("a", LONG, 4, cached=0, chunked=True)) is None
    for p in range(0, len(LONG), CHUNK):
        assert one_reply(follower, chunk_plan("a", p, min(CHUNK, len(LONG) - p))) is None
    assert follower.batch.uids == ["a"]
    for x, y in zip(_cache_arrays(rank0.get("a").session), _cache_arrays(follower.batch.sessions[0])):
        assert mx.array_equal(x, y).item()


def test_follower_rejects_bad_chunk_frames_and_frees_a_stopped_prefill(chunk, follower):
    def rejected(frame, code, contains):
        reply = one_reply(follower, frame)
        assert reply is not None and not reply.ok and reply.code == code, reply
        assert contains in reply.error

    rejected(chunk_plan("a", 0, 4), pb.UNKNOWN_SESSION, "not being prefilled")
    assert one_reply(follower, join_plan("a", LONG, 4, cached=0, chunked=True)) is None
    rejected(join_plan("a", LONG, 4, cached=0, chunked=True), pb.BAD_FRAME, "already resident")
    rejected(chunk_plan("a", 4, 4), pb.OUT_OF_ORDER, "holds 0 tokens")
    rejected(chunk_plan("a", 0, len(LONG) + 1), pb.BAD_FRAME, "does not fit")
    rejected(chunk_plan("a", 0, 0), pb.BAD_FRAME, "does not fit")
    assert one_reply(follower, chunk_plan("a", 0, 4)) is None
    assert follower.engine.get("a").session.position == 4  # the rejected frames ran nothing
    stop = one_reply(follower, leave_plan("a", pb.CANCELLED))
    assert stop.ok and stop.position == 4
    assert follower.engine.get("a") is None and len(follower.batch) == 0


# --------------------------------------------------------------------------- rank 0's loop
def _recording(link):
    seen = []
    send = link.send

    def recording_send(frame):
        copy = pb.Frame()
        copy.CopyFrom(frame)
        seen.append(copy)
        send(frame)

    link.send = recording_send
    return seen


def _with_follower(model, executor, follower):
    """Rank 0's scheduler with ``follower`` as rank 1 over a loopback link that records every frame:
    ``(scheduler, link, frames sent)``."""
    group = RankGroup()
    link = LoopbackLink(follower, group.deliver, executor)
    seen = _recording(link)
    return make_engine(model, executor, [link], group), link, seen


def test_a_short_prompt_is_answered_while_a_long_one_prefills(model, executor, chunk, follower):
    """The long prompt goes in chunks of at most CHUNK tokens, at consecutive positions, one per loop
    iteration, with the short request's prefill and decode steps between them; both answers equal
    their lone greedy answers, and the short request's first token comes before the long one's."""
    engine, link, seen = _with_follower(model, executor, follower)
    firsts = []

    async def run():
        async def one(name, prompt, n):
            out = []
            async for t in engine.generate(prompt, n, uid=name):
                if not out:
                    firsts.append(name)
                out.append(t)
            return out
        return await asyncio.gather(one("long", LONG, 5), one("short", SHORT, 8))

    long_answer, short_answer = asyncio.run(run())
    assert long_answer == greedy_reference(model, LONG, 5)
    assert short_answer == greedy_reference(model, SHORT, 8)
    assert firsts == ["short", "long"]
    chunks = [f for f in seen if f.step_plan.chunks]
    assert all(len(f.step_plan.chunks) == 1 for f in chunks)  # one chunk per plan
    assert [(c.step_plan.chunks[0].position, c.step_plan.chunks[0].count) for c in chunks] == \
        [(p, min(CHUNK, len(LONG) - p)) for p in range(0, len(LONG), CHUNK)]
    between = seen[seen.index(chunks[0]):seen.index(chunks[-1]) + 1]
    assert any(f.step_plan.decode for f in between)  # the short stream decoded meanwhile
    executor.submit(lambda: None).result()
    assert len(follower.batch) == 0 and engine.running == 0 and engine.broken is None


def test_every_engine_call_of_a_long_prompt_is_one_chunk(model, executor, chunk):
    """What the watchdog times (one call on the MLX thread) prefills at most one chunk."""
    calls = []
    engine = make_engine(model, executor)
    original = engine.engine.prefill_chunk

    def counting(uid, count):
        calls.append(count)
        return original(uid, count)

    engine.engine.prefill_chunk = counting
    assert collect(engine, LONG, 3) == greedy_reference(model, LONG, 3)
    assert calls == [min(CHUNK, len(LONG) - p) for p in range(0, len(LONG), CHUNK)]


def test_a_prompt_cancelled_while_prefilling_is_dropped_on_every_rank(model, executor, chunk, follower):
    engine, link, seen = _with_follower(model, executor, follower)

    async def run():
        agen = engine.generate(LONG, 5, uid="gone")
        task = asyncio.ensure_future(agen.__anext__())
        send = link.send

        def cancel_on_second_chunk(frame):
            send(frame)
            if sum(len(f.step_plan.chunks) for f in seen) == 2:
                task.cancel()

        link.send = cancel_on_second_chunk
        with pytest.raises(asyncio.CancelledError):
            await task
        await agen.aclose()
        while engine._task is not None:  # the loop retires it, then ends (nothing else to do)
            await asyncio.wait_for(asyncio.shield(engine._task), 30)

    asyncio.run(run())
    stops = [x for f in seen for x in f.step_plan.leaves]
    assert [(s.uid, s.reason) for s in stops] == [("gone", pb.CANCELLED)]
    assert sum(len(f.step_plan.chunks) for f in seen) < len(range(0, len(LONG), CHUNK))
    executor.submit(lambda: None).result()
    assert follower.engine.sequences == {} and engine.engine.sequences == {} and engine.running == 0


def test_next_chunk_scales_the_last_chunk_to_the_target():
    from mlxcluster.leader.scheduler import next_chunk

    assert next_chunk(None, 0.5, 32, 512) == 32                # nothing measured: the smallest
    assert next_chunk((512, 5.0), 0.5, 32, 512) == 51          # 5 s for 512 tokens: a tenth of it
    assert next_chunk((64, 0.1), 0.5, 32, 512) == 128          # faster than the target: at most doubled
    assert next_chunk((400, 0.1), 0.5, 32, 512) == 512         # ... and never past the largest chunk
    assert next_chunk((32, 10.0), 0.5, 32, 512) == 32          # ... nor under the smallest
    assert next_chunk((0, 1.0), 0.5, 32, 512) == 32 and next_chunk((8, 0.0), 0.5, 32, 512) == 32


@pytest.mark.parametrize("target_s, sizes", [(1e-9, lambda n: [1] * n),      # slower than the target: the smallest
                                              (1e9, lambda n: None)])        # faster: doubling up to CHUNK
def test_chunks_beside_running_streams_follow_the_time_target(model, executor, monkeypatch, follower, target_s,
                                                               sizes):
    """A long prompt admitted while a stream decodes is cut into chunks sized by the measured chunk
    time against PREFILL_CHUNK_TARGET_S (not whole CHUNKs, which would hold the stream's next token for
    a whole chunk); both answers stay their lone greedy answers."""
    from mlxcluster.leader import scheduler as sch

    monkeypatch.setattr(passes_mod, "PREFILL_CHUNK_TOKENS", 8)
    monkeypatch.setattr(sch, "PREFILL_CHUNK_MIN_TOKENS", 1)
    monkeypatch.setattr(sch, "PREFILL_CHUNK_TARGET_S", target_s)
    engine, link, seen = _with_follower(model, executor, follower)

    async def run():
        stream = engine.generate(SHORT, 40, uid="stream")
        head = [await stream.__anext__()]  # the stream is decoding before the long prompt arrives

        async def rest():
            return head + [t async for t in stream]

        async def long():
            return [t async for t in engine.generate(LONG, 3, uid="long")]

        return await asyncio.gather(rest(), long())

    stream_answer, long_answer = asyncio.run(run())
    assert stream_answer == greedy_reference(model, SHORT, 40)
    assert long_answer == greedy_reference(model, LONG, 3)
    counts = [c.count for f in seen for c in f.step_plan.chunks]
    assert sum(counts) == len(LONG)
    if sizes(len(LONG)) is not None:
        assert counts == sizes(len(LONG))
    else:
        assert counts[:4] == [1, 2, 4, 8] and max(counts) == 8


def _short_beside_long(engine, link, short_tokens):
    """Generate LONG (3 tokens) and, once the first plan with a prefill chunk is sent, SHORT
    (``short_tokens``): it arrives while that chunk runs.  Returns both answers."""
    async def drain(agen):
        return [t async for t in agen]

    async def run():
        short = []
        send = link.send

        def start_short_after_the_first_chunk(frame):
            send(frame)
            if frame.step_plan.chunks and not short:
                short.append(asyncio.ensure_future(drain(engine.generate(SHORT, short_tokens, uid="short"))))

        link.send = start_short_after_the_first_chunk
        long = await drain(engine.generate(LONG, 3, uid="long"))
        return long, await short[0]

    return asyncio.run(run())


def test_a_chunk_planned_with_a_joining_request_is_sized_for_its_stream(model, executor, monkeypatch, follower):
    """A long prompt prefilled alone goes in whole chunks; in the plan where a short request joins (it
    decodes from the next plan on), the long prompt's chunk is already cut to the time target, not a
    whole chunk that would hold the short request's first decode step."""
    from mlxcluster.leader import scheduler as sch

    monkeypatch.setattr(passes_mod, "PREFILL_CHUNK_TOKENS", 8)
    monkeypatch.setattr(sch, "PREFILL_CHUNK_MIN_TOKENS", 1)
    monkeypatch.setattr(sch, "PREFILL_CHUNK_TARGET_S", 1e-9)
    engine, link, seen = _with_follower(model, executor, follower)

    long_answer, short_answer = _short_beside_long(engine, link, 4)
    assert long_answer == greedy_reference(model, LONG, 3) and short_answer == greedy_reference(model, SHORT, 4)
    plans = [f.step_plan for f in seen if f.step_plan.chunks]
    assert plans[0].chunks[0].count == 8  # alone: a whole chunk
    joined = next(p for p in plans if any(j.uid == "short" for j in p.joins))
    assert joined.chunks[0].count == 1  # beside the joining stream: the smallest, as the target says


def test_a_new_streams_first_tokens_decode_without_chunks_beside_them(model, executor, monkeypatch, follower):
    """Decode priority for a new short request (issue 42: a "Hi" beside a long prompt's prefill): while
    a stream is in its first PREFILL_PAUSE_FRESH_TOKENS tokens no plan carries a prefill chunk (for at
    most PREFILL_PAUSE_MAX_S in a row); after them the long prompt's chunks run beside it again, and
    both answers are one rank's."""
    from mlxcluster.leader import scheduler as sch

    monkeypatch.setattr(passes_mod, "PREFILL_CHUNK_TOKENS", 4)
    monkeypatch.setattr(sch, "PREFILL_CHUNK_MIN_TOKENS", 1)
    monkeypatch.setattr(sch, "PREFILL_PAUSE_FRESH_TOKENS", 6)
    engine, link, seen = _with_follower(model, executor, follower)

    long_answer, short_answer = _short_beside_long(engine, link, 12)
    assert long_answer == greedy_reference(model, LONG, 3) and short_answer == greedy_reference(model, SHORT, 12)
    steps = [f.step_plan for f in seen if any(e.uid == "short" for e in f.step_plan.decode)]
    # a plan's entry for "short" feeds its token at that position: it has generated position - len + 1
    generated = [next(e.position for e in p.decode if e.uid == "short") - len(SHORT) + 1 for p in steps]
    fresh = [p for p, n in zip(steps, generated) if n < 6]
    assert len(fresh) >= 4 and not any(p.chunks for p in fresh)
    assert all(p.ahead for p in fresh[1:])  # the batch stays as it is: the steps look ahead
    assert any(p.chunks for p, n in zip(steps, generated) if n >= 6)  # then the long prompt goes on

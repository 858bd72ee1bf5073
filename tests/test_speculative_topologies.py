"""Speculative decoding in every topology that decodes (issue 30), in process on the tiny random Llama:
greedy answers with n-gram drafting equal the same topology's plain answers token for token, with a
rank N following rank 0's plans -- a two-stage pipeline (``1:output,0:0``: rank 0 the output stage,
rank 1 the embedding stage, its hidden states handed over by an in-process send/recv), ``--local-decode``
over that route (rank 0 decodes and verifies alone; rank 1 ignores the kept counts) and a PD decode group
of two ranks (each fetching its K/V from an in-process prefill group).

Requests start staggered, so that a request joins in the plan of another's verify step: a rank N then
prefills it while that step's rejected positions still await the next plan's kept counts, and adds it to
its batch only after that rollback (:meth:`RankEngine.commit`), in rank 0's order.  Fast tier: no rank
processes; each check fails if its mechanism is removed (the pipeline's every-position logits, a stage's
rollback, the deferred batch join, rank N's handling of ``--local-decode``'s kept counts)."""

from __future__ import annotations

import asyncio
import collections
import os
import sys

import pytest

mx = pytest.importorskip("mlx.core")

sys.path.insert(0, os.path.dirname(__file__))

import tinymodel  # noqa: E402
from harness import InProcessRank  # noqa: E402
from mlxcluster.control.follower import Follower  # noqa: E402
from mlxcluster.control.link import RankGroup  # noqa: E402
from mlxcluster.engine import handoff as ho  # noqa: E402
from mlxcluster.engine import pd  # noqa: E402
from mlxcluster.engine.sampling import make_token_sampler, sampling_of  # noqa: E402
from mlxcluster.leader.pd import PdFetch  # noqa: E402
from mlxcluster.leader.scheduler import Scheduler, SessionStats  # noqa: E402
from mlxcluster.model.layout import LayerRange, make_route, parse_layers  # noqa: E402
from mlxcluster.model.pp import PipelinedModel, PipelineStage  # noqa: E402
from mlxcluster.model.tp import build_model  # noqa: E402

CONFIG = tinymodel.TINY_CONFIG
VOCAB, CONTEXT, N_LAYERS = CONFIG["vocab_size"], CONFIG["max_position_embeddings"], CONFIG["num_hidden_layers"]
N_KV, HEAD_DIM = CONFIG["num_key_value_heads"], CONFIG["head_dim"]
#: the tiny model's greedy answers fall into loops: drafts are accepted, partly (rollbacks)
PROMPTS = [[1, 5, 200, 17, 3, 99, 42], [7, 7, 8, 100, 31, 7, 7, 8], [250, 4, 4, 4, 60, 61, 62, 63, 9]]
LENGTHS = [40, 33, 27]
ROUTE = "1:output,0:0"  # rank 0: layer 1 and the head; rank 1: the embedding and layer 0
IDENTITY = ho.identity_of("tiny", "float32", N_KV, HEAD_DIM, "float32")


pytestmark = pytest.mark.usefixtures("full_drafts")  # conftest: drafts by the tokens alone


def _model():
    config, weights = tinymodel.tiny_llama(seed=0)
    return build_model(config, weights, None, "float32")


def _answers(sched, speculative):
    """The three requests' greedy tokens and stats: the first alone, the other two once it has a token --
    with drafting, held back until a plan whose decode step verifies a draft (:func:`_join_at_a_verify_step`)."""
    if speculative[0] != "off":
        _join_at_a_verify_step(sched)

    async def one(prompt, n, started=None):
        st = SessionStats(uid="")
        out = []
        async for t in sched.generate(prompt, n, stats=st, speculative=speculative):
            out.append(t)
            if started is not None and not started.done():
                started.set_result(None)
        return out, st

    async def main():
        try:
            started = asyncio.get_running_loop().create_future()
            first = asyncio.ensure_future(one(PROMPTS[0], LENGTHS[0], started))
            await started
            rest = asyncio.gather(*[one(p, n) for p, n in zip(PROMPTS[1:], LENGTHS[1:])])
            return [await first] + list(await rest)
        finally:
            await sched.close()

    return asyncio.run(main())


def _join_at_a_verify_step(sched):
    """Waiting requests join (beside a running batch) only in a plan whose decode step verifies a draft, so
    that rank N prefills them before that step's kept counts arrive (test hook on the scheduler's plan)."""
    schedule, drafts, may_admit = sched._schedule, sched._drafts, sched._may_admit
    verifies = [False]

    async def _schedule():
        verifies[0] = False
        return await schedule()

    def _drafts(*args):
        out = drafts(*args)
        verifies[0] = bool(out[0] if isinstance(out, tuple) else out)
        return out

    sched._schedule, sched._drafts = _schedule, _drafts
    sched._may_admit = lambda req, group: may_admit(req, group) and (verifies[0] or not sched._running)


def _check(plain, spec, sched, link):
    """Speculative answers equal the plain ones; drafts were verified (some rejected); a request joined
    in a verify step's plan; rank N followed every plan (kept counts after each verify step) and holds
    nothing at the end."""
    assert [t for t, _ in spec] == [t for t, _ in plain]
    s = sched.spec_stats
    assert s.drafted > s.accepted > 0 and s.tokens > s.steps
    assert all(st.spec_drafted > 0 for _, st in spec)
    plans = [f.step_plan for f in link.frames]
    assert any(p.joins and any(e.draft for e in p.decode) for p in plans), "no request joined in a verify step's plan"
    assert sum(bool(p.kept) for p in plans) > 0
    _followed(link)


class _Rank(InProcessRank):
    """:class:`harness.InProcessRank` that keeps each plan's run (a future on the MLX thread): a plan
    that raises on rank N (a bug, not a refusal) fails the test in :func:`_followed`."""

    def __init__(self, follower, group, executor):
        super().__init__(follower, group, executor)
        self.runs = []

    def send(self, frame):
        from mlxcluster.protocol import mlxcluster_pb2 as pb

        copy = pb.Frame()
        copy.CopyFrom(frame)
        self.frames.append(copy)

        def handle():
            for reply in self.follower.handle_frame(frame):
                self.group.deliver(reply)

        self.runs.append(self.executor.submit(handle))


def _followed(link):
    """Rank N ran every plan without an error and holds no sequence and no uncommitted verify step."""
    for run in link.runs:
        run.result()
    assert link.follower.engine.sequences == {} and link.follower.engine.uncommitted is None


# -- a pipeline --------------------------------------------------------------------------------
class _Group:
    """An MLX group as :class:`PipelinedModel` sees it (``size``, ``rank``)."""

    def __init__(self, rank: int):
        self._rank = rank

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return self._rank


@pytest.fixture()
def wire(monkeypatch):
    """The pipeline's one hop in process: rank 1's ``send`` of its hidden states is rank 0's next
    ``recv`` (a FIFO; each plan runs on rank 1 before rank 0, on the one MLX thread)."""
    queue = collections.deque()

    def send(x, dst, group=None):
        assert dst == 0
        queue.append(x)
        return x

    def recv(shape, dtype, src, group=None):
        assert src == 1 and queue, "rank 0 receives what rank 1 has not sent"
        x = queue.popleft()
        assert tuple(x.shape) == tuple(shape) and x.dtype == dtype, (x.shape, shape)
        return x

    monkeypatch.setattr(mx.distributed, "send", send)
    monkeypatch.setattr(mx.distributed, "recv", recv)
    yield queue
    assert not queue


def _pipeline(executor, local_decode=False):
    """Rank 0's scheduler over the two-stage pipeline and rank 1 following it in process."""
    route = make_route(parse_layers(ROUTE, N_LAYERS), N_LAYERS)
    models = [PipelinedModel(PipelineStage(_model(), route.stage_of(r).layers, prune=not (local_decode and r == 0)),
                             route, _Group(r), epoch="e1", local_decode=local_decode, identity=IDENTITY)
              for r in range(2)]
    group = RankGroup()
    link = _Rank(Follower(models[1], 1, VOCAB, CONTEXT), group, executor)
    group.add(link)
    return Scheduler(models[0], group, VOCAB, CONTEXT, executor, step_timeout_s=30), link


def test_a_pipeline_verifies_drafts_on_every_stage(executor, wire):
    """Every verify step is one ``(B, k + 1)`` pass through both stages (rank 0 scores every position);
    rank 1 keeps the written positions until the next plan's kept counts."""
    plain = _answers(_pipeline(executor)[0], ("off", 0))
    sched, link = _pipeline(executor)
    assert sched.speculation_unsupported is None
    spec = _answers(sched, ("ngram", 4))
    _check(plain, spec, sched, link)
    verify = [f.step_plan for f in link.frames if any(e.draft for e in f.step_plan.decode)]
    assert any(len(p.decode) > 1 for p in verify)  # a batch's rows rolled back apart


def test_local_decode_verifies_on_rank_0_alone(executor, wire):
    """``--local-decode``: prompts prefill through the pipeline and hand their K/V to rank 0, which
    decodes and verifies alone; rank 1 gets no decode entries and passes over the kept counts."""
    plain = _answers(_pipeline(executor, local_decode=True)[0], ("off", 0))
    sched, link = _pipeline(executor, local_decode=True)
    spec = _answers(sched, ("ngram", 4))
    assert [t for t, _ in spec] == [t for t, _ in plain]
    assert sched.spec_stats.drafted > sched.spec_stats.accepted > 0
    assert all(st.spec_drafted > 0 and st.handoff_fallback == "" for _, st in spec)
    plans = [f.step_plan for f in link.frames]
    assert not any(p.decode for p in plans) and any(p.kept for p in plans)
    _followed(link)


# -- a prefill/decode-disaggregated decode group ---------------------------------------------------
class _PrefillPeer:
    """The prefill group in process, as a decode rank's ``DecodeSide``: a fetch runs the prompt through
    :func:`~mlxcluster.engine.pd.prefill_stream` on a whole model (on the MLX thread) and reads the
    frames with the one receiver; every rank gets every KV head (each decode rank holds the whole model)."""

    def __init__(self, executor):
        self.model, self.executor = _model(), executor

    def fetch(self, uid, token_ids, sampling):
        frames = []
        s = sampling_of(sampling)
        sampler = make_token_sampler(s.temperature, s.top_p, s.seed, s.top_k, s.min_p)
        pd.prefill_stream(self.model, token_ids, sampler, [(0, N_KV)], lambda n: IDENTITY,
                          lambda _, f: frames.append(f), uid)
        stream = pd.KvStream(uid, ho.Expected(0, LayerRange(0, N_LAYERS - 1, output=True), len(token_ids),
                                              ho.prompt_hash(token_ids), IDENTITY, ""), 0)
        for f in frames:
            stream.offer(f)
        assert stream.state == pd.DECODE
        return PdFetch(stream, int(stream.marker.first_token), stream.bytes, 0.0, stream.marker.prefill_done_unix)

    async def fetch_async(self, uid, token_ids, sampling):
        return await asyncio.get_running_loop().run_in_executor(self.executor, self.fetch, uid, token_ids, sampling)


def _pd(executor):
    peer = _PrefillPeer(executor)
    group = RankGroup()
    follower = Follower(_model(), 1, VOCAB, CONTEXT)
    follower.decode_side = peer
    link = _Rank(follower, group, executor)
    group.add(link)
    return Scheduler(_model(), group, VOCAB, CONTEXT, executor, step_timeout_s=30, decode_side=peer), link


def test_a_pd_decode_group_verifies_drafts_after_the_handoff(executor):
    """Every request's K/V comes from the prefill group (remote joins on both decode ranks, one of them
    in a verify step's plan); the decode group then drafts on its rank 0 and verifies on both ranks."""
    plain = _answers(_pd(executor)[0], ("off", 0))
    sched, link = _pd(executor)
    assert sched.speculation_unsupported is None
    spec = _answers(sched, ("ngram", 4))
    _check(plain, spec, sched, link)
    assert all(st.handoff_fallback == "" and st.handoff_bytes > 0 for _, st in spec)

"""Speculative decoding end to end in rank 0's scheduler (issue 30, phase 2), in process.

* The tiny random Llama (fast): the scheduler with n-gram drafting gives the same greedy tokens as
  without, for a lone request and for three concurrent ones, at world size 1 (lookahead and the
  compiled step between verify steps) and with a rank N in process (a real :class:`Follower` fed
  every plan: drafts in the decode entries, the kept counts in the next plan -- it refuses any plan
  out of step, which would fail the request).
* The real model through :class:`GenerationServicer` (the one token path: text, logprobs, usage):
  three concurrent requests, one copying its prompt, one constrained by a JSON grammar (it never
  drafts), one with no repeats, equal to the same requests without drafting.
* A replay (``resume``: ``resume_token_ids`` at rank 0) cut inside a verify step's tokens equals the
  unbroken answer (the tiny model; the text side of a resume is test_resume's).
* Refusals: malformed drafters, bounds, a model that cannot speculate (a per-request ask refused in
  one line naming why; a server default falls back, logged once), the API's 400 and the CLI's line.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import List

import pytest

mx = pytest.importorskip("mlx.core")

sys.path.insert(0, os.path.dirname(__file__))

import tinymodel  # noqa: E402
from harness import InProcessRank  # noqa: E402
from mlxcluster.control.follower import Follower  # noqa: E402
from mlxcluster.control.link import RankGroup  # noqa: E402
from mlxcluster.leader.scheduler import Scheduler, SessionStats  # noqa: E402
from mlxcluster.model.tp import build_model  # noqa: E402
from mlxcluster.protocol import mlxcluster_pb2 as pb  # noqa: E402

VOCAB = tinymodel.TINY_CONFIG["vocab_size"]
CONTEXT = tinymodel.TINY_CONFIG["max_position_embeddings"]
#: the tiny model's greedy answers fall into loops: drafts are accepted, partly (rollbacks)
PROMPTS = [[1, 5, 200, 17, 3, 99, 42], [7, 7, 8, 100, 31, 7, 7, 8], [250, 4, 4, 4, 60, 61, 62, 63, 9]]
LENGTHS = [40, 33, 27]


def _scheduler(model, executor, rank_n: bool = False, **kw):
    group = RankGroup()
    link = None
    if rank_n:
        link = InProcessRank(Follower(model, 1, VOCAB, CONTEXT), group, executor)
        group.add(link)
    return Scheduler(model, group, VOCAB, CONTEXT, executor, step_timeout_s=30, **kw), link


def _answers(sched, prompts, lengths, speculative, **kw):
    async def one(prompt, n):
        st = SessionStats(uid="")
        return [t async for t in sched.generate(prompt, n, stats=st, speculative=speculative, **kw)], st

    async def main():
        try:
            return await asyncio.gather(*[one(p, n) for p, n in zip(prompts, lengths)])
        finally:
            await sched.close()

    return asyncio.run(main())


@pytest.mark.parametrize("rank_n", [False, True], ids=["alone", "rank-n"])
@pytest.mark.parametrize("n", [1, 3], ids=["lone", "three"])
def test_greedy_with_ngram_drafting_equals_plain_decoding(model, executor, rank_n, n, full_drafts):
    """Token for token, lone and three concurrent requests, with and without a rank N following the
    plans; the drafts were verified (accepted and rejected ones) and every plan after a verify step
    carried its kept counts."""
    plain = _answers(_scheduler(model, executor, rank_n)[0], PROMPTS[:n], LENGTHS[:n], ("off", 0))
    sched, link = _scheduler(model, executor, rank_n)
    spec = _answers(sched, PROMPTS[:n], LENGTHS[:n], ("ngram", 4))
    assert [t for t, _ in spec] == [t for t, _ in plain]
    s = sched.spec_stats
    assert s.drafted > s.accepted > 0 and s.tokens > s.steps  # several tokens per verify step, some rejected
    for (tokens, st), (_, plain_st) in zip(spec, plain):
        assert st.generated_tokens == len(tokens) and st.spec_drafted > 0
        assert st.decode_steps < plain_st.decode_steps == len(tokens) - 1
        assert st.tokens_per_step > 1.0 and 0 < st.acceptance_rate <= 1
    if rank_n:
        plans = [f.step_plan for f in link.frames]
        verify = [i for i, p in enumerate(plans) if any(e.draft for e in p.decode)]
        assert verify and all(len(plans[i + 1].kept) == len(plans[i].decode) for i in verify)
        assert sum(bool(p.kept) for p in plans) == len(verify)
        executor.submit(lambda: None).result()
        assert link.follower.engine.sequences == {}  # every sequence left, on rank N too


def test_without_a_draft_nothing_changes(model, executor):
    """No draft asked (and no server default): plain plans, no drafts, no kept counts, no counters."""
    sched, link = _scheduler(model, executor, rank_n=True)
    _answers(sched, PROMPTS, LENGTHS, None)
    assert not any(e.draft for f in link.frames for e in f.step_plan.decode)
    assert not any(f.step_plan.kept for f in link.frames)
    assert sched.spec_stats.steps == 0 and sched.draft == ""


def test_a_server_default_drafts_for_every_request_that_does_not_say(model, executor, full_drafts):
    plain = _answers(_scheduler(model, executor)[0], PROMPTS, LENGTHS, None)
    sched, _ = _scheduler(model, executor, draft="ngram:1-3", draft_tokens=3)
    got = _answers(sched, PROMPTS, LENGTHS, None)
    assert [t for t, _ in got] == [t for t, _ in plain] and sched.spec_stats.drafted > 0
    assert all(st.spec_drafted > 0 for _, st in got)
    off, _ = _scheduler(model, executor, draft="ngram")
    assert all(st.spec_drafted == 0 for _, st in _answers(off, PROMPTS, LENGTHS, ("off", 0)))


def test_a_replay_cut_inside_a_verify_step_equals_the_unbroken_answer(model, executor, monkeypatch, full_drafts):
    """The group fails after k tokens -- k inside one verify step's tokens (the client had some of
    them) -- and the answer is replayed on a fresh rank 0 with ``resume`` (prompt + those tokens
    re-admitted, their K/V computed), drafting again: the tokens equal the unbroken answer's, at world
    size 1 and with a rank N following."""
    steps = []
    original = Scheduler._deliver_verified

    def recording(self, req, v):
        steps.append((self.engine.get(req.uid).generated - len(v.tokens), len(v.tokens)))
        return original(self, req, v)

    monkeypatch.setattr(Scheduler, "_deliver_verified", recording)
    prompt, n = PROMPTS[1], 40
    (whole, st), = _answers(_scheduler(model, executor)[0], [prompt], [n], ("ngram", 4))
    cuts = [start + 1 for start, count in steps if count > 2][:2]  # after the first of 3+ tokens of one step
    assert cuts and st.spec_accepted > 0
    for k in cuts:
        for rank_n in (False, True):
            (rest, st2), = _answers(_scheduler(model, executor, rank_n)[0], [prompt], [n], ("ngram", 4),
                                    resume=whole[:k])
            assert whole[:k] + rest == whole and st2.generated_tokens == n and st2.resumed_tokens == k
            assert st2.spec_drafted > 0


def test_the_measured_verify_cost_turns_drafting_down(model, executor):
    """A verify step of 5 positions that costs 4 plain steps (a compute-bound CPU) raises the cost per
    verified position towards 0.75, and every drafting request's k falls to 0 at a middling acceptance
    rate (Leviathan section 3.5: no k yields more tokens per unit of time); a cheap one keeps it up."""
    from mlxcluster.engine.speculative import AdaptiveK

    sched, _ = _scheduler(model, executor)
    req = type("R", (), {"adaptive": AdaptiveK(4, sched.spec_cost)})()
    sched._running = [req]
    sched._measure_verify(1, 5, 0.4)  # no plain step measured yet: nothing changes
    assert sched.spec_cost == req.adaptive.cost == 0.1 and req.adaptive.best_k() > 0
    for _ in range(3):
        sched.step_times.record(1, 0.1)
    for _ in range(20):
        sched._measure_verify(1, 5, 0.4)
    assert abs(sched.spec_cost - 0.75) < 0.01 and req.adaptive.cost == sched.spec_cost
    assert req.adaptive.best_k() == 0
    for _ in range(20):
        sched._measure_verify(1, 5, 0.11)
    assert sched.spec_cost < 0.05 and req.adaptive.best_k() >= 2


# --------------------------------------------------------------------------- refusals
def _unspeculative_model():
    from mlx_lm.models import gpt_oss

    from mlxcluster.model.synthetic import TINY

    return gpt_oss.Model(gpt_oss.ModelArgs.from_dict(TINY["gpt_oss"]))


def test_refusals_are_one_line(model, executor, caplog):
    sched, _ = _scheduler(model, executor)
    for draft, k, needle in [("model:/x", 0, "model not found"), ("layers:4", 0, r"N must be in \[1, 1\]"),
                             ("medusa", 0, "unknown drafter"), ("ngram:5-2", 0, "MIN <= MAX"),
                             ("ngram", 17, r"draft_tokens must be in \[1, 16\]")]:
        with pytest.raises(ValueError, match=needle) as exc:
            sched.speculation_of(draft, k)
        assert "\n" not in str(exc.value) and str(exc.value).startswith("speculative.")
    with pytest.raises(ValueError, match="N must be in"):
        Scheduler(model, RankGroup(), VOCAB, CONTEXT, executor, draft="layers:4")
    # a model whose caches cannot roll back: a per-request ask is refused naming why, a server
    # default falls back to plain decoding and says so once
    m = _unspeculative_model()
    with caplog.at_level(logging.WARNING, logger="mlxcluster.leader.scheduler"):
        fallback = Scheduler(m, RankGroup(), VOCAB, CONTEXT, executor, draft="ngram")
    assert fallback.draft == "" and fallback.speculation_of() is None
    warned = [r.getMessage() for r in caplog.records if "--draft ngram" in r.getMessage()]
    assert len(warned) == 1 and "RotatingKVCache" in warned[0] and "without speculation" in warned[0]
    with pytest.raises(ValueError, match=r"^speculative\.draft ngram: .*RotatingKVCache cannot"):
        fallback.speculation_of("ngram", 4)

    async def ask():
        agen = fallback.generate([1, 2, 3], 4, speculative=("ngram", 4))
        try:
            await agen.__anext__()
        finally:
            await agen.aclose()

    with pytest.raises(ValueError, match="RotatingKVCache"):
        asyncio.run(ask())


def test_the_api_refuses_malformed_drafters_with_a_400_naming_speculative():
    import grpc

    from mlxcluster.front.provider import ProviderError, _grpc_error, _speculative

    assert _speculative({}) is None
    assert _speculative({"speculative": {"draft": "ngram:2-3", "draft_tokens": 5}}) == ("ngram:2-3", 5)
    assert _speculative({"speculative": {"draft": "off"}}) == ("off", 0)
    for bad, needle in [({"draft": "model:"}, "model:PATH"), ({"draft": "layers:0"}, "layers:N"),
                        ({"draft": 3}, "must be a string"), ({"draft_tokens": 17}, "0..16"),
                        ({"draft_tokens": True}, "0..16"), ("ngram", "must be an object")]:
        with pytest.raises(ProviderError) as exc:
            _speculative({"speculative": bad})
        assert exc.value.status == 400 and exc.value.param == "speculative" and needle in exc.value.message

    class Refused(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.INVALID_ARGUMENT

        def details(self):
            return "speculative.draft ngram: speculative decoding is not built for --afd"

    err = _grpc_error(Refused(), None, param="messages")
    assert err.status == 400 and err.param == "speculative" and "--afd" in err.message


def test_the_cli_checks_draft_options_before_any_rank_starts(real_model_path, monkeypatch):
    from harness import assert_one_line_error, cli

    from mlxcluster.runtime.launcher import LocalCluster

    started = []
    monkeypatch.setattr(LocalCluster, "start", lambda self, *a, **k: started.append(self) or self)

    for args, needles in [(["--draft", "model:"], ["model:PATH"]), (["--draft", "layers:0"], ["layers:N"]),
                          (["--draft", "eagle"], ["unknown drafter"]),
                          (["--draft", "ngram", "--draft-tokens", "0"], ["--draft-tokens must be in 1..16"]),
                          (["--draft-tokens", "3"], ["needs --draft"])]:
        assert_one_line_error(cli("generate", "hi", "--model", real_model_path, *args), *needles)
    assert_one_line_error(cli("serve", "--draft", "layers:x", "--model", real_model_path), "layers:N")
    assert started == []


# --------------------------------------------------------------------------- the real model, in process
REPEAT = "the cat sat on the mat. the cat sat on the mat. the cat"
PLAIN = "Hi"
#: the constrained request's answer would copy its prompt: only the grammar rule keeps it from drafting
JSON_REPEAT = '{"name": "Bob"}\n{"name": "Bob"}\n'


@pytest.fixture(scope="module")
def source(real_model_path):
    from mlxcluster.model.loader import read_model

    src = read_model(real_model_path)
    return src, build_model(src.config, src.weights, src.quantization, "float32")


def _serve(source, requests: List[pb.GenerateRequest]):
    """Run ``requests`` concurrently on a fresh in-process rank 0 (:class:`GenerationServicer`): per
    request ``(ids, pieces, logprobs, done)``, or the abort's details."""
    from mlxcluster.leader.generation import GenerationServicer
    from test_resume import _Aborted, _Context

    src, m = source
    ex = ThreadPoolExecutor(1)
    sched = Scheduler(m, RankGroup(), src.vocab_size, src.context_length, ex, step_timeout_s=120,
                      tokenizer=src.tokenizer)
    service = GenerationServicer(sched, src, "ring", "float32")

    async def one(request):
        ids, pieces, lps, done, ctx = [], [], [], None, _Context()
        stream = service.Generate(request, ctx)
        try:
            async for event in stream:
                kind = event.WhichOneof("event")
                if kind == "token":
                    ids.append(event.token.token_id)
                    pieces.append(event.token.text)
                    lps.append(round(event.token.logprob, 3))
                elif kind == "done":
                    done = event.done
                    pieces.append(done.text_tail)
        except _Aborted:
            return ctx.details
        finally:
            await stream.aclose()
        return ids, pieces, lps, done

    async def main():
        try:
            return await asyncio.gather(*[one(r) for r in requests])
        finally:
            await sched.close()

    try:
        return asyncio.run(main())
    finally:
        ex.shutdown(wait=True)


def _request(source, prompt, max_tokens, draft=None, **sampling):
    src, _ = source
    r = pb.GenerateRequest(prompt_ids=src.tokenizer.encode(prompt, add_special_tokens=False),
                           max_tokens=max_tokens, sampling=pb.Sampling(**sampling))
    if draft is not None:
        r.speculative.draft, r.speculative.draft_tokens = draft, 4
    return r


@pytest.mark.slow  # the real model in process: ~10 s of the fast tier's 90
def test_three_concurrent_requests_one_constrained_one_without_repeats_equal_plain(source, monkeypatch):
    """Text, logprobs and counts through the servicer equal the plain answers'; the constrained
    request never drafts (one token per step), the copying one takes several tokens per step.  (The
    measured verify cost is left out: on a loaded CPU it turns the drafting down, which is not what
    this checks.)"""
    monkeypatch.setattr(Scheduler, "_measure_verify", lambda self, *a: None)
    from mlxcluster.engine.constraint import json_grammar

    grammar = json_grammar({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})
    asks = [(REPEAT, 10, dict(logprobs=True)), (JSON_REPEAT, 6, dict(grammar=grammar)),
            (PLAIN, 6, {})]
    # all six in one batch: the drafting three verify in the same forward as the plain three take one token
    answers = _serve(source, [_request(source, p, n, d, **kw) for d in ("ngram", None) for p, n, kw in asks])
    spec, plain = answers[:3], answers[3:]
    for (ids, pieces, lps, done), (pids, ppieces, plps, pdone) in zip(spec, plain):
        assert ids == pids and "".join(pieces) == "".join(ppieces)
        assert lps == plps  # each token's logprob, through a verify step or not
        assert done.generated_tokens == pdone.generated_tokens == len(ids)
    copying, constrained, _ = [s[3] for s in spec]
    assert copying.spec_drafted_tokens >= copying.spec_accepted_tokens > 0  # (rejections: the tiny model's tests)
    assert copying.decode_steps < len(spec[0][0]) - 1  # several tokens per step
    assert constrained.spec_drafted_tokens == 0 and constrained.decode_steps == len(spec[1][0]) - 1

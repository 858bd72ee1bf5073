"""Speculative decoding in a decode batch (issue 30): the draft length decided for the whole batch
(:func:`~mlxcluster.engine.speculative.batch_draft_length`) and the scheduler's use of it, as plain
functions -- a verify step pads every row to the longest draft and every sequence waits for it, so at a
batch size where verifying costs more than it yields nothing drafts but a probe step now and then."""

from types import SimpleNamespace

import pytest

from mlxcluster.engine.speculative import AdaptiveK, batch_draft_length, expected_tokens
from mlxcluster.leader import scheduler as sc
from mlxcluster.leader import speculation as sp


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 0.75, 0.95])
@pytest.mark.parametrize("cost", [0.0, 0.05, 0.3, 1.2])
def test_a_batch_of_one_decides_as_the_sequence_alone(alpha, cost):
    k = AdaptiveK(6, cost)
    k._acc, k._rej = alpha * 10, (1 - alpha) * 10
    assert batch_draft_length(1, [(k.alpha, 6, 0.0)], cost) == k.best_k()


def test_the_batch_turns_drafting_down_where_the_verify_cost_grows_with_it():
    """The measured cost per verified position at 32 sequences of a compute-bound CPU step (a (32, 5)
    verify pass ~5.8 plain steps: ~1.2 per position) buys nothing at a copying acceptance rate of 0.73,
    where one sequence (cost ~0.1) drafts the bound; a cheap verify step keeps the batch drafting."""
    copying = [(0.73, 4, 0.0)] * 32
    assert batch_draft_length(1, copying[:1], 0.1) == 4
    assert batch_draft_length(32, copying, 1.2) == 0
    m = batch_draft_length(32, copying, 0.1)
    assert m >= 2
    assert (32 * expected_tokens(0.73, m)) / (1 + 0.1 * m) > 32  # it pays


def test_one_drafter_pays_the_whole_batchs_wait():
    """Alone, a sequence drafts at acceptance 0.6 and cost 0.25 per position; in a batch of 16 where it
    is the only one drafting, its extra tokens do not pay for 16 sequences waiting on the verify step
    (E - 1 > B * cost * m fails); where all 16 draft, they do."""
    assert batch_draft_length(1, [(0.6, 4, 0.0)], 0.25) > 0
    assert batch_draft_length(16, [(0.6, 4, 0.0)], 0.25) == 0
    assert batch_draft_length(16, [(0.6, 4, 0.0)] * 16, 0.25) > 0


def test_draft_time_counts_and_nothing_to_draft_is_no_draft():
    assert batch_draft_length(4, [], 0.0) == 0
    assert batch_draft_length(4, [(0.8, 4, 0.0)] * 4, 0.05) == 4
    assert batch_draft_length(4, [(0.8, 4, 2.0)] * 4, 0.05) == 0  # a draft model slower than the gain
    assert batch_draft_length(4, [(0.8, 2, 0.0), (0.8, 4, 0.0)], 0.0) == 4  # the longest bound's rows


def test_a_drafter_that_finds_nothing_gains_nothing_but_costs_only_with_the_others():
    """An n-gram drafter that proposes in 1 ask of 10 (open chat): alone, its proposals still pay (a
    step without one is a plain step); among 8 such sequences someone proposes at most steps and the
    verify step costs them all; its proposal rate is counted per ask."""
    k = AdaptiveK(4)
    for _ in range(30):
        k.proposed(False)
    assert k.proposal_rate < 0.1
    assert batch_draft_length(1, [(0.9, 4, 0.0, 0.1)], 0.3) == batch_draft_length(1, [(0.9, 4, 0.0)], 0.3) > 0
    assert batch_draft_length(8, [(0.9, 4, 0.0, 0.1)] * 8, 0.3) == 0
    assert batch_draft_length(8, [(0.9, 4, 0.0, 1.0)] * 8, 0.3) > 0


def _req(uid, alpha=0.5, max_k=4):
    adaptive = AdaptiveK(max_k)
    adaptive._acc, adaptive._rej = alpha * 10, (1 - alpha) * 10
    return SimpleNamespace(uid=uid, adaptive=adaptive, cancelled=False, reason=None)


def _sched(requests, costs, plain_at=(1, 32)):
    s = SimpleNamespace(_running=requests, spec_costs=costs, _spec_idle=0, _spec_run=0, step_times=sc.StepTimes(),
                        _probe_every=sp.SPEC_PROBE_EVERY, _probed=False, _spec_samples={}, spec_cost=sp.SPEC_COST_PRIOR,
                        _plain_due=0, lookahead=False)
    for b in plain_at:
        s.step_times.record(b, 0.01 * b)
    for name in ("spec_cost_at", "_plain_measured", "_cost_measured", "_draft_lengths", "_measure_verify"):
        setattr(s, name, getattr(sc.Scheduler, name).__get__(s))
    return s


def test_the_scheduler_drafts_by_the_cost_at_this_batch_size_and_probes_all_at_once():
    """At 32 sequences with a measured cost of 1.2 per position nobody drafts, except probe plans in
    which every drafting sequence drafts 1 token (one verify step for all): the first after
    SPEC_PROBE_EVERY plans, then -- each probe leaving the batch undrafting -- after twice as many, up to
    SPEC_PROBE_EVERY * SPEC_PROBE_BACKOFF; a plain request in the batch counts as a sequence that
    waits; at batch 2 the batch-2 cost applies."""
    batch = [_req(f"r{i}", alpha=0.73) for i in range(31)] + [SimpleNamespace(uid="plain", adaptive=None,
                                                                              cancelled=False, reason=None)]
    s = _sched(batch, {1: 0.05, 32: 1.2})
    plans = [s._draft_lengths() for _ in range(400)]
    probes = [i for i, p in enumerate(plans) if p]
    assert all(plans[i] == {f"r{i}": 1 for i in range(31)} for i in probes)
    gaps = [b - a for a, b in zip([-1] + probes, probes)]
    top = sp.SPEC_PROBE_EVERY * sp.SPEC_PROBE_BACKOFF
    assert gaps[:5] == [sp.SPEC_PROBE_EVERY, 2 * sp.SPEC_PROBE_EVERY, 4 * sp.SPEC_PROBE_EVERY,
                        8 * sp.SPEC_PROBE_EVERY, top] and set(gaps[4:]) == {top}
    two = _sched(batch[:2], {1: 0.05, 32: 1.2})
    assert sc.Scheduler._draft_lengths(two) == {"r0": 4, "r1": 4}  # nearest measured size: 1
    assert sc.Scheduler.spec_cost_at(two, 20) == 1.2 and sc.Scheduler.spec_cost_at(_sched([], {}), 8) == \
        sp.SPEC_COST_PRIOR


def test_verify_steps_are_measured_against_a_plain_step_of_this_batch_size():
    """A drafting batch takes a plain step every SPEC_PLAIN_EVERY plans, and whenever no plain step was
    measured near its size (a plain step measured once at batch 1, extrapolated to 32, made a (32, 5)
    verify step look cheaper than a plain one: drafting never turned down); without such a plain step
    no verify sample counts."""
    batch = [_req(f"r{i}", alpha=0.9) for i in range(32)]
    s = _sched(batch, {32: 0.05})
    plans = [sc.Scheduler._draft_lengths(s) for _ in range(2 * sp.SPEC_PLAIN_EVERY)]
    assert [i for i, p in enumerate(plans) if not p] == [sp.SPEC_PLAIN_EVERY - 1, 2 * sp.SPEC_PLAIN_EVERY - 1]
    assert all(p == {f"r{i}": 4 for i in range(32)} for p in plans if p)
    s = _sched(batch, {32: 0.05})
    s.lookahead = True  # the first plain step after a verify step restarts lookahead: two of them
    plans = [sc.Scheduler._draft_lengths(s) for _ in range(2 * sp.SPEC_PLAIN_EVERY)]
    assert [i for i, p in enumerate(plans) if not p] == [sp.SPEC_PLAIN_EVERY - 1, sp.SPEC_PLAIN_EVERY]
    unmeasured = _sched(batch, {32: 0.05}, plain_at=(1,))
    assert [sc.Scheduler._draft_lengths(unmeasured) for _ in range(3)] == [{}, {}, {}]
    unmeasured.step_times.record(20, 0.2)  # a plain step of 20 sequences: near enough to 32
    assert sc.Scheduler._draft_lengths(unmeasured) == {f"r{i}": 4 for i in range(32)}
    # no plain step measured at all: one first; no verify cost measured near 32 (the prior, or batch
    # 1's): a probe of 1 token measures it before longer drafts
    assert sc.Scheduler._draft_lengths(_sched(batch, {}, plain_at=())) == {}
    assert sc.Scheduler._draft_lengths(_sched(batch, {1: 0.05})) == {f"r{i}": 1 for i in range(32)}


def test_a_lone_sequence_keeps_probing_every_few_plans():
    """One sequence's probe costs no one else a wait: its interval stays SPEC_PROBE_EVERY."""
    s = _sched([_req("r0", alpha=0.1)], {1: 1.2})
    plans = [s._draft_lengths() for _ in range(5 * sp.SPEC_PROBE_EVERY)]
    assert [i for i, p in enumerate(plans) if p] == [sp.SPEC_PROBE_EVERY * j - 1 for j in range(1, 6)]


def test_a_probe_that_finds_drafting_pays_resets_the_interval():
    """After backing off, a probe whose measurements make drafting pay (the acceptance rate rose)
    drafts and brings the interval back to SPEC_PROBE_EVERY."""
    batch = [_req(f"r{i}", alpha=0.2) for i in range(16)]
    s = _sched(batch, {16: 0.3}, plain_at=(16,))
    plans = [s._draft_lengths() for _ in range(3 * sp.SPEC_PROBE_EVERY + 1)]
    assert s._probe_every == 4 * sp.SPEC_PROBE_EVERY and sum(bool(p) for p in plans) == 2
    for r in batch:
        r.adaptive._acc, r.adaptive._rej = 9.5, 0.5
    assert s._draft_lengths()  # the verify step measured high acceptance: it drafts at once
    assert s._probe_every == sp.SPEC_PROBE_EVERY


def test_the_cost_at_a_batch_size_is_the_median_of_its_latest_samples():
    """One verify step slowed by the host (a sample of 4 per position among ~0.75) moves the cost at
    32 sequences nothing; the moving average of every size (AdaptiveK's cost) still follows it."""
    batch = [_req(f"r{i}", alpha=0.7) for i in range(32)]
    s = _sched(batch, {}, plain_at=(32,))
    plain = s.step_times.predict(32)
    for seconds in (1.75, 1.7, 5.0, 1.8, 1.75):
        s._measure_verify(32, 2, seconds * plain)
    assert s.spec_costs[32] == pytest.approx(0.75) and s.spec_cost > 0.75
    assert s._draft_lengths() == {}  # at 0.75 per position 32 sequences at 0.7 gain nothing
    for _ in range(sp.SPEC_COST_SAMPLES):
        s._measure_verify(32, 2, 1.1 * plain)  # a cheap verify step (a memory-bound GPU): only the latest count
    assert s.spec_costs[32] == pytest.approx(0.1) and s._draft_lengths() == {f"r{i}": 4 for i in range(32)}


def test_the_cost_at_a_batch_size_is_its_dearest_draft_lengths():
    """Per draft length its own median; the batch's cost per position is the largest: a compute-bound
    (32, 2) verify step at 0.5 per position and a (32, 4) one at 0.85 -- a linear model fitted to the
    cheap one would draft 1 token at a loss there (32 + 32 * 0.8 * 0.9 tokens in 1.85 plain steps)."""
    batch = [_req(f"r{i}", alpha=0.8) for i in range(32)]
    s = _sched(batch, {}, plain_at=(32,))
    plain = s.step_times.predict(32)
    for _ in range(3):
        s._measure_verify(32, 2, 1.5 * plain)
    assert s.spec_costs[32] == pytest.approx(0.5) and s._draft_lengths()  # 1 token: 57.6 tokens in 1.5
    for _ in range(3):
        s._measure_verify(32, 4, (1 + 3 * 0.85) * plain)
    for _ in range(sp.SPEC_COST_SAMPLES):  # the cheap length measured again, more often: still the dearest
        s._measure_verify(32, 2, 1.5 * plain)
    assert s.spec_costs[32] == pytest.approx(0.85)
    s._spec_idle = 0
    assert s._draft_lengths() == {}


def test_the_step_that_restarts_lookahead_after_a_verify_step_is_not_a_plain_steps_time():
    """After a verify step the next plain step computes its own tokens and queues the next step before
    it returns (lookahead restarts): ~2 plain steps of time for one step's tokens, the other delivered
    later.  Recorded, it raised the plain-step time that verify steps are measured against (at 32
    sequences from 0.18 to 0.33 s, and the cost per verified position fell from 0.75 to ~0.3);
    it is not recorded, the steps after it are."""
    import asyncio

    engine = SimpleNamespace(step=lambda tokens, lookahead, exact=False, defer=False: [7], queued=True, read_first=False)
    s = SimpleNamespace(engine=engine, step_times=sc.StepTimes(), _after_verify=True, _interrupted=False,
                        _last_step_end=1.0, _ahead=None, _owed=None, _admission=None, batch_limit=8, _waiting=[], delivered=[])
    s._deliver = lambda req, token: s.delivered.append(token)

    async def mlx(fn, *args):
        return fn(*args)

    s._mlx = mlx
    asyncio.run(sc.Scheduler._decode_step(s, [object()], lookahead=True))
    assert not s.step_times.decode.samples and s.delivered == [7] and not s._after_verify
    asyncio.run(sc.Scheduler._decode_step(s, [object()], lookahead=True))
    assert len(s.step_times.decode.samples) == 1


def test_with_lookahead_only_a_verify_step_after_a_verify_step_is_timed():
    """The first verify step after plain steps follows a settle that delivered the queued step's
    tokens while it waited (their host work overlapped); the verify steps of a run each pay the last
    one's delivery inside them (at 32 sequences on this CPU 0.24 s for the first, 0.41 s for the
    next ones).  With lookahead only the latter are measured; without lookahead (a group of several
    ranks, no settle) every one is."""
    import asyncio

    def sched(lookahead, after_verify):
        timed = []
        engine = SimpleNamespace(verify=lambda drafts: [SimpleNamespace(tokens=[1], drafted=0, accepted=0)
                                                        for _ in drafts])
        s = SimpleNamespace(engine=engine, lookahead=lookahead, _after_verify=after_verify, _interrupted=False,
                            _last_step_end=1.0, _admission=None, ranks=SimpleNamespace(links=[]), timed=timed)
        s._measure_verify = lambda batch, positions, seconds: timed.append((batch, positions))
        s._deliver_verified = lambda req, v: None

        async def mlx(fn, *args):
            return fn(*args)

        s._mlx = mlx
        asyncio.run(sc.Scheduler._verify_step(s, [SimpleNamespace(uid="a"), SimpleNamespace(uid="b")], {"a": [5, 6]}))
        assert s._after_verify
        return timed

    assert sched(True, False) == [] and sched(True, True) == [(2, 3)]
    assert sched(False, False) == [(2, 3)]

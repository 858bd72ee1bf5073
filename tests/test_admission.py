"""Rank 0's admission rule (``Scheduler._may_admit``) as a plain function: the batch cap, the KV
memory budget, the prefill budget between two decode steps and the inter-token latency target
(``StepTimes``)."""

from types import SimpleNamespace

from mlxcluster.leader import scheduler as sch
from mlxcluster.leader.scheduler import Scheduler, StepTimes


def _req(prompt=40, max_tokens=32):
    return SimpleNamespace(prompt=[1] * prompt, max_tokens=max_tokens, uid=f"r{id(object())}")


def _state(running=0, max_batch=64, budget=0, per_position=0.0, context=8192, limit=None, itl=0.0, times=None,
           chunking=(), chunked_prefill=True):
    s = SimpleNamespace(_running=[_req() for _ in range(running)], max_batch=max_batch, kv_budget_bytes=budget,
                        kv_bytes_per_position=per_position, context_length=context,
                        batch_limit=max_batch if limit is None else limit, itl_target_s=itl,
                        step_times=times or StepTimes(), _chunking=list(chunking), chunked_prefill=chunked_prefill,
                        engine=SimpleNamespace(get=lambda uid: None))
    s._positions = lambda r: Scheduler._positions(s, r)
    s._long = lambda r: Scheduler._long(s, r)
    s._step_tokens = lambda r: Scheduler._step_tokens(s, r)
    return s


def may(state, req, group=()):
    return Scheduler._may_admit(state, req, list(group))


def test_the_cap_bounds_the_batch():
    assert may(_state(running=63), _req())
    assert not may(_state(running=64), _req())
    assert not may(_state(running=1, max_batch=1), _req())
    # the prompts already taken into this step's prefill group count
    assert not may(_state(running=60, max_batch=64), _req(prompt=2), [_req(prompt=2)] * 4)
    assert may(_state(running=60, max_batch=64), _req(prompt=2), [_req(prompt=2)] * 3)


def test_the_kv_budget_bounds_the_batch_by_the_positions_it_may_grow_to():
    per = 46080.0  # SmolLM2 float32: 30 layers x 2 x 3 KV heads x 64 x 4 bytes
    budget = int(per * 72 * 10)  # ten 40-token prompts with 32 tokens to go
    assert may(_state(running=9, budget=budget, per_position=per), _req())
    assert not may(_state(running=10, budget=budget, per_position=per), _req())
    # max_tokens past the context counts only up to it
    assert may(_state(running=0, budget=budget, per_position=per), _req(max_tokens=10 ** 6))
    assert not may(_state(running=1, budget=int(per * 8192), per_position=per, context=8192),
                   _req(max_tokens=10 ** 6))
    # an empty batch always takes one (nothing else could ever run), and no measurement yet: no bound
    assert may(_state(running=0, budget=1, per_position=per), _req())
    assert may(_state(running=10, budget=1, per_position=0.0), _req())
    # ... and the group being prefilled counts against the budget like the running batch
    assert not may(_state(running=5, budget=budget, per_position=per), _req(), [_req()] * 5)
    assert may(_state(running=5, budget=budget, per_position=per), _req(), [_req()] * 4)


def test_a_request_whose_kv_cache_can_never_fit_is_refused_in_one_line():
    per = 46080.0
    state = _state(budget=int(per * 1000), per_position=per, context=8192)
    assert Scheduler.kv_refusal(state, 600, 400) == ""  # 1000 positions: exactly the budget
    why = Scheduler.kv_refusal(state, 600, 401)
    assert "at most 1000 positions" in why and "max_tokens 401" in why and "\n" not in why
    # max_tokens past the context counts only up to it; no measurement or no budget: no refusal
    assert Scheduler.kv_refusal(_state(budget=int(per * 8192), per_position=per), 100, 10 ** 6) == ""
    assert Scheduler.kv_refusal(_state(budget=1, per_position=0.0), 600, 401) == ""
    assert Scheduler.kv_refusal(_state(budget=0, per_position=per), 600, 401) == ""


def test_prefill_between_two_decode_steps_is_bounded_but_takes_at_least_one_prompt():
    big = _req(prompt=sch.PREFILL_TOKENS_PER_STEP + 100)
    assert may(_state(running=3), big)
    assert may(_state(running=3, chunked_prefill=False), big)  # whole (--local-decode, --prefill-peer)
    # prompts of one chunk or less are prefilled whole: their tokens fill the step's budget
    chunk = sch.passes.PREFILL_CHUNK_TOKENS
    taken = [_req(prompt=chunk)] * (sch.PREFILL_TOKENS_PER_STEP // chunk - 1) + [_req(prompt=chunk - 25), _req(prompt=20)]
    assert not may(_state(running=3), _req(prompt=10), taken)
    assert may(_state(running=3), _req(prompt=5), taken)
    taken = [_req(prompt=sch.PREFILL_TOKENS_PER_STEP - 25), _req(prompt=20)]
    assert not may(_state(running=3, chunked_prefill=False), _req(prompt=10), taken)
    assert may(_state(running=3, chunked_prefill=False), _req(prompt=5), taken)


def test_step_times_predict_a_line_and_limit_the_batch_to_the_target():
    t = StepTimes()
    assert t.predict(4) is None
    assert t.limit(0.0, 64) == 64  # no target: the cap
    assert t.limit(0.2, 64) == 1   # a target but nothing measured yet: one sequence
    t.record(1, 0.065)
    assert t.predict(3) == 0.195  # one size measured: proportional ...
    assert t.limit(0.2, 64) == 2  # ... 3 fit, but the line is trusted to twice the largest size measured
    t.record(3, 0.075)
    a, b = t.decode.line()
    assert abs(a - 0.060) < 1e-9 and abs(b - 0.005) < 1e-9
    assert t.limit(0.2, 64) == 6  # (0.2 - 0.06) / 0.005 = 28 fit; trusted to 2 x 3
    t.record(20, 0.160)
    assert t.limit(0.2, 64) == 28 and t.limit(0.2, 16) == 16  # measured far enough now; the cap still bounds
    assert t.limit(0.05, 64) == 1  # even one sequence is slower than the target: it still runs
    flat = StepTimes()
    flat.record(2, 0.10)  # noise making the line fall: slope clamped at 0 ...
    flat.record(5, 0.05)
    assert flat.decode.line()[1] == 0.0
    assert flat.limit(0.2, 64) == 10  # ... and no further than twice the largest size measured
    flat.record(0, 1.0)   # nonsense is ignored
    flat.record(4, -1.0)
    assert len(flat.decode.samples) == 2


def test_step_times_follow_the_recent_steps_only():
    t = StepTimes(window=4)
    for _ in range(4):
        t.record(8, 0.8)   # short contexts long ago ...
    for _ in range(4):
        t.record(8, 0.4)   # ... the window holds the last steps only
    assert abs(t.predict(8) - 0.4) < 1e-9


def test_the_itl_target_bounds_the_batch():
    assert may(_state(running=2, limit=3), _req())
    assert not may(_state(running=3, limit=3), _req())
    assert not may(_state(running=1, limit=3), _req(), [_req()] * 2)
    assert may(_state(running=0, limit=1), _req())  # a lone sequence always runs
    assert not may(_state(running=5, max_batch=4, limit=30), _req())  # the cap bounds a generous limit


def test_the_itl_target_bounds_the_prefill_between_two_decode_steps():
    t = StepTimes()
    assert t.prefill_tokens(0.2, 4, 2048) == 2048  # nothing measured yet: the fixed budget
    t.record(4, 0.100)   # a step of 4 sequences: 100 ms ...
    t.record(6, 0.120)   # ... 6: 120 ms  (60 ms + 10 ms per sequence)
    t.record_prefill(100, 0.050)
    t.record_prefill(300, 0.130)  # 10 ms + 0.4 ms per token
    # a 300 ms target beside a step of 8 (140 ms): (0.3 - 0.14 - 0.01) / 0.0004 = 375 tokens
    assert t.prefill_tokens(0.3, 8, 2048) == 375
    assert t.prefill_tokens(0.3, 8, 200) == 200   # the fixed budget still bounds it
    assert t.prefill_tokens(0.0, 8, 2048) == 2048  # no target
    assert t.prefill_tokens(0.3, 0, 2048) == 2048  # nobody running: nobody waits
    assert t.prefill_tokens(0.1, 8, 2048) == 0    # the step alone takes the target
    # in the admission rule: the group grows up to the budget; with running streams to protect, even
    # its first prompt must fit (a request waits), with none running one always goes
    busy = lambda: _state(running=6, itl=0.3, times=t)  # the next step: 6 running + the 2 of the group
    assert may(busy(), _req(prompt=175), [_req(prompt=200)])
    assert not may(busy(), _req(prompt=200), [_req(prompt=200)])
    assert may(_state(running=6, itl=0.3, times=t), _req(prompt=400))  # beside a step of 7: 400 tokens
    assert not may(_state(running=6, itl=0.3, times=t), _req(prompt=401))
    assert not may(_state(running=7, itl=0.1, times=t), _req(prompt=5))
    assert may(_state(running=0, itl=0.1, times=t), _req(prompt=5000))
    # no target: the fixed budget, and always one prompt
    assert may(_state(running=7, times=t), _req(prompt=200), [_req(prompt=200)])
    assert may(_state(running=7, times=t), _req(prompt=5000))


def test_a_long_prompt_counts_one_chunk_of_the_step_and_a_place_in_the_batch():
    """A prompt longer than one chunk is prefilled a chunk per step: it counts PREFILL_CHUNK_TOKENS
    against the step's prefill budget (not its whole length), and while it prefills it holds a
    place in the batch and in the KV budget like a running sequence."""
    chunk = sch.passes.PREFILL_CHUNK_TOKENS
    long = _req(prompt=6000)
    step = sch.PREFILL_TOKENS_PER_STEP
    # a 2048-token prompt and then a 6000-token one fit one step: the long one takes one chunk of it
    assert may(_state(running=1), long, [_req(prompt=step - chunk)])
    assert not may(_state(running=1, chunked_prefill=False), long, [_req(prompt=step - chunk)])
    # a chunked prefill in progress takes its next chunk of every step's budget
    shorts = [_req(prompt=chunk)] * ((step - chunk) // chunk - 1) + [_req(prompt=chunk - 100)]
    left = step - chunk - sum(len(r.prompt) for r in shorts)  # the budget left for one more short prompt
    assert 0 < left < chunk
    assert not may(_state(running=1, chunking=[long]), _req(prompt=left + 1), shorts)
    assert may(_state(running=1, chunking=[long]), _req(prompt=left), shorts)
    # ... a place in the batch
    assert not may(_state(running=62, max_batch=64, chunking=[long, _req(prompt=6000)]), _req(prompt=2))
    # ... and the positions it may grow to in the KV budget
    per = 46080.0
    budget = int(per * (6000 + 32 + 72))
    assert may(_state(running=0, budget=budget, per_position=per, chunking=[long]), _req())
    assert not may(_state(running=0, budget=budget - 1, per_position=per, chunking=[long]), _req())

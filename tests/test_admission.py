"""Rank 0's admission rule (``Scheduler._may_admit``) as a plain function: the batch cap, the KV
memory budget and the prefill budget between two decode steps."""

from types import SimpleNamespace

from mlxcluster.serving import scheduler as sch
from mlxcluster.serving.scheduler import Scheduler


def _req(prompt=40, max_tokens=32):
    return SimpleNamespace(prompt=[1] * prompt, max_tokens=max_tokens)


def _state(running=0, max_batch=64, budget=0, per_position=0.0, context=8192):
    s = SimpleNamespace(_running=[_req() for _ in range(running)], max_batch=max_batch, kv_budget_bytes=budget,
                        kv_bytes_per_position=per_position, context_length=context)
    s._positions = lambda r: Scheduler._positions(s, r)
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


def test_prefill_between_two_decode_steps_is_bounded_but_takes_at_least_one_prompt():
    big = _req(prompt=sch.PREFILL_TOKENS_PER_STEP + 100)
    assert may(_state(running=3), big)
    taken = [_req(prompt=sch.PREFILL_TOKENS_PER_STEP - 25), _req(prompt=20)]
    assert not may(_state(running=3), _req(prompt=10), taken)
    assert may(_state(running=3), _req(prompt=5), taken)

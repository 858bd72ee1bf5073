"""The eviction planner and Ollama's keep_alive durations (front/residency.py): plain functions, no I/O."""

from __future__ import annotations

import pytest

from mlxcluster.front.residency import (NEVER, Load, Refuse, Resident, Wait, expired, next_expiry, parse_keep_alive,
                                        plan_load)

GB = 10**9


def r(name, size=GB, used=0.0, busy=0, pinned=False, expires=None):
    return Resident(name, size, used, busy, pinned, expires)


def test_room_to_spare_loads_without_evicting():
    assert plan_load([r("a")], "b", GB, 4 * GB) == Load(())
    assert plan_load([r("a")], "b", GB, None, None) == Load(())


def test_memory_evicts_the_least_recently_used_idle_unpinned_model_only():
    loaded = [r("a", used=5), r("b", used=1), r("c", used=3)]
    assert plan_load(loaded, "d", GB, 3 * GB) == Load(("b",))           # one is enough: the oldest
    assert plan_load(loaded, "d", 2 * GB, 3 * GB) == Load(("b", "c"))   # two needed: the two oldest


def test_count_bound_evicts_like_memory():
    loaded = [r("a", used=2), r("b", used=1)]
    assert plan_load(loaded, "c", GB, None, max_loaded=2) == Load(("b",))
    assert plan_load(loaded, "c", GB, None, max_loaded=1) == Load(("b", "a"))
    assert plan_load(loaded, "c", GB, None, max_loaded=3) == Load(())


def test_pinned_and_busy_models_are_passed_over():
    loaded = [r("old", used=0, pinned=True), r("busy", used=1, busy=2), r("idle", used=9)]
    assert plan_load(loaded, "new", GB, 3 * GB) == Load(("idle",))


def test_only_busy_models_can_make_room_waits_and_evicts_nothing():
    loaded = [r("busy", size=3 * GB // 2, used=1, busy=1), r("idle", used=0, size=GB // 4)]
    decision = plan_load(loaded, "new", GB, 2 * GB)
    assert isinstance(decision, Wait) and decision.busy == ("busy",)
    assert "'busy'" in decision.why and "short of the memory budget" in decision.why
    decision = plan_load([r("busy", busy=1)], "new", GB, None, max_loaded=1)
    assert isinstance(decision, Wait) and "--max-loaded-models 1 reached" in decision.why


def test_a_loading_model_counts_as_busy():
    # the pool passes a model still loading with in_flight >= 1: never evicted mid-load
    decision = plan_load([r("loading", busy=1)], "new", GB, GB)
    assert isinstance(decision, Wait)


def test_a_model_larger_than_the_budget_is_refused_naming_the_memory():
    decision = plan_load([], "huge", 5 * GB, 4 * GB)
    assert isinstance(decision, Refuse)
    assert "'huge' needs 4.7 GiB" in decision.why and "memory budget is 3.7 GiB" in decision.why


def test_pinned_models_can_leave_no_room():
    decision = plan_load([r("p", size=3 * GB, pinned=True), r("x")], "new", 2 * GB, 4 * GB)
    assert isinstance(decision, Refuse) and "pinned models (p)" in decision.why
    decision = plan_load([r("p", pinned=True)], "new", GB, None, max_loaded=1)
    assert isinstance(decision, Refuse) and "--max-loaded-models 1" in decision.why


def test_max_loaded_below_one_is_a_bug():
    with pytest.raises(ValueError):
        plan_load([], "a", 1, None, max_loaded=0)


def test_expired_models_are_idle_unpinned_and_due():
    loaded = [r("due", expires=10), r("later", expires=20), r("busy", busy=1, expires=5),
              r("pinned", pinned=True, expires=1), r("never", expires=None), r("first", expires=9)]
    assert expired(loaded, 10) == ["first", "due"]
    assert expired(loaded, 8) == []
    assert next_expiry(loaded) == 9
    assert next_expiry([r("never")]) is None


@pytest.mark.parametrize("value, seconds", [
    ("5m", 300.0), ("1h", 3600.0), ("300ms", 0.3), ("1h30m", 5400.0), ("1.5s", 1.5), ("90", 90.0), (90, 90.0),
    (2.5, 2.5), (0, 0.0), ("0", 0.0), ("0s", 0.0), (-1, NEVER), ("-1", NEVER), ("-1m", NEVER), (-0.5, NEVER),
    ("10us", 1e-5)])
def test_keep_alive_durations_as_ollama_reads_them(value, seconds):
    assert parse_keep_alive(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["", "5 minutes", "m5", "5x", True, None, "1h 30m", float("nan"), [5]])
def test_bad_keep_alive_is_one_line_naming_the_field(value):
    with pytest.raises(ValueError) as err:
        parse_keep_alive(value, "--keep-alive")
    assert str(err.value).startswith("--keep-alive ") and "\n" not in str(err.value)

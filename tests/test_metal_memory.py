"""Metal memory with a fake device report (issue 43): the wired limit set and restored through the
injected ``mx`` hook, the KV budget bounded, a request that cannot fit refused at admission, a shard
over the working set refused before any weight is read, the periodic ``clear_cache``, the standby's
estimate of quantized weights on Metal."""

import json
import os
from types import SimpleNamespace

import pytest

from mlxcluster.config import config
from mlxcluster.engine import memory as mem
from mlxcluster.engine.memory import GiB
from mlxcluster.leader.scheduler import Scheduler, StepTimes, default_kv_budget_bytes
from mlxcluster.model import loader
from mlxcluster.runtime import rank as rank_mod


class FakeDevice(mem.Device):
    """A device report and the memory calls made on it (no MLX)."""

    def __init__(self, working_set=24 * GiB, active=0, wired=0, cache=0):
        self.info = {"max_recommended_working_set_size": working_set, "memory_size": 32 * GiB} if working_set else {}
        self.active, self.wired, self.cache, self.calls = active, wired, cache, []

    def device_info(self):
        return dict(self.info)

    def set_wired_limit(self, limit):
        self.calls.append(("wired", limit))
        previous, self.wired = self.wired, limit
        return previous

    def set_cache_limit(self, limit):
        self.calls.append(("cache_limit", limit))
        return 0

    def clear_cache(self):
        self.calls.append(("clear",))
        self.cache = 0

    def synchronize(self):
        self.calls.append(("sync",))

    @property
    def active_memory(self):
        return self.active

    @property
    def cache_memory(self):
        return self.cache


# -- the wired limit ---------------------------------------------------------------------------------

def test_the_shard_is_wired_up_to_the_working_set_and_the_previous_limit_restored():
    dev = FakeDevice(wired=123)
    with mem.wired(20 * GiB, dev) as w:
        assert dev.wired == 24 * GiB == w.limit  # min(24 GiB, 20 GiB + 4 GiB)
    assert dev.wired == 123 and dev.calls[-2:] == [("sync",), ("wired", 123)]  # synchronised, then restored
    dev = FakeDevice(wired=0)
    with mem.wired(6 * GiB, dev):
        assert dev.wired == 10 * GiB  # a small shard: its size + the margin (exo PR #1672), not the working set
    assert dev.wired == 0


def test_nothing_is_wired_on_the_cpu_backend():
    dev = FakeDevice(working_set=0, wired=7)
    w = mem.WiredLimit(dev)
    assert w.set(20 * GiB) == 0
    w.restore()
    assert dev.calls == [] and dev.wired == 7


# -- the KV budget -----------------------------------------------------------------------------------

def test_the_kv_budget_is_the_working_set_left_by_the_shard_never_unbounded():
    # a 20 GiB shard resident on a 24 GiB working set: over half of a 32 GiB Mac's RAM, where "half the
    # RAM less the weights" gave 0, "no bound"
    budget = default_kv_budget_bytes(device=FakeDevice(active=20 * GiB))
    assert budget == 24 * GiB - 20 * GiB - mem.ACTIVATION_MARGIN_BYTES
    # nothing left: the floor, not 0
    assert default_kv_budget_bytes(device=FakeDevice(active=24 * GiB)) == mem.KV_FLOOR_BYTES
    # CPU: half the RAM available, the floor when none is
    cpu = FakeDevice(working_set=0, active=20 * GiB)
    assert mem.kv_budget_bytes(cpu, 0.5, available=8 * GiB) == 4 * GiB
    assert mem.kv_budget_bytes(cpu, 0.5, available=0) == mem.KV_FLOOR_BYTES


def _scheduler_state(budget, per_position, context=131072, running=0):
    """The fields ``Scheduler.kv_refusal`` / ``_may_admit`` read (as tests/test_admission.py builds them)."""
    req = SimpleNamespace(prompt=[1] * 40, max_tokens=32, uid="r")
    s = SimpleNamespace(_running=[req] * running, max_batch=64, kv_budget_bytes=budget,
                        kv_bytes_per_position=per_position, context_length=context, batch_limit=64,
                        itl_target_s=0.0, step_times=StepTimes(), _chunking=[], chunked_prefill=True,
                        engine=SimpleNamespace(get=lambda uid: None))
    s._positions = lambda r: Scheduler._positions(s, r)
    s._long = lambda r: Scheduler._long(s, r)
    s._step_tokens = lambda r: Scheduler._step_tokens(s, r)
    return s


def test_a_request_that_cannot_fit_the_working_set_is_refused_at_admission():
    budget = default_kv_budget_bytes(device=FakeDevice(active=20 * GiB))
    # a 70B Llama at TP=2: 80 layers x 2 (K, V) x 4 of its 8 KV heads x 128 x 2 bytes, rank 0's share
    per = 80 * 2 * 4 * 128 * 2.0
    state = _scheduler_state(budget, per)
    fit = int(budget // per)
    assert Scheduler.kv_refusal(state, 1000, 1000) == ""
    why = Scheduler.kv_refusal(state, 16000, fit)  # more positions than the budget holds
    assert f"at most {fit} positions" in why and "\n" not in why
    # and the batch stops growing at the budget
    big = SimpleNamespace(prompt=[1] * 8000, max_tokens=8000, uid="b")  # 16000 positions each
    state = _scheduler_state(budget, per)
    state._running = [big]
    assert not Scheduler._may_admit(state, big, [])
    assert Scheduler._may_admit(state, SimpleNamespace(prompt=[1] * 40, max_tokens=32, uid="s"), [])


# -- a shard that cannot fit ---------------------------------------------------------------------------

def _model_dir(tmp_path, weight_bytes):
    """An mlx-lm directory: tinymodel's config and one sparse ``.safetensors`` file of ``weight_bytes``
    (its apparent size: no disk used, never read)."""
    import tinymodel

    config_dict, _ = tinymodel.tiny_llama(seed=0)
    d = tmp_path / "big-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config_dict))
    with open(d / "model.safetensors", "wb") as f:
        f.truncate(weight_bytes)
    return str(d)


def _args(path, world_size):
    from mlxcluster.runtime.rank_config import RankConfig

    return rank_mod._resolved(RankConfig(world_size=world_size, ports=(1,) * world_size, model=path,
                                         weights="quantized"), config())


def _group(rank, size):
    return SimpleNamespace(rank=lambda: rank, size=lambda: size)


def test_a_shard_over_the_working_set_is_refused_before_any_weight_is_read(tmp_path, monkeypatch):
    reads = []
    monkeypatch.setattr(loader, "_read_safetensors", lambda *a: reads.append(a) or {})
    path = _model_dir(tmp_path, 90 * GiB)  # 30 GiB per rank at TP=3
    dev = FakeDevice()
    with pytest.raises(mem.ShardTooLarge) as err:
        rank_mod._load(_args(path, 3), _group(0, 3), wired=mem.WiredLimit(dev))
    line = str(err.value)
    assert "\n" not in line and "30.0 GiB" in line and "24.0 GiB" in line and "max_recommended_working_set_size" in line
    assert reads == [] and dev.calls == []  # nothing read, nothing wired


def test_a_shard_that_fits_is_wired_before_its_weights_are_read(tmp_path, monkeypatch):
    dev = FakeDevice()
    seen = []

    def read(*a):
        seen.append(dev.wired)
        raise RuntimeError("stop before the model is built")

    monkeypatch.setattr(loader, "_read_safetensors", read)
    path = _model_dir(tmp_path, 60 * GiB)  # 20 GiB per rank at TP=3
    with pytest.raises(RuntimeError, match="stop before"):
        rank_mod._load(_args(path, 3), _group(1, 3), wired=mem.WiredLimit(dev))
    assert seen == [24 * GiB]  # wired (min(24, 20 + 4) GiB) before the read


def test_shard_shares():
    from mlxcluster.model.topology import Topology

    tp = Topology()
    assert mem.shard_share(tp, 30, 1, 4) == 0.25
    pipe = Topology(layers="0:9,10:output")
    assert mem.shard_share(pipe, 30, 0, 2) == pytest.approx(10 / 30)
    assert mem.shard_share(pipe, 30, 1, 2) == pytest.approx(20 / 30)
    assert mem.held_bytes(100, {"bits": 4}, "quantized") == 100
    assert mem.held_bytes(100, {"bits": 4}, "float32") == 800
    assert mem.held_bytes(100, None, "float32") == 200


# -- the cache, the standby -----------------------------------------------------------------------------

def test_the_cache_is_cleared_periodically_and_when_it_grows():
    dev = FakeDevice()
    upkeep = mem.CacheUpkeep(dev, every=256, limit=1 * GiB, check_every=16)
    cleared = [upkeep.tick() for _ in range(512)]
    assert [i + 1 for i, c in enumerate(cleared) if c] == [256, 512]
    dev.cache = 2 * GiB  # over the limit: cleared at the next check, then not again while below
    assert [upkeep.tick() for _ in range(16)][-1] and sum(upkeep.tick() for _ in range(64)) == 0


def test_a_rank_engine_step_ticks_the_upkeep(model, monkeypatch):
    from mlxcluster.engine.decode import RankEngine
    from mlxcluster.engine.sampling import Sampling

    dev = FakeDevice()
    eng = RankEngine(model, 256)
    eng.upkeep = mem.CacheUpkeep(dev, every=2)
    eng.prefill_many([("a", [1, 2, 3, 4], Sampling(), (), 16, 0)])
    for _ in range(4):
        eng.step()
    assert dev.calls.count(("clear",)) == 2


def test_the_standby_counts_quantized_weights_at_their_file_size_on_metal(tmp_path):
    d = tmp_path / "q4"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"quantization": {"bits": 4, "group_size": 64}}))
    (d / "model.safetensors").write_bytes(b"\0" * 1000)
    assert rank_mod._preload_bytes(str(d), "quantized") == 1000  # Metal: the weights stay packed
    assert rank_mod._preload_bytes(str(d), "float32") == 8000  # CPU: dequantised to float32
    assert os.path.getsize(d / "model.safetensors") == 1000

"""Model drafters of speculative decoding (issue 30): a draft model (``model:PATH``) and the target's
first N layers (``layers:N``, self-speculative), in process on the tiny random Llama.

* Greedy answers through rank 0's scheduler equal plain decoding token for token with each drafter,
  three concurrent requests, alone and with a rank N following the plans; drafting ran on the MLX
  thread only (never on the event loop); the draft weights were loaded once for all sequences.
* A drafter's KV cache after a partial acceptance: trimmed back to the accepted prefix, so its next
  draft equals a fresh drafter's on the same context (fails without the trim).
* Refusals are one line: ``model:/nonexistent``, ``layers:0``, ``layers:N`` at or past the layer
  count, a draft model with another vocabulary (at the request), the API's 400 for malformed ones.
* :class:`AdaptiveK` counts a drafter's measured time per draft token.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading

import pytest

mx = pytest.importorskip("mlx.core")

sys.path.insert(0, os.path.dirname(__file__))

import tinymodel  # noqa: E402
from harness import InProcessRank  # noqa: E402
from mlxcluster.control.follower import Follower  # noqa: E402
from mlxcluster.control.link import RankGroup  # noqa: E402
from mlxcluster.engine import drafters  # noqa: E402
from mlxcluster.engine.speculative import AdaptiveK, make_drafter  # noqa: E402
from mlxcluster.leader.scheduler import Scheduler, SessionStats  # noqa: E402

VOCAB = tinymodel.TINY_CONFIG["vocab_size"]
CONTEXT = tinymodel.TINY_CONFIG["max_position_embeddings"]
PROMPTS = [[1, 5, 200, 17, 3, 99, 42], [7, 7, 8, 100, 31, 7, 7, 8], [250, 4, 4, 4, 60, 61, 62, 63, 9]]
LENGTHS = [30, 26, 22]


def _write(out_dir, seed, **overrides):
    """A tiny random Llama as an mlx-lm directory (config.json + model.safetensors)."""
    config, weights = tinymodel.tiny_llama(seed=seed, **overrides)
    os.makedirs(out_dir, exist_ok=True)
    mx.save_safetensors(os.path.join(out_dir, "model.safetensors"), weights)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return str(out_dir)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """Another random model of one layer with the target's vocabulary: its drafts are partly right."""
    return _write(tmp_path_factory.mktemp("draft"), 1, num_hidden_layers=1)


def _answers(model, executor, speculative, rank_n=False, **kw):
    group = RankGroup()
    if rank_n:
        group.add(InProcessRank(Follower(model, 1, VOCAB, CONTEXT), group, executor))
    sched = Scheduler(model, group, VOCAB, CONTEXT, executor, step_timeout_s=30, **kw)
    if speculative[0] != "off":  # loaded before: the three requests join together, as without drafting
        executor.submit(sched.speculation_of(*speculative)[0].load).result()

    async def one(prompt, n):
        st = SessionStats(uid="")
        return [t async for t in sched.generate(prompt, n, stats=st, speculative=speculative)], st

    async def main():
        try:
            return await asyncio.gather(*[one(p, n) for p, n in zip(PROMPTS, LENGTHS)])
        finally:
            await sched.close()

    return asyncio.run(main()), sched


@pytest.mark.parametrize("rank_n", [False, True], ids=["alone", "rank-n"])
@pytest.mark.parametrize("kind", ["layers", "model"])
def test_greedy_with_a_model_drafter_equals_plain_decoding(model, executor, draft_dir, monkeypatch, kind, rank_n,
                                                           full_drafts):
    spec = "layers:1" if kind == "layers" else f"model:{draft_dir}"
    plain, _ = _answers(model, executor, ("off", 0), rank_n)
    threads, loads = set(), []
    propose, load = drafters.ModelDrafter.propose, drafters.DraftModels._load
    monkeypatch.setattr(drafters.ModelDrafter, "propose",
                        lambda self, c, k: threads.add(threading.current_thread().name) or propose(self, c, k))
    monkeypatch.setattr(drafters.DraftModels, "_load", lambda self, *a: loads.append(a) or load(self, *a))
    got, sched = _answers(model, executor, (spec, 4), rank_n)
    assert [t for t, _ in got] == [t for t, _ in plain]
    s = sched.spec_stats
    assert s.drafted > s.accepted > 0 and s.tokens > s.steps  # drafts partly accepted: caches trimmed
    assert all(st.spec_drafted > 0 for _, st in got)
    assert threads and all(t.startswith("mlx") for t in threads), threads  # never on the event loop
    assert len(loads) == 1  # one load for the three sequences
    if kind == "layers":  # the view shares the target's own modules
        view = sched.draft_models.get("layers", "1", spec)
        assert len(view.layers) == 1 and view.model.layers[0] is model.model.layers[0]
        assert view.model.embed_tokens is model.model.embed_tokens and view.model.norm is model.model.norm


def test_the_cache_is_trimmed_to_the_accepted_prefix(model, draft_dir):
    """Partial acceptance: the drafter's cache held ``context + draft[:-1]``; the next context keeps
    one draft token and a correction, so the cache is trimmed back to the context and the next draft
    equals a fresh drafter's (a drafter that kept the rejected tokens' K/V drafts from a wrong
    context; one that rebuilt its cache would pass the equality but not the offset check)."""
    models = drafters.DraftModels(model, VOCAB)
    for spec in ("layers:1", f"model:{draft_dir}"):
        d = make_drafter(spec, "--draft", models)
        ctx = [3, 17, 42, 42, 9, 100, 5]
        first = d.propose(ctx, 4)
        assert len(first) == 4 and d.seen == ctx + first[:3]
        assert all(c.offset == len(d.seen) for c in d.cache)
        kept = d.cache[0]
        nxt = ctx + first[:1] + [(first[1] + 1) % VOCAB]  # one accepted, then the target's correction
        again = d.propose(nxt, 4)
        assert d.cache[0] is kept  # trimmed in place, not rebuilt
        assert d.seen == nxt + again[:3] and all(c.offset == len(d.seen) for c in d.cache)
        assert again == make_drafter(spec, "--draft", models).propose(nxt, 4)


def test_a_shard_reads_its_own_copy_of_the_first_layers(model, tmp_path):
    """Where rank 0 holds a part of the model (TP>1), ``layers:N`` is an unsharded copy of the first N
    layers, norm and head read from the model's file: the same logits as the view of a whole model."""

    class Shard:  # what DraftModels sees of a rank 0 shard of the fixture's model
        world_size, args = 2, model.args

    path = _write(tmp_path / "target", 0)  # the fixture's weights
    with pytest.raises(ValueError, match="does not know its file"):
        drafters.DraftModels(Shard(), VOCAB).check("layers", "1", "--draft layers:1")
    models = drafters.DraftModels(Shard(), VOCAB, None, path)
    with pytest.raises(ValueError, match=r"N must be in \[1, 1\]"):
        models.check("layers", "2", "--draft layers:2")
    own = models.get("layers", "1", "--draft layers:1")
    x = mx.array([[3, 17, 42, 9]])
    assert len(own.layers) == 1 and own.layers[0] is not model.layers[0]
    assert mx.allclose(own(x), drafters.first_layers(model, 1)(x), atol=1e-5).item()


def test_bad_drafters_are_one_line_errors(model, executor, tmp_path):
    sched = Scheduler(model, RankGroup(), VOCAB, CONTEXT, executor)
    for draft, needle in [("model:/nonexistent", "model not found: /nonexistent"), ("layers:0", "layers:N"),
                          ("layers:2", r"N must be in \[1, 1\] \(the model has 2 layers\)"),
                          ("layers:999", r"N must be in \[1, 1\]"), ("model:", "model:PATH"), ("layers:x", "layers:N")]:
        with pytest.raises(ValueError, match=needle) as exc:
            sched.speculation_of(draft, 4)
        msg = str(exc.value)
        assert "\n" not in msg and msg.startswith("speculative.draft ") and draft in msg
    with pytest.raises(ValueError, match=r"^--draft layers:999: N must be"):
        Scheduler(model, RankGroup(), VOCAB, CONTEXT, executor, draft="layers:999")
    other = _write(tmp_path / "other", 2, num_hidden_layers=1, vocab_size=VOCAB + 8)

    async def ask():
        agen = sched.generate([1, 2, 3], 4, speculative=(f"model:{other}", 4))
        try:
            await agen.__anext__()
        finally:
            await agen.aclose()

    with pytest.raises(ValueError, match=r"its vocabulary has 264 tokens, the target's 256") as exc:
        asyncio.run(ask())
    assert "\n" not in str(exc.value) and str(exc.value).startswith(f"speculative.draft model:{other}:")
    # the API: malformed drafters are 400s naming speculative; a path or a layer count is rank 0's to check
    from mlxcluster.front.provider import ProviderError, _speculative

    assert _speculative({"speculative": {"draft": "layers:3", "draft_tokens": 2}}) == ("layers:3", 2)
    assert _speculative({"speculative": {"draft": "model:/m"}}) == ("model:/m", 0)
    for bad in ("layers:0", "layers:", "model:", "medusa:1"):
        with pytest.raises(ProviderError) as err:
            _speculative({"speculative": {"draft": bad}})
        assert err.value.status == 400 and err.value.param == "speculative" and "\n" not in err.value.message


def test_adaptive_k_counts_the_drafters_time():
    free, costly = AdaptiveK(8, cost=0.05), AdaptiveK(8, cost=0.05, draft_cost=0.3)
    for a in (free, costly):
        for _ in range(10):
            a.update(4, 3)  # alpha ~ 0.75
    assert free.best_k() > costly.best_k() >= 1
    costly.draft_cost = 2.0  # drafting a token costs two plain steps: nothing pays
    assert costly.best_k() == 0

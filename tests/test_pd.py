"""Prefill/decode disaggregation as plain functions (tiny random model): the producer's
layer-by-layer stream rebuilds a single rank's KV cache bit for bit (whole or per tensor-parallel
head slice), a decode engine started from it continues with a single rank's tokens, and the
consumer's state machine reorders, drops duplicates and fails closed on an early end, an early
LAST_PREFILL, a stale or other-identity stream; a stream that rank 0 refuses after a rank N installed it
leaves every rank's decode batch alike (a decode group of rank 0 and a rank N in process)."""

from __future__ import annotations

import numpy as np
import pytest

from mlxcluster import failpoints
from mlxcluster.engine import passes as passes_mod
from mlxcluster.engine.batch import DecodeBatch
from mlxcluster.engine.decode import RankEngine
from mlxcluster.engine.kv_sources import Remote
from mlxcluster.engine.sampling import Sampling, make_token_sampler, sampling_of
from mlxcluster.engine import handoff as ho
from mlxcluster.engine import pd
from mlxcluster.model.layout import LayerRange
from mlxcluster.model.tp import build_model
from mlxcluster.protocol import frames as fr

from tinymodel import TINY_CONFIG, tiny_llama

N_KV, DIM, N_LAYERS = TINY_CONFIG["num_key_value_heads"], TINY_CONFIG["head_dim"], TINY_CONFIG["num_hidden_layers"]
PROMPT = [int(t) for t in np.random.default_rng(3).integers(1, 250, 45)]
UID = "req-1"


@pytest.fixture(scope="module")
def model():
    config, weights = tiny_llama(seed=1)
    return build_model(config, weights, None, "float32")


def _identity(n):
    return ho.identity_of("d1", "float32", n, DIM, "float32")


def _want(n=N_KV, prompt=PROMPT):
    return ho.Expected(0, LayerRange(0, N_LAYERS - 1, output=True), len(prompt), ho.prompt_hash(prompt),
                       _identity(n), "")


def _produce(model, subscribers=((0, N_KV),), chunk=16, prompt=PROMPT, sampling=Sampling()):
    streams = [[] for _ in subscribers]
    sampler = make_token_sampler(sampling.temperature, sampling.top_p, sampling.seed)
    token = pd.prefill_stream(model, prompt, sampler, subscribers, _identity,
                              lambda s, f: streams[s].append(f), UID, chunk_tokens=chunk)
    return token, streams


def _consume(frames, head0=0, n=N_KV):
    stream = pd.KvStream(UID, _want(n), head0)
    for f in frames:
        if stream.offer(f) == pd.DECODE:
            break
    return stream


def _single_rank(model, chunk, prompt=PROMPT, sampling=Sampling(), steps=6, monkeypatch=None):
    monkeypatch.setattr(passes_mod, "PREFILL_CHUNK_TOKENS", chunk)
    engine = RankEngine(model, 4096)
    first = engine.prefill("ref", prompt, sampling)
    cache = [c.keys_and_values() for c in engine.get("ref").session.cache]
    tokens = [first] + [engine.step()[0] for _ in range(steps)]
    engine.remove("ref")
    return cache, tokens


def test_stream_rebuilds_a_single_rank_cache_and_tokens(model, monkeypatch):
    ref_cache, ref_tokens = _single_rank(model, 16, monkeypatch=monkeypatch)
    token, (frames,) = _produce(model, chunk=16)
    assert token == ref_tokens[0]
    # one frame per (chunk, layer), in the order the producer finished them, then the marker
    assert [(f.chunk, f.layer) for f in frames[:-1]] == [(c, l) for c in range(3) for l in range(N_LAYERS)]
    assert frames[-1].last and frames[-1].total_frames == len(frames) - 1
    assert frames[-1].total_bytes == len(PROMPT) * N_LAYERS * N_KV * DIM * 2 * 4
    stream = _consume(frames)
    kv, first = stream.result()
    assert first == token
    for layer, (k, v) in kv.items():
        assert np.array_equal(np.array(k), np.array(ref_cache[layer][0]))
        assert np.array_equal(np.array(v), np.array(ref_cache[layer][1]))
    engine = RankEngine(model, 4096)
    assert engine.admit(UID, PROMPT, Sampling(), source=Remote(kv, first)).token == ref_tokens[0]
    assert [engine.step()[0] for _ in range(6)] == ref_tokens[1:]


def test_seeded_sampling_continues_like_one_rank(model, monkeypatch):
    s = Sampling(temperature=0.9, top_p=0.95, seed=7)
    _, ref_tokens = _single_rank(model, 16, sampling=s, monkeypatch=monkeypatch)
    token, (frames,) = _produce(model, chunk=16, sampling=s)
    kv, first = _consume(frames).result()
    engine = RankEngine(model, 4096)
    assert engine.admit(UID, PROMPT, s, source=Remote(kv, first)).token == ref_tokens[0]
    assert [engine.step()[0] for _ in range(6)] == ref_tokens[1:]


def test_each_tensor_parallel_rank_gets_its_own_heads(model, monkeypatch):
    ref_cache, _ = _single_rank(model, 16, steps=0, monkeypatch=monkeypatch)
    subs = [pd.head_slice(N_KV, 3, r) for r in range(3)]
    assert subs == [(0, 1), (1, 1), (2, 1)]
    _, streams = _produce(model, subscribers=subs, chunk=16)
    for (h0, n), frames in zip(subs, streams):
        assert all(f.head0 == h0 for f in frames)
        kv, _ = _consume(frames, h0, n).result()
        for layer, (k, _v) in kv.items():
            assert np.array_equal(np.array(k), np.array(ref_cache[layer][0][:, h0:h0 + n]))


@pytest.mark.parametrize("fault", ["dup", "permute"])
def test_duplicated_and_permuted_frames_give_the_same_cache(model, fault):
    _, (frames,) = _produce(model)
    clean, _ = _consume(frames).result()
    with failpoints.scoped("pd.send", fault):  # the prefill group's failpoint
        stream = _consume(pd.as_sent(frames))
    kv, _ = stream.result()
    assert fault != "dup" or stream.duplicates > 0
    for layer in clean:
        assert np.array_equal(np.array(kv[layer][0]), np.array(clean[layer][0]))


def test_without_the_failpoint_the_stream_is_sent_as_produced(model):
    _, (frames,) = _produce(model)
    assert failpoints.fail_point("pd.send") is None
    assert pd.as_sent(frames) is frames


def test_reverse_order_is_held_until_the_gap_fills(model):
    _, (frames,) = _produce(model)
    stream = pd.KvStream(UID, _want(), 0)
    data, marker = frames[:-1], frames[-1]
    assert stream.offer(marker) == pd.LAST_PREFILL
    for f in reversed(data[1:]):
        assert stream.offer(f) == pd.LAST_PREFILL and stream.applied == 0  # index 0 still missing
    assert stream.offer(data[0]) == pd.DECODE
    stream.result()


@pytest.mark.parametrize("fault, words", [
    ("early_end", "ended in PREFILL"),
    ("early_last", "positions"),
    ("hash", "other token ids"),
    ("weights", "another model identity"),
])
def test_faults_fail_closed(model, fault, words):
    _, (frames,) = _produce(model)
    with failpoints.scoped("pd.send", fault):
        stream = _consume(pd.as_sent(frames))
    with pytest.raises(pd.PdError, match=words):
        stream.result()


def test_early_last_then_more_frames_is_refused(model):
    _, (frames,) = _produce(model)
    stream = pd.KvStream(UID, _want(), 0)
    with failpoints.scoped("pd.send", "early_last"):
        sent = pd.as_sent(frames)
    with pytest.raises(pd.PdError, match="early LAST_PREFILL"):
        for f in sent:
            stream.offer(f)
            if stream.state == pd.DECODE:  # what a consumer that kept reading would see next
                continue


def test_stale_or_foreign_frames_are_refused(model):
    _, (frames,) = _produce(model)
    other = pd.KvStream("req-2", _want(), 0)
    with pytest.raises(pd.PdError, match="stale"):
        other.offer(frames[0])
    wrong_heads = pd.KvStream(UID, _want(1), 1)
    with pytest.raises(pd.PdError, match="heads"):
        wrong_heads.offer(frames[0])
    short = pd.KvStream(UID, _want(prompt=PROMPT[:-1]), 0)
    for f in frames:
        short.offer(f)
    with pytest.raises(pd.PdError, match="positions"):
        short.result()


def test_head_slice_refuses_an_uneven_split():
    with pytest.raises(ValueError, match="do not split"):
        pd.head_slice(3, 2, 0)


# -- a decode group in process: rank 0's scheduler and a rank N following its plans ---------------------
class _PrefillPeer:
    """The prefill group in process, as one decode rank's ``DecodeSide``: a fetch runs the prompt through
    :func:`~mlxcluster.engine.pd.prefill_stream` on a whole model and reads the frames, as sent
    (:func:`~mlxcluster.engine.pd.as_sent`), with the one receiver; ``faulty``: prompts whose stream goes
    out with failpoint ``pd.send=hash`` (another prompt's hash: the receiver's check refuses it)."""

    def __init__(self, model, executor, faulty=()):
        self.model, self.executor, self.faulty = model, executor, [list(p) for p in faulty]
        self.fetched = []  # prompts whose stream reached DECODE

    def fetch(self, uid, token_ids, sampling):
        from mlxcluster.leader.pd import PdFetch

        ids = list(token_ids)
        s = sampling_of(sampling)
        frames = []
        pd.prefill_stream(self.model, ids, make_token_sampler(s.temperature, s.top_p, s.seed), [(0, N_KV)],
                          _identity, lambda _, f: frames.append(f), uid)
        if ids in self.faulty:
            with failpoints.scoped("pd.send", "hash"):
                frames = pd.as_sent(frames)
        stream = pd.KvStream(uid, ho.Expected(0, LayerRange(0, N_LAYERS - 1, output=True), len(ids),
                                              ho.prompt_hash(ids), _identity(N_KV), ""), 0)
        for f in frames:
            stream.offer(f)
        self.fetched.append(ids)
        return PdFetch(stream, int(stream.marker.first_token), stream.bytes, 0.0, stream.marker.prefill_done_unix)

    async def fetch_async(self, uid, token_ids, sampling):
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(self.executor, self.fetch, uid, token_ids, sampling)


#: two sequences decoding, then late ones (sent together) whose prefill group's K/V rank 0 may refuse
DECODING = [([1, 5, 200, 17, 3, 99, 42], 30), ([7, 7, 8, 100, 31, 7, 7, 8], 30)]
LATE = [([250, 4, 4, 60, 61, 9], 8), ([9, 9, 31, 2, 77, 5, 5], 8)]


def _decode_group(model, late, refused_by_rank_0, speculative, monkeypatch):
    """The requests of :data:`DECODING`, each sent once the one before has a token, then ``late`` ones
    together, through a decode group of rank 0 and one rank N (each fetching its own K/V from an
    in-process prefill group; rank 0's streams of the prompts ``refused_by_rank_0`` fail its check).
    Returns each request's tokens and stats, rank N's prefill peer, each rank's decode steps as the row
    layouts of its batch cache (rank 0's, rank N's: per step, the uid in each row, ``None`` for a free
    row) and the plans rank N followed."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from harness import InProcessRank
    from mlxcluster.control.follower import Follower
    from mlxcluster.control.link import RankGroup
    from mlxcluster.leader.scheduler import Scheduler, SessionStats

    vocab, context = TINY_CONFIG["vocab_size"], TINY_CONFIG["max_position_embeddings"]
    layouts = {}
    forward, forward_positions = DecodeBatch.forward, DecodeBatch.forward_positions

    def record(batch):
        rows = batch._rows if batch._cache is not None else batch.sessions
        # keyed by the object itself: an id() is unique only while its object lives (a batch of an
        # earlier run, freed, may lend its id to this run's)
        layouts.setdefault(batch, []).append([None if r is None else r.uid for r in rows])

    # undone at the end (a second run must not record into this run's layouts through nested patches)
    patches = monkeypatch.context()
    mp = patches.__enter__()
    mp.setattr(DecodeBatch, "forward", lambda self, x: (record(self), forward(self, x))[1])
    mp.setattr(DecodeBatch, "forward_positions", lambda self, x: (record(self), forward_positions(self, x))[1])
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx")
    try:
        group = RankGroup()
        follower = Follower(model, 1, vocab, context)
        follower.decode_side = peer_n = _PrefillPeer(model, executor)
        link = InProcessRank(follower, group, executor)
        group.add(link)
        peer_0 = _PrefillPeer(model, executor, faulty=refused_by_rank_0)
        sched = Scheduler(model, group, vocab, context, executor, step_timeout_s=30, decode_side=peer_0)

        async def one(prompt, n, started=None):
            st, out = SessionStats(uid=""), []
            async for t in sched.generate(prompt, n, stats=st, speculative=speculative):
                out.append(t)
                if started is not None and not started.done():
                    started.set_result(None)
            return out, st

        async def main():
            try:
                loop, runs = asyncio.get_running_loop(), []
                for prompt, n in DECODING:
                    started = loop.create_future()
                    runs.append(asyncio.ensure_future(one(prompt, n, started)))
                    await started
                runs += [asyncio.ensure_future(one(prompt, n)) for prompt, n in late]
                return [await r for r in runs]
            finally:
                await sched.close()

        answers = asyncio.run(main())
        executor.submit(lambda: None).result()  # rank N has run every plan
        steps = (layouts.get(sched.engine.batch, []), layouts.get(follower.engine.batch, []))
        assert follower.engine.sequences == {}
    finally:
        executor.shutdown(wait=True)
        patches.__exit__(None, None, None)
    return answers, peer_n, steps, [f.step_plan for f in link.frames]


@pytest.mark.parametrize("late, speculative", [(LATE[:1], ("off", 0)), (LATE[:1], ("ngram", 4)), (LATE, ("off", 0))])
def test_a_stream_rank_0_refuses_after_rank_n_installed_it_leaves_the_batches_alike(model, late, speculative,
                                                                                    monkeypatch):
    """Two sequences decode; a third's K/V from the prefill group (with a fourth's, in the same plan) is
    installed by rank N but refused by rank 0 (its stream fails the check), so it leaves every rank and
    joins again computed here.  Rank N must never have held it in its decode batch: every decode step
    of rank N runs the same batch rows as rank 0's (in a tensor-parallel group each step's collectives
    pair those rows), and every answer equals the same requests' answers without the fault.  Two
    refusals of one plan leave in one plan (else rank N would add the second before its own leave)."""
    refused = [p for p, _ in late]
    plain, _, steps_plain, _ = _decode_group(model, late, [], speculative, monkeypatch)
    faulted, peer_n, steps, plans = _decode_group(model, late, refused, speculative, monkeypatch)
    assert all(p in peer_n.fetched for p in refused)  # rank N got the late ones' K/V ...
    assert all(st.handoff_fallback.startswith("rank 0:") for _, st in faulted[2:])  # ... rank 0 refused them
    assert all(st.handoff_fallback == "" for _, st in plain)
    assert sum(len(p.joins) for p in plans if any(fr.source_of(j) == fr.REMOTE for j in p.joins)) == 2 + len(late)
    if len(late) > 1:
        assert any(sum(fr.source_of(j) == fr.REMOTE for j in p.joins) == len(late) for p in plans), "not one plan"
    assert [t for t, _ in faulted] == [t for t, _ in plain]
    rank_0, rank_n = steps
    assert rank_0 and rank_n == rank_0
    assert steps_plain[1] == steps_plain[0]

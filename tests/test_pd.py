"""Prefill/decode disaggregation as plain functions (tiny random model): the producer's
layer-by-layer stream rebuilds a single rank's KV cache bit for bit (whole or per tensor-parallel
head slice), a decode engine started from it continues with a single rank's tokens, and the
consumer's state machine reorders, drops duplicates and fails closed on an early end, an early
LAST_PREFILL, a stale or other-identity stream."""

from __future__ import annotations

import numpy as np
import pytest

from mlxcluster import failpoints
from mlxcluster.engine import decode as dec
from mlxcluster.engine import handoff as ho
from mlxcluster.engine import pd
from mlxcluster.model.layout import LayerRange
from mlxcluster.model.tp import build_model

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


def _produce(model, subscribers=((0, N_KV),), chunk=16, prompt=PROMPT, sampling=dec.Sampling()):
    streams = [[] for _ in subscribers]
    sampler = dec.make_token_sampler(sampling.temperature, sampling.top_p, sampling.seed)
    token = pd.prefill_stream(model, prompt, sampler, subscribers, _identity,
                              lambda s, f: streams[s].append(f), UID, chunk_tokens=chunk)
    return token, streams


def _consume(frames, head0=0, n=N_KV):
    stream = pd.KvStream(UID, _want(n), head0)
    for f in frames:
        if stream.offer(f) == pd.DECODE:
            break
    return stream


def _single_rank(model, chunk, prompt=PROMPT, sampling=dec.Sampling(), steps=6, monkeypatch=None):
    monkeypatch.setattr(dec, "PREFILL_CHUNK_TOKENS", chunk)
    engine = dec.RankEngine(model, 4096)
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
    engine = dec.RankEngine(model, 4096)
    assert engine.admit(UID, PROMPT, dec.Sampling(), source=dec.Remote(kv, first)).token == ref_tokens[0]
    assert [engine.step()[0] for _ in range(6)] == ref_tokens[1:]


def test_seeded_sampling_continues_like_one_rank(model, monkeypatch):
    s = dec.Sampling(temperature=0.9, top_p=0.95, seed=7)
    _, ref_tokens = _single_rank(model, 16, sampling=s, monkeypatch=monkeypatch)
    token, (frames,) = _produce(model, chunk=16, sampling=s)
    kv, first = _consume(frames).result()
    engine = dec.RankEngine(model, 4096)
    assert engine.admit(UID, PROMPT, s, source=dec.Remote(kv, first)).token == ref_tokens[0]
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

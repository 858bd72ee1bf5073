"""The --local-decode KV handoff as plain functions: frames round-trip a KV cache, and rank 0's
check refuses every kind of mismatch before anything is installed (fails closed)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from mlxcluster import failpoints
from mlxcluster.control.follower import Follower
from mlxcluster.engine import handoff as ho
from mlxcluster.model.layout import LayerRange, make_route, parse_layers
from mlxcluster.protocol import frames as fr
from mlxcluster.protocol import mlxcluster_pb2 as pb
from harness import join_plan, one_reply

HEADS, DIM = 3, 8
IDS = list(range(100, 100 + 37))
IDENTITY = ho.identity_of("abc123", "float32", HEADS, DIM, "float32")
RANGE = LayerRange(0, 2)


def _cache(n_layers=3, p=len(IDS), seed=0):
    mx.random.seed(seed)
    caches = []
    for _ in range(n_layers):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, HEADS, p, DIM)), mx.random.normal((1, HEADS, p, DIM)))
        caches.append(c)
    return caches


def _want(**kw):
    base = dict(rank=1, layers=RANGE, token_count=len(IDS), token_hash=ho.prompt_hash(IDS), identity=IDENTITY,
                epoch="e1")
    base.update(kw)
    return ho.Expected(**base)


def _frames(cache=None, monkeypatch=None, frame_bytes=None):
    if frame_bytes and monkeypatch:
        monkeypatch.setattr(ho, "FRAME_BYTES", frame_bytes)
    return list(ho.kv_frames(cache or _cache(), RANGE, IDS, IDENTITY, "e1"))


def test_the_one_receiver_takes_a_handoff_like_a_prefill_groups_stream(monkeypatch):
    """Rank 0 receives a stage's handoff with the same KvStream as a decode rank receives the prefill
    group's stream: reordered and duplicated frames are put right, the K/V are the cache's, and a
    header fault is refused by the same check."""
    cache = _cache()
    frames = list(ho.kv_frames(cache, RANGE, IDS, IDENTITY, "e1", uid="s1"))
    assert {f.uid for f in frames} == {"s1"}
    stream = ho.KvStream("s1", _want(), 0, who="rank 1's KV handoff")
    arrived = [frames[1], frames[0], frames[0]] + frames[2:]
    states = [stream.offer(f) for f in arrived]
    assert states[-1] == ho.DECODE and ho.DECODE not in states[:-1] and stream.duplicates == 1
    kv, _ = stream.result()
    for i, c in enumerate(cache):
        k, v = c.keys_and_values()
        assert np.array_equal(np.array(kv[i][0]), np.array(k)) and np.array_equal(np.array(kv[i][1]), np.array(v))
    with failpoints.scoped("handoff.send", "hash"):
        bad = ho.KvStream("s1", _want(), 0, who="rank 1's KV handoff")
        for f in ho.kv_frames(cache, RANGE, IDS, IDENTITY, "e1", uid="s1"):
            bad.offer(f)
    with pytest.raises(ho.HandoffError, match="rank 1's KV handoff was prefilled from other token ids"):
        bad.result()
    other = ho.KvStream("s2", _want(), 0, who="rank 1's KV handoff")
    with pytest.raises(ho.HandoffError, match="stale"):
        other.offer(frames[0])


def test_frames_round_trip_the_cache_bit_for_bit(monkeypatch):
    cache = _cache()
    frames = _frames(cache, monkeypatch, frame_bytes=2 * HEADS * DIM * 4 * 10)  # 10 positions per frame
    assert len(frames) == 3 * 4 + 1 and frames[-1].last and frames[-1].total_frames == 12
    assert frames[-1].total_bytes == 3 * len(IDS) * 2 * HEADS * DIM * 4
    kv = ho.assemble(frames, _want())
    for i, c in enumerate(cache):
        k, v = c.keys_and_values()
        assert np.array_equal(np.array(kv[i][0]), np.array(k)) and np.array_equal(np.array(kv[i][1]), np.array(v))


@pytest.mark.parametrize("change, words", [
    (lambda f: setattr(f, "token_hash", f.token_hash ^ 1), "other token ids"),
    (lambda f: setattr(f.layers, "end", 1), "the route gives that rank 0:2"),
    (lambda f: setattr(f, "epoch", "e0"), "stale"),
    (lambda f: setattr(f.identity, "weights", "float16"), "weights 'float16' != 'float32'"),
    (lambda f: setattr(f.identity, "digest", "zzz"), "digest"),
    (lambda f: setattr(f, "token_count", 36), "holds 36 positions"),
    (lambda f: setattr(f, "total_frames", 2), "announced 2 data frames"),
    (lambda f: setattr(f, "total_bytes", 5), "announced 5 bytes"),
])
def test_a_header_that_differs_is_refused(change, words):
    frames = _frames()
    change(frames[-1])
    with pytest.raises(ho.HandoffError, match="rank 1's KV handoff") as err:
        ho.assemble(frames, _want())
    assert words in str(err.value) and "\n" not in str(err.value)


def test_data_frames_must_arrive_whole_in_order_and_only_once(monkeypatch):
    frames = _frames(monkeypatch=monkeypatch, frame_bytes=2 * HEADS * DIM * 4 * 20)  # 2 frames per layer
    with pytest.raises(ho.HandoffError, match="ended without its last frame"):
        ho.assemble(frames[:-1], _want())
    with pytest.raises(ho.HandoffError, match="announced 6 data frames, 5 arrived"):
        ho.assemble(frames[:2] + frames[3:], _want())
    swapped = frames[:]
    swapped[0], swapped[1] = swapped[1], swapped[0]
    with pytest.raises(ho.HandoffError, match="frame 1 arrived where frame 0 belongs"):
        ho.assemble(swapped, _want())
    short = [pb.KvFrame.FromString(f.SerializeToString()) for f in frames]
    short[1].keys = short[1].keys[:-4]
    short[-1].total_bytes -= 4
    with pytest.raises(ho.HandoffError, match="bytes, expected"):
        ho.assemble(short, _want())
    wrong_layer = [pb.KvFrame.FromString(f.SerializeToString()) for f in frames]
    wrong_layer[0].layer = 7
    with pytest.raises(ho.HandoffError, match="layer 7, outside 0:2"):
        ho.assemble(wrong_layer, _want())


def test_a_handoff_for_another_prompt_length_never_fits():
    frames = list(ho.kv_frames(_cache(p=30), RANGE, IDS[:30], IDENTITY, "e1"))
    with pytest.raises(ho.HandoffError, match="holds 30 positions, rank 0 prefilled 37"):
        ho.assemble(frames, _want())


@pytest.mark.parametrize("fault, words", [("hash", "other token ids"), ("range", "the route gives"),
                                          ("epoch", "stale"), ("weights", "another model identity")])
def test_each_injected_fault_is_caught_by_the_check(fault, words):
    with failpoints.scoped("handoff.send", fault):  # the sender's failpoint (kv_frames)
        frames = _frames()
    with pytest.raises(ho.HandoffError, match=words):
        ho.assemble(frames, _want())


def test_the_exit_failpoint_ends_the_sender_before_its_second_frame(monkeypatch):
    class Exited(Exception):
        pass

    def exit_(status):
        raise Exited(status)

    monkeypatch.setattr(ho.os, "_exit", exit_)
    sent = []
    with failpoints.scoped("handoff.send", "exit"), pytest.raises(Exited, match="17"):
        for f in ho.kv_frames(_cache(), RANGE, IDS, IDENTITY, "e1"):
            sent.append(f.index)
    assert sent == [0]


def test_expected_senders_are_every_stage_leader_but_rank_0():
    route = make_route(parse_layers("20:output,0:9,10:19", 30), 30)
    want = ho.expected_senders(route, "e", IDS, IDENTITY)
    assert sorted(want) == [1, 2]
    assert (want[1].layers.start, want[1].layers.end) == (0, 9) and want[2].layers.start == 10


def test_local_decode_needs_rank_0_to_own_the_output_and_single_rank_stages():
    from mlxcluster.model.layout import LayoutError

    make_route(parse_layers("15:output,0:14", 30), 30).check_local_decode()
    with pytest.raises(LayoutError, match="needs rank 0 to own K:output"):
        make_route(parse_layers("0:14,15:output", 30), 30).check_local_decode()
    with pytest.raises(LayoutError, match="single-rank stages"):
        make_route(parse_layers("15:output,0:14", 30), 30, (1, 3)).check_local_decode()


class _StageModel:
    """A stand-in for a pipeline stage: the follower must refuse before it touches the model."""

    def __init__(self, route: str, epoch: str, local_decode: bool = True):
        self.route = make_route(parse_layers(route, 30), 30)
        self.epoch = epoch
        self.local_decode = local_decode
        self.layers = []

    def __call__(self, *a, **k):
        raise AssertionError("a rejected frame ran the model")


@pytest.mark.parametrize("route, epoch, local, words", [
    ("0:14,15:output", "e1", True, "runs '15:output,0:14'"),
    ("15:output,0:14", "e0", True, "stale"),
    ("15:output,0:14", "e1", True, None),
])
def test_a_stage_rejects_another_route_or_epoch_before_running_anything(route, epoch, local, words):
    follower = Follower(_StageModel("15:output,0:14", "e1", local_decode=False), 1, 1000, 4096)
    frame = join_plan("s1", [1, 2, 3], 4, route=make_route(parse_layers(route, 30), 30).identity(),
                      epoch=epoch, source=fr.HANDOFF if local else fr.COMPUTE)
    reply = one_reply(follower, frame)
    assert reply is not None and not reply.ok
    assert (words or "not started with --local-decode") in reply.error

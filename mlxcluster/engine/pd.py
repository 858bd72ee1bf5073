"""Prefill/decode disaggregation as data: the producer's layer-by-layer KV stream and the
consumer's marker-driven state machine.

**Producer** (:func:`prefill_stream`, the prefill group's rank 0, on its MLX thread): the prompt
runs in chunks of :data:`~mlxcluster.engine.passes.PREFILL_CHUNK_TOKENS`, one layer at a time;
as soon as layer ``l`` of chunk ``c`` is evaluated its keys and values for the chunk's positions
go out as :class:`KvFrame` data frames, one per (chunk, layer) (split into runs of positions
when a frame would exceed :data:`~mlxcluster.engine.handoff.FRAME_BYTES`), each subscriber
getting only its own KV heads.  So KV travels while the prompt's later layers and chunks are
still computing (exo's "layer-by-layer" streaming, vLLM's ``save_kv_layer``).  The last frame is
the producer's transition marker ``LAST_PREFILL``: the total number of data frames (the
producer's edge index), the first token sampled from the prefill's own logits with the request's
sampler (index 0: the same token a single rank samples), and the handoff header of
:mod:`~mlxcluster.engine.handoff` (model identity, layer range, token count and hash, bytes).

**Consumer**: every rank of the decode group receives its stream with the one K/V receiver,
:class:`~mlxcluster.engine.handoff.KvStream` (the same as a ``--local-decode`` handoff's): nothing
is installed before its ``DECODE`` state and the one check; any mismatch fails closed with
:class:`PdError`.  The shape follows seed 004 and ds4 #401's header.

Bytes for the embedded model (float32, 30 layers, 3 KV heads of 64): keys + values are
30 x 3 x 64 x 2 x 4 = 46,080 B per prompt token for the whole group, split evenly over a
tensor-parallel decode group's ranks (each receives its own heads directly).  With quantized K/V
(``--kv-bits``; the prefill group's cache is in its own KV format, :mod:`~mlxcluster.engine.kvquant`)
the packed triples travel instead: 12,960 B per token at 8 bits in groups of 64 (0.28x), 7,200 B at
4 bits (0.16x); a decode rank of another KV format refuses the stream (the identity check).
"""

from __future__ import annotations

import time
from typing import Callable, List, Sequence, Tuple

import mlx.core as mx

from ..failpoints import fail_point
from ..model.layout import LayerRange
from ..protocol import mlxcluster_pb2 as pb
from .handoff import (AWAITING_KV, DECODE, FRAME_BYTES, LAST_PREFILL, PREFILL, KvStream, PdError,  # noqa: F401
                      prompt_hash)

__all__ = ["PdError", "KvStream", "prefill_stream", "AWAITING_KV", "PREFILL", "LAST_PREFILL", "DECODE",
           "head_slice", "as_sent"]

def head_slice(n_kv_heads: int, world_size: int, rank: int) -> Tuple[int, int]:
    """``(head0, n_heads)``: the KV heads rank ``rank`` of a tensor-parallel group of
    ``world_size`` holds -- contiguous, as mlx-lm's ``shard_linear`` splits ``k_proj``/``v_proj``.

    Raises:
        ValueError: ``world_size`` does not divide ``n_kv_heads``."""
    if world_size < 1 or n_kv_heads % world_size:
        raise ValueError(f"{n_kv_heads} KV heads do not split over {world_size} ranks")
    n = n_kv_heads // world_size
    return rank * n, n


# -- producer ----------------------------------------------------------------------------

def prefill_stream(model, token_ids: Sequence[int], sampler, subscribers: Sequence[Tuple[int, int]],
                   identity: Callable[[int], pb.ModelIdentity], emit: Callable[[int, pb.KvFrame], None],
                   uid: str, chunk_tokens: int = 0) -> int:
    """Prefill ``token_ids`` on ``model`` (a whole single-rank model: mlx-lm Llama or a
    :class:`~mlxcluster.model.tp.LlamaModelTP` of world size 1) one layer at a time and stream
    its K/V.

    Args:
        sampler: ``f(logits (vocab,), index) -> token`` (:func:`~mlxcluster.engine.sampling.make_token_sampler`).
        subscribers: per subscriber ``(head0, n_heads)``: the KV heads it receives.
        identity: the :class:`ModelIdentity` for a subscriber holding ``n`` heads.
        emit: ``emit(subscriber_index, frame)``, called on this (the MLX) thread as each frame is
            ready; it must not block (hand the frame to another thread or loop).
        chunk_tokens: prompt tokens per forward pass (0: ``PREFILL_CHUNK_TOKENS``, what a single
            rank uses, so the K/V are bit for bit a single rank's).
    Returns:
        The first token (int), after the ``LAST_PREFILL`` marker was emitted to every subscriber.
    Raises:
        ValueError: an empty prompt, or a head range outside the model's KV heads.
    """
    from ..model.pp import PipelineStage
    from .passes import PREFILL_CHUNK_TOKENS
    from .handoff import kv_payload, wire_position_bytes
    from .kvquant import make_cache

    ids = mx.array([int(t) for t in token_ids], dtype=mx.int32)[None]
    p = ids.shape[1]
    if p == 0:
        raise ValueError("empty prompt")
    n_layers = len(model.model.layers)
    n_kv = int(model.args.num_key_value_heads)
    for h0, n in subscribers:
        if n < 1 or h0 < 0 or h0 + n > n_kv:
            raise ValueError(f"KV heads [{h0}, {h0 + n}) outside the model's {n_kv}")
    whole = LayerRange(0, n_layers - 1, output=True)
    stage = PipelineStage(model, whole, prune=False)
    cache = make_cache(model)  # in the model's KV format: quantized triples travel as they are
    chunk_tokens = chunk_tokens or PREFILL_CHUNK_TOKENS
    index = [0] * len(subscribers)
    total = [0] * len(subscribers)

    def after_layer(i: int, c: int, pos0: int, n_pos: int) -> None:
        keys, values = cache[i].keys_and_values()  # (1, n_kv, offset, head_dim), or quantized triples
        for s, (h0, n) in enumerate(subscribers):
            run = max(1, FRAME_BYTES // (2 * wire_position_bytes(keys, n)))
            for a in range(pos0, pos0 + n_pos, run):
                b = min(a + run, pos0 + n_pos)
                f = pb.KvFrame(index=index[s], chunk=c, layer=i, pos0=a, n_tokens=b - a, head0=h0, uid=uid,
                               keys=kv_payload(keys, a, b, heads=(h0, h0 + n)),
                               values=kv_payload(values, a, b, heads=(h0, h0 + n)))
                index[s] += 1
                total[s] += len(f.keys) + len(f.values)
                emit(s, f)

    out = None
    for c, pos0 in enumerate(range(0, p, chunk_tokens)):
        chunk = ids[:, pos0:pos0 + chunk_tokens]
        out = stage(chunk, cache, last_only=True,
                    after_layer=lambda i, h, c=c, pos0=pos0, n=chunk.shape[1]: (mx.eval(h, cache[i].state),
                                                                               after_layer(i, c, pos0, n)))
    logits = out[0, -1]
    mx.eval(logits)
    token = int(sampler(logits, 0).item())
    done = time.time()
    h = prompt_hash(token_ids)
    for s, (h0, n) in enumerate(subscribers):
        emit(s, pb.KvFrame(index=index[s], last=True, total_frames=index[s], identity=identity(n),
                           layers=pb.LayerRangeMsg(start=0, end=n_layers - 1, output=True), token_count=p,
                           token_hash=h, total_bytes=total[s], first_token=token, prefill_done_unix=done,
                           head0=h0, uid=uid))
    return token


def as_sent(frames: List[pb.KvFrame]) -> List[pb.KvFrame]:
    """One subscriber's whole stream as the prefill group sends it: ``frames`` (a list), unless
    failpoint ``pd.send`` is set (:mod:`mlxcluster.failpoints`; tests; the prefill service then
    holds the whole stream and sends this): ``dup`` sends every data frame twice, ``permute``
    swaps each pair of data frames, ``early_end`` ends the stream before its marker,
    ``early_last`` sends the marker after the first half of the data frames (announcing that
    half) and then the rest, ``hash``/``weights`` alter the marker's prompt hash / weight format
    (``exit`` is the service's: it ends the process once two frames are held)."""
    fault = fail_point("pd.send")
    if not fault:
        return frames
    data = [f for f in frames if not f.last]
    marks = [f for f in frames if f.last]
    if fault == "dup":
        data = [g for f in data for g in (f, f)]
    elif fault == "permute":
        data = [data[i ^ 1] if (i ^ 1) < len(data) else data[i] for i in range(len(data))]
    elif fault == "early_end":
        marks = []
    elif fault == "early_last" and marks:
        half = len(data) // 2
        m = pb.KvFrame.FromString(marks[0].SerializeToString())
        m.total_frames = m.index = half
        m.total_bytes = sum(len(f.keys) + len(f.values) for f in data[:half])
        return data[:half] + [m] + data[half:]
    elif fault in ("hash", "weights") and marks:
        m = pb.KvFrame.FromString(marks[0].SerializeToString())
        if fault == "hash":
            m.token_hash ^= 1
        else:
            m.identity.weights = "float16" if m.identity.weights != "float16" else "float32"
        marks = [m]
    return data + marks

"""The ``--local-decode`` KV handoff: a pipeline stage's K/V for positions ``[0, P)`` sent to rank 0.

After a prompt of ``P`` tokens is prefilled through the pipeline, every stage but rank 0's
(which owns ``K:output`` and holds every layer) turns its KV cache into :class:`KvFrame`
messages (:func:`kv_frames`): one data frame per (layer, run of positions), then one last
frame carrying the handoff's header -- the model identity, the sender's layer range, ``P``,
the hash of the prompt ids, the formation epoch, the frame count and the byte count.  Rank 0
checks all of it against its own state with :func:`assemble` before anything is installed;
any difference raises :class:`HandoffError` and nothing of the handoff is used (fails
closed).  The shape follows ds4 #401 (the KV shard travels with its token list hash, layer
range and model id; a connection epoch drops stale peers) and ds4's WORK header (FNV-1a over
token ids there; BLAKE2b from ``hashlib`` here).

Payload for the embedded model: per layer keys and values ``(1, 3, P, 64)`` float32, 1,536 B
per position per layer; 786,432 B per layer at ``P`` = 512 (11.25 MiB for 15 layers).  With
quantized K/V (``--kv-bits``, :mod:`~mlxcluster.engine.kvquant`) the cache's packed triples travel as
they are -- never dequantized: 8-bit in groups of 64, 3 x (64 + 2 x 4) x 2 = 432 B per position per
layer (0.28x); 4-bit 240 B (0.16x).  The identity carries the KV format, so a handoff in another
format is refused by the identity check.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..failpoints import fail_point
from ..model.layout import LayerRange
from ..protocol import mlxcluster_pb2 as pb
from .kvquant import GROUP_SIZES, KV_BITS, KvFormat, kv_length, kv_slice, quantized

__all__ = ["HandoffError", "PdError", "Expected", "prompt_hash", "identity_of", "kv_frames", "assemble",
           "expected_senders", "FRAME_BYTES", "KvStream", "AWAITING_KV", "PREFILL", "LAST_PREFILL", "DECODE",
           "kv_payload", "position_bytes", "wire_position_bytes", "kv_format_name"]

#: Upper bound of keys + values bytes in one data frame (a gRPC message stays far below its
#: 4 MiB default; a layer longer than this is cut into runs of positions).
FRAME_BYTES = 1 << 20

_DTYPES = {"float32": (mx.float32, np.float32), "float16": (mx.float16, np.float16),
           "bfloat16": (mx.bfloat16, None)}


class HandoffError(ValueError):
    """A KV handoff that rank 0 refuses (one line: what differs)."""


def prompt_hash(token_ids: Sequence[int]) -> int:
    """64-bit hash of a prompt's token ids (BLAKE2b-64 over their int32 little-endian bytes):
    the handoff's proof that both sides prefilled the same tokens."""
    raw = np.asarray(list(token_ids), dtype="<i4").tobytes()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def identity_of(digest: str, weights: str, n_kv_heads: int, head_dim: int, dtype: str, kv_bits: int = 0,
                kv_group_size: int = 0) -> pb.ModelIdentity:
    """The :class:`ModelIdentity` of a KV cache: model digest, weight format, KV layout and format
    (``kv_bits`` 0: full precision; else quantized in groups of ``kv_group_size``)."""
    return pb.ModelIdentity(digest=digest, weights=weights, n_kv_heads=int(n_kv_heads), head_dim=int(head_dim),
                            dtype=dtype, kv_bits=int(kv_bits), kv_group_size=int(kv_group_size) if kv_bits else 0)


def _dtype_name(a: mx.array) -> str:
    return str(a.dtype).rsplit(".", 1)[-1]


def kv_format_name(identity: pb.ModelIdentity) -> str:
    """``identity``'s KV format in words (``8-bit K/V in groups of 64``, ``full-precision K/V``)."""
    return str(KvFormat(identity.kv_bits, identity.kv_group_size if identity.kv_bits else 0))


def _wire(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)  # bfloat16 travels as float32


def kv_payload(x, a: int, b: int, heads: Optional[Tuple[int, int]] = None) -> bytes:
    """The wire bytes of positions ``[a, b)`` (of KV heads ``heads = (h0, h1)`` when given) of row 0 of
    K/V ``x`` -- an array ``(1, heads, P, head_dim)``, or a quantized triple, whose three arrays are
    concatenated (codes, scales, biases; ``KvFrame``'s layout in ``proto/mlxcluster.proto``)."""
    parts = kv_slice(x, a, b, row=0, heads=heads)
    parts = parts if quantized(parts) else (parts,)
    return b"".join(_wire(p[0]).tobytes() for p in parts)


def wire_position_bytes(x, n_heads: Optional[int] = None) -> int:
    """Wire bytes (:func:`kv_payload`) of one position of K/V ``x`` (an array or a quantized triple;
    bfloat16 as float32) over ``n_heads`` of its KV heads (default: all of them)."""
    parts = x if quantized(x) else (x,)
    return sum((p.shape[1] if n_heads is None else n_heads) * p.shape[3] * (4 if p.dtype == mx.bfloat16 else p.itemsize)
               for p in parts)


def position_bytes(identity: pb.ModelIdentity, n_heads: Optional[int] = None) -> int:
    """Wire bytes of one position's keys (or values) over ``n_heads`` KV heads (default: the
    identity's) in ``identity``'s dtype and KV format (bfloat16 as float32)."""
    itemsize = 4 if identity.dtype == "bfloat16" else np.dtype(_DTYPES[identity.dtype][1]).itemsize
    fmt = KvFormat(identity.kv_bits, identity.kv_group_size if identity.kv_bits else 0)
    return fmt.position_bytes(identity.n_kv_heads if n_heads is None else n_heads, identity.head_dim, itemsize)


def _parse(raw: bytes, identity: pb.ModelIdentity, n: int):
    """``raw`` (one frame's keys or values: ``n`` positions of the identity's heads) as numpy: an
    array ``(heads, n, head_dim)``, or the triple ``(codes, scales, biases)``."""
    wire = np.float32 if _DTYPES[identity.dtype][1] is None else _DTYPES[identity.dtype][1]
    heads, dim = identity.n_kv_heads, identity.head_dim
    if not identity.kv_bits:
        return np.frombuffer(raw, dtype=wire).reshape(heads, n, dim)
    width, groups = dim * identity.kv_bits // 32, dim // identity.kv_group_size
    cut = heads * n * width * 4
    side = heads * n * groups * np.dtype(wire).itemsize
    return (np.frombuffer(raw[:cut], dtype=np.uint32).reshape(heads, n, width),
            np.frombuffer(raw[cut:cut + side], dtype=wire).reshape(heads, n, groups),
            np.frombuffer(raw[cut + side:], dtype=wire).reshape(heads, n, groups))


def kv_frames(cache: Sequence, layers: LayerRange, token_ids: Sequence[int], identity: pb.ModelIdentity,
              epoch: str, uid: str = "") -> Iterator[pb.KvFrame]:
    """The handoff of one stage: ``cache[i]`` (an mlx-lm ``KVCache``, or a quantized one in
    ``identity``'s KV format) holds layer ``layers.start + i`` for the ``len(token_ids)`` positions of
    the prompt of sequence ``uid`` (named in every frame).

    Yields data frames (keys and values ``(n_kv_heads, n, head_dim)`` for positions
    ``[pos0, pos0 + n)``, or their packed triples as they are: :func:`kv_payload`; at most
    :data:`FRAME_BYTES` each), then the last frame with the header.
    Runs on the MLX thread (it reads the cache).  Failpoint ``handoff.send``
    (:mod:`mlxcluster.failpoints`; tests): ``hash``, ``range``, ``epoch``, ``weights`` make that
    field of the header wrong; ``exit`` ends this process before the frame of index 1 (a rank
    dying mid-handoff).

    Raises:
        ValueError: the cache does not hold ``len(token_ids)`` positions for every layer.
    """
    fault = fail_point("handoff.send")
    p = len(token_ids)
    index = total = 0
    for i, c in enumerate(cache):
        keys, values = c.keys_and_values()  # (1, heads, P, head_dim), or triples: up to the offset
        first = keys[0] if quantized(keys) else keys
        if kv_length(keys) != p or first.shape[0] != 1:
            raise ValueError(f"layer {layers.start + i} holds {kv_length(keys)} positions, the prompt {p}")
        run = max(1, FRAME_BYTES // (2 * wire_position_bytes(keys)))
        for pos0 in range(0, p, run):
            end = min(p, pos0 + run)
            frame = pb.KvFrame(index=index, layer=layers.start + i, pos0=pos0, n_tokens=end - pos0,
                               keys=kv_payload(keys, pos0, end), values=kv_payload(values, pos0, end), uid=uid)
            total += len(frame.keys) + len(frame.values)
            index += 1
            if fault == "exit" and frame.index == 1:  # failpoint handoff.send: a rank dying mid-handoff
                os._exit(17)
            yield frame
    last = pb.KvFrame(index=index, last=True, total_frames=index, identity=identity,
                      layers=pb.LayerRangeMsg(start=layers.start, end=layers.end, output=layers.output),
                      token_count=p, token_hash=prompt_hash(token_ids), epoch=epoch, total_bytes=total, uid=uid)
    if fault == "hash":  # failpoint handoff.send: a wrong header field
        last.token_hash ^= 1
    elif fault == "range":
        last.layers.end -= 1
    elif fault == "epoch":
        last.epoch = "stale-" + last.epoch
    elif fault == "weights":
        last.identity.weights = "float16" if last.identity.weights != "float16" else "float32"
    if fault == "exit" and last.index == 1:  # (one data frame: before the last frame)
        os._exit(17)
    yield last


@dataclass(frozen=True)
class Expected:
    """What rank 0 requires of one sender's handoff.

    Attributes:
        rank: the sender.
        layers: the sender's stage in rank 0's route.
        token_count: ``P``, rank 0's own KV length after the prefill.
        token_hash: :func:`prompt_hash` of rank 0's prompt ids.
        identity: rank 0's :class:`ModelIdentity`.
        epoch: rank 0's formation epoch.
    """

    rank: int
    layers: LayerRange
    token_count: int
    token_hash: int
    identity: pb.ModelIdentity
    epoch: str


def _check_header(last: pb.KvFrame, want: Expected, data: List[pb.KvFrame]) -> None:
    who = f"rank {want.rank}'s KV handoff"
    got, mine = last.identity, want.identity
    if (got.kv_bits, got.kv_group_size) != (mine.kv_bits, mine.kv_group_size):
        raise HandoffError(f"{who} holds {kv_format_name(got)}, this rank keeps {kv_format_name(mine)} "
                           f"(--kv-bits / --kv-group-size differ)")
    if last.identity != want.identity:
        diffs = [f"{name} {getattr(got, name)!r} != {getattr(mine, name)!r}"
                 for name in ("digest", "weights", "n_kv_heads", "head_dim", "dtype", "kv_bits", "kv_group_size")
                 if getattr(got, name) != getattr(mine, name)]
        raise HandoffError(f"{who} comes from another model identity: {', '.join(diffs)}")
    r = last.layers
    if (r.start, r.end, r.output) != (want.layers.start, want.layers.end, want.layers.output):
        raise HandoffError(f"{who} holds layers {r.start}:{'output' if r.output else r.end}, "
                           f"the route gives that rank {want.layers}")
    if last.epoch != want.epoch:
        raise HandoffError(f"{who} is from formation epoch {last.epoch!r}, this one is {want.epoch!r} (stale)")
    if last.token_count != want.token_count:
        raise HandoffError(f"{who} holds {last.token_count} positions, rank 0 prefilled {want.token_count}")
    if last.token_hash != want.token_hash:
        raise HandoffError(f"{who} was prefilled from other token ids (hash {last.token_hash:016x}, "
                           f"rank 0's {want.token_hash:016x})")
    if last.total_frames != len(data) or last.index != len(data):
        raise HandoffError(f"{who} announced {last.total_frames} data frames, {len(data)} arrived")
    got_bytes = sum(len(f.keys) + len(f.values) for f in data)
    if last.total_bytes != got_bytes:
        raise HandoffError(f"{who} announced {last.total_bytes} bytes, {got_bytes} arrived")


def assemble(frames: Sequence[pb.KvFrame], want: Expected) -> Dict[int, Tuple[mx.array, mx.array]]:
    """Check one sender's handoff (``frames`` in arrival order) and build its KV cache contents.

    Returns ``{layer: (keys, values)}``, each ``(1, n_kv_heads, P, head_dim)`` in the identity's
    dtype -- or, in a quantized KV format, each the triple ``(codes (1, n_kv_heads, P, head_dim *
    bits / 32) uint32, scales, biases (1, n_kv_heads, P, head_dim / group_size))`` -- for every
    layer of ``want.layers``.

    Raises:
        HandoffError: no last frame, or anything differs from ``want`` -- identity (KV format
            included: ``kv_bits``, ``kv_group_size``), layer range,
            epoch, token count, prompt hash, frame or byte count, a frame out of order or
            duplicated, a layer outside the range, positions not contiguous from 0 to ``P``, a
            payload of the wrong size.  Nothing is returned then: the caller drops the handoff.
    """
    who = f"rank {want.rank}'s KV handoff"
    if not frames or not frames[-1].last:
        raise HandoffError(f"{who} ended without its last frame ({len(frames)} frames arrived)")
    data, last = list(frames[:-1]), frames[-1]
    if any(f.last for f in data):
        raise HandoffError(f"{who} has more than one last frame")
    _check_header(last, want, data)
    ident = want.identity
    if ident.dtype not in _DTYPES:
        raise HandoffError(f"{who}: KV dtype {ident.dtype!r} is not supported")
    if ident.kv_bits and (ident.kv_bits not in KV_BITS or ident.kv_group_size not in GROUP_SIZES
                          or ident.head_dim % ident.kv_group_size):
        raise HandoffError(f"{who}: KV format {ident.kv_bits} bits in groups of {ident.kv_group_size} is not "
                           f"supported for head_dim {ident.head_dim}")
    mx_dtype = _DTYPES[ident.dtype][0]
    heads, dim, p = ident.n_kv_heads, ident.head_dim, want.token_count
    per_position = position_bytes(ident)
    runs: Dict[int, List[Tuple[object, object]]] = {}
    filled = {layer: 0 for layer in range(want.layers.start, want.layers.end + 1)}
    for expected_index, f in enumerate(data):
        if f.index != expected_index:
            raise HandoffError(f"{who}: frame {f.index} arrived where frame {expected_index} belongs")
        if f.layer not in filled:
            raise HandoffError(f"{who}: frame {f.index} carries layer {f.layer}, outside {want.layers}")
        if f.pos0 != filled[f.layer] or f.n_tokens < 1 or f.pos0 + f.n_tokens > p:
            raise HandoffError(f"{who}: frame {f.index} covers positions [{f.pos0}, {f.pos0 + f.n_tokens}) of layer "
                               f"{f.layer}, expected to start at {filled[f.layer]} (P = {p})")
        size = f.n_tokens * per_position
        if len(f.keys) != size or len(f.values) != size:
            raise HandoffError(f"{who}: frame {f.index} carries {len(f.keys)}/{len(f.values)} bytes, "
                               f"expected {size} for ({heads}, {f.n_tokens}, {dim}) {ident.dtype} "
                               f"({kv_format_name(ident)})")
        runs.setdefault(f.layer, []).append((_parse(f.keys, ident, f.n_tokens), _parse(f.values, ident, f.n_tokens)))
        filled[f.layer] += f.n_tokens
    short = [layer for layer, n in filled.items() if n != p]
    if short:
        raise HandoffError(f"{who}: layer {short[0]} has {filled[short[0]]} of {p} positions")

    def join(pieces):  # runs of positions -> (1, heads, P, ...) in the cache's dtypes
        if not ident.kv_bits:
            return mx.array(np.concatenate(pieces, axis=1))[None].astype(mx_dtype)
        codes, scales, biases = zip(*pieces)
        return (mx.array(np.concatenate(codes, axis=1))[None],
                mx.array(np.concatenate(scales, axis=1))[None].astype(mx_dtype),
                mx.array(np.concatenate(biases, axis=1))[None].astype(mx_dtype))

    return {layer: (join([a for a, _ in parts]), join([b for _, b in parts])) for layer, parts in runs.items()}


def expected_senders(route, rank0_epoch: str, token_ids: Sequence[int], identity: pb.ModelIdentity
                     ) -> Mapping[int, Expected]:
    """What rank 0 expects from every other stage's leader for a prompt of ``token_ids``
    (``route``: a :class:`~mlxcluster.model.layout.Route` whose stage 0 is rank 0's)."""
    h, p = prompt_hash(token_ids), len(token_ids)
    return {s.first_rank: Expected(s.first_rank, s.layers, p, h, identity, rank0_epoch)
            for s in route.stages if s.first_rank != 0}


AWAITING_KV, PREFILL, LAST_PREFILL, DECODE = "AWAITING_KV", "PREFILL", "LAST_PREFILL", "DECODE"


class PdError(HandoffError):
    """A K/V stream that its receiver (:class:`KvStream`) refuses (one line: what is wrong)."""


class KvStream:
    """The one receiver of streamed K/V (a pure state machine): a decode rank's view of the
    prefill group's stream (prefill/decode disaggregation), and rank 0's view of one stage's
    ``--local-decode`` handoff alike.

    States move ``AWAITING_KV -> PREFILL -> LAST_PREFILL -> DECODE`` only on the sender's frames:
    the first data frame, the last frame (the ``LAST_PREFILL`` marker with the header), and the
    marker's announced count reached.  Frames may arrive out of order (held until the gap fills:
    the applied index only moves forward), duplicates are dropped (first arrival wins), and
    :meth:`result` runs the one check (:func:`assemble`) before anything is installed: any
    mismatch, an early end or an early marker fails closed with :class:`PdError`.  The shape
    follows seed 004 (producer-triggered transitions; mstar's reorder/drop rules).

    Args:
        uid: the request; a frame of another uid is refused (stale).
        want: what this rank requires (:class:`Expected`: the identity -- with this rank's number
            of KV heads --, the sender's layers, ``P``, the prompt hash, the epoch).
        head0: the first KV head this rank holds.
        who: how errors name the stream (one line each).

    Feed frames in arrival order to :meth:`offer`; once :attr:`state` is ``DECODE``, :meth:`result`
    gives the checked K/V.  :attr:`first_arrival` / :attr:`duplicates` are for reports.
    """

    def __init__(self, uid: str, want: "Expected", head0: int = 0, who: str = "the prefill group's KV stream"):
        self.uid = uid
        self.who = who
        self.want = want
        self.head0 = head0
        self.state = AWAITING_KV
        self.applied = 0                       # data frames applied: indices [0, applied)
        self.duplicates = 0
        self.bytes = 0
        self.first_arrival: Optional[float] = None
        self.marker: Optional[pb.KvFrame] = None
        self._held: Dict[int, pb.KvFrame] = {}  # arrived out of order, waiting for the gap
        self._ordered: List[pb.KvFrame] = []

    def offer(self, frame: pb.KvFrame, now: Optional[float] = None) -> str:
        """Take one frame; returns the new state.

        Raises:
            PdError: a frame of another request, a second marker, a data frame at or beyond the
                announced count, a marker announcing fewer frames than already arrived, a frame
                for other KV heads.
        """
        who = f"{self.who} for {self.uid}"
        if frame.uid != self.uid:
            raise PdError(f"{who} delivered a frame of request {frame.uid!r} (stale)")
        if frame.head0 != self.head0:
            raise PdError(f"{who} sent KV heads from {frame.head0}, this rank holds heads from {self.head0}")
        if self.first_arrival is None:
            self.first_arrival = time.time() if now is None else now
        if frame.last:
            if self.marker is not None:
                if frame == self.marker:
                    self.duplicates += 1
                    return self.state
                raise PdError(f"{who} sent two different LAST_PREFILL markers")
            seen = max([self.applied - 1, *self._held]) + 1
            if frame.total_frames < seen:
                raise PdError(f"{who} announced {frame.total_frames} frames in LAST_PREFILL after {seen} arrived "
                              f"(an early LAST_PREFILL)")
            self.marker = frame
            self.state = LAST_PREFILL
        else:
            i = frame.index
            if self.marker is not None and i >= self.marker.total_frames:
                raise PdError(f"{who} sent frame {i} after LAST_PREFILL announced {self.marker.total_frames} "
                              f"(an early LAST_PREFILL)")
            if i < self.applied or i in self._held:
                self.duplicates += 1  # first arrival wins
                return self.state
            self._held[i] = frame
            while self.applied in self._held:  # the index only moves forward
                f = self._held.pop(self.applied)
                self._ordered.append(f)
                self.bytes += len(f.keys) + len(f.values)
                self.applied += 1
            if self.state == AWAITING_KV:
                self.state = PREFILL
        if self.marker is not None and self.applied == self.marker.total_frames and not self._held:
            self.state = DECODE
        return self.state

    def result(self) -> Tuple[Dict[int, Tuple[mx.array, mx.array]], int]:
        """The checked K/V ``{layer: (keys, values)}`` (each ``(1, n_heads, P, head_dim)``) and the
        first token.

        Raises:
            PdError: the stream is not in ``DECODE`` (it ended early), or the handoff check failed
                (identity, layers, token count or hash, frame or byte count, positions).
        """
        if self.state != DECODE:
            total = self.marker.total_frames if self.marker is not None else "?"
            raise PdError(f"{self.who} for {self.uid} ended in {self.state} after "
                          f"{self.applied} of {total} frames")
        try:
            kv = assemble(self._ordered + [self.marker], self.want)
        except PdError:
            raise
        except HandoffError as exc:
            raise PdError(str(exc).replace(f"rank {self.want.rank}'s KV handoff", self.who))
        return kv, int(self.marker.first_token)

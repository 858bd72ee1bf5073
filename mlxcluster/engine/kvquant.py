"""Quantized KV caches (``--kv-bits 4|8``, ``--kv-group-size``), as mlx-lm's ``QuantizedKVCache``.

A quantized cache holds each layer's keys and values as mlx-lm's quantized triples
``(packed, scales, biases)`` (``mx.quantize``'s affine quantization, MLX's
``mx.quantize`` docs): for K/V ``(B, heads, T, head_dim)`` in dtype ``d``,

* ``packed`` ``(B, heads, T, head_dim * bits / 32)`` uint32 -- ``32 / bits`` codes per word;
* ``scales``, ``biases`` ``(B, heads, T, head_dim / group_size)`` in ``d`` -- one pair per group
  of ``group_size`` consecutive elements along ``head_dim``: ``x ~= scale * code + bias``.

The three arrays share their first three axes (batch row, KV head, position), so every slice
the engine takes of a cache's K/V (a row, a run of positions, a range of KV heads) is the same
slice of each (:func:`kv_slice`, :func:`kv_assign`).  Groups run along ``head_dim`` only, so
each KV head and each position is quantized on its own: a tensor-parallel rank quantizing its
own KV heads holds exactly the bytes a single rank holds for those heads, and a prefix taken
from the prefix cache or a handoff is the same packed data a prefill writes.  Quantization
starts at the first position (mlx-lm's ``quantized_kv_start`` 0), so every topology quantizes
the same values.

mlx-lm's attention (``mlx_lm/models/base.py: scaled_dot_product_attention``) dispatches on
``hasattr(cache, "bits")`` to ``quantized_scaled_dot_product_attention``
(``mx.quantized_matmul`` of the queries with the packed keys, then of the scores with the
packed values), so the models need no change: the caches carry ``bits`` and ``group_size``.

* :class:`SequenceQuantizedKVCache` -- one sequence: mlx-lm's ``QuantizedKVCache`` plus what the
  engine needs of ``KVCache`` (``size``, ``merge`` into a batch, :meth:`~SequenceQuantizedKVCache.write`
  of already quantized K/V).
* :class:`BatchQuantizedKVCache` -- the continuous batch: mlx-lm's left-padded ``BatchKVCache``
  over the triples (``update_and_fetch``, ``finalize``'s roll, ``filter``, ``extend``,
  ``extract``, ``merge``).
* :func:`make_cache` -- a model's per-layer caches in its :class:`KvFormat`: only full-attention
  ``KVCache`` layers are quantized; sliding-window (``RotatingKVCache``) and recurrent
  (``ArraysCache``) layers stay as mlx-lm makes them (as mlx-lm's ``maybe_quantize_kv_cache``
  leaves caches without ``to_quantized``).

The format is a property of the model object a rank runs (:func:`set_format`, from the rank's
``--kv-bits`` / ``--kv-group-size``), so every cache the engine makes for it -- a sequence's, a
batch's, a PD prefill's -- has it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
from mlx.utils import tree_map, tree_reduce
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, dynamic_roll, make_prompt_cache

__all__ = ["KvFormat", "FULL", "KV_BITS", "GROUP_SIZES", "DEFAULT_GROUP_SIZE", "kv_format", "config_head_dim", "format_of",
           "set_format", "make_cache", "SequenceQuantizedKVCache", "BatchQuantizedKVCache", "full_attention",
           "quantized", "kv_length", "kv_slice", "kv_assign", "kv_contiguous", "fill", "bytes_per_token"]

#: the K/V widths ``--kv-bits`` takes (mlx-lm's ``--kv-bits`` choices that ``mx.quantize`` packs in whole bytes)
KV_BITS = (4, 8)
#: the group sizes ``mx.quantize`` supports (MLX 0.32)
GROUP_SIZES = (32, 64, 128)
#: ``--kv-group-size``'s default (mlx-lm's ``kv_group_size``)
DEFAULT_GROUP_SIZE = 64

#: K/V as stored: a full-precision array, or a quantized ``(packed, scales, biases)`` triple
KV = Union[mx.array, Tuple[mx.array, mx.array, mx.array]]


@dataclass(frozen=True)
class KvFormat:
    """How a rank stores K/V: ``bits`` 0 (full precision, the model's activation dtype; ``group_size``
    0) or 4 / 8 (affine quantization in groups of ``group_size`` elements along ``head_dim``)."""

    bits: int = 0
    group_size: int = 0

    @property
    def quantized(self) -> bool:
        return self.bits > 0

    def __str__(self) -> str:
        return f"{self.bits}-bit K/V in groups of {self.group_size}" if self.quantized else "full-precision K/V"

    def position_bytes(self, n_kv_heads: int, head_dim: int, itemsize: int) -> int:
        """Bytes of the keys (or of the values: the same) of one position over ``n_kv_heads`` heads of
        ``head_dim`` elements, the model's K/V dtype ``itemsize`` bytes wide: ``heads x head_dim x
        itemsize`` at full precision, else ``heads x (head_dim x bits / 8 + 2 x head_dim / group_size x
        itemsize)`` (the packed codes, one scale and one bias per group)."""
        if not self.quantized:
            return n_kv_heads * head_dim * itemsize
        return n_kv_heads * (head_dim * self.bits // 8 + 2 * (head_dim // self.group_size) * itemsize)


FULL = KvFormat()


def kv_format(bits: Optional[int], group_size: Optional[int] = None, head_dim: Optional[int] = None) -> KvFormat:
    """The checked :class:`KvFormat` of ``--kv-bits`` / ``--kv-group-size``: ``bits`` ``None`` or 0 is
    full precision (a group size is then ignored); else ``bits`` in :data:`KV_BITS` and
    ``group_size`` (default :data:`DEFAULT_GROUP_SIZE`) in :data:`GROUP_SIZES`, dividing ``head_dim``
    when given.

    Raises:
        ValueError: another width or group size, or a group size that does not divide ``head_dim``
            (one line)."""
    if not bits:
        return FULL
    if bits not in KV_BITS:
        raise ValueError(f"--kv-bits {bits}: choose {' or '.join(map(str, KV_BITS))} (or leave it out: full precision)")
    group_size = DEFAULT_GROUP_SIZE if group_size is None else int(group_size)
    if group_size not in GROUP_SIZES:
        raise ValueError(f"--kv-group-size {group_size}: choose {', '.join(map(str, GROUP_SIZES))}")
    if head_dim is not None and head_dim % group_size:
        raise ValueError(f"--kv-group-size {group_size} does not divide the model's head_dim {head_dim}")
    return KvFormat(int(bits), group_size)


def config_head_dim(config) -> int:
    """``head_dim`` of a ``config.json`` dict (a multimodal model's ``text_config``): its own, else
    ``hidden_size / num_attention_heads``; 0 where the config does not tell."""
    c = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    try:
        return int(c.get("head_dim") or int(c["hidden_size"]) // int(c["num_attention_heads"]))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0


def format_of(model) -> KvFormat:
    """The :class:`KvFormat` of ``model``'s caches (:data:`FULL` unless :func:`set_format` set one)."""
    fmt = getattr(model, "kv_format", None)
    return fmt if isinstance(fmt, KvFormat) else FULL


def set_format(model, fmt: KvFormat) -> None:
    """Make every cache :func:`make_cache` makes for ``model`` of format ``fmt`` -- also for the model a
    pipeline stage wraps (``model.stage.model``: ``--local-decode``'s rank 0 decodes on it)."""
    for m in (model, getattr(getattr(model, "stage", None), "model", None)):
        if m is not None:
            object.__setattr__(m, "kv_format", fmt)  # not an nn.Module child (no parameters)


def quantized(x: Any) -> bool:
    """True for a quantized triple (a tuple or list of three arrays), False for a full-precision array."""
    return isinstance(x, (tuple, list))


def _quantize(x: mx.array, group_size: int, bits: int) -> Tuple[mx.array, mx.array, mx.array]:
    return tuple(mx.quantize(x, group_size=group_size, bits=bits))


def full_attention(cache) -> bool:
    """True for a one-sequence cache of every position (``KVCache``, quantized or not) -- the kind the
    engine batches with row reuse, prefills together, prefix-caches and rolls back."""
    return type(cache) is KVCache or isinstance(cache, SequenceQuantizedKVCache)


def make_cache(model) -> list:
    """``model``'s per-layer caches (mlx-lm's ``make_prompt_cache``), in its :func:`format_of`: each
    full-attention ``KVCache`` becomes a :class:`SequenceQuantizedKVCache` when quantized; other
    kinds stay."""
    caches = make_prompt_cache(model)
    fmt = format_of(model)
    if not fmt.quantized:
        return caches
    return [SequenceQuantizedKVCache(fmt.group_size, fmt.bits) if type(c) is KVCache else c for c in caches]


def bytes_per_token(model, head_dim: int, itemsize: int) -> int:
    """Bytes of K/V one position takes in ``model``'s full-attention caches on this rank (keys and
    values, every layer it holds, its own KV heads: ``self_attn.n_kv_heads`` of each block), in its
    :func:`format_of`; sliding-window and recurrent layers, whose memory does not grow with the
    context, are not counted.  0 where the model's caches cannot be made here."""
    fmt = format_of(model)
    try:
        caches = make_cache(model)
        blocks = list(model.layers)
    except Exception:
        return 0
    total = 0
    for block, c in zip(blocks, caches):
        heads = int(getattr(getattr(block, "self_attn", None), "n_kv_heads", 0) or 0)
        if full_attention(c) and heads:
            total += 2 * fmt.position_bytes(heads, head_dim, itemsize)
    return total


# -- K/V of either kind: slices over (row, head, position) --------------------------------------

def kv_length(x: KV) -> int:
    """Positions (axis 2) of K/V ``x``."""
    return int((x[0] if quantized(x) else x).shape[2])


def kv_slice(x: KV, a: int, b: int, row: Optional[int] = None, heads: Optional[Tuple[int, int]] = None) -> KV:
    """Positions ``[a, b)`` of K/V ``x`` (each array of a triple alike): of row ``row`` only
    (``(1, ...)``), of KV heads ``heads = (h0, h1)`` only, when given; views, not copies."""
    idx = (slice(None) if row is None else slice(row, row + 1),
           slice(None) if heads is None else slice(*heads), slice(a, b))
    return tuple(p[idx] for p in x) if quantized(x) else x[idx]


def kv_assign(dst: KV, a: int, b: int, src: KV, row: Optional[int] = None) -> None:
    """Write ``src`` into positions ``[a, b)`` (of row ``row`` when given) of ``dst``, in place.

    Raises:
        ValueError: one is quantized and the other not."""
    if quantized(dst) != quantized(src):
        raise ValueError("cannot write quantized K/V into a full-precision cache or the reverse")
    idx = (slice(None) if row is None else slice(row, row + 1), slice(None), slice(a, b))
    if quantized(dst):
        for d, s in zip(dst, src):
            d[idx] = s
    else:
        dst[idx] = src


def kv_contiguous(x: KV) -> KV:
    """A contiguous copy of ``x`` (a slice of a batch's buffers held on its own)."""
    return tuple(mx.contiguous(p) for p in x) if quantized(x) else mx.contiguous(x)


def fill(cache, keys: KV, values: KV) -> None:
    """Append ``keys`` / ``values`` computed elsewhere (a prefix cache's, a handoff's, a disk file's) to
    ``cache`` as a prefill would have written them: full precision into a ``KVCache`` (its
    ``update_and_fetch``), quantized triples into a :class:`SequenceQuantizedKVCache` (written as they
    are, never quantized twice).

    Raises:
        ValueError: K/V of another format than the cache's (quantized into full precision, the
            reverse, or other bits or group size)."""
    if isinstance(cache, SequenceQuantizedKVCache):
        if not (quantized(keys) and quantized(values)):
            raise ValueError(f"full-precision K/V cannot fill a cache of {cache.bits}-bit K/V")
        cache.write(keys, values)
    elif quantized(keys) or quantized(values):
        raise ValueError(f"quantized K/V cannot fill a {type(cache).__name__}")
    else:
        cache.update_and_fetch(keys, values)


def _check_triple(x: KV, group_size: int, bits: int) -> None:
    packed, scales, biases = x
    dim = packed.shape[-1] * 32 // bits
    if packed.dtype != mx.uint32 or scales.shape[-1] * group_size != dim or biases.shape != scales.shape \
            or packed.shape[:3] != scales.shape[:3]:
        raise ValueError(f"K/V packed as {packed.dtype} {packed.shape} with scales {scales.shape} are not "
                         f"{bits}-bit in groups of {group_size}")


def _write_at(cache, keys: KV, values: KV, prev: int) -> None:
    """Write the quantized triples ``keys`` / ``values`` (``n`` positions) at position ``prev`` of
    ``cache``'s buffers (``keys`` / ``values`` triples, ``None`` when empty), first growing them by whole
    ``cache.step`` runs of positions where they are too short -- mlx-lm's ``QuantizedKVCache`` growth,
    for one sequence's cache and a batch's alike (the caller moves its own position counters)."""
    n = keys[0].shape[2]
    if cache.keys is None or prev + n > cache.keys[0].shape[2]:
        steps = (cache.step + n - 1) // cache.step * cache.step

        def more(x):
            return mx.zeros((*x.shape[:2], steps, x.shape[3]), dtype=x.dtype)

        if cache.keys is None:
            cache.keys, cache.values = tree_map(more, (tuple(keys), tuple(values)))
        else:
            if prev % cache.step != 0:
                cache.keys, cache.values = tree_map(lambda x: x[..., :prev, :], (cache.keys, cache.values))
            cache.keys, cache.values = tree_map(lambda x: mx.concatenate([x, more(x)], axis=2),
                                                (cache.keys, cache.values))
    for dst, src in ((cache.keys, keys), (cache.values, values)):
        for d, s in zip(dst, src):
            d[..., prev:prev + n, :] = s


class SequenceQuantizedKVCache(QuantizedKVCache):
    """One sequence's quantized KV cache: mlx-lm's ``QuantizedKVCache`` (``keys``/``values`` the
    triples ``(packed (1, heads, capacity, head_dim * bits / 32) uint32, scales, biases (1, heads,
    capacity, head_dim / group_size))``, ``offset`` positions filled, grown by 256 positions) with
    ``size()`` (its positions, which mlx-lm's leaves at 0), ``merge`` into a
    :class:`BatchQuantizedKVCache` and :meth:`write` of already quantized K/V."""

    def size(self) -> int:
        return self.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Quantize and append ``keys`` / ``values`` ``(B, heads, n, head_dim)``; returns the triples of
        every position so far (mlx-lm's ``QuantizedKVCache.update_and_fetch``)."""
        self.write(_quantize(keys, self.group_size, self.bits), _quantize(values, self.group_size, self.bits))
        return self.keys_and_values()

    def write(self, keys: KV, values: KV) -> None:
        """Append already quantized ``keys`` / ``values`` (triples of ``n`` positions) at ``offset``.

        Raises:
            ValueError: triples of other bits or group size."""
        _check_triple(keys, self.group_size, self.bits)
        _check_triple(values, self.group_size, self.bits)
        _write_at(self, keys, values, self.offset)
        self.offset += keys[0].shape[2]

    @classmethod
    def merge(cls, caches: Sequence["QuantizedKVCache"]) -> "BatchQuantizedKVCache":
        return BatchQuantizedKVCache.merge(caches)

    @property
    def nbytes(self) -> int:
        """Bytes of its buffers (codes, scales, biases; growth steps included); 0 when empty."""
        if self.keys is None:
            return 0
        return tree_reduce(lambda a, x: a + x.nbytes, (self.keys, self.values), 0)


class BatchQuantizedKVCache(BatchKVCache):
    """mlx-lm's left-padded ``BatchKVCache`` (one row per sequence; ``left_padding``, per-row ``offset``,
    the write index ``_idx``) over quantized triples: ``keys`` / ``values`` are ``(packed (B, heads,
    capacity, head_dim * bits / 32) uint32, scales, biases (B, heads, capacity, head_dim /
    group_size))``.  Each operation is ``BatchKVCache``'s applied to the three arrays alike; padding
    positions hold zeros (scale and bias 0: the value 0), masked by ``make_mask`` as in
    ``BatchKVCache``.  ``bits`` / ``group_size`` select mlx-lm's quantized attention."""

    def __init__(self, left_padding: List[int], group_size: int = DEFAULT_GROUP_SIZE, bits: int = 8):
        super().__init__(left_padding)
        self.group_size = group_size
        self.bits = bits

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Quantize and append ``keys`` / ``values`` ``(B, heads, n, head_dim)`` at the write index;
        returns the triples of positions ``[0, _idx)``."""
        self._write(_quantize(keys, self.group_size, self.bits), _quantize(values, self.group_size, self.bits))
        return self.keys_and_values()

    def _write(self, keys: KV, values: KV) -> None:
        n = keys[0].shape[2]
        _write_at(self, keys, values, self._idx)
        self.offset = self.offset + n
        self._idx += n

    def keys_and_values(self):
        return tree_map(lambda x: x[..., :self._idx, :], (self.keys, self.values))

    def finalize(self) -> None:
        if self._right_padding is not None:
            padding = self._right_padding
            self.keys, self.values = tree_map(lambda x: dynamic_roll(x, padding[:, None], axis=2),
                                              (self.keys, self.values))
            self.offset = self.offset - padding
            self.left_padding += padding
            self._right_padding = None

    def filter(self, batch_indices) -> None:
        """Keep rows ``batch_indices`` (in place), then shift every row left by the smallest left padding."""
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda x: x[batch_indices], (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())
        if shift > 0:
            if self.keys is not None:
                self.keys, self.values = tree_map(lambda x: x[..., shift:, :], (self.keys, self.values))
            self._idx -= shift
            self.left_padding -= shift

    def extend(self, other: "BatchQuantizedKVCache") -> None:
        """Append ``other``'s rows (in place), both right-aligned at the larger write index."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        ref = self if self.keys is not None else other
        max_idx = max(self._idx, other._idx)
        max_size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def pad(c):
            k, v = c.keys, c.values
            if k is None:
                rows = c.offset.shape[0]
                k, v = tree_map(lambda x: mx.zeros((rows, x.shape[1], 0, x.shape[3]), dtype=x.dtype),
                                (ref.keys, ref.values))
            left = max_idx - c._idx
            right = max_size - k[0].shape[2] - left
            if right < 0:
                k, v = tree_map(lambda x: x[..., :right, :], (k, v))
                right = 0
            if left or right:
                k, v = tree_map(lambda x: mx.pad(x, [(0, 0), (0, 0), (left, right), (0, 0)]), (k, v))
            return k, v, c.offset, c.left_padding + left

        (k1, v1, o1, l1), (k2, v2, o2, l2) = pad(self), pad(other)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(k1, k2))
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(v1, v2))
        self.offset = mx.concatenate([o1, o2])
        self.left_padding = mx.concatenate([l1, l2])
        self._idx = max_idx

    def extract(self, idx: int) -> SequenceQuantizedKVCache:
        """Row ``idx`` as a cache of its own (a contiguous copy of its positions)."""
        cache = SequenceQuantizedKVCache(self.group_size, self.bits)
        mx.eval(self.left_padding)
        padding = self.left_padding.tolist()[idx]
        cache.keys, cache.values = tree_map(lambda x: mx.contiguous(x[idx:idx + 1, :, padding:self._idx]),
                                            (self.keys, self.values))
        cache.offset = self._idx - padding
        return cache

    @classmethod
    def merge(cls, caches: Sequence[QuantizedKVCache]) -> "BatchQuantizedKVCache":
        """One batch of ``caches`` (one-sequence quantized caches of one format, some maybe empty), each
        row right-aligned at the longest one's length (``BatchKVCache.merge``'s layout).

        Raises:
            ValueError: caches of different bits or group sizes."""
        formats = {(c.group_size, c.bits) for c in caches}
        if len(formats) != 1:
            raise ValueError(f"cannot batch quantized caches of different formats {sorted(formats)}")
        (group_size, bits), = formats
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches), group_size, bits)
        padding = [longest - n for n in lengths]
        ref = next(c for c in caches if c.keys is not None)
        keys, values = tree_map(lambda x: mx.zeros((len(caches), x.shape[1], longest, x.shape[3]), dtype=x.dtype),
                                (ref.keys, ref.values))
        for i, (p, c) in enumerate(zip(padding, caches)):
            if c.keys is None:
                continue
            for dst, src in ((keys, c.keys), (values, c.values)):
                for d, s in zip(dst, src):
                    d[i:i + 1, :, p:p + c.offset] = s[..., :c.offset, :]
        cache = cls(padding, group_size, bits)
        cache.keys, cache.values = keys, values
        cache.offset += longest
        cache._idx = longest
        return cache

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return tree_reduce(lambda a, x: a + x.nbytes, (self.keys, self.values), 0)

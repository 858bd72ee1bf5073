"""The continuous batch of one rank (:class:`DecodeBatch`): its sequences' KV caches as one left-padded
``BatchKVCache`` per layer, joins into free rows, leaves, compaction, and the forward passes over it.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from . import passes
from .kvquant import full_attention, kv_assign, kv_slice
from .session import ShardSession


class DecodeBatch:
    """The sequences resident on one rank, decoded together (continuous batching).

    Sequences join after their own prefill (:meth:`add`, :meth:`add_group`) and leave on
    ``sessionStop`` (:meth:`remove`); the batch order (:attr:`sessions`, what :meth:`forward`
    takes and returns) is join order.  A lone sequence keeps its own ``KVCache`` and decodes
    exactly like :meth:`ShardSession.forward`; with two or more, their caches are merged into
    mlx-lm's left-padded ``BatchKVCache`` (one per layer, one row per sequence) and one forward
    pass of shape ``(R, 1)`` advances all of them.

    Joining and leaving such a cache copies all of it (``extend`` pads and concatenates,
    ``filter`` gathers): ~0.5 GB for 32 sequences of ~300 positions of SmolLM2 here.  So a
    leaving sequence's row stays in the cache as a *free row* (decoded alongside on a pad token,
    its output dropped) and a joining sequence whose prompt fits left of the cache's write index
    is written into a free row, right-aligned (its positions and left padding set per row, as
    ``BatchKVCache.merge`` lays rows out): no copy of the others' K/V.  The free rows are
    compacted away (one ``filter``) once more than half the rows are free -- or with the next
    ``extend`` -- which bounds the wasted rows.  Only ``BatchKVCache`` layers reuse rows (and
    :class:`~mlxcluster.engine.kvquant.BatchQuantizedKVCache`, the same over quantized triples, which
    a lone sequence's ``SequenceQuantizedKVCache`` merges into); other caches (sliding-window,
    recurrent) join and leave by copy.  Every rank applies the same
    add/remove/forward sequence and these rules depend on nothing else, so the batches stay
    identical across ranks.
    """

    def __init__(self, model, compute_logits: bool = True):
        self.model = model
        self.compute_logits = compute_logits or bool(getattr(model, "vocab_parallel", False))
        # --afd: sequences keep their own caches, the model runs them as micro-batches (forward_many)
        self.separate = bool(getattr(model, "separate_caches", False))
        self.sessions: List[ShardSession] = []
        self._cache: Optional[list] = None  # per-layer BatchKVCache when len > 1
        self._rows: List[Optional[ShardSession]] = []  # the batch cache's rows: a session, or None (free)
        self._order: Optional[Tuple[Optional[mx.array], Optional[mx.array]]] = None  # see _orders
        self.rows_reused = 0  # joins written into a free row instead of copying the cache
        self.compactions = 0  # left padding every row held, compacted away (_trim_padding)

    def __len__(self) -> int:
        return len(self.sessions)

    @property
    def uids(self) -> List[str]:
        return [s.uid for s in self.sessions]

    @property
    def free_rows(self) -> int:
        """Rows of the batch cache held by no sequence (see the class docstring)."""
        return sum(r is None for r in self._rows)

    def find(self, uid: str) -> Optional[ShardSession]:
        for s in self.sessions:
            if s.uid == uid:
                return s
        return None

    def _reusable(self) -> bool:
        return self._cache is not None and all(isinstance(c, BatchKVCache) for c in self._cache)

    def _compact(self, force: bool = False) -> None:
        """Drop the free rows from the batch cache (one ``filter``: a copy, which also shifts every row
        left by the smallest left padding); ``force``: filter even with no free row (that shift)."""
        keep = [i for i, r in enumerate(self._rows) if r is not None]
        if force or len(keep) < len(self._rows):
            for c in self._cache:
                c.filter(keep)
            self._rows = [self._rows[i] for i in keep]
            self._order = None

    def _write_row(self, row: int, kv: list, length: int) -> None:
        """Write a sequence's K/V of ``length`` positions (per layer ``(keys, values)``, each
        ``(1, heads, length, head_dim)`` or its quantized triple) into free ``row``, right-aligned at
        the write index."""
        for c, (k, v) in zip(self._cache, kv):
            start = c._idx - length
            kv_assign(c.keys, start, c._idx, k, row=row)
            kv_assign(c.values, start, c._idx, v, row=row)
            c.left_padding[row] = start
            c.offset[row] = length

    def _place(self, sessions: List[ShardSession], rows_kv: List[Tuple[list, int]]) -> bool:
        """Write joining ``sessions`` (their per-layer K/V and lengths in ``rows_kv``) into free
        rows, if there are enough and every prompt fits left of the write index; False (nothing
        written) otherwise."""
        free = [i for i, r in enumerate(self._rows) if r is None]
        if not self._reusable() or len(free) < len(sessions) or \
                any(n > self._cache[0]._idx for _, n in rows_kv):
            return False
        for row, session, (kv, n) in zip(free, sessions, rows_kv):
            self._write_row(row, kv, n)
            self._rows[row] = session
        self.rows_reused += len(sessions)
        self._order = None
        return True

    def add(self, session: ShardSession) -> None:
        """Append a prefilled session."""
        session.leave_static()
        for s in self.sessions:
            s.leave_static()
        if self.separate:
            pass
        elif len(self.sessions) == 1:
            first = self.sessions[0]
            # each kind merges into its batch twin: KVCache -> BatchKVCache, RotatingKVCache ->
            # BatchRotatingKVCache (sliding-window layers), ArraysCache (recurrent state), CacheList
            self._cache = [type(a).merge([a, b]) for a, b in zip(first.cache, session.cache)]
            self._rows = [first, session]
            self._order = None
            first.cache = None
            session.cache = None
        elif len(self.sessions) > 1:
            n = session.position
            own = all(full_attention(c) for c in session.cache)
            if not (own and self._place([session], [([(kv_slice(c.keys, 0, n), kv_slice(c.values, 0, n))
                                                      for c in session.cache], n)])):
                self._compact()
                for c, new in zip(self._cache, session.cache):
                    c.extend(type(new).merge([new]))
                self._rows.append(session)
                self._order = None
            session.cache = None
        self.sessions.append(session)

    def add_group(self, sessions: List[ShardSession], cache: list) -> None:
        """Append sessions prefilled together (:func:`~mlxcluster.engine.passes.last_positions`): ``cache`` holds their
        rows, in ``sessions`` order, in one batch cache per layer (each session's own ``cache``
        is unused)."""
        for s in self.sessions:
            s.leave_static()
        if not self.sessions:
            self._cache = cache
            self._rows = list(sessions)
            self._order = None
        else:
            if len(self.sessions) == 1:
                first = self.sessions[0]
                self._cache = [type(c).merge([c]) for c in first.cache]
                self._rows = [first]
                first.cache = None
            placed = False
            if self.free_rows >= len(sessions) and all(isinstance(c, BatchKVCache) for c in cache):
                mx.eval(cache[0].left_padding)
                pads, idx = cache[0].left_padding.tolist(), cache[0]._idx
                placed = self._place(sessions, [([(kv_slice(c.keys, p, idx, row=i), kv_slice(c.values, p, idx, row=i))
                                                  for c in cache], idx - p) for i, p in enumerate(pads)])
            if not placed:
                self._compact()
                for c, new in zip(self._cache, cache):
                    c.extend(new)
                self._rows.extend(sessions)
                self._order = None
        for s in sessions:
            s.cache = None
        self.sessions.extend(sessions)

    def remove(self, uid: str) -> Optional[ShardSession]:
        """Drop a sequence and free its share of the KV cache (its row, see the class docstring)."""
        idx = next((i for i, s in enumerate(self.sessions) if s.uid == uid), None)
        if idx is None:
            return None
        gone = self.sessions.pop(idx)
        if self.separate:
            pass
        elif len(self.sessions) == 1:
            other = self._rows.index(self.sessions[0])
            self.sessions[0].cache = [c.extract(other) for c in self._cache]
            self._cache = None
            self._rows = []
            self._order = None
        elif len(self.sessions) > 1:
            self._rows[self._rows.index(gone)] = None
            self._order = None
            if not self._reusable() or 2 * self.free_rows > len(self._rows):
                self._compact()
            self._trim_padding()
        gone.close()
        return gone

    def _orders(self) -> Tuple[Optional[mx.array], Optional[mx.array]]:
        """``(to_rows, to_batch)`` int32 index arrays: the input index each cache row reads (the
        pad input ``len(sessions)`` for a free row) and the row each session's output is in; both
        ``None`` when rows are in batch order with none free."""
        if self._order is None:
            rows = [self._rows.index(s) for s in self.sessions]
            if rows == list(range(len(self._rows))):
                self._order = (None, None)
            else:
                where = {r: i for i, r in enumerate(rows)}
                pad = len(self.sessions)
                self._order = (mx.array([where.get(r, pad) for r in range(len(self._rows))], dtype=mx.int32),
                               mx.array(rows, dtype=mx.int32))
        return self._order

    def forward(self, x: mx.array) -> mx.array:
        """Queue one decode step: ``x[i]`` (``(B,)`` int32, possibly lazy) is
        fed to ``sessions[i]``.  Returns the lazy logits ``(B, vocab)`` on a
        ``compute_logits`` batch, else the lazy hidden states.  Nothing is
        evaluated here."""
        if len(self.sessions) == 1:  # a lone sequence keeps its own KVCache
            session = self.sessions[0]
            out = session.forward(x.reshape(1, 1))
            return out[None] if session.compute_logits else out
        x = x.reshape(-1)
        if self.separate:
            x = x.reshape(-1, 1)
            out = self.model.forward_many([x[i:i + 1] for i in range(len(self.sessions))],
                                          [s.cache for s in self.sessions])[:, -1]
        else:
            to_rows, to_batch = self._orders()
            if to_rows is not None:  # to cache rows, a pad token (0) for each free row
                x = mx.concatenate([x, mx.zeros((1,), dtype=x.dtype)])[to_rows]
            out = passes.forward(self.model, x.reshape(-1, 1), self._cache, self.compute_logits)
            out = out[:, -1] if self.compute_logits else out
            if to_batch is not None:  # ... and back to batch order
                out = out[to_batch]
        for s in self.sessions:
            s.position += 1
        return out

    def rollback(self, n: int = 1) -> None:
        """Forget the last ``n`` positions of every resident sequence (a
        queued lookahead step of the whole batch)."""
        if len(self.sessions) == 1 or self.separate:
            for s in self.sessions:
                s.rollback(n)
            return
        for c in self._cache:
            c.trim(n)
        for s in self.sessions:
            s.position -= n

    def forward_positions(self, x: mx.array) -> mx.array:
        """Queue one forward pass of ``L`` positions per resident sequence (a speculative verify step):
        ``x`` ``(B, L)`` int32, row i fed to ``sessions[i]`` at its positions ``[position, position +
        L)``.  Returns the lazy logits ``(B, L, vocab)`` on a ``compute_logits`` batch, else the lazy
        hidden states; every session's ``position`` advances by ``L`` (:meth:`keep` rolls back what
        is rejected).  A lone sequence runs on its own ``KVCache``; a batch on its ``BatchKVCache``
        rows (free rows fed the pad token 0, their outputs dropped)."""
        if self.separate:
            raise ValueError("speculative decoding is not built for sequences with separate caches (--afd)")
        L = x.shape[1]
        if len(self.sessions) == 1:
            session = self.sessions[0]
            session.leave_static()
            out = session._forward(x.reshape(1, L))
            session.position += L
            return out
        to_rows, to_batch = self._orders()
        if to_rows is not None:
            x = mx.concatenate([x, mx.zeros((1, L), dtype=x.dtype)])[to_rows]
        out = passes.forward(self.model, x, self._cache, self.compute_logits)
        if to_batch is not None:
            out = out[to_batch]
        for s in self.sessions:
            s.position += L
        return out

    def keep(self, kept: Sequence[int], written: int) -> None:
        """After :meth:`forward_positions` wrote ``written`` positions per sequence, keep the first
        ``kept[i]`` (0 <= kept[i] <= written) of ``sessions[i]`` and forget the rest.

        A lone ``KVCache`` is trimmed.  A ``BatchKVCache`` trims every row alike (one write index),
        so: ``trim(min rejected)``, then each row's further rejected positions become right
        padding that mlx-lm's ``prepare(right_padding=...)`` + ``finalize()`` rolls to the row's
        left (``dynamic_roll`` over the buffer; ``left_padding`` grows and ``offset`` drops by
        it), where the mask hides it -- the mechanism of a batched prefill
        (:func:`~mlxcluster.engine.passes.last_positions`),
        so a row then holds exactly what a sequence decoded one token at a time holds, its keys'
        RoPE positions unchanged.  The roll copies the batch's K/V (one pass over the buffers);
        only when rows' rejections differ.  Free rows are rolled by nothing.  Rows' left padding
        grows by their extra rejections; once the smallest over the occupied rows reaches
        :data:`PAD_SLACK` positions and a quarter of the write index, the cache is
        compacted (:meth:`_trim_padding`).

        Raises:
            ValueError: ``kept`` of another length than the batch, or a count outside ``[0, written]``.
        """
        if len(kept) != len(self.sessions) or any(not 0 <= k <= written for k in kept):
            raise ValueError(f"keep {list(kept)} of {written} positions does not fit a batch of {len(self.sessions)}")
        rejected = [written - int(k) for k in kept]
        if len(self.sessions) == 1:
            if rejected[0]:
                self.sessions[0].rollback(rejected[0])
            return
        least = min(rejected)
        extra = [0] * len(self._rows)
        for s, r in zip(self.sessions, rejected):
            extra[self._rows.index(s)] = r - least
            s.position -= r
        for c in self._cache:
            if least:
                c.trim(least)
            if max(extra) > 0:
                c.prepare(right_padding=extra)
                c.finalize()
        if any(extra):
            self._trim_padding()

    def _trim_padding(self) -> None:
        """Compact the batch cache (``filter``: every row shifted left by the smallest left padding of
        the occupied rows, free rows dropped) once that padding reaches :data:`PAD_SLACK` positions and
        a quarter of the write index.  Every decode step attends over the cache up to its write index,
        padding included, so padding every row holds is work (and memory) for nothing.  It piles up
        two ways: a row that joins is right-aligned at the write index (its prompt left-padded), so
        once the rows that were there first have left, every remaining row holds padding; and rows'
        rejected speculative positions (:meth:`keep`).  The copy costs one pass over the cache
        (~a decode step's K/V reads), and it saves at least a quarter of every later step's."""
        if not self._reusable() or len(self.sessions) < 2:
            return
        pads = self._cache[0].left_padding.tolist()
        slack = min(pads[self._rows.index(s)] for s in self.sessions)
        if slack >= max(PAD_SLACK, self._cache[0]._idx // 4):
            self._compact(force=True)
            self.compactions += 1


#: a batch's KV cache is compacted once every occupied row holds at least this many positions of left
#: padding (and a quarter of the write index): the padding of rows that joined a running batch, and
#: rows' rejected speculative positions, pile up there (:meth:`DecodeBatch._trim_padding`)
PAD_SLACK = 64

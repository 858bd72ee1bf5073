"""One sequence's KV cache on this rank (:class:`ShardSession`): its prefill in chunks, its decode steps,
a KV handoff's install, a rollback, and the compiled greedy step's static buffers.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

from . import passes
from .kvquant import fill, kv_length, make_cache


class ShardSession:
    """KV cache plus position for one session on one rank.

    Args:
        model: a :class:`~mlxcluster.model.tp.LlamaModelTP` shard (or an mlx-lm Llama).
        uid: session id.
        compute_logits: rank 0 computes the output head (logits); ranks N
            stop after the final norm, since their logits would be discarded.
    """

    def __init__(self, model, uid: str, compute_logits: bool = True):
        self.model = model
        self.uid = uid
        # A vocabulary-parallel head holds a collective: every rank runs it.
        self.compute_logits = compute_logits or bool(getattr(model, "vocab_parallel", False))
        self.cache = make_cache(model)  # in the model's KV format (kvquant.set_format)
        self.position = 0  # tokens in the KV cache
        self.compiled = None  # a CompiledGreedyStep for issue_greedy (world size 1)
        self._static = None  # (kv buffers, position array) while issue_greedy runs compiled

    def _forward(self, ids: mx.array, last_only: bool = False) -> mx.array:
        return passes.forward(self.model, ids, self.cache, self.compute_logits, last_only)

    def prefill(self, token_ids: Sequence[int], via=None) -> Optional[mx.array]:
        """Run the prompt through the model in chunks of ``PREFILL_CHUNK_TOKENS``.

        ``via``: run it through this model instead (``--local-decode``: the pipeline, whose
        ``layers`` range of this session's layers it fills; the others stay empty until
        :meth:`install`).  Returns the float logits ``(vocab,)`` of the last prompt position
        on a ``compute_logits`` session, else ``None``.
        """
        ids = mx.array(list(token_ids), dtype=mx.int32)[None]
        n = ids.shape[1]
        out = None
        model, cache = self.model, self.cache
        if via is not None:
            r = via.stage.layers
            self.model, self.cache = via, cache[r.start:r.end + 1]
        try:
            for start in range(0, n, passes.PREFILL_CHUNK_TOKENS):
                out = self._forward(ids[:, start:start + passes.PREFILL_CHUNK_TOKENS], last_only=True)
                if start + passes.PREFILL_CHUNK_TOKENS < n:
                    # the chunk's output too: a pipeline stage's send of its hidden states hangs on it
                    mx.eval([c.state for c in self.cache] + [out])
        finally:
            self.model, self.cache = model, cache
        self.position += n
        if self.compute_logits:
            logits = out[0, -1]
            mx.eval(logits)
            return logits
        mx.eval(out)
        return None

    def install(self, kv) -> None:
        """Fill layers from a KV handoff: ``kv`` maps a layer index to its ``(keys, values)``,
        each ``(1, n_kv_heads, position, head_dim)`` (:func:`mlxcluster.engine.handoff.assemble`), or
        with quantized K/V each the triple of those positions (:mod:`~mlxcluster.engine.kvquant`).

        Raises:
            ValueError: a layer that already holds positions, a length other than :attr:`position`,
                or K/V of another format than the cache's.
        """
        for layer, (k, v) in kv.items():
            c = self.cache[layer]
            if not c.empty() or kv_length(k) != self.position:
                raise ValueError(f"layer {layer}: cannot install {kv_length(k)} positions into a cache of "
                                 f"{c.offset} (the session holds {self.position})")
            fill(c, k, v)  # as a prefill writes it: the same buffer capacity as every other layer

    def forward(self, x: mx.array) -> Optional[mx.array]:
        """Queue one decode step on ``x`` (``(1, 1)`` int32, possibly a lazy
        result still being computed) at index ``self.position``; returns the
        lazy logits ``(vocab,)`` on a ``compute_logits`` session, else the lazy
        hidden state.  Nothing is evaluated here."""
        self.leave_static()
        out = self._forward(x)
        self.position += 1
        return out[0, -1] if self.compute_logits else out

    def step(self, token: int) -> Optional[mx.array]:
        """One decode step on ``token`` at index ``self.position``, evaluated.

        Returns logits ``(vocab,)`` on a ``compute_logits`` session, else ``None``.
        """
        out = self.forward(mx.array([[int(token)]], dtype=mx.int32))
        mx.eval(out)
        return out if self.compute_logits else None

    def issue_greedy(self, token) -> mx.array:
        """Queue one compiled greedy decode step on ``token`` (an int, or a
        lazy scalar ``mx.array`` still being computed) and return its next
        token as a lazy ``(1, 1)`` int32 (not evaluated here).  Needs
        :attr:`compiled` (a :class:`~mlxcluster.engine.compiled.CompiledGreedyStep`);
        only for a group of one rank (no collectives inside the compiled graph).
        """
        from .compiled import grow

        x = token.reshape(1, 1) if isinstance(token, mx.array) else mx.array([[int(token)]], dtype=mx.int32)
        if self._static is None:  # take over the KV cache's buffers
            kv = []
            for c in self.cache:
                kv += [c.keys, c.values]
            self._static = (kv, mx.array([self.position], dtype=mx.int32))
        kv, pos = self._static
        if self.position >= kv[0].shape[2]:
            kv = grow(kv)
        y, pos, kv = self.compiled(x.astype(mx.int32), pos, kv)
        self._static = (kv, pos)
        self.position += 1
        return y

    def leave_static(self) -> None:
        """Hand the compiled step's KV buffers back to the mlx-lm caches."""
        if self._static is None:
            return
        kv, _ = self._static
        self._static = None
        for i, c in enumerate(self.cache):
            c.keys, c.values = kv[2 * i], kv[2 * i + 1]
            c.offset = self.position

    def rollback(self, n: int = 1) -> None:
        """Forget the last ``n`` positions of the KV cache (a speculative step)."""
        self.position -= n
        if self._static is not None:
            kv, _ = self._static
            self._static = (kv, mx.array([self.position], dtype=mx.int32))
            return
        for c in self.cache:
            c.trim(n)

    def close(self) -> None:
        """Free the KV cache."""
        self.cache = None
        self._static = None


def with_prefix(session: "ShardSession", kv: list, n: int) -> None:
    """Start ``session``'s KV cache with ``n`` cached positions (``kv`` from
    :meth:`~mlxcluster.engine.prefix_cache.PrefixCache.take`)."""
    for c, (k, v) in zip(session.cache, kv):
        fill(c, k, v)
    session.position = n

"""One sequence's KV cache and forward passes on one rank, and the decode batch.

Every rank of a tensor-parallel group must run the same sequence of forward
passes with the same shapes (the ``all_sum`` in each layer is a collective), so
rank 0 and ranks N share this one implementation, including the prefill chunk
schedule.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

__all__ = ["ShardSession", "DecodeBatch", "PREFILL_CHUNK_TOKENS"]

# Prompt tokens per prefill forward pass (bounds attention memory to
# heads/N * chunk * context floats per layer); mlx-lm uses 2048 on Metal.
PREFILL_CHUNK_TOKENS = 512


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
        self.cache = make_prompt_cache(model)
        self.position = 0  # tokens in the KV cache
        self.compiled = None  # a CompiledGreedyStep for issue_greedy (world size 1)
        self._static = None  # (kv buffers, position array) while issue_greedy runs compiled

    def _forward(self, ids: mx.array, last_only: bool = False) -> mx.array:
        if not self.compute_logits:
            return self.model.model(ids, cache=self.cache)
        if not last_only:
            return self.model(ids, cache=self.cache)
        # Prefill: run the output head on the last position only (the other
        # positions' logits are never used): saves (L-1) x hidden x vocab MACs.
        h = self.model.model(ids, cache=self.cache)[:, -1:]
        if getattr(self.model.args, "tie_word_embeddings", True):
            return self.model.model.embed_tokens.as_linear(h)
        return self.model.lm_head(h)

    def prefill(self, token_ids: Sequence[int]) -> Optional[mx.array]:
        """Run the prompt through the model in chunks of ``PREFILL_CHUNK_TOKENS``.

        Returns the float logits ``(vocab,)`` of the last prompt position on a
        ``compute_logits`` session, else ``None``.
        """
        ids = mx.array(list(token_ids), dtype=mx.int32)[None]
        n = ids.shape[1]
        out = None
        for start in range(0, n, PREFILL_CHUNK_TOKENS):
            out = self._forward(ids[:, start:start + PREFILL_CHUNK_TOKENS], last_only=True)
            if start + PREFILL_CHUNK_TOKENS < n:
                mx.eval([c.state for c in self.cache])
        self.position = n
        if self.compute_logits:
            logits = out[0, -1]
            mx.eval(logits)
            return logits
        mx.eval(out)
        return None

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
        token as a lazy ``(1, 1)`` int32, already submitted with
        ``mx.async_eval``.  Needs :attr:`compiled` (a
        :class:`~mlxcluster.engine.compiled.CompiledGreedyStep`); only for a
        group of one rank (no collectives inside the compiled graph).
        """
        x = token.reshape(1, 1) if isinstance(token, mx.array) else mx.array([[int(token)]], dtype=mx.int32)
        return self._issue_compiled(x.astype(mx.int32))

    def _issue_compiled(self, x: mx.array) -> mx.array:
        from .compiled import grow

        if self._static is None:  # take over the KV cache's buffers
            kv = []
            for c in self.cache:
                kv += [c.keys, c.values]
            self._static = (kv, mx.array([self.position], dtype=mx.int32))
        kv, pos = self._static
        if self.position >= kv[0].shape[2]:
            kv = grow(kv)
        y, pos, kv = self.compiled(x, pos, kv)
        mx.async_eval(y)
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


class DecodeBatch:
    """The sequences resident on one rank, decoded together (continuous batching).

    Sequences join after their own prefill (:meth:`add`) and leave on
    ``sessionStop`` (:meth:`remove`); the batch order is join order.  A lone
    sequence keeps its own ``KVCache`` and decodes exactly like
    :meth:`ShardSession.step`; with two or more, their caches are merged into
    mlx-lm's left-padded ``BatchKVCache`` (one per layer) and one forward pass
    of shape ``(B, 1)`` advances all of them.  Every rank applies the same
    add/remove/step sequence, so the batches stay identical across ranks.
    """

    def __init__(self, model, compute_logits: bool = True):
        self.model = model
        self.compute_logits = compute_logits or bool(getattr(model, "vocab_parallel", False))
        self.sessions: List[ShardSession] = []
        self._cache: Optional[list] = None  # per-layer BatchKVCache when len > 1

    def __len__(self) -> int:
        return len(self.sessions)

    @property
    def uids(self) -> List[str]:
        return [s.uid for s in self.sessions]

    def find(self, uid: str) -> Optional[ShardSession]:
        for s in self.sessions:
            if s.uid == uid:
                return s
        return None

    def add(self, session: ShardSession) -> None:
        """Append a prefilled session."""
        from mlx_lm.models.cache import BatchKVCache

        session.leave_static()
        for s in self.sessions:
            s.leave_static()
        if len(self.sessions) == 1:
            first = self.sessions[0]
            self._cache = [BatchKVCache.merge([a, b]) for a, b in zip(first.cache, session.cache)]
            first.cache = None
            session.cache = None
        elif len(self.sessions) > 1:
            for c, new in zip(self._cache, session.cache):
                c.extend(BatchKVCache.merge([new]))
            session.cache = None
        self.sessions.append(session)

    def remove(self, uid: str) -> Optional[ShardSession]:
        """Drop a sequence and free its share of the KV cache."""
        idx = next((i for i, s in enumerate(self.sessions) if s.uid == uid), None)
        if idx is None:
            return None
        gone = self.sessions.pop(idx)
        if len(self.sessions) == 1:
            other = 1 - idx
            self.sessions[0].cache = [c.extract(other) for c in self._cache]
            self._cache = None
        elif len(self.sessions) > 1:
            keep = [i for i in range(len(self.sessions) + 1) if i != idx]
            for c in self._cache:
                c.filter(keep)
        gone.close()
        return gone

    def forward(self, x: mx.array) -> mx.array:
        """Queue one decode step: ``x[i]`` (``(B,)`` int32, possibly lazy) is
        fed to ``sessions[i]``.  Returns the lazy logits ``(B, vocab)`` on a
        ``compute_logits`` batch, else the lazy hidden states.  Nothing is
        evaluated here."""
        if len(self.sessions) == 1:  # a lone sequence keeps its own KVCache
            session = self.sessions[0]
            out = session.forward(x.reshape(1, 1))
            return out[None] if session.compute_logits else out
        x = x.reshape(-1, 1)
        if self.compute_logits:
            out = self.model(x, cache=self._cache)[:, -1]
        else:
            out = self.model.model(x, cache=self._cache)
        for s in self.sessions:
            s.position += 1
        return out

    def step(self, tokens: Sequence[int]) -> Optional[mx.array]:
        """One decode step, evaluated: ``tokens[i]`` is fed to ``sessions[i]``.

        Returns logits ``(B, vocab)`` on a ``compute_logits`` batch, else ``None``.
        """
        out = self.forward(mx.array(list(tokens), dtype=mx.int32))
        mx.eval(out)
        logits = self.sessions[0].compute_logits if len(self.sessions) == 1 else self.compute_logits
        return out if logits else None

    def rollback(self, n: int = 1) -> None:
        """Forget the last ``n`` positions of every resident sequence (a
        queued lookahead step of the whole batch)."""
        if len(self.sessions) == 1:
            self.sessions[0].rollback(n)
            return
        for c in self._cache:
            c.trim(n)
        for s in self.sessions:
            s.position -= n

    def clear(self) -> None:
        for s in self.sessions:
            s.close()
        self.sessions = []
        self._cache = None

"""One generation session on one rank: its KV cache and the forward passes.

Every rank of a tensor-parallel group must run the same sequence of forward
passes with the same shapes (the ``all_sum`` in each layer is a collective), so
rank 0 and ranks N share this one implementation, including the prefill chunk
schedule.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

__all__ = ["ShardSession", "PREFILL_CHUNK_TOKENS"]

# Prompt tokens per prefill forward pass (bounds attention memory to
# heads/N * chunk * context floats per layer); mlx-lm uses 2048 on Metal.
PREFILL_CHUNK_TOKENS = 512


class ShardSession:
    """KV cache plus position for one session on one rank.

    Args:
        model: a :class:`~mlxcluster.model.tp.LlamaModelTP` (or mlx-lm Llama).
        uid: session id.
        compute_logits: rank 0 computes the output head (logits); ranks N
            stop after the final norm, since their logits would be discarded.
    """

    def __init__(self, model, uid: str, compute_logits: bool = True):
        self.model = model
        self.uid = uid
        self.compute_logits = compute_logits
        self.cache = make_prompt_cache(model)
        self.position = 0  # tokens in the KV cache

    def _forward(self, ids: mx.array) -> mx.array:
        if self.compute_logits:
            return self.model(ids, cache=self.cache)
        return self.model.model(ids, cache=self.cache)

    def prefill(self, token_ids: Sequence[int]) -> Optional[mx.array]:
        """Run the prompt through the model in chunks of ``PREFILL_CHUNK_TOKENS``.

        Returns the float logits ``(vocab,)`` of the last prompt position on a
        ``compute_logits`` session, else ``None``.
        """
        ids = mx.array(list(token_ids), dtype=mx.int32)[None]
        n = ids.shape[1]
        out = None
        for start in range(0, n, PREFILL_CHUNK_TOKENS):
            out = self._forward(ids[:, start:start + PREFILL_CHUNK_TOKENS])
            if start + PREFILL_CHUNK_TOKENS < n:
                mx.eval([c.state for c in self.cache])
        self.position = n
        if self.compute_logits:
            logits = out[0, -1]
            mx.eval(logits)
            return logits
        mx.eval(out)
        return None

    def step(self, token: int) -> Optional[mx.array]:
        """One decode step on ``token`` at index ``self.position``.

        Returns logits ``(vocab,)`` on a ``compute_logits`` session, else ``None``.
        """
        out = self._forward(mx.array([[token]], dtype=mx.int32))
        self.position += 1
        if self.compute_logits:
            logits = out[0, -1]
            mx.eval(logits)
            return logits
        mx.eval(out)
        return None

    def close(self) -> None:
        """Free the KV cache."""
        self.cache = None


def greedy(logits: mx.array) -> int:
    """Argmax token id of a ``(vocab,)`` logits vector."""
    return int(mx.argmax(logits).item())


def make_token_sampler(temperature: float, top_p: float, seed: int):
    """Return ``f(logits (vocab,)) -> int``: greedy at temperature 0, else
    temperature / nucleus sampling with mlx-lm's sampler and a per-session
    PRNG key derived from ``seed`` (so a seeded session is reproducible)."""
    if temperature <= 0:
        return greedy
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(temp=temperature, top_p=top_p if 0 < top_p < 1 else 0.0)
    state: List[mx.array] = [mx.random.key(seed)]

    def sample(logits: mx.array) -> int:
        state[0], sub = mx.random.split(state[0])
        with _key(sub):
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            return int(sampler(logprobs[None]).item())

    return sample


class _key:
    """Context manager seeding MLX's global PRNG from a key for one call."""

    def __init__(self, key: mx.array):
        self.key = key

    def __enter__(self):
        mx.random.seed(int(mx.random.randint(0, 2**31 - 1, key=self.key).item()))

    def __exit__(self, *exc):
        return False

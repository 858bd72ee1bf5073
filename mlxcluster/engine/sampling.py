"""Token sampling on one rank: greedy, or seeded temperature / nucleus sampling.

Every rank that samples a sequence (rank 0, and ranks N of a self-sampled
sequence) builds the same sampler from the same ``(temperature, top_p, seed)``,
so they draw the same token from the same logits.
"""

from __future__ import annotations

from typing import Callable, List

import mlx.core as mx

__all__ = ["greedy", "make_token_sampler", "Sampler"]

Sampler = Callable[[mx.array], int]


def greedy(logits: mx.array) -> int:
    """Argmax token id of a ``(vocab,)`` logits vector."""
    return int(mx.argmax(logits).item())


def make_token_sampler(temperature: float, top_p: float, seed: int) -> Sampler:
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

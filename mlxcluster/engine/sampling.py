"""Token sampling on one rank: greedy, or seeded temperature / nucleus sampling.

Every rank that samples a sequence (rank 0, and ranks N of a self-sampled
sequence) builds the same sampler from the same ``(temperature, top_p, seed)``,
so they draw the same token from the same logits.  Samplers are lazy: they
return an ``mx.array`` that is part of the step's graph, so a step can be
queued on the token of the step before it (mlx-lm's ``generate_step``).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

__all__ = ["make_token_sampler", "Sampler"]

#: ``f(logits (vocab,) float, index) -> token`` (a lazy uint32 scalar ``mx.array``);
#: ``index`` is the token's ordinal in its sequence (0: the token after the prompt).
Sampler = Callable[[mx.array, int], mx.array]

_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads (seed, index) over 64-bit PRNG seeds


def _greedy(logits: mx.array, index: int = 0) -> mx.array:
    return mx.argmax(logits, axis=-1)


def make_token_sampler(temperature: float, top_p: float, seed: int) -> Sampler:
    """Return a lazy sampler: argmax at ``temperature`` 0, else categorical
    sampling of ``logprobs / temperature`` after mlx-lm's nucleus filter
    (``apply_top_p``, when ``0 < top_p < 1``) -- the chain of mlx-lm's
    ``make_sampler`` -- drawn with the PRNG key of ``(seed, index)``, never
    MLX's global PRNG state: a seeded sequence is reproducible, the same on
    every rank, and independent of batching and of lookahead steps that were
    withdrawn."""
    if temperature <= 0:
        return _greedy
    from mlx_lm.sample_utils import apply_top_p

    nucleus = 0 < top_p < 1

    def sample(logits: mx.array, index: int) -> mx.array:
        key = mx.random.key((int(seed) + (index + 1) * _GOLDEN) % 2**64)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if nucleus:
            logprobs = apply_top_p(logprobs, top_p)
        return mx.random.categorical(logprobs * (1.0 / temperature), key=key)

    return sample

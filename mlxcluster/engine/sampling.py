"""What a sequence's tokens are drawn from: its sampling settings (:class:`Sampling`, read from the wire by
:func:`sampling_of`), the lazy samplers (mlx-lm's filters and temperature, keyed by ``(seed, token index)``)
and the logits processors (:class:`LogitsProcessor`: bias, repetition, presence and frequency penalties).

Pure functions of lazy ``mx.array`` logits: no KV cache, no model here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx

from .speculative import token_key

__all__ = ["Sampler", "greedy", "make_token_logits", "make_token_sampler", "Sampling", "REPETITION_CONTEXT_SIZE",
           "sampling_of", "LogitsProcessor"]

#: ``f(logits (vocab,) float, index) -> token`` (a lazy uint32 scalar ``mx.array``);
#: ``index`` is the token's ordinal in its sequence (0: the token after the prompt).
Sampler = Callable[[mx.array, int], mx.array]


def greedy(logits: mx.array, index: int = 0) -> mx.array:
    """The greedy :data:`Sampler`: the argmax token of ``logits`` (lazy; ``index`` unused)."""
    return mx.argmax(logits, axis=-1)


def make_token_logits(temperature: float, top_p: float = 1.0, top_k: int = 0,
                      min_p: float = 0.0) -> Optional[Callable[[mx.array], mx.array]]:
    """The distribution a sampled sequence draws from: ``f(logits (vocab,) float) -> (vocab,) float32``
    logits whose softmax is it (``-inf`` where a filter removed a token), or ``None`` for greedy
    (``temperature`` <= 0).

    The chain of mlx-lm's ``make_sampler`` (mlx_lm/sample_utils.py), in its order, on ``logprobs =
    logits - logsumexp(logits)``: ``apply_top_p`` (nucleus, when ``0 < top_p < 1``), ``apply_min_p``
    (keep tokens at least ``min_p`` times the most likely's probability, when ``min_p > 0``; ``min_p``
    in [0, 1]), ``apply_top_k`` (the ``top_k`` most likely, when ``0 < top_k < vocab``), then
    ``/ temperature``.  :func:`make_token_sampler` draws from it; speculative verification reads its
    probabilities (the same function, so accepted tokens follow the distribution sampled here)."""
    if temperature <= 0:
        return None
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    nucleus = 0 < top_p < 1
    top_k, min_p = int(top_k), float(min_p)

    def scaled(logits: mx.array) -> mx.array:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if nucleus:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p > 0:
            logprobs = apply_min_p(logprobs, min_p)
        if 0 < top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, top_k)
        return logprobs * (1.0 / temperature)

    return scaled


def make_token_sampler(temperature: float, top_p: float, seed: int, top_k: int = 0, min_p: float = 0.0) -> Sampler:
    """Return a lazy sampler ``f(logits (vocab,) float, index) -> token`` (a uint32 scalar).

    ``temperature`` 0: argmax (the filters cannot change it).  Else categorical sampling of
    :func:`make_token_logits` (mlx-lm's filters, then ``/ temperature``) -- drawn with the PRNG
    key of ``(seed, index)`` (:func:`token_key`; mlx-lm's ``categorical_sampling`` uses MLX's
    global PRNG state instead): a seeded sequence is reproducible, the same on every rank, and
    independent of batching and of lookahead steps that were withdrawn."""
    scaled = make_token_logits(temperature, top_p, top_k, min_p)
    if scaled is None:
        return greedy

    def sample(logits: mx.array, index: int) -> mx.array:
        return mx.random.categorical(scaled(logits), key=token_key(seed, index))

    return sample


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of one sequence: ``temperature`` 0 is greedy; ``top_p``
    in (0, 1) enables nucleus sampling, ``top_k`` > 0 keeps the k most likely tokens and
    ``min_p`` in (0, 1] those at least ``min_p`` times as likely as the most likely
    (mlx-lm's filters, :func:`make_token_sampler`); ``seed`` makes a sampled sequence
    reproducible (the same on every rank that samples it).  ``logit_bias``
    (``((token_id, bias), ...)``, added to the logits), ``presence_penalty`` and
    ``frequency_penalty`` (OpenAI's) and ``repetition_penalty`` (> 0, mlx-lm's, over the last
    ``repetition_context_size`` tokens of prompt + answer; 1.0 or a window of 0: none) are
    logits processors (:class:`LogitsProcessor`).
    ``logprobs``: report each token's log-probability and the ``top_logprobs`` (0..20) most
    likely tokens' (:attr:`SequenceState.last_logprob`); ``grammar``: constrain the tokens to
    this llguidance grammar (:mod:`mlxcluster.engine.constraint`).  These two concern the
    rank that samples (rank 0) only."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    logit_bias: Tuple[Tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: str = ""
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20

    @property
    def repeats(self) -> bool:
        """True when the repetition penalty changes anything (a factor other than 1, a window)."""
        return self.repetition_penalty != 1.0 and self.repetition_context_size > 0

    @property
    def processed(self) -> bool:
        """True when a logits processor applies (then the compiled greedy step does not)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty or self.repeats)


#: mlx-lm's default window of the repetition penalty (``make_logits_processors``), in tokens
REPETITION_CONTEXT_SIZE = 20


def sampling_of(msg) -> Sampling:
    """The :class:`Sampling` a ``Sampling`` message (``mlxcluster_pb2.Sampling``) asks for: the same on
    every rank (``logit_bias`` sorted by token id; an unset ``top_p`` is 1, an unset
    ``repetition_penalty`` 1 and an unset ``repetition_context_size`` :data:`REPETITION_CONTEXT_SIZE`)."""
    return Sampling(msg.temperature, msg.top_p or 1.0, msg.seed, tuple(sorted(msg.logit_bias.items())),
                    msg.presence_penalty, msg.frequency_penalty, msg.logprobs, max(0, msg.top_logprobs),
                    msg.grammar, max(0, msg.top_k), msg.min_p,
                    msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
                    msg.repetition_context_size if msg.HasField("repetition_context_size")
                    else REPETITION_CONTEXT_SIZE)


class LogitsProcessor:
    """The logits processors of one sequence: ``logit_bias``, mlx-lm's repetition penalty and
    OpenAI's presence/frequency penalties, applied in mlx-lm's order (``make_logits_processors``:
    bias, repetition, presence, frequency).

    ``logits (vocab,) -> l = logits + bias``; then mlx-lm's ``make_repetition_penalty`` (CTRL,
    arxiv.org/abs/1909.05858): for each token among the last ``repetition_context_size`` tokens
    of prompt + answer, ``l[j] / penalty`` where ``l[j] >= 0`` else ``l[j] * penalty``; then
    ``l - counts * frequency_penalty - (counts > 0) * presence_penalty``, where ``counts[j]`` is
    how many times token ``j`` was generated so far in this sequence (the prompt does not
    count): OpenAI's formula ("mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) *
    alpha_presence", platform.openai.com/docs/guides/text-generation, parameter details).
    The counts (a ``(vocab,)`` float32 array) and the repetition window (``(<= window,)`` int32
    token ids, starting with the prompt's last tokens) are lazy arrays updated with each sampled
    token (:meth:`record`), so a lookahead step queued on a token not read yet is penalised by
    it; :meth:`rollback` forgets a withdrawn step's token.

    Args:
        sampling: the sequence's :class:`Sampling`.
        prompt: its prompt's token ids (ints): the repetition penalty's first window.
    """

    def __init__(self, sampling: Sampling, prompt: Sequence[int] = ()):
        self.bias_items = tuple(sampling.logit_bias)
        self.presence = float(sampling.presence_penalty)
        self.frequency = float(sampling.frequency_penalty)
        self.bias: Optional[mx.array] = None
        self.counts: Optional[mx.array] = None  # built on first use, sized by the logits
        self.window = int(sampling.repetition_context_size) if sampling.repeats else 0
        self.recent: Optional[mx.array] = None  # the repetition penalty's window of token ids
        self._repeat = None
        if self.window:
            from mlx_lm.sample_utils import make_repetition_penalty

            self._repeat = make_repetition_penalty(float(sampling.repetition_penalty), self.window)
            self.recent = mx.array([int(t) for t in list(prompt)[-self.window:]], dtype=mx.int32)
        self._saved: List[Tuple[Optional[mx.array], Optional[mx.array]]] = []
        self._pending_counts: Optional[List[int]] = None  # primed tokens, counted once the vocabulary is known

    def _init(self, vocab: int) -> None:
        if self.bias is None and self.bias_items:
            ids = mx.array([i for i, _ in self.bias_items], dtype=mx.int32)
            vals = mx.array([b for _, b in self.bias_items], dtype=mx.float32)
            self.bias = mx.zeros((vocab,), dtype=mx.float32).at[ids].add(vals)
        if self.counts is None and (self.presence or self.frequency):
            self.counts = mx.zeros((vocab,), dtype=mx.float32)
            if self._pending_counts:  # a resumed answer's tokens (prime)
                ids = mx.array(self._pending_counts, dtype=mx.int32)
                self.counts = self.counts.at[ids].add(mx.ones(ids.shape, dtype=mx.float32))
                self._pending_counts = None

    def __call__(self, logits: mx.array) -> mx.array:
        self._init(logits.shape[-1])
        out = logits.astype(mx.float32)
        if self.bias is not None:
            out = out + self.bias
        if self.recent is not None:
            out = self._repeat(self.recent, out[None])[0]  # mlx-lm's processor takes (1, vocab)
        if self.counts is not None:
            out = out - self.counts * self.frequency - (self.counts > 0).astype(mx.float32) * self.presence
        return out

    @property
    def counts_tokens(self) -> bool:
        """True when the presence/frequency penalties count the answer's tokens."""
        return bool(self.presence or self.frequency)

    def prime(self, tokens: Sequence[int]) -> None:
        """Count ``tokens`` (int ids: a resumed answer's first tokens, sampled elsewhere) as generated
        by this sequence; the repetition window is left alone (they end the prompt it started from)."""
        if not self.counts_tokens or not tokens:
            return
        self._pending_counts = list(self._pending_counts or []) + [int(t) for t in tokens]

    def record(self, token) -> None:
        """Count a sampled token (an int, or a lazy scalar ``mx.array``)."""
        if self.counts is None and self.recent is None:
            return
        self._saved = self._saved[-1:] + [(self.counts, self.recent)]  # one withdrawable step at most
        if self.counts is not None:
            self.counts = self.counts + (mx.arange(self.counts.shape[0]) == token).astype(mx.float32)
        if self.recent is not None:
            t = (token if isinstance(token, mx.array) else mx.array(int(token))).astype(mx.int32).reshape(1)
            self.recent = mx.concatenate([self.recent, t])[-self.window:]

    def rollback(self) -> None:
        """Forget the last recorded token (a withdrawn lookahead step)."""
        if self._saved:
            self.counts, self.recent = self._saved.pop()

    def snapshot(self) -> tuple:
        """The state :meth:`restore` returns to (lazy arrays are immutable: no copy): a speculative
        step records a draft's tokens to process the positions after them, then restores this and
        records only the tokens verified (:meth:`RankEngine.verify`)."""
        return (self.counts, self.recent, list(self._saved))

    def restore(self, state: tuple) -> None:
        """Return to a :meth:`snapshot`."""
        self.counts, self.recent, saved = state
        self._saved = list(saved)

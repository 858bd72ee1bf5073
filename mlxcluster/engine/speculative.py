"""Speculative decoding at one rank: drafters, verification and the draft-length controller.

A *drafter* proposes up to ``k`` next tokens of a sequence cheaply; the target model scores all of
them in ONE forward pass of ``k + 1`` positions (:meth:`~mlxcluster.engine.decode.RankEngine.verify`),
and the rank that samples keeps the longest acceptable prefix plus one token of its own, so one
step yields 1 .. k + 1 tokens.  A decode step of a memory- and latency-bound model (and of a
tensor-parallel group: one ``all_sum`` round per layer whatever the positions) costs about the same
for 1 position as for 5, which is the gain.

* Verification (pure functions, numpy on the host):

  - :func:`greedy_accept`: greedy requests.  The draft's longest prefix equal to the target's argmax
    at each position, then the target's argmax after it -- exactly the tokens one-at-a-time greedy
    decoding gives (Leviathan et al. 2023, section 2.3, temperature 0).
  - :func:`rejection_accept`: sampled requests.  Speculative sampling (Leviathan, Kalman, Matias,
    "Fast Inference from Transformers via Speculative Decoding", ICML 2023, Algorithm 1; Chen et al.
    2023, "Accelerating Large Language Model Decoding with Speculative Sampling", Algorithm 2): draft
    token ``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection
    the token is drawn from ``norm(max(0, p_i - q_i))`` and the step ends; if all ``k`` are accepted a
    bonus token is drawn from ``p_{k+1}``.  The output then follows ``p`` exactly (Leviathan, Theorem
    3.5; the chi-square test in tests/test_speculative.py checks it).  A deterministic drafter
    (n-gram) has ``q`` one-hot: accept with probability ``p_i(x_i)``, else draw from ``p_i`` with
    ``x_i`` removed and renormalised.

  ``p`` is the distribution the request's own sampler draws from: the engine's logits processors
  (bias, penalties), then :func:`~mlxcluster.engine.sampling.make_token_logits` (mlx-lm's top-p, min-p,
  top-k, temperature) -- the same functions, not a re-implementation.  Randomness is keyed by
  ``(seed, token index)`` (:func:`token_key`): the acceptance uniform of
  token ``i`` by that key xor :data:`ACCEPT_SALT`, a corrected or bonus token ``i`` by the key itself
  (so a bonus token is the very token the plain sampler would draw from the same logits).  Same seed
  and drafts -> same answer at any world size; only rank 0 samples.

* Drafters (:class:`Drafter`: ``propose(context, k) -> list[int]``, optionally with draft
  probabilities), named by :func:`make_drafter` (:func:`parse_draft` checks a name without building
  anything): :class:`NgramDrafter` (``ngram``, prompt lookup); ``model:PATH`` (a draft model with the
  target's tokenizer, on rank 0) and ``layers:N`` (self-speculative: the target's first N layers, its
  final norm and head, LayerSkip), both a :class:`~mlxcluster.engine.drafters.ModelDrafter` over
  weights loaded once per process (:class:`~mlxcluster.engine.drafters.DraftModels`);
  ``remote:HOST:PORT`` (a draft model on a draft node, asked once per plan for the whole batch:
  :mod:`mlxcluster.leader.remote_draft`).

* :class:`AdaptiveK`: the draft length per sequence, from the measured acceptance rate
  (Leviathan et al. 2023, section 3.5: expected tokens per step and the best ``gamma``);
  :func:`batch_draft_length`: the same rule for a decode batch, whose verify step pads every row to
  the longest draft and costs every sequence of the batch its time.

* :class:`SpecStats`: drafted, accepted, steps, tokens per step, acceptance rate.

No MLX graph is built here except the keyed draws; the engine's forward pass and KV rollback are in
:mod:`mlxcluster.engine.decode` (:meth:`~mlxcluster.engine.decode.RankEngine.verify`) and :mod:`mlxcluster.engine.batch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["greedy_accept", "rejection_accept", "residual", "Drafter", "NgramDrafter", "make_drafter", "parse_draft",
           "AdaptiveK", "SpecStats", "Verified", "ACCEPT_SALT", "keyed_uniform", "keyed_categorical",
           "expected_tokens", "batch_draft_length", "token_key", "MAX_DRAFT_TOKENS"]

_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads (seed, index) over 64-bit PRNG seeds


def token_key(seed: int, index: int):
    """The MLX PRNG key of token ``index`` (0-based ordinal in its sequence) of a sequence seeded
    ``seed``: every random draw about that token (its sample,
    :func:`~mlxcluster.engine.sampling.make_token_sampler`; a speculative step's acceptance test and
    corrected or bonus token) derives from it, so a seeded answer is the same on every rank, at every
    world size, with or without batching, lookahead and speculation's draft lengths."""
    import mlx.core as mx

    return mx.random.key((int(seed) + (int(index) + 1) * _GOLDEN) % 2**64)


#: xor'ed into a token's PRNG seed for its acceptance test, so that the uniform is independent of the
#: draw of a corrected or bonus token at the same index (which uses the token's key itself)
ACCEPT_SALT = 0x5EC_0DEC_0DE5_ACCE


@dataclass
class Verified:
    """What one verify step gave one sequence (on the rank that samples it).

    ``tokens``: the tokens emitted, in order (int ids): the accepted prefix of the draft, then the
    corrected or bonus token -- cut after a stop (EOS, ``max_tokens``, a full context), so its last
    token may be a draft token; 1 .. ``drafted + 1`` of them.  ``drafted``: draft tokens verified
    (after the engine clamped the draft to the sequence's limits).  ``accepted``: draft tokens the
    verification accepted (before any stop cut the run).  ``logprobs``: with the request's logprobs,
    one :attr:`~mlxcluster.engine.sequence.SequenceState.last_logprob` entry per emitted token, in
    order (``(logprob, ((token_id, logprob), ...))``); else empty."""

    tokens: List[int]
    drafted: int
    accepted: int
    logprobs: List[tuple] = field(default_factory=list)


# -- verification -----------------------------------------------------------------------------

def greedy_accept(draft: Sequence[int], target: Sequence[int]) -> Tuple[int, List[int]]:
    """Greedy verification: ``target`` holds the target's argmax (int ids) at each of the
    ``len(draft) + 1`` verified positions (position j: the token after the context and ``draft[:j]``).

    Returns ``(a, tokens)``: ``a`` the length of the longest prefix of ``draft`` equal to ``target``,
    ``tokens = draft[:a] + [target[a]]`` (the target's own token after it: the correction, or the
    bonus when all were accepted).  Exactly what ``len(tokens)`` greedy one-token steps give.

    Raises:
        ValueError: ``len(target) != len(draft) + 1``.
    """
    if len(target) != len(draft) + 1:
        raise ValueError(f"{len(target)} target tokens for a draft of {len(draft)}: need {len(draft) + 1}")
    a = 0
    while a < len(draft) and int(draft[a]) == int(target[a]):
        a += 1
    return a, [int(t) for t in draft[:a]] + [int(target[a])]


def residual(p: np.ndarray, q: Optional[np.ndarray], token: int) -> np.ndarray:
    """The distribution to draw from after rejecting draft ``token``: ``norm(max(0, p - q))``
    (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, eq. 1).  ``p``: the target's probabilities
    ``(vocab,)``; ``q``: the drafter's ``(vocab,)``, or ``None`` for a deterministic drafter (q one-hot
    at ``token``: ``p`` without ``token``, renormalised).  float64, sums to 1.  Where ``p - q`` is
    nowhere positive (only when ``p == q``, where no rejection can happen) it is ``p``."""
    p = np.asarray(p, dtype=np.float64)
    if q is None:
        r = p.copy()
        r[int(token)] = 0.0
    else:
        r = np.maximum(p - np.asarray(q, dtype=np.float64), 0.0)
    total = r.sum()
    return r / total if total > 0 else p / p.sum()


def rejection_accept(draft: Sequence[int], p: np.ndarray, q: Optional[np.ndarray], uniforms: Sequence[float],
                     draw: Callable[[int, Optional[np.ndarray]], int]) -> Tuple[int, List[int]]:
    """Speculative sampling of one sequence's step (Leviathan et al. 2023, Algorithm 1).

    Args:
        draft: the ``m`` draft tokens (int ids).
        p: the target's probabilities ``(m + 1, vocab)`` (position j: after the context and
            ``draft[:j]``), each row summing to 1 -- the request's real sampling distribution.
        q: the drafter's probabilities ``(m, vocab)``, or ``None`` (deterministic drafter: one-hot).
        uniforms: ``m`` floats in [0, 1): the acceptance test of draft token j is ``uniforms[j] <
            p[j, x] / q[j, x]`` (i.e. accepted with probability ``min(1, p/q)``).
        draw: ``draw(j, dist)`` -> a token drawn for position j: from ``dist`` ``(vocab,)`` float64
            (the residual after a rejection), or, with ``dist`` ``None``, from ``p[j]`` itself (the
            bonus token; the engine draws it from the sampler's own logits).

    Returns:
        ``(a, tokens)``: ``a`` draft tokens accepted, ``tokens = draft[:a] + [corrected or bonus]``.

    Raises:
        ValueError: shapes that do not fit ``len(draft)``.
    """
    m = len(draft)
    p = np.asarray(p)
    if p.shape[0] != m + 1 or len(uniforms) < m or (q is not None and np.asarray(q).shape[0] != m):
        raise ValueError(f"p {p.shape}, q {None if q is None else np.asarray(q).shape} and {len(uniforms)} "
                         f"uniforms do not fit a draft of {m}")
    for j, x in enumerate(int(t) for t in draft):
        px = float(p[j, x])
        qx = 1.0 if q is None else float(q[j][x])
        if qx > 0 and float(uniforms[j]) < px / qx:
            continue
        return j, [int(t) for t in draft[:j]] + [int(draw(j, residual(p[j], None if q is None else q[j], x)))]
    return m, [int(t) for t in draft] + [int(draw(m, None))]


def keyed_uniform(seed: int, index: int) -> float:
    """The acceptance uniform in [0, 1) of token ``index`` of a sequence seeded ``seed`` (MLX's PRNG,
    keyed by :func:`token_key` of ``seed ^ ACCEPT_SALT``)."""
    import mlx.core as mx

    return float(mx.random.uniform(key=token_key(int(seed) ^ ACCEPT_SALT, index)).item())


def keyed_categorical(logits, seed: int, index: int) -> int:
    """A token drawn from ``logits`` (``(vocab,)`` float, an ``mx.array`` or numpy: unnormalised
    log-probabilities, ``-inf`` excluded) with the key of token ``index`` -- the draw of
    :func:`~mlxcluster.engine.sampling.make_token_sampler`."""
    import mlx.core as mx

    return int(mx.random.categorical(mx.array(logits), key=token_key(seed, index)).item())


# -- drafters ---------------------------------------------------------------------------------

class Drafter:
    """Proposes draft tokens for one sequence.  ``propose(context, k)``: up to ``k`` next tokens (int
    ids, possibly none) after ``context`` (prompt + answer so far, int ids).  A drafter that samples
    its drafts overrides :meth:`propose_with_probs` to give its probabilities too.  ``uses_mlx``: its
    :meth:`propose` runs MLX work (a model forward), so the scheduler calls it on rank 0's MLX thread;
    ``draft_s``: where set, the seconds its last :meth:`propose` spent drafting (the scheduler's
    measure of its cost per draft token; else the call's wall time).  ``batch``: ``None``, or an
    object shared by drafters that are asked together: once per plan, before any :meth:`propose`,
    the scheduler awaits ``batch.prefetch([(drafter, context, k), ...])`` with every drafting
    sequence of the plan whose drafter shares it, and their :meth:`propose` then answers from what
    it fetched (a draft node's one call per plan, :mod:`mlxcluster.leader.remote_draft`)."""

    name = "drafter"
    uses_mlx = False
    draft_s: Optional[float] = None
    batch = None

    def propose(self, context: Sequence[int], k: int) -> List[int]:
        raise NotImplementedError

    def propose_with_probs(self, context: Sequence[int], k: int) -> Tuple[List[int], Optional[np.ndarray]]:
        """``(tokens, q)``: ``q`` ``(len(tokens), vocab)`` float, the distribution each token was
        drawn from, or ``None`` for a deterministic drafter (one-hot)."""
        return self.propose(context, k), None


class NgramDrafter(Drafter):
    """Prompt lookup / n-gram drafting (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``NgramProposer``
    ``prompt_lookup_min``/``max``; transformers' ``prompt_lookup_num_tokens``): for ``n`` from ``max_n``
    down to ``min_n``, find the most recent earlier occurrence of the context's last ``n`` tokens and
    propose the (up to ``k``) tokens that followed it.  No model: it pays where the answer repeats its
    context (code edits, RAG, summaries).  The most recent occurrence (vLLM's and transformers' take
    the first) follows the text being repeated now; where the tokens after it run into the end of the
    context the proposal goes on copying itself (the repeat continues with its period, so a run of
    one token or a short loop still yields ``k`` tokens).  numpy, O(len(context) * max_n) per call."""

    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, not {min_n}..{max_n}")
        self.max_n, self.min_n = int(max_n), int(min_n)

    def propose(self, context: Sequence[int], k: int) -> List[int]:
        ctx = np.asarray(context, dtype=np.int64)
        L = ctx.shape[0]
        if k <= 0:
            return []
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            tail = ctx[L - n:]
            # windows ending before the tail's own last token: starts 0 .. L - n - 1
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:L - 1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                out = [int(t) for t in ctx[start:start + k]]
                while len(out) < k:  # the copy reached the end: it goes on copying itself (period L - start)
                    out.append(out[start + len(out) - L])
                return out
        return []


#: the largest ``--draft-tokens`` (draft tokens verified per step of a sequence): a verify step writes
#: ``1 + k`` positions per sequence of the batch; n-gram drafts past a few tokens are rarely accepted
MAX_DRAFT_TOKENS = 16


def parse_draft(spec: str, option: str = "--draft") -> Tuple[str, str]:
    """Check a ``--draft`` value without building anything: ``(kind, argument)``, kind ``ngram``
    (argument "" or ``MIN-MAX``/``N``), ``model`` (argument: a model reference, an mlx-lm directory or
    a GGUF file, not checked here), ``layers`` (argument: N >= 1 as digits; its upper bound, the
    target's layer count, is rank 0's to check) or ``remote`` (argument ``HOST:PORT``, the port in
    1..65535: a draft node's group, :mod:`mlxcluster.leader.remote_draft`).  ``option``: how the
    caller names the value in errors.

    Raises:
        ValueError: an unknown kind, bad n-gram sizes, ``model:`` without a path, ``layers:`` without
            a positive integer, ``remote:`` without ``HOST:PORT``; one line naming ``option``.
    """
    kind, _, arg = spec.partition(":")
    if kind == "ngram":
        if arg:
            lo, _, hi = arg.partition("-")
            if not lo.isdigit() or not (hi or lo).isdigit() or not 1 <= int(lo) <= int(hi or lo) <= 16:
                raise ValueError(f"{option} {spec!r}: write ngram or ngram:MIN-MAX with 1 <= MIN <= MAX <= 16")
        return kind, arg
    if kind == "model":
        if not arg.strip():
            raise ValueError(f"{option} {spec!r}: write model:PATH (a draft model with the target's tokenizer: "
                             f"an mlx-lm directory or a GGUF file)")
        return kind, arg
    if kind == "layers":
        if not arg.isdigit() or int(arg) < 1:
            raise ValueError(f"{option} {spec!r}: write layers:N with 1 <= N < the model's layer count "
                             f"(the target's first N layers draft)")
        return kind, str(int(arg))
    if kind == "remote":
        host, _, port = arg.rpartition(":")
        if not host.strip() or any(c.isspace() for c in host) or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"{option} {spec!r}: write remote:HOST:PORT (a draft node's group: join --role draft, "
                             f"serve --role draft)")
        return kind, f"{host}:{int(port)}"
    raise ValueError(f"{option} {spec!r}: unknown drafter (ngram, ngram:MIN-MAX, model:PATH, layers:N or "
                     f"remote:HOST:PORT)")


def make_drafter(spec: str, option: str = "--draft", models=None, remote=None) -> Drafter:
    """The drafter a ``--draft`` value names (:func:`parse_draft`), for one sequence: ``ngram`` or
    ``ngram:MIN-MAX`` (n-gram sizes, 1 <= MIN <= MAX <= 16; ``ngram:N`` is ``ngram:N-N``) an
    :class:`NgramDrafter`; ``model:PATH`` and ``layers:N`` a
    :class:`~mlxcluster.engine.drafters.ModelDrafter` with a KV cache of its own over weights that
    ``models`` (rank 0's :class:`~mlxcluster.engine.drafters.DraftModels`) loads once and shares
    (:meth:`~mlxcluster.engine.drafters.DraftModels.drafter`) -- checked here only as far as is cheap
    (N below the target's layer count, the path exists); the load's own checks (the vocabulary)
    come with :meth:`~mlxcluster.engine.drafters.ModelDrafter.load`.  ``remote:HOST:PORT``:
    ``remote(address)``, rank 0's factory of a drafter that asks the draft node's group at
    ``address`` (:class:`~mlxcluster.leader.remote_draft.RemoteDrafter`; the engine speaks no gRPC).
    ``option``: how the caller names the value in errors (``--draft``, ``speculative.draft``).

    Raises:
        ValueError: what :func:`parse_draft` refuses; ``model:``/``layers:`` without ``models`` (they
            run beside the target on rank 0) or refused by its check; ``remote:`` without ``remote``;
            one line naming ``option``.
    """
    kind, arg = parse_draft(spec, option)
    if kind == "ngram":
        if not arg:
            return NgramDrafter()
        lo, _, hi = arg.partition("-")
        return NgramDrafter(max_n=int(hi or lo), min_n=int(lo))
    if kind == "remote":
        if remote is None:
            raise ValueError(f"{option} {spec}: a remote drafter is asked by rank 0's scheduler")
        try:
            return remote(arg)
        except ValueError as exc:
            raise ValueError(f"{option} {spec}: {exc}") from None
    if models is None:
        raise ValueError(f"{option} {spec}: a {kind} drafter runs on rank 0 beside the target model")
    return models.drafter(kind, arg, f"{option} {spec}")


# -- the draft length -------------------------------------------------------------------------

def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens of one verify step of ``k`` drafts at per-token acceptance rate ``alpha``:
    ``(1 - alpha^(k+1)) / (1 - alpha)`` (Leviathan et al. 2023, equation 1; ``k + 1`` at alpha 1)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def batch_draft_length(batch: int, drafting: Sequence[Tuple[float, ...]], cost: float) -> int:
    """The draft length ``m`` of the next decode step of a batch that maximises the batch's tokens per
    unit of time; 0 (a plain step) when no ``m`` beats one.

    A verify step pads every row to ``1 + m`` positions (:meth:`~mlxcluster.engine.decode.RankEngine.verify`),
    so every sequence of the batch waits for it, and each drafting sequence may as well draft ``min(k_i,
    m)`` tokens.  A step where no drafter proposes anything is a plain step whatever ``m``; where some
    does (chance ``P = 1 - prod_i (1 - p_i)``, drafter i proposing with probability ``p_i``), in units of
    a plain step of this batch (``batch`` tokens in time 1) a step of ``m`` yields ``batch + sum_i p_i
    (E(alpha_i, min(k_i, m)) - 1) / P`` tokens (:func:`expected_tokens`; a sequence without a draft
    takes one token) in time ``1 + cost * m + sum_i draft_cost_i * min(k_i, m)``.  Leviathan et al.
    2023's choice of ``gamma`` (section 3.5), for the batch: where the
    measured verify cost grows with the batch (a compute-bound step: every position of every row costs),
    the same acceptance buys less and drafting turns itself down; with one sequence it is
    :meth:`AdaptiveK.best_k`.

    Args:
        batch: sequences in the decode step (>= the drafting ones).
        drafting: per sequence that may draft, ``(alpha, k, draft_cost[, p])``: its acceptance-rate
            estimate, its bound on draft tokens, its drafting time per token relative to a plain step
            of this batch, and how often its drafter proposes anything when asked
            (:attr:`AdaptiveK.proposal_rate`; default 1).
        cost: the time of one more position per row relative to a plain step of this batch (the
            measured ``(verify_s / plain_s - 1) / m`` at this batch size), >= 0.

    Returns:
        ``m`` in ``[0, max k_i]``; ties go to the smaller.
    """
    if not drafting or batch < 1:
        return 0
    rows = [(float(d[0]), int(d[1]), float(d[2]), float(d[3]) if len(d) > 3 else 1.0) for d in drafting]
    top = max(k for _, k, _, _ in rows)
    anyone = 1.0 - float(np.prod([1.0 - min(1.0, max(0.0, p)) for _, _, _, p in rows]))
    if anyone <= 0:
        return 0
    best, best_rate = 0, float(batch)
    for m in range(1, top + 1):
        tokens = batch + sum(p * (expected_tokens(a, min(k, m)) - 1.0) for a, k, _, p in rows) / anyone
        time_ = 1.0 + cost * m + sum(d * min(k, m) for _, k, d, _ in rows)
        if tokens / time_ > best_rate * (1 + 1e-9):
            best, best_rate = m, tokens / time_
    return best


class AdaptiveK:
    """The draft length of one sequence, moved by its measured acceptance rate, within ``[0, max_k]``.

    The rule (Leviathan et al. 2023, section 3.5, "Choosing gamma"): with per-token acceptance rate
    ``alpha`` and a verified position costing ``cost`` of a one-token step, a step of ``k`` drafts
    yields :func:`expected_tokens` ``(alpha, k)`` tokens for ``1 + cost * k`` of time, so the best
    ``k`` maximises ``(1 - alpha^(k+1)) / ((1 - alpha) (1 + cost * k))``; ``k = 0`` (no draft) when
    nothing beats 1.  ``alpha`` is estimated from the verify steps themselves: a step that drafted
    ``d`` and accepted ``a`` shows ``a`` acceptances and, when ``a < d``, one rejection (the run stops
    at the first); the estimate is ``accepted / (accepted + rejections)`` over exponentially decayed
    counts (``decay`` per step; a window of about ``1 / (1 - decay)`` steps), starting from ``prior``
    weighted as ``prior_weight`` observations.  So ``k`` rises on repetitive text and falls to 0 on
    open chat, as vLLM's and mlx-lm's users expect of a fixed ``--num-draft-tokens`` tuned by hand --
    but per sequence and by measurement.  While ``k`` is 0 nothing is measured, so every
    ``probe_every``-th step drafts 1 token again.

    A drafter's own time counts too: ``draft_cost`` (the time of drafting one token relative to a
    one-token decode step, measured by the scheduler; about 0 for n-gram drafting, a model's forward
    for a draft model) is added to ``cost``, so a step of ``k`` drafts costs ``1 + (cost +
    draft_cost) * k``.

    In a batch the scheduler decides for every sequence at once (:func:`batch_draft_length`, probing
    for the whole batch in one step) and sets :attr:`step_k`; :meth:`next_k` then asks for
    ``min(max_k, step_k)``.  :meth:`proposed` counts how often the drafter proposes anything (an
    n-gram drafter often finds nothing in open chat): :attr:`proposal_rate`.

    Args:
        max_k: the bound (``--draft-tokens``), >= 0.
        cost: time of one more verified position relative to a one-token decode step (>= 0).
            Default 0.1.
        draft_cost: time of drafting one token relative to a one-token decode step (>= 0).  Default 0.
    """

    def __init__(self, max_k: int, cost: float = 0.1, decay: float = 0.9, prior: float = 0.5,
                 prior_weight: float = 2.0, probe_every: int = 8, draft_cost: float = 0.0):
        if max_k < 0 or cost < 0 or draft_cost < 0 or not 0 < decay <= 1:
            raise ValueError(f"AdaptiveK needs max_k >= 0, cost >= 0, draft_cost >= 0, 0 < decay <= 1 (got {max_k}, "
                             f"{cost}, {draft_cost}, {decay})")
        self.max_k, self.cost, self.decay, self.probe_every = int(max_k), float(cost), float(decay), int(probe_every)
        self.draft_cost = float(draft_cost)
        self._acc = prior * prior_weight
        self._rej = (1.0 - prior) * prior_weight
        self._idle = 0
        #: the batch's draft length this step (the scheduler's :func:`batch_draft_length`); ``None``:
        #: this sequence decides alone (:meth:`best_k` and its own probes)
        self.step_k: Optional[int] = None
        #: decayed counts of asks for a draft and of those the drafter answered with tokens
        self._asked, self._answered = 1.0, 1.0

    @property
    def alpha(self) -> float:
        """The current estimate of the per-token acceptance rate, in [0, 1]."""
        total = self._acc + self._rej
        return self._acc / total if total > 0 else 0.0

    def best_k(self) -> int:
        """The ``k`` in ``[0, max_k]`` maximising expected tokens per unit of step time (ties: the smaller)."""
        alpha = self.alpha
        best, best_rate = 0, 1.0
        for k in range(1, self.max_k + 1):
            rate = expected_tokens(alpha, k) / (1.0 + (self.cost + self.draft_cost) * k)
            if rate > best_rate + 1e-12:
                best, best_rate = k, rate
        return best

    @property
    def proposal_rate(self) -> float:
        """The fraction of asks for a draft that the drafter answered with tokens (decayed, in (0, 1])."""
        return self._answered / self._asked

    def proposed(self, answered: bool) -> None:
        """Record one ask for a draft: ``answered`` whether the drafter proposed any token."""
        self._asked = self._asked * self.decay + 1.0
        self._answered = self._answered * self.decay + (1.0 if answered else 0.0)

    def next_k(self) -> int:
        """The draft length to ask for this step: ``min(max_k, step_k)`` where the batch decided
        (:attr:`step_k`), else :meth:`best_k` (1 on a probe step while the best is 0)."""
        if self.step_k is not None:
            return min(self.max_k, int(self.step_k))
        k = self.best_k()
        if k == 0 and self.max_k > 0:
            self._idle += 1
            if self._idle >= self.probe_every:
                self._idle = 0
                return 1
        return k

    def update(self, drafted: int, accepted: int) -> None:
        """Record one verify step of this sequence (``drafted`` 0: nothing learned)."""
        if drafted <= 0:
            return
        self._acc = self._acc * self.decay + accepted
        self._rej = self._rej * self.decay + (1.0 if accepted < drafted else 0.0)


@dataclass
class SpecStats:
    """Counters of speculative steps (per engine, or per sequence): ``steps`` verify steps of a
    sequence, ``drafted`` draft tokens verified, ``accepted`` of them accepted, ``tokens`` emitted."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0

    def add(self, v: Verified) -> None:
        self.steps += 1
        self.drafted += v.drafted
        self.accepted += v.accepted
        self.tokens += len(v.tokens)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per verify step of a sequence (0 before any)."""
        return self.tokens / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted, "tokens": self.tokens,
                "acceptance_rate": round(self.acceptance_rate, 4), "tokens_per_step": round(self.tokens_per_step, 4)}

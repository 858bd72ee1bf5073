"""The decode loop's execution side, the same on every rank.

Every rank of a tensor-parallel group runs the same sequence of forward passes
(each layer's ``all_sum`` is a collective), so rank 0 and ranks N drive one
class, :class:`RankEngine`, with the same three operations:

* :meth:`RankEngine.prefill` -- a new sequence: KV cache, chunked prefill, the
  first token sampled (on a rank that samples it), join the decode batch;
* :meth:`RankEngine.step` -- one decode step of every resident sequence
  (continuous batching: mlx-lm's ``BatchKVCache`` once two or more are
  resident), each fed its own last token or the token a frame carries;
  with ``lookahead`` the next step is already queued on the lazy tokens of
  this one before they are read (mlx-lm's ``generate_step`` pipelining);
* :meth:`RankEngine.remove` -- free a sequence's KV cache.

A rank that samples a sequence (rank 0 always; a rank N for a *self-sampled*
lone sequence) applies the one stop rule, :func:`~mlxcluster.protocol.frames.stop_reason`,
after every token, so all ranks stop after the same step.  Lookahead is the
normal shape of a step; only a group of several ranks steps without it, since
a queued step cannot be withdrawn from a collective.  A lone greedy sequence
with lookahead may run as one ``mx.compile``'d function
(:mod:`mlxcluster.engine.compiled`).

No gRPC, no queues, no threads here: the caller owns the one thread that runs
MLX (rank 0's scheduler, a rank N's follower loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence

import mlx.core as mx

from ..protocol.frames import stop_reason
from .sampling import Sampler, make_token_sampler

_GREEDY = make_token_sampler(0.0, 1.0, 0)
from .session import DecodeBatch, ShardSession

__all__ = ["RankEngine", "Sampling", "SequenceState"]


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of one sequence: ``temperature`` 0 is greedy; ``top_p``
    in (0, 1) enables nucleus sampling; ``seed`` makes a sampled sequence
    reproducible (the same on every rank that samples it)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


@dataclass
class SequenceState:
    """One sequence resident on this rank.

    ``sampler`` is ``None`` on a rank that does not sample the sequence (a
    frame-driven rank N: its tokens come in frames).  ``token`` is the next
    decode input (the last token sampled here); ``generated`` counts tokens
    sampled here; ``reason`` is the deterministic stop (``EOS``,
    ``MAX_TOKENS``, ``CONTEXT_FULL``) once reached, else 0.
    """

    session: ShardSession
    sampler: Optional[Sampler]
    eos: frozenset
    max_tokens: int
    generated: int = 0
    token: int = -1
    reason: int = 0


class RankEngine:
    """This rank's resident sequences and the forward passes over them.

    Args:
        model: this rank's shard (:class:`~mlxcluster.model.tp.LlamaModelTP`).
        context_length: maximum tokens in a sequence's KV cache.
        compute_logits: run the output head for sequences this rank does not
            sample (rank 0: True; ranks N: False -- unless the head is
            vocabulary-parallel, whose all_gather every rank must join).
        compile_decode: a lone greedy sequence's step runs as one
            ``mx.compile``'d function over static KV buffers (only for a
            group of one rank: no collective inside the compiled graph).
    """

    def __init__(self, model, context_length: int, compute_logits: bool = True, compile_decode: bool = False):
        self.model = model
        self.context_length = context_length
        self.compute_logits = compute_logits
        self.compile_decode = compile_decode
        self.batch = DecodeBatch(model, compute_logits=compute_logits)
        self.sequences: Dict[str, SequenceState] = {}
        self._compiled = None
        self._pending: Optional[mx.array] = None  # the queued lookahead step's lazy tokens (B,)

    def __len__(self) -> int:
        return len(self.batch)

    @property
    def uids(self) -> List[str]:
        """Resident sequences in batch (join) order."""
        return self.batch.uids

    def get(self, uid: str) -> Optional[SequenceState]:
        return self.sequences.get(uid)

    # -- the three operations ----------------------------------------------------------
    def prefill(self, uid: str, prompt: Sequence[int], sampling: Optional[Sampling] = None,
                eos_token_ids: Iterable[int] = (), max_tokens: int = 0) -> Optional[int]:
        """Prefill ``prompt`` (int token ids) as a new sequence ``uid`` and add it to the batch.

        With ``sampling`` this rank samples the sequence: returns its first
        token (int) and applies the stop rule with ``eos_token_ids`` and
        ``max_tokens``; without it, returns ``None``.
        """
        self.withdraw()
        session = ShardSession(self.model, uid, compute_logits=self.compute_logits or sampling is not None)
        logits = session.prefill(prompt)
        sampler = None if sampling is None else make_token_sampler(sampling.temperature, sampling.top_p,
                                                                   sampling.seed)
        seq = SequenceState(session, sampler, frozenset(int(t) for t in eos_token_ids), max_tokens)
        self.batch.add(session)
        self.sequences[uid] = seq
        return None if sampler is None else self._sample(seq, logits)

    def step(self, tokens: Optional[Sequence[int]] = None, lookahead: bool = False) -> List[Optional[int]]:
        """One decode step of every resident sequence, in batch order.

        Sequence i is fed ``tokens[i]`` (frame-driven) or, when ``tokens`` is
        ``None``, its own last sampled token.  Returns, per sequence, the next
        token sampled here (int), or ``None`` for a sequence this rank does not
        sample.

        ``lookahead`` (a group of one rank, every sequence sampled here): the
        step after this one is queued on this step's lazy tokens before they
        are read, so building its graph (~5 ms of Python per step here)
        overlaps this step's evaluation; the next call only reads it.  Any
        other operation first withdraws it (:meth:`withdraw`).
        """
        seqs = [self.sequences[uid] for uid in self.batch.uids]
        if self._pending is not None:
            y = self._pending  # queued by the previous call on the tokens it returned
        else:
            feed = [s.token for s in seqs] if tokens is None else [int(t) for t in tokens]
            if any(s.sampler is None for s in seqs):  # frame-driven: nothing to sample here
                mx.eval(self.batch.forward(mx.array(feed, dtype=mx.int32)))
                return [None] * len(seqs)
            y = self._issue(seqs, mx.array(feed, dtype=mx.int32), ahead=0)
        self._pending = self._issue(seqs, y, ahead=1) if lookahead else None
        values = y.reshape(-1).tolist()
        for s, t in zip(seqs, values):
            self._record(s, t)
        return values

    def _issue(self, seqs: List[SequenceState], x: mx.array, ahead: int) -> mx.array:
        """Queue a decode step on ``x`` ((B,) int32, maybe lazy) and the
        sampling of its tokens (each sequence's token ``generated + ahead``);
        returns them lazily, submitted with ``mx.async_eval``."""
        if len(seqs) == 1 and self.compile_decode and seqs[0].sampler is _GREEDY:
            session = seqs[0].session
            if session.compiled is None:
                if self._compiled is None:
                    from .compiled import CompiledGreedyStep

                    self._compiled = CompiledGreedyStep(self.model)
                session.compiled = self._compiled
            y = session.issue_greedy(x)
        else:
            logits = self.batch.forward(x)
            y = mx.stack([s.sampler(logits[i], s.generated + ahead) for i, s in enumerate(seqs)]).astype(mx.int32)
        mx.async_eval(y)
        return y

    def remove(self, uid: str) -> int:
        """Free sequence ``uid`` (after withdrawing a lookahead step); returns
        the length of its KV cache (tokens), 0 for an unknown uid."""
        seq = self.sequences.pop(uid, None)
        if seq is None:
            return 0
        self.withdraw()
        position = seq.session.position
        self.batch.remove(uid)
        return position

    def withdraw(self) -> None:
        """Roll back a queued lookahead step of the whole batch, if any."""
        if self._pending is not None:
            mx.eval(self._pending)  # let the queued step finish, then forget its KV entries
            self._pending = None
            self.batch.rollback(1)

    def kv_length(self, seq: SequenceState) -> int:
        """Positions in ``seq``'s KV cache, not counting a queued lookahead step."""
        return seq.session.position - (self._pending is not None)

    # -- sampling and the stop rule ----------------------------------------------------
    def _sample(self, seq: SequenceState, logits: mx.array) -> int:
        token = int(seq.sampler(logits, seq.generated).item())
        self._record(seq, token)
        return token

    def _record(self, seq: SequenceState, token: int) -> None:
        seq.generated += 1
        seq.token = token
        seq.reason = seq.reason or stop_reason(token, seq.generated, self.kv_length(seq), seq.eos,
                                               seq.max_tokens, self.context_length)

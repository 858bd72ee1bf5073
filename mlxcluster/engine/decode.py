"""One rank's step loop (:class:`RankEngine`): admit, prefill, decode and verify steps, remove.

Every rank of a tensor-parallel group runs the same sequence of forward passes
(each layer's ``all_sum`` is a collective), so rank 0 and ranks N drive one
class, :class:`RankEngine`, with the same operations:

* :meth:`RankEngine.admit` -- the one way a sequence joins, its K/V from a source
  (:class:`Compute`: after prefix-cache positions, prefilled by
  :meth:`RankEngine.prefill_chunk` -- one chunk per step for a long prompt -- or
  :meth:`RankEngine.prefill_admitted` -- the rest of several admitted prompts at once, together
  as one batch where allowed (:meth:`RankEngine.prefill` and :meth:`RankEngine.prefill_many`
  are admit + that); :class:`Remote`: prefilled elsewhere, installed by the one install), the
  first token sampled (on the rank that samples), join the decode batch;
* :meth:`RankEngine.step` -- one decode step of every resident sequence
  (continuous batching: mlx-lm's ``BatchKVCache`` once two or more are
  resident), each fed its own last token or the token a frame carries;
  with ``lookahead`` the next step is already queued on the lazy tokens of
  this one before they are read (mlx-lm's ``generate_step`` pipelining);
* :meth:`RankEngine.remove` -- free a sequence's KV cache.

Every rank that samples a sequence (rank 0; in a group whose logits every rank holds -- a
vocabulary-parallel head -- every rank, for sequences without a grammar or a drafter) applies the
one stop rule, :func:`~mlxcluster.protocol.frames.stop_reason`, after every token; the others follow
the tokens rank 0's plans feed.  Lookahead is the normal shape of a step at every world size: in a
group every rank queues the same next step (a queued step's collectives run whether it is kept or
not), as the plan says (``StepPlan.ahead``), and a rank samples it itself, so the next plan's
frame travels while that step computes.  A lone greedy sequence of a one-rank group may run as
one ``mx.compile``'d function (:mod:`mlxcluster.engine.compiled`).

The parts it drives live beside it: the samplers and logits processors
(:mod:`~mlxcluster.engine.sampling`), one sequence's KV cache (:mod:`~mlxcluster.engine.session`)
and state (:mod:`~mlxcluster.engine.sequence`), the continuous batch (:mod:`~mlxcluster.engine.batch`),
the forward passes (:mod:`~mlxcluster.engine.passes`), the prefix cache
(:mod:`~mlxcluster.engine.prefix_cache`) and the K/V sources (:mod:`~mlxcluster.engine.kv_sources`).
No gRPC, no queues, no threads here: the caller owns the one thread that runs MLX (rank 0's
scheduler, a rank N's follower).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from ..protocol.frames import stop_reason
from .batch import DecodeBatch
from .kv_sources import Compute, Remote
from .kvquant import format_of, full_attention, kv_length, kv_slice, make_cache, quantized
from .passes import groupable, last_positions
from .prefix_cache import PREFIX_CACHE_POSITIONS, PrefixCache
from .sampling import LogitsProcessor, Sampling, greedy, make_token_logits, make_token_sampler
from .sequence import SequenceState
from .session import ShardSession, with_prefix
from .speculative import token_key

if TYPE_CHECKING:
    from .speculative import Verified

log = logging.getLogger(__name__)

__all__ = ["RankEngine", "LOOKAHEAD_PROBE_STEPS"]

#: lookahead steps timed per kind of step (compiled lone step, or a graph of ops) before deciding
#: whether queuing the next step overlaps anything (RankEngine.step)
LOOKAHEAD_PROBE_STEPS = 8


def _speculation_refusal(model) -> Optional[str]:
    """Why ``model`` cannot run speculative verify steps (:meth:`RankEngine.verify`), in one line, or
    ``None``: a verify step writes ``k + 1`` positions and rolls the rejected ones back, which needs
    full-attention ``KVCache`` layers (a sliding window's ``RotatingKVCache`` may have overwritten
    what a rollback must restore; a recurrent ``ArraysCache`` cannot forget a step), a model that
    returns every position's logits (a pipeline does when asked, :class:`~mlxcluster.model.pp.PipelinedModel`)
    and one batch cache (not ``--afd``'s separate caches).  (``--local-decode``: rank 0's whole
    ``model`` decodes and verifies alone; its pipeline only prefills.)"""
    if getattr(model, "separate_caches", False):
        return "speculative decoding is not built for --afd (separate caches per sequence)"
    if getattr(model, "last_position_only", False):
        return "speculative decoding needs every position's logits, which this model does not return"
    try:
        caches = make_cache(model)
    except Exception as exc:  # a wrapper whose blocks make caches of their own
        return f"speculative decoding needs the model's KV caches, which it does not make here ({exc})"
    for i, c in enumerate(caches):
        if not full_attention(c):
            return (f"speculative decoding needs KV caches that roll back: layer {i}'s {type(c).__name__} "
                    f"cannot (no speculation for this model)")
    return None


def _trimmable_caches(model) -> bool:
    """True when every layer's cache kind can forget its last position (``KVCache``, quantized or not,
    ``RotatingKVCache``: a sliding window of ``max_size`` loses only the position that left it)."""
    from mlx_lm.models.cache import RotatingKVCache

    try:
        caches = make_cache(model)
    except Exception:  # a wrapper (pipeline, AFD) whose blocks make plain KV caches
        return True
    return all(full_attention(c) or type(c) is RotatingKVCache for c in caches)


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
        prefill_model: ``--local-decode`` (rank 0): prompts are prefilled through this
            pipeline (:class:`~mlxcluster.model.pp.PipelinedModel` over ``model``'s own
            layers), the other stages' K/V arrive by :meth:`install`, and ``model`` (every
            layer) decodes alone.
    """

    def __init__(self, model, context_length: int, compute_logits: bool = True, compile_decode: bool = False,
                 prefill_model=None, tokenizer=None, probe_lookahead: bool = True, read_first: bool = False):
        self.model = model
        # time the first lookahead steps and turn lookahead off where queuing does the work (a group
        # of one rank); in a group lookahead also hides the next plan's flight, so it stays as planned
        self.probe_lookahead = probe_lookahead
        self.tokenizer = tokenizer  # Hugging Face tokenizer: grammars (Sampling.grammar) need it
        self.prefill_model = prefill_model
        self.context_length = context_length
        self.compute_logits = compute_logits
        self.compile_decode = compile_decode
        self.batch = DecodeBatch(model, compute_logits=compute_logits)
        # a queued lookahead step is withdrawn by trimming one position: caches whose state
        # cannot be rolled back (recurrent ArraysCache, ...) decode without lookahead
        self.trimmable = _trimmable_caches(model)
        self.batched_prefill = groupable(model) and prefill_model is None
        # the same models keep earlier prompts' K/V for later prompts (PREFIX_CACHE_POSITIONS 0: none)
        self.prefix = PrefixCache() if self.batched_prefill and PREFIX_CACHE_POSITIONS > 0 else None
        self.sequences: Dict[str, SequenceState] = {}
        self._compiled = None
        self._pending: Optional[mx.array] = None  # the queued lookahead step's lazy tokens (B,)
        #: a lookahead step reads this step's tokens before it queues the next one, which
        #: :meth:`queue_owed` does (see :meth:`step`); the step owed meanwhile: (sequences, tokens)
        self.read_first = read_first
        self._owed: Optional[Tuple[List[SequenceState], mx.array]] = None
        self._lengths = threading.Lock()  # kv_length (another thread's) against queue_owed's build
        # lookahead, per kind of step (True: the compiled lone step): seconds queuing the next step
        # and seconds then waiting for this one's tokens; kinds whose queuing does the work: no lookahead
        self._probes: Dict[bool, List[Tuple[float, float]]] = {True: [], False: []}
        self.lookahead_off: set = set()
        # speculative decoding (verify): why this model cannot (one line), or None
        self.speculative_error: Optional[str] = _speculation_refusal(model)
        self._unverified: Optional[int] = None  # positions a frame-driven verify wrote, until commit
        # sequences prefilled after such a verify step, in the same plan: (uids, their join to the
        # batch), run by commit after the rollback -- the order rank 0's batch saw them in
        self._deferred: List[Tuple[List[str], Callable[[], None]]] = []
        # --pd: sequences whose received K/V is installed, not yet in the batch: rank 0 may still refuse
        # them (another rank's stream failed); they join at join_remote, once that is decided
        self._remote: List[str] = []
        from .speculative import SpecStats

        self.spec_stats = SpecStats()
        from .memory import CacheUpkeep

        self.upkeep = CacheUpkeep()  # a periodic mx.clear_cache() (mlx-lm's), one tick per decode/verify step

    def get(self, uid: str) -> Optional[SequenceState]:
        return self.sequences.get(uid)

    # -- the three operations ----------------------------------------------------------
    def attach_disk(self, disk, agree: Optional[Callable[[int], int]] = None) -> bool:
        """Give this rank's :class:`PrefixCache` the disk tier ``disk``
        (:class:`~mlxcluster.engine.prompt_disk.DiskPrompts`) and, in a group of several ranks,
        ``agree`` (:attr:`PrefixCache.agree`: an ``all_min`` over the group); False (nothing
        attached) where this model keeps no prefix cache."""
        if self.prefix is None:
            return False
        self.prefix.disk, self.prefix.agree = disk, agree
        return True

    def prefix_match(self, prompt: Sequence[int], salt: str = "", disk: bool = True) -> int:
        """Leading positions of ``prompt`` this rank's :class:`PrefixCache` holds under namespace
        ``salt`` (0: none), in memory or (``disk``) on its disk tier."""
        return self.prefix.match(prompt, salt, disk) if self.prefix is not None else 0

    def prefix_lookup(self, prompt: Sequence[int], salt: str = "") -> Tuple[int, bool]:
        """``(n, on_disk)``: :meth:`prefix_match` and whether the positions come from the disk tier
        (:meth:`PrefixCache.lookup`; ``(0, False)`` without a prefix cache)."""
        return self.prefix.lookup(prompt, salt) if self.prefix is not None else (0, False)

    def admit(self, uid: str, prompt: Sequence[int], sampling: Optional[Sampling] = None,
              eos_token_ids: Iterable[int] = (), max_tokens: int = 0,
              source: "Compute | Remote" = Compute(), resumed: Sequence[int] = ()) -> SequenceState:
        """The one way a sequence joins this rank: ``prompt`` (int token ids) as new sequence
        ``uid``, its K/V from ``source``.

        * :class:`Compute`: its KV cache is made and its first ``source.cached`` positions taken
          from the prefix cache; nothing is computed.  The prompt is then prefilled by
          :meth:`prefill_chunk` calls (one per step of rank 0's loop for a long prompt) or by
          :meth:`prefill_admitted` (the rest at once, several prompts together) and the sequence
          joins the decode batch after the chunk that ends it.
        * :class:`Remote`: the K/V is installed, its first token the prefill group's (counted as
          generated where this rank samples it); the sequence joins the decode batch at the next
          :meth:`join_remote` (at the latest before the next decode step), once rank 0 has decided for
          the group whether it decodes -- a sequence rank 0 refuses never joins any rank's batch.

        With ``sampling`` this rank samples the sequence and applies the stop rule with
        ``eos_token_ids`` and ``max_tokens``.  Returns its :class:`SequenceState` (``token``: the
        first token once known).

        ``resumed`` (lossless failover; int token ids, the last ``len(resumed)`` ids of ``prompt``):
        the answer's first tokens, generated by an earlier group; the sequence goes on as if it had
        sampled them itself (:meth:`SequenceState.resume`): its next token is number
        ``len(resumed)`` (the seeded sampler's index), ``max_tokens`` counts them, the
        presence/frequency counts and a grammar include them.  Only with :class:`Compute`.

        Raises:
            KeyError: ``source.cached`` positions of ``prompt`` are not in this rank's prefix cache.
            ValueError: ``uid`` is already resident, the cached positions leave nothing to prefill,
                a remote layer is missing or of another length, ``sampling.grammar`` on a rank
                without a tokenizer, or ``resumed`` that is not the end of ``prompt``, holds an EOS,
                reaches ``max_tokens`` or comes with a :class:`Remote` source.
        """
        if uid in self.sequences:
            raise ValueError(f"sequence {uid!r} is already resident")
        resumed = [int(t) for t in resumed]
        if resumed and (isinstance(source, Remote) or list(prompt[len(prompt) - len(resumed):]) != resumed
                        or len(resumed) >= len(prompt)):
            raise ValueError("resumed tokens must end the prompt of a computed join")
        session = ShardSession(self.model, uid, compute_logits=self.compute_logits or sampling is not None)
        seq = self._sequence(session, sampling, eos_token_ids, max_tokens, prompt, self.tokenizer)
        if resumed:
            seq.resume(resumed)
        if isinstance(source, Remote):
            session.position = len(prompt)
            try:
                self._install(seq, source.kv, join=False)
            except ValueError:
                session.close()
                raise
            self.sequences[uid] = seq
            self._remote.append(uid)
            if seq.sampler is None:
                seq.token = int(source.first_token)
            else:
                if seq.processor is not None:
                    seq.processor.record(int(source.first_token))
                self._record(seq, int(source.first_token))
            return seq
        if not 0 <= source.cached < len(prompt):
            raise ValueError(f"{source.cached} cached positions of a {len(prompt)}-token prompt leave nothing "
                             f"to prefill")
        seq.salt = source.salt
        if source.cached:
            kv = self.prefix.take(prompt, source.cached, source.salt, source.disk)
            if kv:  # fewer positions only where a disk file was refused or, in a group, a rank held fewer
                with_prefix(session, kv, kv_length(kv[0][0]))
        seq.prefilling = True
        self.sequences[uid] = seq
        return seq

    def prefill_chunk(self, uid: str, count: int) -> Optional[int]:
        """Prefill the next ``count`` prompt tokens of admitted sequence ``uid`` (:meth:`admit`),
        those at positions ``[position, position + count)`` of its KV cache, in passes of at most
        ``PREFILL_CHUNK_TOKENS``.  The chunk that ends the prompt keeps the prompt in the prefix
        cache and adds the sequence to the decode batch (with a ``prefill_model``, only once
        :meth:`install` or :meth:`recompute` has filled the other stages' layers); it returns the
        first token (int) where this rank samples the sequence.  Every other call returns ``None``.
        Calls whose chunks start at the same positions compute the same K/V and logits as one
        call over the whole prompt (the same passes, in the same order).

        Raises:
            KeyError: ``uid`` is not resident.
            ValueError: ``uid`` is not being prefilled, or the chunk is empty or runs past the prompt.
        """
        seq = self.sequences[uid]
        session = seq.session
        start = session.position
        if not seq.prefilling:
            raise ValueError(f"sequence {uid!r} is not being prefilled")
        if count < 1 or start + count > len(seq.prompt):
            raise ValueError(f"a chunk of {count} tokens at position {start} does not fit {uid!r}'s "
                             f"{len(seq.prompt)}-token prompt")
        self._withdraw_lookahead()
        logits = session.prefill(seq.prompt[start:start + count], via=self.prefill_model)
        if session.position < len(seq.prompt):
            return None
        seq.prefilling = False
        if self.prefix is not None:
            self.prefix.add(seq.prompt, lambda a, b: [(kv_slice(c.keys, a, b), kv_slice(c.values, a, b))
                                                      for c in session.cache], seq.salt)
        if self.prefill_model is None:
            self._join_batch([uid], lambda: self.batch.add(session))
        return None if seq.sampler is None else self._sample(seq, logits)

    def prefill(self, uid: str, prompt: Sequence[int], sampling: Optional[Sampling] = None,
                eos_token_ids: Iterable[int] = (), max_tokens: int = 0, cached: int = 0) -> Optional[int]:
        """:meth:`admit` ``uid`` (:class:`Compute` after ``cached`` prefix-cache positions) and
        prefill its whole prompt at once (:meth:`prefill_chunk`): returns its first token where
        this rank samples it, else ``None``.

        Raises:
            KeyError, ValueError: as :meth:`admit`.
        """
        seq = self.admit(uid, prompt, sampling, eos_token_ids, max_tokens, Compute(cached))
        return self.prefill_chunk(uid, len(prompt) - seq.session.position)

    def prefill_many(self, items: Sequence[Tuple[str, Sequence[int], Optional[Sampling], Iterable[int], int, int]]
                     ) -> List[Optional[int]]:
        """Admit several new sequences, ``items`` of ``(uid, prompt, sampling, eos_token_ids,
        max_tokens, cached)`` as in :meth:`prefill` (every admit before any prefill), and prefill
        them together (:meth:`prefill_admitted`).  Returns each sequence's first token (int) where
        this rank samples it, else ``None``.

        Raises:
            KeyError, ValueError: as :meth:`admit`.
        """
        for uid, prompt, sampling, eos, max_tokens, cached in items:
            self.admit(uid, prompt, sampling, eos, max_tokens, Compute(cached))
        return self.prefill_admitted([item[0] for item in items], together=True)

    def prefill_admitted(self, uids: Sequence[str], together: bool = False) -> List[Optional[int]]:
        """Prefill the rest of the prompt of each admitted sequence (:meth:`admit` with
        :class:`Compute`) and add them to the batch in that order.

        With ``together``, :attr:`batched_prefill` and two or more sequences, the prompts run
        together: one forward pass of shape ``(G, chunk)`` per chunk instead of G passes (mlx-lm's
        ``BatchGenerator``); else one after another (:meth:`prefill_chunk` over the rest of each).
        Returns each sequence's first token (int) where this rank samples it, else ``None``.  Every
        rank of a group must make the same call (the passes hold collectives).  Together, the
        logits may differ from a lone prefill's in the last bits (other matrix shapes);
        BENCHMARKS.md measures how often that changes a greedy answer.

        Raises:
            KeyError: a uid is not resident.  ValueError: a sequence is not being prefilled.
        """
        seqs = [self.sequences[uid] for uid in uids]
        bad = next((s for s in seqs if not s.prefilling), None)
        if bad is not None:
            raise ValueError(f"sequence {bad.session.uid!r} is not being prefilled")
        if len(seqs) < 2 or not together or not self.batched_prefill:
            return [self.prefill_chunk(s.session.uid, len(s.prompt) - s.session.position) for s in seqs]
        self._withdraw_lookahead()
        sessions = [s.session for s in seqs]
        compute = any(s.compute_logits for s in sessions)
        for s in sessions:
            s.compute_logits = compute
        prompts = [list(s.prompt) for s in seqs]
        # rows of different cached lengths: merged left-padded, then the rest right-padded
        cache = [type(layer[0]).merge(list(layer)) for layer in zip(*(s.cache for s in sessions))]
        logits = last_positions(self.model, [p[s.position:] for p, s in zip(prompts, sessions)], cache,
                                 sessions[0].compute_logits)
        if self.prefix is not None:
            mx.eval(cache[0].left_padding)
            for i, (prompt, pad) in enumerate(zip(prompts, cache[0].left_padding.tolist())):
                self.prefix.add(prompt, lambda a, b: [(kv_slice(c.keys, pad + a, pad + b, row=i),
                                                       kv_slice(c.values, pad + a, pad + b, row=i)) for c in cache],
                                seqs[i].salt)
        for seq, prompt in zip(seqs, prompts):
            seq.session.position = len(prompt)
            seq.prefilling = False
        self._join_batch([s.uid for s in sessions], lambda: self.batch.add_group(sessions, cache))
        sampled = [i for i, s in enumerate(seqs) if s.sampler is not None]
        out: List[Optional[int]] = [None] * len(seqs)
        if sampled:
            y = self._draw([seqs[i] for i in sampled], logits[mx.array(sampled)] if len(sampled) < len(seqs)
                           else logits, ahead=0)
            mx.eval(y, *[a for i in sampled for a in seqs[i].lazy_logprobs(seqs[i].generated)])
            for i, t in zip(sampled, y.tolist()):
                self._record(seqs[i], t)
                out[i] = t
        return out

    def kv_bytes_per_position(self) -> float:
        """Bytes one position of one sequence takes in this rank's KV caches that grow with the
        context (full-attention layers, quantized or not: keys and values, packed codes with their
        scales and biases), over every layer it holds: each layer's buffers' bytes over the rows x
        positions they are allocated for -- not over the positions filled, which a cache's growth in
        steps of 256 positions would inflate ~50x after a 5-token prompt.  Sliding-window and
        recurrent layers (a fixed size) are not counted.  0.0 before a cache is allocated."""
        caches = self.batch._cache if self.batch._cache is not None else \
            next((s.cache for s in self.batch.sessions if s.cache is not None), [])
        total = 0.0
        for c in caches:
            if not (full_attention(c) or isinstance(c, BatchKVCache)) or getattr(c, "keys", None) is None:
                continue
            arrays = [a for x in (c.keys, c.values) for a in (x if quantized(x) else (x,))]
            total += sum(a.nbytes for a in arrays) / (arrays[0].shape[0] * arrays[0].shape[2])
        return total

    def install(self, uid: str, kv) -> None:
        """``--local-decode``: fill admitted ``uid``'s other layers from a checked handoff
        (``{layer: (keys, values)}``, :class:`~mlxcluster.engine.handoff.KvStream`) and add it to
        the batch -- the one install, as :meth:`admit` with :class:`Remote` does.

        Raises:
            ValueError: some layer is still empty afterwards, or already held positions.
        """
        self._install(self.sequences[uid], kv)

    def _install(self, seq: "SequenceState", kv, join: bool = True) -> None:
        """The one install of received K/V: ``kv`` (``{layer: (keys, values)}``) into ``seq``'s
        KV cache, every layer then holding K/V, and (``join``) ``seq`` added to the decode batch.

        Raises:
            ValueError: a layer already held positions, or is still empty afterwards.
        """
        session = seq.session
        session.install(kv)
        empty = [i for i, c in enumerate(session.cache) if c.empty()]
        if empty:
            raise ValueError(f"layers {empty[0]}..{empty[-1]} of {session.uid!r} received no K/V")
        if join:
            self._withdraw_lookahead()
            self._join_batch([session.uid], lambda: self.batch.add(session))

    def join_remote(self, refused: Iterable[str] = ()) -> List[str]:
        """``--pd``: add the sequences whose K/V :meth:`admit` installed from a :class:`Remote` source
        to the decode batch, in admission order, but those in ``refused`` (uids rank 0 refused for the
        group: they only leave).  Rank 0 calls it after the plan that fetched them (its joins and
        chunks run), once it has decided; a rank N at the start of the next plan, after
        :meth:`commit` and before its leaves -- the point of rank 0's batch that follows that plan --
        with the plan's refusals (its leaves of such sequences with reason ``ERROR``).  So every rank
        changes its batch in the same order and never holds a row for a sequence rank 0 refused (its
        removal would leave a free row there that rank 0's batch does not have).  Returns the uids
        added."""
        refused = set(refused)
        added = [u for u in self._remote if u not in refused]
        self._remote = [u for u in self._remote if u in refused]
        for uid in added:
            session = self.sequences[uid].session
            self._withdraw_lookahead()
            self._join_batch([uid], lambda session=session: self.batch.add(session))
        return added

    @staticmethod
    def _sequence(session: ShardSession, sampling: Optional[Sampling], eos_token_ids: Iterable[int],
                  max_tokens: int, prompt: Sequence[int], tokenizer=None) -> SequenceState:
        """Raises ValueError: ``sampling.grammar`` on a rank without a tokenizer."""
        sampler = None if sampling is None else make_token_sampler(sampling.temperature, sampling.top_p,
                                                                   sampling.seed, sampling.top_k, sampling.min_p)
        seq = SequenceState(session, sampler, frozenset(int(t) for t in eos_token_ids), max_tokens)
        seq.prompt = list(prompt)
        seq.sampling = sampling
        if sampling is None:
            return seq
        if sampling.processed:
            seq.processor = LogitsProcessor(sampling, prompt)
        if sampling.logprobs:
            seq.top_logprobs = max(0, int(sampling.top_logprobs))
        if sampling.grammar:
            if tokenizer is None:
                raise ValueError("this rank has no tokenizer to constrain decoding with")
            from .constraint import Constraint

            seq.constraint = Constraint(tokenizer, sampling.grammar, sorted(seq.eos))
        return seq

    def recompute(self, uid: str) -> None:
        """``--local-decode`` fallback: drop whatever ``uid``'s KV cache holds, prefill its
        prompt again through every layer of this rank's model (the same chunks as a
        single-rank run), and add it to the batch.  Its first token stays the one already
        sampled (the pipeline's logits are the whole model's, bit for bit)."""
        seq = self.sequences[uid]
        session = ShardSession(self.model, uid, compute_logits=True)
        session.prefill(seq.prompt)
        seq.session = session
        self.withdraw()
        self.batch.add(session)

    def step(self, tokens: Optional[Sequence[int]] = None, lookahead: bool = False,
             exact: bool = False, defer: bool = False) -> List[Optional[int]]:
        """One decode step of every resident sequence, in batch order.

        Sequence i is fed ``tokens[i]`` (frame-driven) or, when ``tokens`` is
        ``None``, its own last sampled token.  Returns, per sequence, the next
        token sampled here (int), or ``None`` for a sequence this rank does not
        sample (then no sequence of the batch is sampled here: the step is frame-driven).

        ``lookahead``: the step after this one is queued on this step's lazy tokens before they
        are read (mlx-lm's ``generate_step`` pipelining), so building its graph overlaps this
        step's evaluation -- and, in a group, the next plan's flight over the control link --; the
        next call only reads it.  Any other operation first withdraws it (:meth:`withdraw`) unless
        :meth:`settle` keeps it.  Without ``exact`` it is a wish that :meth:`look_ahead` decides
        (a group of one rank); with ``exact`` (a group: every rank must queue the same step, since
        a queued step's collectives run whether it is kept or not) it is the plan's decision, made
        by rank 0 with :meth:`look_ahead`.  In a group of one rank the first
        :data:`LOOKAHEAD_PROBE_STEPS` lookahead steps of each kind (the compiled lone step, a
        graph of ops) are timed, and a kind whose queuing took longer than the wait that followed
        decodes without lookahead from then on (MLX's CPU backend runs a large graph's
        ``async_eval`` nearly to the end before returning, BENCHMARKS.md issue 17).

        A sequence this rank samples although another rank's token was fed last
        (:attr:`SequenceState.awaits_token`) takes ``tokens[i]`` as its last token first.

        With :attr:`read_first` (a group on MLX's CPU backend, where queuing a decode step runs it:
        its collectives complete inside ``mx.async_eval``, 10.2 of a 10.7 ms TP=2 step measured here,
        BENCHMARKS.md issue 42) a lookahead step reads this step's tokens first and owes the next
        one: queued before this call returns, or with ``defer`` by :meth:`queue_owed`, which rank 0
        runs on the MLX thread without waiting for it, so that its next plan goes out over the
        control link while the step computes.  Where queuing returns at once (Metal) mlx-lm's order
        (queue, then read) keeps the device busy instead; the tokens are the same either way.

        Raises:
            ValueError: ``exact`` lookahead for a batch this rank cannot look ahead on.
        """
        self._check_committed()
        self.queue_owed()
        self.upkeep.tick()
        if self._remote:  # received K/V not yet joined (a single engine driven directly): now
            self.join_remote()
        seqs = [self.sequences[uid] for uid in self.batch.uids]
        if self._pending is not None:
            y = self._pending  # queued by the previous call on the tokens it returned
        else:
            feed = [s.token for s in seqs] if tokens is None else [int(t) for t in tokens]
            self._adopt(seqs, feed)
            if any(s.sampler is None for s in seqs):  # frame-driven: nothing to sample here
                if lookahead and exact:
                    raise ValueError("a lookahead step for a batch this rank does not sample whole")
                mx.eval(self.batch.forward(mx.array(feed, dtype=mx.int32)))
                for s in seqs:
                    s.awaits_token = s.sampler is not None  # rank 0's token is in the next plan's feed
                return [None] * len(seqs)
            y = self._issue(seqs, mx.array(feed, dtype=mx.int32), ahead=0)
        kind = self._compiled_path(seqs)
        if exact:
            ahead = lookahead
            if ahead and not self._can_look_ahead(seqs):
                raise ValueError("a lookahead step for a batch this rank cannot look ahead on")
        else:
            ahead = self.look_ahead(lookahead)
        if ahead and self.read_first:
            with self._lengths:
                self._pending = None  # read below; the next one is owed
            values = y.reshape(-1).tolist()
            for s, t in zip(seqs, values):
                self._record(s, t)
            self._owed = (seqs, y)  # the next step samples token ``generated`` now (recorded above)
            if not defer:
                self.queue_owed()
            return values
        t0 = time.perf_counter()
        self._pending = self._issue(seqs, y, ahead=1) if ahead else None
        t1 = time.perf_counter()
        values = y.reshape(-1).tolist()
        if ahead and self.probe_lookahead and len(self._probes[kind]) < LOOKAHEAD_PROBE_STEPS:
            self._probe(kind, t1 - t0, time.perf_counter() - t1)
        for s, t in zip(seqs, values):
            self._record(s, t)
        return values

    def _can_look_ahead(self, seqs: List[SequenceState]) -> bool:
        """Whether a step of ``seqs`` can queue the next one here: caches that roll back, every
        sequence sampled here, no grammar (its next mask needs this step's token on the host)."""
        return (bool(seqs) and self.trimmable and all(s.sampler is not None for s in seqs)
                and not any(s.constraint is not None for s in seqs))

    def look_ahead(self, lookahead: bool = True) -> bool:
        """Whether the next decode step of the batch, asked to with ``lookahead``, queues the step
        after it (:meth:`step`): rank 0 decides a plan's ``ahead`` with it, before the step runs."""
        seqs = [self.sequences[uid] for uid in self.batch.uids]
        return (lookahead and self._can_look_ahead(seqs)
                and not (self.probe_lookahead and self._compiled_path(seqs) in self.lookahead_off))

    def _adopt(self, seqs: List[SequenceState], feed: Sequence[int]) -> None:
        """Sequences sampled here whose last token another rank sampled (:attr:`SequenceState.awaits_token`)
        record ``feed``'s token as theirs (stop rule, processor counts), so their next draw has the
        right index and history."""
        for s, t in zip(seqs, feed):
            if s.awaits_token:
                s.awaits_token = False
                if s.processor is not None:
                    s.processor.record(int(t))
                self._record(s, int(t))

    def expected_tokens(self, settled: bool = False) -> Dict[str, int]:
        """The token each sequence of the batch that this rank samples (and whose last token it
        knows) will feed to the next decode step: its last token, or with ``settled`` the token of
        the queued lookahead step, which the plan keeps first (:meth:`settle`).  A plan's decode
        entries must feed these (``Follower.check``): a difference means the ranks disagree."""
        seqs = [(uid, self.sequences[uid]) for uid in self.batch.uids]
        values = self._pending.reshape(-1).tolist() if settled and self._pending is not None else None
        out = {}
        for i, (uid, s) in enumerate(seqs):
            if s.sampler is not None and not s.awaits_token:
                out[uid] = int(values[i]) if values is not None else s.token
        return out

    def _probe(self, kind: bool, queued_s: float, waited_s: float) -> None:
        """Time one lookahead step of ``kind``; after :data:`LOOKAHEAD_PROBE_STEPS`, turn lookahead
        off for the kind if queuing took longer than waiting (median)."""
        probes = self._probes[kind]
        probes.append((queued_s, waited_s))
        if len(probes) == LOOKAHEAD_PROBE_STEPS:
            queued = sorted(q for q, _ in probes)[len(probes) // 2]
            waited = sorted(w for _, w in probes)[len(probes) // 2]
            if queued > waited:
                self.lookahead_off.add(kind)
            log.info("lookahead for %s: queuing the next step took %.1f ms, the wait after it %.1f ms "
                     "(median of %d): %s", "the compiled step" if kind else "uncompiled steps", queued * 1e3,
                     waited * 1e3, len(probes), "off" if kind in self.lookahead_off else "on")

    def _compiled_path(self, seqs: List[SequenceState]) -> bool:
        """Whether :meth:`_issue` runs ``seqs`` as the compiled greedy step.  Not with quantized K/V
        (``--kv-bits``): :class:`~mlxcluster.engine.compiled.CompiledGreedyStep` attends over static
        full-precision buffers; such a sequence decodes on its quantized cache uncompiled."""
        return (len(seqs) == 1 and self.compile_decode and seqs[0].sampler is greedy and seqs[0].plain
                and getattr(self.model, "compilable", False) and not format_of(self.model).quantized)

    def queue_owed(self) -> None:
        """Queue the lookahead step a :attr:`read_first` :meth:`step` owes, if any (on the MLX thread;
        every operation on the batch does so first).  Its graph is built under the lock
        :meth:`kv_length` reads under, then submitted with ``mx.async_eval`` outside it."""
        if self._owed is None:
            return
        with self._lengths:
            seqs, y = self._owed
            self._owed = None
            self._pending = self._build(seqs, y, ahead=0)
        self._submit(seqs, self._pending, ahead=0)

    def _issue(self, seqs: List[SequenceState], x: mx.array, ahead: int) -> mx.array:
        """Queue a decode step on ``x`` ((B,) int32, maybe lazy) and the
        sampling of its tokens (each sequence's token ``generated + ahead``);
        returns them lazily, submitted with ``mx.async_eval``."""
        y = self._build(seqs, x, ahead)
        self._submit(seqs, y, ahead)
        return y

    @staticmethod
    def _submit(seqs: List[SequenceState], y: mx.array, ahead: int) -> None:
        """``mx.async_eval`` of a step's lazy tokens ``y`` with each sequence's lazy log-probabilities
        of that token (``generated + ahead``)."""
        mx.async_eval(y, *[a for s in seqs for a in s.lazy_logprobs(s.generated + ahead)])

    def _build(self, seqs: List[SequenceState], x: mx.array, ahead: int) -> mx.array:
        """The lazy tokens ``(B,)`` of a decode step of ``seqs`` on ``x`` (:meth:`_issue`, unsubmitted)."""
        if self._compiled_path(seqs):
            session = seqs[0].session
            if session.compiled is None:
                if self._compiled is None:
                    from .compiled import CompiledGreedyStep

                    self._compiled = CompiledGreedyStep(self.model)
                session.compiled = self._compiled
            y = session.issue_greedy(x)
        else:
            y = self._draw(seqs, self.batch.forward(x), ahead)
        return y

    @staticmethod
    def _draw(seqs: List[SequenceState], logits: mx.array, ahead: int) -> mx.array:
        """The lazy tokens ``(B,)`` int32 of ``seqs`` from their ``logits`` ``(B, vocab)`` (each
        sequence's token ``generated + ahead``): one argmax over the batch when every sequence
        is plain greedy, else each sequence's own :meth:`SequenceState.draw`."""
        if all(s.sampler is greedy and s.plain for s in seqs):
            return mx.argmax(logits, axis=-1).astype(mx.int32)
        return mx.stack([s.draw(logits[i], s.generated + ahead) for i, s in enumerate(seqs)]).astype(mx.int32)

    # -- speculative decoding: one forward over each sequence's draft -------------------------
    def clamp_draft(self, uid: str, draft: Sequence[int]) -> List[int]:
        """The part of ``draft`` (int ids) a verify step of sequence ``uid`` may run: none for a
        grammar-constrained sequence (its mask needs each token on the host before the next: it
        decodes one token per step, its draft ignored) or one that has stopped; at most ``max_tokens
        - generated - 1`` tokens (every emitted token counts) and ``context_length - 2 - kv length``
        (a verify step writes ``1 + len(draft)`` positions; one-at-a-time decoding stops once the KV
        cache holds ``context_length - 1``).  Rank 0 clamps before it sends a draft to ranks N.

        Raises:
            KeyError: ``uid`` is not resident.
        """
        s = self.sequences[uid]
        if s.constraint is not None or s.reason:
            return []
        room = self.context_length - 2 - self.kv_length(s)
        if s.sampler is not None and s.max_tokens:
            room = min(room, s.max_tokens - s.generated - 1)
        return [int(t) for t in draft[:max(0, room)]]

    def verify(self, drafts: Sequence[Sequence[int]], tokens: Optional[Sequence[int]] = None
               ) -> Optional[List["Verified"]]:
        """One speculative step of every resident sequence, in batch order, as ONE forward pass.

        Sequence i is fed its last token (``tokens[i]`` when given, else its own) followed by
        ``drafts[i]`` (int ids, possibly empty: it takes one token, as :meth:`step` would), right-padded
        with token 0 to ``L = 1 + max len(draft)`` positions: a ``(B, L)`` forward pass
        (:meth:`DecodeBatch.forward_positions`) whose logits ``(B, L, vocab)`` score every draft token.

        On the rank that samples (rank 0; every sequence sampled here): each draft is first clamped
        (:meth:`clamp_draft`), then verified (:mod:`mlxcluster.engine.speculative`): greedy requests by
        :func:`greedy_accept` (the output equals one-at-a-time greedy decoding token for token),
        sampled ones by speculative rejection sampling (:func:`rejection_accept`) on the distribution
        the sequence's sampler draws from -- its logits processors (bias, penalties) applied at each
        position as if the draft before it were accepted, then mlx-lm's filters and temperature
        (:func:`make_token_logits`) -- keyed by ``(seed, token index)``.  The stop rule applies token by
        token: a stop inside the accepted run ends the sequence there.  The processors' counts, the
        repetition window and the log-probabilities (``last_logprob`` of each token, as :meth:`step`
        records them) see exactly the emitted tokens.  Every row then keeps ``len(tokens)`` of its
        ``L`` positions (its last input and the accepted draft tokens; :meth:`DecodeBatch.keep`):
        the KV caches hold what one-at-a-time decoding would.  Returns one :class:`Verified` per
        sequence (:attr:`spec_stats` counts them).

        Frame-driven (a rank N: some sequence not sampled here): ``tokens`` and ``drafts`` come from
        rank 0's plan (already clamped there); the forward pass runs (the same collectives as rank
        0's) and ``None`` is returned.  Its ``L`` positions stay written until :meth:`commit` is
        given each row's kept count, which rank 0 learns only after this step (the next plan carries
        it).  Until then only prefills run (the same plan's joins and chunks: their collectives are
        rank 0's now), their sequences joining the batch at :meth:`commit`; every other operation
        refuses to run.

        A queued lookahead step is withdrawn first (its token was never recorded: the drafts are
        about the tokens recorded so far); a verify step itself queues nothing ahead.

        Raises:
            ValueError: this model cannot speculate (:attr:`speculative_error`, one line: caches that
                cannot roll back, ``--afd``), drafts or tokens of another length than the
                batch, no ``tokens`` on a frame-driven rank, or an uncommitted verify step.
        """
        if self.speculative_error is not None:
            raise ValueError(self.speculative_error)
        self._check_committed()
        self.upkeep.tick()
        if self._remote:  # received K/V not yet joined (a single engine driven directly): now
            self.join_remote()
        self.withdraw()
        uids = self.batch.uids
        seqs = [self.sequences[uid] for uid in uids]
        if len(drafts) != len(seqs) or (tokens is not None and len(tokens) != len(seqs)):
            raise ValueError(f"{len(drafts)} drafts and {None if tokens is None else len(tokens)} tokens for a "
                             f"batch of {len(seqs)}")
        frame_driven = any(s.sampler is None for s in seqs)
        if frame_driven and tokens is None:
            raise ValueError("a rank that does not sample verifies the tokens of rank 0's plan")
        drafts = [[int(t) for t in d] for d in drafts] if frame_driven else \
            [self.clamp_draft(uid, d) for uid, d in zip(uids, drafts)]
        first = [s.token for s in seqs] if tokens is None else [int(t) for t in tokens]
        self._adopt(seqs, first)
        L = 1 + max((len(d) for d in drafts), default=0)
        x = mx.array([[t] + d + [0] * (L - 1 - len(d)) for t, d in zip(first, drafts)], dtype=mx.int32)
        before = [s.session.position for s in seqs]
        out = self.batch.forward_positions(x)
        if frame_driven:
            mx.eval(out)
            self._unverified = L
            for s in seqs:
                s.awaits_token = s.sampler is not None  # rank 0's tokens: the next plan's feed
            return None
        results = self._verify_tokens(seqs, drafts, out, before)
        self.batch.keep([len(r.tokens) for r in results], L)
        for r in results:
            self.spec_stats.add(r)
        return results

    def commit(self, kept: Sequence[int]) -> None:
        """A frame-driven rank's end of a verify step: keep the first ``kept[i]`` (int, 1 ..
        ``L``: rank 0's ``len(Verified.tokens)``) of the ``L`` positions sequence i wrote, in the
        verify step's batch order, and forget the rest -- the same rollback rank 0 made.  Then the
        sequences that the verify step's plan prefilled after it join the batch (:meth:`batch_order`),
        as they joined rank 0's after its own rollback.

        Raises:
            ValueError: no verify step awaits its counts, or counts that do not fit it.
        """
        if self._unverified is None:
            raise ValueError("no verify step awaits its kept counts")
        if any(int(k) < 1 for k in kept):
            raise ValueError(f"kept counts {list(kept)}: a row keeps at least its fed token")
        self.batch.keep([int(k) for k in kept], self._unverified)
        self._unverified = None
        deferred, self._deferred = self._deferred, []
        for _, join in deferred:  # joins of the verify step's plan, after its rollback as on rank 0
            join()

    def _join_batch(self, uids: List[str], join: Callable[[], None]) -> None:
        """Add prefilled sequences ``uids`` to the decode batch (``join``: the batch call) now, or --
        after a frame-driven verify step of the same plan -- once :meth:`commit` has rolled that step
        back: rank 0 added them after its own rollback, and every rank must change the batch in the
        same order (the batch's row reuse and compaction depend on it)."""
        if self._unverified is None:
            join()
        else:
            self._deferred.append((list(uids), join))

    @property
    def batch_order(self) -> List[str]:
        """The decode batch's uids in order as the next plan's decode step will see them: the batch,
        then sequences that joined after an uncommitted verify step (:meth:`commit` adds them), then
        those whose received K/V awaits :meth:`join_remote`."""
        return self.batch.uids + [u for uids, _ in self._deferred for u in uids] + list(self._remote)

    @property
    def uncommitted(self) -> Optional[int]:
        """Positions per sequence a frame-driven verify step wrote and :meth:`commit` has not yet
        resolved, else ``None``."""
        return self._unverified

    def _check_committed(self) -> None:
        if self._unverified is not None:
            raise ValueError("a verify step awaits its kept counts (commit) before anything else runs")

    def _verify_tokens(self, seqs: List[SequenceState], drafts: List[List[int]], out: mx.array,
                       before: List[int]) -> List["Verified"]:
        """Rank 0's half of :meth:`verify`: accept, record (stop rule, processors, logprobs)."""
        import numpy as np

        from .speculative import ACCEPT_SALT, Verified, greedy_accept, keyed_categorical, rejection_accept

        work = []  # per sequence: what to evaluate, then decide on the host
        lazies: List[mx.array] = []
        for i, (s, d) in enumerate(zip(seqs, drafts)):
            m = len(d)
            if m == 0:  # one token, exactly as a plain step draws it
                tok = s.draw(out[i, 0], s.generated)
                work.append({"one": tok})
                lazies += [tok] + s.lazy_logprobs(s.generated)
                continue
            w = {"snap": s.processor.snapshot() if s.processor is not None else None}
            if s.processor is not None:  # position j processed as if draft[:j] were accepted
                rows = []
                for j in range(m + 1):
                    rows.append(s.processor(out[i, j]))
                    if j < m:
                        s.processor.record(d[j])
                proc = mx.stack(rows)
            else:
                proc = out[i, :m + 1].astype(mx.float32)
            scaled_fn = (None if s.sampling is None else
                         make_token_logits(s.sampling.temperature, s.sampling.top_p, s.sampling.top_k,
                                           s.sampling.min_p))
            w["proc"] = proc
            if scaled_fn is None:
                w["target"] = mx.argmax(proc, axis=-1)
                lazies.append(w["target"])
            else:
                seed = s.sampling.seed
                w["scaled"] = mx.stack([scaled_fn(proc[j]) for j in range(m + 1)])
                w["probs"] = mx.softmax(w["scaled"], axis=-1)
                w["u"] = mx.stack([mx.random.uniform(key=token_key(int(seed) ^ ACCEPT_SALT, s.generated + j))
                                   for j in range(m)])
                lazies += [w["scaled"], w["probs"], w["u"]]
            work.append(w)
        mx.eval(lazies)
        results = []
        for s, d, w, pos in zip(seqs, drafts, work, before):
            if "one" in w:
                emitted, accepted = [int(w["one"].item())], 0
            elif "target" in w:
                accepted, emitted = greedy_accept(d, w["target"].tolist())
            else:
                seed, base, scaled = s.sampling.seed, s.generated, w["scaled"]

                def draw(j, dist, seed=seed, base=base, scaled=scaled):
                    if dist is None:  # the bonus token: the plain sampler's draw from the same logits
                        return keyed_categorical(scaled[j], seed, base + j)
                    with np.errstate(divide="ignore"):
                        return keyed_categorical(np.log(dist).astype(np.float32), seed, base + j)

                accepted, emitted = rejection_accept(d, np.array(w["probs"], dtype=np.float64), None,
                                                     np.array(w["u"]).tolist(), draw)
            if "one" not in w:
                if s.processor is not None:
                    s.processor.restore(w["snap"])
                if s.top_logprobs >= 0:
                    for j, t in enumerate(emitted):
                        lp = w["proc"][j] - mx.logsumexp(w["proc"][j], axis=-1)
                        entry = (lp[t],)
                        if s.top_logprobs > 0:
                            top = mx.argpartition(-lp, s.top_logprobs - 1)[:s.top_logprobs]
                            entry += (top, lp[top])
                        s._logprobs[s.generated + j] = entry
            kept, lps = [], []
            for j, t in enumerate(emitted):
                s.session.position = pos + 1 + j  # the KV length one-at-a-time decoding has here
                if "one" not in w and s.processor is not None:
                    s.processor.record(t)
                self._record(s, t)
                kept.append(t)
                if s.top_logprobs >= 0:
                    lps.append(s.last_logprob)
                if s.reason:
                    break
            for j in range(len(kept), len(emitted)):
                s._logprobs.pop(s.generated + j - len(kept), None)
            s.session.position = pos + 1 + max((len(x) for x in drafts), default=0)
            results.append(Verified(kept, len(d), accepted, lps))
        return results

    def remove(self, uid: str) -> int:
        """Free sequence ``uid`` (after withdrawing a lookahead step); returns
        the length of its KV cache (tokens), 0 for an unknown uid."""
        self._check_committed()
        seq = self.sequences.pop(uid, None)
        if seq is None:
            return 0
        self.withdraw()
        position = seq.session.position
        if uid in self._remote:  # --pd: its K/V installed, never joined (rank 0 refused it)
            self._remote.remove(uid)
        if self.batch.remove(uid) is None:  # not in the batch yet (a --local-decode prefill, a refused --pd join)
            seq.session.close()
        return position

    def settle(self) -> Dict[str, int]:
        """Keep a queued lookahead step instead of rolling it back: read its tokens and record
        them as :meth:`step` would have on its next call (the stop rule included); returns
        ``{uid: token}`` for every sequence that had not already stopped (a stopped sequence's
        token is dropped: it is being retired).  Called before the batch changes (a sequence
        joins or leaves), so that the step computed meanwhile is used, not discarded."""
        self.queue_owed()
        if self._pending is None:
            return {}
        seqs = [(uid, self.sequences[uid]) for uid in self.batch.uids]
        values = self._pending.reshape(-1).tolist()
        self._pending = None
        out = {}
        for (uid, s), t in zip(seqs, values):
            if not s.reason:
                self._record(s, t)
                out[uid] = t
        return out

    def withdraw(self) -> None:
        """Roll back a queued lookahead step of the whole batch, if any.

        Raises:
            ValueError: a frame-driven verify step awaits its :meth:`commit` (every operation that
                changes the batch passes here first).
        """
        self._check_committed()
        self.queue_owed()
        self._withdraw_lookahead()

    def _withdraw_lookahead(self) -> None:
        """:meth:`withdraw` without its check (a prefill may run while a verify step awaits its
        counts: no lookahead step is queued then, verify withdrew it)."""
        if self._pending is not None:
            mx.eval(self._pending)  # let the queued step finish, then forget its KV entries
            self._pending = None
            self.batch.rollback(1)
            for uid in self.batch.uids:  # ... and the token it sampled (penalties' counts, logprobs)
                seq = self.sequences.get(uid)
                if seq is not None:
                    seq.forget()

    @property
    def queued(self) -> bool:
        """Whether a lookahead step is queued on the batch (:meth:`settle` reads it, :meth:`withdraw` drops it)."""
        with self._lengths:
            return self._pending is not None or self._owed is not None

    def kv_length(self, seq: SequenceState) -> int:
        """Positions in ``seq``'s KV cache, not counting a queued lookahead step (another thread may
        ask while :meth:`queue_owed` builds one)."""
        with self._lengths:
            return seq.session.position - (self._pending is not None)

    # -- sampling and the stop rule ----------------------------------------------------
    def _sample(self, seq: SequenceState, logits: mx.array) -> int:
        token = int(seq.draw(logits, seq.generated).item())
        self._record(seq, token)
        return token

    def _record(self, seq: SequenceState, token: int) -> None:
        if seq.sampler is not None:
            seq.recorded(token)
        seq.generated += 1
        seq.token = token
        seq.reason = seq.reason or stop_reason(token, seq.generated, self.kv_length(seq), seq.eos,
                                               seq.max_tokens, self.context_length)

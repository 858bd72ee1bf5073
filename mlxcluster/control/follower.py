"""Ranks N: one ``stepPlan`` frame -> :class:`~mlxcluster.engine.decode.RankEngine` calls, in lockstep with rank 0.

Like vLLM's ``execute_model(SchedulerOutput)`` (and mlx-lm's ``server.py`` ``_share_object``),
ranks N receive the work rank 0 decided for one iteration of its loop, as one data object, and
run the same engine calls in the same order (proto/mlxcluster.proto ``StepPlan``): leaves
(:meth:`RankEngine.remove`), the decode step (:meth:`RankEngine.step`), joins
(:meth:`RankEngine.admit` with the K/V source, then the prefill of those computed now), prefill
chunks (:meth:`RankEngine.prefill_chunk`), embeds (one forward pass of the embedding inputs,
:func:`mlxcluster.engine.embed.run`: no KV cache, no reply).  :meth:`Follower.check` checks a whole plan against this
rank's state before :meth:`Follower.run` runs any of it.

Threads of a rank N process: gRPC's server threads; per controller stream one
reader thread (frames -> the follower's inbox, then wakes the MLX thread); the
one MLX thread running :meth:`Follower.drain` (inbox -> engine calls ->
replies, which the stream's response generator sends).  A frame crosses two
hops in (reader, MLX thread) and one out.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Executor
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import mlx.core as mx

from ..engine.decode import RankEngine
from ..engine.kv_sources import Compute, Remote
from ..engine.passes import queuing_computes
from ..engine.sampling import sampling_of
from ..failpoints import fail_point
from ..protocol import frames as fr
from ..protocol import mlxcluster_pb2 as pb
from ..protocol import mlxcluster_pb2_grpc as pb_grpc
from .executor import (Admit, Chunk, Decode, Embeds, HandOff, Leave, PlanSide, Prefill, RemoteJoin,
                       RemoteJoined, Settle, parts)
from .mlx_thread import busy_s, step_s

log = logging.getLogger(__name__)

__all__ = ["Follower", "PlanRejected", "RankControlServicer", "serve_follower"]


class PlanRejected(Exception):
    """A plan :meth:`Follower.check` refuses: ``code`` (an ``ErrorCode``), ``uid`` (the sequence
    to blame, "" for the plan), and the one-line message."""

    def __init__(self, code: int, message: str, uid: str = ""):
        super().__init__(message)
        self.code, self.uid = code, uid


class Follower(PlanSide):
    """Plan executor of a rank N (rank >= 1).

    A ``stepPlan`` frame (:func:`~mlxcluster.protocol.frames.step_plan`) is checked whole
    (:meth:`check`) and then run (:meth:`run`): its leaves free sequences, its decode entries run
    one decode step of every resident sequence (continuous batching) on the tokens rank 0
    sampled, its joins admit sequences with their K/V source (computed here -- after a
    prefix-cache hit, at once, with the rest of a batched prefill, or by chunk entries --,
    prefilled through the pipeline and handed to rank 0, or fetched from the prefill group), its
    chunk entries prefill the next chunk of a long prompt.  A plan that fails the check -- an
    unknown session uid, a position other than the KV cache length, a token outside
    ``[0, vocab_size)``, a sequence longer than ``context_length``, a decode step that does not
    name the batch in order, a route or epoch not this rank's, a K/V source this rank cannot
    take -- is answered with one error reply and runs nothing, so no collective is entered for it.

    Speculative decoding: decode entries carrying drafts make the step a verify step (one forward of
    each sequence's token and draft, :meth:`RankEngine.verify`; every stage of a pipeline runs its
    share); rank 0 decides what each keeps only after it, so the next plan's ``kept`` counts are
    applied first (:meth:`RankEngine.commit`: the rollback, then the batch joins of the sequences
    the verify step's plan prefilled after it).
    A plan after a verify step without them, counts without a verify step, drafts for a model that
    cannot speculate or running past the context are refused like any bad plan.

    Args:
        model: this rank's shard (:class:`~mlxcluster.model.tp.TensorParallel`, a pipeline stage, ...).
        rank: this rank (>= 1 in a real group; 0 is allowed for tests).
        vocab_size: number of token ids.
        context_length: maximum tokens in the KV cache.

    Only cluster members reach it: :func:`serve_follower` serves over mutual TLS.
    """

    def __init__(self, model, rank: int, vocab_size: int, context_length: int):
        self.model = model
        self.rank = rank
        self.vocab_size = vocab_size
        self.context_length = context_length
        # Ranks N stop after the final norm where their logits would be discarded; where every
        # rank's logits are the group's (a vocabulary-parallel head, whose all_gather is a
        # collective) they run the head and sample the sequences every rank samples.
        self.engine = RankEngine(model, context_length, compute_logits=self.samples_here,
                                 read_first=queuing_computes())
        self.frames_handled = 0
        # a pipeline stage checks the plan's route and epoch against its own
        route = getattr(model, "route", None)
        self.route_id = route.identity() if route is not None else ""
        self.epoch = getattr(model, "epoch", "")
        # sessions known here without a KV cache until they leave -> P: --local-decode ones
        # whose K/V went to rank 0, --pd ones whose prefill group's K/V this rank refused
        self._handed_off: Dict[str, int] = {}
        self._handing: set = set()  # --local-decode sequences prefilled by chunks: handed off after the last
        self.decode_side = None  # --prefill-peer: a leader.pd.DecodeSide
        self.on_stop = None      # called after each leave (the rank reports counters)

    @property
    def samples_here(self) -> bool:
        """Whether this rank can sample sequences itself: its logits are the group's bit for bit (a
        vocabulary-parallel head; a pipeline whose output is replicated) and it decodes."""
        return bool(getattr(self.model, "logits_replicated", False)) and not getattr(self.model, "local_decode", False)

    def _sampling(self, j: pb.PromptTokens) -> dict:
        """The engine's admit arguments for join ``j``: its sampling, stop rule and resumed tokens
        where every rank samples it, else none (its tokens come in plans)."""
        if not j.every_rank_samples:
            return {}
        ids = list(j.token_ids)
        return dict(sampling=sampling_of(j.sampling), eos_token_ids=list(j.eos_token_ids), max_tokens=j.max_tokens,
                    resumed=ids[len(ids) - j.resumed:] if j.resumed else ())

    @property
    def batch(self):
        """This rank's :class:`~mlxcluster.engine.batch.DecodeBatch`."""
        return self.engine.batch

    @property
    def session(self):
        """The resident sequence's session when exactly one is resident, else ``None``."""
        return self.batch.sessions[0] if len(self.batch) == 1 else None

    def _known(self, uid: str) -> bool:
        return self.engine.get(uid) is not None or uid in self._handed_off

    def _position(self, uid: str) -> int:
        """For an error reply: the KV length of ``uid``, else of the lone resident sequence, else 0."""
        seq = self.engine.get(uid)
        session = seq.session if seq is not None else self.session
        return session.position if session is not None else 0

    # -- the check ----------------------------------------------------------------------------
    def check(self, frame: pb.Frame) -> None:
        """Check a whole plan against this rank's state, as it will be when each part runs.

        Raises:
            PlanRejected: the first thing wrong (the plan must then run nowhere).
        """
        if frame.type != fr.STEP_PLAN or frame.WhichOneof("payload") != "step_plan":
            raise PlanRejected(pb.BAD_FRAME, f"unknown or malformed frame type 0x{frame.type:02X}")
        p = frame.step_plan
        lengths = self._check_kept(p)
        leaving = set()
        for x in p.leaves:
            if x.uid in leaving:
                raise PlanRejected(pb.BAD_FRAME, f"sessionStop for {x.uid!r} twice in one plan", x.uid)
            if not self._known(x.uid):
                raise PlanRejected(pb.UNKNOWN_SESSION, f"sessionStop for unknown session {x.uid!r}", x.uid)
            leaving.add(x.uid)
        if p.decode:
            # the batch once the kept counts are committed (sequences that joined after the verify step last)
            held = [u for u in self.engine.batch_order if u not in leaving]
            named = [e.uid for e in p.decode]
            if named != held:
                code = pb.UNKNOWN_SESSION if set(named) - set(held) else pb.BAD_FRAME
                raise PlanRejected(code, f"decode step for sequences {named} but this rank holds {held}",
                                   next((u for u in named if u not in held), ""))
            for e, seq in zip(p.decode, [self.engine.get(u) for u in held]):
                # a queued lookahead step is this plan's decode step, unless the plan keeps it first
                length = lengths.get(e.uid, self.engine.kv_length(seq) + bool(p.settled and self.engine.queued))
                self._check_entry(e.uid, e.position, e.token, seq.session, length)
            self._check_tokens(p)
            if any(e.draft for e in p.decode):
                self._check_drafts(p.decode)
        if p.settled and not self.engine.queued:
            raise PlanRejected(pb.BAD_FRAME, "a plan that keeps a queued lookahead step, but none is queued here")
        if p.ahead:
            self._check_ahead(p, leaving)
        if p.joins and p.route != self.route_id:
            raise PlanRejected(pb.BAD_FRAME, f"promptTokens for route {p.route or '(none)'!r}, this rank "
                                             f"runs {self.route_id or 'no pipeline'!r}")
        if p.joins and p.epoch != self.epoch:
            raise PlanRejected(pb.BAD_FRAME, f"promptTokens of formation epoch {p.epoch!r}, this rank's "
                               f"is {self.epoch!r} (stale)")
        chunked: Dict[str, Tuple[int, int]] = {}  # uid -> (position, prompt length) of chunked joins
        joined = set()
        for j in p.joins:
            self._check_join(j, leaving, joined)
            joined.add(j.uid)
            if fr.chunked(j):
                if fr.source_of(j) == fr.COMPUTE and j.compute.disk and any(c.uid == j.uid for c in p.chunks):
                    raise PlanRejected(pb.BAD_FRAME, f"a prefillChunk for {j.uid!r} in the plan it joins from disk "
                                                     f"(its cached length is agreed when it is admitted)", j.uid)
                chunked[j.uid] = (j.compute.cached if fr.source_of(j) == fr.COMPUTE else 0, len(j.token_ids))
        chunk_uids = set()
        for c in p.chunks:
            if c.uid in chunk_uids:
                raise PlanRejected(pb.BAD_FRAME, f"two prefillChunks for {c.uid!r} in one plan", c.uid)
            chunk_uids.add(c.uid)
            seq = self.engine.get(c.uid)
            if c.uid in chunked:
                position, length = chunked[c.uid]
            elif seq is not None and seq.prefilling and c.uid not in leaving:
                position, length = seq.session.position, len(seq.prompt)
            else:
                raise PlanRejected(pb.UNKNOWN_SESSION, f"prefillChunk for {c.uid!r}, which is not being "
                                                       f"prefilled here", c.uid)
            if c.position != position:
                raise PlanRejected(pb.OUT_OF_ORDER, f"prefillChunk for {c.uid!r} at position {c.position} "
                                                    f"but the KV cache holds {position} tokens", c.uid)
            if c.count < 1 or c.position + c.count > length:
                raise PlanRejected(pb.BAD_FRAME, f"prefillChunk of {c.count} tokens at position {c.position} "
                                                 f"does not fit the {length}-token prompt", c.uid)
        if p.embeds:
            self._check_embeds(p.embeds)

    def _check_tokens(self, p: pb.StepPlan) -> None:
        """Every decode entry of a sequence this rank samples too must feed the token this rank
        derived itself (issue 42: no rank follows another's tokens silently).

        Raises:
            PlanRejected: ``TOKEN_MISMATCH``, naming the step, this rank, the sequence and both tokens.
        """
        mine = self.engine.expected_tokens(settled=p.settled)
        for e in p.decode:
            if e.uid in mine and mine[e.uid] != e.token:
                raise PlanRejected(pb.TOKEN_MISMATCH, f"step {p.step}: rank {self.rank} sampled token {mine[e.uid]} "
                                                      f"for {e.uid!r} where rank 0's plan feeds {e.token}: the ranks "
                                                      f"disagree", e.uid)

    def _check_ahead(self, p: pb.StepPlan, leaving) -> None:
        """A lookahead plan: a decode step of a batch this rank samples whole, nothing admitted after
        it (a join would withdraw the queued step at once)."""
        if not p.decode or p.joins or p.chunks or getattr(self.model, "local_decode", False):
            raise PlanRejected(pb.BAD_FRAME, "a lookahead plan without a plain decode step of the batch alone")
        notmine = [e.uid for e in p.decode if self.engine.get(e.uid).sampler is None]
        if notmine:
            raise PlanRejected(pb.BAD_FRAME, f"a lookahead step for {notmine}, which this rank does not sample",
                               notmine[0])

    def _check_embeds(self, embeds) -> None:
        """A plan's embeds part: inputs with a uid each (once), tokens in the vocabulary, at most the
        context; a model that can run them (:func:`mlxcluster.engine.embed.unsupported`)."""
        from ..engine.embed import unsupported

        why = unsupported(self.model)
        if why:
            raise PlanRejected(pb.BAD_FRAME, f"embeds: {why}", embeds[0].uid)
        seen = set()
        for e in embeds:
            if not e.uid or e.uid in seen:
                raise PlanRejected(pb.BAD_FRAME, f"embeds entry without a uid or named twice ({e.uid!r})", e.uid)
            seen.add(e.uid)
            if not e.token_ids:
                raise PlanRejected(pb.BAD_FRAME, "embeds entry with no tokens", e.uid)
            bad = next((t for t in e.token_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise PlanRejected(pb.BAD_TOKEN, f"token {bad} outside the vocabulary [0, {self.vocab_size})", e.uid)
            if len(e.token_ids) > self.context_length:
                raise PlanRejected(pb.CONTEXT_OVERFLOW, f"embedding input of {len(e.token_ids)} tokens is longer "
                                                        f"than the context of {self.context_length}", e.uid)

    def _check_kept(self, p: pb.StepPlan) -> Dict[str, int]:
        """Speculative decoding: a plan after a verify step must carry each of its sequences' kept
        count (1 .. the positions it wrote), and only such a plan.  Returns ``{uid: KV length once
        committed}`` (empty when no verify step awaits).  A ``--local-decode`` rank N decodes nothing
        (rank 0 decodes alone): the counts of rank 0's own verify steps are not about its caches."""
        written = self.engine.uncommitted
        if written is None and getattr(self.model, "local_decode", False):
            return {}
        if written is None:
            if p.kept:
                raise PlanRejected(pb.BAD_FRAME, f"kept counts {list(p.kept)} but no verify step awaits them here")
            return {}
        uids = self.batch.uids
        if len(p.kept) != len(uids) or any(not 1 <= k <= written for k in p.kept):
            raise PlanRejected(pb.BAD_FRAME, f"kept counts {list(p.kept)} do not fit the verify step of {uids} "
                                             f"({written} positions each)")
        return {u: s.position - (written - k) for u, s, k in zip(uids, self.batch.sessions, p.kept)}

    def _check_drafts(self, entries) -> None:
        """A verify step: this model must speculate, and every draft token fit the vocabulary and the
        context (``1 + len(draft)`` positions written from ``position``)."""
        if self.engine.speculative_error is not None:
            raise PlanRejected(pb.BAD_FRAME, self.engine.speculative_error)
        for e in entries:
            bad = next((t for t in e.draft if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise PlanRejected(pb.BAD_TOKEN, f"draft token {bad} outside the vocabulary [0, {self.vocab_size})",
                                   e.uid)
            if e.position + 1 + len(e.draft) >= self.context_length:
                raise PlanRejected(pb.CONTEXT_OVERFLOW, f"a draft of {len(e.draft)} at position {e.position} runs "
                                                        f"past the context of {self.context_length}", e.uid)

    def _check_entry(self, uid: str, position: int, token: int, session, length: Optional[int] = None) -> None:
        held = session.position if length is None else length
        if position != held:
            raise PlanRejected(pb.OUT_OF_ORDER, f"step for {uid!r} at position {position} but the KV cache "
                                                f"holds {held} tokens", uid)
        if not 0 <= token < self.vocab_size:
            raise PlanRejected(pb.BAD_TOKEN, f"token {token} outside the vocabulary [0, {self.vocab_size})", uid)
        if position >= self.context_length:
            raise PlanRejected(pb.CONTEXT_OVERFLOW, f"position {position} beyond the context of "
                                                    f"{self.context_length}", uid)

    def _check_join(self, j: pb.PromptTokens, leaving, joined) -> None:
        ids = j.token_ids
        if not j.uid:
            raise PlanRejected(pb.BAD_FRAME, "promptTokens without a session uid")
        if not ids:
            raise PlanRejected(pb.BAD_FRAME, "promptTokens with no tokens", j.uid)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise PlanRejected(pb.BAD_TOKEN, f"token {bad} outside the vocabulary [0, {self.vocab_size})", j.uid)
        if len(ids) >= self.context_length:
            raise PlanRejected(pb.CONTEXT_OVERFLOW, f"prompt of {len(ids)} tokens does not fit the context of "
                                                    f"{self.context_length}", j.uid)
        if (self._known(j.uid) and j.uid not in leaving) or j.uid in joined:
            raise PlanRejected(pb.BAD_FRAME, f"session {j.uid!r} is already resident", j.uid)
        source = fr.source_of(j)
        if j.every_rank_samples and not (self.samples_here and source != fr.HANDOFF):
            raise PlanRejected(pb.BAD_FRAME, "a join every rank samples, but this rank's logits are not the group's "
                                             "(no vocabulary-parallel head)", j.uid)
        if j.resumed >= len(ids):
            raise PlanRejected(pb.BAD_FRAME, f"{j.resumed} resumed tokens of a {len(ids)}-token prompt", j.uid)
        if source == fr.COMPUTE:
            cached = j.compute.cached
            # (a disk join takes what this rank holds and the group agrees on the fewest: PrefixCache.take)
            if cached and not j.compute.disk:
                held = self.engine.prefix_match(ids, j.compute.salt, disk=False)
                if held < cached:
                    raise PlanRejected(pb.BAD_FRAME, f"promptTokens with {cached} cached positions, but this "
                                                     f"rank's prefix cache holds {held}", j.uid)
            if cached >= len(ids):
                raise PlanRejected(pb.BAD_FRAME, f"{cached} cached positions of a {len(ids)}-token prompt leave "
                                                 f"nothing to prefill", j.uid)
        elif source == fr.HANDOFF and not getattr(self.model, "local_decode", False):
            raise PlanRejected(pb.BAD_FRAME, "a handoff join (local decode), but this rank was not started with "
                                             "--local-decode", j.uid)
        elif source == fr.REMOTE and self.decode_side is None:
            raise PlanRejected(pb.BAD_FRAME, "a remote join (pd), but this rank has no --prefill-peer", j.uid)

    # -- the run ------------------------------------------------------------------------------
    def handle_frame(self, frame: pb.Frame) -> List[pb.FrameReply]:
        """Check and run one plan; returns its replies (:meth:`run`, in full).  Never raises for a
        bad plan: its one error reply is returned."""
        return list(self.run(frame))

    def run(self, frame: pb.Frame) -> Iterator[pb.FrameReply]:
        """Check one plan (:meth:`check`) and run it in the plan's order, yielding its replies as
        they are made: one error reply for a rejected plan (nothing ran); otherwise an ack per leave
        (with this rank's peak memory), the ``KvFrame`` replies of each handoff join (made on the MLX
        thread: they read the KV cache), one reply per remote join (its K/V installed, or why it was
        refused)."""
        self.frames_handled += 1
        if log.isEnabledFor(logging.DEBUG):  # describe() is not free: keep it off the hot path
            log.debug("rank %d %s", self.rank, fr.describe(frame))
        try:
            self.check(frame)
        except PlanRejected as exc:
            log.warning("rank %d rejected %s: %s", self.rank, fr.describe(frame), exc)
            yield fr.error_reply(self.rank, exc.code, str(exc), exc.uid, self._position(exc.uid))
            return
        for part in parts(frame.step_plan):  # the one order (control/executor.py), as rank 0 runs it
            yield from self.run_part(part)

    # -- the parts of a plan on a rank N (executor.PlanSide) -----------------------------------
    def settle(self, part: Settle) -> Iterator[pb.FrameReply]:
        """The previous plan's remainders: its queued lookahead step kept (``settled``: its tokens
        recorded, as rank 0 did); its verify step's rollback of what rank 0 rejected
        (``--local-decode``: no verify step here); its ``--pd`` joins whose K/V this rank installed
        join the batch now, where rank 0's joined after that plan -- but those rank 0 refused (this
        plan's ``ERROR`` leaves)."""
        if part.settled:
            self.engine.settle()
        if part.kept and self.engine.uncommitted is not None:
            self.engine.commit(list(part.kept))
        self.engine.join_remote(part.refused)
        return iter(())

    def leave(self, part: Leave) -> Iterator[pb.FrameReply]:
        yield self._leave(part.uid)

    def decode(self, part: Decode) -> Iterator[pb.FrameReply]:
        """One decode step of the batch on the tokens the plan feeds (checked against this rank's
        own where it samples too); a verify step with drafts; with ``ahead`` the next step is queued
        on this one's lazy tokens, sampled here."""
        if part.verify:
            self.engine.verify([list(e.draft) for e in part.entries], tokens=[e.token for e in part.entries])
        else:
            self.engine.step([e.token for e in part.entries], lookahead=part.ahead, exact=True)
            flip = fail_point("decode.token")
            if flip is not None and flip.name in ("flip", "flip_at") and self.rank == 1:
                seq = next((self.engine.get(e.uid) for e in part.entries
                            if self.engine.get(e.uid).sampler is not None), None)
                if seq is not None and (flip.name == "flip" or seq.generated == int(flip.arg)):
                    seq.token ^= 1  # this rank's own token differs from every other rank's
        return iter(())

    def admit(self, part: Admit) -> Iterator[pb.FrameReply]:
        for j in part.joins:
            self.engine.admit(j.uid, list(j.token_ids), source=Compute(j.compute.cached, j.compute.salt,
                                                                       j.compute.disk), **self._sampling(j))
            if fr.source_of(j) == fr.HANDOFF:
                self._handing.add(j.uid)
        return iter(())

    def prefill(self, part: Prefill) -> Iterator[pb.FrameReply]:
        self.engine.prefill_admitted([j.uid for j in part.joins], together=part.together)
        return iter(())

    def hand_off(self, part: HandOff) -> Iterator[pb.FrameReply]:
        self.engine.prefill_admitted([part.join.uid])
        yield from self._hand_off(part.join.uid)

    def remote_join(self, part: RemoteJoin) -> Iterator[pb.FrameReply]:
        yield self._remote(part.join)

    def remote_joined(self, part: RemoteJoined) -> Iterator[pb.FrameReply]:
        return iter(())  # they join the batch at the next plan's Settle, once rank 0's refusals are known

    def chunk(self, part: Chunk) -> Iterator[pb.FrameReply]:
        self.engine.prefill_chunk(part.uid, part.count)
        if part.uid in self._handing and not self.engine.get(part.uid).prefilling:
            yield from self._hand_off(part.uid)

    def embeds(self, part: Embeds) -> Iterator[pb.FrameReply]:
        """One forward pass of every input, as rank 0's (which pools it)."""
        from ..engine import embed

        embed.run(self.model, [list(e.token_ids) for e in part.entries])
        return iter(())

    def _leave(self, uid: str) -> pb.FrameReply:
        self._handing.discard(uid)
        if uid in self._handed_off:  # --local-decode: its K/V already went to rank 0
            position = self._handed_off.pop(uid)
        else:
            position = self.engine.remove(uid)
            if self.on_stop is not None:
                self.on_stop()
        return pb.FrameReply(uid=uid, type=fr.STEP_PLAN, ok=True, rank=self.rank, left=True,
                             peak_memory_bytes=mx.get_peak_memory(), position=position)

    def _hand_off(self, uid: str) -> Iterator[pb.FrameReply]:
        """``--local-decode``: the prompt of ``uid`` has been prefilled through the pipeline (this
        stage's share, at once or by chunks); send this stage's K/V for its positions to rank 0 as
        ``KvFrame`` replies (:func:`mlxcluster.engine.handoff.kv_frames`; failpoint ``handoff.send``)
        and free it.  The session stays known until it leaves; no decode step ever runs here for it."""
        from ..engine.handoff import kv_frames

        self._handing.discard(uid)
        seq = self.engine.get(uid)
        m = self.model
        try:
            for kv in kv_frames(seq.session.cache, m.stage.layers, seq.prompt, m.identity, m.epoch, uid):
                yield pb.FrameReply(uid=uid, type=fr.STEP_PLAN, ok=True, rank=self.rank, position=len(seq.prompt),
                                    kv=kv)
        finally:
            self._handed_off[uid] = self.engine.remove(uid)

    def _remote(self, j: pb.PromptTokens) -> pb.FrameReply:
        """Prefill/decode disaggregation: fetch this rank's KV heads of the prompt from the prefill
        group (blocking this MLX thread until the stream's ``DECODE``), install them, and answer
        with one ``KvFrame`` (last, its byte count); a refused stream installs nothing and is
        answered ok with ``refused`` (rank 0 decides for the group: the sequence leaves everywhere
        and joins again with its K/V computed, the one fallback rule)."""
        from ..engine.pd import PdError

        ids = list(j.token_ids)
        ok = pb.FrameReply(uid=j.uid, type=fr.STEP_PLAN, ok=True, rank=self.rank, position=len(ids))
        try:
            got = self.decode_side.fetch(j.uid, ids, j.sampling)
            self.engine.admit(j.uid, ids, source=Remote(got.kv(), got.first_token), **self._sampling(j))
        except (PdError, ValueError) as exc:
            log.warning("rank %d refused the prefill group's KV of %s: %s", self.rank, j.uid, exc)
            self._handed_off[j.uid] = 0
            ok.refused = str(exc) or type(exc).__name__
            ok.kv.CopyFrom(pb.KvFrame(last=True, uid=j.uid))
            return ok
        ok.kv.CopyFrom(pb.KvFrame(last=True, uid=j.uid, total_bytes=got.bytes, first_token=got.first_token))
        return ok

    # -- the follower loop ------------------------------------------------------------------
    def drain(self, inbox: "queue.Queue", replies: "queue.Queue", end: object,
              on_frame: Optional[Callable[[], None]] = None) -> bool:
        """Handle every frame waiting in ``inbox``, putting replies on ``replies``.  Returns
        (releasing the MLX thread) when the inbox is empty: ``True`` once ``end`` was taken (the
        stream is over), else ``False``.  Runs on the MLX thread; ``on_frame`` is called before
        each frame (:meth:`~mlxcluster.control.mlx_thread.MlxThread.mark`)."""
        while True:
            try:
                frame = inbox.get_nowait()
            except queue.Empty:
                return False
            if frame is end:
                return True
            if on_frame is not None:
                on_frame()
            try:
                for reply in self.run(frame):
                    replies.put(reply)
            except Exception as exc:  # a bug or MLX failure: report it, keep serving
                replies.put(self._internal(frame, exc))

    def _internal(self, frame: pb.Frame, exc: Exception) -> pb.FrameReply:
        log.exception("rank %d failed on %s", self.rank, fr.describe(frame))
        return fr.error_reply(self.rank, pb.INTERNAL, f"rank {self.rank}: {type(exc).__name__}: {exc}")


_END = object()


class RankControlServicer(pb_grpc.RankControlServicer):
    """gRPC face of a :class:`Follower`.

    Only one ``Frames`` stream (rank 0's) is served at a time; a second
    concurrent stream is refused with ``FAILED_PRECONDITION`` so that no
    stranger's frames interleave with rank 0's.  The stream's reader thread
    puts each frame in an inbox and, unless a drain is already scheduled,
    submits :meth:`Follower.drain` to ``executor`` (the process's one MLX
    thread), which runs until the inbox is empty -- so the MLX thread is never
    held waiting for a frame.
    """

    def __init__(self, follower: Follower, executor: Executor, world_size: int, model_name: str = "",
                 weight_bytes: int = 0):
        self.follower = follower
        self.executor = executor
        self.world_size = world_size
        self.model_name = model_name
        self.weight_bytes = weight_bytes  # this rank's shard (reported in Health for the dashboard)
        self._stream_lock = threading.Lock()

    def Frames(self, request_iterator: Iterator[pb.Frame], context) -> Iterator[pb.FrameReply]:
        import grpc

        if not self._stream_lock.acquire(blocking=False):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "another controller stream is active")
        try:
            inbox: "queue.Queue" = queue.Queue()
            replies: "queue.Queue" = queue.Queue()
            lock = threading.Lock()
            scheduled = [False]  # a drain is queued or running on the MLX thread

            def drain() -> None:
                while True:
                    ended = self.follower.drain(inbox, replies, _END, getattr(self.executor, "mark", None))
                    with lock:
                        if ended or inbox.empty():
                            scheduled[0] = False
                            break
                if ended:
                    replies.put(_END)

            def wake() -> None:
                with lock:
                    if scheduled[0]:
                        return
                    scheduled[0] = True
                try:
                    self.executor.submit(drain)
                except RuntimeError:  # the executor is shut down: the process is stopping
                    replies.put(_END)

            def read() -> None:
                try:
                    for frame in request_iterator:
                        inbox.put(frame)
                        wake()
                except Exception:  # the stream broke: rank 0 is gone
                    pass
                finally:
                    inbox.put(_END)
                    wake()

            threading.Thread(target=read, name="frames-reader", daemon=True).start()
            while True:
                reply = replies.get()
                if reply is _END:
                    break
                yield reply
        finally:
            self._stream_lock.release()

    def Health(self, request, context) -> pb.HealthReply:
        import mlx.core as mx

        state = "busy" if len(self.follower.batch) else "ready"
        return pb.HealthReply(rank=self.follower.rank, world_size=self.world_size, state=state,
                              model=self.model_name, active_memory_bytes=int(mx.get_active_memory()),
                              weight_bytes=self.weight_bytes, busy_s=busy_s(self.executor),
                              step_s=step_s(self.executor))


def serve_follower(model, rank: int, world_size: int, source, executor: Executor, bind: str, port: int,
                   credentials, on_ready=None, decode_side=None, on_stop=None, prompt_cache=None,
                   prompt_agree=None) -> None:
    """A rank N's whole life: serve ``RankControl`` on ``bind:port`` until SIGTERM,
    over mutual TLS with ``credentials`` (a :class:`mlxcluster.security.Credentials`):
    only a process that holds the cluster secret can connect.  ``prompt_cache`` / ``prompt_agree``:
    this rank's disk tier and the group's agreement (:meth:`RankEngine.attach_disk`).

    Frames are handled on ``executor``, the process's one MLX thread.

    Raises:
        RuntimeError: the address cannot be bound.
    """
    import signal
    from concurrent import futures

    import grpc

    follower = Follower(model, rank, source.vocab_size, source.context_length)
    follower.decode_side = decode_side
    follower.on_stop = on_stop
    if prompt_cache is not None or prompt_agree is not None:  # a rank without a disk tier agrees too
        follower.engine.attach_disk(prompt_cache, prompt_agree)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[("grpc.so_reuseport", 0)])  # as rank 0's
    from ..model.tp import weight_bytes

    pb_grpc.add_RankControlServicer_to_server(
        RankControlServicer(follower, executor, world_size, source.name, weight_bytes(model)), server)
    if server.add_secure_port(f"{bind}:{port}", credentials.server()) == 0:
        raise RuntimeError(f"cannot listen on {bind}:{port}")
    server.start()
    if on_ready:
        on_ready()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=1)

"""Rank 0's side of the one step-plan executor: run a decided plan here and fold its outputs back into the requests.

:meth:`Rank0Execution._execute` sends a plan's ``stepPlan`` frame to ranks N (:meth:`Rank0Execution._frame`,
:meth:`Rank0Execution._for_ranks`) and runs the plan here through
:func:`~mlxcluster.control.executor.parts`, the one order of a plan's parts that rank N's
:class:`~mlxcluster.control.follower.Follower` runs too.  The :class:`~mlxcluster.control.executor.PlanSide`
methods say what each part means on rank 0: the decode or verify step's tokens are delivered to the
clients (:meth:`Rank0Execution._deliver`, vLLM's ``update_from_output``), joins are admitted with their
K/V source (computed, a ``--local-decode`` handoff, a prefill group's stream), chunks prefill, embeds
are pooled.  Steps are timed into the scheduler's ``step_times`` (what admission and the speculation
policy decide by).

A mixin of :class:`~mlxcluster.leader.scheduler.Scheduler` (issue 42 item 3: the scheduler decides,
this module executes); it reads and writes the scheduler's request lists and its engine
(:class:`~mlxcluster.engine.decode.RankEngine`) and group (:class:`~mlxcluster.control.link.RankGroup`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Dict, List, Optional

from ..control.executor import (Admit, Chunk, Decode, Embeds, HandOff, Leave, PlanSide, Prefill, RemoteJoin,
                                RemoteJoined, Settle, parts)
from ..engine import handoff
from ..engine.kv_sources import Compute, Remote
from ..engine.handoff import KvStream
from ..engine.speculative import Verified
from ..protocol import frames as fr
from ..protocol import mlxcluster_pb2 as pb

if TYPE_CHECKING:
    from .scheduler import Plan, Request

log = logging.getLogger("mlxcluster.leader.scheduler")

__all__ = ["Rank0Execution", "END"]

#: the end of a request's token stream (its ``out`` queue)
END = object()


class Rank0Execution(PlanSide):
    """Rank 0's :class:`~mlxcluster.control.executor.PlanSide` (see the module docstring)."""

    async def _settle(self) -> None:
        """Deliver the tokens of the lookahead step queued on the batch (:meth:`RankEngine.settle`)."""
        tokens = await self._mlx(self.engine.settle)
        for req in self._running:
            if req.uid in tokens and not req.cancelled:
                self._deliver(req, tokens[req.uid])

    async def _decode_step(self, active: List[Request], lookahead: bool = False) -> None:
        """One decode step of the whole batch (``active``, in batch order; see the module
        docstring), timed into :attr:`step_times` (:class:`StepTimes`): from the previous step's read
        when only steps ran in between (with lookahead this step was computing since then; not the
        step that restarts lookahead after a verify step, which waits for its own work and queues the
        next: counted as a plain step of the batch, it made verifying look cheap by ~0.75 of a step at 32
        sequences); right after a prefill, that prefill's interruption instead."""
        tokens = await self._mlx(self.engine.step, None, lookahead, True, True)
        now = time.perf_counter()
        if self.engine.read_first and lookahead:  # the next step queues on the MLX thread while the
            loop = asyncio.get_running_loop()     # next plan goes out (RankEngine.step's read_first)
            self._owed = loop.run_in_executor(self.executor, self.engine.queue_owed)
        # the first step after a verify step computed its own tokens and then queued the next step
        # (lookahead restarts): no steady step; the next one's tokens come with the step after it
        restart, self._after_verify = self._after_verify and bool(self.engine.queued), False
        if not self._interrupted and self._last_step_end and not restart:
            self.step_times.record(len(active), now - self._last_step_end)
            if self._ahead is not None:
                self._ahead.record(lookahead, len(active), now - self._last_step_end)
            if log.isEnabledFor(logging.DEBUG):  # batch_limit fits a line: keep it off the hot path
                log.debug("decode step of %d sequences: %.1f ms (batch limit %d, %d waiting)", len(active),
                          (now - self._last_step_end) * 1e3, self.batch_limit, len(self._waiting))
        elif self._admission is not None:
            prompt_tokens, since = self._admission
            step = self.step_times.predict(len(active)) or 0.0
            self.step_times.record_prefill(prompt_tokens, now - since - step)
            log.debug("a prefill of %d prompt tokens held the decode steps for %.1f ms", prompt_tokens,
                      (now - since - step) * 1e3)
        self._admission = None
        self._interrupted = False
        self._last_step_end = now
        for req, token in zip(active, tokens):
            self._deliver(req, token)

    async def _verify_step(self, active: List[Request], drafts: Dict[str, List[int]]) -> None:
        """A speculative decode step of the whole batch (``active``, in batch order; ``drafts``: uid ->
        draft, the others taking one token): :meth:`RankEngine.verify` on the MLX thread, then each
        sequence's emitted tokens delivered in order (:meth:`_deliver_verified`) and its
        :class:`AdaptiveK` told what was accepted; the kept counts wait for the next frame to ranks N
        (:meth:`_take_kept`).  Not timed into :attr:`step_times` (a verify step is no plain step); timed
        for :meth:`_measure_verify` as a plain step is, from the previous step's end where nothing else
        ran since (its drafting and the host work a plain step's lookahead would hide count), else
        from its own start; with lookahead only when it follows a verify step."""
        t0 = time.perf_counter()
        since = self._last_step_end if self._last_step_end and not self._interrupted else t0
        # with lookahead only a verify step after a verify step is timed: the first after plain steps
        # follows a settle, during which the last step's tokens were delivered (host work a run of verify
        # steps pays inside each step: at 32 sequences 0.24 s for the first, 0.41 s for the next ones)
        steady = not self.lookahead or (self._after_verify and not self._interrupted)
        results = await self._mlx(self.engine.verify, [drafts.get(r.uid, []) for r in active])
        if steady:
            self._measure_verify(len(active), 1 + max(len(d) for d in drafts.values()), time.perf_counter() - since)
        if self.ranks.links:
            self._kept = [len(v.tokens) for v in results]
        self._admission = None
        self._interrupted = False
        self._after_verify = True
        self._last_step_end = time.perf_counter()
        for req, v in zip(active, results):
            if v.drafted:
                if req.adaptive is not None:
                    req.adaptive.update(v.drafted, v.accepted)
                self.spec_stats.add(v)
                st = req.stats
                st.spec_drafted, st.spec_accepted, st.spec_steps = (st.spec_drafted + v.drafted,
                                                                    st.spec_accepted + v.accepted, st.spec_steps + 1)
            self._deliver_verified(req, v)

    def _take_kept(self) -> List[int]:
        """The last verify step's kept counts (``StepPlan.kept``), once: the next frame to ranks N carries them."""
        kept, self._kept = self._kept, []
        return kept

    async def _mlx(self, fn, *args):
        """Run ``fn`` on the MLX thread, watching every rank for errors and timeouts -- after the
        lookahead step a decode step left queuing there (:meth:`_decode_step`): its error or
        timeout is this call's."""
        owed, self._owed = self._owed, None
        if owed is not None:
            await self.ranks.run(owed, self.step_timeout_s)
        loop = asyncio.get_running_loop()
        return await self.ranks.run(loop.run_in_executor(self.executor, fn, *args), self.step_timeout_s)

    def _deliver(self, req: Request, token: Optional[int]) -> None:
        """Hand ``token`` to the client; the engine already applied the stop rule."""
        seq = self.engine.get(req.uid)
        now = time.perf_counter()
        self.generated_tokens += 1
        if seq.generated == seq.resumed + 1:  # the first token generated here
            req.t_first = now
            req.stats.prefill_s = req.stats.ttft_s = now - req.t_start
            self.first_tokens += 1
            self.ttft_seconds_sum += now - req.t_start
        else:
            req.stats.decode_s = now - req.t_first
            req.stats.decode_steps += 1
        req.stats.generated_tokens = seq.generated
        if req.logprobs is not None:
            req.logprobs.append(seq.last_logprob)
        if req.context is not None and token is not None:
            req.context.append(int(token))
        req.out.put_nowait(token)
        req.reason = req.reason or seq.reason

    def _deliver_verified(self, req: Request, v: Verified) -> None:
        """Hand the tokens of one verify step (``v.tokens``, 1 .. k + 1, in order; the engine already
        applied the stop rule token by token) to the client, each with its logprobs entry: what
        :meth:`_deliver` does per token, as one decode step."""
        seq = self.engine.get(req.uid)
        self.generated_tokens += len(v.tokens)
        req.stats.decode_s = time.perf_counter() - req.t_first
        req.stats.decode_steps += 1
        req.stats.generated_tokens = seq.generated
        for i, token in enumerate(v.tokens):
            if req.logprobs is not None:
                req.logprobs.append(v.logprobs[i] if i < len(v.logprobs) else seq.last_logprob)
            if req.context is not None:
                req.context.append(int(token))
            req.out.put_nowait(token)
        req.reason = req.reason or seq.reason

    def _frame(self, plan: Plan) -> pb.Frame:
        """The ``stepPlan`` frame of ``plan``: what every rank runs, rank 0 included (through
        :func:`~mlxcluster.control.executor.parts`); ranks N get :meth:`_for_ranks` of it."""
        leaves = [fr.session_stop(r.uid, r.reason or pb.CANCELLED, "client went away" if r.cancelled else "")
                  for r in plan.leaves]
        seqs = [self.engine.get(r.uid) for r in plan.decode]
        # each entry: the position its fed token is written at (a queued lookahead step's: it is this
        # plan's decode step), and that token
        decode = [(s.session.uid, self.engine.kv_length(s), s.token) + ((plan.drafts.get(s.session.uid, []),)
                                                                  if plan.drafts else ()) for s in seqs]
        joins = [fr.prompt_tokens(r.uid, r.prompt, r.max_tokens, sampling=fr.sampling_message(r.sampling),
                                  eos_token_ids=r.eos, source=r.source, cached=r.cached, chunked=r.chunked,
                                  salt=r.salt, disk=r.disk, every_rank_samples=r.every_rank,
                                  resumed=len(r.resumed))
                 for r in plan.joins]
        chunks = [fr.prefill_chunk(r.uid, position, count) for r, position, count in plan.chunks]
        embeds = [fr.embed_entry(f"{job.uid}.{i}", job.inputs[i]) for job, i in plan.embeds]
        return fr.step_plan(leaves, decode, joins, chunks, plan.batched, route=self.route_id if joins else "",
                            epoch=self.epoch if joins else "", step=plan.step, embeds=embeds,
                            kept=self._take_kept(), ahead=plan.ahead, settled=plan.settled)

    def _for_ranks(self, frame: pb.Frame) -> Optional[pb.Frame]:
        """The copy of rank 0's plan ``frame`` for ranks N (``None``: nothing for them to run; with
        ``--local-decode`` rank 0 decodes alone, so no decode entries)."""
        p = frame.step_plan
        if self.local_decode and (p.decode or p.ahead or p.settled):
            full, frame = frame, pb.Frame()
            frame.CopyFrom(full)
            del frame.step_plan.decode[:]
            frame.step_plan.ahead = frame.step_plan.settled = False
            p = frame.step_plan
        if not (p.leaves or p.decode or p.joins or p.chunks or p.embeds or p.kept):
            return None
        return frame

    async def _execute(self, plan: Plan) -> None:
        """Run ``plan`` here through the one executor every rank N runs its copy of the frame with
        (:func:`~mlxcluster.control.executor.parts`: the order exists once), sent to them first; each
        part is awaited through this scheduler's side of it (:meth:`settle` .. :meth:`embeds`: what rank
        0 collects), its MLX work one call on the MLX thread (so the stuck-group watchdog times one part
        of one step)."""
        self._plan = plan
        frame = self._frame(plan)
        self._plan_requests = {r.uid: r for r in plan.leaves + plan.decode + plan.joins}
        self._plan_requests.update((r.uid, r) for r, _, _ in plan.chunks)
        self._refused = []
        if self.ranks.links:
            for req in plan.leaves:
                if not req.cancelled:
                    self.ranks.expect_acks(req.uid)
            for req in plan.joins:  # registered before the plan goes out: their replies may come at once
                if req.source == fr.HANDOFF:
                    self.ranks.expect_kv(req.uid, {
                        rank: KvStream(req.uid, want, 0, who=f"rank {rank}'s KV handoff")
                        for rank, want in handoff.expected_senders(self.model.route, self.epoch, req.prompt,
                                                                   self.model.identity).items()})
                elif req.source == fr.REMOTE:
                    self.ranks.expect_kv(req.uid, {rank: None for rank in self.ranks.ranks})
            sent = self._for_ranks(frame)
            if sent is not None:
                self.ranks.send(sent)
        if not plan.decode:
            self._last_step_end = 0.0
        t0 = None
        for part in parts(frame.step_plan):
            if t0 is None and isinstance(part, (Admit, HandOff, RemoteJoin, Chunk)):
                t0 = time.perf_counter()
            await self.run_part(part)
        if t0 is not None:
            self._admission = (sum(len(r.prompt) - r.cached for r in plan.joins if not r.chunked) +
                               sum(count for _, _, count in plan.chunks), t0)
            self._interrupted = True
        if plan.embeds:
            self._interrupted = True
        self._plan = None

    # -- the parts of a plan on rank 0 (executor.PlanSide): what rank 0 collects -----------------

    async def settle(self, part: Settle) -> None:
        """Nothing: rank 0 applied its own verify step's kept counts, and added its accepted remote
        joins to the batch, in the plan that made them."""

    async def leave(self, part: Leave) -> None:
        req = self._plan_requests[part.uid]
        self.ranks.forget_kv(req.uid)  # a handoff cancelled before its K/V came
        await self._mlx(self._remove, [req])
        self._interrupted = True
        req.reason = req.reason or pb.CANCELLED
        req.stats.reason = req.reason
        req.out.put_nowait(END)

    async def decode(self, part: Decode) -> None:
        plan = self._plan
        if plan.drafts:
            await self._verify_step(plan.decode, plan.drafts)
        else:  # embeds leave the batch as it is: the step may look ahead beside them
            await self._decode_step(plan.decode, lookahead=part.ahead)

    def _remove(self, leaves: List[Request]) -> None:
        """On the MLX thread: free each leaving sequence's KV cache, and its drafter's."""
        for req in leaves:
            self.engine.remove(req.uid)
            if req.drafter is not None and hasattr(req.drafter, "close"):
                req.drafter.close()

    def _in_flight(self) -> List[Request]:
        """Every request the loop has taken from the queue and not ended: the batch, the chunked
        prefills, and the joins of the plan being run that are not placed in either yet (a group
        that fails during a join's prefill or K/V wait must still end them)."""
        held = self._running + self._chunking
        placed = {r.uid for r in held} | {r.uid for r in self._waiting}
        return held + [r for r in (self._plan.joins if self._plan is not None else []) if r.uid not in placed]

    async def admit(self, part: Admit) -> None:
        """The computed and handoff joins get their KV caches (cached prefix taken); a disk join
        learns how many positions every rank's disk tier held."""
        admitted = [self._plan_requests[j.uid] for j in part.joins]
        await self._mlx(lambda: [self.engine.admit(r.uid, r.prompt, r.sampling, r.eos, r.max_tokens,
                                                   Compute(r.cached, r.salt, r.disk), resumed=r.resumed)
                                 for r in admitted])
        for r in admitted:
            if r.disk:  # the positions every rank's disk tier held (PrefixCache.take from_disk)
                got = self.engine.get(r.uid).session.position
                self.cached_prompt_tokens += got - r.cached
                r.stats.cached_prompt_tokens = got
        self._chunking += [r for r in admitted if r.chunked]

    async def prefill(self, part: Prefill) -> None:
        """The computed joins not chunked: one batched prefill when the plan says so, else one by one;
        each prefilled sequence joins (:meth:`_joined`)."""
        whole = [self._plan_requests[j.uid] for j in part.joins]
        if part.together:
            self.batched_prompts += len(whole)
            tokens = await self._mlx(self.engine.prefill_admitted, [r.uid for r in whole], True)
        else:
            tokens = [(await self._mlx(self.engine.prefill_admitted, [r.uid]))[0] for r in whole]
        for req, token in zip(whole, tokens):
            await self._joined(req, token)

    async def hand_off(self, part: HandOff) -> None:
        """``--local-decode``: prefilled through the pipeline now; the other stages' K/V then taken."""
        req = self._plan_requests[part.join.uid]
        await self._joined(req, (await self._mlx(self.engine.prefill_admitted, [req.uid]))[0])

    async def remote_join(self, part: RemoteJoin) -> None:
        why = await self._join_remote(self._plan_requests[part.join.uid])
        if why is not None:
            self._refused.append(fr.session_stop(part.join.uid, pb.ERROR, why[:200]))

    async def remote_joined(self, part: RemoteJoined) -> None:
        """After the plan's remote joins: the refused ones leave every rank N in one plan of their own,
        before any other (:meth:`Follower.run`); the accepted ones join rank 0's batch now, as on ranks
        N at the next plan."""
        if self._refused:
            self._steps += 1
            self.ranks.send(fr.step_plan(leaves=self._refused, step=self._steps, kept=self._take_kept()))
            self._refused = []
        await self._mlx(self.engine.join_remote)

    async def embeds(self, part: Embeds) -> None:
        await self._run_embeds(self._plan)

    async def _joined(self, req: Request, token: Optional[int]) -> None:
        """``req``'s prompt was prefilled here (at once or by its last chunk): it runs (it decodes from
        the next plan on, in the batch order the engine gave it, the same on every rank), its first
        token is delivered, and with ``--local-decode`` the other stages' K/V are taken
        (:meth:`_take_handoff`)."""
        self._running.append(req)
        self._measure_kv()
        self._deliver(req, token)
        if req.source == fr.HANDOFF:
            await self._take_handoff(req)

    async def chunk(self, part: Chunk) -> None:
        """One prefill chunk (:meth:`_chunk_tokens` sized it), its own call on the MLX thread (so the
        stuck-group watchdog times one chunk, never a whole prompt).  A request whose last chunk ran
        joins the decode batch (its first token delivered)."""
        req = self._plan_requests[part.uid]
        t0 = time.perf_counter()
        token = await self._mlx(self.engine.prefill_chunk, req.uid, part.count)
        self._last_chunk = (part.count, time.perf_counter() - t0)
        if self.engine.get(req.uid).prefilling:
            return
        self._chunking.remove(req)
        await self._joined(req, token)

    async def _take_handoff(self, req: Request) -> None:
        """Wait for the other stages' K/V of ``req`` (each rank's :class:`KvStream`, fed by the
        link), check and install it on the MLX thread; a refused handoff is dropped whole and
        ``req`` goes on from K/V computed here (:meth:`RankEngine.recompute`: every layer), never
        from partial state -- the one fallback rule.  A lost or failing rank raises
        :class:`RankError` (the group is broken).  Its bytes, seconds and any refusal go into
        ``req.stats``."""
        t0 = time.perf_counter()
        waits = await self.ranks.wait_kv(req.uid, self.step_timeout_s)
        req.stats.handoff_bytes = sum(w.receiver.bytes for w in waits.values())
        req.stats.handoff_fallback = await self._mlx(self._adopt, req.uid, waits) or ""
        req.stats.handoff_s = time.perf_counter() - t0

    def _adopt(self, uid: str, waits) -> Optional[str]:
        """On the MLX thread: install the checked K/V of ``uid`` (rank -> :class:`KvWait`); returns
        ``None``, or the one-line reason the handoff was refused (then every layer was computed here)."""
        try:
            kv = {}
            for rank, wait in sorted(waits.items()):
                if wait.refused:
                    raise handoff.HandoffError(wait.refused)
                kv.update(wait.receiver.result()[0])  # HandoffError where incomplete or inconsistent
            self.engine.install(uid, kv)
            return None
        except ValueError as exc:  # HandoffError, or a layer install refused
            log.warning("refused the KV handoff of %s: %s; computing every layer on rank 0 instead", uid, exc)
            self.engine.recompute(uid)
            return str(exc)

    async def _join_remote(self, req: Request) -> Optional[str]:
        """Prefill/decode disaggregation: every rank (ranks N on the plan's remote join, rank 0
        here) fetches its own KV heads of the prompt from the prefill group, which streams them per
        (chunk, layer) while it computes; rank 0 decodes it only once every rank installed its K/V,
        from the prefill group's first token.  If any rank refused its stream (a check failed, the
        stream ended early, the prefill group is lost), every rank drops what it holds (a leave)
        and the request waits at the head of the queue to join again with its K/V computed by this
        group (the one fallback rule) -- never decoded from partial state.  Returns ``None``, or why
        it was refused: :meth:`_join` then sends the leaves of the plan's refused joins as one plan, with
        reason ``ERROR`` (a rank N that installed the K/V drops it without adding it to its batch:
        :meth:`RankEngine.join_remote`; an accepted one joins rank 0's batch after the plan).  A resumed request
        (:meth:`generate`'s ``resume``) never comes here: the prefill group samples the answer's
        token 0, so it joins with a computed source from the start, as after a refusal.  A lost
        rank N raises :class:`RankError` (the group is broken)."""
        from ..engine.pd import PdError

        s, pd = req.sampling, self.decode_side
        t0, refused, got = time.time(), None, None
        try:
            got = await pd.fetch_async(req.uid, req.prompt, fr.sampling_message(s))
        except PdError as exc:
            refused = f"rank 0: {exc}"
        waits = await self.ranks.wait_kv(req.uid, self.step_timeout_s) if self.ranks.links else {}
        others = {rank: w.refused for rank, w in waits.items() if w.refused}
        missing = [rank for rank, w in sorted(waits.items()) if not w.done]
        if refused is None and others:
            rank = min(others)
            refused = f"rank {rank}: {others[rank]}"
        if refused is None and missing:
            refused = f"rank(s) {missing} did not install their K/V within {self.step_timeout_s:.0f} s"
        if refused is None:
            try:
                # got.kv() makes MLX arrays: on the MLX thread, like the install
                token = (await self._mlx(lambda: self.engine.admit(req.uid, req.prompt, s, req.eos, req.max_tokens,
                                                                   Remote(got.kv(), got.first_token)))).token
            except ValueError as exc:
                refused = f"rank 0: {exc}"
        if refused is None:
            st = req.stats
            st.handoff_bytes = got.bytes + sum(w.answer.total_bytes for w in waits.values())
            st.pd_prefill_s = got.prefill_done_unix - t0
            st.pd_tail_s = time.time() - got.prefill_done_unix
            st.pd_streamed_s = got.prefill_done_unix - got.first_frame_unix
            self._running.append(req)
            self._deliver(req, token)
            return None
        log.warning("request %s: the prefill group's K/V was refused: %s; computing it here", req.uid, refused)
        req.stats.handoff_fallback = refused
        req.computed = True
        self._waiting.appendleft(req)
        return refused

    async def _run_embeds(self, plan: Plan) -> None:
        """The plan's embeds part on rank 0 (ranks N run the same forward pass from the frame): the
        vectors go to their requests; a request whose every input is computed is answered."""
        from ..engine import embed as _embed

        inputs = [job.inputs[i] for job, i in plan.embeds]
        vectors = await self._mlx(_embed.embed, self.model, inputs, [job.mode for job, _ in plan.embeds])
        self.embedded_inputs += len(inputs)
        for (job, i), row in zip(plan.embeds, vectors):
            job.vectors[i] = row
            if len(job.vectors) == len(job.inputs) and not job.done.done():
                import numpy as np

                job.done.set_result(np.stack([job.vectors[k] for k in range(len(job.inputs))]))
                self._embed_jobs.remove(job)

    # -- generation (the client side) ------------------------------------------------------

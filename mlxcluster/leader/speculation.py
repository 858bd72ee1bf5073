"""Rank 0's speculation policy: how many tokens each drafting sequence drafts per plan, from what was measured.

The scheduler (:mod:`mlxcluster.leader.scheduler`) asks this policy once per plan
(:meth:`SpeculationPolicy._draft_lengths`), gets the drafts (:meth:`SpeculationPolicy._drafts`, after one
``prefetch`` per batch of a draft node, :meth:`SpeculationPolicy._prefetch_drafts`) and, after each verify
step, folds its time back (:meth:`SpeculationPolicy._measure_verify`).  The policy is the batch-wide draft
length of :func:`~mlxcluster.engine.speculative.batch_draft_length` over every drafting sequence's
:class:`~mlxcluster.engine.speculative.AdaptiveK` (Leviathan et al. 2023, section 3.5: ``k`` maximises
tokens per unit of measured time), with probes while the batch does not draft and plain steps while it
does, so that the verify cost is measured against a plain step of the same batch size.

A mixin of :class:`~mlxcluster.leader.scheduler.Scheduler` (issue 42 item 3: the scheduler decides, this
module holds the speculation bookkeeping); it reads the scheduler's ``_running``, ``step_times``,
``lookahead`` and ``engine``, and owns the state :meth:`SpeculationPolicy._init_speculation` makes.
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from typing import TYPE_CHECKING, Deque, Dict, List, Tuple

from ..engine.speculative import SpecStats, batch_draft_length

if TYPE_CHECKING:
    from .scheduler import Request

__all__ = ["SpeculationPolicy", "DEFAULT_DRAFT_TOKENS", "SPEC_COST_PRIOR", "SPEC_COST_WEIGHT", "SPEC_PROBE_EVERY",
           "SPEC_PROBE_BACKOFF", "SPEC_COST_SAMPLES", "SPEC_PLAIN_EVERY"]

#: draft tokens per verify step of a sequence when neither the server (``--draft-tokens``) nor the
#: request says (the bound :class:`~mlxcluster.engine.speculative.AdaptiveK` moves ``k`` under)
DEFAULT_DRAFT_TOKENS = 4

#: the cost of one more verified position relative to a plain decode step before any was measured
#: (:class:`~mlxcluster.engine.speculative.AdaptiveK`'s default), and the weight of each new
#: measurement in its moving average (:meth:`SpeculationPolicy._measure_verify`)
SPEC_COST_PRIOR = 0.1
SPEC_COST_WEIGHT = 0.2
#: while the batch's draft length is 0, every this many plans one step drafts 1 token in every
#: drafting sequence at once (one probe step's cost for the whole batch: what the acceptance rates and
#: the verify cost are measured by; :meth:`SpeculationPolicy._draft_lengths`).  A probe after which the batch
#: still does not draft doubles the interval, up to ``SPEC_PROBE_EVERY * min(batch,
#: SPEC_PROBE_BACKOFF)`` plans (a probe costs every sequence of the batch its wait); a plan that
#: drafts resets it
SPEC_PROBE_EVERY = 8
SPEC_PROBE_BACKOFF = 8
#: the verify cost at a batch size and draft length is the median of this many latest samples
#: (:meth:`SpeculationPolicy._measure_verify`): one step slowed by the host is no measurement
SPEC_COST_SAMPLES = 5
#: while the batch drafts, every this many plans one step drafts nothing: a plain step of this batch,
#: what the verify steps' cost is measured against (:meth:`SpeculationPolicy._draft_lengths`)
SPEC_PLAIN_EVERY = 32


class SpeculationPolicy:
    """The draft length of each plan and the measured costs it is decided by (see the module docstring)."""

    def _init_speculation(self) -> None:
        """The policy's state, measured from nothing."""
        self.spec_stats = SpecStats()  # verify steps of sequences that had a draft
        #: measured time of one more verified position relative to a plain decode step (AdaptiveK's cost)
        self.spec_cost = SPEC_COST_PRIOR
        #: the same by batch size (a verify step's cost per position grows with the batch where the
        #: step is compute-bound): batch -> median of its latest samples (:meth:`spec_cost_at`)
        self.spec_costs: Dict[int, float] = {}
        self._spec_samples: Dict[Tuple[int, int], Deque[float]] = {}  # (batch, draft length) -> latest samples
        self._spec_idle = 0  # plans since the batch last drafted (SPEC_PROBE_EVERY)
        self._probe_every = SPEC_PROBE_EVERY  # the current probe interval (SPEC_PROBE_BACKOFF)
        self._probed = False  # the last plan was a probe
        self._plain_due = 0  # plain steps the batch takes before it drafts again (their time is measured)
        self._spec_run = 0  # plans the batch drafted since its last plain step (SPEC_PLAIN_EVERY)

    def _draft_lengths(self) -> Dict[str, int]:
        """Each drafting sequence's draft length this plan (uid -> k > 0), decided for the batch at once:
        :func:`batch_draft_length` over every drafting sequence's acceptance rate, bound, draft time and
        how often its drafter proposes anything, at the verify cost measured at this batch
        size (:meth:`spec_cost_at`) -- a verify step pads every row and every sequence of the batch waits
        for it, so a batch drafts only where the tokens it yields pay for that.  While that length is 0,
        every :data:`SPEC_PROBE_EVERY`-th plan probes with 1 draft token in every drafting sequence (one
        verify step for all, rather than each sequence's probe making a verify step of its own); a probe
        after which the batch still does not draft doubles that interval (:data:`SPEC_PROBE_BACKOFF`), a
        plan that drafts resets it.
        Before the verify cost was measured near this batch size the batch drafts at most 1 token (a
        probe of the cost: the prior, or a cost measured at another size, let a batch of 32 draft 3-4
        tokens at ~3x a plain step's time).  A verify
        step's cost is measured against a plain step of the same batch size: while none was measured
        near this size (:meth:`_plain_measured`), and every :data:`SPEC_PLAIN_EVERY`-th plan of a
        drafting run, the batch takes a plain step instead (else a plain step measured once at another
        size, extrapolated, stands for it for good) -- two with lookahead, whose first step after a
        verify step is no steady step (:meth:`_decode_step`).  The length reaches each sequence as its
        :attr:`AdaptiveK.step_k` (:meth:`AdaptiveK.next_k`)."""
        drafting = [r for r in self._running if r.adaptive is not None and not (r.cancelled or r.reason)]
        if not drafting:
            return {}
        batch = len([r for r in self._running if not (r.cancelled or r.reason)])
        m = batch_draft_length(batch, [(r.adaptive.alpha, r.adaptive.max_k, r.adaptive.draft_cost,
                                        r.adaptive.proposal_rate) for r in drafting], self.spec_cost_at(batch))
        if m and not self._plain_measured(batch):
            self._plain_due = max(self._plain_due, 1)  # what a verify step of this size is measured against
        elif m and not self._cost_measured(batch):
            m = 1  # a probe: the verify cost near this batch size is measured before longer drafts
        if m:
            self._probe_every = SPEC_PROBE_EVERY
        elif self._probed:  # the last probe's measurements still say no: probe half as often
            self._probe_every = min(SPEC_PROBE_EVERY * max(1, min(batch, SPEC_PROBE_BACKOFF)), 2 * self._probe_every)
        self._probed = False
        self._spec_idle = 0 if m else self._spec_idle + 1
        if self._spec_idle >= self._probe_every:
            m, self._spec_idle, self._probed = 1, 0, True
        self._spec_run = self._spec_run + 1 if m else 0
        if m and self._spec_run >= SPEC_PLAIN_EVERY:
            # after a verify step the first plain step restarts lookahead (not a steady step): two then
            self._plain_due = 2 if self.lookahead else 1
        if m and self._plain_due:  # a plain step: what the verify steps are measured against
            m, self._spec_run, self._probed = 0, 0, False
        if not m:
            self._plain_due = max(0, self._plain_due - 1)
        for r in drafting:
            r.adaptive.step_k = m
        return {r.uid: k for r in drafting for k in (r.adaptive.next_k(),) if k > 0}

    def _cost_measured(self, batch: int) -> bool:
        """Whether a verify step's cost was measured at a batch near ``batch`` (within a factor of 2)."""
        return any(batch <= 2 * x and x <= 2 * batch for x in self.spec_costs)

    def _plain_measured(self, batch: int) -> bool:
        """Whether :attr:`step_times` holds a plain decode step of a batch near ``batch`` sequences (within
        a factor of 2): its prediction at ``batch`` is then measured, not extrapolated."""
        return any(batch <= 2 * x and x <= 2 * batch for x, _ in self.step_times.decode.samples)

    def spec_cost_at(self, batch: int) -> float:
        """The measured time of one more verified position relative to a plain step, at ``batch``
        sequences: its own measurement, else the nearest batch size's (by ratio), else
        :data:`SPEC_COST_PRIOR`."""
        if batch in self.spec_costs:
            return self.spec_costs[batch]
        if not self.spec_costs:
            return SPEC_COST_PRIOR
        return self.spec_costs[min(self.spec_costs, key=lambda b: (abs(math.log(b / max(1, batch))), b))]

    def _drafts(self, decode: List[Request], ks: Dict[str, int]) -> Tuple[Dict[str, List[int]], Dict[str, float]]:
        """The drafts of the plan's decode step: each drafting sequence of ``decode`` (uid -> ``k`` of
        its :class:`AdaptiveK` this step, in ``ks``) proposes up to ``k`` tokens after its prompt and
        answer so far, clamped to what it may still write (:meth:`RankEngine.clamp_draft`); empty
        drafts are left out (no entry: no verify step).  Returns ``(drafts, seconds)``: uid -> the
        seconds its drafter spent drafting (its ``draft_s``, else the call's wall time).  Runs on the
        MLX thread when a drafter runs a model (:meth:`_schedule`)."""
        out, seconds = {}, {}
        for req in decode:
            k = ks.get(req.uid)
            if k and not req.reason:
                t0 = time.perf_counter()
                proposed = req.drafter.propose(req.context, k)
                took = req.drafter.draft_s
                seconds[req.uid] = time.perf_counter() - t0 if took is None else took
                draft = self.engine.clamp_draft(req.uid, proposed)
                if req.adaptive is not None:
                    req.adaptive.proposed(bool(proposed))
                if draft:
                    out[req.uid] = draft
        return out, seconds

    async def _prefetch_drafts(self, decode: List[Request], ks: Dict[str, int]) -> None:
        """The batch hook of drafters asked together (:attr:`Drafter.batch`, a draft node's
        :class:`RemoteDrafts`): one ``prefetch`` per batch object with every drafting sequence of the
        plan that shares it, before :meth:`_drafts` asks each drafter (which then answers from it)."""
        groups: Dict[int, Tuple[object, list]] = {}
        for req in decode:
            k, batch = ks.get(req.uid), getattr(req.drafter, "batch", None)
            if k and batch is not None and not req.reason:
                groups.setdefault(id(batch), (batch, []))[1].append((req.drafter, req.context, k))
        for batch, items in groups.values():
            await batch.prefetch(items)

    def _measure_drafts(self, decode: List[Request], drafts: Dict[str, List[int]], seconds: Dict[str, float]) -> None:
        """Each drafting sequence's time per draft token relative to a plain step of this batch
        (:attr:`step_times`' prediction) into its :class:`AdaptiveK`'s ``draft_cost`` (moving average,
        weight :data:`SPEC_COST_WEIGHT`): a draft model's forward passes count against its ``k``.  No
        plain step measured yet: nothing changes."""
        plain = self.step_times.predict(len(decode))
        if not plain:
            return
        for req in decode:
            if req.uid in drafts and req.uid in seconds and req.adaptive is not None:
                sample = seconds[req.uid] / len(drafts[req.uid]) / plain
                req.adaptive.draft_cost += SPEC_COST_WEIGHT * (sample - req.adaptive.draft_cost)

    def _measure_verify(self, batch: int, positions: int, seconds: float) -> None:
        """A verify step of ``batch`` sequences x ``positions`` took ``seconds``: the cost of one more
        verified position relative to a plain step of that batch (:attr:`step_times`' prediction, what
        a plain step costs here with lookahead and the compiled step), ``(seconds / plain - 1) /
        (positions - 1)``, into :attr:`spec_cost` (moving average, weight :data:`SPEC_COST_WEIGHT`)
        and every drafting request's :class:`AdaptiveK`, and by batch size into :attr:`spec_costs`: per
        draft length the median of its latest :data:`SPEC_COST_SAMPLES` samples at that size, the
        largest of them (on this CPU at 32 sequences a verify step of 2 positions costs ~0.5 of a plain
        step per draft position, one of 4 ~0.85: the cost grows faster than linearly where the step is
        compute-bound, and drafting is decided by a linear model) -- what :meth:`_draft_lengths` decides
        by; only where a plain step of a batch near this size was measured, :meth:`_plain_measured`):
        ``k`` then maximises tokens per unit of measured
        time (Leviathan et al. 2023, section 3.5), so where verifying costs what it yields (a
        CPU-bound step, a large batch) speculation turns itself down.  No plain step measured yet:
        nothing changes."""
        plain = self.step_times.predict(batch)
        if not plain or positions < 2 or not self._plain_measured(batch):
            return
        sample = max(0.0, (seconds / plain - 1.0) / (positions - 1))
        self.spec_cost += SPEC_COST_WEIGHT * (sample - self.spec_cost)
        samples = self._spec_samples.setdefault((batch, positions - 1), collections.deque(maxlen=SPEC_COST_SAMPLES))
        samples.append(sample)
        self.spec_costs[batch] = max(float(statistics.median(d)) for (b, _), d in self._spec_samples.items()
                                     if b == batch)
        for req in self._running:
            if req.adaptive is not None:
                req.adaptive.cost = self.spec_cost

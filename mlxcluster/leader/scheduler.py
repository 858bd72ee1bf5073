"""Rank 0's scheduler: the one admission queue, and the continuous-batching loop that plans every step.

The ONE admission queue of the system: ``generate()`` calls from any number of
concurrent clients wait in a bounded FIFO (at most ``max_queue``, else
:class:`~mlxcluster.protocol.errors.QueueFullError`), and the decode loop
(:meth:`Scheduler._decode_loop`) admits them into the running batch (at most
``max_batch`` sequences, a cap) at step boundaries.  Each iteration of the loop is one
:class:`Plan` (vLLM's ``schedule() -> SchedulerOutput -> execute_model``): :meth:`Scheduler._schedule`
decides it, one ``stepPlan`` frame carries it to every rank N, and every rank runs it in the same
order (:func:`~mlxcluster.control.executor.parts`; rank 0's side :mod:`~mlxcluster.leader.execution`, rank N's
:class:`~mlxcluster.control.follower.Follower`):

1. **leaves**: finished or cancelled sequences free their KV caches (each acknowledged by every rank N);
2. **decode**: one decode step of the rest of the batch, :meth:`RankEngine.step`, on the tokens rank 0
   sampled in the step before (the one decode path at TP>1; ranks N sampling a lone sequence
   themselves, "self-sampling", was measured not to win beyond noise and removed, BENCHMARKS.md).
   With a group of one rank the step runs with lookahead (mlx-lm's ``generate_step`` pipelining:
   the next step is queued on this step's lazy tokens) where the engine measured that to overlap
   anything, and no join follows in the plan.  **Speculative decoding** (issue 30; a request's
   ``speculative`` or the server's ``--draft``): a sequence that drafts gets, per plan, a draft of up
   to ``k`` tokens from its drafter (:func:`~mlxcluster.engine.speculative.make_drafter`: ``ngram``,
   prompt lookup over its prompt and answer so far, on the event loop; ``model:PATH``, a draft model
   with the target's tokenizer, or ``layers:N``, the target's first N layers with its norm and head,
   each a :class:`~mlxcluster.engine.drafters.ModelDrafter` with its own KV cache over weights loaded
   once (:class:`~mlxcluster.engine.drafters.DraftModels`), drafting on the MLX thread;
   ``remote:HOST:PORT``, a draft node's model, asked once per plan for every such sequence of the batch,
   :mod:`~mlxcluster.leader.speculation` and :mod:`~mlxcluster.leader.remote_draft`), ``k`` from its
   :class:`~mlxcluster.engine.speculative.AdaptiveK` (the measured acceptance rate, verify cost and
   draft time, bounded by ``--draft-tokens``; decided for the whole batch at once,
   :func:`~mlxcluster.engine.speculative.batch_draft_length`, since a verify step pads every row
   and every sequence waits for it: at a batch size where verifying costs more than it yields, no
   sequence drafts but a probe step now and then), clamped by
   :meth:`RankEngine.clamp_draft`; when any sequence of the batch has one, the decode step is a
   verify step (:meth:`RankEngine.verify`: ONE forward of each sequence's token and draft, the
   sequences without a draft taking one token in it) and every emitted token (1 .. k + 1 per
   sequence) is delivered in order through the one token path; the next plan carries each
   sequence's kept count (``StepPlan.kept``) for ranks N's rollback.  A queued lookahead step is
   settled (its token delivered) before a verify step, never thrown away; steps without a draft
   keep lookahead and the compiled step.  A grammar-constrained request decodes one token per step
   (its mask needs each token on the host before the next): it never drafts;
3. **joins**: waiting requests, in order, each with its K/V source (``promptTokens``): computed
   (after the longest prefix it shares with an earlier prompt in the ranks' prefix caches,
   :class:`~mlxcluster.engine.prefix_cache.PrefixCache`; short prompts prefilled now, together as one
   batched prefill, :meth:`RankEngine.prefill_admitted`, where the model allows it), a
   ``--local-decode`` handoff, or a prefill group's stream (PD).  A request joins while the batch
   is below ``max_batch`` (and, with an inter-token latency target ``itl_target_s``, below the
   size whose step :class:`StepTimes` predicts from the steps measured to exceed it), the KV
   caches the batch may grow to fit ``kv_budget_bytes`` (each sequence counted at ``min(prompt +
   max_tokens, context)`` positions times the KV bytes per position measured on the first
   prefill), and the plan's prompt tokens stay within ``PREFILL_TOKENS_PER_STEP`` (at least one
   prompt) -- and, with ``itl_target_s`` and streams running, within what the measured prefill
   times say fits in the target beside the next decode step (:meth:`StepTimes.prefill_tokens`):
   running streams keep flowing while a crowd arrives.  A joined sequence is decoded from the
   next plan on;
4. **chunks**: a prompt longer than one chunk (``PREFILL_CHUNK_TOKENS``) joins without a prefill
   (``chunked``) and is prefilled one chunk per plan (``prefillChunk``; beside running streams a
   chunk sized to take ``PREFILL_CHUNK_TARGET_S``, :func:`next_chunk`), each chunk one call on the
   MLX thread: the stuck-group watchdog times a chunk, never a prompt;
5. **embeds**: embedding inputs (:meth:`Scheduler.embed`, queued FIFO beside the requests: they hold
   no KV cache, so no batch slot) taken while the plan's padded batch stays within
   ``EMBED_TOKENS_PER_STEP`` (at least one input): one forward pass on every rank, pooled by rank 0
   (:mod:`mlxcluster.engine.embed`).  A request's inputs may span plans; it is answered when its
   last input is computed.

A refused K/V source is computed -- the one fallback rule: a refused handoff by rank 0 alone (it
decodes alone), a refused remote prefill by the group (the request leaves and joins again).
Every sequence ends with a leave (EOS, max_tokens, full context, an error or cancellation)
-- always.  The loop is an asyncio task; all MLX work
runs on ``executor`` (one thread) through :class:`~mlxcluster.engine.decode.RankEngine`;
frames and replies go through :class:`~mlxcluster.control.link.RankGroup`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import statistics
import time
import uuid
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import AsyncIterator, Dict, Iterable, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..config import config
from ..control.link import RankError, RankGroup
from ..engine import passes
from ..engine.decode import RankEngine
from ..engine.drafters import DraftModels
from ..engine.sampling import Sampling
from ..engine.speculative import MAX_DRAFT_TOKENS, AdaptiveK, Drafter, make_drafter, parse_draft
from ..protocol import frames as fr
from ..protocol import mlxcluster_pb2 as pb
from ..protocol.errors import QueueFullError
from .execution import END as _END
from .execution import Rank0Execution
from .remote_draft import RemoteDrafter, RemoteDrafts
from .speculation import DEFAULT_DRAFT_TOKENS, SpeculationPolicy

log = logging.getLogger(__name__)

__all__ = ["Scheduler", "AheadChoice", "SessionStats", "StepTimes", "LinearCost", "RankError", "QueueFullError", "next_chunk", "salt_namespace",
           "DEFAULT_DRAFT_TOKENS"]


#: prompt tokens prefilled between two decode steps of a running batch (at least one prompt):
#: mlx-lm's ``prefill_step_size`` default.  Measured (BENCHMARKS.md, issue 17) with batched prefill
#: at 32/64 clients: 256 -> 79.8/74.8 tok/s, 1024 -> 95.4/94.7, 2048 -> 93.6/97.2 (TTFT p95 3.4/6.9 s
#: against 4.7/10.8 s at 256): a crowd is admitted in few large groups, the decode batch fills sooner.
PREFILL_TOKENS_PER_STEP = 2048

#: padded tokens (inputs x the longest input) of one plan's embeds part: at least one input runs
#: (an input may be as long as the context); the prefill budget's size, as embedding inputs are
#: prompts that are only prefilled
EMBED_TOKENS_PER_STEP = PREFILL_TOKENS_PER_STEP

#: seconds one prefill chunk may hold the running streams' next decode step (without an inter-token
#: latency target): a long prompt prefilled beside running streams is cut into chunks predicted to
#: take about this long (:func:`next_chunk`); alone it goes in whole ``PREFILL_CHUNK_TOKENS`` chunks.
#: Measured here (BENCHMARKS.md, long prompts): a 512-token chunk at ~2.5K positions takes ~5 s on
#: this CPU, which held every running stream's next token that long; with the step plan (one decode
#: step per chunk), 0.5 s left a "Hi" beside a 2.7K-token prompt at 24 % / 28 % of the long request's
#: time (TP=1 / TP=3) and 0.25 s at 18 % / 21 %, the long request's time unchanged.
PREFILL_CHUNK_TARGET_S = 0.25
#: seconds one prefill chunk takes with no stream beside it: a request that arrives meanwhile waits
#: for the chunk in flight (whole 512-token chunks at ~2.5K positions took ~5 s here, and a "Hi" sent
#: beside such a prompt waited that long first: issue 42 asks for at most 10 % of the long request's
#: time).  Chunks are cheap to cut on this CPU (the cost is per token, ~10 ms at 2.5K positions), less
#: so over a slow collective (MLX's ring: ~4 ms per all_sum, 61 a forward pass of the default model).
PREFILL_CHUNK_ALONE_S = 0.75
#: the smallest chunk beside running streams (a chunk has a fixed cost of its own)
PREFILL_CHUNK_MIN_TOKENS = 32
#: a stream's first tokens decode without prefill chunks beside them (decode priority for new short
#: requests, as a "Hi" beside a long prompt's prefill expects; vLLM's scheduler likewise serves the
#: running decodes before new prefill chunks, vllm/v1/core/sched/scheduler.py) ...
PREFILL_PAUSE_FRESH_TOKENS = 16
#: ... for at most this many seconds in a row, so a stream of new requests never starves a long prompt
PREFILL_PAUSE_MAX_S = 2.0


def next_chunk(last: Optional[Tuple[int, float]], target_s: float, low: int, high: int) -> int:
    """Prompt tokens for the next prefill chunk so that it takes about ``target_s`` seconds, from the
    last chunk's ``(tokens, seconds)`` (``None``: none measured yet): the last chunk's tokens scaled
    by ``target_s / seconds``, at most doubled (a chunk's cost per token grows with its position: grow
    with care), within ``[low, high]``; ``low`` without a measurement.  A multiplicative feedback
    rule, as Sarathi-Serve sizes its chunks from a latency target (arXiv:2403.02369), with the cost
    measured instead of profiled."""
    if last is None or last[0] < 1 or last[1] <= 0:
        return low
    tokens, seconds = last
    n = min(2 * tokens, int(tokens * target_s / seconds))
    return max(low, min(high, n))


class LinearCost:
    """Seconds of an operation of size ``x`` (a batch's sequences, a prefill group's tokens) from its
    recent measurements: ``seconds = a + b * x`` fitted by least squares over the last ``window``
    (``a, b >= 0``); while every measurement had one size, ``seconds`` is taken as proportional to
    ``x`` (the larger, safe side of any such line through that point).  The window keeps the fit
    current as the sequences' KV caches grow."""

    def __init__(self, window: int = 32):
        self.samples: "collections.deque[Tuple[int, float]]" = collections.deque(maxlen=max(2, window))

    def record(self, x: int, seconds: float) -> None:
        """An operation of size ``x`` took ``seconds`` (wall time); nonsense (``x < 1``, ``seconds <= 0``)
        is ignored."""
        if x >= 1 and seconds > 0:
            self.samples.append((int(x), float(seconds)))

    def line(self) -> Optional[Tuple[float, float]]:
        """``(a, b)``: predicted seconds ``a + b * x``; ``None`` before any measurement."""
        if not self.samples:
            return None
        n = len(self.samples)
        mx_ = sum(x for x, _ in self.samples) / n
        ms = sum(t for _, t in self.samples) / n
        var = sum((x - mx_) ** 2 for x, _ in self.samples)
        if var == 0:
            return 0.0, ms / mx_
        slope = max(0.0, sum((x - mx_) * (t - ms) for x, t in self.samples) / var)
        return max(0.0, ms - slope * mx_), slope

    def predict(self, x: int) -> Optional[float]:
        """Predicted seconds at size ``x`` (``None`` before any measurement)."""
        fit = self.line()
        return None if fit is None else fit[0] + fit[1] * x

    def largest(self, budget_s: float, cap: int) -> Optional[int]:
        """The largest size in ``[0, cap]`` predicted to take at most ``budget_s`` seconds, and at
        most twice the largest size measured: the line is trusted that far beyond its data and no
        further (``None`` before any measurement)."""
        fit = self.line()
        if fit is None:
            return None
        a, b = fit
        if a > budget_s:
            return 0
        trusted = min(cap, 2 * max(x for x, _ in self.samples))
        return trusted if b <= 0 else max(0, min(trusted, int((budget_s - a) / b + 1e-9)))


class StepTimes:
    """The inter-token latency a running stream sees, predicted from measured times, and how large
    the decode batch and the prefill group between two of its steps may be within a target.

    Every running stream waits, per token, one decode step of the batch plus whatever prefill group
    was admitted before that step.  :attr:`decode` fits a step's seconds by batch size (a fixed part:
    reading the weights, the collectives; a part per sequence: its activations and attention),
    :attr:`prefill` a group's seconds by the prompt tokens it prefills (:class:`LinearCost`; Sarathi-
    Serve's budget of prefill tokens per iteration, arXiv:2403.02369, with the budget from measured
    times instead of a profile).  A decode step is measured only when nothing else ran since the
    step before (what a stream sees between two tokens while the batch is unchanged); a prefill
    group's cost is the whole interruption it causes: from its admission to the end of the decode
    step after it, less that step's predicted time (the step after a batch change may also copy the
    batch's KV caches, and runs without lookahead).  A plain object: the scheduler records,
    :meth:`limit` and :meth:`prefill_tokens` decide.
    """

    def __init__(self, window: int = 32):
        self.decode = LinearCost(window)
        self.prefill = LinearCost(window)

    def record(self, batch: int, seconds: float) -> None:
        """One decode step of ``batch`` sequences took ``seconds``."""
        self.decode.record(batch, seconds)

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """One prefill group of ``tokens`` prompt tokens interrupted the decode steps for ``seconds``."""
        self.prefill.record(tokens, seconds)

    def predict(self, batch: int) -> Optional[float]:
        """Predicted seconds of one decode step of ``batch`` sequences (``None`` before any step)."""
        return self.decode.predict(batch)

    def limit(self, target_s: float, cap: int) -> int:
        """The largest batch in ``[1, cap]`` predicted to step within ``target_s`` seconds: ``cap``
        without a target (``target_s <= 0``), 1 before any step was measured (the batch grows once
        one was), at least 1 (a lone sequence always runs)."""
        if target_s <= 0:
            return cap
        n = self.decode.largest(target_s, cap)
        return 1 if n is None else max(1, n)

    def prefill_tokens(self, target_s: float, batch: int, cap: int) -> int:
        """Prompt tokens a prefill group may hold before the next decode step of ``batch`` running
        sequences, so that their inter-token gap (the group, then the step) stays within
        ``target_s``: ``cap`` without a target, with nothing running, or before both were measured;
        0 when the step alone takes the target (then nothing joins until the batch shrinks)."""
        if target_s <= 0 or batch < 1:
            return cap
        step = self.decode.predict(batch)
        n = None if step is None else self.prefill.largest(target_s - step, cap)
        return cap if n is None else n


class AheadChoice:
    """Whether a group's decode steps look ahead, decided by measurement (issue 42: "measure the decode
    path both ways before choosing").  Lookahead hides the next plan's flight over the control link
    (a LAN round of 0.3-5 ms on real clusters) behind the step in flight; where the link is loopback and
    the ranks share fewer cores than there are ranks (this 2-core machine runs 3), the queued steps'
    collectives spin against each other and lookahead cost ~30 % of TP=3 decode here.  So rank 0 times
    :data:`PROBE_STEPS` steady steps each way at one batch size (the first with lookahead), keeps
    lookahead unless the steps without it were more than :data:`MARGIN` faster (median against median),
    and measures again after :data:`REPROBE_STEPS` steps or when the batch size leaves
    ``[b / 2, 2 b]`` of the size it measured at.  The decision reaches every rank as the plan's
    ``ahead`` (every rank runs what rank 0 planned), so nothing but rank 0 measures.  Steps are the
    decode loop's steady periods (:meth:`~mlxcluster.leader.execution.Rank0Execution._decode_step`);
    the first after a switch is not one (its pipeline fills or drains) and is left out.
    The engine's own probe (:attr:`RankEngine.probe_lookahead`) decides at world size 1."""

    PROBE_STEPS = 12
    MARGIN = 0.05
    REPROBE_STEPS = 2048

    def __init__(self) -> None:
        self.samples: Dict[bool, List[float]] = {True: [], False: []}
        self.batch = 0           # the batch size the samples are of
        self.choice: Optional[bool] = None  # decided (None: probing)
        self.since = 0           # steps since the decision
        self._last: Optional[bool] = None  # the mode of the last step recorded

    def want(self) -> bool:
        """Whether the next decode step should look ahead (while probing: the mode being measured)."""
        if self.choice is not None:
            return self.choice
        return len(self.samples[True]) < self.PROBE_STEPS

    def record(self, ahead: bool, batch: int, seconds: float) -> None:
        """A steady decode step of ``batch`` sequences took ``seconds``, with lookahead or not."""
        switched, self._last = self._last is not None and ahead != self._last, ahead
        if not (self.batch // 2 <= batch <= 2 * self.batch) or (self.choice is not None and
                                                                 self.since >= self.REPROBE_STEPS):
            self.samples, self.batch, self.choice, self.since = {True: [], False: []}, batch, None, 0
        if self.choice is not None:
            self.since += 1
            return
        if switched or batch != self.batch:
            return
        self.samples[ahead].append(seconds)
        if all(len(v) >= self.PROBE_STEPS for v in self.samples.values()):
            on, off = (statistics.median(self.samples[k]) for k in (True, False))
            self.choice = not off < on * (1 - self.MARGIN)
            log.info("decode with lookahead: %s (median step %.2f ms with, %.2f ms without, batch %d)",
                     "yes" if self.choice else "no", on * 1e3, off * 1e3, batch)


def default_kv_budget_bytes(fraction: float = 0.5, device=None) -> int:
    """What the KV caches of this rank's batch may grow to (bytes), once its shard is loaded; never 0
    ("no bound"): :func:`mlxcluster.engine.memory.kv_budget_bytes` -- on Metal the working set less
    the resident shard and a margin, on the CPU backend ``fraction`` of the RAM available, a small
    floor (with a warning) where nothing is left.  ``device``: a
    :class:`~mlxcluster.engine.memory.Device` (default the real one)."""
    from ..engine.memory import kv_budget_bytes

    return kv_budget_bytes(device, fraction)


def salt_namespace(cache_salt: str) -> str:
    """The prefix-cache namespace of a request's ``cache_salt`` (vLLM's field; the front has already
    folded in the API key under ``--cache-isolation key``): "" (shared) for "", else the first 32 hex
    digits of its SHA-256 -- what ranks are told (``ComputeSource.salt``), never the salt itself."""
    if not cache_salt:
        return ""
    import hashlib

    return hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).hexdigest()[:32]

@dataclass
class SessionStats:
    """Timings of one generation: seconds, tokens/s, bytes per rank."""

    uid: str
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # leading prompt positions taken from the prefix caches, not prefilled
    #: the whole answer's tokens: a resumed request's ``resumed_tokens`` (generated by an earlier group,
    #: prefilled here after the prompt) included
    generated_tokens: int = 0
    resumed_tokens: int = 0
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    reason: int = pb.STOP_REASON_UNSPECIFIED
    peak_memory_bytes_per_rank: List[int] = field(default_factory=list)
    handoff_bytes: int = 0       # --local-decode: K/V bytes received from the other stages
    handoff_s: float = 0.0       # ... seconds from rank 0's first token to the K/V installed
    handoff_fallback: str = ""   # ... why the handoff was refused ("": installed)
    pd_prefill_s: float = 0.0    # --pd: from admission to the end of the prefill group's compute
    pd_tail_s: float = 0.0       # ... from the end of that compute to the K/V installed on every rank
    pd_streamed_s: float = 0.0   # ... how long before the end of that compute the first K/V frame arrived
    #: speculative decoding: draft tokens verified, of them accepted, verify steps that had a draft
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_steps: int = 0
    #: decode steps that gave this request tokens after its first (plain steps, settled lookahead steps
    #: and verify steps): tokens per step = (generated - resumed - 1) / decode_steps
    decode_steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted draft tokens (0 when nothing was drafted)."""
        return self.spec_accepted / self.spec_drafted if self.spec_drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens decoded per decode step after the first token (0 before any step; 1.0 without speculation)."""
        steps = self.generated_tokens - self.resumed_tokens - 1
        return steps / self.decode_steps if self.decode_steps and steps > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        """Positions prefilled per second: the prompt's and a resumed answer's."""
        return (self.prompt_tokens + self.resumed_tokens) / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.generated_tokens - self.resumed_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


@dataclass
class Request:
    """One client request inside the scheduler (its engine-side state --
    tokens, stop, KV cache -- is ``engine.get(uid)`` once admitted)."""

    uid: str
    prompt: List[int]          # a resumed request's prompt ends with its resumed tokens
    max_tokens: int            # the whole answer's, resumed tokens included
    eos: frozenset
    sampling: Sampling
    stats: SessionStats
    out: "asyncio.Queue"
    t_start: float
    reason: int = 0            # why it ended (the engine's stop, CANCELLED or ERROR)
    cancelled: bool = False
    t_first: float = 0.0
    logprobs: Optional[list] = None  # Sampling.logprobs: one engine last_logprob per token delivered
    source: str = ""           # where its K/V comes from once it joins (frames.COMPUTE, HANDOFF, REMOTE)
    chunked: bool = False      # computed by prefill chunks across iterations
    computed: bool = False     # its remote K/V was refused: it joins again with its K/V computed
    resumed: List[int] = field(default_factory=list)  # lossless failover: the answer's tokens an earlier group gave
    # speculative decoding: the drafter, the draft length's controller and prompt + answer so far (int ids)
    drafter: Optional[Drafter] = None
    adaptive: Optional[AdaptiveK] = None
    context: Optional[List[int]] = None
    salt: str = ""             # its prefix-cache namespace (salt_namespace; "" shared)
    disk: bool = False         # its cached positions come from rank 0's disk tier, in a group of several ranks
    every_rank: bool = False   # every rank samples it (PromptTokens.every_rank_samples): set when it joins

    @property
    def cached(self) -> int:
        """Leading prompt positions taken from the ranks' prefix caches (set at admission)."""
        return self.stats.cached_prompt_tokens


@dataclass
class EmbedJob:
    """One embeddings request inside the scheduler: its inputs (token id lists), each pooled by
    ``mode``; ``taken`` of them went into plans, ``vectors`` holds the computed ones (input index ->
    float32 row); ``done`` is resolved with the ``(len(inputs), hidden)`` array once all are."""

    uid: str
    inputs: List[List[int]]
    mode: str
    done: "asyncio.Future"
    taken: int = 0
    vectors: dict = field(default_factory=dict)


@dataclass
class Plan:
    """One iteration of rank 0's loop, as data (vLLM's ``SchedulerOutput``): the ``stepPlan``
    frame every rank N runs (:meth:`Scheduler._frame`) and rank 0 runs here
    (:meth:`~mlxcluster.leader.execution.Rank0Execution._execute`), in this order: ``leaves`` (finished or cancelled requests), one
    decode step of ``decode`` (the batch, in batch order), ``joins`` (admitted requests, each with
    its K/V source; the computed ones prefilled together when ``batched``), ``chunks`` (``(request,
    position, count)``: one prefill chunk of each chunked prompt)."""

    step: int
    leaves: List[Request] = field(default_factory=list)
    decode: List[Request] = field(default_factory=list)
    joins: List[Request] = field(default_factory=list)
    batched: bool = False
    chunks: List[Tuple[Request, int, int]] = field(default_factory=list)
    embeds: List[Tuple[EmbedJob, int]] = field(default_factory=list)  # (request, input index)
    #: speculative decoding: uid -> its draft (int ids, clamped); non-empty: the decode step is a verify step
    drafts: Dict[str, List[int]] = field(default_factory=dict)
    settled: bool = False  # the previous plan's queued lookahead step was kept before this plan (StepPlan.settled)
    ahead: bool = False    # every rank queues the next step on this plan's decode step (StepPlan.ahead)


class Scheduler(SpeculationPolicy, Rank0Execution):
    """Rank 0 of a tensor-parallel group: admission + continuous-batching generation.

    The scheduler decides: admission (:meth:`generate`, :meth:`_may_admit`) and each plan
    (:meth:`_schedule`).  Running a plan here and folding its outputs back into the requests is
    :class:`~mlxcluster.leader.execution.Rank0Execution`'s; how many tokens each drafting sequence
    drafts is :class:`~mlxcluster.leader.speculation.SpeculationPolicy`'s.

    Args:
        model: rank 0's :class:`~mlxcluster.model.tp.LlamaModelTP` shard.
        ranks: rank 0's :class:`~mlxcluster.control.link.RankGroup` (or the
            links to ranks 1..N-1; empty for world size 1).
        vocab_size, context_length: model limits (tokens).
        executor: the single thread that owns MLX.
        step_timeout_s: a forward pass longer than this means a stuck group.
        max_batch: cap on the sequences decoded together.
        max_queue: requests allowed to wait for a batch slot.
        kv_budget_bytes: bytes the batch's KV caches may grow to (``None``:
            :func:`default_kv_budget_bytes`, never 0; an explicit 0: no bound but ``max_batch``).
        itl_target_s: inter-token latency target (seconds; 0: none): no sequence joins a batch
            whose step :class:`StepTimes` predicts would then exceed it (a lone sequence
            always runs), and the prompts prefilled between two decode steps are bounded so that
            the running streams' gap (that prefill, then the step) is predicted within it: a
            request waits until its prompt fits (at the latest, until the running streams end).
        pipeline: at world size 1, decode with lookahead (False: every step
            is read before the next is built).
        compile_decode: at world size 1, run a lone greedy sequence's
            lookahead step ``mx.compile``'d.
        tokenizer: the model's Hugging Face tokenizer, for requests constrained by a
            grammar (``Sampling.grammar``; ``None``: such requests are refused).
        draft: the server's default drafter for requests that do not say (``--draft``: ``ngram``,
            ``ngram:MIN-MAX``, ``model:PATH``, ``layers:N``; "": none).  A model that cannot speculate
            (:attr:`speculation_unsupported`) decodes without it, logged once.  A draft model's weights
            are loaded on the first request that drafts with them (on the MLX thread).
        draft_tokens: the default bound on draft tokens per verify step (``--draft-tokens``, 1 .. 16).
        model_path: the model's reference (``layers:N`` where rank 0 holds a tensor-parallel shard
            reads an unsharded copy of the first N layers, norm and head from it).
        credentials: rank 0's :class:`~mlxcluster.security.Credentials`, with which a
            ``remote:HOST:PORT`` drafter calls its draft node (``None``: such drafters are refused).

    Raises:
        ValueError: a ``draft`` unknown or malformed, ``layers:N`` outside ``[1, layers)``, a
            ``model:PATH`` that does not exist, ``draft_tokens`` out of range; one line.
    """

    def __init__(self, model, ranks, vocab_size: int, context_length: int, executor: Executor,
                 step_timeout_s: float = 120.0, max_batch: int = 8, max_queue: int = 64,
                 pipeline: bool = True, compile_decode: bool = True,
                 decode_side=None, tokenizer=None, kv_budget_bytes: Optional[int] = None,
                 itl_target_s: float = 0.0, draft: str = "", draft_tokens: int = DEFAULT_DRAFT_TOKENS,
                 model_path: str = "", credentials=None):
        self.model = model
        self.decode_side = decode_side  # --prefill-peer: prompts are prefilled by the prefill group
        self.ranks = ranks if isinstance(ranks, RankGroup) else RankGroup(ranks)
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.executor = executor
        self.step_timeout_s = step_timeout_s
        self.max_batch = max(1, max_batch)
        self.max_queue = max(0, max_queue)
        self.kv_budget_bytes = default_kv_budget_bytes() if kv_budget_bytes is None else max(0, kv_budget_bytes)
        self.kv_bytes_per_position = 0.0  # measured on the first prefilled sequence
        self.itl_target_s = max(0.0, float(itl_target_s))
        self.step_times = StepTimes()
        self._last_step_end = 0.0  # perf_counter() when the previous decode step's tokens were read
        self._admission: Optional[Tuple[int, float]] = None  # (prompt tokens, perf_counter()) of the last prefill
        self._interrupted = False  # anything but decode steps ran since the last one (it is no steady step)
        self._steps = 0            # plans made (StepPlan.step)
        self._plan: Optional[Plan] = None  # the plan being run (its joins are in flight until placed)
        self._plan_requests: Dict[str, Request] = {}  # uid -> request of the plan being run
        self._refused: List[pb.SessionStop] = []  # the plan's remote joins refused so far (their leaves)
        # A pipeline's route and epoch travel in promptTokens (every stage checks them).
        route = getattr(model, "route", None)
        self.route_id = route.identity() if route is not None else ""
        self.epoch = getattr(model, "epoch", "")
        # --local-decode: prefill through the pipeline, decode here alone on every layer.
        self.local_decode = bool(getattr(model, "local_decode", False))
        decoder = model.stage.model if self.local_decode else model
        # Lookahead at every world size (issue 42): alone, or in a group whose ranks all hold the
        # logits (a vocabulary-parallel head): there every rank samples the batch itself and queues
        # the same next step, so no plan's flight is on a token's path.  The compiled step (no
        # collective inside) only when decoding alone.
        alone = len(self.ranks) == 0 or self.local_decode
        #: in a group: every rank can sample the sequences without a grammar or a drafter itself
        self.every_rank_samples = not alone and bool(getattr(model, "logits_replicated", False))
        self.lookahead = pipeline and config().lookahead and (alone or self.every_rank_samples)
        self.engine = RankEngine(decoder, context_length, compute_logits=True,
                                 compile_decode=compile_decode and self.lookahead and alone,
                                 prefill_model=model if self.local_decode else None, tokenizer=tokenizer,
                                 probe_lookahead=alone, read_first=not alone and passes.queuing_computes())
        self.last_stats: Optional[SessionStats] = None
        # counters over every request since start (InfoReply: a dashboard's tok/s and TTFT)
        self.generated_tokens = 0
        self.first_tokens = 0
        self.ttft_seconds_sum = 0.0
        self.batched_prompts = 0  # prompts prefilled in a group of two or more
        self.cached_prompt_tokens = 0  # prompt positions taken from the prefix caches
        self._waiting: "collections.deque[Request]" = collections.deque()
        self._running: List[Request] = []
        # chunked prefill: prompts longer than one chunk are prefilled a chunk per loop iteration
        # (with --local-decode through the pipeline, handed off after the last chunk; in a PD decode
        # group, for the prompts it computes itself after a refused remote prefill)
        self.chunked_prefill = True
        self._chunking: List[Request] = []  # admitted, prompt being prefilled (in admission order)
        self._last_chunk: Optional[Tuple[int, float]] = None  # (tokens, seconds) of the last prefill chunk
        self._paused_since = 0.0  # perf_counter() when chunks were first held back for fresh streams (0: not)
        self._task: Optional[asyncio.Task] = None
        # embeddings: requests with inputs not yet in a plan (FIFO), and every request not answered
        self._embed_waiting: "collections.deque[EmbedJob]" = collections.deque()
        self._embed_jobs: List[EmbedJob] = []
        self.embedded_inputs = 0  # embedding inputs computed since start
        # speculative decoding: the server's default (off: ""), counters over every request (InfoReply)
        if not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"--draft-tokens must be in [1, {MAX_DRAFT_TOKENS}], got {draft_tokens}")
        self.draft_tokens = int(draft_tokens)
        self.draft = ""
        #: draft models' weights (model:PATH, layers:N), loaded once and shared by every sequence
        self.draft_models = DraftModels(model, vocab_size, tokenizer, model_path)
        self.credentials = credentials
        #: remote:HOST:PORT drafters' draft nodes, by address (one call per plan each: _prefetch_drafts)
        self.remote_drafts: Dict[str, RemoteDrafts] = {}
        if draft:
            parse_draft(draft)
            why = self.speculation_unsupported
            if why:
                log.warning("--draft %s: %s; decoding without speculation", draft, why)
            else:
                make_drafter(draft, "--draft", self.draft_models, self._remote_drafter)
                self.draft = draft
        self._init_speculation()
        #: a group's lookahead, by measurement (alone, the engine probes it itself)
        self._ahead: Optional[AheadChoice] = AheadChoice() if self.lookahead and not alone else None
        self._after_verify = False  # the last step was a verify step (the next plain step restarts lookahead)
        self._kept: List[int] = []  # the last verify step's kept counts, for the next frame to ranks N
        self._owed: Optional[asyncio.Future] = None  # the lookahead step queuing on the MLX thread (_mlx)

    @property
    def world_size(self) -> int:
        return 1 + len(self.ranks)

    @property
    def broken(self) -> Optional[str]:
        return self.ranks.broken

    @property
    def queued(self) -> int:
        """Requests waiting for their first step: generation requests and embedding requests."""
        return len(self._waiting) + len(self._embed_waiting)

    @property
    def running(self) -> int:
        return len(self._running) + len(self._chunking)

    @property
    def speculation_unsupported(self) -> Optional[str]:
        """Why this group cannot decode speculatively (one line), or ``None`` when it can: the engine's
        refusal (caches that cannot roll back, ``--afd``).  Every topology that decodes verifies: TP, a
        pipeline (every stage), ``--local-decode`` (rank 0 alone) and a PD decode group (after the handoff)."""
        return self.engine.speculative_error

    def speculation_of(self, draft: str = "", draft_tokens: int = 0) -> Optional[Tuple[Drafter, int]]:
        """A request's speculation: ``(drafter, max k)``, or ``None`` (it decodes one token per step).
        ``draft``: "" the server's default (:attr:`draft`; none: ``None``), ``off``/``none`` no
        drafting, else a drafter (:func:`make_drafter`: ``ngram[:MIN-MAX]``, ``model:PATH``,
        ``layers:N``); ``draft_tokens``: the bound on ``k`` (0: the server's ``--draft-tokens``).  A
        model drafter's weights are not loaded here (:meth:`generate` loads them on the MLX thread).

        Raises:
            ValueError: ``draft_tokens`` beyond 16, an unknown or malformed drafter, ``layers:N``
                outside ``[1, layers)``, a ``model:PATH`` that does not exist, or a drafter asked of
                a group that cannot speculate (the reason); one line naming ``speculative.draft`` /
                ``speculative.draft_tokens``.
        """
        if draft_tokens < 0 or draft_tokens > MAX_DRAFT_TOKENS:
            raise ValueError(f"speculative.draft_tokens must be in [1, {MAX_DRAFT_TOKENS}] (0: the server's "
                             f"{self.draft_tokens}), got {draft_tokens}")
        k = int(draft_tokens) or self.draft_tokens
        if draft in ("off", "none"):
            return None
        if not draft:
            return (make_drafter(self.draft, "--draft", self.draft_models, self._remote_drafter), k) \
                if self.draft else None
        parse_draft(draft, "speculative.draft")
        why = self.speculation_unsupported
        if why:
            raise ValueError(f"speculative.draft {draft}: {why}")
        return make_drafter(draft, "speculative.draft", self.draft_models, self._remote_drafter), k

    def _remote_drafter(self, address: str) -> RemoteDrafter:
        """A new sequence's drafter on the draft node's group at ``address`` (``remote:HOST:PORT``):
        one :class:`RemoteDrafts` per address, its tokenizer check computed once.

        Raises:
            ValueError: no credentials to call it with (one line)."""
        if self.credentials is None:
            raise ValueError("this rank 0 has no cluster credentials to call a draft node with")
        remote = self.remote_drafts.get(address)
        if remote is None:
            from .remote_draft import vocab_digest

            remote = self.remote_drafts[address] = RemoteDrafts(address, self.credentials, self.vocab_size,
                                                                vocab_digest(self.engine.tokenizer))
        return remote.drafter()

    def validate_prompt(self, prompt_tokens: Sequence[int]) -> None:
        """Raise ``ValueError`` (one line) for a prompt the group cannot run."""
        if len(prompt_tokens) == 0:
            raise ValueError("empty prompt: at least one token is needed")
        for t in prompt_tokens:
            if not 0 <= int(t) < self.vocab_size:
                raise ValueError(f"token {t} outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_tokens) >= self.context_length:
            raise ValueError(f"prompt of {len(prompt_tokens)} tokens is longer than the context "
                             f"({self.context_length} tokens, one kept for the answer)")

    async def validate_resume(self, prompt_tokens: Sequence[int], resume: Sequence[int], max_tokens: int,
                              eos_token_ids: Iterable[int] = (), sampling: Optional[Sampling] = None) -> None:
        """Raise ``ValueError`` (one line naming ``resume_token_ids``) unless the answer of a request
        (``prompt_tokens``, ``max_tokens``, ``eos_token_ids``, ``sampling``) may continue after
        ``resume`` (int ids, :meth:`generate`): no EOS among them, ids inside the vocabulary,
        fewer than ``max_tokens``, prompt + resume shorter than the context, and a grammar
        (``sampling.grammar``) that allows them (checked with llguidance in a worker thread)."""
        eos = frozenset(int(t) for t in eos_token_ids)
        for i, t in enumerate(resume):
            if not 0 <= int(t) < self.vocab_size:
                raise ValueError(f"resume_token_ids[{i}]: token {t} outside the vocabulary [0, {self.vocab_size})")
            if int(t) in eos:
                raise ValueError(f"resume_token_ids[{i}] is the end-of-sequence token {t}: that answer has ended")
        if len(resume) >= max_tokens:
            raise ValueError(f"resume_token_ids holds {len(resume)} tokens: nothing is left to generate within "
                             f"max_tokens {max_tokens}")
        total = len(prompt_tokens) + len(resume)
        if total >= self.context_length:
            raise ValueError(f"prompt of {len(prompt_tokens)} tokens and resume_token_ids of {len(resume)} fill the "
                             f"context ({self.context_length} tokens, one kept for the answer)")
        if sampling is not None and sampling.grammar and self.engine.tokenizer is not None:
            from ..engine.constraint import check_resume

            await asyncio.to_thread(check_resume, sampling.grammar, self.engine.tokenizer, self.vocab_size,
                                    sorted(eos), list(resume))

    # -- embeddings (the client side) ------------------------------------------------------
    @property
    def embeddings_unsupported(self) -> Optional[str]:
        """Why this group cannot compute embeddings (one line), or ``None`` when it can."""
        if self.decode_side is not None:
            return ("a prefill/decode-disaggregated decode group (--pd, --prefill-peer) cannot compute embeddings "
                    "(its prompts are prefilled by the prefill group)")
        from ..engine.embed import unsupported

        return unsupported(self.model)

    async def embed(self, inputs: Sequence[Sequence[int]], mode: str = "lasttoken"):
        """The embeddings of ``inputs`` (lists of int token ids), each the final hidden state
        pooled by ``mode`` (:data:`mlxcluster.engine.embed.MODES`) and L2-normalised: a float32
        NumPy array ``(len(inputs), hidden)`` in input order.  The inputs go through the one
        queue and run in the plans' embeds part (several requests' inputs in one forward pass).
        Cancelling the call drops its inputs not yet computed.

        Raises:
            ValueError: no inputs, an empty input, a token outside the vocabulary, an input
                longer than the context, an unknown ``mode``, or a group that cannot compute
                embeddings (:attr:`embeddings_unsupported`; message starts ``embeddings:``).
            QueueFullError: ``max_queue`` embedding requests are already waiting.
            RankError: the group failed.
        """
        from ..engine.embed import MODES

        if self.broken:
            raise RankError(f"the tensor-parallel group is broken: {self.broken}")
        why = self.embeddings_unsupported
        if why:
            raise ValueError(f"embeddings: {why}")
        if mode not in MODES:
            raise ValueError(f"unknown pooling mode {mode!r} (one of {', '.join(MODES)})")
        if not inputs:
            raise ValueError("no input to embed")
        for i, ids in enumerate(inputs):
            if len(ids) == 0:
                raise ValueError(f"input {i} is empty: at least one token is needed")
            bad = next((t for t in ids if not 0 <= int(t) < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"input {i}: token {bad} outside the vocabulary [0, {self.vocab_size})")
            if len(ids) > self.context_length:
                raise ValueError(f"input {i} has {len(ids)} tokens, more than the context of "
                                 f"{self.context_length} tokens")
        if len(self._embed_waiting) >= max(1, self.max_queue):
            raise QueueFullError(f"{len(self._embed_waiting)} embedding requests are already waiting; retry later")
        loop = asyncio.get_running_loop()
        job = EmbedJob(uid=uuid.uuid4().hex[:16], inputs=[[int(t) for t in ids] for ids in inputs], mode=mode,
                       done=loop.create_future())
        self._embed_waiting.append(job)
        self._embed_jobs.append(job)
        if self._task is None:
            self.ranks.bind()
            self._task = loop.create_task(self._decode_loop())
        try:
            return await asyncio.shield(job.done)
        finally:
            if not job.done.done():  # cancelled: its inputs not taken yet never run
                job.done.cancel()
                if job in self._embed_waiting:
                    self._embed_waiting.remove(job)
                if job in self._embed_jobs:
                    self._embed_jobs.remove(job)

    def _take_embeds(self, plan: Plan) -> None:
        """The plan's embeds part: waiting inputs in order while the padded batch stays within
        ``EMBED_TOKENS_PER_STEP`` (at least one input)."""
        longest = 0
        while self._embed_waiting:
            job = self._embed_waiting[0]
            n = len(job.inputs[job.taken])
            if plan.embeds and max(longest, n) * (len(plan.embeds) + 1) > EMBED_TOKENS_PER_STEP:
                break
            longest = max(longest, n)
            plan.embeds.append((job, job.taken))
            job.taken += 1
            if job.taken == len(job.inputs):
                self._embed_waiting.popleft()

    async def generate(self, prompt_tokens: Sequence[int], max_tokens: int,
                       eos_token_ids: Iterable[int] = (), *, uid: Optional[str] = None,
                       temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                       stats: Optional[SessionStats] = None, sampling: Optional[Sampling] = None,
                       logprobs: Optional[list] = None, resume: Sequence[int] = (),
                       speculative: Optional[Tuple[str, int]] = None, cache_salt: str = "") -> AsyncIterator[int]:
        """Generate up to ``max_tokens`` token ids after ``prompt_tokens``.

        ``cache_salt`` (vLLM's: any string, "" shared): the prompt takes prefix-cache positions only
        from, and is held only under, the namespace :func:`salt_namespace` makes of it.

        ``resume`` (lossless failover: int ids an earlier group generated and delivered for this
        request) continues that answer: the request is admitted with ``prompt_tokens + resume``
        as its prompt (its K/V computed, after what the prefix caches hold -- a prefill group of
        ``--pd`` is not asked: it would sample the answer's first token), and the answer goes on
        with its token number ``len(resume)``: ``max_tokens`` counts the resumed tokens, seeded
        sampling draws token i with the key of ``(seed, i)``, the presence/frequency penalties
        count them and a grammar consumes them first (:meth:`RankEngine.admit`).  Only the tokens
        after them are yielded; ``stats.generated_tokens`` counts the whole answer.

        ``speculative`` (``(draft, draft_tokens)``, :meth:`speculation_of`; ``None``: the server's
        default): the request drafts and its decode steps verify several tokens at once (the module
        docstring); greedy answers are the same token for token, sampled ones follow the same
        distribution.  A grammar-constrained request never drafts (one token per step).  Its
        acceptance counts go into ``stats`` (``spec_*``, ``decode_steps``).

        Yields int token ids as they are decided; stops after an id in
        ``eos_token_ids`` (which is yielded), after ``max_tokens``, or when the
        KV cache reaches the context length.  ``sampling`` (with logits processors) replaces
        ``temperature``/``top_p``/``seed``.  ``stats`` (and
        :attr:`last_stats`) receive the request's :class:`SessionStats` once the
        iterator finishes.  With ``sampling.logprobs``, ``logprobs`` receives one entry per
        token, appended before the token is yielded: ``(logprob, ((token_id, logprob), ...))``
        (:attr:`~mlxcluster.engine.sequence.SequenceState.last_logprob`).  Closing the iterator
        early cancels the request and frees its KV cache on every rank.

        Raises:
            ValueError: empty prompt, token outside the vocabulary, prompt not
                shorter than the context, ``max_tokens < 1``, a KV cache it may grow to beyond what the
                batch may hold in all (:meth:`kv_refusal`); a ``speculative`` that
                :meth:`speculation_of` refuses, or whose draft model cannot be loaded or has another
                vocabulary than the target's; ``resume`` with an EOS, a token
                outside the vocabulary, ``len(resume) >= max_tokens``, or a token the grammar
                refuses (so that prompt + resume is the answer's start); a grammar or logprobs
                asked of a prefill/decode-disaggregated group (its first token is
                sampled by the prefill group).
            QueueFullError: ``max_queue`` requests are already waiting.
            RankError: a rank N rejected a frame, failed or was lost, or a
                forward pass exceeded ``step_timeout_s``.
        """
        if self.broken:
            raise RankError(f"the tensor-parallel group is broken: {self.broken}")
        self.validate_prompt(prompt_tokens)
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        why = self.kv_refusal(len(prompt_tokens), max_tokens)
        if why:
            raise ValueError(why)
        resume = [int(t) for t in resume]
        if resume:
            await self.validate_resume(prompt_tokens, resume, max_tokens, eos_token_ids, sampling)
        if sampling is not None and (sampling.grammar or sampling.logprobs) and self.decode_side is not None:
            raise ValueError("response_format and logprobs are not supported by a prefill/decode-disaggregated "
                             "group (its first token is sampled by the prefill group)")
        if sampling is not None and sampling.grammar and self.engine.tokenizer is None:
            raise ValueError("this rank 0 has no tokenizer to constrain decoding (response_format) with")
        spec = self.speculation_of(*(speculative or ("", 0)))
        # at most max_queue waiting beyond those the batch has room for now (its cap, or the ITL target's limit)
        room = max(0, min(self.max_batch, self.batch_limit) - self.running)
        if len(self._waiting) >= self.max_queue + room:
            raise QueueFullError(f"{len(self._waiting)} requests are already waiting; retry later")
        uid = uid or uuid.uuid4().hex[:16]
        stats = stats if stats is not None else SessionStats(uid=uid)
        stats.uid, stats.prompt_tokens, stats.resumed_tokens = uid, len(prompt_tokens), len(resume)
        req = Request(uid=uid, prompt=[int(t) for t in prompt_tokens] + resume, max_tokens=max_tokens,
                      eos=frozenset(int(t) for t in eos_token_ids), sampling=sampling or Sampling(temperature, top_p, seed),
                      stats=stats, out=asyncio.Queue(), t_start=time.perf_counter(),
                      logprobs=logprobs if sampling is not None and sampling.logprobs else None,
                      resumed=resume, computed=bool(resume), salt=salt_namespace(cache_salt))
        if spec is not None and not req.sampling.grammar:  # a grammar's mask needs one token per step
            req.drafter, req.adaptive, req.context = spec[0], AdaptiveK(spec[1], self.spec_cost), list(req.prompt)
            if req.drafter.uses_mlx and not req.drafter.ready():  # its draft weights, loaded once, on the MLX thread
                await asyncio.get_running_loop().run_in_executor(self.executor, req.drafter.load)
        self._waiting.append(req)
        if self._task is None:
            self.ranks.bind()
            self._task = asyncio.get_running_loop().create_task(self._decode_loop())
        finished = False
        try:
            while True:
                item = await req.out.get()
                if item is _END:
                    finished = True
                    break
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
        finally:
            if not finished:
                req.cancelled = True
                stats.reason = pb.CANCELLED
            self.last_stats = stats
        if stats.reason != pb.CANCELLED and not self.broken:
            stats.peak_memory_bytes_per_rank = await self._peak_memory(uid)
        self.last_stats = stats

    async def _peak_memory(self, uid: str, timeout_s: float = 10.0) -> List[int]:
        """Peak memory per rank (bytes) from every rank N's sessionStop ack."""
        try:
            await self.ranks.wait_acks(uid, timeout_s)
        finally:
            acks = self.ranks.forget_acks(uid)
        own = await asyncio.get_running_loop().run_in_executor(self.executor, mx.get_peak_memory)
        return [int(own)] + [int(acks[r].peak_memory_bytes) if r in acks else 0 for r in self.ranks.ranks]

    # -- the decode loop --------------------------------------------------------------------
    async def _decode_loop(self) -> None:
        """Runs while there is work, then exits (the next request starts it again): each
        iteration is one plan, :meth:`_schedule` then :meth:`_execute`."""
        try:
            while self._waiting or self._running or self._chunking or self._embed_waiting:
                await self._execute(await self._schedule())
        except asyncio.CancelledError:
            self._abandon()
            raise
        except Exception as exc:
            if not isinstance(exc, RankError):
                log.exception("decode loop failed")
                self.ranks.fail(f"{type(exc).__name__}: {exc}")
            self._fail_all(exc if isinstance(exc, RankError) else RankError(self.broken))
        finally:
            self._task = None

    async def _schedule(self) -> Plan:
        """Decide this iteration (see the module docstring): the sequences that leave (finished or
        cancelled), the decode step of the rest of the batch, the waiting requests that join
        (:meth:`_may_admit`) with their K/V source, and one chunk of every chunked prefill.  With
        lookahead, a step queued on the batch is settled first when the batch is about to change or a
        sequence is about to draft (a verify step follows the tokens recorded so far).  Drafting
        sequences get their drafts (:meth:`_drafts`; on the MLX thread when a drafter runs a model,
        so that no forward pass blocks the event loop)."""
        ks = self._draft_lengths()
        pause = self._pause_chunks(self._running)  # no chunk this plan: the batch may stay as it is
        changes = (any(r.cancelled or r.reason for r in self._running + self._chunking) or
                   (self._chunking and not pause) or
                   (self._waiting and self._may_admit(self._waiting[0], [])))
        settled = bool(self.lookahead and (changes or (ks and self.engine.queued)) and self.engine.queued)
        if self.lookahead and (changes or (ks and self.engine.queued)):
            await self._settle()  # the batch changes, or drafts follow: use the queued step rather than roll it back
            if changes:
                self._interrupted = True
            else:  # the settled step was the decode step: the next one is timed from here
                self._last_step_end = time.perf_counter()
        self._steps += 1
        plan = Plan(step=self._steps, settled=settled)
        for req in self._running + self._chunking:
            if req.cancelled or req.reason:
                plan.leaves.append(req)
                (self._running if req in self._running else self._chunking).remove(req)
        by_uid = {r.uid: r for r in self._running}
        plan.decode = [by_uid[u] for u in self.engine.batch.uids if u in by_uid]
        if ks:
            await self._prefetch_drafts(plan.decode, ks)
            if any(r.drafter.uses_mlx for r in plan.decode if r.uid in ks):
                plan.drafts, seconds = await self._mlx(self._drafts, plan.decode, ks)
            else:
                plan.drafts, seconds = self._drafts(plan.decode, ks)
            self._measure_drafts(plan.decode, plan.drafts, seconds)
        group: List[Request] = []
        while self._waiting and self._may_admit(self._waiting[0], group):
            req = self._waiting.popleft()
            if req.cancelled:
                req.stats.reason = pb.CANCELLED
                req.out.put_nowait(_END)
                continue
            group.append(req)
        for req in group:
            if self.decode_side is not None and not req.computed:
                req.source = fr.REMOTE
            elif self.local_decode:
                req.source = fr.HANDOFF
                req.chunked = self._long(req)
            else:
                req.source = fr.COMPUTE
                req.stats.cached_prompt_tokens, on_disk = self.engine.prefix_lookup(req.prompt, req.salt)
                # several ranks: how many of them every rank's disk holds is known once admitted (_join)
                req.disk = on_disk and self.engine.prefix is not None and self.engine.prefix.agree is not None
                self.cached_prompt_tokens += req.cached
                req.chunked = self._long(req)
            req.every_rank = (self.every_rank_samples and req.source != fr.HANDOFF and not req.sampling.grammar
                              and req.drafter is None)
            plan.joins.append(req)
        whole = [r for r in group if r.source == fr.COMPUTE and not r.chunked]
        plan.batched = len(whole) > 1 and self.engine.batched_prefill
        # the streams this plan's chunks run beside: the batch, and the joins that decode from the next plan
        beside = len(self._running) + len([r for r in group if not r.chunked])
        # (a disk join's first chunk waits for the next plan: its cached length is agreed at admission)
        for req in [] if pause else self._chunking + [r for r in group if r.chunked and not r.disk]:
            seq = self.engine.get(req.uid)
            position = seq.session.position if seq is not None else req.cached
            plan.chunks.append((req, position, self._chunk_tokens(req, position, beside)))
        self._take_embeds(plan)
        # the decode step queues the next (every rank alike) when nothing but it changes the batch
        # and every rank samples the batch (alone: rank 0 does)
        plan.ahead = bool(plan.decode) and not (plan.joins or plan.chunks or plan.drafts) and self.engine.look_ahead(
            self.lookahead and (not self.every_rank_samples or all(r.every_rank for r in plan.decode))
            and (self._ahead is None or self._ahead.want()))
        return plan

    def _positions(self, req: Request) -> int:
        """KV positions ``req`` may grow to (a resumed request's prompt holds its resumed tokens)."""
        # (getattr: the admission rule's tests pass plain namespaces for requests)
        return min(self.context_length, len(req.prompt) + req.max_tokens - len(getattr(req, "resumed", ())))

    def kv_refusal(self, prompt_tokens: int, max_tokens: int) -> str:
        """Why a request of ``prompt_tokens`` + ``max_tokens`` can never run here (one line), else ``""``:
        the KV cache it may grow to (``min(prompt + max_tokens, context)`` positions times the bytes per
        position measured on this rank's first prefill) exceeds what this rank's batch may hold in all
        (``kv_budget_bytes``) -- refused at admission, before anything streams, rather than run alone
        into an out-of-memory failure mid-answer.  Nothing measured yet, or no budget: ``""``."""
        if not self.kv_budget_bytes or not self.kv_bytes_per_position:
            return ""
        positions = min(self.context_length, prompt_tokens + max_tokens)
        need = positions * self.kv_bytes_per_position
        if need <= self.kv_budget_bytes:
            return ""
        fit = int(self.kv_budget_bytes // self.kv_bytes_per_position)
        return (f"a prompt of {prompt_tokens} tokens with max_tokens {max_tokens} may need {need / 2**20:.0f} MiB "
                f"of KV cache per rank ({positions} positions); this group holds at most {fit} positions "
                f"({self.kv_budget_bytes / 2**20:.0f} MiB): lower max_tokens or shorten the prompt")

    def _may_admit(self, req: Request, group: List[Request]) -> bool:
        """Whether ``req`` joins the batch now, after ``group`` (see the module docstring, step 2)."""
        if len(self._running) + len(self._chunking) + len(group) >= min(self.max_batch, self.batch_limit):
            return False
        prefilled = sum(self._step_tokens(r) for r in group + self._chunking)
        # at least one prompt per step, unless an inter-token latency target protects running streams
        bounded = prefilled or (self.itl_target_s > 0 and self._running)
        if bounded and prefilled + self._step_tokens(req) > self.step_times.prefill_tokens(
                self.itl_target_s, len(self._running) + len(group) + 1 if self._running else 0,
                PREFILL_TOKENS_PER_STEP):
            return False  # the running streams take a decode step first
        if not (self._running or self._chunking or group) or not self.kv_budget_bytes or \
                not self.kv_bytes_per_position:
            return True
        grown = sum(self._positions(r) for r in self._running + self._chunking + group) + self._positions(req)
        return grown * self.kv_bytes_per_position <= self.kv_budget_bytes

    def _long(self, req: Request) -> bool:
        """Whether ``req``'s prompt is prefilled chunk by chunk across loop iterations (longer than
        one chunk, ``PREFILL_CHUNK_TOKENS``) rather than at once, alone or in a prefill group."""
        return self.chunked_prefill and len(req.prompt) > passes.PREFILL_CHUNK_TOKENS

    def _step_tokens(self, req: Request) -> int:
        """Prompt tokens ``req`` prefills in the coming loop iteration: its whole prompt, or for a
        chunked prefill its next chunk (prefix-cache hits are not known before admission and are
        counted as prefilled)."""
        if not self._long(req):
            return len(req.prompt)
        seq = self.engine.get(req.uid)
        done = seq.session.position if seq is not None else 0
        return min(passes.PREFILL_CHUNK_TOKENS, len(req.prompt) - done)

    @property
    def batch_limit(self) -> int:
        """Sequences the decode batch may hold now: ``max_batch``, or fewer where
        ``itl_target_s`` and the measured step times (:meth:`StepTimes.limit`) say so."""
        return self.step_times.limit(self.itl_target_s, self.max_batch)

    def _measure_kv(self) -> None:
        """KV bytes per position, from the first prefilled caches (:meth:`RankEngine.kv_bytes_per_position`)."""
        if self.kv_bytes_per_position:
            return
        try:
            self.kv_bytes_per_position = float(self.engine.kv_bytes_per_position())
        except (AttributeError, TypeError):  # a cache without nbytes: only max_batch bounds the batch
            pass

    def _pause_chunks(self, running: List[Request]) -> bool:
        """Whether the next plan runs no prefill chunk: a stream of ``running`` (the batch) is in its
        first :data:`PREFILL_PAUSE_FRESH_TOKENS` tokens, and chunks have not been held back for
        :data:`PREFILL_PAUSE_MAX_S` in a row already."""
        fresh = any(r.stats.generated_tokens - r.stats.resumed_tokens < PREFILL_PAUSE_FRESH_TOKENS
                    for r in running if not (r.cancelled or r.reason))
        if not (fresh and self._chunking):
            self._paused_since = 0.0
            return False
        now = time.perf_counter()
        self._paused_since = self._paused_since or now
        if now - self._paused_since < PREFILL_PAUSE_MAX_S:
            return True
        self._paused_since = 0.0  # this plan runs a chunk; the next may hold them back again
        return False

    def _chunk_tokens(self, req: Request, position: int, beside: int) -> int:
        """Prompt tokens of ``req``'s next chunk (from ``position``): when no stream decodes beside it (``beside``: the streams that do -- the batch and the plan's joins;
        0: none), the chunk predicted to take ``PREFILL_CHUNK_ALONE_S`` (a request arriving meanwhile
        waits for it), else the chunk predicted to hold those streams for ``PREFILL_CHUNK_TARGET_S``
        (or what the inter-token latency target leaves beside the predicted decode step): at most
        ``PREFILL_CHUNK_TOKENS``, :func:`next_chunk` from the last chunk's measured time."""
        left = len(req.prompt) - position
        high = passes.PREFILL_CHUNK_TOKENS
        if not beside:  # unmeasured: a whole chunk
            return min(left, high if self._last_chunk is None else
                       next_chunk(self._last_chunk, PREFILL_CHUNK_ALONE_S, min(PREFILL_CHUNK_MIN_TOKENS, high), high))
        target = PREFILL_CHUNK_TARGET_S
        if self.itl_target_s > 0:
            target = max(0.0, self.itl_target_s - (self.step_times.predict(beside) or 0.0))
        return min(left, next_chunk(self._last_chunk, target, min(PREFILL_CHUNK_MIN_TOKENS, high), high))

    def _abandon(self) -> None:
        """The event loop is going away: cancel everything in flight, in frame
        order, without awaiting (the MLX thread applies it later)."""
        gone = self._in_flight()
        if gone:
            self.ranks.send(fr.step_plan(leaves=[fr.session_stop(r.uid, pb.CANCELLED, "engine loop stopped")
                                                 for r in gone], kept=self._take_kept()))
        for req in gone:
            req.cancelled = True
            req.stats.reason = pb.CANCELLED
            self.executor.submit(self.engine.remove, req.uid)
            req.out.put_nowait(_END)
        for req in self._waiting:
            req.stats.reason = pb.CANCELLED
            req.out.put_nowait(_END)
        self._running.clear()
        self._chunking.clear()
        self._waiting.clear()
        self._end_embeds(None)
        self._plan = None

    def _end_embeds(self, error: Optional[BaseException]) -> None:
        """Every embedding request not answered ends: with ``error``, or cancelled (``None``)."""
        for job in self._embed_jobs:
            if not job.done.done():
                if error is None:
                    job.done.cancel()
                else:
                    job.done.set_exception(error)
        self._embed_jobs.clear()
        self._embed_waiting.clear()

    def _fail_all(self, error: RankError) -> None:
        gone = self._in_flight()
        if gone:
            self.ranks.send(fr.step_plan(leaves=[fr.session_stop(r.uid, pb.ERROR, str(error)[:200]) for r in gone],
                                         kept=self._take_kept()))
        for req in gone + list(self._waiting):
            req.stats.reason = pb.ERROR
            req.out.put_nowait(error)
        self._running.clear()
        self._chunking.clear()
        self._waiting.clear()
        self._end_embeds(error)
        self._plan = None

    async def close(self) -> None:
        await self.ranks.close()
        for remote in self.remote_drafts.values():
            await remote.close()

"""Every rank's executor of one ``stepPlan``: the order of a plan's parts, written once.

Rank 0 (:meth:`mlxcluster.leader.execution.Rank0Execution._execute`) and every rank N
(:meth:`mlxcluster.control.follower.Follower.run`) run the same plan by iterating :func:`parts`
and handing each part to their :class:`PlanSide` -- as every vLLM v1 worker runs
``execute_model`` on the same ``SchedulerOutput`` (vllm/v1/worker/gpu_model_runner.py) and every
rank of mlx-lm's distributed ``server.py`` runs the same batch loop.  If the two sides iterated
their own copies of the order they could drift apart, and ranks that enter different collectives
hang the group; so the order lives here and nowhere else, and a side only says what a part means
on its rank (the named differences: what rank 0 collects -- the tokens it delivers, the K/V it
receives --, where rank N's K/V replies go, and when the previous plan's remainders are applied).

The order (proto/mlxcluster.proto ``StepPlan``):

1. :class:`Settle` (every plan) -- what the previous plan left for this one: its queued lookahead
   step kept (``settled``), its verify step's ``kept`` counts and the ``--pd`` joins that plan made,
   less those rank 0 refused (the leaves with reason ``ERROR``);
2. :class:`Leave` per ``sessionStop``, in order;
3. :class:`Decode` -- one decode step of the whole batch (a verify step when an entry has a draft),
   queuing the next one when ``ahead``;
4. :class:`Admit` -- the computed and ``--local-decode`` joins get their KV caches (cached prefix taken);
5. :class:`Prefill` -- the computed joins not prefilled by chunks, together when ``batched``;
6. per remaining join, in join order: :class:`HandOff` (a ``--local-decode`` join not chunked:
   prefilled through the pipeline, its K/V moved to rank 0) or :class:`RemoteJoin` (its K/V
   fetched from the prefill group);
7. :class:`Chunk` per ``prefillChunk``, in order;
8. :class:`RemoteJoined`, once after a plan with remote joins (so that every rank's batch takes the
   sequences whose last chunk ran before them, in one order);
9. :class:`Embeds` -- one forward pass of the plan's embedding inputs.

Each part is one unit of MLX work (one call on the MLX thread on rank 0, so the stuck-group
watchdog times one part of one step, never a whole prompt).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Tuple, Union

from ..protocol import frames as fr
from ..protocol import mlxcluster_pb2 as pb

__all__ = ["Settle", "Leave", "Decode", "Admit", "Prefill", "HandOff", "RemoteJoin", "RemoteJoined", "Chunk",
           "Embeds", "Part", "PlanSide", "parts"]


@dataclass(frozen=True)
class Settle:
    """The previous plan's remainders: ``kept`` (its verify step's kept counts, one per decode entry;
    empty: none), ``refused`` (uids of its ``--pd`` joins rank 0 refused: they leave, never join) and
    ``settled`` (its queued lookahead step is kept: its tokens recorded, as rank 0 did first)."""

    kept: Tuple[int, ...]
    refused: Tuple[str, ...]
    settled: bool = False


@dataclass(frozen=True)
class Leave:
    """A sequence leaves: its KV cache is freed (``reason``: a ``StopReason``)."""

    uid: str
    reason: int


@dataclass(frozen=True)
class Decode:
    """One decode step of the batch: ``entries`` (``pb.BatchEntry``, in batch order); ``ahead``: every
    rank then queues the next step on this one's lazy tokens (lookahead)."""

    entries: Tuple[pb.BatchEntry, ...]
    ahead: bool = False

    @property
    def verify(self) -> bool:
        """Whether the step is a speculative verify step (some entry carries a draft)."""
        return any(e.draft for e in self.entries)


@dataclass(frozen=True)
class Admit:
    """The computed and handoff joins (``pb.PromptTokens``) get their KV caches, in order."""

    joins: Tuple[pb.PromptTokens, ...]


@dataclass(frozen=True)
class Prefill:
    """The computed joins not chunked are prefilled: ``joins`` in order, as one batched prefill when
    ``together``."""

    joins: Tuple[pb.PromptTokens, ...]
    together: bool


@dataclass(frozen=True)
class HandOff:
    """A ``--local-decode`` join not chunked: prefilled through the pipeline now, then every other
    stage's K/V goes to rank 0."""

    join: pb.PromptTokens


@dataclass(frozen=True)
class RemoteJoin:
    """A ``--pd`` join: every rank fetches its K/V heads from the prefill group."""

    join: pb.PromptTokens


@dataclass(frozen=True)
class RemoteJoined:
    """After the plan's remote joins (``uids``): rank 0 adds the accepted ones to its batch now; ranks N
    at the next plan's :class:`Settle`, once they know which rank 0 refused."""

    uids: Tuple[str, ...]


@dataclass(frozen=True)
class Chunk:
    """The next prefill chunk of a long prompt: ``count`` tokens from ``position``."""

    uid: str
    position: int
    count: int


@dataclass(frozen=True)
class Embeds:
    """One forward pass of the plan's embedding inputs (``pb.EmbedEntry``, in order)."""

    entries: Tuple[pb.EmbedEntry, ...]


Part = Union[Settle, Leave, Decode, Admit, Prefill, HandOff, RemoteJoin, RemoteJoined, Chunk, Embeds]


class PlanSide:
    """What one part of a plan means on one rank: :meth:`run_part` dispatches a part to the method of its
    name (``settle``, ``leave``, ``decode``, ``admit``, ``prefill``, ``hand_off``, ``remote_join``,
    ``remote_joined``, ``chunk``, ``embeds``).  Rank 0's side is the scheduler's
    :class:`~mlxcluster.leader.execution.Rank0Execution` (its methods are coroutines: the caller awaits
    what :meth:`run_part` returns); rank N's is the follower (its methods return iterators of replies)."""

    _METHODS = {Settle: "settle", Leave: "leave", Decode: "decode", Admit: "admit", Prefill: "prefill",
                HandOff: "hand_off", RemoteJoin: "remote_join", RemoteJoined: "remote_joined", Chunk: "chunk",
                Embeds: "embeds"}

    def run_part(self, part: Part):
        """Run ``part`` on this rank (what the side's method for it returns)."""
        return getattr(self, self._METHODS[type(part)])(part)


def parts(p: pb.StepPlan) -> Iterator[Part]:
    """The parts of plan ``p`` in the one order every rank runs them in (see the module docstring).
    Pure: reads the plan, runs nothing."""
    yield Settle(tuple(p.kept), tuple(x.uid for x in p.leaves if x.reason == pb.ERROR), bool(p.settled))
    for x in p.leaves:
        yield Leave(x.uid, x.reason)
    if p.decode:
        yield Decode(tuple(p.decode), bool(p.ahead))
    admitted = tuple(j for j in p.joins if fr.source_of(j) != fr.REMOTE)
    if admitted:
        yield Admit(admitted)
    whole = tuple(j for j in admitted if fr.source_of(j) == fr.COMPUTE and not j.compute.chunked)
    if whole:
        yield Prefill(whole, bool(p.batched))
    remote: List[str] = []
    for j in p.joins:
        source = fr.source_of(j)
        if source == fr.HANDOFF and not j.handoff.chunked:
            yield HandOff(j)
        elif source == fr.REMOTE:
            remote.append(j.uid)
            yield RemoteJoin(j)
    for c in p.chunks:
        yield Chunk(c.uid, c.position, c.count)
    if remote:
        yield RemoteJoined(tuple(remote))
    if p.embeds:
        yield Embeds(tuple(p.embeds))

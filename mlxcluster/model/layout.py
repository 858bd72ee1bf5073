"""Pipeline layouts: which layers each stage holds, in ds4's layer-range syntax.

A *route* is one layer range per pipeline stage, in rank order (issue 12; reference design
``shared/TOPOLOGIES.md`` section 1).  Syntax, after ds4 (``ds4_distributed.c``, ds4 #430):

* ``A:B`` -- layers ``A`` through ``B``, both inclusive (``0:14`` is 15 layers);
* ``K:output`` -- layers ``K`` through the last, plus the final norm, the output head and
  sampling (the *output stage*);
* ``--layers 0:14,15:output`` -- *forward*: the last stage owns the output;
* ``--layers 15:output,0:14`` -- *reverse*: rank 0 (the coordinator) owns the output, so
  sampling and the token stream stay local and only hidden states travel;
* ``--layers auto`` -- :func:`auto_layers`: an even split (or one weighted by memory), reverse.

Hidden states flow from each stage to the next in rank order, wrapping from the last rank
to rank 0 (``r -> r+1 mod N``: the neighbour rule MLX's ring backend imposes on
``send``/``recv``), so the stage holding layer 0 may sit anywhere and the others follow it
in layer order.  Each stage may itself be tensor-parallel (``--stage-tp 3,1``): stage ``i``
then occupies the next ``tp[i]`` ranks.

Refused, each with one :class:`LayoutError` line: a malformed range, a range outside the
model, gaps, overlaps, missing layers, no or several output stages, ``K:<last>`` written
for ``K:output``, and stages that do not follow layer order in rank order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

__all__ = ["LayoutError", "LayerRange", "Stage", "Route", "parse_layers", "parse_range", "parse_stage_tp", "auto_layers",
           "make_route", "MAX_STAGES"]

#: Most stages a route may have (a bound on what the parser accepts).
MAX_STAGES = 64

_RANGE = re.compile(r"^\s*(\d{1,6})\s*:\s*(\d{1,6}|output)\s*$")


class LayoutError(ValueError):
    """A layer route or stage layout that cannot run; ``str()`` is one line for the user."""


@dataclass(frozen=True)
class LayerRange:
    """Layers ``start`` .. ``end`` (inclusive) of a model with ``n_layers`` layers.

    Attributes:
        start, end: first and last layer index, ``0 <= start <= end < n_layers``.
        output: this stage also runs the final norm and the output head, and samples
            (then ``end == n_layers - 1``).
    """

    start: int
    end: int
    output: bool = False

    @property
    def n_layers(self) -> int:
        """How many transformer layers this range holds."""
        return self.end - self.start + 1

    @property
    def embeds(self) -> bool:
        """This stage embeds the token ids (it holds layer 0)."""
        return self.start == 0

    def __str__(self) -> str:
        return f"{self.start}:{'output' if self.output else self.end}"


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its layers and the ranks that hold them (tensor-parallel when ``tp > 1``).

    Attributes:
        index: position in rank order (0 = the stage that includes rank 0).
        layers: its :class:`LayerRange`.
        tp: ranks in the stage (its tensor-parallel size).
        first_rank: its lowest rank; it holds ranks ``first_rank .. first_rank + tp - 1``.
    """

    index: int
    layers: LayerRange
    tp: int
    first_rank: int

    @property
    def ranks(self) -> Tuple[int, ...]:
        return tuple(range(self.first_rank, self.first_rank + self.tp))


@dataclass(frozen=True)
class Route:
    """The stages of a pipeline in rank order.

    Attributes:
        stages: one :class:`Stage` per stage, rank order.
        n_layers: the model's layer count.
    """

    stages: Tuple[Stage, ...]
    n_layers: int

    @property
    def world_size(self) -> int:
        return sum(s.tp for s in self.stages)

    @property
    def output_stage(self) -> Stage:
        return next(s for s in self.stages if s.layers.output)

    @property
    def first_stage(self) -> Stage:
        """The stage that embeds (holds layer 0): where hidden states start."""
        return next(s for s in self.stages if s.layers.embeds)

    @property
    def reverse(self) -> bool:
        """Rank 0's stage owns the output (the coordinator samples locally)."""
        return self.stages[0].layers.output

    def flow(self) -> Tuple[Stage, ...]:
        """Stages in the order hidden states visit them (layer order)."""
        first = self.first_stage.index
        return self.stages[first:] + self.stages[:first]

    def stage_of(self, rank: int) -> Stage:
        """The stage holding ``rank``.

        Raises:
            LayoutError: ``rank`` outside ``0 .. world_size - 1``.
        """
        for s in self.stages:
            if rank in s.ranks:
                return s
        raise LayoutError(f"rank {rank} is outside this route's {self.world_size} ranks")

    def spec(self) -> str:
        """The ``--layers`` text of this route."""
        return ",".join(str(s.layers) for s in self.stages)

    def identity(self) -> str:
        """The route as one string, stage sizes included (``"15:output,0:14"``, or
        ``"0:14,15:output x3,1"`` with tensor-parallel stages): what ``promptTokens`` carries
        so that every stage checks it runs the same route."""
        tps = [s.tp for s in self.stages]
        return self.spec() + ("" if all(t == 1 for t in tps) else " x" + ",".join(map(str, tps)))

    def check_local_decode(self) -> None:
        """Raise :class:`LayoutError` unless ``--local-decode`` can run on this route: rank 0
        owns ``K:output`` (it decodes alone, so it loads every layer) and every stage is one
        rank (each pushes its whole layers' K/V)."""
        if not self.reverse:
            raise LayoutError("--local-decode needs rank 0 to own K:output (a reverse route such as "
                              "15:output,0:14)")
        if any(s.tp > 1 for s in self.stages):
            raise LayoutError("--local-decode needs single-rank stages (no --stage-tp)")


def parse_range(text: str, n_layers: int) -> LayerRange:
    """One stage's range (``A:B`` or ``K:output``), checked against the model alone (a node's
    ``join --layers``; :func:`parse_layers` checks a whole route).

    Raises:
        LayoutError: malformed, empty, or outside the model's layers.
    """
    m = _RANGE.match(text)
    if not m:
        raise LayoutError(f"bad layer range {text.strip()!r}: write A:B (inclusive) or K:output")
    start = int(m.group(1))
    last = n_layers - 1
    if m.group(2) == "output":
        if start > last:
            raise LayoutError(f"layer range {text.strip()!r}: the model has layers 0..{last}")
        return LayerRange(start, last, True)
    end = int(m.group(2))
    if end < start:
        raise LayoutError(f"layer range {text.strip()!r} is empty: its end is before its start")
    if end > last:
        raise LayoutError(f"layer range {text.strip()!r}: the model has layers 0..{last}")
    return LayerRange(start, end, False)


def parse_layers(spec: str, n_layers: int) -> List[LayerRange]:
    """The ranges of ``--layers`` (one per stage, rank order), validated as a route.

    Args:
        spec: e.g. ``"15:output,0:14"`` (not ``"auto"``: see :func:`auto_layers`).
        n_layers: the model's number of transformer layers.
    Returns:
        ``list[LayerRange]`` in rank order.
    Raises:
        LayoutError: see the module docstring (one line naming the problem).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise LayoutError("--layers is empty: give one range per stage, e.g. 0:14,15:output")
    parts = spec.split(",")
    if len(parts) > MAX_STAGES:
        raise LayoutError(f"--layers names {len(parts)} stages; at most {MAX_STAGES}")
    ranges = [parse_range(p, n_layers) for p in parts]
    _check(ranges, n_layers)
    return ranges


def _check(ranges: Sequence[LayerRange], n_layers: int) -> None:
    last = n_layers - 1
    outputs = [r for r in ranges if r.output]
    if not outputs:
        ends = [r for r in ranges if r.end == last]
        if ends:
            r = ends[0]
            raise LayoutError(f"write {r.start}:output, not {r}: the stage holding the last layer ({last}) "
                              "also owns the final norm, the output head and sampling")
        raise LayoutError(f"no stage owns the output: one range must be K:output (the model has layers 0..{last})")
    if len(outputs) > 1:
        raise LayoutError(f"{len(outputs)} stages claim the output ({', '.join(map(str, outputs))}); exactly one may")
    by_start = sorted(ranges, key=lambda r: r.start)
    if by_start[0].start != 0:
        raise LayoutError(f"layers 0..{by_start[0].start - 1} are on no stage")
    for a, b in zip(by_start, by_start[1:]):
        if b.start <= a.end:
            raise LayoutError(f"layer ranges {a} and {b} overlap (layers {b.start}..{min(a.end, b.end)})")
        if b.start > a.end + 1:
            raise LayoutError(f"layers {a.end + 1}..{b.start - 1} are on no stage (between {a} and {b})")
    # hidden states flow rank r -> r+1 (mod N): in rank order, each stage continues the previous one
    n = len(ranges)
    for i, r in enumerate(ranges):
        nxt = ranges[(i + 1) % n]
        if not r.output and nxt.start != r.end + 1:
            raise LayoutError(f"stages must follow layer order in rank order (wrapping to rank 0): the stage "
                              f"after {r} holds {nxt}, not layer {r.end + 1} onwards")


def parse_stage_tp(spec: Optional[str], n_stages: int) -> Tuple[int, ...]:
    """``--stage-tp`` (e.g. ``"3,1"``): the tensor-parallel size of each stage, rank order.

    ``None`` or ``""``: 1 for every stage.

    Raises:
        LayoutError: not one positive integer per stage.
    """
    if not spec:
        return (1,) * n_stages
    try:
        sizes = tuple(int(x) for x in spec.split(","))
    except ValueError:
        raise LayoutError(f"--stage-tp {spec!r}: give one positive integer per stage, e.g. 3,1") from None
    if len(sizes) != n_stages:
        raise LayoutError(f"--stage-tp {spec!r} names {len(sizes)} stage(s), --layers {n_stages}")
    if any(s < 1 for s in sizes):
        raise LayoutError(f"--stage-tp {spec!r}: every stage needs at least one rank")
    return sizes


def auto_layers(n_layers: int, n_stages: int, weights: Optional[Sequence[float]] = None,
                reverse: bool = True) -> List[LayerRange]:
    """An even split of ``n_layers`` over ``n_stages`` (or one proportional to ``weights``,
    e.g. each node's advertised memory), every stage at least one layer.

    ``reverse`` (default, as mlx-lm's ``pipeline``): rank 0 gets the last layers and the output,
    ranks 1.. the first layers in order, e.g. 30 layers, 2 stages -> ``15:output,0:14``.
    Otherwise forward: ``0:14,15:output``.  Shares are rounded by largest remainder.

    Raises:
        LayoutError: fewer layers than stages, no stages, or bad weights.
    """
    if n_stages < 1 or n_stages > min(n_layers, MAX_STAGES):
        raise LayoutError(f"cannot split {n_layers} layers into {n_stages} stage(s)")
    w = list(weights) if weights is not None else [1.0] * n_stages
    if len(w) != n_stages or any(not x > 0 for x in w):
        raise LayoutError("stage weights must be one positive number per stage")
    spare = n_layers - n_stages  # every stage gets one layer, the rest by share
    exact = [spare * x / sum(w) for x in w]
    counts = [1 + int(e) for e in exact]
    for i in sorted(range(n_stages), key=lambda i: -(exact[i] - int(exact[i])))[: n_layers - sum(counts)]:
        counts[i] += 1
    ranges, start = [], 0  # in layer order
    for c in counts:
        ranges.append(LayerRange(start, start + c - 1, start + c == n_layers))
        start += c
    return ranges[-1:] + ranges[:-1] if reverse and n_stages > 1 else ranges


def make_route(ranges: Sequence[LayerRange], n_layers: int, stage_tp: Optional[Sequence[int]] = None) -> Route:
    """A :class:`Route` from validated ranges (rank order) and each stage's TP size.

    Raises:
        LayoutError: the ranges do not form a route (:func:`parse_layers`' checks), or
            ``stage_tp`` is not one positive size per stage.
    """
    _check(ranges, n_layers)
    tps = tuple(stage_tp) if stage_tp is not None else (1,) * len(ranges)
    if len(tps) != len(ranges) or any(t < 1 for t in tps):
        raise LayoutError("one positive tensor-parallel size per stage is needed")
    stages, first = [], 0
    for i, (r, tp) in enumerate(zip(ranges, tps)):
        stages.append(Stage(i, r, tp, first))
        first += tp
    return Route(tuple(stages), n_layers)

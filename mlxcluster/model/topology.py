"""The topology of one rank group, parsed once: :class:`Topology`.

A group of ranks runs one of these shapes (``ARCHITECTURE.md``; ``shared/TOPOLOGIES.md``):

* **tensor parallel** -- ``tp`` ranks each hold a slice of every layer (``--world-size N``);
* **pipeline** -- ``--layers`` (:mod:`mlxcluster.model.layout`): one layer range per stage in rank
  order, each stage ``--stage-tp`` ranks; ``--local-decode`` (a reverse route: the other stages hand
  their K/V to rank 0, which decodes alone); ``--pp-logits relay|all_sum`` (who gets the logits);
* **attention-FFN disaggregation** -- ``--afd A:1`` (:mod:`mlxcluster.model.afd`) with
  ``--afd-microbatches M``;
* **prefill/decode disaggregation** -- ``--role prefill`` (a one-rank group that only prefills), or a
  tensor-parallel decode group with ``--prefill-peer HOST:PORT`` (a prompt whose K/V stream the
  prefill group refuses is prefilled by the decode group itself).
* **a draft group** -- ``--role draft``: one rank holding a draft model that serves
  ``Generation.Draft`` to target groups (``--draft remote:HOST:PORT``, :mod:`mlxcluster.leader.remote_draft`).

``mlxcluster`` (``cli/``) builds a :class:`Topology` from its options, calls :meth:`Topology.validate`
once against the model, and hands it to the launcher inside the ranks' one
:class:`~mlxcluster.runtime.rank_config.RankConfig` (whose ``world_size`` is :attr:`Topology.world_size`);
the rank reads it back and validates it with the same method (a rank may also be started by ``join``
or a test, without the command line's check).  Every rule lives in :meth:`Topology.validate`.

The rank grid follows vLLM's ``parallel_state`` (``torch.arange(world).reshape(..., pp, tp)``):
:meth:`Topology.grid` lays ranks ``0 .. world_size - 1`` out as one row per tensor-parallel group
(a pipeline stage; the one group of a TP topology), from which :meth:`Topology.stage_of` and
:meth:`Topology.tp_ranks` are read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from .layout import LayoutError, Route, auto_layers, make_route, parse_layers, parse_stage_tp

__all__ = ["Topology", "TopologyError", "ROLES", "PP_LOGITS"]

#: ``--role`` values of a rank group (a PD decode group is ``tp`` with a ``--prefill-peer``; ``draft``:
#: a one-rank group serving a draft model to target groups).
ROLES = ("tp", "prefill", "draft")
#: ``--pp-logits`` values: only rank 0 gets the logits (relay) or every rank (all_sum).
PP_LOGITS = ("relay", "all_sum")


class TopologyError(ValueError):
    """A topology that cannot run (on this model); ``str()`` is one line for the user."""


@dataclass(frozen=True)
class Topology:
    """How a group's ranks split one model.  Immutable; built from options, checked by :meth:`validate`.

    Attributes:
        tp: ranks given as ``--world-size``: the size of a tensor-parallel group; with ``--layers auto``
            the number of stages (at least 2); with a route or ``--afd``, ``None`` (the route's or the
            split's size) or that size.  ``None`` for a plain group means 1.  After :meth:`validate`
            it is :attr:`world_size`.
        layers: the ``--layers`` route, one ``A:B`` / ``K:output`` range per stage in rank order, or
            ``"auto"`` (resolved by :meth:`validate`); ``None``: no pipeline.
        stage_tp: ``--stage-tp``, ranks per stage in rank order (``"3,1"``); ``None``: 1 each.
        local_decode: ``--local-decode``: rank 0 (owner of ``K:output``) decodes alone after the
            other stages hand it their K/V.
        pp_logits: ``--pp-logits``: ``relay`` (only rank 0 gets the logits; a reverse route's other
            ranks get tokens in frames) or ``all_sum`` (every rank gets them and samples itself).
        afd: ``--afd A:1``, attention ranks : FFN ranks; ``None``: no attention-FFN split.
        afd_microbatches: ``--afd-microbatches``, sequences in flight per AFD round (at least 1).
        role: ``tp`` (prefills and decodes), ``prefill`` (a one-rank prefill group) or ``draft`` (a
            one-rank group serving its model as a draft model, ``Generation.Draft``).
        prefill_peer: ``HOST:PORT`` of the prefill group a decode group takes every prompt's K/V from
            (a refused stream: the decode group prefills that prompt itself).
    """

    tp: Optional[int] = None
    layers: Optional[str] = None
    stage_tp: Optional[str] = None
    local_decode: bool = False
    pp_logits: str = "relay"
    afd: Optional[str] = None
    afd_microbatches: int = 1
    role: str = "tp"
    prefill_peer: Optional[str] = None

    # -- kinds -----------------------------------------------------------------------------------

    @property
    def kind(self) -> str:
        """``"tp"``, ``"pipeline"``, ``"afd"``, ``"prefill"``, ``"decode"`` (a PD decode group) or
        ``"draft"``."""
        if self.afd is not None:
            return "afd"
        if self.layers is not None:
            return "pipeline"
        if self.role in ("prefill", "draft"):
            return self.role
        return "decode" if self.prefill_peer else "tp"

    @property
    def pd(self) -> bool:
        """Prefill/decode disaggregation: a prefill group or a decode group."""
        return self.role == "prefill" or bool(self.prefill_peer)

    @property
    def stage_sizes(self) -> Tuple[int, ...]:
        """Ranks per pipeline stage, rank order (``(tp,)``: one group of every rank without a pipeline;
        one ``1`` per rank with ``--afd``).

        Raises:
            TopologyError: a malformed ``--layers``/``--stage-tp``/``--afd`` (:meth:`validate` says which).
        """
        if self.afd is not None:
            return (1,) * self._afd_world_size()
        if self.layers is None:
            return (self.tp or 1,)
        spec = self.layers.strip()
        n_stages = max(self.tp or 2, 2) if spec == "auto" else len(spec.split(","))
        try:
            return parse_stage_tp(self.stage_tp, n_stages)
        except LayoutError as exc:
            raise TopologyError(str(exc)) from None

    @property
    def world_size(self) -> int:
        """Ranks the group needs: ``tp``; the sum of the stages' sizes; ``A + 1`` with ``--afd A:1``.

        Raises:
            TopologyError: a malformed ``--layers``/``--stage-tp``/``--afd``.
        """
        return sum(self.stage_sizes)

    def _afd_world_size(self) -> int:
        parts = (self.afd or "").split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise TopologyError(f"--afd {self.afd!r}: write attention ranks:FFN ranks, e.g. 1:1 or 2:1")
        return int(parts[0]) + int(parts[1])

    # -- the rank grid ---------------------------------------------------------------------------

    def grid(self) -> Tuple[Tuple[int, ...], ...]:
        """Ranks ``0 .. world_size - 1`` as one row per tensor-parallel group, rank order.

        Built like vLLM's ``parallel_state``: ``numpy.arange(world_size)`` split at the stage
        boundaries; with stages of equal size it is ``arange(world_size).reshape(stages, tp)``
        (a TP group: one row of every rank; ``--stage-tp 3,1``: ``((0, 1, 2), (3,))``; ``--afd``:
        one row per rank, which share no weights).

        Raises:
            TopologyError: a malformed topology (:attr:`stage_sizes`).
        """
        sizes = self.stage_sizes
        ranks = np.arange(sum(sizes))
        if len(set(sizes)) == 1:
            rows = ranks.reshape(len(sizes), sizes[0])
        else:
            rows = np.split(ranks, np.cumsum(sizes)[:-1])
        return tuple(tuple(int(r) for r in row) for row in rows)

    def stage_of(self, rank: int) -> int:
        """The row of :meth:`grid` (pipeline stage, rank order) that holds ``rank``.

        Raises:
            TopologyError: ``rank`` outside ``0 .. world_size - 1``.
        """
        for i, row in enumerate(self.grid()):
            if rank in row:
                return i
        raise TopologyError(f"rank {rank} is outside this topology's {self.world_size} rank(s)")

    def tp_ranks(self, stage: int) -> Tuple[int, ...]:
        """The ranks of stage ``stage`` (its tensor-parallel group), ascending.

        Raises:
            TopologyError: no such stage.
        """
        g = self.grid()
        if not 0 <= stage < len(g):
            raise TopologyError(f"stage {stage} is outside this topology's {len(g)} stage(s)")
        return g[stage]

    def tp_rank(self, rank: int) -> int:
        """``rank``'s index within its tensor-parallel group (0 .. that group's size - 1)."""
        return self.tp_ranks(self.stage_of(rank)).index(rank)

    # -- the model ------------------------------------------------------------------------------

    def route(self, n_layers: int) -> Route:
        """The pipeline :class:`~mlxcluster.model.layout.Route` of a model of ``n_layers`` layers
        (``auto``: an even reverse split over :attr:`stage_sizes`' stages).

        Raises:
            TopologyError: no ``--layers``, or a route that does not tile the model.
        """
        if self.layers is None:
            raise TopologyError("this topology has no --layers route")
        try:
            spec = self.layers.strip()
            n_stages = max(self.tp or 2, 2) if spec == "auto" else None
            ranges = auto_layers(n_layers, n_stages) if n_stages else parse_layers(spec, n_layers)
            return make_route(ranges, n_layers, parse_stage_tp(self.stage_tp, len(ranges)))
        except LayoutError as exc:
            raise TopologyError(str(exc)) from None

    def afd_layout(self, n_layers: int):
        """The :class:`~mlxcluster.model.afd.AfdLayout` of ``--afd`` over ``n_layers`` layers.

        Raises:
            TopologyError: no ``--afd``, or a split :func:`~mlxcluster.model.afd.parse_afd` refuses.
        """
        if self.afd is None:
            raise TopologyError("this topology has no --afd split")
        from .afd import parse_afd  # imports MLX

        try:
            return parse_afd(self.afd, n_layers)
        except ValueError as exc:
            raise TopologyError(str(exc)) from None

    def validate(self, config: Mapping[str, Any], *, name: str = "the model",
                 quantization: Optional[Dict[str, Any]] = None, weights: Optional[str] = None) -> "Topology":
        """Check every rule of a topology against a model; return its canonical form.

        Args:
            config: the model's config dict (``ModelInfo.config``: ``num_hidden_layers``, heads, ...).
            name: the model's display name, for messages.
            quantization: the model's quantisation map (``None``: unquantised), for tensor-parallel splits.
            weights: the weight format the ranks load (``None``: ``float32``), for tensor-parallel splits.
        Returns:
            The same topology with ``--layers auto`` resolved to its route, the route and
            ``--stage-tp`` in canonical text (``None`` when every stage has one rank), and
            ``tp == world_size``: what :meth:`to_args` serialises.
        Raises:
            TopologyError: the first broken rule, one line naming the options: a value outside its
                choices; ``--afd`` with ``--layers``/``--local-decode``; ``--afd-microbatches``
                without ``--afd`` or below 1; ``--stage-tp``/``--local-decode`` without ``--layers``;
                ``--pp-logits all_sum`` without ``--layers``; a bad route or split
                (:mod:`~mlxcluster.model.layout`, :func:`~mlxcluster.model.afd.parse_afd`);
                ``--local-decode`` on a route rank 0 does not own the output of, or with TP stages;
                ``--world-size`` other than the route's or the split's size; ``--role prefill`` with
                ``--prefill-peer`` or more than one rank; ``--role draft`` with more than one rank or
                any other topology option; PD with ``--layers``/``--afd``; a
                ``--prefill-peer`` that is not ``HOST:PORT``; pipelines, AFD or PD on a model
                outside the Llama family; a (stage) TP size that does not split the model.
        """
        t = self
        # values outside their choices (RankConfig checks only their types)
        if t.role not in ROLES:
            raise TopologyError(f"--role {t.role!r}: choose {' or '.join(ROLES)}")
        if t.pp_logits not in PP_LOGITS:
            raise TopologyError(f"--pp-logits {t.pp_logits!r}: choose {' or '.join(PP_LOGITS)}")
        if t.tp is not None and t.tp < 1:
            raise TopologyError("--world-size must be at least 1")
        # options that need or exclude each other
        if t.afd is None and t.afd_microbatches != 1:
            raise TopologyError("--afd-microbatches needs --afd")
        if t.afd is not None and (t.layers is not None or t.local_decode):
            raise TopologyError("--afd excludes --layers and --local-decode")
        if t.afd is not None and t.afd_microbatches < 1:
            raise TopologyError("--afd-microbatches must be at least 1")
        if t.layers is None and t.stage_tp is not None:
            raise TopologyError("--stage-tp needs --layers")
        if t.layers is None and t.local_decode:
            raise TopologyError("--local-decode needs --layers (a reverse route such as 15:output,0:14)")
        if t.layers is None and t.pp_logits != "relay":
            raise TopologyError("--pp-logits needs --layers")
        if t.role == "prefill" and t.prefill_peer:
            raise TopologyError("--role prefill and --prefill-peer exclude each other: a prefill group has no peer")
        if t.role == "draft" and (t.prefill_peer or t.layers is not None or t.afd is not None or (t.tp or 1) != 1):
            raise TopologyError("--role draft runs one rank holding the whole draft model: it excludes --world-size "
                                "above 1, --layers, --afd and --prefill-peer")
        if t.pd and (t.layers is not None or t.afd is not None):
            raise TopologyError("prefill/decode disaggregation runs tensor-parallel groups: it excludes --layers, "
                                "--stage-tp, --local-decode and --afd")
        if t.role == "prefill" and (t.tp or 1) != 1:
            raise TopologyError("--role prefill runs one rank (--pd 1:N): tensor-parallel prefill groups are "
                                "not supported")
        if t.prefill_peer is not None:
            host, _, port = t.prefill_peer.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise TopologyError(f"--prefill-peer {t.prefill_peer!r}: write HOST:PORT")
        # the model
        from .arch import is_llama, model_type, text_config

        what = ("--afd" if t.afd is not None else "--layers" if t.layers is not None
                else "--role prefill" if t.role == "prefill"
                else "prefill/decode disaggregation" if t.prefill_peer else None)
        if what is not None and not is_llama(dict(config)):
            try:
                arch = model_type(dict(config))
            except ValueError:
                arch = "?"
            raise TopologyError(f"{what} supports Llama-family models only; {name} is {arch} "
                                "(tensor parallelism, --world-size N, runs every architecture)")
        c = text_config(dict(config))
        n_layers = int(c.get("num_hidden_layers") or c["num_layers"])
        if t.afd is not None:
            layout = t.afd_layout(n_layers)
            if t.tp is not None and t.tp != layout.world_size:
                raise TopologyError(f"--afd {t.afd} needs {layout.world_size} ranks, --world-size is {t.tp}")
            return dataclasses.replace(t, tp=layout.world_size)
        if t.layers is not None:
            route = t.route(n_layers)
            if t.layers.strip() != "auto" and t.tp is not None and t.tp != route.world_size:
                raise TopologyError(f"--world-size {t.tp}, but the route has {route.world_size} rank(s)")
            if t.local_decode:
                try:
                    route.check_local_decode()
                except LayoutError as exc:
                    raise TopologyError(str(exc)) from None
            for size in sorted({s.tp for s in route.stages} - {1}):
                _check_split(config, size, quantization, weights, name)
            sizes = [s.tp for s in route.stages]
            return dataclasses.replace(t, tp=route.world_size, layers=route.spec(),
                                       stage_tp=None if set(sizes) == {1} else ",".join(map(str, sizes)))
        tp = t.tp or 1
        if tp > 1:
            _check_split(config, tp, quantization, weights, name)
        return dataclasses.replace(t, tp=tp)

    def check_group(self, size: int) -> None:
        """Raise :class:`TopologyError` unless a group of ``size`` ranks runs this topology
        (a rank's MLX group against the route or split it was given)."""
        if size != self.world_size:
            what = (f"--afd {self.afd}" if self.afd is not None else "the route" if self.layers is not None
                    else "the topology")
            raise TopologyError(f"{what} needs {self.world_size} rank(s), the group has {size}")

    # -- the one serialisation ------------------------------------------------------------------

    def to_args(self) -> List[str]:
        """This topology in the words of ``mlxcluster``'s options (``["--layers", "15:output,0:14",
        "--local-decode"]``), defaults and the group size left out: its canonical text, which names
        a shard in the prompt cache's disk identity (:mod:`mlxcluster.engine.prompt_disk`).  A rank
        is given its topology in its :class:`~mlxcluster.runtime.rank_config.RankConfig`, not as these.
        """
        out: List[str] = []
        if self.layers is not None:
            out += ["--layers", self.layers]
        if self.stage_tp is not None:
            out += ["--stage-tp", self.stage_tp]
        if self.local_decode:
            out.append("--local-decode")
        if self.pp_logits != "relay":
            out += ["--pp-logits", self.pp_logits]
        if self.afd is not None:
            out += ["--afd", self.afd]
        if self.afd_microbatches != 1:
            out += ["--afd-microbatches", str(self.afd_microbatches)]
        if self.role != "tp":
            out += ["--role", self.role]
        if self.prefill_peer is not None:
            out += ["--prefill-peer", self.prefill_peer]
        return out


def _check_split(config, size: int, quantization, weights: Optional[str], name: str) -> None:
    from .tp import WorldSizeError, check_world_size  # imports MLX

    try:
        check_world_size(dict(config), size, quantization, weights or "float32", name)
    except WorldSizeError as exc:
        raise TopologyError(str(exc)) from None

"""A rank's whole configuration, serialised once: :class:`RankConfig`.

Every setting a rank process (:mod:`mlxcluster.runtime.rank`) reads is one field of one frozen
dataclass: the group (world size, control ports and hosts, bind address, backend, formation epoch),
the model and its weight format, the :class:`~mlxcluster.model.topology.Topology`, rank 0's
admission limits, speculation, the KV format and the prompt cache's disk tier.  Callers build one
(``dataclasses.replace`` for variations) and the launcher puts it on the rank's command line as
ONE argument, ``--config JSON`` (:meth:`RankConfig.to_json`, compact JSON that fits a command
line: ``mpirun`` gives every MPI rank the same one), or a standby rank reads it from its bootstrap
line; the rank reads it back with :meth:`RankConfig.from_json`, which checks every field's type
and choices (a one-line :class:`ValueError`).  The topology's rules are still
:meth:`Topology.validate`'s, against the model, on the rank.

Settings that are a node's, not a group's, stay where they were: MLX's own ``MLX_RANK`` /
``MLX_HOSTFILE`` / ``MLX_IBV_DEVICES`` (the backend's interface, :mod:`mlxcluster.runtime.backends`)
and, for MPI ranks whose one command line is rank 0's node's, the node's model path and
prompt-cache directory (``MLXCLUSTER_MODEL`` / ``MLXCLUSTER_PROMPT_CACHE_DIR``, read once by
:mod:`mlxcluster.config`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from ..model.topology import Topology

__all__ = ["RankConfig", "BACKENDS", "KV_BITS", "NO_PROMPT_DISK", "prompt_cache_refusal"]

#: ``backend`` values (``any``: MLX picks; a world size of 1 always runs ``any``).
BACKENDS = ("ring", "mpi", "jaccl", "any")
#: ``kv_bits`` values (0: full precision).
KV_BITS = (0, 4, 8)

_INT, _FLOAT, _STR, _BOOL = (int,), (int, float), (str,), (bool,)


@dataclass(frozen=True)
class RankConfig:
    """One rank's configuration (the same for every rank of a group but ``bind`` where it is ``""``).

    Attributes:
        world_size: ranks in the group (>= 1); the topology's ``tp`` on the rank.
        ports: one control port per rank, rank order (rank 0's serves ``Generation``).
        hosts: control hosts, one for every rank or one per rank.
        bind: address this rank's gRPC server binds (``""``: its own entry of ``hosts``, for MPI
            ranks sharing one command line).
        backend: one of :data:`BACKENDS`.
        model: the model's path (``None``: ``MLXCLUSTER_MODEL``, a node's own path).
        weights: the weight format (``None``: this platform's default).
        topology: the group's :class:`Topology` (``tp`` is ignored: ``world_size`` is the size).
        epoch: the formation's id, carried by its frames and handoffs.
        step_timeout: seconds rank 0 waits for a step's replies.
        max_batch: sequences decoded together (``None``: ``MLXCLUSTER_MAX_BATCH``).
        max_queue: requests waiting for a batch slot (``None``: ``MLXCLUSTER_MAX_QUEUE``).
        itl_target_ms: inter-token latency target, ms (``None``: ``MLXCLUSTER_ITL_TARGET_MS``; 0: none).
        compile: world size 1 decodes with ``mx.compile``.
        draft: rank 0's default drafter (``ngram``, ``model:PATH``, ``remote:HOST:PORT``, ...; ``""``: off).
        draft_tokens: the most draft tokens verified per step.
        prompt_cache_dir: the prefix cache's disk tier (``""``: none, or the node's, see below).
        prompt_cache_size: its most bytes of files (``"4GiB"``; ``""``: the default).
        prompt_cache_node: ``prompt_cache_dir`` is a ``join`` node's default: a topology without a
            disk tier logs it and keeps none instead of failing.
        kv_bits: one of :data:`KV_BITS`, the KV caches' quantisation.
        kv_group_size: elements per KV quantisation group along head_dim.
    """

    world_size: int = 1
    ports: Tuple[int, ...] = ()
    hosts: Tuple[str, ...] = ("127.0.0.1",)
    bind: str = "127.0.0.1"
    backend: str = "ring"
    model: Optional[str] = None
    weights: Optional[str] = None
    topology: Topology = Topology()
    epoch: str = ""
    step_timeout: float = 120.0
    max_batch: Optional[int] = None
    max_queue: Optional[int] = None
    itl_target_ms: Optional[float] = None
    compile: bool = True
    draft: str = ""
    draft_tokens: int = 4
    prompt_cache_dir: str = ""
    prompt_cache_size: str = ""
    prompt_cache_node: bool = False
    kv_bits: int = 0
    kv_group_size: int = 64

    def addresses(self) -> Tuple[str, ...]:
        """``"host:port"`` per rank, rank order.

        Raises:
            ValueError: not one port per rank, or neither one host nor one per rank (one line)."""
        hosts = self.hosts * len(self.ports) if len(self.hosts) == 1 else self.hosts
        if len(self.ports) != self.world_size or len(hosts) != self.world_size:
            raise ValueError(f"need {self.world_size} ports and hosts, got {len(self.ports)} and {len(hosts)}")
        return tuple(f"{h}:{p}" for h, p in zip(hosts, self.ports))

    def for_launch(self) -> "RankConfig":
        """This configuration as a rank is started with it: world size 1 runs backend ``any``
        (no group to form)."""
        return dataclasses.replace(self, backend="any") if self.world_size == 1 else self

    def group_topology(self) -> Topology:
        """:attr:`topology` with ``tp`` = :attr:`world_size` (what :meth:`Topology.validate` checks)."""
        return dataclasses.replace(self.topology, tp=self.world_size)

    # -- the one serialisation ------------------------------------------------------------------

    def to_json(self) -> str:
        """This configuration as compact JSON (no spaces): one object, the topology nested.
        ``RankConfig.from_json(c.to_json()) == c``."""
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RankConfig":
        """The configuration :meth:`to_json` wrote, every field checked (missing ones: defaults).

        Raises:
            ValueError: not a JSON object, an unknown field, a value of the wrong type, a
                ``backend``/``kv_bits`` outside its choices, a world size below 1 (one line)."""
        try:
            raw = json.loads(text)
        except ValueError:
            raise ValueError("rank config: not JSON") from None
        if not isinstance(raw, dict):
            raise ValueError("rank config: not a JSON object")
        return cls.from_dict(raw)

    def to_dict(self) -> Dict[str, Any]:
        """This configuration as JSON values (:meth:`to_json` before ``json.dumps``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Dict[str, Any]) -> "RankConfig":
        """The configuration of :meth:`to_dict`'s values (a standby's bootstrap line carries them).

        Raises:
            ValueError: as :meth:`from_json`."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ValueError(f"rank config: unknown field {unknown[0]!r}")
        values = {k: _value(k, v, _FIELDS[k]) for k, v in raw.items() if k != "topology"}
        for k in ("ports", "hosts"):
            if k in values:
                values[k] = tuple(values[k])
        if "topology" in raw:
            values["topology"] = _topology(raw["topology"])
        out = cls(**values)
        if out.world_size < 1:
            raise ValueError("rank config: world_size must be at least 1")
        if out.backend not in BACKENDS:
            raise ValueError(f"rank config: backend {out.backend!r}: choose {', '.join(BACKENDS)}")
        if out.kv_bits not in KV_BITS:
            raise ValueError(f"rank config: kv_bits {out.kv_bits}: choose 0, 4 or 8")
        return out


#: field -> (accepted JSON types, None allowed, list item types or None)
_FIELDS: Dict[str, tuple] = dict(
    world_size=(_INT, False, None), ports=((list,), False, _INT), hosts=((list,), False, _STR),
    bind=(_STR, False, None), backend=(_STR, False, None), model=(_STR, True, None),
    weights=(_STR, True, None), epoch=(_STR, False, None), step_timeout=(_FLOAT, False, None),
    max_batch=(_INT, True, None), max_queue=(_INT, True, None), itl_target_ms=(_FLOAT, True, None),
    compile=(_BOOL, False, None), draft=(_STR, False, None), draft_tokens=(_INT, False, None),
    prompt_cache_dir=(_STR, False, None), prompt_cache_size=(_STR, False, None),
    prompt_cache_node=(_BOOL, False, None), kv_bits=(_INT, False, None), kv_group_size=(_INT, False, None))

#: Topology field -> (accepted JSON types, None allowed)
_TOPOLOGY: Dict[str, tuple] = dict(
    tp=(_INT, True, None), layers=(_STR, True, None), stage_tp=(_STR, True, None),
    local_decode=(_BOOL, False, None), pp_logits=(_STR, False, None), afd=(_STR, True, None),
    afd_microbatches=(_INT, False, None), role=(_STR, False, None), prefill_peer=(_STR, True, None))


def _value(name: str, value: Any, spec: tuple) -> Any:
    types, nullable, items = spec
    if value is None and nullable:
        return None
    # bool is an int in Python: a flag is no number, and a number no flag
    ok = isinstance(value, types) and (isinstance(value, bool) == (types == _BOOL))
    if ok and items is not None:
        ok = all(isinstance(v, items) and not isinstance(v, bool) for v in value)
    if not ok:
        want = {_INT: "an integer", _FLOAT: "a number", _STR: "a string", _BOOL: "true or false"}.get(types)
        want = want or f"a list of {'integers' if items == _INT else 'strings'}"
        raise ValueError(f"rank config: {name} must be {want}{' or null' if nullable else ''}, got {value!r:.60}")
    return value


def _topology(raw: Any) -> Topology:
    if not isinstance(raw, dict):
        raise ValueError("rank config: topology must be an object")
    unknown = sorted(set(raw) - set(_TOPOLOGY))
    if unknown:
        raise ValueError(f"rank config: unknown topology field {unknown[0]!r}")
    return Topology(**{k: _value(f"topology.{k}", v, _TOPOLOGY[k]) for k, v in raw.items()})


#: Topology fields whose groups keep no disk tier: their prompts' K/V is handed off or computed by
#: another group (the prefix cache is a tensor-parallel group's or a pipeline's)
NO_PROMPT_DISK = ("--local-decode", "--afd", "--role")


def prompt_cache_refusal(topology: Topology) -> Optional[str]:
    """Why ``--prompt-cache-dir`` cannot serve ``topology``'s group, in one line, or None.  Tensor
    parallelism and pipelines (``--layers``, ``--stage-tp``) of any world size can: each rank keeps
    its own shard's files and a join from disk takes what every rank holds
    (:meth:`PrefixCache.take`); local decode, AFD and prefill/draft roles cannot (:data:`NO_PROMPT_DISK`)."""
    bad = ("--local-decode" if topology.local_decode else "--afd" if topology.afd is not None
           else f"--role {topology.role}" if topology.role != "tp" else None)
    return None if bad is None else f"--prompt-cache-dir serves tensor-parallel groups and pipelines, not {bad}"

"""Every environment variable the package reads, read once.

=============================  ==========  =================================================
variable                       default     meaning
=============================  ==========  =================================================
``MLXCLUSTER_SECRET``          ``""``      cluster secret (or ``--secret-file``): every gRPC link
                                           is mutual TLS whose certificates it authenticates
                                           (:mod:`mlxcluster.security`); never on the command line
``MLXCLUSTER_CLUSTER``         ``local``   cluster name, the salt of the secret's key derivation
                                           (``join`` sets it for its ranks)
``MLXCLUSTER_CA_SEED``         ``""``      set by the process that starts a rank: the secret's
                                           scrypt output for the cluster (64 hex digits,
                                           :func:`mlxcluster.security.rank_environment`), so
                                           the rank skips the derivation (~0.2 s of its start)
``MLXCLUSTER_LOG``             ``WARNING`` log level of rank processes (DEBUG, INFO, WARNING, ERROR, CRITICAL)
``MLXCLUSTER_WEIGHTS``         (unset)     weight format when ``--weights`` is not given
                                           (quantized, float32, float16, bfloat16); unset: the
                                           fastest measured for the platform
``MLXCLUSTER_MAX_BATCH``       ``64``      cap on sequences rank 0 decodes together (``--max-batch``)
``MLXCLUSTER_MAX_QUEUE``       ``64``      requests allowed to wait at rank 0 for a batch slot
                                           (``--max-queue``)
``MLXCLUSTER_ITL_TARGET_MS``   ``0``       inter-token latency target of rank 0's decode batch,
                                           milliseconds (``--itl-target-ms``; 0: none)
``MLXCLUSTER_LOOKAHEAD``       ``on``      ``off``: rank 0 plans no lookahead steps (every rank reads
                                           each decode step before the next is queued); for
                                           measuring the decode path both ways (issue 42)
``MLXCLUSTER_BLAS``            ``""``      ``reference``: no OpenBLAS preload for rank processes;
                                           an absolute path: preload that library (where it
                                           exists); empty: find OpenBLAS
``MLXCLUSTER_MODEL``           (unset)     model of a rank started without ``--model`` (a ``join``
                                           node sets it for the MPI ranks mpirun starts there)
``MLXCLUSTER_PROMPT_CACHE_DIR`` (unset)    a node's prompt-cache directory for MPI ranks (a ``join``
                                           node sets it for the ranks mpirun's ``orted`` starts
                                           there, whose one command line is rank 0's node's): each
                                           rank's disk tier where the formation's topology keeps one
``MLXCLUSTER_PROMPT_CACHE_SIZE`` (unset)   ... and its ``--prompt-cache-size``
``MLXCLUSTER_FAILPOINTS``      (unset)     tests only: failpoints a rank process sets at start-up,
                                           ``name=action`` entries separated by ``;``, e.g.
                                           ``handoff.send=hash`` (a wrong ``--local-decode`` KV
                                           handoff header) or ``pd.send=dup`` (a ``--pd`` KV
                                           stream's frames sent twice) or
                                           ``control.send=delay(3)`` (every step-plan frame
                                           3 ms late); the syntax, every
                                           failpoint and action: :mod:`mlxcluster.failpoints`
``MLXCLUSTER_PROVIDER_TOKEN``  (unset)     ``router --provider-token`` (read by typer only)
``MLXCLUSTER_ROUTER_TOKEN``    (unset)     ``serve --router-token`` (read by typer only; falls
                                           back to ``MLXCLUSTER_PROVIDER_TOKEN``)
=============================  ==========  =================================================

:func:`config` reads the environment the first time it is called and returns
the same :class:`Config` afterwards; a value a variable does not allow (:data:`SETTINGS`)
is one line naming the variable and the allowed values, which every ``mlxcluster`` command
reports before it does anything (exit status 2).  Variables the package *writes* for its
child processes (``MLX_RANK``, ``MLX_HOSTFILE``, ``OMPI_*``, ``LD_PRELOAD``,
``PYTHONPATH``; see :mod:`mlxcluster.runtime.supervisor`) are not settings; a rank reads its launch
rank (``MLX_RANK`` / ``OMPI_COMM_WORLD_RANK``) here too, as :attr:`Config.launch_rank`.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

from . import failpoints as _failpoints

__all__ = ["Config", "config", "VARIABLES", "SETTINGS", "TYPER_VARIABLES", "LOG_LEVELS", "WEIGHT_FORMATS", "parse_bytes"]

#: Names of the variables :class:`Config` reads that a launcher forwards to the ranks mpirun starts
#: (a node's own ``MLXCLUSTER_PROMPT_CACHE_*`` are not: each node's ``join`` sets them for its ranks).
VARIABLES = ("MLXCLUSTER_SECRET", "MLXCLUSTER_CLUSTER", "MLXCLUSTER_CA_SEED", "MLXCLUSTER_LOG", "MLXCLUSTER_WEIGHTS", "MLXCLUSTER_MAX_BATCH",
             "MLXCLUSTER_MAX_QUEUE", "MLXCLUSTER_ITL_TARGET_MS", "MLXCLUSTER_BLAS", "MLXCLUSTER_MODEL",
             "MLXCLUSTER_FAILPOINTS", "MLXCLUSTER_LOOKAHEAD")

#: Variables typer reads, as options' ``envvar`` (any text; not part of :class:`Config`).
TYPER_VARIABLES = ("MLXCLUSTER_PROVIDER_TOKEN", "MLXCLUSTER_ROUTER_TOKEN")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: Weight formats a model loads as (``--weights``, ``MLXCLUSTER_WEIGHTS``;
#: :data:`mlxcluster.model.loader.WEIGHT_FORMATS` is this tuple).
WEIGHT_FORMATS = ("quantized", "float32", "float16", "bfloat16")

#: Every variable :meth:`Config.from_env` reads -> the values it allows, as a bad value's one-line
#: error ends (``"{name}={value!r}: {allowed}"``); ``""``: any text.
SETTINGS = {
    "MLXCLUSTER_SECRET": "",
    "MLXCLUSTER_CLUSTER": "",
    "MLXCLUSTER_CA_SEED": "64 hex digits or empty (set by the process that starts a rank)",
    "MLXCLUSTER_LOG": f"one of {', '.join(LOG_LEVELS)} (any case)",
    "MLXCLUSTER_WEIGHTS": f"one of {', '.join(WEIGHT_FORMATS)}, or empty (the platform's fastest)",
    "MLXCLUSTER_MAX_BATCH": "an integer, at least 1",
    "MLXCLUSTER_MAX_QUEUE": "an integer, at least 0",
    "MLXCLUSTER_ITL_TARGET_MS": "an integer number of milliseconds, at least 0",
    "MLXCLUSTER_BLAS": "reference, the absolute path of a BLAS library, or empty (find OpenBLAS)",
    "MLXCLUSTER_MODEL": "",
    "MLXCLUSTER_PROMPT_CACHE_DIR": "",
    "MLXCLUSTER_PROMPT_CACHE_SIZE": "a size such as 4GiB or 800MB, a number of bytes, or empty (the default)",
    "MLXCLUSTER_FAILPOINTS": "name=action entries separated by ';', or empty",
    "MLXCLUSTER_LOOKAHEAD": "one of on, off, or empty (on)",
}


#: units of :func:`parse_bytes` (case-insensitive): decimal K/M/G/T(B), binary KiB/MiB/GiB/TiB
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, option: str, example: str, minimum: int = 1, too_small: str = "") -> int:
    """Bytes of a size option's value: a number with an optional unit (``B``; ``KB``, ``MB``, ``GB``,
    ``TB`` or ``K``, ``M``, ``G``, ``T``: powers of 1000; ``KiB``, ``MiB``, ``GiB``, ``TiB``: powers of
    1024; case-insensitive), e.g. ``"1.5GiB"``, ``"800MB"``, ``"2000000000"``.

    Raises:
        ValueError: anything else (one line naming ``option`` and showing ``example``), or a size below
            ``minimum`` bytes (``too_small`` where given, else the same line)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text or ""))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(f"{option} {text!r}: a size such as {example} or a number of bytes")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size < minimum:
        raise ValueError(f"{option} {text!r}: {too_small}" if too_small else
                         f"{option} {text!r}: a size such as {example} or a number of bytes")
    return size


def _bad(name: str, raw: str, why: str = "") -> ValueError:
    """The one-line error of ``name``'s value ``raw``: what is wrong (``why``, if more than "not
    allowed") and :data:`SETTINGS`' allowed values."""
    return ValueError(f"{name}={raw!r}: {why + '; allowed: ' if why else ''}{SETTINGS[name]}")


def _int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise _bad(name, raw, "not an integer") from None
    if value < minimum:
        raise _bad(name, raw, f"below {minimum}")
    return value


def _choice(env: Mapping[str, str], name: str, choices: Tuple[str, ...], upper: bool = False) -> Optional[str]:
    """``name``'s value (upper-cased where ``upper``) if one of ``choices``; ``None`` when unset or empty."""
    raw = env.get(name, "").strip()
    value = raw.upper() if upper else raw
    if raw and value not in choices:
        raise _bad(name, raw)
    return value or None


def _checked(env: Mapping[str, str], name: str, ok) -> str:
    """``name``'s value (``""`` unset), which ``ok(value)`` accepts when not empty."""
    raw = env.get(name, "")
    if raw and not ok(raw):
        raise _bad(name, raw)
    return raw


def _is_hex32(text: str) -> bool:
    return re.fullmatch(r"[0-9a-fA-F]{64}", text) is not None


def _is_size(text: str) -> bool:
    try:
        parse_bytes(text, "", "")
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Config:
    """The package's settings from the environment (see the module docstring for each).

    Attributes:
        secret: ``MLXCLUSTER_SECRET``.
        cluster: ``MLXCLUSTER_CLUSTER``.
        ca_seed: ``MLXCLUSTER_CA_SEED`` (hex; "" when the rank derives it from the secret).
        log_level: ``MLXCLUSTER_LOG``, upper-cased.
        weights: ``MLXCLUSTER_WEIGHTS`` (one of :data:`WEIGHT_FORMATS`) or ``None``.
        max_batch: ``MLXCLUSTER_MAX_BATCH`` (>= 1).
        max_queue: ``MLXCLUSTER_MAX_QUEUE`` (>= 0).
        itl_target_ms: ``MLXCLUSTER_ITL_TARGET_MS`` (>= 0; 0: none).
        blas: ``MLXCLUSTER_BLAS``.
        model: ``MLXCLUSTER_MODEL`` or ``None``.
        failpoints: ``MLXCLUSTER_FAILPOINTS`` as ``(name, action)`` pairs, checked
            (:func:`mlxcluster.failpoints.parse`; ``()``: none).
        prompt_cache_dir: ``MLXCLUSTER_PROMPT_CACHE_DIR`` ("" none).
        prompt_cache_size: ``MLXCLUSTER_PROMPT_CACHE_SIZE`` ("" the default).
        lookahead: ``MLXCLUSTER_LOOKAHEAD`` (``on``/``off``) as a bool.
        launch_rank: this process's rank as its launcher gave it, before the group forms: MLX's
            ``MLX_RANK`` (the ring and jaccl backends' interface, which MLX itself reads again in
            ``mx.distributed.init``) or OpenMPI's ``OMPI_COMM_WORLD_RANK``; ``None`` when neither is set.
    """

    secret: str = ""
    cluster: str = "local"
    ca_seed: str = ""
    log_level: str = "WARNING"
    weights: Optional[str] = None
    max_batch: int = 64
    max_queue: int = 64
    itl_target_ms: int = 0
    blas: str = ""
    model: Optional[str] = None
    failpoints: Tuple[Tuple[str, str], ...] = ()
    prompt_cache_dir: str = ""
    prompt_cache_size: str = ""
    lookahead: bool = True
    launch_rank: Optional[str] = None

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "Config":
        """Read the variables from ``env`` (default ``os.environ``).

        Raises:
            ValueError: a value :data:`SETTINGS` does not allow: a numeric variable that is not
                an integer or is out of range, an unknown log level or weight format, a CA seed
                that is not 64 hex digits, a ``MLXCLUSTER_BLAS`` neither ``reference`` nor an
                absolute path, a size that is not one, an unknown failpoint or action in
                ``MLXCLUSTER_FAILPOINTS`` (one line naming the variable and the allowed values).
        """
        env = os.environ if env is None else env
        try:
            failpoints = tuple(_failpoints.parse(env.get("MLXCLUSTER_FAILPOINTS", "")).items())
        except ValueError as exc:
            raise ValueError(f"MLXCLUSTER_FAILPOINTS: {exc}; allowed: {SETTINGS['MLXCLUSTER_FAILPOINTS']}") from None
        return cls(secret=env.get("MLXCLUSTER_SECRET", ""), cluster=env.get("MLXCLUSTER_CLUSTER", "") or "local",
                   ca_seed=_checked(env, "MLXCLUSTER_CA_SEED", _is_hex32),
                   log_level=_choice(env, "MLXCLUSTER_LOG", LOG_LEVELS, upper=True) or cls.log_level,
                   weights=_choice(env, "MLXCLUSTER_WEIGHTS", WEIGHT_FORMATS),
                   max_batch=_int(env, "MLXCLUSTER_MAX_BATCH", cls.max_batch, 1),
                   max_queue=_int(env, "MLXCLUSTER_MAX_QUEUE", cls.max_queue, 0),
                   itl_target_ms=_int(env, "MLXCLUSTER_ITL_TARGET_MS", cls.itl_target_ms, 0),
                   blas=_checked(env, "MLXCLUSTER_BLAS", lambda v: v == "reference" or os.path.isabs(v)),
                   model=env.get("MLXCLUSTER_MODEL") or None, failpoints=failpoints,
                   prompt_cache_dir=env.get("MLXCLUSTER_PROMPT_CACHE_DIR", ""),
                   prompt_cache_size=_checked(env, "MLXCLUSTER_PROMPT_CACHE_SIZE", _is_size),
                   lookahead=(_choice(env, "MLXCLUSTER_LOOKAHEAD", ("on", "off")) or "on") == "on",
                   launch_rank=env.get("MLX_RANK", env.get("OMPI_COMM_WORLD_RANK")))


@functools.lru_cache(maxsize=None)
def config() -> Config:
    """This process's :class:`Config`, read from the environment on the first call.

    Raises:
        ValueError: as :meth:`Config.from_env` (then again on the next call).
    """
    return Config.from_env()

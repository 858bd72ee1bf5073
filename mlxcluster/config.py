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
``MLXCLUSTER_BLAS``            ``""``      ``reference``: no OpenBLAS preload for rank processes;
                                           a path: preload that library; empty: find OpenBLAS
``MLXCLUSTER_MODEL``           (unset)     model of a rank started without ``--model`` (a ``join``
                                           node sets it for the MPI ranks mpirun starts there)
``MLXCLUSTER_PROMPT_CACHE_DIR`` (unset)    a ``join`` node's ``--prompt-cache-dir``, set for the ranks
                                           it starts (or mpirun's ``orted`` starts there): each rank's
                                           disk tier where the formation's topology keeps one
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
the same :class:`Config` afterwards.  Variables the package *writes* for its
child processes (``MLX_RANK``, ``MLX_HOSTFILE``, ``OMPI_*``, ``LD_PRELOAD``,
``PYTHONPATH``; see :mod:`mlxcluster.runtime.supervisor`) are not settings.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

from . import failpoints as _failpoints

__all__ = ["Config", "config", "VARIABLES", "parse_bytes"]

#: Names of the variables :class:`Config` reads (forwarded to ranks started by mpirun).
VARIABLES = ("MLXCLUSTER_SECRET", "MLXCLUSTER_CLUSTER", "MLXCLUSTER_CA_SEED", "MLXCLUSTER_LOG", "MLXCLUSTER_WEIGHTS", "MLXCLUSTER_MAX_BATCH",
             "MLXCLUSTER_MAX_QUEUE", "MLXCLUSTER_ITL_TARGET_MS", "MLXCLUSTER_BLAS", "MLXCLUSTER_MODEL",
             "MLXCLUSTER_FAILPOINTS")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


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


def _int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value}: must be at least {minimum}")
    return value


@dataclass(frozen=True)
class Config:
    """The package's settings from the environment (see the module docstring for each).

    Attributes:
        secret: ``MLXCLUSTER_SECRET``.
        cluster: ``MLXCLUSTER_CLUSTER``.
        ca_seed: ``MLXCLUSTER_CA_SEED`` (hex; "" when the rank derives it from the secret).
        log_level: ``MLXCLUSTER_LOG``, upper-cased.
        weights: ``MLXCLUSTER_WEIGHTS`` or ``None`` (validated by
            :func:`mlxcluster.model.loader.default_weight_format`).
        max_batch: ``MLXCLUSTER_MAX_BATCH`` (>= 1).
        max_queue: ``MLXCLUSTER_MAX_QUEUE`` (>= 0).
        itl_target_ms: ``MLXCLUSTER_ITL_TARGET_MS`` (>= 0; 0: none).
        blas: ``MLXCLUSTER_BLAS``.
        model: ``MLXCLUSTER_MODEL`` or ``None``.
        failpoints: ``MLXCLUSTER_FAILPOINTS`` as ``(name, action)`` pairs, checked
            (:func:`mlxcluster.failpoints.parse`; ``()``: none).
        prompt_cache_dir: ``MLXCLUSTER_PROMPT_CACHE_DIR`` ("" none).
        prompt_cache_size: ``MLXCLUSTER_PROMPT_CACHE_SIZE`` ("" the default).
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

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "Config":
        """Read the variables from ``env`` (default ``os.environ``).

        Raises:
            ValueError: a numeric variable that is not an integer or is out of range,
                an unknown log level, or an unknown failpoint or action in
                ``MLXCLUSTER_FAILPOINTS`` (one line naming the variable).
        """
        env = os.environ if env is None else env
        log_level = (env.get("MLXCLUSTER_LOG", "").strip() or "WARNING").upper()
        if log_level not in LOG_LEVELS:
            raise ValueError(f"MLXCLUSTER_LOG={log_level.lower()!r}: choose one of {', '.join(LOG_LEVELS)}")
        try:
            failpoints = tuple(_failpoints.parse(env.get("MLXCLUSTER_FAILPOINTS", "")).items())
        except ValueError as exc:
            raise ValueError(f"MLXCLUSTER_FAILPOINTS: {exc}") from None
        return cls(secret=env.get("MLXCLUSTER_SECRET", ""), cluster=env.get("MLXCLUSTER_CLUSTER", "") or "local",
                   ca_seed=env.get("MLXCLUSTER_CA_SEED", ""),
                   log_level=log_level,
                   weights=env.get("MLXCLUSTER_WEIGHTS") or None,
                   max_batch=_int(env, "MLXCLUSTER_MAX_BATCH", cls.max_batch, 1),
                   max_queue=_int(env, "MLXCLUSTER_MAX_QUEUE", cls.max_queue, 0),
                   itl_target_ms=_int(env, "MLXCLUSTER_ITL_TARGET_MS", cls.itl_target_ms, 0),
                   blas=env.get("MLXCLUSTER_BLAS", ""), model=env.get("MLXCLUSTER_MODEL") or None,
                   failpoints=failpoints, prompt_cache_dir=env.get("MLXCLUSTER_PROMPT_CACHE_DIR", ""),
                   prompt_cache_size=env.get("MLXCLUSTER_PROMPT_CACHE_SIZE", ""))


@functools.lru_cache(maxsize=None)
def config() -> Config:
    """This process's :class:`Config`, read from the environment on the first call.

    Raises:
        ValueError: as :meth:`Config.from_env` (then again on the next call).
    """
    return Config.from_env()

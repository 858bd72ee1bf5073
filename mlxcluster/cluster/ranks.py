"""Rank supervision for a node daemon: start this node's rank of a formation, and
the pure state transitions its progress events, its exit and its start timeout cause.

Processes are spawned and watched by :mod:`mlxcluster.runtime.supervisor`
(command line, environment, ``@@mlxcluster`` events, stderr tail, stop); a rank
exits by itself when its daemon dies (the parent watch in
:mod:`mlxcluster.runtime.rank`).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Callable

from ..runtime.supervisor import RankProcess, Supervisor, rank_command, rank_env
from ..runtime import backends as bk
from .membership import Bootstrapping, Failed, Formation, OwnState, Running

__all__ = ["RANK_START_TIMEOUT_S", "start_rank", "after_event", "after_exit", "after_start_timeout"]

#: Seconds a rank process may take from ``Bootstrap`` to ``ready``.
RANK_START_TIMEOUT_S = 300.0


def start_rank(formation: Formation, rank: int, *, bind: str, model_path: str, secret: str, cluster: str,
               workdir: str,
               on_event: Callable[[dict], None], on_exit: Callable[[RankProcess], None]) -> Supervisor:
    """Write the backend's files into ``workdir`` and start rank ``rank`` of ``formation``.

    ``on_event(event)`` / ``on_exit(process)`` are called from the supervisor's
    reader threads.  Stop the rank with the returned supervisor's ``stop()``.

    Raises:
        ValueError: the formation's endpoints are invalid for its backend.
        OSError: the files cannot be written or the process cannot be started.
    """
    os.makedirs(workdir, exist_ok=True)
    members = formation.members
    extra = {"MLXCLUSTER_SECRET": secret, "MLXCLUSTER_CLUSTER": cluster}  # the environment: not in ps
    if formation.world_size > 1:
        endpoints = [bk.RankEndpoint(rank=m.rank, address=m.address, ring_port=m.ring_port,
                                     control_port=m.control_port) for m in members]
        extra.update(bk.write_backend_files(formation.backend, endpoints, rank, workdir))
    cmd = rank_command(formation.world_size, [m.control_port for m in members], backend=formation.backend,
                       hosts=[m.address for m in members], bind=bind, model=model_path,
                       weights=formation.weights or None)
    supervisor = Supervisor(on_event=on_event, on_exit=on_exit)
    supervisor.spawn(cmd, rank_env(1, extra), name=f"rank {rank}")
    return supervisor


def after_event(own: OwnState, event: dict) -> OwnState:
    """``own`` after a progress event of its rank process: ``error`` -> :class:`Failed`,
    ``loading``/``loaded``/``connecting`` -> loading, ``ready`` -> :class:`Running`."""
    if not isinstance(own, (Bootstrapping, Running)):
        return own
    kind = event.get("event")
    if kind == "error":
        return Failed(own.formation, own.rank, own.since, str(event.get("message") or "rank failed"))
    if kind == "ready":
        return Running(own.formation, own.rank, own.since)
    if kind in ("loading", "loaded", "connecting") and isinstance(own, Bootstrapping):
        return replace(own, loading=True)
    return own


def after_exit(own: OwnState, why: str) -> OwnState:
    """``own`` after its rank process exited (``why``: one line); a failure unless already failed."""
    if isinstance(own, (Bootstrapping, Running)):
        return Failed(own.formation, own.rank, own.since, why)
    return own


def after_start_timeout(own: OwnState, now: float) -> OwnState:
    """``own`` at ``now``: :class:`Failed` when its rank has not been ready for ``RANK_START_TIMEOUT_S``."""
    if isinstance(own, Bootstrapping) and now - own.since > RANK_START_TIMEOUT_S:
        return Failed(own.formation, own.rank, own.since, "rank process did not become ready in time")
    return own

"""A standby rank: one rank process started ahead of the formation it will serve.

A re-formation after a lost node restarts every rank (an MLX group cannot be rebuilt inside a
live process), and a rank's start is mostly work that does not depend on the formation: the
interpreter, the imports (MLX, mlx-lm, gRPC, the engine), the TLS credentials (scrypt) and
reading and dequantising the model file -- ~2 s of CPU per rank here, on the critical path of
every re-formation, and more when several ranks start on the same cores.  A node keeps one
``python -m mlxcluster.runtime.rank --standby`` process that has done that work and waits on
its stdin; a formation's bootstrap hands it its rank configuration and backend environment
(:meth:`Standby.adopt`) instead of starting a new process, and the node starts the next
standby once that rank serves.

Only where each node starts its own rank: the ring and jaccl backends, and world size 1.  With
MPI, ``mpirun`` starts the ranks through each node's ``orted``, which a waiting process cannot
join.
"""

from __future__ import annotations

import json
import sys
import threading
from typing import TYPE_CHECKING, Callable, Mapping, Optional

from .supervisor import EventCallback, RankProcess, Supervisor, rank_env

if TYPE_CHECKING:  # pragma: no cover
    from .rank_config import RankConfig

__all__ = ["Standby", "standby_command"]


def standby_command(model: Optional[str] = None) -> list:
    """argv of a standby rank (``--model``: the file it may preload; else ``MLXCLUSTER_MODEL``)."""
    return [sys.executable, "-m", "mlxcluster.runtime.rank", "--standby"] + (["--model", model] if model else [])


class Standby:
    """One standby rank process and its hand-over.

    Until adopted its events and exit go nowhere but :attr:`ready` / :attr:`exited`; after
    :meth:`adopt` they go to the formation's callbacks, through the same supervisor, which
    then supervises the rank (``stop()`` it as any rank's).

    Args:
        model: the node's model path (preloaded when it fits, see ``rank._standby``).
        extra_env: the rank's environment beyond :func:`rank_env` (the cluster secret and name:
            never on the command line).
    Raises:
        OSError: the process cannot be started.
    """

    def __init__(self, model: Optional[str], extra_env: Mapping[str, str]):
        self._lock = threading.Lock()
        self._on_event: Optional[EventCallback] = None
        self._on_exit: Optional[Callable[[RankProcess], None]] = None
        self.ready = threading.Event()  # its "standby" event: warmed up, waiting for a bootstrap
        self.exited = threading.Event()  # it exited before it was adopted
        self.adopted = False
        self.supervisor = Supervisor(on_event=self._event, on_exit=self._exit)
        self.process = self.supervisor.spawn(standby_command(model), rank_env(1, dict(extra_env)), name="standby",
                                             stdin=True)

    def _event(self, event: dict) -> None:
        with self._lock:
            forward = self._on_event
        if forward is not None:
            forward(event)
        elif event.get("event") == "standby":
            self.ready.set()

    def _exit(self, proc: RankProcess) -> None:
        with self._lock:
            forward = self._on_exit
        if forward is not None:
            forward(proc)
        else:
            self.exited.set()

    def alive(self) -> bool:
        """Whether it can still be adopted: not adopted, and running."""
        return not self.adopted and not self.exited.is_set() and self.process.popen.poll() is None

    def adopt(self, config: "RankConfig", env: Mapping[str, str], name: str,
              on_event: Optional[EventCallback], on_exit: Optional[Callable[[RankProcess], None]]) -> Supervisor:
        """Make it the rank of ``config`` (a :class:`~mlxcluster.runtime.rank_config.RankConfig`, sent
        on one line as ``{"config": config.to_dict(), "env": env}``) with
        ``env`` added to its environment before its group is initialised; from now on its events
        and exit go to ``on_event`` / ``on_exit`` and messages call it ``name``.  If it has not
        finished warming up it reads the line when it has.

        Returns:
            The supervisor that now supervises the rank.
        Raises:
            OSError: it has exited or was adopted already (start a fresh rank instead).
        """
        if not self.alive():
            raise OSError("the standby rank is gone")
        with self._lock:
            self._on_event, self._on_exit = on_event, on_exit
            self.adopted = True
            self.process.name = name
        try:
            self.process.send(json.dumps({"config": config.for_launch().to_dict(), "env": dict(env)},
                                         separators=(",", ":")))
        except OSError:
            with self._lock:  # it died meanwhile: its exit is no formation's
                self._on_event = self._on_exit = None
            raise
        return self.supervisor

    def stop(self) -> None:
        """Stop it (SIGKILL: nothing of it needs a clean exit)."""
        self.supervisor.stop(timeout_s=0)

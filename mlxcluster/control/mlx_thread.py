"""The rank process's ONE MLX thread, which also says how long its current work has run and how long its recent work took.

Every MLX call of a rank process runs on one executor thread (ARCHITECTURE.md, "Processes, threads
and tasks").  A rank whose peer froze (SIGSTOP, a hung machine) blocks there, inside a collective
(``all_sum``) that the frozen rank never joins, while its gRPC threads still answer.  :meth:`MlxThread.busy_s`
makes that visible to whoever asks the rank how it is (``HealthReply.busy_s``, ``InfoReply.busy_s``):
the node daemon combines it with its peers' silence to find a frozen member sooner than a
heartbeat timeout alone (:func:`mlxcluster.cluster.membership.peer_timeout`).  :meth:`MlxThread.step_s`
(``HealthReply.step_s``, ``InfoReply.step_s``) says how long a piece takes here now -- the slowest of
the last ``RECENT`` -- so that a long ``busy_s`` is judged against this machine's own pace: on a
loaded machine a decode step of 0.7 s is ordinary, not a stall.
"""

from __future__ import annotations

import collections
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Callable, Optional

__all__ = ["MlxThread", "busy_s", "step_s", "RECENT"]

#: completed pieces of work :meth:`MlxThread.step_s` looks back over
RECENT = 32


class MlxThread(ThreadPoolExecutor):
    """A one-thread executor (thread name ``mlx_0``) that times the work it runs.

    Each submitted callable is one piece of work (rank 0: a scheduler step; rank N: a drain of its
    inbox, which calls :meth:`mark` before each frame, so that a piece is one frame).
    """

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="mlx")
        self._since: Optional[float] = None  # time.monotonic() the current piece began; None: idle
        self._recent: collections.deque = collections.deque(maxlen=RECENT)  # completed pieces' seconds

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        def timed():
            self._since = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                self._end(time.monotonic())
                self._since = None

        return super().submit(timed)

    def _end(self, now: float) -> None:
        since = self._since
        if since is not None:
            self._recent.append(now - since)

    def mark(self) -> None:
        """A new piece of work begins inside the running callable (rank N: the next frame)."""
        if self._since is not None:
            now = time.monotonic()
            self._end(now)
            self._since = now

    def step_s(self) -> float:
        """Seconds of the slowest of the last ``RECENT`` completed pieces of work (0.0 before any)."""
        return max(tuple(self._recent), default=0.0)

    def busy_s(self) -> float:
        """Seconds the current piece of work has run (0.0 when the thread is idle)."""
        since = self._since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)


def busy_s(executor: Optional[Executor]) -> float:
    """:meth:`MlxThread.busy_s` of ``executor``, 0.0 for any other executor (tests' plain ones)."""
    return executor.busy_s() if isinstance(executor, MlxThread) else 0.0


def step_s(executor: Optional[Executor]) -> float:
    """:meth:`MlxThread.step_s` of ``executor``, 0.0 for any other executor."""
    return executor.step_s() if isinstance(executor, MlxThread) else 0.0

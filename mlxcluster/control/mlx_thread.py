"""The rank process's ONE MLX thread, which also says how long its current work has run and how long its recent work took.

Every MLX call of a rank process runs on one executor thread (ARCHITECTURE.md, "Processes, threads
and tasks").  A rank whose peer froze (SIGSTOP, a hung machine) blocks there, inside a collective
(``all_sum``) that the frozen rank never joins, while its gRPC threads still answer.  :meth:`MlxThread.busy_s`
makes that visible to whoever asks the rank how it is (``HealthReply.busy_s``, ``InfoReply.busy_s``):
the node daemon combines it with its peers' silence to find a frozen member sooner than a
heartbeat timeout alone (:func:`mlxcluster.cluster.membership.peer_timeout`).  :meth:`MlxThread.step_s`
(``HealthReply.step_s``, ``InfoReply.step_s``) says how long a piece takes here now -- the slowest of
the last ``RECENT`` -- so that a long ``busy_s`` is judged against this machine's own pace: on a
loaded machine a decode step of 0.7 s is ordinary, not a stall.  :meth:`MlxThread.plan_waits` says
how long a rank N's thread sat idle before the frames it ran: whether the control link is on a
decode step's path (issue 42: with lookahead the next plan arrives while the queued step computes,
so the thread finds it waiting, not the other way round).
"""

from __future__ import annotations

import collections
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Callable, Optional

__all__ = ["MlxThread", "busy_s", "step_s", "RECENT"]

#: completed pieces of work :meth:`MlxThread.step_s` looks back over
RECENT = 32
#: idle seconds before a frame beyond which :meth:`MlxThread.plan_waits` counts it as between
#: generations (no request), not as a step waiting for its plan
WAIT_CAP_S = 1.0
#: idle seconds before a frame from which it counts as having waited for its plan
WAITED_S = 1e-3


class MlxThread(ThreadPoolExecutor):
    """A one-thread executor (thread name ``mlx_0``) that times the work it runs.

    Each submitted callable is one piece of work (rank 0: a scheduler step; rank N: a drain of its
    inbox, which calls :meth:`mark` before each frame, so that a piece is one frame).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(max_workers=1, thread_name_prefix="mlx")
        self._clock = clock  # seconds (tests: a fake clock)
        self._since: Optional[float] = None  # the clock's time the current piece began; None: idle
        self._recent: collections.deque = collections.deque(maxlen=RECENT)  # completed pieces' seconds
        self._ended: Optional[float] = None  # the clock's time the last callable returned
        self._idle = 0.0  # seconds idle before the running callable, until its first frame (mark) takes them
        self._waits = [0, 0.0, 0]  # frames, idle seconds before them, frames that waited (plan_waits)

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        def timed():
            self._since = self._clock()
            self._idle = self._since - self._ended if self._ended is not None else WAIT_CAP_S
            try:
                return fn(*args, **kwargs)
            finally:
                self._ended = self._clock()
                self._end(self._ended)
                self._since = None

        return super().submit(timed)

    def _end(self, now: float) -> None:
        since = self._since
        if since is not None:
            self._recent.append(now - since)

    def mark(self) -> None:
        """A new piece of work begins inside the running callable (rank N: the next frame); the first
        frame of a callable waited the idle time before it, the others none."""
        idle, self._idle = self._idle, 0.0
        if idle < WAIT_CAP_S:
            self._waits[0] += 1
            self._waits[1] += idle
            self._waits[2] += idle >= WAITED_S
        if self._since is not None:
            now = self._clock()
            self._end(now)
            self._since = now

    def plan_waits(self) -> dict:
        """Since the thread started, over the frames :meth:`mark` began (rank N) that did not follow a
        pause of :data:`WAIT_CAP_S` or more (between generations): ``plan_frames``; ``plan_wait_s``, the seconds
        the thread sat idle before them (waiting for the frame: the control link and rank 0's
        decision, when a step's next plan is late); ``plan_waited``, how many of them found it idle for
        :data:`WAITED_S` or more.  Counters (they only grow): a run's figures are differences."""
        frames, wait_s, waited = self._waits
        return {"plan_frames": frames, "plan_wait_s": round(wait_s, 6), "plan_waited": waited}

    def step_s(self) -> float:
        """Seconds of the slowest of the last ``RECENT`` completed pieces of work (0.0 before any)."""
        return max(tuple(self._recent), default=0.0)

    def busy_s(self) -> float:
        """Seconds the current piece of work has run (0.0 when the thread is idle)."""
        since = self._since
        return 0.0 if since is None else max(0.0, self._clock() - since)


def busy_s(executor: Optional[Executor]) -> float:
    """:meth:`MlxThread.busy_s` of ``executor``, 0.0 for any other executor (tests' plain ones)."""
    return executor.busy_s() if isinstance(executor, MlxThread) else 0.0


def step_s(executor: Optional[Executor]) -> float:
    """:meth:`MlxThread.step_s` of ``executor``, 0.0 for any other executor."""
    return executor.step_s() if isinstance(executor, MlxThread) else 0.0

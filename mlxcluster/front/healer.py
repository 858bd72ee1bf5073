"""``serve`` keeps its group serving: watch it, and replace it when it fails.

A :class:`Healer` runs as one task on ``serve``'s event loop.  Every
``probe_s`` it checks the group: a rank process that exited (the supervisor's
``failure``), a rank 0 whose port refuses ``Info`` (``UNAVAILABLE``: its process is gone)
or one that answered no ``Info`` for ``stuck_after_s`` (frozen or wedged; rank 0 itself
fails the group within ``LOST_AFTER_S`` when a rank N stops answering heartbeats, and
then exits) means the group failed.  Then:

1. the provider is marked unavailable (``/health`` reports ``restarting``):
   new requests wait for the next group (up to the provider's
   ``unavailable_wait_s``, then 503 + ``Retry-After``), and requests in flight,
   whose streams broke with the group, wait to be replayed on it (the
   provider's failover, :meth:`~mlxcluster.front.provider.Provider._generate`);
2. the group is torn down (every process group SIGTERMed, then SIGKILLed: no
   orphans, a stopped process included);
3. a new group is started (fresh ports and secret) with back-off, and the
   provider is pointed at its rank 0 (which wakes the waiting requests); the
   time from the failure's detection to serving again is the provider's
   ``mlxcluster_provider_reformation_seconds``.  After ``max_failed_starts``
   consecutive failed starts the state is ``failed`` and serving stays 503
   with the reason.

The group is anything :class:`Group` describes: local ranks
(:func:`local_group`), or a formed cluster found over mDNS (re-found after a
failure: its nodes re-form by themselves).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import grpc

from ..protocol import mlxcluster_pb2 as pb
from ..protocol import mlxcluster_pb2_grpc as pb_grpc

log = logging.getLogger("mlxcluster.serve")

__all__ = ["Group", "Healer", "local_group"]


@dataclass
class Group:
    """One running group as ``serve`` sees it.

    Attributes:
        address: ``host:port`` of rank 0's ``Generation`` service.
        credentials: client :class:`~mlxcluster.security.Credentials` for it.
        failure: returns one line on why the group failed, ``None`` while it runs.
        stop: tears the group down (blocking; kills every process it started).
        moved: for a group that re-forms by itself (``serve --cluster``): returns one line when
            another group serves in its place (blocking, bounded; asked when rank 0 misses an
            ``Info``), ``None`` otherwise -- a frozen rank 0 is then replaced as soon as its
            cluster re-formed, not after ``stuck_after_s``.
    """

    address: str
    credentials: object
    failure: Callable[[], Optional[str]]
    stop: Callable[[], None]
    moved: Optional[Callable[[], Optional[str]]] = None


def local_group(cluster) -> Group:
    """:class:`Group` of a started :class:`~mlxcluster.runtime.launcher.LocalCluster`."""
    return Group(cluster.address, cluster.credentials, lambda: cluster.failure, lambda: cluster.stop(timeout_s=2.0))


class Healer:
    """Watch ``group`` for ``provider`` and replace it when it fails (see the module docstring).

    Args:
        provider: the :class:`~mlxcluster.front.provider.Provider` serving the group.
        group: the running group.
        start: starts a new group and returns it (blocking; run in a thread);
            raises on failure (any exception: one line is kept as the reason).
        probe_s: seconds between two checks.
        stuck_after_s: seconds without an answered ``Info`` after which rank 0 is stuck.
        moved_info_s: seconds an ``Info`` may take, for a group that can tell whether it moved
            (``serve --cluster``), before the group is asked (what a missed ``Info`` costs there); other
            groups' ``Info`` may take 3 s.  Both at most ``stuck_after_s``.
        max_failed_starts: consecutive failed starts before giving up (state ``failed``).
    """

    def __init__(self, provider, group: Group, start: Callable[[], Group], *, probe_s: float = 1.0,
                 stuck_after_s: float = 6.0, moved_info_s: float = 1.0, max_failed_starts: int = 5):
        self.provider = provider
        self.group = group
        self.start = start
        self.probe_s = probe_s
        self.stuck_after_s = stuck_after_s
        self.moved_info_s = moved_info_s
        self.max_failed_starts = max_failed_starts
        self.restarts = 0
        provider.healing = True  # requests wait for the next group and are replayed there
        self._publish("ok")

    def _publish(self, status: str, failure: Optional[str] = None) -> None:
        if failure is not None and failure != self.provider.group_status.get("last_failure"):
            self.provider.note_error(f"group {status}: {failure}")
        last = failure if failure is not None else self.provider.group_status.get("last_failure")
        self.provider.group_status = {"status": status, "restarts": self.restarts, "last_failure": last}

    async def run(self) -> None:
        """Watch and heal until cancelled (or until starting a group failed too often)."""
        try:
            while True:
                why, silent = await self._watch()
                log.error("tensor-parallel group failed: %s; restarting it", why)
                if not await self._replace(why, silent):
                    return
        finally:
            await asyncio.to_thread(self.group.stop)

    async def _watch(self) -> Tuple[str, bool]:
        """Return once the group has failed: why (one line), and whether its rank 0 fell silent
        (frozen or cut off: it sends nothing more)."""
        loop = asyncio.get_running_loop()
        last_ok = loop.time()
        channel = self.group.credentials.aio_channel(self.group.address)
        stub = pb_grpc.GenerationStub(channel)
        try:
            while True:
                why = self.group.failure()
                if why:
                    return why, False
                t0 = loop.time()
                # a group that can tell whether it moved is asked at each missed Info (each second)
                timeout = min(self.moved_info_s if self.group.moved is not None else 3.0, self.stuck_after_s)
                try:
                    await stub.Info(pb.InfoRequest(), timeout=timeout)
                    last_ok = loop.time()
                except grpc.RpcError as exc:
                    why = self.group.failure()
                    if why:
                        return why, False
                    if exc.code() == grpc.StatusCode.UNAVAILABLE:
                        # nothing listens on rank 0's port: its process is gone (a cluster's rank 0 exits
                        # when its group fails; no supervisor here reports it) -- not worth waiting for
                        return f"rank 0 at {self.group.address} is gone ({exc.details() or 'unavailable'})", False
                    if self.group.moved is not None:
                        why = await asyncio.to_thread(self.group.moved)
                        if why:
                            return why, True
                    if loop.time() - last_ok >= self.stuck_after_s:
                        return f"rank 0 answered nothing for {loop.time() - last_ok:.0f} s (stuck or frozen)", True
                await asyncio.sleep(max(0.0, self.probe_s - (loop.time() - t0)))
        finally:
            await channel.close()

    async def _replace(self, why: str, silent: bool = False) -> bool:
        """Tear the failed group down and start another; False when giving up.  ``silent``: its
        rank 0 fell silent, so its calls are cancelled at once when the new group takes over."""
        self.provider.unavailable = why
        self._publish("restarting", why)
        t0 = time.monotonic()
        await asyncio.to_thread(self.group.stop)
        for attempt in range(1, self.max_failed_starts + 1):
            try:
                group = await asyncio.to_thread(self.start)
            except Exception as exc:  # any failure to start: logged, retried with back-off
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                log.error("restart %d/%d failed: %s", attempt, self.max_failed_starts, reason)
                self._publish("restarting", f"{why}; restart failed: {reason}")
                if attempt < self.max_failed_starts:  # no back-off after the last: the waiting requests fail now
                    await asyncio.sleep(min(30.0, 2.0 ** attempt))
                continue
            self.group = group
            # a silent rank 0 sends nothing more: its calls are cancelled at once, not after the grace
            await self.provider.retarget(group.address, group.credentials, grace_s=0.0 if silent else None)
            self.restarts += 1
            self.provider.unavailable = None
            took = time.monotonic() - t0
            self.provider.last_reformation_s = round(took, 3)
            self.provider.metrics.reformation_s.observe(took)
            self._publish("ok", why)
            log.warning("tensor-parallel group restarted in %.1f s (restart %d) after: %s",
                        took, self.restarts, why)
            return True
        self.provider.unavailable = f"{why}; gave up after {self.max_failed_starts} failed restarts"
        self._publish("failed", self.provider.unavailable)
        self.provider.end_healing()
        return False

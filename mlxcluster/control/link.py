"""Rank 0 -> ranks N transport: ordered frame streams over gRPC and their replies.

Rank 0 is one asyncio process: :class:`RankLink` writes frames from the event
loop into a ``grpc.aio`` bidirectional stream (no thread hop) and reads the
replies in a task; :class:`RankGroup` collects the replies of every rank and
wakes whoever waits on them (a forward pass, the ack of a leave, a join's K/V) through an
``asyncio.Event`` -- nothing is polled.

Liveness: each link also sends a ``Health`` heartbeat every :data:`HEARTBEAT_S`
on its channel (answered by rank N's gRPC threads, never its MLX thread, so a
long forward pass does not delay it).  A rank that answers none for
:data:`LOST_AFTER_S` -- dead, frozen (SIGSTOP) or cut off -- is lost: the link
delivers an error reply and the group fails at once, even while rank 0's own MLX
thread is blocked in a collective waiting for that rank (the step timeout is
only the last resort for a group that answers heartbeats but never finishes).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass
from typing import Callable, Deque, Dict, Iterable, List, Mapping, Optional

import grpc
import grpc.aio

from ..engine.handoff import DECODE, HandoffError, KvStream
from ..failpoints import fail_point
from ..protocol import mlxcluster_pb2 as pb
from ..protocol import mlxcluster_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

__all__ = ["RankError", "RankLink", "RankGroup", "KvWait"]

_CLOSE = object()
_GRPC_OPTIONS = [("grpc.enable_http_proxy", 0)]

#: Seconds between two heartbeats (``RankControl.Health``) of one link.
HEARTBEAT_S = 1.0
#: Seconds without an answered heartbeat after which a rank N is lost.
LOST_AFTER_S = 5.0


class RankError(RuntimeError):
    """A rank N rejected a frame, failed, or became unreachable.

    After it the tensor-parallel group may be stuck inside a collective;
    the group is marked broken and must be restarted.
    """


class RankLink:
    """Rank 0's ordered frame stream to one rank N (``RankControl.Frames``).

    ``send`` never blocks: frames go on an ``asyncio.Queue`` that the stream
    drains in order.  With the failpoint ``control.send=delay(MS)`` (tests and benchmarks: a slow
    control link, :mod:`mlxcluster.failpoints`) each frame waits MS ms in a FIFO of its own
    (:attr:`_delayed`) before it joins that queue: ``send`` still returns at once, frames keep
    their order, replies and heartbeats are not delayed.  Every reply is handed to ``on_reply``; a broken stream
    becomes a synthetic error reply with code ``INTERNAL``.  Create and use it
    on one event loop; :meth:`open` connects.

    Args:
        rank: the peer's rank.
        address: ``host:port`` of its RankControl service.
        on_reply: called with each :class:`FrameReply` (on the event loop).
        credentials: rank 0's :class:`mlxcluster.security.Credentials`: the stream is
            mutual TLS, and the peer must prove the cluster secret.
    """

    def __init__(self, rank: int, address: str, on_reply: Callable[[pb.FrameReply], None], credentials):
        self.rank = rank
        self.credentials = credentials
        self.address = address
        self.on_reply = on_reply
        self._closed = False
        self._channel: Optional[grpc.aio.Channel] = None
        self._outbox: "asyncio.Queue" = asyncio.Queue()
        # control.send=delay(MS): (due on the loop's clock, frame), in send order, and the timer that
        # moves the due ones to the outbox
        self._delayed: Deque[tuple] = collections.deque()
        self._release: Optional[asyncio.TimerHandle] = None
        self._reader: Optional[asyncio.Task] = None
        self._heartbeat: Optional[asyncio.Task] = None
        #: called once with a one-line reason when the rank misses heartbeats
        self.on_lost: Optional[Callable[[str], None]] = None
        #: the last heartbeat's answer and when it came (the loop's clock), for rank 0's Info
        self.last_health: Optional[pb.HealthReply] = None
        self.last_ok: Optional[float] = None

    async def open(self, connect_timeout_s: float = 60.0) -> "RankLink":
        """Connect and start the stream.

        Raises:
            RankError: the peer did not answer within ``connect_timeout_s``.
        """
        self._channel = self.credentials.aio_channel(self.address, options=_GRPC_OPTIONS)
        try:
            await asyncio.wait_for(self._channel.channel_ready(), connect_timeout_s)
        except asyncio.TimeoutError:
            await self._channel.close()
            raise RankError(f"rank {self.rank} at {self.address} did not answer within "
                            f"{connect_timeout_s:.0f} s") from None
        stub = pb_grpc.RankControlStub(self._channel)
        call = stub.Frames(self._frames())
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read(call))
        self._heartbeat = loop.create_task(self._beat(stub))
        return self

    async def _beat(self, stub) -> None:
        """Heartbeats until closed; on :data:`LOST_AFTER_S` without an answer, report the
        rank lost (an error reply, and :attr:`on_lost`) and stop."""
        loop = asyncio.get_running_loop()
        last_ok = loop.time()
        while not self._closed:
            sent = loop.time()
            try:
                self.last_health = await stub.Health(pb.HealthRequest(), timeout=LOST_AFTER_S)
                last_ok = self.last_ok = loop.time()
            except grpc.RpcError:
                pass
            if self._closed:
                return
            if loop.time() - last_ok >= LOST_AFTER_S:
                message = (f"lost rank {self.rank} at {self.address}: no heartbeat answered for "
                           f"{loop.time() - last_ok:.1f} s (dead, frozen or cut off)")
                log.error("%s", message)
                self.on_reply(pb.FrameReply(ok=False, code=pb.INTERNAL, rank=self.rank, error=message))
                if self.on_lost is not None:
                    self.on_lost(message)
                return
            await asyncio.sleep(max(0.0, HEARTBEAT_S - (loop.time() - sent)))

    async def _frames(self):
        while True:
            frame = await self._outbox.get()
            if frame is _CLOSE:
                return
            yield frame

    async def _read(self, call) -> None:
        try:
            async for reply in call:
                self.on_reply(reply)
            if not self._closed:
                raise RuntimeError("stream ended")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._closed:
                return
            detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
            self.on_reply(pb.FrameReply(ok=False, code=pb.INTERNAL, rank=self.rank,
                                        error=f"lost rank {self.rank} at {self.address}: {detail}"))

    def send(self, frame: pb.Frame) -> None:
        """Queue ``frame`` for the stream (never blocks; call on the link's event loop)."""
        fault = fail_point("control.send")
        if fault is None and not self._delayed:
            self._outbox.put_nowait(frame)
            return
        self._delay(frame, fault.arg / 1e3 if fault is not None else 0.0)

    def _delay(self, frame: pb.Frame, delay_s: float) -> None:
        """Queue ``frame`` ``delay_s`` seconds from now, behind every frame already delayed (FIFO: a
        frame is never due before the one sent before it)."""
        loop = asyncio.get_running_loop()
        due = loop.time() + delay_s
        if self._delayed:
            due = max(due, self._delayed[-1][0])
        self._delayed.append((due, frame))
        if self._release is None:
            self._release = loop.call_at(due, self._release_due)

    def _release_due(self) -> None:
        """Move the delayed frames that are due to the outbox; re-arm for the next one."""
        loop = asyncio.get_running_loop()
        self._release = None
        now = loop.time()
        while self._delayed and self._delayed[0][0] <= now:
            self._outbox.put_nowait(self._delayed.popleft()[1])
        if self._delayed and not self._closed:
            self._release = loop.call_at(self._delayed[0][0], self._release_due)

    async def close(self) -> None:
        self._closed = True
        if self._release is not None:
            self._release.cancel()
            self._release = None
        self._delayed.clear()
        self._outbox.put_nowait(_CLOSE)
        if self._channel is not None:
            await self._channel.close()
        if self._reader is not None:
            self._reader.cancel()
        if self._heartbeat is not None:
            self._heartbeat.cancel()


@dataclass
class KvWait:
    """What one rank N sends for one join's K/V source (:meth:`RankGroup.expect_kv`).

    ``receiver``: a ``--local-decode`` handoff's :class:`~mlxcluster.engine.handoff.KvStream`
    (every ``KvFrame`` reply is offered to it: the one K/V receiver), or ``None`` for a remote
    join, whose one reply says whether the rank installed its K/V (``answer``, ``refused``).
    ``refused``: why the rank's K/V is refused ("": not refused); ``done``: nothing more comes."""

    receiver: Optional[KvStream] = None
    answer: Optional[pb.KvFrame] = None
    refused: str = ""
    done: bool = False

    def offer(self, reply: pb.FrameReply) -> None:
        if self.done:
            return
        if self.receiver is None:
            self.answer, self.refused, self.done = reply.kv, reply.refused, True
            return
        try:
            self.done = self.receiver.offer(reply.kv) == DECODE
        except HandoffError as exc:
            self.refused, self.done = str(exc), True


class RankGroup:
    """Rank 0's view of ranks N: broadcast frames, collect replies, wait without polling.

    Replies may be delivered from any thread (:meth:`deliver`); they are
    processed on the event loop bound by :meth:`bind`.  An error reply marks
    the group broken (:attr:`broken`) and makes every wait raise
    :class:`RankError`; the acks of a leave are kept per session uid for
    :meth:`wait_acks`, a join's K/V replies for :meth:`wait_kv`.

    Args:
        links: objects with ``rank`` and ``send(frame)`` (a :class:`RankLink`,
            or an in-process fake in tests), ranks 1..N-1.
    """

    def __init__(self, links: Iterable = ()):
        self.links: List = []
        for link in links:
            self.add(link)
        self.broken: Optional[str] = None
        self.on_broken: Optional[Callable[[], None]] = None  # called once when the group breaks
        self._acks: Dict[str, Dict[int, pb.FrameReply]] = {}
        self._kv: Dict[str, Dict[int, KvWait]] = {}  # a handoff or remote join's replies, by uid and rank
        self._inbox: Deque[pb.FrameReply] = collections.deque()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._event: Optional[asyncio.Event] = None

    def add(self, link) -> None:
        """Add a link to rank ``link.rank``: its lost-heartbeat report fails the group at once
        (waking any waiter, and :attr:`on_broken` even when nothing waits)."""
        self.links.append(link)
        if hasattr(link, "on_lost"):
            link.on_lost = self.fail

    def __len__(self) -> int:
        return len(self.links)

    @property
    def ranks(self) -> List[int]:
        return [link.rank for link in self.links]

    def bind(self) -> None:
        """Process replies on the running event loop from now on."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop, self._event = loop, asyncio.Event()
            if self._inbox:
                self._event.set()

    def deliver(self, reply: pb.FrameReply) -> None:
        """Hand over one reply (thread-safe; wakes the waiter)."""
        self._inbox.append(reply)
        loop, event = self._loop, self._event
        if loop is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop has closed: the next bind() sees the reply
                pass

    def send(self, frame: pb.Frame) -> None:
        for link in self.links:
            link.send(frame)

    def expect_acks(self, uid: str) -> None:
        """Keep the acks of ``uid``'s leave (others are dropped)."""
        self._acks.setdefault(uid, {})

    def forget_acks(self, uid: str) -> Dict[int, pb.FrameReply]:
        return self._acks.pop(uid, {})

    def missing_acks(self, uid: str) -> List[int]:
        """Ranks whose ack of ``uid``'s leave has not arrived."""
        got = self._acks.get(uid, {})
        return [r for r in self.ranks if r not in got]

    def acked(self, uid: str) -> bool:
        return not self.missing_acks(uid)

    def expect_kv(self, uid: str, receivers: Mapping[int, Optional[KvStream]]) -> None:
        """Keep the ``KvFrame`` replies of ``uid`` from each rank of ``receivers``: offered to that
        rank's :class:`KvStream` (a handoff), or with ``None`` kept as its answer to a remote join.
        Call before the plan that asks for them is sent."""
        self._kv[uid] = {r: KvWait(receiver) for r, receiver in receivers.items()}

    def forget_kv(self, uid: str) -> None:
        """Stop keeping ``uid``'s K/V replies (its sequence left before they were taken)."""
        self._kv.pop(uid, None)

    def kv_done(self, uid: str) -> bool:
        """Every expected rank sent all it will send for ``uid``'s K/V."""
        return all(w.done for w in self._kv.get(uid, {}).values())

    async def wait_kv(self, uid: str, timeout_s: float) -> Dict[int, KvWait]:
        """Wait for the K/V replies of ``uid`` from every expected rank and hand them over (rank ->
        :class:`KvWait`; after ``timeout_s`` seconds, as they stand, ``done`` False where
        incomplete).

        Raises:
            RankError: a rank reported an error or was lost (the group is broken).
        """
        try:
            await self._until(lambda: self.kv_done(uid), timeout_s)
        finally:
            waits = self._kv.pop(uid, {})
        return waits

    def fail(self, message: str) -> RankError:
        """Mark the group broken (first reason wins); returns the error to raise."""
        if self.broken is None:
            self.broken = message
            if self.on_broken is not None:
                self.on_broken()
        return RankError(message)

    def drain(self) -> None:
        """Process delivered replies; raise :class:`RankError` on the first error."""
        while self._inbox:
            reply = self._inbox.popleft()
            if not reply.ok:
                raise self.fail(reply.error or f"rank {reply.rank} failed")
            if reply.left:
                if reply.uid in self._acks:
                    self._acks[reply.uid][reply.rank] = reply
            elif reply.HasField("kv"):
                wait = self._kv.get(reply.uid, {}).get(reply.rank)
                if wait is not None:  # else K/V nobody waits for any more: dropped
                    wait.offer(reply)

    async def _until(self, done: Callable[[], bool], timeout_s: float,
                     also: Optional[asyncio.Future] = None) -> bool:
        """Wait until ``done()`` (or ``also`` completes), processing replies as
        they arrive; ``False`` after ``timeout_s`` seconds.  Raises RankError.
        A group of one rank has no replies to wait for: only ``also``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            self.drain()
            if done():
                return True
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            waiters = set() if also is None else {also}
            if self.links:
                self._event.clear()  # a reply delivered from now on sets it again
                waiters.add(loop.create_task(self._event.wait()))
            if not waiters:
                return done()
            try:
                await asyncio.wait(waiters, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters - {also}:
                    w.cancel()

    async def run(self, future: asyncio.Future, timeout_s: float):
        """Await ``future`` (a forward pass on the MLX thread), raising
        :class:`RankError` as soon as a rank reports an error, or when it
        takes longer than ``timeout_s`` seconds (a stuck group)."""
        if not await self._until(future.done, timeout_s, also=future):
            raise self.fail(f"a forward pass took over {timeout_s:.0f} s: the group is stuck")
        return future.result()

    async def wait_acks(self, uid: str, timeout_s: float) -> bool:
        """Wait until every rank N acknowledged the leave of ``uid``;
        ``False`` on timeout.  Raises RankError on an error reply."""
        return await self._until(lambda: self.acked(uid), timeout_s)

    async def close(self) -> None:
        for link in self.links:
            close = getattr(link, "close", None)
            if close is not None:
                result = close()
                if asyncio.iscoroutine(result):
                    await result

"""A slow link in user space: Ethernet frames between two TAP devices, delayed and rate-limited.

``python -m benchmarks.wire TAP_A TAP_B --delay-ms D --rate-mbit R`` attaches to two TAP devices
(``ip tuntap add ... mode tap``, made by :func:`benchmarks.netns.slow_wire`) and writes every frame read
from one to the other after its serialisation at ``R`` Mbit/s (each direction a link of its own: a
frame waits for the frames before it) plus ``D`` ms of propagation -- what ``tc qdisc ... netem delay D
rate R`` does, for kernels without ``sch_netem``.  A TAP device without a virtio-net header receives
whole frames (the kernel segments and checksums them), so any frame can be written to the other side
as read.  At most :data:`LIMIT` frames wait (as netem's ``limit``); beyond it a frame is dropped.
Prints ``ready`` once both devices are open; runs until killed.

A Wi-Fi-like link (issue 42) adds ``--jitter-ms J`` (each frame's propagation delay drawn uniform in
``D +- J``, netem's ``delay D J`` with its default uniform distribution) and ``--late-pct P --late-ms L``
(``P`` % of frames, drawn independently, ``L`` ms later still: a retransmission burst).  Each direction
stays FIFO: a frame is never delivered before the frame sent before it in the same direction, so a late
frame holds back the frames behind it, as a Wi-Fi receiver's block-ack reorder buffer releases frames in
sequence (IEEE 802.11-2020, 10.24.4) -- and as netem does too once a rate is set.  TCP would take a
reordered segment for loss; this link reorders nothing.  ``--seed`` fixes the draws.  Without these
options every frame is delivered exactly as before (:class:`Schedule`).
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import os
import random
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
#: Frames in flight at most (both directions).
LIMIT = 10_000


def open_tap(name: str) -> int:
    """A non-blocking descriptor of TAP device ``name`` (frames without packet information)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


class Schedule:
    """When each frame is delivered (monotonic seconds), per direction: serialisation at the rate, then
    the propagation delay (jitter and late tail drawn per frame), never before the direction's previous
    frame.  Pure: the clock is the caller's ``now``; the draws come from ``rng``.

    Args:
        delay_ms: mean one-way propagation delay, ms.  rate_mbit: Mbit/s (0: unlimited).
        jitter_ms: each frame's delay uniform in ``delay_ms +- jitter_ms`` (clipped at 0).
        late_pct, late_ms: that percentage of frames is ``late_ms`` later still.
        rng: a ``random.Random`` (its ``random()`` and ``uniform()`` are used).
    Raises:
        ValueError: a negative value or ``late_pct`` over 100.
    """

    def __init__(self, delay_ms: float = 0.0, rate_mbit: float = 0.0, jitter_ms: float = 0.0,
                 late_pct: float = 0.0, late_ms: float = 0.0, rng: random.Random = None):
        for name, value in (("delay-ms", delay_ms), ("rate-mbit", rate_mbit), ("jitter-ms", jitter_ms),
                            ("late-pct", late_pct), ("late-ms", late_ms)):
            if not value >= 0:
                raise ValueError(f"--{name} must be a non-negative number, not {value!r}")
        if late_pct > 100:
            raise ValueError(f"--late-pct is a percentage (0-100), not {late_pct!r}")
        self.delay, self.jitter, self.late = delay_ms / 1e3, jitter_ms / 1e3, late_ms / 1e3
        self.late_p = late_pct / 100.0
        self.per_bit = 1.0 / (rate_mbit * 1e6) if rate_mbit > 0 else 0.0
        self.rng = rng or random.Random()
        self._free: dict = {}  # direction -> when its link is free again
        self._last: dict = {}  # direction -> when its previous frame is delivered

    def propagation(self) -> float:
        """One frame's propagation delay, seconds: ``delay +- jitter``, plus ``late`` for the tail."""
        d = self.delay
        if self.jitter:
            d = max(0.0, self.rng.uniform(d - self.jitter, d + self.jitter))
        if self.late_p and self.rng.random() < self.late_p:
            d += self.late
        return d

    def due(self, direction, now: float, nbytes: int) -> float:
        """When a frame of ``nbytes`` read at ``now`` in ``direction`` is delivered (seconds)."""
        done = max(now, self._free.get(direction, 0.0)) + nbytes * 8 * self.per_bit
        self._free[direction] = done
        at = max(done + self.propagation(), self._last.get(direction, 0.0))
        self._last[direction] = at
        return at


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tap_a")
    ap.add_argument("tap_b")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way propagation delay, ms (each direction)")
    ap.add_argument("--rate-mbit", type=float, default=0.0, help="rate of each direction, Mbit/s (0: unlimited)")
    ap.add_argument("--jitter-ms", type=float, default=0.0, help="each frame's delay uniform in D +- J ms")
    ap.add_argument("--late-pct", type=float, default=0.0, help="percentage of frames delivered --late-ms later")
    ap.add_argument("--late-ms", type=float, default=0.0, help="how much later a late frame is, ms")
    ap.add_argument("--seed", type=int, default=None, help="seed of the jitter and tail draws")
    args = ap.parse_args(argv)
    try:
        schedule = Schedule(args.delay_ms, args.rate_mbit, args.jitter_ms, args.late_pct, args.late_ms,
                            random.Random(args.seed))
    except ValueError as exc:
        ap.error(str(exc))
    a, b = open_tap(args.tap_a), open_tap(args.tap_b)
    peer = {a: b, b: a}
    heap: list = []
    seq = 0
    print("ready", flush=True)
    while True:
        now = time.monotonic()
        timeout = max(0.0, heap[0][0] - now) if heap else 1.0
        ready, _, _ = select.select([a, b], [], [], timeout)
        now = time.monotonic()
        for fd in ready:
            for _ in range(256):
                try:
                    frame = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if len(heap) >= LIMIT:
                    continue
                heapq.heappush(heap, (schedule.due(fd, now, len(frame)), seq, peer[fd], frame))
                seq += 1
        now = time.monotonic()
        while heap and heap[0][0] <= now:
            _, _, fd, frame = heapq.heappop(heap)
            try:
                os.write(fd, frame)
            except OSError:
                pass


if __name__ == "__main__":
    sys.exit(main())

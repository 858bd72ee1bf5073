"""A slow link in user space: Ethernet frames between two TAP devices, delayed and rate-limited.

``python -m benchmarks.wire TAP_A TAP_B --delay-ms D --rate-mbit R`` attaches to two TAP devices
(``ip tuntap add ... mode tap``, made by :func:`benchmarks.netns.slow_wire`) and writes every frame read
from one to the other after its serialisation at ``R`` Mbit/s (each direction a link of its own: a
frame waits for the frames before it) plus ``D`` ms of propagation -- what ``tc qdisc ... netem delay D
rate R`` does, for kernels without ``sch_netem``.  A TAP device without a virtio-net header receives
whole frames (the kernel segments and checksums them), so any frame can be written to the other side
as read.  At most :data:`LIMIT` frames wait (as netem's ``limit``); beyond it a frame is dropped.
Prints ``ready`` once both devices are open; runs until killed.
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import os
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tap_a")
    ap.add_argument("tap_b")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way propagation delay, ms (each direction)")
    ap.add_argument("--rate-mbit", type=float, default=0.0, help="rate of each direction, Mbit/s (0: unlimited)")
    args = ap.parse_args(argv)
    a, b = open_tap(args.tap_a), open_tap(args.tap_b)
    peer = {a: b, b: a}
    free = {a: 0.0, b: 0.0}  # when each direction's link is free again (monotonic seconds)
    delay = args.delay_ms / 1e3
    per_bit = 1.0 / (args.rate_mbit * 1e6) if args.rate_mbit > 0 else 0.0
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
                done = max(now, free[fd]) + len(frame) * 8 * per_bit
                free[fd] = done
                heapq.heappush(heap, (done + delay, seq, peer[fd], frame))
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

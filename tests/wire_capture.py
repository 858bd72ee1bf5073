"""A loopback packet capture while a TP=3 group starts and generates (run by tests/test_security.py).

Run alone in a network namespace of its own (``benchmarks.netns.private_loopback``), so that the capture
holds this group's traffic only; CI's other test worker shares the root namespace's ``lo``, and its
traffic made a capture drop frames.  Usage::

    WIRE_SECRET=... ip netns exec NS python tests/wire_capture.py MODEL PROMPT OUT_FILE

writes every captured frame, concatenated, to OUT_FILE and prints one JSON line: ``dropped`` (the kernel's
count of frames it dropped), ``canary`` (a plaintext canary sent over a TCP socket was captured) and
``tokens`` (how many tokens the group generated).

``python tests/wire_capture.py --only IFACE OUT_FILE SECONDS`` captures alone (``any``: every interface of
the namespace it runs in), printing ``capturing`` once it does, until killed or SECONDS pass
(tests/test_cluster.py's bridge capture).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading
import time


def packet_socket(iface: str) -> socket.socket:
    """An AF_PACKET socket receiving every frame of ``iface`` (``any``: of every interface), both
    directions, with a receive buffer forced large (SO_RCVBUFFORCE, root) so that a reader starved of CPU
    falls behind rather than dropping frames."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))  # ETH_P_ALL
    try:
        # SO_RCVBUFFORCE: 33 (asm-generic/socket.h; 32 is SO_SNDBUFFORCE, which left the receive buffer at
        # net.core.rmem_default, ~208 KiB, and a capture starved of CPU dropped frames)
        sock.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_RCVBUFFORCE", 33), 256 * 2**20)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 2**20)
    if iface != "any":
        sock.bind((iface, 0x0003))  # ETH_P_ALL (Python applies htons)
    got = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    if got < 32 * 2**20:
        raise OSError(f"the capture's receive buffer is {got} bytes, not the 32 MiB or more it asked for")
    return sock


def capture_only(iface: str, out_file: str, seconds: float) -> None:
    """Write every frame of ``iface`` to ``out_file`` (flushed per frame) for ``seconds`` or until killed."""
    sock = packet_socket(iface)
    sock.settimeout(0.2)
    print("capturing", flush=True)
    deadline = time.monotonic() + seconds
    with open(out_file, "wb") as out:
        while time.monotonic() < deadline:
            try:
                out.write(sock.recv(65536))
            except socket.timeout:
                continue
            out.flush()


class Capture:
    """Every frame on the loopback interface (AF_PACKET, both directions) while running.

    The receive buffer is forced large (SO_RCVBUFFORCE, root) so a capture thread starved of
    CPU by busy ranks falls behind rather than dropping frames; ``drops()`` reads the kernel's
    count of frames dropped anyway (PACKET_STATISTICS)."""

    def __init__(self, limit_s: float = 300.0):
        self.sock = packet_socket("lo")
        self.sock.settimeout(0.2)
        self.chunks = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.deadline = time.monotonic() + limit_s
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set() and time.monotonic() < self.deadline:
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                continue
            with self.lock:
                self.chunks.append(chunk)

    def seen(self, needle: bytes, timeout_s: float) -> bool:
        """Wait (bounded) until ``needle`` appears within one captured frame."""
        deadline, checked = time.monotonic() + timeout_s, 0
        while time.monotonic() < deadline:
            with self.lock:
                new = self.chunks[checked:]
            if any(needle in chunk for chunk in new):
                return True
            checked += len(new)
            self.stop.wait(0.05)
        return False

    def drops(self) -> int:
        _packets, dropped = struct.unpack("II", self.sock.getsockopt(263, 6, 8))  # SOL_PACKET, PACKET_STATISTICS
        return dropped

    def data(self) -> bytes:
        self.stop.set()
        self.thread.join(5)
        self.sock.setblocking(False)
        for _ in range(1_000_000):  # what the thread had not read yet
            try:
                self.chunks.append(self.sock.recv(65536))
            except (BlockingIOError, OSError):
                break
        self.sock.close()
        return b"".join(self.chunks)


def main(model: str, prompt: str, out_file: str) -> None:
    from mlxcluster.leader.generation import GenerationClient
    from mlxcluster.runtime.launcher import LocalCluster

    canary = b"plaintext-canary-" + os.urandom(6).hex().encode()
    capture = Capture()
    tokens, canary_seen, dropped = 0, False, -1
    try:
        with LocalCluster(3, "ring", model=model, weights="float32", secret=os.environ["WIRE_SECRET"],
                          start_timeout_s=120) as cluster:
            client = GenerationClient(cluster.address, cluster.credentials, timeout_s=60)
            try:
                tokens = len(client.generate(prompt, max_tokens=4).token_ids)
            finally:
                client.close()
        with socket.create_server(("127.0.0.1", 0)) as srv, socket.create_connection(srv.getsockname()) as c:
            peer, _ = srv.accept()
            c.sendall(canary)
            assert peer.recv(100) == canary
            peer.close()
        canary_seen = capture.seen(canary, 60)
        dropped = capture.drops()
    finally:
        with open(out_file, "wb") as f:
            f.write(capture.data())
    print(json.dumps({"dropped": dropped, "canary": canary_seen, "tokens": tokens}))


if __name__ == "__main__":
    if sys.argv[1] == "--only":
        capture_only(sys.argv[2], sys.argv[3], float(sys.argv[4]))
    else:
        main(*sys.argv[1:4])

"""``/health`` latency while ``serve`` tokenises a huge prompt (issue 28, defect 11).

The HTTP front (a :class:`~mlxcluster.front.provider.Provider` and its FastAPI app under uvicorn, as
``serve`` runs it) with the real model's tokenizer and chat template, in front of a fake rank 0 that
accepts any prompt and answers one token, so that only the front's own work is measured.  One
client sends ``--requests`` chat requests of ``--mb`` MB each, one after another; meanwhile another
asks ``/health`` every ``--interval-ms`` and records each answer's latency.  Printed: p50, p95 and
max of ``/health`` while the big requests run, and each big request's duration.

    .venv/bin/python -m benchmarks.bench_health_under_load [--mb 2] [--requests 3]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from concurrent import futures

import grpc
import httpx
import uvicorn

from mlxcluster.front import Provider, create_app
from mlxcluster.front.api import bind_socket
from mlxcluster.model.loader import default_model_path
from mlxcluster.protocol import mlxcluster_pb2 as pb
from mlxcluster.protocol import mlxcluster_pb2_grpc as pb_grpc
from mlxcluster.security import credentials


class _Rank0(pb_grpc.GenerationServicer):
    """Rank 0 as the front sees it: any prompt, one token back."""

    def Info(self, request, context):
        return pb.InfoReply(model="bench", world_size=1, backend="ring", context_length=1 << 24, vocab_size=49152,
                            weight_format="float32", capacity=8, max_queue=8, batch_limit=8)

    def Generate(self, request, context):
        yield pb.GenerateEvent(started=pb.GenerateStarted())
        yield pb.GenerateEvent(token=pb.GeneratedToken(token_id=42, text="ok"))
        yield pb.GenerateEvent(done=pb.GenerateDone(reason=pb.MAX_TOKENS, text_tail="", generated_tokens=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=2.0, help="size of each big prompt (MB)")
    ap.add_argument("--requests", type=int, default=3, help="big requests, one after another")
    ap.add_argument("--interval-ms", type=float, default=20.0, help="pause between /health requests")
    args = ap.parse_args()

    tls = credentials("bench-health-under-load-secret", "local")
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GenerationServicer_to_server(_Rank0(), grpc_server)
    port = grpc_server.add_secure_port("127.0.0.1:0", tls.server())
    grpc_server.start()
    provider = Provider(f"127.0.0.1:{port}", default_model_path(), "bench", tls)
    sock = bind_socket("127.0.0.1", 0)  # serve's own socket (TCP_NODELAY on its connections)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(provider), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        with httpx.Client(timeout=60) as c:
            for _ in range(500):  # bounded: uvicorn starts within seconds
                try:
                    if c.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.02)
            idle = []
            for _ in range(50):
                t = time.perf_counter()
                c.get(url + "/health")
                idle.append(time.perf_counter() - t)
        text = "The quick brown fox jumps over the lazy dog. " * int(args.mb * 1e6 / 45)
        body = {"model": "bench", "max_tokens": 1, "messages": [{"role": "user", "content": text}]}
        big, done = [], threading.Event()

        def send() -> None:
            with httpx.Client(timeout=300) as c:
                for _ in range(args.requests):
                    t = time.perf_counter()
                    r = c.post(url + "/v1/chat/completions", json=body)
                    big.append((time.perf_counter() - t, r.status_code))
            done.set()

        sender = threading.Thread(target=send)
        sender.start()
        loaded = []
        with httpx.Client(timeout=60) as c:
            while not done.is_set():
                t = time.perf_counter()
                c.get(url + "/health")
                loaded.append(time.perf_counter() - t)
                done.wait(args.interval_ms / 1000)
        sender.join()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        grpc_server.stop(None)

    def ms(xs, q):
        return 1000 * (statistics.median(xs) if q == 50 else sorted(xs)[min(len(xs) - 1, int(len(xs) * q / 100))])

    print(f"/health idle:  p50 {ms(idle, 50):.1f} ms, p95 {ms(idle, 95):.1f} ms, max {1000 * max(idle):.1f} ms "
          f"({len(idle)} requests)")
    print(f"/health while {args.requests} x {args.mb:g} MB chat prompts are tokenised: p50 {ms(loaded, 50):.1f} ms, "
          f"p95 {ms(loaded, 95):.1f} ms, max {1000 * max(loaded):.1f} ms ({len(loaded)} requests)")
    print("big requests: " + ", ".join(f"{s:.2f} s ({code})" for s, code in big))


if __name__ == "__main__":
    main()

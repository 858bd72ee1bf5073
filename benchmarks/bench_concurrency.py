#!/usr/bin/env python3
"""Throughput of one provider at concurrency 1 versus 8 (continuous batching).

Starts a local group (default TP=1; ``--world-size 3`` for TP=3 on MPI), then runs
2 x C chat requests of 48 tokens with C concurrent clients for C in (1, 8) and
prints generated tokens per second of wall time.

Usage: python benchmarks/bench_concurrency.py [--world-size N] [--backend auto|mpi|ring]
"""

import argparse
import concurrent.futures as cf
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlxcluster.leader.generation import GenerationClient  # noqa: E402
from mlxcluster.runtime.launcher import LocalCluster  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    with LocalCluster(args.world_size, args.backend, weights="float32") as cluster:
        GenerationClient(cluster.address, cluster.credentials).generate("Hello", max_tokens=2)  # warm-up
        for conc in (1, 8):
            def one(i):
                client = GenerationClient(cluster.address, cluster.credentials)
                try:
                    r = client.generate(f"Tell me a story about number {i}.", chat=True, max_tokens=args.max_tokens)
                    return len(r.token_ids)
                finally:
                    client.close()

            t0 = time.perf_counter()
            with cf.ThreadPoolExecutor(conc) as pool:
                tokens = sum(pool.map(one, range(2 * conc)))
            dt = time.perf_counter() - t0
            print(f"TP={args.world_size} concurrency {conc}: {2 * conc} requests, {tokens} tokens in "
                  f"{dt:.1f} s = {tokens / dt:.1f} tok/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

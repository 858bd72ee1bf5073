#!/usr/bin/env python3
"""What cluster TLS costs: TP=N decode tokens/s, the control-frame round trip, and formation time.

Runs against the checkout given by ``--repo`` (default: this one), so the same
script measures the code before mutual TLS (e.g. a ``git worktree`` of an older
commit) and after it:

  * decode: a local TP=N group (``--backend``, float32), ``--runs`` greedy
    generations of ``--tokens`` tokens after a warm-up; median decode tokens/s;
  * formation: N ``mlxcluster join`` processes on loopback (one cluster, world
    size N); seconds from starting them to the coordinator's "formed" log line
    (discovery, heartbeats -- TLS handshakes included --, Prepare, Bootstrap, rank
    start and model load), median of ``--formations`` runs.

The control-frame round trip with and without TLS is measured by
``benchmarks/bench.py`` (``bench_control_plane(tls=...)``).

Usage: python benchmarks/bench_security.py [--repo PATH] [--world-size 3] [--backend mpi]
           [--tokens 64] [--runs 3] [--formations 2] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = "bench-secret-0123456789abcdef"


def decode_tokens_per_s(world_size: int, backend: str, tokens: int, runs: int):
    from mlxcluster.runtime.launcher import LocalCluster
    from mlxcluster.leader.generation import GenerationClient

    with LocalCluster(world_size, backend, weights="float32") as cluster:
        creds = getattr(cluster, "credentials", None)
        client = GenerationClient(cluster.address, creds) if creds is not None else GenerationClient(cluster.address)
        try:
            client.generate("Hello", max_tokens=4)  # warm-up
            rates = [client.generate("The capital of France is", max_tokens=tokens).decode_tokens_per_s
                     for _ in range(runs)]
        finally:
            client.close()
    return statistics.median(rates), rates


def formation_s(repo: str, world_size: int, timeout_s: float = 300.0) -> float:
    """Seconds until the coordinator logs that the cluster formed."""
    from mlxcluster.runtime.launcher import free_ports

    tls = os.path.exists(os.path.join(repo, "mlxcluster", "security.py"))
    cluster = f"b-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, PYTHONPATH=repo, OPENBLAS_NUM_THREADS="1", MLXCLUSTER_SECRET=SECRET if tls else "")
    logs, procs = [], []
    tmp = tempfile.mkdtemp(prefix="bench-formation-")
    t0 = time.monotonic()
    try:
        for i, port in enumerate(free_ports(world_size)):
            cmd = [sys.executable, "-m", "mlxcluster", "join", "--cluster", cluster, "--node-id", f"node-{i}",
                   "--interface", "127.0.0.1", "--port", str(port), "--world-size", str(world_size),
                   "--weights", "float32"] + ([] if tls else ["--secret", SECRET])
            log = open(os.path.join(tmp, f"node-{i}.log"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=repo,
                                          start_new_session=True))
        while time.monotonic() - t0 < timeout_s:  # bounded: the log is read every 0.1 s
            logs[0].seek(0)
            if re.search(r"cluster '.*' formed", logs[0].read()):
                return time.monotonic() - t0
            if procs[0].poll() is not None:
                break
            time.sleep(0.1)
        logs[0].seek(0)
        raise RuntimeError(f"no formation within {timeout_s:.0f} s: {logs[0].read()[-500:]}")
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)
        for log in logs:
            log.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", default=ROOT)
    ap.add_argument("--world-size", type=int, default=3)
    ap.add_argument("--backend", default="mpi")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--formations", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    repo = os.path.abspath(args.repo)
    sys.path.insert(0, repo)
    commit = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    median, rates = decode_tokens_per_s(args.world_size, args.backend, args.tokens, args.runs)
    formations = [formation_s(repo, args.world_size) for _ in range(args.formations)]
    result = {"repo": repo, "commit": commit, "tls": os.path.exists(os.path.join(repo, "mlxcluster", "security.py")),
              "world_size": args.world_size, "backend": args.backend,
              "decode_tokens_per_s_median": round(median, 3), "decode_tokens_per_s": [round(r, 3) for r in rates],
              "formation_s_median": round(statistics.median(formations), 2),
              "formation_s": [round(f, 2) for f in formations]}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

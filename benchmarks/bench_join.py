"""TP=3 decode tokens/s and all_sum latency: ring vs MPI, formed by `join` across network
namespaces, next to the same backends launched locally (`LocalCluster`).

Usage (root, Linux: it creates network namespaces)::

    python benchmarks/bench_join.py [--backends ring,mpi] [--tokens 64] [--runs 3] [--model PATH]

Per backend:

* *local*: ``LocalCluster(3, backend)`` on loopback (the launcher's ring hostfile, or one
  ``mpirun`` starting every rank);
* *join*: three `mlxcluster join --backend B --world-size 3` processes, one per namespace
  on one bridge (benchmarks/netns.py); the group forms by mDNS, MPI through mpirun's launch
  agent (no ssh); the client runs inside the first namespace.

Printed: ``all_sum`` median latency of a (1, hidden) float32 tensor (measured by every rank
at start, ``Info.all_sum_us``) and decode tokens/s (median over ``--runs`` greedy
generations of ``--tokens`` tokens; a warm-up generation first).  All processes share this
machine's cores: the numbers compare launch paths and backends, not machines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

PROMPT = "The capital of France is"
SECRET = "bench-join-" + uuid.uuid4().hex


def _measure(client, tokens: int, runs: int) -> dict:
    info = client.info()
    client.generate(PROMPT, max_tokens=8)  # warm-up
    rates = []
    for _ in range(runs):
        result = client.generate(PROMPT, max_tokens=tokens)
        rates.append(result.decode_tokens_per_s)
    return {"all_sum_us": round(info.all_sum_us, 1), "decode_tok_s": round(statistics.median(rates), 2),
            "decode_runs": [round(r, 2) for r in rates], "backend": info.backend, "world_size": info.world_size}


def run_local(backend: str, model: str, tokens: int, runs: int) -> dict:
    from mlxcluster.runtime.launcher import LocalCluster
    from mlxcluster.leader.generation import GenerationClient

    with LocalCluster(3, backend, model=model, weights="float32", start_timeout_s=300) as local:
        client = GenerationClient(local.address, local.credentials)
        try:
            return _measure(client, tokens, runs)
        finally:
            client.close()


def client_main(cluster: str, tokens: int, runs: int) -> int:
    """Inside the first namespace: find rank 0 and measure (prints one JSON line)."""
    from mlxcluster.cluster.client import find_rank0
    from mlxcluster.security import CLIENT, credentials
    from mlxcluster.leader.generation import GenerationClient

    creds = credentials(os.environ["MLXCLUSTER_SECRET"], cluster, [CLIENT])
    address, _ = find_rank0(cluster, creds, ["eth0"], timeout_s=20)
    client = GenerationClient(address, creds)
    try:
        print(json.dumps(_measure(client, tokens, runs)), flush=True)
    finally:
        client.close()
    return 0


def run_join(backend: str, model: str, tokens: int, runs: int, form_timeout_s: float = 300) -> dict:
    from benchmarks.netns import bridged_hosts

    env = dict(os.environ, MLXCLUSTER_SECRET=SECRET, PYTHONPATH=ROOT, OPENBLAS_NUM_THREADS="1")
    cluster = f"bench-{uuid.uuid4().hex[:6]}"
    with bridged_hosts(3) as hosts, tempfile.TemporaryDirectory() as tmp:
        procs = []
        try:
            for i, (ns, _) in enumerate(hosts):
                log = open(os.path.join(tmp, f"node-{i}.log"), "w")
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", ns, sys.executable, "-m", "mlxcluster", "join", "--cluster", cluster,
                     "--node-id", f"host-{i}", "--interface", "eth0", "--world-size", "3", "--backend", backend,
                     "--weights", "float32", "--model", model], env=env, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, process_group=0))  # this session: see supervisor.process_group_kwargs
            t0 = time.monotonic()
            while True:  # bounded: form_timeout_s
                st = subprocess.run(["ip", "netns", "exec", hosts[0][0], sys.executable, "-m", "mlxcluster", "status",
                                     "--cluster", cluster, "--interface", "eth0", "--json", "--timeout", "2"],
                                    env=env, capture_output=True, text=True, timeout=60)
                nodes = json.loads(st.stdout) if st.returncode == 0 and st.stdout.strip() else []
                if sum(n.get("state") == "ready" for n in nodes) == 3:
                    break
                if time.monotonic() - t0 > form_timeout_s:
                    logs = "\n".join(open(os.path.join(tmp, f"node-{i}.log")).read()[-1500:] for i in range(3))
                    raise RuntimeError(f"{backend}: no formation within {form_timeout_s:.0f} s\n{logs}")
                time.sleep(1.0)
            formed_s = time.monotonic() - t0
            out = subprocess.run(["ip", "netns", "exec", hosts[0][0], sys.executable, os.path.abspath(__file__),
                                  "--client", cluster, "--tokens", str(tokens), "--runs", str(runs)],
                                 env=env, capture_output=True, text=True, timeout=900)
            if out.returncode != 0:
                raise RuntimeError(f"{backend}: client failed: {out.stderr.strip()[-500:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["formed_s"] = round(formed_s, 1)
            return row
        finally:
            for p in procs:
                try:
                    os.killpg(p.pid, 15)
                    p.wait(15)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    os.killpg(p.pid, 9)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="ring,mpi")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--launches", default="local,join", help="local, join (three namespaces), or both")
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--client", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        return client_main(args.client, args.tokens, args.runs)
    from mlxcluster.model.loader import resolve_model_path

    model = resolve_model_path(args.model)
    rows = []
    for backend in args.backends.split(","):
        for how, fn in (("local", run_local), ("join, 3 namespaces", run_join)):
            if how.split(",")[0] not in args.launches.split(","):
                continue
            row = fn(backend, model, args.tokens, args.runs)
            row.update(requested=backend, launch=how)  # row["backend"]: the one rank 0 runs
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'backend':<12} {'launch':<20} {'all_sum (µs)':>13} {'decode tok/s':>13}  runs")
    for r in rows:
        name = r["backend"] if r["requested"] == r["backend"] else f"{r['requested']}->{r['backend']}"
        print(f"{name:<12} {r['launch']:<20} {r['all_sum_us']:>13.1f} {r['decode_tok_s']:>13.2f}  "
              f"{r['decode_runs']}" + (f"  (formed in {r['formed_s']} s)" if "formed_s" in r else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Model sharing throughput between two network namespaces, against a plain TCP copy (the floor).

Two hosts on one bridge (benchmarks/netns.py).  ``mlxcluster``: host 0 runs a ``Node`` service
holding the model (mutual TLS), host 1 runs :func:`mlxcluster.cluster.transfer.fetch_model` (1 MiB
chunks, sha256 of every file checked before use).  ``plain TCP``: host 0 sends the same file with
``socket.sendfile`` and host 1 writes what it receives to a file, no TLS, no hashing -- what ``cat``
over the link achieves.  Each is timed from the receiver's start to its verified (or written) copy;
best of ``--repeats``.

``bare node to first token``: hosts 0 and 2 run ``join`` with the model (world size 3) and wait for a
third node; then host 1 runs ``join --fetch-model --world-size 3`` with an empty ``--models-dir``, and a
client on host 0 asks the cluster for one token, again and again until it gets one.  Phases come from host 1's
log timestamps, relative to its start: holder found, model fetched and verified, rank ready, and the
client's first token.

Usage (root): python benchmarks/bench_transfer.py [--model PATH] [--repeats 3] [--no-bare-node]
Roles (run by the benchmark itself inside a namespace): --holder PATH PORT | --fetch ADDR DEST |
--send PATH ADDR | --receive PORT DEST | --first-token CLUSTER.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = "bench-transfer-secret-0123"


def _holder(path: str, port: int) -> None:
    from concurrent import futures
    from types import SimpleNamespace

    import grpc

    from mlxcluster.cluster.service import NodeService
    from mlxcluster.cluster.transfer import ModelShare
    from mlxcluster.protocol import mlxcluster_pb2_grpc as pb_grpc
    from mlxcluster.security import credentials

    share = ModelShare(path)
    share.manifest()  # hash before serving: the benchmark times the transfer, not the holder's hashing
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_NodeServicer_to_server(NodeService(SimpleNamespace(share=share)), server)
    server.add_secure_port(f"0.0.0.0:{port}", credentials(SECRET, "bench").server())
    server.start()
    print("ready", flush=True)
    sys.stdin.read()  # until the benchmark closes our stdin
    server.stop(None)


def _fetch(address: str, dest: str) -> None:
    from mlxcluster.cluster.transfer import fetch_model
    from mlxcluster.security import credentials

    t = time.perf_counter()
    channel = credentials(SECRET, "bench").channel(address)
    path = fetch_model(channel, dest)
    print(json.dumps({"s": time.perf_counter() - t, "path": path}), flush=True)


def _send(path: str, address: str) -> None:
    import socket

    host, port = address.rsplit(":", 1)
    for _ in range(100):  # the receiver may not listen yet (bounded)
        try:
            s = socket.create_connection((host, int(port)), timeout=10)
            break
        except OSError:
            time.sleep(0.05)
    with open(path, "rb") as f:
        s.sendfile(f)
    s.close()


def _receive(port: int, dest: str) -> None:
    import socket

    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept()
    t = time.perf_counter()
    with open(dest, "wb") as out:
        for block in iter(lambda: conn.recv(1 << 20), b""):
            out.write(block)
    print(json.dumps({"s": time.perf_counter() - t}), flush=True)


def _first_token(cluster: str) -> None:
    """After a line on stdin: ask ``cluster`` for one token until one comes (bounded: 600 s); print
    the wall-clock time (``time.time()``) it came."""
    from mlxcluster.cluster.client import ClusterLookupError, find_rank0
    from mlxcluster.security import CLIENT, credentials
    from mlxcluster.leader.generation import ClientError, GenerationClient

    creds = credentials(SECRET, cluster, [CLIENT])
    print("ready", flush=True)
    sys.stdin.readline()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            address, _ = find_rank0(cluster, creds, ["eth0"], timeout_s=2.0)
            client = GenerationClient(address, creds, timeout_s=60)
            try:
                for event in client.stream("Hello", max_tokens=1):
                    if event.WhichOneof("event") == "token":
                        print(json.dumps({"first_token_at": time.time()}), flush=True)
                        return
            finally:
                client.close()
        except (ClusterLookupError, ClientError, OSError):
            time.sleep(0.2)
    print(json.dumps({"first_token_at": None}), flush=True)


def _log_times(path: str, needles: dict, t0: float) -> dict:
    """Seconds after ``t0`` (epoch) of the first log line holding each needle (``None``: absent)."""
    import datetime

    out = {name: None for name in needles}
    with open(path) as f:
        for line in f:
            for name, needle in needles.items():
                if out[name] is None and needle in line:
                    stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                    out[name] = round(stamp - t0, 2)
    return out


def _bare_node(model: str, hosts) -> dict:
    """Time from ``join --fetch-model`` on a bare node (host 1) to the cluster's first token."""
    (ns0, _ip0), (ns1, _ip1), (ns2, _ip2) = hosts
    cluster = f"bare-{os.getpid()}"
    work = tempfile.mkdtemp(prefix="bench-bare-")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), MLXCLUSTER_SECRET=SECRET,
               OPENBLAS_NUM_THREADS="1")
    base = [sys.executable, "-m", "mlxcluster", "join", "--cluster", cluster, "--interface", "eth0", "--port", "50071",
            "--world-size", "3", "--weights", "float32", "--no-dashboard"]
    logs = [open(os.path.join(work, f"host-{i}.log"), "w") for i in range(3)]
    procs = []
    try:
        for i, ns in ((0, ns0), (2, ns2)):
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *base, "--node-id", f"host-{i}", "--model",
                                           model], env=env, stdout=logs[i], stderr=subprocess.STDOUT,
                                          process_group=0))
        client = _in(ns0, "--first-token", cluster)
        assert client.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 120  # hosts 0 and 2 see each other and wait for a third (bounded)
        while time.monotonic() < deadline and "2 of 3 nodes live" not in open(logs[0].name).read():
            time.sleep(0.1)
        if "2 of 3 nodes live" not in open(logs[0].name).read():
            raise RuntimeError(f"the holders did not meet: {open(logs[0].name).read()[-500:]}")
        t0 = time.time()
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns1, *base, "--node-id", "host-1", "--fetch-model",
                                       "--models-dir", os.path.join(work, "models")],
                                      env=env, stdout=logs[1], stderr=subprocess.STDOUT, process_group=0))
        client.stdin.write("go\n")
        client.stdin.flush()
        got = json.loads(client.stdout.readline())
        client.wait(30)  # (its own loop is bounded: 600 s)
        phases = _log_times(logs[1].name, {"holder found": "fetching model", "model verified": "fetched and verified",
                                           "rank ready": "ready at"}, t0)
        phases["first token"] = round(got["first_token_at"] - t0, 2) if got["first_token_at"] else None
        return phases
    finally:
        import signal

        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, signal.SIGKILL)
        for log in logs:
            log.close()
        shutil.rmtree(work, ignore_errors=True)


def _in(ns: str, *args: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, os.path.abspath(__file__), *args], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **kw)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--holder", nargs=2)
    p.add_argument("--fetch", nargs=2)
    p.add_argument("--send", nargs=2)
    p.add_argument("--receive", nargs=2)
    p.add_argument("--first-token")
    p.add_argument("--no-bare-node", action="store_true")
    a = p.parse_args(argv)
    if a.first_token:
        return _first_token(a.first_token) or 0
    if a.holder:
        return _holder(a.holder[0], int(a.holder[1])) or 0
    if a.fetch:
        return _fetch(*a.fetch) or 0
    if a.send:
        return _send(*a.send) or 0
    if a.receive:
        return _receive(int(a.receive[0]), a.receive[1]) or 0

    sys.path.insert(0, ROOT)
    from benchmarks.netns import bridged_hosts
    from mlxcluster.model.loader import default_model_path

    model = a.model or default_model_path()
    size = os.path.getsize(model)
    rows = []
    with bridged_hosts(3) as hosts:
        (ns0, ip0), (ns1, _ip1) = hosts[:2]
        holder = _in(ns0, "--holder", model, "50061")
        assert holder.stdout.readline().strip() == "ready"
        try:
            best = {}
            for _ in range(a.repeats):
                dest = tempfile.mkdtemp(prefix="bench-fetch-")
                out = _in(ns1, "--fetch", f"{ip0}:50061", dest)
                got = json.loads(out.stdout.readline())
                out.wait(60)
                shutil.rmtree(dest)
                best["mlxcluster fetch (TLS, sha256)"] = min(best.get("mlxcluster fetch (TLS, sha256)", 1e9), got["s"])
                dest = tempfile.mktemp(prefix="bench-cat-")
                recv = _in(ns1, "--receive", "50062", dest)
                assert recv.stdout.readline().strip() == "ready"
                ip1 = hosts[1][1]
                send = _in(ns0, "--send", model, f"{ip1}:50062")
                got = json.loads(recv.stdout.readline())
                send.wait(60)
                recv.wait(60)
                os.remove(dest)
                best["plain TCP copy (the floor)"] = min(best.get("plain TCP copy (the floor)", 1e9), got["s"])
        finally:
            holder.stdin.close()
            holder.wait(30)
        for name, s in best.items():
            rows.append({"transfer": name, "bytes": size, "seconds": round(s, 3), "MB_per_s": round(size / s / 1e6, 1)})
            print(f"| {name} | {size / 1e6:.1f} MB | {s:.3f} s | {size / s / 1e6:.1f} MB/s |", flush=True)
        result = {"transfers": rows}
        if not a.no_bare_node:
            phases = _bare_node(model, hosts)
            print("\nfrom `join --fetch-model` on a bare node (TP=3 with two holders), seconds after its start:")
            print("| " + " | ".join(phases) + " |\n|" + "---|" * len(phases) + "\n| " +
                  " | ".join("-" if v is None else f"{v:.2f}" for v in phases.values()) + " |", flush=True)
            result["bare_node_s"] = phases
    json.dump(result, sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Side-by-side benchmark: plain mlx-lm, mlx-lm's own tensor parallelism, mlxcluster.

One run on one machine, on the same weights (the GGUF exported once with
:func:`mlxcluster.model.export.export_mlx`, float32 by default) and the same
prompt token ids:

  * ``mlx-lm TP=1``: a single process running ``mlx_lm.utils.load`` and
    ``mlx_lm.generate.generate_step`` (greedy), with the ranks' BLAS
    environment (:func:`~mlxcluster.runtime.blas.rank_environment`);
  * ``mlx-lm TP=N <backend>``: N processes started the way ``mlx.launch``
    (ring: hostfile + ``MLX_RANK``/``MLX_HOSTFILE``) or ``mpirun`` does, each
    loading with mlx-lm's ``sharded_load`` (lazy load, Llama ``Model.shard``),
    then every rank runs ``generate_step`` -- no control plane;
  * ``mlxcluster TP=1`` and ``mlxcluster TP=N <backend>``
    (:class:`~mlxcluster.runtime.launcher.LocalCluster` +
    :class:`~mlxcluster.leader.generation.GenerationClient`).

Every worker process is started and watched by the ranks' own supervisor
(:mod:`mlxcluster.runtime.supervisor`; ring hostfile / ``mpirun`` command from
:func:`mlxcluster.runtime.launcher.local_processes`) and reports with the
same ``@@mlxcluster`` progress events.

Figures per configuration: bootstrap (spawn -> ready), TTFT, decode tokens/s
after a short prompt, prefill tokens/s on a long prompt, peak MLX memory per
rank.  Plus the median ``all_sum`` latency of a decode-sized tensor per
backend, the loopback TCP round trip (the floor), and the control-plane time
per decode step (one decode-step ``stepPlan`` frame through :class:`RankLink` to a no-op
:class:`RankControlServicer`, and the TP=N step-time difference to mlx-lm).

Writes a Markdown table to stdout, ``bench.json`` and ``bench.png`` into
``--out-dir`` (the chart needs matplotlib: ``pip install -e ".[bench]"``; without
it the chart is skipped with a one-line note).  Every subprocess runs under a
timeout and is killed on failure; a failing configuration is reported with its
one-line reason.

Usage (from a source checkout; ``mlxcluster bench`` takes the same options)::

    python benchmarks/bench.py [--world-size 3] [--backends mpi,ring] [--weights float32]
        [--decode-tokens 64] [--ring-decode-tokens 32] [--prefill-tokens 512]
        [--repeats 5] [--skip-mlx-lm] [--quick] [--mlx-dir DIR] [--timeout S] [--out-dir bench-out]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # python benchmarks/bench.py from an uninstalled checkout
    sys.path.insert(0, ROOT)

from benchmarks.common import machine_description, prepare_mlx_dir as _prepare_mlx_dir, scratch_dir as _scratch_dir  # noqa: E402,F401

from mlxcluster.model.topology import Topology  # noqa: E402
from mlxcluster.runtime.rank import all_sum_times, init_group  # noqa: E402
from mlxcluster.runtime.supervisor import Supervisor, emit, rank_env  # noqa: E402

__all__ = ["main"]

# Greedy continuation runs well past 128 tokens without EOS on the default model.
SHORT_PROMPT = "Once upon a time, in a small village at the edge of a great forest, there lived"
WARM_PROMPT = "Hello, world."
LONG_TEXT = (
    "Tensor parallelism splits every matrix of a transformer layer across several devices. "
    "The query, key, value, gate and up projections are divided by output rows, so that each "
    "rank computes its own attention heads and its own slice of the feed-forward channels; the "
    "output and down projections are divided by input columns, and the partial results of all "
    "ranks are added together with one all-reduce per projection. A decode step of a thirty "
    "layer model therefore waits on sixty small collectives, and their latency, not the "
    "arithmetic, decides how fast tokens come out when the model is small. "
)


# ---------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------

def _one_line(text: str, limit: int = 300) -> str:
    lines = [l.strip() for l in str(text).strip().splitlines() if l.strip()]
    return (lines[-1] if lines else "failed")[:limit]


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def _pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return float(s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))])


def _loadavg() -> Optional[List[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None




def _run_workers(world: int, backend: str, cmd: List[str], timeout_s: float) -> Tuple[Supervisor, Optional[str]]:
    """Run ``cmd`` as ``world`` ranks the way ``mlx.launch`` (ring) or ``mpirun`` does,
    until every process exits; returns the supervisor (its events) and ``None`` or
    the one-line reason of a failure.  A failing rank stops the rest (they may be
    stuck in a collective); so does ``timeout_s``."""
    from mlxcluster.runtime.launcher import LaunchError, local_processes

    sup = Supervisor()
    tmp = tempfile.mkdtemp(prefix="mlxc-bench-")
    try:
        for name, argv, env in local_processes(world, backend, cmd, rank_env(world), tmp):
            sup.spawn(argv, env, name)
        return sup, sup.wait_exit(timeout_s)
    except (LaunchError, OSError, ValueError) as exc:
        sup.stop()
        return sup, _one_line(str(exc))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _worker_cmd(*args: str) -> List[str]:
    return [sys.executable, os.path.abspath(__file__), "--worker", *args]


# ---------------------------------------------------------------------------
# workers (run in subprocesses: python benchmarks/bench.py --worker KIND ...)
# ---------------------------------------------------------------------------

def _worker_mlxlm(args) -> int:
    """Plain mlx-lm (world 1) or mlx-lm's own tensor parallelism (world N)."""
    import mlx.core as mx

    rank = 0
    try:
        group = init_group(args.backend, args.world_size)
        rank = group.rank()
        from mlx_lm.generate import generate_step
        from mlx_lm.utils import load, sharded_load

        if group.size() == 1:
            model, tokenizer = load(args.model_dir)
        else:
            # mlx-lm's own tensor-parallel loading: lazy load, Model.shard(group), eval, barrier.
            model, tokenizer = sharded_load(args.model_dir, tensor_group=group)
        eos = set(tokenizer.eos_token_ids)
        if args.dtype in ("float16", "bfloat16"):
            model.set_dtype(getattr(mx, args.dtype))
        mx.eval(model.parameters())
        if group.size() > 1:
            mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=group))
        emit("ready", rank=rank, wall=time.time())
        with open(args.prompts) as f:
            prompts = json.load(f)

        def run(ids, max_tokens):
            t0 = time.perf_counter()
            times, tokens = [], []
            for tok, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens):
                times.append(time.perf_counter())
                tokens.append(int(tok))
                if tokens[-1] in eos:  # as stream_generate (and mlxcluster) stop
                    break
            mx.synchronize()
            return t0, times, tokens

        run(prompts["warm"], 4)
        ttfts, tps, prefill, token_ids = [], [], [], None
        for _ in range(prompts["repeats"]):
            t0, times, tokens = run(prompts["short"], prompts["decode_tokens"])
            token_ids = token_ids or tokens
            ttfts.append(times[0] - t0)
            decode_s = times[-1] - times[0]
            tps.append((len(tokens) - 1) / decode_s if decode_s > 0 else 0.0)
            l0, ltimes, _ = run(prompts["long"], 1)
            prefill.append(len(prompts["long"]) / (ltimes[0] - l0))
        if group.size() > 1:
            mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=group))
        emit("result", rank=rank, ttft_s=min(ttfts), decode_tokens=len(token_ids),
              decode_tokens_per_s=max(tps), prefill_tokens=len(prompts["long"]),
              prefill_tokens_per_s=max(prefill), token_ids=token_ids,
              runs={"ttft_s": ttfts, "decode_tokens_per_s": tps, "prefill_tokens_per_s": prefill},
              peak_memory_bytes=int(mx.get_peak_memory()))
        if group.size() > 1:  # every rank has reported before any exits
            mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=group))
        return 0
    except Exception as exc:
        emit("error", rank=rank, message=f"{type(exc).__name__}: {_one_line(str(exc)) if str(exc).strip() else ''}")
        return 1


def _worker_allsum(args) -> int:
    """Median latency of ``all_sum`` of a (1, 1, hidden) float32 tensor."""
    import mlx.core as mx

    rank = 0
    try:
        group = init_group(args.backend, args.world_size)
        rank = group.rank()
        times = all_sum_times(group, args.hidden, args.iterations, args.warmup)
        emit("result", rank=rank, median_us=_median(times) * 1e6, p10_us=_pct(times, 0.1) * 1e6,
              p90_us=_pct(times, 0.9) * 1e6, iterations=len(times), bytes=4 * args.hidden)
        mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=group))
        return 0
    except Exception as exc:
        emit("error", rank=rank, message=f"{type(exc).__name__}: {_one_line(str(exc))}")
        return 1


def _worker_echo(args) -> int:
    """TCP echo peer for the round-trip measurement: echo until the peer closes."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(30)
    emit("port", port=srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.settimeout(30)
    while True:
        data = conn.recv(65536)
        if not data:
            break
        conn.sendall(data)
    conn.close()
    srv.close()
    return 0


def _worker_main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="bench.py --worker")
    p.add_argument("kind", choices=["mlxlm", "allsum", "echo"])
    p.add_argument("--model-dir")
    p.add_argument("--prompts")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--backend", default="mpi")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iterations", type=int, default=200)
    args = p.parse_args(argv)
    fn = {"mlxlm": _worker_mlxlm, "allsum": _worker_allsum, "echo": _worker_echo}[args.kind]
    return fn(args)


# ---------------------------------------------------------------------------
# measurements (parent side)
# ---------------------------------------------------------------------------

def _row(name: str, impl: str, world: int, backend: str) -> Dict[str, Any]:
    return {"name": name, "impl": impl, "world_size": world, "backend": backend, "ok": False,
            "error": None}


def _finish_row(row: Dict[str, Any]) -> Dict[str, Any]:
    tps = row.get("decode_tokens_per_s") or 0.0
    row["decode_step_ms"] = 1000.0 / tps if tps > 0 else None
    peaks = row.get("peak_memory_bytes_per_rank") or []
    row["peak_memory_mib_per_rank"] = [round(b / 2**20, 1) for b in peaks]
    return row


def bench_mlxlm(model_dir: str, prompts_file: str, world: int, backend: str, dtype: str,
                timeout_s: float) -> Dict[str, Any]:
    name = "mlx-lm TP=1" if world == 1 else f"mlx-lm TP={world} {backend}"
    row = _row(name, "mlx-lm", world, backend if world > 1 else "none")
    cmd = _worker_cmd("mlxlm", "--model-dir", model_dir, "--prompts", prompts_file, "--dtype", dtype,
                      "--backend", backend, "--world-size", str(world))
    spawn = time.time()
    group, reason = _run_workers(world, backend, cmd, timeout_s)
    ready = [e for e in group.events if e["event"] == "ready"]
    results = {e["rank"]: e for e in group.events if e["event"] == "result"}
    if len(results) == world and 0 in results:
        reason = None  # every rank reported (mpirun flags os._exit without MPI_Finalize)
    elif reason is None:
        reason = f"only {len(results)} of {world} ranks reported results"
    if reason:
        row["error"] = reason
        return _finish_row(row)
    r0 = results[0]
    row.update(ok=True, bootstrap_s=max(e["wall"] for e in ready) - spawn if len(ready) == world else None,
               ttft_s=r0["ttft_s"], decode_tokens=r0["decode_tokens"],
               decode_tokens_per_s=r0["decode_tokens_per_s"], prefill_tokens=r0["prefill_tokens"],
               prefill_tokens_per_s=r0["prefill_tokens_per_s"], token_ids=r0["token_ids"], runs=r0["runs"],
               peak_memory_bytes_per_rank=[results[r]["peak_memory_bytes"] for r in range(world)])
    return _finish_row(row)


def loopback_bytes() -> Optional[int]:
    """Bytes received so far on the loopback interface (``/proc/net/dev``, Linux; ``None``
    elsewhere).  Local ranks' TCP traffic (the MLX ring, gRPC) crosses it; OpenMPI's ranks on
    one machine use shared memory instead, which it does not see."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    return int(rest.split()[0])
    except OSError:
        pass
    return None


def process_tcp_bytes(pids: Sequence[int]) -> Optional[int]:
    """Bytes the processes ``pids`` have sent so far on their open TCP sockets (the kernel's
    ``tcpi_bytes_sent`` of each, read with iproute2's ``ss -tinp``; Linux 4.19+; ``None`` where ``ss`` is
    missing).  Unlike :func:`loopback_bytes` it counts no other process's traffic; a socket closed
    meanwhile takes its bytes with it."""
    import re
    import subprocess

    try:
        out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    wanted, total, owner = {f"pid={p}," for p in pids}, 0, False
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):  # a socket's line; its figures follow on the next
            owner = any(w in line for w in wanted)
        elif owner:
            m = re.search(r"\bbytes_sent:(\d+)", line)
            total += int(m.group(1)) if m else 0
    return total


def topology_args(spec: str) -> Tuple[str, Topology, int]:
    """``--topology`` text -> (label, :class:`~mlxcluster.model.topology.Topology`, world size): the
    ``--layers`` route, then optional ``--local-decode``, ``--stage-tp S`` or ``--pp-logits L``, e.g.
    ``"15:output,0:14 --local-decode"`` or ``"0:14,15:output --stage-tp 3,1"``."""
    parts = spec.split()
    extra = parts[1:]

    def value(flag: str) -> Optional[str]:
        return extra[extra.index(flag) + 1] if flag in extra[:-1] else None

    topology = Topology(layers=parts[0], local_decode="--local-decode" in extra, stage_tp=value("--stage-tp"),
                        pp_logits=value("--pp-logits") or "relay")
    return " ".join(parts), topology, topology.world_size


def bench_mlxcluster(model: str, weights: str, prompts: Dict[str, Any], world: int, backend: str,
                     timeout_s: float, layers: Optional[str] = None) -> Dict[str, Any]:
    """One mlxcluster configuration; ``layers``: a pipeline
    (a ``--topology`` text, :func:`topology_args`) instead of tensor parallelism.

    A pipeline row also has the loopback bytes moved per decode token (the short prompt's
    generation minus a one-token one, over the extra tokens) and for the long prompt's
    one-token request (its prefill, the first token, frames), TTFT on the long prompt, and
    the ``--local-decode`` handoff (bytes, ms) of the long prompt."""
    from mlxcluster.leader.generation import GenerationClient
    from mlxcluster.runtime.launcher import LocalCluster

    name = "mlxcluster TP=1" if world == 1 else f"mlxcluster TP={world} {backend}"
    if layers:
        name = f"mlxcluster PP {layers} {backend}"
    row = _row(name, "mlxcluster", world, backend if world > 1 else "none")
    row["layers"] = layers
    cluster = LocalCluster(world, backend if world > 1 else "ring", model=model, weights=weights,
                           start_timeout_s=min(timeout_s, 300.0), step_timeout_s=min(timeout_s, 120.0),
                           topology=topology_args(layers)[1] if layers else None)
    client = None
    result: Dict[str, Any] = {}

    def body():
        nonlocal client
        t0 = time.perf_counter()
        cluster.start()
        result["bootstrap_s"] = time.perf_counter() - t0
        client = GenerationClient(cluster.address, cluster.credentials, timeout_s=timeout_s)
        client.generate(prompt_ids=prompts["warm"], max_tokens=4)
        result["short"], result["long"] = [], []
        for _ in range(prompts["repeats"]):
            result["short"].append(client.generate(prompt_ids=prompts["short"], max_tokens=prompts["decode_tokens"]))
            result["long"].append(client.generate(prompt_ids=prompts["long"], max_tokens=1))
        if layers and loopback_bytes() is not None:  # bytes on the wire (loopback): the pipeline's hops
            b0 = loopback_bytes()
            one = client.generate(prompt_ids=prompts["short"], max_tokens=1)
            b1 = loopback_bytes()
            many = client.generate(prompt_ids=prompts["short"], max_tokens=prompts["decode_tokens"])
            b2 = loopback_bytes()
            client.generate(prompt_ids=prompts["long"], max_tokens=1)
            b3 = loopback_bytes()
            extra = len(many.token_ids) - len(one.token_ids)
            result["lo_bytes_per_decode_token"] = ((b2 - b1) - (b1 - b0)) / extra if extra > 0 else None
            result["lo_bytes_long_prefill"] = b3 - b2  # the long prompt's request: prefill, first token

    # The whole configuration runs under one deadline: a stuck group is torn down.
    t = threading.Thread(target=lambda: _capture(body, result), daemon=True)
    t.start()
    t.join(timeout_s)
    try:
        if t.is_alive():
            result.setdefault("error", f"timed out after {timeout_s:.0f} s")
        if client is not None:
            client.close()
    finally:
        cluster.stop()
    t.join(10)
    if "error" in result:
        row["error"] = result["error"]
        return _finish_row(row)
    short, long = result["short"], result["long"]
    runs = {"ttft_s": [r.ttft_s for r in short], "decode_tokens_per_s": [r.decode_tokens_per_s for r in short],
            "prefill_tokens_per_s": [r.prefill_tokens_per_s for r in long]}
    loaded = {e["rank"]: e for e in cluster.events if e.get("event") == "loaded"}
    row.update(ok=True, bootstrap_s=result["bootstrap_s"], ttft_s=min(runs["ttft_s"]),
               decode_tokens=len(short[0].token_ids), decode_tokens_per_s=max(runs["decode_tokens_per_s"]),
               prefill_tokens=len(prompts["long"]), prefill_tokens_per_s=max(runs["prefill_tokens_per_s"]),
               runs=runs, token_ids=list(short[0].token_ids),
               peak_memory_bytes_per_rank=list(long[-1].peak_memory_bytes_per_rank),
               parameter_bytes_per_rank=[loaded[r].get("parameter_bytes") for r in sorted(loaded)])
    if layers:
        row.update(ttft_long_s=min(r.ttft_s for r in long),
                   handoff_bytes=long[-1].handoff_bytes, handoff_ms=min(r.handoff_s for r in long) * 1000,
                   handoff_fallback=long[-1].handoff_fallback,
                   lo_bytes_per_decode_token=result.get("lo_bytes_per_decode_token"),
                   lo_bytes_long_prefill=result.get("lo_bytes_long_prefill"))
    return _finish_row(row)


def _capture(fn, result: Dict[str, Any]) -> None:
    try:
        fn()
    except Exception as exc:
        # setdefault: after a timeout, the teardown's own errors are not the reason
        result.setdefault("error", f"{type(exc).__name__}: {_one_line(str(exc))}")


def bench_allsum(world: int, backend: str, hidden: int, iterations: int, timeout_s: float) -> Dict[str, Any]:
    row = {"backend": backend, "world_size": world, "ok": False, "error": None}
    cmd = _worker_cmd("allsum", "--backend", backend, "--world-size", str(world), "--hidden", str(hidden),
                      "--iterations", str(iterations), "--warmup", str(max(10, iterations // 10)))
    group, reason = _run_workers(world, backend, cmd, timeout_s)
    res = [e for e in group.events if e["event"] == "result" and e.get("rank") == 0]
    if len({e.get("rank") for e in group.events if e["event"] == "result"}) == world:
        reason = None  # every rank reported (mpirun flags os._exit without MPI_Finalize)
    elif reason is None:
        reason = "only some ranks reported a result"
    if reason:
        row["error"] = reason
        return row
    r = res[0]
    row.update(ok=True, median_us=r["median_us"], p10_us=r["p10_us"], p90_us=r["p90_us"],
               iterations=r["iterations"], bytes=r["bytes"])
    return row


def bench_tcp_rtt(payloads: Sequence[int], iterations: int, timeout_s: float = 60.0) -> Dict[str, Any]:
    """Median round trip of a TCP ping-pong between this process and an echo process."""
    out: Dict[str, Any] = {"ok": False, "error": None, "iterations": iterations, "by_payload": {}}
    group = Supervisor()
    sock = None
    try:
        echo = group.spawn(_worker_cmd("echo"), rank_env(1), "echo")
        deadline = time.monotonic() + timeout_s
        group.wait_for(lambda: echo.returncode is not None or any(e["event"] == "port" for e in echo.events),
                       timeout_s)
        port = next((e["port"] for e in group.events if e["event"] == "port"), None)
        if port is None:
            raise RuntimeError("echo process did not start" + (f": {group.failure}" if group.failure else ""))
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for size in payloads:
            msg = b"x" * size
            times = []
            for i in range(iterations + max(20, iterations // 10)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"timed out after {timeout_s:.0f} s")
                t = time.perf_counter()
                sock.sendall(msg)
                got = 0
                while got < size:
                    chunk = sock.recv(size - got)
                    if not chunk:
                        raise RuntimeError("echo peer closed the connection")
                    got += len(chunk)
                if i >= max(20, iterations // 10):
                    times.append(time.perf_counter() - t)
            out["by_payload"][str(size)] = {"median_us": _median(times) * 1e6, "p10_us": _pct(times, 0.1) * 1e6,
                                            "p90_us": _pct(times, 0.9) * 1e6}
        out["ok"] = True
    except Exception as exc:
        out["error"] = _one_line(str(exc))
    finally:
        if sock is not None:
            sock.close()
        group.wait_exit(5)  # the echo process ends when the connection closes
    return out


class _NoOpRank:
    """Stands in for a rank N's Follower: records arrival, computes nothing."""

    rank = 1
    batch: list = []

    def __init__(self):
        self.arrived = 0.0
        self.event = threading.Event()

    def run(self, frame):
        self.arrived = time.perf_counter()
        self.event.set()
        return ()

    from mlxcluster.control.follower import Follower as _Follower

    drain = _Follower.drain  # the real follower loop, around the no-op handler
    del _Follower


class _Plaintext:
    """Stands in for :class:`mlxcluster.security.Credentials` with plaintext gRPC, to
    measure what mutual TLS costs (the product has no plaintext links)."""

    @staticmethod
    def aio_channel(address, peer=None, options=()):
        import grpc

        return grpc.aio.insecure_channel(address, options=list(options))


def bench_control_plane(frames: int, timeout_s: float = 60.0, tls: bool = True) -> Dict[str, Any]:
    """Median time from building a decode-step ``stepPlan`` frame on rank 0 to a no-op rank N's handler
    starting on it: RankLink (grpc.aio on rank 0's event loop) -> gRPC stream over
    loopback (mutual TLS, as in the product; ``tls=False``: plaintext, for comparison) ->
    RankControlServicer's reader thread -> the rank's MLX thread.  This is
    what the control plane adds to a decode step's critical path (rank 0 computes while
    the frame travels; rank N starts late by it)."""
    from mlxcluster.security import credentials, new_secret
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from mlxcluster.control.follower import RankControlServicer
    from mlxcluster.control.link import RankGroup, RankLink
    from mlxcluster.protocol import frames as fr
    from mlxcluster.protocol import mlxcluster_pb2_grpc as pb_grpc

    out: Dict[str, Any] = {"ok": False, "error": None, "frames": frames}
    noop = _NoOpRank()
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx")
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_RankControlServicer_to_server(RankControlServicer(noop, executor, 2, "noop"), server)
    creds = credentials(new_secret(), "local") if tls else _Plaintext()
    port = server.add_secure_port("127.0.0.1:0", creds.server()) if tls else server.add_insecure_port("127.0.0.1:0")
    server.start()

    async def measure() -> List[float]:
        group = RankGroup()
        group.bind()
        link = await RankLink(1, f"127.0.0.1:{port}", group.deliver, creds).open(10)
        group.add(link)
        loop = asyncio.get_running_loop()
        try:
            uid = "0123456789abcdef"
            warm = max(20, frames // 10)
            times = []
            deadline = time.monotonic() + timeout_s
            for i in range(warm + frames):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"timed out after {timeout_s:.0f} s")
                noop.event.clear()
                t = time.perf_counter()
                link.send(fr.step_plan(decode=[(uid, 100 + i, 42)], step=i + 1))
                if not await loop.run_in_executor(None, noop.event.wait, 5):
                    raise RuntimeError("a stepPlan frame did not arrive within 5 s")
                if i >= warm:
                    times.append(noop.arrived - t)
                group.drain()  # raises on an unexpected error reply
            return times
        finally:
            await group.close()

    try:
        times = asyncio.run(measure())
        out.update(ok=True, frame_median_us=_median(times) * 1e6, frame_p10_us=_pct(times, 0.1) * 1e6,
                   frame_p90_us=_pct(times, 0.9) * 1e6)
    except Exception as exc:
        out["error"] = _one_line(str(exc))
    finally:
        server.stop(grace=0)
        executor.shutdown(wait=False)
    return out


# ---------------------------------------------------------------------------
# setup: export, prompts, weight size
# ---------------------------------------------------------------------------





def _make_prompts(mlx_dir: str, decode_tokens: int, prefill_tokens: int) -> Dict[str, Any]:
    from tokenizers import Tokenizer

    tok_file = os.path.join(mlx_dir, "tokenizer.json")
    if os.path.isfile(tok_file):
        encode = lambda s: Tokenizer.from_file(tok_file).encode(s, add_special_tokens=False).ids  # noqa: E731
    else:
        from transformers import AutoTokenizer

        t = AutoTokenizer.from_pretrained(mlx_dir)
        encode = lambda s: t.encode(s, add_special_tokens=False)  # noqa: E731
    long_ids: List[int] = []
    while len(long_ids) < prefill_tokens:
        long_ids += encode(LONG_TEXT)
    return {"warm": encode(WARM_PROMPT), "short": encode(SHORT_PROMPT), "long": long_ids[:prefill_tokens],
            "decode_tokens": decode_tokens}


def _full_float32_bytes(config: Dict[str, Any]) -> int:
    """float32 bytes of every parameter of the full (unsharded) model."""
    from mlx.utils import tree_flatten

    from mlxcluster.model.arch import model_classes

    model_cls, args_cls = model_classes(config)
    model = model_cls(args_cls.from_dict(config))  # parameters stay lazy: never evaluated
    return sum(v.size for _, v in tree_flatten(model.parameters())) * 4


# ---------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------

def _fmt(x, spec: str = ".1f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _target(name: str, value: Optional[float], threshold: float, higher_is_better: bool,
            unit: str = "", detail: str = "") -> Dict[str, Any]:
    if value is None:
        return {"name": name, "value": None, "threshold": threshold, "ratio": None, "pass": None,
                "unit": unit, "detail": detail or "not measured"}
    ratio = value / threshold if threshold else None
    ok = value >= threshold if higher_is_better else value <= threshold
    return {"name": name, "value": value, "threshold": threshold, "ratio": ratio, "pass": bool(ok),
            "unit": unit, "detail": detail}


def _targets(report: Dict[str, Any]) -> List[Dict[str, Any]]:
    rows = {r["name"]: r for r in report["configs"]}
    n = report["world_size"]
    backends = report["backends"]
    default = report["default_backend"]
    out = []

    def tps(name):
        r = rows.get(name)
        return r["decode_tokens_per_s"] if r and r["ok"] else None

    for b in backends:
        a, m = tps(f"mlxcluster TP={n} {b}"), tps(f"mlx-lm TP={n} {b}")
        out.append(_target(f"mlxcluster TP={n} {b} decode / mlx-lm TP={n} {b} decode >= 1.0x",
                           a / m if a and m else None, 1.0, True, "x",
                           f"{_fmt(a, '.2f')} vs {_fmt(m, '.2f')} tok/s"))
    a, m = tps("mlxcluster TP=1"), tps("mlx-lm TP=1")
    out.append(_target("mlxcluster TP=1 decode / plain mlx-lm decode >= 1.0x", a / m if a and m else None,
                       1.0, True, "x", f"{_fmt(a, '.2f')} vs {_fmt(m, '.2f')} tok/s"))
    cp = report["control_plane"]
    step_row = rows.get(f"mlxcluster TP={n} {default}")
    step_ms = step_row["decode_step_ms"] if step_row and step_row["ok"] else None
    if cp.get("ok") and step_ms:
        frac = cp["frame_median_us"] / 1000.0 / step_ms
        out.append(_target(f"control plane per step (stepPlan frame, direct) <= 2% of the TP={n} {default} step",
                           frac * 100, 2.0, False, "%",
                           f"{cp['frame_median_us']:.0f} us of {step_ms:.1f} ms"))
    else:
        out.append(_target(f"control plane per step (stepPlan frame, direct) <= 2% of the TP={n} {default} step",
                           None, 2.0, False, "%"))
    for b in backends:
        d = cp.get("derived", {}).get(b)
        if d and "mlxcluster_step_ms" in d:
            out.append(_target(f"control plane per step (mlxcluster - mlx-lm TP={n} {b} step) <= 2% of the step",
                               max(0.0, d["diff_ms"]) / d["mlxcluster_step_ms"] * 100, 2.0, False, "%",
                               f"{d['diff_ms']:+.2f} ms of {d['mlxcluster_step_ms']:.1f} ms"))
    al = next((r for r in report["all_sum"] if r["backend"] == default and r["ok"]), None)
    rtt_us = _rtt_for(report, al) if al else None
    if al and rtt_us:
        out.append(_target(f"all_sum ({default}, {n} ranks) <= 3x TCP round trip", al["median_us"] / rtt_us, 3.0,
                           False, "x", f"{al['median_us']:.0f} us vs {rtt_us:.0f} us"))
    else:
        out.append(_target(f"all_sum ({default}, {n} ranks) <= 3x TCP round trip", None, 3.0, False, "x"))
    limit = report["weights_float32_bytes"] / n * 1.15
    for b in backends:
        r = rows.get(f"mlxcluster TP={n} {b}")
        peak = max(r["peak_memory_bytes_per_rank"]) if r and r["ok"] and r["peak_memory_bytes_per_rank"] else None
        params = max(r.get("parameter_bytes_per_rank") or [0]) if r and r["ok"] else 0
        out.append(_target(f"mlxcluster TP={n} {b} peak memory per rank <= weights/{n} + 15%",
                           peak / 2**20 if peak else None, limit / 2**20, False, "MiB",
                           f"max over ranks; weights {report['weights_float32_bytes'] / 2**20:.0f} MiB float32"
                           + (f", parameters held {params / 2**20:.0f} MiB per rank" if params else "")))
    return out


def _rtt_for(report: Dict[str, Any], allsum_row: Dict[str, Any]) -> Optional[float]:
    """The loopback TCP round-trip floor for the all_sum payload: the lower of the
    median measured at the start of the run and the one measured just before
    ``allsum_row`` (on this VM the round trip is bimodal, ~25 or ~110 us, depending
    on how both ends were woken)."""
    candidates = [allsum_row.get("tcp_rtt_us")]
    rtt = report["tcp_rtt"]
    if rtt.get("ok"):
        candidates.append(rtt["by_payload"].get(str(report["all_sum_bytes"]), {}).get("median_us"))
    candidates = [c for c in candidates if c]
    return min(candidates) if candidates else None


def _markdown(report: Dict[str, Any]) -> str:
    L = []
    s = report["settings"]
    L.append(f"Machine: {report['machine']}; BLAS: {report['blas']}; weights: {report['weights']}; "
             f"model: {report['model']} ({report.get('architecture', 'llama')}, "
             f"{report['weights_float32_bytes'] / 2**20:.0f} MiB of float32 weights)")
    la = report.get("load_average") or {}
    s_ = report["settings"]
    L.append(f"Load average (1/5/15 min) at start {la.get('start')}, at end {la.get('end')} "
             f"(the machine is shared: figures are the best of {s_['repeats']} run(s), ring of {s_.get('ring_repeats', 1)}); "
             f"{report['elapsed_s']} s in all.")
    L.append("")
    L.append(f"| configuration | bootstrap s | TTFT ms | decode tok/s | step ms | prefill tok/s "
             f"({s['prefill_tokens']} tok) | peak MiB per rank | same tokens as mlx-lm |")
    L.append("|---|---|---|---|---|---|---|---|")
    for r in report["configs"]:
        if not r["ok"]:
            L.append(f"| {r['name']} | FAILED: {r['error']} | | | | | | |")
            continue
        L.append(f"| {r['name']} | {_fmt(r.get('bootstrap_s'), '.2f')} | {_fmt(r['ttft_s'] * 1000, '.0f')} "
                 f"| {r['decode_tokens_per_s']:.2f} ({r['decode_tokens']} tok) | {_fmt(r['decode_step_ms'], '.1f')} "
                 f"| {r['prefill_tokens_per_s']:.1f} | {', '.join(map(str, r['peak_memory_mib_per_rank']))} "
                 f"| {r.get('same_tokens', '-')} |")
    pp = [r for r in report["configs"] if r.get("layers") and r["ok"]]
    if pp:
        tp1 = next((r for r in report["configs"] if r["name"] == "mlxcluster TP=1" and r["ok"]), None)
        hidden_b = report["hidden"] * 4
        L.append("")
        L.append(f"| topology | decode tok/s | step ms (TP=1: {_fmt(tp1 and tp1['decode_step_ms'], '.1f')}) "
                 f"| TTFT ms, {s['prefill_tokens']}-token prompt | prefill tok/s | loopback B per decode token "
                 f"(hidden states alone: {hidden_b:,} B per hop) | loopback B of a {s['prefill_tokens']}-token prompt's "
                 f"request (hidden states: {hidden_b * s['prefill_tokens']:,} B per hop) | handoff | peak MiB per rank |")
        L.append("|---|---|---|---|---|---|---|---|---|")
        for r in pp:
            hand = "-"
            if r.get("handoff_bytes"):
                hand = f"{r['handoff_bytes']:,} B in {r['handoff_ms']:.1f} ms"
            if r.get("handoff_fallback"):
                hand += f" (refused: {r['handoff_fallback']})"
            lo_tok, lo_pre = r.get("lo_bytes_per_decode_token"), r.get("lo_bytes_long_prefill")
            L.append(f"| {r['name'][len('mlxcluster PP '):]} | {r['decode_tokens_per_s']:.2f} "
                     f"| {_fmt(r['decode_step_ms'], '.1f')} | {_fmt(r.get('ttft_long_s', 0) * 1000, '.0f')} "
                     f"| {r['prefill_tokens_per_s']:.1f} | {_fmt(lo_tok, ',.0f')} | {_fmt(lo_pre, ',.0f')} | {hand} "
                     f"| {', '.join(map(str, r['peak_memory_mib_per_rank']))} |")
    L.append("")
    rtt = report["tcp_rtt"]
    L.append("| collective | median us | p10 us | p90 us | vs TCP RTT floor (lower median of start / just before) |")
    L.append("|---|---|---|---|---|")
    for a in report["all_sum"]:
        label = f"all_sum {a['backend']} x{a['world_size']} (1x1x{report['hidden']} f32)"
        base = _rtt_for(report, a)
        if a["ok"]:
            L.append(f"| {label} | {a['median_us']:.1f} | {a['p10_us']:.1f} | {a['p90_us']:.1f} | "
                     f"{_fmt(a['median_us'] / base if base else None, '.2f')}x of {_fmt(base, '.1f')} us |")
        else:
            L.append(f"| {label} | FAILED: {a['error']} | | | |")
    if rtt.get("ok"):
        for size, v in rtt["by_payload"].items():
            L.append(f"| TCP loopback round trip, {size} B | {v['median_us']:.1f} | {v['p10_us']:.1f} | "
                     f"{v['p90_us']:.1f} | |")
    else:
        L.append(f"| TCP loopback round trip | FAILED: {rtt['error']} | | | |")
    cp = report["control_plane"]
    L.append("")
    if cp.get("ok"):
        L.append(f"Control plane, direct: stepPlan frame RankLink -> no-op RankControlServicer over loopback "
                 f"gRPC: median {cp['frame_median_us']:.0f} us (p10 {cp['frame_p10_us']:.0f}, "
                 f"p90 {cp['frame_p90_us']:.0f}) over {cp['frames']} frames, mutual TLS"
                 + (f" (plaintext gRPC, for comparison: {cp['plaintext_frame_median_us']:.0f} us)."
                    if "plaintext_frame_median_us" in cp else "."))
    else:
        L.append(f"Control plane, direct: FAILED: {cp['error']}")
    for b, d in cp.get("derived", {}).items():
        if "mlxcluster_step_ms" in d:
            L.append(f"Control plane, derived ({b}): mlxcluster step {d['mlxcluster_step_ms']:.2f} ms - mlx-lm step "
                     f"{d['mlx_lm_step_ms']:.2f} ms = {d['diff_ms']:+.2f} ms.")
    L.append("")
    L.append("| target | value | threshold | ratio | result |")
    L.append("|---|---|---|---|---|")
    for t in report["targets"]:
        res = "n/a" if t["pass"] is None else ("PASS" if t["pass"] else "FAIL")
        val = "-" if t["value"] is None else f"{t['value']:.2f} {t['unit']}".strip()
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
        detail = f" ({t['detail']})" if t["detail"] else ""
        L.append(f"| {t['name']}{detail} | {val} | {t['threshold']:.2f} {t['unit']} | {ratio} | {res} |")
    return "\n".join(L)


def _chart(report: Dict[str, Any], path: str) -> bool:
    """Draw the report as a PNG at ``path``; ``False`` (nothing written) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["configs"]
    names = [r["name"] for r in rows]
    colors = ["tab:gray" if r["impl"] == "mlx-lm" else "tab:blue" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.5))
    for ax, key, title in ((axes[0], "decode_tokens_per_s", "decode tokens/s"),
                           (axes[1], "prefill_tokens_per_s", f"prefill tokens/s ({report['settings']['prefill_tokens']} tok)")):
        vals = [(r.get(key) or 0.0) if r["ok"] else 0.0 for r in rows]
        bars = ax.bar(range(len(rows)), vals, color=colors)
        for b, r, v in zip(bars, rows, vals):
            ax.text(b.get_x() + b.get_width() / 2, v, "failed" if not r["ok"] else f"{v:.1f}",
                    ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        ax.set_title(title)
    labels, vals = [], []
    for a in report["all_sum"]:
        labels.append(f"all_sum {a['backend']} x{a['world_size']}")
        vals.append(a["median_us"] if a["ok"] else 0.0)
    rtt = report["tcp_rtt"]
    for size, v in (rtt.get("by_payload") or {}).items():
        labels.append(f"TCP RTT {size} B")
        vals.append(v["median_us"])
    cp = report["control_plane"]
    if cp.get("ok"):
        labels.append("stepPlan frame")
        vals.append(cp["frame_median_us"])
    ax = axes[2]
    bars = ax.bar(range(len(vals)), vals, color=["tab:orange"] * len(report["all_sum"]) +
                  ["tab:green"] * (len(vals) - len(report["all_sum"])))
    for b, v in zip(bars, vals):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    if vals and min(v for v in vals if v > 0) > 0 and max(vals) / max(min(v for v in vals if v > 0), 1e-9) > 30:
        ax.set_yscale("log")
    ax.set_xticks(range(len(vals)))
    ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
    ax.set_title("median latency, us (loopback)")
    fig.suptitle(f"{report['model']} ({report['weights']}), {report['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------

def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mlxcluster bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or mlx-lm directory (default: the embedded model)")
    p.add_argument("--weights", default=None, help="quantized, float32 (Linux default), float16, bfloat16")
    p.add_argument("--world-size", type=int, default=3)
    p.add_argument("--backends", default="mpi,ring", help="comma-separated: mpi, ring")
    p.add_argument("--decode-tokens", type=int, default=None, help="tokens generated after the short prompt (64; quick 8)")
    p.add_argument("--ring-decode-tokens", type=int, default=None,
                   help="decode tokens for ring configurations (32; quick 4): the ring is slow on one box")
    p.add_argument("--prefill-tokens", type=int, default=None, help="long prompt length (512; quick 64)")
    p.add_argument("--repeats", type=int, default=None,
                   help="measured runs per configuration, best kept (5; quick 1; ring at most 2)")
    p.add_argument("--allsum-iterations", type=int, default=None, help="timed all_sum calls (200; quick 50)")
    p.add_argument("--skip-mlx-lm", action="store_true", help="only mlxcluster configurations")
    p.add_argument("--topology", action="append", default=[],
                   help="also a pipeline with this --layers route per backend, e.g. 15:output,0:14, optionally "
                        "with rank options: \"15:output,0:14 --local-decode\", \"0:14,15:output --stage-tp 3,1\" "
                        "(repeatable)")
    p.add_argument("--quick", action="store_true", help="fewer tokens and iterations (tests)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per configuration (600; quick 120)")
    p.add_argument("--out-dir", default="bench-out")
    p.add_argument("--mlx-dir", default=None,
                   help="an existing export of the model (mlxcluster export DIR --dequantize) to reuse")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the benchmark; print the Markdown report; write bench.json and bench.png.

    Returns 0 when the run completed (failed configurations and targets are
    reported, not raised), 2 on bad arguments or an unusable model.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--serving" in argv:  # serve vs mlx_lm.server under concurrent clients (benchmarks/bench_serving.py)
        from benchmarks.bench_serving import main as serving

        return serving([x for x in argv if x != "--serving"])
    args = _parse(argv)
    q = args.quick
    decode_tokens = args.decode_tokens or (8 if q else 64)
    ring_decode = args.ring_decode_tokens or (min(4, decode_tokens) if q else min(32, decode_tokens))
    prefill_tokens = args.prefill_tokens or (64 if q else 512)
    allsum_iters = args.allsum_iterations or (50 if q else 200)
    repeats = max(1, args.repeats or (1 if q else 5))
    ring_repeats = 1 if q else min(repeats, 2)
    timeout_s = args.timeout or (120.0 if q else 600.0)
    tcp_iters = 300 if q else 2000
    cp_frames = 300 if q else 2000

    def err(msg: str) -> int:
        print(f"mlxcluster bench: error: {msg}", file=sys.stderr)
        return 2

    t0 = time.monotonic()

    def progress(msg: str) -> None:
        print(f"-- [{time.monotonic() - t0:5.1f} s] {msg}", file=sys.stderr, flush=True)

    from mlxcluster.model.loader import ModelError, default_weight_format, inspect_model
    from mlxcluster.model.tp import WorldSizeError, check_world_size
    from mlxcluster.runtime.blas import find_openblas
    from mlxcluster.runtime.launcher import mpirun_path, resolve_backend

    n = args.world_size
    if n < 2:
        return err("--world-size must be at least 2 (TP=1 is always measured)")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in backends if b not in ("mpi", "ring")]
    if bad or not backends:
        return err(f"--backends: unknown backend(s) {', '.join(bad) or '(none)'}; choose from mpi, ring")
    try:
        weights = args.weights or default_weight_format()
        info = inspect_model(args.model)
        check_world_size(info.config, n, info.quantization, weights, info.name)
    except (ModelError, WorldSizeError, ValueError) as exc:
        return err(_one_line(str(exc)))
    model_ref = info.path
    if args.mlx_dir and not os.path.isfile(os.path.join(args.mlx_dir, "config.json")):
        return err(f"--mlx-dir {args.mlx_dir}: not an mlx-lm model directory (no config.json)")
    default_backend = resolve_backend("auto")
    os.makedirs(args.out_dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="mlxc-bench-", dir=_scratch_dir())
    t_start = time.time()
    load_before = _loadavg()
    report: Dict[str, Any] = {
        "machine": machine_description(), "blas": find_openblas() or "bundled reference", "model": info.name,
        "model_path": model_ref, "weights": weights, "world_size": n, "backends": [],
        "default_backend": default_backend, "hidden": info.hidden_size,
        "architecture": info.architecture,
        "settings": {"decode_tokens": decode_tokens, "ring_decode_tokens": ring_decode,
                     "prefill_tokens": prefill_tokens, "allsum_iterations": allsum_iters,
                     "repeats": repeats, "ring_repeats": ring_repeats,
                     "tcp_iterations": tcp_iters, "control_frames": cp_frames, "timeout_s": timeout_s,
                     "quick": q, "skip_mlx_lm": args.skip_mlx_lm},
        "configs": [], "all_sum": [], "skipped": [],
    }
    report["all_sum_bytes"] = report["hidden"] * 4
    report["weights_float32_bytes"] = _full_float32_bytes(info.config)
    for b in backends:
        if b == "mpi" and mpirun_path() is None:
            report["skipped"].append({"backend": b, "reason": "mpirun not installed"})
            progress("skipping mpi: mpirun not installed")
        else:
            report["backends"].append(b)
    try:
        mlx_dir = args.mlx_dir
        if not args.skip_mlx_lm and mlx_dir is None:
            progress("exporting the model for mlx-lm")
            mlx_dir = _prepare_mlx_dir(model_ref, weights, workdir)
        if mlx_dir is not None and os.path.isfile(os.path.join(mlx_dir, "tokenizer.json")):
            prompt_dir = mlx_dir
        else:
            from mlxcluster.model.loader import read_model  # for its tokenizer

            src = read_model(model_ref)
            src.weights = {}
            src.tokenizer.save_pretrained(os.path.join(workdir, "tok"))
            prompt_dir = os.path.join(workdir, "tok")
        base_prompts = _make_prompts(prompt_dir, decode_tokens, prefill_tokens)
        plans = {"ring": dict(base_prompts, decode_tokens=ring_decode, repeats=ring_repeats)}
        plans["other"] = dict(base_prompts, decode_tokens=decode_tokens, repeats=repeats)
        prompt_files = {}
        for key, plan_prompts in plans.items():
            prompt_files[key] = os.path.join(workdir, f"prompts-{key}.json")
            with open(prompt_files[key], "w") as f:
                json.dump(plan_prompts, f)
        report["prompts"] = {"short_tokens": len(base_prompts["short"]), "long_tokens": len(base_prompts["long"]),
                             "short_text": SHORT_PROMPT}

        progress("TCP loopback round trip")
        report["tcp_rtt"] = bench_tcp_rtt([8, report["all_sum_bytes"]], tcp_iters)
        progress("control plane: stepPlan frames to a no-op rank")
        report["control_plane"] = bench_control_plane(cp_frames)
        plain = bench_control_plane(cp_frames, tls=False)
        if plain.get("ok"):
            report["control_plane"]["plaintext_frame_median_us"] = plain["frame_median_us"]

        plan = [("mlx-lm", 1, "none"), ("mlxcluster", 1, "none")]
        for b in report["backends"]:
            plan += [("mlx-lm", n, b), ("mlxcluster", n, b), ("all_sum", n, b)]
            plan += [(f"mlxcluster PP {spec}", topology_args(spec)[2], b) for spec in args.topology
                     if not (b == "ring" and "--stage-tp" in spec)]  # the ring cannot split groups
        if args.skip_mlx_lm:
            plan = [p for p in plan if p[0] != "mlx-lm"]
        for impl, world, b in plan:
            key = "ring" if b == "ring" else "other"
            k = plans[key]["decode_tokens"]
            if impl == "all_sum":
                progress(f"all_sum {b} x{world} (and the TCP round trip again, just before it)")
                paired = bench_tcp_rtt([report["all_sum_bytes"]], tcp_iters)
                row = bench_allsum(world, b, report["hidden"], allsum_iters, timeout_s)
                if paired["ok"]:
                    row["tcp_rtt_us"] = paired["by_payload"][str(report["all_sum_bytes"])]["median_us"]
                report["all_sum"].append(row)
                continue
            label = f"{impl} TP={world}" + (f" {b}" if world > 1 else "")
            progress(f"{label}: running ({k} decode tokens, best of {plans[key]['repeats']})")
            if impl == "mlx-lm":
                row = bench_mlxlm(mlx_dir, prompt_files[key], world, b, weights, timeout_s)
            elif impl.startswith("mlxcluster PP "):
                row = bench_mlxcluster(model_ref, weights, plans[key], world, b, timeout_s,
                                       layers=impl[len("mlxcluster PP "):])
            else:
                row = bench_mlxcluster(model_ref, weights, plans[key], world, b if world > 1 else "ring", timeout_s)
            progress(f"{label}: " + ("ok" if row["ok"] else f"FAILED: {row['error']}"))
            report["configs"].append(row)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    rows = {r["name"]: r for r in report["configs"]}
    for r in report["configs"]:
        if r["impl"] != "mlxcluster" or not r["ok"]:
            continue
        ref = rows.get(r["name"].replace("mlxcluster", "mlx-lm"))
        if ref and ref["ok"]:
            a, b = r.get("token_ids") or [], ref.get("token_ids") or []
            same = 0
            while same < min(len(a), len(b)) and a[same] == b[same]:
                same += 1
            r["same_tokens"] = f"{same}/{min(len(a), len(b))}"
    derived = {}
    for b in report["backends"]:
        a, m = rows.get(f"mlxcluster TP={n} {b}"), rows.get(f"mlx-lm TP={n} {b}")
        if a and m and a["ok"] and m["ok"] and a["decode_step_ms"] and m["decode_step_ms"]:
            derived[b] = {"mlxcluster_step_ms": a["decode_step_ms"], "mlx_lm_step_ms": m["decode_step_ms"],
                          "diff_ms": a["decode_step_ms"] - m["decode_step_ms"]}
    report["control_plane"]["derived"] = derived
    report["targets"] = _targets(report)
    report["elapsed_s"] = round(time.time() - t_start, 1)
    report["load_average"] = {"start": load_before, "end": _loadavg()}

    json_path = os.path.join(args.out_dir, "bench.json")
    png_path = os.path.join(args.out_dir, "bench.png")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    chart = png_path
    try:
        if not _chart(report, png_path):
            chart = 'skipped: matplotlib is not installed (pip install -e ".[bench]")'
    except Exception as exc:
        chart = f"failed: {_one_line(str(exc))}"
    print(_markdown(report))
    print(f"\nJSON: {json_path}\nchart: {chart}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        code = _worker_main(sys.argv[2:])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # never wait on threads stuck in a collective
    sys.exit(main())

"""TP decode over a slow control link (issue 42, item 4): loopback, a failpoint delay, a shaped Wi-Fi-like LAN.

Usage (the namespace rows need root and ``ip``; run from the repository root)::

    .venv/bin/python -m benchmarks.bench_control_link [--models small,embedded] [--backends mpi,ring]
        [--streams 1,8] [--links loopback,failpoint,netns] [--tokens 32] [--delay-ms 3]
        [--repeat 3] [--baseline REV] [--small-scale 2 --small-layers 4] [--out FILE]

Rank 0 drives ranks N with one ``stepPlan`` frame per step over gRPC.  This measures a TP=3 group's
decode -- tok/s and inter-token latency (ITL, p50/p99) at 1 and 8 concurrent greedy streams of
``--tokens`` tokens, on MPI and MLX's ring, each measured ``--repeat`` times in one group (the median
run's figures: this 2-core machine is shared) -- with these control links:

* ``loopback``: the ranks on this machine's loopback (:class:`mlxcluster.runtime.launcher.LocalCluster`);
* ``failpoint``: the same, with ``MLXCLUSTER_FAILPOINTS=control.send=delay(D)``: rank 0 delivers every
  step-plan frame ``--delay-ms`` later, without holding its loop (:mod:`mlxcluster.failpoints`);
* ``netns`` (root): three network namespaces (:mod:`benchmarks.netns`), the collectives on one bridge of
  veth pairs (``eth0``: the ring hostfile's addresses, MPI's ``btl_tcp_if_include``), the control link
  on a second one (``lan0``: the ranks' ``--hosts``) with rank 0's host behind :mod:`benchmarks.wire`
  shaped like Wi-Fi: ``--delay-ms`` +- ``--jitter-ms`` one way, ``--late-pct`` % of frames
  ``--late-ms`` late.  Two rows: ``netns-fast`` (the LAN unshaped, the reference) and ``netns-lan``.
  MPI's daemons start in the other namespaces through a launch agent of two lines (``ip netns exec``
  and a UTS namespace of their own, so OpenMPI takes them for other hosts), as
  :mod:`mlxcluster.runtime.mpi_agent` starts them on ``join`` nodes.

Two models: the embedded default (SmolLM2-135M GGUF, ``mlxcluster generate``'s default model) and a
random-weight llama from :mod:`mlxcluster.model.synthetic` (``--small-scale``, ``--small-layers``;
6 heads, 3 KV heads) whose TP=3 decode step here is a few ms, where a control-link round is a visible
share of a step.

``--baseline REV`` checks REV out into a temporary ``git worktree`` and runs every row with that code too,
in the same run: each group is started by a worker process (this file run as a script with
``--worker``) whose ``PYTHONPATH`` and working directory are that tree, so the launcher and the rank
processes import that tree's package (the supervisor puts its own package root first on the ranks'
``PYTHONPATH``).  A tree without ``control.send=delay`` gets no failpoint rows.

Printed: one row per (model, backend, streams, link) and code; tok/s, ITL p50/p99 (ms), the ratio of
tok/s to the reference row (``loopback`` for ``failpoint``, ``netns-fast`` for ``netns-lan``; the same
code's) and whether the greedy tokens equal the reference row's.  Every wait is bounded (group start
``--start-timeout``, each worker ``--worker-timeout``); everything made is removed in ``finally``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence

THIS_FILE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(THIS_FILE))

LINKS = ("loopback", "failpoint", "netns")
#: the row each link is compared with (same model, backend, streams and code)
REFERENCE = {"failpoint": "loopback", "loopback": "loopback", "netns-lan": "netns-fast", "netns-fast": "netns-fast"}
PROMPTS = (
    "The history of the city begins with a small fishing village on the river.",
    "A good recipe for bread needs only flour, water, salt and yeast.",
    "The old lighthouse keeper climbed the stairs every evening at dusk.",
    "In the morning the market square filled with farmers and their carts.",
    "The engineer opened the panel and found the wires in a tangle.",
    "Rain fell on the mountains for three days without a pause.",
    "The library had a reading room with tall windows facing the park.",
    "On the first day of school the children lined up by the gate.",
)
SMALL_CONFIG = {"num_attention_heads": 6, "num_key_value_heads": 3}


# --------------------------------------------------------------------------- pure parts


@dataclass
class Row:
    """One measured row: tok/s (decode, every stream: tokens after each stream's first over the window from
    the first first-token to the last token), ITL percentiles (ms, gaps between a stream's consecutive
    tokens, all streams pooled), each stream's token ids, or ``error``; rank 1's wait for its plans
    (:func:`plan_wait_figures`: ``wait_ms`` per frame, ``waited_pct`` of frames; ``None``: not reported)."""

    model: str
    backend: str
    streams: int
    link: str
    code: str = "current"
    tok_s: Optional[float] = None
    itl_p50_ms: Optional[float] = None
    itl_p99_ms: Optional[float] = None
    tokens: List[List[int]] = field(default_factory=list)
    error: str = ""
    wait_ms: Optional[float] = None
    waited_pct: Optional[float] = None


def percentile(xs: Sequence[float], q: float) -> Optional[float]:
    """The ``q``-th percentile (0-100) of ``xs``, linear between closest ranks (numpy's default); ``None``
    when empty."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def decode_figures(times: Sequence[Sequence[float]]) -> Dict[str, Optional[float]]:
    """``tok_s``, ``itl_p50_ms``, ``itl_p99_ms`` from each stream's token arrival times (seconds, any
    clock).  A stream of fewer than two tokens adds nothing."""
    gaps = [b - a for ts in times for a, b in zip(ts, ts[1:])]
    firsts = [ts[0] for ts in times if ts]
    lasts = [ts[-1] for ts in times if ts]
    window = (max(lasts) - min(firsts)) if firsts else 0.0
    decoded = sum(max(0, len(ts) - 1) for ts in times)
    p50, p99 = percentile(gaps, 50), percentile(gaps, 99)
    return {"tok_s": decoded / window if window > 0 else None,
            "itl_p50_ms": None if p50 is None else p50 * 1e3, "itl_p99_ms": None if p99 is None else p99 * 1e3}


def pooled(runs: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Repeated measurements of one row as one: the median run's figures (by tok/s) and the first run's
    tokens (``[]`` when the runs' tokens differ: not deterministic)."""
    ranked = sorted(runs, key=lambda r: r["tok_s"] or 0.0)
    mid = dict(ranked[len(ranked) // 2])
    mid["tokens"] = runs[0]["tokens"] if all(r["tokens"] == runs[0]["tokens"] for r in runs) else []
    return mid


def median_round(rounds: Sequence[Row]) -> Row:
    """One row of its interleaved rounds: the median round's by tok/s (an errored round counts only when
    every round erred); ``tokens`` ``[]`` when the rounds' tokens differ (not deterministic)."""
    ok = [r for r in rounds if not r.error and r.tok_s]
    if not ok:
        return rounds[0]
    mid = sorted(ok, key=lambda r: r.tok_s)[len(ok) // 2]
    same = all(r.tokens == ok[0].tokens for r in ok)
    return Row(**dict(asdict(mid), tokens=mid.tokens if same else []))


def rank1_waits(events: Sequence[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """Rank 1's latest ``counters`` event (after each leave: its MLX thread's ``plan_waits``), or ``None``
    (none yet, or a tree whose ranks do not report them)."""
    got = [e for e in events if e.get("event") == "counters" and e.get("of_rank") == 1 and "plan_frames" in e]
    return got[-1] if got else None


def plan_wait_figures(before: Optional[Dict[str, Any]], after: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """Over a row's runs (the difference of two :func:`rank1_waits`): ``wait_ms``, the mean milliseconds
    rank 1's MLX thread sat idle before each frame it ran (waiting for the plan), and ``waited_pct``, the
    share of frames that found it idle 1 ms or more; ``{}`` when unknown."""
    if after is None:
        return {}
    b = before or {"plan_frames": 0, "plan_wait_s": 0.0, "plan_waited": 0}
    frames = after["plan_frames"] - b["plan_frames"]
    if frames <= 0:
        return {}
    return {"wait_ms": (after["plan_wait_s"] - b["plan_wait_s"]) / frames * 1e3,
            "waited_pct": 100.0 * (after["plan_waited"] - b["plan_waited"]) / frames}


def _key(r: Row, link: str) -> tuple:
    return (r.model, r.backend, r.streams, link, r.code)


def compare(rows: Sequence[Row]) -> List[Dict[str, Any]]:
    """Each row with ``ratio`` (its tok/s / its reference row's, :data:`REFERENCE`) and ``equal`` (its
    tokens == the reference row's; ``None`` when either is missing)."""
    by = {_key(r, r.link): r for r in rows}
    out = []
    for r in rows:
        ref = by.get(_key(r, REFERENCE.get(r.link, r.link)))
        ok = ref is not None and not ref.error and not r.error
        ratio = r.tok_s / ref.tok_s if ok and r.tok_s and ref.tok_s else None
        out.append(dict(asdict(r), ratio=ratio, equal=(r.tokens == ref.tokens) if ok and r.tokens else None))
    return out


def _f(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _waits(r: Dict[str, Any]) -> str:
    if r.get("wait_ms") is None:
        return "-"
    return f"{r['wait_ms']:.2f} ({r['waited_pct']:.0f}%)"


def table(rows: Sequence[Row]) -> str:
    """The Markdown table: a row per (model, backend, streams, link), and per code (``current``, the
    baseline) its tok/s, ITL p50/p99 ms, ratio to the reference row and tokens equal (or its error)."""
    cmp = compare(rows)
    codes = list(dict.fromkeys(r["code"] for r in cmp))
    keys = list(dict.fromkeys((r["model"], r["backend"], r["streams"], r["link"]) for r in cmp))
    cells = {(r["model"], r["backend"], r["streams"], r["link"], r["code"]): r for r in cmp}
    head = "| model | backend | streams | link |" + "".join(
        f" {c}: tok/s | ITL p50 ms | ITL p99 ms | ratio | tokens equal | rank 1 waits ms/frame (frames %) |"
        for c in codes)
    lines = [head, "|" + "---|" * (4 + 6 * len(codes))]
    for k in keys:
        line = f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} |"
        for c in codes:
            r = cells.get(k + (c,))
            if r is None:
                line += " - | - | - | - | - | - |"
            elif r["error"]:
                line += f" {r['error'][:60]} | - | - | - | - | - |"
            else:
                eq = "-" if r["equal"] is None else ("yes" if r["equal"] else "NO")
                line += (f" {_f(r['tok_s'], '.1f')} | {_f(r['itl_p50_ms'], '.1f')} | {_f(r['itl_p99_ms'], '.1f')} "
                         f"| {_f(r['ratio'], '.2f')} | {eq} | {_waits(r)} |")
        lines.append(line)
    return "\n".join(lines)


def _csv(text: str, allowed: Sequence[str], what: str) -> List[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"--{what}: choose from {', '.join(allowed)}, not {text!r}")
    return items


def _streams(text: str) -> List[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(not 1 <= n <= len(PROMPTS) for n in out):
        raise argparse.ArgumentTypeError(f"--streams: numbers from 1 to {len(PROMPTS)}, not {text!r}")
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The options (see the module docstring); a bad value exits 2 with one line (argparse)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_control_link",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=lambda t: _csv(t, ("small", "embedded"), "models"), default=["small", "embedded"])
    ap.add_argument("--backends", type=lambda t: _csv(t, ("mpi", "ring"), "backends"), default=["mpi", "ring"])
    ap.add_argument("--streams", type=_streams, default=[1, 8])
    ap.add_argument("--links", type=lambda t: _csv(t, LINKS, "links"), default=list(LINKS))
    ap.add_argument("--tokens", type=int, default=32, help="tokens per stream (bounded: 2-512)")
    ap.add_argument("--repeat", type=int, default=3, help="measurements per row, the median's figures (1-20)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="group starts per row, interleaved (round 1 of every row, then round 2, ...): this "
                         "machine drifts +-10-20%% over minutes, so a row's figures are the median round's (1-9)")
    ap.add_argument("--delay-ms", type=float, default=3.0, help="one-way delay of the failpoint and the LAN, ms")
    ap.add_argument("--jitter-ms", type=float, default=1.0, help="the LAN's jitter (uniform +-), ms")
    ap.add_argument("--late-pct", type=float, default=1.0, help="the LAN's share of late frames, %%")
    ap.add_argument("--late-ms", type=float, default=20.0, help="how late a late frame is, ms")
    ap.add_argument("--baseline", default="", help="git revision to run the same rows with, side by side")
    ap.add_argument("--lookahead-off", action="store_true",
                    help="also run this tree with MLXCLUSTER_LOOKAHEAD=off (every step read before the next)")
    ap.add_argument("--world-size", type=int, default=3, choices=(2, 3),
                    help="ranks in the group (2: the small model only; on 2 cores one core per rank)")
    ap.add_argument("--small-scale", type=int, default=2, help="the small model's width multiplier (x96 hidden)")
    ap.add_argument("--small-layers", type=int, default=4, help="the small model's layers")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds a group may take to start")
    ap.add_argument("--worker-timeout", type=float, default=900.0, help="seconds one worker (one group) may take")
    ap.add_argument("--out", default="", help="write the rows as JSON here")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not 2 <= args.tokens <= 512:
        ap.error(f"--tokens must be from 2 to 512, not {args.tokens}")
    if not 1 <= args.repeat <= 20:
        ap.error(f"--repeat must be from 1 to 20, not {args.repeat}")
    if args.world_size == 2 and "embedded" in args.models:
        ap.error("--world-size 2: the embedded model (3 KV heads) splits at TP=3 only; use --models small")
    if not 1 <= args.rounds <= 9:
        ap.error(f"--rounds must be from 1 to 9, not {args.rounds}")
    if not 0 <= args.delay_ms <= 10_000:
        ap.error(f"--delay-ms must be from 0 to 10000, not {args.delay_ms:g}")
    return args


# --------------------------------------------------------------------------- the worker (one tree's code)


def _measure(address: str, creds, streams: int, tokens: int, timeout_s: float) -> Dict[str, Any]:
    """``streams`` concurrent greedy generations of ``tokens`` tokens: figures and token ids."""
    from mlxcluster.leader.generation import GenerationClient

    def one(i: int):
        client = GenerationClient(address, creds, timeout_s=timeout_s)
        ids, times = [], []
        try:
            for event in client.stream(PROMPTS[i], max_tokens=tokens, temperature=0.0):
                if event.WhichOneof("event") == "token":
                    ids.append(event.token.token_id)
                    times.append(time.perf_counter())
        finally:
            client.close()
        return ids, times

    with cf.ThreadPoolExecutor(streams) as pool:
        got = list(pool.map(one, range(streams)))
    return dict(decode_figures([t for _, t in got]), tokens=[ids for ids, _ in got])


def _netns_processes(spec: Dict[str, Any], cmd: List[str], env: Dict[str, str], workdir: str) -> List[tuple]:
    """``(name, argv, env)`` of the ranks in the namespaces of ``spec["netns"]`` (this worker runs in the
    first): ring ranks under ``ip netns exec``, or one ``mpirun`` whose daemons a launch agent starts there."""
    from mlxcluster.runtime import backends as bk
    from mlxcluster.runtime.launcher import free_ports

    net = spec["netns"]
    world = len(net["ns"])
    ring_ports = free_ports(world)
    eps = [bk.RankEndpoint(rank=r, address=net["data"][r], ring_port=p, control_port=p)
           for r, p in enumerate(ring_ports)]
    if spec["backend"] == "ring":
        return [(f"rank {r}", ["ip", "netns", "exec", net["ns"][r]] + cmd,
                 dict(env, **bk.write_backend_files("ring", eps, r, workdir))) for r in range(world)]
    agent = os.path.join(workdir, "netns_agent.sh")
    cases = "".join(f"  {net['data'][r]}) ns={net['ns'][r]};;\n" for r in range(1, world))
    with open(agent, "w") as f:  # mpirun runs: AGENT HOST orted ARGS (as ssh would)
        f.write(f'#!/bin/sh\nhost=$1; shift\ncase $host in\n{cases}  *) exit 255;;\nesac\n'
                f'exec ip netns exec $ns unshare --uts sh -c "hostname mlxc-$host; exec $*"\n')
    os.chmod(agent, 0o755)
    hostfile = os.path.join(workdir, "mpi_hosts")
    with open(hostfile, "w") as f:
        f.write("".join(f"{ip} slots=1\n" for ip in net["data"]))
    env = dict(env, **bk.mpi_library_environment())
    for name, value in bk.mpi_process_environment().items():
        env.setdefault(name, value)
    exported = [n for n in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS", "PYTHONPATH", "PYTHONUNBUFFERED",
                            "MLXCLUSTER_SECRET", "MLXCLUSTER_CLUSTER", "MLXCLUSTER_CA_SEED", "MLXCLUSTER_FAILPOINTS",
                            "MLX_MPI_LIBNAME") if n in env]
    mca = ["--mca", "plm_rsh_agent", agent, "--mca", "plm_rsh_no_tree_spawn", "1",
           "--mca", "orte_leave_session_attached", "1",  # a daemon that dies fails the start (as mpi_agent)
           "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0", "--oversubscribe"]
    return [("mpirun", bk.mpirun_command(hostfile, world, cmd, exported, extra_args=mca), env)]


@contextlib.contextmanager
def _group(spec: Dict[str, Any]) -> Iterator[tuple]:
    """The group of ``spec`` (``world`` ranks, TP): yields ``(rank 0's address, client credentials)``; stopped on exit."""
    from mlxcluster.runtime.launcher import LOCAL_CLUSTER, LocalCluster, free_ports
    from mlxcluster.runtime.rank_config import RankConfig
    from mlxcluster.runtime.supervisor import Supervisor, rank_command, rank_env
    from mlxcluster.security import CLIENT, credentials, new_secret, rank_environment

    if not spec.get("netns"):
        with LocalCluster(spec.get("world", 3), spec["backend"], model=spec["model_path"], weights="float32",
                          start_timeout_s=spec["start_timeout"]) as cluster:
            yield cluster.address, cluster.credentials, lambda: cluster.events
        return
    net = spec["netns"]
    secret = new_secret()
    world = spec.get("world", 3)
    ports = free_ports(world)
    hosts = (net["lan"],) if isinstance(net["lan"], str) else tuple(net["lan"])
    cmd = rank_command(RankConfig(world_size=world, ports=tuple(ports), backend=spec["backend"], hosts=hosts,
                                  bind="0.0.0.0", model=spec["model_path"], weights="float32"))
    env = rank_env(world, rank_environment(secret, LOCAL_CLUSTER))
    sup = Supervisor()
    workdir = tempfile.mkdtemp(prefix="mlxc-ctl-")
    try:
        for name, argv, penv in _netns_processes(spec, cmd, env, workdir):
            sup.spawn(argv, penv, name)
        sup.wait_ready(world, spec["start_timeout"])
        yield f"127.0.0.1:{ports[0]}", credentials(secret, LOCAL_CLUSTER, [CLIENT]), lambda: sup.events
    finally:
        sup.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def worker(spec: Dict[str, Any]) -> int:
    """Start one group with this tree's code and measure each streams count; prints one JSON line of rows."""
    from mlxcluster import failpoints

    rows = []
    fault = spec.get("failpoint", "")
    try:
        if fault:
            failpoints.parse(fault)  # a tree without the failpoint refuses it
            os.environ["MLXCLUSTER_FAILPOINTS"] = fault
        os.environ.update(spec.get("env", {}))  # the ranks read it (a tree that does not know a setting ignores it)
        with _group(spec) as (address, creds, events):
            _measure(address, creds, 1, 4, 120.0)  # warm-up
            for n in spec["streams"]:
                before = rank1_waits(events())
                runs = [_measure(address, creds, n, spec["tokens"], 300.0) for _ in range(spec.get("repeat", 1))]
                rows.append(dict(streams=n, **pooled(runs), **plan_wait_figures(before, rank1_waits(events()))))
    except Exception as exc:  # noqa: BLE001 -- reported in the table, one line
        rows.append(dict(streams=0, error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))
    print("@@rows " + json.dumps(rows), flush=True)
    return 0


# --------------------------------------------------------------------------- the driver


def run_worker(tree: str, spec: Dict[str, Any], timeout_s: float, netns: str = "") -> List[Dict[str, Any]]:
    """Run :func:`worker` with ``tree``'s package (cwd and ``PYTHONPATH`` = ``tree``; in namespace
    ``netns`` when given); its rows, or one error row."""
    env = dict(os.environ, PYTHONPATH=tree)
    env.pop("MLXCLUSTER_FAILPOINTS", None)
    argv = [sys.executable, THIS_FILE, "--worker", json.dumps(spec)]
    if netns:
        argv = ["ip", "netns", "exec", netns] + argv
    try:
        out = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [dict(streams=0, error=f"the worker took over {timeout_s:.0f} s")]
    for line in out.stdout.splitlines():
        if line.startswith("@@rows "):
            return json.loads(line[len("@@rows "):])
    tail = (out.stderr or out.stdout).strip().splitlines()
    return [dict(streams=0, error=f"worker exited {out.returncode}: {tail[-1][:200] if tail else ''}")]


@contextlib.contextmanager
def baseline_tree(rev: str) -> Iterator[str]:
    """``rev`` checked out in a temporary ``git worktree`` (detached); removed on exit.

    Raises:
        SystemExit: ``rev`` is not a revision of this repository (one line)."""
    path = tempfile.mkdtemp(prefix="mlxc-baseline-")
    os.rmdir(path)
    made = subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", path, rev],
                          capture_output=True, text=True, timeout=120)
    if made.returncode:
        raise SystemExit(f"--baseline {rev}: {made.stderr.strip().splitlines()[-1] if made.stderr else 'git failed'}")
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", path], capture_output=True, timeout=120)


def small_model(workdir: str, scale: int, layers: int, world: int = 3) -> str:
    """The small random-weight llama (hidden 96 x ``scale``, MLP 192 x ``scale``, 6 heads of 16 x ``scale``, 3 KV
    heads -- 2 at ``world`` 2 -- so TP at ``world`` splits it), written once under ``workdir``."""
    from mlxcluster.model.synthetic import write_model

    out = os.path.join(workdir, f"small-s{scale}-l{layers}-w{world}")
    if not os.path.exists(os.path.join(out, "config.json")):
        write_model("llama", out, scale=scale, layers=layers, overrides=dict(
            SMALL_CONFIG, hidden_size=96 * scale, head_dim=16 * scale, intermediate_size=192 * scale,
            num_key_value_heads=3 if world % 3 == 0 else 2))
    return out


@contextlib.contextmanager
def lan(args, shaped: bool) -> Iterator[Dict[str, Any]]:
    """Three hosts: collectives' bridge and a LAN bridge (rank 0's host behind the wire when ``shaped``)."""
    from benchmarks.netns import bridged_hosts, second_link, slow_wire

    with bridged_hosts(args.world_size) as hosts, second_link(hosts) as (lan_ns, lan_ips), contextlib.ExitStack() as stack:
        if shaped:
            tag = hosts[0][0][4:8]
            stack.enter_context(slow_wire(hosts, 0, args.delay_ms, 0.0, bridge_ns=lan_ns, end=f"lx{tag}0b",
                                          wire_args=["--jitter-ms", str(args.jitter_ms), "--late-pct",
                                                     str(args.late_pct), "--late-ms", str(args.late_ms)]))
        yield {"ns": [h[0] for h in hosts], "data": [h[1] for h in hosts], "lan": lan_ips}


def plan(args) -> List[tuple]:
    """``(link label, failpoint, netns kind)`` of each group to start (netns kind: "", "fast" or "lan")."""
    out = []
    if "loopback" in args.links:
        out.append(("loopback", "", ""))
    if "failpoint" in args.links:
        out.append(("failpoint", f"control.send=delay({args.delay_ms:g})", ""))
    if "netns" in args.links:
        out += [("netns-fast", "", "fast"), ("netns-lan", "", "lan")]
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    from benchmarks.common import exit_on_sigterm, machine_description

    exit_on_sigterm()
    rows: List[Row] = []
    work = tempfile.mkdtemp(prefix="mlxc-ctl-bench-")
    try:
        with contextlib.ExitStack() as stack:
            trees = [("current", ROOT, {})]
            if args.lookahead_off:
                trees.append(("current, lookahead off", ROOT, {"MLXCLUSTER_LOOKAHEAD": "off"}))
            if args.baseline:
                trees.append((f"baseline {args.baseline}", stack.enter_context(baseline_tree(args.baseline)), {}))
            models = {"small": small_model(work, args.small_scale, args.small_layers, args.world_size)
                      if "small" in args.models else None, "embedded": None}
            for model in args.models:
                for backend in args.backends:
                    rounds: Dict[tuple, List[Row]] = {}
                    for _ in range(args.rounds):  # interleaved: each round runs every row once
                        for link, fault, kind in plan(args):
                            for code, tree, env in trees:
                                spec = dict(model_path=models[model], backend=backend, streams=args.streams,
                                            tokens=args.tokens, failpoint=fault, start_timeout=args.start_timeout,
                                            repeat=args.repeat, world=args.world_size, env=env)
                                print(f"-- {model} {backend} {link} ({code})", file=sys.stderr, flush=True)
                                if kind:
                                    with lan(args, kind == "lan") as net:
                                        got = run_worker(tree, dict(spec, netns=net), args.worker_timeout, net["ns"][0])
                                else:
                                    got = run_worker(tree, spec, args.worker_timeout)
                                for g in got:
                                    for n in (args.streams if g.get("error") else [g["streams"]]):
                                        row = Row(model, backend, n, link, code, g.get("tok_s"), g.get("itl_p50_ms"),
                                                  g.get("itl_p99_ms"), g.get("tokens", []), g.get("error", ""),
                                                  g.get("wait_ms"), g.get("waited_pct"))
                                        rounds.setdefault((n, link, code), []).append(row)
                                        print(json.dumps(asdict(row))[:300], file=sys.stderr)
                    rows.extend(median_round(rs) for rs in rounds.values())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nMachine: {machine_description()}; TP={args.world_size}; {args.tokens} tokens per stream, median of {args.repeat} "
          f"in a group, median group of {args.rounds} interleaved; "
          f"small model: llama x{args.small_scale}, "
          f"{args.small_layers} layers; link: {args.delay_ms:g} ms one way (LAN: +-{args.jitter_ms:g} ms, "
          f"{args.late_pct:g}% {args.late_ms:g} ms late)\n")
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine_description(), "args": vars(args), "rows": compare(rows)}, f, indent=1)
    return 0


if __name__ == "__main__":
    if "--worker" not in sys.argv and ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    if "--worker" in sys.argv and sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(THIS_FILE):
        sys.path.pop(0)  # the worker imports the package of its tree (PYTHONPATH), not this file's folder
    sys.exit(main())

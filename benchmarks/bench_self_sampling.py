#!/usr/bin/env python3
"""Self-sampled against frame-driven decode at TP=N (issue 27, item 3), measured in one run.

For each backend (``mpi``, ``ring``) two local TP=N groups are started once, through the
launcher every other benchmark uses (:class:`mlxcluster.runtime.launcher.LocalCluster`), and
kept warm side by side:

  * ``self``: the ranks' default: a lone sequence is self-sampled (every rank samples the
    same token from the replicated logits; rank 0's stepToken frames only confirm and permit);
  * ``frame``: ranks started ``--frame-driven`` (ranks N wait for each stepToken/batchStep
    carrying rank 0's token).

Four workloads run on each: 1 stream greedy, 1 stream seeded (temperature 0.8, fixed seed),
N streams greedy and N streams seeded (``--streams``, 8: concurrent requests, seed + i for stream
i).  The scheduler self-samples only a lone sequence, so the N-stream rows run the batched,
frame-driven path in both groups (at most a first stream admitted alone is self-sampled until
the second joins): they are the control, their difference is the noise of identical code.  The
two groups alternate: repetition r runs every workload on one group, then on the other,
and the order flips each repetition (self, frame / frame, self / ...), so slow drifts of the
machine's load fall on both.  Only one group computes at a time; the CPU seconds the idle group
used during each measurement are recorded (``idle_group_cpu_s``).

Figures: decode tokens/s and ms per decode step, from the client's own token arrival times
(1 stream: first to last token; N streams: the window in which all N streams are decoding, i.e.
from the last stream's first token to the first stream's last token, tokens of every stream
arriving in it, per step = window / (tokens / N)).  Rank 0's own figure (``GenerateDone``) is
kept in the JSON.  Per row: mean, stdev, min-max of the repetitions per mode, the difference
self minus frame (tokens/s and ms/step), the noise (the larger of the two modes' min-max
range of ms/step), whether |difference| exceeds it and whether every paired repetition agrees
in sign.  Token equality: every run's token ids of one workload, both modes, all repetitions,
must be identical (greedy and seeded).

Prints a Markdown report and writes ``self_sampling.json`` into ``--out-dir``.  Every request
runs under the gRPC deadline, every N-stream run under a join timeout, the whole run under
``--budget`` seconds (later repetitions are skipped, and said so), and both groups are stopped
in ``finally`` (SIGTERM/SIGINT included).

Usage::

    python benchmarks/bench_self_sampling.py [--world-size 3] [--backends mpi,ring]
        [--decode-tokens 64] [--ring-decode-tokens 16] [--repeats 3] [--ring-repeats 3]
        [--streams 8] [--temperature 0.8] [--seed 1234] [--budget 900] [--quick] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # python benchmarks/bench_self_sampling.py from an uninstalled checkout
    sys.path.insert(0, ROOT)

from benchmarks.common import machine_description  # noqa: E402

__all__ = ["main"]

# The prompt of benchmarks/bench.py's decode rows (greedy runs well past 128 tokens without EOS).
PROMPT = "Once upon a time, in a small village at the edge of a great forest, there lived"
WARM_PROMPT = "Hello, world."
MODES = ("self", "frame")
MODE_LABEL = {"self": "self-sampled", "frame": "frame-driven"}


def _prompts(streams: int) -> List[str]:
    """One prompt per concurrent stream (distinct openers: no two streams share a prompt)."""
    return [PROMPT] if streams == 1 else [f"Story {i + 1}. {PROMPT}" for i in range(streams)]


# ---------------------------------------------------------------------------
# one measured run
# ---------------------------------------------------------------------------

def _one_stream(client, prompt: str, max_tokens: int, temperature: float, seed: int) -> Dict[str, Any]:
    """One request; the arrival time of every token (perf_counter) and rank 0's figures."""
    times: List[float] = []
    ids: List[int] = []
    out: Dict[str, Any] = {}
    for event in client.stream(prompt, max_tokens=max_tokens, temperature=temperature, seed=seed):
        kind = event.WhichOneof("event")
        if kind == "token":
            times.append(time.perf_counter())
            ids.append(event.token.token_id)
        elif kind == "done":
            out["server_decode_tokens_per_s"] = event.done.decode_tokens_per_s
            out["ttft_s"] = event.done.ttft_s
            out["reason"] = event.done.reason
    out.update(token_ids=ids, times=times)
    return out


def run_workload(client, streams: int, max_tokens: int, temperature: float, seed: int,
                 timeout_s: float, measure: bool = True) -> Dict[str, Any]:
    """``streams`` concurrent requests started together; decode tokens/s and ms per step
    (``measure=False``: a warm-up, only run).

    Raises:
        RuntimeError: a request failed, or did not finish within ``timeout_s``.
    """
    prompts = _prompts(streams)
    results: List[Optional[Dict[str, Any]]] = [None] * streams
    errors: List[str] = []
    gate = threading.Barrier(streams)

    def one(i: int) -> None:
        try:
            gate.wait(timeout=30)
            results[i] = _one_stream(client, prompts[i], max_tokens, temperature, seed + i)
        except Exception as exc:  # noqa: BLE001 -- reported as the run's one-line error
            errors.append(f"stream {i}: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[-1][:200]}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"{streams}-stream run did not finish within {timeout_s:.0f} s")
    if errors or any(r is None for r in results):
        raise RuntimeError("; ".join(errors) or "a stream returned nothing")
    wall = time.perf_counter() - t0
    rs: List[Dict[str, Any]] = [r for r in results if r is not None]
    if not measure:
        return {"wall_s": wall}
    if any(len(r["times"]) < 2 for r in rs):
        raise RuntimeError("a stream produced fewer than 2 tokens: no decode step to time")
    start = max(r["times"][0] for r in rs)   # every stream has its first token (prefilled, decoding)
    end = min(r["times"][-1] for r in rs)    # no stream has finished yet
    tokens = sum(1 for r in rs for t in r["times"] if start < t <= end)
    window = end - start
    if window <= 0 or tokens < streams:
        raise RuntimeError(f"no window in which all {streams} streams decode (streams ended early?)")
    tps = tokens / window
    return {
        "decode_tokens_per_s": tps,
        "step_ms": 1000.0 * window / (tokens / streams),
        "window_s": window, "window_tokens": tokens, "wall_s": wall,
        "generated": [len(r["token_ids"]) for r in rs],
        "reasons": [r.get("reason") for r in rs],
        "server_decode_tokens_per_s": [r.get("server_decode_tokens_per_s") for r in rs],
        "ttft_s": [r.get("ttft_s") for r in rs],
        "token_ids": [r["token_ids"] for r in rs],
    }


# ---------------------------------------------------------------------------
# the idle group's CPU time (it shares the 2 cores with the measured one)
# ---------------------------------------------------------------------------

def _proc_tree_cpu_s(roots: Sequence[int]) -> float:
    """utime + stime (s) of ``roots`` and all their descendants (Linux /proc; 0.0 elsewhere)."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        parent: Dict[int, int] = {}
        cpu: Dict[int, float] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(name)] = int(rest[1])
            cpu[int(name)] = (int(rest[11]) + int(rest[12])) / tick
    except (OSError, ValueError, IndexError):
        return 0.0
    keep = set(r for r in roots if r in cpu)
    grew = True
    while grew:
        grew = False
        for pid, ppid in parent.items():
            if ppid in keep and pid not in keep:
                keep.add(pid)
                grew = True
    return sum(cpu[p] for p in keep)


def _tree_pids(roots: Sequence[int]) -> List[int]:
    """``roots`` and their descendants now (Linux /proc)."""
    parent: Dict[int, int] = {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parent[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    keep = set(roots)
    grew = True
    while grew:
        grew = False
        for pid, ppid in parent.items():
            if ppid in keep and pid not in keep:
                keep.add(pid)
                grew = True
    return sorted(keep)


def _alive(pid: int, epoch: str) -> bool:
    """Whether ``pid`` still runs a process of the group of ``epoch`` (its ``--epoch`` on the
    command line: a recycled pid is not ours; a zombie does not run)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if epoch.encode() not in f.read():
                return False
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _cluster_pids(cluster) -> List[int]:
    try:
        return [p.pid for p in cluster.procs]
    except Exception:  # noqa: BLE001
        return []


# ---------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------

def _summary(xs: Sequence[float]) -> Dict[str, Any]:
    xs = list(xs)
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "mean": statistics.fmean(xs), "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs), "values": xs}


def compare(runs: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Any]:
    """Self minus frame for one workload: means, the noise and whether the difference beats it."""
    tps = {m: _summary([r["decode_tokens_per_s"] for r in runs[m]]) for m in MODES}
    ms = {m: _summary([r["step_ms"] for r in runs[m]]) for m in MODES}
    out: Dict[str, Any] = {"tokens_per_s": tps, "step_ms": ms}
    if tps["self"]["n"] == 0 or tps["frame"]["n"] == 0:
        return out
    diff_tps = tps["self"]["mean"] - tps["frame"]["mean"]
    diff_ms = ms["self"]["mean"] - ms["frame"]["mean"]
    noise_ms = max(ms[m]["max"] - ms[m]["min"] for m in MODES)
    noise_tps = max(tps[m]["max"] - tps[m]["min"] for m in MODES)
    # repetition r of both modes ran next to each other: their differences are paired
    frame_by_rep = {r["rep"]: r for r in runs["frame"]}
    pairs = [a["step_ms"] - frame_by_rep[a["rep"]]["step_ms"] for a in runs["self"] if a["rep"] in frame_by_rep]
    out.update(diff_tokens_per_s=diff_tps, diff_step_ms=diff_ms, diff_pct=100.0 * diff_tps / tps["frame"]["mean"],
               noise_step_ms=noise_ms, noise_tokens_per_s=noise_tps,
               paired_diff_step_ms=pairs, pairs_self_faster=sum(1 for d in pairs if d < 0), pairs=len(pairs),
               beyond_noise=abs(diff_ms) > noise_ms,
               self_wins_beyond_noise=diff_ms < 0 and abs(diff_ms) > noise_ms and all(d < 0 for d in pairs))
    return out


def token_equality(runs: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Any]:
    """Whether every run of the workload (both modes, every repetition) produced the same token ids."""
    seqs = [(m, json.dumps(r["token_ids"])) for m in MODES for r in runs[m]]
    if not seqs:
        return {"identical": None, "runs": 0}
    ref = seqs[0][1]
    same_modes = all(s == ref for _, s in seqs)
    per_mode = {m: len({s for mm, s in seqs if mm == m}) == 1 for m in MODES if any(mm == m for mm, _ in seqs)}
    return {"identical": same_modes, "runs": len(seqs), "each_mode_repeatable": per_mode,
            "tokens_per_stream": json.loads(ref) and [len(x) for x in json.loads(ref)]}


# ---------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------

def _parse(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_self_sampling.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model reference (default: the embedded default model)")
    p.add_argument("--weights", default=None, help="weight format (default: the platform's, float32 on Linux)")
    p.add_argument("--world-size", type=int, default=3)
    p.add_argument("--backends", default="mpi,ring")
    p.add_argument("--decode-tokens", type=int, default=None, help="tokens per request on mpi (64; quick 12)")
    p.add_argument("--ring-decode-tokens", type=int, default=None, help="tokens per request on the ring (16; quick 6)")
    p.add_argument("--repeats", type=int, default=None, help="alternating repetitions per mode on mpi (3; quick 2)")
    p.add_argument("--ring-repeats", type=int, default=None, help="... on the ring (3; quick 2)")
    p.add_argument("--streams", type=int, default=8, help="concurrent streams of the batched rows")
    p.add_argument("--temperature", type=float, default=0.8, help="temperature of the seeded rows")
    p.add_argument("--seed", type=int, default=1234, help="seed of the seeded rows (stream i: seed + i)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole run: repetitions that would start later are skipped (900; quick 300)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request / per group start")
    p.add_argument("--quick", action="store_true", help="a smoke run: few tokens, 2 repetitions")
    p.add_argument("--out-dir", default="bench-out")
    return p.parse_args(argv)


def _git_state() -> Dict[str, Any]:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.split("\n")
        return {"commit": rev, "modified": [l[3:] for l in dirty if l.strip()]}
    except (OSError, subprocess.SubprocessError):
        return {}


def _loadavg() -> Optional[List[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def bench_backend(backend: str, args, weights: str, model: str, tokens: int, repeats: int,
                  deadline: float, progress) -> Dict[str, Any]:
    """Both groups of one backend, started once; the alternating repetitions of every workload."""
    from mlxcluster.leader.generation import GenerationClient
    from mlxcluster.runtime.launcher import LocalCluster

    n = args.world_size
    workloads = [(1, 0.0), (1, args.temperature), (args.streams, 0.0), (args.streams, args.temperature)]
    out: Dict[str, Any] = {"backend": backend, "decode_tokens": tokens, "repeats_planned": repeats,
                           "ok": False, "error": None, "startup_s": {}, "skipped": [], "failed_runs": [],
                           "workloads": []}
    clusters: Dict[str, Any] = {}
    clients: Dict[str, Any] = {}
    runs: Dict[str, Dict[str, List[Dict[str, Any]]]] = {
        f"{s}x{t}": {m: [] for m in MODES} for s, t in workloads}
    try:
        for mode in MODES:
            progress(f"{backend}: starting TP={n} {MODE_LABEL[mode]}")
            t0 = time.perf_counter()
            c = LocalCluster(n, backend, model=model, weights=weights, start_timeout_s=args.timeout,
                             step_timeout_s=min(args.timeout, 120.0),
                             rank_args=["--frame-driven"] if mode == "frame" else [])
            clusters[mode] = c
            c.start()
            out["startup_s"][mode] = round(time.perf_counter() - t0, 2)
            clients[mode] = GenerationClient(c.address, c.credentials, timeout_s=args.timeout)
        for mode in MODES:  # warm-up: one run of each shape (batch 1, batch N) on each group
            progress(f"{backend}: warm-up {MODE_LABEL[mode]}")
            run_workload(clients[mode], 1, 4, 0.0, args.seed, args.timeout, measure=False)
            run_workload(clients[mode], args.streams, 8, args.temperature, args.seed, args.timeout, measure=False)
        out["pids"] = {m: _tree_pids(_cluster_pids(c)) for m, c in clusters.items()}
        rep_s = 0.0
        for rep in range(repeats):
            # a whole repetition or none: both modes of a workload stay paired
            if time.monotonic() + rep_s > deadline:
                out["skipped"].append(f"repetitions {rep + 1}-{repeats}: they would end past the --budget")
                progress(f"{backend}: skipping repetitions {rep + 1}-{repeats} (budget)")
                break
            t_rep = time.monotonic()
            order = MODES if rep % 2 == 0 else MODES[::-1]
            for streams, temp in workloads:
                key = f"{streams}x{temp}"
                for mode in order:
                    other = clusters["frame" if mode == "self" else "self"]
                    idle0 = _proc_tree_cpu_s(_cluster_pids(other))
                    try:
                        r = run_workload(clients[mode], streams, tokens, temp, args.seed, args.timeout)
                    except RuntimeError as exc:
                        out["failed_runs"].append(f"rep {rep + 1} {key} {mode}: {exc}")
                        progress(f"{backend} rep {rep + 1} {key} {MODE_LABEL[mode]}: run failed: {exc}")
                        if len(out["failed_runs"]) > 3 or clusters[mode].failure:
                            raise
                        continue
                    r["idle_group_cpu_s"] = round(_proc_tree_cpu_s(_cluster_pids(other)) - idle0, 3)
                    r["rep"], r["load"] = rep + 1, _loadavg()
                    runs[key][mode].append(r)
                    progress(f"{backend} rep {rep + 1}/{repeats} {streams} stream(s) "
                             f"{'greedy' if temp == 0 else f'seeded T={temp}'} {MODE_LABEL[mode]}: "
                             f"{r['decode_tokens_per_s']:.2f} tok/s, {r['step_ms']:.1f} ms/step "
                             f"(idle group {r['idle_group_cpu_s']:.2f} CPU s)")
            rep_s = time.monotonic() - t_rep
        out["ok"] = True
    except Exception as exc:  # noqa: BLE001 -- reported, the other backend still runs
        out["error"] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[-1][:300]}"
        progress(f"{backend}: FAILED: {out['error']}")
    finally:
        for cl in clients.values():
            try:
                cl.close()
            except Exception:  # noqa: BLE001
                pass
        for mode, c in clusters.items():
            progress(f"{backend}: stopping {MODE_LABEL[mode]}")
            c.stop()
        left = sorted(p for m, pids in out.get("pids", {}).items() for p in pids if _alive(p, clusters[m].epoch))
        out["processes_left"] = left
        progress(f"{backend}: processes left after stop: {left or 'none'}")
    for streams, temp in workloads:
        key = f"{streams}x{temp}"
        w = {"streams": streams, "temperature": temp, "seed": args.seed if temp else None,
             "label": f"{streams} stream{'s' if streams > 1 else ''} {'greedy' if temp == 0 else f'seeded T={temp}'}"}
        w.update(compare(runs[key]))
        w["tokens"] = token_equality(runs[key])
        w["runs"] = {m: [{k: v for k, v in r.items() if k != "token_ids"} for r in runs[key][m]] for m in MODES}
        w["token_ids"] = {m: runs[key][m][0]["token_ids"] if runs[key][m] else None for m in MODES}
        out["workloads"].append(w)
    return out


def _markdown(report: Dict[str, Any]) -> str:
    L = ["## Self-sampled vs frame-driven decode, TP=%d" % report["world_size"], "",
         f"Command: `{report['command']}`", "",
         f"Machine: {report['machine']}; model {report['model']} ({report['weights']} weights); "
         f"code {report['git'].get('commit', '?')}"
         + (f" + uncommitted changes in {len(report['git']['modified'])} file(s)" if report["git"].get("modified") else "")
         + f"; load average {report['load_average']['start']} at start, {report['load_average']['end']} at end; "
         f"{report['elapsed_s']:.0f} s.", "",
         "Tokens/s: decode tokens per second from the client's token arrival times (N streams: all N streams "
         "together, in the window where every stream is decoding); ms/step = time per decode step. "
         "Mean ± stdev [min-max] over the alternating repetitions. Δ = self-sampled − frame-driven. "
         "Noise = the larger of the two modes' min-max range of ms/step in this run. Pairs = repetitions in "
         "which self-sampled was faster than the frame-driven run next to it. Only a lone sequence is "
         "self-sampled: the N-stream rows run the batched path in both groups (a control).", "",
         "| backend | workload | tokens | reps | self-sampled tok/s | frame-driven tok/s | self ms/step | "
         "frame ms/step | Δ ms/step (Δ tok/s, %) | noise ms/step | beyond noise? | pairs self faster | "
         "same tokens |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def fmt(s: Dict[str, Any], d: int) -> str:
        if not s.get("n"):
            return "-"
        return f"{s['mean']:.{d}f} ± {s['stdev']:.{d}f} [{s['min']:.{d}f}-{s['max']:.{d}f}]"

    for b in report["backends"]:
        for w in b["workloads"]:
            tps, ms = w.get("tokens_per_s", {}), w.get("step_ms", {})
            eq = w["tokens"]
            same = "-" if eq["identical"] is None else ("yes" if eq["identical"] else "NO") + f" ({eq['runs']} runs)"
            if "diff_step_ms" in w:
                diff = f"{w['diff_step_ms']:+.2f} ({w['diff_tokens_per_s']:+.2f}, {w['diff_pct']:+.1f}%)"
                beyond = ("**yes, self faster**" if w["self_wins_beyond_noise"] else
                          "yes" if w["beyond_noise"] else "no")
                noise, pairs = f"{w['noise_step_ms']:.2f}", f"{w['pairs_self_faster']}/{w['pairs']}"
            else:
                diff = beyond = noise = pairs = "-"
            L.append(f"| {b['backend']} | {w['label']} | {b['decode_tokens']} | {tps.get('self', {}).get('n', 0)}+"
                     f"{tps.get('frame', {}).get('n', 0)} | {fmt(tps.get('self', {}), 2)} | "
                     f"{fmt(tps.get('frame', {}), 2)} | {fmt(ms.get('self', {}), 1)} | {fmt(ms.get('frame', {}), 1)} | "
                     f"{diff} | {noise} | {beyond} | {pairs} | {same} |")
    L.append("")
    for b in report["backends"]:
        idle = [r["idle_group_cpu_s"] for w in b["workloads"] for m in MODES for r in w["runs"][m]]
        L.append(f"- {b['backend']}: groups started in {b['startup_s']} s; "
                 + (f"idle group's CPU during measurements: max {max(idle):.2f} s per run; " if idle else "")
                 + ("ok" if b["ok"] else f"FAILED: {b['error']}")
                 + (f"; skipped: {'; '.join(b['skipped'])}" if b["skipped"] else "")
                 + (f"; failed runs (left out): {'; '.join(b['failed_runs'])}" if b["failed_runs"] else "")
                 + f"; rank processes left after stop: {b.get('processes_left') or 'none'}")
        for w in b["workloads"]:
            eq = w["tokens"]
            if eq["identical"] is not None:
                L.append(f"  - {w['label']}: tokens identical across modes and repetitions: "
                         f"{'yes' if eq['identical'] else 'NO'} ({eq['runs']} runs; each mode repeatable: "
                         f"{eq['each_mode_repeatable']}; tokens per stream {eq['tokens_per_stream']})")
    return "\n".join(L)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    q = args.quick
    mpi_tokens = args.decode_tokens or (12 if q else 64)
    ring_tokens = args.ring_decode_tokens or (6 if q else 16)
    repeats = max(1, args.repeats or (2 if q else 3))
    ring_repeats = max(1, args.ring_repeats or (2 if q else 3))
    budget = args.budget or (300.0 if q else 900.0)
    if args.world_size < 2:
        print("bench_self_sampling: error: --world-size must be at least 2", file=sys.stderr)
        return 2
    if args.streams < 2:
        print("bench_self_sampling: error: --streams must be at least 2", file=sys.stderr)
        return 2
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or any(b not in ("mpi", "ring") for b in backends):
        print("bench_self_sampling: error: --backends: choose from mpi, ring", file=sys.stderr)
        return 2

    from mlxcluster.model.loader import default_weight_format, inspect_model
    from mlxcluster.runtime.launcher import mpirun_path

    t_start = time.monotonic()
    deadline = t_start + budget

    def progress(msg: str) -> None:
        print(f"-- [{time.monotonic() - t_start:6.1f} s] {msg}", file=sys.stderr, flush=True)

    def on_signal(signum, _frame):  # the finally blocks stop the groups
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    info = inspect_model(args.model)
    weights = args.weights or default_weight_format()
    report: Dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/bench_self_sampling.py"] + argv),
        "machine": machine_description(), "model": info.name, "model_path": info.path, "weights": weights,
        "world_size": args.world_size, "git": _git_state(), "load_average": {"start": _loadavg()},
        "settings": {"decode_tokens": mpi_tokens, "ring_decode_tokens": ring_tokens, "repeats": repeats,
                     "ring_repeats": ring_repeats, "streams": args.streams, "temperature": args.temperature,
                     "seed": args.seed, "budget_s": budget, "prompt": PROMPT, "quick": q},
        "backends": [], "skipped": [],
    }
    try:
        for b in backends:
            if b == "mpi" and mpirun_path() is None:
                report["skipped"].append({"backend": b, "reason": "mpirun not installed"})
                progress("skipping mpi: mpirun not installed")
                continue
            report["backends"].append(bench_backend(
                b, args, weights, info.path, ring_tokens if b == "ring" else mpi_tokens,
                ring_repeats if b == "ring" else repeats, deadline, progress))
    except KeyboardInterrupt:
        progress("interrupted: groups stopped; writing what was measured")
    report["elapsed_s"] = time.monotonic() - t_start
    report["load_average"]["end"] = _loadavg()
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "self_sampling.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(_markdown(report))
    print(f"\nJSON: {path}")
    return 0 if all(b["ok"] for b in report["backends"]) else 1


if __name__ == "__main__":
    sys.exit(main())

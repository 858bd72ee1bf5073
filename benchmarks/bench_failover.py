"""Lossless failover under chaos (issue 29): time from a fault to the first replayed token.

Runs the chaos workload of ``tests/chaos_load.py`` (:func:`run_chaos`): 4 clients streaming greedy
chat completions (24 tokens) in a closed loop for ``--seconds``, and every ``--period`` seconds a
victim gets SIGKILL, or SIGSTOP then SIGCONT ``--stop`` seconds later, alternating.  Targets:

* ``serve``: a real ``serve --world-size 3`` on the default model; victims are its ranks (the
  healer restarts the group).
* ``spare``: 4 ``join`` nodes in network namespaces (``--world-size 3``, host-3 ``--spare``) behind
  ``serve --cluster``; victims are the nodes holding a rank (a killed node restarts ``--stop`` s
  later and comes back idle): the group re-forms with the spare.
* ``smaller``: 3 nodes, no ``--world-size``: the survivors re-form at the largest valid size (1
  for SmolLM2's 3 KV heads), and grow back when the node returns.
* ``wait``: 3 nodes, ``--world-size 3 --exact-world-size``: the cluster waits for the node to return.

Healthy nodes under load (issue 48): ``--hog N`` runs N busy loops beside everything (in this
session, so they compete thread for thread with the nodes, serve and the clients) and ``--kinds
SIGSTOP`` freezes only; with a ``join`` target the nodes' logs are read back and every ``lost node X``
line that no fault explains -- neither X nor the node that logged it was faulted in the
``--stop`` + 30 s after a fault -- is a spurious loss (printed, with its reason).  The issue's run:

    .venv/bin/python -m benchmarks.bench_failover --target spare --hog 2 --kinds SIGSTOP --seconds 600 --period 60

Printed: requests, faults, failed and wrong answers (an answer that differs from the same prompt's
fault-free one), the time from each fault to the first token each request in flight at it received
after it (p50, p95, max), and the healer's re-formation times (failure detected -> serving).

    .venv/bin/python -m benchmarks.bench_failover [--target serve|spare|smaller|wait] [--seconds 120]
        [--period 30] [--stop 20] [--hog N] [--kinds SIGKILL,SIGSTOP]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from chaos_load import ChaosCluster, ChaosServe, pct, run_chaos  # noqa: E402  (the chaos tests' own workload)

from mlxcluster.model.loader import default_model_path  # noqa: E402

#: target -> (nodes, --world-size, spares, more join options) of the join cluster
CLUSTERS = {"spare": (4, 3, 1, []), "smaller": (3, None, 0, []), "wait": (3, 3, 0, ["--exact-world-size"])}

#: a node's log line reporting a peer lost (cluster/node.py), with the logging module's asctime
LOST = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ WARNING lost node (\S+): (.*)$", re.M)


def spurious_losses(logs, faults, stop_s, wall_offset, until_t=float("inf")):
    """``(observer, lost node, seconds into the run, reason)`` of every loss in the nodes' ``logs``
    (``{node id: text}``) before ``until_t`` (monotonic: when the nodes began to stop) that no fault
    explains: a fault (monotonic time, victim, kind) of the lost node or of the observer within
    ``stop_s`` + 30 s before it (a thawed node finds its peers silent too).  ``wall_offset``:
    ``time.time() - time.monotonic()`` during the run."""
    out = []
    for observer, text in logs.items():
        for stamp, lost, reason in LOST.findall(text):
            t = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp() - wall_offset
            if t < until_t and not any(v in (lost, observer) and t_f - 1.0 <= t <= t_f + stop_s + 30.0 for t_f, v, _k in faults):
                out.append((observer, lost, t, reason))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", choices=["serve", *CLUSTERS], default="serve", help="what is faulted (see above)")
    ap.add_argument("--seconds", type=float, default=120.0, help="length of the chaos run")
    ap.add_argument("--period", type=float, default=30.0, help="seconds between faults")
    ap.add_argument("--stop", type=float, default=20.0,
                    help="seconds a SIGSTOPped victim stays stopped (and a killed node stays down)")
    ap.add_argument("--seed", type=int, default=29, help="seed of the victim choice")
    ap.add_argument("--backend", default=None, choices=["ring", "mpi"],
                    help="the join nodes' --backend (default: auto, MPI where OpenMPI is installed)")
    ap.add_argument("--no-standby", action="store_true", help="join --no-standby: no rank process started ahead")
    ap.add_argument("--peer-timeout", type=float, default=None, help="join --peer-timeout (default 3 s)")
    ap.add_argument("--logs", default=None, help="keep the join nodes' and serve's logs in this directory")
    ap.add_argument("--hog", type=int, default=0, help="busy loops to run beside the target (CPU starvation)")
    ap.add_argument("--kinds", default="SIGKILL,SIGSTOP", help="the faults, taken in turn (comma-separated)")
    args = ap.parse_args()
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or set(kinds) - {"SIGKILL", "SIGSTOP"}:
        ap.error(f"--kinds {args.kinds!r}: SIGKILL and/or SIGSTOP")
    hogs = []
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: [(h.kill(), h.wait()) for h in hogs])
        if args.target == "serve":
            target = ChaosServe(default_model_path())
        else:
            from benchmarks.netns import bridged_hosts, root_link

            n, world_size, spares, more = CLUSTERS[args.target]
            hosts = stack.enter_context(bridged_hosts(n))
            _if, root_ip = stack.enter_context(root_link(hosts))
            tmp = Path(args.logs) if args.logs else Path(stack.enter_context(tempfile.TemporaryDirectory()))
            tmp.mkdir(parents=True, exist_ok=True)
            target = ChaosCluster(tmp, hosts, root_ip, world_size=world_size, spares=spares, backend=args.backend,
                                  extra=more + (["--no-standby"] if args.no_standby else [])
                                  + (["--peer-timeout", str(args.peer_timeout)] if args.peer_timeout else []))
        # the hog starts once the target serves: the load is on the run, not on forming
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hog)]
        wall_offset = time.time() - time.monotonic()
        stopped, stop = [], target.stop
        target.stop = lambda: (stopped.append(time.monotonic()), stop())  # the losses after it are the stop's
        out = run_chaos(target, args.seconds, period_s=args.period, stop_s=args.stop, seed=args.seed, kinds=kinds)
        logs = {nid: node.text() for nid, node in getattr(target, "nodes", {}).items()}
        if args.logs:
            Path(args.logs, "serve.log").write_text("".join(target.stderr))
    results, reference, gaps = out["results"], out["reference"], out["gaps"]
    failed = sum(1 for r in results if r[6] is not None)
    wrong = sum(1 for r in results if r[6] is None and r[3:5] != reference[r[0]])
    print(f"target {args.target} (backend {args.backend or 'auto'}{', no standby' if args.no_standby else ''}{f', peer timeout {args.peer_timeout:g} s' if args.peer_timeout else ''}"
          f"{f', {args.hog} busy loop(s) on {os.cpu_count()} cores' if args.hog else ''}, {args.seconds:g} s): "
          f"requests {len(results)}  faults {len(out['faults'])} "
          f"({', '.join(f'{k} {name}' for _t, name, k in out['faults'])})  failed {failed}  wrong {wrong}")
    if logs:
        lost_lines = sum(len(LOST.findall(text)) for text in logs.values())
        spurious = spurious_losses(logs, out["faults"], args.stop, wall_offset, stopped[0])
        print(f"node losses logged {lost_lines} (the nodes' stop at the end included), spurious (no fault "
              f"explains them, before the stop) {len(spurious)}")
        for observer, lost, t, reason in spurious[:10]:
            print(f"  spurious: {observer} lost {lost} at {t - out['t_start']:.1f} s: {reason}")
    for r in [r for r in results if r[6] is not None][:3]:
        print(f"  failed: {r[0]!r} at {r[1] - out['t_start']:.1f}-{r[2] - out['t_start']:.1f} s: {r[6][:300]}")
    for t_f, name, kind in out["faults"]:  # each fault's own gaps
        mine = sorted(next((x for x in r[5] if x > t_f), t_f) - t_f for r in results if r[1] < t_f < r[2])
        print(f"  {kind} {name} at {t_f - out['t_start']:.1f} s: {len(mine)} in flight, first token after "
              f"{', '.join(f'{g:.2f}' for g in mine)} s")
    if gaps:
        print(f"fault -> first replayed token: p50 {pct(gaps, 0.5):.2f} s  p95 {pct(gaps, 0.95):.2f} s  "
              f"max {max(gaps):.2f} s  ({len(gaps)} requests in flight at a fault)")
    count = re.search(r"^mlxcluster_provider_reformation_seconds_count (\S+)", out["metrics"], re.M)
    total = re.search(r"^mlxcluster_provider_reformation_seconds_sum (\S+)", out["metrics"], re.M)
    if count and float(count.group(1)):
        print(f"re-formations {float(count.group(1)):.0f}, mean {float(total.group(1)) / float(count.group(1)):.1f} s "
              f"(failure detected -> serving); failover {out['state'].get('failover')}")


if __name__ == "__main__":
    main()

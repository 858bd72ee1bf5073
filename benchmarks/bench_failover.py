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
* ``wait``: 3 nodes, ``--world-size 3``: the cluster waits for the node to return.

Printed: requests, faults, failed and wrong answers (an answer that differs from the same prompt's
fault-free one), the time from each fault to the first token each request in flight at it received
after it (p50, p95, max), and the healer's re-formation times (failure detected -> serving).

    .venv/bin/python -m benchmarks.bench_failover [--target serve|spare|smaller|wait] [--seconds 120]
        [--period 30] [--stop 20]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from chaos_load import ChaosCluster, ChaosServe, pct, run_chaos  # noqa: E402  (the chaos tests' own workload)

from mlxcluster.model.loader import default_model_path  # noqa: E402

#: target -> (nodes, --world-size, spares) of the join cluster
CLUSTERS = {"spare": (4, 3, 1), "smaller": (3, None, 0), "wait": (3, 3, 0)}


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
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        if args.target == "serve":
            target = ChaosServe(default_model_path())
        else:
            from benchmarks.netns import bridged_hosts, root_link

            n, world_size, spares = CLUSTERS[args.target]
            hosts = stack.enter_context(bridged_hosts(n))
            _if, root_ip = stack.enter_context(root_link(hosts))
            tmp = Path(args.logs) if args.logs else Path(stack.enter_context(tempfile.TemporaryDirectory()))
            tmp.mkdir(parents=True, exist_ok=True)
            target = ChaosCluster(tmp, hosts, root_ip, world_size=world_size, spares=spares, backend=args.backend,
                                  extra=(["--no-standby"] if args.no_standby else [])
                                  + (["--peer-timeout", str(args.peer_timeout)] if args.peer_timeout else []))
        out = run_chaos(target, args.seconds, period_s=args.period, stop_s=args.stop, seed=args.seed)
        if args.logs:
            Path(args.logs, "serve.log").write_text("".join(target.stderr))
    results, reference, gaps = out["results"], out["reference"], out["gaps"]
    failed = sum(1 for r in results if r[6] is not None)
    wrong = sum(1 for r in results if r[6] is None and r[3:5] != reference[r[0]])
    print(f"target {args.target} (backend {args.backend or 'auto'}{', no standby' if args.no_standby else ''}{f', peer timeout {args.peer_timeout:g} s' if args.peer_timeout else ''}): requests {len(results)}  faults {len(out['faults'])} "
          f"({', '.join(f'{k} {name}' for _t, name, k in out['faults'])})  failed {failed}  wrong {wrong}")
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

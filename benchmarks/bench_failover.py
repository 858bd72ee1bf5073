"""Lossless failover under chaos (issue 29): time from a fault to the first replayed token.

Runs the chaos workload of ``tests/test_failover.py`` (:func:`run_chaos`): a real ``serve
--world-size 3`` on the default model, 4 clients streaming greedy chat completions (24 tokens) in a
closed loop for ``--seconds``, and every ``--period`` seconds a random rank gets SIGKILL, or SIGSTOP
then SIGCONT ``--stop`` seconds later, alternating.  Printed: requests, faults, failed and wrong
answers (an answer that differs from the same prompt's fault-free one), the time from each fault to
the first token each request in flight at it received after it (p50, p95, max), and the healer's
re-formation times (failure detected -> serving, from ``/metrics``).

    .venv/bin/python -m benchmarks.bench_failover [--seconds 120] [--period 30] [--stop 20]
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from test_failover import _pct, run_chaos  # noqa: E402  (the chaos test's own workload)

from mlxcluster.model.loader import default_model_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=120.0, help="length of the chaos run")
    ap.add_argument("--period", type=float, default=30.0, help="seconds between faults")
    ap.add_argument("--stop", type=float, default=20.0, help="seconds a SIGSTOPped rank stays stopped")
    ap.add_argument("--seed", type=int, default=29, help="seed of the rank choice")
    args = ap.parse_args()
    out = run_chaos(default_model_path(), args.seconds, period_s=args.period, stop_s=args.stop, seed=args.seed)
    results, reference, gaps = out["results"], out["reference"], out["gaps"]
    failed = sum(1 for r in results if r[6] is not None)
    wrong = sum(1 for r in results if r[6] is None and r[3:5] != reference[r[0]])
    print(f"requests {len(results)}  faults {len(out['faults'])} "
          f"({', '.join(f'{k} rank {r}' for _t, r, k in out['faults'])})  failed {failed}  wrong {wrong}")
    if gaps:
        print(f"fault -> first replayed token: p50 {_pct(gaps, 0.5):.2f} s  p95 {_pct(gaps, 0.95):.2f} s  "
              f"max {max(gaps):.2f} s  ({len(gaps)} requests in flight at a fault)")
    count = re.search(r"^mlxcluster_provider_reformation_seconds_count (\S+)", out["metrics"], re.M)
    total = re.search(r"^mlxcluster_provider_reformation_seconds_sum (\S+)", out["metrics"], re.M)
    if count and float(count.group(1)):
        print(f"re-formations {float(count.group(1)):.0f}, mean {float(total.group(1)) / float(count.group(1)):.1f} s "
              f"(failure detected -> serving); failover {out['state'].get('failover')}")


if __name__ == "__main__":
    main()

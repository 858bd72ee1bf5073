"""What a change of the decode batch costs, and whether lookahead overlaps anything, in one process
(no gRPC, no rank process): the engine alone on the embedded model (float32).

Prints, for a batch of B sequences of ~60-token prompts:

* the steady decode step (ms);
* a sequence leaving, then the first decode step after it (ms), and a steady one;
* a sequence joining (its prefill included), then the first decode step after it (ms), and a steady
  one -- with the free rows of ``DecodeBatch`` the leave copies nothing and the join is written into
  the freed row;
* decode tok/s with lookahead on and off, for a lone sequence (the compiled step) and for batches,
  and what ``RankEngine``'s probe decided (``lookahead_off``).

Usage: ``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python
benchmarks/bench_batch_changes.py [--batch 32]`` (OpenBLAS preloaded as the ranks do).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlxcluster.engine.decode import RankEngine  # noqa: E402
from mlxcluster.engine.sampling import Sampling  # noqa: E402
from mlxcluster.model.loader import default_model_path, read_model  # noqa: E402
from mlxcluster.model.tp import build_model  # noqa: E402


def _prompt(i: int, n: int = 60):
    return [1 + (i * 7 + j) % 400 for j in range(n)]


def changes(model, batch: int) -> None:
    eng = RankEngine(model, 2048)
    eng.prefill_many([(f"u{i}", _prompt(i), Sampling(), [], 10_000, 0) for i in range(batch)])

    def step(n: int = 1) -> float:
        t = time.perf_counter()
        for _ in range(n):
            eng.step(lookahead=False)  # steps measured one by one
        return (time.perf_counter() - t) / n * 1e3

    step(8)
    print(f"B={batch}: steady decode step {step(8):.1f} ms", flush=True)
    for k in range(3):
        t = time.perf_counter()
        eng.remove(f"u{k}")
        leave = (time.perf_counter() - t) * 1e3
        print(f"  leave {leave:.1f} ms, first step after {step(1):.1f} ms, then {step(4):.1f} ms "
              f"(free rows {getattr(eng.batch, 'free_rows', '-')})", flush=True)
    for k in range(3):
        t = time.perf_counter()
        eng.prefill(f"n{k}", _prompt(batch + k), Sampling(), [], 10_000)
        join = (time.perf_counter() - t) * 1e3
        print(f"  join (prefill included) {join:.1f} ms, first step after {step(1):.1f} ms, then {step(4):.1f} ms "
              f"(rows reused {getattr(eng.batch, 'rows_reused', '-')})", flush=True)


def lookahead(model, sizes, steps: int = 32) -> None:
    for size in sizes:
        rates = {}
        for mode in ("on", "off", "probed"):
            eng = RankEngine(model, 2048, compile_decode=True)
            if mode == "off":
                eng.lookahead_off = {True, False}
            elif mode == "on":
                eng._probes = {True: [(0.0, 0.0)] * 99, False: [(0.0, 0.0)] * 99}  # never decides: always on
            for i in range(size):
                eng.prefill(f"u{i}", _prompt(i, 8), Sampling(), [], 10_000)
            for _ in range(12):
                eng.step(lookahead=True)
            t = time.perf_counter()
            for _ in range(steps):
                eng.step(lookahead=True)
            rates[mode] = steps * size / (time.perf_counter() - t)
            if mode == "probed":
                rates["decided"] = "off" if (size == 1) in eng.lookahead_off else "on"
        print(f"B={size}: lookahead on {rates['on']:.1f} tok/s, off {rates['off']:.1f} tok/s; "
              f"the probe turned it {rates['decided']}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--changes-only", action="store_true", help="skip the lookahead comparison")
    a = p.parse_args()
    src = read_model(default_model_path())
    model = build_model(src.config, src.weights, src.quantization, "float32")
    changes(model, a.batch)
    if not a.changes_only:
        lookahead(model, [1, 8, a.batch])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What OpenAI's logits processors cost per decoded token.

Greedy decode tok/s of the embedded model with no processor, with a ``logit_bias`` of 10 tokens,
with presence + frequency penalties, and with both, at TP=1 and TP=3 (one local group each;
best of ``--repeats`` runs, 64 tokens after a short prompt).  With a processor the single-rank
compiled greedy step does not apply (the processor runs in the step's graph instead), so
TP=1 also shows the plain step without compilation (``--no-compile``) for a fair comparison.

Usage: python benchmarks/bench_processors.py [--repeats 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    from mlxcluster.model.loader import default_model_path
    from mlxcluster.runtime.launcher import LocalCluster, mpirun_path
    from mlxcluster.serving.generation import GenerationClient

    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args(argv)
    prompt = "Here is a list of the planets in the solar system, with one fact about each:"
    cases = {
        "none": {},
        "logit_bias (10 tokens)": {"logit_bias": {t: -5.0 for t in range(100, 110)}},
        "presence + frequency": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
        "all three": {"logit_bias": {t: -5.0 for t in range(100, 110)}, "presence_penalty": 0.5,
                      "frequency_penalty": 0.5},
    }
    groups = [("TP=1", 1, "ring", []), ("TP=1 --no-compile", 1, "ring", ["--no-compile"]),
              ("TP=3 " + ("mpi" if mpirun_path() else "ring"), 3, "mpi" if mpirun_path() else "ring", [])]
    rows = []
    for name, n, backend, extra in groups:
        with LocalCluster(n, backend, model=default_model_path(), weights="float32", rank_args=extra) as c:
            client = GenerationClient(c.address, c.credentials)
            client.generate(prompt, max_tokens=8, temperature=0)  # warm up
            for case, kw in cases.items():
                best = max(client.generate(prompt, max_tokens=a.tokens, temperature=0, **kw).decode_tokens_per_s
                           for _ in range(a.repeats))
                rows.append({"group": name, "processors": case, "decode_tokens_per_s": round(best, 2)})
                print(f"| {name} | {case} | {best:.2f} |", flush=True)
            client.close()
    json.dump(rows, sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

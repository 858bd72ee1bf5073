"""What OpenAI's logits processors, logprobs and JSON-schema constraints cost per decoded token.

Greedy decode tok/s of the embedded model with no processor, with a ``logit_bias`` of 10 tokens,
with presence + frequency penalties, with both, with logprobs (top 5), and constrained by a JSON
schema (llguidance), at TP=1 and TP=3 (one local group each; best of ``--repeats`` runs, 64
tokens after a short prompt).  With a processor the single-rank compiled greedy step does not
apply (the processor runs in the step's graph instead), so TP=1 also shows the plain step
without compilation (``--no-compile``) for a fair comparison.  A constrained sequence decodes
without lookahead (its next mask needs this token on the host) and is sampled by rank 0 alone;
the grammar's own cost, the mask per token, is timed apart in this process on the tokens of
the constrained answer.

Usage: python benchmarks/bench_processors.py [--repeats 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    from mlxcluster.model.loader import default_model_path
    from mlxcluster.runtime.launcher import LocalCluster, mpirun_path
    from mlxcluster.runtime.rank_config import RankConfig
    from mlxcluster.leader.generation import GenerationClient

    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args(argv)
    prompt = "Here is a list of the planets in the solar system, with one fact about each:"
    from mlxcluster.engine.constraint import json_grammar

    schema = {"type": "object", "properties": {"planets": {"type": "array", "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "fact": {"type": "string"}},
        "required": ["name", "fact"], "additionalProperties": False}}}, "required": ["planets"],
        "additionalProperties": False}
    grammar = json_grammar(schema)
    cases = {
        "none": {},
        "logit_bias (10 tokens)": {"logit_bias": {t: -5.0 for t in range(100, 110)}},
        "presence + frequency": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
        "all three": {"logit_bias": {t: -5.0 for t in range(100, 110)}, "presence_penalty": 0.5,
                      "frequency_penalty": 0.5},
        "logprobs (top 5)": {"logprobs": True, "top_logprobs": 5},
        "json_schema (llguidance)": {"grammar": grammar},
    }
    groups = [("TP=1", 1, "ring", RankConfig()), ("TP=1 --no-compile", 1, "ring", RankConfig(compile=False)),
              ("TP=3 " + ("mpi" if mpirun_path() else "ring"), 3, "mpi" if mpirun_path() else "ring", RankConfig())]
    rows = []
    for name, n, backend, config in groups:
        with LocalCluster(n, backend, model=default_model_path(), weights="float32", config=config) as c:
            client = GenerationClient(c.address, c.credentials)
            client.generate(prompt, max_tokens=8, temperature=0)  # warm up
            for case, kw in cases.items():
                best = max(client.generate(prompt, max_tokens=a.tokens, temperature=0, **kw).decode_tokens_per_s
                           for _ in range(a.repeats))
                rows.append({"group": name, "processors": case, "decode_tokens_per_s": round(best, 2)})
                print(f"| {name} | {case} | {best:.2f} |", flush=True)
            client.close()
    mask_ms = _mask_cost(grammar, prompt, a.tokens)
    print(f"llguidance mask: {mask_ms:.3f} ms per token (median over the constrained answer)", flush=True)
    rows.append({"llguidance_mask_ms_per_token": round(mask_ms, 4)})
    json.dump(rows, sys.stderr)
    return 0


def _mask_cost(grammar: str, prompt: str, tokens: int) -> float:
    """Median ms of one mask (llguidance fill + unpack) along a greedy-like walk of the grammar."""
    import statistics
    import time

    import numpy as np

    from mlxcluster.engine.constraint import Constraint
    from mlxcluster.model.loader import load_tokenizer

    tok, eos = load_tokenizer(None)
    c = Constraint(tok, grammar, eos)
    c.allowed(49152)  # builds the matcher
    times = []
    for _ in range(tokens):
        t = time.perf_counter()
        ids = np.flatnonzero(c.allowed(49152))
        times.append(time.perf_counter() - t)
        if set(ids.tolist()) <= set(eos):
            break
        c.consume(int(ids[len(ids) // 2]))
    return 1000 * statistics.median(times)


if __name__ == "__main__":
    raise SystemExit(main())

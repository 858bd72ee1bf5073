#!/usr/bin/env python3
"""Benchmark mlxcluster generation: TTFT, prefill and decode tokens/s, peak memory per rank.

For each configuration (TP=1; TP=N on each backend) it starts a local group,
warms it up with one short generation, then measures
  * a short chat prompt: TTFT and decode tokens/s over --decode-tokens tokens;
  * a --prefill-tokens token prompt: prefill tokens/s (1 generated token).
Prints a Markdown table and writes JSON (--out).

Usage: python benchmarks/bench_generate.py [--world-size 3] [--backends mpi,ring]
           [--weights float32] [--decode-tokens 64] [--prefill-tokens 512] [--out bench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def machine() -> str:
    from benchmarks.bench import machine_description

    return machine_description()


def main() -> int:
    from mlxcluster.leader.generation import GenerationClient
    from mlxcluster.model.loader import default_weight_format, load_tokenizer, resolve_model_path
    from mlxcluster.runtime.blas import find_openblas
    from mlxcluster.runtime.launcher import LocalCluster, mpirun_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--world-size", type=int, default=3)
    ap.add_argument("--backends", default="mpi,ring")
    ap.add_argument("--weights", default=None)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    path = resolve_model_path(args.model)
    weights = args.weights or default_weight_format()
    tok, _ = load_tokenizer(path)
    text = open(os.path.join(ROOT, "README.md")).read()
    long_ids = tok.encode(text * (1 + args.prefill_tokens // 200))[: args.prefill_tokens]
    if len(long_ids) < args.prefill_tokens:
        raise SystemExit("README too short for the prefill prompt")

    configs = [(1, "ring")]
    for b in args.backends.split(","):
        if b == "mpi" and mpirun_path() is None:
            print("skipping mpi: mpirun not installed", file=sys.stderr)
            continue
        if args.world_size > 1:
            configs.append((args.world_size, b))
    rows = []
    for world, backend in configs:
        label = "TP=1" if world == 1 else f"TP={world} {backend}"
        print(f"-- {label}: starting", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        with LocalCluster(world, backend, model=path, weights=weights) as cluster:
            startup = time.perf_counter() - t0
            client = GenerationClient(cluster.address, cluster.credentials)
            client.generate("Hello", max_tokens=4)  # warm-up
            short = client.generate("Write a short story about a robot who learns to paint.", chat=True,
                                    max_tokens=args.decode_tokens)
            long = client.generate(prompt_ids=long_ids, max_tokens=1)
            client.close()
        row = {
            "config": label, "world_size": world, "backend": backend if world > 1 else "none",
            "weights": weights, "startup_s": round(startup, 2),
            "ttft_s": round(short.ttft_s, 4), "decode_tokens": len(short.token_ids),
            "decode_tokens_per_s": round(short.decode_tokens_per_s, 2),
            "prefill_tokens": len(long_ids), "prefill_tokens_per_s": round(long.prefill_tokens_per_s, 1),
            "peak_memory_mib_per_rank": [round(b / 2**20, 1) for b in long.peak_memory_bytes_per_rank],
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    print(f"\nMachine: {machine()}; BLAS: {find_openblas() or 'bundled reference'}; weights: {weights}\n")
    print("| config | startup s | TTFT ms | decode tok/s | prefill tok/s (%d tok) | peak MiB per rank |" % args.prefill_tokens)
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['startup_s']} | {r['ttft_s'] * 1000:.0f} | {r['decode_tokens_per_s']} "
              f"| {r['prefill_tokens_per_s']} | {', '.join(map(str, r['peak_memory_mib_per_rank']))} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

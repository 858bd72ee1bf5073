"""Batched greedy answers against lone ones, on the embedded model (float32, TP=1, one process).

G distinct chat prompts (``bench_serving``'s questions, varied) are answered greedily three ways:
each alone (its own prefill and decode, no prefix cache), then all together as ``serve`` runs them
(one batched prefill with the prefix cache warm from a first request, then one decode batch of G),
then as a stream of arrivals (at most 16 running, two prompts joining after every step while there is
room: sequences leave and join a running batch, into the rows others freed -- ``DecodeBatch``).
Prints how many batched answers equal their lone answer, where the first differing token is, and the
largest difference of the first-token logits (batched prefill vs lone prefill) -- the "last-bit
difference" of other matrix shapes, measured.

Usage: python benchmarks/batch_equality.py [--sequences 64] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args(argv)

    from mlxcluster.runtime.blas import rank_environment

    extra = rank_environment(1)
    if extra.get("LD_PRELOAD") and extra["LD_PRELOAD"] != os.environ.get("LD_PRELOAD"):
        # OpenBLAS must be loaded before MLX, as the ranks start: run again with it preloaded
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__)] + list(argv or sys.argv[1:]),
                  {**os.environ, **extra})
    import mlx.core as mx

    from benchmarks.bench_serving import PROMPTS
    from mlxcluster.engine.decode import RankEngine
    from mlxcluster.engine.passes import last_positions
    from mlxcluster.engine.sampling import Sampling
    from mlxcluster.engine.session import ShardSession
    from mlxcluster.model.loader import default_model_path, load_tokenizer, read_model
    from mlxcluster.model.tp import build_model

    path = default_model_path()
    src = read_model(path)
    model = build_model(src.config, src.weights, src.quantization, "float32")
    tok, eos = load_tokenizer(path)
    prompts = []
    for i in range(args.sequences):
        text = PROMPTS[i % len(PROMPTS)] + " Please answer briefly." * (i // len(PROMPTS))
        prompts.append(list(tok.apply_chat_template([{"role": "user", "content": text}],
                                                    add_generation_prompt=True)["input_ids"]))
    greedy, n = Sampling(), args.max_tokens

    t0 = time.perf_counter()
    lone, lone_logits = [], []
    for prompt in prompts:
        eng = RankEngine(model, 4096)
        eng.prefix = None
        session = ShardSession(model, "x")
        lone_logits.append(session.prefill(prompt))
        out = [eng.prefill("x", prompt, greedy, eos, n)]
        while not eng.get("x").reason:
            out += eng.step(lookahead=True)
        eng.withdraw()
        lone.append(out)
    t_lone = time.perf_counter() - t0

    t0 = time.perf_counter()
    eng = RankEngine(model, 4096)
    eng.prefill("warm", prompts[0], greedy, eos, 1)  # a first request leaves the system prompt's blocks
    eng.remove("warm")
    cached = [eng.prefix_match(q) for q in prompts]
    items = [(f"u{i}", q, greedy, eos, n, c) for i, (q, c) in enumerate(zip(prompts, cached))]
    first = eng.prefill_many(items)
    batched = {f"u{i}": [t] for i, t in enumerate(first)}
    while eng.batch.uids:
        uids = list(eng.batch.uids)
        for uid, t in zip(uids, eng.step(lookahead=False)):
            batched[uid].append(t)
        for uid in uids:
            if eng.get(uid).reason:
                eng.remove(uid)
    t_batched = time.perf_counter() - t0

    eng = RankEngine(model, 4096)
    waiting = list(range(len(prompts)))
    arrived: dict = {}
    while waiting or eng.batch.uids:
        room = 16 - len(eng.batch.uids)
        join, waiting = waiting[:min(2, room)], waiting[min(2, room):]
        if join:
            items = [(f"s{i}", prompts[i], greedy, eos, n, eng.prefix_match(prompts[i])) for i in join]
            for i, t in zip(join, eng.prefill_many(items)):
                arrived[f"s{i}"] = [t]
        uids = list(eng.batch.uids)
        for uid in [u for u in uids if eng.get(u).reason]:
            eng.remove(uid)
        uids = list(eng.batch.uids)
        if uids:
            for uid, t in zip(uids, eng.step(lookahead=False)):
                arrived[uid].append(t)
            for uid in uids:
                if eng.get(uid).reason:
                    eng.remove(uid)
    reused = eng.batch.rows_reused

    # first-token logits of a batched prefill (no prefix cache) against the lone prefill's
    eng2 = RankEngine(model, 4096)
    sessions = [ShardSession(model, f"v{i}") for i in range(len(prompts))]
    cache = [type(layer[0]).merge(list(layer)) for layer in zip(*(s.cache for s in sessions))]
    logits = last_positions(eng2.model, prompts, cache, True)
    diff = max(float(mx.max(mx.abs(logits[i] - lone_logits[i])).item()) for i in range(len(prompts)))

    equal = sum(batched[f"u{i}"] == lone[i] for i in range(len(prompts)))
    print(f"{len(prompts)} sequences, {n} greedy tokens each, prompts of {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens, {sum(cached)} prompt positions from the prefix cache")
    print(f"batched answers equal to their lone answers: {equal} of {len(prompts)}")
    streamed = sum(arrived[f"s{i}"] == lone[i] for i in range(len(prompts)))
    print(f"answers of a stream of arrivals equal to their lone answers: {streamed} of {len(prompts)} "
          f"({reused} joins written into freed rows)")
    for i in range(len(prompts)):
        a, b = batched[f"u{i}"], lone[i]
        if a != b:
            k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            print(f"  sequence {i}: first difference at token {k} of {len(b)}")
    print(f"largest |batched - lone| first-token logit: {diff:.3g}")
    print(f"time: lone {t_lone:.1f} s, batched {t_batched:.1f} s")
    return 0 if equal == len(prompts) and streamed == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())

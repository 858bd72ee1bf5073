"""TTFT of a long shared prefix: cold, from the prefix cache in memory, and from its disk tier after the
group restarted (issue 32: ``--prompt-cache-dir``).

A one-rank group (``LocalCluster(1)``, float32, the embedded SmolLM2 by default) with
``--prompt-cache-dir`` in a fresh temporary directory gets three requests that share a prefix of
``--prefix-tokens`` tokens of real text (this project's README and ARCHITECTURE) and differ in a short
question after it, each greedy for ``--answer-tokens`` tokens:

1. *cold*: the first request, prefilled whole;
2. *memory hit*: a second question after the same prefix, its K/V taken from the prefix cache in memory;
3. *disk hit after a restart*: the group is stopped and started again over the same directory (new rank
   processes: nothing in memory), then a third question -- its prefix's K/V read from disk.

TTFT is the client's wall time from sending the request to its first token event (gRPC over loopback,
mutual TLS), and the server's own ``ttft_s``; ``cached_prompt_tokens`` says what was taken from a cache.
The three answers' prefix positions are the same; each answer is checked against a cold run of the same
prompt on a group without any cache (greedy tokens equal). Target (issue 32): a disk hit at most 25 % of
cold.

Usage: python benchmarks/bench_prompt_cache.py [--prefix-tokens 4000] [--answer-tokens 8] [--model PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.common import exit_on_sigterm, machine_description  # noqa: E402

QUESTIONS = ("\n\nQuestion: what does rank 0 do?\nAnswer:", "\n\nQuestion: what is a stage?\nAnswer:",
             "\n\nQuestion: how are faults handled?\nAnswer:")


def _prefix(tokenizer, n: int):
    text = ""
    for name in ("README.md", "ARCHITECTURE.md"):
        with open(os.path.join(ROOT, name), encoding="utf-8") as fh:
            text += fh.read() + "\n\n"
    ids = list(tokenizer.encode(text))
    if len(ids) < n:
        raise SystemExit(f"the text has only {len(ids)} tokens; ask for --prefix-tokens {len(ids)} or fewer")
    return ids[:n]


def _timed(group, ids, answer_tokens):
    """(client TTFT s, server ttft_s, cached_prompt_tokens, token ids) of one greedy request."""
    from mlxcluster.leader.generation import GenerationClient

    client = GenerationClient(group.address, group.credentials, timeout_s=1800)
    try:
        t0 = time.perf_counter()
        first, tokens, cached, server_ttft = None, [], 0, 0.0
        for event in client.stream(prompt_ids=ids, max_tokens=answer_tokens):
            kind = event.WhichOneof("event")
            if kind == "started":
                cached = event.started.cached_prompt_tokens
            elif kind == "token":
                if first is None:
                    first = time.perf_counter() - t0
                tokens.append(event.token.token_id)
            elif kind == "done":
                server_ttft = event.done.ttft_s
        return first, server_ttft, cached, tokens
    finally:
        client.close()


def main(argv=None) -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefix-tokens", type=int, default=4000)
    p.add_argument("--answer-tokens", type=int, default=8)
    p.add_argument("--model", default=None)
    args = p.parse_args(argv)

    from mlxcluster.model.loader import read_model, resolve_model_path, tokenizer_of
    from mlxcluster.runtime.launcher import LocalCluster
    from mlxcluster.runtime.rank_config import RankConfig

    model = resolve_model_path(args.model)
    tokenizer, _ = tokenizer_of(read_model(model, tokenizer=False))
    prefix = _prefix(tokenizer, args.prefix_tokens)
    prompts = [prefix + list(tokenizer.encode(q)) for q in QUESTIONS]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-prompt-cache-") as cache_dir:
        disk = RankConfig(prompt_cache_dir=cache_dir)
        group = LocalCluster(1, model=model, weights="float32", config=disk, start_timeout_s=300).start()
        try:
            rows.append(("cold", *_timed(group, prompts[0], args.answer_tokens)))
            rows.append(("memory hit", *_timed(group, prompts[1], args.answer_tokens)))
            deadline = time.monotonic() + 120  # the writer thread's file, before the ranks stop
            while not any(f.endswith(".safetensors") for _, _, fs in os.walk(cache_dir) for f in fs):
                if time.monotonic() > deadline:
                    raise SystemExit("no prompt cache file was written within 120 s")
                time.sleep(0.5)
        finally:
            group.stop()
        group = LocalCluster(1, model=model, weights="float32", config=disk, start_timeout_s=300).start()
        try:
            rows.append(("disk hit after a restart", *_timed(group, prompts[2], args.answer_tokens)))
        finally:
            group.stop()
    plain = LocalCluster(1, model=model, weights="float32", start_timeout_s=300).start()
    try:
        want = [_timed(plain, ids, args.answer_tokens)[3] for ids in prompts]
    finally:
        plain.stop()
    cold = rows[0][1]
    print(f"`python benchmarks/bench_prompt_cache.py --prefix-tokens {args.prefix_tokens}` on "
          f"{machine_description()}; a {args.prefix_tokens}-token shared prefix, greedy {args.answer_tokens}-token "
          f"answers, TP=1 float32")
    print()
    print("| request | TTFT (client) | TTFT (server) | vs cold | cached prompt tokens | tokens = uncached run |")
    print("|---|---:|---:|---:|---:|---|")
    for (name, ttft, server, cached, tokens), ref in zip(rows, want):
        print(f"| {name} | {ttft:.2f} s | {server:.2f} s | {ttft / cold:.0%} | {cached} | "
              f"{'yes' if tokens == ref else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

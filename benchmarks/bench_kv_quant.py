"""Quantized KV caches (issue 32 part 2): full-precision K/V ("16" in the issue's words: here the model's
activation dtype, float32 on this CPU) against ``--kv-bits 8`` and ``--kv-bits 4`` (``--kv-group-size``,
default 64), on the embedded SmolLM2-135M, float32 weights, greedy.

Per TP and KV format, one row:

* **KV bytes/token**: keys + values of one position over every layer and every rank (TP=1: the model's
  caches, :func:`mlxcluster.engine.kvquant.bytes_per_token`; TP=N: the ranks' ``loaded`` events'
  ``kv_bytes_per_token``, summed).  Packed codes plus one scale and one bias per group.
* **agreement**: the 8-prompt set (``benchmarks/bench_serving.py``'s ``PROMPTS``, each through the chat
  template), ``--max-tokens`` (64) greedy tokens each: tokens matched before the first divergence from
  full-precision K/V at the same TP, summed over the prompts / the tokens compared, and how many of the 8
  answers are identical.
* **perplexity** (TP=1, in-process): teacher-forced on :data:`TEXT` (a fixed text), fed through the KV
  cache in chunks of ``--chunk`` (64) positions, so every position's attention reads the K/V of the
  chunks before it -- quantized, where the cache is -- as decoding would:
  ``PPL = exp(-(1/N) sum_i log p(x_i | x_<i))`` over the N predicted tokens (the standard definition:
  Jurafsky & Martin, *Speech and Language Processing*, 3rd ed., ch. 3, eq. 3.16; Hugging Face
  Transformers' "Perplexity of fixed-length models" guide).  Not measured at TP=N (the serving API
  does not teacher-force; each rank's K/V are the same per-head quantization as TP=1's).
* **decode tok/s** (single stream): TP=1: the engine in-process (``RankEngine``, uncompiled at every
  format: the compiled lone greedy step, which full-precision serving would use, skips quantized K/V),
  tokens after the first over the time after the first, median over the prompts; TP=N: the group's
  ``decode_tokens_per_s`` of each answer, median over the prompts.

Prints a Markdown table; ``--json FILE`` writes the figures.

Usage::

    python benchmarks/bench_kv_quant.py [--world-sizes 1,3] [--backend ring] [--bits 0,8,4]
        [--group-size 64] [--max-tokens 64] [--prompts 8] [--chunk 64] [--text-tokens 0] [--json out.json]

(a smoke run: ``--world-sizes 1 --max-tokens 4 --prompts 2 --text-tokens 65``)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # python benchmarks/bench_kv_quant.py from an uninstalled checkout
    sys.path.insert(0, ROOT)

from benchmarks.bench_serving import PROMPTS  # noqa: E402
from benchmarks.common import machine_description  # noqa: E402

__all__ = ["main", "TEXT", "perplexity", "agreement"]

#: The fixed text of the perplexity column: public-domain English prose (Lincoln's Gettysburg Address,
#: the Bliss copy, 1863; the opening paragraph of Dickens' *A Tale of Two Cities*, 1859), ~600 tokens.
TEXT = (
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in "
    "Liberty, and dedicated to the proposition that all men are created equal. Now we are engaged in a great "
    "civil war, testing whether that nation, or any nation so conceived and so dedicated, can long endure. We "
    "are met on a great battle-field of that war. We have come to dedicate a portion of that field, as a final "
    "resting place for those who here gave their lives that that nation might live. It is altogether fitting "
    "and proper that we should do this. But, in a larger sense, we can not dedicate -- we can not consecrate "
    "-- we can not hallow -- this ground. The brave men, living and dead, who struggled here, have consecrated "
    "it, far above our poor power to add or detract. The world will little note, nor long remember what we say "
    "here, but it can never forget what they did here. It is for us the living, rather, to be dedicated here "
    "to the unfinished work which they who fought here have thus far so nobly advanced. It is rather for us to "
    "be here dedicated to the great task remaining before us -- that from these honored dead we take increased "
    "devotion to that cause for which they gave the last full measure of devotion -- that we here highly "
    "resolve that these dead shall not have died in vain -- that this nation, under God, shall have a new "
    "birth of freedom -- and that government of the people, by the people, for the people, shall not perish "
    "from the earth.\n\n"
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it "
    "was the season of Darkness, it was the spring of hope, it was the winter of despair, we had everything "
    "before us, we had nothing before us, we were all going direct to Heaven, we were all going direct the "
    "other way -- in short, the period was so far like the present period, that some of its noisiest "
    "authorities insisted on its being received, for good or for evil, in the superlative degree of "
    "comparison only.\n\n"
    "There were a king with a large jaw and a queen with a plain face, on the throne of England; there were a "
    "king with a large jaw and a queen with a fair face, on the throne of France. In both countries it was "
    "clearer than crystal to the lords of the State preserves of loaves and fishes, that things in general "
    "were settled for ever."
)


def _fmt(bits: int, group_size: int):
    from mlxcluster.engine.kvquant import kv_format

    return kv_format(bits or None, group_size)


def perplexity(model, ids: Sequence[int], chunk: int) -> float:
    """``exp`` of the mean negative log-likelihood of ``ids[1:]``, teacher-forced through ``model``'s KV
    caches (in its KV format, :func:`~mlxcluster.engine.kvquant.make_cache`) ``chunk`` positions per pass."""
    import mlx.core as mx

    from mlxcluster.engine.kvquant import make_cache

    cache = make_cache(model)
    nll, n = 0.0, 0
    x = mx.array([list(ids)], dtype=mx.int32)
    for start in range(0, len(ids) - 1, chunk):
        end = min(start + chunk, len(ids) - 1)
        logits = model(x[:, start:end], cache=cache)[0].astype(mx.float32)  # (end - start, vocab)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        target = x[0, start + 1:end + 1]
        picked = mx.take_along_axis(logp, target[:, None], axis=-1)
        nll -= float(mx.sum(picked).item())
        n += end - start
    return math.exp(nll / n)


def agreement(reference: List[List[int]], answers: List[List[int]]) -> Dict[str, Any]:
    """Tokens of ``answers`` matched before their first divergence from ``reference`` (greedy answers of the
    same prompts), over the tokens compared; identical answers."""
    matched = compared = same = 0
    for want, got in zip(reference, answers):
        n = min(len(want), len(got))
        prefix = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), n)
        matched += prefix
        compared += n
        same += want == got
    return {"matched": matched, "compared": compared, "share": matched / compared if compared else 0.0,
            "identical": same, "prompts": len(reference)}


def _tp1(source, prompts: List[List[int]], bits_list, group_size: int, max_tokens: int, chunk: int,
         text_ids: List[int]) -> List[Dict[str, Any]]:
    import mlx.core as mx

    from mlxcluster.engine.decode import RankEngine
    from mlxcluster.engine.sampling import Sampling
    from mlxcluster.engine.kvquant import bytes_per_token, set_format
    from mlxcluster.model.tp import build_model

    model = build_model(source.config, dict(source.weights), source.quantization, "float32")
    head_dim = int(source.config.get("head_dim") or source.hidden_size // source.config["num_attention_heads"])
    rows = []
    for bits in bits_list:
        set_format(model, _fmt(bits, group_size))
        eng = RankEngine(model, source.context_length)
        answers, rates = [], []
        for i, p in enumerate(prompts):
            tokens = [eng.prefill(f"p{i}", p, Sampling(), (), max_tokens + 1)]
            t0 = time.perf_counter()
            for _ in range(max_tokens - 1):
                tokens += eng.step()
            if max_tokens > 1:
                rates.append((max_tokens - 1) / (time.perf_counter() - t0))
            eng.remove(f"p{i}")
            answers.append(tokens)
        t0 = time.perf_counter()
        ppl = perplexity(model, text_ids, chunk)
        print(f"TP=1 {bits or 'full'}: perplexity in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        rows.append({"tp": 1, "bits": bits, "group_size": group_size if bits else 0,
                     "kv_bytes_per_token": bytes_per_token(model, head_dim, mx.float32.size),
                     "perplexity": ppl,
                     "decode_tokens_per_s": statistics.median(rates) if rates else 0.0, "answers": answers})
        print(f"TP=1 {bits or 'full'}: done", file=sys.stderr, flush=True)
    return rows


def _tpn(n: int, backend: str, model_path: str, prompts: List[List[int]], bits_list, group_size: int,
         max_tokens: int) -> List[Dict[str, Any]]:
    from mlxcluster.leader.generation import GenerationClient
    from mlxcluster.runtime.launcher import LocalCluster
    from mlxcluster.runtime.rank_config import RankConfig

    rows = []
    for bits in bits_list:
        kv = RankConfig(kv_bits=bits, kv_group_size=group_size) if bits else RankConfig()
        with LocalCluster(n, backend, model=model_path, weights="float32", config=kv,
                          start_timeout_s=300) as group:
            loaded = [e for e in group.events if e.get("event") == "loaded"]
            client = GenerationClient(group.address, group.credentials, timeout_s=900)
            try:
                results = [client.generate(prompt_ids=p, max_tokens=max_tokens) for p in prompts]
            finally:
                client.close()
        rows.append({"tp": n, "bits": bits, "group_size": group_size if bits else 0,
                     "kv_bytes_per_token": sum(int(e.get("kv_bytes_per_token", 0)) for e in loaded),
                     "perplexity": None,
                     "decode_tokens_per_s": statistics.median(r.decode_tokens_per_s for r in results),
                     "answers": [list(r.token_ids) for r in results]})
        print(f"TP={n} {bits or 'full'}: done", file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", default="1", help="comma-separated TP sizes (1 runs in-process)")
    ap.add_argument("--backend", default="ring", help="backend of TP > 1 groups")
    ap.add_argument("--bits", default="0,8,4", help="KV widths, 0 = full precision (the reference: first)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the 8 prompts")
    ap.add_argument("--chunk", type=int, default=64, help="positions per teacher-forced pass (perplexity)")
    ap.add_argument("--text-tokens", type=int, default=0, help="perplexity over the first N tokens of TEXT (0: all)")
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args(argv)
    bits_list = [int(b) for b in args.bits.split(",")]
    if bits_list[0] != 0:
        bits_list = [0] + [b for b in bits_list if b != 0]

    from mlxcluster.model.loader import default_model_path, read_model, tokenizer_of
    from mlxcluster.model.tokenizer import apply_chat

    path = default_model_path()
    source = read_model(path)
    tokenizer, _ = tokenizer_of(source)
    prompts = [apply_chat(tokenizer, p) for p in PROMPTS[:args.prompts]]
    text_ids = list(tokenizer.encode(TEXT))[:args.text_tokens or None]
    rows: List[Dict[str, Any]] = []
    for n in (int(w) for w in args.world_sizes.split(",")):
        part = (_tp1(source, prompts, bits_list, args.group_size, args.max_tokens, args.chunk, text_ids) if n == 1
                else _tpn(n, args.backend, path, prompts, bits_list, args.group_size, args.max_tokens))
        reference = part[0]["answers"]
        for row in part:
            row["agreement"] = agreement(reference, row["answers"])
        rows += part

    ppl_note = (f"; perplexity over {len(text_ids)} tokens of TEXT in chunks of {args.chunk}"
                if any(r["perplexity"] is not None for r in rows) else "")
    print(f"\n{machine_description()}; SmolLM2-135M float32, {len(prompts)} prompts x {args.max_tokens} greedy "
          f"tokens{ppl_note}\n")
    print("| TP | KV | bytes/token | vs full | agreement (matched / compared) | identical | perplexity | decode tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    full = {r["tp"]: r["kv_bytes_per_token"] for r in rows if r["bits"] == 0}
    for r in rows:
        a = r["agreement"]
        kv = "full (float32)" if not r["bits"] else f"{r['bits']}-bit, g{r['group_size']}"
        ppl = f"{r['perplexity']:.3f}" if r["perplexity"] is not None else "--"
        ratio = r["kv_bytes_per_token"] / full[r["tp"]] if full.get(r["tp"]) else 0.0
        print(f"| {r['tp']} | {kv} | {r['kv_bytes_per_token']:,} | {ratio:.2f}x | {a['share']:.1%} "
              f"({a['matched']} / {a['compared']}) | {a['identical']} / {a['prompts']} | {ppl} | "
              f"{r['decode_tokens_per_s']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_description(), "rows": rows, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

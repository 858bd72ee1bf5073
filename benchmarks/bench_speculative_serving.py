"""Speculative decoding under load (issue 30): ``serve`` with and without ``--draft ngram`` at 1, 8 and
32 concurrent streaming clients, side by side in one run.

Two ``serve`` processes on the same float32 mlx-lm directory (the default SmolLM2-135M GGUF exported
once, as ``bench --serving`` does; TP=N per ``--world-sizes``) run at the same time: one plain, one
with ``--draft ngram --draft-tokens K``.  For each prompt set and concurrency level C the same closed
loop of ``max(8, 2 C)`` greedy streamed chat requests (bench_serving's clients: each client sends its
next request when its previous answer ended) runs against one server, then the other (the order
alternates per level, so that neither always runs first on a machine whose load drifts).  Prompt sets:

  * ``repetitive``: answers that copy the prompt (bench_speculative's: repeat a text, edit code);
  * ``chat``: open questions (bench_serving's).

Per server, set and level: aggregate output tok/s (completion tokens over the level's wall time),
TTFT p50, ITL p50/p95 (gaps between streamed content chunks: a verify step's tokens may arrive
together), TPOT p50 (time per output token after the first, per request), and from ``/metrics``
(``mlxcluster_spec_*``, the level's increase) the acceptance rate (accepted / drafted draft tokens) and
tokens per decode step (tokens after each answer's first / decode steps; 1.0 without drafting); and
how many answers equal the plain server's (greedy: they should, batching's float32 noise aside).

Usage::

    python benchmarks/bench_speculative_serving.py [--world-sizes 1] [--concurrency 1,8,32]
        [--max-tokens 64] [--draft ngram] [--draft-tokens 4] [--sets repetitive,chat] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # python benchmarks/bench_speculative_serving.py from an uninstalled checkout
    sys.path.insert(0, ROOT)

from benchmarks.bench_serving import PROMPTS, Serve, run_level  # noqa: E402
from benchmarks.common import exit_on_sigterm, machine_description, prepare_mlx_dir, scratch_dir  # noqa: E402

#: the ``mlxcluster_spec_*`` counters a level's row reads (their increase over the level)
SPEC_COUNTERS = ("drafted_tokens", "accepted_tokens", "verify_steps", "decode_steps", "decoded_tokens")


def prompt_sets() -> Dict[str, List[str]]:
    from benchmarks.bench_speculative import REPETITIVE

    return {"repetitive": list(REPETITIVE), "chat": list(PROMPTS)}


def spec_counters(metrics_text: str) -> Dict[str, float]:
    """The ``mlxcluster_spec_*`` counters of a ``/metrics`` page (Prometheus text): name (without the
    prefix and ``_total``) -> value; absent ones 0."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {name: 0.0 for name in SPEC_COUNTERS}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name.startswith("mlxcluster_spec_") and sample.name.endswith("_total"):
                name = sample.name[len("mlxcluster_spec_"):-len("_total")]
                if name in out:
                    out[name] = float(sample.value)
    return out


def spec_figures(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, Optional[float]]:
    """Acceptance rate (accepted / drafted; ``None`` when nothing was drafted) and tokens per decode
    step (decoded tokens / decode steps; ``None`` before any) over the counters' increase."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS}
    return {"acceptance_rate": round(d["accepted_tokens"] / d["drafted_tokens"], 3) if d["drafted_tokens"] else None,
            "tokens_per_step": round(d["decoded_tokens"] / d["decode_steps"], 3) if d["decode_steps"] else None,
            "drafted_tokens": int(d["drafted_tokens"]), "verify_steps": int(d["verify_steps"]),
            "decode_steps": int(d["decode_steps"])}


async def _metrics(url: str) -> Dict[str, float]:
    import httpx

    async with httpx.AsyncClient(timeout=30) as c:
        return spec_counters((await c.get(url + "/metrics")).text)


async def measure(servers: Dict[str, Serve], sets: Dict[str, List[str]], levels: List[int], max_tokens: int,
                  quick: bool = False, rounds: int = 1) -> List[Dict[str, Any]]:
    """Every (set, level) against every server in turn, ``rounds`` times (the order alternating per
    round and level: on a shared 2-core machine one pair of runs moves +-10-30 %); one row per round."""
    for s in servers.values():
        await s.start()
    for s in servers.values():  # warm: the first request compiles and loads
        await run_level(s.url, "m", 1, 1, 4)
    rows: List[Dict[str, Any]] = []
    turn = 0
    for set_name, prompts, c, rnd in [(s, p, c, r) for s, p in sets.items() for c in levels for r in range(rounds)]:
        n = max(4 if quick else 8, 2 * c)
        order = list(servers) if turn % 2 == 0 else list(reversed(list(servers)))
        turn += 1
        answers: Dict[str, Dict[int, str]] = {}
        for mode in order:
            server = servers[mode]
            before = await _metrics(server.url)
            answers[mode] = {}
            row = await run_level(server.url, "m", c, n, max_tokens, prompts, answers[mode])
            row.update(spec_figures(before, await _metrics(server.url)), mode=mode, set=set_name, round=rnd)
            rows.append(row)
        base = answers.get("off", {})
        mine = {r["mode"]: r for r in rows[-len(order):]}
        for mode in order:
            if mode != "off":
                mine[mode]["answers_equal"] = sum(1 for i, t in answers[mode].items() if base.get(i) == t)
        for mode in servers:
            r = mine[mode]
            print(f"  {set_name} C={c} round {rnd + 1} {mode}: {r['output_tok_s']} tok/s, TTFT p50 {r['ttft_p50_s']} s, "
                  f"ITL p50/p95 {r['itl_p50_ms']}/{r['itl_p95_ms']} ms, TPOT p50 {r['tpot_p50_ms']} ms, acceptance "
                  f"{r['acceptance_rate']}, tokens/step {r['tokens_per_step']}"
                  + (f", {len(r['errors'])} error(s): {r['errors']}" if r["errors"] else ""), flush=True)
    return rows


def _f(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def merged(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per (set, level, mode) over its rounds: output tok/s and the other figures their mean
    (tokens/step and acceptance over the summed counters), ``ratios`` each round's tok/s over the plain
    server's in the same round, ``answers_equal``/``ok`` summed."""
    out: List[Dict[str, Any]] = []
    keys = []
    for r in rows:
        k = (r["set"], r["concurrency"], r["mode"])
        if k not in keys:
            keys.append(k)
    for set_name, c, mode in keys:
        mine = [r for r in rows if (r["set"], r["concurrency"], r["mode"]) == (set_name, c, mode)]
        m: Dict[str, Any] = dict(mine[0])
        for f in ("output_tok_s", "ttft_p50_s", "itl_p50_ms", "itl_p95_ms", "tpot_p50_ms"):
            vals = [r[f] for r in mine if r.get(f) is not None]
            m[f] = statistics.mean(vals) if vals else None
        drafted = sum(r.get("drafted_tokens") or 0 for r in mine)
        accepted = sum((r.get("acceptance_rate") or 0) * (r.get("drafted_tokens") or 0) for r in mine)
        steps = sum(r.get("decode_steps") or 0 for r in mine)
        tokens = sum((r.get("tokens_per_step") or 0) * (r.get("decode_steps") or 0) for r in mine)
        if len(mine) > 1:
            m["acceptance_rate"] = accepted / drafted if drafted else None
            m["tokens_per_step"] = tokens / steps if steps else None
        m["ok"] = sum(r["ok"] for r in mine)
        m["answers_equal"] = sum(r.get("answers_equal", 0) for r in mine)
        m["rounds"] = len(mine)
        offs = {r.get("round", 0): r["output_tok_s"] for r in rows
                if (r["set"], r["concurrency"], r["mode"]) == (set_name, c, "off") and r["output_tok_s"]}
        m["ratios"] = [r["output_tok_s"] / offs[r.get("round", 0)] for r in mine if r.get("round", 0) in offs]
        out.append(m)
    return out


def markdown(report: Dict[str, Any]) -> str:
    lines = [f"`python benchmarks/bench_speculative_serving.py` on {report['machine']} ({report['date']}); "
             f"{report['max_tokens']}-token greedy streamed chat requests, closed loop, max(8, 2 C) per level; "
             f"`serve` plain vs `serve --draft {report['draft']} --draft-tokens {report['draft_tokens']}`, "
             "both up in the same run, each level against one then the other.", "",
             "| TP | set | clients | drafting | output tok/s | vs off | TTFT p50 (s) | ITL p50 / p95 (ms) | "
             "TPOT p50 (ms) | acceptance | tokens/step | answers = off |",
             "|---|---|---:|---|---:|---:|---:|---|---:|---:|---:|---|"]
    for world, rows in report["results"].items():
        for r in merged(rows):
            ratio = statistics.median(r["ratios"]) if r["ratios"] else None
            spread = (f" ({min(r['ratios']):.2f}-{max(r['ratios']):.2f})" if len(r["ratios"]) > 1 and r["mode"] != "off"
                      else "")
            same = "-" if r["mode"] == "off" else f"{r.get('answers_equal', 0)} of {r['ok']}"
            lines.append(f"| {world} | {r['set']} | {r['concurrency']} | {r['mode']} | {r['output_tok_s']:.1f} | "
                         f"{_f(ratio)}x{spread} | {_f(r['ttft_p50_s'])} | {_f(r['itl_p50_ms'], '.0f')} / "
                         f"{_f(r['itl_p95_ms'], '.0f')} | {_f(r['tpot_p50_ms'], '.0f')} | {_f(r['acceptance_rate'])} | "
                         f"{_f(r['tokens_per_step'])} | {same} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    exit_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or mlx-lm directory (default: the embedded model)")
    ap.add_argument("--world-sizes", default="1", help="comma-separated TP sizes (e.g. 1,3)")
    ap.add_argument("--backend", default="ring")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--draft", default="ngram")
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--sets", default="repetitive,chat")
    ap.add_argument("--quick", action="store_true", help="at least 4 requests per level (not 8)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs of each level per server, alternating which goes first ('vs off': the median "
                         "of the rounds' ratios, their range beside it)")
    ap.add_argument("--out-dir", default="bench-out", help="the servers' logs")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)
    levels = [int(x) for x in a.concurrency.split(",") if x.strip()]
    every = prompt_sets()
    sets = {name: every[name] for name in a.sets.split(",") if name}
    os.makedirs(a.out_dir, exist_ok=True)
    report: Dict[str, Any] = {"machine": machine_description(), "date": time.strftime("%Y-%m-%d %H:%M"),
                              "max_tokens": a.max_tokens, "draft": a.draft, "draft_tokens": a.draft_tokens,
                              "results": {}}
    work = tempfile.mkdtemp(prefix="bench-spec-serving-", dir=scratch_dir())
    try:
        model = prepare_mlx_dir(a.model, "float32", work)
        for world in [int(w) for w in a.world_sizes.split(",") if w.strip()]:
            print(f"TP={world}:", flush=True)
            servers = {"off": Serve(model, world, a.backend, os.path.join(a.out_dir, f"spec-off-tp{world}.log")),
                       a.draft: Serve(model, world, a.backend, os.path.join(a.out_dir, f"spec-{a.draft}-tp{world}.log"),
                                      ["--draft", a.draft, "--draft-tokens", str(a.draft_tokens)])}
            try:
                report["results"][str(world)] = asyncio.run(measure(servers, sets, levels, a.max_tokens, a.quick,
                                                                      max(1, a.rounds)))
            finally:
                for s in servers.values():
                    s.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    md = markdown(report)
    print("\n" + md)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Long prompts under ``serve``: a short request beside a long prompt's prefill, running streams'
inter-token latency while a long prompt prefills, and a ~6K-token prompt to the end (issue 27).

For each world size (``serve --world-size N``, float32 weights, the embedded default model):

* **short beside long**: a ~2.5K-token chat prompt, then 2 s later a "Hi"; both streamed, greedy.
  Reported: each request's time to its last token and TTFT, and the "Hi"'s time as a share of the
  long request's (target: at most 25 %), and whether both succeeded.
* **streams beside a long prefill**: ``--streams`` (4) streamed requests of ``--stream-tokens`` tokens
  alone, then the same with a long prompt (``--long-tokens``) sent 1 s after them: their inter-token
  latency p50/p95 both ways (issue 32: 8 streams and a 4K-token prompt).
* **a ~6K-token prompt** (world size 1 only): completes, and how long it took.
* The long request's greedy answer at every world size, compared with world size 1's.

Usage: python benchmarks/bench_long_prompt.py [--world-sizes 1,3] [--backend mpi] [--long-tokens 2500]
       [--huge-tokens 6000] [--streams 4] [--out-dir bench-out]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.bench_serving import REQUEST_TIMEOUT_S, Serve, _one, _pct  # noqa: E402
from benchmarks.common import exit_on_sigterm, machine_description  # noqa: E402

__all__ = ["main"]

SENTENCES = ["The river {i} runs north past the old mill and the stone bridge.",
             "In year {i} the village council voted to repair the harbour wall.",
             "Experiment {i} measured the boiling point of water at altitude.",
             "Chapter {i} describes a long journey across the northern plains.",
             "Invoice {i} lists twelve crates of apples and four barrels of cider."]


def long_text(tokens: int, variant: int = 0) -> str:
    """A varied English text of about ``tokens`` tokens (~14 tokens a sentence here) and a question;
    texts of different ``variant`` differ from their first sentence on (no prefix-cache hit)."""
    n = max(1, tokens // 14)
    parts = [SENTENCES[(i + variant) % len(SENTENCES)].format(i=i + 1000 * variant) for i in range(n)]
    return " ".join(parts) + "\n\nSummarise the text above in one sentence."


async def _request(client, url: str, prompt: str, max_tokens: int, t0: float) -> Dict[str, Any]:
    """One streamed greedy chat request: ``_one``'s result plus when it was sent (s since ``t0``),
    its time to the last token and its answer text, or the error."""
    import httpx

    sent = time.perf_counter() - t0
    try:
        r = await _one(client, url, "m", prompt, max_tokens)
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        return {"sent_s": round(sent, 2), "ok": False, "error": (str(exc) or type(exc).__name__)[:200]}
    total = (r["ttft_s"] or 0.0) + sum(r["gaps_s"])
    return {"sent_s": round(sent, 2), "ok": True, "ttft_s": round(r["ttft_s"], 3), "total_s": round(total, 3),
            "tokens": r["tokens"], "gaps_s": r["gaps_s"]}


async def _answer(url: str, prompt: str, max_tokens: int) -> "tuple[str, int]":
    import httpx

    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        r = await client.post(url + "/v1/chat/completions", json=body)
        r.raise_for_status()
        j = r.json()
        return j["choices"][0]["message"]["content"], j["usage"]["prompt_tokens"]


async def bench_world(world: int, backend: str, model: str, args, log: str) -> Dict[str, Any]:
    import httpx

    server = Serve(model, world, backend, log, extra=["--max-queue", "64"])
    out: Dict[str, Any] = {"world_size": world, "backend": backend if world > 1 else "-"}
    try:
        await server.start()
        url = server.url
        long_prompt = long_text(args.long_tokens)
        answer, prompt_tokens = await _answer(url, long_prompt, args.answer_tokens)  # also warms the group
        out["long_prompt_tokens"] = prompt_tokens
        out["long_answer"] = answer
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
            # short beside long: the "Hi" 2 s after the long prompt (another text than the warm-up's:
            # no prefix-cache hit)
            t0 = time.perf_counter()
            prompt = long_text(args.long_tokens, variant=1)

            async def hi_later():
                await asyncio.sleep(2.0)
                return await _request(client, url, "Hi", 8, t0)

            long_r, hi_r = await asyncio.gather(_request(client, url, prompt, args.answer_tokens, t0), hi_later())
            share = hi_r["total_s"] / long_r["total_s"] if long_r.get("ok") and hi_r.get("ok") else None
            out["short_beside_long"] = {"long": _strip(long_r), "hi": _strip(hi_r),
                                        "hi_share": None if share is None else round(share, 3),
                                        "met": bool(share is not None and share <= 0.25)}
            print(f"  TP={world}: long ({prompt_tokens} prompt tokens) {long_r.get('total_s')} s (TTFT "
                  f"{long_r.get('ttft_s')} s), 'Hi' sent at 2 s: {hi_r.get('total_s')} s -> "
                  f"{'-' if share is None else f'{100 * share:.1f} %'} of the long request", flush=True)

            # streams alone, then beside a long prefill
            async def streams(with_long: bool):
                t1 = time.perf_counter()
                tasks = [_request(client, url, f"Count slowly from {k} to {k + 40}.", args.stream_tokens, t1)
                         for k in range(args.streams)]
                if with_long:
                    async def later():
                        await asyncio.sleep(1.0)
                        return await _request(client, url, long_text(args.long_tokens, variant=2), 8, t1)
                    tasks.append(later())
                return await asyncio.gather(*tasks)

            rows = {}
            for name, with_long in (("alone", False), ("beside_long_prefill", True)):
                rs = await streams(with_long)
                gaps = [g for r in rs[:args.streams] if r.get("ok") for g in r["gaps_s"]]
                rows[name] = {"ok": all(r.get("ok") for r in rs),
                              "itl_p50_ms": _ms(_pct(gaps, 50)), "itl_p95_ms": _ms(_pct(gaps, 95)),
                              "itl_max_ms": _ms(max(gaps) if gaps else None)}
                print(f"  TP={world}: {args.streams} streams {name}: ITL p50/p95/max {rows[name]['itl_p50_ms']}/"
                      f"{rows[name]['itl_p95_ms']}/{rows[name]['itl_max_ms']} ms", flush=True)
            out["streams"] = rows
            if world == 1 and args.huge_tokens:
                t2 = time.perf_counter()
                r = await _request(client, url, long_text(args.huge_tokens, variant=3), 8, t2)
                out["huge_prompt"] = _strip(r)
                print(f"  TP={world}: ~{args.huge_tokens}-token prompt: "
                      f"{'ok' if r.get('ok') else 'FAILED: ' + r.get('error', '')} in {r.get('total_s')} s "
                      f"(TTFT {r.get('ttft_s')} s)", flush=True)
    finally:
        server.stop()
    return out


def _strip(r: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in r.items() if k != "gaps_s"}


def _ms(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(1000 * x, 1)


def report_md(report: Dict[str, Any]) -> str:
    lines = [f"Command: `{report['command']}`; {report['machine']}, {report['date']}.", "",
             "| world size | long prompt tokens | long: TTFT / total (s) | 'Hi' at +2 s: total (s) | 'Hi' / long "
             f"| both ok | {report['streams']} streams ITL p50/p95 alone (ms) | ... beside the long prefill (ms) | long answer = TP=1's |",
             "|---|---|---|---|---|---|---|---|---|"]
    base = report["results"][0]["long_answer"] if report["results"] else None
    for r in report["results"]:
        s = r.get("short_beside_long", {})
        lg, hi = s.get("long", {}), s.get("hi", {})
        st = r.get("streams", {})
        a, b = st.get("alone", {}), st.get("beside_long_prefill", {})
        share = s.get("hi_share")
        lines.append(f"| {r['world_size']} | {r.get('long_prompt_tokens')} | {lg.get('ttft_s')} / {lg.get('total_s')} "
                     f"| {hi.get('total_s')} | {'-' if share is None else f'{100 * share:.1f} %'} "
                     f"| {bool(lg.get('ok') and hi.get('ok'))} | {a.get('itl_p50_ms')} / {a.get('itl_p95_ms')} "
                     f"| {b.get('itl_p50_ms')} / {b.get('itl_p95_ms')} | {r.get('long_answer') == base} |")
    for r in report["results"]:
        if "huge_prompt" in r:
            h = r["huge_prompt"]
            lines += ["", f"~{report['huge_tokens']}-token prompt at world size {r['world_size']}: "
                          f"{'completed' if h.get('ok') else 'FAILED (' + h.get('error', '') + ')'} in "
                          f"{h.get('total_s')} s (TTFT {h.get('ttft_s')} s)."]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", default="1,3")
    p.add_argument("--backend", default="mpi")
    p.add_argument("--long-tokens", type=int, default=2500)
    p.add_argument("--huge-tokens", type=int, default=6000, help="0: skip the ~6K-token prompt")
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--stream-tokens", type=int, default=48)
    p.add_argument("--streams", type=int, default=4, help="streams decoding when a long prompt arrives")
    p.add_argument("--model", default=None)
    p.add_argument("--out-dir", default="bench-out")
    args = p.parse_args(argv)
    exit_on_sigterm()
    from mlxcluster.model.loader import resolve_model_path

    model = resolve_model_path(args.model)
    os.makedirs(args.out_dir, exist_ok=True)
    report: Dict[str, Any] = {"command": "python benchmarks/bench_long_prompt.py " + " ".join(argv or sys.argv[1:]),
                              "machine": machine_description(), "date": time.strftime("%Y-%m-%d %H:%M"),
                              "huge_tokens": args.huge_tokens, "streams": args.streams, "results": []}
    for world in [int(w) for w in args.world_sizes.split(",")]:
        log = os.path.join(args.out_dir, f"long-prompt-serve-tp{world}.log")
        report["results"].append(asyncio.run(bench_world(world, args.backend, model, args, log)))
    md = report_md(report)
    print(md)
    with open(os.path.join(args.out_dir, "long_prompt.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out_dir, "long_prompt.md"), "w") as f:
        f.write(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

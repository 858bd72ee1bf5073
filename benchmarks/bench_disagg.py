"""Disaggregation benchmark: prefill/decode groups (``--pd``) and attention–FFN (``--afd``).

Every configuration runs on this one machine (loopback), on the embedded model in float32, and is
compared with one rank (TP=1) and, for AFD, TP=3 over MPI.  On 2 cores nothing here can be a
speed-up -- every extra rank takes cores from the others; the figures measure overheads and
overlap.

PD (``python benchmarks/bench_disagg.py --pd``), per prompt length (512 and 1,100 tokens):
  * TTFT as the client sees it, split into the prefill group's compute (from rank 0's admission
    to the end of the prefill's compute, ``pd_prefill_s``) and the transfer tail (from there to
    the K/V installed on every decode rank, ``pd_tail_s``);
  * the share of the K/V transfer hidden behind the prefill's compute:
    ``streamed / (streamed + tail)``, where ``streamed`` is how long before the end of the compute
    the first K/V frame arrived (``pd_streamed_s``);
  * K/V bytes per prompt token (computed for the model: layers x KV heads x head_dim x 2 x 4 B =
    46,080 B) next to the bytes received; decode tokens/s after the prompt.

AFD (``--afd``): decode tokens/s of one request and the aggregate of two concurrent ones, next to
TP=1 and TP=3; messages per token (computed: 2 x layers; and counted by the FFN rank) and bytes
per token (computed, and on the ring the loopback bytes per decode token); the FFN rank's idle
share (waiting for A2F / time inside forward passes) with and without ``--afd-microbatches 2``;
peak memory per role.

Prints a Markdown report (and ``--json PATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench import _loadavg, loopback_bytes, machine_description  # noqa: E402
from mlxcluster.model.topology import Topology  # noqa: E402
from mlxcluster.runtime.launcher import LocalCluster  # noqa: E402
from mlxcluster.security import new_secret  # noqa: E402
from mlxcluster.leader.generation import GenerationClient  # noqa: E402

PROMPT = "Here is a list of the planets in the solar system, with one fact about each:"
LONG = {n: [(i * 37 + n) % 40000 + 100 for i in range(n)] for n in (512, 1100)}
N_LAYERS, N_KV, HEAD_DIM, HIDDEN = 30, 3, 64, 576
KV_BYTES_PER_TOKEN = N_LAYERS * N_KV * HEAD_DIM * 2 * 4


def _gen(local_or_address, creds=None, **kw):
    address = getattr(local_or_address, "address", local_or_address)
    creds = creds or local_or_address.credentials
    client = GenerationClient(address, creds, timeout_s=600)
    try:
        return client.generate(**kw)
    finally:
        client.close()


def _best(runs: List, key) -> Any:
    return max(runs, key=key)


def bench_pd(model: str, repeats: int, decode_tokens: int) -> List[Dict[str, Any]]:
    rows = []
    with LocalCluster(1, model=model, weights="float32") as tp1:
        for n, ids in LONG.items():
            _gen(tp1, prompt_ids=ids[:8], max_tokens=2)  # warm-up
            runs = [_gen(tp1, prompt_ids=ids, max_tokens=decode_tokens) for _ in range(repeats)]
            r = min(runs, key=lambda r: r.ttft_s)
            rows.append({"config": "TP=1", "prompt_tokens": n, "ttft_s": r.ttft_s,
                         "decode_tok_s": max(x.decode_tokens_per_s for x in runs), "tokens": r.token_ids,
                         "peak_mib": [round(b / 2**20, 1) for b in r.peak_memory_bytes_per_rank]})
    for decode_ranks, backend in ((1, "ring"), (3, "mpi")):
        secret = new_secret()
        with LocalCluster(1, model=model, weights="float32", topology=Topology(role="prefill"), secret=secret) as pre:
            with LocalCluster(decode_ranks, backend, model=model, weights="float32", secret=secret,
                              topology=Topology(prefill_peer=pre.address)) as dec:
                _gen(dec, prompt_ids=LONG[512][:8], max_tokens=2)  # warm-up (connects the channels)
                for n, ids in LONG.items():
                    runs = [_gen(dec, prompt_ids=ids, max_tokens=decode_tokens) for _ in range(repeats)]
                    r = min(runs, key=lambda r: r.ttft_s)
                    streamed, tail = max(r.pd_streamed_s, 0.0), r.pd_tail_s
                    rows.append({
                        "config": f"--pd 1:{decode_ranks} {backend if decode_ranks > 1 else ''}".strip(),
                        "prompt_tokens": n, "ttft_s": r.ttft_s, "pd_prefill_s": r.pd_prefill_s, "pd_tail_s": tail,
                        "pd_streamed_s": r.pd_streamed_s,
                        "hidden_share": streamed / (streamed + tail) if streamed + tail > 0 else None,
                        "kv_bytes": r.handoff_bytes, "kv_bytes_per_token": r.handoff_bytes / n,
                        "decode_tok_s": max(x.decode_tokens_per_s for x in runs), "tokens": r.token_ids,
                        "peak_mib": [round(b / 2**20, 1) for b in r.peak_memory_bytes_per_rank]})
    return rows


def _concurrent(local, decode_tokens: int) -> float:
    """Aggregate tokens/s of two concurrent requests: all their tokens over the wall time from the
    first start to the last end (their prefills included)."""
    out: Dict[int, Any] = {}
    barrier = threading.Barrier(2, timeout=60)

    starts: Dict[int, float] = {}

    def run(i):
        barrier.wait()
        starts[i] = time.perf_counter()
        r = _gen(local, prompt=PROMPT, max_tokens=decode_tokens, temperature=0.0)
        out[i] = (time.perf_counter(), r)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    wall = max(end for end, _ in out.values()) - min(starts.values())
    return sum(len(r.token_ids) for _, r in out.values()) / wall


def _ffn_counters(local) -> Optional[Dict[str, float]]:
    events = [e for e in local.events if e.get("event") == "counters" and e.get("of_rank") == 1]
    return events[-1] if events else None


def bench_afd(model: str, repeats: int, decode_tokens: int) -> List[Dict[str, Any]]:
    rows = []
    configs = [("TP=1", 1, "ring", None), ("TP=3 mpi", 3, "mpi", None),
               ("--afd 1:1 mpi", 2, "mpi", Topology(afd="1:1")),
               ("--afd 1:1 mpi, 2 micro-batches", 2, "mpi", Topology(afd="1:1", afd_microbatches=2)),
               ("--afd 2:1 mpi", 3, "mpi", Topology(afd="2:1")),
               ("--afd 2:1 mpi, 2 micro-batches", 3, "mpi", Topology(afd="2:1", afd_microbatches=2)),
               ("--afd 1:1 ring", 2, "ring", Topology(afd="1:1"))]
    for name, world, backend, topology in configs:
        with LocalCluster(world, backend, model=model, weights="float32", topology=topology) as local:
            _gen(local, prompt=PROMPT, max_tokens=4)  # warm-up
            lo0 = loopback_bytes()
            lone = [_gen(local, prompt=PROMPT, max_tokens=decode_tokens) for _ in range(repeats)]
            lo1 = loopback_bytes()
            c0 = _ffn_counters(local)
            pair = _concurrent(local, decode_tokens)
            c1 = _ffn_counters(local)
            best = max(lone, key=lambda r: r.decode_tokens_per_s)
            row = {"config": name, "decode_tok_s": best.decode_tokens_per_s, "two_concurrent_tok_s": pair,
                   "tokens": best.token_ids, "peak_mib": [round(b / 2**20, 1) for b in best.peak_memory_bytes_per_rank]}
            steps = sum(len(r.token_ids) for r in lone)
            if lo0 is not None and lo1 is not None and backend == "ring":
                row["loopback_bytes_per_token"] = (lo1 - lo0) / steps
            if topology is not None:
                a = int(topology.afd.split(":")[0])
                row["messages_per_token_computed"] = 2 * N_LAYERS + (2 if a == 2 else 0)
                row["bytes_per_token_computed"] = row["messages_per_token_computed"] * HIDDEN * 4
            if c0 and c1:
                first = [e for e in local.events if e.get("event") == "counters" and e.get("of_rank") == 1][0]
                # a request of N tokens is N forward passes (the prefill and N - 1 decode steps)
                row["ffn_sends_per_pass"] = (c0["messages"] - first["messages"]) / steps
                lone_idle = c0["idle_s"] - first["idle_s"]
                lone_busy = c0["busy_s"] - first["busy_s"]
                row["ffn_idle_share_lone"] = lone_idle / (lone_idle + lone_busy) if lone_idle + lone_busy else None
                idle, busy = c1["idle_s"] - c0["idle_s"], c1["busy_s"] - c0["busy_s"]
                row["ffn_idle_share_two"] = idle / (idle + busy) if idle + busy else None
            rows.append(row)
    return rows


def _f(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def markdown(report: Dict[str, Any]) -> str:
    L = [f"Machine: {report['machine']}; float32 weights; load average at start {report['load_start']}, "
         f"at end {report['load_end']}; {report['seconds']:.0f} s in all.", ""]
    if report.get("pd"):
        L += ["| configuration | prompt tokens | TTFT ms | prefill compute ms | transfer tail ms | first K/V frame before "
              "compute end, ms | share of transfer hidden | K/V bytes per prompt token (computed 46,080) | decode tok/s "
              "| same tokens as TP=1 | peak MiB per rank |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
        ref = {r["prompt_tokens"]: r["tokens"] for r in report["pd"] if r["config"] == "TP=1"}
        for r in report["pd"]:
            ms = lambda k: _f(r.get(k) and r[k] * 1000, ".0f")  # noqa: E731
            L.append(f"| {r['config']} | {r['prompt_tokens']} | {ms('ttft_s')} | {ms('pd_prefill_s')} | "
                     f"{ms('pd_tail_s')} | {ms('pd_streamed_s')} | {_f(r.get('hidden_share'), '.0%')} | "
                     f"{_f(r.get('kv_bytes_per_token'), ',.0f')} | {_f(r['decode_tok_s'])} | "
                     f"{'yes' if r['tokens'] == ref[r['prompt_tokens']] else 'NO'} | {r.get('peak_mib', '')} |")
        L.append("")
    if report.get("afd"):
        L += ["| configuration | decode tok/s (1 request) | tok/s of 2 concurrent requests (aggregate) | messages per token "
              "(computed; FFN sends per pass, counted) | bytes per token (computed) | loopback B per token (ring) | FFN idle "
              "share, 1 request | FFN idle share, 2 concurrent | same tokens as TP=1 | peak MiB per rank |",
              "|---|---:|---:|---|---:|---:|---:|---:|---|---|"]
        ref = report["afd"][0]["tokens"]
        for r in report["afd"]:
            msgs = "-" if "messages_per_token_computed" not in r else \
                f"{r['messages_per_token_computed']}; FFN sends {_f(r.get('ffn_sends_per_pass'), '.1f')}"
            L.append(f"| {r['config']} | {_f(r['decode_tok_s'])} | {_f(r['two_concurrent_tok_s'])} | {msgs} | "
                     f"{_f(r.get('bytes_per_token_computed'), ',.0f')} | {_f(r.get('loopback_bytes_per_token'), ',.0f')} | "
                     f"{_f(r.get('ffn_idle_share_lone'), '.0%')} | {_f(r.get('ffn_idle_share_two'), '.0%')} | "
                     f"{'yes' if r['tokens'] == ref else 'NO'} | {r['peak_mib']} |")
    return "\n".join(L)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pd", action="store_true", help="prefill/decode disaggregation only")
    p.add_argument("--afd", action="store_true", help="attention-FFN disaggregation only")
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.decode_tokens < 2:
        print("bench_disagg: --repeats >= 1 and --decode-tokens >= 2", file=sys.stderr)
        return 2
    from mlxcluster.model.loader import inspect_model

    model = inspect_model(args.model).path
    both = not args.pd and not args.afd
    t0, load0 = time.perf_counter(), _loadavg()
    report: Dict[str, Any] = {"machine": machine_description(), "load_start": load0}
    if args.pd or both:
        report["pd"] = bench_pd(model, args.repeats, args.decode_tokens)
    if args.afd or both:
        report["afd"] = bench_afd(model, args.repeats, args.decode_tokens)
    report["load_end"], report["seconds"] = _loadavg(), time.perf_counter() - t0
    print(markdown(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

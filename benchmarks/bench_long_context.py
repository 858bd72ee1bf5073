"""Long-context equality across topologies, at 4K and 8K tokens, beside mlx-lm's prefill (issue 32, item 1).

``tests/test_long_context.py`` checks a ~2K-token prompt in the suite; this runs the longer prompts once
(MLX's CPU attention makes each one minutes long here). For each prompt length (``--tokens``) and each
topology (``--topologies``) on the embedded model (SmolLM2-135M, 8,192 positions, float32):

* **tp1**: one rank, the reference; **tp3-mpi** / **tp3-ring**: TP=3 over MPI / MLX's ring;
  **pipeline**: two stages over MPI, layers ``15:output,0:14`` (the test's); **pd**: PD 1:1 (a prefill
  group of one rank streaming its K/V to a decode group of one rank, over the ring: the test's pair).
* Each topology's group is started once (``tests/harness.py``'s ``Groups``; the PD pair is
  ``tests/test_pd_real.py``'s) and answers every length: one short warm-up request, then each prompt,
  greedy, ``--answer-tokens`` (8) tokens, with the top-20 log-probabilities of each token.
* The prompts are real English text -- this project's README, ARCHITECTURE and BENCHMARKS, then (if ever
  short) the package's module docstrings, in that order, as the model's tokenizer reads them -- one
  disjoint slice per length, so no prompt shares a prefix with another and the prefix cache cannot help
  (each answer's ``cached_prompt_tokens`` is recorded: 0). A length is capped at the model's context less
  the answer (8,192 -> 8,184 tokens: a prompt and its answer must fit).
* Reported against TP=1: whether the greedy tokens are equal, and the max |delta log-probability| at the
  last prompt position (the first answer token's distribution) over TP=1's top-20 tokens also in the
  topology's top 20 (as the test names it; log-probabilities are the logits less their logsumexp, so this
  compares the logits up to that one per-position constant). PD reports no log-probabilities (a PD group
  refuses ``logprobs``), and its last prompt position is computed by the prefill group -- one rank, as
  TP=1 -- so PD is compared on its tokens (produced from the streamed K/V by the decode group) and on the
  K/V bytes it received (``handoff_bytes``, no fallback).
* TTFT is the server's (``ttft_s``: admission to the first token, i.e. the prefill), prefill tok/s the
  server's, total the client's wall time of the request.
* **mlx-lm** alone (``mlx_lm.utils.load`` of the GGUF exported float32 once, ``generate_step`` greedy) on
  the same token ids, in a process of its own per length (the ranks' BLAS environment), after every
  group has stopped: its prefill time is the time to its first token. After ``--mlx-lm-timeout`` seconds
  (default 1800) it is stopped and reported as "> N s (stopped)" with the prompt tokens it had prefilled
  (mlx-lm's CPU prefill of ~6K tokens took more than 10 minutes here). Its first tokens and top-20
  log-probabilities are compared with TP=1's too. ``--skip-mlx-lm`` skips it.

Prints a Markdown table (one row per length x topology) and writes JSON (``--out FILE``, rewritten after
each topology). Every group and worker is stopped in ``finally`` (SIGTERM included). Exit status 1 only
when a measurement could not be taken (a group that does not start, a request that fails, an mlx-lm
worker that fails other than by its timeout); unequal tokens are a result, not a failure.

Usage: python benchmarks/bench_long_context.py [--tokens 4096,8192]
           [--topologies tp1,tp3-mpi,tp3-ring,pipeline,pd] [--answer-tokens 8] [--skip-mlx-lm]
           [--mlx-lm-timeout 1800] [--mlx-dir DIR] [--out long_context.json]
Expected run time (2 cores, quiet machine -- run nothing else beside it, its TTFTs are the figures): ~25-35
min for the five topologies at 4K and 8K (TP=1 prefills ~4K tokens in ~40 s and ~8K in ~3 min; TP=3 over
the ring about twice that), then mlx-lm's two prefills, each stopped after at most ``--mlx-lm-timeout``
(30 min): up to ~1.5 h in all. A smoke run (``--tokens 600 --topologies tp1,tp3-mpi,pd``) takes ~1 min.
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
TESTS = os.path.join(ROOT, "tests")
if TESTS not in sys.path:  # the tests' own group machinery (harness.Groups, test_pd_real._Pd)
    sys.path.insert(0, TESTS)

from benchmarks.common import exit_on_sigterm, machine_description, prepare_mlx_dir, scratch_dir  # noqa: E402

__all__ = ["main", "real_text_ids", "compare"]

TOPOLOGIES = ("tp1", "tp3-mpi", "tp3-ring", "pipeline", "pd")
LABELS = {"tp1": "TP=1", "tp3-mpi": "TP=3 mpi", "tp3-ring": "TP=3 ring",
          "pipeline": "pipeline 15:output,0:14 (mpi)", "pd": "PD 1:1 (ring)"}
TOP_LOGPROBS = 20
#: documents read first, in this order; then the package's module docstrings (sorted paths)
DOCUMENTS = ("README.md", "ARCHITECTURE.md", "BENCHMARKS.md")
WARM_UP = dict(prompt="Hello, world.", max_tokens=2)
#: (world size, backend, rank options) of each plain topology (``pd`` is the test's pair)
GROUP_ARGS = {"tp1": (1, "ring", None), "tp3-mpi": (3, "mpi", None), "tp3-ring": (3, "ring", None),
              "pipeline": (2, "mpi", "15:output,0:14")}  # world size, backend, --layers


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- prompts ------------------------------------------------------------------------------------
def real_text(min_chars: int = 0) -> str:
    """This project's documents (:data:`DOCUMENTS`), then, while shorter than ``min_chars``, the module
    docstrings of ``mlxcluster/`` (sorted paths): real English text, the same for the same checkout."""
    parts = []
    for name in DOCUMENTS:
        with open(os.path.join(ROOT, name), encoding="utf-8") as fh:
            parts.append(fh.read())
    for path in sorted(glob.glob(os.path.join(ROOT, "mlxcluster", "**", "*.py"), recursive=True)):
        if sum(len(p) for p in parts) >= min_chars:
            break
        with open(path, encoding="utf-8") as fh:
            doc = ast.get_docstring(ast.parse(fh.read()))
        if doc:
            parts.append(doc)
    return "\n\n".join(parts) + "\n\n"


def real_text_ids(tokenizer, tokens: int) -> List[int]:
    """At least ``tokens`` token ids of :func:`real_text` (its prefix that many tokens long).

    Raises:
        SystemExit: the checkout's text is shorter (one line naming what is there).
    """
    chars = 0
    while True:
        chars = max(4 * tokens, 2 * chars)
        text = real_text(chars)
        ids = list(tokenizer.encode(text))
        if len(ids) >= tokens:
            return ids[:tokens]
        if len(text) < chars:  # every source read
            raise SystemExit(f"the real text has only {len(ids)} tokens; ask for fewer than {tokens}")


def make_prompts(tokenizer, lengths: Sequence[int]) -> Dict[int, List[int]]:
    """One disjoint slice of the real text per length, in order (no prompt is another's prefix)."""
    ids = real_text_ids(tokenizer, sum(lengths))
    out, at = {}, 0
    for n in lengths:
        out[n] = ids[at:at + n]
        at += n
    return out


# -- comparison -----------------------------------------------------------------------------------
def compare(got_tokens: Sequence[int], got_top: Optional[Sequence[Tuple[int, float]]], ref_tokens: Sequence[int],
            ref_top: Optional[Sequence[Tuple[int, float]]]) -> Dict[str, Any]:
    """``tokens_equal``; with both top-k lists of the last prompt position (the first answer token's):
    ``max_abs_delta_logprob`` over the reference's top tokens also in ``got_top`` (``common_top``
    of them) and ``top5_equal`` (the five most likely tokens in the same order)."""
    out: Dict[str, Any] = {"tokens_equal": list(got_tokens) == list(ref_tokens),
                           "max_abs_delta_logprob": None, "common_top": None, "top5_equal": None}
    if got_top and ref_top:
        ref_of = {int(t): float(lp) for t, lp in ref_top}
        deltas = [abs(float(lp) - ref_of[int(t)]) for t, lp in got_top if int(t) in ref_of]
        out.update(max_abs_delta_logprob=max(deltas) if deltas else None, common_top=len(deltas),
                   top5_equal=[int(t) for t, _ in got_top[:5]] == [int(t) for t, _ in ref_top[:5]])
    return out


# -- mlxcluster groups ------------------------------------------------------------------------------
def _group(pool, model: str, topology: str, timeout_s: float):
    """The running group of ``topology`` (``pool``: a ``harness.Groups``): what answers requests."""
    if topology == "pd":
        from test_pd_real import _Pd

        return pool.hold("pd 1 ring", lambda: _Pd(model, 1, "ring")).decode
    from mlxcluster.model.topology import Topology

    world, backend, layers = GROUP_ARGS[topology]
    return pool.get(world, backend, step_timeout_s=timeout_s, **({"topology": Topology(layers=layers)} if layers else {}))


def run_topology(pool, model: str, topology: str, prompts: Dict[int, List[int]], answer_tokens: int,
                 timeout_s: float, rows: List[Dict[str, Any]]) -> None:
    """One row per prompt length appended to ``rows`` as it is measured: the group of ``topology``
    started once, each prompt answered once."""
    from harness import answers

    t0 = time.perf_counter()
    group = _group(pool, model, topology, timeout_s)
    startup_s = time.perf_counter() - t0
    progress(f"{LABELS[topology]}: group ready in {startup_s:.1f} s")
    answers(group.address, group.credentials, [WARM_UP], timeout_s=timeout_s)
    for n, ids in prompts.items():
        request = dict(prompt_ids=ids, max_tokens=answer_tokens)
        if topology != "pd":  # a PD group refuses logprobs (its prefill group samples the first token)
            request.update(logprobs=True, top_logprobs=TOP_LOGPROBS)
        progress(f"{LABELS[topology]}: {n}-token prompt")
        t1 = time.perf_counter()
        (r,) = answers(group.address, group.credentials, [request], timeout_s=timeout_s)
        total = time.perf_counter() - t1
        row = {"prompt_tokens": n, "topology": topology, "label": LABELS[topology], "ok": True,
               "startup_s": round(startup_s, 2), "ttft_s": round(r.ttft_s, 3),
               "prefill_tokens_per_s": round(r.prefill_tokens_per_s, 1), "total_s": round(total, 3),
               "cached_prompt_tokens": r.cached_prompt_tokens, "token_ids": list(r.token_ids),
               "reason": r.reason,
               "top_logprobs_first": [[int(t), float(lp)] for t, lp in r.logprobs[0][1]] if r.logprobs else None,
               "peak_memory_mib_per_rank": [round(b / 2**20, 1) for b in r.peak_memory_bytes_per_rank]}
        if topology == "pd":
            row.update(handoff_bytes=r.handoff_bytes, handoff_fallback=r.handoff_fallback,
                       pd_prefill_s=round(r.pd_prefill_s, 3), pd_tail_s=round(r.pd_tail_s, 3))
        progress(f"{LABELS[topology]}: {n} tokens: TTFT {r.ttft_s:.2f} s, total {total:.2f} s, "
                 f"tokens {list(r.token_ids)}")
        rows.append(row)


# -- mlx-lm ------------------------------------------------------------------------------------------
def _worker_mlxlm(argv: Sequence[str]) -> int:
    """In its own process: mlx-lm on one prompt (``--prompt FILE``: a JSON list of ids): ``ready``
    once the model is loaded, ``prefilled`` events as the prompt goes in, then ``result`` (time to
    the first token, the tokens, the first token's top log-probabilities)."""
    from mlxcluster.runtime.supervisor import emit

    p = argparse.ArgumentParser(prog="bench_long_context.py --worker-mlxlm")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("--answer-tokens", type=int, default=8)
    a = p.parse_args(argv)
    try:
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.utils import load

        model, tokenizer = load(a.model_dir)
        mx.eval(model.parameters())
        eos = set(tokenizer.eos_token_ids)
        with open(a.prompt) as f:
            ids = json.load(f)
        emit("ready", rank=0)

        def prefilled(done: int, total: int) -> None:
            emit("prefilled", rank=0, done=int(done), total=int(total))

        t0 = time.perf_counter()
        first_s, tokens, top = None, [], None
        for tok, logprobs in generate_step(mx.array(ids), model, max_tokens=a.answer_tokens,
                                           prompt_progress_callback=prefilled):
            tokens.append(int(tok))
            if first_s is None:
                first_s = time.perf_counter() - t0
                flat = logprobs.reshape(-1)
                order = mx.argsort(-flat)[:TOP_LOGPROBS].tolist()
                values = flat[mx.array(order)].tolist()
                top = [[int(t), float(v)] for t, v in zip(order, values)]
                emit("first", rank=0, prefill_s=first_s)
            if tokens[-1] in eos:
                break
        emit("result", rank=0, prefill_s=first_s, token_ids=tokens, top_logprobs_first=top,
             peak_memory_mib=round(mx.get_peak_memory() / 2**20, 1))
        return 0
    except Exception as exc:  # reported as the row's error
        emit("error", rank=0, message=f"{type(exc).__name__}: {exc}")
        return 1


def run_mlxlm(mlx_dir: str, ids: List[int], answer_tokens: int, timeout_s: float, workdir: str) -> Dict[str, Any]:
    """mlx-lm's prefill of ``ids`` in a worker process (stopped after ``timeout_s`` s of prefill)."""
    from mlxcluster.runtime.supervisor import Supervisor, rank_env

    n = len(ids)
    prompt_file = os.path.join(workdir, f"prompt-{n}.json")
    with open(prompt_file, "w") as f:
        json.dump(ids, f)
    sup = Supervisor()
    row: Dict[str, Any] = {"prompt_tokens": n, "ok": False, "timeout_s": timeout_s}
    try:
        sup.spawn([sys.executable, os.path.abspath(__file__), "--worker-mlxlm", "--model-dir", mlx_dir,
                   "--prompt", prompt_file, "--answer-tokens", str(answer_tokens)], rank_env(1), "mlx-lm")

        def seen(kind: str) -> List[dict]:
            return [e for e in sup.events if e["event"] == kind]

        def settled(kind: str):
            return lambda: bool(seen(kind)) or sup.failure is not None

        if not sup.wait_for(settled("ready"), 300) or not seen("ready"):
            row["error"] = sup.failure or "mlx-lm did not load the model within 300 s"
            return row
        t0 = time.perf_counter()
        finished = sup.wait_for(settled("result"), timeout_s)
        waited = time.perf_counter() - t0
        results = seen("result")
        if results:
            r = results[-1]
            row.update(ok=True, prefill_s=round(r["prefill_s"], 3),
                       prefill_tokens_per_s=round(n / r["prefill_s"], 1), token_ids=r["token_ids"],
                       top_logprobs_first=r["top_logprobs_first"], peak_memory_mib=r["peak_memory_mib"])
        elif not finished:
            done = [e["done"] for e in seen("prefilled")]
            row.update(ok=True, stopped=True, prefill_s=None, waited_s=round(waited, 1),
                       prefilled_tokens=max(done) if done else None)
            if seen("first"):  # prefilled, but the answer's decode steps ran past the limit
                row.update(prefill_s=round(seen("first")[-1]["prefill_s"], 3), stopped=False)
        else:
            row["error"] = sup.failure or "mlx-lm exited without a result"
        return row
    finally:
        sup.stop()


# -- report ---------------------------------------------------------------------------------------
def _fmt(x, spec: str = ".2f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def mlxlm_cell(m: Optional[Dict[str, Any]]) -> str:
    if m is None:
        return "not run"
    if m.get("error"):
        return f"failed: {m['error'][:80]}"
    if m.get("stopped"):
        got = m.get("prefilled_tokens")
        return (f"> {m['timeout_s']:.0f} s (stopped" + (f"; {got} of {m['prompt_tokens']} tokens prefilled" if got
                                                          else "") + ")")
    return f"{m['prefill_s']:.1f} ({m['prefill_tokens_per_s']:.0f} tok/s)"


def markdown(report: Dict[str, Any]) -> str:
    lines = [f"Command: `{report['command']}`; {report['machine']}, {report['date']}; {report['model']}, float32, "
             f"greedy, {report['answer_tokens']} answer tokens.", "",
             "| prompt tokens | topology | TTFT s | prefill tok/s | total s | tokens = TP=1 "
             "| max abs delta logprob, last prompt position (top 20) | mlx-lm prefill s |",
             "|---:|---|---:|---:|---:|---|---:|---|"]
    mlxlm = {m["prompt_tokens"]: m for m in report.get("mlx_lm", [])}
    for r in report["rows"]:
        m = mlxlm_cell(mlxlm.get(r["prompt_tokens"])) if not report["skip_mlx_lm"] else "skipped"
        if not r.get("ok"):
            lines.append(f"| {r['prompt_tokens']} | {r['label']} | failed: {r.get('error', '')[:100]} | | | | | {m} |")
            continue
        c = r.get("vs_tp1") or {}
        if r["topology"] == "tp1":
            equal, delta = "(reference)", "(reference)"
        else:
            equal = {True: "yes", False: "**no**", None: "-"}[c.get("tokens_equal")]
            if r["topology"] == "pd":
                delta = "- (prefill group: one rank; no logprobs)"
            else:
                delta = _fmt(c.get("max_abs_delta_logprob"), ".1e")
                if c.get("top5_equal") is False:
                    delta += " (top 5 differ)"
        if r.get("cached_prompt_tokens"):
            equal += f" ({r['cached_prompt_tokens']} cached!)"
        lines.append(f"| {r['prompt_tokens']} | {r['label']} | {_fmt(r['ttft_s'])} | {_fmt(r['prefill_tokens_per_s'], '.1f')} "
                     f"| {_fmt(r['total_s'])} | {equal} | {delta} | {m} |")
    notes = []
    for r in report["rows"]:
        if r.get("ok") and r["topology"] == "pd":
            notes.append(f"PD at {r['prompt_tokens']} tokens: {r['handoff_bytes']} K/V bytes received "
                         f"({r['handoff_bytes'] / r['prompt_tokens']:.0f} per prompt token), fallback: "
                         f"{r['handoff_fallback'] or 'none'}; prefill group {r['pd_prefill_s']} s, tail {r['pd_tail_s']} s.")
    for m in report.get("mlx_lm", []):
        c = m.get("vs_tp1")
        if c:
            notes.append(f"mlx-lm at {m['prompt_tokens']} tokens vs TP=1: tokens equal "
                         f"{'yes' if c['tokens_equal'] else 'no'}, max abs delta logprob at the last prompt position "
                         f"{_fmt(c['max_abs_delta_logprob'], '.1e')}; peak {m.get('peak_memory_mib')} MiB.")
    if notes:
        lines += [""] + [f"* {n}" for n in notes]
    return "\n".join(lines)


def _write(path: Optional[str], report: Dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="4096,8192", help="prompt lengths, comma-separated (capped at the model's "
                                                         "context less --answer-tokens)")
    p.add_argument("--topologies", default=",".join(TOPOLOGIES),
                   help=f"comma-separated, from {', '.join(TOPOLOGIES)} (tp1, the reference, always runs, first)")
    p.add_argument("--answer-tokens", type=int, default=8)
    p.add_argument("--model", default=None, help="model reference (default: the embedded SmolLM2-135M)")
    p.add_argument("--request-timeout", type=float, default=1800.0,
                   help="seconds a request (and a group's prefill chunk) may take before it counts as failed")
    p.add_argument("--skip-mlx-lm", action="store_true")
    p.add_argument("--mlx-lm-timeout", type=float, default=1800.0,
                   help="seconds mlx-lm may prefill one prompt before it is stopped")
    p.add_argument("--mlx-dir", default=None, help="an mlx-lm directory of the model (default: the GGUF exported "
                                                   "float32 into a scratch directory)")
    p.add_argument("--out", default=None, help="write the JSON report here")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker-mlxlm"]:
        return _worker_mlxlm(argv[1:])
    args = _parse(argv)
    exit_on_sigterm()
    from harness import Groups
    from mlxcluster.model.loader import inspect_model, read_model, tokenizer_of
    from mlxcluster.runtime.launcher import mpirun_path

    topologies = ["tp1"] + [t.strip() for t in args.topologies.split(",") if t.strip() and t.strip() != "tp1"]
    unknown = [t for t in topologies if t not in TOPOLOGIES]
    if unknown:
        print(f"--topologies: unknown {', '.join(unknown)}; choose from {', '.join(TOPOLOGIES)}", file=sys.stderr)
        return 2
    info = inspect_model(args.model)
    cap = info.context_length - args.answer_tokens
    lengths = sorted({min(int(t), cap) for t in args.tokens.split(",") if t.strip()})
    tokenizer, _ = tokenizer_of(read_model(info.path, tokenizer=False))
    prompts = make_prompts(tokenizer, lengths)
    report: Dict[str, Any] = {
        "command": "python benchmarks/bench_long_context.py " + " ".join(argv), "machine": machine_description(),
        "date": time.strftime("%Y-%m-%d %H:%M"), "model": info.name, "model_path": info.path, "weights": "float32",
        "context_length": info.context_length, "answer_tokens": args.answer_tokens, "top_logprobs": TOP_LOGPROBS,
        "prompt_tokens": lengths, "prompt_source": list(DOCUMENTS) + ["mlxcluster/**/*.py module docstrings"],
        "topologies": topologies, "skip_mlx_lm": args.skip_mlx_lm, "rows": [], "mlx_lm": [], "skipped": []}
    failed = False
    pool = Groups(info.path)
    workdir = tempfile.mkdtemp(prefix="mlxc-long-context-", dir=scratch_dir())
    t_start = time.perf_counter()
    try:
        for topology in topologies:
            if GROUP_ARGS.get(topology, (0, ""))[1] == "mpi" and mpirun_path() is None:
                report["skipped"].append({"topology": topology, "reason": "mpirun not installed"})
                progress(f"{LABELS[topology]}: skipped (mpirun not installed)")
                continue
            rows: List[Dict[str, Any]] = []
            try:
                run_topology(pool, info.path, topology, prompts, args.answer_tokens, args.request_timeout, rows)
            except Exception as exc:  # a group that does not start, a request that fails: the rows not measured
                failed = True
                reason = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:300]
                progress(f"{LABELS[topology]}: FAILED: {reason}")
                rows += [{"prompt_tokens": n, "topology": topology, "label": LABELS[topology], "ok": False,
                          "error": reason} for n in lengths[len(rows):]]
            finally:
                pool.evict()  # one group at a time: nothing else competes for the two cores
            report["rows"] += rows
            _compare_rows(report)
            _write(args.out, report)
        if not args.skip_mlx_lm:
            mlx_dir = args.mlx_dir
            if mlx_dir is None:
                progress("exporting the model for mlx-lm (float32)")
                mlx_dir = prepare_mlx_dir(info.path, "float32", workdir)
            for n in lengths:
                progress(f"mlx-lm: {n}-token prompt (stopped after {args.mlx_lm_timeout:.0f} s)")
                m = run_mlxlm(mlx_dir, prompts[n], args.answer_tokens, args.mlx_lm_timeout, workdir)
                failed = failed or bool(m.get("error"))
                progress(f"mlx-lm: {n} tokens: {mlxlm_cell(m)}")
                report["mlx_lm"].append(m)
                _compare_rows(report)
                _write(args.out, report)
    finally:
        pool.close()
        shutil.rmtree(workdir, ignore_errors=True)
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    _write(args.out, report)
    print(markdown(report))
    print(f"\n(wall time {report['wall_s']:.0f} s)")
    return 1 if failed else 0


def _compare_rows(report: Dict[str, Any]) -> None:
    """Each row's (and mlx-lm's) comparison with TP=1's row of its length (``vs_tp1``)."""
    ref = {r["prompt_tokens"]: r for r in report["rows"] if r["topology"] == "tp1" and r.get("ok")}
    for r in report["rows"] + report.get("mlx_lm", []):
        base = ref.get(r["prompt_tokens"])
        if r.get("ok") and r.get("token_ids") is not None and base is not None and r is not base:
            r["vs_tp1"] = compare(r["token_ids"], r.get("top_logprobs_first"), base["token_ids"],
                                  base.get("top_logprobs_first"))


if __name__ == "__main__":
    sys.exit(main())

"""``mlxcluster bench --serving``: ``serve`` against ``mlx_lm.server`` under concurrent clients.

Both servers run the same float32 mlx-lm directory (the embedded GGUF exported with
``--dequantize``, as ``bench`` does), with OpenBLAS preloaded the same way (``rank_env``), and get
the same requests: greedy chat completions of ``--max-tokens`` tokens, streamed, from C concurrent
clients (C in ``--concurrency``, default 1, 8, 32, 64), ``max(8, 2 C)`` requests per level.
``mlx_lm.server`` is restarted per level with ``--decode-concurrency C --prompt-concurrency C`` (its
batching is sized at start); ``serve`` runs once per world size with its own defaults.  At TP=N
``mlx_lm.server`` runs as N ranks the way ``mlx.launch`` starts them (``local_processes``: ring
hostfile, or mpirun), ``serve --world-size N`` with the same backend.

Per level and server: output tok/s (completion tokens / wall time), TTFT p50/p95 (request sent to
first content chunk), inter-token latency p50/p95 (gaps between content chunks), requests/s, and
peak RSS per rank (``VmHWM``, reset before each level through ``/proc/PID/clear_refs``).  Writes
``serving.json``, ``serving.md`` and ``serving.png`` to ``--out-dir`` and prints the table, the
targets of issue 17 and, where one is missed, the measured reason.

Usage: mlxcluster bench --serving [--world-sizes 1,3] [--backend ring] [--concurrency 1,8,32,64]
       [--max-tokens 32] [--out-dir bench-out] [--skip-mlx-lm] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

PROMPTS = ["Tell me a short story about a lighthouse.", "Explain what a tensor is.", "Name three rivers in Europe.",
           "Write a haiku about autumn.", "What is the capital of Japan?", "Describe a cat in two sentences.",
           "Give me a tip for learning to cook.", "Why is the sky blue?"]
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 900.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(xs: Sequence[float], q: float) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


# -- processes -------------------------------------------------------------------------------
def _descendants(pid: int) -> List[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _rss_mb(pid: int, field: str = "VmHWM") -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _ranks(pids: Sequence[int], parents_are_ranks: bool = True) -> List[int]:
    """The model-holding processes among ``pids`` (unless ``parents_are_ranks`` is False: ``serve``
    itself holds no weights) and their descendants: those with an RSS above 100 MB."""
    every = (list(pids) if parents_are_ranks else []) + [d for p in pids for d in _descendants(p)]
    return sorted({p for p in every if _rss_mb(p, "VmRSS") > 100})


def _reset_peaks(pids: Sequence[int]) -> None:
    for p in pids:
        try:
            with open(f"/proc/{p}/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS (proc(5))
        except OSError:
            pass


async def _wait_http(url: str, proc_alive, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if not proc_alive():
                raise RuntimeError("the server exited while starting")
            try:
                if (await client.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"no answer at {url} within {timeout_s:.0f} s")


class Serve:
    """``mlxcluster serve`` on ``model`` (TP=``world``)."""

    name = "mlxcluster serve"

    def __init__(self, model: str, world: int, backend: str, log: str, extra: Sequence[str] = ()):
        self.port = _free_port()
        self.log = open(log, "w")
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxcluster", "serve", "--model", model, "--model-name", "m", "--world-size",
             str(world), "--backend", backend, "--weights", "float32", "--port", str(self.port), "--log-level",
             "warning", *extra], env=env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        await _wait_http(self.url + "/health", lambda: self.proc.poll() is None, START_TIMEOUT_S)

    def pids(self) -> List[int]:
        return _ranks([self.proc.pid], parents_are_ranks=False)

    def capacity(self) -> Optional[int]:
        import httpx

        try:
            return int(httpx.get(self.url + "/health", timeout=10).json()["queue"]["capacity"])
        except (httpx.HTTPError, KeyError, ValueError):
            return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


class MlxLmServer:
    """``mlx_lm.server`` on ``model``: one process, or ``world`` ranks started the way
    ``mlx.launch`` starts them (only rank 0 serves HTTP)."""

    name = "mlx_lm.server"

    def __init__(self, model: str, world: int, backend: str, concurrency: int, max_tokens: int):
        from mlxcluster.runtime.launcher import local_processes
        from mlxcluster.runtime.supervisor import Supervisor, rank_env

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp = tempfile.mkdtemp(prefix="bench-mlxlm-")
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", model, "--host", "127.0.0.1", "--port",
               str(self.port), "--decode-concurrency", str(concurrency), "--prompt-concurrency", str(concurrency),
               "--max-tokens", str(max_tokens), "--log-level", "WARNING"]
        self.sup = Supervisor()
        for name, argv, env in local_processes(world, backend, cmd, rank_env(world), self.tmp):
            self.sup.spawn(argv, env, name)

    async def start(self) -> None:
        await _wait_http(self.url + "/v1/models", lambda: self.sup.failure is None, START_TIMEOUT_S)

    def pids(self) -> List[int]:
        return _ranks([p.pid for p in self.sup.processes])

    def stop(self) -> None:
        self.sup.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


# -- load ----------------------------------------------------------------------------------------
async def _one(client, url: str, model: str, prompt: str, max_tokens: int) -> Dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times: List[float] = []
    pieces: List[str] = []
    usage = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    times.append(time.perf_counter())
                    pieces.append(content)
    tokens = int(usage["completion_tokens"]) if usage else len(times)
    return {"ttft_s": times[0] - t0 if times else None, "gaps_s": [b - a for a, b in zip(times, times[1:])],
            "tokens": tokens, "text": "".join(pieces),
            # time per output token after the first (TPOT): the decode time over the tokens it gave
            "tpot_s": (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 and tokens > 1 else None}


async def run_level(url: str, model: str, concurrency: int, n_requests: int, max_tokens: int,
                    prompts: Sequence[str] = PROMPTS, answers: Optional[Dict[int, str]] = None) -> Dict[str, Any]:
    """``n_requests`` streamed chat requests, ``concurrency`` at a time (each client sends its next
    request when the previous one ended); request ``i`` asks ``prompts[i % len(prompts)]``.
    ``answers``: where given, request ``i``'s answer text is stored under ``i``."""
    import httpx

    queue: "asyncio.Queue[int]" = asyncio.Queue()
    for i in range(n_requests):
        queue.put_nowait(i)
    results: List[Dict[str, Any]] = []
    errors: List[str] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        async def worker() -> None:
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                try:
                    results.append(await _one(client, url, model, prompts[i % len(prompts)], max_tokens))
                    if answers is not None:
                        answers[i] = results[-1]["text"]
                except (httpx.HTTPError, RuntimeError, ValueError) as exc:
                    errors.append((str(exc) or type(exc).__name__)[:200])

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    gaps = [g for r in results for g in r["gaps_s"]]
    tpots = [r["tpot_s"] for r in results if r["tpot_s"] is not None]
    return {"concurrency": concurrency, "requests": n_requests, "ok": len(results), "errors": errors[:3],
            "wall_s": round(wall, 2), "output_tokens": tokens, "output_tok_s": round(tokens / wall, 2),
            "requests_s": round(len(results) / wall, 3),
            "ttft_p50_s": _round(_pct(ttfts, 50)), "ttft_p95_s": _round(_pct(ttfts, 95)),
            "itl_p50_ms": _round(_pct(gaps, 50), 1000), "itl_p95_ms": _round(_pct(gaps, 95), 1000),
            "tpot_p50_ms": _round(_pct(tpots, 50), 1000)}


def _round(x: Optional[float], scale: float = 1.0) -> Optional[float]:
    return None if x is None else round(x * scale, 3)


async def bench_server(make, levels: Sequence[int], max_tokens: int, restart_per_level: bool,
                       quick: bool) -> List[Dict[str, Any]]:
    rows = []
    server = None
    try:
        for c in levels:
            if server is None or restart_per_level:
                if server is not None:
                    server.stop()
                server = make(c)
                await server.start()
                await run_level(server.url, "m" if isinstance(server, Serve) else "default_model", 1, 1, 4)  # warm
            pids = server.pids()
            _reset_peaks(pids)
            n = max(4 if quick else 8, 2 * c)
            row = await run_level(server.url, "m" if isinstance(server, Serve) else "default_model", c, n, max_tokens)
            row["peak_rss_mb_per_rank"] = [round(_rss_mb(p)) for p in pids]
            if isinstance(server, Serve):
                row["capacity"] = server.capacity()
            rows.append(row)
            print(f"  {server.name}: concurrency {c}: {row['output_tok_s']} tok/s, TTFT p50/p95 "
                  f"{row['ttft_p50_s']}/{row['ttft_p95_s']} s, ITL p50/p95 {row['itl_p50_ms']}/{row['itl_p95_ms']} ms, "
                  f"{row['requests_s']} req/s, peak RSS/rank {row['peak_rss_mb_per_rank']} MB"
                  + (f", {len(row['errors'])} error(s): {row['errors']}" if row["errors"] else ""), flush=True)
    finally:
        if server is not None:
            server.stop()
    return rows


# -- report ----------------------------------------------------------------------------------------
def targets(report: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Issue 17's targets per world size: tok/s ratio >= 1.2 at 32 and 64 and >= 1.0 at 1 and 8;
    TTFT p95 at 32 no worse than mlx_lm.server's; each with the measured reason when missed."""
    out = []
    for world, res in report["results"].items():
        ours = {r["concurrency"]: r for r in res.get("serve", [])}
        theirs = {r["concurrency"]: r for r in res.get("mlx_lm", [])}
        for c in sorted(ours):
            if c not in theirs or not theirs[c]["output_tok_s"]:
                continue
            need = 1.2 if c >= 32 else 1.0
            ratio = ours[c]["output_tok_s"] / theirs[c]["output_tok_s"]
            t = {"world_size": world, "target": f"output tok/s >= {need}x mlx_lm.server at concurrency {c}",
                 "measured": round(ratio, 2), "met": ratio >= need}
            if not t["met"]:
                t["reason"] = _reason(ours[c], theirs[c])
            out.append(t)
        if 32 in ours and 32 in theirs and ours[32]["ttft_p95_s"] is not None and theirs[32]["ttft_p95_s"]:
            met = ours[32]["ttft_p95_s"] <= theirs[32]["ttft_p95_s"]
            t = {"world_size": world, "target": "TTFT p95 at concurrency 32 <= mlx_lm.server's",
                 "measured": f"{ours[32]['ttft_p95_s']} s vs {theirs[32]['ttft_p95_s']} s", "met": met}
            if not met:
                t["reason"] = _reason(ours[32], theirs[32])
            out.append(t)
    return out


def _reason(ours: Dict[str, Any], theirs: Dict[str, Any]) -> str:
    c, cap = ours["concurrency"], ours.get("capacity")
    parts = []
    if cap is not None and cap < c:
        parts.append(f"serve decodes at most {cap} sequences together (rank 0's max_batch): {c - cap} of {c} "
                     f"clients wait in its queue, so TTFT p95 {ours['ttft_p95_s']} s includes that wait")
    if ours["itl_p95_ms"] and theirs["itl_p95_ms"] and ours["itl_p95_ms"] > 1.2 * theirs["itl_p95_ms"]:
        parts.append(f"the batch stalls while waiting prompts are prefilled one at a time between decode steps "
                     f"(no batched prefill): ITL p95 {ours['itl_p95_ms']:.0f} ms vs {theirs['itl_p95_ms']:.0f} ms, "
                     f"TTFT p95 {ours['ttft_p95_s']} s vs {theirs['ttft_p95_s']} s")
    if ours["itl_p50_ms"] and theirs["itl_p50_ms"]:
        parts.append(f"per-step time (ITL p50) {ours['itl_p50_ms']:.0f} ms vs {theirs['itl_p50_ms']:.0f} ms "
                     f"for {min(c, cap or c)} vs {c} sequences per step")
    failed = theirs.get("requests", 0) - theirs.get("ok", 0)
    if failed > 0:
        parts.append(f"mlx_lm.server dropped {failed} of {theirs['requests']} requests (their slots freed; its "
                     "tok/s counts the rest)")
    return "; ".join(parts) or "no cause measured"


def markdown(report: Dict[str, Any]) -> str:
    lines = [f"`mlxcluster bench --serving` on {report['machine']} ({report['date']}); {report['max_tokens']}-token "
             f"greedy streamed chat requests, float32 mlx-lm directory, backend {report['backend']}"
             + (f", serve {' '.join(report['serve_args'])}" if report.get("serve_args") else "") + ".", "",
             "| TP | clients | server | output tok/s | TTFT p50 / p95 (s) | ITL p50 / p95 (ms) | req/s | failed | "
             "peak RSS per rank (MB) |", "|---|---|---|---|---|---|---|---|---|"]
    for world, res in report["results"].items():
        for key, name in (("serve", "mlxcluster serve"), ("mlx_lm", "mlx_lm.server")):
            for r in res.get(key, []):
                lines.append(f"| {world} | {r['concurrency']} | {name} | {r['output_tok_s']} | {r['ttft_p50_s']} / "
                             f"{r['ttft_p95_s']} | {r['itl_p50_ms']} / {r['itl_p95_ms']} | {r['requests_s']} | "
                             f"{r['requests'] - r['ok']} of {r['requests']} | "
                             f"{', '.join(map(str, r['peak_rss_mb_per_rank']))} |")
        if res.get("mlx_lm_error"):
            lines.append(f"| {world} | - | mlx_lm.server | not run: {res['mlx_lm_error']} | | | | | |")
    lines += ["", "| TP | target | measured | met | reason |", "|---|---|---|---|---|"]
    for t in report["targets"]:
        lines.append(f"| {t['world_size']} | {t['target']} | {t['measured']} | {'yes' if t['met'] else 'no'} | "
                     f"{t.get('reason', '')} |")
    return "\n".join(lines) + "\n"


def chart(report: Dict[str, Any], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for world, res in report["results"].items():
        for key, name, style in (("serve", "mlxcluster serve", "-o"), ("mlx_lm", "mlx_lm.server", "--s")):
            rows = res.get(key, [])
            if rows:
                ax.plot([r["concurrency"] for r in rows], [r["output_tok_s"] for r in rows], style,
                        label=f"{name}, TP={world}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Serving throughput")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mlxcluster bench --serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or mlx-lm directory (default: the embedded model)")
    p.add_argument("--world-sizes", default="1", help="comma-separated TP sizes (e.g. 1,3)")
    p.add_argument("--backend", default="ring", help="ring or mpi (TP > 1)")
    p.add_argument("--concurrency", default="1,8,32,64", help="comma-separated client concurrencies")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out-dir", default="bench-out")
    p.add_argument("--skip-mlx-lm", action="store_true", help="measure serve only")
    p.add_argument("--report", default=None, help="only rewrite serving.md from this serving.json")
    p.add_argument("--quick", action="store_true", help="concurrency 1,8, at least 4 requests per level")
    p.add_argument("--itl-target-ms", type=float, default=None, help="serve's --itl-target-ms (default: none)")
    a = p.parse_args(argv)
    try:
        a.world_sizes = [int(x) for x in a.world_sizes.split(",") if x.strip()]
        a.concurrency = [int(x) for x in a.concurrency.split(",") if x.strip()]
    except ValueError:
        p.error("--world-sizes and --concurrency take comma-separated integers")
    if a.quick:
        a.concurrency = [c for c in a.concurrency if c <= 8] or [1]
    if not a.world_sizes or min(a.world_sizes) < 1 or not a.concurrency or min(a.concurrency) < 1 or a.max_tokens < 1:
        p.error("world sizes, concurrencies and --max-tokens must be at least 1")
    return a


def main(argv: Optional[List[str]] = None) -> int:
    from benchmarks.common import exit_on_sigterm, machine_description, prepare_mlx_dir as _prepare_mlx_dir, \
        scratch_dir as _scratch_dir

    exit_on_sigterm()
    a = _parse(argv)
    if a.report:
        with open(a.report) as f:
            report = json.load(f)
        report["targets"] = targets(report)
        print(markdown(report))
        return 0
    os.makedirs(a.out_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench-serving-", dir=_scratch_dir())
    report: Dict[str, Any] = {"machine": machine_description(), "date": time.strftime("%Y-%m-%d %H:%M"),
                              "max_tokens": a.max_tokens, "backend": a.backend, "results": {}}
    extra = [] if a.itl_target_ms is None else ["--itl-target-ms", str(a.itl_target_ms)]
    if extra:
        report["serve_args"] = extra
    try:
        model = _prepare_mlx_dir(a.model, "float32", work)
        for world in a.world_sizes:
            res: Dict[str, Any] = {}
            print(f"TP={world}:", flush=True)
            log = os.path.join(a.out_dir, f"serve-tp{world}.log")
            try:
                res["serve"] = asyncio.run(bench_server(lambda c: Serve(model, world, a.backend, log, extra), a.concurrency,
                                                        a.max_tokens, False, a.quick))
            except RuntimeError as exc:
                res["serve_error"] = f"{exc} (log: {log})"
                print(f"  serve failed: {res['serve_error']}", flush=True)
            if not a.skip_mlx_lm:
                try:
                    res["mlx_lm"] = asyncio.run(bench_server(
                        lambda c: MlxLmServer(model, world, a.backend, c, a.max_tokens), a.concurrency, a.max_tokens,
                        True, a.quick))
                except RuntimeError as exc:
                    res["mlx_lm_error"] = str(exc)
                    print(f"  mlx_lm.server did not run: {exc}", flush=True)
            report["results"][str(world)] = res
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["targets"] = targets(report)
    md = markdown(report)
    with open(os.path.join(a.out_dir, "serving.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(a.out_dir, "serving.md"), "w") as f:
        f.write(md)
    drawn = chart(report, os.path.join(a.out_dir, "serving.png"))
    print("\n" + md)
    for t in report["targets"]:
        if not t["met"]:
            print(f"target missed at TP={t['world_size']}: {t['target']} (measured {t['measured']}): {t['reason']}")
    print(f"wrote {a.out_dir}/serving.json, serving.md" + (", serving.png" if drawn else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

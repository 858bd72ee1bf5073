#!/usr/bin/env python3
"""Load benchmark of the marketplace router (``mlxcluster router``) with N providers behind it.

By default it starts the router (``python -m mlxcluster router`` subprocess) and, per scenario, N
REAL providers (``python -m mlxcluster serve --world-size 1 --router ... --router-token ...``
subprocesses, each one local rank on the embedded model), or with ``--fake-providers`` in-process
fake providers (a token every ``--token-delay`` s) to exercise the router alone. ``--router-url``
benchmarks an already running router (its providers already linked; scenarios then only set the
load). Users are httpx clients speaking OpenAI's chat completions API (SSE when streaming).

Scenarios (``--scenarios``, comma-separated; default all):
  1p-30r-c5-stream       1 provider, 30 requests, concurrency 5, streaming
  1p-30r-c5-nostream     same, non-streaming
  3p-60r-c20-stream      3 providers, 60 requests, concurrency 20
  1p-40r-c15-saturation  1 provider with a small queue: some requests get 429 (a clear error)
  3p-100r-c100-stream    3 providers, 100 requests, all at once

Per scenario: latency decomposition at p50/p95/p99 (queue wait: the fake providers' own record,
real providers do not report it; TTFT; inter-token latency; total), throughput (requests/s,
tokens/s), the router's retries, and every failure with its reason. A request is *lost* unless it
got a full answer (finish_reason and [DONE]) or a clear error (an HTTP error status with an OpenAI
error body, or an SSE ``error`` event); any lost request makes the exit status 1. A process that
fails to start is reported in one line with its last stderr line.

  python benchmarks/bench_router.py --fake-providers --out bench_router.json
  python benchmarks/bench_router.py --scenarios 1p-30r-c5-stream --max-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import sys
import tempfile
import time
from typing import Dict, List, Optional

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.fake_provider import FakeProvider  # noqa: E402  (needs ROOT on sys.path)
from mlxcluster.runtime.supervisor import Supervisor, rank_env  # noqa: E402

SCENARIOS = {
    "1p-30r-c5-stream": dict(providers=1, requests=30, concurrency=5, stream=True, saturate=False),
    "1p-30r-c5-nostream": dict(providers=1, requests=30, concurrency=5, stream=False, saturate=False),
    "3p-60r-c20-stream": dict(providers=3, requests=60, concurrency=20, stream=True, saturate=False),
    "1p-40r-c15-saturation": dict(providers=1, requests=40, concurrency=15, stream=True, saturate=True),
    "3p-100r-c100-stream": dict(providers=3, requests=100, concurrency=100, stream=True, saturate=False),
}
TOPICS = ["a lighthouse", "the moon", "a red bicycle", "tea", "a quiet library", "rain", "a fox", "the sea",
          "a clock", "mountains"]


# ----- helpers -------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: List[float], p: float) -> Optional[float]:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def dist(values: List[float]) -> Optional[dict]:
    if not values:
        return None
    return {"p50": pct(values, 50), "p95": pct(values, 95), "p99": pct(values, 99), "n": len(values)}


# ----- the system under test -----------------------------------------------------------------------

class Deployment:
    """A router and its providers for one provider configuration.

    The router and real providers are processes of one
    :class:`~mlxcluster.runtime.supervisor.Supervisor` (own process groups, the
    last stderr line in a failure, SIGTERM then SIGKILL at the end); fake
    providers are tasks of this process linked to the router."""

    def __init__(self, args, n_providers: int, saturate: bool):
        self.args = args
        self.n = n_providers
        self.saturate = saturate
        self.token = "bench-" + os.urandom(8).hex()
        self.supervisor = Supervisor()
        self.fakes: List[FakeProvider] = []
        self.links: List[asyncio.Task] = []
        self.base = args.router_url
        self.grpc = None

    async def start(self, http: httpx.AsyncClient) -> None:
        a = self.args
        if a.router_url:
            return
        http_port, grpc_port = free_port(), free_port()
        self.base = f"http://127.0.0.1:{http_port}"
        self.grpc = f"127.0.0.1:{grpc_port}"
        # rank_env: the package importable from this checkout; each provider's own rank gets its
        # BLAS settings from its launcher as in `mlxcluster serve`
        env = rank_env(1, {"MLXCLUSTER_PROVIDER_TOKEN": self.token})
        # the provider link is TLS: the router reuses the self-signed certificate made here, which the
        # providers trust (--router-ca)
        from mlxcluster.router.server import link_certificate, link_names

        self.cert_dir = tempfile.TemporaryDirectory(prefix="bench-router-")
        _, self.link_cert_pem, cert_path, _ = link_certificate(self.cert_dir.name, link_names("127.0.0.1"))
        self.supervisor.spawn([sys.executable, "-m", "mlxcluster", "router", "--port", str(http_port),
                               "--grpc-port", str(grpc_port), "--log-level", "WARNING", "--no-auth",
                               "--link-cert-dir", self.cert_dir.name], env, name="router")
        await self._wait(http, lambda h: True, 60, "the router to start")
        if a.fake_providers:
            from mlxcluster.front.link import run_link

            cap, queue = (a.sat_capacity, a.sat_max_queue) if self.saturate else (a.fake_capacity, 1000)
            for i in range(self.n):
                fake = FakeProvider(f"fake{i}", [a.model or "fake-model"], cap, queue, token_delay=a.token_delay,
                                    context_length=8192)
                self.fakes.append(fake)
                self.links.append(asyncio.ensure_future(run_link(fake, self.grpc, self.token, fake.name,
                                                                 max_backoff_s=2.0,
                                                                 root_certificates=self.link_cert_pem)))
        else:
            for i in range(self.n):
                cmd = [sys.executable, "-m", "mlxcluster", "serve", "--world-size", "1", "--router", self.grpc,
                       "--router-token", self.token, "--router-ca", cert_path, "--port", str(free_port()),
                       "--log-level", "warning"]
                if a.serve_model:
                    cmd += ["--model", a.serve_model]
                if self.saturate:
                    cmd += ["--max-queue", str(a.sat_max_queue), "--max-concurrency", str(a.sat_capacity)]
                else:
                    cmd += ["--max-queue", "1000"]
                self.supervisor.spawn(cmd, env, name=f"provider {i}")
        await self._wait(http, lambda h: len(h.get("providers", [])) >= self.n, a.start_timeout,
                         f"{self.n} provider(s) to register")

    async def _wait(self, http, pred, timeout, what) -> None:
        """Poll the router's /health until ``pred(health)`` (no process reports readiness)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.supervisor.failure:
                raise RuntimeError(f"{self.supervisor.failure} (while waiting for {what})")
            try:
                r = await http.get(self.base + "/health", timeout=2)
                if r.status_code == 200 and pred(r.json()):
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
        raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")

    async def stop(self) -> None:
        for t in self.links:
            t.cancel()
        await asyncio.gather(*self.links, return_exceptions=True)
        await asyncio.to_thread(self.supervisor.stop, 30.0)
        if getattr(self, "cert_dir", None) is not None:
            self.cert_dir.cleanup()


# ----- users ---------------------------------------------------------------------------------------

async def one_request(http: httpx.AsyncClient, base: str, model: str, i: int, stream: bool, max_tokens: int,
                      timeout: float) -> dict:
    rec = {"i": i, "outcome": None, "status": None, "reason": None, "ttft_s": None, "itl_s": [], "total_s": None,
           "tokens": 0}
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "user": f"bench-{i}",
            "messages": [{"role": "user", "content": f"Write two sentences about {TOPICS[i % len(TOPICS)]}."}]}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    t0 = time.perf_counter()

    def clear_error(status, payload):
        err = payload.get("error") if isinstance(payload, dict) else None
        if isinstance(err, dict) and err.get("message"):
            rec.update(outcome="error", status=status, reason=f"{status} {err.get('type')}: {err['message']}")
        else:
            rec.update(outcome="lost", status=status, reason=f"{status} without an OpenAI error body: {payload!r:.200}")

    async def go():
        if not stream:
            r = await http.post(base + "/v1/chat/completions", json=body)
            rec["status"] = r.status_code
            try:
                payload = r.json()
            except ValueError:
                payload = r.text
            if r.status_code != 200:
                clear_error(r.status_code, payload)
            elif payload.get("choices") and payload["choices"][0].get("finish_reason"):
                rec["outcome"] = "ok"
                rec["tokens"] = int((payload.get("usage") or {}).get("completion_tokens") or 0)
            else:
                rec.update(outcome="lost", reason=f"200 without a finished choice: {payload!r:.200}")
        else:
            async with http.stream("POST", base + "/v1/chat/completions", json=body) as r:
                rec["status"] = r.status_code
                if r.status_code != 200:
                    raw = await r.aread()
                    try:
                        clear_error(r.status_code, json.loads(raw))
                    except ValueError:
                        clear_error(r.status_code, raw.decode(errors="replace"))
                else:
                    done, finish, error, last, chunks = False, None, None, None, 0
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            done = True
                            break
                        obj = json.loads(data)
                        if "error" in obj:
                            error = obj["error"]
                            continue
                        if obj.get("usage"):
                            rec["tokens"] = int(obj["usage"].get("completion_tokens") or 0)
                        for ch in obj.get("choices") or []:
                            delta = ch.get("delta") or {}
                            if "content" in delta and "role" not in delta:
                                now = time.perf_counter()
                                chunks += 1
                                if rec["ttft_s"] is None:
                                    rec["ttft_s"] = now - t0
                                else:
                                    rec["itl_s"].append(now - last)
                                last = now
                            finish = ch.get("finish_reason") or finish
                    if error is not None:
                        rec.update(outcome="error", reason=f"SSE error event ({error.get('type')}): "
                                                           f"{error.get('message')}")
                    elif done and finish:
                        rec["outcome"] = "ok"
                        rec["tokens"] = rec["tokens"] or chunks
                    else:
                        rec.update(outcome="lost", reason=f"stream ended without {'[DONE]' if not done else 'finish_reason'}")

    try:
        await asyncio.wait_for(go(), timeout)
    except asyncio.TimeoutError:
        rec.update(outcome="lost", reason=f"no full answer within {timeout:.0f} s")
    except (httpx.HTTPError, ValueError) as exc:
        rec.update(outcome="lost", reason=f"{type(exc).__name__}: {exc}")
    rec["total_s"] = time.perf_counter() - t0
    return rec


async def run_scenario(name: str, sc: dict, dep: Deployment, http: httpx.AsyncClient, args) -> dict:
    models = (await http.get(dep.base + "/v1/models", timeout=10)).json()["data"]
    model = args.model or (models[0]["id"] if models else "none")
    metrics_before = (await http.get(dep.base + "/metrics", timeout=10)).text
    for f in dep.fakes:
        f.queue_wait.clear()
    limits = httpx.Limits(max_connections=sc["concurrency"] + 5, max_keepalive_connections=sc["concurrency"] + 5)
    sem = asyncio.Semaphore(sc["concurrency"])

    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.timeout, connect=10)) as users:
        async def guarded(i):
            async with sem:
                return await one_request(users, dep.base, model, i, sc["stream"], args.max_tokens, args.timeout)

        t0 = time.perf_counter()
        recs = await asyncio.gather(*(guarded(i) for i in range(sc["requests"])))
        wall = time.perf_counter() - t0
    metrics_after = (await http.get(dep.base + "/metrics", timeout=10)).text

    ok = [r for r in recs if r["outcome"] == "ok"]
    errors = [r for r in recs if r["outcome"] == "error"]
    lost = [r for r in recs if r["outcome"] != "ok" and r["outcome"] != "error"]
    queue_wait = dist([w for f in dep.fakes for w in f.queue_wait.values()])
    queue_source = "fake provider record" if dep.fakes else None

    def delta(metric, **labels):
        def val(text):
            total = 0.0
            for line in text.splitlines():
                if line.startswith(metric) and not line.startswith("#") and all(
                        f'{k}="{v}"' in line for k, v in labels.items()):
                    total += float(line.rpartition(" ")[2])
            return total
        return val(metrics_after) - val(metrics_before)

    tokens = sum(r["tokens"] for r in ok)
    reasons: Dict[str, List[int]] = {}
    for r in errors + lost:
        reasons.setdefault(f"[{r['outcome']}] {r['reason']}", []).append(r["i"])
    return {
        "scenario": name, **sc, "model": model, "max_tokens": args.max_tokens,
        "providers_kind": "fake" if args.fake_providers else ("external" if args.router_url else "real"),
        "wall_s": wall, "ok": len(ok), "clear_errors": len(errors), "lost": len(lost),
        "status_429": sum(1 for r in errors if r["status"] == 429),
        "requests_per_s": len(ok) / wall if wall else 0.0, "tokens_per_s": tokens / wall if wall else 0.0,
        "completion_tokens": tokens,
        "queue_wait_s": queue_wait, "queue_wait_source": queue_source,
        "ttft_s": dist([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
        "itl_s": dist([x for r in ok for x in r["itl_s"]]),
        "total_s": dist([r["total_s"] for r in ok]),
        "router_retries": delta("mlxcluster_router_retries_total"),
        "router_failures": delta("mlxcluster_router_failures_total"),
        "failures": [{"request": r["i"], "outcome": r["outcome"], "status": r["status"], "reason": r["reason"]}
                     for r in errors + lost],
        "failure_reasons": {k: len(v) for k, v in reasons.items()},
    }


def ms(d, key):
    if not d or d.get(key) is None:
        return "–"
    return f"{d[key] * 1000:.0f}"


def tri(d):
    return "–" if not d else f"{ms(d, 'p50')} / {ms(d, 'p95')} / {ms(d, 'p99')}"


def markdown(results: List[dict]) -> str:
    lines = ["| scenario | providers | ok | clear errors (429) | lost | wall s | req/s | tok/s | retries | "
             "queue wait ms p50/95/99 | TTFT ms p50/95/99 | ITL ms p50/95/99 | total ms p50/95/99 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['scenario']} | – | – | – | – | – | – | – | – | – | – | – | not run: {r['error']} |")
            continue
        lines.append(
            f"| {r['scenario']} | {r['providers']} ({r['providers_kind']}) | {r['ok']}/{r['requests']} | "
            f"{r['clear_errors']} ({r['status_429']}) | {r['lost']} | {r['wall_s']:.1f} | {r['requests_per_s']:.2f} | "
            f"{r['tokens_per_s']:.1f} | {r['router_retries']:.0f} | {tri(r['queue_wait_s'])} | {tri(r['ttft_s'])} | "
            f"{tri(r['itl_s'])} | {tri(r['total_s'])} |")
    out = ["\n".join(lines)]
    for r in results:
        for reason, count in (r.get("failure_reasons") or {}).items():
            out.append(f"- {r['scenario']}: {count} x {reason}")
    return "\n".join(out)


async def main_async(args) -> int:
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    results = []
    failed = False
    dep: Optional[Deployment] = None
    async with httpx.AsyncClient() as http:
        try:
            for name in names:
                sc = SCENARIOS[name]
                key = (sc["providers"], sc["saturate"])
                if dep is None or (dep.n, dep.saturate) != key:
                    if dep is not None:
                        await dep.stop()
                    dep = Deployment(args, *key)
                    print(f"[{name}] starting router + {sc['providers']} "
                          f"{'fake' if args.fake_providers else 'real'} provider(s)...", file=sys.stderr)
                    try:
                        await dep.start(http)
                    except RuntimeError as exc:
                        print(f"[{name}] {exc}", file=sys.stderr)
                        results.append({"scenario": name, "error": str(exc)})
                        failed = True
                        await dep.stop()
                        dep = None
                        continue
                print(f"[{name}] {sc['requests']} requests, concurrency {sc['concurrency']}, "
                      f"{'stream' if sc['stream'] else 'no stream'}...", file=sys.stderr)
                if args.warmup and not args.router_url:
                    await run_scenario(name + "-warmup", dict(sc, requests=sc["providers"], concurrency=sc["providers"]),
                                       dep, http, args)
                res = await run_scenario(name, sc, dep, http, args)
                results.append(res)
                print(f"[{name}] ok {res['ok']}, clear errors {res['clear_errors']}, lost {res['lost']}, "
                      f"{res['wall_s']:.1f} s", file=sys.stderr)
                if res["lost"]:
                    failed = True
                if sc["saturate"] and not res["status_429"]:
                    print(f"[{name}] note: no request was refused with 429 (the queue never filled)", file=sys.stderr)
        finally:
            if dep is not None:
                await dep.stop()
    print(markdown(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    if failed:
        print("FAIL: some requests were lost (neither a full answer nor a clear error) or a scenario did not run",
              file=sys.stderr)
        return 1
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated scenario names")
    ap.add_argument("--fake-providers", action="store_true", help="in-process fake providers instead of real ones")
    ap.add_argument("--router-url", default=None, help="benchmark this running router (providers already linked)")
    ap.add_argument("--model", default=None, help="model id to request (default: the router's first model)")
    ap.add_argument("--serve-model", default=None, help="--model for the real providers (default: embedded)")
    ap.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every request")
    ap.add_argument("--token-delay", type=float, default=0.02, help="fake providers: seconds per token")
    ap.add_argument("--fake-capacity", type=int, default=4, help="fake providers: requests run at once")
    ap.add_argument("--sat-capacity", type=int, default=2, help="saturation scenario: provider concurrency")
    ap.add_argument("--sat-max-queue", type=int, default=4, help="saturation scenario: provider queue size")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before a request counts as lost")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds for providers to register")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="one unmeasured request per provider before each scenario")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())

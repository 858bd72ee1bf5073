"""Marketplace end to end on the real model: `mlxcluster router` + two real
`mlxcluster serve --router` providers; one provider is killed mid-run and every
request still ends in a full answer or a clear error."""

import asyncio
import json
import signal
import sys

import httpx
import pytest

from harness import until
from mlxcluster.router.server import link_certificate, link_names
from mlxcluster.runtime.launcher import free_ports
from mlxcluster.runtime.supervisor import Supervisor, rank_env

pytestmark = pytest.mark.slow

TOKEN = "provider-token-for-tests"
MODEL = [""]


def _spawn(sup, args, name):
    """``python -m mlxcluster <args>`` under ``sup`` (own process group, stderr tail kept)."""
    return sup.spawn([sys.executable, "-m", "mlxcluster", *args], rank_env(1, {"OPENBLAS_NUM_THREADS": "1"}),
                     name=name)


def _health(http_port):
    try:
        r = httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=5)
        return r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


def _wait_providers(sup, http_port, n, timeout_s=240):
    """The router's /health once ``n`` providers are registered (polled, bounded by ``timeout_s``)."""

    def registered():
        assert sup.failure is None, sup.failure
        health = _health(http_port)
        return health if len(health.get("providers", [])) >= n else None

    return until(registered, timeout_s, f"{n} providers to register", interval_s=0.25)


def test_two_real_providers_one_killed_mid_run(tmp_path):
    http_port, grpc_port, p1, p2 = free_ports(4)
    # The link is TLS: the router keeps its self-signed certificate in --link-cert-dir (made here
    # first, so that the providers can be given it before the router has started: it reuses it).
    cert_path = link_certificate(str(tmp_path), link_names("127.0.0.1"))[2]
    sup = Supervisor()
    _spawn(sup, ["router", "--port", str(http_port), "--grpc-port", str(grpc_port), "--provider-token", TOKEN, "--no-auth",
                 "--link-cert-dir", str(tmp_path)], "router")
    providers = [
        _spawn(sup, ["serve", "--world-size", "1", "--port", str(port), "--router", f"127.0.0.1:{grpc_port}",
                     "--router-token", TOKEN, "--router-ca", cert_path, "--max-concurrency", "2"], f"provider {i}")
        for i, port in enumerate((p1, p2))
    ]
    try:
        health = _wait_providers(sup, http_port, 2)
        assert health

        streaming = asyncio.Event()  # some answer has content: generation is under way

        async def one(client, i):
            body = {"model": MODEL[0], "max_tokens": 24, "stream": True,
                    "messages": [{"role": "user", "content": f"Count from {i} to {i + 20}."}]}
            text, error = "", None
            try:
                async with client.stream("POST", f"http://127.0.0.1:{http_port}/v1/chat/completions",
                                         json=body, timeout=300) as r:
                    if r.status_code != 200:
                        payload = (await r.aread()).decode()
                        return ("error", f"HTTP {r.status_code}: {payload[:200]}")
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            error = chunk["error"].get("message", "error")
                            break
                        for c in chunk.get("choices", []):
                            text += (c.get("delta") or {}).get("content") or ""
                        if text:
                            streaming.set()
            except httpx.HTTPError as exc:  # a transport failure is a lost request
                return ("lost", repr(exc))
            return ("error", error) if error else ("ok", text)

        async def run():
            # Find the model id the router advertises.
            async with httpx.AsyncClient() as client:
                models = (await client.get(f"http://127.0.0.1:{http_port}/v1/models")).json()["data"]
                assert models, "router lists no model"
                MODEL[0] = models[0]["id"]
                tasks = [asyncio.create_task(one(client, i)) for i in range(8)]
                # Kill provider 2 mid-run: once answers stream and both providers have requests in flight.
                await asyncio.wait_for(streaming.wait(), 300)
                await asyncio.to_thread(_wait_busy, http_port, 300)
                providers[1].signal_group(signal.SIGKILL)
                return await asyncio.wait_for(asyncio.gather(*tasks), timeout=600)

        results = asyncio.run(run())
        kinds = [k for k, _ in results]
        assert "lost" not in kinds, results
        assert kinds.count("ok") >= 1, results
        for kind, detail in results:
            if kind == "ok":
                assert detail.strip(), results
            else:
                assert detail and len(detail) > 5, results  # a clear error message
        # The surviving provider still serves.
        r = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", timeout=300,
                       json={"model": models_id(http_port), "prompt": "The capital of France is", "max_tokens": 8,
                             "temperature": 0})
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["text"], r.text
    finally:
        sup.stop(timeout_s=20)


def _wait_busy(http_port, timeout_s):
    """Until every provider the router lists has a request in flight (bounded by ``timeout_s``)."""
    until(lambda: all(p["inflight"] for p in _health(http_port).get("providers", [{"inflight": 0}])), timeout_s,
          "requests to reach both providers", interval_s=0.1)


def models_id(http_port):
    return httpx.get(f"http://127.0.0.1:{http_port}/v1/models", timeout=10).json()["data"][0]["id"]

"""Marketplace end to end on the real model: `mlxcluster router` + two real
`mlxcluster serve --router` providers (one set for the module); a provider is killed
mid-answer and the answer continues on the other, exactly as unbroken; one is killed
under load and every request still ends in a full answer."""

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


class Market:
    """`mlxcluster router` and two `mlxcluster serve --router` providers (world size 1), each
    process under a supervisor of its own (a provider killed by a test is no failure of the rest;
    :meth:`restart` starts it again on the same ports)."""

    def __init__(self, tmp_path):
        self.http_port, self.grpc_port, *self.ports = free_ports(4)
        # The link is TLS: the router keeps its self-signed certificate in --link-cert-dir (made here
        # first, so that the providers can be given it before the router has started: it reuses it).
        self.cert_path = link_certificate(str(tmp_path), link_names("127.0.0.1"))[2]
        self.router_sup = Supervisor()
        _spawn(self.router_sup, ["router", "--port", str(self.http_port), "--grpc-port", str(self.grpc_port),
                                 "--provider-token", TOKEN, "--no-auth", "--link-cert-dir", str(tmp_path)], "router")
        self.sups = [None, None]
        self.procs = [None, None]
        for i in range(2):
            self.restart(i)

    def restart(self, i):
        if self.sups[i] is not None:
            self.sups[i].stop(timeout_s=10)
        self.sups[i] = Supervisor()
        self.procs[i] = _spawn(self.sups[i], [
            "serve", "--world-size", "1", "--port", str(self.ports[i]), "--router", f"127.0.0.1:{self.grpc_port}",
            "--router-token", TOKEN, "--router-ca", self.cert_path, "--max-concurrency", "2"], f"provider {i}")

    def wait_providers(self, n, timeout_s=240):
        """The router's /health once ``n`` providers are registered (polled, bounded by ``timeout_s``)."""

        def registered():
            assert self.router_sup.failure is None, self.router_sup.failure
            health = _health(self.http_port)
            return health if len(health.get("providers", [])) >= n else None

        return until(registered, timeout_s, f"{n} providers to register", interval_s=0.25)

    def tokens(self, i):
        """Tokens provider ``i`` has generated (its /metrics counter, counted live per token; 0 when
        it does not answer)."""
        try:
            text = httpx.get(f"http://127.0.0.1:{self.ports[i]}/metrics", timeout=5).text
        except httpx.HTTPError:
            return 0
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("mlxcluster_provider_completion_tokens_total "))

    def stop(self):
        for sup in self.sups:
            if sup is not None:
                sup.stop(timeout_s=20)
        self.router_sup.stop(timeout_s=20)


@pytest.fixture(scope="module")
def market(tmp_path_factory):
    m = Market(tmp_path_factory.mktemp("market"))
    try:
        yield m
    finally:
        m.stop()


def _deltas(lines):
    """(content of each chunk with choices, the finish reasons, the ids, the last usage) of SSE lines."""
    contents, finishes, ids, usage = [], [], set(), None
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        assert "error" not in chunk, chunk
        ids.add(chunk["id"])
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            contents.append((c.get("delta") or {}).get("content"))
            finishes.append(c.get("finish_reason"))
    return contents, [f for f in finishes if f], ids, usage


def test_a_provider_killed_mid_answer_the_stream_continues_on_the_other_exactly(market):
    """Issue 29's router test: a greedy streamed answer; the provider serving it is SIGKILLed after
    a few tokens; the user's stream goes on on the other provider (same model digest) and equals
    the unbroken answer token for token, in one stream with one id."""
    health = market.wait_providers(2)
    digests = {p["model_digest"] for p in health["providers"]}
    assert len(digests) == 1 and "" not in digests and all(p["resumes"] for p in health["providers"])
    model = httpx.get(f"http://127.0.0.1:{market.http_port}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "max_tokens": 96, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]}
    url = f"http://127.0.0.1:{market.http_port}/v1/chat/completions"
    reference = httpx.post(url, json=body, timeout=300)
    assert reference.status_code == 200, reference.text
    ref = _deltas(reference.text.splitlines())
    assert len(ref[0]) > 20 and ref[1] == ["length"], ref  # long enough to be broken in the middle

    lines, victim = [], None
    before = [market.tokens(i) for i in (0, 1)]
    with httpx.stream("POST", url, json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            lines.append(line)
            if victim is None and sum(1 for x in lines if '"content":"' in x and '"content":""' not in x) >= 4:
                # a few tokens are out: SIGKILL the provider streaming this answer (its rank with it):
                # the one whose token counter moved since the stream began
                victim = next(i for i in (0, 1) if market.tokens(i) > before[i])
                market.procs[victim].signal_group(signal.SIGKILL)
    got = _deltas(lines)
    assert victim is not None
    assert len(got[2]) == 1  # one stream, one id
    assert got[0] == ref[0]  # token for token (each chunk's content), nothing repeated or missing
    assert got[1] == ref[1] and got[3]["completion_tokens"] == ref[3]["completion_tokens"] == 96
    stats = _health(market.http_port)["stats"]
    assert stats["continuations"] == 1, stats
    market.restart(victim)  # for the next test: two providers again


def test_two_real_providers_one_killed_mid_run(market):
    http_port, providers = market.http_port, market.procs
    health = market.wait_providers(2)
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
    # each answer broken by the kill was continued on the surviving provider (or re-sent, if
    # nothing of it had reached the user yet): every request ends in a full answer
    assert [k for k, _ in results] == ["ok"] * len(results), results
    assert all(detail.strip() for _, detail in results), results
    # The surviving provider still serves.
    r = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", timeout=300,
                   json={"model": models_id(http_port), "prompt": "The capital of France is", "max_tokens": 8,
                         "temperature": 0})
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["text"], r.text


def _wait_busy(http_port, timeout_s):
    """Until every provider the router lists has a request in flight (bounded by ``timeout_s``)."""
    until(lambda: all(p["inflight"] for p in _health(http_port).get("providers", [{"inflight": 0}])), timeout_s,
          "requests to reach both providers", interval_s=0.1)


def models_id(http_port):
    return httpx.get(f"http://127.0.0.1:{http_port}/v1/models", timeout=10).json()["data"][0]["id"]

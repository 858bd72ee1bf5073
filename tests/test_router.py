"""The marketplace router and the provider link, end to end on loopback with fake providers."""

import asyncio
import functools
import json
import logging
import time

import httpx
import openai
import pytest

from benchmarks.fake_provider import FakeProvider, words as expected_text
from mlxcluster.router.server import Router, link_certificate, link_names
from mlxcluster.front.link import RegistrationRefused, parse_router_url, read_ca, run_link
from mlxcluster.protocol import router_pb2 as rpb
from mlxcluster.protocol import router_pb2_grpc as rpb_grpc
from mlxcluster.security import fingerprint, self_signed
from mlxcluster.front.sse import fold_chunks
from harness import until_async

TOKEN = "s3cret-tøken"
MODEL = "fake-model"  # FakeProvider's default model


def streaming_on(router, provider_id):
    """Whether a request on ``provider_id`` has delivered content (the router no longer retries it)."""
    conn = router.providers.get(provider_id)
    return conn is not None and any(p.started for p in conn.inflight.values())


@functools.lru_cache(maxsize=None)
def plain_http():
    """The SSL context of every Harness client (they speak plain HTTP to the router, so it is never
    used): one for the module, where each client would load the CA bundle itself (~30 ms of CPU)."""
    import ssl

    return ssl.create_default_context()


class Harness:
    def __init__(self, **router_kw):
        self.router = Router(TOKEN, **router_kw)
        self.links = {}

    async def __aenter__(self):
        await self.router.start("127.0.0.1", 0, grpc_port=0)
        self.base = f"http://127.0.0.1:{self.router.http_port}"
        self.grpc = f"127.0.0.1:{self.router.grpc_port}"
        self.http = httpx.AsyncClient(base_url=self.base, timeout=10, verify=plain_http())
        self.client = openai.AsyncOpenAI(base_url=self.base + "/v1", api_key="user-key", max_retries=0, timeout=10,
                                         http_client=openai.DefaultAsyncHttpxClient(verify=plain_http()))
        return self

    def link(self, provider, token=TOKEN, wait=True, **kw):
        kw.setdefault("max_backoff_s", 0.3)
        kw.setdefault("initial_backoff_s", 0.05)
        kw.setdefault("heartbeat_interval_s", 0.1)
        kw.setdefault("root_certificates", self.router.link_cert_pem)  # the link is TLS: trust its certificate
        task = asyncio.ensure_future(run_link(provider, self.grpc, token, provider.name, **kw))
        self.links[provider.name] = task
        return task

    async def linked(self, *providers, timeout=5.0):
        await until_async(lambda: all(p.name in self.router.providers for p in providers), timeout, "registration")

    async def kill(self, name):
        task = self.links.pop(name)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def __aexit__(self, *exc):
        for name in list(self.links):
            await self.kill(name)
        await self.client.close()
        await self.http.aclose()
        await self.router.stop(grace=0.2)


def run(coro, timeout=30):
    asyncio.run(asyncio.wait_for(coro, timeout))


def metric(text, name, **labels):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in key for k, v in labels.items()):
                total += float(value)
    return total


# ---------------------------------------------------------------------------------------------


def test_parse_router_url():
    assert parse_router_url("grpc://10.0.0.1:8081") == "10.0.0.1:8081"
    assert parse_router_url("router.example:9") == "router.example:9"
    with pytest.raises(ValueError):
        parse_router_url("no-port")


def test_token_checked_and_refused_provider_never_routed():
    async def main():
        async with Harness() as h:
            good, bad = FakeProvider("good"), FakeProvider("bad", models=(MODEL, "bad-only"))
            h.link(good)
            with pytest.raises(RegistrationRefused, match="invalid provider token"):
                await run_link(bad, h.grpc, "wrong", "bad", max_attempts=1, root_certificates=h.router.link_cert_pem)
            h.link(bad, token="wrong", max_backoff_s=0.05)  # keeps retrying in the background (a refusal waits that)
            await h.linked(good)
            await until_async(lambda: h.router.stats["refused_providers"] >= 3, what="refusals")
            assert set(h.router.providers) == {"good"}
            for i in range(4):
                r = await h.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                           user=f"r{i}")
                assert r.choices[0].message.content == expected_text(5)
            with pytest.raises(openai.NotFoundError):
                await h.client.completions.create(model="bad-only", prompt="x")
            assert bad.calls == [] and len(good.calls) == 4
            health = (await h.http.get("/health")).json()
            assert [p["provider_id"] for p in health["providers"]] == ["good"]
            assert metric((await h.http.get("/metrics")).text, "mlxcluster_router_refused_providers_total") >= 3
    run(main())


def test_openai_client_stream_and_non_stream():
    async def main():
        async with Harness() as h:
            h.link(FakeProvider("p", n_tokens=6))
            await h.linked(FakeProvider("p"))
            msgs = [{"role": "user", "content": "hello"}]
            # chat, non-streaming: aggregated object with usage
            r = await h.client.chat.completions.create(model=MODEL, messages=msgs)
            assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
            assert r.choices[0].message.content == expected_text(6)
            assert r.choices[0].finish_reason == "length"
            assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 6, 9)
            # chat, streaming with usage
            stream = await h.client.chat.completions.create(model=MODEL, messages=msgs, stream=True,
                                                            stream_options={"include_usage": True})
            text, usage, finish = "", None, None
            async for chunk in stream:
                if chunk.usage:
                    usage = chunk.usage
                for c in chunk.choices:
                    text += c.delta.content or ""
                    finish = c.finish_reason or finish
            assert text == expected_text(6) and finish == "length" and usage.completion_tokens == 6
            # chat, streaming without include_usage: no usage chunk passes through
            stream = await h.client.chat.completions.create(model=MODEL, messages=msgs, stream=True)
            chunks = [c async for c in stream]
            assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)
            # completions, both ways
            r = await h.client.completions.create(model=MODEL, prompt="once", max_tokens=4)
            assert r.object == "text_completion" and r.choices[0].text == expected_text(4)
            assert r.usage.completion_tokens == 4
            stream = await h.client.completions.create(model=MODEL, prompt="once", max_tokens=3, stream=True,
                                                       stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            assert "".join(c.choices[0].text for c in chunks if c.choices) == expected_text(3)
            assert chunks[-1].usage.total_tokens == 6
            # raw SSE framing
            async with h.http.stream("POST", "/v1/completions",
                                     json={"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True}) as resp:
                assert resp.headers["content-type"].startswith("text/event-stream")
                raw = (await resp.aread()).decode()
            events = raw.split("\n\n")
            assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1])
            # a bad body: 400 naming the field (the router checks it as serve does; never retried)
            with pytest.raises(openai.BadRequestError) as ei:
                await h.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=0)
            assert ei.value.body["param"] == "max_tokens"
            m = (await h.http.get("/metrics")).text
            assert metric(m, "mlxcluster_router_requests_total") == 7
            assert metric(m, "mlxcluster_router_completion_tokens_total") >= 6 + 6 + 6 + 4 + 3
    run(main())


def test_unknown_model_404_and_no_live_provider_503():
    async def main():
        async with Harness() as h:
            with pytest.raises(openai.NotFoundError):
                await h.client.completions.create(model="nope", prompt="x")
            p = FakeProvider("p")
            h.link(p)
            await h.linked(p)
            await h.kill("p")
            await until_async(lambda: not h.router.providers, what="provider gone")
            with pytest.raises(openai.InternalServerError) as ei:
                await h.client.completions.create(model=MODEL, prompt="x")
            assert ei.value.status_code == 503
            r = await h.http.post("/v1/chat/completions", content=b"{not json")
            assert r.status_code == 400 and "error" in r.json()
    run(main())


def test_least_loaded_routing_and_models_union():
    async def main():
        async with Harness() as h:
            a = FakeProvider("a", models=(MODEL, "a-only"), capacity=4, token_delay=0.05, n_tokens=6)
            b = FakeProvider("b", models=(MODEL, "b-only"), capacity=4, token_delay=0.05, n_tokens=6)
            h.link(a)
            h.link(b)
            await h.linked(a, b)
            models = await h.client.models.list()
            assert sorted(m.id for m in models.data) == sorted([MODEL, "a-only", "b-only"])
            # equal load: concurrent requests spread evenly (in flight here + round-robin on ties)
            msgs = [{"role": "user", "content": "x"}]
            await asyncio.gather(*(h.client.chat.completions.create(model=MODEL, messages=msgs, user=f"e{i}")
                                   for i in range(8)))
            assert len(a.calls) == 4 and len(b.calls) == 4
            # a reports a heavy load of other work: everything goes to b (b's own load here, at most
            # 6/4, stays below a's 14/4 however long the requests run: one token each)
            a.fake_load = {"queued": 10, "running": 4, "capacity": 4}
            await until_async(lambda: h.router.providers["a"].load() > 3, what="heartbeat")
            await asyncio.gather(*(h.client.chat.completions.create(model=MODEL, messages=msgs, user=f"l{i}",
                                                                    max_tokens=1)
                                   for i in range(6)))
            assert len(a.calls) == 4 and len(b.calls) == 10
            # a model only one provider serves goes there whatever its load
            await h.client.completions.create(model="a-only", prompt="x", max_tokens=1)
            assert len(a.calls) == 5
    run(main())


def test_provider_killed_mid_run_retries_unstarted_requests():
    async def main():
        async with Harness(retry_attempts=2) as h:
            a = FakeProvider("a", capacity=1, token_delay=0.05, n_tokens=20)
            b = FakeProvider("b", capacity=1, token_delay=0.01, n_tokens=20)  # its 5 requests one by one: 1 s
            h.link(a)
            h.link(b)
            await h.linked(a, b)
            outcomes = {}

            async def user(i):
                tag = f"u{i}"
                text = ""
                try:
                    stream = await h.client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True, user=tag)
                    async for chunk in stream:
                        for c in chunk.choices:
                            text += c.delta.content or ""
                    outcomes[tag] = ("ok", text)
                except openai.APIError as exc:
                    outcomes[tag] = ("error", str(exc))

            users = [asyncio.ensure_future(user(i)) for i in range(6)]
            await until_async(lambda: len(a.calls) == 3 and len(b.calls) == 3 and a.started, what="requests spread")
            await until_async(lambda: streaming_on(h.router, "a"), what="a's first request to stream")
            a_started = list(a.started)
            a_waiting = [t for _, t in a.calls if t not in a_started]
            assert len(a_started) == 1 and len(a_waiting) == 2
            await h.kill("a")
            await asyncio.wait_for(asyncio.gather(*users), 20)
            assert len(outcomes) == 6
            for tag, (kind, value) in outcomes.items():
                if tag in a_started:
                    assert kind == "error" and "lost mid-generation" in value and "incomplete" in value, value
                else:
                    assert (kind, value) == ("ok", expected_text(20)), (tag, kind, value)
            assert all(any(t == w for _, t in b.calls) for w in a_waiting)  # retried on b
            assert h.router.stats["retries"] == 2
            m = (await h.http.get("/metrics")).text
            assert metric(m, "mlxcluster_router_retries_total", reason="provider_lost") == 2
            assert metric(m, "mlxcluster_router_failures_total", reason="provider_lost") == 1
            assert 'mlxcluster_router_provider_inflight{provider="b"} 0.0' in m
    run(main())


def test_non_stream_mid_generation_loss_is_502():
    async def main():
        async with Harness() as h:
            a = FakeProvider("a", token_delay=0.05, n_tokens=40)
            h.link(a)
            await h.linked(a)
            req = asyncio.ensure_future(h.client.completions.create(model=MODEL, prompt="x", user="n"))
            await until_async(lambda: streaming_on(h.router, "a"), what="content from a")
            await h.kill("a")
            with pytest.raises(openai.APIStatusError) as ei:
                await req
            assert ei.value.status_code == 502 and "incomplete" in ei.value.message
    run(main())


def test_saturation_gives_clear_429():
    async def main():
        async with Harness() as h:
            p = FakeProvider("p", capacity=1, max_queue=1, token_delay=0.03, n_tokens=10)
            h.link(p)
            await h.linked(p)
            results = await asyncio.gather(
                *(h.client.completions.create(model=MODEL, prompt="x", user=f"s{i}") for i in range(5)),
                return_exceptions=True)
            ok = [r for r in results if not isinstance(r, Exception)]
            limited = [r for r in results if isinstance(r, openai.RateLimitError)]
            assert len(ok) == 2 and len(limited) == 3, results
            assert "queue full" in limited[0].message
            assert limited[0].response.headers.get("retry-after") == "2"
    run(main())


def test_429_retried_on_another_provider():
    async def main():
        async with Harness() as h:
            a, b = FakeProvider("a"), FakeProvider("b")
            a.always_429 = True
            h.link(a)
            h.link(b)
            await h.linked(a, b)
            for i in range(4):
                r = await h.client.completions.create(model=MODEL, prompt="x", user=f"r{i}")
                assert r.choices[0].text == expected_text(5)
            assert len(b.calls) == 4 and len(a.calls) >= 1
            m = (await h.http.get("/metrics")).text
            assert metric(m, "mlxcluster_router_retries_total", reason="provider_429") == len(a.calls)
            assert metric(m, "mlxcluster_router_failures_total") == 0
    run(main())


def test_reconnects_after_router_restart():
    link_credentials = self_signed(["127.0.0.1"])

    async def main():
        router = Router(TOKEN)
        await router.start("127.0.0.1", 0, grpc_port=0, link_credentials=link_credentials)
        grpc_port = router.grpc_port
        p = FakeProvider("p")
        link = asyncio.ensure_future(run_link(p, f"grpc://127.0.0.1:{grpc_port}", TOKEN, "p", max_backoff_s=0.5,
                                              initial_backoff_s=0.05, heartbeat_interval_s=0.1,
                                              root_certificates=router.link_cert_pem))
        router2 = None
        reconnects = _Reconnects()
        link_log = logging.getLogger("mlxcluster.front.link")
        level = link_log.level
        link_log.setLevel(logging.INFO)
        link_log.addHandler(reconnects)
        try:
            await until_async(lambda: "p" in router.providers, what="first registration")
            await router.stop(grace=0.1)
            await until_async(lambda: reconnects.count >= 3, what="failed reconnects while the router is down")
            router2 = Router(TOKEN)  # the same certificate, as `mlxcluster router` keeps it in --link-cert-dir
            await router2.start("127.0.0.1", 0, grpc_port=grpc_port, link_credentials=link_credentials)
            t0 = time.monotonic()
            await until_async(lambda: "p" in router2.providers, timeout_s=3.0, what="re-registration")
            assert time.monotonic() - t0 < 1.5  # bounded by max_backoff_s (+ connect)
            async with httpx.AsyncClient(timeout=10) as http:
                r = await http.post(f"http://127.0.0.1:{router2.http_port}/v1/completions",
                                    json={"model": MODEL, "prompt": "x"})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected_text(5)
        finally:
            link_log.removeHandler(reconnects)
            link_log.setLevel(level)
            link.cancel()
            await asyncio.gather(link, return_exceptions=True)
            if router2 is not None:
                await router2.stop(grace=0.1)
    run(main())


class _Reconnects(logging.Handler):
    """Counts the link's "reconnecting" log records."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record):
        if record.getMessage().startswith("reconnecting to"):
            self.count += 1


def test_heartbeat_timeout_drops_silent_provider():
    async def main():
        async with Harness(heartbeat_timeout_s=0.2) as h:
            p = FakeProvider("p")
            h.link(p, heartbeat_interval_s=5.0)  # first heartbeat at once, then silence
            await h.linked(p)
            await until_async(lambda: "p" not in h.router.providers, timeout_s=3.0, what="heartbeat timeout")
    run(main())


def test_user_disconnect_sends_cancel():
    async def main():
        async with Harness() as h:
            p = FakeProvider("p", token_delay=0.05, n_tokens=100)
            h.link(p)
            await h.linked(p)
            # streaming: read two events, then hang up
            async with h.http.stream("POST", "/v1/chat/completions",
                                     json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                           "stream": True, "user": "streamer"}) as resp:
                lines = resp.aiter_lines()
                seen = 0
                async for line in lines:
                    if line.startswith("data: "):
                        seen += 1
                        if seen == 3:
                            break
            await until_async(lambda: "streamer" in p.cancelled, what="stream cancel")
            # non-streaming: the client times out (hangs up) while the provider generates
            with pytest.raises(httpx.ReadTimeout):
                await h.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "user": "waiter"},
                                  timeout=0.3)
            await until_async(lambda: "waiter" in p.cancelled, what="non-stream cancel")
            # still queued at the provider (not started): the cancel also reaches it
            q = FakeProvider("q", models=("q-model",), capacity=1, token_delay=0.05, n_tokens=100)
            h.link(q)
            await h.linked(q)
            first = asyncio.ensure_future(h.http.post("/v1/completions", json={"model": "q-model", "prompt": "x",
                                                                               "user": "q1"}, timeout=5))
            await until_async(lambda: q.started == ["q1"], what="q1 start")
            with pytest.raises(httpx.ReadTimeout):
                await h.http.post("/v1/completions", json={"model": "q-model", "prompt": "x", "user": "q2"},
                                  timeout=0.3)
            await until_async(lambda: "q2" in q.cancelled, what="queued cancel")
            assert q.started == ["q1"]
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            await until_async(lambda: not p.running and not q.running, what="nothing left running")
            assert h.router.stats["cancels"] >= 3
            assert all(not c.inflight for c in h.router.providers.values())
    run(main())


def test_fold_chat_tool_calls():
    chunks = [
        {"id": "c1", "created": 1, "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "t1", "type": "function", "function": {"name": "get", "arguments": "{\"a\""}}]}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": ": 1}"}}]}, "finish_reason": "tool_calls"}]},
        {"id": "c1", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}},
    ]
    out = fold_chunks(chunks, chat=True)
    msg = out["choices"][0]["message"]
    assert msg["content"] is None and msg["tool_calls"][0]["function"] == {"name": "get", "arguments": "{\"a\": 1}"}
    assert out["choices"][0]["finish_reason"] == "tool_calls" and out["usage"]["total_tokens"] == 3
    assert json.dumps(out)


def test_users_need_an_api_key_and_are_rate_limited():
    """With keys configured: no key or a wrong one is 401 in OpenAI's format, a good key is
    served, a key over its rate is 429 with Retry-After, and /health shows provider
    addresses only to a key holder."""
    async def main():
        async with Harness(api_keys=["key-alice", "key-bob"], rate_limit_per_min=60) as h:
            h.link(FakeProvider("p"))
            await h.linked(FakeProvider("p"))
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "key-alice"}):
                r = await h.http.post("/v1/chat/completions", json=body, headers=headers)
                assert r.status_code == 401, r.text
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert (await h.http.get("/v1/models", headers=headers)).status_code == 401
            alice = openai.AsyncOpenAI(base_url=h.base + "/v1", api_key="key-alice", max_retries=0, timeout=10)
            r = await alice.chat.completions.create(**body)
            assert r.choices[0].message.content == expected_text(5)
            # 60/min: a burst of 10 s worth (10 requests), then 429 for alice, not for bob
            codes = [(await h.http.post("/v1/chat/completions", json=body,
                                        headers={"authorization": "Bearer key-alice"})).status_code
                     for _ in range(12)]
            assert codes.count(200) == 9 and codes[-1] == 429, codes
            r = await h.http.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer key-alice"})
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
            assert 1 <= int(r.headers["retry-after"]) <= 2
            bob = await h.http.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer key-bob"})
            assert bob.status_code == 200
            # /health: a count for strangers, the details (peer addresses) for key holders
            public = (await h.http.get("/health")).json()
            assert public == {"status": "ok", "providers": 1}
            private = (await h.http.get("/health", headers={"authorization": "Bearer key-bob"})).json()
            assert private["providers"][0]["provider_id"] == "p" and "peer" in private["providers"][0]
            assert "127.0.0.1" not in (await h.http.get("/metrics")).text
    run(main())


def test_router_refuses_hostile_bodies_with_400():
    async def main():
        async with Harness() as h:
            for raw, needle in [(b"[" * 100000, "deeper than"), (b'{"model": "m", "temperature": NaN}', "NaN"),
                                (b'{"model": "m", "prompt": "a\\ud800b"}', "surrogate")]:
                r = await h.http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
                assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    run(main())


def test_router_checks_bodies_like_serve_and_answers_unknown_paths_in_their_dialect():
    """The router's own OpenAI routes check bodies with serve's request models (a wrong type is a 400
    before any provider is asked), refuse ``stream_options`` without ``stream: true`` (it sends every
    provider a stream, so the provider cannot tell), and an unknown path under ``/v1/messages`` or
    ``/api`` is answered in Anthropic's or Ollama's error format."""
    async def main():
        async with Harness() as h:
            h.link(FakeProvider("p", n_tokens=3))
            await h.linked(FakeProvider("p"))
            msgs = [{"role": "user", "content": "hi"}]
            r = await h.http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": "5"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
            r = await h.http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 3,
                                                               "stream_options": {"include_usage": True}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
            r = await h.http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 3,
                                                               "stream": True, "stream_options": {"include_usage": True}})
            assert r.status_code == 200
            r = await h.http.post("/v1/messages/nope", json={})
            assert r.status_code == 404 and r.json()["type"] == "error", r.text
            assert r.json()["error"]["type"] == "not_found_error"
            r = await h.http.post("/api/nope", json={})
            assert r.status_code == 404 and set(r.json()) == {"error"} and isinstance(r.json()["error"], str)
            r = await h.http.get("/v1/nope")
            assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    run(main())


def test_every_dialect_is_forwarded_to_providers():
    """Anthropic, Ollama and Responses requests at the router reach an OpenAI provider (translated at
    the router's edge) and come back in their own format, streamed and not; errors too."""
    import anthropic
    import ollama

    async def main():
        async with Harness() as h:
            h.link(FakeProvider("p", n_tokens=5))
            await h.linked(FakeProvider("p"))
            a = anthropic.AsyncAnthropic(base_url=h.base, api_key="k", max_retries=0, timeout=10)
            m = await a.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
            assert m.content[0].text == expected_text(5) and m.stop_reason == "max_tokens"
            assert (m.usage.input_tokens, m.usage.output_tokens) == (3, 5)
            async with a.messages.stream(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}]) as s:
                assert (await s.get_final_message()).content[0].text == expected_text(5)
            with pytest.raises(anthropic.BadRequestError):
                await a.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "hi"}])
            with pytest.raises(anthropic.NotFoundError):
                await a.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
            o = ollama.AsyncClient(host=h.base)
            assert [x.model for x in (await o.list()).models] == [f"{MODEL}:latest"]
            r = await o.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], options={"num_predict": 5})
            assert r.message.content == expected_text(5) and r.done and r.eval_count == 5
            parts = [p async for p in await o.generate(model=MODEL, prompt="hi", stream=True,
                                                         options={"num_predict": 4})]
            assert "".join(p.response for p in parts) == expected_text(4) and parts[-1].done
            resp = await h.client.responses.create(model=MODEL, input="hi", max_output_tokens=5)
            assert resp.output_text == expected_text(5) and resp.usage.output_tokens == 5
            events = [e async for e in await h.client.responses.create(model=MODEL, input="hi", max_output_tokens=5,
                                                                       stream=True)]
            assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected_text(5)
            await a.close()
            m = (await h.http.get("/metrics")).text
            assert metric(m, "mlxcluster_router_requests_total") >= 7
    run(main())


def test_the_provider_link_is_tls_only():
    """A plaintext client (the token in the clear) is refused in the handshake and never reaches
    the router; a provider that does not trust the router's certificate does not link (nor send
    its token); one that trusts it links and serves."""
    import grpc

    async def main():
        async with Harness() as h:
            async with grpc.aio.insecure_channel(h.grpc) as channel:
                call = rpb_grpc.MarketplaceStub(channel).Link(iter([rpb.ProviderMessage(register=rpb.Register(
                    provider_id="plain", token=TOKEN, models=[MODEL]))]))
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await asyncio.wait_for(call.read(), 10)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            other_key, other_cert = self_signed(["127.0.0.1"])
            for roots in (other_cert, None):  # another certificate; the system's roots
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await run_link(FakeProvider("untrusting"), h.grpc, TOKEN, "untrusting", max_attempts=1,
                                   root_certificates=roots)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert h.router.providers == {} and h.router.stats["refused_providers"] == 0
            h.link(FakeProvider("p"))
            await h.linked(FakeProvider("p"))
            r = await h.client.completions.create(model=MODEL, prompt="x")
            assert r.choices[0].text == expected_text(5)
    run(main())


def test_link_certificate_is_kept_across_restarts(tmp_path):
    names = link_names("127.0.0.1")
    assert names[0] == "127.0.0.1" and "localhost" in names and "0.0.0.0" not in link_names("0.0.0.0")
    key, cert, path, created = link_certificate(str(tmp_path / "d"), names)
    assert created and path == str(tmp_path / "d" / "router-link.pem")
    assert oct((tmp_path / "d" / "router-link.key").stat().st_mode & 0o777) == "0o600"
    assert read_ca(path) == cert and len(fingerprint(cert)) == 95
    assert link_certificate(str(tmp_path / "d"), names)[:2] == (key, cert)  # reused: providers' --router-ca holds
    assert link_certificate(str(tmp_path / "d"), names + ["router.example"])[1] != cert  # a new name: a new one
    (tmp_path / "bad.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match="holds no PEM certificate"):
        read_ca(str(tmp_path / "bad.pem"))
    with pytest.raises(ValueError, match="cannot read"):
        read_ca(str(tmp_path / "missing.pem"))


def test_router_https_and_x_api_key(tmp_path):
    """The router's users' API over HTTPS (--tls-cert/--tls-key, also the link's certificate), and
    the Anthropic client's x-api-key accepted like a Bearer key (one KeyRing with serve's)."""
    import ssl

    import anthropic
    import httpx2

    key_pem, cert_pem = self_signed(["127.0.0.1"])
    (tmp_path / "c.pem").write_bytes(cert_pem)
    (tmp_path / "k.pem").write_bytes(key_pem)

    async def main():
        router = Router(TOKEN, api_keys=["key-alice"])
        await router.start("127.0.0.1", 0, grpc_port=0, tls=(str(tmp_path / "c.pem"), str(tmp_path / "k.pem")))
        link = asyncio.ensure_future(run_link(FakeProvider("p"), f"127.0.0.1:{router.grpc_port}", TOKEN, "p",
                                              root_certificates=cert_pem, heartbeat_interval_s=0.1))
        try:
            assert router.link_cert_pem == cert_pem
            await until_async(lambda: "p" in router.providers, what="registration")
            verify = ssl.create_default_context(cafile=str(tmp_path / "c.pem"))
            async with httpx.AsyncClient(verify=verify, timeout=10) as http:
                client = openai.AsyncOpenAI(base_url=f"https://127.0.0.1:{router.http_port}/v1", api_key="key-alice",
                                            max_retries=0, http_client=http)
                r = await client.completions.create(model=MODEL, prompt="x")
                assert r.choices[0].text == expected_text(5)
                http2 = httpx2.AsyncClient(verify=verify, timeout=10)  # (the anthropic package's httpx)
                a = anthropic.AsyncAnthropic(base_url=f"https://127.0.0.1:{router.http_port}", api_key="key-alice",
                                             max_retries=0, http_client=http2)
                m = await a.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
                assert m.content[0].text == expected_text(5)
                wrong = anthropic.AsyncAnthropic(base_url=f"https://127.0.0.1:{router.http_port}", api_key="nope",
                                                 max_retries=0, http_client=http2)
                with pytest.raises(anthropic.AuthenticationError):
                    await wrong.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
                await http2.aclose()
        finally:
            link.cancel()
            await asyncio.gather(link, return_exceptions=True)
            await router.stop(grace=0.1)
    run(main())

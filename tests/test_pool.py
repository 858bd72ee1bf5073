"""The model pool (front/pool.py) with fake groups and providers, in-process: each request dispatched by its
model, loads on demand (once for concurrent requests), eviction of the least recently used idle unpinned
model (never a busy one), keep_alive, a failed load failing only its waiters, and the HTTP views (404 in
each dialect's format, /v1/models, /api/tags, /api/ps, Ollama's load/unload, /metrics)."""

from __future__ import annotations

import asyncio
import threading
from typing import Dict, List

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from harness import serve_app, until
from mlxcluster.front.pool import ModelPool, PoolModel
from mlxcluster.front.provider import ProviderError

GB = 10**9


class FakeGroup:
    def __init__(self, name: str):
        self.name, self.address, self.credentials, self.stopped = name, f"fake:{name}", None, False

    def failure(self):
        return None

    def stop(self):
        self.stopped = True


class FakeProvider:
    """Answers ``I am NAME`` (one chunk per word); ``gate`` (a threading.Event) holds each answer after
    its first chunk until set."""

    def __init__(self, name: str, group: FakeGroup, gate: threading.Event = None):
        self.model_name, self.models, self.group, self.gate = name, [name], group, gate
        self.registry = CollectorRegistry()
        self.requests = Counter("mlxcluster_provider_requests", "r", ["endpoint", "status"], registry=self.registry)
        self.group_status = {"status": "ok", "restarts": 0, "last_failure": None}
        self.closed = False

    def _check(self, body):
        if body.get("model") not in (None, self.model_name):
            raise ProviderError(404, f"not {self.model_name}", "invalid_request_error", "model", "model_not_found")

    async def _answer(self, body, chat: bool):
        self._check(body)
        assert "keep_alive" not in body  # the pool's field, not the provider's
        for i, word in enumerate(["I", " am", f" {self.model_name}"]):
            piece = {"delta": {"content": word, **({"role": "assistant"} if i == 0 else {})}} if chat else {"text": word}
            yield {"id": "x-1", "object": "chat.completion.chunk" if chat else "text_completion", "created": 0,
                   "model": self.model_name, "choices": [dict(piece, index=0, finish_reason=None)]}
            if i == 0 and self.gate is not None:
                await asyncio.to_thread(self.gate.wait, 30)
        end = {"delta": {}} if chat else {"text": ""}
        yield {"id": "x-1", "object": "chat.completion.chunk" if chat else "text_completion", "created": 0,
               "model": self.model_name, "choices": [dict(end, index=0, finish_reason="stop")]}
        self.requests.labels("chat_completions" if chat else "completions", "200").inc()

    def chat_completion(self, body):
        return self._answer(body, True)

    def completion(self, body):
        return self._answer(body, False)

    async def embed(self, body, *, truncate=False, endpoint="embeddings"):
        self._check(body)
        assert "keep_alive" not in body
        return {"object": "list", "model": self.model_name, "data": [{"embedding": [1.0]}],
                "usage": {"prompt_tokens": 1, "total_tokens": 1}}

    async def count_chat_tokens(self, body):
        self._check(body)
        return len(self.model_name)

    async def health(self):
        return {"status": "ok", "model": self.model_name, "world_size": 1, "queue": {}}

    def load(self):
        return {"queued": 0, "running": 0, "capacity": 4}

    def model_details(self):
        return {"architecture": "llama", "size": 123, "weight_format": "float32", "context_length": 512}

    async def snapshot(self):
        return {"model": self.model_name}

    async def aclose(self):
        self.closed = True


class FakeHealer:
    def __init__(self, provider, group, restart):
        self.group = group

    async def run(self):
        try:
            await asyncio.Event().wait()
        finally:
            self.group.stop()


class Fakes:
    """``start`` / ``connect`` of a pool: records each start; ``fail[name]`` makes its start raise;
    ``hold[name]`` (a threading.Event) holds its start until set; ``gates[name]`` its answers."""

    def __init__(self):
        self.starts: List[str] = []
        self.fail: Dict[str, str] = {}
        self.hold: Dict[str, threading.Event] = {}
        self.gates: Dict[str, threading.Event] = {}
        self.providers: Dict[str, List[FakeProvider]] = {}

    def start(self, name):
        self.starts.append(name)
        if name in self.hold:
            assert self.hold[name].wait(30)
        if name in self.fail:
            raise RuntimeError(self.fail[name])
        return FakeGroup(name)

    def connect(self, name, group, failure):
        assert failure() is None
        provider = FakeProvider(name, group, self.gates.get(name))
        self.providers.setdefault(name, []).append(provider)
        return provider


def pool_of(fakes, *models, **kwargs):
    entries = [m if isinstance(m, PoolModel) else PoolModel(m, GB, details=lambda m=m: {"architecture": m})
               for m in models]
    return ModelPool(entries, fakes.start, fakes.connect, heal=FakeHealer, **kwargs)


def chat(model, **fields):
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}


async def text(pool, body) -> str:
    return "".join(c["choices"][0]["delta"].get("content", "") for c in
                   [c async for c in pool.chat_completion(body)] if c["choices"])


async def error(coro) -> ProviderError:
    with pytest.raises(ProviderError) as err:
        await coro
    return err.value


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_each_request_goes_to_its_models_provider_and_a_model_loads_on_first_use():
    fakes = Fakes()

    async def scenario():
        pool = pool_of(fakes, "a", "b")
        assert pool.models == ["a", "b"] and pool.loaded_names() == []
        assert await text(pool, chat("b")) == "I am b"
        assert await text(pool, {"messages": []}) == "I am a"  # no model: the default
        assert await text(pool, chat("b")) == "I am b"
        assert fakes.starts == ["b", "a"] and sorted(pool.loaded_names()) == ["a", "b"]
        done = [c async for c in pool.completion({"model": "a", "prompt": "x"})]
        assert done[-1]["model"] == "a"
        assert (await pool.embed({"model": "b", "input": "x"}))["model"] == "b"
        assert await pool.count_chat_tokens(chat("b")) == 1
        await pool.embed({"model": "b", "input": "x", "keep_alive": 0})  # Ollama's /api/embed keep_alive
        while "b" in pool.loaded_names():
            await asyncio.sleep(0.01)
        await pool.aclose()
        assert pool.loaded_names() == [] and all(p.group.stopped and p.closed
                                                 for ps in fakes.providers.values() for p in ps)
    run(scenario())


def test_concurrent_requests_for_an_unloaded_model_start_it_once():
    fakes = Fakes()
    fakes.hold["b"] = threading.Event()

    async def scenario():
        pool = pool_of(fakes, "a", "b")
        answers = [asyncio.ensure_future(text(pool, chat("b"))) for _ in range(4)]
        while fakes.starts != ["b"]:
            await asyncio.sleep(0.01)
        assert pool.status()[1]["state"] == "loading" and not any(a.done() for a in answers)
        fakes.hold["b"].set()
        assert await asyncio.gather(*answers) == ["I am b"] * 4
        assert fakes.starts == ["b"] and len(fakes.providers["b"]) == 1
        await pool.aclose()
    run(scenario())


def test_the_least_recently_used_idle_unpinned_model_is_evicted():
    fakes = Fakes()

    async def scenario():
        pool = pool_of(fakes, "a", "b", "c", max_loaded=2)
        await text(pool, chat("a"))
        await text(pool, chat("b"))
        await text(pool, chat("a"))  # b is now the least recently used
        assert await text(pool, chat("c")) == "I am c"
        assert sorted(pool.loaded_names()) == ["a", "c"]
        assert fakes.providers["b"][0].group.stopped
        pinned = pool_of(Fakes(), PoolModel("p", GB, pinned=True), "x", "y", budget_bytes=2 * GB)
        await text(pinned, chat("p"))
        await text(pinned, chat("x"))
        await text(pinned, chat("y"))  # p is the oldest, but pinned: x goes
        assert sorted(pinned.loaded_names()) == ["p", "y"]
        await pool.aclose()
        await pinned.aclose()
    run(scenario())


def test_a_busy_model_is_not_evicted_until_its_request_ends_and_its_stream_loses_nothing():
    fakes = Fakes()
    fakes.gates["a"] = threading.Event()

    async def scenario():
        pool = pool_of(fakes, "a", "b", max_loaded=1)
        streaming = asyncio.ensure_future(text(pool, chat("a")))
        while not fakes.providers.get("a"):
            await asyncio.sleep(0.01)
        waiting = asyncio.ensure_future(text(pool, chat("b")))
        await asyncio.sleep(0.3)
        assert not waiting.done() and fakes.starts == ["a"] and pool.loaded_names() == ["a"]
        fakes.gates["a"].set()
        assert await streaming == "I am a"
        assert await waiting == "I am b"
        assert fakes.starts == ["a", "b"] and pool.loaded_names() == ["b"]
        assert fakes.providers["a"][0].group.stopped
        await pool.aclose()
    run(scenario())


def test_waiting_for_room_is_bounded_by_the_unavailable_wait():
    fakes = Fakes()
    fakes.gates["a"] = threading.Event()

    async def scenario():
        pool = pool_of(fakes, "a", "b", max_loaded=1, unavailable_wait_s=0.2)
        streaming = asyncio.ensure_future(text(pool, chat("a")))
        while not fakes.providers.get("a"):
            await asyncio.sleep(0.01)
        err = await error(text(pool, chat("b")))
        assert err.status == 503 and err.retry_after and "waits for 'a' to finish its requests" in err.message
        fakes.gates["a"].set()
        await streaming
        await pool.aclose()
    run(scenario())


def test_keep_alive_zero_unloads_after_the_answer_and_an_idle_model_expires():
    fakes = Fakes()

    async def scenario():
        pool = pool_of(fakes, "a", PoolModel("b", GB, keep_alive_s=0.2), keep_alive_s=-1)
        reaper = asyncio.ensure_future(pool.run())
        await text(pool, chat("a", keep_alive=0))
        assert pool.status()[0]["state"] in ("stopping", "unloaded")
        await text(pool, chat("b"))
        assert pool.status()[1]["state"] == "ready" and 0 < pool.status()[1]["expires_in_s"] <= 0.2
        while pool.loaded_names():
            await asyncio.sleep(0.02)
        assert fakes.providers["b"][0].group.stopped and fakes.providers["a"][0].group.stopped
        await text(pool, chat("a"))  # keep_alive -1 (the pool's default here): stays
        await text(pool, chat("b", keep_alive="-1"))  # a request's keep_alive wins over the model's
        await asyncio.sleep(0.4)
        assert sorted(pool.loaded_names()) == ["a", "b"]
        assert await pool.keep("b", 0) == "unload"  # Ollama's generate without a prompt, keep_alive 0
        while "b" in pool.loaded_names():
            await asyncio.sleep(0.02)
        assert await pool.keep("b", None) == "load" and "b" in pool.loaded_names()
        err = await error(text(pool, chat("a", keep_alive="soon")))
        assert err.status == 400 and err.param == "keep_alive"
        reaper.cancel()
        await pool.aclose()
    run(scenario())


def test_a_pinned_model_is_preloaded_and_never_expires():
    fakes = Fakes()

    async def scenario():
        pool = pool_of(fakes, "a", PoolModel("p", GB, pinned=True), keep_alive_s=0.05)
        reaper = asyncio.ensure_future(pool.run())
        await pool.preload("p")
        await text(pool, chat("a"))
        while "a" in pool.loaded_names():
            await asyncio.sleep(0.02)
        assert pool.loaded_names() == ["p"] and pool.status()[1]["expires_in_s"] is None
        assert pool.loaded()[0]["expires_at"] == "2100-01-01T00:00:00Z"
        reaper.cancel()
        await pool.aclose()
    run(scenario())


def test_a_failed_load_fails_only_the_requests_waiting_for_it():
    fakes = Fakes()
    fakes.fail["b"] = "corrupt weights in model.safetensors\nTraceback ..."
    fakes.hold["b"] = threading.Event()

    async def scenario():
        pool = pool_of(fakes, "a", "b")
        assert await text(pool, chat("a")) == "I am a"
        waiting = [asyncio.ensure_future(text(pool, chat("b"))) for _ in range(2)]
        while fakes.starts != ["a", "b"]:
            await asyncio.sleep(0.01)
        fakes.hold["b"].set()
        for task in waiting:
            err = await error(task)
            assert err.status == 500 and err.code == "model_load_failed"
            assert err.message == "model 'b' could not be loaded: corrupt weights in model.safetensors"
        assert await text(pool, chat("a")) == "I am a" and pool.loaded_names() == ["a"]
        del fakes.fail["b"]
        assert await text(pool, chat("b")) == "I am b"  # the next request tries again
        assert fakes.starts == ["a", "b", "b"]
        await pool.aclose()
    run(scenario())


def test_a_model_that_can_never_fit_is_refused_with_507_naming_the_memory():
    fakes = Fakes()

    async def scenario():
        pool = pool_of(fakes, "a", PoolModel("big", 3 * GB), budget_bytes=2 * GB)
        err = await error(text(pool, chat("big")))
        assert err.status == 507 and err.code == "insufficient_memory" and "memory budget is 1.9 GiB" in err.message
        assert fakes.starts == []
        err = await error(text(pool, chat("nope")))
        assert err.status == 404 and err.code == "model_not_found" and "available: a, big" in err.message
    run(scenario())


@pytest.fixture
def served():
    """A pool of models a (default), b and c (max 2 loaded), keep_alive 5m, served over HTTP."""
    fakes = Fakes()
    pool = pool_of(fakes, "a", "b", "c", max_loaded=2)
    from mlxcluster.front.api import create_app

    with serve_app(create_app(pool), on_startup=lambda: asyncio.ensure_future(pool.run())) as url, \
            httpx.Client(base_url=url, timeout=30) as client:
        yield client, pool, fakes


def test_unknown_model_is_404_in_each_dialects_format(served):
    client, _pool, _fakes = served
    r = client.post("/v1/chat/completions", json=chat("nope"))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "'nope' does not exist (available: a, b, c)" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"model": "nope", "prompt": "x", "stream": True})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = client.post("/v1/messages", json={"model": "nope", "max_tokens": 5,
                                          "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    for path, body in (("/api/chat", chat("nope")), ("/api/generate", {"model": "nope", "prompt": "x"}),
                       ("/api/generate", {"model": "nope", "prompt": "", "keep_alive": 0})):
        r = client.post(path, json=dict(body, stream=False))
        assert r.status_code == 404 and "'nope' does not exist" in r.json()["error"], (path, r.text)
    r = client.post("/v1/responses", json={"model": "nope", "input": "hi"})
    assert r.status_code == 404
    r = client.post("/v1/embeddings", json={"model": "nope", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_models_tags_and_ps_and_ollamas_load_and_unload(served):
    client, pool, fakes = served
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["a", "b", "c"]
    assert client.get("/v1/models/c").status_code == 200 and client.get("/v1/models/d").status_code == 404
    tags = client.get("/api/tags").json()["models"]
    assert [m["name"] for m in tags] == ["a:latest", "b:latest", "c:latest"] and fakes.starts == []
    assert tags[1]["details"]["family"] == "b"  # the registered description: nothing loaded for /api/tags
    assert client.get("/api/ps").json() == {"models": []}
    r = client.post("/api/generate", json={"model": "b:latest", "prompt": "hi", "stream": False, "keep_alive": "10m"})
    assert r.status_code == 200 and r.json()["response"] == "I am b"
    r = client.post("/v1/chat/completions", json=chat("a"))
    assert r.json()["choices"][0]["message"]["content"] == "I am a" and r.json()["model"] == "a"
    ps = client.get("/api/ps").json()["models"]
    assert [m["name"] for m in ps] == ["a:latest", "b:latest"]  # most recently used first
    assert all(m["size"] == GB and m["size_vram"] == 0 and m["expires_at"].endswith("Z") for m in ps)
    assert ps[0]["expires_at"] < ps[1]["expires_at"]  # a: 5 minutes, b: 10
    r = client.post("/api/generate", json={"model": "b", "prompt": "", "keep_alive": 0})
    assert r.status_code == 200 and r.json()["done"] and r.json()["done_reason"] == "unload"
    until(lambda: pool.loaded_names() == ["a"], 10, "b unloaded")
    r = client.post("/api/generate", json={"model": "c", "prompt": ""})
    assert r.json()["done_reason"] == "load" and sorted(pool.loaded_names()) == ["a", "c"]
    r = client.post("/api/generate", json={"model": "c", "prompt": "", "keep_alive": "soon"})
    assert r.status_code == 400 and "keep_alive" in r.json()["error"]
    metrics = client.get("/metrics").text
    assert 'mlxcluster_model_loaded{model="c"} 1.0' in metrics and 'mlxcluster_model_loaded{model="b"} 0.0' in metrics
    assert 'mlxcluster_model_requests_total{endpoint="chat_completions",model="a",status="200"} 1.0' in metrics
    assert 'mlxcluster_model_unloads_total{model="b",reason="keep_alive"} 1.0' in metrics
    # each loaded provider's own series, labelled with its model
    assert 'mlxcluster_provider_requests_total{endpoint="chat_completions",model="a",status="200"} 1.0' in metrics
    health = client.get("/health").json()
    assert health["status"] == "ok" and [m["name"] for m in health["models"] if m["loaded"]] == ["a", "c"]
    assert client.get("/dashboard/state").json()["models"][2]["state"] == "ready"


def test_requests_counted_per_model_and_an_unknown_model_unlabelled(served):
    client, pool, _fakes = served
    client.post("/v1/chat/completions", json=chat("nope"))
    client.post("/v1/chat/completions", content=b"{bad json")
    metrics = client.get("/metrics").text
    assert 'mlxcluster_model_requests_total{endpoint="chat_completions",model="",status="404"} 1.0' in metrics
    assert 'mlxcluster_model_requests_total{endpoint="chat_completions",model="",status="400"} 1.0' in metrics

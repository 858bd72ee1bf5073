"""The OpenAI-compatible provider (``mlxcluster.serving``) on the real model.

One TP=1 group and one provider serve the whole module (uvicorn in a
background thread); the official ``openai`` client drives it.  A second
provider on the same rank 0, with one slot and a queue of one, checks the
429 path and that a client disconnect frees the slot.
"""

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from mlxcluster.control.client import GenerationClient
from mlxcluster.serving import Provider, create_app
from mlxcluster.serving.provider import Scheduler, QueueFull, _stop_hold, chat_prompt_ids
from mlxcluster.runtime.launcher import LocalCluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "smollm2"
CHAT_PROMPT = "Write a long story about a dragon who learns to fly."
TEXT_PROMPT = "Here is a list of the planets in the solar system, with one fact about each:"


class Server:
    """uvicorn serving ``create_app(provider)`` on a free loopback port, in a thread."""

    def __init__(self, provider):
        import socket

        import uvicorn

        self.provider = provider
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(create_app(provider), log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            assert self.thread.is_alive(), "uvicorn exited"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="module")
def cluster(real_model_path):
    with LocalCluster(1, model=real_model_path, weights="float32") as c:
        yield c


@pytest.fixture(scope="module")
def server(cluster, real_model_path):
    s = Server(Provider(cluster.address, real_model_path, MODEL))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def small_server(cluster, real_model_path):
    """One running slot, one waiting: the third concurrent request is refused."""
    s = Server(Provider(cluster.address, real_model_path, MODEL, max_queue=1, max_concurrency=1))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def rank0(cluster):
    c = GenerationClient(cluster.address)
    yield c
    c.close()


def chat(client, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("messages", [{"role": "user", "content": CHAT_PROMPT}])
    return client.chat.completions.create(**kw)


# -- no model needed -----------------------------------------------------------------
def test_stop_hold():
    assert _stop_hold("abc", ["cde"]) == 1
    assert _stop_hold("abcd", ["cde", "bcdx"]) == 3
    assert _stop_hold("abc", ["x"]) == 0
    assert _stop_hold("", ["abc"]) == 0


def test_scheduler_fifo_queue_full_and_cancel():
    async def main():
        s = Scheduler(capacity=1, max_queue=2)
        await s.acquire()
        order = []

        async def waiter(name):
            await s.acquire()
            order.append(name)

        a = asyncio.ensure_future(waiter("a"))
        b = asyncio.ensure_future(waiter("b"))
        await asyncio.sleep(0.01)
        assert (s.running, s.queued) == (1, 2)
        with pytest.raises(QueueFull):
            await s.acquire()
        a.cancel()  # a cancelled waiter leaves the queue
        await asyncio.sleep(0.01)
        assert s.queued == 1
        s.release()  # the slot goes to b
        await asyncio.wait_for(b, 1)
        assert order == ["b"] and (s.running, s.queued) == (1, 0)
        s.release()
        assert s.running == 0

    asyncio.run(main())


# -- the real model over HTTP --------------------------------------------------------
def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_completion(client, server, rank0):
    r = chat(client, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content.strip()
    # The same greedy chat through rank 0's own tokenisation (mlxcluster generate --chat).
    ref = rank0.generate(CHAT_PROMPT, chat=True, max_tokens=12)
    assert chat_prompt_ids(server.provider.tokenizer, [{"role": "user", "content": CHAT_PROMPT}]) == ref.prompt_ids
    assert r.usage.prompt_tokens == len(ref.prompt_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert msg.content == ref.text
    assert r.choices[0].finish_reason == ("length" if ref.reason == "MAX_TOKENS" else "stop")


def test_chat_completion_streaming(client):
    stream = chat(client, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)  # the client stops at [DONE]
    assert chunks[0].choices[0].delta.role == "assistant"
    token_chunks = [c for c in chunks[1:] if c.choices and c.choices[0].delta.content is not None]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None
    assert usage.completion_tokens == len(token_chunks) == 12
    text = "".join(c.choices[0].delta.content for c in token_chunks)
    assert text.strip()
    assert text == chat(client, max_tokens=12, temperature=0).choices[0].message.content
    # Without include_usage there is no usage chunk (as OpenAI).
    plain = list(chat(client, max_tokens=2, temperature=0, stream=True))
    assert all(c.choices for c in plain)


def test_completion_greedy_equals_generate(client, rank0):
    r = client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=16, temperature=0)
    ref = rank0.generate(TEXT_PROMPT, max_tokens=16)
    assert r.object == "text_completion"
    assert r.choices[0].text == ref.text and ref.text.strip()
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_ids), 16)

    chunks = list(client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    token_chunks = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert "".join(c.choices[0].text for c in token_chunks) == ref.text
    assert len(token_chunks) == chunks[-1].usage.completion_tokens == 16
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        return chat(client, max_tokens=12, temperature=0.9, seed=seed).choices[0].message.content

    a, b = sample(7), sample(7)
    assert a == b and a.strip()
    # Another seed gives another text (a second try makes a coincidence negligible).
    assert sample(8) != a or sample(9) != a, "different seeds gave the same text as seed 7"


def test_stop_sequences(client, rank0):
    full = rank0.generate(TEXT_PROMPT, max_tokens=16).text
    # A stop string in the middle of the text, most likely spanning tokens.
    mid = len(full) // 2
    stop = full[mid:mid + 4]
    expected = full[:full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=16, temperature=0,
                                  stop=[stop, "@@never@@"])
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 16
    chunks = list(client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=16, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_max_tokens_length(client):
    r = chat(client, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3


def test_errors(client, server):
    t0 = time.monotonic()
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, model="no-such-model", max_tokens=4)
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=0)
    assert e.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        chat(client, max_tokens=4, temperature=2.5)
    with pytest.raises(openai.BadRequestError):
        chat(client, max_tokens=4, top_p=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hello " * 9000, max_tokens=4)
    assert "context" in e.value.message and e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=4, messages=[{"role": "user", "content": "hello " * 9000}], stream=True)
    assert time.monotonic() - t0 < 20  # refused before reaching rank 0

    for body in (b"{not json", b"[1, 2]", b'{"model": "smollm2"}'):
        r = httpx.post(server.url + "/v1/chat/completions", content=body,
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code in (400, 422), body
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error" and "param" in err and "code" in err
    r = httpx.get(server.url + "/v1/nothing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_health_and_metrics(server):
    h = httpx.get(server.url + "/health", timeout=10)
    assert h.status_code == 200
    body = h.json()
    assert body["world_size"] == 1 and body["model"] == MODEL and body["context_length"] == 8192
    assert set(body["queue"]) == {"queued", "running", "capacity"}

    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("mlxcluster_provider_requests_total", "mlxcluster_provider_queue_depth",
                 "mlxcluster_provider_running", "mlxcluster_provider_time_to_first_token_seconds_bucket",
                 "mlxcluster_provider_decode_tokens_per_second_bucket", "mlxcluster_provider_queue_wait_seconds_count",
                 "mlxcluster_provider_errors_total", "mlxcluster_provider_completion_tokens_total"):
        assert name in text, name
    samples = {}
    for line in text.splitlines():
        if line.startswith("mlxcluster_provider_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            samples[labels] = float(value)
    assert samples.get('mlxcluster_provider_requests_total{endpoint="chat_completions",status="200"}', 0) >= 1
    assert samples.get('mlxcluster_provider_requests_total{endpoint="completions",status="200"}', 0) >= 1
    assert samples.get('mlxcluster_provider_requests_total{endpoint="chat_completions",status="404"}', 0) >= 1


def test_health_503_when_rank0_unreachable(real_model_path, cluster):
    from mlxcluster.serving.api import create_app as make_app
    from starlette.testclient import TestClient

    p = Provider(cluster.address, real_model_path, MODEL)
    p.rank0_address = "127.0.0.1:1"  # nothing listens there
    with TestClient(make_app(p)) as tc:
        r = tc.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        r = tc.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


def test_queue_full_429(small_server):
    body = {"model": MODEL, "prompt": TEXT_PROMPT, "max_tokens": 12, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(base_url=small_server.url, timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(3)))

    replies = asyncio.run(main())
    assert sorted(r.status_code for r in replies) == [200, 200, 429]
    refused = next(r for r in replies if r.status_code == 429)
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert small_server.provider.load() == {"queued": 0, "running": 0, "capacity": 1}


def test_disconnect_frees_the_slot(small_server, rank0):
    provider = small_server.provider
    body = {"model": MODEL, "prompt": TEXT_PROMPT, "max_tokens": 4000, "temperature": 0, "stream": True}
    with httpx.Client(base_url=small_server.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    assert provider.load()["running"] == 1, events
                    if len(events) == 2:
                        break  # (leaving iter_lines closes the connection)
    # The connection is closed: the provider cancels the call, rank 0 stops the session.
    deadline = time.monotonic() + 10
    while provider.load()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert provider.load()["running"] == 0
    if "running" in type(rank0.info()).DESCRIPTOR.fields_by_name:
        while rank0.info().running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rank0.info().running == 0
    # With the slot free, the next request runs at once (the old one had ~4000 tokens to go).
    t0 = time.monotonic()
    r = httpx.post(small_server.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert time.monotonic() - t0 < 15
    # A non-streaming client that gives up is cancelled as well.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(small_server.url + "/v1/completions", timeout=httpx.Timeout(60, read=2),
                   json={"model": MODEL, "prompt": TEXT_PROMPT, "max_tokens": 4000, "temperature": 0})
    deadline = time.monotonic() + 10
    while provider.load()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert provider.load()["running"] == 0
    metrics = httpx.get(small_server.url + "/metrics", timeout=10).text
    assert 'mlxcluster_provider_requests_total{endpoint="completions",status="499"} 2.0' in metrics


# -- mlxcluster serve ----------------------------------------------------------------
def _cli(*args, timeout=60):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "mlxcluster.cli", "serve", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, stdin=subprocess.DEVNULL)


def _one_error(proc, needle):
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    errors = [l for l in proc.stderr.splitlines() if l.startswith("mlxcluster: error:")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr


def test_serve_bad_input(tmp_path):
    _one_error(_cli("--port", "70000"), "--port")
    _one_error(_cli("--model", str(tmp_path / "nope.gguf")), "model not found")
    import importlib.util

    if importlib.util.find_spec("mlxcluster.serving.link") is None:
        _one_error(_cli("--router", "http://127.0.0.1:1", "--router-token", "t"), "mlxcluster.serving.link")


def test_serve_command_end_to_end():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "mlxcluster.cli", "serve", "--port", str(port), "--weights",
                             "float32", "--model-name", "m", "--log-level", "warning"],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "serve did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "m", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

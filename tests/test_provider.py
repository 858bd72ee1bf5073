"""The OpenAI-compatible provider (``mlxcluster.front``).

Fast tier: a fake rank 0 (the ``Generation`` service with rank 0's admission
rule for ``max_batch=1, max_queue=0``) checks the 429 path and cancellation on
disconnect without the real model.  Slow tier: one real TP=1 group started
with ``--max-batch 1 --max-queue 1`` and one provider serve the rest of the
module (uvicorn in a background thread); the official ``openai`` client
drives it, and rank 0's own queue answers 429 when full.
"""

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import grpc
import httpx
import openai
import pytest

from harness import serve_app, serving_rank0, until
from mlxcluster.leader.generation import GenerationClient
from mlxcluster.model.tokenizer import apply_chat_messages
from mlxcluster.protocol import mlxcluster_pb2 as pb
from mlxcluster.protocol import mlxcluster_pb2_grpc as pb_grpc
from mlxcluster.model.topology import Topology
from mlxcluster.runtime.rank_config import RankConfig
from mlxcluster.runtime.launcher import LocalCluster
from mlxcluster.front import Provider, create_app
from mlxcluster.front.tools import stop_hold as _stop_hold
from mlxcluster.leader.scheduler import Scheduler
from mlxcluster.front.sse import usage_rule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "smollm2"
CHAT_PROMPT = "Write a long story about a dragon who learns to fly."
TEXT_PROMPT = "Here is a list of the planets in the solar system, with one fact about each:"
#: the greedy answers' lengths: enough for a stop string inside the text, chunks to stream and compare
TEXT_TOKENS = 8
CHAT_TOKENS = 8
slow = pytest.mark.slow


class Server:
    """uvicorn serving ``create_app(provider)`` on a free loopback port, in a thread
    (:func:`harness.serve_app`) until :meth:`stop`."""

    def __init__(self, provider):
        self.provider = provider
        self._served = contextlib.ExitStack()
        self.url = self._served.enter_context(serve_app(create_app(provider)))
        self.port = int(self.url.rsplit(":", 1)[1])

    def stop(self):
        self._served.close()


def _metric(text, line_start):
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


# -- no model needed -----------------------------------------------------------------
def test_stop_hold():
    assert _stop_hold("abc", ["cde"]) == 1
    assert _stop_hold("abcd", ["cde", "bcdx"]) == 3
    assert _stop_hold("abc", ["x"]) == 0
    assert _stop_hold("", ["abc"]) == 0


def test_usage_rule():
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    only_usage = {"id": "c", "choices": [], "usage": usage}
    both = {"id": "c", "choices": [{"index": 0, "text": "x"}], "usage": usage}
    plain = {"id": "c", "choices": [{"index": 0, "text": "x"}]}
    assert usage_rule(only_usage, True) is only_usage and usage_rule(both, True) == plain  # usage: last chunk only
    assert usage_rule(only_usage, False) is None
    assert usage_rule(both, False) == plain and "usage" in both
    assert usage_rule(plain, False) is plain


class FakeRank0(pb_grpc.GenerationServicer):
    """Rank 0's ``Generation`` service as the provider sees it, with rank 0's
    admission rule for ``max_batch=1, max_queue=0``: a ``Generate`` while one
    runs is refused with ``RESOURCE_EXHAUSTED`` (how ``leader/generation.py``
    answers ``QueueFullError``).  A running call streams one token, then waits
    until :meth:`release` or until it is cancelled."""

    TOKEN = 70

    def __init__(self):
        self.lock = threading.Lock()
        self.running = 0
        self.released = False
        self.gates = []
        self.streaming = threading.Event()   # a call sent its token
        self.cancelled = threading.Event()   # a call was cancelled by the provider

    def release(self):
        with self.lock:
            self.released = True
            for gate in self.gates:
                gate.set()

    def Info(self, request, context):
        return pb.InfoReply(model="tiny", world_size=1, backend="ring", context_length=64, vocab_size=256,
                            weight_format="float32", capacity=1, max_queue=0, queued=0, running=self.running,
                            batch_limit=1)

    def Generate(self, request, context):
        try:  # rank 0's own prompt check (leader/generation.py), before its queue
            Scheduler.validate_prompt(SimpleNamespace(vocab_size=256, context_length=64), request.prompt_ids)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        gate = threading.Event()
        with self.lock:
            busy = self.running >= 1
            if not busy:
                self.running += 1
                self.gates.append(gate)
                if self.released:
                    gate.set()
        if busy:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "0 requests are already waiting; retry later")
        context.add_callback(gate.set)  # the call ended: cancelled, or finished below
        try:
            yield pb.GenerateEvent(started=pb.GenerateStarted(prompt_ids=request.prompt_ids))
            yield pb.GenerateEvent(token=pb.GeneratedToken(token_id=self.TOKEN, text="A"))
            self.streaming.set()
            gate.wait(30)
            if not context.is_active():
                self.cancelled.set()
                return
            yield pb.GenerateEvent(done=pb.GenerateDone(reason=pb.MAX_TOKENS, text_tail="", generated_tokens=1))
        finally:
            with self.lock:
                self.running -= 1


@pytest.fixture
def fake_server(tmp_path, tls):
    fake = FakeRank0()
    with serving_rank0(fake, tmp_path, tls) as (address, path):
        server = None
        try:
            provider = Provider(address, path, "tiny", tls)
            assert FakeRank0.TOKEN not in provider.eos_token_ids
            server = Server(provider)
            yield fake, server
        finally:
            fake.release()
            if server is not None:
                server.stop()


def test_rank0_queue_full_is_429_and_disconnect_cancels(fake_server):
    fake, server = fake_server
    provider = server.provider
    assert (provider.capacity, provider.max_queue) == (1, 0)  # rank 0's InfoReply, not guessed
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=dict(body, stream=True)) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")).startswith('data: {"id":"cmpl-')
            assert fake.streaming.wait(10)
            assert provider.load() == {"queued": 0, "running": 1, "capacity": 1}
            # Rank 0 is full (one running, no queue): forwarded, refused there, 429 here.
            refused = c.post("/v1/completions", json=body)
            assert refused.status_code == 429
            assert int(refused.headers["Retry-After"]) >= 1
            err = refused.json()["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
            assert "already waiting" in err["message"]
            health = c.get("/health").json()
            assert health["queue"] == {"capacity": 1, "max_queue": 0, "queued": 0, "running": 1, "batch_limit": 1}
        # Leaving the block closed the connection: the provider cancels the call on rank 0.
        assert fake.cancelled.wait(10), "rank 0 never saw the cancellation"
        until(lambda: provider.load()["running"] == 0, what="the provider to drop the request")
        fake.release()
        done = c.post("/v1/completions", json=body)
        assert done.status_code == 200, done.text
        assert done.json()["choices"][0]["text"] == "A" and done.json()["usage"]["completion_tokens"] == 1
        metrics = c.get("/metrics").text
    assert _metric(metrics, 'mlxcluster_provider_requests_total{endpoint="completions",status="429"}') == 1
    assert _metric(metrics, 'mlxcluster_provider_requests_total{endpoint="completions",status="499"}') == 1
    assert _metric(metrics, 'mlxcluster_provider_requests_total{endpoint="completions",status="200"}') == 1
    assert _metric(metrics, "mlxcluster_provider_running ") == 0


def test_bad_requests_are_400_in_openai_format(fake_server):
    fake, server = fake_server
    with httpx.Client(base_url=server.url, timeout=30) as c:
        def error(body, path="/v1/completions"):
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = c.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and "\n" not in err["message"], err
            return err

        # the JSON body (parsed by the API, the same way as the router's)
        assert "not valid JSON" in error(b"{not json")["message"]
        assert "JSON object" in error(b"[1, 2]", "/v1/chat/completions")["message"]
        # hostile bodies: deep nesting, non-finite numbers, a lone surrogate, not UTF-8
        assert "deeper than" in error(b"[" * 100000)["message"]
        assert "deeper than" in error(b'{"a":' * 100000, "/v1/chat/completions")["message"]
        assert "NaN" in error(b'{"model": "tiny", "prompt": "hi", "temperature": NaN}')["message"]
        assert "out of range" in error(b'{"model": "tiny", "prompt": "hi", "temperature": 1e999}')["message"]
        assert "surrogate" in error(b'{"model": "tiny", "prompt": "a\\ud800b"}')["message"]
        assert "surrogate" in error(b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}]}',
                                    "/v1/chat/completions")["message"]
        assert "not UTF-8" in error(b'{"model": "tiny", "prompt": "\xff"}')["message"]
        r = c.post("/v1/completions", content=b" " * (8 * 2**20 + 1), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        # rank 0 refused the prompt (INVALID_ARGUMENT): 400 naming the prompt's field
        err = error({"model": "tiny", "prompt": [1, 300], "max_tokens": 2})
        assert err["param"] == "prompt" and "vocabulary" in err["message"]
        err = error({"model": "tiny", "prompt": [2 ** 40], "max_tokens": 2})  # not even an int32
        assert err["param"] == "prompt"
        # no room for the answer in the 64-token context: refused before rank 0
        for stream in (False, True):
            err = error({"model": "tiny", "prompt": "hello " * 100, "max_tokens": 2, "stream": stream})
            assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
            assert "context length is 64" in err["message"]
        # room for the prompt, not for the max_tokens it asks: refused, not cut short at the context's end
        for stream in (False, True):
            err = error({"model": "tiny", "prompt": [1] * 40, "max_tokens": 30, "stream": stream})
            assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
            assert "at most 24" in err["message"] and "context length is 64" in err["message"]
        metrics = c.get("/metrics").text
    assert fake.running == 0 and not fake.streaming.is_set()
    assert _metric(metrics, 'mlxcluster_provider_requests_total{endpoint="completions",status="400"}') == 12
    assert _metric(metrics, 'mlxcluster_provider_requests_total{endpoint="chat_completions",status="400"}') == 3


# -- the real model ------------------------------------------------------------------
@pytest.mark.parametrize("path,field,value", [
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("/v1/chat/completions", "functions", [{"name": "f", "parameters": {}}]),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/completions", "suffix", " the end"),
    ("/v1/completions", "best_of", 3),
])
def test_fields_not_implemented_are_refused_never_ignored(fake_server, path, field, value):
    """A request asking for tools, JSON output, log probabilities, penalties or a bias gets a
    400 naming the field (OpenAI's error format), not prose as if it had been honoured."""
    fake, server = fake_server
    body = {"model": "tiny", "max_tokens": 2, field: value}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["code"] == "unsupported_parameter" and f"'{field}'" in err["message"]
    assert not fake.streaming.is_set()  # refused before rank 0


def test_fields_asking_for_nothing_and_integral_float_seeds_are_accepted(fake_server):
    fake, server = fake_server
    fake.release()
    neutral = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "logprobs": False,
               "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "seed": 35804.0,
               "user": "u1", "metadata": {"k": "v"}, "store": False}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], **neutral})
    assert r.status_code == 200, r.text
    fp = r.json()["system_fingerprint"]
    assert isinstance(fp, str) and fp.startswith("fp_")  # OpenAI's schema types it as a string
    r = httpx.post(server.url + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": "x", "seed": 1.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"


@pytest.mark.parametrize("path,extra,param,words", [
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "requires 'logprobs'"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "at most 20"),
    ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs", "boolean"),
    ("/v1/completions", {"logprobs": 6}, "logprobs", "at most 5"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format", "one of"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", "'name'"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frobnicate"}}}}, "response_format", "invalid"),
])
def test_bad_output_fields_are_400(fake_server, path, extra, param, words):
    fake, server = fake_server
    body = {"model": "tiny", "max_tokens": 2, **extra}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert not fake.streaming.is_set()


@pytest.mark.parametrize("field,value,words", [
    ("logit_bias", {"x": 1}, "not a token id"),
    ("logit_bias", {"256": 1}, "outside the vocabulary"),
    ("logit_bias", {"5": 101}, "[-100, 100]"),
    ("logit_bias", [1, 2], "must be an object"),
    ("presence_penalty", 2.5, "at most 2"),
    ("frequency_penalty", -3, "at least -2"),
])
def test_bad_processor_fields_are_400(fake_server, field, value, words):
    _, server = fake_server
    r = httpx.post(server.url + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": "x", field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field and words in r.json()["error"]["message"]


def test_openapi_and_docs_are_published(fake_server):
    _, server = fake_server
    spec = httpx.get(server.url + "/openapi.json", timeout=30)
    assert spec.status_code == 200
    paths = spec.json()["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(paths)
    docs = httpx.get(server.url + "/docs", timeout=30)
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


@pytest.fixture(scope="module", params=["tp", "pd"])
def cluster(request, real_model_path):
    # One sequence at a time, one waiting: rank 0's queue is the one tested here.  "pd": the same
    # tests against a decode group whose prompts a separate prefill group prefills (--pd 1:1).
    one = RankConfig(max_batch=1, max_queue=1)
    if request.param == "tp":
        with LocalCluster(1, model=real_model_path, weights="float32", config=one) as c:
            yield c
        return
    from mlxcluster.security import new_secret

    secret = new_secret()
    with LocalCluster(1, model=real_model_path, weights="float32", topology=Topology(role="prefill"),
                      secret=secret) as prefill:
        with LocalCluster(1, model=real_model_path, weights="float32", secret=secret,
                          config=one, topology=Topology(prefill_peer=prefill.address)) as c:
            yield c


@pytest.fixture(scope="module")
def server(cluster, real_model_path):
    s = Server(Provider(cluster.address, real_model_path, MODEL, cluster.credentials))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def rank0(cluster):
    c = GenerationClient(cluster.address, cluster.credentials)
    yield c
    c.close()


@pytest.fixture(scope="module")
def text_ref(rank0):
    """Rank 0's greedy answer to :data:`TEXT_PROMPT` (:data:`TEXT_TOKENS` tokens), asked once per group."""
    return rank0.generate(TEXT_PROMPT, max_tokens=TEXT_TOKENS)


@pytest.fixture(scope="module")
def greedy_chat(client):
    """The provider's greedy chat completion of :data:`CHAT_PROMPT` (:data:`CHAT_TOKENS` tokens), asked once
    per group."""
    return chat(client, max_tokens=CHAT_TOKENS, temperature=0)


def chat(client, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("messages", [{"role": "user", "content": CHAT_PROMPT}])
    return client.chat.completions.create(**kw)


@slow
def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


@slow
def test_chat_completion(greedy_chat, server, rank0):
    r = greedy_chat
    assert r.object == "chat.completion" and r.model == MODEL
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content.strip()
    # The same greedy chat through rank 0's own tokenisation (mlxcluster generate --chat).
    ref = rank0.generate(CHAT_PROMPT, chat=True, max_tokens=CHAT_TOKENS)
    assert apply_chat_messages(server.provider.tokenizer, [{"role": "user", "content": CHAT_PROMPT}]) == ref.prompt_ids
    assert r.usage.prompt_tokens == len(ref.prompt_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert msg.content == ref.text
    assert r.choices[0].finish_reason == ("length" if ref.reason == "MAX_TOKENS" else "stop")


@slow
def test_usage_counts_the_prompt_tokens_taken_from_the_prefix_cache(client, request):
    # Two chats share the template's system prompt: the second takes it from the ranks' prefix
    # caches (a decode group fed by a prefill group prefills nothing itself: none there).
    kw = dict(max_tokens=2, temperature=0)
    first = chat(client, messages=[{"role": "user", "content": "Name a colour."}], **kw)
    second = chat(client, messages=[{"role": "user", "content": "Name a fruit, please."}], **kw)
    streamed = list(chat(client, messages=[{"role": "user", "content": "Name a fruit, please."}], stream=True,
                         stream_options={"include_usage": True}, **kw))
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details is not None
    if request.node.callspec.params["cluster"] == "pd":
        assert cached == 0
    else:
        assert 16 <= cached < second.usage.prompt_tokens  # the system prompt, not the question
        # the same prompt again: all of it but the last position (its logits give the first token)
        assert streamed[-1].usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1


@slow
def test_chat_completion_streaming(client, greedy_chat):
    stream = chat(client, max_tokens=CHAT_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)  # the client stops at [DONE]
    assert chunks[0].choices[0].delta.role == "assistant"
    token_chunks = [c for c in chunks[1:] if c.choices and c.choices[0].delta.content is not None]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None
    assert usage.completion_tokens == len(token_chunks) == CHAT_TOKENS
    text = "".join(c.choices[0].delta.content for c in token_chunks)
    assert text.strip()
    assert text == greedy_chat.choices[0].message.content
    # Without include_usage there is no usage chunk (as OpenAI).
    plain = list(chat(client, max_tokens=2, temperature=0, stream=True))
    assert all(c.choices for c in plain)


@slow
def test_completion_greedy_equals_generate(client, text_ref):
    r = client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=TEXT_TOKENS, temperature=0)
    ref = text_ref
    assert r.object == "text_completion"
    assert r.choices[0].text == ref.text and ref.text.strip()
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_ids), TEXT_TOKENS)

    chunks = list(client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=TEXT_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    token_chunks = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert "".join(c.choices[0].text for c in token_chunks) == ref.text
    assert len(token_chunks) == chunks[-1].usage.completion_tokens == TEXT_TOKENS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


@slow
def test_max_tokens_cutting_a_character_leaves_no_replacement_character(client):
    """SmolLM2 greedily answers this with emoji (one emoji, then 2 tokens of the next: 5 tokens end
    inside one).  The incomplete UTF-8 sequence is not sent as U+FFFD (the model did not produce that
    character), streamed or not."""
    kw = dict(max_tokens=5, temperature=0)
    text = chat(client, messages=[{"role": "user", "content": "Write three emoji about the sun"}], **kw)
    content = text.choices[0].message.content
    assert text.choices[0].finish_reason == "length" and "\ufffd" not in content and content.strip()
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write three emoji about the sun"}], stream=True, **kw)
        if c.choices)
    assert streamed == content


@slow
def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        return chat(client, max_tokens=8, temperature=0.9, seed=seed).choices[0].message.content

    a, b = sample(7), sample(7)
    assert a == b and a.strip()
    # Another seed gives another text (a second try makes a coincidence negligible).
    assert sample(8) != a or sample(9) != a, "different seeds gave the same text as seed 7"


@slow
def test_stop_sequences(client, text_ref):
    full = text_ref.text
    # A stop string in the middle of the text, most likely spanning tokens.
    mid = len(full) // 2
    stop = full[mid:mid + 4]
    expected = full[:full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=TEXT_TOKENS, temperature=0,
                                  stop=[stop, "@@never@@"])
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < TEXT_TOKENS
    chunks = list(client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=TEXT_TOKENS, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


@slow
def test_max_tokens_length(client):
    r = chat(client, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3


@slow
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


@slow
def test_health_and_metrics(server):
    h = httpx.get(server.url + "/health", timeout=10)
    assert h.status_code == 200
    body = h.json()
    assert body["world_size"] == 1 and body["model"] == MODEL and body["context_length"] == 8192
    # rank 0's queue, as started with --max-batch 1 --max-queue 1
    assert body["queue"] == {"capacity": 1, "max_queue": 1, "queued": 0, "running": 0, "batch_limit": 1}

    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("mlxcluster_provider_requests_total", "mlxcluster_provider_queue_depth",
                 "mlxcluster_provider_running", "mlxcluster_provider_time_to_first_token_seconds_bucket",
                 "mlxcluster_provider_decode_tokens_per_second_bucket", "mlxcluster_provider_capacity",
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


@slow
def test_health_503_when_rank0_unreachable(real_model_path, cluster):
    from mlxcluster.front.api import create_app as make_app
    from starlette.testclient import TestClient

    p = Provider(cluster.address, real_model_path, MODEL, cluster.credentials)
    p.rank0_address = "127.0.0.1:1"  # nothing listens there
    with TestClient(make_app(p)) as tc:
        r = tc.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
        r = tc.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


@slow
def test_queue_full_429(server, rank0):
    """Rank 0 runs one sequence and queues one: a third concurrent request is answered 429."""
    body = {"model": MODEL, "prompt": TEXT_PROMPT, "max_tokens": 24, "temperature": 0, "stream": True}

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            async def run(body):
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    return r.status_code, await r.aread()

            running = asyncio.ensure_future(run(body))
            await asyncio.to_thread(until, lambda: rank0.info().running == 1, 60, "the first request to run")
            queued = asyncio.ensure_future(run(dict(body, max_tokens=2)))  # waits its turn: few tokens will do
            await asyncio.to_thread(until, lambda: rank0.info().queued == 1, 60, "the second request to queue")
            refused = await c.post("/v1/completions", json=dict(body, stream=False))
            return refused, await running, await queued

    refused, running, queued = asyncio.run(main())
    assert refused.status_code == 429
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["type"] == "rate_limit_error"
    for status, raw in (running, queued):  # nothing lost: both complete
        assert status == 200 and raw.rstrip().endswith(b"data: [DONE]") and b'"finish_reason":"length"' in raw
    assert server.provider.load() == {"queued": 0, "running": 0, "capacity": 1}


@slow
def test_disconnect_frees_the_slot(server, rank0):
    provider = server.provider
    body = {"model": MODEL, "prompt": TEXT_PROMPT, "max_tokens": 4000, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    assert provider.load()["running"] == 1, events
                    if len(events) == 2:
                        break  # (leaving the block closes the connection)
    # The connection is closed: the provider cancels the call, rank 0 stops the session.
    until(lambda: provider.load()["running"] == 0, 10, "the provider to drop the request")
    until(lambda: rank0.info().running == 0, 10, "rank 0 to retire the sequence")
    # With the slot free, the next request runs at once (the old one had ~4000 tokens to go).
    t0 = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert time.monotonic() - t0 < 15
    # A non-streaming client that gives up is cancelled as well.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=httpx.Timeout(60, read=2),
                   json={"model": MODEL, "prompt": TEXT_PROMPT, "max_tokens": 4000, "temperature": 0})
    until(lambda: provider.load()["running"] == 0, 10, "the provider to drop the request")
    until(lambda: rank0.info().running == 0, 10, "rank 0 to retire the sequence")
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert _metric(metrics, 'mlxcluster_provider_requests_total{endpoint="completions",status="499"}') == 2


# -- mlxcluster serve ----------------------------------------------------------------
def _cli(*args):
    from harness import cli

    return cli("serve", *args)  # in process: every check here ends before anything starts


def _one_error(proc, needle):
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    errors = [l for l in proc.stderr.splitlines() if l.startswith("mlxcluster: error:")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr


def test_serve_bad_input(tmp_path):
    _one_error(_cli("--port", "70000"), "--port")
    _one_error(_cli("--model", str(tmp_path / "nope.gguf")), "model not found")
    _one_error(_cli("--max-queue", "-1"), "--max-queue")
    _one_error(_cli("--cluster", "c", "--max-queue", "2"), "with --cluster")
    _one_error(_cli("--itl-target-ms", "-5"), "--itl-target-ms")
    _one_error(_cli("--cluster", "c", "--itl-target-ms", "200"), "with --cluster")
    _one_error(_cli("--router", "no-port", "--router-token", "t"), "host:port")
    _one_error(_cli("--role", "decode"), "--prefill-peer")
    _one_error(_cli("--role", "decode", "--prefill-peer", "nohost"), "HOST:PORT")
    _one_error(_cli("--role", "prefill", "--world-size", "2"), "one rank")
    _one_error(_cli("--role", "both"), "--role")
    _one_error(_cli("--prefill-peer", "h:1"), "--role decode")


@slow
def test_serve_command_end_to_end():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "mlxcluster.cli", "serve", "--port", str(port), "--weights",
                             "float32", "--model-name", "m", "--log-level", "warning", "--max-queue", "3",
                             "--max-concurrency", "2"],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    health = []

    def up():
        assert proc.poll() is None, proc.communicate()[1]
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        except httpx.HTTPError:
            return False
        health.append(r.json())
        return r.status_code == 200

    try:
        until(up, 120, "serve to come up")
        # --max-queue and --max-concurrency configured rank 0's queue (its --max-queue / --max-batch).
        assert health[-1]["queue"] == {"capacity": 2, "max_queue": 3, "queued": 0, "running": 0, "batch_limit": 2}
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


@slow
def test_serve_roles_end_to_end(tmp_path):
    """`serve --role prefill` and `serve --role decode --prefill-peer` as two commands sharing a
    secret file: the official client gets the same greedy answer as a plain group's."""
    import socket

    ports = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        ports.append(s.getsockname()[1])
        s.close()
    secret = tmp_path / "secret"
    secret.write_text("pd-test-secret-0123456789abcdef\n")
    secret.chmod(0o600)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MLXCLUSTER_SECRET", None)
    common = ["--weights", "float32", "--log-level", "warning", "--secret-file", str(secret)]
    procs = [subprocess.Popen([sys.executable, "-m", "mlxcluster.cli", "serve", "--role", "prefill",
                               "--port", str(ports[0])] + common,
                              env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)]
    procs.append(subprocess.Popen([sys.executable, "-m", "mlxcluster.cli", "serve", "--role", "decode",
                                   "--prefill-peer", f"127.0.0.1:{ports[0]}", "--port", str(ports[1]),
                                   "--model-name", "m"] + common,
                                  env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, start_new_session=True))

    def up():
        for proc in procs:
            assert proc.poll() is None, proc.communicate()[1]
        try:
            socket.create_connection(("127.0.0.1", ports[0]), timeout=2).close()  # the prefill group's rank 0
            return httpx.get(f"http://127.0.0.1:{ports[1]}/health", timeout=2).status_code == 200
        except (httpx.HTTPError, OSError):
            return False

    try:
        until(up, 180, "both groups to come up")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports[1]}/v1", api_key="x", max_retries=0, timeout=120)
        got = client.completions.create(model="m", prompt="The capital of France is", max_tokens=8, temperature=0)
        assert got.choices[0].text.startswith(" Paris") and got.usage.completion_tokens == 8
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
            assert proc.returncode == 0, err
            assert "Traceback" not in err
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


@slow
def test_serve_prefill_restarts_a_failed_group_at_the_same_address(tmp_path, real_model_path):
    """The prefill group's rank dies: `serve --role prefill` restarts it on the same port, and a
    decode group pointed at that address is served by the new one."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    secret = tmp_path / "secret"
    secret.write_text("pd-restart-secret-0123456789abcdef\n")
    secret.chmod(0o600)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MLXCLUSTER_SECRET", None)
    proc = subprocess.Popen([sys.executable, "-m", "mlxcluster.cli", "serve", "--role", "prefill", "--port", str(port),
                             "--weights", "float32", "--secret-file", str(secret)],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    serving = lambda n: sum("prefill group serving" in line for line in lines) >= n  # noqa: E731
    try:
        until(lambda: serving(1), 120, "the prefill group to start")
        ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(ranks) == 1, ranks
        os.kill(int(ranks[0]), signal.SIGKILL)
        until(lambda: serving(2), 120, "the prefill group to restart")
        assert any("restarting it at 127.0.0.1:%d" % port in line for line in lines), lines
        with LocalCluster(1, model=real_model_path, weights="float32", secret=secret.read_text().strip(),
                          topology=Topology(prefill_peer=f"127.0.0.1:{port}")) as dec:
            c = GenerationClient(dec.address, dec.credentials)
            try:
                got = c.generate("The capital of France is", max_tokens=4)
            finally:
                c.close()
        assert got.token_ids[:2] == [7042, 30] and got.pd_prefill_s > 0  # " Paris." via the restarted group
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert not any("Traceback" in line for line in lines)


def test_dashboard_page_assets_and_state(fake_server):
    """The dashboard ships in the package (no CDN) and its state comes from rank 0's Info and /metrics."""
    fake, server = fake_server
    with httpx.Client(base_url=server.url, timeout=30) as c:
        page = c.get("/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "http://" not in page.text and "https://" not in page.text  # nothing fetched from elsewhere
        for asset in ("/dashboard/dashboard.js", "/dashboard/dashboard.css"):
            r = c.get(asset)
            assert r.status_code == 200 and len(r.text) > 500 and "https://" not in r.text
        assert c.get("/dashboard/../api.py").status_code == 404
        assert c.get("/dashboard/other.js").status_code == 404
        fake.release()
        before = c.get("/dashboard/state").json()
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
        state = c.get("/dashboard/state").json()
    assert state["model"] == "tiny" and state["world_size"] == 1 and state["queue"]["capacity"] == 1
    assert state["tokens_total"] == before["tokens_total"] + r.json()["usage"]["completion_tokens"]
    assert state["ttft_s"] is not None and state["group"]["status"] == "ok" and state["errors"] == []


def test_cache_salt_reaches_rank0_and_cache_isolation_key_separates_api_keys(tmp_path, tls):
    """vLLM's ``cache_salt`` goes to rank 0 as ``GenerateRequest.cache_salt`` from every dialect; a
    malformed one is a 400 naming it; under ``--cache-isolation key`` two API keys sending the same
    salt (or none) get different namespaces, and the same key the same one -- never the key itself."""
    from mlxcluster.front.auth import KeyRing

    class Recording(FakeRank0):
        def __init__(self):
            super().__init__()
            self.salts = []
            self.release()

        def Generate(self, request, context):
            self.salts.append(request.cache_salt)
            yield from super().Generate(request, context)

    fake = Recording()
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 1, "temperature": 0}
    with serving_rank0(fake, tmp_path, tls) as (address, path):
        with pytest.raises(ValueError, match="cache isolation"):
            Provider(address, path, "tiny", tls, cache_isolation="per-user")
        shared = Provider(address, path, "tiny", tls)
        with serve_app(create_app(shared)) as url, httpx.Client(base_url=url, timeout=30) as c:
            assert c.post("/v1/completions", json=dict(body, cache_salt="s1")).status_code == 200
            assert c.post("/v1/completions", json=body).status_code == 200
            r = c.post("/v1/messages", json={"model": "tiny", "max_tokens": 1, "cache_salt": "s2",
                                             "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
            for bad in ("", 7, "x" * 1025):
                r = c.post("/v1/completions", json=dict(body, cache_salt=bad))
                assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
        assert fake.salts == ["s1", "", "s2"]
        fake.salts.clear()
        isolated = Provider(address, path, "tiny", tls, cache_isolation="key")
        with serve_app(create_app(isolated, KeyRing(["key-a", "key-b"]))) as url, \
                httpx.Client(base_url=url, timeout=30) as c:
            for key, salt in (("key-a", None), ("key-b", None), ("key-a", None), ("key-a", "s1"), ("key-b", "s1")):
                r = c.post("/v1/completions", json=dict(body, **({"cache_salt": salt} if salt else {})),
                           headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 200, r.text
        a, b, a_again, a_s1, b_s1 = fake.salts
        assert a == a_again and len({a, b, a_s1, b_s1}) == 4 and all(len(x) == 64 for x in fake.salts)
        assert not any("key-" in x for x in fake.salts)


def test_serve_refuses_cache_isolation_without_keys_in_one_line():
    from typer.testing import CliRunner

    from mlxcluster.cli import app

    for args, words in ((["--cache-isolation", "key"], "--api-key"), (["--cache-isolation", "user"], "none or key")):
        result = CliRunner().invoke(app, ["serve", *args])
        lines = (result.output or "").strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and words in lines[0], result.output

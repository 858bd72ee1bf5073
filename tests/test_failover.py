"""Lossless failover (issue 29, the front end's part): a request whose group fails under it waits
for the next group and is replayed there with the tokens it already delivered; the client's stream
goes on with no duplicated and no missing tokens.

Fast tier: the replay bookkeeping as plain functions, and a :class:`Provider` + FastAPI app with
the real :class:`Healer` in front of FAKE rank 0s: the first fails mid-stream (the gRPC stream
aborted after k tokens, ended without ``done``, or ended with ``ERROR``), the healer "re-forms" by
pointing the provider at the next one, which honours ``resume_token_ids``.

Slow tier: THE CHAOS TEST -- a real ``serve --world-size 3`` on the real model, 4 clients streaming
greedy chat completions in a closed loop for ``MLXCLUSTER_CHAOS_S`` seconds (default 120) while every
30 s a rank gets SIGKILL, or SIGSTOP then SIGCONT 20 s later, alternating: every request completes
with exactly its fault-free answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import httpx
import openai
import pytest

from harness import until
from mlxcluster.front import Provider, create_app
from mlxcluster.front.healer import Group, Healer
from mlxcluster.front.provider import ProviderError, replay_cause, replay_error, resume_request
from mlxcluster.protocol import mlxcluster_pb2 as pb
from mlxcluster.protocol import mlxcluster_pb2_grpc as pb_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The fake model's one answer: token ids and the text each releases (then EOS).
WORDS = ["The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".", " It", " ran"]
IDS = list(range(40, 40 + len(WORDS)))
ANSWER = "".join(WORDS)


# -- the bookkeeping, as plain functions ----------------------------------------------------------
class _Err(grpc.RpcError):
    def __init__(self, code, details="x"):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_replay_cause_names_group_failures_and_never_refusals():
    assert replay_cause(_Err(grpc.StatusCode.UNAVAILABLE)) == "unavailable"
    assert replay_cause(_Err(grpc.StatusCode.CANCELLED)) == "cancelled"  # rank 0's server went away
    assert replay_cause(_Err(grpc.StatusCode.INTERNAL)) == "internal"
    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN):
        assert replay_cause(_Err(code)) is None, code  # a bad request (400), queue full (429), ...
    assert replay_cause(None, None) == "stream_ended"  # no done event
    assert replay_cause(None, pb.ERROR) == "group_error"
    for reason in (pb.EOS, pb.MAX_TOKENS, pb.CONTEXT_FULL, pb.CANCELLED):
        assert replay_cause(None, reason) is None


def test_resume_request_resends_the_original_with_what_was_delivered():
    original = pb.GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=24,
                                  sampling=pb.Sampling(temperature=0.7, seed=5, top_k=3))
    again = resume_request(original, [40, 41])
    assert list(again.resume_token_ids) == [40, 41]
    assert again.max_tokens == 24  # the ORIGINAL max_tokens: it counts the resumed tokens
    assert list(again.prompt_ids) == [1, 2, 3] and again.sampling == original.sampling
    assert not original.resume_token_ids  # the original is kept as it was
    assert list(resume_request(again, [40, 41, 42]).resume_token_ids) == [40, 41, 42]  # replaced, not appended
    assert resume_request(original, []) is original  # nothing delivered yet: a plain re-send
    err = replay_error(3, "tensor-parallel group failed: rank 2 lost")
    assert err.status == 503 and err.retry_after and "failed 3 times during this request: " in err.message


# -- fake rank 0s behind a real provider, app and healer -------------------------------------------
class FakeRank0(pb_grpc.GenerationServicer):
    """Rank 0's ``Generation`` as the provider sees it, answering every prompt with :data:`IDS`
    then EOS, honouring ``resume_token_ids`` (it continues after them; they must be a prefix of
    the answer).  ``fail_after``: this group fails in its ``fail_call``-th call, after that call
    sent that many tokens; ``how``: ``abort`` (UNAVAILABLE, as rank 0 aborts when its group fails),
    ``end`` (the stream ends without ``done``) or ``error`` (``done`` with ``ERROR``)."""

    def __init__(self, eos=255, fail_after=None, how="abort", fail_call=1):
        self.eos, self.fail_after, self.how, self.fail_call = eos, fail_after, how, fail_call
        self.dead = None  # why the group failed (the healer's Group.failure)
        self.resumes = []  # resume_token_ids of each call

    def Info(self, request, context):
        return pb.InfoReply(model="tiny", world_size=3, backend="ring", context_length=256, vocab_size=256,
                            weight_format="float32", capacity=8, max_queue=8, batch_limit=8)

    def Generate(self, request, context):
        resume = list(request.resume_token_ids)
        self.resumes.append(resume)
        if any(not 0 <= t < 256 for t in request.prompt_ids):  # rank 0's own prompt check
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt token id outside the vocabulary")
        if self.dead:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"tensor-parallel group failed: {self.dead}")
        if resume != IDS[:len(resume)]:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"resume_token_ids {resume} are not this answer's")
        yield pb.GenerateEvent(started=pb.GenerateStarted(prompt_ids=request.prompt_ids))
        n = min(request.max_tokens, len(IDS) + 1)
        victim = self.fail_after is not None and len(self.resumes) == self.fail_call
        for sent, i in enumerate(range(len(resume), n)):
            if victim and sent == self.fail_after:
                self.dead = "rank 2 exited (killed by signal 9)"
                if self.how == "abort":
                    context.abort(grpc.StatusCode.UNAVAILABLE, f"tensor-parallel group failed: {self.dead}")
                if self.how == "error":
                    yield pb.GenerateEvent(done=pb.GenerateDone(reason=pb.ERROR))
                return
            if i == len(IDS):
                yield pb.GenerateEvent(token=pb.GeneratedToken(token_id=self.eos, text=""))
                yield pb.GenerateEvent(done=pb.GenerateDone(reason=pb.EOS, generated_tokens=i + 1))
                return
            yield pb.GenerateEvent(token=pb.GeneratedToken(token_id=IDS[i], text=WORDS[i]))
        yield pb.GenerateEvent(done=pb.GenerateDone(reason=pb.MAX_TOKENS, generated_tokens=n))


class Stack:
    """Fake rank 0s (one per group the healer will form, in order), a Provider on the first,
    the real Healer (its ``start`` returns the next fake, or blocks on :attr:`gate`), uvicorn
    serving ``create_app`` in a thread."""

    def __init__(self, tmp_path, tls, fakes, *, max_replays=2, unavailable_wait_s=60.0, gate_open=True):
        from tinymodel import write_gguf
        import uvicorn

        path = tmp_path / "tiny.gguf"
        if not path.exists():
            write_gguf(str(path), metadata_overrides={
                "tokenizer.chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"})
        self.servers, self.groups = [], []
        for fake in fakes:
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
            pb_grpc.add_GenerationServicer_to_server(fake, server)
            port = server.add_secure_port("127.0.0.1:0", tls.server())
            server.start()
            self.servers.append(server)
            self.groups.append(Group(f"127.0.0.1:{port}", tls, lambda f=fake: f.dead, lambda: None))
        self.fakes = fakes
        self.gate = threading.Event()
        if gate_open:
            self.gate.set()
        self.formed = 0
        self.provider = Provider(self.groups[0].address, str(path), "tiny", tls, max_replays=max_replays,
                                 unavailable_wait_s=unavailable_wait_s)
        assert 255 in self.provider.eos_token_ids  # the fakes' EOS

        def start():
            assert self.gate.wait(60), "the test never let the group form"
            self.formed += 1
            return self.groups[self.formed]

        self.healer = Healer(self.provider, self.groups[0], start, probe_s=0.02)
        ready, healer = threading.Event(), self.healer

        class _Server(uvicorn.Server):
            async def startup(self, sockets=None):
                await super().startup(sockets=sockets)
                self.healing = asyncio.create_task(healer.run())
                ready.set()

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.server = _Server(uvicorn.Config(create_app(self.provider), log_level="warning",
                                             timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        assert ready.wait(30), "uvicorn did not start"
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def metric(self, name):
        return self.provider.registry.get_sample_value(name) or 0.0

    def close(self):
        self.gate.set()
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
        for server in self.servers:
            server.stop(None)


@pytest.fixture
def stack(tmp_path, tls):
    made = []

    def make(fakes, **kw):
        made.append(Stack(tmp_path, tls, fakes, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "temperature": 0, "max_tokens": 100}


def test_openai_stream_goes_on_across_a_failed_group_with_no_duplicated_or_missing_token(stack, tmp_path):
    fakes = [FakeRank0(), FakeRank0(fail_after=5), FakeRank0()]
    ref_stack = stack([fakes[0]])
    client = openai.OpenAI(base_url=ref_stack.url + "/v1", api_key="x", max_retries=0)
    reference = [c.model_dump() for c in client.chat.completions.create(stream=True, **CHAT,
                                                                       stream_options={"include_usage": True})]
    s = stack(fakes[1:])
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
    chunks = [c.model_dump() for c in client.chat.completions.create(stream=True, **CHAT,
                                                                    stream_options={"include_usage": True})]
    assert len({c["id"] for c in chunks}) == 1  # one stream, one id
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == ANSWER
    strip = lambda cs: [dict(c, id=None, created=None, system_fingerprint=None) for c in cs]  # noqa: E731
    assert strip(chunks) == strip(reference)  # the same chunk sequence, usage included
    assert chunks[-1]["usage"]["completion_tokens"] == len(IDS) + 1
    assert fakes[1].resumes == [[]] and fakes[2].resumes == [IDS[:5]]  # resumed after what was delivered
    assert s.provider.registry.get_sample_value("mlxcluster_provider_replays_total", {"cause": "unavailable"}) == 1
    assert s.metric("mlxcluster_provider_completion_tokens_total") == len(IDS) + 1  # each token counted once
    assert s.metric("mlxcluster_provider_reformation_seconds_count") == 1
    state = httpx.get(s.url + "/dashboard/state", timeout=10).json()
    assert state["failover"]["replays"] == 1 and state["failover"]["last_reformation_s"] is not None
    assert state["group"]["restarts"] == 1


@pytest.mark.parametrize("how,after", [("end", 3), ("error", 7), ("abort", 0)])
def test_non_streaming_anthropic_and_ollama_answers_are_unbroken(stack, how, after):
    """A stream that ends without ``done``, one that ends with ``ERROR`` and one that breaks before
    the first token (queued/prefill: replayed with nothing to resume)."""
    # each request's group fails under it: the first group in its 1st call, the next two in their
    # 2nd (their 1st is the previous request's replay)
    fakes = [FakeRank0(fail_after=after, how=how), FakeRank0(fail_after=after, how=how, fail_call=2),
             FakeRank0(fail_after=after, how=how, fail_call=2), FakeRank0()]
    s = stack(fakes)
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
    answer = client.chat.completions.create(**CHAT)
    assert answer.choices[0].message.content == ANSWER and answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens == len(IDS) + 1
    r = httpx.post(s.url + "/v1/messages", timeout=30, json={"model": "tiny", "max_tokens": 100, "temperature": 0,
                                                             "messages": [{"role": "user", "content": "go"}]})
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == ANSWER and r.json()["stop_reason"] == "end_turn"
    with httpx.stream("POST", s.url + "/api/chat", timeout=30, json={
            "model": "tiny", "messages": [{"role": "user", "content": "go"}], "options": {"temperature": 0}}) as r:
        assert r.status_code == 200
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert "".join(x["message"]["content"] for x in lines) == ANSWER and lines[-1]["done"]
    expect = IDS[:after]
    assert [f.resumes for f in fakes] == [[[]], [expect, []], [expect, []], [expect]]
    cause = {"end": "stream_ended", "error": "group_error", "abort": "unavailable"}[how]
    assert s.provider.registry.get_sample_value("mlxcluster_provider_replays_total", {"cause": cause}) == 3


def test_stop_string_state_continues_across_the_replay(stack):
    # " brown" arrives before the break and is held back (it may start " brown fox"); " fox" after it
    s = stack([FakeRank0(fail_after=3), FakeRank0()])
    r = httpx.post(s.url + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": "go", "max_tokens": 100,
                                                               "stop": [" brown fox"], "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "The quick" and choice["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == 4


def test_replays_are_bounded_then_one_error_naming_the_cause(stack):
    fakes = [FakeRank0(fail_after=1) for _ in range(4)]  # every group fails under the request
    s = stack(fakes, max_replays=2)
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
    content, error = "", None
    try:
        for c in client.chat.completions.create(stream=True, **CHAT):
            content += c.choices[0].delta.content or "" if c.choices else ""
    except openai.APIError as exc:
        error = exc
    assert error is not None
    assert "the group failed 3 times during this request: tensor-parallel group failed: rank 2" in str(error)
    assert ANSWER.startswith(content) and content  # what was delivered stays delivered, nothing twice
    assert s.metric("mlxcluster_provider_failed_after_replays_total") == 1
    assert s.provider.registry.get_sample_value("mlxcluster_provider_replays_total", {"cause": "unavailable"}) == 2
    assert fakes[3].resumes == []  # never sent a fourth time
    # a refusal is never replayed: rank 0's INVALID_ARGUMENT is a 400 at once
    r = httpx.post(s.url + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": [1, 999]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert fakes[3].resumes == [[]]


def test_a_request_arriving_while_no_group_serves_waits_then_is_served(stack):
    fakes = [FakeRank0(), FakeRank0()]
    fakes[0].dead = "rank 1 exited"  # the healer sees it at once and starts the next group ...
    s = stack(fakes, gate_open=False)  # ... which takes until the test says
    until(lambda: s.provider.unavailable is not None, what="the healer to mark the group failed")
    result = {}

    def ask():
        result["r"] = httpx.post(s.url + "/v1/completions", timeout=30,
                                 json={"model": "tiny", "prompt": "go", "max_tokens": 100, "temperature": 0})

    t = threading.Thread(target=ask)
    t.start()
    until(lambda: s.metric("mlxcluster_provider_waited_for_group_total") == 1, what="the request to wait")
    assert "r" not in result and httpx.get(s.url + "/health", timeout=5).status_code == 503
    s.gate.set()
    t.join(30)
    assert result["r"].status_code == 200 and result["r"].json()["choices"][0]["text"] == ANSWER


def test_the_wait_for_a_group_ends_in_503_with_retry_after(stack):
    fakes = [FakeRank0(), FakeRank0()]
    s = stack(fakes, unavailable_wait_s=0.3, gate_open=False)
    fakes[0].dead = "rank 1 exited"
    until(lambda: s.provider.unavailable is not None, what="the healer to mark the group failed")
    r = httpx.post(s.url + "/v1/chat/completions", timeout=30, json=CHAT)
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
    assert "none served within 0.3 s" in r.json()["error"]["message"] and "rank 1 exited" in r.json()["error"]["message"]
    assert s.metric("mlxcluster_provider_group_wait_seconds_count") == 1


def test_a_client_that_goes_away_while_waiting_is_released(stack):
    fakes = [FakeRank0(), FakeRank0()]
    s = stack(fakes, gate_open=False)
    fakes[0].dead = "rank 1 exited"
    until(lambda: s.provider.unavailable is not None, what="the healer to mark the group failed")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(s.url + "/v1/chat/completions", timeout=0.5, json=CHAT)
    until(lambda: not s.provider._waiters._futures, what="the waiter to be released")
    assert s.provider.load()["queued"] == 0

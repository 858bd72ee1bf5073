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
import contextlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import httpx
import openai
import pytest

from harness import serve_app, until
from mlxcluster.front import Provider, create_app
from mlxcluster.front.healer import Group, Healer
from mlxcluster.front.provider import replay_cause, replay_error, resume_request
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
    ``end`` (the stream ends without ``done``), ``error`` (``done`` with ``ERROR``) or ``hang``
    (a frozen rank 0 whose socket stays open: the stream ends only when the provider cancels it)."""

    def __init__(self, eos=255, fail_after=None, how="abort", fail_call=1, ignores_resume=False):
        self.eos, self.fail_after, self.how, self.fail_call = eos, fail_after, how, fail_call
        self.ignores_resume = ignores_resume  # a rank 0 that answers a resume as a new request
        self.dead = None  # why the group failed (the healer's Group.failure)
        self.resumes = []  # resume_token_ids of each call

    def Info(self, request, context):
        return pb.InfoReply(model="tiny", world_size=3, backend="ring", context_length=256, vocab_size=256,
                            weight_format="float32", capacity=8, max_queue=8, batch_limit=8)

    def Generate(self, request, context):
        resume = list(request.resume_token_ids)
        self.resumes.append(resume)
        if self.ignores_resume:
            resume = []
        if any(not 0 <= t < 256 for t in request.prompt_ids):  # rank 0's own prompt check
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt token id outside the vocabulary")
        if self.dead:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"tensor-parallel group failed: {self.dead}")
        if resume != IDS[:len(resume)]:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"resume_token_ids {resume} are not this answer's")
        if len(resume) >= request.max_tokens:  # as the real Scheduler.validate_resume refuses
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"resume_token_ids holds {len(resume)} tokens: "
                          f"nothing is left to generate within max_tokens {request.max_tokens}")
        yield pb.GenerateEvent(started=pb.GenerateStarted(prompt_ids=request.prompt_ids, resumed_tokens=len(resume)))
        n = min(request.max_tokens, len(IDS) + 1)
        victim = self.fail_after is not None and len(self.resumes) == self.fail_call
        for sent, i in enumerate(range(len(resume), n + 1)):  # n + 1: it may fail just before done
            if victim and sent == self.fail_after:
                self.dead = "rank 2 exited (killed by signal 9)"
                if self.how == "abort":
                    context.abort(grpc.StatusCode.UNAVAILABLE, f"tensor-parallel group failed: {self.dead}")
                if self.how == "error":
                    yield pb.GenerateEvent(done=pb.GenerateDone(reason=pb.ERROR))
                if self.how == "hang":  # frozen: the stream stays open until the client cancels it
                    ended = threading.Event()
                    context.add_callback(ended.set)
                    ended.wait(30)
                return
            if i == n:
                break
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

    def __init__(self, tmp_path, tls, fakes, *, max_replays=2, unavailable_wait_s=60.0, gate_open=True,
                 max_failed_starts=5, starts_fail=False):
        from tinymodel import write_gguf

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
            if starts_fail:
                raise RuntimeError("rank 1 could not load the model")
            self.formed += 1
            return self.groups[self.formed]

        self.healer = Healer(self.provider, self.groups[0], start, probe_s=0.02, max_failed_starts=max_failed_starts)
        self._served = contextlib.ExitStack()
        self.url = self._served.enter_context(serve_app(create_app(self.provider),
                                                        on_startup=lambda: asyncio.create_task(self.healer.run())))

    def metric(self, name):
        return self.provider.registry.get_sample_value(name) or 0.0

    def close(self):
        self.gate.set()
        self._served.close()
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


def test_a_replay_that_rank0_does_not_continue_fails_closed(stack):
    """A rank 0 that answers a resume as a new request (one that ignores resume_token_ids) would
    start the answer again after the tokens already delivered: the front checks the started event's
    resumed_tokens and ends the request with one error instead of repeating the answer."""
    s = stack([FakeRank0(fail_after=5), FakeRank0(ignores_resume=True)])
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
    text = ""
    with pytest.raises(openai.APIError) as err:
        for c in client.chat.completions.create(stream=True, **CHAT):
            text += (c.choices[0].delta.content or "") if c.choices else ""
    assert "was not continued: 5 generated tokens were sent" in str(err.value)
    assert text == "".join(WORDS[:5])  # what the first group delivered, nothing repeated


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


def test_a_call_left_hanging_on_a_replaced_group_is_replayed(stack):
    """A frozen rank 0 that survived its group's teardown keeps the stream open: retarget closes the
    old channel under it (grpc.aio cancels the call locally), and the request goes on, not dies."""
    fakes = [FakeRank0(fail_after=4, how="hang"), FakeRank0()]
    s = stack(fakes)
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **CHAT)
                   if c.choices)
    assert text == ANSWER and fakes[1].resumes == [IDS[:4]]
    assert s.provider.registry.get_sample_value("mlxcluster_provider_replays_total", {"cause": "group_replaced"}) == 1


@pytest.mark.parametrize("how", ["abort", "end", "hang"])
def test_an_answer_whose_every_token_arrived_ends_there_when_the_group_fails(stack, how):
    """The group fails after the last of max_tokens tokens went out but before ``done``: nothing is
    left to generate, so the answer ends with ``length`` and the text rank 0's detokenizer held
    (the front's own :func:`answer_tail`), not with a replay rank 0 must refuse (seen in the chaos
    test: 'resume_token_ids holds 24 tokens: nothing is left to generate')."""
    from mlxcluster.model.tokenizer import answer_tail

    fakes = [FakeRank0(fail_after=5, how=how), FakeRank0()]
    s = stack(fakes)
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
    chunks = list(client.chat.completions.create(stream=True, **dict(CHAT, max_tokens=5),
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(WORDS[:5]) + answer_tail(s.provider.tokenizer, IDS[:5])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 5
    assert fakes[1].resumes == []  # no replay was sent
    assert s.metric("mlxcluster_provider_failed_after_replays_total") == 0


def test_stop_scan_holds_a_possible_stop_string_and_cuts_before_one():
    from mlxcluster.front.tools import StopScan

    scan = StopScan(["</end>", "STOP"])
    assert scan.feed("Hello <") == ("Hello ", None)  # "<" may start "</end>": held
    assert scan.feed("/e") == ("", None)
    assert scan.feed("x") == ("</ex", None)  # it did not
    assert scan.feed(" and ST") == (" and ", None)
    assert scan.feed("OP now") == ("", "STOP")  # cut before the stop string, which is not sent
    tail = StopScan(["</end>"])
    assert tail.feed("a </e") == ("a ", None) and tail.feed("", final=True) == ("</e", None)  # the end sends all


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


def test_requests_waiting_fail_at_once_when_the_healer_gives_up(stack):
    fakes = [FakeRank0(fail_after=2), FakeRank0()]
    s = stack(fakes, max_failed_starts=1, starts_fail=True)
    r = httpx.post(s.url + "/v1/chat/completions", timeout=30, json=CHAT)  # its group fails under it
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
    assert "could not be restarted" in r.text and "rank 2 exited" in r.text, r.text
    assert s.provider.group_status["status"] == "failed"
    r = httpx.post(s.url + "/v1/chat/completions", timeout=30, json=CHAT)
    assert r.status_code == 503 and "gave up" in r.json()["error"]["message"]


def test_a_client_that_goes_away_while_waiting_is_released(stack):
    fakes = [FakeRank0(), FakeRank0()]
    s = stack(fakes, gate_open=False)
    fakes[0].dead = "rank 1 exited"
    until(lambda: s.provider.unavailable is not None, what="the healer to mark the group failed")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(s.url + "/v1/chat/completions", timeout=0.5, json=CHAT)
    until(lambda: not s.provider._waiters._futures, what="the waiter to be released")
    assert s.provider.load()["queued"] == 0


@pytest.mark.parametrize("args,words", [(["--max-replays", "-1"], "--max-replays must be at least 0"),
                                        (["--unavailable-wait-s", "nan"], "--unavailable-wait-s must be")])
def test_serve_failover_options_are_checked(args, words):
    r = subprocess.run([sys.executable, "-m", "mlxcluster", "serve", *args], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# -- the chaos test (slow tier) --------------------------------------------------------------------
CHAOS_PROMPTS = ["Name three colours.", "What is the capital of France?", "Count from one to ten.",
                 "Say something about the sea."]
CHAOS_MAX_TOKENS = 24


def _descendants(pid):
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(c) for c in f.read().split()]
                out += kids
                todo += kids
        except OSError:
            continue
    return out


def rank_pids(serve_pid):
    """``{rank: pid}`` of the serve process's rank processes (ring: ``MLX_RANK``; mpirun's:
    ``OMPI_COMM_WORLD_RANK``)."""
    ranks = {}
    for pid in _descendants(serve_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        rank = env.get(b"MLX_RANK", env.get(b"OMPI_COMM_WORLD_RANK"))
        if b"mlxcluster.runtime.rank" in cmdline and rank is not None:
            ranks[int(rank)] = pid
    return ranks


class ChaosServe:
    """A real ``serve --world-size 3`` (the default backend) on the real model."""

    def __init__(self, model_path, world_size=3):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("MLXCLUSTER_SECRET", None)
        self.world_size = world_size
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxcluster", "serve", "--world-size", str(world_size), "--model", model_path,
             "--weights", "float32", "--port", str(self.port), "--model-name", "m", "--log-level", "warning"],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.stderr: list = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()

    def serving(self):
        assert self.proc.poll() is None, "".join(self.stderr[-20:])
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def ranks(self):
        r = rank_pids(self.proc.pid)
        return r if len(r) == self.world_size else None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def _ask(client, prompt, record=None):
    """One streamed greedy chat completion: (text, finish_reason, [arrival time of each content chunk])."""
    text, finish, times = "", None, []
    for c in client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}], stream=True,
                                            temperature=0, max_tokens=CHAOS_MAX_TOKENS):
        if c.choices:
            if c.choices[0].delta.content:
                text += c.choices[0].delta.content
                times.append(time.monotonic())
            finish = c.choices[0].finish_reason or finish
    return text, finish, times


def run_chaos(model_path, duration_s, period_s=30.0, stop_s=20.0, seed=29, log=print):
    """The chaos run: returns a dict of results (see :func:`test_chaos_serve_loses_no_request`)."""
    serve = ChaosServe(model_path)
    rng = random.Random(seed)
    try:
        until(serve.serving, 300, "serve to come up")
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="x", max_retries=0, timeout=600)
        reference = {p: _ask(client, p)[:2] for p in CHAOS_PROMPTS}  # the answers without faults
        done = threading.Event()
        results, faults = [], []  # (prompt, t0, t1, text, finish, times, error); (time, rank, kind)
        lock = threading.Lock()

        def worker(prompt):
            c = openai.OpenAI(base_url=serve.url + "/v1", api_key="x", max_retries=0, timeout=600)
            while not done.is_set():
                t0 = time.monotonic()
                try:
                    text, finish, times = _ask(c, prompt)
                    error = None
                except Exception as exc:  # recorded: the test asserts there is none
                    text, finish, times, error = "", None, [], f"{type(exc).__name__}: {exc}"
                with lock:
                    results.append((prompt, t0, time.monotonic(), text, finish, times, error))

        workers = [threading.Thread(target=worker, args=(p,), daemon=True) for p in CHAOS_PROMPTS]
        t_start = time.monotonic()
        for w in workers:
            w.start()
        kinds, pending_cont = ["SIGKILL", "SIGSTOP"], []
        n = 0
        while True:
            t_fault = t_start + (n + 1) * period_s
            if t_fault >= t_start + duration_s:
                break
            # the workload's schedule: the next fault is due in period_s (not a synchronisation)
            done.wait(max(0.0, t_fault - time.monotonic()))
            for when, pid in [x for x in pending_cont if x[0] <= time.monotonic()]:
                pending_cont.remove((when, pid))
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:  # the healer killed it with its group
                    pass
            ranks = until(lambda: serve.serving() and serve.ranks(), 300, "a serving group to fault")
            rank = rng.randrange(serve.world_size)
            kind = kinds[n % 2]
            t = time.monotonic()
            os.kill(ranks[rank], signal.SIGKILL if kind == "SIGKILL" else signal.SIGSTOP)
            faults.append((t, rank, kind))
            log(f"chaos: {kind} rank {rank} (pid {ranks[rank]}) at {t - t_start:.1f} s")
            if kind == "SIGSTOP":
                pending_cont.append((t + stop_s, ranks[rank]))
            n += 1
        done.wait(max(0.0, t_start + duration_s - time.monotonic()))
        for when, pid in pending_cont:
            done.wait(max(0.0, when - time.monotonic()))
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        done.set()
        for w in workers:
            w.join(600)
        assert not any(w.is_alive() for w in workers), "a client never finished its last request"
        until(serve.serving, 300, "serve to serve after the last fault")
        after = {p: _ask(client, p)[:2] for p in CHAOS_PROMPTS}
        metrics = httpx.get(serve.url + "/metrics", timeout=10).text
        state = httpx.get(serve.url + "/dashboard/state", timeout=10).json()
        # fault -> first replayed token: for each fault, each request in flight at it
        gaps = []
        for t_f, _rank, _kind in faults:
            for _p, t0, t1, _text, _fin, times, _err in results:
                if t0 < t_f < t1:
                    later = [x for x in times if x > t_f]
                    if later:
                        gaps.append(later[0] - t_f)
        return {"reference": reference, "results": results, "faults": faults, "after": after, "gaps": gaps,
                "metrics": metrics, "state": state, "t_start": t_start, "log": serve.stderr[-40:]}
    finally:
        serve.stop()


def _pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


@pytest.mark.slow
def test_chaos_serve_loses_no_request(real_model_path):
    """serve --world-size 3, 4 clients streaming greedy chat completions in a closed loop for
    MLXCLUSTER_CHAOS_S seconds (default 120); every 30 s a random rank gets SIGKILL, or SIGSTOP
    then SIGCONT 20 s later, alternating.  Every request completes with its fault-free answer."""
    duration = float(os.environ.get("MLXCLUSTER_CHAOS_S", "120"))
    out = run_chaos(real_model_path, duration)
    results, reference = out["results"], out["reference"]
    errors = [r for r in results if r[6] is not None]
    wrong = [(r[0], r[3], reference[r[0]][0]) for r in results if r[6] is None and r[3:5] != reference[r[0]]]
    gaps = out["gaps"]
    print(f"chaos: {len(results)} requests, {len(out['faults'])} faults, {len(errors)} failed, {len(wrong)} wrong; "
          f"fault -> first replayed token p50 {_pct(gaps, 0.5):.2f} s p95 {_pct(gaps, 0.95):.2f} s over {len(gaps)} "
          f"requests in flight; failover {out['state'].get('failover')}")
    t_start = out["t_start"]
    when = lambda t: f"{t - t_start:.1f} s"  # noqa: E731
    if errors or wrong:  # the whole story, untruncated
        print("faults:", [(when(t), rank, kind) for t, rank, kind in out["faults"]])
        for r in results:
            print("request:", r[0], when(r[1]), when(r[2]), repr(r[3]), r[4], len(r[5]), r[6])
        print("serve's log:\n" + "".join(out["log"]))
    assert not errors, ([(r[0], when(r[1]), when(r[2]), r[6]) for r in errors[:3]],
                        [(when(t), rank, kind) for t, rank, kind in out["faults"]], "".join(out["log"]))
    assert not wrong, ([(r[0], when(r[1]), when(r[2]), r[3], [when(t) for t in r[5]]) for r in results
                        if r[6] is None and r[3:5] != reference[r[0]]][:3], reference,
                       [(when(t), rank, kind) for t, rank, kind in out["faults"]], "".join(out["log"]))
    assert results and len(out["faults"]) >= max(1, math.ceil(duration / 30) - 1)
    assert out["after"] == reference  # serves normally after the last fault

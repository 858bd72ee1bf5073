"""The one typed request (:mod:`mlxcluster.protocol.args`, issue 44): its one range check, its one
conversion to the wire and back, and the same refusal of a value out of range in every HTTP dialect
and over rank 0's gRPC service.  In-process: a fake rank 0 behind the real provider and app, and the
real ``GenerationServicer`` before a fake scheduler."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import grpc
import pytest

from mlxcluster.engine.sampling import sampling_of
from mlxcluster.leader.generation import engine_sampling
from mlxcluster.protocol import mlxcluster_pb2 as pb
from mlxcluster.protocol.args import (ArgumentError, GenerationArgs, LogitsArgs, SamplingArgs, check_args,
                                      from_request, to_request)

ARGS = GenerationArgs(
    sampling=SamplingArgs(temperature=0.5, top_p=0.75, top_k=7, min_p=0.25, seed=2**64 - 1),
    logits=LogitsArgs(logit_bias=((3, -1.5), (9, 100.0)), presence_penalty=-2.0, frequency_penalty=0.5,
                      repetition_penalty=1.25, repetition_context_size=0),
    max_tokens=9, logprobs=True, top_logprobs=20, grammar='{"x": 1}', speculative=("ngram", 4), cache_salt="s")


# -- pure: the check and the conversions ------------------------------------------------------
def test_check_args_accepts_defaults_and_bounds():
    assert check_args(GenerationArgs()) == GenerationArgs()
    assert check_args(ARGS, vocab_size=10) is ARGS
    edge = GenerationArgs(sampling=SamplingArgs(temperature=2.0, top_p=1.0, min_p=1.0),
                          logits=LogitsArgs(presence_penalty=2.0, frequency_penalty=-2.0))
    check_args(edge)


@pytest.mark.parametrize("args,param,message", [
    (GenerationArgs(sampling=SamplingArgs(temperature=-1.0)), "temperature", "'temperature' must be at least 0, got -1"),
    (GenerationArgs(sampling=SamplingArgs(temperature=2.5)), "temperature", "'temperature' must be at most 2, got 2.5"),
    (GenerationArgs(sampling=SamplingArgs(temperature=math.nan)), "temperature",
     "'temperature' must be a finite number, got nan"),
    (GenerationArgs(sampling=SamplingArgs(top_p=0.0)), "top_p", "'top_p' must be greater than 0, got 0"),
    (GenerationArgs(sampling=SamplingArgs(top_k=-2)), "top_k", "'top_k' must be at least 0 (0: off), got -2"),
    (GenerationArgs(logits=LogitsArgs(repetition_penalty=0.0)), "repetition_penalty",
     "'repetition_penalty' must be greater than 0, got 0"),
    (GenerationArgs(logits=LogitsArgs(logit_bias=((10, 1.0),))), "logit_bias",
     "'logit_bias' token 10 is outside the vocabulary (0..9)"),
    (GenerationArgs(logits=LogitsArgs(logit_bias=((3, 101.0),))), "logit_bias",
     "'logit_bias' value for token 3 must be a number in [-100, 100], got 101"),
    (GenerationArgs(top_logprobs=21), "top_logprobs", "'top_logprobs' must be at most 20, got 21"),
])
def test_check_args_refuses_one_line_naming_the_field(args, param, message):
    with pytest.raises(ArgumentError) as err:
        check_args(args, vocab_size=10)
    assert (err.value.param, str(err.value)) == (param, message)


def test_the_wire_round_trip_keeps_every_field():
    """to_request and from_request are each other's inverse (``stop`` and ``max_tokens_field`` stay
    with the front), and rank 0's engine Sampling of the args is the one ranks N read from the message."""
    msg = to_request(ARGS, [1, 2, 3])
    assert list(msg.prompt_ids) == [1, 2, 3] and msg.speculative.draft_tokens == 4
    assert from_request(msg) == ARGS
    assert engine_sampling(ARGS) == sampling_of(msg.sampling)
    assert from_request(pb.GenerateRequest()) == GenerationArgs()  # unset: the defaults (top_p 1, window 20)


# -- the same refusal everywhere ----------------------------------------------------------------
#: (field, value, the one message); every endpoint below refuses each with exactly this message
BAD = [("temperature", -1, "'temperature' must be at least 0, got -1"),
       ("top_p", 2, "'top_p' must be at most 1, got 2"),
       ("top_p", -0.5, "'top_p' must be greater than 0, got -0.5"),
       ("min_p", 1.5, "'min_p' must be at most 1, got 1.5"),
       ("presence_penalty", 3, "'presence_penalty' must be at most 2, got 3")]
#: the fields each dialect carries (Anthropic and Responses have no min_p or penalties)
CARRIES = {"anthropic": {"temperature", "top_p"}, "responses": {"temperature", "top_p"}}
USER = [{"role": "user", "content": "hi"}]


def _http_body(dialect: str, field: str, value) -> tuple:
    """``(path, body)`` of a request of ``dialect`` setting ``field`` to ``value`` where it sets it."""
    if dialect == "chat":
        return "/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 1, field: value}
    if dialect == "completions":
        return "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1, field: value}
    if dialect == "responses":
        return "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 1, field: value}
    if dialect == "anthropic":
        return "/v1/messages", {"model": "tiny", "messages": USER, "max_tokens": 1, field: value}
    options = {field: value, "num_predict": 1}
    if dialect == "ollama_chat":
        return "/api/chat", {"model": "tiny", "messages": USER, "stream": False, "options": options}
    return "/api/generate", {"model": "tiny", "prompt": "hi", "stream": False, "options": options}


def _message(dialect: str, answer: dict) -> str:
    """The message of ``dialect``'s error body (checking the body's shape)."""
    if dialect.startswith("ollama"):
        assert set(answer) == {"error"}
        return answer["error"]
    if dialect == "anthropic":
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
        return answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error"
    return answer["error"]["message"]


@pytest.fixture(scope="module")
def http(tmp_path_factory, tls):
    """The real provider and app (in-process, every dialect mounted) before a fake rank 0 that records
    each request it is sent."""
    from harness import front_before
    from mlxcluster.protocol import mlxcluster_pb2_grpc as pb_grpc

    seen = []

    class Rank0(pb_grpc.GenerationServicer):
        def Info(self, request, context):
            return pb.InfoReply(model="tiny", world_size=1, backend="none", context_length=64, vocab_size=256,
                                weight_format="float32", capacity=1, max_queue=4, batch_limit=1)

        def Generate(self, request, context):
            seen.append(request)
            yield pb.GenerateEvent(started=pb.GenerateStarted(prompt_ids=request.prompt_ids))
            yield pb.GenerateEvent(done=pb.GenerateDone(reason=pb.MAX_TOKENS, generated_tokens=0))

    with front_before(Rank0(), tmp_path_factory.mktemp("args"), tls) as client:
        yield client, seen


def _grpc_messages(tls) -> dict:
    """``{(field, value): (status code, details)}`` of rank 0's real ``GenerationServicer`` (a fake
    scheduler behind it) asked with each :data:`BAD` value through the real ``GenerationClient``."""
    from mlxcluster.leader.generation import ClientError, GenerationClient, GenerationServicer
    from mlxcluster.protocol import mlxcluster_pb2_grpc as pb_grpc

    class Scheduler:
        def validate_prompt(self, ids):
            pass

        def generate(self, *args, **kw):
            raise AssertionError("a refused request reached the scheduler")

    source = SimpleNamespace(tokenizer=None, eos_token_ids=[0], vocab_size=256)

    async def main():
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(GenerationServicer(Scheduler(), source, "none", "float32"), server)
        port = server.add_secure_port("127.0.0.1:0", tls.server())
        await server.start()
        client = GenerationClient(f"127.0.0.1:{port}", tls, timeout_s=30)

        def run():
            got = {}
            for field, value, _ in BAD:
                try:
                    client.generate(prompt_ids=[1, 2], max_tokens=1, **{field: value})
                except ClientError as exc:
                    got[field, value] = (exc.code, str(exc))
            return got
        try:
            return await asyncio.to_thread(run)
        finally:
            client.close()
            await server.stop(None)

    return asyncio.run(main())


@pytest.mark.parametrize("dialect", ["chat", "completions", "responses", "anthropic", "ollama_chat",
                                     "ollama_generate", "grpc"])
def test_a_value_out_of_range_is_refused_identically(dialect, request, tls):
    """Each :data:`BAD` value is refused before rank 0 generates, with the one message of
    :func:`check_args`, in the dialect's own error body and status (HTTP 400, gRPC INVALID_ARGUMENT)."""
    if dialect == "grpc":
        got = _grpc_messages(tls)
        for field, value, message in BAD:
            assert got.get((field, value)) == (grpc.StatusCode.INVALID_ARGUMENT, message), (field, value)
        return
    client, seen = request.getfixturevalue("http")
    for field, value, message in BAD:
        if field not in CARRIES.get(dialect, {field}):
            continue
        path, body = _http_body(dialect, field, value)
        r = client.post(path, json=body)
        assert r.status_code == 400, (field, value, r.text)
        assert _message(dialect, r.json()) == message, (field, value)
        if dialect in ("chat", "completions", "responses"):
            assert r.json()["error"]["param"] == field
    assert not seen

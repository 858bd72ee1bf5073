"""Lossless failover across providers (issue 29, the router's part): a provider lost after the first
token -- the user's stream continues on another provider of the same model digest, with exactly the
unbroken answer.

Fast tier, in process: the router, two real :class:`Provider` objects (the real model's tokenizer)
linked to it over the real TLS link, each in front of a FAKE rank 0 that streams one fixed answer
with the streaming detokenizer exactly as rank 0 does, honouring ``resume_token_ids``.  The provider
serving a request is paused after k tokens and its link is killed; the other one continues.
"""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent import futures

import grpc
import pytest

from harness import until_async
from mlxcluster.front import Provider
from mlxcluster.front.provider import Delivered, released_text
from mlxcluster.model.tokenizer import final_segment, streaming_detokenizer
from mlxcluster.protocol import mlxcluster_pb2 as pb
from mlxcluster.protocol import mlxcluster_pb2_grpc as pb_grpc
from test_router import Harness, metric, run

MODEL = "smol"
# the answer every fake rank 0 gives: an emoji split across two tokens (the first releases only its
# space), stop-string candidates (" over the", " lazy cat")
TEXT = "The quick brown fox jumps over the lazy dog. Café 😀 ran away."


class TextRank0(pb_grpc.GenerationServicer):
    """Rank 0's ``Generation``: every prompt is answered with :attr:`ids` then EOS, each token's
    text from a streaming detokenizer primed with ``resume_token_ids`` (as leader/generation.py).
    ``pause_after``: a FRESH request (no resume) stops after that many tokens and waits until the
    call is cancelled (its provider's link is killed); ``fail_after``: a fresh request's group fails
    (UNAVAILABLE) after that many tokens; resumed requests never pause or fail."""

    def __init__(self, tokenizer, eos):
        self.tokenizer, self.eos = tokenizer, eos
        self.ids = list(tokenizer.encode(TEXT, add_special_tokens=False))
        self.pause_after = self.fail_after = None
        self.paused = threading.Event()
        self.resumes = []

    def Info(self, request, context):
        return pb.InfoReply(model="smol", world_size=1, backend="ring", context_length=2048, vocab_size=49152,
                            weight_format="float32", capacity=4, max_queue=8, batch_limit=4)

    def Generate(self, request, context):
        resume = [int(t) for t in request.resume_token_ids]
        self.resumes.append(resume)
        if resume != self.ids[:len(resume)] or len(resume) >= request.max_tokens:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad resume_token_ids {resume}")
        detok = streaming_detokenizer(self.tokenizer, resume)
        yield pb.GenerateEvent(started=pb.GenerateStarted(prompt_ids=request.prompt_ids, resumed_tokens=len(resume)))
        n, reason = len(resume), pb.MAX_TOKENS
        for t in self.ids[len(resume):] + [self.eos]:
            if self.pause_after is not None and not resume and n == self.pause_after:
                ended = threading.Event()
                context.add_callback(ended.set)
                self.paused.set()
                ended.wait(30)
                return
            if self.fail_after is not None and not resume and n == self.fail_after:
                context.abort(grpc.StatusCode.UNAVAILABLE, "tensor-parallel group failed: rank 1 lost")
            if n >= request.max_tokens:
                break
            n += 1
            if t == self.eos:
                reason = pb.EOS
                yield pb.GenerateEvent(token=pb.GeneratedToken(token_id=t, text=""))
                break
            detok.add_token(t)
            yield pb.GenerateEvent(token=pb.GeneratedToken(token_id=t, text=detok.last_segment))
        yield pb.GenerateEvent(done=pb.GenerateDone(reason=reason, generated_tokens=n,
                                                    text_tail=final_segment(detok, reason == pb.EOS)))


class Side:
    """One provider: a fake rank 0 (gRPC over the cluster's TLS) and a real Provider on it, which
    records the ``resume`` each of its requests was given."""

    def __init__(self, name, model_path, tls, tokenizer, eos):
        self.fake = TextRank0(tokenizer, eos)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_GenerationServicer_to_server(self.fake, self.server)
        port = self.server.add_secure_port("127.0.0.1:0", tls.server())
        self.server.start()
        self.provider = Provider(f"127.0.0.1:{port}", model_path, MODEL, tls)
        self.provider.name = name
        self.seen = []  # (token_ids, chars) of each request's resume (None: a fresh request)
        chat, completion = self.provider.chat_completion, self.provider.completion

        def recorded(fn):
            def call(body, resume=None, progress=None):
                self.seen.append(None if resume is None else (list(resume.token_ids), resume.chars))
                return fn(body, resume=resume, progress=progress)
            return call

        self.provider.chat_completion, self.provider.completion = recorded(chat), recorded(completion)

    def close(self):
        self.server.stop(None)


@pytest.fixture(scope="module")
def sides(real_model_path, tls):
    from mlxcluster.model.loader import load_tokenizer

    tokenizer, eos = load_tokenizer(real_model_path)
    made = [Side(name, real_model_path, tls, tokenizer, eos[0]) for name in ("A", "B")]
    assert made[0].provider.model_digest() and made[0].provider.model_digest() == made[1].provider.model_digest()
    yield made
    for s in made:
        s.close()


@pytest.fixture
def fresh(sides):
    for s in sides:
        s.fake.pause_after = s.fake.fail_after = None
        s.seen[:] = []
        s.fake.resumes.clear()
        s.fake.paused.clear()
        s.provider._digest = None  # model_digest() read again
    return sides


async def _linked(h, sides):
    for s in sides:
        if s.provider.name not in h.links:
            h.link(s.provider)
    await until_async(lambda: all(s.provider.name in h.router.providers for s in sides), 10, "registration")


async def _broken(h, sides, k, request):
    """``request()`` (a coroutine) with every side pausing fresh requests after ``k`` tokens: once
    the serving side's ``k`` tokens reached the router, its link is killed.  Returns the result of
    ``request()`` and the killed side; the side is linked again."""
    for s in sides:
        s.fake.pause_after = k
    task = asyncio.ensure_future(request())

    def serving():
        for s in sides:
            conn = h.router.providers.get(s.provider.name)
            if s.fake.paused.is_set() and conn is not None and conn.info()["delivered_tokens"] == k:
                return s
        return None

    victim = await until_async(serving, 10, f"{k} tokens delivered from one provider")
    await h.kill(victim.provider.name)
    result = await asyncio.wait_for(task, 20)
    for s in sides:
        s.fake.pause_after = None
    await _linked(h, sides)
    return result, victim


def _sse(raw):
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def _chat_body(**kw):
    return dict({"model": MODEL, "messages": [{"role": "user", "content": "go"}], "temperature": 0,
                 "max_tokens": 100}, **kw)


def _text(chunks):
    out = ""
    for c in chunks:
        for ch in c.get("choices") or []:
            out += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
    return out


def _strip(chunks):
    return [dict(c, id=None, created=None) for c in chunks]


# -- plain functions -------------------------------------------------------------------------------
def test_released_text_is_what_rank0_streamed(sides):
    """The continuing provider recomputes the resumed tokens' text exactly as rank 0 streamed it:
    a character split across tokens is not released until it is whole."""
    tok = sides[0].provider.tokenizer
    ids = sides[0].fake.ids
    for k in range(len(ids) + 1):
        detok = streaming_detokenizer(tok)
        streamed = ""
        for t in ids[:k]:
            detok.add_token(t)
            streamed += detok.last_segment
        released, tail = released_text(tok, ids[:k])
        assert released == streamed and (released + tail).rstrip("\ufffd") == tok.decode(ids[:k]).rstrip("\ufffd")
    p = Delivered()
    p.add("ab", (7, None))
    p.add("c", None)
    assert (p.token_ids, p.chars) == ([7], 3)


# -- the router: continuation across providers -----------------------------------------------------
@pytest.mark.parametrize("k,stop", [(5, None), (13, None), (8, [" lazy cat"]), (6, [" over the"])])
def test_streamed_chat_continues_on_the_other_provider_exactly(fresh, k, stop):
    """k=13: broken between the two tokens of an emoji; k=8: " lazy" held back for the stop string
    " lazy cat" (not a stop after all); k=6: " over" held for " over the", which does stop."""
    body = _chat_body(stream=True, stream_options={"include_usage": True}, **({"stop": stop} if stop else {}))

    async def main():
        async with Harness(max_continuations=2) as h:
            await _linked(h, fresh)

            async def request():
                r = await h.http.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return _sse(r.text)

            reference = await request()
            chunks, victim = await _broken(h, fresh, k, request)
            other = fresh[1] if victim is fresh[0] else fresh[0]
            assert all("error" not in c for c in chunks), chunks
            assert _text(chunks) == _text(reference)  # exactly the unbroken answer
            assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1  # one stream
            assert _strip(chunks) == _strip(reference)  # chunk for chunk: finish_reason, usage included
            ids = fresh[0].fake.ids
            chars = len(_text(chunks[:k + 1]))  # what the user had: the role chunk and k token chunks
            assert other.seen == [None, (ids[:k], chars)] or other.seen == [(ids[:k], chars)]
            assert other.fake.resumes[-1] == ids[:k]  # its rank 0 resumed after them
            assert h.router.stats["continuations"] == 1
            m = (await h.http.get("/metrics")).text
            assert metric(m, "mlxcluster_router_continuations_total", reason="provider_lost") == 1
            if stop == [" over the"]:
                assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
                assert chunks[-2]["choices"][0]["stop_reason"] == " over the"
            return chunks, reference

    run(main())


def test_completion_anthropic_and_non_streaming_answers_continue(fresh):
    async def main():
        async with Harness() as h:
            await _linked(h, fresh)
            cases = [
                ("/v1/completions", {"model": MODEL, "prompt": "go", "max_tokens": 12, "temperature": 0}),  # length
                ("/v1/chat/completions", _chat_body()),
                ("/v1/messages", {"model": MODEL, "max_tokens": 100, "stream": True,
                                  "messages": [{"role": "user", "content": "go"}], "temperature": 0}),
            ]
            for path, body in cases:
                async def request():
                    r = await h.http.post(path, json=body)
                    assert r.status_code == 200, r.text
                    return r.json() if not body.get("stream") else r.text

                reference = await request()
                answer, _victim = await _broken(h, fresh, 4, request)
                if isinstance(reference, dict):
                    assert answer["id"].startswith(("chatcmpl-", "cmpl-"))
                    assert dict(answer, id=None, created=None) == dict(reference, id=None, created=None), path
                else:  # Anthropic's events: the same, message id aside
                    norm = lambda raw: [e for e in raw.split("\n") if '"id"' not in e]  # noqa: E731
                    assert norm(answer) == norm(reference), path
                    deltas = [json.loads(e[6:]).get("delta", {}) for e in answer.split("\n") if e.startswith("data: ")]
                    assert "".join(d.get("text", "") for d in deltas) == TEXT and '"error"' not in answer
            assert h.router.stats["continuations"] == 3

    run(main())


def test_no_provider_with_the_digest_ends_with_one_clear_error(fresh):
    fresh[1].provider._digest = "0123456789abcdef"  # another model file

    async def main():
        async with Harness() as h:
            await _linked(h, fresh[:1])  # only A, until it has delivered 5 tokens

            async def request():
                r = await h.http.post("/v1/chat/completions", json=_chat_body(stream=True))
                return _sse(r.text)

            fresh[0].fake.pause_after = 5
            task = asyncio.ensure_future(request())
            await until_async(lambda: h.router.providers["A"].info()["delivered_tokens"] == 5, 10, "5 tokens from A")
            await _linked(h, fresh)
            await h.kill("A")
            chunks = await asyncio.wait_for(task, 20)
            errors = [c["error"] for c in chunks if "error" in c]
            assert len(errors) == 1 and "no other live provider serves model digest" in errors[0]["message"]
            assert "the answer is incomplete" in errors[0]["message"]
            assert _text(chunks) == "The quick brown fox jumps"  # what A delivered, nothing more
            assert fresh[1].seen == [] and h.router.stats["continuations"] == 0

    run(main())


def test_continuations_are_bounded(fresh):
    async def main():
        async with Harness(max_continuations=0) as h:
            await _linked(h, fresh)

            async def request():
                r = await h.http.post("/v1/chat/completions", json=_chat_body(stream=True))
                return _sse(r.text)

            chunks, _victim = await _broken(h, fresh, 3, request)
            errors = [c["error"] for c in chunks if "error" in c]
            assert len(errors) == 1 and "continued 0 times already" in errors[0]["message"], errors
            assert _text(chunks) == "The quick brown"

    run(main())


def test_provider_refuses_a_resume_beyond_its_text(fresh):
    """A resume whose character count exceeds the resumed tokens' text is a 400 naming ``resume``."""
    from mlxcluster.front.provider import ProviderError

    side = fresh[0]

    async def main():
        it = side.provider.chat_completion(_chat_body(), resume=Delivered(side.fake.ids[:2], 99))
        with pytest.raises(ProviderError) as ei:
            async for _ in it:
                pass
        assert ei.value.status == 400 and ei.value.param == "resume" and "beyond" in ei.value.message

    run(main())


class Scripted:
    """A provider that reports its tokens (``resumes``) without a model: six words ``"w{i} "``, then
    the finish chunk, then (``hold``) it waits -- before its usage chunk -- until cancelled."""

    resumes = True

    def __init__(self, name, hold=False):
        self.name, self.hold = name, hold
        self.models, self.capacity, self.context_length = [MODEL], 4, 2048
        self.seen = []
        self.held = None  # an asyncio.Event set once it waits

    def load(self):
        return {"queued": 0, "running": 0, "capacity": 4}

    def model_digest(self):
        return "d1gest"

    def chat_completion(self, body, resume=None, progress=None):
        return self._gen(resume, progress)

    async def _gen(self, resume, progress):
        done = list(resume.token_ids) if resume is not None else []
        self.seen.append((done, resume.chars if resume is not None else None))
        head = {"id": "chatcmpl-" + self.name, "object": "chat.completion.chunk", "created": 1, "model": MODEL}
        yield dict(head, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                   usage={"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3})
        for i in range(len(done), 6):
            progress.add(f"w{i} ", (i, None))
            yield dict(head, choices=[{"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}])
        yield dict(head, choices=[{"index": 0, "delta": {}, "finish_reason": "length"}])
        if self.hold:
            self.held.set()
            await asyncio.Event().wait()  # until the link is killed (the task is cancelled)
        yield dict(head, choices=[], usage={"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9})


def test_a_break_after_the_finish_chunk_never_duplicates_it():
    """The finish and usage chunks carry no token: the router holds them until the provider's Done,
    so a provider lost between them is continued (after all six tokens) and the user gets one
    finish chunk and the usage of the whole answer."""
    a, b = Scripted("A", hold=True), Scripted("B")

    async def main():
        a.held = asyncio.Event()
        async with Harness() as h:
            h.link(a)
            await h.linked(a)

            async def request():
                r = await h.http.post("/v1/chat/completions", json=_chat_body(
                    stream=True, stream_options={"include_usage": True}))
                return _sse(r.text)

            task = asyncio.ensure_future(request())
            await asyncio.wait_for(a.held.wait(), 10)
            h.link(b)
            await h.linked(b)
            await h.kill("A")
            chunks = await asyncio.wait_for(task, 20)
            assert _text(chunks) == "".join(f"w{i} " for i in range(6))
            assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]].count("length") == 1
            assert chunks[-1]["usage"]["completion_tokens"] == 6 and not chunks[-1]["choices"]
            assert {c["id"] for c in chunks} == {"chatcmpl-A"}
            assert b.seen == [(list(range(6)), len(_text(chunks)))]

    run(main())


def test_cli_refuses_a_negative_max_continuations():
    from harness import assert_one_line_error, cli

    proc = cli("router", "--provider-token", "t", "--no-auth", "--max-continuations", "-1")
    assert proc.returncode == 2
    assert_one_line_error(proc, "--max-continuations must be at least 0, got -1")


def test_a_group_failure_reported_mid_answer_is_continued(fresh):
    """A provider whose group fails under a request (no healer: it answers 503 mid-stream) keeps its
    link; the router continues the answer on the other provider all the same."""
    async def main():
        async with Harness() as h:
            await _linked(h, fresh)

            async def request():
                r = await h.http.post("/v1/completions", json={"model": MODEL, "prompt": "go", "max_tokens": 30,
                                                                "temperature": 0, "stream": True})
                return _sse(r.text)

            reference = await request()
            for s in fresh:
                s.fake.fail_after = 7
            chunks = await request()
            assert all("error" not in c for c in chunks), chunks
            assert _strip(chunks) == _strip(reference) and len({c["id"] for c in chunks}) == 1
            assert [r for s in fresh for r in s.fake.resumes if r] == [fresh[0].fake.ids[:7]]
            assert h.router.stats["continuations"] == 1 and len(h.router.providers) == 2  # no link was lost
            m = (await h.http.get("/metrics")).text
            assert metric(m, "mlxcluster_router_continuations_total", reason="provider_503") == 1

    run(main())

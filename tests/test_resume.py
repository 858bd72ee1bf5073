"""Lossless failover, rank 0's side (issue 29 part A): a request resumed on a new group with the tokens an
earlier group already delivered (``GenerateRequest.resume_token_ids``) continues that answer exactly.

Each check runs a request unbroken to N tokens on a fresh in-process rank 0 (``GenerationServicer`` over a
``Scheduler`` and ``RankEngine`` on the real model, float32), then the same request cut after k tokens
and resumed with those k tokens on ANOTHER fresh rank 0: the token ids and the streamed text pieces put
together equal the unbroken run's.  Greedy, seeded sampling with top_p/top_k, the penalties, logit_bias, a
JSON grammar, a rank N in process (frame-driven, like TP), and a PD decode group (which must compute a
resumed prompt itself).  The slow check resumes on the session's shared TP=3 group.

Each unbroken request runs once per module (:func:`unbroken`); the cut run is a run whose client went
away after k tokens in the greedy check, elsewhere the unbroken run's first k tokens (the same tokens
and pieces, as that check shows).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from concurrent import futures
from dataclasses import dataclass, field
from typing import List, Optional

import pytest

from mlxcluster.leader.generation import GenerationServicer, prime_detokenizer
from mlxcluster.protocol import mlxcluster_pb2 as pb

from harness import InProcessRank

#: a raw prompt (13 tokens) the model continues with an emoji, a multi-byte character split across tokens:
#: " 🌟. I'm a total fan of" (its 2nd token's text is empty: the character waits for its last byte)
EMOJI_PROMPT = "I love ☕ and 🍕 and 😀 and"
#: a longer one (24 tokens), for the prefix cache (it keeps prompts of PREFIX_MIN_TOKENS, 16, or more)
LONG_EMOJI_PROMPT = "I love ☕ and 🍕 and 😀 and 🍕 and ☕ and 😀 and"
N = 10


@pytest.fixture(scope="module")
def source(real_model_path):
    """The real model's source (tokenizer, EOS, limits) and its float32 model, in this process."""
    from mlxcluster.model.loader import read_model
    from mlxcluster.model.tp import build_model

    src = read_model(real_model_path)
    return src, build_model(src.config, src.weights, src.quantization, "float32")


class _Aborted(Exception):
    pass


class _Context:
    """A grpc.aio servicer context that records ``abort``."""

    code = None
    details = ""

    async def abort(self, code, details):
        self.code, self.details = code, details
        raise _Aborted(details)


@dataclass
class Run:
    ids: List[int] = field(default_factory=list)
    pieces: List[str] = field(default_factory=list)  # each token's text, then the done event's tail
    started: Optional[pb.GenerateStarted] = None
    done: Optional[pb.GenerateDone] = None
    code: object = None
    details: str = ""

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def _rank0(source, rank_n: bool = False, decode_side=None):
    """A fresh rank 0 (its own scheduler, engine, caches): ``(servicer, executor)``."""
    from mlxcluster.control.follower import Follower
    from mlxcluster.control.link import RankGroup
    from mlxcluster.leader.scheduler import Scheduler

    src, model = source
    executor = futures.ThreadPoolExecutor(1)
    group = RankGroup()
    if rank_n:
        group.add(InProcessRank(Follower(model, 1, src.vocab_size, src.context_length), group, executor))
    sched = Scheduler(model, group, src.vocab_size, src.context_length, executor, step_timeout_s=120,
                      tokenizer=src.tokenizer, decode_side=decode_side)
    return GenerationServicer(sched, src, "ring", "float32"), executor


def generate(source, request: pb.GenerateRequest, *, stop_after: Optional[int] = None, **rank0) -> Run:
    """Run ``request`` on a fresh rank 0; with ``stop_after``, the client goes away after that many tokens
    (the group's failure as the front end sees it: those tokens were delivered, nothing after)."""
    return generate_all(source, [request], stop_after=stop_after, **rank0)[0]


def generate_all(source, requests: List[pb.GenerateRequest], *, stop_after: Optional[int] = None,
                 **rank0) -> List[Run]:
    """Run ``requests`` one after another on one fresh rank 0 (its prefix cache kept between them)."""
    service, executor = _rank0(source, **rank0)
    runs = []

    async def one(request):
        run, ctx = Run(), _Context()
        runs.append(run)
        stream = service.Generate(request, ctx)
        try:
            async for event in stream:
                kind = event.WhichOneof("event")
                if kind == "started":
                    run.started = event.started
                elif kind == "token":
                    run.ids.append(event.token.token_id)
                    run.pieces.append(event.token.text)
                    if stop_after is not None and len(run.ids) == stop_after:
                        break
                else:
                    run.done = event.done
                    run.pieces.append(event.done.text_tail)
        except _Aborted:
            run.code, run.details = ctx.code, ctx.details
        finally:
            await stream.aclose()

    async def main():
        try:
            for request in requests:
                await one(request)
        finally:
            await service.scheduler.close()

    try:
        asyncio.run(main())
    finally:
        executor.shutdown(wait=True)
    return runs


def _request(source, prompt: str = EMOJI_PROMPT, max_tokens: int = N, resume=(), **sampling) -> pb.GenerateRequest:
    src, _ = source
    ids = src.tokenizer.encode(prompt, add_special_tokens=False)
    s = pb.Sampling(**{k: v for k, v in sampling.items() if k not in ("repetition_penalty",)})
    if "repetition_penalty" in sampling:
        s.repetition_penalty = sampling["repetition_penalty"]
    return pb.GenerateRequest(prompt_ids=ids, max_tokens=max_tokens, sampling=s, resume_token_ids=list(resume))


_UNBROKEN = {}  # (request bytes, rank_n) -> the unbroken Run: each unbroken request is run once per module


def unbroken(source, request: pb.GenerateRequest, rank_n: bool = False) -> Run:
    """The unbroken run of ``request`` on a fresh rank 0 (:func:`generate`), made once per module: every
    fresh rank 0 answers a request alike (greedy, or seeded: token i drawn with the key of seed i)."""
    key = (request.SerializeToString(deterministic=True), rank_n)
    if key not in _UNBROKEN:
        _UNBROKEN[key] = generate(source, request, rank_n=rank_n)
    return _UNBROKEN[key]


def check_resume(source, k: int, prompt: str = EMOJI_PROMPT, max_tokens: int = N, *, stopped: bool = False,
                 **kw) -> Run:
    """Unbroken run (:func:`unbroken`) vs cut after ``k`` tokens + resumed on ANOTHER fresh rank 0: same ids,
    same text.  With ``stopped`` the cut run is a run whose client went away after ``k`` tokens; else it is
    the unbroken run's first ``k`` tokens and pieces (what a run stopped there delivers: the same run up
    to there, as the ``stopped`` checks show)."""
    whole = unbroken(source, _request(source, prompt, max_tokens, **kw))
    if stopped:
        first = generate(source, _request(source, prompt, max_tokens, **kw), stop_after=k)
        assert first.pieces == whole.pieces[:k]
    else:
        first = Run(ids=whole.ids[:k], pieces=whole.pieces[:k])
    assert whole.code is None, whole.details
    assert len(whole.ids) > k, f"the unbroken answer has only {len(whole.ids)} tokens"
    assert first.ids == whole.ids[:k]
    rest = generate(source, _request(source, prompt, max_tokens, resume=first.ids, **kw))
    assert rest.code is None, rest.details
    assert first.ids + rest.ids == whole.ids
    assert "".join(first.pieces) + rest.text == whole.text
    # the counts are the whole request's: prompt without the resumed tokens, completion with them
    assert list(rest.started.prompt_ids) == list(whole.started.prompt_ids)
    assert rest.done.generated_tokens == whole.done.generated_tokens == len(whole.ids)
    assert rest.done.reason == whole.done.reason
    return whole


def _split_points(source, ids: List[int]) -> List[int]:
    """Cuts ``k`` (1 <= k < len) after which the answer's text ends inside a character (its token k-1
    holds a partial UTF-8 sequence)."""
    tok = source[0].tokenizer
    return [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]


@pytest.mark.slow  # in-process, but ~15 s of real-model decoding: the full suite runs it (fast tier budget)
def test_greedy_resume_continues_tokens_and_text_across_a_split_character(source):
    whole = unbroken(source, _request(source))
    splits = _split_points(source, whole.ids)
    assert splits, f"no multi-byte character split in {whole.text!r}"
    assert any(not whole.pieces[k - 1] for k in splits)  # the text of a split character waits for its last byte
    check_resume(source, splits[0], stopped=True)  # a run stopped there
    for k in sorted({splits[-1], 1} - {splits[0]}):  # (a cut the stopped run made is the same resume)
        check_resume(source, k)
    # and at a word boundary (a leading space after the break)
    spaced = [k for k in range(1, len(whole.ids)) if whole.pieces[k].startswith(" ")]
    assert spaced
    check_resume(source, spaced[0])


@pytest.mark.slow  # in-process, but 12-26 s of real-model decoding: the full suite runs it (fast tier budget)
def test_seeded_top_p_top_k_resume_draws_token_i_with_the_key_of_seed_i(source):
    whole = check_resume(source, 5, max_tokens=10, temperature=0.9, top_p=0.95, top_k=40, seed=7)
    # a different seed gives another answer: the comparison is not greedy in disguise (its first 3 tokens
    # differ already; token i's key is seed i's whatever max_tokens)
    assert generate(source, _request(source, max_tokens=3, temperature=0.9, top_p=0.95, top_k=40, seed=8)).ids \
        != whole.ids[:3]


@pytest.mark.slow  # in-process, but ~10 s of real-model decoding: the full suite runs it (fast tier budget)
def test_penalties_resume_counts_the_resumed_tokens(source):
    prompt = "The cat sat on the mat. The cat sat on the mat. The cat"
    kw = dict(presence_penalty=2.0, frequency_penalty=2.0)
    # " sat on the mat. The" resumed: " cat" then not " sat" again, as its count says (" was sitting on";
    # without the penalties: " cat sat on the")
    whole = check_resume(source, 6, prompt=prompt, **kw)
    assert whole.ids != generate(source, _request(source, prompt)).ids  # the penalties change this answer
    check_resume(source, 6, prompt=prompt, temperature=0.7, seed=3, repetition_penalty=1.3, **kw)


@pytest.mark.slow  # in-process, but ~10 s of real-model decoding: the full suite runs it (fast tier budget)
def test_logit_bias_resume(source):
    src, _ = source
    # push the pizza emoji's first byte token (a partial UTF-8 sequence on its own)
    first = src.tokenizer.encode(" 🍕", add_special_tokens=False)[1]
    whole = check_resume(source, 3, logit_bias={first: 6.0})
    assert first in whole.ids


@pytest.mark.slow  # in-process, but 12-26 s of real-model decoding: the full suite runs it (fast tier budget)
def test_json_grammar_resume_consumes_the_resumed_tokens(source):
    from mlxcluster.engine.constraint import json_grammar

    grammar = json_grammar({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                            "required": ["name", "age"]})
    prompt = "Give a JSON object with a name and an age: "
    whole = check_resume(source, 4, prompt=prompt, max_tokens=24, grammar=grammar)
    json.loads(whole.text)


@pytest.mark.slow  # in-process, but ~10 s of real-model decoding: the full suite runs it (fast tier budget)
def test_resume_on_the_surviving_group_takes_the_prompt_from_the_prefix_cache(source):
    """The same rank 0 (a group that survived): the resumed request's prompt comes from the prefix cache;
    started/done count cached positions of the prompt only.  Then a second failover of the same request
    on it: the cache now holds prompt + the first resumed tokens."""
    request = lambda resume=(): _request(source, LONG_EMOJI_PROMPT, resume=resume)  # noqa: E731
    whole = unbroken(source, request())
    k = 4
    again, rest, rest2 = generate_all(source, [request(), request(whole.ids[:k]), request(whole.ids[:k + 3])])
    assert again.ids == whole.ids
    assert whole.ids[:k] + rest.ids == whole.ids
    assert "".join(whole.pieces[:k]) + rest.text == whole.text
    n = len(rest.started.prompt_ids)
    assert again.started.cached_prompt_tokens == 0
    assert rest.started.cached_prompt_tokens == rest.done.cached_prompt_tokens == n - 1  # all but its last position
    # the second failover: prompt + k resumed tokens cached, more than the prompt
    assert whole.ids[:k + 3] + rest2.ids == whole.ids
    assert rest2.started.cached_prompt_tokens == n  # capped at the prompt (more positions were cached)


@pytest.mark.slow  # in-process, but ~5 s of real-model decoding: the full suite runs it (fast tier budget)
def test_a_resumed_prompt_longer_than_a_chunk_is_prefilled_in_chunks(source, monkeypatch):
    """Chunks of 16 tokens here: the unbroken run's prompt (12 tokens) is prefilled in one call; prompt + 6
    resumed tokens pass a chunk and are prefilled chunk by chunk (one per plan), the first token sampled
    at index 6."""
    from mlxcluster.engine import passes
    from mlxcluster.engine.decode import RankEngine

    monkeypatch.setattr(passes, "PREFILL_CHUNK_TOKENS", 16)
    chunks = []
    real = RankEngine.prefill_chunk
    monkeypatch.setattr(RankEngine, "prefill_chunk",
                        lambda self, uid, count: (chunks.append(count), real(self, uid, count))[1])
    ids = [(i * 37) % 40000 + 100 for i in range(12)]
    k = 6
    whole = generate(source, pb.GenerateRequest(prompt_ids=ids, max_tokens=k + 4))
    assert chunks == [12]
    rest = generate(source, pb.GenerateRequest(prompt_ids=ids, max_tokens=k + 4, resume_token_ids=whole.ids[:k]))
    assert chunks == [12, 16, 2]
    assert whole.ids[:k] + rest.ids == whole.ids and len(rest.ids) == 4
    assert "".join(whole.pieces[:k]) + rest.text == whole.text


@pytest.mark.slow  # in-process, but ~10 s of real-model decoding: the full suite runs it (fast tier budget)
def test_frame_driven_rank_n_and_seeded_resume(source):
    """A group of two ranks (a rank N in process, frame-driven: no lookahead, rank 0 samples)."""
    kw = dict(max_tokens=6, temperature=0.8, top_p=0.9, seed=11)
    whole = unbroken(source, _request(source, **kw), rank_n=True)
    k = 3
    rest = generate(source, _request(source, resume=whole.ids[:k], **kw), rank_n=True)
    assert rest.code is None, rest.details
    assert whole.ids[:k] + rest.ids == whole.ids and len(whole.ids) == 6
    assert "".join(whole.pieces[:k]) + rest.text == whole.text


@pytest.mark.slow  # in-process, but ~5 s of real-model decoding: the full suite runs it (fast tier budget)
def test_pd_decode_group_computes_a_resumed_prompt_itself(source):
    """A PD decode group never asks the prefill group for a resumed request (it would sample the answer's
    token 0): the request joins with a computed source.  The decode side here has no prefill group at all."""

    class NoPrefillGroup:
        async def fetch_async(self, *a):
            raise AssertionError("a resumed request was sent to the prefill group")

    whole = unbroken(source, _request(source))
    rest = generate(source, _request(source, resume=whole.ids[:5]), decode_side=NoPrefillGroup())
    assert rest.code is None, rest.details
    assert whole.ids[:5] + rest.ids == whole.ids


def test_bad_resumed_tokens_are_invalid_argument(source):
    import grpc

    from mlxcluster.engine.constraint import json_grammar

    src, _ = source
    eos = src.eos_token_ids[0]
    for resume, kw, words in [
        ([5, eos], {}, "end-of-sequence"),
        ([5] * N, {}, "nothing is left to generate"),
        ([5] * (N + 3), {}, "nothing is left to generate"),
        ([5, src.vocab_size], {}, "outside the vocabulary"),
        (src.tokenizer.encode("hello", add_special_tokens=False), dict(grammar=json_grammar()),
         "does not follow the grammar"),
    ]:
        run = generate(source, _request(source, resume=resume, **kw))
        assert run.code == grpc.StatusCode.INVALID_ARGUMENT, (resume, run.details)
        assert words in run.details and "\n" not in run.details
        assert not run.ids
    # prompt + resume must leave room in the context
    long = pb.GenerateRequest(prompt_ids=[5] * (src.context_length - 3), max_tokens=N, resume_token_ids=[6, 7, 8])
    run = generate(source, long)
    assert run.code == grpc.StatusCode.INVALID_ARGUMENT and "fill the context" in run.details


def test_prime_detokenizer_leaves_the_state_of_the_unbroken_stream(source):
    from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer

    tok = source[0].tokenizer
    ids = tok.encode("Tea ☕ and\n 日本語 🍕 pizza", add_special_tokens=False)
    for k in range(len(ids)):
        a, b = NaiveStreamingDetokenizer(tok), NaiveStreamingDetokenizer(tok)
        pieces = []
        for t in ids:
            a.add_token(t)
            pieces.append(a.last_segment)
        prime_detokenizer(b, ids[:k])
        rest = []
        for t in ids[k:]:
            b.add_token(t)
            rest.append(b.last_segment)
        assert rest == pieces[k:], k


def test_answer_tail_is_the_tail_rank0_would_have_sent(source):
    """An answer cut at max_tokens after k tokens: its streamed pieces + answer_tail(first k) is the
    text rank 0's Generate sends (pieces + done.text_tail) -- the whole decoded text, less a
    character cut in half.  The front end uses it when every token arrived but done was lost."""
    from mlxcluster.model.tokenizer import answer_tail, final_segment, streaming_detokenizer

    tok = source[0].tokenizer
    ids = tok.encode("Tea ☕ and\n 日本語 🍕 pizza  ", add_special_tokens=False)
    for k in range(1, len(ids) + 1):
        a = streaming_detokenizer(tok)
        pieces = []
        for t in ids[:k]:
            a.add_token(t)
            pieces.append(a.last_segment)
        expect = final_segment(a, False)
        assert answer_tail(tok, ids[:k]) == expect, k
        assert "".join(pieces) + expect == tok.decode(ids[:k]).rstrip("\ufffd"), k


@pytest.mark.slow
def test_tp3_group_answers_a_resumed_greedy_request_as_the_unbroken_one(source, tp3_group):
    """The session's shared TP=3 group (left usable): cut after k tokens, resumed, equals unbroken."""
    from mlxcluster.leader.generation import GenerationClient

    src, _ = source
    ids = src.tokenizer.encode(EMOJI_PROMPT, add_special_tokens=False)
    with contextlib.closing(GenerationClient(tp3_group.address, tp3_group.credentials)) as client:
        whole = client.generate(prompt_ids=ids, max_tokens=N)
        k = (_split_points(source, whole.token_ids) or [5])[0]
        stream = client.stream(prompt_ids=ids, max_tokens=N)
        first = []
        for event in stream:
            if event.WhichOneof("event") == "token":
                first.append(event.token)
                if len(first) == k:
                    break
        stream.close()  # the client goes away after k tokens
        rest = client.generate(prompt_ids=ids, max_tokens=N, resume_token_ids=[t.token_id for t in first])
    assert [t.token_id for t in first] + rest.token_ids == whole.token_ids
    assert "".join(t.text for t in first) + rest.text == whole.text
    assert rest.prompt_ids == whole.prompt_ids and rest.reason == whole.reason

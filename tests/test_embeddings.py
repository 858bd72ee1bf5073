"""Embeddings: ``/v1/embeddings`` (OpenAI) and ``/api/embed`` (Ollama) over rank 0's ``Generation.Embed``.

Fast tier: pooling, normalisation, Matryoshka ``dimensions``, the model's sentence-transformers
config, base64 and the request forms as pure functions; the engine's embeddings of a random-weight
Qwen3 equal mlx-lm's own model's (in process, TP=1); the scheduler's embeds part (a loopback rank
N runs the same plan); the HTTP codec of both APIs with a fake rank 0 (the official ``openai`` and
``ollama`` clients).  Slow tier: one TP=1 and one TP=2 group of that Qwen3 (started once each)
answer both endpoints; every embedding equals the reference computed here with mlx-lm's Qwen3 on
the full weights (cosine >= 0.9999), and inputs batched together equal their lone embeddings.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import threading
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace

import grpc
import mlx.core as mx
import numpy as np
import pytest

from mlxcluster.engine import embed as E
from mlxcluster.front.dialects import ollama_embed_request
from mlxcluster.front.provider import ProviderError, embedding_inputs, encode_embedding
from mlxcluster.protocol import frames as fr
from mlxcluster.protocol import mlxcluster_pb2 as pb
from mlxcluster.protocol import mlxcluster_pb2_grpc as pb_grpc
from mlxcluster.protocol.errors import OpenAIError

from harness import InProcessRank

slow = pytest.mark.slow
NAME = "tiny-embed"
TEXTS = ["The capital of France is Paris.", "Hi", "Embeddings of a decoder model, pooled at the last token."]


def _write_embedding_model(out: str, mode: str = "lasttoken", **config) -> str:
    """A random-weight Qwen3 (2 KV heads: TP=2 divides it) with a sentence-transformers config
    (Transformer, Pooling ``mode``, Normalize), as Qwen3-Embedding ships one."""
    from mlxcluster.model.synthetic import write_model

    write_model("qwen3", out, overrides=dict({"is_matryoshka": True}, **config))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    Path(out, "modules.json").write_text(json.dumps(modules))
    Path(out, "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": 64, "include_prompt": True,
               **{k: k == f"pooling_mode_{mode}" for k in ("pooling_mode_cls_token", "pooling_mode_mean_tokens",
                                                         "pooling_mode_max_tokens", "pooling_mode_lasttoken",
                                                         "pooling_mode_mean_sqrt_len_tokens")}}
    if mode == "mean":
        pooling["pooling_mode_mean_tokens"] = True
    Path(out, "1_Pooling", "config.json").write_text(json.dumps(pooling))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _write_embedding_model(str(tmp_path_factory.mktemp("qwen3-embed") / "m"))


@pytest.fixture(scope="module")
def reference(model_dir):
    """``reference(ids)``: mlx-lm's own Qwen3 on the full weights -- the final normed hidden
    state's last position, L2-normalised (Qwen3-Embedding's rule), float32 NumPy."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir))

    def ref(ids):
        h = model.model(mx.array([ids]))[0, -1].astype(mx.float32)
        return np.array(h / mx.linalg.norm(h))

    return ref


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _cos(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# -- pure functions ----------------------------------------------------------------------------
def test_pool_modes_over_each_inputs_own_positions():
    h = mx.array(np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3) - 7.0)
    a = np.array(h)
    got = np.array(E.pool(h, [2, 4], ["lasttoken", "lasttoken"]))
    assert np.array_equal(got, np.stack([a[0, 1], a[1, 3]]))  # position 1 of row 0: its padding is never read
    assert np.allclose(np.array(E.pool(h, [2, 4], ["mean", "mean"])), np.stack([a[0, :2].mean(0), a[1].mean(0)]))
    assert np.array_equal(np.array(E.pool(h, [2, 4], ["cls", "max"])), np.stack([a[0, 0], a[1].max(0)]))
    assert E.pool(h.astype(mx.bfloat16), [1, 1], ["lasttoken"] * 2).dtype == mx.float32
    with pytest.raises(E.EmbedError, match="unknown pooling mode"):
        E.pool(h, [1], ["weightedmean"])


def test_normalize_and_matryoshka_truncation():
    x = np.array([[3.0, 4.0, 12.0], [0.0, 0.0, 0.0]], np.float32)
    n = E.normalize(x)
    assert n.dtype == np.float32 and np.allclose(n[0], [3 / 13, 4 / 13, 12 / 13]) and not np.isnan(n).any()
    assert np.allclose(np.array(E.normalize(mx.array(x))), n)
    t = E.truncate_dimensions(n[:1], 2)
    assert t.shape == (1, 2) and np.allclose(t[0], [0.6, 0.8])  # the first 2 values, renormalised
    assert E.truncate_dimensions(n, 0) is n and E.truncate_dimensions(n, 3) is n


def test_dimensions_only_where_the_config_allows_them():
    plain = E.Pooling(width=64)
    assert E.check_dimensions(plain, 0) == 64 and E.check_dimensions(plain, 64) == 64
    with pytest.raises(E.EmbedError, match="allows no Matryoshka"):
        E.check_dimensions(plain, 32)
    any_width = E.Pooling(width=64, matryoshka=())
    assert E.check_dimensions(any_width, 7) == 7
    with pytest.raises(E.EmbedError, match="between 1 and 64"):
        E.check_dimensions(any_width, 65)
    listed = E.Pooling(width=64, matryoshka=(16, 32))
    assert E.check_dimensions(listed, 32) == 32
    with pytest.raises(E.EmbedError, match="16, 32, 64"):
        E.check_dimensions(listed, 8)


def test_pooling_of_reads_the_sentence_transformers_config(tmp_path):
    config = {"model_type": "qwen3", "hidden_size": 64}
    assert E.pooling_of(str(tmp_path), config) == E.Pooling("lasttoken", 64, None, "default")
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True,
                                                                     "pooling_mode_cls_token": False}))
    assert E.pooling_of(str(tmp_path), config).mode == "mean"
    modules = [{"type": "sentence_transformers.models.Transformer", "path": ""},
               {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"},
               {"type": "sentence_transformers.models.Normalize", "path": "2_Normalize"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    p = E.pooling_of(str(tmp_path), dict(config, matryoshka_dimensions=[32, 16]))
    assert (p.mode, p.matryoshka) == ("lasttoken", (16, 32)) and p.source.endswith("config.json")
    assert E.pooling_of(str(tmp_path), dict(config, is_matryoshka=True)).matryoshka == ()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(E.EmbedError, match="pooling_mode_weightedmean_tokens is not supported"):
        E.pooling_of(str(tmp_path), config)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True,
                                                                     "pooling_mode_mean_tokens": True}))
    with pytest.raises(E.EmbedError, match="2 pooling modes"):
        E.pooling_of(str(tmp_path), config)
    (tmp_path / "modules.json").write_text(json.dumps(modules + [{"type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(E.EmbedError, match="Dense module"):
        E.pooling_of(str(tmp_path), config)
    gguf = str(tmp_path / "m.gguf")
    assert E.pooling_of(gguf, config, {"qwen3.pooling_type": 1}).mode == "mean"
    assert E.pooling_of(gguf, config, {"general.name": "x"}).mode == "lasttoken"


def test_topologies_that_cannot_embed_say_why():
    assert "--local-decode" in E.unsupported(SimpleNamespace(local_decode=True, route=object()))
    assert "--layers" in E.unsupported(SimpleNamespace(local_decode=False, route=object()))
    AfdModel = type("AfdModel", (), {})
    assert "--afd" in E.unsupported(AfdModel())
    assert E.unsupported(SimpleNamespace(hidden=lambda x: x)) is None


def test_base64_is_little_endian_float32():
    values = [0.25, -1.5, 3.0e-8]
    encoded = encode_embedding(values, "base64")
    assert np.array_equal(np.frombuffer(base64.b64decode(encoded), dtype="<f4"), np.array(values, np.float32))
    assert encode_embedding(np.array(values, np.float32), "float") == [float(np.float32(v)) for v in values]


def test_openai_input_forms():
    assert embedding_inputs("a") == ["a"]
    assert embedding_inputs(["a", "b"]) == ["a", "b"]
    assert embedding_inputs([1, 2, 3]) == [[1, 2, 3]]
    assert embedding_inputs([[1], [2, 3]]) == [[1], [2, 3]]
    for bad, words in [(None, "must be a string"), ([], "must not be empty"), ("", "empty string"),
                       (["a", ""], "empty string"), ([[1], []], "empty token list"), ([-1], "negative"),
                       ([1.5], "must be a string"), ([["a"]], "must be a string"), ([True], "must be a string"),
                       (["a", 1], "must be a string"), (["x"] * 2049, "at most 2048")]:
        with pytest.raises(ProviderError, match=words) as err:
            embedding_inputs(bad)
        assert err.value.status == 400 and err.value.param == "input"


def test_ollama_request_forms():
    assert ollama_embed_request({"model": "m:latest", "input": "a"}) == ({"model": "m", "input": "a"}, True)
    assert ollama_embed_request({"model": "m", "input": ["a"], "truncate": False, "dimensions": 8,
                                 "options": {"num_ctx": 64}, "keep_alive": "5m"}) == \
        ({"model": "m", "input": ["a"], "dimensions": 8, "keep_alive": "5m"}, False)  # (for a model pool)
    for body, param in [({"input": "a"}, "model"), ({"model": "m", "input": [1]}, "input"),
                        ({"model": "m", "input": "a", "keep_alive": "soon"}, "keep_alive"),
                        ({"model": "m", "input": "a", "truncate": "yes"}, "truncate"),
                        ({"model": "m", "input": "a", "options": []}, "options")]:
        with pytest.raises(OpenAIError) as err:
            ollama_embed_request(body)
        assert err.value.status == 400 and err.value.param == param


# -- the engine, in process ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp1_model(model_dir):
    from mlxcluster.model.loader import read_model
    from mlxcluster.model.tp import build_model

    source = read_model(model_dir)
    return build_model(source.config, source.weights, source.quantization, "float32", None)


def test_engine_equals_mlx_lm_and_batches_equal_lone_inputs(tp1_model, reference):
    inputs = [[5, 6, 7, 8, 9], [11], list(range(20, 60)), [3, 4]]
    together = E.embed(tp1_model, inputs, ["lasttoken"] * len(inputs))
    assert together.shape == (4, 64) and together.dtype == np.float32
    for ids, row in zip(inputs, together):
        assert _cos(row, reference(ids)) >= 0.9999
        assert abs(np.linalg.norm(row) - 1) < 1e-5
        lone = E.embed(tp1_model, [ids], ["lasttoken"])[0]
        assert _cos(row, lone) >= 0.9999 and np.allclose(row, lone, atol=1e-5)
    # mean pooling reads only each input's own positions
    mean = E.embed(tp1_model, inputs[:2], ["mean", "mean"])
    h = np.array(tp1_model.hidden(mx.array([inputs[0]])))[0]
    assert _cos(mean[0], h.mean(0)) >= 0.9999


# -- the scheduler's embeds part, with a rank N in process ---------------------------------------
def test_scheduler_runs_concurrent_requests_in_one_plan_on_every_rank(tp1_model):
    from mlxcluster.control.follower import Follower
    from mlxcluster.control.link import RankGroup
    from mlxcluster.leader.scheduler import Scheduler

    executor = futures.ThreadPoolExecutor(1)
    try:
        group = RankGroup()
        follower = Follower(tp1_model, 1, 264, 512)
        link = InProcessRank(follower, group, executor)
        group.add(link)
        sched = Scheduler(tp1_model, group, 264, 512, executor, step_timeout_s=60, max_queue=4)
        runs = []
        real_run = E.run
        requests = [[[1, 2, 3]], [[4, 5], list(range(30, 50))], [[7]]]

        async def main():
            return await asyncio.gather(*(sched.embed(r) for r in requests))

        E.run = lambda model, inputs: (runs.append(len(inputs)), real_run(model, inputs))
        try:
            results = asyncio.run(main())
        finally:
            E.run = real_run
        for req, got in zip(requests, results):
            assert got.shape == (len(req), 64)
            for ids, row in zip(req, got):
                assert _cos(row, E.embed(tp1_model, [ids], ["lasttoken"])[0]) >= 0.9999
        # one plan carried every input of the three requests; rank N ran the same forward pass
        assert [len(f.step_plan.embeds) for f in link.frames] == [4] and runs == [4]
        assert sched.embedded_inputs == 4 and not sched._embed_jobs and sched.broken is None
        # bad input: refused before the queue
        for bad, words in [([], "no input"), ([[]], "empty"), ([[999]], "outside the vocabulary"),
                           ([[1] * 513], "more than the context")]:
            with pytest.raises(ValueError, match=words):
                asyncio.run(sched.embed(bad))
    finally:
        executor.shutdown(wait=True)


def test_a_plan_longer_than_the_budget_is_split_across_plans(tp1_model, monkeypatch):
    from mlxcluster.control.link import RankGroup
    from mlxcluster.leader import scheduler as S

    monkeypatch.setattr(S, "EMBED_TOKENS_PER_STEP", 8)
    executor = futures.ThreadPoolExecutor(1)
    try:
        sched = S.Scheduler(tp1_model, RankGroup(), 264, 512, executor, step_timeout_s=60)
        plans = []
        real = sched._run_embeds

        async def spy(plan):
            plans.append([len(job.inputs[i]) for job, i in plan.embeds])
            await real(plan)

        sched._run_embeds = spy
        inputs = [[1, 2, 3], [4, 5, 6], [7] * 12, [8]]
        got = asyncio.run(sched.embed(inputs))
        assert plans == [[3, 3], [12], [1]]  # padded tokens <= 8 per plan, at least one input
        for ids, row in zip(inputs, got):
            assert _cos(row, E.embed(tp1_model, [ids], ["lasttoken"])[0]) >= 0.9999
    finally:
        executor.shutdown(wait=True)


def test_embeds_beside_a_decoding_stream_at_world_size_one(tp1_model):
    """World size 1 decodes with lookahead: embeds run beside the queued step (they leave the batch
    and its KV caches as they are); the stream's tokens are its lone tokens, the embeddings right."""
    from mlxcluster.control.link import RankGroup
    from mlxcluster.leader.scheduler import Scheduler

    executor = futures.ThreadPoolExecutor(1)
    try:
        sched = Scheduler(tp1_model, RankGroup(), 264, 512, executor, step_timeout_s=60)
        assert sched.lookahead
        plans = []
        execute = sched._execute

        async def spy(plan):
            plans.append((len(plan.decode), len(plan.embeds)))
            await execute(plan)

        sched._execute = spy

        async def tokens():
            return [t async for t in sched.generate([5, 6, 7], 12)]

        async def both():
            stream = asyncio.ensure_future(tokens())
            vectors = [await sched.embed([[1, 2, 3], [9] * 7]) for _ in range(3)]  # plans between decode steps
            return await stream, vectors

        lone = asyncio.run(tokens())
        together, vectors = asyncio.run(both())
        assert together == lone and len(lone) == 12
        assert any(decode and embeds for decode, embeds in plans), plans  # embeds beside a lookahead step
        for got in vectors:
            for ids, row in zip([[1, 2, 3], [9] * 7], got):
                assert _cos(row, E.embed(tp1_model, [ids], ["lasttoken"])[0]) >= 0.9999
        assert sched.embedded_inputs == 6
    finally:
        executor.shutdown(wait=True)


def test_a_cancelled_request_runs_nothing_and_a_failed_group_ends_every_request(tp1_model):
    from mlxcluster.control.link import RankError, RankGroup
    from mlxcluster.leader.scheduler import Scheduler
    from mlxcluster.protocol.errors import QueueFullError

    executor = futures.ThreadPoolExecutor(1)
    try:
        sched = Scheduler(tp1_model, RankGroup(), 264, 512, executor, step_timeout_s=60, max_queue=1)

        async def cancelled():
            task = asyncio.ensure_future(sched.embed([[1, 2]]))
            await asyncio.sleep(0)  # the request is queued (the loop's task not run yet)
            assert len(sched._embed_waiting) == 1
            assert sched.queued == 1  # counted as waiting (/health, the dashboard, Info)
            with pytest.raises(QueueFullError):  # max_queue 1: one request may wait
                await sched.embed([[3]])
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not sched._embed_waiting and not sched._embed_jobs

        asyncio.run(cancelled())
        assert sched.embedded_inputs == 0

        group = RankGroup()

        class Refusing:  # a rank N that rejects every plan
            rank = 1

            def send(self, frame):
                group.deliver(fr.error_reply(1, pb.BAD_FRAME, "rank 1 says no", frame.step_plan.embeds[0].uid))

        group.add(Refusing())
        sched = Scheduler(tp1_model, group, 264, 512, executor, step_timeout_s=60)

        async def failed():
            return await asyncio.wait_for(asyncio.gather(sched.embed([[1]]), sched.embed([[2]]),
                                                         return_exceptions=True), 60)

        results = asyncio.run(failed())
        assert all(isinstance(r, RankError) and "rank 1 says no" in str(r) for r in results), results
        assert not sched._embed_jobs and sched.broken
    finally:
        executor.shutdown(wait=True)


def test_follower_checks_the_embeds_part():
    from mlxcluster.control.follower import Follower

    follower = Follower(SimpleNamespace(hidden=None), 1, 264, 16)  # nothing runs: every plan is refused first
    cases = [([fr.embed_entry("a", [1]), fr.embed_entry("a", [2])], pb.BAD_FRAME, "named twice"),
             ([fr.embed_entry("", [1])], pb.BAD_FRAME, "without a uid"),
             ([fr.embed_entry("a", [])], pb.BAD_FRAME, "no tokens"),
             ([fr.embed_entry("a", [264])], pb.BAD_TOKEN, "outside the vocabulary"),
             ([fr.embed_entry("a", [1] * 17)], pb.CONTEXT_OVERFLOW, "longer than the context")]
    follower.model = SimpleNamespace(hidden=lambda x: x)
    for embeds, code, words in cases:
        (reply,) = follower.handle_frame(fr.step_plan(embeds=embeds))
        assert not reply.ok and reply.code == code and words in reply.error
    follower.model = SimpleNamespace(local_decode=False, route=object())
    (reply,) = follower.handle_frame(fr.step_plan(embeds=[fr.embed_entry("a", [1])]))
    assert not reply.ok and "--layers" in reply.error
    assert "embed 2 inputs, 3 tokens" in fr.describe(fr.step_plan(embeds=[fr.embed_entry("a", [1]),
                                                                          fr.embed_entry("b", [2, 3])]))


# -- rank 0's Generation.Embed, with a fake scheduler --------------------------------------------
class _Aborted(Exception):
    pass


class _Context:
    """A grpc.aio servicer context that records ``abort``."""

    async def abort(self, code, details):
        self.code, self.details = code, details
        raise _Aborted(details)


def test_rank0_tokenises_checks_and_truncates(model_dir, tokenizer):
    from mlxcluster.leader.generation import GenerationServicer
    from mlxcluster.model.loader import ModelInfo

    class Sched:
        embeddings_unsupported = None
        calls = []

        async def embed(self, inputs, mode):
            self.calls.append((inputs, mode))
            return E.normalize(np.ones((len(inputs), 64), np.float32) + np.arange(64, dtype=np.float32))

    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    source = SimpleNamespace(path=model_dir, config=config, tokenizer=tokenizer,
                             context_length=ModelInfo(model_dir, "m", dict(config, max_position_embeddings=8),
                                                      None).context_length, metadata={})
    sched = Sched()
    service = GenerationServicer(sched, source, "ring", "float32")

    def call(*inputs, **kw):
        req = pb.EmbedRequest(inputs=[pb.EmbedInput(text=x) if isinstance(x, str) else pb.EmbedInput(token_ids=x)
                                      for x in inputs], **kw)
        ctx = _Context()
        try:
            return asyncio.run(service.Embed(req, ctx)), ctx
        except _Aborted:
            return None, ctx

    reply, _ = call("Hi", [5, 6, 7])
    assert sched.calls[-1] == ([tokenizer.encode("Hi"), [5, 6, 7]], "lasttoken")
    assert [e.tokens for e in reply.embeddings] == [2, 3] and reply.prompt_tokens == 5
    assert len(reply.embeddings[0].values) == 64
    reply, _ = call("Hi", dimensions=16)  # the model's config.json says is_matryoshka
    assert len(reply.embeddings[0].values) == 16 and abs(np.linalg.norm(reply.embeddings[0].values) - 1) < 1e-6
    reply, _ = call("ten chars!", truncate=True)
    assert sched.calls[-1][0] == [tokenizer.encode("ten chars!")[:8]] and reply.prompt_tokens == 8
    n = len(sched.calls)
    for args, kw, code, words in [
            (("ten chars!",), {}, grpc.StatusCode.INVALID_ARGUMENT, "input 0 has 10 tokens, more than"),
            (("a", ""), {}, grpc.StatusCode.INVALID_ARGUMENT, "input 1 is empty"),
            ((), {}, grpc.StatusCode.INVALID_ARGUMENT, "no input"),
            (("a",), {"dimensions": 65}, grpc.StatusCode.INVALID_ARGUMENT, "between 1 and 64")]:
        reply, ctx = call(*args, **kw)
        assert reply is None and ctx.code == code and words in ctx.details, ctx.details
    assert len(sched.calls) == n  # refused before the queue
    sched.embeddings_unsupported = "a pipeline (--layers) cannot compute embeddings (run a tensor-parallel group)"
    _, ctx = call("a")
    assert ctx.code == grpc.StatusCode.FAILED_PRECONDITION and "--layers" in ctx.details
    sched.embeddings_unsupported = None
    service.prefill_service = object()
    _, ctx = call("a")
    assert ctx.code == grpc.StatusCode.FAILED_PRECONDITION and "--role prefill" in ctx.details


# -- the HTTP codec, with a fake rank 0 ----------------------------------------------------------
class FakeRank0(pb_grpc.GenerationServicer):
    """Rank 0's ``Generation`` as the provider sees it: ``Embed`` answers input ``i`` with the unit
    vector of 4 floats ``[i+1, 0.5, -0.25, 1e-3]`` normalised and the input's length (a text's
    characters, ids' count) as its tokens, or fails as told."""

    def __init__(self):
        self.requests = []
        self.fail = None  # (grpc.StatusCode, details)
        self.fail_after = 0  # calls answered before ``fail`` applies

    def Info(self, request, context):
        return pb.InfoReply(model=NAME, world_size=1, backend="ring", context_length=512, vocab_size=264,
                            weight_format="float32", capacity=1, max_queue=4)

    def Embed(self, request, context):
        self.requests.append(request)
        if self.fail is not None and self.fail_after <= 0:
            context.abort(*self.fail)
        out = []
        for i, x in enumerate(request.inputs):
            v = np.array([i + 1, 0.5, -0.25, 1e-3], np.float32)
            out.append(pb.Embedding(values=(v / np.linalg.norm(v)).tolist(),
                                    tokens=len(x.token_ids) or len(x.text)))
        self.fail_after -= 1
        return pb.EmbedReply(embeddings=out, prompt_tokens=sum(e.tokens for e in out))


class _Server:
    """uvicorn serving ``create_app(provider)`` on a free loopback port, in a thread."""

    def __init__(self, provider):
        import socket

        import uvicorn

        from mlxcluster.front import create_app

        ready = threading.Event()
        self.provider = provider

        class _S(uvicorn.Server):
            async def startup(self, sockets=None):
                await super().startup(sockets=sockets)
                ready.set()

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = _S(uvicorn.Config(create_app(provider), log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        assert ready.wait(30) and self.server.started, "uvicorn did not start"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="module")
def fake(model_dir, tls):
    from mlxcluster.front import Provider

    rank0 = FakeRank0()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GenerationServicer_to_server(rank0, grpc_server)
    port = grpc_server.add_secure_port("127.0.0.1:0", tls.server())
    grpc_server.start()
    server = _Server(Provider(f"127.0.0.1:{port}", model_dir, NAME, tls))
    try:
        yield rank0, server
    finally:
        server.stop()
        grpc_server.stop(None)


def test_openai_client_float_and_base64(fake):
    import openai

    rank0, server = fake
    rank0.fail = None
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    plain = client.embeddings.create(model=NAME, input=["ab", "cde"], encoding_format="float")
    assert plain.object == "list" and plain.model == NAME and [d.index for d in plain.data] == [0, 1]
    assert plain.usage.prompt_tokens == 5 and plain.usage.total_tokens == 5
    assert rank0.requests[-1].inputs[1].text == "cde" and rank0.requests[-1].dimensions == 0
    assert not rank0.requests[-1].truncate
    # the client's default is base64 (little-endian float32), decoded by the client itself
    b64 = client.embeddings.create(model=NAME, input=[[1, 2, 3], [4]], dimensions=3)
    assert rank0.requests[-1].dimensions == 3 and list(rank0.requests[-1].inputs[0].token_ids) == [1, 2, 3]
    assert np.allclose(b64.data[0].embedding, plain.data[0].embedding) and b64.usage.prompt_tokens == 4
    import httpx

    raw = httpx.post(server.url + "/v1/embeddings", json={"input": "x", "encoding_format": "base64"}).json()
    assert isinstance(raw["data"][0]["embedding"], str) and raw["model"] == NAME


def test_openai_errors_are_400_in_openai_format(fake):
    import httpx

    rank0, server = fake
    rank0.fail = None
    n = len(rank0.requests)
    url = server.url + "/v1/embeddings"
    for body, param in [({"input": []}, "input"), ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": "a", "dimensions": 0}, "dimensions"), ({"input": "a", "dimensions": "8"}, "dimensions"),
                        ({"input": [[300]]}, "input"), ({"input": "a", "user": 5}, "user")]:
        r = httpx.post(url, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(url, json={"input": "a", "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert len(rank0.requests) == n  # all refused before rank 0
    for code, detail, status, param in [
            (grpc.StatusCode.FAILED_PRECONDITION, "embeddings: a pipeline (--layers) cannot compute embeddings",
             400, None),
            (grpc.StatusCode.INVALID_ARGUMENT, "'dimensions' 8 is not supported: ...", 400, "dimensions"),
            (grpc.StatusCode.INVALID_ARGUMENT, "input 0 has 600 tokens, more than the model's context", 400, "input"),
            (grpc.StatusCode.RESOURCE_EXHAUSTED, "4 embedding requests are already waiting", 429, None)]:
        rank0.fail = (code, detail)
        r = httpx.post(url, json={"input": "a"})
        err = r.json()["error"]
        assert r.status_code == status and err["param"] == param and detail[:20] in err["message"], r.text
    rank0.fail = None


def test_the_provider_itself_bounds_dimensions(fake):
    """Provider.embed checks its fields whoever calls it (the Ollama route, the HTTP route after its
    schema): a ``dimensions`` beyond uint32 is a 400, not a failed protobuf (500)."""
    rank0, server = fake
    n = len(rank0.requests)
    with pytest.raises(ProviderError) as err:
        asyncio.run(server.provider.embed({"input": "a", "dimensions": 2**40}))
    assert err.value.status == 400 and err.value.param == "dimensions" and len(rank0.requests) == n


def test_many_inputs_go_to_rank0_in_bounded_calls(fake):
    import httpx

    from mlxcluster.front.provider import EMBED_INPUTS_PER_CALL as N

    rank0, server = fake
    rank0.fail = None
    n = len(rank0.requests)
    texts = [f"t{i}" for i in range(2 * N + 2)]
    got = httpx.post(server.url + "/v1/embeddings", json={"input": texts, "encoding_format": "float"}).json()
    assert [len(r.inputs) for r in rank0.requests[n:]] == [N, N, 2]
    assert [d["index"] for d in got["data"]] == list(range(len(texts)))
    assert [r.text for req in rank0.requests[n:] for r in req.inputs] == texts
    assert got["usage"]["prompt_tokens"] == sum(len(t) for t in texts)
    rank0.fail, rank0.fail_after = (grpc.StatusCode.INVALID_ARGUMENT, "input 1 is empty: it has no tokens"), 1
    r = httpx.post(server.url + "/v1/embeddings", json={"input": texts})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"input {N + 1} is empty")
    rank0.fail, rank0.fail_after = None, 0


def test_ollama_embed_with_the_ollama_client(fake):
    import ollama

    rank0, server = fake
    rank0.fail = None
    client = ollama.Client(host=server.url)
    got = client.embed(model=NAME, input=["ab", "c"])
    assert got.model == NAME and len(got.embeddings) == 2 and got.prompt_eval_count == 3
    assert got.total_duration > 0 and rank0.requests[-1].truncate  # Ollama truncates by default
    client.embed(model=NAME + ":latest", input="abc", truncate=False, dimensions=2)
    assert not rank0.requests[-1].truncate and rank0.requests[-1].dimensions == 2
    assert client.embed(model=NAME, input=[]).embeddings == []
    with pytest.raises(ollama.ResponseError) as err:
        client.embed(model="other", input="a")
    assert err.value.status_code == 404 and "does not exist" in err.value.error
    rank0.fail = (grpc.StatusCode.FAILED_PRECONDITION, "embeddings: an attention-FFN split (--afd) cannot ...")
    with pytest.raises(ollama.ResponseError) as err:
        client.embed(model=NAME, input="a")
    assert err.value.status_code == 400 and "--afd" in err.value.error
    rank0.fail = None
    # Ollama's older endpoint (ollama.embeddings): one prompt, one vector -- /api/embed's first
    old = client.embeddings(model=NAME, prompt="ab")
    assert list(old.embedding) == list(client.embed(model=NAME, input="ab").embeddings[0])
    assert list(client.embeddings(model=NAME, prompt="").embedding) == []
    with pytest.raises(ollama.ResponseError) as err:
        client.embeddings(model="other", prompt="a")
    assert err.value.status_code == 404


# -- slow tier: TP=1 and TP=2 groups ------------------------------------------------------------
@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    """``served(n)``: a TP=``n`` group of the model with a provider and HTTP server, started on
    first use; one group at a time (the TP=1 checks run first, then TP=2's)."""
    from mlxcluster.front import Provider
    from mlxcluster.runtime.launcher import LocalCluster, mpirun_path

    running = {}

    def get(n):
        if n not in running:
            for cluster, server in running.values():
                server.stop()
                cluster.stop()
            running.clear()
            backend = "mpi" if mpirun_path() and n > 1 else "ring"
            cluster = LocalCluster(n, backend, model=model_dir, weights="float32", start_timeout_s=300).start()
            try:
                server = _Server(Provider(cluster.address, model_dir, NAME, cluster.credentials))
            except BaseException:
                cluster.stop()
                raise
            running[n] = (cluster, server)
        return running[n][1]

    yield get
    for cluster, server in running.values():
        server.stop()
        cluster.stop()


@slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_embeddings_equal_the_reference(world_size, served, reference, tokenizer):
    """Both endpoints at TP=``world_size``: every embedding is mlx-lm's (cosine >= 0.9999), the
    inputs of one request (different lengths, one forward pass) equal their lone embeddings, and
    Matryoshka ``dimensions`` truncate and renormalise."""
    import ollama
    import openai

    server = served(world_size)
    assert server.provider.world_size == world_size
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    ids = [tokenizer.encode(t, add_special_tokens=True) for t in TEXTS]
    assert len({len(x) for x in ids}) == len(ids)
    together = client.embeddings.create(model=NAME, input=TEXTS)
    assert together.usage.prompt_tokens == sum(len(x) for x in ids)
    for x, d in zip(ids, together.data):
        assert _cos(d.embedding, reference(x)) >= 0.9999
        lone = client.embeddings.create(model=NAME, input=[x], encoding_format="float").data[0].embedding
        assert _cos(d.embedding, lone) >= 0.9999
    short = client.embeddings.create(model=NAME, input=TEXTS[0], dimensions=16, encoding_format="float")
    want = reference(ids[0])[:16]
    assert len(short.data[0].embedding) == 16 and _cos(short.data[0].embedding, want) >= 0.9999
    assert abs(np.linalg.norm(short.data[0].embedding) - 1) < 1e-5
    got = ollama.Client(host=server.url, timeout=120).embed(model=NAME, input=TEXTS[1:])
    assert got.prompt_eval_count == sum(len(x) for x in ids[1:])
    for x, e in zip(ids[1:], got.embeddings):
        assert _cos(e, reference(x)) >= 0.9999
    with pytest.raises(openai.BadRequestError, match="more than the model's context"):
        client.embeddings.create(model=NAME, input=[[1] * 513])

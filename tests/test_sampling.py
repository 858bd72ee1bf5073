"""mlx-lm's sampler options (``top_k``, ``min_p``, ``repetition_penalty``) in mlxcluster's sampler, and
rank 0's check of a ``Sampling`` message (issue 28, defect 13) -- all in-process, fast tier.

The filters and the penalty on tiny logits (top_k keeps k, the min_p threshold, mlx-lm's order of
filters, the repetition penalty equal to mlx-lm's own processor over prompt + answer), seeded
determinism (token i drawn with the key of (seed, i)), neutral values changing nothing, the
penalty surviving a withdrawn lookahead step on a tiny random-weight model, and the gRPC
``Generation`` service refusing bad values with ``INVALID_ARGUMENT`` naming the field.
"""

import asyncio
import math
from types import SimpleNamespace

import grpc
import mlx.core as mx
import numpy as np
import pytest

from harness import interrupted_decode
from mlxcluster.engine.decode import RankEngine
from mlxcluster.engine.sampling import (REPETITION_CONTEXT_SIZE, LogitsProcessor, Sampling, make_token_sampler,
                                        sampling_of)
from mlxcluster.protocol import frames as fr
from mlxcluster.protocol.args import ArgumentError, check_args, from_request
from mlxcluster.protocol import mlxcluster_pb2 as pb


def _draws(sampler, logits, n=200):
    return [int(sampler(logits, i).item()) for i in range(n)]


def _logprobs(*probs):
    return mx.log(mx.array(probs, dtype=mx.float32))


def test_top_k_keeps_the_k_most_likely_tokens():
    logits = mx.array([0.0, 1.0, 2.0, 3.0, 4.0])
    assert set(_draws(make_token_sampler(1.0, 1.0, 7, top_k=2), logits)) == {3, 4}
    assert set(_draws(make_token_sampler(1.0, 1.0, 7, top_k=1), logits)) == {4}  # top_k 1 is greedy
    assert set(_draws(make_token_sampler(1.0, 1.0, 7), logits)) == {0, 1, 2, 3, 4}
    # k >= the vocabulary keeps everything (mlx-lm's apply_top_k would refuse it)
    assert set(_draws(make_token_sampler(1.0, 1.0, 7, top_k=5), logits)) == {0, 1, 2, 3, 4}


def test_min_p_keeps_tokens_above_its_share_of_the_most_likely():
    lp = _logprobs(0.5, 0.3, 0.15, 0.05)
    assert set(_draws(make_token_sampler(1.0, 1.0, 3, min_p=0.25), lp, 300)) == {0, 1, 2}  # >= 0.125
    assert set(_draws(make_token_sampler(1.0, 1.0, 3, min_p=0.5), lp, 300)) == {0, 1}      # >= 0.25
    assert set(_draws(make_token_sampler(1.0, 1.0, 3, min_p=1.0), lp, 50)) == {0}


def test_filters_run_in_mlx_lms_order_top_p_first():
    """make_sampler applies top_p before top_k.  Here top_p 0.5 first keeps {0, 1} (0.4 < 0.5),
    then top_k 2 keeps both; the other order (top_k, renormalise, top_p) would keep only {0}."""
    lp = _logprobs(0.4, 0.3, 0.2, 0.1)
    assert set(_draws(make_token_sampler(1.0, 0.5, 11, top_k=2), lp)) == {0, 1}


def test_seeded_sampling_draws_token_i_with_the_key_of_seed_and_i():
    logits = mx.array(np.random.default_rng(0).normal(size=64).astype(np.float32))
    a = make_token_sampler(0.9, 0.95, 1234, top_k=20, min_p=0.01)
    b = make_token_sampler(0.9, 0.95, 1234, top_k=20, min_p=0.01)
    forward = _draws(a, logits, 40)
    # another sampler, indices in another order (lookahead, batching): the same token per index
    assert [int(b(logits, i).item()) for i in reversed(range(40))] == forward[::-1]
    assert len(set(forward)) > 3  # it does sample
    assert _draws(make_token_sampler(0.9, 0.95, 99, top_k=20, min_p=0.01), logits, 40) != forward


def test_values_that_ask_for_nothing_change_nothing():
    logits = mx.array(np.random.default_rng(1).normal(size=50).astype(np.float32))
    plain = _draws(make_token_sampler(0.8, 1.0, 5), logits, 60)
    assert _draws(make_token_sampler(0.8, 1.0, 5, top_k=0, min_p=0.0), logits, 60) == plain
    assert not Sampling(top_k=0, min_p=0.0, repetition_penalty=1.0).processed
    assert not Sampling(repetition_penalty=1.3, repetition_context_size=0).processed  # a window of no tokens
    assert Sampling(repetition_penalty=1.3).processed
    assert make_token_sampler(0.0, 0.5, 1, top_k=3, min_p=0.2) is make_token_sampler(0.0, 1.0, 0)  # greedy


def test_repetition_penalty_equals_mlx_lms_over_prompt_and_answer():
    from mlx_lm.sample_utils import make_repetition_penalty

    logits = mx.array([1.0, -2.0, 3.0, -4.0, 5.0, 6.0])
    prompt = [1, 2, 3, 4]
    p = LogitsProcessor(Sampling(repetition_penalty=1.5, repetition_context_size=3), prompt)
    ref = make_repetition_penalty(1.5, 3)

    def want(tokens):
        return np.array(ref(mx.array(tokens), logits[None])[0])

    # the prompt's last 3 tokens (2, 3, 4): positive logits divided, negative ones multiplied
    assert np.allclose(np.array(p(logits)), [1.0, -2.0, 2.0, -6.0, 5.0 / 1.5, 6.0])
    assert np.allclose(np.array(p(logits)), want(prompt))
    p.record(5)
    assert np.allclose(np.array(p(logits)), want(prompt + [5]))  # window (3, 4, 5): 2 left it
    p.record(mx.array(0, dtype=mx.uint32))  # a lazy token (a lookahead step) ...
    assert np.allclose(np.array(p(logits)), want(prompt + [5, 0]))
    p.rollback()                            # ... withdrawn: as if never sampled
    assert np.allclose(np.array(p(logits)), want(prompt + [5]))


def test_processors_compose_in_mlx_lms_order():
    """bias, then repetition, then OpenAI's presence/frequency (make_logits_processors' order)."""
    s = Sampling(logit_bias=((0, 2.0),), repetition_penalty=2.0, repetition_context_size=4,
                 frequency_penalty=0.5, presence_penalty=0.25)
    p = LogitsProcessor(s, [0])
    logits = mx.array([1.0, 3.0, -1.0])
    # token 0: (1 + 2) / 2 = 1.5 (bias before the penalty); nothing generated yet
    assert np.allclose(np.array(p(logits)), [1.5, 3.0, -1.0])
    p.record(2)
    # token 2: -1 * 2 (repetition) - 0.5 - 0.25 (generated once)
    assert np.allclose(np.array(p(logits)), [1.5, 3.0, -2.75])


def test_sampling_message_round_trip_and_defaults():
    s = Sampling(0.5, 0.75, 3, ((1, 2.0),), 0.25, 0.5, False, 0, "", 5, 0.125, 1.25, 7)
    assert sampling_of(fr.sampling_message(s)) == s  # what ranks N and the prefill group receive
    assert sampling_of(fr.sampling_message(Sampling())) == Sampling()
    unset = sampling_of(pb.Sampling())
    assert (unset.top_k, unset.min_p, unset.repetition_penalty, unset.repetition_context_size) == \
        (0, 0.0, 1.0, REPETITION_CONTEXT_SIZE)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from mlxcluster.model.loader import read_model
    from mlxcluster.model.synthetic import write_model
    from mlxcluster.model.tp import build_model

    src = read_model(write_model("llama", str(tmp_path_factory.mktemp("m") / "m")))
    return build_model(src.config, src.weights, src.quantization, "float32")


def test_repetition_penalty_survives_a_withdrawn_lookahead_step(tiny_model):
    """A greedy penalised sequence decoding with lookahead, interrupted by another sequence's
    prefill (which withdraws the queued step), gives its lone answer; the penalty changes it."""
    s = Sampling(repetition_penalty=3.0, repetition_context_size=6)
    prompt = [5, 9, 100, 42, 17]

    lone = interrupted_decode(tiny_model, prompt, s, False)
    assert interrupted_decode(tiny_model, prompt, s, True) == lone
    assert lone != interrupted_decode(tiny_model, prompt, Sampling(), False)


def test_the_prompt_counts_for_the_repetition_penalty(tiny_model):
    """The first token's logits are penalised by the prompt's last tokens (mlx-lm's context is
    prompt + answer): a bias makes token 11 the greedy first token; a strong penalty with a window
    of one token takes it away when the prompt ends with 11, not when 11 is further back."""
    eng = RankEngine(tiny_model, 512)
    boost = ((11, 100.0),)

    def first(prompt, **kw):
        token = eng.prefill("u", prompt, Sampling(logit_bias=boost, **kw), [], 4)
        eng.remove("u")
        return token

    assert first([5, 9, 11]) == 11
    assert first([5, 9, 11], repetition_penalty=1e4, repetition_context_size=1) != 11
    assert first([5, 11, 9], repetition_penalty=1e4, repetition_context_size=1) == 11
    assert first([5, 11, 9], repetition_penalty=1e4, repetition_context_size=2) != 11


def test_a_penalised_greedy_sequence_does_not_take_the_compiled_step(tiny_model):
    eng = RankEngine(tiny_model, 512, compile_decode=True)
    plain = eng.admit("a", [1, 2, 3], Sampling(top_k=5, min_p=0.5), [], 8)  # greedy: filters do nothing
    pen = eng.admit("b", [1, 2, 3], Sampling(repetition_penalty=1.2), [], 8)
    assert plain.plain and plain.processor is None
    assert not pen.plain and pen.processor is not None
    assert tiny_model.compilable  # (llama: full attention)
    assert eng._compiled_path([plain]) and not eng._compiled_path([pen])


def test_the_prefill_group_samples_the_first_token_with_every_option(tiny_model):
    """PD: the prefill group (leader/pd.py PrefillService) samples the first token from the
    ``Sampling`` message the decode ranks send: the same first token as one rank's engine, for the
    repetition penalty over the prompt (taking a boosted token away) and for top_k 1 (greedy)."""
    from mlxcluster.leader.pd import PrefillService, _Job

    n_kv = int(tiny_model.args.num_key_value_heads)
    service = PrefillService(tiny_model, None, 10**6, 4096, lambda n: pb.ModelIdentity(), n_kv)

    class Loop:  # the MLX thread hands frames to the loop: here, straight into a list
        def call_soon_threadsafe(self, fn, frame):
            fn(frame)

    def pd_first(prompt, sampling):
        frames = []
        job = _Job("u", list(prompt), fr.sampling_message(sampling), 1, heads={0: (0, n_kv)},
                   queues={0: SimpleNamespace(put_nowait=frames.append)})
        service._run(job, Loop())
        return frames[-1].first_token

    def engine_first(prompt, sampling):
        eng = RankEngine(tiny_model, 512)
        return eng.prefill("u", prompt, sampling, [], 4)

    boost = ((11, 100.0),)
    cases = [([5, 9, 11], Sampling(logit_bias=boost)),
             ([5, 9, 11], Sampling(logit_bias=boost, repetition_penalty=1e4, repetition_context_size=1)),
             ([5, 9, 12], Sampling(temperature=1.0, top_k=1, seed=3)),
             ([5, 9, 12], Sampling(temperature=1.0, top_p=0.9, min_p=0.1, seed=3))]
    got = [pd_first(p, s) for p, s in cases]
    assert got == [engine_first(p, s) for p, s in cases]
    assert got[0] == 11 and got[1] != 11
    assert got[2] == engine_first([5, 9, 12], Sampling())  # top_k 1: the greedy token


# -- rank 0's check (defect 13) -----------------------------------------------------------

def check_sampling(msg: pb.Sampling, vocab_size: int = 0) -> None:
    """Rank 0's check of a request's ``Sampling`` message: the one check of its settings."""
    check_args(from_request(pb.GenerateRequest(sampling=msg)), vocab_size)


def _msg(**kw):
    bias = kw.pop("logit_bias", {})
    m = pb.Sampling(**kw)
    for k, v in bias.items():
        m.logit_bias[k] = v
    return m


BAD = [
    ("temperature", dict(temperature=math.nan)),
    ("temperature", dict(temperature=math.inf)),
    ("temperature", dict(temperature=-0.5)),
    ("top_p", dict(top_p=5.0)),
    ("top_p", dict(top_p=-0.1)),
    ("top_p", dict(top_p=math.nan)),
    ("top_k", dict(top_k=-1)),
    ("min_p", dict(min_p=1.5)),
    ("min_p", dict(min_p=-0.01)),
    ("min_p", dict(min_p=math.nan)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("repetition_penalty", dict(repetition_penalty=-1.0)),
    ("repetition_penalty", dict(repetition_penalty=math.inf)),
    ("repetition_penalty", dict(repetition_penalty=math.nan)),
    ("repetition_context_size", dict(repetition_context_size=-1)),
    ("presence_penalty", dict(presence_penalty=2.5)),
    ("frequency_penalty", dict(frequency_penalty=-3.0)),
    ("frequency_penalty", dict(frequency_penalty=math.nan)),
    ("logit_bias[3]", dict(logit_bias={3: 101.0})),
    ("logit_bias[3]", dict(logit_bias={3: math.nan})),
    ("logit_bias[3]", dict(logit_bias={3: -math.inf})),
    ("logit_bias", dict(logit_bias={-1: 1.0})),
    ("logit_bias", dict(logit_bias={1000: 1.0})),
    ("top_logprobs", dict(top_logprobs=21)),
    ("top_logprobs", dict(top_logprobs=-1)),
]


@pytest.mark.parametrize("field,kw", BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_check_sampling_refuses_bad_values_naming_the_field(field, kw):
    with pytest.raises(ArgumentError) as err:
        check_sampling(_msg(**kw), vocab_size=1000)
    assert err.value.path == field and "\n" not in str(err.value)


def test_check_sampling_accepts_defaults_and_bounds():
    for kw in [{}, dict(temperature=0.0, top_p=1.0), dict(temperature=2.0, top_p=0.01, top_k=40, min_p=1.0),
               dict(repetition_penalty=1.0, repetition_context_size=0), dict(repetition_penalty=0.5),
               dict(presence_penalty=-2.0, frequency_penalty=2.0, logit_bias={0: -100.0, 999: 100.0}),
               dict(top_logprobs=20, seed=2**64 - 1)]:
        check_sampling(_msg(**kw), vocab_size=1000)


class _FakeTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 50 for c in text]

    def decode(self, ids, **kw):
        return "".join(chr(97 + i % 26) for i in ids)


class _FakeScheduler:
    """Rank 0's scheduler as the servicer sees it: records the Sampling it is given, yields 2 tokens."""

    vocab_size, context_length = 50, 64

    def __init__(self):
        self.sampling = []

    def validate_prompt(self, ids):
        pass

    def generate(self, ids, max_tokens, eos, *, stats, sampling, logprobs):
        self.sampling.append(sampling)

        async def tokens():
            for t in (3, 4):
                yield t
            stats.reason = pb.MAX_TOKENS
        return tokens()


def test_generation_service_refuses_bad_sampling_with_invalid_argument(tls):
    """The real ``GenerationServicer`` on a ``grpc.aio`` server (loopback, mutual TLS) and the real
    ``GenerationClient``: a NaN temperature, ``top_p`` 5 and ``top_k`` -1 are ``INVALID_ARGUMENT``
    naming the field, before the scheduler sees them; good values reach it as the engine's
    :class:`Sampling` (the new fields included)."""
    from mlxcluster.leader.generation import ClientError, GenerationClient, GenerationServicer
    from mlxcluster.protocol import mlxcluster_pb2_grpc as pb_grpc

    sched = _FakeScheduler()
    source = SimpleNamespace(tokenizer=_FakeTokenizer(), eos_token_ids=[0], vocab_size=50)

    async def main():
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(GenerationServicer(sched, source, "none", "float32"), server)
        port = server.add_secure_port("127.0.0.1:0", tls.server())
        await server.start()
        client = GenerationClient(f"127.0.0.1:{port}", tls, timeout_s=30)
        try:
            def run():
                errors = []
                for kw in (dict(temperature=math.nan), dict(top_p=5.0), dict(top_k=-1), dict(min_p=2.0),
                           dict(repetition_penalty=0.0), dict(logit_bias={60: 1.0})):
                    try:
                        client.generate(prompt_ids=[1, 2], max_tokens=2, **kw)
                        errors.append(None)
                    except ClientError as exc:
                        errors.append((exc.code, str(exc)))
                ok = client.generate(prompt_ids=[1, 2], max_tokens=2, temperature=0.5, top_k=3, min_p=0.25,
                                     repetition_penalty=1.5, repetition_context_size=8, seed=9)
                return errors, ok
            return await asyncio.to_thread(run)
        finally:
            client.close()
            await server.stop(None)

    errors, ok = asyncio.run(main())
    fields = ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "logit_bias"]
    for field, got in zip(fields, errors):
        assert got is not None and got[0] == grpc.StatusCode.INVALID_ARGUMENT, (field, got)
        assert f"'{field}' " in got[1], got[1]  # check_args' message: the HTTP dialects' own (issue 44)
    assert ok.token_ids == [3, 4]
    assert sched.sampling == [Sampling(0.5, 1.0, 9, top_k=3, min_p=0.25, repetition_penalty=1.5,
                                       repetition_context_size=8)]



# -- the HTTP side: the OpenAI body fields (the contract the dialects map onto) -------------

@pytest.fixture
def http(tmp_path, tls):
    """The real provider and FastAPI app (in-process) before a fake rank 0 that records each
    request's ``Sampling`` and answers one token."""
    from harness import front_before
    from mlxcluster.protocol import mlxcluster_pb2_grpc as pb_grpc

    seen = []

    class Rank0(pb_grpc.GenerationServicer):
        def Info(self, request, context):
            return pb.InfoReply(model="tiny", world_size=1, backend="none", context_length=64, vocab_size=256,
                                weight_format="float32", capacity=1, max_queue=4, batch_limit=1)

        def Generate(self, request, context):
            seen.append(request.sampling)
            yield pb.GenerateEvent(started=pb.GenerateStarted(prompt_ids=request.prompt_ids))
            yield pb.GenerateEvent(token=pb.GeneratedToken(token_id=70, text="A"))
            yield pb.GenerateEvent(done=pb.GenerateDone(reason=pb.MAX_TOKENS, generated_tokens=1))

    with front_before(Rank0(), tmp_path, tls) as client:
        yield client, seen


def test_openai_body_sampler_options_reach_rank0(http):
    client, seen = http
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for body in (dict(chat, top_k=40, min_p=0.05, repetition_penalty=1.25, repetition_context_size=64),
                 {"model": "tiny", "prompt": "hi", "max_tokens": 1, "top_k": -1, "repetition_penalty": 1,
                  "min_p": 0},
                 dict(chat, top_k=10**12, repetition_context_size=10**12)):
        r = client.post("/v1/chat/completions" if "messages" in body else "/v1/completions", json=body)
        assert r.status_code == 200, r.text
    got = [sampling_of(m) for m in seen]
    assert (got[0].top_k, got[0].repetition_penalty, got[0].repetition_context_size) == (40, 1.25, 64)
    assert abs(got[0].min_p - 0.05) < 1e-6 and got[0].processed
    # -1 / 0 / 1: off, exactly as a request without them
    assert (got[1].top_k, got[1].min_p, got[1].repetition_penalty, got[1].repetition_context_size) == \
        (0, 0.0, 1.0, REPETITION_CONTEXT_SIZE) and not got[1].processed
    assert (got[2].top_k, got[2].repetition_context_size) == (256, 64)  # bounded by vocabulary / context
    for m in seen:
        check_sampling(m, 256)  # what the provider sends, rank 0 accepts


@pytest.mark.parametrize("field,value", [("top_k", -2), ("top_k", 2.5), ("top_k", "5"), ("min_p", 1.5),
                                         ("min_p", -0.1), ("repetition_penalty", 0), ("repetition_penalty", -1),
                                         ("repetition_context_size", -1), ("repetition_context_size", 1.5)])
def test_openai_body_sampler_options_are_checked(http, field, value):
    client, seen = http
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 1, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]
    assert not seen


# -- generate's flags ------------------------------------------------------------------------

@pytest.mark.parametrize("args,flag", [
    (["--temperature", "nan"], "--temperature"), (["--temperature", "-1"], "--temperature"),
    (["--top-p", "5"], "--top-p"), (["--top-p", "0"], "--top-p"), (["--top-k", "-3"], "--top-k"),
    (["--min-p", "1.5"], "--min-p"), (["--repetition-penalty", "0"], "--repetition-penalty"),
    (["--repetition-penalty", "inf"], "--repetition-penalty"), (["--seed", "-1"], "--seed"),
    (["--top-k", "x"], "--top-k"),
])
def test_generate_refuses_bad_sampling_flags_in_one_line(args, flag):
    """Checked before any rank starts: one line naming the flag, exit 2, no traceback."""
    from typer.testing import CliRunner

    from mlxcluster.cli import app

    r = CliRunner().invoke(app, ["generate", "hello", *args])
    assert r.exit_code == 2, r.output
    assert flag in r.output and "Traceback" not in r.output
    assert len([line for line in r.output.splitlines() if "error" in line.lower()]) == 1


def test_generate_takes_any_large_top_k(monkeypatch):
    """A K beyond the vocabulary keeps every token (as mlx_lm.server): not an error, and no
    'Value out of range' from the int32 message field."""
    import mlxcluster.cli as cli

    assert cli._sampling_options(0.5, 1.0, 10**12, 0.0, None, 1)["top_k"] == 2**31 - 1


def test_generate_reads_exactly_one_prompt_source(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import mlxcluster.cli as cli

    got = {}

    def read(prompt, prompt_file):
        got["prompt"] = real(prompt, prompt_file)
        raise cli.typer.Exit(0)  # stop before any rank starts

    real = cli._read_prompt
    monkeypatch.setattr(cli, "_read_prompt", read)
    runner = CliRunner()
    f = tmp_path / "p.txt"
    f.write_text("a long prompt\nfrom a file ✓", encoding="utf-8")
    assert runner.invoke(cli.app, ["generate", "--prompt-file", str(f)]).exit_code == 0
    assert got.pop("prompt") == "a long prompt\nfrom a file ✓"
    assert runner.invoke(cli.app, ["generate", "-"], input="from stdin\n").exit_code == 0
    assert got.pop("prompt") == "from stdin\n"
    assert runner.invoke(cli.app, ["generate", "plain"]).exit_code == 0
    assert got.pop("prompt") == "plain"
    for args in ([], ["x", "--prompt-file", str(f)], ["--prompt-file", str(tmp_path / "missing.txt")]):
        r = runner.invoke(cli.app, ["generate", *args])
        assert r.exit_code == 2 and "mlxcluster: error:" in r.output and "Traceback" not in r.output, r.output
        assert not got
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00bad")
    r = runner.invoke(cli.app, ["generate", "--prompt-file", str(bad)])
    assert r.exit_code == 2 and "cannot read the prompt" in r.output

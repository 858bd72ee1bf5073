"""OpenAI's logits processors: ``logit_bias``, ``presence_penalty``, ``frequency_penalty``.

The formula on plain arrays (fast), then on the real model (slow): a -100 bias on the greedy
token changes it, penalties change a temperature-0 answer, every answer is the same at TP=1
and TP=3 (rank 0 applies the processor; ranks N follow its tokens), and two
concurrent penalised requests equal their lone answers (a withdrawn lookahead step's token is
taken back out of the penalty counts).
"""

from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest

from harness import interrupted_decode
from mlxcluster.engine.sampling import LogitsProcessor, Sampling


def test_processor_applies_openais_formula_over_generated_tokens():
    p = LogitsProcessor(Sampling(logit_bias=((1, 5.0), (3, -100.0)), presence_penalty=0.5, frequency_penalty=0.25))
    logits = mx.array([1.0, 2.0, 3.0, 4.0])
    assert np.allclose(np.array(p(logits)), [1, 7, 3, -96])  # no token generated yet: bias only
    for t in (2, 2, 0):
        p.record(t)
    # counts = [1, 0, 2, 0]: mu - c * 0.25 - (c > 0) * 0.5 + bias
    assert np.allclose(np.array(p(logits)), [1 - 0.25 - 0.5, 7, 3 - 0.5 - 0.5, -96])
    p.record(mx.array(1))  # a lazy token (a lookahead step) ...
    p.rollback()           # ... withdrawn: as if never sampled
    assert np.allclose(np.array(p(logits)), [1 - 0.25 - 0.5, 7, 3 - 0.5 - 0.5, -96])


def test_neutral_sampling_has_no_processor():
    assert not Sampling().processed and not Sampling(presence_penalty=0.0, logit_bias=()).processed
    assert Sampling(logit_bias=((5, 1.0),)).processed and Sampling(frequency_penalty=0.1).processed


def test_withdrawn_lookahead_token_leaves_the_penalty_counts(tmp_path):
    """In one process on a tiny model: a sequence decoding with lookahead, interrupted by another
    sequence's prefill (which withdraws the queued step), gives its lone answer."""
    from mlxcluster.model.loader import read_model
    from mlxcluster.model.synthetic import write_model
    from mlxcluster.model.tp import build_model

    src = read_model(write_model("qwen3", str(tmp_path / "m")))
    model = build_model(src.config, src.weights, src.quantization, "float32")
    s = Sampling(frequency_penalty=2.0, presence_penalty=1.0)
    prompt = [5, 9, 100, 42, 17]

    lone = interrupted_decode(model, prompt, s, False)
    assert len(set(lone)) > 3  # the penalties spread the tokens
    assert interrupted_decode(model, prompt, s, True) == lone


PROMPT = "List the days of the week, then list them again, and again:"
N = 24


@pytest.fixture(scope="module")
def clusters(tp1_group, tp3_group):
    from mlxcluster.leader.generation import GenerationClient

    clients = [GenerationClient(c.address, c.credentials) for c in (tp1_group, tp3_group)]
    yield clients
    for c in clients:
        c.close()


def _all(clusters, *kws):
    """Each request (``kws``: its processors) sent to both groups at once, the requests to a group together
    (decoded as one batch: N steps, not N per request; batched greedy equals lone greedy,
    test_batched_prefill_real, and processors are per sequence -- the next check's concurrent requests
    equal their lone answers): each answer's token ids, the same at TP=1 and TP=3."""
    def group(client):
        with ThreadPoolExecutor(len(kws)) as pool:
            return list(pool.map(lambda kw: client.generate(PROMPT, max_tokens=N, temperature=0, **kw).token_ids, kws))

    with ThreadPoolExecutor(len(clusters)) as pool:
        a, b = pool.map(group, clusters)
    for kw, x, y in zip(kws, a, b):
        assert x == y, f"TP=3 differs from TP=1 with {kw}"
    return a


@pytest.mark.slow
def test_processors_change_greedy_answers_identically_at_tp1_and_tp3(clusters):
    """The plain answer, then the four processed ones (a -100 bias on its first token, a +100 bias on its
    second, a frequency penalty, a presence penalty) together, at TP=1 and TP=3 at once."""
    (plain,) = _all(clusters, {})
    assert len(plain) == N
    repeated = len(plain) - len(set(plain))
    assert repeated > 0  # the prompt asks for repetition: the penalties have something to act on
    banned, boosted, freq, pres = _all(clusters, dict(logit_bias={plain[0]: -100.0}),
                                       dict(logit_bias={plain[1]: 100.0}), dict(frequency_penalty=2.0),
                                       dict(presence_penalty=2.0))
    assert banned[0] != plain[0]
    assert boosted[0] == plain[1]
    assert freq != plain and pres != plain
    assert len(freq) - len(set(freq)) < repeated and len(pres) - len(set(pres)) < repeated


@pytest.mark.slow
def test_concurrent_penalised_requests_equal_their_lone_answers(clusters, real_model_path):
    """At TP=1 the scheduler decodes with lookahead; a second request arriving withdraws the
    queued step, whose token must leave the first request's penalty counts again."""
    from mlxcluster.leader.generation import GenerationClient

    one = clusters[0]
    kws = [dict(frequency_penalty=1.0), dict(presence_penalty=1.5, logit_bias={13: 3.0})]
    lone = [one.generate(PROMPT, max_tokens=N, temperature=0, **kw).token_ids for kw in kws]
    extra = GenerationClient(one.address, one.credentials)
    try:
        with ThreadPoolExecutor(1) as pool:
            first, later = [], None
            for event in one.stream(PROMPT, max_tokens=N, temperature=0, **kws[0]):
                if event.WhichOneof("event") == "token":
                    first.append(event.token.token_id)
                    if len(first) == 4:  # A is decoding (with lookahead): now B arrives and is prefilled
                        later = pool.submit(extra.generate, PROMPT, max_tokens=N, temperature=0, **kws[1])
            second = later.result(timeout=300)
    finally:
        extra.close()
    assert first == lone[0] and second.token_ids == lone[1]

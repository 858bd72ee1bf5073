"""Structured output and log-probabilities through the OpenAI API, on the real model at TP=1 and TP=3.

* ``response_format`` ``json_object`` / ``json_schema``: greedy answers that parse (and validate
  against the schema) where the same unconstrained prompt's answer does not parse;
* ``logprobs`` / ``top_logprobs`` (chat) and ``logprobs`` (completions): equal to
  ``log_softmax`` of reference logits computed here in-process, in OpenAI's shapes;
* every answer is the same at TP=1 and TP=3.

The grammar's mask and the matcher are plain functions tested fast at the top.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mlxcluster.engine.constraint import Constraint, GrammarError, json_grammar

MODEL = "smollm2"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 30},
                                           "color": {"type": "string", "enum": ["black", "white", "orange"]}},
          "required": ["name", "age", "color"], "additionalProperties": False}
PROMPT = "Describe a cat: its name, its age and its color."


# -- the grammar, as plain functions ------------------------------------------------------
def test_constraint_allows_only_the_grammars_tokens(real_model_path):
    from mlxcluster.model.loader import load_tokenizer

    tok, eos = load_tokenizer(real_model_path)
    c = Constraint(tok, json_grammar({"type": "object", "properties": {"a": {"type": "boolean"}},
                                      "required": ["a"], "additionalProperties": False}), eos)
    text = ""
    for _ in range(20):
        allowed = c.allowed(49152)
        ids = np.flatnonzero(allowed)
        assert len(ids) > 0
        if set(ids) <= set(eos):
            break
        token = int(ids[-1])  # the grammar, not a model, chooses
        c.consume(token)
        text += tok.decode([token])
    assert json.loads(text) in ({"a": True}, {"a": False})
    assert set(np.flatnonzero(c.allowed(49152))) <= set(eos)  # complete: only EOS is left


def test_bad_schema_is_a_grammar_error(real_model_path):
    from mlxcluster.engine.constraint import check_grammar
    from mlxcluster.model.loader import load_tokenizer

    tok, eos = load_tokenizer(real_model_path)
    check_grammar(json_grammar(SCHEMA), tok, 49152, eos)
    with pytest.raises(GrammarError, match="invalid grammar"):
        check_grammar(json_grammar({"type": "frobnicate"}), tok, 49152, eos)


# -- the real model through the API -------------------------------------------------------
@pytest.fixture(scope="module")
def clients(real_model_path, tp1_group, tp3_group):
    import openai

    from mlxcluster.front.provider import Provider
    from test_provider import Server

    one, three = tp1_group, tp3_group
    servers = [Server(Provider(c.address, real_model_path, MODEL, c.credentials)) for c in (one, three)]
    try:
        clients = [openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=300)
                   for s in servers]
        clients[0].cluster = one  # the test of logprobs reads the token ids from rank 0
        yield clients
    finally:
        for s in servers:
            s.stop()


def _both(clients, fn):
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(fn, clients)
    return a, b


def _chat(client, **kw):
    kw.setdefault("max_tokens", 60)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                          temperature=0, **kw)


@pytest.mark.slow
def test_json_modes_return_parseable_json_identically_at_tp1_and_tp3(clients):
    import jsonschema

    plain = _chat(clients[0]).choices[0].message.content
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain)  # without the constraint this prompt's answer is prose (or fenced JSON)
    a, b = _both(clients, lambda c: _chat(c, response_format={"type": "json_object"}))
    assert a.choices[0].message.content == b.choices[0].message.content
    assert isinstance(json.loads(a.choices[0].message.content), dict)
    assert a.choices[0].finish_reason == "stop"
    fmt = {"type": "json_schema", "json_schema": {"name": "cat", "schema": SCHEMA, "strict": True}}
    a, b = _both(clients, lambda c: _chat(c, response_format=fmt))
    assert a.choices[0].message.content == b.choices[0].message.content
    jsonschema.validate(json.loads(a.choices[0].message.content), SCHEMA)
    # streamed: the same text
    chunks = _chat(clients[1], response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == a.choices[0].message.content


@pytest.fixture(scope="module")
def reference(real_model_path):
    """``log_softmax`` of the real model's logits after a token sequence, in this process (TP=1, no scheduler)."""
    import mlx.core as mx

    from mlxcluster.model.loader import read_model
    from mlxcluster.model.tp import build_model

    src = read_model(real_model_path)
    model = build_model(src.config, src.weights, src.quantization, "float32")

    def logprobs(ids):
        logits = model(mx.array([ids], dtype=mx.int32))[0].astype(mx.float32)
        return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    return src.tokenizer, logprobs


@pytest.mark.slow
def test_logprobs_are_log_softmax_of_the_logits_identically_at_tp1_and_tp3(clients, reference):
    from mlxcluster.model.tokenizer import apply_chat

    from mlxcluster.leader.generation import GenerationClient

    tok, logprobs = reference
    a, b = _both(clients, lambda c: _chat(c, max_tokens=8, logprobs=True, top_logprobs=3))
    ca, cb = a.choices[0].logprobs.content, b.choices[0].logprobs.content
    assert len(ca) == len(cb) == a.usage.completion_tokens == 8
    prompt = apply_chat(tok, PROMPT, None)
    rank0 = GenerationClient(clients[0].cluster.address, clients[0].cluster.credentials)
    try:
        ids = rank0.generate(prompt_ids=prompt, max_tokens=8, temperature=0).token_ids
    finally:
        rank0.close()
    assert [tok.decode([t]) for t in ids] == [e.token for e in ca]
    ref = logprobs(prompt + ids)[len(prompt) - 1:]
    for i, (ea, eb) in enumerate(zip(ca, cb)):
        assert ea.token == eb.token and abs(ea.logprob - eb.logprob) < 2e-3
        assert abs(ea.logprob - ref[i][ids[i]]) < 2e-3
        assert ea.logprob == pytest.approx(float(ref[i].max()), abs=2e-3)  # greedy: the most likely token
        top = [t.logprob for t in ea.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True)
        assert np.allclose(top, np.sort(ref[i])[::-1][:3], atol=2e-3)
        assert ea.top_logprobs[0].token == ea.token and bytes(ea.bytes).decode() == ea.token
    assert "".join(e.token for e in ca) == a.choices[0].message.content
    # without logprobs: none
    assert _chat(clients[0], max_tokens=2).choices[0].logprobs is None


@pytest.mark.slow
def test_completions_logprobs_in_the_legacy_shape(clients):
    r = clients[0].completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                      logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(value, abs=1e-6) and value <= 0

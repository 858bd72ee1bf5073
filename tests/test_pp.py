"""Pipeline stages run one after another reproduce the whole model bit for bit.

Each stage is built from its own model instance (as each rank would), keeps only its layers,
and gets the previous stage's hidden states; its own KV caches cover its own layers.  Compared
with mlx-lm's whole-model forward pass (same weights, one KV cache per layer) over a chunked
prefill and greedy decode steps: the logits must be equal, not merely close.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlxcluster.model.layout import LayerRange, LayoutError, make_route, parse_layers
from mlxcluster.model.pp import PipelineStage
from mlxcluster.model.tp import build_model

# one split in the fast tier (three stages, the first holding the embeddings); the others in the full suite
SPLITS = [pytest.param("0:14,15:output", marks=pytest.mark.slow), pytest.param("15:output,0:14", marks=pytest.mark.slow),
          "0:3,4:20,21:output", pytest.param("25:output,0:9,10:17,18:24", marks=pytest.mark.slow)]


def _run(forwards, caches, prompt, chunk, steps):
    """Logits of a chunked prefill then ``steps`` greedy decode steps through ``forwards``
    (callables taking (inputs, cache) in flow order), as a list of float32 arrays."""
    out = []

    def forward(x):
        for fn, cache in zip(forwards, caches):
            x = fn(x, cache)
        mx.eval(x)
        return x

    for i in range(0, len(prompt), chunk):
        logits = forward(mx.array([prompt[i:i + chunk]], dtype=mx.int32))
    out.append(logits[:, -1])
    for _ in range(steps):
        token = mx.argmax(logits[:, -1], axis=-1)
        logits = forward(token[:, None].astype(mx.int32))
        out.append(logits[:, -1])
    return out


@pytest.fixture(scope="module")
def real(real_model_path):
    from mlxcluster.model.loader import read_model

    return read_model(real_model_path, tokenizer=False)  # (the stages run token ids: no tokenizer to build)


def _model(source):
    return build_model(source.config, dict(source.weights), source.quantization, "float32")


def _stage_model(source, layers):
    """The model a rank of stage ``layers`` builds: cut to its layers before loading (that this is
    the whole model cut after loading, bit for bit, is checked below)."""
    from mlxcluster.model.pp import prune_to_stage

    return build_model(source.config, dict(source.weights), source.quantization, "float32",
                       prepare=lambda m: prune_to_stage(m, layers))


# 4 tokens, prefilled in chunks of 2 (a chunk boundary inside: the second chunk, of more than one token,
# runs on a cache that holds the first), then 2 decode steps (the second on a cache a decode step
# extended): each token run costs ~0.12 s of CPU here, whole model or stages, and more of them prove
# nothing more
PROMPT = list(range(100, 104))
CHUNK, STEPS = 2, 2


@pytest.fixture(scope="module")
def whole(real):
    """The whole model, built once for the module (~0.5 s of CPU each): nothing here changes it (a
    stage is built from a model of its own)."""
    return _model(real)


@pytest.fixture(scope="module")
def whole_logits(real, whole):
    """mlx-lm's whole-model logits over the chunked prefill and the greedy decode steps (one run for
    every split)."""
    n = real.config["num_hidden_layers"]
    return _run([lambda x, c: whole(x, c)], [[KVCache() for _ in range(n)]], PROMPT, CHUNK, STEPS)


@pytest.mark.parametrize("spec", SPLITS)
def test_stages_in_flow_order_equal_the_whole_model_bitwise(real, whole_logits, spec):
    n = real.config["num_hidden_layers"]
    ref = whole_logits
    route = make_route(parse_layers(spec, n), n)
    stages = [PipelineStage(_stage_model(real, s.layers), s.layers) for s in route.flow()]
    assert sum(s.n_layers for s in stages) == n
    got = _run([lambda x, c, s=s: s(x, c) for s in stages], [[KVCache() for _ in range(s.n_layers)] for s in stages],
               PROMPT, CHUNK, STEPS)
    assert len(got) == len(ref) == STEPS + 1
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and mx.array_equal(a, b).item()


def test_a_stage_keeps_only_its_layers_and_what_it_runs(real, whole):
    n = real.config["num_hidden_layers"]
    whole_bytes = whole.parameter_bytes()
    middle = PipelineStage(_model(real), LayerRange(10, 17))
    assert middle.n_layers == 8 and middle.model.model.embed_tokens is None and middle.model.model.norm is None
    assert middle.model.parameter_bytes() < whole_bytes * 0.4
    last = PipelineStage(_model(real), LayerRange(25, n - 1, True))
    assert last.model.model.embed_tokens is not None  # tied head
    hidden = mx.zeros((1, 3, real.config["hidden_size"]))
    assert last(hidden).shape == (1, 3, real.config["vocab_size"])
    assert middle(hidden).shape == hidden.shape
    with pytest.raises(LayoutError):  # refused before anything of the (whole, unpruned) model is dropped
        PipelineStage(whole, LayerRange(25, n - 1, False))  # the last layer without the output
    assert whole.parameter_bytes() == whole_bytes


def test_a_stage_cut_before_loading_never_materialises_the_other_layers(real):
    """``build_model(prepare=prune_to_stage)`` (what a rank does): the same stage, bit for bit,
    at a fraction of the whole model's peak memory while loading."""
    from mlxcluster.model.pp import prune_to_stage

    r = LayerRange(10, 17)
    mx.eval(mx.zeros(1))
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    cut = build_model(real.config, dict(real.weights), real.quantization, "float32",
                      prepare=lambda m: prune_to_stage(m, r))
    cut_peak = mx.get_peak_memory() - base
    early = PipelineStage(cut, r)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    late = PipelineStage(_model(real), r)
    whole_peak = mx.get_peak_memory() - base
    assert early.n_layers == late.n_layers == 8
    assert early.model.parameter_bytes() == late.model.parameter_bytes()
    assert cut_peak < 0.6 * whole_peak, (cut_peak, whole_peak)
    hidden = mx.random.normal((1, 4, real.config["hidden_size"]), key=mx.random.key(0))
    assert mx.array_equal(early(hidden), late(hidden)).item()
    with pytest.raises(LayoutError, match="cut to layers 10:17"):
        PipelineStage(cut, LayerRange(0, 9))

"""The attention–FFN split as plain functions: who holds which layer, what each role keeps."""

import pytest

from mlxcluster.model.afd import FFN_RANK, parse_afd, prune_for_afd
from mlxcluster.model.tp import build_model

from tinymodel import tiny_llama


def test_layouts():
    one = parse_afd("1:1", 30)
    assert one.world_size == 2 and one.attention == (0,) and {one.owner(i) for i in range(30)} == {0}
    two = parse_afd("2:1", 30)
    assert two.world_size == 3 and two.attention == (0, 2)
    assert [two.owner(i) for i in (0, 14, 15, 29)] == [0, 0, 2, 2] and FFN_RANK == 1


@pytest.mark.parametrize("spec", ["3:1", "1:2", "0:1", "1", "a:1"])
def test_bad_specs(spec):
    with pytest.raises(ValueError, match="--afd"):
        parse_afd(spec, 30)


def test_each_role_keeps_only_its_modules():
    config, weights = tiny_llama(seed=2, num_hidden_layers=4)
    layout = parse_afd("2:1", 4)
    ffn = build_model(config, dict(weights), None, "float32", prepare=lambda m: prune_for_afd(m, layout, FFN_RANK))
    assert ffn.model.embed_tokens is None and all(b.self_attn is None and b.mlp is not None for b in ffn.model.layers)
    first = build_model(config, dict(weights), None, "float32", prepare=lambda m: prune_for_afd(m, layout, 0))
    assert len(first.model.layers) == 2 and all(b.mlp is None for b in first.model.layers)
    assert first.model.embed_tokens is not None and first.model.norm is not None
    second = build_model(config, dict(weights), None, "float32", prepare=lambda m: prune_for_afd(m, layout, 2))
    assert len(second.model.layers) == 2 and second.model.embed_tokens is None and second.model.norm is None
    whole = build_model(config, dict(weights), None, "float32").parameter_bytes()
    assert ffn.parameter_bytes() + first.parameter_bytes() + second.parameter_bytes() < whole + 1  # nothing twice

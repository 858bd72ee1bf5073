"""mlxcluster.model.topology: one typed Topology, its rules, its one serialisation and its rank grid
(in-process: no rank starts)."""

import dataclasses

import numpy as np
import pytest

from mlxcluster.model.topology import Topology, TopologyError

#: SmolLM2-135M's shape (the embedded model): 30 layers, 9 attention heads over 3 KV heads.
SMOL = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "vocab_size": 49152}
QWEN3 = dict(SMOL, model_type="qwen3", head_dim=64)


# one validated topology of every kind, and its world size
KINDS = [
    (Topology(), "tp", 1),
    (Topology(tp=3), "tp", 3),
    (Topology(layers="15:output,0:14"), "pipeline", 2),
    (Topology(layers="0:14,15:output", pp_logits="all_sum"), "pipeline", 2),
    (Topology(layers="0:9,10:19,20:output"), "pipeline", 3),
    (Topology(layers="0:14,15:output", stage_tp="3,1"), "pipeline", 4),
    (Topology(layers="15:output,0:14", local_decode=True), "pipeline", 2),
    (Topology(tp=3, layers="auto"), "pipeline", 3),
    (Topology(afd="1:1"), "afd", 2),
    (Topology(afd="2:1", afd_microbatches=2), "afd", 3),
    (Topology(role="prefill"), "prefill", 1),
    (Topology(tp=3, prefill_peer="127.0.0.1:5000"), "decode", 3),
]


@pytest.mark.parametrize("topology, kind, world", KINDS)
def test_every_kind_round_trips_through_the_rank_command_line(topology, kind, world):
    t = topology.validate(SMOL, weights="float32")
    assert t.kind == kind and t.world_size == world and t.tp == world
    assert t.validate(SMOL, weights="float32") == t  # canonical: validating again changes nothing
    # the rank's own parser (its other settings included) reads the same topology back
    from mlxcluster.config import Config
    from mlxcluster.runtime.rank import _parse
    from mlxcluster.runtime.rank_config import RankConfig
    from mlxcluster.runtime.supervisor import rank_command

    rc = RankConfig(world_size=world, ports=(1,) * world, max_queue=3, topology=dataclasses.replace(t, tp=None))
    assert _parse(rank_command(rc)[3:], Config()).group_topology() == t


def test_defaults_stay_off_the_command_line_and_auto_is_resolved():
    assert Topology().validate(SMOL).to_args() == []
    t = Topology(tp=1, layers=" auto ").validate(SMOL)  # --world-size 1 --layers auto: two stages
    assert (t.layers, t.stage_tp, t.world_size) == ("15:output,0:14", None, 2)
    assert t.to_args() == ["--layers", "15:output,0:14"]
    t = Topology(layers="0:14, 15:output", stage_tp="1,1").validate(SMOL)  # canonical text
    assert (t.layers, t.stage_tp) == ("0:14,15:output", None)
    assert Topology(tp=2, layers="0:14,15:output").world_size == 2  # given = the route's: kept


RULES = [
    (Topology(tp=0), "--world-size must be at least 1"),
    (Topology(role="decode"), "--role 'decode': choose tp or prefill"),
    (Topology(layers="0:14,15:output", pp_logits="gather"), "--pp-logits 'gather': choose relay or all_sum"),
    (Topology(afd_microbatches=2), "--afd-microbatches needs --afd"),
    (Topology(afd="1:1", layers="0:14,15:output"), "--afd excludes --layers and --local-decode"),
    (Topology(afd="1:1", local_decode=True), "--afd excludes --layers and --local-decode"),
    (Topology(afd="1:1", afd_microbatches=0), "--afd-microbatches must be at least 1"),
    (Topology(afd="3:1"), "1:1 and 2:1 are supported"),
    (Topology(afd="1:2"), "1:1 and 2:1 are supported"),
    (Topology(afd="a:b"), "write attention ranks:FFN ranks"),
    (Topology(tp=3, afd="1:1"), "--afd 1:1 needs 2 ranks, --world-size is 3"),
    (Topology(stage_tp="3,1"), "--stage-tp needs --layers"),
    (Topology(local_decode=True), "--local-decode needs --layers"),
    (Topology(pp_logits="all_sum"), "--pp-logits needs --layers"),
    (Topology(layers="0:14,15:29"), "write 15:output, not 15:29"),
    (Topology(layers="0:14,16:output"), "layers 15..15 are on no stage"),
    (Topology(layers="0:14,15:output", stage_tp="3"), "names 1 stage(s), --layers 2"),
    (Topology(layers="0:14,15:output", stage_tp="x,1"), "give one positive integer per stage"),
    (Topology(tp=3, layers="0:14,15:output"), "--world-size 3, but the route has 2 rank(s)"),
    (Topology(layers="0:14,15:output", local_decode=True), "needs rank 0 to own K:output"),
    (Topology(layers="15:output,0:14", stage_tp="1,3", local_decode=True), "single-rank stages"),
    (Topology(layers="0:14,15:output", stage_tp="2,1"), "world size 2 cannot split"),
    (Topology(role="prefill", prefill_peer="h:1"), "--role prefill and --prefill-peer exclude each other"),
    (Topology(role="prefill", tp=2), "--role prefill runs one rank"),
    (Topology(prefill_peer="h:1", layers="0:14,15:output"), "prefill/decode disaggregation runs tensor-parallel "
                                                             "groups: it excludes --layers"),
    (Topology(role="prefill", afd="1:1"), "it excludes --layers, --stage-tp, --local-decode and --afd"),
    (Topology(prefill_peer="nohost"), "--prefill-peer 'nohost': write HOST:PORT"),
    (Topology(prefill_peer="h:70000"), "write HOST:PORT"),
    (Topology(tp=2), "world size 2 cannot split the model (llama: 9 attention heads"),
]


@pytest.mark.parametrize("topology, message", RULES)
def test_each_rule_is_one_line(topology, message):
    with pytest.raises(TopologyError) as err:
        topology.validate(SMOL, weights="float32")
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("topology, what", [(Topology(layers="0:14,15:output"), "--layers"),
                                            (Topology(afd="1:1"), "--afd"),
                                            (Topology(role="prefill"), "--role prefill"),
                                            (Topology(prefill_peer="h:1"), "prefill/decode disaggregation")])
def test_pipelines_and_disaggregation_need_the_llama_family(topology, what):
    with pytest.raises(TopologyError) as err:
        topology.validate(QWEN3, name="qwen3")
    assert str(err.value) == (f"{what} supports Llama-family models only; qwen3 is qwen3 "
                              "(tensor parallelism, --world-size N, runs every architecture)")
    assert Topology(tp=3).validate(QWEN3).world_size == 3  # tensor parallelism runs every architecture


def test_the_group_must_have_the_topology_s_size():
    Topology(layers="0:14,15:output").check_group(2)
    with pytest.raises(TopologyError, match="the route needs 2 rank"):
        Topology(layers="0:14,15:output").check_group(1)
    with pytest.raises(TopologyError, match="--afd 2:1 needs 3 rank"):
        Topology(afd="2:1").check_group(2)


def test_the_grid_is_arange_reshaped_into_tensor_parallel_groups():
    t = Topology(layers="0:9,10:19,20:output", stage_tp="3,3,3").validate(SMOL)
    assert np.array_equal(np.array(t.grid()), np.arange(9).reshape(3, 3))
    assert [t.stage_of(r) for r in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert t.tp_ranks(1) == (3, 4, 5) and t.tp_rank(4) == 1
    uneven = Topology(layers="0:14,15:output", stage_tp="3,1")
    assert uneven.grid() == ((0, 1, 2), (3,))
    assert [uneven.stage_of(r) for r in range(4)] == [0, 0, 0, 1] and uneven.tp_ranks(1) == (3,)
    # the grid's stages are the route's: same ranks, same order
    route = uneven.route(30)
    assert tuple(s.ranks for s in route.stages) == uneven.grid()
    assert Topology(tp=3).grid() == ((0, 1, 2),)
    assert Topology(afd="2:1").grid() == ((0,), (1,), (2,))  # no tensor parallelism: each rank alone
    assert Topology(layers="auto", tp=4).grid() == ((0,), (1,), (2,), (3,))
    with pytest.raises(TopologyError, match="rank 4 is outside"):
        uneven.stage_of(4)
    with pytest.raises(TopologyError, match="stage 2 is outside"):
        uneven.tp_ranks(2)


def test_it_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Topology().tp = 2

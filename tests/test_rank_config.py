"""mlxcluster.runtime.rank_config: a rank's one configuration, its one wire form (JSON on the command
line or a standby's bootstrap line) and its checks; the rank's reading of it (in-process: no rank starts)."""

import dataclasses
import json

import pytest

from mlxcluster.config import Config
from mlxcluster.model.topology import Topology
from mlxcluster.runtime.rank import _parse, _resolved
from mlxcluster.runtime.rank_config import RankConfig, prompt_cache_refusal
from mlxcluster.runtime.supervisor import rank_command

#: a configuration with every field away from its default
FULL = RankConfig(world_size=2, ports=(5000, 5001), hosts=("10.0.0.1", "10.0.0.2"), bind="", backend="mpi",
                  model="/m/model.gguf", weights="float16", epoch="abc123", step_timeout=30.5, max_batch=3,
                  max_queue=0, itl_target_ms=25.0, compile=False, draft="remote:10.0.0.9:7000", draft_tokens=6,
                  prompt_cache_dir="/tmp/pc", prompt_cache_size="4GiB", prompt_cache_node=True, kv_bits=4,
                  kv_group_size=32,
                  topology=Topology(tp=2, layers="15:output,0:14", local_decode=True, pp_logits="all_sum"))


@pytest.mark.parametrize("config", [RankConfig(), FULL, dataclasses.replace(FULL, topology=Topology(afd="1:1",
                                    afd_microbatches=2)), RankConfig(topology=Topology(prefill_peer="h:1"))])
def test_round_trips_through_the_wire(config):
    wire = config.to_json()
    assert " " not in wire  # one command-line word
    assert RankConfig.from_json(wire) == config
    assert RankConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config  # the standby's line


def test_the_rank_reads_its_command_line_back():
    cmd = rank_command(FULL)
    assert cmd[1:4] == ["-m", "mlxcluster.runtime.rank", "--config"] and len(cmd) == 5
    assert _parse(cmd[3:], Config()) == FULL  # every field given: nothing resolved
    one = rank_command(RankConfig(ports=(1,), backend="ring"))
    assert RankConfig.from_json(one[-1]).backend == "any"  # world size 1 forms no group


def test_defaults_come_from_the_rank_processs_settings():
    rc = _parse(["--config", RankConfig(ports=(1,)).to_json()], Config(max_batch=5, max_queue=9, itl_target_ms=7))
    assert (rc.max_batch, rc.max_queue, rc.itl_target_ms, rc.compile) == (5, 9, 7.0, True)
    rc = _parse(["--config", RankConfig(ports=(1,), max_queue=2, compile=False).to_json()], Config(max_queue=9))
    assert (rc.max_queue, rc.compile) == (2, False)


def test_a_nodes_prompt_cache_is_a_default_an_explicit_one_wins():
    cfg = Config(prompt_cache_dir="/node", prompt_cache_size="1GiB")
    rc = _resolved(RankConfig(), cfg)
    assert (rc.prompt_cache_dir, rc.prompt_cache_size, rc.prompt_cache_node) == ("/node", "1GiB", True)
    rc = _resolved(RankConfig(prompt_cache_dir="/own"), cfg)
    assert (rc.prompt_cache_dir, rc.prompt_cache_node) == ("/own", False)
    assert not _resolved(RankConfig(), Config()).prompt_cache_dir


BAD = [
    ("[1]", "rank config: not a JSON object"),
    ("{", "rank config: not JSON"),
    ('{"world_size":1,"max_bach":3}', "rank config: unknown field 'max_bach'"),
    ('{"world_size":"2"}', "rank config: world_size must be an integer, got '2'"),
    ('{"world_size":true}', "rank config: world_size must be an integer, got True"),
    ('{"compile":1}', "rank config: compile must be true or false, got 1"),
    ('{"ports":[1,"2"]}', "rank config: ports must be a list of integers, got [1, '2']"),
    ('{"hosts":"a,b"}', "rank config: hosts must be a list of strings, got 'a,b'"),
    ('{"max_queue":1.5}', "rank config: max_queue must be an integer or null, got 1.5"),
    ('{"model":null,"weights":3}', "rank config: weights must be a string or null, got 3"),
    ('{"world_size":0}', "rank config: world_size must be at least 1"),
    ('{"backend":"tcp"}', "rank config: backend 'tcp': choose ring, mpi, jaccl, any"),
    ('{"kv_bits":3}', "rank config: kv_bits 3: choose 0, 4 or 8"),
    ('{"topology":[]}', "rank config: topology must be an object"),
    ('{"topology":{"layer":"0:1"}}', "rank config: unknown topology field 'layer'"),
    ('{"topology":{"local_decode":"yes"}}', "rank config: topology.local_decode must be true or false, got 'yes'"),
]


@pytest.mark.parametrize("wire, message", BAD)
def test_bad_input_is_one_line(wire, message):
    with pytest.raises(ValueError) as exc:
        RankConfig.from_json(wire)
    assert str(exc.value) == message


def test_the_rank_refuses_another_command_line_in_one_line():
    for argv in ([], ["--world-size", "1", "--ports", "1"], ["--config"]):
        with pytest.raises(ValueError, match=r"^usage: python -m mlxcluster.runtime.rank --config JSON"):
            _parse(argv, Config())


def test_addresses_pair_hosts_and_ports():
    assert RankConfig(world_size=2, ports=(1, 2)).addresses() == ("127.0.0.1:1", "127.0.0.1:2")
    assert FULL.addresses() == ("10.0.0.1:5000", "10.0.0.2:5001")
    with pytest.raises(ValueError, match="^need 3 ports and hosts, got 2 and 2$"):
        RankConfig(world_size=3, ports=(1, 2), hosts=("a", "b")).addresses()


def test_prompt_cache_refusal_reads_the_topology():
    assert prompt_cache_refusal(Topology(tp=3)) is None
    assert prompt_cache_refusal(Topology(layers="0:14,15:output", stage_tp="3,1")) is None
    assert prompt_cache_refusal(Topology(tp=2, prefill_peer="h:1")) is None  # a decode group keeps its own
    base = "--prompt-cache-dir serves tensor-parallel groups and pipelines, not "
    assert prompt_cache_refusal(Topology(layers="15:output,0:14", local_decode=True)) == base + "--local-decode"
    assert prompt_cache_refusal(Topology(afd="1:1")) == base + "--afd"
    assert prompt_cache_refusal(Topology(role="prefill")) == base + "--role prefill"
    assert prompt_cache_refusal(Topology(role="draft")) == base + "--role draft"


def test_launch_rank_is_read_by_config():
    assert Config.from_env({"MLX_RANK": "2"}).launch_rank == "2"
    assert Config.from_env({"OMPI_COMM_WORLD_RANK": "0"}).launch_rank == "0"
    assert Config.from_env({}).launch_rank is None

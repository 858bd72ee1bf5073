"""Pipeline routes (`--layers`, `--stage-tp`, `auto`): the pure parser and its one-line refusals."""

import pytest

from mlxcluster.model.layout import (
    LayerRange, LayoutError, auto_layers, make_route, parse_layers, parse_stage_tp)

N = 30  # the embedded model's layers


@pytest.mark.parametrize("spec, reverse", [
    ("0:14,15:output", False), ("15:output,0:14", True), ("0:3,4:20,21:output", False),
    ("25:output,0:9,10:17,18:24", True), ("0:output", True)])
def test_the_issue_s_routes_parse_and_print_back(spec, reverse):
    ranges = parse_layers(spec, N)
    route = make_route(ranges, N)
    assert route.spec() == spec and route.reverse is reverse
    assert sum(r.n_layers for r in ranges) == N
    flow = route.flow()
    assert flow[0].layers.start == 0 and flow[-1].layers.output  # hidden states start at layer 0, end at the head
    assert [s.layers.start for s in flow] == sorted(s.layers.start for s in flow)


def test_inclusive_ranges():
    a, b = parse_layers("0:14,15:output", N)
    assert (a.start, a.end, a.output, a.n_layers, a.embeds) == (0, 14, False, 15, True)
    assert (b.start, b.end, b.output, b.n_layers) == (15, 29, True, 15)


@pytest.mark.parametrize("spec, message", [
    ("", "--layers is empty"),
    ("0-14,15:output", "bad layer range '0-14'"),
    ("0:14,15:29", "write 15:output, not 15:29"),
    ("0:14,15:28", "no stage owns the output"),
    ("0:14,14:output", "layer ranges 0:14 and 14:output overlap (layers 14..14)"),
    ("0:13,15:output", "layers 14..14 are on no stage (between 0:13 and 15:output)"),
    ("1:14,15:output", "layers 0..0 are on no stage"),
    ("0:14,10:output,15:output", "2 stages claim the output"),
    ("0:31,15:output", "the model has layers 0..29"),
    ("0:14,30:output", "the model has layers 0..29"),
    ("9:3,0:8,10:output", "is empty: its end is before its start"),
    ("0:9,20:output,10:19", "stages must follow layer order in rank order"),
])
def test_bad_routes_are_refused_with_one_line(spec, message):
    with pytest.raises(LayoutError) as err:
        parse_layers(spec, N)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_stage_tp_places_ranks():
    route = make_route(parse_layers("0:14,15:output", N), N, parse_stage_tp("3,1", 2))
    assert route.world_size == 4
    assert [s.ranks for s in route.stages] == [(0, 1, 2), (3,)]
    assert route.stage_of(2).layers == LayerRange(0, 14) and route.stage_of(3).layers.output
    with pytest.raises(LayoutError):
        route.stage_of(4)
    assert parse_stage_tp(None, 3) == (1, 1, 1)
    for bad in ("3", "3,0", "a,b", "1,1,1"):
        with pytest.raises(LayoutError):
            parse_stage_tp(bad, 2)


def test_auto_splits_evenly_reverse_by_default_and_by_weight():
    assert make_route(auto_layers(N, 2), N).spec() == "15:output,0:14"
    assert make_route(auto_layers(N, 2, reverse=False), N).spec() == "0:14,15:output"
    assert make_route(auto_layers(N, 4), N).spec() == "23:output,0:7,8:15,16:22"
    # memory-weighted: a node with 3x the memory holds ~3x the layers
    ranges = auto_layers(N, 2, weights=[3.0, 1.0], reverse=False)
    assert [r.n_layers for r in ranges] == [22, 8]
    assert make_route(auto_layers(N, N), N).world_size == N  # one layer each
    for bad in (dict(n_stages=0), dict(n_stages=31), dict(n_stages=2, weights=[1.0, 0.0])):
        with pytest.raises(LayoutError):
            auto_layers(N, **bad)

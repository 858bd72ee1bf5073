"""The shape planner's cost model and choice (cluster/shape.py) as plain functions: no processes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mlxcluster.cluster import shape
from mlxcluster.cluster.shape import (
    LinkMeasure, Measurements, ModelProfile, NodeMeasure, Request, ShapeError, chosen, describe,
    measurements_from_json, plan_shape)

GB = 10**9

#: SmolLM2-135M's config (the embedded model): 30 layers, 9 heads, 3 KV heads.
SMOL = {"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "intermediate_size": 1536, "hidden_size": 576, "vocab_size": 49152, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "head_dim": 64}


def smol(**over) -> ModelProfile:
    return replace(ModelProfile.from_config(SMOL, name="smol"), **over)


def node(nid, mem=8 * GB, layer_ms=1.2, prefill=250.0, head_ms=10.0, layer_batch_ms=0.0, **kw) -> NodeMeasure:
    return NodeMeasure(nid, mem, layer_ms * 1e-3, prefill, layer_batch_s=layer_batch_ms * 1e-3,
                       head_s=head_ms * 1e-3, **kw)


def mesh(ids, lat=40e-6, bw=2e9, **slow) -> tuple:
    """A link per pair; ``slow={"b-c": (lat, bw)}`` overrides one."""
    out = []
    for i, a in enumerate(ids):
        for b in ids[i + 1:]:
            la, ba = slow.get(f"{a}-{b}", (lat, bw))
            out.append(LinkMeasure(a, b, la, ba, "en0"))
    return tuple(out)


def test_kv_bytes_per_token_from_the_config():
    m = smol()
    assert m.kv_bytes_per_token == 2 * 3 * 64 * 4 * 30  # 2 * KV heads * head_dim * float32 * layers
    # --kv-bits 8 in groups of 64: 64 one-byte codes + a float32 scale and bias per head and position
    # (12,960 bytes: what an 8-bit handoff carries, tests/test_kv_quant.py)
    assert ModelProfile.from_config(SMOL, kv_bits=8).kv_bytes_per_token == 2 * 3 * (64 + 2 * 4) * 30 == 12960
    assert ModelProfile.from_config(SMOL, kv_bits=4, kv_group_size=32).kv_bytes_per_token == 2 * 3 * (32 + 4 * 4) * 30


def test_memory_that_does_not_fit():
    # c's memory holds less than the model: c alone is refused with the figures, a alone is chosen
    nodes = (node("a"), node("b"), node("c", mem=int(0.2 * GB)))
    ranked = plan_shape(Measurements(nodes, mesh("abc"), {"mpi": 76.0}), smol(), Request(context=2048))
    c_alone = next(c for c in ranked if c.label == "c alone")
    assert c_alone.reason.startswith("does not fit: node c needs 0.6 GB, has 0.2 GB"), c_alone.reason
    assert not chosen(ranked).reason and "c" not in chosen(ranked).nodes
    # no node holds the model alone: a multi-node plan is chosen, every single node refused
    small = tuple(replace(n, memory_bytes=int(0.4 * GB)) for n in nodes[:2])
    ranked = plan_shape(Measurements(small, mesh("ab"), {"mpi": 76.0}), smol(), Request(context=2048))
    assert all(c.reason.startswith("does not fit") for c in ranked if c.kind == "single")
    assert len(chosen(ranked).nodes) == 2


def test_a_slow_link_makes_tp_lose_to_one_node():
    # three machines of their own: over fast links TP=3 wins; one slow link (b-c, 12 MB/s, 5 ms) bounds it
    nodes = tuple(node(n, layer_ms=3.0, head_ms=20.0) for n in "abc")
    fast = plan_shape(Measurements(nodes, mesh("abc", lat=20e-6, bw=10e9), {"mpi": 30.0}), smol(),
                      Request(context=2048))
    assert chosen(fast).label == "TP=3 on a,b,c"
    slow = plan_shape(Measurements(nodes, mesh("abc", lat=20e-6, bw=10e9, **{"b-c": (5e-3, 12e6)}),
                                   {"mpi": 30.0}), smol(), Request(context=2048))
    assert chosen(slow).kind == "single"
    tp3 = next(c for c in slow if c.label == "TP=3 on a,b,c")
    assert tp3.reason == "slower than a alone"
    assert tp3.note == "link b-c 12 MB/s"
    assert tp3.prediction.decode_tok_s < chosen(slow).prediction.decode_tok_s


def test_never_slower_than_the_fastest_single_node():
    nodes = (node("a", layer_ms=0.5), node("b"), node("c"))
    ranked = plan_shape(Measurements(nodes, mesh("abc"), {"ring": 4000.0}), smol(), Request(context=2048))
    best_single = max((c for c in ranked if c.kind == "single"), key=lambda c: c.prediction.decode_tok_s)
    assert chosen(ranked).prediction.decode_tok_s >= best_single.prediction.decode_tok_s
    for c in ranked:
        if c.kind != "single" and c.prediction and c.prediction.decode_tok_s < best_single.prediction.decode_tok_s:
            assert c.reason in ("slower than a alone",) or c.reason.startswith("does not fit"), c


def _pipeline_ranges(cand):
    """{node: layers it holds} of a pipeline candidate."""
    route = cand.topology.route(30)
    return {cand.nodes[s.first_rank]: s.layers.n_layers for s in route.stages}


def test_uneven_split_by_speed():
    # neither node holds the model alone; b is 3x slower, so it gets fewer layers than a
    nodes = (node("a", mem=int(0.4 * GB)), node("b", mem=int(0.4 * GB), layer_ms=3.6))
    ranked = plan_shape(Measurements(nodes, mesh("ab"), {"ring": 4000.0}), smol(), Request(context=2048))
    best = chosen(ranked)
    assert best.kind == "pipeline", describe(ranked)
    layers = _pipeline_ranges(best)
    assert sum(layers.values()) == 30 and layers["b"] < layers["a"], layers


def test_uneven_split_by_memory():
    # equal speed, b has little memory: it holds only what fits (the even 15 would not)
    nodes = (node("a", mem=int(0.6 * GB)), node("b", mem=int(0.2 * GB)))
    m = smol()
    ranked = plan_shape(Measurements(nodes, mesh("ab"), {"ring": 4000.0}), m, Request(context=2048))
    best = chosen(ranked)
    assert best.kind == "pipeline", describe(ranked)
    layers = _pipeline_ranges(best)
    assert layers["b"] < 15 and layers["a"] > 15, layers
    assert all(need <= next(n.memory_bytes for n in nodes if n.node_id == nid) for nid, need in best.prediction.memory)


def test_context_too_long_for_every_plan_is_one_line():
    nodes = (node("a", mem=1 * GB), node("b", mem=1 * GB))
    big = smol(max_positions=10**7)
    with pytest.raises(ShapeError) as err:
        plan_shape(Measurements(nodes, mesh("ab"), {"mpi": 76.0}), big, Request(context=200_000))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("context 200000 tokens is too long for every plan"), msg
    assert "46080 bytes per token" in msg and "the longest any plan holds is" in msg
    longest = int(msg.rsplit(" ", 2)[-2])
    plan_shape(Measurements(nodes, mesh("ab"), {"mpi": 76.0}), big, Request(context=longest))  # fits
    # beyond the model's positions
    with pytest.raises(ShapeError, match=r"^context 9000 tokens is beyond smol's 8192 positions$"):
        plan_shape(Measurements(nodes, mesh("ab"), {"mpi": 76.0}), smol(), Request(context=9000))


def test_the_optimize_targets_choose_differently():
    # a: the fastest decode; b: the fastest prefill; c: the cheapest extra sequence in a batch
    nodes = (node("a", layer_ms=1.0, prefill=100.0, layer_batch_ms=1.0),
             node("b", layer_ms=2.0, prefill=1000.0, layer_batch_ms=1.0),
             node("c", layer_ms=1.5, prefill=100.0, layer_batch_ms=0.05))
    m = Measurements(nodes, mesh("abc"), {"ring": 4000.0})
    picks = {t: chosen(plan_shape(m, smol(), Request(context=1024, optimize=t))).label
             for t in ("decode", "throughput", "ttft")}
    assert picks["decode"] == "a alone"
    assert picks["throughput"] == "c alone"
    assert picks["ttft"] in ("b alone", "PD prefill b, decode a alone"), picks


def test_pd_takes_the_fastest_prefill_node():
    nodes = (node("a", layer_ms=1.0, prefill=100.0), node("b", layer_ms=2.0, prefill=1000.0))
    ranked = plan_shape(Measurements(nodes, mesh("ab", bw=10e9), {"ring": 4000.0}), smol(), Request(context=1024))
    pd = next(c for c in ranked if c.kind == "pd")
    assert pd.label == "PD prefill b, decode a alone"
    a_alone = next(c for c in ranked if c.label == "a alone")
    assert pd.prediction.decode_s == a_alone.prediction.decode_s
    assert pd.prediction.ttft_s < a_alone.prediction.ttft_s / 5


def test_tp_sizes_that_do_not_split_the_heads_are_refused():
    nodes = tuple(node(n) for n in "abcd")
    ranked = plan_shape(Measurements(nodes, mesh("abcd"), {"mpi": 76.0}), smol(), Request(context=1024))
    refused = {c.label: c.reason for c in ranked if c.kind == "tp" and c.prediction is None}
    assert set(refused) == {"TP=2", "TP=4"}
    assert "world size 2 cannot split smol" in refused["TP=2"] and "3 KV heads" in refused["TP=2"]
    assert all(len(c.nodes) in (1, 3) for c in ranked if c.kind == "tp" and c.prediction is not None)
    assert {len(c.nodes) for c in ranked if c.kind == "tp" and c.prediction} == {3}
    # a model whose heads split in two gets TP=2 and TP x PP candidates (MPI splits groups)
    four = dict(SMOL, num_attention_heads=8, num_key_value_heads=4, head_dim=72)
    ranked = plan_shape(Measurements(nodes[:3], mesh("abc"), {"mpi": 76.0}),
                        ModelProfile.from_config(four, name="four"), Request(context=1024))
    assert any(c.label.startswith("TP=2 on") and c.prediction for c in ranked)
    assert any(c.kind == "tp_pp" and c.prediction and " x" in c.label for c in ranked), describe(ranked)


def test_this_machine_calibration_orders_tp1_mpi_ring():
    """On this 2-core machine (BENCHMARKS.md): TP=1 ~21.5 tok/s, TP=3 over MPI 11.7 (all_sum 76 us),
    over the ring 2.1 (all_sum ~4 ms); three nodes on one host."""
    nodes = tuple(node(n, layer_ms=1.2, head_ms=10.0, host="this") for n in "abc")
    links = mesh("abc", lat=40e-6, bw=2e9)
    got = {}
    for backend, us in (("mpi", 76.0), ("ring", 4000.0)):
        ranked = plan_shape(Measurements(nodes, links, {backend: us}), smol(), Request(context=2048))
        got["tp1"] = next(c for c in ranked if c.label == "a alone").prediction.decode_tok_s
        got[backend] = next(c for c in ranked if c.label == "TP=3 on a,b,c").prediction.decode_tok_s
        assert chosen(ranked).kind == "single"
    assert got["tp1"] > got["mpi"] > got["ring"], got
    assert got["tp1"] == pytest.approx(21.5, rel=0.3)
    assert got["mpi"] == pytest.approx(11.7, rel=0.3)
    assert got["ring"] == pytest.approx(2.1, rel=0.5)  # 3.0 predicted: the ring's spinners cost more


def test_host_sharing_is_what_slows_tp_on_one_machine():
    nodes = tuple(node(n) for n in "abc")
    on_one = tuple(replace(n, host="this") for n in nodes)
    args = (mesh("abc"), {"mpi": 76.0})
    apart = plan_shape(Measurements(nodes, *args), smol(), Request(context=2048))
    shared = plan_shape(Measurements(on_one, *args), smol(), Request(context=2048))
    tp = lambda r: next(c for c in r if c.label == "TP=3 on a,b,c").prediction.decode_tok_s  # noqa: E731
    assert tp(apart) > 2 * tp(shared)
    assert shape.host_slowdown(1) == 1.0 and shape.host_slowdown(3, prefill=True) == 3.0


def test_all_sum_is_bounded_by_the_slowest_link():
    assert shape.all_sum_s(2304, 1, 76.0, 1e-3, 1e9) == 0.0
    fast = shape.all_sum_s(2304, 3, 76.0, 20e-6, 10e9, "mpi")
    assert fast == pytest.approx(76e-6 + 4 / 3 * 2304 / 10e9)
    assert shape.all_sum_s(2304, 3, 76.0, 5e-3, 10e9, "mpi") == pytest.approx(2 * 5e-3 + 4 / 3 * 2304 / 10e9)
    assert shape.all_sum_s(2304, 3, None, 5e-3, 10e9, "ring") == pytest.approx(4 * 5e-3 + 4 / 3 * 2304 / 10e9)


def test_describe_marks_the_chosen_plan():
    nodes = tuple(node(n, layer_ms=3.0, head_ms=20.0) for n in "abc")
    m = Measurements(nodes, mesh("abc", lat=20e-6, bw=10e9, **{"b-c": (5e-3, 12e6)}), {"mpi": 30.0})
    lines = describe(plan_shape(m, smol(), Request(context=2048)))
    assert lines[0].startswith("* a alone: ") and " tok/s (" in lines[0]
    assert sum(line.startswith("*") for line in lines) == 1
    tp = next(line for line in lines if "TP=3 on a,b,c over mpi: " in line)
    assert "[link b-c 12 MB/s] -- slower than a alone" in tp
    assert len(describe(plan_shape(m, smol(), Request(context=2048)), limit=2)) == 3


@pytest.mark.parametrize("doc, needle", [
    ([], "expected a JSON object"),
    ({"nodes": []}, "non-empty list"),
    ({"nodes": [{"node_id": "a"}]}, "nodes[0]: missing"),
    ({"nodes": [{"node_id": "a", "memory_bytes": 1, "layer_s": "x", "prefill_tokens_per_s": 1}]},
     "layer_s must be a non-negative number"),
    ({"nodes": [{"node_id": "a", "memory_bytes": 1, "layer_s": 1, "prefill_tokens_per_s": 1, "ram": 2}]},
     "unknown field 'ram'"),
    ({"nodes": [{"node_id": "a", "memory_bytes": 1, "layer_s": 1, "prefill_tokens_per_s": 1}],
      "links": [{"a": "a", "b": "z", "latency_s": 0, "bandwidth_bytes_per_s": 1}]}, "not a pair of measured nodes"),
    ({"nodes": [{"node_id": "a", "memory_bytes": 1, "layer_s": 1, "prefill_tokens_per_s": 1}],
      "all_sum_us": {"mpi": -1}}, "all_sum_us"),
])
def test_bad_measurements_are_one_line(doc, needle):
    with pytest.raises(ShapeError) as err:
        measurements_from_json(doc)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_measured_tp_layer_sets_the_all_sum_a_step_pays():
    """Under a CPU quota the bare all_sum probe reads the collective back to back (12 ms: each call
    waits out a throttled peer's period) while a decode step's all_sums, with compute between, cost
    less; the other way round on a machine whose ranks wait for a slow one.  A TP formation's measured
    layer (a rank's share + two all_sums) fixes the in-step all_sum, so that formation is predicted at
    its measured layer time, and another TP set of the backend pays the same per all_sum."""
    nodes = (node("a", layer_ms=5.4, head_ms=0), node("b", layer_ms=5.4, head_ms=0), node("c", layer_ms=6.0, head_ms=0),
             node("d", layer_ms=5.4, head_ms=0))
    t = shape.TpLayerMeasure("mpi", ("a", "b", "c"), 9e-3)
    m = Measurements(nodes[:3], mesh("abc"), {"mpi": 12_000.0}, (t,))
    assert shape.in_step_all_sum_s(m, "mpi") == pytest.approx((9e-3 - 6.0e-3 / 3) / 2)  # slowest rank's share
    assert shape.in_step_all_sum_s(m, "ring") is None
    assert shape.in_step_all_sum_s(replace(m, nodes=nodes[:2]), "mpi") is None  # c not measured

    def tp3(meas):
        return next(c for c in plan_shape(meas, smol(), Request(context=2048)) if c.label == "TP=3 on a,b,c")

    with_layer, bare = tp3(m), tp3(replace(m, tp_layers=()))
    steps = 30 * 9e-3  # the measured layer, 30 times
    assert with_layer.prediction.decode_s == pytest.approx(steps, rel=0.06)  # + the head's gather and the frame
    assert bare.prediction.decode_s > 2.5 * steps  # the bare probe's 12 ms x 61
    # a layer measured slower than the model's compute share: the all_sum costs nothing, never less
    assert shape.in_step_all_sum_s(replace(m, tp_layers=(replace(t, layer_s=1e-3),)), "mpi") == 0.0
    # several formations: the largest one's
    two = shape.TpLayerMeasure("mpi", ("a", "b"), 4e-3)
    assert shape.in_step_all_sum_s(replace(m, tp_layers=(two, t)), "mpi") == pytest.approx((9e-3 - 2e-3) / 2)

    # prefill: a 128-token layer measured at 80 ms (a throttled peer waited out per all_sum) against a
    # share of 128 / (3 x 30 x 250 tok/s) = 5.7 ms: the TTFT of a 128-token prompt is its 30 layers
    pf = replace(t, prefill_layer_s=80e-3, prefill_tokens=128)
    mp = replace(m, tp_layers=(pf,))
    act = 576 * 4
    want = (80e-3 - 128 / (3 * 30 * 250.0)) / 2 - 2 * 2 / 3 * 128 * act / 2e9
    assert shape.in_step_all_sum_s(mp, "mpi", act, 30) == pytest.approx(want)
    assert shape.in_step_all_sum_s(m, "mpi", act, 30) is None  # decode only: prefill keeps the bare probe

    def tp3_ttft(meas):
        req = Request(context=2048, prompt_tokens=128)
        return next(c for c in plan_shape(meas, smol(), req) if c.label == "TP=3 on a,b,c").prediction.ttft_s

    assert tp3_ttft(mp) == pytest.approx(30 * 80e-3, rel=0.06)
    assert tp3_ttft(m) < 0.6 * tp3_ttft(mp)


def test_measurements_round_trip_from_json():
    doc = {"nodes": [{"node_id": "a", "memory_bytes": 8 * GB, "layer_s": 1e-3, "prefill_tokens_per_s": 200,
                      "chip": "Apple M2"}],
           "links": [], "all_sum_us": {"mpi": 76}}
    m = measurements_from_json(doc)
    assert m.nodes[0] == NodeMeasure("a", 8 * GB, 1e-3, 200, chip="Apple M2") and m.all_sum_us == {"mpi": 76.0}
    doc["nodes"].append(dict(doc["nodes"][0], node_id="b"))
    doc["tp_layers"] = [{"backend": "mpi", "nodes": ["a", "b"], "layer_s": 2e-3},
                        {"backend": "ring", "nodes": ["b", "a"], "layer_s": 3e-3, "prefill_layer_s": 0.05,
                         "prefill_tokens": 128}]
    assert measurements_from_json(doc).tp_layers == (shape.TpLayerMeasure("mpi", ("a", "b"), 2e-3),
                                                     shape.TpLayerMeasure("ring", ("b", "a"), 3e-3, 0.05, 128))
    for bad in ({"backend": "mpi", "nodes": ["a", "z"], "layer_s": 2e-3}, {"backend": "mpi", "nodes": ["a", "b"]},
                {"backend": "mpi", "nodes": ["a", "b"], "layer_s": -1},
                {"backend": "mpi", "nodes": ["a", "b"], "layer_s": 1, "prefill_tokens": 1.5},
                {"backend": "mpi", "nodes": ["a", "b"], "layer_s": 1, "extra": 1}):
        with pytest.raises(ShapeError, match=r"tp_layers\[0\]"):
            measurements_from_json(dict(doc, tp_layers=[bad]))


# -- join --plan auto: the shape chosen by measurement (issue 31) -----------------------------

# (here rather than in test_plan.py: the shape planner validates topologies with the model classes,
# whose import this module pays already)

from dataclasses import replace as _replace  # noqa: E402

from test_plan import NOW, check, formation, info, live, peers  # noqa: E402  (PlanInputs helpers)

from mlxcluster.cluster.membership import Peer, PeerReport, PeerStatus, Running  # noqa: E402
from mlxcluster.cluster.plan import MEASURE_WAIT_S, AutoInputs, Form, Teardown, Wait, auto_choice, predicted_for  # noqa: E402

_PROFILE = ModelProfile.from_config(SMOL, name="smol")


def _auto(ids="abc", host="", pending=(), mem=None, layer_ms=None, bw=2e9, sums=None) -> AutoInputs:
    """Measurements of nodes ``ids``: equal by default; ``host`` "" puts each on its own machine."""
    mem, layer_ms = mem or {}, layer_ms or {}
    nodes = tuple(NodeMeasure(n, mem.get(n, 8 * GB), layer_ms.get(n, 1.2) * 1e-3, 250.0, head_s=0.01, host=host)
                  for n in ids if n not in pending)
    have = [n.node_id for n in nodes]
    links = tuple(LinkMeasure(a, b, 40e-6, bw) for i, a in enumerate(have) for b in have[i + 1:])
    return AutoInputs(Measurements(nodes, links, {"mpi": 76.0} if sums is None else sums), _PROFILE,
                      Request(context=2048), tuple(pending))


def _auto_check(auto, world_size=None, **kw):
    return check("a", peers(live("b"), live("c")), world_size=world_size, auto=auto, **kw)


def test_auto_forms_one_node_alone_where_it_is_predicted_fastest():
    # three nodes on one 2-core host: TP=3 shares its cores, one node alone is fastest (test_shape's calibration)
    assert _auto_check(_auto(host="this")) == Form(("a",), shape="a alone")


def test_auto_forms_tp_over_every_node_on_fast_separate_machines():
    action = _auto_check(_auto())
    assert isinstance(action, Form) and action.members == ("a", "b", "c") and action.layers == ""
    assert action.shape == "TP=3 on a,b,c"


def test_auto_forms_an_uneven_pipeline_when_one_node_is_short_of_memory():
    # the context's K/V and the weights fit neither a alone nor an even split: a holds most layers
    auto = _auto("ab", mem={"a": int(0.6 * GB), "b": int(0.2 * GB)}, sums={"ring": 4000.0})
    action = check("a", peers(live("b")), world_size=None, auto=auto)
    assert isinstance(action, Form) and action.members == ("a", "b") and action.layers, action
    out, first = action.layers.split(",")  # rank 0 (a) owns K:output, b the layers before
    assert out.endswith(":output") and int(first.split(":")[1]) + 1 < 15, action.layers


def test_auto_waits_for_pending_measurements_then_falls_back_to_the_largest_size():
    auto = _auto(pending=("c",))
    waiting = _auto_check(auto, started_at=NOW - 1.0, changed_at=NOW - 3.0)
    assert isinstance(waiting, Wait) and "measuring c" in waiting.reason
    late = NOW - MEASURE_WAIT_S - 1.0
    assert _auto_check(auto, started_at=late, changed_at=late) == Form(("a", "b", "c"))


def test_auto_without_a_nodes_measurements_or_with_a_planner_error_uses_rule_7():
    assert _auto_check(_replace(_auto(), measurements=Measurements(()))) == Form(("a", "b", "c"))
    too_long = _replace(_auto(host="this"), request=Request(context=10**6))  # beyond the positions: ShapeError
    assert _auto_check(too_long) == Form(("a", "b", "c"))


def test_explicit_world_size_role_and_spares_win_over_auto():
    assert _auto_check(_auto(host="this"), world_size=3) == Form(("a", "b", "c"))
    spare_c = peers(live("b"), Peer(info=info("c", spare=True), status=PeerStatus.LIVE, last_ok=NOW,
                                    report=PeerReport(state="idle")))
    got = check("a", spare_c, world_size=None, auto=_auto(host="this"))
    assert got == Form(("a", "b")), got  # a spare in play: rule 7 (2 non-spares), not the shape


def test_auto_picks_the_best_plan_this_coordinator_can_form():
    # c is three times faster: "c alone" is best, but a coordinates; it forms its best plan with itself as
    # rank 0 and says which better plan needs another coordinator
    auto = _auto(layer_ms={"a": 3.6, "b": 3.6, "c": 1.2}, host="this")
    choice, why = auto_choice("a", ("a", "b", "c"), auto)
    assert choice is not None and "a" == choice.members[0], why
    assert "c alone" in choice.note


def test_auto_growth_follows_the_choice_not_the_largest_size():
    f = formation("a")
    own = Running(f, 0, since=0.0)
    quiet = dict(own=own, announced=True, rank0_idle=True, changed_at=NOW - 100)
    # one node alone is the choice on a shared host: a running formation of one does not grow to 3
    assert isinstance(_auto_check(_auto(host="this"), **quiet), Wait)
    # ... while on separate fast machines TP=3 is, so it grows (rule 4b)
    assert isinstance(_auto_check(_auto(), **quiet), Teardown)
    # ... and without auto (today's rule) it grows too
    assert isinstance(_auto_check(None, **quiet), Teardown)


def test_predicted_for_finds_the_formations_candidate():
    auto = _auto(host="this")
    tp = predicted_for(auto, ("a", "b", "c"))
    alone = predicted_for(auto, ("a",))
    assert tp.label == "TP=3 on a,b,c" and alone.label == "a alone"
    assert alone.prediction.decode_tok_s > tp.prediction.decode_tok_s
    assert predicted_for(_auto(pending=("c",)), ("a", "b", "c")) is None


def test_more_nodes_must_win_by_the_margin():
    # b's head is faster, a's layers are: a pipeline (b owns the output, a most layers) is predicted a few
    # per cent faster than b alone -- not enough for a second node: b alone is chosen, the pipeline says why
    nodes = (node("a", layer_ms=1.0, head_ms=10.0), node("b", layer_ms=1.05, head_ms=5.0))
    ranked = plan_shape(Measurements(nodes, mesh("ab"), {"mpi": 76.0}), smol(), Request(context=2048))
    pipe = next(c for c in ranked if c.kind == "pipeline" and c.prediction and not c.reason.startswith("does not"))
    b_alone = next(c for c in ranked if c.label == "b alone")
    assert 1.0 < pipe.prediction.decode_tok_s / b_alone.prediction.decode_tok_s < 1 + shape.NODE_MARGIN
    assert chosen(ranked).label == "b alone", describe(ranked)
    assert pipe.reason == f"within {shape.NODE_MARGIN:.0%} of b alone, on more nodes", pipe.reason
    # a's head four times b's: now the pipeline wins by more than the margin and is chosen
    nodes = (node("a", layer_ms=1.0, head_ms=20.0), node("b", layer_ms=2.0, head_ms=5.0))
    ranked = plan_shape(Measurements(nodes, mesh("ab"), {"mpi": 76.0}), smol(), Request(context=2048))
    assert chosen(ranked).kind == "pipeline", describe(ranked)


def test_jaccl_prior_lets_tp_win_on_thunderbolt_before_a_jaccl_group_ran():
    """Issue 43, item 10: three Macs whose only measured link is the LAN's gRPC round trip (1 ms, 1 GbE),
    able to run jaccl.  Priced from the LAN, TP=3 loses to one Mac alone; with jaccl's prior it is
    chosen, as it is with a measured jaccl all_sum of the same size; a measured figure always wins."""
    nodes = tuple(node(n, layer_ms=3.0, head_ms=20.0) for n in "abc")
    lan = Measurements(nodes, mesh("abc", lat=1e-3, bw=117e6))
    req = Request(context=2048)
    assert chosen(plan_shape(lan, smol(), req)).kind == "single"
    assert shape.with_jaccl_prior(lan, False) is lan
    prior = shape.with_jaccl_prior(lan, True)
    assert prior.all_sum_us == {"jaccl": shape.JACCL_PRIOR_US}
    got = chosen(plan_shape(prior, smol(), req))
    assert (got.label, got.backend) == ("TP=3 on a,b,c", "jaccl")
    measured = replace(lan, all_sum_us={"jaccl": 29.0})
    assert chosen(plan_shape(measured, smol(), req)).label == "TP=3 on a,b,c"
    slow = replace(lan, all_sum_us={"jaccl": 5000.0})
    assert shape.with_jaccl_prior(slow, True) is slow
    assert chosen(plan_shape(slow, smol(), req)).kind == "single"

"""The side-by-side benchmark (benchmarks/bench.py, ``mlxcluster bench``) runs end to end in quick mode.

One quick run (8 decode tokens, 64-token prefill, TP=1 and TP=3 over MPI):
every configuration reports positive figures, the JSON, the PNG chart, the
all_sum / TCP round-trip figures and the targets section are all there.
Without matplotlib the chart is skipped, not failed.
"""

import json
import os
import sys

import pytest

from mlxcluster.runtime.launcher import mpirun_path

def slow(test):
    """The tests of the quick run: they start rank processes on the real model (the first
    one pays for the run: 300 s limit)."""
    return pytest.mark.slow(pytest.mark.timeout(300)(test))

WORLD = 3


@pytest.fixture(scope="module")
def quick_run(real_model_path, tmp_path_factory):
    import contextlib
    import io

    from benchmarks.bench import main

    out_dir = str(tmp_path_factory.mktemp("bench"))
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["--quick", "--world-size", str(WORLD), "--backends", "mpi", "--decode-tokens", "8",
                     "--prefill-tokens", "64", "--out-dir", out_dir])
    with open(os.path.join(out_dir, "bench.json")) as f:
        report = json.load(f)
    return code, stdout.getvalue(), report, out_dir


def _expected_configs():
    names = ["mlx-lm TP=1", "mlxcluster TP=1"]
    if mpirun_path():
        names += [f"mlx-lm TP={WORLD} mpi", f"mlxcluster TP={WORLD} mpi"]
    return names


@slow
def test_exit_code_and_table(quick_run):
    code, out, _, _ = quick_run
    assert code == 0
    assert "| configuration |" in out and "| target |" in out
    for name in _expected_configs():
        assert f"| {name} |" in out


@slow
def test_every_configuration_has_positive_figures(quick_run):
    _, _, report, _ = quick_run
    rows = {r["name"]: r for r in report["configs"]}
    for name in _expected_configs():
        r = rows[name]
        assert r["ok"], (name, r["error"])
        for key in ("bootstrap_s", "ttft_s", "decode_tokens_per_s", "decode_step_ms", "prefill_tokens_per_s"):
            assert r[key] > 0, (name, key, r[key])
        assert r["decode_tokens"] == 8, name
        assert r["prefill_tokens"] == 64, name
        assert len(r["peak_memory_bytes_per_rank"]) == r["world_size"], name
        assert all(b > 0 for b in r["peak_memory_bytes_per_rank"]), name
    if not mpirun_path():
        assert report["skipped"] and report["skipped"][0]["backend"] == "mpi"


@slow
def test_greedy_tokens_match_mlx_lm(quick_run):
    _, _, report, _ = quick_run
    rows = {r["name"]: r for r in report["configs"]}
    # same float32 weights, same prompt, greedy: the first tokens agree
    assert rows["mlxcluster TP=1"]["token_ids"][:4] == rows["mlx-lm TP=1"]["token_ids"][:4]


@slow
def test_collective_and_round_trip_figures(quick_run):
    _, _, report, _ = quick_run
    rtt = report["tcp_rtt"]
    assert rtt["ok"], rtt["error"]
    assert all(v["median_us"] > 0 for v in rtt["by_payload"].values())
    assert str(report["all_sum_bytes"]) in rtt["by_payload"]
    cp = report["control_plane"]
    assert cp["ok"], cp["error"]
    assert cp["frame_median_us"] > 0
    if mpirun_path():
        (a,) = report["all_sum"]
        assert a["ok"], a["error"]
        assert a["backend"] == "mpi" and a["world_size"] == WORLD and a["median_us"] > 0
        assert "mpi" in cp["derived"]


@slow
def test_targets_section(quick_run):
    _, out, report, _ = quick_run
    targets = report["targets"]
    assert targets
    names = " ".join(t["name"] for t in targets)
    assert "mlxcluster TP=1 decode / plain mlx-lm decode" in names
    assert "control plane per step" in names
    assert "all_sum" in names and "TCP round trip" in names
    if mpirun_path():
        assert f"mlxcluster TP={WORLD} mpi decode / mlx-lm TP={WORLD} mpi decode" in names
        assert "peak memory per rank" in names
        assert all(t["pass"] is not None for t in targets), targets
    for t in targets:
        if t["pass"] is not None:
            assert t["value"] is not None and t["ratio"] is not None
            assert ("PASS" if t["pass"] else "FAIL") in out


@slow
def test_png_chart(quick_run):
    _, _, _, out_dir = quick_run
    path = os.path.join(out_dir, "bench.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 10_000


def test_chart_is_optional(tmp_path, monkeypatch):
    from benchmarks.bench import _chart

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    path = tmp_path / "bench.png"
    assert _chart({"configs": []}, str(path)) is False
    assert not path.exists()


# --------------------------------------------------------------------------- bench_control_link / wire (pure)


def test_control_link_bench_arguments():
    from benchmarks.bench_control_link import parse_args

    a = parse_args([])
    assert (a.models, a.backends, a.streams, a.links, a.delay_ms) == (
        ["small", "embedded"], ["mpi", "ring"], [1, 8], ["loopback", "failpoint", "netns"], 3.0)
    a = parse_args(["--models", "small", "--backends", "ring", "--streams", "1", "--links", "loopback,failpoint",
                    "--baseline", "HEAD~1"])
    assert (a.models, a.backends, a.streams, a.links, a.baseline) == (
        ["small"], ["ring"], [1], ["loopback", "failpoint"], "HEAD~1")
    for bad in (["--models", "big"], ["--streams", "0"], ["--streams", "9"], ["--links", "wifi"], ["--tokens", "1"],
                ["--delay-ms", "-1"], ["--repeat", "0"], ["--rounds", "0"], ["--rounds", "10"]):
        with pytest.raises(SystemExit) as err:
            parse_args(bad)
        assert err.value.code == 2


def test_control_link_bench_figures_and_table():
    from benchmarks.bench_control_link import (Row, compare, decode_figures, median_round, plan_wait_figures, pooled,
                                               rank1_waits, table)

    f = decode_figures([[0.0, 0.01, 0.02, 0.03], [0.005, 0.025]])
    assert f["tok_s"] == pytest.approx(4 / 0.03) and f["itl_p50_ms"] == pytest.approx(10.0)
    assert f["itl_p99_ms"] == pytest.approx(19.7)  # gaps 10, 10, 10, 20 ms
    assert decode_figures([[1.0]])["tok_s"] is None
    runs = [dict(tok_s=t, itl_p50_ms=1.0, itl_p99_ms=2.0, tokens=[[1, 2]]) for t in (5.0, 9.0, 7.0)]
    assert pooled(runs)["tok_s"] == 7.0 and pooled(runs)["tokens"] == [[1, 2]]
    assert pooled(runs[:2] + [dict(runs[2], tokens=[[1, 3]])])["tokens"] == []
    rounds = [Row("small", "mpi", 1, "loopback", "current", t, t / 10, 0.0, [[1, 2]]) for t in (50.0, 90.0, 70.0)]
    assert median_round(rounds + [Row("small", "mpi", 1, "loopback", error="E")]).itl_p50_ms == 7.0
    assert median_round(rounds[:2] + [Row("small", "mpi", 1, "loopback", "current", 1.0, 0, 0, [[3]])]).tokens == []
    assert median_round([Row("small", "mpi", 1, "loopback", error="E")]).error == "E"
    waits = [{"event": "counters", "of_rank": 1, "plan_frames": f, "plan_wait_s": w, "plan_waited": n}
             for f, w, n in ((10, 0.002, 1), (50, 0.022, 9))] + [{"event": "counters", "of_rank": 0}]
    assert rank1_waits(waits[:1]) == waits[0] and rank1_waits(waits) == waits[1] and rank1_waits([]) is None
    got = plan_wait_figures(waits[0], waits[1])
    assert got["wait_ms"] == pytest.approx(0.5) and got["waited_pct"] == pytest.approx(20.0)
    assert plan_wait_figures(None, waits[0])["waited_pct"] == pytest.approx(10.0)
    assert plan_wait_figures(waits[1], None) == {} and plan_wait_figures(waits[1], waits[1]) == {}
    rows = [Row("small", "mpi", 1, "loopback", "current", 100.0, 10.0, 12.0, [[1, 2]]),
            Row("small", "mpi", 1, "failpoint", "current", 96.0, 10.4, 13.0, [[1, 2]], wait_ms=0.25, waited_pct=3.0),
            Row("small", "mpi", 1, "loopback", "baseline HEAD", 100.0, 10.0, 12.0, [[1, 2]]),
            Row("small", "mpi", 1, "failpoint", "baseline HEAD", 75.0, 13.0, 16.0, [[1, 3]]),
            Row("small", "ring", 1, "netns-lan", "current", error="LaunchError: no mpirun")]
    cmp = {(r["link"], r["code"]): r for r in compare(rows)}
    assert cmp[("failpoint", "current")]["ratio"] == pytest.approx(0.96) and cmp[("failpoint", "current")]["equal"]
    assert cmp[("failpoint", "baseline HEAD")]["ratio"] == pytest.approx(0.75)
    assert cmp[("failpoint", "baseline HEAD")]["equal"] is False
    text = table(rows)
    lines = text.splitlines()
    assert lines[0].count("tok/s") == 2 and "baseline HEAD: tok/s" in lines[0]
    assert "| small | mpi | 1 | failpoint | 96.0 | 10.4 | 13.0 | 0.96 | yes | 0.25 (3%) | 75.0 | 13.0 | 16.0 | 0.75 | NO | - |" \
        in lines
    assert any(l.startswith("| small | ring | 1 | netns-lan | LaunchError: no mpirun |") for l in lines)
    assert all(l.count("|") == lines[0].count("|") for l in lines)


def test_wire_schedule_jitter_tail_and_fifo_on_a_fake_clock():
    import random

    from benchmarks.wire import Schedule

    plain = Schedule(delay_ms=3.0, rate_mbit=8.0)  # the default behaviour: serialisation, then D
    assert plain.due("a", 1.0, 1000) == pytest.approx(1.0 + 0.001 + 0.003)
    assert plain.due("a", 1.0, 1000) == pytest.approx(1.0 + 0.002 + 0.003)  # waits for the frame before it
    assert plain.due("b", 1.0, 1000) == pytest.approx(1.0 + 0.001 + 0.003)  # the other direction is its own
    s = Schedule(delay_ms=3.0, jitter_ms=1.0, late_pct=1.0, late_ms=20.0, rng=random.Random(7))
    draws = [s.propagation() for _ in range(20000)]
    late = [d for d in draws if d > 0.010]
    assert all(0.002 <= d <= 0.004 for d in draws if d <= 0.010)
    assert all(0.022 <= d <= 0.024 for d in late)
    assert 0.005 < len(late) / len(draws) < 0.015
    assert max(draws) - 0.020 > 0.0039 and min(draws) < 0.0021  # the whole +-J range is drawn
    fifo = Schedule(delay_ms=3.0, jitter_ms=1.0, late_pct=10.0, late_ms=20.0, rng=random.Random(1))
    now, dues = 0.0, []
    for _ in range(2000):
        now += 0.0005
        dues.append(fifo.due("a", now, 100))
        assert dues[-1] >= now + 0.002
    assert dues == sorted(dues)  # never delivered before the frame sent before it
    with pytest.raises(ValueError, match="--late-pct"):
        Schedule(late_pct=101.0)
    with pytest.raises(ValueError, match="--jitter-ms"):
        Schedule(jitter_ms=-1.0)

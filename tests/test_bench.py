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

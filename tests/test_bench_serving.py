"""``mlxcluster bench --serving``: the report's targets and reasons as plain functions, and one quick
live run of serve against mlx_lm.server (slow)."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import bench_serving as bs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _row(c, tok_s, ttft95, itl50=20.0, capacity=None):
    return {"concurrency": c, "requests": 2 * c, "ok": 2 * c, "output_tok_s": tok_s, "ttft_p50_s": ttft95 / 2, "ttft_p95_s": ttft95,
            "itl_p50_ms": itl50, "itl_p95_ms": itl50 * 2, "requests_s": 1.0, "peak_rss_mb_per_rank": [500],
            "capacity": capacity}


def test_targets_name_the_measured_reason_when_missed():
    report = {"results": {"1": {
        "serve": [_row(1, 16.0, 0.2, capacity=8), _row(32, 54.0, 9.0, itl50=120, capacity=8)],
        "mlx_lm": [_row(1, 15.5, 0.3), _row(32, 77.0, 4.0, itl50=300)]}}}
    got = {t["target"]: t for t in bs.targets(report)}
    assert got["output tok/s >= 1.0x mlx_lm.server at concurrency 1"]["met"]
    missed = got["output tok/s >= 1.2x mlx_lm.server at concurrency 32"]
    assert not missed["met"] and missed["measured"] == 0.7
    assert "at most 8 sequences together" in missed["reason"] and "24 of 32 clients wait" in missed["reason"]
    assert "dropped" not in missed["reason"] and "no batched prefill" not in missed["reason"]
    report["results"]["1"]["mlx_lm"][1]["ok"] = 50  # 14 of 64 failed at mlx_lm.server
    report["results"]["1"]["serve"][1]["itl_p95_ms"] = 2000.0
    why = {t["target"]: t for t in bs.targets(report)}["output tok/s >= 1.2x mlx_lm.server at concurrency 32"]["reason"]
    assert "mlx_lm.server dropped 14 of 64 requests" in why and "ITL p95 2000 ms vs 600 ms" in why
    ttft = got["TTFT p95 at concurrency 32 <= mlx_lm.server's"]
    assert not ttft["met"] and ttft["measured"] == "9.0 s vs 4.0 s"
    report["results"]["1"]["serve"][1] = _row(32, 100.0, 3.0, capacity=64)
    assert all(t["met"] for t in bs.targets(report))


def test_markdown_says_why_mlx_lm_did_not_run():
    report = {"machine": "m", "date": "d", "max_tokens": 8, "backend": "ring",
              "results": {"3": {"serve": [_row(8, 40.0, 1.0, capacity=8)], "mlx_lm_error": "no answer within 300 s"}}}
    report["targets"] = bs.targets(report)
    md = bs.markdown(report)
    assert "| 3 | 8 | mlxcluster serve | 40.0 |" in md and "| 0 of 16 |" in md and "not run: no answer within 300 s" in md


def test_percentile():
    assert bs._pct([], 50) is None
    assert bs._pct([3, 1, 2], 50) == 2 and bs._pct(list(range(101)), 95) == 95


@pytest.mark.slow
def test_quick_live_run_against_mlx_lm_server(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "mlxcluster", "bench", "--serving", "--concurrency", "1,2",
                           "--max-tokens", "4", "--out-dir", str(out), "--quick"], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "serving.json").read_text())
    res = report["results"]["1"]
    assert "mlx_lm_error" not in res, res
    for key in ("serve", "mlx_lm"):
        assert [r["concurrency"] for r in res[key]] == [1, 2]
        for r in res[key]:
            assert r["ok"] == r["requests"] >= 4 and r["output_tokens"] == 4 * r["requests"], r
            assert r["output_tok_s"] > 0 and r["ttft_p95_s"] > 0 and all(m > 100 for m in r["peak_rss_mb_per_rank"])
    assert (out / "serving.png").stat().st_size > 0 and "| 1 | 2 | mlx_lm.server |" in (out / "serving.md").read_text()


def test_speculative_serving_rows_read_acceptance_and_tokens_per_step_from_metrics():
    """bench_speculative_serving: the level's increase of /metrics' mlxcluster_spec_* counters gives its
    acceptance rate and tokens per step; the table puts each drafting row beside the plain one."""
    from benchmarks import bench_speculative_serving as bss

    page = ("# TYPE mlxcluster_spec_drafted_tokens counter\nmlxcluster_spec_drafted_tokens_total 100.0\n"
            "# TYPE mlxcluster_spec_accepted_tokens counter\nmlxcluster_spec_accepted_tokens_total 80.0\n"
            "# TYPE mlxcluster_spec_decode_steps counter\nmlxcluster_spec_decode_steps_total 60.0\n"
            "# TYPE mlxcluster_spec_decoded_tokens counter\nmlxcluster_spec_decoded_tokens_total 150.0\n")
    after = bss.spec_counters(page)
    assert after["drafted_tokens"] == 100.0 and after["verify_steps"] == 0.0
    before = dict(after, drafted_tokens=20.0, accepted_tokens=20.0, decode_steps=20.0, decoded_tokens=50.0)
    fig = bss.spec_figures(before, after)
    assert (fig["acceptance_rate"], fig["tokens_per_step"]) == (0.75, 2.5)
    assert bss.spec_figures(after, after)["acceptance_rate"] is None
    row = dict(_row(32, 100.0, 1.0), tpot_p50_ms=30.0, set="chat", mode="off", acceptance_rate=None,
               tokens_per_step=1.0)
    spec = dict(row, mode="ngram", output_tok_s=95.0, acceptance_rate=0.5, tokens_per_step=1.1, answers_equal=64)
    md = bss.markdown({"machine": "m", "date": "d", "max_tokens": 64, "draft": "ngram", "draft_tokens": 4,
                       "results": {"1": [row, spec]}})
    assert "| 1 | chat | 32 | off | 100.0 | 1.00x |" in md and "| 1 | chat | 32 | ngram | 95.0 | 0.95x |" in md
    assert "| 0.50 | 1.10 | 64 of 64 |" in md
    # three rounds: the median of each round's ratio to the plain server's, the range beside it
    rounds = [dict(row, round=i, output_tok_s=off, drafted_tokens=0, decode_steps=10) for i, off in
              enumerate((100.0, 120.0, 80.0))]
    rounds += [dict(spec, round=i, output_tok_s=x, drafted_tokens=10, decode_steps=10, answers_equal=64) for i, x in
               enumerate((110.0, 108.0, 84.0))]
    md = bss.markdown({"machine": "m", "date": "d", "max_tokens": 64, "draft": "ngram", "draft_tokens": 4,
                       "results": {"1": rounds}})
    assert "| 1 | chat | 32 | ngram | 100.7 | 1.05x (0.90-1.10) |" in md and "| 192 of 192 |" in md

"""`mlxcluster plan --measurements FILE`: the ranked candidates printed, bad input one line (in process);
`plan --cluster NAME` against a formed cluster: tests/test_cluster.py's loopback test."""

import json

from typer.testing import CliRunner

from mlxcluster.cli import app

CONFIG = {"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
          "intermediate_size": 1536, "hidden_size": 576, "vocab_size": 49152, "max_position_embeddings": 8192,
          "tie_word_embeddings": True, "head_dim": 64, "rms_norm_eps": 1e-5}


def _node(nid):
    return {"node_id": nid, "memory_bytes": 8 * 10**9, "layer_s": 3e-3, "prefill_tokens_per_s": 250,
            "head_s": 0.02}


def _files(tmp_path, slow_bc=True):
    model = tmp_path / "smol"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    links = [{"a": a, "b": b, "latency_s": 2e-5, "bandwidth_bytes_per_s": 1e10} for a, b in ("ab", "ac", "bc")]
    if slow_bc:
        links[2].update(latency_s=5e-3, bandwidth_bytes_per_s=12e6, interface="wifi")
    m = tmp_path / "m.json"
    m.write_text(json.dumps({"nodes": [_node(n) for n in "abc"], "links": links, "all_sum_us": {"mpi": 30}}))
    return str(model), str(m)


def _run(*args):
    return CliRunner().invoke(app, ["plan", *args])


def test_plan_prints_the_ranked_candidates(tmp_path):
    model, m = _files(tmp_path)
    r = _run("--measurements", m, "--model", model, "--context", "2048", "--weights", "float32")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith("smol, float32 weights, context 2048 tokens, optimize decode (3 node(s)")
    assert lines[1].startswith("* a alone: ")
    assert any("TP=3 on a,b,c over mpi" in l and "[link b-c 12 MB/s] -- slower than a alone" in l for l in lines)
    assert any(l.startswith("  TP=2 -- world size 2 cannot split smol") for l in lines)
    (tmp_path / "fast").mkdir()
    fast_model, fast = _files(tmp_path / "fast", slow_bc=False)
    r = _run("--measurements", fast, "--model", fast_model, "--context", "2048", "--weights", "float32")
    assert r.exit_code == 0 and r.stdout.splitlines()[1].startswith("* TP=3 on a,b,c over mpi: "), r.output


def test_plan_bad_input_is_one_line(tmp_path):
    model, m = _files(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    cases = [
        (["--measurements", str(bad), "--model", model], "cannot read"),
        (["--measurements", m, "--model", model, "--optimize", "fastest"], "--optimize 'fastest'"),
        (["--measurements", m, "--model", model, "--context", "9000"], "beyond smol's 8192 positions"),
        (["--model", model], "plan needs --cluster NAME or --measurements FILE"),
        (["--cluster", "lab", "--measurements", m, "--model", model], "--cluster and --measurements exclude each other"),
        (["--measurements", m, "--model", model, "--save", str(tmp_path / "out.json")], "--save writes what --cluster"),
    ]
    for args, needle in cases:
        r = _run(*args)
        assert r.exit_code == 2 and (r.exception is None or isinstance(r.exception, SystemExit)), (args, r.output)
        errors = [l for l in r.stderr.splitlines() if l.startswith("mlxcluster: error:")]
        assert len(errors) == 1 and needle in errors[0], (args, r.stderr)
        assert "Traceback" not in r.output


def test_status_shows_the_plans_prediction_beside_the_measured_figures(monkeypatch, tmp_path):
    from mlxcluster.cluster import client

    plan = {"label": "TP=3 on n0,n1,n2", "mode": "auto", "decode_tok_s": 11.7, "ttft_s": 0.21, "prompt_tokens": 512,
            "measured_decode_tok_s": 10.9, "measured_ttft_s": None, "note": ""}
    rows = [{"node_id": n, "address": "127.0.0.1:1", "state": state, "rank": r, "world_size": 3,
             "formation_id": "f1", "backend": "mpi", "model": "m", "rank0_address": "127.0.0.1:2",
             "backends": ["mpi"], "memory_bytes": 0, "platform": "", "plan": plan if r == 0 else None}
            for n, r, state in (("n0", 0, "ready"), ("n1", 1, "ready"), ("n2", 2, "ready"))]
    monkeypatch.setattr(client, "cluster_status", lambda *a, **k: rows)
    r = CliRunner().invoke(app, ["status", "--cluster", "lab"])
    assert r.exit_code == 0, r.output
    assert "plan TP=3 on n0,n1,n2 (auto): predicted 11.7 tok/s, TTFT 0.21 s (512 tokens); measured 10.9 tok/s" in r.output
    for row in rows:  # not formed yet: no plan line, and no error
        row["state"] = "loading"
    secret = tmp_path / "secret"
    secret.write_text("x" * 32)
    secret.chmod(0o600)
    r = CliRunner().invoke(app, ["status", "--cluster", "lab", "--secret-file", str(secret)])
    assert r.exit_code == 0 and "not formed" in r.output and "plan " not in r.output, r.output

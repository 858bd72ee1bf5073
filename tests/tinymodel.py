"""A tiny random Llama model for fast tests (no real model needed).

* :func:`tiny_llama` -> ``(config, weights)`` in mlx-lm's Llama naming
  (``model.layers.N.self_attn.q_proj.weight``, ...), Hugging Face rotary row
  order, float32.
* :func:`quantize_weights` -> the same weights packed with ``mx.quantize``
  plus the mlx-lm quantisation map.
* :func:`write_gguf` writes them as a GGUF file the way llama.cpp's
  ``convert_hf_to_gguf.py`` would (llama.cpp tensor names and metadata keys,
  Q/K rows permuted to the interleaved-pairs rotary layout);
  :func:`write_gpt2_gguf` writes a file whose architecture is not Llama.

The mappings and the permutation are written out here independently of
``mlxcluster.model.gguf`` so that the tests check that module against them.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple

import mlx.core as mx

__all__ = [
    "TINY_CONFIG",
    "tiny_llama",
    "quantize_weights",
    "permute_rows",
    "gguf_tensors",
    "gguf_metadata",
    "tokenizer_metadata",
    "write_gguf",
    "write_gpt2_gguf",
    "GGUF_LAYER_NAMES",
    "GGUF_GLOBAL_NAMES",
]

TINY_CONFIG: Dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 96,
    "num_hidden_layers": 2,
    "intermediate_size": 192,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
    "rope_theta": 10000.0,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
    "rope_traditional": False,
    "attention_bias": False,
    "mlp_bias": False,
}

# mlx-lm module (inside model.layers.N) -> llama.cpp tensor (inside blk.N)
GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",  # qwen3
    "self_attn.k_norm": "attn_k_norm",
}
GGUF_GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def tiny_llama(seed: int = 0, **overrides) -> Tuple[Dict[str, Any], Dict[str, mx.array]]:
    """A random tiny Llama: ``(config dict, weights dict)`` in mlx-lm naming.

    Linear weights are ``N(0, 1/in_features)``; the embedding is scaled so
    that logits have a standard deviation of about 1.5 (so temperature
    sampling is far from greedy); norm weights are ``1 + N(0, 0.1)``.
    ``overrides`` replace config entries (e.g. ``tie_word_embeddings=False``).
    """
    config = dict(TINY_CONFIG, **overrides)
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    n_heads = config["num_attention_heads"]
    n_kv = config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // n_heads
    vocab = config["vocab_size"]

    key = mx.random.key(seed)
    counter = [0]

    def normal(shape, std):
        counter[0] += 1
        k = mx.random.split(key, counter[0] + 1)[-1]  # one independent key per tensor
        return (mx.random.normal(shape, key=k) * std).astype(mx.float32)

    def linear(out_dim, in_dim):
        return normal((out_dim, in_dim), in_dim ** -0.5)

    def norm(dim):
        return 1.0 + normal((dim,), 0.1)

    weights: Dict[str, mx.array] = {"model.embed_tokens.weight": normal((vocab, hidden), 0.15)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm(hidden)
        weights[p + "post_attention_layernorm.weight"] = norm(hidden)
        weights[p + "self_attn.q_proj.weight"] = linear(n_heads * head_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = linear(n_kv * head_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = linear(n_kv * head_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = linear(hidden, n_heads * head_dim)
        weights[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = linear(hidden, inter)
    weights["model.norm.weight"] = norm(hidden)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = linear(vocab, hidden)
    mx.eval(weights)
    return config, weights


def quantize_weights(weights: Dict[str, mx.array], group_size: int = 32, bits: int = 4,
                     embed_bits: Optional[int] = 8) -> Tuple[Dict[str, mx.array], Dict[str, Any]]:
    """Pack every 2-D weight with ``mx.quantize`` (affine).

    Returns ``(weights, quantization)`` where quantised modules have
    ``weight``/``scales``/``biases`` and ``quantization`` is mlx-lm's map,
    ``{"group_size": g, "bits": b, "model.embed_tokens": {...}}`` when
    ``embed_bits`` differs from ``bits`` (like a llama.cpp Q4_1 file, whose
    token embedding is Q8_0).
    """
    out: Dict[str, mx.array] = {}
    quant: Dict[str, Any] = {"group_size": group_size, "bits": bits}
    for name, w in weights.items():
        if w.ndim != 2 or not name.endswith(".weight"):
            out[name] = w
            continue
        module = name[: -len(".weight")]
        b = bits
        if module == "model.embed_tokens" and embed_bits is not None:
            b = embed_bits
            if b != bits:
                quant[module] = {"group_size": group_size, "bits": b}
        wq, scales, biases = mx.quantize(w, group_size=group_size, bits=b)
        out[module + ".weight"] = wq
        out[module + ".scales"] = scales
        out[module + ".biases"] = biases
    mx.eval(out)
    return out, quant


def permute_rows(w: mx.array, n_head: int) -> mx.array:
    """llama.cpp's ``LlamaModel.permute`` (``convert_hf_to_gguf.py``): Hugging
    Face "rotate halves" rows -> llama.cpp interleaved-pairs rows, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(config: Dict[str, Any], weights: Dict[str, mx.array], permute: bool = True) -> Dict[str, mx.array]:
    """mlx-lm named float weights -> llama.cpp named tensors (Q/K permuted for the Llama
    family: ``permute``; llama.cpp's Qwen2/Qwen3 converters keep the rows)."""
    tensors: Dict[str, mx.array] = {}
    for name, w in weights.items():
        module, suffix = name.rsplit(".", 1)
        if module.startswith("model.layers."):
            _, _, layer, rest = module.split(".", 3)
            target = f"blk.{layer}.{GGUF_LAYER_NAMES[rest]}.{suffix}"
            if not permute:
                pass
            elif rest == "self_attn.q_proj":
                w = permute_rows(w, config["num_attention_heads"])
            elif rest == "self_attn.k_proj":
                w = permute_rows(w, config["num_key_value_heads"])
        else:
            target = f"{GGUF_GLOBAL_NAMES[module]}.{suffix}"
        tensors[target] = w
    return tensors


def _u32(v: int) -> mx.array:
    return mx.array(v, dtype=mx.uint32)


def _f32(v: float) -> mx.array:
    return mx.array(v, dtype=mx.float32)


def gguf_metadata(config: Dict[str, Any], arch: str = "llama") -> Dict[str, Any]:
    """llama.cpp metadata keys for ``config`` (numbers as typed 0-d arrays)."""
    return {
        "general.architecture": arch,
        "general.name": "tiny-test-llama",
        f"{arch}.embedding_length": _u32(config["hidden_size"]),
        f"{arch}.block_count": _u32(config["num_hidden_layers"]),
        f"{arch}.feed_forward_length": _u32(config["intermediate_size"]),
        f"{arch}.attention.head_count": _u32(config["num_attention_heads"]),
        f"{arch}.attention.head_count_kv": _u32(config["num_key_value_heads"]),
        f"{arch}.attention.layer_norm_rms_epsilon": _f32(config["rms_norm_eps"]),
        f"{arch}.context_length": _u32(config["max_position_embeddings"]),
        f"{arch}.rope.freq_base": _f32(config["rope_theta"]),
        f"{arch}.vocab_size": _u32(config["vocab_size"]),
    }


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tokenizer_metadata(vocab_size: int = 256) -> Dict[str, Any]:
    """A minimal byte-level BPE ("gpt2") vocabulary of exactly ``vocab_size``
    tokens: bytes 0..vocab_size-3 (0xFE/0xFF never occur in UTF-8), one merge
    ``"Ġ t"`` and an ``<|endoftext|>`` CONTROL token (the EOS)."""
    table = _bytes_to_unicode()
    n_bytes = vocab_size - 2
    tokens = [table[b] for b in range(n_bytes)] + ["Ġt", "<|endoftext|>"]
    types = [1] * (vocab_size - 1) + [3]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["Ġ t"],
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.eos_token_id": _u32(vocab_size - 1),
        "tokenizer.ggml.add_bos_token": mx.array(False),
    }


def write_gguf(path, config: Optional[Dict[str, Any]] = None, weights: Optional[Dict[str, mx.array]] = None,
               *, with_tokenizer: bool = True, arch: str = "llama", drop: Iterable[str] = (),
               extra_tensors: Optional[Dict[str, mx.array]] = None,
               metadata_overrides: Optional[Dict[str, Any]] = None) -> Tuple[Dict[str, Any], Dict[str, mx.array]]:
    """Write the tiny model (default :func:`tiny_llama`) as a float32 GGUF.

    Args:
        path: output file.
        with_tokenizer: add :func:`tokenizer_metadata`.
        arch: ``general.architecture`` (and prefix of the model keys).
        drop: llama.cpp tensor names or metadata keys to leave out.
        extra_tensors: more llama.cpp-named tensors to write.
        metadata_overrides: metadata keys to set/replace.
    Returns:
        ``(config, weights)`` that were written (mlx-lm naming, HF row order).
    """
    if config is None or weights is None:
        config, weights = tiny_llama()
    tensors = gguf_tensors(config, weights, permute=arch in ("llama", "mistral"))
    tensors.update(extra_tensors or {})
    metadata = gguf_metadata(config, arch)
    if with_tokenizer:
        metadata.update(tokenizer_metadata(config["vocab_size"]))
    metadata.update(metadata_overrides or {})
    drop = set(drop)
    tensors = {k: v for k, v in tensors.items() if k not in drop}
    metadata = {k: v for k, v in metadata.items() if k not in drop}
    mx.save_gguf(str(path), tensors, metadata)
    return config, weights


def write_gpt2_gguf(path) -> None:
    """A GGUF whose ``general.architecture`` is ``gpt2`` (not a Llama)."""
    config, weights = tiny_llama()
    tensors = {
        "token_embd.weight": weights["model.embed_tokens.weight"],
        "position_embd.weight": mx.zeros((config["max_position_embeddings"], config["hidden_size"])),
        "output_norm.weight": weights["model.norm.weight"],
        "output_norm.bias": mx.zeros((config["hidden_size"],)),
    }
    metadata = {
        "general.architecture": "gpt2",
        "gpt2.embedding_length": _u32(config["hidden_size"]),
        "gpt2.block_count": _u32(0),
        "gpt2.context_length": _u32(config["max_position_embeddings"]),
        "gpt2.attention.head_count": _u32(config["num_attention_heads"]),
    }
    metadata.update(tokenizer_metadata(config["vocab_size"]))
    mx.save_gguf(str(path), tensors, metadata)

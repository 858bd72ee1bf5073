"""Random-weight mlx-lm model directories of every architecture, written locally.

Tests and benchmarks need models of each architecture mlx-lm can shard without the Hugging
Face hub: :func:`write_model` instantiates mlx-lm's own ``Model`` for a small config
(:data:`TINY`), scales it (``scale``: hidden/MLP widths and layers), optionally quantises it
with mlx-lm's ``quantize_model``, and saves it as mlx-lm saves a model (``config.json``,
``model.safetensors``) with a byte-level BPE tokenizer built with ``tokenizers`` (256 byte
tokens + chat special tokens, a ChatML chat template), so ``mlx_lm.load`` and mlxcluster
read it alike.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Dict, Optional

__all__ = ["TINY", "VOCAB_SIZE", "write_model", "write_tokenizer"]

#: Vocabulary of the synthetic tokenizer: 256 bytes + 8 special tokens (divisible by 2, 3, 4).
VOCAB_SIZE = 264
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>", "<|r0|>", "<|r1|>", "<|r2|>", "<|r3|>"]
_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_GQA = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, vocab_size=VOCAB_SIZE,
            max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False)
_MLA = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
            n_routed_experts=4, routed_scaling_factor=1.0, kv_lora_rank=32, q_lora_rank=48,
            qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=1, topk_group=1,
            num_experts_per_tok=2, moe_layer_freq=1, first_k_dense_replace=1, max_position_embeddings=512,
            rms_norm_eps=1e-6, rope_theta=10000.0, norm_topk_prob=True)

_MISTRAL_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                 "original_max_position_embeddings": 512, "factor": 1.0}

#: model_type -> a small config mlx-lm 0.32 instantiates (dense and MoE, GQA and MLA).
TINY: Dict[str, Dict[str, Any]] = {
    "llama": dict(_GQA, model_type="llama", tie_word_embeddings=True),
    "qwen2": dict(_GQA, model_type="qwen2"),
    "qwen3": dict(_GQA, model_type="qwen3", tie_word_embeddings=True),
    "qwen3_moe": dict(_GQA, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                      mlp_only_layers=[0], moe_intermediate_size=64, norm_topk_prob=True),
    "gpt_oss": dict(_GQA, model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"], intermediate_size=64,
                    rope_theta=150000.0),
    "deepseek_v2": dict(_MLA, model_type="deepseek_v2", topk_method="greedy",
                        rope_scaling={"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 512}),
    "deepseek_v3": dict(_MLA, model_type="deepseek_v3"),
    "glm4_moe": dict(_GQA, model_type="glm4_moe", moe_intermediate_size=64, norm_topk_prob=True, n_group=1,
                     topk_group=1, n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0,
                     num_experts_per_tok=2, first_k_dense_replace=1, rope_scaling=None, use_qk_norm=True,
                     attention_bias=False, partial_rotary_factor=0.5),
    "glm4_moe_lite": dict(_MLA, model_type="glm4_moe_lite", tie_word_embeddings=False, partial_rotary_factor=1.0),
    "minimax": dict(_GQA, model_type="minimax", num_experts_per_tok=2, num_local_experts=4,
                    shared_intermediate_size=0, rotary_dim=8, intermediate_size=64),
    "ministral3": dict(_GQA, model_type="ministral3", rope_parameters=_MISTRAL_ROPE),
    "mistral4": dict(_MLA, model_type="mistral4", tie_word_embeddings=False, rope_parameters=_MISTRAL_ROPE),
    "exaone_moe": dict(_GQA, model_type="exaone_moe", moe_intermediate_size=64, num_experts=4,
                       num_experts_per_tok=2, num_shared_experts=1, sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"], is_moe_layer=[False, True]),
    "deepseek_v32": dict(_MLA, model_type="deepseek_v32", index_head_dim=16, index_n_heads=2, index_topk=8),
    "kimi_k25": dict(model_type="kimi_k25", text_config=dict(_MLA, model_type="kimi_k2"),
                     vocab_size=VOCAB_SIZE, max_position_embeddings=512),
    "iquestloopcoder": dict(_GQA, model_type="iquestloopcoder", loop_num=2, loop_window_size=8),
    "qwen3_5": dict(model_type="qwen3_5", text_config=dict(
        model_type="qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, vocab_size=VOCAB_SIZE, max_position_embeddings=512,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, full_attention_interval=2, tie_word_embeddings=False,
        rope_parameters={"type": "default", "mrope_section": [1, 1, 0], "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25})),
    "longcat_flash": dict(model_type="longcat_flash", attention_method="MLA", zero_expert_type="identity",
                          hidden_size=64, ffn_hidden_size=128, moe_topk=2, expert_ffn_hidden_size=64,
                          n_routed_experts=4, zero_expert_num=1, num_layers=2, vocab_size=VOCAB_SIZE,
                          max_position_embeddings=512, num_attention_heads=4, kv_lora_rank=32, q_lora_rank=48,
                          qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=1.0,
                          rms_norm_eps=1e-6, rope_theta=10000.0, mla_scale_q_lora=True, mla_scale_kv_lora=True,
                          attention_bias=False),
    "deepseek_v41": dict(model_type="deepseek_v41", vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, head_dim=32, q_lora_rank=48, qk_rope_head_dim=8, o_groups=2,
                         o_lora_rank=32, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                         sliding_window=8, index_n_heads=2, index_head_dim=16, index_topk=8,
                         max_position_embeddings=512, hc_mult=2),
    "longcat_flash_ngram": dict(model_type="longcat_flash_ngram", hidden_size=64, ffn_hidden_size=128, moe_topk=2,
                                expert_ffn_hidden_size=64, n_routed_experts=4, zero_expert_num=1, num_layers=2,
                                vocab_size=VOCAB_SIZE, max_position_embeddings=512, num_attention_heads=4,
                                kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                v_head_dim=16, routed_scaling_factor=1.0, rms_norm_eps=1e-6, rope_theta=10000.0,
                                mla_scale_q_lora=True, mla_scale_kv_lora=True, ngram_vocab_size_ratio=2,
                                emb_neighbor_num=2, emb_split_num=2),
    "step3p5": dict(_GQA, model_type="step3p5", num_attention_groups=2, moe_num_experts=4, moe_top_k=2,
                    moe_intermediate_size=64, share_expert_dim=64, sliding_window=8,
                    layer_types=["full_attention", "sliding_attention"], moe_layers_enum="1"),
}


def write_tokenizer(out_dir: str) -> None:
    """Save a byte-level BPE tokenizer of :data:`VOCAB_SIZE` tokens (``tokenizer.json``,
    ``tokenizer_config.json``, ChatML template; eos ``<|im_end|>``) to ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for s in _SPECIALS:
        vocab[s] = len(vocab)
    assert len(vocab) == VOCAB_SIZE
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(_SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token=None,
                                   pad_token="<|pad|>", unk_token=None)
    fast.chat_template = _CHATML
    fast.save_pretrained(out_dir)


def _scaled(config: Dict[str, Any], scale: int, layers: Optional[int]) -> Dict[str, Any]:
    c = copy.deepcopy(config)
    for k in ("hidden_size", "intermediate_size", "moe_intermediate_size", "share_expert_dim", "kv_lora_rank",
              "q_lora_rank"):
        if c.get(k):
            c[k] *= scale
    if c.get("head_dim"):
        c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
    if layers:
        c["num_hidden_layers"] = layers
        for k in ("layer_types", "is_moe_layer"):
            if isinstance(c.get(k), list):
                c[k] = [c[k][i % len(c[k])] for i in range(layers)]
    return c


def write_model(model_type: str, out_dir: str, *, scale: int = 1, layers: Optional[int] = None,
                quantize: Optional[Dict[str, int]] = None, seed: int = 0, dtype: str = "float32",
                weight_std: float = 0.5, overrides: Optional[Dict[str, Any]] = None) -> str:
    """Write a random-weight mlx-lm model directory.

    Args:
        model_type: a key of :data:`TINY`.
        out_dir: created if missing; ``config.json``, ``model.safetensors`` and the tokenizer go there.
        scale: multiplies hidden, MLP and latent widths (``scale`` 16 of a dense model is ~100 MB).
        layers: transformer blocks (default: the tiny config's 2).
        quantize: ``{"group_size": 32, "bits": 4}`` to save it quantised (mlx-lm's ``quantize_model``).
        seed: MLX PRNG seed of the weights.
        dtype: of the float weights.
        overrides: config entries set after scaling (e.g. ``num_attention_heads``).
        weight_std: matrices are redrawn from N(0, weight_std^2 / fan_in) so logits spread
            (fewer near-ties between greedy candidates than mlx-lm's small default init).
    Returns:
        ``out_dir``.
    Raises:
        KeyError: an unknown ``model_type``.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map_with_path
    from mlx_lm.utils import quantize_model, save_config

    from .arch import model_classes

    config = _scaled(TINY[model_type], scale, layers)
    config.update(overrides or {})
    mx.random.seed(seed)
    model_cls, args_cls = model_classes(config)
    model = model_cls(args_cls.from_dict(config))

    def redraw(path, a):
        if not mx.issubdtype(a.dtype, mx.floating) or a.ndim < 2 or "norm" in path:
            return a
        return (mx.random.normal(a.shape) * (weight_std / a.shape[-1] ** 0.5)).astype(getattr(mx, dtype))

    model.update(tree_map_with_path(redraw, model.parameters()))
    model.update(tree_map_with_path(
        lambda p, a: a.astype(getattr(mx, dtype)) if mx.issubdtype(a.dtype, mx.floating) else a,
        model.parameters()))
    mx.eval(model.parameters())
    if quantize:
        model, config = quantize_model(model, config, group_size=quantize["group_size"], bits=quantize["bits"])
    else:
        config.pop("quantization", None)
    os.makedirs(out_dir, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(os.path.join(out_dir, "model.safetensors"), weights, metadata={"format": "mlx"})
    config["eos_token_id"] = VOCAB_SIZE - len(_SPECIALS) + 2  # <|im_end|>
    config["torch_dtype"] = dtype
    save_config(config, os.path.join(out_dir, "config.json"))
    write_tokenizer(out_dir)
    return out_dir


def main(argv=None) -> int:
    """``python -m mlxcluster.model.synthetic TYPE OUT_DIR [--scale S] [--layers L] [--set KEY=JSON ...]
    [--quantize BITS]``: write a random-weight model directory; prints its path and config."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m mlxcluster.model.synthetic")
    p.add_argument("model_type", choices=sorted(TINY))
    p.add_argument("out_dir")
    p.add_argument("--scale", type=int, default=1)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--set", action="append", default=[], help="KEY=JSON config override")
    p.add_argument("--quantize", type=int, default=None, help="bits (group size 64)")
    a = p.parse_args(argv)
    overrides = {k: json.loads(v) for k, v in (x.split("=", 1) for x in a.set)}
    out = write_model(a.model_type, a.out_dir, scale=a.scale, layers=a.layers, overrides=overrides,
                      quantize={"group_size": 64, "bits": a.quantize} if a.quantize else None)
    with open(os.path.join(out, "config.json")) as f:
        print(out, f.read())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

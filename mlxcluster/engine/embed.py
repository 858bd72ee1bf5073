"""Embeddings of a decoder model: the forward pass of a plan's inputs, pooling, normalisation.

Decoder embedding models (Qwen3-Embedding, gte-Qwen2, e5-mistral, ...) are ordinary mlx-lm
architectures: an embedding is the final normed hidden state (``TensorParallel.hidden``, the
model without its output head) pooled over the input's positions -- the last token's by default,
or the mean / first / maximum where the model's sentence-transformers config (``modules.json``,
``1_Pooling/config.json``) or a GGUF's ``{arch}.pooling_type`` says so -- then L2-normalised
(always, as OpenAI's embeddings and vLLM's ``embed`` pooler are).  A generation model can be
asked for embeddings as well (vLLM's pooling runner and Ollama allow it): last-token pooling.

Tensor parallelism is the model's own: every rank runs its shard's forward pass of the same
right-padded ``(B, L)`` batch (:func:`run` on ranks N, :func:`embed` on rank 0), the
row-parallel ``all_sum`` leaves every rank the full hidden state, and rank 0 pools it.  With
causal attention a position never attends to the padding to its right, so an input's positions
are those of its own one-input forward pass; no KV cache is kept (nothing outlives the call).

Matryoshka truncation (``dimensions``) is allowed only where the model's ``config.json`` says the
model was trained for it (vLLM's rule: ``is_matryoshka: true``, or ``matryoshka_dimensions``,
the widths allowed): the first ``d`` values, renormalised.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

__all__ = ["EmbedError", "Pooling", "MODES", "pooling_of", "unsupported", "hidden_states", "pool", "normalize",
           "embed", "run", "check_dimensions", "truncate_dimensions"]

#: pooling modes (sentence-transformers' ``pooling_mode_*`` names, shortened)
MODES = ("lasttoken", "mean", "cls", "max")

#: sentence-transformers ``Pooling`` config keys -> :data:`MODES`
_ST_MODES = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max"}
#: llama.cpp's ``LLAMA_POOLING_TYPE`` (GGUF ``{arch}.pooling_type``) -> :data:`MODES`
_GGUF_MODES = {0: "lasttoken", 1: "mean", 2: "cls", 3: "lasttoken"}


class EmbedError(ValueError):
    """A model or request this module cannot embed (one line)."""


@dataclass(frozen=True)
class Pooling:
    """How a model's embeddings are made.

    Attributes:
        mode: one of :data:`MODES`.
        width: the hidden size (the embedding's dimensions without truncation).
        matryoshka: ``None`` (no truncation allowed), ``()`` (any width from 1 to ``width``) or
            the widths allowed.
        source: where ``mode`` came from (for messages).
    """

    mode: str = "lasttoken"
    width: int = 0
    matryoshka: Optional[Tuple[int, ...]] = None
    source: str = "default"


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise EmbedError(f"cannot read {path}: {exc}") from None


def _st_pooling(cfg: Any, where: str) -> str:
    if not isinstance(cfg, dict):
        raise EmbedError(f"{where} is not a JSON object")
    on = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
    if len(on) != 1:
        raise EmbedError(f"{where} turns on {len(on)} pooling modes ({', '.join(on) or 'none'}): "
                         f"exactly one of {', '.join(sorted(_ST_MODES))} is supported")
    if on[0] not in _ST_MODES:
        raise EmbedError(f"{where}: {on[0]} is not supported (supported: {', '.join(sorted(_ST_MODES))})")
    return _ST_MODES[on[0]]


def pooling_of(path: str, config: Dict[str, Any], metadata: Optional[Dict[str, Any]] = None) -> Pooling:
    """The :class:`Pooling` of the model at ``path`` (an mlx-lm directory or a ``.gguf`` file) whose
    config dict is ``config`` (and GGUF ``metadata``).

    A directory's ``modules.json`` (sentence-transformers) may list a ``Transformer``, a
    ``Pooling`` (its ``config.json`` says the mode) and a ``Normalize``; without it a
    ``1_Pooling/config.json`` is read if present; otherwise last-token pooling.

    Raises:
        EmbedError: an unreadable config, a pooling mode other than those of :data:`MODES`, or a
            module this engine cannot run (e.g. a ``Dense`` projection).
    """
    from ..model.arch import text_config

    text = text_config(config)
    width = int(text.get("hidden_size") or 0)
    dims = config.get("matryoshka_dimensions", text.get("matryoshka_dimensions"))
    if isinstance(dims, list) and dims:
        matryoshka: Optional[Tuple[int, ...]] = tuple(sorted({int(d) for d in dims}))
    elif config.get("is_matryoshka") or text.get("is_matryoshka"):
        matryoshka = ()
    else:
        matryoshka = None
    mode, source = "lasttoken", "default"
    if os.path.isdir(path):
        modules_path = os.path.join(path, "modules.json")
        pooling_dir = None
        if os.path.isfile(modules_path):
            modules = _read_json(modules_path)
            if not isinstance(modules, list):
                raise EmbedError(f"{modules_path} is not a JSON list")
            for m in modules:
                kind = str((m or {}).get("type", "")).rsplit(".", 1)[-1] if isinstance(m, dict) else ""
                if kind == "Pooling":
                    pooling_dir = os.path.join(path, str(m.get("path", "")))
                elif kind not in ("Transformer", "Normalize"):
                    raise EmbedError(f"{modules_path} lists a {kind or 'malformed'} module: only Transformer, "
                                     f"Pooling and Normalize are supported")
        elif os.path.isdir(os.path.join(path, "1_Pooling")):
            pooling_dir = os.path.join(path, "1_Pooling")
        if pooling_dir is not None:
            where = os.path.join(pooling_dir, "config.json")
            mode, source = _st_pooling(_read_json(where), where), where
    else:
        for key, value in (metadata or {}).items():
            if key.endswith(".pooling_type"):
                if int(value) not in _GGUF_MODES:
                    raise EmbedError(f"GGUF {key} = {value} is not supported (none, mean, cls or last)")
                mode, source = _GGUF_MODES[int(value)], f"GGUF {key}"
    return Pooling(mode=mode, width=width, matryoshka=matryoshka, source=source)


def unsupported(model) -> Optional[str]:
    """Why this rank's ``model`` cannot run embeddings (one line), or ``None`` when it can: every
    tensor-parallel model can (its ``hidden``); a pipeline stage, a ``--local-decode`` stage or an
    attention-FFN split cannot."""
    if getattr(model, "local_decode", False):
        return "a --local-decode pipeline cannot compute embeddings (run a tensor-parallel group)"
    if getattr(model, "route", None) is not None:
        return "a pipeline (--layers) cannot compute embeddings (run a tensor-parallel group)"
    if type(model).__name__ == "AfdModel":
        return "an attention-FFN split (--afd) cannot compute embeddings (run a tensor-parallel group)"
    if not callable(getattr(model, "hidden", None)):
        return f"{type(model).__name__} has no final hidden state to pool"
    return None


def hidden_states(model, inputs: Sequence[Sequence[int]]) -> mx.array:
    """The final normed hidden states of ``inputs`` (lists of int token ids, at least one each),
    right-padded with token 0 into one ``(B, L)`` batch: ``(B, L, hidden)`` in the model's float
    dtype (lazy).  A collective on a tensor-parallel model: every rank makes the same call."""
    longest = max(len(ids) for ids in inputs)
    batch = np.zeros((len(inputs), longest), dtype=np.int32)
    for i, ids in enumerate(inputs):
        batch[i, :len(ids)] = ids
    return model.hidden(mx.array(batch))


def pool(hidden: mx.array, lengths: Sequence[int], modes: Sequence[str]) -> mx.array:
    """Row ``i`` of ``hidden`` (``(B, L, H)``) pooled over its first ``lengths[i]`` positions by
    ``modes[i]`` (:data:`MODES`): float32 ``(B, H)``, not normalised."""
    rows = []
    for i, (n, mode) in enumerate(zip(lengths, modes)):
        h = hidden[i, :n].astype(mx.float32)
        if mode == "lasttoken":
            rows.append(h[n - 1])
        elif mode == "mean":
            rows.append(h.mean(axis=0))
        elif mode == "cls":
            rows.append(h[0])
        elif mode == "max":
            rows.append(h.max(axis=0))
        else:
            raise EmbedError(f"unknown pooling mode {mode!r} (one of {', '.join(MODES)})")
    return mx.stack(rows)


def normalize(x, eps: float = 1e-12):
    """Rows of ``x`` (``(B, H)``, MLX or NumPy) divided by their L2 norm (at least ``eps``, as
    ``torch.nn.functional.normalize``): float32."""
    if isinstance(x, mx.array):
        x = x.astype(mx.float32)
        return x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), eps)
    x = np.asarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), eps)


def embed(model, inputs: Sequence[Sequence[int]], modes: Sequence[str]) -> np.ndarray:
    """Rank 0: the embeddings of ``inputs`` (token id lists) pooled by ``modes`` (one per input),
    L2-normalised: float32 NumPy ``(B, hidden)``.  Runs (and evaluates) the forward pass: a
    collective, matched by :func:`run` on every rank N."""
    h = hidden_states(model, inputs)
    out = normalize(pool(h, [len(ids) for ids in inputs], modes))
    mx.eval(out)
    return np.array(out, copy=True)


def run(model, inputs: Sequence[Sequence[int]]) -> None:
    """Rank N: this rank's share of :func:`embed` (the same forward pass, evaluated; nothing pooled)."""
    mx.eval(hidden_states(model, inputs))


def check_dimensions(pooling: Pooling, dimensions: int) -> int:
    """The width of the embeddings a request asks for: ``dimensions`` (0: the model's width).

    Raises:
        EmbedError: ``dimensions`` is not the model's width and the model allows no Matryoshka
            truncation, is not one of the widths it allows, or is outside ``[1, width]``."""
    width = pooling.width
    if dimensions in (0, width):
        return width
    if pooling.matryoshka is None:
        raise EmbedError(f"'dimensions' {dimensions} is not supported: this model's embeddings have {width} "
                         f"dimensions and its config.json allows no Matryoshka truncation")
    if not 1 <= dimensions <= width:
        raise EmbedError(f"'dimensions' must be between 1 and {width}, got {dimensions}")
    if pooling.matryoshka and dimensions not in pooling.matryoshka:
        raise EmbedError(f"'dimensions' {dimensions} is not one this model was trained for "
                         f"({', '.join(map(str, pooling.matryoshka + (width,)))})")
    return dimensions


def truncate_dimensions(vectors: np.ndarray, dimensions: int) -> np.ndarray:
    """Matryoshka truncation: the first ``dimensions`` values of each row of ``vectors``
    (``(B, H)``), renormalised to L2 norm 1 (float32 ``(B, dimensions)``); unchanged when
    ``dimensions`` is 0 or ``H``."""
    if dimensions in (0, vectors.shape[-1]):
        return vectors
    return normalize(vectors[..., :dimensions])

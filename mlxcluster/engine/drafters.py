"""Model drafters of speculative decoding, on rank 0: a draft model (``model:PATH``) and the target's
own first N layers (``layers:N``, self-speculative).

* :class:`DraftModels`: rank 0's draft weights, loaded once per process (per scheduler) and shared
  by every sequence's drafter.  ``model:PATH``: any model reference the loader reads (an mlx-lm
  directory, a GGUF file), in the target's weight format, refused unless its vocabulary is the
  target's (the same embedding rows and, where both are known, the same tokenizer vocabulary).
  ``layers:N`` (LayerSkip, Elhoushi et al. 2024: the early exit of layer N through the model's
  final norm and head): at TP=1 a view of the target's own modules (its first N blocks, final
  norm, head or tied embedding: no weights copied); where rank 0 holds only a shard (TP>1) an
  unsharded copy of just those layers, norm and head, read from the model's file.
* :class:`ModelDrafter`: one sequence's drafter.  It keeps an mlx-lm KV cache of its own over the
  context it has seen; :meth:`ModelDrafter.propose` syncs it to the given context (trims it back to
  the longest common prefix with what it had -- the rejected draft tokens -- with mlx-lm's
  ``trim_prompt_cache``, then feeds the rest) and drafts ``k`` tokens greedily, one forward each,
  as mlx-lm's ``speculative_generate_step`` does (its ``_draft_generate`` with the greedy sampler).

Everything here that touches MLX runs on rank 0's one MLX thread (the scheduler calls
:meth:`ModelDrafter.propose` and :meth:`ModelDrafter.load` there).
"""

from __future__ import annotations

import copy
import re
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .speculative import Drafter

__all__ = ["DraftModels", "ModelDrafter", "first_layers", "first_layers_weights", "weight_format_of",
           "export_first_layers", "layer_count"]

#: tokens fed to a draft model per forward while it catches up with a context (mlx-lm's
#: ``prefill_step_size`` of ``speculative_generate_step``)
PREFILL_STEP = 512

_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _inner(model):
    """The module holding ``layers``, ``norm`` and ``embed_tokens`` (mlx-lm's ``model.model``; inside
    a multimodal wrapper's ``language_model``) and the language model around it."""
    import mlx.nn as nn

    lm = getattr(model, "language_model", None)
    lm = lm if isinstance(lm, nn.Module) else model
    return lm, lm.model


def layer_count(model) -> int:
    """Transformer blocks of an mlx-lm model (a :class:`~mlxcluster.model.tp.TensorParallel` shard
    holds them all)."""
    return len(_inner(model)[1].layers)


def first_layers(model, n: int):
    """A view of ``model`` running its first ``n`` blocks, then its final norm and head (tied
    embedding or ``lm_head``): shallow copies of the model and of its inner model with ``layers``
    cut to ``n``; every parameter is the target's own (nothing copied).  mlx-lm's
    ``make_prompt_cache`` of the view makes ``n`` caches.  Call: ``view(tokens (1, T) int32, cache)``
    -> logits ``(1, T, vocab)``."""
    lm, inner = _inner(model)
    cut = copy.copy(inner)
    cut.layers = inner.layers[:n]
    view_lm = copy.copy(lm)
    view_lm.model = cut
    if lm is model:
        return view_lm
    view = copy.copy(model)
    view.language_model = view_lm
    return view


def first_layers_weights(config: Dict[str, Any], weights: Dict[str, Any], n: int) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(config, weights)`` of a model's first ``n`` blocks (plus its embedding, final norm and
    head): ``num_hidden_layers`` (and per-layer lists such as ``layer_types``) cut to ``n``, block
    weights of index >= ``n`` dropped.  Arrays are not copied (lazily loaded ones stay unread)."""
    from ..model.arch import text_config

    cfg = copy.deepcopy(config)
    tc = text_config(cfg)
    key = "num_hidden_layers" if "num_hidden_layers" in tc else "num_layers"
    total = int(tc[key])
    tc[key] = n
    for k, v in list(tc.items()):
        if isinstance(v, list) and len(v) == total and k != "eos_token_id":
            tc[k] = v[:n]
    kept = {}
    for name, w in weights.items():
        m = _LAYER_KEY.search(name)
        if m is None or int(m.group(1)) < n:
            kept[name] = w
    return cfg, kept


def weight_format_of(model) -> str:
    """The weight format (:data:`~mlxcluster.model.loader.WEIGHT_FORMATS`) ``model`` computes with:
    ``quantized`` when any module is quantised, else its float parameters' dtype."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    if not isinstance(model, nn.Module):  # a pipeline's wrapper: its stage's model
        model = getattr(getattr(model, "stage", None), "model", None)
        if not isinstance(model, nn.Module):
            return "float32"
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            return "quantized"
    for _, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            return {mx.float16: "float16", mx.bfloat16: "bfloat16"}.get(v.dtype, "float32")
    return "float32"


def export_first_layers(model: Optional[str], out_dir: str, n: int) -> str:
    """Write the first ``n`` blocks of ``model`` (a model reference; ``None``: the default model),
    float32, with its tokenizer, as an mlx-lm directory (:func:`~mlxcluster.model.export.export_mlx`,
    then cut by :func:`first_layers_weights`): a draft model with the target's tokenizer, for tests
    and benchmarks.  Returns ``out_dir``.

    Raises:
        ModelError: the model cannot be read.
    """
    import json
    import os

    import mlx.core as mx

    from ..model.export import export_mlx
    from ..model.loader import resolve_model_path

    path = resolve_model_path(model)
    if os.path.isdir(path):
        raise ValueError(f"{path} is an mlx-lm directory: export a GGUF model")
    export_mlx(path, out_dir, dequantize=True)
    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    st = os.path.join(out_dir, "model.safetensors")
    config, weights = first_layers_weights(config, mx.load(st), n)
    mx.eval(list(weights.values()))
    mx.save_safetensors(st, weights, metadata={"format": "mlx"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir


class DraftModels:
    """Rank 0's draft weights, each loaded once and shared by every sequence's :class:`ModelDrafter`.

    Args:
        target: rank 0's model (a :class:`~mlxcluster.model.tp.TensorParallel` model or shard).
        vocab_size: the target's vocabulary (embedding rows).
        tokenizer: the target's tokenizer (``None``: only the embedding rows are compared).
        model_path: the target's model reference (``layers:N`` where rank 0 holds a shard reads
            those layers from it; "": refused there).
    """

    def __init__(self, target, vocab_size: int, tokenizer=None, model_path: str = ""):
        self.target = target
        self.vocab_size = int(vocab_size)
        self.tokenizer = tokenizer
        self.model_path = model_path
        self._models: Dict[Tuple[str, str], Any] = {}
        self._lock = threading.Lock()

    @property
    def sharded(self) -> bool:
        """True when rank 0 holds only a part of the target (a tensor-parallel shard, a pipeline
        stage): ``layers:N`` then reads its own copy of the first layers."""
        return int(getattr(self.target, "world_size", 1) or 1) > 1

    @property
    def n_layers(self) -> int:
        """The target's transformer blocks (all of them, whatever rank 0 holds)."""
        if not self.sharded:
            return layer_count(self.target)
        args = getattr(self.target, "args", None)
        for name in ("num_hidden_layers", "num_layers"):
            if getattr(args, name, None):
                return int(getattr(args, name))
        from ..model.loader import inspect_model

        return inspect_model(self.model_path).n_layers

    def check(self, kind: str, arg: str, what: str) -> None:
        """The cheap checks of ``kind:arg`` (no weights read): ``layers`` N in ``[1, layer count)``
        (and a model path where rank 0 holds a shard); ``model`` a reference that exists.  ``what``
        starts the error line (``speculative.draft layers:99``).

        Raises:
            ValueError: one line starting with ``what``.
        """
        if (kind, arg) in self._models:
            return
        if kind == "layers":
            if self.sharded and not self.model_path:
                raise ValueError(f"{what}: rank 0 holds a part of the model and does not know its file to "
                                 f"read the first layers from")
            n, total = int(arg), self.n_layers
            if not 1 <= n < total:
                raise ValueError(f"{what}: N must be in [1, {total - 1}] (the model has {total} layers)")
        elif kind == "model":
            from ..model.loader import ModelError, resolve_model_path

            try:
                resolve_model_path(arg)
            except ModelError as exc:
                raise ValueError(f"{what}: {exc}") from None
        else:
            raise ValueError(f"{what}: not a model drafter")

    def hold(self, kind: str, arg: str, model) -> None:
        """Take an already built draft model as ``kind:arg``'s (a draft node's own model, read by its
        rank like any target: :class:`~mlxcluster.leader.remote_draft.DraftService`): its drafters
        skip the load and its checks."""
        with self._lock:
            self._models[(kind, arg)] = model

    def drafter(self, kind: str, arg: str, what: str) -> "ModelDrafter":
        """A new sequence's :class:`ModelDrafter` over ``kind:arg`` after :meth:`check` (weights not
        loaded yet: :meth:`ModelDrafter.load`).

        Raises:
            ValueError: :meth:`check`'s refusals (one line starting with ``what``)."""
        self.check(kind, arg, what)
        return ModelDrafter(self, kind, arg, what)

    def get(self, kind: str, arg: str, what: str):
        """The draft model of ``kind:arg`` (an mlx-lm model: ``model(tokens (1, T) int32, cache)`` ->
        logits ``(1, T, vocab)``), loaded on first use (call it on the MLX thread).

        Raises:
            ValueError: :meth:`check`'s refusals; a model that cannot be read, or whose vocabulary
                differs from the target's; one line starting with ``what``.
        """
        key = (kind, arg)
        with self._lock:
            if key not in self._models:
                self.check(kind, arg, what)
                self._models[key] = self._load(kind, arg, what)
            return self._models[key]

    def _load(self, kind: str, arg: str, what: str):
        from ..model.loader import ModelError, read_model, tokenizer_of
        from ..model.tp import build_model

        fmt = weight_format_of(self.target)
        if kind == "layers":
            n = int(arg)
            if not self.sharded:
                return first_layers(self.target, n)
            try:
                source = read_model(self.model_path, tokenizer=False)
            except ModelError as exc:
                raise ValueError(f"{what}: {exc}") from None
            config, weights = first_layers_weights(source.config, source.weights, n)
            return build_model(config, weights, source.quantization, fmt, None, consume_weights=True)
        try:
            source = read_model(arg, tokenizer=False)
        except ModelError as exc:
            raise ValueError(f"{what}: {exc}") from None
        if source.vocab_size != self.vocab_size:
            raise ValueError(f"{what}: its vocabulary has {source.vocab_size} tokens, the target's {self.vocab_size}: "
                             f"a draft model needs the target's tokenizer")
        if self.tokenizer is not None:
            try:
                tok, _ = tokenizer_of(source)
            except ModelError as exc:
                raise ValueError(f"{what}: {exc}") from None
            if tok.get_vocab() != self.tokenizer.get_vocab():
                raise ValueError(f"{what}: its tokenizer's vocabulary differs from the target's: a draft model "
                                 f"needs the target's tokenizer")
        try:
            return build_model(source.config, source.weights, source.quantization, fmt, None, consume_weights=True)
        except ValueError as exc:
            raise ValueError(f"{what}: {str(exc).splitlines()[0]}") from None


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ModelDrafter(Drafter):
    """One sequence's drafter over a draft model of :class:`DraftModels` (``kind`` ``model`` or
    ``layers``, ``arg`` its path or N; ``what``: how errors name it).  It holds its own mlx-lm KV
    cache (``make_prompt_cache`` of the draft model) over :attr:`seen`, the tokens it has fed.

    :meth:`propose` (on the MLX thread): the cache is trimmed back to the longest common prefix of
    :attr:`seen` and ``context`` (at most ``len(context) - 1``: the last token is fed again for its
    logits) with mlx-lm's ``trim_prompt_cache`` -- after a verify step these are the rejected draft
    tokens -- (a cache that cannot trim is made afresh), the rest of the context is fed in chunks of
    :data:`PREFILL_STEP`, then ``k`` tokens are drafted greedily (argmax), one forward each, lazily
    chained and evaluated once.  The cache then holds ``context + draft[:-1]``.  Greedy drafts are
    deterministic (q one-hot), which is what the target's rejection sampling assumes of a drafter
    without probabilities: sampled requests keep their exact distribution.
    """

    uses_mlx = True

    def __init__(self, models: DraftModels, kind: str, arg: str, what: str = ""):
        self.models, self.kind, self.arg, self.what = models, kind, arg, what or f"{kind}:{arg}"
        self.name = kind
        self.model = None
        self.cache: Optional[List[Any]] = None
        self.seen: List[int] = []
        self.draft_s: Optional[float] = None

    def ready(self) -> bool:
        """Whether the draft weights are here: taken from :class:`DraftModels` when already loaded
        (no MLX work: any thread); else :meth:`load` must run (on the MLX thread)."""
        if self.model is None:
            with self.models._lock:
                self.model = self.models._models.get((self.kind, self.arg))
        return self.model is not None

    def load(self) -> None:
        """Take the shared draft weights (loading them on first use: call on the MLX thread).

        Raises:
            ValueError: :meth:`DraftModels.get`'s refusals (one line)."""
        if self.model is None:
            self.model = self.models.get(self.kind, self.arg, self.what)

    def _sync(self, context: List[int]) -> List[int]:
        """Trim the cache to the common prefix with ``context`` (leaving at least its last token to
        feed); returns the tokens still to feed (>= 1)."""
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

        if self.cache is None:
            self.cache, self.seen = make_prompt_cache(self.model), []
        p = min(_common_prefix(self.seen, context), len(context) - 1)
        drop = len(self.seen) - p
        if drop > 0:
            if can_trim_prompt_cache(self.cache) and trim_prompt_cache(self.cache, drop) == drop:
                del self.seen[p:]
            else:
                self.cache, self.seen, p = make_prompt_cache(self.model), [], 0
        return context[p:]

    def propose(self, context: Sequence[int], k: int) -> List[int]:
        """Up to ``k`` draft tokens (int ids, below the target's vocabulary) after ``context`` (int
        ids, prompt + answer so far).

        Raises:
            ValueError: the draft model cannot be loaded (:meth:`load`)."""
        import mlx.core as mx

        if k <= 0 or not context:
            return []
        self.load()
        ctx = [int(t) for t in context]
        rest = self._sync(ctx)
        while len(rest) > 1:  # catch up: every token but the last, in chunks
            n = min(PREFILL_STEP, len(rest) - 1)
            self.model(mx.array([rest[:n]], dtype=mx.int32), cache=self.cache)
            mx.eval([c.state for c in self.cache])
            self.seen += rest[:n]
            rest = rest[n:]
        t0 = time.perf_counter()
        y = mx.array([rest], dtype=mx.int32)
        out = []
        for _ in range(k):
            y = mx.argmax(self.model(y, cache=self.cache)[:, -1, :], axis=-1).astype(mx.int32)[:, None]
            mx.async_eval(y)
            out.append(y)
        tokens = mx.concatenate(out, axis=1)[0].tolist()
        self.draft_s = time.perf_counter() - t0
        self.seen += rest + tokens[:-1]
        vocab = self.models.vocab_size
        cut = next((i for i, t in enumerate(tokens) if not 0 <= t < vocab), len(tokens))
        return tokens[:cut]

    def close(self) -> None:
        """Drop the KV cache (the weights stay shared)."""
        self.cache, self.seen = None, []

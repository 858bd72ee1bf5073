"""Tensor-parallel models: mlx-lm's own model classes, sharded with their own ``shard``,
plus what mlxcluster owns on top (vocabulary-parallel embedding and head, shard-then-dequantise
loading, world-size validation, memory accounting).

Sharding (Megatron-LM style, Shoeybi et al. 2019, as implemented by mlx-lm's ``Model.shard``
with ``mlx.nn.layers.distributed.shard_linear``/``shard_inplace``; what each architecture splits
is in :mod:`mlxcluster.model.arch`).  For a Llama:

  * q/k/v/gate/up: split by output rows ("all-to-sharded"); each rank holds
    ``n_heads / N`` query heads, ``n_kv_heads / N`` KV heads and
    ``intermediate_size / N`` MLP channels, so its KV cache holds only its heads;
  * o/down: split by input columns ("sharded-to-all"), one ``all_sum`` each,
    i.e. two ``all_sum`` of a ``(batch, seq, hidden)`` activation per layer;
  * MoE layers (qwen3_moe, gpt_oss, deepseek, ...): every expert's channels split the same
    way (``shard_inplace`` on the stacked ``SwitchLinear``), the router replicated, and the
    MoE block's own ``all_sum`` after the weighted sum of experts;
  * MLA attention (deepseek): queries and the per-head latent up-projections split by heads,
    the compressed latent K/V replicated (so is its cache);
  * embedding and output head, tied or untied: vocabulary-parallel (Megatron-LM's
    vocab-parallel embedding, :class:`VocabParallelEmbedding` / :class:`VocabParallelHead`)
    when the vocabulary ``V`` divides by ``N``: each rank holds ``V/N`` rows, the
    lookup ends in one ``all_sum`` of ``(batch, seq, hidden)`` and the head in
    one ``all_gather`` of the ``(batch, seq, V/N)`` logit slices, so every
    rank ends with the same full ``(batch, seq, V)`` logits.  A ``V`` that ``N``
    does not divide stays replicated;
  * norms are replicated.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama

__all__ = ["TensorParallel", "LlamaModelTP", "tp_class", "VocabParallelEmbedding", "VocabParallelHead",
           "valid_world_sizes", "check_world_size", "WorldSizeError", "build_model"]

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


class WorldSizeError(ValueError):
    """The model cannot be split over the requested number of ranks."""


def _group_size(quantization: Optional[Dict[str, Any]], weight_format: str) -> Optional[int]:
    """Quantisation group size of packed weights (``None`` when they are dequantised or float)."""
    return quantization.get("group_size") if (quantization and weight_format == "quantized") else None


def _fits(config: Dict[str, Any], n: int, group_size: Optional[int]) -> bool:
    from .arch import row_parallel_inputs, split_dims

    if any(v % n for v in split_dims(config).values()):
        return False
    if group_size:
        # row-parallel (sharded-to-all) layers split their inputs: each rank's
        # slice must be whole quantisation groups.
        if any((w // n) % group_size for w in row_parallel_inputs(config) if w % n == 0):
            return False
    return True


def valid_world_sizes(config: Dict[str, Any], quantization: Optional[Dict[str, Any]] = None,
                      weight_format: str = "quantized") -> List[int]:
    """World sizes ``N`` this model can be tensor-parallel split into.

    ``N`` must divide every size the architecture's ``shard`` splits
    (:func:`mlxcluster.model.arch.split_dims`: attention heads, KV heads unless the
    attention is MLA, MLP and expert channels); with quantised weights (``weight_format``
    ``"quantized"`` and a ``quantization`` map) each rank's slice of the
    row-parallel inputs must also be whole quantisation groups.  The
    vocabulary need not divide: the head is then replicated.  An architecture
    whose mlx-lm class has no ``shard`` runs on one rank only.

    Returns:
        the valid ``N``, ascending, from 1 to the number of attention heads.
    """
    from .arch import ArchError, model_classes, split_dims

    if config.get("model_type"):  # (a bare dims dict, as in tests and older callers: a Llama)
        try:
            if not hasattr(model_classes(config)[0], "shard"):
                return [1]
        except ArchError:
            return [1]
    group_size = _group_size(quantization, weight_format)
    dims = split_dims(config)
    top = dims.get("attention heads") or max(dims.values(), default=1)
    return [n for n in range(1, top + 1) if _fits(config, n, group_size)]


def check_world_size(config: Dict[str, Any], n: int, quantization: Optional[Dict[str, Any]] = None,
                     weight_format: str = "quantized", name: str = "the model") -> None:
    """Check that world size ``n`` can split the model (see :func:`valid_world_sizes`).

    Raises:
        WorldSizeError: ``n`` is not valid; the one-line message names
            ``name``, its architecture, the sizes its ``shard`` splits, and the valid sizes.
    """
    from .arch import model_type, split_dims

    valid = valid_world_sizes(config, quantization, weight_format)
    if n not in valid:
        dims = split_dims(config)
        what = ", ".join(f"{v} {k}" if "heads" in k else f"{k} {v}" for k, v in dims.items())
        arch = model_type(config) if config.get("model_type") else "?"
        if valid == [1] and not dims:
            what = "mlx-lm has no tensor-parallel shard for it"
        gs = _group_size(quantization, weight_format)
        quant = f", {gs}-wide quantisation groups" if gs else ""
        raise WorldSizeError(
            f"world size {n} cannot split {name} ({arch}: {what}{quant}): "
            f"valid world sizes are {', '.join(map(str, valid))}"
        )


class VocabParallelEmbedding(nn.Module):
    """Token embedding (and tied output head) split by vocabulary rows.

    Rank ``r`` holds rows ``[r*V/N, (r+1)*V/N)`` (float ``Embedding`` or
    packed ``QuantizedEmbedding``); ``V`` must divide by ``N``.  Lookup
    (``__call__``): int ids ``(B, L)`` -> ``(B, L, hidden)`` in the weights'
    dtype; each rank embeds the ids in its range, zeros the rest, and one
    ``all_sum`` gives every rank the full embeddings (exact: one non-zero
    term per element).  Output head (``as_linear``): ``(..., hidden)`` ->
    ``(..., V)``; each rank computes its ``V/N`` logits and one
    ``all_gather`` assembles them, the same bytes on every rank.  Both are
    collectives: every rank must make the same calls in the same order.
    Megatron-LM's vocab-parallel embedding (Shoeybi et al. 2019, section 3).
    """

    def __init__(self, local: nn.Module, vocab_size: int, group: mx.distributed.Group):
        super().__init__()
        self.local = local
        self.group = group
        self.vocab_size = vocab_size
        self.n = group.size()
        self.part = vocab_size // self.n
        self.offset = group.rank() * self.part

    def __call__(self, ids: mx.array) -> mx.array:
        local_ids = ids - self.offset
        inside = (local_ids >= 0) & (local_ids < self.part)
        x = self.local(mx.where(inside, local_ids, 0))
        x = x * inside[..., None].astype(x.dtype)
        return mx.distributed.all_sum(x, group=self.group)

    def as_linear(self, h: mx.array) -> mx.array:
        local = self.local.as_linear(h)  # (..., V/N)
        lead = local.shape[:-1]
        gathered = mx.distributed.all_gather(local.reshape(1, -1, self.part), group=self.group)  # (N, M, V/N)
        return gathered.transpose(1, 0, 2).reshape(*lead, self.vocab_size)


def _slice_embedding(emb: nn.Module, start: int, stop: int) -> nn.Module:
    """Rows ``[start, stop)`` of an ``Embedding``/``QuantizedEmbedding`` as a new module."""
    if isinstance(emb, nn.QuantizedEmbedding):
        new = nn.QuantizedEmbedding(stop - start, emb.dims, group_size=emb.group_size, bits=emb.bits,
                                    mode=getattr(emb, "mode", "affine"))
        new.weight = emb.weight[start:stop]
        new.scales = emb.scales[start:stop]
        if emb.get("biases") is not None:
            new.biases = emb.biases[start:stop]
        return new
    new = nn.Embedding(stop - start, emb.weight.shape[1])
    new.weight = emb.weight[start:stop]
    return new


class VocabParallelHead(nn.Module):
    """An untied output head (``lm_head``) split by vocabulary rows.

    Rank ``r`` holds rows ``[r*V/N, (r+1)*V/N)`` of the ``(V, hidden)`` head (float ``Linear``
    or packed ``QuantizedLinear``); ``V`` must divide by ``N``.  Call: ``(..., hidden)`` ->
    ``(..., V)``: each rank computes its ``V/N`` logits and one ``all_gather`` assembles them,
    the same bytes on every rank (a collective: every rank makes the same calls).
    Megatron-LM's vocab-parallel output layer (Shoeybi et al. 2019, section 3).
    """

    def __init__(self, local: nn.Module, vocab_size: int, group: mx.distributed.Group):
        super().__init__()
        self.local = local
        self.group = group
        self.vocab_size = vocab_size
        self.part = vocab_size // group.size()

    def __call__(self, h: mx.array) -> mx.array:
        local = self.local(h)  # (..., V/N)
        lead = local.shape[:-1]
        gathered = mx.distributed.all_gather(local.reshape(1, -1, self.part), group=self.group)  # (N, M, V/N)
        return gathered.transpose(1, 0, 2).reshape(*lead, self.vocab_size)


def _slice_linear(lin: nn.Module, start: int, stop: int) -> nn.Module:
    """Output rows ``[start, stop)`` of a ``Linear``/``QuantizedLinear`` as a new module."""
    if isinstance(lin, nn.QuantizedLinear):
        new = nn.QuantizedLinear(lin.group_size, stop - start, bias="bias" in lin, group_size=lin.group_size,
                                 bits=lin.bits, mode=getattr(lin, "mode", "affine"))
        new.weight, new.scales = lin.weight[start:stop], lin.scales[start:stop]
        if lin.get("biases") is not None:
            new.biases = lin.biases[start:stop]
        else:
            new.biases = None
    else:
        new = nn.Linear(1, stop - start, bias="bias" in lin)
        new.weight = lin.weight[start:stop]
    if "bias" in lin:
        new.bias = lin.bias[start:stop]
    return new


def _packed_group_size(model: nn.Module) -> Optional[int]:
    """Quantisation group size of the model's packed row-parallel layers (``None``: float)."""
    fallback = None
    for name, m in model.named_modules():
        gs = getattr(m, "group_size", None) if "Quantized" in type(m).__name__ else None
        if gs and (name.endswith("o_proj") or name.endswith("down_proj")):
            return gs
        fallback = fallback or gs
    return fallback


class TensorParallel:
    """Mixed into an mlx-lm ``Model`` class (:func:`tp_class`): the model holds only this
    rank's ``1/N`` shard.

    Call: ``model(inputs, cache)`` with ``inputs`` int32 ``(batch, seq)`` ->
    logits ``(batch, seq, vocab)`` in the widest float dtype of the parameters
    (float32 for float32 or dequantised weights; float16/bfloat16 for those weight
    formats).  Every rank must make the same calls in the same order: the row-parallel
    layers' ``all_sum``, the MoE blocks' ``all_sum`` and the vocabulary-parallel
    embedding's ``all_sum`` / head's ``all_gather`` are collectives.

    Attributes:
        group: the MLX distributed group (``None`` for a single rank).
        rank, world_size: this rank and N.
    """

    group: Optional[mx.distributed.Group] = None
    rank = 0
    world_size = 1

    # -- the language model inside (wrapped multimodal / text_config models hold one) --
    @property
    def _lm(self):
        inner = getattr(self, "language_model", None)
        return inner if isinstance(inner, nn.Module) else self

    @property
    def _head(self) -> Optional[nn.Module]:
        """The untied output head (``lm_head``), ``None`` when the embedding is the head."""
        lm = self._lm
        return lm["lm_head"] if "lm_head" in lm else None

    @property
    def split_head(self) -> bool:
        """True when ``model(x) == head(hidden(x))`` with :meth:`hidden` the inner model and
        :meth:`head` the (tied or untied) output head: the engine then runs the head on the
        positions it needs only (the last one of a prefill chunk)."""
        head = self._head
        if head is None:
            return hasattr(self._lm.model.embed_tokens, "as_linear")
        return isinstance(head, (nn.Linear, nn.QuantizedLinear, VocabParallelHead))

    def hidden(self, inputs: mx.array, cache=None) -> mx.array:
        """The final-norm hidden states ``(batch, seq, hidden)`` (every collective of a full
        call except the output head's)."""
        return self._lm.model(inputs, cache=cache)

    def head(self, h: mx.array) -> mx.array:
        """Logits ``(..., vocab)`` of hidden states ``h`` (:attr:`split_head` models only)."""
        head = self._head
        return head(h) if head is not None else self._lm.model.embed_tokens.as_linear(h)

    def model_config(self) -> Dict[str, Any]:
        """The model's args as a config dict (for :func:`check_world_size`)."""
        import dataclasses

        cfg = dict(vars(self.args))
        inner = cfg.get("text_config")
        if dataclasses.is_dataclass(inner):
            cfg["text_config"] = dict(vars(inner))
        return cfg

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """Shard in place across ``group`` (default: ``mx.distributed.init()``):
        the architecture's own mlx-lm ``shard`` for attention, MLP and experts, then the
        embedding/head by vocabulary rows (see the module docstring).  Size 1 shards nothing.

        Raises:
            WorldSizeError: a size the architecture splits is not divisible by N, or
                (quantised weights) a rank's row-parallel inputs are not whole
                quantisation groups.
        """
        group = group or mx.distributed.init()
        n = group.size()
        gs = _packed_group_size(self)
        check_world_size(self.model_config(), n, {"group_size": gs} if gs else None,
                         "quantized" if gs else "float32")
        self.group, self.rank, self.world_size = group, group.rank(), n
        if n > 1:
            super().shard(group)
            self._shard_vocab(group)

    @property
    def vocab_parallel(self) -> bool:
        """True when the embedding/output head is split over the ranks (its
        collectives then run on every rank, so ranks N compute the head too)."""
        head = self._head
        if head is not None and not isinstance(head, (nn.Linear, nn.QuantizedLinear)):
            return True  # split by us, or by the architecture's own shard (qwen3_5)
        inner = getattr(self._lm, "model", None)
        return isinstance(getattr(inner, "embed_tokens", None), VocabParallelEmbedding)

    @property
    def logits_replicated(self) -> bool:
        """True when every rank computes the same full logits bit for bit: one
        rank, or a vocabulary-parallel head (its ``all_gather`` concatenates the
        same bytes on every rank)."""
        return self.world_size == 1 or self.vocab_parallel

    def _shard_vocab(self, group) -> None:
        """Split the embedding and the (tied or untied) output head by vocabulary rows when
        the vocabulary divides evenly."""
        n, r = group.size(), group.rank()
        lm = self._lm
        inner = getattr(lm, "model", None)
        emb = getattr(inner, "embed_tokens", None)
        if not isinstance(emb, (nn.Embedding, nn.QuantizedEmbedding)):
            return  # a pipeline stage that neither embeds nor runs the head, or an unusual embedding
        vocab = emb.weight.shape[0]
        if vocab % n:
            return
        part = vocab // n
        head = self._head
        if head is not None and not isinstance(head, (nn.Linear, nn.QuantizedLinear)):
            return  # the architecture split its head itself
        inner.embed_tokens = VocabParallelEmbedding(_slice_embedding(emb, r * part, (r + 1) * part), vocab, group)
        if head is not None and head.weight.shape[0] == vocab:
            lm.lm_head = VocabParallelHead(_slice_linear(head, r * part, (r + 1) * part), vocab, group)

    def parameter_bytes(self) -> int:
        """Bytes held by this rank's parameters."""
        return sum(v.nbytes for _, v in tree_flatten(self.parameters()))


class LlamaModelTP(TensorParallel, llama.Model):
    """mlx-lm's Llama ``Model`` holding only this rank's 1/N shard (see :class:`TensorParallel`).

    The pipeline (:mod:`mlxcluster.model.pp`), disaggregation (:mod:`~mlxcluster.model.afd`,
    :mod:`mlxcluster.engine.pd`) and compiled-decode (:mod:`mlxcluster.engine.compiled`) paths
    are written for this class.
    """

    @property
    def compilable(self) -> bool:
        """Full attention in every layer: :class:`~mlxcluster.engine.compiled.CompiledGreedyStep` applies."""
        return not self.args.layer_types or all(t == "full_attention" for t in self.args.layer_types)


_TP_CLASSES: Dict[type, type] = {llama.Model: LlamaModelTP}


def tp_class(model_cls: type) -> type:
    """The :class:`TensorParallel` subclass of an mlx-lm ``Model`` class (one per class)."""
    if model_cls not in _TP_CLASSES:
        _TP_CLASSES[model_cls] = type(f"{model_cls.__name__}TP", (TensorParallel, model_cls),
                                      {"__module__": __name__, "__doc__": TensorParallel.__doc__})
    return _TP_CLASSES[model_cls]


def infer_quant_config(path: str, module: nn.Module, weights: dict) -> dict:
    """The ``group_size``, ``bits`` and ``mode`` a saved weight was packed with, for a path the
    quantization map does not name: mlx-lm's ``mlx_lm.utils.infer_quant_config`` (0.32), copied
    because ``mlx_lm.utils`` imports ``transformers`` at its top (~0.7 s of every rank's start);
    ``tests/test_models.py`` checks the two agree.

    Raises:
        ValueError: scales of a mode that no (bits, group size) pair names.
    """
    scales = weights[f"{path}.scales"]
    in_dims = module.weight.shape[-1]
    group_size = in_dims // scales.shape[-1]
    bits = (weights[f"{path}.weight"].shape[-1] * 32) // in_dims
    if scales.dtype != mx.uint8:  # only affine keeps the scales in the weight dtype
        return {"group_size": group_size, "bits": bits, "mode": "affine"}
    modes = {(4, 16): "nvfp4", (4, 32): "mxfp4", (8, 32): "mxfp8"}
    if (bits, group_size) in modes:
        return {"group_size": group_size, "bits": bits, "mode": modes[(bits, group_size)]}
    raise ValueError(f"Cannot infer the quantization mode of {path}: {bits} bits with group size {group_size}.")


def build_model(config: Dict[str, Any], weights: Dict[str, mx.array],
                quantization: Optional[Dict[str, Any]], weight_format: str = "quantized",
                group: Optional[mx.distributed.Group] = None, consume_weights: bool = False,
                prepare: Optional[Callable[[TensorParallel], None]] = None) -> TensorParallel:
    """Build this rank's shard of the model: mlx-lm's class for ``config``'s architecture
    (:func:`mlxcluster.model.arch.model_classes`) with :class:`TensorParallel` mixed in.

    Args:
        config: the model's config dict (mlx-lm's ``config.json``).
        weights: full (unsharded) parameter path -> array, as saved by mlx-lm or read from a
            GGUF (passed through the architecture's ``sanitize``, as ``mlx_lm.utils.load_model``
            does); quantised modules as ``weight``/``scales``/``biases``.  Lazily loaded
            arrays (``mx.load``) are best: only this rank's slices are ever materialised.
        quantization: mlx-lm quantisation map (default ``group_size``/``bits``/``mode``
            plus per-module overrides), or ``None``.
        weight_format: ``"quantized"`` keeps the packed weights;
            ``"float32"``/``"float16"``/``"bfloat16"`` dequantise at load.
        group: distributed group to shard over; ``None`` or size 1 = no sharding.
        consume_weights: empty ``weights`` once the model holds them, so each
            full (unsharded) tensor is freed as soon as this rank's slice of it
            is materialised (lower peak memory while loading).
        prepare: called with the model once the (packed) weights are loaded, before
            sharding, dequantisation and evaluation: a pipeline stage drops the layers it
            does not run here (:func:`mlxcluster.model.pp.prune_to_stage`), so they are
            never materialised.
    Returns:
        The evaluated model, holding only this rank's shard.
    Raises:
        WorldSizeError: the group size cannot split the model.
        ValueError: unknown ``weight_format``, an architecture mlx-lm lacks, or weights
            that do not fit.
    """
    from .arch import model_classes

    if weight_format not in ("quantized", *_DTYPES):
        raise ValueError(f"unknown weight format {weight_format!r}")
    model_cls, args_cls = model_classes(config)
    model = tp_class(model_cls)(args_cls.from_dict(config))
    if hasattr(model, "sanitize"):
        weights_in = weights
        weights = model.sanitize(dict(weights))
        if consume_weights:
            weights_in.clear()
    if quantization:
        def predicate(path, module):
            if path in quantization and isinstance(quantization[path], dict):
                return quantization[path]
            if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
                return False
            return infer_quant_config(path, module, weights)

        nn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"],
                    mode=quantization.get("mode", "affine"), class_predicate=predicate)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    if consume_weights:
        weights.clear()
    if prepare is not None:
        prepare(model)
    # Shard first (while still packed), then dequantise only this rank's
    # slice: peak memory stays ~ packed model + this rank's float shard.
    if group is not None and group.size() > 1:
        model.shard(group)
    elif group is not None:
        model.group, model.rank, model.world_size = group, 0, 1
    if weight_format != "quantized":
        dtype = _DTYPES[weight_format]
        _dequantize_modules(model, dtype)
        model.update(_cast_tree(model.parameters(), dtype))
    # Evaluate tensor by tensor so that at most one full (unsharded) tensor is
    # materialised at a time before its slice is kept: peak ~ this rank's share + one tensor.
    for _, v in tree_flatten(model.parameters()):
        mx.eval(v)
    return model


def _dequantized(m: nn.Module, dtype) -> mx.array:
    """``dequantize(weight)`` of a quantised module in ``dtype`` (float scales and biases
    cast to ``dtype`` first: float32 arithmetic matches llama.cpp's ``d * q + m``)."""
    def cast(a):
        return a.astype(dtype) if a is not None and mx.issubdtype(a.dtype, mx.floating) else a

    return mx.dequantize(m["weight"], cast(m["scales"]), cast(m.get("biases")), group_size=m.group_size,
                         bits=m.bits, mode=getattr(m, "mode", "affine")).astype(dtype)


def _dequantize_modules(model: nn.Module, dtype) -> None:
    """Replace every quantised layer (plain or tensor-parallel) by its float
    twin holding ``dequantize(weight)`` computed in ``dtype`` (float32
    arithmetic matches llama.cpp's ``d * q + m`` dequantisation)."""
    from mlx.nn.layers.distributed import (AllToShardedLinear, QuantizedAllToShardedLinear,
                                           QuantizedShardedToAllLinear, ShardedToAllLinear)
    from mlx.utils import tree_unflatten
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    replacements = []
    for name, m in model.named_modules():
        if isinstance(m, QuantizedSwitchLinear):  # stacked experts (E, out, in), sharded in place
            w = _dequantized(m, dtype)
            experts, out_dims, in_dims = w.shape
            new = SwitchLinear(in_dims, out_dims, experts, bias="bias" in m)
            new.weight = w
            if "bias" in m:
                new.bias = m["bias"].astype(dtype)
            replacements.append((name, new))
            continue
        if not isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding,
                              QuantizedAllToShardedLinear, QuantizedShardedToAllLinear)):
            continue
        w = _dequantized(m, dtype)
        out_dims, in_dims = w.shape
        has_bias = "bias" in m
        if isinstance(m, nn.QuantizedEmbedding):
            new = nn.Embedding(out_dims, in_dims)
        elif isinstance(m, QuantizedAllToShardedLinear):
            new = AllToShardedLinear(in_dims, out_dims * m.group.size(), has_bias, group=m.group)
        elif isinstance(m, QuantizedShardedToAllLinear):
            new = ShardedToAllLinear(in_dims * m.group.size(), out_dims, has_bias, group=m.group)
        else:
            new = nn.Linear(in_dims, out_dims, bias=has_bias)
        new.weight = w
        if has_bias:
            new.bias = m["bias"].astype(dtype)
        replacements.append((name, new))
    if replacements:
        model.update_modules(tree_unflatten(replacements))


def _cast_tree(tree, dtype):
    if isinstance(tree, dict):
        return {k: _cast_tree(v, dtype) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_cast_tree(v, dtype) for v in tree]
    if isinstance(tree, mx.array) and mx.issubdtype(tree.dtype, mx.floating):
        return tree.astype(dtype)
    return tree


def weight_bytes(model) -> int:
    """Bytes of ``model``'s parameters as loaded on this rank (its shard), for memory reports.

    Returns 0 for a model without ``parameters()`` (a pipeline wrapper reports its stage's)."""
    from mlx.utils import tree_flatten

    params = getattr(model, "parameters", None)
    if params is None:
        return 0
    return int(sum(v.nbytes for _, v in tree_flatten(params()) if hasattr(v, "nbytes")))

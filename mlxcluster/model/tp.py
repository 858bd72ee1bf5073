"""LlamaModelTP: mlx-lm's Llama, sharded tensor-parallel over an MLX group.

Sharding (Megatron-LM style, Shoeybi et al. 2019, as implemented by mlx-lm's
``Model.shard`` with ``mlx.nn.layers.distributed.shard_linear``):

  * q/k/v/gate/up: split by output rows ("all-to-sharded"); each rank holds
    ``n_heads / N`` query heads, ``n_kv_heads / N`` KV heads and
    ``intermediate_size / N`` MLP channels, so its KV cache holds only its heads;
  * o/down: split by input columns ("sharded-to-all"), one ``all_sum`` each,
    i.e. two ``all_sum`` of a ``(batch, seq, hidden)`` activation per layer;
  * tied embedding / output head: vocabulary-parallel (Megatron-LM's
    vocab-parallel embedding, :class:`VocabParallelEmbedding`) when the
    vocabulary ``V`` divides by ``N``: each rank holds ``V/N`` rows, the
    lookup ends in one ``all_sum`` of ``(batch, seq, hidden)`` and the head in
    one ``all_gather`` of the ``(batch, seq, V/N)`` logit slices, so every
    rank ends with the same full ``(batch, seq, V)`` logits.  An untied
    ``lm_head``, or a ``V`` that ``N`` does not divide, stays replicated;
  * norms are replicated.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama

__all__ = ["LlamaModelTP", "valid_world_sizes", "check_world_size", "WorldSizeError", "build_model"]

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


class WorldSizeError(ValueError):
    """The model cannot be split over the requested number of ranks."""


def _split_dims(config: Dict[str, Any]) -> Dict[str, int]:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return {
        "attention heads": config["num_attention_heads"],
        "KV heads": config.get("num_key_value_heads") or config["num_attention_heads"],
        "intermediate size": config["intermediate_size"],
        "_o_in": config["num_attention_heads"] * head_dim,
    }


def _fits(config: Dict[str, Any], n: int, group_size: Optional[int]) -> bool:
    dims = _split_dims(config)
    if any(v % n for v in dims.values()):
        return False
    if group_size:
        # row-parallel (sharded-to-all) layers split their inputs: each rank's
        # slice must be whole quantisation groups.
        if (dims["_o_in"] // n) % group_size or (dims["intermediate size"] // n) % group_size:
            return False
    return True


def valid_world_sizes(config: Dict[str, Any], quantization: Optional[Dict[str, Any]] = None,
                      weight_format: str = "quantized") -> List[int]:
    """World sizes ``N`` this model can be tensor-parallel split into.

    ``N`` must divide the attention heads, the KV heads and the MLP
    intermediate size; with quantised weights (``weight_format``
    ``"quantized"`` and a ``quantization`` map) each rank's slice of the
    row-parallel inputs must also be whole quantisation groups.  The
    vocabulary need not divide: the head is then replicated.

    Returns:
        the valid ``N``, ascending, from 1 to the number of attention heads.
    """
    group_size = quantization.get("group_size") if (quantization and weight_format == "quantized") else None
    heads = config["num_attention_heads"]
    return [n for n in range(1, heads + 1) if _fits(config, n, group_size)]


def check_world_size(config: Dict[str, Any], n: int, quantization: Optional[Dict[str, Any]] = None,
                     weight_format: str = "quantized", name: str = "the model") -> None:
    """Check that world size ``n`` can split the model (see :func:`valid_world_sizes`).

    Raises:
        WorldSizeError: ``n`` is not valid; the one-line message names
            ``name``, its head counts and intermediate size, and the valid sizes.
    """
    valid = valid_world_sizes(config, quantization, weight_format)
    if n not in valid:
        dims = _split_dims(config)
        raise WorldSizeError(
            f"world size {n} cannot split {name} ({dims['attention heads']} attention heads, "
            f"{dims['KV heads']} KV heads, intermediate size {dims['intermediate size']}): "
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


class LlamaModelTP(llama.Model):
    """mlx-lm's Llama ``Model`` holding only this rank's 1/N shard.

    Call: ``model(inputs, cache)`` with ``inputs`` int32 ``(batch, seq)`` ->
    logits ``(batch, seq, vocab)`` in the widest float dtype of the parameters
    (float32 for the GGUF's weights, quantised or float32; float16/bfloat16
    for those weight formats).  Every rank must make the same calls in the
    same order: the row-parallel layers' ``all_sum`` and the
    vocabulary-parallel embedding's ``all_sum`` / ``all_gather`` are
    collectives.

    Attributes:
        group: the MLX distributed group (``None`` for a single rank).
        rank, world_size: this rank and N.
    """

    def __init__(self, args: llama.ModelArgs):
        super().__init__(args)
        self.group: Optional[mx.distributed.Group] = None
        self.rank = 0
        self.world_size = 1

    def shard(self, group: Optional[mx.distributed.Group] = None):
        """Shard in place across ``group`` (default: ``mx.distributed.init()``):
        mlx-lm's Llama ``shard`` for the attention and MLP layers, then the
        tied embedding/head by vocabulary rows (see the module docstring).
        Size 1 shards nothing.

        Raises:
            WorldSizeError: heads, KV heads or MLP size not divisible by N, or
                (quantised weights) a rank's row-parallel inputs not whole
                quantisation groups.
        """
        group = group or mx.distributed.init()
        n = group.size()
        cfg = {
            "num_attention_heads": self.args.num_attention_heads,
            "num_key_value_heads": self.args.num_key_value_heads,
            "intermediate_size": self.args.intermediate_size,
            "hidden_size": self.args.hidden_size,
            "head_dim": self.args.head_dim,
        }
        gs = None
        first = self.model.layers[0].self_attn.o_proj
        if isinstance(first, nn.QuantizedLinear):
            gs = first.group_size
        check_world_size(cfg, n, {"group_size": gs} if gs else None, "quantized" if gs else "float32")
        self.group, self.rank, self.world_size = group, group.rank(), n
        if n > 1:
            super().shard(group)
            self._shard_vocab(group)

    @property
    def vocab_parallel(self) -> bool:
        """True when the embedding/output head is split over the ranks (its
        collectives then run on every rank, so ranks N compute the head too)."""
        return isinstance(self.model.embed_tokens, VocabParallelEmbedding)

    @property
    def logits_replicated(self) -> bool:
        """True when every rank computes the same full logits bit for bit: one
        rank, or a vocabulary-parallel head (its ``all_gather`` concatenates the
        same bytes on every rank).  Ranks can then sample the next token
        themselves (self-sampling, see ``proto/mlxcluster.proto``)."""
        return self.world_size == 1 or self.vocab_parallel

    def _shard_vocab(self, group) -> None:
        """Split the tied embedding/output head by vocabulary rows when the
        vocabulary divides evenly (untied heads stay replicated)."""
        n, r = group.size(), group.rank()
        vocab = self.args.vocab_size
        if not self.args.tie_word_embeddings or vocab % n or self.model.embed_tokens is None:
            return  # (None: a pipeline stage that neither embeds nor runs the head)
        part = vocab // n
        local = _slice_embedding(self.model.embed_tokens, r * part, (r + 1) * part)
        self.model.embed_tokens = VocabParallelEmbedding(local, vocab, group)

    def parameter_bytes(self) -> int:
        """Bytes held by this rank's parameters."""
        return sum(v.nbytes for _, v in tree_flatten(self.parameters()))


def build_model(config: Dict[str, Any], weights: Dict[str, mx.array],
                quantization: Optional[Dict[str, Any]], weight_format: str = "quantized",
                group: Optional[mx.distributed.Group] = None, consume_weights: bool = False,
                prepare: Optional[Callable[[LlamaModelTP], None]] = None) -> LlamaModelTP:
    """Build a :class:`LlamaModelTP` for this rank from full (unsharded) weights.

    Args:
        config: mlx-lm Llama config dict.
        weights: mlx-lm parameter path -> array; quantised modules as
            ``weight``/``scales``/``biases``.
        quantization: mlx-lm quantisation map (default ``group_size``/``bits``
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
        ValueError: unknown ``weight_format`` or weights that do not fit.
    """
    if weight_format not in ("quantized", *_DTYPES):
        raise ValueError(f"unknown weight format {weight_format!r}")
    args = llama.ModelArgs.from_dict(config)
    model = LlamaModelTP(args)
    if quantization:
        def predicate(path, module):
            if path in quantization and isinstance(quantization[path], dict):
                return quantization[path]
            return hasattr(module, "to_quantized") and f"{path}.scales" in weights

        nn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"],
                    class_predicate=predicate)
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
    # Evaluate layer by layer so that at most one full (unsharded) layer is
    # materialised at a time before its slice is kept.
    mx.eval([m.parameters() for m in (model.model.embed_tokens, model.model.norm) if m is not None])
    for layer in model.model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    return model


def _dequantize_modules(model: nn.Module, dtype) -> None:
    """Replace every quantised layer (plain or tensor-parallel) by its float
    twin holding ``dequantize(weight)`` computed in ``dtype`` (float32
    arithmetic matches llama.cpp's ``d * q + m`` dequantisation)."""
    from mlx.nn.layers.distributed import (AllToShardedLinear, QuantizedAllToShardedLinear,
                                           QuantizedShardedToAllLinear, ShardedToAllLinear)
    from mlx.utils import tree_unflatten

    replacements = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding,
                              QuantizedAllToShardedLinear, QuantizedShardedToAllLinear)):
            continue
        biases = m.get("biases")
        w = mx.dequantize(m["weight"], m["scales"].astype(dtype),
                          None if biases is None else biases.astype(dtype),
                          group_size=m.group_size, bits=m.bits, mode=getattr(m, "mode", "affine")).astype(dtype)
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

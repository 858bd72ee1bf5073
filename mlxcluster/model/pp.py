"""One pipeline stage of mlx-lm's Llama: layers ``start..end`` of the model, plus the token
embedding on the stage that holds layer 0 and the final norm + output head on the output
stage (``model/layout.py``'s :class:`~mlxcluster.model.layout.LayerRange`).

The forward pass is mlx-lm's ``LlamaModel.__call__`` / ``Model.__call__`` (mlx_lm 0.32.2
``models/llama.py``) cut at the stage's boundaries: same modules, same masks
(``create_attention_mask`` per attention type), same order of operations, so the stages run
one after another reproduce the whole model's logits bit for bit (tests/test_pp.py).  A
stage may itself be tensor-parallel: the model it wraps is a
:class:`~mlxcluster.model.tp.LlamaModelTP` sharded over the stage's group, whose collectives
then run inside the stage.

What travels between stages: the hidden states, float ``(batch, seq, hidden)`` in the
model's activation dtype -- for the embedded model one decode token is ``(1, 1, 576)``
float32, 2,304 bytes per hop.
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask

from .layout import LayerRange, LayoutError
from .tp import LlamaModelTP

__all__ = ["PipelineStage", "PipelinedModel", "prune_to_stage"]


def prune_to_stage(model: LlamaModelTP, layers: LayerRange) -> None:
    """Drop from ``model`` (in place) what the stage ``layers`` never runs: the other
    transformer blocks, the token embedding unless the stage embeds (or is the output stage
    of a tied head), the final norm and output head unless it is the output stage.  Called
    before the weights are evaluated (``build_model(prepare=...)``), the dropped layers are
    never materialised: a stage's peak memory is its own share of the model.

    Raises:
        LayoutError: the range does not fit the model.
    """
    inner = model.model
    n = len(inner.layers)
    if not 0 <= layers.start <= layers.end < n or layers.output != (layers.end == n - 1):
        raise LayoutError(f"layer range {layers} does not fit a model with layers 0..{n - 1}")
    inner.layers = inner.layers[layers.start: layers.end + 1]
    if not (layers.embeds or (layers.output and model.args.tie_word_embeddings)):
        inner.embed_tokens = None
    if not layers.output:
        inner.norm = None
        if hasattr(model, "lm_head"):
            model.lm_head = None
    model.stage_layers = layers


class PipelineStage:
    """Layers ``layers.start .. layers.end`` of ``model`` (the others are dropped from it).

    Args:
        model: the whole model for this rank (TP-sharded over the stage's group, or not), or one
            already cut to ``layers`` by :func:`prune_to_stage`.
        layers: the stage's range; ``layers.end`` must be the model's last layer iff ``layers.output``.
        prune: drop the other layers from ``model`` (False: ``--local-decode``'s rank 0, which
            keeps every layer to decode alone and runs this stage for the pipeline's prefill).
    Raises:
        LayoutError: the range does not fit the model.

    Call: ``stage(inputs, cache)`` where ``inputs`` is int32 token ids ``(batch, seq)`` on the
    stage that embeds, else the previous stage's hidden states ``(batch, seq, hidden)``;
    ``cache`` holds one KV cache per layer of this stage (``None``: no cache).  Returns the
    hidden states ``(batch, seq, hidden)``, or on the output stage the logits ``(batch, seq, vocab)``
    (``(batch, 1, vocab)`` of the last position with ``last_only``).  ``after_layer(layer, h)``,
    if given, is called after each block is built (``engine/pd.py`` evaluates and streams there).
    """

    def __init__(self, model: LlamaModelTP, layers: LayerRange, prune: bool = True):
        inner = model.model
        pruned = getattr(model, "stage_layers", None)
        if pruned is not None and pruned != layers:
            raise LayoutError(f"the model was cut to layers {pruned}, not {layers}")
        n = len(inner.layers)
        if pruned is None and (not 0 <= layers.start <= layers.end < n or layers.output != (layers.end == n - 1)):
            raise LayoutError(f"layer range {layers} does not fit a model with layers 0..{n - 1}")
        self.model = model
        self.layers = layers
        self.blocks = list(inner.layers) if pruned is not None else inner.layers[layers.start: layers.end + 1]
        self.tied = bool(model.args.tie_word_embeddings)
        self.fa_idx = next((i for i, b in enumerate(self.blocks) if not b.use_sliding), None)
        self.swa_idx = next((i for i, b in enumerate(self.blocks) if b.use_sliding), None)
        if prune and pruned is None:  # the caller holds no other reference: the memory goes
            prune_to_stage(model, layers)

    @property
    def n_layers(self) -> int:
        """Transformer layers in this stage (one KV cache each)."""
        return len(self.blocks)

    def __call__(self, inputs: mx.array, cache: Optional[List] = None, last_only: bool = False,
                 after_layer=None) -> mx.array:
        inner = self.model.model
        h = inner.embed_tokens(inputs) if self.layers.embeds else inputs
        if cache is None:
            cache = [None] * len(self.blocks)
        fa_mask = create_attention_mask(h, cache[self.fa_idx]) if self.fa_idx is not None else None
        swa_mask = None
        if self.swa_idx is not None:
            swa_mask = create_attention_mask(h, cache[self.swa_idx], window_size=self.model.args.sliding_window)
        for i, (block, c) in enumerate(zip(self.blocks, cache)):
            h = block(h, swa_mask if block.use_sliding else fa_mask, cache=c)
            if after_layer is not None:  # prefill/decode disaggregation streams each layer's K/V
                after_layer(self.layers.start + i, h)
        if not self.layers.output:
            return h
        if last_only:  # the head on the last position only: (seq - 1) x hidden x vocab MACs saved
            h = h[:, -1:]
        h = inner.norm(h)
        return inner.embed_tokens.as_linear(h) if self.tied else self.model.lm_head(h)


class PipelinedModel:
    """A pipeline of stages that every rank calls like the whole model.

    Stage ``i`` of ``route`` holds ranks ``first_rank .. first_rank + tp - 1``; this rank runs its
    stage's :class:`PipelineStage` (tensor-parallel over ``stage_group`` when ``tp > 1``).  One
    call, on every rank with the same token ids ``(batch, seq)``:

    1. the stage holding layer 0 embeds the ids; every other stage's *leader* (its first rank)
       receives the previous stage's hidden states ``(batch, seq, hidden)`` from that stage's
       leader (``mx.distributed.recv``), and a tensor-parallel stage spreads them to its other
       ranks with an ``all_sum`` over the stage (zeros from the others: exact);
    2. the stage runs its layers (a tensor-parallel stage's collectives inside it) and, unless it
       is the output stage, its leader sends the result to the next stage's leader (next in rank
       order, wrapping to rank 0: with single-rank stages these are neighbours, which MLX's ring
       requires; tensor-parallel stages need a backend that can split groups, i.e. MPI);
    3. on a reverse route with ``relay`` (the default), rank 0 owns the output stage: it keeps
       the logits and samples, and ranks N get the tokens in the plan's decode entries (the token relay: exo #2229, ds4) -- no logits move.
       Otherwise the output stage leader's logits are summed over the whole group, zeros from
       every other rank (``x + 0`` is exact), so every rank holds them bit for bit (as with a
       vocabulary-parallel head); rank 0 samples and ranks N follow its frames either way.  (A
       forward route cannot relay: rank 0 would receive the logits after its own send inside
       one lazy graph, and MLX's ``recv`` has no input to order it by.)

    Returns the last position's logits ``(batch, 1, vocab)`` with ``last_only`` (a prefill: all the
    engine uses), else every position's ``(batch, seq, vocab)`` (a decode step, ``seq`` 1, or a
    speculative verify step, ``seq`` ``1 + k``: every draft token scored in one pass); on a rank N of a
    relaying reverse route, zeros of that shape.  Bytes per hop per decode token: ``batch x hidden x 4``
    (2,304 for the embedded model, float32) plus the frame carrying the token; without
    ``relay`` also the ``all_sum`` of ``batch x vocab`` logits (196,608 B).  Measured on the
    MLX ring, 2 stages: 3,636 B per decode token on loopback with ``relay``, 413,967 B
    without, at the same tokens/s (BENCHMARKS.md).

    Args:
        stage: this rank's stage.
        route: every stage, rank order (:class:`~mlxcluster.model.layout.Route`).
        group: the MLX group of ``route.world_size`` ranks.
        stage_group: this rank's stage as a group (``group.split`` by stage), for ``tp > 1``.
        epoch: the formation epoch (``promptTokens`` carries it; a KV handoff is checked against it).
        local_decode: ``--local-decode``: prompts are prefilled through the pipeline, then every
            other stage hands its K/V to rank 0, which decodes alone (its stage was built with
            ``prune=False``, so ``stage.model`` holds every layer).
        identity: this rank's :class:`ModelIdentity` (``--local-decode``: compared at each handoff).
        relay: on a reverse route only rank 0 keeps the logits (see 3. above); ``False``: every rank gets them.
    Raises:
        LayoutError: the route's size is not the group's, or a tensor-parallel stage has no group.
    """

    vocab_parallel = True  # every rank runs every call (collectives inside)
    takes_last_only = True  # the output stage cuts the positions itself: the engine passes last_only

    def __init__(self, stage: PipelineStage, route, group, stage_group=None, epoch: str = "",
                 local_decode: bool = False, identity=None, relay: bool = True):
        n = group.size()
        # Relay only where rank 0 owns the output: elsewhere rank 0 would have to receive the
        # logits after its own send inside one lazy graph, and MLX's recv takes no input that
        # could order it after the send (measured: a deadlock on 0:14,15:output).
        self.logits_replicated = not (relay and route.stages[0].layers.output)
        if local_decode:
            route.check_local_decode()
        self.epoch = epoch
        self.local_decode = local_decode
        self.identity = identity
        if route.world_size != n:
            raise LayoutError(f"the route has {route.world_size} ranks, the group {n}")
        self.stage = stage
        self.route = route
        self.group = group
        self.rank = group.rank()
        self.world_size = n
        me = route.stage_of(self.rank)
        if me.tp > 1 and (stage_group is None or stage_group.size() != me.tp):
            raise LayoutError(f"stage {me.index} is tensor-parallel over {me.tp} ranks and needs its own group")
        self.stage_group = stage_group if me.tp > 1 else None
        self.leader = self.rank == me.first_rank
        stages = route.stages
        self.prev = stages[(me.index - 1) % len(stages)].first_rank
        self.next = stages[(me.index + 1) % len(stages)].first_rank
        args = stage.model.args
        self.args = args
        self.hidden_size = args.hidden_size
        self.vocab_size = args.vocab_size
        self.dtype = stage.blocks[0].input_layernorm.weight.dtype  # activations (float32 for GGUF/float32)

    @property
    def layers(self):
        """This stage's transformer blocks (one KV cache each: ``make_prompt_cache``)."""
        return self.stage.blocks

    def parameter_bytes(self) -> int:
        return self.stage.model.parameter_bytes()

    def __call__(self, inputs: mx.array, cache: Optional[List] = None, last_only: bool = True) -> mx.array:
        """One forward pass of ``inputs`` (int32 token ids ``(batch, seq)``, the same on every rank) through
        the pipeline, each stage on its own ``cache`` (one KV cache per layer of the stage).  Returns float
        logits ``(batch, 1, vocab)`` with ``last_only``, else ``(batch, seq, vocab)`` (zeros on a rank N of
        a relaying route); every rank must pass the same ``last_only``."""
        batch, seq = inputs.shape[:2]
        if self.stage.layers.embeds:
            x = inputs
        else:
            shape = (batch, seq, self.hidden_size)
            x = mx.distributed.recv(shape, self.dtype, self.prev, group=self.group) if self.leader \
                else mx.zeros(shape, dtype=self.dtype)
            if self.stage_group is not None:
                x = mx.distributed.all_sum(x, group=self.stage_group)
        out = self.stage(x, cache, last_only=last_only)
        zeros = mx.zeros((batch, 1 if last_only else seq, self.vocab_size), dtype=self.dtype)
        if self.stage.layers.output:
            logits = out if self.leader else mx.depends(zeros, out)
        elif self.leader:
            logits = mx.depends(zeros, mx.distributed.send(out, self.next, group=self.group))
        else:
            logits = mx.depends(zeros, out)  # its share of the stage's collectives
        if self.logits_replicated:
            return mx.distributed.all_sum(logits, group=self.group)
        return logits  # relay: rank 0 owns the output and samples; ranks N get tokens in frames

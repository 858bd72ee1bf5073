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

__all__ = ["PipelineStage", "PipelinedModel"]


class PipelineStage:
    """Layers ``layers.start .. layers.end`` of ``model`` (the others are dropped from it).

    Args:
        model: the whole model for this rank (TP-sharded over the stage's group, or not).
        layers: the stage's range; ``layers.end`` must be the model's last layer iff ``layers.output``.
    Raises:
        LayoutError: the range does not fit the model.

    Call: ``stage(inputs, cache)`` where ``inputs`` is int32 token ids ``(batch, seq)`` on the
    stage that embeds, else the previous stage's hidden states ``(batch, seq, hidden)``;
    ``cache`` holds one KV cache per layer of this stage (``None``: no cache).  Returns the
    hidden states ``(batch, seq, hidden)``, or on the output stage the logits ``(batch, seq, vocab)``.
    """

    def __init__(self, model: LlamaModelTP, layers: LayerRange):
        inner = model.model
        n = len(inner.layers)
        if not 0 <= layers.start <= layers.end < n or layers.output != (layers.end == n - 1):
            raise LayoutError(f"layer range {layers} does not fit a model with layers 0..{n - 1}")
        self.model = model
        self.layers = layers
        self.blocks = inner.layers[layers.start: layers.end + 1]
        self.tied = bool(model.args.tie_word_embeddings)
        # Drop what this stage never runs, so its memory goes (the caller holds no other reference).
        inner.layers = self.blocks
        if not (layers.embeds or (layers.output and self.tied)):
            inner.embed_tokens = None
        if not layers.output:
            inner.norm = None
            if hasattr(model, "lm_head"):
                model.lm_head = None
        self.fa_idx = next((i for i, b in enumerate(self.blocks) if not b.use_sliding), None)
        self.swa_idx = next((i for i, b in enumerate(self.blocks) if b.use_sliding), None)

    @property
    def n_layers(self) -> int:
        """Transformer layers in this stage (one KV cache each)."""
        return len(self.blocks)

    def __call__(self, inputs: mx.array, cache: Optional[List] = None) -> mx.array:
        inner = self.model.model
        h = inner.embed_tokens(inputs) if self.layers.embeds else inputs
        if cache is None:
            cache = [None] * len(self.blocks)
        fa_mask = create_attention_mask(h, cache[self.fa_idx]) if self.fa_idx is not None else None
        swa_mask = None
        if self.swa_idx is not None:
            swa_mask = create_attention_mask(h, cache[self.swa_idx], window_size=self.model.args.sliding_window)
        for block, c in zip(self.blocks, cache):
            h = block(h, swa_mask if block.use_sliding else fa_mask, cache=c)
        if not self.layers.output:
            return h
        h = inner.norm(h)
        return inner.embed_tokens.as_linear(h) if self.tied else self.model.lm_head(h)


class PipelinedModel:
    """A pipeline of tensor-parallel-size-1 stages that every rank calls like the whole model.

    Rank ``r`` holds stage ``r`` of ``route`` (:class:`PipelineStage`).  One call, on every
    rank with the same token ids ``(batch, seq)``:

    1. the stage holding layer 0 embeds the ids; every other stage receives the previous
       stage's hidden states ``(batch, seq, hidden)`` from rank ``r - 1 (mod N)``
       (``mx.distributed.recv``);
    2. it runs its layers and, unless it is the output stage, sends the result to rank
       ``r + 1 (mod N)`` (``mx.distributed.send``; MLX's ring allows only neighbours);
    3. the output stage's last-position logits ``(batch, 1, vocab)``, zeros elsewhere, are
       summed over the group (``all_sum``): ``x + 0`` is exact, so every rank holds the output
       stage's logits bit for bit and samples the same token (the engine's self-sampling, as
       with a vocabulary-parallel head).

    The logits of the last position only are returned ``(batch, 1, vocab)``: all the engine
    uses.  Bytes per hop per decode token: ``batch x hidden x 4`` (2,304 for the embedded
    model, float32); plus the ``all_sum`` of ``batch x vocab`` logits (196,608 B) -- the price of
    identical sampling on every rank (a token relay would move 4 B; not done yet).

    Args:
        stage: this rank's stage.
        route: every stage (all with ``tp == 1``; stage index = rank).
        group: the MLX group of ``route.world_size`` ranks.
    Raises:
        LayoutError: the route has tensor-parallel stages, or its size is not the group's.
    """

    vocab_parallel = True      # every rank runs every call (collectives inside)
    logits_replicated = True   # ... and ends with the same logits

    def __init__(self, stage: PipelineStage, route, group):
        n = group.size()
        if route.world_size != n or any(s.tp != 1 for s in route.stages):
            raise LayoutError(f"a pipeline of {len(route.stages)} single-rank stages needs {len(route.stages)} "
                              f"ranks, the group has {n}" if route.world_size != n else
                              "tensor-parallel stages (--stage-tp) are not supported yet")
        self.stage = stage
        self.route = route
        self.group = group
        self.rank = group.rank()
        self.world_size = n
        self.prev, self.next = (self.rank - 1) % n, (self.rank + 1) % n
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

    def __call__(self, inputs: mx.array, cache: Optional[List] = None) -> mx.array:
        batch, seq = inputs.shape[:2]
        if self.stage.layers.embeds:
            x = inputs
        else:
            x = mx.distributed.recv((batch, seq, self.hidden_size), self.dtype, self.prev, group=self.group)
        out = self.stage(x, cache)
        if self.stage.layers.output:
            logits = out[:, -1:]
        else:
            sent = mx.distributed.send(out, self.next, group=self.group)
            logits = mx.depends(mx.zeros((batch, 1, self.vocab_size), dtype=self.dtype), sent)
        return mx.distributed.all_sum(logits, group=self.group)

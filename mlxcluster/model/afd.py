"""Attention–FFN disaggregation (``--afd A:1``): attention ranks and an FFN rank.

Step3's split (vLLM #25162, seed 003; ``../shared/TOPOLOGIES.md`` section 5) on mlx-lm's Llama
block, whose forward is ``h = x + attn(norm1(x)); out = h + mlp(norm2(h))``:

* **attention ranks** hold the token embedding, the norms, ``q/k/v/o`` and the KV cache of their
  layers, and (rank 0) the final norm and output head; per layer they send the normalised
  residual ``norm2(h)`` to the FFN rank (A2F) and add what comes back (F2A);
* **the FFN rank** (rank 1) holds ``gate/up/down`` of every layer and runs a fixed order:
  ``for layer: for micro-batch: recv A2F, send mlp(A2F)`` -- no KV cache, no head.

Every rank calls :meth:`AfdModel.forward_many` with the same token ids each step (the engine's
frame-driven loop: rank 0 samples, the others get the tokens in frames); the shapes of every
message follow from them, so no message carries a header and each side knows what it receives
before it posts the receive.  With ``--afd 2:1`` the two attention ranks (0 and 2; the FFN rank
1 neighbours both on MLX's ring) split the layers evenly -- rank 0 the first half with the
embedding and the head, rank 2 the second -- and the hidden state goes 0 -> 2 -> 0 once per step.
(Step3's attention instances are data-parallel over sequences instead; that needs a scheduler per
attention rank, not built.)

**Micro-batches** (``--afd-microbatches M``): the sequences of a step run in rounds of ``M``, each
a whole sequence with its own KV cache, ping-ponged per layer: as soon as the FFN output of
micro-batch ``m`` at layer ``l`` is back, the attention rank computes ``m``'s layer ``l + 1``
attention and sends it, while the FFN computes micro-batch ``m + 1`` of layer ``l`` -- neither side
waits for a whole layer.  The FFN never concatenates micro-batches, so every GEMM has the shape a
single rank would use: tokens are bit for bit a single rank's.

Messages per decode token: ``2 x n_layers`` (60 for the embedded model, 2,304 B each in float32:
138,240 B), plus the 0 -> 2 -> 0 hops with ``A = 2``.  Each message is a send/recv pair evaluated
one at a time (MLX's ``recv`` takes no input that could order it after a send inside one lazy
graph).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask

__all__ = ["AfdLayout", "AfdModel", "parse_afd", "prune_for_afd", "FFN_RANK"]

FFN_RANK = 1


@dataclass(frozen=True)
class AfdLayout:
    """Who holds what in an ``A:1`` split of ``n_layers`` layers.

    Attributes:
        attention: the attention ranks, in layer order (``(0,)`` or ``(0, 2)``).
        ranges: per attention rank its layers ``(start, end)``, ``end`` exclusive.
    """

    attention: Tuple[int, ...]
    ranges: Tuple[Tuple[int, int], ...]
    n_layers: int

    @property
    def world_size(self) -> int:
        return len(self.attention) + 1

    def owner(self, layer: int) -> int:
        """The attention rank holding ``layer``."""
        for rank, (a, b) in zip(self.attention, self.ranges):
            if a <= layer < b:
                return rank
        raise IndexError(layer)

    def layers_of(self, rank: int) -> Tuple[int, int]:
        return self.ranges[self.attention.index(rank)]


def parse_afd(spec: str, n_layers: int) -> AfdLayout:
    """``"A:F"`` -> :class:`AfdLayout`.

    Raises:
        ValueError: not ``A:1`` with ``A`` 1 or 2, or fewer layers than attention ranks."""
    parts = spec.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--afd {spec!r}: write attention ranks:FFN ranks, e.g. 1:1 or 2:1")
    a, f = int(parts[0]), int(parts[1])
    if f != 1 or a not in (1, 2):
        raise ValueError(f"--afd {spec!r}: 1:1 and 2:1 are supported (one FFN rank, one or two attention ranks)")
    if n_layers < a:
        raise ValueError(f"--afd {spec!r}: {n_layers} layers cannot split over {a} attention ranks")
    if a == 1:
        return AfdLayout((0,), ((0, n_layers),), n_layers)
    mid = (n_layers + 1) // 2
    return AfdLayout((0, 2), ((0, mid), (mid, n_layers)), n_layers)


def prune_for_afd(model, layout: AfdLayout, rank: int) -> None:
    """Drop from ``model`` (in place, before its weights are materialised) what ``rank`` never
    runs: the FFN rank keeps only every layer's MLP; an attention rank keeps its layers minus
    their MLPs, and the embedding, final norm and head only on rank 0."""
    inner = model.model
    if rank == FFN_RANK:
        for block in inner.layers:
            block.self_attn = block.input_layernorm = block.post_attention_layernorm = None
        inner.embed_tokens = inner.norm = None
        if hasattr(model, "lm_head"):
            model.lm_head = None
        return
    a, b = layout.layers_of(rank)
    for block in inner.layers[a:b]:
        block.mlp = None
    inner.layers = inner.layers[a:b]
    if rank != 0:
        inner.embed_tokens = inner.norm = None
        if hasattr(model, "lm_head"):
            model.lm_head = None


class AfdModel:
    """One rank of an attention–FFN split, called by the engine like a whole model.

    Args:
        model: this rank's model, cut by :func:`prune_for_afd`.
        layout: the split.
        group: the MLX group of ``layout.world_size`` ranks.
        microbatches: sequences in flight per round (``--afd-microbatches``).
    Raises:
        ValueError: the group's size is not the layout's.

    :meth:`forward_many` takes ``B`` sequences' token ids ``(1, L_i)`` and KV caches and returns
    the last position's logits ``(B, 1, vocab)`` on rank 0, zeros elsewhere (rank 0 samples: the
    tokens reach the others in frames).
    """

    vocab_parallel = True       # every rank runs every call (the messages are collective)
    last_position_only = True   # a call returns the last position's logits only
    logits_replicated = False   # only rank 0 holds them
    separate_caches = True      # sequences keep their own KV caches (micro-batches of whole sequences)

    def __init__(self, model, layout: AfdLayout, group, microbatches: int = 1):
        if group.size() != layout.world_size:
            raise ValueError(f"--afd needs {layout.world_size} ranks, the group has {group.size()}")
        self.model = model
        self.args = model.args
        self.layout = layout
        self.group = group
        self.rank = group.rank()
        self.microbatches = max(1, int(microbatches))
        self.hidden_size = model.args.hidden_size
        self.vocab_size = model.args.vocab_size
        self.blocks = list(model.model.layers)
        self.tied = bool(model.args.tie_word_embeddings)
        first = self.blocks[0]
        if self.rank == FFN_RANK:  # activations: a float layer's weight dtype, a quantised one's scales'
            self.dtype = getattr(first.mlp.gate_proj, "scales", first.mlp.gate_proj.weight).dtype
        else:
            self.dtype = first.input_layernorm.weight.dtype
        #: messages sent by this rank (A2F/F2A and hidden-state hops), and on the FFN rank the seconds
        #: spent waiting for A2F (idle) and running MLPs and sends (busy): :meth:`counters`
        self.messages = 0
        self.idle_s = self.busy_s = 0.0

    @property
    def layers(self):
        """Blocks with a KV cache on this rank (``make_prompt_cache``): none on the FFN rank."""
        return [] if self.rank == FFN_RANK else self.blocks

    def parameter_bytes(self) -> int:
        return self.model.parameter_bytes()

    def __call__(self, inputs: mx.array, cache: Optional[List] = None) -> mx.array:
        return self.forward_many([inputs], [cache if cache is not None else [None] * len(self.layers)])

    def counters(self) -> dict:
        """Messages sent, and the FFN rank's idle and busy seconds inside forward passes so far."""
        return {"messages": self.messages, "idle_s": round(self.idle_s, 6), "busy_s": round(self.busy_s, 6)}

    def _send(self, x: mx.array, dst: int) -> None:
        mx.eval(mx.distributed.send(x, dst, group=self.group))
        self.messages += 1

    def _recv(self, shape, src: int) -> mx.array:
        return mx.distributed.recv(shape, self.dtype, src, group=self.group)

    def _take(self, x: mx.array) -> mx.array:
        """Evaluate ``x`` (holding one receive) now: two pending receives from one peer could run in
        either order inside one graph and swap their messages."""
        mx.eval(x)
        return x

    def forward_many(self, xs: Sequence[mx.array], caches: Sequence[List]) -> mx.array:
        """One forward pass of ``len(xs)`` sequences (see the class docstring)."""
        outs = []
        for r in range(0, len(xs), self.microbatches):
            outs += self._round(list(xs[r:r + self.microbatches]), list(caches[r:r + self.microbatches]))
        return mx.concatenate(outs, axis=0)

    def _round(self, xs, caches) -> List[mx.array]:
        shapes = [(x.shape[0], x.shape[1], self.hidden_size) for x in xs]
        zeros = [mx.zeros((x.shape[0], 1, self.vocab_size), dtype=self.dtype) for x in xs]
        if self.rank == FFN_RANK:
            for layer in range(self.layout.n_layers):
                owner, mlp = self.layout.owner(layer), self.blocks[layer].mlp
                for shape in shapes:
                    t0 = time.perf_counter()
                    x = self._take(self._recv(shape, owner))  # idle: the attention side computes
                    t1 = time.perf_counter()
                    self._send(mlp(x), owner)
                    self.idle_s += t1 - t0
                    self.busy_s += time.perf_counter() - t1
            return zeros
        a, b = self.layout.layers_of(self.rank)
        inner = self.model.model
        if self.rank == 0:
            hs = [inner.embed_tokens(x) for x in xs]
        else:
            hs = [self._take(self._recv(shape, 0)) for shape in shapes]
        masks = [create_attention_mask(h, c[0] if c else None) for h, c in zip(hs, caches)]
        n = b - a

        def attend(i: int, m: int) -> mx.array:
            block = self.blocks[i]
            h = hs[m] + block.self_attn(block.input_layernorm(hs[m]), masks[m], caches[m][i])
            self._send(block.post_attention_layernorm(h), FFN_RANK)  # A2F
            return h

        mid = [attend(0, m) for m in range(len(xs))]
        for i in range(n):  # ping-pong: micro-batch m's next layer starts as soon as its F2A is back
            for m in range(len(xs)):
                hs[m] = mid[m] + self._recv(shapes[m], FFN_RANK)  # F2A
                if i + 1 < n:
                    mid[m] = attend(i + 1, m)  # its send's evaluation takes this receive first
                else:
                    self._take(hs[m])
        if self.rank != 0:  # the second half goes back to rank 0, which owns the head
            for h in hs:
                self._send(h, 0)
            return zeros
        if len(self.layout.attention) > 1:
            for h in hs:
                self._send(h, 2)
            hs = [self._take(self._recv(shape, 2)) for shape in shapes]
        outs = []
        for h in hs:
            h = inner.norm(h[:, -1:])
            outs.append(inner.embed_tokens.as_linear(h) if self.tied else self.model.lm_head(h))
        return outs

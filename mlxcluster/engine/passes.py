"""The forward passes over KV caches, and how this device runs them: one pass of a ``(B, L)`` batch
(:func:`forward`), several prompts prefilled together (:func:`last_positions`, where :func:`groupable`),
in chunks of :data:`PREFILL_CHUNK_TOKENS` positions, and whether queuing a step computes it
(:func:`queuing_computes`).

Read :data:`PREFILL_CHUNK_TOKENS` as ``passes.PREFILL_CHUNK_TOKENS`` (tests and the scheduler set it here).
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

from .kvquant import full_attention, make_cache

# Prompt tokens per prefill forward pass (bounds attention memory to
# heads/N * chunk * context floats per layer); mlx-lm uses 2048 on Metal.
PREFILL_CHUNK_TOKENS = 512


def _hidden(model, ids: mx.array, cache) -> mx.array:
    """The hidden states of ``ids``: every collective of a forward pass but the head's."""
    hidden = getattr(model, "hidden", None)
    return hidden(ids, cache=cache) if hidden is not None else model.model(ids, cache=cache)


def forward(model, ids: mx.array, cache, compute_logits: bool, last_only: bool = False) -> mx.array:
    """One forward pass of ``ids`` ``(B, L)`` int32 through ``model`` with ``cache``: logits
    ``(B, L, vocab)`` (``(B, 1, vocab)`` with ``last_only`` where the model splits its head or is a
    pipeline), or the hidden states when ``compute_logits`` is false."""
    if not compute_logits:
        return _hidden(model, ids, cache)
    if getattr(model, "takes_last_only", False):  # a pipeline: its output stage cuts the positions
        return model(ids, cache=cache, last_only=last_only)
    if not last_only or getattr(model, "last_position_only", False) or not getattr(model, "split_head", False):
        return model(ids, cache=cache)  # --afd cuts its logits itself; an unusual head runs whole
    # Prefill: run the output head on the last position only (the other
    # positions' logits are never used): saves (L-1) x hidden x vocab MACs.
    return model.head(_hidden(model, ids, cache)[:, -1:])


def last_positions(model, prompts: Sequence[Sequence[int]], cache, compute_logits: bool) -> Optional[mx.array]:
    """Prefill ``prompts`` (G lists of int token ids, G >= 1) together into ``cache`` (per layer, a
    batch cache of G empty rows: ``type(c).merge`` of fresh caches) and return the logits
    ``(G, vocab)`` of each prompt's last position (``None`` unless ``compute_logits``).

    mlx-lm's ``PromptProcessingBatch.prompt``: the prompts are right-padded to the longest
    (``cache.prepare(right_padding=...)``), run in chunks of ``PREFILL_CHUNK_TOKENS`` positions
    (causal masks: a prompt's positions never see the padding after it), and
    ``cache.finalize()`` rolls each row's padding to its left, where decode masks it
    (``BatchKVCache``'s ``left_padding``).  Each row's last real position is taken from the chunk
    that holds it and only those G rows go through the output head (:attr:`split_head` models)."""
    lengths = [len(p) for p in prompts]
    n = max(lengths)
    pad = [n - k for k in lengths]
    ids = mx.array([list(p) + [0] * (n - len(p)) for p in prompts], dtype=mx.int32)
    for c in cache:
        c.prepare(lengths=lengths, right_padding=pad)
    last = [None] * len(prompts)
    for start in range(0, n, PREFILL_CHUNK_TOKENS):
        h = _hidden(model, ids[:, start:start + PREFILL_CHUNK_TOKENS], cache)
        for i, k in enumerate(lengths):
            if start <= k - 1 < start + PREFILL_CHUNK_TOKENS:
                last[i] = h[i, k - 1 - start]
        mx.eval([c.state for c in cache] + [x for x in last if x is not None])
    for c in cache:
        c.finalize()
    h = mx.stack(last)[:, None]  # (G, 1, hidden)
    out = model.head(h)[:, 0] if compute_logits else h
    mx.eval([c.state for c in cache] + [out])
    return out if compute_logits else None


def groupable(model) -> bool:
    """True when several prompts may be prefilled as one batch (:func:`last_positions`): a
    model whose head runs apart from its hidden states (:attr:`split_head`), whose sequences
    share one batch cache (not ``separate_caches``), with full-attention ``KVCache`` layers
    only, quantized or not (a sliding window's or a recurrent state's right padding is not handled here)."""
    if not getattr(model, "split_head", False) or not hasattr(model, "hidden") \
            or getattr(model, "separate_caches", False) or getattr(model, "last_position_only", False):
        return False
    try:
        return all(full_attention(c) for c in make_cache(model))
    except Exception:
        return False


def queuing_computes() -> bool:
    """Whether queuing a decode step with ``mx.async_eval`` computes it before returning: MLX's CPU
    backend, where a group's step ran inside ``async_eval`` (its collectives complete there; 10.2 of
    a 10.7 ms TP=2 step, BENCHMARKS.md issue 42), unlike Metal's command buffers.  A group's engines
    then read a step's tokens before they queue the next (:attr:`RankEngine.read_first`)."""
    return mx.default_device() == mx.cpu

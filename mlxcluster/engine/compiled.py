"""A compiled greedy decode step for one sequence on one rank.

``mx.compile`` cannot wrap the model call with mlx-lm's ``KVCache``: the
cache's Python-side offset and slice writes are traced once, so every later
call silently reuses the first position (measured: wrong tokens, no error;
BENCHMARKS.md).  This module compiles a *pure* Llama decode step instead:
the KV cache is a list of preallocated buffers passed in and returned, the
position is an ``mx.array``, the new key/value row is written with
``mx.slice_update``, and attention runs over the whole buffer with the mask
``arange(capacity) <= position``.  The function is traced once per buffer
capacity (a multiple of 256 positions, mlx-lm's ``KVCache.step``).

Only for a group of one rank (no collectives inside the compiled graph), and only with
full-precision K/V: with ``--kv-bits`` (:mod:`mlxcluster.engine.kvquant`) the engine skips this step
(``RankEngine._compiled_path``) and decodes on the quantized caches uncompiled -- the static buffers
here hold float K/V, and a quantized variant (packed buffers, ``mx.quantize`` of the new row,
``quantized_matmul`` attention) was not worth its second code path yet.
"""

from __future__ import annotations

from typing import List

import mlx.core as mx

__all__ = ["CompiledGreedyStep", "BUCKET"]

BUCKET = 256  # positions added to the KV buffers when they are full (= KVCache.step)


class CompiledGreedyStep:
    """``step(token (1, 1) int32, position (1,) int32, *kv) -> (next (1, 1) int32, position + 1, *kv)``
    for an mlx-lm Llama ``model`` (unsharded), compiled with ``mx.compile``.

    ``kv`` is ``[k_0, v_0, k_1, v_1, ...]``, each ``(1, n_kv_heads, capacity, head_dim)``;
    the next token is the argmax of the logits (greedy).
    """

    def __init__(self, model):
        self.model = model
        self._fn = mx.compile(self._step)

    def _step(self, token: mx.array, position: mx.array, *kv: mx.array):
        inner = self.model.model
        capacity = kv[0].shape[2]
        mask = mx.arange(capacity) <= position  # (capacity,) bool: filled positions and this one
        h = inner.embed_tokens(token)
        out: List[mx.array] = []
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).reshape(1, 1, attn.n_heads, -1).transpose(0, 2, 1, 3)
            k = attn.k_proj(x).reshape(1, 1, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
            v = attn.v_proj(x).reshape(1, 1, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
            q = attn.rope(q, offset=position[0])
            k = attn.rope(k, offset=position[0])
            keys = mx.slice_update(kv[2 * i], k, position, axes=(2,))
            values = mx.slice_update(kv[2 * i + 1], v, position, axes=(2,))
            out += [keys, values]
            o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=mask)
            h = h + attn.o_proj(o.transpose(0, 2, 1, 3).reshape(1, 1, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = inner.norm(h)
        if getattr(self.model.args, "tie_word_embeddings", True):
            logits = inner.embed_tokens.as_linear(h)
        else:
            logits = self.model.lm_head(h)
        token = mx.argmax(logits[:, -1], axis=-1, keepdims=True).astype(mx.int32)
        return (token, position + 1, *out)

    def __call__(self, token: mx.array, position: mx.array, kv: List[mx.array]):
        token, position, *kv = self._fn(token, position, *kv)
        return token, position, kv


def grow(kv: List[mx.array], positions: int = BUCKET) -> List[mx.array]:
    """Append ``positions`` empty slots to every KV buffer (axis 2)."""
    return [mx.concatenate([a, mx.zeros((a.shape[0], a.shape[1], positions, a.shape[3]), a.dtype)], axis=2)
            for a in kv]

"""The decode loop's execution side, the same on every rank.

Every rank of a tensor-parallel group runs the same sequence of forward passes
(each layer's ``all_sum`` is a collective), so rank 0 and ranks N drive one
class, :class:`RankEngine`, with the same operations:

* :meth:`RankEngine.admit` -- the one way a sequence joins, its K/V from a source
  (:class:`Compute`: after prefix-cache positions, prefilled by
  :meth:`RankEngine.prefill_chunk` -- one chunk per step for a long prompt -- or
  :meth:`RankEngine.prefill_admitted` -- the rest of several admitted prompts at once, together
  as one batch where allowed (:meth:`RankEngine.prefill` and :meth:`RankEngine.prefill_many`
  are admit + that); :class:`Remote`: prefilled elsewhere, installed by the one install), the
  first token sampled (on the rank that samples), join the decode batch;
* :meth:`RankEngine.step` -- one decode step of every resident sequence
  (continuous batching: mlx-lm's ``BatchKVCache`` once two or more are
  resident), each fed its own last token or the token a frame carries;
  with ``lookahead`` the next step is already queued on the lazy tokens of
  this one before they are read (mlx-lm's ``generate_step`` pipelining);
* :meth:`RankEngine.remove` -- free a sequence's KV cache.

Every rank that samples a sequence (rank 0; in a group whose logits every rank holds -- a
vocabulary-parallel head -- every rank, for sequences without a grammar or a drafter) applies the
one stop rule, :func:`~mlxcluster.protocol.frames.stop_reason`, after every token; the others follow
the tokens rank 0's plans feed.  Lookahead is the normal shape of a step at every world size: in a
group every rank queues the same next step (a queued step's collectives run whether it is kept or
not), as the plan says (``StepPlan.ahead``), and a rank samples it itself, so the next plan's
frame travels while that step computes.  A lone greedy sequence of a one-rank group may run as
one ``mx.compile``'d function (:mod:`mlxcluster.engine.compiled`).

Sections: sampling (lazy samplers), the KV cache of one sequence
(:class:`ShardSession`) and the continuous batch (:class:`DecodeBatch`), then
:class:`RankEngine`.  No gRPC, no queues, no threads here: the caller owns the
one thread that runs MLX (rank 0's scheduler, a rank N's follower).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from ..protocol.frames import stop_reason
from .kvquant import (fill, format_of, full_attention, kv_assign, kv_contiguous, kv_length, kv_slice,
                      make_cache, quantized)
from .speculative import token_key

if TYPE_CHECKING:
    from .speculative import Verified

log = logging.getLogger(__name__)

__all__ = ["RankEngine", "Sampling", "SequenceState", "ShardSession", "DecodeBatch", "make_token_sampler",
           "Sampler", "PREFILL_CHUNK_TOKENS", "sampling_of", "Compute", "Remote", "LogitsProcessor",
           "REPETITION_CONTEXT_SIZE", "make_token_logits", "token_key"]


# -- sampling ----------------------------------------------------------------------

#: ``f(logits (vocab,) float, index) -> token`` (a lazy uint32 scalar ``mx.array``);
#: ``index`` is the token's ordinal in its sequence (0: the token after the prompt).
Sampler = Callable[[mx.array, int], mx.array]



def _greedy(logits: mx.array, index: int = 0) -> mx.array:
    return mx.argmax(logits, axis=-1)


def make_token_logits(temperature: float, top_p: float = 1.0, top_k: int = 0,
                      min_p: float = 0.0) -> Optional[Callable[[mx.array], mx.array]]:
    """The distribution a sampled sequence draws from: ``f(logits (vocab,) float) -> (vocab,) float32``
    logits whose softmax is it (``-inf`` where a filter removed a token), or ``None`` for greedy
    (``temperature`` <= 0).

    The chain of mlx-lm's ``make_sampler`` (mlx_lm/sample_utils.py), in its order, on ``logprobs =
    logits - logsumexp(logits)``: ``apply_top_p`` (nucleus, when ``0 < top_p < 1``), ``apply_min_p``
    (keep tokens at least ``min_p`` times the most likely's probability, when ``min_p > 0``; ``min_p``
    in [0, 1]), ``apply_top_k`` (the ``top_k`` most likely, when ``0 < top_k < vocab``), then
    ``/ temperature``.  :func:`make_token_sampler` draws from it; speculative verification reads its
    probabilities (the same function, so accepted tokens follow the distribution sampled here)."""
    if temperature <= 0:
        return None
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    nucleus = 0 < top_p < 1
    top_k, min_p = int(top_k), float(min_p)

    def scaled(logits: mx.array) -> mx.array:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if nucleus:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p > 0:
            logprobs = apply_min_p(logprobs, min_p)
        if 0 < top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, top_k)
        return logprobs * (1.0 / temperature)

    return scaled


def make_token_sampler(temperature: float, top_p: float, seed: int, top_k: int = 0, min_p: float = 0.0) -> Sampler:
    """Return a lazy sampler ``f(logits (vocab,) float, index) -> token`` (a uint32 scalar).

    ``temperature`` 0: argmax (the filters cannot change it).  Else categorical sampling of
    :func:`make_token_logits` (mlx-lm's filters, then ``/ temperature``) -- drawn with the PRNG
    key of ``(seed, index)`` (:func:`token_key`; mlx-lm's ``categorical_sampling`` uses MLX's
    global PRNG state instead): a seeded sequence is reproducible, the same on every rank, and
    independent of batching and of lookahead steps that were withdrawn."""
    scaled = make_token_logits(temperature, top_p, top_k, min_p)
    if scaled is None:
        return _greedy

    def sample(logits: mx.array, index: int) -> mx.array:
        return mx.random.categorical(scaled(logits), key=token_key(seed, index))

    return sample


_GREEDY = make_token_sampler(0.0, 1.0, 0)


# -- KV caches: one sequence, and the continuous batch ------------------------------
# Prompt tokens per prefill forward pass (bounds attention memory to
# heads/N * chunk * context floats per layer); mlx-lm uses 2048 on Metal.
PREFILL_CHUNK_TOKENS = 512


def _hidden(model, ids: mx.array, cache) -> mx.array:
    """The hidden states of ``ids``: every collective of a forward pass but the head's."""
    hidden = getattr(model, "hidden", None)
    return hidden(ids, cache=cache) if hidden is not None else model.model(ids, cache=cache)


def _forward(model, ids: mx.array, cache, compute_logits: bool, last_only: bool = False) -> mx.array:
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


def _last_positions(model, prompts: Sequence[Sequence[int]], cache, compute_logits: bool) -> Optional[mx.array]:
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


#: positions the prefix caches of a rank hold in all (the least recently used prompt dropped first): a
#: count of positions, not bytes, so that every rank of a group, making the same calls, keeps the same
#: prompts (0: no prefix caching)
PREFIX_CACHE_POSITIONS = 4096
#: shorter common prefixes are prefilled again (nothing worth a second code path)
PREFIX_MIN_TOKENS = 16

#: lookahead steps timed per kind of step (compiled lone step, or a graph of ops) before deciding
#: whether queuing the next step overlaps anything (RankEngine.step)
LOOKAHEAD_PROBE_STEPS = 8


class PrefixCache:
    """K/V of earlier prompts, for later prompts that start the same way (a chat template's system
    prompt, a conversation's earlier turns): the longest common prefix with any prompt held, token
    by token, is taken from here instead of prefilled (mlx-lm's ``LRUPromptCache.fetch_nearest_cache``;
    vLLM's automatic prefix caching, at token rather than block granularity).

    Each prompt held keeps, per layer, ``(keys, values)`` of its positions ``[0, len - 1)`` (the last
    position is always computed: its logits give the first token), shape ``(1, n_kv_heads of this
    rank, len - 1, head_dim)`` -- with quantized K/V (:mod:`~mlxcluster.engine.kvquant`) each is the
    ``(packed, scales, biases)`` triple of those positions, held as the caches hold it -- (copies,
    not views of a batch's buffers).  At most ``max_positions``
    positions in all, least recently used prompt dropped first.  Every rank of a group makes the same
    :meth:`take` / :meth:`add` calls in the same order (rank 0 tells ranks N the prefix length in
    ``promptTokens.cached_prefix``), so all hold the same prompts.

    Namespaces (vLLM's ``cache_salt``, issue 32): every call names the prompt's ``salt`` (a digest,
    ``ComputeSource.salt``; "" shared); a prompt is held under its salt and matches only prompts held
    under the same one, so a client whose requests carry a salt -- or every API key under ``serve
    --cache-isolation key`` -- neither takes positions of another's prompts nor sees them in
    ``cached_tokens`` or time to first token.  All namespaces share ``max_positions`` and the LRU
    order.  The disk tier keeps prompts of the shared namespace only.
    """

    def __init__(self, max_positions: int = PREFIX_CACHE_POSITIONS, min_tokens: int = PREFIX_MIN_TOKENS):
        import collections

        self.max_positions = max(0, max_positions)
        self.min_tokens = max(1, min_tokens)
        #: held prompts ``(salt, tuple of token ids of positions [0, len - 1))`` -> per layer (keys, values),
        #: oldest first
        self.entries: "collections.OrderedDict[tuple, list]" = collections.OrderedDict()
        self.positions = 0
        self.hit_positions = 0  # prompt positions taken from here instead of prefilled
        self.memory_hit_positions = 0  # ... of them from memory
        self.disk_hit_positions = 0  # ... of them loaded from the disk tier
        #: the disk tier (--prompt-cache-dir): a :class:`~mlxcluster.engine.prompt_disk.DiskPrompts`
        self.disk = None
        #: in a group of several ranks with a disk tier: ``int -> int``, the fewest positions any rank
        #: passes (an ``all_min`` over the group; :meth:`take` with ``from_disk``); None for one rank
        self.agree: Optional[Callable[[int], int]] = None

    def __len__(self) -> int:
        return len(self.entries)

    def _best(self, prompt: Sequence[int], salt: str = "", disk: bool = True) -> Tuple[int, Optional[tuple], bool]:
        """``(n, key, on_disk)``: the longest common prefix of ``prompt`` (at most ``len(prompt) - 1``)
        with a prompt held under ``salt``, the first such in least-recently-used order, memory before
        disk (a disk prompt only where it is longer)."""
        import numpy as np

        want = np.asarray(prompt[:-1], dtype=np.int64)
        best, best_key, on_disk = 0, None, False
        keys = [(k, False) for k in self.entries if k[0] == salt]
        if disk and self.disk is not None and not salt:
            keys += [(("", k), True) for k in self.disk.keys() if ("", k) not in self.entries]
        for key, d in keys:
            tokens = key[1]
            m = min(len(tokens), len(want))
            if m <= best:
                continue
            diff = np.flatnonzero(np.asarray(tokens[:m], dtype=np.int64) != want[:m])
            n = int(diff[0]) if diff.size else m
            if n > best:
                best, best_key, on_disk = n, key, d
        return (best, best_key, on_disk) if best >= self.min_tokens else (0, None, False)

    def match(self, prompt: Sequence[int], salt: str = "", disk: bool = True) -> int:
        """Leading positions of ``prompt`` held here under ``salt`` (0, or at least ``min_tokens``;
        always fewer than ``len(prompt)``), in memory or (``disk``) on disk."""
        return self._best(prompt, salt, disk)[0]

    def lookup(self, prompt: Sequence[int], salt: str = "") -> Tuple[int, bool]:
        """``(n, on_disk)``: :meth:`match` and whether those positions come from the disk tier (in a
        group of several ranks, a join that then takes them with ``from_disk``)."""
        n, _, on_disk = self._best(prompt, salt)
        return n, on_disk

    def take(self, prompt: Sequence[int], n: int, salt: str = "", from_disk: bool = False) -> list:
        """Per layer ``(keys, values)`` of ``prompt``'s first ``n`` positions (``n`` from :meth:`match`),
        each ``(1, heads, n, head_dim)``; marks the prompt they come from used.

        One rank (no :attr:`agree`): a prompt on disk is loaded (and held in memory from then on,
        where it fits); only with a disk tier are fewer positions returned -- where a file is refused
        at load (corrupt: then forgotten) or was deleted by the size bound since :meth:`match` --:
        the best still held, maybe none (``[]``); the caller prefills the rest.

        A group of several ranks (:attr:`agree` set, ``--prompt-cache-dir``): the memory tiers are in
        step (every rank makes the same calls), the disk tiers need not be (a write dropped, a file
        refused, another size bound).  Without ``from_disk`` the positions come from memory only.
        With ``from_disk`` (rank 0's match was on its disk: ``ComputeSource.disk``) each rank takes
        the most it holds, in memory or on disk, up to ``n``, and :attr:`agree` (an ``all_min`` over
        the group, called exactly once on every rank) makes it the fewest any rank holds: every rank
        returns that many and prefills the rest alike.  A disk prompt loaded so is not held in memory
        (it would be held on some ranks only); the joining prompt is, once prefilled.

        Raises:
            KeyError: fewer than ``n`` leading positions of ``prompt`` are held here (one rank without
                a disk tier, or a group's take not ``from_disk``).
        """
        group = self.agree is not None
        lenient = (self.disk is not None and not group) or from_disk
        kv, got, on_disk = [], 0, False
        for _ in range(1 + len(self.disk.keys()) if self.disk is not None else 1):  # a refused file is forgotten
            best, key, on_disk = self._best(prompt, salt, disk=from_disk or not group)
            if key is None or best < n:
                if not lenient:
                    raise KeyError(f"{n} leading positions of a {len(prompt)}-token prompt are not cached here")
                n = best  # a disk file refused at load, deleted by the size bound since match, or not here
                if key is None:
                    break
            if not on_disk:
                self.entries.move_to_end(key)
                kv, got = self.entries[key], n
                break
            loaded = self.disk.load(key[1])
            if loaded is None:
                continue
            if not group and len(key[1]) <= self.max_positions:
                self._hold(key, loaded)
            kv, got = loaded, n
            break
        if from_disk and group:
            got = self.agree(got) if kv else self.agree(0)
        if not got:
            return []
        if on_disk:
            self.disk_hit_positions += got
            log.info("prompt cache: %d of %d prompt positions loaded from disk", got, len(prompt))
        else:
            self.memory_hit_positions += got
        self.hit_positions += got
        return [(kv_slice(k, 0, got), kv_slice(v, 0, got)) for k, v in kv]

    def _hold(self, key: tuple, kv: list) -> None:
        self.entries[key] = kv
        self.positions += len(key[1])
        while self.positions > self.max_positions:
            old, _ = self.entries.popitem(last=False)
            self.positions -= len(old[1])

    def add(self, prompt: Sequence[int], layers: Callable[[int, int], list], salt: str = "") -> None:
        """Hold ``prompt`` under ``salt`` (unless a prompt held there already starts with all of it but
        its last position); ``layers(a, b)`` gives per layer ``(keys, values)`` of positions ``[a, b)``
        of its KV cache.  The disk tier, where there is one, writes a prompt of the shared namespace
        too (:meth:`DiskPrompts.wants`)."""
        n = len(prompt) - 1
        if n < self.min_tokens:
            return
        tokens = tuple(prompt[:-1])
        key = (salt, tokens)
        memory = n <= self.max_positions
        if memory:
            for held in self.entries:
                if held[0] == salt and len(held[1]) >= n and held[1][:n] == tokens:
                    self.entries.move_to_end(held)
                    memory = False
                    break
        disk = self.disk is not None and not salt and self.disk.wants(tokens)
        if not (memory or disk):
            return
        kv = [(kv_contiguous(k), kv_contiguous(v)) for k, v in layers(0, n)]
        mx.eval(kv)
        if memory:
            self._hold(key, kv)
        if disk:
            self.disk.save(tokens, kv)


def _with_prefix(session: "ShardSession", kv: list, n: int) -> None:
    """Start ``session``'s KV cache with ``n`` cached positions (``kv`` from :meth:`PrefixCache.take`)."""
    for c, (k, v) in zip(session.cache, kv):
        fill(c, k, v)
    session.position = n


def _groupable(model) -> bool:
    """True when several prompts may be prefilled as one batch (:func:`_last_positions`): a
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


def _speculation_refusal(model) -> Optional[str]:
    """Why ``model`` cannot run speculative verify steps (:meth:`RankEngine.verify`), in one line, or
    ``None``: a verify step writes ``k + 1`` positions and rolls the rejected ones back, which needs
    full-attention ``KVCache`` layers (a sliding window's ``RotatingKVCache`` may have overwritten
    what a rollback must restore; a recurrent ``ArraysCache`` cannot forget a step), a model that
    returns every position's logits (a pipeline does when asked, :class:`~mlxcluster.model.pp.PipelinedModel`)
    and one batch cache (not ``--afd``'s separate caches).  (``--local-decode``: rank 0's whole
    ``model`` decodes and verifies alone; its pipeline only prefills.)"""
    if getattr(model, "separate_caches", False):
        return "speculative decoding is not built for --afd (separate caches per sequence)"
    if getattr(model, "last_position_only", False):
        return "speculative decoding needs every position's logits, which this model does not return"
    try:
        caches = make_cache(model)
    except Exception as exc:  # a wrapper whose blocks make caches of their own
        return f"speculative decoding needs the model's KV caches, which it does not make here ({exc})"
    for i, c in enumerate(caches):
        if not full_attention(c):
            return (f"speculative decoding needs KV caches that roll back: layer {i}'s {type(c).__name__} "
                    f"cannot (no speculation for this model)")
    return None


def _trimmable_caches(model) -> bool:
    """True when every layer's cache kind can forget its last position (``KVCache``, quantized or not,
    ``RotatingKVCache``: a sliding window of ``max_size`` loses only the position that left it)."""
    from mlx_lm.models.cache import RotatingKVCache

    try:
        caches = make_cache(model)
    except Exception:  # a wrapper (pipeline, AFD) whose blocks make plain KV caches
        return True
    return all(full_attention(c) or type(c) is RotatingKVCache for c in caches)


class ShardSession:
    """KV cache plus position for one session on one rank.

    Args:
        model: a :class:`~mlxcluster.model.tp.LlamaModelTP` shard (or an mlx-lm Llama).
        uid: session id.
        compute_logits: rank 0 computes the output head (logits); ranks N
            stop after the final norm, since their logits would be discarded.
    """

    def __init__(self, model, uid: str, compute_logits: bool = True):
        self.model = model
        self.uid = uid
        # A vocabulary-parallel head holds a collective: every rank runs it.
        self.compute_logits = compute_logits or bool(getattr(model, "vocab_parallel", False))
        self.cache = make_cache(model)  # in the model's KV format (kvquant.set_format)
        self.position = 0  # tokens in the KV cache
        self.compiled = None  # a CompiledGreedyStep for issue_greedy (world size 1)
        self._static = None  # (kv buffers, position array) while issue_greedy runs compiled

    def _forward(self, ids: mx.array, last_only: bool = False) -> mx.array:
        return _forward(self.model, ids, self.cache, self.compute_logits, last_only)

    def prefill(self, token_ids: Sequence[int], via=None) -> Optional[mx.array]:
        """Run the prompt through the model in chunks of ``PREFILL_CHUNK_TOKENS``.

        ``via``: run it through this model instead (``--local-decode``: the pipeline, whose
        ``layers`` range of this session's layers it fills; the others stay empty until
        :meth:`install`).  Returns the float logits ``(vocab,)`` of the last prompt position
        on a ``compute_logits`` session, else ``None``.
        """
        ids = mx.array(list(token_ids), dtype=mx.int32)[None]
        n = ids.shape[1]
        out = None
        model, cache = self.model, self.cache
        if via is not None:
            r = via.stage.layers
            self.model, self.cache = via, cache[r.start:r.end + 1]
        try:
            for start in range(0, n, PREFILL_CHUNK_TOKENS):
                out = self._forward(ids[:, start:start + PREFILL_CHUNK_TOKENS], last_only=True)
                if start + PREFILL_CHUNK_TOKENS < n:
                    # the chunk's output too: a pipeline stage's send of its hidden states hangs on it
                    mx.eval([c.state for c in self.cache] + [out])
        finally:
            self.model, self.cache = model, cache
        self.position += n
        if self.compute_logits:
            logits = out[0, -1]
            mx.eval(logits)
            return logits
        mx.eval(out)
        return None

    def install(self, kv) -> None:
        """Fill layers from a KV handoff: ``kv`` maps a layer index to its ``(keys, values)``,
        each ``(1, n_kv_heads, position, head_dim)`` (:func:`mlxcluster.engine.handoff.assemble`), or
        with quantized K/V each the triple of those positions (:mod:`~mlxcluster.engine.kvquant`).

        Raises:
            ValueError: a layer that already holds positions, a length other than :attr:`position`,
                or K/V of another format than the cache's.
        """
        for layer, (k, v) in kv.items():
            c = self.cache[layer]
            if not c.empty() or kv_length(k) != self.position:
                raise ValueError(f"layer {layer}: cannot install {kv_length(k)} positions into a cache of "
                                 f"{c.offset} (the session holds {self.position})")
            fill(c, k, v)  # as a prefill writes it: the same buffer capacity as every other layer

    def forward(self, x: mx.array) -> Optional[mx.array]:
        """Queue one decode step on ``x`` (``(1, 1)`` int32, possibly a lazy
        result still being computed) at index ``self.position``; returns the
        lazy logits ``(vocab,)`` on a ``compute_logits`` session, else the lazy
        hidden state.  Nothing is evaluated here."""
        self.leave_static()
        out = self._forward(x)
        self.position += 1
        return out[0, -1] if self.compute_logits else out

    def step(self, token: int) -> Optional[mx.array]:
        """One decode step on ``token`` at index ``self.position``, evaluated.

        Returns logits ``(vocab,)`` on a ``compute_logits`` session, else ``None``.
        """
        out = self.forward(mx.array([[int(token)]], dtype=mx.int32))
        mx.eval(out)
        return out if self.compute_logits else None

    def issue_greedy(self, token) -> mx.array:
        """Queue one compiled greedy decode step on ``token`` (an int, or a
        lazy scalar ``mx.array`` still being computed) and return its next
        token as a lazy ``(1, 1)`` int32 (not evaluated here).  Needs
        :attr:`compiled` (a :class:`~mlxcluster.engine.compiled.CompiledGreedyStep`);
        only for a group of one rank (no collectives inside the compiled graph).
        """
        from .compiled import grow

        x = token.reshape(1, 1) if isinstance(token, mx.array) else mx.array([[int(token)]], dtype=mx.int32)
        if self._static is None:  # take over the KV cache's buffers
            kv = []
            for c in self.cache:
                kv += [c.keys, c.values]
            self._static = (kv, mx.array([self.position], dtype=mx.int32))
        kv, pos = self._static
        if self.position >= kv[0].shape[2]:
            kv = grow(kv)
        y, pos, kv = self.compiled(x.astype(mx.int32), pos, kv)
        self._static = (kv, pos)
        self.position += 1
        return y

    def leave_static(self) -> None:
        """Hand the compiled step's KV buffers back to the mlx-lm caches."""
        if self._static is None:
            return
        kv, _ = self._static
        self._static = None
        for i, c in enumerate(self.cache):
            c.keys, c.values = kv[2 * i], kv[2 * i + 1]
            c.offset = self.position

    def rollback(self, n: int = 1) -> None:
        """Forget the last ``n`` positions of the KV cache (a speculative step)."""
        self.position -= n
        if self._static is not None:
            kv, _ = self._static
            self._static = (kv, mx.array([self.position], dtype=mx.int32))
            return
        for c in self.cache:
            c.trim(n)

    def close(self) -> None:
        """Free the KV cache."""
        self.cache = None
        self._static = None


class DecodeBatch:
    """The sequences resident on one rank, decoded together (continuous batching).

    Sequences join after their own prefill (:meth:`add`, :meth:`add_group`) and leave on
    ``sessionStop`` (:meth:`remove`); the batch order (:attr:`sessions`, what :meth:`forward`
    takes and returns) is join order.  A lone sequence keeps its own ``KVCache`` and decodes
    exactly like :meth:`ShardSession.forward`; with two or more, their caches are merged into
    mlx-lm's left-padded ``BatchKVCache`` (one per layer, one row per sequence) and one forward
    pass of shape ``(R, 1)`` advances all of them.

    Joining and leaving such a cache copies all of it (``extend`` pads and concatenates,
    ``filter`` gathers): ~0.5 GB for 32 sequences of ~300 positions of SmolLM2 here.  So a
    leaving sequence's row stays in the cache as a *free row* (decoded alongside on a pad token,
    its output dropped) and a joining sequence whose prompt fits left of the cache's write index
    is written into a free row, right-aligned (its positions and left padding set per row, as
    ``BatchKVCache.merge`` lays rows out): no copy of the others' K/V.  The free rows are
    compacted away (one ``filter``) once more than half the rows are free -- or with the next
    ``extend`` -- which bounds the wasted rows.  Only ``BatchKVCache`` layers reuse rows (and
    :class:`~mlxcluster.engine.kvquant.BatchQuantizedKVCache`, the same over quantized triples, which
    a lone sequence's ``SequenceQuantizedKVCache`` merges into); other caches (sliding-window,
    recurrent) join and leave by copy.  Every rank applies the same
    add/remove/forward sequence and these rules depend on nothing else, so the batches stay
    identical across ranks.
    """

    def __init__(self, model, compute_logits: bool = True):
        self.model = model
        self.compute_logits = compute_logits or bool(getattr(model, "vocab_parallel", False))
        # --afd: sequences keep their own caches, the model runs them as micro-batches (forward_many)
        self.separate = bool(getattr(model, "separate_caches", False))
        self.sessions: List[ShardSession] = []
        self._cache: Optional[list] = None  # per-layer BatchKVCache when len > 1
        self._rows: List[Optional[ShardSession]] = []  # the batch cache's rows: a session, or None (free)
        self._order: Optional[Tuple[Optional[mx.array], Optional[mx.array]]] = None  # see _orders
        self.rows_reused = 0  # joins written into a free row instead of copying the cache
        self.compactions = 0  # left padding every row held, compacted away (_trim_padding)

    def __len__(self) -> int:
        return len(self.sessions)

    @property
    def uids(self) -> List[str]:
        return [s.uid for s in self.sessions]

    @property
    def free_rows(self) -> int:
        """Rows of the batch cache held by no sequence (see the class docstring)."""
        return sum(r is None for r in self._rows)

    def find(self, uid: str) -> Optional[ShardSession]:
        for s in self.sessions:
            if s.uid == uid:
                return s
        return None

    def _reusable(self) -> bool:
        return self._cache is not None and all(isinstance(c, BatchKVCache) for c in self._cache)

    def _compact(self, force: bool = False) -> None:
        """Drop the free rows from the batch cache (one ``filter``: a copy, which also shifts every row
        left by the smallest left padding); ``force``: filter even with no free row (that shift)."""
        keep = [i for i, r in enumerate(self._rows) if r is not None]
        if force or len(keep) < len(self._rows):
            for c in self._cache:
                c.filter(keep)
            self._rows = [self._rows[i] for i in keep]
            self._order = None

    def _write_row(self, row: int, kv: list, length: int) -> None:
        """Write a sequence's K/V of ``length`` positions (per layer ``(keys, values)``, each
        ``(1, heads, length, head_dim)`` or its quantized triple) into free ``row``, right-aligned at
        the write index."""
        for c, (k, v) in zip(self._cache, kv):
            start = c._idx - length
            kv_assign(c.keys, start, c._idx, k, row=row)
            kv_assign(c.values, start, c._idx, v, row=row)
            c.left_padding[row] = start
            c.offset[row] = length

    def _place(self, sessions: List[ShardSession], rows_kv: List[Tuple[list, int]]) -> bool:
        """Write joining ``sessions`` (their per-layer K/V and lengths in ``rows_kv``) into free
        rows, if there are enough and every prompt fits left of the write index; False (nothing
        written) otherwise."""
        free = [i for i, r in enumerate(self._rows) if r is None]
        if not self._reusable() or len(free) < len(sessions) or \
                any(n > self._cache[0]._idx for _, n in rows_kv):
            return False
        for row, session, (kv, n) in zip(free, sessions, rows_kv):
            self._write_row(row, kv, n)
            self._rows[row] = session
        self.rows_reused += len(sessions)
        self._order = None
        return True

    def add(self, session: ShardSession) -> None:
        """Append a prefilled session."""
        session.leave_static()
        for s in self.sessions:
            s.leave_static()
        if self.separate:
            pass
        elif len(self.sessions) == 1:
            first = self.sessions[0]
            # each kind merges into its batch twin: KVCache -> BatchKVCache, RotatingKVCache ->
            # BatchRotatingKVCache (sliding-window layers), ArraysCache (recurrent state), CacheList
            self._cache = [type(a).merge([a, b]) for a, b in zip(first.cache, session.cache)]
            self._rows = [first, session]
            self._order = None
            first.cache = None
            session.cache = None
        elif len(self.sessions) > 1:
            n = session.position
            own = all(full_attention(c) for c in session.cache)
            if not (own and self._place([session], [([(kv_slice(c.keys, 0, n), kv_slice(c.values, 0, n))
                                                      for c in session.cache], n)])):
                self._compact()
                for c, new in zip(self._cache, session.cache):
                    c.extend(type(new).merge([new]))
                self._rows.append(session)
                self._order = None
            session.cache = None
        self.sessions.append(session)

    def add_group(self, sessions: List[ShardSession], cache: list) -> None:
        """Append sessions prefilled together (:func:`_last_positions`): ``cache`` holds their
        rows, in ``sessions`` order, in one batch cache per layer (each session's own ``cache``
        is unused)."""
        for s in self.sessions:
            s.leave_static()
        if not self.sessions:
            self._cache = cache
            self._rows = list(sessions)
            self._order = None
        else:
            if len(self.sessions) == 1:
                first = self.sessions[0]
                self._cache = [type(c).merge([c]) for c in first.cache]
                self._rows = [first]
                first.cache = None
            placed = False
            if self.free_rows >= len(sessions) and all(isinstance(c, BatchKVCache) for c in cache):
                mx.eval(cache[0].left_padding)
                pads, idx = cache[0].left_padding.tolist(), cache[0]._idx
                placed = self._place(sessions, [([(kv_slice(c.keys, p, idx, row=i), kv_slice(c.values, p, idx, row=i))
                                                  for c in cache], idx - p) for i, p in enumerate(pads)])
            if not placed:
                self._compact()
                for c, new in zip(self._cache, cache):
                    c.extend(new)
                self._rows.extend(sessions)
                self._order = None
        for s in sessions:
            s.cache = None
        self.sessions.extend(sessions)

    def remove(self, uid: str) -> Optional[ShardSession]:
        """Drop a sequence and free its share of the KV cache (its row, see the class docstring)."""
        idx = next((i for i, s in enumerate(self.sessions) if s.uid == uid), None)
        if idx is None:
            return None
        gone = self.sessions.pop(idx)
        if self.separate:
            pass
        elif len(self.sessions) == 1:
            other = self._rows.index(self.sessions[0])
            self.sessions[0].cache = [c.extract(other) for c in self._cache]
            self._cache = None
            self._rows = []
            self._order = None
        elif len(self.sessions) > 1:
            self._rows[self._rows.index(gone)] = None
            self._order = None
            if not self._reusable() or 2 * self.free_rows > len(self._rows):
                self._compact()
            self._trim_padding()
        gone.close()
        return gone

    def _orders(self) -> Tuple[Optional[mx.array], Optional[mx.array]]:
        """``(to_rows, to_batch)`` int32 index arrays: the input index each cache row reads (the
        pad input ``len(sessions)`` for a free row) and the row each session's output is in; both
        ``None`` when rows are in batch order with none free."""
        if self._order is None:
            rows = [self._rows.index(s) for s in self.sessions]
            if rows == list(range(len(self._rows))):
                self._order = (None, None)
            else:
                where = {r: i for i, r in enumerate(rows)}
                pad = len(self.sessions)
                self._order = (mx.array([where.get(r, pad) for r in range(len(self._rows))], dtype=mx.int32),
                               mx.array(rows, dtype=mx.int32))
        return self._order

    def forward(self, x: mx.array) -> mx.array:
        """Queue one decode step: ``x[i]`` (``(B,)`` int32, possibly lazy) is
        fed to ``sessions[i]``.  Returns the lazy logits ``(B, vocab)`` on a
        ``compute_logits`` batch, else the lazy hidden states.  Nothing is
        evaluated here."""
        if len(self.sessions) == 1:  # a lone sequence keeps its own KVCache
            session = self.sessions[0]
            out = session.forward(x.reshape(1, 1))
            return out[None] if session.compute_logits else out
        x = x.reshape(-1)
        if self.separate:
            x = x.reshape(-1, 1)
            out = self.model.forward_many([x[i:i + 1] for i in range(len(self.sessions))],
                                          [s.cache for s in self.sessions])[:, -1]
        else:
            to_rows, to_batch = self._orders()
            if to_rows is not None:  # to cache rows, a pad token (0) for each free row
                x = mx.concatenate([x, mx.zeros((1,), dtype=x.dtype)])[to_rows]
            out = _forward(self.model, x.reshape(-1, 1), self._cache, self.compute_logits)
            out = out[:, -1] if self.compute_logits else out
            if to_batch is not None:  # ... and back to batch order
                out = out[to_batch]
        for s in self.sessions:
            s.position += 1
        return out

    def rollback(self, n: int = 1) -> None:
        """Forget the last ``n`` positions of every resident sequence (a
        queued lookahead step of the whole batch)."""
        if len(self.sessions) == 1 or self.separate:
            for s in self.sessions:
                s.rollback(n)
            return
        for c in self._cache:
            c.trim(n)
        for s in self.sessions:
            s.position -= n

    def forward_positions(self, x: mx.array) -> mx.array:
        """Queue one forward pass of ``L`` positions per resident sequence (a speculative verify step):
        ``x`` ``(B, L)`` int32, row i fed to ``sessions[i]`` at its positions ``[position, position +
        L)``.  Returns the lazy logits ``(B, L, vocab)`` on a ``compute_logits`` batch, else the lazy
        hidden states; every session's ``position`` advances by ``L`` (:meth:`keep` rolls back what
        is rejected).  A lone sequence runs on its own ``KVCache``; a batch on its ``BatchKVCache``
        rows (free rows fed the pad token 0, their outputs dropped)."""
        if self.separate:
            raise ValueError("speculative decoding is not built for sequences with separate caches (--afd)")
        L = x.shape[1]
        if len(self.sessions) == 1:
            session = self.sessions[0]
            session.leave_static()
            out = session._forward(x.reshape(1, L))
            session.position += L
            return out
        to_rows, to_batch = self._orders()
        if to_rows is not None:
            x = mx.concatenate([x, mx.zeros((1, L), dtype=x.dtype)])[to_rows]
        out = _forward(self.model, x, self._cache, self.compute_logits)
        if to_batch is not None:
            out = out[to_batch]
        for s in self.sessions:
            s.position += L
        return out

    def keep(self, kept: Sequence[int], written: int) -> None:
        """After :meth:`forward_positions` wrote ``written`` positions per sequence, keep the first
        ``kept[i]`` (0 <= kept[i] <= written) of ``sessions[i]`` and forget the rest.

        A lone ``KVCache`` is trimmed.  A ``BatchKVCache`` trims every row alike (one write index),
        so: ``trim(min rejected)``, then each row's further rejected positions become right
        padding that mlx-lm's ``prepare(right_padding=...)`` + ``finalize()`` rolls to the row's
        left (``dynamic_roll`` over the buffer; ``left_padding`` grows and ``offset`` drops by
        it), where the mask hides it -- the mechanism of a batched prefill (:func:`_last_positions`),
        so a row then holds exactly what a sequence decoded one token at a time holds, its keys'
        RoPE positions unchanged.  The roll copies the batch's K/V (one pass over the buffers);
        only when rows' rejections differ.  Free rows are rolled by nothing.  Rows' left padding
        grows by their extra rejections; once the smallest over the occupied rows reaches
        :data:`PAD_SLACK` positions and a quarter of the write index, the cache is
        compacted (:meth:`_trim_padding`).

        Raises:
            ValueError: ``kept`` of another length than the batch, or a count outside ``[0, written]``.
        """
        if len(kept) != len(self.sessions) or any(not 0 <= k <= written for k in kept):
            raise ValueError(f"keep {list(kept)} of {written} positions does not fit a batch of {len(self.sessions)}")
        rejected = [written - int(k) for k in kept]
        if len(self.sessions) == 1:
            if rejected[0]:
                self.sessions[0].rollback(rejected[0])
            return
        least = min(rejected)
        extra = [0] * len(self._rows)
        for s, r in zip(self.sessions, rejected):
            extra[self._rows.index(s)] = r - least
            s.position -= r
        for c in self._cache:
            if least:
                c.trim(least)
            if max(extra) > 0:
                c.prepare(right_padding=extra)
                c.finalize()
        if any(extra):
            self._trim_padding()

    def _trim_padding(self) -> None:
        """Compact the batch cache (``filter``: every row shifted left by the smallest left padding of
        the occupied rows, free rows dropped) once that padding reaches :data:`PAD_SLACK` positions and
        a quarter of the write index.  Every decode step attends over the cache up to its write index,
        padding included, so padding every row holds is work (and memory) for nothing.  It piles up
        two ways: a row that joins is right-aligned at the write index (its prompt left-padded), so
        once the rows that were there first have left, every remaining row holds padding; and rows'
        rejected speculative positions (:meth:`keep`).  The copy costs one pass over the cache
        (~a decode step's K/V reads), and it saves at least a quarter of every later step's."""
        if not self._reusable() or len(self.sessions) < 2:
            return
        pads = self._cache[0].left_padding.tolist()
        slack = min(pads[self._rows.index(s)] for s in self.sessions)
        if slack >= max(PAD_SLACK, self._cache[0]._idx // 4):
            self._compact(force=True)
            self.compactions += 1


#: a batch's KV cache is compacted once every occupied row holds at least this many positions of left
#: padding (and a quarter of the write index): the padding of rows that joined a running batch, and
#: rows' rejected speculative positions, pile up there (:meth:`DecodeBatch._trim_padding`)
PAD_SLACK = 64


# -- the engine -----------------------------------------------------------------

@dataclass(frozen=True)
class Sampling:
    """Sampling settings of one sequence: ``temperature`` 0 is greedy; ``top_p``
    in (0, 1) enables nucleus sampling, ``top_k`` > 0 keeps the k most likely tokens and
    ``min_p`` in (0, 1] those at least ``min_p`` times as likely as the most likely
    (mlx-lm's filters, :func:`make_token_sampler`); ``seed`` makes a sampled sequence
    reproducible (the same on every rank that samples it).  ``logit_bias``
    (``((token_id, bias), ...)``, added to the logits), ``presence_penalty`` and
    ``frequency_penalty`` (OpenAI's) and ``repetition_penalty`` (> 0, mlx-lm's, over the last
    ``repetition_context_size`` tokens of prompt + answer; 1.0 or a window of 0: none) are
    logits processors (:class:`LogitsProcessor`).
    ``logprobs``: report each token's log-probability and the ``top_logprobs`` (0..20) most
    likely tokens' (:attr:`SequenceState.last_logprob`); ``grammar``: constrain the tokens to
    this llguidance grammar (:mod:`mlxcluster.engine.constraint`).  These two concern the
    rank that samples (rank 0) only."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    logit_bias: Tuple[Tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: str = ""
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20

    @property
    def repeats(self) -> bool:
        """True when the repetition penalty changes anything (a factor other than 1, a window)."""
        return self.repetition_penalty != 1.0 and self.repetition_context_size > 0

    @property
    def processed(self) -> bool:
        """True when a logits processor applies (then the compiled greedy step does not)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty or self.repeats)


#: mlx-lm's default window of the repetition penalty (``make_logits_processors``), in tokens
REPETITION_CONTEXT_SIZE = 20


def sampling_of(msg) -> Sampling:
    """The :class:`Sampling` a ``Sampling`` message (``mlxcluster_pb2.Sampling``) asks for: the same on
    every rank (``logit_bias`` sorted by token id; an unset ``top_p`` is 1, an unset
    ``repetition_penalty`` 1 and an unset ``repetition_context_size`` :data:`REPETITION_CONTEXT_SIZE`)."""
    return Sampling(msg.temperature, msg.top_p or 1.0, msg.seed, tuple(sorted(msg.logit_bias.items())),
                    msg.presence_penalty, msg.frequency_penalty, msg.logprobs, max(0, msg.top_logprobs),
                    msg.grammar, max(0, msg.top_k), msg.min_p,
                    msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
                    msg.repetition_context_size if msg.HasField("repetition_context_size")
                    else REPETITION_CONTEXT_SIZE)


class LogitsProcessor:
    """The logits processors of one sequence: ``logit_bias``, mlx-lm's repetition penalty and
    OpenAI's presence/frequency penalties, applied in mlx-lm's order (``make_logits_processors``:
    bias, repetition, presence, frequency).

    ``logits (vocab,) -> l = logits + bias``; then mlx-lm's ``make_repetition_penalty`` (CTRL,
    arxiv.org/abs/1909.05858): for each token among the last ``repetition_context_size`` tokens
    of prompt + answer, ``l[j] / penalty`` where ``l[j] >= 0`` else ``l[j] * penalty``; then
    ``l - counts * frequency_penalty - (counts > 0) * presence_penalty``, where ``counts[j]`` is
    how many times token ``j`` was generated so far in this sequence (the prompt does not
    count): OpenAI's formula ("mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) *
    alpha_presence", platform.openai.com/docs/guides/text-generation, parameter details).
    The counts (a ``(vocab,)`` float32 array) and the repetition window (``(<= window,)`` int32
    token ids, starting with the prompt's last tokens) are lazy arrays updated with each sampled
    token (:meth:`record`), so a lookahead step queued on a token not read yet is penalised by
    it; :meth:`rollback` forgets a withdrawn step's token.

    Args:
        sampling: the sequence's :class:`Sampling`.
        prompt: its prompt's token ids (ints): the repetition penalty's first window.
    """

    def __init__(self, sampling: Sampling, prompt: Sequence[int] = ()):
        self.bias_items = tuple(sampling.logit_bias)
        self.presence = float(sampling.presence_penalty)
        self.frequency = float(sampling.frequency_penalty)
        self.bias: Optional[mx.array] = None
        self.counts: Optional[mx.array] = None  # built on first use, sized by the logits
        self.window = int(sampling.repetition_context_size) if sampling.repeats else 0
        self.recent: Optional[mx.array] = None  # the repetition penalty's window of token ids
        self._repeat = None
        if self.window:
            from mlx_lm.sample_utils import make_repetition_penalty

            self._repeat = make_repetition_penalty(float(sampling.repetition_penalty), self.window)
            self.recent = mx.array([int(t) for t in list(prompt)[-self.window:]], dtype=mx.int32)
        self._saved: List[Tuple[Optional[mx.array], Optional[mx.array]]] = []
        self._pending_counts: Optional[List[int]] = None  # primed tokens, counted once the vocabulary is known

    def _init(self, vocab: int) -> None:
        if self.bias is None and self.bias_items:
            ids = mx.array([i for i, _ in self.bias_items], dtype=mx.int32)
            vals = mx.array([b for _, b in self.bias_items], dtype=mx.float32)
            self.bias = mx.zeros((vocab,), dtype=mx.float32).at[ids].add(vals)
        if self.counts is None and (self.presence or self.frequency):
            self.counts = mx.zeros((vocab,), dtype=mx.float32)
            if self._pending_counts:  # a resumed answer's tokens (prime)
                ids = mx.array(self._pending_counts, dtype=mx.int32)
                self.counts = self.counts.at[ids].add(mx.ones(ids.shape, dtype=mx.float32))
                self._pending_counts = None

    def __call__(self, logits: mx.array) -> mx.array:
        self._init(logits.shape[-1])
        out = logits.astype(mx.float32)
        if self.bias is not None:
            out = out + self.bias
        if self.recent is not None:
            out = self._repeat(self.recent, out[None])[0]  # mlx-lm's processor takes (1, vocab)
        if self.counts is not None:
            out = out - self.counts * self.frequency - (self.counts > 0).astype(mx.float32) * self.presence
        return out

    @property
    def counts_tokens(self) -> bool:
        """True when the presence/frequency penalties count the answer's tokens."""
        return bool(self.presence or self.frequency)

    def prime(self, tokens: Sequence[int]) -> None:
        """Count ``tokens`` (int ids: a resumed answer's first tokens, sampled elsewhere) as generated
        by this sequence; the repetition window is left alone (they end the prompt it started from)."""
        if not self.counts_tokens or not tokens:
            return
        self._pending_counts = list(self._pending_counts or []) + [int(t) for t in tokens]

    def record(self, token) -> None:
        """Count a sampled token (an int, or a lazy scalar ``mx.array``)."""
        if self.counts is None and self.recent is None:
            return
        self._saved = self._saved[-1:] + [(self.counts, self.recent)]  # one withdrawable step at most
        if self.counts is not None:
            self.counts = self.counts + (mx.arange(self.counts.shape[0]) == token).astype(mx.float32)
        if self.recent is not None:
            t = (token if isinstance(token, mx.array) else mx.array(int(token))).astype(mx.int32).reshape(1)
            self.recent = mx.concatenate([self.recent, t])[-self.window:]

    def rollback(self) -> None:
        """Forget the last recorded token (a withdrawn lookahead step)."""
        if self._saved:
            self.counts, self.recent = self._saved.pop()

    def snapshot(self) -> tuple:
        """The state :meth:`restore` returns to (lazy arrays are immutable: no copy): a speculative
        step records a draft's tokens to process the positions after them, then restores this and
        records only the tokens verified (:meth:`RankEngine.verify`)."""
        return (self.counts, self.recent, list(self._saved))

    def restore(self, state: tuple) -> None:
        """Return to a :meth:`snapshot`."""
        self.counts, self.recent, saved = state
        self._saved = list(saved)


@dataclass
class SequenceState:
    """One sequence resident on this rank.

    ``sampler`` is ``None`` on a rank that does not sample the sequence (a
    frame-driven rank N: its tokens come in frames).  ``token`` is the next
    decode input (the last token sampled here); ``generated`` counts tokens
    sampled here, after the ``resumed`` tokens of an answer resumed from an earlier group
    (:meth:`resume`); ``reason`` is the deterministic stop (``EOS``,
    ``MAX_TOKENS``, ``CONTEXT_FULL``) once reached, else 0.
    """

    session: ShardSession
    sampler: Optional[Sampler]
    eos: frozenset
    max_tokens: int
    generated: int = 0
    resumed: int = 0  # the answer's first tokens, generated by an earlier group (lossless failover)
    token: int = -1
    reason: int = 0
    prompt: Sequence[int] = ()
    processor: Optional[LogitsProcessor] = None  # logit_bias / penalties, on a rank that samples
    constraint: Any = None  # engine.constraint.Constraint: a grammar, on rank 0
    prefilling: bool = False  # admitted, its prompt not yet wholly prefilled (RankEngine.prefill_chunk)
    #: on a rank N that samples the sequence too: its last token was sampled elsewhere (a step of a
    #: batch this rank could not sample whole, a verify step) and is learned from the next plan's feed
    awaits_token: bool = False
    salt: str = ""  # its prompt's prefix-cache namespace (Compute.salt)
    top_logprobs: int = -1  # -1: no logprobs; else how many most likely tokens to report
    sampling: Optional["Sampling"] = None  # on a rank that samples: what it asked for (speculative verification)
    #: ``(logprob, ((token_id, logprob), ...))`` of the last token recorded (``top_logprobs`` >= 0)
    last_logprob: Optional[Tuple[float, Tuple[Tuple[int, float], ...]]] = None
    _logprobs: Dict[int, Tuple[mx.array, ...]] = field(default_factory=dict)  # token index -> lazy logprobs

    @property
    def plain(self) -> bool:
        """No processor, grammar or logprobs: the compiled greedy step may run it."""
        return self.processor is None and self.constraint is None and self.top_logprobs < 0

    def draw(self, logits: mx.array, index: int) -> mx.array:
        """Sample token ``index`` from ``logits`` ``(vocab,)`` (lazy).  The processor, if any,
        is applied first and counts the drawn token; then the grammar's mask; the
        log-probabilities are those of the distribution after both (before temperature)."""
        if self.plain:
            return self.sampler(logits, index)
        if self.processor is not None:
            logits = self.processor(logits)
        if self.constraint is not None:
            logits = self.constraint(logits)
        token = self.sampler(logits, index)
        if self.processor is not None:
            self.processor.record(token)
        if self.top_logprobs >= 0:
            logits = logits.astype(mx.float32)
            lp = logits - mx.logsumexp(logits, axis=-1)
            entry = (lp[token],)
            if self.top_logprobs > 0:
                top = mx.argpartition(-lp, self.top_logprobs - 1)[:self.top_logprobs]
                entry += (top, lp[top])
            self._logprobs[index] = entry
        return token

    def lazy_logprobs(self, index: int) -> List[mx.array]:
        """The lazy log-probability arrays of token ``index`` (to evaluate with it)."""
        return list(self._logprobs.get(index, ()))

    def recorded(self, token: int) -> None:
        """Token ``generated`` (0-based) is ``token``: read its log-probabilities, advance the grammar."""
        entry = self._logprobs.pop(self.generated, None)
        if entry is not None:
            top = ()
            if len(entry) == 3:
                pairs = zip(entry[1].tolist(), entry[2].tolist())
                # most likely first; tokens the grammar forbids (-inf) are not candidates
                top = tuple(sorted(((int(i), float(v)) for i, v in pairs if v != -float("inf")),
                                   key=lambda p: (-p[1], p[0])))
            self.last_logprob = (float(entry[0].item()), top)
        if self.constraint is not None:
            self.constraint.consume(token)

    def resume(self, tokens: Sequence[int]) -> None:
        """Lossless failover: ``tokens`` (int ids) are this sequence's first tokens, sampled by an
        earlier group; go on as if they had been sampled here: :attr:`generated` starts at
        ``len(tokens)`` (so the next token is drawn with index ``len(tokens)``, and the stop rule's
        ``max_tokens`` counts them), the processor's presence/frequency counts include them (its
        repetition window already does: they end the prompt), and a grammar consumes them before
        its first mask (a refused token raises ``GrammarError`` then: check them first with
        :func:`~mlxcluster.engine.constraint.check_resume`, as rank 0's scheduler does).

        Raises:
            ValueError: an EOS among ``tokens``, or ``len(tokens) >= max_tokens`` (nothing left to
                generate); one line.
        """
        tokens = [int(t) for t in tokens]
        eos = next((t for t in tokens if t in self.eos), None)
        if eos is not None:
            raise ValueError(f"resume_token_ids holds the end-of-sequence token {eos}: that answer has ended")
        if self.max_tokens and len(tokens) >= self.max_tokens:
            raise ValueError(f"resume_token_ids holds {len(tokens)} tokens: nothing is left to generate within "
                             f"max_tokens {self.max_tokens}")
        if self.constraint is not None:
            self.constraint.resume(tokens)
        if self.processor is not None and self.processor.counts_tokens:
            self.processor.prime(tokens)
        self.generated = self.resumed = len(tokens)
        if tokens:
            self.token = tokens[-1]

    def forget(self) -> None:
        """Forget a withdrawn lookahead step's token (index ``generated``)."""
        if self.processor is not None:
            self.processor.rollback()
        self._logprobs.pop(self.generated, None)


@dataclass(frozen=True)
class Compute:
    """Where a joining sequence's K/V comes from: computed here by :meth:`RankEngine.prefill_chunk`,
    after its first ``cached`` positions taken from this rank's :class:`PrefixCache` (0: none;
    every rank of a group is given the same value).  Cached positions count as computed tokens, as
    vLLM's ``KVConnector`` counts external K/V like prefix-cache hits.  ``salt``: the prompt's
    prefix-cache namespace (:class:`PrefixCache`; "" shared): cached positions come from it and the
    prompt is held there."""

    cached: int = 0
    salt: str = ""
    #: rank 0's cached positions come from its disk tier: in a group of several ranks each rank takes
    #: what it holds and the group agrees on the fewest (:meth:`PrefixCache.take` ``from_disk``)
    disk: bool = False


@dataclass(frozen=True)
class Remote:
    """Where a joining sequence's K/V comes from: prefilled elsewhere (prefill/decode
    disaggregation): ``kv`` maps every layer to its ``(keys, values)``, each ``(1, n_kv_heads of
    this rank, len(prompt), head_dim)`` -- or its packed triple, in a quantized KV format
    (:mod:`~mlxcluster.engine.kvquant`) -- (checked by :class:`~mlxcluster.engine.pd.KvStream`), and
    ``first_token`` is the prefill group's first token of the answer."""

    kv: Any
    first_token: int


def queuing_computes() -> bool:
    """Whether queuing a decode step with ``mx.async_eval`` computes it before returning: MLX's CPU
    backend, where a group's step ran inside ``async_eval`` (its collectives complete there; 10.2 of
    a 10.7 ms TP=2 step, BENCHMARKS.md issue 42), unlike Metal's command buffers.  A group's engines
    then read a step's tokens before they queue the next (:attr:`RankEngine.read_first`)."""
    return mx.default_device() == mx.cpu


class RankEngine:
    """This rank's resident sequences and the forward passes over them.

    Args:
        model: this rank's shard (:class:`~mlxcluster.model.tp.LlamaModelTP`).
        context_length: maximum tokens in a sequence's KV cache.
        compute_logits: run the output head for sequences this rank does not
            sample (rank 0: True; ranks N: False -- unless the head is
            vocabulary-parallel, whose all_gather every rank must join).
        compile_decode: a lone greedy sequence's step runs as one
            ``mx.compile``'d function over static KV buffers (only for a
            group of one rank: no collective inside the compiled graph).
        prefill_model: ``--local-decode`` (rank 0): prompts are prefilled through this
            pipeline (:class:`~mlxcluster.model.pp.PipelinedModel` over ``model``'s own
            layers), the other stages' K/V arrive by :meth:`install`, and ``model`` (every
            layer) decodes alone.
    """

    def __init__(self, model, context_length: int, compute_logits: bool = True, compile_decode: bool = False,
                 prefill_model=None, tokenizer=None, probe_lookahead: bool = True, read_first: bool = False):
        self.model = model
        # time the first lookahead steps and turn lookahead off where queuing does the work (a group
        # of one rank); in a group lookahead also hides the next plan's flight, so it stays as planned
        self.probe_lookahead = probe_lookahead
        self.tokenizer = tokenizer  # Hugging Face tokenizer: grammars (Sampling.grammar) need it
        self.prefill_model = prefill_model
        self.context_length = context_length
        self.compute_logits = compute_logits
        self.compile_decode = compile_decode
        self.batch = DecodeBatch(model, compute_logits=compute_logits)
        # a queued lookahead step is withdrawn by trimming one position: caches whose state
        # cannot be rolled back (recurrent ArraysCache, ...) decode without lookahead
        self.trimmable = _trimmable_caches(model)
        self.batched_prefill = _groupable(model) and prefill_model is None
        # the same models keep earlier prompts' K/V for later prompts (PREFIX_CACHE_POSITIONS 0: none)
        self.prefix = PrefixCache() if self.batched_prefill and PREFIX_CACHE_POSITIONS > 0 else None
        self.sequences: Dict[str, SequenceState] = {}
        self._compiled = None
        self._pending: Optional[mx.array] = None  # the queued lookahead step's lazy tokens (B,)
        #: a lookahead step reads this step's tokens before it queues the next one, which
        #: :meth:`queue_owed` does (see :meth:`step`); the step owed meanwhile: (sequences, tokens)
        self.read_first = read_first
        self._owed: Optional[Tuple[List[SequenceState], mx.array]] = None
        self._lengths = threading.Lock()  # kv_length (another thread's) against queue_owed's build
        # lookahead, per kind of step (True: the compiled lone step): seconds queuing the next step
        # and seconds then waiting for this one's tokens; kinds whose queuing does the work: no lookahead
        self._probes: Dict[bool, List[Tuple[float, float]]] = {True: [], False: []}
        self.lookahead_off: set = set()
        # speculative decoding (verify): why this model cannot (one line), or None
        self.speculative_error: Optional[str] = _speculation_refusal(model)
        self._unverified: Optional[int] = None  # positions a frame-driven verify wrote, until commit
        # sequences prefilled after such a verify step, in the same plan: (uids, their join to the
        # batch), run by commit after the rollback -- the order rank 0's batch saw them in
        self._deferred: List[Tuple[List[str], Callable[[], None]]] = []
        # --pd: sequences whose received K/V is installed, not yet in the batch: rank 0 may still refuse
        # them (another rank's stream failed); they join at join_remote, once that is decided
        self._remote: List[str] = []
        from .speculative import SpecStats

        self.spec_stats = SpecStats()
        from .memory import CacheUpkeep

        self.upkeep = CacheUpkeep()  # a periodic mx.clear_cache() (mlx-lm's), one tick per decode/verify step

    def get(self, uid: str) -> Optional[SequenceState]:
        return self.sequences.get(uid)

    # -- the three operations ----------------------------------------------------------
    def attach_disk(self, disk, agree: Optional[Callable[[int], int]] = None) -> bool:
        """Give this rank's :class:`PrefixCache` the disk tier ``disk``
        (:class:`~mlxcluster.engine.prompt_disk.DiskPrompts`) and, in a group of several ranks,
        ``agree`` (:attr:`PrefixCache.agree`: an ``all_min`` over the group); False (nothing
        attached) where this model keeps no prefix cache."""
        if self.prefix is None:
            return False
        self.prefix.disk, self.prefix.agree = disk, agree
        return True

    def prefix_match(self, prompt: Sequence[int], salt: str = "", disk: bool = True) -> int:
        """Leading positions of ``prompt`` this rank's :class:`PrefixCache` holds under namespace
        ``salt`` (0: none), in memory or (``disk``) on its disk tier."""
        return self.prefix.match(prompt, salt, disk) if self.prefix is not None else 0

    def prefix_lookup(self, prompt: Sequence[int], salt: str = "") -> Tuple[int, bool]:
        """``(n, on_disk)``: :meth:`prefix_match` and whether the positions come from the disk tier
        (:meth:`PrefixCache.lookup`; ``(0, False)`` without a prefix cache)."""
        return self.prefix.lookup(prompt, salt) if self.prefix is not None else (0, False)

    def admit(self, uid: str, prompt: Sequence[int], sampling: Optional[Sampling] = None,
              eos_token_ids: Iterable[int] = (), max_tokens: int = 0,
              source: "Compute | Remote" = Compute(), resumed: Sequence[int] = ()) -> SequenceState:
        """The one way a sequence joins this rank: ``prompt`` (int token ids) as new sequence
        ``uid``, its K/V from ``source``.

        * :class:`Compute`: its KV cache is made and its first ``source.cached`` positions taken
          from the prefix cache; nothing is computed.  The prompt is then prefilled by
          :meth:`prefill_chunk` calls (one per step of rank 0's loop for a long prompt) or by
          :meth:`prefill_admitted` (the rest at once, several prompts together) and the sequence
          joins the decode batch after the chunk that ends it.
        * :class:`Remote`: the K/V is installed, its first token the prefill group's (counted as
          generated where this rank samples it); the sequence joins the decode batch at the next
          :meth:`join_remote` (at the latest before the next decode step), once rank 0 has decided for
          the group whether it decodes -- a sequence rank 0 refuses never joins any rank's batch.

        With ``sampling`` this rank samples the sequence and applies the stop rule with
        ``eos_token_ids`` and ``max_tokens``.  Returns its :class:`SequenceState` (``token``: the
        first token once known).

        ``resumed`` (lossless failover; int token ids, the last ``len(resumed)`` ids of ``prompt``):
        the answer's first tokens, generated by an earlier group; the sequence goes on as if it had
        sampled them itself (:meth:`SequenceState.resume`): its next token is number
        ``len(resumed)`` (the seeded sampler's index), ``max_tokens`` counts them, the
        presence/frequency counts and a grammar include them.  Only with :class:`Compute`.

        Raises:
            KeyError: ``source.cached`` positions of ``prompt`` are not in this rank's prefix cache.
            ValueError: ``uid`` is already resident, the cached positions leave nothing to prefill,
                a remote layer is missing or of another length, ``sampling.grammar`` on a rank
                without a tokenizer, or ``resumed`` that is not the end of ``prompt``, holds an EOS,
                reaches ``max_tokens`` or comes with a :class:`Remote` source.
        """
        if uid in self.sequences:
            raise ValueError(f"sequence {uid!r} is already resident")
        resumed = [int(t) for t in resumed]
        if resumed and (isinstance(source, Remote) or list(prompt[len(prompt) - len(resumed):]) != resumed
                        or len(resumed) >= len(prompt)):
            raise ValueError("resumed tokens must end the prompt of a computed join")
        session = ShardSession(self.model, uid, compute_logits=self.compute_logits or sampling is not None)
        seq = self._sequence(session, sampling, eos_token_ids, max_tokens, prompt, self.tokenizer)
        if resumed:
            seq.resume(resumed)
        if isinstance(source, Remote):
            session.position = len(prompt)
            try:
                self._install(seq, source.kv, join=False)
            except ValueError:
                session.close()
                raise
            self.sequences[uid] = seq
            self._remote.append(uid)
            if seq.sampler is None:
                seq.token = int(source.first_token)
            else:
                if seq.processor is not None:
                    seq.processor.record(int(source.first_token))
                self._record(seq, int(source.first_token))
            return seq
        if not 0 <= source.cached < len(prompt):
            raise ValueError(f"{source.cached} cached positions of a {len(prompt)}-token prompt leave nothing "
                             f"to prefill")
        seq.salt = source.salt
        if source.cached:
            kv = self.prefix.take(prompt, source.cached, source.salt, source.disk)
            if kv:  # fewer positions only where a disk file was refused or, in a group, a rank held fewer
                _with_prefix(session, kv, kv_length(kv[0][0]))
        seq.prefilling = True
        self.sequences[uid] = seq
        return seq

    def prefill_chunk(self, uid: str, count: int) -> Optional[int]:
        """Prefill the next ``count`` prompt tokens of admitted sequence ``uid`` (:meth:`admit`),
        those at positions ``[position, position + count)`` of its KV cache, in passes of at most
        ``PREFILL_CHUNK_TOKENS``.  The chunk that ends the prompt keeps the prompt in the prefix
        cache and adds the sequence to the decode batch (with a ``prefill_model``, only once
        :meth:`install` or :meth:`recompute` has filled the other stages' layers); it returns the
        first token (int) where this rank samples the sequence.  Every other call returns ``None``.
        Calls whose chunks start at the same positions compute the same K/V and logits as one
        call over the whole prompt (the same passes, in the same order).

        Raises:
            KeyError: ``uid`` is not resident.
            ValueError: ``uid`` is not being prefilled, or the chunk is empty or runs past the prompt.
        """
        seq = self.sequences[uid]
        session = seq.session
        start = session.position
        if not seq.prefilling:
            raise ValueError(f"sequence {uid!r} is not being prefilled")
        if count < 1 or start + count > len(seq.prompt):
            raise ValueError(f"a chunk of {count} tokens at position {start} does not fit {uid!r}'s "
                             f"{len(seq.prompt)}-token prompt")
        self._withdraw_lookahead()
        logits = session.prefill(seq.prompt[start:start + count], via=self.prefill_model)
        if session.position < len(seq.prompt):
            return None
        seq.prefilling = False
        if self.prefix is not None:
            self.prefix.add(seq.prompt, lambda a, b: [(kv_slice(c.keys, a, b), kv_slice(c.values, a, b))
                                                      for c in session.cache], seq.salt)
        if self.prefill_model is None:
            self._join_batch([uid], lambda: self.batch.add(session))
        return None if seq.sampler is None else self._sample(seq, logits)

    def prefill(self, uid: str, prompt: Sequence[int], sampling: Optional[Sampling] = None,
                eos_token_ids: Iterable[int] = (), max_tokens: int = 0, cached: int = 0) -> Optional[int]:
        """:meth:`admit` ``uid`` (:class:`Compute` after ``cached`` prefix-cache positions) and
        prefill its whole prompt at once (:meth:`prefill_chunk`): returns its first token where
        this rank samples it, else ``None``.

        Raises:
            KeyError, ValueError: as :meth:`admit`.
        """
        seq = self.admit(uid, prompt, sampling, eos_token_ids, max_tokens, Compute(cached))
        return self.prefill_chunk(uid, len(prompt) - seq.session.position)

    def prefill_many(self, items: Sequence[Tuple[str, Sequence[int], Optional[Sampling], Iterable[int], int, int]]
                     ) -> List[Optional[int]]:
        """Admit several new sequences, ``items`` of ``(uid, prompt, sampling, eos_token_ids,
        max_tokens, cached)`` as in :meth:`prefill` (every admit before any prefill), and prefill
        them together (:meth:`prefill_admitted`).  Returns each sequence's first token (int) where
        this rank samples it, else ``None``.

        Raises:
            KeyError, ValueError: as :meth:`admit`.
        """
        for uid, prompt, sampling, eos, max_tokens, cached in items:
            self.admit(uid, prompt, sampling, eos, max_tokens, Compute(cached))
        return self.prefill_admitted([item[0] for item in items], together=True)

    def prefill_admitted(self, uids: Sequence[str], together: bool = False) -> List[Optional[int]]:
        """Prefill the rest of the prompt of each admitted sequence (:meth:`admit` with
        :class:`Compute`) and add them to the batch in that order.

        With ``together``, :attr:`batched_prefill` and two or more sequences, the prompts run
        together: one forward pass of shape ``(G, chunk)`` per chunk instead of G passes (mlx-lm's
        ``BatchGenerator``); else one after another (:meth:`prefill_chunk` over the rest of each).
        Returns each sequence's first token (int) where this rank samples it, else ``None``.  Every
        rank of a group must make the same call (the passes hold collectives).  Together, the
        logits may differ from a lone prefill's in the last bits (other matrix shapes);
        BENCHMARKS.md measures how often that changes a greedy answer.

        Raises:
            KeyError: a uid is not resident.  ValueError: a sequence is not being prefilled.
        """
        seqs = [self.sequences[uid] for uid in uids]
        bad = next((s for s in seqs if not s.prefilling), None)
        if bad is not None:
            raise ValueError(f"sequence {bad.session.uid!r} is not being prefilled")
        if len(seqs) < 2 or not together or not self.batched_prefill:
            return [self.prefill_chunk(s.session.uid, len(s.prompt) - s.session.position) for s in seqs]
        self._withdraw_lookahead()
        sessions = [s.session for s in seqs]
        compute = any(s.compute_logits for s in sessions)
        for s in sessions:
            s.compute_logits = compute
        prompts = [list(s.prompt) for s in seqs]
        # rows of different cached lengths: merged left-padded, then the rest right-padded
        cache = [type(layer[0]).merge(list(layer)) for layer in zip(*(s.cache for s in sessions))]
        logits = _last_positions(self.model, [p[s.position:] for p, s in zip(prompts, sessions)], cache,
                                 sessions[0].compute_logits)
        if self.prefix is not None:
            mx.eval(cache[0].left_padding)
            for i, (prompt, pad) in enumerate(zip(prompts, cache[0].left_padding.tolist())):
                self.prefix.add(prompt, lambda a, b: [(kv_slice(c.keys, pad + a, pad + b, row=i),
                                                       kv_slice(c.values, pad + a, pad + b, row=i)) for c in cache],
                                seqs[i].salt)
        for seq, prompt in zip(seqs, prompts):
            seq.session.position = len(prompt)
            seq.prefilling = False
        self._join_batch([s.uid for s in sessions], lambda: self.batch.add_group(sessions, cache))
        sampled = [i for i, s in enumerate(seqs) if s.sampler is not None]
        out: List[Optional[int]] = [None] * len(seqs)
        if sampled:
            y = self._draw([seqs[i] for i in sampled], logits[mx.array(sampled)] if len(sampled) < len(seqs)
                           else logits, ahead=0)
            mx.eval(y, *[a for i in sampled for a in seqs[i].lazy_logprobs(seqs[i].generated)])
            for i, t in zip(sampled, y.tolist()):
                self._record(seqs[i], t)
                out[i] = t
        return out

    def kv_bytes_per_position(self) -> float:
        """Bytes one position of one sequence takes in this rank's KV caches that grow with the
        context (full-attention layers, quantized or not: keys and values, packed codes with their
        scales and biases), over every layer it holds: each layer's buffers' bytes over the rows x
        positions they are allocated for -- not over the positions filled, which a cache's growth in
        steps of 256 positions would inflate ~50x after a 5-token prompt.  Sliding-window and
        recurrent layers (a fixed size) are not counted.  0.0 before a cache is allocated."""
        caches = self.batch._cache if self.batch._cache is not None else \
            next((s.cache for s in self.batch.sessions if s.cache is not None), [])
        total = 0.0
        for c in caches:
            if not (full_attention(c) or isinstance(c, BatchKVCache)) or getattr(c, "keys", None) is None:
                continue
            arrays = [a for x in (c.keys, c.values) for a in (x if quantized(x) else (x,))]
            total += sum(a.nbytes for a in arrays) / (arrays[0].shape[0] * arrays[0].shape[2])
        return total

    def install(self, uid: str, kv) -> None:
        """``--local-decode``: fill admitted ``uid``'s other layers from a checked handoff
        (``{layer: (keys, values)}``, :class:`~mlxcluster.engine.handoff.KvStream`) and add it to
        the batch -- the one install, as :meth:`admit` with :class:`Remote` does.

        Raises:
            ValueError: some layer is still empty afterwards, or already held positions.
        """
        self._install(self.sequences[uid], kv)

    def _install(self, seq: "SequenceState", kv, join: bool = True) -> None:
        """The one install of received K/V: ``kv`` (``{layer: (keys, values)}``) into ``seq``'s
        KV cache, every layer then holding K/V, and (``join``) ``seq`` added to the decode batch.

        Raises:
            ValueError: a layer already held positions, or is still empty afterwards.
        """
        session = seq.session
        session.install(kv)
        empty = [i for i, c in enumerate(session.cache) if c.empty()]
        if empty:
            raise ValueError(f"layers {empty[0]}..{empty[-1]} of {session.uid!r} received no K/V")
        if join:
            self._withdraw_lookahead()
            self._join_batch([session.uid], lambda: self.batch.add(session))

    def join_remote(self, refused: Iterable[str] = ()) -> List[str]:
        """``--pd``: add the sequences whose K/V :meth:`admit` installed from a :class:`Remote` source
        to the decode batch, in admission order, but those in ``refused`` (uids rank 0 refused for the
        group: they only leave).  Rank 0 calls it after the plan that fetched them (its joins and
        chunks run), once it has decided; a rank N at the start of the next plan, after
        :meth:`commit` and before its leaves -- the point of rank 0's batch that follows that plan --
        with the plan's refusals (its leaves of such sequences with reason ``ERROR``).  So every rank
        changes its batch in the same order and never holds a row for a sequence rank 0 refused (its
        removal would leave a free row there that rank 0's batch does not have).  Returns the uids
        added."""
        refused = set(refused)
        added = [u for u in self._remote if u not in refused]
        self._remote = [u for u in self._remote if u in refused]
        for uid in added:
            session = self.sequences[uid].session
            self._withdraw_lookahead()
            self._join_batch([uid], lambda session=session: self.batch.add(session))
        return added

    @staticmethod
    def _sequence(session: ShardSession, sampling: Optional[Sampling], eos_token_ids: Iterable[int],
                  max_tokens: int, prompt: Sequence[int], tokenizer=None) -> SequenceState:
        """Raises ValueError: ``sampling.grammar`` on a rank without a tokenizer."""
        sampler = None if sampling is None else make_token_sampler(sampling.temperature, sampling.top_p,
                                                                   sampling.seed, sampling.top_k, sampling.min_p)
        seq = SequenceState(session, sampler, frozenset(int(t) for t in eos_token_ids), max_tokens)
        seq.prompt = list(prompt)
        seq.sampling = sampling
        if sampling is None:
            return seq
        if sampling.processed:
            seq.processor = LogitsProcessor(sampling, prompt)
        if sampling.logprobs:
            seq.top_logprobs = max(0, int(sampling.top_logprobs))
        if sampling.grammar:
            if tokenizer is None:
                raise ValueError("this rank has no tokenizer to constrain decoding with")
            from .constraint import Constraint

            seq.constraint = Constraint(tokenizer, sampling.grammar, sorted(seq.eos))
        return seq

    def recompute(self, uid: str) -> None:
        """``--local-decode`` fallback: drop whatever ``uid``'s KV cache holds, prefill its
        prompt again through every layer of this rank's model (the same chunks as a
        single-rank run), and add it to the batch.  Its first token stays the one already
        sampled (the pipeline's logits are the whole model's, bit for bit)."""
        seq = self.sequences[uid]
        session = ShardSession(self.model, uid, compute_logits=True)
        session.prefill(seq.prompt)
        seq.session = session
        self.withdraw()
        self.batch.add(session)

    def step(self, tokens: Optional[Sequence[int]] = None, lookahead: bool = False,
             exact: bool = False, defer: bool = False) -> List[Optional[int]]:
        """One decode step of every resident sequence, in batch order.

        Sequence i is fed ``tokens[i]`` (frame-driven) or, when ``tokens`` is
        ``None``, its own last sampled token.  Returns, per sequence, the next
        token sampled here (int), or ``None`` for a sequence this rank does not
        sample (then no sequence of the batch is sampled here: the step is frame-driven).

        ``lookahead``: the step after this one is queued on this step's lazy tokens before they
        are read (mlx-lm's ``generate_step`` pipelining), so building its graph overlaps this
        step's evaluation -- and, in a group, the next plan's flight over the control link --; the
        next call only reads it.  Any other operation first withdraws it (:meth:`withdraw`) unless
        :meth:`settle` keeps it.  Without ``exact`` it is a wish that :meth:`look_ahead` decides
        (a group of one rank); with ``exact`` (a group: every rank must queue the same step, since
        a queued step's collectives run whether it is kept or not) it is the plan's decision, made
        by rank 0 with :meth:`look_ahead`.  In a group of one rank the first
        :data:`LOOKAHEAD_PROBE_STEPS` lookahead steps of each kind (the compiled lone step, a
        graph of ops) are timed, and a kind whose queuing took longer than the wait that followed
        decodes without lookahead from then on (MLX's CPU backend runs a large graph's
        ``async_eval`` nearly to the end before returning, BENCHMARKS.md issue 17).

        A sequence this rank samples although another rank's token was fed last
        (:attr:`SequenceState.awaits_token`) takes ``tokens[i]`` as its last token first.

        With :attr:`read_first` (a group on MLX's CPU backend, where queuing a decode step runs it:
        its collectives complete inside ``mx.async_eval``, 10.2 of a 10.7 ms TP=2 step measured here,
        BENCHMARKS.md issue 42) a lookahead step reads this step's tokens first and owes the next
        one: queued before this call returns, or with ``defer`` by :meth:`queue_owed`, which rank 0
        runs on the MLX thread without waiting for it, so that its next plan goes out over the
        control link while the step computes.  Where queuing returns at once (Metal) mlx-lm's order
        (queue, then read) keeps the device busy instead; the tokens are the same either way.

        Raises:
            ValueError: ``exact`` lookahead for a batch this rank cannot look ahead on.
        """
        self._check_committed()
        self.queue_owed()
        self.upkeep.tick()
        if self._remote:  # received K/V not yet joined (a single engine driven directly): now
            self.join_remote()
        seqs = [self.sequences[uid] for uid in self.batch.uids]
        if self._pending is not None:
            y = self._pending  # queued by the previous call on the tokens it returned
        else:
            feed = [s.token for s in seqs] if tokens is None else [int(t) for t in tokens]
            self._adopt(seqs, feed)
            if any(s.sampler is None for s in seqs):  # frame-driven: nothing to sample here
                if lookahead and exact:
                    raise ValueError("a lookahead step for a batch this rank does not sample whole")
                mx.eval(self.batch.forward(mx.array(feed, dtype=mx.int32)))
                for s in seqs:
                    s.awaits_token = s.sampler is not None  # rank 0's token is in the next plan's feed
                return [None] * len(seqs)
            y = self._issue(seqs, mx.array(feed, dtype=mx.int32), ahead=0)
        kind = self._compiled_path(seqs)
        if exact:
            ahead = lookahead
            if ahead and not self._can_look_ahead(seqs):
                raise ValueError("a lookahead step for a batch this rank cannot look ahead on")
        else:
            ahead = self.look_ahead(lookahead)
        if ahead and self.read_first:
            with self._lengths:
                self._pending = None  # read below; the next one is owed
            values = y.reshape(-1).tolist()
            for s, t in zip(seqs, values):
                self._record(s, t)
            self._owed = (seqs, y)  # the next step samples token ``generated`` now (recorded above)
            if not defer:
                self.queue_owed()
            return values
        t0 = time.perf_counter()
        self._pending = self._issue(seqs, y, ahead=1) if ahead else None
        t1 = time.perf_counter()
        values = y.reshape(-1).tolist()
        if ahead and self.probe_lookahead and len(self._probes[kind]) < LOOKAHEAD_PROBE_STEPS:
            self._probe(kind, t1 - t0, time.perf_counter() - t1)
        for s, t in zip(seqs, values):
            self._record(s, t)
        return values

    def _can_look_ahead(self, seqs: List[SequenceState]) -> bool:
        """Whether a step of ``seqs`` can queue the next one here: caches that roll back, every
        sequence sampled here, no grammar (its next mask needs this step's token on the host)."""
        return (bool(seqs) and self.trimmable and all(s.sampler is not None for s in seqs)
                and not any(s.constraint is not None for s in seqs))

    def look_ahead(self, lookahead: bool = True) -> bool:
        """Whether the next decode step of the batch, asked to with ``lookahead``, queues the step
        after it (:meth:`step`): rank 0 decides a plan's ``ahead`` with it, before the step runs."""
        seqs = [self.sequences[uid] for uid in self.batch.uids]
        return (lookahead and self._can_look_ahead(seqs)
                and not (self.probe_lookahead and self._compiled_path(seqs) in self.lookahead_off))

    def _adopt(self, seqs: List[SequenceState], feed: Sequence[int]) -> None:
        """Sequences sampled here whose last token another rank sampled (:attr:`SequenceState.awaits_token`)
        record ``feed``'s token as theirs (stop rule, processor counts), so their next draw has the
        right index and history."""
        for s, t in zip(seqs, feed):
            if s.awaits_token:
                s.awaits_token = False
                if s.processor is not None:
                    s.processor.record(int(t))
                self._record(s, int(t))

    def expected_tokens(self, settled: bool = False) -> Dict[str, int]:
        """The token each sequence of the batch that this rank samples (and whose last token it
        knows) will feed to the next decode step: its last token, or with ``settled`` the token of
        the queued lookahead step, which the plan keeps first (:meth:`settle`).  A plan's decode
        entries must feed these (``Follower.check``): a difference means the ranks disagree."""
        seqs = [(uid, self.sequences[uid]) for uid in self.batch.uids]
        values = self._pending.reshape(-1).tolist() if settled and self._pending is not None else None
        out = {}
        for i, (uid, s) in enumerate(seqs):
            if s.sampler is not None and not s.awaits_token:
                out[uid] = int(values[i]) if values is not None else s.token
        return out

    def _probe(self, kind: bool, queued_s: float, waited_s: float) -> None:
        """Time one lookahead step of ``kind``; after :data:`LOOKAHEAD_PROBE_STEPS`, turn lookahead
        off for the kind if queuing took longer than waiting (median)."""
        probes = self._probes[kind]
        probes.append((queued_s, waited_s))
        if len(probes) == LOOKAHEAD_PROBE_STEPS:
            queued = sorted(q for q, _ in probes)[len(probes) // 2]
            waited = sorted(w for _, w in probes)[len(probes) // 2]
            if queued > waited:
                self.lookahead_off.add(kind)
            log.info("lookahead for %s: queuing the next step took %.1f ms, the wait after it %.1f ms "
                     "(median of %d): %s", "the compiled step" if kind else "uncompiled steps", queued * 1e3,
                     waited * 1e3, len(probes), "off" if kind in self.lookahead_off else "on")

    def _compiled_path(self, seqs: List[SequenceState]) -> bool:
        """Whether :meth:`_issue` runs ``seqs`` as the compiled greedy step.  Not with quantized K/V
        (``--kv-bits``): :class:`~mlxcluster.engine.compiled.CompiledGreedyStep` attends over static
        full-precision buffers; such a sequence decodes on its quantized cache uncompiled."""
        return (len(seqs) == 1 and self.compile_decode and seqs[0].sampler is _GREEDY and seqs[0].plain
                and getattr(self.model, "compilable", False) and not format_of(self.model).quantized)

    def queue_owed(self) -> None:
        """Queue the lookahead step a :attr:`read_first` :meth:`step` owes, if any (on the MLX thread;
        every operation on the batch does so first).  Its graph is built under the lock
        :meth:`kv_length` reads under, then submitted with ``mx.async_eval`` outside it."""
        if self._owed is None:
            return
        with self._lengths:
            seqs, y = self._owed
            self._owed = None
            self._pending = self._build(seqs, y, ahead=0)
        self._submit(seqs, self._pending, ahead=0)

    def _issue(self, seqs: List[SequenceState], x: mx.array, ahead: int) -> mx.array:
        """Queue a decode step on ``x`` ((B,) int32, maybe lazy) and the
        sampling of its tokens (each sequence's token ``generated + ahead``);
        returns them lazily, submitted with ``mx.async_eval``."""
        y = self._build(seqs, x, ahead)
        self._submit(seqs, y, ahead)
        return y

    @staticmethod
    def _submit(seqs: List[SequenceState], y: mx.array, ahead: int) -> None:
        """``mx.async_eval`` of a step's lazy tokens ``y`` with each sequence's lazy log-probabilities
        of that token (``generated + ahead``)."""
        mx.async_eval(y, *[a for s in seqs for a in s.lazy_logprobs(s.generated + ahead)])

    def _build(self, seqs: List[SequenceState], x: mx.array, ahead: int) -> mx.array:
        """The lazy tokens ``(B,)`` of a decode step of ``seqs`` on ``x`` (:meth:`_issue`, unsubmitted)."""
        if self._compiled_path(seqs):
            session = seqs[0].session
            if session.compiled is None:
                if self._compiled is None:
                    from .compiled import CompiledGreedyStep

                    self._compiled = CompiledGreedyStep(self.model)
                session.compiled = self._compiled
            y = session.issue_greedy(x)
        else:
            y = self._draw(seqs, self.batch.forward(x), ahead)
        return y

    @staticmethod
    def _draw(seqs: List[SequenceState], logits: mx.array, ahead: int) -> mx.array:
        """The lazy tokens ``(B,)`` int32 of ``seqs`` from their ``logits`` ``(B, vocab)`` (each
        sequence's token ``generated + ahead``): one argmax over the batch when every sequence
        is plain greedy, else each sequence's own :meth:`SequenceState.draw`."""
        if all(s.sampler is _greedy and s.plain for s in seqs):
            return mx.argmax(logits, axis=-1).astype(mx.int32)
        return mx.stack([s.draw(logits[i], s.generated + ahead) for i, s in enumerate(seqs)]).astype(mx.int32)

    # -- speculative decoding: one forward over each sequence's draft -------------------------
    def clamp_draft(self, uid: str, draft: Sequence[int]) -> List[int]:
        """The part of ``draft`` (int ids) a verify step of sequence ``uid`` may run: none for a
        grammar-constrained sequence (its mask needs each token on the host before the next: it
        decodes one token per step, its draft ignored) or one that has stopped; at most ``max_tokens
        - generated - 1`` tokens (every emitted token counts) and ``context_length - 2 - kv length``
        (a verify step writes ``1 + len(draft)`` positions; one-at-a-time decoding stops once the KV
        cache holds ``context_length - 1``).  Rank 0 clamps before it sends a draft to ranks N.

        Raises:
            KeyError: ``uid`` is not resident.
        """
        s = self.sequences[uid]
        if s.constraint is not None or s.reason:
            return []
        room = self.context_length - 2 - self.kv_length(s)
        if s.sampler is not None and s.max_tokens:
            room = min(room, s.max_tokens - s.generated - 1)
        return [int(t) for t in draft[:max(0, room)]]

    def verify(self, drafts: Sequence[Sequence[int]], tokens: Optional[Sequence[int]] = None
               ) -> Optional[List["Verified"]]:
        """One speculative step of every resident sequence, in batch order, as ONE forward pass.

        Sequence i is fed its last token (``tokens[i]`` when given, else its own) followed by
        ``drafts[i]`` (int ids, possibly empty: it takes one token, as :meth:`step` would), right-padded
        with token 0 to ``L = 1 + max len(draft)`` positions: a ``(B, L)`` forward pass
        (:meth:`DecodeBatch.forward_positions`) whose logits ``(B, L, vocab)`` score every draft token.

        On the rank that samples (rank 0; every sequence sampled here): each draft is first clamped
        (:meth:`clamp_draft`), then verified (:mod:`mlxcluster.engine.speculative`): greedy requests by
        :func:`greedy_accept` (the output equals one-at-a-time greedy decoding token for token),
        sampled ones by speculative rejection sampling (:func:`rejection_accept`) on the distribution
        the sequence's sampler draws from -- its logits processors (bias, penalties) applied at each
        position as if the draft before it were accepted, then mlx-lm's filters and temperature
        (:func:`make_token_logits`) -- keyed by ``(seed, token index)``.  The stop rule applies token by
        token: a stop inside the accepted run ends the sequence there.  The processors' counts, the
        repetition window and the log-probabilities (``last_logprob`` of each token, as :meth:`step`
        records them) see exactly the emitted tokens.  Every row then keeps ``len(tokens)`` of its
        ``L`` positions (its last input and the accepted draft tokens; :meth:`DecodeBatch.keep`):
        the KV caches hold what one-at-a-time decoding would.  Returns one :class:`Verified` per
        sequence (:attr:`spec_stats` counts them).

        Frame-driven (a rank N: some sequence not sampled here): ``tokens`` and ``drafts`` come from
        rank 0's plan (already clamped there); the forward pass runs (the same collectives as rank
        0's) and ``None`` is returned.  Its ``L`` positions stay written until :meth:`commit` is
        given each row's kept count, which rank 0 learns only after this step (the next plan carries
        it).  Until then only prefills run (the same plan's joins and chunks: their collectives are
        rank 0's now), their sequences joining the batch at :meth:`commit`; every other operation
        refuses to run.

        A queued lookahead step is withdrawn first (its token was never recorded: the drafts are
        about the tokens recorded so far); a verify step itself queues nothing ahead.

        Raises:
            ValueError: this model cannot speculate (:attr:`speculative_error`, one line: caches that
                cannot roll back, ``--afd``), drafts or tokens of another length than the
                batch, no ``tokens`` on a frame-driven rank, or an uncommitted verify step.
        """
        if self.speculative_error is not None:
            raise ValueError(self.speculative_error)
        self._check_committed()
        self.upkeep.tick()
        if self._remote:  # received K/V not yet joined (a single engine driven directly): now
            self.join_remote()
        self.withdraw()
        uids = self.batch.uids
        seqs = [self.sequences[uid] for uid in uids]
        if len(drafts) != len(seqs) or (tokens is not None and len(tokens) != len(seqs)):
            raise ValueError(f"{len(drafts)} drafts and {None if tokens is None else len(tokens)} tokens for a "
                             f"batch of {len(seqs)}")
        frame_driven = any(s.sampler is None for s in seqs)
        if frame_driven and tokens is None:
            raise ValueError("a rank that does not sample verifies the tokens of rank 0's plan")
        drafts = [[int(t) for t in d] for d in drafts] if frame_driven else \
            [self.clamp_draft(uid, d) for uid, d in zip(uids, drafts)]
        first = [s.token for s in seqs] if tokens is None else [int(t) for t in tokens]
        self._adopt(seqs, first)
        L = 1 + max((len(d) for d in drafts), default=0)
        x = mx.array([[t] + d + [0] * (L - 1 - len(d)) for t, d in zip(first, drafts)], dtype=mx.int32)
        before = [s.session.position for s in seqs]
        out = self.batch.forward_positions(x)
        if frame_driven:
            mx.eval(out)
            self._unverified = L
            for s in seqs:
                s.awaits_token = s.sampler is not None  # rank 0's tokens: the next plan's feed
            return None
        results = self._verify_tokens(seqs, drafts, out, before)
        self.batch.keep([len(r.tokens) for r in results], L)
        for r in results:
            self.spec_stats.add(r)
        return results

    def commit(self, kept: Sequence[int]) -> None:
        """A frame-driven rank's end of a verify step: keep the first ``kept[i]`` (int, 1 ..
        ``L``: rank 0's ``len(Verified.tokens)``) of the ``L`` positions sequence i wrote, in the
        verify step's batch order, and forget the rest -- the same rollback rank 0 made.  Then the
        sequences that the verify step's plan prefilled after it join the batch (:meth:`batch_order`),
        as they joined rank 0's after its own rollback.

        Raises:
            ValueError: no verify step awaits its counts, or counts that do not fit it.
        """
        if self._unverified is None:
            raise ValueError("no verify step awaits its kept counts")
        if any(int(k) < 1 for k in kept):
            raise ValueError(f"kept counts {list(kept)}: a row keeps at least its fed token")
        self.batch.keep([int(k) for k in kept], self._unverified)
        self._unverified = None
        deferred, self._deferred = self._deferred, []
        for _, join in deferred:  # joins of the verify step's plan, after its rollback as on rank 0
            join()

    def _join_batch(self, uids: List[str], join: Callable[[], None]) -> None:
        """Add prefilled sequences ``uids`` to the decode batch (``join``: the batch call) now, or --
        after a frame-driven verify step of the same plan -- once :meth:`commit` has rolled that step
        back: rank 0 added them after its own rollback, and every rank must change the batch in the
        same order (the batch's row reuse and compaction depend on it)."""
        if self._unverified is None:
            join()
        else:
            self._deferred.append((list(uids), join))

    @property
    def batch_order(self) -> List[str]:
        """The decode batch's uids in order as the next plan's decode step will see them: the batch,
        then sequences that joined after an uncommitted verify step (:meth:`commit` adds them), then
        those whose received K/V awaits :meth:`join_remote`."""
        return self.batch.uids + [u for uids, _ in self._deferred for u in uids] + list(self._remote)

    @property
    def uncommitted(self) -> Optional[int]:
        """Positions per sequence a frame-driven verify step wrote and :meth:`commit` has not yet
        resolved, else ``None``."""
        return self._unverified

    def _check_committed(self) -> None:
        if self._unverified is not None:
            raise ValueError("a verify step awaits its kept counts (commit) before anything else runs")

    def _verify_tokens(self, seqs: List[SequenceState], drafts: List[List[int]], out: mx.array,
                       before: List[int]) -> List["Verified"]:
        """Rank 0's half of :meth:`verify`: accept, record (stop rule, processors, logprobs)."""
        import numpy as np

        from .speculative import ACCEPT_SALT, Verified, greedy_accept, keyed_categorical, rejection_accept

        work = []  # per sequence: what to evaluate, then decide on the host
        lazies: List[mx.array] = []
        for i, (s, d) in enumerate(zip(seqs, drafts)):
            m = len(d)
            if m == 0:  # one token, exactly as a plain step draws it
                tok = s.draw(out[i, 0], s.generated)
                work.append({"one": tok})
                lazies += [tok] + s.lazy_logprobs(s.generated)
                continue
            w = {"snap": s.processor.snapshot() if s.processor is not None else None}
            if s.processor is not None:  # position j processed as if draft[:j] were accepted
                rows = []
                for j in range(m + 1):
                    rows.append(s.processor(out[i, j]))
                    if j < m:
                        s.processor.record(d[j])
                proc = mx.stack(rows)
            else:
                proc = out[i, :m + 1].astype(mx.float32)
            scaled_fn = (None if s.sampling is None else
                         make_token_logits(s.sampling.temperature, s.sampling.top_p, s.sampling.top_k,
                                           s.sampling.min_p))
            w["proc"] = proc
            if scaled_fn is None:
                w["target"] = mx.argmax(proc, axis=-1)
                lazies.append(w["target"])
            else:
                seed = s.sampling.seed
                w["scaled"] = mx.stack([scaled_fn(proc[j]) for j in range(m + 1)])
                w["probs"] = mx.softmax(w["scaled"], axis=-1)
                w["u"] = mx.stack([mx.random.uniform(key=token_key(int(seed) ^ ACCEPT_SALT, s.generated + j))
                                   for j in range(m)])
                lazies += [w["scaled"], w["probs"], w["u"]]
            work.append(w)
        mx.eval(lazies)
        results = []
        for s, d, w, pos in zip(seqs, drafts, work, before):
            if "one" in w:
                emitted, accepted = [int(w["one"].item())], 0
            elif "target" in w:
                accepted, emitted = greedy_accept(d, w["target"].tolist())
            else:
                seed, base, scaled = s.sampling.seed, s.generated, w["scaled"]

                def draw(j, dist, seed=seed, base=base, scaled=scaled):
                    if dist is None:  # the bonus token: the plain sampler's draw from the same logits
                        return keyed_categorical(scaled[j], seed, base + j)
                    with np.errstate(divide="ignore"):
                        return keyed_categorical(np.log(dist).astype(np.float32), seed, base + j)

                accepted, emitted = rejection_accept(d, np.array(w["probs"], dtype=np.float64), None,
                                                     np.array(w["u"]).tolist(), draw)
            if "one" not in w:
                if s.processor is not None:
                    s.processor.restore(w["snap"])
                if s.top_logprobs >= 0:
                    for j, t in enumerate(emitted):
                        lp = w["proc"][j] - mx.logsumexp(w["proc"][j], axis=-1)
                        entry = (lp[t],)
                        if s.top_logprobs > 0:
                            top = mx.argpartition(-lp, s.top_logprobs - 1)[:s.top_logprobs]
                            entry += (top, lp[top])
                        s._logprobs[s.generated + j] = entry
            kept, lps = [], []
            for j, t in enumerate(emitted):
                s.session.position = pos + 1 + j  # the KV length one-at-a-time decoding has here
                if "one" not in w and s.processor is not None:
                    s.processor.record(t)
                self._record(s, t)
                kept.append(t)
                if s.top_logprobs >= 0:
                    lps.append(s.last_logprob)
                if s.reason:
                    break
            for j in range(len(kept), len(emitted)):
                s._logprobs.pop(s.generated + j - len(kept), None)
            s.session.position = pos + 1 + max((len(x) for x in drafts), default=0)
            results.append(Verified(kept, len(d), accepted, lps))
        return results

    def remove(self, uid: str) -> int:
        """Free sequence ``uid`` (after withdrawing a lookahead step); returns
        the length of its KV cache (tokens), 0 for an unknown uid."""
        self._check_committed()
        seq = self.sequences.pop(uid, None)
        if seq is None:
            return 0
        self.withdraw()
        position = seq.session.position
        if uid in self._remote:  # --pd: its K/V installed, never joined (rank 0 refused it)
            self._remote.remove(uid)
        if self.batch.remove(uid) is None:  # not in the batch yet (a --local-decode prefill, a refused --pd join)
            seq.session.close()
        return position

    def settle(self) -> Dict[str, int]:
        """Keep a queued lookahead step instead of rolling it back: read its tokens and record
        them as :meth:`step` would have on its next call (the stop rule included); returns
        ``{uid: token}`` for every sequence that had not already stopped (a stopped sequence's
        token is dropped: it is being retired).  Called before the batch changes (a sequence
        joins or leaves), so that the step computed meanwhile is used, not discarded."""
        self.queue_owed()
        if self._pending is None:
            return {}
        seqs = [(uid, self.sequences[uid]) for uid in self.batch.uids]
        values = self._pending.reshape(-1).tolist()
        self._pending = None
        out = {}
        for (uid, s), t in zip(seqs, values):
            if not s.reason:
                self._record(s, t)
                out[uid] = t
        return out

    def withdraw(self) -> None:
        """Roll back a queued lookahead step of the whole batch, if any.

        Raises:
            ValueError: a frame-driven verify step awaits its :meth:`commit` (every operation that
                changes the batch passes here first).
        """
        self._check_committed()
        self.queue_owed()
        self._withdraw_lookahead()

    def _withdraw_lookahead(self) -> None:
        """:meth:`withdraw` without its check (a prefill may run while a verify step awaits its
        counts: no lookahead step is queued then, verify withdrew it)."""
        if self._pending is not None:
            mx.eval(self._pending)  # let the queued step finish, then forget its KV entries
            self._pending = None
            self.batch.rollback(1)
            for uid in self.batch.uids:  # ... and the token it sampled (penalties' counts, logprobs)
                seq = self.sequences.get(uid)
                if seq is not None:
                    seq.forget()

    @property
    def queued(self) -> bool:
        """Whether a lookahead step is queued on the batch (:meth:`settle` reads it, :meth:`withdraw` drops it)."""
        with self._lengths:
            return self._pending is not None or self._owed is not None

    def kv_length(self, seq: SequenceState) -> int:
        """Positions in ``seq``'s KV cache, not counting a queued lookahead step (another thread may
        ask while :meth:`queue_owed` builds one)."""
        with self._lengths:
            return seq.session.position - (self._pending is not None)

    # -- sampling and the stop rule ----------------------------------------------------
    def _sample(self, seq: SequenceState, logits: mx.array) -> int:
        token = int(seq.draw(logits, seq.generated).item())
        self._record(seq, token)
        return token

    def _record(self, seq: SequenceState, token: int) -> None:
        if seq.sampler is not None:
            seq.recorded(token)
        seq.generated += 1
        seq.token = token
        seq.reason = seq.reason or stop_reason(token, seq.generated, self.kv_length(seq), seq.eos,
                                               seq.max_tokens, self.context_length)

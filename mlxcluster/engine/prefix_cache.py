"""The prefix cache's memory tier (:class:`PrefixCache`): earlier prompts' K/V, reused by later prompts that
start the same way, per namespace, least recently used dropped first (its disk tier:
:mod:`~mlxcluster.engine.prompt_disk`).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence, Tuple

import mlx.core as mx

from .kvquant import kv_contiguous, kv_slice

log = logging.getLogger(__name__)

#: positions the prefix caches of a rank hold in all (the least recently used prompt dropped first): a
#: count of positions, not bytes, so that every rank of a group, making the same calls, keeps the same
#: prompts (0: no prefix caching)
PREFIX_CACHE_POSITIONS = 4096
#: shorter common prefixes are prefilled again (nothing worth a second code path)
PREFIX_MIN_TOKENS = 16


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

"""Where a joining sequence's K/V comes from (:meth:`~mlxcluster.engine.decode.RankEngine.admit`):
computed on this rank after its prefix-cache positions (:class:`Compute`), or prefilled elsewhere
and received (:class:`Remote`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Compute:
    """Where a joining sequence's K/V comes from: computed here by
    :meth:`~mlxcluster.engine.decode.RankEngine.prefill_chunk`, after its first ``cached`` positions
    taken from this rank's :class:`~mlxcluster.engine.prefix_cache.PrefixCache` (0: none; every rank
    of a group is given the same value).  Cached positions count as computed tokens, as vLLM's
    ``KVConnector`` counts external K/V like prefix-cache hits.  ``salt``: the prompt's prefix-cache
    namespace (:class:`~mlxcluster.engine.prefix_cache.PrefixCache`; "" shared): cached positions
    come from it and the prompt is held there."""

    cached: int = 0
    salt: str = ""
    #: rank 0's cached positions come from its disk tier: in a group of several ranks each rank takes
    #: what it holds and the group agrees on the fewest
    #: (:meth:`~mlxcluster.engine.prefix_cache.PrefixCache.take` ``from_disk``)
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

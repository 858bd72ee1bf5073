"""Which models stay loaded: Ollama's ``keep_alive`` durations and the pure eviction planner.

:func:`plan_load` decides, from the models loaded now, the memory budget and the count bound, what
loading one more model takes: evicting some idle models (:class:`Load`), waiting for busy ones to
finish their requests (:class:`Wait`), or nothing can make room (:class:`Refuse`).  :func:`expired`
names the loaded models whose ``keep_alive`` ran out.  Both are plain functions of their inputs (no
I/O, no clock: ``now`` is an input), tested as such (``tests/test_residency.py``); the model pool
(:mod:`mlxcluster.front.pool`) applies their answers.

Rules (Ollama's scheduler and oMLX's ``EnginePool`` behave alike):

* a model is evicted only when idle (no request in flight): eviction happens between two requests,
  never inside one, so a stream of another model never loses a token;
* pinned models are never evicted, and never expire;
* among the idle unpinned models the least recently used go first, and no more than needed;
* when evicting every idle unpinned model would not make room but the busy ones would, the load
  waits for them to drain (:class:`Wait`), evicting nothing meanwhile;
* a model larger than the budget, or than what the pinned models leave of it, is refused.

``keep_alive`` (Ollama's ``docs/api.md``, "keep_alive: controls how long the model will stay loaded into
memory following the request (default: 5m)"; ``docs/faq.md``, "How do I keep a model loaded in memory or
make it unload immediately?"): a duration string (``"5m"``, ``"1h30m"``, ``"300ms"``), or a number of
seconds; ``0`` unloads the model as soon as its request ends; a negative value keeps it loaded forever.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

__all__ = ["DEFAULT_KEEP_ALIVE_S", "NEVER", "Resident", "Load", "Wait", "Refuse", "plan_load", "expired",
           "parse_keep_alive", "gib", "next_expiry"]

#: Ollama's default ``keep_alive`` (``OLLAMA_KEEP_ALIVE``: 5 minutes)
DEFAULT_KEEP_ALIVE_S = 300.0
#: a ``keep_alive`` that never expires (Ollama: any negative value)
NEVER = -1.0

#: Go's ``time.ParseDuration`` units (Ollama parses ``keep_alive`` strings with it), in seconds
_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")


def parse_keep_alive(value: Any, what: str = "keep_alive") -> float:
    """Seconds of a ``keep_alive`` value: a Go duration string (``"5m"``, ``"1h30m"``, ``"300ms"``,
    ``"-1m"``), a number of seconds (or a string of one, as ``OLLAMA_KEEP_ALIVE`` takes it).

    Returns:
        seconds >= 0, or :data:`NEVER` (-1.0) for any negative value (loaded forever).

    Raises:
        ValueError: anything else (one line naming ``what``)."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{what} {value!r}: a duration such as \"5m\", \"1h\", \"300ms\" or a number of seconds")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)
        except ValueError:
            parts = _PART.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"{what} {value!r}: a duration such as \"5m\", \"1h\", \"300ms\" "
                                 "or a number of seconds") from None
            seconds = sign * sum(float(n) * _UNITS[u] for n, u in parts)
    if math.isnan(seconds):
        raise ValueError(f"{what} {value!r}: a duration such as \"5m\", \"1h\", \"300ms\" or a number of seconds")
    return NEVER if seconds < 0 or math.isinf(seconds) else seconds


def gib(n: float) -> str:
    """``n`` bytes in GiB, one decimal (``"1.5 GiB"``)."""
    return f"{n / (1 << 30):.1f} GiB"


@dataclass(frozen=True)
class Resident:
    """One loaded (or loading) model as the planner sees it.

    Attributes:
        name: its served name.
        bytes: the memory it holds (or will hold, loading), all its ranks together.
        last_used: when its last request arrived or ended (any monotonic clock: only the order counts).
        in_flight: its requests not yet answered (a loading model counts its waiting requests, and at
            least 1: it is never evicted while it loads).
        pinned: never evicted, never expired.
        expires_at: when its ``keep_alive`` runs out (the clock of ``now``); ``None``: never, or a
            request is in flight.
    """

    name: str
    bytes: int
    last_used: float
    in_flight: int = 0
    pinned: bool = False
    expires_at: Optional[float] = None


@dataclass(frozen=True)
class Load:
    """Load the model after unloading ``evict`` (names, least recently used first; may be empty)."""

    evict: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Wait:
    """No idle model can make room, but these busy ones can once their requests end: plan again then."""

    busy: Tuple[str, ...]
    why: str


@dataclass(frozen=True)
class Refuse:
    """The model cannot be loaded beside the models that must stay (one line naming the memory)."""

    why: str


Decision = Union[Load, Wait, Refuse]


def plan_load(loaded: Sequence[Resident], name: str, need: int, budget: Optional[int],
              max_loaded: Optional[int] = None) -> Decision:
    """What loading model ``name`` (``need`` bytes) beside ``loaded`` takes, under a memory ``budget``
    (bytes; ``None``: unbounded) and at most ``max_loaded`` models (``None``: unbounded).

    ``name`` must not be in ``loaded``.  See the module docstring for the rules.

    Returns:
        :class:`Load` (evicting the fewest least recently used idle unpinned models that make room),
        :class:`Wait` (only busy models can make room), or :class:`Refuse` (nothing can)."""
    if max_loaded is not None and max_loaded < 1:
        raise ValueError("max_loaded must be at least 1")
    if budget is not None and need > budget:
        return Refuse(f"model {name!r} needs {gib(need)} ({need} bytes) but the memory budget is {gib(budget)} "
                      f"({budget} bytes): it can never be loaded here (a smaller quantization, or --memory-budget)")
    pinned = [r for r in loaded if r.pinned]
    pinned_bytes = sum(r.bytes for r in pinned)
    if budget is not None and need + pinned_bytes > budget:
        return Refuse(f"model {name!r} needs {gib(need)} but the pinned models ({', '.join(r.name for r in pinned)}) "
                      f"hold {gib(pinned_bytes)} of the {gib(budget)} memory budget")
    if max_loaded is not None and len(pinned) >= max_loaded:
        return Refuse(f"model {name!r} cannot be loaded: the {len(pinned)} pinned models fill "
                      f"--max-loaded-models {max_loaded}")
    short_bytes = (need + sum(r.bytes for r in loaded) - budget) if budget is not None else 0
    short_count = (len(loaded) + 1 - max_loaded) if max_loaded is not None else 0
    if short_bytes <= 0 and short_count <= 0:
        return Load()
    candidates = sorted((r for r in loaded if not r.pinned), key=lambda r: (r.last_used, r.name))
    chosen = _fewest(candidates, short_bytes, short_count)
    idle = _fewest([r for r in candidates if r.in_flight == 0], short_bytes, short_count)
    if idle is not None:
        return Load(tuple(r.name for r in idle))
    busy = tuple(r.name for r in (chosen or []) if r.in_flight > 0)
    # chosen is never None here: the pinned checks above leave room once every unpinned model is gone
    return Wait(busy, f"model {name!r} waits for {', '.join(map(repr, busy))} to finish "
                      f"{'its' if len(busy) == 1 else 'their'} requests "
                      f"({_shortfall(short_bytes, short_count, max_loaded)})")


def _fewest(ordered: List[Resident], short_bytes: int, short_count: int) -> Optional[List[Resident]]:
    """The shortest prefix of ``ordered`` (least recently used first) freeing ``short_bytes`` bytes and
    ``short_count`` places; ``None`` when all of it does not."""
    freed_bytes, chosen = 0, []
    for r in ordered:
        if freed_bytes >= short_bytes and len(chosen) >= short_count:
            break
        chosen.append(r)
        freed_bytes += r.bytes
    if freed_bytes >= short_bytes and len(chosen) >= short_count:
        return chosen
    return None


def _shortfall(short_bytes: int, short_count: int, max_loaded: Optional[int]) -> str:
    parts = []
    if short_bytes > 0:
        parts.append(f"{gib(short_bytes)} short of the memory budget")
    if short_count > 0:
        parts.append(f"--max-loaded-models {max_loaded} reached")
    return "; ".join(parts)


def expired(loaded: Sequence[Resident], now: float) -> List[str]:
    """Names of the ``loaded`` models whose ``keep_alive`` ran out at ``now``: idle, unpinned, with an
    ``expires_at`` not after ``now`` (oldest expiry first)."""
    due = [r for r in loaded if r.in_flight == 0 and not r.pinned and r.expires_at is not None
           and r.expires_at <= now]
    return [r.name for r in sorted(due, key=lambda r: (r.expires_at, r.name))]


def next_expiry(loaded: Sequence[Resident]) -> Optional[float]:
    """The earliest ``expires_at`` among idle unpinned ``loaded`` models (``None``: none expires)."""
    times = [r.expires_at for r in loaded if r.in_flight == 0 and not r.pinned and r.expires_at is not None]
    return min(times) if times else None

"""Failpoints: named places where a test makes the package misbehave on purpose; off unless set.

One mechanism for every fault a test injects, in the manner of TiKV's fail-rs
(https://github.com/tikv/fail-rs, ``fail_point!`` and ``FAILPOINTS``) and etcd's gofail
(https://github.com/etcd-io/gofail, ``GOFAIL_FAILPOINTS``).  A failpoint site in the code is ::

    action = fail_point("handoff.send")
    if action:
        ...  # misbehave as ``action`` says

:func:`fail_point` returns the failpoint's configured action, or ``None`` (one dict lookup) when
it is not set -- which it never is outside tests.  The action is an :class:`Action`: a ``str``
equal to the action as written canonically (``"hash"``, ``"delay(3)"``), whose ``name`` is the
action's name and ``arg`` its validated argument (``None`` for an action without one).

**From the environment** (a rank process, set by a test for the ranks it starts): the one
variable ``MLXCLUSTER_FAILPOINTS``, read with the other settings by :mod:`mlxcluster.config`
(once per process; mpirun forwards it).  A rank process applies it at start-up
(:func:`setup`, called by ``mlxcluster.runtime.rank.main``).  fail-rs's syntax: entries
``name=action[(arg)]`` separated by ``;``, blanks around them ignored::

    MLXCLUSTER_FAILPOINTS="handoff.send=hash"
    MLXCLUSTER_FAILPOINTS="pd.send=early_last;handoff.send=exit"
    MLXCLUSTER_FAILPOINTS="control.send=delay(3)"

A later entry for the same name wins; the action ``off`` leaves the failpoint unset.  An action
with an argument is written as fail-rs writes ``sleep(ms)`` and ``delay(ms)``: ``name=action(arg)``
(only the actions listed below with an argument take one, and they need it).  An unknown failpoint,
an action that failpoint does not have, a missing, unexpected or out-of-range argument, or an entry
without ``=`` is a :class:`ValueError` of one line naming the entry and the known choices, raised
when the process reads its configuration (at start-up).

**In process** (tests): :func:`cfg` / :func:`remove` set and unset one failpoint, :func:`scoped`
sets some for a ``with`` block and restores the previous ones after it, :func:`teardown` unsets
all, :func:`active` lists them.

**The failpoints** (:data:`FAILPOINTS`; every action fires in the sending process):

``handoff.send`` -- a ``--local-decode`` pipeline stage sending its K/V to rank 0
(:func:`mlxcluster.engine.handoff.kv_frames`):

- ``hash``, ``range``, ``epoch``, ``weights``: that field of the last frame's header is wrong
  (prompt hash, layer range end, a stale formation epoch, the weight format);
- ``exit``: the process exits (status 17) before sending its frame of index 1 (a rank dying
  mid-handoff).

``decode.token`` -- a rank N that samples a sequence itself (issue 42), after a decode step
(:meth:`mlxcluster.control.follower.Follower.decode`):

- ``flip``: on rank 1, the token it derived for the batch's first such sequence is another, so
  the next plan's feed differs from it (a rank whose token differs: the group fails closed);
- ``flip_at`` (``flip_at(N)``, N from 1 to 1,000,000): the same, only after the step that gave that
  sequence its N-th token (resumed tokens counted): the group fails closed once, and the replay,
  which resumes after the tokens delivered, continues the answer (issue 42's end-to-end check).

``pd.send`` -- the prefill group sending one decode rank's KV stream (the whole stream is held,
then reshaped: :func:`mlxcluster.engine.pd.as_sent`, from ``mlxcluster.leader.pd``):

- ``dup``: every data frame twice;  ``permute``: each pair of data frames swapped;
- ``early_end``: the stream ends before its ``LAST_PREFILL`` marker;
- ``early_last``: the marker after the first half of the data frames (announcing that half),
  then the rest;
- ``hash``, ``weights``: the marker's prompt hash / weight format is wrong;
- ``exit``: the process exits (status 17) once two frames of a stream are held (a prefill
  group dying mid-stream).

``control.send`` -- rank 0 sending a ``stepPlan`` frame to a rank N
(:meth:`mlxcluster.control.link.RankLink.send`):

- ``delay`` (``delay(MS)``, MS a number of milliseconds, 0 to :data:`MAX_DELAY_MS`): every frame
  is delivered MS ms after it was sent, in order, without holding the sender's event loop -- a slow
  control link (issue 42).  Unlike fail-rs's ``delay`` (which busy-waits the thread at the site),
  nothing waits at the site: the frame waits.  Replies and heartbeats are not delayed.

Standard library only: the bottom layer of the package (:mod:`mlxcluster.config` imports it).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Dict, Iterable, Iterator, Mapping, Optional, Tuple, Union

__all__ = ["FAILPOINTS", "ARGUMENTS", "MAX_DELAY_MS", "Action", "fail_point", "parse", "cfg", "remove", "scoped",
           "setup", "teardown", "active"]

#: Every failpoint: its name -> its actions -> what each does.
FAILPOINTS: Mapping[str, Mapping[str, str]] = {
    "decode.token": {
        "flip": "rank 1's own token of its first sampled sequence differs after each decode step it samples",
        "flip_at": "flip_at(N): the same, once: after the step that gives that sequence its token N (1-based, "
                   "resumed tokens counted), so a replay that resumes past it is not flipped again",
    },
    "handoff.send": {
        "hash": "the handoff header's prompt hash is wrong",
        "range": "the handoff header's layer range ends one layer early",
        "epoch": "the handoff header's formation epoch is stale",
        "weights": "the handoff header's weight format is another",
        "exit": "the sending rank exits before its frame of index 1",
    },
    "pd.send": {
        "dup": "every data frame is sent twice",
        "permute": "each pair of data frames is swapped",
        "early_end": "the stream ends before its LAST_PREFILL marker",
        "early_last": "the marker comes after half the data frames, announcing that half",
        "hash": "the marker's prompt hash is wrong",
        "weights": "the marker's weight format is another",
        "exit": "the prefill process exits once two frames of a stream are held",
    },
    "control.send": {
        "delay": "delay(MS): every step-plan frame is delivered MS milliseconds later, in order",
    },
}

OFF = "off"

#: The most milliseconds ``control.send=delay(MS)`` takes (10 s: a frame later than that is a lost
#: link, not a slow one).
MAX_DELAY_MS = 10_000.0


def _milliseconds(text: str) -> float:
    """A delay's argument: a finite number of milliseconds in 0..:data:`MAX_DELAY_MS`."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0.0 <= value <= MAX_DELAY_MS):  # also refuses nan
        raise ValueError(f"takes a number of milliseconds from 0 to {MAX_DELAY_MS:g}, not {text!r}")
    return value


#: ``(failpoint, action)`` -> the parser of its argument (a ValueError's text says why it is refused);
#: an action listed here needs an argument, any other takes none.
def _token_index(text: str) -> float:
    """A token index: an integer from 1 to 1,000,000."""
    if not text.isdigit() or not 1 <= int(text) <= 1_000_000:
        raise ValueError(f"takes a token index from 1 to 1000000, not {text!r}")
    return float(int(text))


ARGUMENTS: Mapping[Tuple[str, str], Callable[[str], float]] = {
    ("control.send", "delay"): _milliseconds,
    ("decode.token", "flip_at"): _token_index,
}


class Action(str):
    """A configured action: equal to its canonical text (``"hash"``, ``"delay(3)"``); ``name`` is the
    action's name, ``arg`` its parsed argument (``None``: the action takes none)."""

    name: str
    arg: Optional[float]

    def __new__(cls, name: str, arg: Optional[float] = None) -> "Action":
        self = super().__new__(cls, name if arg is None else f"{name}({arg:g})")
        self.name, self.arg = name, arg
        return self


# name -> action of the failpoints that are set; replaced whole on every change (never mutated),
# so a reader on another thread sees one consistent table.
_active: Dict[str, Action] = {}


def fail_point(name: str) -> Optional[Action]:
    """The action failpoint ``name`` is set to, or ``None`` (the failpoint is off)."""
    return _active.get(name)


def _known() -> str:
    return ", ".join(FAILPOINTS)


def _check(name: str, action: str, entry: str) -> Action:
    """``action`` of failpoint ``name`` (``act`` or ``act(arg)``, blanks stripped) as an :class:`Action`;
    ValueError (one line naming ``entry``) when either is unknown or the argument is missing,
    unexpected or refused."""
    name, action = name.strip(), action.strip()
    if name not in FAILPOINTS:
        raise ValueError(f"unknown failpoint {name!r} in {entry!r}; known failpoints: {_known()}")
    act, paren, arg = action.partition("(")
    act = act.strip()
    if paren and not arg.endswith(")"):
        raise ValueError(f"failpoint entry {entry!r}: an argument is written {act}(ARG)")
    if act != OFF and act not in FAILPOINTS[name]:
        raise ValueError(f"failpoint entry {entry!r}: {name} has no action {act!r}; "
                         f"choose one of {', '.join(FAILPOINTS[name])} or {OFF}")
    parser = ARGUMENTS.get((name, act))
    if parser is None:
        if paren:
            raise ValueError(f"failpoint entry {entry!r}: the action {act} of {name} takes no argument")
        return Action(act)
    if not paren:
        raise ValueError(f"failpoint entry {entry!r}: the action {act} of {name} needs an argument: {act}(ARG)")
    try:
        return Action(act, parser(arg[:-1].strip()))
    except ValueError as exc:
        raise ValueError(f"failpoint entry {entry!r}: {act} {exc}") from None


def parse(spec: str) -> Dict[str, Action]:
    """``name -> action`` of a ``MLXCLUSTER_FAILPOINTS`` value (see the module docstring; ``off``
    entries included, a later entry for a name replacing an earlier one).

    Raises:
        ValueError: an entry without ``=``, an unknown failpoint or action, an argument missing,
            unexpected or out of range (one line naming the entry and the known choices).
    """
    out: Dict[str, Action] = {}
    for entry in (spec or "").split(";"):
        entry = entry.strip()
        if not entry:
            continue
        name, eq, action = entry.partition("=")
        if not eq or not name.strip() or not action.strip():
            raise ValueError(f"failpoint entry {entry!r} is not name=action; known failpoints: {_known()}")
        out[name.strip()] = _check(name, action, entry)
    return out


def _apply(changes: Mapping[str, Action]) -> None:
    global _active
    table = dict(_active)
    for name, action in changes.items():
        if action == OFF:
            table.pop(name, None)
        else:
            table[name] = action
    _active = table


def cfg(name: str, action: str) -> None:
    """Set failpoint ``name`` to ``action`` (``off``: unset it).

    Raises:
        ValueError: an unknown failpoint or action."""
    _apply({name.strip(): _check(name, action, f"{name}={action}")})


def remove(name: str) -> None:
    """Unset failpoint ``name`` (nothing when it is not set)."""
    _apply({name: OFF})


def setup(entries: Union[str, Mapping[str, str], Iterable[Tuple[str, str]]]) -> None:
    """Set the failpoints of ``entries``: a ``MLXCLUSTER_FAILPOINTS`` value, a mapping or
    ``(name, action)`` pairs (:attr:`mlxcluster.config.Config.failpoints`).  Others stay as they are.

    Raises:
        ValueError: as :func:`parse`."""
    if isinstance(entries, str):
        changes = parse(entries)
    else:
        pairs = entries.items() if isinstance(entries, Mapping) else entries
        changes = {name.strip(): _check(name, action, f"{name}={action}") for name, action in pairs}
    _apply(changes)


def teardown() -> None:
    """Unset every failpoint."""
    global _active
    _active = {}


def active() -> Dict[str, Action]:
    """``name -> action`` of the failpoints that are set (a copy)."""
    return dict(_active)


@contextlib.contextmanager
def scoped(spec: str, action: Optional[str] = None) -> Iterator[None]:
    """Set failpoints for a ``with`` block, then restore the table as it was before it:
    ``scoped("handoff.send", "hash")`` or ``scoped("handoff.send=hash;pd.send=dup")``.

    Raises:
        ValueError: as :func:`parse` (on entering; nothing is changed)."""
    changes = parse(spec) if action is None else {spec.strip(): _check(spec, action, f"{spec}={action}")}
    global _active
    before = _active
    _apply(changes)
    try:
        yield
    finally:
        _active = before

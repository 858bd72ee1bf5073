"""The one place that starts rank processes and watches them.

Used by the local launcher (``generate``/``serve``,
:class:`mlxcluster.runtime.launcher.LocalCluster`), by the ``join`` node
daemon, and by the benchmark harness (``benchmarks/bench.py``, whose workers
speak the same protocol).  It owns:

* the rank command line (:func:`rank_command`) and environment
  (:func:`rank_env`: the BLAS preload of :mod:`mlxcluster.runtime.blas`,
  ``PYTHONUNBUFFERED``, the package root on ``PYTHONPATH``);
* process placement: each child in its own process group, in the caller's
  session (:func:`process_group_kwargs`), so it can be killed as a group;
  no ``preexec_fn`` hook is needed.  A rank exits by itself when its parent
  dies (the parent watch in :mod:`mlxcluster.runtime.rank`);
* the progress-event protocol: a child writes ``@@mlxcluster {json}`` lines on
  stdout (:func:`emit`), the supervisor parses them (:func:`parse_event`);
  every event is a JSON object with an ``"event"`` kind (``init``,
  ``loading``, ``loaded``, ``connecting``, ``ready``, ``error``, or a
  benchmark worker's own kinds) and usually a ``"rank"``;
* waiting (for N ``ready`` ranks, for any condition on the events, for exit)
  on one :class:`threading.Condition`, with timeouts and no polling;
* a one-line :attr:`Supervisor.failure`; :meth:`Supervisor.stop` sends SIGTERM
  to each process group, then SIGKILL.

Threads: two daemon threads per child process.  The stdout reader parses
events, records them and calls ``on_event``; at end of file it waits (bounded)
for the stderr reader, reaps the process, records its exit code and calls
``on_exit``.  The stderr reader keeps the last lines for failure messages.
Waiters block on the condition the readers notify.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable, Deque, Dict, List, Mapping, Optional, Sequence

from .blas import rank_environment

if TYPE_CHECKING:  # pragma: no cover
    import psutil

    from .rank_config import RankConfig

__all__ = ["EVENT_PREFIX", "emit", "parse_event", "rank_command", "rank_env", "process_group_kwargs",
           "RankProcess", "Supervisor", "LaunchError"]

EVENT_PREFIX = "@@mlxcluster "
#: Root of the ``mlxcluster`` package's checkout / site-packages directory.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EventCallback = Callable[[dict], None]


class LaunchError(RuntimeError):
    """A rank failed to start (or the backend is unavailable)."""


# -- the child side of the protocol ---------------------------------------------------

def emit(event: str, **fields) -> None:
    """Write one progress event line on stdout (in a child process).

    ``fields`` must be JSON-serialisable; ``"event"`` is set to ``event`` and
    ``"t"`` (Unix time, s) is added unless given.
    """
    fields["event"] = event
    fields.setdefault("t", round(time.time(), 3))
    sys.stdout.write(EVENT_PREFIX + json.dumps(fields) + "\n")
    sys.stdout.flush()


def parse_event(line: str) -> Optional[dict]:
    """The event dict of a progress line written by :func:`emit`, else ``None``."""
    idx = line.find(EVENT_PREFIX)
    if idx < 0:
        return None
    try:
        event = json.loads(line[idx + len(EVENT_PREFIX):])
    except ValueError:
        return None
    return event if isinstance(event, dict) and isinstance(event.get("event"), str) else None


# -- command line and environment ---------------------------------------------------------

def rank_command(config: "RankConfig") -> List[str]:
    """argv of ``python -m mlxcluster.runtime.rank --config JSON``: the rank's whole
    :class:`~mlxcluster.runtime.rank_config.RankConfig`, one argument (world size 1 always gets
    backend ``any``: no group to form)."""
    return [sys.executable, "-m", "mlxcluster.runtime.rank", "--config", config.for_launch().to_json()]


def rank_env(local_ranks: int, extra: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """Environment of a child process: this process's environment, the BLAS
    settings for ``local_ranks`` co-located ranks, ``PYTHONUNBUFFERED=1`` (events
    arrive as they are written), the package root in front of ``PYTHONPATH``
    (the package imports in the child even from an uninstalled checkout), then ``extra``."""
    env = dict(os.environ)
    env.update(rank_environment(local_ranks, base=env))
    env["PYTHONUNBUFFERED"] = "1"
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([PACKAGE_ROOT] + [p for p in paths if p != PACKAGE_ROOT])
    env.update(extra or {})
    return env


def process_group_kwargs() -> Dict[str, object]:
    """``subprocess.Popen`` arguments that put a rank in its own process group
    (so it can be killed as a group) but keep it in the caller's session.

    Not ``start_new_session``: a new session is a new scheduler *autogroup* on
    Linux (``/proc/sys/kernel/sched_autogroup_enabled``), and CFS then shares
    the CPU between sessions before threads.  MLX's ring backend busy-polls a
    socket thread per pending transfer; with every co-located rank in its own
    autogroup that spinner took half of its rank's share from the rank's
    compute thread: measured on 2 cores, 3 ring ranks, a plain decode loop
    ran at 519 ms/step in one session and 1252 ms/step with one session per
    rank (BENCHMARKS.md).
    """
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}  # pragma: no cover - Python 3.10


# -- one process ----------------------------------------------------------------------------

class RankProcess:
    """One child process (a rank, ``mpirun`` carrying N ranks, or a benchmark
    worker), its events and its exit.  Created by :meth:`Supervisor.spawn`.

    Attributes:
        name: how messages name it (``"rank 1"``, ``"mpirun"``).
        popen: the :class:`subprocess.Popen`.
        events: every event it printed, in order.
        stderr_tail: its last 40 stderr lines.
        returncode: ``None`` until it has exited and all its output was read.
    """

    def __init__(self, name: str, popen: subprocess.Popen, supervisor: "Supervisor"):
        self.name = name
        self.popen = popen
        self.events: List[dict] = []
        self.stderr_tail: Deque[str] = collections.deque(maxlen=40)
        self.returncode: Optional[int] = None
        self._supervisor = supervisor
        self._cond = supervisor._cond
        self._stderr = threading.Thread(target=self._read_stderr, name=f"{name} stderr", daemon=True)
        self._stdout = threading.Thread(target=self._read_stdout, name=f"{name} stdout", daemon=True)
        self._stderr.start()
        self._stdout.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _read_stdout(self) -> None:
        for line in self.popen.stdout:
            event = parse_event(line)
            if event is None:
                self._supervisor._output("stdout", line)
                continue
            with self._cond:
                self.events.append(event)
                self._cond.notify_all()
            if self._supervisor._on_event is not None:
                try:
                    self._supervisor._on_event(event)
                except Exception:  # a caller's display bug must not stop the reader
                    pass
        self._stderr.join(timeout=2.0)  # its last lines, unless a grandchild holds stderr open
        code = self.popen.wait()
        with self._cond:
            self.returncode = code
            if not self._supervisor._stopping:
                self._supervisor._exits.append(self)
            self._cond.notify_all()
        if self._supervisor._on_exit is not None:
            try:
                self._supervisor._on_exit(self)
            except Exception:
                pass

    def _read_stderr(self) -> None:
        for line in self.popen.stderr:
            with self._cond:
                self.stderr_tail.append(line.rstrip())
            self._supervisor._output("stderr", line)

    def exit_line(self) -> str:
        """``"<name> exited with code C: <last stderr line>"`` (call after exit)."""
        # mpirun's own failure text is a boxed help message: the launch agent's line says more
        lines = [l for l in reversed(self.stderr_tail) if l.strip(" -=*")]
        tail = next((l for l in lines if l.startswith("mlxcluster mpi agent:")), lines[0] if lines else "")
        return f"{self.name} exited with code {self.returncode}" + (f": {tail.strip()[:300]}" if tail else "")

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to its process group while it has not been reaped."""
        if self.popen.returncode is None:
            try:
                os.killpg(self.popen.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def descendants(self) -> List["psutil.Process"]:
        """Its live descendants (psutil), in any process group: ``mpirun`` puts each rank it
        starts in a process group of its own, which signalling this group does not reach."""
        import psutil

        try:
            return psutil.Process(self.popen.pid).children(recursive=True)
        except psutil.Error:
            return []

    def send(self, line: str) -> None:
        """Write ``line`` and a newline to its stdin (spawned with ``stdin=True``) and flush.

        Raises:
            OSError: the process has no stdin pipe, or it has exited (``BrokenPipeError``).
        """
        if self.popen.stdin is None:
            raise OSError(f"{self.name} has no stdin pipe")
        try:
            self.popen.stdin.write(line + "\n")
            self.popen.stdin.flush()
        except ValueError as exc:  # closed by us
            raise OSError(str(exc)) from None

    def join(self, timeout_s: float) -> bool:
        """Wait until its output is read and its exit recorded; ``True`` if it was."""
        self._stdout.join(timeout=timeout_s)
        return not self._stdout.is_alive()


# -- a group of processes -------------------------------------------------------------

def exited(proc) -> bool:
    """Whether the ``psutil.Process`` ``proc`` has exited: gone, or a zombie -- its memory and
    sockets are released already; only its parent's ``wait`` is left, and an orphan's parent is
    PID 1 (which in a container may reap it seconds later: ``mpirun``'s ranks once ``mpirun`` died
    were waited on for 1.5 s here, every re-formation)."""
    import psutil

    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # access denied etc.: judge by existence
        return not proc.is_running()


def _close(fd: int) -> None:
    """Close pidfd ``fd``; one already closed (EBADF: seen once under the full test suite, cause not
    found) is no error -- the wait it belonged to is over either way."""
    with contextlib.suppress(OSError):
        os.close(fd)


def _pidfds(pids: Sequence[int]) -> Optional[Dict[int, int]]:
    """``{pidfd: pid}`` of ``pids`` (``os.pidfd_open``, Linux >= 5.3: the descriptor is readable
    once the process exits, zombie or not), leaving out those already gone; ``None`` where this
    system has no pidfds."""
    fds: Dict[int, int] = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            continue
        except (AttributeError, OSError):  # not Linux, or an older kernel: no pidfds
            for fd in fds:
                _close(fd)
            return None
    return fds


def _poll_exits(fds: Dict[int, int], timeout_s: Optional[float]) -> List[int]:
    """Block until every pidfd of ``fds`` (:func:`_pidfds`) is readable or ``timeout_s`` seconds
    passed (``None``: no limit); closes them all and returns the pids that had not exited.  The
    kernel wakes each ``poll`` on an exit: one pass per exit, bounded by ``len(fds)``."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while fds:
            left_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            ready = poller.poll(left_ms)
            if not ready:
                break
            for fd, _ in ready:
                poller.unregister(fd)
                del fds[fd]
                _close(fd)
        return list(fds.values())
    finally:
        for fd in fds:
            _close(fd)


def wait_exited(procs, timeout_s: float) -> list:
    """Wait up to ``timeout_s`` seconds for every ``psutil.Process`` of ``procs`` to exit
    (:func:`exited`: a zombie counts); returns those still running, in ``procs``' order.

    Linux: a ``poll`` on each process's pidfd, which the kernel wakes at its exit, reaping nothing.
    Elsewhere: :func:`psutil.wait_procs` (kqueue on macOS; launchd reaps orphans at once).  Not
    psutil on Linux: for a process that is not our child (``mpirun``'s ranks) it waits past the
    exit until the zombie is reaped, polling ``kill(pid, 0)`` (psutil/_psposix.py,
    ``wait_pid_posix``) -- an orphan's reaper may take seconds (see :func:`exited`)."""
    import psutil

    left = [p for p in procs if not exited(p)]
    if not left:
        return []
    fds = _pidfds([p.pid for p in left])
    if fds is None:
        return psutil.wait_procs(left, timeout=timeout_s)[1]
    by_pid = {p.pid: p for p in left}
    for fd, pid in list(fds.items()):  # exited before its pidfd opened (its pid maybe another's now)
        if not by_pid[pid].is_running() or exited(by_pid[pid]):
            _close(fds.pop(fd))
    still = set(_poll_exits(fds, timeout_s))
    return [p for p in left if p.pid in still]


def wait_parent_exit() -> None:
    """Block until this process's parent exits (or return at once if it has: re-parented).  Linux:
    the parent's pidfd; macOS: kqueue ``NOTE_EXIT``; elsewhere :meth:`psutil.Process.wait` (which
    for a non-child returns once the parent is reaped)."""
    parent = os.getppid()
    fds = _pidfds([parent])
    if fds is not None:
        if os.getppid() == parent:  # the pidfd is of our parent, not of a process given its pid since
            _poll_exits(fds, None)
        else:
            for fd in fds:
                _close(fd)
        return
    if hasattr(select, "kqueue"):
        kq = select.kqueue()
        try:
            ev = select.kevent(parent, filter=select.KQ_FILTER_PROC, flags=select.KQ_EV_ADD | select.KQ_EV_ONESHOT,
                               fflags=select.KQ_NOTE_EXIT)
            if os.getppid() == parent:
                kq.control([ev], 1, None)
        except OSError:  # ESRCH: it has exited
            pass
        finally:
            kq.close()
        return
    import psutil

    with contextlib.suppress(psutil.Error):
        psutil.Process(parent).wait()


class Supervisor:
    """The processes of one launch: N ring ranks, one ``mpirun`` carrying N
    ranks, one rank of a ``join`` formation, or a benchmark's workers.

    Args:
        on_event: called with every event dict, from the reader threads.
        on_exit: called with the :class:`RankProcess` once it has exited
            (after its events), from its reader thread.
        on_output: called with ``("stdout" | "stderr", line)`` for every output
            line that is not an event, from the reader threads.  :meth:`stop` waits for
            the readers, so do not call it while holding a lock these callbacks take.

    Thread-safe; every wait has a timeout and wakes on the readers' notifications.
    One supervisor per launch: after :meth:`stop`, start the next launch with a new one.
    """

    def __init__(self, on_event: Optional[EventCallback] = None,
                 on_exit: Optional[Callable[[RankProcess], None]] = None,
                 on_output: Optional[Callable[[str, str], None]] = None):
        self.processes: List[RankProcess] = []
        self._on_event = on_event
        self._on_exit = on_exit
        self._on_output = on_output
        self._cond = threading.Condition()
        self._stopping = False
        self._exits: List[RankProcess] = []  # in the order they exited, unless stop() caused it

    def _output(self, stream: str, line: str) -> None:
        if self._on_output is not None:
            try:
                self._on_output(stream, line)
            except Exception:  # a caller's bug must not stop the reader
                pass

    def spawn(self, cmd: Sequence[str], env: Mapping[str, str], name: str = "rank 0",
              stdin: bool = False) -> RankProcess:
        """Start ``cmd`` with environment ``env`` (e.g. :func:`rank_env`) in its own
        process group of this session; stdin is ``/dev/null``, or with ``stdin`` a pipe
        that :meth:`RankProcess.send` writes (a standby rank's bootstrap).

        Raises:
            OSError: the executable cannot be started.
        """
        popen = subprocess.Popen(list(cmd), env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, text=True,
                                 **process_group_kwargs())
        proc = RankProcess(name, popen, self)
        with self._cond:
            self.processes.append(proc)
        return proc

    # -- state (every read under the condition's lock) ------------------------------
    @property
    def events(self) -> List[dict]:
        """Every event of every process, per process in order."""
        with self._cond:
            return [e for p in self.processes for e in p.events]

    @property
    def states(self) -> Dict[int, str]:
        """The latest event kind of each rank that has reported one."""
        with self._cond:
            return self._states()

    def _states(self) -> Dict[int, str]:
        out: Dict[int, str] = {}
        for p in self.processes:
            for e in p.events:
                if isinstance(e.get("rank"), int):
                    out[e["rank"]] = e["event"]
        return out

    def _error(self) -> Optional[str]:
        for p in self.processes:
            for e in p.events:
                if e["event"] == "error":
                    who = f"rank {e['rank']}" if e.get("rank") is not None else p.name
                    lines = str(e.get("message") or "").strip().splitlines()
                    return f"{who}: {lines[0] if lines else 'failed'}"
        return None

    def _failure(self, exit_0_fails: bool = True) -> Optional[str]:
        error = self._error()
        if error:
            return error
        for p in self._exits:
            if exit_0_fails or p.returncode != 0:
                return p.exit_line()
        return None

    @property
    def failure(self) -> Optional[str]:
        """One line saying why the group failed: the first ``error`` event
        (``"rank R: message"``), else the first process that exited (``"rank 1
        exited with code -9: <last stderr line>"``); ``None`` while all run.
        Exits caused by :meth:`stop` are not failures."""
        with self._cond:
            return self._failure()

    # -- waiting ------------------------------------------------------------------------
    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Block until ``predicate()`` (called under the lock, after every event and
        exit) is true, or ``timeout_s`` passes; returns its last value."""
        with self._cond:
            return bool(self._cond.wait_for(predicate, timeout=max(0.0, timeout_s)))

    def wait_ready(self, ranks: int, timeout_s: float) -> None:
        """Block until ``ranks`` distinct ranks have reported ``ready`` as their latest event.

        Raises:
            LaunchError: a rank reported an error, a process exited, or
                ``timeout_s`` passed (the message is one line; the group is stopped first).
        """
        def settled() -> bool:
            ready = sum(1 for s in self._states().values() if s == "ready")
            return ready >= ranks or self._failure() is not None

        with self._cond:
            self._cond.wait_for(settled, timeout=max(0.0, timeout_s))
            ready = sum(1 for s in self._states().values() if s == "ready")
            if ready >= ranks:
                return
            states = self._states()
            message = self._failure() or (
                f"ranks did not become ready within {timeout_s:.0f} s (states: "
                + ", ".join(f"rank {r}: {states.get(r, 'starting')}" for r in range(ranks)) + ")")
        self.stop()
        raise LaunchError(message)

    def wait_exit(self, timeout_s: float, grace_s: float = 2.0) -> Optional[str]:
        """Wait until every process has exited; ``None`` when all exited 0 without an
        ``error`` event, else the one-line reason.

        When one fails, the others get ``grace_s`` to report and exit (they may be
        stuck in a collective), then the group is stopped; after ``timeout_s`` it
        is stopped and the reason is ``"timed out after S s"``.
        """
        def all_exited() -> bool:
            return all(p.returncode is not None for p in self.processes)

        with self._cond:
            done = self._cond.wait_for(lambda: all_exited() or self._failure(exit_0_fails=False) is not None,
                                       timeout=max(0.0, timeout_s))
            if done and not all_exited():
                self._cond.wait_for(all_exited, timeout=grace_s)
        self.stop()
        with self._cond:
            if not done:
                return f"timed out after {timeout_s:.0f} s"
            return self._failure(exit_0_fails=False)

    # -- stopping --------------------------------------------------------------------------
    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM (and SIGCONT, for a stopped process) to every process group and to every
        descendant outside it (``mpirun``'s ranks), SIGKILL to those still running after
        ``timeout_s``; returns once each exit is recorded (bounded: a process that survives
        SIGKILL for 5 s more is left).  A rank frozen with SIGSTOP is killed too: without the
        descendants, ``mpirun`` exited and left it stopped for good."""
        import psutil

        with self._cond:
            self._stopping = True
            procs = list(self.processes)
        strays = [d for p in procs for d in p.descendants()]
        for p in procs:
            p.signal_group(signal.SIGTERM)
            p.signal_group(signal.SIGCONT)
        for d in strays:
            with contextlib.suppress(psutil.Error):
                d.send_signal(signal.SIGTERM)
                d.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + timeout_s
        for p in procs:
            if not p.join(max(0.0, deadline - time.monotonic())):
                p.signal_group(signal.SIGKILL)
        alive = wait_exited(strays, max(0.0, deadline - time.monotonic()))
        for d in alive:
            with contextlib.suppress(psutil.Error):
                d.kill()
        wait_exited(alive, 5.0)
        for p in procs:
            p.join(5.0)

    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

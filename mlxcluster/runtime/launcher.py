"""Local launcher: N rank processes on one machine, over loopback.

Backends:
  * ``ring``: MLX's TCP ring.  One process per rank with ``MLX_RANK`` and
    ``MLX_HOSTFILE`` set, the hostfile being the JSON list of ``["ip:port"]``
    per rank that ``mlx.launch`` writes.
  * ``mpi``: OpenMPI's ``mpirun -np N`` starts the ranks (MLX's MPI backend).

Every rank prints ``@@mlxcluster {json}`` progress events (see
:mod:`mlxcluster.runtime.rank`); the launcher waits until all ranks are
``ready`` (or one fails, or the start timeout passes) and then hands out rank
0's address.  Any rank that exits afterwards is reported by :attr:`failure`.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Deque, Dict, List, Optional

from .blas import rank_environment
from .rank import parse_event

__all__ = ["LocalCluster", "LaunchError", "free_ports", "BACKENDS"]

BACKENDS = ("ring", "mpi")


def resolve_backend(backend: str) -> str:
    """``auto`` -> ``mpi`` when OpenMPI's ``mpirun`` is installed, else ``ring``.

    MPI is preferred because its small-message ``all_sum`` is ~100x faster
    than MLX's TCP ring on the same machine (see BENCHMARKS.md).
    """
    if backend == "auto":
        return "mpi" if mpirun_path() else "ring"
    return backend


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


class LaunchError(RuntimeError):
    """A rank failed to start (or the backend is unavailable)."""


def free_ports(n: int, host: str = "127.0.0.1") -> List[int]:
    """``n`` distinct TCP ports that were free on ``host`` a moment ago."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def mpirun_path() -> Optional[str]:
    return shutil.which("mpirun")


class LocalCluster:
    """Start and supervise a local N-rank tensor-parallel group.

    Args:
        world_size: number of ranks N.
        backend: ``"ring"`` or ``"mpi"``.
        model: model reference (path or ``None`` for the embedded default).
        weights: weight format (see :data:`mlxcluster.model.loader.WEIGHT_FORMATS`).
        on_event: called with every progress event dict (from reader threads).
        start_timeout_s: seconds to wait for all ranks to be ready.
        host: loopback address the ranks use.
    Raises (from :meth:`start`):
        LaunchError: backend unavailable, a rank failed, or the timeout passed.
    """

    def __init__(self, world_size: int, backend: str = "ring", model: Optional[str] = None,
                 weights: Optional[str] = None, on_event: Optional[Callable[[dict], None]] = None,
                 start_timeout_s: float = 300.0, host: str = "127.0.0.1",
                 extra_env: Optional[Dict[str, str]] = None, step_timeout_s: float = 120.0):
        backend = resolve_backend(backend)
        if backend not in BACKENDS:
            raise LaunchError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
        if world_size < 1:
            raise LaunchError("world size must be at least 1")
        self.world_size = world_size
        self.backend = backend
        self.model = model
        self.weights = weights
        self.on_event = on_event
        self.start_timeout_s = start_timeout_s
        self.host = host
        self.extra_env = extra_env or {}
        self.step_timeout_s = step_timeout_s
        self.procs: List[subprocess.Popen] = []
        self.states: Dict[int, str] = {}
        self.events: List[dict] = []
        self.errors: List[str] = []
        self.stderr_tail: Deque[str] = collections.deque(maxlen=40)
        self.address: Optional[str] = None
        self._tmp = tempfile.mkdtemp(prefix="mlxcluster-")
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._threads: List[threading.Thread] = []

    # -- process management ---------------------------------------------------
    def _rank_cmd(self, ports: List[int]) -> List[str]:
        cmd = [sys.executable, "-m", "mlxcluster.runtime.rank", "--backend",
               self.backend if self.world_size > 1 else "any",
               "--world-size", str(self.world_size), "--ports", ",".join(map(str, ports)),
               "--hosts", self.host, "--bind", self.host, "--step-timeout", str(self.step_timeout_s)]
        if self.model:
            cmd += ["--model", self.model]
        if self.weights:
            cmd += ["--weights", self.weights]
        return cmd

    def _base_env(self) -> Dict[str, str]:
        env = dict(os.environ)
        env.update(rank_environment(self.world_size))
        env.update(self.extra_env)
        env["PYTHONUNBUFFERED"] = "1"
        # Make the package importable from the rank processes even when it is
        # used from a source checkout that is not installed.
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def start(self) -> "LocalCluster":
        """Spawn the ranks and block until all are ready; returns ``self``."""
        ports = free_ports(self.world_size, self.host)
        cmd = self._rank_cmd(ports)
        env = self._base_env()
        if self.world_size == 1 or self.backend == "ring":
            if self.world_size > 1:
                ring_ports = free_ports(self.world_size, self.host)
                hostfile = os.path.join(self._tmp, "hostfile.json")
                with open(hostfile, "w") as f:
                    json.dump([[f"{self.host}:{p}"] for p in ring_ports], f)
                env["MLX_HOSTFILE"] = hostfile
            for rank in range(self.world_size):
                renv = dict(env, MLX_RANK=str(rank))
                self._spawn(cmd, renv)
        else:
            mpirun = mpirun_path()
            if mpirun is None:
                raise LaunchError("the mpi backend needs OpenMPI's mpirun (run scripts/setup.sh, or apt-get install openmpi-bin)")
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            # Ranks waiting in a collective yield the CPU instead of spinning:
            # with co-located ranks (3 ranks on 2 cores here) spinning waiters
            # starve the rank still computing (decode 1.5 -> 8.4 tok/s, TP=3).
            env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
            exported = ["LD_PRELOAD", "OPENBLAS_NUM_THREADS", "PYTHONPATH", "PYTHONUNBUFFERED",
                        "MLXCLUSTER_SECRET", "MLXCLUSTER_WEIGHTS", "MLXCLUSTER_LOG", "MLXCLUSTER_MAX_BATCH",
                        "MLXCLUSTER_MAX_QUEUE", "MLXCLUSTER_SELF_SAMPLE", "MLXCLUSTER_COMPILE", *self.extra_env]
            mpi_cmd = [mpirun, "-np", str(self.world_size), "--oversubscribe", "--bind-to", "none",
                       "--host", f"localhost:{self.world_size}"]
            for name in exported:
                if name in env:
                    mpi_cmd += ["-x", name]
            self._spawn(mpi_cmd + ["--"] + cmd, env)
        self._wait_ready()
        self.address = f"{self.host}:{ports[0]}"
        return self

    def _spawn(self, cmd: List[str], env: Dict[str, str]) -> None:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True, **process_group_kwargs())
        self.procs.append(proc)
        for stream, reader in ((proc.stdout, self._read_stdout), (proc.stderr, self._read_stderr)):
            t = threading.Thread(target=reader, args=(stream,), daemon=True)
            t.start()
            self._threads.append(t)

    def _read_stdout(self, stream) -> None:
        for line in stream:
            event = parse_event(line)
            if event is None:
                continue
            with self._cond:
                self.events.append(event)
                rank = event.get("rank")
                if rank is not None:
                    self.states[rank] = event["event"]
                if event["event"] == "error":
                    who = f"rank {rank}" if rank is not None else "a rank"
                    self.errors.append(f"{who}: {event.get('message', 'failed')}")
                self._cond.notify_all()
            if self.on_event:
                try:
                    self.on_event(event)
                except Exception:
                    pass

    def _read_stderr(self, stream) -> None:
        for line in stream:
            with self._cond:
                self.stderr_tail.append(line.rstrip())

    def _exited(self) -> List[int]:
        return [p.returncode for p in self.procs if p.poll() is not None]

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        with self._cond:
            while True:
                ready = sum(1 for s in self.states.values() if s == "ready")
                if ready >= self.world_size:
                    return
                if self.errors:
                    break
                if self._exited():
                    # give the readers a moment to collect the last lines
                    self._cond.wait(timeout=0.5)
                    break
                if time.monotonic() > deadline:
                    break
                self._cond.wait(timeout=0.2)
        message = self.failure or (
            f"ranks did not become ready within {self.start_timeout_s:.0f} s "
            f"(states: {self._state_summary()})")
        self.stop()
        raise LaunchError(message)

    def _state_summary(self) -> str:
        return ", ".join(f"rank {r}: {self.states.get(r, 'starting')}" for r in range(self.world_size))

    @property
    def failure(self) -> Optional[str]:
        """One line describing why the group failed, or ``None`` if all is well."""
        with self._lock:
            if self.errors:
                return self.errors[0]
            for i, p in enumerate(self.procs):
                code = p.poll()
                if code is not None:
                    tail = next((l for l in reversed(self.stderr_tail) if l.strip()), "")
                    who = f"rank {i}" if len(self.procs) > 1 else ("mpirun" if self.backend == "mpi" and self.world_size > 1 else "rank 0")
                    return f"{who} exited with code {code}" + (f": {tail.strip()[:300]}" if tail else "")
        return None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate every rank (SIGTERM, then SIGKILL after ``timeout_s``)."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=5)
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

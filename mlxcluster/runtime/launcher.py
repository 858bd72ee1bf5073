"""Local launcher: N rank processes on one machine, over loopback.

Backends (the files and command lines of :mod:`mlxcluster.runtime.backends`,
as ``mlx.launch`` makes them):
  * ``ring``: MLX's TCP ring.  One process per rank with ``MLX_RANK`` and
    ``MLX_HOSTFILE`` set, the hostfile being the JSON list of ``["ip:port"]``
    per rank.
  * ``mpi``: OpenMPI's ``mpirun -np N`` starts the ranks (MLX's MPI backend).

The processes are started and watched by :class:`~mlxcluster.runtime.supervisor.Supervisor`:
every rank prints ``@@mlxcluster {json}`` progress events, :meth:`LocalCluster.start`
waits until all ranks are ``ready`` (or one fails, or the start timeout
passes) and then hands out rank 0's address.  Any rank that exits afterwards
is reported by :attr:`LocalCluster.failure`.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from typing import TYPE_CHECKING, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..config import VARIABLES
from . import backends as bk
from ..security import CLIENT, credentials, new_secret, rank_environment
from .rank_config import RankConfig
from .supervisor import LaunchError, Supervisor, rank_command, rank_env

if TYPE_CHECKING:
    from ..model.topology import Topology

__all__ = ["LocalCluster", "LaunchError", "free_ports", "mpirun_path", "resolve_backend", "local_processes",
           "BACKENDS"]

BACKENDS = ("ring", "mpi")
#: Cluster name (key-derivation salt) of a local group.
LOCAL_CLUSTER = "local"

# Exported to the ranks mpirun starts (with the backend's own variables).
_MPI_EXPORTS = ("LD_PRELOAD", "OPENBLAS_NUM_THREADS", "PYTHONPATH", "PYTHONUNBUFFERED") + VARIABLES


def resolve_backend(backend: str) -> str:
    """The local backend to use for ``backend``: ``auto`` -> ``mpi`` when OpenMPI's
    ``mpirun`` is installed, else ``ring``; ``ring`` and ``mpi`` as given.

    MPI is preferred because its small-message ``all_sum`` is ~100x faster
    than MLX's TCP ring on the same machine (see BENCHMARKS.md).

    Raises:
        LaunchError: any other name (one line naming the choices).
    """
    if backend == "auto":
        return "mpi" if mpirun_path() else "ring"
    if backend not in BACKENDS:
        raise LaunchError(f"unknown backend {backend!r}: choose one of auto, {', '.join(BACKENDS)}")
    return backend


#: Lowest port :func:`free_ports` picks.
LOW_PORT = 10000


def ephemeral_range() -> Tuple[int, int]:
    """The OS's range of ephemeral ports (those it gives outgoing connections and ``bind(0)``):
    Linux's ``/proc/sys/net/ipv4/ip_local_port_range``, else IANA's 49152-65535 (macOS's default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def free_ports(n: int, host: str = "127.0.0.1") -> List[int]:
    """``n`` distinct TCP ports free on ``host`` a moment ago, for a process started later to bind.

    Picked at random below the ephemeral range (:func:`ephemeral_range`), from :data:`LOW_PORT`: a
    port ``bind(0)`` returns is an ephemeral one, which an outgoing connection (gRPC's, MPI's) may
    take before the rank binds it -- "Failed to bind to address", a failed formation and a retry,
    seen in failover runs.  Falls back to ``bind(0)`` if 100 draws per port find none free.

    Raises:
        OSError: ``host`` is not a local address.
    """
    import random

    low, _high = ephemeral_range()
    top = max(LOW_PORT + 1, low - 1)
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            for _try in range(100):
                port = random.randint(LOW_PORT, top)
                if port in ports:
                    continue
                try:
                    s.bind((host, port))
                    break
                except OSError as exc:
                    if exc.errno == errno.EADDRNOTAVAIL:
                        s.close()
                        raise
            else:
                s.bind((host, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def mpirun_path() -> Optional[str]:
    """Path of OpenMPI's ``mpirun``, or ``None`` when it is not installed."""
    return shutil.which("mpirun")


def local_processes(world_size: int, backend: str, cmd: Sequence[str], env: Mapping[str, str],
                    workdir: str, host: str = "127.0.0.1") -> List[Tuple[str, List[str], Dict[str, str]]]:
    """The processes that run ``cmd`` as ``world_size`` ranks on this machine, the
    way ``mlx.launch`` (ring) or ``mpirun`` (mpi) starts them.

    Args:
        world_size: N (1: one process, no backend).
        backend: ``ring``, ``mpi`` or ``auto`` (:func:`resolve_backend`).
        cmd: argv of one rank.
        env: environment of one rank (e.g. :func:`~mlxcluster.runtime.supervisor.rank_env`).
        workdir: existing directory for the backend's files (ring hostfile, MPI hostfile).
        host: IPv4 address the ranks use.
    Returns:
        ``(name, argv, env)`` per process, for :meth:`Supervisor.spawn`: N ring
        ranks ``"rank R"`` with ``MLX_RANK``/``MLX_HOSTFILE``, or one ``"mpirun"``.
    Raises:
        LaunchError: unknown backend, or ``mpi`` without ``mpirun``.
    """
    if world_size == 1:
        return [("rank 0", list(cmd), dict(env))]
    backend = resolve_backend(backend)
    ring_ports = free_ports(world_size, host)
    eps = [bk.RankEndpoint(rank=r, address=host, ring_port=p, control_port=p) for r, p in enumerate(ring_ports)]
    if backend == "ring":
        return [(f"rank {r}", list(cmd), dict(env, **bk.write_backend_files("ring", eps, r, workdir)))
                for r in range(world_size)]
    mpirun = mpirun_path()
    if mpirun is None:
        raise LaunchError("the mpi backend needs OpenMPI's mpirun (run scripts/setup.sh, or apt-get install openmpi-bin)")
    mpi_env = bk.write_backend_files("mpi", eps, 0, workdir)  # the MPI hostfile; MLX_MPI_LIBNAME
    env = dict(env, **mpi_env)
    for name, value in bk.mpi_process_environment().items():
        env.setdefault(name, value)
    exported = [n for n in dict.fromkeys(_MPI_EXPORTS + tuple(mpi_env)) if n in env]
    argv = bk.mpirun_command(os.path.join(workdir, bk.MPI_HOSTFILE_NAME), world_size, cmd, exported,
                             mpirun=mpirun, extra_args=["--oversubscribe"])
    return [("mpirun", argv, env)]


#: Starts of a local group tried when a picked port was taken meanwhile.
START_ATTEMPTS = 3


def _port_taken(message: str) -> bool:
    """Whether a rank's start-up error says its port was taken (gRPC, MLX's ring, the OS)."""
    m = message.lower()
    return any(k in m for k in ("failed to bind", "address already in use", "couldn't bind", "cannot listen on"))


class LocalCluster:
    """Start and supervise a local N-rank tensor-parallel group.

    Args:
        world_size: number of ranks N.
        backend: ``"ring"``, ``"mpi"`` or ``"auto"`` (:func:`resolve_backend`).
        model: model reference (path or ``None`` for the embedded default).
        weights: weight format (see :data:`mlxcluster.model.loader.WEIGHT_FORMATS`).
        on_event: called with every progress event dict (from reader threads).
        start_timeout_s: seconds to wait for all ranks to be ready.
        host: loopback address the ranks use.
        step_timeout_s: the ranks' ``step_timeout``.
        config: the ranks' other settings, a :class:`~mlxcluster.runtime.rank_config.RankConfig`
            (e.g. ``RankConfig(max_queue=8)``, ``RankConfig(compile=False)``; default: its defaults);
            the group's own fields (world size, ports, hosts, bind, backend, epoch) and those given
            here (``model``, ``weights``, ``step_timeout_s``, ``topology``) are set by the launcher.
        secret: the group's cluster secret (``None``: a fresh random one,
            :func:`mlxcluster.security.new_secret`), handed to the ranks in their
            environment; every link of the group is mutual TLS under it.
        rank0_port: rank 0's ``Generation`` port (0: a free one; a prefill group's fixed address).
        topology: the group's validated :class:`~mlxcluster.model.topology.Topology` (``None``: the
            ``config``'s, by default a tensor-parallel group); its ``world_size`` must be ``world_size``.

    Attributes:
        credentials: client :class:`~mlxcluster.security.Credentials` for rank 0
            (e.g. ``GenerationClient(local.address, local.credentials)``).
    Raises:
        LaunchError: (here) unknown backend, world size below 1 or other than the topology's; (from
            :meth:`start`) backend unavailable, a rank failed, or the timeout passed.
    """

    def __init__(self, world_size: int, backend: str = "ring", model: Optional[str] = None,
                 weights: Optional[str] = None, on_event: Optional[Callable[[dict], None]] = None,
                 start_timeout_s: float = 300.0, host: str = "127.0.0.1", step_timeout_s: float = 120.0,
                 config: Optional[RankConfig] = None, secret: Optional[str] = None, rank0_port: int = 0,
                 topology: Optional["Topology"] = None):
        backend = resolve_backend(backend)
        self.rank0_port = rank0_port  # rank 0's Generation port (0: any free one)
        if world_size < 1:
            raise LaunchError("world size must be at least 1")
        if topology is not None and topology.world_size != world_size:
            raise LaunchError(f"the topology needs {topology.world_size} rank(s), not {world_size}")
        self.config = config if config is not None else RankConfig()
        self.topology = topology if topology is not None else self.config.topology
        self.world_size = world_size
        self.backend = backend
        self.model = model
        self.weights = weights
        self.on_event = on_event
        self.start_timeout_s = start_timeout_s
        self.host = host
        self.step_timeout_s = step_timeout_s
        self.epoch = uuid.uuid4().hex[:12]  # this group's formation epoch (checked by pipeline stages)
        self.address: Optional[str] = None
        self.secret = secret or new_secret()
        self.credentials = credentials(self.secret, LOCAL_CLUSTER, [CLIENT])
        self.supervisor = Supervisor(on_event=on_event)
        self._tmp = tempfile.mkdtemp(prefix="mlxcluster-")

    def start(self) -> "LocalCluster":
        """Spawn the ranks and block until all are ready; returns ``self``.

        The ranks' ports are picked free just before they start, so another
        process can take one in between (OpenMPI's own sockets did, measured
        in the benchmark): a start that fails only because a port was taken
        is retried with fresh ports, at most :data:`START_ATTEMPTS` times.

        Raises:
            LaunchError: one line: the backend is unavailable, a rank reported an
                error or exited, or ``start_timeout_s`` passed (the ranks are stopped).
        """
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                return self._start_once()
            except LaunchError as exc:
                if attempt == START_ATTEMPTS or not _port_taken(str(exc)):
                    raise
                self.supervisor = Supervisor(on_event=self.on_event)
        raise AssertionError("unreachable")

    def _start_once(self) -> "LocalCluster":
        ports = free_ports(self.world_size, self.host)
        if self.rank0_port:
            ports[0] = self.rank0_port
        cmd = rank_command(dataclasses.replace(
            self.config, world_size=self.world_size, ports=tuple(ports), hosts=(self.host,), bind=self.host,
            backend=self.backend, model=self.model, weights=self.weights, step_timeout=self.step_timeout_s,
            topology=self.topology, epoch=self.epoch))
        try:
            for name, argv, env in local_processes(self.world_size, self.backend, cmd, rank_env(
                    self.world_size, rank_environment(self.secret, LOCAL_CLUSTER)),
                                                   self._tmp, self.host):
                self.supervisor.spawn(argv, env, name)
        except ValueError as exc:  # a bad setting (mlxcluster.config) or backend file
            self.stop()
            raise LaunchError(str(exc)) from None
        except OSError as exc:
            self.stop()
            raise LaunchError(f"cannot start the rank processes: {exc}") from None
        self.supervisor.wait_ready(self.world_size, self.start_timeout_s)
        self.address = f"{self.host}:{ports[0]}"
        return self

    @property
    def procs(self) -> List[subprocess.Popen]:
        """The processes started: N ranks (ring, or world size 1), or one ``mpirun``."""
        return [p.popen for p in self.supervisor.processes]

    @property
    def events(self) -> List[dict]:
        """Every progress event received so far."""
        return self.supervisor.events

    @property
    def states(self) -> Dict[int, str]:
        """Latest event kind per rank."""
        return self.supervisor.states

    @property
    def failure(self) -> Optional[str]:
        """One line describing why the group failed, or ``None`` if all is well."""
        return self.supervisor.failure

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate every rank (SIGTERM, then SIGKILL after ``timeout_s``)."""
        self.supervisor.stop(timeout_s)
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

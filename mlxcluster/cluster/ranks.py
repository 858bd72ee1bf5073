"""Rank supervision for a node daemon: start this node's rank of a formation, and
the pure state transitions its progress events, its exit and its start timeout cause.

Per backend: *ring* and *jaccl* -- every node starts its own rank process with
the backend's files (the same content on every node: :mod:`mlxcluster.runtime.backends`);
*mpi* -- rank 0's node starts ``mpirun`` for the whole group, which starts the
other ranks through each member's node (:mod:`mlxcluster.runtime.mpi_agent`:
``Node.Exec`` runs ``orted`` there, :func:`start_orted`).

Processes are spawned and watched by :mod:`mlxcluster.runtime.supervisor`
(command line, environment, ``@@mlxcluster`` events, stderr tail, stop); a rank
exits by itself when its daemon dies (the parent watch in
:mod:`mlxcluster.runtime.rank`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Sequence, Tuple

from ..model.topology import Topology
from ..runtime.rank_config import RankConfig
from ..runtime.standby import Standby
from ..runtime.supervisor import RankProcess, Supervisor, rank_command, rank_env
from ..runtime import backends as bk
from ..runtime import mpi_agent, thunderbolt
from ..protocol import mlxcluster_pb2 as pb
from ..security import rank_environment
from .membership import Bootstrapping, Failed, Formation, OwnState, Running

__all__ = ["RANK_START_TIMEOUT_S", "pick_backend", "DataPlane", "data_plane", "ring_addresses", "rdma_facts", "rdma_msg", "start_rank", "start_orted",
           "mpi_node_env", "after_event", "after_exit", "after_start_timeout"]

#: Seconds a rank process may take from ``Bootstrap`` to ``ready``.
RANK_START_TIMEOUT_S = 300.0


def rdma_msg(facts: thunderbolt.RdmaFacts) -> pb.RdmaFactsMsg:
    """``facts`` for ``PrepareReply.rdma``."""
    return pb.RdmaFactsMsg(ports=[pb.ThunderboltPortMsg(iface=p.iface, uuid=p.uuid, connected_to=p.connected_to or "",
                                                        address=p.address, speed_gbps=p.speed_gbps)
                                  for p in facts.ports], devices=list(facts.rdma_devices), problem=facts.problem)


def rdma_facts(msg: pb.RdmaFactsMsg) -> thunderbolt.RdmaFacts:
    """Inverse of :func:`rdma_msg`, validated (a peer sent it).

    Raises:
        ValueError: malformed facts (:meth:`RdmaFacts.from_dict`).
    """
    return thunderbolt.RdmaFacts.from_dict({
        "ports": [{"iface": p.iface, "uuid": p.uuid, "connected_to": p.connected_to or None, "address": p.address,
                   "speed_gbps": round(float(p.speed_gbps), 3)} for p in msg.ports],
        "rdma_devices": list(msg.devices), "problem": msg.problem})


def pick_backend(requested: str, endpoints: Sequence[bk.RankEndpoint], facts: Sequence[thunderbolt.RdmaFacts]
                 ) -> Tuple[str, str, Optional[List[list]]]:
    """The backend of a formation, why (one line for ``mlxcluster status``), and jaccl's device matrix.

    * explicit ``ring`` / ``mpi`` / ``jaccl``: every node must list it
      (:func:`mlxcluster.runtime.backends.choose_backend`); jaccl also needs the mesh;
    * ``auto``: jaccl when every node has it and the Thunderbolt mesh with RDMA is
      complete (:func:`mlxcluster.runtime.thunderbolt.jaccl_mesh`); else MPI when every
      node lists ``mpi`` (its ``Prepare`` reply: OpenMPI's ``mpirun`` and ``orted``
      installed and MLX loads its ``libmpi``, :func:`mlxcluster.runtime.backends.local_backends`;
      mpirun starts the ranks through every node's daemon, no ssh); else ring.  MPI's
      collectives decode several times faster than MLX's TCP ring (TP=3 here: 11.7 vs
      2.1 tok/s), so the ring is the last resort.

    Args:
        requested: ``auto``, ``ring``, ``mpi`` or ``jaccl``.
        endpoints: one per rank (``hostname``: the node id, for messages).
        facts: each rank's node's :class:`~mlxcluster.runtime.thunderbolt.RdmaFacts`, rank order.
    Returns:
        ``(backend, reason, devices)``; ``devices`` is the N x N matrix for jaccl, else ``None``.
    Raises:
        ValueError: an explicit backend that some node lacks, or jaccl without a full mesh.
    """
    if len(endpoints) == 1:
        return "ring", "world size 1 needs no collective backend", None
    labels = [f"rank {ep.rank} ({ep.hostname or ep.address})" for ep in endpoints]
    mesh = thunderbolt.jaccl_mesh(facts, labels)
    lacking = [label for label, ep in zip(labels, endpoints) if "jaccl" not in (ep.backends or [])]
    if requested == "jaccl":
        if mesh.devices is None:
            raise ValueError(f"jaccl: {mesh.reason}")
        if lacking:
            raise ValueError(f"jaccl: MLX has no jaccl backend on {', '.join(lacking)}")
        return "jaccl", f"requested; {mesh.reason}", mesh.devices
    if requested in ("ring", "mpi"):
        return bk.choose_backend(requested, endpoints), "requested", None
    bk.check_request(requested)
    if mesh.devices is not None and not lacking:
        return "jaccl", mesh.reason, mesh.devices
    why = mesh.reason if mesh.devices is None else f"MLX has no jaccl backend on {', '.join(lacking)}"
    no_mpi = [label for label, ep in zip(labels, endpoints) if "mpi" not in (ep.backends or [])]
    if not no_mpi:
        return "mpi", f"no jaccl: {why}; every node has OpenMPI", None
    where = "any node" if len(no_mpi) == len(labels) else ", ".join(no_mpi)
    return "ring", f"no jaccl: {why}; no usable OpenMPI on {where}", None


@dataclass(frozen=True)
class DataPlane:
    """Where a formation's collectives run, beyond its backend (:func:`data_plane`).

    Attributes:
        ring_hosts_json: ring: :attr:`Formation.ring_hosts_json` (``""``: the members' addresses).
        jaccl_ring: jaccl: run as a ring (``MLX_JACCL_RING=1``).
        note: one line for ``mlxcluster status`` (appended to the backend's reason), ``""``: none.
    """

    ring_hosts_json: str = ""
    jaccl_ring: bool = False
    note: str = ""


def data_plane(backend: str, facts: Sequence[thunderbolt.RdmaFacts], labels: Sequence[str] = ()) -> DataPlane:
    """The data plane of a formation whose ranks' nodes reported ``facts`` (rank order): MLX's TCP
    ring over the Thunderbolt cables' per-cable addresses where every pair of ring neighbours is
    cabled and addressed (as ``mlx.distributed_config`` sets it up; else over the members'
    addresses, usually the LAN or Wi-Fi, and ``note`` says why), jaccl as a ring where every pair
    has several cables (:func:`~mlxcluster.runtime.thunderbolt.jaccl_mesh`).  MPI chooses its own
    interfaces.  Never raises."""
    if len(facts) < 2:
        return DataPlane()
    if backend == "jaccl":
        mesh = thunderbolt.jaccl_mesh(facts, labels)
        return DataPlane(jaccl_ring=mesh.devices is not None and mesh.ring)
    if backend != "ring":
        return DataPlane()
    rows, why = thunderbolt.ring_over_cables(facts, labels)
    if rows is None:
        cabled = any(p.connected_to for f in facts for p in f.ports)
        return DataPlane(note=f"ring over the nodes' addresses: {why}" if cabled else "")
    return DataPlane(ring_hosts_json=json.dumps(rows), note=f"ring {why}")


def mpi_node_env(secret: str, cluster: str, model_path: str, prompt_cache: Tuple[str, str] = ("", "")) -> dict:
    """Environment of this node's MPI processes (``mpirun`` on rank 0's node, ``orted``
    elsewhere), which their ranks inherit: the secret and cluster name (never sent
    with mpirun's ``-x``), this node's settings that rank 0's one command line cannot
    carry -- its model path (``MLXCLUSTER_MODEL``) and its ``prompt_cache`` directory and
    size (``MLXCLUSTER_PROMPT_CACHE_DIR`` / ``_SIZE``, when set) --, this
    interpreter's directory first on ``PATH`` (the rank command runs ``python3``),
    MLX's libmpi name, and ``mpi_yield_when_idle`` (waiting ranks yield the CPU)."""
    node = dict(MLXCLUSTER_MODEL=model_path)
    if prompt_cache[0]:
        node.update(MLXCLUSTER_PROMPT_CACHE_DIR=prompt_cache[0], MLXCLUSTER_PROMPT_CACHE_SIZE=prompt_cache[1])
    env = rank_env(1, dict(rank_environment(secret, cluster), **node))
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", os.defpath)])
    for name, value in bk.mpi_process_environment().items():
        env.setdefault(name, value)
    return env


def start_rank(formation: Formation, rank: int, *, bind: str, model_path: str, secret: str, cluster: str,
               workdir: str, node_endpoints: Sequence[str] = (), standby: Optional[Standby] = None,
               prompt_cache: Tuple[str, str] = ("", ""), on_event: Callable[[dict], None], on_exit: Callable[[RankProcess], None]) -> Optional[Supervisor]:
    """Write the backend's files into ``workdir`` and start rank ``rank`` of ``formation``.

    ``standby``: this node's standby rank process, adopted as the rank (its ``adopted`` set)
    where the node starts its own rank (ring, jaccl, world size 1) and it is alive; else a
    new process is started.  ``prompt_cache``: this node's ``(directory, size)`` of the prefix
    cache's disk tier (``""``: none), the rank's node default (``RankConfig.prompt_cache_node``).

    ``on_event(event)`` / ``on_exit(process)`` are called from the supervisor's
    reader threads.  Stop the rank with the returned supervisor's ``stop()``.
    MPI: rank 0 starts ``mpirun`` for every rank (``node_endpoints``: each rank's
    ``Node`` service, ``"ip:port"``, for the launch agent); other ranks return
    ``None`` and wait for rank 0's ``mpirun`` to start ``orted`` here (:func:`start_orted`).

    Raises:
        ValueError: the formation's endpoints are invalid for its backend.
        OSError: the files cannot be written or the process cannot be started.
    """
    os.makedirs(workdir, exist_ok=True)
    members = formation.members
    # every rank runs the same route; the formation id is the epoch its frames and handoffs carry
    decode = formation.role == "decode"
    topology = Topology(layers=formation.layers or None,
                        role=formation.role if formation.role in ("prefill", "draft") else "tp",
                        prefill_peer=formation.prefill_peer if decode else None)  # checked by the ranks
    config = RankConfig(
        world_size=formation.world_size, ports=tuple(m.control_port for m in members),
        hosts=tuple(m.address for m in members), bind=bind, backend=formation.backend, model=model_path,
        weights=formation.weights or None, topology=topology, epoch=formation.formation_id,
        # the draft node's group: rank 0's default drafter (a request may choose another)
        draft=f"remote:{formation.draft_peer}" if formation.draft_peer else "",
        # the coordinator's KV format, the same on every rank (checked by the ranks)
        kv_bits=formation.kv_bits or 0, kv_group_size=formation.kv_group_size if formation.kv_bits else 64,
        prompt_cache_dir=prompt_cache[0], prompt_cache_size=prompt_cache[1], prompt_cache_node=bool(prompt_cache[0]))
    supervisor = Supervisor(on_event=on_event, on_exit=on_exit)
    if formation.backend == "mpi" and formation.world_size > 1:
        if rank != 0:
            return None
        if not shutil.which("mpirun"):
            raise ValueError("the mpi backend needs OpenMPI's mpirun on rank 0's node")
        # by name, not path: an absolute mpirun implies --prefix, which makes mpirun prefix the
        # daemon's command with shell assignments (PATH=...; export PATH; ...), not orted
        mpirun = "mpirun"
        # one command line for every rank: each binds its own host, reads its node's model path and
        # prompt cache in its environment (mpi_node_env)
        cmd = rank_command(replace(config, backend="mpi", bind="", model=None, prompt_cache_dir="",
                                   prompt_cache_size="", prompt_cache_node=False))
        cmd[0] = "python3"  # each node's interpreter, first on the PATH of its MPI processes
        argv = mpi_agent.join_mpirun(
            formation_id=formation.formation_id, cluster=cluster, addresses=[m.address for m in members],
            node_ids=[m.node_id for m in members], node_endpoints=list(node_endpoints), rank_command=cmd,
            workdir=workdir, mpirun=mpirun)
        supervisor.spawn(argv, mpi_node_env(secret, cluster, model_path, prompt_cache), name="mpirun")
        return supervisor
    extra = rank_environment(secret, cluster)  # the environment: not in ps
    if formation.world_size > 1:
        devices = json.loads(formation.jaccl_devices_json) if formation.backend == "jaccl" else None
        cabled = ring_addresses(formation)
        endpoints = [bk.RankEndpoint(rank=m.rank, address=m.address, ring_port=m.ring_port,
                                     control_port=m.control_port,
                                     rdma_devices={j: d for j, d in enumerate(devices[m.rank]) if d is not None}
                                     if devices else None, ring_addresses=cabled[m.rank] if cabled else None)
                     for m in members]
        extra.update(bk.write_backend_files(formation.backend, endpoints, rank, workdir,
                                            jaccl_ring=formation.jaccl_ring))
    if standby is not None and standby.alive():
        # its interpreter and the secret are in place: it takes the configuration and the
        # backend's variables (an adoption that fails here raises OSError: the bootstrap fails, and is retried)
        backend_env = {k: v for k, v in extra.items() if not k.startswith("MLXCLUSTER_")}  # it has the secret
        return standby.adopt(config, backend_env, f"rank {rank}", on_event, on_exit)
    supervisor.spawn(rank_command(config), rank_env(1, extra), name=f"rank {rank}")
    return supervisor


def ring_addresses(formation: Formation) -> Optional[List[List[str]]]:
    """A ring formation's per-rank addresses over the Thunderbolt cables (``ring_hosts_json``), or
    ``None`` (the members' addresses).

    Raises:
        ValueError: not a JSON list of one list of strings per rank (the coordinator sent it); the
            strings are IPv4 addresses, which :func:`~mlxcluster.runtime.backends.ring_hostfile` checks.
    """
    if formation.backend != "ring" or not formation.ring_hosts_json:
        return None
    try:
        rows = json.loads(formation.ring_hosts_json)
    except ValueError:
        rows = None
    if not (isinstance(rows, list) and len(rows) == formation.world_size
            and all(isinstance(r, list) and 0 < len(r) <= 16 and all(isinstance(a, str) for a in r) for r in rows)):
        raise ValueError("ring_hosts_json must be one list of 1..16 IPv4 addresses per rank")
    return rows  # each address is checked where the hostfile is written (backends.ring_hostfile)


def start_orted(argv: Sequence[str], *, secret: str, cluster: str, model_path: str,
                prompt_cache: Tuple[str, str] = ("", ""), on_output: Callable[[str, str], None], on_exit: Callable[[RankProcess], None]) -> Supervisor:
    """Start OpenMPI's daemon for this node's MPI rank (``Node.Exec``): ``argv`` as
    checked by :func:`mlxcluster.runtime.mpi_agent.orted_argv`, in the environment of
    :func:`mpi_node_env` (``prompt_cache``: this node's, as :func:`start_rank`'s).  ``on_output(stream,
    line)`` gets its stdout/stderr lines.

    Raises:
        OSError: ``orted`` cannot be started.
    """
    supervisor = Supervisor(on_exit=on_exit, on_output=on_output)
    supervisor.spawn(list(argv), mpi_node_env(secret, cluster, model_path, prompt_cache), name="orted")
    return supervisor


def after_event(own: OwnState, event: dict) -> OwnState:
    """``own`` after a progress event of its rank process: ``error`` -> :class:`Failed`,
    ``loading``/``loaded``/``connecting`` -> loading, ``ready`` -> :class:`Running`."""
    if not isinstance(own, (Bootstrapping, Running)):
        return own
    kind = event.get("event")
    if kind == "error":
        return Failed(own.formation, own.rank, own.since, str(event.get("message") or "rank failed"))
    if kind == "ready":
        return Running(own.formation, own.rank, own.since)
    if kind in ("loading", "loaded", "connecting") and isinstance(own, Bootstrapping):
        return replace(own, loading=True)
    return own


def after_exit(own: OwnState, why: str) -> OwnState:
    """``own`` after its rank process exited (``why``: one line); a failure unless already failed."""
    if isinstance(own, (Bootstrapping, Running)):
        return Failed(own.formation, own.rank, own.since, why)
    return own


def after_start_timeout(own: OwnState, now: float) -> OwnState:
    """``own`` at ``now``: :class:`Failed` when its rank has not been ready for ``RANK_START_TIMEOUT_S``."""
    if isinstance(own, Bootstrapping) and now - own.since > RANK_START_TIMEOUT_S:
        return Failed(own.formation, own.rank, own.since, "rank process did not become ready in time")
    return own


#: Bytes read per ``read`` call by :func:`warm_page_cache`.
WARM_CHUNK_BYTES = 8 << 20


def warm_page_cache(model_path: str, limit_bytes: int, stop: Optional[Callable[[], bool]] = None) -> int:
    """Read the model's files once (:func:`mlxcluster.cluster.transfer.model_files`, in order) so
    that their pages sit in the OS page cache and a rank's load later is a warm read (``join
    --spare`` does this while idle).  Bounded: at most ``limit_bytes`` bytes in all, in reads of
    :data:`WARM_CHUNK_BYTES`, stopping early when ``stop()`` says so.

    Returns:
        The bytes read.  An unreadable file is skipped (it is no error: this is only a hint).
    """
    from .transfer import model_files

    base = model_path if os.path.isdir(model_path) else os.path.dirname(model_path)
    done = 0
    buf = bytearray(WARM_CHUNK_BYTES)
    for rel in model_files(model_path):
        try:
            with open(os.path.join(base, rel), "rb", buffering=0) as f:
                while done < limit_bytes and not (stop is not None and stop()):
                    view = memoryview(buf)[: min(WARM_CHUNK_BYTES, limit_bytes - done)]
                    n = f.readinto(view)
                    if not n:
                        break
                    done += n
        except OSError:
            continue
        if done >= limit_bytes or (stop is not None and stop()):
            break
    return done

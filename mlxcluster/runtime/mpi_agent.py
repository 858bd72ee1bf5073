"""MPI across ``join`` nodes without ssh: mlxcluster as OpenMPI's launch agent.

OpenMPI's ``mpirun`` starts its daemon (``orted``) on every other host through a
launch agent, ssh by default (MCA parameter ``plm_rsh_agent``; OpenMPI 4.1
``orte/mca/plm/rsh/plm_rsh_module.c``): it runs ``<agent> <host> orted <args>``
and, like ssh, expects the agent to run the words after the host on that host,
relay their output and exit with their status.  Here the agent is::

    python -m mlxcluster.runtime.mpi_agent --nodes NODES.json HOST orted ...

which asks the node daemon behind ``HOST`` (``Node.Exec``, mutual TLS proving the
cluster secret and the node's id: :mod:`mlxcluster.security`) to start ``orted``
for the formation, and relays its stdout, stderr and exit status.  Killing the
agent cancels the call, and the node then kills ``orted`` and its ranks.  The
pattern is Kubeflow's MPI operator's, with ``kubectl exec`` as the agent.

As ssh does, the agent joins the words after the host with spaces and the
remote side splits them as a POSIX shell would (mpirun quotes some of them for
that shell, e.g. ``-mca ess "env"``); the node accepts only ``orted`` of its own
OpenMPI install, run without a shell (:func:`orted_argv`).

The mpirun side (:func:`join_mpirun`) names every rank's host in the hostfile by
an alias (``mlxcluster-rank-R``; rank 0 by its address, so mpirun starts rank 0
itself), so that ranks on one machine still get one daemon each, keeps
``orted`` attached (``orte_leave_session_attached``: no ``--daemonize``, its
life is the call's), has mpirun launch every daemon itself
(``plm_rsh_no_tree_spawn``).  OpenMPI picks its TCP interfaces itself: naming
the members' addresses as ``/32`` networks in ``btl_tcp_if_include`` hangs its
TCP transport on messages over the 64 KiB eager limit (OpenMPI 4.1.4, measured
in network namespaces), and each node's subnet is not known to rank 0.  The
cluster secret is never passed with ``-x`` (mpirun forwards those over its own
plaintext TCP): each rank inherits it from its node's ``orted``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from typing import List, Mapping, Optional, Sequence, Tuple

__all__ = ["AGENT_MODULE", "NODES_FILE_NAME", "host_alias", "join_mpirun", "orted_argv", "main"]

AGENT_MODULE = "mlxcluster.runtime.mpi_agent"
NODES_FILE_NAME = "mpi_nodes.json"
#: ssh's status for "could not run the command there"; mpirun reports the daemon as failed.
EXIT_UNREACHABLE = 255


def host_alias(rank: int) -> str:
    """The hostfile name of rank ``rank``'s machine (``rank >= 1``): ``mlxcluster-rank-R``."""
    return f"mlxcluster-rank-{rank}"


def orted_argv(argv: Sequence[str], orted: Optional[str] = None) -> List[str]:
    """The command a node runs for ``Node.Exec``: ``argv`` split as a POSIX shell
    would split the words ssh passes on, checked to be ``orted`` and its options.

    Args:
        argv: the words after the host name, as the agent received them.
        orted: path of this machine's ``orted`` (default: found on ``PATH``).
    Returns:
        ``[<path of orted>, *options]``.
    Raises:
        ValueError: empty, unbalanced quoting, not ``orted``, or no ``orted`` on
            this machine.  (The words become an argv for ``execve``; no shell runs
            them, so shell syntax in them is inert.)
    """
    try:
        words = shlex.split(" ".join(argv))
    except ValueError as exc:
        raise ValueError(f"cannot split the command: {exc}") from None
    if not words:
        raise ValueError("empty command")
    if words[0] != "orted":
        raise ValueError(f"only OpenMPI's orted may be started, not {words[0][:60]!r}")
    path = orted or shutil.which("orted")
    if not path:
        raise ValueError("OpenMPI's orted is not installed on this node")
    return [path] + words[1:]


def join_mpirun(*, formation_id: str, cluster: str, addresses: Sequence[str], node_ids: Sequence[str],
                node_endpoints: Sequence[str], rank_command: Sequence[str], workdir: str,
                mpirun: str = "mpirun", python: str = sys.executable) -> List[str]:
    """Write the hostfile and the agent's node map into ``workdir``; return mpirun's argv.

    Args:
        formation_id: the formation every node must hold for its ``Exec``.
        cluster: cluster name (part of the agent's node map, informational).
        addresses: data-plane IPv4 address of each rank, rank order.
        node_ids: node id of each rank (the agent insists the node proves it).
        node_endpoints: ``"ip:port"`` of each rank's ``Node`` service.
        rank_command: argv of every rank (the same on all: node-specific settings
            come from each node's environment).
        workdir: existing directory for ``mpi_hostfile`` and ``mpi_nodes.json``.
        mpirun, python: executables on this machine.
    Returns:
        ``list[str]``: ``mpirun --hostfile ... -- <rank_command>``.
    Raises:
        ValueError: lengths differ or fewer than 2 ranks.
        OSError: the files cannot be written.
    """
    n = len(addresses)
    if n < 2 or not len(node_ids) == len(node_endpoints) == n:
        raise ValueError("join_mpirun needs one address, node id and endpoint per rank, at least 2")
    hosts = [addresses[0]] + [host_alias(r) for r in range(1, n)]
    hostfile = os.path.join(workdir, "mpi_hostfile")
    with open(hostfile, "w") as f:
        f.write("".join(f"{h} slots=1\n" for h in hosts))
    nodes = {"formation_id": formation_id, "cluster": cluster,
             "hosts": {host_alias(r): {"node_id": node_ids[r], "endpoint": node_endpoints[r]} for r in range(1, n)}}
    nodes_path = os.path.join(workdir, NODES_FILE_NAME)
    with open(nodes_path, "w") as f:
        json.dump(nodes, f)
    agent = f"{python} -m {AGENT_MODULE} --nodes {nodes_path}"
    argv = [mpirun, "--hostfile", hostfile, "-np", str(n), "--bind-to", "none",
            "--mca", "plm_rsh_agent", agent, "--mca", "plm_rsh_no_tree_spawn", "1",
            "--mca", "orte_leave_session_attached", "1"]
    return argv + ["--", *rank_command]


# -- the agent process ---------------------------------------------------------------------

def _load_nodes(path: str, host: str) -> Tuple[str, str, str, str]:
    with open(path) as f:
        data = json.load(f)
    entry = data["hosts"].get(host)
    if entry is None:
        raise ValueError(f"no node for host {host!r} in {path}")
    return data["formation_id"], data["cluster"], entry["node_id"], entry["endpoint"]


def run_remote(endpoint: str, node_id: str, formation_id: str, words: Sequence[str], creds,
               out=None, err=None) -> int:
    """Call ``Node.Exec`` on ``endpoint`` (which must prove ``node_id``); copy its
    output to ``out``/``err`` (binary files) and return its exit status.

    Raises:
        grpc.RpcError: the node refused the command or could not be reached.
    """
    from ..protocol import mlxcluster_pb2 as pb
    from ..protocol import mlxcluster_pb2_grpc as pb_grpc
    from ..security import node_name

    out = out or sys.stdout.buffer
    err = err or sys.stderr.buffer
    channel = creds.channel(endpoint, node_name(node_id))
    try:
        for event in pb_grpc.NodeStub(channel).Exec(pb.ExecRequest(formation_id=formation_id, argv=list(words))):
            kind = event.WhichOneof("event")
            if kind == "stdout":
                out.write(event.stdout)
                out.flush()
            elif kind == "stderr":
                err.write(event.stderr)
                err.flush()
            elif kind == "exit_code":
                return event.exit_code
        return EXIT_UNREACHABLE  # the stream ended without a status
    finally:
        channel.close()


def main(argv: Optional[List[str]] = None, env: Optional[Mapping[str, str]] = None) -> int:
    """``python -m mlxcluster.runtime.mpi_agent --nodes FILE HOST WORD...`` (called by mpirun)."""
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    p = argparse.ArgumentParser(prog="mlxcluster-mpi-agent")
    p.add_argument("--nodes", required=True)
    p.add_argument("host")
    p.add_argument("words", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    import grpc

    from ..config import Config
    from ..security import credentials, describe_rpc_error

    try:
        formation_id, cluster, node_id, endpoint = _load_nodes(args.nodes, args.host)
        cfg = Config.from_env(env)
        creds = credentials(cfg.secret, cluster, seed=cfg.ca_seed if cluster == cfg.cluster else "")
    except (OSError, ValueError, KeyError) as exc:
        print(f"mlxcluster mpi agent: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        return run_remote(endpoint, node_id, formation_id, args.words, creds)
    except grpc.RpcError as exc:
        print(f"mlxcluster mpi agent: node {node_id} at {endpoint}: {describe_rpc_error(exc)}", file=sys.stderr)
        return EXIT_UNREACHABLE


if __name__ == "__main__":
    sys.exit(main())

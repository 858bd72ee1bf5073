"""``join``'s Thunderbolt network step: print the plan, configure this Mac, or warn about its
unaddressed ports (:mod:`mlxcluster.runtime.netplan`)."""

from __future__ import annotations

import json
from typing import Optional

import typer

from .common import _fail


def _thunderbolt_network(dry_run: bool, as_json: bool, recorded: Optional[str], configure: bool) -> None:
    """``join``'s Thunderbolt network step (``runtime/netplan.py``): print the plan and exit 0
    (``--dry-run``), run this host's commands with sudo (``--configure-network``), or, by default on a
    Mac, print the commands its cabled ports without an address need.  Nothing on another system
    without ``--recorded``."""
    import platform
    import socket
    import subprocess

    from ..runtime import netplan

    host = socket.gethostname().split(".")[0]
    if recorded is None and platform.system() != "Darwin":
        if dry_run or configure:
            msg = "no Thunderbolt ports here (not macOS): give Macs' recorded outputs with --recorded DIR"
            if configure:
                raise _fail(msg)
            typer.echo(json.dumps({"hosts": [], "problems": [msg]}) if as_json else msg)
            raise typer.Exit(0)
        return
    try:
        if recorded is not None:
            nodes = netplan.read_recorded(recorded)
        else:
            from ..runtime.doctor import gather, recorded_node

            node = recorded_node(gather(host))
            if node is None:
                raise ValueError("cannot read this Mac's Thunderbolt ports (system_profiler, networksetup)")
            nodes = [node]
        plan = netplan.network_plan(nodes)
    except ValueError as exc:
        raise _fail(str(exc), 2)
    if dry_run:
        typer.echo(json.dumps(plan.to_dict(), indent=2) if as_json else netplan.describe(plan))
        raise typer.Exit(0)
    me = next((n for n in nodes if n.host == host), None)
    try:  # every Mac's outputs: MLX's plan; this Mac alone: each cable's /30 from its two port uuids
        cmds = list(plan.commands.get(host, ())) if recorded is not None else \
            (netplan.local_commands(me) if me is not None else [])
    except ValueError as exc:
        raise _fail(f"--configure-network: {exc}" if configure else str(exc), 2)
    if configure:
        if len(cmds) < (2 if recorded is not None else 1):
            raise _fail(f"--configure-network: {host} has no cabled Thunderbolt port to set up")
        failed = [c for c in cmds if subprocess.run(["sudo"] + c.split(), check=False).returncode != 0]
        if failed:
            raise _fail(f"--configure-network: {len(failed)} command(s) failed, the first: sudo {failed[0]}")
        return
    ports = netplan.unaddressed_ports(me) if me is not None else []
    if ports:
        cmds = [c for c in cmds if any(f" {p} " in c or c.endswith(f" {p}") for p in ports)]
        typer.echo(f"warning: Thunderbolt port(s) {', '.join(ports)} have no IPv4 address (jaccl and the ring's "
                   "direct links need one per cable): " + "; ".join(f"sudo {c}" for c in cmds)
                   + " (or join with --configure-network)", err=True)

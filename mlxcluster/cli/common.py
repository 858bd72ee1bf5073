"""What every ``mlxcluster`` command shares: one-line errors, the command class, logging, the
cluster secret and client credentials, rank 0 of a formed cluster, and local ranks' start-up."""

from __future__ import annotations

import sys
import threading
from typing import List, Optional

import typer
from typer.core import TyperCommand

from ..config import LOG_LEVELS  # one list for --log-level and MLXCLUSTER_LOG


def _fail(message: str, code: int = 1) -> "typer.Exit":
    typer.echo(f"mlxcluster: error: {message}", err=True)
    return typer.Exit(code)


class _Command(TyperCommand):
    """Every ``mlxcluster`` command: once its options are parsed (``--help`` and usage errors come
    first), it reads the ``MLXCLUSTER_*`` settings (:func:`mlxcluster.config.config`) before it does
    anything -- a value a variable does not allow is one line naming the variable and the allowed
    values, exit status 2 -- and a Ctrl-C the command does not handle itself is one line, exit
    status 130 (typer would end it silently)."""

    def invoke(self, ctx):
        from ..config import config

        try:
            config()
        except ValueError as exc:
            raise _fail(str(exc), 2)
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise _fail("interrupted", 130)


def _setup_logging(level: str) -> None:
    """Log to stderr at ``level`` (one of :data:`LOG_LEVELS`, any case); another value is a
    one-line error (exit 2)."""
    import logging

    name = level.upper()
    if name not in LOG_LEVELS:
        raise _fail(f"unknown log level {level!r}: choose one of {', '.join(LOG_LEVELS)}", 2)
    logging.basicConfig(level=getattr(logging, name), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _env_secret() -> str:
    """``MLXCLUSTER_SECRET`` ("": unset)."""
    from ..config import config

    return config().secret or ""


def _read_secret(secret_file: Optional[str], required: bool = True) -> str:
    """The cluster secret from ``--secret-file`` or ``MLXCLUSTER_SECRET``; a problem is a one-line error."""
    from ..config import config
    from ..security import SecretError, read_secret

    try:
        return read_secret(config().secret, secret_file, required=required)
    except SecretError as exc:
        raise _fail(str(exc), 2)


def _client_credentials(cluster: str, secret_file: Optional[str]):
    """TLS credentials of a client of ``cluster`` (:mod:`mlxcluster.security`)."""
    from ..security import CLIENT, credentials

    return credentials(_read_secret(secret_file), cluster, [CLIENT])


def _find_rank0(cluster: str, interface: List[str], creds, view=None):
    """``(address, status)`` of the formed cluster's rank 0 (:func:`~mlxcluster.cluster.client.find_rank0`,
    from ``view`` when given); none found is a one-line error."""
    from ..cluster.client import ClusterLookupError, find_rank0

    try:
        return find_rank0(cluster, creds, interface, view=view)
    except (ClusterLookupError, ValueError, OSError) as exc:
        raise _fail(str(exc))


def _start_local(local) -> None:
    """Start a :class:`LocalCluster` whose ``on_event`` is a :class:`_Progress`;
    a rank that fails to start becomes one error line."""
    from ..runtime.launcher import LaunchError

    try:
        local.start()
    except LaunchError as exc:
        raise _fail(f"a rank failed to start: {exc}")
    finally:
        local.on_event.done()


class _Progress:
    """Shows rank start-up progress on stderr (one line, rewritten in place on a TTY)."""

    def __init__(self, world_size: int, enabled: bool):
        self.world_size = world_size
        self.enabled = enabled
        self.states = {}
        self.lock = threading.Lock()
        self.tty = sys.stderr.isatty()

    def __call__(self, event: dict) -> None:
        if not self.enabled or event.get("rank") is None:
            return
        with self.lock:
            self.states[event["rank"]] = event["event"]
            line = "ranks: " + "  ".join(f"{r}:{self.states.get(r, 'starting')}" for r in range(self.world_size))
            if self.tty:
                sys.stderr.write("\r\033[K" + line)
            else:
                sys.stderr.write(line + "\n")
            sys.stderr.flush()

    def done(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()

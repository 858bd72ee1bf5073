"""``serve``'s process once its options are checked: the serving groups (local ranks or a formed
cluster's rank 0, replaced when one fails), the HTTP API's event loop, and the one-rank prefill or
draft group of ``serve --role prefill|draft``."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, List, Optional

import typer

from .common import _Progress, _client_credentials, _fail, _find_rank0, _start_local

if TYPE_CHECKING:  # pragma: no cover
    from ..runtime.rank_config import RankConfig


#: Restarts of a failed prefill group before `serve --role prefill` gives up.
PREFILL_RESTARTS = 10


def _serve_prefill(info, topology, backend, fmt, host, port, secret, start_timeout, role: str = "prefill",
                   config: Optional["RankConfig"] = None) -> None:
    """``serve --role prefill``: a one-rank group serving ``Generation.Prefill`` on ``host:port``
    (mutual TLS under ``secret``) until SIGINT/SIGTERM.  A group that fails is restarted at the
    same address (decode groups keep their ``--prefill-peer``; their requests in flight fail closed
    or fall back), at most :data:`PREFILL_RESTARTS` times.  ``role`` ``draft`` (``serve --role
    draft``): the same for a group serving ``Generation.Draft`` (target groups keep their
    ``--draft remote:HOST:PORT``; while it restarts they decode plainly).  ``config``: the ranks' other
    settings (a :class:`~mlxcluster.runtime.rank_config.RankConfig`: the KV format)."""
    import signal

    from ..runtime.launcher import LocalCluster

    def _terminate(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    local = None
    try:
        for attempt in range(PREFILL_RESTARTS + 1):
            local = LocalCluster(1, backend, model=info.path, weights=fmt, host=host, rank0_port=port, secret=secret,
                                 topology=topology, on_event=_Progress(1, enabled=attempt == 0),
                                 start_timeout_s=start_timeout, config=config)
            _start_local(local)
            port = int(local.address.rsplit(":", 1)[1])  # a restart keeps the address decode groups use
            typer.echo(f"prefill group serving {os.path.basename(info.path)!r} at {local.address} "
                       f"(decode groups: serve --role decode --prefill-peer {local.address})" if role == "prefill" else
                       f"draft group serving {os.path.basename(info.path)!r} at {local.address} "
                       f"(target groups: --draft remote:{local.address} --secret-file FILE)", err=True)
            sup = local.supervisor  # woken by every rank event and exit; ends on SIGINT/SIGTERM or a failure
            sup.wait_for(lambda: sup.failure is not None, 10 * 365 * 86400.0)
            why = local.failure
            local.stop()
            if attempt == PREFILL_RESTARTS:
                raise _fail(f"the {role} group failed {attempt + 1} times; the last: {why}")
            typer.echo(f"the {role} group failed ({why}); restarting it at {local.address} "
                       f"({attempt + 1} of {PREFILL_RESTARTS})", err=True)
    except KeyboardInterrupt:
        pass
    finally:
        if local is not None:
            local.stop()


def _bind_http(host: str, port: int):
    """The HTTP API's listening socket (:func:`mlxcluster.front.api.bind_socket`); a taken port is a
    one-line error."""
    from ..front.api import bind_socket

    try:
        return bind_socket(host, port)
    except OSError as exc:
        raise _fail(str(exc))


class _LocalGroups:
    """``serve``'s groups of local ranks: the first one started with progress on stderr, each
    replacement (:class:`~mlxcluster.front.healer.Healer`) with fresh ports and, but for a decode or
    remote-drafting group (``secret``: the secret it shares), a fresh secret."""

    def __init__(self, info, topology, backend: str, fmt: str, start_timeout: float, config: "RankConfig",
                 secret: Optional[str]):
        self.info, self.topology, self.backend, self.fmt = info, topology, backend, fmt
        self.start_timeout, self.config, self.secret = start_timeout, config, secret

    def _local(self, on_event=None):
        from ..runtime.launcher import LocalCluster

        return LocalCluster(self.topology.world_size, self.backend, model=self.info.path, weights=self.fmt,
                            start_timeout_s=self.start_timeout, topology=self.topology, config=self.config,
                            secret=self.secret, **({"on_event": on_event} if on_event else {}))

    def first(self, groups: list) -> None:
        """Start the first group, ``groups[0]`` (a placeholder that stops it while it starts)."""
        from ..front.healer import Group, local_group

        local = self._local(_Progress(self.topology.world_size, enabled=True))
        groups.append(Group(None, None, lambda: local.failure, lambda: local.stop(timeout_s=2.0)))
        _start_local(local)
        groups[0] = local_group(local)

    def start_group(self):
        """A replacement group, started."""
        from ..front.healer import local_group

        local = self._local()
        try:
            local.start()
        except BaseException:
            local.stop()
            raise
        return local_group(local)

    def close(self) -> None:
        pass


class _ClusterGroups:
    """``serve --cluster``'s groups: rank 0 of the formed cluster, found over mDNS (one browser,
    :class:`~mlxcluster.cluster.client.ClusterView`, for serve's life), and found again -- another
    formation than the one that failed -- when the cluster re-forms."""

    def __init__(self, cluster: str, interface: List[str], secret_file: Optional[str]):
        from ..cluster.client import ClusterView

        self.cluster, self.interface = cluster, interface
        self.creds = _client_credentials(cluster, secret_file)
        self.formation = ""  # the formation serve talks to
        self.found = None  # moved()'s answer, taken by the next start_group instead of browsing again
        try:
            self.view = ClusterView(cluster, interface)
        except (ValueError, OSError) as exc:
            raise _fail(str(exc))

    def moved(self) -> Optional[str]:
        """Rank 0 missed an Info: did the cluster re-form without it? (a line saying so, else ``None``)"""
        from ..cluster.client import ClusterLookupError, find_rank0

        try:
            found = find_rank0(self.cluster, self.creds, self.interface, timeout_s=1.0,
                               not_formation=self.formation, view=self.view)
        except (ClusterLookupError, ValueError, OSError):
            return None
        self.found = found
        st = found[1]
        return f"the cluster re-formed without rank 0 (formation {st.formation_id}, world size {st.world_size})"

    def first(self, groups: list) -> None:
        from ..front.healer import Group

        address, found = _find_rank0(self.cluster, self.interface, self.creds, self.view)
        self.formation = found.formation_id
        groups.append(Group(address, self.creds, lambda: None, lambda: None, self.moved))

    def start_group(self):
        """The re-formed cluster's rank 0.  Another formation than the one that failed: its rank 0's
        node may report it ready a moment longer (it has not seen its rank die yet), and that rank 0
        is gone."""
        from ..cluster.client import find_rank0
        from ..front.healer import Group

        found, self.found = self.found, None
        address, st = found or find_rank0(self.cluster, self.creds, self.interface, timeout_s=120.0,
                                          not_formation=self.formation, view=self.view)
        self.formation = st.formation_id
        return Group(address, self.creds, lambda: None, lambda: None, self.moved)

    def close(self) -> None:
        self.view.close()


class _ModelGroups:
    """``serve``'s groups of several models (a :class:`_LocalGroups` per model, ``sources``): the default
    model's first group is started with progress on stderr before the HTTP API listens; the others are
    started by the model pool (:class:`~mlxcluster.front.pool.ModelPool`) when a request needs them."""

    def __init__(self, sources: dict, default: str):
        self.sources, self.default = sources, default

    def first(self, groups: list) -> None:
        self.sources[self.default].first(groups)

    def start_group(self, name: str):
        """Model ``name``'s group, started (blocking)."""
        return self.sources[name].start_group()

    def close(self) -> None:
        pass


def _serve_groups(sock, source, serve_http) -> None:
    """Start ``source``'s first group (:class:`_LocalGroups` or :class:`_ClusterGroups`) and run
    ``serve_http(first group, start_group)`` until it returns or SIGINT/SIGTERM (``start_group``'s
    arguments are ``source.start_group``'s: a model's name for :class:`_ModelGroups`); then close ``sock``,
    stop every group started and close ``source``.  Ctrl-C before the first group serves is one line,
    exit status 130."""
    import signal

    def _terminate(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    groups = []  # every group started, stopped at exit (stop is idempotent)

    def start_and_keep(*args):
        groups.append(source.start_group(*args))
        return groups[-1]
    try:
        source.first(groups)
        serve_http(groups[0], start_and_keep)
    except KeyboardInterrupt:
        if not groups or groups[0].address is None:
            raise _fail("interrupted", 130)
    finally:
        sock.close()
        for group in groups:
            group.stop()
        source.close()


def _serve_http(sock, group, start_group, model_path, name, host, log_level, run_link, router,
                router_token, auth=None, tls=None, router_roots=None, failover=None) -> None:
    """Run the provider's HTTP API on ``sock`` until uvicorn is told to exit: one asyncio loop
    (uvicorn, the provider's gRPC calls to rank 0, the router link, the
    :class:`~mlxcluster.front.healer.Healer` that replaces a failed group).  ``auth``: the API
    keys (a :class:`~mlxcluster.front.auth.KeyRing`); ``tls``: (cert, key) files for HTTPS;
    ``router_roots``: the PEM roots the router link trusts (``None``: the system's); ``failover``: the
    provider's ``max_replays`` / ``unavailable_wait_s``."""
    import asyncio
    import logging

    import uvicorn

    from ..front.api import create_app
    from ..front.healer import Healer
    from ..front.provider import Provider, ProviderError

    holder = {}
    try:
        provider = Provider(group.address, model_path, name, group.credentials,
                            failure=lambda: holder["healer"].group.failure() if "healer" in holder else None,
                            **(failover or {}))
    except (ProviderError, ValueError) as exc:
        raise _fail(str(exc))
    config = uvicorn.Config(create_app(provider, auth), log_level=log_level, timeout_graceful_shutdown=5,
                            **(dict(ssl_certfile=tls[0], ssl_keyfile=tls[1]) if tls else {}))
    server = uvicorn.Server(config)
    port = sock.getsockname()[1]
    typer.echo(f"serving {name!r} (world size {provider.world_size}, capacity {provider.capacity}, queue "
               f"{provider.max_queue}, rank 0 at {group.address}) on {'https' if tls else 'http'}://{host}:{port}/v1"
               + (f" (API keys: {', '.join(auth.ids)})" if auth else ""), err=True)
    log = logging.getLogger("mlxcluster.serve")

    async def main() -> None:
        link = None
        healer = holder["healer"] = Healer(provider, group, start_group)
        healing = asyncio.create_task(healer.run())
        if run_link is not None:
            link = asyncio.create_task(run_link(provider, router, router_token, root_certificates=router_roots))

            def _ended(task: "asyncio.Task") -> None:
                if not task.cancelled() and task.exception() is not None:
                    log.error("router link ended: %s", task.exception())
            link.add_done_callback(_ended)
        try:
            await server.serve(sockets=[sock])
        finally:
            healing.cancel()
            if link is not None:
                link.cancel()
            await asyncio.gather(healing, *([link] if link else []), return_exceptions=True)
            await provider.aclose()

    asyncio.run(main())


def _serve_pool_http(sock, group, start_group, models, paths, host, log_level, auth=None, tls=None,
                     failover=None, pool=None) -> None:
    """Serve several models (a :class:`~mlxcluster.front.pool.ModelPool`) on ``sock`` until uvicorn is
    told to exit: one asyncio loop (uvicorn, the providers' gRPC calls, a healer per loaded model, the
    pool's ``keep_alive`` task).  ``group``: the default model's group, started; ``start_group(name)``:
    starts a model's group (blocking); ``models``: the :class:`~mlxcluster.front.pool.PoolModel` entries,
    the default first; ``paths``: each model's reference (its tokenizer is read by its provider);
    ``failover``: each provider's ``max_replays`` / ``unavailable_wait_s`` / ``cache_isolation``;
    ``pool``: the pool's ``budget_bytes`` / ``max_loaded`` / ``keep_alive_s``.  Pinned models are loaded
    once the API listens."""
    import asyncio
    import logging

    import uvicorn

    from ..front.api import create_app
    from ..front.pool import ModelPool
    from ..front.provider import Provider, ProviderError
    from ..front.residency import gib

    failover = dict(failover or {})

    def connect(name, started, failure):
        return Provider(started.address, paths[name], name, started.credentials, failure=failure, **failover)

    default = models[0].name
    try:
        service = ModelPool(models, start_group, connect, unavailable_wait_s=failover.get("unavailable_wait_s", 60.0),
                            **(pool or {}))
    except (ProviderError, ValueError) as exc:
        raise _fail(str(exc))
    config = uvicorn.Config(create_app(service, auth), log_level=log_level, timeout_graceful_shutdown=5,
                            **(dict(ssl_certfile=tls[0], ssl_keyfile=tls[1]) if tls else {}))
    server = uvicorn.Server(config)
    port = sock.getsockname()[1]
    budget = service.budget_bytes
    typer.echo(f"serving {len(models)} models ({', '.join(m.name for m in models)}; {default!r} loaded, the "
               f"default) on {'https' if tls else 'http'}://{host}:{port}/v1: memory budget "
               f"{gib(budget) if budget is not None else 'unbounded'}, "
               f"{f'at most {service.max_loaded} loaded' if service.max_loaded else 'no bound on the models loaded'}, "
               f"keep_alive {service.keep_alive_s:g} s"
               + (f" (API keys: {', '.join(auth.ids)})" if auth else ""), err=True)
    log = logging.getLogger("mlxcluster.serve")

    async def main() -> None:
        try:
            await service.adopt(default, group)
        except (ProviderError, ValueError) as exc:
            raise _fail(str(exc))
        reaper = asyncio.create_task(service.run())
        pinned = [asyncio.create_task(service.preload(m.name)) for m in models[1:] if m.pinned]
        for task in pinned:
            task.add_done_callback(lambda t: t.cancelled() or t.exception() is None
                                   or log.error("preloading a pinned model failed: %s", t.exception()))
        try:
            await server.serve(sockets=[sock])
        finally:
            for task in [reaper, *pinned]:
                task.cancel()
            await asyncio.gather(reaper, *pinned, return_exceptions=True)
            await service.aclose()

    asyncio.run(main())

"""Several models behind one provider: each request dispatched by its ``model`` to that model's own
:class:`~mlxcluster.front.provider.Provider`, models loaded on demand and unloaded by memory, count and
``keep_alive``.

:class:`ModelPool` speaks the provider interface :mod:`mlxcluster.front.api` and
:mod:`mlxcluster.front.dialects` call (``chat_completion``, ``completion``, ``embed``,
``count_chat_tokens``, ``models``, ``check_model``, ``health``, ``load``, ``snapshot``, ...), so every
dialect routes by its model field.  Per registered model (:class:`PoolModel`):

* **Load on demand.**  A request for a model that is not loaded starts its group through the injected
  ``start(name)`` (blocking, run in a thread: ``serve``'s local ranks) and connects a provider to it
  (``connect``), while the request waits -- at most ``unavailable_wait_s``, the deadline a request
  waits for a group that is being replaced (issue 29), then 503 with ``Retry-After`` (the load goes
  on).  Concurrent requests for one model start it once.  A load that fails fails the requests
  waiting for it with one 500 (``model_load_failed``) naming why; the other models keep serving, and
  the next request for it tries again.
* **Room.**  Before a load, :func:`~mlxcluster.front.residency.plan_load` decides which idle models to
  unload (least recently used, unpinned: never one with a request in flight, so a stream never loses
  a token), or that the load waits for busy models to drain, or that it can never fit: a 507
  ``insufficient_memory`` naming the memory (OpenAI's clients raise it as an ``InternalServerError``,
  Ollama's as ``ResponseError`` with ``status_code`` 507; the status says the server cannot hold the
  model, not that the request was malformed).
* **keep_alive** (Ollama's semantics, ``docs/faq.md``): after its last request ends a model stays
  loaded for its ``keep_alive`` (the last request's ``keep_alive`` field, else the model's, else
  the pool's default, 5 minutes), then unloads; ``0`` unloads it as its request ends; negative keeps
  it.  One task (:meth:`ModelPool.run`) unloads expired models.  Pinned models are never evicted and
  never expire (a request's explicit ``keep_alive: 0`` still unloads one, as ``ollama stop`` does).
* **Failover.**  Each loaded model has its own healer (``heal``: a
  :class:`~mlxcluster.front.healer.Healer` by default), which replaces its failed group as for a
  single model; a healer that gives up unloads the model.

Metrics: one registry (:attr:`ModelPool.registry`): the pool's own series
(``mlxcluster_model_loaded``, ``_requests``, ``_loads``, ``_unloads``, ``_load_seconds``,
``_memory_bytes``, each labelled ``model``) and every loaded provider's series with a ``model`` label
added (a model's provider counters restart from 0 when it is loaded again: a Prometheus counter reset).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Sequence, Tuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from .dialects import NEVER_EXPIRES
from .provider import ProviderError
from .residency import (DEFAULT_KEEP_ALIVE_S, NEVER, Refuse, Resident, Wait, expired, next_expiry,
                        parse_keep_alive)

log = logging.getLogger("mlxcluster.serve")

__all__ = ["PoolModel", "ModelPool", "NEVER_EXPIRES"]



@dataclass
class PoolModel:
    """One registered model.

    Attributes:
        name: the id clients pass as ``model``.
        bytes: memory it holds once loaded, all its ranks together (the planner's estimate).
        pinned: never evicted, never expired.
        keep_alive_s: its default ``keep_alive`` in seconds (``None``: the pool's; negative: never).
        vram_bytes: what Ollama's ``/api/ps`` reports as ``size_vram`` (on Apple silicon the weights are
            in unified memory the GPU reads: ``bytes``; on MLX's CPU backend 0).
        details: returns its description for ``/api/tags`` and ``/api/show`` while it is not loaded
            (``architecture``, ``size``, ``format``, ``parameter_size``, ``weight_format``; may read the
            model's files: called off the event loop, once); ``None``: nothing.
    """

    name: str
    bytes: int
    pinned: bool = False
    keep_alive_s: Optional[float] = None
    vram_bytes: int = 0
    details: Optional[Callable[[], Dict[str, Any]]] = None


class _Slot:
    """A model loading, loaded or unloading."""

    def __init__(self, model: PoolModel, keep_alive_s: float, now: float):
        self.model = model
        self.state = "loading"  # -> "ready" -> "stopping"
        self.provider: Any = None
        self.healer: Any = None  # the heal factory's object (.run(), .group)
        self.healing: Optional[asyncio.Task] = None
        self.ready: "asyncio.Future[None]" = asyncio.get_running_loop().create_future()
        self.stopped: "asyncio.Future[None]" = asyncio.get_running_loop().create_future()
        self.in_flight = 0  # requests holding its provider
        self.waiting = 0    # requests waiting for it to load
        self.last_used = now
        self.keep_alive_s = keep_alive_s
        self.expires_at: Optional[float] = None

    def resident(self) -> Resident:
        busy = self.in_flight + self.waiting + (1 if self.state != "ready" else 0)
        return Resident(self.model.name, self.model.bytes, self.last_used, busy, self.model.pinned,
                        self.expires_at if busy == 0 else None)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class _ProviderSeries:
    """A Prometheus collector: every loaded model's provider series, with a ``model`` label added."""

    def __init__(self, pool: "ModelPool"):
        self.pool = pool

    def collect(self):
        merged: Dict[str, Metric] = {}
        for name, provider in self.pool.providers():
            for family in provider.registry.collect():
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                for s in family.samples:
                    out.add_sample(s.name, dict(s.labels, model=name), s.value, s.timestamp, s.exemplar)
        return list(merged.values())


class _Metrics:
    """The pool's own series (see the module docstring)."""

    def __init__(self, registry: CollectorRegistry, models: Sequence[PoolModel]):
        m = "mlxcluster_model_"
        self.loaded = Gauge(m + "loaded", "1 while the model is loaded (serving), else 0.", ["model"], registry=registry)
        self.requests = Counter(m + "requests", "Requests by model, endpoint and HTTP status (499: the client "
                                "went away; model \"\": refused before a model was named).",
                                ["model", "endpoint", "status"], registry=registry)
        self.loads = Counter(m + "loads", "Model loads by result (ok, failed).", ["model", "result"], registry=registry)
        self.unloads = Counter(m + "unloads", "Model unloads by reason (keep_alive: expired or 0, evicted: room for "
                               "another, failed: its group could not be restarted, shutdown).",
                               ["model", "reason"], registry=registry)
        self.load_s = Histogram(m + "load_seconds", "Time to load a model (its group started and serving).",
                                ["model"], registry=registry, buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600))
        self.memory = Gauge(m + "memory_bytes", "The memory a model holds once loaded (the planner's estimate).",
                            ["model"], registry=registry)
        for model in models:
            self.loaded.labels(model.name).set(0)
            self.memory.labels(model.name).set(model.bytes)


def _default_heal(provider, group, restart):
    from .healer import Healer

    return Healer(provider, group, restart)


class ModelPool:
    """Serve several models through one provider interface (see the module docstring).

    Args:
        models: the registered models; the first is the default of requests that name none.
        start: ``start(name) -> group`` (a :class:`~mlxcluster.front.healer.Group`): starts the model's
            group (blocking; run in a thread); raises on failure (its first line is the reason).
        connect: ``connect(name, group, failure) -> provider``: a provider on the started group
            (blocking); ``failure()`` gives one line on why its current group failed.
        budget_bytes: memory the loaded models may hold together (``None``: unbounded).
        max_loaded: models loaded at once (``None``: unbounded).
        keep_alive_s: the default ``keep_alive`` in seconds (negative: never unload).
        unavailable_wait_s: seconds a request waits for its model to load or for room, then 503.
        heal: ``heal(provider, group, restart) -> healer`` with ``await healer.run()`` (watches and
            replaces the group until cancelled, stopping it on the way out) and ``healer.group`` (the
            current group); default :class:`~mlxcluster.front.healer.Healer`.
        clock: monotonic seconds (tests pass a fake one).

    Raises:
        ValueError: no model, a duplicate name, ``max_loaded`` < 1, a negative budget or wait.
    """

    def __init__(self, models: Sequence[PoolModel], start: Callable[[str], Any],
                 connect: Callable[[str, Any, Callable[[], Optional[str]]], Any], *,
                 budget_bytes: Optional[int] = None, max_loaded: Optional[int] = None,
                 keep_alive_s: float = DEFAULT_KEEP_ALIVE_S, unavailable_wait_s: float = 60.0,
                 heal: Callable[[Any, Any, Callable[[], Any]], Any] = _default_heal,
                 clock: Callable[[], float] = time.monotonic):
        names = [m.name for m in models]
        if not names:
            raise ValueError("the pool needs at least one model")
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate model names: {', '.join(sorted({n for n in names if names.count(n) > 1}))}")
        if max_loaded is not None and max_loaded < 1:
            raise ValueError("max_loaded must be at least 1")
        if (budget_bytes is not None and budget_bytes < 0) or not unavailable_wait_s >= 0:
            raise ValueError("budget_bytes and unavailable_wait_s must be at least 0")
        self.registered: Dict[str, PoolModel] = {m.name: m for m in models}
        self.model_name = names[0]
        self._start, self._connect, self._heal = start, connect, heal
        self.budget_bytes, self.max_loaded = budget_bytes, max_loaded
        self.keep_alive_s = float(keep_alive_s)
        self.unavailable_wait_s = float(unavailable_wait_s)
        self._clock = clock
        self._slots: Dict[str, _Slot] = {}
        self._changed = asyncio.Event()
        self._tasks: set = set()  # loads and unloads in the background (kept referenced)
        self._details: Dict[str, Dict[str, Any]] = {}  # catalog()'s descriptions of models not loaded
        self.registry = CollectorRegistry()
        self.metrics = _Metrics(self.registry, models)
        self.registry.register(_ProviderSeries(self))

    # -- the registry ------------------------------------------------------------------
    @property
    def models(self) -> List[str]:
        """Every registered model's name, the default first."""
        return list(self.registered)

    def check_model(self, model: Any) -> None:
        """Raises ProviderError (404 ``model_not_found``, param ``model``) unless ``model`` is registered."""
        if model not in self.registered:
            raise ProviderError(404, f"The model {model!r} does not exist (available: {', '.join(self.models)})",
                                "invalid_request_error", "model", "model_not_found")

    def _name_of(self, body: Dict[str, Any]) -> str:
        model = body.get("model")
        if model is None:
            return self.model_name
        self.check_model(model)
        return model

    def providers(self) -> List[Tuple[str, Any]]:
        """``[(name, provider)]`` of the models loaded now (serving, or unloading)."""
        return [(n, s.provider) for n, s in self._slots.items() if s.provider is not None]

    def loaded_names(self) -> List[str]:
        """The models loaded now and serving."""
        return [n for n, s in self._slots.items() if s.state == "ready"]

    # -- load, hold, release --------------------------------------------------------------
    def _notify(self) -> None:
        """Wake everything waiting for a change (a load, an unload, a request's end)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _spawn(self, coro) -> "asyncio.Task":
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _until(self, awaitable, deadline: float, why: str) -> None:
        """Await ``awaitable`` until ``deadline`` (:attr:`_clock` seconds).

        Raises:
            ProviderError: 503 with ``Retry-After`` past the deadline."""
        left = deadline - self._clock()
        try:
            if left <= 0:
                raise asyncio.TimeoutError
            await asyncio.wait_for(awaitable, left)
        except asyncio.TimeoutError:
            raise ProviderError(503, f"{why}; not served within {self.unavailable_wait_s:g} s", "server_error",
                                code="service_unavailable", retry_after=5) from None

    async def _acquire(self, name: str, keep_alive: Optional[float]) -> _Slot:
        """Hold model ``name``'s loaded slot for one request (loading it, making room, waiting: see the
        module docstring); :meth:`_release` gives it back.

        Raises:
            ProviderError: 507 it can never fit; 500 its load failed; 503 not loaded within the wait."""
        deadline = self._clock() + self.unavailable_wait_s
        while True:
            slot = self._slots.get(name)
            if slot is not None and slot.state == "ready":
                slot.in_flight += 1
                slot.last_used, slot.expires_at = self._clock(), None
                if keep_alive is not None:
                    slot.keep_alive_s = keep_alive
                return slot
            if slot is not None:  # loading or unloading: wait for it, then look again
                slot.waiting += 1
                try:
                    await self._until(asyncio.shield(slot.ready if slot.state == "loading" else slot.stopped),
                                      deadline, f"model {name!r} is still {slot.state}")
                finally:
                    slot.waiting -= 1
                continue
            decision = self._plan(name)
            if isinstance(decision, Refuse):
                raise ProviderError(507, decision.why, "server_error", "model", "insufficient_memory")
            if isinstance(decision, Wait):
                await self._until(self._changed.wait(), deadline, decision.why)
                continue
            self._load(name, [self._unload(n, "evicted") for n in decision.evict])

    def _plan(self, name: str):
        from .residency import plan_load

        model = self.registered[name]
        return plan_load([s.resident() for s in self._slots.values()], name, model.bytes, self.budget_bytes,
                         self.max_loaded)

    def _release(self, slot: _Slot) -> None:
        """A request on ``slot`` ended: once its model is idle, its ``keep_alive`` starts (0: unload now)."""
        slot.in_flight -= 1
        slot.last_used = self._clock()
        if slot.in_flight == 0 and slot.state == "ready":
            self._idle(slot)
        self._notify()

    def _idle(self, slot: _Slot) -> None:
        ka = slot.keep_alive_s
        if ka == 0:
            self._unload(slot.model.name, "keep_alive")
        elif ka < 0 or slot.model.pinned:
            slot.expires_at = None
        else:
            slot.expires_at = self._clock() + ka

    def _default_keep_alive(self, model: PoolModel) -> float:
        if model.pinned:
            return NEVER
        return model.keep_alive_s if model.keep_alive_s is not None else self.keep_alive_s

    def _load(self, name: str, after: List["asyncio.Future"]) -> _Slot:
        """Start loading ``name`` (after the unloads ``after`` end): a slot in state ``loading`` now."""
        model = self.registered[name]
        slot = _Slot(model, self._default_keep_alive(model), self._clock())
        self._slots[name] = slot
        self._spawn(self._loading(slot, after))
        return slot

    async def _loading(self, slot: _Slot, after: List["asyncio.Future"]) -> None:
        name, t0 = slot.model.name, self._clock()
        try:
            if after:
                await asyncio.gather(*after, return_exceptions=True)
            log.info("loading model %r", name)
            group = await asyncio.to_thread(self._start, name)
            try:
                provider = await asyncio.to_thread(
                    self._connect, name, group, lambda: (slot.healer.group if slot.healer else group).failure())
            except BaseException:
                await asyncio.to_thread(group.stop)
                raise
        except Exception as exc:  # any failure to load: one line, to every request waiting for it
            why = _one_line(exc)
            log.error("model %r could not be loaded: %s", name, why)
            self.metrics.loads.labels(name, "failed").inc()
            if self._slots.get(name) is slot:
                del self._slots[name]
            slot.ready.set_exception(ProviderError(500, f"model {name!r} could not be loaded: {why}", "server_error",
                                                   "model", "model_load_failed"))
            slot.ready.exception()  # retrieved: nobody may be waiting any more
            slot.stopped.set_result(None)
            self._notify()
            return
        self._adopt(slot, group, provider)
        took = self._clock() - t0
        self.metrics.load_s.labels(name).observe(took)
        log.warning("model %r loaded in %.1f s", name, took)

    def _adopt(self, slot: _Slot, group, provider) -> None:
        """``slot``'s group serves through ``provider``: watch it, and wake its waiting requests."""
        name = slot.model.name
        slot.provider = provider
        slot.healer = self._heal(provider, group, lambda: self._start(name))
        slot.healing = self._spawn(slot.healer.run())
        slot.healing.add_done_callback(lambda task: self._healer_ended(slot, task))
        slot.state, slot.last_used = "ready", self._clock()
        self.metrics.loads.labels(name, "ok").inc()
        self.metrics.loaded.labels(name).set(1)
        if not slot.ready.done():
            slot.ready.set_result(None)
        if slot.in_flight == 0 and slot.waiting == 0:  # loaded ahead of any request (serve's start)
            self._idle(slot)
        self._notify()

    def _healer_ended(self, slot: _Slot, task: "asyncio.Task") -> None:
        """The healer gave up on ``slot``'s model (its group could not be restarted): unload it, so that
        the next request loads it afresh."""
        if task.cancelled() or slot.state != "ready" or self._slots.get(slot.model.name) is not slot:
            return
        log.error("model %r unloaded: its group failed and could not be restarted", slot.model.name)
        self._unload(slot.model.name, "failed")

    def _unload(self, name: str, reason: str) -> "asyncio.Future":
        """Begin unloading ``name`` (serving, idle or not for reason ``failed``): its slot is ``stopping``
        until its group is stopped.  Returns the future that ends then."""
        slot = self._slots[name]
        slot.state, slot.expires_at = "stopping", None
        self.metrics.loaded.labels(name).set(0)
        self.metrics.unloads.labels(name, reason).inc()
        log.warning("unloading model %r (%s)", name, reason)
        self._spawn(self._stopping(slot))
        return slot.stopped

    async def _stopping(self, slot: _Slot) -> None:
        try:
            if slot.healing is not None:
                slot.healing.cancel()  # the healer stops its current group on the way out
                await asyncio.gather(slot.healing, return_exceptions=True)
            try:
                await slot.provider.aclose()
            except Exception as exc:  # a closing channel only
                log.debug("closing model %r's provider: %s", slot.model.name, exc)
        finally:
            if self._slots.get(slot.model.name) is slot:
                del self._slots[slot.model.name]
            if not slot.stopped.done():
                slot.stopped.set_result(None)
            self._notify()

    async def adopt(self, name: str, group) -> None:
        """Serve ``name`` from its already started ``group`` (``serve`` starts the default model before the
        HTTP API listens), counted loaded; its ``keep_alive`` starts now.

        Raises:
            what ``connect`` raises (the group is left to the caller to stop)."""
        model = self.registered[name]
        slot = _Slot(model, self._default_keep_alive(model), self._clock())
        provider = await asyncio.to_thread(
            self._connect, name, group, lambda: (slot.healer.group if slot.healer else group).failure())
        self._slots[name] = slot
        self._adopt(slot, group, provider)

    async def preload(self, name: str) -> None:
        """Load ``name`` ahead of any request (a pinned model at ``serve``'s start), as a request would.

        Raises:
            ProviderError: as a request for it would be refused."""
        slot = await self._acquire(name, None)
        self._release(slot)

    async def keep(self, model: Any, keep_alive: Any) -> str:
        """Ollama's request without a prompt (``/api/generate`` with an empty ``prompt``): load ``model``
        (the default when ``None``) and apply ``keep_alive`` (``0``: unload it now).  Returns Ollama's
        ``done_reason``: ``"load"`` or ``"unload"``.

        Raises:
            ProviderError: 404 unknown model, 400 a bad ``keep_alive``, or a load's own errors."""
        name = self._name_of({"model": model})
        seconds = self._keep_alive({"keep_alive": keep_alive})
        if seconds == 0:
            slot = self._slots.get(name)
            if slot is not None and slot.state == "loading":
                await self._until(asyncio.shield(slot.ready), self._clock() + self.unavailable_wait_s,
                                  f"model {name!r} is still loading")
                slot = self._slots.get(name)
            if slot is not None and slot.state == "ready":
                slot.keep_alive_s = 0.0
                if slot.in_flight == 0:
                    self._idle(slot)  # else: once its last request ends
            return "unload"
        slot = await self._acquire(name, seconds)
        self._release(slot)
        return "load"

    @staticmethod
    def _keep_alive(body: Dict[str, Any]) -> Optional[float]:
        """The request's ``keep_alive`` in seconds (``None``: not given).

        Raises:
            ProviderError: 400 naming ``keep_alive``."""
        value = body.get("keep_alive")
        if value is None:
            return None
        try:
            return parse_keep_alive(value)
        except ValueError as exc:
            raise ProviderError(400, str(exc), "invalid_request_error", "keep_alive") from None

    async def run(self) -> None:
        """Unload the models whose ``keep_alive`` ran out, until cancelled (one task on ``serve``'s loop)."""
        while True:
            now = self._clock()
            residents = [s.resident() for s in self._slots.values()]
            for name in expired(residents, now):
                self._unload(name, "keep_alive")
            nxt = next_expiry([s.resident() for s in self._slots.values()])
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), None if nxt is None else max(0.0, nxt - self._clock()))
            except asyncio.TimeoutError:
                pass

    async def aclose(self) -> None:
        """Unload every model (their healers stop their groups) and wait for it."""
        stops = [self._unload(n, "shutdown") for n, s in list(self._slots.items()) if s.state == "ready"]
        stops += [s.stopped for s in list(self._slots.values()) if s.state == "stopping"]
        await asyncio.gather(*stops, return_exceptions=True)

    # -- the provider interface -----------------------------------------------------------------
    async def _routed(self, body: Dict[str, Any], call) -> AsyncIterator[Dict[str, Any]]:
        """Yield ``call(provider, body)``'s chunks from the provider of ``body``'s model, held for the
        request (counted per model: :meth:`_counted`)."""
        name = self._name_of(body)
        keep_alive = self._keep_alive(body)
        body = {k: v for k, v in body.items() if k != "keep_alive"}
        slot = await self._acquire(name, keep_alive)
        try:
            gen = call(slot.provider, body)
            try:
                async for chunk in gen:
                    yield chunk
            finally:
                await gen.aclose()
        finally:
            self._release(slot)

    def _label(self, body: Dict[str, Any]) -> str:
        """The ``model`` label of a request's metrics: its registered model, else \"\"."""
        model = body.get("model")
        if model is None:
            return self.model_name
        return model if isinstance(model, str) and model in self.registered else ""

    @contextlib.contextmanager
    def _counting(self, endpoint: str, body: Dict[str, Any]):
        """Count the request of ``body`` done inside, per model by status: 200, a
        :class:`ProviderError`'s status, 500 for any other error, 499 when the consumer stopped early
        (cancelled, or an iterator closed)."""
        status = "499"
        try:
            yield
            status = "200"
        except ProviderError as exc:
            status = str(exc.status)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception:
            status = "500"
            raise
        finally:
            self.metrics.requests.labels(self._label(body), endpoint, status).inc()

    async def _counted(self, endpoint: str, body: Dict[str, Any], gen) -> AsyncIterator[Dict[str, Any]]:
        """Yield ``gen``'s chunks, counting the request (:meth:`_counting`); closing this iterator closes ``gen``."""
        try:
            with self._counting(endpoint, body):
                async for chunk in gen:
                    yield chunk
        finally:
            await gen.aclose()

    #: the router link's continuations are per model digest: a pool is not offered to a router (yet)
    resumes = False

    def chat_completion(self, body: Dict[str, Any]) -> AsyncIterator[Dict[str, Any]]:
        """:meth:`Provider.chat_completion <mlxcluster.front.provider.Provider.chat_completion>` of ``body``'s
        model (loaded first when it is not); errors as there, and as :meth:`_acquire`'s."""
        return self._counted("chat_completions", body, self._routed(
            body, lambda p, b: p.chat_completion(b)))

    def completion(self, body: Dict[str, Any]) -> AsyncIterator[Dict[str, Any]]:
        """:meth:`Provider.completion <mlxcluster.front.provider.Provider.completion>` of ``body``'s model."""
        return self._counted("completions", body, self._routed(body, lambda p, b: p.completion(b)))

    async def _call(self, endpoint: str, body: Dict[str, Any], call):
        """``await call(provider, body)`` on the provider of ``body``'s model, held for the call and counted."""
        with self._counting(endpoint, body):
            slot = await self._acquire(self._name_of(body), self._keep_alive(body))
            try:
                return await call(slot.provider, {k: v for k, v in body.items() if k != "keep_alive"})
            finally:
                self._release(slot)

    async def embed(self, body: Dict[str, Any], *, truncate: bool = False,
                    endpoint: str = "embeddings") -> Dict[str, Any]:
        """:meth:`Provider.embed <mlxcluster.front.provider.Provider.embed>` of ``body``'s model."""
        return await self._call(endpoint, body, lambda p, b: p.embed(b, truncate=truncate, endpoint=endpoint))

    async def count_chat_tokens(self, body: Dict[str, Any]) -> int:
        """:meth:`Provider.count_chat_tokens <mlxcluster.front.provider.Provider.count_chat_tokens>` of
        ``body``'s model (which is loaded for it: its chat template)."""
        return await self._call("count_tokens", body, lambda p, b: p.count_chat_tokens(b))

    def record_request(self, endpoint: str, status: int, error_type: Optional[str] = None) -> None:
        """Count a request refused before it named a model (bad JSON, a wrong key)."""
        self.metrics.requests.labels("", endpoint, str(status)).inc()

    def load(self) -> Dict[str, int]:
        """The loaded models' requests at their rank 0s, summed: ``{queued, running, capacity}``."""
        total = {"queued": 0, "running": 0, "capacity": 0}
        for _name, provider in self.providers():
            for k, v in provider.load().items():
                total[k] = total.get(k, 0) + v
        return total

    @property
    def group_status(self) -> Dict[str, Any]:
        """The default model's group state for ``/health`` (``ok`` while it is not loaded)."""
        slot = self._slots.get(self.model_name)
        if slot is not None and slot.provider is not None:
            return dict(slot.provider.group_status)
        return {"status": "ok", "restarts": 0, "last_failure": None}

    async def health(self) -> Dict[str, Any]:
        """``{"status": "ok", "model": default, "models": [{name, loaded, status, ...}]}``: each loaded
        model's own health (its rank 0's ``Info``), and the others as not loaded.

        Raises:
            ProviderError: 503 when models are loaded and none of them answers."""
        entries, failed = [], []
        for name in self.models:
            slot = self._slots.get(name)
            if slot is None or slot.state != "ready":
                entries.append({"name": name, "loaded": False, "state": slot.state if slot else "unloaded"})
                continue
            try:
                h = await slot.provider.health()
                entries.append({"name": name, "loaded": True, "state": "ready", "status": "ok",
                                "world_size": h.get("world_size"), "queue": h.get("queue")})
            except ProviderError as exc:
                failed.append(f"{name}: {exc.message}")
                entries.append({"name": name, "loaded": True, "state": "ready",
                                "status": slot.provider.group_status.get("status", "unavailable"),
                                "error": exc.message})
        if failed and len(failed) == len(self.loaded_names()):
            raise ProviderError(503, "no loaded model answers: " + "; ".join(failed), "server_error",
                                code="service_unavailable", retry_after=5)
        return {"status": "ok", "model": self.model_name, "models": entries}

    def status(self) -> List[Dict[str, Any]]:
        """Each registered model: ``name``, ``state`` (unloaded, loading, ready, stopping), ``bytes``,
        ``pinned``, ``in_flight``, ``expires_in_s`` (``None``: never, or busy)."""
        now, out = self._clock(), []
        for name, model in self.registered.items():
            slot = self._slots.get(name)
            out.append({"name": name, "state": slot.state if slot else "unloaded", "bytes": model.bytes,
                        "pinned": model.pinned, "in_flight": slot.in_flight if slot else 0,
                        "expires_in_s": round(slot.expires_at - now, 1) if slot and slot.expires_at else None})
        return out

    async def snapshot(self) -> Dict[str, Any]:
        """The dashboard's snapshot: the default model's provider's (else the most recently used
        loaded one's), with ``models`` (:meth:`status`) added."""
        ready = sorted((s for s in self._slots.values() if s.state == "ready"),
                       key=lambda s: (s.model.name != self.model_name, -s.last_used))
        if ready:
            snap = dict(await ready[0].provider.snapshot())
        else:
            snap = {"model": self.model_name, "world_size": 0, "backend": "", "weight_format": "", "ranks": [],
                    "decode_tokens_per_s": 0.0, "ttft_s": None, "tokens_total": 0, "group": self.group_status,
                    "errors": [], "failover": {}, "speculative": None,
                    "queue": {"queued": 0, "running": 0, "capacity": 0}, "time": time.time()}
        snap["models"] = self.status()
        return snap

    def catalog(self) -> List[Tuple[str, Dict[str, Any]]]:
        """``[(name, details)]`` of every registered model (``/api/tags``, ``/api/show``): a loaded
        model's provider's :meth:`~mlxcluster.front.provider.Provider.model_details` (reads files: call
        it off the event loop), else the registered description."""
        out = []
        for name, model in self.registered.items():
            slot = self._slots.get(name)
            if slot is not None and slot.provider is not None:
                out.append((name, slot.provider.model_details()))
                continue
            if name not in self._details:
                self._details[name] = dict(model.details()) if model.details is not None else {}
            out.append((name, dict(self._details[name])))
        return out

    def loaded(self) -> List[Dict[str, Any]]:
        """Ollama's ``/api/ps`` view of the loaded models, most recently used first: ``name``,
        ``details`` (each provider's ``model_details()``: reads files once, so call it off the event
        loop), ``size`` (bytes), ``size_vram``, ``expires_at`` (ISO-8601,
        UTC; :data:`NEVER_EXPIRES` for a model that never expires)."""
        now, wall = self._clock(), time.time()
        out = []
        for slot in sorted(list(self._slots.values()), key=lambda s: -s.last_used):
            if slot.state != "ready":
                continue
            ka = slot.keep_alive_s
            if slot.expires_at is not None:
                at = wall + (slot.expires_at - now)
            elif ka < 0 or slot.model.pinned:
                at = None
            else:  # busy: its keep_alive starts when its requests end
                at = wall + ka
            out.append({"name": slot.model.name, "details": slot.provider.model_details(),
                        "size": slot.model.bytes, "size_vram": slot.model.vram_bytes,
                        "expires_at": NEVER_EXPIRES if at is None else
                        datetime.fromtimestamp(at, timezone.utc).isoformat().replace("+00:00", "Z")})
        return out

"""What the tests share: one polling helper, the TP=1 reference, one rank group at a time, result helpers.

* :func:`until` / :func:`until_async` / :func:`seconds_until`: poll a predicate until it is truthy
  (its value, or the seconds it took, is returned), failing with one line naming what was awaited.
  Never a sleep as synchronisation: a bounded wait on an observable condition.
* :class:`Reference`: the answers of one TP=1 group (``LocalCluster(1)``, float32) started once per
  session on first use, each request run once and remembered.  Every answer is prefilled from
  scratch: a request that could take a prefix another request left in the group's prefix cache
  restarts the group first, and one that took a cached prefix anyway is rerun on a fresh group.
* :class:`Groups`: one running rank group at a time, reused by consecutive checks of the same
  topology (a different topology, or :meth:`Groups.evict` after a check that breaks the group,
  stops it).
* :func:`answers` / :func:`token_ids`: the requests most topology checks compare with TP=1
  (:data:`GREEDY`, :data:`SEEDED`, :data:`LONG`) and their token ids.
* :func:`serve_app`: an ASGI app under uvicorn on a free loopback port, in a thread (its URL).
* :func:`cli`: ``mlxcluster ARGS`` in this process (typer's runner), with the ``returncode``,
  ``stdout`` and ``stderr`` a subprocess would give: for checks that end before anything starts.
* :func:`interrupted_decode`: one sequence decoding with lookahead on a ``RankEngine``, optionally
  interrupted by other sequences' prefills (each withdraws its queued lookahead step).

conftest.py exposes them as fixtures: ``tp1_reference`` (session), ``groups`` (module), and the plain
shared groups ``tp1_group`` / ``tp3_group`` (one each per session, for modules that never break them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from mlxcluster.engine.decode import RankEngine
from mlxcluster.engine.passes import PREFILL_CHUNK_TOKENS
from mlxcluster.engine.sampling import Sampling

PROMPT = "The capital of France is"
#: ``PREFILL_CHUNK_TOKENS + 88`` ids: a prompt of two prefill chunks
LONG_IDS = [(i * 37) % 40000 + 100 for i in range(PREFILL_CHUNK_TOKENS + 88)]
GREEDY = dict(prompt=PROMPT, max_tokens=16)
SEEDED = dict(prompt=PROMPT, max_tokens=16, temperature=0.8, top_p=0.95, seed=11)
LONG = dict(prompt_ids=LONG_IDS, max_tokens=6)
#: greedy, seeded sampling, and a prompt of two prefill chunks
STANDARD = (GREEDY, SEEDED, LONG)


def cli(*args, env=None):
    """``mlxcluster ARGS`` in this process (typer's runner), ``env`` set for the call: for the checks
    that end before any rank, node or server starts, without a Python start and the heavy imports
    per call.  Like ``subprocess.run`` (``capture_output=True, text=True``), it returns ``returncode``, ``stdout`` and ``stderr``; an
    exception that would have been a traceback in a process is one here too (``Traceback`` in
    ``stderr``)."""
    import logging
    import signal
    import traceback
    from types import SimpleNamespace

    from typer.testing import CliRunner

    from mlxcluster.cli import app
    from mlxcluster.config import config

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    root = logging.getLogger()
    level, root_handlers = root.level, list(root.handlers)
    config.cache_clear()  # the settings are read from this call's environment, as a new process would
    try:
        result = CliRunner().invoke(app, list(args), env=env)
    finally:
        config.cache_clear()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        root.setLevel(level)
        root.handlers[:] = root_handlers
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "Traceback (most recent call last):\n" + "".join(traceback.format_exception(result.exception))
    return SimpleNamespace(returncode=result.exit_code, stdout=result.stdout, stderr=stderr)


def assert_one_line_error(proc, *needles):
    """``proc`` (a :func:`cli` or ``subprocess.run`` result) failed with exactly one ``mlxcluster: error:``
    line, containing every one of ``needles``, and no traceback."""
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    errors = [l for l in proc.stderr.splitlines() if l.startswith("mlxcluster: error:")]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def descendants(pid: int) -> List[int]:
    """Pids of every process below ``pid`` (children, grandchildren ...; ``[]`` when it is gone)."""
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _timed_out(timeout_s: float, what) -> AssertionError:
    return AssertionError(f"timed out after {timeout_s} s waiting for {what() if callable(what) else what}")


def until(pred: Callable[[], Any], timeout_s: float = 10.0, what: Any = "condition", interval_s: float = 0.05):
    """Poll ``pred`` every ``interval_s`` until it returns a truthy value, and return that value.

    ``what`` names the condition in the failure (a callable: called then, e.g. to show the state
    that was last seen).

    Raises:
        AssertionError: ``pred`` stayed falsy for ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _timed_out(timeout_s, what)
        time.sleep(interval_s)


async def until_async(pred: Callable[[], Any], timeout_s: float = 5.0, what: Any = "condition",
                      interval_s: float = 0.02):
    """:func:`until` inside an event loop (``asyncio.sleep`` between polls)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _timed_out(timeout_s, what)
        await asyncio.sleep(interval_s)


def seconds_until(pred: Callable[[], Any], timeout_s: float, what: Any = "condition",
                  interval_s: float = 0.05) -> float:
    """:func:`until`, returning the seconds it took (for checks that bound the time)."""
    t0 = time.monotonic()
    until(pred, timeout_s, what, interval_s)
    return time.monotonic() - t0


def answers(address: str, creds, requests: Iterable[dict] = STANDARD, timeout_s: float = 300):
    """The :class:`~mlxcluster.leader.generation.GenerationResult` of each request (``generate``'s
    keyword arguments), run one after another on the group at ``address``."""
    from mlxcluster.leader.generation import GenerationClient

    client = GenerationClient(address, creds, timeout_s=timeout_s)
    try:
        return [client.generate(**r) for r in requests]
    finally:
        client.close()


def token_ids(results) -> List[List[int]]:
    """The token ids of each result."""
    return [list(r.token_ids) for r in results]


def _key(request: dict) -> str:
    return json.dumps(request, sort_keys=True)


class Reference:
    """TP=1 answers (one ``LocalCluster(1)`` of ``model``, started on first use), each request run once.

    Every answer is prefilled from scratch, as a module's own fresh TP=1 group would: a request
    whose ``prompt_ids`` share :data:`~mlxcluster.engine.prefix_cache.PREFIX_MIN_TOKENS` or more leading
    ids with an earlier prompt, or a chat request after another chat request (the template's
    system prompt), restarts the group first; a request that took a cached prefix anyway
    (``cached_prompt_tokens``) is rerun on a fresh group.
    """

    def __init__(self, model: str, weights: str = "float32"):
        self.model, self.weights = model, weights
        self._memo: Dict[str, Any] = {}
        self._group = None
        self._sent: List[Tuple[Tuple[int, ...], bool]] = []  # (prompt ids or (), chat) since the group started
        self.starts = 0

    def _fresh(self):
        from mlxcluster.runtime.launcher import LocalCluster

        self.close()
        self._group = LocalCluster(1, model=self.model, weights=self.weights).start()
        self._sent = []
        self.starts += 1

    def _could_share_a_prefix(self, request: dict) -> bool:
        from mlxcluster.engine.prefix_cache import PREFIX_MIN_TOKENS

        ids = tuple(request.get("prompt_ids", ()))
        chat = bool(request.get("chat"))
        for sent_ids, sent_chat in self._sent:
            if chat and sent_chat:
                return True
            n = min(len(ids), len(sent_ids))
            if n >= PREFIX_MIN_TOKENS and ids[:PREFIX_MIN_TOKENS] == sent_ids[:PREFIX_MIN_TOKENS]:
                return True
        return False

    def _run(self, request: dict):
        if self._group is None or self._group.failure or self._could_share_a_prefix(request):
            self._fresh()
        self._sent.append((tuple(request.get("prompt_ids", ())), bool(request.get("chat"))))
        (result,) = answers(self._group.address, self._group.credentials, [request])
        return result

    def generate(self, **request):
        """TP=1's :class:`~mlxcluster.leader.generation.GenerationResult` of ``request``."""
        key = _key(request)
        if key not in self._memo:
            result = self._run(request)
            if result.cached_prompt_tokens:
                self._fresh()
                result = self._run(request)
                assert not result.cached_prompt_tokens, "a fresh TP=1 group answered from its prefix cache"
            self._memo[key] = result
        return self._memo[key]

    def results(self, requests: Iterable[dict] = STANDARD) -> list:
        """TP=1's result of each request."""
        return [self.generate(**r) for r in requests]

    def tokens(self, requests: Iterable[dict] = STANDARD) -> List[List[int]]:
        """TP=1's token ids of each request."""
        return token_ids(self.results(requests))

    def close(self) -> None:
        if self._group is not None:
            self._group.stop()
            self._group = None


class Groups:
    """One running rank group at a time (``LocalCluster``), reused by consecutive checks of one topology.

    :meth:`get` returns the running group when it was started with the same arguments, else stops
    it and starts the one asked for.  A check that breaks its group (kills a rank, injects a fault)
    calls :meth:`evict` (or uses its own ``LocalCluster``).  A group that reports a failure is never
    handed out again.
    """

    def __init__(self, model: str):
        self.model = model
        self._key: Optional[str] = None
        self._group = None
        self.starts = 0

    def get(self, world_size: int, backend: str = "ring", weights: str = "float32", **kwargs):
        """The running ``LocalCluster(world_size, backend, model, weights, **kwargs)`` (``config=``: the
        ranks' :class:`~mlxcluster.runtime.rank_config.RankConfig`)."""
        from mlxcluster.runtime.launcher import LocalCluster

        kwargs.setdefault("start_timeout_s", 300)
        key = _key(dict(world_size=world_size, backend=backend, weights=weights,
                        **{k: repr(v) for k, v in kwargs.items()}))
        return self.hold(key, lambda: LocalCluster(world_size, backend, model=self.model, weights=weights,
                                                   **kwargs).start())

    def hold(self, key: str, start: Callable[[], Any]):
        """The running thing of ``key``, else (the previous one stopped) ``start()``'s: anything with
        ``stop()`` and ``failure`` (``None`` while it is sound), e.g. two groups that work together."""
        if self._group is not None and (key != self._key or self._group.failure):
            self.evict()
        if self._group is None:
            self._group = start()
            self._key = key
            self.starts += 1
        return self._group

    def evict(self) -> None:
        """Stop the running group (the next :meth:`get` starts a fresh one)."""
        if self._group is not None:
            group, self._group, self._key = self._group, None, None
            group.stop()

    close = evict


# -- stepPlan frames with one part (in-process follower tests) ---------------------------------
def join_plan(uid: str, token_ids: Sequence[int], max_tokens: int, route: str = "", epoch: str = "", **kwargs):
    """A ``stepPlan`` frame whose one part is a join (``frames.prompt_tokens(uid, ...)``; ``kwargs``:
    its sampling and source)."""
    from mlxcluster.protocol import frames as fr

    return fr.step_plan(joins=[fr.prompt_tokens(uid, token_ids, max_tokens, **kwargs)], route=route, epoch=epoch)


def decode_plan(*entry) -> Any:
    """A ``stepPlan`` frame whose one part is a decode step: ``decode_plan(uid, position, token)``
    for a lone sequence, or ``decode_plan([(uid, position, token), ...])``."""
    from mlxcluster.protocol import frames as fr

    return fr.step_plan(decode=entry[0] if len(entry) == 1 else [entry])


def leave_plan(uid: str, reason: Optional[int] = None, detail: str = "") -> Any:
    """A ``stepPlan`` frame whose one part is the leave of ``uid`` (default reason ``EOS``)."""
    from mlxcluster.protocol import frames as fr
    from mlxcluster.protocol import mlxcluster_pb2 as pb

    return fr.step_plan(leaves=[fr.session_stop(uid, pb.EOS if reason is None else reason, detail)])


def chunk_plan(uid: str, position: int, count: int) -> Any:
    """A ``stepPlan`` frame whose one part is a prefill chunk."""
    from mlxcluster.protocol import frames as fr

    return fr.step_plan(chunks=[fr.prefill_chunk(uid, position, count)])


def one_reply(follower, frame) -> Any:
    """Run ``frame`` on ``follower`` (``Follower.handle_frame``): its one reply, or ``None`` when it
    made none (a plan without leaves or K/V joins that ran)."""
    replies = follower.handle_frame(frame)
    assert len(replies) <= 1, replies
    return replies[0] if replies else None


@contextlib.contextmanager
def serving_rank0(rank0, directory, tls) -> Iterator[Tuple[str, str]]:
    """``rank0`` (a ``GenerationServicer``) served as rank 0 over mutual TLS (``tls``) on a loopback port,
    beside a tiny GGUF with a plain chat template written into ``directory`` for the provider's tokenizer:
    yields ``(address, model path)``."""
    from concurrent import futures

    import grpc
    from tinymodel import write_gguf

    from mlxcluster.protocol import mlxcluster_pb2_grpc as pb_grpc

    path = f"{directory}/tiny.gguf"
    write_gguf(path, metadata_overrides={
        "tokenizer.chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_GenerationServicer_to_server(rank0, server)
    port = server.add_secure_port("127.0.0.1:0", tls.server())
    server.start()
    try:
        yield f"127.0.0.1:{port}", path
    finally:
        server.stop(None)


@contextlib.contextmanager
def front_before(rank0, directory, tls) -> Iterator[Any]:
    """The real provider and app (in-process, every dialect mounted; ``fastapi.testclient.TestClient``)
    before ``rank0`` served by :func:`serving_rank0`."""
    from fastapi.testclient import TestClient

    from mlxcluster.front import Provider, create_app

    with serving_rank0(rank0, directory, tls) as (address, path):
        with TestClient(create_app(Provider(address, path, "tiny", tls))) as client:
            yield client


@contextlib.contextmanager
def serve_app(app, on_startup: Optional[Callable[[], Any]] = None, **config) -> Iterator[str]:
    """Serve ``app`` with uvicorn in a daemon thread on a loopback port it binds itself
    (``127.0.0.1:0``); yields the URL (``https`` when ``config`` has ``ssl_certfile``) once the
    server listens, and stops it (``should_exit``, joined) on exit.

    ``on_startup`` runs on the server's event loop once it listens, before the URL is yielded
    (e.g. ``lambda: asyncio.create_task(...)`` for a task beside the app); what it returns is kept
    until the server stops.  ``config``: more ``uvicorn.Config`` options (``log_level`` "warning"
    and ``timeout_graceful_shutdown`` 2 unless given)."""
    import uvicorn

    ready = threading.Event()

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            self.started_hook = on_startup() if on_startup is not None else None
            ready.set()

    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", 0))
        server = _Server(uvicorn.Config(app, **{"log_level": "warning", "timeout_graceful_shutdown": 2, **config}))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        try:
            assert ready.wait(30) and server.started, "uvicorn did not start"
            scheme = "https" if config.get("ssl_certfile") else "http"
            yield f"{scheme}://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            server.should_exit = True
            thread.join(timeout=10)
    finally:
        sock.close()


def interrupted_decode(model, prompt: Sequence[int], sampling: Sampling, interrupt: bool,
                       other: Sequence[int] = (7, 7, 8), steps: int = 15, at: Sequence[int] = (3, 8)) -> List[int]:
    """Sequence ``"a"`` (``prompt``, ``sampling``, 40 tokens at most) on a fresh ``RankEngine(model,
    512)``: its first token and ``steps`` steps with lookahead; with ``interrupt``, after the steps
    ``at`` another sequence (``other``, default sampling) is prefilled, which withdraws a's queued
    step, and removed.  Its tokens, to compare with the lone run's."""
    eng = RankEngine(model, 512)
    out = [eng.prefill("a", list(prompt), sampling, [], 40)]
    for i in range(steps):
        out += eng.step(lookahead=True)
        if interrupt and i in at:
            eng.prefill(f"b{i}", list(other), Sampling(), [], 40)  # withdraws a's queued step
            eng.remove(f"b{i}")
    eng.withdraw()
    return out


class InProcessRank:
    """A rank N in process, as a :class:`~mlxcluster.control.link.RankGroup` member: every plan goes
    to a real :class:`~mlxcluster.control.follower.Follower` on the MLX thread (``executor``), whose
    replies (a refusal included: the group then fails) go back to rank 0's ``group``; :attr:`frames`
    keeps a copy of each frame sent."""

    def __init__(self, follower, group, executor):
        self.rank, self.follower, self.group, self.executor = 1, follower, group, executor
        self.frames: list = []

    def send(self, frame):
        from mlxcluster.protocol import mlxcluster_pb2 as pb

        copy = pb.Frame()
        copy.CopyFrom(frame)
        self.frames.append(copy)

        def handle():  # the copy: rank 0 may reuse its frame object before the MLX thread gets here
            for reply in self.follower.handle_frame(copy):
                self.group.deliver(reply)

        self.executor.submit(handle)

    def close(self):
        pass

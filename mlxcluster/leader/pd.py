"""Prefill/decode disaggregation over gRPC: the prefill group's ``Generation.Prefill`` service and
the decode ranks' side of it.

**Prefill group** (``--role prefill``, its rank 0; a group of one rank): :class:`PrefillService`.
Every rank of a decode group subscribes to the same request uid with its own KV heads
(``PrefillRequest.subscriber`` of ``subscribers``); when all have subscribed, the job joins the
prefill group's ONE admission queue (a bounded FIFO, ``RESOURCE_EXHAUSTED`` when full) and runs
on the MLX thread (:func:`mlxcluster.engine.pd.prefill_stream`), whose frames go to each
subscriber's stream as they are produced.  A job whose subscribers do not all arrive within
``join_timeout_s`` is dropped with ``DEADLINE_EXCEEDED``.

**Decode ranks**: :func:`fetch_kv` (rank N, blocking, on its MLX thread) and
:func:`fetch_kv_async` (rank 0, on its event loop) open the subscription and feed a
:class:`~mlxcluster.engine.pd.KvStream` until ``DECODE``; both raise
:class:`~mlxcluster.engine.pd.PdError` with one line for any failure (the prefill peer lost or
unreachable included).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import grpc

from ..failpoints import fail_point
from ..protocol import mlxcluster_pb2 as pb
from ..protocol import mlxcluster_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

__all__ = ["PrefillService", "fetch_kv", "fetch_kv_async", "PdFetch"]

_END = object()
# KV frames are up to FRAME_BYTES (1 MiB) each: raise gRPC's 4 MiB default with room to spare
GRPC_OPTIONS = [("grpc.max_receive_message_length", 16 << 20), ("grpc.max_send_message_length", 16 << 20)]


@dataclass
class _Job:
    uid: str
    token_ids: List[int]
    sampling: pb.Sampling
    subscribers: int
    heads: Dict[int, Tuple[int, int]] = field(default_factory=dict)
    queues: Dict[int, "asyncio.Queue"] = field(default_factory=dict)
    complete: Optional[asyncio.Event] = None


class PrefillService:
    """The prefill group's side (see the module docstring).

    Args:
        model: rank 0's whole model (a group of one rank).
        executor: the one MLX thread.
        vocab_size, context_length: request limits (tokens).
        identity: ``identity(n_heads) -> ModelIdentity`` of this group's K/V.
        n_kv_heads: the model's KV heads.
        max_queue: jobs allowed to wait for the MLX thread.
        join_timeout_s: how long a job waits for all its subscribers.
    """

    def __init__(self, model, executor, vocab_size: int, context_length: int, identity, n_kv_heads: int,
                 max_queue: int = 64, join_timeout_s: float = 30.0):
        self.model = model
        self.executor = executor
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.identity = identity
        self.n_kv_heads = n_kv_heads
        self.max_queue = max_queue
        self.join_timeout_s = join_timeout_s
        self._jobs: Dict[str, _Job] = {}
        self._queue: Optional[asyncio.Queue] = None
        self._worker: Optional[asyncio.Task] = None

    def _check(self, r: pb.PrefillRequest) -> Optional[str]:
        ids = list(r.token_ids)
        if not r.uid:
            return "a Prefill request needs a uid"
        if not ids:
            return "empty prompt: at least one token is needed"
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return f"token {bad} outside the vocabulary [0, {self.vocab_size})"
        if len(ids) >= self.context_length:
            return f"prompt of {len(ids)} tokens does not fit the context of {self.context_length}"
        if not 0 <= r.subscriber < r.subscribers:
            return f"subscriber {r.subscriber} of {r.subscribers}"
        if r.n_heads < 1 or r.head0 + r.n_heads > self.n_kv_heads:
            return f"KV heads [{r.head0}, {r.head0 + r.n_heads}) outside the model's {self.n_kv_heads}"
        return None

    async def Prefill(self, request: pb.PrefillRequest, context):
        """The ``Generation.Prefill`` handler: yields this subscriber's ``KvFrame`` stream."""
        error = self._check(request)
        if error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        job = self._jobs.get(request.uid)
        if job is None:
            job = self._jobs[request.uid] = _Job(request.uid, list(request.token_ids), request.sampling,
                                                 request.subscribers, complete=asyncio.Event())
        elif (job.token_ids != list(request.token_ids) or job.subscribers != request.subscribers
              or job.sampling != request.sampling or request.subscriber in job.queues):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request {request.uid}: subscriber {request.subscriber} disagrees with the others "
                                f"(prompt, sampling or group size) or subscribed twice")
        q: asyncio.Queue = asyncio.Queue()
        job.queues[request.subscriber] = q
        job.heads[request.subscriber] = (request.head0, request.n_heads)
        if len(job.queues) == job.subscribers:
            self._enqueue(job)
            if job.uid in self._jobs:
                job.complete.set()
        try:
            await asyncio.wait_for(job.complete.wait(), self.join_timeout_s)
        except asyncio.TimeoutError:
            self._jobs.pop(request.uid, None)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"request {request.uid}: {len(job.queues)} of {job.subscribers} decode ranks "
                                f"subscribed within {self.join_timeout_s:.0f} s")
        if job.uid not in self._jobs and q.empty():  # refused by the queue
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.max_queue} prefill jobs are already waiting")
        frames = []
        fault = fail_point("pd.send")  # tests: hold the whole stream and send it as the failpoint says
        while True:
            item = await q.get()
            if item is _END:
                break
            if isinstance(item, BaseException):
                await context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {item}")
            if fault:
                frames.append(item)
                if fault == "exit" and len(frames) == 2:  # a prefill group dying mid-stream
                    os._exit(17)
                continue
            yield item
        if fault:
            from ..engine.pd import as_sent

            for f in as_sent(frames):
                yield f

    def _enqueue(self, job: _Job) -> None:
        if self._queue is None:
            self._queue = asyncio.Queue()
        if self._queue.qsize() >= self.max_queue:
            self._jobs.pop(job.uid, None)
            job.complete.set()
            return
        self._queue.put_nowait(job)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._work())

    async def _work(self) -> None:
        """Run queued jobs one at a time on the MLX thread (exits when the queue is empty)."""
        loop = asyncio.get_running_loop()
        while not self._queue.empty():
            job = self._queue.get_nowait()
            try:
                await loop.run_in_executor(self.executor, self._run, job, loop)
                ends = [_END] * len(job.queues)
            except Exception as exc:  # one line to every subscriber
                log.exception("prefill of %s failed", job.uid)
                ends = [exc] * len(job.queues)
            finally:
                self._jobs.pop(job.uid, None)
            for q, end in zip(job.queues.values(), ends):
                q.put_nowait(end)

    def _run(self, job: _Job, loop) -> None:
        from ..engine.pd import prefill_stream
        from ..engine.sampling import make_token_sampler

        order = sorted(job.queues)
        queues = [job.queues[s] for s in order]
        from ..engine.sampling import LogitsProcessor
        from ..engine.sampling import sampling_of

        s = sampling_of(job.sampling)
        sampler = make_token_sampler(s.temperature, s.top_p, s.seed, s.top_k, s.min_p)
        if s.processed:  # the first token: logit_bias and the repetition penalty over the prompt apply
            base, proc = sampler, LogitsProcessor(s, job.token_ids)
            sampler = lambda logits, i: base(proc(logits), i)  # noqa: E731
        prefill_stream(self.model, job.token_ids, sampler, [job.heads[i] for i in order], self.identity,
                       lambda i, f: loop.call_soon_threadsafe(queues[i].put_nowait, f), job.uid)


# -- the decode side ---------------------------------------------------------------------

@dataclass
class PdFetch:
    """One decode rank's stream from the prefill group, in ``DECODE``: the first token, bytes
    received, the wall-clock times of the first frame and of the end of the prefill's compute
    (s since the epoch; one clock when both groups share a host).  :meth:`kv` builds the checked
    K/V -- MLX arrays, so on the MLX thread."""

    stream: object
    first_token: int
    bytes: int
    first_frame_unix: float
    prefill_done_unix: float

    def kv(self) -> dict:
        """``{layer: (keys, values)}`` (see :meth:`mlxcluster.engine.pd.KvStream.result`).

        Raises:
            PdError: the handoff check failed."""
        return self.stream.result()[0]


def _request(uid, token_ids, sampling, subscriber, subscribers, head0, n_heads) -> pb.PrefillRequest:
    return pb.PrefillRequest(uid=uid, token_ids=list(token_ids), sampling=sampling, subscriber=subscriber,
                             subscribers=subscribers, head0=head0, n_heads=n_heads)


def _done(stream) -> PdFetch:
    from ..engine.pd import DECODE, PdError

    if stream.state != DECODE:  # the stream ended early: say so here, off the MLX thread
        total = stream.marker.total_frames if stream.marker is not None else "?"
        raise PdError(f"the prefill group's KV stream for {stream.uid} ended in {stream.state} after "
                      f"{stream.applied} of {total} frames")
    return PdFetch(stream, int(stream.marker.first_token), stream.bytes, stream.first_arrival or 0.0,
                   stream.marker.prefill_done_unix)


def _rpc_error(peer: str, exc: grpc.RpcError):
    from ..engine.pd import PdError

    return PdError(f"prefill group at {peer}: {exc.details() or exc.code()}")


@contextmanager
def _reading(peer: str, call):
    """Around reading ``call``: a gRPC failure raises :class:`PdError`; the call is cancelled however it ends."""
    try:
        yield
    except grpc.RpcError as exc:
        raise _rpc_error(peer, exc) from None
    finally:
        call.cancel()


def _subscribe(channel, want, uid, token_ids, sampling, subscriber, subscribers, head0, n_heads, timeout_s):
    """``(KvStream, call)``: the subscription of one decode rank (``channel`` sync or ``grpc.aio``)."""
    from ..engine.pd import KvStream

    call = pb_grpc.GenerationStub(channel).Prefill(
        _request(uid, token_ids, sampling, subscriber, subscribers, head0, n_heads), timeout=timeout_s)
    return KvStream(uid, want, head0), call


def fetch_kv(channel, peer: str, want, uid: str, token_ids: Sequence[int], sampling: pb.Sampling,
             subscriber: int, subscribers: int, head0: int, n_heads: int, timeout_s: float = 600.0) -> PdFetch:
    """Subscribe to ``uid`` at the prefill group (``channel``, a sync gRPC channel to ``peer``) and
    read this rank's stream until ``DECODE`` (blocking; rank N's MLX thread).

    Raises:
        PdError: the stream failed the checks, ended early, or the peer failed or is unreachable.
    """
    from ..engine.pd import DECODE

    stream, call = _subscribe(channel, want, uid, token_ids, sampling, subscriber, subscribers, head0, n_heads,
                              timeout_s)
    with _reading(peer, call):
        for frame in call:
            if stream.offer(frame) == DECODE:
                break
    return _done(stream)


async def fetch_kv_async(channel, peer: str, want, uid: str, token_ids: Sequence[int], sampling: pb.Sampling,
                         subscriber: int, subscribers: int, head0: int, n_heads: int,
                         timeout_s: float = 600.0) -> PdFetch:
    """:func:`fetch_kv` on an event loop (``channel``: a ``grpc.aio`` channel); rank 0's."""
    from ..engine.pd import DECODE

    stream, call = _subscribe(channel, want, uid, token_ids, sampling, subscriber, subscribers, head0, n_heads,
                              timeout_s)
    with _reading(peer, call):
        async for frame in call:
            if stream.offer(frame, time.time()) == DECODE:
                break
    return _done(stream)


@dataclass
class DecodeSide:
    """What one decode rank needs to fetch its KV from the prefill group.

    Attributes:
        peer: ``host:port`` of the prefill group's rank 0 (its ``Generation`` service).
        credentials: this rank's :class:`~mlxcluster.security.Credentials` (the same cluster secret).
        rank, world_size: this rank in the decode group.
        n_layers: the model's transformer layers.
        identity: this rank's K/V :class:`ModelIdentity` (its own number of KV heads).
        head0: the first KV head this rank holds.

    A refused fetch is never an error of the request: the decode group prefills the prompt itself.
    """

    peer: str
    credentials: object
    rank: int
    world_size: int
    n_layers: int
    identity: pb.ModelIdentity
    head0: int
    _channel: object = None

    def expected(self, token_ids: Sequence[int]):
        from ..engine.handoff import Expected, prompt_hash
        from ..model.layout import LayerRange

        return Expected(self.rank, LayerRange(0, self.n_layers - 1, output=True), len(token_ids),
                        prompt_hash(token_ids), self.identity, "")

    def _args(self, uid, token_ids, sampling):
        return (self.peer, self.expected(token_ids), uid, token_ids, sampling, self.rank, self.world_size,
                self.head0, self.identity.n_kv_heads)

    def fetch(self, uid: str, token_ids: Sequence[int], sampling: pb.Sampling) -> PdFetch:
        """Rank N (blocking): see :func:`fetch_kv`."""
        if self._channel is None:
            self._channel = self.credentials.channel(self.peer, options=GRPC_OPTIONS)
        return fetch_kv(self._channel, *self._args(uid, token_ids, sampling))

    async def fetch_async(self, uid: str, token_ids: Sequence[int], sampling: pb.Sampling) -> PdFetch:
        """Rank 0 (on its event loop): see :func:`fetch_kv_async`."""
        if self._channel is None:
            self._channel = self.credentials.aio_channel(self.peer, options=GRPC_OPTIONS)
        return await fetch_kv_async(self._channel, *self._args(uid, token_ids, sampling))

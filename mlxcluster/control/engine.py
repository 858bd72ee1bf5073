"""Rank 0: the decode loop, driving ranks N with control frames over gRPC."""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Dict, List, Optional, Sequence

import grpc
import mlx.core as mx

from ..engine.session import DecodeBatch, ShardSession, make_token_sampler
from ..protocol import frames as fr
from ..protocol.errors import QueueFullError
from ..protocol import mlxcluster_pb2 as pb
from ..protocol import mlxcluster_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

__all__ = ["RankLink", "TensorParallelEngine", "RankError", "SessionStats", "QueueFullError"]

_CLOSE = object()


class RankError(RuntimeError):
    """A rank N rejected a frame, failed, or became unreachable.

    After it the tensor-parallel group may be stuck inside a collective;
    :attr:`TensorParallelEngine.broken` is set and the group must be restarted.
    """


class RankLink:
    """Rank 0's ordered frame stream to one rank N.

    ``send`` never blocks (frames go on a queue that the gRPC stream drains in
    order); replies arrive on ``replies`` from a reader thread.  A broken
    stream is reported as a synthetic error reply with code ``INTERNAL``.

    Args:
        rank: the peer's rank.
        address: ``host:port`` of its RankControl service.
        connect_timeout_s: how long to wait for the peer to come up.
    Raises:
        RankError: the peer did not answer within ``connect_timeout_s``.
    """

    def __init__(self, rank: int, address: str, replies: "queue.Queue[pb.FrameReply]",
                 connect_timeout_s: float = 60.0):
        self.rank = rank
        self.address = address
        self.replies = replies
        self.channel = grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)])
        try:
            grpc.channel_ready_future(self.channel).result(timeout=connect_timeout_s)
        except grpc.FutureTimeoutError:
            self.channel.close()
            raise RankError(f"rank {rank} at {address} did not answer within {connect_timeout_s:.0f} s") from None
        self.stub = pb_grpc.RankControlStub(self.channel)
        self._outbox: "queue.Queue" = queue.Queue()
        self._closed = False
        self._call = self.stub.Frames(iter(self._outbox.get, _CLOSE))
        self._reader = threading.Thread(target=self._read, name=f"rank{rank}-replies", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for reply in self._call:
                self.replies.put(reply)
            if not self._closed:
                raise RuntimeError("stream ended")
        except Exception as exc:
            if self._closed:
                return
            detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
            self.replies.put(pb.FrameReply(ok=False, code=pb.INTERNAL, rank=self.rank,
                                           error=f"lost rank {self.rank} at {self.address}: {detail}"))

    def send(self, frame: pb.Frame) -> None:
        self._outbox.put(frame)

    def close(self) -> None:
        self._closed = True
        self._outbox.put(_CLOSE)
        self.channel.close()


@dataclass
class SessionStats:
    """Timings of one generation (seconds, tokens/s, bytes)."""

    uid: str
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    reason: int = pb.STOP_REASON_UNSPECIFIED
    peak_memory_bytes_per_rank: List[int] = field(default_factory=list)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.generated_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0



_END = object()


@dataclass
class _Sequence:
    """One request inside the scheduler."""

    uid: str
    prompt: List[int]
    max_tokens: int
    eos: set
    sampler: object
    sampler_args: tuple  # (temperature, top_p, seed) as sent in promptTokens
    stats: SessionStats
    out: "asyncio.Queue"
    generated: int = 0
    last_token: int = -1
    reason: int = 0            # set when finished
    cancelled: bool = False
    session: Optional[ShardSession] = None
    t_start: float = 0.0
    t_first: float = 0.0
    self_sample: bool = False  # ranks N sample this sequence's tokens themselves
    permitted: int = 0         # highest position whose decode step ranks N may run
    greedy: bool = False       # temperature 0
    pending: Optional[mx.array] = None  # pipelined (world size 1): the queued step's lazy token


class TensorParallelEngine:
    """Rank 0 of a tensor-parallel group: continuous-batching generation.

    ``generate()`` calls from any number of concurrent clients enter a FIFO
    queue (at most ``max_queue`` waiting, else :class:`QueueFullError`); a
    scheduler task admits them into the running batch (at most ``max_batch``
    sequences) at step boundaries.  Admission sends ``promptTokens`` to every
    rank N and prefills the sequence on its own; then every step sends
    ``stepToken`` (a lone sequence) or ``batchStep`` (several) and runs one
    decode forward pass of the whole batch, ranks N in lockstep.  Each
    sequence picks its next token from rank 0's logits (greedy, or seeded
    temperature/top-p sampling) and ends with ``sessionStop`` on EOS,
    max_tokens, a full context, an error or cancellation -- always.
    All MLX work runs on ``executor`` (one thread).

    A lone sequence is *self-sampled* when every rank holds the same logits
    (``model.logits_replicated``): ranks N sample its tokens and apply its
    stops themselves, and rank 0's ``stepToken`` for position p, sent just
    before rank 0 runs that step, confirms its token and permits the step at
    p + 1 -- so no rank N waits for a frame on the decode critical path.
    Before admitting a second sequence, or ending on cancellation, rank 0
    runs the one step it has already permitted; the batch then continues
    frame-driven.  A rank N that samples a different token, or ends at a
    different position, answers ``DIVERGED`` and the group is marked broken.

    Args:
        model: rank 0's :class:`~mlxcluster.model.tp.LlamaModelTP` shard.
        links: one :class:`RankLink` per rank N (empty for world size 1).
        vocab_size, context_length: model limits (tokens).
        executor: single-thread executor owning MLX.
        secret: cluster secret put in every frame.
        step_timeout_s: a forward pass longer than this means a stuck group.
        max_batch: sequences decoded together.
        max_queue: requests allowed to wait for a batch slot.
        self_sampling: self-sample lone sequences when the logits allow it
            (False: every step waits for its frame, as in the first protocol).
        pipeline: at world size 1, decode a lone greedy sequence the way
            mlx-lm's ``generate_step`` does: step p + 1 is queued on the lazy
            token of step p before that token is read, overlapping Python
            graph building with evaluation; a queued step past the end is
            rolled back from the KV cache.
        compile_decode: with ``pipeline``, run those steps as one
            ``mx.compile``'d function over static KV buffers
            (:mod:`mlxcluster.engine.compiled`).
    """

    def __init__(self, model, links: Sequence[RankLink], vocab_size: int, context_length: int,
                 executor: ThreadPoolExecutor, replies: Optional["queue.Queue[pb.FrameReply]"] = None,
                 secret: str = "", step_timeout_s: float = 120.0, max_batch: int = 8, max_queue: int = 64,
                 self_sampling: bool = True, pipeline: bool = True, compile_decode: bool = True):
        self.model = model
        self.links = list(links)
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.executor = executor
        self.replies = replies if replies is not None else queue.Queue()
        self.secret = secret
        self.step_timeout_s = step_timeout_s
        self.max_batch = max(1, max_batch)
        self.max_queue = max(0, max_queue)
        self.pipeline = pipeline
        self.compile_decode = compile_decode
        self._compiled = None
        self.self_sampling = (self_sampling and bool(self.links)
                              and bool(getattr(model, "logits_replicated", False)))
        self.broken: Optional[str] = None
        self.last_stats: Optional[SessionStats] = None
        self._acks: Dict[str, Dict[int, pb.FrameReply]] = {}
        self._waiting: "collections.deque[_Sequence]" = collections.deque()
        self._running: List[_Sequence] = []
        self._batch = DecodeBatch(model, compute_logits=True)
        self._wake: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None

    @property
    def world_size(self) -> int:
        return 1 + len(self.links)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    # -- validation ---------------------------------------------------------------
    def validate_prompt(self, prompt_tokens: Sequence[int]) -> None:
        """Raise ``ValueError`` (one line) for a prompt the group cannot run."""
        if len(prompt_tokens) == 0:
            raise ValueError("empty prompt: at least one token is needed")
        for t in prompt_tokens:
            if not 0 <= int(t) < self.vocab_size:
                raise ValueError(f"token {t} outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_tokens) >= self.context_length:
            raise ValueError(f"prompt of {len(prompt_tokens)} tokens is longer than the context "
                             f"({self.context_length} tokens, one kept for the answer)")

    # -- frames -------------------------------------------------------------------
    def _send(self, frame: pb.Frame) -> None:
        for link in self.links:
            link.send(frame)

    def _drain_replies(self) -> None:
        """Take replies off the queue; raise RankError on the first error."""
        while True:
            try:
                reply = self.replies.get_nowait()
            except queue.Empty:
                return
            if not reply.ok:
                self.broken = reply.error or f"rank {reply.rank} failed"
                raise RankError(self.broken)
            if reply.type == fr.SESSION_STOP and reply.uid in self._acks:
                self._acks[reply.uid][reply.rank] = reply
            # acks nobody waits for (cancelled or failed sessions) are dropped

    async def _run(self, fn, *args):
        """Run ``fn`` on the MLX thread, watching for rank errors and timeouts."""
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self.executor, fn, *args)
        deadline = time.monotonic() + self.step_timeout_s
        while True:
            done, _ = await asyncio.wait({fut}, timeout=0.05)
            if done:
                self._drain_replies()
                return fut.result()
            self._drain_replies()
            if time.monotonic() > deadline:
                self.broken = f"a forward pass took over {self.step_timeout_s:.0f} s: the group is stuck"
                raise RankError(self.broken)

    async def _collect_stop_acks(self, uid: str, timeout_s: float = 10.0) -> List[int]:
        """Wait for every rank N's sessionStop ack; return peak memory per rank."""
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                self._drain_replies()
                if len(self._acks.get(uid, {})) >= len(self.links):
                    break
                await asyncio.sleep(0.002)
        finally:
            acks = self._acks.pop(uid, {})
        peaks = [int(mx.get_peak_memory())]
        for link in self.links:
            peaks.append(int(acks[link.rank].peak_memory_bytes) if link.rank in acks else 0)
        return peaks

    # -- scheduler ----------------------------------------------------------------
    def _deliver(self, seq: _Sequence, token: int) -> None:
        """Hand ``token`` to the client and decide whether ``seq`` is finished."""
        seq.generated += 1
        seq.last_token = token
        seq.stats.generated_tokens = seq.generated
        now = time.perf_counter()
        if seq.generated == 1:
            seq.t_first = now
            seq.stats.prefill_s = seq.stats.ttft_s = now - seq.t_start
        else:
            seq.stats.decode_s = now - seq.t_first
        seq.out.put_nowait(token)
        kv_length = seq.session.position - (seq.pending is not None)  # without a queued speculative step
        seq.reason = seq.reason or fr.stop_reason(token, seq.generated, kv_length, seq.eos,
                                                  seq.max_tokens, self.context_length)

    async def _wait_acks(self, uid: str) -> None:
        """Wait (up to ``step_timeout_s``) until every rank N acknowledged the
        sessionStop of ``uid``; the acks stay for :meth:`_collect_stop_acks`.

        Raises:
            RankError: a rank answered with an error (e.g. ``DIVERGED``) or
                did not answer: it may be inside a collective rank 0 skipped.
        """
        deadline = time.monotonic() + self.step_timeout_s
        while len(self._acks.get(uid, {})) < len(self.links):
            self._drain_replies()
            if time.monotonic() > deadline:
                missing = [l.rank for l in self.links if l.rank not in self._acks.get(uid, {})]
                self.broken = (f"rank(s) {missing} did not end self-sampled session {uid} within "
                               f"{self.step_timeout_s:.0f} s: the group is stuck")
                raise RankError(self.broken)
            await asyncio.sleep(0.0005)

    async def _retire(self, seq: _Sequence, reason: int, detail: str = "") -> None:
        """Send sessionStop for ``seq`` and drop it from the batch.

        A self-sampled sequence ended by cancellation first runs the step
        ranks N are already permitted to run (its token is discarded), and
        rank 0 waits for every rank's ack before running anything else."""
        deterministic = seq.reason in (pb.EOS, pb.MAX_TOKENS, pb.CONTEXT_FULL)
        if seq.session is not None and seq.reason != pb.ERROR:
            await self._drop_pending(seq)
        seq.reason = seq.reason or reason
        seq.stats.reason = seq.reason
        if seq in self._running:
            self._running.remove(seq)
        if seq.self_sample and not deterministic and seq.reason != pb.ERROR \
                and seq.session.position <= seq.permitted:
            await self._run(self._batch.step, [seq.last_token])
        if seq.self_sample or (not seq.cancelled and seq.reason != pb.ERROR):
            self._acks.setdefault(seq.uid, {})
        self._send(fr.session_stop(seq.uid, seq.reason, detail, self.secret,
                                   final_position=seq.session.position if seq.session else 0))
        await self._run(self._batch.remove, seq.uid)
        if seq.self_sample and seq.reason != pb.ERROR:
            try:
                await self._wait_acks(seq.uid)
            except RankError as exc:
                seq.out.put_nowait(exc)
                raise
            finally:
                if seq.cancelled:
                    self._acks.pop(seq.uid, None)
        seq.out.put_nowait(_END)

    def _compiled_step(self):
        """The engine's one CompiledGreedyStep (traced once per KV capacity)."""
        if self._compiled is None:
            from ..engine.compiled import CompiledGreedyStep

            self._compiled = CompiledGreedyStep(self.model)
        return self._compiled

    async def _drop_pending(self, seq: _Sequence) -> None:
        """Withdraw a pipelined sequence's speculative step (world size 1)."""
        if seq.pending is not None:
            def drop(seq=seq):
                mx.eval(seq.pending)  # let the queued step finish, then forget its KV entry
                seq.session.rollback(1)
                seq.pending = None
            await self._run(drop)

    async def _leave_self_sampling(self) -> None:
        """Before a second sequence joins: run the step ranks N are already
        permitted to run for the self-sampled sequence (delivering its token
        unless cancelled); the sequence is frame-driven from then on."""
        for seq in self._running:
            if not seq.self_sample:
                continue
            seq.self_sample = False
            if seq.reason or seq.session.position > seq.permitted:
                continue  # a deterministic stop: ranks N stopped too
            def step(seq=seq):
                logits = self._batch.step([seq.last_token])
                return None if seq.cancelled else seq.sampler(logits[0])

            token = await self._run(step)
            if token is not None and not seq.cancelled:
                self._deliver(seq, token)

    async def _admit(self, seq: _Sequence) -> None:
        seq.session = ShardSession(self.model, seq.uid, compute_logits=True)
        seq.self_sample = self.self_sampling and not self._running
        seq.permitted = len(seq.prompt)
        self._send(fr.prompt_tokens(seq.uid, seq.prompt, seq.max_tokens, *seq.sampler_args, self.secret,
                                    self_sample=seq.self_sample, eos_token_ids=seq.eos))
        self._running.append(seq)

        def prefill():
            token = seq.sampler(seq.session.prefill(seq.prompt))
            self._batch.add(seq.session)
            return token

        token = await self._run(prefill)
        self._deliver(seq, token)

    async def _schedule(self) -> None:
        """The decode loop: runs while there is work, then exits."""
        try:
            while self._waiting or self._running:
                # 1. retire finished or cancelled sequences
                for seq in list(self._running):
                    if seq.cancelled:
                        await self._retire(seq, pb.CANCELLED, "client went away")
                    elif seq.reason:
                        await self._retire(seq, seq.reason)
                # 2. admit waiting requests into free batch slots
                while self._waiting and len(self._running) < self.max_batch:
                    seq = self._waiting.popleft()
                    if seq.cancelled:
                        seq.stats.reason = pb.CANCELLED
                        seq.out.put_nowait(_END)
                        continue
                    await self._leave_self_sampling()
                    for other in self._running:
                        await self._drop_pending(other)
                    await self._admit(seq)
                    if seq.reason or seq.cancelled:
                        await self._retire(seq, seq.reason or pb.CANCELLED)
                # 3. one decode step of the whole batch
                active = [s for s in self._running if not s.reason and not s.cancelled]
                if len(active) != len(self._running) or not active:
                    continue
                entries = [(s.uid, s.session.position, s.last_token) for s in active]
                if len(active) == 1 and not self.links and active[0].greedy and self.pipeline:
                    # one rank, one greedy sequence: mlx-lm's pipelining (queue the
                    # next step on the lazy token before reading it)
                    def pipelined(seq=active[0]):
                        if self.compile_decode and seq.session.compiled is None:
                            seq.session.compiled = self._compiled_step()
                        if seq.pending is None:
                            seq.pending = seq.session.issue_greedy(seq.last_token)
                        queued = seq.session.issue_greedy(seq.pending)
                        token = int(seq.pending.item())
                        seq.pending = queued
                        return token

                    self._deliver(active[0], await self._run(pipelined))
                    continue
                if len(active) == 1 and active[0].self_sample:
                    self._send(fr.step_token(*entries[0], self.secret))  # confirm t_p, permit step p + 1
                    active[0].permitted = active[0].session.position + 1
                elif len(active) == 1:
                    self._send(fr.step_token(*entries[0], self.secret))
                else:
                    self._send(fr.batch_step(entries, self.secret))

                def step(tokens=[e[2] for e in entries], seqs=active):
                    logits = self._batch.step(tokens)
                    return [s.sampler(logits[i]) for i, s in enumerate(seqs)]

                for seq, token in zip(active, await self._run(step)):
                    self._deliver(seq, token)
        except asyncio.CancelledError:
            # The event loop is going away: cancel everything in flight, in
            # frame order, without awaiting (the MLX thread applies it later).
            for seq in self._running:
                seq.cancelled = True
                seq.stats.reason = pb.CANCELLED
                self._send(fr.session_stop(seq.uid, pb.CANCELLED, "engine loop stopped", self.secret))
                self.executor.submit(self._batch.remove, seq.uid)
                seq.out.put_nowait(_END)
            for seq in self._waiting:
                seq.stats.reason = pb.CANCELLED
                seq.out.put_nowait(_END)
            self._running.clear()
            self._waiting.clear()
            raise
        except Exception as exc:
            if not isinstance(exc, RankError):
                log.exception("scheduler failed")
                self.broken = self.broken or f"{type(exc).__name__}: {exc}"
            error = exc if isinstance(exc, RankError) else RankError(self.broken)
            for seq in self._running + list(self._waiting):
                seq.stats.reason = pb.ERROR
                self._send(fr.session_stop(seq.uid, pb.ERROR, str(error)[:200], self.secret))
                seq.out.put_nowait(error)
            self._running.clear()
            self._waiting.clear()
        finally:
            self._task = None

    # -- generation ---------------------------------------------------------------
    async def generate(self, prompt_tokens: Sequence[int], max_tokens: int,
                       eos_token_ids: Sequence[int] = (), *, uid: Optional[str] = None,
                       temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                       stats: Optional[SessionStats] = None) -> AsyncIterator[int]:
        """Generate up to ``max_tokens`` token ids after ``prompt_tokens``.

        Yields int token ids as they are decided; stops after an id in
        ``eos_token_ids`` (which is yielded), after ``max_tokens``, or when the
        KV cache reaches the context length.  ``stats`` (and
        :attr:`last_stats`) receive the request's :class:`SessionStats` once the
        iterator finishes.  Closing the iterator early cancels the request and
        frees its KV cache on every rank.

        Raises:
            ValueError: empty prompt, token outside the vocabulary, prompt not
                shorter than the context, ``max_tokens < 1``.
            QueueFullError: ``max_queue`` requests are already waiting.
            RankError: a rank N rejected a frame, failed or was lost, or a
                forward pass exceeded ``step_timeout_s``.
        """
        if self.broken:
            raise RankError(f"the tensor-parallel group is broken: {self.broken}")
        self.validate_prompt(prompt_tokens)
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if len(self._waiting) >= self.max_queue and len(self._running) >= self.max_batch:
            raise QueueFullError(f"{len(self._waiting)} requests are already waiting; retry later")
        uid = uid or uuid.uuid4().hex[:16]
        stats = stats if stats is not None else SessionStats(uid=uid)
        stats.uid, stats.prompt_tokens = uid, len(prompt_tokens)
        seq = _Sequence(uid=uid, prompt=[int(t) for t in prompt_tokens], max_tokens=max_tokens,
                        eos=set(int(t) for t in eos_token_ids),
                        sampler=make_token_sampler(temperature, top_p, seed),
                        sampler_args=(temperature, top_p, seed), stats=stats, greedy=temperature <= 0,
                        out=asyncio.Queue(), t_start=time.perf_counter())
        self._waiting.append(seq)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._schedule())
        finished = False
        try:
            while True:
                item = await seq.out.get()
                if item is _END:
                    finished = True
                    break
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
        finally:
            if not finished:
                seq.cancelled = True
                stats.reason = pb.CANCELLED
            self.last_stats = stats
        if stats.reason != pb.CANCELLED and not self.broken:
            stats.peak_memory_bytes_per_rank = await self._collect_stop_acks(uid)
        self.last_stats = stats

    def close(self) -> None:
        for link in self.links:
            link.close()

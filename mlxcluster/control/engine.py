"""Rank 0: the decode loop, driving ranks N with control frames over gRPC."""

from __future__ import annotations

import asyncio
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

from ..model.session import ShardSession, make_token_sampler
from . import frames as fr
from . import mlxcluster_pb2 as pb
from . import mlxcluster_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

__all__ = ["RankLink", "TensorParallelEngine", "RankError", "SessionStats"]

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


class TensorParallelEngine:
    """Rank 0 of a tensor-parallel group: greedy (or seeded sampled) generation.

    For each session it sends ``promptTokens`` to every rank N and prefills
    its own shard, then loops: pick the next token from rank 0's logits, yield
    it, send ``stepToken`` and run the decode step; at the end it always sends
    ``sessionStop`` (on EOS, max_tokens, error and cancellation alike).
    Sessions run one at a time (an ``asyncio.Lock``).  All MLX work runs on
    ``executor`` (one thread), so this object can be driven from any event loop.

    Args:
        model: rank 0's :class:`~mlxcluster.model.tp.LlamaModelTP` shard.
        links: one :class:`RankLink` per rank N (empty for world size 1).
        vocab_size, context_length: model limits (tokens).
        executor: single-thread executor owning MLX.
        secret: cluster secret put in every frame.
        step_timeout_s: a forward pass longer than this means a stuck group.
    """

    def __init__(self, model, links: Sequence[RankLink], vocab_size: int, context_length: int,
                 executor: ThreadPoolExecutor, replies: Optional["queue.Queue[pb.FrameReply]"] = None,
                 secret: str = "", step_timeout_s: float = 120.0):
        self.model = model
        self.links = list(links)
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.executor = executor
        self.replies = replies if replies is not None else queue.Queue()
        self.secret = secret
        self.step_timeout_s = step_timeout_s
        self.broken: Optional[str] = None
        self.last_stats: Optional[SessionStats] = None
        self._lock: Optional[asyncio.Lock] = None
        self._acks: Dict[str, Dict[int, pb.FrameReply]] = {}
        self._current_uid: Optional[str] = None

    @property
    def world_size(self) -> int:
        return 1 + len(self.links)

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
            if reply.type == fr.SESSION_STOP and reply.uid == self._current_uid:
                self._acks.setdefault(reply.uid, {})[reply.rank] = reply
            # acks of earlier (cancelled or failed) sessions are dropped

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
        while len(self._acks.get(uid, {})) < len(self.links) and time.monotonic() < deadline:
            self._drain_replies()
            if len(self._acks.get(uid, {})) >= len(self.links):
                break
            await asyncio.sleep(0.005)
        acks = self._acks.pop(uid, {})
        peaks = [int(mx.get_peak_memory())]
        for link in self.links:
            peaks.append(int(acks[link.rank].peak_memory_bytes) if link.rank in acks else 0)
        return peaks

    # -- generation ---------------------------------------------------------------
    async def generate(self, prompt_tokens: Sequence[int], max_tokens: int,
                       eos_token_ids: Sequence[int] = (), *, uid: Optional[str] = None,
                       temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                       ) -> AsyncIterator[int]:
        """Generate up to ``max_tokens`` token ids after ``prompt_tokens``.

        Yields int token ids as they are decided; stops after an id in
        ``eos_token_ids`` (which is yielded), after ``max_tokens``, or when the
        KV cache reaches the context length.  :attr:`last_stats` holds the
        session's :class:`SessionStats` once the iterator finishes.

        Raises:
            ValueError: empty prompt, token outside the vocabulary, prompt not
                shorter than the context, ``max_tokens < 1``.
            RankError: a rank N rejected a frame, failed or was lost, or a
                forward pass exceeded ``step_timeout_s``.
        """
        if self.broken:
            raise RankError(f"the tensor-parallel group is broken: {self.broken}")
        self.validate_prompt(prompt_tokens)
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self._lock is None:
            self._lock = asyncio.Lock()
        eos = set(int(t) for t in eos_token_ids)
        uid = uid or uuid.uuid4().hex[:16]
        prompt = [int(t) for t in prompt_tokens]
        stats = SessionStats(uid=uid, prompt_tokens=len(prompt))
        async with self._lock:
            self._drain_replies()
            self._acks.clear()
            self._current_uid = uid
            sample = make_token_sampler(temperature, top_p, seed)
            session = ShardSession(self.model, uid, compute_logits=True)
            reason = pb.ERROR
            detail = ""
            t0 = time.perf_counter()
            try:
                self._send(fr.prompt_tokens(uid, prompt, max_tokens, temperature, top_p, seed, self.secret))
                token = await self._run(lambda: sample(session.prefill(prompt)))
                stats.prefill_s = stats.ttft_s = time.perf_counter() - t0
                t_decode = time.perf_counter()
                while True:
                    stats.generated_tokens += 1
                    yield token
                    if token in eos:
                        reason = pb.EOS
                        break
                    if stats.generated_tokens >= max_tokens:
                        reason = pb.MAX_TOKENS
                        break
                    if session.position + 1 >= self.context_length:
                        reason = pb.CONTEXT_FULL
                        break
                    self._send(fr.step_token(uid, session.position, token, self.secret))
                    token = await self._run(lambda t=token: sample(session.step(t)))
                    stats.decode_s = time.perf_counter() - t_decode
            except (asyncio.CancelledError, GeneratorExit):
                reason, detail = pb.CANCELLED, "client went away"
                raise
            except BaseException as exc:
                reason, detail = pb.ERROR, str(exc)[:200]
                raise
            finally:
                stats.reason = reason
                self._send(fr.session_stop(uid, reason, detail, self.secret))
                self.executor.submit(session.close)
                self.last_stats = stats
            if not self.broken:
                stats.peak_memory_bytes_per_rank = await self._collect_stop_acks(uid)

    def close(self) -> None:
        for link in self.links:
            link.close()

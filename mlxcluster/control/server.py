"""Ranks N: run this rank's shard in lockstep with rank 0, driven by control frames."""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, Optional

import mlx.core as mx

from ..engine.session import DecodeBatch, ShardSession, make_token_sampler
from ..protocol import frames as fr
from ..protocol import mlxcluster_pb2 as pb
from ..protocol import mlxcluster_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

__all__ = ["TensorParallelServer", "RankControlServicer"]


@dataclass
class SelfSampling:
    """Decode state of a self-sampled session on a rank N (see the proto).

    ``token`` is this rank's own sample at ``session.position`` (the next
    decode input); ``permitted`` the highest position whose step rank 0 has
    allowed; ``stopped`` a deterministic stop (EOS, max_tokens, full
    context) reached at ``session.position``; ``own`` this rank's samples
    awaiting rank 0's confirmation, by position.
    """

    sampler: Callable
    eos: frozenset
    max_tokens: int
    permitted: int
    token: int = -1
    generated: int = 0
    stopped: bool = False
    own: Dict[int, int] = field(default_factory=dict)


class TensorParallelServer:
    """Frame handler of a rank N (rank >= 1).

    ``promptTokens`` prefills a new sequence and adds it to this rank's
    :class:`~mlxcluster.engine.session.DecodeBatch`, ``stepToken`` runs one
    decode step of a lone sequence, ``batchStep`` one decode step of every
    resident sequence (continuous batching), ``sessionStop`` frees a
    sequence.  A *self-sampled* lone sequence (``promptTokens.self_sample``)
    decodes on its own tokens instead: :meth:`ready_step` says when a
    permitted step can run, :meth:`run_ready_step` runs it, and its
    ``stepToken`` frames only confirm rank 0's tokens and permit the next
    step, so this rank never waits for a frame while rank 0 decodes.  Any
    other frame first runs the permitted steps, then turns the sequence
    frame-driven (rank 0 does the same before admitting a second sequence).
    Without vocabulary-parallel logits the forward passes stop
    after the final norm (the logits of ranks N are never used).  A frame that
    fails validation -- wrong secret, unknown session uid, a position other
    than the KV cache length, a token outside ``[0, vocab_size)``, a sequence
    longer than ``context_length`` -- is answered with an error reply and runs
    nothing, so no collective is entered for it.

    Args:
        model: this rank's :class:`~mlxcluster.model.tp.LlamaModelTP` shard.
        rank: this rank (>= 1 in a real group; 0 is allowed for tests).
        vocab_size: number of token ids.
        context_length: maximum tokens in the KV cache.
        secret: cluster secret frames must carry ("" = none).
    """

    def __init__(self, model, rank: int, vocab_size: int, context_length: int, secret: str = ""):
        self.model = model
        self.rank = rank
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.secret = secret
        self.batch = DecodeBatch(model, compute_logits=False)
        self.frames_handled = 0

    @property
    def session(self) -> Optional[ShardSession]:
        """The resident sequence when exactly one is resident, else ``None``."""
        return self.batch.sessions[0] if len(self.batch) == 1 else None

    def _reject(self, frame, code, message) -> pb.FrameReply:
        log.warning("rank %d rejected %s: %s", self.rank, fr.describe(frame), message)
        target = self.batch.find(frame.uid) or self.session
        return fr.error_reply(frame, self.rank, code, message, target.position if target else 0)

    def _bad_tokens(self, ids) -> Optional[int]:
        for t in ids:
            if t < 0 or t >= self.vocab_size:
                return t
        return None

    def _check_entry(self, uid: str, position: int, token: int, session: ShardSession):
        """``(code, message)`` if a step entry is invalid, else ``None``."""
        if position != session.position:
            return pb.OUT_OF_ORDER, (f"step for {uid!r} at position {position} but the KV cache holds "
                                     f"{session.position} tokens")
        if not 0 <= token < self.vocab_size:
            return pb.BAD_TOKEN, f"token {token} outside the vocabulary [0, {self.vocab_size})"
        if position >= self.context_length:
            return pb.CONTEXT_OVERFLOW, f"position {position} beyond the context of {self.context_length}"
        return None

    # -- self-sampling --------------------------------------------------------------
    def _sample_own(self, session: ShardSession, logits: mx.array) -> None:
        """Sample this rank's token at ``session.position`` and apply rank 0's
        stop rule (:func:`~mlxcluster.protocol.frames.stop_reason`)."""
        auto = session.auto
        token = auto.sampler(logits)
        auto.generated += 1
        auto.token = token
        auto.own[session.position] = token
        auto.stopped = bool(fr.stop_reason(token, auto.generated, session.position, auto.eos,
                                           auto.max_tokens, self.context_length))

    def _self_sampled(self) -> Optional[ShardSession]:
        s = self.session
        return s if s is not None and s.auto is not None else None

    def ready_step(self) -> bool:
        """True when a self-sampled sequence has a permitted decode step to run."""
        s = self._self_sampled()
        return s is not None and not s.auto.stopped and s.position <= s.auto.permitted

    def run_ready_step(self) -> None:
        """Run one permitted decode step of the self-sampled sequence on this
        rank's own token (precondition: :meth:`ready_step`)."""
        s = self._self_sampled()
        log.debug("rank %d self-sampled step of %s at position %d on token %d (permitted through %d)",
                  self.rank, s.uid, s.position, s.auto.token, s.auto.permitted)
        try:
            logits = self.batch.step([s.auto.token])
            self._sample_own(s, logits[0])
        except Exception:
            s.auto.stopped = True  # never retry a failed step
            raise

    def _catch_up(self, limit: Optional[int] = None) -> None:
        """Run every permitted step of the self-sampled sequence (up to KV
        length ``limit``)."""
        while self.ready_step():
            if limit is not None and self.session.position >= limit:
                return
            self.run_ready_step()

    def _end_self_sampling(self) -> None:
        """Run the permitted steps, then make the sequence frame-driven."""
        s = self._self_sampled()
        if s is not None:
            self._catch_up()
            s.auto = None

    def _confirm(self, frame: pb.Frame, session: ShardSession) -> Optional[pb.FrameReply]:
        """stepToken of a self-sampled session: check rank 0's token, permit the next step."""
        auto, st = session.auto, frame.step_token
        own = auto.own.get(st.position)
        if own is None or own != st.token or (auto.stopped and st.position >= session.position):
            mine = "none" if own is None else str(own)
            if own is not None and auto.stopped and own == st.token:
                mine += " (a stop for this rank)"
            return self._reject(frame, pb.DIVERGED,
                                f"rank {self.rank} diverged from rank 0 at position {st.position}: rank 0 "
                                f"sampled {st.token}, this rank {mine}")
        for p in [p for p in auto.own if p <= st.position]:
            del auto.own[p]
        auto.permitted = max(auto.permitted, st.position + 1)
        return None

    def handle_frame(self, frame: pb.Frame) -> Optional[pb.FrameReply]:
        """Validate and execute one frame.

        Returns an error :class:`FrameReply` for a rejected frame, an ok reply
        for ``sessionStop`` (carrying this rank's peak memory), else ``None``.
        Never raises for bad frames.
        """
        self.frames_handled += 1
        if log.isEnabledFor(logging.DEBUG):  # describe() is not free: keep it off the hot path
            log.debug("rank %d frame %s", self.rank, fr.describe(frame))
        if self.secret and not fr.secrets_match(frame.secret, self.secret):
            return self._reject(frame, pb.UNAUTHENTICATED, "frame rejected: wrong cluster secret")
        which = frame.WhichOneof("payload")
        if frame.type == fr.PROMPT_TOKENS and which == "prompt_tokens":
            ids = list(frame.prompt_tokens.token_ids)
            if not frame.uid:
                return self._reject(frame, pb.BAD_FRAME, "promptTokens without a session uid")
            if not ids:
                return self._reject(frame, pb.BAD_FRAME, "promptTokens with no tokens")
            bad = self._bad_tokens(ids)
            if bad is not None:
                return self._reject(frame, pb.BAD_TOKEN, f"token {bad} outside the vocabulary [0, {self.vocab_size})")
            if len(ids) >= self.context_length:
                return self._reject(frame, pb.CONTEXT_OVERFLOW,
                                    f"prompt of {len(ids)} tokens does not fit the context of {self.context_length}")
            if self.batch.find(frame.uid) is not None:
                return self._reject(frame, pb.BAD_FRAME, f"session {frame.uid!r} is already resident")
            pt = frame.prompt_tokens
            if pt.self_sample:
                if len(self.batch) and self._self_sampled() is None:
                    return self._reject(frame, pb.BAD_FRAME,
                                        "self-sampled promptTokens while other sequences are resident")
                if not getattr(self.model, "logits_replicated", False):
                    return self._reject(frame, pb.BAD_FRAME,
                                        "self-sampling needs the same logits on every rank "
                                        "(a vocabulary-parallel head)")
                if pt.max_tokens < 1:
                    return self._reject(frame, pb.BAD_FRAME, "self-sampled promptTokens with max_tokens 0")
            self._end_self_sampling()
            session = ShardSession(self.model, frame.uid, compute_logits=bool(pt.self_sample))
            logits = session.prefill(ids)
            if pt.self_sample:
                sampling = pt.sampling
                session.auto = SelfSampling(
                    sampler=make_token_sampler(sampling.temperature, sampling.top_p, sampling.seed),
                    eos=frozenset(pt.eos_token_ids), max_tokens=pt.max_tokens, permitted=len(ids))
                self._sample_own(session, logits)
            self.batch.add(session)
            return None
        if frame.type == fr.STEP_TOKEN and which == "step_token":
            st = frame.step_token
            session = self.batch.find(frame.uid)
            if session is None:
                return self._reject(frame, pb.UNKNOWN_SESSION, f"stepToken for unknown session {frame.uid!r}")
            if len(self.batch) != 1:
                return self._reject(frame, pb.BAD_FRAME,
                                    f"stepToken with {len(self.batch)} resident sequences: use batchStep")
            if session.auto is not None:
                return self._confirm(frame, session)
            error = self._check_entry(frame.uid, st.position, st.token, session)
            if error:
                return self._reject(frame, *error)
            self.batch.step([st.token])
            return None
        if frame.type == fr.BATCH_STEP and which == "batch_step":
            self._end_self_sampling()
            entries = list(frame.batch_step.entries)
            if [e.uid for e in entries] != self.batch.uids:
                return self._reject(frame, pb.UNKNOWN_SESSION,
                                    f"batchStep for sequences {[e.uid for e in entries]} but this rank holds {self.batch.uids}")
            for e, session in zip(entries, self.batch.sessions):
                error = self._check_entry(e.uid, e.position, e.token, session)
                if error:
                    return self._reject(frame, *error)
            self.batch.step([e.token for e in entries])
            return None
        if frame.type == fr.SESSION_STOP and which == "session_stop":
            session = self.batch.find(frame.uid)
            if session is None:
                return self._reject(frame, pb.UNKNOWN_SESSION, f"sessionStop for unknown session {frame.uid!r}")
            final = frame.session_stop.final_position
            diverged = None
            if session.auto is not None:
                self._catch_up(limit=final)
                if final and session.position != final:
                    diverged = (f"rank {self.rank} diverged from rank 0 on session {frame.uid!r}: it ended at "
                                f"position {session.position}, rank 0 at {final}")
            else:
                self._end_self_sampling()  # another sequence's permitted steps come first
            position = session.position
            self.batch.remove(frame.uid)
            if diverged:
                return self._reject(frame, pb.DIVERGED, diverged)
            return pb.FrameReply(uid=frame.uid, type=frame.type, ok=True, rank=self.rank,
                                 peak_memory_bytes=mx.get_peak_memory(), position=position)
        return self._reject(frame, pb.BAD_FRAME, f"unknown or malformed frame type 0x{frame.type:02X}")


_END = object()


class RankControlServicer(pb_grpc.RankControlServicer):
    """gRPC face of a :class:`TensorParallelServer`.

    Only one ``Frames`` stream (rank 0's) is served at a time; a second
    concurrent stream is refused with ``FAILED_PRECONDITION`` so that no
    stranger's frames interleave with rank 0's.  All MLX work runs on the
    single ``executor`` thread: one worker loop per stream handles frames in
    arrival order and, between frames, runs the permitted decode steps of a
    self-sampled sequence without waiting for any frame.
    """

    def __init__(self, server: TensorParallelServer, executor: ThreadPoolExecutor,
                 world_size: int, model_name: str = ""):
        self.server = server
        self.executor = executor
        self.world_size = world_size
        self.model_name = model_name
        self._stream_lock = threading.Lock()

    def _internal(self, frame: Optional[pb.Frame], exc: Exception) -> pb.FrameReply:
        rank = self.server.rank
        what = fr.describe(frame) if frame is not None else "a self-sampled decode step"
        log.exception("rank %d failed on %s", rank, what)
        uid = frame.uid if frame is not None else (self.server.session.uid if self.server.session else "")
        base = frame if frame is not None else pb.Frame(type=fr.STEP_TOKEN, uid=uid)
        return fr.error_reply(base, rank, pb.INTERNAL, f"rank {rank}: {type(exc).__name__}: {exc}")

    def _process(self, frame, inbox: "queue.Queue", replies: "queue.Queue") -> bool:
        """Handle ``frame`` and every frame already queued behind it, running
        permitted self-sampled steps whenever no frame is waiting; return
        (releasing the MLX thread) when there is nothing left to do.  Runs on
        the MLX thread.  Returns True once the stream has ended."""
        server = self.server
        while True:
            if frame is _END:
                return True
            if frame is not None:
                try:
                    reply = server.handle_frame(frame)
                except Exception as exc:  # a bug or MLX failure: report it, keep serving
                    reply = self._internal(frame, exc)
                if reply is not None:
                    replies.put(reply)
            try:
                frame = inbox.get_nowait()
                continue
            except queue.Empty:
                frame = None
            if not server.ready_step():
                return False
            try:
                server.run_ready_step()
            except Exception as exc:
                replies.put(self._internal(None, exc))

    def Frames(self, request_iterator: Iterator[pb.Frame], context) -> Iterator[pb.FrameReply]:
        import grpc

        if not self._stream_lock.acquire(blocking=False):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "another controller stream is active")
        try:
            inbox: "queue.Queue" = queue.Queue()
            replies: "queue.Queue" = queue.Queue()

            def read() -> None:
                try:
                    for frame in request_iterator:
                        inbox.put(frame)
                except Exception:  # the stream broke: rank 0 is gone
                    pass
                finally:
                    inbox.put(_END)

            def dispatch() -> None:
                try:
                    while not self.executor.submit(self._process, inbox.get(), inbox, replies).result():
                        pass
                except Exception as exc:  # executor shut down
                    log.debug("rank %d frame dispatcher stopped: %s", self.server.rank, exc)
                finally:
                    replies.put(_END)

            threading.Thread(target=read, name="frames-reader", daemon=True).start()
            threading.Thread(target=dispatch, name="frames-dispatch", daemon=True).start()
            while True:
                reply = replies.get()
                if reply is _END:
                    break
                yield reply
        finally:
            self._stream_lock.release()

    def Health(self, request, context) -> pb.HealthReply:
        state = "busy" if len(self.server.batch) else "ready"
        return pb.HealthReply(rank=self.server.rank, world_size=self.world_size, state=state,
                              model=self.model_name)

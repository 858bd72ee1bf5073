"""Ranks N: run this rank's shard in lockstep with rank 0, driven by control frames."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Optional

import mlx.core as mx

from ..model.session import DecodeBatch, ShardSession
from . import frames as fr
from . import mlxcluster_pb2 as pb
from . import mlxcluster_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

__all__ = ["TensorParallelServer", "RankControlServicer"]


class TensorParallelServer:
    """Frame handler of a rank N (rank >= 1).

    ``promptTokens`` prefills a new sequence and adds it to this rank's
    :class:`~mlxcluster.model.session.DecodeBatch`, ``stepToken`` runs one
    decode step of a lone sequence, ``batchStep`` one decode step of every
    resident sequence (continuous batching), ``sessionStop`` frees a
    sequence.  The forward passes stop
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

    def handle_frame(self, frame: pb.Frame) -> Optional[pb.FrameReply]:
        """Validate and execute one frame.

        Returns an error :class:`FrameReply` for a rejected frame, an ok reply
        for ``sessionStop`` (carrying this rank's peak memory), else ``None``.
        Never raises for bad frames.
        """
        self.frames_handled += 1
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
            session = ShardSession(self.model, frame.uid, compute_logits=False)
            session.prefill(ids)
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
            error = self._check_entry(frame.uid, st.position, st.token, session)
            if error:
                return self._reject(frame, *error)
            self.batch.step([st.token])
            return None
        if frame.type == fr.BATCH_STEP and which == "batch_step":
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
            position = session.position
            self.batch.remove(frame.uid)
            return pb.FrameReply(uid=frame.uid, type=frame.type, ok=True, rank=self.rank,
                                 peak_memory_bytes=mx.get_peak_memory(), position=position)
        return self._reject(frame, pb.BAD_FRAME, f"unknown or malformed frame type 0x{frame.type:02X}")


class RankControlServicer(pb_grpc.RankControlServicer):
    """gRPC face of a :class:`TensorParallelServer`.

    Only one ``Frames`` stream (rank 0's) is served at a time; a second
    concurrent stream is refused with ``FAILED_PRECONDITION`` so that no
    stranger's frames interleave with rank 0's.  All MLX work runs on the
    single ``executor`` thread, in arrival order.
    """

    def __init__(self, server: TensorParallelServer, executor: ThreadPoolExecutor,
                 world_size: int, model_name: str = ""):
        self.server = server
        self.executor = executor
        self.world_size = world_size
        self.model_name = model_name
        self._stream_lock = threading.Lock()

    def Frames(self, request_iterator: Iterator[pb.Frame], context) -> Iterator[pb.FrameReply]:
        import grpc

        if not self._stream_lock.acquire(blocking=False):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "another controller stream is active")
        try:
            for frame in request_iterator:
                try:
                    reply = self.executor.submit(self.server.handle_frame, frame).result()
                except Exception as exc:  # a bug or MLX failure: report it, keep serving
                    log.exception("rank %d failed on %s", self.server.rank, fr.describe(frame))
                    reply = fr.error_reply(frame, self.server.rank, pb.INTERNAL,
                                           f"rank {self.server.rank}: {type(exc).__name__}: {exc}")
                if reply is not None:
                    yield reply
        finally:
            self._stream_lock.release()

    def Health(self, request, context) -> pb.HealthReply:
        state = "busy" if len(self.server.batch) else "ready"
        return pb.HealthReply(rank=self.server.rank, world_size=self.world_size, state=state,
                              model=self.model_name)

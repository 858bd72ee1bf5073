"""Ranks N: frame -> :class:`~mlxcluster.engine.decode.RankEngine` call, in lockstep with rank 0.

Like mlx-lm's ``server.py`` (``_share_object`` / ``_next_request``), ranks N
receive the work rank 0 decided and run the same forward passes: rank 0's
``promptTokens`` becomes :meth:`RankEngine.admit` and a prefill, ``prefillChunk``
:meth:`RankEngine.prefill_chunk`, ``stepToken`` /
``batchStep`` :meth:`RankEngine.step`, ``sessionStop`` :meth:`RankEngine.remove`.

Threads of a rank N process: gRPC's server threads; per controller stream one
reader thread (frames -> the follower's inbox, then wakes the MLX thread); the
one MLX thread running :meth:`Follower.drain` (inbox -> engine calls ->
replies, which the stream's response generator sends).  A frame crosses two
hops in (reader, MLX thread) and one out.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Executor
from typing import Dict, Iterator, List, Optional, Tuple

import mlx.core as mx

from ..engine.decode import Compute, RankEngine, Remote
from ..protocol import frames as fr
from ..protocol import mlxcluster_pb2 as pb
from ..protocol import mlxcluster_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

__all__ = ["Follower", "RankControlServicer", "serve_follower"]


class Follower:
    """Frame handler of a rank N (rank >= 1).

    ``promptTokens`` admits a new sequence (:meth:`RankEngine.admit`) and prefills it (at once,
    with the rest of its prefill group, or by ``prefillChunk`` frames), ``stepToken`` runs one
    decode step of a lone sequence and ``batchStep`` one of every resident sequence (continuous
    batching), each on the tokens rank 0 sampled, ``sessionStop`` frees a sequence.  A frame that
    fails validation -- unknown session
    uid, a position other than the KV cache length, a token outside
    ``[0, vocab_size)``, a sequence longer than ``context_length`` -- is
    answered with an error reply and runs nothing, so no collective is
    entered for it.

    Args:
        model: this rank's shard (:class:`~mlxcluster.model.tp.TensorParallel`, a pipeline stage, ...).
        rank: this rank (>= 1 in a real group; 0 is allowed for tests).
        vocab_size: number of token ids.
        context_length: maximum tokens in the KV cache.

    Only cluster members reach it: :func:`serve_follower` serves over mutual TLS.
    """

    def __init__(self, model, rank: int, vocab_size: int, context_length: int):
        self.model = model
        self.rank = rank
        self.vocab_size = vocab_size
        self.context_length = context_length
        # Ranks N stop after the final norm (their logits would be discarded),
        # unless the head is vocabulary-parallel: DecodeBatch and ShardSession
        # then run it, since its all_gather is a collective.
        self.engine = RankEngine(model, context_length, compute_logits=False)
        self.frames_handled = 0
        # a pipeline stage checks promptTokens' route and epoch against its own
        route = getattr(model, "route", None)
        self.route_id = route.identity() if route is not None else ""
        self.epoch = getattr(model, "epoch", "")
        # sessions known here without a KV cache until their sessionStop -> P: --local-decode ones
        # whose K/V went to rank 0, --pd ones whose prefill group's K/V this rank refused
        self._handed_off: Dict[str, int] = {}
        self.decode_side = None  # --prefill-peer: a leader.pd.DecodeSide
        self.on_stop = None      # called after each sessionStop (the rank reports counters)
        self._group: List[Tuple[pb.Frame, List[int]]] = []  # a batched prefill group's frames so far
        self._group_size = 0

    @property
    def batch(self):
        """This rank's :class:`~mlxcluster.engine.decode.DecodeBatch`."""
        return self.engine.batch

    @property
    def session(self):
        """The resident sequence's session when exactly one is resident, else ``None``."""
        return self.batch.sessions[0] if len(self.batch) == 1 else None

    def _reject(self, frame, code, message) -> pb.FrameReply:
        log.warning("rank %d rejected %s: %s", self.rank, fr.describe(frame), message)
        target = self.batch.find(frame.uid) or self.session
        return fr.error_reply(frame, self.rank, code, message, target.position if target else 0)

    def _check_entry(self, uid: str, position: int, token: int, session):
        """``(code, message)`` if a step entry is invalid, else ``None``."""
        if position != session.position:
            return pb.OUT_OF_ORDER, (f"step for {uid!r} at position {position} but the KV cache holds "
                                     f"{session.position} tokens")
        if not 0 <= token < self.vocab_size:
            return pb.BAD_TOKEN, f"token {token} outside the vocabulary [0, {self.vocab_size})"
        if position >= self.context_length:
            return pb.CONTEXT_OVERFLOW, f"position {position} beyond the context of {self.context_length}"
        return None

    # -- frames ---------------------------------------------------------------------------
    def handle_frame(self, frame: pb.Frame) -> Optional[pb.FrameReply]:
        """Validate and execute one frame.

        Returns an error :class:`FrameReply` for a rejected frame, an ok reply
        for ``sessionStop`` (carrying this rank's peak memory), an iterator of
        ``KvFrame`` replies for a ``--local-decode`` ``promptTokens`` (consumed on
        the MLX thread: it reads the KV cache), else ``None``.  Never raises for bad frames.
        """
        self.frames_handled += 1
        if log.isEnabledFor(logging.DEBUG):  # describe() is not free: keep it off the hot path
            log.debug("rank %d frame %s", self.rank, fr.describe(frame))
        which = frame.WhichOneof("payload")
        if self._group and not (frame.type == fr.PROMPT_TOKENS and which == "prompt_tokens"
                                and frame.prompt_tokens.prefill_group > 1):
            held, self._group = len(self._group), []
            return self._reject(frame, pb.BAD_FRAME, f"{fr.describe(frame)} inside a batched prefill group "
                                                     f"({held} of {self._group_size} promptTokens received)")
        if frame.type == fr.PROMPT_TOKENS and which == "prompt_tokens":
            return self._prompt(frame)
        if frame.type == fr.STEP_TOKEN and which == "step_token":
            return self._step(frame)
        if frame.type == fr.BATCH_STEP and which == "batch_step":
            return self._batch_step(frame)
        if frame.type == fr.SESSION_STOP and which == "session_stop":
            return self._stop(frame)
        if frame.type == fr.PREFILL_CHUNK and which == "prefill_chunk":
            return self._prefill_chunk(frame)
        return self._reject(frame, pb.BAD_FRAME, f"unknown or malformed frame type 0x{frame.type:02X}")

    def _prompt(self, frame: pb.Frame) -> Optional[pb.FrameReply]:
        pt = frame.prompt_tokens
        ids = list(pt.token_ids)
        if not frame.uid:
            return self._reject(frame, pb.BAD_FRAME, "promptTokens without a session uid")
        if not ids:
            return self._reject(frame, pb.BAD_FRAME, "promptTokens with no tokens")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return self._reject(frame, pb.BAD_TOKEN, f"token {bad} outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.context_length:
            return self._reject(frame, pb.CONTEXT_OVERFLOW,
                                f"prompt of {len(ids)} tokens does not fit the context of {self.context_length}")
        if self.engine.get(frame.uid) is not None or frame.uid in self._handed_off:
            return self._reject(frame, pb.BAD_FRAME, f"session {frame.uid!r} is already resident")
        if pt.route != self.route_id:
            return self._reject(frame, pb.BAD_FRAME, f"promptTokens for route {pt.route or '(none)'!r}, this rank "
                                                     f"runs {self.route_id or 'no pipeline'!r}")
        if pt.epoch != self.epoch:
            return self._reject(frame, pb.BAD_FRAME, f"promptTokens of formation epoch {pt.epoch!r}, this rank's "
                                                     f"is {self.epoch!r} (stale)")
        if pt.cached_prefix and (pt.local_decode or pt.pd or self.engine.prefix_match(ids) < pt.cached_prefix):
            return self._reject(frame, pb.BAD_FRAME, f"promptTokens with {pt.cached_prefix} cached positions, but "
                                                     f"this rank's prefix cache holds {self.engine.prefix_match(ids)}")
        if pt.chunked:
            if pt.local_decode or pt.pd or pt.prefill_group:
                return self._reject(frame, pb.BAD_FRAME, "chunked promptTokens cannot be local-decode, pd or "
                                                         "part of a prefill group")
            self.engine.admit(frame.uid, ids, source=Compute(pt.cached_prefix))
            return None
        if pt.prefill_group > 1:
            return self._grouped(frame, ids)
        if pt.local_decode:
            if not getattr(self.model, "local_decode", False):
                return self._reject(frame, pb.BAD_FRAME, "local-decode promptTokens, but this rank was not started "
                                                         "with --local-decode")
            return self._handoff(frame, ids)
        if pt.pd:
            if self.decode_side is None:
                return self._reject(frame, pb.BAD_FRAME, "pd promptTokens, but this rank has no --prefill-peer")
            return self._pd(frame, ids)
        self.engine.prefill(frame.uid, ids, cached=pt.cached_prefix)
        return None

    def _grouped(self, frame: pb.Frame, ids) -> Optional[pb.FrameReply]:
        """One frame of a batched prefill group (``promptTokens.prefill_group`` = G): held until
        the group's G-th frame arrives, then the G prompts are prefilled together
        (:meth:`RankEngine.prefill_many`, the call rank 0 makes)."""
        pt = frame.prompt_tokens
        if pt.local_decode or pt.pd:
            return self._reject(frame, pb.BAD_FRAME, "a batched prefill group's promptTokens cannot be "
                                                     "local-decode or pd")
        if self._group and pt.prefill_group != self._group_size:
            return self._reject(frame, pb.BAD_FRAME, f"promptTokens of a prefill group of {pt.prefill_group} "
                                                     f"inside one of {self._group_size}")
        if any(f.uid == frame.uid for f, _ in self._group):
            return self._reject(frame, pb.BAD_FRAME, f"session {frame.uid!r} is already resident")
        if not self._group:
            self._group_size = pt.prefill_group
        self._group.append((frame, ids))
        if len(self._group) < self._group_size:
            return None
        group, self._group = self._group, []
        self.engine.prefill_many([(f.uid, ids, None, (), 0, f.prompt_tokens.cached_prefix) for f, ids in group])
        return None

    def _prefill_chunk(self, frame: pb.Frame) -> Optional[pb.FrameReply]:
        """The next chunk of a chunked prefill (``promptTokens.chunked``), checked before any pass:
        a known sequence still being prefilled, at its KV cache's length, within its prompt."""
        c = frame.prefill_chunk
        seq = self.engine.get(frame.uid)
        if seq is None or not seq.prefilling:
            return self._reject(frame, pb.UNKNOWN_SESSION, f"prefillChunk for {frame.uid!r}, which is not being "
                                                           f"prefilled here")
        if c.position != seq.session.position:
            return self._reject(frame, pb.OUT_OF_ORDER, f"prefillChunk for {frame.uid!r} at position {c.position} "
                                                        f"but the KV cache holds {seq.session.position} tokens")
        if c.count < 1 or c.position + c.count > len(seq.prompt):
            return self._reject(frame, pb.BAD_FRAME, f"prefillChunk of {c.count} tokens at position {c.position} "
                                                     f"does not fit the {len(seq.prompt)}-token prompt")
        self.engine.prefill_chunk(frame.uid, c.count)
        return None

    def _handoff(self, frame: pb.Frame, ids) -> Iterator[pb.FrameReply]:
        """``--local-decode``: prefill ``ids`` through the pipeline (this stage's share), then
        send this stage's K/V for the prompt's positions to rank 0 as ``KvFrame`` replies
        (:func:`mlxcluster.engine.handoff.kv_frames`) and free it.  The session stays known
        until its ``sessionStop``; no decode step ever runs here for it."""
        from ..engine.decode import ShardSession
        from ..engine.handoff import kv_frames

        session = ShardSession(self.model, frame.uid)
        session.prefill(ids)
        self._handed_off[frame.uid] = len(ids)
        m = self.model
        try:
            for kv in kv_frames(session.cache, m.stage.layers, ids, m.identity, m.epoch):  # failpoint handoff.send
                yield pb.FrameReply(uid=frame.uid, type=frame.type, ok=True, rank=self.rank, position=len(ids), kv=kv)
        finally:
            session.close()

    def _pd(self, frame: pb.Frame, ids) -> pb.FrameReply:
        """Prefill/decode disaggregation: fetch this rank's KV heads of ``ids`` from the prefill
        group (blocking this MLX thread until ``DECODE``), install them, and answer with one
        ``KvFrame`` (last, its byte count); a refused stream installs nothing and is answered ok
        with ``pd_refused`` (the request fails closed on rank 0's word, the group stays whole)."""
        from ..engine.pd import PdError

        ok = pb.FrameReply(uid=frame.uid, type=frame.type, ok=True, rank=self.rank, position=len(ids))
        try:
            got = self.decode_side.fetch(frame.uid, ids, frame.prompt_tokens.sampling)
            self.engine.admit(frame.uid, ids, source=Remote(got.kv(), got.first_token))
        except (PdError, ValueError) as exc:
            log.warning("rank %d refused the prefill group's KV of %s: %s", self.rank, frame.uid, exc)
            self._handed_off[frame.uid] = 0
            ok.pd_refused = str(exc) or type(exc).__name__
            ok.kv.CopyFrom(pb.KvFrame(last=True, uid=frame.uid))
            return ok
        ok.kv.CopyFrom(pb.KvFrame(last=True, uid=frame.uid, total_bytes=got.bytes, first_token=got.first_token))
        return ok

    def _step(self, frame: pb.Frame) -> Optional[pb.FrameReply]:
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
        self.engine.step([st.token])
        return None

    def _batch_step(self, frame: pb.Frame) -> Optional[pb.FrameReply]:
        entries = list(frame.batch_step.entries)
        if [e.uid for e in entries] != self.batch.uids:
            return self._reject(frame, pb.UNKNOWN_SESSION, f"batchStep for sequences {[e.uid for e in entries]} "
                                                           f"but this rank holds {self.batch.uids}")
        for e, session in zip(entries, self.batch.sessions):
            error = self._check_entry(e.uid, e.position, e.token, session)
            if error:
                return self._reject(frame, *error)
        self.engine.step([e.token for e in entries])
        return None

    def _stop(self, frame: pb.Frame) -> Optional[pb.FrameReply]:
        if frame.uid in self._handed_off:  # --local-decode: its K/V already went to rank 0
            return pb.FrameReply(uid=frame.uid, type=frame.type, ok=True, rank=self.rank,
                                 peak_memory_bytes=mx.get_peak_memory(), position=self._handed_off.pop(frame.uid))
        if self.engine.get(frame.uid) is None:
            return self._reject(frame, pb.UNKNOWN_SESSION, f"sessionStop for unknown session {frame.uid!r}")
        position = self.engine.remove(frame.uid)
        if self.on_stop is not None:
            self.on_stop()
        return pb.FrameReply(uid=frame.uid, type=frame.type, ok=True, rank=self.rank,
                             peak_memory_bytes=mx.get_peak_memory(), position=position)

    # -- the follower loop ------------------------------------------------------------------
    def drain(self, inbox: "queue.Queue", replies: "queue.Queue", end: object) -> bool:
        """Handle every frame waiting in ``inbox``, putting replies on ``replies``.  Returns
        (releasing the MLX thread) when the inbox is empty: ``True`` once ``end`` was taken (the
        stream is over), else ``False``.  Runs on the MLX thread."""
        while True:
            try:
                frame = inbox.get_nowait()
            except queue.Empty:
                return False
            if frame is end:
                return True
            try:
                reply = self.handle_frame(frame)
                if reply is not None and not isinstance(reply, pb.FrameReply):  # a stream of replies
                    for r in reply:
                        replies.put(r)
                    reply = None
            except Exception as exc:  # a bug or MLX failure: report it, keep serving
                reply = self._internal(frame, exc)
            if reply is not None:
                replies.put(reply)

    def _internal(self, frame: pb.Frame, exc: Exception) -> pb.FrameReply:
        log.exception("rank %d failed on %s", self.rank, fr.describe(frame))
        return fr.error_reply(frame, self.rank, pb.INTERNAL, f"rank {self.rank}: {type(exc).__name__}: {exc}")


_END = object()


class RankControlServicer(pb_grpc.RankControlServicer):
    """gRPC face of a :class:`Follower`.

    Only one ``Frames`` stream (rank 0's) is served at a time; a second
    concurrent stream is refused with ``FAILED_PRECONDITION`` so that no
    stranger's frames interleave with rank 0's.  The stream's reader thread
    puts each frame in an inbox and, unless a drain is already scheduled,
    submits :meth:`Follower.drain` to ``executor`` (the process's one MLX
    thread), which runs until the inbox is empty -- so the MLX thread is never
    held waiting for a frame.
    """

    def __init__(self, follower: Follower, executor: Executor, world_size: int, model_name: str = "",
                 weight_bytes: int = 0):
        self.follower = follower
        self.executor = executor
        self.world_size = world_size
        self.model_name = model_name
        self.weight_bytes = weight_bytes  # this rank's shard (reported in Health for the dashboard)
        self._stream_lock = threading.Lock()

    def Frames(self, request_iterator: Iterator[pb.Frame], context) -> Iterator[pb.FrameReply]:
        import grpc

        if not self._stream_lock.acquire(blocking=False):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "another controller stream is active")
        try:
            inbox: "queue.Queue" = queue.Queue()
            replies: "queue.Queue" = queue.Queue()
            lock = threading.Lock()
            scheduled = [False]  # a drain is queued or running on the MLX thread

            def drain() -> None:
                while True:
                    ended = self.follower.drain(inbox, replies, _END)
                    with lock:
                        if ended or inbox.empty():
                            scheduled[0] = False
                            break
                if ended:
                    replies.put(_END)

            def wake() -> None:
                with lock:
                    if scheduled[0]:
                        return
                    scheduled[0] = True
                try:
                    self.executor.submit(drain)
                except RuntimeError:  # the executor is shut down: the process is stopping
                    replies.put(_END)

            def read() -> None:
                try:
                    for frame in request_iterator:
                        inbox.put(frame)
                        wake()
                except Exception:  # the stream broke: rank 0 is gone
                    pass
                finally:
                    inbox.put(_END)
                    wake()

            threading.Thread(target=read, name="frames-reader", daemon=True).start()
            while True:
                reply = replies.get()
                if reply is _END:
                    break
                yield reply
        finally:
            self._stream_lock.release()

    def Health(self, request, context) -> pb.HealthReply:
        import mlx.core as mx

        state = "busy" if len(self.follower.batch) else "ready"
        return pb.HealthReply(rank=self.follower.rank, world_size=self.world_size, state=state,
                              model=self.model_name, active_memory_bytes=int(mx.get_active_memory()),
                              weight_bytes=self.weight_bytes)


def serve_follower(model, rank: int, world_size: int, source, executor: Executor, bind: str, port: int,
                   credentials, on_ready=None, decode_side=None, on_stop=None) -> None:
    """A rank N's whole life: serve ``RankControl`` on ``bind:port`` until SIGTERM,
    over mutual TLS with ``credentials`` (a :class:`mlxcluster.security.Credentials`):
    only a process that holds the cluster secret can connect.

    Frames are handled on ``executor``, the process's one MLX thread.

    Raises:
        RuntimeError: the address cannot be bound.
    """
    import signal
    from concurrent import futures

    import grpc

    follower = Follower(model, rank, source.vocab_size, source.context_length)
    follower.decode_side = decode_side
    follower.on_stop = on_stop
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    from ..model.tp import weight_bytes

    pb_grpc.add_RankControlServicer_to_server(
        RankControlServicer(follower, executor, world_size, source.name, weight_bytes(model)), server)
    if server.add_secure_port(f"{bind}:{port}", credentials.server()) == 0:
        raise RuntimeError(f"cannot listen on {bind}:{port}")
    server.start()
    if on_ready:
        on_ready()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=1)

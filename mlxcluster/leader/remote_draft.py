"""Speculative decoding with a draft node: a draft model served over the cluster's mutual TLS
(``join --role draft``, ``serve --role draft``) and rank 0's drafters that ask it
(``--draft remote:HOST:PORT``).

* :class:`DraftService` (the draft node's rank 0, ``Generation.Draft``): holds the draft model (the
  rank's own model, any model reference the loader reads, with the target's vocabulary) and one
  :class:`~mlxcluster.engine.drafters.ModelDrafter` per sequence uid -- its KV cache over that
  sequence's context, trimmed to what the target accepted -- dropped when the target says the
  sequence ended (``DraftRequest.ended``), after :data:`IDLE_S` without a call, or, least recently
  used first, beyond :data:`MAX_SEQUENCES`.  Each call's forward passes run on the process's one MLX
  thread.  The vocabulary is checked per call: a target of another vocabulary size or tokenizer
  vocabulary (:func:`vocab_digest`) is ``FAILED_PRECONDITION``.
* :class:`RemoteDrafts` (rank 0, one per draft node address): ONE ``Draft`` call per plan carries
  every drafting sequence of the batch (the scheduler's batch hook,
  :attr:`~mlxcluster.engine.speculative.Drafter.batch`: :meth:`RemoteDrafts.prefetch`).  Each item
  sends only the context tokens the draft node lacks (``keep``: how many of those it was sent are
  still valid, ``tokens``: the rest; the context of a sequence only grows, and rejected draft tokens
  were never sent: the draft node's drafter trims them from its own cache).  A draft node that is
  slow, gone or refusing never fails or stalls a request: each call has a deadline
  (:data:`DRAFT_DEADLINE_S`); on any error every sequence of the plan just gets no draft (a plain
  step), the next call waits a back-off (:data:`BACKOFF_S` doubling to :data:`BACKOFF_MAX_S`), and
  one line is logged per outage.  The call's time is the sequences' draft time (``draft_s``, shared
  by their draft lengths), which :class:`~mlxcluster.engine.speculative.AdaptiveK` weighs.
* :class:`RemoteDrafter`: one sequence's :class:`~mlxcluster.engine.speculative.Drafter`; its
  :meth:`~RemoteDrafter.propose` answers with what the plan's call fetched (never blocks).

Greedy answers stay those of plain decoding: the target verifies every draft token; a drafter only
proposes.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import time
import uuid
from typing import Callable, List, Optional, Sequence, Tuple

import grpc

from ..engine.drafters import DraftModels, ModelDrafter
from ..engine.speculative import MAX_DRAFT_TOKENS, Drafter
from ..protocol import mlxcluster_pb2 as pb
from ..protocol import mlxcluster_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

__all__ = ["DraftService", "RemoteDrafts", "RemoteDrafter", "vocab_digest", "DRAFT_DEADLINE_S", "BACKOFF_S",
           "BACKOFF_MAX_S", "MAX_SEQUENCES", "MAX_ITEMS", "IDLE_S"]

#: seconds one ``Draft`` call may take before its plan goes on without drafts (a plain step)
DRAFT_DEADLINE_S = 0.5
#: seconds before the first call after a failed one; doubled per failure up to ``BACKOFF_MAX_S``
BACKOFF_S = 1.0
BACKOFF_MAX_S = 30.0
#: sequences a draft node holds (least recently used dropped first) and drafts per call
MAX_SEQUENCES = 256
MAX_ITEMS = 256
#: seconds after its last call that a draft node drops a sequence the target never ended
IDLE_S = 120.0


def vocab_digest(tokenizer) -> str:
    """sha256 (hex) of a Hugging Face tokenizer's vocabulary (``get_vocab()``: token -> id, sorted),
    the draft node's and the target's to compare; ``""`` for no tokenizer."""
    if tokenizer is None:
        return ""
    vocab = tokenizer.get_vocab()
    return hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()).hexdigest()


class _Held:
    __slots__ = ("drafter", "context", "used")

    def __init__(self, drafter: ModelDrafter, used: float):
        self.drafter, self.context, self.used = drafter, [], used


class DraftService:
    """A draft node's ``Generation.Draft`` (see the module docstring).

    Args:
        model: the draft model (an mlx-lm model: ``model(tokens (1, T) int32, cache)`` -> logits
            ``(1, T, vocab)``), built by this process (its rank's model).
        vocab_size: its vocabulary (embedding rows).
        tokenizer: its tokenizer (``None``: only ``vocab_size`` is compared with the target's).
        executor: the process's one MLX thread (``None``: :meth:`draft` runs on the event loop's
            thread -- tests only).
        name: how the model is named in logs.
        max_sequences, idle_s: the bounds on held sequences (:data:`MAX_SEQUENCES`, :data:`IDLE_S`).
        clock: ``time.monotonic`` (tests give their own).
    """

    def __init__(self, model, vocab_size: int, tokenizer=None, executor=None, name: str = "draft",
                 max_sequences: int = MAX_SEQUENCES, idle_s: float = IDLE_S,
                 clock: Callable[[], float] = time.monotonic):
        self.models = DraftModels(model, vocab_size, tokenizer)
        self.models.hold("model", name, model)
        self.name, self.vocab_size, self.executor = name, int(vocab_size), executor
        self.max_sequences, self.idle_s, self.clock = max(1, int(max_sequences)), float(idle_s), clock
        self.digest = vocab_digest(tokenizer)
        self._held: "collections.OrderedDict[str, _Held]" = collections.OrderedDict()
        self.calls = 0  # Draft calls answered

    @property
    def sequences(self) -> int:
        """Sequences held now."""
        return len(self._held)

    def check(self, request: pb.DraftRequest) -> Optional[Tuple[grpc.StatusCode, str]]:
        """``(code, one line)`` for a request this service refuses, else ``None``: another
        vocabulary (``FAILED_PRECONDITION``); more than :data:`MAX_ITEMS` items, a uid twice or empty,
        ``k`` outside 1..16, a token outside the vocabulary (``INVALID_ARGUMENT``)."""
        if request.vocab_size != self.vocab_size:
            return (grpc.StatusCode.FAILED_PRECONDITION,
                    f"the draft model's vocabulary has {self.vocab_size} tokens, the target's {request.vocab_size}: "
                    f"a draft model needs the target's tokenizer")
        if request.vocab_digest and self.digest and request.vocab_digest != self.digest:
            return (grpc.StatusCode.FAILED_PRECONDITION,
                    "the draft model's tokenizer vocabulary differs from the target's: a draft model needs the "
                    "target's tokenizer")
        if len(request.items) > MAX_ITEMS:
            return grpc.StatusCode.INVALID_ARGUMENT, f"{len(request.items)} items in one call: at most {MAX_ITEMS}"
        uids = set()
        for item in request.items:
            if not item.uid or item.uid in uids:
                return grpc.StatusCode.INVALID_ARGUMENT, f"item uid {item.uid!r} is empty or repeated"
            uids.add(item.uid)
            if not 1 <= item.k <= MAX_DRAFT_TOKENS:
                return grpc.StatusCode.INVALID_ARGUMENT, f"item {item.uid}: k must be in 1..{MAX_DRAFT_TOKENS}, got {item.k}"
            if any(not 0 <= t < self.vocab_size for t in item.tokens):
                return grpc.StatusCode.INVALID_ARGUMENT, f"item {item.uid}: a token outside the vocabulary [0, {self.vocab_size})"
        return None

    def draft(self, request: pb.DraftRequest) -> pb.DraftReply:
        """Answer a checked request (:meth:`check`) on the MLX thread: drop the ended uids and those
        idle beyond the bound, then per item the uid's context becomes its first ``keep`` tokens plus
        ``tokens`` and its drafter proposes up to ``k`` greedy draft tokens after it; an item whose
        ``keep`` exceeds what is held (an unknown uid with ``keep`` > 0) gets ``resync`` and no
        draft.  Beyond ``max_sequences`` the least recently used sequences are dropped."""
        t0 = time.perf_counter()
        now = self.clock()
        for uid in request.ended:
            self._drop(uid)
        for uid in [u for u, h in self._held.items() if now - h.used > self.idle_s]:
            self._drop(uid)
        out = []
        for item in request.items:
            held = self._held.get(item.uid)
            have = len(held.context) if held is not None else 0
            if item.keep > have:
                self._drop(item.uid)
                out.append(pb.DraftTokens(uid=item.uid, resync=True))
                continue
            if held is None:
                held = self._held[item.uid] = _Held(self.models.drafter("model", self.name, f"draft model {self.name}"),
                                                    now)
            held.context = held.context[:item.keep] + [int(t) for t in item.tokens]
            held.used = now
            self._held.move_to_end(item.uid)
            tokens = held.drafter.propose(held.context, int(item.k)) if held.context else []
            out.append(pb.DraftTokens(uid=item.uid, tokens=tokens))
        while len(self._held) > self.max_sequences:
            self._drop(next(iter(self._held)))
        self.calls += 1
        return pb.DraftReply(items=out, seconds=time.perf_counter() - t0)

    def _drop(self, uid: str) -> None:
        held = self._held.pop(uid, None)
        if held is not None:
            held.drafter.close()

    async def Draft(self, request: pb.DraftRequest, context) -> pb.DraftReply:
        """``Generation.Draft``: :meth:`check`, then :meth:`draft` on the MLX thread."""
        bad = self.check(request)
        if bad is not None:
            await context.abort(*bad)
        if self.executor is None:
            return self.draft(request)
        return await asyncio.get_running_loop().run_in_executor(self.executor, self.draft, request)


class RemoteDrafts:
    """Rank 0's side of one draft node's group at ``address`` (``host:port``): the batch object of
    its sequences' :class:`RemoteDrafter` s (see the module docstring).

    Args:
        address: the draft group's rank 0.
        credentials: this rank's :class:`~mlxcluster.security.Credentials` (the cluster secret).
        vocab_size: the target's vocabulary; ``digest``: :func:`vocab_digest` of its tokenizer ("").
        deadline_s: each call's deadline (:data:`DRAFT_DEADLINE_S`).
        clock: ``time.monotonic`` (tests give their own).
    """

    def __init__(self, address: str, credentials, vocab_size: int, digest: str = "",
                 deadline_s: float = DRAFT_DEADLINE_S, clock: Callable[[], float] = time.monotonic):
        self.address, self.credentials = address, credentials
        self.vocab_size, self.digest, self.deadline_s, self.clock = int(vocab_size), digest, float(deadline_s), clock
        self._channel = None
        self._stub = None
        self._ended: "collections.deque[str]" = collections.deque(maxlen=4 * MAX_ITEMS)  # any thread appends
        self._backoff = 0.0
        self.retry_at = 0.0   # no call before this clock time (after a failure)
        self.failing = ""     # the last failure's one line while the node does not answer ("": it does)
        self.calls = 0        # Draft calls made
        self.failures = 0     # ... of them failed

    def drafter(self) -> "RemoteDrafter":
        """A new sequence's drafter.  On an event loop the channel starts connecting now, so that the
        first plan's call does not spend its deadline on the TLS handshake."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop here (a check at start): the first call connects
            pass
        else:
            self._open()
        return RemoteDrafter(self)

    def _open(self) -> None:
        if self._stub is None:
            self._channel = self.credentials.aio_channel(self.address)
            self._stub = pb_grpc.GenerationStub(self._channel)
            self._channel.get_state(try_to_connect=True)

    def end(self, uid: str) -> None:
        """The sequence ``uid`` ended: the next call tells the draft node (any thread)."""
        self._ended.append(uid)

    async def prefetch(self, items: Sequence[Tuple["RemoteDrafter", Sequence[int], int]]) -> None:
        """One ``Draft`` call for the plan's drafting sequences (``(drafter, context int ids, k)`` each):
        each drafter's next :meth:`RemoteDrafter.propose` answers with its draft tokens (none on any
        failure, or while the back-off after one runs).  Never raises (but ``CancelledError``)."""
        for d, _, _ in items:
            d.pending, d.draft_s = [], None
        if not items or self.clock() < self.retry_at:
            return
        sent = []
        for d, context, k in items:
            keep = d.sent if 0 < d.sent <= len(context) and context[d.sent - 1] == d.tail else 0
            sent.append((d, keep, context, int(k)))
        ended = [self._ended.popleft() for _ in range(len(self._ended))]
        request = pb.DraftRequest(
            items=[pb.DraftItem(uid=d.uid, keep=keep, tokens=[int(t) for t in context[keep:]], k=k)
                   for d, keep, context, k in sent],
            ended=ended, vocab_size=self.vocab_size, vocab_digest=self.digest)
        self._open()
        t0 = time.perf_counter()
        self.calls += 1
        try:
            reply = await self._stub.Draft(request, timeout=self.deadline_s)
            if len(reply.items) != len(sent):
                raise ValueError(f"the draft node answered {len(reply.items)} items for {len(sent)}")
        except (grpc.RpcError, ValueError) as exc:
            self._ended.extend(ended)  # told with the next call (or dropped there after IDLE_S)
            self._failed(exc)
            await self.close()  # the next call connects afresh (not through gRPC's reconnect back-off)
            return
        seconds = time.perf_counter() - t0
        total = sum(k for _, _, _, k in sent)
        for (d, keep, context, k), got in zip(sent, reply.items):
            if got.resync:
                d.sent, d.tail = 0, None
                continue
            d.sent, d.tail = len(context), (int(context[-1]) if context else None)
            tokens = [int(t) for t in got.tokens][:k]
            d.pending = tokens[:next((i for i, t in enumerate(tokens) if not 0 <= t < self.vocab_size), len(tokens))]
            d.draft_s = seconds * k / total  # the call's time, shared by the draft lengths asked
        if self.failing:
            log.info("draft node at %s answers again", self.address)
        self.failing, self._backoff = "", 0.0

    def _failed(self, exc: BaseException) -> None:
        from ..security import describe_rpc_error

        self.failures += 1
        code = exc.code() if isinstance(exc, grpc.RpcError) and hasattr(exc, "code") else None
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            why = f"no answer within {self.deadline_s:g} s"
        else:
            why = describe_rpc_error(exc)
        refused = code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
                           grpc.StatusCode.UNIMPLEMENTED)
        self._backoff = BACKOFF_MAX_S if refused else min(BACKOFF_MAX_S, max(BACKOFF_S, 2 * self._backoff))
        self.retry_at = self.clock() + self._backoff
        if not self.failing:
            log.warning("draft node at %s: %s; decoding without its drafts (retrying in %g s)", self.address,
                        why, self._backoff)
        self.failing = why

    async def close(self) -> None:
        """Close the channel (idempotent)."""
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            await channel.close()


class RemoteDrafter(Drafter):
    """One sequence's drafter on a draft node (``remote:HOST:PORT``; :class:`RemoteDrafts`).

    :attr:`uid` names the sequence at the draft node (random: unique across target groups);
    :attr:`sent` counts the context tokens the draft node was sent and holds (``tail`` the last of
    them); :attr:`pending` the draft tokens the plan's call fetched.  :meth:`propose` never calls the
    draft node itself."""

    name = "remote"
    uses_mlx = False

    def __init__(self, remote: RemoteDrafts):
        self.batch = remote
        self.uid = uuid.uuid4().hex
        self.sent: int = 0
        self.tail: Optional[int] = None
        self.pending: List[int] = []
        self.draft_s: Optional[float] = None

    def propose(self, context: Sequence[int], k: int) -> List[int]:
        """The draft tokens (int ids, at most ``k``) the plan's :meth:`RemoteDrafts.prefetch` fetched
        for ``context``; ``[]`` when none (no call this plan, a failure, the back-off)."""
        out, self.pending = self.pending[:max(0, k)], []
        return out

    def close(self) -> None:
        """The sequence ended: the draft node drops its state with the next call (any thread)."""
        if self.sent:
            self.batch.end(self.uid)
        self.sent, self.tail, self.pending = 0, None, []

"""Rank 0's client-facing ``Generation`` gRPC service (text in, token stream out) and its client.

The service tokenises requests (chat template included) and detokenises
tokens; the scheduler and the ranks see token ids only.  Rank 0's process runs
one asyncio event loop: this service (``grpc.aio``), the scheduler's decode
loop and the links to ranks N; MLX runs on one executor thread.
:class:`GenerationClient` is what ``mlxcluster generate`` (and the benchmarks)
use; importing it does not import MLX.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import grpc

from ..protocol import mlxcluster_pb2 as pb
from ..protocol import mlxcluster_pb2_grpc as pb_grpc
from ..control.link import RankError, RankGroup, RankLink
from ..control.mlx_thread import busy_s, step_s
from ..model.tokenizer import final_segment, prime_detokenizer, streaming_detokenizer
from ..protocol.args import (REPETITION_CONTEXT_SIZE, GenerationArgs, LogitsArgs, SamplingArgs,
                             check_args, from_request, to_request)
from ..protocol.errors import QueueFullError
from .pd import GRPC_OPTIONS as _PD_OPTIONS

if TYPE_CHECKING:  # the scheduler imports MLX: only rank 0 needs it
    from ..engine.sampling import Sampling
    from .scheduler import Scheduler

log = logging.getLogger(__name__)

__all__ = ["GenerationServicer", "serve_rank0", "prime_detokenizer", "DEFAULT_MAX_TOKENS", "GenerationClient", "ClientError", "collect",
           "GenerationResult", "chat_messages", "CHAT_ROLES"]

DEFAULT_MAX_TOKENS = 128


def engine_sampling(args: GenerationArgs) -> "Sampling":
    """The engine's :class:`~mlxcluster.engine.sampling.Sampling` of a request's
    :class:`~mlxcluster.protocol.args.GenerationArgs` (rank 0 samples every token with it)."""
    from ..engine.sampling import Sampling

    s, lg = args.sampling, args.logits
    return Sampling(temperature=s.temperature, top_p=s.top_p, seed=s.seed, logit_bias=lg.logit_bias,
                    presence_penalty=lg.presence_penalty, frequency_penalty=lg.frequency_penalty,
                    logprobs=args.logprobs, top_logprobs=args.top_logprobs, grammar=args.grammar, top_k=s.top_k,
                    min_p=s.min_p, repetition_penalty=lg.repetition_penalty,
                    repetition_context_size=lg.repetition_context_size)


CHAT_ROLES = ("system", "user", "assistant")


def chat_messages(request: pb.GenerateRequest) -> List[Dict[str, str]]:
    """``request.messages`` as the chat template's ``{"role", "content"}`` dicts (``system``
    first when set).

    Raises:
        ValueError: messages beside ``prompt``, a role outside :data:`CHAT_ROLES`, or a
            conversation that does not end with a user message.
    """
    if request.prompt:
        raise ValueError("give either prompt or messages, not both")
    out = [{"role": "system", "content": request.system}] if request.system else []
    for i, m in enumerate(request.messages):
        if m.role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, not {m.role[:40]!r}")
        out.append({"role": m.role, "content": m.content})
    if out[-1]["role"] != "user":
        raise ValueError("the conversation must end with a user message")
    return out


@contextlib.asynccontextmanager
async def _aborts_on_failure(context, what: str):
    """The one mapping of a serving call's failures to gRPC status codes (``Generate`` and ``Embed``):
    ``ValueError`` -> ``INVALID_ARGUMENT``, :class:`QueueFullError` -> ``RESOURCE_EXHAUSTED``,
    :class:`RankError` -> ``UNAVAILABLE`` (logged as ``"<what> failed"``); ``context.abort`` raises."""
    try:
        yield
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    except QueueFullError as exc:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    except RankError as exc:
        log.error("%s failed: %s", what, exc)
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"tensor-parallel group failed: {exc}")


class GenerationServicer(pb_grpc.GenerationServicer):
    """Tokenises a request (optionally through the chat template), streams the
    scheduler's tokens with their detokenised text, and ends with the session's
    timings.  Errors map to gRPC status codes: ``INVALID_ARGUMENT`` for bad
    input, ``UNAVAILABLE`` when the tensor-parallel group failed.  Served over
    mutual TLS (:func:`serve_rank0`): only secret holders reach it."""

    def __init__(self, scheduler: Scheduler, source, backend: str, weight_format: str, all_sum_us: float = 0.0,
                 prefill_service=None, draft_service=None):
        self.scheduler = scheduler
        self.prefill_service = prefill_service  # --role prefill: leader.pd.PrefillService
        self.draft_service = draft_service  # --role draft: leader.remote_draft.DraftService
        self.source = source
        self.backend = backend
        self.weight_format = weight_format
        self.all_sum_us = all_sum_us
        self._weight_bytes: Optional[int] = None  # rank 0's shard, computed on the first Info

    def _tokenize(self, request: pb.GenerateRequest) -> List[int]:
        from ..model.tokenizer import apply_chat, apply_chat_messages

        if request.prompt_ids:
            return list(request.prompt_ids)
        if request.messages:  # a whole conversation (multi-turn chat)
            return apply_chat_messages(self.source.tokenizer, chat_messages(request))
        if request.chat:
            return apply_chat(self.source.tokenizer, request.prompt, request.system or None)
        return list(self.source.tokenizer.encode(request.prompt, add_special_tokens=True))

    async def Generate(self, request: pb.GenerateRequest, context):
        """Stream a request's answer: ``started``, one ``token`` event per token, ``done``.

        A resumed request (``resume_token_ids``, lossless failover: the answer's first tokens,
        generated and delivered by an earlier group) continues that answer
        (:meth:`Scheduler.generate`'s ``resume``): only the tokens after them are streamed, and
        the streaming detokenizer is first fed the resumed tokens without sending their text, so
        the text pieces continue the earlier group's exactly (a character split across the break,
        a word's leading space).  ``started.prompt_ids`` is the prompt without the resumed tokens
        and ``cached_prompt_tokens`` counts cached positions of that prompt only;
        ``done.generated_tokens`` counts the whole answer, resumed tokens included.  Bad resumed
        tokens (an EOS, ``len >= max_tokens``, outside the vocabulary, refused by the grammar) are
        ``INVALID_ARGUMENT``."""
        try:
            args = check_args(from_request(request), self.source.vocab_size)
            # the chat template takes milliseconds: keep it off the loop that drives the decode steps
            ids = await asyncio.to_thread(self._tokenize, request)
            self.scheduler.validate_prompt(ids)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        resume = [int(t) for t in request.resume_token_ids]
        detok = streaming_detokenizer(self.source.tokenizer, resume)
        from .scheduler import SessionStats

        st = SessionStats(uid="")
        logprobs: List = []
        stream = self.scheduler.generate(ids, args.max_tokens or DEFAULT_MAX_TOKENS, self.source.eos_token_ids,
                                         stats=st, sampling=engine_sampling(args), logprobs=logprobs,
                                         **({"resume": resume} if resume else {}),
                                         **({"cache_salt": args.cache_salt} if args.cache_salt else {}),
                                         **({"speculative": args.speculative} if args.speculative else {}))
        started = False
        try:
            async with _aborts_on_failure(context, "generation"):
                async for token in stream:
                    if not started:
                        yield pb.GenerateEvent(started=pb.GenerateStarted(
                            prompt_ids=ids, cached_prompt_tokens=min(st.cached_prompt_tokens, len(ids)),
                            resumed_tokens=len(resume or ())))
                        started = True
                    if token in self.source.eos_token_ids:
                        text = ""
                    else:
                        detok.add_token(token)
                        text = detok.last_segment
                    event = pb.GeneratedToken(token_id=token, text=text)
                    entry = logprobs.pop(0) if logprobs else None  # the scheduler appends one per token before it yields
                    if entry is not None:
                        event.logprob = entry[0]
                        event.top_logprobs.extend(pb.TokenLogprob(token_id=t, logprob=v) for t, v in entry[1])
                    yield pb.GenerateEvent(token=event)
        finally:
            await stream.aclose()
        tail = final_segment(detok, st.reason == pb.EOS)
        yield pb.GenerateEvent(done=pb.GenerateDone(
            reason=st.reason, ttft_s=st.ttft_s, prefill_tokens_per_s=st.prefill_tokens_per_s,
            decode_tokens_per_s=st.decode_tokens_per_s,
            peak_memory_bytes_per_rank=st.peak_memory_bytes_per_rank,
            text_tail=tail, generated_tokens=st.generated_tokens, handoff_bytes=st.handoff_bytes,
            handoff_s=st.handoff_s, handoff_fallback=st.handoff_fallback, pd_prefill_s=st.pd_prefill_s,
            pd_tail_s=st.pd_tail_s, pd_streamed_s=st.pd_streamed_s,
            cached_prompt_tokens=min(st.cached_prompt_tokens, len(ids)), spec_drafted_tokens=st.spec_drafted,
            spec_accepted_tokens=st.spec_accepted, spec_steps=st.spec_steps, decode_steps=st.decode_steps))

    async def Prefill(self, request: pb.PrefillRequest, context):
        """Prefill/decode disaggregation: a decode rank's subscription (:mod:`mlxcluster.leader.pd`)."""
        if self.prefill_service is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this group is not a prefill group (start it with --role prefill)")
        async for frame in self.prefill_service.Prefill(request, context):
            yield frame

    async def Draft(self, request: pb.DraftRequest, context) -> pb.DraftReply:
        """Speculative decoding with a draft node (:mod:`mlxcluster.leader.remote_draft`): a target
        group's draft tokens for its batch's sequences; ``FAILED_PRECONDITION`` where this group is no
        draft group (or the target's vocabulary differs), ``INVALID_ARGUMENT`` for a bad request."""
        if self.draft_service is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this group is not a draft group (start it with --role draft)")
        return await self.draft_service.Draft(request, context)

    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedReply:
        """Embeddings (:mod:`mlxcluster.engine.embed`): each input's text is tokenised here (the
        tokenizer's special tokens added) unless it carries ids, checked against the context (cut to
        it with ``truncate``), queued through the scheduler (:meth:`Scheduler.embed`) and pooled as
        the model's config says; ``dimensions`` truncates (Matryoshka) where the model allows it.
        ``INVALID_ARGUMENT`` for bad input, ``FAILED_PRECONDITION`` where this group cannot embed
        (a prefill group, a pipeline, --afd, --pd), ``RESOURCE_EXHAUSTED`` when the queue is full,
        ``UNAVAILABLE`` when the group failed."""
        from ..engine import embed as _embed

        if self.prefill_service is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "embeddings: a prefill group (--role prefill) cannot compute embeddings")
        why = self.scheduler.embeddings_unsupported
        if why:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"embeddings: {why}")
        try:
            pooling = getattr(self, "_pooling", None)
            if pooling is None:  # reads the model's sentence-transformers files once
                pooling = self._pooling = await asyncio.to_thread(
                    _embed.pooling_of, self.source.path, self.source.config, getattr(self.source, "metadata", None))
        except _embed.EmbedError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"embeddings: {exc}")
        async with _aborts_on_failure(context, "embeddings"):
            dimensions = _embed.check_dimensions(pooling, int(request.dimensions))
            inputs = await asyncio.to_thread(self._embed_inputs, request)
            vectors = await self.scheduler.embed(inputs, pooling.mode)
        vectors = _embed.truncate_dimensions(vectors, dimensions)
        return pb.EmbedReply(embeddings=[pb.Embedding(values=row.tolist(), tokens=len(ids))
                                         for row, ids in zip(vectors, inputs)],
                             prompt_tokens=sum(len(ids) for ids in inputs))

    def _embed_inputs(self, request: pb.EmbedRequest) -> List[List[int]]:
        """The token ids of each input of an ``EmbedRequest`` (text tokenised, special tokens added),
        cut to the context with ``truncate``.  Raises ``ValueError`` (one line) for no input, an empty
        one, or one longer than the context without ``truncate``."""
        if not request.inputs:
            raise ValueError("no input to embed")
        context = self.source.context_length
        out = []
        for i, item in enumerate(request.inputs):
            ids = list(item.token_ids) if item.token_ids else \
                list(self.source.tokenizer.encode(item.text, add_special_tokens=True))
            if not ids:
                raise ValueError(f"input {i} is empty: it has no tokens to embed")
            if len(ids) > context:
                if not request.truncate:
                    raise ValueError(f"input {i} has {len(ids)} tokens, more than the model's context of "
                                     f"{context} tokens")
                ids = ids[:context]
            out.append(ids)
        return out

    async def Info(self, request, context) -> pb.InfoReply:
        from ..engine.kvquant import format_of

        kv = format_of(self.scheduler.engine.model)  # the KV caches' format
        return pb.InfoReply(model=self.source.name, world_size=self.scheduler.world_size,
                            backend=self.backend, context_length=self.source.context_length,
                            vocab_size=self.source.vocab_size, weight_format=self.weight_format,
                            capacity=self.scheduler.max_batch, max_queue=self.scheduler.max_queue,
                            queued=self.scheduler.queued, running=self.scheduler.running,
                            all_sum_us=self.all_sum_us, ranks=self._ranks(),
                            generated_tokens=self.scheduler.generated_tokens, first_tokens=self.scheduler.first_tokens,
                            ttft_seconds_sum=self.scheduler.ttft_seconds_sum,
                            batched_prompts=self.scheduler.batched_prompts,
                            cached_prompt_tokens=self.scheduler.cached_prompt_tokens,
                            batch_limit=self.scheduler.batch_limit,
                            itl_target_ms=self.scheduler.itl_target_s * 1000.0,
                            eos_token_ids=sorted(int(t) for t in self.source.eos_token_ids),
                            spec_drafted_tokens=self.scheduler.spec_stats.drafted,
                            spec_accepted_tokens=self.scheduler.spec_stats.accepted,
                            spec_steps=self.scheduler.spec_stats.steps,
                            spec_emitted_tokens=self.scheduler.spec_stats.tokens,
                            draft=self.scheduler.draft, draft_tokens=self.scheduler.draft_tokens,
                            busy_s=busy_s(self.scheduler.executor), step_s=step_s(self.scheduler.executor),
                            kv_bits=kv.bits,
                            kv_group_size=kv.group_size)

    def _ranks(self) -> List[pb.RankStatus]:
        """Every rank as rank 0 knows it now: its own memory, each rank N's last heartbeat."""
        import mlx.core as mx

        from ..control.link import LOST_AFTER_S

        if self._weight_bytes is None:
            from ..model.tp import weight_bytes

            self._weight_bytes = weight_bytes(self.scheduler.model)
        out = [pb.RankStatus(rank=0, active_memory_bytes=int(mx.get_active_memory()), weight_bytes=self._weight_bytes,
                             alive=not self.scheduler.broken)]
        now = asyncio.get_running_loop().time()
        for link in self.scheduler.ranks.links:
            h, seen = link.last_health, link.last_ok
            age = now - seen if seen is not None else -1.0
            out.append(pb.RankStatus(rank=link.rank, address=link.address, alive=0 <= age < LOST_AFTER_S,
                                     last_seen_s=max(0.0, age),
                                     active_memory_bytes=h.active_memory_bytes if h is not None else 0,
                                     weight_bytes=h.weight_bytes if h is not None else 0))
        return out



async def serve_rank0(model, source, executor, addresses: Sequence[str], bind: str, *, backend: str,
                      weight_format: str, credentials, all_sum_us: float = 0.0, step_timeout_s: float = 120.0,
                      max_batch: int = 8,
                      max_queue: int = 64, compile_decode: bool = True,
                      connect_timeout_s: float = 60.0, on_connecting: Optional[Callable[[], None]] = None,
                      on_ready: Optional[Callable[[], None]] = None, prefill_service=None,
                      decode_side=None, itl_target_s: float = 0.0, draft: str = "",
                      draft_tokens: int = 4, draft_service=None, prompt_cache=None, prompt_agree=None) -> None:
    """Rank 0's whole life: connect to ranks 1..N-1 at ``addresses[1:]``, serve
    ``Generation`` on ``bind:port of addresses[0]`` until SIGTERM or until the
    group breaks (then the process must be restarted).  ``credentials``
    (:class:`mlxcluster.security.Credentials`) make both the links to ranks N
    and the ``Generation`` service mutual TLS.  ``draft`` / ``draft_tokens``: the default
    speculative decoding of requests that do not ask (``--draft``, ``--draft-tokens``; "": off).
    ``draft_service``: a draft group's :class:`~mlxcluster.leader.remote_draft.DraftService`
    (``--role draft``: ``Generation.Draft``, on ``executor``).  ``prompt_cache``: the prefix cache's
    disk tier (``--prompt-cache-dir``, :class:`~mlxcluster.engine.prompt_disk.DiskPrompts`).

    Raises:
        RankError: a rank N did not answer, or the group broke while serving.
        RuntimeError: the address cannot be bound.
    """
    import signal

    from .scheduler import Scheduler

    group = RankGroup()
    group.bind()
    if on_connecting:
        on_connecting()
    for rank in range(1, len(addresses)):
        group.add(await RankLink(rank, addresses[rank], group.deliver, credentials).open(connect_timeout_s))
    scheduler = Scheduler(model, group, source.vocab_size, source.context_length, executor,
                          step_timeout_s=step_timeout_s, max_batch=max_batch, max_queue=max_queue,
                          compile_decode=compile_decode, decode_side=decode_side,
                          tokenizer=source.tokenizer, itl_target_s=itl_target_s, draft=draft,
                          draft_tokens=draft_tokens, model_path=source.path, credentials=credentials)
    if not scheduler.engine.attach_disk(prompt_cache, prompt_agree) and prompt_cache is not None:
        log.warning("--prompt-cache-dir: this model keeps no prefix cache; nothing is written")
    stop = asyncio.Event()
    # no SO_REUSEPORT (gRPC's default on Linux): a second server on this port fails to start instead
    # of silently taking half of its connections (a rank 0 of an earlier group still stopping there)
    server = grpc.aio.server(options=_PD_OPTIONS + [("grpc.so_reuseport", 0)])
    pb_grpc.add_GenerationServicer_to_server(
        GenerationServicer(scheduler, source, backend, weight_format, all_sum_us, prefill_service, draft_service),
        server)
    port = int(addresses[0].rsplit(":", 1)[1])
    if server.add_secure_port(f"{bind}:{port}", credentials.server()) == 0:
        raise RuntimeError(f"cannot listen on {bind}:{port}")
    await server.start()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    group.on_broken = stop.set
    if on_ready:
        on_ready()
    await stop.wait()
    # grace: the failing request's error (or the last tokens) reach their clients
    await server.stop(grace=1.0)
    await scheduler.close()
    if group.broken:
        raise RankError(group.broken)


# -- the client ----------------------------------------------------------------

class ClientError(RuntimeError):
    """The request failed; ``str()`` is the server's one-line reason."""

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None):
        super().__init__(message)
        self.code = code


@dataclass
class GenerationResult:
    """A finished generation (token ids, text and the session's timings)."""

    prompt_ids: List[int] = field(default_factory=list)
    cached_prompt_tokens: int = 0  # leading prompt positions taken from the prefix caches
    token_ids: List[int] = field(default_factory=list)
    text: str = ""
    reason: str = ""
    ttft_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    peak_memory_bytes_per_rank: List[int] = field(default_factory=list)
    handoff_bytes: int = 0       # --local-decode (see GenerateDone)
    handoff_s: float = 0.0
    handoff_fallback: str = ""
    pd_prefill_s: float = 0.0    # prefill/decode disaggregation (see GenerateDone)
    pd_tail_s: float = 0.0
    pd_streamed_s: float = 0.0
    spec_drafted_tokens: int = 0   # speculative decoding (see GenerateDone)
    spec_accepted_tokens: int = 0
    spec_steps: int = 0
    decode_steps: int = 0
    #: with ``logprobs``: per token, its log-probability and the ``top_logprobs`` most likely tokens'
    #: ``((token_id, logprob), ...)`` (natural log, float32 from the rank that samples)
    logprobs: List[Tuple[float, Tuple[Tuple[int, float], ...]]] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted draft tokens (0 when nothing was drafted)."""
        return self.spec_accepted_tokens / self.spec_drafted_tokens if self.spec_drafted_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens decoded per decode step after the first token (0 before any step)."""
        steps = len(self.token_ids) - 1
        return steps / self.decode_steps if self.decode_steps and steps > 0 else 0.0


def collect(events: Iterable[pb.GenerateEvent]) -> GenerationResult:
    """A whole generation's ``GenerateEvent`` stream (:meth:`GenerationClient.stream`) collected
    into a :class:`GenerationResult` (token ids, text, the ``done`` timings)."""
    result = GenerationResult()
    parts: List[str] = []
    for event in events:
        kind = event.WhichOneof("event")
        if kind == "started":
            result.prompt_ids = list(event.started.prompt_ids)
            result.cached_prompt_tokens = event.started.cached_prompt_tokens
        elif kind == "token":
            result.token_ids.append(event.token.token_id)
            parts.append(event.token.text)
            if event.token.top_logprobs or event.token.logprob:
                result.logprobs.append((event.token.logprob, tuple((t.token_id, t.logprob)
                                                                   for t in event.token.top_logprobs)))
        elif kind == "done":
            d = event.done
            parts.append(d.text_tail)
            result.reason = pb.StopReason.Name(d.reason)
            result.ttft_s = d.ttft_s
            result.prefill_tokens_per_s = d.prefill_tokens_per_s
            result.decode_tokens_per_s = d.decode_tokens_per_s
            result.peak_memory_bytes_per_rank = list(d.peak_memory_bytes_per_rank)
            result.handoff_bytes, result.handoff_s = d.handoff_bytes, d.handoff_s
            result.handoff_fallback = d.handoff_fallback
            result.pd_prefill_s, result.pd_tail_s, result.pd_streamed_s = d.pd_prefill_s, d.pd_tail_s, d.pd_streamed_s
            result.spec_drafted_tokens, result.spec_accepted_tokens = d.spec_drafted_tokens, d.spec_accepted_tokens
            result.spec_steps, result.decode_steps = d.spec_steps, d.decode_steps
    result.text = "".join(parts)
    return result


class GenerationClient:
    """Talks to rank 0 at ``address`` (``host:port``) over mutual TLS with
    ``credentials`` (:class:`mlxcluster.security.Credentials`): rank 0 must prove
    the cluster secret before the request (prompt included) is sent."""

    def __init__(self, address: str, credentials, timeout_s: float = 600.0):
        self.address, self.credentials = address, credentials
        self.timeout_s = timeout_s
        self.channel = credentials.channel(address)
        self.stub = pb_grpc.GenerationStub(self.channel)

    def info(self) -> pb.InfoReply:
        try:
            return self.stub.Info(pb.InfoRequest(), timeout=10)
        except grpc.RpcError as exc:
            raise ClientError(exc.details() or str(exc.code()), exc.code()) from None

    def stream(self, prompt: str = "", *, prompt_ids: Sequence[int] = (), chat: bool = False,
               system: str = "", max_tokens: int = 128, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, logit_bias: Optional[Dict[int, float]] = None,
               presence_penalty: float = 0.0, frequency_penalty: float = 0.0, logprobs: bool = False,
               top_logprobs: int = 0, grammar: str = "", top_k: int = 0, min_p: float = 0.0,
               repetition_penalty: Optional[float] = None, repetition_context_size: Optional[int] = None,
               messages: Sequence[Tuple[str, str]] = (), resume_token_ids: Sequence[int] = (),
               speculative: Optional[Tuple[str, int]] = None) -> Iterator[pb.GenerateEvent]:
        """Yield ``GenerateEvent`` messages (started, token..., done).  ``messages``: a whole
        conversation, ``(role, content)`` pairs ending with the user's turn, through the chat
        template (instead of ``prompt``; :func:`chat_messages`).  ``temperature`` (0:
        greedy), ``top_p``, ``top_k`` (0: off), ``min_p`` (0: off) and ``seed`` are mlx-lm's
        sampler options; ``logit_bias`` (token id -> added logit), the penalties (OpenAI's
        presence/frequency, mlx-lm's ``repetition_penalty`` over the last
        ``repetition_context_size`` tokens, default 1.0 = off and 20) are logits processors
        (:class:`mlxcluster.engine.sampling.LogitsProcessor`); ``logprobs`` fills each token's
        ``logprob`` (and ``top_logprobs`` of the most likely); ``grammar`` (an llguidance
        grammar, :func:`mlxcluster.engine.constraint.json_grammar`) constrains the answer.
        Rank 0 checks the values (:func:`~mlxcluster.protocol.args.check_args`).  ``resume_token_ids`` (lossless
        failover): the answer's first tokens, already delivered by an earlier group; the same
        request with them continues that answer token for token and text piece for text piece
        (:meth:`GenerationServicer.Generate`).  ``speculative``: ``(draft, draft_tokens)``, the
        request's speculative decoding (``GenerateRequest.speculative``; ``None``: the server's default).

        Raises:
            ClientError: invalid input (``INVALID_ARGUMENT``, one line naming the field), a failed
                group, or rank 0 unreachable.
        """
        args = GenerationArgs(
            sampling=SamplingArgs(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed),
            logits=LogitsArgs(logit_bias=tuple(sorted((logit_bias or {}).items())), presence_penalty=presence_penalty,
                              frequency_penalty=frequency_penalty,
                              repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
                              repetition_context_size=REPETITION_CONTEXT_SIZE if repetition_context_size is None
                              else repetition_context_size),
            max_tokens=max_tokens, logprobs=logprobs, top_logprobs=top_logprobs, grammar=grammar,
            speculative=None if speculative is None else (speculative[0], int(speculative[1])))
        request = to_request(args, prompt_ids, prompt=prompt, chat=chat, system=system,
                             messages=[pb.ChatMessage(role=r, content=c) for r, c in messages],
                             resume_token_ids=[int(t) for t in resume_token_ids])
        call = self.stub.Generate(request, timeout=self.timeout_s)
        started = False
        try:
            for event in call:
                started = True
                yield event
        except grpc.RpcError as exc:
            details = exc.details() or str(exc.code())
            if started and exc.code() == grpc.StatusCode.UNAVAILABLE and "Socket closed" in details \
                    and not details.startswith("tensor-parallel group failed"):
                # rank 0 itself went away (not its own report of a failed group)
                details = f"rank 0 at {self.address} stopped mid-generation: its group failed ({details})"
            raise ClientError(details, exc.code()) from None
        finally:
            call.cancel()

    def generate(self, prompt: str = "", **kwargs) -> GenerationResult:
        """Run a whole generation and collect it (see :meth:`stream`)."""
        return collect(self.stream(prompt, **kwargs))

    def embed(self, texts: Sequence[str] = (), *, token_ids: Sequence[Sequence[int]] = (), dimensions: int = 0,
              truncate: bool = False) -> pb.EmbedReply:
        """The embeddings of ``texts`` (or of the token id lists ``token_ids``): an ``EmbedReply``
        (one float32 ``Embedding`` per input, in order, L2 norm 1; ``dimensions`` 0: the model's width).

        Raises:
            ClientError: invalid input, a group that cannot embed, a failed group, or rank 0 unreachable.
        """
        inputs = [pb.EmbedInput(text=t) for t in texts] + [pb.EmbedInput(token_ids=list(ids)) for ids in token_ids]
        try:
            return self.stub.Embed(pb.EmbedRequest(inputs=inputs, dimensions=dimensions, truncate=truncate),
                                   timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise ClientError(exc.details() or str(exc.code()), exc.code()) from None

    def close(self) -> None:
        self.channel.close()

"""Rank 0's client-facing ``Generation`` gRPC service (text in, token stream out)."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Callable, List, Optional

import grpc

from ..protocol import mlxcluster_pb2 as pb
from ..protocol import mlxcluster_pb2_grpc as pb_grpc
from ..control.engine import QueueFullError, RankError, SessionStats, TensorParallelEngine
from ..protocol.frames import secrets_match

log = logging.getLogger(__name__)

__all__ = ["GenerationServicer", "serve_generation", "DEFAULT_MAX_TOKENS"]

DEFAULT_MAX_TOKENS = 128


class GenerationServicer(pb_grpc.GenerationServicer):
    """Tokenises a request (optionally through the chat template), streams the
    engine's tokens with their detokenised text, and ends with the session's
    timings.  Errors map to gRPC status codes: ``INVALID_ARGUMENT`` for bad
    input, ``UNAVAILABLE`` when the tensor-parallel group failed,
    ``UNAUTHENTICATED`` for a wrong secret."""

    def __init__(self, engine: TensorParallelEngine, source, backend: str, weight_format: str,
                 shutdown: asyncio.Event, secret: str = ""):
        self.engine = engine
        self.source = source
        self.backend = backend
        self.weight_format = weight_format
        self.shutdown = shutdown
        self.secret = secret

    def _tokenize(self, request: pb.GenerateRequest) -> List[int]:
        from ..model.tokenizer import apply_chat

        if request.prompt_ids:
            return list(request.prompt_ids)
        if request.chat:
            return apply_chat(self.source.tokenizer, request.prompt, request.system or None)
        return list(self.source.tokenizer.encode(request.prompt, add_special_tokens=True))

    async def _check_secret(self, secret: str, context) -> None:
        if self.secret and not secrets_match(secret, self.secret):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong cluster secret")

    async def Generate(self, request: pb.GenerateRequest, context):
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        await self._check_secret(request.secret, context)
        try:
            ids = self._tokenize(request)
            self.engine.validate_prompt(ids)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        max_tokens = request.max_tokens or DEFAULT_MAX_TOKENS
        detok = TokenizerWrapper(self.source.tokenizer).detokenizer
        detok.reset()
        s = request.sampling
        st = SessionStats(uid="")
        stream = self.engine.generate(ids, max_tokens, self.source.eos_token_ids,
                                      temperature=s.temperature, top_p=s.top_p or 1.0, seed=s.seed, stats=st)
        started = False
        try:
            async for token in stream:
                if not started:
                    yield pb.GenerateEvent(started=pb.GenerateStarted(prompt_ids=ids))
                    started = True
                if token in self.source.eos_token_ids:
                    text = ""
                else:
                    detok.add_token(token)
                    text = detok.last_segment
                yield pb.GenerateEvent(token=pb.GeneratedToken(token_id=token, text=text))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFullError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except RankError as exc:
            log.error("generation failed: %s", exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"tensor-parallel group failed: {exc}")
        finally:
            await stream.aclose()
        detok.finalize()
        yield pb.GenerateEvent(done=pb.GenerateDone(
            reason=st.reason, ttft_s=st.ttft_s, prefill_tokens_per_s=st.prefill_tokens_per_s,
            decode_tokens_per_s=st.decode_tokens_per_s,
            peak_memory_bytes_per_rank=st.peak_memory_bytes_per_rank,
            text_tail=detok.last_segment, generated_tokens=st.generated_tokens))

    async def Info(self, request, context) -> pb.InfoReply:
        return pb.InfoReply(model=self.source.name, world_size=self.engine.world_size,
                            backend=self.backend, context_length=self.source.context_length,
                            vocab_size=self.source.vocab_size, weight_format=self.weight_format,
                            capacity=self.engine.max_batch, max_queue=self.engine.max_queue,
                            queued=self.engine.queued, running=self.engine.running)

    async def Shutdown(self, request, context) -> pb.ShutdownReply:
        await self._check_secret(request.secret, context)
        self.shutdown.set()
        return pb.ShutdownReply()


async def serve_generation(engine: TensorParallelEngine, source, address: str, backend: str,
                           weight_format: str, on_ready: Optional[Callable[[], None]] = None) -> None:
    """Serve ``Generation`` on ``address`` until ``Shutdown``, SIGTERM, or the
    group breaks (then the process must be restarted)."""
    import signal

    shutdown = asyncio.Event()
    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(
        GenerationServicer(engine, source, backend, weight_format, shutdown,
                           os.environ.get("MLXCLUSTER_SECRET", "")), server)
    if server.add_insecure_port(address) == 0:
        raise RuntimeError(f"cannot listen on {address}")
    await server.start()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, shutdown.set)
    if on_ready:
        on_ready()
    while not shutdown.is_set():
        try:
            await asyncio.wait_for(shutdown.wait(), timeout=0.5)
        except asyncio.TimeoutError:
            pass
        if engine.broken:
            # Let the failing request's error reach its client, then exit.
            await asyncio.sleep(0.5)
            break
    await server.stop(grace=1.0)
    if engine.broken:
        raise RankError(engine.broken)

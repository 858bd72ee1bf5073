"""Client of rank 0's ``Generation`` service."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence

import grpc

from ..protocol import mlxcluster_pb2 as pb
from ..protocol import mlxcluster_pb2_grpc as pb_grpc

__all__ = ["GenerationClient", "ClientError", "GenerationResult"]


class ClientError(RuntimeError):
    """The request failed; ``str()`` is the server's one-line reason."""

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None):
        super().__init__(message)
        self.code = code


@dataclass
class GenerationResult:
    """A finished generation (token ids, text and the session's timings)."""

    prompt_ids: List[int] = field(default_factory=list)
    token_ids: List[int] = field(default_factory=list)
    text: str = ""
    reason: str = ""
    ttft_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    peak_memory_bytes_per_rank: List[int] = field(default_factory=list)


class GenerationClient:
    """Talks to rank 0 at ``address`` (``host:port``)."""

    def __init__(self, address: str, secret: str = "", timeout_s: float = 600.0):
        self.address = address
        self.secret = secret
        self.timeout_s = timeout_s
        self.channel = grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)])
        self.stub = pb_grpc.GenerationStub(self.channel)

    def info(self) -> pb.InfoReply:
        try:
            return self.stub.Info(pb.InfoRequest(), timeout=10)
        except grpc.RpcError as exc:
            raise ClientError(exc.details() or str(exc.code()), exc.code()) from None

    def stream(self, prompt: str = "", *, prompt_ids: Sequence[int] = (), chat: bool = False,
               system: str = "", max_tokens: int = 128, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0) -> Iterator[pb.GenerateEvent]:
        """Yield ``GenerateEvent`` messages (started, token..., done).

        Raises:
            ClientError: invalid input, a failed group, or rank 0 unreachable.
        """
        request = pb.GenerateRequest(
            prompt=prompt, prompt_ids=list(prompt_ids), chat=chat, system=system,
            max_tokens=max_tokens, secret=self.secret,
            sampling=pb.Sampling(temperature=temperature, top_p=top_p, seed=seed))
        call = self.stub.Generate(request, timeout=self.timeout_s)
        try:
            for event in call:
                yield event
        except grpc.RpcError as exc:
            raise ClientError(exc.details() or str(exc.code()), exc.code()) from None
        finally:
            call.cancel()

    def generate(self, prompt: str = "", **kwargs) -> GenerationResult:
        """Run a whole generation and collect it (see :meth:`stream`)."""
        result = GenerationResult()
        parts: List[str] = []
        for event in self.stream(prompt, **kwargs):
            kind = event.WhichOneof("event")
            if kind == "started":
                result.prompt_ids = list(event.started.prompt_ids)
            elif kind == "token":
                result.token_ids.append(event.token.token_id)
                parts.append(event.token.text)
            elif kind == "done":
                d = event.done
                parts.append(d.text_tail)
                result.reason = pb.StopReason.Name(d.reason)
                result.ttft_s = d.ttft_s
                result.prefill_tokens_per_s = d.prefill_tokens_per_s
                result.decode_tokens_per_s = d.decode_tokens_per_s
                result.peak_memory_bytes_per_rank = list(d.peak_memory_bytes_per_rank)
        result.text = "".join(parts)
        return result

    def close(self) -> None:
        self.channel.close()

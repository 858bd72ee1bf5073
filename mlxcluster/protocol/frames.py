"""Control frames exchanged between rank 0 and ranks N (see proto/mlxcluster.proto).

Frame type values match the Swift cluster app's ``ClusterMsgType``:
``promptTokens`` = 0x08, ``stepToken`` = 0x09, ``sessionStop`` = 0x0A; ``batchStep`` = 0x0B
and ``prefillChunk`` = 0x0C are this project's.
Frames carry no secret: the link they travel on is mutual TLS
(:mod:`mlxcluster.security`), so only secret holders can send or read them.
"""

from __future__ import annotations

from typing import Container, Iterable, Optional

from . import mlxcluster_pb2 as pb

PROMPT_TOKENS = pb.PROMPT_TOKENS
STEP_TOKEN = pb.STEP_TOKEN
SESSION_STOP = pb.SESSION_STOP
BATCH_STEP = pb.BATCH_STEP
PREFILL_CHUNK = pb.PREFILL_CHUNK

assert (PROMPT_TOKENS, STEP_TOKEN, SESSION_STOP) == (0x08, 0x09, 0x0A)

FRAME_NAMES = {PROMPT_TOKENS: "promptTokens", STEP_TOKEN: "stepToken", SESSION_STOP: "sessionStop",
               BATCH_STEP: "batchStep", PREFILL_CHUNK: "prefillChunk"}


def sampling_message(s) -> pb.Sampling:
    """The ``Sampling`` message of an engine :class:`~mlxcluster.engine.decode.Sampling` (read by attribute: no import of the engine here), as ranks N
    receive it (``logprobs`` and ``grammar`` concern rank 0 only and are left out)."""
    return pb.Sampling(temperature=s.temperature, top_p=s.top_p, seed=s.seed, logit_bias=dict(s.logit_bias),
                       presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty)


def prompt_tokens(uid: str, token_ids: Iterable[int], max_tokens: int,
                  temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                  eos_token_ids: Iterable[int] = (), route: str = "", epoch: str = "",
                  local_decode: bool = False, pd: bool = False, sampling: Optional[pb.Sampling] = None,
                  prefill_group: int = 0, cached_prefix: int = 0, chunked: bool = False) -> pb.Frame:
    """A ``promptTokens`` (0x08) frame: reset the KV cache and prefill ``token_ids``.

    ``route`` (:meth:`~mlxcluster.model.layout.Route.identity`) and ``epoch``: what a pipeline stage
    checks before it runs anything; ``local_decode``: the stages hand their K/V to rank 0
    after this prefill; ``pd``: every rank fetches its KV heads from the prefill group instead
    of prefilling (prefill/decode disaggregation); ``prefill_group``: one of that many
    consecutive frames prefilled together (batched prefill); ``cached_prefix``: leading positions
    taken from every rank's prefix cache; ``chunked``: admit only, the prompt is prefilled by
    :func:`prefill_chunk` frames."""
    return pb.Frame(
        type=PROMPT_TOKENS, uid=uid,
        prompt_tokens=pb.PromptTokens(
            token_ids=list(token_ids), max_tokens=max_tokens,
            sampling=sampling if sampling is not None else pb.Sampling(temperature=temperature, top_p=top_p,
                                                                       seed=seed),
            eos_token_ids=sorted(int(t) for t in eos_token_ids),
            route=route, epoch=epoch, local_decode=local_decode, pd=pd, prefill_group=prefill_group,
            cached_prefix=cached_prefix, chunked=chunked,
        ),
    )


def prefill_chunk(uid: str, position: int, count: int) -> pb.Frame:
    """A ``prefillChunk`` (0x0C) frame: prefill the ``count`` prompt tokens of chunked sequence
    ``uid`` at positions ``[position, position + count)``."""
    return pb.Frame(type=PREFILL_CHUNK, uid=uid, prefill_chunk=pb.PrefillChunk(position=position, count=count))


def step_token(uid: str, position: int, token: int) -> pb.Frame:
    """A ``stepToken`` (0x09) frame: decode ``token`` at sequence index ``position``."""
    return pb.Frame(type=STEP_TOKEN, uid=uid, step_token=pb.StepToken(position=position, token=token))


def batch_step(entries: Iterable[tuple]) -> pb.Frame:
    """A ``batchStep`` (0x0B) frame: one decode step of every resident sequence.

    ``entries``: ``(uid, position, token)`` per sequence, in batch order.
    """
    return pb.Frame(type=BATCH_STEP, batch_step=pb.BatchStep(
        entries=[pb.BatchEntry(uid=u, position=p, token=t) for u, p, t in entries]))


def session_stop(uid: str, reason: int = pb.EOS, detail: str = "") -> pb.Frame:
    """A ``sessionStop`` (0x0A) frame: end the session and free its KV cache."""
    return pb.Frame(type=SESSION_STOP, uid=uid,
                    session_stop=pb.SessionStop(reason=reason, detail=detail))


def stop_reason(token: int, generated: int, kv_length: int, eos_token_ids: Container[int],
                max_tokens: int, context_length: int) -> int:
    """The deterministic stop after a sampled ``token``, the ``generated``-th of
    its sequence, when the KV cache holds ``kv_length`` positions: ``EOS``,
    ``MAX_TOKENS``, ``CONTEXT_FULL``, or 0 (``STOP_REASON_UNSPECIFIED``) to go
    on.  Rank 0 applies this one rule after every token it samples."""
    if token in eos_token_ids:
        return pb.EOS
    if generated >= max_tokens:
        return pb.MAX_TOKENS
    if kv_length + 1 >= context_length:
        return pb.CONTEXT_FULL
    return pb.STOP_REASON_UNSPECIFIED


def error_reply(frame: pb.Frame, rank: int, code: int, message: str,
                position: Optional[int] = None) -> pb.FrameReply:
    """A rejection of ``frame``: the rank ran nothing for it."""
    return pb.FrameReply(uid=frame.uid, type=frame.type, ok=False, code=code,
                         error=message, rank=rank, position=position or 0)


def describe(frame: pb.Frame) -> str:
    """Short human-readable form, e.g. ``stepToken(uid=ab12, pos=7, token=42)``."""
    name = FRAME_NAMES.get(frame.type, f"0x{frame.type:02X}")
    which = frame.WhichOneof("payload")
    if which == "prompt_tokens":
        return f"{name}(uid={frame.uid}, {len(frame.prompt_tokens.token_ids)} tokens)"
    if which == "step_token":
        return f"{name}(uid={frame.uid}, pos={frame.step_token.position}, token={frame.step_token.token})"
    if which == "batch_step":
        return f"{name}({len(frame.batch_step.entries)} sequences)"
    if which == "prefill_chunk":
        c = frame.prefill_chunk
        return f"{name}(uid={frame.uid}, pos={c.position}, {c.count} tokens)"
    if which == "session_stop":
        return f"{name}(uid={frame.uid}, reason={pb.StopReason.Name(frame.session_stop.reason)})"
    return f"{name}(uid={frame.uid})"

"""Control frames exchanged between rank 0 and ranks N (see proto/mlxcluster.proto).

One frame per iteration of rank 0's loop: a ``stepPlan`` (0x0D), whose parts keep the Swift
cluster app's ``ClusterMsgType`` names (``promptTokens`` joins, ``stepToken``/``batchStep``
decode entries, ``sessionStop`` leaves) and add ``prefillChunk`` entries and ``embeds``
(embedding inputs, :func:`embed_entry`).  Frames carry no
secret: the link they travel on is mutual TLS (:mod:`mlxcluster.security`), so only secret
holders can send or read them.
"""

from __future__ import annotations

from typing import Container, Iterable, Optional

from . import mlxcluster_pb2 as pb

STEP_PLAN = pb.STEP_PLAN

assert STEP_PLAN == 0x0D

#: the K/V sources of a join (``PromptTokens.source``)
COMPUTE, HANDOFF, REMOTE = "compute", "handoff", "remote"


def sampling_message(s) -> pb.Sampling:
    """The ``Sampling`` message of an engine :class:`~mlxcluster.engine.sampling.Sampling` (read by attribute: no import of the engine here), as ranks N
    receive it (``logprobs`` and ``grammar`` concern rank 0 only and are left out)."""
    return pb.Sampling(temperature=s.temperature, top_p=s.top_p, seed=s.seed, logit_bias=dict(s.logit_bias),
                       presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                       top_k=s.top_k, min_p=s.min_p, repetition_penalty=s.repetition_penalty,
                       repetition_context_size=s.repetition_context_size)


def prompt_tokens(uid: str, token_ids: Iterable[int], max_tokens: int,
                  temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                  eos_token_ids: Iterable[int] = (), sampling: Optional[pb.Sampling] = None,
                  source: str = COMPUTE, cached: int = 0, chunked: bool = False, salt: str = "",
                  disk: bool = False, every_rank_samples: bool = False, resumed: int = 0) -> pb.PromptTokens:
    """A join (``promptTokens``): sequence ``uid`` with prompt ``token_ids`` (int ids) and its K/V
    from ``source``: :data:`COMPUTE` (``cached`` leading positions from every rank's prefix cache,
    under namespace ``salt`` -- the prompt is held there too --, with ``disk`` as many of them as
    every rank's disk tier holds (``ComputeSource.disk``), the rest prefilled in the plan, or with ``chunked`` by :func:`prefill_chunk` entries),
    :data:`HANDOFF` (``--local-decode``: prefilled through the pipeline, in the plan or with
    ``chunked`` by chunk entries, then the stages' K/V sent to rank 0) or :data:`REMOTE` (fetched
    from the prefill group).  ``every_rank_samples``: every rank samples the sequence itself (the
    plan's decode entries confirm its tokens); ``resumed``: how many of the prompt's last tokens are
    the answer's first (lossless failover: the seeded sampler's next index)."""
    msg = pb.PromptTokens(
        uid=uid, token_ids=list(token_ids), max_tokens=max_tokens, every_rank_samples=every_rank_samples,
        resumed=resumed,
        sampling=sampling if sampling is not None else pb.Sampling(temperature=temperature, top_p=top_p, seed=seed),
        eos_token_ids=sorted(int(t) for t in eos_token_ids))
    if source == COMPUTE:
        msg.compute.CopyFrom(pb.ComputeSource(cached=cached, chunked=chunked, salt=salt, disk=disk))
    elif source == HANDOFF:
        msg.handoff.CopyFrom(pb.HandoffSource(chunked=chunked))
    elif source == REMOTE:
        msg.remote.SetInParent()
    else:
        raise ValueError(f"unknown K/V source {source!r}")
    return msg


def prefill_chunk(uid: str, position: int, count: int) -> pb.PrefillChunk:
    """A ``prefillChunk`` entry: prefill the ``count`` prompt tokens of chunked sequence ``uid`` at
    positions ``[position, position + count)``."""
    return pb.PrefillChunk(uid=uid, position=position, count=count)


def embed_entry(uid: str, token_ids: Iterable[int]) -> pb.EmbedEntry:
    """An ``embeds`` entry: the final hidden state of input ``uid`` (its int ``token_ids``, at most
    the context length) is computed by every rank and pooled by rank 0 (:mod:`mlxcluster.engine.embed`)."""
    return pb.EmbedEntry(uid=uid, token_ids=list(token_ids))


def session_stop(uid: str, reason: int = pb.EOS, detail: str = "") -> pb.SessionStop:
    """A leave (``sessionStop``): end sequence ``uid`` and free its KV cache."""
    return pb.SessionStop(uid=uid, reason=reason, detail=detail)


def step_plan(leaves: Iterable[pb.SessionStop] = (), decode: Iterable[tuple] = (),
              joins: Iterable[pb.PromptTokens] = (), chunks: Iterable[pb.PrefillChunk] = (),
              batched: bool = False, route: str = "", epoch: str = "", step: int = 0,
              embeds: Iterable[pb.EmbedEntry] = (), kept: Iterable[int] = (), ahead: bool = False,
              settled: bool = False) -> pb.Frame:
    """The ``stepPlan`` frame of one iteration (proto/mlxcluster.proto ``StepPlan``: the previous verify
    step's ``kept`` counts, leaves, then the decode step, then joins, then chunks, then the embeds as
    one forward pass, on every rank).  ``decode``: ``(uid, position, token)`` or ``(uid, position,
    token, draft)`` (int ids: a speculative verify step) per sequence of the batch, in batch order
    (empty: no decode step); ``batched``: the joins computed now are prefilled together;
    ``route``/``epoch``: what a pipeline stage checks; ``kept``: per decode entry of the previous
    plan's verify step, the positions it keeps; ``ahead``: every rank queues the next decode step on
    this one's lazy tokens (lookahead); ``settled``: the previous plan's queued step is kept first."""
    entries = [pb.BatchEntry(uid=e[0], position=e[1], token=e[2], draft=list(e[3]) if len(e) > 3 else [])
               for e in decode]
    return pb.Frame(type=STEP_PLAN, step_plan=pb.StepPlan(
        step=step, leaves=list(leaves), decode=entries, joins=list(joins), batched=batched, chunks=list(chunks),
        route=route, epoch=epoch, embeds=list(embeds), kept=list(kept), ahead=ahead, settled=settled))


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


def error_reply(rank: int, code: int, message: str, uid: str = "", position: Optional[int] = None
                ) -> pb.FrameReply:
    """A rejection of a plan (about sequence ``uid`` where one is to blame): the rank ran nothing of it."""
    return pb.FrameReply(uid=uid, type=STEP_PLAN, ok=False, code=code, error=message, rank=rank,
                         position=position or 0)


def source_of(join: pb.PromptTokens) -> str:
    """A join's K/V source: :data:`COMPUTE`, :data:`HANDOFF` or :data:`REMOTE` (unset: compute)."""
    return join.WhichOneof("source") or COMPUTE


def chunked(join: pb.PromptTokens) -> bool:
    """Whether a join's prompt is prefilled by chunk entries (a computed or handoff source)."""
    return (join.compute.chunked if join.HasField("compute") else
            join.handoff.chunked if join.HasField("handoff") else False)


def describe(frame: pb.Frame) -> str:
    """Short human-readable form, e.g.
    ``stepPlan(step=7: leave ab12 MAX_TOKENS; decode 2; join cd34 5 tokens compute; chunk ef56 512+100)``."""
    if frame.WhichOneof("payload") != "step_plan":
        return f"0x{frame.type:02X}(malformed)"
    p = frame.step_plan
    parts = [f"kept {list(p.kept)}"] if p.kept else []
    parts += ["settled"] if p.settled else []
    parts += [f"leave {x.uid} {pb.StopReason.Name(x.reason)}" for x in p.leaves]
    if p.decode:
        parts.append(f"decode {len(p.decode)}" if len(p.decode) > 1 else
                     f"decode {p.decode[0].uid} pos={p.decode[0].position} token={p.decode[0].token}")
        drafted = sum(len(e.draft) for e in p.decode)
        if drafted:
            parts[-1] += f" verify {drafted} drafted"
        if p.ahead:
            parts[-1] += " ahead"
    for j in p.joins:
        src = source_of(j)
        if src == COMPUTE and (j.compute.cached or j.compute.chunked):
            src += f"(cached={j.compute.cached}{', chunked' if j.compute.chunked else ''})"
        elif src == HANDOFF and j.handoff.chunked:
            src += "(chunked)"
        parts.append(f"join {j.uid} {len(j.token_ids)} tokens {src}")
    if p.batched:
        parts.append("batched")
    parts += [f"chunk {c.uid} {c.position}+{c.count}" for c in p.chunks]
    if p.embeds:
        parts.append(f"embed {len(p.embeds)} inputs, {sum(len(e.token_ids) for e in p.embeds)} tokens")
    return f"stepPlan(step={p.step}: {'; '.join(parts) or 'empty'})"

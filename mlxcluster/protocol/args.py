"""One typed generation request, from the HTTP front to rank 0: :class:`GenerationArgs`, its one check
(:func:`check_args`) and its one conversion to the wire and back (:func:`to_request`, :func:`from_request`).

Like mlx-lm's ``server.py`` (``GenerationArguments`` = ``SamplingArguments`` + ``LogitsProcessorArguments``
+ stop words, limits, draft tokens, logprobs, seed: built once per HTTP request and carried to the
generation loop), a request's sampling, logits processors, stop strings, limits, speculation and cache
namespace travel as one frozen value.  Every dialect's body becomes one (the provider's
:meth:`~mlxcluster.front.provider.Provider.request_args`), :func:`check_args` checks its ranges, the
provider sends it as a ``GenerateRequest`` (:func:`to_request`) and rank 0 reads it back
(:func:`from_request`) and checks it again with the same :func:`check_args` (a gRPC caller is untrusted),
so a value out of range is refused with the same one-line message over every HTTP dialect and over gRPC.

Imports only the generated protocol (no MLX, no engine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Tuple

from . import mlxcluster_pb2 as pb

__all__ = ["ArgumentError", "GenerationArgs", "LogitsArgs", "SamplingArgs", "check_args", "from_request",
           "to_request", "MAX_LOGIT_BIAS", "MAX_TOP_LOGPROBS", "REPETITION_CONTEXT_SIZE"]

#: OpenAI's bound on ``top_logprobs`` (chat)
MAX_TOP_LOGPROBS = 20
#: entries of a ``logit_bias`` map
MAX_LOGIT_BIAS = 1024
#: mlx-lm's default window of the repetition penalty (``make_logits_processors``; mlx_lm.server's
#: ``repetition_context_size``), in tokens
REPETITION_CONTEXT_SIZE = 20


@dataclass(frozen=True)
class SamplingArgs:
    """The sampler's settings (mlx-lm server.py ``SamplingArguments``, plus the seed): ``temperature``
    (0: greedy), ``top_p`` (nucleus, 1: off), ``top_k`` (0: off), ``min_p`` (0: off), ``seed`` (uint64)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0


@dataclass(frozen=True)
class LogitsArgs:
    """The logits processors (mlx-lm server.py ``LogitsProcessorArguments``): ``logit_bias``
    (``((token_id, bias), ...)`` sorted by token id, added to the logits), OpenAI's
    ``presence_penalty`` / ``frequency_penalty``, mlx-lm's ``repetition_penalty`` (1: off) over the last
    ``repetition_context_size`` tokens of prompt + answer."""

    logit_bias: Tuple[Tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = REPETITION_CONTEXT_SIZE


@dataclass(frozen=True)
class GenerationArgs:
    """One request's generation settings (mlx-lm server.py ``GenerationArguments``).

    Attributes:
        sampling: :class:`SamplingArgs`.
        logits: :class:`LogitsArgs`.
        max_tokens: most tokens to generate (0: the server's default).
        max_tokens_field: the request field that set ``max_tokens`` ("" the default): a limit asked
            for is refused when it does not fit the context, a default one is cut to it.
        stop: stop strings (the front applies them; never on the wire).
        logprobs: report each token's log-probability, and ``top_logprobs`` (0..20) alternatives'.
        grammar: an llguidance grammar constraining the answer ("" none).
        speculative: ``(draft, draft_tokens)`` (``GenerateRequest.speculative``), or ``None``: the
            server's default.
        cache_salt: the prompt's prefix-cache namespace ("" shared).
    """

    sampling: SamplingArgs = field(default_factory=SamplingArgs)
    logits: LogitsArgs = field(default_factory=LogitsArgs)
    max_tokens: int = 0
    max_tokens_field: str = ""
    stop: Tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: str = ""
    speculative: Optional[Tuple[str, int]] = None
    cache_salt: str = ""


class ArgumentError(ValueError):
    """A :class:`GenerationArgs` value out of range: one line, ``'<param>' must be <rule>, got <value>``
    (or, for a ``logit_bias`` entry, its own wording).

    Attributes:
        param: the request field (``temperature``, ``logit_bias``): an HTTP error's ``param``.
        path: the value's place within it (``logit_bias[3]``; else ``param``).
        rule: what the value must be (``at least 0``).
        value: the value refused, as shown.
    """

    def __init__(self, param: str, rule: str, value: Any, path: str = "", message: str = ""):
        self.param, self.path, self.rule, self.value = param, path or param, rule, _shown(value)
        super().__init__(message or f"'{param}' must be {rule}, got {self.value}")


def _shown(value: Any) -> str:
    """A number as a request would write it: ``-1`` for ``-1.0``, ``nan``, ``2.5``."""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)


def _range(param: str, value: float, lo: Optional[float] = None, hi: Optional[float] = None,
           lo_open: bool = False, rule: str = "") -> None:
    """Raise :class:`ArgumentError` unless ``value`` is finite and within ``lo`` (exclusive with
    ``lo_open``) .. ``hi``; ``rule`` replaces the wording of a value below ``lo``."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ArgumentError(param, "a finite number", value)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ArgumentError(param, rule or f"{'greater than' if lo_open else 'at least'} {_shown(lo)}", value)
    if hi is not None and value > hi:
        raise ArgumentError(param, f"at most {_shown(hi)}", value)


def check_args(args: GenerationArgs, vocab_size: int = 0) -> GenerationArgs:
    """The one range check of a request's generation settings, at the HTTP edge (the provider) and at
    rank 0's gRPC service alike: ``temperature`` in [0, 2]; ``top_p`` in (0, 1]; ``top_k`` >= 0 (0:
    off); ``min_p`` in [0, 1]; ``seed`` in [0, 2**64); ``presence_penalty`` / ``frequency_penalty`` in
    [-2, 2]; ``repetition_penalty`` > 0; ``repetition_context_size`` >= 0; ``logit_bias``: at most
    :data:`MAX_LOGIT_BIAS` entries, token ids in ``[0, vocab_size)`` (``vocab_size`` 0: unchecked),
    biases in [-100, 100]; ``top_logprobs`` in [0, 20].  NaN and infinities fail every range.
    (OpenAI's ranges, and mlx_lm.server's ``validate_model_parameters`` for its own fields.)

    Returns:
        ``args``, unchanged.

    Raises:
        ArgumentError: the first value out of range, one line naming its field.
    """
    s, lg = args.sampling, args.logits
    _range("temperature", s.temperature, 0, 2)
    _range("top_p", s.top_p, 0, 1, lo_open=True)
    _range("top_k", s.top_k, 0, rule="at least 0 (0: off)")
    _range("min_p", s.min_p, 0, 1)
    _range("seed", s.seed, 0, 2**64 - 1)
    _range("presence_penalty", lg.presence_penalty, -2, 2)
    _range("frequency_penalty", lg.frequency_penalty, -2, 2)
    _range("repetition_penalty", lg.repetition_penalty, 0, lo_open=True)
    _range("repetition_context_size", lg.repetition_context_size, 0)
    _check_bias(lg.logit_bias, vocab_size)
    _range("top_logprobs", args.top_logprobs, 0, MAX_TOP_LOGPROBS)
    return args


def _check_bias(bias: Sequence[Tuple[int, float]], vocab_size: int) -> None:
    if len(bias) > MAX_LOGIT_BIAS:
        raise ArgumentError("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens", f"{len(bias)} tokens",
                            message=f"'logit_bias' takes at most {MAX_LOGIT_BIAS} tokens")
    for token, value in bias:
        if token < 0 or (vocab_size > 0 and token >= vocab_size):
            where = f"0..{vocab_size - 1}" if vocab_size > 0 else "token ids >= 0"
            raise ArgumentError("logit_bias", f"keyed by token ids in the vocabulary ({where})", token,
                                message=f"'logit_bias' token {token} is outside the vocabulary ({where})")
        if not (math.isfinite(value) and -100 <= value <= 100):
            raise ArgumentError("logit_bias", "in [-100, 100]", value, path=f"logit_bias[{token}]",
                                message=f"'logit_bias' value for token {token} must be a number in [-100, 100], "
                                        f"got {_shown(value)}")


def to_request(args: GenerationArgs, prompt_ids: Sequence[int] = (), max_tokens: Optional[int] = None,
               **request: Any) -> pb.GenerateRequest:
    """The one conversion of :class:`GenerationArgs` to the wire: a ``GenerateRequest`` for
    ``prompt_ids`` (int token ids) with ``args``' sampling, processors, limit (``max_tokens``, else
    ``args.max_tokens``), speculation and cache salt; ``request``: other ``GenerateRequest`` fields
    (``prompt``, ``chat``, ``messages``, ...).  ``stop`` and ``max_tokens_field`` stay with the caller.

    Raises:
        ValueError: a token id or value the message's fields cannot hold (beyond int32)."""
    s, lg = args.sampling, args.logits
    sampling = pb.Sampling(temperature=s.temperature, top_p=s.top_p, seed=s.seed, top_k=s.top_k, min_p=s.min_p,
                           logit_bias=dict(lg.logit_bias), presence_penalty=lg.presence_penalty,
                           frequency_penalty=lg.frequency_penalty, repetition_penalty=lg.repetition_penalty,
                           repetition_context_size=lg.repetition_context_size, logprobs=args.logprobs,
                           top_logprobs=args.top_logprobs, grammar=args.grammar)
    msg = pb.GenerateRequest(prompt_ids=list(prompt_ids), sampling=sampling, cache_salt=args.cache_salt,
                             max_tokens=args.max_tokens if max_tokens is None else max_tokens, **request)
    if args.speculative is not None:
        msg.speculative.draft, msg.speculative.draft_tokens = args.speculative[0], int(args.speculative[1])
    return msg


def from_request(request: pb.GenerateRequest) -> GenerationArgs:
    """The one conversion back: the :class:`GenerationArgs` a ``GenerateRequest`` asks for (rank 0).
    Unset fields take their defaults: ``top_p`` 0 is 1, an unset ``repetition_penalty`` 1 and
    ``repetition_context_size`` :data:`REPETITION_CONTEXT_SIZE`; ``logit_bias`` sorted by token id;
    ``speculative`` ``None`` unless set.  Checks nothing (:func:`check_args` does)."""
    m = request.sampling
    spec = request.speculative if request.HasField("speculative") else None
    return GenerationArgs(
        sampling=SamplingArgs(temperature=m.temperature, top_p=m.top_p or 1.0, top_k=m.top_k, min_p=m.min_p,
                              seed=m.seed),
        logits=LogitsArgs(logit_bias=tuple(sorted(m.logit_bias.items())), presence_penalty=m.presence_penalty,
                          frequency_penalty=m.frequency_penalty,
                          repetition_penalty=m.repetition_penalty if m.HasField("repetition_penalty") else 1.0,
                          repetition_context_size=m.repetition_context_size
                          if m.HasField("repetition_context_size") else REPETITION_CONTEXT_SIZE),
        max_tokens=request.max_tokens, logprobs=m.logprobs, top_logprobs=m.top_logprobs, grammar=m.grammar,
        speculative=(spec.draft, int(spec.draft_tokens)) if spec is not None else None,
        cache_salt=request.cache_salt)

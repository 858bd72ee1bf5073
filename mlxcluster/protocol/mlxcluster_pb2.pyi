from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FrameType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FRAME_TYPE_UNSPECIFIED: _ClassVar[FrameType]
    STEP_PLAN: _ClassVar[FrameType]

class StopReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STOP_REASON_UNSPECIFIED: _ClassVar[StopReason]
    EOS: _ClassVar[StopReason]
    MAX_TOKENS: _ClassVar[StopReason]
    CANCELLED: _ClassVar[StopReason]
    ERROR: _ClassVar[StopReason]
    CONTEXT_FULL: _ClassVar[StopReason]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    UNKNOWN_SESSION: _ClassVar[ErrorCode]
    OUT_OF_ORDER: _ClassVar[ErrorCode]
    BAD_TOKEN: _ClassVar[ErrorCode]
    BAD_FRAME: _ClassVar[ErrorCode]
    UNAUTHENTICATED: _ClassVar[ErrorCode]
    CONTEXT_OVERFLOW: _ClassVar[ErrorCode]
    INTERNAL: _ClassVar[ErrorCode]
    TOKEN_MISMATCH: _ClassVar[ErrorCode]
FRAME_TYPE_UNSPECIFIED: FrameType
STEP_PLAN: FrameType
STOP_REASON_UNSPECIFIED: StopReason
EOS: StopReason
MAX_TOKENS: StopReason
CANCELLED: StopReason
ERROR: StopReason
CONTEXT_FULL: StopReason
ERROR_CODE_UNSPECIFIED: ErrorCode
UNKNOWN_SESSION: ErrorCode
OUT_OF_ORDER: ErrorCode
BAD_TOKEN: ErrorCode
BAD_FRAME: ErrorCode
UNAUTHENTICATED: ErrorCode
CONTEXT_OVERFLOW: ErrorCode
INTERNAL: ErrorCode
TOKEN_MISMATCH: ErrorCode

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "seed", "logit_bias", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "grammar", "top_k", "min_p", "repetition_penalty", "repetition_context_size")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_CONTEXT_SIZE_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    seed: int
    logit_bias: _containers.ScalarMap[int, float]
    presence_penalty: float
    frequency_penalty: float
    logprobs: bool
    top_logprobs: int
    grammar: str
    top_k: int
    min_p: float
    repetition_penalty: float
    repetition_context_size: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., grammar: _Optional[str] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., repetition_context_size: _Optional[int] = ...) -> None: ...

class PromptTokens(_message.Message):
    __slots__ = ("token_ids", "max_tokens", "sampling", "eos_token_ids", "uid", "compute", "handoff", "remote", "every_rank_samples", "resumed")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    EVERY_RANK_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    sampling: Sampling
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    uid: str
    compute: ComputeSource
    handoff: HandoffSource
    remote: RemoteSource
    every_rank_samples: bool
    resumed: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., uid: _Optional[str] = ..., compute: _Optional[_Union[ComputeSource, _Mapping]] = ..., handoff: _Optional[_Union[HandoffSource, _Mapping]] = ..., remote: _Optional[_Union[RemoteSource, _Mapping]] = ..., every_rank_samples: _Optional[bool] = ..., resumed: _Optional[int] = ...) -> None: ...

class ComputeSource(_message.Message):
    __slots__ = ("cached", "chunked", "salt", "disk")
    CACHED_FIELD_NUMBER: _ClassVar[int]
    CHUNKED_FIELD_NUMBER: _ClassVar[int]
    SALT_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    cached: int
    chunked: bool
    salt: str
    disk: bool
    def __init__(self, cached: _Optional[int] = ..., chunked: _Optional[bool] = ..., salt: _Optional[str] = ..., disk: _Optional[bool] = ...) -> None: ...

class HandoffSource(_message.Message):
    __slots__ = ("chunked",)
    CHUNKED_FIELD_NUMBER: _ClassVar[int]
    chunked: bool
    def __init__(self, chunked: _Optional[bool] = ...) -> None: ...

class RemoteSource(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefillChunk(_message.Message):
    __slots__ = ("position", "count", "uid")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    position: int
    count: int
    uid: str
    def __init__(self, position: _Optional[int] = ..., count: _Optional[int] = ..., uid: _Optional[str] = ...) -> None: ...

class BatchEntry(_message.Message):
    __slots__ = ("uid", "position", "token", "draft")
    UID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    uid: str
    position: int
    token: int
    draft: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, uid: _Optional[str] = ..., position: _Optional[int] = ..., token: _Optional[int] = ..., draft: _Optional[_Iterable[int]] = ...) -> None: ...

class SessionStop(_message.Message):
    __slots__ = ("reason", "detail", "uid")
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    reason: StopReason
    detail: str
    uid: str
    def __init__(self, reason: _Optional[_Union[StopReason, str]] = ..., detail: _Optional[str] = ..., uid: _Optional[str] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step", "leaves", "decode", "joins", "batched", "chunks", "route", "epoch", "embeds", "kept", "ahead", "settled")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    JOINS_FIELD_NUMBER: _ClassVar[int]
    BATCHED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EMBEDS_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    step: int
    leaves: _containers.RepeatedCompositeFieldContainer[SessionStop]
    decode: _containers.RepeatedCompositeFieldContainer[BatchEntry]
    joins: _containers.RepeatedCompositeFieldContainer[PromptTokens]
    batched: bool
    chunks: _containers.RepeatedCompositeFieldContainer[PrefillChunk]
    route: str
    epoch: str
    embeds: _containers.RepeatedCompositeFieldContainer[EmbedEntry]
    kept: _containers.RepeatedScalarFieldContainer[int]
    ahead: bool
    settled: bool
    def __init__(self, step: _Optional[int] = ..., leaves: _Optional[_Iterable[_Union[SessionStop, _Mapping]]] = ..., decode: _Optional[_Iterable[_Union[BatchEntry, _Mapping]]] = ..., joins: _Optional[_Iterable[_Union[PromptTokens, _Mapping]]] = ..., batched: _Optional[bool] = ..., chunks: _Optional[_Iterable[_Union[PrefillChunk, _Mapping]]] = ..., route: _Optional[str] = ..., epoch: _Optional[str] = ..., embeds: _Optional[_Iterable[_Union[EmbedEntry, _Mapping]]] = ..., kept: _Optional[_Iterable[int]] = ..., ahead: _Optional[bool] = ..., settled: _Optional[bool] = ...) -> None: ...

class EmbedEntry(_message.Message):
    __slots__ = ("uid", "token_ids")
    UID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    uid: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, uid: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("type", "step_plan")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    STEP_PLAN_FIELD_NUMBER: _ClassVar[int]
    type: FrameType
    step_plan: StepPlan
    def __init__(self, type: _Optional[_Union[FrameType, str]] = ..., step_plan: _Optional[_Union[StepPlan, _Mapping]] = ...) -> None: ...

class ModelIdentity(_message.Message):
    __slots__ = ("digest", "weights", "n_kv_heads", "head_dim", "dtype", "kv_bits", "kv_group_size")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    N_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_BITS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    digest: str
    weights: str
    n_kv_heads: int
    head_dim: int
    dtype: str
    kv_bits: int
    kv_group_size: int
    def __init__(self, digest: _Optional[str] = ..., weights: _Optional[str] = ..., n_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., kv_bits: _Optional[int] = ..., kv_group_size: _Optional[int] = ...) -> None: ...

class LayerRangeMsg(_message.Message):
    __slots__ = ("start", "end", "output")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    output: bool
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ..., output: _Optional[bool] = ...) -> None: ...

class KvFrame(_message.Message):
    __slots__ = ("index", "layer", "pos0", "n_tokens", "keys", "values", "last", "total_frames", "identity", "layers", "token_count", "token_hash", "epoch", "total_bytes", "chunk", "head0", "first_token", "prefill_done_unix", "uid")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    POS0_FIELD_NUMBER: _ClassVar[int]
    N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FRAMES_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_HASH_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    HEAD0_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DONE_UNIX_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    index: int
    layer: int
    pos0: int
    n_tokens: int
    keys: bytes
    values: bytes
    last: bool
    total_frames: int
    identity: ModelIdentity
    layers: LayerRangeMsg
    token_count: int
    token_hash: int
    epoch: str
    total_bytes: int
    chunk: int
    head0: int
    first_token: int
    prefill_done_unix: float
    uid: str
    def __init__(self, index: _Optional[int] = ..., layer: _Optional[int] = ..., pos0: _Optional[int] = ..., n_tokens: _Optional[int] = ..., keys: _Optional[bytes] = ..., values: _Optional[bytes] = ..., last: _Optional[bool] = ..., total_frames: _Optional[int] = ..., identity: _Optional[_Union[ModelIdentity, _Mapping]] = ..., layers: _Optional[_Union[LayerRangeMsg, _Mapping]] = ..., token_count: _Optional[int] = ..., token_hash: _Optional[int] = ..., epoch: _Optional[str] = ..., total_bytes: _Optional[int] = ..., chunk: _Optional[int] = ..., head0: _Optional[int] = ..., first_token: _Optional[int] = ..., prefill_done_unix: _Optional[float] = ..., uid: _Optional[str] = ...) -> None: ...

class FrameReply(_message.Message):
    __slots__ = ("uid", "type", "ok", "code", "error", "rank", "peak_memory_bytes", "position", "kv", "refused", "left")
    UID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    uid: str
    type: FrameType
    ok: bool
    code: ErrorCode
    error: str
    rank: int
    peak_memory_bytes: int
    position: int
    kv: KvFrame
    refused: str
    left: bool
    def __init__(self, uid: _Optional[str] = ..., type: _Optional[_Union[FrameType, str]] = ..., ok: _Optional[bool] = ..., code: _Optional[_Union[ErrorCode, str]] = ..., error: _Optional[str] = ..., rank: _Optional[int] = ..., peak_memory_bytes: _Optional[int] = ..., position: _Optional[int] = ..., kv: _Optional[_Union[KvFrame, _Mapping]] = ..., refused: _Optional[str] = ..., left: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("rank", "world_size", "state", "model", "active_memory_bytes", "weight_bytes", "busy_s", "step_s")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    state: str
    model: str
    active_memory_bytes: int
    weight_bytes: int
    busy_s: float
    step_s: float
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., state: _Optional[str] = ..., model: _Optional[str] = ..., active_memory_bytes: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., busy_s: _Optional[float] = ..., step_s: _Optional[float] = ...) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank", "active_memory_bytes", "weight_bytes", "alive", "last_seen_s", "address")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    active_memory_bytes: int
    weight_bytes: int
    alive: bool
    last_seen_s: float
    address: str
    def __init__(self, rank: _Optional[int] = ..., active_memory_bytes: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., alive: _Optional[bool] = ..., last_seen_s: _Optional[float] = ..., address: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_ids", "chat", "system", "max_tokens", "sampling", "messages", "resume_token_ids", "speculative", "cache_salt")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    chat: bool
    system: str
    max_tokens: int
    sampling: Sampling
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    speculative: Speculative
    cache_salt: str
    def __init__(self, prompt: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., chat: _Optional[bool] = ..., system: _Optional[str] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., speculative: _Optional[_Union[Speculative, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class Speculative(_message.Message):
    __slots__ = ("draft", "draft_tokens")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    draft: str
    draft_tokens: int
    def __init__(self, draft: _Optional[str] = ..., draft_tokens: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateStarted(_message.Message):
    __slots__ = ("prompt_ids", "cached_prompt_tokens", "resumed_tokens")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_prompt_tokens: int
    resumed_tokens: int
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., cached_prompt_tokens: _Optional[int] = ..., resumed_tokens: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class GeneratedToken(_message.Message):
    __slots__ = ("token_id", "text", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateDone(_message.Message):
    __slots__ = ("reason", "ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s", "peak_memory_bytes_per_rank", "text_tail", "generated_tokens", "handoff_bytes", "handoff_s", "handoff_fallback", "pd_prefill_s", "pd_tail_s", "pd_streamed_s", "cached_prompt_tokens", "spec_drafted_tokens", "spec_accepted_tokens", "spec_steps", "decode_steps")
    REASON_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    TEXT_TAIL_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_BYTES_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_S_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    PD_PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    PD_TAIL_S_FIELD_NUMBER: _ClassVar[int]
    PD_STREAMED_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_STEPS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    reason: StopReason
    ttft_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    peak_memory_bytes_per_rank: _containers.RepeatedScalarFieldContainer[int]
    text_tail: str
    generated_tokens: int
    handoff_bytes: int
    handoff_s: float
    handoff_fallback: str
    pd_prefill_s: float
    pd_tail_s: float
    pd_streamed_s: float
    cached_prompt_tokens: int
    spec_drafted_tokens: int
    spec_accepted_tokens: int
    spec_steps: int
    decode_steps: int
    def __init__(self, reason: _Optional[_Union[StopReason, str]] = ..., ttft_s: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., decode_tokens_per_s: _Optional[float] = ..., peak_memory_bytes_per_rank: _Optional[_Iterable[int]] = ..., text_tail: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., handoff_bytes: _Optional[int] = ..., handoff_s: _Optional[float] = ..., handoff_fallback: _Optional[str] = ..., pd_prefill_s: _Optional[float] = ..., pd_tail_s: _Optional[float] = ..., pd_streamed_s: _Optional[float] = ..., cached_prompt_tokens: _Optional[int] = ..., spec_drafted_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., spec_steps: _Optional[int] = ..., decode_steps: _Optional[int] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("started", "token", "done")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    started: GenerateStarted
    token: GeneratedToken
    done: GenerateDone
    def __init__(self, started: _Optional[_Union[GenerateStarted, _Mapping]] = ..., token: _Optional[_Union[GeneratedToken, _Mapping]] = ..., done: _Optional[_Union[GenerateDone, _Mapping]] = ...) -> None: ...

class EmbedInput(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("inputs", "dimensions", "truncate")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[EmbedInput]
    dimensions: int
    truncate: bool
    def __init__(self, inputs: _Optional[_Iterable[_Union[EmbedInput, _Mapping]]] = ..., dimensions: _Optional[int] = ..., truncate: _Optional[bool] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values", "tokens")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    tokens: int
    def __init__(self, values: _Optional[_Iterable[float]] = ..., tokens: _Optional[int] = ...) -> None: ...

class EmbedReply(_message.Message):
    __slots__ = ("embeddings", "prompt_tokens")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    prompt_tokens: int
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("model", "world_size", "backend", "context_length", "vocab_size", "weight_format", "capacity", "max_queue", "queued", "running", "all_sum_us", "ranks", "generated_tokens", "first_tokens", "ttft_seconds_sum", "batched_prompts", "cached_prompt_tokens", "batch_limit", "itl_target_ms", "eos_token_ids", "spec_drafted_tokens", "spec_accepted_tokens", "spec_steps", "spec_emitted_tokens", "draft", "draft_tokens", "busy_s", "kv_bits", "kv_group_size", "step_s")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    ALL_SUM_US_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_SECONDS_SUM_FIELD_NUMBER: _ClassVar[int]
    BATCHED_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BATCH_LIMIT_FIELD_NUMBER: _ClassVar[int]
    ITL_TARGET_MS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_STEPS_FIELD_NUMBER: _ClassVar[int]
    SPEC_EMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    KV_BITS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    model: str
    world_size: int
    backend: str
    context_length: int
    vocab_size: int
    weight_format: str
    capacity: int
    max_queue: int
    queued: int
    running: int
    all_sum_us: float
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    generated_tokens: int
    first_tokens: int
    ttft_seconds_sum: float
    batched_prompts: int
    cached_prompt_tokens: int
    batch_limit: int
    itl_target_ms: float
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    spec_drafted_tokens: int
    spec_accepted_tokens: int
    spec_steps: int
    spec_emitted_tokens: int
    draft: str
    draft_tokens: int
    busy_s: float
    kv_bits: int
    kv_group_size: int
    step_s: float
    def __init__(self, model: _Optional[str] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ..., context_length: _Optional[int] = ..., vocab_size: _Optional[int] = ..., weight_format: _Optional[str] = ..., capacity: _Optional[int] = ..., max_queue: _Optional[int] = ..., queued: _Optional[int] = ..., running: _Optional[int] = ..., all_sum_us: _Optional[float] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., generated_tokens: _Optional[int] = ..., first_tokens: _Optional[int] = ..., ttft_seconds_sum: _Optional[float] = ..., batched_prompts: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., batch_limit: _Optional[int] = ..., itl_target_ms: _Optional[float] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., spec_drafted_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., spec_steps: _Optional[int] = ..., spec_emitted_tokens: _Optional[int] = ..., draft: _Optional[str] = ..., draft_tokens: _Optional[int] = ..., busy_s: _Optional[float] = ..., kv_bits: _Optional[int] = ..., kv_group_size: _Optional[int] = ..., step_s: _Optional[float] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("uid", "token_ids", "sampling", "subscriber", "subscribers", "head0", "n_heads")
    UID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBER_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBERS_FIELD_NUMBER: _ClassVar[int]
    HEAD0_FIELD_NUMBER: _ClassVar[int]
    N_HEADS_FIELD_NUMBER: _ClassVar[int]
    uid: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    subscriber: int
    subscribers: int
    head0: int
    n_heads: int
    def __init__(self, uid: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., subscriber: _Optional[int] = ..., subscribers: _Optional[int] = ..., head0: _Optional[int] = ..., n_heads: _Optional[int] = ...) -> None: ...

class DraftItem(_message.Message):
    __slots__ = ("uid", "keep", "tokens", "k")
    UID_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    uid: str
    keep: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    k: int
    def __init__(self, uid: _Optional[str] = ..., keep: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("items", "ended", "vocab_size", "vocab_digest")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_DIGEST_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[DraftItem]
    ended: _containers.RepeatedScalarFieldContainer[str]
    vocab_size: int
    vocab_digest: str
    def __init__(self, items: _Optional[_Iterable[_Union[DraftItem, _Mapping]]] = ..., ended: _Optional[_Iterable[str]] = ..., vocab_size: _Optional[int] = ..., vocab_digest: _Optional[str] = ...) -> None: ...

class DraftTokens(_message.Message):
    __slots__ = ("uid", "tokens", "resync")
    UID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    uid: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    resync: bool
    def __init__(self, uid: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., resync: _Optional[bool] = ...) -> None: ...

class DraftReply(_message.Message):
    __slots__ = ("items", "seconds")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[DraftTokens]
    seconds: float
    def __init__(self, items: _Optional[_Iterable[_Union[DraftTokens, _Mapping]]] = ..., seconds: _Optional[float] = ...) -> None: ...

class PrepareRequest(_message.Message):
    __slots__ = ("protocol_version", "formation_id", "coordinator_id")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    FORMATION_ID_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    formation_id: str
    coordinator_id: str
    def __init__(self, protocol_version: _Optional[int] = ..., formation_id: _Optional[str] = ..., coordinator_id: _Optional[str] = ...) -> None: ...

class PrepareReply(_message.Message):
    __slots__ = ("ok", "error", "address", "ring_port", "control_port", "node_id", "backends", "rdma", "measure")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RING_PORT_FIELD_NUMBER: _ClassVar[int]
    CONTROL_PORT_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    RDMA_FIELD_NUMBER: _ClassVar[int]
    MEASURE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    address: str
    ring_port: int
    control_port: int
    node_id: str
    backends: _containers.RepeatedScalarFieldContainer[str]
    rdma: RdmaFactsMsg
    measure: NodeMeasureMsg
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., address: _Optional[str] = ..., ring_port: _Optional[int] = ..., control_port: _Optional[int] = ..., node_id: _Optional[str] = ..., backends: _Optional[_Iterable[str]] = ..., rdma: _Optional[_Union[RdmaFactsMsg, _Mapping]] = ..., measure: _Optional[_Union[NodeMeasureMsg, _Mapping]] = ...) -> None: ...

class LinkMeasureMsg(_message.Message):
    __slots__ = ("peer", "latency_s", "bandwidth_bytes_per_s", "interface", "age_s")
    PEER_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    INTERFACE_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    peer: str
    latency_s: float
    bandwidth_bytes_per_s: float
    interface: str
    age_s: float
    def __init__(self, peer: _Optional[str] = ..., latency_s: _Optional[float] = ..., bandwidth_bytes_per_s: _Optional[float] = ..., interface: _Optional[str] = ..., age_s: _Optional[float] = ...) -> None: ...

class NodeMeasureMsg(_message.Message):
    __slots__ = ("memory_bytes", "layer_s", "prefill_tokens_per_s", "layer_batch_s", "head_s", "chip", "host", "links", "all_sum_us", "weights", "error", "tp_layers")
    class AllSumUsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    LAYER_BATCH_S_FIELD_NUMBER: _ClassVar[int]
    HEAD_S_FIELD_NUMBER: _ClassVar[int]
    CHIP_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    ALL_SUM_US_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TP_LAYERS_FIELD_NUMBER: _ClassVar[int]
    memory_bytes: int
    layer_s: float
    prefill_tokens_per_s: float
    layer_batch_s: float
    head_s: float
    chip: str
    host: str
    links: _containers.RepeatedCompositeFieldContainer[LinkMeasureMsg]
    all_sum_us: _containers.ScalarMap[str, float]
    weights: str
    error: str
    tp_layers: _containers.RepeatedCompositeFieldContainer[TpLayerMsg]
    def __init__(self, memory_bytes: _Optional[int] = ..., layer_s: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., layer_batch_s: _Optional[float] = ..., head_s: _Optional[float] = ..., chip: _Optional[str] = ..., host: _Optional[str] = ..., links: _Optional[_Iterable[_Union[LinkMeasureMsg, _Mapping]]] = ..., all_sum_us: _Optional[_Mapping[str, float]] = ..., weights: _Optional[str] = ..., error: _Optional[str] = ..., tp_layers: _Optional[_Iterable[_Union[TpLayerMsg, _Mapping]]] = ...) -> None: ...

class TpLayerMsg(_message.Message):
    __slots__ = ("backend", "nodes", "layer_us", "prefill_layer_us", "prefill_tokens")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    LAYER_US_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LAYER_US_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    layer_us: float
    prefill_layer_us: float
    prefill_tokens: int
    def __init__(self, backend: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ..., layer_us: _Optional[float] = ..., prefill_layer_us: _Optional[float] = ..., prefill_tokens: _Optional[int] = ...) -> None: ...

class PlanMsg(_message.Message):
    __slots__ = ("label", "mode", "decode_tok_s", "ttft_s", "prompt_tokens", "measured_decode_tok_s", "measured_ttft_s", "note")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOK_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_DECODE_TOK_S_FIELD_NUMBER: _ClassVar[int]
    MEASURED_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    label: str
    mode: str
    decode_tok_s: float
    ttft_s: float
    prompt_tokens: int
    measured_decode_tok_s: float
    measured_ttft_s: float
    note: str
    def __init__(self, label: _Optional[str] = ..., mode: _Optional[str] = ..., decode_tok_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., measured_decode_tok_s: _Optional[float] = ..., measured_ttft_s: _Optional[float] = ..., note: _Optional[str] = ...) -> None: ...

class MeasureRequest(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class MeasureReply(_message.Message):
    __slots__ = ("received_bytes",)
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    def __init__(self, received_bytes: _Optional[int] = ...) -> None: ...

class ThunderboltPortMsg(_message.Message):
    __slots__ = ("iface", "uuid", "connected_to", "address", "speed_gbps")
    IFACE_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_TO_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SPEED_GBPS_FIELD_NUMBER: _ClassVar[int]
    iface: str
    uuid: str
    connected_to: str
    address: str
    speed_gbps: float
    def __init__(self, iface: _Optional[str] = ..., uuid: _Optional[str] = ..., connected_to: _Optional[str] = ..., address: _Optional[str] = ..., speed_gbps: _Optional[float] = ...) -> None: ...

class RdmaFactsMsg(_message.Message):
    __slots__ = ("ports", "devices", "problem")
    PORTS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    ports: _containers.RepeatedCompositeFieldContainer[ThunderboltPortMsg]
    devices: _containers.RepeatedScalarFieldContainer[str]
    problem: str
    def __init__(self, ports: _Optional[_Iterable[_Union[ThunderboltPortMsg, _Mapping]]] = ..., devices: _Optional[_Iterable[str]] = ..., problem: _Optional[str] = ...) -> None: ...

class RankEndpointMsg(_message.Message):
    __slots__ = ("rank", "node_id", "address", "ring_port", "control_port")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RING_PORT_FIELD_NUMBER: _ClassVar[int]
    CONTROL_PORT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node_id: str
    address: str
    ring_port: int
    control_port: int
    def __init__(self, rank: _Optional[int] = ..., node_id: _Optional[str] = ..., address: _Optional[str] = ..., ring_port: _Optional[int] = ..., control_port: _Optional[int] = ...) -> None: ...

class BootstrapRequest(_message.Message):
    __slots__ = ("protocol_version", "formation_id", "coordinator_id", "rank", "world_size", "backend", "endpoints", "model_digest", "weights", "backend_reason", "jaccl_devices_json", "layers", "role", "prefill_peer", "draft_peer", "kv_bits", "kv_group_size", "ring_hosts_json", "jaccl_ring")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    FORMATION_ID_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_REASON_FIELD_NUMBER: _ClassVar[int]
    JACCL_DEVICES_JSON_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PEER_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PEER_FIELD_NUMBER: _ClassVar[int]
    KV_BITS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    RING_HOSTS_JSON_FIELD_NUMBER: _ClassVar[int]
    JACCL_RING_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    formation_id: str
    coordinator_id: str
    rank: int
    world_size: int
    backend: str
    endpoints: _containers.RepeatedCompositeFieldContainer[RankEndpointMsg]
    model_digest: str
    weights: str
    backend_reason: str
    jaccl_devices_json: str
    layers: str
    role: str
    prefill_peer: str
    draft_peer: str
    kv_bits: int
    kv_group_size: int
    ring_hosts_json: str
    jaccl_ring: bool
    def __init__(self, protocol_version: _Optional[int] = ..., formation_id: _Optional[str] = ..., coordinator_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ..., endpoints: _Optional[_Iterable[_Union[RankEndpointMsg, _Mapping]]] = ..., model_digest: _Optional[str] = ..., weights: _Optional[str] = ..., backend_reason: _Optional[str] = ..., jaccl_devices_json: _Optional[str] = ..., layers: _Optional[str] = ..., role: _Optional[str] = ..., prefill_peer: _Optional[str] = ..., draft_peer: _Optional[str] = ..., kv_bits: _Optional[int] = ..., kv_group_size: _Optional[int] = ..., ring_hosts_json: _Optional[str] = ..., jaccl_ring: _Optional[bool] = ...) -> None: ...

class BootstrapReply(_message.Message):
    __slots__ = ("ok", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class TeardownRequest(_message.Message):
    __slots__ = ("formation_id", "reason")
    FORMATION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    formation_id: str
    reason: str
    def __init__(self, formation_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class TeardownReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStatusReply(_message.Message):
    __slots__ = ("node_id", "cluster", "state", "formation_id", "rank", "world_size", "rank0_address", "model", "backend", "coordinator_id", "error", "members", "protocol_version", "backend_reason", "waiting", "layers", "role", "prefill_peer", "model_digest", "model_bytes", "fetch_state", "fetch_done_bytes", "fetch_total_bytes", "fetch_from", "spare", "measure", "plan", "draft_peer")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FORMATION_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK0_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_REASON_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PEER_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FETCH_STATE_FIELD_NUMBER: _ClassVar[int]
    FETCH_DONE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FETCH_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FETCH_FROM_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    MEASURE_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PEER_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    cluster: str
    state: str
    formation_id: str
    rank: int
    world_size: int
    rank0_address: str
    model: str
    backend: str
    coordinator_id: str
    error: str
    members: _containers.RepeatedCompositeFieldContainer[RankEndpointMsg]
    protocol_version: int
    backend_reason: str
    waiting: str
    layers: str
    role: str
    prefill_peer: str
    model_digest: str
    model_bytes: int
    fetch_state: str
    fetch_done_bytes: int
    fetch_total_bytes: int
    fetch_from: str
    spare: bool
    measure: NodeMeasureMsg
    plan: PlanMsg
    draft_peer: str
    def __init__(self, node_id: _Optional[str] = ..., cluster: _Optional[str] = ..., state: _Optional[str] = ..., formation_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., rank0_address: _Optional[str] = ..., model: _Optional[str] = ..., backend: _Optional[str] = ..., coordinator_id: _Optional[str] = ..., error: _Optional[str] = ..., members: _Optional[_Iterable[_Union[RankEndpointMsg, _Mapping]]] = ..., protocol_version: _Optional[int] = ..., backend_reason: _Optional[str] = ..., waiting: _Optional[str] = ..., layers: _Optional[str] = ..., role: _Optional[str] = ..., prefill_peer: _Optional[str] = ..., model_digest: _Optional[str] = ..., model_bytes: _Optional[int] = ..., fetch_state: _Optional[str] = ..., fetch_done_bytes: _Optional[int] = ..., fetch_total_bytes: _Optional[int] = ..., fetch_from: _Optional[str] = ..., spare: _Optional[bool] = ..., measure: _Optional[_Union[NodeMeasureMsg, _Mapping]] = ..., plan: _Optional[_Union[PlanMsg, _Mapping]] = ..., draft_peer: _Optional[str] = ...) -> None: ...

class ExecRequest(_message.Message):
    __slots__ = ("formation_id", "argv")
    FORMATION_ID_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    formation_id: str
    argv: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, formation_id: _Optional[str] = ..., argv: _Optional[_Iterable[str]] = ...) -> None: ...

class ExecEvent(_message.Message):
    __slots__ = ("stdout", "stderr", "exit_code")
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    stdout: bytes
    stderr: bytes
    exit_code: int
    def __init__(self, stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., exit_code: _Optional[int] = ...) -> None: ...

class ModelFileMsg(_message.Message):
    __slots__ = ("path", "size", "sha256")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    sha256: str
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class ManifestRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ManifestReply(_message.Message):
    __slots__ = ("model_digest", "name", "is_dir", "files")
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    IS_DIR_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    model_digest: str
    name: str
    is_dir: bool
    files: _containers.RepeatedCompositeFieldContainer[ModelFileMsg]
    def __init__(self, model_digest: _Optional[str] = ..., name: _Optional[str] = ..., is_dir: _Optional[bool] = ..., files: _Optional[_Iterable[_Union[ModelFileMsg, _Mapping]]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("model_digest", "path", "offset")
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    model_digest: str
    path: str
    offset: int
    def __init__(self, model_digest: _Optional[str] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

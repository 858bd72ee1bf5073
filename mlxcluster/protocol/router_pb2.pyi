from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Register(_message.Message):
    __slots__ = ("provider_id", "token", "models", "context_length", "capacity", "model_digest", "resumes")
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    RESUMES_FIELD_NUMBER: _ClassVar[int]
    provider_id: str
    token: str
    models: _containers.RepeatedScalarFieldContainer[str]
    context_length: int
    capacity: int
    model_digest: str
    resumes: bool
    def __init__(self, provider_id: _Optional[str] = ..., token: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., context_length: _Optional[int] = ..., capacity: _Optional[int] = ..., model_digest: _Optional[str] = ..., resumes: _Optional[bool] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("queued", "running", "capacity")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    queued: int
    running: int
    capacity: int
    def __init__(self, queued: _Optional[int] = ..., running: _Optional[int] = ..., capacity: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("request_id", "json", "token_ids", "text_chars")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    json: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text_chars: int
    def __init__(self, request_id: _Optional[str] = ..., json: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text_chars: _Optional[int] = ...) -> None: ...

class Done(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("request_id", "status", "message", "type", "param", "retry_after_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    status: int
    message: str
    type: str
    param: str
    retry_after_s: float
    def __init__(self, request_id: _Optional[str] = ..., status: _Optional[int] = ..., message: _Optional[str] = ..., type: _Optional[str] = ..., param: _Optional[str] = ..., retry_after_s: _Optional[float] = ...) -> None: ...

class ProviderMessage(_message.Message):
    __slots__ = ("register", "heartbeat", "chunk", "done", "error")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    register: Register
    heartbeat: Heartbeat
    chunk: Chunk
    done: Done
    error: Error
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., done: _Optional[_Union[Done, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class Registered(_message.Message):
    __slots__ = ("ok", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class Request(_message.Message):
    __slots__ = ("request_id", "kind", "body_json", "resume_token_ids", "resume_chars")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BODY_JSON_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_CHARS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kind: str
    body_json: str
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resume_chars: int
    def __init__(self, request_id: _Optional[str] = ..., kind: _Optional[str] = ..., body_json: _Optional[str] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., resume_chars: _Optional[int] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class RouterMessage(_message.Message):
    __slots__ = ("registered", "request", "cancel")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    registered: Registered
    request: Request
    cancel: Cancel
    def __init__(self, registered: _Optional[_Union[Registered, _Mapping]] = ..., request: _Optional[_Union[Request, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ...) -> None: ...

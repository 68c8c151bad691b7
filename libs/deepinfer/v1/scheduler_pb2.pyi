from deepinfer.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "resume_hints", "constraint", "output_token_ids", "images", "hand_off", "resume_position")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RESUME_HINTS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    HAND_OFF_FIELD_NUMBER: _ClassVar[int]
    RESUME_POSITION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    resume_hints: _containers.RepeatedScalarFieldContainer[int]
    constraint: _common_pb2.Constraint
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    images: _containers.RepeatedScalarFieldContainer[bytes]
    hand_off: bool
    resume_position: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., resume_hints: _Optional[_Iterable[int]] = ..., constraint: _Optional[_Union[_common_pb2.Constraint, _Mapping]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., images: _Optional[_Iterable[bytes]] = ..., hand_off: _Optional[bool] = ..., resume_position: _Optional[int] = ...) -> None: ...

class Handoff(_message.Message):
    __slots__ = ("position",)
    POSITION_FIELD_NUMBER: _ClassVar[int]
    position: int
    def __init__(self, position: _Optional[int] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "prompt_logprobs", "finish_reason", "stop_token_id", "cached_tokens", "cached_tier", "prompt_tokens", "draft_tokens", "accepted_draft_tokens", "handoff")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TIER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobEntry]
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    cached_tokens: int
    cached_tier: str
    prompt_tokens: int
    draft_tokens: int
    accepted_draft_tokens: int
    handoff: Handoff
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobEntry, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., cached_tier: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., handoff: _Optional[_Union[Handoff, _Mapping]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("submit", "cancel")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    submit: SessionSubmit
    cancel: str
    def __init__(self, submit: _Optional[_Union[SessionSubmit, _Mapping]] = ..., cancel: _Optional[str] = ...) -> None: ...

class SessionSubmit(_message.Message):
    __slots__ = ("request", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request: SubmitRequest
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request: _Optional[_Union[SubmitRequest, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SessionEvents(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[SessionItem]
    def __init__(self, items: _Optional[_Iterable[_Union[SessionItem, _Mapping]]] = ...) -> None: ...

class SessionItem(_message.Message):
    __slots__ = ("event", "status")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    event: TokenEvent
    status: RequestStatus
    def __init__(self, event: _Optional[_Union[TokenEvent, _Mapping]] = ..., status: _Optional[_Union[RequestStatus, _Mapping]] = ...) -> None: ...

class RequestStatus(_message.Message):
    __slots__ = ("request_id", "code", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class PromptLogprobEntry(_message.Message):
    __slots__ = ("position", "entries")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    position: int
    entries: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprob]
    def __init__(self, position: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[_common_pb2.TopLogprob, _Mapping]]] = ...) -> None: ...

class SchedulerAbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class SchedulerAbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted: _Optional[_Iterable[str]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("grace_period_s",)
    GRACE_PERIOD_S_FIELD_NUMBER: _ClassVar[int]
    grace_period_s: float
    def __init__(self, grace_period_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("remaining_requests",)
    REMAINING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    remaining_requests: int
    def __init__(self, remaining_requests: _Optional[int] = ...) -> None: ...

class HandOffRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class HandOffResponse(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetReplicaInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaInfo(_message.Message):
    __slots__ = ("model", "accelerator", "dtype", "world_size", "determinism", "role", "sessions")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DETERMINISM_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    accelerator: str
    dtype: str
    world_size: int
    determinism: _common_pb2.Determinism
    role: str
    sessions: bool
    def __init__(self, model: _Optional[str] = ..., accelerator: _Optional[str] = ..., dtype: _Optional[str] = ..., world_size: _Optional[int] = ..., determinism: _Optional[_Union[_common_pb2.Determinism, _Mapping]] = ..., role: _Optional[str] = ..., sessions: _Optional[bool] = ...) -> None: ...

from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "seed", "logprobs", "prompt_logprobs", "structured_output", "skip_special_tokens", "include_stop_str_in_output")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    seed: int
    logprobs: int
    prompt_logprobs: int
    structured_output: StructuredOutput
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., skip_special_tokens: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("schema_type", "schema")
    class SchemaType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        SCHEMA_TYPE_UNSPECIFIED: _ClassVar[StructuredOutput.SchemaType]
        SCHEMA_TYPE_REGEX: _ClassVar[StructuredOutput.SchemaType]
        SCHEMA_TYPE_JSON_SCHEMA: _ClassVar[StructuredOutput.SchemaType]
        SCHEMA_TYPE_JSON_OBJECT: _ClassVar[StructuredOutput.SchemaType]
        SCHEMA_TYPE_EBNF: _ClassVar[StructuredOutput.SchemaType]
        SCHEMA_TYPE_STRUCTURAL_TAG: _ClassVar[StructuredOutput.SchemaType]
    SCHEMA_TYPE_UNSPECIFIED: StructuredOutput.SchemaType
    SCHEMA_TYPE_REGEX: StructuredOutput.SchemaType
    SCHEMA_TYPE_JSON_SCHEMA: StructuredOutput.SchemaType
    SCHEMA_TYPE_JSON_OBJECT: StructuredOutput.SchemaType
    SCHEMA_TYPE_EBNF: StructuredOutput.SchemaType
    SCHEMA_TYPE_STRUCTURAL_TAG: StructuredOutput.SchemaType
    SCHEMA_TYPE_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    schema_type: StructuredOutput.SchemaType
    schema: str
    def __init__(self, schema_type: _Optional[_Union[StructuredOutput.SchemaType, str]] = ..., schema: _Optional[str] = ...) -> None: ...

class CompiledGrammar(_message.Message):
    __slots__ = ("compiled_json", "cache_key", "tokenizer_fingerprint", "allowed_control_token_ids", "backend")
    COMPILED_JSON_FIELD_NUMBER: _ClassVar[int]
    CACHE_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_CONTROL_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    compiled_json: str
    cache_key: str
    tokenizer_fingerprint: str
    allowed_control_token_ids: _containers.RepeatedScalarFieldContainer[int]
    backend: str
    def __init__(self, compiled_json: _Optional[str] = ..., cache_key: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., allowed_control_token_ids: _Optional[_Iterable[int]] = ..., backend: _Optional[str] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("grammar", "banned_token_ids", "after_think", "reasoning_banned_token_ids")
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    BANNED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    AFTER_THINK_FIELD_NUMBER: _ClassVar[int]
    REASONING_BANNED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    grammar: CompiledGrammar
    banned_token_ids: _containers.RepeatedScalarFieldContainer[int]
    after_think: bool
    reasoning_banned_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, grammar: _Optional[_Union[CompiledGrammar, _Mapping]] = ..., banned_token_ids: _Optional[_Iterable[int]] = ..., after_think: _Optional[bool] = ..., reasoning_banned_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens", "reasoning_tokens", "cached_tokens_by_tier", "draft_tokens", "accepted_draft_tokens")
    class CachedTokensByTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    cached_tokens_by_tier: _containers.ScalarMap[str, int]
    draft_tokens: int
    accepted_draft_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., reasoning_tokens: _Optional[int] = ..., cached_tokens_by_tier: _Optional[_Mapping[str, int]] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class ReplicaLoad(_message.Message):
    __slots__ = ("replica_id", "waiting_requests", "running_requests", "queued_prefill_tokens", "free_kv_pages", "total_kv_pages", "step_time_ms", "draining", "max_queued", "max_running")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    waiting_requests: int
    running_requests: int
    queued_prefill_tokens: int
    free_kv_pages: int
    total_kv_pages: int
    step_time_ms: float
    draining: bool
    max_queued: int
    max_running: int
    def __init__(self, replica_id: _Optional[str] = ..., waiting_requests: _Optional[int] = ..., running_requests: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., free_kv_pages: _Optional[int] = ..., total_kv_pages: _Optional[int] = ..., step_time_ms: _Optional[float] = ..., draining: _Optional[bool] = ..., max_queued: _Optional[int] = ..., max_running: _Optional[int] = ...) -> None: ...

class Determinism(_message.Message):
    __slots__ = ("batch_invariant", "deterministic_sampling", "covers", "requires")
    class RequiresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    COVERS_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_FIELD_NUMBER: _ClassVar[int]
    batch_invariant: bool
    deterministic_sampling: bool
    covers: _containers.RepeatedScalarFieldContainer[str]
    requires: _containers.ScalarMap[str, str]
    def __init__(self, batch_invariant: _Optional[bool] = ..., deterministic_sampling: _Optional[bool] = ..., covers: _Optional[_Iterable[str]] = ..., requires: _Optional[_Mapping[str, str]] = ...) -> None: ...

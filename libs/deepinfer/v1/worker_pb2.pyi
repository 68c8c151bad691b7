from deepinfer.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrepareImagesRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    images: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., images: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PrepareImagesResponse(_message.Message):
    __slots__ = ("token_ids", "spans", "digests")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    spans: _containers.RepeatedScalarFieldContainer[int]
    digests: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., spans: _Optional[_Iterable[int]] = ..., digests: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("model", "dtype", "num_pages", "page_size", "max_model_len")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    num_pages: int
    page_size: int
    max_model_len: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., num_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "chunks", "released", "snapshots", "dropped_snapshots", "offloads", "fetches", "dropped_images", "ranks")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    OFFLOADS_FIELD_NUMBER: _ClassVar[int]
    FETCHES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_IMAGES_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkPlan]
    released: _containers.RepeatedScalarFieldContainer[str]
    snapshots: _containers.RepeatedCompositeFieldContainer[SnapshotOrder]
    dropped_snapshots: _containers.RepeatedScalarFieldContainer[str]
    offloads: _containers.RepeatedCompositeFieldContainer[OffloadOrder]
    fetches: _containers.RepeatedCompositeFieldContainer[FetchOrder]
    dropped_images: _containers.RepeatedScalarFieldContainer[str]
    ranks: _containers.RepeatedCompositeFieldContainer[StepPlan]
    def __init__(self, step_id: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[ChunkPlan, _Mapping]]] = ..., released: _Optional[_Iterable[str]] = ..., snapshots: _Optional[_Iterable[_Union[SnapshotOrder, _Mapping]]] = ..., dropped_snapshots: _Optional[_Iterable[str]] = ..., offloads: _Optional[_Iterable[_Union[OffloadOrder, _Mapping]]] = ..., fetches: _Optional[_Iterable[_Union[FetchOrder, _Mapping]]] = ..., dropped_images: _Optional[_Iterable[str]] = ..., ranks: _Optional[_Iterable[_Union[StepPlan, _Mapping]]] = ...) -> None: ...

class OffloadOrder(_message.Message):
    __slots__ = ("snapshot_id", "key", "pages", "meta", "export")
    class MetaEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    EXPORT_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    key: bytes
    pages: _containers.RepeatedScalarFieldContainer[int]
    meta: _containers.ScalarMap[str, str]
    export: bool
    def __init__(self, snapshot_id: _Optional[str] = ..., key: _Optional[bytes] = ..., pages: _Optional[_Iterable[int]] = ..., meta: _Optional[_Mapping[str, str]] = ..., export: _Optional[bool] = ...) -> None: ...

class ExportResult(_message.Message):
    __slots__ = ("snapshot_id", "ok", "reason")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    ok: bool
    reason: str
    def __init__(self, snapshot_id: _Optional[str] = ..., ok: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class FetchOrder(_message.Message):
    __slots__ = ("fetch_id", "key")
    FETCH_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    fetch_id: str
    key: bytes
    def __init__(self, fetch_id: _Optional[str] = ..., key: _Optional[bytes] = ...) -> None: ...

class FetchResult(_message.Message):
    __slots__ = ("fetch_id", "ok", "reason")
    FETCH_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    fetch_id: str
    ok: bool
    reason: str
    def __init__(self, fetch_id: _Optional[str] = ..., ok: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class SnapshotOrder(_message.Message):
    __slots__ = ("request_id", "snapshot_id", "position")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    snapshot_id: str
    position: int
    def __init__(self, request_id: _Optional[str] = ..., snapshot_id: _Optional[str] = ..., position: _Optional[int] = ...) -> None: ...

class ChunkPlan(_message.Message):
    __slots__ = ("request_id", "token_ids", "start", "block_table", "sample", "params", "logprob_targets", "trace_context", "resume_from", "constraint", "constraint_history", "decoder_from", "images", "num_drafts")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_TARGETS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_HISTORY_FIELD_NUMBER: _ClassVar[int]
    DECODER_FROM_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    start: int
    block_table: _containers.RepeatedScalarFieldContainer[int]
    sample: bool
    params: _common_pb2.SamplingParams
    logprob_targets: _containers.RepeatedScalarFieldContainer[int]
    trace_context: _containers.ScalarMap[str, str]
    resume_from: str
    constraint: _common_pb2.Constraint
    constraint_history: _containers.RepeatedScalarFieldContainer[int]
    decoder_from: int
    images: bool
    num_drafts: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., start: _Optional[int] = ..., block_table: _Optional[_Iterable[int]] = ..., sample: _Optional[bool] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., logprob_targets: _Optional[_Iterable[int]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., resume_from: _Optional[str] = ..., constraint: _Optional[_Union[_common_pb2.Constraint, _Mapping]] = ..., constraint_history: _Optional[_Iterable[int]] = ..., decoder_from: _Optional[int] = ..., images: _Optional[bool] = ..., num_drafts: _Optional[int] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "results", "forward_ms", "fetched", "exported", "graph_captures")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    FETCHED_FIELD_NUMBER: _ClassVar[int]
    EXPORTED_FIELD_NUMBER: _ClassVar[int]
    GRAPH_CAPTURES_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    results: _containers.RepeatedCompositeFieldContainer[SeqResult]
    forward_ms: float
    fetched: _containers.RepeatedCompositeFieldContainer[FetchResult]
    exported: _containers.RepeatedCompositeFieldContainer[ExportResult]
    graph_captures: int
    def __init__(self, step_id: _Optional[int] = ..., results: _Optional[_Iterable[_Union[SeqResult, _Mapping]]] = ..., forward_ms: _Optional[float] = ..., fetched: _Optional[_Iterable[_Union[FetchResult, _Mapping]]] = ..., exported: _Optional[_Iterable[_Union[ExportResult, _Mapping]]] = ..., graph_captures: _Optional[int] = ...) -> None: ...

class SeqResult(_message.Message):
    __slots__ = ("request_id", "token_id", "logprob", "prompt_logprobs", "error", "extra_token_ids", "extra_logprobs", "num_drafts")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EXTRA_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: int
    logprob: _common_pb2.TokenLogprob
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobRow]
    error: str
    extra_token_ids: _containers.RepeatedScalarFieldContainer[int]
    extra_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    num_drafts: int
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[int] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobRow, _Mapping]]] = ..., error: _Optional[str] = ..., extra_token_ids: _Optional[_Iterable[int]] = ..., extra_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., num_drafts: _Optional[int] = ...) -> None: ...

class PromptLogprobRow(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprob]
    def __init__(self, entries: _Optional[_Iterable[_Union[_common_pb2.TopLogprob, _Mapping]]] = ...) -> None: ...

class GetWorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "accelerator", "device", "model", "num_pages", "page_size", "max_model_len", "vocab_size", "eos_token_id", "dtype", "rank", "world_size", "determinism", "fingerprint", "kvstore", "num_speculative_tokens")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DETERMINISM_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    accelerator: str
    device: str
    model: str
    num_pages: int
    page_size: int
    max_model_len: int
    vocab_size: int
    eos_token_id: int
    dtype: str
    rank: int
    world_size: int
    determinism: _common_pb2.Determinism
    fingerprint: str
    kvstore: bool
    num_speculative_tokens: int
    def __init__(self, worker_id: _Optional[str] = ..., accelerator: _Optional[str] = ..., device: _Optional[str] = ..., model: _Optional[str] = ..., num_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., dtype: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., determinism: _Optional[_Union[_common_pb2.Determinism, _Mapping]] = ..., fingerprint: _Optional[str] = ..., kvstore: _Optional[bool] = ..., num_speculative_tokens: _Optional[int] = ...) -> None: ...

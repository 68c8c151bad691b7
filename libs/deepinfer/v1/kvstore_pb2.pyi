from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_HOST: Tier
TIER_DISK: Tier

class PageKey(_message.Message):
    __slots__ = ("hash", "resume_point")
    HASH_FIELD_NUMBER: _ClassVar[int]
    RESUME_POINT_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    resume_point: bool
    def __init__(self, hash: _Optional[bytes] = ..., resume_point: _Optional[bool] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("model_fingerprint", "keys")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    keys: _containers.RepeatedCompositeFieldContainer[PageKey]
    def __init__(self, model_fingerprint: _Optional[str] = ..., keys: _Optional[_Iterable[_Union[PageKey, _Mapping]]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class PageChunk(_message.Message):
    __slots__ = ("key", "model_fingerprint", "layout", "offset", "total_bytes", "data", "crc32", "meta")
    class MetaEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    key: PageKey
    model_fingerprint: str
    layout: str
    offset: int
    total_bytes: int
    data: bytes
    crc32: int
    meta: _containers.ScalarMap[str, str]
    def __init__(self, key: _Optional[_Union[PageKey, _Mapping]] = ..., model_fingerprint: _Optional[str] = ..., layout: _Optional[str] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., meta: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "refused")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    refused: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, stored: _Optional[int] = ..., refused: _Optional[_Iterable[str]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("model_fingerprint", "key")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    key: PageKey
    def __init__(self, model_fingerprint: _Optional[str] = ..., key: _Optional[_Union[PageKey, _Mapping]] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("model_fingerprint", "keys")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    keys: _containers.RepeatedCompositeFieldContainer[PageKey]
    def __init__(self, model_fingerprint: _Optional[str] = ..., keys: _Optional[_Iterable[_Union[PageKey, _Mapping]]] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("shared_dir", "probe")
    SHARED_DIR_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    shared_dir: str
    probe: str
    def __init__(self, shared_dir: _Optional[str] = ..., probe: _Optional[str] = ...) -> None: ...

class SharedBlob(_message.Message):
    __slots__ = ("header", "file")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    header: PageChunk
    file: str
    def __init__(self, header: _Optional[_Union[PageChunk, _Mapping]] = ..., file: _Optional[str] = ...) -> None: ...

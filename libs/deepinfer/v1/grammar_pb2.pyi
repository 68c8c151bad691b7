from deepinfer.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CompileRequest(_message.Message):
    __slots__ = ("structured_output", "tokenizer_fingerprint", "timeout_s")
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    structured_output: _common_pb2.StructuredOutput
    tokenizer_fingerprint: str
    timeout_s: float
    def __init__(self, structured_output: _Optional[_Union[_common_pb2.StructuredOutput, _Mapping]] = ..., tokenizer_fingerprint: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class CompileResponse(_message.Message):
    __slots__ = ("grammar", "compile_ms", "cached")
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    COMPILE_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    grammar: _common_pb2.CompiledGrammar
    compile_ms: float
    cached: bool
    def __init__(self, grammar: _Optional[_Union[_common_pb2.CompiledGrammar, _Mapping]] = ..., compile_ms: _Optional[float] = ..., cached: _Optional[bool] = ...) -> None: ...

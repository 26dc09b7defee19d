from gpuscope.generated.tsl import profiler_options_pb2 as _profiler_options_pb2
from gpuscope.generated.tsl import xplane_pb2 as _xplane_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToolRequestOptions(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProfileRequest(_message.Message):
    __slots__ = ("duration_ms", "max_events", "tools", "opts", "repository_root", "session_id", "host_name", "tool_options", "emit_xspace")
    class ToolOptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ToolRequestOptions
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[ToolRequestOptions, _Mapping]] = ...) -> None: ...
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_EVENTS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    OPTS_FIELD_NUMBER: _ClassVar[int]
    REPOSITORY_ROOT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    EMIT_XSPACE_FIELD_NUMBER: _ClassVar[int]
    duration_ms: int
    max_events: int
    tools: _containers.RepeatedScalarFieldContainer[str]
    opts: _profiler_options_pb2.ProfileOptions
    repository_root: str
    session_id: str
    host_name: str
    tool_options: _containers.MessageMap[str, ToolRequestOptions]
    emit_xspace: bool
    def __init__(self, duration_ms: _Optional[int] = ..., max_events: _Optional[int] = ..., tools: _Optional[_Iterable[str]] = ..., opts: _Optional[_Union[_profiler_options_pb2.ProfileOptions, _Mapping]] = ..., repository_root: _Optional[str] = ..., session_id: _Optional[str] = ..., host_name: _Optional[str] = ..., tool_options: _Optional[_Mapping[str, ToolRequestOptions]] = ..., emit_xspace: _Optional[bool] = ...) -> None: ...

class ProfileToolData(_message.Message):
    __slots__ = ("name", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    data: bytes
    def __init__(self, name: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class ProfileResponse(_message.Message):
    __slots__ = ("tool_data", "empty_trace", "xspace")
    TOOL_DATA_FIELD_NUMBER: _ClassVar[int]
    EMPTY_TRACE_FIELD_NUMBER: _ClassVar[int]
    XSPACE_FIELD_NUMBER: _ClassVar[int]
    tool_data: _containers.RepeatedCompositeFieldContainer[ProfileToolData]
    empty_trace: bool
    xspace: _xplane_pb2.XSpace
    def __init__(self, tool_data: _Optional[_Iterable[_Union[ProfileToolData, _Mapping]]] = ..., empty_trace: _Optional[bool] = ..., xspace: _Optional[_Union[_xplane_pb2.XSpace, _Mapping]] = ...) -> None: ...

class TerminateRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class TerminateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

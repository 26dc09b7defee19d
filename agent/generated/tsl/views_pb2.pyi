from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProfileResponseView(_message.Message):
    __slots__ = ("tool_data", "empty_trace", "xspace")
    TOOL_DATA_FIELD_NUMBER: _ClassVar[int]
    EMPTY_TRACE_FIELD_NUMBER: _ClassVar[int]
    XSPACE_FIELD_NUMBER: _ClassVar[int]
    tool_data: _containers.RepeatedCompositeFieldContainer[ProfileToolDataView]
    empty_trace: bool
    xspace: bytes
    def __init__(self, tool_data: _Optional[_Iterable[_Union[ProfileToolDataView, _Mapping]]] = ..., empty_trace: _Optional[bool] = ..., xspace: _Optional[bytes] = ...) -> None: ...

class ProfileToolDataView(_message.Message):
    __slots__ = ("name", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    data: bytes
    def __init__(self, name: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class XSpaceView(_message.Message):
    __slots__ = ("planes", "errors", "warnings", "hostnames")
    PLANES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    HOSTNAMES_FIELD_NUMBER: _ClassVar[int]
    planes: _containers.RepeatedScalarFieldContainer[bytes]
    errors: _containers.RepeatedScalarFieldContainer[bytes]
    warnings: _containers.RepeatedScalarFieldContainer[bytes]
    hostnames: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, planes: _Optional[_Iterable[bytes]] = ..., errors: _Optional[_Iterable[bytes]] = ..., warnings: _Optional[_Iterable[bytes]] = ..., hostnames: _Optional[_Iterable[bytes]] = ...) -> None: ...

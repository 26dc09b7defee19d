from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProfileOptions(_message.Message):
    __slots__ = ("include_dataset_ops", "host_tracer_level", "device_tracer_level", "python_tracer_level", "version", "device_type", "enable_hlo_proto", "start_timestamp_ns", "duration_ms", "repository_path")
    class DeviceType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNSPECIFIED: _ClassVar[ProfileOptions.DeviceType]
        CPU: _ClassVar[ProfileOptions.DeviceType]
        GPU: _ClassVar[ProfileOptions.DeviceType]
        TPU: _ClassVar[ProfileOptions.DeviceType]
        PLUGGABLE_DEVICE: _ClassVar[ProfileOptions.DeviceType]
    UNSPECIFIED: ProfileOptions.DeviceType
    CPU: ProfileOptions.DeviceType
    GPU: ProfileOptions.DeviceType
    TPU: ProfileOptions.DeviceType
    PLUGGABLE_DEVICE: ProfileOptions.DeviceType
    INCLUDE_DATASET_OPS_FIELD_NUMBER: _ClassVar[int]
    HOST_TRACER_LEVEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TRACER_LEVEL_FIELD_NUMBER: _ClassVar[int]
    PYTHON_TRACER_LEVEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    ENABLE_HLO_PROTO_FIELD_NUMBER: _ClassVar[int]
    START_TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    REPOSITORY_PATH_FIELD_NUMBER: _ClassVar[int]
    include_dataset_ops: bool
    host_tracer_level: int
    device_tracer_level: int
    python_tracer_level: int
    version: int
    device_type: ProfileOptions.DeviceType
    enable_hlo_proto: bool
    start_timestamp_ns: int
    duration_ms: int
    repository_path: str
    def __init__(self, include_dataset_ops: _Optional[bool] = ..., host_tracer_level: _Optional[int] = ..., device_tracer_level: _Optional[int] = ..., python_tracer_level: _Optional[int] = ..., version: _Optional[int] = ..., device_type: _Optional[_Union[ProfileOptions.DeviceType, str]] = ..., enable_hlo_proto: _Optional[bool] = ..., start_timestamp_ns: _Optional[int] = ..., duration_ms: _Optional[int] = ..., repository_path: _Optional[str] = ...) -> None: ...

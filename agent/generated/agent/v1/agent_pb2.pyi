from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    OUTCOME_CAPTURED: _ClassVar[Outcome]
    OUTCOME_BUSY: _ClassVar[Outcome]
    OUTCOME_EMPTY: _ClassVar[Outcome]
    OUTCOME_UNREACHABLE: _ClassVar[Outcome]
    OUTCOME_REFUSED: _ClassVar[Outcome]
    OUTCOME_FAILED: _ClassVar[Outcome]
    OUTCOME_EXITED: _ClassVar[Outcome]
OUTCOME_UNSPECIFIED: Outcome
OUTCOME_CAPTURED: Outcome
OUTCOME_BUSY: Outcome
OUTCOME_EMPTY: Outcome
OUTCOME_UNREACHABLE: Outcome
OUTCOME_REFUSED: Outcome
OUTCOME_FAILED: Outcome
OUTCOME_EXITED: Outcome

class GetSnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetSnapshotResponse(_message.Message):
    __slots__ = ("snapshot_json",)
    SNAPSHOT_JSON_FIELD_NUMBER: _ClassVar[int]
    snapshot_json: bytes
    def __init__(self, snapshot_json: _Optional[bytes] = ...) -> None: ...

class ListAlertsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAlertsResponse(_message.Message):
    __slots__ = ("alerts_json",)
    ALERTS_JSON_FIELD_NUMBER: _ClassVar[int]
    alerts_json: bytes
    def __init__(self, alerts_json: _Optional[bytes] = ...) -> None: ...

class CaptureRequest(_message.Message):
    __slots__ = ("gpu", "pid", "target", "duration_ms", "reason", "start_at")
    GPU_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    START_AT_FIELD_NUMBER: _ClassVar[int]
    gpu: int
    pid: int
    target: str
    duration_ms: int
    reason: str
    start_at: float
    def __init__(self, gpu: _Optional[int] = ..., pid: _Optional[int] = ..., target: _Optional[str] = ..., duration_ms: _Optional[int] = ..., reason: _Optional[str] = ..., start_at: _Optional[float] = ...) -> None: ...

class CaptureRecord(_message.Message):
    __slots__ = ("id", "outcome", "record_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    RECORD_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    outcome: Outcome
    record_json: str
    def __init__(self, id: _Optional[str] = ..., outcome: _Optional[_Union[Outcome, str]] = ..., record_json: _Optional[str] = ...) -> None: ...

class ListCapturesRequest(_message.Message):
    __slots__ = ("limit", "include_refused")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_REFUSED_FIELD_NUMBER: _ClassVar[int]
    limit: int
    include_refused: bool
    def __init__(self, limit: _Optional[int] = ..., include_refused: _Optional[bool] = ...) -> None: ...

class ListCapturesResponse(_message.Message):
    __slots__ = ("captures", "refused_count", "refused_json", "listing_json")
    CAPTURES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_COUNT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_JSON_FIELD_NUMBER: _ClassVar[int]
    LISTING_JSON_FIELD_NUMBER: _ClassVar[int]
    captures: _containers.RepeatedCompositeFieldContainer[CaptureRecord]
    refused_count: int
    refused_json: bytes
    listing_json: bytes
    def __init__(self, captures: _Optional[_Iterable[_Union[CaptureRecord, _Mapping]]] = ..., refused_count: _Optional[int] = ..., refused_json: _Optional[bytes] = ..., listing_json: _Optional[bytes] = ...) -> None: ...

class GetCaptureRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("path", "offset", "data", "last")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    data: bytes
    last: bool
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class GetAgentInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AgentInfo(_message.Message):
    __slots__ = ("node_name", "pid", "version", "simulated_scenario", "control_socket", "capture_store")
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SIMULATED_SCENARIO_FIELD_NUMBER: _ClassVar[int]
    CONTROL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_STORE_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    pid: int
    version: str
    simulated_scenario: str
    control_socket: str
    capture_store: str
    def __init__(self, node_name: _Optional[str] = ..., pid: _Optional[int] = ..., version: _Optional[str] = ..., simulated_scenario: _Optional[str] = ..., control_socket: _Optional[str] = ..., capture_store: _Optional[str] = ...) -> None: ...

"""The XSpace (``*.xplane.pb``) that TensorFlow's and JAX's profilers write, read a piece at a time.

An XSpace is one protobuf message: a plane per device and one for the host, each plane holding its
lines (threads, streams) of events and the metadata that names them. It is never parsed whole: the
file is memory-mapped, the protobuf wire format is walked here to find each plane's fields, and
only one plane's metadata and one line (or, for a very long line, one run of its events) is a
parsed message at a time.

What is kept:

- ``/host:CPU``: ``$``-prefixed events are Python functions, ``cuda...``/``cuX...`` events CUDA
  runtime and driver calls, events that take time on XLA's CPU thread pools (lines ``tf_XLA...``,
  ``XLA...``, ``tf_Compute...``) are compiled computations, a root event with a ``step_num`` stat
  is a step (``StepTraceAnnotation``), and the rest are host operations; each on its thread's line.
- ``/device:GPU:N``: the events of the physical streams (lines ``Stream #...``), each GPU apart;
  the lines XProf derives from them (XLA Modules, XLA Ops, TensorFlow Ops ...) repeat them and are
  skipped, except ``Steps``: the framework's own steps as the device ran them, used when the host
  plane marks none. A GPU plane without stream events is kept as a GPU that ran nothing.
- ``/host:metadata``: the framework's version stats name the framework; without them, what the
  trace carries does (JAX's ``PjitFunction``, TensorFlow's op lines, threads and function calls).
"""

from __future__ import annotations

import mmap
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from google.protobuf.message import DecodeError

from gpuscope.analysis.errors import DEFAULT_MAX_BYTES, TraceError, TraceFormatError, TraceTooLargeError
from gpuscope.analysis.model import Kind, Trace
from gpuscope.generated.tsl import xplane_pb2

# Field numbers of the messages walked here (tsl/profiler/protobuf/xplane.proto).
XSPACE_PLANES = 1
XPLANE_LINES = 3
XLINE_EVENTS = 4

# A line longer than this (in bytes of the file) is parsed a run of events at a time.
EVENT_RUN_BYTES = 4 << 20

HOST_PLANE = "/host:CPU"
METADATA_PLANE = "/host:metadata"
GPU_PLANE = re.compile(r"/device:GPU:(\d+)")
STREAM_LINE_PREFIX = "Stream #"
STEPS_LINE = "Steps"
# CUPTI's id that ties a launch call (``cuGraphLaunch``, ``cuLaunchKernel``) to the work it started.
CORRELATION_STAT = "correlation_id"
# Lines only TensorFlow writes: its op and name-scope lines (renamed "Framework ..." by newer
# profilers, which JAX writes too). Thread names say little: XLA's thread pools, which JAX uses too,
# are named "tf_..." by the library they share; only tf.data's are TensorFlow's (by JAX's PjitFunction
# a JAX job that reads tf.data is still named JAX).
TENSORFLOW_LINES = ("TensorFlow Ops", "TensorFlow Name Scope")
TENSORFLOW_THREADS = ("tf_data_",)
XLA_CPU_LINE_PREFIXES = ("tf_XLA", "XLA", "tf_Compute")
NOT_COMPUTE_PREFIXES = ("end: ", "ThreadpoolListener::")
CUDA_CALL = re.compile(r"cu(?:da|[A-Z])")
FRAMEWORK_BY_VERSION_STAT = {"jax_version": "jax", "tf_version": "tensorflow",
                             "tensorflow_version": "tensorflow"}

Field = tuple[int, int, int, int]  # field number, first byte of the tag, first byte of the value, end


class WireError(Exception):
    """Bytes that are not the protobuf wire format, at ``offset`` in the file."""

    def __init__(self, offset: int, what: str) -> None:
        super().__init__(what)
        self.offset = offset


def read_xspace(path: Path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Trace:
    """The events of an XSpace file of at most ``max_bytes`` bytes."""
    try:
        size = path.stat().st_size
    except OSError as error:
        raise TraceError(f"{path}: cannot read the trace: {error}") from error
    if size > max_bytes:
        raise TraceTooLargeError(f"{path}: the trace holds {size} bytes, more than {max_bytes}; not read")
    if size == 0:
        raise TraceFormatError(f"{path}: an empty file, not an XSpace")
    trace = Trace(format="xspace", source=str(path))
    try:
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if len(data) > max_bytes:  # grew since stat()
                raise TraceTooLargeError(f"{path}: the trace holds more than {max_bytes} bytes; not read")
            reader = XSpaceReader(data, trace)
            planes = reader.read()
    except WireError as error:
        raise TraceFormatError(f"{path}: malformed XSpace at byte {error.offset}: {error}") from error
    except DecodeError as error:
        raise TraceFormatError(f"{path}: malformed XSpace: {error}") from error
    except OSError as error:
        raise TraceError(f"{path}: cannot read the trace: {error}") from error
    except ValueError as error:  # mmap of a file emptied since stat()
        raise TraceFormatError(f"{path}: an empty file, not an XSpace") from error
    if not planes:
        raise TraceFormatError(f"{path}: not an XSpace (no planes)")
    if not trace.framework:  # a profile taken over the profiler server has no /host:metadata plane
        trace.framework = _framework_from_names(trace.names) or _framework_from_lines(reader.line_names)
    trace.finish()  # XLine timestamps are nanoseconds since the Unix epoch: base_ns is one of them
    return trace


def _framework_from_names(names: list[str]) -> str:
    """JAX's dispatch (``PjitFunction(f)``) or TensorFlow's function calls name the framework."""
    if any(name.startswith(("PjitFunction(", "PmapFunction(")) for name in names):
        return "jax"
    if any(name.startswith(("__inference_", "EagerExecute", "EagerKernelExecute")) for name in names):
        return "tensorflow"
    return ""


def _framework_from_lines(lines: set[str]) -> str:
    """TensorFlow's op lines on a device or its own threads on the host name it."""
    if any(line in TENSORFLOW_LINES or line.startswith(TENSORFLOW_THREADS) for line in lines):
        return "tensorflow"
    return ""


def varint(data: mmap.mmap, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it."""
    result = shift = 0
    while pos < end:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            break
    raise WireError(pos, "a truncated or overlong varint")


def fields(data: mmap.mmap, start: int, end: int) -> Iterator[Field]:
    """The fields of the message in ``data[start:end]``, without decoding their values."""
    pos = start
    while pos < end:
        tag, value_start = varint(data, pos, end)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == 0:
            _, value_end = varint(data, value_start, end)
        elif wire_type == 1:
            value_end = value_start + 8
        elif wire_type == 2:
            length, value_start = varint(data, value_start, end)
            value_end = value_start + length
        elif wire_type == 5:
            value_end = value_start + 4
        else:
            raise WireError(pos, f"wire type {wire_type}, which XSpace does not use")
        if number == 0 or value_end > end:
            raise WireError(pos, "a field that runs past its message" if number else "field number 0")
        yield number, pos, value_start, value_end
        pos = value_end


class XSpaceReader:
    """Adds the events of the planes it knows to a Trace, a plane and a line at a time."""

    def __init__(self, data: mmap.mmap, trace: Trace) -> None:
        self.data = data
        self.trace = trace
        self.base_ns: int | None = None  # the first line's start: times are kept small, and exact
        # Each GPU plane's Steps line: (start, duration, name), used when the host marks no steps.
        self.device_steps: dict[int, list[tuple[float, float, str]]] = {}
        self.line_names: set[str] = set()  # of every plane read, kept or not: they name the framework

    def read(self) -> int:
        """Read every plane; how many there were."""
        planes = 0
        for number, _, start, end in fields(self.data, 0, len(self.data)):
            if number == XSPACE_PLANES:
                planes += 1
                self.read_plane(start, end)
        self.add_device_steps()
        return planes

    def add_device_steps(self) -> None:
        """The steps of the first GPU whose plane has a Steps line, when the host plane marked none:
        the framework's own step boundaries, where nothing else would be left but to infer them."""
        if self.trace.count(Kind.STEP) or not self.device_steps:
            return
        gpu = min(self.device_steps)
        for start, dur, name in self.device_steps[gpu]:
            number = int(name) if name.isdigit() else -1
            self.trace.add_step(start, dur, name, f"GPU {gpu} {STEPS_LINE}", number=number)

    def read_plane(self, start: int, end: int) -> None:
        header: list[bytes] = []
        lines: list[tuple[int, int]] = []
        for number, field_start, value_start, field_end in fields(self.data, start, end):
            if number == XPLANE_LINES:
                lines.append((value_start, field_end))
            else:
                header.append(self.data[field_start:field_end])
        plane = xplane_pb2.XPlane.FromString(b"".join(header))
        gpu = GPU_PLANE.fullmatch(plane.name)
        if plane.name == HOST_PLANE:
            host = HostEvents(plane, self.trace)
            for line_start, line_end in lines:
                self.read_line(line_start, line_end, host)
        elif gpu:
            self.trace.has_device = True
            self.read_device_properties(plane)
            index = int(gpu.group(1))
            self.trace.devices.setdefault(f"GPU {index}", 0)
            device = DeviceEvents(plane, index, self.trace, self.device_steps.setdefault(index, []))
            for line_start, line_end in lines:
                self.read_line(line_start, line_end, device)
            if not self.device_steps[index]:
                del self.device_steps[index]
        elif plane.name == METADATA_PLANE:
            self.read_framework(plane)

    def read_line(self, start: int, end: int, events: HostEvents | DeviceEvents) -> None:
        """One line's events, the whole line at once or, when it is long, a run of events at a time."""
        if end - start <= EVENT_RUN_BYTES:
            line = xplane_pb2.XLine.FromString(self.data[start:end])
            self.line_names.add(line.name)
            if events.wants(line):
                events.add(line, line.events, self.origin_us(line))
            return
        header, runs = self.split_line(start, end)
        line = xplane_pb2.XLine.FromString(header)
        self.line_names.add(line.name)
        if not events.wants(line):
            return
        origin_us = self.origin_us(line)
        for run_start, run_end in runs:
            events.add(line, xplane_pb2.XLine.FromString(self.data[run_start:run_end]).events, origin_us)

    def split_line(self, start: int, end: int) -> tuple[bytes, list[tuple[int, int]]]:
        """A line's fields other than its events, and its events as runs of at most EVENT_RUN_BYTES.

        A run is a slice of consecutive event fields: parsed as an XLine, it is a line of those events.
        """
        header: list[bytes] = []
        runs: list[tuple[int, int]] = []
        run_start = run_end = -1
        for number, field_start, _, field_end in fields(self.data, start, end):
            if number != XLINE_EVENTS:
                header.append(self.data[field_start:field_end])
            elif field_start == run_end and field_end - run_start <= EVENT_RUN_BYTES:
                run_end = field_end
            else:
                if run_start >= 0:
                    runs.append((run_start, run_end))
                run_start, run_end = field_start, field_end
        if run_start >= 0:
            runs.append((run_start, run_end))
        return b"".join(header), runs

    def origin_us(self, line: xplane_pb2.XLine) -> float:
        """The line's start in microseconds from the first line's start: kept small because a double
        holds an absolute time (about 1.7e15 microseconds) only to a quarter of a microsecond."""
        if self.base_ns is None:
            self.base_ns = self.trace.base_ns = line.timestamp_ns
        return (line.timestamp_ns - self.base_ns) / 1e3

    def read_device_properties(self, plane: xplane_pb2.XPlane) -> None:
        """The GPU's compute capability, from its plane's statistics (the first GPU's)."""
        if self.trace.compute_capability is not None:
            return
        values = {name: stat_number(stat) for stat in plane.stats
                  if (name := plane.stat_metadata[stat.metadata_id].name
                      if stat.metadata_id in plane.stat_metadata else "")}
        major, minor = values.get("compute_cap_major"), values.get("compute_cap_minor")
        if major:
            self.trace.compute_capability = (major, minor or 0)

    def read_framework(self, plane: xplane_pb2.XPlane) -> None:
        for stat in plane.stats:
            metadata = plane.stat_metadata.get(stat.metadata_id)
            framework = FRAMEWORK_BY_VERSION_STAT.get(metadata.name) if metadata else None
            if framework and self.trace.framework != "jax":  # JAX's version wins over the TF it runs on
                self.trace.framework = framework


def is_aggregate(event: xplane_pb2.XEvent) -> bool:
    """An event that counts occurrences in place of a start time."""
    return bool(event.WhichOneof("data") == "num_occurrences")


def stat_number(stat: xplane_pb2.XStat) -> int | None:
    value = stat.WhichOneof("value")
    if value == "int64_value":
        return stat.int64_value
    if value == "uint64_value":
        return stat.uint64_value
    return None


def stat_of(event: xplane_pb2.XEvent, stat_id: int | None) -> int | None:
    """An event's numeric statistic, None where it has none."""
    if stat_id is None:
        return None
    for stat in event.stats:
        if stat.metadata_id == stat_id:
            return stat_number(stat)
    return None


def stat_ids(plane: xplane_pb2.XPlane) -> dict[str, int]:
    return {metadata.name: metadata_id for metadata_id, metadata in plane.stat_metadata.items()}


def event_name(plane: xplane_pb2.XPlane, metadata_id: int) -> str:
    metadata = plane.event_metadata.get(metadata_id)
    if metadata is None:
        return f"event {metadata_id}"
    return metadata.name or metadata.display_name


class HostEvents:
    """The events of the host plane's threads."""

    def __init__(self, plane: xplane_pb2.XPlane, trace: Trace) -> None:
        self.plane = plane
        self.trace = trace
        ids = stat_ids(plane)
        self.step_stat = ids.get("step_num")
        self.root_stat = ids.get("_r")
        self.corr_stat = ids.get(CORRELATION_STAT)
        # Per event metadata id: the kind its name alone decides (else None), the name to keep, and
        # whether it may be a compiled computation on an XLA thread.
        self.by_metadata: dict[int, tuple[Kind | None, str, bool]] = {}

    def wants(self, line: xplane_pb2.XLine) -> bool:
        return True

    def classify(self, metadata_id: int) -> tuple[Kind | None, str, bool]:
        found = self.by_metadata.get(metadata_id)
        if found is None:
            name = event_name(self.plane, metadata_id)
            if name.startswith("$"):
                found = (Kind.PYTHON, name[1:], False)
            elif CUDA_CALL.match(name):
                found = (Kind.RUNTIME, name, False)
            else:
                found = (None, name, not name.startswith(NOT_COMPUTE_PREFIXES))
            self.by_metadata[metadata_id] = found
        return found

    def add(self, line: xplane_pb2.XLine, events: Iterable[xplane_pb2.XEvent],
            origin_us: float) -> None:
        track = line.name or line.display_name or f"thread {line.id}"
        on_xla_pool = line.name.startswith(XLA_CPU_LINE_PREFIXES)
        trace = self.trace
        for event in events:
            if is_aggregate(event):
                continue
            kind, name, may_compute = self.classify(event.metadata_id)
            start, dur = origin_us + event.offset_ps / 1e6, event.duration_ps / 1e6
            if kind is None:
                if on_xla_pool and may_compute and event.duration_ps > 0:
                    kind = Kind.CPU_COMPUTE
                else:
                    step = self.step_number(event) if event.stats else None
                    if step is not None:
                        trace.add_step(start, dur, name, track, number=step)
                        continue
                    kind = Kind.HOST_OP
            # A host event with a correlation id started device work: a launch call, or the host's side
            # of a transfer (``MemcpyH2D`` on a PjRt thread).
            corr = stat_of(event, self.corr_stat) if event.stats else None
            trace.add(kind, start, dur, name, track, corr=-1 if corr is None else corr)

    def step_number(self, event: xplane_pb2.XEvent) -> int | None:
        """The step a ``StepTraceAnnotation`` marks; None for other events and nested annotations."""
        if self.step_stat is None:
            return None
        step: int | None = None
        for stat in event.stats:
            if stat.metadata_id == self.step_stat:
                step = stat_number(stat)
            elif stat.metadata_id == self.root_stat and stat_number(stat) != 1:
                return None
        return step


class DeviceEvents:
    """The events of one GPU's streams."""

    def __init__(self, plane: xplane_pb2.XPlane, index: int, trace: Trace,
                 steps: list[tuple[float, float, str]]) -> None:
        self.plane = plane
        self.index = index
        self.trace = trace
        self.steps = steps
        self.corr_stat = stat_ids(plane).get(CORRELATION_STAT)
        self.by_metadata: dict[int, tuple[Kind, str]] = {}

    def wants(self, line: xplane_pb2.XLine) -> bool:
        return line.name.startswith(STREAM_LINE_PREFIX) or line.name == STEPS_LINE

    def classify(self, metadata_id: int) -> tuple[Kind, str]:
        found = self.by_metadata.get(metadata_id)
        if found is None:
            name = event_name(self.plane, metadata_id)
            lowered = name.lower()
            kind = Kind.MEMCPY if "memcpy" in lowered else Kind.MEMSET if "memset" in lowered else Kind.KERNEL
            found = self.by_metadata[metadata_id] = (kind, name)
        return found

    def add(self, line: xplane_pb2.XLine, events: Iterable[xplane_pb2.XEvent],
            origin_us: float) -> None:
        if line.name == STEPS_LINE:
            for event in events:
                if not is_aggregate(event):
                    self.steps.append((origin_us + event.offset_ps / 1e6, event.duration_ps / 1e6,
                                       event_name(self.plane, event.metadata_id)))
            return
        track = f"GPU {self.index} {line.name}"
        for event in events:
            if is_aggregate(event):
                continue
            kind, name = self.classify(event.metadata_id)
            corr = stat_of(event, self.corr_stat)
            self.trace.add(kind, origin_us + event.offset_ps / 1e6, event.duration_ps / 1e6, name, track,
                           corr=-1 if corr is None else corr)

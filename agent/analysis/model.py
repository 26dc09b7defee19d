"""One small event model for both stored trace formats (Kineto/Chrome JSON and XSpace).

A trace of a few hundred megabytes holds millions of events: they are kept in columns (``array``
of doubles and ints, 36 bytes an event) with names interned once, never as one Python object
per event. Times are microseconds from the trace's first event, durations microseconds.

Kinds of span:

- ``HOST_OP``: a framework operation or annotation on a host thread (PyTorch ``cpu_op`` and
  ``user_annotation``, a TraceMe event of TensorFlow/JAX); ``track`` is the thread.
- ``PYTHON``: a Python function (PyTorch ``python_function``, XSpace ``$``-prefixed events).
- ``RUNTIME``: a CUDA runtime or driver API call on a host thread (``cudaLaunchKernel``,
  ``cudaStreamSynchronize``, ``cudaMemcpyAsync`` ...).
- ``KERNEL``, ``MEMCPY``, ``MEMSET``: activity on a device; ``track`` is the stream.
- ``CPU_COMPUTE``: a compiled computation running on host threads in place of a device (XLA on the
  CPU): treated as device activity when a trace has no device.
- ``STEP``: a training step as the framework marks it (``ProfilerStep#N``, a TF/JAX step annotation).

Two more columns join the kinds: ``corr``, the CUDA correlation id that ties a launch call on a host
thread (``RUNTIME``) to the kernel or copy it started on the device (-1 where the trace gives none),
and ``fill``, a kernel's thread blocks per streaming multiprocessor (below 1, part of the GPU had
nothing to run; -1 where unknown).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Literal

TraceFormat = Literal["kineto", "xspace"]


class Kind(IntEnum):
    HOST_OP = 0
    PYTHON = 1
    RUNTIME = 2
    KERNEL = 3
    MEMCPY = 4
    MEMSET = 5
    CPU_COMPUTE = 6
    STEP = 7


DEVICE_KINDS = (Kind.KERNEL, Kind.MEMCPY, Kind.MEMSET)
MAX_SKIPPED_KINDS = 32
EPOCH_2001_NS = 10**18  # September 2001: a time before it is not the Unix epoch's


@dataclass(frozen=True, slots=True)
class Span:
    """One event, as the analysis reads it back from the columns."""

    kind: Kind
    start: float  # microseconds from the trace's origin
    dur: float  # microseconds
    name: str
    track: str  # thread or stream name

    @property
    def end(self) -> float:
        return self.start + self.dur


class Spans:
    """The spans of one kind, in columns; ``sort()`` orders them by start (readers append in any order)."""

    __slots__ = ("corr", "dur", "fill", "name", "start", "track")
    COLUMNS = ("start", "dur", "name", "track", "corr", "fill")

    def __init__(self) -> None:
        self.start = array("d")
        self.dur = array("d")
        self.name = array("I")
        self.track = array("I")
        self.corr = array("q")
        self.fill = array("f")

    def __len__(self) -> int:
        return len(self.start)

    def append(self, start: float, dur: float, name: int, track: int, *, corr: int = -1,
               fill: float = -1.0) -> None:
        self.start.append(start)
        self.dur.append(dur)
        self.name.append(name)
        self.track.append(track)
        self.corr.append(corr)
        self.fill.append(fill)

    def sort(self) -> None:
        order = sorted(range(len(self.start)), key=self.start.__getitem__)
        if all(order[i] == i for i in range(len(order))):
            return
        for column in self.COLUMNS:
            values = getattr(self, column)
            setattr(self, column, array(values.typecode, (values[i] for i in order)))

    def shift(self, offset: float) -> None:
        """Move every start by ``offset`` microseconds (to a new origin)."""
        for i in range(len(self.start)):
            self.start[i] += offset


@dataclass
class Trace:
    """One process's (or one profile's) events, by kind, with what the reader learnt of the source."""

    format: TraceFormat
    source: str  # the file, as the user named it
    framework: str = ""  # "pytorch", "jax", "tensorflow", or "" when the trace does not say
    spans: dict[Kind, Spans] = field(default_factory=lambda: {kind: Spans() for kind in Kind})
    names: list[str] = field(default_factory=list)
    tracks: list[str] = field(default_factory=list)
    step_numbers: array[int] = field(default_factory=lambda: array("q"))  # per STEP span, -1 when unnumbered
    has_device: bool = False  # a GPU's activity was recorded (kernels, copies), even if none ran
    has_stacks: bool = False  # Python function events are present
    truncated: bool = False  # the file ended inside its events: what came before the cut was read
    # Device events per GPU ("GPU 0"), after ``finish``; a GPU the trace names without events (an
    # XSpace plane with no kernels) counts 0.
    devices: dict[str, int] = field(default_factory=dict)
    # Events the reader saw and left out, by category (at most MAX_SKIPPED_KINDS of them): what an
    # unreadable trace holds instead.
    skipped: dict[str, int] = field(default_factory=dict)
    events_read: int = 0
    # Host operations that are the user's or the framework's annotations (PyTorch's user_annotation:
    # ``Optimizer.step#...``, ``record_function`` blocks), not operators: by name id.
    annotations: set[int] = field(default_factory=set)
    compute_capability: tuple[int, int] | None = None  # of the traced GPU, when the trace says
    # Nanoseconds since the Unix epoch of the trace's time 0 (after ``finish``), when the trace gives
    # its clock: traces of processes on one node are then placed on one time line.
    epoch_ns: int | None = None
    base_ns: int = 0  # what the reader adds to an event's time to get the epoch (set before finish)
    # Of a rank of a distributed job, when the trace says (Kineto's ``distributedInfo``): its ``rank``
    # and ``world_size``; empty otherwise.
    distributed: dict[str, int] = field(default_factory=dict)
    _name_ids: dict[str, int] = field(default_factory=dict, repr=False)
    _track_ids: dict[str, int] = field(default_factory=dict, repr=False)

    def name_id(self, name: str) -> int:
        found = self._name_ids.get(name)
        if found is None:
            found = self._name_ids[name] = len(self.names)
            self.names.append(name)
        return found

    def track_id(self, track: str) -> int:
        found = self._track_ids.get(track)
        if found is None:
            found = self._track_ids[track] = len(self.tracks)
            self.tracks.append(track)
        return found

    def add(self, kind: Kind, start: float, dur: float, name: str, track: str, *, corr: int = -1,
            fill: float = -1.0) -> None:
        """One event; a negative duration (a clock glitch) counts as 0."""
        self.spans[kind].append(start, max(dur, 0.0), self.name_id(name), self.track_id(track), corr=corr,
                                fill=fill)
        self.events_read += 1

    def skip(self, category: str) -> None:
        """Count an event that was seen and not kept."""
        if category in self.skipped or len(self.skipped) < MAX_SKIPPED_KINDS:
            self.skipped[category] = self.skipped.get(category, 0) + 1

    def add_step(self, start: float, dur: float, name: str, track: str, number: int = -1) -> None:
        self.add(Kind.STEP, start, dur, name, track)
        self.step_numbers.append(number)

    def finish(self) -> None:
        """Sort every kind by start and move the origin to the first event. Readers call it last."""
        steps = self.spans[Kind.STEP]
        if len(steps):
            order = sorted(range(len(steps)), key=steps.start.__getitem__)
            self.step_numbers = array("q", (self.step_numbers[i] for i in order))
        for spans in self.spans.values():
            spans.sort()
        origin = min((s.start[0] for s in self.spans.values() if len(s)), default=0.0)
        if origin:
            for spans in self.spans.values():
                spans.shift(-origin)
        epoch_ns = self.base_ns + round(origin * 1000)
        # A clock that is not the epoch's (a profile's own, counted from its start) says nothing of
        # where the trace lies beside another process's.
        self.epoch_ns = epoch_ns if epoch_ns >= EPOCH_2001_NS else None
        self.has_stacks = self.has_stacks or bool(len(self.spans[Kind.PYTHON]))
        for kind in DEVICE_KINDS:
            for track in self.spans[kind].track:
                gpu = gpu_of(self.tracks[track])
                self.devices[gpu] = self.devices.get(gpu, 0) + 1

    def of_device(self, gpu: str) -> Trace:
        """The same trace with only one GPU's device events (host events shared, not copied): a process
        that drives several GPUs is read one GPU at a time, so that one GPU's work does not fill
        another's idle time."""
        spans = dict(self.spans)
        tracks = [gpu_of(track) == gpu for track in self.tracks]
        for kind in DEVICE_KINDS:
            kept, source = Spans(), self.spans[kind]
            for i in range(len(source)):
                if tracks[source.track[i]]:
                    kept.append(source.start[i], source.dur[i], source.name[i], source.track[i],
                                corr=source.corr[i], fill=source.fill[i])
            spans[kind] = kept
        # ``devices`` stays the trace's: GPUs that ran nothing still say the capture caught part of them.
        return replace(self, source=f"{self.source} [{gpu}]", spans=spans)

    def count(self, kind: Kind) -> int:
        return len(self.spans[kind])

    def iter(self, kind: Kind) -> Iterator[Span]:
        spans = self.spans[kind]
        names, tracks = self.names, self.tracks
        for i in range(len(spans)):
            yield Span(kind, spans.start[i], spans.dur[i], names[spans.name[i]], tracks[spans.track[i]])

    @property
    def active_devices(self) -> list[str]:
        """The GPUs with device events, in order."""
        return sorted((gpu for gpu, count in self.devices.items() if count),
                      key=lambda gpu: (len(gpu), gpu))

    @property
    def end(self) -> float:
        """The end of the last event, microseconds from the origin."""
        return max((max(s + d for s, d in zip(spans.start, spans.dur, strict=True))
                    for spans in self.spans.values() if len(spans)), default=0.0)


def gpu_of(track: str) -> str:
    """The GPU of a device track ("GPU 0 stream 7", "GPU 0 Stream #14(...)"): its first two words."""
    return " ".join(track.split()[:2])

"""The Chrome trace JSON that PyTorch's profiler (Kineto) writes, read as a stream.

A trace is one JSON object whose ``traceEvents`` array holds every event; it runs to hundreds of
megabytes. It is never loaded whole: the text is read a chunk at a time (through ``gzip`` for
``.gz``), each event is decoded on its own with ``JSONDecoder.raw_decode`` and dropped once added to
the Trace, and only the undecoded tail of the text is kept. The other top-level keys (schema
version, device properties, distributed info ...) are small and may come before or after the events.

Only complete events (``"ph": "X"``) of the categories below are kept; metadata, instant and flow
events, and categories the analysis does not use (GPU-side annotations, overheads) are skipped.
Host events are tracked by thread (``thread TID``), device events by stream (``GPU PID stream S``).

The categories changed over PyTorch's versions: 1.8 and 1.9 write ``Operator``, ``Kernel``,
``Runtime``, ``Memcpy``, ``Memset`` and ``Python``, with device threads named ``stream 7``; 1.10 and
later ``cpu_op``, ``kernel``, ``cuda_runtime``, ``gpu_memcpy``, ``gpu_memset`` and ``python_function``.
Both are read, by their lowercased name. A kernel's ``blocks per SM`` (1.10 and later) is computed
from its ``grid`` and the GPU's ``numSms`` where an older trace gives only those.

A trace cut off inside its event array (a profiler killed while writing, a partial download) is read
up to the last whole event and marked ``truncated``; a file that is not a trace at all is an error.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import re
import zlib
from pathlib import Path
from typing import Any

from gpuscope.analysis.errors import DEFAULT_MAX_BYTES, TraceError, TraceFormatError, TraceTooLargeError
from gpuscope.analysis.model import DEVICE_KINDS, Kind, Trace

DEFAULT_CHUNK_CHARS = 1 << 20

# One top-level value or event longer than this is taken for a malformed file (an unterminated
# string would otherwise pull the rest of the file into memory while waiting for its end).
MAX_VALUE_CHARS = 64 << 20

BinaryFile = io.BufferedReader | gzip.GzipFile

# By the category's lowercased name: PyTorch 1.8/1.9 capitalise theirs (``Operator``, ``Kernel`` ...).
KIND_BY_CATEGORY = {
    "cpu_op": Kind.HOST_OP,
    "operator": Kind.HOST_OP,  # PyTorch 1.8/1.9
    "user_annotation": Kind.HOST_OP,
    "python_function": Kind.PYTHON,
    "python": Kind.PYTHON,  # PyTorch 1.8/1.9
    "cuda_runtime": Kind.RUNTIME,
    "cuda_driver": Kind.RUNTIME,
    "runtime": Kind.RUNTIME,  # PyTorch 1.8/1.9
    "hip_runtime": Kind.RUNTIME,
    "kernel": Kind.KERNEL,
    "gpu_memcpy": Kind.MEMCPY,
    "memcpy": Kind.MEMCPY,  # PyTorch 1.8/1.9
    "gpu_memset": Kind.MEMSET,
    "memset": Kind.MEMSET,  # PyTorch 1.8/1.9
}
# Categories only PyTorch writes: seeing one names the framework.
PYTORCH_CATEGORIES = frozenset({"cpu_op", "operator", "python_function", "python"})

PROFILER_STEP = re.compile(r"ProfilerStep#(\d+)")
WHITESPACE = re.compile(r"[ \t\n\r]*")


def read_kineto(path: Path, *, max_bytes: int = DEFAULT_MAX_BYTES,
                chunk_chars: int = DEFAULT_CHUNK_CHARS) -> Trace:
    """The events of a Kineto trace (``.json`` or ``.json.gz``), reading at most ``max_bytes``
    decompressed bytes and ``chunk_chars`` characters at a time."""
    trace = Trace(format="kineto", source=str(path))
    events = KinetoEvents(trace)
    try:
        with open_binary(path) as binary:
            stream = TextStream(binary, path, chunk_chars=chunk_chars, max_bytes=max_bytes)
            read_document(stream, events)
    except gzip.BadGzipFile as error:
        raise TraceFormatError(f"{path}: not gzip data: {error}") from error
    except OSError as error:
        raise TraceError(f"{path}: cannot read the trace: {error}") from error
    except (EOFError, zlib.error) as error:  # a truncated or corrupt gzip stream
        raise TraceFormatError(f"{path}: corrupt gzip data: {error}") from error
    except UnicodeDecodeError as error:
        raise TraceFormatError(f"{path}: not UTF-8 text: {error}") from error
    except TraceFormatError:
        # Cut off inside the event array: what was read before the cut is a trace, marked so.
        if not events.in_events or not trace.events_read:
            raise
        trace.truncated = True
    trace.finish()
    return trace


def open_binary(path: Path) -> BinaryFile:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    return path.open("rb")


class TextStream:
    """The decompressed text of a trace, decoded a JSON value at a time from the front.

    ``buffer[pos:]`` is the text read but not yet decoded; ``dropped`` counts the characters decoded
    and discarded before ``buffer``, so ``dropped + pos`` is where the reader stands in the file.
    """

    def __init__(self, binary: BinaryFile, path: Path, *, chunk_chars: int, max_bytes: int) -> None:
        self.binary = binary
        self.text = io.TextIOWrapper(binary, encoding="utf-8", newline="")  # no newline translation
        self.path = path
        self.chunk_chars = max(1, chunk_chars)
        self.max_bytes = max_bytes
        self.decoder = json.JSONDecoder()
        self.buffer = ""
        self.pos = 0
        self.dropped = 0
        self.at_end = False

    def offset(self) -> int:
        return self.dropped + self.pos

    def fail(self, what: str) -> TraceFormatError:
        return TraceFormatError(f"{self.path}: malformed trace JSON at character {self.offset()}: {what}")

    def read_more(self, at_least: int = 0) -> bool:
        """Append the next chunk (of at least ``at_least`` characters); False at the end of the file."""
        if self.at_end:
            return False
        chunk = self.text.read(max(self.chunk_chars, at_least))
        # The binary file's position counts the decompressed bytes handed to the text decoder.
        if self.binary.tell() > self.max_bytes:
            raise TraceTooLargeError(f"{self.path}: the trace holds more than {self.max_bytes} bytes "
                                     "(decompressed); not read further")
        if not chunk:
            self.at_end = True
            return False
        self.dropped += self.pos
        self.buffer = self.buffer[self.pos:] + chunk
        self.pos = 0
        return True

    def peek(self) -> str:
        """The next character that is not whitespace, not consumed; "" at the end of the file."""
        while True:
            match = WHITESPACE.match(self.buffer, self.pos)
            self.pos = match.end() if match else self.pos
            if self.pos < len(self.buffer):
                return self.buffer[self.pos]
            if not self.read_more():
                return ""

    def expect(self, allowed: str) -> str:
        """Consume the next character, one of ``allowed``."""
        found = self.peek()
        if not found or found not in allowed:
            wanted = " or ".join(repr(c) for c in allowed)
            raise self.fail(f"expected {wanted}, found {found!r}" if found else
                            f"expected {wanted}, found the end of the file (truncated?)")
        self.pos += 1
        return found

    def value(self) -> Any:
        """Decode the next JSON value, reading more text while it is incomplete."""
        if not self.peek():
            raise self.fail("expected a value, found the end of the file (truncated?)")
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buffer, self.pos)
            except json.JSONDecodeError as error:
                pending = len(self.buffer) - self.pos
                if pending > MAX_VALUE_CHARS:
                    raise self.fail(f"a value longer than {MAX_VALUE_CHARS} characters") from error
                # Read as much again as is pending: a long value is retried a few times, not once a chunk.
                if self.read_more(at_least=pending):
                    continue
                raise self.fail(error.msg) from error
            # A number or literal that ends where the text read so far ends may go on in the next chunk.
            if end == len(self.buffer) and self.read_more():
                continue
            self.pos = end
            return value


class KinetoEvents:
    """Adds a trace's events, one decoded JSON object at a time, to a Trace."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.in_events = False  # reading the traceEvents array
        self.sms = 0  # the GPU's multiprocessors, for the fill of kernels that give only their grid

    def add(self, event: Any) -> None:
        if not isinstance(event, dict) or event.get("ph") != "X":
            return
        category = event.get("cat")
        category = category.lower() if isinstance(category, str) else ""
        kind = KIND_BY_CATEGORY.get(category)
        if kind is None:
            self.trace.skip(f"category {category!r}" if category else "no category")
            return
        start, dur = number(event.get("ts")), number(event.get("dur", 0))
        if start is None or dur is None:
            return
        name = event.get("name")
        name = name if isinstance(name, str) else str(name)
        args = event.get("args")
        args = args if isinstance(args, dict) else {}
        if kind in DEVICE_KINDS:
            stream = args.get("stream", event.get("tid"))
            if isinstance(stream, str):  # PyTorch 1.8/1.9 name the device thread "stream 7"
                stream = stream.removeprefix("stream ").strip()
            fill = self.fill(args) if kind is Kind.KERNEL else None
            self.trace.add(kind, start, dur, name, f"GPU {event.get('pid')} stream {stream}",
                           corr=integer(args.get("correlation")), fill=-1.0 if fill is None else fill)
            self.trace.has_device = True
            return
        track = f"thread {event.get('tid')}"
        if category in PYTORCH_CATEGORIES:
            self.trace.framework = "pytorch"
        step = PROFILER_STEP.fullmatch(name) if kind is Kind.HOST_OP else None
        if step:
            self.trace.framework = "pytorch"
            self.trace.add_step(start, dur, name, track, number=int(step.group(1)))
            return
        if kind is Kind.RUNTIME:
            self.trace.add(kind, start, dur, name, track, corr=integer(args.get("correlation")))
            return
        if category == "user_annotation":
            self.trace.annotations.add(self.trace.name_id(name))
        self.trace.add(kind, start, dur, name, track)

    def fill(self, args: dict[str, Any]) -> float | None:
        """A kernel's thread blocks per multiprocessor: as the trace gives it, or from its grid."""
        given = number(args.get("blocks per SM"))
        if given is not None or not self.sms:
            return given
        grid = args.get("grid")
        if not isinstance(grid, list) or not grid or not all(integer(g) > 0 for g in grid):
            return None
        blocks = 1
        for g in grid:
            blocks *= g
        return blocks / self.sms

    def add_metadata(self, key: str, value: Any) -> None:
        """A top-level key other than ``traceEvents``: the GPU's properties, the clock's base, the rank."""
        if key == "deviceProperties" and value:
            self.trace.has_device = True
            first = value[0] if isinstance(value, list) and isinstance(value[0], dict) else {}
            major, minor = integer(first.get("computeMajor")), integer(first.get("computeMinor"))
            if major > 0:
                self.trace.compute_capability = (major, max(minor, 0))
            if not self.sms:
                self.sms = max(integer(first.get("numSms")), 0)
        elif key == "baseTimeNanoseconds" and integer(value) > 0:
            self.trace.base_ns = integer(value)
        elif key == "distributedInfo" and isinstance(value, dict):
            rank, world_size = integer(value.get("rank")), integer(value.get("world_size"))
            if 0 <= rank < world_size:
                self.trace.distributed = {"rank": rank, "world_size": world_size}


def number(value: Any) -> float | None:
    """A time field as a float, or None when it is not a finite number (JSON's NaN and Infinity, which
    Python's decoder accepts, would poison every sum they enter)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def integer(value: Any) -> int:
    """A whole number from the trace, or -1 when it is not one."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return -1


def read_document(stream: TextStream, events: KinetoEvents) -> None:
    """The top-level object: its keys in any order, ``traceEvents`` streamed."""
    if stream.peek() != "{":
        raise stream.fail("not a Chrome trace (expected a JSON object with a traceEvents array)")
    stream.expect("{")
    seen_events = False
    if stream.peek() != "}":
        while True:
            key = stream.value()
            if not isinstance(key, str):
                raise stream.fail("expected a key")
            stream.expect(":")
            if key == "traceEvents":
                events.in_events = True
                read_events(stream, events)
                events.in_events = False
                seen_events = True
            else:
                events.add_metadata(key, stream.value())
            if stream.expect(",}") == "}":
                break
    else:
        stream.expect("}")
    if stream.peek():
        raise stream.fail("text after the trace's closing brace")
    if not seen_events:
        raise TraceFormatError(f"{stream.path}: not a Chrome trace: no traceEvents array")


def read_events(stream: TextStream, events: KinetoEvents) -> None:
    """The ``traceEvents`` array, an event at a time."""
    stream.expect("[")
    if stream.peek() == "]":
        stream.expect("]")
        return
    while True:
        events.add(stream.value())
        if stream.expect(",]") == "]":
            return

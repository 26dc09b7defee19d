"""Captures from TensorFlow and JAX processes through their profiler server (TSL's ProfilerService).

A job that called ``jax.profiler.start_server(port)`` or ``tf.profiler.experimental.server.start(port)``
answers ``/tensorflow.ProfilerService/Profile`` over gRPC: it records for ``opts.duration_ms`` and, when
asked with ``emit_xspace``, returns the trace (an XSpace) in the response, so the agent needs no
filesystem shared with the job. The backend stores it as ``plugins/profile/<run>/<host>.xplane.pb``
under the staging directory: the layout TensorBoard's profile plugin and XProf read.

Measured on JAX 0.10.2 (CPU): a second concurrent capture fails at once with INTERNAL "Another
profiling session active."; an idle process answers after the full duration with ``empty_trace``
(its XSpace still has a host plane, without events); no server: UNAVAILABLE within milliseconds.

The call is made by a profiler client process (``gpuscope.capture.tsl_client``), so that neither gRPC
nor the trace while it arrives stays in the agent's memory; the agent copies the trace it hands over
into the staging area a MiB at a time. The XSpace is never parsed into objects: the response is read
through wire-compatible views that keep it as bytes (a second of capture is several MiB), and written
byte for byte.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO

from gpuscope.capture.config import DEFAULT_MAX_TRACE_BYTES
from gpuscope.capture.model import (
    BackendResult,
    CaptureTarget,
    StagingArea,
    TargetKind,
    clip_error,
    request_problem,
)
from gpuscope.common.addresses import AddressError, HostPort, parse_host_port
from gpuscope.common.sizes import format_size
from gpuscope.common.unixfs import safe_file_name

PROFILE_METHOD = "/tensorflow.ProfilerService/Profile"
RESPONSE_OVERHEAD_BYTES = 1 << 20  # a response's fields besides the trace (tool names, errors)
XPLANE_SUFFIX = ".xplane.pb"
TORCH_TRACE_SUFFIX = ".pt.trace.json.gz"  # what gpuscope.workload.serve returns in tool_data
PROFILE_DIR = ("plugins", "profile")  # under a TensorBoard logdir
# Where a server that ignores emit_xspace (an old TensorFlow) writes the trace on its own filesystem.
DEFAULT_REPOSITORY_ROOT = "/tmp/gpuscope/plugins/profile"
MAX_HEADER_BYTES = 64 * 1024  # the client process's answer line (and what is read of its stderr)
COPY_CHUNK_BYTES = 1 << 20  # the trace is copied from the client process a MiB at a time
CLIENT_EXIT_S = 10.0  # after the deadline, the time a client process has to hand over its trace
# gRPC's other name resolvers: a target like "unix:/path", "dns:///host:port" or "ipv4:1.2.3.4:5".
# ("dns:6009" stays the host "dns", port 6009.)
_GRPC_SCHEME = re.compile(r"(?:unix|unix-abstract|vsock|dns|ipv4|ipv6|xds):(?!\d+$)|[a-z][a-z0-9+.-]*://",
                          re.IGNORECASE)


def parse_target(address: str) -> HostPort:
    """A ProfilerService endpoint: ``host:port`` or ``[ipv6]:port``, optionally with the ``grpc://``
    prefix TensorFlow's client takes. Other gRPC target schemes (``unix:``, ``dns:``, ...) are refused
    (AddressError, a ValueError)."""
    text = address.strip().removeprefix("grpc://")
    if _GRPC_SCHEME.match(text):
        raise AddressError(f"profiler address {address!r}: gRPC target schemes such as unix: or dns: are "
                           "not supported; name the server as host:port")
    try:
        return parse_host_port(text)
    except AddressError as err:
        raise AddressError(f"profiler {err}") from None


class TslProfilerBackend:
    """CaptureBackend for TSL profiler servers (TensorFlow, JAX). Stateless and thread-safe: one
    instance serves concurrent captures of different targets, each through a profiler client process
    of its own (``gpuscope.capture.tsl_client``: gRPC, and the trace while it arrives, stay out of the
    agent's memory), whose trace is copied into the staging area a chunk at a time."""

    kind: TargetKind = "tsl"
    client_command: tuple[str, ...] = (sys.executable, "-m", "gpuscope.capture.tsl_client")  # + its ARGS

    def __init__(self, *, python_tracer_level: int = 0, host_tracer_level: int = 2,
                 device_tracer_level: int = 1, repository_root: str = DEFAULT_REPOSITORY_ROOT,
                 max_trace_bytes: int = DEFAULT_MAX_TRACE_BYTES) -> None:
        self.max_trace_bytes = max_trace_bytes
        self.python_tracer_level = python_tracer_level
        self.host_tracer_level = host_tracer_level
        self.device_tracer_level = device_tracer_level
        self.repository_root = repository_root

    def capture(self, target: CaptureTarget, duration_s: float, staging: StagingArea, *,
                deadline_s: float) -> BackendResult:
        """Profiles ``target`` for ``duration_s``; never raises, never blocks past ``deadline_s`` (and
        the client process's exit)."""
        try:
            return self._capture(target, duration_s, staging, deadline_s=deadline_s)
        except Exception as err:  # the contract: an outcome, never an exception
            return BackendResult("failed", error=clip_error(f"{type(err).__name__}: {err}"))

    def _capture(self, target: CaptureTarget, duration_s: float, staging: StagingArea, *,
                 deadline_s: float) -> BackendResult:
        problem = request_problem(target, "tsl", duration_s, deadline_s)
        if problem is not None or target.address is None:
            return BackendResult("failed", error=problem)
        try:
            address = parse_target(target.address)
        except AddressError as err:
            return BackendResult("failed", error=str(err))
        run = staging.run
        if not run or safe_file_name(run, limit=255, default="") != run:
            return BackendResult("failed", error=f"run name {run!r} is not a plain file name")
        args = {"address": str(address), "duration_ms": max(1, round(duration_s * 1000)), "run": run,
                "pid": target.pid, "deadline_s": deadline_s, "deadline_at": time.monotonic() + deadline_s,
                "max_trace_bytes": self.max_trace_bytes, "repository_root": self.repository_root,
                "python_tracer_level": self.python_tracer_level,
                "host_tracer_level": self.host_tracer_level, "device_tracer_level": self.device_tracer_level}
        with tempfile.TemporaryFile() as errors, subprocess.Popen(
                [*self.client_command, json.dumps(args)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors) as client:
            # Past its deadline (and the time to hand over its trace) the client is killed.
            stop = threading.Timer(deadline_s + CLIENT_EXIT_S, client.kill)
            stop.start()
            stream = client.stdout
            assert stream is not None  # stdout=PIPE
            try:
                result = self._receive(stream, staging)
            finally:
                stop.cancel()
                stream.close()  # a client still writing gets EPIPE and ends
                client.wait()
            if result is None:  # no answer: it died, or was killed
                errors.seek(0)
                said = errors.read(MAX_HEADER_BYTES).decode(errors="replace").strip().splitlines()
                return BackendResult("failed", error=clip_error(
                    f"the profiler client process ended with status {client.returncode} without an answer"
                    + (f": {said[-1]}" if said else "")))
            return result

    def _receive(self, stream: IO[bytes], staging: StagingArea) -> BackendResult | None:
        """The client's answer, its trace copied into ``staging``; None when it sent none."""
        line = stream.readline(MAX_HEADER_BYTES)
        if not line.endswith(b"\n"):
            return None
        header = json.loads(line)
        outcome, error, spec = header["outcome"], header.get("error"), header.get("file")
        if spec is None:
            return BackendResult(outcome, error=error)
        size = int(spec["bytes"])
        if size > self.max_trace_bytes + RESPONSE_OVERHEAD_BYTES:  # gRPC refuses more; checked all the same
            return BackendResult("failed", error=too_large(self.max_trace_bytes, f"{size} bytes"))
        with staging.new_file(str(spec["stem"]), str(spec["suffix"]),
                              folders=tuple(str(f) for f in spec["folders"])) as new:
            left = size
            while left:
                chunk = stream.read(min(left, COPY_CHUNK_BYTES))
                if not chunk:
                    return BackendResult("failed", error=f"the profiler client process sent {size - left} of "
                                                         f"the trace's {size} bytes")
                new.file.write(chunk)
                left -= len(chunk)
            return BackendResult(outcome, files=(new.publish(),), error=error)


def too_large(max_trace_bytes: int, detail: str) -> str:
    """Why a trace over ``capture.max_trace_bytes`` was refused."""
    return clip_error(
        f"the target's trace is larger than capture.max_trace_bytes ({format_size(max_trace_bytes)}); it was "
        f"refused as it started to arrive ({detail}). Capture for less time, or raise the limit (the "
        "profiler client process holds about 3.6x it in memory while a trace arrives)")

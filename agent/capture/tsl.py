"""Captures from TensorFlow and JAX processes through their profiler server (TSL's ProfilerService).

A job that called ``jax.profiler.start_server(port)`` or ``tf.profiler.experimental.server.start(port)``
answers ``/tensorflow.ProfilerService/Profile`` over gRPC: it records for ``opts.duration_ms`` and, when
asked with ``emit_xspace``, returns the trace (an XSpace) in the response, so the agent needs no
filesystem shared with the job. The backend stores it as ``plugins/profile/<run>/<host>.xplane.pb``
under the staging directory: the layout TensorBoard's profile plugin and XProf read.

Measured on JAX 0.10.2 (CPU): a second concurrent capture fails at once with INTERNAL "Another
profiling session active."; an idle process answers after the full duration with ``empty_trace``
(its XSpace still has a host plane, without events); no server: UNAVAILABLE within milliseconds.

The XSpace is never parsed into objects: the response is read through wire-compatible views that
keep it as bytes (a second of capture is several MiB), and written byte for byte.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

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
from gpuscope.common.lazy_import import lazy_module
from gpuscope.common.sizes import format_size
from gpuscope.common.unixfs import safe_file_name

if TYPE_CHECKING:
    import grpc

    from gpuscope.generated.tsl import profiler_options_pb2, profiler_service_pb2, views_pb2
else:  # imported at the first capture: an agent that never takes one never loads gRPC
    grpc = lazy_module("grpc")
    profiler_options_pb2 = lazy_module("gpuscope.generated.tsl.profiler_options_pb2")
    profiler_service_pb2 = lazy_module("gpuscope.generated.tsl.profiler_service_pb2")
    views_pb2 = lazy_module("gpuscope.generated.tsl.views_pb2")

PROFILE_METHOD = "/tensorflow.ProfilerService/Profile"
RESPONSE_OVERHEAD_BYTES = 1 << 20  # a response's fields besides the trace (tool names, errors)
XPLANE_SUFFIX = ".xplane.pb"
TORCH_TRACE_SUFFIX = ".pt.trace.json.gz"  # what gpuscope.workload.serve returns in tool_data
PROFILE_DIR = ("plugins", "profile")  # under a TensorBoard logdir
# Where a server that ignores emit_xspace (an old TensorFlow) writes the trace on its own filesystem.
DEFAULT_REPOSITORY_ROOT = "/tmp/gpuscope/plugins/profile"
_BUSY_MESSAGES = ("another profiling session", "session active", "already profiling")
_BUSY_CODES = ("FAILED_PRECONDITION", "ALREADY_EXISTS")  # grpc.StatusCode names
_UNREACHABLE_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED")
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
    instance serves concurrent captures of different targets."""

    kind: TargetKind = "tsl"

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
        """Profiles ``target`` for ``duration_s``; never raises, never blocks past ``deadline_s``."""
        try:
            return self._capture(target, duration_s, staging, deadline_s=deadline_s)
        except Exception as err:  # the contract: an outcome, never an exception
            return BackendResult("failed", error=clip_error(f"{type(err).__name__}: {err}"))

    def request(self, address: HostPort, duration_ms: int, run: str) -> profiler_service_pb2.ProfileRequest:
        """The Profile request: the length in both fields (servers read ``opts.duration_ms``)."""
        options = profiler_options_pb2.ProfileOptions(
            version=1, host_tracer_level=self.host_tracer_level,
            device_tracer_level=self.device_tracer_level, python_tracer_level=self.python_tracer_level,
            duration_ms=duration_ms)
        return profiler_service_pb2.ProfileRequest(
            duration_ms=duration_ms, tools=["xplane"], opts=options, emit_xspace=True,
            repository_root=self.repository_root, session_id=run, host_name=safe_file_name(address.host))

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
        duration_ms = max(1, round(duration_s * 1000))
        started = time.monotonic()
        try:
            response = self._profile(address, self.request(address, duration_ms, run), deadline_s)
        except grpc.RpcError as err:
            if _code(err) == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in _details(err):
                return self._too_large(_details(err))
            return _rpc_error(err, deadline_s, time.monotonic() - started)
        return self._store(response, address, target, staging)

    def _too_large(self, detail: str) -> BackendResult:
        limit = format_size(self.max_trace_bytes)
        return BackendResult("failed", error=clip_error(
            f"the target's trace is larger than capture.max_trace_bytes ({limit}); it was refused as it "
            f"started to arrive ({detail}). Capture for less time, or raise the limit (the agent holds "
            "about 3.6x it in memory while a trace arrives)"))

    def _profile(self, address: HostPort, request: profiler_service_pb2.ProfileRequest,
                 deadline_s: float) -> views_pb2.ProfileResponseView:
        options = [
            # gRPC refuses a larger response from its length prefix, before buffering it: the target
            # cannot make the agent hold more than this (the trace, and the response's other fields).
            ("grpc.max_receive_message_length", self.max_trace_bytes + RESPONSE_OVERHEAD_BYTES),
            ("grpc.enable_http_proxy", 0),  # the job is on this node or in its pod network
        ]
        with grpc.insecure_channel(str(address), options=options) as channel:
            profile = channel.unary_unary(
                PROFILE_METHOD, request_serializer=profiler_service_pb2.ProfileRequest.SerializeToString,
                response_deserializer=views_pb2.ProfileResponseView.FromString)
            response: views_pb2.ProfileResponseView = profile(request, timeout=deadline_s,
                                                              wait_for_ready=False)
            return response

    def _store(self, response: views_pb2.ProfileResponseView, address: HostPort, target: CaptureTarget,
               staging: StagingArea) -> BackendResult:
        if response.empty_trace:
            return BackendResult("empty")
        data = response.xspace
        where = f"pid{target.pid}" if target.pid is not None else f"port{address.port}"
        chrome = next((tool.data for tool in response.tool_data if tool.name.endswith(TORCH_TRACE_SUFFIX)),
                      b"")
        if not data and chrome:
            # gpuscope.workload.serve (PyTorch) answers with a gzip Chrome trace, not an XSpace.
            relative = _write(staging, (), f"{safe_file_name(address.host)}_{where}", chrome,
                              TORCH_TRACE_SUFFIX)
            return BackendResult("captured", files=(relative,))
        if not data:  # a server without emit_xspace support may return the file as tool data
            data = next((tool.data for tool in response.tool_data if tool.name.endswith("xplane.pb")), b"")
        if len(data) > self.max_trace_bytes:
            return self._too_large(f"{len(data)} bytes")
        if not data and not response.HasField("xspace"):
            return BackendResult("failed", error="the server returned no trace (without emit_xspace "
                                                  f"support it writes it under {self.repository_root} "
                                                  "on its own filesystem)")
        space = views_pb2.XSpaceView.FromString(data)
        if not space.planes:
            return BackendResult("empty")
        hostname = space.hostnames[0].decode(errors="replace") if space.hostnames else address.host
        relative = _write(staging, (*PROFILE_DIR, staging.run), f"{safe_file_name(hostname)}_{where}", data,
                          XPLANE_SUFFIX)
        errors = [e.decode(errors="replace") for e in space.errors]
        return BackendResult("captured", files=(relative,),
                             error=clip_error("profiler reported: " + "; ".join(errors)) if errors else None)


def _code(err: grpc.RpcError) -> grpc.StatusCode:
    # The errors that calls raise are also grpc.Call objects (code, details); the stubs cannot say so.
    return err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN


def _details(err: grpc.RpcError) -> str:
    return (err.details() if hasattr(err, "details") else None) or str(err)


def _rpc_error(err: grpc.RpcError, deadline_s: float, elapsed_s: float) -> BackendResult:
    code = _code(err)
    details = _details(err)
    if any(text in details.lower() for text in _BUSY_MESSAGES) or code.name in _BUSY_CODES:
        return BackendResult("busy", error=clip_error(details))
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return BackendResult("unreachable", error=f"no answer within the deadline ({deadline_s:g} s, "
                                                  f"waited {elapsed_s:.1f} s)")
    if code.name in _UNREACHABLE_CODES:
        return BackendResult("unreachable", error=clip_error(details))
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return BackendResult("failed", error=clip_error(f"not a TSL profiler server: {details}"))
    return BackendResult("failed", error=clip_error(f"{code.name}: {details}"))


def _write(staging: StagingArea, folders: tuple[str, ...], stem: str, data: bytes, suffix: str) -> str:
    with staging.new_file(stem, suffix, folders=folders) as new:
        new.file.write(data)
        return new.publish()

"""The profiler client process of TSL captures: one Profile call, its answer to the agent on stdout.

gRPC and protobuf cost a Python process some 20 MiB that it never gives back, and gRPC holds a
received trace about three times over while it arrives (a peak near 3.6x the trace). The agent runs
each TSL capture's call here (``gpuscope.capture.tsl.TslProfilerBackend``), so neither stays in its
memory: this process writes one line of JSON, ``{"outcome", "error", "file"}``, where ``file`` (or
null) is ``{"folders", "stem", "suffix", "bytes"}``, then that many bytes of the trace, and exits.

Run as ``python -m gpuscope.capture.tsl_client ARGS``, ARGS a JSON object: ``address`` (host:port),
``duration_ms``, ``run``, ``pid``, ``deadline_s``, ``deadline_at`` (a time.monotonic() value: the clock
is the machine's, shared by its processes), ``max_trace_bytes``, ``repository_root`` and the three
tracer levels.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import grpc

from gpuscope.capture.model import clip_error
from gpuscope.capture.tsl import (
    PROFILE_DIR,
    PROFILE_METHOD,
    RESPONSE_OVERHEAD_BYTES,
    TORCH_TRACE_SUFFIX,
    XPLANE_SUFFIX,
    too_large,
)
from gpuscope.common.addresses import HostPort, parse_host_port
from gpuscope.common.unixfs import safe_file_name
from gpuscope.generated.tsl import profiler_options_pb2, profiler_service_pb2, views_pb2

_BUSY_MESSAGES = ("another profiling session", "session active", "already profiling")
_BUSY_CODES = ("FAILED_PRECONDITION", "ALREADY_EXISTS")  # grpc.StatusCode names
_UNREACHABLE_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED")

Answer = tuple[dict[str, Any], bytes]  # the header line's fields, and the trace's bytes


def profile_request(args: dict[str, Any], address: HostPort) -> profiler_service_pb2.ProfileRequest:
    """The Profile request: the length in both fields (servers read ``opts.duration_ms``)."""
    duration_ms = int(args["duration_ms"])
    options = profiler_options_pb2.ProfileOptions(
        version=1, host_tracer_level=int(args["host_tracer_level"]),
        device_tracer_level=int(args["device_tracer_level"]),
        python_tracer_level=int(args["python_tracer_level"]), duration_ms=duration_ms)
    return profiler_service_pb2.ProfileRequest(
        duration_ms=duration_ms, tools=["xplane"], opts=options, emit_xspace=True,
        repository_root=str(args["repository_root"]), session_id=str(args["run"]),
        host_name=safe_file_name(address.host))


def profile(args: dict[str, Any]) -> Answer:
    """Call Profile on ``args["address"]`` and say what came back."""
    address = parse_host_port(str(args["address"]))
    max_trace_bytes = int(args["max_trace_bytes"])
    timeout = max(0.0, float(args["deadline_at"]) - time.monotonic())
    options = [
        # gRPC refuses a larger response from its length prefix, before buffering it: the target
        # cannot make this process hold more than this (the trace, and the response's other fields).
        ("grpc.max_receive_message_length", max_trace_bytes + RESPONSE_OVERHEAD_BYTES),
        ("grpc.enable_http_proxy", 0),  # the job is on this node or in its pod network
    ]
    started = time.monotonic()
    try:
        with grpc.insecure_channel(str(address), options=options) as channel:
            call = channel.unary_unary(
                PROFILE_METHOD, request_serializer=profiler_service_pb2.ProfileRequest.SerializeToString,
                response_deserializer=views_pb2.ProfileResponseView.FromString)
            response = call(profile_request(args, address), timeout=timeout, wait_for_ready=False)
    except grpc.RpcError as err:
        if _code(err) == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in _details(err):
            return _outcome("failed", too_large(max_trace_bytes, _details(err)))
        return _rpc_error(err, float(args.get("deadline_s", timeout)), time.monotonic() - started)
    return _answer(response, address, args, max_trace_bytes)


def _answer(response: views_pb2.ProfileResponseView, address: HostPort, args: dict[str, Any],
            max_trace_bytes: int) -> Answer:
    if response.empty_trace:
        return _outcome("empty")
    data = response.xspace
    pid = args.get("pid")
    where = f"pid{pid}" if pid is not None else f"port{address.port}"
    chrome = next((tool.data for tool in response.tool_data if tool.name.endswith(TORCH_TRACE_SUFFIX)), b"")
    if not data and chrome:
        # gpuscope.workload.serve (PyTorch) answers with a gzip Chrome trace, not an XSpace.
        return _file((), f"{safe_file_name(address.host)}_{where}", TORCH_TRACE_SUFFIX, chrome)
    if not data:  # a server without emit_xspace support may return the file as tool data
        data = next((tool.data for tool in response.tool_data if tool.name.endswith("xplane.pb")), b"")
    if len(data) > max_trace_bytes:
        return _outcome("failed", too_large(max_trace_bytes, f"{len(data)} bytes"))
    if not data and not response.HasField("xspace"):
        return _outcome("failed", f"the server returned no trace (without emit_xspace support it writes it "
                                  f"under {args['repository_root']} on its own filesystem)")
    space = views_pb2.XSpaceView.FromString(data)
    if not space.planes:
        return _outcome("empty")
    hostname = space.hostnames[0].decode(errors="replace") if space.hostnames else address.host
    errors = [e.decode(errors="replace") for e in space.errors]
    header, _ = _file((*PROFILE_DIR, str(args["run"])), f"{safe_file_name(hostname)}_{where}", XPLANE_SUFFIX,
                      data)
    if errors:
        header["error"] = clip_error("profiler reported: " + "; ".join(errors))
    return header, data


def _outcome(outcome: str, error: str | None = None) -> Answer:
    return {"outcome": outcome, "error": error, "file": None}, b""


def _file(folders: tuple[str, ...], stem: str, suffix: str, data: bytes) -> Answer:
    spec = {"folders": list(folders), "stem": stem, "suffix": suffix, "bytes": len(data)}
    return {"outcome": "captured", "error": None, "file": spec}, data


def _code(err: grpc.RpcError) -> grpc.StatusCode:
    # The errors that calls raise are also grpc.Call objects (code, details); the stubs cannot say so.
    return err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN


def _details(err: grpc.RpcError) -> str:
    return (err.details() if hasattr(err, "details") else None) or str(err)


def _rpc_error(err: grpc.RpcError, deadline_s: float, elapsed_s: float) -> Answer:
    code = _code(err)
    details = _details(err)
    if any(text in details.lower() for text in _BUSY_MESSAGES) or code.name in _BUSY_CODES:
        return _outcome("busy", clip_error(details))
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return _outcome("unreachable", f"no answer within the deadline ({deadline_s:g} s, waited "
                                       f"{elapsed_s:.1f} s)")
    if code.name in _UNREACHABLE_CODES:
        return _outcome("unreachable", clip_error(details))
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return _outcome("failed", clip_error(f"not a TSL profiler server: {details}"))
    return _outcome("failed", clip_error(f"{code.name}: {details}"))


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent decides when a capture ends
    args = json.loads((sys.argv[1:] if argv is None else argv)[0])
    try:
        header, data = profile(args)
    except Exception as err:  # an answer that cannot be read, above all: an outcome, never a traceback
        header, data = _outcome("failed", clip_error(f"{type(err).__name__}: {err}"))
    out = sys.stdout.buffer
    out.write(json.dumps(header).encode() + b"\n")
    out.write(data)
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

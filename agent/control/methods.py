"""What the control API's methods do, on plain values: no gRPC here.

The agent runs these; the gRPC server that receives the calls is either in the agent (``control.tcp``
configured) or in a short-lived server process (``gpuscope.control.server_process``) that forwards each
call over a private socket (``gpuscope.control.bridge``). A failed call raises ``ApiError`` with the
name of the gRPC status code it is answered with and a message for the user.

A capture blocks its call for its duration, so at most ``MAX_WAITING_CAPTURES`` Capture calls wait at a
time (RESOURCE_EXHAUSTED beyond), which keeps threads free for the other methods. A capture the policy
refuses is a result (outcome "refused"); a request that cannot be a capture (no selector, a duration over
the maximum, a start time too far ahead) is INVALID_ARGUMENT with the reason.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any, Protocol

from gpuscope.alerts.model import AlertSource
from gpuscope.capture.config import MAX_DURATION_SECONDS
from gpuscope.capture.model import CaptureRecord, Trigger
from gpuscope.capture.records import CaptureIdError
from gpuscope.capture.service import CaptureRequest, CaptureService
from gpuscope.capture.store import CaptureNotFoundError, CaptureStore, CaptureStoreError, new_capture_id
from gpuscope.capture.tsl import parse_target
from gpuscope.common.durations import format_duration
from gpuscope.control.config import ControlConfig
from gpuscope.documents import (
    DEFAULT_PROCESSES,
    NO_SNAPSHOT_YET,
    ParameterError,
    ProcessExposure,
    alerts_document,
    captures_document,
    encode_document,
    list_parameters,
    snapshot_document,
)
from gpuscope.snapshot import Snapshot, SnapshotSource
from gpuscope.version import __version__

log = logging.getLogger(__name__)

MAX_WAITING_CAPTURES = 4  # Capture calls blocked at a time
MAX_START_DELAY_S = 60.0  # start_at at most this far ahead (the capture service waits no longer)
MAX_REASON_CHARS = 200
# A capture id names the GPU in at most 4 digits (records.CAPTURE_ID): a larger index made even the record
# of its refusal fail with CaptureIdError, a traceback instead of an answer.
MAX_GPU_INDEX = 9999
# A Capture call without a deadline waits this long at most for its record (the capture goes on).
DEFAULT_CAPTURE_WAIT_S = MAX_START_DELAY_S + MAX_DURATION_SECONDS + 120.0
POLL_S = 0.2  # how often a waiting Capture call checks for a stop or a vanished client


class ApiError(Exception):
    """A call's failure: ``code`` is the name of a gRPC status code (``INVALID_ARGUMENT``, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class CallContext(Protocol):
    """What a method needs to know of its call while it waits (gRPC's ServicerContext has both)."""

    def time_remaining(self) -> float | None: ...

    def is_active(self) -> bool: ...


class ApiMethods(Protocol):
    """The methods a gRPC servicer answers from: ``ControlMethods`` or a bridge to them."""

    info: dict[str, Any]
    stopping: threading.Event

    def snapshot_json(self) -> bytes: ...

    def alerts_json(self) -> bytes: ...

    def capture(self, fields: dict[str, Any], *, user: str, context: CallContext) -> dict[str, Any]: ...

    def list_captures(self, *, limit: int, include_refused: bool) -> dict[str, Any]: ...

    def capture_files(self, capture_id: str) -> list[tuple[str, Path]]: ...


class ControlMethods:
    """The methods of gpuscope.v1.Agent on this agent's parts. ``info``: GetAgentInfo's fields.
    ``processes``: the ``processes`` settings; ``downloads``: whether the HTTP port sends captures (its
    web configuration authenticates every client). The snapshot, the alerts and the capture listing are
    the documents of ``gpuscope.documents``, the same the HTTP endpoints answer."""

    def __init__(self, *, service: CaptureService | None, store: CaptureStore | None,
                 snapshots: SnapshotSource, alerts: AlertSource | None, hostname: str,
                 wall_clock: Callable[[], float] = time.time, info: dict[str, Any] | None = None,
                 processes: ProcessExposure = DEFAULT_PROCESSES,
                 downloads: Callable[[], bool] = lambda: False) -> None:
        self.info: dict[str, Any] = info or {"node_name": hostname, "pid": os.getpid(),
                                             "version": __version__}
        self._service = service
        self._store = store
        self._snapshots = snapshots
        self._alerts = alerts
        self._hostname = hostname
        self._wall_clock = wall_clock
        self._processes = processes
        self._downloads = downloads
        self._waiting = threading.BoundedSemaphore(MAX_WAITING_CAPTURES)
        self.stopping = threading.Event()  # set when the API stops: waiting Capture calls end at once

    def snapshot_json(self) -> bytes:
        snapshot = self._snapshots.latest()
        if snapshot is None:
            raise ApiError("UNAVAILABLE", NO_SNAPSHOT_YET)
        return encode_document(snapshot_document(snapshot, self._processes))

    def alerts_json(self) -> bytes:
        return encode_document(alerts_document(self._alerts))

    def capture(self, fields: dict[str, Any], *, user: str, context: CallContext) -> dict[str, Any]:
        """Take a capture; its record's JSON. ``fields``: the request's fields that are set (``gpu``,
        ``pid`` or ``target``; ``duration_ms``, ``reason``, ``start_at``)."""
        try:
            capture = self._capture_request(fields, user)
        except ValueError as err:
            raise ApiError("INVALID_ARGUMENT", str(err)) from None
        # Checked here, not in the capture service, so that every client hears "no such GPU" instead of
        # a capture that found no profiler.
        missing = _missing_gpu(capture.gpu, self._snapshots.latest(), self._hostname)
        if missing is not None:
            raise missing
        if "reason" in fields:
            log.info("capture requested over the control API (%s): %s", user,
                     str(fields["reason"])[:MAX_REASON_CHARS])
        if self._service is None:
            return self._unserved(capture, "captures are disabled on this agent (capture.enabled: false "
                                           "or the capture store could not be opened)").to_json()
        if not self._waiting.acquire(blocking=False):
            raise ApiError("RESOURCE_EXHAUSTED", f"{MAX_WAITING_CAPTURES} capture requests are already "
                                                 "waiting on this agent; try again when they are done")
        try:
            return self._wait(self._service.submit(capture), context).to_json()
        finally:
            self._waiting.release()

    def list_captures(self, *, limit: int, include_refused: bool) -> dict[str, Any]:
        """The capture listing (``gpuscope.documents.captures_document``). ``limit`` 0: absent (proto3
        cannot tell them apart), the default; out of range: INVALID_ARGUMENT, as HTTP's 400."""
        try:
            parameters = list_parameters(limit=limit or None, include_refused=include_refused)
        except ParameterError as err:
            raise ApiError("INVALID_ARGUMENT", str(err)) from None
        refusals = self._service.refusals if self._service is not None else None
        return captures_document(self._store, refusals, parameters, self._processes,
                                 downloads=self._downloads())

    def capture_files(self, capture_id: str) -> list[tuple[str, Path]]:
        """A stored capture's files: (path relative to the capture, where it is)."""
        store = self._require_store()
        try:
            return [(stored.relative, stored.path) for stored in store.files(capture_id)]
        except CaptureIdError as err:
            raise ApiError("INVALID_ARGUMENT", str(err)) from None
        except CaptureNotFoundError as err:
            raise ApiError("NOT_FOUND", str(err)) from None
        except CaptureStoreError as err:
            raise ApiError("FAILED_PRECONDITION", str(err)) from None

    # -- helpers -----------------------------------------------------------------------------------------

    def _wait(self, future: futures.Future[CaptureRecord], context: CallContext) -> CaptureRecord:
        """The capture's record; the call ends early (the capture goes on, and is stored if it succeeds)
        when its deadline passes, the client goes away or the API stops."""
        remaining = context.time_remaining()
        wait = DEFAULT_CAPTURE_WAIT_S if remaining is None else max(0.0, remaining - 0.2)
        deadline = time.monotonic() + wait
        while True:
            try:
                return future.result(timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
            except futures.TimeoutError:
                pass
            if self.stopping.is_set():
                raise ApiError("UNAVAILABLE", "the agent is stopping; the capture in progress may still be "
                                              "stored")
            if not context.is_active():
                raise ApiError("CANCELLED", "the client went away")
            if time.monotonic() >= deadline:
                raise ApiError("DEADLINE_EXCEEDED", "the capture did not finish before the call's deadline; "
                                                    "it may still be stored: see `gpuscope captures ls`")

    def _capture_request(self, fields: dict[str, Any], user: str) -> CaptureRequest:
        """The service's request for an API request; ValueError names what makes it invalid."""
        gpu = pid = target = None
        if "gpu" in fields:
            if not 0 <= fields["gpu"] <= MAX_GPU_INDEX:
                raise ValueError(f"gpu must be a GPU index (0 to {MAX_GPU_INDEX}), got {fields['gpu']}")
            gpu = int(fields["gpu"])
        elif "pid" in fields:
            if fields["pid"] <= 0:
                raise ValueError(f"pid must be a process id (1 or more), got {fields['pid']}")
            pid = int(fields["pid"])
        elif "target" in fields:
            parse_target(fields["target"])  # AddressError (a ValueError): host:port, nothing else
            target = str(fields["target"]).strip()
        else:
            raise ValueError("name what to capture: gpu, pid or target")
        duration_ms = fields.get("duration_ms") or 0
        duration = duration_ms / 1000 if duration_ms else None  # 0: the agent's default
        if duration is not None and duration > MAX_DURATION_SECONDS:
            raise ValueError(f"duration {format_duration(duration)} is longer than the maximum capture "
                             f"of {format_duration(MAX_DURATION_SECONDS)}")
        if "reason" in fields and len(fields["reason"]) > MAX_REASON_CHARS:
            raise ValueError(f"reason is longer than {MAX_REASON_CHARS} characters")
        start_at = None
        if "start_at" in fields:
            start_at = float(fields["start_at"])
            if not math.isfinite(start_at):
                raise ValueError("start_at must be a finite Unix time")
            ahead = start_at - self._wall_clock()
            if ahead > MAX_START_DELAY_S:
                raise ValueError(f"start_at is {format_duration(round(ahead, 1))} ahead; at most "
                                 f"{format_duration(MAX_START_DELAY_S)} (are the nodes' clocks in sync?)")
        trigger = Trigger("fleet" if start_at is not None else "user", user=user)
        return CaptureRequest(trigger, gpu=gpu, pid=pid, target=target, duration_s=duration,
                              start_at=start_at)

    def _unserved(self, request: CaptureRequest, reason: str) -> CaptureRecord:
        now = self._wall_clock()
        return CaptureRecord(
            id=new_capture_id(now, gpu=request.gpu, pid=request.pid, token=secrets.token_hex(3)),
            trigger=request.trigger, gpu=request.gpu, pids=() if request.pid is None else (request.pid,),
            targets=(), start=now, duration_s=request.duration_s or 0.0, bytes=0, outcome="refused",
            error=reason, hostname=self._hostname)

    def _require_store(self) -> CaptureStore:
        if self._store is None:
            raise ApiError("FAILED_PRECONDITION", "captures are disabled on this agent (no capture store)")
        return self._store


def _missing_gpu(gpu: int | None, snapshot: Snapshot | None, hostname: str) -> ApiError | None:
    """Why GPU ``gpu`` cannot be captured on this node: the node has no such GPU (INVALID_ARGUMENT,
    naming the GPUs it has), or NVML is down so it knows none (FAILED_PRECONDITION). None when the GPU
    exists, when no GPU is named, or before the first sampling tick."""
    if gpu is None or snapshot is None:
        return None
    if not snapshot.nvml_up:
        return ApiError("FAILED_PRECONDITION",
                        f"GPU {gpu}: NVML is not available on {hostname}, so the agent knows no GPU to "
                        "capture; capture a process (pid) or a profiler (target) instead")
    indexes = sorted(g.index for g in snapshot.gpus)
    if gpu in indexes:
        return None
    has = f"its GPUs are {', '.join(map(str, indexes))}" if indexes else "it has no GPUs"
    return ApiError("INVALID_ARGUMENT", f"GPU {gpu} does not exist on {hostname}: {has}")


def agent_methods(config: ControlConfig, *, service: CaptureService | None, store: CaptureStore | None,
                  snapshots: SnapshotSource, alerts: AlertSource | None, hostname: str | None = None,
                  wall_clock: Callable[[], float] = time.time, simulated: str | None = None,
                  processes: ProcessExposure = DEFAULT_PROCESSES,
                  downloads: Callable[[], bool] = lambda: False) -> ControlMethods:
    """The agent's methods, with what GetAgentInfo says of it (``simulated``: the scenario it plays);
    ``processes`` and ``downloads`` as ControlMethods takes them."""
    hostname = hostname or socket.gethostname()
    info = {"node_name": hostname, "pid": os.getpid(), "version": __version__,
            "simulated_scenario": simulated or "", "control_socket": str(config.socket),
            "capture_store": str(store.root) if store is not None else ""}
    return ControlMethods(service=service, store=store, snapshots=snapshots, alerts=alerts, hostname=hostname,
                          wall_clock=wall_clock, info=info, processes=processes, downloads=downloads)

"""The capture service: one worker thread turns triggers into stored captures.

Alert transitions (from the sampler thread), webhook alerts and user requests (from HTTP and control
API threads) are queued; the worker runs them one at a time through policy -> target resolution ->
backends -> store. Nothing on the sampling or scraping path waits for a capture: alert triggers are
fire-and-forget, and only a user who asked for a capture waits for its record.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import cast

from gpuscope.alerts.model import Transition
from gpuscope.capture.alert_context import alert_trigger
from gpuscope.capture.model import (
    BackendResult,
    CaptureBackend,
    CaptureRecord,
    CaptureTarget,
    Outcome,
    TargetOutcome,
    Trigger,
    TriggerKind,
    best_outcome,
    clip_error,
)
from gpuscope.capture.policy import CapturePolicy, Decision
from gpuscope.capture.refusals import RefusalLog, RefusalReason, RefusedTrigger
from gpuscope.capture.store import (
    CaptureQuotaError,
    CaptureStore,
    CaptureStoreError,
    Staging,
    new_capture_id,
)
from gpuscope.capture.targets import TargetResolver
from gpuscope.common.memory import release_free_memory
from gpuscope.health import SourceHealth
from gpuscope.snapshot import GpuReading, SnapshotSource
from gpuscope.threads import OnDemandThread

log = logging.getLogger(__name__)

_QUEUE_LIMIT = 64  # triggers waiting; more than this while a capture runs means a storm: drop
_MAX_PARALLEL_TARGETS = 16  # processes of one capture profiled at the same time
# The policy's refusal codes that are refusals of a capture, kept in the refusal log (not "rule": an
# alert whose rule takes no captures).
_KEPT_POLICY_REFUSALS = frozenset({"disabled", "duration", "busy", "cooldown", "budget"})


@dataclass(frozen=True, slots=True)
class CaptureRequest:
    trigger: Trigger
    gpu: int | None = None
    uuid: str | None = None
    pid: int | None = None
    target: str | None = None  # an explicit "host:port" ProfilerService (user requests)
    duration_s: float | None = None
    start_at: float | None = None  # wall clock: fleet captures start together
    mig_uuid: str | None = None  # an alert on one MIG device of the GPU: the processes on it only
    # An alert on one GPU instance of the GPU (without mig_uuid): the processes on its compute instances.
    gpu_instance: int | None = None

    @property
    def on_mig(self) -> bool:
        """The request is for one MIG device (or GPU instance) of its GPU, not the whole GPU."""
        return self.mig_uuid is not None or self.gpu_instance is not None


class CaptureService:
    """Implements the exporter's CaptureStats too (counts, store size, last capture)."""

    def __init__(self, *, store: CaptureStore, policy: CapturePolicy, resolver: TargetResolver,
                 backends: Mapping[str, CaptureBackend], snapshots: SnapshotSource,
                 hostname: str, deadline_margin_s: float,
                 wall_clock: Callable[[], float] = time.time, health: SourceHealth | None = None,
                 refusals: RefusalLog | None = None) -> None:
        self._store = store
        self._policy = policy
        self._resolver = resolver
        self._backends = dict(backends)
        self._snapshots = snapshots
        self._hostname = hostname
        self._margin = deadline_margin_s
        self._wall_clock = wall_clock
        self._health = health
        self._store_failed = False  # the capture being processed failed on the agent's side (its store)
        self._queue: queue.Queue[tuple[CaptureRequest, Future[CaptureRecord]] | None] = queue.Queue(
            _QUEUE_LIMIT)
        self._lock = threading.Lock()
        self._counts: dict[tuple[TriggerKind, Outcome], int] = {}
        self._worker = OnDemandThread("gpuscope-capture", self._run, health=health, source="captures")
        self._stored_listeners: list[Callable[[CaptureRecord], None]] = []
        # The newest refused triggers, for `captures ls --all`, the APIs, the page and the event log.
        self.refusals = refusals if refusals is not None else RefusalLog()

    def add_stored_listener(self, callback: Callable[[CaptureRecord], None]) -> None:
        """Called in the capture thread with the record of each capture stored with a trace."""
        self._stored_listeners.append(callback)

    # ------------------------------------------------------------ triggers

    def on_transition(self, transition: Transition) -> None:
        """Alert listener (sampler thread): a rule that starts firing asks for a capture of its GPU."""
        if transition.state != "firing":
            return
        self.submit(CaptureRequest(alert_trigger(transition), gpu=transition.gpu,
                                   uuid=transition.uuid, mig_uuid=transition.labels.get("mig_uuid")))

    def submit(self, request: CaptureRequest) -> Future[CaptureRecord]:
        """Queue a capture; the future resolves to its record (refused ones included). Never blocks."""
        future: Future[CaptureRecord] = Future()
        try:
            self._queue.put_nowait((request, future))
        except queue.Full:
            record = self._refused(request, "too many captures queued; this trigger was dropped",
                                   reason="queue_full")
            future.set_result(record)
            return future
        self._worker.wake()
        return future

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """From now on captures are taken; the worker thread starts with the first one (a node that
        never takes a capture has no thread waiting for one)."""
        if self._health is not None:
            self._health.record("captures", success=True, duration_seconds=None)
        self._worker.allow(pending=not self._queue.empty())

    def stop(self, timeout: float = 1.0) -> None:
        """Stop after the capture in progress (if any); queued triggers are dropped."""
        self._worker.forbid()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[1].set_result(self._refused(item[0], "the agent is stopping", reason="stopping"))
        with contextlib.suppress(queue.Full):  # just emptied: only a racing submit could fill it
            self._queue.put_nowait(None)
        self._worker.join(timeout)

    # ------------------------------------------------------------ CaptureStats

    def capture_counts(self) -> dict[tuple[TriggerKind, Outcome], int]:
        with self._lock:
            return dict(self._counts)

    def store_bytes(self) -> int | None:
        return self._store.total_bytes()

    def last_capture_timestamp(self) -> float | None:
        return self._store.last_start()

    def budget_remaining(self) -> int | None:
        return self._policy.budget_left()

    # ------------------------------------------------------------ the worker

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            request, future = item
            started = time.perf_counter()
            self._store_failed = False
            try:
                record = self._capture(request)
                healthy = not self._store_failed
            except Exception as err:  # a bug here must not end the worker
                log.exception("capture failed")
                record = self._record(request, "failed", error=f"internal error: {err}")
                self._count(request.trigger.kind, "failed")
                healthy = False
            if self._health is not None:
                self._health.record("captures", success=healthy,
                                    duration_seconds=time.perf_counter() - started)
            release_free_memory()  # a trace of up to capture.max_trace_bytes was held three times over
            future.set_result(record)

    def _capture(self, request: CaptureRequest) -> CaptureRecord:
        gpu_reading = self._gpu(request)
        gpu = gpu_reading.index if gpu_reading is not None else request.gpu
        decision = self._policy.admit(request.trigger, gpu, duration_s=request.duration_s)
        if not decision.allowed:
            log.info("capture refused (%s, %s): %s", request.trigger.kind, _subject(request, gpu),
                     decision.reason)
            # An alert whose rule takes no captures was never a capture: counted, not kept.
            kept = cast(RefusalReason, decision.code) if decision.code in _KEPT_POLICY_REFUSALS else None
            return self._refused(request, decision.reason, gpu=gpu, reason=kept,
                                 allowed_at=decision.allowed_at, lasting=decision.lasting_reason)
        if request.on_mig and request.pid is None and request.target is None:
            gpu_reading, refusal = _on_requested_device(gpu_reading, request, gpu)
            if gpu_reading is None:  # never the whole GPU in its place: other tenants' jobs
                self._policy.release(decision, refund=True)
                log.info("capture refused (%s, %s): %s", request.trigger.kind, _subject(request, gpu),
                         refusal)
                return self._refused(request, refusal, gpu=gpu, reason="device_gone")
        targets, pids = self._targets(request, gpu_reading)
        if not targets:
            self._policy.release(decision, refund=True)
            if request.pid is not None:
                of = f"process {request.pid}"
            elif request.on_mig:
                of = f"the processes on {_device_text(request)}"
            else:
                of = "this GPU's processes"
            return self._not_taken(request, decision, gpu, pids,
                                   error=f"no profiling endpoint found for {of} "
                                         "(see docs/capture.md: make the job capturable)")
        refund = False  # the agent's own disk failed: the capture is not charged to the budget
        try:
            staging = self._store.begin(gpu=gpu, pid=request.pid)
        except CaptureStoreError as err:
            self._policy.release(decision, refund=True)
            self._store_failed = True
            record = self._record(request, "failed", gpu=gpu, pids=pids, duration_s=decision.duration_s,
                                  error=str(err))
            self._count(request.trigger.kind, record.outcome)
            log.warning("capture not taken (%s): %s", _subject(request, gpu), err)
            return record
        try:
            if request.start_at is not None:  # fleet: start with the other nodes
                time.sleep(max(0.0, min(request.start_at - self._wall_clock(), 60.0)))
            start = self._wall_clock()
            outcomes = self._run_backends(targets, decision, staging)
            record = self._record(request, best_outcome([o.outcome for o in outcomes]), gpu=gpu, pids=pids,
                                  targets=outcomes, start=start, duration_s=decision.duration_s,
                                  capture_id=staging.id,
                                  error="; ".join(o.error for o in outcomes if o.error) or None)
            try:
                if staging.agent_failure is not None:  # a backend's write was stopped or failed
                    raise staging.agent_failure
                record = self._store.commit(staging, record)
            except CaptureQuotaError as err:  # the trace alone exceeds the quota: the operator's limit
                self._store.abort(staging)
                record = self._record(request, "refused", gpu=gpu, pids=pids, targets=outcomes,
                                      start=start, duration_s=decision.duration_s, error=str(err))
                self._keep_refusal(request, "quota", str(err), gpu=gpu)
            except CaptureStoreError as err:  # no space, an I/O error: the agent's side failed
                self._store.abort(staging)
                self._store_failed = refund = True
                record = self._record(request, "failed", gpu=gpu, pids=pids, targets=outcomes,
                                      start=start, duration_s=decision.duration_s,
                                      error=f"the agent could not store it (not counted against the "
                                            f"hourly budget): {err}")
        except BaseException:
            self._store.abort(staging)
            raise
        finally:
            self._policy.release(decision, refund=refund)
        self._count(request.trigger.kind, record.outcome)
        if decision.notice:
            record = replace(record, notice=decision.notice)
        on_gpu = [] if gpu is None else [f"GPU {gpu}"]  # a target's own description names the pid
        log.info("capture %s: %s (%s)", record.id, record.outcome,
                 ", ".join([*on_gpu, *(o.target.describe() for o in record.targets)]))
        if record.outcome == "captured" and record.files:
            for listener in self._stored_listeners:
                try:
                    listener(record)
                except Exception:
                    log.exception("stored-capture listener %r failed", listener)
        return record

    def _run_backends(self, targets: list[CaptureTarget], decision: Decision,
                      staging: Staging) -> tuple[TargetOutcome, ...]:
        """The targets at the same time, so that the traces of a GPU's processes cover the same seconds
        (the analysis compares them to see whether the processes shared the GPU) and several
        processes take one capture's time. A PyTorch (Kineto) trace is streamed from a file: any
        number at once. A trace that arrives over gRPC is held in memory by its profiler client
        process (about 3.6 times capture.max_trace_bytes at worst): those run one after another, in one
        lane beside them."""
        if len(targets) == 1:
            return (self._run_backend(targets[0], decision, staging),)
        lanes: list[list[int]] = [[i] for i, t in enumerate(targets) if t.kind == "kineto"]
        in_memory = [i for i, t in enumerate(targets) if t.kind != "kineto"]
        if in_memory:
            lanes.append(in_memory)
        outcomes: list[TargetOutcome | None] = [None] * len(targets)

        def run_lane(lane: list[int]) -> None:
            for i in lane:
                try:
                    outcomes[i] = self._run_backend(targets[i], decision, staging)
                except Exception as err:  # a backend's bug: that target failed, the others stand
                    log.exception("capture of %s failed", targets[i].describe())
                    outcomes[i] = TargetOutcome(targets[i], "failed",
                                                error=clip_error(f"internal error: {err}"))

        with ThreadPoolExecutor(max_workers=min(len(lanes), _MAX_PARALLEL_TARGETS),
                                thread_name_prefix="gs-capture-target") as pool:
            for future in [pool.submit(run_lane, lane) for lane in lanes]:
                future.result()
        return tuple(o for o in outcomes if o is not None)

    def _run_backend(self, target: CaptureTarget, decision: Decision, staging: Staging) -> TargetOutcome:
        backend = self._backends.get(target.kind)
        if backend is None:
            return TargetOutcome(target, "failed", error=f"no {target.kind} backend in this agent")
        try:
            result: BackendResult = backend.capture(target, decision.duration_s, staging,
                                                    deadline_s=decision.duration_s + self._margin)
        except CaptureStoreError as err:  # the staging area stopped a write (noted on it, too)
            return TargetOutcome(target, "failed", error=str(err))
        return TargetOutcome(target, result.outcome, result.files, result.error)

    def _gpu(self, request: CaptureRequest) -> GpuReading | None:
        snapshot = self._snapshots.latest()
        if snapshot is None:
            return None
        for gpu in snapshot.gpus:
            if request.uuid:
                if gpu.uuid == request.uuid:
                    return gpu
            elif request.gpu is not None:
                if gpu.index == request.gpu:
                    return gpu
            elif request.pid is not None and any(p.pid == request.pid for p in gpu.processes):
                return gpu
        return None

    def _targets(self, request: CaptureRequest,
                 gpu: GpuReading | None) -> tuple[list[CaptureTarget], tuple[int, ...]]:
        if request.target is not None:
            return [CaptureTarget("tsl", request.pid, request.target, source="request")], \
                (() if request.pid is None else (request.pid,))
        if request.pid is not None:
            return self._resolver.resolve_pid(request.pid), (request.pid,)
        if gpu is None:
            return [], ()
        return (self._resolver.resolve(gpu, mig_device=request.on_mig),
                tuple(p.pid for p in gpu.compute_processes))

    # ------------------------------------------------------------ records

    def _not_taken(self, request: CaptureRequest, decision: Decision, gpu: int | None,
                   pids: tuple[int, ...], *, error: str) -> CaptureRecord:
        record = self._record(request, "unreachable", gpu=gpu, pids=pids, duration_s=decision.duration_s,
                              error=error)
        self._count(request.trigger.kind, record.outcome)
        log.info("capture not taken (%s): %s", _subject(request, gpu), error)
        return record

    def _refused(self, request: CaptureRequest, message: str, *, gpu: int | None = None,
                 reason: RefusalReason | None, allowed_at: float | None = None,
                 lasting: str = "") -> CaptureRecord:
        """The record of a refused request, counted and (``reason`` given) kept in the refusal log, in
        the words that stay true when read later (``lasting``) where they differ from the reply's."""
        self._count(request.trigger.kind, "refused")
        gpu = gpu if gpu is not None else request.gpu
        if reason is not None:
            self._keep_refusal(request, reason, lasting or message, gpu=gpu, allowed_at=allowed_at)
        return self._record(request, "refused", gpu=gpu, error=message)

    def _keep_refusal(self, request: CaptureRequest, reason: RefusalReason, message: str, *,
                      gpu: int | None, allowed_at: float | None = None) -> None:
        self.refusals.add(RefusedTrigger(
            at=self._wall_clock(), trigger=request.trigger, gpu=gpu, reason=reason, message=message,
            allowed_at=allowed_at, pid=request.pid, mig_uuid=request.mig_uuid))

    def _record(self, request: CaptureRequest, outcome: Outcome, *, gpu: int | None = None,
                pids: tuple[int, ...] = (), targets: tuple[TargetOutcome, ...] = (),
                start: float | None = None, duration_s: float | None = None, error: str | None = None,
                capture_id: str | None = None) -> CaptureRecord:
        now = self._wall_clock()
        return CaptureRecord(
            # Records that are never stored (refusals) still get a well-formed, unique id.
            id=capture_id or new_capture_id(now, gpu=gpu, pid=request.pid, token=secrets.token_hex(3)),
            trigger=request.trigger, gpu=gpu if gpu is not None else request.gpu,
            pids=pids or ((request.pid,) if request.pid is not None else ()), targets=targets,
            start=start if start is not None else now, duration_s=duration_s or request.duration_s or 0.0,
            bytes=0, outcome=outcome, error=error, hostname=self._hostname,
        )

    def _count(self, trigger: TriggerKind, outcome: Outcome) -> None:
        with self._lock:
            key = (trigger, outcome)
            self._counts[key] = self._counts.get(key, 0) + 1


def on_mig_device(gpu: GpuReading, mig_uuid: str | None,
                  gpu_instance: int | None = None) -> GpuReading | None:
    """The GPU with only the processes on its MIG device ``mig_uuid`` or, without one, on the compute
    instances of its GPU instance ``gpu_instance`` (an alert on that device: the other devices'
    processes are other jobs, often other tenants'), and only those MIG devices. The GPU itself when
    neither is given; None when no such device is listed now (destroyed)."""
    if mig_uuid is None and gpu_instance is None:
        return gpu
    devices = tuple(d for d in gpu.mig_devices
                    if (d.uuid == mig_uuid if mig_uuid is not None else d.gpu_instance == gpu_instance))
    if not devices:
        return None
    return replace(gpu, mig_devices=devices, processes=tuple(
        p for p in gpu.processes if any(d.runs(p) for d in devices)))


def _on_requested_device(gpu: GpuReading | None, request: CaptureRequest,
                         index: int | None) -> tuple[GpuReading | None, str]:
    """(the GPU with only the processes on the MIG device the request names, "") or, where there is
    nothing of that device to capture, (None, why)."""
    where = _device_text(request) + ("" if index is None else f" of GPU {index}")
    if gpu is None:
        return None, f"{where}: the GPU is not in the latest snapshot, nothing to capture"
    if not gpu.up:
        return None, f"{where}: the GPU cannot be read now, so the processes on the device are unknown"
    scoped = on_mig_device(gpu, request.mig_uuid, request.gpu_instance)
    if scoped is None:
        return None, (f"{where} is not on the GPU now (destroyed, or its MIG devices could not be "
                      "listed): nothing to capture")
    if not scoped.compute_processes:
        return None, f"{where} runs no compute process now: nothing to capture"
    return scoped, ""


def _device_text(request: CaptureRequest) -> str:
    """The MIG device a request names: "MIG device MIG-…" or "GPU instance 3"."""
    if request.mig_uuid is not None:
        return f"MIG device {request.mig_uuid}"
    return f"GPU instance {request.gpu_instance}"


def _subject(request: CaptureRequest, gpu: int | None) -> str:
    """What a capture is of, for log lines: "GPU 0", "GPU 0, pid 1234", "pid 1234" or "target host:port".
    A request by pid or target has no GPU when its process is on none the agent knows: nothing is said of
    a GPU then (not "GPU None")."""
    parts = [] if gpu is None else [f"GPU {gpu}"]
    if request.pid is not None:
        parts.append(f"pid {request.pid}")
    if request.target is not None and request.pid is None:
        parts.append(f"target {request.target}")
    return ", ".join(parts) or "no GPU"

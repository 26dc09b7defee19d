"""The Snapshot: one immutable picture of the node per sampler tick.

Everything downstream (exporters, history, alert rules, the control API) reads these objects and
nothing else. Values are in base units (bytes, seconds, joules, watts, celsius, hertz, ratios 0-1).
``None`` means "this GPU does not provide this reading" (not supported, or failed this tick), which
the exporters turn into an absent series, never a 0.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from typing import Any, Literal, Protocol, TypeVar

ProcessKind = Literal["compute", "graphics"]
STALE_AFTER_INTERVALS = 3  # a snapshot older than this many sampling intervals is stale


@dataclass(frozen=True, slots=True)
class UtilizationSample:
    """One of the driver's buffered utilization samples (NVML keeps about six per second)."""

    timestamp_us: int  # the driver's own timestamp, microseconds; an opaque cursor, not wall time
    value: float  # ratio 0-1 of the sample period during which a kernel was running


@dataclass(frozen=True, slots=True)
class SlurmJob:
    """The Slurm job step a process runs in, as its cgroup path names it (host/slurm.py)."""

    job_id: str  # the numeric job id (an array task or a heterogeneous component has its own)
    step: str  # a step number, or "batch", "extern" or "interactive"; "" when the path names none
    uid: int | None = None  # the job's user id, where the path names it (Slurm's cgroup v1 layout)

    @property
    def notation(self) -> str:
        """Slurm's own name for the step: ``4242.0``, ``4242.batch``; the job id alone without a step."""
        return f"{self.job_id}.{self.step}" if self.step else self.job_id


@dataclass(frozen=True, slots=True)
class ProcessReading:
    """A process holding a context on one GPU, with what the host knows of it.

    ``host_visible`` is False when the pid could not be mapped to a host process (it exited, or the
    agent runs in another PID namespace); the host details are then None, but the process is still
    reported with what NVML knows.
    """

    pid: int
    kind: ProcessKind
    memory_used_bytes: int | None
    sm_utilization_ratio: float | None
    host_visible: bool
    name: str | None = None
    user: str | None = None
    container_id: str | None = None
    cmdline: tuple[str, ...] | None = None  # only filled when processes.cmdline is opted in
    slurm_job: SlurmJob | None = None  # None outside a Slurm job
    # Seconds during which a kernel of the process ran on this GPU since it was first seen (busy_time.py);
    # None where the GPU reports no per-process samples.
    busy_seconds_total: float | None = None
    # The part of the GPU's energy attributed to the process since it was first seen, joules
    # (energy_split.py: an estimate); None without per-process samples or an energy counter.
    energy_joules_total: float | None = None
    # The MIG instance the process runs in (GPU and compute instance ids); None off MIG.
    gpu_instance: int | None = None
    compute_instance: int | None = None


@dataclass(frozen=True, slots=True, order=True)
class PodContainer:
    """A pod's container that the kubelet allocated a GPU to (kubelet pod-resources API)."""

    namespace: str
    pod: str
    container: str


@dataclass(frozen=True, slots=True)
class MigReading:
    """One MIG device (a compute instance of a GPU instance) of a GPU in MIG mode, in one tick."""

    index: int  # NVML's MIG device index on the parent
    gpu_instance: int
    compute_instance: int
    uuid: str  # "MIG-…"
    profile: str  # "1g.10gb"
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    # GPM per GPU instance (Hopper and newer), ratios 0-1; the compute instances of one GPU instance
    # share them. None elsewhere and on the first tick.
    sm_active_ratio: float | None = None
    tensor_active_ratio: float | None = None
    dram_active_ratio: float | None = None
    # Seconds the GPU instance had a context active since the agent started: GPM's graphics activity
    # times the interval it covers, in place of the utilization samples NVML does not keep per instance.
    busy_seconds_total: float | None = None

    # The pod containers the kubelet allocated this MIG device to (by its MIG UUID).
    pods: tuple[PodContainer, ...] = ()

    def runs(self, process: ProcessReading) -> bool:
        """The process runs on this MIG device: in its GPU instance and its compute instance. The one
        test of it: the alert history, the status page, the command line and capture targets ask it."""
        return process.gpu_instance == self.gpu_instance and process.compute_instance == self.compute_instance


HEALTH_STATES = ("ok", "reset_required", "replace", "lost")


@dataclass(frozen=True, slots=True)
class GpuReading:
    """Everything read from one GPU in one tick. ``up`` is False when the GPU could not be read."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    up: bool
    mig_enabled: bool = False
    utilization_ratio: float | None = None  # mean of the driver samples since the last tick
    utilization_samples: tuple[UtilizationSample, ...] = ()
    busy_seconds_total: float | None = None  # seconds a kernel ran since the agent started (busy_time.py)
    memory_utilization_ratio: float | None = None
    memory_used_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    memory_total_bytes: int | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    energy_joules_total: float | None = None  # monotonic across driver counter resets
    # Energy since the agent started that is attributed to no process, joules (energy_split.py)
    idle_energy_joules_total: float | None = None
    temperature_celsius: float | None = None
    sm_clock_hertz: float | None = None
    memory_clock_hertz: float | None = None
    clock_event_reasons: frozenset[str] | None = None  # active reason names (clock_events.py)
    pcie_tx_bytes_total: float | None = None
    pcie_rx_bytes_total: float | None = None
    xid_errors: Mapping[int, int] = field(default_factory=dict)  # Xid code -> events since start
    ecc_uncorrected_errors_total: int | None = None
    sm_active_ratio: float | None = None
    sm_occupancy_ratio: float | None = None
    tensor_active_ratio: float | None = None
    dram_active_ratio: float | None = None
    # The GPM ratios integrated over the intervals they cover, since the agent started: SM-seconds
    # (one second of every SM active counts one) and tensor-seconds.
    sm_active_seconds_total: float | None = None
    tensor_active_seconds_total: float | None = None
    idle_dips_total: int | None = None
    fp16_active_ratio: float | None = None
    fp32_active_ratio: float | None = None
    fp64_active_ratio: float | None = None
    encoder_utilization_ratio: float | None = None
    decoder_utilization_ratio: float | None = None
    # Hardware health (read every nvml.health_interval; throttle time every nvml.throttle_interval).
    clock_throttle_seconds_total: Mapping[str, float] | None = None  # reason -> seconds since driver load
    remapped_rows_correctable_total: int | None = None
    remapped_rows_uncorrectable_total: int | None = None
    row_remap_pending: bool | None = None  # a remapped row takes effect at the next GPU reset
    row_remap_failed: bool | None = None  # a row could not be remapped: the GPU needs replacing
    ecc_corrected_errors_total: int | None = None
    pcie_replays_total: int | None = None
    pcie_errors_total: Mapping[str, int] | None = None  # error type -> count
    memory_temperature_celsius: float | None = None
    # NVLink (None on a GPU without it): sums over the links, and per link with nvml.nvlink_per_link.
    nvlink_active_links: int | None = None
    nvlink_transmit_bytes_total: float | None = None
    nvlink_receive_bytes_total: float | None = None
    nvlink_errors_total: Mapping[str, int] | None = None  # error type -> count
    nvlink_link_bytes: Mapping[int, Mapping[str, float]] | None = None  # link -> transmit/receive_bytes
    nvlink_link_errors_total: Mapping[int, Mapping[str, int]] | None = None  # link -> type -> count
    mig_devices: tuple[MigReading, ...] = ()  # MIG mode only
    processes: tuple[ProcessReading, ...] = ()
    # The pod containers the kubelet allocated this GPU to, sorted: none outside Kubernetes, several
    # where the GPU is time-sliced between pods.
    pods: tuple[PodContainer, ...] = ()

    @property
    def compute_processes(self) -> tuple[ProcessReading, ...]:
        return tuple(p for p in self.processes if p.kind == "compute")

    @property
    def health(self) -> str:
        """One of HEALTH_STATES: what an operator does with the GPU. ``replace``: a row remap failed;
        ``reset_required``: a remap waits for the GPU's reset; ``lost``: the GPU cannot be read."""
        if not self.up:
            return "lost"
        if self.row_remap_failed:
            return "replace"
        if self.row_remap_pending:
            return "reset_required"
        return "ok"

    @property
    def health_reasons(self) -> tuple[str, ...]:
        """Why ``health`` is not "ok", worst first; none when it is. A GPU in MIG mode has one health
        for all its MIG devices: NVML reads it per physical GPU."""
        if not self.up:
            return ("the GPU cannot be read",)
        reasons = []
        if self.row_remap_failed:
            reasons.append("a memory row could not be remapped")
        if self.row_remap_pending:
            reasons.append("a remapped memory row waits for a GPU reset")
        return tuple(reasons)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The node at one tick."""

    timestamp: float  # wall clock (Unix seconds) when the tick finished
    hostname: str
    nvml_up: bool
    driver_version: str | None
    gpus: tuple[GpuReading, ...]
    sample_duration_seconds: float
    sample_errors: Mapping[str, int] = field(default_factory=dict)  # reading -> failures since start
    interval_seconds: float = 1.0
    monotonic: float = 0.0  # time.monotonic() at the tick, for staleness checks
    nvml_stuck_calls_total: int = 0  # NVML calls given up on since start (GPU reads, Xid checks)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (frozensets become sorted lists, Xid keys become strings), with each GPU's
        and MIG device's health (``health``, ``health_reasons``)."""
        data = asdict(self)
        for gpu, reading in zip(data["gpus"], self.gpus, strict=True):
            # Small on purpose: the state and why; each MIG device has its GPU's (NVML reads it per GPU).
            health = {"health": reading.health, "health_reasons": list(reading.health_reasons)}
            gpu.update(health)
            for device in gpu["mig_devices"]:
                device.update(health)
            for name in ("nvlink_link_bytes", "nvlink_link_errors_total"):
                if gpu[name] is not None:
                    gpu[name] = {str(link): dict(v) for link, v in gpu[name].items()}
            reasons = gpu["clock_event_reasons"]
            gpu["clock_event_reasons"] = None if reasons is None else sorted(reasons)
            gpu["xid_errors"] = {str(k): v for k, v in gpu["xid_errors"].items()}
        return data

    @classmethod
    def from_json(cls, data: object) -> Snapshot:
        """The Snapshot that ``to_json`` gave ``data`` (parsed JSON, e.g. an agent's /api/v1/snapshot):
        the dataclasses rebuilt, lists back to tuples and frozensets, string keys of Xid codes and NVLink
        links back to ints; the derived ``health`` and ``health_reasons`` are dropped, as are keys this
        version does not know (a newer agent's). SnapshotJsonError names the first field that does not
        fit."""
        return _from_json(cls, data, "snapshot")


class SnapshotJsonError(ValueError):
    """A snapshot's JSON does not fit the Snapshot: the message names the field (``gpus[0].index``)."""


_T = TypeVar("_T")


def _from_json(cls: type[_T], data: object, where: str) -> _T:
    if not isinstance(data, dict):
        raise SnapshotJsonError(f"{where}: expected a JSON object, got {_kind(data)}")
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]  # every caller passes a dataclass
        if f.name in data:
            values[f.name] = _value(hints[f.name], data[f.name], f"{where}.{f.name}")
        elif f.default is MISSING and f.default_factory is MISSING:
            raise SnapshotJsonError(f"{where}.{f.name}: missing")
    return cls(**values)


def _value(hint: Any, value: object, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]  # the snapshot's unions are all "X | None"
        return _value(hint, value, where)
    if is_dataclass(hint) and isinstance(hint, type):
        return _from_json(hint, value, where)
    if origin is Literal:
        if value not in args:
            raise SnapshotJsonError(f"{where}: expected one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise SnapshotJsonError(f"{where}: expected true or false, got {_kind(value)}")
        return value
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise SnapshotJsonError(f"{where}: expected an integer, got {_kind(value)}")
        return value
    if hint is float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise SnapshotJsonError(f"{where}: expected a number, got {_kind(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise SnapshotJsonError(f"{where}: expected a string, got {_kind(value)}")
        return value
    if origin in (tuple, frozenset):
        if not isinstance(value, list):
            raise SnapshotJsonError(f"{where}: expected a list, got {_kind(value)}")
        items = (_value(args[0], item, f"{where}[{i}]") for i, item in enumerate(value))
        return tuple(items) if origin is tuple else frozenset(items)
    if origin is Mapping:
        if not isinstance(value, dict):
            raise SnapshotJsonError(f"{where}: expected a JSON object, got {_kind(value)}")
        key_hint, item_hint = args
        return {_key(key_hint, key, where): _value(item_hint, item, f"{where}[{key!r}]")
                for key, item in value.items()}
    raise TypeError(f"{where}: no JSON conversion for {hint!r}")  # a new field's type: teach _value


def _key(hint: Any, key: str, where: str) -> Any:
    if hint is int:  # Xid codes and NVLink link numbers: strings in JSON
        try:
            return int(key)
        except ValueError:
            raise SnapshotJsonError(f"{where}: expected integer keys, got {key!r}") from None
    return key


def _kind(value: object) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


class SnapshotSource(Protocol):
    """The sampler as every reader sees it: the latest snapshot and whether it is still ticking."""

    @property
    def interval_seconds(self) -> float: ...

    def latest(self) -> Snapshot | None:
        """The newest snapshot, or None before the first tick finished."""
        ...

    def is_alive(self) -> bool:
        """True while sampling makes progress (a tick completed lately)."""
        ...

    def snapshot_is_stale(self) -> bool:
        """The latest snapshot is older than STALE_AFTER_INTERVALS sampling intervals: its GPU
        readings are not fit to export any more."""
        ...

"""The `capture:` section of the configuration: when captures are taken, where they go, how they are found.

```yaml
capture:
  enabled: true
  store: {root: /var/lib/gpuscope/captures, quota_bytes: 2GiB, min_free_bytes: 256MiB}
  duration: 2s          # an alert-triggered capture; a user may ask for up to max_duration
  max_trace_bytes: 64MiB    # per gRPC target; its client process holds about 3.6x this while it arrives
  max_duration: 30s
  cooldown: 15m         # per GPU, for alert and webhook triggers
  hourly_budget: 6      # alert and webhook captures in a rolling hour, for the node
  user_hourly_budget: 12  # on-demand captures (user, fleet) in a rolling hour, per person
  rules: {GpuThrottled: true, GpuLowUtilization: false}
  profiler_ports: [6009]
  targets:
    - {address: "10.0.0.7:6009", gpu: 0}
    - {address: "trainer:9012", all: true}
  webhook:                                  # POST /api/v1/alertmanager: off unless enabled
    enabled: true
    token_file: /etc/gpuscope/webhook-token # Authorization: Bearer <token> (Alertmanager's
                                            # http_config.authorization.credentials_file)
    users: [alertmanager]                   # and/or basic auth: users of web.config_file
  kineto:                                   # PyTorch jobs started with KINETO_USE_DAEMON=1
    trace_dir: /run/gpuscope/kineto/traces  # they write their traces here: visible to them at this path
    socket_dir: /run/gpuscope/kineto/ipc    # null: the abstract socket @dynolog (host network only)
    max_trace_bytes: 1GiB                   # a trace file, on disk: streamed into the store
    write_timeout: 5m                       # for a job to write its trace, after the recording
```

The defaults depend on who runs the agent (``common/user_paths``): root keeps the store in
/var/lib/gpuscope; a user's own agent keeps it in $XDG_STATE_HOME/gpuscope and its Kineto directories
in its runtime directory, listening on a socket file there rather than on the node-wide @dynolog.

Which alerts capture by default each rule says (``captures_by_default``: the rules whose cause a profiler
trace can show); ``rules`` overrides it per rule and refuses names that are not alert rules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field, model_validator

from gpuscope.alerts.rules import CAPTURES_BY_DEFAULT, RULE_TYPES
from gpuscope.common.config_types import ByteSize, Duration, FilePath, PeerAddress, Section
from gpuscope.common.durations import format_duration
from gpuscope.common.sizes import format_size
from gpuscope.common.unixfs import MAX_UNIX_SOCKET_PATH_BYTES
from gpuscope.common.user_paths import default_dirs

MAX_DURATION_SECONDS = 30.0  # the longest capture anyone may ask for (a trace of 30 s is already large)
# A trace received over gRPC is held about 3.6 times over while it arrives (gRPC's buffers, the
# message, the allocator's slack), in the profiler client process the agent starts for the capture:
# 64 MiB keeps its peak near 300 MiB, within the shipped 512 MiB memory limits of the agent's cgroup
# (bench/capture_memory.py measures it).
DEFAULT_MAX_TRACE_BYTES = 64 * 2**20
MAX_TRACE_BYTES_CEILING = 2**31 - 2**21  # a gRPC message is at most 2 GiB
# A Kineto trace is a file the job writes and the agent streams into the store, compressed as it is
# copied: its cap is a size on disk, not a memory cap (the agent holds one chunk of it at a time). A
# 2 s capture writes about 136 MiB of JSON for a launch-heavy GPU job, 200-450 MiB for a busy loop of
# small CPU ops. The ceiling keeps a capture's copy near a minute (gzip level 3: about 250 MB/s).
DEFAULT_KINETO_MAX_TRACE_BYTES = 2**30
KINETO_MAX_TRACE_BYTES_CEILING = 16 * 2**30
# A job converts what it recorded before it writes (the longest step: 6-20 s for 1.4 million events
# on a 2-core VM), then writes; the agent waits while it does, up to this long after the recording.
DEFAULT_KINETO_WRITE_TIMEOUT_S = 300.0
MAX_KINETO_WRITE_TIMEOUT_S = 3600.0
# A trace file that holds data but has not grown for this long: the job stopped writing it. (Not a
# setting: a job writes its JSON in one go, far faster than this.)
KINETO_STALL_TIMEOUT_S = 60.0
MIN_QUOTA_BYTES = 2**20
# PyTorch binds its client socket at <socket_dir>/dynoconfigclient<36-character uuid>: 53 bytes after
# the directory, in a Unix socket address of at most 107 (measured with PyTorch 2.13: 54 works, 55 fails).
MAX_KINETO_SOCKET_DIR_BYTES = MAX_UNIX_SOCKET_PATH_BYTES - len("/dynoconfigclient") - 36



def default_store_root() -> Path:
    """``/var/lib/gpuscope/captures`` for root, the state directory's ``captures`` for anyone else."""
    return default_dirs().state / "captures"


def default_kineto_trace_dir() -> Path | None:
    """Root: None (the daemon's own default, under the temporary directory); anyone else: the
    runtime directory's ``kineto/traces``."""
    dirs = default_dirs()
    return None if dirs.owner == "root" else dirs.runtime / "kineto" / "traces"


def default_kineto_socket_dir() -> Path | None:
    """None (the abstract @dynolog) for root and services; a user's own agent listens in its runtime
    directory instead: @dynolog is one name for the whole node, which an agent started by hand
    should not take from the node's own agent (or take the other users' PyTorch jobs with it)."""
    dirs = default_dirs()
    return dirs.runtime / "kineto" / "ipc" if dirs.owner == "user" else None


def _port(value: int) -> int:
    if not 1 <= value <= 65535:
        raise ValueError(f"a port must be from 1 to 65535, got {value}")
    return value


def _unique_ports(ports: list[int]) -> list[int]:
    if len(set(ports)) != len(ports):
        raise ValueError("a port is listed twice")
    return ports


def _plain_absolute(value: Path) -> Path:
    """An absolute path, written plainly (no ``..``): the agent and the jobs use this very path.
    (The messages leave out the value: the error report adds it.)"""
    if "\x00" in str(value):
        raise ValueError("a path must not contain a NUL character")
    if not value.is_absolute():
        raise ValueError("must be an absolute path: the agent and the jobs must name the same directory")
    if ".." in value.parts:
        raise ValueError("must not contain '..': write the directory's plain path")
    if str(value).strip("/") == "":  # "/", and "//" (which pathlib keeps as a root of its own)
        raise ValueError("must be a directory of its own, not /")
    return value


def _socket_dir(value: Path) -> Path:
    value = _plain_absolute(value)
    if len(str(value).encode()) > MAX_KINETO_SOCKET_DIR_BYTES:
        raise ValueError(f"must be at most {MAX_KINETO_SOCKET_DIR_BYTES} bytes long: PyTorch binds its "
                         "socket at <socket_dir>/dynoconfigclient<36-character uuid>, and a Unix socket "
                         f"address holds {MAX_UNIX_SOCKET_PATH_BYTES} bytes")
    return value


def _kineto_trace_cap(value: int) -> int:
    if not MIN_QUOTA_BYTES <= value <= KINETO_MAX_TRACE_BYTES_CEILING:
        raise ValueError(f"must be from {format_size(MIN_QUOTA_BYTES)} to "
                         f"{format_size(KINETO_MAX_TRACE_BYTES_CEILING)} (the size of a trace file on disk)")
    return value


def _kineto_write_timeout(value: float) -> float:
    if not 1.0 <= value <= MAX_KINETO_WRITE_TIMEOUT_S:
        raise ValueError(f"must be from 1s to {format_duration(MAX_KINETO_WRITE_TIMEOUT_S)}")
    return value


def _known_rules(rules: dict[str, bool]) -> dict[str, bool]:
    unknown = sorted(set(rules) - set(RULE_TYPES))
    if unknown:
        raise ValueError(f"unknown alert rule {', '.join(map(repr, unknown))}; the rules are "
                         f"{', '.join(RULE_TYPES)}")
    return rules


class StoreConfig(Section):
    root: FilePath = Field(default_factory=default_store_root,
                       description="Directory of the capture store (one sub-directory per capture). "
                                   "Default: /var/lib/gpuscope/captures for root, else "
                                   "$XDG_STATE_HOME/gpuscope/captures (~/.local/state/gpuscope/captures).")
    quota_bytes: ByteSize = Field(2 * 2**30, ge=MIN_QUOTA_BYTES,
                              description="Disk space the captures may use; the oldest are evicted first. "
                                          "Sizes such as 2GiB or 500MB are accepted.")
    min_free_bytes: ByteSize = Field(256 * 2**20, description=(
        "Free space the store's file system keeps: a capture that would leave less evicts the oldest "
        "captures first, and stops (failed on the agent's side) when none is left."))


class StaticTarget(Section):
    """A ProfilerService (TensorFlow/JAX) the agent cannot discover, named with what it profiles."""

    address: PeerAddress = Field(
        description="host:port of the ProfilerService (gRPC), e.g. 10.0.0.7:6009 or [fd00::7]:6009.")
    gpu: int | None = Field(None, ge=0, description="Profile this target for alerts on this GPU index.")
    uuid: str | None = Field(None, min_length=1, description="... or on the GPU with this UUID.")
    pid: int | None = Field(None, ge=1, description="... or when this pid is on the alerting GPU.")
    all: bool = Field(False, description="... or for every GPU of the node.")

    @model_validator(mode="after")
    def _one_selector(self) -> StaticTarget:
        chosen = [name for name in ("gpu", "uuid", "pid") if getattr(self, name) is not None]
        if self.all:
            chosen.append("all")
        if len(chosen) != 1:
            raise ValueError("name exactly one of gpu, uuid, pid or all: true"
                             + (f" (got {', '.join(chosen)})" if chosen else ""))
        return self


class KinetoConfig(Section):
    """The agent's Kineto on-demand daemon (PyTorch jobs started with KINETO_USE_DAEMON=1)."""

    trace_dir: Annotated[Path, AfterValidator(_plain_absolute)] | None = Field(
        default_factory=default_kineto_trace_dir,
        description="Directory in which the jobs write their traces (one random sub-directory per "
                    "capture). The jobs must see it at the same path: not a private /tmp. "
                    "Default: gpuscope-kineto-<uid> in the agent's temporary directory for root, else "
                    "kineto/traces in the agent's runtime directory.")
    socket_dir: Annotated[Path, AfterValidator(_socket_dir)] | None = Field(
        default_factory=default_kineto_socket_dir,
        description="Listen on the socket file <socket_dir>/dynolog, for jobs started with "
                    "KINETO_IPC_SOCKET_DIR=<socket_dir> (containers without host networking). "
                    "null: the abstract socket @dynolog, which only the host's network namespace "
                    "reaches; the default for root and services. A user's own agent listens in "
                    "kineto/ipc of its runtime directory by default.")
    max_trace_bytes: Annotated[ByteSize, AfterValidator(_kineto_trace_cap)] = Field(
        DEFAULT_KINETO_MAX_TRACE_BYTES, description=(
            "Largest trace file taken from one PyTorch job, as it lies on disk (1 MiB to 16 GiB). A larger "
            "one is refused before it is read. The file is streamed into the store, compressed as it is "
            "copied, never held in memory: this bounds disk and CPU time, not the agent's memory."))
    write_timeout: Annotated[Duration, AfterValidator(_kineto_write_timeout)] = Field(
        DEFAULT_KINETO_WRITE_TIMEOUT_S, description=(
            "How long after its recording a job may take to complete its trace (1s to 1h). The job "
            "converts what it recorded, then writes the JSON; a busy job takes tens of seconds. The agent "
            "waits while the job runs and its trace file keeps growing, up to this long; copying the file "
            "into the store may take as long again."))

    @model_validator(mode="after")
    def _separate_directories(self) -> KinetoConfig:
        # The socket directory is writable by every user (sticky); the trace directory is the agent's
        # alone. Nested, one would inherit the other's exposure (or a cleanup of the other's entries).
        trace, sock = self.trace_dir, self.socket_dir
        if trace is not None and sock is not None and (
                trace == sock or trace.is_relative_to(sock) or sock.is_relative_to(trace)):
            raise ValueError(f"trace_dir ({trace}) and socket_dir ({sock}) must be separate directories, "
                             "neither inside the other")
        return self


class WebhookConfig(Section):
    """Alertmanager's webhook (POST /api/v1/alertmanager): it starts captures, so it is off unless
    enabled, and then answers only requests with its credentials."""

    enabled: bool = Field(False, description="Accept capture triggers from Alertmanager's webhook.")
    token_file: FilePath | None = Field(None, description="File holding the bearer token Alertmanager sends "
                                                      "(Authorization: Bearer <token>, 16+ characters).")
    users: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list, max_length=64,
        description="Basic-auth users (of web.config_file's basic_auth_users) allowed to trigger captures.")

    @model_validator(mode="after")
    def _credentials(self) -> WebhookConfig:
        if self.enabled and self.token_file is None and not self.users:
            raise ValueError("the webhook needs credentials: set token_file (a bearer token) or users "
                             "(basic-auth users of web.config_file), as Alertmanager's http_config "
                             "sends them")
        return self


class AnalysisConfig(Section):
    enabled: bool = Field(True, description=(
        "Diagnose each stored capture right after it is taken (why the device idles: input_bound, "
        "host_sync, launch_bound ...; what it is busy with: tensor_cores_idle, costly_op ...), in a "
        "child process; the verdict goes into its record."))
    max_trace_bytes: ByteSize = Field(512 * 2**20, ge=MIN_QUOTA_BYTES, description=(
        "A capture whose traces are larger in all is not analysed (its record says so)."))
    cpu_seconds: int = Field(120, ge=1, le=3600, description="CPU time one analysis may use.")
    memory_bytes: ByteSize = Field(2 * 2**30, ge=256 * 2**20, description=(
        "Address space of the analysis process (its RLIMIT_AS)."))


class CaptureConfig(Section):
    enabled: bool = Field(True, description="Take captures at all (alert, webhook and user triggers).")
    store: StoreConfig = Field(default_factory=StoreConfig)
    duration: Duration = Field(2.0, gt=0.0, description="Length of an alert-triggered capture; also the "
                                                        "default of a user request that names none.")
    max_duration: Duration = Field(MAX_DURATION_SECONDS, gt=0.0, le=MAX_DURATION_SECONDS,
                                   description="Longest capture a user may request (at most 30s).")
    cooldown: Duration = Field(900.0, le=7 * 86400.0,
                               description="After a capture on a GPU, alert and webhook triggers on that "
                                           "GPU are refused for this long.")
    hourly_budget: int = Field(6, ge=1, le=3600,
                               description="Alert and webhook captures allowed in a rolling hour on the "
                                           "node; written down in the store, so a restart keeps it.")
    user_hourly_budget: int = Field(12, ge=1, le=3600,
                                    description="On-demand captures (user and fleet requests) each person "
                                                "may start in a rolling hour; apart from hourly_budget.")
    max_trace_bytes: ByteSize = Field(
        DEFAULT_MAX_TRACE_BYTES, ge=MIN_QUOTA_BYTES, le=MAX_TRACE_BYTES_CEILING, description=(
            "Largest trace received over gRPC from one TensorFlow/JAX profiler server (a response is "
            "refused as it starts to arrive): a memory cap, as the profiler client process the agent "
            "starts for the capture holds about 3.6x this while receiving. PyTorch's trace files have "
            "their own cap, kineto.max_trace_bytes."))
    deadline_margin: Duration = Field(10.0, gt=0.0, le=120.0,
                                      description="Time a backend may take beyond the capture duration "
                                                  "(connection, trace transfer) before it is abandoned; "
                                                  "for a PyTorch job, the time it may take to poll for "
                                                  "its config, and to start its trace file once it "
                                                  "has recorded (kineto.write_timeout bounds the rest).")
    rules: Annotated[dict[str, bool], AfterValidator(_known_rules)] = Field(
        default_factory=dict,
        description="Per alert rule, whether its firing triggers a capture (overrides the defaults).")
    profiler_ports: Annotated[list[Annotated[int, AfterValidator(_port)]], AfterValidator(_unique_ports)] = (
        Field([6009], max_length=32,
              description="TCP ports on which a GPU process (or its parent) may serve a profiler; "
                          "no other port is looked at."))
    targets: list[StaticTarget] = Field(default_factory=list,
                                        description="Profiler services named by hand.")
    kineto: KinetoConfig = Field(default_factory=KinetoConfig)
    webhook: WebhookConfig = Field(default_factory=WebhookConfig)
    analysis: AnalysisConfig = Field(default_factory=AnalysisConfig)

    @model_validator(mode="after")
    def _duration_within_max(self) -> CaptureConfig:
        if self.duration > self.max_duration:
            raise ValueError(f"duration ({format_duration(self.duration)}) must not be longer than "
                             f"max_duration ({format_duration(self.max_duration)})")
        return self

    def rule_captures(self, alertname: str) -> bool:
        """Whether a firing ``alertname`` triggers a capture (False for names that are not rules)."""
        return self.rules.get(alertname, CAPTURES_BY_DEFAULT.get(alertname, False))

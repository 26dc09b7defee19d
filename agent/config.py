"""The agent's configuration: one model, fed by a YAML file, GPUSCOPE_* variables and CLI flags.

Precedence, highest first: command-line flags, environment variables, the YAML file, defaults.
Unknown keys are refused with their path, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator

from gpuscope.alerts.alertmanager import alertmanager_endpoint
from gpuscope.alerts.config import AlertingConfig
from gpuscope.alerts.rules import validate_against_interval
from gpuscope.capture.config import CaptureConfig
from gpuscope.common.config_types import (
    ConfigError,
    Duration,
    FilePath,
    ListenAddress,
    Section,
    UnixSocketPath,
    format_errors,
)
from gpuscope.common.durations import format_duration
from gpuscope.common.process_labels import DEFAULT_MAX_PER_GPU, PROCESS_LABEL_CHOICES, ProcessLabel
from gpuscope.common.sizes import format_size
from gpuscope.common.suggestions import did_you_mean
from gpuscope.common.unixfs import FileTooLargeError, read_bounded
from gpuscope.config_environment import deep_merge, environment_problems, environment_values
from gpuscope.control.config import ControlConfig
from gpuscope.otlp.config import OtlpConfig
from gpuscope.otlp.target import endpoint_url

ENVIRONMENT = "GPUSCOPE_* environment variables"
MAX_CONFIG_BYTES = 1 << 20
# Where the kubelet serves its pod-resources API (a Unix socket it re-creates when it restarts).
KUBELET_POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")


class WebConfig(Section):
    listen_address: ListenAddress = Field(":9847", description="HTTP address: host:port, :port or [v6]:port.")
    max_requests: int = Field(64, ge=1, le=10_000, description=(
        "HTTP requests handled at once; one more is answered 503 at once (bounds the agent's threads)."))
    config_file: FilePath | None = Field(None, description=(
        "Web configuration file (exporter-toolkit's format): TLS, basic auth, headers, rate limit."))


class ProcessesConfig(Section):
    cmdline: bool = Field(False, description="Export full command lines (may contain secrets).")
    user: bool = Field(True, description="Look up each GPU process's user name (the `user` label); false "
                                         "leaves it empty and never reads it.")
    export: bool = Field(True, description=(
        "Export one series per GPU process (gpu_process_*: pid, name, user, container) and list the "
        "processes in /api/v1/snapshot; false keeps the per-GPU series only. Alerts and captures still "
        "see the processes."))
    labels: list[ProcessLabel] = Field(default_factory=lambda: list(PROCESS_LABEL_CHOICES), description=(
        "The labels of the per-process series besides gpu and uuid (an allow-list). Without pid, the "
        "processes of a GPU that share the other labels make one series, their values summed."))
    max_per_gpu: int = Field(DEFAULT_MAX_PER_GPU, ge=1, le=4096, description=(
        "Processes exported per GPU; those using the most device memory are kept and the others counted "
        "in gpuscope_processes_dropped_total. Alerts and captures still see every process."))

    @field_validator("labels")
    @classmethod
    def _labels_once(cls, labels: list[str]) -> list[str]:
        repeated = sorted({name for name in labels if labels.count(name) > 1})
        if repeated:
            raise ValueError(f"label(s) listed more than once: {', '.join(repeated)}")
        return labels


class IdleDipsConfig(Section):
    threshold: float = Field(0.25, gt=0.0, lt=1.0, description="A driver sample below this is idle.")
    max_duration: Duration = Field(5.0, gt=0.0, le=3600.0,
                                   description="Longer idle runs are idle periods, not dips.")


class NvmlConfig(Section):
    retry_initial: Duration = Field(1.0, gt=0.0, le=3600.0,
                                    description="First retry delay when NVML is unavailable.")
    retry_max: Duration = Field(60.0, gt=0.0, le=3600.0, description="Retry back-off ceiling.")
    expected_gpus: int | None = Field(None, ge=1, le=1024, description=(
        "GPUs this node has: /-/ready fails while fewer are readable. Unset: whatever NVML lists."))
    energy_interval: Duration = Field(10.0, ge=0.0, le=300.0, description=(
        "Time between reads of each GPU's energy counter (0: every sample). The counter is exact however "
        "seldom it is read, so reading it less often only makes its steps coarser, and a driver can spend "
        "milliseconds of CPU on each read (some 5 ms on an H200), more than all other readings together."))
    samples_interval: Duration = Field(5.0, ge=0.0, le=10.0, description=(
        "Time between reads of each GPU's utilization samples (0: every sample). The driver keeps the "
        "samples since the last read (some 14 s of them), so none is lost; between reads the utilization "
        "gauge is the driver's current rate, and busy seconds and idle dips count at the next read. "
        "A read costs some 1.7 ms of CPU on an H200."))
    gpm_interval: Duration = Field(5.0, ge=0.0, le=60.0, description=(
        "Time between GPM samples of each GPU (Hopper and newer; 0: every sample). Each GPM ratio is "
        "the mean over the time since the previous sample, so the SM and tensor active seconds stay "
        "exact however seldom it is sampled; between samples the ratio gauges repeat the last means. "
        "A sample and its metrics cost two calls a GPU, more CPU than any other per-sample reading on "
        "NVIDIA's mock NVML."))
    health_interval: Duration = Field(10.0, ge=0.0, le=300.0, description=(
        "Time between reads of each GPU's slow-changing health readings (0: every sample): row remapping, "
        "ECC errors (corrected and uncorrected), PCIe replays and errors, memory temperature, NVLink link "
        "states and errors, and the list of MIG devices; and of the settings that change as seldom: the "
        "enforced power limit and the memory clock; and of the video encoder's and decoder's utilization "
        "(read every sample while either is in use). Between reads the last values are exported."))
    throttle_interval: Duration = Field(30.0, ge=0.0, le=300.0, description=(
        "Time between reads of each GPU's throttle (violation) counters (0: every sample). They add up the "
        "time each reason held the clocks down, so none is lost between reads; a read costs 0.6-1 ms of "
        "CPU per reason on an H100, six reasons per GPU."))
    nvlink_per_link: bool = Field(False, description=(
        "Also export the NVLink data and error counters of each link (gpu_nvlink_link_*), besides their "
        "sums over the links: 18 links per GPU on an HGX H100, so 18 times the series."))


class WatchdogConfig(Section):
    stuck_after: Duration = Field(3.0, ge=0.5, le=3600.0, description=(
        "An NVML call on a GPU that has not returned after this long is given up on: the GPU is reported "
        "down and skipped until the call returns, while the other GPUs keep reporting (a stuck check for "
        "Xid events: Xid counts stand still)."))
    unhealthy_after: Duration = Field(30.0, ge=5.0, le=3600.0, description=(
        "/-/healthy fails when no sampling tick has completed for this long (Kubernetes' liveness probe "
        "then restarts the agent)."))


class PodsConfig(Section):
    enabled: bool = Field(True, description="Ask the kubelet which pod each GPU is allocated to.")
    socket: UnixSocketPath = Field(KUBELET_POD_RESOURCES_SOCKET,
                                   description="The kubelet's pod-resources socket.")
    refresh_interval: Duration = Field(10.0, ge=1.0, le=3600.0, description="Time between kubelet queries.")
    timeout: Duration = Field(2.0, gt=0.0, le=60.0, description="Deadline of one kubelet query.")
    keep_for: Duration = Field(300.0, ge=0.0, le=86400.0, description=(
        "How long the last answer stays in use while the kubelet cannot be asked (a kubelet restart)."))


class Settings(Section):
    sample_interval: Duration = Field(1.0, ge=0.05, le=3600.0, description="Seconds between NVML samples.")
    node_name: str | None = Field(None, description="Node name in snapshots; default: the hostname (a "
                                                     "simulated node: its scenario's name).")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    simulate: str | None = Field(None, description="Bundled scenario name or scenario file: fake NVML.")
    web: WebConfig = Field(default_factory=WebConfig)
    processes: ProcessesConfig = Field(default_factory=ProcessesConfig)
    idle_dips: IdleDipsConfig = Field(default_factory=IdleDipsConfig)
    nvml: NvmlConfig = Field(default_factory=NvmlConfig)
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    alerting: AlertingConfig = Field(default_factory=AlertingConfig)
    capture: CaptureConfig = Field(default_factory=CaptureConfig)
    control: ControlConfig = Field(default_factory=ControlConfig)
    pods: PodsConfig = Field(default_factory=PodsConfig)
    otlp: OtlpConfig = Field(default_factory=OtlpConfig)


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        # Followed if a symlink: a Kubernetes ConfigMap mounts the file as one.
        text = read_bounded(path, MAX_CONFIG_BYTES, follow_symlinks=True).decode("utf-8")
    except FileTooLargeError:
        raise ConfigError(str(path), [f"the file is larger than {format_size(MAX_CONFIG_BYTES)}; a "
                                      "configuration is a few KiB"]) from None
    except OSError as err:
        raise ConfigError(str(path), [f"cannot read the file: {err.strerror or err}"]) from err
    except UnicodeDecodeError as err:
        raise ConfigError(str(path), [f"not UTF-8 text: byte {err.object[err.start]:#04x} at offset "
                                      f"{err.start} cannot be decoded"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(str(path), [f"{where}not valid YAML: {getattr(err, 'problem', err)}"]) from err
    except RecursionError:  # the parser recurses once per nesting level: "[[[[..." exhausts the stack
        raise ConfigError(str(path), ["not valid YAML: nested too deeply for a configuration"]) from None
    except ValueError as err:  # a constructor's refusal, e.g. an integer of more than 4300 digits
        raise ConfigError(str(path), [f"not valid YAML: a value cannot be read ({err})"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), [f"the top level must be a mapping of keys, not {type(data).__name__}"])
    # The settings take the top-level keys as keyword arguments: one that is not a string ("1: x",
    # "~: x", "2024-01-01: x") would end in a TypeError.
    odd = [key for key in data if not isinstance(key, str)]
    if odd:
        raise ConfigError(str(path), [f"{odd[0]!r}: a key must be a name, not {type(odd[0]).__name__}"])
    return data


def load_settings(path: Path | None = None, overrides: dict[str, Any] | None = None) -> Settings:
    """Build the settings from the file (optional), GPUSCOPE_* variables and flag overrides."""
    file_values = read_yaml(path) if path is not None else {}
    # Top-level keys are matched as written: of "web" and "WEB" neither may shadow the other unseen.
    unknown = [f"{key}: unknown key{did_you_mean(key, Settings.model_fields)}"
               for key in file_values if key not in Settings.model_fields]
    file_values = {key: value for key, value in file_values.items() if key in Settings.model_fields}
    source = str(path) if path is not None else "environment/flags"
    problems = environment_problems(Settings, os.environ)
    if problems:
        raise ConfigError(ENVIRONMENT, problems)
    env_values = environment_values(Settings, os.environ)
    try:
        Settings.model_validate(env_values)  # the environment alone: its errors are named as its own
    except ValidationError as err:
        raise ConfigError(ENVIRONMENT, format_errors(err, model=Settings)) from err
    merged = deep_merge(deep_merge(file_values, env_values), overrides or {})
    try:
        settings = Settings.model_validate(merged)
    except ValidationError as err:
        raise ConfigError(source, unknown + format_errors(err, model=Settings)) from err
    if unknown:
        raise ConfigError(source, unknown)
    problems = _cross_field_problems(settings)
    if problems:
        raise ConfigError(source, problems)
    return settings


def _cross_field_problems(settings: Settings) -> list[str]:
    """Checks that involve more than one key, in the same "key.path: reason" form."""
    problems = []
    if settings.nvml.retry_max < settings.nvml.retry_initial:
        problems.append("nvml.retry_max: must not be shorter than nvml.retry_initial")
    if settings.watchdog.unhealthy_after < 3 * settings.sample_interval:
        problems.append("watchdog.unhealthy_after: must be at least 3 sample intervals "
                        f"({format_duration(3 * settings.sample_interval)})")
    if settings.alerting.enabled:
        problems += validate_against_interval(settings.alerting.rules, settings.sample_interval)
    url = settings.alerting.alertmanager.url
    if url is not None:
        try:
            alertmanager_endpoint(url)
        except ValueError as err:
            problems.append(f"alerting.alertmanager.url: {err}")
    if settings.capture.webhook.users and settings.web.config_file is None:
        problems.append("capture.webhook.users: basic-auth users are defined in web.config_file, which is "
                        "not set")
    if settings.alerting.alertmanager.resend_interval < settings.sample_interval:
        problems.append("alerting.alertmanager.resend_interval: must be at least the sample interval "
                        f"({format_duration(settings.sample_interval)})")
    if settings.otlp.endpoint is not None:
        try:
            endpoint_url(settings.otlp.endpoint, grpc=settings.otlp.protocol == "grpc", as_base=False)
        except ValueError as err:
            problems.append(f"otlp.endpoint: {err}")
    return problems

"""Findings about what a busy device does: the second half of the checklist, once it is not idle.

Each is a share of the steps' time, from the device profile (``device_profile``):

- ``tensor_cores_idle``: fp32 matrix and convolution kernels on the SIMT cores, on a GPU with tensor
  cores (compute capability 7.0 and newer; assumed when the trace does not say);
- ``layout_conversion``: cuDNN's NCHW/NHWC conversions around convolutions;
- ``costly_op``: the one operation that moves or selects data (indexing and its backward, scatter,
  sort, unique, nonzero) with the most device time;
- ``small_grids``: kernels with fewer thread blocks than the GPU has SMs (part of the GPU idles while
  NVML counts it busy);
- ``optimizer_heavy``: the optimizer's step, an opportunity (a fused optimizer), never the verdict.

While the device idles most of each step its work is not what the step waits for: these findings are
then ``low``, to read once the idle time is gone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpuscope.analysis.device_profile import DeviceProfile, KernelStat
from gpuscope.analysis.evidence import MAX_EVIDENCE
from gpuscope.analysis.findings import BOUNDS, Check, Evidence, Finding, Severity, percent
from gpuscope.analysis.kernels import short_name as _short
from gpuscope.analysis.patterns import COLLECTIVE_KERNEL, NON_COMPUTE_OP, REMEDIES

COLLECTIVE_OP = re.compile(rf"{COLLECTIVE_KERNEL.pattern}|c10d::|nccl:", re.IGNORECASE)
MIN_BUSY = 0.5  # of the step time: below it, the device's own efficiency is not the step's limit
TENSOR_CORE_CAPABILITY = (7, 0)


@dataclass(frozen=True, slots=True)
class BusyContext:
    profile: DeviceProfile
    steps: int
    step_us: float  # the measured steps' time
    busy: float  # the device's busy share of it
    capability: tuple[int, int] | None


def busy_findings(context: BusyContext) -> tuple[list[Finding], list[Check]]:
    """The findings over their thresholds, and every check with its measure."""
    findings: list[Finding] = []
    checks: list[Check] = []
    for check in (_tensor_cores, _layout, _costly_op, _small_grids, _optimizer):
        made = check(context)
        if made is None:
            continue
        finding, row = made
        checks.append(row)
        if finding is not None:
            findings.append(finding)
    return findings, checks


def _of_steps(context: BusyContext, us: float) -> float:
    """Device time as a share of the steps' time, per GPU: a process that drives several GPUs has as
    many times the steps' time to fill."""
    span = context.step_us * context.profile.devices
    return min(us / span, 1.0) if span > 0 else 0.0


def _severity(context: BusyContext, kind: str, share: float) -> tuple[Severity | None, str]:
    """The severity of a share, capped at low while the device idles most of the step; the words that
    say so."""
    severity = BOUNDS[kind].severity(share)
    if severity is not None and severity != "low" and context.busy < MIN_BUSY:
        return "low", (f" (the device idles {percent(1 - context.busy)} of the step: this matters once "
                       "that idle time is gone)")
    return severity, ""


@dataclass(frozen=True, slots=True)
class _Measured:
    share: float  # of the steps' time
    check: Check
    severity: Severity | None
    caveat: str


def _measure(context: BusyContext, kind: str, us: float, note: str = "") -> _Measured:
    """``us`` of device time as a share of the steps' time, its check and its severity."""
    share = _of_steps(context, us)
    severity, caveat = _severity(context, kind, share)
    return _Measured(share, Check(kind, round(share, 4), BOUNDS[kind].reported_from, note=note), severity,
                     caveat)


def _ms(us: float) -> float:
    return round(us / 1e3, 3)


def _by_op(context: BusyContext, cls: str) -> tuple[Evidence, ...]:
    """The operations with the most time in kernels of one class, with that class's top kernel."""
    profile = context.profile
    rows = sorted(((name, stat) for name, stat in profile.op_stats.items() if stat.by_class.get(cls)),
                  key=lambda kv: -kv[1].by_class[cls])[:MAX_EVIDENCE]
    return tuple(Evidence(name, stat.by_class_count[cls], _ms(stat.by_class[cls]),
                          detail=_short(stat.top_kernel(cls, profile.kernel_stats))) for name, stat in rows)


def _tensor_cores(context: BusyContext) -> tuple[Finding | None, Check] | None:
    capability = context.capability
    if capability is not None and capability < TENSOR_CORE_CAPABILITY:
        return None  # no tensor cores to leave idle
    profile = context.profile
    fp32_us = profile.class_us["fp32_matmul"]
    tensor_us = profile.class_us["tensor_core"]
    measured = _measure(context, "tensor_cores_idle", fp32_us,
                        note=f"tensor-core kernels {percent(_of_steps(context, tensor_us))}")
    share, severity = measured.share, measured.severity
    if severity is None:
        return None, measured.check
    gpu = (f"this GPU (compute capability {capability[0]}.{capability[1]}) has tensor cores"
           if capability else "if this GPU has tensor cores (Volta and newer)")
    summary = (f"fp32 matrix and convolution kernels run on the SIMT cores {percent(share)} of the step "
               f"time ({percent(profile.classes.get('fp32_matmul', 0.0))} of the device's time, against "
               f"{percent(profile.classes.get('tensor_core', 0.0))} on the tensor cores): {gpu} that "
               f"bf16/fp16 or TF32 would use{measured.caveat}")
    return Finding("tensor_cores_idle", severity, round(share, 4), None, summary,
                   _by_op(context, "fp32_matmul"), REMEDIES["tensor_cores_idle"]), measured.check


def _layout(context: BusyContext) -> tuple[Finding | None, Check] | None:
    profile = context.profile
    us = profile.class_us["layout"]
    measured = _measure(context, "layout_conversion", us)
    if measured.severity is None:
        return None, measured.check
    summary = (f"cuDNN converts tensors between NCHW and NHWC {percent(measured.share)} of the step time "
               f"({_ms(us) / max(context.steps, 1):.2f} ms per step) around the convolutions"
               f"{measured.caveat}")
    return Finding("layout_conversion", measured.severity, round(measured.share, 4), None, summary,
                   _by_op(context, "layout"), REMEDIES["layout_conversion"]), measured.check


def _costly_op(context: BusyContext) -> tuple[Finding | None, Check] | None:
    profile = context.profile
    # Collectives gather and scatter too (all-gather, reduce-scatter): communication, not a costly op.
    candidates = sorted(((name, stat) for name, stat in profile.op_stats.items()
                         if NON_COMPUTE_OP.search(name) and not COLLECTIVE_OP.search(name)
                         and stat.by_class.get("collective", 0.0) < 0.5 * stat.us), key=lambda kv: -kv[1].us)
    if not candidates:
        return None, Check("costly_op", 0.0, BOUNDS["costly_op"].moderate)
    name, stat = candidates[0]
    measured = _measure(context, "costly_op", stat.us, note=name)
    share, severity = measured.share, measured.severity
    if severity is None:
        return None, measured.check
    kernel = stat.top_kernel()
    kernel_share = stat.by_kernel[kernel] / profile.device_us
    summary = (f"{name} takes {percent(share)} of the step time on the device in "
               f"{stat.count / max(context.steps, 1):.0f} kernels per step, {percent(kernel_share)} of the "
               f"device's time in {_short(kernel, 60)} alone: it moves or selects data, it does not compute "
               f"the model{measured.caveat}")
    evidence = tuple(Evidence(op, op_stat.count, _ms(op_stat.us), detail=_short(op_stat.top_kernel()))
                     for op, op_stat in candidates[:MAX_EVIDENCE])
    return Finding("costly_op", severity, round(share, 4), round(stat.count / max(context.steps, 1), 1),
                   summary, evidence, REMEDIES["costly_op"]), measured.check


def _small_grids(context: BusyContext) -> tuple[Finding | None, Check] | None:
    profile = context.profile
    if profile.small_grids is None:
        return None  # the trace gives no grid sizes
    small: list[tuple[str, KernelStat]] = sorted(
        ((name, stat) for name, stat in profile.kernel_stats.items() if stat.small_us),
        key=lambda kv: -kv[1].small_us)
    measured = _measure(context, "small_grids", sum(stat.small_us for _, stat in small))
    if measured.severity is None:
        return None, measured.check
    summary = (f"kernels with fewer thread blocks than the GPU has SMs run {percent(measured.share)} of the "
               f"step time: most of the GPU's multiprocessors have nothing to do while NVML counts the GPU "
               f"busy{measured.caveat}")
    evidence = tuple(Evidence(_short(name), stat.small_count, _ms(stat.small_us), detail=_short(stat.op))
                     for name, stat in small[:MAX_EVIDENCE])
    return Finding("small_grids", measured.severity, round(measured.share, 4), None, summary, evidence,
                   REMEDIES["small_grids"]), measured.check


def _optimizer(context: BusyContext) -> tuple[Finding | None, Check] | None:
    profile = context.profile
    us = profile.optimizer_us
    measured = _measure(context, "optimizer_heavy", us)  # low at most: never capped
    share, severity = measured.share, measured.severity
    if severity is None:
        return None, measured.check
    rows = sorted(((name, stat) for name, stat in profile.kernel_stats.items() if stat.optimizer_us),
                  key=lambda kv: -kv[1].optimizer_us)[:MAX_EVIDENCE]
    summary = (f"the optimizer's step takes {percent(share)} of the step time on the device "
               f"({_ms(us) / max(context.steps, 1):.2f} ms per step): a fused optimizer does it in fewer "
               "passes over the parameters")
    evidence = tuple(Evidence(_short(name), stat.count, _ms(stat.optimizer_us), detail=_short(stat.op))
                     for name, stat in rows)
    return Finding("optimizer_heavy", severity, round(share, 4), None, summary, evidence,
                   REMEDIES["optimizer_heavy"]), measured.check

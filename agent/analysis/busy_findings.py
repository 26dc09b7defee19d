"""Findings about what a busy device does: the second half of the checklist, once it is not idle.

Each is a share of the steps' time, from the device profile (``device_profile``):

- ``tensor_cores_idle``: fp32 matrix and convolution kernels on the SIMT cores, on a GPU with tensor
  cores (compute capability 7.0 and newer; assumed when the trace does not say);
- ``dominant_op``: one operation of memory-bound kernels (softmax, elementwise, normalisation) with
  most of the device's time, or unfused attention (softmax beside batched matmuls); matrix work
  dominating is what a model does (fp32 matrix work is ``tensor_cores_idle``'s);
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
from gpuscope.analysis.findings import BOUNDS, SEVERITIES, Bounds, Check, Evidence, Finding, Severity, percent
from gpuscope.analysis.kernel_taxonomy import LOG_SOFTMAX, MATMUL_CLASSES, without_parameters
from gpuscope.analysis.kernels import short_name as _short
from gpuscope.analysis.patterns import COLLECTIVE_KERNEL, NON_COMPUTE_OP
from gpuscope.analysis.remedies import remedy_for

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
    framework: str = ""  # "pytorch", "tensorflow", "jax", or "" when the trace does not say

    def remedy(self, kind: str) -> str:
        return remedy_for(kind, framework=self.framework, capability=self.capability)


def busy_findings(context: BusyContext) -> tuple[list[Finding], list[Check]]:
    """The findings over their thresholds, and every check with its measure."""
    findings: list[Finding] = []
    checks: list[Check] = []
    for check in (_tensor_cores, _costly_op, _dominant_op, _layout, _small_grids, _optimizer):
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
                   _by_op(context, "fp32_matmul"), context.remedy("tensor_cores_idle")), measured.check


def _layout(context: BusyContext) -> tuple[Finding | None, Check] | None:
    profile = context.profile
    us = profile.class_us["layout"]
    measured = _measure(context, "layout_conversion", us)
    if measured.severity is None:
        return None, measured.check
    summary = (f"tensors are converted between layouts (NCHW and NHWC, transposes) {percent(measured.share)} "
               f"of the step time ({_ms(us) / max(context.steps, 1):.2f} ms per step)"
               f"{measured.caveat}")
    return Finding("layout_conversion", measured.severity, round(measured.share, 4), None, summary,
                   _by_op(context, "layout"), context.remedy("layout_conversion")), measured.check


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
                   summary, evidence, context.remedy("costly_op")), measured.check


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
                   context.remedy("small_grids")), measured.check


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
                   context.remedy("optimizer_heavy")), measured.check


# Kernels whose time fusion removes: each reads and writes its tensors once more.
MEMORY_BOUND = ("softmax", "elementwise", "reduction")
# Unfused attention, by the softmax kernels' share of the device's time: softmax is one of several
# passes over the score matrix (scaling, masking, dropout and their backward run as elementwise
# kernels), so a smaller share of softmax alone stands for the pattern.
ATTENTION_BOUNDS = Bounds(0.15, 0.25)
BATCHED_MATMUL = re.compile(r"bmm|matmul|einsum|batched|attention", re.IGNORECASE)
LOSS_OP = re.compile(r"log_?softmax|cross_entropy|nll_?loss", re.IGNORECASE)


def _attention(context: BusyContext) -> tuple[float, float, list[str]]:
    """Unfused attention: the attention softmax's device time (the loss's log-softmax left out), the
    batched matmuls' beside it, and the operations of both."""
    profile = context.profile
    softmax_us = matmul_us = 0.0
    ops: dict[str, float] = {}
    # Without operations to name them, any matrix kernel may be attention's.
    any_matmul = profile.attributed_us < 0.5 * profile.device_us
    for name, stat in profile.kernel_stats.items():
        if stat.cls == "softmax" and not LOG_SOFTMAX.search(without_parameters(name)):
            for op, us in stat.ops.items():
                if not LOSS_OP.search(op):
                    softmax_us += us
                    ops[op] = ops.get(op, 0.0) + us
        elif stat.cls in MATMUL_CLASSES:
            for op, us in stat.ops.items():
                if any_matmul or BATCHED_MATMUL.search(op) or BATCHED_MATMUL.search(name):
                    matmul_us += us
                    ops[op] = ops.get(op, 0.0) + us
    return softmax_us, matmul_us, sorted(ops, key=lambda op: -ops[op])


def _dominant_op(context: BusyContext) -> tuple[Finding | None, Check] | None:
    profile = context.profile
    total = profile.device_us
    softmax_us, matmul_us, attention_ops = _attention(context)
    attention = softmax_us / total if matmul_us > 0 else 0.0
    candidates = sorted(((name, stat) for name, stat in profile.op_stats.items()
                         if not NON_COMPUTE_OP.search(name) and not COLLECTIVE_OP.search(name)
                         and sum(stat.by_class.get(cls, 0.0) for cls in MEMORY_BOUND) >= 0.5 * stat.us),
                        key=lambda kv: -kv[1].us)
    name, stat = candidates[0] if candidates else ("", None)
    op_share = stat.us / total if stat is not None else 0.0
    op_severity = BOUNDS["dominant_op"].severity(op_share)
    attention_severity = ATTENTION_BOUNDS.severity(attention)
    by_attention = attention_severity is not None and (
        op_severity is None or rank_severity(attention_severity) <= rank_severity(op_severity))
    if by_attention:
        check = Check("dominant_op", round(attention, 4), ATTENTION_BOUNDS.moderate,
                      note="softmax beside batched matmuls (unfused attention), of the device's time")
        severity, us = attention_severity, softmax_us + matmul_us
    else:
        check = Check("dominant_op", round(op_share, 4), BOUNDS["dominant_op"].moderate,
                      note=f"{name}, of the device's time" if name else "of the device's time")
        severity, us = op_severity, stat.us if stat is not None else 0.0
    if severity is None:
        return None, check
    caveat = ""
    if severity != "low" and context.busy < MIN_BUSY:
        severity, caveat = "low", (f" (the device idles {percent(1 - context.busy)} of the step: this "
                                   "matters once that idle time is gone)")
    share = _of_steps(context, us)
    if by_attention:
        summary = (f"unfused attention: softmax kernels take {percent(attention)} of the device's time "
                   f"beside batched matrix multiplications ({percent(matmul_us / total)}), "
                   f"{percent(share)} of the "
                   "step time together; each pass writes the score matrix to memory and reads it back, which "
                   f"a fused attention kernel never does{caveat}")
        rows = [(op, profile.op_stats[op]) for op in attention_ops if op in profile.op_stats]
    else:
        assert stat is not None
        cls = max(MEMORY_BOUND, key=lambda c: stat.by_class.get(c, 0.0))
        summary = (f"{name} takes {percent(op_share)} of the device's time ({percent(share)} of the step "
                   f"time) in {cls} kernels such as {_short(stat.top_kernel(), 60)}: memory-bound work "
                   f"that fusing it with its neighbours removes{caveat}")
        rows = candidates
    evidence = tuple(Evidence(op, op_stat.count, _ms(op_stat.us), detail=_short(op_stat.top_kernel()))
                     for op, op_stat in rows[:MAX_EVIDENCE])
    return Finding("dominant_op", severity, round(share, 4), None, summary, evidence,
                   context.remedy("dominant_op")), check


def rank_severity(severity: Severity) -> int:
    return SEVERITIES.index(severity)

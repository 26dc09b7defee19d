"""The status page at ``/``: the node at a glance, as one self-contained HTML document.

Rendering is a pure function of a ``StatusView`` (the latest Snapshot, the alerts, the recent
captures, the utilization history), gathered by ``app.AgentApp`` from what the agent already holds:
it reads nothing from the node and never waits for the sampler.

The agent often runs where nothing outside the node can be reached, so the page has no script, no
external stylesheet, font or image: the CSS is inline and the sparklines are inline SVG (sparkline.py:
the envelope of the driver's utilization samples, so that short dips to idle show). It reloads
itself every REFRESH_SECONDS with a meta refresh. Every string that comes from outside the agent
(process, user, pod and GPU names, alert summaries, capture errors) goes through ``html.escape``.
A wide table scrolls sideways inside its own section rather than widening the page; in a window
narrower than 800 px, each alert, GPU and capture is a block whose cells wrap (status_style.py), so
that none of their columns is scrolled out of view.

A GPU in MIG mode is followed by one row per MIG device (its profile, GPU and compute instance ids,
UUID, pods, busy share with its sparkline, SM activity, memory, processes and alerts); the processes on
a MIG device are listed with that device and its pods. Each GPU and MIG device has a health badge
(status_health.py: its readings' state, "reset required", "replace", "lost", and its hardware alerts);
a GPU whose health is not ok has an amber or red "up", never a green one. The captures are
status_captures.py's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from gpuscope.alerts.capture_verdicts import CAPTURE_EARLY_SECONDS
from gpuscope.alerts.model import Alert, Transition
from gpuscope.capture.alert_context import alert_context
from gpuscope.capture.model import CaptureRecord
from gpuscope.capture.record_gains import verdict_gain_text
from gpuscope.capture.refusals import RefusedTrigger
from gpuscope.common.sizes import format_size
from gpuscope.documents import CAPTURES_PATH
from gpuscope.snapshot import GpuReading, MigReading, PodContainer, ProcessReading, Snapshot
from gpuscope.web.sparkline import sparkline
from gpuscope.web.status_captures import (
    RECENT_CAPTURES,
    capture_anchor,
    captures_section,
    shown_captures,
)
from gpuscope.web.status_format import NONE as _NONE
from gpuscope.web.status_format import clock as _clock
from gpuscope.web.status_format import duration as _duration
from gpuscope.web.status_format import escape as _e
from gpuscope.web.status_format import section as _section
from gpuscope.web.status_format import table as _table
from gpuscope.web.status_health import GpuHealth, gpu_health, health_cell, state_badge
from gpuscope.web.status_style import STATUS_PAGE_CSS
from gpuscope.web.utilization_history import DEFAULT_POINTS, UtilizationSeries

__all__ = ["RECENT_CAPTURES", "REFRESH_SECONDS", "StatusView", "render_status_page"]

REFRESH_SECONDS = 5


@dataclass(frozen=True, slots=True)
class StatusView:
    """Everything the page shows. ``alerts`` and ``captures`` are None where that part is off."""

    snapshot: Snapshot | None
    stale: bool  # the snapshot is older than the sampler's staleness limit
    alerts: Sequence[Alert] | None
    captures: Sequence[CaptureRecord] | None
    history: Callable[[int, str], UtilizationSeries]  # (GPU index, uuid) -> recent utilization
    version: str
    now: float  # wall clock, Unix seconds
    simulated: str | None = None  # the scenario's name when the node is simulated
    include_processes: bool = True  # processes.export
    include_users: bool = True  # processes.user
    downloads: bool = False  # whether capture downloads are served to this page's reader
    history_points: int = DEFAULT_POINTS
    refusals: Sequence[RefusedTrigger] = ()  # capture triggers refused lately, newest first
    resolved: Sequence[Transition] = ()  # alerts resolved lately, newest first (alerts/resolved.py)


def render_status_page(view: StatusView) -> bytes:
    """The page as UTF-8 bytes."""
    snapshot = view.snapshot
    hostname = snapshot.hostname if snapshot is not None else "gpuscope"
    parts = [
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n",
        f'<meta http-equiv="refresh" content="{REFRESH_SECONDS}">\n',
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n',
        f"<title>{_e(hostname)} &middot; gpuscope</title>\n",
        f"<style>{STATUS_PAGE_CSS}</style>\n</head>\n<body>\n",
        _header(view),
        _banners(view),
        "<main>\n",
    ]
    if snapshot is None:
        parts.append('<section><p class="note">No snapshot yet: the first sampling tick has not '
                     "finished. This page reloads on its own.</p></section>\n")
    else:
        parts += [_alerts_section(view), _gpus_section(view, snapshot), _processes_section(view, snapshot)]
    parts += [captures_section(view.captures, view.refusals, downloads=view.downloads, now=view.now,
                               alerts=view.alerts, resolved=view.resolved),
              "</main>\n", _footer(view), "</body>\n</html>\n"]
    return "".join(parts).encode()


# -- sections -----------------------------------------------------------------------------------------


def _header(view: StatusView) -> str:
    snapshot = view.snapshot
    if snapshot is None:
        return f'<header><h1>gpuscope</h1><span class="sub">version {_e(view.version)}</span></header>\n'
    facts = [f"{len(snapshot.gpus)} GPU{'' if len(snapshot.gpus) == 1 else 's'}"]
    if snapshot.driver_version:
        facts.append(f"driver {_e(snapshot.driver_version)}")
    facts.append(f"sampled every {_duration(snapshot.interval_seconds)}")
    age = _duration(max(0.0, view.now - snapshot.timestamp))
    facts.append(f"updated {_clock(snapshot.timestamp)} ({age} ago)")
    return (f'<header><h1>{_e(snapshot.hostname)}</h1><span class="sub">{" &middot; ".join(facts)}</span>'
            f'<span class="sub right">gpuscope {_e(view.version)}</span></header>\n')


def _banners(view: StatusView) -> str:
    banners = []
    if view.simulated is not None:
        banners.append(f'<div class="banner sim" id="simulated">SIMULATED NODE &mdash; scenario '
                       f"<code>{_e(view.simulated)}</code>: every reading on this page comes from a "
                       "simulation, not from real GPUs.</div>\n")
    snapshot = view.snapshot
    if snapshot is not None and not snapshot.nvml_up:
        banners.append('<div class="banner bad">NVML is not available: no GPU can be read (see the '
                       "agent's log).</div>\n")
    if snapshot is not None and view.stale:
        banners.append(f'<div class="banner bad">The latest snapshot is '
                       f"{_duration(max(0.0, view.now - snapshot.timestamp))} old: the sampler may be stuck; "
                       "the readings below are out of date.</div>\n")
    return "".join(banners)


def _alerts_section(view: StatusView) -> str:
    if view.alerts is None:
        return _section("Alerts", '<p class="note muted">Alerting is off on this agent '
                                  "(<code>alerting.enabled</code>).</p>")
    if not view.alerts:
        return _section("Alerts", '<p class="note ok">No alert is pending or firing.</p>')
    # Firing first (critical before warning), then clearing, then pending, then the inhibited ones.
    order = {"firing": 0, "clearing": 1, "pending": 2, "inhibited": 3}
    ordered = sorted(view.alerts, key=lambda a: (order[_shown_state(a)], a.severity != "critical", a.gpu,
                                                 a.name))
    rows = []
    for alert in ordered:
        since = alert.firing_since if alert.state == "firing" and alert.firing_since else alert.active_since
        state = _shown_state(alert)
        severity = _e(alert.severity)
        rows.append(
            f'<tr class="alert {state} {severity}"><td><span class="badge {state}">{state}</span></td>'
            f"<td><b>{_e(alert.name)}</b></td><td class=\"num\">{alert.gpu}{_alert_device(alert)}</td>"
            f'<td><span class="severity {severity}">{severity}</span></td>'
            f'<td class="nowrap">{_duration(max(0.0, view.now - since))}</td>'
            f"<td>{_inhibition(alert)}{_e(alert.summary)}{_alert_capture(alert, view.captures)}</td></tr>")
    counts = {shown: sum(1 for a in view.alerts if _shown_state(a) == shown)
              for shown in ("firing", "clearing", "pending", "inhibited")}
    title = "Alerts: " + ", ".join(f"{n} {shown}" for shown, n in counts.items()
                                   if n or shown in ("firing", "pending"))
    return _section(title, _table(("State", "Alert", "GPU", "Severity", "For", "Summary"), rows), "alerts")


def _shown_state(alert: Alert) -> str:
    """firing, clearing (firing, its condition no longer holding), pending, or inhibited (muted by a
    greater alert on its GPU, whatever its own state)."""
    if alert.inhibited_by:
        return "inhibited"
    return "clearing" if alert.clearing else alert.state


def _alert_capture(alert: Alert, captures: Sequence[CaptureRecord] | None) -> str:
    """What the latest analysed capture this alert triggered found, under its summary: the verdict
    where it accounts for the alert, and that it saw other minutes where it does not. Its id links to
    its row in the captures table, with the explanation, where the table lists it."""
    listed = {record.id for record in shown_captures(captures)}
    for record in captures or ():  # newest first
        if (record.trigger.kind == "alert" and record.trigger.alertname == alert.name
                and record.gpu == alert.gpu and record.start >= alert.active_since - CAPTURE_EARLY_SECONDS
                and record.analysis and record.analysis.get("verdict")):
            context = alert_context(record.to_json())
            verdict = _e(str(record.analysis["verdict"]))
            named = (f'<a href="#{capture_anchor(record.id)}">{_e(record.id)}</a>' if record.id in listed
                     else _e(record.id))
            if context is not None and context.accounts is False:
                return (f'<div class="small muted" title="{_e(context.text)}">its capture {named} '
                        f"saw other minutes ({verdict}) and does not explain it</div>")
            # On hover, the headline and what fixing the finding would buy (the captures table shows both).
            hover = "\n".join(filter(None, (str(record.analysis.get("headline") or ""),
                                             verdict_gain_text(record.analysis))))
            return f'<div class="small" title="{_e(hover)}">its capture {named}: <b>{verdict}</b></div>'
    return ""


def _inhibition(alert: Alert) -> str:
    """What mutes an inhibited alert, in front of its summary."""
    if not alert.inhibited_by:
        return ""
    return (f'<span class="inhibited-by">inhibited by {_e(alert.inhibited_by)}, which explains it '
            f"({_e(alert.state)} on its own):</span> ")


def _gpus_section(view: StatusView, snapshot: Snapshot) -> str:
    if not snapshot.gpus:
        return _section("GPUs", '<p class="note muted">NVML lists no GPU.</p>')
    alerts_by_gpu: dict[int, list[Alert]] = {}
    alerts_by_device: dict[str, list[Alert]] = {}  # the alerts on a MIG device, by its UUID
    for alert in view.alerts or ():
        device = alert.labels.get("mig_uuid")
        if device:
            alerts_by_device.setdefault(device, []).append(alert)
        else:
            alerts_by_gpu.setdefault(alert.gpu, []).append(alert)
    rows = []
    for gpu in snapshot.gpus:
        series = view.history(gpu.index, gpu.uuid)
        on_gpu = alerts_by_gpu.get(gpu.index, ())
        health = gpu_health(gpu, on_gpu)
        state = state_badge(gpu, health)
        badges = _alert_badges(on_gpu)
        if gpu.up:
            cells = (f'<td class="busy"><div class="util"><span class="num">{_percent(gpu.utilization_ratio)}'
                     f"</span>{sparkline(series, view.history_points)}</div></td>"
                     f'<td class="num mem">{_memory(gpu)}</td><td class="num power">{_power(gpu)}</td>'
                     f'<td class="num temp">{_temperature(gpu.temperature_celsius)}</td>'
                     f'<td class="num procs">{len(gpu.processes)}</td>')
        else:
            cells = '<td colspan="5" class="muted">not readable this tick</td>'
        mig = ' <span class="muted">(MIG)</span>' if gpu.mig_enabled else ""
        name = f'<span title="{_e(gpu.uuid)} at PCI {_e(gpu.pci_bus_id)}">{_e(gpu.name)}</span>{mig}'
        rows.append(f'<tr class="gpu" id="gpu-{gpu.index}">'
                    f'<td class="num index"><b>{gpu.index}</b></td><td class="name">{name}</td>'
                    f'<td class="state">{state}</td><td class="health">{health_cell(health)}</td>{cells}'
                    f'<td class="alerts">{badges or _NONE}</td></tr>')
        if gpu.up:
            rows += [_mig_row(view, gpu, device, alerts_by_device.get(device.uuid, ()), health)
                     for device in gpu.mig_devices]
    span = _history_span(view, snapshot)
    headings = ("GPU", "Name", "State", "Health", f"Utilization, {span}", "Memory used / total",
                "Power / limit", "Temp.", "Proc.", "Alerts")
    return _section("GPUs", _table(headings, rows), "gpus")


def _mig_row(view: StatusView, gpu: GpuReading, device: MigReading, alerts: Iterable[Alert],
             health: GpuHealth) -> str:
    """One MIG device of ``gpu``, in the GPUs table under its GPU: profile and ids (its UUID as a
    tooltip) and the pods allocated it; its busy share (the latest tick's, and the sparkline) and SM
    activity (GPM); memory; its processes; its alerts."""
    profile = _e(device.profile or "?")
    name = (f'<span class="mig-name" title="{_e(device.uuid)}">&#8627; MIG {profile}</span> '
            f"{_instance_ids(device.gpu_instance, device.compute_instance)}")
    if device.pods:
        name += f'<div class="small pods">{_pods_text(device.pods)}</div>'
    series = view.history(gpu.index, device.uuid)
    latest = series.values[-1] if series.values else None
    sm = (f' <span class="muted small nowrap">SM {_percent(device.sm_active_ratio)}</span>'
          if device.sm_active_ratio is not None else "")
    busy = (f'<div class="util"><span class="num" title="busy share (GPM graphics activity)">'
            f"{_percent(latest)}</span>{sparkline(series, view.history_points)}{sm}</div>")
    on_it = sum(1 for p in gpu.processes if device.runs(p))
    badges = _alert_badges(alerts)
    return (f'<tr class="mig" id="gpu-{gpu.index}-mig-{device.gpu_instance}-{device.compute_instance}">'
            f'<td class="index"></td><td class="name">{name}</td><td class="state"></td>'
            f'<td class="health">{health_cell(health, of_gpu=gpu.index)}</td><td class="busy">{busy}</td>'
            f'<td class="num mem">{_used_of(device.memory_used_bytes, device.memory_total_bytes)}</td>'
            f'<td class="num power">{_NONE}</td><td class="num temp">{_NONE}</td>'
            f'<td class="num procs">{on_it}</td><td class="alerts">{badges or _NONE}</td></tr>')


def _pods_text(pods: Iterable[PodContainer]) -> str:
    """Pod containers on one line, escaped: "pod research/finetune-7 (trainer)"."""
    named = [f"{_e(p.namespace)}/{_e(p.pod)} ({_e(p.container)})" for p in sorted(pods)]
    return f"pod{'s' if len(named) > 1 else ''} {', '.join(named)}"


def _alert_badges(alerts: Iterable[Alert]) -> str:
    """The GPU's alerts as badges; the inhibited ones are left out (the alerts table lists them)."""
    return " ".join(f'<span class="badge {_e(a.state)}" title="{_e(a.summary)}">{_e(a.name)}</span>'
                    for a in sorted(alerts, key=lambda a: a.name) if not a.inhibited_by)


def _alert_device(alert: Alert) -> str:
    """The MIG device an alert is on, under its GPU in the alerts table ("" for an alert on a GPU)."""
    labels = alert.labels
    if not labels.get("mig_uuid"):
        return ""
    ids = _instance_ids(labels.get("gpu_instance", "?"), labels.get("compute_instance", "?"))
    return (f'<div class="muted small nowrap"><span title="{_e(labels["mig_uuid"])}">MIG '
            f'{_e(labels.get("mig_profile") or "?")}</span> {ids}</div>')


def _instance_ids(gpu_instance: int | str, compute_instance: int | str) -> str:
    """A MIG device's ids, short, with their names as a tooltip: "GI 1 · CI 0"."""
    gi, ci = _e(str(gpu_instance)), _e(str(compute_instance))
    return (f'<span class="muted small nowrap" title="GPU instance {gi}, compute instance {ci}">'
            f"GI {gi} &middot; CI {ci}</span>")


def _processes_section(view: StatusView, snapshot: Snapshot) -> str:
    if not view.include_processes:
        return _section("Processes", '<p class="note muted">Process details are not shown on this agent '
                                     "(<code>processes.export: false</code>).</p>")
    rows = []
    # The Slurm job column only on a node that runs Slurm jobs: elsewhere it would be empty.
    show_jobs = any(p.slurm_job is not None and p.host_visible
                    for gpu in snapshot.gpus for p in gpu.processes)
    for gpu in snapshot.gpus:
        pod = _pod_cells(gpu.pods)
        seen: set[int] = set()  # NVML lists a process with a compute and a graphics context twice
        for process in gpu.processes:
            if process.pid in seen:
                continue
            seen.add(process.pid)
            device = _device_of(gpu, process)
            cells = _pod_cells(device.pods) if device is not None else pod
            rows.append(_process_row(view, gpu, process, cells, show_jobs=show_jobs, device=device))
    if not rows:
        return _section("Processes", '<p class="note muted">No process holds a GPU.</p>')
    headings = ["GPU", "PID", "Process"]
    if view.include_users:
        headings.append("User")
    if show_jobs:
        headings.append("Slurm job")
    headings += ["Memory", "SM", "Pod", "Namespace", "Container"]
    return _section("Processes", _table(headings, rows), "processes")


def _device_of(gpu: GpuReading, process: ProcessReading) -> MigReading | None:
    """The MIG device a process runs on; None off MIG."""
    if process.gpu_instance is None or not gpu.mig_devices:
        return None
    return next((d for d in gpu.mig_devices if d.runs(process)), None)


def _process_row(view: StatusView, gpu: GpuReading, process: ProcessReading,
                 pod: tuple[str, str, str], *, show_jobs: bool, device: MigReading | None = None) -> str:
    if process.host_visible:
        name = _e(process.name) if process.name else _NONE
    else:
        name = '<span class="muted">not visible from the host</span>'
    where = str(gpu.index)
    if device is not None:  # its MIG device, as the GPUs table shows it
        profile = _e(device.profile or "?")
        where += (f' <span class="muted small nowrap" title="{_e(device.uuid)}">MIG {profile}</span> '
                  f"{_instance_ids(device.gpu_instance, device.compute_instance)}")
    cells = [f'<td class="num">{where}</td>', f'<td class="num">{process.pid}</td>',
             f'<td class="pname">{name}</td>']
    if view.include_users:
        cells.append(f"<td>{_e(process.user) if process.user and process.host_visible else _NONE}</td>")
    if show_jobs:
        job = process.slurm_job if process.host_visible else None
        step = job.notation if job is not None else ""
        cells.append(f'<td class="mono">{_e(step)}</td>' if step else f"<td>{_NONE}</td>")
    pod_name, namespace, container = pod
    if not container and process.container_id and process.host_visible:
        # No pod to name it: the container runtime's id, shortened as `docker ps` shows it.
        short = _e(process.container_id[:12])
        container = f'<span class="mono" title="{_e(process.container_id)}">{short}</span>'
    cells += [
        f'<td class="num">{_bytes(process.memory_used_bytes)}</td>',
        f'<td class="num">{_percent(process.sm_utilization_ratio)}</td>',
        f"<td>{pod_name or _NONE}</td>", f"<td>{namespace or _NONE}</td>", f"<td>{container or _NONE}</td>",
    ]
    return f'<tr class="process">{"".join(cells)}</tr>'


def _pod_cells(pods: tuple[PodContainer, ...]) -> tuple[str, str, str]:
    """(pod, namespace, container) cells, escaped, for the processes of a GPU the kubelet allocated to
    ``pods``. A GPU time-sliced between pods: the kubelet cannot say which process is whose, so the
    page names the candidates, as such."""
    if not pods:
        return "", "", ""
    namespaces = sorted({p.namespace for p in pods})
    namespace = ", ".join(_e(n) for n in namespaces)
    names = sorted({p.pod for p in pods})
    if len(names) > 1:
        return f'<span class="muted">one of</span> {", ".join(_e(n) for n in names)}', namespace, ""
    container = _e(pods[0].container) if len(pods) == 1 else ""
    return _e(names[0]), namespace, container


def _footer(view: StatusView) -> str:
    links = (("/metrics", "metrics"), ("/api/v1/snapshot", "snapshot (JSON)"),
             ("/api/v1/alerts", "alerts (JSON)"), (CAPTURES_PATH, "captures (JSON)"),
             ("/-/healthy", "liveness"), ("/-/ready", "readiness"))
    anchors = " &middot; ".join(f'<a href="{path}">{label}</a>' for path, label in links)
    return (f"<footer>{anchors}<br>gpuscope {_e(view.version)} &middot; this page reloads every "
            f"{REFRESH_SECONDS} s</footer>\n")


# -- pieces --------------------------------------------------------------------------------------------


def _history_span(view: StatusView, snapshot: Snapshot) -> str:
    """How much time the sparklines cover when full, e.g. "last 60 s"."""
    return f"last {_duration(view.history_points * snapshot.interval_seconds)}"


def _memory(gpu: GpuReading) -> str:
    return _used_of(gpu.memory_used_bytes, gpu.memory_total_bytes)


def _used_of(used: int | None, total: int | None) -> str:
    if used is None:
        return _NONE
    text = f"{format_size(used)} / {format_size(total)}" if total else format_size(used)
    if total:
        text += f' <span class="muted">({used / total:.0%})</span>'
    return text


def _power(gpu: GpuReading) -> str:
    if gpu.power_watts is None or not math.isfinite(gpu.power_watts):
        return _NONE
    limit = gpu.power_limit_watts
    if limit is None or not math.isfinite(limit):
        return f"{gpu.power_watts:.0f} W"
    return f"{gpu.power_watts:.0f} W / {limit:.0f} W"


def _temperature(celsius: float | None) -> str:
    return _NONE if celsius is None or not math.isfinite(celsius) else f"{celsius:.0f} &deg;C"


def _percent(ratio: float | None) -> str:
    return _NONE if ratio is None or not math.isfinite(ratio) else f"{ratio:.0%}"


def _bytes(size: int | None) -> str:
    return _NONE if size is None else format_size(size)

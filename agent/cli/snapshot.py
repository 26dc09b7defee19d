"""`gpuscope snapshot`: one snapshot of the node, as a table (GPUs, then processes) or as JSON.

Without --simulate it asks the agent running on this machine first (its control socket, then its HTTP
endpoint: agent_snapshot.py) and prints that agent's latest snapshot, saying on stderr which agent
answered. Only when none answers (and always with --simulate) does it sample the node itself: it
builds the node's sampling exactly as `gpuscope run` does (NodeSampling: the same settings, pods and
simulation), takes two ticks half a second apart so that rates cover a real interval, and exits.

In the table, a GPU in MIG mode is followed by its MIG devices (profile, GPU and compute instance ids,
busy share over the half second, SM activity, memory, processes on it, pods), and a GPU whose health
is not "ok" says so in its STATE (``RESET REQUIRED``, ``REPLACE``, ``LOST``). A POD column appears
where the kubelet allocated a GPU or MIG device to a pod.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence

from gpuscope.cli.agent_snapshot import ask_running_agent
from gpuscope.cli.local_agent import find_local_agent, no_nvml_hints
from gpuscope.config import Settings
from gpuscope.sampling.node import NodeSampling
from gpuscope.snapshot import GpuReading, MigReading, PodContainer, SlurmJob, Snapshot

EXIT_OK, EXIT_FAILURE = 0, 1


def _note(line: str) -> None:
    print(f"gpuscope: {line}", file=sys.stderr)


def print_snapshot(settings: Settings, *, as_json: bool) -> int:
    """Print one snapshot, the running agent's if one answers, else one sampled here; exit 0, or 1
    when NVML is not available (then stderr says what to try, and where a running agent's snapshot
    is). ConfigError for a bad scenario."""
    if settings.simulate is None:
        answer = ask_running_agent(settings, _note)
        if answer is not None:
            _note(f"snapshot of the running agent at {answer.where} ({answer.details})")
            snapshot = answer.snapshot
            print(json.dumps(answer.document, indent=2) if as_json else format_snapshot(snapshot))
            if not snapshot.nvml_up:
                _note("the running agent finds no NVIDIA driver on this machine either")
            return EXIT_OK if snapshot.nvml_up else EXIT_FAILURE
    else:
        _note(f"sampling its own simulated node (--simulate {settings.simulate}), not the running agent's")
    return _sample_here(settings, as_json=as_json)


def _sample_here(settings: Settings, *, as_json: bool) -> int:
    """Sample the node as `gpuscope run` would, twice half a second apart, and print the second tick."""
    sampling = NodeSampling(settings)
    sampling.install()
    try:
        if sampling.pods is not None:
            sampling.pods.refresh()  # one kubelet query, so the snapshot names the pods
        sampler = sampling.sampler
        first = sampler.tick()  # primes the cursors (utilization samples, GPM) ...
        time.sleep(0.5)
        snapshot = sampler.tick()  # ... so this tick has rates over a real interval
    finally:
        sampling.sampler.stop()
        if sampling.pods is not None:
            sampling.pods.stop()
        sampling.uninstall()
    print(json.dumps(snapshot.to_json(), indent=2) if as_json else format_snapshot(snapshot, previous=first))
    if not snapshot.nvml_up and settings.simulate is None:  # a simulated node without a driver is on purpose
        # No agent gave its snapshot; one may still be there (its HTTP port wants a password or TLS).
        agent = find_local_agent(settings.web.listen_address, settings.control.socket)
        for line in no_nvml_hints(agent):
            print(f"gpuscope: {line}", file=sys.stderr)
    return EXIT_OK if snapshot.nvml_up else EXIT_FAILURE


def _fmt(value: float | None, scale: float = 1.0, spec: str = ".0f", suffix: str = "") -> str:
    return "-" if value is None else f"{value * scale:{spec}}{suffix}"


_HEALTH = {"reset_required": "RESET REQUIRED", "replace": "REPLACE"}  # "lost": the GPU's state is LOST
_GIB = 1 / 2**30


def format_snapshot(snapshot: Snapshot, previous: Snapshot | None = None) -> str:
    """A human table: the GPUs (each in MIG mode followed by its MIG devices), then their processes.
    ``previous``: the tick before, of the same sampler, from its start: the MIG devices' busy share is
    their busy-seconds' growth since then ("-" without it)."""
    if not snapshot.nvml_up:
        return f"{snapshot.hostname}: NVML is not available (no NVIDIA driver?)"
    lines = [f"{snapshot.hostname}  driver {snapshot.driver_version}  {len(snapshot.gpus)} GPU(s)", ""]
    with_pods = any(g.pods or any(m.pods for m in g.mig_devices) for g in snapshot.gpus)
    gpu_rows = [("GPU", "NAME", "UTIL", "SM", "MEM USED/TOTAL", "POWER", "TEMP", "PROCS", "DIPS", "STATE",
                 *(("POD",) if with_pods else ()))]
    proc_rows = [("GPU", "PID", "PROCESS", "USER", "TYPE", "GPU MEM", "SM", "CONTAINER", "JOB")]
    gib = _GIB
    before = _busy_before(snapshot, previous)
    for g in snapshot.gpus:
        active = (g.clock_event_reasons or frozenset()) - {"gpu_idle"}
        state = ("up" + (f" ({','.join(sorted(active))})" if active else "")) if g.up else "LOST"
        if g.health in _HEALTH:
            state = f"{_HEALTH[g.health]}, {state}"
        gpu_rows.append((
            str(g.index), g.name or "?", _fmt(g.utilization_ratio, 100, ".0f", "%"),
            _fmt(g.sm_active_ratio, 100, ".0f", "%"),
            f"{_fmt(g.memory_used_bytes, gib, '.1f')}/{_fmt(g.memory_total_bytes, gib, '.0f')} GiB",
            _fmt(g.power_watts, 1, ".0f", " W"), _fmt(g.temperature_celsius, 1, ".0f", " C"),
            str(len(g.compute_processes)), _fmt(g.idle_dips_total, 1, "d"), state,
            *((_pods(g.pods),) if with_pods else ()),
        ))
        if g.up:
            gpu_rows += [_mig_row(g, m, before, with_pods=with_pods) for m in g.mig_devices]
        for p in g.processes:
            proc_rows.append((
                str(g.index), str(p.pid), p.name or "?", p.user or "?", p.kind,
                _fmt(p.memory_used_bytes, gib, ".1f", " GiB"), _fmt(p.sm_utilization_ratio, 100, ".0f", "%"),
                (p.container_id or "-")[:12], _slurm_step(p.slurm_job),
            ))
    lines += _table(gpu_rows)
    if len(proc_rows) > 1:
        lines += ["", *_table(proc_rows)]
    return "\n".join(lines)


def _busy_before(snapshot: Snapshot, previous: Snapshot | None) -> dict[str, tuple[float, float]]:
    """MIG device UUID -> (seconds since ``previous``, its busy-seconds then; 0 where it had none: the
    sampler counts from 0 from its first GPM sample)."""
    if previous is None or snapshot.monotonic <= previous.monotonic:
        return {}
    elapsed = snapshot.monotonic - previous.monotonic
    return {m.uuid: (elapsed, m.busy_seconds_total or 0.0) for g in previous.gpus for m in g.mig_devices}


def _mig_row(gpu: GpuReading, device: MigReading, before: dict[str, tuple[float, float]], *,
             with_pods: bool) -> tuple[str, ...]:
    """A MIG device's row, under its GPU's: its busy share (``before``), GPM SM activity and memory;
    power, temperature and idle dips are the GPU's only; in the STATE column, its UUID."""
    share = None
    if device.uuid in before and device.busy_seconds_total is not None:
        elapsed, busy = before[device.uuid]
        share = min(1.0, max(0.0, (device.busy_seconds_total - busy) / elapsed))
    on_it = [p for p in gpu.compute_processes if device.runs(p)]
    used, total = device.memory_used_bytes, device.memory_total_bytes
    memory = f"{_fmt(used, _GIB, '.1f')}/{_fmt(total, _GIB, '.0f')} GiB"
    return (
        "", f"  MIG {device.profile or '?'} GI {device.gpu_instance} CI {device.compute_instance}",
        _fmt(share, 100, ".0f", "%"), _fmt(device.sm_active_ratio, 100, ".0f", "%"), memory, "-", "-",
        str(len(on_it)), "-", device.uuid, *((_pods(device.pods),) if with_pods else ()),
    )


def _pods(pods: Sequence[PodContainer]) -> str:
    """"research/finetune-7/trainer" (namespace/pod/container), comma-separated; "-" for none."""
    return ",".join(f"{p.namespace}/{p.pod}/{p.container}" for p in pods) or "-"


def _slurm_step(job: SlurmJob | None) -> str:
    """Slurm's own notation for a step (``4242.0``, ``4242.batch``), or ``-`` outside a job."""
    if job is None:
        return "-"
    return job.notation


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]

"""`gpuscope snapshot`: one snapshot of the node, as a table (GPUs, then processes) or as JSON.

It builds the node's sampling exactly as `gpuscope run` does (NodeSampling: the same settings, pods
and simulation), takes two ticks half a second apart so that rates cover a real interval, and exits.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence

from gpuscope.cli.local_agent import find_local_agent, no_nvml_hints
from gpuscope.config import Settings
from gpuscope.sampling.node import NodeSampling
from gpuscope.snapshot import SlurmJob, Snapshot

EXIT_OK, EXIT_FAILURE = 0, 1


def print_snapshot(settings: Settings, *, as_json: bool) -> int:
    """Print one snapshot; exit 0, or 1 when NVML is not available (then stderr says what to try, and
    where a running agent's snapshot is). ConfigError for a bad scenario."""
    sampling = NodeSampling(settings)
    sampling.install()
    try:
        if sampling.pods is not None:
            sampling.pods.refresh()  # one kubelet query, so the snapshot names the pods
        sampler = sampling.sampler
        sampler.tick()  # primes the cursors (utilization samples, GPM) ...
        time.sleep(0.5)
        snapshot = sampler.tick()  # ... so this tick has rates over a real interval
    finally:
        sampling.sampler.stop()
        if sampling.pods is not None:
            sampling.pods.stop()
        sampling.uninstall()
    print(json.dumps(snapshot.to_json(), indent=2) if as_json else format_snapshot(snapshot))
    if not snapshot.nvml_up and settings.simulate is None:  # a simulated node without a driver is on purpose
        agent = find_local_agent(settings.web.listen_address, settings.control.socket)
        for line in no_nvml_hints(agent):
            print(f"gpuscope: {line}", file=sys.stderr)
    return EXIT_OK if snapshot.nvml_up else EXIT_FAILURE


def _fmt(value: float | None, scale: float = 1.0, spec: str = ".0f", suffix: str = "") -> str:
    return "-" if value is None else f"{value * scale:{spec}}{suffix}"


def format_snapshot(snapshot: Snapshot) -> str:
    """A human table: the GPUs, then their processes."""
    if not snapshot.nvml_up:
        return f"{snapshot.hostname}: NVML is not available (no NVIDIA driver?)"
    lines = [f"{snapshot.hostname}  driver {snapshot.driver_version}  {len(snapshot.gpus)} GPU(s)", ""]
    gpu_rows = [("GPU", "NAME", "UTIL", "SM", "MEM USED/TOTAL", "POWER", "TEMP", "PROCS", "DIPS", "STATE")]
    proc_rows = [("GPU", "PID", "PROCESS", "USER", "TYPE", "GPU MEM", "SM", "CONTAINER", "JOB")]
    gib = 1 / 2**30
    for g in snapshot.gpus:
        active = (g.clock_event_reasons or frozenset()) - {"gpu_idle"}
        state = ("up" + (f" ({','.join(sorted(active))})" if active else "")) if g.up else "LOST"
        gpu_rows.append((
            str(g.index), g.name or "?", _fmt(g.utilization_ratio, 100, ".0f", "%"),
            _fmt(g.sm_active_ratio, 100, ".0f", "%"),
            f"{_fmt(g.memory_used_bytes, gib, '.1f')}/{_fmt(g.memory_total_bytes, gib, '.0f')} GiB",
            _fmt(g.power_watts, 1, ".0f", " W"), _fmt(g.temperature_celsius, 1, ".0f", " C"),
            str(len(g.compute_processes)), _fmt(g.idle_dips_total, 1, "d"), state,
        ))
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


def _slurm_step(job: SlurmJob | None) -> str:
    """Slurm's own notation for a step (``4242.0``, ``4242.batch``), or ``-`` outside a job."""
    if job is None:
        return "-"
    return job.notation


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]

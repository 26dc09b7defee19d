"""Cost per sampling tick and per scrape against the node's size: GPUs, and processes per GPU.

Run: python bench/scaling.py [--gpus 1,8,16] [--processes 1,4,32] [--ticks 200] [--rounds 200] [--json]

For every combination, a simulated node (steady, busy H100s) with that many GPUs, each running that
many compute processes (MPS clients or time-sliced jobs), is sampled in this process over the fake
NVML library, as bench/tick.py does, and scraped as the agent's /metrics would be:

* tick: CPU time of this thread per ``Sampler.tick`` (median and p99), stepped as in bench/tick.py
  (a manual clock moved one interval before each tick, so each finds an interval's worth of driver
  samples, without waiting for real time). The sampler has the listeners the agent gives it by
  default: the alert engine with the default rules, and the status page's utilization history.
  As in the agent, gc.freeze() is called once set up; the p99 is where a full collection of what
  the sampler keeps (its per-GPU and per-process state) lands;
* scrape: wall time of collecting the agent's /metrics families (the snapshot's, with the default
  per-process settings, the alerts' and the process's own) and rendering them, text 0.0.4 and
  OpenMetrics (which a Prometheus asks for first), median over ``--rounds``, measured as in
  bench/scrape.py; the text body's size and its series (samples) count.

The processes are real: a ``sleep`` per simulated process, whose pid the scenario reports, so that
the per-process lookups (/proc, user name, container) run against live processes, as on a node.

The fake library is Python, where a real node's driver is C: a tick here is an upper bound of a
real node's on the same CPU. ``less fake`` is the mean wall time of a tick less the time spent
inside the fake library's functions (perf_counter around each call, over as many more ticks, as
bench/tick.py does): what pynvml's wrappers, gpuscope and its listeners cost, the part a real node
pays in Python (the timing's own overhead stays in it).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.process_collector import ProcessCollector
from scrape import timings_ms
from tick import ManualClock, running, split_ms, stepped_ticks, timing_fake

from gpuscope.alerts.engine import AlertEngine
from gpuscope.alerts.rules import build_rules
from gpuscope.config import Settings
from gpuscope.exporters.alerts import AlertCollector
from gpuscope.exporters.exposition import render_openmetrics, render_text
from gpuscope.exporters.prometheus import SnapshotCollector
from gpuscope.sampling.sampler import Sampler
from gpuscope.web.utilization_history import UtilizationHistory

INTERVAL = 1.0


def scenario_yaml(gpus: int, pids: list[list[int]]) -> str:
    """A steady busy node: ``gpus`` GPUs, GPU i running the processes ``pids[i]`` (1 GiB each)."""
    lines = [f"name: scaling-{gpus}x{len(pids[0])}", "duration: 5m", "seed: 7", "gpus:"]
    for index in range(gpus):
        lines.append(f"  - utilization: {{level: {0.9 - 0.01 * (index % 8):.2f}, noise: 0.03}}")
        lines.append("    processes:")
        lines += [f"      - {{name: job-{index}-{n}, pid: {pid}, memory: 1GiB}}"
                  for n, pid in enumerate(pids[index])]
    return "\n".join(lines) + "\n"


@contextmanager
def sleepers(count: int) -> Iterator[list[int]]:
    """``count`` live processes (``sleep``) to stand for the GPU processes; their pids."""
    processes = [subprocess.Popen(["sleep", "86400"]) for _ in range(count)]
    try:
        yield [p.pid for p in processes]
    finally:
        for p in processes:
            p.kill()
        for p in processes:
            p.wait()


def agent_listeners(sampler: Sampler, settings: Settings) -> AlertEngine:
    """What the agent adds to its sampler by default: the alert engine and the utilization history."""
    engine = AlertEngine(build_rules(settings.alerting.rules), hostname="bench")
    sampler.add_listener(engine.on_snapshot)
    sampler.add_listener(UtilizationHistory().observe)
    return engine


def measure(gpus: int, per_gpu: int, pids: list[int], args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    path = tmp / f"scaling-{gpus}x{per_gpu}.yaml"
    path.write_text(scenario_yaml(gpus, [pids[i * per_gpu:(i + 1) * per_gpu] for i in range(gpus)]))
    settings = Settings()
    clock = ManualClock(1.0)
    with running(str(path), INTERVAL, clock) as sampler:
        engine = agent_listeners(sampler, settings)
        # As the agent does once started: what lives as long as the process is out of the collector's
        # reach (the previous combination's leftovers are let go first).
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        for _ in range(args.warmup):
            clock.now += INTERVAL
            sampler.tick()
        ticks = sorted(stepped_ticks(sampler, clock, args.ticks, INTERVAL))
        with timing_fake() as spent:
            split = split_ms(stepped_ticks(sampler, clock, args.ticks, INTERVAL, time.perf_counter), spent)
        snapshot = sampler.latest()
        assert snapshot is not None and snapshot.nvml_up, "the simulated NVML did not come up"
        seen = {"gpus_seen": len(snapshot.gpus), "processes": sum(len(g.processes) for g in snapshot.gpus),
                "host_visible": sum(p.host_visible for g in snapshot.gpus for p in g.processes)}
        processes = settings.processes
        registry = CollectorRegistry(auto_describe=False)
        registry.register(SnapshotCollector(sampler, include_cmdline=processes.cmdline,
                                            include_processes=processes.export,
                                            process_labels=processes.labels,
                                            max_per_gpu=processes.max_per_gpu))
        registry.register(AlertCollector(engine))
        ProcessCollector(registry=registry)
        families = list(registry.collect())
        body = render_text(families)
        text = timings_ms(lambda: render_text(registry.collect()), args.rounds)
        openmetrics = timings_ms(lambda: render_openmetrics(registry.collect()), args.rounds)
    return {
        "gpus": gpus, "processes_per_gpu": per_gpu, **seen,
        "tick_cpu_ms_median": statistics.median(ticks),
        "tick_cpu_ms_p99": ticks[min(len(ticks) - 1, int(len(ticks) * 0.99))],
        "tick_wall_ms_mean": split["tick_ms"], "tick_fake_nvml_ms_mean": split["fake_ms"],
        "tick_real_node_ms_mean": split["real_node_ms"],
        "scrape_text_ms_median": text[0], "scrape_text_ms_p99": text[1],
        "scrape_openmetrics_ms_median": openmetrics[0], "scrape_openmetrics_ms_p99": openmetrics[1],
        "body_bytes": len(body),
        "series": sum(len(family.samples) for family in families),
        "families": len(families),
    }


HEADER = (f"{'GPUs':>4} {'procs/GPU':>9} {'procs':>6} {'tick ms':>8} {'p99':>8} {'less fake':>9} "
          f"{'scrape ms':>10} {'OpenMetrics':>11} {'body bytes':>11} {'series':>7}")


def format_row(r: dict[str, Any]) -> str:
    return (f"{r['gpus']:>4} {r['processes_per_gpu']:>9} {r['processes']:>6} {r['tick_cpu_ms_median']:>8.2f} "
            f"{r['tick_cpu_ms_p99']:>8.2f} {r['tick_real_node_ms_mean']:>9.2f} "
            f"{r['scrape_text_ms_median']:>10.2f} "
            f"{r['scrape_openmetrics_ms_median']:>11.2f} {r['body_bytes']:>11,} {r['series']:>7,}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", default="1,8,16", help="comma-separated GPU counts (default 1,8,16)")
    parser.add_argument("--processes", default="1,4,32",
                        help="comma-separated processes per GPU (default 1,4,32)")
    parser.add_argument("--ticks", type=int, default=200, help="stepped ticks measured (default 200)")
    parser.add_argument("--warmup", type=int, default=5, help="ticks before measuring (default 5)")
    parser.add_argument("--rounds", type=int, default=200, help="scrapes timed per format (default 200)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON only")
    args = parser.parse_args()
    gpu_counts = [int(n) for n in args.gpus.split(",")]
    per_gpu_counts = [int(n) for n in args.processes.split(",")]

    if not args.json:
        print(f"scaling: stepped ticks at {INTERVAL:g} s, Python {sys.version.split()[0]}; CPU ms per tick "
              "(this thread), collect+render ms per scrape (wall), text body", flush=True)
        print(HEADER, flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="gpuscope-scaling-") as tmp, \
            sleepers(max(gpu_counts) * max(per_gpu_counts)) as pids:
        for gpus in gpu_counts:
            for per_gpu in per_gpu_counts:
                started = time.monotonic()
                result = measure(gpus, per_gpu, pids, args, Path(tmp))
                result["seconds"] = round(time.monotonic() - started, 1)
                results.append(result)
                if not args.json:
                    print(format_row(result), flush=True)
                if result["gpus_seen"] != gpus:
                    print(f"note: {gpus} GPUs asked for, {result['gpus_seen']} seen", file=sys.stderr)
    if args.json:
        print(json.dumps({"python": sys.version.split()[0], "interval_s": INTERVAL, "results": results},
                         indent=2))


if __name__ == "__main__":
    main()

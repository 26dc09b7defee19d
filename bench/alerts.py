"""CPU per tick of the alert engine (``AlertEngine.observe``) on an 8-GPU node, all rules on.

    python bench/alerts.py                  # bench-8x4, 600 ticks timed after the windows filled
    python bench/alerts.py --ticks 2000 --scenario demo --json

Not a test: run by hand. The snapshots are made first, by the real sampler over the simulator
(``--scenario``, default ``bench-8x4``: 8 GPUs, 4 compute processes each, steady, input-bound,
ramping and 0.8-busy GPUs, so several alerts are pending or firing), one per simulated second.
Then a fresh engine with the default rules is fed ``--warmup`` snapshots (enough to fill the
longest window: 10 minutes, so every rule judges full windows) and each following ``observe`` is
timed with perf_counter (after gc.freeze(), as the agent does once started). Reported: median,
p99 and max per tick in µs, the share of each rule (timed separately, evaluate only) and of the
history update, and the alerts active at the end.

Target: at most 1 ms per tick for 8 GPUs with all rules.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

from gpuscope.alerts.engine import AlertEngine
from gpuscope.alerts.history import NodeHistory
from gpuscope.alerts.rules import RulesConfig, build_rules
from gpuscope.host.processes import ProcessInspector
from gpuscope.nvml.boundary import Nvml
from gpuscope.sampling.sampler import Sampler
from gpuscope.simulate import Simulation, load_scenario
from gpuscope.snapshot import Snapshot


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_snapshots(scenario: str, count: int) -> list[Snapshot]:
    clock = ManualClock()
    sim = Simulation(load_scenario(scenario), clock=clock, spawn_processes=False)
    sim.install()
    try:
        sampler = Sampler(Nvml(clock=clock), ProcessInspector(host_pid_namespace=True), clock=clock,
                          wall_clock=lambda: 1.7e9 + clock.now)
        snapshots = []
        for _ in range(count):
            snapshots.append(sampler.tick())
            clock.now += 1.0
        sampler.stop()
        return snapshots
    finally:
        sim.uninstall()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(snapshots: list[Snapshot], warmup: int) -> dict[str, Any]:
    engine = AlertEngine(build_rules(RulesConfig()), hostname="bench")
    for snap in snapshots[:warmup]:
        engine.observe(snap)
    per_tick = []
    for snap in snapshots[warmup:]:
        started = time.perf_counter()
        engine.observe(snap)
        per_tick.append((time.perf_counter() - started) * 1e6)

    # The split: the history update, then each rule's evaluate alone (same snapshots, fresh objects).
    history = NodeHistory(engine.history.longest_window_seconds, engine.history.span_windows)
    split: dict[str, list[float]] = {"history.observe": []} | {r.name: [] for r in engine.rules}
    for i, snap in enumerate(snapshots):
        started = time.perf_counter()
        history.observe(snap)
        elapsed = time.perf_counter() - started
        if i < warmup:
            continue
        split["history.observe"].append(elapsed * 1e6)
        for rule in engine.rules:
            started = time.perf_counter()
            rule.evaluate(history, frozenset())
            split[rule.name].append((time.perf_counter() - started) * 1e6)
    return {
        "gpus": len(snapshots[-1].gpus),
        "rules": len(engine.rules),
        "ticks_timed": len(per_tick),
        "observe_us": {"median": statistics.median(per_tick), "p99": percentile(per_tick, 0.99),
                       "max": max(per_tick), "mean": statistics.fmean(per_tick)},
        "split_median_us": {k: statistics.median(v) for k, v in split.items()},
        "active_alerts": sorted(f"{a.name}@{a.gpu}:{a.state}" for a in engine.alerts()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="bench-8x4")
    parser.add_argument("--ticks", type=int, default=600, help="timed ticks")
    parser.add_argument("--warmup", type=int, default=660, help="ticks fed first (fill 10m windows)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    snapshots = make_snapshots(args.scenario, args.warmup + args.ticks)
    # As the agent does after start-up (agent.py): the long-lived objects (here, the prepared
    # snapshots) out of the collector's reach, so collections cost what the engine's garbage costs.
    gc.collect()
    gc.freeze()
    result = run(snapshots, args.warmup)
    result["scenario"] = args.scenario
    if args.json:
        print(json.dumps(result, indent=2))
        return
    o = result["observe_us"]
    print(f"{result['scenario']}: {result['gpus']} GPUs, {result['rules']} rules, "
          f"{result['ticks_timed']} ticks timed")
    print(f"AlertEngine.observe per tick: median {o['median']:.0f} µs, p99 {o['p99']:.0f} µs, "
          f"max {o['max']:.0f} µs, mean {o['mean']:.0f} µs (target <= 1000 µs)")
    print("median per part (µs):")
    for name, us in result["split_median_us"].items():
        print(f"  {name:24} {us:7.1f}")
    print("active at the end:", ", ".join(result["active_alerts"]) or "none")


if __name__ == "__main__":
    main()

"""What a sampling tick costs beyond the NVML calls it makes, on a real NVML library (not a test).

    python bench/nvml_floor.py --nvml-lib DIR [--seconds 30]    # DIR holds libnvidia-ml.so.1
    python bench/nvml_floor.py                                  # the node's own NVML

Any agent that reads these values pays for the calls; what gpuscope adds on top (pynvml's wrappers
are counted with the calls) is its own. This runs the real sampler in this process and records,
through pynvml, the calls one of its ticks makes (the steady state: after 12 ticks, when what a GPU
does not support is no longer asked, and the Xid watcher knows whether the library's event wait
polls, in which case each tick checks for Xid events). Then, every 1.5 s, in turns half a second
apart:

* ``tick``: the sampler's tick, as the agent's sampler thread runs it (listeners aside: the alert
  rules cost another 0.2-0.3 ms for 8 GPUs per evaluation, see ``bench/alerts.py``), with the
  energy counter, the utilization samples and the GPM samples read every ``nvml.energy_interval``,
  ``nvml.samples_interval`` and ``nvml.gpm_interval`` as in the agent (the median tick reads none
  of them; the mean includes them);
* ``calls``: the recorded calls replayed as they were made, with nothing around them: the floor;
* each call on its own, timed: the CPU each NVML function costs on this driver (the energy
  counter's and the samples' reads included, whether or not the recorded tick made them).

All are CPU time of this thread (``time.thread_time``), medians over ``--seconds``. A library does
more for the first call on a GPU after a pause than for the next ones (NVIDIA's mock library, in
Go, refreshes its state; a driver has its own caches), which a tick always pays once a second: the
``calls, back to back`` figure repeats the replay at once, to show that part.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Ticks (one a second) before the calls are recorded: the Xid watcher's first event wait (10 s) tells
# whether the library's wait polls, and then the sampler checks for Xid events each tick.
WARMUP_TICKS = 12
# Read once per interval of their own, not every tick (nvml.energy_interval, nvml.samples_interval).
INTERVAL_READS = frozenset({"nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetSamples",
                            "nvmlDeviceGetViolationStatus", "nvmlDeviceGetNvLinkState",
                            "nvmlGpmSampleGet", "nvmlGpmMetricsGet"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvml-lib", metavar="DIR", help="directory holding the libnvidia-ml.so.1 to use")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds measured (default 30)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    if args.nvml_lib and os.environ.get("_GPUSCOPE_FLOOR_LIB") != args.nvml_lib:
        # The dynamic loader reads LD_LIBRARY_PATH when the process starts: run again with it set.
        lib = str(Path(args.nvml_lib).resolve())
        env = {**os.environ, "_GPUSCOPE_FLOOR_LIB": args.nvml_lib,
               "LD_LIBRARY_PATH": os.pathsep.join(p for p in (lib, os.environ.get("LD_LIBRARY_PATH")) if p)}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    return measure(args.seconds, args.json)


def measure(seconds: float, as_json: bool) -> int:
    import pynvml

    from gpuscope.config import NvmlConfig
    from gpuscope.host.processes import ProcessInspector
    from gpuscope.nvml.boundary import Nvml
    from gpuscope.sampling.sampler import Sampler

    nvml = Nvml()
    # As the agent runs it: the energy counter and the utilization samples read every
    # nvml.energy_interval and nvml.samples_interval, not every tick.
    defaults = NvmlConfig()
    sampler = Sampler(nvml, ProcessInspector(), energy_interval_seconds=defaults.energy_interval,
                      samples_interval_seconds=defaults.samples_interval,
                      health_interval_seconds=defaults.health_interval,
                      throttle_interval_seconds=defaults.throttle_interval,
                      gpm_interval_seconds=defaults.gpm_interval)
    for _ in range(WARMUP_TICKS):
        snapshot = sampler.tick()
        time.sleep(1.0)
    if not snapshot.nvml_up:
        raise SystemExit("NVML is not available: is DIR/libnvidia-ml.so.1 there, or a driver installed?")
    if not snapshot.gpus:
        raise SystemExit("NVML lists no GPU")
    calls = record_calls(pynvml, sampler.tick)
    # Each call a tick can make, once per function and first argument: the ticks that read the
    # energy counter and the samples are recorded too (one every few seconds), for the per-call figures.
    timed = {(name, id(args[0]) if args else 0): (name, args) for name, args in calls}
    longest = max(defaults.energy_interval, defaults.samples_interval, defaults.health_interval,
                  defaults.throttle_interval, defaults.gpm_interval)
    for _ in range(int(longest) + 1):
        if {name for name, _ in timed.values()} >= INTERVAL_READS:
            break
        time.sleep(1.0)
        for name, args in record_calls(pynvml, sampler.tick):
            timed.setdefault((name, id(args[0]) if args else 0), (name, args))
    per_call: dict[str, list[float]] = {}
    tick, replayed, warm = [], [], []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.5)
        started = time.thread_time()
        sampler.tick()
        tick.append(time.thread_time() - started)
        time.sleep(0.5)
        started = time.thread_time()
        replay(pynvml, calls)
        replayed.append(time.thread_time() - started)
        started = time.thread_time()
        replay(pynvml, calls)
        warm.append(time.thread_time() - started)
        time.sleep(0.5)  # each call as a tick finds it: after a pause
        time_each(pynvml, list(timed.values()), per_call)
    sampler.stop()
    nvml.shutdown()

    gpus = len(snapshot.gpus)
    figures: dict[str, Any] = {
        "gpus": gpus,
        "calls_per_tick": len(calls),
        "calls_by_function": dict(Counter(name for name, _ in calls).most_common()),
        "ticks": len(tick),
        "tick_ms": statistics.median(tick) * 1e3,
        "tick_mean_ms": statistics.mean(tick) * 1e3,
        "calls_ms": statistics.median(replayed) * 1e3,
        "calls_back_to_back_ms": statistics.median(warm) * 1e3,
    }
    figures["gpuscope_ms"] = figures["tick_ms"] - figures["calls_ms"]
    # CPU per call of each function, median (one call's own cost, timer included: read the larger ones).
    by_cost = sorted(per_call.items(), key=lambda kv: -statistics.median(kv[1]))
    figures["call_ms_by_function"] = {name: round(statistics.median(times) * 1e3, 4)
                                      for name, times in by_cost}
    if as_json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"{gpus} GPU(s), {len(calls)} NVML calls per tick ({len(calls) / gpus:.1f} per GPU), "
          f"{len(tick)} ticks; CPU of this thread per tick, median:")
    print(f"  tick                       {figures['tick_ms']:6.3f} ms "
          f"(mean {figures['tick_mean_ms']:.3f}: with the energy counter's and samples' reads)")
    print(f"  calls (the floor)          {figures['calls_ms']:6.3f} ms")
    print(f"  calls, back to back        {figures['calls_back_to_back_ms']:6.3f} ms")
    print(f"  gpuscope's own (tick - calls) {figures['gpuscope_ms']:6.3f} ms "
          f"({figures['gpuscope_ms'] / gpus * 1e3:.0f} us per GPU)")
    print("  calls: " + ", ".join(f"{name} x{n}" for name, n in figures["calls_by_function"].items()))
    print("  CPU per call, median: " + ", ".join(
        f"{name} {ms:.3f} ms" for name, ms in figures["call_ms_by_function"].items()))
    return 0


# Calls the boundary makes on NVML's C function itself, past pynvml's wrapper (a field-values array
# made once and filled every tick): recorded and replayed under this name, through the same function.
_DIRECT = "nvmlDeviceGetFieldValues (array reused)"
_direct_calls: dict[str, Callable[..., Any]] = {}


def _function(pynvml: Any, name: str) -> Callable[..., Any]:
    return _direct_calls.get(name) or getattr(pynvml, name)


def record_calls(pynvml: Any, tick: Callable[[], object]) -> list[tuple[str, tuple[Any, ...]]]:
    """The pynvml functions (and their arguments) that one call of ``tick`` makes, in order."""
    from gpuscope.nvml import health

    calls: list[tuple[str, tuple[Any, ...]]] = []
    originals = {name: value for name, value in vars(pynvml).items()
                 if name.startswith(("nvmlDevice", "nvmlGpm", "nvmlEvent")) and callable(value)}
    direct = _direct_calls.setdefault(_DIRECT, health.fill_field_values)

    depth = [0]  # pynvml's functions call each other (a version's wrapper): the outermost call only
    caller = threading.get_ident()  # not the Xid watcher's thread, waiting for events meanwhile

    def recording(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            if threading.get_ident() != caller:
                return function(*args)
            if not depth[0]:
                calls.append((name, args))
            depth[0] += 1
            try:
                return function(*args)
            finally:
                depth[0] -= 1
        return call

    for name, function in originals.items():
        setattr(pynvml, name, recording(name, function))
    health.fill_field_values = recording(_DIRECT, direct)  # type: ignore[assignment]
    try:
        tick()
    finally:
        for name, function in originals.items():
            setattr(pynvml, name, function)
        health.fill_field_values = direct  # type: ignore[assignment]
    return calls


def replay(pynvml: Any, calls: list[tuple[str, tuple[Any, ...]]]) -> None:
    for name, args in calls:
        # Not contextlib.suppress: its enter and exit would be counted as the calls' cost.
        try:  # noqa: SIM105
            _function(pynvml, name)(*args)
        except pynvml.NVMLError:
            pass  # as in the boundary: a failing reading costs its call all the same


def time_each(pynvml: Any, calls: list[tuple[str, tuple[Any, ...]]],
              per_call: dict[str, list[float]]) -> None:
    """Each call made on its own and timed, by function."""
    for name, args in calls:
        started = time.thread_time()
        try:  # noqa: SIM105
            _function(pynvml, name)(*args)
        except pynvml.NVMLError:
            pass
        per_call.setdefault(name, []).append(time.thread_time() - started)


if __name__ == "__main__":
    raise SystemExit(main())

"""CPU per sampler tick on a simulated 8-GPU node, 4 processes per GPU (not a test: run by hand).

    python bench/tick.py                       # the defaults: about a minute
    python bench/tick.py --ticks 120 --json    # longer, machine-readable

Runs the real sampler and the real pynvml wrappers in this process over the fake NVML library
(``--simulate``'s code path), helper processes spawned as in ``--simulate``, and reports CPU time:
- paced: one tick per ``--interval`` seconds of real time, as in production, so that each tick
  finds an interval's worth of new driver samples, and runs with the caches as cold as a once-a-
  second thread finds them. Per tick: the sampler thread's CPU (``time.thread_time``) and the
  process's (``time.process_time``); over the whole window, the process CPU per interval, which
  adds what other threads (the Xid event wait) burn between ticks;
- stepped: the same work per tick, back to back: the simulation clock (and the sampler's) is a
  manual one moved by ``--interval`` before each tick. The least noisy figure; compare versions
  with it, and with ``paced`` for what production pays;
- back-to-back: real-time ticks with no pause: nothing new in the driver's buffers, the fixed cost;
- the split between the fake library (on a real node the driver does that work in C, outside
  Python) and the rest, what a real node pays (pynvml's wrappers, gpuscope): measured directly by
  timing every call into the fake's C functions (perf_counter around each; those ticks are timed
  with perf_counter too), over stepped ticks and over paced ones;
- a cProfile of paced ticks, split by module: ``gpuscope.simulate`` (the fake), ``pynvml`` (the
  bindings' wrappers) and gpuscope's own modules (the NVML boundary, the sampler, the process
  lookups). Time in builtins and the standard library (ctypes, locks, generated dataclass
  __init__) and in pynvml's structure field accessors goes to the nearest caller that is one of
  those. Profiling inflates short calls, so read the shares, not the milliseconds.

On a small shared VM the paced figures vary by tens of percent from run to run; compare versions
with the stepped ones, and several runs of each.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pynvml

import gpuscope
import gpuscope.simulate
from gpuscope.config import NvmlConfig
from gpuscope.host.processes import ProcessInspector
from gpuscope.nvml.boundary import Nvml
from gpuscope.sampling.sampler import Sampler
from gpuscope.simulate import Simulation, load_scenario

_SIMULATE = str(Path(gpuscope.simulate.__path__[0]).resolve())
_GPUSCOPE = str(Path(gpuscope.__path__[0]).resolve())
_PYNVML = str(Path(pynvml.__file__).resolve())
FAKE, PYNVML, OTHER = "fake NVML (gpuscope.simulate)", "pynvml wrappers", "unattributed"
AGENT_PREFIX = "agent: "
# pynvml's structures read and write their fields through these Python methods: the cost belongs
# to whoever touches the field (the fake library filling a result, the boundary reading it).
_PASSTHROUGH = frozenset({"__getattribute__", "__setattr__"})


def _category(filename: str, name: str) -> str | None:
    if filename.startswith(("<", "~")):  # builtins, generated dataclass __init__: the caller's
        return None
    path = os.path.realpath(filename)
    if path.startswith(_SIMULATE + os.sep):
        return FAKE
    if path == _PYNVML:
        return PYNVML if name not in _PASSTHROUGH else None
    if path.startswith(_GPUSCOPE + os.sep):
        return AGENT_PREFIX + os.path.relpath(path, _GPUSCOPE)
    return None  # standard library, psutil, pydantic: the caller's


def split(stats: pstats.Stats) -> dict[str, float]:
    """Seconds of profiled self time per category, builtins attributed through their callers."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    memo: dict[Any, dict[str, float]] = {}

    def shares(func: Any) -> dict[str, float]:
        if func in memo:
            return memo[func]
        cat = _category(func[0], func[2])
        if cat is not None:
            memo[func] = {cat: 1.0}
            return memo[func]
        memo[func] = {OTHER: 1.0}  # cycle guard while the callers are resolved
        callers = raw[func][4] if func in raw else {}
        weights = {c: edge[2] for c, edge in callers.items()}
        if not any(weights.values()):
            weights = {c: float(edge[0]) for c, edge in callers.items()}
        total = sum(weights.values())
        if not total:
            return memo[func]
        out: dict[str, float] = {}
        for caller, weight in weights.items():
            for cat, frac in shares(caller).items():
                out[cat] = out.get(cat, 0.0) + frac * weight / total
        memo[func] = out
        return out

    seconds: dict[str, float] = {}
    for func, (_cc, _nc, tt, _ct, _callers) in raw.items():
        for cat, frac in shares(func).items():
            seconds[cat] = seconds.get(cat, 0.0) + tt * frac
    return seconds


class ManualClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@contextmanager
def running(scenario: str, interval: float, clock: Callable[[], float] | None = None) -> Iterator[Sampler]:
    """A sampler over an installed simulation; ``clock`` (manual) drives both, or real time."""
    sim = Simulation(load_scenario(scenario), clock=clock)
    sim.install()
    timing: dict[str, Any] = {} if clock is None else {"clock": clock}
    # The health and throttle readings on the agent's own intervals (nvml.health_interval,
    # nvml.throttle_interval); the energy counter and the utilization samples every tick.
    defaults = NvmlConfig()
    sampler = Sampler(Nvml(**timing), ProcessInspector(), interval_seconds=interval,
                      health_interval_seconds=defaults.health_interval,
                      throttle_interval_seconds=defaults.throttle_interval, **timing)
    try:
        yield sampler
    finally:
        sampler.stop()
        sim.uninstall()


def paced_ticks(
    sampler: Sampler, ticks: int, interval: float, profiler: cProfile.Profile | None = None,
) -> tuple[list[float], list[float], float, list[float]]:
    """Per tick thread CPU and process CPU (ms), the process CPU (ms) per interval overall, and per
    tick the wall time (ms)."""
    thread_ms, process_ms, wall_ms = [], [], []
    window_cpu0, window_t0 = time.process_time(), time.monotonic()
    next_at = time.monotonic()
    for _ in range(ticks):
        next_at += interval
        time.sleep(max(0.0, next_at - time.monotonic()))
        p0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
        if profiler is not None:
            profiler.enable()
        sampler.tick()
        if profiler is not None:
            profiler.disable()
        wall_ms.append((time.perf_counter() - w0) * 1000)
        thread_ms.append((time.thread_time() - t0) * 1000)
        process_ms.append((time.process_time() - p0) * 1000)
    window_ms = (time.process_time() - window_cpu0) * 1000
    intervals = (time.monotonic() - window_t0) / interval
    return thread_ms, process_ms, window_ms / intervals, wall_ms


@contextmanager
def timing_fake() -> Iterator[dict[str, float]]:
    """Time the calls this thread (the ticking one) makes into the installed fake library's C
    functions: yields {"seconds", "calls"}. The Xid thread's calls (a blocking wait) are not counted."""
    lib = pynvml.nvmlLib
    spent = {"seconds": 0.0, "calls": 0.0}
    clock = time.perf_counter  # cheap (thread_time is a system call): these ticks are timed by it too
    ticking = threading.get_ident()

    def timed(fn: Callable[..., int]) -> Callable[..., int]:
        def call(*args: Any) -> int:
            if threading.get_ident() != ticking:
                return fn(*args)
            t0 = clock()
            try:
                return fn(*args)
            finally:
                spent["seconds"] += clock() - t0
                spent["calls"] += 1

        return call

    names = [name for name in dir(type(lib)) if name.startswith("nvml")]
    for name in names:  # instance attributes shadow the class's methods, for pynvml's getattr
        setattr(lib, name, timed(getattr(lib, name)))
    pynvml._nvmlGetFunctionPointer_cache.clear()  # pynvml caches the functions it looked up
    try:
        yield spent
    finally:
        for name in names:
            delattr(lib, name)
        pynvml._nvmlGetFunctionPointer_cache.clear()


def split_ms(ticks_ms: list[float], spent: dict[str, float]) -> dict[str, float]:
    ticks = len(ticks_ms)
    fake = spent["seconds"] * 1000 / ticks
    total = statistics.mean(ticks_ms)
    return {"tick_ms": total, "fake_ms": fake, "real_node_ms": total - fake,
            "fake_calls_per_tick": spent["calls"] / ticks}


def stepped_ticks(sampler: Sampler, clock: ManualClock, ticks: int, interval: float,
                  timer: Callable[[], float] = time.thread_time) -> list[float]:
    out = []
    for _ in range(ticks):
        clock.now += interval
        t0 = timer()
        sampler.tick()
        out.append((timer() - t0) * 1000)
    return out


def stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"mean": statistics.mean(values), "median": statistics.median(values),
            "p90": ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]}


def summarize(per_tick_ms: dict[str, float], paced_cpu_ms: float) -> dict[str, Any]:
    total = sum(per_tick_ms.values()) or 1.0
    fake = per_tick_ms.get(FAKE, 0.0)
    agent = {k[len(AGENT_PREFIX):]: v for k, v in per_tick_ms.items() if k.startswith(AGENT_PREFIX)}
    agent_total = sum(agent.values())
    wrappers = per_tick_ms.get(PYNVML, 0.0)
    other = per_tick_ms.get(OTHER, 0.0)
    real_node = agent_total + wrappers + other
    return {
        "profiled_ms_per_tick": total,
        "fake_ms": fake,
        "pynvml_ms": wrappers,
        "agent_ms": agent_total,
        "agent_by_module_ms": dict(sorted(agent.items(), key=lambda kv: -kv[1])),
        "unattributed_ms": other,
        "fake_share": fake / total,
        "real_node_share": real_node / total,
        "paced_fake_ms_estimate": paced_cpu_ms * fake / total,
        "paced_real_node_ms_estimate": paced_cpu_ms * real_node / total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="bench-8x4")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds per tick (default 1)")
    parser.add_argument("--ticks", type=int, default=30, help="paced ticks measured (default 30)")
    parser.add_argument("--stepped", type=int, default=300, help="stepped ticks measured (default 300)")
    parser.add_argument("--back-to-back", type=int, default=300, help="unpaced ticks (default 300)")
    parser.add_argument("--profile-ticks", type=int, default=10, help="paced ticks profiled (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="ticks before measuring (default 3)")
    parser.add_argument("--top", type=int, default=0, help="print this many profile rows (default 0)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON only")
    args = parser.parse_args()

    # Stepped: a manual clock for the simulation and the sampler, moved one interval per tick.
    clock = ManualClock(1.0)
    with running(args.scenario, args.interval, clock) as sampler:
        for _ in range(args.warmup):
            clock.now += args.interval
            sampler.tick()
        stepped = stepped_ticks(sampler, clock, args.stepped, args.interval)
        with timing_fake() as spent:
            stepped_split = split_ms(
                stepped_ticks(sampler, clock, args.stepped, args.interval, time.perf_counter), spent)

    with running(args.scenario, args.interval) as sampler:
        for _ in range(args.warmup):  # NVML init, enumeration, first GPM sample, pid cache filled
            sampler.tick()
            time.sleep(args.interval)
        snap = sampler.latest()
        assert snap is not None and snap.nvml_up, "the simulated NVML did not come up"
        shape = {"gpus": len(snap.gpus), "processes": sum(len(g.processes) for g in snap.gpus)}
        thread_ms, process_ms, per_interval_ms, _ = paced_ticks(sampler, args.ticks, args.interval)
        cpu0 = time.process_time()
        for _ in range(args.back_to_back):
            sampler.tick()
        b2b_ms = (time.process_time() - cpu0) * 1000 / args.back_to_back
        with timing_fake() as spent:
            paced_split = split_ms(paced_ticks(sampler, args.profile_ticks, args.interval)[3], spent)
        profiler = cProfile.Profile()
        paced_ticks(sampler, args.profile_ticks, args.interval, profiler)

    per_tick = {cat: s * 1000 / args.profile_ticks for cat, s in split(pstats.Stats(profiler)).items()}
    thread, stepped_stats = stats(thread_ms), stats(stepped)
    paced: dict[str, Any] = {"thread_cpu_ms": thread, "process_cpu_ms": stats(process_ms),
                             "process_cpu_ms_per_interval": per_interval_ms}
    prof = summarize(per_tick, thread["mean"])
    result: dict[str, Any] = {
        "python": sys.version.split()[0], "scenario": args.scenario, "interval_s": args.interval, **shape,
        "paced": paced, "stepped_cpu_ms": stepped_stats, "back_to_back_cpu_ms": b2b_ms,
        "split_stepped": stepped_split, "split_paced": paced_split, "profile": prof,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    if args.top:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
        print(text.getvalue())
    st = stepped_stats
    print(f"{args.scenario}: {shape['gpus']} GPUs, {shape['processes']} processes, one tick per "
          f"{args.interval:g} s, Python {result['python']}; CPU ms per tick")
    print(f"  paced, {args.ticks} ticks:        mean {thread['mean']:6.3f}  "
          f"median {thread['median']:6.3f}  p90 {thread['p90']:6.3f}  (sampler thread)")
    print(f"    process CPU per interval:   {per_interval_ms:6.3f}  (ticks + other threads)")
    print(f"  stepped, {args.stepped} ticks:      mean {st['mean']:6.3f}  median {st['median']:6.3f}  "
          f"p90 {st['p90']:6.3f}")
    print(f"  back-to-back, {args.back_to_back} ticks: mean {b2b_ms:6.3f}  (nothing new in the buffers)")
    splits = (("stepped", stepped_split, args.stepped), ("paced", paced_split, args.profile_ticks))
    for label, sp, n in splits:
        print(f"  timed split, {label} ({n} ticks, {sp['fake_calls_per_tick']:.0f} fake calls/tick): "
              f"tick {sp['tick_ms']:.3f} = fake NVML {sp['fake_ms']:.3f} + real-node part (pynvml + "
              f"gpuscope) {sp['real_node_ms']:.3f}")
    print(f"  profile of {args.profile_ticks} paced ticks ({prof['profiled_ms_per_tick']:.2f} ms/tick "
          "under cProfile), share of the time:")
    total = prof["profiled_ms_per_tick"] or 1.0
    print(f"    fake NVML (the driver's C on a real node)  {100 * prof['fake_ms'] / total:5.1f} %")
    print(f"    pynvml wrappers                            {100 * prof['pynvml_ms'] / total:5.1f} %")
    print(f"    gpuscope                                   {100 * prof['agent_ms'] / total:5.1f} %")
    for module, ms in prof["agent_by_module_ms"].items():
        print(f"      {module:<40} {100 * ms / total:5.1f} %")
    if prof["unattributed_ms"]:
        print(f"    unattributed{'':<31}{100 * prof['unattributed_ms'] / total:5.1f} %")
    print(f"  paced tick split by those shares: fake {prof['paced_fake_ms_estimate']:.3f} ms, "
          f"real-node part {prof['paced_real_node_ms_estimate']:.3f} ms")


if __name__ == "__main__":
    main()

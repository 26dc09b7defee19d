"""Microbenchmark: µs per ProcessInspector.describe for 32 live pids, cached and uncached.

Run: python bench/process_lookup.py [--pids 32] [--rounds 2000]

"cached" is the per-tick cost the sampler pays for a process it has seen before, once with a pidfd
(the default) and once with the start-time check it falls back to; "uncached" is the first sight
(psutil name/username, the cgroup file, two stat reads). For comparison it also times the check
psutil would give: building a psutil.Process, which reads the process's create time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from gpuscope.host.processes import ProcessInspector


def spawn_sleepers(count: int) -> list[subprocess.Popen[bytes]]:
    procs = [subprocess.Popen(["sleep", "600"]) for _ in range(count)]
    for proc in procs:  # wait for each exec, so that "sleep" is what gets described
        while Path(f"/proc/{proc.pid}/cmdline").read_bytes() != b"sleep\x00600\x00":
            time.sleep(0.001)
    return procs


def per_call_us(action: Callable[[], None], calls_per_action: int, rounds: int) -> float:
    action()  # warm up
    started = time.perf_counter()
    for _ in range(rounds):
        action()
    return (time.perf_counter() - started) / (rounds * calls_per_action) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pids", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()

    procs = spawn_sleepers(args.pids)
    pids = [proc.pid for proc in procs]
    try:
        for label, pidfd_open in (("pidfd", os.pidfd_open), ("start-time", None)):
            inspector = ProcessInspector(pidfd_open=pidfd_open)

            def describe_all(inspector: ProcessInspector = inspector) -> None:
                for pid in pids:
                    inspector.describe(pid)

            def describe_all_fresh(inspector: ProcessInspector = inspector) -> None:
                inspector.close()  # empties the cache, so every describe reads afresh
                describe_all(inspector)

            cached = per_call_us(describe_all, len(pids), args.rounds)
            uncached = per_call_us(describe_all_fresh, len(pids), max(args.rounds // 50, 5))
            inspector.close()
            print(f"{label:>10}: cached {cached:8.2f} µs/describe   uncached {uncached:8.1f} µs/describe")

        def construct_all() -> None:
            for pid in pids:
                psutil.Process(pid)

        psutil_check = per_call_us(construct_all, len(pids), 200)
        print(f"{'psutil':>10}: Process(pid), i.e. its create_time check, {psutil_check:.1f} µs")
        print(f"({len(pids)} pids, {os.cpu_count()} CPUs)")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()

"""Agent overhead on a simulated 8-GPU node with 4 processes per GPU (not a test: run by hand).

    python bench/overhead.py                      # 1 s and 0.1 s intervals, 60 s each
    python bench/overhead.py --duration 600 --intervals 1   # the 10-minute RSS-growth run

Starts `gpuscope run --simulate bench-8x4` as a subprocess and reports, per interval:
- CPU seconds per tick (the agent process's user+system time over the run / ticks), unscraped, then
  while scraped once per second (the usual Prometheus load is one scrape per 15-30 s);
- RSS: after warm-up, peak, at the end, and the growth between the first and last minute;
- /metrics latency (p50/p99) over loopback, text format and OpenMetrics.
The simulated NVML runs inside the agent process, so its CPU counts in the figures: they are an
upper bound of what the agent itself costs on the same Python (real NVML calls are C calls).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import Any

import psutil
from local_agent import free_port, stop, wait_ready

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"



def get(url: str, accept: str | None = None) -> float:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=5) as response:
        response.read()
    return time.perf_counter() - started



def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(interval: float, duration: float, scenario: str) -> dict[str, Any]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    agent = subprocess.Popen(
        [sys.executable, "-m", "gpuscope", "run", "--simulate", scenario, "--log-level", "warning",
         "--web.listen-address", f"127.0.0.1:{port}", "--sample-interval", str(interval)],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        proc = psutil.Process(agent.pid)
        wait_ready(base)
        time.sleep(max(3.0, 5 * interval))  # warm-up: caches filled, first GPM pair taken
        rss_start = proc.memory_info().rss

        # 1) sampling alone, unscraped.
        cpu0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
        rss: list[tuple[float, int]] = []
        while time.monotonic() - t0 < duration:
            time.sleep(1.0)
            rss.append((time.monotonic() - t0, proc.memory_info().rss))
        cpu1, t1 = sum(proc.cpu_times()[:2]), time.monotonic()
        ticks = (t1 - t0) / interval
        per_tick = (cpu1 - cpu0) / ticks

        # 2) the same with one scrape per second (a far heavier load than Prometheus' usual 15-30 s).
        cpu2, t2 = sum(proc.cpu_times()[:2]), time.monotonic()
        text, om = [], []
        while time.monotonic() - t2 < min(duration, 60.0):
            text.append(get(base + "/metrics"))
            om.append(get(base + "/metrics", OPENMETRICS))
            time.sleep(max(0.0, 1.0 - text[-1] - om[-1]))
        cpu3, t3 = sum(proc.cpu_times()[:2]), time.monotonic()
        scraped_per_tick = (cpu3 - cpu2) / ((t3 - t2) / interval)

        # 3) latency under no other load: back-to-back scrapes.
        burst_text = [get(base + "/metrics") for _ in range(300)]
        burst_om = [get(base + "/metrics", OPENMETRICS) for _ in range(300)]

        minute = max(1, min(60, len(rss) // 4))
        first = statistics.mean(r for _, r in rss[:minute])
        last = statistics.mean(r for _, r in rss[-minute:])
        snapshot = json.loads(urllib.request.urlopen(base + "/api/v1/snapshot", timeout=5).read())
        return {
            "interval_s": interval,
            "duration_s": round(t1 - t0, 1),
            "gpus": len(snapshot["gpus"]),
            "processes": sum(len(g["processes"]) for g in snapshot["gpus"]),
            "cpu_ms_per_tick": round(per_tick * 1000, 3),
            "cpu_core_percent": round(100 * (cpu1 - cpu0) / (t1 - t0), 3),
            "cpu_ms_per_tick_scraped_1hz": round(scraped_per_tick * 1000, 3),
            "sample_duration_ms_last_tick": round(snapshot["sample_duration_seconds"] * 1000, 3),
            "rss_mib_after_warmup": round(rss_start / 2**20, 1),
            "rss_mib_peak": round(max(r for _, r in rss) / 2**20, 1),
            "rss_mib_end": round(rss[-1][1] / 2**20, 1),
            "rss_growth_mib_first_to_last_window": round((last - first) / 2**20, 2),
            # One reading per minute: a cache filling up flattens out, a leak keeps climbing.
            "rss_mib_by_minute": [round(r / 2**20, 1) for t, r in rss if int(t) % 60 == 0 or t == rss[-1][0]],
            "metrics_text_ms_p50": round(percentile(burst_text, 0.5) * 1000, 2),
            "metrics_text_ms_p99": round(percentile(burst_text, 0.99) * 1000, 2),
            "metrics_openmetrics_ms_p50": round(percentile(burst_om, 0.5) * 1000, 2),
            "metrics_openmetrics_ms_p99": round(percentile(burst_om, 0.99) * 1000, 2),
            "metrics_text_ms_p99_while_sampling_1hz": round(percentile(text, 0.99) * 1000, 2),
        }
    finally:
        stop(agent, 5)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per interval (default 60)")
    parser.add_argument("--intervals", default="1,0.1", help="comma-separated sample intervals (s)")
    parser.add_argument("--scenario", default="bench-8x4")
    args = parser.parse_args()
    results = [measure(float(i), args.duration, args.scenario) for i in args.intervals.split(",")]
    print(json.dumps({"cpu": psutil.cpu_count(), "python": sys.version.split()[0], "results": results},
                     indent=2))


if __name__ == "__main__":
    main()

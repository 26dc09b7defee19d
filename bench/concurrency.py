"""Many Prometheus servers scraping one agent at once (not a test: run by hand).

    python bench/concurrency.py                  # 50 scrapers, 20 s, every mode
    python bench/concurrency.py --scrapers 200 --duration 60 --mode burst

Starts `gpuscope run --simulate demo` as a subprocess and runs ``--scrapers`` client threads against
its /metrics on loopback, each on its own connection per request (as Prometheus does after the
agent closes one), in three modes:

- ``paced``: every scraper asks once a second, each at its own offset within the second (Prometheus
  spreads its targets' scrapes over the interval the same way): 50 scrapes a second;
- ``burst``: every scraper asks once a second, all in the same instant (the worst alignment of
  scrape intervals): 50 connections arrive together every second, and the last waits for the 49
  before it (one Python process renders one at a time);
- ``flood``: every scraper asks again as soon as it has its answer (a load far beyond any real
  one): what the agent sustains, and whether ``web.max_requests`` (64) and the listen backlog hold.

Reported per mode: requests, errors (a refused or reset connection, a timeout, or any status but
200; the goal is none), 503s (answered at once when web.max_requests are in progress), and the
latency percentiles of the successful requests (connect to last byte).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from local_agent import free_port

TIMEOUT_S = 10.0



@dataclass
class Results:
    latencies: list[float] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, latency: float | None) -> None:
        with self.lock:
            self.statuses[outcome] += 1
            if latency is not None:
                self.latencies.append(latency)


def scrape(port: int, results: Results) -> None:
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        connection.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
        response = connection.getresponse()
        response.read()
        status = str(response.status)
        results.add(status, time.perf_counter() - started if status == "200" else None)
    except (OSError, http.client.HTTPException) as err:
        results.add(type(err).__name__, None)
    finally:
        connection.close()


def run_mode(port: int, mode: str, scrapers: int, duration: float) -> Results:
    results = Results()
    end = time.monotonic() + duration
    barrier = threading.Barrier(scrapers)

    def paced(offset: float) -> None:
        barrier.wait()
        next_at = time.monotonic() + offset
        while next_at < end:
            time.sleep(max(0.0, next_at - time.monotonic()))
            scrape(port, results)
            next_at += 1.0

    def burst() -> None:
        next_at = time.monotonic()
        while next_at < end:
            barrier.wait()
            scrape(port, results)
            next_at += 1.0
            time.sleep(max(0.0, next_at - time.monotonic()))

    def flood() -> None:
        barrier.wait()
        while time.monotonic() < end:
            scrape(port, results)

    def runner(index: int) -> threading.Thread:
        if mode == "paced":
            return threading.Thread(target=paced, args=(index / scrapers,), daemon=True)
        return threading.Thread(target=burst if mode == "burst" else flood, daemon=True)

    threads = [runner(index) for index in range(scrapers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(duration + 2 * TIMEOUT_S + 5)
    barrier.abort()
    return results


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(mode: str, results: Results, duration: float) -> dict[str, Any]:
    total = sum(results.statuses.values())
    ok = results.statuses.get("200", 0)
    busy = results.statuses.get("503", 0)
    lat = results.latencies or [float("nan")]
    return {"mode": mode, "requests": total, "per_second": round(total / duration, 1), "ok": ok,
            "busy_503": busy, "errors": total - ok - busy,
            "error_kinds": {k: v for k, v in results.statuses.items() if k not in ("200", "503")},
            "p50_ms": round(1000 * percentile(lat, 0.5), 1), "p99_ms": round(1000 * percentile(lat, 0.99), 1),
            "max_ms": round(1000 * max(lat), 1), "mean_ms": round(1000 * statistics.fmean(lat), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scrapers", type=int, default=50)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--mode", choices=["paced", "burst", "flood", "all"], default="all")
    parser.add_argument("--scenario", default="demo")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    port = free_port()
    agent = subprocess.Popen(
        [sys.executable, "-m", "gpuscope", "run", "--simulate", args.scenario, "--log-level", "warning",
         "--web.listen-address", f"127.0.0.1:{port}"],
        env={**os.environ, "GPUSCOPE_CAPTURE__ENABLED": "false", "GPUSCOPE_CONTROL__ENABLED": "false"})
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or agent.poll() is not None:
                    raise SystemExit("the agent did not become ready") from None
                time.sleep(0.2)
        time.sleep(2.0)
        modes = ["paced", "burst", "flood"] if args.mode == "all" else [args.mode]
        reports = [summary(mode, run_mode(port, mode, args.scrapers, args.duration), args.duration)
                   for mode in modes]
    finally:
        agent.terminate()
        agent.wait(10)
    if args.json:
        print(json.dumps({"scrapers": args.scrapers, "duration_s": args.duration, "modes": reports},
                         indent=2))
        return
    print(f"{args.scrapers} scrapers, {args.duration:g} s each mode, /metrics of the simulated "
          f"'{args.scenario}' node over loopback")
    print(f"{'mode':>6} {'requests':>9} {'req/s':>7} {'errors':>7} {'503':>5} {'p50':>8} {'p99':>8} "
          f"{'max':>8}")
    for r in reports:
        print(f"{r['mode']:>6} {r['requests']:>9} {r['per_second']:>7} {r['errors']:>7} {r['busy_503']:>5} "
              f"{r['p50_ms']:>6}ms {r['p99_ms']:>6}ms {r['max_ms']:>6}ms")
        if r["error_kinds"]:
            print(f"{'':>6} errors: {r['error_kinds']}")


if __name__ == "__main__":
    main()

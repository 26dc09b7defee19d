"""Latency of /metrics when many scrapers ask at once (not a test: run by hand).

    python bench/scrape_concurrency.py                       # 50 scrapers, 20 rounds, plain and gzip
    python bench/scrape_concurrency.py --scrapers 100 --rounds 40 --json out.json

Starts `gpuscope run --simulate demo` as a subprocess and, for each encoding (plain, then gzip),
runs ``--rounds`` rounds in which ``--scrapers`` client threads ask for /metrics in the same instant,
each on a connection of its own (as Prometheus servers whose scrape intervals line up do): a fixed
count of ``scrapers x rounds`` requests per encoding. A round starts when the last request of the one
before has its answer, so sampling ticks fall wherever they fall among the rounds.

Reported per encoding: requests, errors (a refused or reset connection, a timeout, or any status but
200; the goal is none), the latency percentiles of the successful requests (connect to last byte,
p50/p95/p99/max), the body's size as sent (smallest and largest: the simulated node's processes come
and go), and the agent's CPU time per request (user and system,
from /proc; sampling ticks included). The client threads run in this process: on a small
machine they compete with the agent for the CPU, as scrapers on the same host would.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from local_agent import free_port, stop, wait_ready, write_config

TIMEOUT_S = 10.0
ENCODINGS = ("plain", "gzip")


@dataclass
class Results:
    latencies: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    body_sizes: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ok(self, latency: float, size: int) -> None:
        with self.lock:
            self.latencies.append(latency)
            self.body_sizes.add(size)

    def failed(self, kind: str) -> None:
        with self.lock:
            self.failures[kind] = self.failures.get(kind, 0) + 1


def scrape(port: int, gzip: bool, results: Results) -> None:
    headers = {"Accept-Encoding": "gzip"} if gzip else {}
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        connection.request("GET", "/metrics", headers=headers)
        response = connection.getresponse()
        body = response.read()
        if response.status != 200:
            results.failed(str(response.status))
        elif gzip and response.getheader("Content-Encoding") != "gzip":
            results.failed("not gzip")
        else:
            results.ok(time.perf_counter() - started, len(body))
    except (OSError, http.client.HTTPException) as err:
        results.failed(type(err).__name__)
    finally:
        connection.close()


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid`` so far (0 where /proc cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[-1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def run_rounds(port: int, gzip: bool, scrapers: int, rounds: int) -> Results:
    """``rounds`` rounds of ``scrapers`` requests released together by a barrier."""
    results = Results()
    barrier = threading.Barrier(scrapers)

    def scraper() -> None:
        for _ in range(rounds):
            barrier.wait()  # every scraper of the round has had its answer to the round before
            scrape(port, gzip, results)

    threads = [threading.Thread(target=scraper, daemon=True) for _ in range(scrapers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(rounds * (TIMEOUT_S + 1) + 10)
    barrier.abort()
    return results


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile ``q`` (0-1) of ``values``; NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(encoding: str, results: Results, agent_cpu_s: float) -> dict[str, Any]:
    lat = results.latencies
    requests = len(lat) + sum(results.failures.values())
    return {
        "encoding": encoding, "requests": requests,
        "errors": sum(results.failures.values()), "error_kinds": dict(results.failures),
        "p50_ms": round(1000 * percentile(lat, 0.50), 1), "p95_ms": round(1000 * percentile(lat, 0.95), 1),
        "p99_ms": round(1000 * percentile(lat, 0.99), 1),
        "max_ms": round(1000 * max(lat), 1) if lat else float("nan"),
        "body_bytes_min": min(results.body_sizes, default=0),
        "body_bytes_max": max(results.body_sizes, default=0),
        "agent_cpu_ms_per_request": round(1000 * agent_cpu_s / max(requests, 1), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scrapers", type=int, default=50, help="scrapers asking at once (default 50)")
    parser.add_argument("--rounds", type=int, default=20, help="rounds per encoding (default 20)")
    parser.add_argument("--scenario", default="demo", help="the simulated node (default demo)")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds after ready before measuring")
    parser.add_argument("--json", type=Path, help="also write the figures to this file as JSON")
    args = parser.parse_args()
    if args.scrapers < 1 or args.rounds < 1:
        parser.error("--scrapers and --rounds must be at least 1")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="gpuscope-bench-") as tmp:
        config = write_config(Path(tmp), capture={"enabled": False}, control={"enabled": False})
        agent = subprocess.Popen(
            [sys.executable, "-m", "gpuscope", "run", "--config", str(config), "--simulate", args.scenario,
             "--log-level", "warning", "--web.listen-address", f"127.0.0.1:{port}"],
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            wait_ready(base, agent)
            time.sleep(args.warmup)
            reports = []
            for encoding in ENCODINGS:
                cpu_before = cpu_seconds(agent.pid)
                results = run_rounds(port, encoding == "gzip", args.scrapers, args.rounds)
                reports.append(summary(encoding, results, cpu_seconds(agent.pid) - cpu_before))
        finally:
            stop(agent)
    report = {"scenario": args.scenario, "scrapers": args.scrapers, "rounds": args.rounds,
              "cpus": os.cpu_count(), "encodings": reports}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    print(f"{args.scrapers} scrapers at once, {args.rounds} rounds per encoding, /metrics of the simulated "
          f"'{args.scenario}' node over loopback ({os.cpu_count()} CPUs)")
    print(f"{'encoding':>8} {'requests':>9} {'errors':>7} {'p50':>8} {'p95':>8} {'p99':>8} {'max':>8} "
          f"{'body':>15} {'agent CPU/req':>14}")
    for r in reports:
        print(f"{r['encoding']:>8} {r['requests']:>9} {r['errors']:>7} {r['p50_ms']:>6}ms {r['p95_ms']:>6}ms "
              f"{r['p99_ms']:>6}ms {r['max_ms']:>6}ms {r['body_bytes_min']:>6}-{r['body_bytes_max']:<6} B "
              f"{r['agent_cpu_ms_per_request']:>11} ms")
        if r["error_kinds"]:
            print(f"{'':>8} errors: {r['error_kinds']}")


if __name__ == "__main__":
    main()

"""Benchmark: milliseconds per /metrics scrape of a busy node (8 GPUs x 4 processes by default).

Run: python bench/scrape.py [--gpus 8] [--processes 4] [--rounds 2000] [--requests 1000] [--cmdline]
                            [--gc-freeze] [--encoders-only]

Times, as median and p99 over many rounds:

* ``collect``: building the metric families (SnapshotCollector + ProcessCollector, as the agent
  registers them), without encoding;
* ``render``: encoding alone (of families collected once), with prometheus_client's encoders and
  with gpuscope.exporters.exposition's, text 0.0.4 and OpenMetrics;
* ``serve``: the /metrics handler in process (the WSGI application, no socket), as the agent wires
  it: the snapshot's families from the tick's render (``same tick``: what every scrape of a tick but
  the first costs) or rendered anew (``new tick``: the first scrape after each tick), the process
  families rendered on each request after them, plain and gzipped;
* ``http``: a whole loopback ``GET /metrics`` against AgentHttpServer on 127.0.0.1, timed by a
  client in another process (as Prometheus would be, so that the client does not compete for this
  process's GIL), a fresh connection per request as the wsgiref server closes it: plain text,
  OpenMetrics, and each gzipped.

``--gc-freeze`` calls gc.freeze() once set up: a full garbage collection (which a scrape can
trigger) then scans only objects created since, not every function and class of the loaded
modules; without it such a pause costs several milliseconds and shows in the p99.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Metric, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics_exposition
from prometheus_client.process_collector import ProcessCollector

from gpuscope.exporters.prometheus import SnapshotCollector
from gpuscope.snapshot import Snapshot
from gpuscope.web.app import AgentApp
from gpuscope.web.server import AgentHttpServer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from snapshots import FakeSource, make_gpus, make_snapshot  # the test builders (tests/ is not a package)

OPENMETRICS = "application/openmetrics-text; version=1.0.0"
generate_openmetrics: Callable[..., bytes] = openmetrics_exposition.generate_latest  # (untyped there)

# Run by the client process: argv is host, port, requests, headers as JSON; prints the sorted
# latencies in ms and the last body's size as JSON.
_CLIENT = """
import http.client, json, sys, time
host, port, requests, headers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
def get():
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("GET", "/metrics", headers=headers)
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            raise SystemExit(f"HTTP {response.status}")
        return len(body)
    finally:
        conn.close()
for _ in range(min(50, requests)):
    get()
latencies = []
for _ in range(requests):
    started = time.perf_counter()
    size = get()
    latencies.append((time.perf_counter() - started) * 1000)
print(json.dumps({"latencies": sorted(latencies), "size": size}))
"""


class _Fixed:
    """A collector over already collected families, to time encoding alone."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


class _Source:
    """The SnapshotSource the HTTP server wants (only /metrics is timed, so it has no snapshot)."""

    interval_seconds = 1.0

    def latest(self) -> Snapshot | None:
        return None

    def is_alive(self) -> bool:
        return True


def served_by_the_app(snapshot: Snapshot, cmdline: bool) -> list[tuple[str, Callable[[], bytes]]]:
    """/metrics answered by the WSGI application as the agent wires it: the snapshot's families
    rendered once per tick, the process families on every request."""
    source = FakeSource(snapshot)
    live = CollectorRegistry()
    ProcessCollector(registry=live)
    app = AgentApp(live, source, lambda: snapshot.monotonic,
                   per_tick=SnapshotCollector(source, include_cmdline=cmdline))

    def serve(encoding: str | None) -> bytes:
        environ: dict[str, Any] = {"REQUEST_METHOD": "GET", "PATH_INFO": "/metrics", "QUERY_STRING": ""}
        if encoding is not None:
            environ["HTTP_ACCEPT_ENCODING"] = encoding
        return b"".join(app(environ, lambda status, headers, exc_info=None: None))

    def new_tick(encoding: str | None) -> bytes:
        source.snapshot = replace(snapshot)  # a snapshot of its own: a tick of its own
        return serve(encoding)

    return [("serve text, same tick", lambda: serve(None)),
            ("serve text gzip, same tick", lambda: serve("gzip")),
            ("serve text, new tick", lambda: new_tick(None)),
            ("serve text gzip, new tick", lambda: new_tick("gzip"))]


def median_p99(sorted_ms: list[float]) -> tuple[float, float]:
    return statistics.median(sorted_ms), sorted_ms[min(len(sorted_ms) - 1, int(len(sorted_ms) * 0.99))]


def timings_ms(action: Callable[[], object], rounds: int) -> tuple[float, float]:
    """(median, p99) in milliseconds of ``rounds`` calls after a short warm-up."""
    for _ in range(min(50, rounds)):
        action()
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        action()
        samples.append((time.perf_counter() - started) * 1000)
    return median_p99(sorted(samples))


def report(label: str, result: tuple[float, float], size: int | None = None) -> None:
    extra = f"  ({size:,} bytes)" if size is not None else ""
    print(f"{label:<40} median {result[0]:7.3f} ms   p99 {result[1]:7.3f} ms{extra}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes", type=int, default=4, help="compute processes per GPU")
    parser.add_argument("--rounds", type=int, default=2000, help="rounds of each in-process timing")
    parser.add_argument("--requests", type=int, default=1000, help="HTTP requests of each kind")
    parser.add_argument("--cmdline", action="store_true", help="export the cmdline label too")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="gc.freeze() after setting up, as a long-running agent could after start-up")
    parser.add_argument("--encoders-only", action="store_true", help="skip the HTTP timings")
    args = parser.parse_args()

    snapshot = make_snapshot(gpus=make_gpus(args.gpus, args.processes))
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(FakeSource(snapshot), include_cmdline=args.cmdline))
    ProcessCollector(registry=registry)
    families = list(registry.collect())
    pairs = sum(len(sample.labels) for family in families for sample in family.samples)
    samples = sum(len(family.samples) for family in families)
    print(f"{args.gpus} GPUs x {args.processes} processes: {len(families)} families, {samples} samples, "
          f"{pairs} label pairs; Python {sys.version.split()[0]}; gc.freeze: {args.gc_freeze}")
    collector = _Fixed(families)
    if args.gc_freeze:
        gc.collect()
        gc.freeze()

    report("collect only", timings_ms(lambda: list(registry.collect()), args.rounds))
    encoders: list[tuple[str, Callable[[], bytes]]] = [
        ("render text, prometheus_client", lambda: generate_latest(collector)),
        ("render OpenMetrics, prometheus_client", lambda: generate_openmetrics(collector)),
    ]
    try:
        from gpuscope.exporters.exposition import render_openmetrics, render_text
    except ImportError:
        print("(gpuscope.exporters.exposition is not there: prometheus_client only)")
    else:
        encoders += [
            ("render text, gpuscope", lambda: render_text(families)),
            ("render OpenMetrics, gpuscope", lambda: render_openmetrics(families)),
        ]
    for label, encode in encoders:
        report(label, timings_ms(encode, args.rounds), len(encode()))
    for label, action in served_by_the_app(snapshot, args.cmdline):
        report(label, timings_ms(action, args.rounds), len(action()))
    if args.encoders_only:
        return

    server = AgentHttpServer("127.0.0.1:0", registry=registry, source=_Source())
    server.start()
    host, port = server.bound_address
    try:
        for label, headers in (
            ("http GET /metrics text", {}),
            ("http GET /metrics OpenMetrics", {"Accept": OPENMETRICS}),
            ("http GET /metrics text gzip", {"Accept-Encoding": "gzip"}),
            ("http GET /metrics OpenMetrics gzip", {"Accept": OPENMETRICS, "Accept-Encoding": "gzip"}),
        ):
            client = subprocess.run(
                [sys.executable, "-c", _CLIENT, host, str(port), str(args.requests), json.dumps(headers)],
                capture_output=True, text=True, check=True, timeout=600)
            result = json.loads(client.stdout)
            report(label, median_p99(result["latencies"]), result["size"])
    finally:
        server.stop()


if __name__ == "__main__":
    main()

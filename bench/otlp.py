"""What OTLP export costs, on the simulated ``demo`` node at 1 Hz sampling with a 10 s push interval.

Two parts:

* **per push, in this process**: the real sampler ticks the simulated node (a dozen ticks, so every
  counter and GPM ratio is there), then the push's work is repeated ``--pushes`` times on that
  snapshot: building the families and encoding the request (``encode``), serialising it, and POSTing
  it to a loopback receiver over a kept-alive connection (``push``). CPU is the calling thread's own
  (``time.thread_time``): the receiver's thread is not counted. Bytes are the request's body, plain
  and gzip.
* **the agent**: ``gpuscope run --simulate demo`` as a subprocess, once with OTLP off and once pushing
  every ``--interval`` to a loopback receiver in this process, each for ``--duration`` seconds. RSS at
  the end (and its peak), and the agent's CPU over the run (utime + stime), with the receiver's count
  of requests: the difference in CPU between the two runs, over the pushes, is the CPU per push as the
  agent pays it (noisy on a shared machine: compare with the in-process figure).

Usage: ``python bench/otlp.py [--pushes 50] [--duration 60] [--interval 10s] [--json]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_agent import free_port, stop, wait_ready, write_config


class _Counter:
    def __init__(self) -> None:
        self.requests = 0
        self.bytes = 0
        self.lock = threading.Lock()


def receiver() -> tuple[ThreadingHTTPServer, _Counter]:
    """A loopback OTLP/HTTP receiver that answers 200 to everything and counts."""
    counter = _Counter()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as a Collector does

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            with counter.lock:
                counter.requests += 1
                counter.bytes += len(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, counter


def per_push(pushes: int) -> dict[str, Any]:
    from gpuscope.host.processes import ProcessInspector
    from gpuscope.nvml.boundary import Nvml
    from gpuscope.otlp.encode import RequestEncoder
    from gpuscope.otlp.factory import ProcessExport, SnapshotFamilies
    from gpuscope.otlp.proto import load_protos
    from gpuscope.otlp.target import ExportTarget
    from gpuscope.otlp.transport import HttpTransport, gzip_bytes
    from gpuscope.sampling.sampler import Sampler
    from gpuscope.simulate import Simulation, load_scenario

    class Clock:
        now = 0.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    simulation = Simulation(load_scenario("demo"), clock=clock)
    simulation.install()
    sampler = Sampler(Nvml(clock=clock), ProcessInspector(host_pid_namespace=True), clock=clock,
                      wall_clock=lambda: 1.7e9 + clock.now, hostname="demo")
    server, _ = receiver()
    try:
        for _ in range(12):
            sampler.tick()
            clock.now += 1.0
        snapshot = sampler.latest()
        assert snapshot is not None
        families = SnapshotFamilies(ProcessExport(), interval_seconds=1.0)
        encoder = RequestEncoder(load_protos(), start_time=1.7e9)
        url = f"http://127.0.0.1:{server.server_address[1]}/v1/metrics"
        transport = HttpTransport(ExportTarget(url=url, protocol="http/protobuf", timeout_seconds=5.0,
                                               compression="none", headers=()))
        encode_ms, push_ms, sizes = [], [], []
        points = 0
        for _ in range(pushes):
            start = time.thread_time()
            request = encoder.encode(snapshot, families.families(snapshot))
            body = request.SerializeToString()
            encoded = time.thread_time()
            result = transport.push(body, 5.0)
            done = time.thread_time()
            assert result.outcome == "sent", result
            encode_ms.append((encoded - start) * 1e3)
            push_ms.append((done - encoded) * 1e3)
            sizes.append(len(body))
            points = sum(len(m.gauge.data_points) + len(m.sum.data_points)
                         for m in request.resource_metrics[0].scope_metrics[0].metrics)
        transport.close()
        gzipped = len(gzip_bytes(body))
    finally:
        server.shutdown()
        sampler.stop()
        simulation.uninstall()
    return {
        "gpus": len(snapshot.gpus), "points_per_push": points, "bytes_per_push": statistics.median(sizes),
        "bytes_per_push_gzip": gzipped, "encode_cpu_ms_median": round(statistics.median(encode_ms), 2),
        "encode_cpu_ms_p90": round(sorted(encode_ms)[int(0.9 * (len(encode_ms) - 1))], 2),
        "post_cpu_ms_median": round(statistics.median(push_ms), 2),
        "cpu_ms_per_push_median": round(statistics.median(e + p for e, p in zip(encode_ms, push_ms,
                                                                                 strict=True)), 2),
    }


def _proc(pid: int) -> tuple[float, float, float]:
    """(RSS MiB, peak RSS MiB, CPU seconds) of ``pid`` from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = {name: rest.split()[0] for name, _, rest in (line.partition(":") for line in status.splitlines())
              if rest.split()}
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields["VmRSS"]) / 1024, int(fields["VmHWM"]) / 1024, (int(stat[11]) + int(stat[12])) / ticks


def agent_run(otlp: bool, duration: float, interval: str) -> dict[str, Any]:
    server, counter = receiver()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        sections: dict[str, Any] = {}
        if otlp:
            sections["otlp"] = {"enabled": True, "interval": interval,
                                "endpoint": f"http://127.0.0.1:{server.server_address[1]}"}
        config = write_config(tmp, **sections)
        port = free_port()
        agent = subprocess.Popen(
            [sys.executable, "-m", "gpuscope", "run", "--config", str(config), "--simulate", "demo",
             "--sample-interval", "1s", "--web.listen-address", f"127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_ready(f"http://127.0.0.1:{port}", agent)
            _, _, cpu_start = _proc(agent.pid)
            time.sleep(duration)
            rss, peak, cpu_end = _proc(agent.pid)
        finally:
            stop(agent)
            server.shutdown()
    return {"otlp": otlp, "rss_mib": round(rss, 1), "peak_rss_mib": round(peak, 1),
            "cpu_s": round(cpu_end - cpu_start, 3), "pushes": counter.requests,
            "bytes_received": counter.bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pushes", type=int, default=50, help="pushes timed in this process")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds each agent run lasts")
    parser.add_argument("--interval", default="10s", help="otlp.interval of the agent run")
    parser.add_argument("--skip-agent", action="store_true", help="only the in-process part")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    result: dict[str, Any] = {"per_push": per_push(args.pushes)}
    if not args.skip_agent:
        off = agent_run(False, args.duration, args.interval)
        on = agent_run(True, args.duration, args.interval)
        result["agent"] = {"off": off, "on": on}
        if on["pushes"]:
            extra_cpu_ms = (on["cpu_s"] - off["cpu_s"]) * 1e3
            result["agent"]["extra_cpu_ms_per_push"] = round(extra_cpu_ms / on["pushes"], 1)
        result["agent"]["extra_rss_mib"] = round(on["rss_mib"] - off["rss_mib"], 1)
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()

"""The agent's memory while it receives a profiler trace (not a test: run by hand).

    python bench/capture_memory.py                        # the default cap (capture.max_trace_bytes)
    python bench/capture_memory.py --cap 64MiB --over 300MiB

Starts `gpuscope run --simulate demo` as a subprocess and a stand-in TensorFlow/JAX profiler server
(a gRPC server in another subprocess that answers Profile with an XSpace of a chosen size), then asks
the agent for captures of that server through the control socket (`gpuscope capture --target`) and
samples the agent's RSS every 5 ms. Reported, per trace size: RSS before, the peak during the
capture, RSS 2 s after, the capture's outcome and how long it took.

Sizes: a trace just under the cap (what the agent may have to hold), and one well over it (what a
target could send; the agent refuses it from gRPC's length prefix). gRPC holds a received message
about three times over while it arrives, so the peak is near RSS + 3.6 x the trace size.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from gpuscope.capture.config import DEFAULT_MAX_TRACE_BYTES
from gpuscope.common.sizes import format_size, parse_size

MIB = 2**20

SERVER = r"""
import sys
from concurrent import futures
import grpc
from gpuscope.generated.tsl import profiler_service_pb2, xplane_pb2
size, port = int(sys.argv[1]), int(sys.argv[2])
space = xplane_pb2.XSpace(hostnames=["bench"])
plane = space.planes.add(id=0, name="x" * size)
plane.event_metadata[1].name = "kernel"
plane.lines.add(id=1, name="stream").events.add(metadata_id=1, offset_ps=1, duration_ps=1)
reply = profiler_service_pb2.ProfileResponse(xspace=space).SerializeToString()
def profile(request, context):
    return reply
server = grpc.server(futures.ThreadPoolExecutor(max_workers=2),
                     options=[("grpc.max_send_message_length", -1)])
server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("tensorflow.ProfilerService", {
    "Profile": grpc.unary_unary_rpc_method_handler(profile, request_deserializer=lambda b: b,
                                                   response_serializer=lambda b: b)}),))
server.add_insecure_port(f"127.0.0.1:{port}")
server.start()
print("ready", flush=True)
server.wait_for_termination()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RssSampler:
    """The peak RSS of ``pid`` while running, sampled every 5 ms."""

    def __init__(self, pid: int) -> None:
        self._proc = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def serve_trace(size: int) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(size), str(port)], stdout=subprocess.PIPE,
                              text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    return server, port


def capture_once(agent: psutil.Process, socket_path: Path, size: int) -> dict[str, Any]:
    server, port = serve_trace(size)
    try:
        before = agent.memory_info().rss
        started = time.monotonic()
        with RssSampler(agent.pid) as sampler:
            done = subprocess.run(
                [sys.executable, "-m", "gpuscope", "capture", "--socket", str(socket_path), "--target",
                 f"127.0.0.1:{port}", "--duration", "1s", "--json"], capture_output=True, text=True,
                timeout=120, check=False)
        elapsed = time.monotonic() - started
        time.sleep(2.0)
        after = agent.memory_info().rss
    finally:
        server.kill()
        server.wait()
    try:
        record = json.loads(done.stdout)
        outcome, error = record.get("outcome"), record.get("error")
    except json.JSONDecodeError:
        outcome, error = "error", (done.stderr or done.stdout).strip()[-300:]
    return {"trace_bytes": size, "rss_before": before, "rss_peak": sampler.peak, "rss_after": after,
            "outcome": outcome, "error": error, "seconds": round(elapsed, 2)}


def run(cap: int, sizes: list[int]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="gpuscope-bench-") as tmp:
        folder = Path(tmp)
        control = folder / "control.sock"
        config = folder / "gpuscope.yml"
        config.write_text(f"capture:\n  max_trace_bytes: {cap}\n  store:\n    root: {folder / 'captures'}\n"
                          f"    quota_bytes: {4 * max(sizes) + 64 * MIB}\n    min_free_bytes: 0\n"
                          f"control:\n  socket: {control}\n")
        agent = subprocess.Popen(
            [sys.executable, "-m", "gpuscope", "run", "--simulate", "demo", "--config", str(config),
             "--log-level", "warning", "--web.listen-address", f"127.0.0.1:{free_port()}"],
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            deadline = time.monotonic() + 30
            while not control.exists():
                if time.monotonic() > deadline or agent.poll() is not None:
                    raise SystemExit("the agent did not start")
                time.sleep(0.1)
            time.sleep(3.0)  # warm-up
            proc = psutil.Process(agent.pid)
            return [capture_once(proc, control, size) for size in sizes]
        finally:
            agent.terminate()
            agent.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cap", default=str(DEFAULT_MAX_TRACE_BYTES), help="capture.max_trace_bytes")
    parser.add_argument("--over", default="300MiB", help="a trace size over the cap")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cap, over = parse_size(args.cap), parse_size(args.over)
    results = run(cap, [cap - 2 * MIB, over])
    if args.json:
        print(json.dumps({"cap": cap, "runs": results}, indent=2))
        return
    print(f"capture.max_trace_bytes {format_size(cap)}")
    print(f"{'trace':>10} {'outcome':>9} {'RSS before':>11} {'peak':>9} {'after':>9} {'time':>6}")
    for r in results:
        print(f"{format_size(r['trace_bytes']):>10} {r['outcome']:>9} {r['rss_before'] / MIB:>9.0f}Mi "
              f"{r['rss_peak'] / MIB:>7.0f}Mi {r['rss_after'] / MIB:>7.0f}Mi {r['seconds']:>5.1f}s")
        if r["outcome"] != "captured" and r["error"]:
            print(f"{'':>10} {r['error'][:150]}")


if __name__ == "__main__":
    main()

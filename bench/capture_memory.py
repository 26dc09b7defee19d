"""The agent's memory while it takes a profiler trace (not a test: run by hand).

    python bench/capture_memory.py                  # gRPC, at the default cap (capture.max_trace_bytes)
    python bench/capture_memory.py --cap 64MiB --over 300MiB
    python bench/capture_memory.py --kineto         # a PyTorch trace file (capture.kineto.max_trace_bytes)

Starts `gpuscope run --simulate demo` as a subprocess and a stand-in target in another subprocess,
then asks the agent for captures of it through the control socket (`gpuscope capture`) and samples
the agent's RSS every 5 ms. Reported, per trace size: RSS before, the peak during the capture, RSS 2 s
after, the capture's outcome and how long it took.

gRPC (the default): the target is a TensorFlow/JAX profiler server that answers Profile with an XSpace
of a chosen size. Sizes: a trace just under the cap (what the agent may have to hold), and one well over
it (what a target could send; the agent refuses it from gRPC's length prefix). gRPC holds a received
message about three times over while it arrives, so the peak is near RSS + 3.6 x the trace size.

--kineto: the target is a scripted PyTorch job: it polls the agent's Kineto daemon as a job started with
KINETO_USE_DAEMON=1 does and, given a trace config, writes a Chrome trace JSON of many events, of a
chosen size, into trace_<pid>.json.tmp, then renames it. Sizes: just under capture.kineto.max_trace_bytes,
and over it (refused before it is read). The agent streams the file into the store, compressed, one
chunk at a time: the peak should not grow with the trace.

--series N (default 6; 0: none): then N captures of one trace of --series-size (default 16MiB), with
RSS before the series, after its first capture and after its last (each 2 s after the capture): what
captures leave behind. gRPC stays out of the agent: the control API's gRPC server runs in a server
process while clients call, and a gRPC target's trace is received by a profiler client process, so
neither the first capture nor later ones should add more than a few MiB. The child processes' RSS
at their peak is reported beside the agent's. To see that level, measure an agent that has not loaded
gRPC before: the simulated node starts a stand-in kubelet that does, so name a real NVML library
instead with
--nvml-lib DIR (put first in LD_LIBRARY_PATH; the rest of the environment, such as NVIDIA's mock
libnvidia-ml's MOCK_NVML_CONFIG, passes to the agent) and the series runs before the sized captures:

    LD_LIBRARY_PATH= MOCK_NVML_CONFIG=/path/to/mock-nvml-config-h100.yaml \
        python bench/capture_memory.py --nvml-lib /path/to/mocknvml/lib --series 6
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from gpuscope.capture.config import DEFAULT_KINETO_MAX_TRACE_BYTES, DEFAULT_MAX_TRACE_BYTES
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


# A PyTorch job's side of the Kineto on-demand protocol, scripted: poll until a trace config comes,
# "record" for its duration, then write trace_<pid>.json.tmp of about SIZE bytes and rename it.
KINETO_JOB = r"""
import os, sys, time
from gpuscope.simulate.kineto_client import KinetoClient
daemon, size = sys.argv[1], int(sys.argv[2])
client = KinetoClient(daemon, on_trace=lambda _: None, busy=lambda: False)
request = client.wait_for_request(0.5, lambda: print("ready", flush=True))
time.sleep(request.duration_s)
final = request.trace_path(os.getpid())
temporary = final.with_name(final.name + ".tmp")
pid = os.getpid()
block = "".join(
    f'{{"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": {pid}, "tid": {pid}, "ts": {n * 3}, '
    f'"dur": 2, "args": {{"External id": {n}, "Sequence number": {n % 977}}}}},\n'
    for n in range(2000)).encode()
head = b'{"schemaVersion": 1, "traceEvents": [\n'
tail = b'{"ph": "X", "cat": "Trace", "name": "bench", "pid": 1, "tid": 1, "ts": 0, "dur": 1}\n]}\n'
with temporary.open("wb") as out:
    out.write(head)
    written = len(head) + len(tail)
    while written + len(block) <= size:
        out.write(block)
        written += len(block)
    out.write(tail)
os.rename(temporary, final)
sys.stdin.read()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RssSampler:
    """The peak RSS of ``pid`` while running, sampled every 5 ms, and (every 4th sample) the peak of
    its child processes' RSS together: the control API's server process, the profiler client of a
    gRPC capture, a capture's analysis."""

    def __init__(self, pid: int) -> None:
        self._proc = psutil.Process(pid)
        self.peak = 0
        self.children_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        samples = 0
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            if samples % 4 == 0:
                self.children_peak = max(self.children_peak, _children_rss(self._proc))
            samples += 1
            time.sleep(0.005)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _children_rss(proc: psutil.Process) -> int:
    total = 0
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.Error):  # ended meanwhile
            total += child.memory_info().rss
    return total


def serve_trace(size: int) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(size), str(port)], stdout=subprocess.PIPE,
                              text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    return server, port


def measured_capture(agent: psutil.Process, socket_path: Path, size: int, selector: list[str],
                     timeout: float) -> dict[str, Any]:
    """One `gpuscope capture SELECTOR` through the agent's control socket, with the agent's RSS before,
    at its peak (sampled every 5 ms) and 2 s after."""
    before = agent.memory_info().rss
    started = time.monotonic()
    with RssSampler(agent.pid) as sampler:
        done = subprocess.run(
            [sys.executable, "-m", "gpuscope", "capture", "--socket", str(socket_path), *selector,
             "--duration", "1s", "--json"], capture_output=True, text=True, timeout=timeout, check=False)
    elapsed = time.monotonic() - started
    time.sleep(2.0)
    after = agent.memory_info().rss
    return {"trace_bytes": size, "rss_before": before, "rss_peak": sampler.peak, "rss_after": after,
            "children_rss_peak": sampler.children_peak, **_outcome(done), "seconds": round(elapsed, 2)}


def capture_once(agent: psutil.Process, socket_path: Path, size: int) -> dict[str, Any]:
    server, port = serve_trace(size)
    try:
        return measured_capture(agent, socket_path, size, ["--target", f"127.0.0.1:{port}"], 120)
    finally:
        server.kill()
        server.wait()


def start_kineto_job(daemon: str, size: int) -> subprocess.Popen[str]:
    # Its stderr is dropped: a job whose trace the agent gave up on fails to rename it, by design.
    job = subprocess.Popen([sys.executable, "-c", KINETO_JOB, daemon, str(size)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert job.stdout is not None and job.stdout.readline().strip() == "ready"
    return job


def capture_kineto_once(agent: psutil.Process, socket_path: Path, daemon: str, size: int) -> dict[str, Any]:
    job = start_kineto_job(daemon, size)
    try:
        return measured_capture(agent, socket_path, size, ["--pid", str(job.pid)], 600)
    finally:
        job.kill()
        job.wait()


def _outcome(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    try:
        record = json.loads(done.stdout)
        return {"outcome": record.get("outcome"), "error": record.get("error"),
                "stored_bytes": record.get("bytes")}
    except json.JSONDecodeError:
        return {"outcome": "error", "error": (done.stderr or done.stdout).strip()[-300:]}


def run_series(agent: psutil.Process, count: int, one: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``count`` captures by ``one``: RSS before the first, after the first and after the last."""
    before = agent.memory_info().rss
    runs = [one() for _ in range(count)]
    return {"captures": count, "trace_bytes": runs[0]["trace_bytes"], "rss_before": before,
            "rss_after_first": runs[0]["rss_after"], "rss_after_last": runs[-1]["rss_after"],
            "rss_peak": max(r["rss_peak"] for r in runs),
            "children_rss_peak": max(r["children_rss_peak"] for r in runs),
            "outcomes": sorted({str(r["outcome"]) for r in runs})}


def run(cap: int, sizes: list[int], *, kineto: bool = False, series: int = 0, series_size: int = 0,
        nvml_lib: str | None = None) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    with tempfile.TemporaryDirectory(prefix="gpuscope-bench-") as tmp:
        folder = Path(tmp)
        control = folder / "control.sock"
        config = folder / "gpuscope.yml"
        kineto_ipc = folder / "kineto-ipc"
        capture: dict[str, Any] = {
            "store": {"root": str(folder / "captures"),
                      "quota_bytes": 4 * max([*sizes, series_size]) + series * series_size + 64 * MIB,
                      "min_free_bytes": 0},
            # The series takes its captures back to back: no cooldown, a budget that allows them.
            "cooldown": "0s", "hourly_budget": max(6, series + len(sizes) + 1),
            "user_hourly_budget": max(12, series + len(sizes) + 1)}
        if kineto:
            capture["kineto"] = {"max_trace_bytes": cap, "trace_dir": str(folder / "kineto-traces"),
                                 "socket_dir": str(kineto_ipc)}
            # The diagnosis of a stored trace runs in a child process of its own, not measured here.
            capture["analysis"] = {"enabled": False}
        else:
            capture["max_trace_bytes"] = cap
        # JSON is YAML
        config.write_text(json.dumps({"capture": capture, "control": {"socket": str(control)}}))
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        node = ["--simulate", "demo"]
        if nvml_lib:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                p for p in (str(Path(nvml_lib).resolve()), os.environ.get("LD_LIBRARY_PATH", "")) if p)
            node = []
        agent = subprocess.Popen(
            [sys.executable, "-m", "gpuscope", "run", *node, "--config", str(config),
             "--log-level", "warning", "--web.listen-address", f"127.0.0.1:{free_port()}"], env=env)
        try:
            deadline = time.monotonic() + 30
            while not control.exists():
                if time.monotonic() > deadline or agent.poll() is not None:
                    raise SystemExit("the agent did not start")
                time.sleep(0.1)
            time.sleep(3.0)  # warm-up
            proc = psutil.Process(agent.pid)
            daemon = str(kineto_ipc / "dynolog")

            def once(size: int) -> dict[str, Any]:
                if kineto:
                    return capture_kineto_once(proc, control, daemon, size)
                return capture_once(proc, control, size)

            summary = run_series(proc, series, lambda: once(series_size)) if series else None
            return summary, [once(size) for size in sizes]
        finally:
            agent.terminate()
            agent.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kineto", action="store_true",
                        help="a PyTorch job's trace file (capture.kineto.max_trace_bytes), not gRPC")
    parser.add_argument("--cap", help="capture.max_trace_bytes (gRPC; default 64MiB), or "
                                      "capture.kineto.max_trace_bytes with --kineto (default 1GiB)")
    parser.add_argument("--over", help="a trace size over the cap (default: 300MiB; with --kineto, the cap "
                                       "and 64MiB)")
    parser.add_argument("--series", type=int, default=6,
                        help="captures in a row, RSS before, after the first and after the last (default 6; "
                             "0: none)")
    parser.add_argument("--series-size", default="16MiB", help="the trace size of the series (default 16MiB)")
    parser.add_argument("--nvml-lib", metavar="DIR", help="run the agent on the NVML library in DIR, not on "
                                                          "the simulated node")
    parser.add_argument("--only-series", action="store_true", help="the series only, no sized captures")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    default_cap = DEFAULT_KINETO_MAX_TRACE_BYTES if args.kineto else DEFAULT_MAX_TRACE_BYTES
    cap = parse_size(args.cap) if args.cap else default_cap
    over = parse_size(args.over) if args.over else (cap + 64 * MIB if args.kineto else 300 * MIB)
    sizes = [] if args.only_series else [cap - 2 * MIB, over]
    series, results = run(cap, sizes, kineto=args.kineto, series=args.series,
                          series_size=parse_size(args.series_size), nvml_lib=args.nvml_lib)
    setting = "capture.kineto.max_trace_bytes" if args.kineto else "capture.max_trace_bytes"
    if args.json:
        print(json.dumps({"setting": setting, "cap": cap, "series": series, "runs": results}, indent=2))
        return
    if series is not None:
        mib = {key: f"{series[key] / MIB:.1f} MiB" for key in series if key.startswith("rss_")}
        print(f"{series['captures']} captures of {format_size(series['trace_bytes'])} "
              f"({', '.join(series['outcomes'])}): RSS before {mib['rss_before']}, after the first "
              f"{mib['rss_after_first']}, after the last {mib['rss_after_last']} (peak {mib['rss_peak']}); "
              f"its child processes at their peak {series['children_rss_peak'] / MIB:.1f} MiB together")
    if not results:
        return
    print(f"{setting} {format_size(cap)}")
    print(f"{'trace':>10} {'outcome':>9} {'RSS before':>11} {'peak':>9} {'after':>9} {'time':>6} "
          f"{'stored':>10} {'children peak':>14}")
    for r in results:
        stored = format_size(int(r.get("stored_bytes") or 0))
        print(f"{format_size(r['trace_bytes']):>10} {r['outcome']:>9} {r['rss_before'] / MIB:>9.0f}Mi "
              f"{r['rss_peak'] / MIB:>7.0f}Mi {r['rss_after'] / MIB:>7.0f}Mi {r['seconds']:>5.1f}s "
              f"{stored:>10} {r['children_rss_peak'] / MIB:>12.0f}Mi")
        if r["outcome"] != "captured" and r["error"]:
            print(f"{'':>10} {r['error'][:150]}")


if __name__ == "__main__":
    main()

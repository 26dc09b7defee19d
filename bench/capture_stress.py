"""Many captures of a PyTorch job that serves ``gpuscope.workload``, under CPU load: the job must survive
every one, and every trace must be whole.

    python bench/capture_stress.py --runs 200 [--captures-per-job 4] [--load 2] [--duration-ms 100]
                                   [--train-threads 2] [--small-ops] [--json OUT]

A run is one capture: the agent's own Profile request (``gpuscope.capture.tsl_client``) sent to
``tests/workloads/torch_workload.py --serve 0``, a training loop on the main thread (and
``--train-threads`` more on threads of their own). Every ``--captures-per-job`` runs the job is a fresh
process, so that the first capture of a process, when torch starts Kineto, is taken again and again;
``--captures-per-job 1`` makes every run a first capture. ``--load`` busy processes (one Python loop
each) keep the CPUs contended, so the job's threads are preempted at any point of a profiler start or
stop. Short captures (``--duration-ms``) put many starts and stops in a run. The job's threads
train on models of their own; the profiler records the one that reached the step boundary where
the capture started (``training_threads_seen_min``: the fewest threads with training ops in a trace).

A run fails when the job exits before it is told to, the RPC fails, the answer is not one gzip
Chrome trace with the training loop's ops in it, or the job, told to exit, exits other than 0 or
wrote a crash to its standard error (glibc's heap checks, a signal). The job's standard error is
also searched for Kineto's complaint that its client was initialised on a thread other than the
one that registered it (``init_on_another_thread``): the sign that the profiler was first started
by the server's thread. Prints one line per failure and a summary; ``--json`` writes the figures.
Exit status 1 when any run failed.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpuscope.capture.tsl_client import profile_request
from gpuscope.common.addresses import HostPort
from gpuscope.generated.tsl import profiler_service_pb2, profiler_service_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "tests" / "workloads" / "torch_workload.py"
TRAINING_OPS = {"aten::mm", "aten::addmm"}
CRASH = re.compile(r"malloc\(\)|free\(\)|corrupted|double free|Aborted|Segmentation fault|Fatal Python error"
                   r"|terminate called")
INIT_ON_ANOTHER_THREAD = "External init callback must run in same thread as registerClient"
READY_TIMEOUT_S = 120.0
EXIT_TIMEOUT_S = 20.0


@dataclass
class Figures:
    runs: int = 0
    jobs: int = 0
    failures: list[str] = field(default_factory=list)
    init_on_another_thread: int = 0
    capture_s: list[float] = field(default_factory=list)
    threads_seen: list[int] = field(default_factory=list)


class Job:
    """One training process serving the profiler on a port of its choosing."""

    def __init__(self, log: Path, extra: list[str]) -> None:
        self.log = log
        environment = {k: v for k, v in os.environ.items() if k != "KINETO_USE_DAEMON"}  # serve() alone
        with log.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKLOAD), "--serve", "0", *extra], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=err, text=True, env={**environment, "PYTHONUNBUFFERED": "1"})
        self.port = 0

    def wait_ready(self) -> str | None:
        """None once the job says ``ready``; else what went wrong."""
        lines: list[str] = []
        done = threading.Event()
        stdout = self.proc.stdout
        assert stdout is not None

        def read() -> None:
            for line in stdout:
                lines.append(line.strip())
                if line.strip() == "ready":
                    break
            done.set()

        threading.Thread(target=read, daemon=True).start()
        if not done.wait(READY_TIMEOUT_S) or "ready" not in lines:
            return f"not ready (exit {self.proc.poll()}, said {lines[-3:]})"
        self.port = next(int(line.split()[1]) for line in lines if line.startswith("port "))
        return None

    def finish(self) -> int | None:
        """Closes its standard input (it exits then); its exit status, None when it had to be killed."""
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            return self.proc.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


def capture(port: int, duration_ms: int) -> profiler_service_pb2.ProfileResponse:
    """The agent's Profile request, as ``gpuscope.capture.tsl_client`` sends it."""
    address = HostPort("127.0.0.1", port)
    args = {"duration_ms": duration_ms, "host_tracer_level": 2, "device_tracer_level": 1,
            "python_tracer_level": 0, "repository_root": "/tmp", "run": "stress"}
    with grpc.insecure_channel(str(address), options=[("grpc.max_receive_message_length", -1)]) as channel:
        stub = profiler_service_pb2_grpc.ProfilerServiceStub(channel)
        response: profiler_service_pb2.ProfileResponse = stub.Profile(
            profile_request(args, address), timeout=duration_ms / 1000 + 60)
        return response


def trace_problem(response: profiler_service_pb2.ProfileResponse) -> tuple[str | None, int]:
    """(None or what is wrong with the answer, how many threads ran the training loop's ops in it)."""
    if response.empty_trace or len(response.tool_data) != 1:
        return f"empty_trace={response.empty_trace}, {len(response.tool_data)} files", 0
    (tool,) = response.tool_data
    if not tool.name.endswith(".pt.trace.json.gz"):
        return f"file named {tool.name!r}", 0
    try:
        trace = json.loads(gzip.decompress(tool.data))
    except (OSError, EOFError, ValueError) as err:
        return f"not a gzip Chrome trace: {err}", 0
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        return "no list of traceEvents", 0
    threads = {e.get("tid") for e in events if e.get("ph") == "X" and e.get("name") in TRAINING_OPS}
    if not threads:
        return "none of the training loop's ops", 0
    return None, len(threads)


def run_job(index: int, captures: int, args: argparse.Namespace, logs: Path, figures: Figures) -> None:
    extra = ["--train-threads", str(args.train_threads), *(["--many-small-ops"] if args.small_ops else []),
             *args.workload_arg]
    job = Job(logs / f"job-{index}.log", extra)
    figures.jobs += 1
    failed = False

    def fail(what: str) -> None:
        nonlocal failed
        failed = True
        figures.failures.append(f"job {index} (pid {job.proc.pid}): {what}")
        print(f"FAIL {figures.failures[-1]}", flush=True)

    try:
        problem = job.wait_ready()
        if problem is not None:
            fail(problem)
            figures.runs += captures
            return
        for number in range(captures):
            figures.runs += 1
            started = time.monotonic()
            response: profiler_service_pb2.ProfileResponse | None
            try:
                response = capture(job.port, args.duration_ms)
            except grpc.RpcError as err:
                response = None
                time.sleep(0.5)  # a job that died has its exit status by now
                fail(f"capture {number}: {err.code()} {err.details()} (job exit {job.proc.poll()})")
            if response is not None:
                figures.capture_s.append(time.monotonic() - started)
                problem, threads = trace_problem(response)
                figures.threads_seen.append(threads)
                if problem is not None:
                    fail(f"capture {number}: {problem}")
            if job.proc.poll() is not None:
                fail(f"exited ({job.proc.returncode}) after capture {number}")
                figures.runs += captures - number - 1
                break
    finally:
        status = job.finish()
        said = job.log.read_text(errors="replace")
        figures.init_on_another_thread += INIT_ON_ANOTHER_THREAD in said
        if status is None:
            fail(f"still running {EXIT_TIMEOUT_S:g} s after told to exit")
        elif status != 0 and not failed:
            fail(f"exit status {status} when told to exit")
        if crash := CRASH.search(said):
            fail(f"crash on its standard error: {said[max(0, crash.start() - 200):crash.end() + 200]!r}")
        if failed:
            print(f"  its standard error ({job.log}):\n" + "\n".join(said.splitlines()[-15:]), flush=True)


def start_load(processes: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200, help="captures in all (default 200)")
    parser.add_argument("--captures-per-job", type=int, default=4,
                        help="captures of each fresh job process (default 4; 1: every capture a first one)")
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the job (default 2)")
    parser.add_argument("--duration-ms", type=int, default=100, help="length of each capture (default 100)")
    parser.add_argument("--train-threads", type=int, default=2,
                        help="training loops on threads of their own beside the main one (default 2)")
    parser.add_argument("--small-ops", action="store_true",
                        help="the main thread runs small ops back to back, without a pause")
    parser.add_argument("--workload-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for the job (tests/workloads/torch_workload.py), repeatable")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--logs", type=Path, help="keep the jobs' standard error here (default: a temporary "
                                                   "folder, kept only when a run failed)")
    args = parser.parse_args(argv)
    for name in ("runs", "captures_per_job", "duration_ms"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.load < 0 or args.train_threads < 0:
        parser.error("--load and --train-threads cannot be negative")

    logs = args.logs or Path(tempfile.mkdtemp(prefix="gpuscope-capture-stress-"))
    logs.mkdir(parents=True, exist_ok=True)
    figures = Figures()
    load = start_load(args.load)
    started = time.monotonic()
    try:
        index = 0
        while figures.runs < args.runs:
            run_job(index, min(args.captures_per_job, args.runs - figures.runs), args, logs, figures)
            index += 1
    finally:
        for busy in load:
            busy.kill()
            busy.wait()
    wall_s = time.monotonic() - started
    if not figures.failures and args.logs is None:
        for log in logs.iterdir():
            log.unlink()
        logs.rmdir()
    report: dict[str, Any] = {
        "runs": figures.runs, "jobs": figures.jobs, "failed": len(figures.failures),
        "failures": figures.failures, "init_on_another_thread": figures.init_on_another_thread,
        "wall_s": round(wall_s, 1), "load_processes": args.load, "cpus": os.cpu_count(),
        "captures_per_job": args.captures_per_job, "duration_ms": args.duration_ms,
        "train_threads": args.train_threads, "small_ops": args.small_ops,
        "capture_s_median": round(sorted(figures.capture_s)[len(figures.capture_s) // 2], 3)
        if figures.capture_s else None,
        "training_threads_seen_min": min(figures.threads_seen, default=0),
    }
    print(f"{figures.runs} captures of {figures.jobs} fresh jobs, {len(figures.failures)} failed, "
          f"{figures.init_on_another_thread} jobs initialised Kineto on another thread; {wall_s:.0f} s with "
          f"{args.load} busy processes on {os.cpu_count()} CPUs"
          + ("" if not figures.failures else f"; logs in {logs}"))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if figures.failures else 0


if __name__ == "__main__":
    sys.exit(main())

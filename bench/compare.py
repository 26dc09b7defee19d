"""Side by side: the gpuscope agent and a peer exporter on the same node, under the same scrape loads.

Run: python bench/compare.py --nvml-lib DIR --peer "EXPORTER --port {port} ..." [--seconds 60]
                             [--warmup 15] [--rounds 2] [--json FILE] [--profile]
     python bench/compare.py --simulate demo --seconds 30 --rounds 1      # gpuscope alone

Each run starts an agent as a fresh process, waits until it answers, scrapes it for ``--warmup``
seconds and then measures it for ``--seconds`` under one load:

* ``quiet``: one GET /metrics every 15 s (a Prometheus at its usual interval);
* ``busy``: one GET /metrics every second.

Scrapes come from a thread of this harness, a fresh HTTP connection each, timed from connect to the
last byte of the body. gpuscope runs with every default feature on (alert rules, captures with their
store, the Kineto daemon, the control API, pod attribution), sampling every second, with the paths
it writes in a temporary directory. It starts through a small launcher that gives every Python
thread a kernel name (comm) from its Python name as it starts (the agent renames its own long-lived
threads; this names the others: gRPC's server threads, per-request HTTP threads, thread pools) and
lists their ids, so that the per-thread figures say which part woke up. Nothing else changes.

The node is either simulated (``--simulate NAME``, the default without ``--nvml-lib``; gpuscope only,
as a peer needs an NVML library) or whatever NVML library ``--nvml-lib DIR`` holds: DIR goes first in
the children's LD_LIBRARY_PATH and the rest of this environment (MOCK_NVML_* variables included)
passes to them unchanged. ``--peer CMD`` is the peer's command line, started with the same library;
``{port}`` in it is replaced by a free loopback port, which the peer must serve /metrics on.

For each round and each load, gpuscope runs and then the peer, so that a machine whose other load
drifts affects both; the tables show per agent and load the median over the rounds. Per run, from
/proc, over the measured window:

* CPU ms per second of the process tree (the agent and its child processes; the simulator's
  stand-in training processes are not the agent's and are left out): utime+stime of
  /proc/PID/stat (10 ms ticks, but it keeps the time of threads that have exited, such as the HTTP
  server's per-request threads) plus what reaped children used, and the sum of the per-thread
  /proc/PID/task/TID/schedstat run times (nanoseconds, threads seen alive at a once-a-second
  reading only);
* RSS: the median of one reading a second (steady), the largest reading (peak), and VmHWM at the end;
* threads: the most seen at once;
* scrape latency p50 and p99, and the body's size;
* wake-ups: voluntary plus involuntary context switches per second, per thread name
  (/proc/PID/task/TID/status and comm); a thread that lived less than a second between two readings
  is missed. In gpuscope's table, ``C:NAME`` is a thread that a C library started (gRPC's, the NVML
  library's own), named after the thread that started it; ``(main)`` is the main thread.

``--profile`` also runs gpuscope once, unscraped, under py-spy when py-spy is on PATH: the stacks most
often sampled over 20 s (``py-spy record``: running threads only, so where the CPU goes), then
every thread's stack once (``py-spy dump``, idle ones too: where each waits).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from local_agent import free_port, stop, wait_ready, write_config

MIB = 2**20
TICK = os.sysconf("SC_CLK_TCK")
LOADS = {"quiet": 15.0, "busy": 1.0}  # seconds between scrapes
HELPER = "gpuscope.simulate.helper_process"  # the simulator's stand-in training processes
TOP_THREADS = 8
THREAD_FIELDS = ("threads", "wakeups_per_s", "voluntary_per_s", "cpu_ms_per_s")

# Run as `python -c LAUNCHER run ...`: the agent's own `main`, with each Python thread's kernel name
# (comm, 15 bytes) set from its Python name as it starts, so that /proc tells the threads apart, and its
# id appended to the file named by $THREAD_LOG. Threads that a C library starts (gRPC's, an NVML
# library's own) are not in that file: they inherit the name of the thread that started them.
LAUNCHER = r"""
import ctypes, os, re, sys, threading
from gpuscope.cli.main import main

log = os.open(os.environ["THREAD_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)

libc = ctypes.CDLL(None, use_errno=True)
zero = ctypes.c_ulong(0)

def kernel_name(name):
    name = re.sub(r"^gpuscope-", "gs-", name)
    name = re.sub(r"^Thread-\d+ \((.*)\)$", r"\1", name)
    name = re.sub(r"^ThreadPoolExecutor-(\d+)_(\d+)$", r"pool-\1_\2", name)
    return name.encode(errors="replace")[:15]

real_bootstrap = threading.Thread._bootstrap_inner

def named_bootstrap(self):
    libc.prctl(ctypes.c_int(15), ctypes.c_char_p(kernel_name(self.name)), zero, zero, zero)
    os.write(log, f"{threading.get_native_id()}\n".encode())
    real_bootstrap(self)

threading.Thread._bootstrap_inner = named_bootstrap
sys.argv = ["gpuscope", *sys.argv[1:]]
sys.exit(main())
"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# --- the agents -------------------------------------------------------------------------------------


def child_env(nvml_lib: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if nvml_lib:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(Path(nvml_lib).resolve()), os.environ.get("LD_LIBRARY_PATH", "")) if p)
    return env


def gpuscope_command(args: argparse.Namespace, tmp: Path, port: int) -> list[str]:
    command = [sys.executable, "-c", LAUNCHER, "run", "--config", str(write_config(tmp)),
               "--web.listen-address", f"127.0.0.1:{port}", "--sample-interval", "1s", "--log-level", "info"]
    return command + (["--simulate", args.simulate] if args.simulate else [])


def wait_metrics(base: str, process: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """Returns once ``base``/metrics answers 200 (a peer need not have a readiness endpoint)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the peer exited with status {process.returncode} before it answered")
        try:
            with urllib.request.urlopen(base + "/metrics", timeout=5) as response:
                response.read()
            return
        except (OSError, http.client.HTTPException):
            time.sleep(0.2)
    raise SystemExit(f"the peer at {base} did not answer /metrics in {timeout:.0f} s")


def start_agent(agent: str, args: argparse.Namespace, tmp: Path, port: int) -> subprocess.Popen[bytes]:
    base = f"http://127.0.0.1:{port}"
    with open(tmp / f"{agent}.log", "ab") as log:  # the child keeps its own descriptor
        if agent == "gpuscope":
            (tmp / "threads.txt").unlink(missing_ok=True)
            env = {**child_env(args.nvml_lib), "THREAD_LOG": str(tmp / "threads.txt")}
            process = subprocess.Popen(gpuscope_command(args, tmp, port), cwd=tmp, stdout=log,
                                       stderr=subprocess.STDOUT, env=env)
        else:
            command = shlex.split(args.peer.replace("{port}", str(port)))
            process = subprocess.Popen(command, cwd=tmp, stdout=log, stderr=subprocess.STDOUT,
                                       env=child_env(args.nvml_lib))
    try:
        if agent == "gpuscope":
            wait_ready(base, process)
        else:
            wait_metrics(base, process)
    except BaseException:
        stop(process)
        raise
    return process


# --- scraping ---------------------------------------------------------------------------------------


@dataclass
class Scrape:
    at: float  # monotonic time it started
    ms: float
    size: int
    ok: bool


class Scraper(threading.Thread):
    """GET /metrics every ``period`` seconds, a fresh connection each, until stopped."""

    def __init__(self, port: int, period: float, first_at: float) -> None:
        super().__init__(name="scraper", daemon=True)
        self.port, self.period, self.first_at = port, period, first_at
        self.scrapes: list[Scrape] = []
        self.halt = threading.Event()

    def get(self) -> tuple[int, bool]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", "/metrics")
            response = conn.getresponse()
            body = response.read()
            return len(body), response.status == 200
        finally:
            conn.close()

    def run(self) -> None:
        next_at = self.first_at
        self.halt.wait(max(0.0, next_at - time.monotonic()))
        while not self.halt.is_set():
            at, started = time.monotonic(), time.perf_counter()
            try:
                size, ok = self.get()
            except (OSError, http.client.HTTPException):
                size, ok = 0, False
            self.scrapes.append(Scrape(at, (time.perf_counter() - started) * 1000, size, ok))
            next_at += self.period
            self.halt.wait(max(0.0, next_at - time.monotonic()))


# --- /proc ------------------------------------------------------------------------------------------


def read(path: str) -> str | None:
    try:
        with open(path) as file:
            return file.read()
    except OSError:  # gone since it was listed
        return None


def status_fields(text: str) -> dict[str, str]:
    return {key: value.strip() for key, _, value in (line.partition(":") for line in text.splitlines())}


def kib(value: str | None) -> int:
    return int(value.split()[0]) * 1024 if value else 0


@dataclass
class Reading:
    """One reading of a process tree."""

    at: float
    cpu_ticks: dict[tuple[int, int], int]  # (pid, start time) -> utime+stime
    reaped_ticks: int  # the root's cutime+cstime: children that exited and were waited for
    tasks: dict[tuple[int, int], tuple[str, int, int, int]]  # (pid, tid) -> comm, run ns, vol, invol
    rss: int
    threads: int
    hwm: int = 0


@dataclass
class Tree:
    """The agent and its child processes, less the simulator's stand-in training processes."""

    root: int
    thread_log: Path | None = None  # the launcher's list of the agent's Python threads
    skipped: set[int] = field(default_factory=set)

    def python_threads(self) -> set[str] | None:
        if self.thread_log is None:
            return None
        text = read(str(self.thread_log))
        return set((text or "").split()) | {str(self.root)}

    def pids(self) -> list[int]:
        try:
            children = psutil.Process(self.root).children(recursive=True)
        except psutil.Error:
            return []
        pids = [self.root]
        for child in children:
            if child.pid in self.skipped:
                continue
            try:
                if any(HELPER in part for part in child.cmdline()):
                    self.skipped.add(child.pid)
                    continue
            except psutil.Error:
                continue
            pids.append(child.pid)
        return pids

    def read(self) -> Reading:
        reading = Reading(time.monotonic(), {}, 0, {}, 0, 0)
        python_threads = self.python_threads()
        for pid in self.pids():
            stat, status = read(f"/proc/{pid}/stat"), read(f"/proc/{pid}/status")
            if stat is None or status is None:
                continue
            fields = stat.rsplit(")", 1)[1].split()  # after the comm, which may hold spaces
            utime, stime, cutime, cstime, start = (int(fields[i]) for i in (11, 12, 13, 14, 19))
            reading.cpu_ticks[(pid, start)] = utime + stime
            if pid == self.root:
                reading.reaped_ticks = cutime + cstime
            info = status_fields(status)
            reading.rss += kib(info.get("VmRSS"))
            reading.threads += int(info.get("Threads", "0"))
            if pid == self.root:
                reading.hwm = kib(info.get("VmHWM"))
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                task = f"/proc/{pid}/task/{tid}"
                comm, sched, tstatus = read(task + "/comm"), read(task + "/schedstat"), read(task + "/status")
                if comm is None or sched is None or tstatus is None:
                    continue
                t = status_fields(tstatus)
                name = "(main)" if pid == self.root and tid == str(pid) else comm.strip()
                if pid == self.root and python_threads is not None and tid not in python_threads:
                    python_threads = self.python_threads()  # it may have started since the file was read
                    if python_threads is not None and tid not in python_threads:
                        name = "C:" + name  # started by a C library, named after the thread that started it
                reading.tasks[(pid, int(tid))] = (
                    name, int(sched.split()[0]), int(t.get("voluntary_ctxt_switches", "0")),
                    int(t.get("nonvoluntary_ctxt_switches", "0")))
        return reading


def deltas(first: dict[Any, int], seen: dict[Any, int]) -> int:
    """Growth of counters keyed by process or thread: since the first reading for those present then,
    since zero for those that appeared later (last value seen for those that went away)."""
    return sum(value - first.get(key, 0) for key, value in seen.items())


def summarize_window(readings: list[Reading]) -> dict[str, Any]:
    first, last = readings[0], readings[-1]
    seconds = last.at - first.at
    cpu_seen: dict[tuple[int, int], int] = {}
    task_seen: dict[tuple[int, int], tuple[str, int, int, int]] = {}
    for reading in readings:
        cpu_seen.update(reading.cpu_ticks)
        task_seen.update(reading.tasks)
    stat_ticks = deltas(first.cpu_ticks, cpu_seen) + last.reaped_ticks - first.reaped_ticks
    by_name: dict[str, dict[str, float]] = {}
    run_ns = 0
    for key, (name, ns, vol, invol) in task_seen.items():
        base = first.tasks.get(key, (name, 0, 0, 0))
        group = re.sub(r"[-_]?\d+(_\d+)?$", "", name) or name  # pool-0_1 and pool-0_2 together
        row = by_name.setdefault(group, dict.fromkeys(THREAD_FIELDS, 0.0))
        row["threads"] += 1
        row["wakeups_per_s"] += (vol - base[2] + invol - base[3]) / seconds
        row["voluntary_per_s"] += (vol - base[2]) / seconds
        row["cpu_ms_per_s"] += (ns - base[1]) / 1e6 / seconds
        run_ns += ns - base[1]
    rss = [r.rss for r in readings]
    return {
        "seconds": round(seconds, 2),
        "cpu_ms_per_s_stat": stat_ticks / TICK * 1000 / seconds,
        "cpu_ms_per_s_schedstat": run_ns / 1e6 / seconds,
        "rss_mib_steady": statistics.median(rss) / MIB,
        "rss_mib_peak": max(rss) / MIB,
        "vmhwm_mib_end": last.hwm / MIB,
        "threads_max": max(r.threads for r in readings),
        "processes": len({pid for pid, _ in cpu_seen}),
        "wakeups_per_s": sum(row["wakeups_per_s"] for row in by_name.values()),
        "threads_by_name": dict(sorted(by_name.items(), key=lambda kv: -kv[1]["wakeups_per_s"])),
    }


# --- one run ----------------------------------------------------------------------------------------


def measure(agent: str, load: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    port = free_port()
    process = start_agent(agent, args, tmp, port)
    # Scrapes through the warm-up too, in phase with the window: half a period after its start, then
    # every period, so that even a window shorter than the quiet load's period has a scrape.
    period = LOADS[load]
    t0 = time.monotonic() + args.warmup
    scraper = Scraper(port, period, t0 + period / 2 - (args.warmup + period / 2) // period * period)
    try:
        tree = Tree(process.pid, tmp / "threads.txt" if agent == "gpuscope" else None)
        scraper.start()
        time.sleep(max(0.0, t0 - time.monotonic()))
        readings = [tree.read()]
        t0 = readings[0].at
        for k in range(1, int(args.seconds) + 1):
            time.sleep(max(0.0, t0 + k - time.monotonic()))
            readings.append(tree.read())
        if process.poll() is not None:
            raise SystemExit(f"{agent} exited with status {process.returncode} during the run "
                             f"(log: {tmp / (agent + '.log')})")
        t1 = readings[-1].at
    finally:
        scraper.halt.set()
        stop(process)
        scraper.join(15)
    window = [s for s in scraper.scrapes if t0 <= s.at <= t1]
    ok = [s for s in window if s.ok]
    latencies = [s.ms for s in ok]
    result = {"agent": agent, "load": load, **summarize_window(readings),
              "skipped_processes": len(tree.skipped),
              "scrapes": len(window), "scrape_errors": len(window) - len(ok),
              "scrape_ms_p50": statistics.median(latencies) if latencies else None,
              "scrape_ms_p99": percentile(latencies, 0.99) if latencies else None,
              "body_bytes": int(statistics.median(s.size for s in ok)) if ok else None}
    print(f"  {agent:<9} {load:<6} CPU {result['cpu_ms_per_s_stat']:6.2f} ms/s (schedstat "
          f"{result['cpu_ms_per_s_schedstat']:6.2f}), RSS {result['rss_mib_steady']:6.1f} MiB, "
          f"{result['threads_max']} threads, {result['scrapes']} scrapes", file=sys.stderr, flush=True)
    return result


# --- report -----------------------------------------------------------------------------------------

ROWS = [
    ("CPU ms/s, stat (utime+stime)", "cpu_ms_per_s_stat", "{:.2f}"),
    ("CPU ms/s, schedstat (live threads)", "cpu_ms_per_s_schedstat", "{:.2f}"),
    ("RSS MiB, steady (median)", "rss_mib_steady", "{:.1f}"),
    ("RSS MiB, peak", "rss_mib_peak", "{:.1f}"),
    ("VmHWM MiB at the end", "vmhwm_mib_end", "{:.1f}"),
    ("threads (max)", "threads_max", "{:.0f}"),
    ("scrape ms p50", "scrape_ms_p50", "{:.2f}"),
    ("scrape ms p99", "scrape_ms_p99", "{:.2f}"),
    ("body bytes", "body_bytes", "{:,.0f}"),
    ("wake-ups/s, all threads", "wakeups_per_s", "{:.1f}"),
]


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def thread_medians(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    names = {name for r in runs for name in r["threads_by_name"]}
    zero = dict.fromkeys(THREAD_FIELDS, 0.0)
    out = {name: {k: statistics.median(r["threads_by_name"].get(name, zero)[k] for r in runs) for k in zero}
           for name in names}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["wakeups_per_s"]))


def fmt(template: str, value: float | None) -> str:
    return "-" if value is None else template.format(value)


def print_tables(runs: list[dict[str, Any]], agents: list[str], args: argparse.Namespace) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for load in args.load_names:
        period = LOADS[load]
        by_agent = {a: [r for r in runs if r["agent"] == a and r["load"] == load] for a in agents}
        print(f"\nload {load}: one scrape every {period:g} s; {args.seconds:g} s measured after "
              f"{args.warmup:g} s; median of {len(by_agent[agents[0]])} round(s)")
        header = f"{'':<36}" + "".join(f"{a:>14}" for a in agents)
        print(header + (f"{'gpuscope/peer':>15}" if len(agents) == 2 else ""))
        summary[load] = {}
        for label, key, template in ROWS:
            values = {a: median_of(by_agent[a], key) for a in agents}
            summary[load][key] = values
            line = f"{label:<36}" + "".join(f"{fmt(template, values[a]):>14}" for a in agents)
            if len(agents) == 2:
                g, p = values["gpuscope"], values["peer"]
                line += f"{fmt('{:.2f}', g / p if g is not None and p else None):>15}"
            print(line)
        threads = thread_medians(by_agent["gpuscope"])
        summary[load]["gpuscope_threads"] = threads
        print(f"\n  gpuscope threads by wake-ups ({load}), top {TOP_THREADS}:")
        print(f"  {'thread':<18}{'count':>6}{'wake-ups/s':>12}{'voluntary/s':>13}{'CPU ms/s':>10}")
        for name, row in list(threads.items())[:TOP_THREADS]:
            print(f"  {name:<18}{row['threads']:>6.0f}{row['wakeups_per_s']:>12.2f}"
                  f"{row['voluntary_per_s']:>13.2f}{row['cpu_ms_per_s']:>10.2f}")
    return summary


# --- py-spy -----------------------------------------------------------------------------------------


def profile(args: argparse.Namespace, tmp: Path, seconds: int = 20, top: int = 12) -> dict[str, Any]:
    """py-spy on an unscraped gpuscope: where its CPU goes (``record``, samples of threads running or
    wanting the GIL only), then where each thread waits (``dump``, with idle threads)."""
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        print("\nprofile: py-spy is not on PATH; skipped (pip install py-spy)")
        return {"skipped": "py-spy not on PATH"}
    port = free_port()
    process = start_agent("gpuscope", args, tmp, port)
    out = tmp / "py-spy.txt"
    try:
        time.sleep(min(args.warmup, 5.0))
        record = subprocess.run([pyspy, "record", "--pid", str(process.pid), "--duration", str(seconds),
                                 "--rate", "1000", "--threads", "--nonblocking", "--format", "raw",
                                 "--output", str(out)], capture_output=True, text=True, check=False)
        dump = subprocess.run([pyspy, "dump", "--pid", str(process.pid)], capture_output=True, text=True,
                              check=False)
    finally:
        stop(process)
    if record.returncode != 0 or not out.exists():
        print(f"\nprofile: py-spy failed ({record.returncode}): {record.stderr.strip()[-500:]}")
        return {"failed": record.stderr.strip()[-2000:]}
    stacks: Counter[str] = Counter()
    for line in out.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        if stack and samples.isdigit():
            stacks[stack] += int(samples)
    total = sum(stacks.values())
    print(f"\nprofile: py-spy record, {seconds} s at 1000 Hz of an unscraped gpuscope: {total} samples of a "
          f"running thread ({total / seconds:.1f} a second); top {top} stacks (thread, then the innermost "
          "frames):")
    threads: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    for stack, count in stacks.items():
        frames = stack.split(";")
        threads[frames[0]] += count
        leaves[frames[-1]] += count
    print("  by thread:     " + ", ".join(f"{name} {100 * n / (total or 1):.0f} %"
                                          for name, n in threads.most_common(8)))
    print("  by innermost frame (self time):")
    for frame, count in leaves.most_common(8):
        print(f"  {100 * count / (total or 1):5.1f} %  {frame}")
    print("  by stack:")
    rows = []
    for stack, count in stacks.most_common(top):
        frames = stack.split(";")
        rows.append({"samples": count, "stack": frames})
        print(f"  {100 * count / (total or 1):5.1f} %  {frames[0]}")
        for frame in frames[-3:]:
            print(f"           {frame}")
    print("\nprofile: py-spy dump at the end (every thread, where it waits):")
    text = dump.stdout if "Thread " in dump.stdout else dump.stderr
    text = text[text.find("Thread "):] if "Thread " in text else text  # past the command line
    print("  " + text.strip().replace("\n", "\n  "))
    return {"samples": total, "by_thread": dict(threads), "by_innermost_frame": dict(leaves.most_common(50)),
            "top": rows, "dump": dump.stdout}


def compile_gpuscope() -> None:
    """Byte-compile gpuscope's modules where they are missing, as installing a package does: an agent
    run from a source checkout under PYTHONDONTWRITEBYTECODE (as some CI images set) would otherwise
    compile every module at each start, and hold what compiling leaves in its heap (about 0.6 MiB)."""
    import compileall

    import gpuscope
    import gpuscope.exporters  # a directory of its own in a source checkout

    for directory in [*gpuscope.__path__, *gpuscope.exporters.__path__]:
        compileall.compile_dir(directory, quiet=1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--simulate", metavar="NAME", help=(
        "simulated node (bundled scenario or file); the default, demo, without --nvml-lib"))
    parser.add_argument("--nvml-lib", metavar="DIR", help="directory holding the libnvidia-ml.so.1 to use")
    parser.add_argument("--peer", metavar="CMD", help="peer exporter command; {port} is filled in")
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds measured per run (default 60)")
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds before measuring (default 15)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every agent and load (default 2)")
    parser.add_argument("--loads", default="quiet,busy", help="comma-separated loads (default quiet,busy)")
    parser.add_argument("--json", metavar="FILE", help="write every run and the medians as JSON")
    parser.add_argument("--profile", action="store_true", help="also profile gpuscope with py-spy (20 s)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (agent logs)")
    args = parser.parse_args()
    if args.simulate and args.nvml_lib:
        parser.error("--simulate and --nvml-lib exclude each other")
    if not args.nvml_lib:
        args.simulate = args.simulate or "demo"
        if args.peer:
            parser.error("--peer needs --nvml-lib: a peer cannot read the simulated node")
    args.load_names = [name.strip() for name in args.loads.split(",") if name.strip()]
    if not args.load_names or any(name not in LOADS for name in args.load_names):
        parser.error(f"--loads: choose among {', '.join(LOADS)}")
    agents = ["gpuscope", "peer"] if args.peer else ["gpuscope"]
    compile_gpuscope()

    node = f"simulated node {args.simulate}" if args.simulate else f"NVML from {args.nvml_lib}" + "".join(
        f", {k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MOCK_NVML_"))
    print(f"compare: {', '.join(agents)} on {node}; {psutil.cpu_count()} CPUs, Python "
          f"{sys.version.split()[0]}" + (f"; peer: {args.peer}" if args.peer else ""), flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpuscope-compare-"))
    runs: list[dict[str, Any]] = []
    try:
        for round_ in range(args.rounds):
            print(f"round {round_ + 1}/{args.rounds}", file=sys.stderr, flush=True)
            for load in args.load_names:
                for agent in agents:
                    runs.append({"round": round_, **measure(agent, load, args, tmp)})
        summary = print_tables(runs, agents, args)
        profiled = profile(args, tmp) if args.profile else None
    finally:
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        document = {"node": node, "peer": args.peer, "cpus": psutil.cpu_count(),
                    "python": sys.version.split()[0],
                    "seconds": args.seconds, "warmup": args.warmup, "rounds": args.rounds,
                    "runs": runs, "medians": summary, "profile": profiled}
        Path(args.json).write_text(json.dumps(document, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

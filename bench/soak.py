"""Memory soak: the agent's RSS over a long run at 0.1 s sampling, scraped once per second (not a test).

    python bench/soak.py                                  # `demo` node, 20 minutes (12,000 ticks)
    python bench/soak.py --duration 300 --json            # 5 minutes, JSON summary on stdout
    python bench/soak.py --tracemalloc                    # also: which source lines grew

Starts the real agent (`gpuscope run --simulate demo --sample-interval 0.1s`) as a subprocess, with a
configuration file that keeps every default on (alert rules, captures with the default policy and
profiler ports, the control API on a Unix socket, pod attribution through the simulated kubelet, the
Kineto daemon) and turns on the alert event log; every path it writes (event log, capture store,
Kineto directories, control socket) lies in a temporary directory, so a soak never touches /run or
/var/lib nor competes for the abstract socket @dynolog. Logging stays at `info`, into a file.

The `demo` scenario is the default because it exercises the most code: four GPUs with five
processes (spawned, so per-process lookup runs against live pids), pods from the simulated kubelet
(one GPU time-sliced between two pods), and over its five minutes every alert rule's pattern (power
cap, input-bound idle dips, a shared GPU, a stalled rank, skew, an Xid). It loops, so alerts fire and
resolve again every five minutes: event-log lines, alert history and capture attempts keep coming
through the whole run instead of settling into one steady state (bench-8x4 has more GPUs but no pods,
no Xid and fewer alert transitions).

While it runs: one GET /metrics per second (plain text, OpenMetrics and gzipped text in turn), and
/api/v1/snapshot and /api/v1/alerts every 10 s. Reported:
- RSS (psutil, every second), one row per minute: MiB, change, agent threads and open fds, ticks;
- start (once ready), peak and end RSS, and the least-squares slope (MiB/min) over the second half of
  the run with the growth it amounts to over that half (the goal: at most 1 MiB);
- ticks completed (the run goes on past --duration until duration/interval ticks are done, or 10 %
  longer at most). /metrics has no tick counter (only the last tick's timestamp and duration), so the
  agent is started through a small launcher (BOOTSTRAP below) that counts calls of Sampler.tick and
  writes the count, sys.getallocatedblocks() and the thread count to a file on SIGUSR1. It changes
  nothing else in the agent.

--tracemalloc starts the agent under `python -X tracemalloc=N`; the launcher dumps a snapshot on
SIGUSR2, taken after the first minute, at half time and at the end, and the table of the lines whose
allocations grew most (half to end, and first minute to end) is printed. Tracing costs memory and
CPU, so the RSS figures of such a run are not comparable with an untraced one.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from local_agent import free_port, stop, wait_ready, write_config

REPO = Path(__file__).resolve().parent.parent
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
MIB = 2**20
GOAL_MIB = 1.0  # growth over the second half that still counts as flat

# Run as `python -c BOOTSTRAP <stats dir> run ...`: the agent's own `main`, plus a tick counter and two
# signal handlers (run in the main thread, which only waits for SIGTERM).
BOOTSTRAP = r"""
import json, os, signal, sys, threading, time, tracemalloc
from gpuscope.sampling.sampler import Sampler
from gpuscope.cli.main import main

out = sys.argv[1]
ticks = 0
requests = {"stats": 0, "snapshot": 0}
real_tick = Sampler.tick

def counted_tick(self, generation=None):
    global ticks
    snapshot = real_tick(self, generation)
    ticks += 1
    return snapshot

def publish(name, document):
    with open(os.path.join(out, name + ".tmp"), "w") as file:
        json.dump(document, file)
    os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))

def on_stats(signum, frame):
    requests["stats"] += 1
    publish("stats.json", {"seq": requests["stats"], "ticks": ticks, "threads": threading.active_count(),
                           "allocated_blocks": sys.getallocatedblocks()})

def on_snapshot(signum, frame):
    requests["snapshot"] += 1
    seq = requests["snapshot"]
    started = time.perf_counter()
    tracemalloc.take_snapshot().dump(os.path.join(out, f"tracemalloc-{seq}.pickle"))
    current, peak = tracemalloc.get_traced_memory()
    publish(f"tracemalloc-{seq}.json", {"ticks": ticks, "traced_bytes": current, "traced_peak_bytes": peak,
                                        "seconds": time.perf_counter() - started})

Sampler.tick = counted_tick
signal.signal(signal.SIGUSR1, on_stats)
signal.signal(signal.SIGUSR2, on_snapshot)
sys.argv = ["gpuscope", *sys.argv[2:]]
sys.exit(main())
"""



def get(url: str, accept: str | None = None, gzipped: bool = False) -> bytes:
    headers = {"Accept": accept} if accept else {}
    if gzipped:
        headers["Accept-Encoding"] = "gzip"
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
        body: bytes = response.read()
        return gzip.decompress(body) if response.headers.get("Content-Encoding") == "gzip" else body


def agent_command(tmp: Path, args: argparse.Namespace, port: int) -> list[str]:
    python = [sys.executable, "-X", f"tracemalloc={args.frames}"] if args.tracemalloc else [sys.executable]
    config = write_config(tmp, alerting={"event_log": {"path": str(tmp / "events.jsonl")}})  # every feature
    return [*python, "-c", BOOTSTRAP, str(tmp), "run", "--config", str(config),
            "--simulate", args.scenario, "--sample-interval", str(args.interval),
            "--web.listen-address", f"127.0.0.1:{port}"]


def wait_for_file(path: Path, timeout: float, seq: int | None = None) -> dict[str, Any]:
    """The JSON document at ``path`` once it exists (and carries ``seq``, when given)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            document: dict[str, Any] = json.loads(path.read_text())
            if seq is None or document.get("seq") == seq:
                return document
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"the agent did not write {path.name} within {timeout:.0f} s")


class AgentStats:
    """The launcher's counters, asked for with SIGUSR1."""

    def __init__(self, pid: int, directory: Path) -> None:
        self.pid, self.path, self.seq = pid, directory / "stats.json", 0

    def read(self) -> dict[str, Any]:
        self.seq += 1
        os.kill(self.pid, signal.SIGUSR1)
        return wait_for_file(self.path, 10.0, self.seq)


def tracemalloc_snapshot(pid: int, directory: Path, seq: int) -> dict[str, Any]:
    os.kill(pid, signal.SIGUSR2)
    info = wait_for_file(directory / f"tracemalloc-{seq}.json", 300.0)
    info["path"] = str(directory / f"tracemalloc-{seq}.pickle")
    return info


def sample_value(text: str, name: str) -> float | None:
    """The value of an unlabelled sample ``name`` in a text exposition."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def labelled_sum(text: str, name: str, needle: str = "") -> float:
    """Sum of the samples of family ``name`` whose label set contains ``needle``."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and needle in line)


def slope_mib_per_min(points: list[tuple[float, int]]) -> float:
    """Least-squares slope of (seconds, bytes) points, in MiB per minute."""
    if len(points) < 2:
        return 0.0
    ts = [t for t, _ in points]
    rs = [r for _, r in points]
    t_mean, r_mean = statistics.fmean(ts), statistics.fmean(rs)
    var = sum((t - t_mean) ** 2 for t in ts)
    cov = sum((t - t_mean) * (r - r_mean) for t, r in zip(ts, rs, strict=True))
    return cov / var * 60 / MIB if var else 0.0


def scrape_once(base: str, n: int, counters: dict[str, int]) -> str | None:
    """One scrape (format by turn); every 10th second also the snapshot and alerts APIs."""
    kinds = (("text", None, False), ("openmetrics", OPENMETRICS, False), ("gzip", None, True))
    kind, accept, gzipped = kinds[n % len(kinds)]
    text = None
    try:
        body = get(base + "/metrics", accept, gzipped)
        counters["scrapes_" + kind] += 1
        text = body.decode() if kind != "openmetrics" else None
        if n % 10 == 0:
            json.loads(get(base + "/api/v1/snapshot"))
            json.loads(get(base + "/api/v1/alerts"))
            counters["api_calls"] += 2
    except (OSError, ValueError):
        counters["errors"] += 1
    return text


def minute_row(minute: int, elapsed: float, rss: int, *, previous: int | None, proc: psutil.Process,
               stats: dict[str, Any]) -> dict[str, Any]:
    return {"minute": minute, "elapsed_s": round(elapsed, 1), "rss_mib": round(rss / MIB, 2),
            "delta_mib": None if previous is None else round((rss - previous) / MIB, 2),
            "threads": proc.num_threads(), "fds": proc.num_fds(), "ticks": stats["ticks"],
            "py_blocks": stats["allocated_blocks"]}


def format_row(row: dict[str, Any]) -> str:
    delta = "" if row["delta_mib"] is None else f"{row['delta_mib']:+.2f}"
    return (f"{row['minute']:>6} {row['elapsed_s']:>8.0f} {row['rss_mib']:>9.2f} {delta:>7} "
            f"{row['threads']:>7} {row['fds']:>4} {row['ticks']:>7} {row['py_blocks']:>10}")


HEADER = f"{'minute':>6} {'t (s)':>8} {'RSS MiB':>9} {'Δ MiB':>7} {'threads':>7} {'fds':>4} {'ticks':>7} " \
         f"{'py blocks':>10}"


def soak(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp / "agent.log"
    with open(log_path, "wb") as log:
        agent = subprocess.Popen(agent_command(tmp, args, port), cwd=REPO, stdout=log,
                                 stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        proc = psutil.Process(agent.pid)
        wait_ready(base, agent)
        stats = AgentStats(agent.pid, tmp)
        counters = dict.fromkeys(
            ("scrapes_text", "scrapes_openmetrics", "scrapes_gzip", "api_calls", "errors"), 0)
        rss: list[tuple[float, int]] = []
        rows: list[dict[str, Any]] = []
        snapshots: list[dict[str, Any]] = []
        last_text = ""
        row_rss: int | None = None
        t0 = time.monotonic()
        print(HEADER, file=sys.stderr, flush=True)
        n = 0
        while True:
            elapsed = time.monotonic() - t0
            rss.append((elapsed, proc.memory_info().rss))
            # Past the duration, go on (10 % more at most) until the agent has done duration/interval
            # ticks: it skips the ticks it is too late for when the machine is busy.
            done = elapsed >= args.duration and (stats.read()["ticks"] >= args.duration / args.interval
                                                 or elapsed >= 1.1 * args.duration)
            if int(elapsed // 60) >= len(rows) or done:
                rows.append(minute_row(len(rows), elapsed, rss[-1][1], previous=row_rss, proc=proc,
                                       stats=stats.read()))
                row_rss = rss[-1][1]
                print(format_row(rows[-1]), file=sys.stderr, flush=True)
            if args.tracemalloc and ((len(snapshots) == 0 and elapsed >= 60)
                                     or (len(snapshots) == 1 and elapsed >= args.duration / 2)):
                snapshots.append(tracemalloc_snapshot(agent.pid, tmp, len(snapshots) + 1))
            if done:
                break
            started = time.monotonic()
            last_text = scrape_once(base, n, counters) or last_text
            n += 1
            time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
        if args.tracemalloc:
            snapshots.append(tracemalloc_snapshot(agent.pid, tmp, len(snapshots) + 1))
        final = stats.read()
        end_text = get(base + "/metrics").decode()
    finally:
        stop(agent, 10)
    return summarize(args, tmp, Run(rss, rows, counters, final, end_text or last_text, snapshots,
                                    agent.returncode))


@dataclass
class Run:
    rss: list[tuple[float, int]]  # (seconds since ready, bytes), one a second
    rows: list[dict[str, Any]]  # one a minute
    counters: dict[str, int]
    final: dict[str, Any]  # the launcher's last stats
    metrics: str  # the last text exposition
    snapshots: list[dict[str, Any]]  # tracemalloc snapshots taken
    returncode: int | None


def log_summary(path: Path) -> dict[str, Any]:
    levels = {"WARNING": 0, "ERROR": 0, "CRITICAL": 0}
    first: list[str] = []
    for line in path.read_text(errors="replace").splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[2] in levels:
            levels[parts[2]] += 1
            if len(first) < 5:
                first.append(line[:200])
    return {"lines_by_level": levels, "first_warnings": first}


def summarize(args: argparse.Namespace, tmp: Path, run: Run) -> dict[str, Any]:
    rss, snapshots, metrics = run.rss, run.snapshots, run.metrics
    duration = rss[-1][0]
    second_half = [(t, r) for t, r in rss if t >= duration / 2]
    slope = slope_mib_per_min(second_half)
    half_minutes = (second_half[-1][0] - second_half[0][0]) / 60
    window = max(1, min(60, len(second_half) // 4))  # a minute's readings at each end of the half
    raw = (statistics.fmean(r for _, r in second_half[-window:])
           - statistics.fmean(r for _, r in second_half[:window]))
    events = tmp / "events.jsonl"
    summary: dict[str, Any] = {
        "scenario": args.scenario,
        "interval_s": args.interval,
        "duration_s": round(duration, 1),
        "tracemalloc": args.tracemalloc,
        "python": sys.version.split()[0],
        "cpu": psutil.cpu_count(),
        "ticks": run.final["ticks"],
        "ticks_scheduled": int(duration / args.interval),
        "rss_mib_start": round(rss[0][1] / MIB, 2),
        "rss_mib_peak": round(max(r for _, r in rss) / MIB, 2),
        "rss_mib_end": round(rss[-1][1] / MIB, 2),
        "slope_mib_per_min_second_half": round(slope, 4),
        "growth_mib_second_half_fit": round(slope * half_minutes, 3),
        "growth_mib_second_half_raw": round(raw / MIB, 3),
        "flat": slope * half_minutes <= GOAL_MIB,
        "by_minute": run.rows,
        "requests": run.counters,
        "agent_exit_status": run.returncode,
        "alert_transitions": labelled_sum(metrics, "gpuscope_alert_transitions_total"),
        "event_log_lines": sum(1 for _ in events.open()) if events.exists() else 0,
        "captures": {outcome: labelled_sum(metrics, "gpuscope_captures_total", f'outcome="{outcome}"')
                     for outcome in ("captured", "empty", "failed", "refused", "unreachable", "exited",
                                     "busy")},
        "last_sample_duration_ms": round(
            (sample_value(metrics, "gpuscope_sample_duration_seconds") or 0.0) * 1000, 3),
        "agent_log": log_summary(tmp / "agent.log"),
    }
    if snapshots:
        summary["tracemalloc_snapshots"] = [
            {key: value for key, value in s.items() if key != "path"} for s in snapshots]
        summary["tracemalloc_growth"] = {
            "half_to_end": top_growth(snapshots[1]["path"], snapshots[-1]["path"], args.top),
            "first_minute_to_end": top_growth(snapshots[0]["path"], snapshots[-1]["path"], args.top),
        }
    return summary


def short(filename: str) -> str:
    for prefix in (str(REPO) + "/", "site-packages/"):
        if prefix in filename:
            return filename.split(prefix, 1)[1]
    return filename


def top_growth(before_path: str, after_path: str, top: int) -> list[dict[str, Any]]:
    """The ``top`` source lines whose live allocations grew most (largest growth first), each with the
    traceback through which it grew most."""
    ignore = [tracemalloc.Filter(False, "<frozen importlib._bootstrap*>"),
              tracemalloc.Filter(False, "<unknown>"), tracemalloc.Filter(False, tracemalloc.__file__)]
    before = tracemalloc.Snapshot.load(before_path).filter_traces(ignore)
    after = tracemalloc.Snapshot.load(after_path).filter_traces(ignore)
    # A Traceback runs from the oldest frame to the innermost one (the allocating line): [-1].
    by_trace = sorted(after.compare_to(before, "traceback"), key=lambda s: s.size_diff, reverse=True)
    out = []
    for stat in sorted(after.compare_to(before, "lineno"), key=lambda s: s.size_diff, reverse=True)[:top]:
        frame = stat.traceback[-1]
        where = next((s for s in by_trace if s.traceback[-1] == frame), None)
        out.append({
            "where": f"{short(frame.filename)}:{frame.lineno}",
            "size_diff_kib": round(stat.size_diff / 1024, 1),
            "count_diff": stat.count_diff,
            "size_kib": round(stat.size / 1024, 1),
            "biggest_traceback": [] if where is None else
            [f"{short(f.filename)}:{f.lineno}" for f in reversed(where.traceback[-8:])],
            "biggest_traceback_size_diff_kib": None if where is None else round(where.size_diff / 1024, 1),
        })
    return out


def print_report(summary: dict[str, Any]) -> None:
    print(f"soak: scenario {summary['scenario']}, every {summary['interval_s']:g} s for "
          f"{summary['duration_s']:.0f} s, Python {summary['python']}, {summary['cpu']} CPUs"
          + (", tracemalloc on" if summary["tracemalloc"] else ""))
    print(HEADER)
    for row in summary["by_minute"]:
        print(format_row(row))
    print(f"ticks: {summary['ticks']} (scheduled over the measured time: {summary['ticks_scheduled']})")
    print(f"RSS: start {summary['rss_mib_start']} MiB, peak {summary['rss_mib_peak']} MiB, "
          f"end {summary['rss_mib_end']} MiB")
    print(f"second half: slope {summary['slope_mib_per_min_second_half']:+.4f} MiB/min, growth "
          f"{summary['growth_mib_second_half_fit']:+.3f} MiB (fit) / "
          f"{summary['growth_mib_second_half_raw']:+.3f} MiB (last minute - first minute): "
          f"{'flat' if summary['flat'] else 'GROWING'} "
          f"(goal: at most {GOAL_MIB:g} MiB)")
    print(f"requests: {summary['requests']}")
    print(f"alert transitions: {summary['alert_transitions']:.0f}, event-log lines: "
          f"{summary['event_log_lines']}, captures: {summary['captures']}")
    print(f"agent log: {summary['agent_log']['lines_by_level']}, exit status {summary['agent_exit_status']}")
    for line in summary["agent_log"]["first_warnings"]:
        print("   ", line)
    for snap in summary.get("tracemalloc_snapshots", []):
        print(f"tracemalloc snapshot at tick {snap['ticks']}: traced {snap['traced_bytes'] / MIB:.2f} MiB "
              f"(taken in {snap['seconds']:.1f} s)")
    for name, stats in summary.get("tracemalloc_growth", {}).items():
        print(f"tracemalloc growth, {name.replace('_', ' ')}:")
        for stat in stats:
            print(f"  {stat['size_diff_kib']:>+9.1f} KiB {stat['count_diff']:>+7} blocks  {stat['where']}")
        if stats and stats[0]["biggest_traceback"]:
            print("  biggest traceback of the first line (innermost first):")
            for frame in stats[0]["biggest_traceback"]:
                print("     ", frame)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=1200.0,
                        help="seconds measured once the agent is ready (default 1200: 12,000 ticks at 0.1 s)")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between samples (default 0.1)")
    parser.add_argument("--scenario", default="demo", help="bundled scenario name or file (default demo)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary instead of the table")
    parser.add_argument("--tracemalloc", action="store_true", help="trace allocations; report what grew")
    parser.add_argument("--frames", type=int, default=25, help="frames kept per allocation (--tracemalloc)")
    parser.add_argument("--top", type=int, default=15, help="source lines reported (--tracemalloc)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (log, snapshots)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpuscope-soak-"))
    try:
        summary = soak(args, tmp)
    finally:
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_report(summary)


if __name__ == "__main__":
    main()

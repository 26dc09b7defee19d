"""Real-GPU scenarios: does gpuscope name the bottleneck of jobs whose bottleneck is known? (Not a
test: run by hand on a node with an NVIDIA GPU; never run in CI or from the tests.)

    python bench/gpu_scenarios.py                                   # every job, on GPU 0
    python bench/gpu_scenarios.py --jobs deep_narrow_mlp,seg_masked_loss --duration 3s
    python bench/gpu_scenarios.py --out results.json --markdown     # also JSON, and a Markdown table
    python bench/gpu_scenarios.py --python /opt/venv/bin/python     # the jobs' interpreter (torch, jax)
    python bench/gpu_scenarios.py --device-check                    # the GPU, driver, torch and jax here
    python bench/gpu_scenarios.py --dry-run-cpu                     # the same flow on a CPU-only machine

What it does:

1. Starts the agent, ``gpuscope run`` with the real NVML, as a subprocess. Everything it writes (the
   capture store, the Kineto trace and socket directories, the control socket) is in a temporary
   directory; its web listener is on a free loopback port. Alert-triggered captures are off, so that
   only this script's captures take the node's one capture slot.
2. Starts the jobs of bench/gpu_jobs/ one at a time on the GPU (``--gpu``, default 0): PyTorch jobs
   with ``KINETO_USE_DAEMON=1`` and ``KINETO_IPC_SOCKET_DIR`` set to the agent's Kineto socket
   directory, JAX jobs with ``jax.profiler.start_server(PORT)`` on a port the agent's
   ``capture.profiler_ports`` lists. Each job prints "ready" once warm, then its own step time.
3. After two of the job's step-time windows, captures the GPU through the agent's control socket as a
   user does, ``gpuscope capture --gpu 0 --duration 2s --json``, then diagnoses the stored capture
   with ``gpuscope captures explain ID --json``.
4. Prints a table: the job, the verdict expected and the one given, the top findings (kind,
   severity, share of the step time, count per step), the step time the job measured and the one the
   trace shows, the capture's outcome and how long it took from the request to the stored trace
   (from the moment ``gpuscope capture`` has reached the agent until it exits with the record), and
   whether the diagnosis matched. ``--out FILE`` writes the same as JSON, ``--markdown`` prints it as
   a Markdown table for docs/diagnosis.md.
5. Stops every process it started (each in its own process group) whatever happens: a job that fails
   or a capture that fails is recorded in the table and the next job runs; Ctrl-C stops the run and
   prints what it has. Each job has a bounded time (``--job-timeout``), and exits by itself when this
   script's end closes its standard input.

``--dry-run-cpu`` runs the same flow on a machine without a GPU, to test the script itself: the agent
simulates a node (``gpuscope run --simulate demo``), the jobs run on the CPU at tiny sizes, and each
is captured by its pid (``gpuscope capture --pid``), since the simulated GPUs' processes are the
simulator's. The verdicts then differ from a GPU's: a CPU trace has no device time to attribute.

Exit status: 0 when every job's diagnosis matched (a dry run: when every job was captured and
explained), 1 otherwise, 130 when interrupted.

What the diagnosis may say is read from ``gpuscope captures explain --json`` only: ``verdict``, and
per trace its ``findings`` (``kind``, ``severity``, ``share``, ``per_step``, ``summary``),
``mean_step_ms`` and ``steps``. A field missing from it shows as "-".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from local_agent import free_port
from scenario_processes import Agent, JobProcess, last_line

from gpuscope.common.durations import parse_duration

HERE = Path(__file__).resolve().parent
JOB_SCRIPTS = {"torch": HERE / "gpu_jobs" / "torch_jobs.py", "jax": HERE / "gpu_jobs" / "jax_jobs.py"}
HEALTHY = "healthy"
MAX_SOCKET_DIR = 54  # capture.kineto.socket_dir's limit: PyTorch binds a longer name inside it
TOP_FINDINGS = 3


@dataclass(frozen=True)
class Job:
    """A job and what a correct diagnosis of it says."""

    name: str
    framework: str  # torch or jax: which script of bench/gpu_jobs runs it
    expected: str  # as the table shows it
    verdicts: tuple[str, ...]  # acceptable verdicts; () means any verdict but healthy
    present: tuple[str, ...] = ()  # finding kinds that must be among the findings
    absent: tuple[str, ...] = ()  # finding kinds that must not be
    min_per_step: tuple[tuple[str, float], ...] = ()  # (kind, count per step it must reach)


JOBS = (
    Job("healthy_mlp_bf16", "torch", HEALTHY, (HEALTHY,)),
    Job("seg_masked_loss", "torch", "not healthy: host_sync (>= 4/step), tensor_cores_idle", (),
        present=("host_sync", "tensor_cores_idle"), min_per_step=(("host_sync", 4.0),)),
    Job("seg_fixed_loss", "torch", "tensor_cores_idle, no host_sync", ("tensor_cores_idle",),
        present=("tensor_cores_idle",), absent=("host_sync",)),
    Job("resnet50_dataloader_no_workers", "torch", "input_bound", ("input_bound",)),
    Job("deep_narrow_mlp", "torch", "launch_bound", ("launch_bound",)),
    # The generator's next() is Python the agent's captures do not trace (they take no Python stacks):
    # its time is host-bound, or input-bound where the analysis recognises the wait for the next batch.
    Job("jax_python_generator", "jax", "host_bound", ("host_bound",)),
)
JOB_NAMES = tuple(job.name for job in JOBS)


@dataclass
class Result:
    """One row of the table."""

    job: str
    expected: str
    verdict: str | None = None
    findings: list[dict[str, Any]] = field(default_factory=list)
    job_step_ms: float | None = None  # the job's own clock, before the capture
    job_step_ms_during_capture: float | None = None
    trace_step_ms: float | None = None  # the diagnosis's mean step
    trace_steps: int | None = None
    capture_id: str | None = None
    outcome: str | None = None  # the capture's: captured, busy, empty, unreachable, refused, failed
    capture_s: float | None = None  # from the request reaching the agent to the stored capture's record
    matched: bool | None = None
    why: str = ""  # what did not match, or what failed
    note: str = ""  # how the verdict was read, where it is not the job's own trace's
    error: str | None = None
    job_info: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0  # the whole scenario: start, warm-up, capture, explain


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


# ----------------------------------------------------------------------------- one scenario


@dataclass(frozen=True)
class Settings:
    gpu: int
    duration: float
    python: str
    dry_run: bool
    job_timeout: float
    ready_timeout: float


def job_environment(job: Job, agent: Agent, settings: Settings) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if job.framework == "torch":
        # Checks in with the agent's Kineto daemon, on the socket file it listens on.
        env |= {"KINETO_USE_DAEMON": "1", "KINETO_IPC_SOCKET_DIR": str(agent.kineto_sockets)}
    if settings.dry_run:
        env |= {"CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu"}
    else:
        # NVML numbers GPUs by PCI bus; CUDA, by default, fastest first: make the job's device 0 the
        # GPU the agent captures.
        env |= {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(settings.gpu),
                # JAX on the GPU or not at all (not quietly on the CPU); memory as it is used, not
                # 75% of the GPU at start.
                "JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    return env


def run_scenario(job: Job, agent: Agent, jax_port: int, settings: Settings, tmp: Path) -> Result:
    result = Result(job.name, job.expected)
    started = time.monotonic()
    deadline = started + settings.job_timeout
    command = [settings.python, str(JOB_SCRIPTS[job.framework]), job.name,
               "--max-seconds", f"{settings.job_timeout + 30:.0f}"]
    if job.framework == "jax":
        command += ["--port", str(jax_port)]
    if settings.dry_run:
        command.append("--tiny")
    process = JobProcess(command, job_environment(job, agent, settings), tmp / f"{job.name}.log")
    try:
        process.wait_steady(min(deadline, time.monotonic() + settings.ready_timeout))
        requested = time.monotonic()
        assert process.ready_at is not None
        result.job_step_ms = median(process.windows_after(process.ready_at, requested))
        capture(job, agent, process, settings, result=result, deadline=deadline)
        result.job_step_ms_during_capture = median(process.windows_after(requested, time.monotonic()))
        if result.outcome == "captured" and result.capture_id:
            explain(agent, process.proc.pid, result, deadline)
        judge(job, result)
    except RuntimeError as err:
        result.error = str(err)
    finally:
        result.job_info = dict(process.info)
        process.stop()
        result.seconds = round(time.monotonic() - started, 1)
    if result.error:
        result.matched, result.why = False, result.error
    return result


def remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise RuntimeError("the job's time (--job-timeout) ran out")
    return left


def capture(job: Job, agent: Agent, process: JobProcess, settings: Settings, *, result: Result,
            deadline: float) -> None:
    """``gpuscope capture``: the GPU (a dry run: the job's pid, as the simulated GPUs are not its)."""
    what = ["--pid", str(process.proc.pid)] if settings.dry_run else ["--gpu", str(settings.gpu)]
    run = agent.cli("capture", *what, "--duration", f"{settings.duration:g}s", "--json",
                    "--reason", f"bench/gpu_scenarios.py {job.name}", timeout=remaining(deadline))
    record = run.json()
    if not isinstance(record, dict):
        raise RuntimeError(f"capture: {run.failure()}")
    result.outcome = str(record.get("outcome"))
    result.capture_id = record.get("id") if record.get("files") else None  # only stored ones have files
    result.capture_s = round(run.ended - (run.first_stderr or run.started), 2)
    if result.outcome != "captured":
        error = " ".join(str(record.get("error") or "").split())
        raise RuntimeError(f"capture {result.outcome}" + (f": {error}" if error else ""))


def explain(agent: Agent, pid: int, result: Result, deadline: float) -> None:
    """``gpuscope captures explain ID --json``: the verdict and findings of the job's own trace."""
    assert result.capture_id is not None
    run = agent.cli("captures", "explain", result.capture_id, "--json", timeout=remaining(deadline))
    document = run.json()
    if not isinstance(document, dict):
        raise RuntimeError(f"captures explain: {run.failure()}")
    traces = [t for t in document.get("traces") or [] if isinstance(t, dict)]
    # Other processes on the GPU are in the capture too: the job's trace names its pid (Kineto:
    # <host>_<pid>.<ms>.pt.trace.json.gz; XSpace: <host>_pid<pid>.xplane.pb).
    own = [t for t in traces if f"_{pid}." in str(t.get("source")) or f"pid{pid}." in str(t.get("source"))]
    trace = own[0] if own else traces[0] if len(traces) == 1 else None
    verdict = trace.get("verdict") if trace is not None else document.get("verdict")
    result.verdict = verdict if isinstance(verdict, str) else None
    if trace is None:
        result.note = f"{len(traces)} traces, none named after pid {pid}: the capture's verdict"
        return
    result.findings = [finding_summary(f) for f in trace.get("findings") or [] if isinstance(f, dict)]
    if isinstance(trace.get("mean_step_ms"), (int, float)):
        result.trace_step_ms = round(float(trace["mean_step_ms"]), 3)
    if isinstance(trace.get("steps"), int):
        result.trace_steps = trace["steps"]


def finding_summary(finding: dict[str, Any]) -> dict[str, Any]:
    def number(key: str) -> float | None:
        value = finding.get(key)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    return {"kind": str(finding.get("kind")), "severity": str(finding.get("severity")),
            "share": number("share"), "per_step": number("per_step"),
            "summary": str(finding.get("summary") or "")}


def judge(job: Job, result: Result) -> None:
    """Whether the diagnosis says what the job was built to show; ``why`` lists what it does not."""
    if result.verdict is None:
        result.matched, result.why = False, result.why or "no verdict"
        return
    problems = []
    if job.verdicts and result.verdict not in job.verdicts:
        problems.append(f"verdict {result.verdict}, expected {' or '.join(job.verdicts)}")
    if not job.verdicts and result.verdict == HEALTHY:
        problems.append("verdict healthy")
    kinds = {f["kind"] for f in result.findings}
    problems += [f"no {kind} finding" for kind in job.present if kind not in kinds]
    problems += [f"a {kind} finding" for kind in job.absent if kind in kinds]
    for kind, least in job.min_per_step:  # a kind that is missing altogether is said above
        counts = [f["per_step"] for f in result.findings if f["kind"] == kind and f["per_step"] is not None]
        if kind in kinds and (not counts or max(counts) < least):
            problems.append(f"{kind} {max(counts) if counts else '?'}/step, expected >= {least:g}")
    result.matched = not problems
    result.why = "; ".join(problems)


# ----------------------------------------------------------------------------- the report


def format_findings(findings: list[dict[str, Any]], top: int = TOP_FINDINGS) -> str:
    parts = []
    for f in findings[:top]:
        text = f"{f['kind']} {f['severity']}"
        if f["share"] is not None:
            text += f" {f['share'] * 100:.0f}%"
        if f["per_step"] is not None:
            text += f" {f['per_step']:g}/step"
        parts.append(text)
    more = len(findings) - top
    return "; ".join(parts) + (f"; +{more}" if more > 0 else "") if parts else "-"


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def rows(results: list[Result]) -> list[list[str]]:
    table = [["job", "expected", "verdict", "top findings (kind severity share count)",
              "ms/step job / trace", "capture", "capture s", "match"]]
    for r in results:
        match = "-" if r.matched is None else "yes" if r.matched else "no" + (f": {r.why}" if r.why else "")
        if r.note:
            match += f" ({r.note})"
        table.append([r.job, r.expected, r.verdict or "-", format_findings(r.findings),
                      f"{ms(r.job_step_ms)} / {ms(r.trace_step_ms)}", r.outcome or "-",
                      "-" if r.capture_s is None else f"{r.capture_s:.1f}", match])
    return table


def print_table(table: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for n, row in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def markdown(table: list[list[str]]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| " + " | ".join(cell(c) for c in table[0]) + " |", "|" + "---|" * len(table[0])]
    for job, *rest in table[1:]:
        lines.append("| " + " | ".join([f"`{job}`", *(cell(c) for c in rest)]) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the node

PROBE = r"""
import json, sys
found = {"python": sys.version.split()[0], "executable": sys.executable}
try:
    import torch
    found["torch"] = torch.__version__
    found["torch_cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        found["torch_device"] = torch.cuda.get_device_name(0)
        found["torch_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        found["torch_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    else:
        found["torch_device"] = None
except Exception as err:
    found["torch"] = f"not importable: {err}"
try:
    import torchvision
    found["torchvision"] = torchvision.__version__
except Exception:
    found["torchvision"] = None
try:
    import jax
    found["jax"] = jax.__version__
    found["jax_devices"] = [f"{d.platform}:{d.device_kind}" for d in jax.devices()]
except Exception as err:
    found["jax"] = f"not usable: {' '.join(str(err).split())[:200]}"
print(json.dumps(found))
"""


def node_environment(settings: Settings) -> dict[str, Any]:
    """The GPU and driver (nvidia-smi), and the jobs' interpreter: torch, torchvision, jax."""
    found: dict[str, Any] = {"mode": "dry run on the CPU" if settings.dry_run else f"GPU {settings.gpu}"}
    if shutil.which("nvidia-smi"):
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=30,
                                 check=False)
            found["gpus"] = [line.strip() for line in smi.stdout.splitlines() if line.strip()] or \
                last_line(smi.stderr)
        except subprocess.TimeoutExpired:
            found["gpus"] = "nvidia-smi timed out"
    else:
        found["gpus"] = "no nvidia-smi"
    env = {**os.environ}
    if settings.dry_run:
        env |= {"CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu"}
    else:
        env |= {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(settings.gpu),
                "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    try:
        probe = subprocess.run([settings.python, "-c", PROBE], capture_output=True, text=True, timeout=180,
                               env=env, check=False)
        found |= json.loads(probe.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError, OSError) as err:
        found["probe"] = f"{settings.python} could not be asked: {err}"
    return found


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", default=",".join(JOB_NAMES), metavar="A,B,...",
                        help=f"Which jobs, in this order (default all: {', '.join(JOB_NAMES)}).")
    parser.add_argument("--duration", default="2s", metavar="DURATION",
                        help="Capture length, e.g. 2s or 500ms (default 2s).")
    parser.add_argument("--gpu", type=int, default=0, metavar="N",
                        help="The GPU (NVML index) to use (default 0).")
    parser.add_argument("--python", default=sys.executable, metavar="PATH",
                        help="The jobs' interpreter, with torch and jax (default: this one).")
    parser.add_argument("--job-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="Most time one job may take, start to explained capture (default 600).")
    parser.add_argument("--ready-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="Most time a job may take to warm up (default 300).")
    parser.add_argument("--out", type=Path, metavar="FILE", help="Also write the results as JSON.")
    parser.add_argument("--markdown", action="store_true", help="Also print the table in Markdown.")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="Keep the agent's and jobs' logs and the captures in DIR (default: removed).")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                        help="The agent's log level (its log: agent.log, kept with --keep).")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--device-check", action="store_true",
                      help="Print the GPU, driver, torch and jax present, and exit.")
    mode.add_argument("--dry-run-cpu", action="store_true",
                      help="The same flow without a GPU: a simulated node, the jobs on the CPU at "
                           "tiny sizes.")
    args = parser.parse_args(argv)
    args.job_list = [name.strip() for name in args.jobs.split(",") if name.strip()]
    unknown = [name for name in args.job_list if name not in JOB_NAMES]
    if unknown or not args.job_list:
        parser.error(f"--jobs: unknown {', '.join(unknown)}; known: {', '.join(JOB_NAMES)}" if unknown
                     else "--jobs: name at least one")
    try:
        args.duration_s = parse_duration(args.duration)
    except ValueError as err:
        parser.error(f"--duration: {err}")
    return args


def work_directory() -> Path:
    """Where the agent and the jobs write: short enough for the Kineto socket directory's limit."""
    path = Path(tempfile.mkdtemp(prefix="gpuscope-gpu-"))
    if len(str(path / "kineto-ipc").encode()) > MAX_SOCKET_DIR:  # a long $TMPDIR
        path.rmdir()
        path = Path(tempfile.mkdtemp(prefix="gpuscope-gpu-", dir="/tmp"))
    return path


def keep_files(tmp: Path, keep: Path) -> Path:
    """Copy the logs, the configuration and the captures to a new folder in ``keep`` (sockets and
    other special files left out)."""

    def special(folder: str, names: list[str]) -> list[str]:
        paths = ((name, Path(folder, name)) for name in names)
        return [name for name, path in paths if not (path.is_dir() or path.is_file())]

    keep.mkdir(parents=True, exist_ok=True)
    destination = Path(tempfile.mkdtemp(prefix="gpu-scenarios-", dir=keep))
    shutil.copytree(tmp, destination, ignore=special, dirs_exist_ok=True)
    return destination


def interrupt_on_signals() -> None:
    """Ctrl-C and SIGTERM both raise KeyboardInterrupt, so that the finally blocks stop every process
    started. SIGINT's handler is set too: a shell starts a background command with SIGINT ignored."""

    def handler(signum: int, frame: Any) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second one must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = Settings(gpu=args.gpu, duration=args.duration_s, python=args.python, dry_run=args.dry_run_cpu,
                        job_timeout=args.job_timeout, ready_timeout=args.ready_timeout)
    environment = node_environment(settings)
    if args.device_check:
        for key, value in environment.items():
            print(f"{key:18} {value}")
        return 0
    interrupt_on_signals()
    jobs = [next(job for job in JOBS if job.name == name) for name in args.job_list]
    tmp = work_directory()
    results: list[Result] = []
    interrupted = False
    began = time.monotonic()
    jax_port = free_port()
    agent = Agent(tmp, simulate=settings.dry_run, profiler_port=jax_port, log_level=args.log_level)
    try:
        print(f"agent: {' '.join(agent.command[1:])}", file=sys.stderr)
        agent.start()
        for job in jobs:
            print(f"{job.name}: starting", file=sys.stderr)
            try:
                result = run_scenario(job, agent, jax_port, settings, tmp)
            except Exception as err:  # one job's failure is a row of the table, not the end of the run
                result = Result(job.name, job.expected, matched=False, why=f"{type(err).__name__}: {err}",
                                error=f"{type(err).__name__}: {err}")
            results.append(result)
            print(f"{job.name}: {result.verdict or '-'} ({'matched' if result.matched else result.why}) "
                  f"in {result.seconds:.0f} s", file=sys.stderr)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: stopping the agent and the jobs", file=sys.stderr)
    except RuntimeError as err:
        print(f"gpu_scenarios: {err}", file=sys.stderr)
        return 1
    finally:
        agent.stop()
        if args.keep is not None:
            with contextlib.suppress(OSError):
                print(f"logs and captures kept in {keep_files(tmp, args.keep)}", file=sys.stderr)
        shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.monotonic() - began
    table = rows(results)
    where = describe(environment, settings)
    print(f"\n{where}; {elapsed:.0f} s in all")
    if settings.dry_run:
        print("(a dry run: CPU traces have no device time, so the verdicts are not a GPU's)")
    print_table(table)
    if args.markdown:
        print(f"\n{where}:\n\n{markdown(table)}")
    if args.out is not None:
        args.out.write_text(json.dumps({"environment": environment, "duration_s": settings.duration,
                                        "seconds": round(elapsed, 1), "interrupted": interrupted,
                                        "jobs": [asdict(job) for job in jobs],
                                        "results": [asdict(r) for r in results]}, indent=2) + "\n")
    if interrupted:
        return 130
    if settings.dry_run:  # the flow is under test, not the verdicts: every job captured and explained
        return 0 if results and all(r.error is None and r.verdict for r in results) else 1
    return 0 if results and all(r.matched for r in results) else 1


def describe(environment: dict[str, Any], settings: Settings) -> str:
    """One line: the GPU and driver, torch and jax, the capture length."""
    if settings.dry_run:
        device = "a dry run on the CPU (simulated node)"
    else:
        device = str(environment.get("torch_device") or f"GPU {settings.gpu}")
        gpus = environment.get("gpus")
        for line in gpus if isinstance(gpus, list) else ():
            fields = [f.strip() for f in line.split(",")]
            if len(fields) >= 3 and fields[0] == str(settings.gpu):  # index, name, driver, memory
                device = f"{fields[1]}, driver {fields[2]}"
    torch = environment.get("torch")
    if environment.get("torch_cuda"):
        torch = f"{torch} (CUDA {environment['torch_cuda']})"
    return f"{device}; torch {torch}, jax {environment.get('jax')}; captures of {settings.duration:g} s"


if __name__ == "__main__":
    sys.exit(main())

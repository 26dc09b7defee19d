"""How long the Kineto backend waits for a job's trace, what it reads of it, and how it tells a job
that exited: scripted jobs (tests/workloads/kineto_scripted_job.py) that poll the daemon as PyTorch
does and then behave as asked, and a real PyTorch job whose trace takes longer to write than the
capture's deadline margin, captured with the agent's default settings."""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from capturing import (
    TORCH_WORKLOAD,
    WORKLOADS,
    DirectoryStaging,
    Workload,
    require_torch,
    start,
    stop,
    wait_ready,
)
from snapshots import FakeSource
from test_control_api import short_dir as short_directory

from gpuscope.capture.config import CaptureConfig
from gpuscope.capture.factory import build_captures
from gpuscope.capture.kineto.backend import KinetoBackend
from gpuscope.capture.kineto.daemon import KinetoDaemon, PendingTrace
from gpuscope.capture.kineto.trace_wait import MAX_ENTRIES, TooManyEntries, process_alive, scan_trace_dir
from gpuscope.capture.model import BackendResult, CaptureTarget, Trigger
from gpuscope.capture.service import CaptureRequest

SCRIPTED_JOB = WORKLOADS / "kineto_scripted_job.py"
MIB = 2**20


@pytest.fixture(scope="module")
def short_dir() -> Iterator[Path]:
    with short_directory() as path:
        yield path


@pytest.fixture(scope="module")
def daemon(short_dir: Path) -> Iterator[KinetoDaemon]:
    with KinetoDaemon(socket_dir=short_dir / "sock", trace_dir=short_dir / "traces") as running:
        yield running


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[list[Workload]]:
    started: list[Workload] = []
    try:
        yield started
    finally:
        for job in started:
            stop(job)


def scripted_job(daemon: KinetoDaemon, jobs: list[Workload], tmp_path: Path, behaviour: str,
                 *options: str) -> Workload:
    """A scripted job, registered with ``daemon``."""
    job = start(SCRIPTED_JOB, tmp_path, f"{behaviour}-{len(jobs)}", daemon.address, behaviour, *options)
    jobs.append(job)
    wait_ready(job)
    end = time.monotonic() + 10
    while job.pid not in daemon.registered():
        assert time.monotonic() < end, f"pid {job.pid} never registered"
        time.sleep(0.02)
    return job


def capture(backend: KinetoBackend, job: Workload, out: Path, *, duration_s: float = 0.5,
            margin_s: float = 1.0) -> BackendResult:
    return backend.capture(CaptureTarget("kineto", job.pid, source="kineto-registration"), duration_s,
                           DirectoryStaging(out), deadline_s=duration_s + margin_s)


def staged(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir()) if out.exists() else []


# --- jobs that exit --------------------------------------------------------------------------------

def test_a_job_that_exits_before_taking_the_config_has_exited(daemon: KinetoDaemon, jobs: list[Workload],
                                                               tmp_path: Path) -> None:
    job = scripted_job(daemon, jobs, tmp_path, "write")
    stop(job)  # it polled (it is still registered), then ended
    result = capture(KinetoBackend(daemon), job, tmp_path / "out", margin_s=10.0)
    assert result.outcome == "exited", result
    assert re.fullmatch(rf"pid {job.pid} exited before it took the trace config, [0-9.]+ s after the capture "
                        r"was asked for", result.error or ""), result.error
    assert list(daemon.trace_dir.iterdir()) == []


def test_a_job_that_exits_during_the_capture_has_exited(daemon: KinetoDaemon, jobs: list[Workload],
                                                        tmp_path: Path) -> None:
    job = scripted_job(daemon, jobs, tmp_path, "exit")
    result = capture(KinetoBackend(daemon), job, tmp_path / "out", duration_s=5.0)
    assert result.outcome == "exited", result
    assert re.fullmatch(rf"pid {job.pid} exited during the capture, [0-9.]+ s after it took the trace "
                        r"config, before writing its trace", result.error or ""), result.error
    assert staged(tmp_path / "out") == []


def test_a_job_that_took_the_config_and_exited_before_the_daemon_marked_it_is_not_called_early(
        daemon: KinetoDaemon, tmp_path: Path) -> None:
    """Under load the daemon's thread may mark the delivery after the job, its reply read, has exited:
    the capture waits for that mark instead of saying the job never took the config."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    pid = int(gone.stdout)
    assert not process_alive(pid)
    trace = PendingTrace(pid=pid, directory=tmp_path, config=b"", created=time.monotonic(), sending=True)

    def mark_late() -> None:
        time.sleep(0.3)
        trace.delivered = time.monotonic()
        trace.event.set()

    threading.Thread(target=mark_late, daemon=True).start()
    backend = KinetoBackend(daemon)
    start = time.monotonic()
    assert backend._wait_for_delivery(trace, start, start + 5.0, 5.0) is None
    unsent = PendingTrace(pid=pid, directory=tmp_path, config=b"", created=time.monotonic())
    result = backend._wait_for_delivery(unsent, start, time.monotonic() + 5.0, 5.0)
    assert result is not None and result.outcome == "exited", result


def test_a_job_that_exits_while_writing_has_exited(daemon: KinetoDaemon, jobs: list[Workload],
                                                   tmp_path: Path) -> None:
    job = scripted_job(daemon, jobs, tmp_path, "exit-writing")
    result = capture(KinetoBackend(daemon), job, tmp_path / "out")
    assert result.outcome == "exited", result
    assert re.fullmatch(rf"pid {job.pid} exited before its trace was complete, [0-9.]+ s after the recording "
                        rf"ended \(trace_{job.pid}\.json\.tmp held [0-9.]+ KiB\)", result.error or ""), \
        result.error
    assert staged(tmp_path / "out") == []


# --- jobs that take their time ---------------------------------------------------------------------

def test_a_job_still_writing_past_the_margin_is_waited_for(daemon: KinetoDaemon, jobs: list[Workload],
                                                           tmp_path: Path) -> None:
    """Its file stays empty for 2 s (a PyTorch job converting what it recorded), then grows for 2 s:
    past the 1 s margin, so a fixed deadline would have given up on it."""
    job = scripted_job(daemon, jobs, tmp_path, "grow", "--empty-for", "2", "--seconds", "2")
    result = capture(KinetoBackend(daemon), job, tmp_path / "out", margin_s=1.0)
    assert result.outcome == "captured", result
    (name,) = result.files
    text = gzip.decompress((tmp_path / "out" / name).read_bytes())
    assert text.startswith(b'{"schemaVersion": 1') and text.rstrip().endswith(b"]}")
    assert list(daemon.trace_dir.iterdir()) == []


def test_a_job_that_stops_writing_fails_after_the_stall_bound(daemon: KinetoDaemon, jobs: list[Workload],
                                                              tmp_path: Path) -> None:
    job = scripted_job(daemon, jobs, tmp_path, "stall")
    result = capture(KinetoBackend(daemon, stall_timeout_s=1.0), job, tmp_path / "out", margin_s=30.0)
    assert result.outcome == "failed", result
    assert re.fullmatch(rf"pid {job.pid} stopped writing its trace: trace_{job.pid}\.json\.tmp held "
                        r"[0-9.]+ KiB and had not grown for 1s", result.error or ""), result.error
    assert staged(tmp_path / "out") == []
    assert list(daemon.trace_dir.iterdir()) == []  # given up: its folder is removed


def test_a_job_still_writing_at_the_write_timeout_fails_naming_it(daemon: KinetoDaemon, jobs: list[Workload],
                                                                  tmp_path: Path) -> None:
    job = scripted_job(daemon, jobs, tmp_path, "grow", "--seconds", "60")
    result = capture(KinetoBackend(daemon, write_timeout_s=1.5), job, tmp_path / "out", margin_s=30.0)
    assert result.outcome == "failed", result
    assert re.fullmatch(rf"pid {job.pid} had not finished its trace 1\.5s after the recording ended "
                        rf"\(capture\.kineto\.write_timeout\): trace_{job.pid}\.json\.tmp held "
                        r"[0-9.]+ [KM]iB", result.error or ""), result.error


def test_a_job_that_writes_no_file_is_unreachable_after_the_margin(
        daemon: KinetoDaemon, jobs: list[Workload], tmp_path: Path) -> None:
    job = scripted_job(daemon, jobs, tmp_path, "no-file")
    result = capture(KinetoBackend(daemon), job, tmp_path / "out", margin_s=1.0)
    assert result.outcome == "unreachable", result
    assert (result.error or "").startswith(f"pid {job.pid} took the trace config but wrote no trace: no "
                                           "trace_<pid>.json.tmp appeared within 1s of the recording's end")
    assert "capture.kineto.trace_dir" in (result.error or "")


def test_the_agent_stopping_ends_the_wait_for_a_trace(short_dir: Path, jobs: list[Workload],
                                                      tmp_path: Path) -> None:
    own = KinetoDaemon(socket_dir=short_dir / "sock-stop", trace_dir=short_dir / "traces-stop")
    own.start()
    try:
        job = scripted_job(own, jobs, tmp_path, "grow", "--empty-for", "600")
        results: list[BackendResult] = []
        thread = threading.Thread(target=lambda: results.append(capture(KinetoBackend(own), job,
                                                                        tmp_path / "out", margin_s=1.0)))
        thread.start()
        end = time.monotonic() + 20
        while not any(own.trace_dir.glob("*/*.json.tmp")):  # the job took the config and is "converting"
            assert time.monotonic() < end and thread.is_alive(), results
            time.sleep(0.02)
    finally:
        own.stop()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert [(r.outcome, r.error) for r in results] == [("unreachable", "the Kineto daemon stopped")]


# --- sizes -----------------------------------------------------------------------------------------

def test_a_finished_trace_over_the_cap_is_not_read(daemon: KinetoDaemon, jobs: list[Workload],
                                                   tmp_path: Path) -> None:
    job = scripted_job(daemon, jobs, tmp_path, "write-direct", "--bytes", str(2 * MIB))
    result = capture(KinetoBackend(daemon, max_trace_bytes=MIB), job, tmp_path / "out")
    assert result.outcome == "failed", result
    assert re.fullmatch(r"the trace is 2\.[0-9] MiB, larger than capture\.kineto\.max_trace_bytes "
                        r"\(1\.0 MiB\); it was not read\. Capture for less time, or raise the limit",
                        result.error or ""), result.error
    assert staged(tmp_path / "out") == []


def test_a_trace_growing_past_the_cap_is_given_up_early(daemon: KinetoDaemon, jobs: list[Workload],
                                                        tmp_path: Path) -> None:
    job = scripted_job(daemon, jobs, tmp_path, "grow", "--seconds", "60")
    result = capture(KinetoBackend(daemon, max_trace_bytes=MIB), job, tmp_path / "out", margin_s=30.0)
    assert result.outcome == "failed", result
    assert re.fullmatch(r"the trace has grown to 1\.[0-9] MiB, larger than capture\.kineto\.max_trace_bytes "
                        r"\(1\.0 MiB\); it was not read\. .*", result.error or ""), result.error
    assert staged(tmp_path / "out") == []


def test_a_trace_over_the_grpc_cap_is_captured_with_the_defaults(daemon: KinetoDaemon, jobs: list[Workload],
                                                                 tmp_path: Path) -> None:
    """100 MiB of JSON: over capture.max_trace_bytes (the memory cap of gRPC responses, 64 MiB), under
    capture.kineto.max_trace_bytes, which applies to trace files."""
    defaults = CaptureConfig()
    assert defaults.max_trace_bytes == 64 * MIB
    backend = KinetoBackend(daemon)
    assert (backend.max_trace_bytes, backend.write_timeout_s) == (defaults.kineto.max_trace_bytes,
                                                                  defaults.kineto.write_timeout)
    job = scripted_job(daemon, jobs, tmp_path, "write", "--bytes", str(100 * MIB))
    result = capture(backend, job, tmp_path / "out", margin_s=defaults.deadline_margin)
    assert result.outcome == "captured", result
    (name,) = result.files
    size = 0
    with gzip.open(tmp_path / "out" / name, "rb") as stored:
        while chunk := stored.read(MIB):
            size += len(chunk)
            last = chunk
    assert 100 * MIB <= size < 101 * MIB and last.rstrip().endswith(b"]}")


# --- what the wait looks at -------------------------------------------------------------------------

def test_a_trace_folder_is_scanned_within_a_bound(tmp_path: Path) -> None:
    (tmp_path / "trace_7.json.tmp").write_bytes(b"{}")
    (tmp_path / "trace_7.json.tmp.link").symlink_to("/etc/passwd")
    files = scan_trace_dir(tmp_path)
    assert files.done is None and [(n, size) for n, size, _ in files.writing] == [("trace_7.json.tmp", 2)]
    (tmp_path / "elsewhere.json").symlink_to(tmp_path / "trace_7.json.tmp")  # never taken for the trace
    assert scan_trace_dir(tmp_path).done is None
    for n in range(MAX_ENTRIES):
        (tmp_path / f"junk{n}").touch()
    with pytest.raises(TooManyEntries):
        scan_trace_dir(tmp_path)
    assert scan_trace_dir(tmp_path / "gone") == scan_trace_dir(tmp_path / "also-gone")


def test_an_exited_process_is_not_alive_before_its_parent_reaps_it() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert process_alive(child.pid) and process_alive(os.getpid())
    finally:
        assert child.stdin is not None
        child.stdin.close()
    end = time.monotonic() + 10
    while process_alive(child.pid):  # a zombie until waited for: not running all the same
        assert time.monotonic() < end
        time.sleep(0.01)
    assert os.path.exists(f"/proc/{child.pid}")  # still there, not reaped
    child.wait()
    assert not process_alive(child.pid)


# --- a real PyTorch job -----------------------------------------------------------------------------

def test_a_busy_pytorch_job_is_captured_with_the_default_settings(short_dir: Path, tmp_path: Path) -> None:
    """A training loop of many small ops, polling at PyTorch's own pace (5 s): a 2 s capture records
    about 1.4 million events, which the job converts and writes as 200-450 MiB of JSON over 8-29 s on
    a 2-core VM. Its trace is complete later than the capture's length and capture.deadline_margin
    (12 s from the request), and larger than capture.max_trace_bytes (64 MiB, gRPC's cap): it takes
    the Kineto backend's own wait and cap to capture it."""
    require_torch()
    config = CaptureConfig.model_validate({
        "store": {"root": str(tmp_path / "store")},
        "kineto": {"trace_dir": str(short_dir / "busy-traces"), "socket_dir": str(short_dir / "busy-ipc")},
        "analysis": {"enabled": False}})  # what the trace shows is not this test's subject
    captures = build_captures(config, snapshots=FakeSource(), hostname="node-1")
    assert captures is not None
    captures.start()
    job = start(TORCH_WORKLOAD, tmp_path, "busy", "--many-small-ops",
                env={"KINETO_USE_DAEMON": "1", "KINETO_IPC_SOCKET_DIR": str(short_dir / "busy-ipc")},
                unset=("KINETO_CONFIG",))
    try:
        wait_ready(job)
        end = time.monotonic() + 30
        while job.pid not in captures.kineto.registered():
            assert time.monotonic() < end, job.log.read_text()
            time.sleep(0.05)
        record = captures.service.submit(CaptureRequest(Trigger("user", user="test"), pid=job.pid,
                                                        duration_s=2.0)).result(timeout=300)
        assert record.outcome == "captured", (record, job.log.read_text()[-2000:])
        (name,) = record.files
        stored = captures.store.path(record.id) / name
        with gzip.open(stored, "rb") as trace:
            head = trace.read(MIB)
        assert b'"traceEvents"' in head and b'"aten::mm"' in head
    finally:
        stop(job)
        captures.stop()

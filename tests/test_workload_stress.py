"""Captures of a PyTorch job that serves gpuscope.workload, under CPU load, through the stress harness
(bench/capture_stress.py; its 200-run figures are measured by hand): the job survives every capture,
each trace is whole, and Kineto was started on serve()'s thread rather than on the server's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from capturing import require_torch

STRESS = Path(__file__).resolve().parent.parent / "bench" / "capture_stress.py"


def run_stress(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, object]]:
    out = tmp_path / "stress.json"
    command = [sys.executable, str(STRESS), "--json", str(out), "--logs", str(tmp_path / "logs"), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    return result, json.loads(out.read_text())


def test_captures_under_load_leave_the_job_running_and_every_trace_whole(tmp_path: Path) -> None:
    require_torch()
    result, report = run_stress(tmp_path, "--runs", "6", "--captures-per-job", "3", "--load", "1",
                                "--train-threads", "2", "--duration-ms", "100")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (report["runs"], report["jobs"], report["failed"]) == (6, 2, 0), report
    assert report["init_on_another_thread"] == 0, report
    assert report["training_threads_seen_min"] == 1, report  # the thread that reached the step boundary


def test_the_harness_fails_a_job_that_answers_without_a_trace(tmp_path: Path) -> None:
    require_torch()
    result, report = run_stress(tmp_path, "--runs", "1", "--load", "0", "--train-threads", "0",
                                "--workload-arg=--idle")
    assert result.returncode == 1, result.stdout + result.stderr
    assert report["failed"] == 1 and "empty_trace=True" in str(report["failures"]), report

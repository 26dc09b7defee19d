"""The diagnosis on real training jobs captured through the agent's real capture path.

A real agent (`gpuscope run --simulate demo`) captures real PyTorch and JAX jobs on the CPU, each with
a known problem (tests/workloads/pattern_workload.py): a slow input pipeline, a host read-back every
step, or none. The command-line client asks for each capture (`gpuscope capture --target`), and
`gpuscope captures explain` must name the problem; so must the agent's own analysis of the stored
capture, in its record (`gpuscope captures ls --json`).

The machine may have few cores: each job runs only while it is captured (started, captured for 3 s,
stopped), so the jobs never compete with each other, and every test of a job reuses its capture.
Not marked ``e2e``: that marks the tests that need Prometheus and Alertmanager; like
test_demo_capture.py, this needs only the agent, torch and jax.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from agent_process import RunningAgent, run_agent
from capturing import WORKLOADS, free_port, require_jax, require_torch, start, stop, wait_ready

from gpuscope.analysis.diagnose import MODERATE
from gpuscope.cli.main import main

PATTERN_WORKLOAD = WORKLOADS / "pattern_workload.py"
CAPTURE = "3s"
ANALYSIS_WAIT_S = 60.0
TRACE_SUFFIXES = (".pt.trace.json.gz", ".xplane.pb")  # gpuscope.workload's, JAX's
# (framework, pattern) -> the verdict the diagnosis must give.
EXPECTED = {
    ("torch", "slow_input"): "input_bound",
    ("torch", "sync"): "host_sync",
    ("torch", "healthy"): "healthy",
    # The generator's sleep is Python the profiler does not trace: the thread that dispatches the
    # steps runs no traced operation while the computation waits.
    ("jax", "slow_input"): "host_bound",
    ("jax", "healthy"): "healthy",
}
CASES = [pytest.param(case, id=f"{case[0]}-{case[1]}") for case in EXPECTED]


@dataclass(frozen=True)
class Agent:
    running: RunningAgent
    socket: Path
    tmp: Path


@dataclass(frozen=True)
class Captured:
    framework: str
    pattern: str
    record: dict[str, Any]
    report: dict[str, Any]  # `gpuscope captures explain ID --json`

    @property
    def id(self) -> str:
        return str(self.record["id"])

    def describe(self) -> str:
        return json.dumps(self.report, indent=1)[:6000]


def cli(*argv: str) -> tuple[int, str, str]:
    """`gpuscope ARGV` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exit_:  # argparse: usage errors
            code = int(exit_.code or 0)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    tmp = tmp_path_factory.mktemp("explain-agent")
    # The demo's alerts off (an alert's capture would hold the node's one slot when a test asks for
    # its own) and room in the hourly budget for every case.
    env = {"GPUSCOPE_ALERTING__ENABLED": "false", "GPUSCOPE_CAPTURE__USER_HOURLY_BUDGET": "60"}
    with run_agent(tmp, "--simulate", "demo", env=env) as running:
        yield Agent(running, tmp / f"control-{running.port}.sock", tmp)


@pytest.fixture(scope="module", params=CASES)
def captured(request: pytest.FixtureRequest, agent: Agent) -> Captured:
    """The job of this case, started, captured through the agent for 3 s and stopped; its record and
    the diagnosis of the stored capture."""
    framework, pattern = request.param
    (require_torch if framework == "torch" else require_jax)()
    env = {"JAX_PLATFORMS": "cpu"} if framework == "jax" else {}
    port = "0" if framework == "torch" else str(free_port())
    job = start(PATTERN_WORKLOAD, agent.tmp, f"{framework}-{pattern}", framework, pattern, port,
                port=int(port), env=env, unset=("KINETO_USE_DAEMON",))
    try:
        wait_ready(job)
        code, out, err = cli("capture", "--target", job.address, "--duration", CAPTURE, "--json",
                             "--socket", str(agent.socket))
    finally:
        stop(job)
    assert code == 0, f"{err}\n{out}\njob:\n{job.log.read_text()}\nagent:\n{agent.running.stderr()[-4000:]}"
    record = json.loads(out)
    assert record["outcome"] == "captured" and record["files"], record
    code, out, err = cli("captures", "explain", record["id"], "--json", "--socket", str(agent.socket))
    assert code == 0, err
    return Captured(framework, pattern, record, json.loads(out))


def top(report: dict[str, Any]) -> dict[str, Any] | None:
    findings = [f for trace in report["traces"] for f in trace["findings"]]
    return findings[0] if findings else None


def test_explain_names_the_problem(captured: Captured) -> None:
    expected = EXPECTED[(captured.framework, captured.pattern)]
    report = captured.report
    assert report["path"] == f"capture {captured.id}"
    assert report["verdict"] == expected, captured.describe()
    (trace,) = report["traces"]
    if captured.framework == "torch":
        assert trace["framework"] == "pytorch", captured.describe()
    else:  # a capture over the profiler server has no /host:metadata plane, which names JAX
        assert trace["framework"] in ("jax", ""), captured.describe()
    assert trace["steps"] >= 10, captured.describe()
    finding = top(report)
    if expected == "healthy":
        assert finding is None, captured.describe()
        return
    assert finding is not None and finding["kind"] == expected, captured.describe()
    # How large the share is depends on how fast this machine runs the step beside the input's fixed
    # sleep (a loaded machine computes slower): only that it is a finding that holds the step back.
    if expected == "input_bound":
        assert finding["severity"] in ("moderate", "high"), captured.describe()
        assert finding["share"] >= MODERATE, captured.describe()
        assert finding["evidence"], captured.describe()
    if expected == "host_bound":
        assert finding["severity"] in ("moderate", "high"), captured.describe()
        assert finding["share"] >= MODERATE, captured.describe()
        assert any(e["name"].startswith("no traced operation on") for e in finding["evidence"]), \
            captured.describe()
    if expected == "host_sync":
        # .item(), nonzero and the boolean mask (a nonzero inside): three read-backs a step, each named.
        # On the CPU their cost cannot be timed: counted, a moderate finding with no share.
        assert finding["per_step"] >= 2 and finding["share"] is None, captured.describe()
        names = {e["name"] for e in finding["evidence"]}
        assert {"aten::_local_scalar_dense", "aten::nonzero"} <= names, captured.describe()
        assert all(f["kind"] != "input_bound" for f in trace["findings"]), captured.describe()


def test_the_agent_analyses_each_capture(captured: Captured, agent: Agent) -> None:
    """The agent's background analysis of the stored capture: the same verdict, in its record."""
    deadline = time.monotonic() + ANALYSIS_WAIT_S
    analysis = None
    while analysis is None:
        code, out, err = cli("captures", "ls", "--json", "--socket", str(agent.socket))
        assert code == 0, err
        (record,) = [r for r in json.loads(out) if r.get("id") == captured.id]
        analysis = record.get("analysis")
        if analysis is None:
            assert time.monotonic() < deadline, f"no analysis after {ANALYSIS_WAIT_S} s: {record}"
            time.sleep(0.5)
    expected = EXPECTED[(captured.framework, captured.pattern)]
    assert analysis["verdict"] == expected, json.dumps(analysis, indent=1)
    assert analysis["headline"].startswith(expected), analysis
    finding = top(captured.report)
    if finding is None:
        assert analysis["findings"] == [], analysis
    else:
        assert analysis["findings"][0]["kind"] == expected, analysis
        assert analysis["findings"][0]["share"] == finding["share"], analysis


def test_explain_a_downloaded_capture(captured: Captured, agent: Agent, tmp_path: Path) -> None:
    """`gpuscope explain` on the capture downloaded with `captures get`: the same diagnosis, as text."""
    target = tmp_path / "download"
    code, _, err = cli("captures", "get", captured.id, "-o", str(target), "--socket", str(agent.socket))
    assert code == 0, err
    code, out, err = cli("explain", str(target))
    assert code == 0, err
    (trace,) = [name for name in captured.record["files"] if name.endswith(TRACE_SUFFIXES)]
    lines = out.splitlines()
    assert lines[0] == str(target / trace), out
    assert lines[1].startswith(f"  verdict: {captured.report['verdict']}"), out

"""Each GPU of the demo, captured and explained as a newcomer would (`gpuscope capture --gpu N`, then
`gpuscope captures explain ID`), gets its own verdict: the simulated jobs write traces with device
activity shaped like their GPU's scenario.

The demo's GPU 3 turns busy-but-stalled 20 seconds in; the test runs the demo with that phase moved to
the start (the bundled file, one line changed), so that every GPU shows its problem at once.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_process import RunningAgent, run_agent

import gpuscope.simulate
from gpuscope.cli.main import main

# GPU -> (the verdict of every trace of its capture, the traces it holds)
EXPECTED = {0: ("healthy", 1), 1: ("input_bound", 1), 2: ("shared_gpu", 2), 3: ("small_grids", 1)}
ANALYSIS_WAIT_S = 60.0


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exit_:
            code = int(exit_.code or 0)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningAgent, Path]]:
    tmp = tmp_path_factory.mktemp("demo-verdicts")
    text = (Path(gpuscope.simulate.__file__).parent / "scenarios" / "demo.yaml").read_text()
    stalled_now, changed = re.subn(r"- from: \w+( +# busy but stalled)", r"- from: 0s\1", text)
    assert changed == 1, "the demo's busy-but-stalled phase is no longer where this test expects it"
    (tmp / "demo.yaml").write_text(stalled_now)
    short = Path(tempfile.mkdtemp(prefix="gv-", dir="/tmp"))  # Unix socket paths must stay short
    env = {"GPUSCOPE_ALERTING__ENABLED": "false", "GPUSCOPE_CAPTURE__USER_HOURLY_BUDGET": "60",
           "GPUSCOPE_CAPTURE__KINETO__TRACE_DIR": str(short / "traces"),
           "GPUSCOPE_CAPTURE__KINETO__SOCKET_DIR": str(short / "ipc")}
    try:
        with run_agent(tmp, "--simulate", str(tmp / "demo.yaml"), env=env) as agent:
            yield agent, tmp / f"control-{agent.port}.sock"
    finally:
        shutil.rmtree(short, ignore_errors=True)


@pytest.fixture(scope="module")
def captures(demo: tuple[RunningAgent, Path]) -> dict[int, tuple[dict[str, Any], dict[str, Any], str]]:
    agent, socket = demo
    out: dict[int, tuple[dict[str, Any], dict[str, Any], str]] = {}
    for gpu in EXPECTED:
        deadline = time.monotonic() + 30
        while True:  # the simulated jobs register with the agent's Kineto daemon within seconds
            code, text, err = cli("capture", "--gpu", str(gpu), "--duration", "2s", "--json",
                                  "--socket", str(socket))
            record = json.loads(text) if code == 0 else {}
            if record.get("outcome") == "captured" or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        assert record.get("outcome") == "captured", f"{err}\n{text}\n{agent.stderr()[-3000:]}"
        code, report, err = cli("captures", "explain", record["id"], "--json", "--socket", str(socket))
        assert code == 0, err
        code, words, err = cli("captures", "explain", record["id"], "--socket", str(socket))
        assert code == 0, err
        out[gpu] = (record, json.loads(report), words)
    return out


@pytest.mark.parametrize("gpu", list(EXPECTED))
def test_each_demo_gpu_gets_its_own_verdict(captures: dict[int, Any], gpu: int) -> None:
    _, report, words = captures[gpu]
    verdict, traces = EXPECTED[gpu]
    assert report["verdict"] == verdict, json.dumps(report, indent=1)[:4000]
    assert len(report["traces"]) == traces
    for trace in report["traces"]:
        assert trace["device"] and trace["steps"] >= 2
        assert trace["verdict"] == verdict
        assert trace["device_profile"]["classes"]["tensor_core"] > 0.5  # the simulated bf16 GEMMs
    assert f"verdict: {verdict}" in words


def test_the_agent_records_the_same_verdicts(captures: dict[int, Any],
                                             demo: tuple[RunningAgent, Path]) -> None:
    """The agent's own analysis of each stored capture, as `captures ls` shows it: one spelling."""
    _, socket = demo
    deadline = time.monotonic() + ANALYSIS_WAIT_S
    while True:
        code, text, err = cli("captures", "ls", "--json", "--socket", str(socket))
        assert code == 0, err
        analyses = {r["id"]: r.get("analysis") for r in json.loads(text)}
        if all(analyses.get(record["id"]) for record, _, _ in captures.values()):
            break
        assert time.monotonic() < deadline, analyses
        time.sleep(0.5)
    for gpu, (record, _, _) in captures.items():
        analysis = analyses[record["id"]]
        assert analysis["verdict"] == EXPECTED[gpu][0], analysis
        assert analysis["headline"].startswith(f"{EXPECTED[gpu][0]}: "), analysis
    code, table, err = cli("captures", "ls", "--socket", str(socket))
    assert code == 0, err
    for gpu, (record, _, _) in captures.items():
        head, *rows = table.splitlines()
        (line,) = [row for row in rows if row.startswith(record["id"])]
        finding = head.index("FINDING")
        assert line[finding:].split()[0] == EXPECTED[gpu][0], table

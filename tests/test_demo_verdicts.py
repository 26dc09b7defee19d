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
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_process import RunningAgent, run_agent
from prometheus_client.parser import text_string_to_metric_families

import gpuscope.simulate
from gpuscope.analysis.gains import FIXES
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


def diagnosis_series(agent: RunningAgent) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The agent's gpuscope_diagnosis_* samples: (name, labels) -> value."""
    status, body = agent.get("/metrics")
    assert status == 200
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(body)
            if family.name.startswith("gpuscope_diagnosis_") for sample in family.samples}


def analysed_records(socket: Path, captures: dict[int, Any]) -> dict[int, dict[str, Any]]:
    """Each GPU's capture record once the agent's analysis is in it."""
    deadline = time.monotonic() + ANALYSIS_WAIT_S
    while True:
        code, text, err = cli("captures", "ls", "--json", "--socket", str(socket))
        assert code == 0, err
        by_id = {r["id"]: r for r in json.loads(text)}
        records = {gpu: by_id.get(record["id"], {}) for gpu, (record, _, _) in captures.items()}
        if all(r.get("analysis") for r in records.values()):
            return records
        assert time.monotonic() < deadline, records
        time.sleep(0.5)


def expected_diagnosis(record: dict[str, Any]) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """What gpuscope_diagnosis_* of a GPU must say of its capture record (without its gpu and uuid
    labels): the timestamp, the verdict, each finding's largest share, each kind's largest estimated
    gain, and all of them together."""
    analysis = record["analysis"]
    shares: dict[str, tuple[float, str]] = {}
    gains: dict[str, float] = {}
    for found in analysis["findings"]:
        kind = found["kind"]
        if found["share"] is not None and found["share"] > shares.get(kind, (-1.0, ""))[0]:
            shares[kind] = (found["share"], found["severity"])
        if "share" in (found.get("gain") or {}):
            gains[kind] = max(gains.get(kind, 0.0), found["gain"]["share"])
    expected = {("gpuscope_diagnosis_timestamp_seconds", frozenset()): record["start"],
                ("gpuscope_diagnosis_verdict", frozenset({("verdict", analysis["verdict"])})): 1.0}
    for kind, (share, severity) in shares.items():
        labels = frozenset({("finding", kind), ("severity", severity)})
        expected["gpuscope_diagnosis_finding_share", labels] = share
    for kind, share in gains.items():
        expected["gpuscope_diagnosis_gain_share", frozenset({("finding", kind)})] = share
    if gains:
        together = (analysis.get("gain_together") or {}).get("share", 0.0)
        expected["gpuscope_diagnosis_gain_together_share", frozenset()] = max(together, *gains.values())
    return expected


def test_the_agent_exports_each_gpus_diagnosis(captures: dict[int, Any],
                                               demo: tuple[RunningAgent, Path]) -> None:
    """gpuscope_diagnosis_* of each GPU say what its capture's analysis says, under its gpu_info's
    gpu and uuid."""
    agent, socket = demo
    records = analysed_records(socket, captures)
    body = agent.get("/metrics")[1]
    uuids = {s.labels["gpu"]: s.labels["uuid"] for f in text_string_to_metric_families(body)
             if f.name == "gpu_info" for s in f.samples}
    series = diagnosis_series(agent)
    for gpu, record in records.items():
        labels = {("gpu", str(gpu)), ("uuid", uuids[str(gpu)])}
        of_gpu = {(name, key - labels): value for (name, key), value in series.items() if labels <= key}
        assert record["analysis"]["verdict"] == EXPECTED[gpu][0]
        assert of_gpu == pytest.approx(expected_diagnosis(record)), (gpu, record["analysis"])
    exported = {value for (_, key) in series for label, value in key if label == "gpu"}
    assert exported == {str(gpu) for gpu in EXPECTED}


def test_each_demo_gpus_capture_shows_what_fixing_its_findings_would_buy(captures: dict[int, Any]) -> None:
    """`captures explain` gives every finding its gain, estimated for every kind the replay models."""
    for gpu, (_, report, words) in captures.items():
        findings = [f for trace in report["traces"] for f in trace["findings"]]
        assert words.count("fixing it: ") == len(findings), words
        for found in findings:
            if found["kind"] in FIXES:
                assert found["gain"]["before_s"] > found["gain"]["after_s"] > 0, (gpu, found)
            else:
                assert found["gain"]["not_estimated"], (gpu, found)
    _, report, words = captures[1]  # the input-bound GPU: its verdict's fix, estimated
    assert re.search(r"fixing it: [\d.]+ -> [\d.]+ ms a step \(\d+% less\)", words), words


def test_a_restarted_agent_exports_the_same_diagnoses_from_its_store(
        captures: dict[int, Any], demo: tuple[RunningAgent, Path]) -> None:
    """Last in this module: it stops the module's agent and starts another on the same store."""
    agent, socket = demo
    analysed_records(socket, captures)
    before = diagnosis_series(agent)
    assert before
    agent.proc.send_signal(signal.SIGTERM)
    agent.proc.wait(10)
    tmp = agent.log.parent
    short = Path(tempfile.mkdtemp(prefix="gr-", dir="/tmp"))
    env = {"GPUSCOPE_ALERTING__ENABLED": "false",
           "GPUSCOPE_CAPTURE__STORE__ROOT": str(tmp / f"captures-{agent.port}"),
           "GPUSCOPE_CAPTURE__KINETO__TRACE_DIR": str(short / "traces"),
           "GPUSCOPE_CAPTURE__KINETO__SOCKET_DIR": str(short / "ipc")}
    try:
        with run_agent(tmp, "--simulate", str(tmp / "demo.yaml"), env=env) as restarted:
            restarted.wait_for("/metrics", "gpuscope_diagnosis_verdict")
            assert diagnosis_series(restarted) == before
    finally:
        shutil.rmtree(short, ignore_errors=True)

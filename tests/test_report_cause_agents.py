"""End to end with real agents: `gpuscope report --by cause` over a real Prometheus scraping two simulated
demo nodes whose GPUs were captured and analysed by the agents' own analysis workers.

Node A's four GPUs are all captured (the demo's verdicts: GPU 0 healthy, 1 input-bound, 2 shared,
3 small grids); node B's GPUs 1 and 2 only, so its GPUs 0 and 3 are held but not diagnosed. Once
Prometheus has every diagnosis, the report covers a window of WINDOW_S seconds at a 1 s step. The
truth is what each agent's /metrics says of each GPU (the shares come from the real analysis of
simulated traces, so the test reads them rather than fixing them): every held GPU counts the whole
window under each cause of its diagnosis. Tolerance: two steps (2 s) per GPU, as the subquery's
steps at both ends of the window may or may not count.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from agent_process import RunningAgent, run_agent
from test_demo_verdicts import EXPECTED, analysed_records, cli, diagnosis_series
from test_e2e_prometheus import Prometheus, run_prometheus

import gpuscope.simulate
from gpuscope.cli.main import main

pytestmark = pytest.mark.e2e

WINDOW_S = 20
CAPTURED = {"A": (0, 1, 2, 3), "B": (1, 2)}
STEP_S = 1.0
HOUR_S = 3600.0


def capture(socket: Path, gpu: int, agent: RunningAgent) -> dict[str, Any]:
    """`gpuscope capture --gpu N`, retried while the simulated jobs register with the agent."""
    deadline = time.monotonic() + 30
    while True:
        code, text, err = cli("capture", "--gpu", str(gpu), "--duration", "2s", "--json",
                              "--socket", str(socket))
        record = json.loads(text) if code == 0 else {}
        if record.get("outcome") == "captured" or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert record.get("outcome") == "captured", f"{err}\n{text}\n{agent.stderr()[-3000:]}"
    return record


def scrape_both(agents: dict[str, RunningAgent]) -> str:
    targets = ", ".join(f"'127.0.0.1:{agent.port}'" for agent in agents.values())
    return ("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"scrape_configs:\n  - job_name: gpuscope\n    static_configs:\n      - targets: [{targets}]\n")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prometheus, dict[str, RunningAgent],
                                                                      float, float]]:
    """The two nodes, their captures analysed, and a window [start, end] that Prometheus has scraped."""
    tmp = tmp_path_factory.mktemp("report-cause-agents")
    text = (Path(gpuscope.simulate.__file__).parent / "scenarios" / "demo.yaml").read_text()
    # As test_demo_verdicts.py: the busy-but-stalled phase of GPU 3 from the start.
    stalled_now, changed = re.subn(r"- from: \w+( +# busy but stalled)", r"- from: 0s\1", text)
    assert changed == 1
    (tmp / "demo.yaml").write_text(stalled_now)
    with ExitStack() as stack:
        agents: dict[str, RunningAgent] = {}
        for node in CAPTURED:
            short = Path(tempfile.mkdtemp(prefix=f"gc{node}-", dir="/tmp"))  # short Unix socket paths
            stack.callback(shutil.rmtree, short, ignore_errors=True)
            env = {"GPUSCOPE_ALERTING__ENABLED": "false", "GPUSCOPE_CAPTURE__USER_HOURLY_BUDGET": "60",
                   "GPUSCOPE_CAPTURE__KINETO__TRACE_DIR": str(short / "traces"),
                   "GPUSCOPE_CAPTURE__KINETO__SOCKET_DIR": str(short / "ipc")}
            agents[node] = stack.enter_context(run_agent(tmp, "--simulate", str(tmp / "demo.yaml"), env=env))
        prometheus = stack.enter_context(run_prometheus(tmp / "prometheus", scrape_both(agents)))
        for node, gpus in CAPTURED.items():
            socket = tmp / f"control-{agents[node].port}.sock"
            records = {gpu: (capture(socket, gpu, agents[node]), None, None) for gpu in gpus}
            for gpu, record in analysed_records(socket, records).items():
                assert record["analysis"]["verdict"] == EXPECTED[gpu][0], (node, gpu, record["analysis"])
        diagnosed = sum(len(gpus) for gpus in CAPTURED.values())
        prometheus.wait_for("gpuscope_diagnosis_verdict", count=diagnosed)
        prometheus.wait_for("gpu_process_info", count=8)
        start = math.ceil(time.time()) + 1.0
        end = start + WINDOW_S
        time.sleep(max(0.0, end + 3 - time.time()))  # and a few scrapes past the end
        yield prometheus, agents, start, end


def truth(agents: dict[str, RunningAgent], by_node: bool) -> dict[tuple[str, ...], dict[str, Any]]:
    """Per cause (and node): the GPUs under it and the sums of their shares, from the agents' /metrics."""
    rows: dict[tuple[str, ...], dict[str, Any]] = defaultdict(
        lambda: {"gpus": 0, "attributed": None, "gain": None})

    def add(key: tuple[str, ...], name: str, value: float) -> None:
        rows[key][name] = (rows[key][name] or 0.0) + value

    for node, agent in agents.items():
        instance = f"127.0.0.1:{agent.port}"
        per_gpu: dict[str, dict[str, Any]] = defaultdict(lambda: {"shares": {}, "gains": {}, "verdict": None})
        for (name, labels), value in diagnosis_series(agent).items():
            label = dict(labels)
            gpu = per_gpu[label["gpu"]]
            if name == "gpuscope_diagnosis_finding_share":
                gpu["shares"][label["finding"]] = value
            elif name == "gpuscope_diagnosis_gain_share":
                gpu["gains"][label["finding"]] = value
            elif name == "gpuscope_diagnosis_verdict":
                gpu["verdict"] = label["verdict"]
        assert set(per_gpu) == {str(gpu) for gpu in CAPTURED[node]}
        for index in range(4):
            diagnosis = per_gpu.get(str(index))
            owner = (instance,) if by_node else ()
            if diagnosis is None:
                rows[("not diagnosed", *owner)]["gpus"] += 1
                continue
            causes = set(diagnosis["shares"])
            if diagnosis["verdict"] not in causes:
                causes.add(diagnosis["verdict"])
            for cause in causes:
                rows[(cause, *owner)]["gpus"] += 1
            for cause, share in diagnosis["shares"].items():
                add((cause, *owner), "attributed", share)
            for cause, share in diagnosis["gains"].items():
                add((cause, *owner), "gain", share)
    return dict(rows)


def report(capsys: pytest.CaptureFixture[str], prometheus: Prometheus, start: float, end: float,
           *args: str) -> tuple[int, str, str]:
    code = main(["report", "--prometheus", prometheus.base, "--since", f"{start:.0f}",
                 "--until", f"{end:.0f}", "--step", "1s", *args])
    out, err = capsys.readouterr()
    return code, out, err


def near(got: float | None, per_step: float | None) -> bool:
    """``got`` GPU-hours against ``per_step`` (GPU-hours per second of the window) times the window,
    within two steps at that rate."""
    if per_step is None or got is None:
        return got is per_step
    return abs(got - per_step * WINDOW_S / HOUR_S) <= 2 * STEP_S * per_step / HOUR_S + 1e-9


@pytest.mark.parametrize("by_node", [False, True], ids=["cause", "cause-and-node"])
def test_the_report_by_cause_is_what_the_agents_analysed(
        fleet: tuple[Prometheus, dict[str, RunningAgent], float, float], capsys: pytest.CaptureFixture[str],
        by_node: bool) -> None:
    prometheus, agents, start, end = fleet
    code, out, err = report(capsys, prometheus, start, end, "--by", "cause", "--json",
                            *(["--by", "node"] if by_node else []))
    assert code == 0, err
    document = json.loads(out)
    got = {(row["cause"], *row["owner"].values()): row for row in document["rows"]}
    expected = truth(agents, by_node)
    assert set(got) == set(expected), (sorted(got), sorted(expected))
    for key, want in expected.items():
        row = got[key]
        assert near(row["held_gpu_hours"], float(want["gpus"])), (key, row, want)
        assert near(row["attributed_gpu_hours"], want["attributed"]), (key, row, want)
        assert near(row["gain_gpu_hours"], want["gain"]), (key, row, want)
        # Every demo GPU is busy (50% to 96%): a busy rate read over too short a window would be 0.
        assert 0 < row["busy_gpu_hours"] <= row["held_gpu_hours"] + 1e-9, (key, row)
        if key[0] != "not diagnosed":  # every capture was taken before the window
            assert 0 < row["newest_diagnosis_age_seconds"] <= row["oldest_diagnosis_age_seconds"], row
    # The demo's own verdicts, on both nodes where captured; node B's other two GPUs undiagnosed.
    causes = {key[0]: want["gpus"] for key, want in truth(agents, False).items()}
    assert causes["input_bound"] >= 2 and causes["shared_gpu"] >= 2, causes
    assert causes["small_grids"] >= 1 and causes["healthy"] >= 1 and causes["not diagnosed"] == 2, causes
    assert near(document["total"]["held_gpu_hours"], 8.0)
    assert near(document["total"]["not_diagnosed_gpu_hours"], 2.0)


def test_the_table_of_real_agents(fleet: tuple[Prometheus, dict[str, RunningAgent], float, float],
                                  capsys: pytest.CaptureFixture[str]) -> None:
    prometheus, _, start, end = fleet
    code, out, err = report(capsys, prometheus, start, end, "--by", "cause", "--by", "pod")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[1].split()[:4] == ["cause", "namespace", "pod", "HELD"]
    # Node B's two undiagnosed GPUs, one pod each: 20 s, in thousandths of a GPU-hour (a short range).
    undiagnosed = [line.split()[4] for line in lines if line.startswith("not diagnosed")]
    assert undiagnosed == ["0.006", "0.006"], out
    assert "75% of it diagnosed within the horizon" in out

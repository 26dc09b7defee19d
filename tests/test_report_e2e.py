"""End to end: `gpuscope report` against a real Prometheus holding a simulated week of two nodes.

A generator writes a week of samples every 30 s of two nodes with two GPUs each, in OpenMetrics text
with the agent's metric names and labels: processes of known owners (pods, users, one GPU
time-sliced between two users off Kubernetes) with known busy schedules, the GPUs' busy and energy
counters, alerts firing, captures, and an agent restart on one node (every counter of that node
starts again from 0). `promtool tsdb create-blocks-from openmetrics` turns it into TSDB blocks that a
Prometheus on loopback serves; every figure of the report is compared with the truth the generator
computed from the same schedule, within 1%.

Backfilled blocks hold no staleness markers (a live Prometheus writes one when a series leaves a
scrape), so the server runs with a lookback delta of 30 s, the sample interval: a series that
stopped is then absent 30 s later, as it would be after its staleness marker. The recording rules'
series are backfilled from that server with `promtool tsdb create-blocks-from rules`, so the
`--recorded` report is checked against the same truth.

The schedule changes only on whole minutes; minute m holds the samples at m*60-30 and m*60.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from agent_process import free_port, run_ready_server
from prometheus_client import CollectorRegistry
from snapshots import FakeSource, make_full_snapshot
from test_e2e_prometheus import PROMETHEUS, PROMTOOL, require
from test_exporter import _alert_source, _capture_stats

from gpuscope.cli.main import main
from gpuscope.exporters.alerts import AlertCollector
from gpuscope.exporters.captures import CaptureCollector
from gpuscope.exporters.prometheus import SnapshotCollector

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
RECORDING_RULES = ROOT / "deploy" / "prometheus" / "gpuscope-recording-rules.yml"
START = 1_704_067_200  # 2024-01-01T00:00:00Z
MINUTES = 7 * 24 * 60  # the report's range: samples 0..MINUTES
MARGIN = 5  # samples before and after the range
END = START + 60 * MINUTES
RESTART = 6000  # node-2's agent restarts just before this sample
NODES = ("node-1:9847", "node-2:9847")
GPUS = [(node, index, f"GPU-{n}{index}") for n, node in enumerate(NODES, 1) for index in (0, 1)]


@dataclass(frozen=True)
class Proc:
    node: str
    gpu: int
    pid: int
    user: str
    namespace: str
    pod: str
    first: int  # first and last sample holding the GPU
    last: int
    load: Callable[[int], float]  # the busy fraction of the minute ending at a sample

    def busy(self, m: int) -> float:
        """0 in the minute before the first sample: the counter starts there at 0."""
        return self.load(m) if self.first < m <= self.last else 0.0


PROCS = [
    Proc(NODES[0], 0, 101, "alice", "ml", "train-a", 60, 2939, lambda m: 0.9),
    Proc(NODES[0], 0, 102, "alice", "ml", "train-a", 5000, 6439, lambda m: 0.6),
    Proc(NODES[0], 1, 202, "bob", "ml", "notebook-b", 100, 4419, lambda m: 0.5 if 1000 <= m < 1360 else 0.0),
    Proc(NODES[1], 0, 303, "carol", "research", "sweep-c", 3000, 8759,
         lambda m: 0.8 if (m // 60) % 2 == 0 else 0.02),
    # Off Kubernetes, time-sliced: no pod labels.
    Proc(NODES[1], 1, 404, "dave", "", "", 500, 1939, lambda m: 0.3),
    Proc(NODES[1], 1, 405, "erin", "", "", 1000, 1599, lambda m: 0.1),
]
ALERTS = [  # node, gpu, alertname, first and last firing sample
    (NODES[0], 0, "GpuLowUtilization", 20, 30),  # nobody holds the GPU
    (NODES[0], 1, "GpuHeldIdle", 2000, 2060),
    (NODES[0], 1, "GpuHeldIdle", 3000, 3030),
    (NODES[1], 0, "GpuLowUtilization", 3100, 3200),
    (NODES[1], 0, "GpuLowUtilization", 7000, 7010),
    (NODES[1], 0, "GpuHeldIdle", 7000, 7010),
]
CAPTURES = {NODES[0]: [2010, 3010], NODES[1]: [3150, 7005]}
SAMPLES = range(-2 * MARGIN, 2 * (MINUTES + MARGIN) + 1)  # every 30 s


def minute(k: int) -> int:
    """The minute the sample k (at k*30 s) ends a half of."""
    return -(-k // 2)


def present(proc: Proc, m: int) -> bool:
    return proc.first <= m <= proc.last


def gpu_busy(node: str, gpu: int, m: int) -> float:
    return sum(p.busy(m) for p in PROCS if (p.node, p.gpu) == (node, gpu))


def gpu_energy(node: str, gpu: int, m: int) -> float:
    return (60.0 + 240.0 * gpu_busy(node, gpu, m)) * 60.0


def firing(node: str, gpu: int, m: int) -> set[str]:
    return {name for n, g, name, a, b in ALERTS if (n, g) == (node, gpu) and a <= m <= b}


def onsets(node: str, gpu: int, m: int) -> int:
    return len(firing(node, gpu, m) - firing(node, gpu, m - 1))


# -- OpenMetrics ------------------------------------------------------------------------------------

def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def _counter_lines(name: str, labels: str, increments: Callable[[int], float], node: str,
                   samples: range) -> Iterator[str]:
    """``increments(m)`` is minute m's; each of its two samples adds half of it."""
    value = 0.0
    for k in samples:
        if node == NODES[1] and k == 2 * RESTART - 1:
            value = 0.0
        value += increments(minute(k)) / 2
        yield f"{name}{labels} {value!r} {START + 30 * k}\n"


def _proc_samples(p: Proc) -> range:
    return range(2 * p.first - 1, 2 * p.last + 1)


def openmetrics() -> Iterator[str]:
    gpu_families = {
        "gpu_busy_seconds": lambda n, g, m: gpu_busy(n, g, m) * 60.0,
        "gpu_energy_joules": gpu_energy,
        "gpu_idle_energy_joules": lambda n, g, m: gpu_energy(n, g, m) * (1 - gpu_busy(n, g, m)),
    }
    for family, increment in gpu_families.items():
        yield f"# TYPE {family} counter\n"
        for node, gpu, uuid in GPUS:
            labels = _labels(instance=node, job="gpuscope", gpu=str(gpu), uuid=uuid)
            yield from _counter_lines(f"{family}_total", labels,
                                      lambda m, n=node, g=gpu, f=increment: f(n, g, m), node, SAMPLES)

    def proc_labels(p: Proc) -> dict[str, str]:
        uuid = next(u for n, g, u in GPUS if (n, g) == (p.node, p.gpu))
        return {"instance": p.node, "job": "gpuscope", "gpu": str(p.gpu), "uuid": uuid, "gpu_instance": "",
                "pid": str(p.pid),
                "process": "python3", "user": p.user, "container_id": f"c{p.pid}", "pod": p.pod,
                "namespace": p.namespace, "container": "main" if p.pod else ""}

    yield "# TYPE gpu_process_info gauge\n"
    for p in PROCS:
        labels = _labels(**proc_labels(p), type="compute")
        yield from (f"gpu_process_info{labels} 1 {START + 30 * k}\n" for k in _proc_samples(p))
    proc_families = {
        "gpu_process_busy_seconds": lambda p, m: p.busy(m) * 60.0,
        "gpu_process_energy_joules": lambda p, m: p.busy(m) * gpu_energy(p.node, p.gpu, m),
    }
    for family, increment in proc_families.items():
        yield f"# TYPE {family} counter\n"
        for p in PROCS:
            yield from _counter_lines(f"{family}_total", _labels(**proc_labels(p)),
                                      lambda m, p=p, f=increment: f(p, m), p.node, _proc_samples(p))
    yield "# TYPE gpuscope_alert_firing gauge\n"
    for node, gpu, uuid in GPUS:
        for name in sorted({a[2] for a in ALERTS}):
            labels = _labels(instance=node, job="gpuscope", alertname=name, gpu=str(gpu), uuid=uuid,
                             severity="warning")
            yield from (f"gpuscope_alert_firing{labels} 1 {START + 30 * k}\n"
                        for k in SAMPLES if name in firing(node, gpu, minute(k)))
    yield "# TYPE gpuscope_captures counter\n"
    for node in NODES:
        labels = _labels(instance=node, job="gpuscope", trigger="alert", outcome="captured")
        taken = 0
        for k in SAMPLES:  # one capture at the end of each of these minutes
            taken = 0 if node == NODES[1] and k == 2 * RESTART - 1 else taken
            taken += k % 2 == 0 and k // 2 in CAPTURES[node]
            yield f"gpuscope_captures_total{labels} {taken} {START + 30 * k}\n"
    yield "# EOF\n"


# -- The truth --------------------------------------------------------------------------------------

OWNER_KEYS: dict[str, Callable[[Proc], tuple[str, ...]]] = {
    "pod": lambda p: (p.namespace, p.pod),
    "namespace": lambda p: (p.namespace,),
    "user": lambda p: (p.user,),
}
WINDOW = range(0, MINUTES + 1)  # the steps of the range; counters count the increments after sample 0


def truth(by: str) -> dict[tuple[str, ...], dict[str, float]]:
    rows: dict[tuple[str, ...], dict[str, float]] = defaultdict(
        lambda: {"held_gpu_hours": 0.0, "busy_gpu_hours": 0.0, "held_idle_gpu_hours": 0.0, "energy_kwh": 0.0,
                 "alerts_fired": 0.0})
    for node, gpu, uuid in GPUS:
        procs = [p for p in PROCS if (p.node, p.gpu) == (node, gpu)]
        for m in WINDOW:
            holders = [p for p in procs if present(p, m)]
            idle = gpu_busy(node, gpu, m) < 0.05
            if by in ("node", "gpu"):
                key = (node,) if by == "node" else (node, str(gpu), uuid)
                row = rows[key]
                if holders:
                    row["held_gpu_hours"] += 1 / 60
                    row["held_idle_gpu_hours"] += idle / 60
                row["alerts_fired"] += onsets(node, gpu, m)
                if m > 0:
                    row["busy_gpu_hours"] += gpu_busy(node, gpu, m) / 60
                    row["energy_kwh"] += gpu_energy(node, gpu, m) / 3.6e6
                continue
            for key in {OWNER_KEYS[by](p) for p in holders}:
                rows[key]["held_gpu_hours"] += 1 / 60
                rows[key]["held_idle_gpu_hours"] += idle / 60
                rows[key]["alerts_fired"] += onsets(node, gpu, m)
            for p in procs:
                if m > 0:
                    rows[OWNER_KEYS[by](p)]["busy_gpu_hours"] += p.busy(m) / 60
                    rows[OWNER_KEYS[by](p)]["energy_kwh"] += p.busy(m) * gpu_energy(node, gpu, m) / 3.6e6
    return dict(rows)


# -- The server -------------------------------------------------------------------------------------

@contextmanager
def serve(tsdb: Path, directory: Path) -> Iterator[str]:
    binary = require(PROMETHEUS, "prometheus")
    config = directory / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1m\n")
    port = free_port()
    argv = [binary, f"--config.file={config}", f"--storage.tsdb.path={tsdb}",
            "--storage.tsdb.retention.time=36500d", "--query.lookback-delta=30s",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    log = directory / "prometheus.log"
    with run_ready_server(argv, f"http://127.0.0.1:{port}", log, "prometheus") as base:
        yield base


def promtool(*args: str) -> None:
    result = subprocess.run([require(PROMTOOL, "promtool"), *args], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def week(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A Prometheus serving the week (and the recording rules' series, backfilled from it)."""
    require(PROMETHEUS, "prometheus")
    tmp = tmp_path_factory.mktemp("report")
    source = tmp / "week.om"
    with source.open("w") as out:
        out.writelines(openmetrics())
    tsdb = tmp / "tsdb"
    promtool("tsdb", "create-blocks-from", "openmetrics", "--max-block-duration=24h", str(source), str(tsdb))
    with serve(tsdb, tmp) as base:
        promtool("tsdb", "create-blocks-from", "rules", f"--start={START - 60 * MARGIN}",
                 f"--end={END + 60 * MARGIN}", f"--url={base}", f"--output-dir={tmp / 'recorded'}",
                 "--eval-interval=1m", str(RECORDING_RULES))
    for block in (tmp / "recorded").iterdir():
        shutil.move(block, tsdb / block.name)
    with serve(tsdb, tmp) as base:
        yield base, tmp


def report(capsys: pytest.CaptureFixture[str], base: str, *args: str) -> tuple[int, str, str]:
    code = main(["report", "--prometheus", base, "--since", str(START), "--until", str(END), *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("recorded", [False, True], ids=["raw", "recorded"])
@pytest.mark.parametrize("by", ["pod", "namespace", "user", "node", "gpu"])
def test_every_figure_matches_the_truth_within_one_percent(
        week: tuple[str, Path], capsys: pytest.CaptureFixture[str], by: str, recorded: bool) -> None:
    code, out, err = report(capsys, week[0], "--by", by, "--json", *(["--recorded"] if recorded else []))
    assert code == 0, err
    document = json.loads(out)
    got = {tuple(row["owner"].values()): row for row in document["rows"]}
    expected = truth(by)
    assert set(got) == set(expected)
    for key, figures in expected.items():
        for name, value in figures.items():
            assert got[key][name] == pytest.approx(value, rel=0.01, abs=1e-9), (key, name)
        assert got[key]["efficiency"] == pytest.approx(figures["busy_gpu_hours"] / figures["held_gpu_hours"],
                                                       rel=0.01)
    idle = sum(gpu_energy(n, g, m) * (1 - gpu_busy(n, g, m)) for n, g, _ in GPUS for m in WINDOW if m > 0)
    assert document["unattributed_energy_kwh"] == pytest.approx(idle / 3.6e6, rel=0.01)
    assert document["captures"] == {"total": 4, "by_node": {NODES[0]: 2, NODES[1]: 2}, "ids_exported": False}
    assert (document["start"], document["end"]) == ("2024-01-01T00:00:00Z", "2024-01-08T00:00:00Z")


def test_the_table_names_the_worst_waster_first(week: tuple[str, Path],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = report(capsys, week[0], "--by", "user")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "GPU use by user, 2024-01-01T00:00:00Z to 2024-01-08T00:00:00Z (step 1m)"
    assert lines[1].split()[:3] == ["user", "HELD", "GPU-h"]
    assert lines[2].split()[0] == "bob"  # the idle notebook
    assert lines[7].startswith("TOTAL")
    assert "Captures taken: 4 (node-1:9847 2, node-2:9847 2)" in out


def test_csv_has_a_header_and_a_row_per_owner(week: tuple[str, Path],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = report(capsys, week[0], "--by", "namespace", "--csv")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == ("namespace,held_gpu_hours,busy_gpu_hours,efficiency,held_idle_gpu_hours,energy_kwh,"
                        "alerts_fired")
    assert sorted(line.split(",")[0] for line in lines[1:]) == ["", "ml", "research"]


def test_a_range_without_data_says_so(week: tuple[str, Path],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["report", "--prometheus", week[0], "--since", "2023-01-01T00:00:00Z",
                 "--until", "2023-01-08T00:00:00Z"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("gpuscope report: no GPU process data in the range")
    assert "2023-01-01T00:00:00Z to 2023-01-08T00:00:00Z" in err


def test_the_week_has_the_names_and_labels_the_agent_exports() -> None:
    """The generated week is hand-written OpenMetrics: this keeps it the agent's own families and label
    names (Prometheus adds instance and job), so the report is checked on what a real node exports."""
    written: dict[str, set[str]] = {}
    for line in openmetrics():
        if line.startswith("#"):
            continue
        name, _, rest = line.partition("{")
        written.setdefault(name, {pair.split("=")[0] for pair in rest.split("}")[0].split(",")})
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(FakeSource(make_full_snapshot())))
    registry.register(CaptureCollector(_capture_stats()))
    registry.register(AlertCollector(_alert_source()))
    exported = {sample.name: set(sample.labels) for family in registry.collect() for sample in family.samples}
    for name, labels in written.items():
        assert name in exported, f"{name}: not a series the agent exports"
        assert labels - {"instance", "job"} == exported[name], name

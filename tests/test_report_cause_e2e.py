"""End to end: `gpuscope report --by cause` against a real Prometheus holding six hours of two nodes whose
GPUs' diagnoses are known.

As in test_report_e2e.py, a generator writes samples every 30 s in OpenMetrics text with the agent's
names and labels (the processes, the GPUs' busy counters and the diagnosis series of each GPU's latest
analysed capture), `promtool tsdb create-blocks-from openmetrics` makes TSDB blocks of them, the
recording rules are backfilled from the served blocks, and the report, raw and `--recorded`, is
compared with the truth the schedule gives: GPU-hours within two steps (2 minutes times the figure's
share), diagnosis ages within one step.

- node-1 GPU 0 (ml/train-a): input-bound (40% of the step, its fix 30%) and waiting on a sync (20%,
  not estimated) from a capture an hour before the range, until minute 180; then healthy.
- node-1 GPU 1 (ml/notebook-b, held minutes 0 to 240): launch-bound (50%, fix 40%) from a capture 23h
  before the range: past the 24h horizon from minute 60, it is "not diagnosed" from then on.
- node-2 GPU 0 (research/sweep-c): never diagnosed.
- node-2 GPU 1, time-sliced off Kubernetes by dave and erin: shared (30%, fix 20%) and input-bound
  (10%) all along.
- node-2 GPU 2: diagnosed but held by nobody, so in no row.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from snapshots import FakeSource, make_gpu, make_snapshot
from test_e2e_prometheus import PROMETHEUS, require
from test_report_e2e import promtool, serve

from gpuscope.capture.diagnoses import FindingShare, GpuDiagnosis
from gpuscope.cli.main import main
from gpuscope.exporters.diagnosis import DiagnosisCollector

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
RECORDING_RULES = ROOT / "deploy" / "prometheus" / "gpuscope-recording-rules.yml"
START = 1_704_067_200  # 2024-01-01T00:00:00Z
MINUTES = 360
MARGIN = 5
END = START + 60 * MINUTES
SAMPLES = range(-2 * MARGIN, 2 * (MINUTES + MARGIN) + 1)  # every 30 s


@dataclass(frozen=True)
class Diagnosis:
    first: int  # the minutes it is the latest
    last: int
    started: int  # Unix seconds its capture started
    verdict: str
    shares: dict[str, float] = field(default_factory=dict)
    gains: dict[str, float] = field(default_factory=dict)
    together: float | None = None


@dataclass(frozen=True)
class Gpu:
    node: str
    index: int
    busy: float
    holders: tuple[tuple[int, str, str, str], ...]  # pid, user, namespace, pod
    held: tuple[int, int]  # first and last minute held
    diagnoses: tuple[Diagnosis, ...]

    @property
    def uuid(self) -> str:
        return f"GPU-{self.node[5]}{self.index}"


GPUS = [
    Gpu("node-1:9847", 0, 0.5, ((101, "alice", "ml", "train-a"),), (-MARGIN, MINUTES + MARGIN), (
        Diagnosis(-MARGIN, 179, START - 3600, "input_bound", {"input_bound": 0.4, "host_sync": 0.2},
                  {"input_bound": 0.3}, 0.45),
        Diagnosis(180, MINUTES + MARGIN, START + 179 * 60, "healthy"))),
    Gpu("node-1:9847", 1, 0.2, ((202, "bob", "ml", "notebook-b"),), (-MARGIN, 240), (
        Diagnosis(-MARGIN, MINUTES + MARGIN, START - 23 * 3600, "launch_bound", {"launch_bound": 0.5},
                  {"launch_bound": 0.4}, 0.4),)),
    Gpu("node-2:9847", 0, 0.8, ((303, "carol", "research", "sweep-c"),), (-MARGIN, MINUTES + MARGIN), ()),
    Gpu("node-2:9847", 1, 0.6, ((404, "dave", "", ""), (405, "erin", "", "")), (-MARGIN, MINUTES + MARGIN), (
        Diagnosis(-MARGIN, MINUTES + MARGIN, START - 600, "shared_gpu",
                  {"shared_gpu": 0.3, "input_bound": 0.1}, {"shared_gpu": 0.2}, 0.25),)),
    Gpu("node-2:9847", 2, 0.0, (), (0, -1), (
        Diagnosis(-MARGIN, MINUTES + MARGIN, START, "input_bound", {"input_bound": 0.9}),)),
]


def minute(k: int) -> int:
    return -(-k // 2)


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def openmetrics() -> Iterator[str]:
    def at(k: int) -> int:
        return START + 30 * k

    def gpu_labels(g: Gpu, **more: str) -> str:
        return _labels(instance=g.node, job="gpuscope", gpu=str(g.index), uuid=g.uuid, **more)

    def proc_labels(g: Gpu, pid: int, user: str, namespace: str, pod: str) -> dict[str, str]:
        return {"instance": g.node, "job": "gpuscope", "gpu": str(g.index), "uuid": g.uuid,
                "gpu_instance": "", "pid": str(pid), "process": "python3", "user": user,
                "container_id": f"c{pid}", "pod": pod, "namespace": namespace,
                "container": "main" if pod else ""}

    def held(g: Gpu, k: int) -> bool:
        return g.held[0] <= minute(k) <= g.held[1]

    yield "# TYPE gpu_busy_seconds counter\n"
    for g in GPUS:
        yield from (f"gpu_busy_seconds_total{gpu_labels(g)} {30 * g.busy * (k - SAMPLES[0])!r} {at(k)}\n"
                    for k in SAMPLES)
    yield "# TYPE gpu_process_info gauge\n"
    for g in GPUS:
        for holder in g.holders:
            labels = _labels(**proc_labels(g, *holder), type="compute")
            yield from (f"gpu_process_info{labels} 1 {at(k)}\n" for k in SAMPLES if held(g, k))
    yield "# TYPE gpu_process_busy_seconds counter\n"
    for g in GPUS:
        for holder in g.holders:
            share = g.busy / len(g.holders)
            yield from (f"gpu_process_busy_seconds_total{_labels(**proc_labels(g, *holder))} "
                        f"{30 * share * (k - SAMPLES[0])!r} {at(k)}\n" for k in SAMPLES if held(g, k))

    def diagnosis_lines(name: str, value: float | None, extra: dict[str, str], d: Diagnosis,
                        g: Gpu) -> Iterator[str]:
        if value is None:
            return
        yield from (f"{name}{gpu_labels(g, **extra)} {value!r} {at(k)}\n"
                    for k in SAMPLES if d.first <= minute(k) <= d.last)

    families = {
        "gpuscope_diagnosis_timestamp_seconds": lambda d: [({}, float(d.started))],
        "gpuscope_diagnosis_verdict": lambda d: [({"verdict": d.verdict}, 1.0)],
        "gpuscope_diagnosis_finding_share": lambda d: [({"finding": f, "severity": "high"}, v)
                                                       for f, v in d.shares.items()],
        "gpuscope_diagnosis_gain_share": lambda d: [({"finding": f}, v) for f, v in d.gains.items()],
        "gpuscope_diagnosis_gain_together_share": lambda d: [({}, d.together)],
    }
    for name, series_of in families.items():
        yield f"# TYPE {name} gauge\n"
        for g in GPUS:
            for d in g.diagnoses:
                for extra, value in series_of(d):
                    yield from diagnosis_lines(name, value, extra, d, g)
    yield "# EOF\n"


# -- The truth, by hand from the schedule above (hours) ----------------------------------------------------

CAUSES = {  # held, busy, attributed, gain, newest and oldest age (s)
    "input_bound": (9.0, 1.5 + 3.6, 1.2 + 0.6, 0.9, 600, 600 + MINUTES * 60),
    "shared_gpu": (6.0, 3.6, 1.8, 1.2, 600, 600 + MINUTES * 60),
    "host_sync": (3.0, 1.5, 0.6, None, 3600, 3600 + 179 * 60),
    "launch_bound": (1.0, 0.2, 0.5, 0.4, 23 * 3600, 23 * 3600 + 59 * 60),
    "healthy": (3.0, 1.5, None, None, 60, 60 + 180 * 60),
    "not diagnosed": (3.0 + 6.0, 3 * 0.2 + 6 * 0.8, None, None, None, None),
}
BY_NAMESPACE = {  # (cause, namespace): held, busy (the owner's processes), attributed
    ("input_bound", "ml"): (3.0, 1.5, 1.2), ("host_sync", "ml"): (3.0, 1.5, 0.6),
    ("launch_bound", "ml"): (1.0, 0.2, 0.5), ("healthy", "ml"): (3.0, 1.5, None),
    ("not diagnosed", "ml"): (3.0, 0.6, None), ("not diagnosed", "research"): (6.0, 4.8, None),
    ("input_bound", ""): (6.0, 3.6, 0.6), ("shared_gpu", ""): (6.0, 3.6, 1.8),
}
STEP_H = 1 / 60


@pytest.fixture(scope="module")
def diagnosed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require(PROMETHEUS, "prometheus")
    tmp = tmp_path_factory.mktemp("report-cause")
    source = tmp / "six-hours.om"
    with source.open("w") as out:
        out.writelines(openmetrics())
    tsdb = tmp / "tsdb"
    promtool("tsdb", "create-blocks-from", "openmetrics", str(source), str(tsdb))
    with serve(tsdb, tmp) as base:
        promtool("tsdb", "create-blocks-from", "rules", f"--start={START - 60 * MARGIN}",
                 f"--end={END + 60 * MARGIN}", f"--url={base}", f"--output-dir={tmp / 'recorded'}",
                 "--eval-interval=1m", str(RECORDING_RULES))
    for block in (tmp / "recorded").iterdir():
        shutil.move(block, tsdb / block.name)
    with serve(tsdb, tmp) as base:
        yield base


def report(capsys: pytest.CaptureFixture[str], base: str, *args: str) -> tuple[int, str, str]:
    code = main(["report", "--prometheus", base, "--since", str(START), "--until", str(END), *args])
    out, err = capsys.readouterr()
    return code, out, err


def near(got: float | None, expected: float | None, share: float = 1.0) -> bool:
    if expected is None or got is None:
        return got is expected
    return abs(got - expected) <= 2 * STEP_H * share + 1e-9


@pytest.mark.parametrize("recorded", [False, True], ids=["raw", "recorded"])
def test_by_cause_matches_the_schedule(diagnosed: str, capsys: pytest.CaptureFixture[str],
                                       recorded: bool) -> None:
    code, out, err = report(capsys, diagnosed, "--by", "cause", "--json",
                            *(["--recorded"] if recorded else []))
    assert code == 0, err
    document = json.loads(out)
    rows = {row["cause"]: row for row in document["rows"]}
    assert set(rows) == set(CAUSES)
    for cause, (held, busy, attributed, gain, newest, oldest) in CAUSES.items():
        row = rows[cause]
        assert near(row["held_gpu_hours"], held), (cause, row)
        assert near(row["busy_gpu_hours"], busy), (cause, row)
        assert near(row["attributed_gpu_hours"], attributed, 0.5), (cause, row)
        assert near(row["gain_gpu_hours"], gain, 0.5), (cause, row)
        for name, age in (("newest_diagnosis_age_seconds", newest), ("oldest_diagnosis_age_seconds", oldest)):
            assert (row[name] is None) if age is None else abs(row[name] - age) <= 60, (cause, name, row)
    total = document["total"]
    assert near(total["held_gpu_hours"], 6 + 4 + 6 + 6, 4)  # four GPUs, two steps each
    assert near(total["not_diagnosed_gpu_hours"], 9.0, 2)
    assert near(total["gain_together_gpu_hours"], 0.45 * 3 + 0.4 * 1 + 0.25 * 6, 0.5)
    assert [row["cause"] for row in document["rows"]][-2:] == ["healthy", "not diagnosed"]


@pytest.mark.parametrize("recorded", [False, True], ids=["raw", "recorded"])
def test_by_cause_and_namespace(diagnosed: str, capsys: pytest.CaptureFixture[str], recorded: bool) -> None:
    code, out, err = report(capsys, diagnosed, "--by", "cause", "--by", "namespace", "--json",
                            *(["--recorded"] if recorded else []))
    assert code == 0, err
    document = json.loads(out)
    rows = {(row["cause"], row["owner"]["namespace"]): row for row in document["rows"]}
    assert set(rows) == set(BY_NAMESPACE)
    for key, (held, busy, attributed) in BY_NAMESPACE.items():
        assert near(rows[key]["held_gpu_hours"], held), (key, rows[key])
        assert near(rows[key]["busy_gpu_hours"], busy), (key, rows[key])
        assert near(rows[key]["attributed_gpu_hours"], attributed, 0.5), (key, rows[key])
    owners = {t["owner"]["namespace"]: t for t in document["total"]["by_owner"]}
    assert near(owners["ml"]["gain_together_gpu_hours"], 0.45 * 3 + 0.4, 0.5)
    assert near(owners[""]["gain_together_gpu_hours"], 0.25 * 6, 0.5)


def test_a_time_sliced_gpu_counts_for_each_user(diagnosed: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = report(capsys, diagnosed, "--by", "cause", "--by", "user", "--json")
    assert code == 0, err
    rows = {(row["cause"], row["owner"]["user"]): row for row in json.loads(out)["rows"]}
    for user in ("dave", "erin"):
        assert near(rows["shared_gpu", user]["held_gpu_hours"], 6.0)
        assert near(rows["shared_gpu", user]["busy_gpu_hours"], 1.8)
        assert near(rows["shared_gpu", user]["gain_gpu_hours"], 1.2, 0.2)


def test_the_table(diagnosed: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = report(capsys, diagnosed, "--by", "cause")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == ("GPU-hours by cause, 2024-01-01T00:00:00Z to 2024-01-01T06:00:00Z "
                        "(step 1m, horizon 24h)")
    assert lines[1].split()[:3] == ["cause", "HELD", "GPU-h"]
    causes = [line.split("  ")[0].strip() for line in lines[2:8]]
    # Findings by the GPU-hours attributed to them, then the verdicts, then no diagnosis.
    assert causes == ["shared_gpu", "input_bound", "host_sync", "launch_bound", "healthy", "not diagnosed"]
    assert lines[7].split()[2:] == ["9.0", "5.4", "-", "-", "-"]
    assert "Held: 22.1 GPU-h, 59% of it diagnosed within the horizon" in out
    assert re.search(r"^Could be won back \(all fixes together\): 3\.[23] GPU-h$", out, re.M), out  # 3.25
    assert "causes overlap" in out


def test_a_horizon_shorter_than_the_captures_ages(diagnosed: str, capsys: pytest.CaptureFixture[str]) -> None:
    """At 30 minutes, only the captures younger than that at a step count: node-2 GPU 1's (10 minutes
    before the range) for its first 20 minutes and node-1 GPU 0's healthy one for 31 minutes."""
    code, out, err = report(capsys, diagnosed, "--by", "cause", "--horizon", "30m", "--json")
    assert code == 0, err
    document = json.loads(out)
    rows = {row["cause"]: row for row in document["rows"]}
    assert document["horizon_seconds"] == 1800
    assert any("within the horizon (30m) before the step" in note for note in document["notes"])
    assert set(rows) == {"shared_gpu", "input_bound", "healthy", "not diagnosed"}
    assert near(rows["shared_gpu"]["held_gpu_hours"], 20 / 60)
    assert near(rows["healthy"]["held_gpu_hours"], 31 / 60)
    assert near(rows["not diagnosed"]["held_gpu_hours"], 22 - 20 / 60 - 31 / 60, 4)


def test_the_six_hours_have_the_names_and_labels_the_agent_exports() -> None:
    """The generated diagnosis series are hand-written: this keeps them the agent's own families and
    label names (Prometheus adds instance and job)."""
    written: dict[str, set[str]] = {}
    for line in openmetrics():
        name, _, rest = line.partition("{")
        if name.startswith("gpuscope_diagnosis_"):
            written.setdefault(name, {pair.split("=")[0] for pair in rest.split("}")[0].split(",")})
    diagnosis = GpuDiagnosis(0, "c1", START, "input_bound", (FindingShare("input_bound", "high", 0.4, 0.3),),
                             0.3)

    class OneDiagnosis:
        def latest(self) -> list[GpuDiagnosis]:
            return [diagnosis]

    collector = DiagnosisCollector(OneDiagnosis(), FakeSource(make_snapshot([make_gpu(0)])))
    exported = {sample.name: set(sample.labels)
                for family in collector.collect() for sample in family.samples}
    assert {name: labels - {"instance", "job"} for name, labels in written.items()} == exported

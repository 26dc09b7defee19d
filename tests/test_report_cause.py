"""`gpuscope report --by cause` without a Prometheus: the flags, the recording rules kept equal to the
report's own expressions, a fleet without any diagnosis, and the table (tests/test_report_cause_e2e.py
runs the queries against a real Prometheus)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_prometheus_rules import run_promtool
from test_report import EMPTY, NOW, CannedPrometheus, series, server

from gpuscope.cli.main import main
from gpuscope.cli.report_cause import cause_as_csv, cause_as_json, cause_as_table
from gpuscope.report.build import NoData
from gpuscope.report.cause_build import build_cause_report
from gpuscope.report.cause_promql import (
    CAUSE_RULES,
    NOT_DIAGNOSED,
    RECORDED_HORIZON_S,
    TOGETHER_RULE,
    CausePerGpu,
    CauseQueries,
    quoted,
)

ROOT = Path(__file__).resolve().parent.parent
RECORDING_RULES = ROOT / "deploy" / "prometheus" / "gpuscope-recording-rules.yml"


def test_the_recording_rules_record_the_reports_own_expressions() -> None:
    """--recorded and the raw report must count the same: the rules are the raw per-GPU expressions at
    the rules' horizon and a minute's busy rate."""
    groups = yaml.safe_load(RECORDING_RULES.read_text())["groups"]
    (group,) = [g for g in groups if g["name"] == "gpuscope-diagnosis"]
    assert group["interval"] == "1m"
    recorded = {rule["record"]: " ".join(rule["expr"].split()) for rule in group["rules"]}
    per_gpu = CausePerGpu(RECORDED_HORIZON_S, 60)
    expected = {rule: per_gpu.column(name) for name, rule in CAUSE_RULES.items()}
    expected[TOGETHER_RULE] = per_gpu.together()
    assert recorded == expected


@pytest.mark.parametrize(("args", "message"), [
    (["--by", "cause", "--by", "gpu"], "--by cause combines with at most one of pod, namespace, user, node"),
    (["--by", "cause", "--by", "pod", "--by", "user"], "--by cause combines with at most one of"),
    (["--by", "cause", "--by", "cause"], "--by cause combines with at most one of"),
    (["--by", "pod", "--by", "user"], "two --by are for cause and an owner"),
    (["--by", "pod", "--horizon", "12h"], "--horizon applies to --by cause"),
    (["--by", "cause", "--recorded", "--horizon", "12h"], "--recorded reads rules whose horizon is 24h"),
])
def test_wrong_groupings_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], args: list[str],
                                              message: str) -> None:
    code = main(["report", "--prometheus", "http://127.0.0.1:9", "--since", "1d", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and err.count("\n") == 1


def test_a_horizon_that_is_not_a_span_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["report", "--prometheus", "http://127.0.0.1:9", "--since", "1d", "--by", "cause",
              "--horizon", "soon"])
    assert exit_.value.code == 2
    assert "a span of at least 1m such as 24h or 7d, got 'soon'" in capsys.readouterr().err


def test_the_horizon_and_the_owner_reach_the_queries() -> None:
    queries = CauseQueries("namespace", range_s=3600, step_s=60, horizon_s=7200)
    held = queries.column("held", ["input_bound", NOT_DIAGNOSED])
    assert held is not None and "> time() - 7200" in held
    assert held.startswith("sum by (cause, namespace) (")
    assert 'gpuscope_diagnosis_finding_share{finding="input_bound"}' in held
    assert queries.column("held", []) is None, "no cause seen, nothing to ask by owner"
    # By node a GPU has one owner: no arm per cause.
    by_node = CauseQueries("node", range_s=3600, step_s=60).column("attributed", [])
    assert by_node is not None and by_node.startswith("sum by (cause, instance) (")


def test_a_cause_label_outside_the_vocabulary_is_refused() -> None:
    assert quoted("input_bound") == '"input_bound"'
    with pytest.raises(ValueError, match="unexpected cause label value"):
        quoted('x"} or vector(1) or {a="')


def held_only(queries: CauseQueries) -> dict[str, list[dict[str, Any]]]:
    """A fleet that exported no diagnosis: its two held GPUs are "not diagnosed"."""
    held = queries.column("held", [])
    busy = queries.column("busy", [])
    assert held is not None and busy is not None
    return {held: [series(7200, cause=NOT_DIAGNOSED)], busy: [series(3600, cause=NOT_DIAGNOSED)],
            queries.held_total(): [series(7200)]}


def test_no_diagnosis_at_all_is_a_report_of_not_diagnosed_with_a_note() -> None:
    queries = CauseQueries(None, range_s=3600, step_s=60)
    canned = CannedPrometheus(held_only(queries))
    report = build_cause_report(canned, queries, NOW - 3600, NOW)  # type: ignore[arg-type]
    assert [(r.cause, r.held_gpu_hours, r.busy_gpu_hours, r.attributed_gpu_hours) for r in report.rows] == [
        (NOT_DIAGNOSED, 2.0, 1.0, None)]
    assert report.gain_together_gpu_hours is None
    assert any("no agent exported a diagnosis in the range" in note for note in report.notes)
    table = cause_as_table(report)
    assert "Held: 2.0 GPU-h, 0% of it diagnosed within the horizon" in table
    assert "Could be won back (all fixes together): - GPU-h (no fix estimated in the range)" in table
    assert table.splitlines()[2].split() == ["not", "diagnosed", "2.0", "1.0", "-", "-", "-"]
    document = cause_as_json(report)
    assert document["by"] == ["cause"] and document["total"]["diagnosed_share"] == 0.0
    assert cause_as_csv(report).splitlines()[1] == "not diagnosed,2,1,,,,"


def test_nothing_held_is_no_data() -> None:
    queries = CauseQueries(None, range_s=3600, step_s=60)
    with pytest.raises(NoData, match="no GPU was held in the range"):
        build_cause_report(CannedPrometheus({}), queries, NOW - 3600, NOW)  # type: ignore[arg-type]


def test_the_cli_prints_the_note_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    with server(200, EMPTY) as (url, _):
        code = main(["report", "--prometheus", url, "--since", "1h", "--by", "cause", "--by", "pod"])
    assert code == 1
    assert capsys.readouterr().err.startswith("gpuscope report: no GPU was held in the range")


def test_overlapping_causes_sort_by_what_they_cost_and_say_they_overlap() -> None:
    queries = CauseQueries(None, range_s=3600, step_s=60)
    answers = held_only(queries)
    held, attributed, gain = (queries.column(name, []) for name in ("held", "attributed", "gain"))
    assert held is not None and attributed is not None and gain is not None
    answers[held] = [series(3600, cause="host_sync"), series(3600, cause="input_bound"),
                     series(3600, cause="healthy"), series(3600, cause=NOT_DIAGNOSED)]
    answers[attributed] = [series(720, cause="host_sync"), series(1440, cause="input_bound")]
    answers[gain] = [series(1080, cause="input_bound")]
    answers[queries.together()] = [series(1800)]
    answers[queries.any_diagnosis()] = [series(1)]
    report = build_cause_report(CannedPrometheus(answers), queries, NOW - 3600, NOW)  # type: ignore[arg-type]
    assert [r.cause for r in report.rows] == ["input_bound", "host_sync", "healthy", NOT_DIAGNOSED]
    table = cause_as_table(report)
    assert table.splitlines()[2].split()[:5] == ["input_bound", "1.0", "0.0", "0.4", "0.3"]
    assert table.splitlines()[3].split()[3:5] == ["0.2", "-"], "the sync's fix was not estimated"
    assert "Could be won back (all fixes together): 0.5 GPU-h" in table
    assert "causes overlap" in table and "no agent exported" not in table
    assert json.loads(json.dumps(cause_as_json(report)))["total"]["gain_together_gpu_hours"] == 0.5


def test_the_fleet_dashboards_cause_panels_chart_the_reports_expressions() -> None:
    """The panels "GPU-hours by cause" and "Could be won back" count what `report --by cause` counts
    (24h horizon), with the dashboard's job and instance on every selector."""
    dashboard = json.loads((ROOT / "dashboards" / "gpu-fleet.json").read_text())
    panels = {p["title"]: p for p in dashboard["panels"]}
    per_gpu = CausePerGpu(RECORDED_HORIZON_S, 60, matchers='job=~"$job", instance=~"$instance"')

    def hours(expr: str, by: str = "cause") -> str:
        return f"sum by ({by}) (sum_over_time(({expr})[$__range:$__interval])) * $__interval_ms / 3600000"

    (held,) = panels["GPU-hours by cause"]["targets"]
    assert held["expr"] == hours(per_gpu.cause_held())
    gains, together = panels["Could be won back"]["targets"]
    assert gains["expr"].startswith(hours(per_gpu.gain()) + " or on () ")
    assert together["expr"] == hours(per_gpu.together(), by="") + " or vector(0)"


def test_the_demo_prometheus_config_is_valid_and_scrapes_the_demo_agent() -> None:
    """docs/report.md's "Try it on the demo" starts Prometheus with this file."""
    config = ROOT / "deploy" / "prometheus" / "demo-prometheus.yml"
    document = yaml.safe_load(config.read_text())
    assert document["rule_files"] == ["gpuscope-recording-rules.yml"]
    assert document["scrape_configs"][0]["static_configs"][0]["targets"] == ["127.0.0.1:9847"]
    result = run_promtool("check", "config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_step_as_short_as_the_scrape_interval_still_reads_the_busy_rate() -> None:
    """rate() over a window holding one sample is empty: a step under a minute reads the last minute."""
    by_pod = CauseQueries("pod", range_s=3600, step_s=15).column("busy", ["input_bound"])
    assert by_pod is not None and "rate(gpu_process_busy_seconds_total[60s])" in by_pod
    assert "[3600s:15s]" in by_pod
    short = CauseQueries(None, range_s=3600, step_s=15).column("busy", [])
    assert short is not None and "rate(gpu_busy_seconds_total[60s])" in short
    long = CauseQueries(None, range_s=86400, step_s=300).column("busy", [])
    assert long is not None and "rate(gpu_busy_seconds_total[300s])" in long

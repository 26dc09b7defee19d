"""deploy/prometheus/gpuscope-rules.yml: valid for promtool, its unit tests pass, in step with the agent.

The PromQL rules restate the agent's own rules; the unit tests (promtool test rules) prove each fires
and does not fire where it should. The checks here also keep their names, severities and ``for``
durations equal to the agent's rule defaults, so a change on one side that forgets the other fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuscope.alerts.rules import RulesConfig
from gpuscope.common.durations import parse_duration

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "gpuscope-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "tests" / "gpuscope-rules.test.yml"
AGENT_RULES = list(RulesConfig.model_fields)  # the agent's alert names
OPERATIONAL = ["GpuscopeDown", "GpuscopeNvmlDown", "GpuLost"]
# PromQL only: the hardware health alerts (docs/alerts.md, "Hardware health").
HARDWARE = ["GpuRowRemapPending", "GpuRowRemapFailed", "GpuNvlinkErrors", "GpuPcieErrors", "GpuUnhealthy"]


def promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is not installed; scripts/test.sh installs it (Debian package prometheus)")
        pytest.skip("promtool is not installed (scripts/test.sh installs it)")
    return binary


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60, check=False,
                          cwd=ROOT)


def alerting_rules() -> dict[str, dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert all("alert" in rule for rule in rules), "recording rules are not expected here"
    return {rule["alert"]: rule for rule in rules}


def test_promtool_check_rules() -> None:
    result = run_promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerting_rules())} rules found" in result.stdout


def test_promtool_test_rules() -> None:
    result = run_promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_agent_rule_and_the_operational_and_hardware_alerts_are_there() -> None:
    assert list(alerting_rules()) == [*AGENT_RULES, *OPERATIONAL, *HARDWARE]


@pytest.mark.parametrize("name", AGENT_RULES)
def test_severity_and_for_equal_the_agent_defaults(name: str) -> None:
    rule = alerting_rules()[name]
    defaults = getattr(RulesConfig(), name)
    assert rule["labels"]["severity"] == defaults.severity
    assert parse_duration(rule.get("for", "0s")) == defaults.for_


def test_every_alert_has_a_severity_and_sentences_to_show() -> None:
    for name, rule in alerting_rules().items():
        assert rule["labels"]["severity"] in ("info", "warning", "critical"), name
        assert set(rule["annotations"]) == {"summary", "description"}, name
        assert "{{ $labels.instance }}" in rule["annotations"]["summary"], name


def test_every_alert_is_unit_tested() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    firing = {case["alertname"] for test in tests for case in test.get("alert_rule_test", [])
              if case.get("exp_alerts")}
    assert firing == set(alerting_rules()), "every alert needs a case where it fires"


RECORDING_RULES = ROOT / "deploy" / "prometheus" / "gpuscope-recording-rules.yml"
RECORDING_RULE_TESTS = ROOT / "deploy" / "prometheus" / "tests" / "gpuscope-recording-rules.test.yml"


def test_promtool_checks_and_unit_tests_the_recording_rules() -> None:
    groups = yaml.safe_load(RECORDING_RULES.read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert all("record" in rule for rule in rules)
    result = run_promtool("check", "rules", str(RECORDING_RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout
    result = run_promtool("test", "rules", str(RECORDING_RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_rule_file_has_its_unit_tests() -> None:
    tests = sorted(p.name for p in (ROOT / "deploy" / "prometheus" / "tests").glob("*.test.yml"))
    assert tests == sorted([RULE_TESTS.name, RECORDING_RULE_TESTS.name])

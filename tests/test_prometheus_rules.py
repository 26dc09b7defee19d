"""deploy/prometheus/gpuscope-rules.yml: valid for promtool, its unit tests pass, in step with the agent.

The PromQL rules restate the agent's own rules; the unit tests (promtool test rules) prove each fires
and does not fire where it should. The checks here also keep their names, severities and ``for``
durations equal to the agent's rule defaults, so a change on one side that forgets the other fails.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuscope.alerts.rules import HARDWARE_RULES, RulesConfig
from gpuscope.common.durations import parse_duration

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "gpuscope-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "tests" / "gpuscope-rules.test.yml"
NODE_RULES = list(RulesConfig.model_fields)  # every alert name of the agent's own rules
# The agent's rules on how a GPU is used (group gpuscope-waste) and on its hardware (gpuscope-hardware).
AGENT_RULES = [name for name in NODE_RULES if name not in HARDWARE_RULES]
HARDWARE = list(HARDWARE_RULES)
OPERATIONAL = ["GpuscopeDown", "GpuscopeNvmlDown", "GpuLost"]  # PromQL only: about the agent and NVML


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


def test_the_hardware_group_holds_the_agents_hardware_rules_in_order() -> None:
    groups = {group["name"]: group for group in yaml.safe_load(RULES.read_text())["groups"]}
    assert [rule["alert"] for rule in groups["gpuscope-hardware"]["rules"]] == HARDWARE


@pytest.mark.parametrize("name", NODE_RULES)
def test_severity_and_for_equal_the_agent_defaults(name: str) -> None:
    rule = alerting_rules()[name]
    defaults = getattr(RulesConfig(), name)
    assert rule["labels"]["severity"] == defaults.severity
    assert parse_duration(rule.get("for", "0s")) == defaults.for_
    if name in HARDWARE:  # no label of its own but its severity, as the node's hardware alerts
        assert set(rule["labels"]) == {"severity"}


def numbers_after(expr: str, operator: str) -> list[float]:
    """The constants an expression compares with ``operator`` ("> 80" -> 80.0), in order."""
    return [float(x) for x in re.findall(rf"{re.escape(operator)}\s*([0-9.]+)", expr)]


def ranges(expr: str) -> set[float]:
    """The range selectors' lengths in seconds ("[10m]" -> 600.0)."""
    return {parse_duration(x) for x in re.findall(r"\[([0-9]+[smh])\]", expr)}


def test_hardware_thresholds_equal_the_agent_defaults() -> None:
    """The thresholds the PromQL expressions state are those the agent's rules judge by default."""
    rules, defaults = alerting_rules(), RulesConfig()
    assert rules["GpuRowRemapPending"]["expr"].strip() == "gpu_row_remap_pending == 1"
    assert rules["GpuRowRemapFailed"]["expr"].strip() == "gpu_row_remap_failed == 1"
    assert rules["GpuUnhealthy"]["expr"].strip() == 'gpu_health{state!="ok"} == 1'
    nvlink, pcie, ecc = (rules[name]["expr"]
                         for name in ("GpuNvlinkErrors", "GpuPcieErrors", "GpuEccUncorrectable"))
    nvlink_defaults = defaults.GpuNvlinkErrors  # type: ignore[attr-defined]
    assert ranges(nvlink) == {nvlink_defaults.window}
    assert numbers_after(nvlink, ">") == [0.0, nvlink_defaults.crc_per_second * nvlink_defaults.window]
    assert 'type=~"recovery|replay"' in nvlink and 'type=~"crc_flit|crc_data"' in nvlink
    pcie_defaults = defaults.GpuPcieErrors  # type: ignore[attr-defined]
    assert ranges(pcie) == {pcie_defaults.window}
    assert numbers_after(pcie, ">") == [0.0, pcie_defaults.replays_per_minute * pcie_defaults.window / 60]
    assert 'type=~"fatal|non_fatal"' in pcie
    assert ranges(ecc) == {defaults.GpuEccUncorrectable.window}  # type: ignore[attr-defined]
    assert numbers_after(ecc, ">") == [0.0]


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

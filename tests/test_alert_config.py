"""The `alerting.rules` configuration: defaults, building the rules, and bad values refused by path."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from gpuscope.alerts.config import AlertingConfig
from gpuscope.alerts.rules import RULE_TYPES, RULES, RulesConfig, build_rules, validate_against_interval
from gpuscope.alerts.rules.base import Rule
from gpuscope.alerts.rules.shared_by_processes import SharedByProcessesRule
from gpuscope.alerts.rules.xid_error import XidErrorRule
from gpuscope.common.config_types import format_errors


class Root(BaseModel):
    """The settings' shape around the section, so that error paths start at `alerting`."""

    model_config = ConfigDict(extra="forbid")
    alerting: AlertingConfig = AlertingConfig()


def problems(rules: dict[str, Any]) -> list[str]:
    with pytest.raises(ValidationError) as caught:
        Root.model_validate({"alerting": {"rules": rules}})
    return format_errors(caught.value)


def rules_config(rules: dict[str, Any]) -> RulesConfig:
    return Root.model_validate({"alerting": {"rules": rules}}).alerting.rules


# The documented defaults (docs/alerts.md): (severity, window, for, clear_for, thresholds).
DOCUMENTED = {
    "GpuLowUtilization": ("warning", 120.0, 120.0, 60.0, {"threshold": 0.80, "hysteresis": 0.05}),
    "GpuSharedByProcesses": ("warning", None, 30.0, 30.0, {
        "max_processes": 1, "allow": ["nvidia-cuda-mps-server", "nvidia-cuda-mps-control"]}),
    "GpuFrequentIdleDips": ("warning", 60.0, 60.0, 60.0, {
        "max_per_minute": 6.0, "hysteresis": 1.0, "min_utilization": 0.30}),
    "GpuUtilizationSkew": ("warning", 120.0, 120.0, 60.0, {"max_spread": 0.20, "hysteresis": 0.05,
                                                           "min_gpus": 2}),
    "GpuBusyButStalled": ("warning", 60.0, 60.0, 60.0, {"min_utilization": 0.80, "max_sm_active": 0.30,
                                                       "hysteresis": 0.05}),
    "GpuThrottled": ("warning", 120.0, 60.0, 60.0, {"min_fraction": 0.5, "hysteresis": 0.1}),
    "GpuXidError": ("critical", 30.0, 0.0, 300.0, {"benign": [13, 31, 43, 45]}),
    "GpuHeldIdle": ("warning", 600.0, 300.0, 60.0, {"threshold": 0.05, "hysteresis": 0.05,
                                                    "min_memory": 2**30}),
    "GpuAllocatedUnused": ("warning", 600.0, 300.0, 60.0, {}),
    "GpuRowRemapPending": ("warning", None, 60.0, 0.0, {}),
    "GpuRowRemapFailed": ("critical", None, 60.0, 0.0, {}),
    # The counter rules judge their window from their own record (window_seconds None: no history).
    "GpuNvlinkErrors": ("warning", None, 0.0, 0.0, {"window": 600.0, "crc_per_second": 100.0}),
    "GpuPcieErrors": ("warning", None, 0.0, 0.0, {"window": 600.0, "replays_per_minute": 8.0}),
    "GpuUnhealthy": ("warning", None, 60.0, 0.0, {}),
    "GpuEccUncorrectable": ("critical", None, 0.0, 0.0, {"window": 600.0}),
}


def test_defaults_build_every_rule_with_the_documented_values() -> None:
    rules = {r.name: r for r in build_rules(RulesConfig())}
    assert list(rules) == list(RulesConfig.model_fields) == list(RULE_TYPES) == list(DOCUMENTED)
    for name, (severity, window, for_, clear_for, thresholds) in DOCUMENTED.items():
        rule = rules[name]
        assert (rule.severity, rule.window_seconds, rule.for_seconds, rule.clear_for_seconds) == (
            severity, window, for_, clear_for), name
        assert {key: getattr(rule.config, key) for key in thresholds} == thresholds, name
    assert validate_against_interval(RulesConfig(), 1.0) == []


def test_every_registered_rule_declares_what_the_registry_needs() -> None:
    for rule in RULES:
        assert issubclass(rule, Rule) and rule.name.startswith("Gpu")
        assert isinstance(rule.captures_by_default, bool)
        assert rule.config_model().enabled  # every default is valid, and a rule is on by default
        assert rule.configured() == rule(rule.config_model())


def test_values_from_yaml_reach_the_rules() -> None:
    config = rules_config({
        "GpuLowUtilization": {"threshold": 0.7, "window": "5m", "for": "10m", "clear_for": "1m30s",
                              "severity": "info"},
        "GpuSharedByProcesses": {"allow": ["my-sidecar"], "max_processes": 2},
        "GpuThrottled": {"enabled": False},
        "GpuXidError": {"benign": [13, 43, 45, 31, 68]},
    })
    rules = {r.name: r for r in build_rules(config)}
    assert "GpuThrottled" not in rules and len(rules) == len(RULES) - 1
    low = rules["GpuLowUtilization"]
    assert (low.config.threshold, low.window_seconds, low.for_seconds, low.clear_for_seconds,
            low.severity) == (0.7, 300.0, 600.0, 90.0, "info")
    shared = rules["GpuSharedByProcesses"]
    assert isinstance(shared, SharedByProcessesRule)
    assert shared.allow == frozenset({"my-sidecar"}) and shared.config.max_processes == 2
    xid = rules["GpuXidError"]
    assert isinstance(xid, XidErrorRule) and 68 in xid.benign


def test_an_unknown_rule_name_is_refused_with_its_path() -> None:
    assert problems({"GpuLowUtilisation": {"threshold": 0.7}}) == [
        "alerting.rules.GpuLowUtilisation: unknown key"]


def test_an_unknown_key_inside_a_rule_is_refused_with_its_path() -> None:
    assert problems({"GpuThrottled": {"treshold": 0.5}}) == [
        "alerting.rules.GpuThrottled.treshold: unknown key"]


@pytest.mark.parametrize(("rules", "expected"), [
    ({"GpuLowUtilization": {"threshold": 1.5}},
     "alerting.rules.GpuLowUtilization.threshold: Input should be less than or equal to 1 (got 1.5)"),
    ({"GpuLowUtilization": {"threshold": 0}},
     "alerting.rules.GpuLowUtilization.threshold: Input should be greater than 0 (got 0)"),
    ({"GpuFrequentIdleDips": {"min_utilization": -0.1}},
     "alerting.rules.GpuFrequentIdleDips.min_utilization: Input should be greater than or equal to 0 "
     "(got -0.1)"),
    ({"GpuUtilizationSkew": {"max_spread": 1}},
     "alerting.rules.GpuUtilizationSkew.max_spread: Input should be less than 1 (got 1)"),
    ({"GpuUtilizationSkew": {"min_gpus": 1}},
     "alerting.rules.GpuUtilizationSkew.min_gpus: Input should be greater than or equal to 2 (got 1)"),
    ({"GpuSharedByProcesses": {"max_processes": 0}},
     "alerting.rules.GpuSharedByProcesses.max_processes: Input should be greater than or equal to 1 (got 0)"),
    ({"GpuXidError": {"benign": [13, 0]}},
     "alerting.rules.GpuXidError.benign[1]: Input should be greater than or equal to 1 (got 0)"),
    ({"GpuXidError": {"severity": "page"}},
     "alerting.rules.GpuXidError.severity: Input should be 'info', 'warning' or 'critical' (got 'page')"),
    ({"GpuLowUtilization": {"for": "soon"}},
     "alerting.rules.GpuLowUtilization.for: expected a duration such as 1.5, '500ms' or '2m', "
     "got 'soon'"),
    ({"GpuLowUtilization": {"window": "2h"}},
     "alerting.rules.GpuLowUtilization.window: a window must be longer than 0 and at most 1h, "
     "got 120m (got '2h')"),
    ({"GpuLowUtilization": {"window": 0}},
     "alerting.rules.GpuLowUtilization.window: a window must be longer than 0 and at most 1h, "
     "got 0s"),
    ({"GpuXidError": {"clear_for": "25h"}},
     "alerting.rules.GpuXidError.clear_for: must be at most 24h, got 1500m (got '25h')"),
    ({"GpuHeldIdle": {"min_memory": 0}},
     "alerting.rules.GpuHeldIdle.min_memory: Input should be greater than or equal to 1 (got 0)"),
    ({"GpuHeldIdle": {"min_memory": "lots"}},
     "alerting.rules.GpuHeldIdle.min_memory: expected a size such as 1024, '512MiB' or '80GiB', got 'lots'"),
    ({"GpuHeldIdle": {"threshold": 0}},
     "alerting.rules.GpuHeldIdle.threshold: Input should be greater than 0 (got 0)"),
    ({"GpuAllocatedUnused": {"window": "90m"}},
     "alerting.rules.GpuAllocatedUnused.window: a window must be longer than 0 and at most 1h, "
     "got 90m (got '90m')"),
])
def test_out_of_range_values_are_refused_with_their_path(rules: dict[str, Any], expected: str) -> None:
    assert problems(rules) == [expected]


@pytest.mark.parametrize(("rules", "expected"), [
    ({"GpuLowUtilization": {"threshold": 0.99}}, "threshold + hysteresis must be at most 1"),
    ({"GpuUtilizationSkew": {"max_spread": 0.1, "hysteresis": 0.1}}, "hysteresis must be below max_spread"),
    ({"GpuFrequentIdleDips": {"max_per_minute": 1, "hysteresis": 1}},
     "hysteresis must be below max_per_minute"),
    ({"GpuThrottled": {"min_fraction": 0.1}}, "hysteresis must be below min_fraction"),
    ({"GpuBusyButStalled": {"min_utilization": 0.3, "max_sm_active": 0.5}},
     "max_sm_active must be below min_utilization"),
    ({"GpuThrottled": {"reasons": ["sw_power_capp"]}}, "unknown clock event reason(s) ['sw_power_capp']"),
    ({"GpuHeldIdle": {"threshold": 0.99}}, "threshold + hysteresis must be at most 1"),
])
def test_inconsistent_rule_settings_are_refused(rules: dict[str, Any], expected: str) -> None:
    (problem,) = problems(rules)
    name = next(iter(rules))
    assert problem.startswith(f"alerting.rules.{name}: ") and expected in problem


def test_a_window_shorter_than_the_sample_interval_is_refused() -> None:
    config = rules_config({"GpuLowUtilization": {"window": "500ms"}, "GpuXidError": {"window": "1s"}})
    assert validate_against_interval(config, 1.0) == [
        "alerting.rules.GpuLowUtilization.window: must be at least the sample interval (1s), got 500ms"]
    assert validate_against_interval(config, 2.0) == [
        "alerting.rules.GpuLowUtilization.window: must be at least the sample interval (2s), got 500ms",
        "alerting.rules.GpuXidError.window: must be at least the sample interval (2s), got 1s"]


def test_a_window_of_too_many_samples_is_refused() -> None:
    config = rules_config({"GpuThrottled": {"window": "1h"}})
    assert validate_against_interval(config, 1.0) == []
    assert validate_against_interval(config, 0.25) == [
        "alerting.rules.GpuThrottled.window: 60m holds 14400 samples at the 250ms sample interval; "
        "at most 7200 (shorten the window or lengthen the interval)"]

"""The alert rules, registered in one place: ``RULES`` (docs/alerts.md explains each one).

Each rule lives in a module of its own with its configuration model (its defaults, stated once), its
condition and whether its firing takes a profiler capture by default. Everything else is derived
from ``RULES``: the ``alerting.rules`` section of the configuration (``RulesConfig``, one key per
rule name), the rules the engine runs (``build_rules``), and the capture defaults. Adding a rule is
adding its module and one line here.

```yaml
alerting:
  rules:
    GpuLowUtilization: {threshold: 0.7, window: 5m, for: 5m}
    GpuSharedByProcesses: {allow: [nvidia-cuda-mps-server, my-sidecar]}
    GpuThrottled: {enabled: false}
    GpuHeldIdle: {min_memory: 4GiB, window: 30m}
```
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import create_model

from gpuscope.alerts.rules.allocated_unused import AllocatedUnusedRule
from gpuscope.alerts.rules.base import MAX_WINDOW_POINTS, Rule, RuleConfig
from gpuscope.alerts.rules.busy_but_stalled import BusyButStalledRule
from gpuscope.alerts.rules.ecc_uncorrectable import EccUncorrectableRule
from gpuscope.alerts.rules.frequent_idle_dips import FrequentIdleDipsRule
from gpuscope.alerts.rules.held_idle import HeldIdleRule
from gpuscope.alerts.rules.low_utilization import LowUtilizationRule
from gpuscope.alerts.rules.nvlink_errors import NvlinkErrorsRule
from gpuscope.alerts.rules.pcie_errors import PcieErrorsRule
from gpuscope.alerts.rules.row_remap_failed import RowRemapFailedRule
from gpuscope.alerts.rules.row_remap_pending import RowRemapPendingRule
from gpuscope.alerts.rules.shared_by_processes import SharedByProcessesRule
from gpuscope.alerts.rules.throttled import ThrottledRule
from gpuscope.alerts.rules.unhealthy import UnhealthyRule
from gpuscope.alerts.rules.utilization_skew import UtilizationSkewRule
from gpuscope.alerts.rules.xid_error import XidErrorRule
from gpuscope.common.config_types import Section
from gpuscope.common.durations import format_duration

# Every rule, in the order the engine evaluates them and the configuration lists them.
RULES: tuple[type[Rule[Any]], ...] = (
    LowUtilizationRule,
    SharedByProcessesRule,
    FrequentIdleDipsRule,
    UtilizationSkewRule,
    BusyButStalledRule,
    ThrottledRule,
    XidErrorRule,
    HeldIdleRule,
    AllocatedUnusedRule,
    # The GPU's hardware health, in the order of the PromQL rules' gpuscope-hardware group.
    RowRemapPendingRule,
    RowRemapFailedRule,
    NvlinkErrorsRule,
    PcieErrorsRule,
    UnhealthyRule,
    EccUncorrectableRule,
)
RULE_TYPES: Mapping[str, type[Rule[Any]]] = {rule.name: rule for rule in RULES}
# The rules on the GPU's hardware (a fault to drain on, not a way of using the GPU): the status page
# and the snapshot count their alerts in a GPU's health.
HARDWARE_RULES: tuple[str, ...] = (
    RowRemapPendingRule.name, RowRemapFailedRule.name, NvlinkErrorsRule.name, PcieErrorsRule.name,
    UnhealthyRule.name, EccUncorrectableRule.name)
# Whether a rule's firing takes a capture when capture.rules does not say.
CAPTURES_BY_DEFAULT: Mapping[str, bool] = {rule.name: rule.captures_by_default for rule in RULES}

if TYPE_CHECKING:
    class RulesConfig(Section):
        """Per-rule settings; the keys are the rule names (built from RULES at run time)."""
else:
    RulesConfig = create_model(
        "RulesConfig", __base__=Section, __module__=__name__,
        __doc__="Per-rule settings; the keys are the rule names.",
        **{rule.name: (rule.config_model, rule.config_model()) for rule in RULES})


def rule_config(config: RulesConfig, name: str) -> RuleConfig:
    """The settings of the rule ``name``."""
    found: RuleConfig = getattr(config, name)
    return found


def build_rules(config: RulesConfig) -> list[Rule[Any]]:
    """The enabled rules, configured, in the order of RULES."""
    return [rule(settings) for rule in RULES if (settings := rule_config(config, rule.name)).enabled]


def validate_against_interval(config: RulesConfig, sample_interval: float) -> list[str]:
    """Problems of the rules' windows at this sample interval, as "key.path: reason" lines."""
    problems = []
    for rule in RULES:
        window = getattr(rule_config(config, rule.name), "window", None)
        if window is None:
            continue
        path = f"alerting.rules.{rule.name}.window"
        if window < sample_interval - 1e-9:
            problems.append(f"{path}: must be at least the sample interval "
                            f"({format_duration(sample_interval)}), got {format_duration(window)}")
        elif window / sample_interval > MAX_WINDOW_POINTS:
            problems.append(f"{path}: {format_duration(window)} holds {window / sample_interval:.0f} "
                            f"samples at the {format_duration(sample_interval)} sample interval; at most "
                            f"{MAX_WINDOW_POINTS} (shorten the window or lengthen the interval)")
    return problems

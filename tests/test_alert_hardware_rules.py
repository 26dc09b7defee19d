"""The hardware-health rules on hand-built histories: row remapping, the GPU's health state, and the
NVLink, PCIe and ECC error counters over their window (counted from the first value seen, a counter
that goes down starting again from its new value, as PromQL's increase() does)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from snapshots import mig_uuid
from test_alert_rules import feed, history_for, node

from gpuscope.alerts.history import NodeHistory
from gpuscope.alerts.model import Condition
from gpuscope.alerts.rules import HARDWARE_RULES, RULE_TYPES
from gpuscope.alerts.rules.base import Rule
from gpuscope.alerts.rules.ecc_uncorrectable import EccUncorrectableRule
from gpuscope.alerts.rules.hardware import CounterIncreases
from gpuscope.alerts.rules.nvlink_errors import NvlinkErrorsRule
from gpuscope.alerts.rules.pcie_errors import PcieErrorsRule
from gpuscope.alerts.rules.row_remap_failed import RowRemapFailedRule
from gpuscope.alerts.rules.row_remap_pending import RowRemapPendingRule
from gpuscope.alerts.rules.unhealthy import UnhealthyRule
from gpuscope.snapshot import GpuReading, MigReading

NVLINK_ZERO = {"crc_flit": 0, "crc_data": 0, "replay": 0, "recovery": 0}


def evaluated(rule: Rule[Any], seconds: int, gpus: Callable[[float], list[GpuReading]]
              ) -> list[dict[int, Condition]]:
    """The rule's conditions at each tick of ``seconds`` of ``gpus``, evaluated every tick as the
    engine does (the counter rules keep their record at each evaluation)."""
    h = history_for(rule)
    out = []
    for t in range(seconds):
        feed(h, 1, gpus, start=float(t))
        out.append(rule.evaluate(h, frozenset()))
    return out


def firing_ticks(results: list[dict[int, Condition]], gpu_index: int) -> list[int]:
    return [t for t, found in enumerate(results) if gpu_index in found]


def test_every_hardware_rule_is_registered_and_takes_no_capture() -> None:
    for name in HARDWARE_RULES:
        assert not RULE_TYPES[name].captures_by_default, name  # a trace cannot show a hardware fault


def test_row_remap_pending_and_failed_on_their_gpus_only() -> None:
    gpus = node(g1={"row_remap_pending": True, "remapped_rows_uncorrectable_total": 1},
                g3={"row_remap_failed": True, "remapped_rows_uncorrectable_total": 8})
    h = history_for()
    feed(h, 3, gpus)
    pending = RowRemapPendingRule.configured().evaluate(h, frozenset())
    failed = RowRemapFailedRule.configured().evaluate(h, frozenset())
    assert set(pending) == {1} and set(failed) == {3}
    assert pending[1].summary == "GPU 1 has a memory row remap pending: drain it and reset the GPU"
    assert failed[3].summary == "GPU 3 could not remap a failing memory row: drain it and replace the GPU"
    assert failed[3].values["remapped_rows_uncorrectable"] == 8.0
    assert pending[1].labels == {} and failed[3].labels == {}
    # Unknown (not read, as on a GPU without row remapping) is not a fault.
    h = history_for()
    feed(h, 3, node(g0={"row_remap_pending": None, "row_remap_failed": None}))
    assert RowRemapPendingRule.configured().evaluate(h, frozenset()) == {}


def test_unhealthy_names_the_state_and_covers_a_lost_gpu() -> None:
    rule = UnhealthyRule.configured()
    assert rule.include_down
    h = history_for()
    feed(h, 3, node(g0={"row_remap_pending": True}, g1={"row_remap_failed": True, "row_remap_pending": True},
                    g2={"up": False}))
    found = rule.evaluate(h, frozenset())
    assert set(found) == {0, 1, 2}
    assert found[0].summary == "GPU 0 is unhealthy (reset_required): drain the node, then reset the GPU"
    assert found[1].summary == "GPU 1 is unhealthy (replace): drain the node, then replace the GPU"
    assert found[2].summary == ("GPU 2 is unhealthy (lost): drain the node, then reset the GPU or reboot "
                                "the node")
    assert found[1].values == {"replace": 1.0}


def test_a_mig_gpu_says_its_mig_devices_share_the_fault() -> None:
    devices = tuple(MigReading(index=n, gpu_instance=n + 1, compute_instance=0, uuid=mig_uuid(2, n),
                               profile="3g.40gb") for n in range(2))
    h = history_for()
    feed(h, 2, node(g2={"mig_enabled": True, "mig_devices": devices, "row_remap_pending": True}))
    (condition,) = RowRemapPendingRule.configured().evaluate(h, frozenset()).values()
    assert condition.summary == ("GPU 2 has a memory row remap pending (its 2 MIG devices share it): "
                                 "drain it and reset the GPU")


def nvlink(counts: Callable[[float], dict[str, int]]) -> Callable[[float], dict[str, int]]:
    return lambda t: {**NVLINK_ZERO, **counts(t)}


def test_nvlink_recovery_fires_for_the_window_then_clears() -> None:
    rule = NvlinkErrorsRule.configured()
    errors = nvlink(lambda t: {"recovery": 2 if t >= 100 else 0})
    results = evaluated(rule, 800, node(g2={"nvlink_errors_total": errors}))
    assert firing_ticks(results, 2) == list(range(100, 700))  # in the 10m window after the error
    assert all(set(found) <= {2} for found in results)
    assert results[100][2].summary == "GPU 2 counted NVLink errors in the last 10m: 2 recovery errors"
    assert results[100][2].values == {"recovery": 2.0}


def test_nvlink_crc_errors_fire_only_above_100_a_second_over_the_window() -> None:
    at_limit = nvlink(lambda t: {"crc_flit": int(t) * 100})  # exactly 100/s: 60000 in 10m, not above
    quiet = evaluated(NvlinkErrorsRule.configured(), 700, node(g1={"nvlink_errors_total": at_limit}))
    assert firing_ticks(quiet, 1) == []
    above = nvlink(lambda t: {"crc_data": int(t) * 101})
    results = evaluated(NvlinkErrorsRule.configured(), 700, node(g1={"nvlink_errors_total": above}))
    assert firing_ticks(results, 1) == list(range(595, 700))  # 101 * 595 > 60000
    assert results[-1][1].values == {"crc_data": 60600.0}


def test_errors_from_before_the_agent_started_do_not_fire_and_a_reset_counts_from_its_new_value() -> None:
    rule = NvlinkErrorsRule.configured()
    before = nvlink(lambda t: {"replay": 50})  # counted before the agent's first reading
    assert firing_ticks(evaluated(rule, 30, node(g0={"nvlink_errors_total": before})), 0) == []
    counter = CounterIncreases(600.0)
    assert counter.increase("GPU-a", "x", 50, 0.0) == 0
    assert counter.increase("GPU-a", "x", 2, 10.0) == 2  # the driver reloaded: 2 since
    assert counter.increase("GPU-a", "x", None, 20.0) == 2  # not read this time: as it was
    assert counter.increase("GPU-a", "x", 5, 700.0) == 3  # the reset's 2 left the window
    assert counter.increase("GPU-b", "x", None, 0.0) is None
    counter.keep(["GPU-b"])
    assert counter.increase("GPU-a", "x", 9, 710.0) == 0  # forgotten: a new baseline


def test_pcie_uncorrectable_errors_at_once_replays_above_8_a_minute() -> None:
    rule = PcieErrorsRule.configured()
    fatal = {"fatal": 0, "non_fatal": 0, "correctable": 500}
    results = evaluated(rule, 200, node(
        g1={"pcie_errors_total": lambda t: {**fatal, "non_fatal": 1 if t >= 50 else 0}},
        g2={"pcie_replays_total": int},  # 60 a minute
        g3={"pcie_replays_total": lambda t: 80},  # before the agent: not counted
        g0={"pcie_errors_total": lambda t: {**fatal, "correctable": 500 + int(t)}}))  # correctable: no alert
    assert firing_ticks(results, 1)[:1] == [50]
    assert firing_ticks(results, 2)[:1] == [81]  # 81 replays > 80 in 10m
    assert firing_ticks(results, 0) == firing_ticks(results, 3) == []
    assert results[100][1].summary == "GPU 1 counted PCIe errors in the last 10m: 1 non_fatal error"
    assert results[100][2].summary == "GPU 2 counted PCIe errors in the last 10m: 100 replays"


def test_uncorrectable_ecc_errors_fire_for_the_window() -> None:
    rule = EccUncorrectableRule.configured()
    results = evaluated(rule, 700, node(g3={"ecc_uncorrected_errors_total": lambda t: 3 if t >= 10 else 1}))
    assert firing_ticks(results, 3) == list(range(10, 610))
    assert results[10][3].summary == ("GPU 3 counted 2 uncorrectable ECC errors in the last 10m: check for a "
                                      "row remap pending or failed")
    assert severity_of(rule) == "critical"


def severity_of(rule: Rule[Any]) -> str:
    return rule.severity


def test_no_hardware_rule_fires_on_a_sound_node() -> None:
    for name in HARDWARE_RULES:
        rule = RULE_TYPES[name].configured()
        h = NodeHistory(0.0)
        for t in range(5):
            feed(h, 1, node(), start=float(t))
            assert rule.evaluate(h, frozenset()) == {}, name

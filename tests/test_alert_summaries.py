"""Every rule's summary, firing and held by its hysteresis: true of the numbers it shows.

A rule holds an active alert past its threshold until the value is past it by the hysteresis; in
that band the summary must not say that the value is past the threshold ("84.9% (< 80%)"), but
that the alert holds, and until when. Summaries start with "GPU <n> " (the log line relies on it),
and the numbers they show compare with the thresholds they show as the real values do.
"""

from __future__ import annotations

import random
import re
from typing import Any

import pytest
from test_alert_rules import CAP, NOTEBOOK, POD, dips_every, feed, history_for, node

from gpuscope.alerts.history import NodeHistory
from gpuscope.alerts.rules import RULES
from gpuscope.alerts.rules.base import Rule, bound_text, percent, value_text
from gpuscope.alerts.rules.low_utilization import LowUtilizationRule
from gpuscope.alerts.rules.utilization_skew import UtilizationSkewRule


def summaries(rule: Rule[Any], seconds: int, **per_gpu: Any) -> tuple[str | None, str | None]:
    """The rule's summary for its GPU after ``seconds`` of ``per_gpu``: (alert not active, active).
    A rule that keeps a record of counters of its own (the hardware error counters) is evaluated at
    every tick, as the engine does, and starts from a fresh record."""
    h = history_for(rule)
    if hasattr(rule, "counted_seconds"):
        rule = type(rule).configured()
        for t in range(seconds):
            feed(h, 1, node(**per_gpu), start=float(t))
            rule.evaluate(h, frozenset())
    else:
        feed(h, seconds, node(**per_gpu))
    (gpu,) = [int(k[1:]) for k in per_gpu]
    fresh, active = rule.evaluate(h, frozenset()), rule.evaluate(h, frozenset({gpu}))
    return (fresh[gpu].summary if gpu in fresh else None), (active[gpu].summary if gpu in active else None)


# Each rule at its defaults: (its pattern past the threshold, its pattern in the hysteresis band).
CASES: dict[str, tuple[tuple[Any, ...], tuple[Any, ...]]] = {
    "GpuLowUtilization": (
        (150, {"g1": {"util": 0.62}},
         "GPU 1 runs a job but its mean utilization is 62.0% over 2m (below 80%)"),
        (150, {"g1": {"util": 0.849}},
         "GPU 1 runs a job at 84.9% mean utilization over 2m: no longer below 80%, but the alert holds "
         "until it reaches 85%"),
    ),
    "GpuSharedByProcesses": (
        (1, {"g3": {"procs": ["train-rank3", "dup-worker"]}},
         "GPU 3 is shared by 2 compute processes (dup-worker, train-rank3), more than the 1 allowed"),
        None,  # no hysteresis: an active alert holds on the same condition
    ),
    "GpuFrequentIdleDips": (
        (90, {"g1": {"util": 0.88, "idle_dips_total": dips_every(2)}},
         "GPU 1 dips to idle 30 times a minute (more than 6) at 88.0% mean utilization over 1m: the GPU "
         "waits between steps, for its input, for host work (a synchronisation such as .item(), Python "
         "overhead) or for other ranks; a capture shows which"),
        (90, {"g1": {"util": 0.88, "idle_dips_total": dips_every(10)}},
         "GPU 1 dips to idle 6 times a minute at 88.0% mean utilization over 1m: no longer more than 6, "
         "but the alert holds until it is 5 or fewer"),
    ),
    "GpuUtilizationSkew": (
        (150, {"g2": {"util": 0.6}},
         "GPU 2 lags its peers: 60.0% mean utilization against 95.0% on GPU 0 over 2m, a gap of 35.0 "
         "points (more than 20)"),
        (150, {"g2": {"util": 0.77}},
         "GPU 2 lags its peers: 77.0% mean utilization against 95.0% on GPU 0 over 2m, a gap of 18.0 "
         "points: no longer more than 20, but the alert holds until it is 15 or less"),
    ),
    "GpuBusyButStalled": (
        (70, {"g2": {"util": 0.9, "sm_active_ratio": 0.18}},
         "GPU 2 is 90.0% busy but its SMs are only 18.0% active over 1m (busy: 80% or more, SMs below "
         "30%): kernels wait (host syncs, tiny launches)"),
        (70, {"g2": {"util": 0.78, "sm_active_ratio": 0.32}},
         "GPU 2 is 78.0% busy with its SMs 32.0% active over 1m: no longer at the firing thresholds (80% "
         "busy or more, SMs below 30%), but the alert holds until utilization falls below 75% or SM "
         "activity reaches 35%"),
    ),
    "GpuThrottled": (
        (150, {"g3": {"clock_event_reasons": CAP}},
         "GPU 3 clocks were held down (sw_power_cap) 100% of the last 2m (at least 50%)"),
        (150, {"g3": {"clock_event_reasons": lambda t: CAP if t % 20 < 9 else frozenset()}},
         "GPU 3 clocks were held down (sw_power_cap) 45% of the last 2m: no longer at least 50%, but the "
         "alert holds until it is below 40%"),
    ),
    "GpuXidError": (
        (1, {"g2": {"xid_errors": {48: 1}}},
         "GPU 2 reported Xid 48 (double-bit ECC error) in the last 30s"),
        None,
    ),
    "GpuHeldIdle": (
        (620, {"g1": {"util": 0.012, "processes": NOTEBOOK, "pods": POD}},
         "GPU 1 was busy 1.2% of the last 10m (below 5%) but is held by ipykernel (pid 4242, user alice, "
         "12.0 GiB, on it for 10m); the kubelet allocated it to pod research/notebook-alice (container "
         "notebook)"),
        (620, {"g1": {"util": 0.0999, "processes": NOTEBOOK}},
         "GPU 1 was busy 9.99% of the last 10m and is held by ipykernel (pid 4242, user alice, 12.0 GiB, "
         "on it for 10m): no longer below 5%, but the alert holds until it reaches 10%"),
    ),
    "GpuAllocatedUnused": (
        (620, {"g2": {"util": 0.0, "procs": 0, "pods": POD}},
         "GPU 2 is allocated to pod research/notebook-alice (container notebook), but no process has held a "
         "context on it for 10m"),
        None,  # no hysteresis: whether a process held a context is yes or no
    ),
    # The hardware rules: a state, or a count over the window; no hysteresis.
    "GpuRowRemapPending": (
        (3, {"g1": {"row_remap_pending": True}},
         "GPU 1 has a memory row remap pending: drain it and reset the GPU"), None),
    "GpuRowRemapFailed": (
        (3, {"g3": {"row_remap_failed": True}},
         "GPU 3 could not remap a failing memory row: drain it and replace the GPU"), None),
    "GpuUnhealthy": (
        (3, {"g2": {"row_remap_pending": True}},
         "GPU 2 is unhealthy (reset_required): drain the node, then reset the GPU"), None),
    "GpuNvlinkErrors": (
        (30, {"g2": {"nvlink_errors_total": lambda t: {"crc_flit": 0, "crc_data": 0, "recovery": 0,
                                                      "replay": 1 if t > 10 else 0}}},
         "GPU 2 counted NVLink errors in the last 10m: 1 replay error"), None),
    "GpuPcieErrors": (
        (30, {"g1": {"pcie_errors_total": lambda t: {"fatal": 2 if t > 10 else 0, "non_fatal": 0}}},
         "GPU 1 counted PCIe errors in the last 10m: 2 fatal errors"), None),
    "GpuEccUncorrectable": (
        (30, {"g3": {"ecc_uncorrected_errors_total": lambda t: 1 if t > 10 else 0}},
         "GPU 3 counted 1 uncorrectable ECC error in the last 10m: check for a row remap pending or failed"),
        None),
}
DEFAULT = {rule.name: rule.configured() for rule in RULES}


def test_every_rule_has_its_cases() -> None:
    assert set(CASES) == set(DEFAULT)


@pytest.mark.parametrize("name", sorted(CASES))
def test_firing_summary(name: str) -> None:
    seconds, per_gpu, expected = CASES[name][0]
    fresh, active = summaries(DEFAULT[name], seconds, **per_gpu)
    assert fresh == expected
    assert active == expected  # active and past the threshold: the same words


@pytest.mark.parametrize("name", sorted(CASES))
def test_held_summary(name: str) -> None:
    held = CASES[name][1]
    if held is None:
        assert "hysteresis" not in type(DEFAULT[name]).config_model.model_fields
        return
    seconds, per_gpu, expected = held
    fresh, active = summaries(DEFAULT[name], seconds, **per_gpu)
    assert fresh is None  # in the band: a new alert does not start ...
    assert active == expected  # ... an active one holds, and says so


def test_stalled_held_on_utilization_alone_or_sm_activity_alone() -> None:
    rule = DEFAULT["GpuBusyButStalled"]
    _, active = summaries(rule, 70, g2={"util": 0.9, "sm_active_ratio": 0.33})
    assert active is not None and active.startswith(
        "GPU 2 is 90.0% busy with its SMs 33.0% active over 1m: no longer at the firing thresholds")
    _, active = summaries(rule, 70, g2={"util": 0.77, "sm_active_ratio": 0.1})
    assert active is not None and active.startswith("GPU 2 is 77.0% busy with its SMs 10.0% active")


def test_held_wording_follows_the_configured_thresholds() -> None:
    rule = LowUtilizationRule.configured(threshold=0.7, hysteresis=0.1)
    _, active = summaries(rule, 150, g1={"util": 0.75})
    assert active == ("GPU 1 runs a job at 75.0% mean utilization over 2m: no longer below 70%, but the "
                      "alert holds until it reaches 80%")
    skew = UtilizationSkewRule.configured(max_spread=0.3, hysteresis=0.1)
    _, active = summaries(skew, 150, g2={"util": 0.7})
    assert active is not None and active.endswith(
        "a gap of 25.0 points: no longer more than 30, but the alert holds until it is 20 or less")


def test_the_alert_stops_holding_exactly_at_threshold_plus_hysteresis() -> None:
    """0.8 + 0.05 is 0.8500000000000001 in floats: 85% must still clear, as the summary says."""
    for rule, per_gpu in [(DEFAULT["GpuLowUtilization"], {"g1": {"util": 0.85}}),
                          (DEFAULT["GpuUtilizationSkew"], {"g2": {"util": 0.8}}),  # gap 0.15
                          (DEFAULT["GpuBusyButStalled"], {"g2": {"util": 0.9, "sm_active_ratio": 0.35}})]:
        assert summaries(rule, 150, **per_gpu) == (None, None), rule.name


def test_held_idle_stops_holding_exactly_at_threshold_plus_hysteresis_and_starts_below_it() -> None:
    rule = DEFAULT["GpuHeldIdle"]
    assert summaries(rule, 620, g1={"util": 0.1, "processes": NOTEBOOK}) == (None, None)
    fresh, active = summaries(rule, 620, g1={"util": 0.04996, "processes": NOTEBOOK})
    assert fresh == active and fresh is not None and "busy 4.996% of the last 10m (below 5%)" in fresh
    _, active = summaries(rule, 620, g1={"util": 0.05, "processes": NOTEBOOK})
    assert active is not None and "busy 5.0% of the last 10m and is held by" in active


@pytest.mark.parametrize(("util", "shown"), [
    (0.79996, "GPU 1 runs a job but its mean utilization is 79.996% over 2m (below 80%)"),  # not "80.0%"
    (0.8, "GPU 1 runs a job at 80.0% mean utilization over 2m: no longer below 80%"),
    (0.84996, "GPU 1 runs a job at 84.996% mean utilization over 2m: no longer below 80%"),  # not "85.0%"
])
def test_a_value_next_to_a_threshold_is_shown_with_the_precision_that_tells_them_apart(
        util: float, shown: str) -> None:
    _, active = summaries(DEFAULT["GpuLowUtilization"], 150, g1={"util": util})
    assert active is not None and active.startswith(shown)


def test_every_summary_names_its_gpu_first() -> None:
    for name, (firing, held) in CASES.items():
        for case in (firing, held):
            if case is not None:
                _, per_gpu, expected = case
                gpu = next(iter(per_gpu))[1:]
                assert expected.startswith(f"GPU {gpu} "), name


# ------------------------------------------------------------------------ the number formatting


@pytest.mark.parametrize(("value", "bounds", "kwargs", "shown"), [
    (0.62, (0.8,), {}, "62.0"),
    (0.7996, (0.8,), {}, "79.96"),
    (0.8, (0.8,), {}, "80.0"),
    (0.84996, (0.8, 0.85), {}, "84.996"),
    (0.7999999999, (0.8,), {}, "79.999"),  # below by float noise only: truncated, never "80.0"
    (0.8000000001, (0.8,), {}, "80.001"),
    (30.0, (6.0,), {"scale": 1.0, "decimals": 0}, "30"),
    (6.2, (6.0,), {"scale": 1.0, "decimals": 0}, "6.2"),
    (5.9, (6.0, 5.0), {"scale": 1.0, "decimals": 0}, "5.9"),
    (float("nan"), (0.8,), {}, "nan"),
])
def test_value_text(value: float, bounds: tuple[float, ...], kwargs: dict[str, Any], shown: str) -> None:
    assert value_text(value, *bounds, **kwargs) == shown


def test_bounds_are_shown_without_float_noise() -> None:
    assert bound_text(0.8 + 0.05) == "85" and bound_text(0.2 - 0.05) == "15" and bound_text(0.125) == "12.5"
    assert bound_text(6.0, scale=1.0) == "6" and percent(0.5) == "50.0%"


def test_shown_values_compare_with_shown_bounds_as_the_real_ones_do() -> None:
    rng = random.Random(11)
    for _ in range(5_000):
        bounds = tuple(rng.randrange(1, 100) / 100 for _ in range(rng.choice((1, 2))))
        value = rng.choice(bounds) + rng.choice((-1, 1)) * rng.choice((0.0, 1e-12, 1e-7, 1e-5, 1e-3, 0.02))
        shown = float(value_text(value, *bounds))
        for b in bounds:
            real = (value > b) - (value < b)
            b_shown = float(bound_text(b))
            assert (shown > b_shown) - (shown < b_shown) == real, (value, b, shown)


def test_summaries_on_random_histories_are_true_of_their_numbers() -> None:
    """Low utilization at random means, fresh and active: the first percentage compares with the
    thresholds the way the words say."""
    rule = DEFAULT["GpuLowUtilization"]
    rng = random.Random(5)
    for _ in range(200):
        util = round(rng.uniform(0.75, 0.9), rng.choice((2, 3, 4, 5)))
        h = NodeHistory(120.0)
        feed(h, 130, node(g1={"util": util}))
        for active in (frozenset(), frozenset({1})):
            found = rule.evaluate(h, active)
            if 1 not in found:
                continue
            summary = found[1].summary
            shown = float(re.findall(r"(\d+(?:\.\d+)?)%", summary)[0])
            if "holds" in summary:
                assert 80 <= shown < 85, summary
            else:
                assert shown < 80, summary

"""Each alert rule's evaluate() on hand-built histories: what holds, what does not, and edge cases."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from snapshots import GIB, MIB, make_gpu, make_process, make_snapshot

from gpuscope.alerts.history import NodeHistory
from gpuscope.alerts.rules.allocated_unused import AllocatedUnusedRule
from gpuscope.alerts.rules.busy_but_stalled import BusyButStalledRule
from gpuscope.alerts.rules.frequent_idle_dips import FrequentIdleDipsRule
from gpuscope.alerts.rules.held_idle import HeldIdleRule
from gpuscope.alerts.rules.low_utilization import LowUtilizationRule
from gpuscope.alerts.rules.shared_by_processes import SharedByProcessesRule
from gpuscope.alerts.rules.throttled import ThrottledRule
from gpuscope.alerts.rules.utilization_skew import UtilizationSkewRule
from gpuscope.alerts.rules.xid_error import XidErrorRule
from gpuscope.snapshot import GpuReading, PodContainer

GpuFn = Callable[[int, float], dict[str, Any]]  # (gpu index, time) -> GpuReading overrides


def gpu(index: int, *, util: float | None = 0.95, procs: int | list[str | None] = 1,
        **overrides: Any) -> GpuReading:
    """A GPU reading: ``procs`` compute processes (a count, or their names), utilization ``util``."""
    names = [f"train-rank{index}" if i == 0 else f"extra-{i}" for i in range(procs)] if isinstance(
        procs, int) else procs
    processes = tuple(make_process(10_000 + 100 * index + i, name=n, host_visible=n is not None)
                      for i, n in enumerate(names))
    fields: dict[str, Any] = {"utilization_ratio": util, "processes": processes, "sm_active_ratio": None,
                              "idle_dips_total": 0, "clock_event_reasons": frozenset(), "xid_errors": {}}
    fields.update(overrides)
    return make_gpu(index, **fields)


def feed(history: NodeHistory, seconds: int, gpus: Callable[[float], list[GpuReading]],
         start: float = 0.0, interval: float = 1.0) -> float:
    """One snapshot per interval from ``start`` for ``seconds``; returns the time of the last one."""
    t = start
    for i in range(round(seconds / interval)):
        t = start + i * interval
        history.observe(make_snapshot(gpus=gpus(t), monotonic=t, timestamp=1.7e9 + t,
                                      interval_seconds=interval))
    return t


def node(**per_gpu: Mapping[str, Any]) -> Callable[[float], list[GpuReading]]:
    """Four GPUs, healthy unless ``g<i>={...}`` overrides GPU i (values may be callables of time)."""
    def build(t: float) -> list[GpuReading]:
        out = []
        for i in range(4):
            kw = {k: (v(t) if callable(v) else v) for k, v in per_gpu.get(f"g{i}", {}).items()}
            out.append(gpu(i, **kw))
        return out
    return build


def history_for(*rules: Any) -> NodeHistory:
    """A history sized as the engine sizes it: a per-tick ring for the windows of most rules, marks
    for the windows of those that judge spans (GpuHeldIdle, GpuAllocatedUnused)."""
    return NodeHistory(max((r.window_seconds or 0.0 for r in rules if not r.span_window), default=0.0),
                       [r.window_seconds for r in rules if r.span_window])


# ------------------------------------------------------------------------ GpuLowUtilization

LOW = LowUtilizationRule.configured(window=120.0, threshold=0.80, hysteresis=0.05)


def test_low_utilization_fires_on_the_low_gpu_only() -> None:
    h = history_for(LOW)
    feed(h, 150, node(g2={"util": 0.5}))
    found = LOW.evaluate(h, frozenset())
    assert set(found) == {2}
    assert found[2].values["mean_utilization"] == pytest.approx(0.5)
    assert found[2].values["threshold"] == 0.80
    assert "GPU 2" in found[2].summary and "50.0%" in found[2].summary and "2m" in found[2].summary


def test_low_utilization_needs_a_compute_process() -> None:
    h = history_for(LOW)
    graphics_only = (make_process(1, kind="graphics", name="Xorg"),)
    feed(h, 150, node(g1={"util": 0.0, "procs": 0}, g2={"util": 0.1, "processes": graphics_only}))
    assert LOW.evaluate(h, frozenset()) == {}


def test_low_utilization_waits_for_the_window_to_be_covered() -> None:
    h = history_for(LOW)
    feed(h, 95, node(g1={"util": 0.3}))  # 95 s of a 2 min window: 79 % < 80 %
    assert LOW.evaluate(h, frozenset()) == {}
    feed(h, 1, node(g1={"util": 0.3}), start=95.0)  # 96 s: 80 %
    assert set(LOW.evaluate(h, frozenset())) == {1}


def test_low_utilization_ignores_a_job_that_ran_for_only_part_of_the_window() -> None:
    h = history_for(LOW)
    # The job started 40 s ago: before it the GPU was free. Not "a job running at 33 %".
    feed(h, 150, node(g1={"util": lambda t: 0.9 if t >= 110 else 0.0,
                          "procs": lambda t: 1 if t >= 110 else 0}))
    assert LOW.evaluate(h, frozenset()) == {}


def test_low_utilization_hysteresis_holds_an_active_alert_until_threshold_plus_margin() -> None:
    h = history_for(LOW)
    feed(h, 150, node(g1={"util": 0.82}))
    assert LOW.evaluate(h, frozenset()) == {}  # 0.82 >= 0.80: does not start
    assert set(LOW.evaluate(h, frozenset({1}))) == {1}  # 0.82 < 0.85: an active alert holds
    feed(h, 150, node(g1={"util": 0.86}), start=150.0)
    assert LOW.evaluate(h, frozenset({1})) == {}  # 0.86 >= 0.85: clears


def test_rules_skip_gpus_that_are_down_now() -> None:
    h = history_for(LOW)
    feed(h, 150, node(g1={"util": 0.3}))
    feed(h, 1, lambda t: [gpu(0), make_gpu(1, up=False, utilization_ratio=None, processes=()),
                          gpu(2), gpu(3)], start=150.0)
    assert h.up == frozenset({0, 2, 3}) and h.present == frozenset({0, 1, 2, 3})
    assert LOW.evaluate(h, frozenset({1})) == {}


# ------------------------------------------------------------------------ GpuSharedByProcesses

SHARED = SharedByProcessesRule.configured()


@pytest.mark.parametrize(("names", "fires"), [
    (["train-rank0"], False),
    (["train-rank0", "dup-worker"], True),
    (["train-rank0", None], True),  # a process the host cannot see still holds a context
    (["nvidia-cuda-mps-server", "train-rank0"], False),  # MPS: the server does not count
    (["nvidia-cuda-mps", "train-rank0"], False),  # ... nor its comm name, truncated to 15 chars
    (["nvidia-cuda", "train-rank0"], True),  # a shorter prefix is another name
    (["nvidia-cuda-mps-server", "train-rank0", "train-rank1"], True),
])
def test_shared_counts_compute_processes_outside_the_allow_list(names: list[str | None], fires: bool) -> None:
    h = NodeHistory(0.0)
    feed(h, 1, node(g3={"procs": names}))
    found = SHARED.evaluate(h, frozenset())
    assert set(found) == ({3} if fires else set())
    if fires:
        counted = [n for n in names if n is None or "mps" not in n]
        assert found[3].values["compute_processes"] == len(counted)
        assert "GPU 3 is shared by" in found[3].summary


def test_shared_ignores_graphics_processes_and_honours_max_processes() -> None:
    h = NodeHistory(0.0)
    procs = (make_process(1, name="train"), make_process(2, name="Xorg", kind="graphics"))
    feed(h, 1, node(g0={"processes": procs}, g1={"procs": ["a", "b"]}))
    assert set(SHARED.evaluate(h, frozenset())) == {1}
    assert SharedByProcessesRule.configured(max_processes=2).evaluate(h, frozenset()) == {}
    assert SharedByProcessesRule.configured(allow=["b"]).evaluate(h, frozenset()) == {}


# ------------------------------------------------------------------------ GpuFrequentIdleDips

DIPS = FrequentIdleDipsRule.configured(window=60.0, max_per_minute=6.0, hysteresis=1.0, min_utilization=0.3)


def dips_every(seconds: float) -> Callable[[float], int]:
    return lambda t: int(t // seconds)


def test_idle_dips_fire_above_the_rate_on_a_busy_gpu() -> None:
    h = history_for(DIPS)
    feed(h, 90, node(g1={"util": 0.88, "idle_dips_total": dips_every(2)},  # 30 a minute
                     g2={"util": 0.95, "idle_dips_total": dips_every(12)}))  # 5 a minute: tolerated
    found = DIPS.evaluate(h, frozenset())
    assert set(found) == {1}
    assert found[1].values["dips_per_minute"] == pytest.approx(30, abs=1.5)
    # The dips do not tell what the GPU waits for: the summary names the likely causes, not one.
    summary = found[1].summary
    assert all(cause in summary for cause in ("for its input", "for host work", "for other ranks"))
    assert "the job waits for its input" not in summary


def test_idle_dips_hysteresis() -> None:
    h = history_for(DIPS)
    feed(h, 90, node(g1={"idle_dips_total": lambda t: int(t * 5.5 / 60)}))  # 5.5 a minute
    assert DIPS.evaluate(h, frozenset()) == {}
    assert set(DIPS.evaluate(h, frozenset({1}))) == {1}  # active: holds above 6 - 1
    h = history_for(DIPS)
    feed(h, 90, node(g1={"idle_dips_total": lambda t: int(t * 4.5 / 60)}))
    assert DIPS.evaluate(h, frozenset({1})) == {}


@pytest.mark.parametrize("case", ["idle", "no-counter", "no-process"])
def test_idle_dips_need_a_working_gpu_with_a_counter(case: str) -> None:
    h = history_for(DIPS)
    overrides: dict[str, Any] = {"idle_dips_total": dips_every(1)}
    if case == "idle":
        overrides["util"] = 0.2  # below min_utilization: not "mostly busy"
    elif case == "no-counter":
        overrides["idle_dips_total"] = None  # MIG, no driver samples
    else:
        overrides["procs"] = 0
    feed(h, 90, node(g1=overrides))
    assert DIPS.evaluate(h, frozenset()) == {}


def test_idle_dips_counter_restart_is_not_a_negative_rate() -> None:
    h = history_for(DIPS)
    # The sampler restarted its counter (NVML re-initialised) at 70 s: 1 a second before and after.
    feed(h, 100, node(g1={"idle_dips_total": lambda t: int(t) if t < 70 else int(t - 70)}))
    found = DIPS.evaluate(h, frozenset())
    assert found[1].values["dips_per_minute"] == pytest.approx(59, abs=2)


# ------------------------------------------------------------------------ GpuUtilizationSkew

SKEW = UtilizationSkewRule.configured(window=120.0, max_spread=0.20, hysteresis=0.05)


def test_skew_names_the_laggard_and_the_leader() -> None:
    h = history_for(SKEW)
    feed(h, 150, node(g0={"util": 0.93}, g1={"util": 0.97}, g2={"util": 0.6}, g3={"util": 0.9}))
    found = SKEW.evaluate(h, frozenset())
    assert set(found) == {2}
    c = found[2]
    assert c.labels == {"laggard": "true"}
    assert c.values["leader_gpu"] == 1 and c.values["leader_utilization"] == pytest.approx(0.97)
    assert c.values["gap"] == pytest.approx(0.37) and c.values["spread"] == pytest.approx(0.37)
    assert "GPU 2 lags" in c.summary and "GPU 1" in c.summary


def test_skew_can_name_several_laggards() -> None:
    h = history_for(SKEW)
    feed(h, 150, node(g0={"util": 0.98}, g1={"util": 0.62}, g2={"util": 0.63}, g3={"util": 0.85}))
    assert set(SKEW.evaluate(h, frozenset())) == {1, 2}


def test_skew_compares_only_gpus_running_a_job() -> None:
    h = history_for(SKEW)
    feed(h, 150, node(g0={"util": 0.95}, g1={"util": 0.0, "procs": 0}, g2={"util": 0.0, "procs": 0},
                      g3={"util": 0.0, "procs": 0}))
    assert SKEW.evaluate(h, frozenset()) == {}  # one busy GPU: nothing to compare
    h = history_for(SKEW)
    feed(h, 150, node(g0={"util": 0.95}, g1={"util": 0.9}, g2={"util": 0.0, "procs": 0},
                      g3={"util": 0.0, "procs": 0}))
    assert SKEW.evaluate(h, frozenset()) == {}  # free GPUs are not laggards


def test_skew_hysteresis() -> None:
    h = history_for(SKEW)
    feed(h, 150, node(g2={"util": 0.77}))  # gap 0.18
    assert SKEW.evaluate(h, frozenset()) == {}
    assert set(SKEW.evaluate(h, frozenset({2}))) == {2}  # active: holds above 0.20 - 0.05


# ------------------------------------------------------------------------ GpuBusyButStalled

STALLED = BusyButStalledRule.configured(window=60.0, min_utilization=0.8, max_sm_active=0.3, hysteresis=0.05)


@pytest.mark.parametrize(("util", "sm", "fires"), [
    (0.9, 0.18, True),  # busy, SMs idle: the sync-point signature
    (0.9, 0.75, False),  # busy and working
    (0.5, 0.1, False),  # not busy: another rule's business
    (0.9, None, False),  # no GPM (pre-Hopper, MIG): never
])
def test_busy_but_stalled(util: float, sm: float | None, fires: bool) -> None:
    h = history_for(STALLED)
    feed(h, 70, node(g2={"util": util, "sm_active_ratio": sm}))
    found = STALLED.evaluate(h, frozenset())
    assert set(found) == ({2} if fires else set())
    if fires:
        assert found[2].values["mean_sm_active"] == pytest.approx(sm)
        assert found[2].values["mean_utilization"] == pytest.approx(util)


def test_busy_but_stalled_needs_gpm_over_most_of_the_window() -> None:
    h = history_for(STALLED)
    feed(h, 70, node(g2={"util": 0.9, "sm_active_ratio": lambda t: 0.1 if t >= 40 else None}))
    assert STALLED.evaluate(h, frozenset()) == {}  # GPM for 30 s of 60


def test_busy_but_stalled_hysteresis() -> None:
    h = history_for(STALLED)
    feed(h, 70, node(g2={"util": 0.78, "sm_active_ratio": 0.32}))
    assert STALLED.evaluate(h, frozenset()) == {}
    assert set(STALLED.evaluate(h, frozenset({2}))) == {2}


# ------------------------------------------------------------------------ GpuThrottled

THROTTLED = ThrottledRule.configured(window=120.0, min_fraction=0.5, hysteresis=0.1)
CAP = frozenset({"sw_power_cap"})


@pytest.mark.parametrize(("share", "reasons", "fires"), [
    (1.0, CAP, True),
    (0.6, frozenset({"sw_thermal_slowdown", "gpu_idle"}), True),
    (0.3, CAP, False),  # now and then: not "most of the window"
    (1.0, frozenset({"gpu_idle"}), False),  # idle clocks are not throttling
    (1.0, frozenset({"applications_clocks_setting"}), False),
])
def test_throttled(share: float, reasons: frozenset[str], fires: bool) -> None:
    h = history_for(THROTTLED)
    period = 10
    feed(h, 150, node(g3={"clock_event_reasons": lambda t: reasons if t % period < share * period
                          else frozenset()}))
    found = THROTTLED.evaluate(h, frozenset())
    assert set(found) == ({3} if fires else set())
    if fires:
        assert found[3].values["throttled_fraction"] == pytest.approx(share, abs=0.02)
        assert sorted(reasons - {"gpu_idle"})[0] in found[3].summary


def test_throttled_hysteresis_custom_reasons_and_unknown_reasons() -> None:
    h = history_for(THROTTLED)
    feed(h, 150, node(g3={"clock_event_reasons": lambda t: CAP if t % 20 < 9 else frozenset()},
                      g1={"clock_event_reasons": None}))  # reasons not readable on GPU 1
    assert THROTTLED.evaluate(h, frozenset()) == {}  # 45 %
    assert set(THROTTLED.evaluate(h, frozenset({1, 3}))) == {3}  # active: holds above 40 %
    thermal_only = ThrottledRule.configured(window=120.0, reasons=["hw_thermal_slowdown"])
    assert thermal_only.evaluate(h, frozenset({3})) == {}


# ------------------------------------------------------------------------ GpuXidError

XID = XidErrorRule.configured(window=30.0, benign=[13, 31, 43, 45])


def test_xid_fires_at_once_on_a_new_non_benign_xid() -> None:
    h = history_for(XID)
    feed(h, 10, node())
    assert XID.evaluate(h, frozenset()) == {}
    feed(h, 1, node(g2={"xid_errors": {48: 1}}), start=10.0)  # the agent's 11th second: no coverage needed
    found = XID.evaluate(h, frozenset())
    assert set(found) == {2}
    assert found[2].values == {"xid_48": 1.0}
    assert "Xid 48 (double-bit ECC error)" in found[2].summary


def test_xid_ignores_benign_codes_and_old_events() -> None:
    h = history_for(XID)
    feed(h, 5, node())
    feed(h, 40, node(g1={"xid_errors": {13: 2, 43: 1}}, g2={"xid_errors": {79: 1}}), start=5.0)
    # GPU 1: benign only. GPU 2: its Xid 79 happened 40 s ago, before the 30 s window.
    assert XID.evaluate(h, frozenset()) == {}
    feed(h, 1, node(g1={"xid_errors": {13: 3, 94: 1}}, g2={"xid_errors": {79: 1}}), start=45.0)
    assert set(XID.evaluate(h, frozenset())) == {1}


def test_xid_is_evaluated_on_a_gpu_that_went_down_with_it() -> None:
    h = history_for(XID)
    feed(h, 10, node())
    feed(h, 1, lambda t: [gpu(0), make_gpu(1, up=False, utilization_ratio=None, processes=(),
                                           xid_errors={79: 1}), gpu(2), gpu(3)], start=10.0)
    assert XidErrorRule.include_down and set(XID.evaluate(h, frozenset())) == {1}


def test_xid_count_restart() -> None:
    h = history_for(XID)
    feed(h, 10, node(g0={"xid_errors": {48: 3}}))
    feed(h, 1, node(g0={"xid_errors": {48: 1}}), start=10.0)  # the watcher restarted: 1 new one
    assert XID.evaluate(h, frozenset())[0].values == {"xid_48": 1.0}


# ------------------------------------------------------------------------ GpuHeldIdle

HELD = HeldIdleRule.configured(window=60.0, threshold=0.05, hysteresis=0.05, min_memory=GIB)
NOTEBOOK = (make_process(4242, name="ipykernel", memory_used_bytes=12 * GIB),)
POD = (PodContainer("research", "notebook-alice", "notebook"),)


def test_held_idle_fires_on_an_idle_gpu_a_process_holds() -> None:
    h = history_for(HELD)
    feed(h, 70, node(g1={"util": 0.01, "processes": NOTEBOOK, "pods": POD},
                     g2={"util": 0.0, "procs": 0}))  # free: not held
    found = HELD.evaluate(h, frozenset())
    assert set(found) == {1}
    c = found[1]
    assert c.values == {"mean_utilization": pytest.approx(0.01), "threshold": 0.05,
                        "memory_held_bytes": 12 * GIB, "holding_processes": 1.0}
    assert c.summary == ("GPU 1 was busy 1.0% of the last 1m (below 5%) but is held by ipykernel (pid 4242, "
                         "user alice, 12.0 GiB, on it for 1m); the kubelet allocated it to pod "
                         "research/notebook-alice (container notebook)")


def test_held_idle_needs_min_memory_and_counts_compute_processes_only() -> None:
    h = history_for(HELD)
    small = (make_process(1, name="probe", memory_used_bytes=512 * MIB),)
    unknown = (make_process(2, name="mig-tenant", memory_used_bytes=None),)  # NVML did not say
    graphics = (make_process(3, name="Xorg", kind="graphics", memory_used_bytes=4 * GIB),)
    feed(h, 70, node(g0={"util": 0.0, "processes": small}, g1={"util": 0.0, "processes": unknown},
                     g2={"util": 0.0, "processes": graphics}))
    assert HELD.evaluate(h, frozenset()) == {}
    assert set(HeldIdleRule.configured(window=60.0, min_memory="256MiB").evaluate(h, frozenset())) == {0}


def test_held_idle_needs_the_process_on_the_gpu_for_the_whole_window() -> None:
    h = history_for(HELD)
    # The GPU idled free for a while; the process arrived 30 s ago, then another pid replaced it.
    feed(h, 70, node(g1={"util": 0.0, "processes": lambda t: NOTEBOOK if t >= 40 else ()}))
    assert HELD.evaluate(h, frozenset()) == {}
    feed(h, 40, node(g1={"util": 0.0, "processes": NOTEBOOK}), start=70.0)  # on it since 40 s: 69 s now
    assert set(HELD.evaluate(h, frozenset())) == {1}
    other = (make_process(4343, name="ipykernel", memory_used_bytes=12 * GIB),)
    feed(h, 10, node(g1={"util": 0.0, "processes": other}), start=110.0)
    assert HELD.evaluate(h, frozenset()) == {}  # a new process: 10 s on the GPU


def test_held_idle_hysteresis_and_a_busy_gpu() -> None:
    h = history_for(HELD)
    feed(h, 70, node(g1={"util": 0.07, "processes": NOTEBOOK}, g2={"util": 0.5, "processes": NOTEBOOK}))
    assert HELD.evaluate(h, frozenset()) == {}  # 7 % >= 5 %: does not start; 50 %: working
    assert set(HELD.evaluate(h, frozenset({1, 2}))) == {1}  # 7 % < 10 %: an active alert holds
    h = history_for(HELD)
    feed(h, 70, node(g1={"util": 0.1, "processes": NOTEBOOK}))
    assert HELD.evaluate(h, frozenset({1})) == {}  # 10 %: clears


def test_held_idle_judges_the_mean_of_the_window_not_the_last_tick() -> None:
    h = history_for(HELD)
    # Idle but for a 6-second burst at full speed in the last minute: 10 % over it.
    feed(h, 130, node(g1={"util": lambda t: 1.0 if 100 <= t < 106 else 0.0, "processes": NOTEBOOK}))
    assert HELD.evaluate(h, frozenset()) == {}
    feed(h, 60, node(g1={"util": 0.0, "processes": NOTEBOOK}), start=130.0)
    assert set(HELD.evaluate(h, frozenset())) == {1}  # the burst has left the window


def test_held_idle_needs_utilization_for_most_of_the_window() -> None:
    h = history_for(HELD)
    feed(h, 70, node(g1={"util": None, "processes": NOTEBOOK},  # MIG: no utilization
                     g2={"util": lambda t: 0.0 if t >= 40 else None, "processes": NOTEBOOK}))
    assert HELD.evaluate(h, frozenset()) == {}


def test_held_idle_names_several_holders_and_those_the_host_cannot_see() -> None:
    h = history_for(HELD)
    holders = (make_process(11, name="python3", memory_used_bytes=2 * GIB, user=None),
               make_process(12, name=None, host_visible=False, user=None, memory_used_bytes=8 * GIB),
               make_process(13, memory_used_bytes=3 * GIB), make_process(14, memory_used_bytes=3 * GIB),
               make_process(15, memory_used_bytes=GIB))
    feed(h, 70, node(g3={"util": 0.0, "processes": holders}))
    c = HELD.evaluate(h, frozenset())[3]
    assert c.values["memory_held_bytes"] == 17 * GIB and c.values["holding_processes"] == 5
    assert c.summary == (
        "GPU 3 was busy 0.0% of the last 1m (below 5%) but is held by a process the host cannot see "
        "(pid 12, 8.0 GiB, on it for 1m), python3 (pid 13, user alice, 3.0 GiB, on it for 1m), python3 "
        "(pid 14, user alice, 3.0 GiB, on it for 1m) and 2 more processes")


def test_held_idle_keeps_its_holders_through_a_tick_whose_process_list_failed() -> None:
    h = history_for(HELD)
    feed(h, 50, node(g1={"util": 0.0, "processes": NOTEBOOK}))
    # NVML's process listing failed at 50 s (sample_errors grew): the list read empty, unknown.
    h.observe(make_snapshot(gpus=node(g1={"util": 0.0, "procs": 0})(50.0), monotonic=50.0,
                            sample_errors={"processes": 1}))
    feed(h, 20, node(g1={"util": 0.0, "processes": NOTEBOOK}), start=51.0)
    occupancy = h.occupancy(1)
    assert occupancy is not None and occupancy.held_since == {4242: 0.0}
    assert set(HELD.evaluate(h, frozenset())) == {1}


# ------------------------------------------------------------------------ GpuAllocatedUnused

UNUSED = AllocatedUnusedRule.configured(window=60.0)
TIME_SLICED = (PodContainer("research", "a", "main"), PodContainer("research", "a", "sidecar"),
               PodContainer("team-b", "b", "main"))


def test_allocated_unused_fires_on_a_pod_gpu_without_a_process() -> None:
    h = history_for(UNUSED)
    feed(h, 70, node(g0={"pods": POD},  # allocated and used
                     g1={"util": 0.0, "procs": 0},  # free
                     g2={"util": 0.0, "procs": 0, "pods": POD},
                     g3={"util": 0.0, "procs": 0, "pods": TIME_SLICED}))
    found = UNUSED.evaluate(h, frozenset())
    assert set(found) == {2, 3}
    assert found[2].values == {"unused_seconds": 69.0, "pods": 1.0}
    assert found[2].summary == ("GPU 2 is allocated to pod research/notebook-alice (container notebook), but "
                                "no process has held a context on it for 1m")
    assert found[3].values["pods"] == 3.0
    assert found[3].summary.startswith("GPU 3 is allocated to pods research/a (containers main, sidecar) and "
                                       "team-b/b (container main), but no process")


def test_allocated_unused_any_context_in_the_window_counts_graphics_too() -> None:
    h = history_for(UNUSED)
    brief = (make_process(7, name="cuda-check", memory_used_bytes=500 * MIB),)
    graphics = (make_process(8, name="Xorg", kind="graphics", memory_used_bytes=64 * MIB),)
    feed(h, 70, node(g1={"util": 0.0, "pods": POD, "processes": lambda t: brief if t == 30 else ()},
                     g2={"util": 0.0, "pods": POD, "processes": graphics}))
    assert UNUSED.evaluate(h, frozenset()) == {}
    feed(h, 30, node(g1={"util": 0.0, "procs": 0, "pods": POD}), start=70.0)  # 69 s since the last one
    found = UNUSED.evaluate(h, frozenset())
    assert set(found) == {1} and found[1].values["unused_seconds"] == 69.0


def test_allocated_unused_waits_a_whole_window_for_each_pod() -> None:
    h = history_for(UNUSED)
    first, second = PodContainer("research", "a", "main"), PodContainer("research", "b", "main")
    feed(h, 70, node(g1={"util": 0.0, "procs": 0, "pods": lambda t: (first, second) if t >= 40 else (first,)},
                     g2={"util": 0.0, "procs": 0, "pods": lambda t: (second,) if t >= 40 else (first,)}))
    found = UNUSED.evaluate(h, frozenset())
    assert set(found) == {1}  # GPU 2's pod has had it for 30 s only
    assert "pod research/a (container main)," in found[1].summary and "research/b" not in found[1].summary


def test_allocated_unused_counts_an_unknown_process_list_as_a_possible_context() -> None:
    h = history_for(UNUSED)
    idle = node(g1={"util": 0.0, "procs": 0, "pods": POD})
    feed(h, 30, idle)
    h.observe(make_snapshot(gpus=idle(30.0), monotonic=30.0, sample_errors={"graphics_processes": 2}))
    feed(h, 40, idle, start=31.0)
    assert UNUSED.evaluate(h, frozenset()) == {}  # the failed listing at 30 s is within the window
    feed(h, 1, lambda t: [gpu(0), make_gpu(1, up=False, utilization_ratio=None, processes=(), pods=POD),
                          gpu(2), gpu(3)], start=71.0)  # down: not judged, and not "no process"
    feed(h, 59, idle, start=72.0)
    assert UNUSED.evaluate(h, frozenset()) == {}  # 130 s: the down tick at 71 s is within (70, 130]
    feed(h, 1, idle, start=131.0)
    assert set(UNUSED.evaluate(h, frozenset())) == {1}


# ------------------------------------------------------------------------ the history itself


def test_window_totals_match_a_recount_after_the_ring_wrapped() -> None:
    """The running sums give the same means and counts as recounting the window's points."""
    rng = random.Random(7)
    h = NodeHistory(60.0)
    reasons = [frozenset(), frozenset({"sw_power_cap"}), None, frozenset({"gpu_idle", "hw_slowdown"})]

    def reading(t: float) -> list[GpuReading]:
        up = rng.random() > 0.05
        if not up:
            return [make_gpu(0, up=False, utilization_ratio=None, processes=(), idle_dips_total=None,
                             sm_active_ratio=None, clock_event_reasons=None)]
        return [gpu(0, util=rng.choice([None, rng.random()]), procs=rng.choice([0, 1, 2]),
                    sm_active_ratio=rng.choice([None, rng.random()]),
                    idle_dips_total=int(t // 3) if rng.random() > 0.1 else None,
                    clock_event_reasons=rng.choice(reasons))]

    feed(h, 500, reading)
    assert len(h._gpus[0].points) == h.maxlen(1.0) < 500  # bounded
    watched = frozenset({"sw_power_cap", "hw_slowdown"})
    for seconds in (1.0, 7.0, 30.0, 60.0):
        w = h.window(0, seconds)
        assert w is not None
        pts = list(w.points)
        assert len(pts) == w.n == seconds and pts[-1].t == 499 and pts[0].t == 500 - seconds
        busy = [p.utilization for p in pts if p.compute_processes and p.utilization is not None]
        fraction, mean = w.busy_utilization()
        assert fraction == pytest.approx(len(busy) / len(pts))
        assert mean == (pytest.approx(sum(busy) / len(busy)) if busy else None)
        sm = [(p.utilization, p.sm_active) for p in pts
              if p.sm_active is not None and p.utilization is not None]
        fraction, util, active = w.sm_activity()
        assert fraction == pytest.approx(len(sm) / len(pts))
        assert util == (pytest.approx(sum(u for u, _ in sm) / len(sm)) if sm else None)
        assert active == (pytest.approx(sum(a for _, a in sm) / len(sm)) if sm else None)
        known = [p.clock_event_reasons for p in pts if p.clock_event_reasons is not None]
        assert w.clock_events(watched) == (len(known), sum(1 for r in known if r & watched))
        assert w.baseline is not None and w.baseline.t == 499 - seconds
        # Dips: the counter's growth from its last reading before the window to its last in it.
        before = [p.idle_dips_total for p in h._gpus[0].points
                  if p.t <= w.baseline.t and p.idle_dips_total is not None]
        inside = [p.idle_dips_total for p in pts if p.idle_dips_total is not None]
        counted = w.idle_dips()
        if before and inside:
            assert counted is not None and counted[0] == inside[-1] - before[-1]


def test_spans_match_a_recount_from_their_mark() -> None:
    """A span's totals equal a recount of the points after its mark, which lies at most one mark
    step before the window's start; early on it starts at the first point once 80 % is covered."""
    rng = random.Random(3)
    h = NodeHistory(0.0, [60.0, 600.0])
    assert h.mark_step(1.0) == 1.0 and h.mark_step(0.5) == 1.0 and h.mark_step(5.0) == 5.0
    kept: list[tuple[float, float | None]] = []

    def reading(t: float) -> list[GpuReading]:
        util = rng.choice([None, rng.random()])
        kept.append((t, util))
        return [gpu(0, util=util)]

    feed(h, 40, reading)
    assert h.span(0, 60.0) is None  # 40 s of 60
    feed(h, 10, reading, start=40.0)
    span = h.span(0, 60.0)
    assert span is not None and span.n == 50  # 50 s of 60: from the first point
    feed(h, 1000, reading, start=50.0)
    assert len(h._gpus[0].marks) == h.marks(1.0) == 605
    for seconds in (60.0, 600.0):
        span = h.span(0, seconds)
        assert span is not None
        inside = [u for t, u in kept if t > 1049 - seconds]  # (now - seconds, now]: a mark every second
        assert span.n == len(inside) == seconds
        fraction, mean = span.utilization()
        known = [u for u in inside if u is not None]
        assert fraction == pytest.approx(len(known) / len(inside))
        assert mean == pytest.approx(sum(known) / len(known))
    assert h.span(0, 700.0) is None  # longer than the marks kept
    coarse = NodeHistory(0.0, [600.0])  # a mark every 10 s
    feed(coarse, 1000, lambda t: [gpu(0, util=0.5 if t % 2 else 0.0)])
    span = coarse.span(0, 600.0)
    assert span is not None and 600 <= span.n < 610
    assert span.utilization() == (1.0, pytest.approx(0.25, abs=0.01))


def test_history_coverage_and_a_replaced_gpu() -> None:
    h = NodeHistory(120.0)
    feed(h, 10, node())
    assert h.window(0, 120.0) is None  # 10 s of 120
    assert h.window(0, 12.0) is not None  # 10 s of 12: 83 %
    assert h.window(0, 120.0, min_coverage=0.0) is not None
    assert h.window(7, 12.0) is None  # no such GPU
    # Another GPU at index 0 (a different UUID): its history starts over.
    feed(h, 1, lambda t: [make_gpu(0, uuid="GPU-other")], start=10.0)
    assert h.uuid(0) == "GPU-other" and h.window(0, 12.0) is None

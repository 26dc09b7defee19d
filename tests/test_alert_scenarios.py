"""Scenarios prove the rules: the real sampler over the simulator feeds the engine, on simulated time.

For each rule a bundled ``alert-*`` scenario shows its pattern on one GPU (not GPU 0) from the
start, the other GPUs healthy. The alert must fire on that GPU, and nowhere else, within ``for`` +
2 ticks of the condition being *established*: the moment the pattern has filled the rule's window
(``window`` seconds after it began; for GpuXidError, the Xid itself; for GpuSharedByProcesses,
which reads only the latest tick, the start). And on the ``healthy`` scenario nothing at all
happens (not even a pending alert) in 10 minutes.

The rules that watch for a GPU held or allocated while idle (``GpuHeldIdle``,
``GpuAllocatedUnused``) judge 10-minute windows and wait 5 more: on every other bundled scenario,
with their windows shortened to a minute by configuration, they do not even go pending in 10
minutes.

Simulated time runs on a manual clock, 1 s per tick, as fast as the sampler goes (about 2 ms a
tick): 10 simulated minutes take about a second. Where a scenario allocates GPUs to pods, its
simulated kubelet is asked once, as the agent would at start.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from gpuscope.alerts.engine import AlertEngine
from gpuscope.alerts.model import Transition
from gpuscope.alerts.rules import HARDWARE_RULES, RulesConfig, build_rules
from gpuscope.capture.config import CaptureConfig
from gpuscope.host.pods import PodAttribution
from gpuscope.host.processes import ProcessInspector
from gpuscope.nvml.boundary import Nvml
from gpuscope.sampling.sampler import Sampler
from gpuscope.simulate import Simulation, bundled_scenarios, load_scenario

DEFAULTS = RulesConfig()
RULES = {r.name: r for r in build_rules(DEFAULTS)}


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Run:
    """A scenario sampled tick by tick into an engine with the default rules (or ``rules``)."""

    name: str
    rules: RulesConfig = DEFAULTS
    clock: ManualClock = field(default_factory=ManualClock)
    transitions: list[tuple[float, Transition]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.scenario = load_scenario(self.name)
        self.simulation = Simulation(self.scenario, clock=self.clock)
        self.engine = AlertEngine(build_rules(self.rules), hostname="sim-node")
        self.engine.add_listener(lambda t: self.transitions.append((self.clock.now, t)))
        self.xid_times = sorted(x.at for g in self.scenario.gpus for x in g.xid)
        self.pods: PodAttribution | None = None

    def __enter__(self) -> Run:
        self.simulation.install()
        socket = self.simulation.kubelet_socket
        if socket is not None:  # the scenario's pods never change: one answer, as at the agent's start
            self.pods = PodAttribution(socket, refresh_interval=3600.0, timeout=5.0, keep_for=3600.0,
                                       clock=self.clock)
            self.pods.refresh()
        self.sampler = Sampler(Nvml(clock=self.clock), ProcessInspector(host_pid_namespace=True),
                               clock=self.clock, wall_clock=lambda: 1.7e9 + self.clock.now,
                               hostname="sim-node", pods=self.pods.pods_for if self.pods else None)
        self.sampler.add_listener(self.engine.on_snapshot)  # as the agent wires it
        return self

    def __exit__(self, *exc: object) -> None:
        self.sampler.stop()
        if self.pods is not None:
            self.pods.stop()
        self.simulation.uninstall()

    def until(self, end: float) -> None:
        """Tick once a simulated second up to ``end`` (inclusive)."""
        while self.clock.now <= end:
            if any(self.clock.now - 1 < at <= self.clock.now for at in self.xid_times):
                # Xids arrive on the watcher thread, which polls the simulated clock every 20 ms of
                # wall time: give it the moment a real 1 s tick would.
                time.sleep(0.15)
            self.sampler.tick()
            self.clock.now += 1.0

    def fired(self) -> dict[tuple[str, int], float]:
        """(rule, GPU) -> simulated time of its first transition to firing."""
        out: dict[tuple[str, int], float] = {}
        for at, t in self.transitions:
            if t.state == "firing":
                out.setdefault((t.name, t.gpu), at)
        return out

    def touched(self) -> set[tuple[str, int]]:
        """Every (rule, GPU) that had any transition (pending included)."""
        return {(t.name, t.gpu) for _, t in self.transitions}


@dataclass(frozen=True)
class Case:
    scenario: str
    rule: str
    gpu: int
    established: float  # simulated seconds: when the condition is fully in the window
    also: frozenset[tuple[str, int]] = frozenset()  # other alerts that must fire (and only those)


def window(rule: str) -> float:
    seconds = RULES[rule].window_seconds
    assert seconds is not None
    return seconds


CASES = [
    Case("alert-low-utilization", "GpuLowUtilization", 1, window("GpuLowUtilization")),
    Case("alert-shared", "GpuSharedByProcesses", 2, 0.0),
    Case("alert-idle-dips", "GpuFrequentIdleDips", 1, window("GpuFrequentIdleDips")),
    # A laggard 35 points below busy peers is below 80 % too: both alerts, both on GPU 2.
    Case("alert-skew", "GpuUtilizationSkew", 2, window("GpuUtilizationSkew"),
         frozenset({("GpuLowUtilization", 2)})),
    Case("alert-stalled", "GpuBusyButStalled", 2, window("GpuBusyButStalled")),
    Case("alert-throttled", "GpuThrottled", 3, window("GpuThrottled")),
    Case("alert-xid", "GpuXidError", 2, 60.0),  # the scenario's Xid 48 at 60 s
    # A GPU held by an idle process is also a job below 80 % to GpuLowUtilization.
    Case("alert-held-idle", "GpuHeldIdle", 1, window("GpuHeldIdle"), frozenset({("GpuLowUtilization", 1)})),
    Case("alert-allocated-unused", "GpuAllocatedUnused", 2, window("GpuAllocatedUnused")),
    # GPU 3's row remap pending, GPU 7's failed: read from the start, each GPU unhealthy too.
    Case("alert-row-remap", "GpuRowRemapPending", 3, 0.0,
         frozenset({("GpuUnhealthy", 3), ("GpuRowRemapFailed", 7), ("GpuUnhealthy", 7)})),
    # The errors at 55 s, seen at the next health read (nvml.health_interval, 10 s).
    Case("alert-hardware-errors", "GpuNvlinkErrors", 1, 65.0,
         frozenset({("GpuPcieErrors", 2), ("GpuEccUncorrectable", 3)})),
]
IDLE_RULES = ("GpuHeldIdle", "GpuAllocatedUnused")


@pytest.mark.parametrize("case", CASES, ids=[c.rule for c in CASES])
def test_each_rule_fires_on_its_scenario_at_the_right_gpu_in_time(case: Case) -> None:
    rule = RULES[case.rule]
    deadline = case.established + rule.for_seconds + 2  # ticks are 1 s apart
    with Run(case.scenario) as r:
        r.until(deadline + 30)  # and a while after, to catch anything spurious
    fired = r.fired()
    assert (case.rule, case.gpu) in fired, f"{case.rule} never fired on GPU {case.gpu}: {fired}"
    assert fired[case.rule, case.gpu] <= deadline, (
        f"{case.rule} fired on GPU {case.gpu} at {fired[case.rule, case.gpu]:g} s, after {deadline:g} s")
    expected = {(case.rule, case.gpu)} | case.also
    assert set(fired) == expected
    assert r.touched() == expected  # nothing else even went pending
    alert = next(a for a in r.engine.alerts() if (a.name, a.gpu) == (case.rule, case.gpu))
    assert alert.state == "firing" and alert.hostname == "sim-node" and alert.uuid.startswith("GPU-")
    assert alert.severity == rule.severity and f"GPU {case.gpu}" in alert.summary


def test_skew_names_the_leader_and_the_mps_server_does_not_share_a_gpu() -> None:
    with Run("alert-skew") as r:
        r.until(window("GpuUtilizationSkew") + 5)
    (skew,) = [a for a in r.engine.alerts() if a.name == "GpuUtilizationSkew"]
    assert skew.labels == {"laggard": "true"}
    assert skew.values["leader_gpu"] in (0, 1, 3) and skew.values["gap"] > 0.3
    with Run("alert-shared") as r:
        r.until(35)
        gpu1 = r.sampler.latest().gpus[1]  # type: ignore[union-attr]
    assert sorted(p.name or "" for p in gpu1.compute_processes) == ["nvidia-cuda-mps", "train-rank1"]
    assert [a.gpu for a in r.engine.alerts()] == [2]


def test_xid_alert_resolves_after_window_plus_clear_for() -> None:
    rule = RULES["GpuXidError"]
    assert rule.window_seconds is not None
    with Run("alert-xid") as r:
        r.until(60 + rule.window_seconds + rule.clear_for_seconds + 2)
    states = [(at, t.state) for at, t in r.transitions]
    assert states == [(60.0, "firing"), (60 + rule.window_seconds + rule.clear_for_seconds, "resolved")]
    assert r.engine.transition_counts() == {("GpuXidError", "firing"): 1, ("GpuXidError", "resolved"): 1}


def test_hardware_error_alerts_resolve_once_the_errors_leave_their_window() -> None:
    with Run("alert-hardware-errors") as r:
        r.until(55 + 600 + 15)
    ends = {(t.name, t.gpu): at for at, t in r.transitions if t.state == "resolved"}
    assert set(ends) == {("GpuNvlinkErrors", 1), ("GpuPcieErrors", 2), ("GpuEccUncorrectable", 3)}
    fired = r.fired()
    for key, end in ends.items():  # up for the 10m window after the errors were read
        assert end - fired[key] == pytest.approx(600.0, abs=1.0), (key, fired[key], end)
    nvlink = next(t for _, t in r.transitions if t.name == "GpuNvlinkErrors")
    assert nvlink.values == {"recovery": 2.0}
    assert nvlink.summary == "GPU 1 counted NVLink errors in the last 10m: 2 recovery errors"


def test_healthy_node_raises_nothing_in_ten_minutes() -> None:
    started = time.monotonic()
    with Run("healthy") as r:
        r.until(600)
    assert r.transitions == []
    assert r.engine.alerts() == [] and r.engine.transition_counts() == {}
    assert r.clock.now > 600
    assert time.monotonic() - started < 30  # simulated time runs far faster than wall time


def test_the_demo_node_shows_every_rule() -> None:
    """The README's demo scenario is meant to show every pattern of a GPU at work: each rule fires
    on it but those of a GPU held or allocated while idle (every demo GPU works) and those of a GPU's
    hardware (every demo GPU is sound)."""
    with Run("demo") as run:
        run.until(450.0)  # a 5-minute loop and a half: the lagging phase's window fills after 5m
    fired = {rule for rule, _gpu in run.fired()}
    expected = set(RULES) - set(IDLE_RULES) - set(HARDWARE_RULES)
    assert fired == expected, sorted(expected ^ fired)
    where: dict[str, set[int]] = {}
    for rule, gpu in run.fired():
        where.setdefault(rule, set()).add(gpu)
    assert where["GpuSharedByProcesses"] == {2} and where["GpuBusyButStalled"] == {3}
    assert where["GpuThrottled"] == {0} and where["GpuXidError"] == {3}
    assert where["GpuFrequentIdleDips"] == {1}


def test_the_demo_stall_alert_fires_with_time_left_in_the_stall_for_its_capture() -> None:
    """GpuBusyButStalled captures by default: its capture must see the stall it fired on, so the demo's
    stall outlasts the rule's window and `for` by at least a capture and the time its backend may take."""
    (stall_start, stall_end) = demo_stall()
    capture = CaptureConfig()
    with Run("demo") as run:
        run.until(stall_end)
    fired = run.fired().get(("GpuBusyButStalled", 3))
    assert fired is not None, "GpuBusyButStalled never fired during GPU 3's stall"
    assert stall_start < fired
    left = stall_end - fired
    assert left >= capture.duration + capture.deadline_margin, (
        f"fired at {fired:g} s, {left:g} s before the stall ends at {stall_end:g} s: too late for a "
        f"{capture.duration:g} s capture")


def demo_stall() -> tuple[float, float]:
    """When GPU 3 of the demo is busy but stalled: its phase of low GPM SM activity, to the next phase."""
    phases = load_scenario("demo").gpus[3].phases
    stalled = RULES["GpuBusyButStalled"].config.max_sm_active  # type: ignore[attr-defined]
    for k, phase in enumerate(phases):
        if phase.gpm is not None and phase.gpm.sm_active < stalled:
            return phase.from_, phases[k + 1].from_
    raise AssertionError("the demo's GPU 3 has no busy-but-stalled phase")


# ------------------------------------------------------------------------ a GPU held or allocated while idle

# Their windows and `for` shortened by configuration, so that 10 simulated minutes are ten windows.
SHORT = RulesConfig.model_validate({name: {"window": "1m", "for": "10s"} for name in IDLE_RULES})
# The mig scenario holds one MIG device idle on purpose (test_the_mig_node_alerts_on_its_mig_devices).
WORKING = sorted(set(bundled_scenarios()) - {c.scenario for c in CASES if c.rule in IDLE_RULES} - {"mig"})


@pytest.mark.parametrize("scenario", WORKING)
def test_held_and_allocated_idle_stay_quiet_on_every_other_scenario(scenario: str) -> None:
    with Run(scenario, SHORT) as r:
        r.until(600)
    assert not [(at, t.name, t.gpu, t.state) for at, t in r.transitions if t.name in IDLE_RULES]


def test_held_idle_fires_with_a_short_window_and_names_the_notebook_and_its_pod() -> None:
    """The pattern with a 1-minute window: fired at window + `for`, on GPU 1 only."""
    with Run("alert-held-idle", SHORT) as r:
        r.until(100)
    fired = {key: at for key, at in r.fired().items() if key[0] in IDLE_RULES}
    assert fired == {("GpuHeldIdle", 1): pytest.approx(70, abs=2)}
    (alert,) = [a for a in r.engine.alerts() if a.name == "GpuHeldIdle"]
    assert alert.state == "firing" and alert.gpu == 1
    assert alert.values["memory_held_bytes"] == 12 * 2**30 and alert.values["mean_utilization"] < 0.05
    summary = alert.summary
    assert summary.startswith("GPU 1 was busy ")
    assert "of the last 1m (below 5%) but is held by ipykernel (pid " in summary
    assert ", 12.0 GiB, on it for 1m)" in summary
    assert summary.endswith("; the kubelet allocated it to pod research/notebook-alice (container notebook)")


def test_the_mig_node_alerts_on_its_mig_devices() -> None:
    """The mig scenario's GPU 0 has no utilization of its own: its MIG devices are judged. The 1g.10gb
    one is held idle by its notebook pod; the 2g.20gb one works at 40 %; the 3g.40gb one at 85 %. Each
    device has its process: none is allocated unused, and none is shared."""
    with Run("mig", SHORT) as r:
        r.until(200)
    alerts = {(a.name, a.labels.get("mig_profile")): a for a in r.engine.alerts()}
    assert set(alerts) == {("GpuHeldIdle", "1g.10gb"), ("GpuLowUtilization", "1g.10gb"),
                           ("GpuLowUtilization", "2g.20gb")}
    held = alerts["GpuHeldIdle", "1g.10gb"]
    assert (held.gpu, held.state, held.labels["gpu_instance"], held.labels["compute_instance"]) == (
        0, "firing", "3", "0")
    assert held.labels["mig_uuid"].startswith("MIG-") and held.uuid.startswith("GPU-")
    assert held.summary.startswith("GPU 0 MIG instance 1g.10gb (GPU instance 3, compute instance 0) was busy "
                                   "0.0% of the last 1m (below 5%) but is held by notebook (pid ")
    assert held.summary.endswith(", 4.0 GiB of its memory in use; the kubelet allocated it to pod "
                                 "research/notebook-alice (container jupyter)")
    assert alerts["GpuLowUtilization", "2g.20gb"].values["mean_utilization"] == pytest.approx(0.4, abs=0.05)
    assert {t.gpu for _, t in r.transitions} == {0}


def test_allocated_unused_names_the_pod_and_a_late_start_is_not_unused() -> None:
    """At the default window (10m): GPU 1's pod starts its process at 3m, well within it."""
    sooner = RulesConfig.model_validate({"GpuAllocatedUnused": {"for": "10s"}})
    with Run("alert-allocated-unused", sooner) as r:
        r.until(615)
    (alert,) = r.engine.alerts()
    assert (alert.name, alert.gpu, alert.state) == ("GpuAllocatedUnused", 2, "firing")
    assert alert.summary == ("GPU 2 is allocated to pod research/preprocess-7 (container tokenizer), but no "
                             "process has held a context on it for 10m")
    assert alert.values == {"unused_seconds": 615.0, "pods": 1.0}
    assert {t.gpu for _, t in r.transitions} == {2}

"""How a simulated process's work follows its scenario (simulate/work_shape.py): steps on the pattern's
grid, busy for the pattern's level, phases, loops, start and stop."""

from __future__ import annotations

import json
import time

import pytest

from gpuscope.simulate.loader import parse_scenario
from gpuscope.simulate.traced_work import compute_until
from gpuscope.simulate.work_shape import FULL_FILL, STEP_S, Step, WorkShape, work_spec


def shape_of(yaml: str, gpu: int = 0, process: int = 0) -> WorkShape:
    scenario = parse_scenario(yaml)
    spec = scenario.gpus[gpu]
    period = scenario.duration if scenario.loop else None
    # Through JSON, as the helper process receives it.
    return WorkShape(json.loads(json.dumps(work_spec(spec, spec.processes[process], period))))


def close(step: Step, start: float, busy_until: float, end: float) -> bool:
    return all(abs(a - b) < 1e-9 for a, b in ((step.start, start), (step.busy_until, busy_until),
                                              (step.end, end)))


def test_a_steady_gpu_gives_short_steps_busy_for_its_level() -> None:
    shape = shape_of("duration: 10s\ngpus:\n  - utilization: {level: 0.9, noise: 0.05}\n"
                     "    processes: [{name: p, spawn: true}]\n")
    assert close(shape.step_at(0.0), 0.0, 0.09, STEP_S)
    assert close(shape.step_at(3.25), 3.2, 3.29, 3.3)
    assert close(shape.step_at(13.25), 13.2, 13.29, 13.3)  # the scenario loops every 10 s


def test_steps_follow_the_patterns_period_and_busy_fraction() -> None:
    # The demo's input-bound GPU: busy 97 % for the first half of each second, idle the other half.
    shape = shape_of("duration: 10s\ngpus:\n  - utilization: {pattern: steps, period: 1s, busy_fraction: 0.5,"
                     " busy_level: 0.97, idle_level: 0.0}\n    processes: [{name: p, spawn: true}]\n")
    assert close(shape.step_at(2.7), 2.0, 2.485, 3.0)
    assert shape.step_at(2.7).active


def test_a_share_of_the_gpu_and_phases() -> None:
    shape = shape_of("""
duration: 10s
gpus:
  - utilization: 1.0
    phases:
      - {from: 4s, utilization: {pattern: ramp, start: 0.0, end: 1.0, over: 2s}}
      - {from: 8s}
    processes:
      - {name: a, spawn: true, sm_share: 0.25}
      - {name: b, spawn: true, sm_share: 0.75}
""", process=0)
    assert close(shape.step_at(1.0), 1.0, 1.025, 1.1)  # a quarter of a fully busy GPU
    assert close(shape.step_at(5.0), 5.0, 5.0 + 0.1 * 0.525 * 0.25, 5.1)  # the ramp, half-way up
    assert close(shape.step_at(8.05), 8.0, 8.025, 8.1)  # back to the GPU's own pattern


def test_a_process_with_its_own_pattern_runs_only_between_start_and_stop() -> None:
    shape = shape_of("""
duration: 10s
gpus:
  - utilization: 0.5
    processes:
      - {name: p, spawn: true, start: 2s, stop: 6s,
         utilization: {pattern: steps, period: 2s, busy_fraction: 0.25}}
""")
    assert not shape.step_at(1.0).active
    assert close(shape.step_at(3.0), 2.0, 2.5, 4.0)  # its pattern's time starts at its start
    assert not shape.step_at(7.0).active
    assert close(shape.step_at(13.0), 12.0, 12.5, 14.0)  # and again in the next loop


def test_a_step_ends_where_the_next_phase_begins() -> None:
    shape = shape_of("duration: 10s\ngpus:\n"
                     "  - utilization: {pattern: steps, period: 3s, busy_fraction: 1.0}\n"
                     "    phases: [{from: 4s, utilization: 0.5}]\n    processes: [{name: p, spawn: true}]\n")
    assert close(shape.step_at(3.5), 3.0, 4.0, 4.0)


@pytest.mark.parametrize("spec", [
    {"phases": [{"from": 0, "pattern": {"pattern": "sawtooth"}}]},
    {"phases": [{"pattern": {"pattern": "steady", "level": 1}}]},
    {"phases": [{"from": 0, "pattern": {"pattern": "steps"}}]},
    {"loop": 0, "phases": []},
    {"phases": 5},
])
def test_a_bad_work_spec_is_refused_when_the_helper_starts(spec: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="invalid work spec"):
        WorkShape(spec)


def test_no_spec_is_a_process_that_only_waits() -> None:
    step = WorkShape({}).step_at(1.0)
    assert not step.active and step.end > 1.0


def test_the_simulated_gpu_runs_a_shared_gpus_kernels_for_its_busy_part_and_fills_few_sms_when_stalled(
        ) -> None:
    yaml = """
duration: 10s
gpus:
  - utilization: 0.8
    phases:
      - {from: 5s, gpm: {sm_active: 0.2}}
    processes:
      - {name: a, spawn: true, sm_share: 0.25}
      - {name: b, spawn: true, sm_share: 0.75}
"""
    shape = shape_of(yaml, process=0)
    step = shape.step_at(1.0)
    assert close(step, 1.0, 1.02, 1.1)  # its own CPU work: a quarter of the GPU's 80%
    # Time-sliced, its kernels stretch over the other process's slices: the GPU's whole busy part.
    assert step.device_until == pytest.approx(1.08) and step.fill == FULL_FILL
    assert shape.step_at(6.0).fill == pytest.approx(0.2)  # busy, but most SMs empty
    alone = shape_of("duration: 10s\ngpus:\n  - utilization: 0.8\n    processes: [{name: p, spawn: true}]\n")
    assert alone.step_at(1.0).device_until == pytest.approx(alone.step_at(1.0).busy_until)


def test_a_compute_span_of_a_process_woken_late_still_computes() -> None:
    assert compute_until(time.monotonic() - 1.0) == 1  # its deadline passed before it ran
    assert compute_until(time.monotonic() + 0.05) > 1

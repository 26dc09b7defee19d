"""The replay on CPU traces, against measured pairs of jobs whose fix is on the host (recorded by
bench/replay_pairs.py, see tests/fixtures/traces/cpu/README.md): a DataLoader without workers against
4 and against 1 worker, a loop with and without a per-step ``.item()``. The pairs' measured step times
are data, so the checks are deterministic; a live PyTorch job checks only what does not depend on
its timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache, partial
from pathlib import Path
from typing import Any

import pytest
from capturing import require_torch

from gpuscope.analysis.diagnose import diagnose
from gpuscope.analysis.gains import estimate_gains
from gpuscope.analysis.intervals import IntervalSet
from gpuscope.analysis.model import Kind, Trace
from gpuscope.analysis.patterns import INPUT_OP
from gpuscope.analysis.replay import fidelity, replay, step_time, step_times
from gpuscope.analysis.replay_fixes import Fix, predict, prefetch_input, remove_host_syncs
from gpuscope.analysis.replay_graph import HOST, StepGraph, build_graph
from gpuscope.analysis.sources import read_trace

FIXTURES = Path(__file__).parent / "fixtures" / "traces" / "cpu"
PAIRS: dict[str, dict[str, Any]] = json.loads((FIXTURES / "pairs.json").read_text(encoding="utf-8"))
TRACES = sorted(path.name for path in FIXTURES.glob("*.pt.trace.json.gz"))


@cache
def trace_of(name: str) -> Trace:
    return read_trace(FIXTURES / name)


@cache
def graph_of(name: str) -> StepGraph:
    return build_graph(trace_of(name))


def fix_of(pair: str) -> Fix:
    workers = PAIRS[pair]["workers"]
    return partial(prefetch_input, workers=workers) if workers else remove_host_syncs


def test_the_fixtures_are_the_pairs_bench_replay_pairs_records() -> None:
    assert set(PAIRS) == {"input4", "input1", "sync"}
    for pair, entry in PAIRS.items():
        assert entry["before_trace"] in TRACES and entry["after_trace"] in TRACES, pair
        assert entry["measured_before_ms"] > 0 and entry["measured_after_ms"] > 0, pair
    for name in TRACES:
        assert (FIXTURES / name).stat().st_size < 200_000, name


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_the_prediction_is_within_15_percent_of_the_measured_speedup(pair: str) -> None:
    """From the unfixed job's trace alone, the fix's replay predicts the speedup measured between the
    two jobs without the profiler, in the cycle the traces come from."""
    entry = PAIRS[pair]
    prediction = predict(trace_of(entry["before_trace"]), [fix_of(pair)])
    measured = entry["measured_before_ms"] / entry["measured_after_ms"]
    assert prediction.speedup == pytest.approx(measured, rel=0.15)


def test_the_input_pairs_gain_a_lot_and_the_sync_pair_nothing() -> None:
    """What the 15% bound is about: four loaders roughly halve the step, one loader (as slow as the
    input) does less, and reading the loss back on the CPU costs nothing."""
    speedups = {pair: predict(trace_of(entry["before_trace"]), [fix_of(pair)]).speedup
                for pair, entry in PAIRS.items()}
    assert speedups["input4"] > speedups["input1"] > 1.5
    assert speedups["sync"] == pytest.approx(1.0, abs=1e-9)


def test_estimate_gains_gives_the_input_finding_the_one_loader_replay() -> None:
    """The diagnosis of the CPU trace finds the input wait; its gain is the replay with one loader,
    which the pair with one worker measured."""
    trace = trace_of(PAIRS["input1"]["before_trace"])
    (finding,) = [f for f in diagnose(trace).findings if f.kind == "input_bound"]
    gain = estimate_gains(trace, [finding]).of(finding)
    prediction = predict(trace, [prefetch_input])
    assert not gain.not_estimated
    assert gain.after_ms == pytest.approx(prediction.after_us / 1e3)
    measured = PAIRS["input1"]["measured_before_ms"] / PAIRS["input1"]["measured_after_ms"]
    assert gain.before_ms / gain.after_ms == pytest.approx(measured, rel=0.15)


def test_the_per_step_item_is_a_host_sync_finding_whose_gain_is_none() -> None:
    """On the CPU, ``.item()`` waits for no device: the diagnosis counts it, and its fix's replay
    wins nothing (no synchronisation in the graph waits for anything)."""
    trace = trace_of(PAIRS["sync"]["before_trace"])
    (finding,) = [f for f in diagnose(trace).findings if f.kind == "host_sync"]
    gain = estimate_gains(trace, [finding]).of(finding)
    assert not gain.not_estimated
    assert gain.after_ms == pytest.approx(gain.before_ms)


@pytest.mark.parametrize("name", TRACES)
def test_a_cpu_trace_replays_to_its_measured_step_time(name: str) -> None:
    result = fidelity(trace_of(name))
    assert result.replayed_us == pytest.approx(result.measured_us, rel=0.01)
    graph = graph_of(name)
    replayed = replay(graph)
    for i in range(len(graph)):
        assert replayed.start[i] == pytest.approx(graph.start[i], abs=0.01)
        assert replayed.end[i] == pytest.approx(graph.end(i), abs=0.01)


@pytest.mark.parametrize("name", TRACES)
def test_a_cpu_graph_is_the_host_operations_without_the_input_wait(name: str) -> None:
    graph, trace = graph_of(name), trace_of(name)
    assert len(graph) > 10 * len(graph.steps.steps)
    assert set(graph.kind) == {HOST}
    names = [trace.names[graph.name[i]] for i in range(len(graph))]
    assert not [n for n in names if INPUT_OP.search(n)]
    assert "Optimizer.step#SGD.step" in names
    assert sum(1 for n in names if n.startswith("ProfilerStep#")) == trace.count(Kind.STEP)
    assert not graph.assumptions  # nothing about device work tied to launches: there is none


def test_prefetching_takes_the_input_wait_out_of_every_step_the_first_included() -> None:
    name = PAIRS["input4"]["before_trace"]
    graph, trace = graph_of(name), trace_of(name)
    fixed = prefetch_input(graph, workers=4)
    waits = IntervalSet.merge((s.start, s.start + s.dur) for s in trace.iter(Kind.HOST_OP)
                              if INPUT_OP.search(s.name))
    for step, after in zip(graph.steps.steps, step_times(fixed, replay(fixed)), strict=True):
        wait = waits.covered(step.start, step.end)
        assert wait > 0.5 * step.duration  # the input wait is most of each step
        assert after == pytest.approx(step.duration - wait, abs=0.05 * step.duration)


# --- a live PyTorch job: what does not depend on its timing ---------------------------------------

LOADER_JOB = """
import sys, time
import torch
from torch.utils.data import DataLoader, Dataset

class Slow(Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        time.sleep(0.002)  # the read from storage
        return torch.full((16,), float(i)), torch.tensor([float(i)])

torch.manual_seed(0)
model = torch.nn.Linear(16, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                            schedule=torch.profiler.schedule(wait=1, warmup=1, active=4, repeat=1),
                            on_trace_ready=lambda p: p.export_chrome_trace(sys.argv[1])) as prof:
    for x, y in DataLoader(Slow(), batch_size=4):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()
        prof.step()
"""


@pytest.fixture(scope="module")
def loader_trace(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    require_torch()
    tmp = tmp_path_factory.mktemp("loader")
    out = tmp / "loader.pt.trace.json"
    script = tmp / "job.py"
    script.write_text(LOADER_JOB)
    done = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return read_trace(out)


def test_a_recorded_cpu_loop_replays_as_it_ran_and_its_sync_fix_wins_nothing(loader_trace: Trace) -> None:
    graph = build_graph(loader_trace)
    assert len(graph.steps.steps) >= 3
    names = {loader_trace.names[graph.name[i]] for i in range(len(graph))}
    assert "aten::_local_scalar_dense" in names or "aten::item" in names
    assert not [n for n in names if INPUT_OP.search(n)]  # the DataLoader's wait is not a node
    assert step_time(graph, replay(graph)) == pytest.approx(
        graph.steps.time / len(graph.steps.steps), rel=0.01)
    prediction = predict(graph, [remove_host_syncs])
    assert prediction.after_us == pytest.approx(prediction.before_us)


def test_a_recorded_cpu_loop_loses_its_input_wait_to_prefetching(loader_trace: Trace) -> None:
    """The DataLoader's time (8 ms of sleeps a step) leaves the step: no number measured here, only
    that the fix takes out the time the input spans cover and the loaders bound the step."""
    graph = build_graph(loader_trace)
    fixed = prefetch_input(graph, workers=2)
    waits = IntervalSet.merge((s.start, s.start + s.dur) for s in loader_trace.iter(Kind.HOST_OP)
                              if INPUT_OP.search(s.name))
    steps = graph.steps.steps
    per_step = waits.covered(steps[0].start, steps[-1].end) / len(steps)
    assert per_step > 0
    assert fixed.floor_us == pytest.approx(per_step / 2)
    replayed = step_times(fixed, replay(fixed))
    for step, after in zip(steps, replayed, strict=True):
        assert after <= step.duration - 0.9 * waits.covered(step.start, step.end) + 1.0


def test_the_bench_runs_a_pair_and_reports_each_cycle(tmp_path: Path) -> None:
    """bench/replay_pairs.py's harness, on one short cycle: the figures are not judged here."""
    require_torch()
    bench = Path(__file__).resolve().parent.parent / "bench" / "replay_pairs.py"
    done = subprocess.run([sys.executable, str(bench), "--pairs", "sync", "--cycles", "1", "--block", "4",
                           "--skip", "1", "--warmup", "1", "--hidden", "64", "--keep", str(tmp_path / "keep"),
                           "--fixtures", str(tmp_path / "fixtures"), "--json"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    (cycle,) = json.loads(done.stdout)["sync"]
    assert cycle["before_ms"] > 0 and cycle["after_ms"] > 0 and cycle["predicted"] > 0
    assert cycle["how"].startswith("predict(remove_host_syncs)")
    written = json.loads((tmp_path / "fixtures" / "pairs.json").read_text(encoding="utf-8"))
    assert written["sync"]["before_trace"] == "sync_before.pt.trace.json.gz"
    trace = read_trace(tmp_path / "fixtures" / "sync_before.pt.trace.json.gz")
    assert trace.count(Kind.STEP) == 3  # the block's steps less the one skipped

"""Measured pairs on the CPU where the fix is on the host: the replay's predicted speedup against the
one measured between a job and its fixed version (not a test: run by hand).

Run: python bench/replay_pairs.py [--pairs input4,input1,sync] [--cycles 5] [--block 12] [--keep DIR]
                                  [--fixtures tests/fixtures/traces/cpu] [--each] [--json]

Pairs (PyTorch on the CPU, one intra-op thread; both jobs of a pair in one child process):

* ``input4``: an MLP trained from a DataLoader whose Dataset reads each sample: a sleep of
  ``--read-ms`` for the read from storage, then light decoding (bytes to normalised floats). Before:
  ``num_workers=0`` (the step's thread loads every batch); after: ``num_workers=4`` (the reads
  overlap the step and each other, even on two cores: they sleep). Replayed: ``prefetch_input`` with
  4 loaders.
* ``input1``: the same with ``num_workers=1``: one loader, as slow as the input it prefetches.
  Replayed: ``prefetch_input`` with 1 loader (what ``estimate_gains`` replays for an input_bound
  finding).
* ``sync``: the same MLP on batches already in memory, with and without a per-step ``loss.item()``
  (the fixed job sums the loss as a tensor and reads it once). On the CPU ``.item()`` waits for no
  device, so the measured speedup is about 1.0: the check is that the replay predicts no gain that
  is not there. Replayed: ``remove_host_syncs``.

The machine's other work changes a step's time by tens of percent from one second to the next, so
the jobs are measured in cycles: each cycle runs a block of steps of each job under torch.profiler
(CPU activity; a Chrome trace each), then a block of each without it, timed. A block's first
``--skip`` steps are neither traced nor timed (the batches a job's workers queued while the other
ran). Per cycle: the measured speedup (the blocks without the profiler: mean step time before over
after), the traced one (the traces' ``ProfilerStep`` spans) and the predicted one, from the unfixed
job's trace of that cycle, through ``predict`` with the fix as the pair makes it, and through
``estimate_gains`` on the diagnosis's finding where it gives one. The table prints, per pair, the
medians over the cycles and the prediction's error (|predicted - measured| / measured), and the
range of the cycles' own errors. ``--keep DIR`` keeps every trace, and names each pair's median
cycle; ``--fixtures DIR`` writes each pair's median cycle there (tests/test_replay_pairs.py's
fixtures).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

# The child: one pair, both jobs in one process, measured in alternating blocks, then the unfixed
# job's trace. Run with ``python -c PAIR_JOB PAIR OUT ARGS_JSON``.
PAIR_JOB = r"""
import json, statistics, sys, time
from pathlib import Path
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, schedule
from torch.utils.data import DataLoader, Dataset

pair, out, args = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
torch.set_num_threads(1)  # one core for the step, whatever else the machine runs
torch.manual_seed(0)
FEATURES, HIDDEN, CLASSES, BATCH = 512, args["hidden"], 10, args["batch"]
blocks, block, skip = args["cycles"], args["block"], args["skip"]
total_steps = args["warmup"] + 2 * blocks * block + 8


class StoredSamples(Dataset):
    # Each sample as if read from storage (a sleep: the read's wait) and decoded (bytes to floats).
    def __init__(self, n, read_s):
        generator = torch.Generator().manual_seed(1)
        self.blobs = torch.randint(0, 256, (n, FEATURES), dtype=torch.uint8, generator=generator)
        self.labels = torch.randint(0, CLASSES, (n,), generator=generator)
        self.read_s = read_s

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        time.sleep(self.read_s)
        return self.blobs[i].float().div_(255.0).sub_(0.5), self.labels[i]


model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                      nn.Linear(HIDDEN, CLASSES))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loss_fn = nn.CrossEntropyLoss()
running = torch.zeros(())
logged = []


def in_memory():
    generator = torch.Generator().manual_seed(1)
    return iter([(torch.randn(BATCH, FEATURES, generator=generator),
                  torch.randint(0, CLASSES, (BATCH,), generator=generator)) for _ in range(total_steps)])


def loading(workers):
    dataset = StoredSamples(total_steps * BATCH, args["read_ms"] / 1e3)
    return iter(DataLoader(dataset, batch_size=BATCH, num_workers=workers, persistent_workers=workers > 0))


def job(batches, read_back):
    def step():
        global running
        x, y = next(batches)
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        if read_back:
            logged.append(loss.item())  # read back every step, as a loop that logs each loss does
        else:
            running = running + loss.detach()  # kept as a tensor, read once at the end
    return step


if pair == "sync":
    before, after = job(in_memory(), True), job(in_memory(), False)
else:
    before, after = job(loading(0), False), job(loading(int(pair.removeprefix("input"))), False)
for _ in range(args["warmup"]):
    before()
    after()
# Cycles of four blocks: each job under the profiler (its trace), then each job without it (timed), so
# that what else the machine runs weighs on both jobs, and on the trace and the timing, alike. A block's
# first steps are neither recorded nor timed (the batches a job's workers queued while the other ran).
cycles = []
for cycle in range(blocks):
    record = {}
    for name, step in (("before", before), ("after", after)):
        trace = out / f"{pair}_{cycle}_{name}.pt.trace.json"
        with profile(activities=[ProfilerActivity.CPU],
                     schedule=schedule(wait=max(skip - 1, 0), warmup=1, active=block - skip),
                     on_trace_ready=lambda p, trace=trace: p.export_chrome_trace(str(trace))) as prof:
            for _ in range(block):
                step()
                prof.step()
        record[f"{name}_trace"] = str(trace)
    for name, step in (("before", before), ("after", after)):
        for _ in range(skip):
            step()
        started = time.perf_counter()
        for _ in range(block - skip):
            step()
        record[f"{name}_ms"] = (time.perf_counter() - started) / (block - skip) * 1e3
    cycles.append(record)
print(json.dumps({"pair": pair, "cycles": cycles}))
"""

# pair -> the loaders its fix replays with (0: the synchronisation pair)
PAIRS = {"input4": 4, "input1": 1, "sync": 0}


@dataclass(frozen=True)
class CycleResult:
    """One cycle of a pair: the jobs' mean step times (ms) and the prediction from the unfixed job's
    trace of that cycle."""

    pair: str
    cycle: int
    before_ms: float  # without the profiler
    after_ms: float
    traced_before_ms: float  # the traces' mean steps (under the profiler)
    traced_after_ms: float
    predicted: float  # speedup, through ``predict`` with the fix as the pair makes it
    gains_predicted: float | None  # speedup, through estimate_gains; None: not estimated
    how: str
    before_trace: str
    after_trace: str

    @property
    def measured(self) -> float:
        return self.before_ms / self.after_ms

    @property
    def traced(self) -> float:
        return self.traced_before_ms / self.traced_after_ms

    @property
    def error(self) -> float:
        return abs(self.predicted - self.measured) / self.measured


def run_pair_job(pair: str, out: Path, job_args: dict[str, Any]) -> dict[str, Any]:
    run = subprocess.run([sys.executable, "-c", PAIR_JOB, pair, str(out), json.dumps(job_args)],
                         capture_output=True, text=True, timeout=1800, check=False)
    if run.returncode:
        raise SystemExit(f"pair {pair} failed ({run.returncode}):\n{run.stderr}")
    result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    for cycle in result["cycles"]:
        for key in ("before_trace", "after_trace"):
            plain = Path(cycle[key])
            zipped = plain.with_name(plain.name + ".gz")
            with plain.open("rb") as source, gzip.open(zipped, "wb") as target:
                shutil.copyfileobj(source, target)
            plain.unlink()
            cycle[key] = str(zipped)
    return result


def traced_step_ms(path: Path) -> float:
    """A trace's mean step time (its ``ProfilerStep`` spans, as the diagnosis finds them), ms."""
    from gpuscope.analysis.sources import read_trace
    from gpuscope.analysis.steps import find_steps

    found = find_steps(read_trace(path))
    return found.time / len(found.steps) / 1e3


def predict_pair(pair: str, trace_path: Path) -> tuple[float, float | None, str]:
    """The predicted speedup through ``predict`` with the pair's fix, through ``estimate_gains`` on the
    diagnosis's finding (None where not estimated), and how."""
    from gpuscope.analysis.diagnose import diagnose
    from gpuscope.analysis.gains import estimate_gains
    from gpuscope.analysis.replay_fixes import Fix, predict, prefetch_input, remove_host_syncs
    from gpuscope.analysis.sources import read_trace

    trace = read_trace(trace_path)
    workers = PAIRS[pair]
    fix: Fix
    if workers:
        kind, fix = "input_bound", partial(prefetch_input, workers=workers)
        named = f"predict(prefetch_input, workers={workers})"
    else:
        kind, fix, named = "host_sync", remove_host_syncs, "predict(remove_host_syncs)"
    prediction = predict(trace, [fix])
    finding = next((f for f in diagnose(trace).findings if f.kind == kind), None)
    if finding is None:
        return prediction.speedup, None, f"{named}; the diagnosis found no {kind}"
    gain = estimate_gains(trace, [finding]).of(finding)
    if gain.not_estimated or gain.after_ms <= 0:
        return prediction.speedup, None, f"{named}; estimate_gains: {gain.not_estimated}"
    how = f"{named}; estimate_gains on its {kind} finding"
    return prediction.speedup, gain.before_ms / gain.after_ms, how


def run_pair(pair: str, out: Path, job_args: dict[str, Any]) -> list[CycleResult]:
    measured = run_pair_job(pair, out, job_args)
    (out / f"{pair}.json").write_text(json.dumps(measured, indent=1), encoding="utf-8")
    results = []
    for n, cycle in enumerate(measured["cycles"]):
        before, after = Path(cycle["before_trace"]), Path(cycle["after_trace"])
        predicted, gains_predicted, how = predict_pair(pair, before)
        results.append(CycleResult(pair, n, cycle["before_ms"], cycle["after_ms"], traced_step_ms(before),
                                   traced_step_ms(after), predicted, gains_predicted, how, str(before),
                                   str(after)))
    return results


def median_cycle(cycles: list[CycleResult]) -> CycleResult:
    """The cycle whose measured speedup is the median (the lower middle one of an even count)."""
    ordered = sorted(cycles, key=lambda c: c.measured)
    return ordered[(len(ordered) - 1) // 2]


def table(by_pair: dict[str, list[CycleResult]]) -> str:
    lines = ["| pair | measured before (ms) | measured after (ms) | measured speedup | predicted speedup "
             "| error | traced speedup | estimate_gains speedup | cycles | error range | how predicted |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for pair, cycles in by_pair.items():
        before = statistics.median(c.before_ms for c in cycles)
        after = statistics.median(c.after_ms for c in cycles)
        measured = statistics.median(c.measured for c in cycles)
        predicted = statistics.median(c.predicted for c in cycles)
        traced = statistics.median(c.traced for c in cycles)
        gains = [c.gains_predicted for c in cycles if c.gains_predicted is not None]
        gains_text = f"{statistics.median(gains):.2f}x" if gains else "not estimated"
        errors = [c.error * 100 for c in cycles]
        lines.append(f"| {pair} | {before:.1f} | {after:.1f} | {measured:.2f}x | {predicted:.2f}x | "
                     f"{abs(predicted - measured) / measured * 100:.1f}% | {traced:.2f}x | {gains_text} | "
                     f"{len(cycles)} | {min(errors):.1f}-{max(errors):.1f}% | {cycles[0].how} |")
    return "\n".join(lines)


def cycle_table(by_pair: dict[str, list[CycleResult]]) -> str:
    lines = ["| pair | cycle | measured (ms) | measured speedup | traced (ms) | traced speedup "
             "| predicted speedup | error |", "|---|---|---|---|---|---|---|---|"]
    for pair, cycles in by_pair.items():
        lines.extend(f"| {pair} | {c.cycle} | {c.before_ms:.1f} -> {c.after_ms:.1f} | {c.measured:.2f}x | "
                     f"{c.traced_before_ms:.1f} -> {c.traced_after_ms:.1f} | {c.traced:.2f}x | "
                     f"{c.predicted:.2f}x | {c.error * 100:.1f}% |" for c in cycles)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated, of {', '.join(PAIRS)}")
    parser.add_argument("--cycles", type=int, default=5, help="cycles of the two jobs' blocks")
    parser.add_argument("--block", type=int, default=12, help="steps a block")
    parser.add_argument("--skip", type=int, default=3, help="steps at a block's start not timed nor traced")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--read-ms", type=float, default=1.0, help="the storage read per sample")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--keep", type=Path, help="keep the traces and the jobs' results in this folder")
    parser.add_argument("--fixtures", type=Path, help="write each pair's median cycle here (test fixtures)")
    parser.add_argument("--each", action="store_true", help="also a row for each cycle")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    pairs = [p for p in args.pairs.split(",") if p]
    unknown = [p for p in pairs if p not in PAIRS]
    if unknown:
        parser.error(f"unknown pairs {unknown}: choose from {sorted(PAIRS)}")
    if not 0 <= args.skip < args.block:
        parser.error("--skip must be at least 0 and less than --block")
    job_args = {"warmup": args.warmup, "read_ms": args.read_ms, "batch": args.batch, "hidden": args.hidden,
                "cycles": args.cycles, "block": args.block, "skip": args.skip}
    by_pair: dict[str, list[CycleResult]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        out = args.keep or Path(scratch)
        out.mkdir(parents=True, exist_ok=True)
        for pair in pairs:
            by_pair[pair] = run_pair(pair, out, job_args)
        if args.fixtures:  # while the traces are there
            write_fixtures(by_pair, args.fixtures)
    if args.json:
        print(json.dumps({pair: [{**asdict(c), "measured": c.measured, "traced": c.traced, "error": c.error}
                                 for c in cycles] for pair, cycles in by_pair.items()}, indent=1))
        return
    print(table(by_pair))
    if args.each:
        print()
        print(cycle_table(by_pair))
    if args.keep:
        print()
        for pair, cycles in by_pair.items():
            middle = median_cycle(cycles)
            print(f"{pair}: median cycle {middle.cycle}: {middle.before_trace}, {middle.after_trace}")


def write_fixtures(by_pair: dict[str, list[CycleResult]], folder: Path) -> None:
    """Each pair's median cycle: its two traces, and ``pairs.json`` with the blocks' step times timed
    without the profiler in that cycle (what the tests compare the prediction with)."""
    folder.mkdir(parents=True, exist_ok=True)
    pairs = {}
    for pair, cycles in by_pair.items():
        middle = median_cycle(cycles)
        names = {}
        for which, path in (("before", middle.before_trace), ("after", middle.after_trace)):
            names[which] = f"{pair}_{which}.pt.trace.json.gz"
            shutil.copyfile(path, folder / names[which])
        pairs[pair] = {"workers": PAIRS[pair], "before_trace": names["before"], "after_trace": names["after"],
                       "measured_before_ms": round(middle.before_ms, 3),
                       "measured_after_ms": round(middle.after_ms, 3), "cycle": middle.cycle,
                       "cycles": len(cycles)}
    (folder / "pairs.json").write_text(json.dumps(pairs, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

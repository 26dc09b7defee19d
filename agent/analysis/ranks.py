"""The ranks of one distributed job, side by side: which rank is the slowest, and which wait for it.

In a data-parallel job every rank waits for the slowest at each collective: a rank that computes
longer (a bigger batch, a slower GPU, a busier host) keeps the others spinning in their all-reduce
kernels or blocked in ``cudaStreamSynchronize``. Each rank's own diagnosis then blames communication
on the ranks that wait, and nothing on the one they wait for; only the ranks read together say which
one holds the job back.

Traces are taken for ranks of one job when each carries Kineto's ``distributedInfo`` with the same
world size and a rank of its own, or, without it, when their file names number the ranks
(``rank3``, ``rank-3``, ``_rank_3``) after one common prefix.

Per rank, per step: the compute (the device busy, less the communication no computation hides), the
exposed communication, the device's idle time, the time the host was blocked in synchronising calls,
and the time spent waiting for peers inside the collectives. That wait is estimated per collective
kernel: a rank's time in it beyond the least any rank spent in the same collective (the fastest rank
to arrive waits for nobody, so its time is the transfer itself).

Explain reads one trace at a time: ``rank_summary`` keeps the little this comparison needs while the
trace is loaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from statistics import median
from typing import Any

from gpuscope.analysis.diagnose import Diagnosis
from gpuscope.analysis.intervals import IntervalSet
from gpuscope.analysis.model import Kind, Trace
from gpuscope.analysis.patterns import COLLECTIVE_KERNEL, SYNC_RUNTIME
from gpuscope.analysis.steps import find_steps

# A rank that waits for the slowest: in the collectives, longer than the slowest does by both.
WAIT_MARGIN_MS = 1.0
WAIT_MARGIN_SHARE = 0.20
# A rank number in a file or folder name: rank3, rank-3, rank_3, Rank.3; not "crank3".
RANK_NAME = re.compile(r"(?<![a-z])rank[-_.]?(\d+)(?!\d)", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class RankSummary:
    """What the ranks' comparison needs of one trace, taken while it is loaded. Times are ms a step."""

    source: str
    name: str  # the file's path under the folder explained: its rank number, without distributedInfo
    distributed: dict[str, int]  # the trace's rank and world_size, when it says
    verdict: str
    steps: int
    step_ms: float  # the steps' window over their count: what the breakdown's shares are of
    busy_ms: float
    compute_ms: float  # the device busy, less the exposed communication
    communication_ms: float  # exposed: collectives with no computation beside them
    idle_ms: float
    host_blocked_ms: float  # the host in synchronising calls (cudaStreamSynchronize ...)
    collectives: tuple[tuple[str, float], ...]  # each collective kernel's time a step, by name

    @property
    def comparable(self) -> bool:
        """It has device steps to compare (``steps`` counts none on a trace without a device)."""
        return self.steps > 0 and self.step_ms > 0


def rank_summary(trace: Trace, diagnosis: Diagnosis, name: str) -> RankSummary:
    """The summary of one trace, from its diagnosis and what only the trace holds."""
    steps = find_steps(trace).steps
    n = len(steps)
    window = (steps[0].start, steps[-1].end) if steps else (0.0, 0.0)
    step_ms = (window[1] - window[0]) / max(n, 1) / 1e3
    shares = diagnosis.breakdown if diagnosis.device else {}
    busy = shares.get("busy", 0.0) * step_ms
    exposed = shares.get("communication", 0.0) * step_ms
    return RankSummary(
        source=diagnosis.source, name=name, distributed=dict(trace.distributed), verdict=diagnosis.verdict,
        steps=n if diagnosis.device else 0, step_ms=round(step_ms, 3), busy_ms=round(busy, 3),
        compute_ms=round(max(busy - exposed, 0.0), 3), communication_ms=round(exposed, 3),
        idle_ms=round(max(step_ms - busy, 0.0), 3),
        host_blocked_ms=round(_host_blocked(trace, window) / max(n, 1) / 1e3, 3),
        collectives=_collectives(trace, window, n))


def _host_blocked(trace: Trace, window: tuple[float, float]) -> float:
    """Microseconds within the steps in which a host thread waited in a synchronising call."""
    runtime, names = trace.spans[Kind.RUNTIME], trace.names
    syncing = {i for i, name in enumerate(names) if SYNC_RUNTIME.match(name)}
    return IntervalSet.merge((runtime.start[i], runtime.start[i] + runtime.dur[i])
                             for i in range(len(runtime)) if runtime.name[i] in syncing).covered(*window)


def _collectives(trace: Trace, window: tuple[float, float], n: int) -> tuple[tuple[str, float], ...]:
    """Each collective kernel's time a step (ms) within the steps, by kernel name."""
    kernels, names = trace.spans[Kind.KERNEL], trace.names
    collective = {i for i, name in enumerate(names) if COLLECTIVE_KERNEL.search(name)}
    if not collective:
        return ()
    a, b = window
    time: dict[str, float] = {}
    for i in range(len(kernels)):
        if kernels.name[i] in collective and a <= kernels.start[i] < b:
            name = names[kernels.name[i]]
            time[name] = time.get(name, 0.0) + kernels.dur[i]
    return tuple(sorted((name, round(us / max(n, 1) / 1e3, 3)) for name, us in time.items()))


@dataclass(frozen=True, slots=True)
class RankRow:
    rank: int
    summary: RankSummary
    peer_wait_ms: float  # in the collectives, beyond the least any rank spent in them
    waits: bool  # waits for the slowest rank


@dataclass(frozen=True, slots=True)
class RanksReport:
    world_size: int | None  # None when only the file names number the ranks
    identified_by: str  # "distributedInfo" or "file names"
    rows: tuple[RankRow, ...]  # by rank
    slowest: int  # the rank the others wait for
    waiting: tuple[int, ...]
    collectives: bool  # the traces hold collective kernels (else the waits cannot be measured)

    @property
    def slowest_row(self) -> RankRow:
        return next(row for row in self.rows if row.rank == self.slowest)

    @property
    def verdict(self) -> str:
        """The job's verdict: the slowest rank's, as the others wait for it."""
        return self.slowest_row.summary.verdict

    @property
    def missing(self) -> tuple[int, ...]:
        """The ranks of the job with no trace here (or none that could be compared)."""
        if self.world_size is None:
            return ()
        present = {row.rank for row in self.rows}
        return tuple(r for r in range(self.world_size) if r not in present)

    def headline(self) -> str:
        slow = self.slowest_row
        own = slow.summary.compute_ms + slow.summary.idle_ms
        others = [row.summary.compute_ms + row.summary.idle_ms for row in self.rows if row is not slow]
        text = (f"rank {self.slowest} is the slowest: {slow.summary.compute_ms:.1f} ms of compute and "
                f"{slow.summary.idle_ms:.1f} ms of device idle time a step ({own:.1f} ms), against "
                f"{median(others):.1f} ms on the other ranks (median)")
        if not self.collectives:
            return text + "; the traces hold no collective kernels: the waits for it are not measured"
        if not self.waiting:
            return text + f"; no rank waits for it more than {WAIT_MARGIN_MS:g} ms a step longer than it does"
        waits = [row.peer_wait_ms for row in self.rows if row.waits]
        verb = "waits" if len(self.waiting) == 1 else "wait"
        return (text + f"; {_ranks(self.waiting)} {verb} for it {median(waits):.1f} ms a step (median) in "
                       "the collectives")

    def to_json(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size, "identified_by": self.identified_by, "missing": list(self.missing),
            "slowest": self.slowest, "waiting": list(self.waiting), "verdict": self.verdict,
            "summary": self.headline(),
            "per_rank": [{"rank": row.rank, "source": row.summary.source, "verdict": row.summary.verdict,
                          "steps": row.summary.steps, "step_ms": row.summary.step_ms,
                          "compute_ms": row.summary.compute_ms,
                          "communication_ms": row.summary.communication_ms,
                          "idle_ms": row.summary.idle_ms, "peer_wait_ms": row.peer_wait_ms,
                          "host_blocked_ms": row.summary.host_blocked_ms, "waits": row.waits}
                         for row in self.rows]}


def compare_ranks(summaries: list[RankSummary]) -> RanksReport | None:
    """The comparison of traces that are the ranks of one job; None when they are not (or fewer than
    two of them have device steps to compare)."""
    found = job_ranks(summaries)
    if found is None:
        return None
    ranks, world_size, identified_by = found
    pairs = sorted(((rank, s) for rank, s in zip(ranks, summaries, strict=True) if s.comparable),
                   key=lambda pair: pair[0])
    if len(pairs) < 2:
        return None
    waits = _peer_waits([s for _, s in pairs])
    # The rank the others wait for spends the most time a step on its own work: computing, or with
    # its device idle while its host prepares the next launch.
    slowest = max(range(len(pairs)), key=lambda i: pairs[i][1].compute_ms + pairs[i][1].idle_ms)
    floor = waits[slowest]
    waiting = [i != slowest and w > floor + WAIT_MARGIN_MS and w > floor * (1 + WAIT_MARGIN_SHARE)
               for i, w in enumerate(waits)]
    rows = tuple(RankRow(rank, s, waits[i], waiting[i]) for i, (rank, s) in enumerate(pairs))
    return RanksReport(world_size, identified_by, rows, pairs[slowest][0],
                       tuple(row.rank for row in rows if row.waits),
                       collectives=any(s.collectives for _, s in pairs))


def job_ranks(summaries: list[RankSummary]) -> tuple[list[int], int | None, str] | None:
    """Each trace's rank, the world size, and what told them, when the traces are ranks of one job."""
    if len(summaries) < 2:
        return None
    infos = [s.distributed for s in summaries]
    if all(infos):
        ranks = [info["rank"] for info in infos]
        sizes = {info["world_size"] for info in infos}
        if len(sizes) == 1 and len(set(ranks)) == len(ranks):
            return ranks, sizes.pop(), "distributedInfo"
        return None  # ranks of several jobs, or the same rank twice
    matches = [RANK_NAME.search(s.name) for s in summaries]
    named = [m for m in matches if m is not None]
    if len(named) != len(summaries):
        return None
    prefixes = {m.string[:m.start()] for m in named}
    ranks = [int(m.group(1)) for m in named]
    if len(prefixes) != 1 or len(set(ranks)) != len(ranks):
        return None
    return ranks, None, "file names"


def _peer_waits(summaries: list[RankSummary]) -> list[float]:
    """Per rank, its time a step in the collectives beyond the least any rank spent in each."""
    times = [dict(s.collectives) for s in summaries]
    least: dict[str, float] = {}
    for own in times:
        for name, ms in own.items():
            least[name] = min(ms, least.get(name, ms))
    return [round(sum(ms - least[name] for name, ms in own.items()), 3) for own in times]


def _ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks[:-1]) + f" and {ranks[-1]}"

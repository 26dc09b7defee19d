"""The diagnosis against the trace corpus: published traces with a reading written down by hand.

Each entry of ``fixtures/corpus/corpus.json`` is a trace (or a folder of one job's rank files) that
others recorded and published, with its origin and license, and an expert reading made before
gpuscope was run on it: the verdict (and others that are also right), and the shares of the step
time measured by ``scripts/measure_trace.py``, which does not use gpuscope. Every file of an entry is
diagnosed; its verdict must be the expert's or one of the acceptable ones, and its busy, input and
communication shares (the mean over the entry's files) within 0.03 of the expert's wherever the
expert gives a number. ``baseline.json`` holds what gpuscope said before the diagnosis was changed
for the corpus.
"""

from __future__ import annotations

import json
import statistics
from functools import cache
from pathlib import Path

import pytest

from gpuscope.analysis.diagnose import Diagnosis, diagnose_devices
from gpuscope.analysis.sources import find_traces, read_trace

CORPUS = Path(__file__).parent / "fixtures" / "corpus"
MANIFEST = json.loads((CORPUS / "corpus.json").read_text(encoding="utf-8"))
SHARES = ("busy", "input", "communication")
TOLERANCE = 0.03
REQUIRED_RIGHT = 0.9


def entry_files(entry: dict) -> list[Path]:
    folder = CORPUS / entry["id"]
    files = [folder / name for name in entry["files"]]
    for path in files:
        assert path.resolve().is_relative_to(CORPUS.resolve()), path
        assert path.is_file(), path
    return files


@cache
def diagnoses_of(entry_id: str) -> tuple[Diagnosis, ...]:
    (entry,) = [e for e in MANIFEST if e["id"] == entry_id]
    found: list[Diagnosis] = []
    for path in entry_files(entry):
        (traced,) = find_traces(path)
        found.extend(diagnose_devices(read_trace(traced)))  # one diagnosis per GPU with activity
    return tuple(found)


def accepted(entry: dict) -> set[str]:
    return {entry["expert"]["verdict"], *entry["expert"]["also_acceptable"]}


def problems(entry: dict) -> list[str]:
    """What the diagnosis of an entry gets wrong against the expert reading (nothing: right)."""
    found = diagnoses_of(entry["id"])
    wrong = [f"{Path(d.source).name}: verdict {d.verdict}, expected {sorted(accepted(entry))}"
             for d in found if d.verdict not in accepted(entry)]
    for share in SHARES:
        expected = entry["expert"][share]
        if expected is None:
            continue
        measured = [d.breakdown.get(share) for d in found]
        if any(value is None for value in measured):
            wrong.append(f"{share}: not measured, expected {expected:.2f}")
            continue
        mean = statistics.fmean(measured)
        if abs(mean - expected) > TOLERANCE:
            wrong.append(f"{share}: {mean:.3f}, expected {expected:.2f} +- {TOLERANCE}")
    return wrong


def test_manifest_is_complete() -> None:
    ids = [entry["id"] for entry in MANIFEST]
    assert len(ids) == len(set(ids))
    for entry in MANIFEST:
        origin = entry["origin"]
        assert origin["repository"] and origin["license"] and origin["copyright"]
        assert len(origin["commit"]) == 40
        assert entry["expert"]["reading"]
        entry_files(entry)


@pytest.mark.parametrize("entry", MANIFEST, ids=[entry["id"] for entry in MANIFEST])
def test_entry_matches_expert_reading(entry: dict) -> None:
    wrong = problems(entry)
    assert not wrong, f"{entry['id']}: " + "; ".join(wrong)


def test_most_entries_are_right() -> None:
    right = [entry["id"] for entry in MANIFEST if not problems(entry)]
    share = len(right) / len(MANIFEST)
    assert share >= REQUIRED_RIGHT, f"{len(right)} of {len(MANIFEST)} entries right ({share:.0%})"

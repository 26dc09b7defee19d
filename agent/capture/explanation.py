"""Diagnose trace files and print the report: what `gpuscope explain` and `gpuscope captures explain`
print, and what the capture analysis worker's child process runs (``--json``).

A folder that is a capture (its ``capture.json`` record) is read with its record: the processes of a
capture of one GPU are compared with each other (what sharing the GPU cost each), and a capture an
alert triggered is reported beside that alert. It lives with the captures, under the command line,
so that the analysis worker runs it without importing the command line.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuscope.analysis.findings import UNREADABLE

if TYPE_CHECKING:
    from gpuscope.analysis.diagnose import Diagnosis
    from gpuscope.analysis.gains import Gains
    from gpuscope.analysis.ranks import RanksReport
    from gpuscope.analysis.sharing import DeviceTimeline

EXIT_OK, EXIT_FAILURE = 0, 1


def explain_path(path: Path, *, as_json: bool, shown_as: str | None = None) -> int:
    """Diagnose every trace under ``path`` and print the reports; the exit code."""
    return explain_paths([path], as_json=as_json, shown_as=shown_as)


@dataclass(frozen=True, slots=True)
class _Explained:
    """One trace file's outcome: its diagnosis, or why nothing could be read in it."""

    source: str
    diagnosis: Diagnosis | None
    unreadable: str = ""  # what was missing, when nothing could be read
    gains: Gains | None = None  # what fixing each finding would buy

    def to_json(self) -> dict[str, Any]:
        if self.diagnosis is None:
            return {"source": self.source, "verdict": UNREADABLE, "unreadable": self.unreadable,
                    "findings": []}
        data = self.diagnosis.to_json()
        if self.gains is not None:
            for finding, shown in zip(self.diagnosis.findings, data["findings"], strict=True):
                shown["gain"] = self.gains.of(finding).to_json()
            if self.gains.together is not None:
                data["gain_together"] = self.gains.together.to_json()
        return data


def explain_paths(paths: list[Path], *, as_json: bool, shown_as: str | None = None) -> int:
    """Diagnose every trace under ``paths`` and print the reports; the exit code: 1 when nothing could
    be read in any trace."""
    from gpuscope.analysis.errors import TraceError
    from gpuscope.analysis.sources import find_traces

    root = paths[0]
    try:
        files = _unique([(path, file) for path in paths for file in find_traces(path)])
        record = _capture_record(root) if len(paths) == 1 else None
        explained, ranks = _explain_files(files, record, shown_as)
    except TraceError as err:
        print(f"gpuscope explain: {err}", file=sys.stderr)
        return EXIT_FAILURE
    except OSError as err:
        print(f"gpuscope explain: {shown_as or root}: {err.strerror or err}", file=sys.stderr)
        return EXIT_FAILURE
    _print_report(paths, explained, ranks, record, as_json=as_json, shown_as=shown_as)
    return EXIT_OK if any(not e.unreadable for e in explained) else EXIT_FAILURE


def _explain_files(files: list[tuple[Path, Path]], record: dict[str, Any] | None,
                   shown_as: str | None) -> tuple[list[_Explained], RanksReport | None]:
    """Each file diagnosed, one trace in memory at a time, and the ranks' comparison when the traces
    are the ranks of one job. A file that cannot be read is reported as such when it is one of several
    (a folder of 64 ranks is not lost to one truncated file); alone, its error is the command's."""
    from gpuscope.analysis.diagnose import diagnose_devices
    from gpuscope.analysis.errors import TraceError
    from gpuscope.analysis.gains import estimate_gains, not_estimated
    from gpuscope.analysis.ranks import RankSummary, compare_ranks, rank_summary
    from gpuscope.analysis.sharing import device_timeline
    from gpuscope.analysis.sources import read_trace

    one_gpu = len(files) > 1 and isinstance(record, dict) and isinstance(record.get("gpu"), int)
    explained: list[_Explained] = []
    timelines: list[DeviceTimeline | None] = []
    summaries: list[RankSummary] = []
    for root, file in files:
        source = _shown(file, root, shown_as)
        try:
            trace = read_trace(file)
        except (TraceError, OSError) as err:
            if len(files) == 1:
                raise
            message = str(err) if isinstance(err, TraceError) else (err.strerror or str(err))
            explained.append(_Explained(source, None, message.removeprefix(f"{file}: ")))
            continue
        # A process that drives several GPUs gets a diagnosis per GPU ("trace [GPU 1]").
        diagnoses = diagnose_devices(trace)
        for of_device in diagnoses:
            shown = source + of_device.source[len(trace.source):]
            diagnosis = replace(of_device, source=shown)
            missing = diagnosis.unreadable  # what it lacked for anything to be read
            # The replay models one GPU's steps: a process that drives several has no gains.
            gains: Gains | None = None
            if not missing:
                gains = (estimate_gains(trace, diagnosis.findings) if len(diagnoses) == 1 else
                         not_estimated(diagnosis.findings, "the replay models the steps of one GPU"))
            explained.append(_Explained(shown, diagnosis, missing, gains))
            if one_gpu:
                timelines.append(device_timeline(trace, shown) if not missing and len(diagnoses) == 1
                                 else None)
        if len(files) > 1 and not one_gpu and len(diagnoses) == 1 and not explained[-1].unreadable:
            summaries.append(rank_summary(trace, explained[-1].diagnosis or diagnoses[0], _name(file, root)))
        del trace  # one trace in memory at a time
    if one_gpu:
        shared = iter(_with_sharing([e.diagnosis for e in explained if e.diagnosis is not None], timelines))
        explained = [replace(e, diagnosis=next(shared)) if e.diagnosis is not None else e for e in explained]
    return explained, compare_ranks(summaries) if summaries else None


def _print_report(paths: list[Path], explained: list[_Explained], ranks: RanksReport | None,
                  record: dict[str, Any] | None, *, as_json: bool, shown_as: str | None) -> None:
    from gpuscope.analysis.render import format_diagnosis, format_ranks
    from gpuscope.capture.alert_context import alert_context

    read = [e.diagnosis for e in explained if e.diagnosis is not None and not e.unreadable]
    verdict = _overall(explained, read, ranks, record)
    # A capture an alert triggered is read beside that alert: which minutes each saw, and whether
    # this verdict accounts for the alert.
    context = alert_context(record, verdict=verdict if read else None) if record is not None else None
    unreadable = [e for e in explained if e.unreadable]
    if as_json:
        shown: Any = (shown_as or str(paths[0])) if len(paths) == 1 else [str(p) for p in paths]
        traces = [e.to_json() for e in explained]
        report: dict[str, Any] = {"path": shown, "verdict": verdict,
                                  "verdicts": {t["source"]: t["verdict"] for t in traces}}
        if context is not None:
            report["alert"] = context.to_json()
        if ranks is not None:
            report["ranks"] = ranks.to_json()
        print(json.dumps({**report, "traces": traces}, indent=2))
        for entry in unreadable:  # stdout stays one JSON document
            print(f"gpuscope explain: {entry.source}: unreadable: {entry.unreadable}", file=sys.stderr)
        return
    blocks = [f"Alert: {context.text}"] if context is not None else []
    if ranks is not None:
        blocks.append(format_ranks(ranks))
    blocks += [format_diagnosis(e.diagnosis, e.gains) if e.diagnosis is not None and not e.unreadable
               else f"{e.source}\n  unreadable: {e.unreadable}" for e in explained]
    if unreadable and read:
        blocks.append(f"{len(unreadable)} of {len(explained)} traces could not be read: "
                      + ", ".join(e.source for e in unreadable))
    print("\n\n".join(blocks))


def _overall(explained: list[_Explained], read: list[Diagnosis], ranks: RanksReport | None,
             record: dict[str, Any] | None) -> str | None:
    """The verdict over all the traces, where there is one: a capture's (its processes were taken
    together, for one reason), a job's (its slowest rank's), or a lone trace's. Unrelated traces have
    their own verdicts and no overall one."""
    from gpuscope.analysis.render import top_finding

    if not read:
        return UNREADABLE
    if record is not None:
        return top_finding(read)
    if ranks is not None:
        return ranks.verdict
    if len(explained) == 1:
        return read[0].verdict
    return None


def _unique(files: list[tuple[Path, Path]]) -> list[tuple[Path, Path]]:
    """Each file once (a file named twice, or inside a folder also named), in order."""
    seen: set[Path] = set()
    out = []
    for root, file in files:
        key = file.resolve()
        if key not in seen:
            seen.add(key)
            out.append((root, file))
    return out


def _name(file: Path, root: Path) -> str:
    """The file's path under the folder named (where a rank number may be, as rank3/trace.json), or
    the file as named."""
    return str(file.relative_to(root)) if file != root else str(file)


def _capture_record(path: Path) -> dict[str, Any] | None:
    """The capture record (capture.json) of a capture's folder; None for any other path. A capture of
    one GPU (its record names the GPU) has traces of processes that share that GPU, compared with
    each other."""
    from gpuscope.capture.records import MAX_RECORD_BYTES, RECORD_FILE
    from gpuscope.common.json_input import JsonInputError, load_json
    from gpuscope.common.unixfs import read_bounded

    if not path.is_dir():
        return None
    try:
        record = load_json(read_bounded(path / RECORD_FILE, MAX_RECORD_BYTES), max_bytes=MAX_RECORD_BYTES)
    except (OSError, JsonInputError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _with_sharing(diagnoses: list[Diagnosis], timelines: list[DeviceTimeline | None]) -> list[Diagnosis]:
    """The diagnoses with what sharing the GPU cost each process."""
    from gpuscope.analysis.findings import rank
    from gpuscope.analysis.sharing import shared_gpu

    out = []
    for diagnosis, (finding, check) in zip(diagnoses, shared_gpu(timelines), strict=True):
        if check is None:
            out.append(diagnosis)
            continue
        findings = diagnosis.findings + ((finding,) if finding is not None else ())
        out.append(replace(diagnosis, findings=tuple(sorted(findings, key=rank)),
                           checks=(*diagnosis.checks, check)))
    return out


def _shown(file: Path, path: Path, shown_as: str | None) -> str:
    """How a trace is named in the report: as the user named it, or, for a downloaded capture (whose
    temporary directory means nothing to the user), as ``capture ID: its path in the capture``."""
    if shown_as is None or file == path:
        return str(file)
    return f"{shown_as}: {file.relative_to(path)}"

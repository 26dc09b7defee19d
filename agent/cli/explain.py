"""`gpuscope explain PATH`: diagnose trace files a user already has, with no agent running.

PATH is a trace file (``.pt.trace.json[.gz]`` from torch.profiler or Kineto, ``.xplane.pb`` from
TensorFlow or JAX) or a directory holding them (a TensorBoard/XProf log directory, a downloaded
capture). Each trace gets its own report; ``--json`` prints them as one JSON document.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuscope.analysis.diagnose import Diagnosis
    from gpuscope.analysis.sharing import DeviceTimeline

EXIT_OK, EXIT_FAILURE = 0, 1


def add_explain_command(subparsers: Any) -> None:
    explain = subparsers.add_parser(
        "explain", help="Diagnose profiler traces: why the device idles (input_bound, host_sync, "
                        "launch_bound ...) and what it is busy with (tensor_cores_idle, costly_op ...).",
        description="Read trace files (PyTorch/Kineto JSON, TensorFlow/JAX XSpace) or a TensorBoard log "
                    "directory, and say where the steps' time went, with the evidence.")
    explain.add_argument("path", type=Path, help="A trace file, or a directory of them.")
    explain.add_argument("--json", action="store_true", help="Print the diagnoses as JSON.")


def run_explain_command(args: argparse.Namespace) -> int:
    return explain_path(args.path, as_json=args.json)


def explain_path(path: Path, *, as_json: bool, shown_as: str | None = None) -> int:
    """Diagnose every trace under ``path`` and print the reports; the exit code."""
    from gpuscope.analysis.diagnose import diagnose
    from gpuscope.analysis.errors import TraceError
    from gpuscope.analysis.render import format_diagnosis, top_finding
    from gpuscope.analysis.sharing import device_timeline
    from gpuscope.analysis.sources import find_traces, read_trace
    from gpuscope.capture.alert_context import alert_context

    try:
        files = find_traces(path)
        record = _capture_record(path)
        one_gpu = len(files) > 1 and isinstance(record, dict) and isinstance(record.get("gpu"), int)
        diagnoses = []
        timelines: list[DeviceTimeline | None] = []
        for file in files:
            trace = read_trace(file)
            source = _shown(file, path, shown_as)
            diagnoses.append(replace(diagnose(trace), source=source))
            if one_gpu:
                timelines.append(device_timeline(trace, source))
            del trace  # one trace in memory at a time
        if one_gpu:
            diagnoses = _with_sharing(diagnoses, timelines)
    except TraceError as err:
        print(f"gpuscope explain: {err}", file=sys.stderr)
        return EXIT_FAILURE
    except OSError as err:
        print(f"gpuscope explain: {shown_as or path}: {err.strerror or err}", file=sys.stderr)
        return EXIT_FAILURE
    verdict = top_finding(diagnoses)
    # A capture an alert triggered is read beside that alert: which minutes each saw, and whether
    # this verdict accounts for the alert.
    context = alert_context(record, verdict=verdict) if record is not None else None
    if as_json:
        report: dict[str, Any] = {"path": shown_as or str(path), "verdict": verdict}
        if context is not None:
            report["alert"] = context.to_json()
        print(json.dumps({**report, "traces": [d.to_json() for d in diagnoses]}, indent=2))
    else:
        intro = f"Alert: {context.text}\n\n" if context is not None else ""
        print(intro + "\n\n".join(format_diagnosis(d) for d in diagnoses))
    return EXIT_OK


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

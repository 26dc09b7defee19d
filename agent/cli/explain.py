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
from typing import Any

EXIT_OK, EXIT_FAILURE = 0, 1


def add_explain_command(subparsers: Any) -> None:
    explain = subparsers.add_parser(
        "explain", help="Diagnose profiler traces: input-bound, host-sync-bound, launch-bound, idle.",
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
    from gpuscope.analysis.sources import find_traces, read_trace

    try:
        files = find_traces(path)
        diagnoses = [replace(diagnose(read_trace(file)), source=_shown(file, path, shown_as))
                     for file in files]
    except TraceError as err:
        print(f"gpuscope explain: {err}", file=sys.stderr)
        return EXIT_FAILURE
    except OSError as err:
        print(f"gpuscope explain: {shown_as or path}: {err.strerror or err}", file=sys.stderr)
        return EXIT_FAILURE
    if as_json:
        print(json.dumps({"path": shown_as or str(path), "verdict": top_finding(diagnoses),
                          "traces": [d.to_json() for d in diagnoses]}, indent=2))
    else:
        print("\n\n".join(format_diagnosis(d) for d in diagnoses))
    return EXIT_OK


def _shown(file: Path, path: Path, shown_as: str | None) -> str:
    """How a trace is named in the report: as the user named it, or, for a downloaded capture (whose
    temporary directory means nothing to the user), as ``capture ID: its path in the capture``."""
    if shown_as is None or file == path:
        return str(file)
    return f"{shown_as}: {file.relative_to(path)}"

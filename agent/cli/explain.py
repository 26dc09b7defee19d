"""`gpuscope explain PATH...`: diagnose trace files a user already has, with no agent running.

PATH is a trace file (``.pt.trace.json[.gz]`` from torch.profiler or Kineto, ``.xplane.pb`` from
TensorFlow or JAX) or a directory holding them (a TensorBoard/XProf log directory, a downloaded
capture). Each trace gets its own report; ``--json`` prints them as one JSON document.

There is a verdict over all the traces only where they belong together: the processes of one
capture, or the ranks of one job (whose verdict is that of the rank the others wait for, beside the
ranks' comparison). Unrelated traces each keep their own. A trace in which nothing could be read says
what it lacked; when that is every trace, the command fails.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gpuscope.capture.explanation import explain_path, explain_paths

__all__ = ["add_explain_command", "explain_path", "explain_paths", "run_explain_command"]


def add_explain_command(subparsers: Any) -> None:
    explain = subparsers.add_parser(
        "explain", help="Diagnose profiler traces: why the device idles (input_bound, host_sync, "
                        "launch_bound ...) and what it is busy with (tensor_cores_idle, costly_op ...).",
        description="Read trace files (PyTorch/Kineto JSON, TensorFlow/JAX XSpace) or a TensorBoard log "
                    "directory, and say where the steps' time went, with the evidence. The traces of "
                    "the ranks of one job are also compared: which rank the others wait for.")
    explain.add_argument("path", type=Path, nargs="+", help="A trace file, or a directory of them.")
    explain.add_argument("--json", action="store_true", help="Print the diagnoses as JSON.")


def run_explain_command(args: argparse.Namespace) -> int:
    return explain_paths(args.path, as_json=args.json)

#!/usr/bin/env python3
"""Cut a Kineto (PyTorch profiler) trace down to a few training steps, for a test fixture.

    scripts/trim_trace.py IN.pt.trace.json.gz OUT.pt.trace.json.gz --steps 6 [--skip 20]

The steps are counted as the diagnosis counts them: ``ProfilerStep#N`` spans, else PyTorch's
``Optimizer.step#...`` annotations (a step ends where one ends). The window runs from the end of the
``skip``-th boundary to the end of ``steps`` more, with a millisecond on either side; every complete
event that overlaps it is kept (an operation that began before it still encloses its launches), and
the launch calls of its kernels wherever they are, with the operators around them (the host runs
ahead of the device by several steps). Skip the first steps of a capture: their kernels were launched
before the recording began, so no launch ties them to an operation. Only the fields the diagnosis
reads are kept (name, category, times, thread or stream, and the arguments ``correlation``,
``stream``, ``blocks per SM``, ``External id``); flow events, Kineto's own overhead spans and GPU-side
annotations are dropped; the top-level keys (``deviceProperties``, ``distributedInfo``,
``baseTimeNanoseconds`` ...) are kept as they are. Traces of PyTorch 1.8 and 1.9, whose categories are
capitalised (``Operator``, ``Runtime``, ``Kernel``, ``Memcpy``, ``Memset``, ``Trace``, ``Python``),
are trimmed the same way and keep their category names; their lowercase ``external id`` argument is
kept too.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from bisect import bisect_left
from pathlib import Path
from typing import Any

# PyTorch 1.8 and 1.9 (Kineto's first versions) named the categories with capitals.
OLD_CATEGORIES = {"Operator", "Runtime", "Kernel", "Memcpy", "Memset", "Trace", "Python"}
KEPT_CATEGORIES = {"cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver", "kernel",
                   "gpu_memcpy", "gpu_memset"} | OLD_CATEGORIES
CALL_CATEGORIES = {"cuda_runtime", "cuda_driver", "Runtime"}
DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"}
OPERATOR_CATEGORIES = {"cpu_op", "Operator"}
KEPT_ARGS = ("correlation", "stream", "blocks per SM", "External id", "external id", "device")
MARGIN_US = 1000.0


def boundaries(events: list[dict[str, Any]]) -> list[float]:
    """Where steps end: ProfilerStep ends, else optimizer step ends."""
    host = [e for e in events
            if e.get("ph") == "X" and e.get("cat") in ("user_annotation", "cpu_op", "Operator")]
    steps = [e for e in host if re.fullmatch(r"ProfilerStep#\d+", str(e.get("name")))]
    if not steps:
        steps = [e for e in host if str(e.get("name")).startswith("Optimizer.step#")]
    return sorted(float(e["ts"]) + float(e.get("dur", 0)) for e in steps)


def slim(event: dict[str, Any]) -> dict[str, Any]:
    args = event.get("args") or {}
    kept = {key: event[key] for key in ("ph", "cat", "name", "pid", "tid", "ts", "dur") if key in event}
    kept["args"] = {key: args[key] for key in KEPT_ARGS if key in args}
    return kept


def overlaps(event: dict[str, Any], first: float, last: float) -> bool:
    start = float(event.get("ts", 0))
    return start <= last and start + float(event.get("dur", 0)) >= first


def trim(document: dict[str, Any], steps: int, skip: int) -> dict[str, Any]:
    events = document["traceEvents"]
    ends = boundaries(events)
    if len(ends) < skip + steps + 1:
        raise SystemExit(f"the trace has {max(len(ends) - 1, 0)} whole steps; asked for {skip} + {steps}")
    first, last = ends[skip] - MARGIN_US, ends[skip + steps] + MARGIN_US
    complete = [e for e in events if e.get("ph") == "X" and e.get("cat") in KEPT_CATEGORIES]
    kept = [e for e in complete if overlaps(e, first, last)]
    # The host runs ahead of the device, by thousands of launches: the launch calls of the kernels kept
    # are kept wherever they are, and the operators around them, so that each kernel keeps its operation.
    launched = {e["args"]["correlation"] for e in kept
                if e["cat"] in DEVICE_CATEGORIES and "correlation" in (e.get("args") or {})}
    calls = [e for e in complete if e["cat"] in CALL_CATEGORIES and not overlaps(e, first, last)
             and (e.get("args") or {}).get("correlation") in launched]
    at: dict[Any, list[float]] = {}
    for call in calls:
        at.setdefault(call.get("tid"), []).append(float(call["ts"]))
    for times in at.values():
        times.sort()
    around = []
    for event in complete:
        if (event["cat"] not in OPERATOR_CATEGORIES or overlaps(event, first, last)
                or event.get("tid") not in at):
            continue
        times, start = at[event.get("tid")], float(event["ts"])
        i = bisect_left(times, start)
        if i < len(times) and times[i] <= start + float(event.get("dur", 0)):
            around.append(event)
    metadata = [e for e in events if e.get("ph") == "M"]
    trimmed = metadata + [slim(e) for e in kept + calls + around]
    return {**{k: v for k, v in document.items() if k != "traceEvents"}, "traceEvents": trimmed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip", type=int, default=20, help="whole steps left out at the start")
    args = parser.parse_args(argv)
    opener = gzip.open if args.source.name.endswith(".gz") else open
    with opener(args.source, "rt", encoding="utf-8") as file:
        document = json.load(file)
    trimmed = trim(document, args.steps, args.skip)
    text = json.dumps(trimmed, separators=(",", ":"))
    if args.target.name.endswith(".gz"):
        with gzip.GzipFile(args.target, "wb", compresslevel=9, mtime=0) as out:
            out.write(text.encode())
    else:
        args.target.write_text(text)
    print(f"{args.target}: {len(trimmed['traceEvents'])} events, {len(text) / 2**20:.1f} MiB of JSON, "
          f"{args.target.stat().st_size / 2**10:.0f} KiB on disk", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

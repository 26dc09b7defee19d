#!/usr/bin/env python3
"""Measure a profiler trace by hand, independently of gpuscope's diagnosis, for the trace corpus.

    scripts/measure_trace.py TRACE [TRACE ...] [--json]

A Kineto (PyTorch profiler) JSON trace, gzipped or not, in the current format (lowercase categories
``kernel``, ``cuda_runtime``, ``cpu_op``) or the PyTorch 1.8/1.9 one (``Kernel``, ``Runtime``,
``Operator``, ``Memcpy``, ``Memset``). An XSpace (``.xplane.pb``, TensorFlow or JAX) is measured when
the generated protobuf message module can be imported (``gpuscope.generated.tsl.xplane_pb2``: only the
message definition is used, nothing of the diagnosis); otherwise only its size is reported.

Steps: ``ProfilerStep#N`` spans (the outermost ones, without a step at either edge shorter than half
the median), else the intervals between the ends of ``Optimizer.step#...`` annotations, else the
whole trace as one step. Every share is of the steps' wall time, from the first step's start to the
last one's end, per device (a process and device id; for an XSpace a GPU plane), then averaged over
the devices that ran anything:

- busy: the union of kernel, memcpy and memset intervals;
- communication: collective kernel time (NCCL and other all-reduce / all-gather kernels) that no
  other kernel of the same device overlaps;
- input: device idle time while a data loader's ``__next__`` (or ``enumerate(DataLoader)``) runs;
- sync: host time in cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize and
  synchronous cudaMemcpy calls;
- launch_gaps: device idle time in gaps shorter than 1 ms after which the next kernel's launch call
  returned only after the previous kernel had ended (the host was behind the device).

It also lists the top kernels by device time, the kernel count and median duration, and the median
and 90th percentile of the delay from a launch call's start to its kernel's start. Standard library
only.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import sys
from collections import Counter, defaultdict
from itertools import pairwise
from pathlib import Path
from typing import Any

OLD_CATEGORIES = {"Kernel": "kernel", "Memcpy": "gpu_memcpy", "Memset": "gpu_memset",
                  "Runtime": "cuda_runtime", "Operator": "cpu_op", "Python": "python_function"}
DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
COLLECTIVE = re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter|alltoall|all_to_all|"
                        r"multimem|cross_device_reduce|rccl", re.IGNORECASE)
INPUT_OP = re.compile(r"enumerate\(DataLoader\)|DataLoader.*__next__|dataloader", re.IGNORECASE)
SYNC_CALL = re.compile(r"^(cuda|hip)(StreamSynchronize|DeviceSynchronize|EventSynchronize|Memcpy)$")
LAUNCH_CALL = re.compile(r"LaunchKernel|cuLaunch|hipLaunch|hipExtModuleLaunch|cudaMemcpyAsync|"
                         r"cudaMemsetAsync|cudaGraphLaunch|hipGraphLaunch|cudaMemcpy$|hipMemcpy")
SHORT_GAP_US = 1000.0


# ----------------------------------------------------------------------------- intervals

def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def clip(intervals: list[tuple[float, float]], first: float, last: float) -> list[tuple[float, float]]:
    return [(max(a, first), min(b, last)) for a, b in intervals if b > first and a < last]


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def subtract(base: list[tuple[float, float]], cut: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """base minus cut, both unions (sorted, disjoint)."""
    out: list[tuple[float, float]] = []
    j = 0
    for a, b in base:
        start = a
        while j < len(cut) and cut[j][1] <= start:
            j += 1
        k = j
        while k < len(cut) and cut[k][0] < b:
            if cut[k][0] > start:
                out.append((start, cut[k][0]))
            start = max(start, cut[k][1])
            k += 1
        if start < b:
            out.append((start, b))
    return out


def intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


# ----------------------------------------------------------------------------- steps

def whole_only(steps: list[tuple[float, float]]) -> list[tuple[float, float]]:
    if len(steps) < 2:
        return steps
    floor = statistics.median(b - a for a, b in steps) / 2
    first, last = 0, len(steps)
    while last - first > 1 and steps[first][1] - steps[first][0] < floor:
        first += 1
    while last - first > 1 and steps[last - 1][1] - steps[last - 1][0] < floor:
        last -= 1
    return steps[first:last]


Interval = tuple[float, float]


def find_steps(host: list[dict[str, Any]], span: Interval) -> tuple[str, list[Interval]]:
    marked = sorted((e["ts"], e["ts"] + e["dur"]) for e in host
                    if re.fullmatch(r"ProfilerStep#\d+", e["name"]))
    outer: list[tuple[float, float]] = []
    for start, end in marked:
        if outer and start < outer[-1][1]:
            continue
        outer.append((start, end))
    if outer:
        return "ProfilerStep", whole_only(outer)
    ends = sorted(e["ts"] + e["dur"] for e in host if e["name"].startswith("Optimizer.step#"))
    if len(ends) >= 2:
        return "Optimizer.step", whole_only(list(pairwise(ends)))
    return "whole", [span]


# ----------------------------------------------------------------------------- Kineto JSON

def load_json(path: Path) -> Any:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as file:
        return json.load(file)


def device_key(event: dict[str, Any]) -> tuple[Any, Any]:
    args = event.get("args") or {}
    return (event.get("pid"), args.get("device", args.get("Device")))


def measure_kineto(path: Path) -> dict[str, Any]:
    document = load_json(path)
    raw = document.get("traceEvents", []) if isinstance(document, dict) else document
    meta = document if isinstance(document, dict) else {}
    events = []
    for e in raw:
        if not isinstance(e, dict) or e.get("ph") != "X" or "ts" not in e:
            continue
        cat = OLD_CATEGORIES.get(e.get("cat"), e.get("cat"))
        events.append({**e, "cat": cat, "ts": float(e["ts"]), "dur": float(e.get("dur", 0) or 0),
                       "name": str(e.get("name", ""))})
    device = [e for e in events if e["cat"] in DEVICE_CATEGORIES]
    host = [e for e in events if e["cat"] in ("cpu_op", "user_annotation")]
    calls = [e for e in events if e["cat"] in ("cuda_runtime", "cuda_driver")]
    everything = device + host + calls
    span = (min((e["ts"] for e in everything), default=0.0),
            max((e["ts"] + e["dur"] for e in everything), default=0.0))
    method, steps = find_steps(host, span)
    first, last = steps[0][0], steps[-1][1]
    window = max(last - first, 0.0)
    result: dict[str, Any] = {
        "file": str(path), "format": "kineto", "events": len(raw),
        "gpus": [(p.get("name"), f"{p.get('computeMajor')}.{p.get('computeMinor')}")
                 for p in meta.get("deviceProperties") or []],
        "distributed": {k: (meta.get("distributedInfo") or {}).get(k)
                        for k in ("rank", "world_size", "backend")},
        "step_method": method, "steps": len(steps), "step_ms": round(window / max(len(steps), 1) / 1000, 3),
        "window_ms": round(window / 1000, 3),
    }
    if window <= 0:
        return result
    per_device: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in device:
        per_device[device_key(e)].append(e)
    input_spans = union(clip([(e["ts"], e["ts"] + e["dur"]) for e in host if INPUT_OP.search(e["name"])],
                             first, last))
    # A device-to-host copy's call (cudaMemcpyAsync after .item(), nonzero ...) waits for the copy.
    d2h = {(e.get("args") or {}).get("correlation") for e in device
           if e["cat"] == "gpu_memcpy" and re.search(r"DtoH|D2H", e["name"])}
    blocking = [e for e in calls if SYNC_CALL.match(e["name"])
                or ("Memcpy" in e["name"] and (e.get("args") or {}).get("correlation") in d2h)]
    sync_spans = union(clip([(e["ts"], e["ts"] + e["dur"]) for e in blocking], first, last))
    launches = {(e.get("args") or {}).get("correlation"): e for e in calls if LAUNCH_CALL.search(e["name"])}
    shares: dict[str, list[float]] = defaultdict(list)
    delays: list[float] = []
    for events_of_device in per_device.values():
        inside = [e for e in events_of_device if e["ts"] < last and e["ts"] + e["dur"] > first]
        if not inside:
            continue
        busy = union(clip([(e["ts"], e["ts"] + e["dur"]) for e in inside], first, last))
        kernels = [e for e in inside if e["cat"] == "kernel"]
        collective = union(clip([(e["ts"], e["ts"] + e["dur"]) for e in kernels
                                 if COLLECTIVE.search(e["name"])], first, last))
        compute = union(clip([(e["ts"], e["ts"] + e["dur"]) for e in kernels
                              if not COLLECTIVE.search(e["name"])], first, last))
        idle = subtract([(first, last)], busy)
        shares["busy"].append(length(busy) / window)
        shares["communication"].append(length(subtract(collective, compute)) / window)
        shares["input"].append(length(intersect(idle, input_spans)) / window)
        # gaps where the host was behind: the next kernel's launch call returned after the device went idle
        ordered = sorted(kernels, key=lambda e: e["ts"])
        behind = 0.0
        for gap_start, gap_end in idle:
            if gap_end - gap_start >= SHORT_GAP_US:
                continue
            nxt = next((e for e in ordered if e["ts"] >= gap_end - 0.5), None)
            call = launches.get((nxt.get("args") or {}).get("correlation")) if nxt else None
            if call and call["ts"] + call["dur"] > gap_start:
                behind += gap_end - gap_start
        shares["launch_gaps"].append(behind / window)
        for e in kernels:
            call = launches.get((e.get("args") or {}).get("correlation"))
            if call:
                delays.append(e["ts"] - call["ts"])
    result.update({key: round(statistics.fmean(values), 4) for key, values in shares.items()})
    result["devices"] = len(shares["busy"])
    result["sync"] = round(length(sync_spans) / window, 4)
    result["sync_calls"] = Counter(e["name"] for e in blocking if first <= e["ts"] <= last)
    in_window = [e for e in device if e["cat"] == "kernel" and first <= e["ts"] <= last]
    total = sum(e["dur"] for e in device if first <= e["ts"] <= last) or 1.0
    by_name: Counter[str] = Counter()
    for e in in_window:
        by_name[e["name"]] += e["dur"]
    result["kernels"] = len(in_window)
    result["kernel_median_us"] = (round(statistics.median(e["dur"] for e in in_window), 2)
                                  if in_window else None)
    result["top_kernels"] = [(round(t / total, 3), name[:110]) for name, t in by_name.most_common(6)]
    memcpy = Counter()
    for e in device:
        if e["cat"] != "kernel" and first <= e["ts"] <= last:
            memcpy[e["name"][:40]] += e["dur"]
    result["copies"] = [(round(t / total, 3), name) for name, t in memcpy.most_common(3)]
    if delays:
        delays.sort()
        result["launch_delay_us"] = {"median": round(statistics.median(delays), 1),
                                     "p90": round(delays[int(0.9 * (len(delays) - 1))], 1)}
    top_ops: Counter[str] = Counter()
    for e in host:
        if first <= e["ts"] <= last and not e["name"].startswith("ProfilerStep"):
            top_ops[e["name"][:60]] += e["dur"]
    result["top_host_ops_ms"] = [(name, round(t / 1000, 2)) for name, t in top_ops.most_common(6)]
    return result


# ----------------------------------------------------------------------------- XSpace

NON_ACTIVITY_LINES = ("TensorFlow Ops", "TensorFlow Name Scope", "Steps", "XLA Ops", "XLA Modules",
                      "Launch Stats", "Source", "Framework Ops", "Framework Name Scope", "XLA TraceMe")


def measure_xspace(path: Path) -> dict[str, Any]:
    result: dict[str, Any] = {"file": str(path), "format": "xspace", "bytes": path.stat().st_size}
    try:
        from gpuscope.generated.tsl import xplane_pb2  # the message definition only
    except ImportError:
        return result
    space = xplane_pb2.XSpace()
    space.ParseFromString(path.read_bytes())
    result["hosts"] = list(space.hostnames)
    planes = [p for p in space.planes if p.name.startswith("/device:GPU:")]
    gpus = []
    shares: dict[str, list[float]] = defaultdict(list)
    by_name: Counter[str] = Counter()
    windows = []
    for plane in planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
        stats = {stat_names.get(s.metadata_id): (s.str_value or s.int64_value or s.uint64_value
                                                 or s.double_value) for s in plane.stats}
        gpus.append((plane.name, f"{stats.get('compute_cap_major')}.{stats.get('compute_cap_minor')}",
                     stats.get("core_count")))
        step_spans: list[tuple[float, float]] = []
        spans: list[tuple[float, float, str]] = []
        for line in plane.lines:
            base = line.timestamp_ns * 1000.0  # picoseconds
            found = [((base + ev.offset_ps) / 1e6, (base + ev.offset_ps + ev.duration_ps) / 1e6,
                      names.get(ev.metadata_id, "")) for ev in line.events]
            if line.name == "Steps":
                step_spans.extend((a, b) for a, b, _ in found)
            elif not line.name.startswith(NON_ACTIVITY_LINES):
                spans.extend(found)
        if not spans:
            continue
        steps = whole_only(sorted(set(step_spans))) if step_spans else []
        first = steps[0][0] if steps else min(a for a, _, _ in spans)
        last = steps[-1][1] if steps else max(b for _, b, _ in spans)
        window = last - first
        if window <= 0:
            continue
        windows.append((window, max(len(steps), 1), "Steps line" if steps else "whole"))
        busy = union(clip([(a, b) for a, b, _ in spans], first, last))
        collective = union(clip([(a, b) for a, b, n in spans if COLLECTIVE.search(n)], first, last))
        compute = union(clip([(a, b) for a, b, n in spans if not COLLECTIVE.search(n)], first, last))
        shares["busy"].append(length(busy) / window)
        shares["communication"].append(length(subtract(collective, compute)) / window)
        for a, b, n in spans:
            if first <= a <= last:
                by_name[n] += b - a
    result["gpus"] = gpus
    if not windows:
        result["devices"] = 0
        return result
    result.update({"step_method": windows[0][2], "steps": windows[0][1],
                   "step_ms": round(statistics.fmean(w / n for w, n, _ in windows) / 1000, 3)})
    total = sum(by_name.values()) or 1.0
    result.update({key: round(statistics.fmean(values), 4) for key, values in shares.items()})
    result["busy_per_device"] = [round(v, 4) for v in shares["busy"]]
    result["devices"] = len(shares["busy"])
    result["top_kernels"] = [(round(t / total, 3), n[:110]) for n, t in by_name.most_common(6)]
    return result


def measure(path: Path) -> dict[str, Any]:
    if path.name.endswith(".xplane.pb"):
        return measure_xspace(path)
    return measure_kineto(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--json", action="store_true", help="one JSON object per trace")
    args = parser.parse_args(argv)
    for path in args.traces:
        result = measure(path)
        if args.json:
            print(json.dumps(result, default=str))
            continue
        print(f"== {path}")
        for key, value in result.items():
            if key in ("top_kernels", "top_host_ops_ms"):
                print(f"  {key}:")
                for item in value:
                    print(f"      {item}")
            elif key != "file":
                print(f"  {key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

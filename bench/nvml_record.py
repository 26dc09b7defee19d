"""Record what a real NVML library answers to the agent's calls, as a fixture for the tests.

    python bench/nvml_record.py --out tests/fixtures/nvml/NAME.json [--reads 8] [--interval 1]
                                [--nvml-lib DIR] [--note TEXT]

Runs the agent's NVML boundary (``gpuscope.nvml.boundary.Nvml``) in this process against the node's
``libnvidia-ml.so.1`` (or the one in ``--nvml-lib DIR``): start, the driver version, the GPUs, then
``--reads`` readings of every GPU ``--interval`` seconds apart, then one Xid event set with a 200 ms
wait. Underneath pynvml, every C function it calls goes through a recorder that keeps, per call, the
function's name, its arguments (values passed by value; the size of each buffer passed by
reference), the bytes each buffer holds once the call returns, the return code and how long the call
took. ``tests/nvml_replay.py`` plays such a file back under the real pynvml, so that the tests run the
boundary's decoding on a real driver's bytes: its struct versions, sample value types, GPM results,
PCIe field values and process lists, none of which a fake written from the headers can vouch for.

Next to the calls the file holds what ``nvidia-smi`` says of the same GPUs and processes (an
independent reading to test the decoded values against) and the readings the boundary made here.

Run it with some work on the GPU (a training job, or any CUDA program that keeps it partly busy) so
that processes, per-process samples and GPM activity are recorded too.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

FORMAT = 1


def describe_argument(arg: Any) -> tuple[list[Any], Any]:
    """(how the argument is matched on replay, the ctypes object whose bytes are the output or None).

    By value: ``["null"]``, ``["int", n]``, ``["bytes", hex]``, ``["value", hex]`` (a ctypes scalar or
    an opaque handle). By reference: ``["ref", size]``, a buffer whose bytes are kept after the call.
    """
    if arg is None:
        return ["null"], None
    if isinstance(arg, bool | int):
        return ["int", int(arg)], None
    if isinstance(arg, bytes):
        return ["bytes", arg.hex()], None
    if isinstance(arg, str):
        return ["bytes", arg.encode().hex()], None
    if type(arg).__name__ == "CArgObject":  # byref(obj)
        obj = arg._obj
        return ["ref", ctypes.sizeof(obj)], obj
    if isinstance(arg, ctypes._Pointer):
        if ctypes.sizeof(arg._type_) and arg:
            return ["ref", ctypes.sizeof(arg._type_)], arg.contents
        return ["value", bytes(arg).hex()], None  # an opaque handle: its address
    if isinstance(arg, ctypes._SimpleCData):
        return ["value", bytes(arg).hex()], None
    if isinstance(arg, ctypes.Array | ctypes.Structure | ctypes.Union):
        return ["ref", ctypes.sizeof(arg)], arg
    raise TypeError(f"cannot record an argument of type {type(arg).__name__}")


class RecordingFunction:
    """One C function of the library: calls it and appends what it did to ``calls``. Attributes that
    pynvml sets on a function (``restype``) reach the real one."""

    def __init__(self, name: str, function: Any, calls: list[dict[str, Any]]) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_function", function)
        object.__setattr__(self, "_calls", calls)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._function, name, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._function, name)

    def __call__(self, *args: Any) -> Any:
        described = [describe_argument(arg) for arg in args]
        started = time.perf_counter_ns()
        result = self._function(*args)
        elapsed = time.perf_counter_ns() - started
        returned: Any = result.hex() if isinstance(result, bytes) else result
        self._calls.append({
            "fn": self._name,
            "args": [match for match, _ in described],
            # Trailing zero bytes are left out (a replay writes zeros there): most of a GPM request is.
            "out": [None if obj is None else bytes(obj).rstrip(b"\0").hex() for _, obj in described],
            "rc": returned,
            "ns": elapsed,
        })
        return result


class RecordingLibrary:
    """The NVML library as pynvml sees it (``pynvml.nvmlLib``), every function recorded."""

    def __init__(self, library: Any) -> None:
        self._library = library
        self.calls: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> RecordingFunction:
        if name.startswith("_"):
            raise AttributeError(name)
        return RecordingFunction(name, getattr(self._library, name), self.calls)


def nvidia_smi(*query: str) -> list[str] | None:
    """nvidia-smi's CSV answer (no header, no units), one line per row; None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True,
                          text=True, timeout=30, check=False)
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def record(library: Any, reads: int, interval: float, clock: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """Run the boundary on ``library`` (what pynvml calls: a loaded libnvidia-ml.so.1, or the
    simulator's) with every call recorded; pynvml is left on ``library`` afterwards."""
    import pynvml

    from gpuscope.nvml.boundary import Nvml

    recorder = RecordingLibrary(library)
    with pynvml.libLoadLock:
        pynvml.nvmlLib = recorder
        pynvml._nvmlGetFunctionPointer_cache.clear()
    try:
        nvml = Nvml(clock=clock)
        nvml.init()
        driver = nvml.driver_version()
        devices = nvml.devices()
        smi_apps_before = nvidia_smi("--query-compute-apps=gpu_uuid,pid,used_memory")
        readings: list[list[dict[str, Any]]] = []
        for n in range(reads):
            if n:
                sleep(interval)
            readings.append([dataclasses.asdict(nvml.read(device)) for device in devices])
        event_set = nvml.xid_event_set(devices)
        xid_wait_s = None
        if event_set is not None:
            started = time.monotonic()
            nvml.wait_xid(event_set, devices, 200)
            xid_wait_s = round(time.monotonic() - started, 3)
            nvml.free_event_set(event_set)
        nvml.shutdown()
    finally:
        with pynvml.libLoadLock:
            pynvml.nvmlLib = library
            pynvml._nvmlGetFunctionPointer_cache.clear()
    return {
        "format": FORMAT,
        "recorded": time.strftime("%Y-%m-%d", time.gmtime()),
        "nvidia_ml_py": metadata.version("nvidia-ml-py"),
        "driver_version": driver,
        "read_interval_s": interval,
        "health_readings": True,  # each read took the health and throttle readings too
        "xid_wait_200ms_took_s": xid_wait_s,
        "devices": [dataclasses.asdict(device.identity) for device in devices],
        "nvidia_smi": {
            "gpus": nvidia_smi("--query-gpu=index,uuid,name,pci.bus_id,memory.total,power.limit,"
                               "ecc.errors.uncorrected.volatile.total"),
            "compute_apps_before": smi_apps_before,
            "compute_apps_after": nvidia_smi("--query-compute-apps=gpu_uuid,pid,used_memory"),
        },
        "readings": readings,
        "calls": recorder.calls,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="the JSON file to write")
    parser.add_argument("--reads", type=int, default=8, help="readings of every GPU (default 8)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between readings (default 1)")
    parser.add_argument("--nvml-lib", metavar="DIR", help="directory holding the libnvidia-ml.so.1 to use")
    parser.add_argument("--note", default="", help="what ran on the GPUs, kept in the file")
    args = parser.parse_args()
    if args.reads < 2:
        parser.error("--reads must be at least 2 (GPM ratios need two samples)")
    if args.nvml_lib and os.environ.get("_GPUSCOPE_RECORD_LIB") != args.nvml_lib:
        # The dynamic loader reads LD_LIBRARY_PATH when the process starts: run again with it set.
        lib = str(Path(args.nvml_lib).resolve())
        env = {**os.environ, "_GPUSCOPE_RECORD_LIB": args.nvml_lib,
               "LD_LIBRARY_PATH": os.pathsep.join(p for p in (lib, os.environ.get("LD_LIBRARY_PATH")) if p)}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    from gpuscope.nvml.boundary import NvmlUnavailable

    try:
        library = ctypes.CDLL("libnvidia-ml.so.1")
        fixture = record(library, args.reads, args.interval)
    except (OSError, NvmlUnavailable) as err:
        raise SystemExit(f"NVML is not available ({err}): is DIR/libnvidia-ml.so.1 there, or a driver "
                         "installed?") from None
    fixture["note"] = args.note
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, indent=1) + "\n", encoding="utf-8")
    calls = fixture["calls"]
    print(f"{len(fixture['devices'])} GPU(s), driver {fixture['driver_version']}, {len(calls)} calls "
          f"recorded to {args.out} ({args.out.stat().st_size / 1024:.0f} KiB); Xid wait of 200 ms took "
          f"{fixture['xid_wait_200ms_took_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

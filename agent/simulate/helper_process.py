"""A stand-in for a training process: a real pid whose name (what psutil reports) the scenario chose,
and which a profiler capture can trace.

Started by the simulator as ``python -m gpuscope.simulate.helper_process --name NAME [--work SPEC]
[--kineto-daemon ADDRESS]``. It renames itself with prctl(PR_SET_NAME), asks the kernel to SIGTERM it
when its parent goes away (PR_SET_PDEATHSIG) so that it never outlives the simulation, and prints
``ready``.

With ``--kineto-daemon`` it polls that Kineto daemon (the agent's: ``@dynolog`` or a socket file) as a
PyTorch process started with ``KINETO_USE_DAEMON=1`` does, so the agent can capture it. On a trace
config it works for the requested time, following ``--work`` (its GPU's utilization pattern in the
scenario, ``work_shape``), and writes the Chrome trace of what it did (``traced_work``). Otherwise it
only waits. The simulator writes ``origin <seconds>`` to its standard input once the scenario's clock
starts (a ``time.monotonic()`` reading, the same clock in every process), so that its steps line up
with the simulated GPU's.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from typing import TextIO

from gpuscope.simulate.kineto_client import KinetoClient, TraceRequest
from gpuscope.simulate.traced_work import TracedWork, chrome_trace, write_trace
from gpuscope.simulate.work_shape import WorkShape

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
MAX_NAME_BYTES = 15  # the kernel's comm field holds 15 bytes plus the terminating NUL

log = logging.getLogger("gpuscope.simulate.helper_process")


def _prctl(libc: ctypes.CDLL, option: int, arg: int | bytes) -> None:
    # prctl is variadic over unsigned longs: pass each argument at full width explicitly.
    value = ctypes.c_char_p(arg) if isinstance(arg, bytes) else ctypes.c_ulong(arg)
    zero = ctypes.c_ulong(0)
    if libc.prctl(ctypes.c_int(option), value, zero, zero, zero) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}) failed: {os.strerror(err)}")


class ScenarioOrigin:
    """The monotonic time at which the scenario started: this process's start until the simulator
    says (``origin <seconds>`` on standard input)."""

    def __init__(self) -> None:
        self._value = time.monotonic()

    def get(self) -> float:
        return self._value

    def follow(self, stream: TextIO) -> None:
        for line in stream:
            word, _, value = line.partition(" ")
            if word == "origin":
                try:
                    self._value = float(value)
                except ValueError:
                    log.warning("ignored a malformed origin line: %r", line[:80])


def record(request: TraceRequest, work: TracedWork, name: str) -> None:
    """Work as the trace config asks and write the trace of it."""
    if request.warmup_s:
        time.sleep(request.warmup_s)
    started = time.time_ns()
    spans = work.run(request.duration_s)
    ended = time.time_ns()
    path = request.trace_path(os.getpid())
    write_trace(path, chrome_trace(spans, process_name=name, started_ns=started, ended_ns=ended,
                                   trace_name=str(path)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", required=True, help="process name, at most 15 bytes")
    parser.add_argument("--parent", type=int, default=0, help="pid of the simulator (exit if it is gone)")
    parser.add_argument("--work", default="{}", help="work spec (JSON) from the scenario: see work_shape")
    parser.add_argument("--kineto-daemon", metavar="ADDRESS",
                        help="poll this Kineto daemon (@dynolog, or a socket file's path) to be capturable")
    args = parser.parse_args(argv)
    try:
        shape = WorkShape(json.loads(args.work))
    except ValueError as err:
        parser.error(f"--work: {err}")
    logging.basicConfig(level=logging.WARNING,
                        format=f"simulated process {args.name} (pid {os.getpid()}): %(message)s")
    libc = ctypes.CDLL(None, use_errno=True)
    _prctl(libc, PR_SET_PDEATHSIG, signal.SIGTERM)
    if args.parent and os.getppid() != args.parent:
        return 0  # the simulator died before the death signal was armed
    _prctl(libc, PR_SET_NAME, args.name.encode()[:MAX_NAME_BYTES])
    # Ctrl-C in a terminal reaches the whole process group; the simulator stops us with SIGTERM, which
    # ends the process through SystemExit so that the client's socket file is removed.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    origin = ScenarioOrigin()
    threading.Thread(target=origin.follow, args=(sys.stdin,), name="origin", daemon=True).start()
    requests: queue.SimpleQueue[TraceRequest] = queue.SimpleQueue()
    recording = threading.Event()
    client = None
    try:  # from the first socket on: a SIGTERM at any point removes the client's socket file
        if args.kineto_daemon:
            client = KinetoClient(args.kineto_daemon, on_trace=requests.put, busy=recording.is_set)
            client.start()
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        work = TracedWork(shape, origin.get)
        while True:
            request = requests.get()
            recording.set()
            try:
                record(request, work, args.name)
            except OSError as err:  # e.g. the capture was given up and its directory removed
                log.warning("cannot write the trace %s: %s", request.trace_path(os.getpid()), err)
            finally:
                recording.clear()
    finally:
        if client is not None:
            client.close()


if __name__ == "__main__":
    sys.exit(main())

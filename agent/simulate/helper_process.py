"""A stand-in for a training process: a real pid whose name (what psutil reports) the scenario chose.

Started by the simulator as ``python -m gpuscope.simulate.helper_process --name NAME``. It renames
itself with prctl(PR_SET_NAME), asks the kernel to SIGTERM it when its parent goes away
(PR_SET_PDEATHSIG) so that it never outlives the simulation, prints ``ready``, and sleeps.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
MAX_NAME_BYTES = 15  # the kernel's comm field holds 15 bytes plus the terminating NUL


def _prctl(libc: ctypes.CDLL, option: int, arg: int | bytes) -> None:
    # prctl is variadic over unsigned longs: pass each argument at full width explicitly.
    value = ctypes.c_char_p(arg) if isinstance(arg, bytes) else ctypes.c_ulong(arg)
    zero = ctypes.c_ulong(0)
    if libc.prctl(ctypes.c_int(option), value, zero, zero, zero) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}) failed: {os.strerror(err)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", required=True, help="process name, at most 15 bytes")
    parser.add_argument("--parent", type=int, default=0, help="pid of the simulator (exit if it is gone)")
    args = parser.parse_args(argv)
    libc = ctypes.CDLL(None, use_errno=True)
    _prctl(libc, PR_SET_PDEATHSIG, signal.SIGTERM)
    if args.parent and os.getppid() != args.parent:
        return 0  # the simulator died before the death signal was armed
    _prctl(libc, PR_SET_NAME, args.name.encode()[:MAX_NAME_BYTES])
    # Ctrl-C in a terminal reaches the whole process group; the simulator stops us with SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())

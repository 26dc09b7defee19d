"""A scripted stand-in for a PyTorch job started with KINETO_USE_DAEMON=1: it polls the Kineto daemon
as libkineto does, and does with a trace config what the test asks, so the agent's waits can be tried
on behaviours a real job shows only now and then (or never on purpose).

    python kineto_scripted_job.py DAEMON_ADDRESS BEHAVIOUR [--bytes N] [--seconds S] [--empty-for S]

BEHAVIOUR, once the config is taken:

* ``exit``: exit at once (the job ended during the capture).
* ``exit-writing``: record, write part of the trace into ``trace_<pid>.json.tmp``, then exit.
* ``no-file``: record, then write nothing (a job that cannot write into the trace directory).
* ``grow``: record, keep ``.tmp`` empty for ``--empty-for`` s (converting), then fill it for
  ``--seconds`` s and rename it: a job that writes slowly but steadily.
* ``stall``: record, write part of the trace, then stop writing (the file never grows again).
* ``write``: record, then write a complete trace of about ``--bytes`` bytes into ``.tmp`` and rename it.
* ``write-direct``: the same, but the trace is written under another name and renamed into place
  in one step (no ``.tmp`` is ever seen): only the finished file's size can be checked.

"Record" is a sleep of the config's duration. It polls every 0.2 s, prints ``ready`` after the
daemon's first answer, and exits when its standard input closes.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from gpuscope.simulate.kineto_client import KinetoClient, TraceRequest

POLL_S = 0.2
EVENT = ('{"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": %d, "tid": %d, "ts": %d, "dur": 1, '
         '"args": {"External id": %d}},\n')
HEAD = '{"schemaVersion": 1, "traceEvents": [\n'
TAIL = '{"ph": "X", "cat": "Trace", "name": "scripted", "pid": 1, "tid": 1, "ts": 0, "dur": 1}\n]}\n'


def exit_when_stdin_closes() -> None:
    sys.stdin.read()
    os._exit(0)


def events(pid: int, size: int) -> bytes:
    """At least ``size`` bytes of Chrome trace events (each line one event, with a comma)."""
    block = "".join(EVENT % (pid, pid, n, n) for n in range(1000)).encode()
    return block * max(1, -(-size // len(block)))


def poll(daemon: str) -> TraceRequest:
    """Poll until the daemon hands over a trace config; print ``ready`` after its first answer."""
    client = KinetoClient(daemon, on_trace=lambda _: None, busy=lambda: False)
    return client.wait_for_request(POLL_S, lambda: print("ready", flush=True))


def main() -> None:
    daemon, behaviour, *options = sys.argv[1:]
    number = {options[i]: float(options[i + 1]) for i in range(0, len(options), 2)}
    threading.Thread(target=exit_when_stdin_closes, daemon=True).start()
    request = poll(daemon)
    if behaviour == "exit":
        os._exit(0)
    final = request.trace_path(os.getpid())
    temporary = final.with_name(final.name + ".tmp")
    time.sleep(request.duration_s)  # "recording"
    body = events(os.getpid(), int(number.get("--bytes", 1 << 20)))
    if behaviour == "no-file":
        threading.Event().wait()
    if behaviour == "write-direct":
        partial = final.with_name("partial")
        partial.write_bytes(HEAD.encode() + body + TAIL.encode())
        os.rename(partial, final)
        threading.Event().wait()
    with temporary.open("wb") as out:
        if behaviour == "grow":
            out.flush()
            time.sleep(number.get("--empty-for", 0.0))
            seconds = number.get("--seconds", 1.0)
            end = time.monotonic() + seconds
            out.write(HEAD.encode())
            some = events(os.getpid(), 1)  # whole events: the trace stays valid JSON
            while time.monotonic() < end:
                out.write(some)
                out.flush()
                time.sleep(0.1)
        elif behaviour in ("exit-writing", "stall"):
            out.write(HEAD.encode() + body[:65536])
            out.flush()
            if behaviour == "exit-writing":
                os._exit(0)
            threading.Event().wait()
        else:
            out.write(HEAD.encode() + body)
        out.write(TAIL.encode())
    os.rename(temporary, final)
    threading.Event().wait()


if __name__ == "__main__":
    main()

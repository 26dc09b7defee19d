"""A one-line progress indicator for commands that wait: ``capturing GPU 0: 12s / 30s`` on stderr.

It is drawn only on a terminal: redrawn in place (``\\r``) once a second while the block runs, and erased
when it ends, so the command's own output (on stdout) starts on a clean line. Piped or redirected stderr
gets nothing, so logs and scripts see only the command's messages.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

from gpuscope.common.durations import format_duration

REDRAW_S = 1.0  # the elapsed time is shown in whole seconds


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


@contextlib.contextmanager
def progress_line(label: str, total_s: float | None, *, enabled: bool = True, stream: TextIO | None = None,
                  clock: Callable[[], float] = time.monotonic) -> Iterator[None]:
    """Show ``label: <elapsed>s / <total>`` (or ``label: <elapsed>s`` without a total) while the block
    runs, when ``enabled`` and ``stream`` (default stderr) is a terminal."""
    out = sys.stderr if stream is None else stream
    if not enabled or not is_terminal(out):
        yield
        return
    started = clock()
    stop = threading.Event()
    drawn = 0  # characters on the line now: a shorter text is padded over them

    def write(text: str) -> None:
        with contextlib.suppress(OSError, ValueError):  # the terminal went away: nothing to show
            out.write(text)
            out.flush()

    def draw() -> None:
        nonlocal drawn
        elapsed = clock() - started
        text = f"{label}: {int(elapsed)}s" + ("" if total_s is None else f" / {format_duration(total_s)}")
        write("\r" + text.ljust(drawn))
        drawn = len(text)

    def redraw() -> None:
        while True:
            draw()
            # Wake on the next whole second of elapsed time, so the count never skips or stalls.
            if stop.wait(REDRAW_S - (clock() - started) % REDRAW_S):
                return

    thread = threading.Thread(target=redraw, name="gpuscope-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        write("\r" + " " * drawn + "\r")

"""Waiting in tests for what another thread or process does: poll a condition, fail after a while."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], timeout: float = 10.0, step: float = 0.01) -> None:
    """Return once ``condition()`` is true; fail the test ("timed out") after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(step)

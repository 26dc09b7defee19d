"""The Xid watcher waits in NVML's event wait; with a library whose wait polls (its thread wakes many
times while it waits, as in NVIDIA's mock library) it asks without waiting once a second instead."""

from __future__ import annotations

import threading
import time
from typing import Any

from gpuscope.nvml import xid
from gpuscope.nvml.xid import XidWatcher


class SpinningNvml:
    """An event wait that wakes 50 times a second for its timeout (a library that polls); queued events
    are returned by a wait without timeout."""

    def __init__(self) -> None:
        self.events: list[tuple[int, int]] = []
        self.calls: list[int] = []
        self.lock = threading.Lock()

    def xid_event_set(self, devices: list[Any]) -> object:
        return object()

    def free_event_set(self, event_set: object) -> None:
        pass

    def wait_xid(self, event_set: object, devices: list[Any], timeout_ms: int) -> tuple[int, int] | None:
        with self.lock:
            self.calls.append(timeout_ms)
            if timeout_ms == 0:
                return self.events.pop(0) if self.events else None
        end = time.monotonic() + 1.2
        while time.monotonic() < end:  # wakes every 20 ms, as a library that polls inside its wait does
            time.sleep(0.02)
        return None


def test_a_polling_event_wait_is_replaced_by_a_check_once_a_second(monkeypatch: Any) -> None:
    monkeypatch.setattr(xid, "POLL_SECONDS", 0.2)
    nvml = SpinningNvml()
    watcher = XidWatcher(nvml, [])  # type: ignore[arg-type]
    assert watcher.start()
    try:
        deadline = time.monotonic() + 10
        while 0 not in nvml.calls:  # the first wait spins; then the watcher stops waiting
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with nvml.lock:
            nvml.events += [(1, 79), (1, 79), (0, 48)]  # a burst: drained back to back
        while watcher.counts(1) != {79: 2} or watcher.counts(0) != {48: 1}:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        calls = len(nvml.calls)
        time.sleep(1.0)
        assert len(nvml.calls) - calls <= 7  # about one check per POLL_SECONDS, not a spin
        assert nvml.calls[0] == xid._WAIT_MS and set(nvml.calls[1:]) == {0}
    finally:
        watcher.stop(timeout=2)

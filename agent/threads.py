"""The agent's long-lived threads, all started the same way.

Each loop already catches what it expects and carries on; a thread can still die of what nothing
foresaw (a bug). Then it is logged with its traceback, and it shows until the agent restarts: the
source the thread serves is reported failed (``gpuscope_collector_success`` 0) and ``/-/ready``
names the thread, so a node that lost, say, its Xid watcher or its Alertmanager pushes does not look
healthy.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

from gpuscope.health import SourceHealth

log = logging.getLogger(__name__)


def start_thread(name: str, target: Callable[[], object], *, health: SourceHealth | None = None,
                 source: str | None = None) -> threading.Thread:
    """Start ``target`` on a daemon thread called ``name``, watched as described above. ``source``:
    the health source (``nvml``, ``pods``, ...) the thread's death fails."""

    def run() -> None:
        name_os_thread(name)
        try:
            target()
        except BaseException:
            log.exception("the %s thread died; restart the agent to get it back", name)
            if health is not None:
                health.thread_died(name, source)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` in the kernel too (``top -H``, ``ps -L``, /proc/PID/task/TID/comm
    show it): "gpuscope-sampler" becomes "gs-sampler", within the kernel's 15 bytes."""
    short = name.replace("gpuscope-", "gs-").encode("ascii", "replace")[:15]
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the Python name stays the only one
        _prctl()(_PR_SET_NAME, ctypes.c_char_p(short), 0, 0, 0)


_PR_SET_NAME = 15


@functools.cache
def _prctl() -> Any:
    return ctypes.CDLL(None, use_errno=True).prctl


class OnDemandThread:
    """A worker thread started by its first job: ``allow`` once the worker may run, ``wake`` with each
    job (starts the thread the first time), ``forbid`` before stopping. A node that never gets a job
    has no thread waiting for one."""

    def __init__(self, name: str, target: Callable[[], object], *, health: SourceHealth | None = None,
                 source: str | None = None) -> None:
        self._name, self._target, self._health, self._source = name, target, health, source
        self._lock = threading.Lock()
        self._allowed = False
        self.thread: threading.Thread | None = None

    def allow(self, *, pending: bool = False) -> None:
        """The worker may run from now on; ``pending``: jobs are already waiting, start it now."""
        with self._lock:
            self._allowed = True
        if pending:
            self.wake()

    def wake(self) -> None:
        with self._lock:
            if self._allowed and self.thread is None:
                self.thread = start_thread(self._name, self._target, health=self._health, source=self._source)

    def forbid(self) -> None:
        with self._lock:
            self._allowed = False

    def join(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

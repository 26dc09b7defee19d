"""The agent's long-lived threads, all started the same way.

Each loop already catches what it expects and carries on; a thread can still die of what nothing
foresaw (a bug). Then it is logged with its traceback, and it shows until the agent restarts: the
source the thread serves is reported failed (``gpuscope_collector_success`` 0) and ``/-/ready``
names the thread, so a node that lost, say, its Xid watcher or its Alertmanager pushes does not look
healthy.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from gpuscope.health import SourceHealth

log = logging.getLogger(__name__)


def start_thread(name: str, target: Callable[[], object], *, health: SourceHealth | None = None,
                 source: str | None = None) -> threading.Thread:
    """Start ``target`` on a daemon thread called ``name``, watched as described above. ``source``:
    the health source (``nvml``, ``pods``, ...) the thread's death fails."""

    def run() -> None:
        try:
            target()
        except BaseException:
            log.exception("the %s thread died; restart the agent to get it back", name)
            if health is not None:
                health.thread_died(name, source)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread

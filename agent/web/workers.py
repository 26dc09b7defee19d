"""The threads that serve the HTTP connections: each connection gets a thread at once, as with a thread
per connection, but a thread that is done waits for the next one for a while instead of ending (one
such thread at most: after a burst of connections the others end).

A new thread per connection costs the thread that accepts it about 0.2 ms of CPU and four or five
wake-ups more than handing the connection over (one scrape a second, measured). With Prometheus
scraping every 15 to 60 s, one thread serves every scrape and wakes once for each; a thread left
idle for ``idle_seconds`` ends, so a node nobody scrapes keeps none.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from gpuscope.threads import name_os_thread

log = logging.getLogger(__name__)

DEFAULT_IDLE_SECONDS = 75.0  # more than the usual scrape intervals (15-60 s): one thread serves them all
Job = tuple[Callable[..., None], tuple[Any, ...]]


class ConnectionWorkers:
    """Runs each submitted job at once on an idle worker thread, or on a new one when none is idle
    (the caller bounds how many run at once)."""

    def __init__(self, name: str, *, idle_seconds: float = DEFAULT_IDLE_SECONDS, max_idle: int = 1) -> None:
        self.name = name
        self.idle_seconds = idle_seconds
        self.max_idle = max_idle
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._idle = 0  # workers waiting for a job that no job has been promised to yet
        self._threads: set[threading.Thread] = set()
        self._closed = False

    @property
    def threads(self) -> int:
        with self._lock:
            return len(self._threads)

    def submit(self, function: Callable[..., None], *args: Any) -> None:
        """Run ``function(*args)`` at once on a worker; RuntimeError once closed."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: closed")
            if self._idle:
                self._idle -= 1  # promised to one of them: the next submit finds it busy
                self._jobs.put((function, args))
                return
            thread = threading.Thread(target=self._work, args=((function, args),), name=self.name,
                                      daemon=True)
            self._threads.add(thread)
        try:
            thread.start()
        except BaseException:
            with self._lock:
                self._threads.discard(thread)
            raise

    def close(self) -> None:
        """Idle workers end now; busy ones end after their job. Nothing is waited for."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, 0
        for _ in range(idle):
            self._jobs.put(None)

    def _work(self, job: Job | None) -> None:
        name_os_thread(self.name)
        try:
            while job is not None:
                function, args = job
                try:
                    function(*args)
                except Exception:  # the job handles its own errors; this is a bug: the worker goes on
                    log.exception("%s: a connection's handler failed", self.name)
                job = self._next_job()
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _next_job(self) -> Job | None:
        with self._lock:
            if self._closed or self._idle >= self.max_idle:
                return None
            self._idle += 1
        try:
            return self._jobs.get(timeout=self.idle_seconds)
        except queue.Empty:
            with self._lock:
                try:  # a job promised to the idle workers as this one gave up: it is this one's
                    return self._jobs.get_nowait()
                except queue.Empty:
                    if not self._closed:  # (close() has already counted it out)
                        self._idle -= 1
                    return None

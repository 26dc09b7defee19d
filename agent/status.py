"""What the HTTP and control surfaces need to know about the sampler, as a protocol."""

from __future__ import annotations

from typing import Protocol

from gpuscope.snapshot import Snapshot


class SnapshotSource(Protocol):
    """The sampler, as seen by readers: the latest snapshot and whether it is still ticking."""

    @property
    def interval_seconds(self) -> float: ...

    def latest(self) -> Snapshot | None:
        """The newest snapshot, or None before the first tick finished."""
        ...

    def is_alive(self) -> bool:
        """True while the sampling thread runs (it may be stuck in a slow NVML call)."""
        ...

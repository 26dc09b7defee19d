"""The capture store's errors: what it cannot do, and why (the quota, the disk, another agent, an id
it does not hold)."""

from __future__ import annotations

from gpuscope.capture.model import CaptureError


class CaptureStoreError(CaptureError):
    """The store cannot do what was asked; the message says why."""


class CaptureStoreInUseError(CaptureStoreError):
    """Another agent holds the store's lock; ``pid`` names it when its lock file says."""

    def __init__(self, message: str, pid: int | None = None) -> None:
        super().__init__(message)
        self.pid = pid


class CaptureNotFoundError(CaptureStoreError, LookupError):
    """No complete capture with this id."""


class CaptureQuotaError(CaptureStoreError):
    """The capture does not fit in the store's quota even with every other capture evicted."""


class CaptureDiskError(CaptureStoreError):
    """The store's file system cannot take the capture and keep min_free_bytes free, even with every
    other capture evicted (or a write failed: no space, an I/O error)."""

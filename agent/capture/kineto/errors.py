"""The Kineto daemon's errors (capture errors: the agent logs them and goes on without PyTorch
captures, a backend turns them into an outcome)."""

from __future__ import annotations

from gpuscope.capture.model import CaptureError


class KinetoDaemonError(CaptureError, RuntimeError):
    """The daemon cannot start (its address is taken, its directories are unusable); says why.
    ``setting`` names the directory at fault, as in ``capture.kineto``: "trace_dir" or "socket_dir"."""

    def __init__(self, message: str, *, setting: str | None = None) -> None:
        super().__init__(message)
        self.setting = setting


class KinetoUnreachableError(CaptureError):
    """No registered process with that pid, or the daemon is not running."""


class KinetoBusyError(CaptureError):
    """A capture of that process is already in flight, or it is profiling itself."""

"""The control API's errors: one base for the client and the server, as the CLI reports them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc


class ControlError(Exception):
    """A control API call, or the control API itself, that failed; the message is one line.
    ``usage``: the request itself was wrong (the CLI exits 2), else it exits 1. ``code``: the gRPC
    status the agent answered with, when it answered."""

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None, usage: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.usage = usage


class ControlServerError(ControlError):
    """The control API cannot start; the message names the path or address and why."""

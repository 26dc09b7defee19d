"""What can go wrong reading a trace, and how much of one is read at most.

Every error's message names the file and what is wrong with it, in words a user can act on.
"""

from __future__ import annotations

# Decompressed bytes read from one trace before reading stops: a bound on time and memory against
# a runaway trace or a gzip bomb (a few megabytes that inflate without end).
DEFAULT_MAX_BYTES = 2 << 30


class TraceError(Exception):
    """A trace that cannot be read: missing, unreadable, not a trace, or none where one was expected."""


class TraceFormatError(TraceError):
    """The file is not well-formed in its format (truncated, corrupt, or another kind of file)."""


class TraceTooLargeError(TraceError):
    """The trace holds more than the reader's bound on decompressed bytes."""

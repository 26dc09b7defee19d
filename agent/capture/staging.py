"""A capture in progress: the private folder its backends write into until the store commits or aborts
it, and the files they write there, each chunk of which is claimed from the store before it reaches
the disk (``CaptureStore.claim_room``: the quota, the file system's free bytes)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, BinaryIO, Protocol, cast

from gpuscope.capture.store_errors import CaptureDiskError, CaptureStoreError
from gpuscope.common.unixfs import NewFile, safe_file_name


class RoomKeeper(Protocol):
    def claim_room(self, staging: Staging, size: int) -> None:
        """Room for ``size`` more bytes of ``staging``, or CaptureQuotaError or CaptureDiskError."""


class _ClaimingWriter:
    """A staging file's writer: each chunk is claimed from the store before it is written, and a
    write error is noted on the staging area (the agent's own disk failed, not the target)."""

    def __init__(self, inner: BinaryIO, staging: Staging) -> None:
        self._inner = inner
        self._staging = staging

    def write(self, data: bytes | bytearray | memoryview) -> int:
        size = memoryview(data).nbytes
        self._staging.claim(size)
        try:
            return self._inner.write(data)
        except OSError as err:
            raise self._staging.failed(CaptureDiskError(
                f"cannot write to the capture store: {err.strerror or err}")) from err

    def flush(self) -> None:
        self._inner.flush()

    def fileno(self) -> int:
        return self._inner.fileno()

    def close(self) -> None:
        self._inner.close()

    @property
    def closed(self) -> bool:
        return self._inner.closed

    def __getattr__(self, name: str) -> Any:  # what gzip.GzipFile or a caller may ask of a file
        return getattr(self._inner, name)


class Staging:
    """A capture in progress: a private directory the backends write into, until commit or abort."""

    __slots__ = ("_lock", "agent_failure", "begun", "claimed", "id", "owner", "path")

    def __init__(self, owner: RoomKeeper, capture_id: str, path: Path, begun: float) -> None:
        self.owner = owner  # the store that began it, and only it, commits or aborts it
        self.id = capture_id
        self.path = path
        self.begun = begun  # wall clock (Unix seconds) at begin()
        self.claimed = 0  # bytes the backends wrote (or are writing) into this capture
        # Why the capture failed on the agent's side (quota, disk), if it did: the service then
        # reports it as the agent's failure, not the target's, and charges no budget for it.
        self.agent_failure: CaptureStoreError | None = None
        self._lock = threading.Lock()  # the backends of one capture write at the same time

    def claim(self, size: int) -> None:
        """Make room for ``size`` more bytes of this capture, before they are written (evicting the
        oldest captures if the file system's min_free_bytes needs it); CaptureQuotaError or
        CaptureDiskError (both noted in ``agent_failure``) when there is none."""
        with self._lock:
            try:
                self.owner.claim_room(self, size)
            except CaptureStoreError as err:
                raise self.failed(err) from None
            self.claimed += size

    def failed(self, error: CaptureStoreError) -> CaptureStoreError:
        """Note ``error`` as the agent's side of a failed capture (the first one is kept); returns it."""
        if self.agent_failure is None:
            self.agent_failure = error
        return error

    @property
    def run(self) -> str:
        """The TensorBoard run name of this capture's traces (the capture id: it sorts by time)."""
        return self.id

    def new_file(self, stem: str, suffix: str, *, folders: tuple[str, ...] = ()) -> NewFile:
        """A file ``<folders>/<stem>[-N]<suffix>`` of this capture, for a backend to fill and then
        ``publish()`` (atomically, never replacing a file; its path relative to the capture is
        returned). Left unpublished, it is removed. ``folders`` and ``stem`` must be plain names."""
        for part in (*folders, stem + suffix):
            if not part or part != safe_file_name(part, limit=255, default=""):
                raise CaptureStoreError(f"{part!r} is not a plain file or folder name")
        try:
            new = NewFile(self.path.joinpath(*folders), stem, suffix, relative_to=self.path)
        except OSError as err:
            raise self.failed(CaptureDiskError(f"cannot create a file in the capture store: "
                                               f"{err.strerror or err}")) from err
        new.file = cast(BinaryIO, _ClaimingWriter(new.file, self))
        return new

    def __repr__(self) -> str:
        return f"Staging({self.id!r})"

"""A stored capture as one uncompressed tar file, streamed from the store's files.

The archive's length is known before its first byte (every header is built up front from the sizes
the store lists), so the response has a Content-Length and no file is buffered in memory: the body
is written in CHUNK_BYTES pieces, whatever the capture's size (the store's quota bounds it). Members
are named ``<id>/<path in the capture>``, so ``tar -xf`` gives the directory ``tensorboard --logdir``
reads. The traces are compressed already (.pt.trace.json.gz) or protobuf, so the tar is not.

Files are opened without following links, and each must still be the regular file of the listed
size: a capture evicted or altered while it is being sent ends the body short of its Content-Length
(the client sees a truncated download, never bytes that are not the capture's).
"""

from __future__ import annotations

import logging
import os
import stat
import tarfile
from collections.abc import Generator, Iterator
from dataclasses import dataclass

from gpuscope.capture.store import CaptureStore, StoredFile

log = logging.getLogger(__name__)

CHUNK_BYTES = 256 * 1024
_BLOCK = tarfile.BLOCKSIZE
_RECORD = tarfile.RECORDSIZE  # tar(1) and Python's tarfile pad an archive to a whole record
_FILE_MODE = 0o640


@dataclass(frozen=True, slots=True)
class _Member:
    header: bytes
    file: StoredFile


@dataclass(frozen=True, slots=True)
class CaptureArchive:
    """One capture as a tar stream: ``length`` bytes, produced by ``chunks()``."""

    capture_id: str
    length: int
    members: tuple[_Member, ...]

    @property
    def file_name(self) -> str:
        return f"{self.capture_id}.tar"

    def chunks(self) -> Iterator[bytes]:
        """The archive's bytes; it stops early (logged) if a file changed since it was listed."""
        sent = 0
        for member in self.members:
            yield member.header
            sent += len(member.header)
            if not (yield from _file_chunks(self.capture_id, member.file)):
                return  # short of the Content-Length: the client knows the download failed
            sent += member.file.size
            padding = -sent % _BLOCK
            if padding:
                yield bytes(padding)
                sent += padding
        if sent < self.length:
            yield bytes(self.length - sent)  # the two zero blocks that end an archive, and the padding


def capture_archive(store: CaptureStore, capture_id: str) -> CaptureArchive:
    """The archive of a complete capture. CaptureIdError for an id the store would not generate (it
    never reaches a path), CaptureNotFoundError, CaptureStoreError for a capture that holds a link or
    a special file."""
    files = store.files(capture_id)
    mtime = int(store.get(capture_id).start)
    members = []
    length = 0
    for stored in files:
        info = tarfile.TarInfo(f"{capture_id}/{stored.relative}")
        info.size, info.mtime, info.mode, info.type = stored.size, mtime, _FILE_MODE, tarfile.REGTYPE
        header = info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")
        members.append(_Member(header, stored))
        length += len(header) + _padded(stored.size)
    length += 2 * _BLOCK
    return CaptureArchive(capture_id, _padded(length, _RECORD), tuple(members))


def _padded(size: int, unit: int = _BLOCK) -> int:
    return -(-size // unit) * unit


def _file_chunks(capture_id: str, stored: StoredFile) -> Generator[bytes, None, bool]:
    """Exactly ``stored.size`` bytes of the file (then True), or fewer (logged, then False) when it is
    no longer that file."""
    try:
        # O_NONBLOCK: a FIFO put in the file's place must not hold the request's thread at open().
        fd = os.open(stored.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as err:
        log.warning("capture %s: cannot send %s: %s (evicted while it was being downloaded?)",
                    capture_id, stored.relative, err.strerror or err)
        return False
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size != stored.size:
            log.warning("capture %s: %s changed while it was being downloaded; the download ends short",
                        capture_id, stored.relative)
            return False
        left = stored.size
        while left > 0:
            piece = file.read(min(CHUNK_BYTES, left))
            if not piece:
                log.warning("capture %s: %s was truncated while it was being downloaded; the download "
                            "ends short", capture_id, stored.relative)
                return False
            left -= len(piece)
            yield piece
    return True

"""The capture store: one directory per capture under a root, published atomically, within a disk quota.

Layout::

    <root>/.lock                       flock held by the agent that owns the store; holds its pid
    <root>/.staging/<id>/              where backends write while a capture runs (private, 0700)
    <root>/.trash/<id>/                a capture being deleted (evicted), removed right after
    <root>/<id>/capture.json           the record (capture.json is what makes a capture complete)
    <root>/<id>/plugins/profile/<run>/<host>.xplane.pb    TensorFlow/JAX traces (TensorBoard/XProf layout)
    <root>/<id>/<host>_<pid>.<ms>.pt.trace.json.gz         PyTorch (Kineto) traces

So ``tensorboard --logdir <root>/<id>`` (or ``--logdir <root>``) shows the traces.

Atomicity: a capture appears under ``<root>`` only through one ``rename`` of its complete staging
directory, after its files and then capture.json were written and fsynced. A crash before that
leaves a staging directory, which the next start removes; a crash while deleting leaves a directory
in ``.trash``, removed the same way. So a directory named like a capture with a valid capture.json is
always complete.

Safety: ids that come from outside go through ``check_capture_id`` (a strict ASCII regex) before they
touch a path; the root is resolved once and every capture path is ``<root>/<valid id>``; symlinks and
special files inside the store are refused (never followed), so nothing outside the root is read,
listed or deleted through the store.

Quota: sizes are apparent file sizes (what a download streams). Before a capture is published, the
oldest captures (by start time) are evicted until it fits; a capture larger than the whole quota is
refused (CaptureQuotaError) and nothing is evicted for it.

Room while writing: a backend writes through the staging area's files, which claim every chunk
before it is written. A capture may never hold more than the quota (CaptureQuotaError at the chunk
that would pass it: nothing more reaches the disk), and the store's file system keeps
``min_free_bytes`` free: a chunk that would eat into it first evicts the oldest captures, and when
none is left, the capture stops (CaptureDiskError). Both, and any write error of the agent's own
disk, are noted on the staging area (``agent_failure``): the capture failed on the agent's side.
The staging area is ``capture/staging.py``; the store's errors are ``capture/store_errors.py``.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpuscope.capture.model import CaptureRecord, Outcome
from gpuscope.capture.records import (
    MAX_RECORD_BYTES,
    RECORD_FILE,
    CaptureIdError,
    CaptureRecordError,
    check_capture_id,
    record_from_bytes,
    record_to_bytes,
)
from gpuscope.capture.staging import Staging
from gpuscope.capture.store_errors import (
    CaptureDiskError,
    CaptureNotFoundError,
    CaptureQuotaError,
    CaptureStoreError,
    CaptureStoreInUseError,
)
from gpuscope.common.sizes import format_size
from gpuscope.common.unixfs import (
    UnsafePathError,
    fsync_path,
    private_directory,
    read_bounded,
    remove_tree,
    write_new_file,
)
from gpuscope.common.user_paths import check_fallback_runtime_dir

# The store's names, for its callers: the staging area and the errors are modules of their own.
__all__ = [
    "CaptureDiskError",
    "CaptureIdError",
    "CaptureNotFoundError",
    "CaptureQuotaError",
    "CaptureStore",
    "CaptureStoreError",
    "CaptureStoreInUseError",
    "Staging",
    "StoredFile",
]

log = logging.getLogger(__name__)

STAGING_DIR = ".staging"
TRASH_DIR = ".trash"
LOCK_FILE = ".lock"
MAX_DEPTH = 16  # directory levels inside one capture (plugins/profile/<run>/ is 3)
MAX_FILES = 10_000  # files inside one capture


def file_system_free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s file system."""
    info = os.statvfs(path)
    return info.f_bavail * info.f_frsize


@dataclass(frozen=True, slots=True)
class StoredFile:
    """One file of a capture: its path relative to the capture directory, where it is, its size."""

    relative: str
    path: Path
    size: int


@dataclass(frozen=True, slots=True)
class _Entry:
    record: CaptureRecord
    disk_bytes: int  # the files plus capture.json


class CaptureStore:
    """Complete captures under ``root``; thread-safe. One agent process owns a root at a time (flock)."""

    def __init__(self, root: Path, *, quota_bytes: int, min_free_bytes: int = 0,
                 clock: Callable[[], float] = time.time,
                 token: Callable[[], str] = lambda: secrets.token_hex(3),
                 free_bytes: Callable[[Path], int] = file_system_free_bytes) -> None:
        if quota_bytes <= 0:
            raise ValueError(f"quota_bytes must be positive, got {quota_bytes}")
        self.quota_bytes = quota_bytes
        self.min_free_bytes = min_free_bytes
        self._free_bytes = free_bytes
        self._clock = clock
        self._token = token
        self._lock = threading.RLock()
        self._index: dict[str, _Entry] = {}
        self._open: set[str] = set()
        try:
            check_fallback_runtime_dir(root, create=True)  # a store under /tmp/gpuscope-<uid>: ours only
            root.mkdir(mode=0o750, parents=True, exist_ok=True)
            self.root = root.resolve(strict=True)
        except OSError as err:
            raise CaptureStoreError(f"cannot create the capture store {root}: {err.strerror or err}") from err
        if not self.root.is_dir():
            raise CaptureStoreError(f"the capture store {root} is not a directory")
        self._lock_fd = self._take_lock()
        try:
            self._staging_root = self._private_dir(STAGING_DIR)
            self._trash = self._private_dir(TRASH_DIR)
            self._recover()
        except BaseException:
            self.close()
            raise

    # -- lifecycle -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the store's lock (another CaptureStore may then open the root)."""
        with self._lock:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1

    def __enter__(self) -> CaptureStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take_lock(self) -> int:
        path = self.root / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as err:
            raise CaptureStoreError(f"cannot open {path}: {err.strerror or err}") from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _lock_holder(fd)
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                who = f"pid {holder}" if holder else "its .lock is held"
                raise CaptureStoreInUseError(f"the capture store {self.root} is in use by another gpuscope "
                                             f"agent ({who}); set capture.store.root to give this agent a "
                                             "store of its own", holder) from None
            raise CaptureStoreError(f"cannot lock {path}: {err.strerror or err}") from err
        # Who holds the lock, for the message a second agent gives (the lock itself is the flock).
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _private_dir(self, name: str) -> Path:
        path = self.root / name
        try:
            return private_directory(path)
        except UnsafePathError as err:
            raise CaptureStoreError(f"{err.strerror}; refusing to use it") from err
        except OSError as err:
            raise CaptureStoreError(f"cannot create {path}: {err.strerror or err}") from err

    def _recover(self) -> None:
        """At start-up: drop leftovers of a crash (staging, trash, capture directories without a valid
        capture.json) and index the complete captures. Entries not named like captures are left alone."""
        for leftover in (self._staging_root, self._trash):
            for entry in os.scandir(leftover):
                log.info("removing %s, left over from an interrupted capture", entry.path)
                _remove(Path(entry.path))
        for entry in os.scandir(self.root):
            if entry.name.startswith("."):
                continue
            try:
                check_capture_id(entry.name)
            except CaptureIdError:
                log.warning("ignoring %s in the capture store: not a capture", entry.path)
                continue
            path = Path(entry.path)
            if entry.is_symlink() or not entry.is_dir(follow_symlinks=False):
                log.warning("removing %s from the capture store: not a directory (a symlink?)", path)
                _remove(path)
                continue
            try:
                self._index[entry.name] = self._load(entry.name, path)
            except (CaptureStoreError, CaptureRecordError, OSError) as err:
                log.warning("removing %s from the capture store: %s", path, err)
                self._delete_dir(path)
        try:
            self._keep_free(0)  # the file system filled up while the agent was away
        except CaptureDiskError as err:
            log.warning("%s", err)

    def _load(self, capture_id: str, path: Path) -> _Entry:
        files, disk_bytes = _scan(path)
        if not any(f.relative == RECORD_FILE for f in files):
            raise CaptureStoreError(f"no {RECORD_FILE}")
        record = record_from_bytes(read_bounded(path / RECORD_FILE, MAX_RECORD_BYTES))
        if record.id != capture_id:
            raise CaptureStoreError(f"{RECORD_FILE} names capture {record.id!r}, not {capture_id!r}")
        return _Entry(record, disk_bytes)

    # -- writing -------------------------------------------------------------------------------------

    def begin(self, *, gpu: int | None = None, pid: int | None = None) -> Staging:
        """A new capture id and its private staging directory (``gpu`` or ``pid`` goes into the id)."""
        with self._lock:
            self._check_open()
            for _ in range(16):
                now = self._clock()
                capture_id = new_capture_id(now, gpu=gpu, pid=pid, token=self._token())
                if capture_id in self._index or capture_id in self._open:
                    continue
                path = self._staging_root / capture_id
                try:
                    os.mkdir(path, 0o700)
                except FileExistsError:
                    continue
                except OSError as err:
                    raise CaptureStoreError(f"cannot create {path}: {err.strerror or err}") from err
                self._open.add(capture_id)
                return Staging(self, capture_id, path, now)
        raise CaptureStoreError("could not find an unused capture id (16 tries)")

    def abort(self, staging: Staging) -> None:
        """Drop a capture in progress and its files. Safe to call twice, or after commit."""
        with self._lock:
            if staging.owner is not self or staging.id not in self._open:
                return
            self._open.discard(staging.id)
        _remove(staging.path)

    def commit(self, staging: Staging, record: CaptureRecord) -> CaptureRecord:
        """Publish a capture: the staging files plus capture.json, atomically, within the quota.

        ``record.bytes`` and ``record.files`` are replaced by what the staging directory holds (the
        files' sizes; capture.json not counted). Returns the record as stored. The staging directory
        is consumed whatever happens: on any error it is removed, and nothing already in the store is
        touched unless the capture was published (only then are older captures evicted).
        """
        with self._lock:
            if staging.owner is not self or staging.id not in self._open:
                raise CaptureStoreError(f"capture {staging.id} is not in progress in this store "
                                        "(already committed or aborted?)")
        try:
            if record.id != staging.id:
                raise CaptureStoreError(f"the record's id {record.id!r} is not the staging id {staging.id!r}")
            published = self._commit(staging, record)
        except BaseException:
            self.abort(staging)
            raise
        with self._lock:
            self._open.discard(staging.id)
        return published

    def _commit(self, staging: Staging, record: CaptureRecord) -> CaptureRecord:
        info = os.lstat(staging.path)
        if not stat.S_ISDIR(info.st_mode):
            raise CaptureStoreError(f"{staging.path} is no longer a directory")
        files, data_bytes = _scan(staging.path)
        data = [f for f in files if f.relative != RECORD_FILE]
        data_bytes = sum(f.size for f in data)
        final = replace(record, bytes=data_bytes, files=tuple(f.relative for f in data))
        payload = record_to_bytes(final)
        size = data_bytes + len(payload)
        if size > self.quota_bytes:
            raise CaptureQuotaError(
                f"capture {record.id} is {format_size(size)}, larger than the whole store quota of "
                f"{format_size(self.quota_bytes)} (capture.store.quota_bytes); it was not stored and no "
                "other capture was evicted")
        with self._lock:
            self._keep_free(len(payload))
        try:
            for f in data:
                fsync_path(f.path, directory=False)
            for directory in _directories(staging.path):
                fsync_path(directory, directory=True)
            _write_record(staging.path / RECORD_FILE, payload)
        except OSError as err:
            raise CaptureStoreError(f"cannot write capture {record.id}: {err.strerror or err}") from err
        with self._lock:
            self._check_open()
            self._make_room(size)
            target = self.root / staging.id
            try:
                os.rename(staging.path, target)
                fsync_path(self.root, directory=True)
                fsync_path(self._staging_root, directory=True)
            except OSError as err:
                raise CaptureStoreError(f"cannot publish capture {record.id}: {err.strerror or err}") from err
            self._index[staging.id] = _Entry(final, size)
        return final

    def annotate(self, capture_id: str, analysis: dict[str, Any]) -> CaptureRecord:
        """Add the analysis of a complete capture to its record: capture.json replaced in one rename
        (written first in the staging area, so a crash leaves the old record or the new one, and
        nothing a recovery would not remove). CaptureNotFoundError if it was evicted meanwhile."""
        with self._lock:
            entry = self._entry(capture_id)
            record = replace(entry.record, analysis=analysis)
            payload = record_to_bytes(record)
            path = self.root / capture_id / RECORD_FILE
            try:
                old_size = os.lstat(path).st_size
                self._keep_free(len(payload))
                scratch = self._staging_root / f"{capture_id}.record"
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(scratch)
                write_new_file(scratch, payload, mode=0o640)
                os.rename(scratch, path)
                fsync_path(path.parent, directory=True)
            except OSError as err:
                raise CaptureStoreError(f"cannot update the record of capture {capture_id}: "
                                        f"{err.strerror or err}") from err
            self._index[capture_id] = _Entry(record, entry.disk_bytes - old_size + len(payload))
            return record

    def claim_room(self, staging: Staging, size: int) -> None:
        """Room for ``size`` more bytes of ``staging`` within the quota and the file system's
        min_free_bytes (see the module's docstring)."""
        with self._lock:
            self._check_open()
            if staging.claimed + size > self.quota_bytes:
                raise CaptureQuotaError(
                    f"capture {staging.id} would be larger than the whole store quota of "
                    f"{format_size(self.quota_bytes)} (capture.store.quota_bytes): it was stopped at "
                    f"{format_size(staging.claimed)}, and no other capture was evicted")
            self._keep_free(size)

    def _keep_free(self, size: int) -> None:
        """Evict the oldest captures until ``size`` more bytes leave min_free_bytes free on the file
        system (lock held); CaptureDiskError when even evicting all of them would not."""
        free = self._measure_free()
        if free - size >= self.min_free_bytes:
            return
        for entry in sorted(self._index.values(), key=lambda e: (e.record.start, e.record.id)):
            log.info("evicting capture %s (%s) to keep %s free on the capture store's file system "
                     "(capture.store.min_free_bytes)", entry.record.id, format_size(entry.disk_bytes),
                     format_size(self.min_free_bytes))
            self._delete(entry.record.id)
            free = self._measure_free()
            if free - size >= self.min_free_bytes:
                return
        raise CaptureDiskError(
            f"the capture store's file system has {format_size(max(0, free))} free: {format_size(size)} more "
            f"would leave less than capture.store.min_free_bytes ({format_size(self.min_free_bytes)}), and "
            "no older capture is left to evict")

    def _measure_free(self) -> int:
        try:
            return self._free_bytes(self.root)
        except OSError as err:
            raise CaptureDiskError(f"cannot measure the free space of {self.root}: {err.strerror or err}"
                                   ) from err

    def _make_room(self, size: int) -> None:
        """Evict the oldest captures until ``size`` more bytes fit in the quota (lock held)."""
        oldest_first = sorted(self._index.values(), key=lambda e: (e.record.start, e.record.id))
        total = self.total_bytes()
        for entry in oldest_first:
            if total + size <= self.quota_bytes:
                break
            log.info("evicting capture %s (%s) to stay within the quota", entry.record.id,
                      format_size(entry.disk_bytes))
            self._delete(entry.record.id)
            total -= entry.disk_bytes

    def delete(self, capture_id: str) -> None:
        """Remove a complete capture (CaptureIdError, CaptureNotFoundError)."""
        check_capture_id(capture_id)
        with self._lock:
            if capture_id not in self._index:
                raise CaptureNotFoundError(f"no capture {capture_id!r} in the store")
            self._delete(capture_id)

    def _delete(self, capture_id: str) -> None:
        self._index.pop(capture_id, None)
        self._delete_dir(self.root / capture_id)

    def _delete_dir(self, path: Path) -> None:
        """Move ``path`` out of the listing in one rename, then remove it (never follows symlinks)."""
        trash = self._trash / path.name
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        except OSError as err:
            log.warning("cannot move %s to %s: %s; removing it in place", path, trash, err)
            trash = path
        _remove(trash)

    # -- reading -------------------------------------------------------------------------------------

    def list(self) -> builtins.list[CaptureRecord]:
        """The complete captures, newest first."""
        with self._lock:
            entries = list(self._index.values())
        entries.sort(key=lambda e: (e.record.start, e.record.id), reverse=True)
        return [e.record for e in entries]

    def get(self, capture_id: str) -> CaptureRecord:
        """The record of a complete capture; CaptureIdError for a malformed id, CaptureNotFoundError."""
        return self._entry(capture_id).record

    def path(self, capture_id: str) -> Path:
        """The directory of a complete capture (same errors as ``get``)."""
        self._entry(capture_id)
        return self.root / capture_id

    def files(self, capture_id: str) -> builtins.list[StoredFile]:
        """The files of a complete capture, capture.json included, sorted by relative path, for
        streaming. CaptureStoreError if the directory holds a symlink or a special file."""
        self._entry(capture_id)
        files, _ = _scan(self.root / capture_id)
        for f in files:  # belt and braces: _scan never follows a link, so this cannot fire
            if not f.path.resolve().is_relative_to(self.root / capture_id):
                raise CaptureStoreError(f"{f.relative} of capture {capture_id} resolves outside it")
        return files

    def total_bytes(self) -> int:
        """Disk bytes of the complete captures (their files and capture.json)."""
        with self._lock:
            return sum(e.disk_bytes for e in self._index.values())

    def last_start(self, outcome: Outcome | None = "captured") -> float | None:
        """Start time of the newest stored capture with this outcome (any outcome: None); None if none."""
        with self._lock:
            starts = [e.record.start for e in self._index.values()
                      if outcome is None or e.record.outcome == outcome]
        return max(starts, default=None)

    def _entry(self, capture_id: str) -> _Entry:
        check_capture_id(capture_id)
        with self._lock:
            entry = self._index.get(capture_id)
            if entry is None:
                raise CaptureNotFoundError(f"no capture {capture_id!r} in the store")
            try:
                info = os.lstat(self.root / capture_id)
            except FileNotFoundError:
                self._index.pop(capture_id, None)  # removed by hand
                raise CaptureNotFoundError(f"capture {capture_id!r} is gone from the store") from None
            if not stat.S_ISDIR(info.st_mode):
                raise CaptureStoreError(f"{self.root / capture_id} is not a directory (a symlink?); "
                                        "refusing it")
            return entry

    def _check_open(self) -> None:
        if self._lock_fd < 0:
            raise CaptureStoreError(f"the capture store {self.root} is closed")


def new_capture_id(now: float, *, gpu: int | None = None, pid: int | None = None, token: str) -> str:
    """``yyyymmddThhmmssZ-gpuN-xxxxxx`` (UTC); ``pidN`` when there is no GPU, ``node`` with neither."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    who = f"gpu{gpu}" if gpu is not None else f"pid{pid}" if pid is not None else "node"
    return check_capture_id(f"{stamp}-{who}-{token}")


# -- file helpers --------------------------------------------------------------------------------------


def _lock_holder(fd: int) -> int | None:
    """The pid a lock file names (written by the agent holding it), or None."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() and 0 < int(text) < 2**22 else None


def _scan(top: Path) -> tuple[list[StoredFile], int]:
    """Every regular file under ``top`` (sorted), and their total size; CaptureStoreError on a symlink,
    a special file, too deep a tree or too many files. Never follows a link."""
    found: list[StoredFile] = []

    def walk(directory: Path, prefix: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise CaptureStoreError(f"{directory} is nested more than {MAX_DEPTH} levels deep")
        with os.scandir(directory) as entries:
            for entry in entries:
                relative = prefix + entry.name
                if entry.is_symlink():
                    raise CaptureStoreError(f"symlink {relative} inside the capture store; refusing it")
                info = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(info.st_mode):
                    walk(Path(entry.path), relative + "/", depth + 1)
                elif stat.S_ISREG(info.st_mode):
                    found.append(StoredFile(relative, Path(entry.path), info.st_size))
                    if len(found) > MAX_FILES:
                        raise CaptureStoreError(f"more than {MAX_FILES} files in {top}")
                else:
                    raise CaptureStoreError(f"{relative} inside the capture store is not a regular file")

    walk(top, "", 0)
    found.sort(key=lambda f: f.relative)
    return found, sum(f.size for f in found)


def _directories(top: Path) -> Iterator[Path]:
    """``top`` and its sub-directories, deepest first (for fsync before the parent's)."""
    for dirpath, _, _ in sorted(os.walk(top, followlinks=False), key=lambda w: -len(w[0])):
        yield Path(dirpath)


def _write_record(path: Path, payload: bytes) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a backend's stray capture.json (never a link: _scan refused those)
    write_new_file(path, payload, mode=0o640)


def _remove(path: Path) -> None:
    """Remove a file, a link (not its target) or a directory tree (links inside removed, not followed)."""
    try:
        remove_tree(path)
    except OSError as err:
        log.warning("cannot remove %s: %s", path, err)

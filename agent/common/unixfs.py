"""Safe Unix file-system operations shared by the capture store, the Kineto daemon and the control API.

The agent runs as root on nodes where other users write into shared directories (a socket
directory, a trace directory). Every operation here therefore refuses to follow a symlink where the
agent did not expect one, creates with explicit modes whatever the umask, never replaces a file it
did not make, bounds what it reads, and makes what it writes durable (file, then directory fsync)
before it is published by a rename or a link.

Errors are ``OSError`` subclasses, so callers that already handle I/O errors handle these too and
translate them into their own boundary's error; nothing here imports another part of gpuscope.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import stat
import struct
import tempfile
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

MAX_UNIX_SOCKET_PATH_BYTES = 107  # sun_path holds 108 bytes, the last one a NUL
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_UNSAFE_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
_MAX_NAME_TRIES = 999
_UCRED = struct.Struct("=iII")  # struct ucred {pid_t pid; uid_t uid; gid_t gid}


class UnsafePathError(OSError):
    """A path the agent refuses to use as it is: a symlink, another kind of file than expected, too
    long a socket address, or a file that is not a plain one. The message says which and why."""


class SocketInUseError(OSError):
    """Something answers on the socket path: another process serves it, so it is not replaced.
    ``pid``: that process, when the kernel names it (the peer credentials of a stream socket)."""

    pid: int | None = None


class FileTooLargeError(OSError):
    """A file larger than the reader's bound; nothing past the bound was read."""


def safe_file_name(text: str, *, limit: int = 100, default: str = "host") -> str:
    """``text`` made into one file name of ``[A-Za-z0-9._-]``: never hidden, empty, ``.`` or ``..``,
    at most ``limit`` characters (a host name from a trace, say)."""
    name = _UNSAFE_NAME_CHARS.sub("_", text).lstrip(".-")[:limit]
    return name or default


# -- reading and writing files ----------------------------------------------------------------------------


def read_bounded(path: Path, limit: int, *, follow_symlinks: bool = False,
                 regular_only: bool = True) -> bytes:
    """The content of the regular file ``path``, read without following a symlink at ``path`` (unless
    ``follow_symlinks``); FileTooLargeError past ``limit`` bytes, UnsafePathError if it is not a
    regular file (a FIFO would block the agent, a device never end). ``regular_only=False`` reads a
    pipe too, for a command-line tool given ``<(command)``; still no more than ``limit`` bytes."""
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_NONBLOCK if regular_only else 0)
    flags |= 0 if follow_symlinks else os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UnsafePathError(errno.ELOOP, f"{path} is a symlink, which is not followed") from None
        raise
    with os.fdopen(fd, "rb") as file:
        if regular_only and not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafePathError(errno.EINVAL, f"{path} is not a regular file")
        data = file.read(limit + 1)
    if len(data) > limit:
        raise FileTooLargeError(errno.EFBIG, f"{path} is larger than {limit} bytes")
    return data


def fsync_path(path: Path, *, directory: bool = False) -> None:
    """Flush a file's (or a directory's entries') data to disk, without following a symlink."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new_file(path: Path, data: bytes, *, mode: int = 0o640) -> None:
    """Create ``path`` (never an existing file, never through a symlink) holding ``data``, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def link_new(source: Path, directory: Path, stem: str, suffix: str) -> str:
    """Give the file ``source`` the first free name ``<stem><suffix>``, ``<stem>-2<suffix>``, ... in
    ``directory`` by a hard link, which never replaces an existing file; the name taken. (On a file
    system without hard links: a rename after checking the name is free.)"""
    for attempt in range(1, _MAX_NAME_TRIES + 1):
        name = f"{stem}{suffix}" if attempt == 1 else f"{stem}-{attempt}{suffix}"
        final = directory / name
        try:
            os.link(source, final)
        except FileExistsError:
            continue
        except OSError:
            if os.path.lexists(final):
                continue
            os.replace(source, final)
        return name
    raise FileExistsError(errno.EEXIST, f"{directory}: too many files named {stem}*{suffix}")


class NewFile:
    """A file being written under a directory, published under its final name only when complete.

    Use as a context manager: write to ``file``, then ``publish()``; leaving the block without
    publishing (a return, an exception) removes what was written. Readers never see a partial file.
    """

    def __init__(self, directory: Path, stem: str, suffix: str, *, relative_to: Path | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._directory = directory
        self._stem = stem
        self._suffix = suffix
        self._relative_to = relative_to or directory
        fd, temporary = tempfile.mkstemp(prefix=f".{stem}.", suffix=".tmp", dir=directory)
        self._temporary = Path(temporary)
        self.file: BinaryIO = os.fdopen(fd, "wb")
        self.published: str | None = None

    def publish(self) -> str:
        """Flush and fsync the file, link it to its final name (never replacing one); that name,
        relative to ``relative_to``."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        name = link_new(self._temporary, self._directory, self._stem, self._suffix)
        fsync_path(self._directory, directory=True)  # the new name survives a crash too
        self.published = (self._directory / name).relative_to(self._relative_to).as_posix()
        return self.published

    def __enter__(self) -> NewFile:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._temporary)


def remove_tree(path: Path) -> None:
    """Remove a file, a symlink (not its target) or a directory tree (symlinks inside removed, never
    followed). OSError if it cannot be removed; a missing path is not an error."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


# -- directories ------------------------------------------------------------------------------------------


def chmod_directory(path: Path, mode: int) -> os.stat_result:
    """Set the mode of the directory ``path`` itself, never of what a symlink there points to; its
    stat. UnsafePathError when ``path`` is a symlink or not a directory."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePathError(err.errno, f"{path} is a symlink or not a directory") from None
        raise
    try:
        os.fchmod(fd, mode)
        return os.fstat(fd)
    finally:
        os.close(fd)


def ensure_directory(path: Path, mode: int, *, parents_mode: int = 0o755,
                     follow_symlinks: bool = False) -> tuple[os.stat_result, bool]:
    """Create ``path`` with exactly ``mode`` (whatever the umask) when it is missing, its missing
    parents with ``parents_mode``; (its stat, whether it was made now). An existing ``path`` keeps its
    mode and is only checked: UnsafePathError when it is not a directory, or a symlink (unless
    ``follow_symlinks``: a directory of the agent's own, such as ``/var/run`` -> ``/run``)."""
    missing: list[Path] = []
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            break
        missing.append(candidate)
    created = False
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)  # private until its final mode is set
        except FileExistsError:  # made meanwhile by someone else: then it is checked like any other
            continue
        if directory == path:
            created = True
        else:
            chmod_directory(directory, parents_mode)
    existing = os.stat if follow_symlinks else os.lstat
    info = chmod_directory(path, mode) if created else existing(path)
    if not stat.S_ISDIR(info.st_mode):
        symlink = "" if follow_symlinks else " (or is a symlink, which the agent never follows)"
        raise UnsafePathError(errno.ENOTDIR, f"{path} is not a directory{symlink}")
    return info, created


def private_directory(path: Path) -> Path:
    """``path`` as a directory of the agent's own (made 0700 when missing); UnsafePathError when a
    symlink or a file is in its place."""
    ensure_directory(path, 0o700, parents_mode=0o700)
    return path


# -- Unix sockets -----------------------------------------------------------------------------------------


def check_socket_path(path: Path) -> None:
    """UnsafePathError when ``path`` does not fit a Unix socket address."""
    if len(os.fsencode(path)) > MAX_UNIX_SOCKET_PATH_BYTES:
        raise UnsafePathError(errno.ENAMETOOLONG, f"{path} is longer than {MAX_UNIX_SOCKET_PATH_BYTES} "
                                                  "bytes, the most a Unix socket address holds")


def _serving_pid(path: Path, kind: socket.SocketKind, timeout: float) -> int | None:
    """None when nobody serves ``path``; else the serving process's pid, 0 when the kernel does not
    say (a datagram socket has no peer credentials)."""
    with socket.socket(socket.AF_UNIX, kind | socket.SOCK_CLOEXEC) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return None
        if kind != socket.SOCK_STREAM:
            return 0
        credentials = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        return int(_UCRED.unpack(credentials)[0])


def clear_stale_socket(path: Path, kind: socket.SocketKind = socket.SOCK_STREAM) -> bool:
    """Make ``path`` free for a new socket: nothing there, or a stale socket, which is removed (True).
    UnsafePathError when something other than a socket is there, SocketInUseError when a process
    answers on it: neither is ever replaced."""
    check_socket_path(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(info.st_mode):
        raise UnsafePathError(errno.EEXIST, f"{path} exists and is not a socket; it is not replaced")
    pid = _serving_pid(path, kind, 1.0)
    if pid is not None:
        err = SocketInUseError(errno.EADDRINUSE, f"another process{f' (pid {pid})' if pid else ''} serves "
                                                 f"the socket {path}")
        err.pid = pid or None
        raise err
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return True


def same_file(path: Path, identity: tuple[int, int] | None) -> bool:
    """Whether ``path`` (not followed) is still the file whose (st_dev, st_ino) is ``identity``."""
    if identity is None:
        return False
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return (info.st_dev, info.st_ino) == identity


def file_identity(path: Path) -> tuple[int, int]:
    """(st_dev, st_ino) of ``path`` itself, to recognise it later with ``same_file``."""
    info = os.lstat(path)
    return info.st_dev, info.st_ino

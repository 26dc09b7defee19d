"""The Kineto daemon's directories: where PyTorch processes bind their sockets and write their traces.

Both are shared with the traced processes, which may belong to any user, so their modes are set
explicitly whatever the umask, and the agent never follows a symlink at either directory's own
path; missing parents are made 0755, for other users' processes to pass through:

* ``trace_dir`` 0711, the agent's: other users' processes may pass through to their capture's folder
  but can neither list it (the folder names are random and secret) nor create anything in it, so no
  one can plant a file or a link where the agent looks for traces. It need not be world-writable like
  /tmp: the process never creates a directory (the agent makes each capture's folder and gives it to
  the process's user, or makes it writable when it cannot). An existing one must already be like
  that; the agent does not change the mode of a directory it did not create.
* ``socket_dir`` 01733: every user's process binds its client socket there (and PyTorch makes it
  0666); sticky, so none removes another's socket or the daemon's; not listable, because a client
  socket takes a trace config from anyone who can name it. An existing one keeps its mode (it may be
  shared on purpose) but must be owned by the agent or root, and sticky if everyone may write in it.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import stat
import tempfile
from pathlib import Path

from gpuscope.capture.kineto.errors import KinetoDaemonError
from gpuscope.common.unixfs import UnsafePathError, ensure_directory
from gpuscope.common.user_paths import check_fallback_runtime_dir

log = logging.getLogger(__name__)

TRACE_DIR_MODE = 0o711
SOCKET_DIR_MODE = 0o1733
PARENT_DIR_MODE = 0o755
_CAPTURE_DIR_NAME = re.compile(r"\d+-[0-9a-f]{16}")  # <pid>-<random>, made by make_capture_dir


def default_trace_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"gpuscope-kineto-{os.geteuid()}"


def prepare_socket_dir(directory: Path) -> os.stat_result:
    """Makes the socket directory (01733) or checks the existing one: a real directory, owned by the
    agent or root, and sticky if everyone may write in it (else anyone could replace the daemon's
    socket). An existing one keeps its mode: it may be shared on purpose."""
    st, created = _directory(directory, SOCKET_DIR_MODE, what="Kineto socket directory", setting="socket_dir")
    if created:
        return st
    if st.st_uid not in (os.geteuid(), 0):
        raise KinetoDaemonError(f"the Kineto socket directory {directory} belongs to uid {st.st_uid}, "
                                "neither the agent nor root: its owner could replace the daemon's socket",
                                setting="socket_dir")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise KinetoDaemonError(f"the Kineto socket directory {directory} is writable by everyone without "
                                f"the sticky bit (mode {_mode(st)}): anyone could replace the daemon's "
                                "socket; chmod 1733 it", setting="socket_dir")
    if not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        log.warning("Kineto daemon: only uid %d can make its socket in %s (mode %s): other users' PyTorch "
                    "processes cannot register (chmod 1733 it)", st.st_uid, directory, _mode(st))
    return st


def prepare_trace_dir(directory: Path) -> None:
    """Makes the trace directory (0711) or checks the existing one: a real directory of the agent's own
    that other users may enter but neither list nor write."""
    st, created = _directory(directory, TRACE_DIR_MODE, what="Kineto trace directory", setting="trace_dir")
    if created:
        return
    if st.st_uid != os.geteuid():
        raise KinetoDaemonError(f"the Kineto trace directory {directory} belongs to uid {st.st_uid}, "
                                f"not to the agent (uid {os.geteuid()})", setting="trace_dir")
    if st.st_mode & 0o066:
        raise KinetoDaemonError(f"the Kineto trace directory {directory} can be listed or written by other "
                                f"users (mode {_mode(st)}): they could find or plant traces; chmod 0711 it, "
                                "or name a new directory", setting="trace_dir")
    if st.st_mode & stat.S_IRWXU != stat.S_IRWXU:
        raise KinetoDaemonError(f"the agent cannot list, write or enter its own Kineto trace directory "
                                f"{directory} (mode {_mode(st)}); chmod 0711 it", setting="trace_dir")
    if not st.st_mode & stat.S_IXOTH:
        raise KinetoDaemonError(f"other users cannot enter the Kineto trace directory {directory} (mode "
                                f"{_mode(st)}), so their jobs could not write traces; chmod 0711 it",
                                setting="trace_dir")


def make_capture_dir(trace_dir: Path, pid: int, uid: int | None, gid: int | None) -> Path:
    """A new, randomly named folder for one capture of ``pid``, writable by the process's user."""
    directory = trace_dir / f"{pid}-{secrets.token_hex(8)}"
    try:
        directory.mkdir(mode=0o700)
    except FileNotFoundError:  # removed meanwhile (a /tmp cleaner): made again, checked again
        prepare_trace_dir(trace_dir)
        directory.mkdir(mode=0o700)
    if uid is not None and uid != os.geteuid():
        try:
            if os.geteuid() != 0:
                raise PermissionError("not root")
            os.chown(directory, uid, gid if gid is not None else -1)
        except OSError:
            # Another user's process must create its file here; the name is random and the parent is
            # not listable.
            os.chmod(directory, 0o777)
    return directory


def remove_leftovers(trace_dir: Path) -> None:
    """Removes the capture folders of a daemon that stopped mid-capture (a crash): the trace directory
    outlives the agent (a RuntimeDirectory kept across restarts, a hostPath)."""
    try:
        with os.scandir(trace_dir) as entries:
            stale = [Path(e.path) for e in entries
                     if _CAPTURE_DIR_NAME.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for directory in stale:
        remove_quietly(directory)
    if stale:
        log.info("Kineto daemon: removed %d capture folder(s) left in %s", len(stale), trace_dir)


def remove_quietly(directory: Path) -> None:
    """A capture's folder, as much of it as can go: a process may still be writing in it. (rmtree
    never follows a symlink found inside.)"""
    shutil.rmtree(directory, ignore_errors=True)


def _directory(path: Path, mode: int, *, what: str, setting: str) -> tuple[os.stat_result, bool]:
    """Creates ``path`` with ``mode`` when it is missing; (its stat, whether it was made now). A
    symlink at ``path`` is refused, never followed; so is a runtime directory under /tmp that is not
    the agent's user's own."""
    try:
        check_fallback_runtime_dir(path, create=True)
        return ensure_directory(path, mode, parents_mode=PARENT_DIR_MODE)
    except UnsafePathError as err:
        raise KinetoDaemonError(f"the {what} {err.strerror}", setting=setting) from err
    except OSError as err:
        raise KinetoDaemonError(f"cannot create the {what} {path}: {err}", setting=setting) from err


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"

"""The control socket's directory and path: made ready before anything listens there."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from gpuscope.common.unixfs import (
    MAX_UNIX_SOCKET_PATH_BYTES,
    SocketInUseError,
    UnsafePathError,
    clear_stale_socket,
    ensure_directory,
    file_identity,
    same_file,
)
from gpuscope.common.user_paths import check_fallback_runtime_dir
from gpuscope.control.errors import ControlServerError

log = logging.getLogger(__name__)


def prepare_socket_dir(path: Path) -> None:
    """Create the socket's directory (0750) and clear a stale socket; refuse anything else in the way,
    a live agent's socket above all (naming that agent)."""
    parent = path.parent
    try:
        check_fallback_runtime_dir(parent, create=True)  # /tmp/gpuscope-<uid>: ours, or not used
        ensure_directory(parent, 0o750, parents_mode=0o755, follow_symlinks=True)
    except OSError as err:
        raise ControlServerError(f"cannot use {parent}, the directory of the control socket {path}: "
                                 f"{err.strerror or err}") from err
    try:
        if clear_stale_socket(path):
            log.info("removed a stale control socket at %s", path)
    except SocketInUseError as err:
        from gpuscope.control.client import describe_agent_at  # asks that agent who it is, over gRPC

        raise ControlServerError(f"the control socket {path} is in use by another agent "
                                 f"({describe_agent_at(path, err.pid)}); set control.socket "
                                 "(GPUSCOPE_CONTROL__SOCKET) to give this agent its own") from None
    except UnsafePathError as err:
        raise ControlServerError(f"{err.strerror}: set control.socket to another path") from None
    except OSError as err:
        raise ControlServerError(f"cannot inspect the control socket {path}: {err.strerror or err}") from err


def place_socket(path: Path, mode: int, bind: Callable[[Path], object], *,
                 replacing: tuple[int, int] | None = None) -> tuple[int, int]:
    """Bind a socket at ``path`` through ``bind``, with ``mode``; its identity (device, inode).

    It is bound in a private directory beside ``path``, given its mode, then linked into place: no
    client ever sees it with the umask's permissions, and an existing path is never replaced by the
    link. ``replacing``: the identity of a socket at ``path`` to take over instead, in one rename
    (clients then connect to one socket or the other, never to none). A staged path too long for a
    socket address binds in place. ControlServerError names what failed; ``bind``'s own errors pass.
    """
    try:
        private = Path(tempfile.mkdtemp(prefix=".gpuscope-", dir=path.parent))
    except OSError as err:
        raise ControlServerError(f"cannot create the control socket in {path.parent}: "
                                 f"{err.strerror or err}") from err
    try:
        staged = private / "s"
        in_place = len(str(staged).encode()) > MAX_UNIX_SOCKET_PATH_BYTES
        if replacing is not None and (in_place or not same_file(path, replacing)):
            raise ControlServerError(f"cannot take over the control socket {path}: it is no longer the "
                                     "agent's own, or its directory's path is too long to stage a socket "
                                     "beside it")
        target = path if in_place else staged
        bind(target)
        try:
            os.chmod(target, mode)
            if replacing is not None:
                os.rename(staged, path)
            elif not in_place:
                os.link(staged, path)
                os.unlink(staged)
            return file_identity(path)
        except OSError as err:
            if err.errno == errno.EEXIST:
                raise ControlServerError(f"{path} appeared while the control socket was being set up "
                                         "(another gpuscope agent starting?)") from err
            raise ControlServerError(f"cannot set up the control socket {path}: "
                                     f"{err.strerror or err}") from err
    finally:
        shutil.rmtree(private, ignore_errors=True)

"""The control socket's directory and path: made ready before anything listens there."""

from __future__ import annotations

import logging
from pathlib import Path

from gpuscope.common.unixfs import SocketInUseError, UnsafePathError, clear_stale_socket, ensure_directory
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

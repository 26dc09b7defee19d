"""Where the agent keeps its files unless the configuration says otherwise, and for whom.

* **root**: the system's directories, ``/var/lib/gpuscope`` (state: the capture store) and
  ``/run/gpuscope`` (runtime: the control socket), as packages and the Kubernetes DaemonSet expect.
* **a systemd service** with ``StateDirectory=`` or ``RuntimeDirectory=``: the directories systemd made
  for it (``$STATE_DIRECTORY``, ``$RUNTIME_DIRECTORY``), whatever its user. The shipped unit runs as a
  dynamic user and gets ``/var/lib/gpuscope`` and ``/run/gpuscope`` this way.
* **any other user**: that user's own XDG base directories, so that an agent started by hand never
  needs root and never meets another user's agent: state ``$XDG_STATE_HOME/gpuscope`` (by default
  ``~/.local/state/gpuscope``), runtime ``$XDG_RUNTIME_DIR/gpuscope``. Without a usable
  ``XDG_RUNTIME_DIR`` (unset, as under ``su`` or ``runuser``, or not the user's own 0700 directory)
  the runtime directory is ``/tmp/gpuscope-<uid>``: a 0700 directory that must belong to the user, be a
  real directory and not a symlink (``check_fallback_runtime_dir``), since anyone may create names in
  ``/tmp``.

The command-line client reads the same functions, so ``gpuscope capture`` finds the agent that the same
user started. Nothing here creates anything except ``check_fallback_runtime_dir``; nothing imports
another part of gpuscope.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gpuscope.common.unixfs import MAX_UNIX_SOCKET_PATH_BYTES, UnsafePathError

SYSTEM_STATE_DIR = Path("/var/lib/gpuscope")
SYSTEM_RUNTIME_DIR = Path("/run/gpuscope")
APP_DIR_NAME = "gpuscope"
# The longest socket address made under the runtime directory: a PyTorch client socket,
# <runtime>/kineto/ipc/dynoconfigclient<36-character uuid>. A runtime directory too long to hold it
# is not usable.
_LONGEST_SOCKET_SUFFIX_BYTES = len("/kineto/ipc/dynoconfigclient") + 36
MAX_RUNTIME_DIR_BYTES = MAX_UNIX_SOCKET_PATH_BYTES - _LONGEST_SOCKET_SUFFIX_BYTES


Owner = Literal["root", "service", "user"]


@dataclass(frozen=True, slots=True)
class DefaultDirs:
    """The default state and runtime directories of an agent, and whose they are: root's, a systemd
    service's, or those of a user who started the agent for themselves ("user"), whose other defaults
    also stay out of names the whole node shares."""

    state: Path
    runtime: Path
    owner: Owner


def fallback_runtime_dir(euid: int | None = None) -> Path:
    """The runtime directory of a user without a usable XDG_RUNTIME_DIR: ``/tmp/gpuscope-<uid>``.
    (Always /tmp, not $TMPDIR: the agent and the command-line client must agree on it.)"""
    return Path(f"/tmp/{APP_DIR_NAME}-{os.geteuid() if euid is None else euid}")


def default_dirs(environ: Mapping[str, str] | None = None, euid: int | None = None) -> DefaultDirs:
    """The default directories for this process (or for ``environ`` and ``euid``, in tests)."""
    env = os.environ if environ is None else environ
    uid = os.geteuid() if euid is None else euid
    service_state = _first_absolute(env.get("STATE_DIRECTORY"))
    service_runtime = _first_absolute(env.get("RUNTIME_DIRECTORY"))
    if service_state is not None or service_runtime is not None:
        return DefaultDirs(service_state or SYSTEM_STATE_DIR, service_runtime or SYSTEM_RUNTIME_DIR,
                           "service")
    if uid == 0:
        return DefaultDirs(SYSTEM_STATE_DIR, SYSTEM_RUNTIME_DIR, "root")
    runtime = _xdg_runtime_dir(env.get("XDG_RUNTIME_DIR"), uid)
    runtime = runtime / APP_DIR_NAME if runtime is not None else fallback_runtime_dir(uid)
    state_home = _xdg_state_home(env)
    # No home of its own (a service account with HOME=/): the runtime directory holds the state too.
    state = state_home / APP_DIR_NAME if state_home is not None else runtime / "state"
    return DefaultDirs(state, runtime, "user")


def check_fallback_runtime_dir(path: Path, *, create: bool, euid: int | None = None) -> None:
    """When ``path`` is in this user's fallback runtime directory (``/tmp/gpuscope-<uid>``), make that
    directory 0700 if ``create`` and it is missing, and check that it is this user's own: a real
    directory, not a symlink, owned by this user, closed to others. Anyone can create a name in
    /tmp first, so a directory there is trusted only after this check. UnsafePathError says what is
    wrong; other paths are left alone. Without ``create`` a missing directory is no error (the
    caller then finds nothing there)."""
    uid = os.geteuid() if euid is None else euid
    top = fallback_runtime_dir(uid)
    if path != top and top not in path.parents:
        return
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(top, 0o700)  # never through a symlink: mkdir fails on any existing name
    try:
        info = os.lstat(top)
    except FileNotFoundError:
        if create:
            raise
        return
    hint = "remove it, or set XDG_RUNTIME_DIR to a directory of your own"
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafePathError(errno.ENOTDIR, f"{top} is a symlink or not a directory, so it is not used; "
                                             f"{hint}")
    if info.st_uid != uid:
        raise UnsafePathError(errno.EPERM, f"{top} belongs to uid {info.st_uid}, not to this user (uid "
                                           f"{uid}), so it is not used; {hint}")
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise UnsafePathError(errno.EPERM, f"{top} is open to other users (mode "
                                           f"{stat.S_IMODE(info.st_mode):04o}), so it is not used; "
                                           f"chmod 0700 it")


def _first_absolute(value: str | None) -> Path | None:
    # systemd lists one path per directory the unit names, separated by ':'; the first is ours.
    first = (value or "").split(":", 1)[0]
    return Path(first) if first.startswith("/") else None


def _xdg_state_home(env: Mapping[str, str]) -> Path | None:
    """XDG_STATE_HOME, by default ~/.local/state; None without a home directory."""
    configured = env.get("XDG_STATE_HOME", "")
    if configured.startswith("/"):  # the XDG specification: a relative value is invalid, ignored
        return Path(configured)
    home = env.get("HOME") or os.path.expanduser("~")
    if not home.startswith("/") or home.rstrip("/") == "":
        return None
    return Path(home) / ".local" / "state"


def _xdg_runtime_dir(value: str | None, uid: int) -> Path | None:
    """XDG_RUNTIME_DIR when it is usable: absolute, the user's own real directory, closed to others
    (as the specification requires), and short enough for the sockets made under it."""
    if not value or not value.startswith("/"):
        return None
    path = Path(value)
    if len(os.fsencode(path / APP_DIR_NAME)) > MAX_RUNTIME_DIR_BYTES:
        return None
    try:
        info = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or stat.S_IMODE(info.st_mode) & 0o077:
        return None
    return path

"""The default locations per user (common/user_paths.py), the settings that follow them, and where the
command-line client looks for an agent."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuscope.capture.config import CaptureConfig, KinetoConfig
from gpuscope.common.unixfs import UnsafePathError
from gpuscope.common.user_paths import (
    MAX_RUNTIME_DIR_BYTES,
    DefaultDirs,
    check_fallback_runtime_dir,
    default_dirs,
    fallback_runtime_dir,
)
from gpuscope.control.client import default_socket
from gpuscope.control.config import ControlConfig, client_socket_candidates

USER = os.geteuid() or 4242  # a user other than root: ourselves, or (as root) a uid we give files to
SYSTEM = DefaultDirs(Path("/var/lib/gpuscope"), Path("/run/gpuscope"), "root")


@pytest.fixture
def runtime_dir() -> Iterator[Path]:
    """A directory like /run/user/<uid>: USER's own, mode 0700, short."""
    path = Path(tempfile.mkdtemp(prefix="xdg-", dir="/tmp"))
    if os.geteuid() == 0:
        os.chown(path, USER, -1)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_root_keeps_the_system_directories() -> None:
    assert default_dirs({"HOME": "/root", "XDG_RUNTIME_DIR": "/run/user/0"}, euid=0) == SYSTEM


def test_a_systemd_service_gets_the_directories_systemd_made_for_it() -> None:
    # The shipped unit: a dynamic user with StateDirectory=gpuscope and RuntimeDirectory=gpuscope.
    env = {"STATE_DIRECTORY": "/var/lib/gpuscope:/var/lib/other", "RUNTIME_DIRECTORY": "/run/gpuscope",
           "HOME": "/"}
    assert default_dirs(env, euid=61234) == DefaultDirs(Path("/var/lib/gpuscope"), Path("/run/gpuscope"),
                                                        "service")
    assert default_dirs({"RUNTIME_DIRECTORY": "/run/x"}, euid=0) == DefaultDirs(
        Path("/var/lib/gpuscope"), Path("/run/x"), "service")
    assert default_dirs({"STATE_DIRECTORY": "relative", "HOME": "/home/u"}, euid=1000).owner == "user"


def test_a_user_gets_the_xdg_directories(runtime_dir: Path) -> None:
    env = {"HOME": "/home/u", "XDG_RUNTIME_DIR": str(runtime_dir)}
    assert default_dirs(env, euid=USER) == DefaultDirs(
        Path("/home/u/.local/state/gpuscope"), runtime_dir / "gpuscope", "user")
    env["XDG_STATE_HOME"] = "/data/state"
    assert default_dirs(env, euid=USER).state == Path("/data/state/gpuscope")
    env["XDG_STATE_HOME"] = "relative/state"  # invalid by the XDG specification: ignored
    assert default_dirs(env, euid=USER).state == Path("/home/u/.local/state/gpuscope")
    # No home of its own: the state goes with the runtime directory.
    assert default_dirs({"HOME": "/", "XDG_RUNTIME_DIR": str(runtime_dir)}, euid=USER).state == (
        runtime_dir / "gpuscope" / "state")


def test_an_unusable_runtime_dir_falls_back_to_a_private_one_in_tmp(runtime_dir: Path) -> None:
    fallback = Path(f"/tmp/gpuscope-{USER}")
    assert fallback_runtime_dir(USER) == fallback

    def runtime(value: str | None) -> Path:
        env = {"HOME": "/home/u"} | ({} if value is None else {"XDG_RUNTIME_DIR": value})
        return default_dirs(env, euid=USER).runtime

    assert runtime(str(runtime_dir)) == runtime_dir / "gpuscope"
    assert runtime(None) == fallback  # su, runuser, cron: no session
    assert runtime("run/user/1000") == fallback  # relative
    assert runtime(str(runtime_dir / "missing")) == fallback
    link = runtime_dir.with_name(runtime_dir.name + "-link")
    link.symlink_to(runtime_dir)
    try:
        assert runtime(str(link)) == fallback  # a symlink is not the user's own directory
    finally:
        link.unlink()
    runtime_dir.chmod(0o755)
    assert runtime(str(runtime_dir)) == fallback  # open to others
    runtime_dir.chmod(0o700)
    assert default_dirs({"HOME": "/h", "XDG_RUNTIME_DIR": str(runtime_dir)}, euid=USER + 1).runtime == (
        Path(f"/tmp/gpuscope-{USER + 1}"))  # someone else's
    # Too long for the sockets made under it (PyTorch's client sockets in kineto/ipc).
    deep = runtime_dir / ("d" * (MAX_RUNTIME_DIR_BYTES - len(str(runtime_dir))))
    deep.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(deep, USER, -1)
    assert runtime(str(deep)) == fallback


@pytest.fixture
def fake_uid() -> Iterator[int]:
    """A uid no one on this machine uses, and its fallback runtime directory cleaned up after."""
    uid = 3_000_000_000 + secrets.randbelow(10**8)
    try:
        yield uid
    finally:
        path = fallback_runtime_dir(uid)
        if path.is_symlink() or path.is_file():
            path.unlink()
        shutil.rmtree(path, ignore_errors=True)


def test_the_fallback_runtime_dir_is_trusted_only_when_it_is_the_users_own(fake_uid: int) -> None:
    top = fallback_runtime_dir(fake_uid)
    check_fallback_runtime_dir(Path("/run/gpuscope/control.sock"), create=True, euid=fake_uid)  # not under it
    check_fallback_runtime_dir(top / "control.sock", create=False, euid=fake_uid)  # missing: nothing to check
    assert not top.exists()
    # Made by someone else (here: by this process, for the fake user).
    with pytest.raises(UnsafePathError, match=rf"{top} belongs to uid {os.geteuid()}, not to this user"):
        check_fallback_runtime_dir(top, create=True, euid=fake_uid)
    assert top.is_dir() and (top.stat().st_mode & 0o777) == 0o700  # made 0700
    top.rmdir()
    top.symlink_to("/tmp")
    with pytest.raises(UnsafePathError, match="is a symlink or not a directory"):
        check_fallback_runtime_dir(top / "kineto" / "traces", create=True, euid=fake_uid)
    top.unlink()
    if os.geteuid() != 0:
        return  # the rest gives the directory to the fake user
    top.mkdir(mode=0o700)
    os.chown(top, fake_uid, -1)
    check_fallback_runtime_dir(top / "kineto" / "ipc", create=True, euid=fake_uid)  # the user's own: fine
    top.chmod(0o755)
    with pytest.raises(UnsafePathError, match=r"open to other users \(mode 0755\).*chmod 0700"):
        check_fallback_runtime_dir(top / "control.sock", create=False, euid=fake_uid)


def test_the_settings_default_to_this_users_directories() -> None:
    dirs = default_dirs()
    assert CaptureConfig().store.root == dirs.state / "captures"
    assert ControlConfig().socket == dirs.runtime / "control.sock"
    kineto = KinetoConfig()
    if dirs.owner == "root":  # the daemon's own trace directory, and the abstract @dynolog
        assert (kineto.trace_dir, kineto.socket_dir) == (None, None)
    else:
        assert kineto.trace_dir == dirs.runtime / "kineto" / "traces"
        assert kineto.socket_dir == (dirs.runtime / "kineto" / "ipc" if dirs.owner == "user" else None)
    # What is set explicitly wins, null included (the abstract socket, for anyone).
    explicit = CaptureConfig.model_validate({"store": {"root": "/srv/captures"},
                                             "kineto": {"socket_dir": None, "trace_dir": "/srv/traces"}})
    assert explicit.store.root == Path("/srv/captures")
    assert (explicit.kineto.socket_dir, explicit.kineto.trace_dir) == (None, Path("/srv/traces"))
    assert ControlConfig.model_validate({"socket": "/srv/c.sock"}).socket == Path("/srv/c.sock")


def test_the_client_looks_for_this_users_agent_then_the_nodes(runtime_dir: Path) -> None:
    user = DefaultDirs(Path("/home/u/.local/state/gpuscope"), runtime_dir, "user")
    own, node = client_socket_candidates(user)
    assert (own, node) == (runtime_dir / "control.sock", Path("/run/gpuscope/control.sock"))
    assert client_socket_candidates(SYSTEM) == [node]
    missing = runtime_dir / "missing.sock"
    assert default_socket([missing, runtime_dir / "other.sock"]) == missing  # none: the first, to name
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(runtime_dir / "other.sock"))
        assert default_socket([missing, runtime_dir / "other.sock"]) == runtime_dir / "other.sock"

"""Safe file-system operations (gpuscope.common.unixfs): what they refuse, and what they never do."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from gpuscope.common.unixfs import (
    FileTooLargeError,
    NewFile,
    SocketInUseError,
    UnsafePathError,
    clear_stale_socket,
    ensure_directory,
    link_new,
    read_bounded,
    remove_tree,
    safe_file_name,
    write_new_file,
)


def test_read_bounded_reads_refuses_links_special_files_and_what_is_too_large(tmp_path: Path) -> None:
    target = tmp_path / "token"
    target.write_bytes(b"x" * 10)
    assert read_bounded(target, 10) == b"x" * 10
    with pytest.raises(FileTooLargeError, match="larger than 9 bytes"):
        read_bounded(target, 9)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(UnsafePathError, match="symlink"):
        read_bounded(link, 100)
    assert read_bounded(link, 100, follow_symlinks=True) == b"x" * 10  # e.g. a Kubernetes Secret
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UnsafePathError, match="not a regular file"):
        read_bounded(fifo, 100)  # never blocks on it


def test_link_new_never_replaces_a_file(tmp_path: Path) -> None:
    (tmp_path / "trace.pb").write_text("first")
    source = tmp_path / "tmp"
    source.write_text("second")
    assert link_new(source, tmp_path, "trace", ".pb") == "trace-2.pb"
    assert (tmp_path / "trace.pb").read_text() == "first"
    assert (tmp_path / "trace-2.pb").read_text() == "second"


def test_a_new_file_appears_only_when_published(tmp_path: Path) -> None:
    with NewFile(tmp_path / "plugins", "host", ".xplane.pb", relative_to=tmp_path) as new:
        new.file.write(b"data")
        assert not (tmp_path / "plugins" / "host.xplane.pb").exists()
        assert new.publish() == "plugins/host.xplane.pb"
    with NewFile(tmp_path / "plugins", "host", ".xplane.pb", relative_to=tmp_path) as new:
        new.file.write(b"abandoned")  # not published: gone with the block, temporary file included
    assert sorted(p.name for p in (tmp_path / "plugins").iterdir()) == ["host.xplane.pb"]


def test_write_new_file_refuses_an_existing_file_and_a_symlink(tmp_path: Path) -> None:
    write_new_file(tmp_path / "record", b"{}", mode=0o640)
    assert stat.S_IMODE((tmp_path / "record").stat().st_mode) == 0o640
    with pytest.raises(FileExistsError):
        write_new_file(tmp_path / "record", b"again")
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FileExistsError):
        write_new_file(tmp_path / "link", b"through")
    assert not (tmp_path / "elsewhere").exists()


def test_ensure_directory_sets_modes_and_never_follows_a_symlink(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        info, created = ensure_directory(tmp_path / "a" / "b", 0o1733, parents_mode=0o755)
    finally:
        os.umask(old)
    assert created and stat.S_IMODE(info.st_mode) == 0o1733
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o755
    assert ensure_directory(tmp_path / "a" / "b", 0o700)[1] is False  # existing: kept as it is
    assert stat.S_IMODE((tmp_path / "a" / "b").stat().st_mode) == 0o1733
    (tmp_path / "real").mkdir(mode=0o755)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(UnsafePathError, match="symlink"):
        ensure_directory(tmp_path / "link", 0o700)
    assert ensure_directory(tmp_path / "link", 0o700, follow_symlinks=True)[1] is False
    assert stat.S_IMODE((tmp_path / "real").stat().st_mode) == 0o755


def test_a_stale_socket_is_cleared_a_live_one_and_other_files_are_not(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    assert clear_stale_socket(path) is False  # nothing there
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(path))
    live.listen(1)
    with pytest.raises(SocketInUseError, match=rf"another process \(pid {os.getpid()}\) serves") as in_use:
        clear_stale_socket(path)
    assert in_use.value.pid == os.getpid()  # the kernel's peer credentials name who serves it
    live.close()  # the file stays: a socket nobody serves
    assert path.exists() and clear_stale_socket(path) is True and not path.exists()
    path.write_text("not a socket")
    with pytest.raises(UnsafePathError, match="not a socket"):
        clear_stale_socket(path)
    with pytest.raises(UnsafePathError, match="107 bytes"):
        clear_stale_socket(tmp_path / ("x" * 120))


def test_remove_tree_removes_links_not_what_they_point_to(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "out").symlink_to(outside)
    remove_tree(tree)
    remove_tree(tree)  # a missing path is not an error
    assert not tree.exists() and (outside / "keep").read_text() == "keep"


@pytest.mark.parametrize(("text", "name"), [
    ("worker-0.example.com", "worker-0.example.com"), ("../../etc/passwd", "_.._etc_passwd"),
    ("...", "host"), ("ä b/c", "_b_c"), ("-rf", "rf"),
])
def test_safe_file_name(text: str, name: str) -> None:
    assert safe_file_name(text) == name

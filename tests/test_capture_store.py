"""The capture store: layout, atomic publication, crash leftovers, hostile ids and symlinks, the quota."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuscope.capture import store as store_module
from gpuscope.capture.model import CaptureRecord, CaptureTarget, TargetOutcome, Trigger
from gpuscope.capture.records import CAPTURE_ID, record_from_bytes
from gpuscope.capture.store import (
    CaptureDiskError,
    CaptureIdError,
    CaptureNotFoundError,
    CaptureQuotaError,
    CaptureStore,
    CaptureStoreError,
    CaptureStoreInUseError,
    Staging,
)

T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z
TARGET = CaptureTarget("tsl", 123, "127.0.0.1:6009", "port 6009 of pid 123")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CaptureStore]:
    with CaptureStore(tmp_path / "captures", quota_bytes=1 << 20) as s:
        yield s


def record_for(staging: Staging, *, start: float = T0, files: tuple[str, ...] = (),
               trigger: Trigger | None = None) -> CaptureRecord:
    return CaptureRecord(
        id=staging.id, trigger=trigger or Trigger("alert", alertname="GpuLowUtilization"), gpu=0, pids=(123,),
        targets=(TargetOutcome(TARGET, "captured", files),), start=start, duration_s=2.0, bytes=0,
        outcome="captured", hostname="node-1")


def write_trace(staging: Staging, size: int, host: str = "node-1") -> str:
    with staging.new_file(host, ".xplane.pb", folders=("plugins", "profile", staging.run)) as new:
        new.file.write(b"x" * size)
        return new.publish()


def add(store: CaptureStore, size: int, *, start: float = T0, gpu: int = 0) -> CaptureRecord:
    staging = store.begin(gpu=gpu)
    relative = write_trace(staging, size)
    return store.commit(staging, record_for(staging, start=start, files=(relative,)))


def entries(root: Path) -> set[str]:
    return {p.name for p in root.iterdir()}


# -- layout and round trip ---------------------------------------------------------------------------


def test_commit_publishes_a_complete_capture(tmp_path: Path) -> None:
    root = tmp_path / "captures"
    with CaptureStore(root, quota_bytes=1 << 20, clock=lambda: T0, token=lambda: "00c0ff") as store:
        staging = store.begin(gpu=3)
        assert staging.id == "20231114T221320Z-gpu3-00c0ff"
        assert staging.path == root.resolve() / ".staging" / staging.id
        assert oct(staging.path.stat().st_mode & 0o777) == "0o700"
        xplane = write_trace(staging, 1000, host="node-1.example")
        with staging.new_file("node-1_4242.1700000000000", ".pt.trace.json.gz") as new:
            new.file.write(b"k" * 500)
            kineto = new.publish()
        assert store.list() == [], "nothing lists before commit"

        stored = store.commit(staging, record_for(staging))
        assert xplane == f"plugins/profile/{staging.id}/node-1.example.xplane.pb"
        assert kineto == "node-1_4242.1700000000000.pt.trace.json.gz"
        assert stored.bytes == 1500
        assert stored.files == (kineto, xplane)
        assert not staging.path.exists()
        directory = root / staging.id
        assert (directory / xplane).read_bytes() == b"x" * 1000
        on_disk = json.loads((directory / "capture.json").read_text())
        assert on_disk["id"] == staging.id and on_disk["bytes"] == 1500 and on_disk["outcome"] == "captured"
        assert on_disk["target"] == "tsl 127.0.0.1:6009"
        assert record_from_bytes((directory / "capture.json").read_bytes()) == stored

        assert store.list() == [stored] and store.get(staging.id) == stored
        assert store.path(staging.id) == directory.resolve()
        files = store.files(staging.id)
        record_size = (directory / "capture.json").stat().st_size
        assert [(f.relative, f.size) for f in files] == sorted([
            ("capture.json", record_size), (kineto, 500), (xplane, 1000)])
        assert all(f.path.read_bytes() for f in files)
        assert store.total_bytes() == sum(f.size for f in files)
        assert store.last_start() == T0 and store.last_start("failed") is None


def test_ids_name_the_gpu_or_the_pid(store: CaptureStore) -> None:
    by_gpu, by_pid, neither = store.begin(gpu=7), store.begin(pid=4242), store.begin()
    assert "-gpu7-" in by_gpu.id and "-pid4242-" in by_pid.id and "-node-" in neither.id
    for staging in (by_gpu, by_pid, neither):
        assert CAPTURE_ID.fullmatch(staging.id)
        store.abort(staging)


def test_an_id_collision_draws_again(tmp_path: Path) -> None:
    tokens = iter(["aaaaaa", "aaaaaa", "bbbbbb"])
    with CaptureStore(tmp_path, quota_bytes=1 << 20, clock=lambda: T0, token=lambda: next(tokens)) as store:
        first, second = store.begin(gpu=0), store.begin(gpu=0)
        assert (first.id[-6:], second.id[-6:]) == ("aaaaaa", "bbbbbb")


def test_list_is_newest_first_and_survives_a_restart(tmp_path: Path) -> None:
    root = tmp_path / "captures"
    with CaptureStore(root, quota_bytes=1 << 20) as store:
        old = add(store, 100, start=T0)
        new = add(store, 200, start=T0 + 60)
        mid = add(store, 300, start=T0 + 30)
        assert store.list() == [new, mid, old]
        total = store.total_bytes()
    with CaptureStore(root, quota_bytes=1 << 20) as reopened:
        assert reopened.list() == [new, mid, old]
        assert reopened.total_bytes() == total


def test_one_agent_per_store(tmp_path: Path) -> None:
    # The lock file names its holder, so that a second agent can say whose the store is.
    message = rf"in use by another gpuscope agent \(pid {os.getpid()}\); set capture.store.root"
    with CaptureStore(tmp_path, quota_bytes=1 << 20), \
            pytest.raises(CaptureStoreInUseError, match=message) as in_use:
        CaptureStore(tmp_path, quota_bytes=1 << 20)
    assert in_use.value.pid == os.getpid()
    CaptureStore(tmp_path, quota_bytes=1 << 20).close()  # released on close


def test_misuse_of_a_staging_is_refused_and_cleans_up(store: CaptureStore) -> None:
    staging = store.begin(gpu=0)
    write_trace(staging, 10)
    other = store.begin(gpu=1)
    with pytest.raises(CaptureStoreError, match="is not the staging id"):
        store.commit(staging, record_for(other))
    assert not staging.path.exists(), "a failed commit consumes the staging directory"
    with pytest.raises(CaptureStoreError, match="not in progress"):
        store.commit(staging, record_for(staging))
    store.commit(other, record_for(other))
    with pytest.raises(CaptureStoreError, match="not in progress"):
        store.commit(other, record_for(other))
    store.abort(other)  # after commit: nothing happens
    assert [r.id for r in store.list()] == [other.id]


# -- atomicity and crash leftovers -------------------------------------------------------------------


def test_an_uncommitted_staging_is_not_listed_and_is_cleaned_at_start_up(tmp_path: Path) -> None:
    root = tmp_path / "captures"
    store = CaptureStore(root, quota_bytes=1 << 20)
    kept = add(store, 100)
    staging = store.begin(gpu=1)
    write_trace(staging, 5000)
    (staging.path / "capture.json").write_text("{}")
    assert store.list() == [kept]
    store.close()  # the agent stops (or dies) mid-capture
    with CaptureStore(root, quota_bytes=1 << 20) as reopened:
        assert reopened.list() == [kept]
        assert list((root / ".staging").iterdir()) == []
        assert reopened.total_bytes() == store.total_bytes()


def test_abort_removes_the_files(store: CaptureStore) -> None:
    staging = store.begin(gpu=0)
    write_trace(staging, 100)
    store.abort(staging)
    store.abort(staging)
    assert not staging.path.exists() and store.list() == []


CRASH_SCRIPT = """
import os, sys
from pathlib import Path
from gpuscope.capture import store as m
from gpuscope.capture.model import CaptureRecord, Trigger
where = sys.argv[2]
store = m.CaptureStore(Path(sys.argv[1]), quota_bytes=1 << 20)
staging = store.begin(gpu=0)
(staging.path / "trace.pt.trace.json.gz").write_bytes(b"t" * 4096)
if where == "before-record":
    os._exit(9)  # killed between the trace files and capture.json
if where == "before-rename":
    m.os.rename = lambda *a: os._exit(9)  # killed after capture.json, before the publishing rename
record = CaptureRecord(id=staging.id, trigger=Trigger("user", user="u"), gpu=0, pids=(), targets=(),
                       start=1.0, duration_s=2.0, bytes=0, outcome="captured")
store.commit(staging, record)
if where == "mid-evict":
    real_rename = os.rename
    def rename_then_die(src, dst):
        real_rename(src, dst)  # the capture is in .trash, not yet removed
        os._exit(9)
    m.os.rename = rename_then_die
    store.delete(staging.id)
os._exit(0)
"""


@pytest.mark.parametrize("where", ["before-record", "before-rename", "mid-evict"])
def test_a_crash_leaves_nothing_that_lists(tmp_path: Path, where: str) -> None:
    root = tmp_path / "captures"
    with CaptureStore(root, quota_bytes=1 << 20) as store:
        kept = add(store, 100)
    result = subprocess.run([sys.executable, "-c", CRASH_SCRIPT, str(root), where], capture_output=True,
                            timeout=30, check=False)
    assert result.returncode == 9, result.stderr.decode()
    leftovers = [p for p in (root / ".staging").iterdir()] + [p for p in (root / ".trash").iterdir()]
    assert len(leftovers) == 1, "the crash left a half-written capture behind"
    if where == "before-rename":
        assert (leftovers[0] / "capture.json").exists(), "capture.json was written, but not published"
    with CaptureStore(root, quota_bytes=1 << 20) as reopened:
        assert reopened.list() == [kept]
        assert not leftovers[0].exists()
        assert entries(root) == {".lock", ".staging", ".trash", kept.id}


def test_directories_without_a_valid_record_are_removed_at_start_up(tmp_path: Path) -> None:
    root = tmp_path / "captures"
    with CaptureStore(root, quota_bytes=1 << 20) as store:
        kept = add(store, 100)
        broken = add(store, 100, gpu=1)
        mismatched = add(store, 100, gpu=2)
        missing = add(store, 100, gpu=3)
    (root / broken.id / "capture.json").write_text('{"id": "x", "version": 1')
    record = json.loads((root / mismatched.id / "capture.json").read_text())
    record["id"] = kept.id
    (root / mismatched.id / "capture.json").write_text(json.dumps(record))
    (root / missing.id / "capture.json").unlink()
    (root / "notes").mkdir()  # not named like a capture: left alone
    (root / "notes" / "keep.txt").write_text("mine")
    with CaptureStore(root, quota_bytes=1 << 20) as reopened:
        assert reopened.list() == [kept]
    assert entries(root) == {".lock", ".staging", ".trash", kept.id, "notes"}
    assert (root / "notes" / "keep.txt").read_text() == "mine"


def test_a_disk_error_while_writing_the_record_loses_nothing(store: CaptureStore,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    kept = add(store, 100)

    def full(path: Path, payload: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store_module, "_write_record", full)
    staging = store.begin(gpu=1)
    write_trace(staging, 100)
    with pytest.raises(CaptureStoreError, match=r"cannot write capture .*: No space left on device"):
        store.commit(staging, record_for(staging))
    assert not staging.path.exists()
    assert store.list() == [kept] and store.files(kept.id)


# -- hostile ids ---------------------------------------------------------------------------------------

VALID = "20231114T221320Z-gpu0-abcdef"


@pytest.mark.parametrize(("bad", "message"), [
    ("../x", "contains a path separator"),
    ("..", "contains '..' or starts with '.'"),
    (".staging", "contains '..' or starts with '.'"),
    ("/etc/passwd", "contains a path separator"),
    (f"../../{VALID}", "contains a path separator"),
    (f"{VALID}/../../x", "contains a path separator"),
    ("..\\x", "contains a path separator"),
    ("a\x00b", "contains a NUL character"),
    (VALID + "\x00", "contains a NUL character"),
    ("", "the capture id is empty"),
    ("2" * 200, "is too long (200 characters, at most 48)"),
    (VALID + "\n", "contains non-ASCII or control characters"),
    ("\uff12\uff10\uff12\uff13" + VALID[4:], "contains non-ASCII"),  # fullwidth digits
    (VALID[:-6] + "abcd\u0435f", "contains non-ASCII"),  # Cyrillic e
    (VALID.replace("-", "\u2010"), "contains non-ASCII"),  # Unicode hyphen
    (VALID.upper(), "is not of the form yyyymmddThhmmssZ-gpuN-xxxxxx"),
    (VALID + "0", "is not of the form"),
    (VALID.replace("gpu0", "gpu-1"), "is not of the form"),
    ("*", "is not of the form"),
    (VALID + " ", "is not of the form"),
    (42, "a capture id must be a string, got int"),
])
def test_hostile_ids_are_refused_with_the_problem_named(store: CaptureStore, bad: object,
                                                        message: str) -> None:
    kept = add(store, 100)
    before = sorted(p.relative_to(store.root) for p in store.root.rglob("*"))
    for call in (store.get, store.files, store.path, store.delete):
        with pytest.raises(CaptureIdError, match=re.escape(message)):
            call(bad)  # type: ignore[arg-type]
    assert sorted(p.relative_to(store.root) for p in store.root.rglob("*")) == before
    assert store.list() == [kept]


def test_well_formed_but_unknown_ids_are_not_found(store: CaptureStore) -> None:
    with pytest.raises(CaptureNotFoundError, match=f"no capture '{VALID}' in the store"):
        store.get(VALID)
    with pytest.raises(CaptureNotFoundError):
        store.delete(VALID)
    staging = store.begin(gpu=0)
    with pytest.raises(CaptureNotFoundError):
        store.get(staging.id)  # in progress is not complete
    store.abort(staging)


def test_a_capture_removed_by_hand_is_not_found(store: CaptureStore) -> None:
    record = add(store, 100)
    store_module._remove(store.root / record.id)
    with pytest.raises(CaptureNotFoundError, match="is gone from the store"):
        store.files(record.id)
    assert store.list() == [] and store.total_bytes() == 0


# -- symlinks --------------------------------------------------------------------------------------------


def test_a_symlink_inside_a_capture_is_refused(store: CaptureStore, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("do not serve")
    record = add(store, 100)
    os.symlink(secret, store.root / record.id / "plugins" / "link.xplane.pb")
    with pytest.raises(CaptureStoreError, match=r"symlink plugins/link.xplane.pb inside the capture store"):
        store.files(record.id)
    assert secret.read_text() == "do not serve"


def test_a_symlink_written_by_a_backend_fails_the_commit(store: CaptureStore, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("do not copy")
    staging = store.begin(gpu=0)
    write_trace(staging, 10)
    os.symlink(secret, staging.path / "escape.pt.trace.json.gz")
    with pytest.raises(CaptureStoreError, match=r"symlink escape\.pt\.trace\.json\.gz inside the capture"):
        store.commit(staging, record_for(staging))
    assert not staging.path.exists() and store.list() == []
    assert secret.read_text() == "do not copy"


def test_a_capture_directory_that_is_a_symlink_is_dropped_at_start_up(tmp_path: Path) -> None:
    root = tmp_path / "captures"
    with CaptureStore(root, quota_bytes=1 << 20) as store:
        record = add(store, 100)
    outside = tmp_path / "outside"
    (root / record.id).rename(outside)
    os.symlink(outside, root / record.id)
    with CaptureStore(root, quota_bytes=1 << 20) as reopened:
        assert reopened.list() == []
        with pytest.raises(CaptureNotFoundError):
            reopened.files(record.id)
    assert not os.path.lexists(root / record.id), "the link is removed"
    assert (outside / "capture.json").exists(), "what it pointed to is untouched"


def test_a_staging_area_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "captures", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("keep")
    os.symlink(elsewhere, root / ".staging")
    with pytest.raises(CaptureStoreError, match=r"\.staging is not a directory \(or is a symlink"):
        CaptureStore(root, quota_bytes=1 << 20)
    assert (elsewhere / "precious").read_text() == "keep"
    CaptureStore(tmp_path / "captures2", quota_bytes=1 << 20).close()  # and the lock was released


def test_a_root_behind_a_symlink_is_resolved_once(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    with CaptureStore(tmp_path / "link", quota_bytes=1 << 20) as store:
        record = add(store, 10)
        assert store.root == real
        assert (real / record.id / "capture.json").exists()


# -- quota -------------------------------------------------------------------------------------------------


def test_the_oldest_captures_are_evicted_to_make_room(tmp_path: Path) -> None:
    with CaptureStore(tmp_path, quota_bytes=10_000) as store:  # a capture.json is 700-900 bytes here
        oldest = add(store, 2000, start=T0)
        middle = add(store, 2000, start=T0 + 20)
        newer = add(store, 2000, start=T0 + 10)  # committed last, but started before `middle`
        assert store.list() == [middle, newer, oldest]
        newest = add(store, 2000, start=T0 + 30)
        assert store.list() == [newest, middle, newer]
        assert not (tmp_path / oldest.id).exists() and list((tmp_path / ".trash").iterdir()) == []
        assert store.total_bytes() <= 10_000
        big = add(store, 5000, start=T0 + 40)
        assert store.list() == [big, newest]
        assert store.total_bytes() <= 10_000
        assert store.total_bytes() == sum(f.size for r in store.list() for f in store.files(r.id))


def test_a_capture_larger_than_the_quota_is_refused_and_nothing_is_evicted(tmp_path: Path) -> None:
    with CaptureStore(tmp_path, quota_bytes=10_000) as store:
        first = add(store, 4000, start=T0)
        second = add(store, 4000, start=T0 + 1)
        before = {r.id: [(f.relative, f.path.read_bytes()) for f in store.files(r.id)] for r in store.list()}
        staging = store.begin(gpu=0)
        # Written by hand (not through a staging file, which would have stopped it): commit refuses it.
        (staging.path / "big.bin").write_bytes(b"x" * 10_001)
        with pytest.raises(CaptureQuotaError) as caught:
            store.commit(staging, record_for(staging))
        message = str(caught.value)
        assert re.match(f"capture {staging.id} is 10.[0-9] KiB, larger than the whole store quota of "
                        r"9.8 KiB \(capture.store.quota_bytes\)", message), message
        assert message.endswith("it was not stored and no other capture was evicted")
        assert not staging.path.exists()
        assert store.list() == [second, first]
        assert {r.id: [(f.relative, f.path.read_bytes()) for f in store.files(r.id)]
                for r in store.list()} == before


def test_delete(store: CaptureStore) -> None:
    kept, gone = add(store, 100), add(store, 200, start=T0 + 1)
    store.delete(gone.id)
    assert store.list() == [kept] and not (store.root / gone.id).exists()


# -- threads -------------------------------------------------------------------------------------------------


def test_concurrent_commits(tmp_path: Path) -> None:
    with CaptureStore(tmp_path, quota_bytes=1 << 20) as store:
        barrier = threading.Barrier(8)
        published: list[CaptureRecord] = []
        lock = threading.Lock()

        def capture(n: int) -> None:
            barrier.wait()
            for i in range(5):
                record = add(store, 1000 + n, start=T0 + n * 10 + i, gpu=n)
                with lock:
                    published.append(record)
                store.list()
                store.total_bytes()

        threads = [threading.Thread(target=capture, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len({r.id for r in published}) == 40
        assert sorted(r.id for r in store.list()) == sorted(r.id for r in published)
        assert store.total_bytes() == sum(f.size for r in published for f in store.files(r.id))


def test_concurrent_commits_under_a_tight_quota(tmp_path: Path) -> None:
    quota = 12_000
    with CaptureStore(tmp_path, quota_bytes=quota) as store:
        barrier = threading.Barrier(6)

        def capture(n: int) -> None:
            barrier.wait()
            for i in range(6):
                add(store, 3000, start=T0 + i * 10 + n, gpu=n)

        threads = [threading.Thread(target=capture, args=(n,)) for n in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        listed = store.list()
        assert store.total_bytes() <= quota
        assert {p.name for p in tmp_path.iterdir() if not p.name.startswith(".")} == {r.id for r in listed}
        assert store.total_bytes() == sum(f.size for r in listed for f in store.files(r.id))
        # Eviction takes the oldest start first, so the capture that started last is never evicted.
        assert max(r.start for r in listed) == T0 + 5 * 10 + 5


# -- room while writing: the quota and the file system's free space ---------------------------------------


class Disk:
    """A file system of ``size`` bytes holding ``other`` bytes of other programs' files and what the
    store's root holds (measured): what CaptureStore's ``free_bytes`` reads."""

    def __init__(self, size: int, other: int = 0) -> None:
        self.size, self.other = size, other

    def __call__(self, root: Path) -> int:
        used = sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())
        return max(0, self.size - self.other - used)


def staged_bytes(staging: Staging) -> int:
    return sum(p.stat().st_size for p in staging.path.rglob("*") if p.is_file())


def test_a_trace_over_the_quota_stops_before_it_reaches_the_disk(tmp_path: Path) -> None:
    with CaptureStore(tmp_path, quota_bytes=10_000) as store:
        kept = add(store, 4000, start=T0)
        staging = store.begin(gpu=0)
        with pytest.raises(CaptureQuotaError, match=r"would be larger than the whole store quota of 9.8 KiB "
                                                     r"\(capture.store.quota_bytes\): it was stopped at 0 B"):
            write_trace(staging, 10_001)  # one write of it all: refused before a byte is written
        assert staging.agent_failure is not None and staged_bytes(staging) == 0
        with staging.new_file("chunks", ".bin") as new:
            new.file.write(b"x" * 6000)
            with pytest.raises(CaptureQuotaError, match=r"stopped at 5\.9 KiB"):
                new.file.write(b"x" * 5000)
            assert staged_bytes(staging) == 6000  # not a byte of the refused chunk
        store.abort(staging)
        assert store.list() == [kept]


def test_min_free_bytes_evicts_the_oldest_then_stops_the_capture(tmp_path: Path) -> None:
    disk = Disk(size=100_000, other=60_000)  # 40 kB left for the store
    with CaptureStore(tmp_path, quota_bytes=1 << 30, min_free_bytes=20_000, free_bytes=disk) as store:
        old = add(store, 8000, start=T0)
        new = add(store, 8000, start=T0 + 1)  # 16 kB used (and two small records): about 24 kB free
        staging = store.begin(gpu=0)
        with staging.new_file("trace", ".bin") as file:
            file.file.write(b"x" * 9000)  # 24 kB - 9 kB < 20 kB: the oldest capture makes room
            assert store.list() == [new]
            file.file.write(b"x" * 9000)  # and then the next oldest
            assert store.list() == []
            with pytest.raises(CaptureDiskError, match=r"has .* free: 8.8 KiB more would leave less than "
                                                       r"capture.store.min_free_bytes \(19.5 KiB\), and no "
                                                       "older capture is left to evict"):
                file.file.write(b"x" * 9000)
        assert isinstance(staging.agent_failure, CaptureDiskError)
        store.abort(staging)
        assert old.id not in entries(tmp_path)


def test_a_write_error_of_the_agents_disk_is_noted(tmp_path: Path) -> None:
    with CaptureStore(tmp_path, quota_bytes=1 << 20) as store:
        staging = store.begin(gpu=0)
        with staging.new_file("trace", ".bin") as new, open("/dev/full", "wb", buffering=0) as full:
            # The writer's file replaced by /dev/full: writes fail as a full disk's do (ENOSPC).
            new.file._inner.close()  # type: ignore[attr-defined]
            new.file._inner = full  # type: ignore[attr-defined]
            with pytest.raises(CaptureDiskError, match="cannot write to the capture store: No space left"):
                new.file.write(b"x" * 10)
        assert isinstance(staging.agent_failure, CaptureDiskError)
        store.abort(staging)


def test_the_store_restores_min_free_bytes_at_start(tmp_path: Path) -> None:
    with CaptureStore(tmp_path, quota_bytes=1 << 30) as store:
        old, new = add(store, 8000, start=T0), add(store, 8000, start=T0 + 1)
    disk = Disk(size=100_000, other=75_000)  # something else filled the disk while the agent was down
    with CaptureStore(tmp_path, quota_bytes=1 << 30, min_free_bytes=12_000, free_bytes=disk) as reopened:
        assert reopened.list() == [new]
        assert old.id not in entries(tmp_path)

"""The alert event log: JSON lines, size rotation, and failures that never reach the sampler thread."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpuscope.alerts.config import EventLogConfig
from gpuscope.alerts.eventlog import SCHEMA_VERSION, AlertEventLog
from gpuscope.alerts.model import Transition, TransitionState

AT = 1_700_000_000.0


@dataclass
class FakeClock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


def transition(n: int = 0, state: TransitionState = "firing", **values: float) -> Transition:
    return Transition(
        name="GpuLowUtilization", gpu=n % 8, uuid=f"GPU-{n % 8:08d}", severity="warning", hostname="node-1",
        previous="pending", state=state, at=AT + n, active_since=AT - 120, values=values or {"mean": 0.5},
        summary=f"transition {n}: GPU mean utilization 50% < 80% over 2m", labels={"n": str(n)},
    )


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


class Synced:
    """An AlertEventLog whose every call waits until its worker thread has handled the line, so that
    a test can look at the file (and the counters) right after it."""

    def __init__(self, log: AlertEventLog) -> None:
        self.log = log

    def __call__(self, transition: Transition) -> None:
        self.log(transition)
        assert self.log.flush(timeout=10)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.log, name)


@pytest.fixture
def make_log(clock: FakeClock) -> Iterator[Any]:
    logs: list[AlertEventLog] = []

    def make(path: Path, **config: Any) -> Synced:
        log = AlertEventLog(EventLogConfig(path=str(path), **config), clock=clock, retry_seconds=30.0)
        logs.append(log)
        return Synced(log)

    yield make
    for log in logs:
        log.close()


def test_lines_are_json_transitions_with_a_schema_version(tmp_path: Path, make_log: Any) -> None:
    path = tmp_path / "deep" / "er" / "alerts.jsonl"  # the parent directories are created
    log = make_log(path)
    first, second = transition(1), transition(2, state="resolved")
    log(first)
    # Flushed line by line: a reader sees the line before the next transition or close().
    assert read_lines(path) == [{"version": SCHEMA_VERSION, **json.loads(json.dumps(first.to_json()))}]
    log(second)
    lines = read_lines(path)
    assert [line["to"] for line in lines] == ["firing", "resolved"]
    assert lines[1]["from"] == "pending"
    assert lines[1]["alertname"] == "GpuLowUtilization"
    assert lines[1]["labels"] == {"n": "2"}
    assert path.read_bytes().endswith(b"\n")
    assert log.lines_written == 2 and log.errors == 0


def test_non_finite_values_are_written_as_null(tmp_path: Path, make_log: Any) -> None:
    path = tmp_path / "alerts.jsonl"
    make_log(path)(transition(1, spread=float("nan"), peak=float("-inf"), mean=0.25))
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert read_lines(path)[0]["values"] == {"spread": None, "peak": None, "mean": 0.25}


def test_appends_to_an_existing_log(tmp_path: Path, make_log: Any) -> None:
    path = tmp_path / "alerts.jsonl"
    path.write_text('{"earlier": true}\n{"cut": ')  # a line cut short by a crash or a full disk
    make_log(path)(transition(1))
    text = path.read_text().splitlines()
    assert text[:2] == ['{"earlier": true}', '{"cut": ']
    assert json.loads(text[2])["summary"].startswith("transition 1:")


@pytest.mark.parametrize("backups", [0, 1, 3])
def test_rotation_keeps_n_backups_and_loses_no_line(tmp_path: Path, make_log: Any, backups: int) -> None:
    path = tmp_path / "alerts.jsonl"
    log = make_log(path, max_bytes=4096, backups=backups)
    line_bytes = len(json.dumps({"version": 1, **transition(100).to_json()})) + 1
    per_file = 4096 // line_bytes
    total = per_file * (backups + 3) + 2  # enough for more rotations than backups
    for n in range(total):
        log(transition(n))
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["alerts.jsonl"] + [f"alerts.jsonl.{i}" for i in range(1, backups + 1)]
    assert all(f.stat().st_size <= 4096 for f in files)
    # Oldest first: path.N ... path.1, path: the kept lines are the newest ones, contiguous, none missing.
    kept = [line["labels"]["n"] for f in reversed(files[1:]) for line in read_lines(f)] + [
        line["labels"]["n"] for line in read_lines(path)]
    numbers = [int(n) for n in kept]
    assert numbers == list(range(total - len(numbers), total))
    assert len(numbers) >= per_file * backups + 1
    assert log.lines_written == total


def test_rotation_loses_no_line_while_backups_remain(tmp_path: Path, make_log: Any) -> None:
    path = tmp_path / "alerts.jsonl"
    log = make_log(path, max_bytes=4096, backups=5)
    for n in range(40):  # about three files' worth
        log(transition(n))
    files = sorted(tmp_path.iterdir())
    assert 3 <= len(files) <= 5
    kept = [int(line["labels"]["n"]) for f in reversed(files[1:]) for line in read_lines(f)]
    assert kept + [int(line["labels"]["n"]) for line in read_lines(path)] == list(range(40))


def test_rotation_with_many_files_is_in_order(tmp_path: Path, make_log: Any) -> None:
    path = tmp_path / "alerts.jsonl"
    log = make_log(path, max_bytes=4096, backups=2)
    for n in range(200):
        log(transition(n))
    firsts = [read_lines(tmp_path / name)[0]["labels"]["n"] for name in
              ("alerts.jsonl.2", "alerts.jsonl.1", "alerts.jsonl")]
    assert [int(n) for n in firsts] == sorted(int(n) for n in firsts)


def _unwritable(tmp_path: Path) -> Path:
    if os.geteuid() == 0:
        # root writes through permissions: a path under a regular file cannot be created by anyone.
        blocker = tmp_path / "not-a-dir"
        blocker.write_text("")
        return blocker / "alerts.jsonl"
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    return locked / "sub" / "alerts.jsonl"


def test_unwritable_path_is_logged_once_counted_and_never_raises(
        tmp_path: Path, make_log: Any, clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    path = _unwritable(tmp_path)
    log = make_log(path)
    with caplog.at_level(logging.DEBUG, logger="gpuscope.alerts.eventlog"):
        for n in range(5):
            log(transition(n))  # no exception
            clock.now += 40  # past the retry delay: every call tries again
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert str(path) in warnings[0].getMessage()
    assert log.errors == 5
    assert log.lines_written == 0


def test_retries_after_the_delay_and_writes_what_was_buffered(
        tmp_path: Path, make_log: Any, clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "logs"
    blocker.write_text("")  # a file where the directory should be: unwritable, for root too
    path = blocker / "alerts.jsonl"
    log = make_log(path)
    log(transition(0))
    assert log.errors == 1
    log(transition(1))
    log(transition(2))
    assert log.errors == 1, "no retry before the delay: the sampler thread does not pay for it"
    blocker.unlink()
    clock.now += 31
    with caplog.at_level(logging.INFO, logger="gpuscope.alerts.eventlog"):
        log(transition(3))
    assert [line["labels"]["n"] for line in read_lines(path)] == ["0", "1", "2", "3"]
    assert "writable again" in caplog.text
    # A second outage is logged again (once).
    caplog.clear()
    log.close()
    log2 = make_log(path)
    path.unlink()
    path.mkdir()  # a directory where the file should be
    with caplog.at_level(logging.WARNING, logger="gpuscope.alerts.eventlog"):
        log2(transition(4))
        clock.now += 31
        log2(transition(5))
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_existing_lines_survive_an_outage(tmp_path: Path, make_log: Any, clock: FakeClock) -> None:
    path = tmp_path / "alerts.jsonl"
    log = make_log(path, max_bytes=4096, backups=1)
    log(transition(0))
    log(transition(1))
    # The file is moved away and something unwritable takes its place (a directory: for root too).
    saved = path.read_bytes()
    path.unlink()
    path.mkdir()
    log(transition(2))
    assert log.errors == 1
    path.rmdir()
    path.write_bytes(saved)
    clock.now += 31
    log(transition(3))
    assert [line["labels"]["n"] for line in read_lines(path)] == ["0", "1", "2", "3"]


def test_buffer_is_bounded_during_an_outage(tmp_path: Path, clock: FakeClock) -> None:
    blocker = tmp_path / "logs"
    blocker.write_text("")
    path = blocker / "alerts.jsonl"
    log = AlertEventLog(EventLogConfig(path=str(path)), clock=clock, buffer_lines=3)
    for n in range(10):
        log(transition(n))
    assert log.flush(timeout=10)
    assert log.dropped == 7 and log.errors >= 1
    blocker.unlink()
    clock.now += 31
    log(transition(10))  # the oldest of the three is dropped for it
    log.close()
    assert [line["labels"]["n"] for line in read_lines(path)] == ["8", "9", "10"]
    assert log.dropped == 8


def test_a_file_moved_away_is_noticed_and_the_path_reopened(tmp_path: Path, make_log: Any) -> None:
    path = tmp_path / "alerts.jsonl"
    log = make_log(path)
    log(transition(0))
    path.rename(tmp_path / "alerts.jsonl.old")  # what an external logrotate does
    log(transition(1))
    assert [line["labels"]["n"] for line in read_lines(tmp_path / "alerts.jsonl.old")] == ["0"]
    assert [line["labels"]["n"] for line in read_lines(path)] == ["1"]


def test_close_is_idempotent_and_later_transitions_are_ignored(tmp_path: Path, make_log: Any) -> None:
    path = tmp_path / "alerts.jsonl"
    log = make_log(path)
    log(transition(0))
    log.close()
    log.close()
    log(transition(1))
    assert len(read_lines(path)) == 1


def test_a_path_is_required() -> None:
    with pytest.raises(ValueError, match=r"event_log\.path"):
        AlertEventLog(EventLogConfig())


def test_thread_safe(tmp_path: Path, make_log: Any) -> None:
    path = tmp_path / "alerts.jsonl"
    log = make_log(path, max_bytes=64 * 1024, backups=50)
    threads = [threading.Thread(target=lambda k=k: [log(transition(k * 1000 + n)) for n in range(200)])
               for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = [line for f in tmp_path.iterdir() for line in read_lines(f)]
    assert sorted(int(line["labels"]["n"]) for line in lines) == sorted(
        k * 1000 + n for k in range(4) for n in range(200))


def test_a_hanging_disk_never_holds_up_the_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler thread calls the log; a write that hangs (a hung NFS mount) holds only the log's
    own worker thread, and close() gives up on it after a second."""
    released = threading.Event()
    entered = threading.Event()
    real_open = AlertEventLog._open

    def hanging_open(self: AlertEventLog) -> None:
        entered.set()
        released.wait(timeout=30)
        real_open(self)

    monkeypatch.setattr(AlertEventLog, "_open", hanging_open)
    log = AlertEventLog(EventLogConfig(path=str(tmp_path / "alerts.jsonl")))
    try:
        log(transition(0))
        assert entered.wait(timeout=10)  # the worker is stuck in the write
        started = time.monotonic()
        for n in range(1, 200):
            log(transition(n))
        assert time.monotonic() - started < 0.5
        assert not log.flush(timeout=0.2)
        started = time.monotonic()
        log.close()
        assert time.monotonic() - started < 2.0
    finally:
        released.set()


def test_an_unexpected_error_in_the_writer_keeps_the_lines_and_the_writer(
        tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "alerts.jsonl"
    real_open = AlertEventLog._open
    calls: list[int] = []

    def failing_once(self: AlertEventLog) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug in the writer")
        real_open(self)

    monkeypatch.setattr(AlertEventLog, "_open", failing_once)
    log = AlertEventLog(EventLogConfig(path=str(path)), clock=clock, retry_seconds=30.0)
    try:
        with caplog.at_level(logging.ERROR, logger="gpuscope.alerts.eventlog"):
            log(transition(0))
            assert log.flush(timeout=10)
        assert "writing failed unexpectedly" in caplog.text and log.errors == 1
        clock.now += 31
        log(transition(1))
        assert log.flush(timeout=10)
        assert [line["labels"]["n"] for line in read_lines(path)] == ["0", "1"]  # nothing lost
    finally:
        log.close()

"""ProcessInspector against real child processes, fake /proc trees and fake psutil processes."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from gpuscope.host.cgroup import read_container_id
from gpuscope.host.processes import (
    PROC_PID_INIT_INO,
    HostProcess,
    ProcessInspector,
    in_host_pid_namespace,
)
from gpuscope.snapshot import SlurmJob

FIXTURES = Path(__file__).parent / "fixtures" / "cgroup"
SLURM_FIXTURES = Path(__file__).parent / "fixtures" / "slurm"
DOCKER_ID = "d548c5b83fa61d8e3bd86ad42a7ffea9b7c86e3f9d8095c1577d3e1270bb9420"

pytestmark = pytest.mark.timeout(60)

# Both ways a cached answer is checked: a pidfd poll (default) and the start time in /proc/<pid>/stat.
CHECKS = [pytest.param(os.pidfd_open, id="pidfd"), pytest.param(None, id="start-time")]

# A child that renames itself (PR_SET_NAME) to each name it reads on stdin and answers "ok".
RENAMER = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
for line in sys.stdin:
    if libc.prctl(15, ctypes.c_char_p(line.strip().encode()), 0, 0, 0) != 0:
        sys.exit(ctypes.get_errno())
    print("ok", flush=True)
"""


def current_user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def is_zombie(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return stat[stat.rindex(b")") + 2 :].startswith(b"Z")


class Children:
    """Spawns children and kills and reaps every one of them at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def sleep(self, seconds: int = 60) -> subprocess.Popen[str]:
        proc = self._spawn(["sleep", str(seconds)])
        # Popen returns before the child's exec completes; what the inspector reads at first sight
        # is what it keeps, so wait for the exec (NVML only reports a process after its CUDA init).
        wait_for(lambda: Path(f"/proc/{proc.pid}/cmdline").read_bytes() == f"sleep\0{seconds}\0".encode())
        return proc

    def renamer(self, first_name: str) -> subprocess.Popen[str]:
        proc = self._spawn([sys.executable, "-c", RENAMER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        rename(proc, first_name)
        return proc

    def _spawn(self, argv: list[str], **kwargs: object) -> subprocess.Popen[str]:
        proc: subprocess.Popen[str] = subprocess.Popen(argv, text=True, **kwargs)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    def cleanup(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout=10)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()


def rename(proc: subprocess.Popen[str], name: str) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(name + "\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "ok"


@pytest.fixture
def children() -> Iterator[Children]:
    spawned = Children()
    try:
        yield spawned
    finally:
        spawned.cleanup()


def fake_procfs(
    root: Path, pids: list[int], *, cgroup: str | None = None, ns_inode: int | None = None
) -> Path:
    """A /proc tree with our pid namespace link and, per pid, a copy of its stat and a cgroup file."""
    ns = root / "self" / "ns"
    ns.mkdir(parents=True)
    os.symlink(f"pid:[{PROC_PID_INIT_INO if ns_inode is None else ns_inode}]", ns / "pid")
    for pid in pids:
        (root / str(pid)).mkdir()
        shutil.copyfile(f"/proc/{pid}/stat", root / str(pid) / "stat")
        (root / str(pid) / "cgroup").write_text(cgroup if cgroup is not None else "0::/\n")
    return root


def bump_start_time(procfs: Path, pid: int) -> None:
    """Rewrite field 22 of the fake stat file, as if another process now held the pid."""
    path = procfs / str(pid) / "stat"
    data = path.read_text()
    head, _, tail = data.rpartition(")")
    fields = tail.split(" ")
    fields[20] = str(int(fields[20]) + 1)  # tail starts with the space before field 3
    path.write_text(head + ")" + " ".join(fields))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# --- real processes ------------------------------------------------------------------------------


@pytest.mark.parametrize("pidfd_open", CHECKS)
def test_describes_a_running_child(children: Children, pidfd_open: Callable[[int], int] | None) -> None:
    child = children.sleep()
    with ProcessInspector(host_pid_namespace=True, pidfd_open=pidfd_open) as inspector:
        info = inspector.describe(child.pid)
        assert info.visible
        assert (info.name, info.user) == ("sleep", current_user())
        assert info.container_id == read_container_id(child.pid)  # whatever this machine runs in
        assert info.cmdline is None  # not collected unless opted in: it can hold secrets
        assert inspector.describe(child.pid) is info  # cached


def test_container_id_comes_from_the_cgroup_file(children: Children, tmp_path: Path) -> None:
    child = children.sleep()
    procfs = fake_procfs(tmp_path, [child.pid], cgroup=(FIXTURES / "docker_systemd_v2.txt").read_text())
    with ProcessInspector(procfs=procfs) as inspector:
        assert inspector.describe(child.pid).container_id == DOCKER_ID


def test_slurm_job_comes_from_the_cgroup_file(children: Children, tmp_path: Path) -> None:
    child = children.sleep()
    procfs = fake_procfs(tmp_path, [child.pid], cgroup=(SLURM_FIXTURES / "v1_task.txt").read_text())
    with ProcessInspector(procfs=procfs) as inspector:
        assert inspector.describe(child.pid).slurm_job == SlurmJob("4242", "0", 1000)


def test_slurm_uid_left_out_without_users(children: Children, tmp_path: Path) -> None:
    child = children.sleep()
    procfs = fake_procfs(tmp_path, [child.pid], cgroup=(SLURM_FIXTURES / "v1_task.txt").read_text())
    with ProcessInspector(procfs=procfs, include_user=False) as inspector:
        info = inspector.describe(child.pid)
        assert info.user is None
        assert info.slurm_job == SlurmJob("4242", "0")


def test_host_process_has_no_container_id(children: Children, tmp_path: Path) -> None:
    child = children.sleep()
    procfs = fake_procfs(tmp_path, [child.pid], cgroup=(FIXTURES / "host_sshd_v2.txt").read_text())
    with ProcessInspector(procfs=procfs) as inspector:
        info = inspector.describe(child.pid)
        assert info.visible
        assert info.container_id is None
        assert info.slurm_job is None


def test_cmdline_only_when_opted_in(children: Children) -> None:
    child = children.sleep(61)
    with ProcessInspector(host_pid_namespace=True) as default:
        assert default.describe(child.pid).cmdline is None
    with ProcessInspector(host_pid_namespace=True, include_cmdline=True) as opted_in:
        assert opted_in.describe(child.pid).cmdline == ("sleep", "61")


def test_name_is_the_comm_set_with_prctl(children: Children) -> None:
    child = children.renamer("gs-renamed")
    with ProcessInspector(host_pid_namespace=True) as inspector:
        assert inspector.describe(child.pid).name == "gs-renamed"


@pytest.mark.parametrize("pidfd_open", CHECKS)
def test_child_that_exited_becomes_invisible(
    children: Children, pidfd_open: Callable[[int], int] | None
) -> None:
    child = children.sleep()
    with ProcessInspector(host_pid_namespace=True, pidfd_open=pidfd_open) as inspector:
        assert inspector.describe(child.pid).visible
        child.kill()
        child.wait(timeout=10)
        assert inspector.describe(child.pid) == HostProcess(visible=False)
        assert inspector.describe(child.pid) == HostProcess(visible=False)


def test_pid_that_exited_before_first_sight_is_invisible(children: Children) -> None:
    child = children.sleep()
    child.kill()
    child.wait(timeout=10)
    with ProcessInspector(host_pid_namespace=True) as inspector:
        assert inspector.describe(child.pid) == HostProcess(visible=False)


@pytest.mark.parametrize("pidfd_open", CHECKS)
def test_zombie_keeps_what_was_known(children: Children, pidfd_open: Callable[[int], int] | None) -> None:
    child = children.sleep()
    with ProcessInspector(host_pid_namespace=True, include_cmdline=True, pidfd_open=pidfd_open) as inspector:
        before = inspector.describe(child.pid)
        child.send_signal(signal.SIGKILL)  # not reaped: stays a zombie until cleanup
        wait_for(lambda: is_zombie(child.pid))
        assert inspector.describe(child.pid) == before
        assert before.name == "sleep"
        assert before.cmdline == ("sleep", "60")


def test_zombie_seen_first_keeps_the_readable_fields(children: Children) -> None:
    child = children.sleep()
    child.send_signal(signal.SIGKILL)
    wait_for(lambda: is_zombie(child.pid))
    with ProcessInspector(host_pid_namespace=True, include_cmdline=True) as inspector:
        info = inspector.describe(child.pid)
    # A zombie's name and owner remain in /proc; its command line is gone.
    assert info == HostProcess(visible=True, name="sleep", user=current_user(), cmdline=None)


def test_reused_pid_is_read_afresh(children: Children, tmp_path: Path) -> None:
    # Pid reuse simulated by a start time that no longer matches the cache key.
    child = children.renamer("gs-first")
    procfs = fake_procfs(tmp_path, [child.pid])
    with ProcessInspector(procfs=procfs, pidfd_open=None) as inspector:
        assert inspector.describe(child.pid).name == "gs-first"
        rename(child, "gs-second")
        # Same start time: the cached answer stands (what was read at first sight).
        assert inspector.describe(child.pid).name == "gs-first"
        bump_start_time(procfs, child.pid)
        assert inspector.describe(child.pid).name == "gs-second"


def test_pidfd_vouches_for_the_process_without_reading_stat(children: Children, tmp_path: Path) -> None:
    # While the pidfd says the process runs, the start time is not consulted at all: the pidfd
    # refers to that process, not to its pid number, so reuse cannot fool it.
    child = children.renamer("gs-first")
    procfs = fake_procfs(tmp_path, [child.pid])
    with ProcessInspector(procfs=procfs) as inspector:
        assert inspector.describe(child.pid).name == "gs-first"
        rename(child, "gs-second")
        bump_start_time(procfs, child.pid)
        assert inspector.describe(child.pid).name == "gs-first"


def test_pid_changing_hands_while_read_is_not_cached(children: Children, tmp_path: Path) -> None:
    child = children.sleep()
    procfs = fake_procfs(tmp_path, [child.pid])
    calls: list[int] = []

    def factory(pid: int) -> psutil.Process:
        calls.append(pid)
        if len(calls) == 1:
            bump_start_time(procfs, pid)  # the pid is reused between the two start-time reads
        return psutil.Process(pid)

    with ProcessInspector(procfs=procfs, process_factory=factory) as inspector:
        assert inspector.describe(child.pid) == HostProcess(visible=False)
        assert inspector.describe(child.pid).name == "sleep"
        assert inspector.describe(child.pid).name == "sleep"
    assert len(calls) == 2  # the consistent second read was cached


# --- PID namespaces ------------------------------------------------------------------------------


def test_outside_the_host_pid_namespace_everything_is_invisible(
    children: Children, caplog: pytest.LogCaptureFixture
) -> None:
    child = children.sleep()
    caplog.set_level(logging.DEBUG, logger="gpuscope.host.processes")
    with ProcessInspector(host_pid_namespace=False) as inspector:
        assert not inspector.host_pid_namespace
        for _ in range(3):
            assert inspector.describe(child.pid) == HostProcess(visible=False)
            assert inspector.describe(os.getpid()) == HostProcess(visible=False)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "hostPID: true" in warnings[0].getMessage()


def test_namespace_is_detected_from_the_pid_ns_link(children: Children, tmp_path: Path) -> None:
    child = children.sleep()
    host = fake_procfs(tmp_path / "host", [child.pid], ns_inode=4026531836)
    pod = fake_procfs(tmp_path / "pod", [child.pid], ns_inode=4026532555)
    assert in_host_pid_namespace(host)
    assert not in_host_pid_namespace(pod)
    with ProcessInspector(procfs=host) as inspector:
        assert inspector.describe(child.pid).visible
    with ProcessInspector(procfs=pod) as inspector:
        assert not inspector.host_pid_namespace
        assert inspector.describe(child.pid) == HostProcess(visible=False)


def test_unreadable_or_odd_ns_link_counts_as_host(tmp_path: Path) -> None:
    assert in_host_pid_namespace(tmp_path)  # no self/ns/pid at all
    (tmp_path / "self" / "ns").mkdir(parents=True)
    os.symlink("something-else", tmp_path / "self" / "ns" / "pid")
    assert in_host_pid_namespace(tmp_path)


def test_override_beats_detection(children: Children, tmp_path: Path) -> None:
    child = children.sleep()
    pod = fake_procfs(tmp_path, [child.pid], ns_inode=4026532555)
    with ProcessInspector(procfs=pod, host_pid_namespace=True) as inspector:
        assert inspector.describe(child.pid).visible


def test_this_machine_namespace_detection_runs() -> None:
    # Value depends on where the tests run; it must agree with the kernel's own link.
    inode = int(os.readlink("/proc/self/ns/pid").split("[")[1].rstrip("]"))
    assert in_host_pid_namespace() == (inode == PROC_PID_INIT_INO)


# --- denied and vanishing fields (fake psutil processes) -----------------------------------------


class FakeProcess:
    """Stands in for psutil.Process; a field set to an exception raises it."""

    def __init__(self, pid: int, **fields: object) -> None:
        self.pid = pid
        self.fields: dict[str, object] = {"name": "fake", "username": "alice", "cmdline": ["fake", "--x"]}
        self.fields.update(fields)

    @contextlib.contextmanager
    def oneshot(self) -> Iterator[None]:
        yield

    def _get(self, field: str) -> object:
        value = self.fields[field]
        if isinstance(value, BaseException):
            raise value
        return value

    def name(self) -> object:
        return self._get("name")

    def username(self) -> object:
        return self._get("username")

    def cmdline(self) -> object:
        return self._get("cmdline")


class CountingFactory:
    def __init__(self, **fields: object) -> None:
        self.fields = fields
        self.calls = 0

    def __call__(self, pid: int) -> FakeProcess:
        self.calls += 1
        return FakeProcess(pid, **self.fields)


def fake_inspector(factory: Callable[[int], object], **kwargs: object) -> ProcessInspector:
    return ProcessInspector(host_pid_namespace=True, process_factory=factory, **kwargs)  # type: ignore[arg-type]


def test_denied_user_keeps_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="gpuscope.host.processes")
    factory = CountingFactory(username=psutil.AccessDenied(os.getpid()))
    with fake_inspector(factory, include_cmdline=True) as inspector:
        for _ in range(5):
            info = inspector.describe(os.getpid())
            assert info.visible
            assert (info.name, info.user, info.cmdline) == ("fake", None, ("fake", "--x"))
    assert factory.calls == 1
    assert len([r for r in caplog.records if "user not readable" in r.getMessage()]) == 1


def test_denied_cmdline_keeps_the_rest() -> None:
    factory = CountingFactory(cmdline=psutil.AccessDenied(os.getpid()))
    with fake_inspector(factory, include_cmdline=True) as inspector:
        info = inspector.describe(os.getpid())
    assert (info.visible, info.name, info.user, info.cmdline) == (True, "fake", "alice", None)


def test_cmdline_not_even_read_unless_opted_in() -> None:
    factory = CountingFactory(cmdline=AssertionError("cmdline must not be read"))
    with fake_inspector(factory) as inspector:
        assert inspector.describe(os.getpid()).user == "alice"


def test_user_names_not_even_read_when_turned_off() -> None:
    factory = CountingFactory(username=AssertionError("the user name must not be read"))
    with fake_inspector(factory, include_user=False) as inspector:
        info = inspector.describe(os.getpid())
    assert (info.visible, info.name, info.user) == (True, "fake", None)


def test_process_vanishing_mid_read_is_invisible_and_not_cached() -> None:
    factory = CountingFactory(username=psutil.NoSuchProcess(os.getpid()))
    with fake_inspector(factory) as inspector:
        assert inspector.describe(os.getpid()) == HostProcess(visible=False)
        assert inspector.describe(os.getpid()) == HostProcess(visible=False)
    assert factory.calls == 2


def test_psutil_unable_to_look_at_all_still_reports_visible() -> None:
    def factory(pid: int) -> FakeProcess:
        raise psutil.AccessDenied(pid)

    with fake_inspector(factory) as inspector:
        info = inspector.describe(os.getpid())
    assert info.visible
    assert (info.name, info.user) == (None, None)


def test_numeric_uid_passes_through() -> None:
    # psutil itself turns a uid without a passwd entry into its number as a string.
    with fake_inspector(CountingFactory(username="4242")) as inspector:
        assert inspector.describe(os.getpid()).user == "4242"


@pytest.mark.parametrize("pid", [-1, 0, 2**31 - 1])
def test_impossible_pids_are_invisible(pid: int) -> None:
    with ProcessInspector(host_pid_namespace=True) as inspector:
        assert inspector.describe(pid) == HostProcess(visible=False)


# --- pidfds and the cache ------------------------------------------------------------------------


def test_retain_drops_entries_and_closes_their_pidfds(children: Children) -> None:
    a, b = children.sleep(), children.sleep()
    baseline = open_fds()
    factory = CountingFactory()
    inspector = fake_inspector(factory)
    inspector.describe(a.pid)
    inspector.describe(b.pid)
    assert open_fds() == baseline + 2
    inspector.retain([a.pid])
    assert open_fds() == baseline + 1
    inspector.describe(a.pid)
    assert factory.calls == 2  # a still cached
    inspector.describe(b.pid)
    assert factory.calls == 3  # b read afresh
    inspector.close()
    assert open_fds() == baseline


@pytest.mark.parametrize(
    ("error", "disables"), [(errno.ENOSYS, True), (errno.EPERM, True), (errno.EMFILE, False)]
)
def test_refused_pidfds_fall_back_to_start_times(children: Children, error: int, disables: bool) -> None:
    child = children.sleep()
    attempts: list[int] = []

    def refusing(pid: int) -> int:
        attempts.append(pid)
        raise OSError(error, os.strerror(error))

    with ProcessInspector(host_pid_namespace=True, pidfd_open=refusing) as inspector:
        assert inspector.describe(child.pid).name == "sleep"
        assert inspector.describe(os.getpid()).visible
        child.kill()
        child.wait(timeout=10)
        assert inspector.describe(child.pid) == HostProcess(visible=False)
    # A kernel or seccomp refusal is final; running out of descriptors is asked again next time.
    assert len(attempts) == (1 if disables else 3)


def test_cached_describe_does_not_query_the_process_again(children: Children) -> None:
    # Speed lives in bench/process_lookup.py; here the behaviour that makes it fast: once a pid is
    # known, describing it again builds no new psutil.Process (no name/user/cgroup reads).
    procs = [children.sleep() for _ in range(8)]
    pids = [p.pid for p in procs]
    built: list[int] = []

    def counting_factory(pid: int) -> psutil.Process:
        built.append(pid)
        return psutil.Process(pid)

    with ProcessInspector(host_pid_namespace=True, process_factory=counting_factory) as inspector:
        assert all(inspector.describe(pid).name == "sleep" for pid in pids)
        first = len(built)
        assert first >= len(pids)
        for _ in range(5):
            assert all(inspector.describe(pid).name == "sleep" for pid in pids)
        assert len(built) == first

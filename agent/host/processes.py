"""Host details (name, user, container, Slurm job) of the processes NVML reports on the GPUs.

NVML always reports *host* pids. A pid number means the same process to us only when the agent runs
in the host's (initial) PID namespace, so outside it every process is reported as not visible
rather than risk naming the wrong one (Kubernetes: ``hostPID: true``; docker: ``--pid=host``).

The sampler asks about the same few dozen pids every tick, so each answer is cached for the life of
the process. The cache key is the process start time (``/proc/<pid>/stat`` field 22, clock ticks
since boot), which tells a reused pid number from the process that held it before. Checking the
key costs a read of the stat file per pid per tick (a cached describe then takes ~13 µs,
measured on 2 vCPUs with bench/process_lookup.py); building a psutil.Process to get its
create time, ~35-50 µs. A pidfd (``pidfd_open``, Linux 5.3+) answers "has this very process
exited?" with one ``poll`` (a cached describe then takes ~1 µs) and cannot be fooled by pid reuse,
so it is the fast path; the start time is the fallback for kernels or seccomp profiles without
pidfds and for processes the pidfd reports exited (a zombie keeps its start time and its answer).

What is cached is what was read at first sight: a later ``exec`` or rename of the same process is
not seen (NVML only reports a process after it created its GPU context, by which time it has
normally done both).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import select
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import psutil

from gpuscope.host.cgroup import container_id_from_cgroup, read_cgroup_file
from gpuscope.host.slurm import slurm_job_from_cgroup
from gpuscope.snapshot import SlurmJob

log = logging.getLogger(__name__)

# The inode number the kernel gives the initial PID namespace (include/linux/proc_ns.h); fixed
# since Linux 3.8, so it identifies the host namespace without having to see the host.
PROC_PID_INIT_INO = 0xEFFFFFFC

_NS_LINK = re.compile(r"pid:\[(\d+)\]")
_T = TypeVar("_T")
# (pid, start ticks) pairs already logged about; past this many the set restarts, which at worst
# repeats a debug line, rather than growing without bound on a node that churns processes.
_MAX_LOGGED = 4096
# None where the platform has no pidfds (not Linux); the kernel may still refuse at call time.
_PIDFD_OPEN: Callable[[int], int] | None = getattr(os, "pidfd_open", None)


@dataclass(frozen=True, slots=True)
class HostProcess:
    """What the host knows of one GPU process."""

    visible: bool  # False: pid not found, exited, or not in our PID namespace
    name: str | None = None  # psutil name (comm, or the longer name from cmdline when comm is cut)
    user: str | None = None  # username, or the numeric uid as a string when no passwd entry
    container_id: str | None = None
    cmdline: tuple[str, ...] | None = None  # only when include_cmdline=True
    slurm_job: SlurmJob | None = None  # its uid only when include_user=True


_INVISIBLE = HostProcess(visible=False)


def in_host_pid_namespace(procfs: Path = Path("/proc")) -> bool:
    """Whether this process runs in the initial PID namespace; True when that cannot be told.

    Unreadable is taken as "host" rather than blanking every process on a guess: the link is
    missing on kernels before 3.8, and ``self`` does not resolve in a host /proc mounted into a
    container, where the pid numbers read are the host's anyway.
    """
    try:
        target = os.readlink(procfs / "self" / "ns" / "pid")
    except OSError:
        return True
    match = _NS_LINK.fullmatch(target)
    return match is None or int(match[1]) == PROC_PID_INIT_INO


class ProcessInspector:
    """Maps host pids to :class:`HostProcess`, cached per process. Not thread-safe.

    ``procfs`` is where this module reads stat, cgroup and the namespace link; psutil reads
    ``psutil.PROCFS_PATH`` (a process-wide setting this class leaves alone).
    ``process_factory`` builds the psutil view of a pid (tests pass fakes that deny fields).
    ``pidfd_open`` is ``os.pidfd_open``; None makes every cached answer re-check the start time.
    Holds one pidfd per cached pid: call :meth:`retain` each tick and :meth:`close` when done.
    """

    def __init__(
        self,
        *,
        procfs: Path = Path("/proc"),
        include_cmdline: bool = False,
        include_user: bool = True,
        host_pid_namespace: bool | None = None,
        process_factory: Callable[[int], psutil.Process] = psutil.Process,
        pidfd_open: Callable[[int], int] | None = _PIDFD_OPEN,
    ) -> None:
        self._procfs = str(procfs)
        self._procfs_path = procfs
        self._include_cmdline = include_cmdline
        self._include_user = include_user
        self._host_pid_namespace = (
            in_host_pid_namespace(procfs) if host_pid_namespace is None else host_pid_namespace
        )
        self._process_factory = process_factory
        self._pidfd_open = pidfd_open
        self._cache: dict[int, _Entry] = {}
        self._warned_namespace = False
        self._logged: set[tuple[int, int]] = set()

    @property
    def host_pid_namespace(self) -> bool:
        """Whether pids can be mapped at all (see the module docstring)."""
        return self._host_pid_namespace

    def describe(self, pid: int) -> HostProcess:
        """What the host knows of ``pid``; never raises."""
        if not self._host_pid_namespace:
            self._warn_namespace_once()
            return _INVISIBLE
        entry = self._cache.get(pid)
        if entry is not None:
            if entry.pidfd is not None and not entry.pidfd.exited():
                return entry.info  # the fast path: the very process we described is still running
            if _read_start_ticks(self._procfs, pid) == entry.start_ticks:
                return entry.info  # same process: no pidfd to ask, or exited but not yet reaped
            self._drop(pid)
        return self._describe_uncached(pid)

    def retain(self, pids: Iterable[int]) -> None:
        """Forget every pid not in ``pids`` (the processes now on some GPU); call once per tick."""
        keep = set(pids)
        for pid in [pid for pid in self._cache if pid not in keep]:
            self._drop(pid)

    def close(self) -> None:
        """Forget everything and close the pidfds."""
        self.retain(())

    def __enter__(self) -> ProcessInspector:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _describe_uncached(self, pid: int) -> HostProcess:
        if pid <= 0:
            return _INVISIBLE
        # The pidfd is opened first so that it pins the process whose details are then read: if it
        # still runs at a later check, the details cannot belong to a successor under the same pid.
        try:
            pidfd = self._open_pidfd(pid)
        except ProcessLookupError:
            return _INVISIBLE
        read = self._read_consistent(pid)
        if read is None:
            if pidfd is not None:
                pidfd.close()
            return _INVISIBLE
        start_ticks, info = read
        self._cache[pid] = _Entry(start_ticks, info, pidfd)
        return info

    def _read_consistent(self, pid: int) -> tuple[int, HostProcess] | None:
        """The start time and details of ``pid``, or None when it is gone or changed hands."""
        start_ticks = _read_start_ticks(self._procfs, pid)
        if start_ticks is None:
            return None
        info = self._read(pid, start_ticks)
        # Read the start time again: if the pid changed hands while we read, the details may be
        # the successor's or a mix, so answer "not visible" this tick and look again next tick.
        if info is None or _read_start_ticks(self._procfs, pid) != start_ticks:
            return None
        return start_ticks, info

    def _read(self, pid: int, start_ticks: int) -> HostProcess | None:
        """The details from psutil and the cgroup file; None when the process is gone."""
        try:
            process = self._process_factory(pid)
            with process.oneshot():
                name = self._field(pid, start_ticks, "name", process.name)
                user = self._field(pid, start_ticks, "user", process.username) if self._include_user else None
                cmdline = (
                    self._field(pid, start_ticks, "cmdline", lambda: tuple(process.cmdline()))
                    if self._include_cmdline
                    else None
                )
        except psutil.NoSuchProcess:  # ZombieProcess included: nothing at all could be read
            return None
        except (psutil.Error, OSError) as exc:  # psutil could not even look: keep what /proc gives
            self._debug_once(pid, start_ticks, "pid %d: cannot inspect: %s", pid, exc)
            name = user = None
            cmdline = None
        # One read of the cgroup file serves both the container and the Slurm job.
        cgroup = read_cgroup_file(pid, self._procfs_path) or ""
        slurm_job = slurm_job_from_cgroup(cgroup)
        if slurm_job is not None and not self._include_user:
            slurm_job = replace(slurm_job, uid=None)  # processes.user false: no user, not even as a uid
        return HostProcess(
            visible=True,
            name=name,
            user=user,
            container_id=container_id_from_cgroup(cgroup),
            cmdline=cmdline,
            slurm_job=slurm_job,
        )

    def _field(self, pid: int, start_ticks: int, what: str, read: Callable[[], _T]) -> _T | None:
        """One field, or None when denied; the whole answer is dropped when the process is gone."""
        try:
            return read()
        except psutil.ZombieProcess:
            return None  # exited but not reaped: this field is gone, the others may not be
        except psutil.NoSuchProcess:
            raise
        except (psutil.Error, OSError) as exc:  # AccessDenied mostly (hidepid, LSM policies)
            self._debug_once(pid, start_ticks, "pid %d: %s not readable: %s", pid, what, exc)
            return None

    def _open_pidfd(self, pid: int) -> _PidFd | None:
        """A pidfd for ``pid``, or None to fall back to start times; ProcessLookupError if gone."""
        if self._pidfd_open is None:
            return None
        try:
            return _PidFd(self._pidfd_open(pid))
        except ProcessLookupError:
            raise
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                return None  # out of descriptors: this pid just takes the slower check
            if exc.errno == errno.EINVAL:
                raise ProcessLookupError(pid) from exc  # not a valid pid at all
            # ENOSYS (old kernel), EPERM (seccomp profile): no use trying again for other pids.
            log.debug("pidfd_open unavailable (%s); checking process start times instead", exc)
            self._pidfd_open = None
            return None

    def _drop(self, pid: int) -> None:
        entry = self._cache.pop(pid)
        if entry.pidfd is not None:
            entry.pidfd.close()

    def _warn_namespace_once(self) -> None:
        if self._warned_namespace:
            return
        self._warned_namespace = True
        log.warning(
            "the agent is not in the host PID namespace; NVML reports host pids, which cannot be "
            "mapped to processes from here, so process names, users and containers are omitted. "
            "Run the agent with hostPID: true (Kubernetes) or --pid=host (docker) to get them."
        )

    def _debug_once(self, pid: int, start_ticks: int, message: str, *args: object) -> None:
        key = (pid, start_ticks)
        if key in self._logged:
            return
        if len(self._logged) >= _MAX_LOGGED:
            self._logged.clear()
        self._logged.add(key)
        log.debug(message, *args)


@dataclass(slots=True)
class _Entry:
    start_ticks: int
    info: HostProcess
    pidfd: _PidFd | None


class _PidFd:
    """A pidfd and the poll set that asks it whether its process has exited."""

    __slots__ = ("_fd", "_poll")

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def exited(self) -> bool:
        # A pidfd becomes readable once the process has exited (zombie or reaped); any event,
        # even an error, only sends the caller to the start-time check, which is always right.
        return bool(self._poll.poll(0))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        # Safety net for an inspector dropped without close(); CPython runs this at once.
        self.close()


def _read_start_ticks(procfs: str, pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (start time, clock ticks after boot); None if unreadable.

    os.open/os.read rather than open(): half the cost, and this runs on the per-tick path.
    """
    try:
        fd = os.open(f"{procfs}/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    # The command name (field 2) is in parentheses and may itself hold spaces and ')', so fields
    # are counted from the last ')': state is then field 3, and start time 19 fields further on.
    try:
        return int(data[data.rindex(b")") + 2 :].split(b" ", 20)[19])
    except (ValueError, IndexError):
        return None

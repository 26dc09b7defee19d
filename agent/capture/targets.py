"""Target resolution: from an alerting GPU to its compute processes to the endpoints that can profile them.

For each compute process of the GPU, the first of:

1. a Kineto (PyTorch on-demand) registration with that pid → a ``kineto`` target;
2. a TCP socket that the process, or else its parent, is LISTENing on, on one of the configured
   ``capture.profiler_ports`` → a ``tsl`` target (``127.0.0.1:port`` for a wildcard bind, the bound
   address otherwise).

Then the static targets of the config (``capture.targets``) that name the GPU (index or UUID), one
of its processes, or all GPUs are added, unless every process already has a target. A capture of one
MIG device (an alert on it) adds only those that name one of the device's processes: a target named
for the GPU profiles whoever listens there, on a GPU split into MIG devices often another tenant's job.

Nothing is probed: the resolver reads the kernel's socket table for the processes' own sockets
(psutil, ``/proc/<pid>/fd`` + ``/proc/net/tcp{,6}``) and never opens a connection; ports outside the
configured list are never looked at. A process in another network namespace (a pod without host
networking) is not found by port, because ``127.0.0.1`` in our namespace would not reach it: name it
in ``capture.targets`` or let it register with Kineto. Processes that are not ``host_visible`` (the
agent runs in another PID namespace) are never looked up by pid, since their pid numbers would name
other processes here.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import psutil

from gpuscope.capture.config import StaticTarget
from gpuscope.capture.model import CaptureTarget
from gpuscope.common.addresses import format_host_port
from gpuscope.snapshot import GpuReading

log = logging.getLogger(__name__)

ListenAddress = tuple[str, int]  # (ip, port) of a LISTEN socket
Connections = Callable[[int], Iterable[ListenAddress]]
ParentOf = Callable[[int], "int | None"]


def listening_sockets(pid: int) -> list[ListenAddress]:
    """The TCP addresses ``pid`` listens on; [] when it is gone or its file descriptors are not ours
    to read (another user's process while the agent runs without CAP_SYS_PTRACE/root)."""
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess) as err:
        log.debug("cannot list the sockets of pid %d: %s", pid, err)
        return []
    return [(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN and c.laddr]


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid``; None when it is gone or its parent is init (pid 1) or the kernel (0)."""
    try:
        ppid = psutil.Process(pid).ppid()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    return ppid if ppid > 1 else None


def connect_address(ip: str, port: int) -> str:
    """The address to dial for a socket bound to ``ip``: loopback for a wildcard bind."""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return f"127.0.0.1:{port}"
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if addr.is_unspecified:
        # 0.0.0.0, or [::] (dual-stack unless IPV6_V6ONLY, which profiler servers do not set).
        return f"127.0.0.1:{port}"
    return format_host_port(str(addr), port)


class TargetResolver:
    """Finds how to profile the processes on a GPU. Thread-safe (holds no mutable state)."""

    def __init__(self, *, profiler_ports: Sequence[int] = (6009,),
                 static_targets: Sequence[StaticTarget] = (),
                 kineto_registered: Callable[[], Mapping[int, Any]] | None = None,
                 connections: Connections = listening_sockets, parent_of: ParentOf = parent_pid) -> None:
        self._ports = tuple(dict.fromkeys(profiler_ports))  # configured order, de-duplicated
        self._port_set = frozenset(self._ports)
        self._static = tuple(static_targets)
        self._kineto = kineto_registered
        self._connections = connections
        self._parent_of = parent_of

    def resolve(self, gpu: GpuReading, *, mig_device: bool = False) -> list[CaptureTarget]:
        """The targets for the compute processes of ``gpu``, in process order, without duplicates.
        ``mig_device``: ``gpu`` holds only the processes of one of its MIG devices (or GPU instances),
        and the static targets that name the GPU, or all GPUs, are not used: only those naming one of
        those processes."""
        registered = self._registered()
        targets: list[CaptureTarget] = []
        unresolved: list[int | None] = []
        for process in gpu.compute_processes:
            found = self._for_pid(process.pid, registered) if process.host_visible else None
            if found is None:
                unresolved.append(process.pid if process.host_visible else None)
            else:
                targets.append(found)
        if unresolved or not gpu.compute_processes:
            pids = {pid for pid in unresolved if pid is not None}
            targets += [_static(t, t.pid) for t in self._static
                        if (t.pid is not None and t.pid in pids)
                        or (not mig_device and (t.all or t.gpu == gpu.index
                                                or (t.uuid is not None and t.uuid == gpu.uuid)))]
        return _dedupe(targets)

    def resolve_pid(self, pid: int) -> list[CaptureTarget]:
        """The targets for one process named by a user (a host pid): Kineto, its port, or the static
        targets naming that pid. ValueError for a pid that cannot be one."""
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise ValueError(f"a pid must be a positive integer, got {pid!r}")
        found = self._for_pid(pid, self._registered())
        if found is not None:
            return [found]
        return _dedupe([_static(t, pid) for t in self._static if t.pid == pid])

    def _registered(self) -> Mapping[int, Any]:
        if self._kineto is None:
            return {}
        try:
            return self._kineto()
        except Exception as err:  # a broken registry must not stop the other ways
            log.warning("cannot read the Kineto registrations: %s", err)
            return {}

    def _for_pid(self, pid: int, registered: Mapping[int, Any]) -> CaptureTarget | None:
        if pid in registered:
            return CaptureTarget("kineto", pid, None, "kineto-registration")
        address = self._listening_on_port(pid)
        if address is not None:
            return CaptureTarget("tsl", pid, address[0], f"port {address[1]} of pid {pid}")
        parent = self._parent_of(pid)
        if parent is not None:
            address = self._listening_on_port(parent)
            if address is not None:
                return CaptureTarget("tsl", pid, address[0], f"port {address[1]} of parent pid {parent}")
        return None

    def _listening_on_port(self, pid: int) -> tuple[str, int] | None:
        """(address to dial, port) of the first configured port that ``pid`` listens on."""
        by_port: dict[int, str] = {}
        for ip, port in self._connections(pid):
            if port in self._port_set:
                current = by_port.get(port)
                candidate = connect_address(ip, port)
                # Prefer a wildcard/loopback bind (dialled on 127.0.0.1) over a specific address.
                if current is None or candidate.startswith("127.0.0.1:"):
                    by_port[port] = candidate
        for port in self._ports:
            if port in by_port:
                return by_port[port], port
        return None


def _static(target: StaticTarget, pid: int | None) -> CaptureTarget:
    return CaptureTarget("tsl", pid, target.address, "config")


def _dedupe(targets: Iterable[CaptureTarget]) -> list[CaptureTarget]:
    """One target per endpoint (a tsl address, or a kineto pid), the first found kept."""
    seen: set[tuple[str, object]] = set()
    out = []
    for target in targets:
        key = (target.kind, target.address if target.kind == "tsl" else target.pid)
        if key not in seen:
            seen.add(key)
            out.append(target)
    return out

"""A running simulation: the fake library installed under pynvml, plus its helper processes."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from gpuscope.simulate.fake_nvml import FakeNvmlLib, install_library, uninstall_library
from gpuscope.simulate.model import GpuModel
from gpuscope.simulate.scenario import Scenario
from gpuscope.simulate.work_shape import work_spec

if TYPE_CHECKING:
    from gpuscope.simulate.kubelet import FakeKubelet

_READY_TIMEOUT_S = 20.0  # helpers start a Python interpreter each; a loaded CI machine can be slow
_STOP_TIMEOUT_S = 5.0
# Where spawning is disabled, spawned processes get pids above Linux's PID_MAX_LIMIT (2^22), which no
# real process can have: the agent sees a pid it cannot find, as with any vanished process.
_SYNTHETIC_PID_BASE = 4_194_304 + 100


class Simulation:
    """Installs a scenario's fake NVML under pynvml.

    ``clock`` returns scenario seconds; by default it is the monotonic time since ``install()``.
    Helper processes die with the thread that spawned them (PR_SET_PDEATHSIG): install from a
    thread that outlives the simulation, normally the main thread.

    ``kineto_daemon``: the address of the agent's Kineto daemon (``@dynolog`` or a socket file's
    path), which the helper processes then poll like PyTorch processes, so that captures can trace
    them; None: they are not capturable.
    """

    def __init__(self, scenario: Scenario, *, clock: Callable[[], float] | None = None,
                 spawn_processes: bool = True, kineto_daemon: str | None = None) -> None:
        self.scenario = scenario
        self._clock = clock
        self._spawn = spawn_processes
        self.kineto_daemon = kineto_daemon
        self._t0: float | None = None
        self._helpers: dict[str, subprocess.Popen[bytes]] = {}
        self._lib: FakeNvmlLib | None = None
        self._kubelet: FakeKubelet | None = None
        self._kubelet_dir: Path | None = None
        self._kineto_dir: Path | None = None

    def now(self) -> float:
        """The current scenario time in seconds."""
        if self._clock is not None:
            return self._clock()
        return 0.0 if self._t0 is None else time.monotonic() - self._t0

    @property
    def installed(self) -> bool:
        return self._lib is not None

    @property
    def helper_pids(self) -> dict[str, int]:
        """Spawned process name -> real pid (empty before install or with spawning disabled)."""
        return {name: proc.pid for name, proc in self._helpers.items()}

    @property
    def kubelet_socket(self) -> Path | None:
        """Where the simulated kubelet serves the scenario's pods while installed; None when no GPU
        of the scenario has pods. Reading it makes the socket's temporary directory, which
        ``uninstall`` removes: call ``uninstall`` even when ``install`` never ran."""
        if not any(gpu.pods or any(m.pods for m in gpu.mig_devices) for gpu in self.scenario.gpus):
            return None
        if self._kubelet_dir is None:
            self._kubelet_dir = Path(tempfile.mkdtemp(prefix="gpuscope-sim-kubelet-"))
        return self._kubelet_dir / "kubelet.sock"

    @property
    def kineto_dir(self) -> Path:
        """A private directory for the agent's Kineto daemon while it serves this simulation: its
        socket in ``ipc/`` and the traces in ``traces/`` (made by the daemon). The helper processes
        are told the daemon's address, so a simulated node needs no node-wide name (``@dynolog``, a
        shared socket directory) that a real agent on the same machine may hold. Reading it makes the
        directory, which ``uninstall`` removes."""
        if self._kineto_dir is None:
            self._kineto_dir = Path(tempfile.mkdtemp(prefix="gpuscope-sim-kineto-"))
        return self._kineto_dir

    def install(self) -> None:
        """Start the helper processes and the simulated kubelet, then make pynvml call the fake
        library."""
        if self._lib is not None:
            return
        try:
            if self._spawn:
                self._start_helpers()
            models = self._models()
            socket = self.kubelet_socket
            if socket is not None:
                # gRPC is loaded only for a scenario with pods, as a real node loads it only with a kubelet.
                from gpuscope.simulate.fake_nvml_hardware import mig_uuid
                from gpuscope.simulate.kubelet import DeviceAllocation, FakeKubelet

                self._kubelet = FakeKubelet(socket, [
                    DeviceAllocation(pod.namespace, pod.pod, pod.container, (model.uuid,))
                    for model, gpu in zip(models, self.scenario.gpus, strict=True) for pod in gpu.pods] + [
                    # NVIDIA's device plugin names a MIG device by its UUID, under its profile's resource.
                    DeviceAllocation(pod.namespace, pod.pod, pod.container, (mig_uuid(model, i),),
                                     f"nvidia.com/mig-{mig.profile}")
                    for model, gpu in zip(models, self.scenario.gpus, strict=True)
                    for i, mig in enumerate(gpu.mig_devices) for pod in mig.pods])
                self._kubelet.start()
            lib = FakeNvmlLib(self.scenario, models, self.now)
            self._t0 = time.monotonic()
            install_library(lib)
            self._lib = lib
            if self._clock is None:
                self._tell_helpers(f"origin {self._t0!r}\n")  # their steps follow the scenario's clock
        except BaseException:
            self._stop_kubelet()
            self._stop_helpers()
            raise

    def uninstall(self) -> None:
        """Detach the fake library, stop the simulated kubelet, and terminate and reap the helpers.
        Safe to call twice."""
        if self._lib is not None:
            uninstall_library(self._lib)
            self._lib = None
        self._stop_kubelet()
        self._stop_helpers()
        if self._kineto_dir is not None:
            shutil.rmtree(self._kineto_dir, ignore_errors=True)
            self._kineto_dir = None

    def _stop_kubelet(self) -> None:
        if self._kubelet is not None:
            self._kubelet.stop()
            self._kubelet = None
        if self._kubelet_dir is not None:
            shutil.rmtree(self._kubelet_dir, ignore_errors=True)
            self._kubelet_dir = None

    def __enter__(self) -> Simulation:
        self.install()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.uninstall()

    # ---------------------------------------------------------------- internals

    def _spawned_names(self) -> list[str]:
        names: dict[str, None] = {}  # first-appearance order, each name once
        for gpu in self.scenario.gpus:
            for proc in gpu.processes:
                if proc.spawn:
                    names[proc.name] = None
        return list(names)

    def _models(self) -> list[GpuModel]:
        spawned = {name: self._helpers[name].pid if name in self._helpers else _SYNTHETIC_PID_BASE + i
                   for i, name in enumerate(self._spawned_names())}
        period = self.scenario.duration if self.scenario.loop else None
        return [
            GpuModel(index, gpu, scenario_name=self.scenario.name, seed=self.scenario.seed, period=period,
                     pids=[spawned[p.name] if p.spawn else (p.pid or 0) for p in gpu.processes])
            for index, gpu in enumerate(self.scenario.gpus)
        ]

    def _helper_command(self, name: str) -> list[str]:
        gpu, process = next((gpu, p) for gpu in self.scenario.gpus for p in gpu.processes if p.name == name)
        period = self.scenario.duration if self.scenario.loop else None
        command = [sys.executable, "-m", "gpuscope.simulate.helper_process", "--name", name,
                   "--parent", str(os.getpid()), "--work", json.dumps(work_spec(gpu, process, period))]
        if self.kineto_daemon is not None:
            command += ["--kineto-daemon", self.kineto_daemon]
        return command

    def _tell_helpers(self, line: str) -> None:
        for proc in self._helpers.values():
            if proc.stdin is not None:
                with contextlib.suppress(OSError):  # a helper that died is found by the agent as gone
                    proc.stdin.write(line.encode())
                    proc.stdin.flush()

    def _start_helpers(self) -> None:
        for name in self._spawned_names():
            self._helpers[name] = subprocess.Popen(
                self._helper_command(name), stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        # Wait until each has renamed itself, so that the first NVML reading already sees the name.
        deadline = time.monotonic() + _READY_TIMEOUT_S
        for name, proc in self._helpers.items():
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = proc.stdout.readline() if ready else b""
            proc.stdout.close()
            if line.strip() != b"ready":
                raise RuntimeError(f"simulator helper process {name!r} did not start "
                                   f"(exit code {proc.poll()}); see its stderr above")

    def _stop_helpers(self) -> None:
        helpers, self._helpers = self._helpers, {}
        for proc in helpers.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in helpers.values():
            try:
                proc.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None and not pipe.closed:
                    with contextlib.suppress(OSError):
                        pipe.close()

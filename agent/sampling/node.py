"""What samples the node, built from the settings in one place: the (simulated) NVML, the process
inspector, the kubelet's pod attribution and the sampler.

``gpuscope run`` (the Agent) and ``gpuscope snapshot`` both use it, so a one-off snapshot sees the
node exactly as the running agent would: the same settings, the same pods, the same simulation.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from gpuscope.config import Settings
from gpuscope.health import SourceHealth
from gpuscope.host.pods import PodAttribution
from gpuscope.host.processes import ProcessInspector
from gpuscope.nvml.boundary import Nvml
from gpuscope.sampling.sampler import Sampler

if TYPE_CHECKING:
    from gpuscope.simulate import Simulation


class NodeSampling:
    """The sampling side of one node. ``install`` puts a simulation in place (no-op on a real node);
    ``uninstall`` removes it; the sampler's and the pods' own ``start``/``stop`` run them."""

    def __init__(self, settings: Settings, *, health: SourceHealth | None = None) -> None:
        self.simulation: Simulation | None = None
        if settings.simulate:
            # Imported lazily: the simulator (and its helper processes) exist only with --simulate.
            from gpuscope.simulate import Simulation, load_scenario

            self.simulation = Simulation(load_scenario(settings.simulate))
        # A simulated node is named after its scenario (`demo`), not after the machine it runs on.
        simulated = self.simulation.scenario.name if self.simulation is not None else None
        self.hostname = settings.node_name or simulated or socket.gethostname()
        self.health = health or SourceHealth()
        try:
            self.pods = self._pod_attribution(settings)
        except BaseException:
            self.uninstall()  # the simulated kubelet's temporary directory
            raise
        self.sampler = Sampler(
            Nvml(),
            ProcessInspector(include_cmdline=settings.processes.cmdline,
                             include_user=settings.processes.user),
            interval_seconds=settings.sample_interval,
            idle_dip_threshold=settings.idle_dips.threshold,
            idle_dip_max_seconds=settings.idle_dips.max_duration,
            hostname=self.hostname,
            retry_initial_seconds=settings.nvml.retry_initial,
            retry_max_seconds=settings.nvml.retry_max,
            pods=self.pods.pods_for if self.pods is not None else None,
            health=self.health,
            expected_gpus=settings.nvml.expected_gpus,
            energy_interval_seconds=settings.nvml.energy_interval,
            samples_interval_seconds=settings.nvml.samples_interval,
            health_interval_seconds=settings.nvml.health_interval,
            throttle_interval_seconds=settings.nvml.throttle_interval,
            gpm_interval_seconds=settings.nvml.gpm_interval,
            nvlink_per_link=settings.nvml.nvlink_per_link,
            stuck_after_seconds=settings.watchdog.stuck_after,
            unhealthy_after_seconds=settings.watchdog.unhealthy_after,
        )

    def _pod_attribution(self, settings: Settings) -> PodAttribution | None:
        config = settings.pods
        if not config.enabled:
            return None
        socket_path = config.socket
        # A simulated node with pods brings its own kubelet, unless the socket was set explicitly.
        if self.simulation is not None and "socket" not in config.model_fields_set:
            socket_path = self.simulation.kubelet_socket or socket_path
        return PodAttribution(socket_path, refresh_interval=config.refresh_interval, timeout=config.timeout,
                              keep_for=config.keep_for, health=self.health)

    def install(self) -> None:
        if self.simulation is not None:
            self.simulation.install()

    def uninstall(self) -> None:
        if self.simulation is not None:
            self.simulation.uninstall()

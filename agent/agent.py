"""The agent: wires configuration, (simulated) NVML, the sampler and the HTTP side together."""

from __future__ import annotations

import gc
import logging
import signal
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING

from gpuscope.alert_captures.event_lines import CaptureEventLines
from gpuscope.alert_captures.verdicts import CaptureVerdicts
from gpuscope.alerts.alertmanager import AlertmanagerNotifier, instance_label
from gpuscope.alerts.engine import AlertEngine
from gpuscope.alerts.eventlog import AlertEventLog
from gpuscope.alerts.resolved import ResolvedAlerts
from gpuscope.alerts.rules import build_rules
from gpuscope.capture.config import CaptureConfig
from gpuscope.capture.diagnoses import LatestDiagnoses
from gpuscope.capture.factory import Captures, build_captures
from gpuscope.capture.webhook import WebhookReceiver, this_node_hosts
from gpuscope.common.config_types import ConfigError
from gpuscope.common.memory import release_free_memory
from gpuscope.config import Settings
from gpuscope.control.errors import ControlError, ControlServerError
from gpuscope.control.methods import ControlMethods, agent_methods
from gpuscope.control.on_demand import OnDemandControlServer
from gpuscope.documents import ProcessExposure
from gpuscope.exporters.alerts import AlertCollector
from gpuscope.exporters.captures import CaptureCollector
from gpuscope.exporters.diagnosis import DiagnosisCollector
from gpuscope.exporters.families import Registry
from gpuscope.exporters.health import SourceHealthCollector
from gpuscope.exporters.pods import PodResourcesCollector
from gpuscope.exporters.process_metrics import ProcessCollector
from gpuscope.exporters.prometheus import SnapshotCollector
from gpuscope.health import SourceHealth
from gpuscope.listeners import SocketListeners
from gpuscope.sampling.node import NodeSampling
from gpuscope.systemd_notify import SystemdNotifier
from gpuscope.web.self_metrics import WebCollector
from gpuscope.web.server import AgentHttpServer
from gpuscope.web.utilization_history import UtilizationHistory
from gpuscope.web.web_config import WebConfigWatcher
from gpuscope.web.webhook_auth import WebhookAuth

if TYPE_CHECKING:
    from gpuscope.control.server import ControlServer

log = logging.getLogger(__name__)

STOP_SECONDS = 1.5  # SIGTERM to exit, all parts together (systemd and Kubernetes allow far more)


class Agent:
    """One node's agent. ``start`` returns once serving; ``stop`` is quick and idempotent."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.health = SourceHealth()
        self.sampling = NodeSampling(settings, health=self.health)
        self.simulation = self.sampling.simulation
        self.hostname = self.sampling.hostname
        self.pods = self.sampling.pods
        self.sampler = self.sampling.sampler
        self.event_log: AlertEventLog | None = None
        try:
            self._build(settings)
        except BaseException:
            self._release_partial_build()
            raise

    def _release_partial_build(self) -> None:
        """What a failed build leaves running: the event log's writer thread, the simulation's files."""
        if self.event_log is not None:
            self.event_log.close()
        self.sampling.uninstall()  # e.g. the simulated kubelet's temporary directory

    def _capture_settings(self, settings: Settings) -> CaptureConfig:
        """The capture settings, with a simulated node's Kineto directories private to the simulation
        where the configuration does not name them: a demo started beside a real agent must not
        compete for its @dynolog or its socket and trace directories."""
        kineto = settings.capture.kineto
        unset = {"socket_dir", "trace_dir"} - kineto.model_fields_set
        if self.simulation is None or not unset:
            return settings.capture
        private = self.simulation.kineto_dir
        kineto = kineto.model_copy(update={name: private / ("ipc" if name == "socket_dir" else "traces")
                                           for name in unset})
        return settings.capture.model_copy(update={"kineto": kineto})

    def _control_methods(self) -> ControlMethods:
        return agent_methods(
            self.settings.control,
            service=self.captures.service if self.captures is not None else None,
            store=self.captures.store if self.captures is not None else None,
            snapshots=self.sampler, alerts=self.alerts, hostname=self.hostname,
            simulated=self.simulation.scenario.name if self.simulation is not None else None,
            processes=self.process_exposure,
            downloads=lambda: self.web_config.current().authenticates_every_client)

    def _build(self, settings: Settings) -> None:
        processes = settings.processes
        # What the documents both doors serve (HTTP's /api/v1/*, the control API) say of processes.
        self.process_exposure = ProcessExposure(export=processes.export, cmdline=processes.cmdline,
                                                user=processes.user)
        # /metrics renders the snapshot's families once per sampling tick (they change only then) and
        # the registry's, the agent's own state between ticks, on every request, after them.
        self.snapshot_collector = SnapshotCollector(self.sampler, include_cmdline=processes.cmdline,
                                                    include_processes=processes.export,
                                                    process_labels=processes.labels,
                                                    max_per_gpu=processes.max_per_gpu)
        self.registry = Registry()
        self.registry.register(SourceHealthCollector(self.health))
        self.systemd = SystemdNotifier()
        self.sampler.add_listener(self.systemd.on_snapshot)
        if self.pods is not None:
            self.registry.register(PodResourcesCollector(self.pods.status))
        self.registry.register(ProcessCollector())  # the agent's own CPU and memory, to prove its overhead

        alerting = settings.alerting
        self.capture_verdicts = CaptureVerdicts()  # what alert-triggered captures showed, for the alerts
        self.alerts: AlertEngine | None = None
        self.notifier: AlertmanagerNotifier | None = None
        self.resolved_alerts = ResolvedAlerts()  # for the status page: what became of a capture's alert
        if alerting.enabled:
            self.alerts = AlertEngine(build_rules(alerting.rules), hostname=self.hostname, health=self.health,
                                      evaluation_interval_seconds=alerting.evaluation_interval)
            self.sampler.add_listener(self.alerts.on_snapshot)
            self.alerts.add_listener(self.resolved_alerts)
            self.registry.register(AlertCollector(self.alerts))
            if alerting.event_log.path is not None:
                self.event_log = AlertEventLog(alerting.event_log, health=self.health)
                self.alerts.add_listener(self.event_log)
        # One thread waits on every listening socket: the HTTP port, the control API's socket while
        # no client calls, the Kineto daemon's (started by the first one added).
        self.listeners = SocketListeners("gpuscope-listen", health=self.health)
        self.captures: Captures | None = build_captures(
            self._capture_settings(settings), snapshots=self.sampler, hostname=self.hostname,
            health=self.health, listeners=self.listeners)
        if self.simulation is not None and self.captures is not None:
            # The simulated processes poll this agent's Kineto daemon, as PyTorch jobs would, so that
            # captures can trace them (they start with the simulation, before the daemon: they retry).
            self.simulation.kineto_daemon = self.captures.kineto.address
        # ConfigError (exit 2) when the web configuration file cannot be used.
        self.web_config = WebConfigWatcher(settings.web.config_file)
        self.webhook: WebhookReceiver | None = None
        webhook_auth: WebhookAuth | None = None
        self.diagnoses: LatestDiagnoses | None = None
        if self.captures is not None:
            if self.alerts is not None:
                self.alerts.add_listener(self.captures.service.on_transition)
            self.registry.register(CaptureCollector(self.captures.service, self.captures.analysis))
            event_lines = CaptureEventLines(self.event_log) if self.event_log is not None else None
            if self.captures.analysis is not None:
                self.captures.analysis.add_listener(self.capture_verdicts.on_analysed)
                # Each GPU's latest diagnosis, from the stored records first: it outlives a restart.
                self.diagnoses = LatestDiagnoses()
                self.captures.analysis.add_listener(self.diagnoses.on_analysed)
                self.diagnoses.load(self.captures.store.list())
                self.registry.register(DiagnosisCollector(self.diagnoses, self.sampler))
                if event_lines is not None:
                    self.captures.analysis.add_listener(event_lines.record_analysis)
            if event_lines is not None:
                self.captures.service.refusals.add_listener(event_lines.record_refusal)
            if settings.capture.webhook.enabled:
                webhook_auth = build_webhook_auth(settings, self.web_config)
                self.webhook = WebhookReceiver(self.captures.service.submit,
                                               hosts=this_node_hosts(self.hostname), port=None)
        self.control: ControlServer | OnDemandControlServer | None = None
        if settings.control.enabled:
            # gRPC runs in a server process while clients call, unless remote clients (control.tcp)
            # expect it listening from the start: then in this process.
            if settings.control.tcp.enabled:
                from gpuscope.control.server import ControlServer

                self.control = ControlServer(settings.control, self._control_methods())
            else:
                self.control = OnDemandControlServer(settings.control, self._control_methods(),
                                                     listeners=self.listeners)
        self.utilization_history = UtilizationHistory()  # the status page's sparklines
        self.sampler.add_listener(self.utilization_history.observe)
        self.http = AgentHttpServer(settings.web.listen_address, registry=self.registry,
                                    per_tick=self.snapshot_collector, source=self.sampler,
                                    listeners=self.listeners,
                                    alerts=self.alerts, webhook=self.webhook,
                                    expected_gpus=settings.nvml.expected_gpus, health=self.health,
                                    max_requests=settings.web.max_requests, web_config=self.web_config,
                                    webhook_auth=webhook_auth, processes=self.process_exposure,
                                    captures=self.captures.store if self.captures is not None else None,
                                    refusals=self.captures.service.refusals if self.captures else None,
                                    history=self.utilization_history, resolved=self.resolved_alerts,
                                    simulated=self.simulation.scenario.name if self.simulation else None)
        self.registry.register(WebCollector(self.http.rejections, self.web_config))
        self._stopped = False

    def start(self, *, watchdog_thread: bool = True) -> None:
        """Serve. ``watchdog_thread=False``: the sampler's watchdog is left to the caller's thread
        (``run_until_signalled`` runs it on the main thread, which has nothing else to do)."""
        self.sampling.install()
        try:
            self.http.start()  # bind first: a busy port is a start-up error, before any thread runs
        except BaseException:
            self.sampling.uninstall()
            raise
        host, port = self.http.bound_address[:2]
        if self.webhook is not None:
            self.webhook.port = port  # an alert's `instance` names this agent by its real port
        if self.captures is not None:
            self.captures.start()
        if self.pods is not None:
            self.pods.start()
        if self.control is not None:
            try:
                self.control.start()
            except ControlServerError as err:  # e.g. /run/gpuscope not writable: serve everything else
                log.warning("control API disabled: %s", err)
                self.control = None
        if self.alerts is not None and self.settings.alerting.alertmanager.url is not None:
            # Built once the port is bound: the alert's `instance` label names the real address.
            self.notifier = AlertmanagerNotifier(
                self.settings.alerting.alertmanager, self.alerts, hostname=self.hostname,
                instance=instance_label(host, port, self.hostname), health=self.health,
                verdicts=self.capture_verdicts)
            self.alerts.add_listener(self.notifier)
            self.notifier.start()
        self.sampler.start(watchdog_thread=watchdog_thread)
        # Everything built so far lives as long as the process: move it out of the collector's
        # reach, so the garbage a scrape leaves behind triggers cheap collections, not 6-8 ms ones.
        gc.collect()
        gc.freeze()
        release_free_memory()  # what building it all freed (about 1 MiB) goes back to the system
        self.systemd.ready(f"serving on port {port}")
        security = self.web_config.current()
        scheme = "https" if security.tls else "http"
        users = f", basic auth ({len(security.users.users())} users)" if security.users.enabled else ""
        log.info("gpuscope serving %s on %s (port %d%s), sampling every %gs%s", scheme, host, port, users,
                 self.settings.sample_interval,
                 f", simulating {self.settings.simulate!r}" if self.settings.simulate else "")

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        """Stop everything within ``timeout``, in every state: a capture in progress, a sampler stuck in
        NVML, clients connected. Each part gets what is left of one deadline (and no more than its own
        share); what does not end in time is abandoned to its daemon thread, which the process's exit
        ends. Nothing is left half-written: captures publish by rename, the event log by whole lines."""
        if self._stopped:
            return
        self._stopped = True
        deadline = time.monotonic() + timeout

        def share(most: float) -> float:
            return max(0.0, min(most, deadline - time.monotonic()))

        self.systemd.stopping()
        self.http.stop(timeout=share(0.3))
        if self.control is not None:
            self.control.stop(grace=share(0.4))
        self.sampler.stop(timeout=share(0.4))
        if self.pods is not None:
            self.pods.stop(timeout=share(0.2))
        if self.notifier is not None:
            self.notifier.stop(timeout=share(0.2))
        if self.event_log is not None:
            self.event_log.close(timeout=share(0.4))
        if self.captures is not None:
            self.captures.stop(timeout=share(0.5))
        self.listeners.close(timeout=share(0.2))
        self.sampling.uninstall()

    def run_until_signalled(self) -> None:
        """Serve until SIGTERM or SIGINT, then stop (well within 2 s).

        The main thread runs the sampler's watchdog meanwhile (a thread fewer): between its rounds,
        once per ``watchdog.stuck_after`` on a quiet node, it sleeps in a lock acquisition. Linux hands
        a signal sent to the process to its main thread, whose acquisition the signal interrupts to run
        the handler, and the handler releases the lock. A lock, not an Event: Event.set takes an inner
        lock that the interrupted thread may be holding, and a handler waiting on it would wait forever;
        a release never waits."""
        serving = threading.Lock()
        serving.acquire()  # released by the first SIGTERM or SIGINT

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            log.info("received %s, stopping", signal.Signals(signum).name)
            if serving.locked():  # held until the main thread wakes; a second signal finds it taken again
                serving.release()

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.start(watchdog_thread=False)
            delay = self.settings.watchdog.stuck_after
            while not serving.acquire(timeout=delay):
                delay = self._watch_once()
        finally:
            self.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _watch_once(self) -> float:
        """One round of the sampler's watchdog; a failure is logged and the next round comes as usual."""
        try:
            return self.sampler.watch_once()
        except Exception:  # the main thread must go on serving, and stop on a signal
            log.exception("the NVML watchdog failed; trying again in %gs", self.settings.watchdog.stuck_after)
            return self.settings.watchdog.stuck_after


def build_webhook_auth(settings: Settings, web_config: WebConfigWatcher) -> WebhookAuth:
    """The webhook's credentials, checked at start: ConfigError (exit 2) for a token file that cannot
    be used or a user that the web configuration file does not define."""
    webhook = settings.capture.webhook
    auth = WebhookAuth(token_file=webhook.token_file, users=webhook.users, security=web_config.current)
    try:
        auth.check_token_file()
    except ControlError as err:
        raise ConfigError("capture.webhook.token_file", [str(err)]) from None
    missing = sorted(set(webhook.users) - web_config.current().users.users())
    if missing:
        raise ConfigError("capture.webhook.users", [
            f"{', '.join(missing)}: not in basic_auth_users of {settings.web.config_file}"])
    return auth

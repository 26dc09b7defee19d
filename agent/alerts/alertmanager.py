"""Pushes firing and resolved alerts to an Alertmanager (API v2), the way Prometheus does.

A Transition listener that only records what changed and wakes a worker thread, so the sampler never
waits on the network. The worker POSTs ``/api/v2/alerts``:

- on a transition to firing: the alert with ``endsAt`` = now + ``ENDS_AT_RESEND_INTERVALS`` times the
  resend interval (Prometheus' convention, ``4 * max(resend delay, evaluation interval)``): Alertmanager
  keeps the alert while the agent keeps re-sending it, and resolves it by itself if the agent dies;
- on a transition to resolved: the alert with ``endsAt`` = the resolve time;
- every ``resend_interval``: all alerts the source reports firing, which renews their ``endsAt``;
- on a transition from firing to inhibited (a greater alert on the GPU now explains it: inhibition.py):
  the alert with ``endsAt`` = that time and an ``inhibited_by`` annotation, so that the receivers hear
  of the greater alert only (as Alertmanager's own ``inhibit_rules`` would have it). Inhibited alerts
  are not re-sent; one that fires again when the greater alert resolves is pushed as firing.

Pending alerts (and pending alerts that went inactive) are never pushed. ``startsAt`` is when the
alert's condition first held (``active_since``), identical in every push of one alert. The queue of
undelivered transitions holds the latest state per alert (labels), at most ``max_pending`` alerts;
beyond that the oldest is dropped, counted and logged once. A failed push (connection refused,
timeout, 5xx) is retried with exponential back-off; a 4xx answer (the payload was refused) is not.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import urllib.error
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

from gpuscope.alerts.capture_verdicts import CaptureVerdict, CaptureVerdictSource
from gpuscope.alerts.config import AlertmanagerConfig
from gpuscope.alerts.model import Alert, AlertSource, Transition
from gpuscope.common.addresses import format_host_port, split_http_url
from gpuscope.health import SourceHealth
from gpuscope.threads import start_thread

log = logging.getLogger(__name__)

API_PATH = "/api/v2/alerts"
ENDS_AT_RESEND_INTERVALS = 4  # a firing alert's endsAt: this many resend intervals ahead
MAX_PENDING = 1024
RETRY_INITIAL_SECONDS = 1.0
RETRY_MAX_SECONDS = 60.0
STOP_JOIN_SECONDS = 0.5  # stop() waits this long for a push in flight, then leaves the daemon thread
_RESERVED_LABELS = ("alertname", "gpu", "uuid", "severity", "instance", "hostname")

_AlertKey = tuple[tuple[str, str], ...]  # the sorted label pairs: Alertmanager's identity of an alert


class _Refused(Exception):
    """Alertmanager answered 4xx: resending the same payload cannot succeed."""


def alertmanager_endpoint(url: str | None) -> str:
    """The push URL for an Alertmanager base URL; ValueError with a hint when it is not usable.

    Accepts ``http(s)://host[:port][/prefix]`` (a prefix for an Alertmanager behind
    ``--web.route-prefix`` or a reverse proxy); refuses other schemes, credentials, queries,
    fragments and ``.``/``..`` path segments.
    """
    example = "e.g. http://alertmanager:9093"
    if not url:
        raise ValueError(f"alerting.alertmanager.url is not set ({example})")
    try:
        checked = split_http_url(url, example)
    except ValueError as err:
        raise ValueError(f"invalid Alertmanager URL {url!r}: {err}") from None
    parts = checked.parts
    path = parts.path.rstrip("/")
    decoded = urllib.parse.unquote(path)
    segments = decoded.split("/")[1:]
    if any(s in ("", ".", "..") for s in segments) or "\\" in decoded or any(ord(c) < 0x21 for c in decoded):
        raise ValueError(
            f"invalid Alertmanager URL {url!r}: the path must be a plain prefix like /alertmanager")
    return urllib.parse.urlunsplit((parts.scheme, checked.netloc, path + API_PATH, "", ""))


def instance_label(host: str, port: int, hostname: str) -> str:
    """The ``instance`` label for the agent listening on (host, port): ``host:port`` as Prometheus
    would scrape it; a wildcard or empty host (all interfaces) becomes the node's ``hostname``."""
    return format_host_port(hostname if host in ("", "0.0.0.0", "::") else host, port)


class AlertmanagerNotifier:
    """A Transition listener that pushes firing and resolved alerts from a worker thread."""

    def __init__(
        self,
        config: AlertmanagerConfig,
        source: AlertSource,
        *,
        hostname: str,
        instance: str,
        clock: Callable[[], float] = time.time,
        max_pending: int = MAX_PENDING,
        retry_initial_seconds: float = RETRY_INITIAL_SECONDS,
        retry_max_seconds: float = RETRY_MAX_SECONDS,
        health: SourceHealth | None = None,
        verdicts: CaptureVerdictSource | None = None,
    ) -> None:
        self._health = health
        self._verdicts = verdicts
        self.endpoint = alertmanager_endpoint(config.url)
        self._resend_interval = config.resend_interval
        self._timeout = config.timeout
        self._source = source
        self._hostname = hostname
        self._instance = instance
        self._generator_url = f"http://{instance}/api/v1/alerts" if instance and not instance.startswith(
            ":") else ""
        self._clock = clock
        self._max_pending = max_pending
        self._retry_initial = retry_initial_seconds
        self._retry_max = max(retry_max_seconds, retry_initial_seconds)
        # Imported here, where an Alertmanager is configured: urllib.request loads http.client and ssl.
        import urllib.request

        # Environment proxies are ignored, as Prometheus does: Alertmanager is normally in-cluster.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._wake = threading.Condition()
        self._pending: OrderedDict[_AlertKey, Transition] = OrderedDict()
        self._stopping = False
        self._started = False
        self._thread: threading.Thread | None = None
        self._failing = False
        self._drop_logged = False
        self._bad_label_logged: set[str] = set()
        self.pushes = 0  # successful POSTs
        self.errors = 0  # failed POSTs (each retry counts)
        self.dropped = 0  # transitions dropped from a full queue, or refused (4xx) by Alertmanager

    # -- the listener (sampler thread) -------------------------------------------------------------

    def __call__(self, transition: Transition) -> None:
        """Queue a firing or resolved transition (or the inhibition of a firing alert) for the worker;
        never blocks on the network."""
        if transition.state not in ("firing", "resolved") and not (
                transition.state == "inhibited" and transition.previous == "firing"):
            return
        try:
            key = self._key(transition)
        except Exception:
            log.exception("cannot queue alert transition %r for Alertmanager", transition)
            return
        with self._wake:
            self._pending.pop(key, None)  # the latest state of an alert replaces an undelivered older one
            self._pending[key] = transition
            if len(self._pending) > self._max_pending:
                self._pending.popitem(last=False)
                self.dropped += 1
                if not self._drop_logged:
                    self._drop_logged = True
                    log.warning("Alertmanager queue full (%d alerts): dropping the oldest undelivered "
                                   "transitions (logged once; see the dropped count)", self._max_pending)
            self._wake.notify()

    # -- life cycle --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker thread (once: a stopped notifier cannot be started again)."""
        if self._started:
            raise RuntimeError("the Alertmanager notifier can be started only once")
        self._started = True
        self._thread = start_thread("gpuscope-alertmanager", self._run, health=self._health, source="alerts")
        log.debug("pushing alerts to %s", self.endpoint)

    def stop(self, timeout: float = STOP_JOIN_SECONDS) -> None:
        """Stop the worker promptly; a push in flight is abandoned after ``timeout``."""
        thread, self._thread = self._thread, None
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if thread is not None:
            thread.join(timeout)

    @property
    def queued(self) -> int:
        """Alerts whose latest transition is not delivered yet."""
        with self._wake:
            return len(self._pending)

    # -- the worker --------------------------------------------------------------------------------

    def _run(self) -> None:
        failures = 0
        next_attempt = 0.0
        next_resend = time.monotonic() + self._resend_interval
        while True:
            with self._wake:
                while not self._stopping:
                    now = time.monotonic()
                    # Queued transitions go at once and the resend on time, but not before the back-off.
                    due = max(min(now, next_resend) if self._pending else next_resend, next_attempt)
                    if now >= due:
                        break
                    self._wake.wait(timeout=due - now)
                if self._stopping:
                    return
                batch = dict(self._pending)
            resend = time.monotonic() >= next_resend
            try:
                self._push(batch, resend)
            except _Refused as err:
                self.errors += 1
                log.warning("Alertmanager at %s refused %d alerts: %s (not retried)",
                               self.endpoint, len(batch), err)
                self._forget(batch, dropped=True)
            except Exception as err:  # network errors, 5xx, and anything unexpected: retry later
                failures += 1
                self.errors += 1
                delay = min(self._retry_max, self._retry_initial * 2 ** min(failures - 1, 30))
                next_attempt = time.monotonic() + delay
                import http.client  # loaded with urllib.request

                unexpected = not isinstance(err, (OSError, http.client.HTTPException))
                if not self._failing or unexpected:
                    self._failing = True
                    log.warning("cannot push alerts to Alertmanager at %s: %s; retrying with back-off",
                                   self.endpoint, err, exc_info=unexpected)
                else:
                    log.debug("push to %s failed again (%d in a row): %s", self.endpoint, failures, err)
                continue
            else:
                self._forget(batch, dropped=False)
                if self._failing:
                    self._failing = False
                    log.info("Alertmanager at %s reachable again after %d failed pushes", self.endpoint,
                                failures)
            failures, next_attempt = 0, 0.0
            if resend:
                next_resend = time.monotonic() + self._resend_interval

    def _forget(self, batch: Mapping[_AlertKey, Transition], *, dropped: bool) -> None:
        """Remove the delivered (or refused) transitions, unless a newer one replaced them meanwhile."""
        with self._wake:
            for key, transition in batch.items():
                if self._pending.get(key) is transition:
                    del self._pending[key]
                    if dropped:
                        self.dropped += 1

    def _push(self, batch: Mapping[_AlertKey, Transition], resend: bool) -> None:
        now = self._clock()
        payload: dict[_AlertKey, dict[str, Any]] = {}
        if resend:
            for alert in self._source.alerts():
                if alert.state == "firing" and not alert.inhibited_by:
                    key, item = self._from_alert(alert, now)
                    payload[key] = item
        for key, transition in batch.items():  # a queued transition is newer than the source's view
            payload[key] = self._from_transition(key, transition, now)
        if not payload:
            return
        body = json.dumps(list(payload.values()), allow_nan=False).encode()
        import urllib.request  # loaded by __init__

        request = urllib.request.Request(self.endpoint, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with self._opener.open(request, timeout=self._timeout) as response:
                response.read()
        except urllib.error.HTTPError as err:
            detail = err.read(500).decode(errors="replace").strip()
            if 400 <= err.code < 500:
                raise _Refused(f"HTTP {err.code}: {detail}") from err
            raise OSError(f"HTTP {err.code}: {detail}") from err
        self.pushes += 1

    # -- payload -----------------------------------------------------------------------------------

    def _key(self, alert: Alert | Transition) -> _AlertKey:
        labels: dict[str, str] = {}
        for label, value in alert.labels.items():
            if label in _RESERVED_LABELS:
                continue
            if not _valid_label_name(label):
                if label not in self._bad_label_logged:
                    self._bad_label_logged.add(label)
                    log.warning("alert label %r is not a valid Prometheus label name; not pushed", label)
                continue
            labels[label] = str(value)
        labels.update({
            "alertname": alert.name, "gpu": str(alert.gpu), "uuid": alert.uuid, "severity": alert.severity,
            "instance": self._instance, "hostname": alert.hostname or self._hostname,
        })
        # An empty value means "no such label" in Prometheus and Alertmanager alike.
        return tuple(sorted((k, v) for k, v in labels.items() if v))

    def _from_transition(self, key: _AlertKey, t: Transition, now: float) -> dict[str, Any]:
        ends = t.state in ("resolved", "inhibited")
        ends_at = max(t.at, t.active_since) if ends else self._firing_ends_at(now)
        item = self._item(key, t.active_since, ends_at, t.summary, values=t.values,
                          verdict=self._verdict(t.name, t.gpu, t.active_since))
        if t.inhibited_by:
            item["annotations"]["inhibited_by"] = t.inhibited_by
        return item

    def _from_alert(self, alert: Alert, now: float) -> tuple[_AlertKey, dict[str, Any]]:
        key = self._key(alert)
        ends_at = self._firing_ends_at(now)
        return key, self._item(key, alert.active_since, ends_at, alert.summary, values=alert.values,
                               verdict=self._verdict(alert.name, alert.gpu, alert.active_since))

    def _verdict(self, alertname: str, gpu: int, active_since: float) -> CaptureVerdict | None:
        return self._verdicts.for_alert(alertname, gpu, active_since) if self._verdicts is not None else None

    def _firing_ends_at(self, now: float) -> float:
        return now + ENDS_AT_RESEND_INTERVALS * self._resend_interval

    def _item(self, key: _AlertKey, starts_at: float, ends_at: float, summary: str, *,
              values: Mapping[str, float], verdict: CaptureVerdict | None) -> dict[str, Any]:
        annotations = {"summary": summary}
        description = ", ".join(f"{name}={_number(value)}" for name, value in sorted(values.items()))
        if description:
            annotations["description"] = description
        if verdict is not None:  # what the capture this alert triggered showed
            annotations["diagnosis"] = verdict.headline + (
                " (the capture saw other minutes than the alert judged and does not explain it)"
                if verdict.accounts is False else "")
            annotations["capture_id"] = verdict.capture_id
            if verdict.context:
                annotations["capture_context"] = verdict.context
            if verdict.gain:
                annotations["capture_gain"] = verdict.gain
        return {
            "labels": dict(key),
            "annotations": annotations,
            "startsAt": _rfc3339(starts_at),
            "endsAt": _rfc3339(max(ends_at, starts_at)),
            "generatorURL": self._generator_url,
        }


def _valid_label_name(name: str) -> bool:
    return bool(name) and name.isascii() and (name[0].isalpha() or name[0] == "_") and all(
        c.isalnum() or c == "_" for c in name) and not name.startswith("__")


def _number(value: float) -> str:
    return f"{value:.4g}" if isinstance(value, float) and math.isfinite(value) else str(value)


def _rfc3339(unix_seconds: float) -> str:
    moment = datetime.fromtimestamp(unix_seconds, tz=timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")

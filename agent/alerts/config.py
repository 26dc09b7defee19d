"""The `alerting:` section of the configuration: the rules (``alerts.rules``) and the outputs."""

from __future__ import annotations

from pydantic import Field

from gpuscope.alerts.rules import RulesConfig
from gpuscope.common.config_types import ByteSize, Duration, Section


class EventLogConfig(Section):
    path: str | None = Field(None, min_length=1,
                             description="JSON-lines file of alert transitions; none: no event log.")
    max_bytes: ByteSize = Field(10 * 2**20, ge=4096, le=2**40,
                                description="Rotate when the file reaches this size (e.g. 10MiB).")
    backups: int = Field(3, ge=0, le=100, description="Rotated files kept (path.1 ... path.N).")


class AlertmanagerConfig(Section):
    url: str | None = Field(None, description="Alertmanager base URL, e.g. http://alertmanager:9093.")
    resend_interval: Duration = Field(60.0, gt=0.0, le=86400.0,
                                      description="Firing alerts are re-sent this often.")
    timeout: Duration = Field(5.0, gt=0.0, le=60.0, description="HTTP timeout of one push.")


class AlertingConfig(Section):
    enabled: bool = True
    evaluation_interval: Duration = Field(5.0, ge=0.0, le=60.0, description=(
        "Time between evaluations of the rules (0: every sample); every sample still feeds their "
        "history. Their windows and for durations are minutes; a transition comes less than two of "
        "these intervals later (a condition is seen at the next evaluation, for and clear_for end at "
        "one). An Xid event, or a GPU going down or coming back, is evaluated at the sample it shows in."))
    rules: RulesConfig = Field(default_factory=RulesConfig)
    event_log: EventLogConfig = Field(default_factory=EventLogConfig)
    alertmanager: AlertmanagerConfig = Field(default_factory=AlertmanagerConfig)

"""One builder per document the agent serves at both doors (see the package's docstring).

Each builder takes what the agent holds (the latest snapshot, the alert engine, the capture store and
its refusal log) and the ``processes`` settings, and returns the document as JSON-ready values. The
snapshot's fields come from its own serialisation (``Snapshot.to_json``); a builder only removes what
the settings keep inside the agent:

- ``processes.export: false``: no GPU process is listed in the snapshot, and no pid leaves in a capture
  record (``pids``, ``targets``, ``target``) or a refused trigger (``pid``);
- ``processes.cmdline: false`` (the default): no command line, whatever the snapshot holds;
- ``processes.user: false``: no user name.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from gpuscope.alerts.model import AlertSource
from gpuscope.capture.refusals import RefusalLog, RefusedTrigger
from gpuscope.capture.store import CaptureStore
from gpuscope.documents.parameters import ListParameters
from gpuscope.snapshot import Snapshot

CAPTURES_PATH = "/api/v1/captures"  # a capture's "download" is this path, a slash and its id
# Why there is no snapshot document before the first tick: HTTP's 503 and the control API's UNAVAILABLE.
NO_SNAPSHOT_YET = "no snapshot yet: the first sampling tick has not finished"
_PROCESS_KEYS = ("pids", "targets", "target")  # where a capture record names processes


@dataclass(frozen=True, slots=True)
class ProcessExposure:
    """What the documents say of GPU processes: the ``processes`` settings ``export``, ``cmdline``
    and ``user``, with their defaults."""

    export: bool = True
    cmdline: bool = False
    user: bool = True


DEFAULT_PROCESSES = ProcessExposure()  # the settings' defaults


def snapshot_document(snapshot: Snapshot, processes: ProcessExposure) -> dict[str, Any]:
    """GET /api/v1/snapshot and GetSnapshot: the snapshot's serialisation, less what ``processes``
    keeps inside the agent."""
    document = snapshot.to_json()
    for gpu in document["gpus"]:
        if not processes.export:
            gpu["processes"] = []
            continue
        for process in gpu["processes"]:
            if not processes.cmdline:
                process["cmdline"] = None
            if not processes.user:
                process["user"] = None
    return document


def alerts_document(alerts: AlertSource | None) -> dict[str, Any]:
    """GET /api/v1/alerts and ListAlerts: the alerts pending or firing now. With alerting off (no
    engine) ``enabled`` is false and the list empty: not an error, so a poller needs no special case."""
    listed = [] if alerts is None else [alert.to_json() for alert in alerts.alerts()]
    return {"enabled": alerts is not None, "alerts": listed}


def captures_document(store: CaptureStore | None, refusals: RefusalLog | None, parameters: ListParameters,
                      processes: ProcessExposure, *, downloads: bool) -> dict[str, Any]:
    """GET /api/v1/captures and ListCaptures: the newest ``parameters.limit`` capture records, each
    with its ``download`` path; ``enabled`` (the agent takes captures), ``downloads`` (the HTTP port
    sends them: its web configuration authenticates every client), ``refused_count`` (refusals since
    the agent started) and, with ``include_refused``, ``refused``: the newest refused triggers."""
    listed = []
    for record in [] if store is None else store.list()[:parameters.limit]:
        entry = record.to_json()
        if not processes.export:
            for key in _PROCESS_KEYS:
                entry.pop(key, None)
        entry["download"] = f"{CAPTURES_PATH}/{record.id}"
        listed.append(entry)
    document: dict[str, Any] = {
        "enabled": store is not None, "downloads": store is not None and downloads, "captures": listed,
        "refused_count": 0 if refusals is None else refusals.total}
    if parameters.include_refused:
        recent = [] if refusals is None else refusals.recent(parameters.limit)
        document["refused"] = [_refusal(refused, processes) for refused in recent]
    return document


def encode_document(document: dict[str, Any]) -> bytes:
    """A document as UTF-8 JSON, the same bytes at both doors. A NaN or an infinity (a rule's value)
    becomes null: JSON has no literal for it."""
    try:
        return json.dumps(document, allow_nan=False).encode()
    except ValueError:
        return json.dumps(_finite(document), allow_nan=False).encode()


def _refusal(refused: RefusedTrigger, processes: ProcessExposure) -> dict[str, Any]:
    entry = refused.to_json()
    if not processes.export:
        entry.pop("pid", None)
    return entry


def _finite(obj: Any) -> Any:
    """``obj`` with NaN and infinities replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {key: _finite(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_finite(value) for value in obj]
    return obj

"""Alertmanager's webhook (payload version 4) as a capture trigger.

Central Prometheus rules fire, Alertmanager posts the group to every agent's
``POST /api/v1/alertmanager``; each agent keeps the firing alerts that name *it* (their ``instance``
label's host is one of this node's names or addresses, and its port, if any, is the agent's) and
that carry a ``gpu`` or ``uuid`` label. Anything malformed is refused whole with the reason, and
nothing is triggered.

An alert on a MIG device (the PromQL rules' MIG clauses) captures the processes on that device only,
never the whole GPU: the device its ``mig_uuid`` label names or, for the alerts that carry only a
``gpu_instance`` label (``GpuHeldIdle``, ``GpuSharedByProcesses``), the compute instances of that GPU
instance.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import psutil

from gpuscope.capture.model import CaptureError, Trigger
from gpuscope.capture.service import CaptureRequest
from gpuscope.common.json_input import JsonInputError, load_json

MAX_BODY_BYTES = 1 << 20  # Alertmanager groups are small; a larger body is not a webhook
MAX_ALERTS = 1000


class WebhookError(CaptureError, ValueError):
    """A payload that is not a valid Alertmanager v4 webhook; the message says why."""


@dataclass(frozen=True, slots=True)
class WebhookTrigger:
    alertname: str
    gpu: int | None
    uuid: str | None
    mig_uuid: str | None = None  # an alert on one MIG device: the processes on it only
    gpu_instance: int | None = None  # ... or, without mig_uuid, on one GPU instance


def parse_webhook(body: bytes, *, hosts: Collection[str], port: int | None) -> list[WebhookTrigger]:
    """The capture triggers a webhook body asks of this node. ``hosts``: its names and addresses."""
    try:
        payload = load_json(body, max_bytes=MAX_BODY_BYTES)
    except JsonInputError as err:
        raise WebhookError(f"payload: {err}") from None
    if not isinstance(payload, dict):
        raise WebhookError("the payload must be a JSON object")
    if payload.get("version") != "4":
        raise WebhookError(f"unsupported payload version {payload.get('version')!r} (expected \"4\")")
    alerts = payload.get("alerts")
    if not isinstance(alerts, list):
        raise WebhookError("'alerts' must be a list")
    if len(alerts) > MAX_ALERTS:
        raise WebhookError(f"{len(alerts)} alerts exceed the limit of {MAX_ALERTS}")
    common = _labels(payload.get("commonLabels", {}), "commonLabels")
    triggers = []
    for i, alert in enumerate(alerts):
        if not isinstance(alert, dict):
            raise WebhookError(f"alerts[{i}] must be an object")
        labels = {**common, **_labels(alert.get("labels", {}), f"alerts[{i}].labels")}
        status = alert.get("status", payload.get("status"))
        if status not in ("firing", "resolved"):
            raise WebhookError(f"alerts[{i}].status must be 'firing' or 'resolved', got {status!r}")
        if status != "firing" or not _is_this_node(labels.get("instance", ""), hosts, port):
            continue
        gpu = _small_id(labels.get("gpu"), f"alerts[{i}].labels.gpu", "GPU index")
        uuid = labels.get("uuid") or None
        if gpu is None and uuid is None:
            continue  # about this node but no GPU: nothing to capture
        instance = _small_id(labels.get("gpu_instance"), f"alerts[{i}].labels.gpu_instance",
                             "MIG GPU instance id")
        mig_uuid = labels.get("mig_uuid") or None
        triggers.append(WebhookTrigger(labels.get("alertname", "unnamed"), gpu, uuid, mig_uuid,
                                       instance if mig_uuid is None else None))
    return triggers


def _labels(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                              for k, v in value.items()):
        raise WebhookError(f"{where} must map label names to strings")
    return value


def _small_id(value: str | None, where: str, what: str) -> int | None:
    """A GPU index or a MIG GPU instance id (NVML's are small: up to 14 on an H100); None when absent."""
    if value is None or value == "":
        return None
    # isascii too: isdigit() is also true of '²' or '٣', which int() refuses or reads as another digit.
    if not (value.isascii() and value.isdigit()) or len(value) > 4:
        raise WebhookError(f"{where} must be a {what}, got {value!r}")
    return int(value)


def _split_instance(instance: str) -> tuple[str, str]:
    """(host, port) of an `instance` label; port is "" when absent."""
    if instance.startswith("["):  # [v6]:port or [v6]
        host, _, rest = instance[1:].partition("]")
        return host, rest.removeprefix(":")
    if instance.count(":") == 1:  # host:port
        host, _, port = instance.partition(":")
        return host, port
    return instance, ""  # a bare host, or a bare IPv6 address


def _is_this_node(instance: str, hosts: Collection[str], port: int | None) -> bool:
    host, port_text = _split_instance(instance)
    if not host:
        return False
    if port_text and port is not None and port_text != str(port):
        return False
    return host.lower() in {h.lower() for h in hosts}


def this_node_hosts(node_name: str | None = None) -> set[str]:
    """The names and addresses an `instance` label may use for this node."""
    hosts = {socket.gethostname(), socket.getfqdn(), "localhost"}
    if node_name:
        hosts.add(node_name)
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family in (socket.AF_INET, socket.AF_INET6):
                hosts.add(address.address.split("%", 1)[0])  # fe80::1%eth0 -> fe80::1
    return hosts


class WebhookReceiver:
    """The HTTP handler: parse, then queue one capture per trigger (the reply never waits for them)."""

    def __init__(self, submit: Callable[[CaptureRequest], object], *, hosts: Collection[str],
                 port: int | None) -> None:
        self._submit = submit
        self._hosts = frozenset(h.lower() for h in hosts)
        self.port = port  # set once the HTTP server knows its bound port

    def __call__(self, body: bytes) -> tuple[str, dict[str, Any]]:
        try:
            triggers = parse_webhook(body, hosts=self._hosts, port=self.port)
        except WebhookError as err:
            return "400 Bad Request", {"error": str(err)}
        for t in triggers:
            self._submit(CaptureRequest(Trigger("webhook", alertname=t.alertname), gpu=t.gpu, uuid=t.uuid,
                                        mig_uuid=t.mig_uuid, gpu_instance=t.gpu_instance))
        return "200 OK", {"accepted": len(triggers), "captures": [_described(t) for t in triggers]}


def _described(trigger: WebhookTrigger) -> dict[str, Any]:
    """A trigger as the reply lists it: the MIG device, where it names one."""
    out: dict[str, Any] = {"alertname": trigger.alertname, "gpu": trigger.gpu, "uuid": trigger.uuid}
    if trigger.mig_uuid is not None:
        out["mig_uuid"] = trigger.mig_uuid
    if trigger.gpu_instance is not None:
        out["gpu_instance"] = trigger.gpu_instance
    return out

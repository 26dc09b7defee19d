"""The Alertmanager webhook payload parser: this node's firing GPU alerts, or a clear refusal."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpuscope.capture.service import CaptureRequest
from gpuscope.capture.webhook import (
    MAX_BODY_BYTES,
    WebhookError,
    WebhookReceiver,
    WebhookTrigger,
    parse_webhook,
)

HOSTS = {"gpu-node-7", "10.0.0.7", "::1"}


def payload(*alerts: dict[str, Any], **top: Any) -> bytes:
    body = {"version": "4", "status": "firing", "receiver": "gpuscope", "groupLabels": {},
            "commonLabels": {}, "alerts": list(alerts), **top}
    return json.dumps(body).encode()


def alert(status: str = "firing", **labels: str) -> dict[str, Any]:
    return {"status": status, "labels": {"alertname": "GpuLowUtilization", **labels},
            "annotations": {}, "startsAt": "2026-11-22T08:00:00Z", "endsAt": "0001-01-01T00:00:00Z"}


def parse(body: bytes) -> list[WebhookTrigger]:
    return parse_webhook(body, hosts=HOSTS, port=9847)


def test_keeps_this_nodes_firing_gpu_alerts() -> None:
    body = payload(
        alert(instance="gpu-node-7:9847", gpu="2", uuid="GPU-abc"),
        alert(instance="10.0.0.7:9847", uuid="GPU-def"),
        alert(instance="[::1]:9847", gpu="0"),
        alert(instance="gpu-node-8:9847", gpu="1"),  # another node
        alert(instance="gpu-node-7:9100", gpu="1"),  # this host, another exporter
        alert("resolved", instance="gpu-node-7:9847", gpu="3"),  # resolved: nothing to capture
        alert(instance="gpu-node-7:9847"),  # no GPU named
    )
    assert parse(body) == [
        WebhookTrigger("GpuLowUtilization", 2, "GPU-abc"),
        WebhookTrigger("GpuLowUtilization", None, "GPU-def"),
        WebhookTrigger("GpuLowUtilization", 0, None),
    ]


def test_common_labels_apply_and_host_match_ignores_case() -> None:
    body = payload({"status": "firing", "labels": {"gpu": "1"}},
                   commonLabels={"alertname": "GpuThrottled", "instance": "GPU-NODE-7:9847"})
    assert parse(body) == [WebhookTrigger("GpuThrottled", 1, None)]


@pytest.mark.parametrize(("body", "reason"), [
    (b"{not json", "not JSON"),
    (b"[]", "JSON object"),
    (payload(version="3"), "version"),
    (json.dumps({"version": "4", "alerts": {}}).encode(), "'alerts' must be a list"),
    (payload("nope"), r"alerts\[0\] must be an object"),
    (payload(alert(instance="gpu-node-7:9847", gpu="../0")), r"alerts\[0\]\.labels\.gpu"),
    (payload(alert(instance="gpu-node-7:9847", gpu="0", gpu_instance="x")),
     r"alerts\[0\]\.labels\.gpu_instance must be a MIG GPU instance id"),
    (payload({"status": "firing", "labels": {"gpu": 1}}), r"alerts\[0\]\.labels must map"),
    (payload(alert("pending", instance="gpu-node-7:9847", gpu="0")), "status"),
    (b"x" * (MAX_BODY_BYTES + 1), "exceeds"),
])
def test_malformed_payloads_are_refused_with_the_reason(body: bytes, reason: str) -> None:
    with pytest.raises(WebhookError, match=reason):
        parse(body)


def test_a_bad_alert_refuses_the_whole_payload() -> None:
    # One malformed alert among good ones: nothing is triggered (all or nothing).
    body = payload(alert(instance="gpu-node-7:9847", gpu="0"), alert(instance="gpu-node-7:9847", gpu="x"))
    with pytest.raises(WebhookError):
        parse(body)


MIG = "MIG-00000002-0000-4e6f-8d2a-5c3b1a9e0f70"


def test_an_alert_on_a_mig_device_names_the_device() -> None:
    """The PromQL rules' MIG clauses: GpuLowUtilization and GpuAllocatedUnused carry the device's
    mig_uuid (and gpu_instance); GpuHeldIdle and GpuSharedByProcesses its GPU instance only."""
    here = {"instance": "gpu-node-7:9847", "gpu": "2", "uuid": "GPU-abc"}
    held = alert(**here, gpu_instance="1", mig_profile="3g.40gb", pid="9200", process="python3")
    held["labels"]["alertname"] = "GpuHeldIdle"
    body = payload(
        alert(**here, gpu_instance="1", compute_instance="0", mig_profile="3g.40gb", mig_uuid=MIG),
        held,
        alert(**here, gpu_instance=""),  # an empty label is no label (a process off MIG)
    )
    assert parse(body) == [
        WebhookTrigger("GpuLowUtilization", 2, "GPU-abc", mig_uuid=MIG),
        WebhookTrigger("GpuHeldIdle", 2, "GPU-abc", gpu_instance=1),
        WebhookTrigger("GpuLowUtilization", 2, "GPU-abc"),
    ]


def test_the_receiver_asks_for_a_capture_of_the_mig_device_only() -> None:
    asked: list[CaptureRequest] = []
    receiver = WebhookReceiver(asked.append, hosts=HOSTS, port=9847)
    here = {"instance": "gpu-node-7:9847", "gpu": "2", "uuid": "GPU-abc"}
    status, reply = receiver(payload(alert(**here, gpu_instance="1", mig_uuid=MIG),
                                     alert(**here, gpu_instance="3"), alert(**here)))
    assert status == "200 OK" and reply["accepted"] == 3
    assert [(r.gpu, r.uuid, r.mig_uuid, r.gpu_instance, r.on_mig) for r in asked] == [
        (2, "GPU-abc", MIG, None, True), (2, "GPU-abc", None, 3, True), (2, "GPU-abc", None, None, False)]
    assert reply["captures"] == [
        {"alertname": "GpuLowUtilization", "gpu": 2, "uuid": "GPU-abc", "mig_uuid": MIG},
        {"alertname": "GpuLowUtilization", "gpu": 2, "uuid": "GPU-abc", "gpu_instance": 3},
        {"alertname": "GpuLowUtilization", "gpu": 2, "uuid": "GPU-abc"},
    ]

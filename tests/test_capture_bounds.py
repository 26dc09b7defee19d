"""Captures bounded in disk and across restarts: a capture that the agent's own disk cannot take is
the agent's failure and costs no budget; the hourly budget and the cooldowns survive a restart (the
ledger in the store, or the stored captures when there is none)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from snapshots import FakeSource
from test_capture_store import Disk
from test_control_api import FakeBackend, one_gpu_snapshot

from gpuscope.capture.config import CaptureConfig, StaticTarget
from gpuscope.capture.factory import build_captures, restored_admissions
from gpuscope.capture.ledger import LEDGER_FILE, AdmissionLedger, Admissions
from gpuscope.capture.model import Trigger
from gpuscope.capture.policy import CapturePolicy
from gpuscope.capture.service import CaptureRequest, CaptureService
from gpuscope.capture.store import CaptureStore
from gpuscope.capture.targets import TargetResolver
from gpuscope.health import SourceHealth

USER = Trigger("user", user="test")
ALERT = Trigger("alert", alertname="GpuLowUtilization")


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def config(tmp_path: Path, **extra: object) -> CaptureConfig:
    return CaptureConfig.model_validate({"store": {"root": str(tmp_path / "captures")}, "hourly_budget": 3,
                                         "targets": [StaticTarget(address="127.0.0.1:1", all=True)],
                                         **extra})


def service_for(store: CaptureStore, policy: CapturePolicy, backend: FakeBackend,
                health: SourceHealth | None = None) -> CaptureService:
    return CaptureService(store=store, policy=policy,
                          resolver=TargetResolver(profiler_ports=[], static_targets=policy_targets()),
                          backends={"tsl": backend}, snapshots=FakeSource(one_gpu_snapshot()),
                          hostname="node", deadline_margin_s=5.0, health=health)


def policy_targets() -> list[StaticTarget]:
    return [StaticTarget(address="127.0.0.1:1", all=True)]


def capture(service: CaptureService, trigger: Trigger = USER) -> tuple[str, str | None]:
    record = service.submit(CaptureRequest(trigger, gpu=0, duration_s=0.1)).result(timeout=30)
    return record.outcome, record.error


def test_a_full_disk_fails_the_capture_on_the_agents_side_and_costs_no_budget(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    disk = Disk(size=1 << 30, other=(1 << 30) - 300_000)  # 300 kB free, min_free 200 kB: 100 kB of room
    store = CaptureStore(tmp_path / "captures", quota_bytes=1 << 30, min_free_bytes=200_000, free_bytes=disk)
    policy = CapturePolicy(cfg)
    health = SourceHealth()
    service = service_for(store, policy, FakeBackend(size=150_000), health)
    service.start()
    try:
        outcome, error = capture(service, ALERT)
        assert outcome == "failed" and error is not None
        assert error.startswith("the agent could not store it (not counted against the hourly budget): "
                                "the capture store's file system has")
        assert policy.budget_left() == 3 and policy.cooldown_left(0) == 0.0  # refunded
        assert health.runs()["captures"].success is False  # the agent's side failed
        assert store.list() == [] and list((store.root / ".staging").iterdir()) == []
        assert service.capture_counts() == {("alert", "failed"): 1}
        # Space freed: the next one goes through, and the worker reports healthy again.
        disk.other -= 1 << 20
        assert capture(service, ALERT)[0] == "captured"
        assert policy.budget_left() == 2 and health.runs()["captures"].success is True
    finally:
        service.stop()
        store.close()


def test_a_trace_larger_than_the_quota_is_refused_before_it_is_written(tmp_path: Path) -> None:
    store = CaptureStore(tmp_path / "captures", quota_bytes=1 << 20)
    service = service_for(store, CapturePolicy(config(tmp_path)), FakeBackend(size=(1 << 20) + 1))
    service.start()
    try:
        outcome, error = capture(service)
        assert outcome == "refused" and error is not None and "capture.store.quota_bytes" in error
        assert store.list() == [] and list((store.root / ".staging").iterdir()) == []
    finally:
        service.stop()
        store.close()


def test_the_budget_and_cooldowns_survive_a_restart(tmp_path: Path) -> None:
    ledger = AdmissionLedger(tmp_path / LEDGER_FILE)
    mono, wall = Clock(100.0), Clock(1_800_000_000.0)
    cfg = CaptureConfig.model_validate({"hourly_budget": 3, "cooldown": "15m"})
    first = CapturePolicy(cfg, clock=mono, wall_clock=wall, ledger=ledger)
    for gpu in (0, 1):
        decision = first.admit(ALERT, gpu)
        assert decision.allowed
        first.release(decision)
        mono.now += 60
        wall.now += 60
    refunded = first.admit(ALERT, 2)
    first.release(refunded, refund=True)  # nothing was attempted: not written down either
    assert first.budget_left() == 1
    saved = json.loads((tmp_path / LEDGER_FILE).read_text())
    assert saved["version"] == 1 and len(saved["started"]) == 2 and set(saved["last_on_gpu"]) == {"0", "1"}

    # A restart 5 minutes later: a new process, a new monotonic clock.
    wall.now += 300
    second = CapturePolicy(cfg, clock=Clock(7.0), wall_clock=wall, ledger=ledger, restored=ledger.load())
    assert second.budget_left() == 1
    assert 0 < second.cooldown_left(1) <= 15 * 60 - 300
    refused = second.admit(ALERT, 1)
    assert not refused.allowed and refused.code == "cooldown"
    assert second.admit(ALERT, 2).allowed

    # An hour after the first admissions, the budget is whole again (the cooldowns long over).
    wall.now += 3600
    third = CapturePolicy(cfg, clock=Clock(1.0), wall_clock=wall, ledger=ledger, restored=ledger.load())
    assert third.budget_left() == 3 and third.cooldown_left(0) == third.cooldown_left(1) == 0.0


@pytest.mark.parametrize("content", [b"{not json", b'{"version": 2}', b'{"version": 1, "started": ["x"], '
                                     b'"last_on_gpu": {}}', b'{"version": 1, "started": [], '
                                     b'"last_on_gpu": {"../0": 1}}', b"[" * 100])
def test_a_ledger_that_cannot_be_read_is_ignored(tmp_path: Path, content: bytes,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / LEDGER_FILE).write_bytes(content)
    assert AdmissionLedger(tmp_path / LEDGER_FILE).load() == Admissions()
    assert "ignoring the capture ledger" in caplog.text


def test_without_a_ledger_the_stored_captures_stand_in(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    store = CaptureStore(tmp_path / "captures", quota_bytes=1 << 30)
    service = service_for(store, CapturePolicy(cfg), FakeBackend(size=100))
    service.start()
    try:
        assert capture(service)[0] == "captured"
        assert capture(service, Trigger("alert", alertname="GpuLowUtilization"))[0] == "captured"
    finally:
        service.stop()
    admissions = restored_admissions(AdmissionLedger(store.root / LEDGER_FILE), store)
    # Only the alert's capture charged the alert captures' budget and started GPU 0's alert cooldown:
    # the person's was charged to their own budget, which a restart does not keep.
    assert len(admissions.started) == 1 and set(admissions.last_on_gpu) == {0}
    assert admissions.last_on_gpu[0] == max(admissions.started)
    restored = CapturePolicy(cfg, restored=admissions)
    assert restored.budget_left() == 2 and restored.cooldown_left(0) > 0
    store.close()


def test_a_restarted_agent_keeps_the_budget(tmp_path: Path) -> None:
    """build_captures, as the agent starts: the second start finds the first one's admissions."""
    cfg = config(tmp_path, hourly_budget=2)
    first = build_captures(cfg, snapshots=FakeSource(one_gpu_snapshot()), hostname="node")
    assert first is not None
    first.service._backends["tsl"] = FakeBackend(size=100)
    first.service.start()
    try:
        assert capture(first.service, Trigger("alert", alertname="GpuLowUtilization"))[0] == "captured"
        assert first.service.budget_remaining() == 1
    finally:
        first.service.stop()
        first.store.close()
    second = build_captures(cfg, snapshots=FakeSource(one_gpu_snapshot()), hostname="node")
    assert second is not None
    try:
        assert second.service.budget_remaining() == 1
    finally:
        second.store.close()
    assert time.time() - json.loads((cfg.store.root / LEDGER_FILE).read_text())["started"][0] < 60

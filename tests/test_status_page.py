"""The status page at / and the capture endpoints: served for real on 127.0.0.1, then the whole agent
on the simulated `demo` node rendered by a real headless Chromium (screenshot and DOM)."""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import re
import shutil
import ssl
import subprocess
import tarfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import bcrypt
import pytest
from agent_process import run_agent
from chromium import find_chromium, png_size
from pki import make_pki
from prometheus_client import CollectorRegistry
from snapshots import FakeSource, make_gpu, make_gpus, make_mig_gpu, make_process, make_snapshot, mig_uuid

from gpuscope.alerts.model import Alert, AlertState, TransitionState
from gpuscope.capture.model import CaptureRecord, CaptureTarget, TargetOutcome, Trigger
from gpuscope.capture.store import CaptureStore
from gpuscope.documents import ProcessExposure
from gpuscope.snapshot import PodContainer, SlurmJob, Snapshot, UtilizationSample
from gpuscope.web.capture_download import capture_archive
from gpuscope.web.server import AgentHttpServer
from gpuscope.web.status_page import RECENT_CAPTURES
from gpuscope.web.utilization_history import UtilizationHistory
from gpuscope.web.web_config import WebConfigWatcher

PASSWORD = "status page password"
USER = ("operator", PASSWORD)
HOSTILE = "<script>alert(1)</script>"
T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z
T0_US = 1_700_000_000_000_000  # a driver timestamp, µs


@dataclass
class FakeAlerts:
    current: list[Alert] = field(default_factory=list)

    def alerts(self) -> list[Alert]:
        return list(self.current)

    def transition_counts(self) -> Mapping[tuple[str, TransitionState], int]:
        return {}


def make_alert(name: str, gpu: int, state: AlertState, summary: str) -> Alert:
    now = time.time()
    return Alert(name=name, gpu=gpu, uuid=f"GPU-{gpu}", severity="warning", state=state,
                 hostname="gpu-node-07", active_since=now - 90,
                 firing_since=now - 30 if state == "firing" else None, values={}, summary=summary)


def add_capture(store: CaptureStore, *, gpu: int, trace: bytes, alertname: str = "GpuFrequentIdleDips",
                error: str | None = None) -> CaptureRecord:
    staging = store.begin(gpu=gpu)
    with staging.new_file("node-1", ".xplane.pb", folders=("plugins", "profile", staging.run)) as new:
        new.file.write(trace)
        relative = new.publish()
    target = CaptureTarget("tsl", 4242, "127.0.0.1:6009", "port 6009 of pid 4242")
    record = CaptureRecord(id=staging.id, trigger=Trigger("alert", alertname=alertname), gpu=gpu,
                           pids=(4242,), targets=(TargetOutcome(target, "captured", (relative,)),),
                           start=staging.begun, duration_s=2.0, bytes=0, outcome="captured", error=error,
                           hostname="node-1")
    return store.commit(staging, record)


@dataclass
class Served:
    server: AgentHttpServer
    source: FakeSource
    alerts: FakeAlerts
    history: UtilizationHistory
    store: CaptureStore | None

    def captures(self) -> CaptureStore:
        assert self.store is not None
        return self.store

    def request(self, path: str, *, user: tuple[str, str] | None = None, method: str = "GET",
                ) -> tuple[int, dict[str, str], bytes]:
        host, port = self.server.bound_address
        headers = {}
        if user is not None:
            headers["Authorization"] = "Basic " + base64.b64encode(f"{user[0]}:{user[1]}".encode()).decode()
        connection = http.client.HTTPConnection(host, port, timeout=10)
        try:
            connection.request(method, path, headers=headers)
            response = connection.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            connection.close()

    def page(self, user: tuple[str, str] | None = None) -> str:
        status, headers, body = self.request("/", user=user)
        assert status == 200, body
        assert headers["content-type"] == "text/html; charset=utf-8"
        return body.decode()


def demo_like_snapshot(**overrides: Any) -> Snapshot:
    """Four GPUs: two with pods, GPU 2 time-sliced between two pods, GPU 3 down."""
    gpus = list(make_gpus(4))
    gpus[0] = replace(gpus[0], processes=(make_process(1001, name="train-rank0", user="alice"),),
                      pods=(PodContainer("research", "llm-pretrain-0", "trainer"),))
    gpus[2] = replace(gpus[2], processes=(make_process(1201, name="train-rank2", user="alice"),
                                          make_process(1202, name="eval-job", user="bob")),
                      pods=(PodContainer("research", "eval-nightly", "eval"),
                            PodContainer("research", "llm-pretrain-2", "trainer")))
    gpus[3] = make_gpu(3, up=False, processes=())
    return make_snapshot(gpus=gpus, timestamp=time.time() - 0.5, **overrides)


@contextmanager
def serving(tmp_path: Path, *, snapshot: Snapshot | None = None, web_yml: str | None = None,
            captures: bool = True, alerting: bool = True, **options: Any) -> Iterator[Served]:
    config = None
    if web_yml is not None:
        config = tmp_path / "web.yml"
        config.write_text(web_yml)
    source = FakeSource(snapshot if snapshot is not None else demo_like_snapshot())
    alerts = FakeAlerts()
    history = UtilizationHistory()
    store = CaptureStore(tmp_path / "captures", quota_bytes=1 << 24) if captures else None
    server = AgentHttpServer("127.0.0.1:0", registry=CollectorRegistry(), source=source,
                             alerts=alerts if alerting else None, web_config=WebConfigWatcher(config),
                             captures=store, history=history, **options)
    server.start()
    try:
        yield Served(server, source, alerts, history, store)
    finally:
        server.stop()
        if store is not None:
            store.close()


def basic_auth_yml() -> str:
    return f"basic_auth_users:\n  {USER[0]}: {bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()}\n"


# -- what the page shows ----------------------------------------------------------------------------------


def test_the_page_shows_gpus_processes_alerts_captures_and_the_simulation(tmp_path: Path) -> None:
    with serving(tmp_path, simulated="demo") as served:
        served.alerts.current = [
            make_alert("GpuSharedByProcesses", 2, "firing", "GPU 2 is shared by 2 compute processes"),
            make_alert("GpuFrequentIdleDips", 1, "pending", "GPU 1 dips to idle 51 times a minute"),
        ]
        store = served.captures()
        for gpu in (1, 3):
            add_capture(store, gpu=gpu, trace=b"x" * 100, error="target answered late" if gpu == 3 else None)
        page = served.page()
    assert '<meta http-equiv="refresh" content="5">' in page
    assert 'id="simulated"' in page and "SIMULATED NODE" in page and "<code>demo</code>" in page
    assert "gpu-node-07" in page
    for index in range(4):
        assert f'id="gpu-{index}"' in page
    assert page.count('<tr class="gpu"') == 4
    assert '<span class="badge down">down</span>' in page  # GPU 3
    assert "79.6 GiB" in page and "512 W / 700 W" in page
    # Alerts: firing first, with their summaries, near the top (before the GPUs).
    assert page.index("GPU 2 is shared by 2 compute processes") < page.index("GPU 1 dips to idle 51 times")
    assert page.index('id="alerts"') < page.index('id="gpus"') < page.index('id="processes"')
    assert "1 firing, 1 pending" in page
    # Processes, with the pods the kubelet allocated (a time-sliced GPU names its candidates).
    for shown in ("train-rank0", "train-rank2", "eval-job", "alice", "bob", "1201", "llm-pretrain-0",
                  "trainer"):
        assert shown in page, shown
    assert "one of</span> eval-nightly, llm-pretrain-2" in page
    # Captures, newest first; no download links without authentication.
    assert page.count('<tr class="capture"') == 2
    assert "GpuFrequentIdleDips" in page and "target answered late" in page
    assert 'href="/api/v1/captures/' not in page
    assert "Downloads over HTTP need authentication" in page


def test_a_real_node_has_no_simulation_banner(tmp_path: Path) -> None:
    with serving(tmp_path) as served:
        page = served.page()
    assert "SIMULATED" not in page and 'id="simulated"' not in page


def test_hostile_names_are_escaped(tmp_path: Path) -> None:
    gpu = make_gpu(0, name=HOSTILE, processes=(make_process(66, name=HOSTILE, user='"><img src=x>'),),
                   pods=(PodContainer("ns<blink>", "pod<marquee>", "c&c"),))
    with serving(tmp_path, snapshot=make_snapshot(gpus=[gpu], hostname="<h1>node</h1>"),
                 simulated="<svg onload=x>") as served:
        served.alerts.current = [make_alert("GpuX", 0, "firing", f"summary {HOSTILE}")]
        store = served.captures()
        add_capture(store, gpu=0, trace=b"t", alertname=HOSTILE, error=HOSTILE)
        status, headers, body = served.request("/")
    page = body.decode()
    assert status == 200
    for raw in (HOSTILE, "<img src=x>", "<blink>", "<marquee>", "<h1>node", "<svg onload"):
        assert raw not in page, raw
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&quot;&gt;&lt;img src=x&gt;" in page and "pod&lt;marquee&gt;" in page and "c&amp;c" in page
    assert "<script" not in page.lower()
    # Defence in depth: the page may run no script and load nothing at all.
    assert "default-src 'none'" in headers["content-security-policy"]


def test_processes_hidden_when_export_is_off(tmp_path: Path) -> None:
    with serving(tmp_path, processes=ProcessExposure(export=False)) as served:
        store = served.captures()
        add_capture(store, gpu=0, trace=b"t")
        page = served.page()
        listing = json.loads(served.request("/api/v1/captures")[2])
    for hidden in ("train-rank0", "eval-job", "alice", "bob", "1001", "llm-pretrain-0", 'class="process"'):
        assert hidden not in page, hidden
    assert "processes.export: false" in page
    assert page.count('<tr class="gpu"') == 4  # the per-GPU readings stay
    (entry,) = listing["captures"]
    assert "pids" not in entry and "targets" not in entry and "4242" not in json.dumps(entry)


def test_users_hidden_when_user_lookup_is_off(tmp_path: Path) -> None:
    with serving(tmp_path, processes=ProcessExposure(user=False)) as served:
        page = served.page()
    assert "train-rank0" in page
    assert "alice" not in page and "bob" not in page and "<th>User</th>" not in page


def test_slurm_jobs_get_a_column_only_on_a_node_that_runs_them(tmp_path: Path) -> None:
    with serving(tmp_path) as served:
        assert "Slurm job" not in served.page()
    gpus = list(make_gpus(2))
    gpus[0] = replace(gpus[0], processes=(make_process(1001, slurm_job=SlurmJob("4242", "0")),
                                          make_process(1002, slurm_job=SlurmJob("4243", ""))))
    gpus[1] = replace(gpus[1], processes=(make_process(1101),))
    with serving(tmp_path, snapshot=make_snapshot(gpus=gpus, timestamp=time.time())) as served:
        page = served.page()
    assert "<th>Slurm job</th>" in page
    rows = {row.split('<td class="num">')[2].split("<")[0]: row
            for row in page.split('<tr class="process">')[1:]}
    assert '<td class="mono">4242.0</td>' in rows["1001"]
    assert '<td class="mono">4243</td>' in rows["1002"]
    assert '<td class="mono">' not in rows["1101"].split("</tr>")[0]  # no job: an empty cell


def test_sparklines_come_from_the_history(tmp_path: Path) -> None:
    with serving(tmp_path) as served:
        base = demo_like_snapshot()
        for tick, level in enumerate((0.1, 0.9, 0.5, 0.0, 1.0)):
            # Without driver samples (an older GPU): the sparkline draws the per-tick values.
            gpus = [replace(g, utilization_ratio=level, utilization_samples=()) if g.index == 0 else g
                    for g in base.gpus]
            served.history.observe(replace(base, gpus=tuple(gpus), monotonic=100.0 + tick))
        page = served.page()
    row = re.search(r'<tr class="gpu" id="gpu-0">.*?</tr>', page, re.S)
    assert row is not None
    points = re.findall(r'<polyline points="([^"]+)"', row.group(0))
    assert len(points) == 1 and len(points[0].split()) == 5
    ys = [float(p.split(",")[1]) for p in points[0].split()]
    assert ys[4] < ys[1] < ys[2] < ys[0] < ys[3]  # SVG y grows downwards: 100 % is the top
    assert "Utilization, last 1 min" in page
    gpu3 = re.search(r'<tr class="gpu" id="gpu-3">.*?</tr>', page, re.S)
    assert gpu3 is not None and "not readable" in gpu3.group(0)


def test_a_sparkline_shows_the_dips_that_the_per_tick_utilization_hides(tmp_path: Path) -> None:
    """GPU 0 reads 80 % every tick, but its driver samples (six a second, in a batch every 5 s) drop
    to 0 for one sample of each second: its sparkline reaches the bottom."""
    with serving(tmp_path) as served:
        base = demo_like_snapshot()
        for tick in range(1, 61):
            samples = ()
            if tick % 5 == 0:  # samples (k x 1/6 s) of the last 5 s, and a repeat of the batch before's last
                samples = tuple(UtilizationSample(T0_US + k * 166_667, 0.0 if k % 6 == 0 else 0.96)
                                for k in range(max(0, tick * 6 - 31), tick * 6))
            gpus = [replace(g, utilization_ratio=0.8, utilization_samples=samples) if g.index == 0 else g
                    for g in base.gpus]
            served.source.snapshot = replace(base, gpus=tuple(gpus), monotonic=100.0 + tick)
            served.history.observe(served.source.snapshot)
        page = served.page()
    row = re.search(r'<tr class="gpu" id="gpu-0">.*?</tr>', page, re.S)
    assert row is not None and '<span class="num">80%</span>' in row.group(0)
    svg = re.search(r'<svg class="spark".*?</svg>', row.group(0), re.S)
    assert svg is not None
    ys = [float(y) for y in re.findall(r'[\d.]+,([\d.]+)', svg.group(0))]
    assert max(ys) >= 26  # 0 % is y 27: the dips are drawn
    assert min(ys) <= 3  # and so is the 96 % in between
    assert len(svg.group(0)) < 3000


def test_the_history_is_a_bounded_ring_per_gpu() -> None:
    history = UtilizationHistory(points=3)
    snapshot = make_snapshot(gpus=make_gpus(2))
    for tick in range(10):
        history.observe(replace(snapshot, monotonic=float(tick)))
    series = history.series(0, snapshot.gpus[0].uuid)
    assert len(series.values) == 3 and series.span_seconds == 2.0
    assert history.series(0, "GPU-other").values == ()  # another GPU at index 0 has no past here
    history.observe(replace(snapshot, gpus=snapshot.gpus[1:], monotonic=10.0))
    assert history.series(0, snapshot.gpus[0].uuid).values == ()  # gone from NVML: forgotten


def test_the_history_keeps_each_mig_devices_busy_share() -> None:
    history = UtilizationHistory(points=3)
    mig = make_mig_gpu(0)
    first, second = mig.mig_devices

    def tick(t: float, busy: float | None, **overrides: Any) -> None:
        fields = {"mig_devices": (replace(first, busy_seconds_total=busy), second), **overrides}
        history.observe(make_snapshot(gpus=[replace(mig, **fields)], monotonic=t))

    tick(0.0, None)  # GPM: nothing yet
    tick(1.0, 10.0)  # the counter's first reading: no share yet
    tick(3.0, 11.0)  # 1 s busy over 2 s
    assert history.series(0, first.uuid).values == (None, None, 0.5)
    assert history.series(0, mig.uuid).values == (None, None, None)  # the GPU itself: no utilization
    assert history.series(1, first.uuid).values == ()  # not a device of GPU 1
    tick(4.0, None, up=False, mig_devices=())  # down: a gap
    tick(5.0, 12.0)  # back: the share starts again from this reading
    assert history.series(0, first.uuid).values == (0.5, None, None)
    history.observe(make_snapshot(gpus=[replace(mig, mig_devices=(second,))], monotonic=6.0))
    assert history.series(0, first.uuid).values == ()  # destroyed: forgotten
    assert len(history.series(0, second.uuid).values) == 3


def test_before_the_first_tick_and_with_everything_off(tmp_path: Path) -> None:
    with serving(tmp_path, captures=False, alerting=False) as served:
        served.source.snapshot = None
        page = served.page()
    assert "No snapshot yet" in page
    assert "Captures are off" in page
    with serving(tmp_path, captures=False, alerting=False) as served:
        page = served.page()
        assert "Alerting is off" in page and "Captures are off" in page
        assert json.loads(served.request("/api/v1/captures")[2]) == {"enabled": False, "downloads": False,
                                                                     "captures": [], "refused_count": 0}
        assert served.request("/api/v1/captures/20231114T221320Z-gpu0-abcdef")[0] == 404


def test_banners_for_a_stale_snapshot_and_no_nvml(tmp_path: Path) -> None:
    snapshot = make_snapshot(gpus=[], nvml_up=False, timestamp=time.time() - 42)
    with serving(tmp_path, snapshot=snapshot) as served:
        served.source.stale = True
        page = served.page()
    assert "NVML is not available" in page
    assert "The latest snapshot is 42 s old" in page
    assert "NVML lists no GPU" in page


def test_at_most_ten_recent_captures(tmp_path: Path) -> None:
    with serving(tmp_path) as served:
        store = served.captures()
        records = [add_capture(store, gpu=0, trace=b"t") for _ in range(RECENT_CAPTURES + 2)]
        page = served.page()
        listing = json.loads(served.request("/api/v1/captures")[2])
        assert served.request("/api/v1/captures?limit=0")[0] == 400
        assert served.request("/api/v1/captures?limit=abc")[0] == 400
        assert len(json.loads(served.request("/api/v1/captures?limit=3")[2])["captures"]) == 3
    assert page.count('<tr class="capture"') == RECENT_CAPTURES
    newest = sorted(records, key=lambda r: (r.start, r.id), reverse=True)
    assert [c["id"] for c in listing["captures"]] == [r.id for r in newest]
    assert f"newest {RECENT_CAPTURES} of {RECENT_CAPTURES + 2}" in page


def mig_alert(name: str, state: AlertState, device: int, summary: str) -> Alert:
    """An alert on MIG device ``device`` of the MIG GPU 2 (make_mig_gpu), labelled as the rules label it."""
    labels = {"gpu_instance": str(device + 1), "compute_instance": "0", "mig_profile": "3g.40gb",
              "mig_uuid": mig_uuid(2, device)}
    return replace(make_alert(name, 2, state, summary), labels=labels)


def test_a_mig_gpu_lists_its_mig_devices_with_their_pods_busy_share_and_alerts(tmp_path: Path) -> None:
    mig = make_mig_gpu(2)
    first, second = mig.mig_devices
    snapshot = make_snapshot(gpus=[make_gpu(0), make_gpu(1), mig], timestamp=time.time())
    with serving(tmp_path, snapshot=snapshot) as served:
        served.alerts.current = [
            mig_alert("GpuHeldIdle", "firing", 1, "GPU 2 MIG instance 3g.40gb (...) was busy 0.0%"),
            make_alert("GpuXidError", 2, "pending", "GPU 2 reported Xid 48"),
        ]
        # Busy-seconds growing 0.5 s a second on the first device, 0.25 on the second.
        for tick in range(4):
            devices = (replace(first, busy_seconds_total=100.0 + 0.5 * tick),
                       replace(second, busy_seconds_total=10.0 + 0.25 * tick))
            ticked = replace(mig, mig_devices=devices)
            gpus = (*snapshot.gpus[:2], ticked)
            served.history.observe(replace(snapshot, gpus=gpus, monotonic=100.0 + tick))
        page = served.page()
    rows = re.findall(r'<tr class="(gpu|mig)" id="([^"]+)">(.*?)</tr>', page, re.S)
    assert [(kind, ident) for kind, ident, _ in rows] == [
        ("gpu", "gpu-0"), ("gpu", "gpu-1"), ("gpu", "gpu-2"), ("mig", "gpu-2-mig-1-0"),
        ("mig", "gpu-2-mig-2-0")]
    gpu2, device_a, device_b = (row for _, _, row in rows[2:])
    assert "(MIG)" in gpu2 and "GpuXidError" in gpu2 and "GpuHeldIdle" not in gpu2
    assert f'title="{first.uuid}">&#8627; MIG 3g.40gb</span>' in device_a
    assert 'title="GPU instance 1, compute instance 0">GI 1 &middot; CI 0</span>' in device_a
    assert "pod research/finetune-7 (trainer)" in device_a
    assert ">50%</span>" in device_a and "SM 62%" in device_a  # busy share (latest tick), GPM SM activity
    assert len(re.findall(r"<polyline", device_a)) == 1
    assert "21.0 GiB / 39.5 GiB" in device_a
    assert '<td class="num procs">1</td>' in device_a  # the process on it
    # A MIG device shows its GPU's health (pending Xid: a warning, not yet critical).
    assert '<td class="health"><span class="small muted"' in device_a and "as GPU 2:" in device_a
    assert '<span class="badge health warning"' in device_a and '<span class="badge up warning"' in gpu2
    assert "GpuHeldIdle" not in device_a
    assert ">25%</span>" in device_b and "GpuHeldIdle" in device_b and "pod " not in device_b
    assert '<td class="num procs">0</td>' in device_b
    # The alerts table names the MIG device under the GPU; the process, its MIG device and its pod.
    assert "MIG 3g.40gb</span> " in page and ">GI 2 &middot; CI 0</span></div>" in page
    (process,) = re.findall(r'<tr class="process">(.*?)</tr>', page, re.S)[-1:]
    assert "MIG 3g.40gb</span>" in process and ">GI 1 &middot; CI 0</span>" in process
    assert "finetune-7" in process and "research" in process


def test_a_gpu_that_needs_a_reset_or_replacing_or_is_lost_says_so(tmp_path: Path) -> None:
    gpus = [make_gpu(0), make_gpu(1, row_remap_pending=True), make_gpu(2, row_remap_failed=True,
                                                                      row_remap_pending=True),
            make_gpu(3, up=False, processes=())]
    with serving(tmp_path, snapshot=make_snapshot(gpus=gpus, timestamp=time.time())) as served:
        page = served.page()
    rows = dict(re.findall(r'<tr class="gpu" id="gpu-(\d)">(.*?)</tr>', page, re.S))
    assert '<th>Health</th>' in page
    assert '<span class="badge up">up</span>' in rows["0"] and ">ok</span>" in rows["0"]
    assert ('<span class="badge health reset_required" title="a remapped memory row waits for a GPU '
            'reset: drain the GPU, then reset it">reset required</span>') in rows["1"]
    assert ('<span class="badge health replace" title="a memory row could not be remapped: drain the GPU '
            'and replace it">replace</span>') in rows["2"]
    assert '<td class="state"><span class="badge down">down</span></td>' in rows["3"]
    assert '<span class="badge health lost"' in rows["3"] and ">lost</span>" in rows["3"]
    # Only a GPU whose health is ok has a green "up": amber for a reset, red for a replacement.
    assert '<span class="badge up warning"' in rows["1"] and '<span class="badge up critical"' in rows["2"]
    assert '<span class="badge up">' not in rows["1"] + rows["2"]


def test_a_critical_hardware_alert_turns_a_gpu_red_and_names_itself(tmp_path: Path) -> None:
    """The Xid beside a green "up": a firing critical Xid (or hardware) alert makes the GPU's health
    critical, whatever its readings say; a usage alert does not touch its health."""
    with serving(tmp_path, snapshot=make_snapshot(gpus=[make_gpu(i) for i in range(3)],
                                                  timestamp=time.time())) as served:
        xid = replace(make_alert("GpuXidError", 1, "firing", "GPU 1 reported Xid 79"), severity="critical")
        nvlink = make_alert("GpuNvlinkErrors", 2, "firing", "GPU 2 counted NVLink errors")
        served.alerts.current = [xid, nvlink, make_alert("GpuLowUtilization", 0, "firing", "GPU 0 low")]
        page = served.page()
    rows = dict(re.findall(r'<tr class="gpu" id="gpu-(\d)">(.*?)</tr>', page, re.S))
    assert '<span class="badge up">up</span>' in rows["0"] and ">ok</span>" in rows["0"]
    assert '<span class="badge up critical"' in rows["1"]
    assert '<span class="badge health critical"' in rows["1"]
    assert '<span title="GPU 1 reported Xid 79">GpuXidError</span>' in rows["1"]
    assert '<span class="badge up warning"' in rows["2"] and '<span class="badge health warning"' in rows["2"]


# -- protection and downloads ---------------------------------------------------------------------------


def test_basic_auth_protects_the_page_and_the_capture_endpoints(tmp_path: Path) -> None:
    with serving(tmp_path, web_yml=basic_auth_yml()) as served:
        for path in ("/", "/api/v1/captures", "/api/v1/captures/20231114T221320Z-gpu0-abcdef"):
            for user in (None, (USER[0], "wrong")):
                status, headers, body = served.request(path, user=user)
                assert status == 401, (path, user)
                assert b"gpu-node-07" not in body
                assert headers["www-authenticate"] == 'Basic realm="gpuscope"'
        assert "gpu-node-07" in served.page(user=USER)
        assert served.request("/-/healthy")[0] == 200  # the probes stay open


def test_downloads_need_an_authenticating_web_configuration(tmp_path: Path) -> None:
    with serving(tmp_path) as served:
        store = served.captures()
        record = add_capture(store, gpu=0, trace=b"trace")
        status, _, body = served.request(f"/api/v1/captures/{record.id}")
        listing = json.loads(served.request("/api/v1/captures")[2])
    assert status == 403 and b"basic_auth_users" in body
    assert listing["downloads"] is False and listing["captures"][0]["id"] == record.id


def test_a_capture_downloads_as_a_tar_of_its_folder(tmp_path: Path) -> None:
    trace = os.urandom(300_000)  # several chunks, not a multiple of the tar block
    with serving(tmp_path, web_yml=basic_auth_yml()) as served:
        store = served.captures()
        record = add_capture(store, gpu=1, trace=trace)
        page = served.page(user=USER)
        status, headers, body = served.request(f"/api/v1/captures/{record.id}", user=USER)
        head_status, head_headers, head_body = served.request(f"/api/v1/captures/{record.id}", user=USER,
                                                              method="HEAD")
    assert f'href="/api/v1/captures/{record.id}"' in page
    assert status == 200, body
    assert headers["content-type"] == "application/x-tar"
    assert headers["content-disposition"] == f'attachment; filename="{record.id}.tar"'
    assert int(headers["content-length"]) == len(body) and len(body) % tarfile.RECORDSIZE == 0
    assert (head_status, head_headers["content-length"], head_body) == (200, headers["content-length"], b"")
    with tarfile.open(fileobj=io.BytesIO(body)) as archive:
        names = sorted(archive.getnames())
        assert names == sorted(f"{record.id}/{f}" for f in (*record.files, "capture.json"))
        trace_member = archive.extractfile(f"{record.id}/{record.files[0]}")
        assert trace_member is not None and trace_member.read() == trace
        stored = archive.extractfile(f"{record.id}/capture.json")
        assert stored is not None and json.loads(stored.read())["id"] == record.id


def test_a_capture_changed_while_it_is_sent_ends_the_download_short(tmp_path: Path) -> None:
    with CaptureStore(tmp_path / "captures", quota_bytes=1 << 24) as store:
        record = add_capture(store, gpu=0, trace=b"x" * 5000)
        archive = capture_archive(store, record.id)
        assert len(b"".join(archive.chunks())) == archive.length
        (store.path(record.id) / record.files[0]).write_bytes(b"MODIFIED")  # not the file that was listed
        sent = b"".join(archive.chunks())
    assert len(sent) < archive.length and b"MODIFIED" not in sent


def test_over_tls_with_required_client_certificates(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    yml = (f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
           f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca}\n")
    with serving(tmp_path, web_yml=yml) as served:
        record = add_capture(served.captures(), gpu=0, trace=b"trace over TLS")
        port = served.server.bound_address[1]
        client = ssl.create_default_context(cafile=str(pki.ca))
        client.load_cert_chain(pki.client_cert, pki.client_key)
        connection = http.client.HTTPSConnection("localhost", port, context=client, timeout=10)
        try:
            connection.request("GET", "/")
            page = connection.getresponse().read().decode()
            connection.request("GET", f"/api/v1/captures/{record.id}")
            response = connection.getresponse()
            status, body = response.status, response.read()
        finally:
            connection.close()
        anonymous = http.client.HTTPSConnection("localhost", port, timeout=10,
                                                context=ssl.create_default_context(cafile=str(pki.ca)))
        with pytest.raises((ssl.SSLError, ConnectionError)):  # no certificate, no page
            anonymous.request("GET", "/")
            anonymous.getresponse().read()
        anonymous.close()
    assert "gpu-node-07" in page and f'href="/api/v1/captures/{record.id}"' in page
    assert status == 200
    with tarfile.open(fileobj=io.BytesIO(body)) as archive:
        member = archive.extractfile(f"{record.id}/{record.files[0]}")
        assert member is not None and member.read() == b"trace over TLS"


@pytest.mark.parametrize("path, status", [
    ("/api/v1/captures/", 400),
    ("/api/v1/captures/..%2F..%2Fetc%2Fpasswd", 400),
    ("/api/v1/captures/../../etc/passwd", 400),
    ("/api/v1/captures/.lock", 400),
    ("/api/v1/captures/20231114T221320Z-gpu0-abcdef/capture.json", 400),
    ("/api/v1/captures/20231114T221320Z-gpu0-ABCDEF", 400),
    ("/api/v1/captures/20231114T221320Z-gpu0-abcdef", 404),
])
def test_capture_ids_are_checked_before_any_path(tmp_path: Path, path: str, status: int) -> None:
    with serving(tmp_path, web_yml=basic_auth_yml()) as served:
        got, headers, body = served.request(path, user=USER)
    assert got == status, body
    assert headers["content-type"] == "application/json" and "error" in json.loads(body)


def test_other_methods_on_the_capture_endpoints_are_405(tmp_path: Path) -> None:
    with serving(tmp_path, web_yml=basic_auth_yml()) as served:
        for path in ("/api/v1/captures", "/api/v1/captures/20231114T221320Z-gpu0-abcdef"):
            status, headers, _ = served.request(path, user=USER, method="DELETE")
            assert status == 405 and headers["allow"] == "GET, HEAD"


# -- the whole agent in a real browser ---------------------------------------------------------------------

# The demo node's GPU 2 is shared from the start and GPU 1 dips to idle every step: with short
# windows both alerts fire within seconds instead of a minute.
FAST_ALERTS = """\
alerting:
  rules:
    GpuSharedByProcesses: {for: 2s}
    GpuFrequentIdleDips: {window: 10s, for: 2s}
"""
BROWSER_TIMEOUT = 60


def wait_until_firing(get: Any, names: set[str], timeout: float = 45.0) -> None:
    deadline = time.monotonic() + timeout
    body = ""
    while time.monotonic() < deadline:
        status, body = get("/api/v1/alerts")
        firing = {a["alertname"] for a in json.loads(body)["alerts"] if a["state"] == "firing"}
        if status == 200 and names <= firing:
            return
        time.sleep(0.5)
    raise AssertionError(f"{sorted(names)} not all firing after {timeout} s; last /api/v1/alerts:\n{body}")


def test_headless_chromium_renders_the_demo_node(tmp_path: Path) -> None:
    chromium = find_chromium()
    config = tmp_path / "gpuscope.yaml"
    config.write_text(FAST_ALERTS)
    firing = {"GpuSharedByProcesses", "GpuFrequentIdleDips"}
    with run_agent(tmp_path, "--simulate", "demo", "--config", str(config)) as agent:
        wait_until_firing(agent.get, firing)
        url = agent.base + "/"
        browser = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                   f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1280,2000"]
        screenshot = tmp_path / "status.png"
        shot = subprocess.run([*browser, f"--screenshot={screenshot}", url], capture_output=True, text=True,
                              timeout=BROWSER_TIMEOUT, check=False)
        dom = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True,
                             timeout=BROWSER_TIMEOUT, check=False)
    assert shot.returncode == 0 and screenshot.exists(), shot.stderr[-3000:]
    data = screenshot.read_bytes()
    assert png_size(data) == (1280, 2000)
    assert len(data) > 30_000, f"a {len(data)}-byte screenshot is too small to show the page"
    assert dom.returncode == 0, dom.stderr[-3000:]
    page = dom.stdout
    assert "SIMULATED NODE" in page
    assert len(re.findall(r'<tr class="gpu" id="gpu-\d"', page)) == 4
    assert "NVIDIA H100" in page
    alerts = re.search(r'<section id="alerts">.*?</section>', page, re.S)
    assert alerts is not None, page[:3000]
    for name in firing:
        # firing, or firing and clearing when the page was taken (its own badge since it says so)
        row = rf'<tr class="alert (?:firing|clearing) [a-z]+">.*?<b>{name}</b>'
        assert re.search(row, alerts.group(0)), name
    for process in ("train-rank0", "train-rank1", "train-rank2", "eval-job", "train-rank3"):
        assert process in page
    assert "llm-pretrain-0" in page and "research" in page
    # a sparkline per GPU, fed by the sampler since the start: the envelope of the driver's samples
    assert page.count('<svg class="spark"') == 4 and page.count("<polygon") >= 4
    if os.environ.get("STATUS_PAGE_SCREENSHOT"):  # keep it to look at
        shutil.copy(screenshot, os.environ["STATUS_PAGE_SCREENSHOT"])


def test_firing_clearing_and_pending_alerts_look_apart_and_critical_ones_stand_out(tmp_path: Path) -> None:
    """A firing alert whose condition no longer holds is shown as clearing, not beside a red
    "firing" badge; a critical alert is marked so, and listed before the warnings."""
    clearing = replace(make_alert("GpuLowUtilization", 0, "firing",
                                  "clearing: its condition no longer holds (40s of the 5m needed)"),
                       clearing=True)
    xid = replace(make_alert("GpuXidError", 1, "firing", "GPU 1 reported Xid 79"), severity="critical")
    with serving(tmp_path) as served:
        served.alerts.current = [
            make_alert("GpuHeldIdle", 2, "firing", "GPU 2 is held but idle"), clearing, xid,
            make_alert("GpuFrequentIdleDips", 3, "pending", "GPU 3 dips to idle"),
        ]
        page = served.page()
    rows = re.findall(r'<tr class="alert ([a-z]+) ([a-z]+)"><td><span class="badge ([a-z]+)">', page)
    assert rows == [("firing", "critical", "firing"), ("firing", "warning", "firing"),
                    ("clearing", "warning", "clearing"), ("pending", "warning", "pending")]
    assert '<span class="severity critical">critical</span>' in page
    assert "Alerts: 2 firing, 1 clearing, 1 pending" in page
    assert ".badge.clearing{" in page and ".severity.critical{" in page


def test_inhibited_alerts_are_listed_last_under_what_mutes_them_and_not_as_gpu_badges(tmp_path: Path) -> None:
    """One idle notebook is one alert: the alerts a greater one explains are dimmed, counted apart,
    and left out of their GPU's badges."""
    held = make_alert("GpuHeldIdle", 0, "firing", "GPU 0 is held but idle")
    low = replace(make_alert("GpuLowUtilization", 0, "firing", "GPU 0 runs a job at 0.1%"),
                  inhibited_by="GpuHeldIdle")
    shared = replace(make_alert("GpuSharedByProcesses", 0, "pending", "GPU 0 has 2 processes"),
                     inhibited_by="GpuHeldIdle")
    with serving(tmp_path) as served:
        served.alerts.current = [low, shared, held]
        page = served.page()
    rows = re.findall(r'<tr class="alert ([a-z]+) [a-z]+"><td><span class="badge ([a-z]+)">[a-z]+</span></td>'
                      r"<td><b>(\w+)</b>", page)
    assert rows == [("firing", "firing", "GpuHeldIdle"), ("inhibited", "inhibited", "GpuLowUtilization"),
                    ("inhibited", "inhibited", "GpuSharedByProcesses")]
    assert "Alerts: 1 firing, 0 pending, 2 inhibited" in page
    assert "inhibited by GpuHeldIdle, which explains it (firing on its own):" in page
    gpu_row = re.search(r'<tr class="gpu" id="gpu-0".*?</tr>', page, re.S)
    assert gpu_row is not None
    assert ">GpuHeldIdle</span>" in gpu_row.group(0) and "GpuLowUtilization" not in gpu_row.group(0)


def test_an_alert_shows_what_its_capture_found_or_that_it_saw_other_minutes(tmp_path: Path) -> None:
    low = make_alert("GpuLowUtilization", 1, "firing", "GPU 1 runs a job at 12%")

    def analysed(store: CaptureStore, verdict: str) -> CaptureRecord:
        record = add_capture(store, gpu=1, trace=b"x", alertname="GpuLowUtilization")
        gain = {"before_s": 0.1, "after_s": 0.06, "share": 0.4, "assumptions": ["one loader prefetches"]}
        findings = [] if verdict == "healthy" else [{"kind": verdict, "severity": "high", "gain": gain}]
        return store.annotate(record.id, {"verdict": verdict, "headline": f"{verdict}: 40% waits",
                                          "findings": findings})

    with serving(tmp_path) as served:
        served.alerts.current = [low]
        healthy = analysed(served.captures(), "healthy")
        page = served.page()
        # The capture's id links to its row in the captures table, which holds its explanation.
        link = f'<a href="#capture-{healthy.id}">{healthy.id}</a>'
        assert f"its capture {link} saw other minutes (healthy) and does not explain it" in page
        assert f'<tr class="capture" id="capture-{healthy.id}">' in page
        assert '<div class="small headline" title="healthy: 40% waits">healthy: 40% waits</div>' in page
        found = analysed(served.captures(), "input_bound")
        page = served.page()
    # On hover: the headline, and what fixing the finding would buy (the captures table shows both).
    assert (f'<div class="small" title="input_bound: 40% waits\nfixing input_bound: 100.0 -&gt; 60.0 ms a '
            f'step (40% less), assuming one loader prefetches">its capture <a href="#capture-{found.id}">'
            f'{found.id}</a>: <b>input_bound</b></div>') in page
    assert "fixing it: 100.0 -&gt; 60.0 ms a step (40% less)</div>" in page
